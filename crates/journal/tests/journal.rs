#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The journal within one process: round trip, damage, queries, timeline.

use std::os::unix::fs::FileExt;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use cryo_journal::{
    in_flight_stops, last_steps, parse_since_at, read, render_json, render_timeline, Event, Filter,
    FrameFault, Journal, Origin, Origins, ProcId, Record, StopStep, FILE_NAME,
};

fn p(pid: i32) -> ProcId {
    ProcId::new(pid, 1000 + pid as u64)
}

fn every_kind(pid: ProcId) -> Vec<Event> {
    vec![
        Event::StopRequested {
            target: format!("pid {}", pid.pid),
        },
        Event::LockStarted { pid },
        Event::Locked { pid, ms: 12 },
        Event::LockFailed {
            pid,
            error: "CUDA_ERROR_NOT_READY".into(),
        },
        Event::CheckpointStarted { pid },
        Event::Checkpointed {
            pid,
            ms: 1830,
            bytes: 5_800_000_000,
        },
        Event::CheckpointFailed {
            pid,
            error: "CUDA_ERROR_ILLEGAL_STATE".into(),
        },
        Event::Verified { pid, ms: Some(40) },
        Event::VerifyFailed {
            pid,
            bytes_left: 1 << 20,
        },
        Event::KillStarted { pid, signal: 9 },
        Event::Killed { pid },
        Event::Refused {
            pid,
            reason: "lock timed out".into(),
            hint: "retry \"later\"\n".into(),
        },
        Event::StopCompleted {
            target: "pid 1".into(),
            killed: vec![pid, p(2)],
            ms: 4100,
            refused: vec![p(3)],
        },
        Event::FreshDeclared { pid },
        Event::FreezeStarted {
            image: "/img/a".into(),
        },
        Event::Dumped {
            image: "/img/a".into(),
            ms: 2100,
            bytes: 42,
        },
        Event::ImagePublished {
            image: "/img/a".into(),
            bytes: 42,
        },
        Event::FreezeFailed {
            image: "/img/a".into(),
            error: "criu".into(),
        },
        Event::ThawStarted {
            image: "/img/a".into(),
        },
        Event::CriuRestored {
            image: "/img/a".into(),
            ms: 900,
        },
        Event::RestoreCompleted {
            pid,
            image: "/img/a".into(),
            ms: Some(310),
        },
        Event::Unlocked {
            pid,
            ms: Some(2),
            recovery: false,
        },
        Event::HealthOk { pid, ms: 35 },
        Event::ThawCompleted {
            image: "/img/a".into(),
            pids: vec![pid],
            ms: 3400,
        },
        Event::ThawFailed {
            image: "/img/a".into(),
            error: "no memory".into(),
        },
        Event::GuardAttached {
            pid,
            source: cryo_journal::AttachSource::Restore,
        },
        Event::FatalSignal { pid, signal: 11 },
        Event::Pinned {
            pid,
            gpu: "GPU-1234".into(),
            fds: vec![5, 6, 7],
        },
        Event::GpuQuarantined {
            gpu: "GPU-1234".into(),
            reason: "pinned context".into(),
        },
        Event::PinsReleased { pid },
        Event::GuardLost { pid },
    ]
}

#[test]
fn round_trip_of_every_event() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path().join("nested/journal")).unwrap();
    let mut written = Vec::new();
    for e in every_kind(p(4242)) {
        written.push(j.append(e).unwrap());
    }
    drop(j);
    let scan = read(dir.path().join("nested/journal")).unwrap();
    assert!(scan.corruptions.is_empty() && scan.tail.is_none());
    assert_eq!(scan.records, written);
    assert_eq!(
        scan.records.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=31).collect::<Vec<_>>()
    );
    // A second writer continues the sequence.
    let j = Journal::open(dir.path().join("nested/journal")).unwrap();
    assert_eq!(j.append(Event::Killed { pid: p(1) }).unwrap().seq, 32);
}

