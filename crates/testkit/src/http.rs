//! One HTTP request to a worker, on loopback TCP or on a unix socket, through cryo's one HTTP
//! client (`cryo_http`; a worker frozen by CRIU serves on a unix socket, `--http-unix`).

use std::time::Duration;

pub use cryo_http::Endpoint;

/// A worker's port on loopback, or its endpoint.
#[derive(Debug, Clone)]
pub struct To(pub Endpoint);

impl From<u16> for To {
    fn from(port: u16) -> Self {
        To(Endpoint::loopback(port))
    }
}

impl From<Endpoint> for To {
    fn from(e: Endpoint) -> Self {
        To(e)
    }
}

impl From<&Endpoint> for To {
    fn from(e: &Endpoint) -> Self {
        To(e.clone())
    }
}

/// Sends one request and returns `(status, body)`. Panics when the worker cannot be reached
/// within a minute or answers something that is not HTTP: in a test, that is the failure.
pub fn http(to: impl Into<To>, method: &str, path: &str, body: &str) -> (u16, String) {
    let url = to.into().0.url(path);
    let body = (!body.is_empty()).then_some(("application/json", body.as_bytes()));
    cryo_http::fetch(method, &url, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}

/// One request to `127.0.0.1:PORT` in the network namespace of process `pid` (a worker in a
/// namespace of its own): `(status, body)`. The connection is made there and used from here.
pub fn http_in_netns(
    pid: cryo_proc::Pid,
    port: u16,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    use std::io::{Read, Write};
    let mut s = crate::eventually(
        Duration::from_secs(60),
        "a connection in the worker's namespace",
        || {
            cryo_proc::in_net_namespace_of(pid, || {
                std::net::TcpStream::connect(("127.0.0.1", port))
            })
            .ok()
        },
    );
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not HTTP from pid {pid}: {text:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status from pid {pid}: {head:?}"));
    (status, rest.to_string())
}

/// Reads a client's connection to its end, which must come (EOF or a reset, never a hang past
/// the read timeout the caller set): what a client sees when the process that forwarded its
/// bytes dies.
pub fn assert_ends(conn: &mut impl std::io::Read) {
    let t = std::time::Instant::now();
    let mut rest = Vec::new();
    if let Err(e) = conn.read_to_end(&mut rest) {
        assert_eq!(
            e.kind(),
            std::io::ErrorKind::ConnectionReset,
            "the connection hangs or fails oddly after {:?}: {e}",
            t.elapsed()
        );
    }
}
