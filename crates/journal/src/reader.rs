//! Readers: no lock, never blocking a writer, never cutting anything.

use std::fs::File;
use std::io::{self, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use crate::error::ReadError;
use crate::frame::{scan, Corruption, Tail};
use crate::{Filter, Record, FILE_NAME};

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

/// Reads the whole journal in `dir`. A journal that does not exist yet reads as empty.
pub fn read(dir: impl AsRef<Path>) -> Result<Scan, ReadError> {
    Reader::new(dir).read_new()
}

/// Follows a journal: each [`Reader::read_new`] returns what was appended since the last call
/// (for streaming records off the host, or watching).
#[derive(Debug)]
pub struct Reader {
    path: PathBuf,
    file: Option<File>,
    /// End of the last valid frame returned.
    offset: u64,
}

impl Reader {
    /// A reader of the journal in `dir`, from its start. Does no I/O.
    pub fn new(dir: impl AsRef<Path>) -> Reader {
        Reader {
            path: dir.as_ref().join(FILE_NAME),
            file: None,
            offset: 0,
        }
    }

    /// Records appended since the last call (all of them the first time).
    pub fn read_new(&mut self) -> Result<Scan, ReadError> {
        let mut found = self.scan_from_offset()?;
        if !found.corruptions.is_empty() {
            // A writer may have been cutting a dead writer's torn tail and appending while we
            // read, which can make one read look damaged; damage that is really on disk is
            // still there when read a second time.
            found = self.scan_from_offset()?;
        }
        self.offset = found.valid_end;
        Ok(Scan {
            records: found.records,
            corruptions: found.corruptions,
            tail: found.tail,
        })
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
                Ok(f) => self.file = Some(f),
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
