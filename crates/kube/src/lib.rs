//! cryo on Kubernetes: what the node agent (`cryod`) calls to make its work visible to, and safe
//! under, Kubernetes.
//!
//! # Design
//! Pure decisions apart from I/O, each unit-tested:
//! - [`identity`]: a process's pod UID and container ID from its cgroup path (containerd, CRI-O,
//!   Docker; systemd and cgroupfs drivers), hardened against a container naming a sub-cgroup
//!   after another;
//! - [`cgroup`]: a pod's container -> its cgroup directory on cgroup v2 and hybrid v1;
//! - [`caller`]: the preStop caller's container, and the rule that it may stop only that one;
//! - [`grace`]: the stop's deadline from the Pod (deletion timestamp, grace period);
//! - [`gpus`]: the GPU UUIDs a container was given (`NVIDIA_VISIBLE_DEVICES`, CDI names) and the
//!   image -> node GPU map a thaw or wake needs (never by index);
//! - [`fence`]: what the node must show for a set of fenced GPUs (taint, condition, Event);
//! - [`drain`]: which pods the endgame evicts;
//! - [`events`]: which journal events are Events, on which object, aggregated and rate-limited.
//!
//! The I/O is one type, [`NodeClient`]: the agent's client for its own node (`kube` +
//! `k8s-openapi`, core/v1 only, so it works against any API server since 1.20).
//!
//! # Limitations
//! The kubelet running the preStop and a real container runtime are not exercised by the tests
//! (see `docs/kubernetes.md`); the API calls are, against a real kube-apiserver.

pub mod caller;
pub mod cgroup;
pub mod client;
pub mod drain;
pub mod events;
pub mod fence;
pub mod gpus;
pub mod grace;
pub mod identity;

pub use caller::{authorize, caller_identity, Caller, CallerError, CgroupLocator, PodTarget};
pub use cgroup::{CgroupFs, CgroupVersion, ContainerCgroup, QosClass, ResolveError};
pub use client::{ApiError, NodeClient, PodRef, Posted};
pub use drain::{DrainError, EvictionReport};
pub use events::{step_of, subject_of, Correlator, EventType, Locate, Step, Subject};
pub use fence::{FenceError, FenceOutcome, CONDITION_TYPE, TAINT_KEY};
pub use gpus::{gpu_map, Assigned, GpuMapError};
pub use identity::{CgroupIdentity, ContainerId, PodUid, Runtime};
