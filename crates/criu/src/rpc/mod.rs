//! The `criu swrk` transport: one request, its notifications, one answer, over a `SOCK_SEQPACKET`
//! socketpair whose other end is the worker's standard input.
//!
//! # Design
//! The message types in `generated.rs` are prost's output for CRIU 4.1.1's `images/rpc.proto`
//! (vendored as `proto/rpc.proto`, MIT), committed so the build needs neither `protoc` nor a
//! proto compiler crate. Regenerate with `prost-build` 0.14 + `protox` 0.9:
//! `protox::compile(["rpc.proto"], ["proto"])` then `prost_build::Config::compile_fds`.
//!
//! The worker's end of the socketpair is handed over as its stdin (`criu swrk 0`): std gives a
//! child its stdio without `O_CLOEXEC` and everything else with it, so no other fd leaks into
//! CRIU and no `pre_exec` hook is needed.

#[allow(clippy::all, missing_docs, missing_debug_implementations)]
mod generated;

use std::fs::File;
use std::io::{Read, Seek};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::process::{Child, Command, Stdio};

use nix::sys::socket::{recv, send, socketpair, AddressFamily, MsgFlags, SockFlag, SockType};
use prost::Message;

pub(crate) use generated::{CriuOpts, CriuReq, CriuReqType, CriuResp};

