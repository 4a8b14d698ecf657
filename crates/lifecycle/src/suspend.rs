//! Suspension: lock, checkpoint and verify a set of CUDA processes, all or nothing.
//!
//! # Design
//! Every driver call runs under a caller-side deadline ([`cryo_gpu::deadline`]): a call that does
//! not return is a failure of that process (the call is journaled as abandoned), never a hang.
//! With [`SuspendOptions::until`] (an operation's overall deadline, `cryo stop --deadline`) the
//! lock attempts get only the time that leaves room for the checkpoint (estimated from the device
//! memory NVML lists, at half the measured rate) and the verification; no call is waited for past
//! it. A process whose threads are all stopped (job control, a debugger) cannot run the driver's
//! restore thread: it fails at once ([`SuspendFailure::NotRunnable`]).

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, DriverError, Gpu, GpuProcess, Limits, ProcessState};
pub use cryo_journal::Purpose;
use cryo_journal::{Event, Journal, ProcId};
use cryo_proc::Pid;
use cryo_proc::ProcHandle;

use crate::failpoint;
use crate::progress::Progress;
use crate::runnable::{runnable, Runnable};

/// How hard to try.
#[derive(Debug, Clone)]
pub struct SuspendOptions {
    /// Timeout of one lock attempt (`cuda-checkpoint --timeout`).
    pub lock_timeout: Duration,
    /// Lock attempts before giving up on work that stays in flight.
    pub lock_attempts: u32,
    /// How long to wait for NVML to stop listing a checkpointed process.
    pub verify_timeout: Duration,
    /// On failure, also bring back (restore + unlock) the processes this run checkpointed, so the
    /// worker keeps serving (freeze); otherwise they stay CHECKPOINTED, which is safe (stop).
    pub resume_on_failure: bool,
    /// The suspension's part of an overall deadline: lock attempts are cut to leave room for the
    /// checkpoint and the verification, and nothing is waited for past it.
    pub until: Option<Instant>,
    /// What the suspension is for (journaled, so a later run knows how to finish it).
    pub purpose: Purpose,
}

impl Default for SuspendOptions {
    fn default() -> Self {
        SuspendOptions {
            lock_timeout: Duration::from_secs(30),
            lock_attempts: 3,
            verify_timeout: Duration::from_secs(10),
            resume_on_failure: false,
            until: None,
            purpose: Purpose::Stop,
        }
    }
}

/// Failpoint (pausing, [`failpoint::pause_if`]): every process is suspended and verified; once
/// the test lets it go on, the suspension fails as a whole and is rolled back (with
/// `resume_on_failure`, what it checkpointed is restored and unlocked in place).
pub const SUSPEND_ROLL_BACK: &str = "suspend-roll-back";

/// Failpoint (pausing, [`failpoint::pause_if`]: stalling until killed without a resume file): a
/// process is locked, its `Locked` not journaled yet (it goes with `CheckpointStarted`), nothing
/// checkpointed.
pub const SUSPEND_AFTER_LOCK: &str = "suspend-after-lock";

/// Failpoint (stalling until killed): every process is checkpointed, its `Checkpointed` not
/// journaled yet (it goes with `Verified`, which syncs the `CheckpointStarted` written before
/// the checkpoint too), nothing verified.
pub const SUSPEND_AFTER_CHECKPOINT: &str = "suspend-after-checkpoint";

/// The checkpoint rate assumed when budgeting a deadline: half the slowest rate measured on an
/// H200 (1.7 GB/s), since page faulting, not the bus, bounds it.
pub const CHECKPOINT_BYTES_PER_SEC: u64 = 850_000_000;

/// A lock attempt shorter than this is not worth making.
const MIN_LOCK: Duration = Duration::from_millis(100);

impl SuspendOptions {
    /// Time still left before [`SuspendOptions::until`] (`None`: no deadline).
    pub(crate) fn left(&self) -> Option<Duration> {
        self.until
            .map(|u| u.saturating_duration_since(Instant::now()))
    }

    /// What the checkpoint and the verification of `bytes` of device memory need after the locks.
    pub fn reserve(&self, bytes: u64) -> Duration {
        let ckpt = Duration::from_millis(bytes / (CHECKPOINT_BYTES_PER_SEC / 1000))
            + Duration::from_secs(1);
        ckpt + self.verify_timeout.min(Duration::from_secs(1))
    }

    /// The limits every driver call of the suspension runs under.
    pub(crate) fn limits(&self) -> Limits {
        match self.until {
            Some(u) => Limits::default().until(u),
            None => Limits::default(),
        }
    }
}

/// What one process went through.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Suspended {
    /// The process.
    pub pid: Pid,
    /// State found before acting.
    pub state_before: ProcessState,
    /// Device memory NVML listed before acting, bytes.
    pub device_memory: u64,
    /// Time spent in lock, when this run locked it (JSON: `lock_ms`).
    #[serde(
        rename = "lock_ms",
        serialize_with = "opt_ms",
        deserialize_with = "opt_ms_de"
    )]
    pub lock: Option<Duration>,
    /// Time spent in checkpoint, when this run checkpointed it (JSON: `checkpoint_ms`).
    #[serde(
        rename = "checkpoint_ms",
        serialize_with = "opt_ms",
        deserialize_with = "opt_ms_de"
    )]
    pub checkpoint: Option<Duration>,
    /// Time from checkpoint return to NVML no longer listing the pid (JSON: `verify_ms`).
    #[serde(
        rename = "verify_ms",
        serialize_with = "opt_ms",
        deserialize_with = "opt_ms_de"
    )]
    pub verify: Option<Duration>,
}

