#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Rotation attacked: what recovery needs survives it, followers see every record once across
//! it, writers holding the retired file move on, hostile names in the journal directory, and
//! the rotator killed at each of its steps (`cryo-journal-testee rotate` with a failpoint).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cryo_journal::{
    guarded, in_flight_stops, pinned, read, AttachSource, Event, Journal, Origins, ProcId, Purpose,
    Reader, Record, RotateError, FILE_NAME, NEXT_NAME,
};

/// A child process, killed and reaped when dropped.
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A live process (a `sleep`), with its identity.
fn live() -> (Kid, ProcId) {
    let child = Command::new("sleep").arg("600").spawn().unwrap();
    let id = ProcId::of(child.id() as i32).unwrap();
    (Kid(child), id)
}

/// The identity of a process that has exited and been reaped.
fn exited() -> ProcId {
    let mut child = Command::new("sleep").arg("600").spawn().unwrap();
    let id = ProcId::of(child.id() as i32).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    id
}

fn restored(j: &Journal, p: ProcId, image: &str) {
    j.append(Event::RestoreStarted {
        pid: p,
        image: image.into(),
        unlock_by: None,
    })
    .unwrap();
    j.append(Event::RestoreCompleted {
        pid: p,
        image: image.into(),
        ms: Some(1),
    })
    .unwrap();
}

fn in_flight(j: &Journal, p: ProcId) {
    j.append(Event::SuspendStarted {
        pid: p,
        purpose: Purpose::Stop,
        by: None,
    })
    .unwrap();
    j.append(Event::LockStarted { pid: p }).unwrap();
}

fn filler(j: &Journal, n: usize) {
    for i in 0..n {
        j.append(Event::FreezeStarted {
            image: format!("/img/{i}"),
        })
        .unwrap();
    }
}

/// What recovery asks of the journal, restricted to processes alive now, plus what a guard acts
/// on for dead ones (pins, attachments).
#[derive(Debug, PartialEq)]
struct Answers {
    live_restored: Vec<ProcId>,
    in_flight: Vec<ProcId>,
    pinned: BTreeMap<ProcId, Vec<String>>,
    guarded: BTreeMap<ProcId, AttachSource>,
}

fn answers(records: &[Record]) -> Answers {
    Answers {
        live_restored: Origins::from_records(records).live_restored(),
        in_flight: in_flight_stops(records)
            .into_keys()
            .filter(ProcId::is_alive_same)
            .collect(),
        pinned: pinned(records),
        guarded: guarded(records),
    }
}

/// A journal with live and dead processes' facts: restored, in flight, pinned, guarded, and
/// records no reader needs.
struct Scene {
    dir: tempfile::TempDir,
    journal: Journal,
    live: ProcId,
    dead: ProcId,
    _kid: Kid,
}

fn scene() -> Scene {
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path()).unwrap();
    let (kid, live) = live();
    let dead = exited();
    let (pinned_dead, guarded_dead, tree_dead) = (exited(), exited(), exited());
    filler(&journal, 5);
    restored(&journal, live, "/img/live");
    restored(&journal, dead, "/img/dead");
    in_flight(&journal, dead);
    journal
        .append(Event::GuardAttached {
            pid: live,
            source: AttachSource::Restore,
        })
        .unwrap();
    journal
        .append(Event::Pinned {
            pid: pinned_dead,
            gpu: "GPU-1".into(),
            fds: vec![3],
        })
        .unwrap();
    journal
        .append(Event::GuardAttached {
            pid: guarded_dead,
            source: AttachSource::Scan,
        })
        .unwrap();
    journal
        .append(Event::ThawCompleted {
            image: "/img/live".into(),
            pids: vec![live, tree_dead],
            ms: 3,
        })
        .unwrap();
    filler(&journal, 5);
    in_flight(&journal, live);
    Scene {
        dir,
        journal,
        live,
        dead,
        _kid: kid,
    }
}

fn seqs(records: &[Record]) -> Vec<u64> {
    records.iter().map(|r| r.seq).collect()
}

