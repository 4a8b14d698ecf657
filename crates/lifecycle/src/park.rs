//! Park and wake in place: the cheapest scale to zero there is. A parked worker's CUDA processes
//! are locked, checkpointed and verified (NVML lists no device memory for them): the GPU is free
//! for other work, the processes stay alive in host memory, holding their device memory there.
//! A wake restores their contexts (onto the GPUs they left, or another one the policy allows),
//! has them traced by the guard while still LOCKED, then unlocks them. No image, no CRIU.
//!
//! # Design
//! - [`park`] is [`crate::suspend`] (the one all-or-nothing suspension) with
//!   `resume_on_failure`: a park that cannot suspend every CUDA process of the target brings back
//!   the ones it suspended, so the worker keeps serving. Each parked process is journaled
//!   ([`Event::Parked`]: its device memory and its GPUs), which is what a wake, `cryo status` and
//!   the metrics read; one parked already is journaled again with its first record's values (the
//!   record is what ends the park's suspension of it: without it a completed park of a parked
//!   worker stayed in flight, and the next guard or agent start resumed the worker). A park whose record cannot be written is undone: what it suspended is
//!   restored and unlocked in place ([`ParkError::Unrecorded`] says so, or names what could not
//!   be brought back, left suspended: never a CHECKPOINTED worker nothing can find). A process
//!   parked before it (a re-park) was not suspended by it and stays parked, its first record
//!   standing, and the error says so; the park's suspension of it, left in flight by the
//!   refused record (or by a re-park that died before its record), is settled by the next guard
//!   or agent start as still parked ([`crate::Settlement::StillParked`]), never resumed: a
//!   start woke a worker its user had parked, and the error said "the worker serves again".
//!   [`ParkOptions::max_parked_host`] refuses a park that would take the host memory held by
//!   parked workers past a limit.
//! - [`wake`] checks first, pure ([`place`]): the node's fence (every GPU when it holds an entry
//!   for an unknown GPU), and for each process, on every GPU it goes to, the free device memory
//!   it held on the GPU that one replaces ([`Event::Parked`] records each GPU's share): a
//!   restore short of memory on any one of them leaves the process stuck CHECKPOINTED for good
//!   (NVIDIA/cuda-checkpoint#44). [`WhenFull`] says what happens when none has room: wait for one
//!   (bounded), take another GPU of [`WakeOptions::gpus`], or refuse. Then: restore every
//!   process in parallel (journaled [`Event::RestoreCompleted`]: from then on it is a restored
//!   process), [`Watcher::guard_before_unlock`], unlock, health check. A failure after a restore
//!   suspends the restored processes again (they stay parked); a live restored context is never
//!   left unlocked without the guard when a guard runs, and never torn down.
//! - One park or wake at a time per process ([`crate::oplock`]): each takes the process's lock
//!   before it reads or journals anything and holds it until it returns; one that finds it held
//!   is refused at once, nothing done ([`ParkError::InProgress`], [`WakeError::InProgress`]).
//! - A parked process can be stopped (`cryo stop`: its context is already CHECKPOINTED, verified
//!   again, then killed) or frozen (`cryo freeze`: CRIU dumps it as it is).
//!
//! # Limitations
//! A process that was checkpointed by something other than a park has no record of its device
//! memory, so a wake refuses it (restore it with `cryo gpu restore`). One a park or a freeze
//! checkpointed and then died before its record (its suspension in flight, its owner gone) is
//! refused as such ([`WakeError::DeadPark`]): the next guard or agent start resumes it in place,
//! and a restore by hand would race that, so the refusal says so and advises none (it advised
//! `cryo gpu restore` before). A process on several GPUs
//! is only put back on the GPUs it left.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, Gpu, GpuInfo, GpuPair, GpuUuid, ProcessState};
use cryo_journal::{Event, Journal, ProcId, Record};
use cryo_proc::{Pid, ProcHandle};
use cryo_state::fence::{Fence, FenceError, FencedGpu, Quarantine};
use cryo_state::StateDir;
use cryo_units::fmt_bytes;

use crate::health::HealthCheck;
use crate::progress::Progress;
pub use crate::restore::Placement;
use crate::restore::{restore_to_unlock, AgainError};
use crate::suspend::{id, me, suspend, suspend_watched, SuspendFailure, SuspendOptions};
use crate::target::Resolved;
use crate::watcher::{Coverage, Watcher};

/// Options of a park.
#[derive(Debug, Clone)]
pub struct ParkOptions {
    /// How to suspend (`resume_on_failure` is always set: a failed park leaves the worker serving).
    pub suspend: SuspendOptions,
    /// Refuse a park that would take the host memory held by parked workers (this one included)
    /// past this many bytes.
    pub max_parked_host: Option<u64>,
    /// Ask the engine to release what it can rebuild first (taken back by the wake, or at once
    /// when the park fails).
    pub shrink: Option<crate::shrink::Shrink>,
}

impl Default for ParkOptions {
    fn default() -> Self {
        ParkOptions {
            suspend: SuspendOptions {
                resume_on_failure: true,
                ..SuspendOptions::default()
            },
            max_parked_host: None,
            shrink: None,
        }
    }
}

/// One parked process.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ParkedProc {
    /// The process.
    pub pid: Pid,
    /// Device memory moved into its host memory, bytes.
    pub device_bytes: u64,
    /// The GPUs it left.
    pub gpus: Vec<GpuUuid>,
    /// Its resident host memory after the park, bytes.
    pub host_bytes: u64,
    /// Whether it was parked already (nothing to do).
    pub already: bool,
}

/// What a park did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ParkReport {
    /// The target as named.
    pub target: String,
    /// The CUDA processes, now parked.
    pub parked: Vec<ParkedProc>,
    /// Processes of the target without CUDA state (left as they are).
    pub plain: Vec<Pid>,
    /// Wall time, ms.
    pub elapsed_ms: u64,
    /// The engine's shrink before the suspension, if one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<crate::shrink::ShrinkReport>,
}

