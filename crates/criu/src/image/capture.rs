//! The freeze's image capture: `criu dump --stream` hands cryo every image file through a pipe,
//! and cryo writes it into the staging directory, hashing each chunk on the way: one pass over
//! the bytes, no re-read at publish.
//!
//! # Design
//! CRIU's image-streamer protocol, capture side (`criu/img-streamer.c`): CRIU connects to
//! `streamer-capture.sock` in its images directory; for every image file it writes, it sends the
//! file's name (a 4-byte length and an `img_streamer_request_entry`; no reply) and the read end
//! of a fresh pipe (`SCM_RIGHTS`), then writes the file into the pipe and closes it.
//!
//! cryo receives each file on its own thread, which fills a chunk-sized buffer from the pipe and
//! hands it at once to a thread that hashes it (BLAKE3: the manifest's chunk digest) and to one
//! that writes it into `STAGING/NAME` (a new file, never an existing one); one flusher thread per capture starts
//! the writeback of every chunk written (`sync_file_range`), so the disk works while CRIU still
//! dumps and publish's fsync waits only for the tail. The writeback is off the writers' path:
//! `sync_file_range` blocks while the disk's queue is full, and a writer that waited for the
//! disk held CRIU's `post-dump` (and the end of the worker) back to disk speed (1 GiB: worker
//! gone 1.2 s against the bare route's 0.8 s). The writers wait for the flusher only once they
//! are [`MAX_LAG`] ahead of it. Files are received in parallel (one pages file per process).
//!
//! CRIU kills the dumped tree only once its `post-dump` action script passed; a failing script
//! makes it resume the tree instead. That script waits at cryo's gate (see `criu.rs`) until cryo
//! has written every byte it was sent into the staging files ([`Capture::written`]): a full disk
//! or any other write error fails the dump while the tree is alive, never after it was killed.
//! A name that is not a plain file name, a file sent twice, a pipe that fails or a write that
//! fails refuses the capture: cryo stops reading (CRIU's next write fails) and the gate says no.
//!
//! # Limitations
//! CRIU's log (`dump.log`) is written by CRIU itself into the staging directory (its work
//! directory) and hashed at publish, as are any other files that did not come through the
//! streamer. Up to five chunks per file are in memory at once.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::manifest::{DigestAlg, FileEntry, MANIFEST_FILE};
use super::stream::{read_request, recv_fd, PIPE_SIZE};
use super::{hash, io, is_staging_name, sys, ImageError};

/// The socket CRIU connects to, in the directory given to `criu dump --stream -D`.
pub(crate) const CAPTURE_SOCKET: &str = "streamer-capture.sock";

/// Chunks handed from a file's reader to its writer ahead of the one being written.
const IN_FLIGHT: usize = 2;

/// How long the gate waits for CRIU to close a file it still writes when it reached
/// `post-dump` (CRIU closes every image before; one still open is a protocol surprise).
const STILL_OPEN_WAIT: Duration = Duration::from_secs(10);

/// Where one file stands.
#[derive(Debug)]
enum FileState {
    /// CRIU may still write into the pipe.
    Receiving,
    /// The pipe ended; the last chunks are being written.
    Draining,
    /// Every byte written into the staging file.
    Done(FileEntry),
}

#[derive(Debug, Default)]
struct State {
    files: BTreeMap<String, FileState>,
    /// The first reason to refuse, until someone takes it.
    failure: Option<ImageError>,
    /// Refused (sticky: the reason may have been taken).
    refused: bool,
}

/// A range of a staging file whose writeback the flusher starts.
type Flush = (Arc<File>, u64, u64);

/// How far the writers may run ahead of the writeback the flusher started. Within it a dump
/// goes at the speed CRIU sends and cryo hashes (the disk catches up during publish's fsync);
/// past it the writers wait for the disk, so dirty pages never reach the kernel's throttling
/// (20% of memory by default), which slowed a 4 GiB dump from 2.1 to 4.3 s when nothing paced
/// the writers.
const MAX_LAG: u64 = 1 << 30;

