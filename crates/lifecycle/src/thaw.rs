//! `cryo thaw`: verify an image, check that this host can take it, CRIU-restore the tree, restore
//! and unlock its CUDA processes, health-check the worker.
//!
//! # Design
//! Nothing runs before the image is verified (manifest digest, every file's size and SHA-256) and
//! the prechecks pass ([`precheck`], pure): the node's fence (read here, every time: a quarantine
//! file that cannot be read or trusted refuses the thaw) has no entry for an unknown GPU, and every
//! target GPU (after `--gpu-map`) exists, is the image's GPU model, is not quarantined, and has
//! the free device memory the image needs (a restore
//! that fails on memory leaves the process stuck in CHECKPOINTED for good, NVIDIA/cuda-checkpoint#44);
//! the driver is compatible (same major version); every pid, pgid and sid of the image is free
//! (unless its tree had a pid namespace of its own: CRIU restores it into a fresh one).
//!
//! Then: CRIU restore (the tree comes back CHECKPOINTED, as a child of the caller; listed, paired
//! with the image and held by pidfds at CRIU's gate, before any of it runs: a tree that cannot be
//! paired is refused there and never runs; every process's restore intent journaled there too,
//! in one synced write, a journal that cannot take it refusing the gate: from then on they are
//! *restored*, and a thaw that dies before its GPU restore leaves its tree for the next guard or
//! agent start to end, see `leftover`), GPU restore of
//! every CUDA process in parallel with its UUID pairs (a complete list for a process whose GPUs
//! the map names: one pair for each GPU it used, identity pairs included, as the driver demands;
//! none otherwise; a map that lands two of the image's GPUs on one is refused before anything runs), `RestoreCompleted` journaled for every
//! process, unlock, health check. Any failure after the CRIU
//! restore ends in [`crate::stop`] of the restored tree as CRIU's gate listed it (processes the
//! pairing left out included: nothing else owns them) and of what it forked since CRIU resumed
//! it (its descendants, and the members of the sessions it leads, where a fork whose parent
//! exited still is), looked for again after each stop until none is left (bounded, else
//! said): suspended (lock, checkpoint, verified) first, then killed; the forks are named in
//! the error. A live restored context is never torn down.
//!
//! Once the worker runs (every CUDA process unlocked), nothing the journal refuses fails the
//! thaw: a record it cannot take from then on (an `Unlocked`, `HealthOk`, the grow's `Grown` or
//! `GrowFailed`, `ThawCompleted`) is logged and said in the report
//! ([`ThawReport::unrecorded`]): a caller told the thaw failed would retry an image whose
//! worker serves. The next guard or agent start takes such a worker for what it is (it runs:
//! `leftover` ends only a CHECKPOINTED tree) and traces it. Until session 23 the grow's record
//! was the thaw's error ("cannot write the journal"), the worker serving.
//!
//! # Limitations
//! A process the restored tree forked since CRIU resumed it that started a session of its own
//! and whose parent has exited is tied to the tree by nothing the kernel shows: a failed thaw
//! does not find it. A session of the tree whose every member exited during the removal, its
//! id taken at once by another process's new session, would be looked at as the tree's (pid
//! reuse within the removal).
//! The restored root is the caller's child (CRIU's `rst_sibling`): a long-lived caller reaps it;
//! the `cryo` CLI exits and leaves it to its reaper (init or a subreaper), as a detached worker.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cryo_criu::image::{Image, ImageError, Manifest};
use cryo_criu::{Criu, CriuError, RestoreOpts};
use cryo_gpu::Gpu;
use cryo_gpu::{GpuInfo, GpuPair, GpuUuid};
use cryo_journal::{Event, Journal};
use cryo_proc::Pid;
use cryo_proc::ProcHandle;
use cryo_state::fence::{Fence, FenceError, FencedGpu, Quarantine};

use crate::failpoint;
use crate::forks::ROUNDS as FORK_ROUNDS;
use crate::health::{HealthCheck, HealthError};
use crate::progress::Progress;
use crate::restore::{restore_after_intent, Placement};
use crate::stop::{stop, StopOptions};
use crate::suspend::id;
use crate::target::{Resolved, Target};
use crate::watcher::{Coverage, Watcher};
use cryo_units::fmt_bytes;

/// Failpoint: the image is opened and checked (trust, manifest, sizes), prechecks passed, CRIU
/// not started. Tests change the image here to show that what CRIU reads is checked as it reads.
pub const THAW_BEFORE_RESTORE: &str = "thaw-before-restore";

/// Failpoint: CRIU restored every process and waits at cryo's gate (none runs yet), the image
/// passed. Tests kill the thaw here, mid-restore, or (a pausing failpoint, see
/// [`failpoint::pause_if`]) let it go on to write its verdict and kill it before CRIU's exit.
pub const THAW_AT_CRIU_GATE: &str = "thaw-at-criu-gate";

/// Failpoint (a pause, see [`failpoint::pause_if`]): CRIU resumed the tree past its gate and
/// cryo holds it by the pidfds taken there; the plain processes' `RestoreCompleted` records
/// are not written yet, no CUDA process is restored. Tests fill the disk here.
pub const THAW_BEFORE_PLAIN_RECORDS: &str = "thaw-before-plain-records";

/// Failpoint (a pause, see [`failpoint::pause_if`]): CRIU's restore returned, its gate passed:
/// the tree runs (CRIU resumed it), its CUDA processes CHECKPOINTED, none restored. Tests kill
/// the thaw here.
pub const THAW_AFTER_CRIU: &str = "thaw-after-criu";

/// Failpoint: every CUDA process is restored (LOCKED) and traced by the watcher, none unlocked.
pub const THAW_BEFORE_UNLOCK: &str = "thaw-before-unlock";

/// Failpoint (a pause, see [`failpoint::pause_if`]): every CUDA process is unlocked (each
/// `Unlocked` journaled), the worker runs; not health-checked yet, nor grown, its `HealthOk`,
/// `Grown` (or `GrowFailed`) and `ThawCompleted` not written. Tests fill the disk here.
pub const THAW_AFTER_UNLOCK: &str = "thaw-after-unlock";

/// Failpoint (a pause, see [`failpoint::pause_if`]): at CRIU's gate, the tree's restore
/// intents journaled (one synced write), the gate's verdict not written: CRIU holds every
/// process of the tree, none resumed. Tests start a guard or agent here.
pub const THAW_GATE_RECORDED: &str = "thaw-gate-recorded";

/// Options of a thaw.
#[derive(Debug, Clone)]
pub struct ThawOptions {
    /// GPU pairs (OLD from the image, NEW on this host), resolved to UUIDs.
    pub gpu_map: Vec<GpuPair>,
    /// How to tell the worker serves; `None`: success once unlocked.
    pub health: Option<HealthCheck>,
    /// How long the health check may take.
    pub health_timeout: Duration,
    /// How to remove the restored tree safely when a step after the CRIU restore fails.
    pub stop: StopOptions,
    /// When the thaw was requested (times are reported from there).
    pub requested: Instant,
    /// How the engine grows once the tree runs: `None` as the image records it (an image frozen
    /// after a shrink that released memory is grown with that shrink's spec and address);
    /// `Some` overrides the image (a `none` spec: no grow).
    pub shrunk: Option<crate::shrink::Shrink>,
    /// How long CRIU's restore may take; `None`: [`criu_deadline`] of the image's size. Past
    /// it, CRIU and what it restored (nothing of which ran) are killed and the thaw fails.
    pub criu_timeout: Option<Duration>,
}

/// The default deadline of a thaw's CRIU restore for an image of `bytes`: two minutes plus the
/// image at 50 MB/s (a cold read from a slow disk), far above what a restore that makes
/// progress takes (1 GiB restores in seconds) and short enough that a restore blocked for good
/// (a file lock held elsewhere) fails instead of hanging its caller.
pub fn criu_deadline(bytes: u64) -> Duration {
    Duration::from_secs(120) + Duration::from_millis(bytes / 50_000)
}

/// One restored CUDA process.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct RestoredGpu {
    /// The process.
    pub pid: Pid,
    /// The GPUs it landed on.
    pub gpus: Vec<GpuUuid>,
    /// Device memory restored (as in the manifest), bytes.
    pub bytes: u64,
    /// Time of its GPU restore, ms.
    pub restore_ms: u64,
}

/// What a thaw did.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ThawReport {
    /// The image.
    pub image: PathBuf,
    /// The restored root.
    pub root_pid: Pid,
    /// Every process CRIU restored and still running when the thaw ended (by its pidfd: one
    /// that exited since CRIU's gate, a plain process the worker ended, is not): the image's,
    /// then those of [`ThawReport::extras`].
    pub pids: Vec<Pid>,
    /// The processes CRIU restored beside the image's (the pairing at its gate left them out:
    /// a process CRIU dumped that the manifest does not name, plain as the freeze makes them)
    /// and still running: part of the worker's tree, journaled restored like the rest.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extras: Vec<Pid>,
    /// The CUDA processes.
    pub gpu: Vec<RestoredGpu>,
    /// The checks before CRIU runs (trust, manifest, listing, sizes), ms.
    pub verify_ms: u64,
    /// CRIU restore, every chunk of the image checked before anything restored runs, ms.
    pub criu_ms: u64,
    /// Bytes of the image checked during the CRIU restore (see `cryo_criu::Restored`).
    pub served_bytes: u64,
    /// The moments of the CRIU restore, ms from its start (checks done, gate reached, pages
    /// checked, verdict, CRIU's exit).
    #[serde(default)]
    pub criu_phases: cryo_criu::RestorePhases,
    /// GPU restore of every CUDA process (in parallel) and unlock, ms.
    pub gpu_restore_ms: u64,
    /// From the request to the first healthy answer, ms (`None` without a health check).
    pub first_answer_ms: Option<u64>,
    /// The first healthy answer on the host's `CLOCK_MONOTONIC` ([`cryo_units::Moment`]), so
    /// a caller measures it from its own origin (`None` without a health check, or from an
    /// older agent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_answer_at: Option<cryo_units::Moment>,
    /// Whether a guard traced every CUDA process before its unlock (false: no guard runs here).
    pub guarded: bool,
    /// From the request to the end, ms.
    pub elapsed_ms: u64,
    /// The grow of the engine, when the image was frozen shrunk (`ThawOptions::shrunk`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<crate::shrink::ShrinkReport>,
    /// The records the journal could not take once the worker ran (an `Unlocked`, its
    /// `HealthOk`, `Grown` or `GrowFailed`, `ThawCompleted`), each with why: the thaw succeeded
    /// all the same (the worker serves; a caller told it failed would retry an image whose
    /// worker runs), and says so.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unrecorded: Vec<String>,
}

