//! `cryo freeze`: suspend every CUDA process of a tree, CRIU-dump the tree into a staged image,
//! publish it atomically.
//!
//! # Design
//! 1. The tree comes resolved to pidfd handles (the caller resolved it once); a member (not
//!    the root) that ends while it is looked at is not part of it; refuse what CRIU
//!    cannot dump cleanly (a root that does not lead its own session, a process traced by anything
//!    but cryo's guard, e.g. a debugger).
//! 2. Record from NVML, *before* the checkpoint, which GPUs each CUDA process uses and how much
//!    device memory (the manifest's per-pid GPU UUIDs and sizes; after the checkpoint NVML lists
//!    nothing).
//! 3. Stage the image directory next to the final one ([`Staging::create`]), then suspend all
//!    CUDA processes ([`suspend`] with `resume_on_failure`: a refused freeze leaves the worker
//!    serving). The guard traces them throughout (the engine's shrink and the suspension
//!    included), standing duplicates and all: a death or an `execve` there is pinned.
//!    The suspension's last records (`Verified`, the outcomes journaled with it) are written
//!    right after GPU free, unsynced, and synced on a thread of their own from then on, beside
//!    the next steps; CRIU's gate waits for that sync before its verdict, so every suspension
//!    is on stable storage before anything can end its process (a sync that fails refuses the
//!    dump), and GPU free waits for one `fdatasync` (the lock's intent, which must be on disk
//!    before the lock) and no write of the journal after the checkpoint (see
//!    [`write_verified`] for why the write may follow the moment). A write that fails there
//!    refuses the freeze before anything is let go: the tree is resumed in place under the
//!    guard ([`FreezeError::Unrecorded`]).
//! 4. Only now, every context checkpointed and journaled so, ask the [`Watcher`] (the guard) to
//!    let go of the processes it traces (CRIU must trace them itself); the guard itself refuses to
//!    let go of a process whose context the journal does not show suspended. A death between the
//!    let-go and the dump is the safe kind (its context is checkpointed) and is journaled as such.
//! 5. CRIU dump into the staging directory. At CRIU's `post-dump` gate (every image written,
//!    the tree frozen) the manifest's list of processes is settled against what lives in the
//!    tree then, which is what CRIU dumped (`at_dump_gate`): a listed process that ended
//!    since is left out, a process forked since is added, and every zombie of the tree
//!    (listed or not) is named apart ([`Manifest::zombies`]): no process of the image, but
//!    CRIU restores it as a zombie under its pid, so the freeze waits for that pid to be free
//!    as for the others' and a thaw checks it; so are the ids of the tree's threads
//!    ([`Manifest::threads`]), each restored under its id. A listed plain process that left the tree
//!    (reparented out when its parent ended: a daemonized helper) is not in CRIU's image:
//!    left out, not waited for, and left running, no longer the worker's. A tree that forks
//!    all the time (health-check shells, tokenizer workers) freezes as CRIU saw it. A CUDA
//!    process is never left out or added unseen: one that ended or left the tree after its
//!    suspension, or a forked (or departed) one holding CUDA state or driver files, refuses
//!    the dump there (CRIU resumes the tree, resumed in place as after a failed dump),
//!    and one NVML listed that ended before its suspension refuses the freeze. Without
//!    `leave_running` CRIU kills the tree: every
//!    context was suspended and verified, so that teardown is the safe kind; each exit is
//!    confirmed through its pidfd. Whatever still lives after CRIU (a failed dump, or
//!    `leave_running`) goes back under watch while still CHECKPOINTED, and is then restored,
//!    traced before its unlock ([`Watcher::guard_before_unlock`]) and unlocked in place, journaled
//!    as *restored* (its context went through a driver restore, so it gets the restored
//!    processes' protection).
//! 5. Publish: hash every chunk (BLAKE3, all cores; what the follower hashed as CRIU wrote the
//!    pages, and of every file since CRIU's gate, is not hashed again) and fsync every file
//!    (all at once; the follower started the writeback of what it hashed), write the
//!    manifest, rename into place.
//!
//! A crash at any point leaves at the image path either nothing or a whole image (the staging
//! directory is removed by the next freeze of the same path), and the worker RUNNING (before the
//! suspension, traced), CHECKPOINTED (alive, or killed by CRIU after a complete dump): never a
//! live context torn down. A freeze that dies after the let-go ends its leases with it (over the
//! guard's socket the lease is the connection; in the agent the guard dies too, and the next one
//! re-attaches and resumes the worker under watch, `settle_in_flight`).
//!
//! One operation at a time per process ([`crate::oplock`], [`crate::Op::Freeze`]): the freeze
//! takes the lock of every process of the tree before its first look at it, and of every fork
//! before it looks at that, and holds them until it returns (the worker gone, or given back as
//! it found it). A park, a wake or a stop holding one refuses the freeze at once, nothing read,
//! suspended or dumped ([`FreezeError::InProgress`], exit 3); one meeting the freeze's lock is
//! refused the same way. (Before: a wake of a parked worker whose freeze had verified it
//! CHECKPOINTED and not yet dumped it restored and unlocked it, and the freeze then dumped a
//! live restored context, for CRIU to end.) Its undos (resuming in place) run under these locks
//! and take none; it calls nothing that takes them.
//!
//! # Limitations
//! The root must lead its own session (start workers with `setsid`); no `shell_job`. Processes
//! traced by anything but the watcher are refused rather than detached.

use std::path::{Path, PathBuf};

use std::time::{Duration, Instant};

use cryo_criu::image::{
    DeviceUse, FrozenShrink, ImageError, ImageMeta, Manifest, ProcessEntry, ProcessGpu, Staging,
};
use cryo_criu::{Criu, CriuError, DumpOpts};
use cryo_gpu::{Gpu, ProcessState};
use cryo_journal::{Event, Journal};
use cryo_proc::Pid;
use cryo_proc::{ProcError, ProcHandle};
use cryo_units::Moment;

use crate::cuda::Class;
use crate::failpoint;
use crate::progress::Progress;
use crate::runnable::Runnable;
use crate::suspend::{
    id, suspend_listed, Known, SuspendFailure, SuspendOptions, Suspended, Verified,
};
use crate::target::Resolved;
use crate::watcher::{Lease, Watcher, WatcherError};

/// Failpoint: the dump is complete in the staging directory, nothing is published yet.
pub const FREEZE_BEFORE_PUBLISH: &str = "freeze-before-publish";
/// Failpoints inside the publish: this prefix and a [`cryo_criu::image::PublishStep`]'s name
/// (`freeze-publish-synced`, `-manifest-written`, `-renamed`).
pub const FREEZE_PUBLISH_PREFIX: &str = "freeze-publish-";

/// Failpoint (pausing, [`failpoint::pause_if`]): every CUDA process is suspended and the guard
/// let go of the traced processes (their leases are held), nothing dumped.
pub const FREEZE_AFTER_LET_GO: &str = "freeze-after-let-go";

/// Failpoint (pausing): CRIU wrote the dump and waits at its gate (the tree frozen, nothing
/// killed), before cryo's checks there; the follower has been hashing CRIU's pages files since
/// the dump started.
pub const FREEZE_AT_DUMP_GATE: &str = "freeze-at-dump-gate";

/// Failpoint (an injected error): the `fdatasync` of the suspension's last records, started at
/// GPU free, fails; CRIU's gate then refuses the dump (CRIU resumes the tree, the freeze resumes
/// it in place).
pub const FREEZE_SUSPENSION_UNSYNCED: &str = "freeze-suspension-unsynced";

/// Failpoint (pausing, [`failpoint::pause_if`]; stalling until killed without a resume file):
/// the GPU-free moment is taken (every CUDA process of the tree suspended, NVML lists none of
/// them), the verification's records (each process's `Checkpointed` and `Verified`) are not
/// written yet ([`write_verified`]).
pub const FREEZE_AFTER_GPU_FREE: &str = "freeze-after-gpu-free";

/// Failpoint (an injected error): the write of the verification's records right after GPU free
/// ([`write_verified`]) fails as a journal that cannot be written does (EIO; a full disk is
/// ENOSPC), the suspensions done and verified.
pub const FREEZE_VERIFIED_UNWRITTEN: &str = "freeze-verified-unwritten";

