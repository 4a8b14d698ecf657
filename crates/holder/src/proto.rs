//! The holder's protocol: typed messages, one JSON document per `SOCK_SEQPACKET` message, with
//! the pinned fds attached to the message that names them (`SCM_RIGHTS`).
//!
//! # Design
//! - **Framing by the kernel.** A seqpacket socket delivers whole messages, and the fds sent with
//!   a message arrive with exactly that message, so there is no partial frame and no fd that
//!   belongs to no message. A message is at most [`MAX_MESSAGE`] bytes and carries at most
//!   [`MAX_FDS`] fds (the kernel's `SCM_MAX_FD` is 253); a pin with more fds is sent as several
//!   [`Request::Hold`]s of the same process, which the holder merges.
//! - **Versioned.** The holder speaks first: [`Reply::Hello`] carries [`PROTOCOL`]. A holder of a
//!   newer protocol keeps answering every request of the older ones (requests are only ever
//!   added, never changed), so a client adopts any holder of protocol `>=`
//!   [`OLDEST_PROTOCOL`] and sends it only the requests of the smaller of the two protocols.
//!   A request the holder does not know is answered with [`Refusal::BadRequest`]; the connection
//!   stays open and nothing held changes.
//! - **Nothing received is ever dropped.** Fds that arrive with a request that cannot be read
//!   are held all the same, as a pin on [`FencedGpu::Unknown`] (which fences every GPU), and the
//!   refusal says how many were kept.

use std::io::{self, IoSlice, IoSliceMut};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use cryo_journal::ProcId;
use cryo_state::fence::FencedGpu;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use serde::{Deserialize, Serialize};

/// This build's protocol version.
pub const PROTOCOL: u32 = 1;
/// The oldest holder protocol this build's client adopts.
pub const OLDEST_PROTOCOL: u32 = 1;
/// The largest message, in bytes (well under the socket's default send buffer). Lists of pins
/// are sent in as many messages as they need ([`chunks`]).
pub const MAX_MESSAGE: usize = 64 << 10;
/// How many bytes of pins one message of a list carries at most.
const CHUNK_BYTES: usize = 32 << 10;
/// The most fds one message carries (the kernel refuses more than 253 per `SCM_RIGHTS`).
pub const MAX_FDS: usize = 250;

/// A request to the holder.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "request", rename_all = "snake_case")]
pub enum Request {
    /// The holder and every pin it holds.
    Inventory,
    /// Hold the fds attached to this message. Answered with [`Reply::Held`] once they are in the
    /// holder's table.
    Hold {
        /// Whose fds they are.
        pin: PinMeta,
    },
    /// Close every pin on `gpu` (the operator's release).
    Release {
        /// The GPU (or the entry for pins whose GPU is unknown).
        gpu: FencedGpu,
        /// Says the caller knows what closing pins does.
        confirm: Confirmation,
    },
    /// From a new holder taking over (an upgrade of the holder itself): send every pin, with
    /// its fds, as [`Reply::Handing`] messages, then [`Reply::HandedAll`]; keep them all until
    /// [`Request::TookAll`], then exit.
    HandOver,
    /// The new holder holds every pin the handover sent.
    TookAll {
        /// How many pins it took (must be every one sent).
        pins: usize,
    },
    /// Exit, if nothing is held.
    Exit,
}

/// The only value a release accepts: closing pins lets the driver tear down a live restored
/// context, which wedges affected hosts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Confirmation {
    /// `i-understand-this-may-wedge-the-host`.
    #[serde(rename = "i-understand-this-may-wedge-the-host")]
    MayWedgeTheHost,
}