/// The bytes whose writeback the flusher started, for the writers to wait on.
#[derive(Debug, Default)]
struct Started {
    /// Bytes started; `None` once no flusher runs (then nobody waits).
    bytes: Mutex<Option<u64>>,
    more: Condvar,
}

impl Started {
    fn add(&self, n: u64) {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(b) = b.as_mut() {
            *b += n;
        }
        self.more.notify_all();
    }

    fn stop(&self) {
        *self.bytes.lock().unwrap_or_else(|p| p.into_inner()) = None;
        self.more.notify_all();
    }

    /// Waits until the flusher started all but [`MAX_LAG`] of `written` bytes.
    fn wait_for(&self, written: u64) {
        let mut b = self.bytes.lock().unwrap_or_else(|p| p.into_inner());
        while let Some(started) = *b {
            if written.saturating_sub(started) <= MAX_LAG {
                return;
            }
            b = self.more.wait(b).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// Receives one dump from CRIU into a staging directory.
#[derive(Debug)]
pub struct Capture {
    dir: PathBuf,
    chunk: u64,
    /// To the flusher thread, which ends when this is dropped (with the capture).
    flush: Mutex<mpsc::Sender<Flush>>,
    started: Arc<Started>,
    state: Mutex<State>,
    changed: Condvar,
    written: AtomicU64,
    /// [`STILL_OPEN_WAIT`], shorter in tests.
    still_open_wait: Duration,
}

impl Capture {
    pub(crate) fn new(dir: &Path, chunk: u64) -> Capture {
        let (flush, ranges) = mpsc::channel::<Flush>();
        let started = Arc::new(Started {
            bytes: Mutex::new(Some(0)),
            more: Condvar::new(),
        });
        let st = Arc::clone(&started);
        // Not joined: it ends once the capture is gone and what was queued is started; the
        // writeback it did not start is publish's fsync's.
        let spawned = std::thread::Builder::new()
            .name("cryo-flush".into())
            .spawn(move || {
                for (file, offset, len) in ranges {
                    // Only a hint to the kernel: publish's fsync does what this did not.
                    let _ = sys::start_writeback(&*file, offset, len);
                    st.add(len);
                }
                st.stop();
            });
        if let Err(e) = spawned {
            started.stop();
            tracing::warn!(error = %e, "no flusher thread: the writeback waits for publish");
        }
        Capture {
            dir: dir.to_path_buf(),
            chunk: chunk.max(1),
            flush: Mutex::new(flush),
            started,
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            written: AtomicU64::new(0),
            still_open_wait: STILL_OPEN_WAIT,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Bytes written into the staging directory so far.
    pub fn written_bytes(&self) -> u64 {
        self.written.load(Ordering::Relaxed)
    }

    fn fail(&self, e: ImageError) {
        tracing::warn!(error = %e, "image capture refused");
        let mut st = self.lock();
        st.failure.get_or_insert(e);
        st.refused = true;
        self.changed.notify_all();
    }

    /// The first reason the capture was refused, if any.
    pub(crate) fn failure(&self) -> Option<ImageError> {
        self.lock().failure.take()
    }

    fn failed(&self) -> bool {
        self.lock().refused
    }

    /// Accepts CRIU's connection on `listener` and receives every file it sends until it closes
    /// the connection; returns once every file is written. Returns at once if the listener is
    /// shut down before CRIU connects.
    pub(crate) fn serve(&self, listener: &UnixListener) {
        let conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::debug!(error = %e, "no CRIU connected to the image capture");
                return;
            }
        };
        // The connection is closed as soon as this loop ends, before the files being received
        // are waited for: the pipes of requests not read yet are closed with it, so CRIU's
        // writes into them fail instead of waiting for a reader forever.
        std::thread::scope(|s| {
            let mut conn = conn;
            loop {
                if !self.next(s, &mut conn) {
                    return;
                }
            }
        });
    }

    /// Takes CRIU's next file and starts receiving it; `false` when there is none or the
    /// capture is refused.
    fn next<'s>(&'s self, s: &'s std::thread::Scope<'s, '_>, conn: &mut UnixStream) -> bool {
        {
            let stream_err = |reason| ImageError::Stream {
                dir: self.dir.clone(),
                reason,
            };
            match read_request(conn) {
                Ok(None) => return false,
                Ok(Some(req)) => match recv_fd(conn.as_raw_fd()) {
                    Ok(pipe) => {
                        s.spawn(move || {
                            if let Err(e) = self.receive(&req.filename, pipe) {
                                self.fail(e);
                            }
                        });
                    }
                    Err(reason) => {
                        self.fail(stream_err(format!(
                            "receiving the pipe for {}: {reason}",
                            req.filename
                        )));
                        return false;
                    }
                },
                Err(reason) => {
                    self.fail(stream_err(reason));
                    return false;
                }
            }
        }
        // A refused capture takes no more files: CRIU's next request fails.
        !self.failed()
    }

    fn set(&self, name: &str, state: FileState) {
        self.lock().files.insert(name.to_string(), state);
        self.changed.notify_all();
    }

    /// Receives file `name` from `pipe` into the staging directory, hashing every chunk.
    fn receive(&self, name: &str, pipe: OwnedFd) -> Result<(), ImageError> {
        let path = self.dir.join(name);
        if let Some(reason) = bad_name(name) {
            return Err(ImageError::Unexpected { file: path, reason });
        }
        {
            let mut st = self.lock();
            if st.files.contains_key(name) {
                return Err(ImageError::Unexpected {
                    file: path,
                    reason: "sent twice by CRIU".into(),
                });
            }
            st.files.insert(name.to_string(), FileState::Receiving);
        }
        tracing::debug!(file = name, "CRIU writes an image file");
        let _ = nix::fcntl::fcntl(
            pipe.as_raw_fd(),
            nix::fcntl::FcntlArg::F_SETPIPE_SZ(PIPE_SIZE),
        );
        let file = Arc::new(
            File::options()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(io(&path))?,
        );
        let flush = self.flush.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut pipe = File::from(pipe);
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        // Each chunk goes to a writer and a hasher at once (two cores' work, not one after the
        // other); whichever lets go of it last hands the buffer back to the reader.
        type Chunk = (u64, Arc<Vec<u8>>);
        let (tx, rx) = mpsc::sync_channel::<Chunk>(IN_FLIGHT);
        let (htx, hrx) = mpsc::sync_channel::<Chunk>(IN_FLIGHT);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        let recycle = |buf: Arc<Vec<u8>>, free: &mpsc::Sender<Vec<u8>>| {
            if let Ok(b) = Arc::try_unwrap(buf) {
                let _ = free.send(b);
            }
        };
        let (size, chunks) = std::thread::scope(|s| {
            let (file, path) = (&file, &path);
            let free = free_tx.clone();
            let hasher = s.spawn(move || -> Vec<String> {
                let mut digests = Vec::new();
                for (_, buf) in hrx {
                    digests.push(hash::digest(DigestAlg::Blake3, &buf));
                    recycle(buf, &free);
                }
                digests
            });
            let writer = s.spawn(move || -> Result<(), ImageError> {
                for (offset, buf) in rx {
                    file.write_all_at(&buf, offset).map_err(io(path))?;
                    let _ = flush.send((Arc::clone(file), offset, buf.len() as u64));
                    let total = self.written.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    self.started.wait_for(total + buf.len() as u64);
                    recycle(buf, &free_tx);
                }
                Ok(())
            });
            let mut offset = 0u64;
            let read = loop {
                let mut buf = free_rx
                    .try_recv()
                    .unwrap_or_else(|_| Vec::with_capacity(chunk));
                buf.clear();
                if let Err(e) = (&mut pipe).take(self.chunk).read_to_end(&mut buf) {
                    break Err(ImageError::Stream {
                        dir: self.dir.clone(),
                        reason: format!("reading {name} from CRIU: {e}"),
                    });
                }
                let n = buf.len();
                if n == 0 {
                    break Ok(());
                }
                let buf = Arc::new(buf);
                // The writer stopped on an error, which it returns.
                if htx.send((offset, Arc::clone(&buf))).is_err() || tx.send((offset, buf)).is_err()
                {
                    break Ok(());
                }
                offset += n as u64;
                if n < chunk {
                    // Short only at the end of the pipe.
                    break Ok(());
                }
            };
            drop((tx, htx));
            if read.is_ok() {
                self.set(name, FileState::Draining);
            }
            writer
                .join()
                .unwrap_or_else(|_| Err(io(path)(std::io::Error::other("writer panicked"))))?;
            let digests = hasher
                .join()
                .map_err(|_| io(path)(std::io::Error::other("hasher panicked")))?;
            read.map(|()| (offset, digests))
        })?;
        self.set(
            name,
            FileState::Done(FileEntry {
                name: name.to_string(),
                size,
                sha256: String::new(),
                chunks,
            }),
        );
        Ok(())
    }

    /// The gate's verdict at CRIU's `post-dump` stage: waits until every file CRIU sent is
    /// written whole, and refuses if anything was refused or CRIU still holds a file open
    /// (after [`STILL_OPEN_WAIT`]).
    pub(crate) fn written(&self) -> Result<(), ImageError> {
        let since = Instant::now();
        let mut st = self.lock();
        loop {
            if let Some(e) = st.failure.take() {
                return Err(e);
            }
            if st.refused {
                return Err(ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: "the capture was refused".into(),
                });
            }
            let open: Vec<&String> = st
                .files
                .iter()
                .filter(|(_, f)| matches!(f, FileState::Receiving))
                .map(|(n, _)| n)
                .collect();
            let draining = st.files.values().any(|f| matches!(f, FileState::Draining));
            if open.is_empty() && !draining {
                return Ok(());
            }
            if !open.is_empty() && since.elapsed() >= self.still_open_wait {
                return Err(ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: format!("CRIU finished its dump with {open:?} still open"),
                });
            }
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(100))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Every file received, sorted by name; an error if any was refused or is not whole.
    pub(crate) fn into_files(self) -> Result<BTreeMap<String, FileEntry>, ImageError> {
        let st = self.state.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(e) = st.failure {
            return Err(e);
        }
        if st.refused {
            return Err(ImageError::Stream {
                dir: self.dir.clone(),
                reason: "the capture was refused".into(),
            });
        }
        st.files
            .into_iter()
            .map(|(name, f)| match f {
                FileState::Done(e) => Ok((name, e)),
                _ => Err(ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: format!("{name}: not received whole"),
                }),
            })
            .collect()
    }
}

