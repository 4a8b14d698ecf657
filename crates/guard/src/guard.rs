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
//!   act any more, so the driver is not asked for a state. The context counts as live when NVML
//!   lists the pid (or, NVML failing, when driver fds are open). Live: every driver fd
//!   ([`cryo_gpu::GpuInspector::driver_fds`]) is duplicated, `Pinned` is journaled per GPU, the GPU
//!   is quarantined ([`cryo_state::fence`]) and `GpuQuarantined` journaled, all before the
//!   process is released. The duplicates stay in this process; the context is never torn down
//!   until an operator releases them ([`Guard::release`]). Not live (suspended): nothing is held.
//! - **Endgame** after a quarantine: [`Endgame::Hold`] waits for the operator;
//!   [`Endgame::Drain`] stops every other GPU process of the node through
//!   [`cryo_lifecycle::stop`] (suspend-before-kill), then runs the operator's command.
//! - **Memory**: guarded processes get a low `oom_score_adj` (refused without
//!   `CAP_SYS_RESOURCE`, which is reported per process), and [`Guard::check_memory`] suspends and
//!   stops a guarded worker whose memory cgroup has less headroom than its device memory plus a
//!   margin (a checkpoint moves device memory into host memory, so it must happen while there is
//!   room for it), or whose PSI `some avg10` passes a threshold.
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
//! - The memory check polls (every `MemoryWatch::interval`); a sudden allocation larger than the
//!   headroom still ends in an OOM kill, which the exit stop catches.

use std::collections::{BTreeMap, BTreeSet};
use std::os::fd::RawFd;
use std::path::Path;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use cryo_gpu::Gpu;
use cryo_journal::{Event, Journal, ProcId, Reader, Record};
use cryo_lifecycle::{NoProgress, ResolveError, Resolved, StopOptions, SuspendOptions, Target};
use cryo_proc::{Pid, ProcHandle};
use cryo_state::fence::{Fence, FenceError, FencedGpu};
use cryo_state::StateDir;
use serde::{Deserialize, Serialize};

use crate::memory::{CgroupVersion, MemoryCgroup};
use crate::pins::PinSink;
use crate::policy::{Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee};
use crate::tracer::{AttachError, DetachError, SpawnError, Tracer, TracerGone};

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
    /// Also act when PSI `some avg10` (percent) of its pressure source reaches this; `None`: off.
    pub psi_some_avg10: Option<f64>,
    /// How often to look.
    pub interval: Duration,
}

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
                psi_some_avg10: None,
                interval: Duration::from_millis(250),
            }),
            pin_sink: None,
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
}

/// One guarded process, as `cryo status` shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct GuardedInfo {
    /// Pid.
    pub pid: Pid,
    /// Start time (clock ticks), with the pid its identity.
    pub start_time: u64,
    /// `journal` (restored by cryo) or `pid` (named by the operator).
    pub source: String,
    /// The `oom_score_adj` set, or why it could not be.
    pub oom_score_adj: String,
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
}

struct Watched {
    id: ProcId,
    handle: Arc<ProcHandle>,
    source: &'static str,
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
    /// Detached on request (for a CRIU dump), by identity: a process restored later under the same
    /// pid is another process and is guarded.
    paused: Mutex<BTreeSet<ProcId>>,
    pins: Mutex<Vec<Pin>>,
    /// The state directory's pin holder ([`GuardConfig::pin_sink`], or the holder of the state
    /// directory if one runs): asked for its inventory and for releases even when pins are not
    /// handed to it.
    holder: Arc<dyn PinSink>,
    /// Whether the operator was told that this host refuses `oom_score_adj` (once is enough:
    /// every later process gets the same answer, shown per process in `cryo status`).
    oom_warned: std::sync::atomic::AtomicBool,
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
            .unwrap_or_else(|| ProcId::of(pid).unwrap_or(ProcId { pid, start_time: 0 }))
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
        let mut open: BTreeMap<ProcId, Vec<FencedGpu>> = BTreeMap::new();
        for r in records {
            match &r.event {
                Event::Pinned { pid, gpu, .. } => open
                    .entry(*pid)
                    .or_default()
                    .push(gpu.parse().unwrap_or(FencedGpu::Unknown)),
                Event::PinsReleased { pid } | Event::PinsLost { pid, .. } => {
                    open.remove(pid);
                }
                _ => {}
            }
        }
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

