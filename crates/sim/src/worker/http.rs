//! The worker's HTTP endpoints (tiny_http: plain threads, no runtime, nothing CRIU-hostile).

use std::sync::Arc;

use tiny_http::{Header, Method, Request, Response, Server};

use super::state::{CallError, Worker};
use crate::memory;

/// Threads answering requests (a lock test needs calls blocked at the gate while others answer).
const HANDLERS: usize = 4;

/// Words a completion samples.
const SAMPLES: u64 = 8;

/// Serves until the process ends.
pub(super) fn serve(worker: Arc<Worker>, server: Arc<Server>) {
    let mut handles = Vec::new();
    for _ in 0..HANDLERS {
        let (w, s) = (worker.clone(), server.clone());
        handles.push(std::thread::spawn(move || loop {
            match s.recv() {
                Ok(req) => handle(&w, req),
                Err(err) => tracing::warn!(%err, "http: receive failed"),
            }
        }));
    }
    for h in handles {
        let _ = h.join();
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
    }
}

fn query<'a>(url: &'a str, key: &str) -> Option<&'a str> {
    url.split_once('?')?
        .1
        .split('&')
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
}

fn handle(w: &Worker, mut req: Request) {
    let path = req.url().split('?').next().unwrap_or("").to_string();
    let mut exit_after = false;
    let resp = match (req.method(), path.as_str()) {
        (Method::Get, "/health") => {
            let (queued, waiting) = w.load();
            json(
                200,
                serde_json::json!({
                    "ok": true,
                    "pid": std::process::id(),
                    "queued_ms": u64::try_from(queued.as_millis()).unwrap_or(u64::MAX),
                    "gpu_calls_waiting": waiting,
                }),
            )
        }
        (Method::Post, "/v1/completions") => {
            let mut prompt = Vec::new();
            match req.as_reader().read_to_end(&mut prompt) {
                Err(err) => json(
                    400,
                    serde_json::json!({ "error": format!("cannot read the prompt: {err}") }),
                ),
                Ok(_) => match complete(w, &prompt) {
                    Ok(text) => json(200, serde_json::json!({ "text": text })),
                    Err(e) => call_error(e),
                },
            }
        }
        (Method::Get, "/verify") => match w.verify() {
            Ok((actual, expected)) => json(
                200,
                serde_json::json!({
                    "ok": actual == expected,
                    "hash": format!("{actual:016x}"),
                    "expected": format!("{expected:016x}"),
                    "bytes": w.bytes(),
                }),
            ),
            Err(e) => call_error(e),
        },
        (Method::Post, "/busy") => match query(req.url(), "ms").map(str::parse::<u64>) {
            Some(Ok(ms)) => match w.enqueue(ms) {
                Ok(()) => json(200, serde_json::json!({ "queued_ms": ms })),
                Err(e) => call_error(e),
            },
            _ => json(400, serde_json::json!({ "error": "expected ?ms=N" })),
        },
        (Method::Post, "/fault") => match w.fault() {
            Ok(()) => {
                exit_after = query(req.url(), "exit") == Some("1");
                json(
                    200,
                    serde_json::json!({ "fault": "CUDA_ERROR_ILLEGAL_ADDRESS", "exiting": exit_after }),
                )
            }
            Err(e) => call_error(e),
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

/// The answer depends on the prompt and on device memory at prompt-derived offsets, so lost or
/// corrupted memory changes it.
fn complete(w: &Worker, prompt: &[u8]) -> Result<String, CallError> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in prompt {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    let nwords = (w.bytes() / 8).max(1);
    let offsets: Vec<u64> = (0..SAMPLES).map(|j| memory::word(h, j) % nwords).collect();
    let words = w.read_words(offsets)?;
    let mut acc = h;
    let mut text = String::new();
    for (j, word) in words.iter().enumerate() {
        acc = memory::word(acc ^ word, j as u64);
        text.push_str(&format!("{acc:016x}"));
    }
    Ok(text)
}
