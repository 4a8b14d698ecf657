//! The client side: what the guard (in the agent or in `cryo guard`) and the CLI ask the holder.
//!
//! # Design
//! One [`Session`] is one connection: the holder's [`Reply::Hello`] is read and checked first
//! (the holder runs as root, and speaks a protocol this build adopts), then requests are sent
//! one at a time. A client only ever speaks requests of protocol 1 so far; when a later protocol
//! adds requests, [`Session::protocol`] says which ones the holder understands.
//!
//! [`Session::hold`] keeps the caller's copies of the fds untouched: the caller closes them only
//! once this returns `Ok` (the holder has acknowledged that it holds every fd sent), so at every
//! instant the caller's copies or the holder's hold the files open. Pins with more than
//! [`MAX_FDS`] fds go in several messages, each acknowledged.

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
use serde::Serialize;

use crate::proto::{
    self, Confirmation, HeldPin, HolderInfo, PinMeta, Refusal, Reply, Request, MAX_FDS,
    OLDEST_PROTOCOL,
};

/// How long a client waits for any one answer.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// Talking to the holder failed.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nothing answers on the socket (no holder runs, or one is between handing over and
    /// taking over).
    #[error("no pin holder answers on {0}")]
    NotRunning(PathBuf),
    /// The holder took the connection and closed it before its greeting: it is exiting (the
    /// connection was still queued when it exited, after an `exit` or a handover).
    #[error("the pin holder on {0} closed the connection before its greeting: it is exiting")]
    Exiting(PathBuf),
    /// The exchange failed.
    #[error("talking to the pin holder on {path} failed: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The process answering is not root: it is not given pins.
    #[error(
        "the process answering on {path} runs as uid {uid}, not root: not a pin holder to trust"
    )]
    NotRoot {
        /// The socket.
        path: PathBuf,
        /// Its uid.
        uid: u32,
    },
    /// The holder speaks a protocol older than this build adopts.
    #[error("the pin holder (pid {pid}, cryo {version}) speaks protocol {protocol}; this cryo needs {OLDEST_PROTOCOL} or later")]
    TooOld {
        /// Its pid.
        pid: i32,
        /// Its cryo version.
        version: String,
        /// Its protocol.
        protocol: u32,
    },
    /// The holder answered something that is not a reply.
    #[error("the pin holder answered {answer:?}: {error}")]
    BadReply {
        /// What it answered.
        answer: String,
        /// The parser's complaint.
        error: String,
    },
    /// The holder answered, but not to the question asked.
    #[error("the pin holder answered {0:?} to a {1} request")]
    Unexpected(Box<Reply>, &'static str),
    /// The holder refused.
    #[error("the pin holder says: {0}")]
    Refused(Refusal),
    /// The holder received fewer fds than were sent (the rest are still the caller's).
    #[error("the pin holder received {received} of {sent} fd(s)")]
    Incomplete {
        /// Sent.
        sent: usize,
        /// Received.
        received: usize,
    },
}

/// The holder of one state directory (nothing is touched until a call).
#[derive(Debug, Clone)]
pub struct HolderClient {
    socket: PathBuf,
}

impl HolderClient {
    /// The client of the holder of `state`.
    pub fn new(state: &StateDir) -> Self {
        Self {
            socket: state.pin_holder_socket(),
        }
    }

    /// The socket.
    pub fn socket(&self) -> &std::path::Path {
        &self.socket
    }

