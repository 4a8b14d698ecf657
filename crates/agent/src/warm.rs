//! The warm path through the agent: `POST /v1/park`, `/v1/wake`; the standby pools are
//! [`crate::standby`].
//!
//! # Design
//! The handlers call the lifecycle's own `park` and `wake` with the options the request's one
//! conversion gives (the standalone commands use the same); a wake is traced by the guard in
//! this process before its unlock (`guard_before_unlock` of [`cryo_guard::Guard`]).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use cryo_api::{path, ApiError, ErrorKind, ParkRequest, WakeRequest};
use cryo_lifecycle::park::PlaceError;
use cryo_lifecycle::{ParkError, ParkReport, Progress, Target, WakeError, WakeReport};

use crate::auth::Peer;
use crate::server::{streamed, target_request, Failure};
use crate::Agent;

/// The warm path's routes, merged into the agent's router.
pub(crate) fn routes() -> Router<Arc<Agent>> {
    Router::new()
        .route(path::PARK, post(park))
        .route(path::WAKE, post(wake))
        .merge(crate::standby::routes())
        .merge(crate::activators::routes())
}

async fn park(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req = target_request(&agent, &peer, &body, |r: &ParkRequest| &r.target)?;
    tracing::info!(target = %Target::from(&req.target), ?peer.cred, "park");
    Ok(streamed(move |p| agent.park(&req, p)))
}

async fn wake(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req = target_request(&agent, &peer, &body, |r: &WakeRequest| &r.target)?;
    if let Some(h) = &req.wake.options().health {
        h.validate()
            .map_err(|e| Failure::from(ApiError::new(ErrorKind::BadRequest, e.to_string())))?;
    }
    tracing::info!(target = %Target::from(&req.target), ?peer.cred, "wake");
    Ok(streamed(move |p| agent.wake(&req, p)))
}

impl Agent {
    /// `POST /v1/park`.
    pub(crate) fn park(
        &self,
        req: &ParkRequest,
        progress: &dyn Progress,
    ) -> Result<ParkReport, ApiError> {
        let target = Target::from(&req.target);
        let resolved = target
            .resolve()
            .map_err(|e| ApiError::new(ErrorKind::NotFound, e.to_string()))?;
        cryo_lifecycle::park(
            &self.gpu,
            &resolved,
            &req.options(),
            &self.journal,
            &self.state,
            self.guard.as_ref(),
            progress,
        )
        .map_err(|e| match e {
            ParkError::Suspend { .. }
            | ParkError::HostMemory { .. }
            | ParkError::NoCuda(_)
            // A park or a wake is at work on it: this one did nothing.
            | ParkError::InProgress { .. } => ApiError::new(ErrorKind::Refused, e.to_string()),
            e => ApiError::new(ErrorKind::Failed, e.to_string()),
        })
    }

    /// `POST /v1/wake`: traced by this agent's guard before the unlock.
    pub(crate) fn wake(
        &self,
        req: &WakeRequest,
        progress: &dyn Progress,
    ) -> Result<WakeReport, ApiError> {
        let target = Target::from(&req.target);
        let resolved = target
            .resolve()
            .map_err(|e| ApiError::new(ErrorKind::NotFound, e.to_string()))?;
        cryo_lifecycle::wake(
            &self.gpu,
            &resolved,
            &req.wake.options(),
            &self.journal,
            &self.state,
            self.guard.as_ref(),
            progress,
        )
        .map_err(wake_error)
    }
}

/// Whether the wake was refused before anything was restored (the worker stays parked).
pub(crate) fn refused_before_restore(e: &WakeError) -> bool {
    matches!(
        e,
        WakeError::Place(
            PlaceError::NoRoom { .. }
                | PlaceError::NodeFenced { .. }
                | PlaceError::NoSuchGpu { .. },
        ) | WakeError::NotParked(_)
            | WakeError::DeadPark { .. }
            | WakeError::NoCuda(_)
            // Another wake is at work on it: this one read and restored nothing.
            | WakeError::InProgress { .. }
    )
}

/// A wake's error as the API's: a refusal when nothing was restored.
pub(crate) fn wake_error(e: WakeError) -> ApiError {
    if refused_before_restore(&e) {
        ApiError::new(ErrorKind::Refused, e.to_string())
    } else {
        ApiError::new(ErrorKind::Failed, e.to_string())
    }
}
