//! The API on the unix socket: routes, authorisation, JSON and NDJSON answers.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::extract::{ConnectInfo, Path, Query, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use cryo_api::{path, Access, ApiError, ErrorKind, StreamLine};
use serde::{de::DeserializeOwned, Serialize};
use tokio::sync::mpsc;

use crate::auth::Peer;
use crate::Agent;

type Shared = State<Arc<Agent>>;

/// An [`ApiError`] as an HTTP answer.
pub(crate) struct Failure(ApiError);

impl From<ApiError> for Failure {
    fn from(e: ApiError) -> Self {
        Failure(e)
    }
}

impl IntoResponse for Failure {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.0.kind.http_status())
            .unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        (status, json_body(&self.0)).into_response()
    }
}

fn json_body<T: Serialize>(v: &T) -> Response {
    match serde_json::to_vec(v) {
        Ok(b) => ([(header::CONTENT_TYPE, "application/json")], b).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e.to_string()).into_response(),
    }
}

/// Serves `listener` until `done` fires (the guard's loop ended); then lets the requests in
/// flight finish.
pub fn serve(
    agent: Arc<Agent>,
    listener: std::os::unix::net::UnixListener,
    done: tokio::sync::oneshot::Receiver<()>,
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("cryod-api")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let listener = tokio::net::UnixListener::from_std(listener)?;
        // The Kubernetes client lives in this runtime, shared by the publisher and handlers.
        crate::k8s::Kube::start(&agent);
        let app = router(agent);
        axum::serve(listener, app.into_make_service_with_connect_info::<Peer>())
            .with_graceful_shutdown(async move {
                let _ = done.await;
            })
            .await
    })?;
    // Blocking threads still running (a stop whose client left) finish their work.
    rt.shutdown_timeout(Duration::from_secs(600));
    Ok(())
}

fn router(agent: Arc<Agent>) -> Router {
    Router::new()
        .route(path::STATUS, get(status))
        .route(path::METRICS, get(metrics))
        .route(path::EVENTS, get(events))
        .route(path::STOP, post(stop))
        .route(path::FREEZE, post(freeze))
        .route(path::THAW, post(thaw))
        .route(&format!("{}/{{call}}", path::GPU), post(gpu))
        .route(path::GUARD_ATTACH, post(attach))
        .route(path::GUARD_DETACH, post(detach))
        .route(path::GUARD_RELEASE, post(release))
        .route(path::SHUTDOWN, post(shutdown))
        .route(path::KUBE_STOP, post(kube_stop))
        .merge(crate::warm::routes())
        .fallback(|| async {
            Failure(ApiError::new(
                ErrorKind::NotFound,
                "no such endpoint (this agent speaks /v1)",
            ))
        })
        .with_state(agent)
}

/// Checks the caller may make a request of `access`; a change only from a caller outside any
/// pod's container (a container may only stop itself: [`allow_stop`]).
pub(crate) fn allow(agent: &Agent, peer: &Peer, access: Access) -> Result<(), Failure> {
    allow_stop(agent, peer, access)?;
    if access == Access::Change {
        refused_if_err(peer, crate::k8s::unconfined(agent, peer))?;
    }
    Ok(())
}

/// As [`allow`] for the stops, which a caller in a pod's container may make of its own
/// container only: that container, if so.
fn allow_stop(
    agent: &Agent,
    peer: &Peer,
    access: Access,
) -> Result<Option<cryo_kube::CgroupIdentity>, Failure> {
    refused_if_err(
        peer,
        peer.authorize(access, agent.read_group.as_ref().map(|g| g.1)),
    )?;
    if access != Access::Change {
        return Ok(None);
    }
    refused_if_err(peer, crate::k8s::own_container(agent, peer))
}

fn refused_if_err<T>(peer: &Peer, r: Result<T, ApiError>) -> Result<T, Failure> {
    if let Err(e) = &r {
        tracing::warn!(?peer.cred, "refused: {}", e.message);
    }
    Ok(r?)
}

