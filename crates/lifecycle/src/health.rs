//! Health checks of a thawed worker: an HTTP GET that answers 2xx, or a command that exits 0,
//! retried until a deadline.
//!
//! A worker serving on a unix socket is named `unix:SOCKET:/PATH` (`unix:/run/w.sock:/health`):
//! sidecar-style workers do, and so must workers frozen with a CRIU older than 4.2 on Linux >=
//! 6.16, which cannot dump TCP sockets there (`getsockopt(SO_PASSCRED)` is refused for them).
//!
//! The request goes through `cryo_http`, cryo's one HTTP client.
//!
//! Attempts are `Pauses` apart: 1 ms after the first, doubling to 20 ms (a command's exit is
//! waited for on its pidfd: seen the moment it comes). A thawed worker usually answers within a few
//! milliseconds of its unlock, and a fixed 20 ms period made every thaw's first answer wait up
//! to 20 ms for the next attempt; a worker that is still starting gets at most 5 attempts in
//! its first 31 ms and 50 a second after that, as before.
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
        let mut pauses = Pauses::new(FIRST_PAUSE, MAX_PAUSE);
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
                pauses
                    .next_pause()
                    .min(deadline.saturating_duration_since(Instant::now())),
            );
        }
    }
}

const NOT_TRIED: &str = "not tried";

/// The pause after a health check's first failed attempt.
const FIRST_PAUSE: Duration = Duration::from_millis(1);
/// The longest pause between two attempts: at most 50 a second at length.
const MAX_PAUSE: Duration = Duration::from_millis(20);

/// Pauses between attempts: `first`, doubling each time up to `max`, then `max` for good.
#[derive(Debug, Clone)]
pub(crate) struct Pauses {
    next: Duration,
    max: Duration,
}

impl Pauses {
    pub(crate) fn new(first: Duration, max: Duration) -> Pauses {
        Pauses {
            next: first.min(max),
            max,
        }
    }

    /// The pause to take now.
    pub(crate) fn next_pause(&mut self) -> Duration {
        let now = self.next;
        self.next = (now * 2).min(self.max);
        now
    }
}

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
    // Our child, not reaped yet: its pid names it. Its exit makes the pidfd readable.
    let pid = rustix::process::Pid::from_child(&child);
    let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
        .map_err(|e| HealthAttempt::Failed(format!("cannot open a pidfd of sh: {e}")))?;
    let deadline = Instant::now() + timeout;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fds = [rustix::event::PollFd::new(
            &pidfd,
            rustix::event::PollFlags::IN,
        )];
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        match rustix::event::poll(&mut fds, ms) {
            Ok(0) if left.is_zero() => {
                // The group's id is the child's pid, ours until we reap it.
                let _ = rustix::process::kill_process_group(pid, rustix::process::Signal::Kill);
                let _ = child.wait();
                return Err(HealthAttempt::Cut("still running at the deadline".into()));
            }
            Ok(0) | Err(rustix::io::Errno::INTR) => {}
            Ok(_) => {
                return match child.wait() {
                    Ok(st) if st.success() => Ok(()),
                    Ok(st) => Err(HealthAttempt::Failed(format!("exited with {st}"))),
                    Err(e) => Err(HealthAttempt::Failed(e.to_string())),
                };
            }
            Err(e) => return Err(HealthAttempt::Failed(e.to_string())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn pauses_start_at_a_millisecond_and_double_to_their_bound() {
        let mut p = Pauses::new(FIRST_PAUSE, MAX_PAUSE);
        let ms: Vec<u128> = (0..8).map(|_| p.next_pause().as_millis()).collect();
        assert_eq!(ms, [1, 2, 4, 8, 16, 20, 20, 20]);
        let mut p = Pauses::new(Duration::from_millis(50), MAX_PAUSE);
        assert_eq!(p.next_pause(), MAX_PAUSE);
    }

    /// The most attempts a check may make within `elapsed`, by the promise in the module docs
    /// (not by [`Pauses`], whose breakage this bounds): the first at once, the next ones 1, 2,
    /// 4, 8, 16 ms and then 20 ms after the one before (a sleep is never shorter than asked).
    fn most_attempts_within(elapsed: Duration) -> usize {
        let mut pause = 1;
        let (mut n, mut t) = (1, 0);
        loop {
            t += pause;
            if Duration::from_millis(t) > elapsed {
                return n;
            }
            n += 1;
            pause = (pause * 2).min(20);
        }
    }

    /// Attack: a worker that is starting (answering 503 to its first 40 requests) is polled no
    /// faster than the pauses allow, however fast it answers; counted by the worker, bounded by
    /// the time the check took (a fixed rate of attempts must not become a loop).
    #[test]
    fn a_worker_that_is_starting_is_not_hammered() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("w.sock");
        let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        const REFUSED: usize = 40;
        let server = std::thread::spawn(move || {
            let mut served = 0;
            for conn in listener.incoming() {
                let mut c = conn.unwrap();
                let mut req = [0u8; 1024];
                let _ = c.read(&mut req);
                served += 1;
                let status = if served > REFUSED {
                    "200 OK"
                } else {
                    "503 Service Unavailable"
                };
                let _ = write!(
                    c,
                    "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                );
                if served > REFUSED {
                    return served;
                }
            }
            served
        });
        let check = HealthCheck::Url(format!("unix:{}:/health", sock.display()));
        let t = Instant::now();
        let answered = check.wait(Duration::from_secs(30)).unwrap();
        let took = answered.duration_since(t);
        let attempts = server.join().unwrap();
        assert_eq!(attempts, REFUSED + 1);
        assert!(
            attempts <= most_attempts_within(took),
            "{attempts} attempts in {took:?}: at most {} allowed",
            most_attempts_within(took)
        );
    }

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
