//! Readers: no lock, never blocking a writer, never cutting anything.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crate::error::ReadError;
use crate::frame::{scan, Corruption, Tail};
use crate::{Event, Filter, Record, FILE_NAME};

/// What a read found.
#[derive(Debug, Clone, Default)]
pub struct Scan {
    /// Valid records, in file order.
    pub records: Vec<Record>,
    /// Damaged ranges that valid frames follow; their records are lost, and reported here.
    pub corruptions: Vec<Corruption>,
    /// Bytes after the last valid frame that no valid frame follows: a record being written
    /// right now, or a torn one the next writer will cut. Not an error.
    pub tail: Option<Tail>,
    /// The file at the journal's path was replaced by one that does not continue what this
    /// reader returned (another journal, not a rotation): these records are that file's from
    /// its first.
    pub restarted: bool,
    /// Seqs this reader skipped because no file it can read holds them any more (archives
    /// removed by the retention while it was behind, or damaged frames: [`Scan::corruptions`]),
    /// in order. Reported only where the reader follows seq by seq ([`Reader::after`], and every
    /// later read of a [`Reader::new`]/[`Reader::own`]), never for the carried copies a
    /// rotated segment starts with.
    pub gaps: Vec<Gap>,
}

/// A range of seqs a follower will never return: every seq from `first` to `last`, both
/// included, was journaled, and is lost to the follower.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Gap {
    /// The first seq lost.
    pub first: u64,
    /// The last seq lost.
    pub last: u64,
}

impl Gap {
    /// How many records were lost.
    pub fn lost(&self) -> u64 {
        self.last - self.first + 1
    }
}

impl Scan {
    /// The events of the valid records, in file order.
    pub fn into_events(self) -> Vec<crate::Event> {
        self.records.into_iter().map(|r| r.event).collect()
    }

    /// The records that `filter` keeps.
    pub fn filtered<'a>(&'a self, filter: &'a Filter) -> impl Iterator<Item = &'a Record> + 'a {
        self.records.iter().filter(move |r| filter.matches(r))
    }
}

/// Reads the whole journal in `dir` (its active segment: after a rotation, the records recovery
/// still needs and everything since; `cryo timeline --all` reads the archives too). A journal
/// that does not exist yet reads as empty.
pub fn read(dir: impl AsRef<Path>) -> Result<Scan, ReadError> {
    Reader::new(dir).read_new()
}

