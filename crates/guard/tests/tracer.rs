#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The tracer against ordinary processes (root, no GPU).

mod common;

use std::io::{ErrorKind, Read};
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use common::{my_pid, procs, stats_eventually, thread_state, Ev, Recorder, Victim};
use cryo_guard::{AttachError, Decision, DetachError, ExitCause, Tracer};
use cryo_testkit::{eventually, PATIENCE};

fn tracer() -> (Arc<Recorder>, Tracer) {
    let rec = Arc::new(Recorder::default());
    let tracer = Tracer::spawn(rec.clone()).unwrap();
    (rec, tracer)
}

fn killed_by(signal: i32) -> ExitCause {
    ExitCause::Signaled {
        signal,
        core_dumped: false,
    }
}

fn signal_of(cause: ExitCause) -> Option<i32> {
    match cause {
        ExitCause::Signaled { signal, .. } => Some(signal),
        ExitCause::Exited(_) => None,
    }
}

#[test]
fn sigterm_is_held_while_other_threads_run_then_delivered() {
    let (rec, tracer) = tracer();
    let v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    let (pid, helper) = (v.pid, v.helper);
    *rec.hook.lock().unwrap() = Some(Box::new(move |_, sig| {
        // Held: the signalled thread is in a ptrace stop, the helper thread is not.
        assert_eq!(thread_state(pid, sig.tid), 't');
        assert_ne!(thread_state(pid, helper), 't');
        assert_ne!(sig.tid, helper);
    }));
    v.signal(libc::SIGTERM);
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGTERM));
    let fatals = rec.fatals();
    assert_eq!(fatals.len(), 1, "{fatals:?}");
    assert_eq!(fatals[0].signal, libc::SIGTERM);
    assert_eq!(fatals[0].code, 0, "SI_USER");
    assert_eq!(fatals[0].sender, Some(my_pid()));
    // The death of a held process still passes through the leader's exit stop.
    rec.with(|e| {
        assert!(e.iter().any(|e| matches!(e, Ev::ExitStop { cause, .. }
            if signal_of(*cause) == Some(libc::SIGTERM))));
    });
    assert_eq!(tracer.stats().fatal_held, 1);
}

#[test]
fn discarded_sigterm_leaves_the_process_running() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    *rec.decision.lock().unwrap() = Decision::Discard;
    v.signal(libc::SIGTERM);
    rec.wait_for("SIGTERM held", |e| {
        e.iter().any(|e| matches!(e, Ev::Fatal(_)))
    });
    v.ping();
    assert!(v.pidfd.is_alive());
}

#[test]
fn real_segv_is_held_then_delivered() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("segv");
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGSEGV));
    let f = rec.fatals();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].signal, libc::SIGSEGV);
    assert_eq!(f[0].tid, v.pid);
    assert!(
        f[0].code > 0,
        "a kernel-raised fault, si_code {}",
        f[0].code
    );
    assert_eq!(f[0].sender, None);
}

#[test]
fn abort_is_held_then_delivered() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("abort");
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGABRT));
    assert_eq!(rec.fatals()[0].signal, libc::SIGABRT);
}

#[test]
fn sigkill_is_seen_at_the_exit_stop_and_pinned_fds_outlive_the_process() {
    let (rec, tracer) = tracer();
    let (mut ours, theirs) = UnixStream::pair().unwrap();
    let v = Victim::spawn_with_stderr(Some(OwnedFd::from(theirs)));
    *rec.pin.lock().unwrap() = vec![2, 9999];
    tracer.attach(v.pid).unwrap();
    v.signal(libc::SIGKILL);
    assert_eq!(rec.wait_gone(), killed_by(libc::SIGKILL));
    rec.with(|e| match e {
        [Ev::ExitStop {
            tid,
            cause,
            pinned,
            failed,
        }, Ev::Gone(_)] => {
            assert_eq!(*tid, v.pid);
            assert_eq!(*cause, killed_by(libc::SIGKILL));
            assert_eq!(pinned, &[2]);
            assert_eq!(*failed, 1, "fd 9999 does not exist");
        }
        other => panic!("unexpected events {other:?}"),
    });
    // Dead: a zombie (our tracer has seen its end; its real parent may not have reaped it yet).
    assert!(cryo_proc::status(v.pid).map_or(true, |s| s.state == 'Z'));
    // The process is reaped, yet its end of the socket is still open: our duplicate holds it.
    ours.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 16];
    let err = ours.read(&mut buf).expect_err("EOF while pinned");
    assert_eq!(err.kind(), ErrorKind::WouldBlock);
    rec.pinned.lock().unwrap().clear();
    ours.set_nonblocking(false).unwrap();
    assert_eq!(
        ours.read(&mut buf).unwrap(),
        0,
        "EOF once the pins are dropped"
    );
}

