#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The pin holder as a process (root): it holds what it acknowledged until a release names the
//! GPU, whatever clients do, whatever signal it gets, and across a handover to a new holder.
//!
//! The "context" of these tests is a pipe: the test keeps the read end and hands the write end
//! to the holder, closing its own. Once every write end is closed the read end reports `POLLHUP`,
//! and that never goes away (nobody can open a new write end of an anonymous pipe), so one look
//! at the end of a test proves that at no instant before was the write end closed by everyone:
//! exactly the property of a pinned driver fd (the driver tears the context down at the last
//! close).

use std::io::{BufRead, BufReader};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use cryo_holder::proto::{self, Reply, Request};
use cryo_holder::{ClientError, HeldPin, HolderClient, HolderInfo, PinMeta, Refusal};
use cryo_journal::ProcId;
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;
use cryo_testkit::{eventually, PATIENCE};

const GPU_A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000001";
const GPU_B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000002";

fn testee() -> &'static str {
    env!("CARGO_BIN_EXE_cryo-holder-testee")
}

fn gpu(s: &str) -> FencedGpu {
    s.parse().unwrap()
}

/// A holder process for one test; on drop asked to exit, and SIGKILLed if it holds pins.
struct Holder {
    state: StateDir,
    child: Option<Child>,
    pid: i32,
    /// With `pid`, its identity: the drop never signals a process that reused the pid.
    start_time: u64,
    _dir: Option<tempfile::TempDir>,
}

impl Holder {
    fn start() -> Holder {
        let dir = tempfile::Builder::new()
            .prefix("cryo-holder-test-")
            .tempdir()
            .unwrap();
        let state = StateDir::new(dir.path().join("state"));
        let mut h = Holder::start_at(&state, &[]);
        h._dir = Some(dir);
        h
    }

    /// `cryo-holder-testee serve STATE EXTRA...` in the foreground, once it serves.
    fn start_at(state: &StateDir, extra: &[&str]) -> Holder {
        let mut child = Command::new(testee())
            .arg("serve")
            .arg(state.root())
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let info: HolderInfo = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("holder did not start ({e}): {line:?}"));
        Holder {
            state: state.clone(),
            pid: info.id.pid,
            start_time: info.id.start_time,
            child: Some(child),
            _dir: None,
        }
    }

    fn client(&self) -> HolderClient {
        HolderClient::new(&self.state)
    }

    fn session(&self) -> cryo_holder::Session {
        self.client().connect().unwrap()
    }

    fn inventory(&self) -> (HolderInfo, Vec<HeldPin>) {
        self.session().inventory().unwrap()
    }
}

impl Drop for Holder {
    fn drop(&mut self) {
        let asked = HolderClient::new(&self.state)
            .connect()
            .and_then(|mut s| s.exit());
        if asked.is_err() {
            if let Ok(h) = cryo_proc::ProcHandle::open_expected(self.pid, self.start_time) {
                let _ = h.signal(cryo_proc::Signal::SIGKILL);
            }
        }
        if let Some(mut c) = self.child.take() {
            let _ = c.wait();
        }
    }
}

/// A stand-in for a driver fd: the test keeps the read end and watches it.
struct Context {
    read: OwnedFd,
    write: Option<OwnedFd>,
}

impl Context {
    fn new() -> Context {
        let (read, write) = rustix::pipe::pipe().unwrap();
        Context {
            read,
            write: Some(write),
        }
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.write.as_ref().unwrap().as_fd()
    }

    /// Closes the test's own write end (the holder's copy is the only one left).
    fn let_go(&mut self) {
        self.write = None;
    }

    /// Whether every write end was closed at some instant (sticky).
    fn torn_down(&self) -> bool {
        let mut fds = [rustix::event::PollFd::new(
            &self.read,
            rustix::event::PollFlags::IN,
        )];
        rustix::event::poll(&mut fds, 0).unwrap();
        fds[0].revents().contains(rustix::event::PollFlags::HUP)
    }
}

fn meta(pid: i32, gpus: &[&str], fds: usize) -> PinMeta {
    PinMeta {
        pid: ProcId::new(pid, 1000 + pid as u64),
        gpus: gpus.iter().map(|g| gpu(g)).collect(),
        fds: (0..fds as i32).map(|n| n + 3).collect(),
        cause: "killed by SIGKILL".into(),
        from: "holder test".into(),
    }
}

