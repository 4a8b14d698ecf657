//! A fake driver: the `cryo-gpu` traits in process, scripted by the test, with error injection.
//!
//! It knows the pids it is told about ([`FakeGpu::add`]); every other pid is "not a CUDA process"
//! (`CUDA_ERROR_NOT_INITIALIZED`), as on the real driver. Transitions follow the driver's rules
//! (lock from RUNNING, checkpoint from LOCKED, restore from CHECKPOINTED to LOCKED, unlock from
//! LOCKED; anything else `CUDA_ERROR_ILLEGAL_STATE`, a sticky context `CUDA_ERROR_ILLEGAL_ADDRESS`).
//! NVML lists a RUNNING or LOCKED process while it lives (its context goes with its files).
//!
//! Errors are injected per call ([`FakeGpu::fail_next`], [`FakeGpu::fail_next_on`]); a call can
//! hang until the test lets it go ([`FakeGpu::hang_next`]); a process can die the moment a call
//! reaches it ([`FakeGpu::exit_at`]). Every call is recorded ([`FakeGpu::calls`]), and so is
//! every live restored context torn down ([`FakeGpu::wedges`]): a process that went through a
//! restore and died while RUNNING or LOCKED.

use std::collections::HashMap;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use cryo_gpu::{
    BackendKind, CheckpointDriver, CuResult, DriverError, Gpu, GpuInfo, GpuInspector, GpuPair,
    GpuProcess, GpuUuid, InspectError, ProcessState,
};

use cryo_proc::Pid;

use crate::{eventually, procs, PATIENCE};

/// A checkpoint-API entry point.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Call {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreThreadId,
}

impl Call {
    fn name(self) -> &'static str {
        match self {
            Call::State => "cuCheckpointProcessGetState",
            Call::Lock => "cuCheckpointProcessLock",
            Call::Checkpoint => "cuCheckpointProcessCheckpoint",
            Call::Restore => "cuCheckpointProcessRestore",
            Call::Unlock => "cuCheckpointProcessUnlock",
            Call::RestoreThreadId => "cuCheckpointProcessGetRestoreThreadId",
        }
    }
}

/// One process as the fake driver knows it.
#[derive(Debug, Clone)]
struct Proc {
    state: ProcessState,
    sticky: bool,
    gpu: u32,
    bytes: u64,
    restored: bool,
    keep_listed: bool,
}

#[derive(Debug)]
enum Injected {
    Code(CuResult),
    Hang(Hang),
    Exit,
    UnknownState(u32),
}

#[derive(Debug, Default)]
struct Inner {
    procs: HashMap<Pid, Proc>,
    injected: Vec<(Option<Pid>, Call, Injected)>,
    calls: Vec<(Pid, Call)>,
    /// The transition calls (lock, checkpoint, restore, unlock) that returned, their effect
    /// applied (or refused).
    returned: Vec<(Pid, Call)>,
    lock_timeouts: Vec<Option<Duration>>,
    restore_pairs: Vec<Vec<GpuPair>>,
    scripted: Vec<(Pid, Call, usize, ProcessState)>,
    driver_fds: HashMap<Pid, Vec<i32>>,
    /// NVML's process list fails (`nvmlDeviceGetComputeRunningProcesses` erring) while set.
    nvml_down: bool,
}

/// A call held by [`FakeGpu::hang_next`] until [`Hang::release`].
#[derive(Debug, Clone, Default)]
pub struct Hang(Arc<(Mutex<(bool, bool)>, Condvar)>);

impl Hang {
    /// Waits until the call has reached the driver (and hangs there).
    pub fn wait_reached(&self) {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap();
        while !g.0 {
            let (next, timeout) = cv.wait_timeout(g, PATIENCE).unwrap();
            assert!(!timeout.timed_out(), "the hung call never came");
            g = next;
        }
    }

