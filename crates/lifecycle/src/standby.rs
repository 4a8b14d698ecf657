//! The pre-thawed standby: a worker restored from an image ahead of demand, without its GPU
//! restore, so that handing it out is only the driver's restore and unlock.
//!
//! # Design
//! - [`prepare`] does everything of a thaw that can be done before a request comes: the image is
//!   opened (trust, manifest, listing, sizes) and served to CRIU through cryo's streamer (every
//!   chunk checked before CRIU reads it); the host is checked as for a thaw ([`crate::precheck`]:
//!   the fence, the GPU model, the driver), except free device memory, which a claim checks; the
//!   host memory the standby will hold ([`cryo_proc::mem_available`]); and the pids. CRIU restores
//!   the tree as it was dumped: its CUDA processes come back CHECKPOINTED (the driver says so,
//!   or the standby is removed), their device memory in their host memory, no live context. Each
//!   is journaled [`Event::Parked`] (its device memory and GPUs, from the manifest), then the
//!   standby [`Event::StandbyReady`]: from then on it is a parked worker like any other, and
//!   [`claim`] is [`crate::wake`] (fence and free memory checked, `restore_context`, the
//!   [`Watcher`] traces it while LOCKED, unlock).
//! - **Pids and ports.** CRIU restores a process with the pids and listening addresses it had.
//!   More than one standby of an image therefore needs the worker to have run in its own pid and
//!   network namespaces (as in a container): CRIU then restores each standby into fresh ones
//!   (the same pids and ports inside, distinct on the host). An image's tree had a pid
//!   namespace of its own when its manifest's namespace pids say so (format 4 on,
//!   [`Manifest::own_pid_namespace`]) and a network namespace of its own when CRIU dumped one
//!   (`netns-*.img`); [`prepare`] refuses a second standby of an image without both
//!   ([`own_namespaces`]), and checks the pids of one that shares the host's pid namespace (as
//!   a thaw does).
//! - **Evidence, not assumptions.** [`claim`] reads the image's manifest again: a standby of an
//!   image that changed since (another digest) is stale and never handed out
//!   ([`ClaimError::Stale`]); the fence and the free memory are the wake's checks; a standby
//!   whose root or CUDA process is gone ([`ClaimError::Gone`]) is not woken (a plain process
//!   that exited while it waited, a helper of the worker, is left out of the claim), and what
//!   is left of it is removed when it is dropped ([`drop_standby`]).
//! - **Huge pages.** CRIU writes a restored process's memory back 4 KiB at a time, so memory the
//!   worker held in transparent huge pages (it asked with `MADV_HUGEPAGE`) comes back in small
//!   pages; the claim's GPU restore reads all of it. [`prepare`] collapses it into huge pages
//!   again (`process_madvise(MADV_COLLAPSE)`, best effort), before the standby is ready.
//! - A standby is removed with [`crate::stop`] (its contexts are CHECKPOINTED: verified, then
//!   killed); a standby killed while CHECKPOINTED tears nothing live down.
//! - **No half-restored leftovers.** CRIU restores the root as a sibling of itself, a child of
//!   the thread that runs [`prepare`]. A restore that ends after the gate ends the tree journaled
//!   there; one that ends before it (CRIU killed at its deadline) ends what CRIU added to that
//!   thread's children: it never ran, so no context of it is live. Both by the kernel's evidence
//!   (no driver fd, not listed by NVML), journaled [`Event::StandbyDropped`].
//!
//! - **Paired at CRIU's gate.** The restored tree is listed and paired with the image's
//!   processes where CRIU's gate holds it (every process restored, none run), as a thaw's
//!   (`GateTree` in [`crate::thaw`]), and held by pidfds from there on: once CRIU exits the tree
//!   runs, and a child that exits or forks, or a pid taken by another process, cannot make the
//!   pairing wrong or drop a sound standby. A tree that cannot be paired is refused at the gate
//!   (CRIU ends it; it never ran). A plain process of the image that exits once the tree runs is
//!   left out of the standby; a CUDA process (or the root) that exits drops it.
//!
//! # Limitations
//! The processes of a restored tree are paired as a thaw pairs them (by pid in cryo's pid
//! namespace, by namespace pid for a format-4 image of a tree with its own, else in fork order)
//! and checked by command name: a tree that cannot be told apart is refused, not guessed.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cryo_criu::image::{Image, ImageError, Manifest};
use cryo_criu::{Criu, CriuError, RestoreOpts};
use cryo_gpu::{Gpu, GpuInfo, ProcessState};
use cryo_journal::{Event, Journal, ProcId};
use cryo_proc::{Pid, ProcHandle};
use cryo_state::fence::{Fence, FenceError};
use cryo_units::fmt_bytes;

use crate::failpoint;
use crate::park::{wake, WakeError, WakeOptions, WakeReport};
use crate::progress::Progress;
use crate::stop::StopOptions;
use crate::suspend::id;
use crate::target::{Resolved, Target};
use crate::thaw::{pids_needed_taken, precheck, GateTree, PrecheckError};
use crate::watcher::Watcher;

/// How long a claim waits for the image's file system to answer its look at the manifest (is
/// the standby stale?): a claim is a request someone waits on, and a standby whose image cannot
/// be looked at is not handed out (it stays ready).
pub const CLAIM_IMAGE_LOOK: Duration = Duration::from_secs(10);

/// Failpoint: a standby's image is opened and checked, CRIU not started (tests kill the agent
/// here: a refill cut short).
pub const STANDBY_BEFORE_RESTORE: &str = "standby-before-restore";

/// Failpoint: CRIU restored the standby and its processes are journaled `Parked`, its
/// `StandbyReady` is not written yet (tests kill the agent here: the orphan window).
pub const STANDBY_BEFORE_READY: &str = "standby-before-ready";

/// Failpoint: CRIU restored the standby and its tree is journaled `StandbyRestoring`; CRIU waits
/// at its gate until the file named by `CRYO_FAILPOINT_RESUME` exists (tests let CRIU's deadline
/// pass here).
pub const STANDBY_AT_GATE: &str = "standby-at-gate";

/// What a pool keeps, as journaled (`StandbyPool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PoolConfig {
    /// How many standbys to keep ready.
    pub count: u32,
    /// The deadline of each standby's CRIU restore; `None`: [`crate::criu_deadline`] of the
    /// image's size.
    pub criu_timeout: Option<Duration>,
}