/// The park did not happen; every process of the target serves as before (or, refused as
/// [`ParkError::InProgress`], is left as the operation at work on it leaves it).
#[derive(Debug, thiserror::Error)]
pub enum ParkError {
    /// Another park or a wake is at work on it: it holds the process's lock
    /// ([`crate::oplock`]). Nothing was read, journaled or suspended by this one.
    #[error("pid {pid} is being {} by {}: left to it", fmt_doing(*.doing), fmt_by(*.by))]
    InProgress {
        /// The process.
        pid: Pid,
        /// The cryo process at work on it, when known.
        by: Option<Pid>,
        /// What that one does, when known.
        doing: Option<crate::Op>,
    },
    /// The process's lock could not be taken (its file could not be created, opened or
    /// locked); nothing was read or suspended.
    #[error("cannot take the park's lock: {0}")]
    Lock(String),
    /// The target holds no CUDA process: there is nothing to park.
    #[error("{0} holds no CUDA process: nothing to park")]
    NoCuda(String),
    /// The driver could not tell which processes use CUDA.
    #[error("cannot ask the driver about pid {pid}: {error}")]
    Driver {
        /// The process.
        pid: Pid,
        /// The driver's error.
        error: cryo_gpu::DriverError,
    },
    /// The inspection API (NVML) could not list processes.
    #[error("cannot list GPU processes: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// The journal could not be read or written before acting.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    JournalRead(#[from] cryo_journal::ReadError),
    /// Parking would hold more host memory than the limit.
    #[error("parking would hold {} of host memory in parked workers, over the limit of {} (parked now: {}); wake or stop a parked worker first", fmt_bytes(*.would), fmt_bytes(*.limit), fmt_bytes(*.now))]
    HostMemory {
        /// Held after the park.
        would: u64,
        /// The limit.
        limit: u64,
        /// Held by parked workers now.
        now: u64,
    },
    /// A process could not be suspended; the ones suspended were brought back.
    #[error("pid {pid} cannot be parked: {} ({}); the worker keeps serving", .failure.reason(), .failure.hint())]
    Suspend {
        /// The process.
        pid: Pid,
        /// Why.
        failure: SuspendFailure,
    },
    /// Every process was suspended, but the record that it is parked (what a wake, `cryo
    /// status` and the agent find it by) could not be written: the processes this park
    /// suspended were restored and unlocked in place, so the worker serves again; those that
    /// could not be are named in `left` (CHECKPOINTED or LOCKED, never torn down). Those parked
    /// before this park (`kept`: it did nothing to them) stay parked, their first record
    /// standing: the settlement of this park's suspension leaves them parked
    /// ([`crate::Settlement::StillParked`]).
    #[error("pid {pid} was suspended but its park could not be recorded ({source}); {}", fmt_unrecorded(*.suspended, .left, .kept))]
    Unrecorded {
        /// The process whose record failed.
        pid: Pid,
        /// The journal's error.
        source: cryo_journal::AppendError,
        /// How many processes this park suspended (the others were parked already).
        suspended: usize,
        /// Processes not brought back, and why.
        left: Vec<(Pid, String)>,
        /// Processes parked before this park, which stay parked.
        kept: Vec<Pid>,
    },
}

/// Failpoint (`CRYO_FAILPOINT`, a test hook): every process is suspended and verified, and the
/// first `Parked` record of the park fails as a journal that cannot be written does (EIO), so
/// that the park's undo runs.
pub const PARK_RECORD_FAILS: &str = "park-record-fails";

/// Failpoint (`CRYO_FAILPOINT`, a test hook): as [`PARK_RECORD_FAILS`], and then the undo's
/// `RestoreCompleted` record fails too (EIO), its `RestoreStarted` written: the undo checkpoints
/// the worker again. Two transient write errors of a real disk (a path flapping under
/// multipath, a controller reset) leave the same journal.
pub const PARK_UNDO_UNRECORDED: &str = "park-undo-unrecorded";

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): as
/// [`PARK_RECORD_FAILS`], and then the undo pauses between the driver's restore (the worker is
/// LOCKED, its context restored) and its `RestoreCompleted` record, so that a test kills the park
/// there: what a park killed at that moment (the OOM killer, a node agent restarted) leaves.
pub const PARK_UNDO_DIES_RESTORED: &str = "park-undo-dies-restored";

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): every process
/// is suspended and verified, nothing is recorded as parked yet; the park waits there until the
/// file named by `CRYO_FAILPOINT_RESUME` exists, so that a test can fill the disk at that moment.
pub const PARK_BEFORE_RECORD: &str = "park-before-record";

/// "parked", "woken", "settled", or "worked on" when the holder did not say.
pub(crate) fn fmt_doing(doing: Option<crate::Op>) -> String {
    doing.map_or_else(|| "worked on".to_string(), |d| d.to_string())
}

/// "cryo pid N", or "another cryo process" when the holder did not say.
pub(crate) fn fmt_by(by: Option<Pid>) -> String {
    by.map_or_else(
        || "another cryo process".to_string(),
        |by| format!("cryo pid {by}"),
    )
}

