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
//! The threads that carry the calls (*carriers*) are kept between calls: a call is handed to a
//! carrier that waits for one, and a new carrier is started only when none waits (every carrier
//! is busy with a call in flight or abandoned). A call that never returns holds its carrier and
//! nothing else: the next call gets another. At most [`IDLE_KEPT`] carriers wait; one more ends
//! after its call. Carriers block every signal (a carrier started before a command deferred its
//! termination signals must not take them: a process-directed signal goes to a thread that does
//! not block it).
//!
//! Why kept (session 16): on this project's loaded 2-CPU host a fresh thread waits for a CPU
//! far longer than a woken one. The hand-over alone (a trivial call): 0.12-1.4 ms median, 1.2-3.8
//! ms at the 90th percentile with a thread per call, 19-25 us and 55-71 us with a waiting
//! carrier (load 2.9-7.3). Calls of the simulated driver through this layer, the two ways
//! interleaved (150 rounds of a NVML query, get-state, lock and unlock, 5 ms apart, load 7.8,
//! the driver's daemon serving each connection on a kept thread too): mean 1.09 -> 0.17 ms for
//! the query, 1.9-2.1 -> 0.81-0.86 ms for each checkpoint-API call (paired medians 1.4-2.3x);
//! a freeze makes five such calls before GPU free.
//!
//! # Limitations
//! A carrier blocked in a call serves nothing else until the call returns; then it runs the
//! call's late handler (a late lock's unlock, itself not bounded) and waits like any other.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cryo_proc::Pid;

use crate::{
    CheckpointDriver, DriverError, Gpu, GpuInfo, GpuInspector, GpuPair, GpuProcess, InspectError,
    ProcessState,
};

/// How many abandoned calls may still be blocked in the driver before new calls fail at once.
pub const MAX_ABANDONED: usize = 64;

/// Abandoned calls of one kind still blocked, and how many of them are allowed before a new call
/// of that kind fails at once ([`Late::Unresponsive`]). The driver's calls share one
/// ([`abandoned`]); another user of [`within_counted`] (the image check's reads) keeps its own,
/// so a dead disk and a dead driver do not use up each other's budget.
#[derive(Debug)]
pub struct Abandoned {
    count: AtomicUsize,
    max: usize,
}

impl Abandoned {
    /// A budget of `max` abandoned calls.
    pub const fn new(max: usize) -> Self {
        Abandoned {
            count: AtomicUsize::new(0),
            max,
        }
    }

    /// Calls of this kind whose caller gave up and that have not returned yet.
    pub fn get(&self) -> usize {
        self.count.load(Ordering::Relaxed)
    }
}

static ABANDONED: Abandoned = Abandoned::new(MAX_ABANDONED);

/// Calls whose caller gave up and that are still blocked in the driver.
pub fn abandoned() -> usize {
    ABANDONED.get()
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
    /// The answer was taken by its caller ([`Pending::wait`]).
    Taken,
    Abandoned,
}

/// Runs `call` on a carrier (a thread of the deadline layer, see the module docs) and waits at
/// most `limit` for it. `on_late` gets the result if it comes after the caller gave up.
pub fn within<T: Send + 'static>(
    limit: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    on_late: impl FnOnce(T) + Send + 'static,
) -> Result<T, Late> {
    within_counted(&ABANDONED, limit, call, on_late)
}

/// [`within`], its abandoned calls counted in `budget` (and refused past its maximum) instead
/// of the driver's.
pub fn within_counted<T: Send + 'static>(
    budget: &'static Abandoned,
    limit: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    on_late: impl FnOnce(T) + Send + 'static,
) -> Result<T, Late> {
    start_counted(budget, limit, call, on_late)?.wait()
}

/// Hands `call` to a carrier now and returns at once: its answer is waited for later
/// ([`Pending::wait`]), at most `limit` from now, so the caller does other work meanwhile
/// without a thread of its own for it. A [`Pending`] dropped unanswered is abandoned, as a
/// call not answered in time is (counted; `on_late` gets the answer when it comes).
pub fn start<T: Send + 'static>(
    limit: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    on_late: impl FnOnce(T) + Send + 'static,
) -> Result<Pending<T>, Late> {
    start_counted(&ABANDONED, limit, call, on_late)
}

