#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `stop` against a fake driver and real (non-CUDA) processes: the decisions, not the driver.

use std::time::Duration;

use cryo_gpu::ProcessState;
use cryo_journal::{Event, Journal};
use cryo_proc::Pid;
use cryo_testkit::fake::{Call, FakeGpu};
use cryo_testkit::procs::Procs;

use super::*;
use crate::NoProgress;
use crate::Target;

fn opts() -> StopOptions {
    StopOptions {
        suspend: SuspendOptions {
            verify_timeout: Duration::from_secs(2),
            ..SuspendOptions::default()
        },
        ..StopOptions::default()
    }
}

#[test]
fn one_process_that_cannot_be_suspended_stops_nothing() {
    let mut procs = Procs::spawn(3);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.add(procs.pid(1)).make_sticky(procs.pid(1));
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1), procs.pid(2)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert_eq!(report.refusals.len(), 1);
    assert_eq!(report.refusals[0].pid, procs.pid(1));
    assert!(matches!(
        report.refusals[0].reason,
        SuspendFailure::StickyError { .. }
    ));
    assert!(!report.stopped());
    for i in 0..3 {
        assert!(procs.alive(i), "process {i} was killed");
    }
    // The one that locked was unlocked again: it keeps serving.
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
    let records = cryo_journal::read(dir.path()).unwrap().records;
    assert!(records
        .iter()
        .any(|r| matches!(r.event, Event::Refused { pid, .. } if pid.pid == procs.pid(1))));
    assert!(records
        .iter()
        .any(|r| matches!(r.event, Event::Unlocked { pid, .. } if pid.pid == procs.pid(0))));
    assert!(!records
        .iter()
        .any(|r| matches!(r.event, Event::KillStarted { .. })));
}

#[test]
fn suspends_cuda_processes_then_kills_everything() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert!(report.stopped(), "{report:?}");
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    let cuda = report
        .processes
        .iter()
        .find(|p| p.pid == procs.pid(0))
        .unwrap();
    assert!(cuda.cuda && cuda.suspended.is_some() && cuda.restored.is_none());
    let plain = report
        .processes
        .iter()
        .find(|p| p.pid == procs.pid(1))
        .unwrap();
    assert!(!plain.cuda && plain.suspended.is_none() && plain.ended);
    assert!(!procs.alive(0) && !procs.alive(1));
    // CUDA processes are killed before the others.
    let kills: Vec<Pid> = cryo_journal::read(dir.path())
        .unwrap()
        .records
        .iter()
        .filter_map(|r| match r.event {
            Event::KillStarted { pid, .. } => Some(pid.pid),
            _ => None,
        })
        .collect();
    assert_eq!(kills, vec![procs.pid(0), procs.pid(1)]);
}

#[test]
fn fresh_does_not_override_a_journaled_restore() {
    let procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.add(procs.pid(1));
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let restored = cryo_journal::ProcId::of(procs.pid(0)).unwrap();
    journal
        .append(Event::RestoreCompleted {
            pid: restored,
            image: "test".into(),
            ms: None,
        })
        .unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1)])
        .resolve()
        .unwrap();
    let report = stop(
        &fake.gpu(),
        &target,
        &StopOptions {
            fresh: true,
            ..opts()
        },
        &journal,
        &NoProgress,
    )
    .unwrap();
    assert!(report.stopped(), "{report:?}");
    assert_eq!(
        fake.state_of(procs.pid(0)),
        ProcessState::Checkpointed,
        "the restored one was not suspended"
    );
    assert_eq!(
        fake.state_of(procs.pid(1)),
        ProcessState::Running,
        "the fresh one was suspended anyway"
    );
    assert_eq!(report.unsafe_kills, vec![procs.pid(1)]);
    assert_eq!(report.processes[0].restored, Some(true));
}

#[test]
fn an_already_checkpointed_process_is_verified_and_killed() {
    let mut procs = Procs::spawn(1);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.set_state(procs.pid(0), ProcessState::Checkpointed);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let report = stop(
        &fake.gpu(),
        &Target::Tree(procs.pid(0)).resolve().unwrap(),
        &opts(),
        &journal,
        &NoProgress,
    )
    .unwrap();
    assert!(report.stopped());
    let s = report.processes[0].suspended.as_ref().unwrap();
    assert_eq!(s.state_before, ProcessState::Checkpointed);
    assert!(s.lock.is_none() && s.checkpoint.is_none() && s.verify.is_some());
    assert!(!procs.alive(0));
}

/// A process of the target that exits on its own while the stop looks at it has ended too: the
/// stop succeeds (regression: it was reported as not ended, exit 3 without a refusal).
#[test]
fn a_process_that_exits_on_its_own_meanwhile_counts_as_ended() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.exit_at(procs.pid(1), Call::State);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert!(report.stopped(), "{report:?}");
    assert!(report.processes.iter().all(|p| p.ended), "{report:?}");
    assert!(!procs.alive(0) && !procs.alive(1));
}

/// A CUDA process that dies on its own while being locked (a dying worker; CRIU ending a dumped
/// tree) leaves the target; the others are still suspended and stopped, and the journal says so.
#[test]
fn a_cuda_process_that_dies_during_the_suspension_does_not_block_the_others() {
    let mut procs = Procs::spawn(3);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.add(procs.pid(1));
    fake.exit_at(procs.pid(1), Call::Lock);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1), procs.pid(2)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert!(report.stopped(), "{report:?}");
    assert!(report.refusals.is_empty());
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    for i in 0..3 {
        assert!(!procs.alive(i), "process {i} still alive");
    }
    let records = cryo_journal::read(dir.path()).unwrap().records;
    assert!(records
        .iter()
        .any(|r| matches!(r.event, Event::ProcessExited { pid, .. } if pid.pid == procs.pid(1))));
}

/// The last look before the kill: a process that something restored after the verification
/// (a concurrent thaw or toggle) is refused, and then nothing in the target is killed: not the
/// other processes either, as for any refusal.
#[test]
fn a_late_change_found_at_the_last_look_kills_nothing() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    // State calls on it: classification, suspension, then the last look before any kill.
    fake.set_state_at(procs.pid(0), Call::State, 3, ProcessState::Running);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert_eq!(report.refusals[0].pid, procs.pid(0));
    assert!(
        matches!(&report.refusals[0].reason, SuspendFailure::Driver { step: "kill", error } if error.contains("running")),
        "{report:?}"
    );
    assert!(!report.stopped());
    assert!(
        procs.alive(0) && procs.alive(1),
        "a late refusal killed part of the target"
    );
    let records = cryo_journal::read(dir.path()).unwrap().records;
    assert!(!records
        .iter()
        .any(|r| matches!(r.event, Event::KillStarted { .. })));
    assert!(records
        .iter()
        .any(|r| matches!(r.event, Event::Refused { pid, .. } if pid.pid == procs.pid(0))));
}

/// A refused stop kills nothing, whichever way the suspension failed (here NVML keeps listing
/// the process's memory after the checkpoint), and leaves what it checkpointed CHECKPOINTED.
#[test]
fn memory_still_listed_refuses_the_stop_and_kills_nothing() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0))
        .add(procs.pid(1))
        .keep_listed(procs.pid(1));
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let target = Target::Pids(vec![procs.pid(0), procs.pid(1)])
        .resolve()
        .unwrap();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert!(matches!(
        report.refusals[0].reason,
        SuspendFailure::MemoryStillListed { .. }
    ));
    assert!(procs.alive(0) && procs.alive(1));
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    assert_eq!(fake.state_of(procs.pid(1)), ProcessState::Checkpointed);
}
