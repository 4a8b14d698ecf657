//! Requests and answers, one type per endpoint.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use cryo_gpu::GpuPair;
use cryo_guard::control::Confirmation;
use cryo_journal::ProcId;
use cryo_lifecycle::{
    EndSignal, FreezeOptions, HealthCheck, Shrink, StopOptions, SuspendOptions, Target, ThawOptions,
};
use cryo_proc::Pid;
use cryo_state::fence::{FencedGpu, Quarantine};
use serde::{Deserialize, Serialize};

/// What a stop or freeze acts on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum TargetSpec {
    /// A process and its descendants.
    Tree {
        /// The root.
        pid: Pid,
    },
    /// Exactly these processes.
    Pids {
        /// The pids.
        pids: Vec<Pid>,
    },
    /// Every process of a cgroup (and its sub-cgroups).
    Cgroup {
        /// The cgroup's directory.
        path: PathBuf,
    },
}

impl From<&TargetSpec> for Target {
    fn from(t: &TargetSpec) -> Target {
        match t {
            TargetSpec::Tree { pid } => Target::Tree(*pid),
            TargetSpec::Pids { pids } => Target::Pids(pids.clone()),
            TargetSpec::Cgroup { path } => Target::Cgroup(path.clone()),
        }
    }
}

impl From<&Target> for TargetSpec {
    fn from(t: &Target) -> TargetSpec {
        match t {
            Target::Tree(pid) => TargetSpec::Tree { pid: *pid },
            Target::Pids(pids) => TargetSpec::Pids { pids: pids.clone() },
            Target::Cgroup(path) => TargetSpec::Cgroup { path: path.clone() },
        }
    }
}

/// How a stop ends each process once its contexts are suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "signal", rename_all = "snake_case", deny_unknown_fields)]
pub enum SignalSpec {
    /// SIGKILL.
    Kill,
    /// SIGTERM, then SIGKILL after `grace_s`.
    Term {
        /// Seconds between the two.
        grace_s: u64,
    },
}

/// `POST /v1/stop`: `cryo stop`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StopRequest {
    /// What to stop.
    pub target: TargetSpec,
    /// Timeout of each lock attempt, ms.
    pub lock_timeout_ms: u64,
    /// Lock attempts.
    pub lock_attempts: u32,
    /// How long NVML may keep listing a checkpointed process, ms.
    pub verify_timeout_ms: u64,
    /// How processes are ended.
    pub signal: SignalSpec,
    /// Kill what cannot be suspended (may wedge the host).
    pub unsafe_kill: bool,
    /// The target never came from a restore: kill without suspending.
    pub fresh: bool,
    /// The whole stop's deadline, ms (`None`: none): what is not suspended by then is refused.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// Ask the engine to release what it can rebuild before the suspension.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<Shrink>,
}

impl StopRequest {
    /// The lifecycle's options for it (the standalone command uses the same).
    pub fn options(&self) -> StopOptions {
        StopOptions {
            suspend: SuspendOptions {
                lock_timeout: Duration::from_millis(self.lock_timeout_ms),
                lock_attempts: self.lock_attempts,
                verify_timeout: Duration::from_millis(self.verify_timeout_ms),
                // A stop leaves what it could not finish checkpointed (safe); it does not resume it.
                resume_on_failure: false,
                ..SuspendOptions::default()
            },
            signal: match self.signal {
                SignalSpec::Kill => EndSignal::Kill,
                SignalSpec::Term { grace_s } => EndSignal::Term {
                    grace: Duration::from_secs(grace_s),
                },
            },
            unsafe_kill: self.unsafe_kill,
            fresh: self.fresh,
            deadline: self.deadline_ms.map(Duration::from_millis),
            shrink: self.shrink.clone(),
            ..StopOptions::default()
        }
    }

    /// The target.
    pub fn target(&self) -> Target {
        (&self.target).into()
    }
}

/// `POST /v1/freeze`: `cryo freeze`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FreezeRequest {
    /// The root of the tree.
    pub pid: Pid,
    /// Where to publish the image.
    pub image: PathBuf,
    /// Keep the tree running afterwards.
    pub leave_running: bool,
    /// Replace an existing image.
    pub replace: bool,
    /// Lock timeout, ms.
    pub lock_timeout_ms: u64,
    /// Ask the engine to release what it can rebuild before the suspension (and to take it back
    /// when the tree runs on).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<Shrink>,
}

