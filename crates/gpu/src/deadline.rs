//! Caller-side deadlines on every driver call: a call that does not return is an error, never a
//! hung command, stop or guard.
//!
//! # Design
//! The CUDA driver's checkpoint calls and NVML queries have no deadline of their own (a restore
//! toggle can hang, NVIDIA/cuda-checkpoint#17; a lock can hang on NCCL jobs, #30, #45; a call on a
//! process whose threads cannot run waits for them). [`Bounded`] wraps a backend: each call runs
//! on a thread of its own and the caller waits at most its [`Limits`]; past them the caller gets
//! [`DriverError::NoAnswer`] (or [`InspectError::NoAnswer`]) and the call is *abandoned*: a
//! blocked driver call cannot be cancelled, so its thread stays until the driver returns. What the
//! driver does with it later is not known to the caller, who must look at the process's state
//! again before it decides anything; one case is undone here: a lock that succeeds after its
//! caller gave up is unlocked at once (the caller reported the process as it was, RUNNING).
//!
//! Abandoned calls are counted ([`abandoned`]); past [`MAX_ABANDONED`] of them still blocked, a
//! new call fails at once ([`DriverError::Unresponsive`]) instead of adding a thread: a driver
//! that answers nothing must not exhaust the process.
//!
//! # Limitations
//! A thread per call (tens of microseconds), which matters nowhere next to the driver's own times.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use cryo_proc::Pid;

use crate::{
    CheckpointDriver, DriverError, Gpu, GpuInfo, GpuInspector, GpuPair, GpuProcess, InspectError,
    ProcessState,
};

/// How many abandoned calls may still be blocked in the driver before new calls fail at once.
pub const MAX_ABANDONED: usize = 64;

static ABANDONED: AtomicUsize = AtomicUsize::new(0);

/// Calls whose caller gave up and that are still blocked in the driver.
pub fn abandoned() -> usize {
    ABANDONED.load(Ordering::Relaxed)
}

/// How long a caller waits for each kind of call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Questions: `GetState`, `GetRestoreThreadId`, unlock, and every NVML query.
    pub query: Duration,
    /// A lock waits for the work in flight up to its own timeout; the caller waits this much more.
    pub lock_grace: Duration,
    /// Moving device memory: checkpoint and restore (tens of GB at 2-6 GB/s), and a lock without
    /// a timeout of its own.
    pub transfer: Duration,
    /// No call is waited for past this instant (an operation's overall deadline), whatever its
    /// kind allows.
    pub until: Option<Instant>,
}

impl Default for Limits {
    /// Generous enough for any healthy driver: 10 s per question, 10 s past a lock's timeout,
    /// 10 min per transfer (140 GB at the measured 2 GB/s takes 70 s).
    fn default() -> Self {
        Limits {
            query: Duration::from_secs(10),
            lock_grace: Duration::from_secs(10),
            transfer: Duration::from_secs(600),
            until: None,
        }
    }
}

impl Limits {
    /// These limits, with no call waited for past `until`.
    pub fn until(self, until: Instant) -> Self {
        Limits {
            until: Some(self.until.map_or(until, |u| u.min(until))),
            ..self
        }
    }

    /// The wait allowed for a call whose kind allows `base`.
    fn cap(&self, base: Duration) -> Duration {
        match self.until {
            Some(u) => base.min(u.saturating_duration_since(Instant::now())),
            None => base,
        }
    }

    fn lock(&self, timeout: Option<Duration>) -> Duration {
        self.cap(timeout.map_or(self.transfer, |t| t.saturating_add(self.lock_grace)))
    }
}

/// A call that was not waited for to the end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Late {
    /// No answer within the limit (the call is abandoned and may still take effect).
    Elapsed(Duration),
    /// Too many earlier calls are still blocked; this one was not made.
    Unresponsive(usize),
    /// No thread could be started for the call; it was not made.
    NoThread,
}

/// Where a call's answer meets its caller.
enum Slot<T> {
    Waiting,
    Done(T),
    Abandoned,
}