/// Checks the caller sees pids as the agent does (same pid namespace).
pub(crate) fn same_pids(peer: &Peer) -> Result<(), Failure> {
    let refuse = |why: &str| {
        Failure(
            ApiError::new(
                ErrorKind::Forbidden,
                format!("pids name processes in the agent's pid namespace, and {why}"),
            )
            .with_hint(
                "name the target by cgroup, or run the command in the agent's pid namespace",
            ),
        )
    };
    let pid = peer
        .pid()
        .ok_or_else(|| refuse("the caller is not visible from it"))?;
    let me = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(cryo_proc::Pid::MAX);
    match cryo_proc::same_namespace(pid, me, cryo_proc::NamespaceKind::Pid) {
        Ok(true) => Ok(()),
        _ => Err(refuse("the caller is in another one")),
    }
}

/// Pids are the agent's: a caller in another pid namespace may name a cgroup only.
fn check_target(peer: &Peer, target: &cryo_api::TargetSpec) -> Result<(), Failure> {
    if matches!(target, cryo_api::TargetSpec::Cgroup { .. }) {
        Ok(())
    } else {
        same_pids(peer)
    }
}

/// Whether a request names processes by pid (read in the agent's pid namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pids {
    /// It does: the caller must see pids as the agent does ([`same_pids`]).
    Named,
    /// It does not (an image, a GPU).
    None,
}

/// A request that changes something: the caller authorised for changes ([`allow`]), the body
/// parsed, and, when it names pids, the caller in the agent's pid namespace.
pub(crate) fn change_request<T: DeserializeOwned>(
    agent: &Agent,
    peer: &Peer,
    body: &Bytes,
    pids: Pids,
) -> Result<T, Failure> {
    allow(agent, peer, Access::Change)?;
    let req = parse(body)?;
    if pids == Pids::Named {
        same_pids(peer)?;
    }
    Ok(req)
}

/// A change request that names a target (`target` finds it in the request): as
/// [`change_request`], then a target named by pids only from the agent's pid namespace
/// ([`check_target`]).
pub(crate) fn target_request<T: DeserializeOwned>(
    agent: &Agent,
    peer: &Peer,
    body: &Bytes,
    target: impl FnOnce(&T) -> &cryo_api::TargetSpec,
) -> Result<T, Failure> {
    let req = change_request(agent, peer, body, Pids::None)?;
    check_target(peer, target(&req))?;
    Ok(req)
}

pub(crate) fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, Failure> {
    serde_json::from_slice(body).map_err(|e| {
        Failure(ApiError::new(
            ErrorKind::BadRequest,
            format!("malformed request: {e}"),
        ))
    })
}

/// Runs `f` on a blocking thread; its answer as JSON.
pub(crate) async fn blocking<T: Serialize + Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<Response, Failure> {
    match tokio::task::spawn_blocking(f).await {
        Ok(r) => Ok(json_body(&r?)),
        Err(e) => Err(Failure(ApiError::new(
            ErrorKind::Failed,
            format!("the request's thread failed: {e}"),
        ))),
    }
}

/// Runs a long operation on a blocking thread; answers NDJSON: its progress as it happens,
/// then the result. The operation runs to its end whether or not the caller stays.
pub(crate) fn streamed<T: Serialize + Send + 'static>(
    f: impl FnOnce(&crate::ops::StreamProgress) -> Result<T, ApiError> + Send + 'static,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::task::spawn_blocking(move || {
        let progress = crate::ops::StreamProgress::new(tx.clone());
        let line = match f(&progress) {
            Ok(t) => StreamLine::Done(t),
            Err(e) => StreamLine::Error(e),
        };
        // The caller may be gone: the operation is done all the same.
        let _ = tx.blocking_send(ndjson(&line));
    });
    ndjson_response(rx)
}

/// One NDJSON line.
pub(crate) fn ndjson<T: Serialize>(v: &T) -> Bytes {
    let mut line = serde_json::to_vec(v).unwrap_or_else(|e| {
        format!(r#"{{"error":{{"kind":"failed","message":"cannot encode the answer: {e}"}}}}"#)
            .into_bytes()
    });
    line.push(b'\n');
    Bytes::from(line)
}

fn ndjson_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv()
            .await
            .map(|b| (Ok::<_, std::convert::Infallible>(b), rx))
    });
    (
        [(header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(stream),
    )
        .into_response()
}

async fn status(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Read)?;
    blocking(move || Ok(agent.status())).await
}

