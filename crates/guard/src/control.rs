//! The running guard's control socket ([`StateDir::guard_socket`]): typed requests and responses.
//!
//! # Design
//! One request per connection: a [`Request`] as one line of JSON, answered by one [`Response`] as
//! one line of JSON (`{"request":"detach","pid":{"pid":12,"start_time":345}}` ->
//! `{"response":"detached","pid":{...}}`). Failures are typed too ([`Refusal`]): a client
//! branches on the variant, never on the wording. Only root may talk to it: the peer's
//! credentials (`SO_PEERCRED`) are checked on every connection, and the socket file is mode 0600.
//! - [`Request::Status`]: the [`GuardStatus`].
//! - [`Request::Detach`]: stop guarding a process until it is attached again (what `cryo freeze`
//!   asks before a CRIU dump, since CRIU cannot dump a traced process; a thaw's
//!   `RestoreCompleted` attaches the restored process by itself).
//! - [`Request::Attach`]: guard a process (restored by another tool, or after a detach).
//! - [`Request::Release`]: close the pins on a GPU and lift its quarantine. The confirmation is
//!   part of the request ([`Confirmation`]) so that no client can close pins by accident.
//!
//! Processes are named by pid and start time ([`ProcId`]): a pid reused since the client looked
//! is refused, not acted upon.
//!
//! [`GuardClient`] is the client side; it is also how a standalone command asks the guard of
//! the node to let go of a process around a dump ([`cryo_lifecycle::Watcher`]).
//!
//! # Limitations
//! The server handles one connection at a time (each request is short); a request line is at
//! most [`MAX_REQUEST_BYTES`].

use std::fmt;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cryo_journal::ProcId;
use cryo_lifecycle::{Watcher, WatcherError};
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;
use serde::{Deserialize, Serialize};

use crate::guard::{Guard, GuardDetachError, GuardStatus, ReleaseError};
use cryo_proc::Pid;

/// The longest request line the server reads.
pub const MAX_REQUEST_BYTES: u64 = 64 << 10;

/// A request to the running guard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case", deny_unknown_fields)]
pub enum Request {
    /// The guard's state.
    Status,
    /// Stop guarding this process until it is attached again.
    Detach {
        /// The process.
        pid: ProcId,
    },
    /// Guard this process.
    Attach {
        /// The process.
        pid: ProcId,
    },
    /// Close the pins on `gpu` and lift its quarantine.
    Release {
        /// The GPU (or the entry for an unknown GPU).
        gpu: FencedGpu,
        /// Says the caller knows what closing pins does.
        confirm: Confirmation,
    },
}

/// The only value [`Request::Release`] accepts: closing pins lets the driver tear down a live
/// restored context, which wedges affected hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Confirmation {
    /// `i-understand-this-may-wedge-the-host`.
    #[serde(rename = "i-understand-this-may-wedge-the-host")]
    MayWedgeTheHost,
}

/// The guard's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "response", rename_all = "snake_case", deny_unknown_fields)]
pub enum Response {
    /// To [`Request::Status`].
    Status {
        /// The guard's state.
        status: GuardStatus,
    },
    /// To [`Request::Detach`]: no thread of the process is traced any more.
    Detached {
        /// The process.
        pid: ProcId,
    },
    /// To [`Request::Attach`]: the process is guarded.
    Attached {
        /// The process.
        pid: ProcId,
    },
    /// To [`Request::Release`]: the pins of these processes were closed.
    Released {
        /// The processes whose pins were closed.
        pids: Vec<ProcId>,
    },
    /// The request was not carried out.
    Refused {
        /// Why.
        refusal: Refusal,
    },
}

/// Why the guard did not carry out a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum Refusal {
    /// Only root may control the guard.
    #[error("only root may control the guard (peer uid {uid})")]
    NotRoot {
        /// The peer's uid.
        uid: u32,
    },
    /// The peer's credentials could not be read.
    #[error("no peer credentials: {error}")]
    NoCredentials {
        /// Why.
        error: String,
    },
    /// The request is not one this guard understands.
    #[error("bad request: {error}")]
    BadRequest {
        /// The parser's complaint.
        error: String,
    },
    /// The process is not guarded by this guard (or its pid names another process now).
    #[error("process {pid} is not traced by this guard")]
    NotTraced {
        /// The process.
        pid: Pid,
    },
    /// Nothing is pinned or quarantined for that GPU.
    #[error("GPU {gpu} is neither pinned by this guard nor quarantined")]
    NotPinned {
        /// The GPU.
        gpu: FencedGpu,
    },
    /// The guard tried and failed.
    #[error("{error}")]
    Failed {
        /// What went wrong.
        error: String,
    },
}

