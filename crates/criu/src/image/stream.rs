//! The thaw's image streamer: cryo serves an image to `criu restore --stream`, and CRIU gets no
//! byte that cryo has not checked against the manifest first.
//!
//! # Design
//! CRIU's image-streamer protocol (`criu/img-streamer.c`, `images/img-streamer.proto`): CRIU
//! connects to `streamer-serve.sock` in its images directory and, for each image file it opens,
//! sends the file's name (a 4-byte length and an `img_streamer_request_entry`); cryo answers
//! whether it exists (`img_streamer_reply_entry`); if it does, CRIU sends the write end of a
//! fresh pipe (`SCM_RIGHTS`, one dummy byte) and reads the file from the read end.
//!
//! cryo answers only for files of the manifest, and fills each pipe from its own memory: every
//! chunk is read from the (trusted, see `trust`) file into a private buffer, hashed, compared
//! with the manifest, and only then written into the pipe. Once a chunk matched, nobody can
//! change what CRIU gets of it; a chunk that does not match is never written: the pipe is
//! closed, CRIU's read ends early and the restore fails before any restored process ran. The
//! image is read once, from disk or page cache, with several chunks read and hashed in parallel
//! ahead of the one CRIU reads.
//!
//! Corruption in a file or a part of one that CRIU never reads must still refuse the image:
//! the [`Server::finish`] gate checks everything not checked yet, and runs from CRIU's
//! `post-restore` action script, after every process of the tree is restored and before any of
//! them is resumed; CRIU aborts the restore (and kills the tree) when the script fails.
//!
//! Once CRIU ended or was killed before a verdict passed (its deadline, its own failure), the
//! restore stops the streamer ([`Server::stop`]): CRIU's connection is shut down and each
//! file's writer returns at once; the chunks are read and hashed on a thread of the deadline
//! layer (`check`'s, counted in `abandoned_checks` while a read of a file system that stopped
//! answering holds it), so a read that never returns is left there and the restore returns at
//! its deadline. (Session 23: with the reads on threads of the restore's own scope, a thaw
//! whose streamer's read of a hung file system never returned never returned either, CRIU
//! killed at its deadline.)
//!
//! # Limitations
//! The gate's check of what CRIU did not read ([`Server::finish`]) reads on the caller's
//! threads: a file system that stops answering then holds the verdict (CRIU waits at its gate,
//! its tree not resumed) until it answers.
//!
//! Each checked chunk is copied into CRIU's pipe (`write`), not handed over with `vmsplice`:
//! handing over the checked buffer's own pages is only safe with fresh pages for every chunk
//! (a reused buffer could change under a pipe that still references it, and a pipe's pages can
//! be spliced on), and fresh pages cost what the copy saves (measured on 1 GiB from the page
//! cache, a reader thread copying out as CRIU does: write 0.46-0.56 s of CPU, vmsplice of fresh
//! pages 0.54-0.74 s, of fresh huge pages 0.54 s; only reused buffers were cheaper, 0.32 s).
//! Measured and not kept either: a 32 MiB pipe instead of 1 MiB (no change), and asking the
//! kernel to read the whole image ahead (`POSIX_FADV_WILLNEED`) for a cold thaw (CRIU's
//! restore took 4.9-5.2 s with it, 3.8-4.7 s without, 1 GiB, alternating).
//! One chunk of a file is the unit held in memory, so formats 1 and 2 (a whole-file SHA-256
//! for files without chunk digests, 64 MiB chunks otherwise) hold up to a whole file, or 64 MiB
//! per chunk in flight, in memory while it is served; format 3 holds 4 MiB chunks.

use std::fs::File;
use std::io::{IoSliceMut, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Mutex};

use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use prost::Message;
use rayon::prelude::*;

use super::hash::{self, Span};
use super::open::{file_spans, Image};
use super::ImageError;

/// The socket CRIU connects to, in the directory given to `criu restore --stream -D`.
pub(crate) const SERVE_SOCKET: &str = "streamer-serve.sock";

/// Chunks read and hashed in parallel ahead of the writer, per file.
const WINDOW: usize = 4;
/// Pipe buffer asked for (F_SETPIPE_SZ); the default 64 KiB costs a context switch per 64 KiB.
pub(super) const PIPE_SIZE: i32 = 1 << 20;
/// Longest file name CRIU may ask for (its own limit is PATH_MAX).
const MAX_REQUEST: u32 = 4096;

