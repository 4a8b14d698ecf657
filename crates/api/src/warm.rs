//! The warm path's requests: park, wake, and the pre-thawed standby pool.
//!
//! Each request becomes the lifecycle's options through one conversion, which the standalone
//! command uses too, so `cryo park`, `cryo wake` and `cryo standby` mean the same through the
//! agent and without it.

use std::path::PathBuf;
use std::time::Duration;

use cryo_gpu::GpuUuid;
use cryo_lifecycle::{
    HealthCheck, ParkOptions, ParkReport, Progress, Standby, SuspendOptions, WakeOptions,
    WakeReport, WhenFull,
};
use serde::{Deserialize, Serialize};

use crate::{path, AgentClient, ClientError, TargetSpec};

/// What a wake does when the GPU has too little free memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "policy", rename_all = "snake_case", deny_unknown_fields)]
pub enum WhenFullSpec {
    /// Wait up to `wait_s` for memory, then refuse.
    Wait {
        /// Seconds.
        wait_s: u64,
    },
    /// Take another allowed GPU of the same model.
    OtherGpu,
    /// Refuse at once.
    Refuse,
}

impl From<WhenFullSpec> for WhenFull {
    fn from(w: WhenFullSpec) -> WhenFull {
        match w {
            WhenFullSpec::Wait { wait_s } => WhenFull::Wait(Duration::from_secs(wait_s)),
            WhenFullSpec::OtherGpu => WhenFull::OtherGpu,
            WhenFullSpec::Refuse => WhenFull::Refuse,
        }
    }
}

/// `POST /v1/park`: `cryo park`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParkRequest {
    /// What to park.
    pub target: TargetSpec,
    /// Timeout of each lock attempt, ms.
    pub lock_timeout_ms: u64,
    /// Lock attempts.
    pub lock_attempts: u32,
    /// Refuse when parked workers would hold more host memory than this, bytes.
    #[serde(default)]
    pub max_parked_host: Option<u64>,
    /// Ask the engine to release what it can rebuild before the suspension (the wake takes it
    /// back).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<cryo_lifecycle::Shrink>,
}

impl ParkRequest {
    /// The request for `target` that [`ParkRequest::options`] turns back into `o` (its lock
    /// settings and host memory limit; no shrink).
    pub fn of(target: TargetSpec, o: &ParkOptions) -> ParkRequest {
        ParkRequest {
            target,
            lock_timeout_ms: u64::try_from(o.suspend.lock_timeout.as_millis()).unwrap_or(u64::MAX),
            lock_attempts: o.suspend.lock_attempts,
            max_parked_host: o.max_parked_host,
            shrink: None,
        }
    }

    /// The lifecycle's options for it (the standalone command uses the same).
    pub fn options(&self) -> ParkOptions {
        ParkOptions {
            suspend: SuspendOptions {
                lock_timeout: Duration::from_millis(self.lock_timeout_ms),
                lock_attempts: self.lock_attempts,
                resume_on_failure: true,
                ..SuspendOptions::default()
            },
            max_parked_host: self.max_parked_host,
            shrink: self.shrink.clone(),
        }
    }
}

/// How the wake of a parked worker or the claim of a standby is done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WakeSpec {
    /// GPUs it may use (empty: the ones it left, any with `other_gpu`).
    #[serde(default)]
    pub onto: Vec<GpuUuid>,
    /// When the GPU is full.
    pub when_full: WhenFullSpec,
    /// Healthy when a GET of this URL answers 2xx (`None`: once unlocked).
    #[serde(default)]
    pub health_url: Option<String>,
    /// Seconds the health check may take.
    pub health_timeout_s: u64,
}

impl WakeSpec {
    /// The lifecycle's options for it.
    pub fn options(&self) -> WakeOptions {
        WakeOptions {
            gpus: (!self.onto.is_empty()).then(|| self.onto.clone()),
            when_full: self.when_full.into(),
            health: self.health_url.clone().map(HealthCheck::Url),
            health_timeout: Duration::from_secs(self.health_timeout_s),
            resuspend: SuspendOptions::default(),
        }
    }
}

/// `POST /v1/wake`: `cryo wake`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WakeRequest {
    /// What to wake.
    pub target: TargetSpec,
    /// How.
    pub wake: WakeSpec,
}

/// `POST /v1/standby/create`: keep `count` standbys of an image ready (replaces the count of
/// an existing pool).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyCreateRequest {
    /// The image.
    pub image: PathBuf,
    /// How many to keep ready (at least 1).
    pub count: u32,
    /// The deadline of each standby's CRIU restore, s (absent: two minutes plus the image at
    /// 50 MB/s, as a thaw's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub criu_timeout_s: Option<u64>,
}

/// `POST /v1/standby/claim`: hand out one standby of an image, woken.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyClaimRequest {
    /// The image whose pool to claim from.
    pub image: PathBuf,
    /// How to wake it.
    pub wake: WakeSpec,
}

/// `POST /v1/standby/remove`: end a pool (its standbys are removed safely: CHECKPOINTED,
/// verified, killed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StandbyRemoveRequest {
    /// The image whose pool to remove.
    pub image: PathBuf,
}

