//! The blocking client of the agent's API, for the CLI and hooks.
//!
//! Every call connects to the socket; [`ClientError::NotRunning`] means nothing listens there
//! (no socket, or a socket its agent left behind), which is the CLI's cue to work standalone.
//! Any other failure means an agent runs and the request failed: never a reason to act behind
//! its back.

use std::path::{Path, PathBuf};
use std::time::Duration;

use cryo_http::{Client, Endpoint, HttpError, Response, Timeouts};
use cryo_lifecycle::{FreezeReport, Progress, StopReport, ThawReport};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{
    path, AgentStatus, ApiError, AttachReport, DetachReport, FreezeRequest, PidRequest,
    ReleaseReport, ReleaseRequest, ShutdownReport, StopRequest, StreamLine, ThawRequest,
};

/// How long a short request may take.
const SHORT: Duration = Duration::from_secs(60);

/// A request to the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// No agent listens on the socket.
    #[error("no agent runs (nothing answers on {0})")]
    NotRunning(PathBuf),
    /// The exchange failed (the agent died mid-request, or refused the connection).
    #[error("talking to the agent: {0}")]
    Http(#[from] HttpError),
    /// The agent answered with an error.
    #[error("{0}")]
    Api(ApiError),
    /// The agent answered something this client cannot read (another version of cryo?).
    #[error("the agent answered {status} {body:?}, which this cryo cannot read: {error}")]
    BadAnswer {
        /// The HTTP status.
        status: u16,
        /// What it sent (cut to 512 bytes).
        body: String,
        /// The parser's complaint.
        error: String,
    },
    /// A long operation's stream ended without its result (the agent died or restarted).
    #[error("the agent's answer ended before the result (did the agent die?); the operation may have finished: check `cryo timeline`")]
    Truncated,
}

impl ClientError {
    /// The agent's error, if it answered one.
    pub fn api(&self) -> Option<&ApiError> {
        match self {
            ClientError::Api(e) => Some(e),
            _ => None,
        }
    }
}

/// The client of the agent on one socket.
#[derive(Debug, Clone)]
pub struct AgentClient {
    socket: PathBuf,
    pub(crate) short: Client,
    pub(crate) long: Client,
}

