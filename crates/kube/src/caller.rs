//! The caller of a preStop: which container a process on the agent's socket is, and what it may
//! stop (only its own container).
//!
//! # Design
//! The agent takes the caller's pid from the socket's peer credentials and holds it through a
//! pidfd ([`cryo_proc::ProcHandle`]: SO_PEERPIDFD, or pidfd_open while the connection is open).
//! [`caller_identity`] reads the process's cgroups and checks the process is still alive after
//! the read (so the pid was not reused in between) and names the pod and container from the path
//! ([`crate::identity`]: the component directly below the pod's, so a sub-cgroup a container
//! made cannot impersonate another). [`NodeClient::resolve_caller`] then requires that pod to be
//! on this node and that container to be in its status, and reads the deadline from the Pod.
//! [`authorize`] (pure) lets a caller act only on processes whose cgroups name the same pod and
//! container.

use std::time::SystemTime;

use cryo_journal::ProcId;
use cryo_proc::ProcHandle;
use k8s_openapi::api::core::v1::Pod;

use crate::cgroup::{CgroupFs, ContainerCgroup, QosClass, ResolveError};
use crate::client::{pod_ref_of, ApiError, NodeClient, PodRef};
use crate::events::Locate;
use crate::grace::stop_deadline;
use crate::identity::{identity_from_cgroups, CgroupIdentity, ContainerId, IdentityError, PodUid};

/// Identifying or authorising a caller failed.
#[derive(Debug, thiserror::Error)]
pub enum CallerError {
    /// The process could not be read (gone, or reused during the read).
    #[error("pid {pid}: {source}")]
    Proc {
        /// The pid.
        pid: i32,
        /// What failed.
        #[source]
        source: cryo_proc::ProcError,
    },
    /// Its cgroups do not name one container.
    #[error("pid {pid}: {source}")]
    Identity {
        /// The pid.
        pid: i32,
        /// Why.
        #[source]
        source: IdentityError,
    },
    /// Its pod is not on this node (or is gone).
    #[error("pod {0} is not on this node")]
    PodNotHere(PodUid),
    /// Its container is not in the pod's status.
    #[error("pod {pod}: no container with ID {container} in its status")]
    ContainerNotInPod {
        /// The pod.
        pod: PodRef,
        /// The container ID from the cgroup.
        container: String,
    },
    /// A target is not the caller's container.
    #[error("refused: pid {target} is in pod {target_pod} container {target_container}, not in the caller's (pod {pod} container {container})")]
    Foreign {
        /// The target process.
        target: i32,
        /// Its pod.
        target_pod: PodUid,
        /// Its container.
        target_container: String,
        /// The caller's pod.
        pod: PodUid,
        /// The caller's container.
        container: String,
    },
    /// A call to the API server failed.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The container's cgroup could not be found.
    #[error(transparent)]
    Resolve(#[from] ResolveError),
}

/// Who the process is: the pod and container its cgroups name.
pub fn caller_identity(handle: &ProcHandle) -> Result<CgroupIdentity, CallerError> {
    let pid = handle.pid();
    let cgroups = handle
        .cgroups()
        .map_err(|source| CallerError::Proc { pid, source })?;
    identity_from_cgroups(cgroups.iter().map(|c| c.path.as_str()))
        .map_err(|source| CallerError::Identity { pid, source })
}

/// Lets `caller` act on `targets` (each with its identity) only if every one is in the caller's
/// own container.
pub fn authorize(
    caller: &CgroupIdentity,
    targets: &[(i32, Result<CgroupIdentity, IdentityError>)],
) -> Result<(), CallerError> {
    for (pid, target) in targets {
        let foreign = |tp: PodUid, tc: String| CallerError::Foreign {
            target: *pid,
            target_pod: tp,
            target_container: tc,
            pod: caller.pod.clone(),
            container: caller.container.clone(),
        };
        match target {
            Ok(t) if t.pod == caller.pod && t.container == caller.container => {}
            Ok(t) => return Err(foreign(t.pod.clone(), t.container.clone())),
            Err(e) => {
                return Err(CallerError::Identity {
                    pid: *pid,
                    source: e.clone(),
                })
            }
        }
    }
    Ok(())
}

/// The container of `pod` whose status ID is the one `identity` names: its name and ID.
pub fn container_in_pod(pod: &Pod, identity: &CgroupIdentity) -> Option<(String, ContainerId)> {
    let status = pod.status.as_ref()?;
    status
        .container_statuses
        .iter()
        .flatten()
        .chain(status.init_container_statuses.iter().flatten())
        .chain(status.ephemeral_container_statuses.iter().flatten())
        .find_map(|s| {
            let id: ContainerId = s.container_id.as_deref()?.parse().ok()?;
            identity.is(&id).then(|| (s.name.clone(), id))
        })
}

/// The caller of a preStop, identified.
#[derive(Debug, Clone)]
pub struct Caller {
    /// Its pod.
    pub pod: PodRef,
    /// Its container's name in the pod.
    pub container: String,
    /// Its container's ID.
    pub container_id: ContainerId,
    /// The pod's QoS class (where its cgroup is).
    pub qos: Option<QosClass>,
    /// When the stop must be done (see [`crate::grace`]); `None`: no time left.
    pub deadline: Option<SystemTime>,
    /// The identity its cgroups gave.
    pub identity: CgroupIdentity,
}

impl Caller {
    /// The caller's container's cgroup: what `cryo stop --self` stops, whole subtree.
    pub fn cgroup(&self, fs: &CgroupFs) -> Result<ContainerCgroup, ResolveError> {
        fs.container(&self.pod.uid, self.qos, &self.container_id)
    }
}

impl NodeClient {
    /// Identifies the process `handle` holds as a container of a pod of this node.
    pub async fn resolve_caller(&self, handle: &ProcHandle) -> Result<Caller, CallerError> {
        let identity = caller_identity(handle)?;
        let pod = self
            .pod(&identity.pod)
            .await?
            .ok_or_else(|| CallerError::PodNotHere(identity.pod.clone()))?;
        let pod_ref =
            pod_ref_of(&pod).ok_or_else(|| CallerError::PodNotHere(identity.pod.clone()))?;
        let (container, container_id) =
            container_in_pod(&pod, &identity).ok_or_else(|| CallerError::ContainerNotInPod {
                pod: pod_ref.clone(),
                container: identity.container.clone(),
            })?;
        let qos = pod
            .status
            .as_ref()
            .and_then(|s| s.qos_class.as_deref())
            .and_then(QosClass::from_status);
        Ok(Caller {
            pod: pod_ref,
            container,
            container_id,
            qos,
            deadline: stop_deadline(&pod, SystemTime::now()),
            identity,
        })
    }