/// Durations in JSON as milliseconds (fractional), `null` when absent.
fn opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_secs_f64() * 1e3)),
        None => s.serialize_none(),
    }
}

/// Milliseconds (fractional) or `null` in JSON back to a duration (the agent's answers).
fn opt_ms_de<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Duration>, D::Error> {
    let ms: Option<f64> = serde::Deserialize::deserialize(d)?;
    Ok(ms.map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1e3)))
}

/// A step's name: one of this crate's literals (an alias so that serde's derive does not take
/// the `'static` for a borrow from the input: the name is matched to its literal instead).
pub type StepName = &'static str;

/// A step's name read back from JSON (the agent's answers): see [`crate::progress::step_literal`].
fn step_name<'de, D: serde::Deserializer<'de>>(d: D) -> Result<&'static str, D::Error> {
    let s: String = serde::Deserialize::deserialize(d)?;
    Ok(crate::progress::step_literal(s))
}

/// Why a process could not be suspended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SuspendFailure {
    /// Work stayed in flight through every lock attempt (`CUDA_ERROR_NOT_READY`).
    LockTimedOut {
        /// Attempts made.
        attempts: u32,
        /// Timeout of the last one.
        timeout_ms: u64,
        /// The overall deadline that cut the attempts short, if one did.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        deadline_ms: Option<u64>,
    },
    /// The overall deadline leaves no time for `step` (and what follows it).
    OutOfTime {
        /// The step that could not be started.
        #[serde(deserialize_with = "step_name")]
        step: StepName,
        /// The deadline, ms from the start of the operation... as left when the step was due.
        left_ms: u64,
    },
    /// A driver call did not return in time: it was abandoned (the driver may still carry it
    /// out), and the process is left as the driver leaves it.
    NoAnswer {
        /// The step.
        #[serde(deserialize_with = "step_name")]
        step: StepName,
        /// How long the call was waited for.
        ms: u64,
    },
    /// The process cannot run the driver's restore thread: all its threads are stopped.
    NotRunnable {
        /// How it is stopped.
        runnable: Runnable,
        /// Its pid (for the message).
        pid: Pid,
    },
    /// Whether it is a CUDA process could not be decided (the evidence contradicts the driver).
    Unclassified(crate::cuda::Unsure),
    /// The last look before the kill found it no longer safe to kill.
    LastLook {
        /// What was found.
        found: String,
    },
    /// The context has a sticky error: the driver cannot lock it.
    StickyError {
        /// The driver's error name.
        code: String,
    },
    /// The driver reports the process FAILED.
    DriverFailedState,
    /// A driver call failed otherwise.
    Driver {
        /// The step.
        #[serde(deserialize_with = "step_name")]
        step: StepName,
        /// The driver's message.
        error: String,
    },
    /// NVML still attributes device memory to the process after the deadline.
    MemoryStillListed {
        /// Bytes still listed.
        bytes: u64,
    },
    /// The process exited while being suspended.
    Exited,
    /// The thread carrying a driver call panicked: the call's outcome is unknown.
    Panicked {
        /// The step (`checkpoint`).
        #[serde(deserialize_with = "step_name")]
        step: StepName,
    },
    /// The suspension's intent could not be made durable (the journal's write or `fdatasync`
    /// failed) before its first driver action: nothing was done, since a cryo that died then
    /// would leave nothing on disk for the recovery.
    Journal {
        /// The journal's error.
        error: String,
    },
}

impl SuspendFailure {
    /// A short reason for humans.
    pub fn reason(&self) -> String {
        match self {
            SuspendFailure::LockTimedOut {
                attempts,
                timeout_ms,
                deadline_ms,
            } => {
                let cut = deadline_ms.map_or(String::new(), |d| {
                    format!("; the deadline of {d} ms left no time for more")
                });
                format!("lock timed out with GPU work in flight ({attempts} attempts, the last of {timeout_ms} ms, CUDA_ERROR_NOT_READY{cut})")
            }
            SuspendFailure::OutOfTime { step, left_ms } => format!(
                "the deadline leaves no time to {step} ({left_ms} ms left, less than the {step} and what follows need)"
            ),
            SuspendFailure::NoAnswer { step, ms } => format!(
                "the driver did not answer the {step} within {ms} ms; the call was abandoned and may still take effect"
            ),
            SuspendFailure::NotRunnable { runnable, pid } => runnable
                .why_not(*pid)
                .unwrap_or_else(|| "it runs again".to_string()),
            SuspendFailure::Unclassified(u) => format!("cannot tell whether it holds a CUDA context: {u}"),
            SuspendFailure::LastLook { found } => {
                format!("the last look before the kill found {found}")
            }
            SuspendFailure::StickyError { code } => {
                format!("the CUDA context has a sticky error ({code}): the driver cannot lock it")
            }
            SuspendFailure::DriverFailedState => {
                "the driver reports the process FAILED".to_string()
            }
            SuspendFailure::Driver { step, error } => format!("{step} failed: {error}"),
            SuspendFailure::MemoryStillListed { bytes } => {
                format!(
                    "NVML still lists {} of device memory after checkpoint",
                    cryo_units::fmt_bytes(*bytes)
                )
            }
            SuspendFailure::Exited => "the process exited while being suspended".to_string(),
            SuspendFailure::Panicked { step } => {
                format!("the {step} call panicked in cryo; its outcome is unknown")
            }
            SuspendFailure::Journal { error } => format!(
                "the journal cannot take the suspension's intent ({error}); nothing was done to it"
            ),
        }
    }

