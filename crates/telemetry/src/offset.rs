//! The forwarder's durable position in the journal.
//!
//! A small JSON file, `{"seq": N, "journal_first": "<time of record 1>", "marks": [[seq, mark],
//! ..]}`, replaced atomically (temporary file in the same directory, `fsync`, `rename`, directory
//! `fsync`), so a crash leaves the old offset or the new one. `journal_first` tells a journal that
//! was replaced (a new host install, a restored backup) from the one the offset was taken in:
//! then the offset means nothing and forwarding starts over from the first record (at least
//! once, never a silent gap).
//!
//! `marks` name the records the position stands on (a power cut can take back records the
//! forwarder already sent, after which new records reuse their seqs): the journal's
//! [`cryo_journal::Position`], the one home of that mechanism, which the agent's Kubernetes
//! Events use too.

use std::fs::File;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use crate::error::OffsetError;

/// Where the forwarder is in the journal: the journal's [`cryo_journal::Position`] (its seq,
/// the journal's identity, the marks of the records it stands on).
pub type Offset = cryo_journal::Position;

/// The offset file at a path.
#[derive(Debug, Clone)]
pub struct OffsetFile {
    path: PathBuf,
}

impl OffsetFile {
    /// The offset file at `path` (its directory must exist when it is written).
    pub fn new(path: impl Into<PathBuf>) -> OffsetFile {
        OffsetFile { path: path.into() }
    }

    /// Its path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The stored offset; the default (nothing sent yet) when there is no file.
    pub fn load(&self) -> Result<Offset, OffsetError> {
        let text = match std::fs::read_to_string(&self.path) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Offset::default()),
            Err(source) => {
                return Err(OffsetError::Read {
                    path: self.path.clone(),
                    source,
                })
            }
        };
        serde_json::from_str(&text).map_err(|source| OffsetError::Parse {
            path: self.path.clone(),
            source,
        })
    }

    /// Replaces the stored offset atomically and durably.
    pub fn store(&self, offset: &Offset) -> Result<(), OffsetError> {
        let err = |source| OffsetError::Write {
            path: self.path.clone(),
            source,
        };
        let dir = match self.path.parent() {
            Some(d) if !d.as_os_str().is_empty() => d,
            _ => Path::new("."),
        };
        let mut tmp = tempfile::Builder::new()
            .prefix(".offset-")
            .tempfile_in(dir)
            .map_err(err)?;
        let body = serde_json::to_vec(offset).map_err(|e| err(e.into()))?;
        tmp.write_all(&body)
            .and_then(|()| tmp.as_file().sync_data())
            .map_err(err)?;
        tmp.persist(&self.path).map_err(|e| err(e.error))?;
        File::open(dir).and_then(|d| d.sync_all()).map_err(err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_reads_as_start_and_round_trips() {
        let dir = tempfile::tempdir().unwrap();
        let f = OffsetFile::new(dir.path().join("syslog.offset"));
        assert_eq!(f.load().unwrap(), Offset::default());
        let o = Offset {
            seq: 41,
            journal_first: Some("2026-11-30T02:41:07.000000001Z".into()),
            marks: vec![(41, "00ff".into()), (40, "0a0b".into())],
        };
        f.store(&o).unwrap();
        assert_eq!(f.load().unwrap(), o);
        f.store(&Offset { seq: 42, ..o }).unwrap();
        assert_eq!(f.load().unwrap().seq, 42);
        // Only the file itself is left (no temporary files).
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }

    #[test]
    fn garbage_is_an_error_not_an_offset() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("syslog.offset");
        std::fs::write(&p, "not json").unwrap();
        assert!(matches!(
            OffsetFile::new(&p).load(),
            Err(OffsetError::Parse { .. })
        ));
    }
}
