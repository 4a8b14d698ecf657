//! Rotation: the active segment is archived and replaced by one that starts with the records
//! recovery still needs (see `docs/journal-rotation.md`).
//!
//! # Design
//! - **What is carried** ([`carried`]): the records of every process recovery may still act
//!   on, and of every operation it treats as unfinished. Processes are grouped: records that
//!   name several processes (a tree's `ThawCompleted`, a standby's pids, a dump's pinned CPUs)
//!   join them into one group, and a group is kept whole when any process of it may be alive
//!   (same pid and start time, or anything short of proof that it is gone: `/proc` unreadable
//!   counts as alive), or is dead with a fact a guard still acts on (pins never released or
//!   declared lost, a guard attachment never closed), or is an unfinished standby or dump
//!   pinning. Every record of such a group is carried, in order, so every fold a reader makes
//!   per process (origins, suspensions in flight, parks, restores to finish, shrinks to grow)
//!   answers the same on the new segment as on the whole history. Besides groups: the last
//!   `StandbyPool` of each image (the pools the agent keeps), every event this build does not
//!   know (a newer build may need it), and before each restore intent carried the last
//!   `ThawStarted` of its image (it names no process; the next start ends a dead thaw's tree
//!   only under it). Over-carrying costs bytes; under-carrying a wedge.
//! - **Before the lock**, the rotator reads the active segment, decodes it, looks up every
//!   process it names and chooses what to carry ([`Carry::of`]): nearly all of a rotation's
//!   cost (100-300 ms at the agent's 4 MiB), which every writer's append waited for when it ran
//!   under the lock. Under the lock it uses that only if the file is the same inode and still
//!   starts with the very bytes decoded; the records appended since are decoded there and
//!   carried whole when every group stays whole, else everything is chosen again
//!   ([`Carry::extend`]; the carry property test checks both against [`carried`]).
//! - **Steps** ([`Journal::rotate`]), under the `flock` of the active file: cut a torn tail,
//!   sync, decode what was appended since the read before the lock; write `journal.log.next` (a new file: a name left there, a symlink or another
//!   user's file included, is removed first, and the file is created exclusively) with the
//!   carried frames verbatim and an [`Event::Rotated`], synced and locked; hard-link the active
//!   file as the archive `journal.<first>.log`, sync the directory; rename the new file over
//!   `journal.log`, sync the directory; unlock both. Every open sees the old or the new active
//!   file, never none. A writer that locks the retired file afterwards sees another inode at
//!   the path and moves on (`Journal::locked`); one that opens the new file waits on its lock
//!   until its name is durable.
//! - **A crash** at any step leaves `journal.log` whole: before the rename it is the old file
//!   (a `.next` nobody reads, or an archive link to the same inode, which the next rotation
//!   finds and goes on with); after it, the new one.
//!
//! # Limitations
//! - Damaged frames in the middle of the old segment are not carried (no reader could use
//!   them); the archive keeps them.
//! - The carried records of a process alive for a long time are copied at every rotation.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use rustix::fs::{flock, FlockOperation};

use crate::error::{FileError, RotateError};
use crate::writer::{encode, sync_dir, unlock};
use crate::{Event, Journal, ProcId, Record};

/// Name of the file a rotation writes before it renames it over the journal.
pub const NEXT_NAME: &str = "journal.log.next";

/// Failpoint (`CRYO_FAILPOINT`): a rotation stalls (until killed) once `journal.log.next` is
/// written and synced.
pub const ROTATE_NEXT_WRITTEN: &str = "journal-rotate-next-written";
/// Failpoint: a rotation pauses once it has read and decoded the active segment and looked up
/// its processes, before it takes the writers' lock, until the file named by
/// `CRYO_FAILPOINT_RESUME` exists (for good without one).
pub const ROTATE_DECODED: &str = "journal-rotate-decoded";
/// Failpoint: a rotation stalls once the archive link is made and the directory synced.
pub const ROTATE_LINKED: &str = "journal-rotate-linked";
/// Failpoint: a rotation stalls once the new file is renamed over the journal and the directory
/// synced, still holding both locks.
pub const ROTATE_RENAMED: &str = "journal-rotate-renamed";

/// The archive name of a segment whose first own record has seq `first` (`journal.17.log`).
pub fn archive_name(first: u64) -> String {
    format!("journal.{first}.log")
}

