//! Shrink before suspend: before cryo locks a worker's CUDA contexts, the engine is asked to
//! release what it can rebuild (the KV cache, the weights when the host or the model's files can
//! bring them back), so the checkpoint copies less device memory; after the restore it is asked to
//! take it back.
//!
//! # Design
//! One [`Shrink`] (the spec, the engine's address, a deadline) and two calls: [`Shrink::release`]
//! before the suspension and [`Shrink::grow`] after the restore and unlock. The endpoints, as the
//! engines define them:
//! - **vLLM** (`vllm/entrypoints/serve/sleep/api_router.py`, mounted only with
//!   `VLLM_SERVER_DEV_MODE=1`, sleep mode with `--enable-sleep-mode`): `POST /sleep?level=N`,
//!   `POST /wake_up` (optional `tags` query values `weights`, `kv_cache`), `GET /is_sleeping`
//!   (`{"is_sleeping": bool}`); after level 2 the weights are reloaded between the two wake-ups
//!   (`POST /wake_up?tags=weights`, `POST /collective_rpc` `{"method": "reload_weights"}`,
//!   `POST /wake_up?tags=kv_cache`), as vLLM's sleep-mode documentation does. vLLM has crashed
//!   when put to sleep with requests in flight, so cryo first waits until its `/metrics` say
//!   `vllm:num_requests_running` and `vllm:num_requests_waiting` are 0; metrics it cannot read
//!   mean no shrink. A `/sleep` answered is not always a sleep done (vLLM's own FIXME), so
//!   `/is_sleeping` must say so before the release counts.
//! - **SGLang** (`python/sglang/srt/entrypoints/http_server.py`, `--enable-memory-saver`):
//!   `POST /release_memory_occupation` and `POST /resume_memory_occupation`, body
//!   `{"tags": [...]}` among `kv_cache`, `weights`, `cuda_graph`. Where its `/metrics` answer
//!   (`--enable-metrics`), cryo waits for `sglang:num_running_reqs` to reach 0 first.
//! - **http**: `POST RELEASE_URL`, `POST RESUME_URL`; any 2xx is success.
//!
//! # The safe path
//! A shrink never blocks the suspension: one that fails or runs past its deadline leaves the
//! worker whole and the suspension copies all of its memory. Nothing is left half-shrunk on
//! purpose: once the release request was sent, a failure is followed at once by the resume
//! sequence (its own bound, [`UNDO_TIMEOUT`]); when even that fails the outcome says the engine's
//! state is unknown, and the caller grows it after the restore as for a shrunk one.
//!
//! # Network namespaces
//! [`Shrink::release_from`] and [`Shrink::grow_from`] reach the engine from the worker's network
//! namespace ([`NetNs`]: the caller hands it in, the lifecycle takes the worker's): an engine in a
//! container or a standby serves on a loopback of its own, which `--engine-url
//! http://127.0.0.1:PORT` names as the worker sees it. A unix socket is named by its path.

mod spec;

use std::time::{Duration, Instant};

use cryo_http::{Client, Endpoint, HttpError, Timeouts};

pub use cryo_http::NetNs;
use serde::{Deserialize, Serialize};

pub use spec::{ShrinkSpec, SpecError, SGLANG_DEFAULT_TAGS, SGLANG_TAGS};

/// How long a release may take unless told otherwise.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(10);

/// How long undoing a failed release may take.
pub const UNDO_TIMEOUT: Duration = Duration::from_secs(5);

/// How often `/metrics` and `/is_sleeping` are asked again while waiting.
const POLL: Duration = Duration::from_millis(25);

/// A shrink: what to ask, where, within how long.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Shrink {
    /// How to ask.
    pub spec: ShrinkSpec,
    /// The engine's HTTP address (`http://host:port` or `unix:SOCKET:/`), for vLLM and SGLang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// The release's deadline, ms (drain, request and confirmation).
    pub timeout_ms: u64,
}

