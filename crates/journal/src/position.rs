//! A follower's durable position in the journal that a power cut, a replaced journal or a pruned
//! archive cannot fool: the one home of what every consumer that resumes after a stored `seq`
//! needs (the syslog forwarder, the agent's Kubernetes Events).
//!
//! # Design
//! A bare `seq` is not enough. The journal's unsynced appends can be lost in a power cut after a
//! follower handed them on; the records written after the next boot then take the lost records'
//! seqs, and a follower resuming "after seq N" would skip them. So a [`Position`] carries marks
//! of the records it stands on ([`record_mark`]: a digest of one record's seq, append time to
//! the nanosecond and event type), for `seq` and for `seq` with its low bits cleared one by one
//! ([`mark_seqs`]: at most 64, each at most twice as far back as the one before), and the time
//! of the journal's first record (`journal_first`), naming the journal it was taken in.
//! [`Position::resume`] finds where to resume: after the newest mark whose record the journal
//! still holds unchanged (what a power cut leaves of a journal is a prefix of what was
//! written), so records after it are handed on again, at most about twice as many as the power
//! cut replaced, none skipped; from the first record when the journal is another one. Records
//! no file holds any more when the follower comes to them (archives pruned while it was behind)
//! are reported by the journal's reader as [`crate::Gap`]s (`Scan::gaps`), which a consumer
//! must report in turn. [`Marks`] keeps the marks a consumer needs between two stores.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Event, Reader, Record, Scan};

/// Where a follower is in the journal, as stored.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// The last `seq` handed on.
    pub seq: u64,
    /// The time of the journal's first record (RFC 3339, as stored), naming the journal.
    #[serde(default)]
    pub journal_first: Option<String>,
    /// Digests of records at and below `seq` ([`record_mark`]), newest first: the proof that the
    /// journal still holds the records the position counts as handed on. Empty in positions of
    /// older builds (their `seq` is trusted as it is).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub marks: Vec<(u64, String)>,
}

/// Where a follower resumes ([`Position::resume`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Resume {
    /// Resume after this seq.
    pub after: u64,
    /// Seqs the follower handed on that now name other records (a power cut took the first ones
    /// back and new records reused their seqs): `(first, last)`, to tell whoever got them.
    pub replaced: Option<(u64, u64)>,
    /// The position belongs to another journal than the one there now: resumed from its first
    /// record.
    pub other_journal: bool,
    /// The identity of the journal there now ([`Position::journal_first`]), when known.
    pub journal_first: Option<String>,
}

/// The seqs a position at `seq` keeps a mark of: `seq`, then `seq` with its lowest set bit
/// cleared, again and again (newest first, no zero). A later position's set is made of seqs after
/// `seq` and of seqs of this set (two seqs in one aligned block of 2^k clear to the same seq), so
/// a follower needs the marks of what it handed on since its last store, and those it stored.
pub fn mark_seqs(seq: u64) -> impl Iterator<Item = u64> {
    std::iter::successors(Some(seq).filter(|s| *s > 0), |s| {
        Some(s & (s - 1)).filter(|s| *s > 0)
    })
}

