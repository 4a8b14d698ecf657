//! The node agent's API (`cryod`, `cryo agent run`): HTTP/JSON over the unix socket at
//! [`cryo_state::StateDir::agent_socket`] (or `CRYO_AGENT_SOCKET`), paths under `/v1`.
//!
//! # Design
//! Types only, and the client; no business logic. A request names what to act on and how, in the
//! words of the command line ([`StopRequest`], [`FreezeRequest`], ...); the same type becomes the
//! lifecycle's options through one conversion ([`StopRequest::options`]...), which the
//! standalone CLI uses too, so a command means the same through the agent and without it. The
//! answers are the lifecycle's own reports ([`cryo_lifecycle::StopReport`]...).
//!
//! - Short requests answer one JSON document; a failure is an [`ApiError`] (a stable
//!   machine-readable [`ErrorKind`], a message, a hint) with the matching HTTP status.
//! - Long operations (stop, freeze, thaw) answer `application/x-ndjson`: [`StreamLine`]s of
//!   progress, then one `done` (the report) or one `error` line. The HTTP status is 200 once the
//!   stream starts; a refusal before it (authorisation, a malformed request) is a plain error.
//! - `GET /v1/events?follow=1&since=SEQ`: the journal's records as NDJSON, one per line
//!   (`cryo timeline --json`'s format), followed as they are written. Records the journal no
//!   longer holds when the stream comes to them (archives removed by the retention) are one
//!   line `{"type":"records_lost","first":SEQ,"last":SEQ,"lost":N}` (no `seq`) before the
//!   records after them.
//! - `GET /v1/metrics`: the Prometheus text exposition (also served on TCP, loopback by default).
//!
//! Authorisation is by the peer's credentials (`SO_PEERCRED`, `SO_PEERGROUPS`): root for every
//! request that changes something, root or members of the agent's read group for reads
//! ([`Access`]).
//!
//! [`client::AgentClient`] is the blocking client (through [`cryo_http`], cryo's one HTTP client).

pub mod client;
pub mod driver;
mod kube;
mod requests;
mod warm;

use serde::{Deserialize, Serialize};

pub use client::{AgentClient, ClientError};
pub use driver::{AgentDriver, DriverFailure, GpuCall, GpuCallAnswer, GpuCallRequest};
pub use kube::{ContainerStop, KubeStopReport, KubeStopRequest, KubeTarget};
pub use requests::*;
pub use warm::*;

/// The environment variable naming the agent's socket (else `STATE_DIR/cryod.sock`).
pub const SOCKET_ENV: &str = "CRYO_AGENT_SOCKET";

/// The agent's socket for the state directory `state`: `CRYO_AGENT_SOCKET` when set (and not
/// empty), else [`cryo_state::StateDir::agent_socket`].
pub fn socket_path(state: &cryo_state::StateDir) -> std::path::PathBuf {
    match std::env::var_os(SOCKET_ENV) {
        Some(p) if !p.is_empty() => p.into(),
        _ => state.agent_socket(),
    }
}

/// The API's paths.
pub mod path {
    /// `GET`: [`crate::AgentStatus`].
    pub const STATUS: &str = "/v1/status";
    /// `POST` [`crate::StopRequest`]: stream of [`cryo_lifecycle::StopReport`].
    pub const STOP: &str = "/v1/stop";
    /// `POST` [`crate::FreezeRequest`]: stream of [`cryo_lifecycle::FreezeReport`].
    pub const FREEZE: &str = "/v1/freeze";
    /// `POST` [`crate::ThawRequest`]: stream of [`cryo_lifecycle::ThawReport`].
    pub const THAW: &str = "/v1/thaw";
    /// `POST` [`crate::GpuCallRequest`] to `/v1/gpu/{call}`: [`crate::GpuCallAnswer`].
    pub const GPU: &str = "/v1/gpu";
    /// `POST` [`crate::PidRequest`]: [`crate::AttachReport`].
    pub const GUARD_ATTACH: &str = "/v1/guard/attach";
    /// `POST` [`crate::PidRequest`]: [`crate::DetachReport`].
    pub const GUARD_DETACH: &str = "/v1/guard/detach";
    /// `POST` [`crate::ReleaseRequest`]: [`crate::ReleaseReport`].
    pub const GUARD_RELEASE: &str = "/v1/guard/release";
    /// `GET ?follow=1&since=SEQ`: NDJSON journal records.
    pub const EVENTS: &str = "/v1/events";
    /// `GET`: Prometheus text.
    pub const METRICS: &str = "/v1/metrics";
    /// `POST`: [`crate::ShutdownReport`], or [`crate::ErrorKind::PinsHeld`].
    pub const SHUTDOWN: &str = "/v1/shutdown";
    /// `POST` [`crate::ParkRequest`]: stream of [`cryo_lifecycle::ParkReport`].
    pub const PARK: &str = "/v1/park";
    /// `POST` [`crate::WakeRequest`]: stream of [`cryo_lifecycle::WakeReport`].
    pub const WAKE: &str = "/v1/wake";
    /// `POST` [`crate::KubeStopRequest`]: stream of [`crate::KubeStopReport`] (agents run with
    /// `--kube-node` only).
    pub const KUBE_STOP: &str = "/v1/kube/stop";
    /// `GET`: [`crate::StandbyList`]; `POST /v1/standby/{create,claim,remove}`.
    pub const STANDBY: &str = "/v1/standby";
    /// `GET` lists the agent's activators, `POST` creates one, `POST .../remove` removes one.
    pub const ACTIVATORS: &str = "/v1/activators";
}

