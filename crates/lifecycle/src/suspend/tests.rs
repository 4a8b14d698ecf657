#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `suspend` against the fake driver and real (non-CUDA) processes, without root: the
//! all-or-nothing rule, retries, refusals and roll-back. Each test names the claim it attacks.

use std::time::Duration;

use cryo_gpu::{CuResult, ProcessState};
use cryo_journal::{Event, Journal};
use cryo_proc::Pid;
use cryo_proc::ProcHandle;
use cryo_testkit::fake::{Call, FakeGpu, DEFAULT_BYTES};
use cryo_testkit::procs::Procs;
use cryo_testkit::{eventually, PATIENCE};

use super::*;
use crate::NoProgress;

fn opts() -> SuspendOptions {
    SuspendOptions {
        lock_timeout: Duration::from_secs(1),
        lock_attempts: 3,
        verify_timeout: Duration::from_millis(300),
        resume_on_failure: false,
        ..SuspendOptions::default()
    }
}

/// `n` sleepers the fake driver knows as RUNNING CUDA processes.
fn cuda(n: usize) -> (Procs, FakeGpu) {
    let procs = Procs::spawn(n);
    let fake = FakeGpu::new();
    for p in procs.pids() {
        fake.add(p);
    }
    (procs, fake)
}

/// Suspends every process of `procs`; the outcomes by pid and the journal.
fn run(fake: &FakeGpu, procs: &Procs, opts: &SuspendOptions) -> (Vec<SuspendOutcome>, Vec<Event>) {
    let handles: Vec<ProcHandle> = procs
        .pids()
        .into_iter()
        .map(|p| ProcHandle::open(p).unwrap())
        .collect();
    let refs: Vec<&ProcHandle> = handles.iter().collect();
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let out = suspend(&fake.gpu(), &refs, opts, Some(&journal), &NoProgress);
    let events = cryo_journal::read(dir.path())
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.event)
        .collect();
    (out, events)
}

fn result(out: &[SuspendOutcome], pid: Pid) -> &Result<Suspended, SuspendFailure> {
    &out.iter().find(|o| o.pid == pid).unwrap().result
}

/// The journal's labels for `pid`, in order.
fn steps(events: &[Event], pid: Pid) -> Vec<&'static str> {
    events
        .iter()
        .filter(|e| e.pids().iter().any(|p| p.pid == pid))
        .map(|e| e.label())
        .collect()
}

fn checkpoints(fake: &FakeGpu) -> usize {
    fake.calls()
        .iter()
        .filter(|(_, c)| *c == Call::Checkpoint)
        .count()
}

/// All or nothing: one process that fails to lock leaves every other one unlocked again (not
/// LOCKED, which would hang the worker), and nothing is checkpointed.
#[test]
fn one_process_that_fails_to_lock_leaves_the_others_unlocked() {
    let (procs, fake) = cuda(3);
    fake.fail_next_on(procs.pid(1), Call::Lock, CuResult::UNKNOWN);
    let (out, events) = run(&fake, &procs, &opts());
    assert!(
        matches!(
            result(&out, procs.pid(1)),
            Err(SuspendFailure::Driver { step: "lock", .. })
        ),
        "{out:?}"
    );
    for p in procs.pids() {
        assert_eq!(fake.state_of(p), ProcessState::Running, "pid {p}");
    }
    for i in [0, 2] {
        let s = steps(&events, procs.pid(i));
        assert!(s.contains(&"unlocked"), "{s:?}");
    }
    assert_eq!(checkpoints(&fake), 0, "checkpointed after a failed lock");
}

