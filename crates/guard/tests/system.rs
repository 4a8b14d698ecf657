#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The guard's process-level behaviour: its own death, memcg OOM kills, oom_score_adj, PSI.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use common::{testee, Ev, Lines, Recorder, Victim};
use cryo_guard::memory::{CgroupVersion, MemoryCgroup, PressureSource, Psi, PsiTrigger, Stall};
use cryo_guard::{ExitCause, Tracer};
use cryo_proc::{OomAdjError, ProcHandle};
use cryo_testkit::cgroup::TestCgroup;

/// A minimal guard in its own process (`cryo-guard-testee guard PID`), our direct child.
struct GuardProcess {
    child: std::process::Child,
    lines: Lines,
}

impl GuardProcess {
    fn start(pid: i32, hold: bool) -> Self {
        let mut cmd = Command::new(testee());
        cmd.args(["guard", &pid.to_string()]);
        if hold {
            cmd.arg("hold");
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let lines = Lines::new(child.stdout.take().unwrap());
        lines.expect("attached");
        Self { child, lines }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        let status = self.child.wait().unwrap();
        assert!(!status.success());
    }
}

#[test]
fn killed_guard_leaves_its_tracee_running() {
    let mut v = Victim::spawn();
    let guard = GuardProcess::start(v.pid, false);
    let guard_pid = i32::try_from(guard.child.id()).unwrap();
    for tid in v.pidfd.tasks().unwrap() {
        let tracer = cryo_proc::status(tid).unwrap().tracer_pid;
        assert_ne!(tracer, 0);
        assert_eq!(cryo_proc::status(tracer).unwrap().tgid, guard_pid);
    }
    guard.kill();
    // The guard is reaped, so its exit (and the kernel's detach of its tracees) is complete.
    for tid in v.pidfd.tasks().unwrap() {
        assert_eq!(cryo_proc::status(tid).unwrap().tracer_pid, 0);
    }
    v.ping();
    v.signal(libc::SIGUSR1);
    v.lines.expect("usr1");
}

/// What the kernel does with a thread held at a signal-delivery-stop when its tracer dies
/// (measured on Linux 6.18): the held signal is dropped and the thread runs on, untraced.
#[test]
fn killed_guard_drops_a_held_signal() {
    let mut v = Victim::spawn();
    let guard = GuardProcess::start(v.pid, true);
    v.signal(libc::SIGTERM);
    let held = guard.lines.expect("held ");
    assert_eq!(held, format!("{} {}", v.pid, libc::SIGTERM));
    assert_eq!(cryo_proc::status(v.pid).unwrap().state, 't');
    guard.kill();
    let st = cryo_proc::status(v.pid).unwrap();
    assert_eq!(st.tracer_pid, 0);
    assert_eq!(st.sig_pending, 0, "SIGTERM is not pending any more");
    // Alive and serving: the SIGTERM was lost, not delivered.
    v.ping();
    assert_ne!(cryo_proc::status(v.pid).unwrap().state, 'Z');
}

#[test]
fn memcg_oom_kill_is_seen_at_the_exit_stop() {
    let rec = Arc::new(Recorder::default());
    let tracer = Tracer::spawn(rec.clone()).unwrap();
    let mut v = Victim::spawn();
    let cg = TestCgroup::new("guard-oom", 64 << 20);
    cg.add(v.pid);
    let memcg = MemoryCgroup::of(&v.pidfd).unwrap();
    assert_eq!(memcg.version, CgroupVersion::V1);
    assert_eq!(memcg.dir, cg.path());
    assert_eq!(memcg.oom_kills().unwrap(), 0);
    *rec.pin.lock().unwrap() = vec![0, 1];
    tracer.attach(v.pid).unwrap();
    v.send("alloc");
    assert_eq!(
        rec.wait_gone(),
        ExitCause::Signaled {
            signal: libc::SIGKILL,
            core_dumped: false
        }
    );
    rec.with(|e| {
        assert!(e.iter().any(|e| matches!(e, Ev::ExitStop { cause: ExitCause::Signaled { signal: 9, .. }, pinned, .. } if pinned == &[0, 1])), "{e:?}");
    });
    assert_eq!(memcg.oom_kills().unwrap(), 1);
    drop(tracer);
}

#[test]
fn oom_score_adj_is_set_or_refused_loudly() {
    let v = Victim::spawn();
    v.pidfd.set_oom_score_adj(500).unwrap();
    assert_eq!(v.pidfd.oom_score_adj().unwrap(), 500);
    assert!(matches!(
        v.pidfd.set_oom_score_adj(5000),
        Err(OomAdjError::Range { .. })
    ));
    // Lowering needs CAP_SYS_RESOURCE: either it works, or the error says the machine refuses.
    match v.pidfd.set_oom_score_adj(-900) {
        Ok(()) => assert_eq!(v.pidfd.oom_score_adj().unwrap(), -900),
        Err(e @ OomAdjError::NotPermitted { .. }) => {
            eprintln!("NOTE: {e}");
            assert_eq!(v.pidfd.oom_score_adj().unwrap(), 500);
        }
        Err(e) => panic!("{e}"),
    }
}

#[test]
fn memory_cgroup_and_pressure_of_this_process() {
    let me = common::my_pid();
    let memcg = MemoryCgroup::of(&ProcHandle::open(me).unwrap()).unwrap();
    eprintln!("memory cgroup of the test process: {memcg:?}");
    assert!(memcg.dir.is_dir());
    memcg.oom_kills().unwrap();
    let psi: Psi = memcg.pressure().unwrap();
    assert!(psi.full.is_some());
    Psi::system().unwrap();
    let trigger = PsiTrigger::arm(
        &PressureSource::System,
        Stall::Some,
        Duration::from_millis(100),
        // Without CAP_SYS_RESOURCE the kernel takes only windows that are multiples of 2 s.
        Duration::from_secs(2),
    )
    .unwrap();
    trigger.wait(Some(Duration::ZERO)).unwrap();
}

/// A restored worker that handles SIGTERM itself (a server's graceful shutdown) gets one: the
/// guard holds it, suspends the worker, then ends it with SIGKILL. An ordinary shutdown is a safe
/// end: suspended, nothing pinned, no GPU fenced. (Before: the handler ran, the worker exited with
/// its context live, and it was pinned and its GPU quarantined.)
#[test]
fn a_handled_sigterm_to_a_guarded_restored_worker_is_a_safe_stop() {
    use cryo_journal::Event;
    let mut v = Victim::spawn();
    v.send("handle-term");
    v.lines.expect("ok");
    let dir = tempfile::tempdir().unwrap();
    let state = cryo_state::StateDir::new(dir.path());
    let fake = cryo_testkit::fake::FakeGpu::new();
    fake.add(v.pid).mark_restored(v.pid);
    let (guard, id) = guard_restored(&state, &fake, v.pid);
    v.signal(libc::SIGTERM);
    let events = || state.read_journal().unwrap().into_events();
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the exit to be journaled", || {
        events()
            .iter()
            .any(|e| matches!(e, Event::ProcessExited { pid, .. } if *pid == id))
    });
    let path: Vec<&str> = events()
        .iter()
        .filter(|e| e.pids().contains(&id))
        .map(Event::label)
        .collect::<Vec<_>>();
    for step in ["checkpointed", "verified", "kill started", "exited"] {
        assert!(path.contains(&step), "{step} missing: {path:?}");
    }
    assert!(
        !path.contains(&"pinned") && !path.contains(&"GPU QUARANTINED"),
        "{path:?}"
    );
    assert!(guard.status().pins.is_empty());
    assert!(state.fence().list().unwrap().is_empty());
}