/// Runs `call` on a thread of its own and waits at most `limit` for it. `on_late` gets the
/// result if it comes after the caller gave up.
pub fn within<T: Send + 'static>(
    limit: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    on_late: impl FnOnce(T) + Send + 'static,
) -> Result<T, Late> {
    let pending = abandoned();
    if pending >= MAX_ABANDONED {
        return Err(Late::Unresponsive(pending));
    }
    let slot = Arc::new((Mutex::new(Slot::Waiting), Condvar::new()));
    let theirs = Arc::clone(&slot);
    let spawned = std::thread::Builder::new()
        .name("cryo-driver-call".into())
        .spawn(move || {
            let out = call();
            let (m, cv) = &*theirs;
            let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
            if matches!(*s, Slot::Abandoned) {
                drop(s);
                ABANDONED.fetch_sub(1, Ordering::Relaxed);
                on_late(out);
            } else {
                *s = Slot::Done(out);
                cv.notify_all();
            }
        });
    if spawned.is_err() {
        return Err(Late::NoThread);
    }
    let start = Instant::now();
    let deadline = start + limit;
    let (m, cv) = &*slot;
    let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
    loop {
        if let Slot::Done(_) = *s {
            return match std::mem::replace(&mut *s, Slot::Waiting) {
                Slot::Done(out) => Ok(out),
                _ => Err(Late::NoThread),
            };
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            *s = Slot::Abandoned;
            ABANDONED.fetch_add(1, Ordering::Relaxed);
            return Err(Late::Elapsed(start.elapsed()));
        }
        s = cv
            .wait_timeout(s, left)
            .map(|(g, _)| g)
            .unwrap_or_else(|p| p.into_inner().0);
    }
}

impl Late {
    fn driver(self, call: &'static str, pid: Pid) -> DriverError {
        match self {
            Late::Elapsed(after) => DriverError::NoAnswer { call, pid, after },
            Late::Unresponsive(pending) => DriverError::Unresponsive { call, pid, pending },
            Late::NoThread => DriverError::Unresponsive {
                call,
                pid,
                pending: abandoned(),
            },
        }
    }

    fn inspect(self, what: &'static str) -> InspectError {
        match self {
            Late::Elapsed(after) => InspectError::NoAnswer { what, after },
            Late::Unresponsive(_) | Late::NoThread => InspectError::NoAnswer {
                what,
                after: Duration::ZERO,
            },
        }
    }
}

/// A backend whose every call is bounded by [`Limits`] (see the module docs).
#[derive(Clone)]
pub struct Bounded {
    driver: Arc<dyn CheckpointDriver>,
    inspect: Arc<dyn GpuInspector>,
    limits: Limits,
}

impl std::fmt::Debug for Bounded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bounded")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl Limits {
    /// Both limits at once: the tighter of each kind and of the overall deadlines (what a call
    /// bounded by one and then by the other would be waited for).
    fn tighter(self, other: Limits) -> Limits {
        let until = match (self.until, other.until) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Limits {
            query: self.query.min(other.query),
            lock_grace: self.lock_grace.min(other.lock_grace),
            transfer: self.transfer.min(other.transfer),
            until,
        }
    }
}

/// The [`Bounded`] layer behind `gpu`, when both its APIs are that one layer (what
/// [`Gpu::bounded`] makes).
fn bounded_layer(gpu: &Gpu) -> Option<&Bounded> {
    let driver = Arc::as_ptr(&gpu.driver).cast::<()>();
    let inspect = Arc::as_ptr(&gpu.inspect).cast::<()>();
    if driver != inspect {
        return None;
    }
    gpu.driver.as_bounded()
}

impl Gpu {
    /// The same backend with every call bounded by `limits` (see [`crate::deadline`]). A backend
    /// that is already bounded gets one layer with the tighter limits of both, not a second
    /// layer: each layer is a thread and a wake-up more per call (a freeze bounded its calls
    /// three times over, and on a loaded host every wake-up waits for a core).
    pub fn bounded(&self, limits: Limits) -> Gpu {
        let b = Arc::new(match bounded_layer(self) {
            Some(inner) => Bounded {
                driver: Arc::clone(&inner.driver),
                inspect: Arc::clone(&inner.inspect),
                limits: inner.limits.tighter(limits),
            },
            None => Bounded {
                driver: Arc::clone(&self.driver),
                inspect: Arc::clone(&self.inspect),
                limits,
            },
        });
        Gpu {
            kind: self.kind,
            driver: b.clone(),
            inspect: b,
        }
    }
}