/// A record's append time as stored (RFC 3339 with nanoseconds).
pub fn record_time(r: &Record) -> String {
    serde_json::to_value(r)
        .ok()
        .and_then(|v| v.get("time").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_default()
}

/// An event's type as stored (`locked`, `parked`, ...; `unknown` for one this build cannot
/// name).
pub fn event_type(event: &Event) -> String {
    serde_json::to_value(event)
        .ok()
        .and_then(|v| v.get("type").and_then(|t| t.as_str()).map(str::to_owned))
        .unwrap_or_else(|| "unknown".to_owned())
}

/// A digest naming one journal record: its seq, its append time (RFC 3339 with nanoseconds, as
/// stored) and its event type, hashed (BLAKE3, 64 bits in hex). The event's other fields are left
/// out on purpose: a later build may serialise an event with more (defaulted) fields, which must
/// not read as another record. A record that replaced a lost one after a power cut has another
/// time (a boot later) and, most often, another type.
pub fn record_mark(record: &Record) -> String {
    let mut h = blake3::Hasher::new();
    h.update(&record.seq.to_le_bytes());
    h.update(record_time(record).as_bytes());
    h.update(&[0]);
    h.update(event_type(&record.event).as_bytes());
    let d = h.finalize();
    d.as_bytes()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The identity of the journal `active` (its active segment) is: the time of its first record,
/// which a rotated segment keeps in its rotation record (its own first record is a carried one,
/// or the rotation's).
pub fn journal_first(active: &Scan) -> Option<String> {
    active
        .records
        .iter()
        .find_map(|r| match &r.event {
            Event::Rotated { origin, .. } => Some(origin.clone()),
            _ => None,
        })
        .unwrap_or_else(|| {
            active
                .records
                .first()
                .filter(|r| r.seq == 1)
                .map(record_time)
        })
}

impl Position {
    /// Where a follower stored at this position resumes in the journal in `dir` (whose active
    /// segment `active` is, read a moment ago): after the position when the journal still holds
    /// the records its marks name (or it has none); after the newest mark still held when a
    /// power cut replaced the records after it (saying which seqs now name other records); from
    /// the first record when the position is another journal's. `what` names the follower in
    /// the warnings logged.
    pub fn resume(&self, dir: &Path, active: &Scan, what: &str) -> Resume {
        let first = journal_first(active);
        let last = active.records.last().map_or(0, |r| r.seq);
        let other_journal = matches!((&self.journal_first, &first), (Some(a), Some(b)) if a != b);
        let mut out = Resume {
            after: self.seq,
            journal_first: first.or_else(|| self.journal_first.clone()),
            ..Resume::default()
        };
        if other_journal || self.marks.is_empty() && self.seq > last {
            tracing::warn!(
                position = self.seq,
                journal_last = last,
                "{what}: the stored position belongs to another journal; following this one from its first record"
            );
            out.after = 0;
            out.other_journal = true;
        } else if !self.marks.is_empty() {
            let proven = self.proven(dir, active);
            if proven < self.seq {
                tracing::warn!(
                    position = self.seq,
                    resume_after = proven,
                    journal_last = last,
                    "{what}: the journal no longer holds the records the stored position counts as handed on (a power cut took back unsynced records and new ones reused their seqs): following again after the last record proven handed on; some records are handed on twice"
                );
                out.replaced = Some((proven + 1, self.seq));
                out.after = proven;
            }
        }
        out
    }

    /// The newest seq among the marks whose record the journal still holds unchanged (0 if
    /// none): the records before it are those handed on, those after it may not be.
    fn proven(&self, dir: &Path, active: &Scan) -> u64 {
        let mut marks = self.marks.clone();
        marks.sort_unstable_by_key(|m| std::cmp::Reverse(m.0));
        let wanted: HashSet<u64> = marks.iter().map(|(s, _)| *s).collect();
        let mut held: HashMap<u64, String> = active
            .records
            .iter()
            .filter(|r| wanted.contains(&r.seq))
            .map(|r| (r.seq, record_mark(r)))
            .collect();
        let last = active.records.last().map_or(0, |r| r.seq);
        // The oldest record the journal holds at or after the oldest mark, once the archives
        // were read.
        let mut oldest_held = None;
        for (seq, mark) in &marks {
            if !held.contains_key(seq) && *seq <= last && oldest_held.is_none() {
                // A record the active segment no longer holds (the follower was behind a
                // rotation): the archives, read once, from the oldest mark on.
                let oldest = marks.last().map_or(*seq, |(s, _)| *s);
                match Reader::after(dir, oldest.saturating_sub(1)).read_new() {
                    Ok(scan) => {
                        oldest_held = Some(scan.records.first().map_or(u64::MAX, |r| r.seq));
                        held.extend(
                            scan.records
                                .iter()
                                .filter(|r| wanted.contains(&r.seq))
                                .map(|r| (r.seq, record_mark(r))),
                        );
                    }
                    Err(err) => {
                        tracing::warn!(%err, "cannot read the journal's archives to check a stored position");
                        return 0;
                    }
                }
            }
            if held.get(seq) == Some(mark) {
                return *seq;
            }
        }
        let newest = marks.first().map_or(0, |(s, _)| *s);
        if oldest_held.is_some_and(|o| o > newest) {
            // Every record the marks name was removed with the archives that held them: they can
            // be neither checked nor handed on again, and what the journal holds all comes after
            // them. Resuming at the stored position tells the consumer exactly which records it
            // will never get (a power cut that replaced them before they were archived cannot be
            // told from here: those are lost with the archives either way).
            tracing::warn!(
                position = newest,
                oldest_held = oldest_held.unwrap_or_default(),
                "the records a stored position names were removed by the journal's retention; resuming from the position"
            );
            return self.seq;
        }
        0
    }
}

/// The marks a follower keeps between two stores of its position: those of the stored position
/// and of every record handed on since, pruned to [`mark_seqs`] at each store.
#[derive(Debug, Clone, Default)]
pub struct Marks {
    marks: BTreeMap<u64, String>,
    journal_first: Option<String>,
}

impl Marks {
    /// The marks of `stored`, in the journal named `journal_first` (see [`Resume`]).
    pub fn of(stored: &Position, journal_first: Option<String>) -> Marks {
        Marks {
            marks: stored.marks.iter().cloned().collect(),
            journal_first: journal_first.or_else(|| stored.journal_first.clone()),
        }
    }

    /// `r` was handed on.
    pub fn note(&mut self, r: &Record) {
        if r.seq == 1 {
            self.journal_first = Some(record_time(r));
        }
        self.marks.insert(r.seq, record_mark(r));
    }

    /// The follower starts over after `seq`: marks past it name nothing handed on any more.
    pub fn resume_after(&mut self, seq: u64) {
        self.marks.retain(|s, _| *s <= seq);
    }

    /// The journal's identity as known.
    pub fn journal_first(&self) -> Option<&String> {
        self.journal_first.as_ref()
    }

    /// The position at `seq` (every record up to it handed on), to store; marks no later
    /// position needs are forgotten (a later position's mark seqs are after this one or among
    /// its own).
    pub fn position(&mut self, seq: u64) -> Position {
        let keep: Vec<u64> = mark_seqs(seq).collect();
        self.marks.retain(|s, _| *s > seq || keep.contains(s));
        Position {
            seq,
            journal_first: self.journal_first.clone(),
            marks: keep
                .iter()
                .filter_map(|s| self.marks.get(s).map(|m| (*s, m.clone())))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_position_of_an_older_build_reads_without_marks() {
        let p: Position = serde_json::from_str(r#"{"seq":7,"journal_first":null}"#).unwrap();
        assert_eq!((p.seq, p.marks.len()), (7, 0));
    }
}