/// The seq an archive's name carries, if `name` is an archive's name.
pub fn archive_seq(name: &str) -> Option<u64> {
    let digits = name.strip_prefix("journal.")?.strip_suffix(".log")?;
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Size past which the agent rotates the journal (at a quiet moment): ~25,000 records.
pub const AGENT_ROTATE_BYTES: u64 = 4 << 20;

/// Size past which any writer rotates the journal when it opens it (a node without an agent).
pub const STANDALONE_ROTATE_BYTES: u64 = 64 << 20;

/// How many archives are kept, and how many bytes of them, at most: the oldest go first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Archives kept at most.
    pub count: usize,
    /// Bytes of archives kept at most.
    pub bytes: u64,
}

impl Default for Retention {
    /// 16 archives, 256 MiB.
    fn default() -> Self {
        Retention {
            count: 16,
            bytes: 256 << 20,
        }
    }
}

/// Whether a file (its metadata, not following a symlink) can be an archive of ours, by the
/// state directory's rules (as the fence's): a regular file owned by root or this user that
/// neither group nor others may write.
pub(crate) fn trusted(meta: &std::fs::Metadata) -> bool {
    let uid = meta.uid();
    meta.file_type().is_file()
        && (uid == 0 || uid == rustix::process::geteuid().as_raw())
        && meta.mode() & 0o022 == 0
}

/// The archives in `dir`, oldest first: (seq, path, size). A symlink, another user's file or a
/// file others may write with an archive's name is no archive of ours: logged, left.
pub fn archives(dir: &Path) -> io::Result<Vec<(u64, PathBuf, u64)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let name = entry.file_name();
        let Some(seq) = name.to_str().and_then(archive_seq) else {
            continue;
        };
        let path = entry.path();
        let meta = std::fs::symlink_metadata(&path)?;
        if !trusted(&meta) {
            tracing::warn!(path = %path.display(), "a file with a journal archive's name is not a regular file only root or this user can write: not treated as an archive");
            continue;
        }
        out.push((seq, path, meta.len()));
    }
    out.sort();
    Ok(out)
}

/// What a rotation did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rotation {
    /// The archive of the retired segment.
    pub archive: PathBuf,
    /// The seq of the retired segment's first own record.
    pub first_seq: u64,
    /// Its last seq.
    pub last_seq: u64,
    /// Records copied into the new segment.
    pub carried: u64,
    /// Records the retired segment held.
    pub records: u64,
    /// Size of the retired segment, bytes.
    pub old_bytes: u64,
    /// Size of the new segment, bytes.
    pub new_bytes: u64,
}

/// Whether `proc` may still be alive as the process the journal names: `false` only on proof
/// that it is gone (no such pid, another start time, a zombie, another pidfs inode); `/proc`
/// that cannot be read counts as alive.
pub fn may_be_alive(proc: &ProcId) -> bool {
    match cryo_proc::stat(proc.pid) {
        Err(cryo_proc::ProcError::NoSuchProcess(_)) => false,
        Err(_) => true,
        Ok(st) if st.start_time != proc.start_time || st.state == 'Z' || st.state == 'X' => false,
        Ok(_) => match (proc.pidfs, cryo_proc::pidfs_inode(proc.pid)) {
            (Some(a), Some(b)) => a == b,
            _ => true,
        },
    }
}

/// The processes a record names, for grouping (its `pids`, and the roots of standbys and dump
/// pinnings, which closing records name alone).
fn names(event: &Event) -> Vec<ProcId> {
    let mut out = event.pids();
    match event {
        Event::CpusPinned { root, .. }
        | Event::CpusReturned { root, .. }
        | Event::StandbyReady { root, .. }
        | Event::StandbyRestoring { root, .. } => out.push(*root),
        _ => {}
    }
    out
}

/// Union-find over processes keyed by pid and start time (two processes that differ only in
/// their pidfs inode fall in one group: more carried, never less).
#[derive(Default)]
struct Groups {
    index: HashMap<(i32, u64), usize>,
    parent: Vec<usize>,
}

impl Groups {
    fn id(&mut self, p: &ProcId) -> usize {
        let next = self.parent.len();
        let i = *self.index.entry((p.pid, p.start_time)).or_insert(next);
        if i == next {
            self.parent.push(next);
        }
        i
    }

