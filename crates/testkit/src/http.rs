//! One HTTP/1.1 request to a worker, on loopback TCP or on a unix socket.
//!
//! Hand-written on purpose: a worker frozen by CRIU serves on a unix socket (`--http-unix`), which
//! no small client speaks through a stable API, and a test needs nothing but one request with
//! `Connection: close` and the status and body of its answer.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;

/// Where a worker serves HTTP.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `127.0.0.1:PORT`.
    Tcp(u16),
    /// A unix socket.
    Unix(PathBuf),
}

impl From<u16> for Endpoint {
    fn from(port: u16) -> Self {
        Endpoint::Tcp(port)
    }
}

impl From<&Endpoint> for Endpoint {
    fn from(e: &Endpoint) -> Self {
        e.clone()
    }
}

impl Endpoint {
    /// The URL `cryo thaw --health-url` takes for `path` here.
    pub fn url(&self, path: &str) -> String {
        match self {
            Endpoint::Tcp(port) => format!("http://127.0.0.1:{port}{path}"),
            Endpoint::Unix(sock) => format!("unix:{}:{path}", sock.display()),
        }
    }
}

/// Sends one request and returns `(status, body)`. Panics when the worker cannot be reached or
/// answers something that is not HTTP: in a test, that is the failure.
pub fn http(to: impl Into<Endpoint>, method: &str, path: &str, body: &str) -> (u16, String) {
    match to.into() {
        Endpoint::Tcp(port) => exchange(
            TcpStream::connect(("127.0.0.1", port))
                .unwrap_or_else(|e| panic!("cannot connect to 127.0.0.1:{port}: {e}")),
            method,
            path,
            body,
        ),
        Endpoint::Unix(sock) => exchange(
            UnixStream::connect(&sock)
                .unwrap_or_else(|e| panic!("cannot connect to {}: {e}", sock.display())),
            method,
            path,
            body,
        ),
    }
}

fn exchange(mut s: impl Read + Write, method: &str, path: &str, body: &str) -> (u16, String) {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out
        .split_once("\r\n\r\n")
        .unwrap_or_else(|| panic!("not an HTTP answer: {out:?}"));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head:?}"));
    (status, body.to_string())
}
