//! The agent's activators (`/v1/activators`): listeners on scaled-to-zero workers' service
//! addresses, owned by the agent so that they outlive the command that made them.
//!
//! # Design
//! - Each is `cryo_activator`'s [`Activator`], served on a tokio runtime of this module's own
//!   (`cryod-activators`), so that the API's runtime and its shutdown stay as they are. The
//!   waking is the lifecycle's park and wake traced by this agent's guard ([`InPlace`]), or, in
//!   front of a standby pool, [`FromStandby`] making its claim through this agent's own API.
//! - What each listens on and for which worker is kept in `STATE_DIR/activators.json` (written
//!   whole, then renamed): a pid target with the start times of its processes, a standby
//!   activator with the worker it claimed, and the keeper of its listening socket. A restarted
//!   agent listens again on every address, for the same worker in the phase the driver says it
//!   is in; one whose worker is gone (or whose pid now belongs to another process) is dropped.
//!   Each is journaled (`ActivatorListening`, `ActivatorRemoved`).
//! - The listening socket is handed over, not bound again ([`crate::keeper`]): a keeper process
//!   holds it while no agent runs, so connections queued in the dead agent's backlog, and those
//!   made before the next agent listens, are served by the next agent. Where the keeper is gone
//!   the address is bound again (a unix socket its dead predecessor left is replaced once
//!   nothing answers on it; TCP binds with `SO_REUSEADDR`).
//! - Connections the dead agent had accepted end with it (the client sees its connection
//!   closed, never a hang); the worker keeps serving and the next agent's guard traces it again.
//!
//! # Limitations
//! See [`crate::keeper`]: an agent stopped on purpose leaves its sockets held for a minute; a
//! keeper killed with the agent's cgroup or container loses the backlog.

use std::collections::BTreeMap;
use std::path::Path;
use std::str::FromStr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use cryo_activator::{Activation, Activator, Addr, FromStandby, InPlace, Phase, Policy};
use cryo_api::{
    path, Access, ActivatorList, ActivatorRemoveRequest, ActivatorSpec, ActivatorStatus, ApiError,
    ErrorKind, ParkRequest, TargetSpec,
};
use cryo_journal::{Event, ProcId};
use cryo_lifecycle::{HealthCheck, ParkOptions, Target};
use cryo_proc::ProcHandle;
use serde::{Deserialize, Serialize};

use crate::auth::Peer;
use crate::keeper::{self, Keeper};
use crate::server::{allow, blocking, change_request, same_pids, Failure, Pids};
use crate::Agent;

/// The routes of `/v1/activators`, merged into the agent's router.
pub(crate) fn routes() -> Router<Arc<Agent>> {
    Router::new()
        .route(path::ACTIVATORS, get(list).post(create))
        .route(&format!("{}/remove", path::ACTIVATORS), post(remove))
}

async fn list(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Read)?;
    blocking(move || Ok(agent.activators.list())).await
}

async fn create(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let spec: ActivatorSpec = change_request(&agent, &peer, &body, Pids::None)?;
    if spec.target.is_some() {
        same_pids(&peer)?;
    }
    tracing::info!(listen = %spec.listen, upstream = %spec.upstream, ?peer.cred, "activator create");
    blocking(move || agent.activator_create(spec)).await
}

async fn remove(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: ActivatorRemoveRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::info!(listen = %req.listen, ?peer.cred, "activator remove");
    blocking(move || {
        let removed = agent.activators.remove(&req.listen)?;
        agent.journal_activator(Event::ActivatorRemoved {
            listen: removed.spec.listen.clone(),
            reason: "removed on request".into(),
        });
        Ok(removed)
    })
    .await
}

impl Drop for Activators {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// What is kept of one activator across restarts.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Record {
    spec: ActivatorSpec,
    /// A pid target's processes as they were when it was made (a reused pid is not the worker).
    #[serde(default)]
    procs: Vec<ProcId>,
    /// The worker a standby activator claimed.
    #[serde(default)]
    claimed: Option<ProcId>,
    /// The process that holds the listening socket for the next agent ([`crate::keeper`]).
    #[serde(default)]
    keeper: Option<ProcId>,
}