#[test]
fn a_rotation_keeps_every_fact_recovery_needs_and_drops_the_dead() {
    let s = scene();
    let whole = read(s.dir.path()).unwrap().records;
    let before = answers(&whole);
    assert_eq!(before.live_restored, vec![s.live]);
    assert_eq!(before.in_flight, vec![s.live]);
    let rotation = s.journal.rotate().unwrap().unwrap();
    assert_eq!(rotation.last_seq, whole.last().unwrap().seq);
    let now = read(s.dir.path()).unwrap().records;
    assert_eq!(answers(&now), before);
    // The dead restored process is gone from the active segment, the archive has everything.
    assert!(!now.iter().any(|r| r.event.pids().contains(&s.dead)));
    assert!(now.len() < whole.len(), "nothing dropped: {}", now.len());
    let archived = cryo_journal::read_segment(&rotation.archive)
        .unwrap()
        .records;
    assert_eq!(archived, whole);
    let Event::Rotated {
        last_seq, carried, ..
    } = &now.last().unwrap().event
    else {
        panic!("no rotation record last: {:?}", now.last());
    };
    assert_eq!(*last_seq, rotation.last_seq);
    assert_eq!(*carried as usize, now.len() - 1);
    // Seqs go on past the old last.
    let r = s.journal.append(Event::Killed { pid: s.live }).unwrap();
    assert_eq!(r.seq, rotation.last_seq + 2);
    // A second rotation carries the carried records again, and names another archive.
    let second = s.journal.rotate().unwrap().unwrap();
    assert_ne!(second.archive, rotation.archive);
    assert_eq!(second.first_seq, rotation.last_seq + 1);
}

#[test]
fn a_writer_holding_the_retired_file_appends_to_the_new_segment() {
    let s = scene();
    let other = Journal::open(s.dir.path()).unwrap();
    let rotation = s.journal.rotate().unwrap().unwrap();
    let archived = std::fs::metadata(&rotation.archive).unwrap().len();
    let r = other.append(Event::Killed { pid: s.live }).unwrap();
    assert_eq!(r.seq, rotation.last_seq + 2);
    assert_eq!(
        std::fs::metadata(&rotation.archive).unwrap().len(),
        archived,
        "an append landed in the retired segment"
    );
    assert_eq!(read(s.dir.path()).unwrap().records.last().unwrap(), &r);
}

#[test]
fn a_follower_mid_file_returns_every_record_once_across_rotations() {
    let s = scene();
    let mut follower = Reader::new(s.dir.path());
    let mut got = follower.read_new().unwrap().records;
    filler(&s.journal, 3);
    s.journal.rotate().unwrap().unwrap();
    filler(&s.journal, 2);
    got.extend(follower.read_new().unwrap().records);
    // Two rotations between two reads: the middle segment is read from its archive.
    filler(&s.journal, 4);
    s.journal.rotate().unwrap().unwrap();
    filler(&s.journal, 3);
    s.journal.rotate().unwrap().unwrap();
    filler(&s.journal, 1);
    got.extend(follower.read_new().unwrap().records);
    let end = s.journal.append(Event::Killed { pid: s.live }).unwrap().seq;
    got.extend(follower.read_new().unwrap().records);
    assert_eq!(seqs(&got), (1..=end).collect::<Vec<_>>());
    // A reader from a position reads the archives it needs.
    let mut late = Reader::after(s.dir.path(), 7);
    assert_eq!(
        seqs(&late.read_new().unwrap().records),
        (8..=end).collect::<Vec<_>>()
    );
}

/// Every seq after `after` up to `end`, each once: either returned or inside a reported gap.
fn returned_or_lost(scan: &cryo_journal::Scan, after: u64, end: u64) {
    let mut all: Vec<u64> = seqs(&scan.records);
    for g in &scan.gaps {
        assert!(g.first <= g.last, "{g:?}");
        all.extend(g.first..=g.last);
    }
    all.sort_unstable();
    assert_eq!(
        all,
        (after + 1..=end).collect::<Vec<_>>(),
        "records {:?}, gaps {:?}",
        seqs(&scan.records),
        scan.gaps
    );
}