/// With `resume_on_failure` (freeze), a process that fails to checkpoint brings the others
/// back: the checkpointed ones are restored and unlocked, the locked one unlocked.
#[test]
fn a_checkpoint_failure_with_resume_brings_every_process_back() {
    let (procs, fake) = cuda(3);
    fake.fail_next_on(procs.pid(1), Call::Checkpoint, CuResult::UNKNOWN);
    let (out, events) = run(
        &fake,
        &procs,
        &SuspendOptions {
            resume_on_failure: true,
            ..opts()
        },
    );
    assert!(
        matches!(
            result(&out, procs.pid(1)),
            Err(SuspendFailure::Driver {
                step: "checkpoint",
                ..
            })
        ),
        "{out:?}"
    );
    for p in procs.pids() {
        assert_eq!(fake.state_of(p), ProcessState::Running, "pid {p}");
    }
    for i in [0, 2] {
        // Brought back through a driver restore: journaled as restored, intent first.
        let s = steps(&events, procs.pid(i));
        let at = |what: &str| s.iter().position(|x| *x == what);
        assert!(
            at("restore started").is_some() && at("restore started") < at("restore completed"),
            "{s:?}"
        );
        assert_eq!(fake.count(procs.pid(i), Call::Restore), 1);
    }
    assert!(steps(&events, procs.pid(1)).contains(&"unlocked"));
    assert_eq!(fake.count(procs.pid(1), Call::Restore), 0);
}

/// Without `resume_on_failure` (stop), what was checkpointed stays CHECKPOINTED (safe to kill
/// later); the one that could not be checkpointed is unlocked, never left LOCKED.
#[test]
fn a_checkpoint_failure_without_resume_leaves_the_checkpointed_ones_checkpointed() {
    let (procs, fake) = cuda(3);
    fake.fail_next_on(procs.pid(1), Call::Checkpoint, CuResult::UNKNOWN);
    let (out, _) = run(&fake, &procs, &opts());
    assert!(result(&out, procs.pid(1)).is_err());
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    assert_eq!(fake.state_of(procs.pid(2)), ProcessState::Checkpointed);
    assert_eq!(fake.state_of(procs.pid(1)), ProcessState::Running);
    assert!(fake.calls().iter().all(|(_, c)| *c != Call::Restore));
}

/// Work in flight (`CUDA_ERROR_NOT_READY`) is retried; the lock that then succeeds counts.
#[test]
fn not_ready_is_retried_until_the_lock_succeeds() {
    let (procs, fake) = cuda(1);
    let p = procs.pid(0);
    fake.fail_next_on(p, Call::Lock, CuResult::NOT_READY);
    fake.fail_next_on(p, Call::Lock, CuResult::NOT_READY);
    let (out, events) = run(&fake, &procs, &opts());
    let s = result(&out, p).as_ref().unwrap();
    assert!(s.lock.is_some() && s.checkpoint.is_some() && s.verify.is_some());
    assert_eq!(fake.count(p, Call::Lock), 3);
    assert_eq!(fake.state_of(p), ProcessState::Checkpointed);
    let failed = steps(&events, p)
        .iter()
        .filter(|s| **s == "lock failed")
        .count();
    assert_eq!(failed, 2, "every failed attempt is journaled");
}

/// Work that stays in flight through every attempt is a lock timeout, the process RUNNING.
#[test]
fn not_ready_through_every_attempt_is_a_lock_timeout() {
    let (procs, fake) = cuda(1);
    let p = procs.pid(0);
    for _ in 0..3 {
        fake.fail_next_on(p, Call::Lock, CuResult::NOT_READY);
    }
    let (out, _) = run(&fake, &procs, &opts());
    assert_eq!(
        result(&out, p).as_ref().err(),
        Some(&SuspendFailure::LockTimedOut {
            attempts: 3,
            timeout_ms: 1000,
            deadline_ms: None,
        })
    );
    assert_eq!(fake.count(p, Call::Lock), 3);
    assert_eq!(fake.state_of(p), ProcessState::Running);
}

/// A sticky error is refused at once: no retry can help, and the others are unlocked again.
#[test]
fn a_sticky_context_is_refused_without_retries() {
    let (procs, fake) = cuda(2);
    fake.make_sticky(procs.pid(1));
    let (out, _) = run(&fake, &procs, &opts());
    assert_eq!(
        result(&out, procs.pid(1)).as_ref().err(),
        Some(&SuspendFailure::StickyError {
            code: "CUDA_ERROR_ILLEGAL_ADDRESS".into()
        })
    );
    assert_eq!(fake.count(procs.pid(1), Call::Lock), 1);
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
}