/// The pids of `pids` that are taken, once the zombies among their holders have been waited for
/// (bounded): a zombie only is [`PrecheckError::Unreaped`], naming the parent that has not reaped
/// it; a live holder is left to [`precheck`] ([`PrecheckError::PidsInUse`]).
pub(crate) fn pids_taken(criu: &dyn Criu, pids: &[Pid]) -> Result<Vec<Pid>, PrecheckError> {
    let held = crate::reaped::wait_reaped(|| criu.pids_in_use(pids), crate::reaped::REAP_WAIT);
    if !held.is_empty() && held.iter().all(cryo_proc::PidHolder::is_zombie) {
        return Err(PrecheckError::Unreaped(held));
    }
    Ok(held.iter().map(cryo_proc::PidHolder::pid).collect())
}

/// [`pids_taken`] of the image's pids (its processes' and its zombies', which CRIU restores as
/// zombies under their pids: [`Manifest::restore_pids`]), but none for a tree that had a pid namespace of its own
/// ([`Manifest::own_pid_namespace`]): CRIU restores it into a fresh namespace, under host pids of
/// its own, so the host pids it had at freeze may be anyone's now. An older image says nothing
/// of its namespaces: its pids must be free (the safe side).
pub(crate) fn pids_needed_taken(
    criu: &dyn Criu,
    manifest: &Manifest,
) -> Result<Vec<Pid>, PrecheckError> {
    if manifest.own_pid_namespace() {
        return Ok(Vec::new());
    }
    pids_taken(criu, &manifest.restore_pids())
}

/// This host cannot take the image; nothing was run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PrecheckError {
    /// Pids of the image are taken (the original still running, or its leftovers).
    #[error("pids {} of the image are in use on this host (is the original still running? stop it first)", fmt_pids(.0))]
    PidsInUse(Vec<Pid>),
    /// Pids of the image are held by processes that have exited and that their parents have not
    /// reaped (the original worker is gone, its pids are not free yet).
    #[error("the image's pids are not free yet after {} s: {} (the original has exited; its parent must reap it, or exit)", crate::reaped::REAP_WAIT.as_secs(), crate::reaped::describe(.0))]
    Unreaped(Vec<cryo_proc::PidHolder>),
    /// A GPU the image used is not on this host and not mapped.
    #[error(
        "the image ran on GPU {0}, which this host does not have; map it with --gpu-map {0}=NEW"
    )]
    NoSuchGpu(GpuUuid),
    /// `--gpu-map` names a GPU the image did not use.
    #[error("--gpu-map maps GPU {0}, which the image does not use (it used {1})")]
    UnusedMapping(GpuUuid, String),
    /// A target GPU is another model.
    #[error("the image was frozen on {image:?} GPUs; GPU {gpu} is a {found:?}")]
    Model {
        /// The image's GPU model.
        image: String,
        /// The target GPU.
        gpu: GpuUuid,
        /// Its model.
        found: String,
    },
    /// The driver is not compatible.
    #[error("the image was frozen under driver {image:?}, this host runs {found:?} (another major version)")]
    Driver {
        /// At freeze.
        image: String,
        /// Here.
        found: String,
    },
    /// A target GPU is quarantined.
    #[error("GPU {0} is quarantined (see `cryo guard`); pick another with --gpu-map")]
    Quarantined(GpuUuid),
    /// The guard pinned a context whose GPU it could not tell: every GPU of the node is fenced.
    #[error("every GPU of this node is quarantined: {reason} (see `cryo status`; `cryo guard release --gpu unknown` lifts it)")]
    NodeFenced {
        /// The quarantine entry's reason.
        reason: String,
    },
    /// Not enough free device memory on a target GPU.
    #[error("GPU {gpu} has {} free, the image needs {}: a restore short of memory leaves the worker stuck CHECKPOINTED", fmt_bytes(*.free), fmt_bytes(*.needed))]
    Memory {
        /// The GPU.
        gpu: GpuUuid,
        /// Bytes needed.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// GPU pairs map two images' GPUs onto one, or similar.
    #[error("two GPUs of the image land on GPU {0}")]
    Overlap(GpuUuid),
}

pub(crate) fn fmt_pids(p: &[Pid]) -> String {
    p.iter()
        .map(|p| p.to_string())
        .collect::<Vec<_>>()
        .join(",")
}

