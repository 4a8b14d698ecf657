#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The syslog forwarder against a real rsyslog (Debian's package, a private instance on a
//! loopback port of its own): every record in order with the journal's content; a collector
//! stopped during a burst and started again gets what it missed; a forwarder restarted resumes
//! from its stored offset; an offset of another journal is not trusted.

mod support;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use cryo_journal::{Event, Journal, ProcId, Record};
use cryo_telemetry::{ForwardConfig, Forwarder, Offset, OffsetFile, SyslogFormat};
use support::rsyslog::{Received, Rsyslog};

const LONG: Duration = Duration::from_secs(60);

fn p(pid: i32) -> ProcId {
    ProcId::new(pid, 7)
}

fn cfg(state: &std::path::Path, collector: &str) -> ForwardConfig {
    let mut c = ForwardConfig::new(&cryo_state::StateDir::new(state), collector);
    c.format = SyslogFormat {
        hostname: "node-a.example".into(),
        ..SyslogFormat::default()
    };
    // Reconnect quickly in tests.
    c.retry_max = Duration::from_millis(200);
    c
}

/// Every seq of `got`, checking that each first copy comes in journal order.
fn first_copies(got: &[Received]) -> BTreeMap<u64, usize> {
    let mut count = BTreeMap::new();
    let mut last_new = 0;
    for r in got {
        let n = count.entry(r.seq).or_insert(0);
        if *n == 0 {
            assert!(
                r.seq > last_new,
                "seq {} first arrived after {last_new}",
                r.seq
            );
            last_new = r.seq;
        }
        *n += 1;
    }
    count
}

#[test]
fn rsyslog_receives_every_record_in_order_with_the_journal_content() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    let j = Journal::open(state.path().join("journal")).unwrap();
    let mut written: Vec<Record> = Vec::new();
    written.push(
        j.append(Event::StopRequested {
            target: "pid 4242".into(),
        })
        .unwrap(),
    );
    written.push(
        j.append(Event::Locked {
            pid: p(4242),
            ms: 12,
        })
        .unwrap(),
    );
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    written.push(
        j.append(Event::Refused {
            pid: p(4242),
            reason: "lock timed out] \"twice\"".into(),
            hint: "retry\nlater é".into(),
        })
        .unwrap(),
    );
    written.push(
        j.append(Event::Pinned {
            pid: p(4242),
            gpu: "GPU-0".into(),
            fds: vec![5, 6],
        })
        .unwrap(),
    );
    let n = written.len();
    let got = rs.wait_for(LONG, "every record", |g| g.len() >= n);
    assert_eq!(got.len(), n, "{got:#?}");
    for (r, w) in got.iter().zip(&written) {
        assert_eq!(r.seq, w.seq);
        assert_eq!(
            format!("{}\n", r.msg),
            cryo_telemetry::ndjson_line(w),
            "MSG is the record as cryo timeline --json prints it"
        );
        assert_eq!(r.msgid, cryo_telemetry::event_type(&w.event));
        assert_eq!(r.hostname, "node-a.example");
        assert_eq!(r.app_name, "cryo");
        assert_eq!(r.procid, std::process::id().to_string());
        assert!(r.structured_data.starts_with(&format!(
            "[cryo@32473 seq=\"{}\" type=\"{}\"",
            w.seq, r.msgid
        )));
    }
    assert_eq!(got[2].pri, "28", "daemon.warning for a refusal");
    assert_eq!(got[3].pri, "26", "daemon.crit for a pin");
    assert!(
        got[2]
            .structured_data
            .contains(r#"reason="lock timed out\] \"twice\"""#),
        "{}",
        got[2].structured_data
    );
    let st = fwd.status();
    assert!(st.connected);
    assert_eq!(st.delivered_seq, n as u64);
    fwd.stop();
    let stored = OffsetFile::new(state.path().join("syslog.offset"))
        .load()
        .unwrap();
    assert_eq!(stored.seq, n as u64);
}

/// The collector is stopped (SIGTERM, as a service manager does) in the middle of a burst and
/// started again: every record arrives.
#[test]
fn collector_stopped_during_a_burst_receives_what_it_missed() {
    catch_up(Rsyslog::stop);
}

/// The collector crashes (SIGKILL) in the middle of a burst and is started again: every record
/// arrives.
#[test]
fn collector_killed_during_a_burst_receives_what_it_missed() {
    catch_up(Rsyslog::kill);
}