#[test]
fn missing_journal_reads_empty() {
    let dir = tempfile::tempdir().unwrap();
    let scan = read(dir.path().join("nope")).unwrap();
    assert!(scan.records.is_empty() && scan.tail.is_none());
}

#[test]
fn unknown_event_from_a_newer_cryo_reads_as_unknown() {
    let r: Record = serde_json::from_str(
        r#"{"seq":3,"time":"2026-11-30T02:41:07.123456789Z","event":{"type":"warp_drive","pid":1}}"#,
    )
    .unwrap();
    assert_eq!(r.event, Event::Unknown);
    assert_eq!(r.seq, 3);
}

#[test]
fn records_of_older_journals_read_without_the_newer_fields() {
    // As a cryo before durations were journaled for verify, restore and unlock wrote them.
    let old = [
        r#"{"seq":1,"time":"2026-11-30T02:41:07Z","event":{"type":"verified","pid":{"pid":7,"start_time":9}}}"#,
        r#"{"seq":2,"time":"2026-11-30T02:41:07Z","event":{"type":"restore_completed","pid":{"pid":7,"start_time":9},"image":"/img"}}"#,
        r#"{"seq":3,"time":"2026-11-30T02:41:07Z","event":{"type":"unlocked","pid":{"pid":7,"start_time":9}}}"#,
        r#"{"seq":4,"time":"2026-11-30T02:41:07Z","event":{"type":"stop_completed","target":"pid 7","killed":[],"ms":5}}"#,
    ];
    let events: Vec<Event> = old
        .iter()
        .map(|t| serde_json::from_str::<Record>(t).unwrap().event)
        .collect();
    let pid = ProcId::new(7, 9);
    assert_eq!(
        events,
        vec![
            Event::Verified { pid, ms: None },
            Event::RestoreCompleted {
                pid,
                image: "/img".into(),
                ms: None
            },
            Event::Unlocked {
                pid,
                ms: None,
                recovery: false,
            },
            Event::StopCompleted {
                target: "pid 7".into(),
                killed: vec![],
                ms: 5,
                refused: vec![],
            },
        ]
    );
    // And records without the new values are written as before, so older readers see no change.
    for (text, event) in old.iter().zip(events) {
        let r = Record {
            seq: serde_json::from_str::<Record>(text).unwrap().seq,
            time: serde_json::from_str::<Record>(text).unwrap().time,
            event,
        };
        let again: serde_json::Value = serde_json::to_value(&r).unwrap();
        let orig: serde_json::Value = serde_json::from_str(text).unwrap();
        assert_eq!(again["event"], orig["event"]);
    }
}

/// Appends 10 records and returns the frame start offsets.
fn ten(dir: &std::path::Path) -> (Journal, Vec<Record>, Vec<u64>) {
    let j = Journal::open(dir).unwrap();
    let mut starts = Vec::new();
    let mut recs = Vec::new();
    for i in 0..10 {
        starts.push(std::fs::metadata(dir.join(FILE_NAME)).unwrap().len());
        recs.push(
            j.append(Event::Locked {
                pid: p(i),
                ms: i as u64,
            })
            .unwrap(),
        );
    }
    (j, recs, starts)
}

fn flip(dir: &std::path::Path, offset: u64) {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(dir.join(FILE_NAME))
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, offset).unwrap();
    b[0] ^= 0x20;
    f.write_all_at(&b, offset).unwrap();
}