    fn run_endgame(self: &Arc<Self>) {
        let Endgame::Drain { restart_cmd } = self.cfg.endgame.clone() else {
            return;
        };
        let inner = Arc::clone(self);
        let spawned = std::thread::Builder::new()
            .name("cryo-guard-drain".into())
            .spawn(move || inner.drain(restart_cmd.as_deref()));
        if let Err(err) = spawned {
            tracing::error!(%err, "cannot start the drain endgame");
        }
    }

    fn drain(&self, restart_cmd: Option<&str>) {
        let pinned: BTreeSet<Pid> = lock(&self.pins).iter().map(|p| p.id.pid).collect();
        let others: BTreeSet<Pid> = match self.gpu.inspect.processes() {
            Ok(list) => list
                .into_iter()
                .map(|p| p.pid)
                .filter(|p| !pinned.contains(p))
                .collect(),
            Err(err) => {
                tracing::error!(%err, "drain: cannot list GPU processes; nothing stopped");
                return;
            }
        };
        let mut all_stopped = true;
        for pid in others {
            match self.stop(Target::Pids(vec![pid]).resolve()) {
                Ok(r) if r.stopped() => tracing::warn!(pid, "drain: stopped (suspended first)"),
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
        let outcome = cryo_lifecycle::suspend(
            &inner.gpu,
            &[&handle],
            &inner.cfg.suspend,
            Some(&inner.journal),
            &NoProgress,
        );
        match outcome.into_iter().next().map(|o| o.result) {
            Some(Ok(s)) => {
                tracing::warn!(pid, signal = %cryo_proc::signal_name(signal.signal), state_before = %s.state_before, "suspended before delivering a fatal signal");
            }
            Some(Err(f)) => {
                tracing::error!(pid, reason = %f.reason(), "cannot suspend before a fatal signal; the exit stop will pin");
                inner.record(Event::Refused {
                    pid: id,
                    reason: f.reason(),
                    hint: "the guard pins the context's driver fds at the exit stop and fences the GPU".into(),
                });
            }
            None => {}
        }
        Decision::Deliver
    }

    fn fds_to_pin(&self, target: &Tracee) -> Vec<RawFd> {
        let pid = target.pid();
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
        let (listed, gpus) = match inner.gpu.inspect.processes() {
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
                tracing::error!(pid, %err, "NVML query failed at the exit stop; treating open driver fds as a live context");
                (!pinned.fds.is_empty(), Vec::new())
            }
        };
        if !listed {
            // Suspended (or never had a context): its teardown is the safe kind.
            return;
        }
        let how = describe(cause);
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
                inner.record(Event::Pinned {
                    pid: id,
                    gpu: gpu.to_string(),
                    fds: fds.clone(),
                });
            }
        }
        inner.quarantine(id, &gpus, &reason);
        tracing::error!(pid, %how, ?gpus, "context pinned and GPU quarantined");
        if !fds.is_empty() {
            // Still at the exit stop: the process is released only after this returns, so the
            // holder acknowledges before the guard's copies (or the process's own) close.
            match inner.hand_to_sink(id, &gpus, &how, &pinned) {
                Some(holder) => {
                    tracing::warn!(pid, holder = holder.pid, "pins handed to the pin holder");
                    drop(pinned);
                }
                None => lock(&inner.pins).push(Pin {
                    id,
                    gpus,
                    cause: how,
                    held: pinned,
                }),
            }
        }
        inner.run_endgame();
    }

    fn on_gone(&self, target: &Tracee, cause: ExitCause) {
        let pid = target.pid();
        let w = lock(&self.0.watched).remove(&pid);
        let id = w.map_or_else(|| self.0.id_of(pid), |w| w.id);
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
    reader: Mutex<Reader>,
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
        // A guard (or stop, or freeze) that died half-way left a worker locked or checkpointed:
        // finish or undo that first, before anything is attached.
        let settled = cryo_lifecycle::settle_in_flight(&gpu, &journal)?;
        let inner = Arc::new(Inner {
            gpu,
            journal,
            fence: cfg.state.fence(),
            watched: Mutex::new(BTreeMap::new()),
            paused: Mutex::new(BTreeSet::new()),
            pins: Mutex::new(Vec::new()),
            oom_warned: std::sync::atomic::AtomicBool::new(false),
            holder: cfg.pin_sink.clone().unwrap_or_else(|| {
                Arc::new(crate::pins::HolderSink::new(&cfg.state)) as Arc<dyn PinSink>
            }),
            cfg,
        });
        let tracer = Tracer::spawn(Arc::new(PolicyHandle(Arc::clone(&inner))))?;
        let mut reader = inner.cfg.state.journal_reader();
        let records = reader.read_new()?.records;
        inner.adopt_pins(&records);
        let guard = Guard {
            inner,
            tracer,
            reader: Mutex::new(reader),
        };
        let mut report = guard.adopt(&records);
        report.settled = settled;
        Ok((guard, report))
    }

    fn adopt(&self, records: &[Record]) -> StartReport {
        let mut report = StartReport::default();
        let origins = cryo_journal::Origins::from_records(records);
        for id in origins.live_restored() {
            match self.attach(id, "journal") {
                Ok(()) => report.attached.push(id),
                Err(e) => {
                    self.inner.record(Event::GuardLost { pid: id });
                    report.lost.push((id, format!("cannot attach: {e}")));
                }
            }
        }
        // Guarded before, dead now, and no record of how it ended: it died unwatched.
        let mut open: BTreeSet<ProcId> = BTreeSet::new();
        for r in records {
            match &r.event {
                Event::GuardAttached { pid } => {
                    open.insert(*pid);
                }
                Event::GuardLost { pid }
                | Event::ProcessExited { pid, .. }
                | Event::Pinned { pid, .. }
                | Event::Killed { pid } => {
                    open.remove(pid);
                }
                _ => {}
            }
        }
        for id in open {
            if !id.is_alive_same() {
                self.inner.record(Event::GuardLost { pid: id });
                report
                    .lost
                    .push((id, "exited while no guard was watching".into()));
            }
        }
        report
    }

    /// Guards `id`: attaches, lowers its `oom_score_adj`, journals `GuardAttached`.
    fn attach(&self, id: ProcId, source: &'static str) -> Result<(), GuardAttachError> {
        if lock(&self.inner.watched)
            .get(&id.pid)
            .is_some_and(|w| w.id == id)
        {
            return Ok(());
        }
        let handle = ProcHandle::open_expected(id.pid, id.start_time)?;
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
        if let Err(e) = self.tracer.attach_handle(traced) {
            lock(&self.inner.watched).remove(&id.pid);
            return Err(e.into());
        }
        lock(&self.inner.paused).remove(&id);
        self.inner
            .journal
            .append(Event::GuardAttached { pid: id })?;
        tracing::info!(pid = id.pid, source, "guarding");
        Ok(())
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
        self.attach(id, "pid")
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
        lock(&self.inner.paused).insert(id);
        match self.tracer.detach(pid) {
            Ok(()) => {
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

    /// Reads the journal's new records and guards every process a new `RestoreCompleted` names.
    pub fn poll_journal(&self) -> Result<Vec<ProcId>, cryo_journal::ReadError> {
        let records = lock(&self.reader).read_new()?.records;
        lock(&self.inner.paused).retain(ProcId::is_alive_same);
        let mut attached = Vec::new();
        for r in &records {
            if let Event::RestoreCompleted { pid, .. } = &r.event {
                if lock(&self.inner.paused).contains(pid) || !pid.is_alive_same() {
                    continue;
                }
                match self.attach(*pid, "journal") {
                    Ok(()) => attached.push(*pid),
                    Err(e) => {
                        tracing::error!(pid = pid.pid, err = %e, "cannot guard a restored process");
                        self.inner.record(Event::GuardLost { pid: *pid });
                    }
                }
            }
        }
        Ok(attached)
    }

    /// The operator's release of the contexts pinned on `gpu`: closes the duplicates (on
    /// affected hosts the driver then tears the contexts down, which is what wedges them) and
    /// lifts the quarantine. Returns the processes whose pins were closed.
    pub fn release(&self, gpu: &FencedGpu) -> Result<Vec<ProcId>, ReleaseError> {
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
        let mut released = crate::pins::journal_released(&self.inner.journal, gpu, &in_holder);
        for p in taken {
            tracing::warn!(
                pid = p.id.pid,
                %gpu,
                fds = p.held.fds.len(),
                "closing pins on the operator's request"
            );
            drop(p.held);
            self.inner.record(Event::PinsReleased { pid: p.id });
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
                source: w.source.to_string(),
                oom_score_adj: w.oom.clone(),
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
            paused: lock(&self.inner.paused).iter().map(|p| p.pid).collect(),
            pins,
            endgame: match &self.inner.cfg.endgame {
                Endgame::Hold => "hold".into(),
                Endgame::Drain { .. } => "drain".into(),
            },
        }
    }

    /// One pass of the memory watch: suspends and stops (through [`cryo_lifecycle::stop`]) each
    /// guarded process whose cgroup is about to run out of room. Returns the processes stopped.
    pub fn check_memory(&self) -> Vec<ProcId> {
        let Some(watch) = self.inner.cfg.memory.clone() else {
            return Vec::new();
        };
        let ids: Vec<ProcId> = lock(&self.inner.watched).values().map(|w| w.id).collect();
        let mut stopped = Vec::new();
        for id in ids {
            let Some(why) = memory_trigger(&self.inner.gpu, id, &watch) else {
                continue;
            };
            tracing::warn!(pid = id.pid, %why, "memory pressure: suspending and stopping before the OOM killer acts");
            // The very process guarded, not whatever holds its pid now.
            let target = ProcHandle::open_expected(id.pid, id.start_time)
                .map(|h| Resolved::from_handles(Target::Pids(vec![id.pid]), vec![h]))
                .map_err(ResolveError::from);
            match self.inner.stop(target) {
                Ok(r) if r.stopped() => stopped.push(id),
                Ok(r) => {
                    tracing::error!(pid = id.pid, refusals = ?r.refusals, "memory pressure: could not suspend; the exit stop will pin")
                }
                Err(err) => tracing::error!(pid = id.pid, %err, "memory pressure: stop failed"),
            }
        }
        stopped
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

/// Why `pid` must be suspended now, if it must.
fn memory_trigger(gpu: &Gpu, id: ProcId, watch: &MemoryWatch) -> Option<String> {
    let pid = id.pid;
    let handle = ProcHandle::open_expected(id.pid, id.start_time).ok()?;
    let cg = MemoryCgroup::of(&handle).ok()?;
    let (usage, limit) = match cg.version {
        CgroupVersion::V1 => (
            read_u64(&cg.dir.join("memory.usage_in_bytes")),
            read_u64(&cg.dir.join("memory.limit_in_bytes")),
        ),
        CgroupVersion::V2 => (
            read_u64(&cg.dir.join("memory.current")),
            read_u64(&cg.dir.join("memory.max")),
        ),
    };
    if let (Some(usage), Some(limit)) = (usage, limit) {
        // v1 says "no limit" with a huge page-rounded number.
        if limit < (1 << 60) {
            let device = gpu.inspect.process_memory(pid).ok().flatten().unwrap_or(0);
            let room = limit.saturating_sub(usage);
            if device > 0 && room < device.saturating_add(watch.margin) {
                return Some(format!("{room} bytes left in {} (limit {limit}), checkpoint needs {device} + margin {}", cg.dir.display(), watch.margin));
            }
        }
    }
    if let Some(threshold) = watch.psi_some_avg10 {
        if let Ok(psi) = cg.pressure() {
            if psi.some.avg10 >= threshold {
                return Some(format!(
                    "memory PSI some avg10 {:.1}% >= {threshold}%",
                    psi.some.avg10
                ));
            }
        }
    }
    None
}

fn read_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// The node agent asks its in-process guard to let go of a process around a CRIU dump.
impl cryo_lifecycle::Watcher for Guard {
    fn detach(&self, pid: ProcId) -> Result<bool, cryo_lifecycle::WatcherError> {
        match Guard::detach(self, pid) {
            Ok(()) => Ok(true),
            Err(GuardDetachError::NotTraced { .. }) => Ok(false),
            Err(e) => Err(cryo_lifecycle::WatcherError::new(e)),
        }
    }

    fn attach(&self, pid: ProcId) -> Result<(), cryo_lifecycle::WatcherError> {
        self.attach_id(pid)
            .map_err(cryo_lifecycle::WatcherError::new)
    }

    fn guard_before_unlock(
        &self,
        procs: &[&cryo_proc::ProcHandle],
    ) -> Result<cryo_lifecycle::Coverage, cryo_lifecycle::WatcherError> {
        for p in procs {
            self.attach_id(ProcId {
                pid: p.pid(),
                start_time: p.start_time(),
            })
            .map_err(cryo_lifecycle::WatcherError::new)?;
        }
        Ok(cryo_lifecycle::Coverage::Guarded)
    }
}