/// Every record arrives after the outage, each first copy in journal order; the duplicates are
/// resends of records sent before the outage (at least once), never of later ones.
fn catch_up(down: fn(&mut Rsyslog)) {
    const TOTAL: u64 = 1500;
    let state = tempfile::tempdir().unwrap();
    let mut rs = Rsyslog::start();
    let j = Arc::new(Journal::open(state.path().join("journal")).unwrap());
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();

    let appended = Arc::new(AtomicU64::new(0));
    let writer = std::thread::spawn({
        let (j, appended) = (Arc::clone(&j), Arc::clone(&appended));
        move || {
            for i in 1..=TOTAL {
                j.append(Event::Checkpointed {
                    pid: p(i as i32),
                    ms: i,
                    bytes: i << 20,
                })
                .unwrap();
                appended.store(i, Ordering::Relaxed);
                // Paced, so that the outage falls in the middle of the burst.
                std::thread::sleep(Duration::from_micros(300));
            }
        }
    });

    rs.wait_for(LONG, "the first 300 records", |g| {
        g.iter().any(|r| r.seq >= 300)
    });
    down(&mut rs);
    let at_down = appended.load(Ordering::Relaxed);
    let received_before = rs.received().iter().map(|r| r.seq).max().unwrap_or(0);
    // The journal goes on while the collector is down.
    support::eventually(
        LONG,
        "200 records appended while the collector is down",
        || (appended.load(Ordering::Relaxed) >= at_down + 200).then_some(()),
    );
    let at_up = appended.load(Ordering::Relaxed);
    rs.restart();
    writer.join().unwrap();

    let got = rs.wait_for(LONG, "every record after the restart", |g| {
        let seen: std::collections::BTreeSet<u64> = g.iter().map(|r| r.seq).collect();
        seen.len() as u64 == TOTAL
    });
    let count = first_copies(&got);
    assert_eq!(count.len() as u64, TOTAL);
    assert_eq!(*count.keys().next().unwrap(), 1);
    assert_eq!(*count.keys().last().unwrap(), TOTAL);
    let dups: u64 = count.values().map(|n| *n as u64 - 1).sum();
    let last_dup = count
        .iter()
        .filter(|(_, n)| **n > 1)
        .map(|(s, _)| *s)
        .max()
        .unwrap_or(0);
    let st = fwd.status();
    assert!(
        dups <= st.resent_total,
        "{dups} duplicates but {} resends",
        st.resent_total
    );
    assert!(
        last_dup <= received_before,
        "seq {last_dup} arrived twice, though the collector only had up to {received_before} before the outage"
    );
    assert!(st.connections_total >= 2, "{st:?}");
    assert!(got.iter().all(|r| r.msgid == "checkpointed"));
    eprintln!(
        "catch-up: {TOTAL} records; collector had {received_before} when it went down, the journal \
         {at_down}; {} appended while it was down; after the restart every record arrived: \
         {dups} duplicates (resends {}), {} connections",
        at_up - at_down,
        st.resent_total,
        st.connections_total
    );
}

#[test]
fn a_restarted_forwarder_resumes_from_its_offset() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    let j = Journal::open(state.path().join("journal")).unwrap();
    for i in 1..=10 {
        j.append(Event::Locked { pid: p(i), ms: 1 }).unwrap();
    }
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    rs.wait_for(LONG, "ten records", |g| g.len() >= 10);
    // Wait until delivery is known (acknowledged), then stop cleanly.
    support::eventually(LONG, "delivery of ten", || {
        (fwd.status().delivered_seq == 10).then_some(())
    });
    fwd.stop();
    for i in 11..=15 {
        j.append(Event::Locked { pid: p(i), ms: 1 }).unwrap();
    }
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let got = rs.wait_for(LONG, "fifteen records", |g| g.iter().any(|r| r.seq == 15));
    let seqs: Vec<u64> = got.iter().map(|r| r.seq).collect();
    assert_eq!(
        seqs,
        (1..=15).collect::<Vec<_>>(),
        "nothing sent twice after a clean stop"
    );
    drop(fwd);
}