    /// What the operator can do.
    pub fn hint(&self) -> &'static str {
        match self {
            SuspendFailure::LockTimedOut { .. } => {
                "drain the worker's requests or raise --timeout/--lock-attempts (and --deadline), then run the stop again"
            }
            SuspendFailure::OutOfTime { .. } => {
                "raise --deadline (under Kubernetes, with the pod's terminationGracePeriodSeconds), then run the stop again"
            }
            SuspendFailure::NoAnswer { .. } => {
                "check the driver (dmesg, nvidia-smi) and `cryo gpu state --pid PID`; the next stop or guard start settles the abandoned call first"
            }
            SuspendFailure::NotRunnable { runnable: Runnable::Debugger { .. }, .. } => {
                "detach the debugger (or let it continue the process), then run the stop again"
            }
            SuspendFailure::NotRunnable { .. } => {
                "resume it (kill -CONT PID), then run the stop again"
            }
            SuspendFailure::Unclassified(_) => {
                "check its driver files (ls -l /proc/PID/fd) and nvidia-smi; run the stop again once the driver answers a state for it"
            }
            SuspendFailure::LastLook { .. } => {
                "something acted on it after its suspension was verified (a restore?); run the stop again"
            }
            SuspendFailure::StickyError { .. } => {
                "the context cannot be suspended; keep the process alive and use `cryo guard` (pins its driver fds at exit) or, on a host known not to wedge, --unsafe"
            }
            SuspendFailure::DriverFailedState => "inspect the driver (dmesg, nvidia-smi); on a host known not to wedge, --unsafe",
            SuspendFailure::Driver { .. } => "check the driver and the pid, then run the stop again",
            SuspendFailure::MemoryStillListed { .. } => {
                "do not kill it: check nvidia-smi; another tool may hold the process's driver fds; run the stop again"
            }
            SuspendFailure::Exited => "check the journal and the wedge/host state: the process ended on its own",
            SuspendFailure::Panicked { .. } => "do not kill it: check its state with `cryo gpu state`, run the stop again, and report the panic (stderr has it)",
            SuspendFailure::Journal { .. } => "make the journal's file system writable (space, errors in dmesg: the state directory's), then run it again",
        }
    }
}

/// The result for one process.
#[derive(Debug, Clone)]
pub struct SuspendOutcome {
    /// The process.
    pub pid: Pid,
    /// What happened.
    pub result: Result<Suspended, SuspendFailure>,
}

/// Suspends every process in `procs` (all must be CUDA processes): lock in parallel, checkpoint
/// in parallel, verify through NVML. All or nothing: if any process fails, the ones this run
/// locked are unlocked again (and, with `resume_on_failure`, the ones it checkpointed are
/// restored and unlocked), so every process is left in a safe state.
pub fn suspend(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    opts: &SuspendOptions,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) -> Vec<SuspendOutcome> {
    suspend_watched(gpu, procs, opts, journal, progress, &crate::NoWatcher)
}

/// As [`suspend`], for a caller whose processes `watcher` traces (park, freeze): a roll-back
/// that resumes what it checkpointed (`resume_on_failure`) has `watcher` trace each process again
/// before its unlock ([`crate::Watcher::guard_before_unlock`], as after every restore), so the
/// guard holds what an `execve` right after the unlock would need (its standing duplicates,
/// dropped while the process was checkpointed).
pub fn suspend_watched(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    opts: &SuspendOptions,
    journal: Option<&Journal>,
    progress: &dyn Progress,
    watcher: &dyn crate::Watcher,
) -> Vec<SuspendOutcome> {
    // Without `Known` the records are written and synced here: nothing is left unwritten.
    suspend_listed(gpu, procs, None, opts, journal, progress, watcher).outcomes
}

/// How the verification's records (`Verified`, with the outcomes journaled with them) reach
/// the journal and stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verified {
    /// Written and synced before the suspension returns (whoever kills the processes next may
    /// do so at once).
    Synced,
    /// Handed back unwritten ([`Suspension::unwritten`]): the caller writes them before it
    /// journals or does anything else, and syncs the journal before anything ends the processes
    /// (a freeze: written right after its GPU-free moment, before the guard lets go, which
    /// reads them; synced beside CRIU's dump and waited for at its gate, before CRIU may kill
    /// the tree). A suspension that fails writes and syncs everything itself, as with `Synced`.
    ByCaller,
}