/// A follower that fell behind the retention: the records only pruned archives held are reported
/// as gaps (the seq ranges lost), never skipped silently, and the records after them are
/// returned. A follower that lost nothing reports no gap, carried copies between its reads
/// included.
#[test]
fn a_follower_behind_a_pruned_archive_is_told_which_seqs_it_lost() {
    let keep_one = cryo_journal::Retention {
        count: 1,
        bytes: u64::MAX,
    };
    // Records of the dead only (nothing carried): exact ranges.
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    let dead = exited();
    let kill = |j: &Journal| j.append(Event::Killed { pid: dead }).unwrap().seq;
    (1..=3).for_each(|_| {
        kill(&j);
    });
    let mut mid = Reader::after(dir.path(), 0);
    let first = mid.read_new().unwrap();
    assert_eq!((seqs(&first.records), first.gaps.len()), (vec![1, 2, 3], 0));
    (4..=6).for_each(|_| {
        kill(&j);
    });
    j.rotate().unwrap().unwrap(); // 7: journal.1.log holds 1..=6
    (8..=9).for_each(|_| {
        kill(&j);
    });
    j.rotate().unwrap().unwrap(); // 10: journal.7.log holds 7..=9
    kill(&j);
    j.rotate().unwrap().unwrap(); // 12: journal.10.log holds 10..=11
    let end = kill(&j);
    assert_eq!(j.prune(keep_one).unwrap().len(), 2);
    // The follower finishes the segment it holds open (4..=6), then 7..=9 are gone.
    let scan = mid.read_new().unwrap();
    returned_or_lost(&scan, 3, end);
    assert_eq!(
        scan.gaps,
        [cryo_journal::Gap { first: 7, last: 9 }],
        "{:?}",
        seqs(&scan.records)
    );
    // A reader started later (a forwarder restarted from its offset) loses 3..=9.
    let late = Reader::after(dir.path(), 2).read_new().unwrap();
    returned_or_lost(&late, 2, end);
    assert_eq!(late.gaps, [cryo_journal::Gap { first: 3, last: 9 }]);
    assert!(mid.read_new().unwrap().gaps.is_empty(), "reported once");

    // With carried copies (live processes' records) in every segment: every seq once, as a
    // record or in a gap, whatever the follower's starting point.
    let s = scene();
    let mut follower = Reader::after(s.dir.path(), 0);
    let read = follower.read_new().unwrap();
    assert!(read.gaps.is_empty());
    let read_to = read.records.last().unwrap().seq;
    for _ in 0..3 {
        filler(&s.journal, 3);
        s.journal.rotate().unwrap().unwrap();
    }
    let end = s.journal.append(Event::Killed { pid: s.dead }).unwrap().seq;
    let caught_up = follower.read_new().unwrap();
    returned_or_lost(&caught_up, read_to, end);
    assert!(caught_up.gaps.is_empty(), "{:?}", caught_up.gaps);
    let whole = Reader::after(s.dir.path(), 0).read_new().unwrap();
    assert!(
        whole.gaps.is_empty(),
        "nothing pruned, no gap: {:?}",
        whole.gaps
    );
    s.journal.prune(keep_one).unwrap();
    for after in 0..end {
        returned_or_lost(
            &Reader::after(s.dir.path(), after).read_new().unwrap(),
            after,
            end,
        );
    }
}

#[test]
fn a_stale_or_hostile_next_file_is_replaced_not_written_through() {
    let s = scene();
    let victim_dir = tempfile::tempdir().unwrap();
    let victim = victim_dir.path().join("victim");
    std::fs::write(&victim, b"precious").unwrap();
    let next = s.dir.path().join(NEXT_NAME);
    std::os::unix::fs::symlink(&victim, &next).unwrap();
    s.journal.rotate().unwrap().unwrap();
    assert_eq!(std::fs::read(&victim).unwrap(), b"precious");
    // A hard link of another file under the name.
    let victim2 = s.dir.path().join("victim2");
    std::fs::write(&victim2, b"precious").unwrap();
    std::fs::hard_link(&victim2, &next).unwrap();
    filler(&s.journal, 1);
    s.journal.rotate().unwrap().unwrap();
    assert_eq!(std::fs::read(&victim2).unwrap(), b"precious");
    assert!(!next.exists());
}

