//! The running guard's control socket: `STATE_DIR/guard.sock`.
//!
//! # Design
//! One request per connection: a line of text, answered by one line of JSON
//! (`{"ok":true,...}` or `{"ok":false,"error":"..."}`). Only root may talk to it: the peer's
//! credentials (`SO_PEERCRED`) are checked on every connection, and the socket file is mode 0600.
//! - `status`: the [`GuardStatus`].
//! - `detach PID`: stop guarding PID until `attach PID` (what `cryo freeze` asks before a CRIU
//!   dump, since CRIU cannot dump a traced process; a thaw's `RestoreCompleted` re-attaches the
//!   restored process by itself).
//! - `attach PID`: guard PID (restored by another tool, or after a `detach`).
//! - `release GPU-UUID i-understand-this-may-wedge-the-host`: close the pins on that GPU and
//!   lift its quarantine. The confirmation word is part of the protocol so that no client can
//!   close pins by accident.
//!
//! # Limitations
//! The server handles one connection at a time (each request is short).

use std::io::{self, BufRead, BufReader, Write};
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use cryo_state::StateDir;
use serde_json::{json, Value};

use crate::guard::{Guard, GuardStatus};
use crate::Pid;

/// The word `release` requires.
pub const RELEASE_CONFIRMATION: &str = "i-understand-this-may-wedge-the-host";

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
    std::thread::Builder::new()
        .name("cryo-guard-control".into())
        .spawn(move || {
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => {
                        if let Err(err) = handle(&guard, s) {
                            tracing::debug!(%err, "control client went away");
                        }
                    }
                    Err(err) => tracing::warn!(%err, "control socket accept failed"),
                }
            }
        })
        .map_err(listen_err)?;
    Ok(())
}

fn handle(guard: &Guard, mut s: UnixStream) -> io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    let uid = rustix::net::sockopt::get_socket_peercred(&s).map(|c| c.uid.as_raw());
    let answer = match uid {
        Ok(0) => {
            let mut line = String::new();
            BufReader::new(&s).read_line(&mut line)?;
            answer(guard, line.trim())
        }
        Ok(uid) => {
            json!({"ok": false, "error": format!("only root may control the guard (peer uid {uid})")})
        }
        Err(e) => json!({"ok": false, "error": format!("no peer credentials: {e}")}),
    };
    writeln!(s, "{answer}")
}

fn answer(guard: &Guard, line: &str) -> Value {
    let words: Vec<&str> = line.split_whitespace().collect();
    let pid = |w: Option<&&str>| w.and_then(|w| w.parse::<Pid>().ok()).filter(|p| *p > 0);
    let fail = |e: String| json!({"ok": false, "error": e});
    match words.first().copied() {
        Some("status") => match serde_json::to_value(guard.status()) {
            Ok(v) => json!({"ok": true, "status": v}),
            Err(e) => fail(e.to_string()),
        },
        Some("detach") => match pid(words.get(1)) {
            Some(p) => match guard.detach(p) {
                Ok(()) => json!({"ok": true, "detached": p}),
                Err(e) => fail(e.to_string()),
            },
            None => fail("usage: detach PID".into()),
        },
        Some("attach") => match pid(words.get(1)) {
            Some(p) => match guard.attach_pid(p) {
                Ok(id) => json!({"ok": true, "attached": id.pid, "start_time": id.start_time}),
                Err(e) => fail(e.to_string()),
            },
            None => fail("usage: attach PID".into()),
        },
        Some("release") => match (words.get(1), words.get(2)) {
            (Some(gpu), Some(&RELEASE_CONFIRMATION)) => match guard.release(gpu) {
                Ok(ids) => json!({"ok": true, "released": ids.iter().map(|i| i.pid).collect::<Vec<_>>()}),
                Err(e) => fail(e.to_string()),
            },
            _ => fail(format!("usage: release GPU-UUID {RELEASE_CONFIRMATION}")),
        },
        _ => fail(format!("unknown request {line:?} (status, attach PID, detach PID, release GPU-UUID {RELEASE_CONFIRMATION})")),
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
    /// The guard answered something that is not JSON.
    #[error("the guard answered {0:?}")]
    BadAnswer(String),
    /// The guard refused or failed.
    #[error("the guard says: {0}")]
    Refused(String),
}

/// Sends one request line to the guard of `state`; its JSON answer when `ok`.
pub fn request(state: &StateDir, line: &str) -> Result<Value, ControlError> {
    let path = state.guard_socket();
    let mut s = UnixStream::connect(&path).map_err(|e| match e.kind() {
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
    writeln!(s, "{line}").map_err(io_err)?;
    let mut answer = String::new();
    BufReader::new(&s).read_line(&mut answer).map_err(io_err)?;
    let v: Value =
        serde_json::from_str(answer.trim()).map_err(|_| ControlError::BadAnswer(answer.clone()))?;
    if v["ok"].as_bool() == Some(true) {
        Ok(v)
    } else {
        Err(ControlError::Refused(
            v["error"].as_str().unwrap_or("unknown error").to_string(),
        ))
    }
}

/// The running guard's status; `Ok(None)` when no guard runs.
pub fn status(state: &StateDir) -> Result<Option<GuardStatus>, ControlError> {
    match request(state, "status") {
        Ok(v) => serde_json::from_value(v["status"].clone())
            .map(Some)
            .map_err(|e| ControlError::BadAnswer(e.to_string())),
        Err(ControlError::NotRunning(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Asks the guard to stop watching `pid` (before `criu dump`). `Ok(false)`: no guard runs, so
/// nothing traces it.
pub fn detach(state: &StateDir, pid: Pid) -> Result<bool, ControlError> {
    match request(state, &format!("detach {pid}")) {
        Ok(_) => Ok(true),
        Err(ControlError::NotRunning(_)) => Ok(false),
        // Not traced by the guard: nothing to do for the dump either.
        Err(ControlError::Refused(e)) if e.contains("is not traced") => Ok(true),
        Err(e) => Err(e),
    }
}

/// Asks the guard to watch `pid` again (after a failed or dumped-and-kept freeze).
pub fn attach(state: &StateDir, pid: Pid) -> Result<bool, ControlError> {
    match request(state, &format!("attach {pid}")) {
        Ok(_) => Ok(true),
        Err(ControlError::NotRunning(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Asks the guard to close the pins on `gpu`; the pids released.
pub fn release(state: &StateDir, gpu: &str) -> Result<Vec<Pid>, ControlError> {
    let v = request(state, &format!("release {gpu} {RELEASE_CONFIRMATION}"))?;
    Ok(v["released"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|p| p.as_i64())
                .filter_map(|p| Pid::try_from(p).ok())
                .collect()
        })
        .unwrap_or_default())
}