/// Runs a driver call under `limit`.
fn drive<T: Send + 'static>(
    limit: Duration,
    call: &'static str,
    pid: Pid,
    f: impl FnOnce() -> Result<T, DriverError> + Send + 'static,
    on_late: impl FnOnce(Result<T, DriverError>) + Send + 'static,
) -> Result<T, DriverError> {
    within(limit, f, on_late).unwrap_or_else(|late| {
        tracing::error!(pid, call, ?late, "driver call abandoned: no answer in time");
        Err(late.driver(call, pid))
    })
}

fn late_log<T>(call: &'static str, pid: Pid) -> impl FnOnce(Result<T, DriverError>) {
    move |r| match r {
        Ok(_) => tracing::warn!(pid, call, "an abandoned driver call succeeded late"),
        Err(e) => tracing::warn!(pid, call, error = %e, "an abandoned driver call failed late"),
    }
}

fn inspect<T: Send + 'static>(
    limit: Duration,
    what: &'static str,
    f: impl FnOnce() -> Result<T, InspectError> + Send + 'static,
) -> Result<T, InspectError> {
    within(limit, f, |_| {}).unwrap_or_else(|late| {
        tracing::error!(what, ?late, "NVML query abandoned: no answer in time");
        Err(late.inspect(what))
    })
}

impl CheckpointDriver for Bounded {
    fn as_bounded(&self) -> Option<&Bounded> {
        Some(self)
    }

    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        let d = Arc::clone(&self.driver);
        const CALL: &str = "cuCheckpointProcessGetState";
        drive(
            self.limits.cap(self.limits.query),
            CALL,
            pid,
            move || d.state(pid),
            late_log(CALL, pid),
        )
    }

    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        let d = Arc::clone(&self.driver);
        let undo = Arc::clone(&self.driver);
        const CALL: &str = "cuCheckpointProcessLock";
        drive(
            self.limits.lock(timeout),
            CALL,
            pid,
            move || d.lock(pid, timeout),
            move |r| {
                // The caller reported the process as it was (RUNNING): make that true again.
                if r.is_ok() {
                    tracing::warn!(
                        pid,
                        "a lock abandoned by its caller succeeded late; unlocking"
                    );
                    if let Err(e) = undo.unlock(pid) {
                        tracing::error!(pid, error = %e, "cannot unlock after a late lock; the process stays LOCKED");
                    }
                }
            },
        )
    }

    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        let d = Arc::clone(&self.driver);
        const CALL: &str = "cuCheckpointProcessCheckpoint";
        drive(
            self.limits.cap(self.limits.transfer),
            CALL,
            pid,
            move || d.checkpoint(pid),
            late_log(CALL, pid),
        )
    }

    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        let d = Arc::clone(&self.driver);
        let pairs = pairs.to_vec();
        const CALL: &str = "cuCheckpointProcessRestore";
        drive(
            self.limits.cap(self.limits.transfer),
            CALL,
            pid,
            move || d.restore(pid, &pairs),
            late_log(CALL, pid),
        )
    }

    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        let d = Arc::clone(&self.driver);
        const CALL: &str = "cuCheckpointProcessUnlock";
        drive(
            self.limits.cap(self.limits.query),
            CALL,
            pid,
            move || d.unlock(pid),
            late_log(CALL, pid),
        )
    }

    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        let d = Arc::clone(&self.driver);
        const CALL: &str = "cuCheckpointProcessGetRestoreThreadId";
        drive(
            self.limits.cap(self.limits.query),
            CALL,
            pid,
            move || d.restore_thread_id(pid),
            late_log(CALL, pid),
        )
    }
}