/// Failpoint (pausing): the engine's shrink is done, no CUDA process is suspended yet.
pub const FREEZE_BEFORE_SUSPEND: &str = "freeze-before-suspend";

/// Options of a freeze.
#[derive(Debug, Clone)]
pub struct FreezeOptions {
    /// Where the image is published (a directory that must not exist unless `replace`).
    pub image: PathBuf,
    /// Keep the tree running afterwards (restored and unlocked in place).
    pub leave_running: bool,
    /// Replace an existing image at `image` (atomically).
    pub replace: bool,
    /// How to suspend. `resume_on_failure` is forced on: a refused freeze leaves the worker serving.
    pub suspend: SuspendOptions,
    /// Ask the engine to release what it can rebuild first (and to take it back when the tree
    /// runs on: left running, or the freeze failed).
    pub shrink: Option<crate::shrink::Shrink>,
}

/// What a freeze did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct FreezeReport {
    /// The published image.
    pub image: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
    /// Every CUDA process's suspension.
    pub suspended: Vec<Suspended>,
    /// Time to lock, checkpoint and verify every CUDA process, ms.
    pub suspend_ms: u64,
    /// Time CRIU took, ms.
    pub dump_ms: u64,
    /// Time to hash, fsync and publish, ms.
    pub publish_ms: u64,
    /// From the start of the freeze to every CUDA process suspended (its GPU memory free), ms.
    pub gpu_free_ms: u64,
    /// From the start of the freeze to the dump done and (unless left running) every process
    /// of the tree gone, ms.
    pub worker_gone_ms: u64,
    /// The streamed dump's moments, ms from the dump's start (absent for a dump CRIU wrote
    /// itself).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dump_phases: Option<cryo_criu::DumpPhases>,
    /// The same moments as `gpu_free_ms`, `worker_gone_ms` and the publish's end, as absolute
    /// times on the host's `CLOCK_MONOTONIC`, so a caller measures them from its own origin
    /// (absent from an older agent's report).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moments: Option<FreezeMoments>,
    /// Whether the tree is still running (`leave_running`).
    pub left_running: bool,
    /// Without `leave_running`: what still holds the tree's pids after [`crate::reaped::REAP_WAIT`]
    /// (a zombie whose parent has not reaped it...); empty when they are free, and only then is
    /// the worker gone. A restore of the image needs them free.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub pids_held: Vec<cryo_proc::PidHolder>,
    /// Processes of the tree as it was listed that ended before CRIU froze it: not in the
    /// image (none was a CUDA process: that refuses the freeze).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub ended: Vec<Pid>,
    /// Processes forked after the tree was listed that CRIU dumped with it (plain ones: one
    /// with CUDA state or driver files refuses the freeze); in the image.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub forked: Vec<Pid>,
    /// Plain processes of the tree as it was listed that left it before CRIU froze it
    /// (reparented out when their parent ended: a daemonized helper): not in the image, and
    /// left running (no longer the tree's). A CUDA process that left refuses the freeze.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub left: Vec<Pid>,
    /// Wall time of the whole freeze, ms: the image is published and durable (every file,
    /// the manifest and the directories fsync'd).
    pub elapsed_ms: u64,
    /// The engine's shrink before the suspension, if one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<crate::shrink::ShrinkReport>,
}

/// A freeze's moments on the host's `CLOCK_MONOTONIC` ([`Moment`]), each read as the step that
/// reaches it returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct FreezeMoments {
    /// The freeze started: the tree resolved, the journal open (the caller's costs before it
    /// are not in `gpu_free_ms`, but are between a caller's origin and these moments).
    pub started: Moment,
    /// Every CUDA process suspended (its device memory free).
    pub gpu_free: Moment,
    /// The dump done and, unless left running, every process of the tree exited.
    pub worker_gone: Moment,
    /// The image published and durable: every file, the manifest and the directories
    /// fsync'd, renamed into place.
    pub published: Moment,
}

/// A CUDA process that could not be suspended: nothing was dumped, the tree keeps serving.
#[derive(Debug, Clone, serde::Serialize)]
pub struct FreezeRefusal {
    /// The process.
    pub pid: Pid,
    /// Why.
    pub reason: SuspendFailure,
}