impl AgentClient {
    /// The client of the agent at `socket` (nothing is touched until a call).
    pub fn new(socket: impl Into<PathBuf>) -> Self {
        let socket = socket.into();
        let endpoint = Endpoint::Unix(socket.clone());
        AgentClient {
            short: Client::new(endpoint.clone(), Timeouts::total(SHORT)),
            long: Client::new(endpoint, Timeouts::unlimited()),
            socket,
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// `GET /v1/status`.
    pub fn status(&self) -> Result<AgentStatus, ClientError> {
        self.get(path::STATUS)
    }

    /// `GET /v1/metrics`: the Prometheus text.
    pub fn metrics(&self) -> Result<String, ClientError> {
        let r = self.short.get(path::METRICS).map_err(|e| self.http(e))?;
        Ok(success(r)?.text()?)
    }

    /// `POST /v1/stop`, its progress replayed on `progress`.
    pub fn stop(
        &self,
        req: &StopRequest,
        progress: &dyn Progress,
    ) -> Result<StopReport, ClientError> {
        self.stream(path::STOP, req, progress)
    }

    /// `POST /v1/kube/stop`: `cryo stop --self` or `--pod`.
    pub fn kube_stop(
        &self,
        req: &crate::KubeStopRequest,
        progress: &dyn Progress,
    ) -> Result<crate::KubeStopReport, ClientError> {
        self.stream(path::KUBE_STOP, req, progress)
    }

    /// `POST /v1/freeze`.
    pub fn freeze(
        &self,
        req: &FreezeRequest,
        progress: &dyn Progress,
    ) -> Result<FreezeReport, ClientError> {
        self.stream(path::FREEZE, req, progress)
    }

    /// `POST /v1/thaw`.
    pub fn thaw(
        &self,
        req: &ThawRequest,
        progress: &dyn Progress,
    ) -> Result<ThawReport, ClientError> {
        self.stream(path::THAW, req, progress)
    }

    /// `POST /v1/gpu/{call}`: one driver call made by the agent. A lock may wait as long as
    /// its timeout (without limit when it has none).
    pub fn gpu(
        &self,
        call: crate::GpuCall,
        req: &crate::GpuCallRequest,
    ) -> Result<crate::GpuCallAnswer, ClientError> {
        self.post(&self.long, &call.path(), req)
    }

    /// `POST /v1/guard/attach`.
    pub fn attach(&self, req: &PidRequest) -> Result<AttachReport, ClientError> {
        self.post(&self.short, path::GUARD_ATTACH, req)
    }

    /// `POST /v1/guard/detach`.
    pub fn detach(&self, req: &PidRequest) -> Result<DetachReport, ClientError> {
        self.post(&self.short, path::GUARD_DETACH, req)
    }

    /// `POST /v1/guard/release`.
    pub fn release(&self, req: &ReleaseRequest) -> Result<ReleaseReport, ClientError> {
        self.post(&self.short, path::GUARD_RELEASE, req)
    }

    /// `POST /v1/shutdown`.
    pub fn shutdown(&self) -> Result<ShutdownReport, ClientError> {
        self.post(&self.short, path::SHUTDOWN, &serde_json::json!({}))
    }

    /// `GET /v1/events?follow=...&since=SEQ`: the journal's records, one JSON line each, as
    /// they come (with `follow`, until the agent stops or the caller drops the iterator), and a
    /// `records_lost` line for seqs the journal no longer holds (see the crate docs).
    pub fn events(
        &self,
        since: u64,
        follow: bool,
    ) -> Result<impl Iterator<Item = Result<String, ClientError>>, ClientError> {
        let path = format!("{}?follow={}&since={since}", path::EVENTS, u8::from(follow));
        let r = self.long.get(&path).map_err(|e| self.http(e))?;
        Ok(success(r)?.lines().map(|l| l.map_err(ClientError::from)))
    }

    fn http(&self, e: HttpError) -> ClientError {
        if e.nobody_listens() {
            ClientError::NotRunning(self.socket.clone())
        } else {
            ClientError::Http(e)
        }
    }

    pub(crate) fn get<T: DeserializeOwned>(&self, path: &str) -> Result<T, ClientError> {
        let r = self.short.get(path).map_err(|e| self.http(e))?;
        let status = r.status;
        decode(status, &r.text()?)
    }

    pub(crate) fn post<Req: Serialize, T: DeserializeOwned>(
        &self,
        client: &Client,
        path: &str,
        req: &Req,
    ) -> Result<T, ClientError> {
        let r = client
            .post_json(path, &encode(req)?)
            .map_err(|e| self.http(e))?;
        let status = r.status;
        decode(status, &r.text()?)
    }

    pub(crate) fn stream<Req: Serialize, T: DeserializeOwned>(
        &self,
        path: &str,
        req: &Req,
        progress: &dyn Progress,
    ) -> Result<T, ClientError> {
        let r = self
            .long
            .post_json(path, &encode(req)?)
            .map_err(|e| self.http(e))?;
        for line in success(r)?.lines() {
            let line = line?;
            if line.is_empty() {
                continue;
            }
            match serde_json::from_str::<StreamLine<T>>(&line) {
                Ok(StreamLine::Progress(p)) => p.replay(progress),
                Ok(StreamLine::Done(t)) => return Ok(t),
                Ok(StreamLine::Error(e)) => return Err(ClientError::Api(e)),
                Err(e) => return Err(bad_answer(200, &line, &e)),
            }
        }
        Err(ClientError::Truncated)
    }
}

fn encode<Req: Serialize>(req: &Req) -> Result<Vec<u8>, ClientError> {
    serde_json::to_vec(req).map_err(|e| ClientError::BadAnswer {
        status: 0,
        body: String::new(),
        error: format!("cannot encode the request: {e}"),
    })
}

/// `r` when it is a success; otherwise the agent's error it carries.
fn success(r: Response) -> Result<Response, ClientError> {
    if r.is_success() {
        return Ok(r);
    }
    let status = r.status;
    Err(api_error(status, &r.text()?))
}

fn decode<T: DeserializeOwned>(status: u16, body: &str) -> Result<T, ClientError> {
    if !(200..300).contains(&status) {
        return Err(api_error(status, body));
    }
    serde_json::from_str(body).map_err(|e| bad_answer(status, body, &e))
}

fn api_error(status: u16, body: &str) -> ClientError {
    match serde_json::from_str::<ApiError>(body) {
        Ok(e) => ClientError::Api(e),
        Err(e) => bad_answer(status, body, &e),
    }
}

fn bad_answer(status: u16, body: &str, e: &serde_json::Error) -> ClientError {
    let mut body = body.to_string();
    if body.len() > 512 {
        let cut = (0..=512)
            .rev()
            .find(|i| body.is_char_boundary(*i))
            .unwrap_or(0);
        body.truncate(cut);
    }
    ClientError::BadAnswer {
        status,
        body,
        error: e.to_string(),
    }
}