    fn root(&mut self, mut i: usize) -> usize {
        while self.parent[i] != i {
            self.parent[i] = self.parent[self.parent[i]];
            i = self.parent[i];
        }
        i
    }

    fn join(&mut self, a: usize, b: usize) {
        let (a, b) = (self.root(a), self.root(b));
        if a != b {
            self.parent[a] = b;
        }
    }
}

/// The indices (ascending) of the records of `records` (one segment, in file order) that a
/// rotation carries, `alive` telling whether a process may still be alive ([`may_be_alive`] in
/// production). See the module docs for the rule.
pub fn carried(records: &[Record], alive: impl Fn(&ProcId) -> bool) -> Vec<usize> {
    let mut groups = Groups::default();
    let named: Vec<Vec<usize>> = records
        .iter()
        .map(|r| {
            let ids: Vec<usize> = names(&r.event).iter().map(|p| groups.id(p)).collect();
            for w in ids.windows(2) {
                groups.join(w[0], w[1]);
            }
            ids
        })
        .collect();
    // Processes a reader still acts on: every one that may be alive, and the dead ones with a
    // fact still open.
    let mut needed: BTreeSet<ProcId> = BTreeSet::new();
    let mut seen: HashMap<(i32, u64), bool> = HashMap::new();
    for r in records {
        for p in names(&r.event) {
            let live = seen
                .entry((p.pid, p.start_time))
                .or_insert_with(|| alive(&p));
            if *live {
                needed.insert(p);
            }
        }
    }
    needed.extend(crate::pinned(records).into_keys());
    needed.extend(crate::guarded(records).into_keys());
    for o in crate::open_pins(records) {
        needed.insert(o.root);
    }
    needed.extend(open_standbys(records));
    let keep: BTreeSet<usize> = needed
        .iter()
        .map(|p| {
            let i = groups.id(p);
            groups.root(i)
        })
        .collect();
    // The last pool setting of each image.
    let mut pools: BTreeMap<&str, usize> = BTreeMap::new();
    for (i, r) in records.iter().enumerate() {
        if let Event::StandbyPool { image, .. } = &r.event {
            pools.insert(image, i);
        }
    }
    let pools: BTreeSet<usize> = pools.into_values().collect();
    let kept: Vec<bool> = (0..records.len())
        .map(|i| {
            pools.contains(&i)
                || matches!(records[i].event, Event::Unknown)
                || named[i].iter().any(|&g| keep.contains(&groups.root(g)))
        })
        .collect();
    let thaws = thaw_starts(records, &kept);
    (0..records.len())
        .filter(|&i| kept[i] || thaws.contains(&i))
        .collect()
}

/// The `ThawStarted` records (indices) to carry beside the records `kept` marks: for each kept
/// restore intent, the last `ThawStarted` of its image before it. It names no process, and
/// recovery needs it: the next guard or agent start ends the tree a thaw that died after
/// CRIU's gate left only under a `ThawStarted` of its image (`cryo_lifecycle`'s `leftover`;
/// until session 23 a rotation dropped it, and the tree stayed CHECKPOINTED for good).
fn thaw_starts(records: &[Record], kept: &[bool]) -> BTreeSet<usize> {
    let mut last: HashMap<&str, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for (i, r) in records.iter().enumerate() {
        match &r.event {
            Event::ThawStarted { image } => {
                last.insert(image, i);
            }
            Event::RestoreStarted { image, .. } if kept.get(i).copied().unwrap_or(false) => {
                if let Some(&t) = last.get(image.as_str()) {
                    out.insert(t);
                }
            }
            _ => {}
        }
    }
    out
}

/// [`carried`] of a segment's first records, to be extended by the records appended after them
/// (a rotation chooses before it takes the writers' lock, then sees what was appended since).
#[derive(Debug, Clone)]
pub struct Carry {
    /// [`carried`] of the first `len` records.
    keep: Vec<usize>,
    len: usize,
    /// Every process those records name, by pid and start time (as [`carried`] groups them).
    named: HashSet<(i32, u64)>,
    /// The processes of the groups carried (every member of a group is named by a record of the
    /// group, all of which are carried).
    kept: HashSet<(i32, u64)>,
    /// The images of the `ThawStarted` records among them: a later restore intent of one needs
    /// its thaw's start carried ([`carried`]).
    thawed: HashSet<String>,
}

