//! Every signal whose default action would kill the agent is caught: SIGTERM and SIGINT ask for
//! a clean shutdown (refused while pins are held), every other one is logged with its sender
//! and ignored. SIGKILL cannot be caught (the holder keeps the pins then); a fault of the agent
//! itself (a kernel-sent SIGSEGV, SIGBUS...) still kills it, since returning would fault again.

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};

use nix::sys::signal::Signal;

/// What a caught signal asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Caught {
    /// SIGTERM or SIGINT: shut down cleanly.
    Shutdown {
        /// The signal.
        signal: i32,
        /// Who sent it (0: the kernel or unknown).
        from: i32,
    },
    /// Anything else: logged, nothing more.
    Ignored {
        /// The signal.
        signal: i32,
        /// Who sent it.
        from: i32,
    },
}

/// The signals the agent catches: every one whose default action terminates the process or
/// dumps core (signal(7)), real-time ones included, except SIGKILL (cannot be caught) and the
/// two real-time signals glibc keeps for itself.
pub fn fatal_by_default() -> Vec<libc::c_int> {
    let mut v = vec![
        libc::SIGHUP,
        libc::SIGINT,
        libc::SIGQUIT,
        libc::SIGILL,
        libc::SIGTRAP,
        libc::SIGABRT,
        libc::SIGBUS,
        libc::SIGFPE,
        libc::SIGUSR1,
        libc::SIGSEGV,
        libc::SIGUSR2,
        libc::SIGPIPE,
        libc::SIGALRM,
        libc::SIGTERM,
        libc::SIGSTKFLT,
        libc::SIGXCPU,
        libc::SIGXFSZ,
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGIO,
        libc::SIGPWR,
        libc::SIGSYS,
    ];
    v.extend(libc::SIGRTMIN()..=libc::SIGRTMAX());
    v
}

/// The name of a signal (`SIGQUIT`, `SIGRT3`).
pub fn name(sig: i32) -> String {
    match Signal::try_from(sig) {
        Ok(s) => s.as_str().to_string(),
        Err(_) if sig >= libc::SIGRTMIN() => format!("SIGRTMIN+{}", sig - libc::SIGRTMIN()),
        Err(_) => format!("signal {sig}"),
    }
}

/// Catches [`fatal_by_default`] and calls `on` for each one caught, on a thread of its own.
pub fn catch(on: impl Fn(Caught) + Send + 'static) -> std::io::Result<()> {
    let (rx, tx) = rustix::pipe::pipe_with(
        rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
    )?;
    // The reading end blocks; only the handler's end must not.
    rustix::fs::fcntl_setfl(&rx, rustix::fs::OFlags::empty())?;
    crate::sys::catch_signals(&fatal_by_default(), tx.as_raw_fd())?;
    // The writing end lives as long as the process: the handler may run at any moment.
    std::mem::forget(tx);
    std::thread::Builder::new()
        .name("cryod-signals".into())
        .spawn(move || read_loop(rx, on))?;
    Ok(())
}

fn read_loop(rx: OwnedFd, on: impl Fn(Caught)) {
    let mut pipe = std::fs::File::from(rx);
    let mut buf = [0u8; crate::sys::RECORD];
    while pipe.read_exact(&mut buf).is_ok() {
        let field = |i: usize| {
            let mut b = [0u8; 4];
            b.copy_from_slice(&buf[i * 4..i * 4 + 4]);
            i32::from_ne_bytes(b)
        };
        let (signal, from) = (field(0), field(1));
        on(if signal == libc::SIGTERM || signal == libc::SIGINT {
            Caught::Shutdown { signal, from }
        } else {
            Caught::Ignored { signal, from }
        });
    }
}
