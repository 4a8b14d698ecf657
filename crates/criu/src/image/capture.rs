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
//! hands it to a second thread that hashes it (BLAKE3: the manifest's chunk digest), writes it
//! into `STAGING/NAME` (a new file, never an existing one) and starts its writeback
//! (`sync_file_range`), so the disk works while CRIU still dumps and publish's fsync waits only
//! for the tail. Files are received in parallel (one pages file per process).
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
//! streamer. Up to two chunks per file are in memory at once.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Condvar, Mutex, MutexGuard};
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
    failure: Option<ImageError>,
}

/// Receives one dump from CRIU into a staging directory.
#[derive(Debug)]
pub struct Capture {
    dir: PathBuf,
    chunk: u64,
    state: Mutex<State>,
    changed: Condvar,
    written: AtomicU64,
}

impl Capture {
    pub(crate) fn new(dir: &Path, chunk: u64) -> Capture {
        Capture {
            dir: dir.to_path_buf(),
            chunk: chunk.max(1),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            written: AtomicU64::new(0),
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
        self.changed.notify_all();
    }

    /// The first reason the capture was refused, if any.
    pub(crate) fn failure(&self) -> Option<ImageError> {
        self.lock().failure.take()
    }

    fn failed(&self) -> bool {
        self.lock().failure.is_some()
    }

    /// Accepts CRIU's connection on `listener` and receives every file it sends until it closes
    /// the connection; returns once every file is written. Returns at once if the listener is
    /// shut down before CRIU connects.
    pub(crate) fn serve(&self, listener: &UnixListener) {
        let mut conn = match listener.accept() {
            Ok((c, _)) => c,
            Err(e) => {
                tracing::debug!(error = %e, "no CRIU connected to the image capture");
                return;
            }
        };
        std::thread::scope(|s| loop {
            let stream_err = |reason| ImageError::Stream {
                dir: self.dir.clone(),
                reason,
            };
            match read_request(&mut conn) {
                Ok(None) => return,
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
                        return;
                    }
                },
                Err(reason) => {
                    self.fail(stream_err(reason));
                    return;
                }
            }
            // A refused capture takes no more files: CRIU's next request fails.
            if self.failed() {
                return;
            }
        });
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
        let file = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .map_err(io(&path))?;
        let mut pipe = File::from(pipe);
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        let (tx, rx) = mpsc::sync_channel::<(u64, Vec<u8>)>(IN_FLIGHT);
        let (free_tx, free_rx) = mpsc::channel::<Vec<u8>>();
        let (size, chunks) = std::thread::scope(|s| {
            let (file, path) = (&file, &path);
            let writer = s.spawn(move || -> Result<Vec<String>, ImageError> {
                let mut digests = Vec::new();
                for (offset, buf) in rx {
                    digests.push(hash::digest(DigestAlg::Blake3, &buf));
                    file.write_all_at(&buf, offset).map_err(io(path))?;
                    // Only a hint to the kernel: publish's fsync does what this did not.
                    let _ = sys::start_writeback(file, offset, buf.len() as u64);
                    self.written.fetch_add(buf.len() as u64, Ordering::Relaxed);
                    let _ = free_tx.send(buf);
                }
                Ok(digests)
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
                // The writer stopped on an error, which it returns.
                if tx.send((offset, buf)).is_err() {
                    break Ok(());
                }
                offset += n as u64;
                if n < chunk {
                    // Short only at the end of the pipe.
                    break Ok(());
                }
            };
            drop(tx);
            if read.is_ok() {
                self.set(name, FileState::Draining);
            }
            let digests = writer
                .join()
                .unwrap_or_else(|_| Err(io(path)(std::io::Error::other("writer panicked"))))?;
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
            let open: Vec<&String> = st
                .files
                .iter()
                .filter(|(_, f)| matches!(f, FileState::Receiving))
                .map(|(n, _)| n)
                .collect();
            let draining = st
                .files
                .values()
                .any(|f| matches!(f, FileState::Draining));
            if open.is_empty() && !draining {
                return Ok(());
            }
            if !open.is_empty() && since.elapsed() >= STILL_OPEN_WAIT {
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
    if name.is_empty() || name == "." || name == ".." || name.contains('/') || name.contains('\0')
    {
        return Some("not a plain file name".into());
    }
    if name == MANIFEST_FILE || is_staging_name(name) {
        return Some("a name cryo keeps for itself".into());
    }
    None
}