struct Live {
    record: Record,
    activator: Activator,
    from: Option<Arc<FromStandby>>,
    task: tokio::task::JoinHandle<()>,
    keeper: Option<Keeper>,
}

/// Every activator of the agent.
pub(crate) struct Activators {
    /// Taken only by `Drop` (shut down without waiting: the agent may end on an async thread).
    rt: Option<tokio::runtime::Runtime>,
    live: Mutex<BTreeMap<String, Live>>,
    file: std::path::PathBuf,
}

impl std::fmt::Debug for Activators {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activators")
            .field("file", &self.file)
            .finish_non_exhaustive()
    }
}

fn failed(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorKind::Failed, e.to_string())
}

fn bad(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorKind::BadRequest, e.to_string())
}

fn phase_name(p: &Phase) -> (&'static str, Option<String>) {
    match p {
        Phase::Active => ("active", None),
        Phase::Parked { last_error } => ("parked", last_error.clone()),
        Phase::Waking => ("waking", None),
        Phase::Parking => ("parking", None),
    }
}

impl Activators {
    /// No activator yet; kept in `file`.
    pub(crate) fn new(file: &Path) -> std::io::Result<Activators> {
        Ok(Activators {
            rt: Some(
                tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(2)
                    .thread_name("cryod-activators")
                    .enable_all()
                    .build()?,
            ),
            live: Mutex::new(BTreeMap::new()),
            file: file.to_path_buf(),
        })
    }

    fn rt(&self) -> Result<&tokio::runtime::Runtime, ApiError> {
        self.rt
            .as_ref()
            .ok_or_else(|| failed("the agent is shutting down"))
    }

    fn live(&self) -> MutexGuard<'_, BTreeMap<String, Live>> {
        self.live.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn status(l: &Live) -> ActivatorStatus {
        let (phase, last_error) = phase_name(&l.activator.phase());
        let s = l.activator.stats();
        ActivatorStatus {
            spec: l.record.spec.clone(),
            phase: phase.to_string(),
            last_error,
            activations: s.activations,
            failed_activations: s.failed_activations,
            idle_parks: s.idle_parks,
            forwarded: s.forwarded,
            rejected: s.rejected,
            claimed: l.from.as_ref().and_then(|f| f.claimed()),
        }
    }

    /// `GET /v1/activators`.
    pub(crate) fn list(&self) -> ActivatorList {
        ActivatorList {
            activators: self.live().values().map(Self::status).collect(),
        }
    }

    /// Writes every record (whole, then renamed over the old file).
    fn save(&self, live: &BTreeMap<String, Live>) -> Result<(), ApiError> {
        let records: Vec<Record> = live
            .values()
            .map(|l| Record {
                claimed: l.from.as_ref().and_then(|f| f.claimed()),
                keeper: l.keeper.as_ref().map(|k| k.id),
                ..l.record.clone()
            })
            .collect();
        let body = serde_json::to_vec_pretty(&records).map_err(failed)?;
        let dir = self.file.parent().unwrap_or(Path::new("/"));
        let mut tmp = tempfile::NamedTempFile::new_in(dir).map_err(failed)?;
        std::io::Write::write_all(&mut tmp, &body).map_err(failed)?;
        tmp.as_file().sync_all().map_err(failed)?;
        tmp.persist(&self.file).map_err(failed)?;
        Ok(())
    }