/// [`start`], its abandoned calls counted in `budget` (and refused past its maximum) instead
/// of the driver's.
pub fn start_counted<T: Send + 'static>(
    budget: &'static Abandoned,
    limit: Duration,
    call: impl FnOnce() -> T + Send + 'static,
    on_late: impl FnOnce(T) + Send + 'static,
) -> Result<Pending<T>, Late> {
    let pending = budget.get();
    if pending >= budget.max {
        return Err(Late::Unresponsive(pending));
    }
    let slot = Arc::new((Mutex::new(Slot::Waiting), Condvar::new()));
    let theirs = Arc::clone(&slot);
    let depth = DEPTH.with(std::cell::Cell::get) + 1;
    let start = Instant::now();
    let handed = CARRIERS.hand(Box::new(move |free: &dyn Fn()| {
        DEPTH.with(|d| d.set(depth));
        let out = call();
        DEPTH.with(|d| d.set(0));
        let (m, cv) = &*theirs;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*s, Slot::Abandoned) {
            drop(s);
            budget.count.fetch_sub(1, Ordering::Relaxed);
            on_late(out);
        } else {
            // Free for the next call before its caller wakes: a caller that calls again at
            // once hands it to this carrier instead of starting one.
            free();
            *s = Slot::Done(out);
            cv.notify_all();
        }
    }));
    if handed.is_err() {
        return Err(Late::NoThread);
    }
    Ok(Pending {
        slot,
        start,
        deadline: start + limit,
        budget,
    })
}

/// A call handed to a carrier by [`start`], its answer not taken yet.
pub struct Pending<T> {
    slot: Arc<(Mutex<Slot<T>>, Condvar)>,
    start: Instant,
    deadline: Instant,
    budget: &'static Abandoned,
}

impl<T> std::fmt::Debug for Pending<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pending")
            .field("deadline", &self.deadline)
            .finish_non_exhaustive()
    }
}

impl<T: Send + 'static> Pending<T> {
    /// What gives up on this call from another thread before its limit ([`GiveUp`]).
    pub fn give_up_handle(&self) -> GiveUp {
        let slot = Arc::clone(&self.slot);
        let budget = self.budget;
        GiveUp(Arc::new(move || {
            let (m, cv) = &*slot;
            let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
            if matches!(*s, Slot::Waiting) {
                *s = Slot::Abandoned;
                budget.count.fetch_add(1, Ordering::Relaxed);
                cv.notify_all();
            }
        }))
    }
}

/// Gives up on one call handed to a carrier ([`Pending::give_up_handle`]), from any thread,
/// before its limit: its waiter returns at once ([`Late::Elapsed`]), and the call, if it has
/// not answered yet, is abandoned and counted as one not answered in time is (its `on_late`
/// gets the answer). Nothing happens to a call answered or given up on already. What a caller
/// that no longer needs an answer uses: a thaw whose CRIU ended before its gate gives up on
/// its check's reads (a read of a hung file system cannot be cancelled, only left).
#[derive(Clone)]
pub struct GiveUp(Arc<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for GiveUp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GiveUp").finish_non_exhaustive()
    }
}

impl GiveUp {
    /// Gives up on the call (see [`GiveUp`]).
    pub fn give_up(&self) {
        (self.0)();
    }
}