/// Serving the control socket failed.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another guard answers on the socket.
    #[error("a guard is already running on {0}")]
    AlreadyRunning(PathBuf),
    /// The socket could not be set up.
    #[error("cannot listen on {path}: {source}")]
    Listen {
        /// The socket.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// Binds the socket and serves it on a thread of its own for as long as the process lives.
pub fn serve(guard: Arc<Guard>, state: &StateDir) -> Result<(), ServeError> {
    let path = state.guard_socket();
    let listen_err = |source| ServeError::Listen {
        path: path.clone(),
        source,
    };
    std::fs::create_dir_all(state.root()).map_err(listen_err)?;
    if UnixStream::connect(&path).is_ok() {
        return Err(ServeError::AlreadyRunning(path));
    }
    // Left by a guard that died: nobody answers on it.
    let _ = std::fs::remove_file(&path);
    let listener = UnixListener::bind(&path).map_err(listen_err)?;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).map_err(listen_err)?;
    spawn_server(listener, move |request| answer(&guard, request)).map_err(listen_err)
}

/// Serves `listener` on a thread of its own: every connection is checked, parsed and answered
/// by `answer`.
fn spawn_server(
    listener: UnixListener,
    answer: impl Fn(Request) -> Response + Send + 'static,
) -> io::Result<()> {
    std::thread::Builder::new()
        .name("cryo-guard-control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        if let Err(err) = handle(s, &answer) {
                            tracing::debug!(%err, "control client went away");
                        }
                    }
                    Err(err) => tracing::warn!(%err, "control socket accept failed"),
                }
            }
        })
        .map(drop)
}

fn handle(mut s: UnixStream, answer: &dyn Fn(Request) -> Response) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let uid = rustix::net::sockopt::get_socket_peercred(&s).map(|c| c.uid.as_raw());
    let response = match uid {
        Ok(0) => {
            let mut line = String::new();
            BufReader::new((&s).take(MAX_REQUEST_BYTES)).read_line(&mut line)?;
            match serde_json::from_str::<Request>(&line) {
                Ok(request) => answer(request),
                Err(e) => refused(Refusal::BadRequest {
                    error: e.to_string(),
                }),
            }
        }
        Ok(uid) => refused(Refusal::NotRoot { uid }),
        Err(e) => refused(Refusal::NoCredentials {
            error: e.to_string(),
        }),
    };
    let line = serde_json::to_string(&response).map_err(io::Error::other)?;
    writeln!(s, "{line}")
}

fn refused(refusal: Refusal) -> Response {
    Response::Refused { refusal }
}

fn answer(guard: &Guard, request: Request) -> Response {
    let failed = |e: &dyn fmt::Display| {
        refused(Refusal::Failed {
            error: e.to_string(),
        })
    };
    match request {
        Request::Status => Response::Status {
            status: guard.status(),
        },
        Request::Detach { pid } => match guard.detach(pid) {
            Ok(()) => Response::Detached { pid },
            Err(GuardDetachError::NotTraced { pid }) => refused(Refusal::NotTraced { pid }),
            Err(e) => failed(&e),
        },
        Request::Attach { pid } => match guard.attach_id(pid) {
            Ok(()) => Response::Attached { pid },
            Err(e) => failed(&e),
        },
        Request::Release {
            gpu,
            confirm: Confirmation::MayWedgeTheHost,
        } => match guard.release(&gpu) {
            Ok(pids) => Response::Released { pids },
            Err(ReleaseError::NotPinned(gpu)) => refused(Refusal::NotPinned { gpu }),
            Err(e) => failed(&e),
        },
    }
}

/// Talking to the guard failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// No guard listens on the socket.
    #[error("no guard is running (nothing answers on {0})")]
    NotRunning(PathBuf),
    /// The exchange failed.
    #[error("talking to the guard on {path} failed: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The guard answered something that is not a response (another version of cryo?).
    #[error("the guard answered {answer:?}: {error}")]
    BadAnswer {
        /// What it answered.
        answer: String,
        /// The parser's complaint.
        error: String,
    },
    /// The guard answered, but not to the question asked.
    #[error("the guard answered {0:?} to a {1} request")]
    Unexpected(Box<Response>, &'static str),
    /// The guard refused or failed.
    #[error("the guard says: {0}")]
    Refused(Refusal),
    /// The process to name in the request could not be looked up.
    #[error("cannot name pid {pid} to the guard: {source}")]
    Process {
        /// The pid.
        pid: Pid,
        /// Why.
        source: cryo_proc::ProcError,
    },
}

