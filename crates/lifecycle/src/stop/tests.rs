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

/// A journal in a temporary directory of the test's own.
fn temp_journal() -> (tempfile::TempDir, Journal) {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    (dir, journal)
}

/// `stop` of the processes `pids` through `fake`, with `o`, journaled in `journal`.
fn stop_pids(fake: &FakeGpu, pids: Vec<Pid>, o: &StopOptions, journal: &Journal) -> StopReport {
    let target = Target::Pids(pids).resolve().unwrap();
    stop(&fake.gpu(), &target, o, journal, &NoProgress).unwrap()
}

#[test]
fn one_process_that_cannot_be_suspended_stops_nothing() {
    let mut procs = Procs::spawn(3);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.add(procs.pid(1)).make_sticky(procs.pid(1));
    let (dir, journal) = temp_journal();
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
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
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::Refused { pid, .. } if pid.pid == procs.pid(1))
    ));
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::Unlocked { pid, .. } if pid.pid == procs.pid(0))
    ));
    assert!(!journal_has(dir.path(), |e| matches!(
        e,
        Event::KillStarted { .. }
    )));
}

#[test]
fn suspends_cuda_processes_then_kills_everything() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    let (dir, journal) = temp_journal();
    let report = stop_pids(&fake, vec![procs.pid(0), procs.pid(1)], &opts(), &journal);
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
    let (_dir, journal) = temp_journal();
    let restored = cryo_journal::ProcId::of(procs.pid(0)).unwrap();
    journal
        .append(Event::RestoreCompleted {
            pid: restored,
            image: "test".into(),
            ms: None,
        })
        .unwrap();
    let report = stop_pids(
        &fake,
        vec![procs.pid(0), procs.pid(1)],
        &StopOptions {
            fresh: true,
            ..opts()
        },
        &journal,
    );
    assert!(report.stopped(), "{report:?}");
    assert_eq!(
        fake.state_of(procs.pid(0)),
        ProcessState::Checkpointed,
        "the restored one was not suspended"
    );
    // `--fresh` still suspends first (issue 9 item 7): only what cannot be suspended is killed
    // without it.
    assert_eq!(fake.state_of(procs.pid(1)), ProcessState::Checkpointed);
    assert!(report.unsafe_kills.is_empty(), "{report:?}");
    assert_eq!(report.processes[0].restored, Some(true));
}

#[test]
fn an_already_checkpointed_process_is_verified_and_killed() {
    let mut procs = Procs::spawn(1);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    fake.set_state(procs.pid(0), ProcessState::Checkpointed);
    let (_dir, journal) = temp_journal();
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
    let (_dir, journal) = temp_journal();
    let report = stop_pids(&fake, vec![procs.pid(0), procs.pid(1)], &opts(), &journal);
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
    let (dir, journal) = temp_journal();
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
    assert!(report.stopped(), "{report:?}");
    assert!(report.refusals.is_empty());
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    for i in 0..3 {
        assert!(!procs.alive(i), "process {i} still alive");
    }
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::ProcessExited { pid, .. } if pid.pid == procs.pid(1))
    ));
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
    let (dir, journal) = temp_journal();
    let report = stop_pids(&fake, vec![procs.pid(0), procs.pid(1)], &opts(), &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert_eq!(report.refusals[0].pid, procs.pid(0));
    assert!(
        matches!(&report.refusals[0].reason, SuspendFailure::LastLook { found } if found.contains("running")),
        "{report:?}"
    );
    assert!(!report.stopped());
    assert!(
        procs.alive(0) && procs.alive(1),
        "a late refusal killed part of the target"
    );
    assert!(!journal_has(dir.path(), |e| matches!(
        e,
        Event::KillStarted { .. }
    )));
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::Refused { pid, .. } if pid.pid == procs.pid(0))
    ));
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
    let (_dir, journal) = temp_journal();
    let report = stop_pids(&fake, vec![procs.pid(0), procs.pid(1)], &opts(), &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert!(matches!(
        report.refusals[0].reason,
        SuspendFailure::MemoryStillListed { .. }
    ));
    assert!(procs.alive(0) && procs.alive(1));
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Checkpointed);
    assert_eq!(fake.state_of(procs.pid(1)), ProcessState::Checkpointed);
}