/// The thaw failed.
#[derive(Debug, thiserror::Error)]
pub enum ThawError {
    /// The image is not usable (names the file and the reason); nothing was run.
    #[error("image refused: {0}")]
    Image(#[from] ImageError),
    /// This host cannot take the image; nothing was run.
    #[error("thaw refused: {0}")]
    Precheck(#[from] PrecheckError),
    /// The node's quarantine could not be read or is not trusted; nothing was run.
    #[error("cannot read the GPU quarantine, so every GPU counts as fenced: {0}")]
    Fence(#[from] FenceError),
    /// The GPUs could not be inspected; nothing was run.
    #[error("cannot inspect the GPUs: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// The journal could not be written; nothing was run.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// CRIU could not restore the tree (CRIU removes what it half-restored; no context is live).
    #[error("{0}")]
    Criu(#[from] CriuError),
    /// A step after the CRIU restore failed; the restored tree was suspended and removed (or,
    /// if that failed too, left as `cleanup` says).
    #[error("{step} failed: {error}; the restored tree was {cleanup}")]
    AfterRestore {
        /// The step.
        step: &'static str,
        /// What went wrong.
        error: String,
        /// What happened to the restored tree.
        cleanup: String,
    },
}

/// Decides whether this host can take `manifest`, and how each CUDA process lands. Pure:
/// `gpus`, `driver_version`, `fenced` (the quarantine's entries) and `in_use` describe this host.
pub fn precheck(
    manifest: &Manifest,
    gpus: &[GpuInfo],
    driver_version: Option<&str>,
    map: &[GpuPair],
    fenced: &[Quarantine],
    in_use: &[Pid],
) -> Result<Vec<Placement>, PrecheckError> {
    if let Some(q) = fenced.iter().find(|q| q.gpu == FencedGpu::Unknown) {
        return Err(PrecheckError::NodeFenced {
            reason: q.reason.clone(),
        });
    }
    if !in_use.is_empty() {
        return Err(PrecheckError::PidsInUse(in_use.to_vec()));
    }
    let used = manifest.gpu_uuids();
    for p in map {
        if !used.contains(&p.old) {
            let list = used
                .iter()
                .map(|u| u.to_string())
                .collect::<Vec<_>>()
                .join(", ");
            return Err(PrecheckError::UnusedMapping(
                p.old.clone(),
                if list.is_empty() { "none".into() } else { list },
            ));
        }
    }
    let target = |old: &GpuUuid| {
        map.iter()
            .find(|p| p.old == *old)
            .map_or_else(|| old.clone(), |p| p.new.clone())
    };
    let mut need: BTreeMap<GpuUuid, u64> = BTreeMap::new();
    let mut sources: BTreeMap<GpuUuid, GpuUuid> = BTreeMap::new();
    for old in &used {
        let new = target(old);
        if let Some(prev) = sources.insert(new.clone(), old.clone()) {
            if prev != *old {
                return Err(PrecheckError::Overlap(new));
            }
        }
        let Some(info) = gpus.iter().find(|g| g.uuid == new) else {
            return Err(PrecheckError::NoSuchGpu(old.clone()));
        };
        if let Some(model) = &manifest.gpu_model {
            if info.name != *model {
                return Err(PrecheckError::Model {
                    image: model.clone(),
                    gpu: new,
                    found: info.name.clone(),
                });
            }
        }
        if fenced.iter().any(|q| q.gpu.covers(&new)) {
            return Err(PrecheckError::Quarantined(new));
        }
    }
    if let (Some(image), Some(found)) = (&manifest.driver_version, driver_version) {
        if major(image) != major(found) {
            return Err(PrecheckError::Driver {
                image: image.clone(),
                found: found.to_string(),
            });
        }
    }
    let mut plans = Vec::new();
    for (p, g) in manifest.cuda_processes() {
        let mut plan = Placement {
            pid: p.pid,
            pairs: Vec::new(),
            targets: Vec::new(),
            bytes: 0,
        };
        // Once any pair is given, the driver wants one for every GPU the process used (NVIDIA's
        // documentation), identity pairs for those that stay; none when the map names none.
        let mapped = g
            .devices
            .iter()
            .any(|d| map.iter().any(|m| m.old == d.uuid));
        for d in &g.devices {
            let new = target(&d.uuid);
            if mapped {
                plan.pairs.push(GpuPair {
                    old: d.uuid.clone(),
                    new: new.clone(),
                });
            }
            *need.entry(new.clone()).or_default() += d.memory_bytes;
            plan.targets.push(new);
            plan.bytes += d.memory_bytes;
        }
        plans.push(plan);
    }
    for (uuid, needed) in need {
        let free = gpus
            .iter()
            .find(|g| g.uuid == uuid)
            .map_or(0, |g| g.memory_free);
        if needed > free {
            return Err(PrecheckError::Memory {
                gpu: uuid,
                needed,
                free,
            });
        }
    }
    Ok(plans)
}

/// `580.159.04` -> `580`; `cryo-sim 0.1.0` -> `cryo-sim 0`.
fn major(v: &str) -> &str {
    v.split('.').next().unwrap_or(v)
}

/// Journals what setting CRIU up ended: restores whose cryo died before CRIU's gate (see
/// `cryo_criu::scratch`), each a `ThawFailed` of its image saying what was killed. A record that
/// cannot be written is logged: the processes are gone either way.
pub fn journal_ended_restores(journal: &Journal, ended: &[cryo_criu::scratch::EndedRestore]) {
    for e in ended {
        if let Err(err) = journal.append(Event::ThawFailed {
            image: e.image.display().to_string(),
            error: e.to_string(),
        }) {
            tracing::error!(error = %err, "cannot journal {e}");
        }
    }
}

/// Opens the image at `dir` for a thaw with `opts` (trust, manifest, listing and sizes; the
/// bytes are checked as CRIU reads them), given up at the restore's deadline
/// ([`ThawOptions::criu_timeout`] from the request, or [`criu_deadline`] of an empty image: the
/// size is in the manifest not read yet): an image whose file system does not answer is
/// refused then instead of hanging the thaw before any deadline applies.
pub fn open_image(dir: &Path, opts: &ThawOptions) -> Result<Image, ThawError> {
    Ok(Image::open_until(dir, Some(first_look_deadline(opts)))?)
}

/// [`open_image`], the look made in a process of its own ([`Image::open_apart`]): for a command
/// that must be able to exit at the deadline when the image's file system never answers
/// (`cryo thaw`; a thread stuck in such a look would keep its process alive until the file
/// system answers).
pub fn open_image_apart(dir: &Path, opts: &ThawOptions) -> Result<Image, ThawError> {
    Ok(Image::open_apart(dir, first_look_deadline(opts))?)
}

/// The first look's deadline: the restore's ([`ThawOptions::criu_timeout`] from the request, or
/// [`criu_deadline`] of an empty image: the size is in the manifest not read yet).
fn first_look_deadline(opts: &ThawOptions) -> std::time::Instant {
    opts.requested + opts.criu_timeout.unwrap_or_else(|| criu_deadline(0))
}

/// Thaws the image at `dir` ([`open_image`], then [`thaw_opened`]).
#[allow(clippy::too_many_arguments)]
pub fn thaw(
    gpu: &Gpu,
    criu: &dyn Criu,
    dir: &Path,
    opts: &ThawOptions,
    journal: &Journal,
    fence: &Fence,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<ThawReport, ThawError> {
    let opened = open_image(dir, opts)?;
    thaw_opened(gpu, criu, opened, opts, journal, fence, watcher, progress)
}

/// Thaws `opened` (see [`open_image`]), unless `fence` fences its GPUs. See the module docs.
/// Between the GPU restore and the unlock, `watcher` (the guard, if any) traces every CUDA
/// process while it is still LOCKED ([`Watcher::guard_before_unlock`]); if it cannot, the tree
/// is suspended and removed instead of unlocked.
#[allow(clippy::too_many_arguments)]
pub fn thaw_opened(
    gpu: &Gpu,
    criu: &dyn Criu,
    opened: Image,
    opts: &ThawOptions,
    journal: &Journal,
    fence: &Fence,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<ThawReport, ThawError> {
    let gpu = &gpu.bounded(cryo_gpu::Limits::default());
    let t = Instant::now();
    journal_ended_restores(journal, &criu.ended_restores());
    let dir = opened.path().to_path_buf();
    let dir = dir.as_path();
    // From a cold cache the disk reads the bulk while the prechecks run.
    opened.prefetch_page_contents();
    let manifest = opened.manifest().clone();
    let verify_ms = ms(t.elapsed());
    let fenced = fence.list()?;
    let gpus = gpu.inspect.gpus()?;
    let driver = if manifest.cuda_processes().next().is_some() {
        Some(gpu.inspect.driver_version()?)
    } else {
        None
    };
    let plans = precheck(
        &manifest,
        &gpus,
        driver.as_deref(),
        &opts.gpu_map,
        &fenced,
        &pids_needed_taken(criu, &manifest)?,
    )?;

    let image = dir.display().to_string();
    // Written, not synced: no recovery reads it (the timeline and the kube events do); the next
    // synced append (a CUDA process's `RestoreStarted`, or `ThawFailed`) carries it to disk. A
    // journal that cannot take it still refuses the thaw before CRIU runs.
    journal.append_unsynced(vec![Event::ThawStarted {
        image: image.clone(),
    }])?;
    failpoint::pause_if(THAW_BEFORE_RESTORE);
    let inner = thaw_inner(
        gpu, criu, &opened, &manifest, &plans, opts, journal, watcher, progress, verify_ms,
    );
    // The processes by the pidfds taken at CRIU's gate, never their pids again: one that exited
    // is left out, and a pid taken since by another process names nothing of the thaw.
    let (mut result, running, extras) = match inner {
        Ok((r, running, extras)) => (Ok(r), running, extras),
        Err(e) => (Err(e), Vec::new(), Vec::new()),
    };
    let ids: Vec<cryo_journal::ProcId> = running.iter().map(id).collect();
    if let Ok(r) = result.as_mut() {
        let pids = ids.clone();
        let shrink = match (&opts.shrunk, &manifest.shrunk) {
            (Some(s), _) => Ok(s.clone()),
            (None, Some(frozen)) => crate::shrink::Shrunk::of_image(frozen),
            (None, None) => Ok(crate::shrink::Shrink {
                spec: crate::shrink::ShrinkSpec::None,
                engine: None,
                timeout_ms: 0,
            }),
        };
        match shrink {
            Ok(shrink) if shrink.is_none() => {}
            Ok(shrink) => {
                let mut s = crate::shrink::Shrunk::to_grow(&shrink, &image, pids);
                // The engine as the restored tree sees it (a namespace of its own, restored).
                s.reached_through(gpu, &running);
                // The tree runs: a journal that cannot take the grow's record (`Grown`,
                // `GrowFailed`) is said, never a failed thaw (until session 23 its error was
                // the thaw's: "cannot write the journal", the worker serving).
                if let Err(e) = s.grow(journal, progress) {
                    unrecorded(r, "the engine's grow", &e);
                }
                r.shrink = Some(s.report);
            }
            // The tree runs: an image whose shrink cannot be carried out is said, never a
            // failed thaw.
            Err(error) => {
                tracing::error!(%error, "the engine is not grown");
                if let Err(e) = journal.append(Event::GrowFailed {
                    target: image.clone(),
                    pids,
                    error,
                }) {
                    unrecorded(r, "the grow's failure", &e);
                }
            }
        }
    }
    match &mut result {
        // The tree runs, every restore and unlock journaled: a journal that cannot take the
        // record must not turn the thaw into a failed one (its caller would retry an image
        // whose worker serves).
        Ok(r) => {
            if let Err(e) = journal.append(Event::ThawCompleted {
                image,
                pids: ids.into_iter().chain(extras.iter().map(id)).collect(),
                ms: r.elapsed_ms,
            }) {
                unrecorded(r, "the completed thaw", &e);
            }
        }
        Err(e) => {
            if let Err(j) = journal.append(Event::ThawFailed {
                image,
                error: e.to_string(),
            }) {
                tracing::error!(error = %j, "cannot journal the failed thaw");
            }
        }
    }
    result
}

#[allow(clippy::too_many_arguments)]
fn thaw_inner(
    gpu: &Gpu,
    criu: &dyn Criu,
    opened: &Image,
    manifest: &Manifest,
    plans: &[Placement],
    opts: &ThawOptions,
    journal: &Journal,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
    verify_ms: u64,
) -> Result<(ThawReport, Vec<ProcHandle>, Vec<ProcHandle>), ThawError> {
    let dir = opened.path();
    let image = dir.display().to_string();
    let t = Instant::now();
    progress.begin(manifest.root_pid, "criu restore", manifest.total_bytes);
    let restore_opts = RestoreOpts {
        deadline: Some(
            opts.criu_timeout
                .unwrap_or_else(|| criu_deadline(manifest.total_bytes)),
        ),
        ..RestoreOpts::default()
    };
    // The restored tree, listed and paired with the image at CRIU's gate ([`GateTree`]), off
    // the path between CRIU's exit and the GPU restore. A tree that cannot be listed or paired
    // is refused at the gate: CRIU ends it, it never ran.
    //
    // Named in the journal there too, before any of it runs ([`gate_intents`]: one synced
    // write): from CRIU's resume on, a thaw that dies (SIGKILL, OOM) leaves each CUDA process
    // CHECKPOINTED with its restore intent, its writer gone, which the next guard or agent
    // start ends with its tree (`leftover`). A journal that cannot take it refuses the gate:
    // CRIU ends the tree, it never ran.
    let listed: std::sync::OnceLock<GateTree> = std::sync::OnceLock::new();
    let restored = criu.restore_gated(opened, &restore_opts, &|root| {
        failpoint::pause_if(THAW_AT_CRIU_GATE);
        let gate = GateTree::list(root, manifest)?;
        journal
            .append_all(gate_intents(&gate, plans, &image))
            .map_err(|e| {
                format!("cannot journal the restored tree before it runs, so it does not: {e}")
            })?;
        failpoint::pause_if(THAW_GATE_RECORDED);
        let _ = listed.set(gate);
        Ok(())
    });
    progress.end(
        manifest.root_pid,
        "criu restore",
        restored.is_ok(),
        &format!("{} ms", t.elapsed().as_millis()),
    );
    let streamed = match restored {
        Ok(r) => r,
        // The streamer refused the image while CRIU read it: nothing of it ran.
        Err(CriuError::Image(e)) => return Err(ThawError::Image(e)),
        Err(e) => return Err(e.into()),
    };
    let root = streamed.pid;
    let criu_ms = ms(t.elapsed());
    failpoint::pause_if(THAW_AFTER_CRIU);
    // For the timeline and metrics only: not worth failing a restore that happened, nor an
    // `fdatasync` between CRIU's exit and the GPU restore (the next synced append carries it).
    if let Err(e) = journal.append_unsynced(vec![Event::CriuRestored {
        image: image.clone(),
        ms: criu_ms,
    }]) {
        tracing::error!(error = %e, "cannot journal the CRIU restore");
    }

    // The tree listed at the gate is the one that runs. From here on, every failure removes it
    // safely: all of it, the processes the pairing left out (extras CRIU restored beside the
    // image's) included, which nothing else owns.
    let (gate_tree, handles, image_pids, extras): (Resolved, Vec<ProcHandle>, Vec<Pid>, _) =
        match GateTree::resumed(listed.into_inner(), root) {
            Ok(gate) => {
                let extras = gate.extras();
                let (handles, image_pids) = gate.paired.into_iter().unzip();
                (gate.tree, handles, image_pids, extras)
            }
            Err((error, tree)) => {
                return Err(ThawError::AfterRestore {
                    step: "criu restore",
                    error,
                    cleanup: remove_safely(gpu, &tree, opts, journal, progress),
                });
            }
        };
    let restored = Resolved::from_handles(Target::Tree(root), handles);
    let handles = restored.handles();
    let fail = |step: &'static str, error: String| -> ThawError {
        let cleanup = remove_safely(gpu, &gate_tree, opts, journal, progress);
        ThawError::AfterRestore {
            step,
            error,
            cleanup,
        }
    };
    let extras = extras.map_err(|e| {
        fail(
            "criu restore",
            format!("holding the processes restored beside the image's: {e}"),
        )
    })?;
    // The image's processes as restored here: the same plans under their host pids.
    let plans: Vec<Placement> = plans
        .iter()
        .filter_map(|p| {
            let at = image_pids.iter().position(|i| *i == p.pid)?;
            Some(Placement {
                pid: handles[at].pid(),
                ..p.clone()
            })
        })
        .collect();
    let plans = &plans[..];
    let handle = |pid: Pid| handles.iter().find(|h| h.pid() == pid);
    // The plain processes, the extras among them: restored by CRIU, like the rest, their
    // intents journaled at the gate. Written, not synced: no recovery needs them on disk (the
    // gate's intents name the tree; these tell a polling guard to trace them), the next synced
    // append carries them. A journal that cannot take them (a full disk) fails the thaw
    // through `fail`, as every step past the gate does: the tree is removed through a verified
    // stop, or, when that cannot be journaled either, left as it is (its CUDA processes
    // CHECKPOINTED: none restored yet) and named in the error for `cryo stop`.
    failpoint::pause_if(THAW_BEFORE_PLAIN_RECORDS);
    let plain: Vec<Event> = handles
        .iter()
        .filter(|h| !plans.iter().any(|p| p.pid == h.pid()))
        .chain(&extras)
        .map(|h| Event::RestoreCompleted {
            pid: id(h),
            image: image.clone(),
            ms: None,
        })
        .collect();
    if let Err(e) = journal.append_unsynced(plain) {
        return Err(fail(
            "recording the restore",
            format!("cannot journal its plain processes as restored: {e}"),
        ));
    }

    let t = Instant::now();
    let results: Vec<(Pid, Result<u64, String>)> = std::thread::scope(|s| {
        let jobs: Vec<_> = plans
            .iter()
            .map(|plan| {
                let image = &image;
                s.spawn(move || {
                    progress.begin(plan.pid, "gpu restore", plan.bytes);
                    let t = Instant::now();
                    // Its intent journaled at the gate, naming this thaw as the one that
                    // unlocks it ([`gate_intents`]).
                    let r = match handle(plan.pid) {
                        Some(h) => restore_after_intent(gpu, journal, h, &plan.pairs, image)
                            .map(ms)
                            .map_err(|e| e.to_string()),
                        None => Err(format!("pid {} is gone", plan.pid)),
                    };
                    progress.end(
                        plan.pid,
                        "gpu restore",
                        r.is_ok(),
                        &format!("{} ms, {}", t.elapsed().as_millis(), fmt_bytes(plan.bytes)),
                    );
                    (plan.pid, r)
                })
            })
            .collect();
        jobs.into_iter()
            .zip(plans)
            .map(|(j, plan)| {
                j.join()
                    .unwrap_or_else(|_| (plan.pid, Err("restore thread panicked".into())))
            })
            .collect()
    });
    let mut gpu_report = Vec::new();
    let mut failure = None;
    for ((pid, r), plan) in results.into_iter().zip(plans) {
        match r {
            Ok(restore_ms) => {
                gpu_report.push(RestoredGpu {
                    pid,
                    gpus: plan.targets.clone(),
                    bytes: plan.bytes,
                    restore_ms,
                });
            }
            Err(e) => {
                failure.get_or_insert(format!("pid {pid}: {e}"));
            }
        }
    }
    if let Some(e) = failure {
        return Err(fail("GPU restore", e));
    }
    // Still LOCKED: traced now, or never unlocked (no instant runs unguarded).
    let cuda: Vec<&ProcHandle> = plans.iter().filter_map(|p| handle(p.pid)).collect();
    let guarded = match watcher.guard_before_unlock(&cuda) {
        Ok(c) => c == Coverage::Guarded,
        Err(e) => return Err(fail("guard before unlock", e.to_string())),
    };
    failpoint::stall_if(THAW_BEFORE_UNLOCK);
    // What the journal could not take from the first unlock on (the thaw succeeds all the
    // same: [`ThawReport::unrecorded`]).
    let mut unrecorded: Vec<String> = Vec::new();
    for plan in plans {
        let t = Instant::now();
        if let Err(e) = gpu.driver.unlock(plan.pid) {
            return Err(fail("unlock", format!("pid {}: {e}", plan.pid)));
        }
        // The process runs again: a journal that cannot take the record must not fail the thaw.
        if let Some(h) = handle(plan.pid) {
            if let Err(e) = journal.append(Event::Unlocked {
                pid: id(h),
                ms: Some(ms(t.elapsed())),
                recovery: false,
            }) {
                tracing::error!(pid = plan.pid, error = %e, "cannot journal the unlock");
                unrecorded.push(format!("the unlock of pid {}: {e}", plan.pid));
            }
        }
    }
    let gpu_restore_ms = ms(t.elapsed());
    failpoint::pause_if(THAW_AFTER_UNLOCK);

    let mut first_answer_at = None;
    let first_answer_ms = match &opts.health {
        None => None,
        Some(check) => match check.wait(opts.health_timeout) {
            Ok(at) => {
                first_answer_at = Some(cryo_units::Moment::of(at));
                let check_ms = ms(at.duration_since(t));
                // The worker serves: a journal that cannot take the record must not fail the
                // thaw (as the unlock's, above).
                if let Some(h) = handle(root) {
                    if let Err(e) = journal.append(Event::HealthOk {
                        pid: id(h),
                        ms: check_ms,
                    }) {
                        tracing::error!(pid = root, error = %e, "cannot journal the health check");
                        unrecorded.push(format!("the health check's answer: {e}"));
                    }
                }
                Some(ms(at.duration_since(opts.requested)))
            }
            Err(e @ HealthError::Timeout { .. }) | Err(e @ HealthError::BadUrl(_)) => {
                return Err(fail("health check", e.to_string()))
            }
        },
    };
    // Judged by the pidfds taken at the gate: a process of the image that exited since (a plain
    // one the worker ended; a CUDA one would have failed its restore) is not reported running.
    let running: Vec<ProcHandle> = restored
        .into_handles()
        .into_iter()
        .filter(ProcHandle::is_alive)
        .collect();
    let extras: Vec<ProcHandle> = extras.into_iter().filter(ProcHandle::is_alive).collect();
    Ok((
        ThawReport {
            image: dir.to_path_buf(),
            root_pid: root,
            pids: running.iter().chain(&extras).map(ProcHandle::pid).collect(),
            extras: extras.iter().map(ProcHandle::pid).collect(),
            gpu: gpu_report,
            verify_ms,
            criu_ms,
            served_bytes: streamed.served_bytes,
            criu_phases: streamed.phases,
            gpu_restore_ms,
            first_answer_ms,
            first_answer_at,
            guarded,
            elapsed_ms: ms(opts.requested.elapsed()),
            shrink: None,
            unrecorded,
        },
        running,
        extras,
    ))
}

/// What a thaw journals at CRIU's gate, in one synced write, before any of the tree runs: a
/// restore intent ([`Event::RestoreStarted`] of the image) for every process of `gate`'s
/// tree, the ones the pairing left out included. A CUDA process's (its image pid among
/// `plans`) names this process as the one that unlocks it; a plain one's names none (CRIU
/// restores it whole: nothing to unlock). From then on each counts as restored, and a thaw
/// that dies before its GPU restore leaves its CUDA processes for `leftover` to find, with the
/// whole tree: its root is among the journaled processes.
///
/// Its cost, against one intent per CUDA process after CRIU's exit and one synced record per
/// plain process (session 22, `perf trace` of `cryo thaw`, sim worker of 16 MiB, ext4): no
/// `fdatasync` left between CRIU's exit and the driver's restore (one before for a worker of
/// one process, two for a launcher with one rank), one at the gate before CRIU's resume
/// (0.5 to 5 ms here, on a loaded host); a whole thaw syncs 4 times for both (was 4 and 5).
fn gate_intents(gate: &GateTree, plans: &[Placement], image: &str) -> Vec<Event> {
    let by = crate::suspend::me();
    gate.tree
        .handles()
        .iter()
        .map(|h| {
            let cuda = gate
                .paired
                .iter()
                .any(|(p, at)| p.pid() == h.pid() && plans.iter().any(|plan| plan.pid == *at));
            Event::RestoreStarted {
                pid: id(h),
                image: image.to_string(),
                unlock_by: if cuda { by } else { None },
            }
        })
        .collect()
}

/// A restored tree as CRIU's gate shows it (its `post-restore` stage: every process restored,
/// none resumed), so the image's tree, whole, with none of it forked, exited or its pid reused
/// since. `cryo thaw` and a standby's restore both list and pair it there
/// ([`GateTree::list`]) and hold it by pidfds from then on ([`GateTree::resumed`]), never by
/// listing it again once it runs.
pub(crate) struct GateTree {
    /// The root CRIU named at its gate (its host pid).
    root: Pid,
    /// Every process under it there, root first: the image's, and any CRIU dumped beside them
    /// (a child born between the freeze's listing and CRIU's seize).
    pub(crate) tree: Resolved,
    /// The image's processes, in the manifest's order (root first), each with its pid in the
    /// image.
    pub(crate) paired: Vec<(ProcHandle, Pid)>,
}

impl GateTree {
    /// Lists the tree CRIU restored under `root` (the host pid it named at its gate, never the
    /// image's: a tree with a pid namespace of its own is back under other host pids, and a host
    /// process may hold one of the image's by now) and pairs it with the image
    /// ([`pair_restored`]). Run at CRIU's gate; an `Err` refuses the restore there.
    pub(crate) fn list(root: Pid, manifest: &Manifest) -> Result<Self, String> {
        let tree = ProcHandle::open(root)
            .map_err(|e| format!("the restored root pid {root}: {e}"))
            .and_then(|h| {
                Resolved::tree(h)
                    .map_err(|e| format!("listing the restored tree of pid {root}: {e}"))
            })?;
        let paired = pair_restored(&tree, manifest)?
            .iter()
            .map(|(h, e)| h.try_clone().map(|h| (h, e.pid)))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| e.to_string())?;
        Ok(GateTree { root, tree, paired })
    }

    /// The processes of the tree that the pairing left out (CRIU restored them beside the
    /// image's: processes it dumped that the manifest does not name), each a handle of its own:
    /// part of the worker's tree, owned with the rest.
    pub(crate) fn extras(&self) -> Result<Vec<ProcHandle>, cryo_proc::ProcError> {
        self.tree
            .handles()
            .iter()
            .filter(|h| !self.paired.iter().any(|(p, _)| p.pid() == h.pid()))
            .map(ProcHandle::try_clone)
            .collect()
    }

    /// The tree that runs, once CRIU has exited naming `root` (its pidfile, else the pid of
    /// its gate): the one listed at the gate (`listed`), if CRIU named the same root there.
    /// Otherwise why not, and the tree to remove (the gate's; the one under `root` now when
    /// the gate listed none).
    pub(crate) fn resumed(listed: Option<Self>, root: Pid) -> Result<Self, (String, Resolved)> {
        match listed {
            Some(gate) if gate.root == root => Ok(gate),
            Some(gate) => Err((
                format!(
                    "CRIU named root pid {root}, and pid {} at its gate",
                    gate.root
                ),
                gate.tree,
            )),
            None => Err((
                format!("CRIU resumed root pid {root} without cryo listing it at the gate"),
                match ProcHandle::open(root).map(Resolved::tree) {
                    Ok(Ok(t)) => t,
                    _ => Resolved::from_handles(Target::Tree(root), Vec::new()),
                },
            )),
        }
    }
}

/// Pairs each process of the image with the restored process that is it, in `tree` (the
/// restored root, by its host pid, and its descendants). A tree in cryo's pid namespace is back
/// under the image's pids (CRIU restores them): paired by pid, a process it forked since left
/// out. A tree that is pid 1 of a namespace of its own (a container, `cryo run`) is back under
/// other host pids but the same pids of its namespace (CRIU restores those): paired by its
/// namespace's pid, which the image records from format 4 ([`ProcessEntry::nspid`]). An older
/// image names only the host pids it had: paired root first, then in the order the namespace
/// numbers them against the image's pid order (both the order they were forked in, unless a
/// process of the namespace set `ns_last_pid`). Each pair is checked by its command name.
///
/// [`ProcessEntry::nspid`]: cryo_criu::image::ProcessEntry::nspid
pub(crate) fn pair_restored<'t, 'm>(
    tree: &'t Resolved,
    manifest: &'m Manifest,
) -> Result<Vec<(&'t ProcHandle, &'m cryo_criu::image::ProcessEntry)>, String> {
    let handles: Vec<&ProcHandle> = tree.handles().iter().collect();
    let root = handles
        .first()
        .ok_or_else(|| "no restored process".to_string())?;
    let nspid = |h: &ProcHandle| {
        h.status()
            .map(|s| s.nspid)
            .map_err(|e| format!("pid {}: {e}", h.pid()))
    };
    let levels = nspid(root)?.len();
    if levels == 1 {
        return manifest
            .processes
            .iter()
            .map(|e| {
                handles
                    .iter()
                    .find(|h| h.pid() == e.pid)
                    .map(|h| (*h, e))
                    .ok_or_else(|| format!("pid {} of the image did not come back", e.pid))
            })
            .collect();
    }
    // Each process by its pid in the root's namespace, on both sides.
    let mut restored: Vec<(Pid, &ProcHandle)> = Vec::with_capacity(handles.len());
    for h in &handles {
        let ns = nspid(h)?;
        let at = ns
            .get(levels - 1)
            .copied()
            .ok_or_else(|| format!("pid {} is not in the restored root's namespace", h.pid()))?;
        restored.push((at, h));
    }
    let pairs: Vec<(&ProcHandle, &cryo_criu::image::ProcessEntry)> = match manifest
        .processes
        .first()
        .map(|e| e.nspid.len())
    {
        Some(image_levels) if image_levels > 0 => {
            let mut out: Vec<(&ProcHandle, _)> = Vec::with_capacity(handles.len());
            for e in &manifest.processes {
                let at = e.nspid.get(image_levels - 1).ok_or_else(|| {
                    format!("pid {} of the image is not in its root's namespace", e.pid)
                })?;
                let mut found = restored.iter().filter(|(n, _)| n == at);
                match (found.next(), found.next()) {
                        (Some((_, h)), None)
                            if !out.iter().any(|(o, _)| std::ptr::eq(*o, *h)) =>
                        {
                            out.push((*h, e))
                        }
                        _ => {
                            return Err(format!(
                                "pid {} of the image (pid {at} of its namespace) is not one restored process",
                                e.pid
                            ))
                        }
                    }
            }
            out
        }
        // Older images: by order, which needs every process and no other. A newer image is
        // paired by namespace pid, so a process CRIU dumped beside the image's (forked between
        // the freeze's listing and CRIU's seize, as a fork loop's child is) is left out, as
        // in cryo's own namespace above.
        _ => {
            if handles.len() != manifest.processes.len() {
                return Err(format!(
                    "{} of {} processes came back",
                    handles.len(),
                    manifest.processes.len()
                ));
            }
            let mut ordered = restored[1..].to_vec();
            ordered.sort_by_key(|(n, _)| *n);
            let mut entries: Vec<_> = manifest.processes.iter().collect();
            entries[1..].sort_by_key(|e| e.pid);
            std::iter::once(*root)
                .chain(ordered.into_iter().map(|(_, h)| h))
                .zip(entries)
                .collect()
        }
    };
    for (h, e) in &pairs {
        let comm = h.stat().map(|s| s.comm).unwrap_or_default();
        if comm != e.comm {
            return Err(format!(
                "restored pid {} runs {comm:?} where the image has {:?} (pid {} of the image): cannot tell the processes apart",
                h.pid(),
                e.comm,
                e.pid
            ));
        }
    }
    Ok(pairs)
}

/// What became of a restored tree that [`remove_with_forks`] removed.
pub(crate) struct Removal {
    /// Whether a stop ran (something of the tree was alive).
    pub(crate) stopped: bool,
    /// Why not everything was removed (`None`: it was), naming what is left.
    pub(crate) failure: Option<String>,
    /// The processes the tree forked since it was listed, found and stopped with it.
    pub(crate) forked: Vec<Pid>,
}

impl Removal {
    /// `, with the N processes it forked since ... (pids ...)`, or nothing.
    pub(crate) fn forks(&self, since: &str) -> String {
        if self.forked.is_empty() {
            return String::new();
        }
        format!(
            ", with the {} processes it forked since {since} (pids {})",
            self.forked.len(),
            fmt_pids(&self.forked)
        )
    }
}

/// Suspends and kills a restored tree through the stop path (`stop`'s options): the tree as
/// listed (`restored`: CRIU's gate's, or a standby's processes) and whatever it forked since
/// (found through its descendants and its own sessions, [`forked_since`]), looked for again
/// after each stop until none is left, bounded: none of it runs on unnamed. Every CUDA
/// process among them is suspended and verified before its kill, as any stop's.
pub(crate) fn remove_with_forks(
    gpu: &Gpu,
    restored: &Resolved,
    stop_opts: &StopOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> Removal {
    let gate = restored.handles();
    let sessions = crate::forks::own_sessions(gate);
    let mut forked: Vec<ProcHandle> = Vec::new();
    // Forks each stop found itself (it walks the tree the same way while it stops it).
    let mut found: Vec<Pid> = Vec::new();
    let mut failure: Option<String> = None;
    let mut stopped = false;
    for round in 0..=FORK_ROUNDS {
        let held: Vec<&ProcHandle> = gate.iter().chain(&forked).collect();
        let new = crate::forks::forked_since(&held, &sessions);
        if round > 0 && new.is_empty() {
            break;
        }
        if round == FORK_ROUNDS {
            failure = Some(format!(
                "NOT removed: it kept forking, pids {} still run after {FORK_ROUNDS} stops (run `cryo stop` on them)",
                fmt_pids(&new.iter().map(ProcHandle::pid).collect::<Vec<_>>())
            ));
            break;
        }
        let mut handles: Vec<ProcHandle> = Vec::new();
        if round == 0 {
            handles.extend(gate.iter().filter_map(|h| h.try_clone().ok()));
        }
        handles.extend(new.iter().filter_map(|h| h.try_clone().ok()));
        forked.extend(new);
        let alive: Vec<Pid> = handles
            .iter()
            .filter(|h| h.is_alive())
            .map(ProcHandle::pid)
            .collect();
        if alive.is_empty() {
            continue;
        }
        let target = if round == 0 {
            restored.target().clone()
        } else {
            Target::Pids(alive.clone())
        };
        let target = Resolved::from_handles(target, handles);
        stopped = true;
        match stop(gpu, &target, stop_opts, journal, progress) {
            Ok(r) if r.stopped() => found.extend(r.forked()),
            Ok(r) => {
                failure = Some(format!(
                    "NOT removed: {} (left alive and safe; run `cryo stop` on pids {})",
                    r.refusals
                        .iter()
                        .map(|x| format!("pid {}: {}", x.pid, x.reason.reason()))
                        .collect::<Vec<_>>()
                        .join("; "),
                    fmt_pids(&alive)
                ));
                break;
            }
            Err(e) => {
                failure = Some(format!(
                    "NOT removed: {e} (run `cryo stop` on pids {})",
                    fmt_pids(&alive)
                ));
                break;
            }
        }
    }
    for h in gate.iter().chain(&forked) {
        if !h.is_alive() {
            if let Some(p) = rustix::process::Pid::from_raw(h.pid()) {
                let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
            }
        }
    }
    Removal {
        stopped,
        failure,
        forked: forked.iter().map(ProcHandle::pid).chain(found).collect(),
    }
}

/// Suspends and kills the restored tree of a failed thaw and what it forked since CRIU resumed
/// it ([`remove_with_forks`]); says what became of it.
fn remove_safely(
    gpu: &Gpu,
    restored: &Resolved,
    opts: &ThawOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> String {
    let r = remove_with_forks(gpu, restored, &opts.stop, journal, progress);
    let forks = r.forks("CRIU resumed it");
    match r.failure {
        Some(failed) => format!("{failed}{forks}"),
        None if r.stopped => format!("suspended and removed{forks}"),
        None => format!("already gone{forks}"),
    }
}

/// A record of `what` the journal refused (`e`) once the worker ran: logged, and said in the
/// report ([`ThawReport::unrecorded`]), never the thaw's failure.
fn unrecorded(r: &mut ThawReport, what: &str, e: &cryo_journal::AppendError) {
    tracing::error!(error = %e, "cannot journal {what}");
    r.unrecorded.push(format!("{what}: {e}"));
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use cryo_criu::image::{DeviceUse, ProcessEntry, ProcessGpu};
    use cryo_gpu::ProcessState;

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";
    const C: &str = "GPU-cccccccc-0000-0000-0000-000000000000";
    const D: &str = "GPU-dddddddd-0000-0000-0000-000000000000";

    fn u(s: &str) -> GpuUuid {
        s.parse().unwrap()
    }

    fn fenced(gpu: FencedGpu) -> Quarantine {
        Quarantine {
            gpu,
            reason: "r".into(),
            pids: vec![7],
            since_unix: 0,
        }
    }

    fn gpus(free: u64) -> Vec<GpuInfo> {
        [A, B]
            .iter()
            .enumerate()
            .map(|(i, x)| GpuInfo {
                index: i as u32,
                uuid: u(x),
                name: "M".into(),
                memory_total: free,
                memory_free: free,
            })
            .collect()
    }

    fn manifest(bytes: u64) -> Manifest {
        let json = serde_json::json!({
            "format_version": 1, "cryo_version": "0", "created": "x", "root_pid": 10,
            "processes": [], "gpu_model": "M", "driver_version": "580.1",
            "criu_version": {"major": 4, "minor": 1, "sublevel": 1},
            "total_bytes": 0, "files": [], "manifest_sha256": ""
        });
        let mut m: Manifest = serde_json::from_value(json).unwrap();
        m.processes.push(ProcessEntry {
            pid: 10,
            ppid: 1,
            comm: "w".into(),
            cmdline: vec![],
            nspid: vec![],
            gpu: Some(ProcessGpu {
                state: ProcessState::Checkpointed,
                devices: vec![DeviceUse {
                    uuid: u(A),
                    memory_bytes: bytes,
                }],
            }),
        });
        m
    }

    #[test]
    fn same_gpu_needs_no_pairs() {
        let plans = precheck(&manifest(100), &gpus(1000), Some("580.2"), &[], &[], &[]).unwrap();
        assert_eq!(
            plans,
            vec![Placement {
                pid: 10,
                pairs: vec![],
                targets: vec![u(A)],
                bytes: 100
            }]
        );
    }

    #[test]
    fn map_moves_the_context() {
        let map = [GpuPair {
            old: u(A),
            new: u(B),
        }];
        let plans = precheck(&manifest(100), &gpus(1000), Some("580.2"), &map, &[], &[]).unwrap();
        assert_eq!(plans[0].pairs, map.to_vec());
        assert_eq!(plans[0].targets, vec![u(B)]);
    }

    /// A process on GPUs A and B (and C, D for the host); `map` over four GPUs.
    fn two_gpu_manifest() -> Manifest {
        let mut m = manifest(100);
        m.processes[0]
            .gpu
            .as_mut()
            .unwrap()
            .devices
            .push(DeviceUse {
                uuid: u(B),
                memory_bytes: 50,
            });
        m.processes.push(ProcessEntry {
            pid: 11,
            ppid: 10,
            comm: "w".into(),
            cmdline: vec![],
            nspid: vec![],
            gpu: Some(ProcessGpu {
                state: ProcessState::Checkpointed,
                devices: vec![DeviceUse {
                    uuid: u(D),
                    memory_bytes: 10,
                }],
            }),
        });
        m
    }

    fn four_gpus() -> Vec<GpuInfo> {
        [A, B, C, D]
            .iter()
            .enumerate()
            .map(|(i, x)| GpuInfo {
                index: i as u32,
                uuid: u(x),
                name: "M".into(),
                memory_total: 1000,
                memory_free: 1000,
            })
            .collect()
    }

    fn p(old: &str, new: &str) -> GpuPair {
        GpuPair {
            old: u(old),
            new: u(new),
        }
    }

    #[test]
    fn a_process_whose_gpus_are_mapped_gets_a_pair_for_every_gpu_it_used() {
        let plans = precheck(
            &two_gpu_manifest(),
            &four_gpus(),
            Some("580.2"),
            &[p(A, C)],
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(
            plans[0].pairs,
            vec![p(A, C), p(B, B)],
            "B stays: identity pair"
        );
        assert_eq!(plans[0].targets, vec![u(C), u(B)]);
        assert_eq!(plans[1].pairs, vec![], "the map names none of its GPUs");
        assert_eq!(plans[1].targets, vec![u(D)]);
        // An identity map is still a map: the process gets its complete list.
        let plans = precheck(
            &two_gpu_manifest(),
            &four_gpus(),
            Some("580.2"),
            &[p(D, D)],
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(plans[0].pairs, vec![]);
        assert_eq!(plans[1].pairs, vec![p(D, D)]);
    }

    #[test]
    fn a_map_that_sends_two_gpus_onto_one_is_refused() {
        let m = two_gpu_manifest();
        for map in [vec![p(A, C), p(B, C)], vec![p(A, B)], vec![p(A, D)]] {
            assert!(
                matches!(
                    precheck(&m, &four_gpus(), Some("580.2"), &map, &[], &[]),
                    Err(PrecheckError::Overlap(_))
                ),
                "{map:?}"
            );
        }
        // A swap is fine.
        let plans = precheck(
            &m,
            &four_gpus(),
            Some("580.2"),
            &[p(A, B), p(B, A)],
            &[],
            &[],
        )
        .unwrap();
        assert_eq!(plans[0].pairs, vec![p(A, B), p(B, A)]);
    }

    #[test]
    fn refusals() {
        let m = manifest(100);
        assert_eq!(
            precheck(&m, &gpus(1000), Some("580.2"), &[], &[], &[10]),
            Err(PrecheckError::PidsInUse(vec![10]))
        );
        assert!(matches!(
            precheck(&m, &gpus(50), Some("580.2"), &[], &[], &[]),
            Err(PrecheckError::Memory {
                needed: 100,
                free: 50,
                ..
            })
        ));
        assert!(matches!(
            precheck(&m, &gpus(1000), Some("590.1"), &[], &[], &[]),
            Err(PrecheckError::Driver { .. })
        ));
        // Fenced: its GPU, or every GPU (an entry whose GPU the guard could not tell), even for
        // an image without CUDA processes; another GPU's quarantine does not refuse it.
        let fenced_by = |m: &Manifest, gpu: FencedGpu| {
            precheck(m, &gpus(1000), Some("580.2"), &[], &[fenced(gpu)], &[])
        };
        assert_eq!(
            fenced_by(&m, FencedGpu::Gpu(u(A))),
            Err(PrecheckError::Quarantined(u(A)))
        );
        assert!(fenced_by(&m, FencedGpu::Gpu(u(B))).is_ok());
        let node_fenced = Err(PrecheckError::NodeFenced { reason: "r".into() });
        assert_eq!(fenced_by(&m, FencedGpu::Unknown), node_fenced);
        let no_gpu = Manifest {
            processes: Vec::new(),
            ..manifest(0)
        };
        assert_eq!(fenced_by(&no_gpu, FencedGpu::Unknown), node_fenced);
        let mut other = gpus(1000);
        other[0].name = "N".into();
        assert!(matches!(
            precheck(&m, &other, Some("580.2"), &[], &[], &[]),
            Err(PrecheckError::Model { .. })
        ));
        let map = [GpuPair {
            old: u(B),
            new: u(A),
        }];
        assert!(matches!(
            precheck(&m, &gpus(1000), Some("580.2"), &map, &[], &[]),
            Err(PrecheckError::UnusedMapping(..))
        ));
        let only_b = vec![gpus(1000).remove(1)];
        assert_eq!(
            precheck(&m, &only_b, Some("580.2"), &[], &[], &[]),
            Err(PrecheckError::NoSuchGpu(u(A)))
        );
    }

    /// The failure paths after the CRIU restore, with the fake driver and CRIU: the restored tree
    /// (some contexts already live again) is suspended, verified and only then killed.
    pub(crate) mod after_restore {
        use cryo_criu::image::{ImageMeta, ProcessEntry, ProcessGpu, Staging};
        use cryo_criu::CriuVersion;
        use cryo_gpu::{CuResult, GpuInspector, ProcessState};
        use cryo_journal::Journal;
        use cryo_testkit::fake::{Call, FakeGpu, DEFAULT_BYTES, GPUS, MODEL};
        use cryo_testkit::fake_criu::FakeCriu;
        use cryo_testkit::procs::{self, Procs};
        use cryo_testkit::{eventually, PATIENCE};

        use super::*;
        use crate::NoProgress;

        /// A tree "in an image" (`dir/img`) that the fake CRIU "restores", and a journal
        /// (`dir/journal`).
        pub(crate) struct Scene {
            /// Keeps the tree alive (killed with its process group when dropped).
            _procs: Procs,
            /// Its processes, root first (the image's pids: CRIU restores them).
            pub(crate) pids: Vec<Pid>,
            pub(crate) fake: FakeGpu,
            pub(crate) criu: FakeCriu,
            pub(crate) dir: tempfile::TempDir,
            pub(crate) journal: Journal,
        }

        /// Two processes "in an image" (a root and its child): both CUDA processes, CHECKPOINTED,
        /// as CRIU brings them back.
        fn scene() -> Scene {
            scene_with(None)
        }

        /// [`scene`], with the first process's pid in the image replaced by `image_pid`.
        pub(crate) fn scene_with(image_pid: Option<Pid>) -> Scene {
            scene_of(Procs::session_tree(1), image_pid, &[true, true])
        }

        /// [`scene_of`], the image holding `files` (each a few bytes) beside its pages.
        pub(crate) fn scene_of_files(
            procs: Procs,
            image_pid: Option<Pid>,
            cuda: &[bool],
            files: &[&str],
        ) -> Scene {
            scene_built(procs, image_pid, cuda, files, usize::MAX)
        }

        /// The tree of `procs` in an image, the first process's pid there replaced by
        /// `image_pid`; the `i`th process of the tree (root first) is a CUDA process
        /// (CHECKPOINTED) if `cuda[i]`.
        pub(crate) fn scene_of(procs: Procs, image_pid: Option<Pid>, cuda: &[bool]) -> Scene {
            scene_built(procs, image_pid, cuda, &[], usize::MAX)
        }

        /// [`scene_of`], the manifest naming only the first `named` processes of the tree: the
        /// others are restored by the fake CRIU with them (as a process CRIU dumped that the
        /// manifest does not name), extras the pairing leaves out.
        pub(crate) fn scene_with_extras(procs: Procs, cuda: &[bool], named: usize) -> Scene {
            scene_built(procs, None, cuda, &[], named)
        }

        fn scene_built(
            procs: Procs,
            image_pid: Option<Pid>,
            cuda: &[bool],
            files: &[&str],
            named: usize,
        ) -> Scene {
            let pids = procs.tree();
            assert_eq!(pids.len(), cuda.len(), "{pids:?}");
            let fake = FakeGpu::new();
            for (p, _) in pids.iter().copied().zip(cuda).filter(|(_, c)| **c) {
                fake.add(p).set_state(p, ProcessState::Checkpointed);
            }
            let criu = FakeCriu::watching(&fake);
            criu.restores(&pids);
            let dir = tempfile::tempdir().unwrap();
            let staging = Staging::create(&dir.path().join("img")).unwrap();
            std::fs::write(staging.path().join("pages-1.img"), b"pages").unwrap();
            for f in files {
                std::fs::write(staging.path().join(f), b"file").unwrap();
            }
            let processes = pids
                .iter()
                .zip(cuda)
                .take(named)
                .map(|(&p, &cuda)| {
                    let mut e = ProcessEntry::of(&ProcHandle::open(p).unwrap()).unwrap();
                    if p == pids[0] {
                        e.pid = image_pid.unwrap_or(p);
                        e.nspid = vec![e.pid];
                    }
                    e.gpu = cuda.then(|| ProcessGpu {
                        state: ProcessState::Checkpointed,
                        devices: vec![DeviceUse {
                            uuid: GPUS[0].parse().unwrap(),
                            memory_bytes: DEFAULT_BYTES,
                        }],
                    });
                    e
                })
                .collect();
            staging
                .publish(
                    ImageMeta {
                        root_pid: pids[0],
                        processes,
                        zombies: Vec::new(),
                        threads: Vec::new(),
                        gpu_model: Some(MODEL.into()),
                        driver_version: Some(fake.driver_version().unwrap()),
                        criu_version: CriuVersion::MIN,
                        shrunk: None,
                    },
                    false,
                )
                .unwrap();
            let journal = Journal::open(dir.path().join("journal")).unwrap();
            Scene {
                _procs: procs,
                pids,
                fake,
                criu,
                dir,
                journal,
            }
        }

        impl Scene {
            fn thaw(&self) -> Result<ThawReport, ThawError> {
                self.thaw_watched(&crate::NoWatcher)
            }

            fn thaw_watched(&self, watcher: &dyn Watcher) -> Result<ThawReport, ThawError> {
                let opts = ThawOptions {
                    gpu_map: Vec::new(),
                    health: None,
                    health_timeout: Duration::from_secs(1),
                    stop: StopOptions {
                        suspend: crate::SuspendOptions {
                            verify_timeout: Duration::from_millis(300),
                            ..crate::SuspendOptions::default()
                        },
                        ..StopOptions::default()
                    },
                    requested: Instant::now(),
                    shrunk: None,
                    criu_timeout: None,
                };
                let fence = cryo_state::StateDir::new(self.dir.path()).fence();
                thaw(
                    &self.fake.gpu(),
                    &self.criu,
                    &self.dir.path().join("img"),
                    &opts,
                    &self.journal,
                    &fence,
                    watcher,
                    &NoProgress,
                )
            }

            /// Every journaled event's label, in order.
            pub(crate) fn labels(&self) -> Vec<&'static str> {
                cryo_journal::read(self.journal.dir())
                    .unwrap()
                    .records
                    .iter()
                    .map(|r| r.event.label())
                    .collect()
            }

            fn steps(&self, pid: Pid) -> Vec<&'static str> {
                cryo_journal::read(self.journal.dir())
                    .unwrap()
                    .records
                    .iter()
                    .filter(|r| r.event.pids().iter().any(|p| p.pid == pid))
                    .map(|r| r.event.label())
                    .collect()
            }

            /// Both gone, and each live context was suspended (checkpointed, verified) before its
            /// kill: the fake records no live restored context torn down.
            fn assert_removed_safely(&self, err: ThawError, step: &str) {
                match &err {
                    ThawError::AfterRestore {
                        step: s, cleanup, ..
                    } => {
                        assert_eq!(*s, step, "{err}");
                        assert_eq!(cleanup, "suspended and removed", "{err}");
                    }
                    other => panic!("expected a failure after the restore, got {other}"),
                }
                for p in self.pids.clone() {
                    assert!(!procs::alive(p), "pid {p} outlived the failed thaw");
                    assert_eq!(self.fake.state_of(p), ProcessState::Checkpointed);
                }
                assert!(self.fake.wedges().is_empty(), "{:?}", self.fake.wedges());
            }
        }

        /// One GPU restore fails while the other succeeds: the one whose context is live again
        /// (LOCKED) is checkpointed and verified before it is killed, the other killed as it is.
        #[test]
        fn a_gpu_restore_failure_ends_in_a_safe_stop() {
            let s = scene();
            let (p0, p1) = (s.pids[0], s.pids[1]);
            s.fake
                .fail_next_on(p1, Call::Restore, CuResult::OUT_OF_MEMORY);
            let err = s.thaw().unwrap_err();
            assert!(
                err.to_string().contains("CUDA_ERROR_OUT_OF_MEMORY"),
                "{err}"
            );
            s.assert_removed_safely(err, "GPU restore");
            assert_eq!(s.criu.restore_count(), 1);
            let steps = s.steps(p0);
            let at = |what: &str| steps.iter().position(|x| *x == what);
            assert!(
                at("checkpointed") < at("killed") && at("verified") < at("killed"),
                "{steps:?}"
            );
            assert!(at("checkpointed").is_some(), "{steps:?}");
        }

        /// The restored tree is not the image's (the image's root pid did not come back): the
        /// pairing fails at CRIU's gate, where nothing of the tree runs yet, and the restore is
        /// refused there (CRIU ends the tree); no context is asked to restore, the thaw is
        /// journaled as failed and nothing as restored.
        #[test]
        fn a_tree_that_cannot_be_paired_is_refused_at_criu_s_gate() {
            let mut gone = std::process::Command::new("true").spawn().unwrap();
            let free = gone.id() as Pid;
            gone.wait().unwrap();
            let s = scene_with(Some(free));
            let err = s.thaw().unwrap_err();
            match &err {
                ThawError::Criu(CriuError::Gate(e)) => {
                    assert!(e.contains(&format!("pid {free} of the image")), "{err}")
                }
                other => panic!("expected a refusal at CRIU's gate, got {other}"),
            }
            assert_eq!(s.criu.restore_count(), 1);
            assert!(
                !s.fake.calls().iter().any(|(_, c)| *c == Call::Restore),
                "{:?}",
                s.fake.calls()
            );
            let labels = s.labels();
            assert!(labels.contains(&"thaw failed"), "{labels:?}");
            assert!(
                !labels
                    .iter()
                    .any(|l| l.contains("restored") || l.starts_with("restore")),
                "{labels:?}"
            );
            for p in s.pids.clone() {
                assert_eq!(s.fake.state_of(p), ProcessState::Checkpointed);
            }
        }

        /// Attack (session 12): a thaw fails after CRIU's exit (a GPU restore runs out of
        /// memory) while the restored tree holds processes its image does not name (extras CRIU
        /// restored beside the image's, left out of the pairing at CRIU's gate: a plain one and
        /// one with a CUDA context, CHECKPOINTED). Nothing of the tree may be left running
        /// unowned: the extras are removed with the rest, each CUDA process suspended first, and
        /// no live context torn down. (Before: the stop took the paired processes only and the
        /// extras ran on, named nowhere.)
        #[test]
        fn a_failed_thaw_removes_the_processes_left_out_of_the_pairing_too() {
            let s = scene_with_extras(Procs::session_tree(3), &[true, true, true, false], 2);
            let (paired, extras) = (s.pids[..2].to_vec(), s.pids[2..].to_vec());
            s.fake
                .fail_next_on(paired[1], Call::Restore, CuResult::OUT_OF_MEMORY);
            let err = s.thaw().unwrap_err();
            match &err {
                ThawError::AfterRestore { step, cleanup, .. } => {
                    assert_eq!(*step, "GPU restore", "{err}");
                    assert_eq!(cleanup, "suspended and removed", "{err}");
                }
                other => panic!("expected a failure after the restore, got {other}"),
            }
            for p in paired.iter().chain(&extras) {
                assert!(!procs::alive(*p), "pid {p} outlived the failed thaw: {err}");
            }
            for p in paired.iter().chain(&extras[..1]) {
                assert_eq!(s.fake.state_of(*p), ProcessState::Checkpointed);
            }
            assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
        }

        /// Attack (session 13): the restored tree forks once CRIU resumed it, before the thaw
        /// fails (a GPU restore runs out of memory): the root forks a child that holds a CUDA
        /// context (RUNNING, as if restored: the worst case), and a helper that forks a
        /// grandchild and exits at once, so the grandchild is reparented out of the tree
        /// (only its session still ties it to the restored tree). None of them is in the tree
        /// CRIU's gate listed. A failed thaw leaves nothing of the image running that it does
        /// not name, and never kills a CUDA process that is not CHECKPOINTED. (Before: the stop
        /// took the gate's tree only; both forks ran on, owned and named by nothing.)
        #[test]
        fn a_failed_thaw_removes_what_the_tree_forked_after_criu_resumed_it() {
            let procs = Procs::session_script(
                "trap 'sleep 600 & sh -c \"sleep 601 &\"' USR1; sleep 600 & while :; do wait; done",
                2,
            );
            let root = procs.pid(0);
            eventually(PATIENCE, "the root's trap", || {
                procs::catches(root, nix::sys::signal::Signal::SIGUSR1 as i32)
            });
            let s = scene_of(procs, None, &[false, true]);
            let forked = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Pid>::new()));
            {
                let (fake, forked, gate) = (s.fake.clone(), forked.clone(), s.pids.clone());
                s.criu.on_resume(move || {
                    procs::kill(root, nix::sys::signal::Signal::SIGUSR1 as i32);
                    let child = eventually(PATIENCE, "the root's new child", || {
                        cryo_proc::tree(root).unwrap().into_iter().find(|p| {
                            !gate.contains(p)
                                && cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep")
                        })
                    });
                    fake.add(child).mark_restored(child);
                    let orphan = eventually(PATIENCE, "the orphaned grandchild", || {
                        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
                            let pid: Pid = e.file_name().to_str()?.parse().ok()?;
                            let st = cryo_proc::stat(pid).ok()?;
                            let cmd = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
                            (st.session == root && st.ppid != root && cmd == b"sleep\x00601\x00")
                                .then_some(pid)
                        })
                    });
                    forked.lock().unwrap().extend([child, orphan]);
                });
            }
            s.fake
                .fail_next_on(s.pids[1], Call::Restore, CuResult::OUT_OF_MEMORY);
            let err = s.thaw().unwrap_err();
            let forked = forked.lock().unwrap().clone();
            assert_eq!(forked.len(), 2, "the tree did not fork: {err}");
            match &err {
                ThawError::AfterRestore { step, cleanup, .. } => {
                    assert_eq!(*step, "GPU restore", "{err}");
                    assert!(cleanup.starts_with("suspended and removed"), "{err}");
                    for p in &forked {
                        assert!(cleanup.contains(&p.to_string()), "pid {p} not named: {err}");
                    }
                }
                other => panic!("expected a failure after the restore, got {other}"),
            }
            for p in s.pids.iter().chain(&forked) {
                assert!(!procs::alive(*p), "pid {p} outlived the failed thaw: {err}");
            }
            assert_eq!(s.fake.state_of(forked[0]), ProcessState::Checkpointed);
            assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
        }

        /// Attack (session 13): a thaw succeeds with processes CRIU restored beside the image's
        /// (extras the pairing leaves out: plain ones, as the freeze makes them). They run as
        /// part of the worker's tree, so the thaw names them where it names the image's: its
        /// report (`pids`, and `extras` apart), its `ThawCompleted`, and a `RestoreCompleted`
        /// each, so that a later stop knows them as restored. (Before: named nowhere.)
        #[test]
        fn a_thaw_reports_the_processes_restored_beside_the_image_s() {
            let s = scene_with_extras(Procs::session_tree(3), &[true, true, false, false], 2);
            let extras = s.pids[2..].to_vec();
            let ids: Vec<cryo_journal::ProcId> = s
                .pids
                .iter()
                .map(|p| id(&ProcHandle::open(*p).unwrap()))
                .collect();
            let report = s.thaw().unwrap_or_else(|e| panic!("{e}"));
            assert_eq!(report.extras, extras);
            assert_eq!(report.pids, s.pids);
            let records = cryo_journal::read(s.journal.dir()).unwrap().records;
            let completed: Vec<Vec<cryo_journal::ProcId>> = records
                .iter()
                .filter_map(|r| match &r.event {
                    Event::ThawCompleted { pids, .. } => Some(pids.clone()),
                    _ => None,
                })
                .collect();
            assert_eq!(completed, vec![ids.clone()]);
            let origins = cryo_journal::Origins::from_records(&records);
            for p in &ids[2..] {
                assert!(
                    matches!(origins.of(p), cryo_journal::Origin::Restored { .. }),
                    "{p:?} is not journaled restored"
                );
            }
        }

        /// The unlock fails after every GPU restore succeeded: every restored process (one of them
        /// RUNNING again) is suspended before the kill.
        #[test]
        fn an_unlock_failure_ends_in_a_safe_stop() {
            let s = scene();
            s.fake
                .fail_next_on(s.pids[1], Call::Unlock, CuResult::UNKNOWN);
            let err = s.thaw().unwrap_err();
            s.assert_removed_safely(err, "unlock");
            for p in s.pids.clone() {
                assert!(s.steps(p).contains(&"verified"), "{:?}", s.steps(p));
            }
        }

        /// A pid of the image is held by a zombie (the original exited, its parent has not
        /// reaped it): the thaw waits for the reaping, bounded, and then names the parent, not
        /// "in use"; reaped while it waits, the thaw goes on.
        #[test]
        fn a_zombie_holding_an_image_pid_is_waited_for_and_its_parent_named() {
            let mut original = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let zombie = original.id() as Pid;
            original.kill().unwrap();
            cryo_testkit::eventually(
                cryo_testkit::PATIENCE,
                "the original to be a zombie",
                || cryo_proc::liveness(zombie) == cryo_proc::Liveness::Zombie,
            );
            let s = scene_with(Some(zombie));
            let t = Instant::now();
            let err = s.thaw().unwrap_err();
            assert!(
                t.elapsed() >= crate::reaped::REAP_WAIT,
                "did not wait for the reaping"
            );
            let me = Pid::try_from(std::process::id()).unwrap();
            match &err {
                ThawError::Precheck(PrecheckError::Unreaped(held)) => assert!(
                    matches!(held[..], [cryo_proc::PidHolder::Zombie { pid, parent, .. }] if pid == zombie && parent == me),
                    "{held:?}"
                ),
                other => panic!("expected the unreaped zombie, got {other}"),
            }
            assert!(
                err.to_string().contains(&format!("parent, pid {me}")),
                "{err}"
            );
            assert_eq!(s.criu.restore_count(), 0);
            // Reaped while the thaw waits: it goes on and restores.
            let reaper = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(300));
                original.wait().unwrap();
            });
            // (What follows the CRIU restore does not matter here: the image's pid is not one
            // the fake CRIU brings back.)
            let r = s.thaw();
            assert!(
                !matches!(r, Err(ThawError::Precheck(_))),
                "refused after the reaping: {:?}",
                r.err()
            );
            reaper.join().unwrap();
            assert_eq!(s.criu.restore_count(), 1);
        }