#[test]
fn flipped_byte_in_the_middle_is_reported_with_its_offset_and_skipped() {
    for (what, delta) in [("payload", 40u64), ("length", 5), ("magic", 0)] {
        let dir = tempfile::tempdir().unwrap();
        let (j, recs, starts) = ten(dir.path());
        flip(dir.path(), starts[4] + delta);
        let scan = read(dir.path()).unwrap();
        assert_eq!(scan.corruptions.len(), 1, "{what}");
        let c = &scan.corruptions[0];
        assert_eq!(c.offset, starts[4], "{what}");
        assert_eq!(c.len, starts[5] - starts[4], "{what}");
        let expect: Vec<Record> = recs
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != 4)
            .map(|(_, r)| r.clone())
            .collect();
        assert_eq!(scan.records, expect, "{what}: records around the damage");
        assert!(scan.tail.is_none());
        let fault = &c.fault;
        match what {
            "payload" => assert_eq!(*fault, FrameFault::BadPayloadChecksum),
            "length" => assert_eq!(*fault, FrameFault::BadHeaderChecksum),
            _ => assert_eq!(*fault, FrameFault::BadMagic),
        }
        assert!(c.to_string().contains(&format!("offset {}", starts[4])));

        // Writers keep damage in the middle in place and go on appending after it.
        let r = j.append(Event::Killed { pid: p(99) }).unwrap();
        assert_eq!(r.seq, 11);
        let j2 = Journal::open(dir.path()).unwrap();
        assert_eq!(j2.append(Event::Killed { pid: p(98) }).unwrap().seq, 12);
        let scan = read(dir.path()).unwrap();
        assert_eq!(scan.corruptions.len(), 1);
        assert_eq!(scan.records.len(), 11);
    }
}

#[test]
fn flipped_byte_in_the_last_record_is_cut_as_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let (_j, recs, starts) = ten(dir.path());
    flip(dir.path(), starts[9] + 30);
    let scan = read(dir.path()).unwrap();
    assert_eq!(scan.records, recs[..9]);
    let tail = scan.tail.unwrap();
    assert_eq!(
        (tail.offset, tail.fault),
        (starts[9], FrameFault::BadPayloadChecksum)
    );
    let j = Journal::open(dir.path()).unwrap();
    let scan = read(dir.path()).unwrap();
    assert_eq!(scan.records.len(), 10);
    assert_eq!(
        scan.records[9].event,
        Event::JournalRepaired {
            offset: starts[9],
            bytes: tail.len
        }
    );
    assert_eq!(scan.records[9].seq, 10);
    assert_eq!(j.append(Event::Killed { pid: p(1) }).unwrap().seq, 11);
}

#[test]
fn a_batch_is_appended_in_order_at_once_and_a_torn_one_keeps_its_whole_records() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    j.append(Event::LockStarted { pid: p(1) }).unwrap();
    let batch = vec![
        Event::Locked { pid: p(1), ms: 3 },
        Event::CheckpointStarted { pid: p(1) },
        Event::Killed { pid: p(2) },
    ];
    let written = j.append_all(batch.clone()).unwrap();
    assert_eq!(
        written.iter().map(|r| r.seq).collect::<Vec<_>>(),
        vec![2, 3, 4]
    );
    assert!(j.append_all(Vec::new()).unwrap().is_empty());
    // Another writer (process) appends after the batch, never inside it.
    let other = Journal::open(dir.path()).unwrap();
    assert_eq!(other.append(Event::Killed { pid: p(3) }).unwrap().seq, 5);
    assert_eq!(
        j.append_all(vec![Event::Killed { pid: p(4) }]).unwrap()[0].seq,
        6
    );
    let scan = read(dir.path()).unwrap();
    let events: Vec<Event> = scan.records.iter().map(|r| r.event.clone()).collect();
    assert_eq!(events[1..4], batch[..]);
    assert_eq!(scan.records.len(), 6);

    // A writer killed in the middle of a batch's write: the records before the tear are kept,
    // the torn one is cut by the next writer, as after single appends.
    let path = dir.path().join(FILE_NAME);
    let len = std::fs::metadata(&path).unwrap().len();
    let end_of_third = {
        let scan = read(dir.path()).unwrap();
        assert!(scan.tail.is_none());
        len
    };
    let j = Journal::open(dir.path()).unwrap();
    j.append_all(vec![
        Event::Locked { pid: p(5), ms: 1 },
        Event::CheckpointStarted { pid: p(5) },
    ])
    .unwrap();
    let whole = std::fs::metadata(&path).unwrap().len();
    assert_eq!(read(dir.path()).unwrap().records.len(), 8);
    // Cut inside the batch's second frame: the first one's header says its payload's length.
    let mut header = [0u8; 16];
    std::fs::File::open(&path)
        .unwrap()
        .read_exact_at(&mut header, end_of_third)
        .unwrap();
    assert_eq!(&header[..4], b"CRJ1");
    let payload = u32::from_le_bytes(header[4..8].try_into().unwrap()) as u64;
    let first_frame = end_of_third + 16 + payload + 10;
    assert!(first_frame < whole);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(first_frame)
        .unwrap();
    let scan = read(dir.path()).unwrap();
    assert_eq!(scan.records.len(), 7, "the batch's first record is whole");
    assert_eq!(scan.records[6].event, Event::Locked { pid: p(5), ms: 1 });
    assert!(scan.tail.is_some());
    let j = Journal::open(dir.path()).unwrap();
    assert!(matches!(
        read(dir.path()).unwrap().records[7].event,
        Event::JournalRepaired { .. }
    ));
    assert_eq!(j.append(Event::Killed { pid: p(6) }).unwrap().seq, 9);
}

