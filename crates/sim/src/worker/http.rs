//! The worker's HTTP endpoints (tiny_http: plain threads, no runtime, nothing CRIU-hostile), over
//! a [`Backend`]: the process's own contexts ([`Worker`]) or the ranks of a tree
//! ([`super::tree::Tree`]).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use tiny_http::{Header, Method, Request, Response, Server};

use super::engine::{EngineOp, EngineStatus, WeightsRelease};
use super::state::{CallError, Worker};
use crate::memory;

/// Threads answering requests (a lock test needs calls blocked at the gate while others answer).
const HANDLERS: usize = 4;

/// Words a completion samples per rank.
const SAMPLES: u64 = 8;

/// The content check of device memory, over every rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Verified {
    /// `(actual, expected)` content hash per context, in rank order.
    pub hashes: Vec<(u64, u64)>,
    /// Device memory checked, bytes.
    pub bytes: u64,
}

impl Verified {
    fn ok(&self) -> bool {
        self.hashes.iter().all(|(a, e)| a == e)
    }

    fn json(&self) -> serde_json::Value {
        let hex = |f: fn(&(u64, u64)) -> u64| {
            self.hashes
                .iter()
                .map(|h| format!("{:016x}", f(h)))
                .collect::<Vec<_>>()
                .join(",")
        };
        serde_json::json!({
            "ok": self.ok(),
            "hash": hex(|h| h.0),
            "expected": hex(|h| h.1),
            "bytes": self.bytes,
            "ranks": self.hashes.len(),
        })
    }
}

/// What the endpoints act on.
pub(crate) trait Backend: Send + Sync + 'static {
    /// The completion of `prompt`: depends on device memory at prompt-derived offsets, so lost or
    /// corrupted memory changes it.
    fn complete(&self, prompt: &[u8]) -> Result<String, CallError>;
    /// Hashes all of device memory against the seeds.
    fn verify(&self) -> Result<Verified, CallError>;
    /// Queues `ms` of GPU work (on every rank).
    fn enqueue(&self, ms: u64) -> Result<(), CallError>;
    /// A kernel of rank `rank` faults (sticky `CUDA_ERROR_ILLEGAL_ADDRESS`).
    fn fault(&self, rank: usize) -> Result<(), CallError>;
    /// Extra fields of `GET /health`.
    fn health(&self) -> serde_json::Value;
    /// Releases or takes back engine memory (on every rank).
    fn engine(&self, op: &EngineOp) -> Result<(), CallError>;
    /// Whether the engine sleeps, how many requests run (over every rank).
    fn engine_status(&self) -> Result<EngineStatus, CallError>;
}

impl Backend for Worker {
    fn complete(&self, prompt: &[u8]) -> Result<String, CallError> {
        self.check_awake()?;
        let h = prompt_hash(prompt);
        let mut acc = h;
        let mut text = String::new();
        if self.ranks() == 0 {
            // No device memory: a launcher answers from the prompt alone.
            text.push_str(&format!("{:016x}", memory::word(acc, 0)));
        }
        for rank in 0..self.ranks() {
            let nwords = (self.bytes_of(rank) / 8).max(1);
            let base = h.wrapping_add(rank as u64);
            let offsets: Vec<u64> = (0..SAMPLES)
                .map(|j| memory::word(base, j) % nwords)
                .collect();
            for (j, word) in self.read_words(rank, offsets)?.iter().enumerate() {
                acc = memory::word(acc ^ word, j as u64);
                text.push_str(&format!("{acc:016x}"));
            }
        }
        Ok(text)
    }

    fn verify(&self) -> Result<Verified, CallError> {
        self.check_awake()?;
        let hashes = Worker::verify(self)?;
        Ok(Verified {
            bytes: (0..hashes.len()).map(|r| self.bytes_of(r)).sum(),
            hashes,
        })
    }