#[test]
fn exit_with_a_code_is_seen_at_the_exit_stop() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("exit 3");
    assert_eq!(rec.wait_gone(), ExitCause::Exited(3));
    rec.with(|e| {
        assert!(e.iter().any(|e| matches!(
            e,
            Ev::ExitStop {
                cause: ExitCause::Exited(3),
                ..
            }
        )));
    });
    assert!(rec.fatals().is_empty());
    // Every thread (main and helper) went through its exit stop.
    assert!(tracer.stats().exit_stops >= 2, "{:?}", tracer.stats());
}

#[test]
fn new_threads_are_followed() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("thread");
    let tid: i32 = v.lines.expect("tid ").parse().unwrap();
    assert!(tracer.threads(v.pid).unwrap().unwrap().contains(&tid));
    assert_eq!(
        cryo_proc::status(tid).unwrap().tracer_pid,
        tracer.tracer_tid()
    );
    v.send("thread-segv");
    let faulting: i32 = v.lines.expect("tid ").parse().unwrap();
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGSEGV));
    let f = rec.fatals();
    assert_eq!(f.len(), 1, "{f:?}");
    assert_eq!(f[0].tid, faulting);
    assert_ne!(faulting, v.pid);
    assert!(tracer.stats().threads_followed >= 2);
}

#[test]
fn non_fatal_signals_pass_through() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.signal(libc::SIGUSR1);
    v.lines.expect("usr1");
    v.send("child");
    assert_eq!(v.lines.expect("child done"), "true");
    v.signal(libc::SIGWINCH);
    v.ping();
    assert!(rec.fatals().is_empty());
    // SIGUSR1 (handled), SIGCHLD (default: ignore) and SIGWINCH went through.
    assert!(tracer.stats().signals_passed >= 3, "{:?}", tracer.stats());
    // Without a handler SIGUSR1 kills, so it is held.
    v.send("default-usr1");
    v.lines.expect("ok");
    v.signal(libc::SIGUSR1);
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGUSR1));
    assert_eq!(rec.fatals()[0].signal, libc::SIGUSR1);
}

#[test]
fn group_stop_and_continue_work_under_the_tracer() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.signal(libc::SIGSTOP);
    // Both threads reach group-stop and are parked with PTRACE_LISTEN.
    stats_eventually(&tracer, "group-stops", |s| s.group_stops >= 2);
    // Really stopped, as the kernel sees it: every thread in a stop, none running. A seized
    // tracee parked in its group-stop with PTRACE_LISTEN shows `t` (measured on Linux 6.18); an
    // untraced one `T`. A tracer that resumed the threads instead would leave them `S`/`R`.
    let threads = procs::thread_states(v.pid);
    assert!(threads.len() >= 2, "{threads:?}");
    assert!(
        threads.iter().all(|(_, s)| matches!(s, 'T' | 't')),
        "not every thread is stopped: {threads:?}"
    );
    v.signal(libc::SIGCONT);
    v.ping();
    eventually(PATIENCE, "every thread to run again", || {
        procs::thread_states(v.pid)
            .iter()
            .all(|(_, s)| !matches!(s, 'T' | 't'))
    });
    assert!(rec.fatals().is_empty());
}

#[test]
fn detach_and_reattach() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    let traced_by = |tid| cryo_proc::status(tid).unwrap().tracer_pid;
    for tid in v.pidfd.tasks().unwrap() {
        assert_eq!(traced_by(tid), tracer.tracer_tid());
    }
    tracer.detach(v.pid).unwrap();
    for tid in v.pidfd.tasks().unwrap() {
        assert_eq!(traced_by(tid), 0);
    }
    assert!(tracer.traced().unwrap().is_empty());
    assert!(matches!(
        tracer.detach(v.pid),
        Err(DetachError::NotTraced { .. })
    ));
    v.ping();
    tracer.attach(v.pid).unwrap();
    assert_eq!(tracer.traced().unwrap(), vec![v.pid]);
    v.signal(libc::SIGTERM);
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGTERM));
}