impl Carry {
    /// [`carried`] of `records` (a segment's first records).
    pub fn of(records: &[Record], alive: impl Fn(&ProcId) -> bool) -> Carry {
        let keep = carried(records, alive);
        let key = |p: ProcId| (p.pid, p.start_time);
        let named = records
            .iter()
            .flat_map(|r| names(&r.event))
            .map(key)
            .collect();
        // Pool settings and unknown events are carried whoever they name: no evidence of a
        // group carried.
        let kept = keep
            .iter()
            .map(|&i| &records[i].event)
            .filter(|e| !matches!(e, Event::StandbyPool { .. } | Event::Unknown))
            .flat_map(names)
            .map(key)
            .collect();
        let thawed = records
            .iter()
            .filter_map(|r| match &r.event {
                Event::ThawStarted { image } => Some(image.clone()),
                _ => None,
            })
            .collect();
        Carry {
            keep,
            len: records.len(),
            named,
            kept,
            thawed,
        }
    }

    /// What [`carried`] would answer for `records`, whose first records are those this was
    /// made of, over-carrying where that is safe: when every later record names only processes
    /// of the groups carried, or processes the first records never name, the later records
    /// are all carried (each group stays whole: a group a later record reaches was carried
    /// whole already, or is made of later records alone), unless one is a restore intent of an
    /// image the first records hold a `ThawStarted` of (its thaw's start may not be carried);
    /// otherwise all of `records` is chosen again ([`carried`]).
    pub fn extend(self, records: &[Record], alive: impl Fn(&ProcId) -> bool) -> Vec<usize> {
        let later = records.get(self.len..).unwrap_or_default();
        let whole = later.iter().all(|r| {
            let thawed = matches!(&r.event, Event::RestoreStarted { image, .. } if self.thawed.contains(image));
            !thawed
                && names(&r.event).iter().all(|p| {
                    let k = (p.pid, p.start_time);
                    !self.named.contains(&k) || self.kept.contains(&k)
                })
        });
        if whole && records.len() >= self.len {
            self.keep
                .into_iter()
                .chain(self.len..records.len())
                .collect()
        } else {
            carried(records, alive)
        }
    }
}

/// Roots of standbys restored or ready and neither claimed nor dropped since.
fn open_standbys(records: &[Record]) -> Vec<ProcId> {
    let mut open: Vec<ProcId> = Vec::new();
    for r in records {
        match &r.event {
            Event::StandbyRestoring { root, .. } | Event::StandbyReady { root, .. } => {
                open.push(*root);
            }
            Event::StandbyClaimed { root, .. } | Event::StandbyDropped { root, .. } => {
                open.retain(|p| p != root);
            }
            _ => {}
        }
    }
    open
}

/// Stalls forever (until killed) if failpoint `name` is active (announced on stderr).
fn stall_if(name: &str) {
    if std::env::var_os("CRYO_FAILPOINT").is_some_and(|v| v == name) {
        eprintln!(
            "cryo: failpoint {name} reached; stalling until killed (CRYO_FAILPOINT is a test hook)"
        );
        loop {
            std::thread::sleep(std::time::Duration::from_secs(3600));
        }
    }
}

/// What a rotation reads and decides before it takes the writers' lock: the active segment's
/// intact frames, decoded, and the liveness of every process they name (the decode and the
/// `/proc` look-ups are nearly all of a rotation's cost: 100-300 ms at the agent's 4 MiB, which
/// every append waited for when they ran under the lock). Under the lock the rotation uses it
/// only if the file is the same inode and still starts with these very bytes.
struct Early {
    /// Device and inode of the file read.
    identity: (u64, u64),
    /// Its bytes up to the end of its last intact frame.
    bytes: Vec<u8>,
    records: Vec<Record>,
    /// Where each record's frame lies in `bytes`.
    ranges: Vec<std::ops::Range<usize>>,
    /// [`may_be_alive`] of every process the records name, by pid, start time and pidfs inode.
    alive: HashMap<(i32, u64, Option<u64>), bool>,
    /// The carried records among them.
    carry: Carry,
}