/// What the holder says.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// First message on every connection.
    Hello {
        /// Who answers.
        holder: HolderInfo,
    },
    /// To [`Request::Inventory`], in as many messages as the pins need.
    Inventory {
        /// Who answers.
        holder: HolderInfo,
        /// Pins held (this message's share).
        pins: Vec<HeldPin>,
        /// Another `Inventory` message follows.
        more: bool,
    },
    /// To [`Request::Hold`]: the fds are held.
    Held {
        /// The pin they are part of.
        pin: HeldPin,
        /// How many fds arrived with this message.
        received: usize,
    },
    /// To [`Request::Release`]: these pins were closed (in as many messages as they need).
    Released {
        /// The pins closed (this message's share).
        pins: Vec<HeldPin>,
        /// Another `Released` message follows.
        more: bool,
    },
    /// During a handover: one pin, its fds attached.
    Handing {
        /// The pin.
        pin: HeldPin,
    },
    /// During a handover: every pin was sent.
    HandedAll {
        /// How many.
        pins: usize,
    },
    /// To [`Request::Exit`].
    Exiting,
    /// The request was not carried out.
    Refused {
        /// Why.
        refusal: Refusal,
    },
}

/// Why the holder did not carry out a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Refusal {
    /// Only root may talk to the holder.
    #[error("only root may talk to the pin holder (peer uid {uid})")]
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
    /// The request could not be read (or is of a newer protocol). Fds that came with it are
    /// held anyway, on the unknown GPU.
    #[error(
        "bad request ({error}); {kept_fds} fd(s) that came with it are held on the unknown GPU"
    )]
    BadRequest {
        /// The parser's complaint.
        error: String,
        /// Fds that came with it and are held.
        kept_fds: usize,
    },
    /// A hold without fds.
    #[error("a hold request came without fds")]
    NoFds,
    /// The holder is handing its pins to a new holder: ask again in a moment (the new one
    /// answers on the same socket).
    #[error("the pin holder is handing its pins over to a new holder; retry")]
    HandingOver,
    /// Nothing is held for that GPU.
    #[error("the pin holder holds nothing on {gpu}")]
    NotHeld {
        /// The GPU.
        gpu: FencedGpu,
    },
    /// Exit refused: pins are held.
    #[error("the pin holder holds {pins} pin(s); it exits only once they are released")]
    HoldsPins {
        /// How many.
        pins: usize,
    },
    /// Too many clients at once.
    #[error("the pin holder serves {max} clients at most; retry")]
    Busy {
        /// The limit.
        max: usize,
    },
    /// Not a request this connection may make here.
    #[error("{error}")]
    Unexpected {
        /// What was wrong.
        error: String,
    },
}

/// Whose fds a [`Request::Hold`] carries.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinMeta {
    /// The dead process whose driver fds these are.
    pub pid: ProcId,
    /// The GPUs its context is on ([`FencedGpu::Unknown`]: could not tell).
    pub gpus: Vec<FencedGpu>,
    /// The fd numbers in the dead process, in the order the fds are attached.
    pub fds: Vec<i32>,
    /// How it died (`killed by SIGKILL`).
    pub cause: String,
    /// Who handed them over (`cryo guard pid 12`), for the log and the inventory.
    pub from: String,
}

/// One pin as the holder keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldPin {
    /// Numbered by the holder that first took it (kept across handovers).
    pub id: u64,
    /// Whose fds, as handed over (every chunk's fd numbers together).
    #[serde(flatten)]
    pub meta: PinMeta,
    /// How many fds are held.
    pub held: usize,
    /// When the first fd of it was taken (Unix seconds).
    pub since_unix: u64,
}

impl HeldPin {
    /// Whether releasing `gpu` closes this pin.
    pub fn on(&self, gpu: &FencedGpu) -> bool {
        self.meta.gpus.contains(gpu)
    }
}

/// The holder process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HolderInfo {
    /// Its pid and start time.
    pub id: ProcId,
    /// Its protocol ([`PROTOCOL`] of the build it runs).
    pub protocol: u32,
    /// cryo's version it was built from.
    pub version: String,
    /// When it started (Unix seconds).
    pub started_unix: u64,
    /// Its `oom_score_adj`, or why -1000 could not be set.
    pub oom_score_adj: String,
    /// The cgroup it moved into, or why it stayed where it was started.
    pub cgroup: String,
    /// How many pins it holds.
    pub pins: usize,
}