/// A shrink that cannot be carried out as given.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ShrinkConfigError {
    /// vLLM and SGLang need the engine's address.
    #[error("--shrink {0} needs the engine's address (--engine-url http://127.0.0.1:PORT)")]
    NoEngine(ShrinkSpec),
    /// The engine's address is not a URL cryo can reach.
    #[error("--engine-url: {0}")]
    BadEngine(#[from] cryo_http::UrlError),
}

/// Why a release or a grow did not succeed.
#[derive(Debug, thiserror::Error)]
pub enum ShrinkError {
    /// The engine could not be reached or did not answer in time.
    #[error("{0}")]
    Http(#[from] HttpError),
    /// The engine answered with an error status.
    #[error("{what}: HTTP {status}: {body}")]
    Status {
        /// The request.
        what: String,
        /// Its status.
        status: u16,
        /// The start of the answer.
        body: String,
    },
    /// Requests were still running at the deadline (vLLM has crashed when put to sleep then).
    #[error("{running} requests still in flight after {ms} ms (the engine is not drained)")]
    NotDrained {
        /// Requests running or waiting at the last look.
        running: u64,
        /// How long cryo waited.
        ms: u64,
    },
    /// vLLM's metrics could not be read, so whether requests are in flight is unknown.
    #[error("cannot tell whether requests are in flight: {0}")]
    NoMetrics(String),
    /// The engine never confirmed the state asked for.
    #[error("the engine did not confirm it is {want} within {ms} ms")]
    Unconfirmed {
        /// `sleeping` or `awake`.
        want: &'static str,
        /// How long cryo waited.
        ms: u64,
    },
    /// The deadline passed before the step.
    #[error("the deadline passed before {0}")]
    Deadline(String),
    /// The engine's network namespace (the worker's) cannot be entered: nothing was sent.
    #[error("{0}")]
    Namespace(String),
}

/// How a release ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Outcome {
    /// The engine released its memory: grow it after the restore.
    Shrunk,
    /// It did not, and is whole (nothing was released, or the release was undone): nothing to
    /// grow.
    Whole {
        /// Why it did not shrink.
        error: String,
    },
    /// The release failed after it was sent and could not be undone: the engine may be
    /// half-shrunk; grow it after the restore.
    Unknown {
        /// Why it did not shrink.
        error: String,
        /// Why the undo failed.
        undo_error: String,
    },
}

impl Outcome {
    /// Whether the engine must be asked to grow after the restore.
    pub fn needs_grow(&self) -> bool {
        !matches!(self, Outcome::Whole { .. })
    }
}

/// A release's outcome and its time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Released {
    /// How it ended.
    #[serde(flatten)]
    pub outcome: Outcome,
    /// Wall time, undo included.
    pub ms: u64,
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// One request against a URL or the engine's address.
struct Engine {
    endpoint: Endpoint,
    base: String,
    from: Option<NetNs>,
}

impl Engine {
    fn at(url: &str) -> Result<Self, cryo_http::UrlError> {
        let (endpoint, path) = Endpoint::parse_url(url)?;
        Ok(Engine {
            endpoint,
            base: path.trim_end_matches('/').to_owned(),
            from: None,
        })
    }

    /// The same, reached from the network namespace `from` (`None`: cryo's own).
    fn from(mut self, from: Option<&NetNs>) -> Self {
        self.from = from.cloned();
        self
    }

    /// `METHOD base+path` with a JSON body, before `until`; a non-2xx status is an error.
    fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&serde_json::Value>,
        until: Instant,
    ) -> Result<String, ShrinkError> {
        let what = format!(
            "{method} {}",
            self.endpoint.url(&format!("{}{path}", self.base))
        );
        let left = until.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(ShrinkError::Deadline(what));
        }
        let client = Client::from_namespace(
            self.endpoint.clone(),
            Timeouts::total(left),
            self.from.clone(),
        );
        let bytes = body.map(|b| b.to_string().into_bytes());
        let full = format!("{}{path}", self.base);
        let r = client.send(
            method,
            &full,
            bytes.as_deref().map(|b| ("application/json", b)),
        )?;
        let status = r.status;
        let text = r.text().unwrap_or_default();
        if (200..300).contains(&status) {
            Ok(text)
        } else {
            Err(ShrinkError::Status {
                what,
                status,
                body: text.chars().take(200).collect(),
            })
        }
    }
}