impl Early {
    /// Reads the active segment at `path` without any lock; `None` if it cannot be read (the
    /// rotation then reads it all under the lock, as before).
    fn read(path: &Path) -> Option<Early> {
        let f = File::open(path).ok()?;
        let meta = f.metadata().ok()?;
        let mut bytes = vec![0u8; usize::try_from(meta.len()).ok()?];
        f.read_exact_at(&mut bytes, 0).ok()?;
        let (frames, end) = crate::frame::frames(&bytes);
        bytes.truncate(end);
        let mut alive = HashMap::new();
        let (records, ranges): (Vec<Record>, Vec<_>) = frames.into_iter().unzip();
        for r in &records {
            for p in names(&r.event) {
                alive
                    .entry((p.pid, p.start_time, p.pidfs))
                    .or_insert_with(|| may_be_alive(&p));
            }
        }
        let carry = Carry::of(&records, |p| {
            alive
                .get(&(p.pid, p.start_time, p.pidfs))
                .copied()
                .unwrap_or_else(|| may_be_alive(p))
        });
        Some(Early {
            identity: (meta.dev(), meta.ino()),
            bytes,
            records,
            ranges,
            alive,
            carry,
        })
    }
}

/// Pauses at failpoint `name` (announced on stderr) until the file named by
/// `CRYO_FAILPOINT_RESUME` exists (for good without one).
fn pause_if(name: &str) {
    if std::env::var_os("CRYO_FAILPOINT").is_some_and(|v| v == name) {
        let resume = std::env::var_os("CRYO_FAILPOINT_RESUME").map(PathBuf::from);
        eprintln!("cryo: failpoint {name} reached; paused (CRYO_FAILPOINT is a test hook)");
        while !resume.as_ref().is_some_and(|r| r.exists()) {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }
}

impl Journal {
    /// Rotates the journal (see the module docs): archives the active segment and starts a new
    /// one with the records recovery still needs. `None` when the journal holds no record.
    /// The segment is read, decoded and every process it names looked up in `/proc` before the
    /// lock ([`Early`]); under the lock (other writers wait) only what was appended since is
    /// decoded, the carried records chosen and the new segment written: for a quiet moment, not
    /// a command's path.
    pub fn rotate(&self) -> Result<Option<Rotation>, RotateError> {
        let early = Early::read(&self.path);
        pause_if(ROTATE_DECODED);
        self.locked(|st| -> Result<Option<Rotation>, RotateError> {
            if let Some(repair) = self.sync_tail(st)? {
                self.write_record(st, repair)?;
            }
            let old = Arc::clone(&st.file);
            let io = |what| {
                let path = self.path.clone();
                move |source| FileError { what, path, source }
            };
            // Every record of the segment durable before it becomes the archive.
            old.sync_data().map_err(io("cannot fdatasync"))?;
            let meta = old.metadata().map_err(io("cannot stat"))?;
            let mut buf = vec![0u8; usize::try_from(meta.len()).unwrap_or(usize::MAX)];
            old.read_exact_at(&mut buf, 0).map_err(io("cannot read"))?;
            // What was decoded before the lock, if it is still the start of this very file (an
            // append-only file: anything else, another rotation or a cut, decodes it all again).
            let early = early.filter(|e| {
                e.identity == (meta.dev(), meta.ino())
                    && buf.get(..e.bytes.len()) == Some(&e.bytes[..])
            });
            // The carried records: chosen before the lock for the records read then, extended
            // by those appended since ([`Carry::extend`]).
            let (records, ranges, keep) = match early {
                Some(e) => {
                    let from = e.bytes.len();
                    let (since, _) = crate::frame::frames(&buf[from..]);
                    let (mut records, mut ranges) = (e.records, e.ranges);
                    for (r, range) in since {
                        records.push(r);
                        ranges.push(range.start + from..range.end + from);
                    }
                    // Liveness as looked up before the lock (a process gone then is gone now;
                    // one alive then and gone since is carried, which is safe).
                    let keep = e.carry.extend(&records, |p| {
                        e.alive
                            .get(&(p.pid, p.start_time, p.pidfs))
                            .copied()
                            .unwrap_or_else(|| may_be_alive(p))
                    });
                    (records, ranges, keep)
                }
                None => {
                    let (frames, _) = crate::frame::frames(&buf);
                    let (records, ranges): (Vec<Record>, Vec<_>) = frames.into_iter().unzip();
                    let keep = carried(&records, may_be_alive);
                    (records, ranges, keep)
                }
            };
            let Some(head) = records.first() else {
                return Ok(None);
            };
            let before = records.iter().find_map(|r| match &r.event {
                Event::Rotated { origin, .. } => Some((r.seq, origin.clone())),
                _ => None,
            });
            let first_seq = before.as_ref().map_or(head.seq, |(seq, _)| *seq);
            let origin = match before {
                Some((_, origin)) => origin,
                None if head.seq == 1 => crate::timeline::fmt_utc(head.time, crate::Subsec::Nanos),
                None => None,
            };
            let last_seq = st.last_seq;
            let archive = self.dir.join(archive_name(first_seq));
            let rotated = Record {
                seq: last_seq + 1,
                time: SystemTime::now(),
                event: Event::Rotated {
                    archive: archive_name(first_seq),
                    first_seq,
                    last_seq,
                    carried: keep.len() as u64,
                    origin,
                },
            };
            let mut out = Vec::new();
            for &i in &keep {
                out.extend_from_slice(&buf[ranges[i].clone()]);
            }
            out.extend_from_slice(&encode(&rotated)?);

            // 1. The new segment, under its own lock until its name is durable.
            let next_path = self.dir.join(NEXT_NAME);
            let next = self.write_next(&next_path, &out)?;
            stall_if(ROTATE_NEXT_WRITTEN);
            let undo = |e: RotateError| {
                let _ = std::fs::remove_file(&next_path);
                e
            };
            // 2. The archive: another name of the retired segment's inode.
            link_archive(&self.path, &archive, &meta).map_err(undo)?;
            sync_dir(&self.dir)
                .map_err(io("cannot fsync the directory of"))
                .map_err(|e| undo(e.into()))?;
            stall_if(ROTATE_LINKED);
            // 3. The new segment in place, atomically.
            std::fs::rename(&next_path, &self.path)
                .map_err(io("cannot rename the new segment over"))
                .map_err(|e| undo(e.into()))?;
            let synced = sync_dir(&self.dir).map_err(io("cannot fsync the directory of"));
            stall_if(ROTATE_RENAMED);
            let next = Arc::new(next);
            st.file = Arc::clone(&next);
            st.end = Some(out.len() as u64);
            st.last_seq = rotated.seq;
            self.set_current(Arc::clone(&next));
            // 4. Writers waiting on either lock go on (to the new file).
            unlock(&old, &self.path);
            unlock(&next, &self.path);
            synced?;
            tracing::info!(
                archive = %archive.display(),
                records = records.len(),
                carried = keep.len(),
                "journal rotated"
            );
            Ok(Some(Rotation {
                archive,
                first_seq,
                last_seq,
                carried: keep.len() as u64,
                records: records.len() as u64,
                old_bytes: meta.len(),
                new_bytes: out.len() as u64,
            }))
        })
    }

    /// Rotates if the active segment is larger than `past` bytes, then removes the oldest
    /// archives beyond `keep` (never the active segment: an archive that is still its inode, left
    /// by a rotation that died after its link, is not counted nor removed).
    pub fn maintain(&self, past: u64, keep: Retention) -> Result<Option<Rotation>, RotateError> {
        let size = std::fs::metadata(&self.path)
            .map_err(|source| FileError {
                what: "cannot stat",
                path: self.path.clone(),
                source,
            })?
            .len();
        let rotated = if size > past { self.rotate()? } else { None };
        self.prune(keep)?;
        Ok(rotated)
    }

    /// Removes the oldest archives beyond `keep`; returns what it removed.
    pub fn prune(&self, keep: Retention) -> Result<Vec<PathBuf>, RotateError> {
        let err = |what| {
            let path = self.dir.clone();
            move |source| FileError { what, path, source }
        };
        let active = std::fs::metadata(&self.path).map_err(err("cannot stat the journal in"))?;
        let mut list: Vec<(u64, PathBuf, u64)> = archives(&self.dir)
            .map_err(err("cannot list the archives in"))?
            .into_iter()
            .filter(|(_, p, _)| {
                std::fs::symlink_metadata(p)
                    .map(|m| !(m.dev() == active.dev() && m.ino() == active.ino()))
                    .unwrap_or(false)
            })
            .collect();
        let mut bytes: u64 = list.iter().map(|(_, _, n)| n).sum();
        let mut removed = Vec::new();
        while !list.is_empty() && (list.len() > keep.count || bytes > keep.bytes) {
            let (_, path, n) = list.remove(0);
            std::fs::remove_file(&path).map_err(|source| FileError {
                what: "cannot remove the archive",
                path: path.clone(),
                source,
            })?;
            bytes -= n;
            removed.push(path);
        }
        if !removed.is_empty() {
            sync_dir(&self.dir).map_err(err("cannot fsync"))?;
            tracing::info!(removed = removed.len(), "old journal archives removed");
        }
        Ok(removed)
    }

    /// Writes `bytes` into a new file at `path` (removing whatever has the name: a stale
    /// `.next`, a symlink, a file of someone else), synced, and returns it locked.
    fn write_next(&self, path: &Path, bytes: &[u8]) -> Result<File, RotateError> {
        let err = |what| {
            let path = path.to_path_buf();
            move |source| FileError { what, path, source }
        };
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(err("cannot remove the stale")(e).into()),
        }
        let file = OpenOptions::new()
            .read(true)
            .append(true)
            .create_new(true)
            .mode(0o640)
            .custom_flags(libc_nofollow())
            .open(path)
            .map_err(err("cannot create"))?;
        let written = flock(&file, FlockOperation::LockExclusive)
            .map_err(|e| err("cannot lock")(e.into()))
            .and_then(|()| (&file).write_all(bytes).map_err(err("cannot write")))
            .and_then(|()| file.sync_data().map_err(err("cannot fdatasync")));
        if let Err(e) = written {
            let _ = std::fs::remove_file(path);
            return Err(e.into());
        }
        Ok(file)
    }
}

