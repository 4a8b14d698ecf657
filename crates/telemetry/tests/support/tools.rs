//! External tools of the telemetry tests: finding them, `promtool check metrics`, reading samples.
//! Self-contained (std only): the CLI's tests include it too.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, Stdio};

/// A program on PATH or in the sbin directories (not on every PATH).
pub fn which(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin", "/usr/local/sbin"].map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// `promtool check metrics` on `text`: panics with promtool's findings unless it is clean.
pub fn promtool_check(text: &str) {
    use std::io::Write as _;
    let promtool = which("promtool").unwrap_or_else(|| {
        panic!("promtool not found (Debian package prometheus): run scripts/install-test-deps.sh")
    });
    let mut child = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics failed ({}):\n{}{}\n--- metrics ---\n{text}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The value of a sample (`name{labels} value`) in exposition text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok())?
    })
}

/// `HOST:PORT` on loopback where nothing listens (a port bound, noted and closed): a collector
/// that refuses connections.
pub fn refused_addr() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    l.local_addr().unwrap().to_string()
}

/// `GET path` on `addr` over HTTP/1.1: (status line and headers, body).
pub fn http_get(addr: &str, path: &str) -> (String, String) {
    use std::io::{Read as _, Write as _};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (head.to_string(), body.to_string())
}