/// The sum of every sample of these metrics in a Prometheus text exposition.
fn metric_sum(text: &str, names: &[&str]) -> Option<f64> {
    let mut found = false;
    let mut sum = 0.0;
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let name_end = line.find(['{', ' ']).unwrap_or(line.len());
        if !names.contains(&&line[..name_end]) {
            continue;
        }
        let value = line.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok());
        if let Some(v) = value {
            found = true;
            sum += v;
        }
    }
    found.then_some(sum)
}

impl Shrink {
    /// A shrink as given, checked (addresses parse; vLLM and SGLang have one).
    pub fn new(
        spec: ShrinkSpec,
        engine: Option<String>,
        timeout: Duration,
    ) -> Result<Self, ShrinkConfigError> {
        let s = Shrink {
            spec,
            engine,
            timeout_ms: ms(timeout),
        };
        s.check()?;
        Ok(s)
    }

    /// Whether it is carried out as given (the agent checks what a client sent).
    pub fn check(&self) -> Result<(), ShrinkConfigError> {
        match (&self.engine, self.spec.needs_engine()) {
            (None, true) => Err(ShrinkConfigError::NoEngine(self.spec.clone())),
            (Some(url), _) => Engine::at(url).map(drop).map_err(Into::into),
            (None, false) => Ok(()),
        }
    }

    /// Whether there is anything to do.
    pub fn is_none(&self) -> bool {
        self.spec == ShrinkSpec::None
    }

    /// The release's deadline.
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    fn engine(&self, from: Option<&NetNs>) -> Result<Engine, ShrinkError> {
        let url = self.engine.as_deref().unwrap_or("");
        Engine::at(url)
            .map(|e| e.from(from))
            .map_err(|e| ShrinkError::Deadline(e.to_string()))
    }

    /// Asks the engine to release its memory, within `timeout` (at most the shrink's own),
    /// undoing a failed release (see the crate docs). Never fails: the outcome says.
    pub fn release(&self, timeout: Duration) -> Released {
        self.release_from(timeout, None)
    }

    /// [`Shrink::release`], the engine reached from the network namespace `from`.
    pub fn release_from(&self, timeout: Duration, from: Option<&NetNs>) -> Released {
        let start = Instant::now();
        let until = start + timeout.min(self.timeout());
        let mut sent = false;
        let result = self.try_release(until, &mut sent, from);
        let outcome = match result {
            Ok(()) => Outcome::Shrunk,
            // Refused at connect: the request never reached the engine.
            Err(e) if !sent || matches!(&e, ShrinkError::Http(h) if h.nobody_listens()) => {
                Outcome::Whole {
                    error: e.to_string(),
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "shrink failed after the release was sent: undoing it");
                match self.grow_from(UNDO_TIMEOUT, from) {
                    Ok(_) => Outcome::Whole {
                        error: format!("{e} (undone)"),
                    },
                    Err(undo) => Outcome::Unknown {
                        error: e.to_string(),
                        undo_error: undo.to_string(),
                    },
                }
            }
        };
        Released {
            outcome,
            ms: ms(start.elapsed()),
        }
    }

    fn try_release(
        &self,
        until: Instant,
        sent: &mut bool,
        from: Option<&NetNs>,
    ) -> Result<(), ShrinkError> {
        match &self.spec {
            ShrinkSpec::None => Ok(()),
            ShrinkSpec::Vllm { level } => {
                let e = self.engine(from)?;
                drain(
                    &e,
                    &["vllm:num_requests_running", "vllm:num_requests_waiting"],
                    true,
                    until,
                )?;
                *sent = true;
                e.call("POST", &format!("/sleep?level={level}"), None, until)?;
                confirm(&e, true, until)
            }
            ShrinkSpec::Sglang { tags } => {
                let e = self.engine(from)?;
                drain(
                    &e,
                    &["sglang:num_running_reqs", "sglang:num_queue_reqs"],
                    false,
                    until,
                )?;
                *sent = true;
                let body = serde_json::json!({ "tags": tags });
                e.call("POST", "/release_memory_occupation", Some(&body), until)
                    .map(drop)
            }
            ShrinkSpec::Http { release, .. } => {
                let e = Engine::at(release)
                    .map_err(|e| ShrinkError::Deadline(e.to_string()))?
                    .from(from);
                *sent = true;
                e.call("POST", "", None, until).map(drop)
            }
        }
    }

