//! The fence as the scheduler sees it: a `NoSchedule` taint, a node condition naming the GPUs and
//! why, and an Event; all removed when the operator releases the fence.
//!
//! # Design
//! The quarantine file is the truth; the node is made to show it. [`plan`] (pure) compares the
//! node as it is with the fenced GPUs and says what to change; [`crate::NodeClient::reconcile_fence`]
//! carries it out. So the same call serves a new quarantine, a release, and an agent that
//! restarts and re-applies the file: nothing changes (and no Event is posted) when the node
//! already shows the fence, and a taint someone removed by hand comes back.
//!
//! The taint list is replaced with optimistic concurrency (the node's `resourceVersion`, retried
//! on a conflict), so a taint added by someone else meanwhile is never lost. The condition is a
//! strategic merge patch of `nodes/status` keyed by its type, so the kubelet's conditions are
//! never touched; its `lastTransitionTime` changes only when it appears.

use k8s_openapi::api::core::v1::{Node, NodeCondition, Taint};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use k8s_openapi::jiff::Timestamp;

use kube::api::{Patch, PatchParams};

use crate::client::{now, ApiError, NodeClient, Posted};
use crate::events::EventType;
use cryo_state::fence::{FencedGpu, Quarantine};

/// The taint's key.
pub const TAINT_KEY: &str = "cryo.dev/gpu-fenced";
/// The taint's effect.
pub const TAINT_EFFECT: &str = "NoSchedule";
/// The node condition's type.
pub const CONDITION_TYPE: &str = "CryoGpuFenced";
/// The condition's reason while fenced.
pub const CONDITION_REASON: &str = "GpuQuarantined";
/// Longest condition message; a longer list ends with how many more GPUs there are.
pub const MAX_MESSAGE: usize = 1024;

/// What to change on the node.
#[derive(Debug, Clone, PartialEq)]
pub struct FencePlan {
    /// The node's new taint list, when it must change.
    pub taints: Option<Vec<Taint>>,
    /// The condition change.
    pub condition: ConditionChange,
    /// The Event to post, if the fence as the node shows it changes.
    pub event: Option<(EventType, &'static str, String)>,
}

/// A change of the node's cryo condition.
#[derive(Debug, Clone, PartialEq)]
pub enum ConditionChange {
    /// Already right.
    Keep,
    /// Set it to this.
    Set(NodeCondition),
    /// Remove it.
    Remove,
}

impl FencePlan {
    /// Whether nothing is to be done.
    pub fn is_noop(&self) -> bool {
        self.taints.is_none() && self.condition == ConditionChange::Keep && self.event.is_none()
    }
}

/// The condition message: every fenced GPU and why, bounded.
pub fn condition_message(fenced: &[Quarantine]) -> String {
    let mut msg = format!(
        "{} GPU{} fenced by cryo: ",
        fenced.len(),
        if fenced.len() == 1 { "" } else { "s" }
    );
    for (i, f) in fenced.iter().enumerate() {
        let gpu = match &f.gpu {
            FencedGpu::Gpu(g) => g.to_string(),
            FencedGpu::Unknown => "unknown GPU (all GPUs of the node)".to_owned(),
        };
        let item = format!("{}{gpu}: {}", if i > 0 { "; " } else { "" }, f.reason);
        if msg.len() + item.len() > MAX_MESSAGE {
            msg.push_str(&format!("; and {} more", fenced.len() - i));
            break;
        }
        msg.push_str(&item);
    }
    msg
}

fn fence_taint() -> Taint {
    Taint {
        key: TAINT_KEY.to_owned(),
        effect: TAINT_EFFECT.to_owned(),
        value: None,
        time_added: None,
    }
}

/// What to change so that `node` shows `fenced` (empty: no fence).
pub fn plan(node: &Node, fenced: &[Quarantine], now: Timestamp) -> FencePlan {
    let taints: Vec<Taint> = node
        .spec
        .as_ref()
        .and_then(|s| s.taints.clone())
        .unwrap_or_default();
    let has_taint = taints
        .iter()
        .any(|t| t.key == TAINT_KEY && t.effect == TAINT_EFFECT);
    let current = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == CONDITION_TYPE));
    if fenced.is_empty() {
        let new_taints = has_taint.then(|| {
            taints
                .iter()
                .filter(|t| t.key != TAINT_KEY)
                .cloned()
                .collect()
        });
        let condition = if current.is_some() {
            ConditionChange::Remove
        } else {
            ConditionChange::Keep
        };
        let event = (has_taint || current.is_some()).then(|| {
            (
                EventType::Normal,
                "CryoGpuFenceReleased",
                "the GPU fence was released: the node takes new pods again".to_owned(),
            )
        });
        return FencePlan {
            taints: new_taints,
            condition,
            event,
        };
    }
    let message = condition_message(fenced);
    let new_taints = (!has_taint).then(|| {
        let mut t: Vec<Taint> = taints
            .iter()
            .filter(|t| t.key != TAINT_KEY)
            .cloned()
            .collect();
        t.push(fence_taint());
        t
    });
    let condition_right = current.is_some_and(|c| {
        c.status == "True"
            && c.reason.as_deref() == Some(CONDITION_REASON)
            && c.message.as_deref() == Some(message.as_str())
    });
    let condition = if condition_right {
        ConditionChange::Keep
    } else {
        let was_true = current.is_some_and(|c| c.status == "True");
        let transition = match current.and_then(|c| c.last_transition_time.clone()) {
            Some(t) if was_true => t,
            _ => Time(now),
        };
        ConditionChange::Set(NodeCondition {
            type_: CONDITION_TYPE.to_owned(),
            status: "True".to_owned(),
            reason: Some(CONDITION_REASON.to_owned()),
            message: Some(message.clone()),
            last_transition_time: Some(transition),
            last_heartbeat_time: Some(Time(now)),
        })
    };
    let event = if !condition_right {
        Some((EventType::Warning, "CryoGpuFenced", message))
    } else if !has_taint {
        Some((
            EventType::Warning,
            "CryoGpuFenceReapplied",
            format!("the {TAINT_KEY} taint was missing and is back: {message}"),
        ))
    } else {
        None
    };
    FencePlan {
        taints: new_taints,
        condition,
        event,
    }
}