/// Parks every CUDA process of `target` (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn park(
    gpu: &Gpu,
    target: &Resolved,
    opts: &ParkOptions,
    journal: &Journal,
    state: &StateDir,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<ParkReport, ParkError> {
    let start = Instant::now();
    let described = target.target().to_string();
    // One park or wake at a time per process, held until this returns (its undo included): one
    // at work already refuses this one before it reads, journals or suspends anything.
    let _locks =
        crate::oplock::take(state, target.handles(), crate::Op::Park).map_err(|e| match e {
            crate::oplock::LockError::Held { pid, by, doing } => {
                ParkError::InProgress { pid, by, doing }
            }
            e => ParkError::Lock(e.to_string()),
        })?;
    journal.append(Event::ParkStarted {
        target: described.clone(),
    })?;
    let mut shrunk = crate::shrink::release(
        gpu,
        opts.shrink.as_ref(),
        &described,
        target.handles(),
        opts.shrink.as_ref().map_or(Duration::ZERO, |s| s.timeout()),
        journal,
        progress,
    )?;
    let mut result = park_inner(
        gpu, target, opts, journal, watcher, progress, &described, start,
    );
    if let Some(s) = shrunk.as_mut() {
        match result.as_mut() {
            Ok(r) => r.shrink = Some(s.report.clone()),
            // The park left the worker serving: its engine takes its memory back.
            Err(_) => {
                if let Err(e) = s.grow(journal, progress) {
                    tracing::error!(error = %e, "cannot journal the engine's grow");
                }
            }
        }
    }
    match &result {
        Ok(r) => {
            journal.append(Event::ParkCompleted {
                target: described,
                pids: target
                    .handles()
                    .iter()
                    .filter(|h| r.parked.iter().any(|p| p.pid == h.pid()))
                    .map(id)
                    .collect(),
                ms: ms(start.elapsed()),
            })?;
        }
        Err(e) => {
            if let Err(j) = journal.append(Event::ParkFailed {
                target: described,
                error: e.to_string(),
            }) {
                tracing::error!(error = %j, "cannot journal the failed park");
            }
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn park_inner(
    gpu: &Gpu,
    target: &Resolved,
    opts: &ParkOptions,
    journal: &Journal,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
    described: &str,
    start: Instant,
) -> Result<ParkReport, ParkError> {
    let (cuda, plain) = cuda_processes(gpu, target.handles())
        .map_err(|(pid, error)| ParkError::Driver { pid, error })?;
    if cuda.is_empty() {
        return Err(ParkError::NoCuda(described.to_string()));
    }
    let records = cryo_journal::read(journal.dir())?.records;
    let known = parked_records(&records);
    let listed = gpu.inspect.processes()?;
    let on_gpu = |pid: Pid| -> (u64, Vec<(GpuUuid, u64)>) {
        let per_gpu = per_gpu(&listed, pid);
        (per_gpu.iter().map(|(_, b)| b).sum(), per_gpu)
    };
    if let Some(limit) = opts.max_parked_host {
        let now: u64 = parked_now(&records)
            .iter()
            .filter(|w| !cuda.iter().any(|h| id(h) == w.pid))
            .map(|w| w.host_bytes)
            .sum();
        let adding: u64 = cuda
            .iter()
            .map(|h| h.rss().unwrap_or(0) + on_gpu(h.pid()).0)
            .sum();
        if now + adding > limit {
            return Err(ParkError::HostMemory {
                would: now + adding,
                limit,
                now,
            });
        }
    }
    let before: Vec<(u64, Vec<(GpuUuid, u64)>)> = cuda.iter().map(|h| on_gpu(h.pid())).collect();
    let suspend_opts = SuspendOptions {
        resume_on_failure: true,
        purpose: cryo_journal::Purpose::Park,
        ..opts.suspend.clone()
    };
    let outcomes = suspend_watched(gpu, &cuda, &suspend_opts, Some(journal), progress, watcher);
    if let Some((pid, failure)) = outcomes
        .iter()
        .find_map(|o| o.result.as_ref().err().map(|f| (o.pid, f.clone())))
    {
        return Err(ParkError::Suspend { pid, failure });
    }
    crate::failpoint::pause_if(PARK_BEFORE_RECORD);
    let mut parked = Vec::new();
    for ((h, (bytes, gpus)), o) in cuda.iter().zip(before).zip(&outcomes) {
        let already = matches!(&o.result, Ok(s) if s.state_before == ProcessState::Checkpointed);
        // A process parked before keeps the record of what it held on the GPU.
        let (bytes, gpus, gpu_bytes) = match known.get(&id(h)) {
            Some(k) if already => (k.device_bytes, k.gpus.clone(), k.gpu_bytes.clone()),
            _ => {
                let (gpus, gpu_bytes) = gpus.into_iter().unzip();
                (bytes, gpus, gpu_bytes)
            }
        };
        // Recorded again when it was parked before (the same record): the record is what ends
        // this park's suspension of it in the journal's eyes. Unrecorded, a park of a parked
        // worker stayed in flight after it completed, and the next guard or agent start
        // "settled" it: restored and unlocked a worker an operator had parked.
        let fails = [
            PARK_RECORD_FAILS,
            PARK_UNDO_UNRECORDED,
            PARK_UNDO_DIES_RESTORED,
        ]
        .into_iter()
        .find(|f| crate::failpoint::active(f));
        let recorded = if let Some(f) = fails {
            Err(crate::failpoint::journal_eio(journal, f))
        } else {
            journal.append(Event::Parked {
                pid: id(h),
                bytes,
                gpus: gpus.iter().map(ToString::to_string).collect(),
                gpu_bytes,
            })
        };
        if let Err(source) = recorded {
            return Err(unpark(
                gpu,
                &cuda,
                &outcomes,
                journal,
                watcher,
                h.pid(),
                source,
            ));
        }
        parked.push(ParkedProc {
            pid: h.pid(),
            device_bytes: bytes,
            gpus,
            host_bytes: h.rss().unwrap_or(0),
            already,
        });
    }
    Ok(ParkReport {
        target: described.to_string(),
        parked,
        plain: plain.iter().map(|h| h.pid()).collect(),
        elapsed_ms: ms(start.elapsed()),
        shrink: None,
    })
}

/// A park whose record of `pid` could not be written (`source`): every process of `cuda` this
/// park suspended (`outcomes`: not parked before it) is restored and unlocked in place, traced
/// by `watcher` before its unlock as after any restore; a process already parked before stays
/// as it was, its record written then. Whatever cannot be brought back stays suspended (safe)
/// and is named in the error.
fn unpark(
    gpu: &Gpu,
    cuda: &[&ProcHandle],
    outcomes: &[crate::suspend::SuspendOutcome],
    journal: &Journal,
    watcher: &dyn Watcher,
    pid: Pid,
    source: cryo_journal::AppendError,
) -> ParkError {
    tracing::error!(pid, error = %source, "the park cannot be recorded: resuming what it suspended");
    let mut left = Vec::new();
    let mut kept = Vec::new();
    let mut suspended = 0;
    for (h, o) in cuda.iter().zip(outcomes) {
        let suspended_here =
            matches!(&o.result, Ok(s) if s.state_before != ProcessState::Checkpointed);
        if !suspended_here {
            kept.push(h.pid());
            continue;
        }
        suspended += 1;
        if let Err(e) = crate::restore::resume_in_place(
            gpu,
            journal,
            h,
            "resumed in place: its park could not be recorded",
            watcher,
        ) {
            left.push((h.pid(), e.to_string()));
        }
    }
    ParkError::Unrecorded {
        pid,
        source,
        suspended,
        left,
        kept,
    }
}

/// What became of a park's processes once its record could not be written ([`unpark`]): those
/// it suspended resumed (or named in `left`), those parked before it (`kept`) still parked.
/// Before, a re-park of a parked worker said "...: the worker serves again" of a worker it had
/// left parked.
fn fmt_unrecorded(suspended: usize, left: &[(Pid, String)], kept: &[Pid]) -> String {
    let kept_said = (!kept.is_empty()).then(|| {
        format!(
            "pid {}: it was parked already and stays parked (CHECKPOINTED, its first park record standing: the next guard or agent start leaves it parked, `cryo wake` brings it back)",
            crate::thaw::fmt_pids(kept)
        )
    });
    match (suspended, kept_said) {
        (_, None) => crate::restore::fmt_left(left),
        (0, Some(k)) => k,
        (_, Some(k)) if left.is_empty() => {
            format!("every process it suspended was resumed in place; {k}")
        }
        (_, Some(k)) => format!("{}; {k}", crate::restore::fmt_left(left)),
    }
}

/// What NVML lists for `pid`: each GPU (in the order listed) and its device memory there.
fn per_gpu(listed: &[cryo_gpu::GpuProcess], pid: Pid) -> Vec<(GpuUuid, u64)> {
    let mut out: Vec<(GpuUuid, u64)> = Vec::new();
    for p in listed.iter().filter(|p| p.pid == pid) {
        match out.iter_mut().find(|(u, _)| *u == p.gpu_uuid) {
            Some((_, b)) => *b += p.used_memory,
            None => out.push((p.gpu_uuid.clone(), p.used_memory)),
        }
    }
    out
}

/// The processes of `handles` the driver answers a state for (CUDA), and the others.
#[allow(clippy::type_complexity)]
fn cuda_processes<'a>(
    gpu: &Gpu,
    handles: &'a [ProcHandle],
) -> Result<(Vec<&'a ProcHandle>, Vec<&'a ProcHandle>), (Pid, cryo_gpu::DriverError)> {
    let mut cuda = Vec::new();
    let mut plain = Vec::new();
    for h in handles {
        match gpu.driver.state(h.pid()) {
            Ok(_) => cuda.push(h),
            Err(e)
                if matches!(
                    e.code(),
                    Some(CuResult::NOT_INITIALIZED) | Some(CuResult::INVALID_VALUE)
                ) && h.is_alive() =>
            {
                plain.push(h)
            }
            Err(_) if !h.is_alive() => {}
            Err(e) => return Err((h.pid(), e)),
        }
    }
    Ok((cuda, plain))
}

/// What the journal says a parked process left on the GPU.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ParkedRecord {
    /// The process.
    pub pid: ProcId,
    /// Device memory it held, bytes.
    pub device_bytes: u64,
    /// The GPUs it held.
    pub gpus: Vec<GpuUuid>,
    /// Device memory it held on each of `gpus`, in that order (empty for a record that does not
    /// say: [`ParkedRecord::needs_on`] splits `device_bytes` evenly).
    pub gpu_bytes: Vec<u64>,
}

impl ParkedRecord {
    /// The device memory a restore needs free on its `i`-th GPU.
    pub fn needs_on(&self, i: usize) -> u64 {
        match self.gpu_bytes.get(i) {
            Some(b) if self.gpu_bytes.len() == self.gpus.len() => *b,
            _ => self
                .device_bytes
                .div_ceil(u64::try_from(self.gpus.len().max(1)).unwrap_or(1)),
        }
    }
}

/// Every process whose last word in `records` is that it was parked (no restore, unlock or exit
/// since), whether or not it is still alive.
pub fn parked_records(records: &[Record]) -> BTreeMap<ProcId, ParkedRecord> {
    let mut parked = BTreeMap::new();
    for r in records {
        match &r.event {
            Event::Parked {
                pid,
                bytes,
                gpus,
                gpu_bytes,
            } => {
                parked.insert(
                    *pid,
                    ParkedRecord {
                        pid: *pid,
                        device_bytes: *bytes,
                        gpus: gpus.iter().filter_map(|g| g.parse().ok()).collect(),
                        gpu_bytes: gpu_bytes.clone(),
                    },
                );
            }
            Event::RestoreCompleted { pid, .. }
            | Event::Unlocked { pid, .. }
            | Event::Resumed { pid }
            | Event::Killed { pid }
            | Event::ProcessExited { pid, .. } => {
                parked.remove(pid);
            }
            _ => {}
        }
    }
    parked
}

/// A parked worker process alive now, and the host memory it holds.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ParkedWorker {
    /// The process.
    pub pid: ProcId,
    /// Device memory it left on the GPU (now in its host memory), bytes.
    pub device_bytes: u64,
    /// The GPUs it left.
    pub gpus: Vec<GpuUuid>,
    /// Its resident host memory now, bytes.
    pub host_bytes: u64,
}