/// What [`suspend_listed`] did: each process's outcome, and, with [`Verified::ByCaller`] and
/// every process suspended, the records the caller is to write.
#[derive(Debug)]
pub(crate) struct Suspension {
    /// One per process, in order.
    pub(crate) outcomes: Vec<SuspendOutcome>,
    /// Records not written yet, in order (the verification's and the outcomes that go with
    /// them); empty unless [`Verified::ByCaller`] and every process was suspended.
    pub(crate) unwritten: Vec<Event>,
}

/// What a caller learnt of the processes a moment before it suspends them (a freeze lists and
/// classifies its tree first).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Known<'a> {
    /// NVML's process list.
    pub(crate) listed: &'a [GpuProcess],
    /// The state the driver answered for each process, in the order of the processes.
    pub(crate) states: &'a [ProcessState],
    /// How the verification's records reach stable storage (without a `Known`: before the
    /// suspension returns, [`Verified::Synced`]).
    pub(crate) verified: Verified,
}

/// As [`suspend_watched`], with what the caller learnt a moment ago ([`Known`]): each process's
/// device memory is read from the caller's NVML list and its state is the one the caller's
/// classification got, instead of asking NVML and the driver again (two round trips to the
/// driver before the first lock). A state that changed since is no risk: the driver refuses a
/// lock or a checkpoint from any other state (a refused freeze, rolled back), and the
/// verification refuses a process whose memory is still listed.
pub(crate) fn suspend_listed(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    known: Option<Known<'_>>,
    opts: &SuspendOptions,
    journal: Option<&Journal>,
    progress: &dyn Progress,
    watcher: &dyn crate::Watcher,
) -> Suspension {
    let gpu = &gpu.bounded(opts.limits());
    let verified = known.map_or(Verified::Synced, |k| k.verified);
    let mut unwritten = Vec::new();
    let by = me();
    let memory_before: Vec<u64> = procs
        .iter()
        .map(|p| match known {
            Some(Known { listed, .. }) => listed
                .iter()
                .filter(|l| l.pid == p.pid())
                .map(|l| l.used_memory)
                .sum(),
            None => gpu
                .inspect
                .process_memory(p.pid())
                .ok()
                .flatten()
                .unwrap_or(0),
        })
        .collect();
    let mut rows: Vec<Row> = procs
        .iter()
        .zip(memory_before)
        .map(|(p, mem)| Row {
            handle: p,
            state: None,
            mem,
            lock: None,
            ckpt: None,
            verify: None,
            failure: None,
            locked_here: false,
            ckpt_here: false,
            intent_on_disk: false,
            // Journaled with the first record that goes before a driver action on it (or at
            // the end): nothing was done to it before.
            pending: vec![Event::SuspendStarted {
                pid: id(p),
                purpose: opts.purpose,
                by,
            }],
        })
        .collect();

    for (i, row) in rows.iter_mut().enumerate() {
        let pid = row.handle.pid();
        // The driver's restore thread must run for anything to happen: tell up front.
        match runnable(row.handle) {
            Ok(Runnable::Runs) | Err(_) => {}
            Ok(Runnable::Exited) => {
                row.failure = Some(SuspendFailure::Exited);
                continue;
            }
            Ok(r) => {
                row.failure = Some(SuspendFailure::NotRunnable { runnable: r, pid });
                continue;
            }
        }
        let state = match known.and_then(|k| k.states.get(i)) {
            Some(state) => Ok(*state),
            None => crate::cuda::settled_state(gpu, pid, crate::cuda::SETTLE),
        };
        match state {
            Ok(ProcessState::Failed) => {
                row.state = Some(ProcessState::Failed);
                row.failure = Some(SuspendFailure::DriverFailedState);
            }
            Ok(state) => row.state = Some(state),
            Err(e) => row.failure = Some(classify("get state", &e, row.handle)),
        }
    }

    // Lock phase, in parallel, once every lock's intent is on disk (one append: see
    // `intents`).
    let reserve = opts.reserve(rows.iter().map(|r| r.mem).sum());
    if rows.iter().all(|r| r.failure.is_none()) {
        intents(journal, &mut rows, opts.purpose, Intent::Lock);
    }
    if rows.iter().all(|r| r.failure.is_none()) {
        in_parallel(
            rows.iter_mut()
                .filter(|r| r.state == Some(ProcessState::Running)),
            |row| lock_one(gpu, row, opts, reserve, journal, progress),
        );
    }
    // Checkpoint phase, in parallel: concurrent checkpoints are much faster than serial ones.
    // The intents of those found LOCKED (nothing of their suspension is on disk yet) first.
    if rows.iter().all(|r| r.failure.is_none()) {
        intents(journal, &mut rows, opts.purpose, Intent::Checkpoint);
    }
    if rows.iter().all(|r| r.failure.is_none()) {
        in_parallel(
            rows.iter_mut()
                .filter(|r| r.locked_here || r.state == Some(ProcessState::Locked)),
            |row| checkpoint_one(gpu, row, journal, progress),
        );
    }
    if rows.iter().all(|r| r.failure.is_none()) {
        let verify = match opts.left() {
            Some(left) => opts.verify_timeout.min(left),
            None => opts.verify_timeout,
        };
        verify_all(gpu, &mut rows, verify, journal, verified, &mut unwritten);
    }
    // Every outcome not journaled yet, before anything else is journaled or done (a roll-back,
    // the caller's next step); a suspension that failed writes and syncs what its verification
    // found too, first.
    if rows.iter().any(|r| r.failure.is_some()) {
        record_all(journal, std::mem::take(&mut unwritten));
    }
    flush(journal, &mut rows);
    if rows.iter().all(|r| r.failure.is_none()) && failpoint::active(SUSPEND_ROLL_BACK) {
        failpoint::pause_if(SUSPEND_ROLL_BACK);
        record_all(journal, std::mem::take(&mut unwritten));
        for row in &mut rows {
            row.failure = Some(SuspendFailure::Driver {
                step: "failpoint",
                error: format!("failpoint {SUSPEND_ROLL_BACK}: rolled back on purpose"),
            });
        }
    }
    if rows.iter().any(|r| r.failure.is_some()) {
        roll_back(gpu, &mut rows, opts.resume_on_failure, journal, watcher);
    }

    let outcomes = rows
        .into_iter()
        .map(|r| {
            let pid = r.handle.pid();
            let result = match (r.failure, r.state) {
                (Some(f), _) => Err(f),
                (None, Some(state_before)) => Ok(Suspended {
                    pid,
                    state_before,
                    device_memory: r.mem,
                    lock: r.lock,
                    checkpoint: r.ckpt,
                    verify: r.verify,
                }),
                (None, None) => Err(SuspendFailure::Exited),
            };
            SuspendOutcome { pid, result }
        })
        .collect();
    Suspension {
        outcomes,
        unwritten,
    }
}