    fn enqueue(&self, ms: u64) -> Result<(), CallError> {
        Worker::enqueue(self, ms)
    }

    fn fault(&self, _rank: usize) -> Result<(), CallError> {
        // A sticky error poisons the process: lock fails for all of it.
        Worker::fault(self)
    }

    fn health(&self) -> serde_json::Value {
        let (queued, waiting) = self.load();
        serde_json::json!({
            "queued_ms": u64::try_from(queued.as_millis()).unwrap_or(u64::MAX),
            "gpu_calls_waiting": waiting,
            "ranks": self.ranks(),
        })
    }

    fn engine(&self, op: &EngineOp) -> Result<(), CallError> {
        Worker::engine(self, op)
    }

    fn engine_status(&self) -> Result<EngineStatus, CallError> {
        Ok(Worker::engine_status(self))
    }
}

/// FNV-1a of the prompt.
fn prompt_hash(prompt: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prompt {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// An exec the main thread carries out (`POST /exec?thread=leader`), and where its error goes.
type ExecOnMain = (
    std::process::Command,
    std::sync::mpsc::Sender<std::io::Error>,
);

static MAIN_EXEC: std::sync::OnceLock<std::sync::Mutex<std::sync::mpsc::Sender<ExecOnMain>>> =
    std::sync::OnceLock::new();

/// `execve` from the calling thread; returns only if it failed.
fn exec_here(mut cmd: std::process::Command) -> std::io::Error {
    use std::os::unix::process::CommandExt;
    cmd.exec()
}

/// `execve` from the main thread (the thread-group leader); returns only if it failed.
fn exec_on_main(cmd: std::process::Command) -> std::io::Error {
    let (tx, rx) = std::sync::mpsc::channel();
    let sent = MAIN_EXEC
        .get()
        .and_then(|m| m.lock().ok().map(|s| s.send((cmd, tx)).is_ok()));
    if sent != Some(true) {
        return std::io::Error::other("the main thread does not take exec requests");
    }
    rx.recv()
        .unwrap_or_else(|_| std::io::Error::other("the main thread did not answer"))
}

/// Serves until the process ends; the main thread (the caller) carries out exec requests.
pub(super) fn serve(backend: Arc<dyn Backend>, server: Arc<Server>) {
    let (tx, rx) = std::sync::mpsc::channel::<ExecOnMain>();
    let _ = MAIN_EXEC.set(std::sync::Mutex::new(tx));
    for _ in 0..HANDLERS {
        let (b, s) = (backend.clone(), server.clone());
        std::thread::spawn(move || loop {
            match s.recv() {
                Ok(req) => handle(b.as_ref(), req),
                Err(err) => tracing::warn!(%err, "http: receive failed"),
            }
        });
    }
    for (cmd, reply) in rx {
        let _ = reply.send(exec_here(cmd));
    }
}

fn json(status: u16, body: serde_json::Value) -> Response<std::io::Cursor<Vec<u8>>> {
    let mut r = Response::from_string(body.to_string()).with_status_code(status);
    if let Ok(h) = Header::from_bytes("Content-Type", "application/json") {
        r.add_header(h);
    }
    if let Ok(h) = Header::from_bytes("Connection", "close") {
        r.add_header(h);
    }
    r
}

fn call_error(e: CallError) -> Response<std::io::Cursor<Vec<u8>>> {
    match e {
        CallError::Sticky(code) => json(
            500,
            serde_json::json!({ "error": code.to_string(), "code": code.0 }),
        ),
        CallError::NoContext => json(500, serde_json::json!({ "error": "no GPU context" })),
        CallError::Io(err) => json(
            500,
            serde_json::json!({ "error": format!("GPU driver: {err}") }),
        ),
        CallError::Rank(err) => json(502, serde_json::json!({ "error": err })),
        CallError::Sleeping => json(
            503,
            serde_json::json!({ "error": "the engine is sleeping" }),
        ),
        CallError::Engine(err) => json(400, serde_json::json!({ "error": err })),
    }
}

/// Every value of `key` in the query.
fn query_all<'a>(url: &'a str, key: &str) -> Vec<&'a str> {
    url.split_once('?').map_or_else(Vec::new, |(_, q)| {
        q.split('&')
            .filter_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
            .collect()
    })
}