/// The freeze did not happen, or did not finish.
#[derive(Debug, thiserror::Error)]
pub enum FreezeError {
    /// The target is not a process tree.
    #[error("a freeze takes a process tree, not {0}")]
    NotATree(String),
    /// A process could not be read.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// The root does not lead its own session: CRIU cannot restore the session without the
    /// terminal side (`shell_job`), which cryo does not use.
    #[error("pid {pid} does not lead its own session (session {sid}): start the worker with `setsid` so CRIU can dump it as a whole")]
    NotSessionLeader {
        /// The root.
        pid: Pid,
        /// Its session.
        sid: Pid,
    },
    /// A process is traced by something other than the guard (a debugger...), or still traced
    /// after the guard let go of it: CRIU needs to seize it itself.
    #[error("pid {pid} is traced by pid {tracer} (a debugger?); detach it before freezing (CRIU must trace it itself)")]
    Traced {
        /// The traced process.
        pid: Pid,
        /// Its tracer.
        tracer: Pid,
    },
    /// The watcher (the guard) could not, or would not, let go of a process it traces.
    #[error("cannot get pid {pid} released by the guard that traces it: {source}")]
    Detach {
        /// The traced process.
        pid: Pid,
        /// The watcher's error.
        source: WatcherError,
    },
    /// Whether a process holds a CUDA context could not be decided.
    #[error("freeze refused: cannot tell whether it holds a CUDA context: {0}")]
    Unclassified(#[from] crate::cuda::Unsure),
    /// A process opened the driver but holds no CUDA state the driver can checkpoint (a process
    /// that only ran `cuInit`): CRIU cannot dump its driver files.
    #[error("freeze refused: pid {pid} holds {fds} driver files without CUDA state the driver can checkpoint (a process that only initialised CUDA?); CRIU cannot dump them")]
    DriverFilesWithoutState {
        /// The process.
        pid: Pid,
        /// How many driver files.
        fds: usize,
    },
    /// A process cannot run (stopped by job control or under a debugger): the driver's restore
    /// thread inside it cannot run the checkpoint.
    #[error("freeze refused: {0}")]
    NotRunnable(String),
    /// NVML could not be asked.
    #[error("cannot inspect the GPUs: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// Some CUDA process could not be suspended; the tree keeps running, nothing was dumped.
    #[error("freeze refused: {}", describe_refusals(.0))]
    Refused(Vec<FreezeRefusal>),
    /// The staging directory or the publication failed.
    #[error("image: {0}")]
    Image(#[from] ImageError),
    /// CRIU failed. The processes are left CHECKPOINTED (alive) when the dump did not kill them.
    #[error("{0}")]
    Criu(#[from] CriuError),
    /// A process shares CUDA memory with others (CUDA IPC, NCCL peer-to-peer): the driver this
    /// project runs on (r580) cannot checkpoint that (multi-process jobs need r590, IPC memory
    /// r610), so the image could never be restored.
    #[error("freeze refused: pid {pid} shares GPU memory with other processes ({}): the CUDA driver's checkpoint cannot restore CUDA IPC or NCCL peer-to-peer before r590/r610, so the image could never be restored", evidence.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
    CrossProcessCuda {
        /// The process.
        pid: Pid,
        /// What betrays it.
        evidence: Vec<crate::ipc::Evidence>,
    },
    /// A CUDA process of the tree (NVML listed its device memory) ended during the freeze,
    /// before its suspension: nothing was suspended or dumped.
    #[error("freeze refused: pid {pid}, a CUDA process of the tree (NVML listed its device memory), ended during the freeze; nothing was suspended")]
    CudaProcessEnded {
        /// The process.
        pid: Pid,
    },
    /// The tree kept forking CUDA processes while they were suspended: after every look, one
    /// more turned up (or one still opening the driver). Every process was resumed in place,
    /// nothing dumped.
    #[error("freeze refused: the tree kept forking CUDA processes during the freeze (pids {}, still new after {rounds} looks); every process was resumed in place, nothing dumped", crate::thaw::fmt_pids(pids))]
    KeepsForking {
        /// The processes the last look found.
        pids: Vec<Pid>,
        /// The looks made.
        rounds: usize,
    },
    /// A process CRIU should have killed is still alive after the dump.
    #[error("pid {0} is still alive after the dump; it stays CHECKPOINTED (safe to `cryo stop`)")]
    NotExited(Pid),
    /// With `leave_running`, restoring a process in place failed: it stays CHECKPOINTED.
    #[error("the image is published, but pid {pid} could not be brought back in place ({error}); it stays CHECKPOINTED (safe to `cryo stop`)")]
    Resume {
        /// The process.
        pid: Pid,
        /// Why.
        error: crate::restore::RestoreError,
    },
    /// Every CUDA process was suspended and verified, but what the verification found (each
    /// process's `Checkpointed` and `Verified`, which the guard's let-go and every later
    /// reader stand on) could not be journaled: nothing was let go or dumped; the processes
    /// were restored and unlocked in place (the worker serves again), those that could not be
    /// are named in `left` (left suspended, never torn down).
    #[error("the suspension was verified but its verification could not be journaled ({source}), so nothing was let go or dumped; {}", crate::restore::fmt_left(.left))]
    Unrecorded {
        /// The journal's error.
        source: cryo_journal::AppendError,
        /// Processes not brought back, and why.
        left: Vec<(Pid, String)>,
    },
    /// The journal could not be written before acting.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// A park, a wake, a stop or another freeze is at work on a process of the tree: it holds
    /// the process's lock ([`crate::oplock`]). Nothing was read, suspended or dumped by this
    /// freeze.
    #[error("pid {pid} is being {} by {}: left to it; nothing was frozen", crate::park::fmt_doing(*.doing), crate::park::fmt_by(*.by))]
    InProgress {
        /// The process.
        pid: Pid,
        /// The cryo process at work on it, when known.
        by: Option<Pid>,
        /// What that one does, when known.
        doing: Option<crate::Op>,
    },
    /// A process's lock could not be taken (its file could not be created, opened or locked);
    /// nothing was suspended or dumped.
    #[error("cannot take the freeze's lock: {0}")]
    Lock(String),
}

impl FreezeError {
    /// A freeze's lock that could not be taken.
    fn from_lock(e: crate::oplock::LockError) -> Self {
        match e {
            crate::oplock::LockError::Held { pid, by, doing } => {
                FreezeError::InProgress { pid, by, doing }
            }
            e => FreezeError::Lock(e.to_string()),
        }
    }
}

fn describe_refusals(r: &[FreezeRefusal]) -> String {
    r.iter()
        .map(|r| format!("pid {}: {}", r.pid, r.reason.reason()))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Freezes `tree` (a resolved [`crate::Target::Tree`]) into `opts.image`; `watcher` (the guard, if
/// any) lets go of the processes it traces for the dump and gets back the ones still alive after.
/// See the module docs.
pub fn freeze(
    gpu: &Gpu,
    criu: &dyn Criu,
    tree: &Resolved,
    opts: &FreezeOptions,
    journal: &Journal,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<FreezeReport, FreezeError> {
    let root = tree
        .root()
        .ok_or_else(|| FreezeError::NotATree(tree.target().to_string()))?
        .pid();
    let handles = tree.handles();
    // One operation at a time per process, held from before the first look at the tree until
    // the freeze returns (the worker gone, or given back as found): a park, a wake or a stop at
    // work refuses this freeze before it reads or suspends anything; a wake meeting this freeze
    // is refused the same way, so nothing it verified CHECKPOINTED is restored under it before
    // CRIU ends it. Its undos (resuming in place) run under these locks and take none.
    let state = crate::oplock::state_of(journal);
    let locks = std::cell::RefCell::new(
        crate::oplock::take(&state, handles, crate::Op::Freeze).map_err(FreezeError::from_lock)?,
    );
    let gpu = &gpu.bounded(cryo_gpu::Limits::default());
    // Before anything is asked of the engine or the guard: a tree that can never be restored
    // is refused as it is.
    refuse_cross_process_cuda(handles)?;
    // Refused before the engine is asked anything.
    check_dumpable(root, handles)?;
    // The guard keeps tracing the tree through the shrink and the suspension.
    let mut shrunk = crate::shrink::release(
        gpu,
        opts.shrink.as_ref(),
        &tree.target().to_string(),
        handles,
        opts.shrink.as_ref().map_or(Duration::ZERO, |s| s.timeout()),
        journal,
        progress,
    )?;
    // The image records a shrink that may have released memory, so a thaw grows it again.
    let frozen_shrink = shrunk.as_ref().and_then(crate::shrink::Shrunk::frozen);
    failpoint::pause_if(FREEZE_BEFORE_SUSPEND);
    let cx = Ctx {
        gpu,
        criu,
        root,
        handles,
        opts,
        shrunk: frozen_shrink,
        journal,
        watcher,
        progress,
        state: &state,
        locks: &locks,
    };
    let mut result = freeze_tree(&cx);
    if let Some(s) = shrunk.as_mut() {
        // The tree runs on (left running, or the freeze left it as it found it): its engine
        // takes its memory back. A tree that is gone has no engine to ask.
        let runs_on = (result.is_err() || opts.leave_running)
            && handles.first().is_some_and(ProcHandle::is_alive);
        if runs_on {
            if let Err(e) = s.grow(journal, progress) {
                tracing::error!(error = %e, "cannot journal the engine's grow");
            }
        }
        if let Ok(r) = result.as_mut() {
            r.shrink = Some(s.report.clone());
        }
    }
    result
}

/// Refuses a tree one of whose processes shares GPU memory with others.
pub(crate) fn refuse_cross_process_cuda(handles: &[ProcHandle]) -> Result<(), FreezeError> {
    let root = handles.first().map(ProcHandle::pid);
    for h in handles {
        let evidence = match crate::ipc::cross_process_cuda(h) {
            Ok(e) => e,
            Err(e) if Some(h.pid()) != root && ended(h, &e) => continue,
            Err(e) => return Err(e.into()),
        };
        if !evidence.is_empty() {
            return Err(FreezeError::CrossProcessCuda {
                pid: h.pid(),
                evidence,
            });
        }
    }
    Ok(())
}

/// Asks `watcher` to let go of every process of `handles` that is traced (every CUDA one is
/// suspended, and the journal says so: the guard checks); its leases.
fn let_go_traced<'w>(
    watcher: &'w dyn Watcher,
    handles: &[ProcHandle],
) -> Result<Vec<Lease<'w>>, FreezeError> {
    let mut leases = Vec::new();
    for h in handles {
        if !matches!(h.tracer(), Ok(Some(_))) {
            continue;
        }
        match watcher.let_go(id(h)) {
            Ok(Some(lease)) => leases.push(lease),
            Ok(None) => {}
            // The leases taken so far end on the way out: those processes are traced again.
            Err(source) => {
                return Err(FreezeError::Detach {
                    pid: h.pid(),
                    source,
                })
            }
        }
    }
    Ok(leases)
}

/// What every step of one freeze works with, the same from the listing to the publish.
struct Ctx<'a> {
    gpu: &'a Gpu,
    criu: &'a dyn Criu,
    /// The tree's root (`handles[0]`).
    root: Pid,
    /// The tree as resolved, the root first.
    handles: &'a [ProcHandle],
    opts: &'a FreezeOptions,
    /// The engine's shrink the image records, if it may have released memory.
    shrunk: Option<FrozenShrink>,
    journal: &'a Journal,
    watcher: &'a dyn Watcher,
    progress: &'a dyn Progress,
    /// The state directory of the freeze's locks.
    state: &'a cryo_state::StateDir,
    /// The freeze's locks: the tree's, and its forks' as they are found.
    locks: &'a std::cell::RefCell<crate::oplock::OpLocks>,
}

fn freeze_tree(cx: &Ctx<'_>) -> Result<FreezeReport, FreezeError> {
    let Ctx { gpu, handles, .. } = *cx;
    let start = Instant::now();
    // The GPUs and the driver's version are for the manifest only: asked beside the listing and
    // the classification, not one round trip to the driver after the other before the first
    // lock, and both on one carrier of the deadline layer (one hand-over, no thread of the
    // freeze's own: on a loaded host each is a wake-up that waits for a core). The version
    // only counts (its error included) when there is a CUDA process.
    let about = gpu.ask(ABOUT, |i| (i.gpus(), i.driver_version()));
    // What NVML lists before the checkpoint is all the manifest will ever know about device
    // use.
    let classified = gpu
        .inspect
        .processes()
        .map_err(FreezeError::from)
        .and_then(|listed| classify_tree(gpu, handles, listed));
    let (gpus, driver_version) = about.wait().unwrap_or_else(|e| (Err(again(&e)), Err(e)));
    let (listed, cuda, states) = classified?;
    let gpus = gpus?;
    let driver_version = if cuda.is_empty() {
        None
    } else {
        Some(driver_version?)
    };
    let found = Found {
        listed,
        cuda,
        states,
        gpus,
        driver_version,
    };
    freeze_listed(cx, start, found)
}

/// The questions a freeze asks beside its classification ([`Gpu::ask`]).
const ABOUT: &str = "GPUs and driver version";

/// The same error again, for the other of two questions asked together that did not answer
/// ([`cryo_gpu::deadline::Asked::wait`] fails only that way).
fn again(e: &cryo_gpu::InspectError) -> cryo_gpu::InspectError {
    let after = match e {
        cryo_gpu::InspectError::NoAnswer { after, .. } => *after,
        _ => Duration::ZERO,
    };
    cryo_gpu::InspectError::NoAnswer { what: ABOUT, after }
}

/// Classified processes: NVML's listing, the CUDA processes and the state the driver answered
/// for each of them.
type Classified<'h> = (
    Vec<cryo_gpu::GpuProcess>,
    Vec<&'h ProcHandle>,
    Vec<ProcessState>,
);

/// Classifies every process of `handles`: refuses one that cannot run or holds driver files
/// without CUDA state.
fn classify_tree<'h>(
    gpu: &Gpu,
    handles: &'h [ProcHandle],
    listed: Vec<cryo_gpu::GpuProcess>,
) -> Result<Classified<'h>, FreezeError> {
    let mut cuda: Vec<&ProcHandle> = Vec::new();
    let root = handles.first().map(ProcHandle::pid);
    let mut states = Vec::new();
    for h in handles {
        // A member that ended since the tree was listed (the root must stay) is not part of
        // it, unless NVML listed it: a CUDA process is never left out unseen. What the image
        // lists is settled at CRIU's gate (`at_dump_gate`).
        if Some(h.pid()) != root && !h.is_alive() {
            if listed.iter().any(|p| p.pid == h.pid()) {
                return Err(FreezeError::CudaProcessEnded { pid: h.pid() });
            }
            tracing::debug!(
                pid = h.pid(),
                "ended since the tree was listed: not part of it"
            );
            continue;
        }
        match crate::runnable::runnable(h)? {
            Runnable::Runs | Runnable::Exited => {}
            r => {
                return Err(FreezeError::NotRunnable(
                    r.why_not(h.pid()).unwrap_or_default(),
                ))
            }
        }
        match crate::cuda::classify(gpu, h, &listed, crate::cuda::SETTLE)? {
            Class::Cuda { state } => {
                cuda.push(h);
                states.push(state);
            }
            Class::Plain | Class::Exited => {}
            Class::DriverOnly { fds } => {
                return Err(FreezeError::DriverFilesWithoutState {
                    pid: h.pid(),
                    fds: fds.len(),
                })
            }
        }
    }
    Ok((listed, cuda, states))
}

