//! cryo's journal: an append-only, checksummed, fsync'd event log on the node, and the timeline
//! that `cryo timeline` prints from it.
//!
//! Every step of stop, freeze, thaw and guard is journaled before it acts (an intent) and after
//! (an outcome), so after a crash or a power cut cryo knows what was in flight
//! ([`in_flight_stops`]) and which live processes came from a restore ([`Origins`]).
//!
//! # Design
//! - One file, `DIR/journal.log`, of frames: a 16-byte header (magic `CRJ1`, payload length,
//!   CRC32C of the payload, CRC32C of the header) and a JSON [`Record`] `{seq, time, event}`.
//! - **Writers** ([`Journal`]; `cryo stop`, `cryo thaw`, the guard, possibly at once in several
//!   processes) take an exclusive `flock` for each append, check what was appended since they
//!   last looked (checksums, last `seq`), cut a torn tail left by a writer that died mid-append,
//!   append one frame with a single `write` on an `O_APPEND` file, `fdatasync`, and unlock. The
//!   kernel drops the lock of a killed writer, so a crash never blocks the others. A cut is
//!   itself journaled ([`Event::JournalRepaired`]). A writer checks frames (magic, both
//!   checksums) but decodes only the last record (for its seq): its open reads the file, it
//!   does not parse every record.
//! - **Unsynced appends** ([`Journal::append_unsynced`]): written under the lock like any other,
//!   not waited for: a killed writer loses nothing it was told was written (the page cache
//!   keeps it), a power cut may (a torn tail the next writer cuts) until the next synced append
//!   of any writer. For records no recovery needs on disk before the next synced one (the
//!   freeze's `FreezeStarted`, `CheckpointStarted` once the lock's intent is on disk, `Dumped`):
//!   the caller states why at each use.
//! - The directory is synced when a writer opens an empty file (its creation made durable
//!   before the first frame), not at every open.
//! - **Readers** ([`read`], [`Reader`]) take no lock and never write: they stop at the first
//!   partial or bad frame that no valid frame follows (it may be a record being written now)
//!   and report it as [`Scan::tail`], not as an error.
//! - **Damage in the middle** (a bad frame with a valid frame after it, e.g. a flipped bit) is
//!   never misread: both checksums must match before a payload is parsed. The reader reports it
//!   as a [`Corruption`] with its offset and resynchronises on the next intact frame (magic,
//!   header checksum and payload checksum all valid), so one damaged record does not hide the
//!   rest. Writers keep such damage in place (cutting there would throw away good records).
//! - **Rotation** ([`Journal::rotate`], module `rotate`): the active segment is archived
//!   (`journal.<seq>.log`, a hard link) and replaced, atomically, by one that starts with the
//!   records recovery still needs (every record of a process that may be alive, of a dead one a
//!   guard still acts on, of an unfinished standby or dump pinning: [`carried`]), then an
//!   [`Event::Rotated`]. Recovery reads the active segment only ([`read`]); followers
//!   ([`Reader`]) cross a rotation returning every record once; the whole history is
//!   [`read_all`]. Writers that hold the retired file notice it after their `flock` (another
//!   inode at the path) and move on.
//!
//! # Limitations
//! - A damaged *last* frame cannot be told from a torn write: a writer cuts it (and journals the
//!   cut with its offset and size). A record damaged that way is lost.
//! - Each writer reads and checksums the whole active segment once when it opens the journal
//!   (not a decode: 0.8 ms at 10,000 records where decoding them takes 62 ms, load 12-18; the
//!   `open_bench` example); later appends read only what other writers appended since. Readers
//!   ([`read`]) decode every record of the active segment: O(records since the last rotation,
//!   plus the carried ones).
//! - Processes are identified by pid and start time read from `/proc` in cryo's pid namespace.

mod error;
mod event;
mod frame;
mod position;
mod procid;
mod query;
mod reader;
mod rotate;
mod timeline;
mod writer;

pub use error::{AppendError, FileError, OpenError, ReadError, RotateError, SinceError};
pub use event::{AttachSource, Event, Phase, PinnedCpus, Purpose, Record};
pub use frame::{Corruption, FrameFault, Tail, MAX_PAYLOAD};
pub use position::{
    event_type, journal_first, mark_seqs, record_mark, record_time, Marks, Position, Resume,
};
pub use procid::ProcId;
pub use query::{
    guarded, in_flight_stops, last_steps, open_pins, pinned, Filter, InFlight, OpenPins, Origin,
    Origins, StopStep,
};
pub use reader::{read, read_all, read_segment, Gap, Reader, Scan};
pub use rotate::{
    archive_name, archive_seq, archives, carried, may_be_alive, Carry, Retention, Rotation,
    AGENT_ROTATE_BYTES, NEXT_NAME, ROTATE_DECODED, ROTATE_LINKED, ROTATE_NEXT_WRITTEN,
    ROTATE_RENAMED, STANDALONE_ROTATE_BYTES,
};
pub use timeline::{fmt_utc, parse_since, parse_since_at, render_json, render_timeline, Subsec};
pub use writer::{Journal, Syncer, SYNC_FAILPOINT};

/// Name of the journal file inside the journal directory.
pub const FILE_NAME: &str = "journal.log";