#[test]
fn an_archive_name_taken_by_another_file_fails_the_rotation_and_keeps_the_journal() {
    let s = scene();
    let whole = read(s.dir.path()).unwrap().records;
    let first = whole[0].seq;
    let taken = s.dir.path().join(cryo_journal::archive_name(first));
    std::fs::write(&taken, b"not ours").unwrap();
    let err = s.journal.rotate().unwrap_err();
    assert!(matches!(err, RotateError::ArchiveTaken { .. }), "{err}");
    assert_eq!(std::fs::read(&taken).unwrap(), b"not ours");
    assert!(!s.dir.path().join(NEXT_NAME).exists());
    assert_eq!(read(s.dir.path()).unwrap().records, whole);
    let r = s.journal.append(Event::Killed { pid: s.live }).unwrap();
    assert_eq!(r.seq, whole.last().unwrap().seq + 1);
    // A symlink with the name is no archive of ours either.
    std::fs::remove_file(&taken).unwrap();
    std::os::unix::fs::symlink(s.dir.path().join(FILE_NAME), &taken).unwrap();
    assert!(matches!(
        s.journal.rotate().unwrap_err(),
        RotateError::ArchiveTaken { .. }
    ));
}

/// The rotator reads, decodes and looks processes up before it takes the writers' lock: a
/// writer appends meanwhile without waiting, and what it appended (a process restored since,
/// a record joining a live process with a dead one, a dead process's pin, a torn tail cut) is
/// decoded and chosen under the lock: recovery answers on the new segment as on the whole
/// history, and nothing appended is lost or duplicated.
#[test]
fn what_is_appended_while_the_rotator_decodes_is_chosen_under_the_lock() {
    let s = scene();
    let resume = s.dir.path().join("resume");
    let mut child = Command::new(env!("CARGO_BIN_EXE_cryo-journal-testee"))
        .args(["rotate".as_ref(), s.dir.path().as_os_str()])
        .env("CRYO_FAILPOINT", cryo_journal::ROTATE_DECODED)
        .env("CRYO_FAILPOINT_RESUME", &resume)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let stdout = child.stdout.take().unwrap();
    let kid = Kid(child);
    let mut lines = BufReader::new(stderr).lines();
    loop {
        let line = lines.next().expect("the rotator exited").unwrap();
        if line.contains(&format!(
            "failpoint {} reached",
            cryo_journal::ROTATE_DECODED
        )) {
            break;
        }
    }
    // Meanwhile (the rotator holds no lock): a second live process restored, a tree record
    // joining it with a process that is dead (whose in-flight stop must then come along), a
    // dead process's pin, and a torn tail that the next writer cuts.
    let (_kid2, live2) = live();
    let (dead2, pinned2) = (exited(), exited());
    restored(&s.journal, live2, "/img/second");
    in_flight(&s.journal, dead2);
    s.journal
        .append(Event::ThawCompleted {
            image: "/img/second".into(),
            pids: vec![live2, dead2],
            ms: 2,
        })
        .unwrap();
    s.journal
        .append(Event::Pinned {
            pid: pinned2,
            gpu: "GPU-2".into(),
            fds: vec![4],
        })
        .unwrap();
    filler(&s.journal, 3);
    {
        use std::io::Write as _;
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(s.dir.path().join(FILE_NAME))
            .unwrap();
        f.write_all(b"CRJ1\x10\x00").unwrap();
    }
    let other = Journal::open(s.dir.path()).unwrap(); // cuts the torn tail, journals the cut
    let last = other.append(Event::Killed { pid: s.dead }).unwrap().seq;
    let whole = read(s.dir.path()).unwrap().records;
    assert_eq!(whole.last().unwrap().seq, last);
    let before = answers(&whole);
    assert_eq!(before.live_restored, vec![s.live, live2]);
    assert!(before.pinned.contains_key(&pinned2));

    std::fs::write(&resume, b"").unwrap();
    let mut said = String::new();
    std::io::Read::read_to_string(&mut BufReader::new(stdout), &mut said).unwrap();
    drop(kid);
    let rotated_last: u64 = said
        .split_whitespace()
        .nth(2)
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("the rotator said {said:?}"));
    assert_eq!(
        rotated_last, last,
        "the rotation covers every record appended"
    );
    let now = read(s.dir.path()).unwrap().records;
    assert_eq!(answers(&now), before);
    // The new segment's records are the old one's (carried) plus the rotation record, once each.
    let mut prev = 0;
    for r in &now {
        assert!(r.seq > prev, "seqs not increasing at {}", r.seq);
        prev = r.seq;
        if !matches!(r.event, Event::Rotated { .. }) {
            assert!(whole.contains(r), "not a record of the old segment: {r:?}");
        }
    }
    let all = Reader::after(s.dir.path(), 0).read_new().unwrap();
    assert_eq!(seqs(&all.records), (1..=last + 1).collect::<Vec<_>>());
}