impl<T> Pending<T> {
    /// The call's answer, waited for until its limit (counted from [`start`]); past it the
    /// call is abandoned ([`Late::Elapsed`]), as it is when given up on earlier ([`GiveUp`]).
    pub fn wait(self) -> Result<T, Late> {
        let (m, cv) = &*self.slot;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Slot::Done(_) = *s {
                return match std::mem::replace(&mut *s, Slot::Taken) {
                    Slot::Done(out) => Ok(out),
                    _ => Err(Late::NoThread),
                };
            }
            // Given up on by another thread (counted there).
            if matches!(*s, Slot::Abandoned) {
                return Err(Late::Elapsed(self.start.elapsed()));
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                *s = Slot::Abandoned;
                self.budget.count.fetch_add(1, Ordering::Relaxed);
                return Err(Late::Elapsed(self.start.elapsed()));
            }
            s = cv
                .wait_timeout(s, left)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl<T> Drop for Pending<T> {
    /// Not waited for (a caller that failed before it needed the answer): abandoned, as if its
    /// limit had passed, unless it was answered or given up on already.
    fn drop(&mut self) {
        let (m, _) = &*self.slot;
        let mut s = m.lock().unwrap_or_else(|p| p.into_inner());
        if matches!(*s, Slot::Waiting) {
            *s = Slot::Abandoned;
            self.budget.count.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// How many carriers may wait for a call; one more ends after its call.
pub const IDLE_KEPT: usize = 8;

thread_local! {
    /// On a carrier, how many calls deep its call is (a call made from a carrier's call is 2);
    /// 0 elsewhere.
    static DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// How many calls deep the calling thread is running (see `DEPTH`): 0 outside any call.
pub fn call_depth() -> u32 {
    DEPTH.with(std::cell::Cell::get)
}

/// A call handed to a carrier. It calls the function it is given once nothing it does can block
/// any more (its answer is being handed over): the carrier counts as waiting from then on.
type Job = Box<dyn FnOnce(&dyn Fn()) + Send>;

/// The carriers: calls handed over and the threads that wait for them (see the module docs).
struct Carriers {
    shift: Mutex<Shift>,
    work: Condvar,
}

struct Shift {
    /// Calls handed over that no carrier took yet (never more than `idle`).
    queue: VecDeque<Job>,
    /// Carriers waiting for a call, or about to (handing over an answer).
    idle: usize,
    /// Carriers alive (waiting or carrying a call).
    alive: usize,
}

static CARRIERS: Carriers = Carriers {
    shift: Mutex::new(Shift {
        queue: VecDeque::new(),
        idle: 0,
        alive: 0,
    }),
    work: Condvar::new(),
};

/// Carriers alive now: waiting for a call or carrying one (blocked ones included).
pub fn carriers() -> usize {
    CARRIERS.lock().alive
}

impl Carriers {
    fn lock(&self) -> MutexGuard<'_, Shift> {
        // Nothing panics while holding it (jobs run outside it); a poisoned one is still whole.
        self.shift.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Hands `job` to a waiting carrier, or starts one for it when none waits for a call not
    /// taken yet. `Err` when no thread could be started (the job is dropped, not run).
    fn hand(&'static self, job: Job) -> Result<(), std::io::Error> {
        let mut shift = self.lock();
        if shift.idle > shift.queue.len() {
            shift.queue.push_back(job);
            drop(shift);
            self.work.notify_one();
            return Ok(());
        }
        shift.alive += 1;
        drop(shift);
        let started = std::thread::Builder::new()
            .name("cryo-driver-call".into())
            .spawn(move || self.carry(job));
        if let Err(e) = started {
            self.lock().alive -= 1;
            return Err(e);
        }
        Ok(())
    }

    /// A carrier's life: `first`, then every call handed to it, until more than [`IDLE_KEPT`]
    /// carriers would wait.
    fn carry(&'static self, first: Job) {
        block_signals();
        let mut job = first;
        loop {
            let counted = std::cell::Cell::new(false);
            run(job, &|| {
                if !counted.replace(true) {
                    self.lock().idle += 1;
                }
            });
            let mut shift = self.lock();
            if !counted.get() {
                shift.idle += 1;
            }
            // Counted as waiting: take a call handed over, or wait for one, or end.
            job = loop {
                if let Some(next) = shift.queue.pop_front() {
                    shift.idle -= 1;
                    break next;
                }
                if shift.idle > IDLE_KEPT {
                    shift.idle -= 1;
                    shift.alive -= 1;
                    return;
                }
                shift = self.work.wait(shift).unwrap_or_else(|p| p.into_inner());
            };
        }
    }
}

/// Runs a job; a panic in it ends the job, not the carrier (its caller waits to its limit, as
/// for a call that never returns).
fn run(job: Job, free: &dyn Fn()) {
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(free))).is_err() {
        DEPTH.with(|d| d.set(0));
        tracing::error!("a driver call panicked on its carrier thread");
    }
}

/// Blocks every signal on the calling carrier: a signal sent to the process goes to a thread
/// that does not block it (the command's own threads, whose masks say what they defer).
fn block_signals() {
    use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow};
    if let Err(e) = pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&SigSet::all()), None) {
        tracing::warn!(error = %e, "a driver call carrier cannot block signals");
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

/// NVML-style questions handed to one carrier at once ([`Gpu::ask`]), their answer taken later.
#[derive(Debug)]
pub struct Asked<T> {
    what: &'static str,
    pending: Result<Pending<T>, Late>,
}

impl<T> Asked<T> {
    /// The answer, waited for until the questions' limit; [`InspectError::NoAnswer`] past it.
    pub fn wait(self) -> Result<T, InspectError> {
        let what = self.what;
        self.pending.and_then(Pending::wait).map_err(|late| {
            tracing::error!(what, ?late, "NVML query abandoned: no answer in time");
            late.inspect(what)
        })
    }
}

impl Gpu {
    /// Starts `f` on one carrier of the deadline layer, with this backend's inspection API as
    /// it is below the layer, and returns at once; [`Asked::wait`] takes the answer, waited for
    /// at most one question's limit ([`Limits::query`], capped by the overall deadline) from
    /// now. For questions the caller needs later than now (a freeze's GPUs and driver version,
    /// for its manifest): asked beside the caller's own calls, with no thread of the caller's
    /// own and one hand-over to a carrier for all of them, not one each. A backend that is not
    /// bounded gets the default limits. `what` names the questions in an error.
    pub fn ask<T: Send + 'static>(
        &self,
        what: &'static str,
        f: impl FnOnce(&dyn GpuInspector) -> T + Send + 'static,
    ) -> Asked<T> {
        let (inspect, limits) = match bounded_layer(self) {
            Some(b) => (Arc::clone(&b.inspect), b.limits),
            None => (Arc::clone(&self.inspect), Limits::default()),
        };
        Asked {
            what,
            pending: start(limits.cap(limits.query), move || f(&*inspect), |_| {}),
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

    /// A backend whose `state` blocks until a test opens its gate, noting how many calls deep
    /// (one per deadline layer) it runs.
    #[derive(Default)]
    struct Blocking {
        gate: Gate,
        depths: Mutex<Vec<u32>>,
    }

    impl CheckpointDriver for Blocking {
        fn state(&self, _pid: Pid) -> Result<ProcessState, DriverError> {
            self.depths.lock().unwrap().push(call_depth());
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
        // One carrier carried the call, not one per layer.
        assert_eq!(*fake.depths.lock().unwrap(), vec![1]);
        fake.gate.open();
    }

    /// The calling thread's id, as a call answers it.
    fn carrier() -> std::thread::ThreadId {
        std::thread::current().id()
    }

    /// Attack on the kept carriers: a call that never returns holds its carrier, and the next
    /// call (which a single kept carrier would queue behind it) gets another one and answers;
    /// a carrier whose call returned carries the next call.
    #[test]
    fn a_call_that_never_returns_holds_its_carrier_and_the_next_call_gets_another() {
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let (late_tx, late_rx) = mpsc::channel();
        let hung = within(
            Duration::from_millis(50),
            move || {
                g.wait();
                carrier()
            },
            move |v| late_tx.send(v).unwrap(),
        );
        assert!(matches!(hung, Err(Late::Elapsed(_))), "{hung:?}");
        let t = Instant::now();
        let next = within(Duration::from_secs(20), carrier, |_| {}).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        // Kept: the carrier of a call that returned carries the one after it.
        let again = within(Duration::from_secs(20), carrier, |_| {}).unwrap();
        assert_eq!(again, next);
        assert_ne!(again, std::thread::current().id());
        gate.open();
        let late = late_rx.recv().unwrap();
        assert_ne!(late, next, "the hung call had a carrier of its own");
    }

    /// Attack: many calls that never return (a driver that answers nothing) add at most
    /// [`MAX_ABANDONED`] carriers; past them a call fails at once without one; once the driver
    /// answers again, every late answer is handed on, calls work again, and the carriers that
    /// are left waiting are at most [`IDLE_KEPT`].
    #[test]
    fn many_abandoned_calls_are_bounded_and_their_carriers_go_back_to_work_or_end() {
        let gate = Arc::new(Gate::default());
        let (late_tx, late_rx) = mpsc::channel();
        let before = carriers();
        for i in 0..MAX_ABANDONED {
            let g = Arc::clone(&gate);
            let tx = late_tx.clone();
            let r = within(
                Duration::from_millis(5),
                move || {
                    g.wait();
                    i
                },
                move |v| tx.send(v).unwrap(),
            );
            assert!(matches!(r, Err(Late::Elapsed(_))), "call {i}: {r:?}");
        }
        assert_eq!(abandoned(), MAX_ABANDONED);
        let held = carriers();
        assert!(held <= before + MAX_ABANDONED, "{held} carriers");
        let r = within(Duration::from_secs(20), || 1, |_| {});
        assert_eq!(r, Err(Late::Unresponsive(MAX_ABANDONED)));
        assert_eq!(carriers(), held, "a refused call started no carrier");
        gate.open();
        let mut late: Vec<usize> = (0..MAX_ABANDONED)
            .map(|_| late_rx.recv().unwrap())
            .collect();
        late.sort_unstable();
        assert_eq!(late, (0..MAX_ABANDONED).collect::<Vec<_>>());
        // The count drops before each late handler runs.
        assert_eq!(abandoned(), 0);
        assert_eq!(within(Duration::from_secs(20), || 2, |_| {}), Ok(2));
        // Each carrier, its late handler done, waits or ends: at most `IDLE_KEPT` wait.
        let until = Instant::now() + Duration::from_secs(20);
        while carriers() > IDLE_KEPT && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(carriers() <= IDLE_KEPT, "{} carriers left", carriers());
    }

    /// A carrier takes no signal sent to the process (one started before a command deferred
    /// its termination signals would otherwise let them act at once): it blocks them all.
    #[test]
    fn carriers_block_every_signal() {
        let blocked = within(
            Duration::from_secs(20),
            || {
                let status = std::fs::read_to_string("/proc/thread-self/status").unwrap();
                let line = status
                    .lines()
                    .find_map(|l| l.strip_prefix("SigBlk:"))
                    .unwrap()
                    .trim()
                    .to_string();
                u64::from_str_radix(&line, 16).unwrap()
            },
            |_| {},
        )
        .unwrap();
        use nix::sys::signal::Signal;
        for sig in [
            Signal::SIGINT,
            Signal::SIGTERM,
            Signal::SIGHUP,
            Signal::SIGQUIT,
            Signal::SIGCHLD,
            Signal::SIGUSR1,
        ] {
            assert_ne!(blocked & (1 << (sig as i32 - 1)), 0, "{sig}: {blocked:x}");
        }
    }

    /// A call started now and waited for later is answered, on a carrier, while the caller
    /// did other work.
    #[test]
    fn a_started_call_is_answered_when_waited_for_later() {
        let pending = start(Duration::from_secs(20), carrier, |_| {}).unwrap();
        let mine = std::thread::current().id();
        assert_ne!(pending.wait().unwrap(), mine);
    }

    /// Attack: a started call that never returns, dropped by a caller that failed before it
    /// needed the answer, is abandoned (counted, as one past its limit) and its late answer is
    /// handed on; its wait, had it been made, would have ended at the limit.
    #[test]
    fn a_started_call_dropped_unanswered_is_abandoned_and_its_answer_handed_on() {
        let gate = Arc::new(Gate::default());
        let (late_tx, late_rx) = mpsc::channel();
        let g = Arc::clone(&gate);
        let tx = late_tx.clone();
        let waited = start(
            Duration::from_millis(50),
            move || {
                g.wait();
                1
            },
            move |v| tx.send(v).unwrap(),
        )
        .unwrap();
        let t = Instant::now();
        assert!(matches!(waited.wait(), Err(Late::Elapsed(_))));
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(abandoned(), 1);
        let g = Arc::clone(&gate);
        let dropped = start(
            Duration::from_secs(20),
            move || {
                g.wait();
                2
            },
            move |v| late_tx.send(v).unwrap(),
        )
        .unwrap();
        drop(dropped);
        assert_eq!(abandoned(), 2, "a dropped call is counted as abandoned");
        gate.open();
        let mut late = vec![late_rx.recv().unwrap(), late_rx.recv().unwrap()];
        late.sort_unstable();
        assert_eq!(late, vec![1, 2]);
        assert_eq!(abandoned(), 0);
    }

    /// A call given up on from another thread ([`GiveUp`], a thaw whose CRIU ended before its
    /// gate giving up on its check's reads) wakes its waiter at once, long before its limit, is
    /// counted in its own budget while it runs on, and hands its late answer on; a give-up of
    /// an answered call changes nothing.
    #[test]
    fn a_call_given_up_on_from_another_thread_returns_at_once_and_is_counted_until_it_ends() {
        static BUDGET: Abandoned = Abandoned::new(4);
        let gate = Arc::new(Gate::default());
        let (late_tx, late_rx) = mpsc::channel();
        let g = Arc::clone(&gate);
        let pending = start_counted(
            &BUDGET,
            Duration::from_secs(600),
            move || {
                g.wait();
                7
            },
            move |v| late_tx.send(v).unwrap(),
        )
        .unwrap();
        let give_up = pending.give_up_handle();
        let t = Instant::now();
        let waiter = std::thread::spawn(move || pending.wait());
        give_up.give_up();
        assert!(matches!(waiter.join().unwrap(), Err(Late::Elapsed(_))));
        assert!(t.elapsed() < Duration::from_secs(10), "{:?}", t.elapsed());
        assert_eq!(BUDGET.get(), 1, "counted while it runs on");
        give_up.give_up();
        assert_eq!(BUDGET.get(), 1, "counted once");
        gate.open();
        assert_eq!(late_rx.recv().unwrap(), 7);
        assert_eq!(BUDGET.get(), 0);

        let answered = start_counted(&BUDGET, Duration::from_secs(600), || 8, |_| ()).unwrap();
        let give_up = answered.give_up_handle();
        assert_eq!(answered.wait().unwrap(), 8);
        give_up.give_up();
        assert_eq!(BUDGET.get(), 0, "an answered call is not given up on");
    }

    /// Attack on [`Gpu::ask`]: questions that never return are an error at the bounded
    /// layer's query limit (not the default 10 s), not a hung caller.
    #[test]
    fn questions_asked_on_a_carrier_that_never_return_are_an_error_at_the_layers_limit() {
        let fake = Arc::new(Blocking::default());
        let gpu = Gpu {
            kind: crate::BackendKind::Sim,
            driver: fake.clone(),
            inspect: fake.clone(),
        }
        .bounded(Limits {
            query: Duration::from_millis(100),
            ..Limits::default()
        });
        let gate = Arc::new(Gate::default());
        let g = Arc::clone(&gate);
        let t = Instant::now();
        let asked = gpu.ask("a question", move |i| {
            g.wait();
            i.gpus().map(|g| g.len())
        });
        let r = asked.wait();
        assert!(
            matches!(r, Err(InspectError::NoAnswer { what: "a question", after }) if after >= Duration::from_millis(100)),
            "{r:?}"
        );
        assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
        gate.open();
        // Answered questions are their answer.
        assert_eq!(
            gpu.ask("a question", |i| i.gpus().map(|g| g.len()))
                .wait()
                .unwrap()
                .unwrap(),
            0
        );
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