    /// Connects and reads the holder's hello.
    pub fn connect(&self) -> Result<Session, ClientError> {
        let path = &self.socket;
        let io_err = |source: io::Error| ClientError::Io {
            path: path.clone(),
            source,
        };
        let sock = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| io_err(e.into()))?;
        let addr = SocketAddrUnix::new(path).map_err(|e| io_err(e.into()))?;
        match rustix::net::connect_unix(&sock, &addr) {
            Ok(()) => {}
            Err(rustix::io::Errno::NOENT | rustix::io::Errno::CONNREFUSED) => {
                return Err(ClientError::NotRunning(path.clone()))
            }
            Err(e) => return Err(io_err(e.into())),
        }
        let cred =
            rustix::net::sockopt::get_socket_peercred(&sock).map_err(|e| io_err(e.into()))?;
        if !cred.uid.is_root() && cred.uid != rustix::process::geteuid() {
            return Err(ClientError::NotRoot {
                path: path.clone(),
                uid: cred.uid.as_raw(),
            });
        }
        use rustix::net::sockopt::{set_socket_timeout, Timeout};
        set_socket_timeout(&sock, Timeout::Recv, Some(ANSWER_TIMEOUT))
            .and_then(|()| set_socket_timeout(&sock, Timeout::Send, Some(ANSWER_TIMEOUT)))
            .map_err(|e| io_err(e.into()))?;
        let mut session = Session {
            sock,
            path: path.clone(),
            buf: Vec::new(),
            holder: placeholder(),
        };
        let Some((hello, _)) = session.recv_raw()? else {
            return Err(ClientError::Exiting(path.clone()));
        };
        match hello {
            Reply::Hello { holder } => {
                if holder.protocol < OLDEST_PROTOCOL {
                    return Err(ClientError::TooOld {
                        pid: holder.id.pid,
                        version: holder.version,
                        protocol: holder.protocol,
                    });
                }
                session.holder = holder;
                Ok(session)
            }
            Reply::Refused { refusal } => Err(ClientError::Refused(refusal)),
            other => Err(ClientError::Unexpected(Box::new(other), "hello")),
        }
    }

    /// [`HolderClient::connect`], trying again while nothing answers or the holder is busy, for
    /// up to `within` (a holder hands over to its successor in milliseconds).
    pub fn connect_within(&self, within: Duration) -> Result<Session, ClientError> {
        let start = Instant::now();
        loop {
            match self.connect() {
                Err(
                    ClientError::NotRunning(_)
                    | ClientError::Exiting(_)
                    | ClientError::Refused(Refusal::Busy { .. } | Refusal::HandingOver),
                ) if start.elapsed() < within => std::thread::sleep(Duration::from_millis(10)),
                other => return other,
            }
        }
    }

    /// [`HolderClient::connect`]; when nothing answers on a socket that exists (a holder between
    /// handing over and its successor's taking the socket, or a stale socket of a dead holder),
    /// or the holder is busy, tries again for up to `within`. For questions whose "no holder"
    /// answer is acted on (a release lifts the fence; a guard's start journals lost pins).
    pub fn connect_patiently(&self, within: Duration) -> Result<Session, ClientError> {
        match self.connect() {
            Err(ClientError::NotRunning(_)) if self.socket.exists() => self.connect_within(within),
            Err(
                ClientError::Exiting(_)
                | ClientError::Refused(Refusal::Busy { .. } | Refusal::HandingOver),
            ) => self.connect_within(within),
            other => other,
        }
    }

    /// The holder and its pins; `Ok(None)` when no holder runs.
    pub fn inventory(&self) -> Result<Option<(HolderInfo, Vec<HeldPin>)>, ClientError> {
        match self.connect() {
            Ok(mut s) => s.inventory().map(Some),
            Err(ClientError::NotRunning(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }
}

fn placeholder() -> HolderInfo {
    HolderInfo {
        id: cryo_journal::ProcId::new(0, 0),
        protocol: 0,
        version: String::new(),
        started_unix: 0,
        oom_score_adj: String::new(),
        cgroup: String::new(),
        pins: 0,
    }
}

/// One connection to the holder.
#[derive(Debug)]
pub struct Session {
    sock: OwnedFd,
    path: PathBuf,
    buf: Vec<u8>,
    /// The holder, as its hello said.
    pub holder: HolderInfo,
}

impl Session {
    fn io_err(&self, source: io::Error) -> ClientError {
        ClientError::Io {
            path: self.path.clone(),
            source,
        }
    }

    /// The protocol both sides speak.
    pub fn protocol(&self) -> u32 {
        self.holder.protocol.min(proto::PROTOCOL)
    }

    /// Sends one message (with fds attached).
    pub fn send<T: Serialize>(&self, msg: &T, fds: &[BorrowedFd<'_>]) -> Result<(), ClientError> {
        proto::send(&self.sock, msg, fds).map_err(|e| self.io_err(e))
    }

    /// Receives one reply and the fds that came with it; `None` at the end of the stream.
    pub fn recv_raw(&mut self) -> Result<Option<(Reply, Vec<OwnedFd>)>, ClientError> {
        let Some(m) = proto::recv(&self.sock, &mut self.buf).map_err(|e| self.io_err(e))? else {
            return Ok(None);
        };
        let reply =
            serde_json::from_slice::<Reply>(&m.bytes).map_err(|e| ClientError::BadReply {
                answer: String::from_utf8_lossy(&m.bytes).into_owned(),
                error: e.to_string(),
            })?;
        Ok(Some((reply, m.fds)))
    }

    /// Receives one reply (no fds expected); the end of the stream is an error.
    pub fn recv(&mut self) -> Result<Reply, ClientError> {
        match self.recv_raw()? {
            Some((r, _)) => Ok(r),
            None => Err(self.io_err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "the pin holder closed the connection",
            ))),
        }
    }

    /// Sends a request and reads the first reply, refusals as errors.
    fn ask(&mut self, request: &Request, fds: &[BorrowedFd<'_>]) -> Result<Reply, ClientError> {
        self.send(request, fds)?;
        match self.recv()? {
            Reply::Refused { refusal } => Err(ClientError::Refused(refusal)),
            r => Ok(r),
        }
    }

    /// Sends the first (or only) part of a hold: `meta` with at most [`MAX_FDS`] fds.
    /// [`Session::held`] reads the acknowledgement.
    pub fn send_hold(&self, meta: &PinMeta, fds: &[BorrowedFd<'_>]) -> Result<(), ClientError> {
        self.send(&Request::Hold { pin: meta.clone() }, fds)
    }

    /// Reads the acknowledgement of a hold of `sent` fds.
    pub fn held(&mut self, sent: usize) -> Result<HeldPin, ClientError> {
        match self.recv()? {
            Reply::Held { pin, received } if received == sent => Ok(pin),
            Reply::Held { received, .. } => Err(ClientError::Incomplete { sent, received }),
            Reply::Refused { refusal } => Err(ClientError::Refused(refusal)),
            other => Err(ClientError::Unexpected(Box::new(other), "hold")),
        }
    }

    /// Hands over the fds of `meta` (`fds[i]` is the dead process's fd `meta.fds[i]`) and returns
    /// once the holder holds every one of them. The caller's fds are untouched either way.
    pub fn hold(&mut self, meta: &PinMeta, fds: &[BorrowedFd<'_>]) -> Result<HeldPin, ClientError> {
        let mut last = None;
        for (i, chunk) in fds.chunks(MAX_FDS).enumerate() {
            let start = i * MAX_FDS;
            let part = PinMeta {
                fds: meta
                    .fds
                    .get(start..start + chunk.len())
                    .map(<[i32]>::to_vec)
                    .unwrap_or_default(),
                ..meta.clone()
            };
            self.send_hold(&part, chunk)?;
            last = Some(self.held(chunk.len())?);
        }
        last.ok_or(ClientError::Refused(Refusal::NoFds))
    }

    /// The holder and every pin it holds.
    pub fn inventory(&mut self) -> Result<(HolderInfo, Vec<HeldPin>), ClientError> {
        let mut all = Vec::new();
        let mut reply = self.ask(&Request::Inventory, &[])?;
        loop {
            match reply {
                Reply::Inventory { holder, pins, more } => {
                    all.extend(pins);
                    if !more {
                        return Ok((holder, all));
                    }
                }
                other => return Err(ClientError::Unexpected(Box::new(other), "inventory")),
            }
            reply = self.recv()?;
        }
    }

    /// Closes every pin on `gpu` (the operator's release); the pins closed.
    pub fn release(&mut self, gpu: &FencedGpu) -> Result<Vec<HeldPin>, ClientError> {
        let mut all = Vec::new();
        let mut reply = self.ask(
            &Request::Release {
                gpu: gpu.clone(),
                confirm: Confirmation::MayWedgeTheHost,
            },
            &[],
        )?;
        loop {
            match reply {
                Reply::Released { pins, more } => {
                    all.extend(pins);
                    if !more {
                        return Ok(all);
                    }
                }
                other => return Err(ClientError::Unexpected(Box::new(other), "release")),
            }
            reply = self.recv()?;
        }
    }

    /// Asks the holder to exit (refused while it holds pins).
    pub fn exit(&mut self) -> Result<(), ClientError> {
        match self.ask(&Request::Exit, &[])? {
            Reply::Exiting => Ok(()),
            other => Err(ClientError::Unexpected(Box::new(other), "exit")),
        }
    }
}
