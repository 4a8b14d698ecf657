//! Errors, one enum per operation.

use std::io;
use std::path::PathBuf;

/// A file operation on the journal failed.
#[derive(Debug, thiserror::Error)]
#[error("{what} journal file {path}: {source}")]
pub struct FileError {
    /// What was being done (`cannot fdatasync`).
    pub what: &'static str,
    /// The journal file.
    pub path: PathBuf,
    /// The error.
    pub source: io::Error,
}

/// Opening a journal for writing failed.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The directory could not be created.
    #[error("cannot create journal directory {path}: {source}")]
    CreateDir {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The file could not be opened or created.
    #[error("cannot open journal file {path}: {source}")]
    OpenFile {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The directory could not be synced after creating the file.
    #[error("cannot fsync journal directory {path}: {source}")]
    SyncDir {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Checking or repairing the tail failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// Journaling the repair of a torn tail failed.
    #[error("cannot journal the repair of a torn tail: {0}")]
    Repair(#[from] AppendError),
}

/// Appending a record failed. The record may or may not be on disk; the next append finds out.
#[derive(Debug, thiserror::Error)]
pub enum AppendError {
    /// Locking, reading, cutting, writing or syncing the file failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// The record could not be serialized.
    #[error("cannot serialize the record: {0}")]
    Encode(serde_json::Error),
    /// The serialized record is larger than a frame may be.
    #[error("record of {len} bytes exceeds the frame limit of {max} bytes")]
    TooLarge {
        /// Serialized size.
        len: usize,
        /// The limit.
        max: usize,
    },
}

/// Reading the journal failed (damage is not an error: see [`crate::Scan`]).
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The file exists but could not be opened.
    #[error("cannot open journal file {path}: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// Reading failed.
    #[error("cannot read journal file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

/// A `--since` value was neither an RFC 3339 time nor a relative duration.
#[derive(Debug, thiserror::Error)]
#[error(
    "invalid time {input:?}: expected RFC 3339 (2026-11-30T02:41:07Z) or a duration ago (10m, 2h)"
)]
pub struct SinceError {
    /// The value given.
    pub input: String,
}

/// Rotating the journal failed: the active segment is the old one, whole (a crash or error at
/// any step leaves it so; what a failed step left, a `.next` or an archive link, the next
/// rotation replaces or reuses).
#[derive(Debug, thiserror::Error)]
pub enum RotateError {
    /// Locking, reading, writing, syncing, linking or renaming failed.
    #[error(transparent)]
    File(#[from] FileError),
    /// Journaling the repair of a torn tail, or encoding the rotation record, failed.
    #[error(transparent)]
    Append(#[from] AppendError),
    /// The archive's name is taken by another file than the active segment (not ours to
    /// replace).
    #[error("cannot archive the journal as {path}: another file has that name")]
    ArchiveTaken {
        /// The archive path.
        path: PathBuf,
    },
}
