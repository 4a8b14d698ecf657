#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The journal with real writer processes: killed mid-write, racing each other, read while they
//! write. Children are the crate's helper binary `cryo-journal-testee`.

use std::ffi::OsStr;
use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use cryo_journal::{in_flight_stops, read, Event, Journal, ProcId, Reader, Record, StopStep};

/// The payload a child writes as its `n`th record: self-describing, so a reader can tell a
/// misread from the real thing.
fn reason(tag: &str, n: u64, len: usize) -> String {
    let fill = char::from(b'a' + (n % 26) as u8);
    let head = format!("{tag}:{n}:{len}:");
    let mut s = head.clone();
    s.extend(std::iter::repeat_n(fill, len.saturating_sub(head.len())));
    s
}

/// Checks a record a child wrote; returns (tag, n).
fn check_child_record(r: &Record) -> (String, u64) {
    let Event::Refused { reason: text, .. } = &r.event else {
        panic!("unexpected event {:?}", r.event);
    };
    let mut parts = text.splitn(4, ':');
    let tag = parts.next().unwrap().to_owned();
    let n: u64 = parts.next().unwrap().parse().unwrap();
    let len: usize = parts.next().unwrap().parse().unwrap();
    assert_eq!(*text, reason(&tag, n, len), "record {} misread", r.seq);
    (tag, n)
}

fn seqs_contiguous(records: &[Record]) {
    for (i, r) in records.iter().enumerate() {
        assert_eq!(r.seq, i as u64 + 1, "seq gap or duplicate at index {i}");
    }
}

/// A child process, killed and reaped when dropped (a failing test leaves none behind).
struct Kid(Child);