/// A standby ready for a claim.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Standby {
    /// The image it came from.
    pub image: PathBuf,
    /// The image's manifest digest then.
    pub digest: String,
    /// Its root.
    pub root: ProcId,
    /// Every process of it, root first: the image's, then those CRIU restored beside them
    /// (processes it dumped that the manifest does not name, left out of the pairing).
    pub pids: Vec<ProcId>,
    /// Those of `pids` without CUDA state, the root aside (a worker's helpers, and the processes
    /// restored beside the image's): one that exits
    /// is the worker's business and left out of the claim, as a thaw leaves it out. Absent
    /// (a standby said by an older record or agent): every process is needed.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub plain: Vec<ProcId>,
    /// Host memory it holds (resident), bytes.
    pub host_bytes: u64,
    /// Device memory it will take on the GPU, bytes.
    pub device_bytes: u64,
    /// The CRIU restore, ms.
    pub criu_ms: u64,
}

/// Why this host cannot take one more standby of the image; nothing was restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StandbyRefusal {
    /// The image shares the host's pid and network namespaces, and a standby of it exists (or
    /// the image's pids are taken).
    #[error("a standby of {image} already holds its pids and ports: more than one standby of an image needs the worker to run in its own pid and network namespaces (as in a container) when it is frozen")]
    SharedNamespaces {
        /// The image.
        image: PathBuf,
    },
    /// The host has too little memory available for the standby's host memory.
    #[error("a standby of this image holds about {} of host memory and the host has {} available", fmt_bytes(*.needed), fmt_bytes(*.available))]
    HostMemory {
        /// Bytes it needs.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// The thaw's prechecks refuse it.
    #[error(transparent)]
    Precheck(#[from] PrecheckError),
}

/// No standby was made.
#[derive(Debug, thiserror::Error)]
pub enum StandbyError {
    /// The image is not usable (names the file and the reason).
    #[error("image refused: {0}")]
    Image(#[from] ImageError),
    /// This host cannot take it.
    #[error("standby refused: {0}")]
    Refused(#[from] StandbyRefusal),
    /// The quarantine could not be read: every GPU counts as fenced.
    #[error("cannot read the GPU quarantine, so every GPU counts as fenced: {0}")]
    Fence(#[from] FenceError),
    /// The GPUs could not be inspected.
    #[error("cannot inspect the GPUs: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// The host could not be read.
    #[error("cannot read the host: {0}")]
    Host(#[from] cryo_proc::ProcError),
    /// The journal could not be written.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// CRIU could not restore the tree (it removed what it half-restored).
    #[error("{0}")]
    Criu(#[from] CriuError),
    /// The restored tree is not a standby; it was removed (or left as `cleanup` says).
    #[error("{error}; the restored tree was {cleanup}")]
    AfterRestore {
        /// What was wrong.
        error: String,
        /// What became of it.
        cleanup: String,
    },
}

impl StandbyError {
    /// Whether the host refused it (nothing was restored), as opposed to a failure.
    pub fn is_refusal(&self) -> bool {
        matches!(self, StandbyError::Image(_) | StandbyError::Refused(_))
    }
}

/// Whether the image's tree had pid and network namespaces of its own, so that CRIU restores
/// each standby into fresh ones (pids and ports of its own on the host): its manifest's
/// namespace pids name a namespace of its own ([`Manifest::own_pid_namespace`], format 4 on;
/// an older image says nothing, and counts as sharing the host's), and CRIU dumped its network
/// namespace (`netns-*.img`). A network namespace alone leaves every standby the same host pids.
pub fn own_namespaces(manifest: &Manifest) -> bool {
    manifest.own_pid_namespace() && manifest.files.iter().any(|f| f.name.starts_with("netns-"))
}

/// Restores one standby of the image at `dir` (see the module docs). `others`: how many
/// standbys of it exist already; `criu_timeout`: the deadline of CRIU's restore (`None`:
/// [`crate::criu_deadline`] of the image's size).
#[allow(clippy::too_many_arguments)]
pub fn prepare(
    gpu: &Gpu,
    criu: &dyn Criu,
    dir: &Path,
    others: usize,
    criu_timeout: Option<Duration>,
    journal: &Journal,
    fence: &Fence,
    progress: &dyn Progress,
) -> Result<Standby, StandbyError> {
    let gpu = &gpu.bounded(cryo_gpu::Limits::default());
    // Under the restore's deadline, as a thaw's first look ([`crate::open_image`]): an image
    // whose file system does not answer is refused then, not waited for by the refill.
    let limit = criu_timeout.unwrap_or_else(|| crate::criu_deadline(0));
    let opened = Image::open_until(dir, Some(Instant::now() + limit))?;
    let manifest = opened.manifest().clone();
    let namespaced = own_namespaces(&manifest);
    if !namespaced && others > 0 {
        return Err(StandbyRefusal::SharedNamespaces {
            image: dir.to_path_buf(),
        }
        .into());
    }
    // As a thaw: the image's pids, unless its tree had a pid namespace of its own.
    let in_use = pids_needed_taken(criu, &manifest).map_err(StandbyRefusal::Precheck)?;
    let fenced = fence.list()?;
    // Free device memory is the claim's check: a standby holds none.
    let gpus: Vec<GpuInfo> = gpu
        .inspect
        .gpus()?
        .into_iter()
        .map(|g| GpuInfo {
            memory_free: u64::MAX,
            ..g
        })
        .collect();
    let driver = if manifest.cuda_processes().next().is_some() {
        Some(gpu.inspect.driver_version()?)
    } else {
        None
    };
    precheck(&manifest, &gpus, driver.as_deref(), &[], &fenced, &in_use)
        .map_err(StandbyRefusal::Precheck)?;
    let available = cryo_proc::mem_available()?;
    if manifest.total_bytes > available {
        return Err(StandbyRefusal::HostMemory {
            needed: manifest.total_bytes,
            available,
        }
        .into());
    }

    failpoint::stall_if(STANDBY_BEFORE_RESTORE);
    let t = Instant::now();
    progress.begin(manifest.root_pid, "criu restore", manifest.total_bytes);
    let image = dir.display().to_string();
    // The intent, at CRIU's gate: every process restored, none run. An agent that dies after
    // this record and before the standby's `StandbyReady` leaves an unfinished standby that the
    // next one ends or guards ([`sweep`]); one that dies before it makes CRIU abort the restore.
    // The tree as journaled at the gate: what a restore that fails after it (CRIU killed at its
    // deadline) leaves behind, never run, in namespaces CRIU's own clean-up cannot see.
    // The tree is listed and paired with the image there, as a thaw's ([`GateTree`]): a tree
    // that cannot be paired is refused at the gate (CRIU ends it, it never ran, nothing is
    // journaled); one that can is held by pidfds from there on, never listed again once it runs.
    let gated: std::sync::Mutex<Vec<ProcId>> = std::sync::Mutex::new(Vec::new());
    let listed: std::sync::OnceLock<GateTree> = std::sync::OnceLock::new();
    let at_gate = |root: Pid| -> Result<(), String> {
        let gate = GateTree::list(root, &manifest)?;
        let pids: Vec<ProcId> = gate.tree.handles().iter().map(id).collect();
        journal
            .append(Event::StandbyRestoring {
                image: image.clone(),
                root: pids[0],
                pids: pids.clone(),
            })
            .map(drop)
            .map_err(|e| format!("cannot journal the restored standby: {e}"))?;
        *gated.lock().unwrap_or_else(|p| p.into_inner()) = pids;
        let _ = listed.set(gate);
        failpoint::pause_if(STANDBY_AT_GATE);
        Ok(())
    };
    let restore_opts = RestoreOpts {
        deadline: Some(criu_timeout.unwrap_or_else(|| crate::criu_deadline(manifest.total_bytes))),
        ..RestoreOpts::default()
    };
    let restored = criu.restore_gated(&opened, &restore_opts, &at_gate);
    progress.end(
        manifest.root_pid,
        "criu restore",
        restored.is_ok(),
        &format!("{} ms", t.elapsed().as_millis()),
    );
    let gated = gated.into_inner().unwrap_or_else(|p| p.into_inner());
    let restored = match (restored, gated.first()) {
        (Ok(r), _) => r,
        // Past the gate: the tree was journaled `StandbyRestoring`; it never ran.
        (Err(e), Some(root)) => {
            let cleanup = end_unresumed(gpu, &gated);
            let error = e.to_string();
            if let Err(j) = journal.append(Event::StandbyDropped {
                image,
                root: *root,
                reason: format!("{error}; the restored tree (never run) was {cleanup}"),
            }) {
                tracing::error!(error = %j, "cannot journal the dropped standby");
            }
            return Err(StandbyError::AfterRestore { error, cleanup });
        }
        // Before the gate (CRIU killed at its deadline): what it restored half-way never ran,
        // so no context of it is live (the image's are checkpointed); the CRIU wrapper ended
        // it by the kernel's evidence (its host identities, never the image's pids). Said.
        (Err(e), None) => {
            if let CriuError::TimedOut { killed, left, .. } = &e {
                if let Some(&(pid, start_time)) = killed.first() {
                    let cleanup = if left.is_empty() {
                        format!("killed ({} processes)", killed.len())
                    } else {
                        format!("NOT all killed: {}", left.join("; "))
                    };
                    let error = e.to_string();
                    if let Err(j) = journal.append(Event::StandbyDropped {
                        image,
                        root: ProcId::new(pid, start_time),
                        reason: format!(
                            "{error}; CRIU ended before its gate: the half-restored tree (never run) was {cleanup}"
                        ),
                    }) {
                        tracing::error!(error = %j, "cannot journal the dropped standby");
                    }
                    return Err(StandbyError::AfterRestore { error, cleanup });
                }
            }
            return Err(match e {
                CriuError::Image(e) => StandbyError::Image(e),
                e => e.into(),
            });
        }
    };
    let criu_ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
    if let Err(e) = journal.append(Event::CriuRestored {
        image: image.clone(),
        ms: criu_ms,
    }) {
        tracing::error!(error = %e, "cannot journal the CRIU restore");
    }
    // The tree listed at the gate is the one that runs; from here on, a failure removes it.
    let gate = match GateTree::resumed(listed.into_inner(), restored.pid) {
        Ok(gate) => gate,
        Err((error, tree)) => {
            let cleanup = remove(gpu, &tree, journal, progress);
            if let Some(root) = tree.handles().first() {
                let _ = journal.append(Event::StandbyDropped {
                    image,
                    root: id(root),
                    reason: format!("{error}; the restored tree was {cleanup}"),
                });
            }
            return Err(StandbyError::AfterRestore { error, cleanup });
        }
    };
    let root_id = gate.tree.handles().first().map(id);
    let tree = &gate.tree;
    // The processes CRIU restored beside the image's (the pairing left them out) are the
    // standby's too, plain: nothing else owns them, so its drop removes them with the rest.
    let kept =
        keep(gpu, &gate.paired, &manifest, &image, journal).and_then(|(mut pids, mut plain)| {
            let extras = gate
                .extras()
                .map_err(|e| format!("holding the processes restored beside the image's: {e}"))?;
            for h in extras.iter().filter(|h| h.is_alive()) {
                pids.push(id(h));
                plain.push(id(h));
            }
            Ok((pids, plain))
        });
    if kept.is_ok() {
        // CRIU wrote the memory back in 4 KiB pages: what the worker had in huge pages goes back
        // into huge pages now, off the request path (the claim's GPU restore reads all of it:
        // measured 2.3x slower from small pages at 4 GiB, `cryo bench activate`).
        let t = Instant::now();
        let huge: u64 = tree
            .handles()
            .iter()
            .filter_map(|h| h.collapse_huge_pages().ok())
            .sum();
        tracing::info!(huge = %fmt_bytes(huge), ms = t.elapsed().as_millis() as u64, "standby memory in huge pages again");
        failpoint::stall_if(STANDBY_BEFORE_READY);
    }
    match kept {
        Ok((pids, plain)) => {
            let host_bytes = tree.handles().iter().map(|h| h.rss().unwrap_or(0)).sum();
            let standby = Standby {
                image: dir.to_path_buf(),
                digest: manifest.manifest_sha256.clone(),
                root: pids[0],
                pids,
                plain,
                host_bytes,
                device_bytes: manifest
                    .cuda_processes()
                    .flat_map(|(_, g)| g.devices.iter().map(|d| d.memory_bytes))
                    .sum(),
                criu_ms,
            };
            journal.append(Event::StandbyReady {
                image,
                digest: standby.digest.clone(),
                root: standby.root,
                pids: standby.pids.clone(),
            })?;
            Ok(standby)
        }
        Err(error) => {
            let cleanup = remove(gpu, tree, journal, progress);
            if let Some(root) = root_id {
                let _ = journal.append(Event::StandbyDropped {
                    image,
                    root,
                    reason: format!("{error}; the restored tree was {cleanup}"),
                });
            }
            Err(StandbyError::AfterRestore { error, cleanup })
        }
    }
}

/// Checks the restored tree (`paired`: the image's processes as paired at CRIU's gate, each
/// with its pid in the image) against the manifest (every CUDA process CHECKPOINTED) and
/// journals each CUDA process as parked; the standby's processes, root first. The tree has run
/// since CRIU's exit, so each is judged by its pidfd: a CUDA process, or the root, that exited
/// fails the standby (the driver was asked by pid: its answer may be of another process); any
/// other process that exited is the worker's business and left out. The second list: those
/// of the first without CUDA state, the root aside ([`Standby::plain`]).
fn keep(
    gpu: &Gpu,
    paired: &[(ProcHandle, Pid)],
    manifest: &Manifest,
    image: &str,
    journal: &Journal,
) -> Result<(Vec<ProcId>, Vec<ProcId>), String> {
    let root = paired
        .first()
        .map(|(h, _)| h.pid())
        .ok_or_else(|| "no restored process".to_string())?;
    let mut handles: Vec<&ProcHandle> = Vec::with_capacity(paired.len());
    let mut plain = Vec::new();
    let mut parked = Vec::new();
    for (h, image_pid) in paired {
        let e = manifest
            .processes
            .iter()
            .find(|e| e.pid == *image_pid)
            .ok_or_else(|| format!("pid {image_pid} is not in the image"))?;
        let Some(g) = &e.gpu else {
            if h.is_alive() {
                handles.push(h);
                if h.pid() != root {
                    plain.push(id(h));
                }
            } else if h.pid() == root {
                return Err(format!("the restored root pid {root} exited"));
            }
            continue;
        };
        let state = gpu.driver.state(h.pid());
        if !h.is_alive() {
            return Err(format!(
                "restored pid {} (a CUDA process of the image) exited",
                h.pid()
            ));
        }
        handles.push(h);
        match state {
            Ok(ProcessState::Checkpointed) => {}
            Ok(s) => {
                return Err(format!(
                    "restored pid {} is {s:?}, not CHECKPOINTED: the image was not frozen by cryo",
                    h.pid()
                ))
            }
            Err(err) => return Err(format!("asking the driver about pid {}: {err}", h.pid())),
        }
        parked.push(Event::Parked {
            pid: id(h),
            bytes: g.devices.iter().map(|d| d.memory_bytes).sum(),
            gpus: g.devices.iter().map(|d| d.uuid.to_string()).collect(),
            gpu_bytes: g.devices.iter().map(|d| d.memory_bytes).collect(),
        });
    }
    for p in parked {
        journal.append(p).map_err(|e| e.to_string())?;
    }
    // Frozen after a shrink: these processes' engine is shrunk as the image records, so the
    // claim's wake grows it (it reads the journal's `shrink_completed` for them).
    if let Some(frozen) = &manifest.shrunk {
        journal
            .append(Event::ShrinkCompleted {
                target: image.to_owned(),
                pids: handles.iter().map(|h| id(h)).collect(),
                spec: frozen.spec.clone(),
                engine: frozen.engine.clone(),
                outcome: frozen.outcome.clone(),
                error: None,
                ms: 0,
            })
            .map_err(|e| e.to_string())?;
    }
    tracing::debug!(root, image, "standby kept");
    Ok((handles.iter().map(|h| id(h)).collect(), plain))
}

/// Ends what a CRIU restore that failed past its gate left of a standby's tree (`pids`, as
/// journaled there): processes that never ran, so the driver cannot answer for them (their
/// restore thread never started) and the kernel's evidence decides, as for any unresumed
/// restore: one that holds no driver fd and that NVML does not list has no context, and is
/// SIGKILLed; anything else is left alone and named. Says what became of them.
fn end_unresumed(gpu: &Gpu, pids: &[ProcId]) -> String {
    let handles: Vec<ProcHandle> = pids
        .iter()
        .filter_map(|p| ProcHandle::open_expected(p.pid, p.start_time).ok())
        .filter(ProcHandle::is_alive)
        .collect();
    if handles.is_empty() {
        return "already gone".into();
    }
    let listed = gpu.inspect.processes();
    let mut left = Vec::new();
    let mut killed = Vec::new();
    for h in &handles {
        let pid = h.pid();
        let evidence = match (&listed, gpu.inspect.driver_fds(pid)) {
            (Err(e), _) => Err(format!("NVML cannot list the GPU processes ({e})")),
            (_, Err(e)) => Err(format!("its driver fds cannot be read ({e})")),
            (Ok(l), Ok(fds)) if fds.is_empty() && !l.iter().any(|p| p.pid == pid) => Ok(()),
            (Ok(_), Ok(fds)) => Err(format!("it holds driver fds {fds:?} or NVML lists it")),
        };
        match evidence.and_then(|()| {
            h.signal(cryo_proc::Signal::SIGKILL)
                .map_err(|e| format!("cannot kill it: {e}"))
        }) {
            Ok(()) => killed.push(h),
            Err(why) => left.push(format!("pid {pid}: {why}, left alone")),
        }
    }
    // Their parent (the caller, for the root: CRIU restores it as our child) reaps them.
    let deadline = Instant::now() + Duration::from_secs(10);
    while killed.iter().any(|h| h.is_alive()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    for h in killed.iter().filter(|h| h.is_alive()) {
        left.push(format!("pid {}: still alive 10 s after SIGKILL", h.pid()));
    }
    if left.is_empty() {
        format!("killed ({} processes)", killed.len())
    } else {
        format!("NOT all killed: {}", left.join("; "))
    }
}

/// What [`remove`] and [`drop_standby`] say of a standby none of whose processes runs.
pub const ALREADY_GONE: &str = "already gone";

/// Removes a standby's processes through the stop path (their contexts are CHECKPOINTED:
/// verified again, then killed), and what its tree forked since it was restored (its plain
/// processes run while it waits: [`crate::thaw::remove_with_forks`]); says what became of
/// them, the forks named.
pub fn remove(gpu: &Gpu, tree: &Resolved, journal: &Journal, progress: &dyn Progress) -> String {
    let opts = StopOptions {
        deadline: None,
        ..StopOptions::default()
    };
    // What its tree forked since (a ready standby's plain processes run) is removed with it.
    let r = crate::thaw::remove_with_forks(gpu, tree, &opts, journal, progress);
    let forks = r.forks("it was restored");
    match r.failure {
        Some(failed) => format!("{failed}{forks}"),
        None if r.stopped => format!("removed{forks}"),
        None if forks.is_empty() => ALREADY_GONE.into(),
        None => format!("{ALREADY_GONE}{forks}"),
    }
}

/// The standby's processes that still run, opened by pid and start time, root first; and the
/// first it cannot be handed out without (its root, a CUDA process) that is gone, if any. A
/// plain process that exited ([`Standby::plain`]) is only left out.
fn live(standby: &Standby) -> (Vec<ProcHandle>, Option<Pid>) {
    let mut handles = Vec::with_capacity(standby.pids.len());
    let mut gone = None;
    for p in &standby.pids {
        match p.open().ok().filter(ProcHandle::is_alive) {
            Some(h) => handles.push(h),
            None if standby.plain.contains(p) => {
                tracing::debug!(
                    pid = p.pid,
                    "a plain process of the standby exited: left out"
                );
            }
            None => {
                gone.get_or_insert(p.pid);
            }
        }
    }
    (handles, gone)
}

/// Whether every CUDA process of the standby is CHECKPOINTED, as the driver says (`Err`: what
/// was found instead): what an agent that starts again checks before it adopts a standby.
/// Asked of the standby's processes that still run (each opened by pid and start time) and
/// not of its plain ones ([`Standby::plain`]: no CUDA state to ask about); an answer counts
/// only if its process was still alive after it, so the pid was still its own. A process that
/// exited gave its pid away: the driver's answer for that pid is of whoever holds it now.
pub fn still_checkpointed(gpu: &Gpu, standby: &Standby) -> Result<(), String> {
    let (handles, _) = live(standby);
    for h in handles.iter().filter(|h| !standby.plain.contains(&id(h))) {
        let state = gpu.driver.state(h.pid());
        if !h.is_alive() {
            continue;
        }
        match state {
            Ok(ProcessState::Checkpointed) => {}
            Ok(other) => return Err(format!("pid {} is {other:?}", h.pid())),
            // A process without CUDA state (a launcher) answers an error: not a context.
            Err(_) => {}
        }
    }
    Ok(())
}

/// The processes of `handles` as a target of pids.
fn as_target(handles: Vec<ProcHandle>) -> Resolved {
    Resolved::from_handles(
        Target::Pids(handles.iter().map(ProcHandle::pid).collect()),
        handles,
    )
}

/// The standby as it can be handed out: its processes that still run, opened by pid and start
/// time; `None` when its root or a CUDA process of it is gone (a plain one that exited is left
/// out).
pub fn open(standby: &Standby) -> Option<Resolved> {
    match live(standby) {
        (handles, None) => Some(as_target(handles)),
        (_, Some(_)) => None,
    }
}

/// Removes what still runs of a standby that leaves its pool (see [`remove`]), a standby that
/// lost its root or a CUDA process included: what is left of it is owned by nothing else. Says
/// what became of it.
pub fn drop_standby(
    gpu: &Gpu,
    standby: &Standby,
    journal: &Journal,
    progress: &dyn Progress,
) -> String {
    let (handles, _) = live(standby);
    remove(gpu, &as_target(handles), journal, progress)
}

/// A standby CRIU restored whose preparation did not finish (its agent died between the
/// restore and `StandbyReady`): journaled `StandbyRestoring`, never `StandbyReady` or
/// `StandbyDropped`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unfinished {
    /// The image directory.
    pub image: String,
    /// Its root.
    pub root: ProcId,
    /// Every process restored, root first.
    pub pids: Vec<ProcId>,
}

/// The unfinished standbys the journal names (see [`Unfinished`]).
pub fn unfinished(records: &[cryo_journal::Record]) -> Vec<Unfinished> {
    let mut open: Vec<Unfinished> = Vec::new();
    for r in records {
        match &r.event {
            Event::StandbyRestoring { image, root, pids } => open.push(Unfinished {
                image: image.clone(),
                root: *root,
                pids: pids.clone(),
            }),
            Event::StandbyReady { root, .. } | Event::StandbyDropped { root, .. } => {
                open.retain(|u| u.root != *root);
            }
            _ => {}
        }
    }
    open
}

/// Finishes an unfinished standby and journals `StandbyDropped` with what became of it. A
/// process of it is ended only once the driver says its context is CHECKPOINTED (or that it
/// holds none: [`crate::classify`]), through the stop path, which verifies again before it
/// kills; if any process has a live context or cannot be judged, nothing is killed and those
/// processes are traced by `watcher` (the guard) instead.
pub fn sweep(
    gpu: &Gpu,
    u: &Unfinished,
    journal: &Journal,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> String {
    let handles: Vec<ProcHandle> = u
        .pids
        .iter()
        .filter_map(|p| p.open().ok())
        .filter(ProcHandle::is_alive)
        .collect();
    let what = if handles.is_empty() {
        "already gone".to_string()
    } else {
        let listed = gpu.inspect.processes();
        let mut live: Vec<(&ProcHandle, String)> = Vec::new();
        for h in &handles {
            let class = match &listed {
                Ok(l) => crate::classify(gpu, h, l, crate::cuda::SETTLE).map_err(|e| e.to_string()),
                Err(e) => Err(format!("NVML cannot list the GPU processes: {e}")),
            };
            match class {
                Ok(crate::Class::Cuda {
                    state: ProcessState::Checkpointed,
                })
                | Ok(
                    crate::Class::Plain | crate::Class::DriverOnly { .. } | crate::Class::Exited,
                ) => {}
                Ok(crate::Class::Cuda { state }) => {
                    live.push((h, format!("pid {} is {state:?}", h.pid())));
                }
                Err(e) => live.push((h, e)),
            }
        }
        if live.is_empty() {
            let tree = Resolved::from_handles(
                Target::Pids(handles.iter().map(ProcHandle::pid).collect()),
                handles,
            );
            format!(
                "every context CHECKPOINTED: {}",
                remove(gpu, &tree, journal, progress)
            )
        } else {
            let why: Vec<String> = live.iter().map(|(_, w)| w.clone()).collect();
            let procs: Vec<&ProcHandle> = live.iter().map(|(h, _)| *h).collect();
            match watcher.guard_before_unlock(&procs) {
                Ok(crate::Coverage::Guarded) => {
                    format!("NOT killed ({}): left alive and guarded", why.join("; "))
                }
                Ok(crate::Coverage::NoGuard) => {
                    format!("NOT killed ({}): left alive; no guard runs", why.join("; "))
                }
                Err(e) => format!(
                    "NOT killed ({}): left alive, and the guard could not trace it: {e}",
                    why.join("; ")
                ),
            }
        }
    };
    let reason = format!("unfinished when its agent died (restored, never ready): {what}");
    if let Err(e) = journal.append(Event::StandbyDropped {
        image: u.image.clone(),
        root: u.root,
        reason: reason.clone(),
    }) {
        tracing::error!(error = %e, "cannot journal the end of an unfinished standby");
    }
    reason
}

/// The standby was not handed out.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// The image changed since the standby was restored: it is never handed out.
    #[error("the standby of {} is stale: the image changed since it was restored (manifest {found}, the standby's {had})", .image.display())]
    Stale {
        /// The image.
        image: PathBuf,
        /// The digest the standby came from.
        had: String,
        /// The image's digest now.
        found: String,
    },
    /// The image cannot be read any more (removed, no longer trusted).
    #[error("image refused: {0}")]
    Image(#[from] ImageError),
    /// The standby's root or a CUDA process of it is gone.
    #[error("standby pid {0} is gone")]
    Gone(Pid),
    /// The wake failed (see its error: a refusal restored nothing).
    #[error(transparent)]
    Wake(#[from] WakeError),
}

/// Hands `standby` out: checks the image is the one it came from, then wakes it (see
/// [`crate::wake`]) and journals [`Event::StandbyClaimed`].
#[allow(clippy::too_many_arguments)]
pub fn claim(
    gpu: &Gpu,
    standby: &Standby,
    opts: &WakeOptions,
    journal: &Journal,
    state: &cryo_state::StateDir,
    watcher: &dyn Watcher,
    progress: &dyn Progress,
) -> Result<WakeReport, ClaimError> {
    let mut watch = crate::progress::Stopwatch::default();
    let now = Image::open_until(&standby.image, Some(Instant::now() + CLAIM_IMAGE_LOOK))?;
    let found = &now.manifest().manifest_sha256;
    if *found != standby.digest {
        return Err(ClaimError::Stale {
            image: standby.image.clone(),
            had: standby.digest.clone(),
            found: found.clone(),
        });
    }
    watch.mark("claim: image manifest check");
    let tree = match live(standby) {
        (handles, None) => as_target(handles),
        (_, Some(pid)) => return Err(ClaimError::Gone(pid)),
    };
    watch.mark("claim: open the processes (pidfds)");
    let mut report = wake(gpu, &tree, opts, journal, state, watcher, progress)?;
    let mut after = crate::progress::Stopwatch::default();
    if let Err(e) = journal.append(Event::StandbyClaimed {
        image: standby.image.display().to_string(),
        root: standby.root,
    }) {
        // The worker serves: a journal that cannot take the record must not fail the claim.
        tracing::error!(error = %e, "cannot journal the claim");
    }
    after.mark("journal: standby claimed");
    let mut phases = watch.phases.0;
    phases.append(&mut report.phases.0);
    phases.append(&mut after.phases.0);
    report.phases = crate::progress::Phases(phases);
    Ok(report)
}

/// What the journal says of the standbys: the pools (image -> count kept ready) and every
/// standby ready and not yet claimed or dropped (whether or not it still lives; its sizes are
/// not journaled and read 0).
pub fn from_journal(
    records: &[cryo_journal::Record],
) -> (
    std::collections::BTreeMap<PathBuf, PoolConfig>,
    Vec<Standby>,
) {
    let mut pools = std::collections::BTreeMap::new();
    let mut ready: Vec<Standby> = Vec::new();
    // The CUDA processes of a standby are journaled `Parked` before its `StandbyReady`.
    let mut parked: Vec<ProcId> = Vec::new();
    for r in records {
        match &r.event {
            Event::Parked { pid, .. } => parked.push(*pid),
            Event::StandbyPool {
                image,
                count,
                criu_timeout_s,
            } => {
                if *count == 0 {
                    pools.remove(&PathBuf::from(image));
                } else {
                    pools.insert(
                        PathBuf::from(image),
                        PoolConfig {
                            count: *count,
                            criu_timeout: criu_timeout_s.map(Duration::from_secs),
                        },
                    );
                }
            }
            Event::StandbyReady {
                image,
                digest,
                root,
                pids,
            } => ready.push(Standby {
                image: PathBuf::from(image),
                digest: digest.clone(),
                root: *root,
                pids: pids.clone(),
                plain: pids
                    .iter()
                    .filter(|p| *p != root && !parked.contains(p))
                    .copied()
                    .collect(),
                host_bytes: 0,
                device_bytes: 0,
                criu_ms: 0,
            }),
            Event::StandbyClaimed { root, .. } | Event::StandbyDropped { root, .. } => {
                ready.retain(|s| s.root != *root);
            }
            _ => {}
        }
    }
    (pools, ready)
}

/// One image's standbys as the journal and `/proc` show them now (no driver call), for
/// `cryo status` and the agent's gauges.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PoolNow {
    /// The image.
    pub image: PathBuf,
    /// How many the pool keeps ready (0: the pool was removed, these are left over).
    pub count: u32,
    /// The standbys alive now: each ready (every context CHECKPOINTED, off the GPU).
    pub ready: Vec<StandbyNow>,
    /// Host memory they hold now (resident), bytes.
    pub host_bytes: u64,
    /// Device memory they will take when claimed, bytes.
    pub device_bytes: u64,
}

/// One standby alive now.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct StandbyNow {
    /// Its root.
    pub root: ProcId,
    /// How many processes it has.
    pub processes: usize,
    /// Host memory it holds now (resident), bytes.
    pub host_bytes: u64,
    /// Device memory it will take when claimed, bytes.
    pub device_bytes: u64,
}

/// The pools and their standbys alive now, from the journal's records and `/proc`.
pub fn pools_now(records: &[cryo_journal::Record]) -> Vec<PoolNow> {
    let (counts, ready) = from_journal(records);
    let parked = crate::park::parked_records(records);
    let mut pools: std::collections::BTreeMap<PathBuf, PoolNow> = counts
        .into_iter()
        .map(|(image, count)| {
            (
                image.clone(),
                PoolNow {
                    image,
                    count: count.count,
                    ready: Vec::new(),
                    host_bytes: 0,
                    device_bytes: 0,
                },
            )
        })
        .collect();
    for s in ready {
        let Some(tree) = open(&s) else { continue };
        let host_bytes = tree.handles().iter().map(|h| h.rss().unwrap_or(0)).sum();
        let device_bytes = s
            .pids
            .iter()
            .filter_map(|p| parked.get(p))
            .map(|p| p.device_bytes)
            .sum();
        let pool = pools.entry(s.image.clone()).or_insert_with(|| PoolNow {
            image: s.image.clone(),
            count: 0,
            ready: Vec::new(),
            host_bytes: 0,
            device_bytes: 0,
        });
        pool.host_bytes += host_bytes;
        pool.device_bytes += device_bytes;
        pool.ready.push(StandbyNow {
            root: s.root,
            processes: s.pids.len(),
            host_bytes,
            device_bytes,
        });
    }
    pools.into_values().collect()
}

/// The processes of the standbys alive now (`cryo status` lists them as standbys, not as parked
/// workers).
pub fn standby_pids(records: &[cryo_journal::Record]) -> Vec<ProcId> {
    from_journal(records)
        .1
        .into_iter()
        .flat_map(|s| s.pids)
        .collect()
}

#[cfg(test)]
mod tests {
    use cryo_testkit::fake::Call;
    use cryo_testkit::procs::{self, Procs};
    use cryo_testkit::{eventually, PATIENCE};

    use super::*;
    use crate::thaw::tests::after_restore::{
        scene_of, scene_of_files, scene_with, scene_with_extras, Scene,
    };
    use crate::NoProgress;

    fn prepare(s: &Scene) -> Result<Standby, StandbyError> {
        prepare_beside(s, 0)
    }

    /// [`super::prepare`] of the scene's image, `others` standbys of it said to exist.
    fn prepare_beside(s: &Scene, others: usize) -> Result<Standby, StandbyError> {
        let fence = cryo_state::StateDir::new(s.dir.path()).fence();
        super::prepare(
            &s.fake.gpu(),
            &s.criu,
            &s.dir.path().join("img"),
            others,
            None,
            &s.journal,
            &fence,
            &NoProgress,
        )
    }

    /// A CUDA root (a shell) and one plain child; once "CRIU" resumes the tree, the child is
    /// SIGKILLed and the root reaps it and forks another in its place, all before CRIU exits.
    fn a_tree_whose_child_is_replaced_as_soon_as_it_resumes(cuda_child: bool) -> Scene {
        let s = scene_of(
            Procs::session_shell("sleep 600 & wait; sleep 600 & wait", 1),
            None,
            &[true, cuda_child],
        );
        let (root, child) = (s.pids[0], s.pids[1]);
        s.criu.on_resume(move || {
            procs::kill(child, nix::libc::SIGKILL);
            eventually(PATIENCE, "the child replaced", || {
                !procs::alive(child)
                    && cryo_proc::tree(root).is_ok_and(|t| t.len() == 2 && t[1] != child)
            });
        });
        s
    }

    /// The standby analogue of `cryo thaw`'s pairing at CRIU's gate: the restored tree runs
    /// once CRIU resumes it, and a child of the image that exits (the root forks another in its
    /// place) before CRIU's exit must not make the pairing wrong or refuse a tree that already
    /// runs. Paired at the gate, the standby is the image's processes still running: its root;
    /// the exited plain child is left out, and so is the child forked since.
    #[test]
    fn a_standby_whose_child_exits_and_is_replaced_as_soon_as_it_resumes_is_paired_at_the_gate() {
        let s = a_tree_whose_child_is_replaced_as_soon_as_it_resumes(false);
        let root = ProcHandle::open(s.pids[0]).unwrap();
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(standby.pids, vec![id(&root)]);
        let labels = s.labels();
        assert!(labels.contains(&"standby ready"), "{labels:?}");
        assert!(!labels.contains(&"standby dropped"), "{labels:?}");
    }

    /// A CUDA process of the image exits once the tree resumes: the driver's answer for its pid
    /// (CHECKPOINTED, as a fake that answers by pid gives for whatever process holds it now) is
    /// not taken for it: the standby is dropped, never ready.
    #[test]
    fn a_standby_whose_cuda_process_exits_as_soon_as_it_resumes_is_dropped() {
        let s = a_tree_whose_child_is_replaced_as_soon_as_it_resumes(true);
        let err = prepare(&s).unwrap_err();
        match &err {
            StandbyError::AfterRestore { error, .. } => assert!(
                error.contains(&format!(
                    "pid {} (a CUDA process of the image) exited",
                    s.pids[1]
                )),
                "{err}"
            ),
            other => panic!("expected a failure after the restore, got {other}"),
        }
        let labels = s.labels();
        assert!(labels.contains(&"standby dropped"), "{labels:?}");
        assert!(!labels.contains(&"standby ready"), "{labels:?}");
        assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
    }

    /// [`super::claim`] of `standby`, with the scene's state directory and no guard.
    fn claim_it(s: &Scene, standby: &Standby) -> Result<WakeReport, ClaimError> {
        let state = cryo_state::StateDir::new(s.dir.path());
        super::claim(
            &s.fake.gpu(),
            standby,
            &WakeOptions::default(),
            &s.journal,
            &state,
            &crate::NoWatcher,
            &NoProgress,
        )
    }

    /// SIGKILLs `pid` (a child of a `sleep` root that never reaps it) and waits until it has
    /// exited.
    fn end(pid: Pid) {
        procs::kill(pid, nix::libc::SIGKILL);
        eventually(PATIENCE, "the process to exit", || !procs::alive(pid));
    }

    /// Attack (session 12): a plain process of a ready standby (a helper of the worker, no
    /// CUDA state) exits while the standby waits for its claim. The worker's root and its CUDA
    /// processes are there, CHECKPOINTED: the claim hands them out, the exited helper left out,
    /// as a thaw leaves out a plain process that exits once it runs. (Before: the claim needed
    /// every process alive, failed "gone", and the pool dropped a sound standby.)
    #[test]
    fn a_standby_whose_plain_process_exited_while_ready_is_claimed_without_it() {
        let s = scene_of(Procs::session_tree(1), None, &[true, false]);
        let (root, helper) = (s.pids[0], s.pids[1]);
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(standby.pids.len(), 2);
        assert_eq!(standby.plain, vec![standby.pids[1]]);
        // An agent that starts again knows it from the journal alike.
        let records = cryo_journal::read(s.journal.dir()).unwrap().records;
        assert_eq!(
            from_journal(&records).1,
            vec![Standby {
                host_bytes: 0,
                device_bytes: 0,
                criu_ms: 0,
                ..standby.clone()
            }]
        );
        end(helper);
        let report = claim_it(&s, &standby).unwrap_or_else(|e| panic!("{e}"));
        let woken: Vec<Pid> = report.woken.iter().map(|p| p.pid).collect();
        assert_eq!(woken, vec![root]);
        assert_eq!(s.fake.state_of(root), ProcessState::Running);
        assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
    }

    /// Attack (session 12): a CUDA process of a ready standby (not its root) exits (its context
    /// CHECKPOINTED: the safe kind). The standby is not handed out without it ("gone", naming
    /// that process), and dropping it removes what is left of it, the root, CHECKPOINTED,
    /// through the stop path. (Before: the claim named the root as gone, and the agent's drop
    /// found "already gone" and left the root running, owned by nothing.)
    #[test]
    fn a_standby_whose_cuda_process_exited_while_ready_is_not_claimed_and_its_rest_is_removed() {
        let s = scene_of(Procs::session_tree(1), None, &[true, true]);
        let (root, child) = (s.pids[0], s.pids[1]);
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        end(child);
        match claim_it(&s, &standby) {
            Err(ClaimError::Gone(pid)) => assert_eq!(pid, child),
            Err(e) => panic!("expected the standby gone, got {e}"),
            Ok(_) => panic!("a standby without its CUDA process {child} was handed out"),
        }
        assert!(procs::alive(root));
        let what = drop_standby(&s.fake.gpu(), &standby, &s.journal, &NoProgress);
        assert_eq!(what, "removed", "{what}");
        assert!(!procs::alive(root), "the standby's root outlived its drop");
        assert_eq!(s.fake.state_of(root), ProcessState::Checkpointed);
        assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
    }

    /// Attack (session 13): a standby restored with processes beside the image's (extras the
    /// pairing leaves out, plain). They are part of the standby's tree and nothing else owns
    /// them: the standby names them (its `pids`, and `plain`: one that exits does not fail the
    /// claim; its `StandbyReady` alike) and removes them when it is dropped. (Before: the
    /// standby named the image's processes only, and a dropped standby left its extras
    /// running, owned and named by nothing.)
    #[test]
    fn a_standby_owns_the_processes_restored_beside_the_image_s() {
        let s = scene_with_extras(Procs::session_tree(2), &[true, false, false], 2);
        let extra = id(&ProcHandle::open(s.pids[2]).unwrap());
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        assert!(standby.pids.contains(&extra), "{standby:?}");
        assert!(standby.plain.contains(&extra), "{standby:?}");
        let records = cryo_journal::read(s.journal.dir()).unwrap().records;
        assert_eq!(from_journal(&records).1[0].pids, standby.pids);
        let what = drop_standby(&s.fake.gpu(), &standby, &s.journal, &NoProgress);
        assert_eq!(what, "removed", "{what}");
        for p in &s.pids {
            assert!(!procs::alive(*p), "pid {p} outlived the standby's drop");
        }
        assert_eq!(s.fake.state_of(s.pids[0]), ProcessState::Checkpointed);
        assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
    }

    /// Attack (session 13) on the adoption of a standby by an agent that starts again: a
    /// plain process of the standby exited while no agent ran, and its pid now names another
    /// process, one the driver answers RUNNING for (a CUDA process of someone else). The
    /// standby is sound (its root and CUDA process CHECKPOINTED): it is adopted, and the
    /// driver is never asked about the exited process's pid. (Before: every pid of the
    /// standby was asked by bare pid; the stranger's RUNNING made the standby "a claim cut
    /// short", left as it was, never adopted.)
    #[test]
    fn a_standby_whose_plain_process_exited_and_whose_pid_was_reused_is_still_checkpointed() {
        let s = scene_of(Procs::reaping_tree(1), None, &[true, false]);
        let helper = s.pids[1];
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(standby.plain.len(), 1, "{standby:?}");
        // Ended and reaped (the root reaps its children): its pid is free, then taken.
        let h = ProcHandle::open(helper).unwrap();
        procs::kill(helper, nix::libc::SIGKILL);
        eventually(PATIENCE, "the helper to be reaped", || {
            h.liveness() == cryo_proc::Liveness::Gone
        });
        let _stranger = procs::sleep_at_pid(helper).unwrap();
        // What the driver answers for the pid now: the stranger's live context.
        s.fake.add(helper);
        let asked = s.fake.calls().len();
        assert_eq!(still_checkpointed(&s.fake.gpu(), &standby), Ok(()));
        assert!(
            !s.fake.calls()[asked..].iter().any(|(p, _)| *p == helper),
            "the driver was asked about the exited process's pid: {:?}",
            &s.fake.calls()[asked..]
        );
        // A CUDA process of the standby that is not CHECKPOINTED still says so.
        s.fake.set_state(s.pids[0], ProcessState::Locked);
        assert!(still_checkpointed(&s.fake.gpu(), &standby).is_err());
    }

    /// Attack (session 13): a ready standby's tree runs (its plain processes do), and forks:
    /// its root forks a child while the standby waits for a claim. Dropping the standby must
    /// remove that child too, which nothing else owns, and name it. (Before: the drop stopped
    /// the standby's processes as journaled at its restore, and the child ran on.)
    #[test]
    fn a_dropped_standby_removes_what_its_tree_forked_while_ready() {
        let s = scene_of(Procs::reaping_tree(1), None, &[true, false]);
        let root = s.pids[0];
        let standby = prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        procs::kill(root, nix::libc::SIGUSR1);
        let child = eventually(PATIENCE, "the root to fork", || {
            cryo_proc::tree(root).unwrap().into_iter().find(|p| {
                !s.pids.contains(p) && cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep")
            })
        });
        let what = drop_standby(&s.fake.gpu(), &standby, &s.journal, &NoProgress);
        assert!(what.starts_with("removed"), "{what}");
        assert!(
            what.contains(&child.to_string()),
            "the fork is not named: {what}"
        );
        for p in s.pids.iter().chain([&child]) {
            assert!(
                !procs::alive(*p),
                "pid {p} outlived the standby's drop: {what}"
            );
        }
        assert_eq!(s.fake.state_of(root), ProcessState::Checkpointed);
        assert!(s.fake.wedges().is_empty(), "{:?}", s.fake.wedges());
    }

    /// The standby analogue of `cryo thaw`'s refusal at CRIU's gate: the restored tree is not
    /// the image's (the image's root pid did not come back). Refused at the gate, where nothing
    /// of it runs yet (CRIU ends it): nothing journaled, the driver never asked.
    #[test]
    fn a_standby_tree_that_cannot_be_paired_is_refused_at_criu_s_gate() {
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let free = gone.id() as Pid;
        gone.wait().unwrap();
        let s = scene_with(Some(free));
        let err = prepare(&s).unwrap_err();
        match &err {
            StandbyError::Criu(CriuError::Gate(e)) => {
                assert!(e.contains(&format!("pid {free} of the image")), "{err}")
            }
            other => panic!("expected a refusal at CRIU's gate, got {other}"),
        }
        assert_eq!(s.criu.restore_count(), 1);
        assert!(
            !s.fake.calls().iter().any(|(_, c)| *c == Call::State),
            "{:?}",
            s.fake.calls()
        );
        assert_eq!(s.labels(), Vec::<&str>::new());
    }

    /// Attack: an image of a tree that had a network namespace of its own (CRIU dumped one,
    /// `netns-*.img`) but shared the host's pid namespace (its manifest's namespace pids name
    /// one namespace). Each standby of it would hold the same host pids: a second one is
    /// refused before anything is restored, and the first one's pids are checked free.
    #[test]
    fn an_image_in_its_own_network_namespace_but_the_host_s_pids_gets_one_standby() {
        let s = scene_of_files(
            Procs::session_tree(1),
            None,
            &[true, true],
            &["netns-10.img"],
        );
        let err = prepare_beside(&s, 1).unwrap_err();
        assert!(
            matches!(
                err,
                StandbyError::Refused(StandbyRefusal::SharedNamespaces { .. })
            ),
            "{err}"
        );
        assert_eq!(s.criu.restore_count(), 0);
        // The pids are checked: the fake CRIU counts the image's as free until it restored
        // them once, as the original's would be once it was frozen; now they are taken.
        prepare(&s).unwrap_or_else(|e| panic!("{e}"));
        let err = prepare(&s).unwrap_err();
        assert!(
            matches!(
                err,
                StandbyError::Refused(StandbyRefusal::Precheck(PrecheckError::PidsInUse(_)))
            ),
            "{err}"
        );
        assert_eq!(s.criu.restore_count(), 1);
    }
}