/// What a detach request found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Detach {
    /// The guard let go of the process.
    Detached,
    /// The guard was not tracing it.
    NotTraced,
    /// No guard runs on this state directory.
    NoGuard,
}

/// The client side of the guard of one state directory.
#[derive(Debug, Clone)]
pub struct GuardClient {
    socket: PathBuf,
}

impl GuardClient {
    /// The client of the guard using `state` (nothing is touched until a call).
    pub fn new(state: &StateDir) -> Self {
        Self {
            socket: state.guard_socket(),
        }
    }

    /// Sends one request; the guard's response, refusals included.
    pub fn call(&self, request: &Request) -> Result<Response, ControlError> {
        let path = &self.socket;
        let mut s = UnixStream::connect(path).map_err(|e| match e.kind() {
            io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused => {
                ControlError::NotRunning(path.clone())
            }
            _ => ControlError::Io {
                path: path.clone(),
                source: e,
            },
        })?;
        let io_err = |source| ControlError::Io {
            path: path.clone(),
            source,
        };
        s.set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(io_err)?;
        let line = serde_json::to_string(request).map_err(|e| io_err(io::Error::other(e)))?;
        match writeln!(s, "{line}") {
            Ok(()) => {}
            // A guard that refuses the peer answers without reading the request: its answer is
            // there to read.
            Err(e) if e.kind() == io::ErrorKind::BrokenPipe => {}
            Err(e) => return Err(io_err(e)),
        }
        let mut answer = String::new();
        BufReader::new(&s).read_line(&mut answer).map_err(io_err)?;
        serde_json::from_str(answer.trim()).map_err(|e| ControlError::BadAnswer {
            error: e.to_string(),
            answer,
        })
    }

    /// Sends one request; refusals become [`ControlError::Refused`].
    fn ask(&self, request: &Request) -> Result<Response, ControlError> {
        match self.call(request)? {
            Response::Refused { refusal } => Err(ControlError::Refused(refusal)),
            r => Ok(r),
        }
    }