/// The `tags` of an SGLang memory request body (`{"tags": [...]}`; absent or null: all).
fn sglang_tags(body: &[u8]) -> Result<Vec<String>, String> {
    #[derive(Deserialize)]
    struct Tags {
        #[serde(default)]
        tags: Option<Vec<String>>,
    }
    let all = || {
        vec![
            "kv_cache".to_owned(),
            "weights".to_owned(),
            "cuda_graph".to_owned(),
        ]
    };
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(all());
    }
    let t: Tags = serde_json::from_slice(body).map_err(|e| format!("bad body: {e}"))?;
    let tags = t.tags.unwrap_or_else(all);
    match tags
        .iter()
        .find(|t| !["kv_cache", "weights", "cuda_graph"].contains(&t.as_str()))
    {
        Some(bad) => Err(format!("unknown tag {bad:?}")),
        None => Ok(tags),
    }
}

fn done(r: Result<(), CallError>) -> Response<std::io::Cursor<Vec<u8>>> {
    match r {
        Ok(()) => json(200, serde_json::json!({})),
        Err(e) => call_error(e),
    }
}

/// The engine endpoints (vLLM's sleep mode, SGLang's memory saver, `/metrics`); `None`: not one.
fn engine_endpoint(
    w: &dyn Backend,
    method: &Method,
    path: &str,
    url: &str,
    body: &[u8],
) -> Option<Response<std::io::Cursor<Vec<u8>>>> {
    let has = |tags: &[String], t: &str| tags.iter().any(|x| x == t);
    Some(match (method, path) {
        (Method::Post, "/sleep") => {
            let weights = match query(url, "level").unwrap_or("1") {
                "1" => WeightsRelease::Offload,
                "2" => WeightsRelease::Discard,
                other => {
                    return Some(json(
                        400,
                        serde_json::json!({ "error": format!("no sleep level {other}") }),
                    ))
                }
            };
            match w.engine_status() {
                Ok(st) if st.running > 0 => {
                    // vLLM has crashed when put to sleep with requests in flight: the simulator
                    // is no kinder.
                    tracing::error!(
                        running = st.running,
                        "put to sleep with requests in flight: crashing"
                    );
                    std::process::exit(1);
                }
                Ok(_) => done(w.engine(&EngineOp::Release {
                    weights: Some(weights),
                })),
                Err(e) => call_error(e),
            }
        }
        (Method::Post, "/wake_up") => {
            let tags = query_all(url, "tags");
            if let Some(bad) = tags.iter().find(|t| !["weights", "kv_cache"].contains(t)) {
                return Some(json(
                    400,
                    serde_json::json!({ "error": format!("unknown tag {bad:?}") }),
                ));
            }
            let all = tags.is_empty();
            done(w.engine(&EngineOp::Resume {
                weights: all || tags.contains(&"weights"),
                kv: all || tags.contains(&"kv_cache"),
            }))
        }
        (Method::Get, "/is_sleeping") => match w.engine_status() {
            Ok(st) => json(200, serde_json::json!({ "is_sleeping": st.sleeping })),
            Err(e) => call_error(e),
        },
        (Method::Post, "/collective_rpc") => {
            #[derive(Deserialize)]
            struct Rpc {
                method: String,
            }
            match serde_json::from_slice::<Rpc>(body) {
                Ok(r) if r.method == "reload_weights" => match w.engine(&EngineOp::ReloadWeights) {
                    Ok(()) => json(200, serde_json::json!({ "results": [null] })),
                    Err(e) => call_error(e),
                },
                Ok(r) => json(
                    400,
                    serde_json::json!({ "error": format!("method {:?} is not simulated", r.method) }),
                ),
                Err(e) => json(
                    400,
                    serde_json::json!({ "error": format!("bad body: {e}") }),
                ),
            }
        }
        (Method::Post | Method::Get, "/release_memory_occupation") => match sglang_tags(body) {
            Err(e) => json(400, serde_json::json!({ "error": e })),
            Ok(tags) if has(&tags, "weights") && !has(&tags, "kv_cache") => json(
                400,
                serde_json::json!({ "error": "the simulator releases the weights only with the KV cache" }),
            ),
            Ok(tags) => match w.engine_status() {
                Ok(st) if st.running > 0 => json(
                    400,
                    serde_json::json!({ "error": format!("{} requests in flight", st.running) }),
                ),
                Ok(_) if !has(&tags, "kv_cache") => json(200, serde_json::json!({})),
                Ok(_) => done(w.engine(&EngineOp::Release {
                    weights: has(&tags, "weights").then_some(WeightsRelease::Offload),
                })),
                Err(e) => call_error(e),
            },
        },
        (Method::Post | Method::Get, "/resume_memory_occupation") => match sglang_tags(body) {
            Err(e) => json(400, serde_json::json!({ "error": e })),
            Ok(tags) => done(w.engine(&EngineOp::Resume {
                weights: has(&tags, "weights"),
                kv: has(&tags, "kv_cache"),
            })),
        },
        (Method::Get, "/metrics") => match w.engine_status() {
            Ok(st) => {
                let mut text = String::new();
                for (name, v) in [
                    ("vllm:num_requests_running", st.running),
                    ("vllm:num_requests_waiting", 0),
                    ("sglang:num_running_reqs", st.running),
                    ("sglang:num_queue_reqs", 0),
                ] {
                    text.push_str(&format!(
                        "# TYPE {name} gauge\n{name}{{model_name=\"sim\"}} {v}.0\n"
                    ));
                }
                let mut r = Response::from_string(text);
                if let Ok(h) = Header::from_bytes("Content-Type", "text/plain; version=0.0.4") {
                    r.add_header(h);
                }
                r
            }
            Err(e) => call_error(e),
        },
        _ => return None,
    })
}