/// What the freeze learnt before it acts.
struct Found<'h> {
    /// NVML's process list.
    listed: Vec<cryo_gpu::GpuProcess>,
    /// The CUDA processes.
    cuda: Vec<&'h ProcHandle>,
    /// The state the driver answered for each of them.
    states: Vec<ProcessState>,
    /// The GPUs.
    gpus: Vec<cryo_gpu::GpuInfo>,
    /// The driver's version (with a CUDA process).
    driver_version: Option<String>,
}

fn freeze_listed(
    cx: &Ctx<'_>,
    start: Instant,
    found: Found<'_>,
) -> Result<FreezeReport, FreezeError> {
    let Ctx {
        root,
        handles,
        opts,
        journal,
        ..
    } = *cx;
    let Found {
        listed,
        cuda,
        states,
        gpus,
        driver_version,
    } = found;
    let image = opts.image.display().to_string();
    let mut entries = Vec::with_capacity(handles.len());
    for h in handles {
        let is_cuda = cuda.iter().any(|c| c.pid() == h.pid());
        // A member that ended since it was classified is not part of the tree either; a CUDA
        // one is never left out unseen.
        if h.pid() != root && !h.is_alive() {
            if is_cuda {
                return Err(FreezeError::CudaProcessEnded { pid: h.pid() });
            }
            continue;
        }
        let mut e = match ProcessEntry::of(h) {
            Ok(e) => e,
            Err(e) if h.pid() != root && ended(h, &e) => {
                if is_cuda {
                    return Err(FreezeError::CudaProcessEnded { pid: h.pid() });
                }
                continue;
            }
            Err(e) => return Err(e.into()),
        };
        if cuda.iter().any(|c| c.pid() == h.pid()) {
            e.gpu = Some(suspended_gpu(h.pid(), &listed));
        }
        entries.push(e);
    }
    let used: Vec<_> = entries
        .iter()
        .filter_map(|e| e.gpu.as_ref())
        .flat_map(|g| g.devices.iter().map(|d| d.uuid.clone()))
        .collect();
    let gpu_model = gpus
        .iter()
        .find(|g| used.contains(&g.uuid))
        .map(|g| g.name.clone());

    // Written, not synced: no recovery reads it (the suspension's first intent, synced before
    // the first lock, carries it to disk; a power cut before that loses a freeze that had done
    // nothing yet). A journal that cannot take it still refuses the freeze before it acts.
    journal.append_unsynced(vec![Event::FreezeStarted {
        image: image.clone(),
    }])?;
    let result = freeze_inner(
        cx,
        &cuda,
        Known {
            listed: &listed,
            states: &states,
            // Written after GPU free (`write_verified`), synced beside the dump, waited for at
            // CRIU's gate (`VerifiedSync`).
            verified: Verified::ByCaller,
        },
        entries,
        gpu_model,
        driver_version,
        start,
    );
    match &result {
        Ok(r) => {
            journal.append(Event::ImagePublished {
                image,
                bytes: r.manifest.total_bytes,
            })?;
        }
        Err(e) => {
            if let Err(j) = journal.append(Event::FreezeFailed {
                image,
                error: e.to_string(),
            }) {
                tracing::error!(error = %j, "cannot journal the failed freeze");
            }
        }
    }
    result
}