/// Kills a rotator stalled at `failpoint`, then checks what any later run sees.
fn rotator_killed_at(failpoint: &str) {
    let s = scene();
    let whole = read(s.dir.path()).unwrap().records;
    let before = answers(&whole);
    let mut follower = Reader::after(s.dir.path(), 4);
    let mut got = follower.read_new().unwrap().records;
    filler(&s.journal, 2);
    let old_last = s.journal.append(Event::Killed { pid: s.dead }).unwrap().seq;
    let mut child = Command::new(env!("CARGO_BIN_EXE_cryo-journal-testee"))
        .args(["rotate".as_ref(), s.dir.path().as_os_str()])
        .env("CRYO_FAILPOINT", failpoint)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = child.stderr.take().unwrap();
    let kid = Kid(child);
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let line = lines.next().expect("the rotator exited").unwrap();
        if line.contains(&format!("failpoint {failpoint} reached")) {
            break;
        }
        assert!(Instant::now() < deadline, "no failpoint");
    }
    drop(kid);
    // (a) A writer goes on, past the old last (and the rotation record, if it was renamed in).
    let j = Journal::open(s.dir.path()).unwrap();
    let next = j.append(Event::Killed { pid: s.live }).unwrap().seq;
    let active = read(s.dir.path()).unwrap().records;
    let renamed = active
        .iter()
        .any(|r| matches!(r.event, Event::Rotated { .. }));
    assert_eq!(renamed, failpoint == cryo_journal::ROTATE_RENAMED);
    assert_eq!(next, old_last + 1 + u64::from(renamed));
    let mut prev = 0;
    for r in &active {
        assert!(r.seq > prev, "seqs not increasing at {}", r.seq);
        prev = r.seq;
    }
    // (b) Recovery answers as on the whole history (less the kill just journaled).
    assert_eq!(
        answers(&active[..active.len() - 1]).live_restored,
        before.live_restored
    );
    assert_eq!(
        answers(&active[..active.len() - 1]),
        answers(&read_all(&s, old_last))
    );
    // (d) The follower returns every record once.
    got.extend(follower.read_new().unwrap().records);
    assert_eq!(seqs(&got), (5..=next).collect::<Vec<_>>());
    // A later rotation finishes the job (a leftover `.next` or archive link is no obstacle).
    j.rotate().unwrap().unwrap();
    got.extend(follower.read_new().unwrap().records);
    let end = j.append(Event::Killed { pid: s.live }).unwrap().seq;
    got.extend(follower.read_new().unwrap().records);
    assert_eq!(seqs(&got), (5..=end).collect::<Vec<_>>());
    assert_eq!(
        answers(&read(s.dir.path()).unwrap().records).live_restored,
        vec![s.live]
    );
}

/// Every record up to `last`, archives first (the whole history as a timeline would read it).
fn read_all(s: &Scene, last: u64) -> Vec<Record> {
    let mut r = Reader::after(s.dir.path(), 0);
    r.read_new()
        .unwrap()
        .records
        .into_iter()
        .filter(|r| r.seq <= last)
        .collect()
}

#[test]
fn a_rotator_killed_once_the_next_file_is_written_leaves_the_journal_whole() {
    rotator_killed_at(cryo_journal::ROTATE_NEXT_WRITTEN);
}

#[test]
fn a_rotator_killed_once_the_archive_is_linked_leaves_the_journal_whole() {
    rotator_killed_at(cryo_journal::ROTATE_LINKED);
}

#[test]
fn a_rotator_killed_once_the_new_segment_is_renamed_in_leaves_it_whole() {
    rotator_killed_at(cryo_journal::ROTATE_RENAMED);
}