/// `img_streamer_request_entry`: the image file CRIU wants (or, dumping, writes).
#[derive(Clone, PartialEq, Message)]
pub(super) struct RequestEntry {
    #[prost(string, required, tag = "1")]
    pub(super) filename: String,
}

/// `img_streamer_reply_entry`: whether it exists.
#[derive(Clone, PartialEq, Message)]
struct ReplyEntry {
    #[prost(bool, required, tag = "1")]
    exists: bool,
}

/// What CRIU asked for.
enum Request {
    /// CRIU closed the connection.
    End,
    /// A file the image does not have (answered as such).
    Absent,
    /// File `.0` of the manifest, to be written into the pipe `.1`.
    Serve(usize, OwnedFd),
}

/// Serves one image to one CRIU restore and keeps track of what was checked.
#[derive(Debug)]
pub(crate) struct Server<'a> {
    image: &'a Image,
    spans: Vec<Vec<Span<'a>>>,
    /// Per file, per span: checked against the manifest during this restore.
    checked: Vec<Vec<AtomicBool>>,
    /// The first reason to refuse the image.
    failure: Mutex<Option<ImageError>>,
    /// Bytes written into CRIU's pipes.
    served: AtomicU64,
    /// Set by [`Server::stop`].
    stopped: AtomicBool,
    /// What [`Server::stop`] wakes: CRIU's connection (shut down) and each file's writer.
    wake: Mutex<Wake>,
}

/// What a stop of the streamer wakes.
#[derive(Debug, Default)]
struct Wake {
    conn: Option<UnixStream>,
    writers: Vec<mpsc::SyncSender<Chunk>>,
}

/// What a file's reader hands its writer.
enum Chunk {
    /// Span `.0` of the file, checked: its bytes.
    Checked(usize, Vec<u8>),
    /// Span `.0` was refused.
    Refused(usize, super::hash::SpanError),
    /// The streamer was stopped ([`Server::stop`]).
    Stopped,
    /// The reader is done (every span sent, one refused, or it panicked).
    End,
}

/// The reader's end of its channel: says [`Chunk::End`] when dropped, however the reader ends
/// (the channel stays open while [`Server::stop`] holds a sender of it).
struct Sending(mpsc::SyncSender<Chunk>);

impl Drop for Sending {
    fn drop(&mut self) {
        let _ = self.0.send(Chunk::End);
    }
}

