//! The agent's view of the API server: its own node, the pods on it, and the Events it posts.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{Event as KEvent, EventSource, Node, ObjectReference, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};
use k8s_openapi::jiff::Timestamp;
use kube::api::{ListParams, Patch, PatchParams, PostParams};
use kube::{Api, Client};

use crate::events::{Correlator, Decision, EventType, Step, Subject};
use crate::identity::PodUid;

/// The name cryo's Events and patches carry as their source / field manager.
pub const COMPONENT: &str = "cryod";

/// Longest wait to connect to the API server.
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);
/// Longest wait for one call's answer.
pub const CALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// A call to the API server failed.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The client could not be set up (no kubeconfig, no in-cluster service account).
    #[error("cannot set up a Kubernetes client: {0}")]
    Config(String),
    /// The API server answered with an error or could not be reached.
    #[error("{what}: {source}")]
    Call {
        /// What was asked.
        what: String,
        /// The client's error.
        #[source]
        source: kube::Error,
    },
}

impl ApiError {
    pub(crate) fn call(what: impl Into<String>) -> impl FnOnce(kube::Error) -> ApiError {
        let what = what.into();
        move |source| ApiError::Call { what, source }
    }

    /// The HTTP status the API server answered, when it answered.
    pub fn status_code(&self) -> Option<u16> {
        match self {
            ApiError::Call {
                source: kube::Error::Api(s),
                ..
            } => Some(s.code),
            _ => None,
        }
    }
}

/// A pod of this node, as Events and callers name it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// UID.
    pub uid: PodUid,
}

impl std::fmt::Display for PodRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The outcome of posting one step as an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Posted {
    /// A new Event with this name.
    Created(String),
    /// The existing Event with this name now counts this many.
    Aggregated(String, i32),
    /// Dropped by the rate limit.
    Dropped,
}

/// The agent's client: one node, the pods on it, the Events it posts (through one correlator).
pub struct NodeClient {
    pub(crate) client: Client,
    pub(crate) node: String,
    correlator: Mutex<Correlator>,
    pods: Mutex<HashMap<PodUid, PodRef>>,
}

impl std::fmt::Debug for NodeClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeClient")
            .field("node", &self.node)
            .finish_non_exhaustive()
    }
}

impl NodeClient {
    /// A client for `node` over an existing connection.
    pub fn new(client: Client, node: impl Into<String>) -> Self {
        NodeClient {
            client,
            node: node.into(),
            correlator: Mutex::new(Correlator::new()),
            pods: Mutex::new(HashMap::new()),
        }
    }

    /// The in-cluster client (the DaemonSet's ServiceAccount), or `$KUBECONFIG` outside a pod.
    pub async fn try_default(node: impl Into<String>) -> Result<Self, ApiError> {
        Self::from_config(Self::config(None).await?, node)
    }

    /// A client from a kubeconfig file.
    pub async fn from_kubeconfig(path: &Path, node: impl Into<String>) -> Result<Self, ApiError> {
        Self::from_config(Self::config(Some(path)).await?, node)
    }