/// The parked processes alive now (journal + /proc; no driver call), for `cryo status`.
pub fn parked_now(records: &[Record]) -> Vec<ParkedWorker> {
    parked_records(records)
        .into_values()
        .filter_map(|r| {
            let h = r.pid.open().ok()?;
            h.is_alive().then(|| ParkedWorker {
                pid: r.pid,
                device_bytes: r.device_bytes,
                gpus: r.gpus,
                host_bytes: h.rss().unwrap_or(0),
            })
        })
        .collect()
}

/// What a wake does when the GPU a process needs has too little free memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenFull {
    /// Wait (up to this long) for memory to be freed, then refuse.
    Wait(Duration),
    /// Put the process on another allowed GPU with room (same model), else refuse.
    OtherGpu,
    /// Refuse at once.
    Refuse,
}

/// Options of a wake.
#[derive(Debug, Clone)]
pub struct WakeOptions {
    /// GPUs a wake may put processes on (`None`: the ones they left only, plus any GPU of the
    /// node with [`WhenFull::OtherGpu`]).
    pub gpus: Option<Vec<GpuUuid>>,
    /// What to do when there is no room.
    pub when_full: WhenFull,
    /// How to tell the worker serves again; `None`: success once unlocked.
    pub health: Option<HealthCheck>,
    /// How long the health check may take.
    pub health_timeout: Duration,
    /// How to put the processes back to sleep when a step after a restore fails.
    pub resuspend: SuspendOptions,
}