impl<'a> Server<'a> {
    pub(crate) fn new(image: &'a Image) -> Server<'a> {
        let m = image.manifest();
        let spans: Vec<Vec<Span<'a>>> = (0..m.files.len()).map(|i| file_spans(m, i)).collect();
        let checked = spans
            .iter()
            .map(|s| s.iter().map(|_| AtomicBool::new(false)).collect())
            .collect();
        Server {
            image,
            spans,
            checked,
            failure: Mutex::new(None),
            served: AtomicU64::new(0),
            stopped: AtomicBool::new(false),
            wake: Mutex::new(Wake::default()),
        }
    }

    /// CRIU ended or was killed before a verdict passed: nothing more is served, CRIU's
    /// connection is shut down and every file's writer returns, without waiting for a read
    /// that does not return (left to its thread, see the module docs).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        let mut wake = self.wake.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = &wake.conn {
            let _ = c.shutdown(std::net::Shutdown::Both);
        }
        for w in wake.writers.drain(..) {
            // A full channel: its writer is not waiting, and reads the flag after each chunk.
            let _ = w.try_send(Chunk::Stopped);
        }
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::SeqCst)
    }

    fn stopped_error(&self) -> ImageError {
        ImageError::Stream {
            dir: self.image.path().to_path_buf(),
            reason: "the streamer was stopped: CRIU ended before its gate".into(),
        }
    }

    /// Bytes CRIU was sent.
    pub(crate) fn served_bytes(&self) -> u64 {
        self.served.load(Ordering::Relaxed)
    }

    /// The first reason the image was refused, if any.
    pub(crate) fn failure(&self) -> Option<ImageError> {
        self.failure
            .lock()
            .map(|mut f| f.take())
            .unwrap_or_else(|p| p.into_inner().take())
    }

    fn fail(&self, e: ImageError) {
        tracing::warn!(error = %e, "image refused while CRIU reads it");
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        f.get_or_insert(e);
    }

    fn failed(&self) -> bool {
        self.failure.lock().map_or(true, |f| f.is_some())
    }

    /// Accepts CRIU's connection on `listener` and serves its requests until it closes the
    /// connection; returns once every file being served is done. Returns at once if the
    /// listener is shut down before CRIU connects.
    pub(crate) fn serve(&self, listener: &UnixListener) {
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::debug!(error = %e, "no CRIU connected to the image streamer");
                return;
            }
        };
        {
            let mut wake = self.wake.lock().unwrap_or_else(|p| p.into_inner());
            match conn.try_clone() {
                // Read under the lock [`Server::stop`] takes: stopped before, shut down here.
                Ok(c) if self.is_stopped() => {
                    let _ = c.shutdown(std::net::Shutdown::Both);
                }
                Ok(c) => wake.conn = Some(c),
                Err(e) => tracing::warn!(error = %e, "the streamer cannot be stopped from outside"),
            }
        }
        std::thread::scope(|s| {
            let mut conn = conn;
            loop {
                match self.request(&mut conn) {
                    Ok(Request::End) => return,
                    Ok(Request::Absent) => {}
                    Ok(Request::Serve(i, pipe)) => {
                        s.spawn(move || self.serve_file(i, pipe));
                    }
                    // Stopped: the connection was shut down under the request.
                    Err(_) if self.is_stopped() => return,
                    Err(reason) => {
                        self.fail(ImageError::Stream {
                            dir: self.image.path().to_path_buf(),
                            reason,
                        });
                        return;
                    }
                }
            }
        });
    }

    /// Handles one request.
    fn request(&self, conn: &mut UnixStream) -> Result<Request, String> {
        let Some(req) = read_request(conn)? else {
            return Ok(Request::End);
        };
        // Nothing more is served once the image is refused: CRIU fails on the missing file.
        let index = self
            .image
            .index_of(&req.filename)
            .filter(|_| !self.failed());
        tracing::debug!(file = %req.filename, exists = index.is_some(), "CRIU asks for an image file");
        let reply = ReplyEntry {
            exists: index.is_some(),
        }
        .encode_to_vec();
        let len = u32::try_from(reply.len()).map_err(|_| "reply too long".to_string())?;
        conn.write_all(&len.to_le_bytes())
            .and_then(|()| conn.write_all(&reply))
            .map_err(|e| format!("answering for {}: {e}", req.filename))?;
        let Some(i) = index else {
            return Ok(Request::Absent);
        };
        let pipe = recv_fd(conn.as_raw_fd())
            .map_err(|e| format!("receiving the pipe for {}: {e}", req.filename))?;
        Ok(Request::Serve(i, pipe))
    }

    /// Writes file `i` into `pipe`, one checked chunk at a time.
    fn serve_file(&self, i: usize, pipe: OwnedFd) {
        let _ = nix::fcntl::fcntl(
            pipe.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE),
        );
        match self.try_serve_file(i, File::from(pipe)) {
            Ok(()) => {}
            // Stopped: nothing is said of the image (CRIU ended first; a refusal of a chunk
            // before the stop was said then).
            Err(ImageError::Stream { .. }) if self.is_stopped() => {}
            Err(e) => self.fail(e),
        }
        // Dropping the pipe here: CRIU sees the end of the file (or, after a refusal, a short
        // file and fails).
    }

    fn try_serve_file(&self, i: usize, mut out: File) -> Result<(), ImageError> {
        let (file, _) = self.image.open_file(i)?;
        // The reader's own copies: it runs on a thread of the deadline layer, left there if a
        // read never returns (see the module docs).
        let spans: Vec<(u64, u64, String, bool)> = self.spans[i]
            .iter()
            .map(|s| (s.offset, s.len, s.digest.to_string(), s.last))
            .collect();
        let alg = self.image.alg();
        let (tx, rx) = mpsc::sync_channel::<Chunk>(WINDOW);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        {
            let mut wake = self.wake.lock().unwrap_or_else(|p| p.into_inner());
            if self.is_stopped() {
                return Err(self.stopped_error());
            }
            wake.writers.push(tx.clone());
        }
        let tx = Sending(tx);
        let read = move || {
            for (w, window) in spans.chunks(WINDOW).enumerate() {
                let mut bufs: Vec<Vec<u8>> = window
                    .iter()
                    .map(|_| free_rx.try_recv().unwrap_or_default())
                    .collect();
                let results: Vec<Result<(), hash::SpanError>> = window
                    .par_iter()
                    .zip(bufs.par_iter_mut())
                    .map(|((offset, len, digest, last), buf)| {
                        let span = Span {
                            file: i,
                            offset: *offset,
                            len: *len,
                            digest,
                            last: *last,
                        };
                        hash::read_checked(&file, &span, alg, buf)
                    })
                    .collect();
                for (k, (r, buf)) in results.into_iter().zip(bufs).enumerate() {
                    let at = w * WINDOW + k;
                    let (msg, stop) = match r {
                        Ok(()) => (Chunk::Checked(at, buf), false),
                        Err(e) => (Chunk::Refused(at, e), true),
                    };
                    // The writer stopped (CRIU closed the pipe): nothing more to read.
                    if tx.0.send(msg).is_err() || stop {
                        return;
                    }
                }
            }
        };
        // Dropped when this returns: a read still under way then (CRIU closed the file, or
        // the streamer was stopped) is counted while it lasts.
        let _reader = super::check::on_look_thread(self.image.path(), read)?;
        {
            for msg in rx {
                let buf = match msg {
                    Chunk::Checked(k, buf) => {
                        self.checked[i][k].store(true, Ordering::Relaxed);
                        buf
                    }
                    Chunk::Refused(k, e) => {
                        return Err(self.image.span_error(&self.spans[i][k], e))
                    }
                    Chunk::Stopped => return Err(self.stopped_error()),
                    Chunk::End => break,
                };
                if self.is_stopped() {
                    return Err(self.stopped_error());
                }
                match out.write_all(&buf) {
                    Ok(()) => {
                        self.served.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    }
                    // CRIU read what it needed and closed the file; the rest is checked at
                    // the gate.
                    Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => return Ok(()),
                    Err(e) => {
                        return Err(ImageError::Stream {
                            dir: self.image.path().to_path_buf(),
                            reason: format!(
                                "writing {} to CRIU: {e}",
                                self.image.manifest().files[i].name
                            ),
                        })
                    }
                }
                let _ = free_tx.send(buf);
            }
            Ok(())
        }
    }

    /// The gate before any restored process runs: refuses if anything served was refused, and
    /// checks every chunk of every file that CRIU did not read (all in parallel).
    pub(crate) fn finish(&self) -> Result<(), ImageError> {
        if let Some(e) = self.failure() {
            return Err(e);
        }
        let todo: Vec<&Span<'_>> = self
            .spans
            .iter()
            .zip(&self.checked)
            .flat_map(|(spans, checked)| {
                spans
                    .iter()
                    .zip(checked)
                    .filter(|(_, c)| !c.load(Ordering::Relaxed))
                    .map(|(s, _)| s)
            })
            .collect();
        let owned: Vec<Span<'_>> = todo.into_iter().cloned().collect();
        hash::check_spans(&owned, self.image.alg(), |i| {
            self.image
                .open_file(i)
                .map(|(f, _)| f)
                .map_err(|e| std::io::Error::other(e.to_string()))
        })
        .map_err(|(k, e)| self.image.span_error(&owned[k], e))
    }
}