#[test]
fn retention_removes_the_oldest_archives_and_leaves_what_is_not_ours() {
    let s = scene();
    let mut made = Vec::new();
    for _ in 0..4 {
        filler(&s.journal, 3);
        made.push(s.journal.rotate().unwrap().unwrap().archive);
    }
    // A symlink and another user's file with archive names, older than every archive.
    let link = s.dir.path().join(cryo_journal::archive_name(0));
    std::os::unix::fs::symlink(s.dir.path().join(FILE_NAME), &link).unwrap();
    let foreign = s.dir.path().join("journal.00.log");
    std::fs::write(&foreign, b"someone's").unwrap();
    std::os::unix::fs::chown(&foreign, Some(65534), Some(65534)).unwrap();
    let keep = cryo_journal::Retention {
        count: 2,
        bytes: u64::MAX,
    };
    let removed = s.journal.prune(keep).unwrap();
    assert_eq!(removed, made[..2]);
    assert!(made[2..].iter().all(|p| p.exists()));
    assert!(link.symlink_metadata().is_ok() && foreign.exists());
    // By bytes: the newest alone is kept.
    let newest = std::fs::metadata(&made[3]).unwrap().len();
    let removed = s
        .journal
        .prune(cryo_journal::Retention {
            count: 10,
            bytes: newest,
        })
        .unwrap();
    assert_eq!(removed, made[2..3]);
    // The active segment is never pruned, even when a rotation that died left an archive name
    // on it.
    let stale = s.dir.path().join(cryo_journal::archive_name(1_000_000));
    std::fs::hard_link(s.dir.path().join(FILE_NAME), &stale).unwrap();
    let removed = s
        .journal
        .prune(cryo_journal::Retention { count: 0, bytes: 0 })
        .unwrap();
    assert_eq!(removed, made[3..]);
    assert!(stale.exists());
    assert!(answers(&read(s.dir.path()).unwrap().records).live_restored == vec![s.live]);
}

#[test]
fn maintain_rotates_only_past_its_size() {
    let s = scene();
    let size = std::fs::metadata(s.dir.path().join(FILE_NAME))
        .unwrap()
        .len();
    let keep = cryo_journal::Retention::default();
    assert_eq!(s.journal.maintain(size, keep).unwrap(), None);
    assert!(s.journal.maintain(size - 1, keep).unwrap().is_some());
}

#[test]
fn a_full_disk_during_a_rotation_leaves_the_old_segment_active_and_whole() {
    let fs = cryo_testkit::disk::SmallDisk::mount("256k");
    let dir = fs.path().join("journal");
    let journal = Journal::open(&dir).unwrap();
    let (_kid, me) = live();
    restored(&journal, me, "/img");
    for i in 0..200 {
        journal
            .append(Event::Refused {
                pid: me,
                reason: format!("{i:0>400}"),
                hint: String::new(),
            })
            .unwrap();
    }
    let whole = read(&dir).unwrap().records;
    // Fill the rest of the file system.
    let fill = fs.fill();
    let err = journal.rotate().unwrap_err();
    println!("rotation on a full disk: {err}");
    assert_eq!(read(&dir).unwrap().records, whole);
    assert!(!dir.join(NEXT_NAME).exists());
    std::fs::remove_file(fill).unwrap();
    let r = journal.append(Event::Killed { pid: me }).unwrap();
    assert_eq!(r.seq, whole.last().unwrap().seq + 1);
    let rotation = journal.rotate().unwrap().unwrap();
    assert_eq!(rotation.last_seq, r.seq);
    assert_eq!(
        Origins::from_records(&read(&dir).unwrap().records).live_restored(),
        vec![me]
    );
}

/// Whether `/proc/locks` shows process `pid` waiting for a `flock` on inode `ino`.
fn waits_for_flock(pid: u32, ino: u64) -> bool {
    let locks = std::fs::read_to_string("/proc/locks").unwrap();
    locks.lines().any(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        // "7: -> FLOCK  ADVISORY  WRITE 4242 08:01:1234 0 EOF"
        f.get(1) == Some(&"->")
            && f.get(2) == Some(&"FLOCK")
            && f.get(5) == Some(&pid.to_string().as_str())
            && f.get(6)
                .and_then(|d| d.rsplit(':').next())
                .and_then(|i| i.parse::<u64>().ok())
                == Some(ino)
    })
}