    /// The cgroups of a pod's containers (`container`: just that one), for `cryo stop --pod
    /// NS/NAME [--container C]`: the running containers of the pod as its status lists them.
    pub async fn pod_container_cgroups(
        &self,
        fs: &CgroupFs,
        namespace: &str,
        name: &str,
        container: Option<&str>,
    ) -> Result<Vec<ContainerCgroup>, CallerError> {
        Ok(self
            .pod_target(fs, namespace, name, container)
            .await?
            .containers
            .into_iter()
            .map(|(_, c)| c)
            .collect())
    }

    /// What `cryo stop --pod NS/NAME [--container C]` stops: the pod's running containers (or
    /// that one) with their cgroups, and by when (the Pod's grace period, [`crate::grace`]).
    pub async fn pod_target(
        &self,
        fs: &CgroupFs,
        namespace: &str,
        name: &str,
        container: Option<&str>,
    ) -> Result<PodTarget, CallerError> {
        let pod = kube::Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(ApiError::call(format!("get pod {namespace}/{name}")))?;
        let r = pod_ref_of(&pod).ok_or_else(|| {
            CallerError::Api(ApiError::Config(format!(
                "pod {namespace}/{name} has no UID"
            )))
        })?;
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(self.node.as_str()) {
            return Err(CallerError::PodNotHere(r.uid));
        }
        let status = pod.status.as_ref();
        let qos = status
            .and_then(|s| s.qos_class.as_deref())
            .and_then(QosClass::from_status);
        let mut containers = Vec::new();
        for s in status
            .and_then(|s| s.container_statuses.as_ref())
            .into_iter()
            .flatten()
        {
            if container.is_some_and(|c| c != s.name) {
                continue;
            }
            let running = s.state.as_ref().is_some_and(|st| st.running.is_some());
            let Some(id) = s.container_id.as_deref().and_then(|i| i.parse().ok()) else {
                continue;
            };
            if running {
                containers.push((s.name.clone(), fs.container(&r.uid, qos, &id)?));
            }
        }
        if containers.is_empty() {
            return Err(CallerError::ContainerNotInPod {
                pod: r,
                container: container.unwrap_or("(any running)").to_owned(),
            });
        }
        Ok(PodTarget {
            deadline: stop_deadline(&pod, SystemTime::now()),
            pod: r,
            containers,
        })
    }
}

/// What a stop of a pod acts on (see [`NodeClient::pod_target`]).
#[derive(Debug, Clone)]
pub struct PodTarget {
    /// The pod.
    pub pod: PodRef,
    /// Its running containers asked for: name and cgroup.
    pub containers: Vec<(String, ContainerCgroup)>,
    /// When the stop must be done; `None`: no time left.
    pub deadline: Option<SystemTime>,
}

/// Finds the pod of a process through its cgroup (for Events).
#[derive(Debug, Default, Clone, Copy)]
pub struct CgroupLocator;

impl Locate for CgroupLocator {
    fn pod_of(&self, p: ProcId) -> Option<PodUid> {
        let h = p.open().ok()?;
        caller_identity(&h).ok().map(|i| i.pod)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::Runtime;
    use k8s_openapi::api::core::v1::{ContainerStatus, PodStatus};

    const UID: &str = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";
    const OTHER: &str = "ffffffff-1f2a-4c3d-9e8f-0123456789ab";
    const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
    const B: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    fn id(pod: &str, c: &str) -> CgroupIdentity {
        CgroupIdentity {
            pod: pod.parse().unwrap(),
            container: c.into(),
            runtime: Some(Runtime::Containerd),
        }
    }

    #[test]
    fn only_the_callers_own_container() {
        let me = id(UID, A);
        assert!(authorize(&me, &[(10, Ok(id(UID, A))), (11, Ok(id(UID, A)))]).is_ok());
        assert!(authorize(&me, &[]).is_ok());
        // a sidecar of the same pod is another container
        let e = authorize(&me, &[(10, Ok(id(UID, A))), (12, Ok(id(UID, B)))]).unwrap_err();
        assert!(matches!(e, CallerError::Foreign { target: 12, .. }), "{e}");
        // the same container ID in another pod is not the caller's either
        assert!(matches!(
            authorize(&me, &[(13, Ok(id(OTHER, A)))]),
            Err(CallerError::Foreign { .. })
        ));
        // a process that is no container's (a host process) is refused
        assert!(matches!(
            authorize(&me, &[(1, Err(IdentityError::NotInAPod("/".into())))]),
            Err(CallerError::Identity { pid: 1, .. })
        ));
    }

    #[test]
    fn the_container_is_found_in_the_pod_status() {
        let pod = Pod {
            status: Some(PodStatus {
                container_statuses: Some(vec![
                    ContainerStatus {
                        name: "sidecar".into(),
                        container_id: Some(format!("containerd://{B}")),
                        ..Default::default()
                    },
                    ContainerStatus {
                        name: "vllm".into(),
                        container_id: Some(format!("containerd://{A}")),
                        ..Default::default()
                    },
                ]),
                ..Default::default()
            }),
            ..Default::default()
        };
        let (name, cid) = container_in_pod(&pod, &id(UID, A)).unwrap();
        assert_eq!(name, "vllm");
        assert_eq!(cid.id, A);
        let c = "c".repeat(64);
        assert!(container_in_pod(&pod, &id(UID, &c)).is_none());
        // the runtime must match when the cgroup names it
        let crio = CgroupIdentity {
            runtime: Some(Runtime::CriO),
            ..id(UID, A)
        };
        assert!(container_in_pod(&pod, &crio).is_none());
    }
}
