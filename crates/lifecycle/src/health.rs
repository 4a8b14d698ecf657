//! Health checks of a thawed worker: an HTTP GET that answers 2xx, or a command that exits 0,
//! retried until a deadline.
//!
//! A worker serving on a unix socket is named `unix:SOCKET:/PATH` (`unix:/run/w.sock:/health`):
//! sidecar-style workers do, and so must workers frozen with a CRIU older than 4.2 on Linux >=
//! 6.16, which cannot dump TCP sockets there (`getsockopt(SO_PASSCRED)` is refused for them).
//!
//! # Limitations
//! Plain `http://` only (the worker is on loopback or the node's network); no TLS, no redirects.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// How to tell the worker is serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HealthCheck {
    /// `GET` this `http://host:port/path` (or `unix:SOCKET:/path`) URL; any 2xx answer is healthy.
    Url(String),
    /// Run this command with `sh -c`; exit status 0 is healthy.
    Cmd(String),
}

/// The check never passed.
#[derive(Debug, thiserror::Error)]
pub enum HealthError {
    /// The URL is not `http://host[:port][/path]` nor `unix:SOCKET:/PATH`.
    #[error("health URL {0:?} is not http://host[:port][/path] nor unix:SOCKET:/PATH")]
    BadUrl(String),
    /// No healthy answer before the deadline.
    #[error("no healthy answer from {what} within {} ms (last: {last})", .timeout.as_millis())]
    Timeout {
        /// The check.
        what: String,
        /// The timeout.
        timeout: Duration,
        /// The last failure seen.
        last: String,
    },
}

impl HealthCheck {
    /// Checks the syntax without any system call.
    pub fn validate(&self) -> Result<(), HealthError> {
        match self {
            HealthCheck::Url(u) => parse_url(u).map(|_| ()),
            HealthCheck::Cmd(_) => Ok(()),
        }
    }

    /// Retries the check until it passes or `timeout` runs out; returns when it passed.
    pub fn wait(&self, timeout: Duration) -> Result<Instant, HealthError> {
        let deadline = Instant::now() + timeout;
        let what = match self {
            HealthCheck::Url(u) => u.clone(),
            HealthCheck::Cmd(c) => format!("`{c}`"),
        };
        let mut last = String::from("not tried");
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(HealthError::Timeout {
                    what,
                    timeout,
                    last,
                });
            }
            let attempt = match self {
                HealthCheck::Url(u) => http_get(u, left.min(Duration::from_secs(2))),
                HealthCheck::Cmd(c) => run_cmd(c, left),
            };
            match attempt {
                Ok(()) => return Ok(Instant::now()),
                Err(HealthAttempt::Fatal(e)) => return Err(e),
                Err(HealthAttempt::Failed(why)) => last = why,
            }
            std::thread::sleep(
                Duration::from_millis(20).min(deadline.saturating_duration_since(Instant::now())),
            );
        }
    }
}

enum HealthAttempt {
    Failed(String),
    Fatal(HealthError),
}

#[derive(Debug, PartialEq, Eq)]
enum Endpoint {
    Tcp(String),
    Unix(std::path::PathBuf),
}

fn parse_url(url: &str) -> Result<(Endpoint, String), HealthError> {
    let bad = || HealthError::BadUrl(url.to_string());
    if let Some(rest) = url.strip_prefix("unix:") {
        let (sock, path) = rest.rsplit_once(":/").ok_or_else(bad)?;
        if sock.is_empty() {
            return Err(bad());
        }
        return Ok((Endpoint::Unix(sock.into()), format!("/{path}")));
    }
    let rest = url.strip_prefix("http://").ok_or_else(bad)?;
    let (hostport, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, "/"),
    };
    if hostport.is_empty() {
        return Err(bad());
    }
    let hostport = if hostport.contains(':') {
        hostport.to_string()
    } else {
        format!("{hostport}:80")
    };
    Ok((Endpoint::Tcp(hostport), path.to_string()))
}

fn http_get(url: &str, timeout: Duration) -> Result<(), HealthAttempt> {
    let (endpoint, path) = parse_url(url).map_err(HealthAttempt::Fatal)?;
    let failed = |e: std::io::Error| HealthAttempt::Failed(e.to_string());
    let (mut s, host): (Box<dyn ReadWrite>, String) = match endpoint {
        Endpoint::Tcp(hostport) => {
            let addr = hostport
                .to_socket_addrs()
                .map_err(failed)?
                .next()
                .ok_or_else(|| HealthAttempt::Failed(format!("{hostport} does not resolve")))?;
            let s = TcpStream::connect_timeout(&addr, timeout).map_err(failed)?;
            s.set_read_timeout(Some(timeout)).map_err(failed)?;
            s.set_write_timeout(Some(timeout)).map_err(failed)?;
            (Box::new(s), hostport)
        }
        Endpoint::Unix(sock) => {
            let s = UnixStream::connect(&sock).map_err(failed)?;
            s.set_read_timeout(Some(timeout)).map_err(failed)?;
            s.set_write_timeout(Some(timeout)).map_err(failed)?;
            (Box::new(s), "localhost".into())
        }
    };
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n"
    )
    .map_err(failed)?;
    let mut head = [0u8; 64];
    let n = s.read(&mut head).map_err(failed)?;
    let line = String::from_utf8_lossy(&head[..n]);
    let status = line.split_whitespace().nth(1).unwrap_or("");
    if status.starts_with('2') && status.len() == 3 {
        Ok(())
    } else {
        Err(HealthAttempt::Failed(format!("HTTP status {status:?}")))
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

fn run_cmd(cmd: &str, timeout: Duration) -> Result<(), HealthAttempt> {
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(Stdio::null())
        .spawn()
        .map_err(|e| HealthAttempt::Failed(format!("cannot run sh: {e}")))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(HealthAttempt::Failed(format!("exited with {st}"))),
            Ok(None) if Instant::now() >= deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(HealthAttempt::Failed(
                    "still running at the deadline".into(),
                ));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => return Err(HealthAttempt::Failed(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed() {
        assert_eq!(
            parse_url("http://127.0.0.1:8080/health").unwrap(),
            (Endpoint::Tcp("127.0.0.1:8080".into()), "/health".into())
        );
        assert_eq!(
            parse_url("http://localhost").unwrap(),
            (Endpoint::Tcp("localhost:80".into()), "/".into())
        );
        assert_eq!(
            parse_url("unix:/run/w.sock:/health").unwrap(),
            (Endpoint::Unix("/run/w.sock".into()), "/health".into())
        );
        for bad in [
            "https://x/",
            "127.0.0.1:80",
            "http:///x",
            "unix:/run/w.sock",
            "unix::/h",
        ] {
            assert!(parse_url(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn commands_pass_on_exit_zero_and_time_out_otherwise() {
        assert!(HealthCheck::Cmd("true".into())
            .wait(Duration::from_secs(5))
            .is_ok());
        let err = HealthCheck::Cmd("exit 3".into())
            .wait(Duration::from_millis(200))
            .unwrap_err();
        assert!(err.to_string().contains("exit status: 3"), "{err}");
    }
}