fn journal_has(dir: &std::path::Path, f: impl Fn(&Event) -> bool) -> bool {
    cryo_journal::read(dir)
        .unwrap()
        .records
        .iter()
        .any(|r| f(&r.event))
}

/// Issue 9 item 1: a process that only opened the driver (`cuInit`: driver files, no state the
/// driver knows, nothing listed by NVML) holds no context: it ends like a plain process, said as
/// such in the report.
#[test]
fn a_process_that_only_opened_the_driver_ends_like_a_plain_one_said_as_such() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0)).driver_files(procs.pid(1), &[3, 4]);
    let (_dir, journal) = temp_journal();
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
    assert!(report.stopped(), "{report:?}");
    let launcher = &report.processes[1];
    assert!(!launcher.cuda);
    assert!(
        launcher
            .notes
            .iter()
            .any(|n| n.contains("opened the driver")),
        "{launcher:?}"
    );
    assert!(!procs.alive(0) && !procs.alive(1));
}

/// Issue 9 item 1: an answer other than "no CUDA state" for a process that holds driver files is
/// a refusal naming the pid, the call and the code; nothing is killed (main aborted the whole
/// stop with a driver error, or, for the two "no state" codes, killed it as plain).
#[test]
fn an_unexpected_answer_for_a_process_with_driver_files_refuses_naming_pid_call_and_code() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.driver_files(procs.pid(0), &[3]);
    fake.fail_next_on(procs.pid(0), Call::State, cryo_gpu::CuResult::UNKNOWN);
    let (_dir, journal) = temp_journal();
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    let why = report.refusals[0].reason.reason();
    assert_eq!(report.refusals[0].pid, procs.pid(0));
    for part in [
        &procs.pid(0).to_string()[..],
        "cuCheckpointProcessGetState",
        "CUDA_ERROR_UNKNOWN",
    ] {
        assert!(why.contains(part), "{why}");
    }
    assert!(procs.alive(0) && procs.alive(1));
    // NVML listing memory for a process the driver says has no CUDA state: a refusal too.
    let fake = FakeGpu::new();
    fake.add(procs.pid(1)).keep_listed(procs.pid(1));
    fake.fail_next_on(
        procs.pid(1),
        Call::State,
        cryo_gpu::CuResult::NOT_INITIALIZED,
    );
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
    assert!(
        report
            .refusals
            .iter()
            .any(|r| r.pid == procs.pid(1) && r.reason.reason().contains("NVML lists")),
        "{report:?}"
    );
    assert!(procs.alive(0) && procs.alive(1));
}

/// Issue 9 item 2: a refusal found by the look right before one process's kill ends the kill
/// phase at once: what comes after it (here a plain process) is not killed. Main went on
/// killing the rest.
#[test]
fn a_refusal_right_before_a_kill_ends_the_kill_phase_at_once() {
    // How many state calls a CUDA process gets in a stop that goes through: the last one is the
    // look right before its kill.
    let n = {
        let procs = Procs::spawn(3);
        let fake = FakeGpu::new();
        fake.add(procs.pid(0)).add(procs.pid(1));
        let (_dir, journal) = temp_journal();
        let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
        assert!(report.stopped(), "{report:?}");
        fake.count(procs.pid(1), Call::State)
    };
    let mut procs = Procs::spawn(3);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0)).add(procs.pid(1));
    fake.set_state_at(procs.pid(1), Call::State, n, ProcessState::Running);
    let (_dir, journal) = temp_journal();
    let report = stop_pids(&fake, procs.pids(), &opts(), &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert_eq!(report.refusals[0].pid, procs.pid(1));
    assert!(!report.stopped());
    assert!(
        !procs.alive(0),
        "the first CUDA process was checked and killed"
    );
    assert!(procs.alive(1), "a refused process was killed");
    assert!(procs.alive(2), "the kill phase went on after a refusal");
}