/// Runs `f` on every row at once, each on a thread of its own; a lone row on the calling
/// thread (a thread more is a wake-up more, and on a loaded host each waits for a core).
fn in_parallel<'r, 'a: 'r>(
    rows: impl Iterator<Item = &'r mut Row<'a>>,
    f: impl Fn(&mut Row<'a>) + Sync,
) {
    let mut rows: Vec<&'r mut Row<'a>> = rows.collect();
    if let [row] = rows.as_mut_slice() {
        f(row);
        return;
    }
    let f = &f;
    thread::scope(|s| {
        for row in rows {
            s.spawn(move || f(row));
        }
    });
}

struct Row<'a> {
    handle: &'a ProcHandle,
    state: Option<ProcessState>,
    mem: u64,
    lock: Option<Duration>,
    ckpt: Option<Duration>,
    verify: Option<Duration>,
    failure: Option<SuspendFailure>,
    locked_here: bool,
    ckpt_here: bool,
    /// Its first action's intent is on disk already ([`intents`]).
    intent_on_disk: bool,
    /// Records of it not journaled yet: outcomes (and its `SuspendStarted`), written with the
    /// next record that must be on disk before an action ([`record_row`]), or by [`flush`].
    pending: Vec<Event>,
}

/// Journals `event` about `row`, after its records not journaled yet, in one append (one
/// `fdatasync` instead of one each). What must precede a driver action (an intent:
/// `LockStarted`; `CheckpointStarted` of a process found LOCKED, whose suspension has nothing
/// on disk yet) goes through here, so it is on disk, with everything before it, before the
/// action; an outcome (`Locked`, `Checkpointed`) waits in [`Row::pending`] for the next one. A
/// crash in between loses only outcomes (and, once the lock's intent is on disk, the
/// checkpoint's: written unsynced, see `checkpoint_one`), and recovery never trusts those: it
/// asks the driver the state of every process whose last step is not final
/// ([`crate::settle_in_flight`]).
fn record_row(journal: Option<&Journal>, row: &mut Row<'_>, event: Event) {
    row.pending.push(event);
    record_all(journal, std::mem::take(&mut row.pending));
}

/// The first driver action of a phase, whose intent [`intents`] journals for every row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Intent {
    /// The lock of every row found RUNNING.
    Lock,
    /// The checkpoint of every row found LOCKED (a row this run locks has its lock's intent on
    /// disk).
    Checkpoint,
}