/// A message read off the socket: its bytes and the fds that came with it.
#[derive(Debug)]
pub struct Received {
    /// The message (at most [`MAX_MESSAGE`] bytes).
    pub bytes: Vec<u8>,
    /// Fds that came with it (close-on-exec).
    pub fds: Vec<OwnedFd>,
    /// The message was longer than [`MAX_MESSAGE`] (cut).
    pub truncated: bool,
    /// The kernel could not pass every fd (the receiver's fd limit): some were lost.
    pub fds_cut: bool,
}

/// Splits a list of pins into the shares of consecutive messages (at least one, maybe empty).
pub fn chunks(pins: Vec<HeldPin>) -> Vec<Vec<HeldPin>> {
    let mut out = vec![Vec::new()];
    let mut bytes = 0;
    for pin in pins {
        let size = serde_json::to_vec(&pin).map_or(CHUNK_BYTES, |v| v.len());
        if bytes + size > CHUNK_BYTES && !out.last().is_none_or(Vec::is_empty) {
            out.push(Vec::new());
            bytes = 0;
        }
        bytes += size;
        if let Some(last) = out.last_mut() {
            last.push(pin);
        }
    }
    out
}

/// Sends `msg` with `fds` attached, as one message.
pub fn send<T: Serialize>(sock: impl AsFd, msg: &T, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    if fds.len() > MAX_FDS {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} fds in one message (at most {MAX_FDS})", fds.len()),
        ));
    }
    let bytes = serde_json::to_vec(msg).map_err(io::Error::other)?;
    if bytes.len() > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("message of {} bytes (at most {MAX_MESSAGE})", bytes.len()),
        ));
    }
    let mut space = [0u8; rustix::cmsg_space!(ScmRights(MAX_FDS))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
        return Err(io::Error::other("ancillary buffer too small"));
    }
    let sent = rustix::net::sendmsg(
        sock,
        &[IoSlice::new(&bytes)],
        &mut control,
        SendFlags::NOSIGNAL,
    )?;
    if sent != bytes.len() {
        return Err(io::Error::new(
            io::ErrorKind::WriteZero,
            format!("sent {sent} of {} bytes", bytes.len()),
        ));
    }
    Ok(())
}