impl FreezeRequest {
    /// The lifecycle's options for it.
    pub fn options(&self) -> FreezeOptions {
        FreezeOptions {
            image: self.image.clone(),
            leave_running: self.leave_running,
            replace: self.replace,
            suspend: SuspendOptions {
                lock_timeout: Duration::from_millis(self.lock_timeout_ms),
                resume_on_failure: true,
                ..SuspendOptions::default()
            },
            shrink: self.shrink.clone(),
        }
    }
}

/// How a thaw tells the worker serves.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum HealthSpec {
    /// `GET` this URL until 2xx.
    Url(String),
    /// Run this command until it exits 0.
    Cmd(String),
}

/// `POST /v1/thaw`: `cryo thaw`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThawRequest {
    /// The image.
    pub image: PathBuf,
    /// GPUs of the image to restore onto others (UUIDs, resolved by the client).
    #[serde(default)]
    pub gpu_map: Vec<GpuPair>,
    /// The health check.
    pub health: Option<HealthSpec>,
    /// Its timeout, s.
    pub health_timeout_s: u64,
    /// The image was frozen after this shrink: the engine is asked to grow once the tree runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrunk: Option<Shrink>,
    /// How long CRIU's restore may take, s (absent: the lifecycle's default for the image).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criu_timeout_s: Option<u64>,
}

impl ThawRequest {
    /// The lifecycle's options for it; `requested` is when the request arrived.
    pub fn options(&self, requested: Instant) -> ThawOptions {
        ThawOptions {
            gpu_map: self.gpu_map.clone(),
            health: self.health.as_ref().map(|h| match h {
                HealthSpec::Url(u) => HealthCheck::Url(u.clone()),
                HealthSpec::Cmd(c) => HealthCheck::Cmd(c.clone()),
            }),
            health_timeout: Duration::from_secs(self.health_timeout_s),
            // Cleaning up after a failed thaw has no grace period to fit in: it takes what the
            // suspension needs (each driver call still has its own deadline).
            stop: StopOptions {
                deadline: None,
                ..StopOptions::default()
            },
            requested,
            shrunk: self.shrunk.clone(),
            criu_timeout: self.criu_timeout_s.map(Duration::from_secs),
        }
    }
}

/// `POST /v1/guard/attach` and `/v1/guard/detach`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PidRequest {
    /// The process, by pid and start time (a pid reused since is refused).
    pub pid: ProcId,
}

/// The answer to an attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AttachReport {
    /// The process now guarded.
    pub pid: ProcId,
}

/// The answer to a detach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DetachReport {
    /// The guard let go of it.
    Detached,
    /// The guard was not tracing it.
    NotTraced,
}

/// `POST /v1/guard/release`: close the pins on a GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The GPU (or `unknown`).
    pub gpu: FencedGpu,
    /// The caller knows closing pins may wedge the host.
    pub confirm: Confirmation,
    /// More GPUs released together with `gpu`: a pin that holds contexts on several GPUs is
    /// closed only when every one of them is named (else the release is refused).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<FencedGpu>,
}

/// The answer to a release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReleaseReport {
    /// The processes whose pins were closed.
    pub pids: Vec<ProcId>,
}

/// The answer to a shutdown request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShutdownReport {
    /// The agent's pid (gone once the socket stops answering).
    pub pid: u32,
}

/// `GET /v1/status`: what the agent is and holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AgentStatus {
    /// cryo's version.
    pub version: String,
    /// The agent's pid.
    pub pid: u32,
    /// When it started, seconds since the Unix epoch.
    pub started_unix: u64,
    /// Seconds since.
    pub uptime_s: u64,
    /// The API socket.
    pub socket: PathBuf,
    /// The state directory.
    pub state_dir: PathBuf,
    /// The group whose members may read (`None`: root only).
    pub read_group: Option<String>,
    /// The GPU backend (`cuda`, `sim`).
    pub backend: String,
    /// The guard: what it guards and why, what it pins.
    pub guard: cryo_guard::GuardStatus,
    /// The fence: quarantined GPUs.
    pub quarantined: Vec<Quarantine>,
    /// Why the fence could not be read, if it could not (thaws are refused then).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence_error: Option<String>,
    /// The pin holder (the process that keeps pinned driver fds across agent restarts).
    pub holder: String,
    /// Where `/metrics` is served on TCP, if it is.
    pub metrics_addr: Option<String>,
    /// The syslog forwarder, if one runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub syslog: Option<SyslogStatus>,
    /// Whether a shutdown was asked for (and is refused while pins are held).
    pub stopping: bool,
}

/// The syslog forwarder's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SyslogStatus {
    /// The collector.
    pub collector: String,
    /// The highest `seq` it acknowledged.
    pub delivered_seq: u64,
    /// Whether connected now.
    pub connected: bool,
    /// The last failure.
    pub last_error: Option<String>,
}
