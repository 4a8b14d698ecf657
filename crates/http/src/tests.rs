#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use super::*;

/// A server answering every request with its method, path and body (and `/missing` with 404,
/// `/lines` with three lines in chunks); dropped with the returned guard.
struct Server {
    server: Arc<tiny_http::Server>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    fn start(server: tiny_http::Server) -> Server {
        let server = Arc::new(server);
        let s = Arc::clone(&server);
        let thread = std::thread::spawn(move || {
            for mut rq in s.incoming_requests() {
                let mut body = String::new();
                rq.as_reader().read_to_string(&mut body).unwrap();
                let answer = match rq.url() {
                    "/missing" => tiny_http::Response::from_string("no such thing")
                        .with_status_code(404)
                        .boxed(),
                    "/lines" => tiny_http::Response::new(
                        200.into(),
                        Vec::new(),
                        std::io::Cursor::new(b"one\ntwo\nthree\n".to_vec()),
                        None,
                        None,
                    )
                    .boxed(),
                    url => {
                        tiny_http::Response::from_string(format!("{} {url} {body}", rq.method()))
                            .boxed()
                    }
                };
                rq.respond(answer).unwrap();
            }
        });
        Server {
            server,
            thread: Some(thread),
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.server.unblock();
        self.thread.take().unwrap().join().unwrap();
    }
}

#[test]
fn urls_are_parsed() {
    let ok = |u: &str| Endpoint::parse_url(u).unwrap();
    assert_eq!(
        ok("http://127.0.0.1:8080/health"),
        (Endpoint::Tcp("127.0.0.1:8080".into()), "/health".into())
    );
    assert_eq!(
        ok("http://localhost"),
        (Endpoint::Tcp("localhost:80".into()), "/".into())
    );
    assert_eq!(
        ok("http://[::1]/x"),
        (Endpoint::Tcp("[::1]:80".into()), "/x".into())
    );
    assert_eq!(
        ok("unix:/run/w.sock:/health"),
        (Endpoint::Unix("/run/w.sock".into()), "/health".into())
    );
    for bad in [
        "https://x/",
        "127.0.0.1:80",
        "http:///x",
        "http://user@host/",
        "unix:/run/w.sock",
        "unix::/h",
    ] {
        assert!(Endpoint::parse_url(bad).is_err(), "{bad}");
    }
    let e = Endpoint::Unix("/s".into());
    assert_eq!(Endpoint::parse_url(&e.url("/a")).unwrap(), (e, "/a".into()));
}

#[test]
fn unix_socket_requests_and_statuses() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s.sock");
    let _server = Server::start(tiny_http::Server::http_unix(&sock).unwrap());
    let client = Client::new(
        Endpoint::Unix(sock),
        Timeouts::total(Duration::from_secs(10)),
    );
    let r = client.post_json("/v1/x", br#"{"a":1}"#).unwrap();
    assert_eq!(r.status, 200);
    assert_eq!(r.text().unwrap(), r#"POST /v1/x {"a":1}"#);
    // The connection is reused for the next request.
    let r = client.get("/missing").unwrap();
    assert!(!r.is_success());
    assert_eq!((r.status, r.text().unwrap()), (404, "no such thing".into()));
    let lines: Vec<String> = client
        .get("/lines")
        .unwrap()
        .lines()
        .map(Result::unwrap)
        .collect();
    assert_eq!(lines, ["one", "two", "three"]);
}

#[test]
fn tcp_requests_through_fetch() {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let port = server.server_addr().to_ip().unwrap().port();
    let _server = Server::start(server);
    let (status, body) = fetch(
        "GET",
        &format!("http://127.0.0.1:{port}/health"),
        None,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!((status, body.as_str()), (200, "GET /health "));
}

#[test]
fn nobody_listening_is_told_apart_from_a_refusal() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("none.sock");
    let client = Client::new(Endpoint::Unix(sock.clone()), Timeouts::unlimited());
    let e = client.get("/").unwrap_err();
    assert!(e.nobody_listens(), "{e}");
    // A socket file nobody accepts on (its server died).
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    let e = client.get("/").unwrap_err();
    assert!(e.nobody_listens(), "{e}");
    // A TCP port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let e = Client::new(Endpoint::loopback(port), Timeouts::unlimited())
        .get("/")
        .unwrap_err();
    assert!(e.nobody_listens(), "{e}");
}

#[test]
fn a_silent_server_times_out() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("silent.sock");
    let _listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let e = Client::new(
        Endpoint::Unix(sock),
        Timeouts::total(Duration::from_millis(200)),
    )
    .get("/")
    .unwrap_err();
    assert!(
        matches!(&e, HttpError::Exchange { source, .. } if matches!(**source, ureq::Error::Timeout(_))),
        "{e:?}"
    );
}

/// From a network namespace (here cryo's own, entered through this process's pidfd on the
/// connecting thread: what a worker's namespace takes, without the test needing one): the
/// exchange, keep-alive reuse and a refused port go through the namespace transport. Needs
/// CAP_SYS_ADMIN for `setns(2)`, as cryo does (the suite runs as root).
#[test]
fn tcp_requests_from_a_network_namespace() {
    let server = tiny_http::Server::http("127.0.0.1:0").unwrap();
    let port = server.server_addr().to_ip().unwrap().port();
    let _s = Server::start(server);
    let pid = rustix::process::getpid();
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty()).unwrap();
    let ns = NetNs::new(pidfd);
    let c = Client::from_namespace(
        Endpoint::loopback(port),
        Timeouts::total(Duration::from_secs(10)),
        Some(ns.clone()),
    );
    for body in ["one", "two"] {
        let r = c.post_json("/x", body.as_bytes()).unwrap();
        assert_eq!(r.status, 200);
        assert_eq!(r.text().unwrap(), format!("POST /x {body}"));
    }
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let closed = free.local_addr().unwrap().port();
    drop(free);
    let e = Client::from_namespace(
        Endpoint::loopback(closed),
        Timeouts::total(Duration::from_secs(5)),
        Some(ns),
    )
    .get("/")
    .unwrap_err();
    assert!(e.nobody_listens(), "{e}");
}