/// Receives one message; `None` at the end of the stream. `buf` is reused between calls.
pub fn recv(sock: impl AsFd, buf: &mut Vec<u8>) -> io::Result<Option<Received>> {
    buf.resize(MAX_MESSAGE, 0);
    let mut space = [0u8; rustix::cmsg_space!(ScmRights(MAX_FDS + 3))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let ret = loop {
        match rustix::net::recvmsg(
            &sock,
            &mut [IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Err(rustix::io::Errno::INTR) => continue,
            other => break other?,
        }
    };
    // Every fd that came is taken out of the buffer (a fd left there is closed with it).
    let mut fds = Vec::new();
    for msg in control.drain() {
        if let RecvAncillaryMessage::ScmRights(rights) = msg {
            fds.extend(rights);
        }
    }
    let flags = ret.flags.bits();
    if ret.bytes == 0 && fds.is_empty() {
        return Ok(None);
    }
    let truncated = flags & RecvFlags::TRUNC.bits() != 0;
    let fds_cut = flags & (libc::MSG_CTRUNC as u32) != 0;
    Ok(Some(Received {
        bytes: buf[..ret.bytes.min(MAX_MESSAGE)].to_vec(),
        fds,
        truncated,
        fds_cut,
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn seqpacket_pair() -> (OwnedFd, OwnedFd) {
        rustix::net::socketpair(
            rustix::net::AddressFamily::UNIX,
            rustix::net::SocketType::SEQPACKET,
            rustix::net::SocketFlags::CLOEXEC,
            None,
        )
        .unwrap()
    }

    #[test]
    fn messages_are_tagged_json() {
        let pin = PinMeta {
            pid: ProcId::new(12, 34),
            gpus: vec![FencedGpu::Unknown],
            fds: vec![3, 4],
            cause: "killed by SIGKILL".into(),
            from: "test".into(),
        };
        let text = serde_json::to_string(&Request::Hold { pin: pin.clone() }).unwrap();
        assert_eq!(
            text,
            r#"{"request":"hold","pin":{"pid":{"pid":12,"start_time":34},"gpus":["unknown"],"fds":[3,4],"cause":"killed by SIGKILL","from":"test"}}"#
        );
        assert_eq!(
            serde_json::from_str::<Request>(&text).unwrap(),
            Request::Hold { pin }
        );
        for bad in [
            r#"{"request":"release","gpu":"unknown"}"#,
            r#"{"request":"release","gpu":"unknown","confirm":"yes"}"#,
            r#"{"request":"launch_missiles"}"#,
            "",
        ] {
            assert!(serde_json::from_str::<Request>(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn fds_travel_with_their_message_and_a_message_is_whole() {
        let (a, b) = seqpacket_pair();
        let (r, w) = rustix::pipe::pipe().unwrap();
        send(&a, &Request::Inventory, &[w.as_fd(), r.as_fd()]).unwrap();
        send(&a, &Request::Exit, &[]).unwrap();
        drop(a);
        let mut buf = Vec::new();
        let first = recv(&b, &mut buf).unwrap().unwrap();
        assert_eq!(first.fds.len(), 2);
        assert!(!first.truncated && !first.fds_cut);
        assert_eq!(
            serde_json::from_slice::<Request>(&first.bytes).unwrap(),
            Request::Inventory
        );
        let second = recv(&b, &mut buf).unwrap().unwrap();
        assert!(second.fds.is_empty());
        assert_eq!(
            serde_json::from_slice::<Request>(&second.bytes).unwrap(),
            Request::Exit
        );
        assert!(recv(&b, &mut buf).unwrap().is_none(), "end of stream");
    }

    #[test]
    fn long_lists_are_cut_into_messages_that_fit() {
        let pin = |id| HeldPin {
            id,
            meta: PinMeta {
                pid: ProcId::new(1, 1),
                gpus: vec![FencedGpu::Unknown],
                fds: (0..250).collect(),
                cause: "killed by SIGKILL".into(),
                from: "test".into(),
            },
            held: 250,
            since_unix: 0,
        };
        assert_eq!(chunks(Vec::new()), vec![Vec::<HeldPin>::new()]);
        let pins: Vec<HeldPin> = (0..200).map(pin).collect();
        let parts = chunks(pins.clone());
        assert!(parts.len() > 1);
        assert_eq!(parts.concat(), pins);
        let (a, b) = seqpacket_pair();
        for (i, part) in parts.into_iter().enumerate() {
            let reply = Reply::Released {
                pins: part,
                more: i > 0,
            };
            send(&a, &reply, &[]).unwrap();
            let mut buf = Vec::new();
            let got = recv(&b, &mut buf).unwrap().unwrap();
            assert_eq!(serde_json::from_slice::<Reply>(&got.bytes).unwrap(), reply);
        }
    }

    #[test]
    fn too_many_fds_or_bytes_are_refused_before_sending() {
        let (a, _b) = seqpacket_pair();
        let fds: Vec<BorrowedFd<'_>> = (0..=MAX_FDS).map(|_| a.as_fd()).collect();
        assert!(send(&a, &Request::Inventory, &fds).is_err());
        let huge = PinMeta {
            pid: ProcId::new(1, 1),
            gpus: vec![],
            fds: vec![],
            cause: "x".repeat(MAX_MESSAGE),
            from: String::new(),
        };
        assert!(send(&a, &Request::Hold { pin: huge }, &[]).is_err());
    }
}