    /// Lets the call go on.
    pub fn release(&self) {
        let (m, cv) = &*self.0;
        m.lock().unwrap().1 = true;
        cv.notify_all();
    }

    fn hold(&self) {
        let (m, cv) = &*self.0;
        let mut g = m.lock().unwrap();
        g.0 = true;
        cv.notify_all();
        while !g.1 {
            g = cv.wait(g).unwrap();
        }
    }
}

/// The fake driver; clones share one state. See the module docs.
#[derive(Debug, Clone, Default)]
pub struct FakeGpu(Arc<Mutex<Inner>>);

/// Device memory the fake attributes to a process unless told otherwise.
pub const DEFAULT_BYTES: u64 = 1 << 20;
/// The GPUs the fake has.
pub const GPUS: [&str; 2] = [
    "GPU-fa4e0000-0000-0000-0000-000000000000",
    "GPU-fa4e0000-0000-0000-0000-000000000001",
];
/// Their model.
pub const MODEL: &str = "fake GPU";
/// Their total memory each.
pub const GPU_MEMORY: u64 = 16 << 30;

impl FakeGpu {
    /// A driver with two GPUs and no CUDA process.
    pub fn new() -> Self {
        Self::default()
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Both traits behind one [`Gpu`].
    pub fn gpu(&self) -> Gpu {
        Gpu {
            kind: BackendKind::Sim,
            driver: Arc::new(self.clone()),
            inspect: Arc::new(self.clone()),
        }
    }

    /// Makes `pid` a RUNNING CUDA process on GPU 0 with [`DEFAULT_BYTES`].
    pub fn add(&self, pid: Pid) -> &Self {
        self.inner().procs.insert(
            pid,
            Proc {
                state: ProcessState::Running,
                sticky: false,
                gpu: 0,
                bytes: DEFAULT_BYTES,
                restored: false,
                keep_listed: false,
            },
        );
        self
    }

    fn with(&self, pid: Pid, f: impl FnOnce(&mut Proc)) -> &Self {
        let mut g = self.inner();
        f(g.procs.get_mut(&pid).expect("add the pid first"));
        self
    }

    /// Puts `pid` in `state` (a process found LOCKED, CHECKPOINTED, FAILED...).
    pub fn set_state(&self, pid: Pid, state: ProcessState) -> &Self {
        self.with(pid, |p| p.state = state)
    }

    /// Gives `pid`'s context a sticky error: lock and checkpoint answer
    /// `CUDA_ERROR_ILLEGAL_ADDRESS`.
    pub fn make_sticky(&self, pid: Pid) -> &Self {
        self.with(pid, |p| p.sticky = true)
    }

    /// Declares `pid`'s context restored (tearing it down live is a wedge).
    pub fn mark_restored(&self, pid: Pid) -> &Self {
        self.with(pid, |p| p.restored = true)
    }

    /// Puts `pid` on GPU `index` with `bytes` of device memory.
    pub fn place(&self, pid: Pid, index: u32, bytes: u64) -> &Self {
        self.with(pid, |p| {
            p.gpu = index;
            p.bytes = bytes;
        })
    }

    /// NVML keeps listing `pid`'s memory whatever its state (someone else holds its driver
    /// files, or the driver lags).
    pub fn keep_listed(&self, pid: Pid) -> &Self {
        self.with(pid, |p| p.keep_listed = true)
    }

    /// When the `nth` (1-based) `call` on `pid` arrives, the process is first put in `state`, as
    /// if something else had acted on it in between (a concurrent restore, a driver fault).
    pub fn set_state_at(&self, pid: Pid, call: Call, nth: usize, state: ProcessState) -> &Self {
        self.inner().scripted.push((pid, call, nth, state));
        self
    }

    /// The next `call` (on any pid) answers `code` and changes nothing.
    pub fn fail_next(&self, call: Call, code: CuResult) -> &Self {
        self.inner()
            .injected
            .push((None, call, Injected::Code(code)));
        self
    }

    /// The next `call` on `pid` answers `code` and changes nothing.
    pub fn fail_next_on(&self, pid: Pid, call: Call, code: CuResult) -> &Self {
        self.inner()
            .injected
            .push((Some(pid), call, Injected::Code(code)));
        self
    }

    /// The next `call` on `pid` hangs until the returned [`Hang`] is released, then goes on.
    pub fn hang_next(&self, pid: Pid, call: Call) -> Hang {
        let h = Hang::default();
        self.inner()
            .injected
            .push((Some(pid), call, Injected::Hang(h.clone())));
        h
    }

    /// `pid` dies (SIGKILL) the moment `call` reaches it; the call answers as the driver does
    /// for a process that is gone (`CUDA_ERROR_INVALID_VALUE`).
    pub fn exit_at(&self, pid: Pid, call: Call) -> &Self {
        self.inner()
            .injected
            .push((Some(pid), call, Injected::Exit));
        self
    }

    /// `pid` holds driver files `fds` (what `driver_fds` lists for it; nothing by default). For a
    /// pid not [`FakeGpu::add`]ed: a process that only ran `cuInit`, as the real driver may see
    /// it; for one added, files it holds whatever its state.
    pub fn driver_files(&self, pid: Pid, fds: &[i32]) -> &Self {
        self.inner().driver_fds.insert(pid, fds.to_vec());
        self
    }

    /// The next `times` state queries on `pid` answer a state this build does not know (`raw`,
    /// such as 4 or 5 of newer drivers: CHECKPOINTING, RESTORING).
    pub fn unknown_state_next(&self, pid: Pid, raw: u32, times: usize) -> &Self {
        let mut g = self.inner();
        for _ in 0..times {
            g.injected
                .push((Some(pid), Call::State, Injected::UnknownState(raw)));
        }
        drop(g);
        self
    }

    /// The state the driver holds for `pid`.
    pub fn state_of(&self, pid: Pid) -> ProcessState {
        self.inner().procs[&pid].state
    }

    /// The state the driver holds for `pid`, `None` for a pid it does not know; no call is
    /// recorded (what a test or a fake CRIU looks at).
    pub fn driver_state(&self, pid: Pid) -> Option<ProcessState> {
        self.inner().procs.get(&pid).map(|p| p.state)
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<(Pid, Call)> {
        self.inner().calls.clone()
    }

    /// The timeout of every lock, in order.
    pub fn lock_timeouts(&self) -> Vec<Option<Duration>> {
        self.inner().lock_timeouts.clone()
    }

    /// The GPU pairs of every restore, in order.
    pub fn restore_pairs(&self) -> Vec<Vec<GpuPair>> {
        self.inner().restore_pairs.clone()
    }

    /// How many times `call` reached `pid`.
    pub fn count(&self, pid: Pid, call: Call) -> usize {
        self.inner()
            .calls
            .iter()
            .filter(|c| **c == (pid, call))
            .count()
    }

    /// How many times `call` (a transition: lock, checkpoint, restore, unlock) returned for
    /// `pid`, its effect on the state applied or refused. [`FakeGpu::count`] counts a call as
    /// it enters, before its effect: a test that waits for a call's effect waits for this.
    pub fn returned(&self, pid: Pid, call: Call) -> usize {
        self.inner()
            .returned
            .iter()
            .filter(|c| **c == (pid, call))
            .count()
    }

    /// NVML's process list fails from now on (`down`: as a wedged NVML, no answer in time), or
    /// answers again.
    pub fn nvml_down(&self, down: bool) -> &Self {
        self.inner().nvml_down = down;
        self
    }

    /// Restored contexts torn down live: processes that went through a restore and have died
    /// while RUNNING or LOCKED. Must stay empty.
    pub fn wedges(&self) -> Vec<Pid> {
        let mut w: Vec<Pid> = self
            .inner()
            .procs
            .iter()
            .filter(|(pid, p)| {
                p.restored
                    && matches!(p.state, ProcessState::Running | ProcessState::Locked)
                    && !procs::alive(**pid)
            })
            .map(|(pid, _)| *pid)
            .collect();
        w.sort_unstable();
        w
    }

    /// Runs the injections for `(pid, call)` and records the call; `Err` when one answers.
    fn enter(&self, pid: Pid, call: Call) -> Result<(), DriverError> {
        let injected = {
            let mut g = self.inner();
            g.calls.push((pid, call));
            let n = g.calls.iter().filter(|c| **c == (pid, call)).count();
            let scripted: Vec<ProcessState> = g
                .scripted
                .iter()
                .filter(|(p, c, nth, _)| (*p, *c, *nth) == (pid, call, n))
                .map(|s| s.3)
                .collect();
            for state in scripted {
                if let Some(p) = g.procs.get_mut(&pid) {
                    p.state = state;
                }
            }
            let i = g
                .injected
                .iter()
                .position(|(p, c, _)| *c == call && p.is_none_or(|p| p == pid));
            i.map(|i| g.injected.remove(i).2)
        };
        let err = |code| DriverError::Cuda {
            call: call.name(),
            pid,
            code,
        };
        match injected {
            None => Ok(()),
            Some(Injected::Code(code)) => Err(err(code)),
            Some(Injected::Hang(h)) => {
                h.hold();
                Ok(())
            }
            Some(Injected::UnknownState(raw)) => Err(DriverError::UnknownState { pid, raw }),
            Some(Injected::Exit) => {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
                eventually(PATIENCE, "the process to die", || !procs::alive(pid));
                Err(err(CuResult::INVALID_VALUE))
            }
        }
    }

    fn step(
        &self,
        pid: Pid,
        call: Call,
        from: ProcessState,
        to: ProcessState,
    ) -> Result<(), DriverError> {
        self.enter(pid, call)?;
        let mut g = self.inner();
        // Under the same lock as the effect below: once this is counted, the state is set.
        g.returned.push((pid, call));
        let err = |code| {
            Err(DriverError::Cuda {
                call: call.name(),
                pid,
                code,
            })
        };
        if !procs::alive(pid) {
            return err(CuResult::INVALID_VALUE);
        }
        let Some(p) = g.procs.get_mut(&pid) else {
            return err(CuResult::NOT_INITIALIZED);
        };
        if p.sticky && matches!(call, Call::Lock | Call::Checkpoint) {
            return err(CuResult::ILLEGAL_ADDRESS);
        }
        if p.state != from {
            return err(CuResult::ILLEGAL_STATE);
        }
        p.state = to;
        if call == Call::Restore {
            p.restored = true;
        }
        Ok(())
    }
}

impl CheckpointDriver for FakeGpu {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        self.enter(pid, Call::State)?;
        let code = if procs::alive(pid) {
            match self.inner().procs.get(&pid) {
                Some(p) => return Ok(p.state),
                None => CuResult::NOT_INITIALIZED,
            }
        } else {
            CuResult::INVALID_VALUE
        };
        Err(DriverError::Cuda {
            call: Call::State.name(),
            pid,
            code,
        })
    }
    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        self.inner().lock_timeouts.push(timeout);
        self.step(pid, Call::Lock, ProcessState::Running, ProcessState::Locked)
    }
    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        self.step(
            pid,
            Call::Checkpoint,
            ProcessState::Locked,
            ProcessState::Checkpointed,
        )
    }
    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.inner().restore_pairs.push(pairs.to_vec());
        self.step(
            pid,
            Call::Restore,
            ProcessState::Checkpointed,
            ProcessState::Locked,
        )
    }
    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        self.step(
            pid,
            Call::Unlock,
            ProcessState::Locked,
            ProcessState::Running,
        )
    }
    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        self.enter(pid, Call::RestoreThreadId)?;
        Ok(pid)
    }
}

