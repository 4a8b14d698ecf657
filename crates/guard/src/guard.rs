//! The guard's policy: suspend on a fatal signal, pin and fence at the exit stop, endgames.
//!
//! # Design
//! [`Guard`] owns a [`Tracer`] whose [`Policy`] is the guard's shared state:
//! - **Fatal signal** (the signalled thread held, the others running): journal `FatalSignal`,
//!   suspend the process through [`cryo_lifecycle::suspend`] (lock, checkpoint, NVML verified,
//!   each step journaled), then deliver the signal: the process dies with its context suspended.
//!   A suspension that is impossible (sticky error, lock timeout, driver FAILED) is journaled as
//!   `Refused` and the signal is delivered anyway; the exit stop handles it.
//! - **Exit stop** (every death: the above, SIGKILL, OOM kill, `exit_group`): the driver cannot
//!   act any more, so the driver is not asked for a state. The context counts as live when the
//!   process still holds driver fds (or NVML lists it) and the journal does not show it
//!   checkpointed since its last restore (read up to that instant). NVML only names the GPU: a
//!   pid it does not list (another pid namespace) is pinned all the same, with every GPU fenced
//!   (`unknown`). Live: every driver fd
//!   ([`cryo_gpu::GpuInspector::driver_fds`]) is duplicated, `Pinned` is journaled per GPU, the GPU
//!   is quarantined ([`cryo_state::fence`]) and `GpuQuarantined` journaled, all before the
//!   process is released. The duplicates stay in this process; the context is never torn down
//!   until an operator releases them ([`Guard::release`]). Not live (suspended): nothing is held.
//! - **Exec stop** (`execve` succeeded: the close-on-exec driver fds are closed, the old memory
//!   gone): the standing duplicates ([`crate::standing`]) are the only holders of the old
//!   context; pinned as at an exit stop (no drain), `Execed` journaled, the new program let go.
//! - **Endgame** after a quarantine: [`Endgame::Hold`] waits for the operator;
//!   [`Endgame::Drain`] stops every other GPU process of the node through
//!   [`cryo_lifecycle::stop`] (suspend-before-kill), then runs the operator's command. One drain
//!   at a time: a pin while a drain runs makes that drain look again, and the command runs once.
//!   Only a death by a signal drains: a process that exited on its own is pinned, not drained for.
//!   Processes pinned or held at their exit stop are not the drain's to stop (nor failures).
//! - **Memory**: guarded processes get a low `oom_score_adj` (refused without
//!   `CAP_SYS_RESOURCE`, which is reported per process), and the memory watch (a thread of its
//!   own) suspends and stops a guarded worker whose memory cgroup has less room beside its
//!   unreclaimable memory (anon, shmem, unevictable: never the page cache) than its device memory
//!   plus a margin (a checkpoint moves device memory into host memory, so it must happen while
//!   there is room for it), or whose PSI `full avg10` passes a threshold, several looks in a row.
//!
//! Processes are named by [`cryo_proc::ProcHandle`] (pidfd + start time): the same pidfd, duplicated,
//! is what the tracer attaches through, so the handle used for suspension and the one traced
//! cannot name different processes.
//!
//! # Limitations
//! - When the guard process dies, its pins close: on affected hosts that is the wedge the pins
//!   were holding off. A guard with pins refuses to stop on SIGTERM (see the CLI).
//! - A process whose context is live but whose driver fds cannot be duplicated is still fenced,
//!   but its context is torn down when it exits (journaled loudly).
//! - The memory watch polls (every `MemoryWatch::interval`, [`MEMORY_SAMPLES`] looks); a sudden
//!   allocation larger than the headroom still ends in an OOM kill, which the exit stop catches.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::RawFd;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use cryo_gpu::Gpu;
use cryo_journal::{AttachSource, Event, Journal, ProcId, Reader, Record};
use cryo_lifecycle::{NoProgress, ResolveError, Resolved, StopOptions, SuspendOptions, Target};
use cryo_proc::{Pid, ProcHandle};
use cryo_state::fence::{Fence, FenceError, FencedGpu};
use cryo_state::StateDir;
use serde::{Deserialize, Serialize};

use crate::memory::MemoryCgroup;
use crate::pins::PinSink;
use crate::policy::{AfterExec, Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee};
use crate::standing::StandingSet;
use crate::tracer::{AttachError, DetachError, SpawnError, Tracer, TracerGone};

/// Failpoint (pausing, `cryo_lifecycle::failpoint::pause_if`): an attach took the standing
/// duplicates of the process and has not seized it yet.
pub const GUARD_BEFORE_SEIZE: &str = "guard-before-seize";

/// What happens after a GPU is quarantined.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endgame {
    /// Keep the pins and wait for the operator (the default).
    Hold,
    /// Stop every other GPU process of the node (suspend-before-kill), then run `restart_cmd`
    /// through `sh -c` (with `CRYO_QUARANTINED_GPUS` set), e.g. to drain and reboot the node.
    Drain {
        /// The operator's command.
        restart_cmd: Option<String>,
    },
}

/// When to suspend and stop a guarded worker before the OOM killer acts.
#[derive(Debug, Clone)]
pub struct MemoryWatch {
    /// Act when the cgroup's free room falls below the process's device memory plus this.
    pub margin: u64,
    /// Also act when PSI `full avg10` (percent: every task stalled) of its pressure source
    /// reaches this; `None`: off.
    pub psi_full_avg10: Option<f64>,
    /// How often to look ([`MEMORY_SAMPLES`] looks in a row must agree before it acts).
    pub interval: Duration,
}

/// Which processes cryo did not restore (or hear of) the guard guards: the operator's policy for
/// restores made by other tools (NVIDIA's `cuda-checkpoint`, CRIU's plugin run by hand), which
/// nothing journals.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Scan {
    /// Every CUDA process (NVML lists it, or it holds driver files), found by a scan every
    /// [`SCAN_INTERVAL`]: the safe default on a node where anything restores contexts, since
    /// nothing tells a context restored by another tool from a fresh one. Its ordinary exit is
    /// then pinned like a restored one's.
    #[default]
    AllCuda,
    /// Only restores through cryo, the journal's, and those named by the operator.
    None,
}

/// How long a drain looks again at a traced process whose stop it could not carry out, for its
/// exit stop (a process killed while the drain looked: see `Inner::dies_under_hand`).
pub const DYING_GRACE: Duration = Duration::from_secs(2);

/// How often the scan of [`Scan::AllCuda`] looks for CUDA processes.
pub const SCAN_INTERVAL: Duration = Duration::from_secs(1);

/// How the guard runs.
#[derive(Debug, Clone)]
pub struct GuardConfig {
    /// cryo's state directory: the journal, the fence and the control socket live there.
    pub state: StateDir,
    /// The endgame.
    pub endgame: Endgame,
    /// How a fatal signal's suspension is tried (lock timeout: the held signal waits that long).
    pub suspend: SuspendOptions,
    /// `oom_score_adj` given to guarded processes (lower: the OOM killer prefers others).
    pub oom_score_adj: i32,
    /// Memory watching; `None`: off.
    pub memory: Option<MemoryWatch>,
    /// Where pinned fds go so that they outlive the guard (the pin holder); `None`: they stay in
    /// the guard's own process.
    pub pin_sink: Option<Arc<dyn PinSink>>,
    /// Which processes cryo did not restore are guarded.
    pub scan: Scan,
}

impl GuardConfig {
    /// Defaults for a state directory: hold, lock timeout 10 s (one retry), oom_score_adj -900,
    /// memory watch with a 64 MiB margin every 250 ms.
    pub fn new(state: StateDir) -> Self {
        Self {
            state,
            endgame: Endgame::Hold,
            suspend: SuspendOptions {
                lock_timeout: Duration::from_secs(10),
                lock_attempts: 2,
                verify_timeout: Duration::from_secs(10),
                resume_on_failure: false,
                purpose: cryo_lifecycle::suspend::Purpose::Guard,
                until: None,
            },
            oom_score_adj: -900,
            memory: Some(MemoryWatch {
                margin: 64 << 20,
                psi_full_avg10: None,
                interval: Duration::from_millis(250),
            }),
            pin_sink: None,
            scan: Scan::AllCuda,
        }
    }
}

