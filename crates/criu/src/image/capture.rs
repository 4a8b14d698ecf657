//! The freeze's streamed image capture (`CRYO_DUMP_STREAM=1`; by default CRIU writes its files
//! itself, see `follow.rs`): `criu dump --stream` hands cryo every image file through a pipe,
//! and cryo writes it into the staging directory, hashing each chunk on the way: one pass over
//! the bytes, no re-read at publish.
//!
//! # Design
//! CRIU's image-streamer protocol, capture side (`criu/img-streamer.c`): CRIU connects to
//! `streamer-capture.sock` in its images directory; for every image file it writes, it sends the
//! file's name (a 4-byte length and an `img_streamer_request_entry`; no reply) and the read end
//! of a fresh pipe (`SCM_RIGHTS`), then writes the file into the pipe and closes it.
//!
//! cryo receives each file on its own thread, which moves the pipe's pages straight into
//! `STAGING/NAME` (a new file, never an existing one) with `splice(2)`: one copy, in the
//! kernel, from CRIU's pipe into the page cache, as CRIU's own `criu dump` makes into its files.
//! Each chunk, once in the page cache, goes to the capture's hashers (BLAKE3 of the chunk, read
//! back from the page cache: the manifest's chunk digest) and to one flusher thread per capture,
//! which starts its writeback (`sync_file_range`) so the disk works while CRIU still dumps and
//! publish's fsync waits only for the tail. The writeback is off the receivers' path:
//! `sync_file_range` blocks while the disk's queue is full, and a receiver that waited for the
//! disk held CRIU's `post-dump` (and the end of the worker) back to disk speed. The receivers
//! wait for the flusher only once they are [`MAX_LAG`] ahead of it. Files are received in
//! parallel (one pages file per process).
//!
//! The hashers run beside the receivers at idle priority (`SCHED_IDLE`), on every core: a core
//! CRIU and the receivers leave idle hashes, one they need is theirs; once publish waits for the
//! hashes they go on at the normal priority. Session 6's capture read each chunk into cryo's
//! memory and wrote it out (two copies, and the gate waited for the hash too): 1 GiB reached
//! CRIU's `post-dump` in 1.5 s against CRIU's own 0.35 s into its files, on this 2-core host;
//! CRIU's pages then waited in its `splice` into cryo's pipe.
//!
//! CRIU kills the dumped tree only once its `post-dump` action script passed; a failing script
//! makes it resume the tree instead. That script waits at cryo's gate (see `criu.rs`) until cryo
//! has written every byte it was sent into the staging files ([`Capture::written`]): a full disk
//! or any other write error fails the dump while the tree is alive, never after it was killed.
//! The gate does not wait for the hashes: every byte is then in cryo's staging files (root's,
//! in a directory only root can enter), and the image is published only once every chunk is
//! hashed ([`Capture::into_files`], which publish waits for while it fsyncs) and durable. A
//! crash between the gate and the publish leaves no image (as a crash before the fsync always
//! did), and a chunk that cannot be read back fails the publish.
//! A name that is not a plain file name, a file sent twice, a pipe that fails or a write that
//! fails refuses the capture: cryo stops reading (CRIU's next write fails) and the gate says no.
//!
//! # Limitations
//! CRIU's log (`dump.log`) is written by CRIU itself into the staging directory (its work
//! directory) and hashed at publish, as are any other files that did not come through the
//! streamer. A file system whose files take no `splice` is written through a buffer instead
//! (a copy more). Each hasher holds one chunk in memory.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use super::manifest::{DigestAlg, FileEntry, MANIFEST_FILE};
use super::stream::{read_request, recv_fd, PIPE_SIZE};
use super::{hash, io, is_staging_name, sys, ImageError};

/// The socket CRIU connects to, in the directory given to `criu dump --stream -D`.
pub(crate) const CAPTURE_SOCKET: &str = "streamer-capture.sock";

/// The size asked for CRIU's pipe of each file (past `fs.pipe-max-size`, which root may): CRIU
/// splices into it and waits when it is full, cryo splices out of it. 1 GiB dumped: every byte
/// received at 579 ms with 1 MiB, 507 ms with 32 MiB (load 3 on 2 cores). A pipe holds
/// references to the pages CRIU spliced, not copies.
const CAPTURE_PIPE_SIZE: i32 = 32 << 20;

/// How long the gate waits for CRIU to close a file it still writes when it reached
/// `post-dump` (CRIU closes every image before; one still open is a protocol surprise).
const STILL_OPEN_WAIT: Duration = Duration::from_secs(10);

