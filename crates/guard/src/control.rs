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
//! - [`Request::LetGo`]: stop guarding a process for as long as this connection stays open (a
//!   lease: what `cryo freeze` asks around a CRIU dump, once the process is suspended; refused
//!   while the journal does not show its context suspended, [`Guard::lease`]). When the client
//!   closes it, or dies, the guard takes the process back (if it still lives) and says so on the
//!   same connection.
//! - [`Request::Attach`]: guard a process (restored by another tool, or after a detach).
//! - [`Request::GuardRestored`]: guard processes whose contexts were just restored and are still
//!   LOCKED; answered once every one is traced (what a standalone `cryo thaw`, `cryo gpu restore`
//!   and the cuda-checkpoint front end ask before they unlock).
//! - [`Request::Release`]: close the pins on a GPU and lift its quarantine. The confirmation is
//!   part of the request ([`Confirmation`]) so that no client can close pins by accident.
//!
//! Processes are named by pid and start time ([`ProcId`]): a pid reused since the client looked
//! is refused, not acted upon. A client in another pid namespace (a container) names them in its
//! own: the guard translates them (`NSpid`, [`cryo_proc::ns::translate_pid`]) before acting.
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
use cryo_lifecycle::{Coverage, Lease, Watcher, WatcherError};
use cryo_proc::ProcHandle;
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
    /// Stop guarding this process while this connection stays open (a lease).
    LetGo {
        /// The process.
        pid: ProcId,
    },
    /// Guard this process.
    Attach {
        /// The process.
        pid: ProcId,
    },
    /// Guard these processes, restored and still LOCKED, before their unlock.
    GuardRestored {
        /// The processes.
        pids: Vec<ProcId>,
    },
    /// Close the pins on `gpu` and lift its quarantine.
    Release {
        /// The GPU (or the entry for an unknown GPU).
        gpu: FencedGpu,
        /// Says the caller knows what closing pins does.
        confirm: Confirmation,
        /// More GPUs released together with `gpu` (a pin that holds contexts on several GPUs
        /// is closed only when every one of them is named).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        also: Vec<FencedGpu>,
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
    /// To [`Request::GuardRestored`]: every one of them is traced.
    Guarded {
        /// The processes.
        pids: Vec<ProcId>,
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
    /// No process has that pid in the caller's pid namespace.
    #[error("no process {pid} in the caller's pid namespace")]
    NoSuchProcess {
        /// The pid, as the caller named it.
        pid: Pid,
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

/// What the server does with a request: the response, and for a lease, what to do once the
/// client's connection closes (or the client says it is done); its result is the last line.
pub(crate) struct Answer {
    response: Response,
    on_close: Option<Box<dyn FnOnce() -> Response + Send>>,
}

impl From<Response> for Answer {
    fn from(response: Response) -> Self {
        Self {
            response,
            on_close: None,
        }
    }
}

/// Serves `listener` on a thread of its own: every connection is checked, parsed and answered
/// by `answer`.
fn spawn_server(
    listener: UnixListener,
    answer: impl Fn(Request) -> Answer + Send + 'static,
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

fn handle(mut s: UnixStream, answer: &dyn Fn(Request) -> Answer) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let cred = rustix::net::sockopt::get_socket_peercred(&s).map(|c| (c.uid.as_raw(), c.pid));
    let answer: Answer = match cred {
        Ok((0, peer)) => {
            let mut line = String::new();
            BufReader::new((&s).take(MAX_REQUEST_BYTES)).read_line(&mut line)?;
            match serde_json::from_str::<Request>(&line) {
                Ok(request) => match translate(request, peer.as_raw_nonzero().get()) {
                    Ok(request) => answer(request),
                    Err(refusal) => refused(refusal).into(),
                },
                Err(e) => refused(Refusal::BadRequest {
                    error: e.to_string(),
                })
                .into(),
            }
        }
        Ok((uid, _)) => refused(Refusal::NotRoot { uid }).into(),
        Err(e) => refused(Refusal::NoCredentials {
            error: e.to_string(),
        })
        .into(),
    };
    let line = serde_json::to_string(&answer.response).map_err(io::Error::other)?;
    let written = writeln!(s, "{line}");
    if let Some(on_close) = answer.on_close {
        // A lease: held, on a thread of its own, until the client closes or dies.
        std::thread::Builder::new()
            .name("cryo-guard-lease".into())
            .spawn(move || {
                let _ = s.set_read_timeout(None);
                let mut rest = String::new();
                let _ = BufReader::new((&s).take(MAX_REQUEST_BYTES)).read_line(&mut rest);
                let last = on_close();
                if let Ok(line) = serde_json::to_string(&last) {
                    let _ = writeln!(s, "{line}");
                }
            })?;
    }
    written
}

/// Names the processes of `request` as the guard's pid namespace does: `peer` (the client, as
/// the kernel names it to the guard) named them in its own (a client inside a container).
fn translate(request: Request, peer: Pid) -> Result<Request, Refusal> {
    let map = |id: ProcId| match cryo_proc::ns::translate_pid(peer, id.pid) {
        // The start time is the same in every namespace.
        Ok(Some(pid)) => Ok(ProcId { pid, ..id }),
        Ok(None) => Err(Refusal::NoSuchProcess { pid: id.pid }),
        Err(e) => Err(Refusal::Failed {
            error: format!(
                "translating pid {} from the caller's pid namespace: {e}",
                id.pid
            ),
        }),
    };
    Ok(match request {
        Request::Detach { pid } => Request::Detach { pid: map(pid)? },
        Request::LetGo { pid } => Request::LetGo { pid: map(pid)? },
        Request::Attach { pid } => Request::Attach { pid: map(pid)? },
        Request::GuardRestored { pids } => Request::GuardRestored {
            pids: pids.into_iter().map(map).collect::<Result<_, _>>()?,
        },
        r @ (Request::Status | Request::Release { .. }) => r,
    })
}

fn refused(refusal: Refusal) -> Response {
    Response::Refused { refusal }
}

fn answer(guard: &Arc<Guard>, request: Request) -> Answer {
    let lease = match request {
        Request::LetGo { pid } => pid,
        other => return answer_now(guard, other).into(),
    };
    match guard.lease(lease) {
        Ok(()) => {
            let guard = Arc::clone(guard);
            Answer {
                response: Response::Detached { pid: lease },
                on_close: Some(Box::new(move || match guard.take_back(lease) {
                    Ok(true) => Response::Attached { pid: lease },
                    Ok(false) => refused(Refusal::NotTraced { pid: lease.pid }),
                    Err(e) => failed(&e),
                })),
            }
        }
        Err(GuardDetachError::NotTraced { pid }) => refused(Refusal::NotTraced { pid }).into(),
        Err(e) => failed(&e).into(),
    }
}

fn failed(e: &dyn fmt::Display) -> Response {
    refused(Refusal::Failed {
        error: e.to_string(),
    })
}

fn answer_now(guard: &Guard, request: Request) -> Response {
    match request {
        Request::Status => Response::Status {
            status: guard.status(),
        },
        Request::LetGo { pid } => refused(Refusal::BadRequest {
            error: format!("a lease on {pid} cannot be answered at once"),
        }),
        Request::Detach { pid } => match guard.detach(pid) {
            Ok(()) => Response::Detached { pid },
            Err(GuardDetachError::NotTraced { pid }) => refused(Refusal::NotTraced { pid }),
            Err(e) => failed(&e),
        },
        Request::Attach { pid } => match guard.attach_id(pid) {
            Ok(()) => Response::Attached { pid },
            Err(e) => failed(&e),
        },
        Request::GuardRestored { pids } => match guard.guard_restored(&pids) {
            Ok(()) => Response::Guarded { pids },
            Err(e) => failed(&e),
        },
        Request::Release {
            gpu,
            confirm: Confirmation::MayWedgeTheHost,
            also,
        } => match guard.release(&[vec![gpu], also].concat()) {
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
        self.exchange(request).map(|(response, _)| response)
    }

    /// Sends one request; the guard's response and the connection (a lease lives as long as it).
    fn exchange(&self, request: &Request) -> Result<(Response, UnixStream), ControlError> {
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
        let response =
            serde_json::from_str(answer.trim()).map_err(|e| ControlError::BadAnswer {
                error: e.to_string(),
                answer,
            })?;
        Ok((response, s))
    }

    /// Asks the guard to stop watching `pid` for as long as the returned lease lives (around a
    /// CRIU dump); `Ok(None)`: no guard runs, or it does not trace `pid`.
    pub fn let_go(&self, pid: ProcId) -> Result<Option<SocketLease>, ControlError> {
        match self.exchange(&Request::LetGo { pid }) {
            Ok((Response::Detached { .. }, stream)) => Ok(Some(SocketLease { pid, stream })),
            Ok((Response::Refused { refusal }, _)) => match refusal {
                Refusal::NotTraced { .. } => Ok(None),
                r => Err(ControlError::Refused(r)),
            },
            Ok((other, _)) => Err(ControlError::Unexpected(Box::new(other), "let_go")),
            Err(ControlError::NotRunning(_)) => Ok(None),
            Err(e) => Err(e),
        }
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

    /// Asks the guard to trace `pids` (restored, still LOCKED) before they are unlocked.
    /// `Ok(false)`: no guard runs.
    pub fn guard_restored(&self, pids: &[ProcId]) -> Result<bool, ControlError> {
        match self.ask(&Request::GuardRestored {
            pids: pids.to_vec(),
        }) {
            Ok(Response::Guarded { .. }) => Ok(true),
            Ok(other) => Err(ControlError::Unexpected(Box::new(other), "guard_restored")),
            Err(ControlError::NotRunning(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Asks the guard to close the pins on the GPUs `gpus` names (at least one) and lift their
    /// quarantine; the processes released.
    pub fn release(&self, gpus: &[FencedGpu]) -> Result<Vec<ProcId>, ControlError> {
        let (gpu, also) = gpus
            .split_first()
            .map_or((FencedGpu::Unknown, &[][..]), |(g, a)| (g.clone(), a));
        match self.ask(&Request::Release {
            gpu,
            also: also.to_vec(),
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

/// A process the guard let go of while this connection stays open ([`GuardClient::let_go`]).
#[derive(Debug)]
pub struct SocketLease {
    pid: ProcId,
    stream: UnixStream,
}

impl SocketLease {
    /// Ends the lease: the guard takes the process back (if it lives); its answer. A client that
    /// dies instead ends it all the same (the connection closes).
    pub fn end(self) -> Result<Response, ControlError> {
        let io_err = |source| ControlError::Io {
            path: PathBuf::from(format!("lease on {}", self.pid)),
            source,
        };
        self.stream
            .shutdown(std::net::Shutdown::Write)
            .map_err(io_err)?;
        self.stream
            .set_read_timeout(Some(Duration::from_secs(60)))
            .map_err(io_err)?;
        let mut answer = String::new();
        BufReader::new(&self.stream)
            .read_line(&mut answer)
            .map_err(io_err)?;
        serde_json::from_str(answer.trim()).map_err(|e| ControlError::BadAnswer {
            error: e.to_string(),
            answer,
        })
    }
}

/// A standalone command (`cryo freeze`) asks the node's guard, over its socket, to let go of a
/// process around a CRIU dump: the lease is the open connection.
impl Watcher for GuardClient {
    fn let_go(&self, pid: ProcId) -> Result<Option<Lease<'_>>, WatcherError> {
        let lease = GuardClient::let_go(self, pid).map_err(WatcherError::new)?;
        Ok(lease.map(|l| {
            Lease::new(pid, move || match l.end() {
                Ok(Response::Attached { .. }) => {}
                Ok(other) => tracing::warn!(pid = pid.pid, ?other, "the guard did not take the process back"),
                Err(error) => tracing::error!(pid = pid.pid, %error, "ending the lease failed; run `cryo guard attach --pid {}`", pid.pid),
            })
        }))
    }

    fn guard_before_unlock(&self, procs: &[&ProcHandle]) -> Result<Coverage, WatcherError> {
        let ids: Vec<ProcId> = procs.iter().map(|h| ProcId::of_handle(h)).collect();
        match self.guard_restored(&ids) {
            Ok(true) => Ok(Coverage::Guarded),
            Ok(false) => Ok(Coverage::NoGuard),
            Err(e) => Err(WatcherError::new(e)),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn requests_and_responses_are_one_line_of_tagged_json() {
        let pid = ProcId::new(12, 345);
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
                    also: Vec::new(),
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
        spawn_server(listener, |request| {
            match request {
                Request::Detach { pid } => Response::Detached { pid },
                _ => Response::Refused {
                    refusal: Refusal::Failed {
                        error: "test server".into(),
                    },
                },
            }
            .into()
        })
        .unwrap();
        (dir, GuardClient::new(&state))
    }

    #[test]
    fn garbage_and_overlong_requests_are_refused_as_bad_requests() {
        let (dir, client) = server();
        let pid = ProcId::new(1, 1);
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
