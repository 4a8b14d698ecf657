//! The endgame drain, the Kubernetes way: cordon the node, then evict its other GPU pods through
//! the Eviction API, so PodDisruptionBudgets are honoured and each pod's preStop hook (`cryo stop
//! --self`) suspends its CUDA contexts before the kubelet kills it.
//!
//! # Design
//! [`eviction_candidates`] (pure) picks the pods: bound to this node, using an NVIDIA GPU (a
//! `nvidia.com/...` resource in any container's limits or requests), not already terminating or
//! finished, not a DaemonSet's (it would come back at once, like `kubectl drain`), not a static
//! pod (the API cannot evict those), and not one the caller keeps (the pod whose context is
//! pinned). The Eviction body's version is chosen from what the server serves (`policy/v1` since
//! Kubernetes 1.22, `policy/v1beta1` before), as `kubectl drain` does. A 429 answer is a PDB
//! that allows no disruption now: reported, not retried here (the agent decides when to retry).
//!
//! # Limitations
//! Eviction returns when the API server has accepted the deletion; the pod then terminates on the
//! kubelet's schedule (preStop within its grace period). Waiting for that is the caller's.

use k8s_openapi::api::core::v1::Pod;
use kube::api::{Patch, PatchParams};

use crate::client::{pod_ref_of, ApiError, NodeClient, PodRef};
use crate::identity::PodUid;

/// Whether any container of the pod asks for an NVIDIA device.
pub fn uses_gpu(pod: &Pod) -> bool {
    let Some(spec) = &pod.spec else { return false };
    spec.containers
        .iter()
        .chain(spec.init_containers.iter().flatten())
        .filter_map(|c| c.resources.as_ref())
        .any(|r| {
            r.limits
                .iter()
                .chain(r.requests.iter())
                .flat_map(|m| m.keys())
                .any(|k| k.starts_with("nvidia.com/"))
        })
}

/// Why a pod of the node is not evicted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Skip {
    /// It uses no GPU.
    NoGpu,
    /// The caller keeps it.
    Kept,
    /// Already terminating.
    Terminating,
    /// Succeeded or Failed.
    Finished,
    /// A DaemonSet's.
    DaemonSet,
    /// A static (mirror) pod.
    Static,
}

/// Whether `pod` is to be evicted, and if not why.
pub fn eviction_decision(pod: &Pod, keep: &[PodUid]) -> Result<(), Skip> {
    if !uses_gpu(pod) {
        return Err(Skip::NoGpu);
    }
    if let Some(uid) = pod
        .metadata
        .uid
        .as_deref()
        .and_then(|u| u.parse::<PodUid>().ok())
    {
        if keep.contains(&uid) {
            return Err(Skip::Kept);
        }
    }
    if pod.metadata.deletion_timestamp.is_some() {
        return Err(Skip::Terminating);
    }
    if let Some(phase) = pod.status.as_ref().and_then(|s| s.phase.as_deref()) {
        if phase == "Succeeded" || phase == "Failed" {
            return Err(Skip::Finished);
        }
    }
    let owners = pod.metadata.owner_references.iter().flatten();
    if owners
        .clone()
        .any(|o| o.kind == "DaemonSet" && o.controller == Some(true))
    {
        return Err(Skip::DaemonSet);
    }
    if pod
        .metadata
        .annotations
        .as_ref()
        .is_some_and(|a| a.contains_key("kubernetes.io/config.mirror"))
    {
        return Err(Skip::Static);
    }
    Ok(())
}

/// The pods of `pods` to evict.
pub fn eviction_candidates<'a>(pods: &'a [Pod], keep: &[PodUid]) -> Vec<&'a Pod> {
    pods.iter()
        .filter(|p| eviction_decision(p, keep).is_ok())
        .collect()
}

/// The Eviction body's API version for a server that serves these `policy` versions.
pub fn eviction_version(policy_versions: &[String]) -> &'static str {
    if policy_versions.iter().any(|v| v == "v1") {
        "policy/v1"
    } else {
        "policy/v1beta1"
    }
}

/// The drain failed.
#[derive(Debug, thiserror::Error)]
pub enum DrainError {
    /// A call to the API server failed.
    #[error("drain of node {node}: {source}")]
    Api {
        /// The node.
        node: String,
        /// What failed.
        #[source]
        source: ApiError,
    },
}

/// What an eviction pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvictionReport {
    /// Evictions the API server accepted (the pods terminate through their preStop).
    pub evicted: Vec<PodRef>,
    /// Refused for now by a PodDisruptionBudget (429), with the server's message.
    pub blocked: Vec<(PodRef, String)>,
    /// Gone before their eviction.
    pub gone: Vec<PodRef>,
}

impl NodeClient {
    /// Cordons the node (`spec.unschedulable`); true when it was not cordoned yet.
    pub async fn cordon(&self) -> Result<bool, DrainError> {
        let err = |source| DrainError::Api {
            node: self.node.clone(),
            source,
        };
        let node = self.node().await.map_err(err)?;
        if node.spec.as_ref().and_then(|s| s.unschedulable) == Some(true) {
            return Ok(false);
        }
        let patch = serde_json::json!({ "spec": { "unschedulable": true } });
        self.nodes()
            .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
            .await
            .map_err(|e| err(ApiError::call(format!("cordon node {}", self.node))(e)))?;
        Ok(true)
    }