/// Applying the fence to the node failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// A call to the API server failed.
    #[error("fence on node {node}: {source}")]
    Api {
        /// The node.
        node: String,
        /// What failed.
        #[source]
        source: ApiError,
    },
    /// The node kept changing under the taint update.
    #[error("fence on node {node}: the node changed {tries} times while its taints were updated")]
    Conflicts {
        /// The node.
        node: String,
        /// How many tries.
        tries: u32,
    },
}

/// What a reconcile changed.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FenceOutcome {
    /// The taint list was changed.
    pub taint_changed: bool,
    /// The condition was set or removed.
    pub condition_changed: bool,
    /// The Event posted, if any.
    pub event: Option<Posted>,
}

/// Conflicts on the taint update tolerated before giving up.
const FENCE_TRIES: u32 = 8;

impl NodeClient {
    /// Makes the node show `fenced` (the quarantine file's entries; empty: released): the taint,
    /// the condition, an Event when what the node shows changes. Idempotent.
    pub async fn reconcile_fence(&self, fenced: &[Quarantine]) -> Result<FenceOutcome, FenceError> {
        let err = |source| FenceError::Api {
            node: self.node.clone(),
            source,
        };
        for _ in 0..FENCE_TRIES {
            let node = self.node().await.map_err(err)?;
            let p = plan(&node, fenced, now());
            let mut out = FenceOutcome::default();
            if let Some(taints) = &p.taints {
                // resourceVersion in the patch: the server refuses it (409) if the node changed
                // since it was read, so someone else's taint is never overwritten.
                let patch = serde_json::json!({
                    "metadata": { "resourceVersion": node.metadata.resource_version },
                    "spec": { "taints": taints },
                });
                match self
                    .nodes()
                    .patch(&self.node, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => out.taint_changed = true,
                    Err(kube::Error::Api(s)) if s.code == 409 => continue,
                    Err(e) => {
                        return Err(err(ApiError::call(format!(
                            "patch taints of node {}",
                            self.node
                        ))(e)))
                    }
                }
            }
            let status_patch = match &p.condition {
                ConditionChange::Keep => None,
                ConditionChange::Set(c) => {
                    Some(serde_json::json!({ "status": { "conditions": [c] } }))
                }
                ConditionChange::Remove => Some(serde_json::json!({
                    "status": { "conditions": [ { "type": CONDITION_TYPE, "$patch": "delete" } ] }
                })),
            };
            if let Some(patch) = status_patch {
                self.nodes()
                    .patch_status(
                        &self.node,
                        &PatchParams::default(),
                        &Patch::Strategic(&patch),
                    )
                    .await
                    .map_err(|e| {
                        err(ApiError::call(format!(
                            "patch condition of node {}",
                            self.node
                        ))(e))
                    })?;
                out.condition_changed = true;
            }
            if let Some((kind, reason, message)) = p.event {
                out.event = Some(self.post_node(kind, reason, message).await.map_err(err)?);
            }
            tracing::info!(node = %self.node, fenced = fenced.len(), ?out, "fence reconciled");
            return Ok(out);
        }
        Err(FenceError::Conflicts {
            node: self.node.clone(),
            tries: FENCE_TRIES,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{NodeSpec, NodeStatus};

    fn g(n: u8) -> Quarantine {
        Quarantine {
            gpu: FencedGpu::Gpu(
                format!("GPU-{n:08x}-0000-0000-0000-000000000000")
                    .parse()
                    .unwrap(),
            ),
            reason: format!("pid {n} killed by SIGKILL, context pinned"),
            pids: vec![i32::from(n)],
            since_unix: 1,
        }
    }

    fn node(taints: Vec<Taint>, conds: Vec<NodeCondition>) -> Node {
        Node {
            spec: Some(NodeSpec {
                taints: Some(taints),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                conditions: Some(conds),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    fn other_taint() -> Taint {
        Taint {
            key: "nvidia.com/gpu".into(),
            effect: "NoSchedule".into(),
            value: Some("present".into()),
            time_added: None,
        }
    }

    /// The node after the plan, as the API server would store it.
    fn apply(mut n: Node, p: &FencePlan) -> Node {
        if let Some(t) = &p.taints {
            n.spec.get_or_insert_with(Default::default).taints = Some(t.clone());
        }
        let conds = n
            .status
            .get_or_insert_with(Default::default)
            .conditions
            .get_or_insert_with(Vec::new);
        match &p.condition {
            ConditionChange::Keep => {}
            ConditionChange::Remove => conds.retain(|c| c.type_ != CONDITION_TYPE),
            ConditionChange::Set(c) => {
                conds.retain(|x| x.type_ != CONDITION_TYPE);
                conds.push(c.clone());
            }
        }
        n
    }

    #[test]
    fn fence_then_reapply_then_release() {
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let t1 = Timestamp::from_second(1_000_100).unwrap();
        let n0 = node(vec![other_taint()], vec![]);
        let p = plan(&n0, &[g(1)], t0);
        assert_eq!(p.taints.as_ref().unwrap().len(), 2);
        assert!(matches!(p.condition, ConditionChange::Set(_)));
        assert_eq!(p.event.as_ref().unwrap().1, "CryoGpuFenced");
        let n1 = apply(n0, &p);
        // the agent restarts and re-applies the same file: nothing to do, no Event
        let again = plan(&n1, &[g(1)], t1);
        assert!(again.is_noop(), "{again:?}");
        // a second GPU: message changes, transition time stays, no second taint
        let p2 = plan(&n1, &[g(1), g(2)], t1);
        assert!(p2.taints.is_none());
        let ConditionChange::Set(c) = &p2.condition else {
            panic!("{p2:?}")
        };
        assert_eq!(c.last_transition_time, Some(Time(t0)));
        assert!(c.message.as_ref().unwrap().contains("2 GPUs"));
        let n2 = apply(n1, &p2);
        // someone removes the taint by hand: it comes back, with an Event that says so
        let mut n3 = n2.clone();
        n3.spec.as_mut().unwrap().taints = Some(vec![other_taint()]);
        let p3 = plan(&n3, &[g(1), g(2)], t1);
        assert_eq!(p3.taints.as_ref().unwrap().len(), 2);
        assert_eq!(p3.condition, ConditionChange::Keep);
        assert_eq!(p3.event.as_ref().unwrap().1, "CryoGpuFenceReapplied");
        // release: only our taint goes, the condition is removed
        let p4 = plan(&n2, &[], t1);
        assert_eq!(p4.taints, Some(vec![other_taint()]));
        assert_eq!(p4.condition, ConditionChange::Remove);
        assert_eq!(p4.event.as_ref().unwrap().1, "CryoGpuFenceReleased");
        let n4 = apply(n2, &p4);
        assert!(plan(&n4, &[], t1).is_noop());
    }

    #[test]
    fn unknown_gpu_and_bounded_message() {
        let unknown = Quarantine {
            gpu: FencedGpu::Unknown,
            reason: "NVML did not name the GPU".into(),
            pids: vec![7],
            since_unix: 1,
        };
        let m = condition_message(&[g(1), unknown]);
        assert!(m.contains("unknown GPU"), "{m}");
        assert!(m.contains("GPU-00000001"), "{m}");
        let many: Vec<Quarantine> = (0..200).map(g).collect();
        let m = condition_message(&many);
        assert!(m.len() <= MAX_MESSAGE + 32, "{}", m.len());
        assert!(m.ends_with("more"), "{m}");
    }

    #[test]
    fn a_false_condition_left_by_hand_is_made_true_with_a_new_transition() {
        let t0 = Timestamp::from_second(1_000_000).unwrap();
        let old = NodeCondition {
            type_: CONDITION_TYPE.into(),
            status: "False".into(),
            last_transition_time: Some(Time(Timestamp::from_second(5).unwrap())),
            ..Default::default()
        };
        let p = plan(&node(vec![], vec![old]), &[g(1)], t0);
        let ConditionChange::Set(c) = p.condition else {
            panic!()
        };
        assert_eq!(c.last_transition_time, Some(Time(t0)));
    }
}