fn freeze_inner(
    cx: &Ctx<'_>,
    cuda: &[&ProcHandle],
    known: Known<'_>,
    mut entries: Vec<ProcessEntry>,
    gpu_model: Option<String>,
    driver_version: Option<String>,
    start: Instant,
) -> Result<FreezeReport, FreezeError> {
    let Ctx {
        gpu,
        criu,
        root,
        handles,
        opts,
        journal,
        watcher,
        progress,
        ..
    } = *cx;
    let staging = Staging::create(&opts.image)?;

    let t = Instant::now();
    let mut sopts = opts.suspend.clone();
    sopts.resume_on_failure = true;
    sopts.purpose = cryo_journal::Purpose::Freeze;
    let mut suspended = Vec::new();
    let mut refusals = Vec::new();
    // The verification's records, written after GPU free (`write_verified`).
    let mut unwritten = Vec::new();
    if !cuda.is_empty() {
        let s = suspend_listed(
            gpu,
            cuda,
            Some(known),
            &sopts,
            Some(journal),
            progress,
            watcher,
        );
        unwritten = s.unwritten;
        for o in s.outcomes {
            match o.result {
                Ok(s) => suspended.push(s),
                Err(reason) => refusals.push(FreezeRefusal { pid: o.pid, reason }),
            }
        }
    }
    if !refusals.is_empty() {
        return Err(FreezeError::Refused(refusals));
    }
    // What the tree forked meanwhile: its CUDA processes suspended too, from here on part of
    // the tree as listed.
    let mut forks = Forks::default();
    if let Err(mut e) = suspend_forks(cx, &sopts, &mut forks, &mut unwritten) {
        // What was verified is journaled before the undo (a second try when its first write
        // failed: the undo's records follow it either way).
        if let Err(j) = write_verified(journal, &mut unwritten) {
            tracing::error!(error = %j, "cannot journal the suspension's verification");
        }
        let alive: Vec<&ProcHandle> = cuda
            .iter()
            .copied()
            .chain(&forks.cuda)
            .filter(|h| h.is_alive())
            .collect();
        let not_back = resume_all(
            gpu,
            &alive,
            journal,
            watcher,
            "resumed in place: the tree's forks could not be suspended",
        );
        if let FreezeError::Unrecorded { left, .. } = &mut e {
            *left = not_back.iter().map(|(p, e)| (*p, e.to_string())).collect();
        }
        return Err(e);
    }
    let forked_cuda: Vec<Pid> = forks.cuda.iter().map(ProcHandle::pid).collect();
    let all: Vec<ProcHandle> = handles
        .iter()
        .filter_map(|h| h.try_clone().ok())
        .chain(forks.cuda)
        .collect();
    let handles: &[ProcHandle] = &all;
    let cuda: Vec<&ProcHandle> = handles
        .iter()
        .filter(|h| cuda.iter().any(|c| c.pid() == h.pid()) || forked_cuda.contains(&h.pid()))
        .collect();
    let cuda: &[&ProcHandle] = &cuda;
    entries.extend(forks.entries);
    suspended.extend(forks.suspended);
    let gpu_free_at = Moment::now();
    let suspend_ms = ms(t.elapsed());
    let gpu_free_ms = ms(start.elapsed());
    failpoint::pause_if(FREEZE_AFTER_GPU_FREE);
    if let Err(source) = write_verified(journal, &mut unwritten) {
        // Nothing was let go yet: the guard still traces the tree. Its suspension is not on
        // record, so nothing may end it: undone in place, under the guard, and said.
        let alive: Vec<&ProcHandle> = cuda.iter().copied().filter(|h| h.is_alive()).collect();
        let left = resume_all(
            gpu,
            &alive,
            journal,
            watcher,
            "resumed in place: its suspension's verification could not be journaled",
        );
        return Err(FreezeError::Unrecorded {
            source,
            left: left.iter().map(|(p, e)| (*p, e.to_string())).collect(),
        });
    }
    // The verification's records are written, not synced (`Verified::ByCaller`): synced now on
    // a thread of their own, beside the let-go and CRIU's start, and waited for at CRIU's gate,
    // before its verdict lets CRIU end the tree. Every suspension is on stable storage before
    // its process can end, and GPU free waits for one `fdatasync` (the lock's intent), not two.
    let verified_synced = VerifiedSync::start(journal);

    // Every context is checkpointed (journaled): only now does the guard let go, for CRIU.
    let leases = match let_go_traced(watcher, handles).and_then(|leases| {
        failpoint::pause_if(FREEZE_AFTER_LET_GO);
        // Nothing may trace the tree now (the guard let go; a debugger would make CRIU fail).
        check_untraced(handles).map(|()| leases)
    }) {
        Ok(leases) => leases,
        Err(e) => {
            // The leases taken so far ended on the way out: those processes are traced again.
            after_let_go(
                gpu,
                handles,
                cuda,
                journal,
                watcher,
                "resumed in place: the guard could not let go of the tree",
            );
            return Err(e);
        }
    };

    let t = Instant::now();
    let dump_opts = DumpOpts {
        leave_running: opts.leave_running,
        ..DumpOpts::default()
    };
    // After the checkpoint, device memory is part of each process's resident memory.
    let expected: u64 = handles.iter().filter_map(|h| h.rss().ok()).sum();
    // CRIU writes the dump; cryo's follower hashes the pages as CRIU writes them, and from
    // CRIU's gate on, while it ends the tree, every file, starting their writeback (publish's
    // fsync then waits for the rest only). At the gate the tree is frozen: what lives in it
    // then is what CRIU dumped, and what the manifest lists.
    let seen = std::sync::OnceLock::new();
    // What the dump pins to one CPU, journaled before it pins it (given back by whoever finds
    // this freeze dead, `cpus`).
    let journaled = handles
        .first()
        .map(|r| crate::cpus::Journaled::new(journal, r));
    let pins: &dyn cryo_criu::PinRecord = match &journaled {
        Some(j) => j,
        None => &cryo_criu::Unrecorded,
    };
    let at_gate = || {
        failpoint::pause_if(FREEZE_AT_DUMP_GATE);
        verified_synced.wait()?;
        let s = at_dump_gate(gpu, handles, cuda)?;
        let _ = seen.set(s);
        Ok(())
    };
    let dumped = with_dir_progress(progress, root, "dump", expected, staging.path(), || {
        criu.dump_staged_recorded(root, &staging, &dump_opts, &at_gate, pins)
    });
    let dumped_bytes = cryo_criu::image::dir_bytes(staging.path());
    let detail = format!(
        "{} ms, {}",
        t.elapsed().as_millis(),
        cryo_units::fmt_bytes(dumped_bytes)
    );
    progress.end(root, "dump", dumped.is_ok(), &detail);
    if let Err(e) = dumped {
        // CRIU kills the tree only after a complete dump: on failure it is alive and suspended
        // (what died meanwhile died checkpointed). Back under watch, then resumed, so the freeze
        // leaves it as it found it.
        drop(leases);
        after_let_go(
            gpu,
            handles,
            cuda,
            journal,
            watcher,
            "resumed in place after a failed dump",
        );
        return Err(keep_log(e, &opts.image).into());
    }
    // Both CRIUs reach the gate before a dump succeeds; a seam without one changed nothing.
    let seen = seen.into_inner().unwrap_or_default();
    // Those that ended before the classification were left out then.
    let ended: Vec<Pid> = handles
        .iter()
        .map(ProcHandle::pid)
        .filter(|p| seen.ended.contains(p) || !entries.iter().any(|e| e.pid == *p))
        .collect();
    entries.retain(|e| !seen.ended.contains(&e.pid) && !seen.left.contains(&e.pid));
    entries.extend(seen.forked.iter().map(|(_, e)| e.clone()));
    if opts.leave_running {
        // CRIU let go of the tree: back under watch while still CHECKPOINTED.
        drop(leases);
    } else {
        // What left the tree is not CRIU's to kill: it runs on.
        let dumped = handles.iter().filter(|h| !seen.left.contains(&h.pid()));
        for h in dumped.chain(seen.forked.iter().map(|(h, _)| h)) {
            if !h.wait_exit(Duration::from_secs(10)) {
                // Still CHECKPOINTED (safe): back under watch.
                drop(leases);
                return Err(FreezeError::NotExited(h.pid()));
            }
            reap_if_ours(h.pid());
        }
        // A zombie of the tree is reparented when its parent is killed: to us, if we are the
        // nearest subreaper.
        for z in &seen.zombies {
            reap_if_ours(*z);
        }
        // Gone: nothing for the guard to take back.
        drop(leases);
    }
    let worker_gone_at = Moment::now();
    let dump_ms = ms(t.elapsed());
    let worker_gone_ms = ms(start.elapsed());
    let dump_start = t;
    let dump_clock = staging.capture_clock();

    failpoint::stall_if(FREEZE_BEFORE_PUBLISH);

    let t = Instant::now();
    let meta = ImageMeta {
        root_pid: root,
        processes: entries,
        zombies: seen.zombies.clone(),
        threads: seen.threads.clone(),
        gpu_model,
        driver_version,
        criu_version: criu.version(),
        shrunk: cx.shrunk.clone(),
    };
    progress.begin(root, "publish", 0);
    let published = staging.publish_with(meta, opts.replace, &|step| {
        failpoint::stall_if(&format!("{FREEZE_PUBLISH_PREFIX}{}", step.name()));
    });
    let published_at = Moment::now();
    progress.end(root, "publish", published.is_ok(), "");
    let publish_ms = ms(t.elapsed());
    // A record for the timeline and metrics only (no recovery reads it): written, not synced
    // (the next synced append, `ImagePublished` or `FreezeFailed`, carries it to disk: one
    // `fdatasync` for both), after publish. The dump is done (and the tree gone unless left
    // running), so failing the freeze over it would lose the image.
    if let Err(e) = journal.append_unsynced(vec![Event::Dumped {
        image: image_name(opts),
        ms: dump_ms,
        bytes: dumped_bytes,
    }]) {
        tracing::error!(error = %e, "cannot journal the dump");
    }
    let dump_phases = dump_clock.map(|c| cryo_criu::DumpPhases::of(&c, dump_start));
    let manifest = match published {
        Ok(m) => m,
        Err(e) => {
            if opts.leave_running {
                resume_in_place(
                    gpu,
                    cuda,
                    journal,
                    watcher,
                    "resumed in place after a failed publish",
                );
            }
            return Err(e.into());
        }
    };

    if opts.leave_running {
        if let Some((pid, error)) = resume_in_place(gpu, cuda, journal, watcher, &image_name(opts))
        {
            return Err(FreezeError::Resume { pid, error });
        }
    }
    // Gone means its pids are free: a parent that has not reaped it yet keeps them taken.
    let pids_held = if opts.leave_running {
        Vec::new()
    } else {
        // Its zombies' too: CRIU restores them under their pids.
        let pids = manifest.restore_pids();
        crate::reaped::wait_reaped(|| criu.pids_in_use(&pids), crate::reaped::REAP_WAIT)
    };
    Ok(FreezeReport {
        image: opts.image.clone(),
        manifest,
        suspended,
        suspend_ms,
        dump_ms,
        publish_ms,
        gpu_free_ms,
        worker_gone_ms,
        dump_phases,
        moments: Some(FreezeMoments {
            started: Moment::of(start),
            gpu_free: gpu_free_at,
            worker_gone: worker_gone_at,
            published: published_at,
        }),
        left_running: opts.leave_running,
        pids_held,
        ended,
        forked: seen.forked.iter().map(|(h, _)| h.pid()).collect(),
        left: seen.left,
        elapsed_ms: ms(start.elapsed()),
        shrink: None,
    })
}