/// A process the driver reports FAILED is refused before anything is locked.
#[test]
fn a_failed_process_is_refused_before_anything_is_locked() {
    let (procs, fake) = cuda(2);
    fake.set_state(procs.pid(1), ProcessState::Failed);
    let (out, _) = run(&fake, &procs, &opts());
    assert_eq!(
        result(&out, procs.pid(1)).as_ref().err(),
        Some(&SuspendFailure::DriverFailedState)
    );
    assert!(
        fake.calls().iter().all(|(_, c)| *c == Call::State),
        "{:?}",
        fake.calls()
    );
}

/// An OK from checkpoint is not proof: NVML still listing the process's memory refuses it,
/// and it stays CHECKPOINTED (never unlocked into a state where a kill would tear it down).
#[test]
fn nvml_still_listing_memory_is_a_refusal() {
    let (procs, fake) = cuda(2);
    fake.keep_listed(procs.pid(1));
    let (out, events) = run(&fake, &procs, &opts());
    assert_eq!(
        result(&out, procs.pid(1)).as_ref().err(),
        Some(&SuspendFailure::MemoryStillListed {
            bytes: DEFAULT_BYTES
        })
    );
    assert!(steps(&events, procs.pid(1)).contains(&"verify failed"));
    assert_eq!(fake.state_of(procs.pid(1)), ProcessState::Checkpointed);
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    assert!(steps(&events, procs.pid(0)).contains(&"verified"));
}

/// A process that dies while being locked is reported as exited (not a driver failure), and
/// the suspension of the others is rolled back.
#[test]
fn a_process_that_exits_while_being_locked_is_reported_exited() {
    let (procs, fake) = cuda(2);
    fake.exit_at(procs.pid(1), Call::Lock);
    let (out, _) = run(&fake, &procs, &opts());
    assert_eq!(
        result(&out, procs.pid(1)).as_ref().err(),
        Some(&SuspendFailure::Exited)
    );
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
}

/// The same while it is checkpointed: exited, and the one checkpointed meanwhile is resumed
/// with `resume_on_failure`.
#[test]
fn a_process_that_exits_while_being_checkpointed_is_reported_exited() {
    let (procs, fake) = cuda(2);
    fake.exit_at(procs.pid(1), Call::Checkpoint);
    let (out, _) = run(
        &fake,
        &procs,
        &SuspendOptions {
            resume_on_failure: true,
            ..opts()
        },
    );
    assert_eq!(
        result(&out, procs.pid(1)).as_ref().err(),
        Some(&SuspendFailure::Exited)
    );
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
    assert!(fake.wedges().is_empty(), "{:?}", fake.wedges());
}

/// Locks run in parallel: the second process is locked while the first lock still hangs.
#[test]
fn locks_run_in_parallel() {
    let (procs, fake) = cuda(2);
    let hang = fake.hang_next(procs.pid(0), Call::Lock);
    // Let the hung lock go whatever happens, or a failing test would hang instead of failing.
    struct Release(cryo_testkit::fake::Hang);
    impl Drop for Release {
        fn drop(&mut self) {
            self.0.release();
        }
    }
    std::thread::scope(|s| {
        // Dropped before the scope waits for the job, also when an assertion fails.
        let _release = Release(hang.clone());
        let job = s.spawn(|| run(&fake, &procs, &opts()));
        hang.wait_reached();
        eventually(PATIENCE, "the other lock while the first hangs", || {
            fake.count(procs.pid(1), Call::Lock) == 1
        });
        hang.release();
        let (out, _) = job.join().unwrap();
        assert!(out.iter().all(|o| o.result.is_ok()), "{out:?}");
    });
}