/// A guard of `state` (no memory watch) started once the journal says `pid` (on `fake`) was
/// restored; it attached to it.
fn guard_restored(
    state: &cryo_state::StateDir,
    fake: &cryo_testkit::fake::FakeGpu,
    pid: i32,
) -> (cryo_guard::Guard, cryo_journal::ProcId) {
    let id = cryo_journal::ProcId::of(pid).unwrap();
    state
        .open_journal()
        .unwrap()
        .append(cryo_journal::Event::RestoreCompleted {
            pid: id,
            image: "test".into(),
            ms: None,
        })
        .unwrap();
    let mut cfg = cryo_guard::GuardConfig::new(state.clone());
    cfg.memory = None;
    let (guard, report) = cryo_guard::Guard::start(fake.gpu(), cfg).unwrap();
    assert_eq!(report.attached, vec![id]);
    (guard, id)
}

/// A peer connection the victim keeps (`connect PATH`): the test's end, and the victim's fd.
fn connect(
    v: &mut Victim,
    listener: &std::os::unix::net::UnixListener,
    path: &std::path::Path,
) -> (std::os::unix::net::UnixStream, i32) {
    v.send(&format!("connect {}", path.display()));
    let (ours, _) = listener.accept().unwrap();
    let fd = v.lines.expect("fd ").parse().unwrap();
    (ours, fd)
}