/// Why one exchange with `criu swrk` broke (before CRIU could answer success or failure).
#[derive(Debug, thiserror::Error)]
pub enum RpcError {
    /// The socketpair could not be made.
    #[error("socketpair for criu swrk: {0}")]
    Socket(#[source] nix::Error),
    /// `criu swrk` could not be started.
    #[error("cannot start {path} swrk: {source}")]
    Spawn {
        /// The binary.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Sending the request or an acknowledgement failed.
    #[error("sending to criu swrk: {0}")]
    Send(#[source] nix::Error),
    /// Receiving an answer failed.
    #[error("receiving from criu swrk: {0}")]
    Recv(#[source] nix::Error),
    /// CRIU closed the socket without answering; `stderr` is what it printed.
    #[error("criu swrk exited without answering ({status}){}", fmt_stderr(.stderr))]
    NoAnswer {
        /// Its exit status.
        status: String,
        /// The tail of its stderr.
        stderr: String,
    },
    /// An answer that does not decode.
    #[error("undecodable answer from criu swrk: {0}")]
    Decode(#[from] prost::DecodeError),
    /// An answer of another type than the request.
    #[error("criu swrk answered a {got} request to a {sent} request")]
    Mismatch {
        /// The request type sent.
        sent: &'static str,
        /// The type in the answer.
        got: String,
    },
}

fn fmt_stderr(s: &str) -> String {
    if s.is_empty() {
        String::new()
    } else {
        format!(": {s}")
    }
}

/// One `criu swrk` worker serving one request.
pub(crate) struct Swrk {
    sock: OwnedFd,
    child: Child,
    stderr: File,
    /// CRIU's plugin directory for this worker: empty (see [`Swrk::start`]).
    _no_plugins: tempfile::TempDir,
}

impl Swrk {
    /// Starts `bin swrk 0`. `lib_dir` goes first in the worker's `LD_LIBRARY_PATH` (a carried
    /// CRIU with its libraries beside it).
    pub(crate) fn start(bin: &Path, lib_dir: Option<&Path>) -> Result<Self, RpcError> {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::SeqPacket,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(RpcError::Socket)?;
        let spawn_err = |source| RpcError::Spawn {
            path: bin.display().to_string(),
            source,
        };
        // An unnamed file: CRIU's stderr is read back after it exits, without a reader thread.
        let stderr = tempfile::tempfile().map_err(spawn_err)?;
        let mut cmd = Command::new(bin);
        crate::image::default_sigchld(&mut cmd);
        cmd.arg("swrk")
            .arg("0")
            .stdin(Stdio::from(theirs))
            .stdout(Stdio::null())
            .stderr(Stdio::from(stderr.try_clone().map_err(spawn_err)?));
        // No CRIU plugins: cryo does the CUDA part itself. CRIU's cuda plugin, installed in CRIU's
        // default directory on a GPU host, would otherwise act on every CUDA process of cryo's
        // dumps and, at restore, restore and unlock each one with no GPU map and before cryo has
        // journaled the restore. CRIU reads its plugin directory from this variable (RPC has no
        // option for it); an empty directory loads none.
        let no_plugins = tempfile::tempdir().map_err(spawn_err)?;
        cmd.env("CRIU_LIBS_DIR", no_plugins.path());
        if let Some(dir) = lib_dir {
            let mut path = dir.as_os_str().to_owned();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                path.push(":");
                path.push(old);
            }
            cmd.env("LD_LIBRARY_PATH", path);
        }
        let child = cmd.spawn().map_err(spawn_err)?;
        // `cmd` held the worker's end; dropping it leaves CRIU the only holder, so its exit is EOF.
        drop(cmd);
        Ok(Swrk {
            sock: ours,
            child,
            stderr,
            _no_plugins: no_plugins,
        })
    }

    /// Sends `req` and returns CRIU's answer of the same type, acknowledging any notifications
    /// (cryo asks for no notify scripts, so each is answered "go on").
    pub(crate) fn call(self, req: &CriuReq) -> Result<CriuResp, RpcError> {
        let sent = CriuReqType::try_from(req.r#type)
            .map(|t| t.as_str_name())
            .unwrap_or("?");
        send(
            self.sock.as_raw_fd(),
            &req.encode_to_vec(),
            MsgFlags::empty(),
        )
        .map_err(RpcError::Send)?;
        loop {
            let Some(buf) = self.recv()? else {
                return Err(self.no_answer());
            };
            let resp = CriuResp::decode(buf.as_slice())?;
            if resp.r#type == CriuReqType::Notify as i32 {
                let ack = CriuReq {
                    r#type: CriuReqType::Notify as i32,
                    notify_success: Some(true),
                    ..Default::default()
                };
                send(
                    self.sock.as_raw_fd(),
                    &ack.encode_to_vec(),
                    MsgFlags::empty(),
                )
                .map_err(RpcError::Send)?;
                continue;
            }
            if resp.r#type != req.r#type {
                let got = CriuReqType::try_from(resp.r#type)
                    .map(|t| t.as_str_name().to_string())
                    .unwrap_or_else(|_| resp.r#type.to_string());
                self.finish();
                return Err(RpcError::Mismatch { sent, got });
            }
            self.finish();
            return Ok(resp);
        }
    }

    /// One datagram, sized by peeking; `None` at EOF.
    fn recv(&self) -> Result<Option<Vec<u8>>, RpcError> {
        let fd = self.sock.as_raw_fd();
        let len = loop {
            match recv(fd, &mut [], MsgFlags::MSG_PEEK | MsgFlags::MSG_TRUNC) {
                Err(nix::Error::EINTR) => continue,
                r => break r.map_err(RpcError::Recv)?,
            }
        };
        if len == 0 {
            return Ok(None);
        }
        let mut buf = vec![0u8; len];
        let n = loop {
            match recv(fd, &mut buf, MsgFlags::empty()) {
                Err(nix::Error::EINTR) => continue,
                r => break r.map_err(RpcError::Recv)?,
            }
        };
        buf.truncate(n);
        Ok(Some(buf))
    }

    /// Closes our end (CRIU exits on EOF) and reaps the worker.
    fn finish(mut self) {
        drop(self.sock);
        if let Err(err) = self.child.wait() {
            tracing::warn!(%err, "cannot reap criu swrk");
        }
    }

    fn no_answer(mut self) -> RpcError {
        let status = match self.child.wait() {
            Ok(s) => s.to_string(),
            Err(e) => format!("not reaped: {e}"),
        };
        let mut text = String::new();
        let _ = self.stderr.rewind();
        let _ = self.stderr.read_to_string(&mut text);
        let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
        let tail = lines[lines.len().saturating_sub(5)..].join(" | ");
        RpcError::NoAnswer {
            status,
            stderr: tail,
        }
    }
}