/// Who may make a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Access {
    /// Reads: root, or a member of the agent's read group.
    Read,
    /// Changes: root only.
    Change,
}

/// What kind of failure an [`ApiError`] is: stable, for clients to branch on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The caller may not make this request (403).
    Forbidden,
    /// The request is malformed (400).
    BadRequest,
    /// No such path or thing (404).
    NotFound,
    /// The request was refused as unsafe or impossible; nothing was done (409): a freeze or
    /// thaw refused, a process not traced.
    Refused,
    /// The agent holds pins and will not stop (409).
    PinsHeld,
    /// The operation failed (500).
    Failed,
    /// The agent is shutting down (503).
    ShuttingDown,
}

impl ErrorKind {
    /// The HTTP status that carries it.
    pub fn http_status(self) -> u16 {
        match self {
            ErrorKind::Forbidden => 403,
            ErrorKind::BadRequest => 400,
            ErrorKind::NotFound => 404,
            ErrorKind::Refused | ErrorKind::PinsHeld => 409,
            ErrorKind::Failed => 500,
            ErrorKind::ShuttingDown => 503,
        }
    }
}

/// A failure, as the agent answers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{message}")]
pub struct ApiError {
    /// What kind.
    pub kind: ErrorKind,
    /// What happened, for humans (the same words the standalone command prints).
    pub message: String,
    /// What to do about it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hint: Option<String>,
}

impl ApiError {
    /// An error of `kind`.
    pub fn new(kind: ErrorKind, message: impl Into<String>) -> Self {
        ApiError {
            kind,
            message: message.into(),
            hint: None,
        }
    }

    /// With a hint.
    pub fn with_hint(mut self, hint: impl Into<String>) -> Self {
        self.hint = Some(hint.into());
        self
    }
}

/// One line of a long operation's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamLine<T> {
    /// Progress of a step.
    Progress(ProgressEvent),
    /// The result (last line).
    Done(T),
    /// The operation failed (last line).
    Error(ApiError),
}

/// A call of [`cryo_lifecycle::Progress`], carried to the client.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum ProgressEvent {
    /// [`cryo_lifecycle::Progress::begin`].
    Begin {
        /// The process.
        pid: cryo_proc::Pid,
        /// The step.
        step: String,
        /// Bytes it moves (0: unknown).
        total: u64,
    },
    /// [`cryo_lifecycle::Progress::advance`].
    Advance {
        /// The process.
        pid: cryo_proc::Pid,
        /// Bytes moved so far.
        done: u64,
    },
    /// [`cryo_lifecycle::Progress::end`].
    End {
        /// The process.
        pid: cryo_proc::Pid,
        /// The step.
        step: String,
        /// Whether it succeeded.
        ok: bool,
        /// A short summary.
        detail: String,
    },
}

impl ProgressEvent {
    /// Replays the event on `progress` (the client's display).
    pub fn replay(self, progress: &dyn cryo_lifecycle::Progress) {
        use cryo_lifecycle::progress::step_literal;
        match self {
            ProgressEvent::Begin { pid, step, total } => {
                progress.begin(pid, step_literal(step), total)
            }
            ProgressEvent::Advance { pid, done } => progress.advance(pid, done),
            ProgressEvent::End {
                pid,
                step,
                ok,
                detail,
            } => progress.end(pid, step_literal(step), ok, &detail),
        }
    }
}
