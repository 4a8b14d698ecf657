#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, Mutex};

use super::*;

/// What a fake engine answers: `(status, body)` for `(method, url)`; `None`: never answers.
type Answer = dyn Fn(&str, &str) -> Option<(u16, String)> + Send + Sync;

/// An engine on loopback that records every request and answers through `answer`.
struct Fake {
    url: String,
    seen: Arc<Mutex<Vec<String>>>,
}

impl Fake {
    fn start(answer: impl Fn(&str, &str) -> Option<(u16, String)> + Send + Sync + 'static) -> Fake {
        let server = Arc::new(tiny_http::Server::http("127.0.0.1:0").unwrap());
        let port = server.server_addr().to_ip().unwrap().port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let answer: Arc<Answer> = Arc::new(answer);
        for _ in 0..4 {
            let (server, seen, answer) = (server.clone(), seen.clone(), answer.clone());
            std::thread::spawn(move || {
                while let Ok(mut req) = server.recv() {
                    let mut body = String::new();
                    let _ = std::io::Read::read_to_string(req.as_reader(), &mut body);
                    let line = format!("{} {} {body}", req.method(), req.url());
                    seen.lock().unwrap().push(line.trim_end().to_owned());
                    match answer(req.method().as_str(), req.url()) {
                        Some((status, text)) => {
                            let _ = req.respond(
                                tiny_http::Response::from_string(text).with_status_code(status),
                            );
                        }
                        // Hold the request (and its connection) until the test ends.
                        None => std::mem::forget(req),
                    }
                }
            });
        }
        Fake {
            url: format!("http://127.0.0.1:{port}"),
            seen,
        }
    }

    fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }

    fn shrink(&self, spec: &str, timeout: Duration) -> Shrink {
        Shrink::new(spec.parse().unwrap(), Some(self.url.clone()), timeout).unwrap()
    }
}

/// A vLLM whose `/metrics` report `running` requests and whose sleep state follows its calls.
fn vllm(running: u64, sleep: Option<(u16, &'static str)>) -> Fake {
    let asleep = Arc::new(Mutex::new(false));
    Fake::start(move |method, url| {
        let path = url.split('?').next().unwrap_or("");
        match (method, path) {
            ("GET", "/metrics") => Some((
                200,
                format!(
                    "# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{{model_name=\"m\",engine=\"0\"}} {running}.0\nvllm:num_requests_waiting{{model_name=\"m\"}} 0.0\n"
                ),
            )),
            ("POST", "/sleep") => {
                let answer = sleep.map(|(s, b)| (s, b.to_owned()));
                if answer.as_ref().is_some_and(|(s, _)| *s == 200) {
                    *asleep.lock().unwrap() = true;
                }
                answer
            }
            ("POST", "/wake_up") => {
                *asleep.lock().unwrap() = false;
                Some((200, String::new()))
            }
            ("POST", "/collective_rpc") => Some((200, "{\"results\":[null]}".into())),
            ("GET", "/is_sleeping") => Some((
                200,
                format!("{{\"is_sleeping\":{}}}", *asleep.lock().unwrap()),
            )),
            _ => Some((404, "no".into())),
        }
    })
}

#[test]
fn a_drained_vllm_sleeps_and_wakes_with_the_documented_calls() {
    let e = vllm(0, Some((200, "")));
    let s = e.shrink("vllm:2", Duration::from_secs(5));
    assert_eq!(s.release(Duration::from_secs(5)).outcome, Outcome::Shrunk);
    s.grow(Duration::from_secs(5)).unwrap();
    let calls: Vec<String> = e
        .seen()
        .into_iter()
        .filter(|c| !c.starts_with("GET"))
        .collect();
    assert_eq!(
        calls,
        [
            "POST /sleep?level=2",
            "POST /wake_up?tags=weights",
            "POST /collective_rpc {\"method\":\"reload_weights\"}",
            "POST /wake_up?tags=kv_cache",
        ]
    );
}

/// vLLM has crashed when put to sleep with requests in flight: a busy engine is never sent a
/// sleep, and the worker is suspended whole.
#[test]
fn a_busy_vllm_is_never_put_to_sleep() {
    let e = vllm(2, Some((200, "")));
    let r = e
        .shrink("vllm", Duration::from_millis(300))
        .release(Duration::from_secs(10));
    match &r.outcome {
        Outcome::Whole { error } => {
            assert!(error.contains("2 requests still in flight"), "{error}")
        }
        other => panic!("{other:?}"),
    }
    assert!(!r.outcome.needs_grow());
    assert!(
        e.seen().iter().all(|c| !c.contains("/sleep")),
        "{:?}",
        e.seen()
    );
}

#[test]
fn a_vllm_without_metrics_is_not_shrunk() {
    let e = Fake::start(|_, _| Some((404, "not found".into())));
    let r = e
        .shrink("vllm:1", Duration::from_secs(2))
        .release(Duration::from_secs(2));
    assert!(
        matches!(&r.outcome, Outcome::Whole { error } if error.contains("cannot tell")),
        "{r:?}"
    );
    assert!(e.seen().iter().all(|c| !c.contains("/sleep")));
}

/// A sleep that never answers runs into the deadline and is undone: the engine is whole.
#[test]
fn a_sleep_past_its_deadline_is_undone() {
    let e = vllm(0, None);
    let start = Instant::now();
    let r = e
        .shrink("vllm:1", Duration::from_millis(400))
        .release(Duration::from_secs(30));
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "bounded by the shrink's deadline"
    );
    match &r.outcome {
        Outcome::Whole { error } => assert!(error.contains("(undone)"), "{error}"),
        other => panic!("{other:?}"),
    }
    assert!(e.seen().iter().any(|c| c.starts_with("POST /wake_up")));
}

