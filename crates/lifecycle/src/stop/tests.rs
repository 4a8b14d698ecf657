#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `stop` against a fake driver and real (non-CUDA) processes: the decisions, not the driver.

use std::collections::HashMap;
use std::process::{Child, Command};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cryo_gpu::{
    BackendKind, CheckpointDriver, CuResult, DriverError, Gpu, GpuInfo, GpuInspector, GpuPair,
    GpuProcess, GpuUuid, InspectError, ProcessState,
};
use cryo_journal::{Event, Journal};
use cryo_proc::Pid;

use super::*;
use crate::NoProgress;
use crate::Target;

#[derive(Debug, Clone, Copy)]
struct FakeProc {
    state: ProcessState,
    sticky: bool,
}

/// A driver that knows the pids it is told about, and lists RUNNING/LOCKED ones with 1 MiB.
#[derive(Debug, Clone, Default)]
struct Fake(
    Arc<Mutex<HashMap<Pid, FakeProc>>>,
    /// A process that dies on its own when this driver call reaches it.
    Arc<Mutex<Option<(Pid, &'static str)>>>,
);

impl Fake {
    fn add(&self, pid: Pid, sticky: bool) {
        self.0.lock().unwrap().insert(
            pid,
            FakeProc {
                state: ProcessState::Running,
                sticky,
            },
        );
    }
    fn state_of(&self, pid: Pid) -> ProcessState {
        self.0.lock().unwrap()[&pid].state
    }
    fn gpu(&self) -> Gpu {
        Gpu {
            kind: BackendKind::Sim,
            driver: Arc::new(self.clone()),
            inspect: Arc::new(self.clone()),
        }
    }
    /// Kills `pid` and answers as the driver does for a process that is gone, when `pid` is the
    /// one set to die at `call`.
    fn vanish(&self, pid: Pid, call: &'static str) -> Result<(), DriverError> {
        if *self.1.lock().unwrap() != Some((pid, call)) {
            return Ok(());
        }
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
        while running(pid) {
            std::thread::sleep(Duration::from_millis(5));
        }
        Err(DriverError::Cuda {
            call,
            pid,
            code: CuResult::INVALID_VALUE,
        })
    }
    fn step(
        &self,
        pid: Pid,
        call: &'static str,
        from: ProcessState,
        to: ProcessState,
    ) -> Result<(), DriverError> {
        self.vanish(pid, call)?;
        let mut m = self.0.lock().unwrap();
        let err = |code| Err(DriverError::Cuda { call, pid, code });
        let Some(p) = m.get_mut(&pid) else {
            return err(CuResult::NOT_INITIALIZED);
        };
        if p.sticky {
            return err(CuResult::ILLEGAL_ADDRESS);
        }
        if p.state != from {
            return err(CuResult::ILLEGAL_STATE);
        }
        p.state = to;
        Ok(())
    }
}

impl CheckpointDriver for Fake {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        self.vanish(pid, "state")?;
        self.0
            .lock()
            .unwrap()
            .get(&pid)
            .map(|p| p.state)
            .ok_or(DriverError::Cuda {
                call: "state",
                pid,
                code: CuResult::NOT_INITIALIZED,
            })
    }
    fn lock(&self, pid: Pid, _: Option<Duration>) -> Result<(), DriverError> {
        self.step(pid, "lock", ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        self.step(
            pid,
            "checkpoint",
            ProcessState::Locked,
            ProcessState::Checkpointed,
        )
    }
    fn restore(&self, pid: Pid, _: &[GpuPair]) -> Result<(), DriverError> {
        self.step(
            pid,
            "restore",
            ProcessState::Checkpointed,
            ProcessState::Locked,
        )
    }
    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        self.step(pid, "unlock", ProcessState::Locked, ProcessState::Running)
    }
    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        Ok(pid)
    }
}

impl GpuInspector for Fake {
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
        Ok(Vec::new())
    }
    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
        let m = self.0.lock().unwrap();
        Ok(m.iter()
            // As the driver does, a process's context goes with its files when it exits.
            .filter(|(&pid, p)| {
                matches!(p.state, ProcessState::Running | ProcessState::Locked) && running(pid)
            })
            .map(|(&pid, _)| GpuProcess {
                pid,
                gpu_index: 0,
                gpu_uuid: uuid(),
                used_memory: 1 << 20,
            })
            .collect())
    }
    fn driver_version(&self) -> Result<String, InspectError> {
        Ok("fake".into())
    }
    fn driver_fds(&self, _: Pid) -> Result<Vec<i32>, InspectError> {
        Ok(Vec::new())
    }
}

/// Not exited (a zombie has).
fn running(pid: Pid) -> bool {
    cryo_proc::stat(pid).is_ok_and(|s| s.state != 'Z' && s.state != 'X')
}

fn uuid() -> GpuUuid {
    "GPU-00000000-0000-0000-0000-000000000000".parse().unwrap()
}

struct Procs(Vec<Child>);

impl Procs {
    fn spawn(n: usize) -> Procs {
        Procs(
            (0..n)
                .map(|_| Command::new("sleep").arg("60").spawn().unwrap())
                .collect(),
        )
    }
    fn pid(&self, i: usize) -> Pid {
        self.0[i].id() as Pid
    }
    fn alive(&mut self, i: usize) -> bool {
        self.0[i].try_wait().unwrap().is_none()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
    fake.add(procs.pid(1), true);
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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
    fake.add(procs.pid(1), false);
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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
    fake.lock(procs.pid(0), None).unwrap();
    fake.checkpoint(procs.pid(0)).unwrap();
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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
    *fake.1.lock().unwrap() = Some((procs.pid(1), "state"));
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
    let fake = Fake::default();
    fake.add(procs.pid(0), false);
    fake.add(procs.pid(1), false);
    *fake.1.lock().unwrap() = Some((procs.pid(1), "lock"));
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