    /// The running guard's status; `Ok(None)` when no guard runs.
    pub fn status(&self) -> Result<Option<GuardStatus>, ControlError> {
        match self.ask(&Request::Status) {
            Ok(Response::Status { status }) => Ok(Some(status)),
            Ok(other) => Err(ControlError::Unexpected(Box::new(other), "status")),
            Err(ControlError::NotRunning(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Asks the guard to stop watching `pid` (before a CRIU dump).
    pub fn detach(&self, pid: ProcId) -> Result<Detach, ControlError> {
        match self.ask(&Request::Detach { pid }) {
            Ok(Response::Detached { .. }) => Ok(Detach::Detached),
            Ok(other) => Err(ControlError::Unexpected(Box::new(other), "detach")),
            Err(ControlError::NotRunning(_)) => Ok(Detach::NoGuard),
            Err(ControlError::Refused(Refusal::NotTraced { .. })) => Ok(Detach::NotTraced),
            Err(e) => Err(e),
        }
    }

    /// Asks the guard to watch `pid` (again). `Ok(false)`: no guard runs.
    pub fn attach(&self, pid: ProcId) -> Result<bool, ControlError> {
        match self.ask(&Request::Attach { pid }) {
            Ok(Response::Attached { .. }) => Ok(true),
            Ok(other) => Err(ControlError::Unexpected(Box::new(other), "attach")),
            Err(ControlError::NotRunning(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Asks the guard to close the pins on `gpu` and lift its quarantine; the processes released.
    pub fn release(&self, gpu: &FencedGpu) -> Result<Vec<ProcId>, ControlError> {
        match self.ask(&Request::Release {
            gpu: gpu.clone(),
            confirm: Confirmation::MayWedgeTheHost,
        })? {
            Response::Released { pids } => Ok(pids),
            other => Err(ControlError::Unexpected(Box::new(other), "release")),
        }
    }

    /// The identity of `pid` now, to name it in a request.
    pub fn identify(pid: Pid) -> Result<ProcId, ControlError> {
        ProcId::of(pid).map_err(|source| ControlError::Process { pid, source })
    }
}

/// A standalone command (`cryo freeze`) asks the node's guard, over its socket, to let go of a
/// process around a CRIU dump.
impl Watcher for GuardClient {
    fn detach(&self, pid: ProcId) -> Result<bool, WatcherError> {
        match GuardClient::detach(self, pid) {
            Ok(Detach::Detached) => Ok(true),
            Ok(Detach::NotTraced | Detach::NoGuard) => Ok(false),
            Err(e) => Err(WatcherError::new(e)),
        }
    }

    fn attach(&self, pid: ProcId) -> Result<(), WatcherError> {
        match GuardClient::attach(self, pid) {
            Ok(true) => Ok(()),
            Ok(false) => Err(WatcherError::new(ControlError::NotRunning(
                self.socket.clone(),
            ))),
            Err(e) => Err(WatcherError::new(e)),
        }
    }

    /// The guard's `attach` answers once every thread is seized.
    fn guard_before_unlock(
        &self,
        procs: &[&cryo_proc::ProcHandle],
    ) -> Result<cryo_lifecycle::Coverage, WatcherError> {
        for p in procs {
            let id = ProcId {
                pid: p.pid(),
                start_time: p.start_time(),
            };
            if !GuardClient::attach(self, id).map_err(WatcherError::new)? {
                return Ok(cryo_lifecycle::Coverage::NoGuard);
            }
        }
        Ok(cryo_lifecycle::Coverage::Guarded)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn requests_and_responses_are_one_line_of_tagged_json() {
        let pid = ProcId {
            pid: 12,
            start_time: 345,
        };
        let cases = [
            (Request::Status, r#"{"request":"status"}"#.to_string()),
            (
                Request::Detach { pid },
                r#"{"request":"detach","pid":{"pid":12,"start_time":345}}"#.to_string(),
            ),
            (
                Request::Release {
                    gpu: FencedGpu::Unknown,
                    confirm: Confirmation::MayWedgeTheHost,
                },
                r#"{"request":"release","gpu":"unknown","confirm":"i-understand-this-may-wedge-the-host"}"#
                    .to_string(),
            ),
        ];
        for (request, text) in cases {
            assert_eq!(serde_json::to_string(&request).unwrap(), text);
            assert_eq!(serde_json::from_str::<Request>(&text).unwrap(), request);
        }
        let r = Response::Refused {
            refusal: Refusal::NotTraced { pid: 12 },
        };
        let text = serde_json::to_string(&r).unwrap();
        assert_eq!(
            text,
            r#"{"response":"refused","refusal":{"kind":"not_traced","pid":12}}"#
        );
        assert_eq!(serde_json::from_str::<Response>(&text).unwrap(), r);
    }

    /// A server answering every request with an empty status list, and a client of it.
    fn server() -> (tempfile::TempDir, GuardClient) {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let listener = UnixListener::bind(state.guard_socket()).unwrap();
        spawn_server(listener, |request| match request {
            Request::Detach { pid } => Response::Detached { pid },
            _ => Response::Refused {
                refusal: Refusal::Failed {
                    error: "test server".into(),
                },
            },
        })
        .unwrap();
        (dir, GuardClient::new(&state))
    }

    #[test]
    fn garbage_and_overlong_requests_are_refused_as_bad_requests() {
        let (dir, client) = server();
        let pid = ProcId {
            pid: 1,
            start_time: 1,
        };
        assert_eq!(
            client.call(&Request::Detach { pid }).unwrap(),
            Response::Detached { pid }
        );
        let path = StateDir::new(dir.path()).guard_socket();
        for request in [
            b"detach 12\n".to_vec(),
            b"\n".to_vec(),
            vec![b'x'; MAX_REQUEST_BYTES as usize + 10],
        ] {
            let mut s = UnixStream::connect(&path).unwrap();
            s.write_all(&request).unwrap();
            s.shutdown(std::net::Shutdown::Write).unwrap();
            let mut answer = String::new();
            BufReader::new(&s).read_line(&mut answer).unwrap();
            let r: Response = serde_json::from_str(&answer).unwrap();
            assert!(
                matches!(
                    r,
                    Response::Refused {
                        refusal: Refusal::BadRequest { .. }
                    }
                ),
                "{answer}"
            );
        }
    }

    #[test]
    fn a_release_without_the_confirmation_or_with_a_bad_gpu_does_not_parse() {
        for bad in [
            r#"{"request":"release","gpu":"unknown"}"#,
            r#"{"request":"release","gpu":"unknown","confirm":"yes"}"#,
            r#"{"request":"release","gpu":"GPU-1","confirm":"i-understand-this-may-wedge-the-host"}"#,
            r#"{"request":"detach","pid":12}"#,
            "status",
            "",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }
}