/// Issue 9 item 3: a driver call that never returns is a refusal within the stop's deadline,
/// never a hung stop; nothing is killed, and a lock that succeeds after its caller gave up is
/// undone (the process serves again).
#[test]
fn a_driver_call_that_never_returns_is_a_refusal_not_a_hang() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    let hang = fake.hang_next(procs.pid(0), Call::Lock);
    let (dir, journal) = temp_journal();
    // The suspension gets the deadline less a fifth, and a lock is tried only with 2.1 s of it
    // left (the checkpoint's and the verification's reserve): with 3 s, everything before the
    // lock had 300 ms, which a loaded host exceeded (refused out of time, no hung call).
    let o = StopOptions {
        deadline: Some(Duration::from_secs(6)),
        ..opts()
    };
    let report = stop_pids(&fake, procs.pids(), &o, &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    assert!(
        matches!(
            report.refusals[0].reason,
            SuspendFailure::NoAnswer { step: "lock", .. }
        ),
        "{report:?}"
    );
    assert!(procs.alive(0) && procs.alive(1));
    assert!(journal_has(dir.path(), |e| matches!(
        e,
        Event::CallAbandoned { .. }
    )));
    hang.release();
    // The unlock's return, not its entry: the fake counts a call before it sets the state
    // (waiting for the count alone failed "Locked" against "Running" under load).
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the late lock to be undone", || {
        fake.returned(procs.pid(0), Call::Unlock) == 1
    });
    assert_eq!(fake.count(procs.pid(0), Call::Unlock), 1);
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
}

/// Issue 9 item 4: the stop's deadline budgets the lock attempts: no attempt's timeout reaches
/// past it (main asked for 3 x 30 s, past Kubernetes' grace period), and the refusal says so.
#[test]
fn the_deadline_budgets_the_lock_attempts() {
    let mut procs = Procs::spawn(1);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0));
    for _ in 0..3 {
        fake.fail_next_on(procs.pid(0), Call::Lock, cryo_gpu::CuResult::NOT_READY);
    }
    let (_dir, journal) = temp_journal();
    let deadline = Duration::from_secs(5);
    let o = StopOptions {
        deadline: Some(deadline),
        suspend: SuspendOptions {
            lock_timeout: Duration::from_secs(30),
            ..opts().suspend
        },
        ..opts()
    };
    let report = stop_pids(&fake, procs.pids(), &o, &journal);
    assert!(
        matches!(
            report.refusals[..],
            [Refusal {
                reason: SuspendFailure::LockTimedOut { .. },
                ..
            }]
        ),
        "{report:?}"
    );
    let timeouts = fake.lock_timeouts();
    assert!(!timeouts.is_empty());
    for t in timeouts {
        assert!(t.is_some_and(|t| t < deadline), "a lock attempt of {t:?}");
    }
    assert!(procs.alive(0));
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
}

/// Issue 9 item 5: a process stopped by job control is resumed with SIGCONT (journaled) and
/// stopped as usual; one stopped under a debugger is refused at once, naming the debugger, and
/// no driver call is made on it (main spent its lock attempts, then failed with an unrelated
/// message).
#[test]
fn stopped_processes_are_continued_or_refused_up_front() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0)).add(procs.pid(1));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(procs.pid(0)),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the process to stop", || {
        cryo_testkit::procs::all_threads_in(procs.pid(0), &['T'])
    });
    let (dir, journal) = temp_journal();
    let report = stop_pids(&fake, vec![procs.pid(0)], &opts(), &journal);
    assert!(report.stopped(), "{report:?}");
    assert!(
        report.processes[0]
            .notes
            .iter()
            .any(|n| n.contains("SIGCONT")),
        "{report:?}"
    );
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::Continued { pid } if pid.pid == procs.pid(0))
    ));
    assert!(!procs.alive(0));

    let debugger = cryo_testkit::procs::Debugger::attach(procs.pid(1));
    let report = stop_pids(&fake, vec![procs.pid(1)], &opts(), &journal);
    assert_eq!(report.refusals.len(), 1, "{report:?}");
    let why = report.refusals[0].reason.reason();
    assert!(
        why.contains("debugger") && why.contains(&debugger.pid().to_string()),
        "{why}"
    );
    assert_eq!(fake.count(procs.pid(1), Call::Lock), 0);
    assert!(procs.alive(1));
    drop(debugger);
}