#[test]
fn threads_share_one_journal() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    std::thread::scope(|s| {
        for t in 0..4 {
            let j = &j;
            s.spawn(move || {
                for i in 0..25 {
                    j.append(Event::Locked { pid: p(t), ms: i }).unwrap();
                }
            });
        }
    });
    let scan = read(dir.path()).unwrap();
    assert_eq!(scan.records.len(), 100);
    for (i, r) in scan.records.iter().enumerate() {
        assert_eq!(r.seq, i as u64 + 1);
    }
}

fn at(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(1_796_006_467_123 + ms)
}

fn rec(seq: u64, ms: u64, event: Event) -> Record {
    Record {
        seq,
        time: at(ms),
        event,
    }
}

#[test]
fn timeline_reads_like_an_incident_timeline() {
    let w = p(4242);
    let recs = vec![
        rec(
            1,
            0,
            Event::RestoreCompleted {
                pid: w,
                image: "/img/llama".into(),
                ms: None,
            },
        ),
        rec(2, 900, Event::HealthOk { pid: w, ms: 35 }),
        rec(
            3,
            60_000,
            Event::StopRequested {
                target: "pid 4242".into(),
            },
        ),
        rec(4, 60_012, Event::Locked { pid: w, ms: 12 }),
        rec(
            5,
            61_842,
            Event::Checkpointed {
                pid: w,
                ms: 1830,
                bytes: 5_800_000_000,
            },
        ),
        rec(6, 61_900, Event::Verified { pid: w, ms: None }),
        rec(7, 61_950, Event::Killed { pid: w }),
        rec(
            8,
            62_000,
            Event::Refused {
                pid: p(7),
                reason: "sticky error".into(),
                hint: "use --unsafe".into(),
            },
        ),
    ];
    let text = render_timeline(&recs, &Filter::default());
    let expect = "\
2026-11-30T02:41:07.123Z  pid 4242    restore completed   image /img/llama
2026-11-30T02:41:08.023Z  pid 4242    health ok           35 ms
2026-11-30T02:42:07.123Z  -           stop requested      target pid 4242
2026-11-30T02:42:07.135Z  pid 4242    locked              12 ms
2026-11-30T02:42:08.965Z  pid 4242    checkpointed        1830 ms, 5.4 GiB
2026-11-30T02:42:09.023Z  pid 4242    verified            no device memory left
2026-11-30T02:42:09.073Z  pid 4242    killed
2026-11-30T02:42:09.123Z  pid 7       REFUSED             sticky error (hint: use --unsafe)
";
    assert_eq!(text, expect);

    let only = Filter {
        since: Some(at(61_000)),
        pid: Some(4242),
    };
    let text = render_timeline(&recs, &only);
    assert_eq!(text.lines().count(), 3, "{text}");

    let json = render_json(&recs, &only);
    let lines: Vec<serde_json::Value> = json
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3);
    assert_eq!(lines[0]["seq"], 5);
    assert_eq!(lines[0]["time"], "2026-11-30T02:42:08.965000000Z");
    assert_eq!(lines[0]["event"]["type"], "checkpointed");
    assert_eq!(lines[0]["event"]["bytes"], 5_800_000_000u64);
    assert_eq!(lines[0]["event"]["pid"]["pid"], 4242);
    assert_eq!(lines[0]["event"]["pid"]["start_time"], w.start_time);
    let back: Record = serde_json::from_value(lines[0].clone()).unwrap();
    assert_eq!(back, recs[4]);
}