fn query<'a>(url: &'a str, key: &str) -> Option<&'a str> {
    url.split_once('?')?
        .1
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn handle(w: &dyn Backend, mut req: Request) {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let mut exit_after = false;
    let mut body = Vec::new();
    if matches!(
        path.as_str(),
        "/collective_rpc" | "/release_memory_occupation" | "/resume_memory_occupation"
    ) {
        if let Err(err) = req.as_reader().read_to_end(&mut body) {
            tracing::debug!(%err, "http: cannot read the body");
        }
    }
    if let Some(resp) = engine_endpoint(w, req.method(), &path, req.url(), &body) {
        if let Err(err) = req.respond(resp) {
            tracing::debug!(%err, "http: client went away");
        }
        return;
    }
    let resp = match (req.method(), path.as_str()) {
        (Method::Get, "/health") => {
            let mut body = serde_json::json!({ "ok": true, "pid": std::process::id() });
            if let (Some(b), serde_json::Value::Object(extra)) = (body.as_object_mut(), w.health())
            {
                b.extend(extra);
            }
            json(200, body)
        }
        (Method::Post, "/v1/completions") => {
            let mut prompt = Vec::new();
            match req.as_reader().read_to_end(&mut prompt) {
                Err(err) => json(
                    400,
                    serde_json::json!({ "error": format!("cannot read the prompt: {err}") }),
                ),
                Ok(_) => match w.complete(&prompt) {
                    Ok(text) => json(200, serde_json::json!({ "text": text })),
                    Err(e) => call_error(e),
                },
            }
        }
        (Method::Get, "/verify") => match w.verify() {
            Ok(v) => json(200, v.json()),
            Err(e) => call_error(e),
        },
        (Method::Post, "/busy") => match query(req.url(), "ms").map(str::parse::<u64>) {
            Some(Ok(ms)) => match w.enqueue(ms) {
                Ok(()) => json(200, serde_json::json!({ "queued_ms": ms })),
                Err(e) => call_error(e),
            },
            _ => json(400, serde_json::json!({ "error": "expected ?ms=N" })),
        },
        (Method::Post, "/fault") => {
            match query(req.url(), "rank").map_or(Ok(0), str::parse::<usize>) {
                Err(_) => json(400, serde_json::json!({ "error": "expected ?rank=N" })),
                Ok(rank) => match w.fault(rank) {
                    Ok(()) => {
                        exit_after = query(req.url(), "exit") == Some("1");
                        json(
                            200,
                            serde_json::json!({ "fault": "CUDA_ERROR_ILLEGAL_ADDRESS", "rank": rank, "exiting": exit_after }),
                        )
                    }
                    Err(e) => call_error(e),
                },
            }
        }
        // For the guard's tests: an ordinary exit of a healthy server (`exit(CODE)`, i.e.
        // `exit_group`) with its context live, answered first.
        (Method::Post, "/exit") => {
            match query(req.url(), "code").map_or(Ok(0), str::parse::<i32>) {
                Ok(code) => {
                    let _ = req.respond(json(200, serde_json::json!({ "exiting": code })));
                    tracing::info!(code, "exiting on request");
                    std::process::exit(code);
                }
                Err(_) => json(400, serde_json::json!({ "error": "expected ?code=N" })),
            }
        }
        // For the guard's tests: replace the program (`execve`) with its context live, as a
        // launcher that execs its server does: `?path=P[&arg=A]`, from the leader
        // (`&thread=leader`, handed to the main thread) or from this handler thread
        // (`&thread=other`, the kernel then kills the leader first). The driver fds are
        // close-on-exec, as libcuda opens them: the exec closes them. Only a failed exec
        // answers (`500` with the error); a successful one closes this connection.
        (Method::Post, "/exec") => match query(req.url(), "path") {
            None => json(400, serde_json::json!({ "error": "expected ?path=P" })),
            Some(path) => {
                let mut cmd = std::process::Command::new(path);
                if let Some(arg) = query(req.url(), "arg") {
                    cmd.arg(arg);
                }
                tracing::info!(path, "exec on request");
                let err = match query(req.url(), "thread") {
                    Some("other") => exec_here(cmd),
                    _ => exec_on_main(cmd),
                };
                json(500, serde_json::json!({ "error": err.to_string() }))
            }
        },
        // For the guard's tests: a real segmentation fault, answered first so the client
        // sees it was accepted.
        (Method::Post, "/segv") => {
            let _ = req.respond(json(200, serde_json::json!({ "segv": true })));
            tracing::error!("segfaulting on request");
            crate::sys::segfault();
        }
        // For the guard's tests: grow host memory by N MiB (touched), as a leaking server does.
        (Method::Post, "/alloc") => match query(req.url(), "mib").map(str::parse::<usize>) {
            Some(Ok(mib)) => {
                let mut v = vec![0u8; mib << 20];
                for i in (0..v.len()).step_by(4096) {
                    v[i] = 1;
                }
                std::mem::forget(v);
                json(200, serde_json::json!({ "allocated_mib": mib }))
            }
            _ => json(400, serde_json::json!({ "error": "expected ?mib=N" })),
        },
        _ => json(
            404,
            serde_json::json!({ "error": format!("no endpoint {} {}", req.method(), path) }),
        ),
    };
    if let Err(err) = req.respond(resp) {
        tracing::debug!(%err, "http: client went away");
    }
    if exit_after {
        tracing::error!("fatal CUDA error (CUDA_ERROR_ILLEGAL_ADDRESS): exiting");
        std::process::exit(1);
    }
}