impl Default for WakeOptions {
    fn default() -> Self {
        WakeOptions {
            gpus: None,
            when_full: WhenFull::Refuse,
            health: None,
            health_timeout: Duration::from_secs(60),
            resuspend: SuspendOptions::default(),
        }
    }
}

/// One woken process.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WokenProc {
    /// The process.
    pub pid: Pid,
    /// The GPUs it runs on now.
    pub gpus: Vec<GpuUuid>,
    /// Device memory restored, bytes.
    pub bytes: u64,
    /// The driver's restore, ms (`None`: it was restored already, a wake that died half-way).
    pub restore_ms: Option<u64>,
}

/// What a wake did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct WakeReport {
    /// The target as named.
    pub target: String,
    /// The processes woken.
    pub woken: Vec<WokenProc>,
    /// Whether a guard traced them before they were unlocked (`false`: no guard runs).
    pub guarded: bool,
    /// Waiting for GPU memory, ms.
    pub waited_ms: u64,
    /// Restore of every process (in parallel), guard and unlock, ms.
    pub gpu_ms: u64,
    /// From the start to the first healthy answer, ms (`None` without a health check).
    pub first_answer_ms: Option<u64>,
    /// Wall time, ms.
    pub elapsed_ms: u64,
    /// The grow of an engine shrunk before its park (after the unlock), if one was pending.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<crate::shrink::ShrinkReport>,
    /// Where the time went, step by step (journal appends, driver calls, guard, health).
    #[serde(default)]
    pub phases: crate::progress::Phases,
}

/// No GPU can take a parked process now; nothing was restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PlaceError {
    /// The guard pinned a context whose GPU it could not tell: every GPU of the node is fenced.
    #[error("every GPU of this node is quarantined: {reason} (see `cryo status`)")]
    NodeFenced {
        /// The quarantine entry's reason.
        reason: String,
    },
    /// The process left a GPU that is not on this node any more.
    #[error("pid {pid} left GPU {gpu}, which this node does not have")]
    NoSuchGpu {
        /// The process.
        pid: Pid,
        /// The GPU.
        gpu: GpuUuid,
    },
    /// No allowed GPU has the room (or every one with room is quarantined).
    #[error("pid {pid} needs {} of device memory and no GPU it may use has it ({}): a restore short of memory leaves it stuck CHECKPOINTED", fmt_bytes(*.needed), .tried)]
    NoRoom {
        /// The process.
        pid: Pid,
        /// Bytes needed.
        needed: u64,
        /// What each GPU tried had (`GPU-x: 100 MiB free`, `GPU-y: quarantined`).
        tried: String,
    },
}

/// Decides where each parked process lands. Pure: `gpus` and `fenced` describe the node,
/// `allowed` and `other_gpu` the policy.
pub fn place(
    procs: &[(Pid, &ParkedRecord)],
    gpus: &[GpuInfo],
    fenced: &[Quarantine],
    allowed: Option<&[GpuUuid]>,
    other_gpu: bool,
) -> Result<Vec<Placement>, PlaceError> {
    if let Some(q) = fenced.iter().find(|q| q.gpu == FencedGpu::Unknown) {
        return Err(PlaceError::NodeFenced {
            reason: q.reason.clone(),
        });
    }
    let mut free: BTreeMap<&GpuUuid, u64> = gpus.iter().map(|g| (&g.uuid, g.memory_free)).collect();
    let usable = |u: &GpuUuid| {
        !fenced.iter().any(|q| q.gpu.covers(u)) && allowed.is_none_or(|a| a.contains(u))
    };
    let mut out = Vec::new();
    for (pid, rec) in procs {
        let model = |u: &GpuUuid| gpus.iter().find(|g| g.uuid == *u).map(|g| &g.name);
        for g in &rec.gpus {
            if model(g).is_none() && !(other_gpu && rec.gpus.len() == 1) {
                return Err(PlaceError::NoSuchGpu {
                    pid: *pid,
                    gpu: g.clone(),
                });
            }
        }
        // Candidates: where it was, then (one GPU only) every other allowed GPU of its model.
        let mut candidates: Vec<Vec<GpuUuid>> = vec![rec.gpus.clone()];
        if other_gpu && rec.gpus.len() == 1 {
            let want = model(&rec.gpus[0]);
            candidates.extend(
                gpus.iter()
                    .filter(|g| g.uuid != rec.gpus[0] && (want.is_none() || want == Some(&g.name)))
                    .map(|g| vec![g.uuid.clone()]),
            );
        }
        // Each GPU must have room for what the process held on the GPU it replaces (a restore
        // short on any one of them restores nothing and leaves the process stuck).
        let mut tried = Vec::new();
        let mut chosen = None;
        for c in candidates {
            let ok = c.iter().enumerate().all(|(i, u)| {
                if !usable(u) {
                    tried.push(format!("{u}: not allowed or quarantined"));
                    return false;
                }
                let f = free.get(u).copied().unwrap_or(0);
                let needs = rec.needs_on(i);
                if f < needs {
                    tried.push(format!(
                        "{u}: {} free, needs {}",
                        fmt_bytes(f),
                        fmt_bytes(needs)
                    ));
                    return false;
                }
                true
            });
            if ok {
                chosen = Some(c);
                break;
            }
        }
        let Some(targets) = chosen else {
            return Err(PlaceError::NoRoom {
                pid: *pid,
                needed: rec.device_bytes,
                tried: tried.join(", "),
            });
        };
        for (i, u) in targets.iter().enumerate() {
            if let Some(f) = free.get_mut(u) {
                *f = f.saturating_sub(rec.needs_on(i));
            }
        }
        out.push(Placement {
            pid: *pid,
            pairs: rec
                .gpus
                .iter()
                .zip(&targets)
                .filter(|(old, new)| old != new)
                .map(|(old, new)| GpuPair {
                    old: old.clone(),
                    new: new.clone(),
                })
                .collect(),
            targets,
            bytes: rec.device_bytes,
        });
    }
    Ok(out)
}

