//! The forwarder's durable position in the journal.
//!
//! A small JSON file, `{"seq": N, "journal_first": "<time of record 1>", "marks": [[seq, mark],
//! ..]}`, replaced atomically (temporary file in the same directory, `fsync`, `rename`, directory
//! `fsync`), so a crash leaves the old offset or the new one. `journal_first` tells a journal that
//! was replaced (a new host install, a restored backup) from the one the offset was taken in:
//! then the offset means nothing and forwarding starts over from the first record (at least
//! once, never a silent gap).
//!
//! `marks` name the records the position stands on: a power cut can take back records the
//! forwarder already sent (the journal's unsynced appends), after which new records reuse their
//! seqs, so a seq alone does not say which record it was. Each mark is a digest of one forwarded
//! record ([`record_mark`]: its seq, its append time to the nanosecond and its type), for `seq`
//! and for `seq` with its low bits cleared one by one (`seq & !1`, `seq & !3`, ...: at most 64,
//! each at most twice as far back as the one before). The forwarder resumes after the newest
//! mark whose record the journal still holds unchanged: records after it are sent again, at
//! most twice as many as a power cut replaced (see [`crate::forward`]).

use std::fs::File;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::OffsetError;

/// Where the forwarder is in the journal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Offset {
    /// The last `seq` the collector acknowledged.
    pub seq: u64,
    /// The time of the journal's first record (RFC 3339, as stored), naming the journal.
    #[serde(default)]
    pub journal_first: Option<String>,
    /// Digests of forwarded records at and below `seq` ([`record_mark`]), newest first: the
    /// proof that the journal still holds the records the position counts as sent. Empty in
    /// offsets of older builds (their `seq` is trusted as it is).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<(u64, String)>,
}

/// The seqs an offset at `seq` keeps a mark of: `seq`, then `seq` with its lowest set bit cleared,
/// again and again (newest first, no zero). A later position's set is made of seqs after `seq`
/// and of seqs of this set (two seqs in one aligned block of 2^k clear to the same seq), so a
/// forwarder needs the marks of what it sent since its last store, and those it stored.
pub fn mark_seqs(seq: u64) -> impl Iterator<Item = u64> {
    std::iter::successors(Some(seq).filter(|s| *s > 0), |s| {
        Some(s & (s - 1)).filter(|s| *s > 0)
    })
}

/// A digest naming one journal record: its seq, its append time (RFC 3339 with nanoseconds, as
/// stored) and its event type, hashed (BLAKE3, 64 bits in hex). The event's other fields are left
/// out on purpose: a later build may serialise an event with more (defaulted) fields, which must
/// not read as another record. A record that replaced a lost one after a power cut has another
/// time (a boot later) and, most often, another type.
pub fn record_mark(record: &cryo_journal::Record) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&record.seq.to_le_bytes());
    h.update(crate::forward::time_of(record).as_bytes());
    h.update(&[0]);
    h.update(crate::event_type(&record.event).as_bytes());
    let d = h.finalize();
    d.as_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

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
    fn an_offset_of_an_older_build_reads_without_marks() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("syslog.offset");
        std::fs::write(&p, r#"{"seq":7,"journal_first":null}"#).unwrap();
        let o = OffsetFile::new(&p).load().unwrap();
        assert_eq!((o.seq, o.marks.len()), (7, 0));
    }

    #[test]
    fn mark_seqs_clear_the_low_bits_one_by_one() {
        assert_eq!(mark_seqs(0).count(), 0);
        assert_eq!(mark_seqs(1).collect::<Vec<_>>(), [1]);
        assert_eq!(mark_seqs(10).collect::<Vec<_>>(), [10, 8]);
        assert_eq!(
            mark_seqs(0b1011_0111).collect::<Vec<_>>(),
            [
                0b1011_0111,
                0b1011_0110,
                0b1011_0100,
                0b1011_0000,
                0b1010_0000,
                0b1000_0000
            ]
        );
        assert_eq!(mark_seqs(u64::MAX).count(), 64);
        // A later position's seqs are its own since the earlier one, or the earlier one's.
        for a in 1..300u64 {
            for b in a..300u64 {
                let old: Vec<u64> = mark_seqs(a).collect();
                for s in mark_seqs(b) {
                    assert!(
                        s > a || old.contains(&s),
                        "{b} needs {s}, not among {a}'s {old:?}"
                    );
                }
            }
        }
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