/// Hands `n` contexts of one dead process to the holder and lets go of the test's copies.
fn pin(h: &Holder, pid: i32, gpus: &[&str], n: usize) -> (HeldPin, Vec<Context>) {
    let mut ctxs: Vec<Context> = (0..n).map(|_| Context::new()).collect();
    let fds: Vec<BorrowedFd<'_>> = ctxs.iter().map(Context::fd).collect();
    let held = h.session().hold(&meta(pid, gpus, n), &fds).unwrap();
    drop(fds);
    ctxs.iter_mut().for_each(Context::let_go);
    (held, ctxs)
}

fn alive(ctxs: &[Context]) -> bool {
    ctxs.iter().all(|c| !c.torn_down())
}

#[test]
fn holds_until_its_gpu_is_released_and_never_because_of_a_client() {
    let h = Holder::start();
    let (a, ctx_a) = pin(&h, 100, &[GPU_A], 2);
    let (b, ctx_b) = pin(&h, 200, &[GPU_B], 1);
    assert_eq!(a.held, 2);
    assert_eq!(a.meta.fds, vec![3, 4]);
    let (info, pins) = h.inventory();
    assert_eq!(info.id.pid, h.pid);
    assert_eq!(info.pins, 2);
    assert_eq!(pins, vec![a.clone(), b.clone()]);
    assert!(alive(&ctx_a) && alive(&ctx_b));

    // A client that sends a hold and goes away without reading the acknowledgement (an agent
    // SIGKILLed after the send): the fds are held all the same.
    let mut c = Context::new();
    let s = h.session();
    s.send_hold(&meta(300, &[GPU_A], 1), &[c.fd()]).unwrap();
    drop(s);
    c.let_go();
    let pins = eventually(PATIENCE, "the abandoned hold in the inventory", || {
        let pins = h.inventory().1;
        (pins.len() == 3).then_some(pins)
    });
    assert_eq!(pins[2].meta.pid.pid, 300);
    assert!(!c.torn_down());

    // Releasing a GPU that holds nothing closes nothing.
    let err = h.session().release(&FencedGpu::Unknown).unwrap_err();
    assert!(
        matches!(err, ClientError::Refused(Refusal::NotHeld { .. })),
        "{err}"
    );
    assert!(alive(&ctx_a) && alive(&ctx_b) && !c.torn_down());

    // A release closes exactly the pins on its GPU.
    let released = h.session().release(&gpu(GPU_A)).unwrap();
    assert_eq!(
        released.iter().map(|p| p.meta.pid.pid).collect::<Vec<_>>(),
        vec![100, 300]
    );
    assert!(ctx_a.iter().all(Context::torn_down) && c.torn_down());
    assert!(alive(&ctx_b));
    assert_eq!(h.inventory().1, vec![b]);

    // It refuses to exit while it holds pins.
    let err = h.session().exit().unwrap_err();
    assert!(
        matches!(err, ClientError::Refused(Refusal::HoldsPins { pins: 1 })),
        "{err}"
    );
    assert!(alive(&ctx_b));
    h.session().release(&gpu(GPU_B)).unwrap();
    assert!(ctx_b[0].torn_down());
}

#[test]
fn fds_that_come_with_an_unreadable_request_are_held_on_the_unknown_gpu() {
    let h = Holder::start();
    let mut s = h.session();
    let mut ctxs = vec![Context::new(), Context::new(), Context::new()];
    // A request of a newer protocol (or garbage), and an inventory with fds attached.
    s.send(
        &serde_json::json!({"request": "teleport", "pin": 1}),
        &[ctxs[0].fd()],
    )
    .unwrap();
    match s.recv().unwrap() {
        Reply::Refused {
            refusal: Refusal::BadRequest { kept_fds, .. },
        } => assert_eq!(kept_fds, 1),
        other => panic!("{other:?}"),
    }
    s.send(&Request::Inventory, &[ctxs[1].fd()]).unwrap();
    match s.recv().unwrap() {
        Reply::Refused {
            refusal: Refusal::BadRequest { kept_fds, .. },
        } => assert_eq!(kept_fds, 1),
        other => panic!("{other:?}"),
    }
    // A hold without fds is refused and holds nothing.
    s.send(
        &Request::Hold {
            pin: meta(9, &[GPU_A], 1),
        },
        &[],
    )
    .unwrap();
    assert_eq!(
        s.recv().unwrap(),
        Reply::Refused {
            refusal: Refusal::NoFds
        }
    );
    // The connection is still usable after all that.
    let held = s.hold(&meta(7, &[GPU_B], 1), &[ctxs[2].fd()]).unwrap();
    assert_eq!(held.meta.pid.pid, 7);
    drop(s);
    ctxs.iter_mut().for_each(Context::let_go);
    let pins = h.inventory().1;
    let unknown: Vec<&HeldPin> = pins.iter().filter(|p| p.on(&FencedGpu::Unknown)).collect();
    // Each stray message is a pin of its own, with its own cause.
    assert_eq!(unknown.len(), 2, "{pins:?}");
    assert!(unknown.iter().all(|p| p.held == 1), "{pins:?}");
    assert!(alive(&ctxs));
    h.session().release(&FencedGpu::Unknown).unwrap();
    assert!(ctxs[0].torn_down() && ctxs[1].torn_down() && !ctxs[2].torn_down());
    h.session().release(&gpu(GPU_B)).unwrap();
}