#[test]
fn since_accepts_rfc3339_and_durations_ago() {
    let now = at(0);
    assert_eq!(
        parse_since_at("2026-11-30T02:41:07.123Z", now).unwrap(),
        at(0)
    );
    assert_eq!(
        parse_since_at("2026-11-30T03:41:07.123+01:00", now).unwrap(),
        at(0)
    );
    assert_eq!(
        parse_since_at("10m", now).unwrap(),
        now - Duration::from_secs(600)
    );
    assert_eq!(
        parse_since_at(" 2h ", now).unwrap(),
        now - Duration::from_secs(7200)
    );
    assert_eq!(
        parse_since_at("1h 30m", now).unwrap(),
        now - Duration::from_secs(5400)
    );
    for bad in ["", "yesterday", "2026-11-30", "10 parsecs"] {
        let err = parse_since_at(bad, now).unwrap_err();
        assert!(err.to_string().contains(&format!("{bad:?}")));
    }
}

#[test]
fn origins_know_restored_and_fresh_processes() {
    let me = ProcId::of(std::process::id() as i32).unwrap();
    let gone = ProcId::new(me.pid, me.start_time + 1);
    let recs = vec![
        rec(
            1,
            0,
            Event::RestoreCompleted {
                pid: me,
                image: "/img/a".into(),
                ms: None,
            },
        ),
        rec(
            2,
            1,
            Event::RestoreCompleted {
                pid: gone,
                image: "/img/b".into(),
                ms: None,
            },
        ),
        rec(3, 2, Event::FreshDeclared { pid: p(5) }),
        // A declaration never overrides a restore.
        rec(4, 3, Event::FreshDeclared { pid: me }),
    ];
    let o = Origins::from_records(&recs);
    assert_eq!(
        o.of(&me),
        Origin::Restored {
            image: "/img/a".into()
        }
    );
    assert_eq!(o.of(&p(5)), Origin::Fresh);
    assert_eq!(o.of(&p(6)), Origin::Unknown);
    assert_eq!(o.live_restored(), vec![me]);
    let mut alive = o.clone();
    alive.retain_alive();
    assert_eq!(alive.restored.len(), 1);
    assert!(alive.fresh.is_empty());
}

#[test]
fn in_flight_gives_the_last_stop_step_of_unfinished_processes() {
    let (a, b, c) = (p(1), p(2), p(3));
    let recs = vec![
        rec(
            1,
            0,
            Event::StopRequested {
                target: "cgroup /x".into(),
            },
        ),
        rec(2, 1, Event::LockStarted { pid: a }),
        rec(3, 2, Event::LockStarted { pid: b }),
        rec(4, 3, Event::LockStarted { pid: c }),
        rec(5, 4, Event::Locked { pid: a, ms: 1 }),
        rec(6, 5, Event::Locked { pid: b, ms: 1 }),
        rec(
            7,
            6,
            Event::Checkpointed {
                pid: a,
                ms: 1,
                bytes: 1,
            },
        ),
        rec(8, 7, Event::Verified { pid: a, ms: None }),
        rec(
            9,
            8,
            Event::Refused {
                pid: c,
                reason: "x".into(),
                hint: "y".into(),
            },
        ),
        rec(10, 9, Event::HealthOk { pid: b, ms: 1 }),
    ];
    let f = in_flight_stops(&recs);
    assert_eq!(f.keys().copied().collect::<Vec<_>>(), vec![a, b]);
    assert_eq!(f[&a].step, Some(StopStep::Verified));
    assert_eq!(f[&a].record.seq, 8);
    assert_eq!(f[&b].step, Some(StopStep::Locked));
    let last = last_steps(&recs);
    assert_eq!(last[&b].seq, 10);
    assert_eq!(last[&c].seq, 9);
}