/// At most this many hashers per capture (one per core below it).
const MAX_HASHERS: usize = 4;

/// Where one file stands.
#[derive(Debug)]
enum FileState {
    /// CRIU may still write into the pipe.
    Receiving,
    /// Every byte written into the staging file (its chunks may still be hashed).
    Written {
        /// Bytes.
        size: u64,
        /// Chunks handed to the hashers.
        chunks: usize,
    },
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
/// goes at the speed CRIU sends (the disk catches up during publish's fsync); past it the
/// writers wait for the disk, so dirty pages never reach the kernel's throttling (20% of memory
/// by default), which slowed a 4 GiB dump from 2.1 to 4.3 s when nothing paced the writers.
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

/// When a capture and the dump around it reached their moments, for the freeze's report.
#[derive(Debug, Default)]
pub struct CaptureClock {
    /// Every file CRIU sent so far written whole (the last one sets it; CRIU at the gate when
    /// CRIU writes the files itself).
    pub(crate) received: Mutex<Option<Instant>>,
    /// Every chunk hashed ([`Capture::into_files`]).
    hashed: Mutex<Option<Instant>>,
    /// CRIU at the gate (`post-dump`), the gate's verdict, CRIU's exit (set by the dump).
    pub(crate) gate: Mutex<Option<Instant>>,
    pub(crate) verdict: Mutex<Option<Instant>>,
    pub(crate) criu_exit: Mutex<Option<Instant>>,
    /// Bytes the follower hashed before publish took over (a dump CRIU writes itself).
    pub(crate) followed: Mutex<Option<u64>>,
}

impl CaptureClock {
    pub(crate) fn mark(slot: &Mutex<Option<Instant>>) {
        *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now());
    }