/// Issue 9 item 7: `--fresh` still suspends what can be suspended, and kills without suspension
/// only a process that cannot be suspended (main killed every CUDA process unsuspended).
#[test]
fn fresh_still_tries_the_suspension_first() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0))
        .add(procs.pid(1))
        .make_sticky(procs.pid(1));
    let (dir, journal) = temp_journal();
    let o = StopOptions {
        fresh: true,
        ..opts()
    };
    let report = stop_pids(&fake, procs.pids(), &o, &journal);
    assert!(report.stopped(), "{report:?}");
    assert_eq!(report.unsafe_kills, vec![procs.pid(1)]);
    assert!(report.processes[0].suspended.is_some(), "{report:?}");
    assert!(journal_has(
        dir.path(),
        |e| matches!(e, Event::Checkpointed { pid, .. } if pid.pid == procs.pid(0))
    ));
    assert!(!procs.alive(0) && !procs.alive(1));
}

/// Issue 9 item 9: every stop settles what earlier runs left half-way first, and says so.
#[test]
fn a_stop_settles_earlier_half_way_suspensions_first() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0))
        .set_state(procs.pid(0), ProcessState::Locked);
    let (_dir, journal) = temp_journal();
    let locked = cryo_journal::ProcId::of(procs.pid(0)).unwrap();
    journal
        .append(Event::SuspendStarted {
            pid: locked,
            purpose: cryo_journal::Purpose::Stop,
            by: None,
        })
        .unwrap();
    journal
        .append(Event::Locked { pid: locked, ms: 1 })
        .unwrap();
    let report = stop_pids(&fake, vec![procs.pid(1)], &opts(), &journal);
    assert!(report.stopped());
    assert!(
        matches!(&report.settled[..], [s] if s.pid == locked && s.action == crate::Settlement::Unlocked),
        "{:?}",
        report.settled
    );
    assert_eq!(fake.state_of(procs.pid(0)), ProcessState::Running);
    assert!(procs.alive(0));
}

/// Issue 9 item 6: a process that joins the cgroup during the stop is caught: classified,
/// suspended (it is a CUDA process here), and killed with the rest. Main acted on the
/// processes listed at the start only.
#[test]
fn a_process_that_joins_the_cgroup_during_the_stop_is_caught() {
    let cg = cryo_testkit::cgroup::TestCgroup::new("joiner", 1 << 30);
    let mut first = Procs::spawn(1);
    let mut late = Procs::spawn(1);
    cg.add(first.pid(0));
    let fake = FakeGpu::new();
    fake.add(first.pid(0)).add(late.pid(0));
    let hang = fake.hang_next(first.pid(0), Call::Checkpoint);
    let (_dir, journal) = temp_journal();
    let target = Target::Cgroup(cg.path().to_path_buf()).resolve().unwrap();
    let gpu = fake.gpu();
    let report = std::thread::scope(|s| {
        let t = s.spawn(|| stop(&gpu, &target, &opts(), &journal, &NoProgress));
        hang.wait_reached();
        cg.add(late.pid(0));
        hang.release();
        t.join().unwrap()
    })
    .unwrap();
    assert!(report.stopped(), "{report:?}");
    let joined = report
        .processes
        .iter()
        .find(|p| p.pid == late.pid(0))
        .unwrap_or_else(|| panic!("the joiner is not in the report: {report:?}"));
    assert!(
        joined.notes.iter().any(|n| n.contains("joined")),
        "{joined:?}"
    );
    assert!(joined.suspended.is_some(), "{joined:?}");
    assert!(!first.alive(0) && !late.alive(0));
    assert_eq!(fake.state_of(late.pid(0)), ProcessState::Checkpointed);
}