/// A release that failed and whose undo failed too leaves the engine's state unknown: the caller
/// must grow it after the restore.
#[test]
fn a_failed_release_that_cannot_be_undone_is_unknown() {
    let e = Fake::start(|_, url| {
        Some(if url.contains("release") {
            (500, "oom".into())
        } else {
            (503, "down".into())
        })
    });
    let spec = format!("http:{0}/release,{0}/resume", e.url);
    let s = Shrink::new(spec.parse().unwrap(), None, Duration::from_secs(2)).unwrap();
    let r = s.release(Duration::from_secs(2));
    match &r.outcome {
        Outcome::Unknown { error, undo_error } => {
            assert!(error.contains("HTTP 500"), "{error}");
            assert!(undo_error.contains("HTTP 503"), "{undo_error}");
        }
        other => panic!("{other:?}"),
    }
    assert!(r.outcome.needs_grow());
}

#[test]
fn nothing_listening_leaves_the_engine_whole() {
    let s = Shrink::new(
        "sglang".parse().unwrap(),
        Some("http://127.0.0.1:1".into()),
        Duration::from_secs(2),
    )
    .unwrap();
    // SGLang's metrics are optional: the release itself fails to connect.
    let r = s.release(Duration::from_secs(2));
    assert!(
        matches!(&r.outcome, Outcome::Whole { error } if error.contains("cannot connect")),
        "a request refused at connect never reached the engine: {r:?}"
    );
}

#[test]
fn vllm_and_sglang_need_the_engine_address() {
    for spec in ["vllm", "sglang"] {
        assert!(matches!(
            Shrink::new(spec.parse().unwrap(), None, DEFAULT_TIMEOUT),
            Err(ShrinkConfigError::NoEngine(_))
        ));
    }
    assert!(matches!(
        Shrink::new(
            "vllm".parse().unwrap(),
            Some("ftp://x".into()),
            DEFAULT_TIMEOUT
        ),
        Err(ShrinkConfigError::BadEngine(_))
    ));
    assert!(Shrink::new(ShrinkSpec::None, None, DEFAULT_TIMEOUT).is_ok());
}

#[test]
fn metrics_are_summed_over_their_labels() {
    let text = "# HELP x\nvllm:num_requests_running{engine=\"0\"} 2.0\nvllm:num_requests_running{engine=\"1\"} 1.0\nvllm:num_requests_running_total 7\nvllm:num_requests_waiting 0\n";
    assert_eq!(
        metric_sum(
            text,
            &["vllm:num_requests_running", "vllm:num_requests_waiting"]
        ),
        Some(3.0)
    );
    assert_eq!(metric_sum(text, &["sglang:num_running_reqs"]), None);
}
