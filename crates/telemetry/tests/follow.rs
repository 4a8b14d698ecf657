#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Following the journal: from a seq, woken by appends, across a late creation and a
//! replacement, and served as NDJSON over HTTP.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use cryo_journal::{Event, Journal, ProcId};
use cryo_telemetry::{ndjson_line, Follow};

const LONG: Duration = Duration::from_secs(30);

fn p(pid: i32) -> ProcId {
    ProcId::new(pid, 7)
}

fn locked(j: &Journal, i: u64) -> cryo_journal::Record {
    j.append(Event::Locked {
        pid: p(i as i32),
        ms: i,
    })
    .unwrap()
}

#[test]
fn follows_from_a_seq_and_wakes_on_each_append() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    for i in 1..=5 {
        locked(&j, i);
    }
    let mut f = Follow::new(dir.path(), 3);
    let seqs: Vec<u64> = f.poll_new().unwrap().iter().map(|r| r.seq).collect();
    assert_eq!(seqs, [4, 5]);
    assert!(f.poll_new().unwrap().is_empty());

    // Another thread appends while this one waits: the wait ends with that record.
    let writer = std::thread::spawn(move || {
        for i in 6..=8 {
            locked(&j, i);
        }
    });
    for want in 6..=8 {
        let r = f.next_timeout(LONG).unwrap().expect("appended record");
        assert_eq!(r.seq, want);
    }
    writer.join().unwrap();
    assert_eq!(f.after(), 8);
}

#[test]
fn a_rotation_under_a_follower_neither_repeats_nor_loses_a_record() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    // A live process's records, which a rotation carries into the new segment.
    let me = ProcId::of(std::process::id() as i32).unwrap();
    j.append(Event::RestoreCompleted {
        pid: me,
        image: "/img".into(),
        ms: None,
    })
    .unwrap();
    for i in 2..=5 {
        locked(&j, i);
    }
    let mut f = Follow::new(dir.path(), 2);
    let mut seqs: Vec<u64> = f.poll_new().unwrap().iter().map(|r| r.seq).collect();
    locked(&j, 6);
    j.rotate().unwrap().unwrap();
    locked(&j, 8);
    seqs.extend(f.poll_new().unwrap().iter().map(|r| r.seq));
    // Woken by the rotation's rename as by an append, and two rotations between two looks.
    j.rotate().unwrap().unwrap();
    locked(&j, 10);
    j.rotate().unwrap().unwrap();
    let writer = std::thread::spawn(move || locked(&j, 12));
    while let Some(r) = f.next_timeout(LONG).unwrap() {
        seqs.push(r.seq);
        if r.seq == 12 {
            break;
        }
    }
    writer.join().unwrap();
    assert_eq!(seqs, (3..=12).collect::<Vec<_>>());
    // A follower that starts behind the rotations reads the archives.
    let mut late = Follow::new(dir.path(), 1);
    let all: Vec<u64> = late.poll_new().unwrap().iter().map(|r| r.seq).collect();
    assert_eq!(all, (2..=12).collect::<Vec<_>>());
}

#[test]
fn a_journal_created_after_the_follower_is_followed() {
    let dir = tempfile::tempdir().unwrap();
    let jdir = dir.path().join("not/yet");
    let mut f = Follow::new(&jdir, 0);
    assert!(f.poll_new().unwrap().is_empty());
    let writer = std::thread::spawn(move || {
        let j = Journal::open(&jdir).unwrap();
        locked(&j, 1);
    });
    let r = f.next_timeout(LONG).unwrap().expect("first record");
    assert_eq!(r.seq, 1);
    writer.join().unwrap();
}