    fn get(slot: &Mutex<Option<Instant>>) -> Option<Instant> {
        *slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every byte CRIU sent in the staging files (page cache).
    pub fn received(&self) -> Option<Instant> {
        Self::get(&self.received)
    }

    /// Every chunk hashed.
    pub fn hashed(&self) -> Option<Instant> {
        Self::get(&self.hashed)
    }

    /// CRIU reached `post-dump`: every image sent, the tree still frozen.
    pub fn gate(&self) -> Option<Instant> {
        Self::get(&self.gate)
    }

    /// The gate's verdict written (CRIU then kills the tree).
    pub fn verdict(&self) -> Option<Instant> {
        Self::get(&self.verdict)
    }

    /// CRIU exited.
    pub fn criu_exit(&self) -> Option<Instant> {
        Self::get(&self.criu_exit)
    }

    /// Bytes the follower hashed before publish took over.
    pub fn followed(&self) -> Option<u64> {
        *self.followed.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// One chunk for the hashers: read back from the staging file's page cache and hashed.
struct HashJob {
    name: Arc<str>,
    index: usize,
    file: Arc<File>,
    offset: u64,
    len: usize,
}

/// What the hashers found.
#[derive(Debug, Default)]
struct Hashed {
    digests: BTreeMap<String, Vec<Option<String>>>,
    failure: Option<ImageError>,
}

/// The capture's hashers: threads taking chunks from one queue, at idle priority
/// (`SCHED_IDLE`: only on a core nothing else wants) until someone waits for them
/// ([`Hashers::finish`]), then at the normal one.
#[derive(Debug)]
struct Hashers {
    jobs: Mutex<Option<mpsc::Sender<HashJob>>>,
    /// Someone waits for the hashes: the hashers leave idle priority.
    urgent: Arc<AtomicBool>,
    threads: Mutex<Vec<std::thread::JoinHandle<()>>>,
    done: Arc<Mutex<Hashed>>,
}

impl Hashers {
    fn start(dir: &Path) -> Hashers {
        let (tx, rx) = mpsc::channel::<HashJob>();
        let rx = Arc::new(Mutex::new(rx));
        let done = Arc::new(Mutex::new(Hashed::default()));
        let urgent = Arc::new(AtomicBool::new(false));
        let n = std::thread::available_parallelism()
            .map_or(1, usize::from)
            .clamp(1, MAX_HASHERS);
        let mut threads = Vec::new();
        for _ in 0..n {
            let (rx, done, dir) = (Arc::clone(&rx), Arc::clone(&done), dir.to_path_buf());
            let urgent = Arc::clone(&urgent);
            match std::thread::Builder::new()
                .name("cryo-hash".into())
                .spawn(move || hash_chunks(&rx, &done, &urgent, &dir))
            {
                Ok(t) => threads.push(t),
                Err(e) => tracing::warn!(error = %e, "one hasher thread fewer"),
            }
        }
        if threads.is_empty() {
            done.lock().unwrap_or_else(|p| p.into_inner()).failure = Some(ImageError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::other("no hasher thread could be started"),
            });
        }
        Hashers {
            jobs: Mutex::new(Some(tx)),
            urgent,
            threads: Mutex::new(threads),
            done,
        }
    }

    fn sender(&self) -> Option<mpsc::Sender<HashJob>> {
        self.jobs.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes no more chunks and waits for the hashers to finish what they have, at the normal
    /// priority from now on.
    fn finish(&self) {
        self.urgent.store(true, Ordering::Relaxed);
        drop(self.jobs.lock().unwrap_or_else(|p| p.into_inner()).take());
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            if t.join().is_err() {
                self.done
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .failure
                    .get_or_insert_with(|| ImageError::Io {
                        path: PathBuf::new(),
                        source: std::io::Error::other("a hasher thread panicked"),
                    });
            }
        }
    }
}

/// A hasher's life: reads each chunk it is given back from the page cache and hashes it.
fn hash_chunks(
    jobs: &Mutex<mpsc::Receiver<HashJob>>,
    done: &Mutex<Hashed>,
    urgent: &AtomicBool,
    dir: &Path,
) {
    // Only priorities: a hasher that keeps its priority still hashes every chunk.
    let mut idle = match sys::set_idle_priority(true) {
        Ok(()) => true,
        Err(e) => {
            tracing::debug!(error = %e, "a hasher keeps its priority");
            false
        }
    };
    let mut buf = Vec::new();
    loop {
        if idle && urgent.load(Ordering::Relaxed) {
            if let Err(e) = sys::set_idle_priority(false) {
                tracing::debug!(error = %e, "a hasher stays at idle priority");
            }
            idle = false;
        }
        let job = {
            let rx = jobs.lock().unwrap_or_else(|p| p.into_inner());
            match rx.recv() {
                Ok(j) => j,
                Err(_) => return,
            }
        };
        buf.resize(job.len, 0);
        let read = job.file.read_exact_at(&mut buf, job.offset);
        let mut d = done.lock().unwrap_or_else(|p| p.into_inner());
        match read {
            Ok(()) => {
                let digest = hash::digest(DigestAlg::Blake3, &buf);
                let v = d.digests.entry(job.name.to_string()).or_default();
                if v.len() <= job.index {
                    v.resize(job.index + 1, None);
                }
                v[job.index] = Some(digest);
            }
            Err(e) => {
                let path = dir.join(&*job.name);
                d.failure.get_or_insert(ImageError::Io { path, source: e });
            }
        }
    }
}

/// Moves a file's bytes from CRIU's pipe into the staging file: `splice`, or through a buffer
/// where the file system takes no `splice` (`EINVAL` before the first byte).
struct Mover {
    splice: bool,
    buf: Vec<u8>,
}

impl Mover {
    /// Moves up to `want` bytes from `pipe` into `file` at `offset`; fewer only at the end of
    /// the pipe.
    fn fill(
        &mut self,
        pipe: &File,
        file: &File,
        offset: u64,
        want: usize,
    ) -> std::io::Result<usize> {
        use rustix::io::Errno;
        let mut got = 0usize;
        while got < want {
            let at = offset + got as u64;
            let n = if self.splice {
                let mut off = at;
                match rustix::pipe::splice(
                    pipe,
                    None,
                    file,
                    Some(&mut off),
                    want - got,
                    rustix::pipe::SpliceFlags::MOVE,
                ) {
                    Ok(n) => n,
                    Err(Errno::INTR) => continue,
                    Err(Errno::INVAL) if at == 0 => {
                        tracing::debug!("no splice into this file system: through a buffer");
                        self.splice = false;
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            } else {
                self.buf.resize((want - got).min(1 << 20), 0);
                let n = match (&*pipe).read(&mut self.buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => return Err(e),
                };
                file.write_all_at(&self.buf[..n], at)?;
                n
            };
            if n == 0 {
                break;
            }
            got += n;
        }
        Ok(got)
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
    hashers: Hashers,
    clock: Arc<CaptureClock>,
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
            hashers: Hashers::start(dir),
            clock: Arc::default(),
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
            written: AtomicU64::new(0),
            still_open_wait: STILL_OPEN_WAIT,
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// When the capture (and the dump around it) reached its moments.
    pub fn clock(&self) -> Arc<CaptureClock> {
        Arc::clone(&self.clock)
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

    /// Receives file `name` from `pipe` into the staging directory, each chunk handed to the
    /// hashers and the flusher as soon as it is in the page cache.
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
        // As large as the kernel lets cryo make it: fewer hand-overs between CRIU and cryo.
        for size in [CAPTURE_PIPE_SIZE, PIPE_SIZE] {
            match nix::fcntl::fcntl(pipe.as_raw_fd(), nix::fcntl::FcntlArg::F_SETPIPE_SZ(size)) {
                Ok(_) => break,
                Err(e) => tracing::debug!(size, error = %e, "CRIU's pipe keeps a smaller size"),
            }
        }
        // Read back by the hashers.
        let file = Arc::new(
            File::options()
                .read(true)
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW)
                .open(&path)
                .map_err(io(&path))?,
        );
        let flush = self.flush.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let hash = self.hashers.sender().ok_or_else(|| ImageError::Stream {
            dir: self.dir.clone(),
            reason: format!("{name} arrived after the capture was closed"),
        })?;
        let shared: Arc<str> = Arc::from(name);
        let pipe = File::from(pipe);
        let chunk = usize::try_from(self.chunk).unwrap_or(usize::MAX);
        let mut mover = Mover {
            splice: true,
            buf: Vec::new(),
        };
        let (mut offset, mut index) = (0u64, 0usize);
        loop {
            let n = mover
                .fill(&pipe, &file, offset, chunk)
                .map_err(|e| ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: format!(
                        "moving {name} from CRIU's pipe into {}: {e}",
                        path.display()
                    ),
                })?;
            if n == 0 {
                break;
            }
            let job = HashJob {
                name: Arc::clone(&shared),
                index,
                file: Arc::clone(&file),
                offset,
                len: n,
            };
            if hash.send(job).is_err() {
                return Err(ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: format!("the hashers stopped before {name} was whole"),
                });
            }
            let _ = flush.send((Arc::clone(&file), offset, n as u64));
            let total = self.written.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
            self.started.wait_for(total);
            offset += n as u64;
            index += 1;
            if n < chunk {
                // Short only at the end of the pipe.
                break;
            }
        }
        self.set(
            name,
            FileState::Written {
                size: offset,
                chunks: index,
            },
        );
        CaptureClock::mark(&self.clock.received);
        Ok(())
    }

    fn set(&self, name: &str, state: FileState) {
        self.lock().files.insert(name.to_string(), state);
        self.changed.notify_all();
    }

    /// The gate's verdict at CRIU's `post-dump` stage: waits until every file CRIU sent is
    /// written whole (into the page cache; the hashes may still run), and refuses if anything
    /// was refused or CRIU still holds a file open (after [`STILL_OPEN_WAIT`]).
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
            if open.is_empty() {
                return Ok(());
            }
            if since.elapsed() >= self.still_open_wait {
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

    /// Waits for the hashers, then every file received with its chunk digests, sorted by
    /// name; an error if any was refused, is not whole, or a chunk could not be hashed.
    pub(crate) fn into_files(self) -> Result<BTreeMap<String, FileEntry>, ImageError> {
        self.hashers.finish();
        CaptureClock::mark(&self.clock.hashed);
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
        let mut hashed =
            std::mem::take(&mut *self.hashers.done.lock().unwrap_or_else(|p| p.into_inner()));
        if let Some(e) = hashed.failure {
            return Err(e);
        }
        st.files
            .into_iter()
            .map(|(name, f)| {
                let not_whole = |what: &str| ImageError::Stream {
                    dir: self.dir.clone(),
                    reason: format!("{name}: {what}"),
                };
                let FileState::Written { size, chunks } = f else {
                    return Err(not_whole("not received whole"));
                };
                let digests = hashed.digests.remove(&name).unwrap_or_default();
                if digests.len() != chunks {
                    return Err(not_whole("not every chunk hashed"));
                }
                let chunks = digests
                    .into_iter()
                    .collect::<Option<Vec<String>>>()
                    .ok_or_else(|| not_whole("not every chunk hashed"))?;
                Ok((
                    name.clone(),
                    FileEntry {
                        name,
                        size,
                        sha256: String::new(),
                        chunks,
                    },
                ))
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