async fn metrics(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Read)?;
    agent.update_gauges();
    Ok((
        [(header::CONTENT_TYPE, cryo_telemetry::CONTENT_TYPE)],
        agent.telemetry.metrics().encode(),
    )
        .into_response())
}

/// `?follow=1&since=SEQ`.
#[derive(Debug, serde::Deserialize)]
struct EventsQuery {
    #[serde(default)]
    follow: Option<String>,
    #[serde(default)]
    since: u64,
}

async fn events(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Query(q): Query<EventsQuery>,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Read)?;
    let follow = matches!(q.follow.as_deref(), Some("1" | "true" | "yes" | ""));
    let (tx, rx) = mpsc::channel::<Bytes>(256);
    tokio::task::spawn_blocking(move || crate::ops::follow_events(&agent, q.since, follow, &tx));
    Ok(ndjson_response(rx))
}

async fn stop(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let confined = allow_stop(&agent, &peer, Access::Change)?;
    let req: cryo_api::StopRequest = parse(&body)?;
    check_target(&peer, &req.target)?;
    tracing::info!(target = %req.target(), ?peer.cred, "stop");
    Ok(streamed(move |p| agent.stop(&req, confined.as_ref(), p)))
}

async fn kube_stop(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    // A confined caller may ask for itself only: `plan` checks the rest.
    allow_stop(&agent, &peer, Access::Change)?;
    let req: cryo_api::KubeStopRequest = parse(&body)?;
    let plan = crate::k8s::plan(&agent, &peer, req).await.map_err(|e| {
        tracing::warn!(?peer.cred, "kube stop refused: {}", e.message);
        Failure(e)
    })?;
    tracing::info!(?plan, ?peer.cred, "kube stop");
    Ok(streamed(move |p| agent.kube_stop(plan, p)))
}

async fn freeze(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: cryo_api::FreezeRequest = change_request(&agent, &peer, &body, Pids::Named)?;
    tracing::info!(pid = req.pid, image = %req.image.display(), ?peer.cred, "freeze");
    Ok(streamed(move |p| agent.freeze(&req, p)))
}

async fn thaw(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let requested = std::time::Instant::now();
    let req: cryo_api::ThawRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::info!(image = %req.image.display(), ?peer.cred, "thaw");
    Ok(streamed(move |p| agent.thaw(&req, requested, p)))
}

async fn gpu(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    Path(call): Path<String>,
    body: Bytes,
) -> Result<Response, Failure> {
    let call = cryo_api::GpuCall::parse(&call).ok_or_else(|| {
        Failure(ApiError::new(
            ErrorKind::NotFound,
            format!("no driver call {call:?} (state, lock, checkpoint, restore, unlock, restore_thread_id)"),
        ))
    })?;
    allow(&agent, &peer, call.access())?;
    let req: cryo_api::GpuCallRequest = parse(&body)?;
    same_pids(&peer)?;
    if call.access() == Access::Change {
        tracing::info!(pid = req.pid, call = call.as_str(), ?peer.cred, "driver call");
    }
    blocking(move || agent.gpu_call(call, &req)).await
}

async fn attach(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: cryo_api::PidRequest = change_request(&agent, &peer, &body, Pids::Named)?;
    blocking(move || agent.attach(req.pid)).await
}

async fn detach(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: cryo_api::PidRequest = change_request(&agent, &peer, &body, Pids::Named)?;
    blocking(move || agent.detach(req.pid)).await
}

async fn release(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: cryo_api::ReleaseRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::warn!(gpu = %req.gpu, ?peer.cred, "release of pins asked for");
    blocking(move || agent.release(&req)).await
}

async fn shutdown(
    State(agent): Shared,
    ConnectInfo(peer): ConnectInfo<Peer>,
    // Read, so that a refusal does not close the connection under the caller's request.
    _body: Bytes,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Change)?;
    match agent.request_shutdown() {
        Ok(()) => {
            tracing::info!(?peer.cred, "shutting down on request");
            Ok(json_body(&cryo_api::ShutdownReport {
                pid: std::process::id(),
            }))
        }
        Err(e) => {
            tracing::warn!(?peer.cred, "refusing to stop: {}", e.message);
            Err(Failure(e))
        }
    }
}