/// The wake failed.
#[derive(Debug, thiserror::Error)]
pub enum WakeError {
    /// The target holds no CUDA process.
    #[error("{0} holds no CUDA process: nothing to wake")]
    NoCuda(String),
    /// The driver could not tell which processes use CUDA.
    #[error("cannot ask the driver about pid {pid}: {error}")]
    Driver {
        /// The process.
        pid: Pid,
        /// The driver's error.
        error: cryo_gpu::DriverError,
    },
    /// A CHECKPOINTED process has no park record (what it held on the GPU is unknown).
    #[error("pid {0} was not parked by cryo (no record of its device memory); restore it with `cryo gpu restore`")]
    NotParked(Pid),
    /// A CHECKPOINTED process with no park record whose park (or freeze) did not finish (its
    /// owner gone, its suspension in flight): what it held on the GPU is unknown to a wake, and
    /// the next guard or agent start resumes it in place ([`crate::settle_in_flight`]). A
    /// restore by hand would race that settlement, so none is advised.
    #[error("pid {pid} was checkpointed by a {what} that did not finish ({}) and has no record of its device memory: the next `cryo guard` start or agent start resumes it in place, traced (restart the agent, or start `cryo guard`); nothing was restored (a `cryo gpu restore` by hand would race that)", fmt_by(*.by))]
    DeadPark {
        /// The process.
        pid: Pid,
        /// What left it so: "park" or "freeze".
        what: &'static str,
        /// The cryo process that did, when the journal names it.
        by: Option<Pid>,
    },
    /// The process's driver state is FAILED.
    #[error("the driver reports pid {0} FAILED; it cannot be woken")]
    Failed(Pid),
    /// A park or another wake is at work on it: it holds the process's lock
    /// ([`crate::oplock`]), or restored it and has not recorded that yet. Nothing was restored
    /// by this one.
    #[error("pid {pid} is being {} by {}: left to it", fmt_doing(*.doing), fmt_by(*.by))]
    InProgress {
        /// The process.
        pid: Pid,
        /// The cryo process at work on it, when known.
        by: Option<Pid>,
        /// What that one does, when known.
        doing: Option<crate::Op>,
    },
    /// The process's lock could not be taken (its file could not be created, opened or
    /// locked); nothing was read or restored.
    #[error("cannot take the wake's lock: {0}")]
    Lock(String),
    /// No GPU can take it (after waiting, when the policy waits); nothing was restored.
    #[error("wake refused: {0}")]
    Place(#[from] PlaceError),
    /// The node's quarantine could not be read or is not trusted; nothing was restored.
    #[error("cannot read the GPU quarantine, so every GPU counts as fenced: {0}")]
    Fence(#[from] FenceError),
    /// The GPUs could not be inspected; nothing was restored.
    #[error("cannot inspect the GPUs: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// The journal could not be written before acting.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    JournalRead(#[from] cryo_journal::ReadError),
    /// A step after a restore failed; the restored processes were parked again (or, if that
    /// failed too, left as `cleanup` says).
    #[error("{step} failed: {error}; {cleanup}")]
    AfterRestore {
        /// The step.
        step: &'static str,
        /// What went wrong.
        error: String,
        /// What became of the restored processes.
        cleanup: String,
    },
}

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): a wake pauses
/// once it has read its processes' driver states and the journal, before it places and restores
/// them (where a second wake of the same worker finds them still CHECKPOINTED).
pub const WAKE_BEFORE_RESTORE: &str = "wake-before-restore";

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): a wake pauses
/// once every restore of it is journaled complete, before the guard's attach and the unlock (its
/// processes LOCKED, their contexts restored), where a test kills it: what a restarted guard
/// or agent finishes ([`crate::restore::finish_unlock`]).
pub const WAKE_BEFORE_UNLOCK: &str = "wake-before-unlock";