/// Why `name` cannot be an image file's name, if it cannot.
fn bad_name(name: &str) -> Option<String> {
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0') {
        return Some("not a plain file name".into());
    }
    if name == MANIFEST_FILE || is_staging_name(name) {
        return Some("a name cryo keeps for itself".into());
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::Write;
    use std::os::fd::AsFd;

    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    use prost::Message;

    use crate::image::stream::RequestEntry;

    /// Plays CRIU's side of the capture protocol: one request and one pipe per file.
    struct FakeCriu(UnixStream);

    impl FakeCriu {
        /// Announces `name` and returns the write end of its pipe.
        fn open(&mut self, name: &str) -> File {
            let req = RequestEntry {
                filename: name.to_string(),
            }
            .encode_to_vec();
            self.0.write_all(&(req.len() as u32).to_le_bytes()).unwrap();
            self.0.write_all(&req).unwrap();
            let (r, w) = nix::unistd::pipe().unwrap();
            let fds = [r.as_fd().as_raw_fd()];
            sendmsg::<()>(
                self.0.as_raw_fd(),
                &[std::io::IoSlice::new(&[0])],
                &[ControlMessage::ScmRights(&fds)],
                MsgFlags::empty(),
                None,
            )
            .unwrap();
            File::from(w)
        }
    }

    /// Runs a capture into a fresh directory with `chunk`-byte chunks while `criu` plays CRIU;
    /// returns the directory, the gate's verdict and the capture.
    fn capture(chunk: u64, criu: impl FnOnce(&mut FakeCriu)) -> (tempfile::TempDir, Capture) {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join(CAPTURE_SOCKET);
        let listener = UnixListener::bind(&sock).unwrap();
        let cap = Capture::new(dir.path(), chunk);
        std::thread::scope(|s| {
            s.spawn(|| cap.serve(&listener));
            let mut c = FakeCriu(UnixStream::connect(&sock).unwrap());
            criu(&mut c);
        });
        std::fs::remove_file(&sock).unwrap();
        (dir, cap)
    }

    #[test]
    fn files_are_written_and_hashed_per_chunk_in_one_pass() {
        let data: Vec<u8> = (0..(10 << 20) + 123)
            .map(|i| (i * 7 + i / 1000) as u8)
            .collect();
        let (dir, cap) = capture(4 << 20, |c| {
            let mut big = c.open("pages-1.img");
            let mut small = c.open("core-1.img");
            small.write_all(b"core").unwrap();
            drop(c.open("empty.img"));
            // Odd-sized writes, as CRIU's splices come.
            for part in data.chunks(777_777) {
                big.write_all(part).unwrap();
            }
        });
        cap.written().unwrap();
        assert_eq!(cap.written_bytes(), data.len() as u64 + 4);
        let files = cap.into_files().unwrap();
        assert_eq!(
            files.keys().collect::<Vec<_>>(),
            ["core-1.img", "empty.img", "pages-1.img"]
        );
        let pages = &files["pages-1.img"];
        assert_eq!(pages.size, data.len() as u64);
        let want: Vec<String> = data
            .chunks(4 << 20)
            .map(|c| blake3::hash(c).to_hex().to_string())
            .collect();
        assert_eq!(pages.chunks, want);
        assert_eq!(std::fs::read(dir.path().join("pages-1.img")).unwrap(), data);
        assert_eq!(files["empty.img"].size, 0);
        assert!(files["empty.img"].chunks.is_empty());
        // What publish would hash from the disk is what the capture hashed on the way.
        let f = File::open(dir.path().join("pages-1.img")).unwrap();
        assert_eq!(
            hash::chunk_digests(&f, data.len() as u64, 4 << 20).unwrap(),
            want
        );
    }

    #[test]
    fn names_that_leave_the_directory_or_are_cryos_own_are_refused() {
        for name in ["../escape", "a/b", "manifest.json", "x.tmp-abc", "", ".."] {
            let (dir, cap) = capture(1 << 20, |c| {
                let mut w = c.open(name);
                // CRIU's write fails or lands nowhere: the capture never opened the file.
                let _ = w.write_all(b"evil");
            });
            let err = cap.written().unwrap_err();
            assert!(
                matches!(err, ImageError::Unexpected { .. }),
                "{name:?}: {err}"
            );
            assert!(!dir.path().join("manifest.json").exists());
            assert!(name != "../escape" || !dir.path().parent().unwrap().join("escape").exists());
        }
    }

    #[test]
    fn a_file_sent_twice_is_refused() {
        let (_dir, cap) = capture(1 << 20, |c| {
            c.open("core-1.img").write_all(b"one").unwrap();
            let _ = c.open("core-1.img").write_all(b"two");
        });
        let err = cap.written().unwrap_err();
        assert!(err.to_string().contains("sent twice"), "{err}");
        assert!(cap.into_files().is_err());
    }

    #[test]
    fn the_gate_refuses_when_criu_keeps_a_file_open() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join(CAPTURE_SOCKET);
        let listener = UnixListener::bind(&sock).unwrap();
        let mut cap = Capture::new(dir.path(), 1 << 20);
        cap.still_open_wait = Duration::from_millis(200);
        std::thread::scope(|s| {
            s.spawn(|| cap.serve(&listener));
            let mut c = FakeCriu(UnixStream::connect(&sock).unwrap());
            let mut w = c.open("core-1.img");
            w.write_all(b"half").unwrap();
            // CRIU reached post-dump and still holds the pipe: a refusal, not a hang.
            cryo_testkit::eventually(
                cryo_testkit::PATIENCE,
                "the capture to take the file",
                || cap.lock().files.contains_key("core-1.img"),
            );
            let err = cap.written().unwrap_err();
            assert!(err.to_string().contains("still open"), "{err}");
            drop((w, c));
        });
    }
}