/// A CUDA process's part of the manifest once it is suspended: the device memory NVML listed
/// for it (`listed`, before its checkpoint).
fn suspended_gpu(pid: Pid, listed: &[cryo_gpu::GpuProcess]) -> ProcessGpu {
    ProcessGpu {
        state: ProcessState::Checkpointed,
        devices: listed
            .iter()
            .filter(|p| p.pid == pid)
            .map(|p| DeviceUse {
                uuid: p.gpu_uuid.clone(),
                memory_bytes: p.used_memory,
            })
            .collect(),
    }
}

/// How long the walk after the suspension waits before it looks again at a fork that is
/// still opening the driver (driver files, no context yet).
const OPENING_PAUSE: Duration = Duration::from_millis(50);

/// What the tree forked while its CUDA processes were suspended, and what became of it.
#[derive(Default)]
struct Forks {
    /// The CUDA processes among them, suspended as the listed ones were.
    cuda: Vec<ProcHandle>,
    /// Their manifest entries.
    entries: Vec<ProcessEntry>,
    /// Their suspensions.
    suspended: Vec<Suspended>,
}

/// The tree walked again once its CUDA processes are suspended (a suspension takes a while, and
/// a worker forks: tokenizer workers, one more rank): every CUDA process it forked meanwhile
/// is classified and suspended as the listed ones were, and the tree walked again, until a
/// walk finds no new CUDA process (bounded, [`crate::forks::ROUNDS`]). Plain forks are left to
/// CRIU's gate (`at_dump_gate` adds what CRIU dumped of them to the image). Without this, one
/// forked between the listing and CRIU's seize made CRIU fail on its live context; a fork
/// after the last walk still does (or refuses the dump at the gate), the tree resumed.
/// `Err`: the new ones could not be suspended (their suspension rolled back) or the tree did
/// not settle; the caller resumes what was suspended before.
fn suspend_forks(
    cx: &Ctx<'_>,
    opts: &SuspendOptions,
    forks: &mut Forks,
    unwritten: &mut Vec<Event>,
) -> Result<(), FreezeError> {
    let Ctx {
        gpu,
        handles,
        journal,
        watcher,
        progress,
        state,
        locks,
        ..
    } = *cx;
    // Every process found so far (its descendants are looked at again).
    let mut found: Vec<ProcHandle> = Vec::new();
    for round in 0..=crate::forks::ROUNDS {
        let held: Vec<&ProcHandle> = handles.iter().chain(&found).collect();
        // What CRIU dumps: the root's tree.
        let root: Vec<&ProcHandle> = handles.first().into_iter().collect();
        let new = crate::forks::forked_below(&root, &held, &[]);
        if new.is_empty() {
            return Ok(());
        }
        // A fork is locked as the tree was, before it is looked at: once (one still opening
        // the driver is found again by the next look, its lock already this freeze's).
        let unlocked: Vec<ProcHandle> = new
            .iter()
            .filter(|h| !locks.borrow().holds(&id(h)))
            .filter_map(|h| h.try_clone().ok())
            .collect();
        let more = crate::oplock::take(state, &unlocked, crate::Op::Freeze)
            .map_err(FreezeError::from_lock)?;
        locks.borrow_mut().extend(more);
        let listed = gpu.inspect.processes()?;
        let (mut batch, mut states, mut opening) = (Vec::new(), Vec::new(), Vec::new());
        for h in new {
            match crate::runnable::runnable(&h)? {
                Runnable::Runs | Runnable::Exited => {}
                r => {
                    return Err(FreezeError::NotRunnable(
                        r.why_not(h.pid()).unwrap_or_default(),
                    ))
                }
            }
            match crate::cuda::classify(gpu, &h, &listed, crate::cuda::SETTLE)? {
                Class::Cuda { state } => {
                    states.push(state);
                    batch.push(h);
                }
                Class::Plain | Class::Exited => found.push(h),
                // Opening the driver (a CUDA process to be): looked at again.
                Class::DriverOnly { .. } => opening.push(h.pid()),
            }
        }
        if batch.is_empty() && opening.is_empty() {
            return Ok(());
        }
        if round == crate::forks::ROUNDS {
            return Err(FreezeError::KeepsForking {
                pids: batch.iter().map(ProcHandle::pid).chain(opening).collect(),
                rounds: round + 1,
            });
        }
        if batch.is_empty() {
            // Only processes opening the driver: give them a moment before the next look.
            std::thread::sleep(OPENING_PAUSE);
            continue;
        }
        refuse_cross_process_cuda(&batch)?;
        for h in &batch {
            tracing::info!(
                pid = h.pid(),
                "forked by the tree during the freeze: suspended too"
            );
            let mut e = ProcessEntry::of(h)?;
            e.gpu = Some(suspended_gpu(h.pid(), &listed));
            forks.entries.push(e);
        }
        let refs: Vec<&ProcHandle> = batch.iter().collect();
        let known = Known {
            listed: &listed,
            states: &states,
            // Written with the first suspension's after GPU free, synced from then on
            // (`VerifiedSync`).
            verified: Verified::ByCaller,
        };
        // What the suspensions so far verified goes first: nothing is journaled before it.
        write_verified(journal, unwritten).map_err(|source| FreezeError::Unrecorded {
            source,
            // Named by the caller's undo.
            left: Vec::new(),
        })?;
        let mut refusals = Vec::new();
        let s = suspend_listed(
            gpu,
            &refs,
            Some(known),
            opts,
            Some(journal),
            progress,
            watcher,
        );
        unwritten.extend(s.unwritten);
        for o in s.outcomes {
            match o.result {
                Ok(s) => forks.suspended.push(s),
                Err(reason) => refusals.push(FreezeRefusal { pid: o.pid, reason }),
            }
        }
        if !refusals.is_empty() {
            return Err(FreezeError::Refused(refusals));
        }
        found.extend(batch.iter().filter_map(|h| h.try_clone().ok()));
        forks.cuda.extend(batch);
    }
    Ok(())
}