/// Reads CRIU's next request (a 4-byte length and an `img_streamer_request_entry`); `None`
/// when CRIU closed the connection.
pub(super) fn read_request(conn: &mut UnixStream) -> Result<Option<RequestEntry>, String> {
    let mut len = [0u8; 4];
    match conn.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(format!("reading a request: {e}")),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_REQUEST {
        return Err(format!("request of {len} bytes"));
    }
    let mut buf = vec![0u8; len as usize];
    conn.read_exact(&mut buf)
        .map_err(|e| format!("reading a request: {e}"))?;
    RequestEntry::decode(buf.as_slice())
        .map(Some)
        .map_err(|e| format!("bad request: {e}"))
}

/// Receives one fd (`SCM_RIGHTS` with one dummy byte), close-on-exec.
pub(super) fn recv_fd(sock: RawFd) -> Result<OwnedFd, String> {
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(RawFd);
    let msg = loop {
        match recvmsg::<()>(sock, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(nix::Error::EINTR) => continue,
            r => break r.map_err(|e| e.to_string())?,
        }
    };
    let mut got = None;
    for c in msg.cmsgs().map_err(|e| e.to_string())? {
        if let ControlMessageOwned::ScmRights(fds) = c {
            for fd in fds {
                // SAFETY: the kernel installed this fd in our table for us; nothing else owns it.
                let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                got.get_or_insert(owned);
            }
        }
    }
    got.ok_or_else(|| "no file descriptor in the message".to_string())
}