/// Starting the guard failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The journal could not be opened.
    #[error("cannot open the journal: {0}")]
    Journal(#[from] cryo_journal::OpenError),
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    JournalRead(#[from] cryo_journal::ReadError),
    /// Suspensions left half-way by earlier runs could not be settled.
    #[error("settling suspensions left half-way: {0}")]
    Settle(#[from] cryo_lifecycle::SettleError),
    /// The tracer could not start.
    #[error(transparent)]
    Tracer(#[from] SpawnError),
    /// The memory watch's thread could not start.
    #[error("starting the memory watch's thread failed: {0}")]
    MemoryWatch(std::io::Error),
}

/// Guarding one process failed.
#[derive(Debug, thiserror::Error)]
pub enum GuardAttachError {
    /// The process is gone or its pid now names another process.
    #[error(transparent)]
    Proc(#[from] cryo_proc::ProcError),
    /// ptrace refused.
    #[error(transparent)]
    Attach(#[from] AttachError),
    /// The journal could not be written.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// The process replaced its program (`execve`) before the guard could seize it: the restored
    /// context is pinned (the standing duplicates held it), and the new program holds no driver
    /// files: nothing of it is a restored context, so the guard does not guard it.
    #[error("process {pid} replaced its program (execve) while the guard was attaching: its restored context is pinned and the new program holds none")]
    Replaced {
        /// The pid.
        pid: Pid,
    },
}

/// A stop the guard started (drain, memory watch) could not be carried out.
#[derive(Debug, thiserror::Error)]
enum InnerStopError {
    /// The process could not be opened.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
    /// The stop failed.
    #[error(transparent)]
    Stop(#[from] cryo_lifecycle::StopError),
}

/// Detaching from one process failed.
#[derive(Debug, thiserror::Error)]
pub enum GuardDetachError {
    /// The guard does not trace it (or its pid names another process now).
    #[error("process {pid} is not traced by this guard")]
    NotTraced {
        /// The pid.
        pid: Pid,
    },
    /// The tracer could not detach.
    #[error(transparent)]
    Tracer(DetachError),
    /// A lease was asked for a process whose context may be live (the journal does not show it
    /// suspended since its last restore): untraced, a death or an `execve` would tear it down.
    #[error("process {pid} may hold a live restored context ({why}) and the journal does not show it suspended: the guard lets go of it only once it is (suspend it first)")]
    Live {
        /// The pid.
        pid: Pid,
        /// What says it may be live.
        why: String,
    },
}

/// Releasing pins failed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The fence store failed.
    #[error(transparent)]
    Fence(#[from] FenceError),
    /// Nothing is pinned or quarantined for that GPU.
    #[error("GPU {0} is neither pinned by this guard nor quarantined")]
    NotPinned(FencedGpu),
    /// The pin holder could not be asked to close its pins (nothing was closed, the fence holds).
    #[error("the pin holder could not release {gpu}: {source}")]
    Holder {
        /// The GPU.
        gpu: FencedGpu,
        /// Why.
        source: cryo_holder::ClientError,
    },
    /// A pin the release would close also holds contexts on GPUs it does not name (nothing was
    /// closed).
    #[error("{}", crate::pins::other_gpus_message(*.pid, .others))]
    OtherGpus {
        /// The process whose pin it is.
        pid: ProcId,
        /// The GPUs not named.
        others: Vec<FencedGpu>,
    },
}

/// One guarded process, as `cryo status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GuardedInfo {
    /// Pid.
    pub pid: Pid,
    /// Start time (clock ticks), with the pid its identity.
    pub start_time: u64,
    /// Why it is guarded: `restore` (traced before its unlock), `journal` (a restore the guard
    /// heard of afterwards), `operator`, `scan`.
    pub source: String,
    /// The `oom_score_adj` set, or why it could not be.
    pub oom_score_adj: String,
    /// Standing duplicates of its driver fds the guard holds (what pins its context if it
    /// replaces its program with `execve`).
    #[serde(default)]
    pub standing_fds: usize,
}

/// One pinned context, as `cryo status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct PinInfo {
    /// The dead process whose context is held.
    pub pid: Pid,
    /// Its start time.
    pub start_time: u64,
    /// The GPUs its context is on (`unknown`: NVML could not say).
    pub gpus: Vec<FencedGpu>,
    /// Its fd numbers that were duplicated.
    pub fds: Vec<RawFd>,
    /// How it died.
    pub cause: String,
    /// The pin holder that holds them; `None`: the guard's own process (they close if it dies).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<Pid>,
}

/// The guard's state, for `cryo status` and the control socket.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GuardStatus {
    /// The guard's pid.
    pub guard_pid: u32,
    /// The tracer thread (`TracerPid` of tracees).
    pub tracer_tid: Pid,
    /// Guarded processes.
    pub guarded: Vec<GuardedInfo>,
    /// Processes detached on request (for a CRIU dump) and not re-attached yet.
    pub paused: Vec<Pid>,
    /// Contexts held open.
    pub pins: Vec<PinInfo>,
    /// `hold` or `drain`.
    pub endgame: String,
    /// Whether a drain runs now.
    #[serde(default)]
    pub draining: bool,
}

/// What the guard found when it started.
#[derive(Debug, Clone, Default)]
pub struct StartReport {
    /// Restored processes it attached to.
    pub attached: Vec<ProcId>,
    /// Processes it had guarded (or that are restored) and could not guard now, with why.
    pub lost: Vec<(ProcId, String)>,
    /// Suspensions that earlier stops, freezes or guards left half-way, settled before anything
    /// else (`cryo_lifecycle::settle_in_flight`).
    pub settled: Vec<cryo_lifecycle::Settled>,
    /// Restored processes not attached: their restore is under way (its intent journaled, not
    /// its completion) and they hold no driver file (no context): traced once it completes.
    /// With that restore (its image and its writer, a thaw at CRIU's gate), said at start
    /// ([`crate::Notice::Pending`]).
    pub pending: Vec<(ProcId, cryo_lifecycle::PendingRestore)>,
}

struct Watched {
    id: ProcId,
    handle: Arc<ProcHandle>,
    source: AttachSource,
    oom: String,
}

struct Pin {
    id: ProcId,
    gpus: Vec<FencedGpu>,
    cause: String,
    held: PinnedFds,
}

struct Inner {
    gpu: Gpu,
    journal: Journal,
    fence: Fence,
    cfg: GuardConfig,
    watched: Mutex<BTreeMap<Pid, Watched>>,
    /// Detached on request (for a CRIU dump), by identity, with why it was guarded (what it is
    /// guarded as again): a process restored later under the same pid is another process and is
    /// guarded. Forgotten once the process is gone.
    paused: Mutex<BTreeMap<ProcId, AttachSource>>,
    pins: Mutex<Vec<Pin>>,
    /// The state directory's pin holder ([`GuardConfig::pin_sink`], or the holder of the state
    /// directory if one runs): asked for its inventory and for releases even when pins are not
    /// handed to it.
    holder: Arc<dyn PinSink>,
    /// Processes the memory watch stopped, not yet reported by [`Guard::check_memory`].
    memory_stopped: Mutex<Vec<ProcId>>,
    /// The journal as the guard reads it: new restores, and which contexts were suspended since.
    view: Mutex<JournalView>,
    /// Processes held at their exit stop now (from [`Policy::fds_to_pin`] to [`Policy::on_gone`]):
    /// dying under the guard's hand, not for a drain to stop.
    exiting: Mutex<BTreeSet<Pid>>,
    /// Notified when `exiting` changes (an exit stop taken, a process gone): what a drain that
    /// could not stop a process waits on ([`Inner::dies_under_hand`]).
    exiting_changed: Condvar,
    /// Processes whose exit stop decided (pinned, or found nothing live) and that are not gone
    /// yet: the others' standing duplicates are pinned when they are gone (see `on_gone`).
    exit_decided: Mutex<BTreeSet<Pid>>,
    /// Standing duplicates of every guarded process's driver fds ([`crate::standing`]).
    standing: Mutex<StandingSet>,
    /// Processes seen replacing their program (`Execed`): their pid and start time name a
    /// program that was never restored, for which NVML may still list the pinned old context.
    execed: Mutex<BTreeSet<ProcId>>,
    /// The drain endgame: one at a time.
    drain: Mutex<DrainState>,
    /// Whether the operator was told that this host refuses `oom_score_adj` (once is enough:
    /// every later process gets the same answer, shown per process in `cryo status`).
    oom_warned: std::sync::atomic::AtomicBool,
}

/// What the guard has read of the journal.
struct JournalView {
    reader: Reader,
    /// Processes whose context the journal shows checkpointed since their last restore (a
    /// teardown of theirs is the safe kind).
    suspended: BTreeSet<ProcId>,
    /// Restores read and not yet handed to [`Guard::poll_journal`].
    restores: Vec<ProcId>,
}

impl JournalView {
    /// Reads what was appended since the last read.
    fn catch_up(&mut self) -> Result<(), cryo_journal::ReadError> {
        let records = self.reader.read_new()?.records;
        self.apply(&records);
        Ok(())
    }

    fn apply(&mut self, records: &[Record]) {
        for r in records {
            match &r.event {
                Event::Checkpointed { pid, .. } => {
                    self.suspended.insert(*pid);
                }
                Event::RestoreCompleted { pid, .. } => {
                    self.suspended.remove(pid);
                    self.restores.push(*pid);
                }
                Event::Resumed { pid } => {
                    self.suspended.remove(pid);
                }
                _ => {}
            }
        }
    }
}

/// One drain at a time: a drain asked for while one runs joins it.
#[derive(Debug, Default)]
struct DrainState {
    running: bool,
    /// Another context was pinned while the drain ran: it looks again before it ends.
    again: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic elsewhere must not stop the guard: the data is still the best there is.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn describe(cause: ExitCause) -> String {
    match cause {
        ExitCause::Exited(code) => format!("exited with status {code}"),
        ExitCause::Signaled { signal, .. } => {
            format!("killed by {}", cryo_proc::signal_name(signal))
        }
    }
}

impl Inner {
    fn record(&self, event: Event) {
        // Acting matters more than the log: a full disk must not stop a suspension or a pin.
        if let Err(err) = self.journal.append(event) {
            tracing::error!(%err, "cannot write the journal");
        }
    }

    fn id_of(&self, pid: Pid) -> ProcId {
        lock(&self.watched)
            .get(&pid)
            .map(|w| w.id)
            .unwrap_or_else(|| ProcId::of(pid).unwrap_or(ProcId::new(pid, 0)))
    }

    /// Whether the journal shows `id`'s context checkpointed since its last restore (read up to
    /// now). A journal that cannot be read says no: the safe answer (the context is pinned).
    fn suspended_since_restore(&self, id: ProcId) -> bool {
        let mut view = lock(&self.view);
        if let Err(err) = view.catch_up() {
            tracing::error!(%err, pid = id.pid, "cannot read the journal at the exit stop; counting the context as live");
            return false;
        }
        view.suspended.contains(&id)
    }

    fn quarantine(&self, id: ProcId, gpus: &[FencedGpu], reason: &str) {
        for gpu in gpus {
            if let Err(err) = self.fence.quarantine(gpu, reason, &[id.pid]) {
                tracing::error!(%err, %gpu, "cannot record the quarantine");
            }
            self.record(Event::GpuQuarantined {
                gpu: gpu.to_string(),
                reason: reason.to_string(),
            });
        }
    }

    /// Re-adopts the pins of the pin holder: their GPUs stay (or are again) quarantined, and they
    /// show in the status. Pins the journal says were taken and never released, that the holder
    /// does not hold, were lost with the process that held them (a holder or guard that died):
    /// `PinsLost` is journaled loudly (their contexts were torn down: a likely wedge) and their
    /// GPUs stay quarantined. Nothing is concluded when the holder cannot be asked.
    fn adopt_pins(&self, records: &[Record]) {
        let mut open: BTreeMap<ProcId, Vec<FencedGpu>> = cryo_journal::pinned(records)
            .into_iter()
            .map(|(pid, gpus)| {
                let gpus = gpus
                    .iter()
                    .map(|g| g.parse().unwrap_or(FencedGpu::Unknown))
                    .collect();
                (pid, gpus)
            })
            .collect();
        let held = match self.holder.inventory() {
            Ok(Some((_, pins))) => pins,
            Ok(None) => Vec::new(),
            Err(err) => {
                tracing::error!(%err, "cannot ask the pin holder for its pins; not adopting them (its GPUs stay as the fence says)");
                return;
            }
        };
        for pin in &held {
            open.remove(&pin.meta.pid);
            let reason = format!(
                "pid {} {} with a live restored context; its driver fds are held by the pin holder (pin {})",
                pin.meta.pid.pid, pin.meta.cause, pin.id
            );
            for gpu in &pin.meta.gpus {
                self.keep_fenced(pin.meta.pid, gpu, &reason);
            }
        }
        for (pid, gpus) in open {
            let reason = "nobody holds its pinned driver fds any more (the pin holder or the guard that held them died): its context was torn down, which wedges affected hosts; drain the node and reboot it";
            tracing::error!("PINS LOST of pid {}: {reason}", pid.pid);
            self.record(Event::PinsLost {
                pid,
                reason: reason.to_string(),
            });
            for gpu in &gpus {
                self.keep_fenced(pid, gpu, &format!("pins of pid {} lost: {reason}", pid.pid));
            }
        }
        if !held.is_empty() {
            tracing::warn!(pins = held.len(), "adopted the pin holder's pins");
        }
    }

    /// Quarantines `gpu` unless it has an entry of its own already (never lifts one).
    fn keep_fenced(&self, pid: ProcId, gpu: &FencedGpu, reason: &str) {
        match self.fence.get(gpu) {
            Ok(Some(_)) => {}
            Ok(None) => self.quarantine(pid, std::slice::from_ref(gpu), reason),
            Err(err) => {
                tracing::error!(%err, %gpu, "cannot read the fence; quarantining again");
                self.quarantine(pid, std::slice::from_ref(gpu), reason);
            }
        }
    }

    /// Hands `pinned` to the pin sink; `Some(holder)` once it holds them all, `None` when there
    /// is no sink or it could not take them (journaled loudly: the guard keeps them).
    fn hand_to_sink(
        &self,
        id: ProcId,
        gpus: &[FencedGpu],
        cause: &str,
        pinned: &PinnedFds,
    ) -> Option<ProcId> {
        let sink = self.cfg.pin_sink.as_ref()?;
        let meta = cryo_holder::PinMeta {
            pid: id,
            gpus: gpus.to_vec(),
            fds: pinned.fds.iter().map(|(n, _)| *n).collect(),
            cause: cause.to_string(),
            from: format!("cryo guard pid {}", std::process::id()),
        };
        let fds: Vec<std::os::fd::BorrowedFd<'_>> = pinned
            .fds
            .iter()
            .map(|(_, f)| std::os::fd::AsFd::as_fd(f))
            .collect();
        match sink.hold(&meta, &fds) {
            Ok((holder, _)) => {
                self.record(Event::PinsHanded { pid: id, holder });
                Some(holder)
            }
            Err(err) => {
                tracing::error!(pid = id.pid, %err, "THE PIN HOLDER DID NOT TAKE THE PINS: the guard keeps them in its own process; they close (and the context is torn down) if the guard dies");
                self.record(Event::PinsKeptByGuard {
                    pid: id,
                    error: err.to_string(),
                });
                None
            }
        }
    }

    /// Whether NVML lists `pid`, and on which GPUs (none when NVML cannot answer).
    fn gpus_of(&self, pid: Pid) -> (bool, Vec<FencedGpu>) {
        match self.gpu.inspect.processes() {
            Ok(list) => {
                let mut gpus: Vec<FencedGpu> = list
                    .iter()
                    .filter(|p| p.pid == pid)
                    .map(|p| FencedGpu::Gpu(p.gpu_uuid.clone()))
                    .collect();
                gpus.dedup();
                (!gpus.is_empty(), gpus)
            }
            Err(err) => {
                tracing::error!(pid, %err, "NVML query failed; cannot tell the GPU");
                (false, Vec::new())
            }
        }
    }

    /// Pins a live context: journals `Pinned` per GPU, quarantines its GPUs (every GPU when
    /// NVML could not name one), and hands the duplicates to the pin holder (or keeps them).
    fn pin_live(
        &self,
        id: ProcId,
        how: &str,
        pinned: PinnedFds,
        listed: bool,
        gpus: Vec<FencedGpu>,
    ) {
        let pid = id.pid;
        if !listed {
            tracing::error!(pid, "NVML does not list the process (another pid namespace?); pinning its driver fds and fencing every GPU");
        }
        let fds: Vec<RawFd> = pinned.fds.iter().map(|(n, _)| *n).collect();
        for err in &pinned.failed {
            tracing::error!(pid, %err, "could not pin a driver fd");
        }
        // Which GPU the context is on is unknown: fence them all (thaw refuses every GPU).
        let gpus = if gpus.is_empty() {
            vec![FencedGpu::Unknown]
        } else {
            gpus
        };
        let reason = if fds.is_empty() {
            format!("pid {pid} {how} with a live restored context and none of its driver fds could be pinned")
        } else {
            format!(
                "pid {pid} {how} with a live restored context; {} driver fds pinned by the guard",
                fds.len()
            )
        };
        if !fds.is_empty() {
            for gpu in &gpus {
                self.record(Event::Pinned {
                    pid: id,
                    gpu: gpu.to_string(),
                    fds: fds.clone(),
                });
            }
        }
        self.quarantine(id, &gpus, &reason);
        tracing::error!(pid, %how, ?gpus, "context pinned and GPU quarantined");
        if !fds.is_empty() {
            // The process is still held: the holder acknowledges before the guard's copies (or
            // the process's own) close.
            match self.hand_to_sink(id, &gpus, how, &pinned) {
                Some(holder) => {
                    tracing::warn!(pid, holder = holder.pid, "pins handed to the pin holder");
                    drop(pinned);
                }
                None => lock(&self.pins).push(Pin {
                    id,
                    gpus,
                    cause: how.to_string(),
                    held: pinned,
                }),
            }
        }
    }

    /// Brings the standing duplicates of `pid` up to date ([`crate::standing`]): dropped when
    /// the journal shows it suspended since its last restore, else new driver fds taken.
    fn refresh_standing(&self, pid: Pid, handle: &ProcHandle) -> crate::standing::Refreshed {
        let id = ProcId::of_handle(handle);
        if self.suspended_since_restore(id) {
            lock(&self.standing).take(pid);
            return crate::standing::Refreshed::default();
        }
        match self.gpu.inspect.driver_fds(pid) {
            Ok(now) => lock(&self.standing).refresh(id, handle, &now),
            Err(err) => {
                tracing::warn!(pid, %err, "cannot list driver fds; standing duplicates unchanged");
                crate::standing::Refreshed::default()
            }
        }
    }

    /// Whether `pid` holds no driver file (a listing that fails says it may).
    fn holds_no_driver_files(&self, pid: Pid) -> bool {
        self.gpu
            .inspect
            .driver_fds(pid)
            .is_ok_and(|fds| fds.is_empty())
    }

    /// Why `pid`'s context may be live, from the kernel's and NVML's evidence (driver files held,
    /// listed by NVML, or either unknown); `None`: it holds no context.
    fn may_be_live(&self, pid: Pid) -> Option<String> {
        match self.gpu.inspect.driver_fds(pid) {
            Ok(fds) if !fds.is_empty() => {
                return Some(format!("it holds {} driver files", fds.len()))
            }
            Ok(_) => {}
            Err(err) => return Some(format!("its driver files cannot be listed: {err}")),
        }
        match self.gpu.inspect.processes() {
            Ok(list) if list.iter().any(|p| p.pid == pid) => Some("NVML lists it".into()),
            Ok(_) => None,
            Err(err) => Some(format!("NVML cannot be asked: {err}")),
        }
    }

    /// Stops `target` through the lifecycle (suspend-before-kill, every step journaled).
    fn stop(
        &self,
        target: Result<Resolved, ResolveError>,
    ) -> Result<cryo_lifecycle::StopReport, InnerStopError> {
        Ok(cryo_lifecycle::stop(
            &self.gpu,
            &target?,
            &StopOptions::default(),
            &self.journal,
            &NoProgress,
        )?)
    }

    /// Starts the drain endgame, unless one runs: then that one looks again before it ends, and
    /// the restart command still runs once.
    fn run_endgame(self: &Arc<Self>) {
        let Endgame::Drain { restart_cmd } = self.cfg.endgame.clone() else {
            return;
        };
        {
            let mut d = lock(&self.drain);
            if d.running {
                d.again = true;
                tracing::warn!("drain: one runs already; it covers this pin too");
                return;
            }
            d.running = true;
        }
        let inner = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("cryo-guard-drain".into())
            .spawn(move || {
                let all_stopped = inner.drain_all();
                inner.restart(restart_cmd.as_deref(), all_stopped);
                // Pinned while the command ran: stop what is left; the command ran already.
                loop {
                    let mut d = lock(&inner.drain);
                    if !d.again {
                        d.running = false;
                        break;
                    }
                    d.again = false;
                    drop(d);
                    inner.drain_once();
                }
            });
        if let Err(err) = spawned {
            lock(&self.drain).running = false;
            tracing::error!(%err, "cannot start the drain endgame");
        }
    }

    /// Stops every GPU process of the node that is neither pinned nor dying at its exit stop,
    /// again as long as contexts were pinned meanwhile. Whether every one stopped safely.
    fn drain_all(&self) -> bool {
        let mut all_stopped = true;
        loop {
            all_stopped &= self.drain_once();
            let mut d = lock(&self.drain);
            if !d.again {
                return all_stopped;
            }
            d.again = false;
        }
    }

    /// Whether `pid` is pinned or held at its exit stop (nothing for a drain to stop).
    fn dying(&self, pid: Pid) -> bool {
        lock(&self.exiting).contains(&pid) || lock(&self.pins).iter().any(|p| p.id.pid == pid)
    }

    /// Whether `pid`, whose stop the drain could not carry out, died under the guard's hand:
    /// pinned or held at its exit stop ([`Inner::dying`]), or gone. A process the guard traces
    /// that was killed while the drain looked (two deaths at once) has its driver refuse the
    /// stop before its exit stop is reported and handled (the kill pending, the tracer not yet
    /// woken, the policy's thread not yet run): it is waited for up to [`DYING_GRACE`], woken
    /// by its exit stop (`exiting_changed`, notified where the exit stop marks it and where the
    /// tracer sees it gone), or found gone.
    fn dies_under_hand(&self, pid: Pid) -> bool {
        let handle = lock(&self.watched).get(&pid).map(|w| Arc::clone(&w.handle));
        let Some(handle) = handle else {
            return self.dying(pid);
        };
        let until = std::time::Instant::now() + DYING_GRACE;
        loop {
            // Gone: a look at /proc, outside the lock the tracer's thread takes.
            if handle.liveness() != cryo_proc::Liveness::Alive {
                return true;
            }
            // Held from the look to the wait: an exit stop marked in between is not missed.
            let exiting = lock(&self.exiting);
            if exiting.contains(&pid) || lock(&self.pins).iter().any(|p| p.id.pid == pid) {
                return true;
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            drop(
                self.exiting_changed
                    .wait_timeout(exiting, left)
                    .unwrap_or_else(std::sync::PoisonError::into_inner),
            );
        }
    }

    fn drain_once(&self) -> bool {
        let others: BTreeSet<Pid> = match self.gpu.inspect.processes() {
            Ok(list) => list
                .into_iter()
                .map(|p| p.pid)
                .filter(|p| !self.dying(*p))
                .collect(),
            Err(err) => {
                tracing::error!(%err, "drain: cannot list GPU processes; nothing stopped");
                return false;
            }
        };
        let mut all_stopped = true;
        for pid in others {
            match self.stop(Target::Pids(vec![pid]).resolve()) {
                Ok(r) if r.stopped() => tracing::warn!(pid, "drain: stopped (suspended first)"),
                // Died under the guard's hand meanwhile: its exit stop pins it, not a failure.
                _ if self.dies_under_hand(pid) => {
                    tracing::warn!(pid, "drain: dying at its exit stop; the guard pins it")
                }
                Ok(r) => {
                    all_stopped = false;
                    tracing::error!(pid, refusals = ?r.refusals, "drain: refused; left running");
                }
                Err(err) => {
                    all_stopped = false;
                    tracing::error!(pid, %err, "drain: stop failed");
                }
            }
        }
        all_stopped
    }

    fn restart(&self, restart_cmd: Option<&str>, all_stopped: bool) {
        let Some(cmd) = restart_cmd else { return };
        if !all_stopped {
            tracing::error!("drain: some GPU processes could not be stopped safely; running the restart command anyway");
        }
        let gpus: Vec<String> = self
            .fence
            .list()
            .unwrap_or_default()
            .into_iter()
            .map(|q| q.gpu.to_string())
            .collect();
        match std::process::Command::new("sh")
            .arg("-c")
            .arg(cmd)
            .env("CRYO_QUARANTINED_GPUS", gpus.join(","))
            .status()
        {
            Ok(st) => tracing::warn!(%st, cmd, "drain: restart command finished"),
            Err(err) => tracing::error!(%err, cmd, "drain: cannot run the restart command"),
        }
    }
}

/// The policy is the shared state itself (the tracer holds it as `Arc<dyn Policy>`).
struct PolicyHandle(Arc<Inner>);

impl Policy for PolicyHandle {
    fn on_fatal_signal(&self, target: &Tracee, signal: &FatalSignal) -> Decision {
        let inner = &self.0;
        let pid = target.pid();
        let id = inner.id_of(pid);
        inner.record(Event::FatalSignal {
            pid: id,
            signal: signal.signal,
        });
        let handle = lock(&inner.watched)
            .get(&pid)
            .map(|w| Arc::clone(&w.handle));
        let Some(handle) = handle else {
            tracing::error!(
                pid,
                "fatal signal for a process without a handle; delivering"
            );
            return Decision::Deliver;
        };
        // Suspended already (a `cryo stop --signal term` after its suspension, say): end it.
        let suspended = inner.suspended_since_restore(id)
            || {
                let outcome = cryo_lifecycle::suspend(
                    &inner.gpu,
                    &[&handle],
                    &inner.cfg.suspend,
                    Some(&inner.journal),
                    &NoProgress,
                );
                match outcome.into_iter().next().map(|o| o.result) {
                    Some(Ok(s)) => {
                        tracing::warn!(pid, signal = %cryo_proc::signal_name(signal.signal), state_before = %s.state_before, "suspended before the signal");
                        true
                    }
                    Some(Err(f)) => {
                        tracing::error!(pid, reason = %f.reason(), "cannot suspend before the signal; the exit stop will pin");
                        inner.record(Event::Refused {
                        pid: id,
                        reason: f.reason(),
                        hint: "the guard pins the context's driver fds at the exit stop and fences the GPU".into(),
                    });
                        false
                    }
                    None => false,
                }
            };
        if !(signal.handled && suspended) {
            return Decision::Deliver;
        }
        // A graceful end the process handles: its handler would touch the checkpointed GPU and
        // hang. Suspended is the safe end; SIGKILL finishes it (the journal shows why).
        inner.record(Event::KillStarted {
            pid: id,
            signal: libc::SIGKILL,
        });
        match handle.signal(cryo_proc::Signal::SIGKILL) {
            Ok(()) => {
                tracing::warn!(pid, signal = %cryo_proc::signal_name(signal.signal), "graceful end: suspended, then killed");
                Decision::Discard
            }
            Err(err) => {
                tracing::error!(pid, %err, "cannot kill after the suspension; delivering the signal");
                Decision::Deliver
            }
        }
    }

    fn fds_to_pin(&self, target: &Tracee) -> Vec<RawFd> {
        let pid = target.pid();
        lock(&self.0.exiting).insert(pid);
        self.0.exiting_changed.notify_all();
        match self.0.gpu.inspect.driver_fds(pid) {
            Ok(fds) => fds,
            Err(err) => {
                // Unsure which fds are the driver's: hold them all rather than lose a context.
                tracing::error!(pid, %err, "cannot list driver fds; pinning every fd");
                target
                    .handle()
                    .fds()
                    .map(|fds| fds.iter().map(|f| f.fd).collect())
                    .unwrap_or_default()
            }
        }
    }

    fn on_exit_stop(&self, target: &Tracee, _tid: Pid, cause: ExitCause, pinned: PinnedFds) {
        let inner = &self.0;
        let pid = target.pid();
        let id = inner.id_of(pid);
        lock(&inner.exit_decided).insert(pid);
        // Live unless the journal shows it suspended since its last restore; NVML only names
        // the GPU (a pid it does not list, from another pid namespace say, is pinned all the same).
        let suspended = inner.suspended_since_restore(id);
        let holds_driver_fds = !pinned.fds.is_empty() || !pinned.failed.is_empty();
        let (listed, gpus) = inner.gpus_of(pid);
        // Replaced its program: NVML may list it for the old context, which is pinned already;
        // only driver files of its own would hold a context now.
        let listed = listed && !lock(&inner.execed).contains(&id);
        if suspended || !(holds_driver_fds || listed) {
            // Suspended (or never had a context): its teardown is the safe kind.
            return;
        }
        inner.pin_live(id, &describe(cause), pinned, listed, gpus);
        // A process that exited on its own (`exit`, `exit_group`) ended in an orderly way: its
        // context is pinned and its GPU fenced, but the rest of the node keeps serving.
        if matches!(cause, ExitCause::Signaled { .. }) {
            inner.run_endgame();
        } else {
            tracing::warn!(pid, how = %describe(cause), "exited on its own: pinned, no drain");
        }
    }

    fn before_exec(&self, target: &Tracee) {
        // The fd table is whole until the leader goes: the freshest look there is.
        self.0.refresh_standing(target.pid(), target.handle());
    }

    fn on_exec(&self, target: &Tracee, thread: Pid) -> AfterExec {
        let inner = &self.0;
        let pid = target.pid();
        let id = inner.id_of(pid);
        let held = lock(&inner.standing).take(pid);
        let fds = held
            .map(crate::standing::Standing::into_all)
            .unwrap_or_default();
        let suspended = inner.suspended_since_restore(id);
        let (listed, gpus) = inner.gpus_of(pid);
        let how = format!("replaced its program (execve by thread {thread})");
        if suspended {
            tracing::warn!(pid, "execve of a suspended process: nothing live to hold");
        } else if !fds.is_empty() {
            let pinned = PinnedFds {
                target: pid,
                fds,
                failed: Vec::new(),
            };
            inner.pin_live(id, &how, pinned, listed, gpus);
            tracing::warn!(pid, "execve: the old context is pinned, no drain");
        } else if listed {
            // Only a duplicate taken before the exec could have held it.
            let reason = format!("pid {pid} {how} with a live context and no standing duplicate of its driver fds: its context was torn down");
            tracing::error!(pid, "{reason}");
            inner.quarantine(id, &gpus, &reason);
        }
        lock(&inner.watched).remove(&pid);
        lock(&inner.execed).insert(id);
        inner.record(Event::Execed { pid: id, thread });
        // The restored program is gone; the new one is another program (a scan may guard it
        // if it opens driver files of its own).
        AfterExec::Detach
    }

    fn on_gone(&self, target: &Tracee, cause: ExitCause) {
        let pid = target.pid();
        lock(&self.0.exiting).remove(&pid);
        self.0.exiting_changed.notify_all();
        let decided = lock(&self.0.exit_decided).remove(&pid);
        let held = lock(&self.0.standing).take(pid);
        let id = lock(&self.0.watched)
            .get(&pid)
            .map_or_else(|| self.0.id_of(pid), |w| w.id);
        if let Some(held) = held.filter(|_| !decided) {
            // Gone without its exit stop deciding (its leader let go early, taken for one
            // killed by an exec that did not happen): the standing duplicates are what holds
            // its context now.
            let fds = held.into_all();
            if !fds.is_empty() && !self.0.suspended_since_restore(id) {
                let (listed, gpus) = self.0.gpus_of(pid);
                let pinned = PinnedFds {
                    target: pid,
                    fds,
                    failed: Vec::new(),
                };
                self.0.pin_live(id, &describe(cause), pinned, listed, gpus);
            }
        }
        let w = lock(&self.0.watched).remove(&pid);
        let id = w.map_or(id, |w| w.id);
        self.0.record(Event::ProcessExited {
            pid: id,
            how: describe(cause),
        });
    }
}

/// The running guard. Dropping it detaches from everything (and closes pins: see the crate docs).
pub struct Guard {
    inner: Arc<Inner>,
    tracer: Tracer,
    /// One attach at a time: a restore's request (control socket) and the journal poll may name
    /// the same process at once, and the loser's failed seize must not unregister the winner's.
    attaching: Mutex<()>,
}

impl std::fmt::Debug for Guard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Guard")
            .field("tracer", &self.tracer)
            .finish_non_exhaustive()
    }
}

impl Guard {
    /// Starts the tracer, re-attaches to every live restored process of the journal, and
    /// journals `GuardLost` for the ones it had guarded and lost track of (dead without the guard
    /// seeing it, or impossible to attach now).
    pub fn start(gpu: Gpu, cfg: GuardConfig) -> Result<(Self, StartReport), StartError> {
        let journal = cfg.state.open_journal()?;
        let mut reader = cfg.state.journal_reader();
        let records = reader.read_new()?.records;
        let mut view = JournalView {
            reader,
            suspended: BTreeSet::new(),
            restores: Vec::new(),
        };
        view.apply(&records);
        // The restores so far are the start's business (`adopt`), not the poll's.
        view.restores.clear();
        view.suspended.retain(ProcId::is_alive_same);
        let inner = Arc::new(Inner {
            gpu,
            journal,
            fence: cfg.state.fence(),
            watched: Mutex::new(BTreeMap::new()),
            paused: Mutex::new(BTreeMap::new()),
            pins: Mutex::new(Vec::new()),
            memory_stopped: Mutex::new(Vec::new()),
            view: Mutex::new(view),
            exiting: Mutex::new(BTreeSet::new()),
            exiting_changed: Condvar::new(),
            exit_decided: Mutex::new(BTreeSet::new()),
            standing: Mutex::new(StandingSet::default()),
            execed: Mutex::new(
                records
                    .iter()
                    .filter_map(|r| match &r.event {
                        Event::Execed { pid, .. } => Some(*pid),
                        _ => None,
                    })
                    .filter(ProcId::is_alive_same)
                    .collect(),
            ),
            drain: Mutex::new(DrainState::default()),
            oom_warned: std::sync::atomic::AtomicBool::new(false),
            holder: cfg.pin_sink.clone().unwrap_or_else(|| {
                Arc::new(crate::pins::HolderSink::new(&cfg.state)) as Arc<dyn PinSink>
            }),
            cfg,
        });
        let tracer = Tracer::spawn(Arc::new(PolicyHandle(Arc::clone(&inner))))?;
        let guard = Guard {
            inner,
            tracer,
            attaching: Mutex::new(()),
        };
        // A guard (or stop, or freeze) that died half-way left a worker locked or checkpointed:
        // finish or undo that before anything else is attached. The tracer runs already, so
        // what is resumed in place is traced before its unlock, as after every restore.
        let settled =
            cryo_lifecycle::settle_in_flight(&guard.inner.gpu, &guard.inner.journal, Some(&guard))?;
        let records = if settled.is_empty() {
            records
        } else {
            cryo_journal::read(guard.inner.journal.dir())?.records
        };
        guard.inner.adopt_pins(&records);
        if let Some(watch) = guard.inner.cfg.memory.clone() {
            let weak = Arc::downgrade(&guard.inner);
            std::thread::Builder::new()
                .name("cryo-guard-memory".into())
                .spawn(move || memory_watch(&weak, &watch))
                .map_err(StartError::MemoryWatch)?;
        }
        let mut report = guard.adopt(&records);
        report.settled = settled;
        Ok((guard, report))
    }

    /// Re-attaches everything a guard before it was guarding, whatever the reason (restored,
    /// named by the operator, found by a scan: the source journaled with `GuardAttached`), and
    /// every live restored process of the journal but those whose restore is pending (intent
    /// journaled, not its completion) and that hold no driver file: a thaw at CRIU's gate,
    /// whose CRIU seizes the tree itself before it resumes it ([`StartReport::pending`]).
    fn adopt(&self, records: &[Record]) -> StartReport {
        let mut report = StartReport::default();
        // Guarded before and not let go of since: with the reason it was guarded for.
        let open: BTreeMap<ProcId, AttachSource> = cryo_journal::guarded(records);
        let origins = cryo_journal::Origins::from_records(records);
        let mut wanted = open.clone();
        for id in origins.live_restored() {
            wanted.entry(id).or_insert(AttachSource::Journal);
        }
        for (id, source) in wanted {
            if !id.is_alive_same() {
                if open.contains_key(&id) {
                    // Guarded before, dead now, and no record of how it ended: it died unwatched.
                    self.inner.record(Event::GuardLost { pid: id });
                    report
                        .lost
                        .push((id, "exited while no guard was watching".into()));
                }
                continue;
            }
            let pending = (!open.contains_key(&id))
                .then(|| cryo_lifecycle::pending_restore(records, id))
                .flatten()
                .filter(|_| self.inner.holds_no_driver_files(id.pid));
            if let Some(pending) = pending {
                // Its restore is under way (a thaw at CRIU's gate: CRIU seizes the tree itself
                // before it resumes it, and a seize of ours there made it abort the restore,
                // "Can't attach to PID: Operation not permitted", until session 23) or its
                // writer died before the driver's: it holds no context to tear down
                // (CHECKPOINTED, or no CUDA process). Whoever completes its restore has it
                // traced then (a thaw's guard-before-unlock, this guard's journal poll at its
                // `RestoreCompleted`); a dead thaw's tree was ended by the settlement above.
                report.pending.push((id, pending));
                continue;
            }
            match self.attach(id, source) {
                Ok(_) => report.attached.push(id),
                Err(GuardAttachError::Replaced { .. }) => {}
                Err(e) => {
                    self.inner.record(Event::GuardLost { pid: id });
                    report.lost.push((id, format!("cannot attach: {e}")));
                }
            }
        }
        report
    }

    /// Guards `id`: attaches, lowers its `oom_score_adj`, journals `GuardAttached` with `source`.
    /// `Ok(false)`: it was guarded already.
    fn attach(&self, id: ProcId, source: AttachSource) -> Result<bool, GuardAttachError> {
        let _one_at_a_time = lock(&self.attaching);
        let watched = lock(&self.inner.watched)
            .get(&id.pid)
            .filter(|w| w.id == id)
            .map(|w| Arc::clone(&w.handle));
        if let Some(handle) = watched {
            // Guarded already (a wake, a suspension rolled back, a restore named again): its
            // context may be new, and its standing duplicates were dropped while the journal
            // showed it checkpointed. Taken again now; a restore's caller unlocks only after
            // this returns, so an `execve` right after the unlock is pinned.
            let again = self.inner.refresh_standing(id.pid, &handle);
            if source == AttachSource::Restore && again.taken > 0 {
                if let Some(w) = lock(&self.inner.watched).get_mut(&id.pid) {
                    w.source = source;
                }
                // The journal says the restored context is guarded again before its unlock, as
                // for a first attach (restore, `GuardAttached`, unlock).
                self.inner
                    .journal
                    .append(Event::GuardAttached { pid: id, source })?;
            }
            return Ok(false);
        }
        if lock(&self.inner.execed).contains(&id) && self.inner.holds_no_driver_files(id.pid) {
            // Its restored program is gone (pinned at its exec); the new one holds no context.
            return Err(GuardAttachError::Replaced { pid: id.pid });
        }
        let handle = id.open()?;
        let traced = handle.try_clone()?;
        let oom = match handle.set_oom_score_adj(self.inner.cfg.oom_score_adj) {
            Ok(()) => self.inner.cfg.oom_score_adj.to_string(),
            Err(e) => {
                if self
                    .inner
                    .oom_warned
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::debug!(pid = id.pid, err = %e, "oom_score_adj not set");
                } else {
                    tracing::warn!(pid = id.pid, err = %e, "oom_score_adj not set (this host refuses it; `cryo status` shows it per process)");
                }
                format!("not set: {e}")
            }
        };
        // Registered before attaching: a fatal signal can arrive the moment the seize lands.
        lock(&self.inner.watched).insert(
            id.pid,
            Watched {
                id,
                handle: Arc::new(handle),
                source,
                oom,
            },
        );
        // Standing duplicates before the seize: an exec between the two would close the
        // driver fds with no exec stop to see it.
        self.inner.refresh_standing(id.pid, &traced);
        cryo_lifecycle::failpoint::pause_if(GUARD_BEFORE_SEIZE);
        if let Err(e) = self.tracer.attach_handle(traced) {
            lock(&self.inner.watched).remove(&id.pid);
            lock(&self.inner.standing).take(id.pid);
            return Err(e.into());
        }
        let handle = lock(&self.inner.watched)
            .get(&id.pid)
            .map(|w| Arc::clone(&w.handle));
        if let Some(handle) = handle {
            if self.settle_vanished_at_attach(id, &handle) {
                self.let_go_replaced(id);
                return Err(GuardAttachError::Replaced { pid: id.pid });
            }
        }
        lock(&self.inner.paused).remove(&id);
        self.inner
            .journal
            .append(Event::GuardAttached { pid: id, source })?;
        tracing::info!(pid = id.pid, %source, "guarding");
        Ok(true)
    }

    /// Right after the seize: driver files held before it and gone after it were closed by the
    /// process while nothing traced it (an `execve` between the two looks, or a checkpoint by
    /// another tool). Unless the driver says its context is CHECKPOINTED (or the journal shows it
    /// suspended), they are pinned: the safe reading on both. Whether they were pinned and the
    /// process holds no driver file any more (what an `execve` leaves: see
    /// [`Guard::let_go_replaced`]).
    fn settle_vanished_at_attach(&self, id: ProcId, handle: &ProcHandle) -> bool {
        let r = self.inner.refresh_standing(id.pid, handle);
        if r.vanished == 0 {
            return false;
        }
        let checkpointed = matches!(
            self.inner.gpu.driver.state(id.pid),
            Ok(cryo_gpu::ProcessState::Checkpointed)
        );
        let gone = lock(&self.inner.standing).take_vanished(id.pid);
        if checkpointed || gone.is_empty() {
            return false;
        }
        let (listed, gpus) = self.inner.gpus_of(id.pid);
        let pinned = PinnedFds {
            target: id.pid,
            fds: gone,
            failed: Vec::new(),
        };
        self.inner.pin_live(
            id,
            "closed driver fds while the guard was attaching (an execve?)",
            pinned,
            listed,
            gpus,
        );
        self.inner.holds_no_driver_files(id.pid)
    }

    /// The process closed every driver file between the standing duplicates and the seize, and
    /// they are pinned now: what an `execve` that no exec stop could see leaves (close-on-exec).
    /// Its restored context is held by the pin, not by the process, whose pid and start time now
    /// name a program that was never restored: let go of as at an exec stop (`Execed`, thread 0:
    /// not seen), so that its later end, which NVML may list for the pinned context, is never
    /// taken for a restored context's teardown (a second quarantine, a drain), and nothing
    /// (a restart's re-attach, the scan) guards it as restored again.
    fn let_go_replaced(&self, id: ProcId) {
        lock(&self.inner.execed).insert(id);
        lock(&self.inner.standing).take(id.pid);
        lock(&self.inner.watched).remove(&id.pid);
        if let Err(err) = self.tracer.detach(id.pid) {
            // Still traced: its exit stop knows it as replaced (`execed`) all the same.
            tracing::warn!(pid = id.pid, %err, "cannot let go of a process that replaced its program");
        }
        self.inner.record(Event::Execed { pid: id, thread: 0 });
        tracing::warn!(
            pid = id.pid,
            "replaced its program before the seize: its restored context is pinned; the new program is let go"
        );
    }

    /// Refreshes the standing duplicates of every guarded process (every
    /// [`crate::SCAN_INTERVAL`] from the guard's loop): driver fds opened since are taken, and
    /// those of processes the journal shows suspended dropped.
    pub fn refresh_standing(&self) {
        let all: Vec<Arc<ProcHandle>> = lock(&self.inner.watched)
            .values()
            .map(|w| Arc::clone(&w.handle))
            .collect();
        for h in all {
            self.inner.refresh_standing(h.pid(), &h);
        }
    }

    /// Guards a process restored by other tools (`cryo guard --pid N`, or `attach` on the socket).
    pub fn attach_pid(&self, pid: Pid) -> Result<ProcId, GuardAttachError> {
        let id = ProcId::of(pid)?;
        self.attach_id(id)?;
        Ok(id)
    }

    /// Guards the process `id` names, if its pid still names it (`attach` on the socket, a freeze
    /// handing a process back).
    pub fn attach_id(&self, id: ProcId) -> Result<(), GuardAttachError> {
        self.attach(id, AttachSource::Operator).map(|_| ())
    }

    /// Guards processes whose context was just restored, while they are still LOCKED (see
    /// [`cryo_lifecycle::Watcher::guard_before_unlock`]); returns once every one is traced.
    pub fn guard_restored(&self, ids: &[ProcId]) -> Result<(), GuardAttachError> {
        for id in ids {
            self.attach(*id, AttachSource::Restore)?;
        }
        Ok(())
    }

    /// Stops guarding `pid` until [`Guard::attach_pid`] (before a CRIU dump: CRIU cannot dump a
    /// traced process). The journal poll does not re-attach it meanwhile.
    pub fn detach(&self, id: ProcId) -> Result<(), GuardDetachError> {
        let pid = id.pid;
        if lock(&self.inner.watched)
            .get(&pid)
            .is_some_and(|w| w.id != id)
        {
            return Err(GuardDetachError::NotTraced { pid });
        }
        let source = lock(&self.inner.watched)
            .get(&pid)
            .map_or(AttachSource::Operator, |w| w.source);
        lock(&self.inner.paused).insert(id, source);
        match self.tracer.detach(pid) {
            Ok(()) => {
                // Not traced: an exec would not be seen; the process holds its own fds.
                lock(&self.inner.standing).take(pid);
                if let Some(w) = lock(&self.inner.watched).remove(&pid) {
                    self.inner.record(Event::GuardLost { pid: w.id });
                }
                Ok(())
            }
            Err(e) => {
                lock(&self.inner.paused).remove(&id);
                Err(match e {
                    DetachError::NotTraced { pid } => GuardDetachError::NotTraced { pid },
                    e => GuardDetachError::Tracer(e),
                })
            }
        }
    }

    /// Stops guarding `id` for a lease (a CRIU dump), only if its context is not live: the journal
    /// shows it checkpointed since its last restore, or it holds no driver files and NVML does
    /// not list it ([`GuardDetachError::Live`] otherwise: a death or an exec while nothing
    /// traces it would tear a live restored context down). Then as [`Guard::detach`].
    pub fn lease(&self, id: ProcId) -> Result<(), GuardDetachError> {
        let traced = lock(&self.inner.watched)
            .get(&id.pid)
            .is_some_and(|w| w.id == id);
        if traced && !self.inner.suspended_since_restore(id) {
            if let Some(why) = self.inner.may_be_live(id.pid) {
                return Err(GuardDetachError::Live { pid: id.pid, why });
            }
        }
        self.detach(id)
    }

    /// The end of a lease ([`cryo_lifecycle::Lease`], or a `let_go` connection that closed):
    /// guards `id` again, as what it was guarded as, if it still lives and was not attached
    /// meanwhile. `Ok(false)`: nothing to take back.
    pub fn take_back(&self, id: ProcId) -> Result<bool, GuardAttachError> {
        let Some(source) = lock(&self.inner.paused).get(&id).copied() else {
            return Ok(false);
        };
        if !id.is_alive_same() {
            lock(&self.inner.paused).remove(&id);
            return Ok(false);
        }
        self.attach(id, source)?;
        Ok(true)
    }

    /// Reads the journal's new records and guards every process a new `RestoreCompleted` names.
    pub fn poll_journal(&self) -> Result<Vec<ProcId>, cryo_journal::ReadError> {
        let restores = {
            let mut view = lock(&self.inner.view);
            view.catch_up()?;
            view.suspended.retain(ProcId::is_alive_same);
            std::mem::take(&mut view.restores)
        };
        lock(&self.inner.paused).retain(|id, _| id.is_alive_same());
        let mut attached = Vec::new();
        for pid in &restores {
            if lock(&self.inner.paused).contains_key(pid) || !pid.is_alive_same() {
                continue;
            }
            match self.attach(*pid, AttachSource::Journal) {
                Ok(true) => attached.push(*pid),
                Ok(false) | Err(GuardAttachError::Replaced { .. }) => {}
                Err(e) => {
                    tracing::error!(pid = pid.pid, err = %e, "cannot guard a restored process");
                    self.inner.record(Event::GuardLost { pid: *pid });
                }
            }
        }
        Ok(attached)
    }

    /// With [`Scan::AllCuda`], guards every CUDA process not guarded yet (source `scan`): NVML's
    /// list and the holders of driver files. Left out: this process, the pin holder (it holds
    /// dead processes' contexts), processes leased out for a dump, and processes someone else
    /// traces (CRIU mid-restore, a debugger: looked at again next time). Returns those attached.
    pub fn scan(&self) -> Vec<ProcId> {
        if self.inner.cfg.scan != Scan::AllCuda {
            return Vec::new();
        }
        let pids = match self.inner.gpu.inspect.cuda_processes() {
            Ok(p) => p,
            Err(err) => {
                tracing::warn!(%err, "cannot scan for CUDA processes");
                return Vec::new();
            }
        };
        let me = Pid::try_from(std::process::id()).unwrap_or(0);
        let holder = match self.inner.holder.inventory() {
            Ok(Some((info, _))) => Some(info.id.pid),
            _ => None,
        };
        let mut attached = Vec::new();
        for pid in pids {
            if pid == me
                || Some(pid) == holder
                || lock(&self.inner.watched).contains_key(&pid)
                || lock(&self.inner.exiting).contains(&pid)
            {
                continue;
            }
            let Ok(id) = ProcId::of(pid) else { continue };
            if lock(&self.inner.paused).contains_key(&id) {
                continue;
            }
            // NVML lists an exec'd process for the old context pinned in its name: guard the
            // new program only once it holds driver files of its own.
            if lock(&self.inner.execed).contains(&id)
                && self
                    .inner
                    .gpu
                    .inspect
                    .driver_fds(pid)
                    .map_or(true, |f| f.is_empty())
            {
                continue;
            }
            if cryo_proc::status(pid).is_ok_and(|s| s.tracer_pid != 0) {
                tracing::debug!(pid, "traced by someone else; scanned again later");
                continue;
            }
            match self.attach(id, AttachSource::Scan) {
                Ok(true) => attached.push(id),
                Ok(false) | Err(GuardAttachError::Replaced { .. }) => {}
                Err(err) => {
                    tracing::warn!(pid, %err, "cannot guard a CUDA process found by the scan")
                }
            }
        }
        attached
    }

    /// The operator's release of the contexts pinned on the GPUs `gpus` names: closes the
    /// duplicates (on affected hosts the driver then tears the contexts down, which is what
    /// wedges them) and lifts their quarantine. Refused before anything is closed when a pin
    /// also holds contexts on a GPU not named ([`ReleaseError::OtherGpus`]: a pin cannot be
    /// closed for one GPU only). Returns the processes whose pins were closed.
    pub fn release(&self, gpus: &[FencedGpu]) -> Result<Vec<ProcId>, ReleaseError> {
        let first = gpus.first().cloned().unwrap_or(FencedGpu::Unknown);
        let held = match self.inner.holder.inventory() {
            Ok(Some((_, pins))) => pins,
            Ok(None) => Vec::new(),
            Err(source) => return Err(ReleaseError::Holder { gpu: first, source }),
        };
        let mine: Vec<(ProcId, Vec<FencedGpu>)> = lock(&self.inner.pins)
            .iter()
            .map(|p| (p.id, p.gpus.clone()))
            .collect();
        let all = held
            .iter()
            .map(|p| (p.meta.pid, &p.meta.gpus[..]))
            .chain(mine.iter().map(|(id, g)| (*id, &g[..])));
        if let Some((pid, others)) = crate::pins::spans_unnamed(all, gpus) {
            return Err(ReleaseError::OtherGpus { pid, others });
        }
        let mut released = Vec::new();
        let mut anything = false;
        for gpu in gpus {
            match self.release_one(gpu, gpus) {
                Ok(pids) => {
                    anything = true;
                    released.extend(pids);
                }
                Err(ReleaseError::NotPinned(_)) => {}
                Err(e) => return Err(e),
            }
        }
        if !anything {
            return Err(ReleaseError::NotPinned(first));
        }
        Ok(released)
    }

    /// [`Guard::release`] of one GPU of the release naming `named`.
    fn release_one(
        &self,
        gpu: &FencedGpu,
        named: &[FencedGpu],
    ) -> Result<Vec<ProcId>, ReleaseError> {
        // The holder's first: if it cannot be asked, nothing is closed and the fence holds.
        let in_holder = self
            .inner
            .holder
            .release(gpu)
            .map_err(|source| ReleaseError::Holder {
                gpu: gpu.clone(),
                source,
            })?;
        let taken: Vec<Pin> = {
            let mut pins = lock(&self.inner.pins);
            let (take, keep) = std::mem::take(&mut *pins)
                .into_iter()
                .partition(|p| p.gpus.contains(gpu));
            *pins = keep;
            take
        };
        let lifted = self.inner.fence.release(gpu)?;
        if taken.is_empty() && in_holder.is_empty() && lifted.is_none() {
            return Err(ReleaseError::NotPinned(gpu.clone()));
        }
        let mut released =
            crate::pins::journal_released(&self.inner.journal, gpu, named, &in_holder);
        for p in taken {
            tracing::warn!(
                pid = p.id.pid,
                %gpu,
                fds = p.held.fds.len(),
                "closing pins on the operator's request"
            );
            drop(p.held);
            self.inner.record(Event::PinsReleased { pid: p.id });
            crate::pins::closed_elsewhere(&self.inner.journal, gpu, named, p.id, &p.gpus);
            released.push(p.id);
        }
        Ok(released)
    }

    /// Whether any context is pinned.
    pub fn has_pins(&self) -> bool {
        !lock(&self.inner.pins).is_empty()
    }

    /// The processes guarded now.
    pub fn guarded(&self) -> Vec<ProcId> {
        lock(&self.inner.watched).values().map(|w| w.id).collect()
    }

    /// The tracer thread id (`TracerPid` of every tracee).
    pub fn tracer_tid(&self) -> Pid {
        self.tracer.tracer_tid()
    }

    /// A snapshot for `cryo status`.
    pub fn status(&self) -> GuardStatus {
        let guarded = lock(&self.inner.watched)
            .values()
            .map(|w| GuardedInfo {
                pid: w.id.pid,
                start_time: w.id.start_time,
                source: w.source.as_str().to_string(),
                oom_score_adj: w.oom.clone(),
                standing_fds: lock(&self.inner.standing).count(w.id.pid),
            })
            .collect();
        let mut pins: Vec<PinInfo> = lock(&self.inner.pins)
            .iter()
            .map(|p| PinInfo {
                pid: p.id.pid,
                start_time: p.id.start_time,
                gpus: p.gpus.clone(),
                fds: p.held.fds.iter().map(|(n, _)| *n).collect(),
                cause: p.cause.clone(),
                holder: None,
            })
            .collect();
        pins.extend(crate::pins::holder_pins(&*self.inner.holder));
        GuardStatus {
            guard_pid: std::process::id(),
            tracer_tid: self.tracer.tracer_tid(),
            guarded,
            paused: lock(&self.inner.paused).keys().map(|p| p.pid).collect(),
            pins,
            endgame: match &self.inner.cfg.endgame {
                Endgame::Hold => "hold".into(),
                Endgame::Drain { .. } => "drain".into(),
            },
            draining: lock(&self.inner.drain).running,
        }
    }

    /// The processes the memory watch (a thread of its own, every `MemoryWatch::interval`)
    /// suspended and stopped since the last call.
    pub fn check_memory(&self) -> Vec<ProcId> {
        std::mem::take(&mut *lock(&self.inner.memory_stopped))
    }

    /// Detaches from everything and journals `GuardLost` for each (they are unguarded from now
    /// on). Pins stay held while this value lives; callers check [`Guard::has_pins`] first.
    pub fn shutdown(&self) {
        for id in self.guarded() {
            if let Err(err) = self.detach(id) {
                tracing::error!(pid = id.pid, %err, "cannot detach");
            }
        }
    }

    /// Whether the tracer still runs.
    pub fn tracer_alive(&self) -> Result<(), TracerGone> {
        self.tracer.traced().map(|_| ())
    }
}

/// How many looks in a row must find a worker short of memory before the watch acts.
pub const MEMORY_SAMPLES: u32 = 3;

/// What the memory watch remembers of one guarded process between looks.
#[derive(Debug, Default)]
struct MemoryLooks {
    /// Looks in a row that found it short.
    short: u32,
    /// `oom` events of its cgroup at the last look.
    oom_events: Option<u64>,
}

/// The memory watch's thread: looks at every guarded process every `watch.interval` until the
/// guard is gone, and suspends and stops (through [`cryo_lifecycle::stop`]) each whose cgroup is
/// about to run out of room. It runs beside the journal poll and the control socket, so a stop
/// here never delays guarding a new restore.
fn memory_watch(inner: &std::sync::Weak<Inner>, watch: &MemoryWatch) {
    let mut looks: BTreeMap<ProcId, MemoryLooks> = BTreeMap::new();
    loop {
        std::thread::sleep(watch.interval.max(Duration::from_millis(10)));
        let Some(inner) = inner.upgrade() else { return };
        let ids: Vec<ProcId> = lock(&inner.watched).values().map(|w| w.id).collect();
        looks.retain(|id, _| ids.contains(id));
        for id in ids {
            let look = looks.entry(id).or_default();
            let Some(why) = memory_trigger(&inner.gpu, id, watch, look) else {
                continue;
            };
            looks.remove(&id);
            tracing::warn!(pid = id.pid, %why, "memory pressure: suspending and stopping before the OOM killer acts");
            // The very process guarded, not whatever holds its pid now.
            let target = id
                .open()
                .map(|h| Resolved::from_handles(Target::Pids(vec![id.pid]), vec![h]))
                .map_err(ResolveError::from);
            match inner.stop(target) {
                Ok(r) if r.stopped() => lock(&inner.memory_stopped).push(id),
                Ok(r) => {
                    tracing::error!(pid = id.pid, refusals = ?r.refusals, "memory pressure: could not suspend; the exit stop will pin")
                }
                Err(err) => tracing::error!(pid = id.pid, %err, "memory pressure: stop failed"),
            }
        }
    }
}

/// Why `id` must be suspended now, if it must: the memory its cgroup cannot reclaim (anonymous,
/// shmem, unevictable: never the page cache, which the kernel drops first) leaves less room than
/// its device memory plus the margin (a checkpoint moves device memory into host memory), or PSI
/// `full` passes the threshold, for [`MEMORY_SAMPLES`] looks in a row; at once when the room is
/// below the device memory alone, or the cgroup hit its limit (`oom` event) since the last look.
fn memory_trigger(
    gpu: &Gpu,
    id: ProcId,
    watch: &MemoryWatch,
    look: &mut MemoryLooks,
) -> Option<String> {
    let handle = id.open().ok()?;
    let cg = MemoryCgroup::of(&handle).ok()?;
    let oom_events = cg.oom_events().ok();
    let hit_limit = matches!((look.oom_events, oom_events), (Some(a), Some(b)) if b > a);
    look.oom_events = oom_events;
    let mut short = None;
    let mut urgent = hit_limit;
    if let (Ok(Some(limit)), Ok(unreclaimable)) = (cg.limit(), cg.unreclaimable()) {
        let device = gpu
            .inspect
            .process_memory(id.pid)
            .ok()
            .flatten()
            .unwrap_or(0);
        let room = limit.saturating_sub(unreclaimable);
        // The margin is gone and the checkpoint itself barely fits: no time for more looks.
        urgent |= device > 0 && room < device;
        if device > 0 && room < device.saturating_add(watch.margin) {
            short = Some(format!(
                "{room} bytes of {} (limit {limit}) left beside unreclaimable memory, checkpoint needs {device} + margin {}",
                cg.dir.display(),
                watch.margin
            ));
        }
    }
    if short.is_none() {
        if let (Some(threshold), Ok(psi)) = (watch.psi_full_avg10, cg.pressure()) {
            if let Some(full) = psi.full.filter(|f| f.avg10 >= threshold) {
                short = Some(format!(
                    "memory PSI full avg10 {:.1}% >= {threshold}%",
                    full.avg10
                ));
            }
        }
    }
    let Some(why) = short else {
        look.short = 0;
        return None;
    };
    look.short += 1;
    if urgent {
        return Some(format!(
            "{why}; {}",
            if hit_limit {
                "the cgroup hit its limit"
            } else {
                "less room than the checkpoint needs"
            }
        ));
    }
    (look.short >= MEMORY_SAMPLES).then(|| format!("{why} ({} looks in a row)", look.short))
}

/// The node agent asks its in-process guard to let go of a process around a CRIU dump.
impl cryo_lifecycle::Watcher for Guard {
    fn let_go(
        &self,
        pid: ProcId,
    ) -> Result<Option<cryo_lifecycle::Lease<'_>>, cryo_lifecycle::WatcherError> {
        match self.lease(pid) {
            Ok(()) => Ok(Some(cryo_lifecycle::Lease::new(pid, move || {
                if let Err(err) = self.take_back(pid) {
                    tracing::error!(pid = pid.pid, %err, "cannot guard the process again after its lease");
                    self.inner.record(Event::GuardLost { pid });
                }
            }))),
            Err(GuardDetachError::NotTraced { .. }) => Ok(None),
            Err(e) => Err(cryo_lifecycle::WatcherError::new(e)),
        }
    }

    fn guard_before_unlock(
        &self,
        procs: &[&ProcHandle],
    ) -> Result<cryo_lifecycle::Coverage, cryo_lifecycle::WatcherError> {
        let ids: Vec<ProcId> = procs.iter().map(|h| ProcId::of_handle(h)).collect();
        self.guard_restored(&ids)
            .map_err(cryo_lifecycle::WatcherError::new)?;
        Ok(cryo_lifecycle::Coverage::Guarded)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    //! The exit-stop decision with a fake driver whose NVML does not list the process (it runs in
    //! another pid namespace, say) while the process holds driver files. Root (ptrace).

    use super::*;
    use cryo_gpu::{GpuInfo, GpuInspector, GpuProcess, InspectError};
    use cryo_testkit::fake::FakeGpu;
    use cryo_testkit::procs::Procs;
    use cryo_testkit::{eventually, PATIENCE};

    /// NVML as the fake answers it, less `hidden`; `hidden` holds driver files `fds`.
    #[derive(Debug)]
    struct Unlisted {
        fake: FakeGpu,
        hidden: Pid,
        fds: Vec<RawFd>,
    }

    impl GpuInspector for Unlisted {
        fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
            self.fake.gpus()
        }
        fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
            let mut list = self.fake.processes()?;
            list.retain(|p| p.pid != self.hidden);
            Ok(list)
        }
        fn driver_version(&self) -> Result<String, InspectError> {
            self.fake.driver_version()
        }
        fn driver_fds(&self, pid: Pid) -> Result<Vec<RawFd>, InspectError> {
            Ok(if pid == self.hidden {
                self.fds.clone()
            } else {
                Vec::new()
            })
        }
    }

    fn journal_events(state: &StateDir) -> Vec<Event> {
        state.read_journal().unwrap().into_events()
    }

    struct Scene {
        _dir: tempfile::TempDir,
        state: StateDir,
        _procs: Procs,
        id: ProcId,
        fake: FakeGpu,
        guard: Guard,
    }

    /// A restored process (journaled so), listed by no NVML query, holding driver file 0; the
    /// journal gets `extra` after its restore; then a guard starts and attaches to it.
    fn scene(extra: impl Fn(ProcId) -> Vec<Event>) -> Scene {
        scene_with(extra, false)
    }

    /// As [`scene`]; `listed`: NVML lists the process (on the fake's GPU 0).
    fn scene_with(extra: impl Fn(ProcId) -> Vec<Event>, listed: bool) -> Scene {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let procs = Procs::spawn(1);
        let pid = procs.pid(0);
        let fake = FakeGpu::new();
        fake.add(pid).mark_restored(pid).driver_files(pid, &[0]);
        let inspect: Arc<dyn GpuInspector> = if listed {
            Arc::new(fake.clone())
        } else {
            Arc::new(Unlisted {
                fake: fake.clone(),
                hidden: pid,
                fds: vec![0],
            })
        };
        let gpu = Gpu {
            kind: cryo_gpu::BackendKind::Sim,
            driver: Arc::new(fake.clone()),
            inspect,
        };
        let id = ProcId::of(pid).unwrap();
        let journal = state.open_journal().unwrap();
        journal
            .append(Event::RestoreCompleted {
                pid: id,
                image: "test".into(),
                ms: None,
            })
            .unwrap();
        for e in extra(id) {
            journal.append(e).unwrap();
        }
        let mut cfg = GuardConfig::new(state.clone());
        cfg.memory = None;
        let (guard, report) = Guard::start(gpu, cfg).unwrap();
        assert_eq!(report.attached, vec![id]);
        Scene {
            _dir: dir,
            state,
            _procs: procs,
            id,
            fake,
            guard,
        }
    }

    impl Scene {
        fn kill(&self) {
            rustix::process::kill_process(
                rustix::process::Pid::from_raw(self.id.pid).unwrap(),
                rustix::process::Signal::Kill,
            )
            .unwrap();
        }

        fn events(&self) -> Vec<Event> {
            journal_events(&self.state)
        }

        fn wait_exited(&self) {
            let id = self.id;
            eventually(PATIENCE, "the exit to be journaled", || {
                self.events()
                    .iter()
                    .any(|e| matches!(e, Event::ProcessExited { pid, .. } if *pid == id))
            });
        }

        fn fenced(&self) -> Vec<FencedGpu> {
            self.state
                .fence()
                .list()
                .unwrap()
                .into_iter()
                .map(|q| q.gpu)
                .collect()
        }
    }

    /// NVML fails at the exit stop (its query does not answer): the process still holds driver
    /// files and the journal shows it restored and not suspended since, so its context is live:
    /// pinned, and the fence gets the `unknown` entry (every GPU), since nothing can name its
    /// GPU. End to end: a real process, the real tracer, the fake driver with NVML down.
    #[test]
    fn nvml_failing_at_the_exit_stop_pins_and_fences_the_unknown_gpu() {
        let s = scene_with(|_| Vec::new(), true);
        s.fake.nvml_down(true);
        s.kill();
        s.wait_exited();
        let id = s.id;
        assert!(
            s.events()
                .iter()
                .any(|e| matches!(e, Event::Pinned { pid, gpu, fds } if *pid == id && gpu == "unknown" && *fds == vec![0])),
            "{:?}",
            s.events()
        );
        assert!(
            s.events()
                .iter()
                .any(|e| matches!(e, Event::GpuQuarantined { gpu, .. } if gpu == "unknown")),
            "{:?}",
            s.events()
        );
        assert_eq!(s.fenced(), vec![FencedGpu::Unknown]);
        // The fake ties no context to the fds (its ledger would call any death a wedge): the
        // guard's pin of fd 0 is what holds the real driver's context.
        assert_eq!(s.guard.status().pins.len(), 1);
    }

    /// Before, the decision trusted NVML alone: an unlisted pid had its duplicated fds dropped
    /// (the context torn down). Now its driver files and the journal decide: pinned, every GPU
    /// fenced since NVML cannot name one.
    #[test]
    fn a_restored_process_nvml_does_not_list_is_pinned() {
        let s = scene(|_| Vec::new());
        s.kill();
        s.wait_exited();
        let id = s.id;
        assert!(
            s.events()
                .iter()
                .any(|e| matches!(e, Event::Pinned { pid, gpu, fds } if *pid == id && gpu == "unknown" && *fds == vec![0])),
            "{:?}",
            s.events()
        );
        assert_eq!(s.fenced(), vec![FencedGpu::Unknown]);
        let st = s.guard.status();
        assert_eq!(st.pins.len(), 1, "{st:?}");
    }

    /// The journal shows the context checkpointed since its restore: its teardown is safe, so
    /// nothing is pinned although it held driver files.
    #[test]
    fn a_process_the_journal_shows_suspended_is_not_pinned() {
        let s = scene(|pid| {
            vec![Event::Checkpointed {
                pid,
                ms: 1,
                bytes: 1,
            }]
        });
        s.kill();
        s.wait_exited();
        assert!(
            !s.events()
                .iter()
                .any(|e| matches!(e, Event::Pinned { .. } | Event::GpuQuarantined { .. })),
            "{:?}",
            s.events()
        );
        assert!(s.guard.status().pins.is_empty());
    }

    /// A lease (a dump's let-go) is refused while the process holds driver files and the journal
    /// does not show its context suspended: untraced, its death or exec would tear a live restored
    /// context down. Once the journal shows it checkpointed, the guard lets go, and takes it back.
    #[test]
    fn a_lease_is_refused_until_the_journal_shows_the_context_suspended() {
        let s = scene_with(|_| Vec::new(), true);
        let err = s.guard.lease(s.id).unwrap_err();
        assert!(matches!(err, GuardDetachError::Live { .. }), "{err}");
        assert!(err.to_string().contains("1 driver files"), "{err}");
        assert!(s.guard.guarded().contains(&s.id));
        s.state
            .open_journal()
            .unwrap()
            .append(Event::Checkpointed {
                pid: s.id,
                ms: 1,
                bytes: 1,
            })
            .unwrap();
        s.guard.lease(s.id).unwrap();
        assert!(!s.guard.guarded().contains(&s.id));
        assert!(s.guard.take_back(s.id).unwrap());
        assert!(s.guard.guarded().contains(&s.id));
        // Ended while traced (the test's own wait must not take the tracer's exit stop).
        s.kill();
        s.wait_exited();
    }
}