/// Writes the records the suspensions handed back unwritten ([`Verified::ByCaller`]: each
/// process's `Checkpointed` and `Verified`), unsynced: right after the GPU-free moment, before
/// anything else is journaled or done (the guard's let-go reads them; [`VerifiedSync`] then
/// syncs them before CRIU's gate lets the tree end).
///
/// Why the write may follow the moment: the moment is a reading of the clock once NVML no longer
/// lists any process of the tree (what "free" means, `gpu-facts.md`) and the walk found no
/// CUDA process it had not suspended; the write records what was found, it does not act. A
/// cryo that dies between the two (killed, crashed) leaves each process's `LockStarted`
/// synced and its `CheckpointStarted` written, no outcome after it, and the process alive and
/// CHECKPOINTED: nothing can have ended it, since CRIU's verdict waits for the sync that
/// follows this write. That is what a death during the verification's NVML query left before
/// (those records were written after the query): the next `cryo stop`, guard or agent start
/// (`settle_in_flight`) finds the suspension's last step not final and its owner gone, asks
/// the driver (CHECKPOINTED, purpose freeze) and restores and unlocks it in place under watch.
/// A power cut could always lose these records (they were never synced before the moment).
///
/// A write that fails (a full disk, EIO; torn or not: the next append cuts a torn frame) fails
/// the freeze before anything is let go or dumped ([`FreezeError::Unrecorded`]): the guard's
/// let-go would otherwise stand on its liveness look alone, and CRIU would end processes whose
/// suspension no record shows. The caller resumes the tree in place, under the guard, journaled
/// as restored; a process the journal also refuses that for stays CHECKPOINTED and traced, its
/// suspension in flight at `CheckpointStarted` (the next guard or agent start resumes it, the
/// next stop names it), and the error names it.
fn write_verified(
    journal: &Journal,
    unwritten: &mut Vec<Event>,
) -> Result<(), cryo_journal::AppendError> {
    let events = std::mem::take(unwritten);
    if events.is_empty() {
        return Ok(());
    }
    let written = if failpoint::active(FREEZE_VERIFIED_UNWRITTEN) {
        Err(failpoint::journal_eio(journal, FREEZE_VERIFIED_UNWRITTEN))
    } else {
        journal.append_unsynced(events).map(drop)
    };
    if let Err(e) = &written {
        tracing::error!(error = %e, "cannot journal the suspension's verification");
    }
    written
}

/// The `fdatasync` of the suspension's last records, started at GPU free on a thread of its own
/// and waited for at CRIU's gate (before anything can end the tree).
struct VerifiedSync(std::sync::Mutex<Option<std::thread::JoinHandle<Result<(), String>>>>);

impl VerifiedSync {
    fn start(journal: &Journal) -> VerifiedSync {
        let sync = |syncer: cryo_journal::Syncer| {
            if failpoint::active(FREEZE_SUSPENSION_UNSYNCED) {
                return Err(format!(
                    "failpoint {FREEZE_SUSPENSION_UNSYNCED}: the sync fails on purpose"
                ));
            }
            syncer.sync().map_err(|e| e.to_string())
        };
        let handle = journal
            .syncer()
            .map_err(|e| e.to_string())
            .and_then(|syncer| {
                std::thread::Builder::new()
                    .name("cryo-journal-sync".into())
                    .spawn(move || sync(syncer))
                    .map_err(|e| format!("cannot start the journal's sync: {e}"))
            });
        let handle = handle.unwrap_or_else(|e| {
            // Without a thread of its own the sync is the gate's to find failed: nothing can end
            // the tree before its suspension is on disk.
            std::thread::spawn(move || Err(e))
        });
        VerifiedSync(std::sync::Mutex::new(Some(handle)))
    }

    /// Waits for the sync; an error refuses the dump at CRIU's gate (CRIU resumes the tree).
    fn wait(&self) -> Result<(), String> {
        let handle = self
            .0
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let Some(handle) = handle else {
            // Waited for already (and found synced: a failure refused the dump then).
            return Ok(());
        };
        handle
            .join()
            .unwrap_or_else(|_| Err("the journal's sync panicked".to_string()))
            .map_err(|e| {
                format!("the suspension's records cannot be made durable before the tree ends: {e}")
            })
    }
}

/// The tree as CRIU dumped it, seen at its gate against the processes the freeze listed.
#[derive(Debug, Default)]
struct AtGate {
    /// Listed processes that ended before CRIU froze the tree: not in its image, or there as
    /// zombies (`zombies`), no processes of it.
    ended: Vec<Pid>,
    /// Processes CRIU dumped that the freeze never listed (forked since), plain ones only.
    forked: Vec<(ProcHandle, ProcessEntry)>,
    /// Listed plain processes that left the tree (reparented out) before CRIU froze it: CRIU
    /// did not dump them.
    left: Vec<Pid>,
    /// The zombies of the tree (children its processes have not reaped, listed or not): CRIU
    /// dumps each and restores it as a zombie under its pid ([`Manifest::zombies`]).
    zombies: Vec<Pid>,
    /// The ids of the threads of the tree's processes, main threads aside: CRIU restores each
    /// under its id ([`Manifest::threads`]).
    threads: Vec<Pid>,
}

/// At CRIU's dump gate (every image written, the tree frozen: none of it can exit or fork, so
/// what lives in it now is what CRIU dumped alive): which of the listed `handles` (the root
/// first) ended before CRIU froze the tree, and which processes it dumped that the freeze
/// never listed, and which listed ones left it (reparented out: CRIU did not dump them; a
/// plain one is left out of the image). Refused (CRIU then resumes the tree, and the freeze
/// resumes it in place): a CUDA process that ended after its suspension or left the tree (the
/// image would lack it: never left out unseen), a listed process that left it with CUDA state
/// or driver files now, and an unlisted one with CUDA state or driver files (the freeze never
/// suspended it).
fn at_dump_gate(gpu: &Gpu, handles: &[ProcHandle], cuda: &[&ProcHandle]) -> Result<AtGate, String> {
    let root = handles
        .first()
        .ok_or_else(|| "the tree has no processes".to_string())?;
    let mut seen = AtGate::default();
    let in_tree = root.descendants();
    let mut nvml = None;
    for h in handles {
        if h.is_alive() {
            if h.pid() != root.pid() && !in_tree.iter().any(|d| d.pid() == h.pid()) {
                let why = if cuda.iter().any(|c| c.pid() == h.pid()) {
                    Some("it was suspended for the freeze".to_string())
                } else {
                    plain_now(gpu, h, &mut nvml).err()
                };
                if let Some(why) = why {
                    return Err(format!(
                        "pid {} left the tree before CRIU froze it (CRIU did not dump it), and {why}",
                        h.pid()
                    ));
                }
                tracing::info!(
                    pid = h.pid(),
                    "left the tree before CRIU froze it (reparented out): not in the image"
                );
                seen.left.push(h.pid());
            }
            continue;
        }
        if h.pid() == root.pid() || cuda.iter().any(|c| c.pid() == h.pid()) {
            return Err(format!(
                "pid {}, suspended for the freeze, ended before CRIU froze the tree: the image would not hold it",
                h.pid()
            ));
        }
        seen.ended.push(h.pid());
    }
    // CRIU dumps every zombie of the tree and restores it under its pid, and every thread
    // under its id: the image needs those as much as its processes' pids (a zombie has no
    // handle: its parent names it).
    for p in std::iter::once(root).chain(in_tree.iter()) {
        match p.zombie_children().and_then(|z| Ok((z, p.tasks()?))) {
            Ok((z, t)) => {
                seen.zombies.extend(z);
                seen.threads.extend(t.into_iter().filter(|t| *t != p.pid()));
            }
            Err(e) if !p.is_alive() => {
                tracing::debug!(pid = p.pid(), error = %e, "ended at CRIU's gate");
            }
            Err(e) => return Err(format!("the zombies and threads of pid {}: {e}", p.pid())),
        }
    }
    seen.zombies.sort_unstable();
    seen.threads.sort_unstable();
    let listed = |d: &ProcHandle| handles.iter().any(|h| h.pid() == d.pid() && h.is_alive());
    let forked: Vec<ProcHandle> = in_tree.into_iter().filter(|d| !listed(d)).collect();
    if forked.is_empty() {
        return Ok(seen);
    }
    let nvml = match nvml {
        Some(l) => l,
        None => gpu.inspect.processes().map_err(|e| {
            format!("cannot ask NVML about the processes forked since the tree was listed: {e}")
        })?,
    };
    for h in forked {
        let never = |what: String| {
            format!(
                "pid {} was forked after the freeze listed the tree and {what}: it was never suspended",
                h.pid()
            )
        };
        match crate::cuda::classify(gpu, &h, &nvml, crate::cuda::SETTLE) {
            Ok(Class::Plain) => {}
            Ok(Class::Exited) => continue,
            Ok(Class::Cuda { state }) => {
                return Err(never(format!("holds CUDA state ({state:?})")))
            }
            Ok(Class::DriverOnly { fds }) => {
                return Err(never(format!("holds {} driver files", fds.len())))
            }
            Err(u) => return Err(never(format!("cannot be classified ({u})"))),
        }
        match ProcessEntry::of(&h) {
            Ok(e) => {
                tracing::info!(
                    pid = h.pid(),
                    "forked after the tree was listed: in the image"
                );
                seen.forked.push((h, e));
            }
            Err(e) if ended(&h, &e) => {}
            Err(e) => return Err(format!("pid {}: {e}", h.pid())),
        }
    }
    Ok(seen)
}