/// Whether every duplicate of the victim's end is closed (EOF on ours).
fn closed(ours: &std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    ours.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    match (&*ours).read(&mut b) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => {
            assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
            false
        }
    }
}

/// The whole guard (fake driver, real process and tracer) against `execve` of a restored process
/// whose "driver files" are close-on-exec connections the test holds the other end of: one held
/// from the start and one opened after the guard attached (taken by the refresh). The exec
/// closes both in the process; the guard's standing duplicates keep them open: pinned,
/// journaled (`Pinned` then `Execed`), GPU fenced, kept by the guard (no holder here), and the
/// new program is let go. Only the operator's release closes them. `single`: a one-threaded
/// process; `from_thread`: the exec comes from a thread other than the leader.
fn exec_keeps_the_driver_files_open(single: bool, from_thread: bool) {
    use cryo_journal::Event;
    use cryo_state::fence::FencedGpu;
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("driver.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let mut v = if single {
        Victim::spawn_single()
    } else {
        Victim::spawn()
    };
    let (first, fd1) = connect(&mut v, &listener, &sock);
    let state = cryo_state::StateDir::new(dir.path().join("state"));
    let fake = cryo_testkit::fake::FakeGpu::new();
    fake.add(v.pid)
        .mark_restored(v.pid)
        .driver_files(v.pid, &[fd1]);
    let (guard, id) = guard_restored(&state, &fake, v.pid);
    let standing = |g: &cryo_guard::Guard| g.status().guarded.first().map_or(0, |g| g.standing_fds);
    assert_eq!(standing(&guard), 1);
    // A driver file opened after the attach: taken by the next refresh.
    let (second, fd2) = connect(&mut v, &listener, &sock);
    fake.driver_files(v.pid, &[fd1, fd2]);
    guard.refresh_standing();
    assert_eq!(standing(&guard), 2);
    v.send(if from_thread {
        "thread-exec /bin/sleep 1000"
    } else {
        "exec /bin/sleep 1000"
    });
    let events = || state.read_journal().unwrap().into_events();
    let thread = cryo_testkit::eventually(cryo_testkit::PATIENCE, "Execed", || {
        events().into_iter().find_map(|e| match e {
            Event::Execed { pid, thread } if pid == id => Some(thread),
            _ => None,
        })
    });
    assert_eq!(thread == v.pid, !from_thread);
    assert!(
        !closed(&first) && !closed(&second),
        "a driver file was closed by the exec"
    );
    let ev = events();
    let pinned = ev
        .iter()
        .position(|e| matches!(e, Event::Pinned { pid, fds, .. } if *pid == id && fds.len() == 2));
    let execed = ev.iter().position(|e| matches!(e, Event::Execed { .. }));
    assert!(pinned.is_some() && pinned < execed, "{ev:?}");
    assert!(
        !ev.iter().any(|e| matches!(e, Event::ProcessExited { .. })),
        "{ev:?}"
    );
    use cryo_gpu::GpuInspector;
    let gpu0 = FencedGpu::Gpu(fake.gpus().unwrap()[0].uuid.clone());
    assert!(state.fence().list().unwrap().iter().any(|q| q.gpu == gpu0));
    assert_eq!(guard.status().pins.len(), 1);
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the new program let go", || {
        cryo_testkit::procs::tracer_pid(v.pid) == 0
    });
    assert!(guard.guarded().is_empty());
    guard.release(std::slice::from_ref(&gpu0)).unwrap();
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the release to close them", || {
        closed(&first) && closed(&second)
    });
}

/// Attack: `execve` of a one-threaded restored process.
#[test]
fn an_exec_of_a_single_threaded_restored_process_is_pinned() {
    exec_keeps_the_driver_files_open(true, false);
}

/// Attack: `execve` by the leader of a multi-threaded restored process.
#[test]
fn an_exec_from_the_leader_of_a_restored_process_is_pinned() {
    exec_keeps_the_driver_files_open(false, false);
}

/// Attack: `execve` by another thread of a restored process.
#[test]
fn an_exec_from_another_thread_of_a_restored_process_is_pinned() {
    exec_keeps_the_driver_files_open(false, true);
}