/// Reads one segment file of the journal whole (an archive, `journal.<seq>.log`), never through
/// a symlink.
pub fn read_segment(path: impl AsRef<Path>) -> Result<Scan, ReadError> {
    let path = path.as_ref();
    let found = read_archive(path).map_err(|source| ReadError::Open {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(Scan {
        records: found.records,
        corruptions: found.corruptions,
        tail: found.tail,
        restarted: false,
        gaps: Vec::new(),
    })
}

/// Reads every record the journal in `dir` still holds: its archives, oldest first, then its
/// active segment, each record once (by seq: a rotation's carried copies left out). For the
/// timeline of the whole history (`cryo timeline --all`); recovery reads [`read`]. An archive
/// that cannot be read is skipped and logged.
pub fn read_all(dir: impl AsRef<Path>) -> Result<Scan, ReadError> {
    Reader::after(dir, 0).read_new()
}

/// Follows a journal: each [`Reader::read_new`] returns what was appended since the last call
/// (for streaming records off the host, or watching), across rotations: every record once, in
/// seq order (a rotation's carried copies, whose seqs it has returned, skipped; what it has not
/// returned of a retired segment read from the segment it holds open, then from the archives).
#[derive(Debug)]
pub struct Reader {
    dir: PathBuf,
    path: PathBuf,
    file: Option<File>,
    /// Device and inode of `file`.
    identity: Option<(u64, u64)>,
    /// End of the last valid frame returned.
    offset: u64,
    /// The seq of the last record returned (or the starting point): later reads return only
    /// records after it.
    last: Option<u64>,
    /// From the active segment's own records ([`Reader::own`]).
    own: bool,
    /// Whether the next record returned must be the one after `last` (seq by seq: a jump is a
    /// gap). Not while a [`Reader::new`] reads a segment from its start (carried copies).
    contiguous: bool,
}

impl Reader {
    /// A reader of the journal in `dir`, from the start of its active segment. Does no I/O.
    pub fn new(dir: impl AsRef<Path>) -> Reader {
        Reader {
            dir: dir.as_ref().to_path_buf(),
            path: dir.as_ref().join(FILE_NAME),
            file: None,
            identity: None,
            offset: 0,
            last: None,
            own: false,
            contiguous: false,
        }
    }

    /// A reader of the records the active segment of the journal in `dir` holds as its own (the
    /// copies a rotation carried left out, no archive read), then of every later record: what
    /// was appended since the last rotation. Does no I/O.
    pub fn own(dir: impl AsRef<Path>) -> Reader {
        Reader {
            own: true,
            contiguous: true,
            ..Reader::new(dir)
        }
    }

    /// A reader of every record of the journal in `dir` after seq `after`, from the archives
    /// where the active segment does not hold them (0: every record the archives still hold).
    /// Does no I/O.
    pub fn after(dir: impl AsRef<Path>, after: u64) -> Reader {
        Reader {
            last: Some(after),
            contiguous: true,
            ..Reader::new(dir)
        }
    }

    /// Records appended since the last call (all of them the first time).
    pub fn read_new(&mut self) -> Result<Scan, ReadError> {
        let scan = self.read_next();
        if scan.is_ok() {
            // What follows the records returned comes seq by seq.
            self.contiguous = self.last.is_some();
        }
        scan
    }

    fn read_next(&mut self) -> Result<Scan, ReadError> {
        if self.file.is_none() {
            return self.open_and_read(false);
        }
        // Which file has the journal's name now, looked at before ours is read: once it names
        // another file, ours was retired before this look and holds its last record already.
        let at_path = identity_of(&self.path);
        let mut found = self.scan_from_offset()?;
        if !found.corruptions.is_empty() {
            // A writer may have been cutting a dead writer's torn tail and appending while we
            // read, which can make one read look damaged; damage that is really on disk is
            // still there when read a second time.
            found = self.scan_from_offset()?;
        }
        self.offset = found.valid_end;
        let mut gaps = Vec::new();
        let mut out = Scan {
            records: self.newer(found.records, &mut gaps),
            corruptions: found.corruptions,
            tail: found.tail,
            restarted: false,
            gaps,
        };
        if at_path.is_some() && at_path != self.identity {
            // Rotated (or replaced): go on in the file at the path.
            let next = self.open_and_read(true)?;
            if next.restarted {
                return Ok(next);
            }
            out.records.extend(next.records);
            out.corruptions.extend(next.corruptions);
            out.gaps.extend(next.gaps);
            out.tail = next.tail;
        }
        Ok(out)
    }

    /// Opens the file at the journal's path and reads it whole: what it holds after the last
    /// record returned (archives first where it does not hold them all), or everything in it
    /// with [`Scan::restarted`] if it replaced (`switched`) a file read before and does not
    /// continue it (another journal).
    fn open_and_read(&mut self, switched: bool) -> Result<Scan, ReadError> {
        self.file = None;
        self.identity = None;
        self.offset = 0;
        if self.file()?.is_none() {
            return Ok(Scan::default());
        }
        let mut found = self.scan_from_offset()?;
        if !found.corruptions.is_empty() {
            found = self.scan_from_offset()?;
        }
        self.offset = found.valid_end;
        let rotated = found.records.iter().find_map(|r| match &r.event {
            Event::Rotated {
                archive, last_seq, ..
            } => Some((archive.clone(), *last_seq)),
            _ => None,
        });
        let mut records = Vec::new();
        let mut corruptions = Vec::new();
        let mut restarted = false;
        if std::mem::take(&mut self.own) && self.last.is_none() {
            self.last = Some(rotated.as_ref().map_or(0, |(_, covered)| *covered));
        }
        match (self.last, rotated) {
            (None, _) => {}
            (Some(last), Some((archive, covered))) if last < covered => {
                // Records after `last` and up to `covered` are in the archives.
                let (old, bad) = self.archived_after(last, &archive);
                records = old;
                corruptions = bad;
            }
            (Some(last), None)
                if switched
                    && (found.records.first().is_some_and(|r| r.seq <= last)
                        || found.records.is_empty() && last > 0) =>
            {
                // Not a rotation of what was read: another journal at the path.
                tracing::warn!(path = %self.path.display(), after = last, "the journal file was replaced; reading it from its first record");
                self.last = None;
                self.contiguous = false;
                restarted = true;
            }
            _ => {}
        }
        records.extend(found.records);
        corruptions.extend(found.corruptions);
        let mut gaps = Vec::new();
        Ok(Scan {
            records: self.newer(records, &mut gaps),
            corruptions,
            tail: found.tail,
            restarted,
            gaps,
        })
    }

    /// The records after `last` in the archive `name` and the archives before it, oldest first,
    /// with their damage. An archive that is gone (retention) leaves a gap, logged.
    fn archived_after(&self, last: u64, name: &str) -> (Vec<Record>, Vec<Corruption>) {
        let mut chain: Vec<crate::frame::Scanned> = Vec::new();
        let mut next = Some(name.to_string());
        // Bounded: each archive names an older one, and there are at most as many as files.
        for _ in 0..4096 {
            let Some(name) = next.take() else { break };
            if crate::archive_seq(&name).is_none() {
                tracing::error!(archive = %name, "a rotation record names an archive that is no archive name; not read");
                break;
            }
            let path = self.dir.join(&name);
            let scanned = match read_archive(&path) {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, after = last, "an archive of the journal cannot be read: the records only it held are not returned");
                    break;
                }
            };
            next = scanned.records.iter().find_map(|r| match &r.event {
                Event::Rotated {
                    archive, last_seq, ..
                } if last < *last_seq => Some(archive.clone()),
                _ => None,
            });
            chain.push(scanned);
        }
        let mut records = Vec::new();
        let mut corruptions = Vec::new();
        for s in chain.into_iter().rev() {
            records.extend(s.records);
            corruptions.extend(s.corruptions);
        }
        (records, corruptions)
    }

    /// The records of `records` after the last one returned (in seq order: a later segment's
    /// carried copies dropped), remembering the last; a jump past the next seq, where the
    /// reader follows seq by seq, goes to `gaps`.
    fn newer(&mut self, records: Vec<Record>, gaps: &mut Vec<Gap>) -> Vec<Record> {
        let mut out = Vec::with_capacity(records.len());
        for r in records {
            if let Some(last) = self.last {
                if r.seq <= last {
                    continue;
                }
                if self.contiguous && r.seq > last + 1 {
                    gaps.push(Gap {
                        first: last + 1,
                        last: r.seq - 1,
                    });
                }
            }
            self.last = Some(r.seq);
            out.push(r);
        }
        out
    }

    fn scan_from_offset(&mut self) -> Result<crate::frame::Scanned, ReadError> {
        let offset = self.offset;
        let Some(file) = self.file()? else {
            return Ok(crate::frame::Scanned::default());
        };
        let mut buf = Vec::new();
        file.seek(SeekFrom::Start(offset))
            .and_then(|_| file.read_to_end(&mut buf))
            .map_err(|source| ReadError::Read {
                path: self.path.clone(),
                source,
            })?;
        Ok(scan(&buf, offset))
    }

    fn file(&mut self) -> Result<Option<&mut File>, ReadError> {
        if self.file.is_none() {
            match File::open(&self.path) {
                Ok(f) => {
                    self.identity = f.metadata().ok().map(|m| (m.dev(), m.ino()));
                    self.file = Some(f);
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
                Err(source) => {
                    return Err(ReadError::Open {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        }
        Ok(self.file.as_mut())
    }
}

/// Device and inode of the file at `path`, if there is one.
fn identity_of(path: &Path) -> Option<(u64, u64)> {
    std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()))
}

/// An archive, read whole: never through a symlink, and only a file the state directory's
/// rules trust (regular, owned by root or this user, not writable by group or others: anyone
/// else's records are not ours to return).
pub(crate) fn read_archive(path: &Path) -> io::Result<crate::frame::Scanned> {
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags((rustix::fs::OFlags::NOFOLLOW | rustix::fs::OFlags::NONBLOCK).bits() as i32)
        .open(path)?;
    if !crate::rotate::trusted(&f.metadata()?) {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "not a regular file only root or this user can write",
        ));
    }
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)?;
    Ok(scan(&buf, 0))
}