/// Journals, in one append before the phase's first driver action, the intent of `phase` for
/// every row it acts on first (after what each has pending: its `SuspendStarted`), one
/// `fdatasync` for all. An intent that cannot be made durable (the write or the `fdatasync`
/// fails: EIO, a full disk) before any driver action of this suspension fails closed: every
/// row is refused ([`SuspendFailure::Journal`]) and nothing is done, since a cryo that died
/// after acting would leave nothing on disk for the recovery (the locked worker would serve
/// nothing, forever). Once actions are under way (a checkpoint phase after locks), and for the
/// guard (whose alternative, a death let through unsuspended, is worse), it is loud and the
/// suspension goes on, as every later record's failure is.
///
/// Why the lock's intent is synced *before* the lock, although durability is not what the
/// recovery needs from it (session 15): a written record survives any process's death (the
/// page cache keeps it for every reader: the recovery, the guard's view, the event stream), and
/// a power cut or kernel crash that loses it ends the worker too, so the sync could run beside
/// the lock and be waited for before the checkpoint. It was built and measured (branch
/// `gpufree2-intent-sync`): the sync then needs a thread of its own, bounded (a hung disk must
/// not leave the worker locked), and on a loaded 2-CPU host that thread's wake-up costs as much
/// as the `fdatasync` it hides (0.4-3 ms here): the lock-to-copy part of a 1 GiB freeze went
/// from 4.4 to 8.9 ms (median of 10, load 4-8), the GPU-free overhead unchanged. Kept here.
fn intents(journal: Option<&Journal>, rows: &mut [Row<'_>], purpose: Purpose, phase: Intent) {
    let Some(j) = journal else { return };
    let first = |r: &Row<'_>| match phase {
        Intent::Lock => r.state == Some(ProcessState::Running),
        Intent::Checkpoint => r.state == Some(ProcessState::Locked),
    };
    let mut events = Vec::new();
    for row in rows.iter_mut().filter(|r| first(r)) {
        events.append(&mut row.pending);
        let pid = id(row.handle);
        events.push(match phase {
            Intent::Lock => Event::LockStarted { pid },
            Intent::Checkpoint => Event::CheckpointStarted { pid },
        });
    }
    if events.is_empty() {
        return;
    }
    let error = match j.append_all(events) {
        Ok(_) => {
            for row in rows.iter_mut().filter(|r| first(r)) {
                row.intent_on_disk = true;
            }
            return;
        }
        Err(e) => e,
    };
    let acted = rows.iter().any(|r| r.locked_here || r.ckpt_here);
    if acted || purpose == Purpose::Guard {
        tracing::error!(error = %error, "cannot write the journal: the suspension goes on unrecorded");
        for row in rows.iter_mut().filter(|r| first(r)) {
            row.intent_on_disk = true;
        }
        return;
    }
    tracing::error!(error = %error, "the suspension's intent cannot be made durable: refused, nothing done");
    // What did reach the file (a failed `fdatasync`) is closed, so no recovery looks again.
    let closed = rows
        .iter_mut()
        .map(|row| {
            row.failure = Some(SuspendFailure::Journal {
                error: error.to_string(),
            });
            Event::SuspensionSettled {
                pid: id(row.handle),
                found: row
                    .state
                    .map_or_else(|| "unknown".to_string(), |s| s.to_string()),
                action: "left as it is: its intent could not be made durable, nothing done"
                    .to_string(),
            }
        })
        .collect();
    record_unsynced(journal, closed);
}

