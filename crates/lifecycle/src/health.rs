//! Health checks of a thawed worker: an HTTP GET that answers 2xx, or a command that exits 0,
//! retried until a deadline.
//!
//! A worker serving on a unix socket is named `unix:SOCKET:/PATH` (`unix:/run/w.sock:/health`):
//! sidecar-style workers do, and so must workers frozen with a CRIU older than 4.2 on Linux >=
//! 6.16, which cannot dump TCP sockets there (`getsockopt(SO_PASSCRED)` is refused for them).
//!
//! The request goes through `cryo_http`, cryo's one HTTP client.
//!
//! # Limitations
//! Plain `http://` only (the worker is on loopback or the node's network); no TLS, no redirects.

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
            HealthCheck::Url(u) => cryo_http::Endpoint::parse_url(u)
                .map(|_| ())
                .map_err(|_| HealthError::BadUrl(u.clone())),
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
        let mut last = String::from(NOT_TRIED);
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
                // An attempt the deadline cut short says less than a finished one that failed.
                Err(HealthAttempt::Cut(why)) if last == NOT_TRIED => last = why,
                Err(HealthAttempt::Cut(_)) => {}
            }
            std::thread::sleep(
                Duration::from_millis(20).min(deadline.saturating_duration_since(Instant::now())),
            );
        }
    }
}

const NOT_TRIED: &str = "not tried";

enum HealthAttempt {
    /// The check ran and failed.
    Failed(String),
    /// The check was still running when the deadline came.
    Cut(String),
    Fatal(HealthError),
}

fn http_get(url: &str, timeout: Duration) -> Result<(), HealthAttempt> {
    match cryo_http::fetch("GET", url, None, timeout) {
        Ok((status, _)) if (200..300).contains(&status) => Ok(()),
        Ok((status, _)) => Err(HealthAttempt::Failed(format!("HTTP status {status}"))),
        Err(cryo_http::HttpError::Url(_)) => {
            Err(HealthAttempt::Fatal(HealthError::BadUrl(url.to_string())))
        }
        Err(e) => Err(HealthAttempt::Failed(e.to_string())),
    }
}

fn run_cmd(cmd: &str, timeout: Duration) -> Result<(), HealthAttempt> {
    use std::os::unix::process::CommandExt;
    // Its own process group: a command still running at the deadline is killed with whatever
    // it started (`sh -c` forks its commands).
    let mut child = Command::new("sh")
        .arg("-c")
        .arg(cmd)
        .stdin(Stdio::null())
        .process_group(0)
        .spawn()
        .map_err(|e| HealthAttempt::Failed(format!("cannot run sh: {e}")))?;
    let deadline = Instant::now() + timeout;
    loop {
        match child.try_wait() {
            Ok(Some(st)) if st.success() => return Ok(()),
            Ok(Some(st)) => return Err(HealthAttempt::Failed(format!("exited with {st}"))),
            Ok(None) if Instant::now() >= deadline => {
                // The group's id is the child's pid, ours until we reap it.
                let group = rustix::process::Pid::from_child(&child);
                let _ = rustix::process::kill_process_group(group, rustix::process::Signal::Kill);
                let _ = child.wait();
                return Err(HealthAttempt::Cut("still running at the deadline".into()));
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
    fn malformed_urls_are_refused_before_any_attempt() {
        for bad in ["https://x/", "127.0.0.1:80", "unix:/run/w.sock"] {
            let check = HealthCheck::Url(bad.into());
            assert!(
                matches!(check.validate(), Err(HealthError::BadUrl(_))),
                "{bad}"
            );
            assert!(
                matches!(
                    check.wait(Duration::from_secs(5)),
                    Err(HealthError::BadUrl(_))
                ),
                "{bad}"
            );
        }
        assert!(HealthCheck::Url("unix:/run/w.sock:/health".into())
            .validate()
            .is_ok());
    }

    #[test]
    fn commands_pass_on_exit_zero_and_time_out_otherwise() {
        assert!(HealthCheck::Cmd("true".into())
            .wait(Duration::from_secs(5))
            .is_ok());
        // Retried until the deadline; the error names how a finished attempt failed, not the
        // last attempt the deadline cut short (CI saw "still running at the deadline" when
        // the load made `sh` slower than the 200 ms this test allowed).
        let err = HealthCheck::Cmd("exit 3".into())
            .wait(Duration::from_secs(2))
            .unwrap_err();
        assert!(err.to_string().contains("exit status: 3"), "{err}");
        let err = HealthCheck::Cmd("sleep 5".into())
            .wait(Duration::from_millis(300))
            .unwrap_err();
        assert!(err.to_string().contains("still running"), "{err}");
        // What the command started went with it (nextest reports a leak otherwise: the
        // `sleep` would hold the test's output pipe for five seconds).
    }
}