#[test]
fn a_replaced_journal_is_followed_from_its_first_record() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    for i in 1..=3 {
        locked(&j, i);
    }
    let mut f = Follow::new(dir.path(), 0);
    assert_eq!(f.poll_new().unwrap().len(), 3);
    drop(j);
    // The operator moves the old journal away; a new one starts at seq 1 again.
    std::fs::rename(
        dir.path().join(cryo_journal::FILE_NAME),
        dir.path().join("old.log"),
    )
    .unwrap();
    let j = Journal::open(dir.path()).unwrap();
    let new = locked(&j, 42);
    assert_eq!(new.seq, 1);
    let r = f
        .next_timeout(LONG)
        .unwrap()
        .expect("the new journal's record");
    assert_eq!(r, new);
}

#[test]
fn ndjson_lines_are_what_timeline_json_prints() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    locked(&j, 1);
    j.append(Event::Refused {
        pid: p(2),
        reason: "a \"quoted\"\nreason".into(),
        hint: "é".into(),
    })
    .unwrap();
    let scan = cryo_journal::read(dir.path()).unwrap();
    let lines: String = Follow::new(dir.path(), 0)
        .poll_new()
        .unwrap()
        .iter()
        .map(ndjson_line)
        .collect();
    assert_eq!(
        lines,
        cryo_journal::render_json(&scan.records, &Default::default())
    );
    assert_eq!(lines.lines().count(), 2);
}

/// `GET /v1/events?follow=1&after=N` as the agent will serve it, on a tiny HTTP server: the
/// backlog after N, then each record as it is appended, one JSON object per line.
#[test]
fn events_stream_as_ndjson_over_http() {
    let dir = tempfile::tempdir().unwrap();
    let j = Journal::open(dir.path()).unwrap();
    for i in 1..=4 {
        locked(&j, i);
    }
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let jdir = dir.path().to_path_buf();
    let server = std::thread::spawn(move || {
        let (conn, _) = listener.accept().unwrap();
        let mut reader = BufReader::new(conn.try_clone().unwrap());
        let mut request = String::new();
        reader.read_line(&mut request).unwrap();
        let after: u64 = request
            .split("after=")
            .nth(1)
            .and_then(|t| t.split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|t| t.parse().ok())
            .unwrap_or(0);
        serve_events(conn, Follow::new(&jdir, after));
    });

    let mut client = TcpStream::connect(addr).unwrap();
    write!(
        client,
        "GET /v1/events?follow=1&after=2 HTTP/1.1\r\nHost: x\r\n\r\n"
    )
    .unwrap();
    let mut lines = BufReader::new(client.try_clone().unwrap()).lines();
    let mut header = Vec::new();
    for l in lines.by_ref() {
        let l = l.unwrap();
        if l.is_empty() {
            break;
        }
        header.push(l);
    }
    assert!(header[0].starts_with("HTTP/1.1 200"), "{header:?}");
    assert!(header
        .iter()
        .any(|h| h == "Content-Type: application/x-ndjson"));

    let mut got = Vec::new();
    for want in 3..=4 {
        let l = lines.next().unwrap().unwrap();
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["seq"], want);
        got.push(l);
    }
    // New records arrive while the client listens.
    for i in 5..=6 {
        let r = locked(&j, i);
        let l = lines.next().unwrap().unwrap();
        assert_eq!(format!("{l}\n"), ndjson_line(&r));
    }
    drop(lines);
    client.shutdown(std::net::Shutdown::Both).unwrap();
    drop(client);
    // The server notices the client is gone at a write after that.
    let mut i = 7;
    support::eventually(LONG, "the server to see the client gone", || {
        locked(&j, i);
        i += 1;
        server.is_finished().then_some(())
    });
    server.join().unwrap();
}

/// What the agent's handler does: backlog, then follow; ends when the client goes away.
fn serve_events(mut conn: TcpStream, mut follow: Follow) {
    if conn
        .write_all(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n",
        )
        .is_err()
    {
        return;
    }
    loop {
        match follow.next_timeout(Duration::from_millis(500)) {
            Ok(Some(r)) => {
                if conn.write_all(ndjson_line(&r).as_bytes()).is_err() {
                    return;
                }
            }
            Ok(None) => continue,
            Err(e) => panic!("{e}"),
        }
    }
}
