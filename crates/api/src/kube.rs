//! Stops of Kubernetes containers through the agent: `cryo stop --self` (a preStop hook asks for
//! its own container) and `cryo stop --pod NS/NAME [--container C]`.

use std::path::PathBuf;
use std::time::Duration;

use cryo_lifecycle::{StopReport, Target};
use serde::{Deserialize, Serialize};

use crate::{SignalSpec, StopRequest};

/// Which container(s) a [`KubeStopRequest`] stops.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum KubeTarget {
    /// The caller's own container, as the agent finds it from the peer credentials on its socket
    /// and that process's cgroup (never from anything in the request).
    Caller,
    /// A pod of the agent's node: every running container of it, or the one named.
    Pod {
        /// Its namespace.
        namespace: String,
        /// Its name.
        name: String,
        /// Only this container.
        #[serde(default)]
        container: Option<String>,
    },
}

/// `POST /v1/kube/stop`: a stop of containers, under a deadline the Pod's grace period sets.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KubeStopRequest {
    /// What to stop.
    pub what: KubeTarget,
    /// Timeout of each lock attempt, ms.
    pub lock_timeout_ms: u64,
    /// Lock attempts.
    pub lock_attempts: u32,
    /// How long NVML may keep listing a checkpointed process, ms.
    pub verify_timeout_ms: u64,
    /// At most this long, ms (`None`: the Pod alone decides): the Pod's deadline (its
    /// `deletionTimestamp`, or now plus `terminationGracePeriodSeconds`, minus a margin for the
    /// kill) shortens it.
    #[serde(default)]
    pub deadline_ms: Option<u64>,
    /// Ask each container's engine to release what it can rebuild first (reached from the
    /// pod's network namespace: `--engine-url http://127.0.0.1:PORT` is the pod's loopback). A
    /// container none of whose CUDA processes runs (a sidecar) is not asked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<cryo_lifecycle::Shrink>,
}

impl KubeStopRequest {
    /// The plain stop of one container's cgroup, with `deadline` (the shorter of the request's
    /// and the Pod's, as the agent computed it). Containers are ended with SIGKILL once
    /// suspended (the kubelet would send its own signals otherwise), never `--unsafe`, never
    /// `--fresh`.
    pub fn for_cgroup(&self, cgroup: PathBuf, deadline: Duration) -> StopRequest {
        StopRequest {
            target: (&Target::Cgroup(cgroup)).into(),
            lock_timeout_ms: self.lock_timeout_ms,
            lock_attempts: self.lock_attempts,
            verify_timeout_ms: self.verify_timeout_ms,
            signal: SignalSpec::Kill,
            unsafe_kill: false,
            fresh: false,
            deadline_ms: Some(
                u64::try_from(deadline.as_millis())
                    .unwrap_or(u64::MAX)
                    .max(1),
            ),
            shrink: self.shrink.clone(),
        }
    }
}

/// What a [`KubeStopRequest`] did.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct KubeStopReport {
    /// The pod, `namespace/name`.
    pub pod: String,
    /// The deadline the stops ran under, ms from when the agent took the request.
    pub deadline_ms: u64,
    /// One stop per container, in order.
    pub containers: Vec<ContainerStop>,
}

/// The stop of one container.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ContainerStop {
    /// The container's name in the pod.
    pub container: String,
    /// Its cgroup directory (the whole subtree was the target).
    pub cgroup: PathBuf,
    /// The lifecycle's report.
    pub report: StopReport,
}