/// One pool, as `GET /v1/standby` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PoolStatus {
    /// The image.
    pub image: PathBuf,
    /// How many it keeps ready.
    pub count: u32,
    /// The standbys ready now, oldest first.
    pub ready: Vec<Standby>,
    /// Standbys being restored now.
    pub refilling: u32,
    /// Why the last refill failed, if it did (it is tried again).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// `GET /v1/standby`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyList {
    /// Every pool.
    pub pools: Vec<PoolStatus>,
}

/// The answer to a claim: the standby handed out and its wake.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StandbyClaim {
    /// The standby (now a serving worker).
    pub standby: Standby,
    /// Its wake.
    pub wake: WakeReport,
    /// From the request to the end, ms.
    pub elapsed_ms: u64,
}

/// `POST /v1/activators`: the agent listens on `listen` in front of a worker parked in place
/// (`target`) or of a standby pool (`standby`), and keeps listening across its own restarts
/// (`cryo activate` while an agent runs).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActivatorSpec {
    /// The service address clients use: HOST:PORT or unix:/PATH (a TCP port 0 is resolved).
    pub listen: String,
    /// Where the worker itself serves.
    pub upstream: String,
    /// The worker, parked in place (`None`: `standby`).
    #[serde(default)]
    pub target: Option<TargetSpec>,
    /// No worker yet: the first connection claims a standby of this image.
    #[serde(default)]
    pub standby: Option<PathBuf>,
    /// How wakes (and the claim) are done; its health URL is the activator's health check,
    /// reached in the worker's network namespace.
    pub wake: WakeSpec,
    /// Park after this many seconds without an open connection (0: never).
    pub idle_timeout_s: u64,
    /// How long a connection waits for an activation, s.
    pub activation_timeout_s: u64,
    /// The protocol is HTTP: a connection that cannot be served gets a 503 with the reason.
    pub http: bool,
    /// Refuse an idle park when parked workers would hold more host memory than this, bytes.
    #[serde(default)]
    pub max_parked_host: Option<u64>,
}

/// One of the agent's activators now.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivatorStatus {
    /// What it was created with (`listen` resolved).
    pub spec: ActivatorSpec,
    /// `active`, `parked`, `waking` or `parking`.
    pub phase: String,
    /// Why the last activation failed, if it did.
    pub last_error: Option<String>,
    /// Activations started.
    pub activations: u64,
    /// Activations that failed.
    pub failed_activations: u64,
    /// Idle parks.
    pub idle_parks: u64,
    /// Connections forwarded.
    pub forwarded: u64,
    /// Connections answered with an error.
    pub rejected: u64,
    /// The worker a standby activator claimed, if it did.
    pub claimed: Option<cryo_journal::ProcId>,
}

/// `GET /v1/activators`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ActivatorList {
    /// Every activator of the agent.
    pub activators: Vec<ActivatorStatus>,
}

/// `POST /v1/activators/remove`: stop listening (the worker stays as it is).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ActivatorRemoveRequest {
    /// The address it listens on, as listed.
    pub listen: String,
}

/// The answer to a removal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StandbyRemoved {
    /// What became of each standby, by root pid.
    pub removed: Vec<(cryo_journal::ProcId, String)>,
}

impl AgentClient {
    /// `POST /v1/park`, its progress replayed on `progress`.
    pub fn park(
        &self,
        req: &ParkRequest,
        progress: &dyn Progress,
    ) -> Result<ParkReport, ClientError> {
        self.stream(path::PARK, req, progress)
    }

    /// `POST /v1/wake`.
    pub fn wake(
        &self,
        req: &WakeRequest,
        progress: &dyn Progress,
    ) -> Result<WakeReport, ClientError> {
        self.stream(path::WAKE, req, progress)
    }

    /// `GET /v1/standby`.
    pub fn standby_list(&self) -> Result<StandbyList, ClientError> {
        self.get(path::STANDBY)
    }

    /// `POST /v1/standby/create`.
    pub fn standby_create(&self, req: &StandbyCreateRequest) -> Result<PoolStatus, ClientError> {
        self.post(&self.short, &format!("{}/create", path::STANDBY), req)
    }

    /// `POST /v1/standby/claim` (waits as long as the wake takes).
    pub fn standby_claim(&self, req: &StandbyClaimRequest) -> Result<StandbyClaim, ClientError> {
        self.post(&self.long, &format!("{}/claim", path::STANDBY), req)
    }

    /// `GET /v1/activators`.
    pub fn activators(&self) -> Result<ActivatorList, ClientError> {
        self.get(path::ACTIVATORS)
    }

    /// `POST /v1/activators`: listening once it answers.
    pub fn activator_create(&self, spec: &ActivatorSpec) -> Result<ActivatorStatus, ClientError> {
        self.post(&self.short, path::ACTIVATORS, spec)
    }

    /// `POST /v1/activators/remove`.
    pub fn activator_remove(
        &self,
        req: &ActivatorRemoveRequest,
    ) -> Result<ActivatorStatus, ClientError> {
        self.post(&self.short, &format!("{}/remove", path::ACTIVATORS), req)
    }

    /// `POST /v1/standby/remove`.
    pub fn standby_remove(
        &self,
        req: &StandbyRemoveRequest,
    ) -> Result<StandbyRemoved, ClientError> {
        self.post(&self.long, &format!("{}/remove", path::STANDBY), req)
    }
}