#[test]
fn a_pin_of_more_fds_than_one_message_carries_arrives_whole() {
    let h = Holder::start();
    let n = proto::MAX_FDS * 2 + 7;
    let (held, ctxs) = pin(&h, 42, &[GPU_A], n);
    assert_eq!(held.held, n);
    assert_eq!(held.meta.fds.len(), n);
    assert_eq!(h.inventory().1.len(), 1);
    assert!(alive(&ctxs));
    assert_eq!(h.session().release(&gpu(GPU_A)).unwrap()[0].held, n);
    assert!(ctxs.iter().all(Context::torn_down));
}

#[test]
fn every_signal_that_kills_by_default_is_ignored() {
    let h = Holder::start();
    let (_, ctxs) = pin(&h, 1, &[GPU_A], 1);
    let signals = cryo_holder::killing_signals();
    for named in [
        libc::SIGHUP,
        libc::SIGINT,
        libc::SIGQUIT,
        libc::SIGTERM,
        libc::SIGUSR1,
        libc::SIGUSR2,
        libc::SIGALRM,
        libc::SIGPIPE,
        libc::SIGXCPU,
        libc::SIGXFSZ,
        libc::SIGVTALRM,
        libc::SIGPROF,
        libc::SIGIO,
        libc::SIGPWR,
        libc::SIGSYS,
        libc::SIGABRT,
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGTSTP,
        libc::SIGTTIN,
        libc::SIGTTOU,
        libc::SIGRTMIN(),
        libc::SIGRTMAX(),
    ] {
        assert!(signals.contains(&named), "{named} is not in the list");
    }
    let status = cryo_proc::status(h.pid).unwrap();
    for &sig in &signals {
        assert!(
            status.sig_ignored & (1u64 << (sig - 1)) != 0,
            "signal {sig} is not ignored by the holder"
        );
    }
    for &sig in &signals {
        // SAFETY: kill(2) takes two integers; no memory is involved.
        let ret = unsafe { libc::kill(h.pid, sig) };
        assert_eq!(ret, 0, "kill -{sig}");
        // A signal whose action kills ends the whole process before kill(2) returns; the
        // holder answering afterwards is the proof it did not.
        let (info, pins) = h.inventory();
        assert_eq!(info.id.pid, h.pid, "after signal {sig}");
        assert_eq!(pins.len(), 1, "after signal {sig}");
        assert!(alive(&ctxs), "after signal {sig}");
    }
    h.session().release(&gpu(GPU_A)).unwrap();
}