    /// Evicts the GPU pods of the node except `keep` (see [`eviction_candidates`]).
    pub async fn evict_gpu_pods(&self, keep: &[PodUid]) -> Result<EvictionReport, DrainError> {
        let err = |source| DrainError::Api {
            node: self.node.clone(),
            source,
        };
        let groups = self
            .client
            .list_api_groups()
            .await
            .map_err(|e| err(ApiError::call("list API groups")(e)))?;
        let versions: Vec<String> = groups
            .groups
            .iter()
            .filter(|g| g.name == "policy")
            .flat_map(|g| g.versions.iter().map(|v| v.version.clone()))
            .collect();
        let version = eviction_version(&versions);
        let pods = self.pods_on_node().await.map_err(err)?;
        let mut report = EvictionReport::default();
        for pod in eviction_candidates(&pods, keep) {
            let Some(r) = pod_ref_of(pod) else { continue };
            let body = serde_json::json!({
                "apiVersion": version,
                "kind": "Eviction",
                "metadata": { "name": r.name, "namespace": r.namespace },
                // Only this pod, not a new one of the same name.
                "deleteOptions": { "preconditions": { "uid": r.uid.as_str() } },
            });
            let bytes = serde_json::to_vec(&body).unwrap_or_default();
            let req = http::Request::post(format!(
                "/api/v1/namespaces/{}/pods/{}/eviction",
                r.namespace, r.name
            ))
            .header("content-type", "application/json")
            .body(bytes)
            .map_err(|e| err(ApiError::Config(format!("eviction request for {r}: {e}"))))?;
            match self.client.request::<serde_json::Value>(req).await {
                Ok(_) => report.evicted.push(r),
                Err(kube::Error::Api(s)) if s.code == 429 => {
                    report.blocked.push((r, s.message.clone()))
                }
                // 404: gone; 409: the precondition failed, i.e. a new pod of the same name.
                Err(kube::Error::Api(s)) if s.code == 404 || s.code == 409 => report.gone.push(r),
                Err(e) => return Err(err(ApiError::call(format!("evict pod {r}"))(e))),
            }
        }
        Ok(report)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus, ResourceRequirements};
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{OwnerReference, Time};
    use std::collections::BTreeMap;

    const UID: &str = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";

    fn pod(res: Option<&str>) -> Pod {
        let resources = res.map(|r| ResourceRequirements {
            limits: Some(BTreeMap::from([(r.to_owned(), Quantity("1".into()))])),
            ..Default::default()
        });
        let mut p = Pod {
            spec: Some(PodSpec {
                containers: vec![Container {
                    name: "c".into(),
                    resources,
                    ..Default::default()
                }],
                ..Default::default()
            }),
            ..Default::default()
        };
        p.metadata.uid = Some(UID.into());
        p
    }

    #[test]
    fn who_is_evicted() {
        assert_eq!(eviction_decision(&pod(Some("nvidia.com/gpu")), &[]), Ok(()));
        assert_eq!(
            eviction_decision(&pod(Some("nvidia.com/mig-1g.10gb")), &[]),
            Ok(())
        );
        assert_eq!(eviction_decision(&pod(Some("cpu")), &[]), Err(Skip::NoGpu));
        assert_eq!(eviction_decision(&pod(None), &[]), Err(Skip::NoGpu));
        assert_eq!(
            eviction_decision(&pod(Some("nvidia.com/gpu")), &[UID.parse().unwrap()]),
            Err(Skip::Kept)
        );
        let mut p = pod(Some("nvidia.com/gpu"));
        p.metadata.deletion_timestamp = Some(Time(k8s_openapi::jiff::Timestamp::UNIX_EPOCH));
        assert_eq!(eviction_decision(&p, &[]), Err(Skip::Terminating));
        let mut p = pod(Some("nvidia.com/gpu"));
        p.status = Some(PodStatus {
            phase: Some("Failed".into()),
            ..Default::default()
        });
        assert_eq!(eviction_decision(&p, &[]), Err(Skip::Finished));
        let mut p = pod(Some("nvidia.com/gpu"));
        p.metadata.owner_references = Some(vec![OwnerReference {
            kind: "DaemonSet".into(),
            controller: Some(true),
            ..Default::default()
        }]);
        assert_eq!(eviction_decision(&p, &[]), Err(Skip::DaemonSet));
        let mut p = pod(Some("nvidia.com/gpu"));
        p.metadata.annotations = Some(BTreeMap::from([(
            "kubernetes.io/config.mirror".into(),
            "x".into(),
        )]));
        assert_eq!(eviction_decision(&p, &[]), Err(Skip::Static));
        // an init container's GPU counts
        let mut p = pod(None);
        let init = pod(Some("nvidia.com/gpu")).spec.unwrap().containers;
        p.spec.as_mut().unwrap().init_containers = Some(init);
        assert_eq!(eviction_decision(&p, &[]), Ok(()));
    }

    #[test]
    fn eviction_body_version() {
        assert_eq!(eviction_version(&["v1beta1".into()]), "policy/v1beta1");
        assert_eq!(
            eviction_version(&["v1".into(), "v1beta1".into()]),
            "policy/v1"
        );
        assert_eq!(eviction_version(&[]), "policy/v1beta1");
    }
}
