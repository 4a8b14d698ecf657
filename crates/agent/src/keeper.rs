//! The keeper of an activator's listening socket: what hands the socket from an agent to the
//! next one, so that connections queued in its backlog, and those made while no agent runs, are
//! served by the next agent instead of being reset or refused.
//!
//! # Design
//! - When an activator listens, the agent starts a keeper: `cryo agent keep-listener` (this
//!   binary, [`ARGS`]) with a duplicate of the listening socket as its stdin, in a process group
//!   of its own, every signal that would end it but SIGKILL ignored. It does nothing with the
//!   socket: it only holds it open, so the socket (its backlog) outlives the agent. It watches
//!   its agent and exits [`LINGER`] after the agent's death.
//! - The activator's record (`STATE_DIR/activators.json`) names the keeper (pid, start time,
//!   pidfs inode). An agent that starts takes the socket from the keeper (`pidfd_getfd` of its
//!   fd 0, checked to be a listening socket on the recorded address), starts a keeper of its own
//!   for it and ends the old one. Where that fails (no keeper, it is gone, the fd is not that
//!   socket) the agent binds the address again, as without a keeper.
//! - Removing an activator ends its keeper, freeing the address.
//!
//! # Limitations
//! - An agent stopped on purpose leaves its sockets held for [`LINGER`]: a restart or upgrade
//!   within that loses nothing; after it the sockets close (queued connections are reset, new
//!   ones refused), as they did at once before.
//! - A keeper is an ordinary child of the agent: what kills the agent's whole cgroup or
//!   container kills it too (then the socket is bound again, its backlog lost).

use std::os::fd::{AsFd, OwnedFd};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use cryo_activator::{Addr, Listener};
use cryo_journal::ProcId;
use cryo_proc::{Pid, ProcHandle};

/// The command line (after the program) that runs a keeper.
pub const ARGS: [&str; 2] = ["agent", "keep-listener"];

/// How long a keeper holds its socket after its agent died.
pub const LINGER: Duration = Duration::from_secs(60);

/// A keeper this agent started.
#[derive(Debug)]
pub(crate) struct Keeper {
    /// Who it is (recorded for the next agent).
    pub(crate) id: ProcId,
    child: Child,
}

impl Keeper {
    /// Starts a keeper holding a duplicate of `listener`.
    pub(crate) fn start(listener: &Listener) -> std::io::Result<Keeper> {
        let fd = match listener {
            Listener::Tcp(l) => l.as_fd().try_clone_to_owned()?,
            Listener::Unix(l) => l.as_fd().try_clone_to_owned()?,
        };
        let me = ProcId::of(Pid::try_from(std::process::id()).unwrap_or(Pid::MAX))
            .map_err(std::io::Error::other)?;
        let mut c = Command::new("/proc/self/exe");
        c.args(ARGS)
            .arg("--agent")
            .arg(format!("{}:{}", me.pid, me.start_time))
            .stdin(Stdio::from(fd))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        std::os::unix::process::CommandExt::process_group(&mut c, 0);
        // Blocked until it ignores them (`keep_listener`): no signal kills it while it starts.
        crate::sys::exec_with_signals_blocked(&mut c);
        let child = c.spawn()?;
        let id = ProcId::of(child.id() as Pid).map_err(std::io::Error::other)?;
        Ok(Keeper { id, child })
    }

    /// Ends it (the socket closes with it unless an agent listens on it).
    pub(crate) fn end(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Takes the listening socket held by `keeper` (another agent's), if it is still a listening
/// socket on `addr`; then ends that keeper. Called within the activators' runtime.
pub(crate) fn take_over(keeper: ProcId, addr: &Addr) -> std::io::Result<Listener> {
    let h = keeper.open().map_err(std::io::Error::other)?;
    let fd: OwnedFd = h.get_fd(0).map_err(std::io::Error::other)?;
    if !rustix::net::sockopt::get_socket_acceptconn(&fd)? {
        return Err(std::io::Error::other(
            "the keeper's fd 0 is not a listening socket",
        ));
    }
    let listener = match addr {
        Addr::Tcp(_) => {
            let l = std::net::TcpListener::from(fd);
            l.set_nonblocking(true)?;
            Listener::Tcp(tokio::net::TcpListener::from_std(l)?)
        }
        Addr::Unix(_) => {
            let l = std::os::unix::net::UnixListener::from(fd);
            l.set_nonblocking(true)?;
            Listener::Unix(tokio::net::UnixListener::from_std(l)?)
        }
    };
    let bound = listener.local_addr()?;
    if bound != *addr {
        return Err(std::io::Error::other(format!(
            "the keeper holds a socket on {bound}, not on {addr}"
        )));
    }
    // Its socket is ours now; the keeper of the dead agent goes (the one we start replaces it).
    let _ = h.signal(nix::sys::signal::Signal::SIGKILL);
    Ok(listener)
}

/// `cryo agent keep-listener --agent PID:START`: holds its stdin (a listening socket) until
/// [`LINGER`] after the agent `(pid, start time)` is gone. Every signal whose default action
/// ends or stops a process is ignored (blocked from its exec until then), as the pin holder
/// ignores them
/// ([`cryo_holder::ignore_killing_signals`]): a keeper killed by a stray SIGALRM, SIGXCPU or
/// real-time signal would take the queued connections of the next agent with it. Its agent (or
/// the next one) ends it with SIGKILL.
pub fn keep_listener(agent: (Pid, u64)) -> std::io::Result<()> {
    if let Some((sig, e)) = cryo_holder::ignore_killing_signals().into_iter().next() {
        return Err(std::io::Error::new(
            e.kind(),
            format!("cannot ignore signal {sig}: {e}"),
        ));
    }
    // Started with every signal blocked ([`Keeper::start`]); those sent meanwhile were
    // discarded by the SIG_IGN above.
    nix::sys::signal::SigSet::all()
        .thread_unblock()
        .map_err(std::io::Error::from)?;
    if let Ok(h) = ProcHandle::open_expected(agent.0, agent.1) {
        // Blocks on the agent's pidfd (readable at its exit), no polling interval.
        while !h.wait_exit(Duration::from_secs(3600)) {}
    }
    std::thread::sleep(LINGER);
    Ok(())
}