        /// A watcher that records the state each process was in when asked to guard it, and
        /// fails when told to.
        struct Recorder<'a> {
            fake: &'a FakeGpu,
            seen: std::sync::Mutex<Vec<(Pid, ProcessState)>>,
            fail: bool,
        }

        impl<'a> Recorder<'a> {
            /// Records what the fake driver says of each process it is asked to guard; `fail`:
            /// then refuses, as a guard that cannot trace.
            fn new(fake: &'a FakeGpu, fail: bool) -> Self {
                Recorder {
                    fake,
                    seen: Default::default(),
                    fail,
                }
            }
        }

        impl crate::Watcher for Recorder<'_> {
            fn let_go(
                &self,
                _: cryo_journal::ProcId,
            ) -> Result<Option<crate::Lease<'_>>, crate::WatcherError> {
                Ok(None)
            }
            fn guard_before_unlock(
                &self,
                procs: &[&ProcHandle],
            ) -> Result<Coverage, crate::WatcherError> {
                for h in procs {
                    let st = self.fake.state_of(h.pid());
                    self.seen.lock().unwrap().push((h.pid(), st));
                }
                if self.fail {
                    return Err(crate::WatcherError::new(std::io::Error::other(
                        "ptrace refused",
                    )));
                }
                Ok(Coverage::Guarded)
            }
        }

        /// The guard is asked while every CUDA process is still LOCKED, before any unlock.
        #[test]
        fn every_cuda_process_is_guarded_while_locked() {
            let s = scene();
            let w = Recorder::new(&s.fake, false);
            let report = s.thaw_watched(&w).unwrap();
            assert!(report.guarded);
            let mut seen = w.seen.into_inner().unwrap();
            seen.sort_by_key(|(p, _)| *p);
            let mut expect: Vec<_> = s
                .pids
                .iter()
                .copied()
                .map(|p| (p, ProcessState::Locked))
                .collect();
            expect.sort_by_key(|(p, _)| *p);
            assert_eq!(seen, expect);
        }

        /// A guard that cannot trace them: nothing is unlocked; the tree is suspended and removed.
        #[test]
        fn a_guard_that_cannot_trace_ends_in_a_safe_stop_without_unlock() {
            let s = scene();
            let w = Recorder::new(&s.fake, true);
            let err = s.thaw_watched(&w).unwrap_err();
            assert!(err.to_string().contains("ptrace refused"), "{err}");
            s.assert_removed_safely(err, "guard before unlock");
            for p in s.pids.clone() {
                assert!(
                    !s.steps(p).iter().any(|x| x.starts_with("unlocked")),
                    "{:?}",
                    s.steps(p)
                );
                assert!(s.steps(p).contains(&"verified"), "{:?}", s.steps(p));
            }
        }

        /// The fake CRIU works: a thaw with nothing injected restores, unlocks and serves.
        #[test]
        fn a_thaw_with_no_failure_unlocks_every_process() {
            let s = scene();
            let report = s.thaw().unwrap();
            assert_eq!(report.gpu.len(), 2);
            for p in s.pids.clone() {
                assert!(procs::alive(p));
                assert_eq!(s.fake.state_of(p), ProcessState::Running);
            }
        }

        /// A plain process of the image exits between CRIU's gate and the GPU restore (it stays a
        /// zombie: its parent does not reap it): the thaw succeeds, and what it reports and
        /// journals as running is what the pidfds taken at the gate say, the CUDA root alone,
        /// never the exited child (which a look by its pid still finds, as a zombie or as
        /// another process that took its pid).
        #[test]
        fn a_plain_process_that_exits_before_the_gpu_restore_is_not_reported_running() {
            let s = scene_of(Procs::session_tree(1), None, &[true, false]);
            let (root, child) = (s.pids[0], s.pids[1]);
            s.criu.on_resume(move || {
                procs::kill(child, nix::libc::SIGKILL);
                eventually(PATIENCE, "the child to be a zombie", || {
                    procs::state(child) == Some('Z')
                });
            });
            let report = s.thaw().unwrap();
            assert_eq!(report.pids, vec![root]);
            let completed: Vec<Vec<Pid>> = cryo_journal::read(s.journal.dir())
                .unwrap()
                .records
                .into_iter()
                .filter_map(|r| match r.event {
                    Event::ThawCompleted { pids, .. } => Some(pids.iter().map(|p| p.pid).collect()),
                    _ => None,
                })
                .collect();
            assert_eq!(completed, vec![vec![root]]);
        }
    }
}