#[test]
fn an_offset_of_another_journal_is_not_trusted() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    // An offset left by a journal that had 500 records (this one has 3).
    OffsetFile::new(state.path().join("syslog.offset"))
        .store(&Offset {
            seq: 500,
            journal_first: Some("2020-01-01T00:00:00.000000000Z".into()),
            marks: Vec::new(),
        })
        .unwrap();
    let j = Journal::open(state.path().join("journal")).unwrap();
    for i in 1..=3 {
        j.append(Event::Killed { pid: p(i) }).unwrap();
    }
    let _fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let got = rs.wait_for(LONG, "three records", |g| g.len() >= 3);
    assert_eq!(got.iter().map(|r| r.seq).collect::<Vec<_>>(), [1, 2, 3]);
}

/// The journal's identity survives rotations (the time of its first record, kept in every
/// rotation record): an offset of another journal is still not trusted once the active segment
/// no longer holds record 1, and the journal is forwarded from its first record, archives
/// included.
#[test]
fn an_offset_of_another_journal_is_not_trusted_after_a_rotation() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    OffsetFile::new(state.path().join("syslog.offset"))
        .store(&Offset {
            seq: 2,
            journal_first: Some("2020-01-01T00:00:00.000000000Z".into()),
            marks: Vec::new(),
        })
        .unwrap();
    let j = Journal::open(state.path().join("journal")).unwrap();
    for i in 1..=3 {
        j.append(Event::Killed { pid: p(i) }).unwrap();
    }
    j.rotate().unwrap().unwrap();
    j.append(Event::Killed { pid: p(5) }).unwrap();
    let _fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let got = rs.wait_for(LONG, "five records", |g| g.iter().any(|r| r.seq == 5));
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        [1, 2, 3, 4, 5]
    );
}

/// A forwarder stopped while the journal rotated (twice) resumes from its offset: what it
/// missed is read from the archives, nothing is sent twice.
#[test]
fn a_forwarder_resumes_across_rotations_from_its_offset() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    let j = Journal::open(state.path().join("journal")).unwrap();
    for i in 1..=5 {
        j.append(Event::Locked { pid: p(i), ms: 1 }).unwrap();
    }
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    support::eventually(LONG, "delivery of five", || {
        (fwd.status().delivered_seq == 5).then_some(())
    });
    fwd.stop();
    j.append(Event::Locked { pid: p(6), ms: 1 }).unwrap();
    j.rotate().unwrap().unwrap();
    j.append(Event::Locked { pid: p(8), ms: 1 }).unwrap();
    j.rotate().unwrap().unwrap();
    j.append(Event::Locked { pid: p(10), ms: 1 }).unwrap();
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let got = rs.wait_for(LONG, "record 10", |g| g.iter().any(|r| r.seq == 10));
    assert_eq!(
        got.iter().map(|r| r.seq).collect::<Vec<_>>(),
        (1..=10).collect::<Vec<_>>(),
        "every record once across the rotations"
    );
    drop(fwd);
}

/// A power cut after the forwarder sent records the journal had not synced yet: the journal
/// comes back cut to its last synced length and new records take the lost records' seqs. The
/// forwarder's stored position (past those seqs) must not make it skip them: every new record
/// reaches the collector (some old ones may come twice, none is lost).
#[test]
fn records_that_reuse_the_seqs_a_power_cut_lost_are_all_forwarded() {
    power_cut_then(false);
}

/// The same, with the journal rotated after the new boot's records: the records the forwarder's
/// position names are in an archive by then, and are checked there.
#[test]
fn records_that_reuse_the_seqs_a_power_cut_lost_are_all_forwarded_across_a_rotation() {
    power_cut_then(true);
}