/// Journals what every row still has pending, in one append.
fn flush(journal: Option<&Journal>, rows: &mut [Row<'_>]) {
    let events: Vec<Event> = rows
        .iter_mut()
        .flat_map(|r| std::mem::take(&mut r.pending))
        .collect();
    record_all(journal, events);
}

fn record_all(journal: Option<&Journal>, events: Vec<Event>) {
    if let Some(j) = journal {
        // As `record`: a journal that cannot take it is loud, not a reason to stop half-way.
        if let Err(e) = j.append_all(events) {
            tracing::error!(error = %e, "cannot write the journal");
        }
    }
}

/// As [`record_all`], without waiting for stable storage ([`Journal::append_unsynced`]).
fn record_unsynced(journal: Option<&Journal>, events: Vec<Event>) {
    if let Some(j) = journal {
        if let Err(e) = j.append_unsynced(events) {
            tracing::error!(error = %e, "cannot write the journal");
        }
    }
}

fn record(journal: Option<&Journal>, event: Event) {
    if let Some(j) = journal {
        // The journal is the record of what happened, but a suspension that is under way must not
        // be abandoned half-way because the log disk is full: the step is still taken, and the
        // failure is loud.
        if let Err(e) = j.append(event) {
            tracing::error!(error = %e, "cannot write the journal");
        }
    }
}

fn classify(step: &'static str, e: &DriverError, h: &ProcHandle) -> SuspendFailure {
    if let DriverError::NoAnswer { after, .. } = e {
        return SuspendFailure::NoAnswer {
            step,
            ms: ms(*after),
        };
    }
    if let DriverError::Unresponsive { .. } = e {
        return SuspendFailure::NoAnswer { step, ms: 0 };
    }
    // The driver stops knowing a process as it exits ("not a CUDA process", "no such process"):
    // for one it knew a moment ago, that means it is going away, which is not a driver failure.
    if matches!(
        e.code(),
        Some(CuResult::NOT_INITIALIZED) | Some(CuResult::INVALID_VALUE)
    ) && h.wait_exit(Duration::from_secs(1))
    {
        return SuspendFailure::Exited;
    }
    match e.code() {
        Some(code) if code.is_sticky() => SuspendFailure::StickyError {
            code: code.to_string(),
        },
        _ => SuspendFailure::Driver {
            step,
            error: e.to_string(),
        },
    }
}

fn lock_one(
    gpu: &Gpu,
    row: &mut Row<'_>,
    opts: &SuspendOptions,
    reserve: Duration,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) {
    let pid = row.handle.pid();
    progress.begin(pid, "lock", 0);
    let start = Instant::now();
    let attempts = opts.lock_attempts.max(1);
    let mut cut = None;
    for attempt in 1..=attempts {
        // Attempts made before this one.
        let made = attempt - 1;
        if !row.handle.is_alive() {
            row.failure = Some(SuspendFailure::Exited);
            break;
        }
        // Within a deadline, each attempt gets what the checkpoint and verification leave.
        let timeout = match opts.left() {
            None => opts.lock_timeout,
            Some(left) => {
                let budget = left.saturating_sub(reserve);
                if budget < MIN_LOCK {
                    row.failure = Some(if made == 0 {
                        SuspendFailure::OutOfTime {
                            step: "lock",
                            left_ms: ms(left),
                        }
                    } else {
                        SuspendFailure::LockTimedOut {
                            attempts: made,
                            timeout_ms: ms(opts.lock_timeout.min(budget)),
                            deadline_ms: Some(ms(left)),
                        }
                    });
                    break;
                }
                if budget < opts.lock_timeout {
                    cut = Some(ms(left));
                }
                opts.lock_timeout.min(budget)
            }
        };
        if attempt > 1 || !row.intent_on_disk {
            let lock_started = Event::LockStarted {
                pid: id(row.handle),
            };
            record_row(journal, row, lock_started);
        }
        match gpu.driver.lock(pid, Some(timeout)) {
            Ok(()) => {
                let took = start.elapsed();
                row.lock = Some(took);
                row.locked_here = true;
                // An outcome: journaled with the checkpoint's intent (or by `flush`).
                row.pending.push(Event::Locked {
                    pid: id(row.handle),
                    ms: ms(took),
                });
                progress.end(pid, "lock", true, &format!("{} ms", took.as_millis()));
                return;
            }
            Err(e) if e.code() == Some(CuResult::NOT_READY) && attempt < attempts => {
                // Journaled with the next attempt's intent.
                row.pending.push(Event::LockFailed {
                    pid: id(row.handle),
                    error: e.to_string(),
                });
                tracing::warn!(pid, attempt, "lock timed out with work in flight; retrying");
            }
            Err(e) => {
                let failed = Event::LockFailed {
                    pid: id(row.handle),
                    error: e.to_string(),
                };
                record_row(journal, row, failed);
                abandoned(journal, row.handle, &e);
                row.failure = Some(if e.code() == Some(CuResult::NOT_READY) {
                    SuspendFailure::LockTimedOut {
                        attempts: attempt,
                        timeout_ms: ms(timeout),
                        deadline_ms: cut,
                    }
                } else {
                    classify("lock", &e, row.handle)
                });
                break;
            }
        }
    }
    progress.end(
        pid,
        "lock",
        false,
        &row.failure.as_ref().map(|f| f.reason()).unwrap_or_default(),
    );
}

/// Journals a call the driver did not answer in time: its effect may still come.
pub(crate) fn abandoned(journal: Option<&Journal>, h: &ProcHandle, e: &DriverError) {
    if let DriverError::NoAnswer { call, after, .. } = e {
        record(
            journal,
            Event::CallAbandoned {
                pid: id(h),
                call: (*call).to_string(),
                ms: ms(*after),
            },
        );
    }
}

/// This cryo process, as the journal names the owner of an operation.
pub(crate) fn me() -> Option<ProcId> {
    i32::try_from(std::process::id())
        .ok()
        .and_then(|p| ProcId::of(p).ok())
}

fn checkpoint_one(
    gpu: &Gpu,
    row: &mut Row<'_>,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) {
    let pid = row.handle.pid();
    let rss_before = row.handle.rss().unwrap_or(0);
    progress.begin(pid, "checkpoint", row.mem);
    // The lock's outcome is not on disk yet: a crash here leaves the lock's intent last.
    failpoint::pause_if(SUSPEND_AFTER_LOCK);
    let started = Event::CheckpointStarted {
        pid: id(row.handle),
    };
    if row.locked_here {
        // The suspension's intent is on disk since before the lock (`SuspendStarted`, with its
        // purpose and owner, and `LockStarted`, synced), and recovery treats every step short
        // of a final one alike (it asks the driver: `settle_in_flight`): the checkpoint's
        // intent and the lock's outcome need not be on stable storage before the checkpoint.
        // Written now (a killed suspension leaves them, the timeline gets their time), synced
        // with the verification's records: one `fdatasync` less between lock and checkpoint.
        row.pending.push(started);
        record_unsynced(journal, std::mem::take(&mut row.pending));
    } else if !row.intent_on_disk {
        // Found LOCKED: nothing of this suspension is on disk yet.
        record_row(journal, row, started);
    }
    let start = Instant::now();
    let result = if progress.shows_advance() {
        checkpoint_sampled(gpu, row, rss_before, progress)
    } else {
        // Nobody renders the advance: the call on this thread (a panic in it is the same
        // failure as on a thread of its own).
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| gpu.driver.checkpoint(pid)))
    };
    let took = start.elapsed();
    match result {
        Err(_panic) => {
            let f = SuspendFailure::Panicked { step: "checkpoint" };
            let failed = Event::CheckpointFailed {
                pid: id(row.handle),
                error: f.reason(),
            };
            record_row(journal, row, failed);
            progress.end(pid, "checkpoint", false, &f.reason());
            row.failure = Some(f);
        }
        Ok(Ok(())) => {
            row.ckpt = Some(took);
            row.ckpt_here = true;
            // An outcome: journaled with the verification's (or by `flush`).
            row.pending.push(Event::Checkpointed {
                pid: id(row.handle),
                ms: ms(took),
                bytes: row.mem,
            });
            progress.end(
                pid,
                "checkpoint",
                true,
                &format!(
                    "{} ms, {}",
                    took.as_millis(),
                    cryo_units::fmt_bytes(row.mem)
                ),
            );
        }
        Ok(Err(e)) => {
            let failed = Event::CheckpointFailed {
                pid: id(row.handle),
                error: e.to_string(),
            };
            record_row(journal, row, failed);
            abandoned(journal, row.handle, &e);
            let f = classify("checkpoint", &e, row.handle);
            progress.end(pid, "checkpoint", false, &f.reason());
            row.failure = Some(f);
        }
    }
}