/// `O_NOFOLLOW` (with `create_new` a symlink at the name fails the open anyway; this says so).
fn libc_nofollow() -> i32 {
    rustix::fs::OFlags::NOFOLLOW.bits() as i32
}

/// Hard-links the journal at `active` (whose metadata, taken through the locked file, is
/// `held`) as `archive`; an archive already there is fine only if it is the same inode (a
/// rotation that died after its link).
fn link_archive(
    active: &Path,
    archive: &Path,
    held: &std::fs::Metadata,
) -> Result<(), RotateError> {
    match std::fs::hard_link(active, archive) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {
            let there = std::fs::symlink_metadata(archive).map_err(|source| FileError {
                what: "cannot stat the archive",
                path: archive.to_path_buf(),
                source,
            })?;
            if there.file_type().is_file() && there.dev() == held.dev() && there.ino() == held.ino()
            {
                Ok(())
            } else {
                Err(RotateError::ArchiveTaken {
                    path: archive.to_path_buf(),
                })
            }
        }
        Err(source) => Err(FileError {
            what: "cannot link the archive",
            path: archive.to_path_buf(),
            source,
        }
        .into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(file: &File) -> (u64, u64) {
        let m = file.metadata().unwrap();
        (m.dev(), m.ino())
    }

    #[test]
    fn a_syncer_syncs_the_segment_its_journal_appends_to_after_a_rotation() {
        let dir = tempfile::tempdir().unwrap();
        let a = Journal::open(dir.path()).unwrap();
        let b = Journal::open(dir.path()).unwrap();
        let (sa, sb) = (a.syncer().unwrap(), b.syncer().unwrap());
        a.append(Event::FreezeStarted { image: "x".into() })
            .unwrap();
        let retired = identity(&sa.file());
        // Rotated by this journal: its syncer follows at once.
        a.rotate().unwrap().unwrap();
        let active = identity(&File::open(dir.path().join(crate::FILE_NAME)).unwrap());
        assert_ne!(active, retired);
        assert_eq!(identity(&sa.file()), active);
        sa.sync().unwrap();
        // Rotated by another writer: its records went to the retired file (synced by the
        // rotator) until its next append, which moves it and its syncer to the new one.
        assert_eq!(identity(&sb.file()), retired);
        b.append_unsynced(vec![Event::FreezeStarted { image: "y".into() }])
            .unwrap();
        assert_eq!(identity(&sb.file()), active);
        sb.sync().unwrap();
    }
}