#[cfg(test)]
mod journal_view_tests {
    #![allow(clippy::unwrap_used)]
    //! The guard's view of the journal (what it polls for restores and checkpoints) while the
    //! journal rotates under it.

    use super::*;

    #[test]
    fn a_rotation_under_the_guard_neither_hides_nor_repeats_a_restored_workers_records() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let journal = state.open_journal().unwrap();
        // A live restored worker (this process stands for it: alive, so its records are carried).
        let worker = ProcId::of(std::process::id() as i32).unwrap();
        let restored = || {
            journal
                .append(Event::RestoreCompleted {
                    pid: worker,
                    image: "/img".into(),
                    ms: None,
                })
                .unwrap();
        };
        restored();
        let mut view = JournalView {
            reader: state.journal_reader(),
            suspended: BTreeSet::new(),
            restores: Vec::new(),
        };
        view.catch_up().unwrap();
        assert_eq!(view.restores, [worker]);
        view.restores.clear();
        // Checkpointed, then rotated (the restore and the checkpoint carried), then checked.
        journal
            .append(Event::Checkpointed {
                pid: worker,
                ms: 1,
                bytes: 1,
            })
            .unwrap();
        journal.rotate().unwrap().unwrap();
        view.catch_up().unwrap();
        assert!(view.suspended.contains(&worker));
        assert!(view.restores.is_empty(), "a carried restore read again");
        // Restored again after the rotation: seen once, and no longer suspended.
        journal.rotate().unwrap().unwrap();
        restored();
        view.catch_up().unwrap();
        assert_eq!(view.restores, [worker]);
        assert!(!view.suspended.contains(&worker));
    }
}