    /// Asks the engine to take back what it released, within `timeout`; returns the time it
    /// took, ms.
    pub fn grow(&self, timeout: Duration) -> Result<u64, ShrinkError> {
        self.grow_from(timeout, None)
    }

    /// [`Shrink::grow`], the engine reached from the network namespace `from`.
    pub fn grow_from(&self, timeout: Duration, from: Option<&NetNs>) -> Result<u64, ShrinkError> {
        let start = Instant::now();
        let until = start + timeout;
        match &self.spec {
            ShrinkSpec::None => {}
            ShrinkSpec::Vllm { level: 1 } => {
                let e = self.engine(from)?;
                e.call("POST", "/wake_up", None, until)?;
                confirm(&e, false, until)?;
            }
            ShrinkSpec::Vllm { .. } => {
                let e = self.engine(from)?;
                e.call("POST", "/wake_up?tags=weights", None, until)?;
                let rpc = serde_json::json!({ "method": "reload_weights" });
                e.call("POST", "/collective_rpc", Some(&rpc), until)?;
                e.call("POST", "/wake_up?tags=kv_cache", None, until)?;
                confirm(&e, false, until)?;
            }
            ShrinkSpec::Sglang { tags } => {
                let body = serde_json::json!({ "tags": tags });
                self.engine(from)?
                    .call("POST", "/resume_memory_occupation", Some(&body), until)?;
            }
            ShrinkSpec::Http { resume, .. } => {
                Engine::at(resume)
                    .map_err(|e| ShrinkError::Deadline(e.to_string()))?
                    .from(from)
                    .call("POST", "", None, until)?;
            }
        }
        Ok(ms(start.elapsed()))
    }
}

/// Waits until the engine's metrics show no request running or waiting. Metrics that cannot be
/// read are an error when `required`, otherwise no reason to wait.
fn drain(e: &Engine, names: &[&str], required: bool, until: Instant) -> Result<(), ShrinkError> {
    let start = Instant::now();
    let mut last = None;
    loop {
        let running = match e.call("GET", "/metrics", None, until) {
            Ok(text) => match metric_sum(&text, names) {
                Some(n) => n,
                None if required => {
                    return Err(ShrinkError::NoMetrics(format!(
                        "/metrics has no {}",
                        names.join(" nor ")
                    )))
                }
                None => return Ok(()),
            },
            // Out of time while asking again: still busy as far as cryo knows.
            Err(_) if last.is_some() && Instant::now() + POLL >= until => f64::MAX,
            Err(err) if required => return Err(ShrinkError::NoMetrics(err.to_string())),
            Err(_) => return Ok(()),
        };
        if running <= 0.0 {
            return Ok(());
        }
        if running < f64::MAX {
            last = Some(running);
        }
        if Instant::now() + POLL >= until {
            return Err(ShrinkError::NotDrained {
                running: last.unwrap_or(0.0) as u64,
                ms: ms(start.elapsed()),
            });
        }
        std::thread::sleep(POLL);
    }
}

/// Waits until vLLM's `/is_sleeping` says `sleeping`.
fn confirm(e: &Engine, sleeping: bool, until: Instant) -> Result<(), ShrinkError> {
    let start = Instant::now();
    loop {
        let text = e.call("GET", "/is_sleeping", None, until)?;
        let now: Option<bool> = serde_json::from_str::<serde_json::Value>(&text)
            .ok()
            .and_then(|v| v["is_sleeping"].as_bool());
        if now == Some(sleeping) {
            return Ok(());
        }
        if Instant::now() + POLL >= until {
            return Err(ShrinkError::Unconfirmed {
                want: if sleeping { "sleeping" } else { "awake" },
                ms: ms(start.elapsed()),
            });
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests;