#[test]
fn only_root_gets_an_answer() {
    let h = Holder::start();
    let (_, ctxs) = pin(&h, 1, &[GPU_A], 1);
    let run = || {
        let out = Command::new(testee())
            .args(["connect-as", "65534"])
            .arg(h.state.root())
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    // The socket is 0600 in a directory of root's: the kernel refuses first.
    let denied = run();
    assert!(
        denied.contains("Permission denied") || denied.contains("permission denied"),
        "{denied}"
    );
    // Opened up by mistake: the holder's own check (peer credentials) refuses.
    use std::os::unix::fs::PermissionsExt;
    // Only the test's own directories (the state directory and the temporary one above it).
    let state = h.state.root();
    for p in [state, state.parent().unwrap()] {
        std::fs::set_permissions(p, std::fs::Permissions::from_mode(0o755)).unwrap();
    }
    std::fs::set_permissions(
        h.state.pin_holder_socket(),
        std::fs::Permissions::from_mode(0o666),
    )
    .unwrap();
    let refused = run();
    assert!(refused.contains("only root"), "{refused}");
    assert!(alive(&ctxs));
    assert_eq!(h.inventory().1.len(), 1);
    h.session().release(&gpu(GPU_A)).unwrap();
}

#[test]
fn a_second_holder_on_the_same_state_directory_refuses_to_start() {
    let h = Holder::start();
    let out = Command::new(testee())
        .arg("serve")
        .arg(h.state.root())
        .output()
        .unwrap();
    assert_eq!(
        out.status.code(),
        Some(launch_already()),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(h.inventory().0.id.pid, h.pid);
}

fn launch_already() -> i32 {
    cryo_holder::launch::EXIT_ALREADY_RUNNING
}

#[test]
fn a_new_holder_takes_every_pin_over_before_the_old_one_exits() {
    let old = Holder::start();
    let (a, ctx_a) = pin(&old, 100, &[GPU_A], 3);
    let (b, ctx_b) = pin(&old, 200, &[GPU_B, GPU_A], proto::MAX_FDS + 1);
    let old_pid = old.pid;
    let old_handle = cryo_proc::ProcHandle::open(old_pid).unwrap();
    let new = Holder::start_at(&old.state, &["--take-over"]);
    assert_ne!(new.pid, old_pid);
    assert!(
        old_handle.wait_exit(PATIENCE),
        "the old holder did not exit after handing over"
    );
    let (info, pins) = new.inventory();
    assert_eq!(info.id.pid, new.pid, "the socket is the new holder's");
    assert_eq!(pins, vec![a, b], "same pins, same ids, same times");
    assert!(
        alive(&ctx_a) && alive(&ctx_b),
        "a context was closed during the handover"
    );
    // The old one is gone; the new one holds and releases.
    let mut old = old;
    if let Some(mut c) = old.child.take() {
        assert!(c.wait().unwrap().success());
    }
    let (c, ctx_c) = pin(&new, 300, &[GPU_B], 1);
    assert_eq!(c.id, 3, "ids continue after the handed-over ones");
    new.session().release(&gpu(GPU_A)).unwrap();
    assert!(ctx_a.iter().chain(&ctx_b).all(Context::torn_down));
    assert!(alive(&ctx_c));
    new.session().release(&gpu(GPU_B)).unwrap();
    drop(old);
}

#[test]
fn a_handover_to_a_holder_that_dies_keeps_everything_with_the_old_one() {
    let old = Holder::start();
    let (a, ctx_a) = pin(&old, 100, &[GPU_A], 2);
    // A "new holder" that asks for the pins, takes them, and goes away without acknowledging.
    {
        let mut s = old.session();
        s.send(&Request::HandOver, &[]).unwrap();
        let mut got = Vec::new();
        loop {
            match s.recv_raw().unwrap().unwrap() {
                (Reply::Handing { pin }, fds) => got.push((pin, fds)),
                (Reply::HandedAll { pins }, _) => {
                    assert_eq!(pins, 1);
                    break;
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got[0].1.len(), 2);
    }
    // Releases wait for a handover; once it failed, the old holder answers as before.
    let pins = eventually(PATIENCE, "the old holder to serve again", || {
        let mut s = old.session();
        match s.release(&FencedGpu::Unknown) {
            Err(ClientError::Refused(Refusal::NotHeld { .. })) => Some(s.inventory().unwrap().1),
            _ => None,
        }
    });
    assert_eq!(pins, vec![a]);
    assert!(alive(&ctx_a));
    old.session().release(&gpu(GPU_A)).unwrap();
}

#[test]
fn detached_it_leads_its_own_session_and_is_not_our_child() {
    let dir = tempfile::tempdir().unwrap();
    let state = StateDir::new(dir.path().join("state"));
    let out = Command::new(testee())
        .arg("serve")
        .arg(state.root())
        .arg("--detach")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: HolderInfo = serde_json::from_slice(&out.stdout).unwrap();
    let pid = info.id.pid;
    let h = Holder {
        state: state.clone(),
        child: None,
        pid,
        start_time: info.id.start_time,
        _dir: None,
    };
    let stat = cryo_proc::stat(pid).unwrap();
    assert_eq!(stat.session, pid, "it leads a session of its own");
    assert_ne!(stat.ppid, std::process::id() as i32);
    assert!(std::fs::read_to_string(state.pin_holder_log())
        .unwrap()
        .contains("holding pins for"));
    // A second detached start finds it running.
    let again = Command::new(testee())
        .arg("serve")
        .arg(state.root())
        .arg("--detach")
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(launch_already()));
    // ensure() adopts it.
    let adopted = cryo_holder::ensure(&state, Command::new("false")).unwrap();
    assert_eq!(adopted, cryo_holder::Adoption::Adopted(h.inventory().0));
    drop(h);
    assert!(cryo_proc::ProcHandle::open(pid).map_or(true, |p| p.wait_exit(PATIENCE)));
    // ensure() starts one when none runs.
    let mut launch = Command::new(testee());
    launch.arg("serve").arg(state.root()).arg("--detach");
    let started = cryo_holder::ensure(&state, launch).unwrap();
    let cryo_holder::Adoption::Started(info) = started else {
        panic!("{started:?}")
    };
    drop(Holder {
        state,
        child: None,
        pid: info.id.pid,
        start_time: info.id.start_time,
        _dir: None,
    });
}

/// A holder that is exiting: it holds `pins.lock`, takes the next connection and closes it
/// without a greeting (the connection was queued when it exited), then lets go of the socket and
/// the lock. An agent starting at that instant must wait it out and start a new holder, not fail.
#[test]
fn ensure_waits_out_a_holder_that_is_exiting() {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let dir = tempfile::tempdir().unwrap();
    let state = StateDir::new(dir.path().join("state"));
    std::fs::create_dir_all(state.root()).unwrap();
    let lock = std::fs::File::create(state.pin_holder_lock()).unwrap();
    rustix::fs::flock(&lock, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let listener = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    let path = state.pin_holder_socket();
    rustix::net::bind_unix(&listener, &SocketAddrUnix::new(&path).unwrap()).unwrap();
    rustix::net::listen(&listener, 8).unwrap();
    let exiting = std::thread::spawn(move || {
        let conn = rustix::net::accept(&listener).unwrap();
        drop(conn);
        std::fs::remove_file(&path).unwrap();
        drop(listener);
        drop(lock);
    });
    let mut launch = Command::new(testee());
    launch.arg("serve").arg(state.root()).arg("--detach");
    let started = cryo_holder::ensure(&state, launch).unwrap();
    exiting.join().unwrap();
    let cryo_holder::Adoption::Started(info) = started else {
        panic!("{started:?}")
    };
    let h = Holder {
        state,
        child: None,
        pid: info.id.pid,
        start_time: info.id.start_time,
        _dir: None,
    };
    assert_eq!(h.inventory().0.id, info.id, "the new holder answers");
}

/// The test's own cgroup tree root and a unique cgroup name under it.
fn unique_cgroup() -> (PathBuf, String) {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    (
        PathBuf::from("/sys/fs/cgroup"),
        format!("cryo-pins-test-{}-{nanos}", std::process::id()),
    )
}

#[test]
fn in_a_cgroup_of_its_own_it_survives_the_killing_of_its_starters_cgroup() {
    // The starter (an agent in a container) lives in a cgroup that a restart kills whole: a v1
    // memory cgroup here (what this machine has; the holder moves on every hierarchy).
    let starter = cryo_testkit::cgroup::TestCgroup::new("holder-starter", 1 << 30);
    let dir = tempfile::tempdir().unwrap();
    let state = StateDir::new(dir.path().join("state"));
    let (root, name) = unique_cgroup();
    let spec = format!("{}:{name}", root.display());
    // The starter joins its cgroup, then execs: everything it starts starts there.
    let mut cmd = Command::new("sh");
    cmd.arg("-c")
        .arg(r#"echo $$ > "$1" && shift && exec "$@""#)
        .arg("sh")
        .arg(starter.path().join("cgroup.procs"))
        .arg(testee())
        .arg("serve")
        .arg(state.root())
        .args(["--detach", "--cgroup", &spec])
        .stdin(Stdio::null());
    let out = cmd.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let info: HolderInfo = serde_json::from_slice(&out.stdout).unwrap();
    let h = Holder {
        state: state.clone(),
        child: None,
        pid: info.id.pid,
        start_time: info.id.start_time,
        _dir: None,
    };
    assert!(info.cgroup.starts_with("moved to"), "{}", info.cgroup);
    let cgroups = std::fs::read_to_string(format!("/proc/{}/cgroup", h.pid)).unwrap();
    assert!(
        !cgroups.contains(starter.path().file_name().unwrap().to_str().unwrap()),
        "{cgroups}"
    );
    assert!(cgroups.contains(&name), "{cgroups}");
    let (_, ctxs) = pin(&h, 1, &[GPU_A], 1);
    // A container restart: every process of the starter's cgroup is SIGKILLed.
    for pid in cryo_proc::cgroup_procs(starter.path()).unwrap() {
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(pid),
            nix::sys::signal::Signal::SIGKILL,
        );
    }
    assert_eq!(h.inventory().1.len(), 1);
    assert!(alive(&ctxs));
    h.session().release(&gpu(GPU_A)).unwrap();
    let pid = h.pid;
    drop(h);
    assert!(cryo_proc::ProcHandle::open(pid).map_or(true, |p| p.wait_exit(PATIENCE)));
    for entry in std::fs::read_dir(&root).unwrap().flatten() {
        let _ = std::fs::remove_dir(entry.path().join(&name));
    }
    let _ = std::fs::remove_dir(root.join(&name));
}