/// Seam (session 14): a tree that forks while it is stopped (a worker's health-check shells,
/// tokenizer workers). The stop walks the tree again as a cgroup is listed again: a child
/// forked after the listing (here while the root's lock is held) is found, stopped with the
/// rest, and named. Before: the tree was listed once, the child reparented out of it when its
/// parent was killed, and left running.
#[test]
fn a_child_forked_during_the_stop_of_a_tree_is_stopped_too() {
    let tree = Procs::reaping_tree(1);
    let root = tree.pid(0);
    let fake = FakeGpu::new();
    fake.add(root);
    let hang = fake.hang_next(root, Call::Lock);
    let (_dir, journal) = temp_journal();
    let target = Target::Tree(root).resolve().unwrap();
    let gpu = fake.gpu();
    let (report, late) = std::thread::scope(|s| {
        let t = s.spawn(|| stop(&gpu, &target, &opts(), &journal, &NoProgress));
        hang.wait_reached();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(root),
            nix::sys::signal::Signal::SIGUSR1,
        )
        .unwrap();
        let late =
            cryo_testkit::eventually(cryo_testkit::PATIENCE, "the root to fork a child", || {
                let now = cryo_proc::tree(root).unwrap();
                let listed: Vec<Pid> = target.handles().iter().map(ProcHandle::pid).collect();
                now.into_iter().find(|p| !listed.contains(p))
            });
        let late = ProcHandle::open(late).unwrap();
        hang.release();
        (t.join().unwrap(), late)
    });
    let report = report.unwrap();
    assert!(report.stopped(), "{report:?}");
    assert!(
        late.wait_exit(Duration::from_secs(10)),
        "the child forked during the stop, pid {}, was left running",
        late.pid()
    );
    assert_eq!(report.forked(), vec![late.pid()], "{report:?}");
}

/// A stop of a process whose lock a wake (or a park) holds is refused at once naming it:
/// nothing journaled, nothing asked of the driver, nothing killed, and the other processes of
/// the target are left too. Once the holder lets go, the stop goes through; a wake meeting a
/// stop's lock is refused the same way (its holder writes "stop").
#[test]
fn a_stop_of_a_process_a_wake_holds_is_refused_and_nothing_is_done() {
    let mut procs = Procs::spawn(2);
    let fake = FakeGpu::new();
    fake.add(procs.pid(0))
        .set_state(procs.pid(0), ProcessState::Checkpointed);
    fake.add(procs.pid(1));
    let (dir, journal) = temp_journal();
    let state = crate::oplock::state_of(&journal);
    let target = Target::Pids(procs.pids()).resolve().unwrap();
    let me = Some(std::process::id() as Pid);
    for doing in [crate::Op::Wake, crate::Op::Park] {
        let held = crate::oplock::take(&state, &target.handles()[..1], doing).unwrap();
        let before = cryo_journal::read(dir.path()).unwrap().records.len();
        let e = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap_err();
        assert!(
            matches!(e, StopError::InProgress { pid, by, doing: d } if pid == procs.pid(0) && by == me && d == Some(doing)),
            "{e}"
        );
        assert!(
            e.to_string().contains(&format!(
                "pid {} is being {doing} by cryo pid",
                procs.pid(0)
            )),
            "{e}"
        );
        assert_eq!(
            cryo_journal::read(dir.path()).unwrap().records.len(),
            before,
            "journaled"
        );
        for p in procs.pids() {
            assert_eq!(fake.count(p, Call::Lock), 0);
        }
        assert!(procs.alive(0) && procs.alive(1), "killed");
        drop(held);
    }
    // Let go, the stop goes through, and lets go of its locks when it returns.
    let handles: Vec<_> = procs
        .pids()
        .into_iter()
        .map(|p| cryo_proc::ProcHandle::open(p).unwrap())
        .collect();
    let report = stop(&fake.gpu(), &target, &opts(), &journal, &NoProgress).unwrap();
    assert!(report.stopped(), "{report:?}");
    crate::oplock::take(&state, &handles, crate::Op::Wake).unwrap();
    assert!(fake.wedges().is_empty());
}