    /// The configuration of the agent's client: the kubeconfig file given, else what
    /// [`kube::Config::infer`] finds (the in-cluster ServiceAccount in the DaemonSet's pod,
    /// `$KUBECONFIG` outside one). Reads files only: the API server is not contacted, so an API
    /// server that is down does not keep the agent from starting.
    pub async fn config(kubeconfig: Option<&Path>) -> Result<kube::Config, ApiError> {
        match kubeconfig {
            Some(path) => {
                let kc = kube::config::Kubeconfig::read_from(path)
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))?;
                kube::Config::from_custom_kubeconfig(kc, &Default::default())
                    .await
                    .map_err(|e| ApiError::Config(format!("{}: {e}", path.display())))
            }
            None => kube::Config::infer()
                .await
                .map_err(|e| ApiError::Config(e.to_string())),
        }
    }

    /// A client from a configuration, made fit for the agent: no hidden retries (the client's
    /// default retries a 429 up to 15 times with backoff up to 1000 s, so an eviction refused by a
    /// PodDisruptionBudget would hang for minutes) and bounded timeouts, so every call returns
    /// in time for the agent to decide; the agent retries what it wants retried.
    pub fn from_config(mut cfg: kube::Config, node: impl Into<String>) -> Result<Self, ApiError> {
        cfg.default_retry = false;
        cfg.connect_timeout = Some(CONNECT_TIMEOUT);
        cfg.read_timeout = Some(CALL_TIMEOUT);
        cfg.write_timeout = Some(CALL_TIMEOUT);
        let client = Client::try_from(cfg).map_err(|e| ApiError::Config(e.to_string()))?;
        Ok(Self::new(client, node))
    }

    /// The node's name.
    pub fn node_name(&self) -> &str {
        &self.node
    }

    /// The underlying client.
    pub fn client(&self) -> &Client {
        &self.client
    }

    pub(crate) fn nodes(&self) -> Api<Node> {
        Api::all(self.client.clone())
    }

    /// This node.
    pub async fn node(&self) -> Result<Node, ApiError> {
        self.nodes()
            .get(&self.node)
            .await
            .map_err(ApiError::call(format!("get node {}", self.node)))
    }

    /// Every pod bound to this node (the agent never lists other nodes' pods).
    pub async fn pods_on_node(&self) -> Result<Vec<Pod>, ApiError> {
        let lp = ListParams::default().fields(&format!("spec.nodeName={}", self.node));
        let list = Api::<Pod>::all(self.client.clone())
            .list(&lp)
            .await
            .map_err(ApiError::call(format!("list pods on node {}", self.node)))?;
        Ok(list.items)
    }

    /// The pod of this node with this UID (looked up again when not in the cache).
    pub async fn pod_ref(&self, uid: &PodUid) -> Result<Option<PodRef>, ApiError> {
        if let Some(p) = self.lock_pods().get(uid) {
            return Ok(Some(p.clone()));
        }
        let pods = self.pods_on_node().await?;
        let mut cache = self.lock_pods();
        cache.clear();
        for p in &pods {
            if let Some(r) = pod_ref_of(p) {
                cache.insert(r.uid.clone(), r);
            }
        }
        Ok(cache.get(uid).cloned())
    }

    /// The pod of this node with this UID, in full.
    pub async fn pod(&self, uid: &PodUid) -> Result<Option<Pod>, ApiError> {
        let Some(r) = self.pod_ref(uid).await? else {
            return Ok(None);
        };
        match Api::<Pod>::namespaced(self.client.clone(), &r.namespace)
            .get_opt(&r.name)
            .await
        {
            Ok(Some(p)) if pod_ref_of(&p).as_ref() == Some(&r) => Ok(Some(p)),
            // Gone, or a new pod of the same name: not the one asked for.
            Ok(_) => {
                self.lock_pods().remove(uid);
                Ok(None)
            }
            Err(e) => Err(ApiError::call(format!("get pod {r}"))(e)),
        }
    }

    fn lock_pods(&self) -> std::sync::MutexGuard<'_, HashMap<PodUid, PodRef>> {
        // A panic while holding it cannot leave the cache inconsistent (plain inserts).
        self.pods.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_correlator(&self) -> std::sync::MutexGuard<'_, Correlator> {
        self.correlator.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Posts `step` on `subject` as a core/v1 Event, aggregated and rate-limited (see
    /// [`crate::events`]). A pod that is no longer on the node gets the Event on the node.
    pub async fn post(&self, subject: &Subject, step: &Step) -> Result<Posted, ApiError> {
        let (subject, involved, namespace) = match subject {
            Subject::Pod(uid) => match self.pod_ref(uid).await? {
                Some(p) => (
                    subject.clone(),
                    ObjectReference {
                        api_version: Some("v1".into()),
                        kind: Some("Pod".into()),
                        namespace: Some(p.namespace.clone()),
                        name: Some(p.name.clone()),
                        uid: Some(p.uid.to_string()),
                        ..Default::default()
                    },
                    p.namespace,
                ),
                None => self.node_involved(),
            },
            Subject::Node => self.node_involved(),
        };
        let decision = self
            .lock_correlator()
            .decide(&subject, step, Instant::now());
        let events: Api<KEvent> = Api::namespaced(self.client.clone(), &namespace);
        let now = Time(now());
        match decision {
            Decision::Drop => Ok(Posted::Dropped),
            Decision::Aggregate { name, count } => {
                let patch = serde_json::json!({ "count": count, "lastTimestamp": now });
                match events
                    .patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
                    .await
                {
                    Ok(_) => Ok(Posted::Aggregated(name, count)),
                    Err(kube::Error::Api(s)) if s.code == 404 => {
                        self.lock_correlator().lost(&subject, step);
                        self.create(&events, &subject, step, involved, 0, now).await
                    }
                    Err(e) => Err(ApiError::call(format!("patch event {namespace}/{name}"))(e)),
                }
            }
            Decision::Create { dropped } => {
                self.create(&events, &subject, step, involved, dropped, now)
                    .await
            }
        }
    }

    fn node_involved(&self) -> (Subject, ObjectReference, String) {
        (
            Subject::Node,
            ObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Node".into()),
                name: Some(self.node.clone()),
                // As the kubelet does, and what `kubectl describe node` looks for.
                uid: Some(self.node.clone()),
                ..Default::default()
            },
            "default".to_owned(),
        )
    }

    async fn create(
        &self,
        events: &Api<KEvent>,
        subject: &Subject,
        step: &Step,
        involved: ObjectReference,
        dropped: u64,
        now: Time,
    ) -> Result<Posted, ApiError> {
        let base = involved.name.clone().unwrap_or_default();
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let name = format!("{base}.{nanos:x}");
        let mut message = step.message.clone();
        if dropped > 0 {
            message.push_str(&format!(
                " ({dropped} earlier cryo Events on this object were dropped by the rate limit)"
            ));
        }
        let ev = KEvent {
            metadata: ObjectMeta {
                name: Some(name.clone()),
                namespace: events_namespace(&involved),
                ..Default::default()
            },
            involved_object: involved,
            reason: Some(step.reason.to_owned()),
            message: Some(message),
            type_: Some(step.kind.as_str().to_owned()),
            count: Some(1),
            first_timestamp: Some(now.clone()),
            last_timestamp: Some(now),
            source: Some(EventSource {
                component: Some(COMPONENT.to_owned()),
                host: Some(self.node.clone()),
            }),
            reporting_component: Some(format!("cryo.dev/{COMPONENT}")),
            reporting_instance: Some(self.node.clone()),
            ..Default::default()
        };
        events
            .create(&PostParams::default(), &ev)
            .await
            .map_err(ApiError::call(format!("create event {name}")))?;
        self.lock_correlator()
            .created(subject, step, name.clone(), Instant::now());
        Ok(Posted::Created(name))
    }

    /// Posts an Event on this node directly (the fence's own Events).
    pub(crate) async fn post_node(
        &self,
        kind: EventType,
        reason: &'static str,
        message: String,
    ) -> Result<Posted, ApiError> {
        let step = Step {
            kind,
            reason,
            message,
            about: crate::events::About::Node,
        };
        self.post(&Subject::Node, &step).await
    }
}

fn events_namespace(involved: &ObjectReference) -> Option<String> {
    Some(
        involved
            .namespace
            .clone()
            .unwrap_or_else(|| "default".to_owned()),
    )
}

/// Now, as the API's timestamps have it.
pub(crate) fn now() -> Timestamp {
    Timestamp::now()
}

/// The reference of a pod as the API returned it (`None` without a name, namespace or valid UID).
pub fn pod_ref_of(p: &Pod) -> Option<PodRef> {
    Some(PodRef {
        namespace: p.metadata.namespace.clone()?,
        name: p.metadata.name.clone()?,
        uid: p.metadata.uid.as_deref()?.parse().ok()?,
    })
}