impl std::ops::Deref for Kid {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Kid {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cryo-journal-testee ARGS...`; its stdout lines arrive on the returned channel, which
/// disconnects when the child closes its stdout (exits).
fn testee(args: &[&OsStr]) -> (Kid, mpsc::Receiver<String>) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_cryo-journal-testee"))
        .args(args)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            // Keep draining even when nobody listens, or the child dies of EPIPE.
            let _ = tx.send(line);
        }
    });
    (Kid(child), rx)
}

/// Spawns a child writer appending `count` records of `len` bytes tagged `tag`; the seqs it
/// acknowledged arrive on the returned channel.
fn spawn_writer(dir: &Path, tag: &str, count: u64, len: usize) -> (Kid, mpsc::Receiver<String>) {
    spawn_writer_as(dir, tag, count, len, &[])
}

/// As [`spawn_writer`], with more arguments (`unsynced`).
fn spawn_writer_as(
    dir: &Path,
    tag: &str,
    count: u64,
    len: usize,
    more: &[&str],
) -> (Kid, mpsc::Receiver<String>) {
    let (count, len) = (count.to_string(), len.to_string());
    let mut args: Vec<&OsStr> = vec![
        "write".as_ref(),
        dir.as_os_str(),
        tag.as_ref(),
        count.as_ref(),
        len.as_ref(),
    ];
    args.extend(more.iter().map(|m| OsStr::new(*m)));
    let (kid, lines) = testee(&args);
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        for line in lines {
            if let Some(seq) = line.strip_prefix("acked ") {
                let _ = tx.send(seq.to_owned());
            }
        }
    });
    (kid, rx)
}

/// Upper bound on waiting for a child's `ready`: a hang guard, not a timing assertion.
const PATIENCE: Duration = Duration::from_secs(600);

/// Where a stuck child is stuck, for the failure message.
fn stuck(pid: u32) -> String {
    let read = |f: &str| std::fs::read_to_string(format!("/proc/{pid}/{f}")).unwrap_or_default();
    format!(
        "stat {:?}, wchan {:?}, stack {:?}",
        read("stat"),
        read("wchan"),
        read("stack")
    )
}

fn wait_ok(child: &mut Child) {
    let status = child.wait().unwrap();
    assert!(status.success(), "child writer failed: {status}");
}

/// How many whole frames a watched child may append without being caught inside one before
/// the watch kills it anyway: a bound on the disk one round takes (48 MiB of 768 KiB records),
/// counted in the child's writes, not in time.
const WATCH_FRAMES: u32 = 64;

/// Kills the child while it is inside the `write` of a frame (the file has grown past the last
/// complete frame but not to the end of the one being written) and returns true; returns false
/// (the child killed all the same, possibly inside a write too) after it appended
/// [`WATCH_FRAMES`] whole frames unseen inside one. Waits for the child's writes, however slow
/// a loaded machine makes them (its open's directory fsync, a first `fdatasync` behind another
/// test's writeback: a 20 s deadline here failed "child never wrote" under load); a child that
/// exits, or that writes nothing for [`PATIENCE`], fails the test (a hang guard).
fn kill_mid_write(child: &mut Child, path: &Path, mut end: u64) -> bool {
    let file = loop {
        if let Ok(f) = File::open(path) {
            break f;
        }
    };
    let mut header = [0u8; 16];
    let mut frames = 0;
    let mut grew = Instant::now();
    loop {
        let size = file.metadata().unwrap().len();
        if size == end {
            if let Some(status) = child.try_wait().unwrap() {
                panic!("child writer exited after {frames} frames: {status}");
            }
            assert!(
                grew.elapsed() < PATIENCE,
                "child wrote nothing for {PATIENCE:?} after {frames} frames: {}",
                stuck(child.id())
            );
            continue;
        }
        grew = Instant::now();
        if size - end < 16 {
            child.kill().unwrap();
            return true;
        }
        file.read_exact_at(&mut header, end).unwrap();
        let len = u64::from(u32::from_le_bytes(header[4..8].try_into().unwrap()));
        let frame_end = end + 16 + len;
        if size < frame_end {
            child.kill().unwrap();
            return true;
        }
        end = frame_end;
        frames += 1;
        if frames == WATCH_FRAMES {
            child.kill().unwrap();
            return false;
        }
    }
}

#[test]
fn torn_tail_after_kill_9_is_cut_and_complete_records_survive() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(cryo_journal::FILE_NAME);
    let parent = Journal::open(dir.path()).unwrap();
    let mut torn_seen = 0;
    let mut rounds = 0;
    let mut acked_all: Vec<u64> = Vec::new();
    while rounds < 40 && torn_seen < 3 {
        rounds += 1;
        let start = parent
            .append(Event::StopRequested {
                target: format!("round {rounds}"),
            })
            .unwrap();
        let _ = start;
        let end = std::fs::metadata(&path).unwrap().len();
        // 768 KiB records: copying one into the page cache takes long enough to be caught.
        let (mut child, acks) = spawn_writer(dir.path(), "kill", 1_000_000, 768 * 1024);
        // Whether the kill was seen to land inside a write or not, the journal must read
        // as a consistent prefix: `torn` below says which it was.
        kill_mid_write(&mut child, &path, end);
        child.wait().unwrap();
        acked_all.extend(acks.iter().map(|s| s.parse::<u64>().unwrap()));

        // What a reader sees before any writer repairs: a consistent prefix, never an error.
        let before = read(dir.path()).unwrap();
        assert!(before.corruptions.is_empty(), "{:?}", before.corruptions);
        seqs_contiguous(&before.records);
        let torn = before.tail.clone();
        if torn.is_some() {
            torn_seen += 1;
        }
        for r in &before.records {
            if matches!(r.event, Event::Refused { .. }) {
                check_child_record(r);
            }
        }
        let last = before.records.last().unwrap().seq;
        for a in &acked_all {
            assert!(*a <= last, "acknowledged record {a} lost (last is {last})");
        }

        // A writer cuts the torn bytes (on its next append) and journals the cut.
        let rec = parent
            .append(Event::Killed {
                pid: ProcId::new(1, 1),
            })
            .unwrap();
        let after = read(dir.path()).unwrap();
        assert!(after.tail.is_none() && after.corruptions.is_empty());
        seqs_contiguous(&after.records);
        assert_eq!(after.records.last().unwrap(), &rec);
        assert_eq!(&after.records[..before.records.len()], &before.records[..]);
        match &torn {
            Some(t) => {
                assert_eq!(after.records.len(), before.records.len() + 2);
                assert_eq!(
                    after.records[before.records.len()].event,
                    Event::JournalRepaired {
                        offset: t.offset,
                        bytes: t.len
                    }
                );
            }
            None => assert_eq!(after.records.len(), before.records.len() + 1),
        }
    }
    println!("{rounds} kills, {torn_seen} left a torn tail");
    assert!(
        torn_seen > 0,
        "no kill in {rounds} rounds landed inside a write"
    );

    // A fresh writer process also opens the repaired journal cleanly.
    let reopened = Journal::open(dir.path()).unwrap();
    let r = reopened
        .append(Event::GuardLost {
            pid: ProcId::new(2, 2),
        })
        .unwrap();
    assert_eq!(r.seq, read(dir.path()).unwrap().records.len() as u64);
}

#[test]
fn open_cuts_a_torn_tail_left_by_a_killed_writer() {
    open_cuts_a_torn_tail_left_by_a_writer_killed_in(&[]);
}

/// A writer killed inside an unsynced append (`Journal::append_unsynced`: the freeze's
/// `FreezeStarted`, `CheckpointStarted`, `Dumped`) leaves what a killed synced one leaves:
/// every record it was told was written, then at most one torn frame the next open cuts (and
/// journals), with the seqs going on from the last whole record.
#[test]
fn open_cuts_a_torn_tail_left_by_a_writer_killed_in_an_unsynced_append() {
    open_cuts_a_torn_tail_left_by_a_writer_killed_in(&["unsynced"]);
}

fn open_cuts_a_torn_tail_left_by_a_writer_killed_in(how: &[&str]) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(cryo_journal::FILE_NAME);
    Journal::open(dir.path()).unwrap();
    let mut torn = None;
    let mut acked: Vec<u64> = Vec::new();
    for _ in 0..40 {
        let end = std::fs::metadata(&path).unwrap().len();
        let (mut child, acks) = spawn_writer_as(dir.path(), "open", 1_000_000, 768 * 1024, how);
        kill_mid_write(&mut child, &path, end);
        child.wait().unwrap();
        acked.extend(acks.iter().map(|s| s.parse::<u64>().unwrap()));
        torn = read(dir.path()).unwrap().tail;
        if torn.is_some() {
            break;
        }
    }
    let torn = torn.expect("no kill landed inside a write in 40 tries");
    let before = read(dir.path()).unwrap();
    seqs_contiguous(&before.records);
    let n = before.records.len();
    let last = before.records.last().map_or(0, |r| r.seq);
    for a in &acked {
        assert!(
            *a <= last,
            "{how:?}: acknowledged record {a} lost (last is {last})"
        );
    }
    Journal::open(dir.path()).unwrap();
    let after = read(dir.path()).unwrap();
    assert!(after.tail.is_none());
    assert_eq!(after.records.len(), n + 1);
    assert_eq!(
        after.records[n].event,
        Event::JournalRepaired {
            offset: torn.offset,
            bytes: torn.len
        }
    );
    assert_eq!(after.records[n].seq, last + 1, "{how:?}");
}

#[test]
fn two_writer_processes_keep_every_record() {
    let dir = tempfile::tempdir().unwrap();
    let n = 200;
    let (mut a, _) = spawn_writer(dir.path(), "a", n, 300);
    let (mut b, _) = spawn_writer(dir.path(), "b", n, 5000);
    // And a writer thread in this process too.
    let journal = Journal::open(dir.path()).unwrap();
    let me = ProcId::of(std::process::id() as i32).unwrap();
    for i in 0..n {
        journal
            .append(Event::Refused {
                pid: me,
                reason: reason("c", i, 100),
                hint: String::new(),
            })
            .unwrap();
    }
    wait_ok(&mut a);
    wait_ok(&mut b);
    let scan = read(dir.path()).unwrap();
    assert!(scan.corruptions.is_empty() && scan.tail.is_none());
    assert_eq!(scan.records.len() as u64, 3 * n);
    seqs_contiguous(&scan.records);
    for tag in ["a", "b", "c"] {
        let ns: Vec<u64> = scan
            .records
            .iter()
            .map(check_child_record)
            .filter(|(t, _)| t == tag)
            .map(|(_, n)| n)
            .collect();
        assert_eq!(ns, (0..n).collect::<Vec<_>>(), "records of writer {tag}");
    }
}

#[test]
fn reader_sees_a_consistent_prefix_while_a_process_writes() {
    let dir = tempfile::tempdir().unwrap();
    let n = 300;
    let (mut child, _) = spawn_writer(dir.path(), "w", n, 200 * 1024);
    let mut follower = Reader::new(dir.path());
    let mut followed: Vec<Record> = Vec::new();
    let mut last_len = 0;
    let mut tails = 0;
    let mut reads = 0;
    loop {
        let done = child.try_wait().unwrap().is_some();
        let whole = read(dir.path()).unwrap();
        assert!(whole.corruptions.is_empty(), "{:?}", whole.corruptions);
        seqs_contiguous(&whole.records);
        assert!(whole.records.len() >= last_len, "records disappeared");
        last_len = whole.records.len();
        whole
            .records
            .iter()
            .for_each(|r| drop(check_child_record(r)));
        tails += usize::from(whole.tail.is_some());
        let new = follower.read_new().unwrap();
        assert!(new.corruptions.is_empty());
        followed.extend(new.records);
        seqs_contiguous(&followed);
        reads += 1;
        if done {
            break;
        }
    }
    wait_ok(&mut child);
    followed.extend(follower.read_new().unwrap().records);
    assert_eq!(followed.len() as u64, n);
    seqs_contiguous(&followed);
    println!("{reads} reads while writing, {tails} saw a partial frame at the end");
}

#[test]
fn crash_between_intent_and_outcome_is_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    // A stop that finished, for another process.
    let journal = Journal::open(dir.path()).unwrap();
    let done = ProcId::new(77, 5);
    for e in [
        Event::LockStarted { pid: done },
        Event::Locked { pid: done, ms: 1 },
        Event::CheckpointStarted { pid: done },
        Event::Checkpointed {
            pid: done,
            ms: 2,
            bytes: 3,
        },
        Event::Verified {
            pid: done,
            ms: None,
        },
        Event::KillStarted {
            pid: done,
            signal: 9,
        },
        Event::Killed { pid: done },
    ] {
        journal.append(e).unwrap();
    }
    let (mut child, lines) = testee(&["intent".as_ref(), dir.path().as_os_str()]);
    // The wait ends when the child says `ready` or exits; PATIENCE only catches a hang (four
    // fdatasyncs can take long on a loaded host, which is no failure).
    match lines.recv_timeout(PATIENCE) {
        Ok(line) => assert_eq!(line, "ready"),
        Err(mpsc::RecvTimeoutError::Disconnected) => {
            panic!("the intent writer exited early: {}", child.wait().unwrap())
        }
        Err(mpsc::RecvTimeoutError::Timeout) => panic!(
            "the intent writer is stuck before `ready`: {}",
            stuck(child.id())
        ),
    }
    let id = ProcId::of(child.id() as i32).unwrap();
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(!id.is_alive_same());

    let scan = read(dir.path()).unwrap();
    let flying = in_flight_stops(&scan.records);
    assert_eq!(flying.len(), 1, "{flying:?}");
    let f = &flying[&id];
    assert_eq!(f.step, Some(StopStep::CheckpointStarted));
    assert_eq!(f.record.event, Event::CheckpointStarted { pid: id });
}