#[test]
fn detach_is_refused_while_a_thread_is_held() {
    let (rec, tracer) = tracer();
    let v = Victim::spawn();
    let tracer = Arc::new(tracer);
    tracer.attach(v.pid).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let t2 = tracer.clone();
    let pid = v.pid;
    *rec.hook.lock().unwrap() = Some(Box::new(move |_, _| {
        tx.send(t2.detach(pid)).unwrap();
    }));
    v.signal(libc::SIGTERM);
    let r = rx.recv().unwrap();
    assert!(matches!(r, Err(DetachError::Busy { .. })), "{r:?}");
    assert_eq!(signal_of(rec.wait_gone()), Some(libc::SIGTERM));
}

#[test]
fn attach_errors() {
    let (_rec, tracer) = tracer();
    let v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    assert!(matches!(
        tracer.attach(v.pid),
        Err(AttachError::AlreadyTraced { .. })
    ));
    // A pid that names no process.
    let mut child = std::process::Command::new("true").spawn().unwrap();
    let dead = i32::try_from(child.id()).unwrap();
    child.wait().unwrap();
    assert!(matches!(tracer.attach(dead), Err(AttachError::Proc(_))));
}

#[test]
fn shutdown_detaches_everything() {
    let (_rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    tracer.shutdown().unwrap();
    assert_eq!(cryo_proc::status(v.pid).unwrap().tracer_pid, 0);
    v.ping();
}

/// The process after `exec`: running `sleep`, one thread, traced by `tracer` (the recorder
/// keeps it).
fn assert_execed(tracer: &Tracer, pid: i32) {
    eventually(PATIENCE, "the new program", || {
        std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    });
    assert_eq!(tracer.threads(pid).unwrap(), Some(vec![pid]));
    assert_eq!(procs::tracer_pid(pid), tracer.tracer_tid());
    assert_eq!(tracer.stats().exec_stops, 1);
}

/// An `execve` by the leader of a multi-threaded process: an exec stop naming it, no exit stop
/// taken for a death (the other thread's own exit stop is let through).
#[test]
fn an_exec_from_the_leader_is_an_exec_stop() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("exec /bin/sleep 1000");
    rec.wait_for("the exec stop", |e| {
        e.iter().any(|e| matches!(e, Ev::Exec(_)))
    });
    assert_execed(&tracer, v.pid);
    rec.with(|e| match e {
        [Ev::Exec(t)] => assert_eq!(*t, v.pid),
        other => panic!("unexpected events {other:?}"),
    });
}

/// An `execve` by another thread: the kernel kills the leader first (its exit stop, with the fd
/// table intact, is `before_exec`, not a death), then the execing thread takes the leader's tid.
#[test]
fn an_exec_from_another_thread_is_before_exec_then_an_exec_stop() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("thread-exec /bin/sleep 1000");
    rec.wait_for("the exec stop", |e| {
        e.iter().any(|e| matches!(e, Ev::Exec(_)))
    });
    assert_execed(&tracer, v.pid);
    rec.with(|e| match e {
        [Ev::BeforeExec, Ev::Exec(t)] => {
            assert_ne!(*t, v.pid);
            assert_ne!(*t, v.helper);
        }
        other => panic!("unexpected events {other:?}"),
    });
}

/// A one-threaded process's exec: the exec stop alone.
#[test]
fn an_exec_of_a_single_threaded_process_is_an_exec_stop() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn_single();
    assert_eq!(v.helper, 0);
    tracer.attach(v.pid).unwrap();
    assert_eq!(tracer.threads(v.pid).unwrap(), Some(vec![v.pid]));
    v.send("exec /bin/sleep 1000");
    rec.wait_for("the exec stop", |e| {
        e.iter().any(|e| matches!(e, Ev::Exec(_)))
    });
    assert_execed(&tracer, v.pid);
    rec.with(|e| assert!(matches!(e, [Ev::Exec(t)] if *t == v.pid), "{e:?}"));
}

/// A failed `execve` (ENOENT), from either thread, is nothing to the tracer.
#[test]
fn a_failed_exec_is_not_reported() {
    let (rec, tracer) = tracer();
    let mut v = Victim::spawn();
    tracer.attach(v.pid).unwrap();
    v.send("exec /nonexistent/cryo-exec");
    assert!(v.lines.expect("exec failed ").contains("No such file"));
    v.send("thread-exec /nonexistent/cryo-exec");
    assert!(v.lines.expect("exec failed ").contains("No such file"));
    v.ping();
    rec.with(|e| assert!(e.is_empty(), "{e:?}"));
    assert_eq!(tracer.stats().exec_stops, 0);
}