/// Wakes every parked process of `target` (see the module docs).
#[allow(clippy::too_many_arguments)]
pub fn wake(
    gpu: &Gpu,
    target: &Resolved,
    opts: &WakeOptions,
    journal: &Journal,
    state: &StateDir,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<WakeReport, WakeError> {
    let start = Instant::now();
    let mut watch = crate::progress::Stopwatch::default();
    let described = target.target().to_string();
    // One park or wake at a time per process, held until this returns (its park again
    // included): one at work already refuses this one before it reads, journals or restores
    // anything.
    let _locks =
        crate::oplock::take(state, target.handles(), crate::Op::Wake).map_err(|e| match e {
            crate::oplock::LockError::Held { pid, by, doing } => {
                WakeError::InProgress { pid, by, doing }
            }
            e => WakeError::Lock(e.to_string()),
        })?;
    let fence = &state.fence();
    journal.append(Event::WakeStarted {
        target: described.clone(),
    })?;
    watch.mark("journal: wake started");
    let mut result = wake_inner(
        gpu, target, opts, journal, fence, watcher, progress, start, &mut watch,
    );
    if let Ok((r, records)) = result.as_mut() {
        // The worker runs: an engine shrunk before its park takes its memory back (the journal
        // as read before the restore: the shrink was journaled before the park).
        let ids: Vec<_> = target.handles().iter().map(id).collect();
        if let Some(mut s) = crate::shrink::pending(records, &ids) {
            s.reached_through(gpu, target.handles());
            if let Err(e) = s.grow(journal, progress) {
                tracing::error!(error = %e, "cannot journal the engine's grow");
            }
            r.shrink = Some(s.report);
        }
        watch.mark("engine grow check");
    }
    let mut result = result.map(|(r, _)| r);
    match &result {
        Ok(r) => {
            let pids = target
                .handles()
                .iter()
                .filter(|h| r.woken.iter().any(|w| w.pid == h.pid()))
                .map(id)
                .collect();
            if let Err(e) = journal.append(Event::WakeCompleted {
                target: described,
                pids,
                ms: r.elapsed_ms,
            }) {
                // The worker runs: a journal that cannot take the record must not fail the wake.
                tracing::error!(error = %e, "cannot journal the completed wake");
            }
            watch.mark("journal: wake completed");
        }
        Err(e) => {
            if let Err(j) = journal.append(Event::WakeFailed {
                target: described,
                error: e.to_string(),
            }) {
                tracing::error!(error = %j, "cannot journal the failed wake");
            }
        }
    }
    if let Ok(r) = result.as_mut() {
        r.phases = watch.phases;
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn wake_inner(
    gpu: &Gpu,
    target: &Resolved,
    opts: &WakeOptions,
    journal: &Journal,
    fence: &Fence,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
    start: Instant,
    watch: &mut crate::progress::Stopwatch,
) -> Result<(WakeReport, Vec<cryo_journal::Record>), WakeError> {
    let described = target.target().to_string();
    let (cuda, _plain) = cuda_processes(gpu, target.handles())
        .map_err(|(pid, error)| WakeError::Driver { pid, error })?;
    if cuda.is_empty() {
        return Err(WakeError::NoCuda(described));
    }
    watch.mark("driver: which processes are CUDA");
    let records = cryo_journal::read(journal.dir())?.records;
    let known = parked_records(&records);
    watch.mark("journal read (parked records)");
    // What each process needs: CHECKPOINTED ones a restore; LOCKED ones after a journaled restore
    // (a wake that died after its record) only the guard and the unlock; RUNNING ones nothing.
    // LOCKED without a journaled restore (a wake that died before its record) is not taken as a
    // whole restored context on the driver's word: checkpointed again, then restored.
    let mut to_restore: Vec<(&ProcHandle, &ParkedRecord)> = Vec::new();
    let mut to_unlock: Vec<&ProcHandle> = Vec::new();
    for h in &cuda {
        match gpu.driver.state(h.pid()) {
            Ok(ProcessState::Checkpointed) => {
                let rec = known.get(&id(h)).ok_or_else(|| not_parked(&records, h))?;
                to_restore.push((h, rec));
            }
            Ok(ProcessState::Locked) => match crate::restore::last_restore(&records, id(h)) {
                Some((_, true)) => to_unlock.push(h),
                Some((Some(by), false)) if Some(by) == me() || by.is_alive_same() => {
                    // Not a park or a wake (those hold the process's lock): say no more than
                    // that something is at work on it.
                    return Err(WakeError::InProgress {
                        pid: h.pid(),
                        by: Some(by.pid),
                        doing: None,
                    });
                }
                _ => {
                    let rec = known.get(&id(h)).ok_or(WakeError::NotParked(h.pid()))?;
                    crate::restore::checkpoint_again(gpu, journal, h).map_err(|e| match e {
                        AgainError::Driver(error) => WakeError::Driver {
                            pid: h.pid(),
                            error,
                        },
                        AgainError::Intent(e) | AgainError::Journal(e) => WakeError::Journal(e),
                    })?;
                    to_restore.push((h, rec));
                }
            },
            Ok(ProcessState::Running) => {}
            Ok(ProcessState::Failed) => return Err(WakeError::Failed(h.pid())),
            Err(error) => {
                return Err(WakeError::Driver {
                    pid: h.pid(),
                    error,
                })
            }
        }
    }

    crate::failpoint::pause_if(WAKE_BEFORE_RESTORE);
    // Where each lands, waiting for room when the policy says so.
    let waited = Instant::now();
    let procs: Vec<(Pid, &ParkedRecord)> = to_restore.iter().map(|(h, r)| (h.pid(), *r)).collect();
    let mut said_waiting = false;
    let plan = loop {
        let fenced = fence.list()?;
        let gpus = gpu.inspect.gpus()?;
        match place(
            &procs,
            &gpus,
            &fenced,
            opts.gpus.as_deref(),
            opts.when_full == WhenFull::OtherGpu,
        ) {
            Ok(p) => break p,
            Err(PlaceError::NoRoom { pid, needed, tried }) if matches!(opts.when_full, WhenFull::Wait(w) if waited.elapsed() < w) =>
            {
                if !said_waiting {
                    said_waiting = true;
                    let reason = format!(
                        "waiting for room on GPU for pid {pid} ({} needed; {tried})",
                        fmt_bytes(needed)
                    );
                    tracing::info!(target = %described, "{reason}");
                    journal.append(Event::WakeWaiting {
                        target: described.clone(),
                        reason,
                    })?;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            Err(e) => return Err(e.into()),
        }
    };
    let waited_ms = ms(waited.elapsed());
    watch.mark("driver states, fence, NVML placement");

    let t = Instant::now();
    let how = "wake";
    let results: Vec<Result<u64, String>> = std::thread::scope(|s| {
        let jobs: Vec<_> = plan
            .iter()
            .zip(&to_restore)
            .map(|(p, (h, _))| {
                s.spawn(move || {
                    progress.begin(p.pid, "gpu restore", p.bytes);
                    let t = Instant::now();
                    // Journaled as restored before the driver is asked, completed after.
                    let r = restore_to_unlock(gpu, journal, h, &p.pairs, how)
                        .map(ms)
                        .map_err(|e| e.to_string());
                    progress.end(
                        p.pid,
                        "gpu restore",
                        r.is_ok(),
                        &format!("{} ms", t.elapsed().as_millis()),
                    );
                    r
                })
            })
            .collect();
        jobs.into_iter()
            .map(|j| {
                j.join()
                    .unwrap_or_else(|_| Err("restore thread panicked".into()))
            })
            .collect()
    });
    let mut woken = Vec::new();
    let mut restored: Vec<&ProcHandle> = to_unlock.clone();
    let mut failure = None;
    for (((h, _), p), r) in to_restore.iter().zip(&plan).zip(results) {
        match r {
            Ok(restore_ms) => {
                // Its context is live again (LOCKED): from now on it is a restored process.
                restored.push(h);
                woken.push(WokenProc {
                    pid: h.pid(),
                    gpus: p.targets.clone(),
                    bytes: p.bytes,
                    restore_ms: Some(restore_ms),
                });
            }
            Err(e) => {
                failure.get_or_insert(format!("pid {}: {e}", h.pid()));
            }
        }
    }
    for h in &to_unlock {
        woken.push(WokenProc {
            pid: h.pid(),
            gpus: Vec::new(),
            bytes: known.get(&id(h)).map_or(0, |k| k.device_bytes),
            restore_ms: None,
        });
    }
    let fail = |step: &'static str, error: String| WakeError::AfterRestore {
        step,
        error,
        cleanup: park_again(gpu, &restored, &opts.resuspend, journal, progress),
    };
    if let Some(e) = failure {
        return Err(fail("GPU restore", e));
    }
    watch.mark("GPU restore (journaled before and after)");
    crate::failpoint::pause_if(WAKE_BEFORE_UNLOCK);
    // Traced while LOCKED, before anything runs: never an unguarded restored context where a
    // guard runs.
    let guarded = match watcher.guard_before_unlock(&restored) {
        Ok(c) => c == Coverage::Guarded,
        Err(e) => return Err(fail("guard before unlock", e.to_string())),
    };
    watch.mark("guard attach");
    for h in &restored {
        let t = Instant::now();
        if let Err(e) = gpu.driver.unlock(h.pid()) {
            return Err(fail("unlock", format!("pid {}: {e}", h.pid())));
        }
        if let Err(e) = journal.append(Event::Unlocked {
            pid: id(h),
            ms: Some(ms(t.elapsed())),
            recovery: false,
        }) {
            tracing::error!(pid = h.pid(), error = %e, "cannot journal the unlock");
        }
    }
    let gpu_ms = ms(t.elapsed());
    watch.mark("unlock (journaled)");
    let first_answer_ms = match &opts.health {
        None => None,
        Some(check) => match check.wait(opts.health_timeout) {
            Ok(at) => Some(ms(at.duration_since(start))),
            // The worker runs and is guarded: a health check that fails is reported, and the
            // worker is left as it is (it may still be starting; the caller decides).
            Err(e) => {
                return Err(WakeError::AfterRestore {
                    step: "health check",
                    error: e.to_string(),
                    cleanup: "the worker was left running".into(),
                })
            }
        },
    };
    if opts.health.is_some() {
        watch.mark("first answer (health check)");
    }
    Ok((
        WakeReport {
            target: described,
            woken,
            guarded,
            waited_ms,
            gpu_ms,
            first_answer_ms,
            elapsed_ms: ms(start.elapsed()),
            shrink: None,
            phases: crate::progress::Phases::default(),
        },
        records,
    ))
}

/// Why CHECKPOINTED process `h` with no park record cannot be woken: a dead park's or freeze's
/// suspension in flight ([`WakeError::DeadPark`], which the next guard or agent start settles),
/// or nothing cryo knows of ([`WakeError::NotParked`]).
fn not_parked(records: &[cryo_journal::Record], h: &ProcHandle) -> WakeError {
    let f = cryo_journal::in_flight_stops(records).remove(&id(h));
    let what = match f.as_ref().and_then(|f| f.purpose) {
        Some(cryo_journal::Purpose::Park) => "park",
        Some(cryo_journal::Purpose::Freeze) => "freeze",
        _ => return WakeError::NotParked(h.pid()),
    };
    let by = f.and_then(|f| f.by);
    if by.is_some_and(|b| b.is_alive_same()) {
        return WakeError::NotParked(h.pid());
    }
    WakeError::DeadPark {
        pid: h.pid(),
        what,
        by: by.map(|b| b.pid),
    }
}

/// Suspends restored (LOCKED) processes again; says what became of them.
fn park_again(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    opts: &SuspendOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> String {
    if procs.is_empty() {
        return "nothing was restored".into();
    }
    let opts = SuspendOptions {
        resume_on_failure: false,
        purpose: cryo_journal::Purpose::Park,
        ..opts.clone()
    };
    // Where they are now (NVML lists a LOCKED process), for the next wake.
    let listed = gpu.inspect.processes().unwrap_or_default();
    let out = suspend(gpu, procs, &opts, Some(journal), progress);
    let mut bad = Vec::new();
    for (h, o) in procs.iter().zip(&out) {
        match &o.result {
            Ok(s) => {
                let (gpus, gpu_bytes): (Vec<String>, Vec<u64>) = per_gpu(&listed, h.pid())
                    .into_iter()
                    .map(|(u, b)| (u.to_string(), b))
                    .unzip();
                if let Err(e) = journal.append(Event::Parked {
                    pid: id(h),
                    bytes: s.device_memory,
                    gpus,
                    gpu_bytes,
                }) {
                    tracing::error!(pid = h.pid(), error = %e, "cannot journal the new park");
                }
            }
            Err(f) => bad.push(format!("pid {}: {}", h.pid(), f.reason())),
        }
    }
    if bad.is_empty() {
        "the restored processes were parked again".into()
    } else {
        format!(
            "NOT parked again: {} (they stay LOCKED or CHECKPOINTED, never torn down; run `cryo stop` on them)",
            bad.join("; ")
        )
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