impl GpuInspector for Bounded {
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
        let i = Arc::clone(&self.inspect);
        inspect(self.limits.cap(self.limits.query), "GPUs", move || i.gpus())
    }

    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
        let i = Arc::clone(&self.inspect);
        inspect(self.limits.cap(self.limits.query), "processes", move || {
            i.processes()
        })
    }

    fn driver_version(&self) -> Result<String, InspectError> {
        let i = Arc::clone(&self.inspect);
        inspect(
            self.limits.cap(self.limits.query),
            "driver version",
            move || i.driver_version(),
        )
    }

    fn driver_fds(&self, pid: Pid) -> Result<Vec<i32>, InspectError> {
        let i = Arc::clone(&self.inspect);
        inspect(
            self.limits.cap(self.limits.query),
            "driver fds",
            move || i.driver_fds(pid),
        )
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::sync::mpsc;

    /// A gate a test opens: calls wait on it.
    #[derive(Default)]
    struct Gate(Mutex<bool>, Condvar);

    impl Gate {
        fn wait(&self) {
            let mut open = self.0.lock().unwrap();
            while !*open {
                open = self.1.wait(open).unwrap();
            }
        }
        fn open(&self) {
            *self.0.lock().unwrap() = true;
            self.1.notify_all();
        }
    }

    #[test]
    fn a_call_that_does_not_return_is_an_error_and_its_late_answer_is_handed_on() {
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let (late_tx, late_rx) = mpsc::channel();
        let r = within(
            Duration::from_millis(50),
            move || {
                g.wait();
                7
            },
            move |v| late_tx.send(v).unwrap(),
        );
        assert!(matches!(r, Err(Late::Elapsed(d)) if d >= Duration::from_millis(50)));
        gate.open();
        assert_eq!(late_rx.recv().unwrap(), 7);
    }

    #[test]
    fn a_call_that_returns_in_time_is_its_answer() {
        assert_eq!(within(Duration::from_secs(60), || 3, |_| {}), Ok(3));
    }

    /// A backend whose `state` blocks until a test opens its gate, counting the threads named
    /// for driver calls while it blocks.
    #[derive(Default)]
    struct Blocking {
        gate: Gate,
        threads: Mutex<Vec<usize>>,
    }

    /// This process's threads named as the deadline layer names its call threads (`comm` is
    /// cut at 15 bytes).
    fn call_threads() -> usize {
        std::fs::read_dir("/proc/self/task")
            .unwrap()
            .filter_map(|t| std::fs::read_to_string(t.unwrap().path().join("comm")).ok())
            .filter(|c| c.trim_end() == "cryo-driver-cal")
            .count()
    }

    impl CheckpointDriver for Blocking {
        fn state(&self, _pid: Pid) -> Result<ProcessState, DriverError> {
            self.threads.lock().unwrap().push(call_threads());
            self.gate.wait();
            Ok(ProcessState::Running)
        }
        fn lock(&self, _: Pid, _: Option<Duration>) -> Result<(), DriverError> {
            Ok(())
        }
        fn checkpoint(&self, _: Pid) -> Result<(), DriverError> {
            Ok(())
        }
        fn restore(&self, _: Pid, _: &[GpuPair]) -> Result<(), DriverError> {
            Ok(())
        }
        fn unlock(&self, _: Pid) -> Result<(), DriverError> {
            Ok(())
        }
        fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
            Ok(pid)
        }
    }

    impl GpuInspector for Blocking {
        fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
            Ok(Vec::new())
        }
        fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
            Ok(Vec::new())
        }
        fn driver_version(&self) -> Result<String, InspectError> {
            Ok(String::new())
        }
        fn driver_fds(&self, _: Pid) -> Result<Vec<i32>, InspectError> {
            Ok(Vec::new())
        }
    }

    #[test]
    fn bounding_a_bounded_backend_again_is_one_layer_with_the_tighter_limits() {
        let fake = Arc::new(Blocking::default());
        let gpu = Gpu {
            kind: crate::BackendKind::Sim,
            driver: fake.clone(),
            inspect: fake.clone(),
        };
        let before = call_threads();
        // The inner layer's deadline is the tighter one: it must survive the outer layer.
        let tight = Limits::default().until(Instant::now() + Duration::from_millis(200));
        let twice = gpu.bounded(tight).bounded(Limits::default());
        let t = Instant::now();
        let r = twice.driver.state(1);
        assert!(
            matches!(r, Err(DriverError::NoAnswer { .. })),
            "{r:?} after {:?}",
            t.elapsed()
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        // One thread carried the call, not one per layer.
        assert_eq!(*fake.threads.lock().unwrap(), vec![before + 1]);
        fake.gate.open();
    }

    #[test]
    fn an_overall_deadline_caps_every_kind() {
        let l = Limits::default().until(Instant::now() + Duration::from_millis(100));
        assert!(l.cap(l.transfer) <= Duration::from_millis(100));
        assert!(l.lock(Some(Duration::from_secs(30))) <= Duration::from_millis(100));
        let unbounded = Limits::default();
        assert_eq!(
            unbounded.lock(Some(Duration::from_secs(30))),
            Duration::from_secs(40)
        );
    }
}