/// Whether `h`, a process that left the tree, is plain now (no CUDA state, no driver files);
/// `Err`: what it is instead. NVML's list is asked once (`nvml`), for every such process.
fn plain_now(
    gpu: &Gpu,
    h: &ProcHandle,
    nvml: &mut Option<Vec<cryo_gpu::GpuProcess>>,
) -> Result<(), String> {
    let listed = match nvml {
        Some(l) => l,
        None => nvml.insert(
            gpu.inspect
                .processes()
                .map_err(|e| format!("NVML cannot be asked about it: {e}"))?,
        ),
    };
    match crate::cuda::classify(gpu, h, listed, crate::cuda::SETTLE) {
        Ok(Class::Plain | Class::Exited) => Ok(()),
        Ok(Class::Cuda { state }) => Err(format!("it holds CUDA state ({state:?})")),
        Ok(Class::DriverOnly { fds }) => Err(format!("it holds {} driver files", fds.len())),
        Err(u) => Err(format!("it cannot be classified ({u})")),
    }
}

/// The staging directory (and CRIU's log in it) goes when the freeze fails: keep the log beside
/// the image path as `NAME.dump.log`, and point the error at it.
fn keep_log(e: CriuError, image: &Path) -> CriuError {
    match e {
        CriuError::Failed { op, log, lines } => {
            let name = image
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let kept = image.with_file_name(format!("{name}.dump.log"));
            let log = match std::fs::copy(&log, &kept) {
                Ok(_) => kept,
                Err(_) => log,
            };
            CriuError::Failed { op, log, lines }
        }
        other => other,
    }
}

fn image_name(opts: &FreezeOptions) -> String {
    opts.image.display().to_string()
}

/// After a failure past the let-go (the leases ended: whatever lives is traced again, still
/// CHECKPOINTED): journals the processes that died meanwhile (their contexts were checkpointed:
/// the safe kind) and resumes the others in place.
fn after_let_go(
    gpu: &Gpu,
    handles: &[ProcHandle],
    cuda: &[&ProcHandle],
    journal: &Journal,
    watcher: &dyn Watcher,
    why: &str,
) {
    for h in handles.iter().filter(|h| !h.is_alive()) {
        let how = if cuda.iter().any(|c| c.pid() == h.pid()) {
            "ended during the freeze, after its suspension: its context was checkpointed (the safe kind)"
        } else {
            "ended during the freeze"
        };
        tracing::warn!(pid = h.pid(), "{how}");
        if let Err(e) = journal.append(Event::ProcessExited {
            pid: id(h),
            how: how.to_string(),
        }) {
            tracing::error!(pid = h.pid(), error = %e, "cannot journal the end");
        }
    }
    let alive: Vec<&ProcHandle> = cuda.iter().copied().filter(|h| h.is_alive()).collect();
    resume_in_place(gpu, &alive, journal, watcher, why);
}

/// Refuses a tree a process of which something traces (after the guard let go: a debugger, or
/// a guard that is not the one asked).
fn check_untraced(handles: &[ProcHandle]) -> Result<(), FreezeError> {
    for h in handles {
        match h.tracer() {
            Ok(Some(tracer)) => {
                return Err(FreezeError::Traced {
                    pid: h.pid(),
                    tracer,
                })
            }
            Ok(None) => {}
            // Gone meanwhile: CRIU's dump says so.
            Err(_) if !h.is_alive() => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Restores and unlocks `procs` in place, each journaled as restored before its driver restore
/// (its context goes through a driver restore: from then on it is a restored one, guarded as
/// such) and traced by `watcher` before its unlock. Returns the first failure; every other
/// process is still attempted.
fn resume_in_place(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    journal: &Journal,
    watcher: &dyn Watcher,
    why: &str,
) -> Option<(Pid, crate::restore::RestoreError)> {
    resume_all(gpu, procs, journal, watcher, why)
        .into_iter()
        .next()
}

/// As [`resume_in_place`], returning every failure.
fn resume_all(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    journal: &Journal,
    watcher: &dyn Watcher,
    why: &str,
) -> Vec<(Pid, crate::restore::RestoreError)> {
    let mut failed = Vec::new();
    for h in procs {
        let pid = h.pid();
        if !matches!(gpu.driver.state(pid), Ok(ProcessState::Checkpointed)) {
            continue;
        }
        if let Err(e) = crate::restore::resume_in_place(gpu, journal, h, why, watcher) {
            tracing::error!(pid, error = %e, "cannot bring the process back; it stays CHECKPOINTED (safe)");
            failed.push((pid, e));
        }
    }
    failed
}

/// Refuses trees CRIU would dump badly: a root outside its own session, a process traced by
/// anything but cryo's own executable (the guard, which lets go after the suspension).
fn check_dumpable(root: Pid, handles: &[ProcHandle]) -> Result<(), FreezeError> {
    for h in handles {
        if h.pid() == root {
            let sid = h.stat()?.session;
            if sid != root {
                return Err(FreezeError::NotSessionLeader { pid: root, sid });
            }
        }
        let tracer = match h.tracer() {
            Ok(t) => t,
            Err(e) if h.pid() != root && ended(h, &e) => continue,
            Err(e) => return Err(e.into()),
        };
        if let Some(tracer) = tracer {
            if !cryo_proc::runs_our_executable(tracer) {
                return Err(FreezeError::Traced {
                    pid: h.pid(),
                    tracer,
                });
            }
        }
    }
    Ok(())
}

/// Whether `e`, from a look at `h`, says that `h` ended since the tree was listed (reaped, or
/// a zombie whose files are gone): such a member is not part of the tree any more.
fn ended(h: &ProcHandle, e: &ProcError) -> bool {
    matches!(e, ProcError::NoSuchProcess(_)) && !h.is_alive()
}

/// Reaps `pid` if it is a zombie child of ours (a worker the caller spawned); a zombie keeps its
/// pid, and a restore of the image needs that pid free.
fn reap_if_ours(pid: Pid) {
    if let Some(p) = rustix::process::Pid::from_raw(pid) {
        // ECHILD for anything not ours: nothing to do.
        let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
    }
}

/// Runs `f` while reporting the bytes found in `dir` as progress of `step` (begun here; the
/// caller ends it).
pub(crate) fn with_dir_progress<T>(
    progress: &dyn Progress,
    pid: Pid,
    step: &'static str,
    total: u64,
    dir: &Path,
    f: impl FnOnce() -> T,
) -> T {
    progress.begin(pid, step, total);
    // The step ends the moment `f` returns: the reporter is woken, never waited for while it
    // sleeps (a sleeping reporter held the end of every dump back by up to 100 ms).
    let (done, stop) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                stop.recv_timeout(Duration::from_millis(100))
            {
                progress.advance(pid, cryo_criu::image::dir_bytes(dir));
            }
        });
        let out = f();
        drop(done);
        out
    })
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