fn uuid(i: u32) -> GpuUuid {
    GPUS[i as usize % GPUS.len()].parse().unwrap()
}

impl GpuInspector for FakeGpu {
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
        let listed = self.processes()?;
        Ok((0..GPUS.len() as u32)
            .map(|i| GpuInfo {
                index: i,
                uuid: uuid(i),
                name: MODEL.into(),
                memory_total: GPU_MEMORY,
                memory_free: GPU_MEMORY
                    - listed
                        .iter()
                        .filter(|p| p.gpu_index == i)
                        .map(|p| p.used_memory)
                        .sum::<u64>(),
            })
            .collect())
    }
    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
        if self.inner().nvml_down {
            // As a wedged NVML looks to cryo: the query under its deadline never returned.
            return Err(InspectError::NoAnswer {
                what: "running processes",
                after: Duration::from_secs(10),
            });
        }
        let mut out: Vec<GpuProcess> = self
            .inner()
            .procs
            .iter()
            .filter(|(pid, p)| {
                p.keep_listed
                    || (matches!(p.state, ProcessState::Running | ProcessState::Locked)
                        && procs::alive(**pid))
            })
            .map(|(pid, p)| GpuProcess {
                pid: *pid,
                gpu_index: p.gpu,
                gpu_uuid: uuid(p.gpu),
                used_memory: p.bytes,
            })
            .collect();
        out.sort_by_key(|p| p.pid);
        Ok(out)
    }
    fn driver_version(&self) -> Result<String, InspectError> {
        Ok("580.0 (fake)".into())
    }
    fn driver_fds(&self, pid: Pid) -> Result<Vec<i32>, InspectError> {
        Ok(self
            .inner()
            .driver_fds
            .get(&pid)
            .cloned()
            .unwrap_or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::Procs;

    use crate::cu_code as code;

    #[test]
    fn follows_the_drivers_transitions() {
        let p = Procs::spawn(1);
        let f = FakeGpu::new();
        assert_eq!(code(f.state(p.pid(0))), CuResult::NOT_INITIALIZED);
        f.add(p.pid(0));
        assert_eq!(code(f.checkpoint(p.pid(0))), CuResult::ILLEGAL_STATE);
        f.lock(p.pid(0), None).unwrap();
        assert!(f.process_memory(p.pid(0)).unwrap().is_some());
        f.checkpoint(p.pid(0)).unwrap();
        assert!(f.process_memory(p.pid(0)).unwrap().is_none());
        f.restore(p.pid(0), &[]).unwrap();
        f.unlock(p.pid(0)).unwrap();
        assert_eq!(f.state(p.pid(0)).unwrap(), ProcessState::Running);
    }

    #[test]
    fn injected_failures_hit_once_and_change_nothing() {
        let p = Procs::spawn(2);
        let f = FakeGpu::new();
        f.add(p.pid(0)).add(p.pid(1));
        f.fail_next_on(p.pid(1), Call::Lock, CuResult::NOT_READY);
        f.lock(p.pid(0), None).unwrap();
        assert_eq!(code(f.lock(p.pid(1), None)), CuResult::NOT_READY);
        assert_eq!(f.state_of(p.pid(1)), ProcessState::Running);
        f.lock(p.pid(1), None).unwrap();
        assert_eq!(f.count(p.pid(1), Call::Lock), 2);
    }

    #[test]
    fn a_restored_context_killed_live_is_a_wedge() {
        let p = Procs::spawn(2);
        let f = FakeGpu::new();
        for i in 0..2 {
            f.add(p.pid(i))
                .set_state(p.pid(i), ProcessState::Checkpointed);
            f.restore(p.pid(i), &[]).unwrap();
        }
        f.checkpoint(p.pid(1)).unwrap();
        let pids = p.pids();
        drop(p);
        assert_eq!(f.wedges(), vec![pids[0]]);
    }
}