#[test]
fn a_writer_that_opens_the_new_segment_waits_until_the_rotator_lets_go() {
    use std::os::unix::fs::MetadataExt;
    let s = scene();
    let old_last = read(s.dir.path()).unwrap().records.last().unwrap().seq;
    let mut rotator = Command::new(env!("CARGO_BIN_EXE_cryo-journal-testee"))
        .args(["rotate".as_ref(), s.dir.path().as_os_str()])
        .env("CRYO_FAILPOINT", cryo_journal::ROTATE_RENAMED)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = rotator.stderr.take().unwrap();
    let rotator = Kid(rotator);
    for line in BufReader::new(stderr).lines() {
        if line.unwrap().contains("reached") {
            break;
        }
    }
    // Renamed in, its name durable, the rotator still at work: a writer that opens the journal
    // now opens the new segment, and must wait for the rotator's lock on it.
    let ino = std::fs::metadata(s.dir.path().join(FILE_NAME))
        .unwrap()
        .ino();
    let mut writer = Command::new(env!("CARGO_BIN_EXE_cryo-journal-testee"))
        .args(["write".as_ref(), s.dir.path().as_os_str()])
        .args(["w", "1", "10"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let out = writer.stdout.take().unwrap();
    let writer = Kid(writer);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !waits_for_flock(writer.0.id(), ino) {
        assert!(
            Instant::now() < deadline,
            "the writer never waited for the new segment's lock"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(rotator);
    let acked = BufReader::new(out).lines().next().unwrap().unwrap();
    assert_eq!(acked, format!("acked {}", old_last + 2));
    drop(writer);
}

#[test]
fn an_archive_someone_else_could_have_written_is_not_read() {
    use std::os::unix::fs::PermissionsExt;
    let s = scene();
    let rotation = s.journal.rotate().unwrap().unwrap();
    filler(&s.journal, 2);
    let all = seqs(&cryo_journal::read_all(s.dir.path()).unwrap().records);
    assert_eq!(all, (1..=rotation.last_seq + 3).collect::<Vec<_>>());
    // Record 1 is a filler: only the archive has it.
    std::fs::set_permissions(&rotation.archive, std::fs::Permissions::from_mode(0o666)).unwrap();
    let now = seqs(&cryo_journal::read_all(s.dir.path()).unwrap().records);
    assert!(
        !now.contains(&1),
        "a world-writable archive was read: {now:?}"
    );
    // A symlink under the archive's name, to a copy of it.
    std::fs::set_permissions(&rotation.archive, std::fs::Permissions::from_mode(0o640)).unwrap();
    let copy = s.dir.path().join("copy");
    std::fs::copy(&rotation.archive, &copy).unwrap();
    std::fs::remove_file(&rotation.archive).unwrap();
    std::os::unix::fs::symlink(&copy, &rotation.archive).unwrap();
    let now = seqs(&cryo_journal::read_all(s.dir.path()).unwrap().records);
    assert!(
        !now.contains(&1),
        "an archive was read through a symlink: {now:?}"
    );
    assert!(cryo_journal::read_segment(&rotation.archive).is_err());
}

#[test]
fn a_writer_rotates_a_journal_past_the_standalone_size_when_it_opens_it() {
    let dir = tempfile::tempdir().unwrap();
    let gone = exited();
    {
        let j = Journal::open(dir.path()).unwrap();
        let big = "x".repeat(1000 * 1000);
        while std::fs::metadata(dir.path().join(FILE_NAME)).unwrap().len()
            <= cryo_journal::STANDALONE_ROTATE_BYTES
        {
            j.append_unsynced(vec![Event::Refused {
                pid: gone,
                reason: big.clone(),
                hint: String::new(),
            }])
            .unwrap();
        }
    }
    let last = cryo_journal::read_all(dir.path())
        .unwrap()
        .records
        .last()
        .unwrap()
        .seq;
    let j = Journal::open(dir.path()).unwrap();
    let active = read(dir.path()).unwrap().records;
    assert_eq!(
        seqs(&active),
        [last + 1],
        "only the rotation record is left"
    );
    assert_eq!(cryo_journal::archives(dir.path()).unwrap().len(), 1);
    assert_eq!(j.append(Event::Killed { pid: gone }).unwrap().seq, last + 2);
}