/// The checkpoint of `row` on a thread of its own, this thread sampling its progress meanwhile.
fn checkpoint_sampled(
    gpu: &Gpu,
    row: &Row<'_>,
    rss_before: u64,
    progress: &dyn Progress,
) -> thread::Result<Result<(), DriverError>> {
    let pid = row.handle.pid();
    thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let call = s.spawn(move || {
            let r = gpu.driver.checkpoint(pid);
            // The receiver only goes away once this thread is joined.
            let _ = tx.send(());
            r
        });
        // The driver gives no progress; the process's resident memory grows by its device memory
        // as the checkpoint moves it, which is the best estimate there is. The wait wakes as soon
        // as the call returns, so sampling adds no latency to the checkpoint.
        while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_millis(100))
        {
            if let Ok(rss) = row.handle.rss() {
                progress.advance(pid, rss.saturating_sub(rss_before).min(row.mem));
            }
        }
        call.join()
    })
}

fn verify_all(
    gpu: &Gpu,
    rows: &mut [Row<'_>],
    timeout: Duration,
    journal: Option<&Journal>,
    verified: Verified,
    unwritten: &mut Vec<Event>,
) {
    // The checkpoints' outcomes are not on disk yet: a crash here leaves their intents last.
    failpoint::stall_if(SUSPEND_AFTER_CHECKPOINT);
    let start = Instant::now();
    let deadline = start + timeout;
    let mut pending: Vec<usize> = (0..rows.len()).collect();
    loop {
        let listed = match gpu.inspect.processes() {
            Ok(l) => l,
            Err(e) => {
                for &i in &pending {
                    rows[i].failure = Some(SuspendFailure::Driver {
                        step: "verify",
                        error: e.to_string(),
                    });
                }
                return;
            }
        };
        // What this look found, journaled at once (with each row's pending outcomes).
        let mut found = Vec::new();
        pending.retain(|&i| {
            let pid = rows[i].handle.pid();
            let bytes: u64 = listed
                .iter()
                .filter(|p| p.pid == pid)
                .map(|p| p.used_memory)
                .sum();
            let still = listed.iter().any(|p| p.pid == pid);
            if !still {
                let took = start.elapsed();
                rows[i].verify = Some(took);
                found.append(&mut rows[i].pending);
                found.push(Event::Verified {
                    pid: id(rows[i].handle),
                    ms: Some(ms(took)),
                });
                return false;
            }
            if Instant::now() >= deadline {
                found.append(&mut rows[i].pending);
                found.push(Event::VerifyFailed {
                    pid: id(rows[i].handle),
                    bytes_left: bytes,
                });
                rows[i].failure = Some(SuspendFailure::MemoryStillListed { bytes });
                return false;
            }
            true
        });
        let failed = found
            .iter()
            .any(|e| matches!(e, Event::VerifyFailed { .. }));
        if verified == Verified::ByCaller && !failed {
            unwritten.append(&mut found);
        } else {
            let mut all = std::mem::take(unwritten);
            all.append(&mut found);
            record_all(journal, all);
        }
        if pending.is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn roll_back(
    gpu: &Gpu,
    rows: &mut [Row<'_>],
    resume: bool,
    journal: Option<&Journal>,
    watcher: &dyn crate::Watcher,
) {
    for row in rows.iter_mut() {
        let pid = row.handle.pid();
        if row.ckpt_here && resume {
            // A driver restore like any other: journaled as restored before it happens.
            let resumed = match journal {
                Some(j) => crate::restore::resume_in_place(
                    gpu,
                    j,
                    row.handle,
                    "resumed in place after a failed suspension",
                    // The guard still traces it, but let go of what holds its context across an
                    // `execve` once it was checkpointed: announced again before the unlock.
                    watcher,
                )
                .map_err(|e| e.to_string()),
                None => gpu
                    .driver
                    .restore(pid, &[])
                    .and_then(|()| gpu.driver.unlock(pid))
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = resumed {
                tracing::error!(pid, error = %e, "cannot bring the process back after a failed suspension; it stays CHECKPOINTED (safe)");
            }
        } else if row.locked_here && !row.ckpt_here {
            let start = Instant::now();
            match gpu.driver.unlock(pid) {
                Ok(()) => record(
                    journal,
                    Event::Unlocked {
                        pid: id(row.handle),
                        ms: Some(ms(start.elapsed())),
                        recovery: false,
                    },
                ),
                Err(e) => {
                    abandoned(journal, row.handle, &e);
                    tracing::error!(pid, error = %e, "cannot unlock the process after a failed suspension")
                }
            }
        }
    }
}

/// The journal's identity of a process held by a handle.
pub fn id(h: &ProcHandle) -> ProcId {
    ProcId::of_handle(h)
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