    /// `POST /v1/activators/remove`: stops listening; the worker stays as it is.
    pub(crate) fn remove(&self, listen: &str) -> Result<ActivatorStatus, ApiError> {
        let mut live = self.live();
        let Some(mut l) = live.remove(listen) else {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!("no activator listens on {listen} (see `cryo status`)"),
            ));
        };
        l.task.abort();
        if let Some(k) = l.keeper.take() {
            k.end();
        }
        if let Ok(Addr::Unix(p)) = Addr::from_str(&l.record.spec.listen) {
            let _ = std::fs::remove_file(p);
        }
        self.save(&live)?;
        Ok(Self::status(&l))
    }

    /// The records kept by the last agent.
    fn saved(&self) -> Vec<Record> {
        match std::fs::read(&self.file) {
            Ok(b) => serde_json::from_slice(&b).unwrap_or_else(|e| {
                tracing::error!(file = %self.file.display(), error = %e, "the activators' file cannot be read: none restored");
                Vec::new()
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => {
                tracing::error!(file = %self.file.display(), error = %e, "the activators' file cannot be read: none restored");
                Vec::new()
            }
        }
    }
}

impl Agent {
    /// `POST /v1/activators`: listening when it answers.
    pub(crate) fn activator_create(
        self: &Arc<Self>,
        spec: ActivatorSpec,
    ) -> Result<ActivatorStatus, ApiError> {
        let procs = match &spec.target {
            Some(TargetSpec::Cgroup { .. }) | None => Vec::new(),
            Some(t) => Target::from(t)
                .resolve()
                .map_err(|e| ApiError::new(ErrorKind::NotFound, e.to_string()))?
                .handles()
                .iter()
                .map(ProcId::of_handle)
                .collect(),
        };
        self.activator_start(
            Record {
                spec,
                procs,
                claimed: None,
                keeper: None,
            },
            false,
        )
    }

    /// Journals what became of an activator (a note: a failure to write it is logged).
    fn journal_activator(&self, event: Event) {
        if let Err(e) = self.journal.append(event) {
            tracing::error!(error = %e, "cannot journal an activator's change");
        }
    }

    /// Listens again on every activator the last agent kept (see the module docs).
    pub(crate) fn restore_activators(self: &Arc<Self>) {
        for r in self.activators.saved() {
            let gone = r
                .procs
                .iter()
                .find(|p| ProcHandle::open_expected(p.pid, p.start_time).is_err());
            if let Some(p) = gone {
                tracing::warn!(listen = %r.spec.listen, pid = p.pid, "activator dropped: its worker is gone");
                self.journal_activator(Event::ActivatorRemoved {
                    listen: r.spec.listen.clone(),
                    reason: format!("its worker (pid {}) is gone", p.pid),
                });
                continue;
            }
            match self.activator_start(r.clone(), true) {
                Ok(s) => {
                    tracing::info!(listen = %s.spec.listen, phase = %s.phase, "activator listening again")
                }
                Err(e) => {
                    tracing::error!(listen = %r.spec.listen, error = %e.message, "activator not restored");
                    self.journal_activator(Event::ActivatorRemoved {
                        listen: r.spec.listen.clone(),
                        reason: format!("cannot listen again: {}", e.message),
                    });
                }
            }
        }
        let live = self.activators.live();
        if let Err(e) = self.activators.save(&live) {
            tracing::error!(error = %e.message, "cannot write the activators' file");
        }
    }

    /// Listens for `record` (`again`: for an activator the last agent kept) and journals it.
    fn activator_start(
        self: &Arc<Self>,
        record: Record,
        again: bool,
    ) -> Result<ActivatorStatus, ApiError> {
        let spec = &record.spec;
        let listen = Addr::from_str(&spec.listen).map_err(bad)?;
        let upstream = Addr::from_str(&spec.upstream).map_err(bad)?;
        let health = spec.wake.health_url.clone().map(HealthCheck::Url);
        if let Some(h) = &health {
            h.validate().map_err(bad)?;
        }
        if self.activators.live().contains_key(&spec.listen) {
            return Err(ApiError::new(
                ErrorKind::Refused,
                format!("an activator listens on {} already", spec.listen),
            ));
        }
        let wake = cryo_api::WakeSpec {
            health_url: None,
            ..spec.wake.clone()
        };
        let park = ParkOptions {
            max_parked_host: spec.max_parked_host,
            ..ParkOptions::default()
        };
        let (activation, from, initial): (Arc<dyn Activation>, _, Phase) =
            match (&spec.target, &spec.standby) {
                (Some(t), None) => {
                    let inplace = InPlace {
                        gpu: self.gpu.clone(),
                        target: Target::from(t),
                        state: self.state.clone(),
                        watcher: Arc::clone(&self.guard) as Arc<dyn cryo_lifecycle::Watcher + Send + Sync>,
                        park,
                        wake: wake.options(),
                    };
                    let initial = inplace.phase_now().map_err(failed)?;
                    (Arc::new(inplace), None, initial)
                }
                (None, Some(image)) => {
                    let park = ParkRequest::of(TargetSpec::Pids { pids: Vec::new() }, &park);
                    let claimed = record.claimed.filter(ProcId::is_alive_same);
                    let from = Arc::new(
                        FromStandby::new(
                            cryo_api::AgentClient::new(&self.socket),
                            image.clone(),
                            wake,
                            park,
                        )
                        .with_claimed(claimed),
                    );
                    let initial = match claimed {
                        Some(root) => InPlace {
                            gpu: self.gpu.clone(),
                            target: Target::Tree(root.pid),
                            state: self.state.clone(),
                            watcher: Arc::clone(&self.guard) as Arc<dyn cryo_lifecycle::Watcher + Send + Sync>,
                            park: ParkOptions::default(),
                            wake: spec.wake.options(),
                        }
                        .phase_now()
                        .map_err(failed)?,
                        None => Phase::Parked { last_error: None },
                    };
                    (Arc::clone(&from) as Arc<dyn Activation>, Some(from), initial)
                }
                _ => {
                    return Err(bad(
                        "an activator is in front of a worker (target) or of a standby pool (standby), one of the two",
                    ))
                }
            };
        let policy = Policy {
            idle_timeout: (spec.idle_timeout_s > 0)
                .then(|| Duration::from_secs(spec.idle_timeout_s)),
            activation_timeout: Duration::from_secs(spec.activation_timeout_s),
            health,
            http: spec.http,
        };
        let activator = Activator::new(upstream, policy, activation, initial);
        let rt = self.activators.rt()?;
        // The last agent's socket, queued connections and all, where its keeper still holds it.
        let taken = match record.keeper.filter(|_| again) {
            Some(k) => {
                let _in_rt = rt.enter();
                keeper::take_over(k, &listen)
                    .inspect_err(|e| {
                        tracing::warn!(listen = %spec.listen, error = %e, "the listening socket cannot be taken from its keeper: bound again");
                    })
                    .ok()
            }
            None => None,
        };
        let handed = taken.is_some();
        let listener = match taken {
            Some(l) => l,
            None => rt.block_on(listen.listen_again()).map_err(|e| {
                ApiError::new(
                    ErrorKind::Refused,
                    format!("cannot listen on {}: {e}", spec.listen),
                )
            })?,
        };
        let bound = listener.local_addr().map_err(failed)?;
        let keeper = Keeper::start(&listener)
            .inspect_err(|e| {
                tracing::warn!(listen = %spec.listen, error = %e, "no keeper for the listening socket: connections queued when the agent dies will be lost");
            })
            .ok();
        let mut record = record;
        record.spec.listen = bound.to_string();
        let task = rt.spawn({
            let activator = activator.clone();
            let agent = Arc::downgrade(self);
            let from = from.clone();
            async move {
                // A standby activator's claim is kept as soon as it is made.
                if let Some(from) = from {
                    let mut phases = activator.watch();
                    let serve = activator.serve(listener);
                    tokio::pin!(serve);
                    let mut kept = from.claimed();
                    loop {
                        tokio::select! {
                            () = &mut serve => break,
                            changed = phases.changed() => {
                                if changed.is_err() { break }
                                let now = from.claimed();
                                if now != kept {
                                    kept = now;
                                    if let Some(agent) = agent.upgrade() {
                                        let live = agent.activators.live();
                                        if let Err(e) = agent.activators.save(&live) {
                                            tracing::error!(error = %e.message, "cannot write the activators' file");
                                        }
                                    }
                                }
                            }
                        }
                    }
                } else {
                    activator.serve(listener).await;
                }
            }
        });
        let live = Live {
            record,
            activator,
            from,
            task,
            keeper,
        };
        let status = Activators::status(&live);
        let pids = live
            .record
            .procs
            .iter()
            .copied()
            .chain(status.claimed)
            .collect();
        let mut all = self.activators.live();
        all.insert(status.spec.listen.clone(), live);
        self.activators.save(&all)?;
        drop(all);
        self.journal_activator(Event::ActivatorListening {
            listen: status.spec.listen.clone(),
            pids,
            found: status.phase.clone(),
            again,
            handed,
        });
        Ok(status)
    }
}