fn power_cut_then(rotate: bool) {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    let dir = state.path().join("journal");
    let path = dir.join(cryo_journal::FILE_NAME);
    let j = Journal::open(&dir).unwrap();
    for i in 1..=5 {
        j.append(Event::Locked { pid: p(i), ms: 1 }).unwrap();
    }
    // What a power cut leaves: everything up to the last synced append.
    let synced = std::fs::metadata(&path).unwrap().len();
    j.append_unsynced(
        (6..=10)
            .map(|i| Event::Locked { pid: p(i), ms: 1 })
            .collect(),
    )
    .unwrap();
    drop(j);
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    support::eventually(LONG, "delivery of ten", || {
        (fwd.status().delivered_seq == 10).then_some(())
    });
    fwd.stop();

    // The power cut, then the host's next boot appends records 6..=12 (other events).
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(synced)
        .unwrap();
    let j = Journal::open(&dir).unwrap();
    let mut after: Vec<Record> = (6..=12)
        .map(|i| j.append(Event::Killed { pid: p(100 + i) }).unwrap())
        .collect();
    assert_eq!(
        after.first().unwrap().seq,
        6,
        "the cut journal reuses the lost seqs"
    );
    if rotate {
        j.rotate().unwrap().unwrap();
        after.push(j.append(Event::Killed { pid: p(200) }).unwrap());
        let active = cryo_journal::read(&dir).unwrap();
        assert!(
            active.records.iter().all(|r| r.seq > 12),
            "records 1..=12 are archived"
        );
    }
    let end = after.last().unwrap().seq;

    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let got = rs.wait_for(LONG, "the last record", |g| g.iter().any(|r| r.seq == end));
    // The collector is told, before the new records, which seqs it got other records for.
    let told = got
        .iter()
        .position(|r| r.msgid == "records_replaced")
        .unwrap_or_else(|| panic!("no records_replaced message: {got:?}"));
    let told = &got[told..];
    assert!(
        told[0].structured_data.contains(r#"last="10""#),
        "{}",
        told[0].structured_data
    );
    let first: u64 = serde_json::from_str::<serde_json::Value>(&told[0].msg).unwrap()["first"]
        .as_u64()
        .unwrap();
    assert!((1..=6).contains(&first), "{}", told[0].msg);
    for w in &after {
        assert!(
            told.iter().any(|r| r.seq == w.seq && format!("{}\n", r.msg) == cryo_telemetry::ndjson_line(w)),
            "record {} of the new boot came before the notice",
            w.seq
        );
    }
    for w in &after {
        assert!(
            got.iter()
                .any(|r| r.seq == w.seq && format!("{}\n", r.msg) == cryo_telemetry::ndjson_line(w)),
            "record {} of the new boot ({}) never reached the collector: {:?}",
            w.seq,
            cryo_telemetry::event_type(&w.event),
            got.iter().map(|r| (r.seq, r.msgid.as_str())).collect::<Vec<_>>()
        );
    }
    drop(fwd);
}

/// A forwarder down longer than the journal's retention: the records only the pruned archives
/// held can no longer be sent, and the collector is told which (a `records_lost` message with
/// the seq range) before the records after them; the forwarder counts them.
#[test]
fn a_forwarder_down_past_the_retention_tells_the_collector_which_records_it_lost() {
    let state = tempfile::tempdir().unwrap();
    let rs = Rsyslog::start();
    let dir = state.path().join("journal");
    let j = Journal::open(&dir).unwrap();
    let lock = |i: i32| j.append(Event::Locked { pid: p(i), ms: 1 }).unwrap().seq;
    (1..=3).for_each(|i| {
        lock(i);
    });
    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    support::eventually(LONG, "delivery of three", || {
        (fwd.status().delivered_seq == 3).then_some(())
    });
    fwd.stop();
    (4..=6).for_each(|i| {
        lock(i);
    });
    j.rotate().unwrap().unwrap(); // 7; journal.1.log holds 1..=6
    (8..=9).for_each(|i| {
        lock(i);
    });
    j.rotate().unwrap().unwrap(); // 10; journal.7.log holds 7..=9
    lock(11);
    j.rotate().unwrap().unwrap(); // 12; journal.10.log holds 10..=11
    let end = lock(13);
    let keep_one = cryo_journal::Retention {
        count: 1,
        bytes: u64::MAX,
    };
    assert_eq!(j.prune(keep_one).unwrap().len(), 2, "1..=9 pruned");

    let fwd = Forwarder::start(cfg(state.path(), &rs.addr())).unwrap();
    let metrics = cryo_telemetry::Metrics::new().unwrap();
    metrics.watch_forwarder(fwd.shared()).unwrap();
    let got = rs.wait_for(LONG, "the last record", |g| g.iter().any(|r| r.seq == end));
    let lost: Vec<&Received> = got.iter().filter(|r| r.msgid == "records_lost").collect();
    assert_eq!(
        lost.len(),
        1,
        "the collector is told once: {:?}",
        got.iter()
            .map(|r| (r.seq, r.msgid.as_str()))
            .collect::<Vec<_>>()
    );
    assert!(
        lost[0]
            .structured_data
            .contains(r#"first="4" last="9" lost="6""#),
        "{}",
        lost[0].structured_data
    );
    assert_eq!(lost[0].pri, "28", "daemon.warning");
    let msg: serde_json::Value = serde_json::from_str(&lost[0].msg).unwrap();
    assert_eq!(
        (msg["first"].as_u64(), msg["last"].as_u64()),
        (Some(4), Some(9))
    );
    // Before the records after the gap, which all arrive.
    let at = got.iter().position(|r| r.msgid == "records_lost").unwrap();
    let after: Vec<u64> = got[at + 1..].iter().map(|r| r.seq).collect();
    assert_eq!(after, (10..=end).collect::<Vec<_>>());
    assert_eq!(fwd.status().lost_total, 6);
    assert!(
        metrics
            .encode()
            .lines()
            .any(|l| l == "cryo_syslog_lost_records_total 6"),
        "{}",
        metrics.encode()
    );
    drop(fwd);
}

#[test]
fn a_collector_that_is_not_there_is_retried_without_blocking_appends() {
    let state = tempfile::tempdir().unwrap();
    let j = Journal::open(state.path().join("journal")).unwrap();
    let fwd = Forwarder::start(cfg(state.path(), &support::tools::refused_addr())).unwrap();
    for i in 1..=50 {
        j.append(Event::Killed { pid: p(i) }).unwrap();
    }
    let st = support::eventually(LONG, "a connection error", || {
        let s = fwd.status();
        s.last_error.is_some().then_some(s)
    });
    assert!(!st.connected);
    assert_eq!(st.delivered_seq, 0);
    assert!(st.last_error.unwrap().contains("refused"));
}

/// A collector that accepts every connection and closes it at once (or resets it) is not
/// hammered: each fruitless connection waits longer than the one before.
#[test]
fn a_collector_that_drops_every_connection_is_retried_with_backoff() {
    let state = tempfile::tempdir().unwrap();
    let j = Journal::open(state.path().join("journal")).unwrap();
    j.append(Event::Killed { pid: p(1) }).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut c = cfg(state.path(), &addr);
    c.retry_min = Duration::from_millis(100);
    c.retry_max = Duration::from_secs(10);
    let _fwd = Forwarder::start(c).unwrap();
    let mut at = Vec::new();
    for _ in 0..5 {
        let (conn, _) = listener.accept().unwrap();
        at.push(std::time::Instant::now());
        drop(conn);
    }
    for (k, w) in at.windows(2).enumerate().skip(1) {
        let gap = w[1] - w[0];
        // 100 ms doubling from the second drop on; only lower bounds (a slow host only waits
        // longer).
        let least = Duration::from_millis(100 << (k - 1)) * 9 / 10;
        assert!(
            gap >= least,
            "reconnect {k} after {gap:?}, expected at least {least:?}: {at:?}"
        );
    }
}

/// A collector that sends without end (nothing a syslog receiver should do) still gets every
/// record: what it sends is read and dropped a bounded amount at a time.
#[test]
fn a_chatty_collector_does_not_stall_forwarding() {
    use std::io::{Read as _, Write as _};
    let state = tempfile::tempdir().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let j = Journal::open(state.path().join("journal")).unwrap();
    j.append(Event::Killed { pid: p(1) }).unwrap();
    let _fwd = Forwarder::start(cfg(state.path(), &addr)).unwrap();
    let (mut conn, _) = listener.accept().unwrap();
    conn.set_read_timeout(Some(LONG)).unwrap();
    let mut writer = conn.try_clone().unwrap();
    let chatter = std::thread::spawn(move || {
        let noise = [b'x'; 65536];
        while writer.write_all(&noise).is_ok() {}
    });
    let mut got = Vec::new();
    let mut buf = [0u8; 65536];
    let mut read_until = |what: &str, got: &mut Vec<u8>| {
        while !String::from_utf8_lossy(got).contains(what) {
            let n = conn
                .read(&mut buf)
                .unwrap_or_else(|e| panic!("waiting for {what}: {e}"));
            assert!(n > 0, "the forwarder closed the connection");
            got.extend_from_slice(&buf[..n]);
        }
    };
    read_until("seq=\"1\"", &mut got);
    // Appended while the collector talks: the forwarder must still get to them.
    for i in 2..=100 {
        j.append(Event::Killed { pid: p(i) }).unwrap();
    }
    read_until("seq=\"100\"", &mut got);
    conn.shutdown(std::net::Shutdown::Both).unwrap();
    chatter.join().unwrap();
}