/// Every record of the journal in `dir` is one that was appended whole, in order (`appended`:
/// every event handed to an append, in order; the journal may hold a prefix of a batch that
/// failed, never a record that differs from the one handed in), with strictly increasing seqs.
fn assert_whole(dir: &std::path::Path, appended: &[Event]) -> cryo_journal::Scan {
    let scan = read(dir).unwrap();
    assert!(scan.corruptions.is_empty(), "{:?}", scan.corruptions);
    let mut at = 0;
    for r in &scan.records {
        if matches!(r.event, Event::JournalRepaired { .. }) {
            continue;
        }
        let found = appended[at..].iter().position(|e| *e == r.event);
        assert!(
            found.is_some(),
            "record {} was never appended whole: {:?}",
            r.seq,
            r.event
        );
        at += found.unwrap_or(0) + 1;
    }
    for w in scan.records.windows(2) {
        assert!(w[0].seq < w[1].seq, "seqs {} then {}", w[0].seq, w[1].seq);
    }
    scan
}

/// Attack (session 12): the disk fills in the middle of a batch (not a kill: the writer lives
/// on and appends again). The append fails; the journal then holds whole records only (a
/// prefix of the batch at most, never a torn record read as a whole one), every later append
/// while the disk is full fails too, and once there is room again the next append cuts the
/// torn tail, journals the repair and goes on, seqs never reused.
#[test]
fn a_batch_torn_by_a_full_disk_leaves_whole_records_and_the_next_append_recovers() {
    let disk = cryo_testkit::disk::SmallDisk::mount("64k");
    let dir = disk.path().join("journal");
    let j = Journal::open(&dir).unwrap();
    let big = |i: usize| Event::StopRequested {
        target: format!("pid {i} {}", "x".repeat(1500)),
    };
    let mut appended = vec![big(0)];
    j.append(big(0)).unwrap();
    let filler = disk.fill();
    // Three frames of ~1.5 KiB do not fit in what is left of the journal's last page.
    let batch: Vec<Event> = (1..4).map(big).collect();
    appended.extend(batch.iter().cloned());
    let err = j.append_all(batch).unwrap_err();
    assert!(err.to_string().contains("No space left on device"), "{err}");
    let scan = assert_whole(&dir, &appended);
    assert!(scan.records.len() < 4, "the whole batch is there: {err}");
    assert!(scan.tail.is_some(), "no torn frame: the attack missed");
    // (Here: the first record and the batch's first, then 862 bytes of its second.)
    // Still full: refused again (the torn tail cut or not), and still only whole records.
    for i in 4..6 {
        appended.push(big(i));
        assert!(j.append(big(i)).is_err(), "appended on a full disk");
        assert_whole(&dir, &appended);
    }
    // A writer that opens it now may cut a torn tail and journal the repair, or fail.
    let _ = Journal::open(&dir);
    assert_whole(&dir, &appended);
    std::fs::remove_file(filler).unwrap();
    let after = Event::Killed { pid: p(7) };
    appended.push(after.clone());
    let last = j.append(after.clone()).unwrap();
    let scan = assert_whole(&dir, &appended);
    assert!(scan.tail.is_none(), "{:?}", scan.tail);
    assert_eq!(scan.records.last().map(|r| &r.event), Some(&after));
    assert_eq!(scan.records.last().map(|r| r.seq), Some(last.seq));
    // Another writer (a process) opens it as it is.
    let other = Journal::open(&dir).unwrap();
    assert_eq!(
        other.append(Event::Killed { pid: p(8) }).unwrap().seq,
        last.seq + 1
    );
}
