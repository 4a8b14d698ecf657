//! The writer: one framed record per append, under an exclusive `flock`, then `fdatasync`.

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::SystemTime;

use rustix::fs::{flock, FlockOperation};

use crate::error::{AppendError, FileError, OpenError};
use crate::frame::{self, bounds};
use crate::{Event, Record, FILE_NAME};

/// An open journal, for appending. Cheap to share between threads (`&self` appends); any number
/// of processes may hold one on the same directory at once.
#[derive(Debug)]
pub struct Journal {
    pub(crate) dir: PathBuf,
    pub(crate) path: PathBuf,
    state: Mutex<State>,
    /// The file this writer appends to now, for its [`Syncer`]s (a rotation replaces it).
    current: Arc<Mutex<Arc<File>>>,
}

#[derive(Debug)]
pub(crate) struct State {
    pub(crate) file: Arc<File>,
    /// End of the last valid frame as this writer last saw it; `None` after an error, which
    /// forces a full scan at the next append.
    pub(crate) end: Option<u64>,
    pub(crate) last_seq: u64,
}

impl Journal {
    /// Opens (creating if needed) the journal in `dir`, and cuts a torn tail if a writer died
    /// mid-append; the cut is itself journaled as [`Event::JournalRepaired`].
    pub fn open(dir: impl AsRef<Path>) -> Result<Journal, OpenError> {
        let dir = dir.as_ref().to_path_buf();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o750)
            .create(&dir)
            .map_err(|source| OpenError::CreateDir {
                path: dir.clone(),
                source,
            })?;
        let path = dir.join(FILE_NAME);
        let file = Arc::new(open_file(&dir, &path)?);
        let journal = Journal {
            dir,
            path,
            state: Mutex::new(State {
                file: Arc::clone(&file),
                end: None,
                last_seq: 0,
            }),
            current: Arc::new(Mutex::new(file)),
        };
        let size = journal.locked(|st| -> Result<u64, OpenError> {
            if let Some(repair) = journal.sync_tail(st)? {
                journal.write_record(st, repair)?;
            }
            Ok(st.end.unwrap_or(0))
        })?;
        // A node without an agent (which rotates far earlier, at a quiet moment) rotates here,
        // rarely: once per STANDALONE_ROTATE_BYTES appended. A failure leaves the journal as it
        // was, and this open goes on.
        if size > crate::STANDALONE_ROTATE_BYTES {
            if let Err(err) =
                journal.maintain(crate::STANDALONE_ROTATE_BYTES, crate::Retention::default())
            {
                tracing::warn!(%err, "cannot rotate the journal; it stays as it is");
            }
        }
        Ok(journal)
    }

    /// The journal's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The journal file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `event` and returns the record as written, once it is on stable storage
    /// (`fdatasync` returned). Blocks while another writer (thread or process) appends.
    pub fn append(&self, event: Event) -> Result<Record, AppendError> {
        self.locked(|st| {
            if let Some(repair) = self.sync_tail(st)? {
                self.write_record(st, repair)?;
            }
            self.write_record(st, event)
        })
    }

    /// Appends `events` in order, at once: one `write` of all their frames and one
    /// `fdatasync`, under one lock (no other writer's record falls between them). Returns the
    /// records as written, once they are all on stable storage. A writer killed mid-write
    /// leaves a prefix of them (whole records, then at most one torn frame that the next
    /// writer cuts), as if it had appended them one by one and died between two. Nothing is
    /// written for an empty list.
    pub fn append_all(&self, events: Vec<Event>) -> Result<Vec<Record>, AppendError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        self.locked(|st| {
            if let Some(repair) = self.sync_tail(st)? {
                self.write_record(st, repair)?;
            }
            self.write_records(st, events)
        })
    }

    /// As [`Journal::append_all`], but returns once the frames are written, without waiting
    /// for stable storage: the records are in the file (a reader sees them; a writer killed
    /// after this returns loses nothing), and a power cut may lose them (a torn tail the next
    /// writer cuts) until an append that syncs returns, this writer's or another's
    /// (`fdatasync` syncs every byte of the file). For records that no recovery needs on disk
    /// before the next synced append: what may happen between them must be safe to recover
    /// without them. A write the file system refuses (full, read-only) is still an error here.
    pub fn append_unsynced(&self, events: Vec<Event>) -> Result<Vec<Record>, AppendError> {
        if events.is_empty() {
            return Ok(Vec::new());
        }
        self.locked(|st| {
            if let Some(repair) = self.sync_tail(st)? {
                self.write_record(st, repair)?;
            }
            self.write_records_as(st, events, Durable::Later)
        })
    }

    /// A handle that makes every record written to the journal so far durable from any thread
    /// ([`Syncer::sync`]: one `fdatasync`, which syncs every byte of the file, whoever wrote
    /// it), so that what [`Journal::append_unsynced`] wrote can be synced beside other work and
    /// waited for where it must be on disk.
    ///
    /// After a rotation the records are in another file than before: the syncer syncs the file
    /// its journal appends to when [`Syncer::sync`] is called (a rotation by another process
    /// synced the segment it retired before it let anyone append again).
    pub fn syncer(&self) -> Result<Syncer, AppendError> {
        Ok(Syncer {
            current: Arc::clone(&self.current),
            path: self.path.clone(),
        })
    }

    /// Runs `f` holding both the in-process mutex (threads share one open file, and `flock`
    /// does not exclude holders of the same open file) and the `flock` (other processes), on
    /// the journal file that is at the journal's path now: a writer that finds it holds a file
    /// a rotation retired (another inode at the path once it has the lock) opens the new one
    /// and locks again, so no append lands in a retired segment.
    pub(crate) fn locked<T, E: From<FileError>>(
        &self,
        f: impl FnOnce(&mut State) -> Result<T, E>,
    ) -> Result<T, E> {
        // A panic mid-append leaves nothing in `State` that the next `sync_tail` (which
        // re-reads the file under the lock) does not correct.
        let mut st = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            flock(&*st.file, FlockOperation::LockExclusive).map_err(|e| FileError {
                what: "cannot lock",
                path: self.path.clone(),
                source: e.into(),
            })?;
            match self.is_current(&st.file) {
                Ok(true) => break,
                Ok(false) => {}
                Err(e) => {
                    unlock(&st.file, &self.path);
                    return Err(e.into());
                }
            }
            // Rotated under us (or removed): the rotator held this lock until the new file was
            // in place, so what is at the path now is the journal.
            unlock(&st.file, &self.path);
            let file = Arc::new(open_file(&self.dir, &self.path).map_err(|e| match e {
                OpenError::File(f) => f,
                other => FileError {
                    what: "cannot open again",
                    path: self.path.clone(),
                    source: io::Error::other(other.to_string()),
                },
            })?);
            st.file = Arc::clone(&file);
            st.end = None;
            st.last_seq = 0;
            *self.current.lock().unwrap_or_else(PoisonError::into_inner) = file;
        }
        let out = f(&mut st);
        unlock(&st.file, &self.path);
        out
    }

    /// Whether `file` is the one at the journal's path (same device and inode).
    fn is_current(&self, file: &File) -> Result<bool, FileError> {
        use std::os::unix::fs::MetadataExt;
        let held = file.metadata().map_err(self.io_err("cannot stat"))?;
        match std::fs::metadata(&self.path) {
            Ok(m) => Ok(m.dev() == held.dev() && m.ino() == held.ino()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
            Err(e) => Err(self.io_err("cannot stat")(e)),
        }
    }

    /// Makes the file appends go to now the one [`Syncer`]s sync.
    pub(crate) fn set_current(&self, file: Arc<File>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = file;
    }

    pub(crate) fn io_err(&self, what: &'static str) -> impl FnOnce(io::Error) -> FileError + '_ {
        move |source| FileError {
            what,
            path: self.path.clone(),
            source,
        }
    }

    /// Under the lock: validates what other writers appended since our last look, learns the
    /// last seq, and cuts a torn tail. Returns the repair event to journal, if it cut anything.
    pub(crate) fn sync_tail(&self, st: &mut State) -> Result<Option<Event>, FileError> {
        let size = st
            .file
            .metadata()
            .map_err(self.io_err("cannot stat"))?
            .len();
        let from = match st.end {
            Some(end) if end == size => return Ok(None),
            Some(end) if end < size => end,
            _ => {
                st.last_seq = 0;
                0
            }
        };
        let mut buf = vec![0u8; usize::try_from(size - from).unwrap_or(usize::MAX)];
        st.file
            .read_exact_at(&mut buf, from)
            .map_err(self.io_err("cannot read"))?;
        // Frames checked, only the last record decoded: the open of a long journal costs its
        // read and checksums, not a decode of every record.
        let found = bounds(&buf, from);
        for c in &found.corruptions {
            tracing::error!(path = %self.path.display(), "{c}; the records after it are kept");
        }
        if let Some(last) = found.last_seq {
            st.last_seq = st.last_seq.max(last);
        }
        let mut repair = None;
        if let Some(tail) = &found.tail {
            tracing::warn!(
                path = %self.path.display(),
                offset = tail.offset,
                bytes = tail.len,
                fault = %tail.fault,
                "cutting the torn tail of the journal"
            );
            st.file
                .set_len(tail.offset)
                .map_err(self.io_err("cannot truncate"))?;
            st.file
                .sync_data()
                .map_err(self.io_err("cannot fdatasync"))?;
            repair = Some(Event::JournalRepaired {
                offset: tail.offset,
                bytes: tail.len,
            });
        }
        st.end = Some(found.valid_end);
        Ok(repair)
    }

    /// Under the lock, with the tail known good: writes one frame and syncs it.
    pub(crate) fn write_record(&self, st: &mut State, event: Event) -> Result<Record, AppendError> {
        let record = Record {
            seq: st.last_seq + 1,
            time: SystemTime::now(),
            event,
        };
        let frame = encode(&record)?;
        self.write_frames(st, &frame, record.seq, Durable::Now)?;
        Ok(record)
    }

    /// Under the lock, with the tail known good: writes the frames of `events` (one `write`)
    /// and syncs them (one `fdatasync`).
    fn write_records(
        &self,
        st: &mut State,
        events: Vec<Event>,
    ) -> Result<Vec<Record>, AppendError> {
        self.write_records_as(st, events, Durable::Now)
    }

    /// As [`Journal::write_records`], syncing now or not.
    fn write_records_as(
        &self,
        st: &mut State,
        events: Vec<Event>,
        sync: Durable,
    ) -> Result<Vec<Record>, AppendError> {
        let time = SystemTime::now();
        let mut records = Vec::with_capacity(events.len());
        let mut frames = Vec::new();
        for (seq, event) in (st.last_seq + 1..).zip(events) {
            let record = Record { seq, time, event };
            frames.extend_from_slice(&encode(&record)?);
            records.push(record);
        }
        let last = records.last().map_or(st.last_seq, |r| r.seq);
        self.write_frames(st, &frames, last, sync)?;
        Ok(records)
    }

    /// Under the lock: appends `frames` (whole frames, the last of seq `last`) and syncs them
    /// (or not: [`Durable::Later`]).
    fn write_frames(
        &self,
        st: &mut State,
        frames: &[u8],
        last: u64,
        sync: Durable,
    ) -> Result<(), AppendError> {
        // One write() of the whole frames (O_APPEND), so a concurrent reader sees them grow
        // from the front and a kill leaves at most a prefix of them.
        let written = (&*st.file)
            .write_all(frames)
            .map_err(self.io_err("cannot write"))
            .and_then(|()| match sync {
                Durable::Now if sync_fails() => Err(self.io_err("cannot fdatasync")(
                    io::Error::from_raw_os_error(rustix::io::Errno::IO.raw_os_error()),
                )),
                Durable::Now => st.file.sync_data().map_err(self.io_err("cannot fdatasync")),
                Durable::Later => Ok(()),
            });
        match written {
            Ok(()) => {
                st.end = st.end.map(|e| e + frames.len() as u64);
                st.last_seq = last;
                Ok(())
            }
            Err(e) => {
                // A partial frame may be on disk: the next append rescans and cuts it.
                st.end = None;
                Err(e.into())
            }
        }
    }
}

/// Failpoint (a test hook, `CRYO_FAILPOINT=journal-sync-eio`; the variable is the one
/// `cryo_lifecycle::failpoint` reads): every append that syncs writes its frames, then fails
/// as an `fdatasync` that met an I/O error does (EIO): the records are in the file, not known
/// to be on stable storage.
pub const SYNC_FAILPOINT: &str = "journal-sync-eio";

/// Whether [`SYNC_FAILPOINT`] is active (one `getenv` per synced append).
fn sync_fails() -> bool {
    std::env::var_os("CRYO_FAILPOINT").is_some_and(|v| v == SYNC_FAILPOINT)
}

/// The journal's file, to sync from another thread ([`Journal::syncer`]).
#[derive(Debug)]
pub struct Syncer {
    /// The file its journal appends to now (shared with it: a rotation replaces it).
    current: Arc<Mutex<Arc<File>>>,
    path: PathBuf,
}

impl Syncer {
    /// The file a sync syncs now.
    #[cfg(test)]
    pub(crate) fn file(&self) -> Arc<File> {
        Arc::clone(&self.current.lock().unwrap_or_else(PoisonError::into_inner))
    }

    /// Returns once every record written to the journal before this call is on stable storage
    /// (fails as every sync does under [`SYNC_FAILPOINT`]): the records its journal wrote are in
    /// the file it appends to now, or in a segment a rotation retired, which the rotator synced
    /// before it let anyone append again (their copies it carried included).
    pub fn sync(&self) -> Result<(), AppendError> {
        // Cloned out of the lock: an `fdatasync` never holds up a rotation's switch.
        let file = Arc::clone(&self.current.lock().unwrap_or_else(PoisonError::into_inner));
        let synced = if sync_fails() {
            Err(io::Error::from_raw_os_error(
                rustix::io::Errno::IO.raw_os_error(),
            ))
        } else {
            file.sync_data()
        };
        synced.map_err(|source| {
            AppendError::File(FileError {
                what: "cannot fdatasync",
                path: self.path.clone(),
                source,
            })
        })
    }
}

/// Whether an append waits for stable storage.
#[derive(Debug, Clone, Copy)]
enum Durable {
    /// `fdatasync` before it returns.
    Now,
    /// The next synced append (any writer's) makes it durable.
    Later,
}

/// Opens (creating if needed) the journal file at `path` in `dir` for appending.
fn open_file(dir: &Path, path: &Path) -> Result<File, OpenError> {
    let file = OpenOptions::new()
        .read(true)
        .append(true)
        .create(true)
        .mode(0o640)
        .open(path)
        .map_err(|source| OpenError::OpenFile {
            path: path.to_path_buf(),
            source,
        })?;
    // Make the file's directory entry durable, or a power cut could lose the whole journal.
    // Once, before the first frame: every writer opens the journal before it appends, and
    // one that finds the file empty syncs the directory, so a file that holds a frame had
    // its entry synced after it was created (by the writer that found it empty). A journal
    // cut back to nothing is synced again, which does no harm. (A rotation syncs the
    // directory itself after its rename, before any writer may append to the new file.)
    let empty = file
        .metadata()
        .map_err(|source| OpenError::OpenFile {
            path: path.to_path_buf(),
            source,
        })?
        .len()
        == 0;
    if empty {
        sync_dir(dir).map_err(|source| OpenError::SyncDir {
            path: dir.to_path_buf(),
            source,
        })?;
    }
    Ok(file)
}

/// `fsync` of a directory (its entries durable).
pub(crate) fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

/// Releases the `flock` on `file` (a failure is only logged: closing the file releases it).
pub(crate) fn unlock(file: &File, path: &Path) {
    if let Err(err) = flock(file, FlockOperation::Unlock) {
        tracing::warn!(%err, path = %path.display(), "cannot unlock the journal");
    }
}

/// One record's frame.
pub(crate) fn encode(record: &Record) -> Result<Vec<u8>, AppendError> {
    let payload = serde_json::to_vec(record).map_err(AppendError::Encode)?;
    frame::encode(&payload).ok_or(AppendError::TooLarge {
        len: payload.len(),
        max: frame::MAX_PAYLOAD,
    })
}
