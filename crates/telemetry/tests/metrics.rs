#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Metrics derived from journal records: linted by `promtool check metrics`, values equal to
//! what the journal says, served over HTTP while following the journal.

mod support;

use std::sync::Arc;
use std::time::Duration;

use cryo_journal::{Event, Journal, ProcId};
use cryo_telemetry::{ForwardConfig, Forwarder, JournalFeed, Metrics, MetricsServer, CONTENT_TYPE};
use support::{promtool_check, sample};

const LONG: Duration = Duration::from_secs(30);

fn p(pid: i32) -> ProcId {
    ProcId::new(pid, 7)
}

/// A journal with one of everything the metrics count (and some they do not).
fn busy_journal(dir: &std::path::Path) -> Journal {
    let j = Journal::open(dir).unwrap();
    let events = vec![
        Event::StopRequested {
            target: "pid 1".into(),
        },
        Event::Locked { pid: p(1), ms: 20 },
        Event::Locked {
            pid: p(2),
            ms: 3000,
        },
        Event::Checkpointed {
            pid: p(1),
            ms: 1500,
            bytes: 1 << 30,
        },
        Event::Verified {
            pid: p(1),
            ms: Some(40),
        },
        Event::Verified {
            pid: p(2),
            ms: None,
        },
        Event::StopCompleted {
            target: "pid 1".into(),
            killed: vec![p(1)],
            ms: 1700,
            refused: vec![],
        },
        Event::Refused {
            pid: p(3),
            reason: "lock timed out".into(),
            hint: "retry".into(),
        },
        Event::StopCompleted {
            target: "pid 3".into(),
            killed: vec![],
            ms: 900,
            refused: vec![p(3)],
        },
        Event::Dumped {
            image: "/img".into(),
            ms: 4200,
            bytes: 1 << 31,
        },
        Event::ImagePublished {
            image: "/img".into(),
            bytes: 1 << 31,
        },
        Event::CriuRestored {
            image: "/img".into(),
            ms: 800,
        },
        Event::RestoreCompleted {
            pid: p(4),
            image: "/img".into(),
            ms: Some(600),
        },
        Event::RestoreCompleted {
            pid: p(5),
            image: "/img".into(),
            ms: None,
        },
        Event::Unlocked {
            pid: p(4),
            ms: Some(2),
            recovery: false,
        },
        Event::ThawCompleted {
            image: "/img".into(),
            pids: vec![p(4)],
            ms: 2500,
        },
        Event::FatalSignal {
            pid: p(4),
            signal: 11,
        },
        Event::Pinned {
            pid: p(4),
            gpu: "GPU-0".into(),
            fds: vec![5],
        },
        Event::GpuQuarantined {
            gpu: "GPU-0".into(),
            reason: "pinned".into(),
        },
    ];
    for e in events {
        j.append(e).unwrap();
    }
    j
}

#[test]
fn journal_records_become_metrics_that_promtool_accepts() {
    let dir = tempfile::tempdir().unwrap();
    drop(busy_journal(dir.path()));
    let m = Metrics::new().unwrap();
    for r in cryo_journal::read(dir.path()).unwrap().records {
        m.observe(&r);
    }
    let text = m.encode();
    promtool_check(&text);
    let v = |s: &str| sample(&text, s).unwrap_or_else(|| panic!("{s} missing:\n{text}"));
    assert_eq!(v("cryo_lock_duration_seconds_count"), 2.0);
    assert!((v("cryo_lock_duration_seconds_sum") - 3.02).abs() < 1e-9);
    assert_eq!(v("cryo_lock_duration_seconds_bucket{le=\"0.025\"}"), 1.0);
    assert_eq!(v("cryo_lock_duration_seconds_bucket{le=\"5\"}"), 2.0);
    assert_eq!(v("cryo_checkpoint_duration_seconds_count"), 1.0);
    assert_eq!(v("cryo_checkpointed_bytes_total"), (1u64 << 30) as f64);
    // A Verified without a duration (an older record) counts nowhere.
    assert_eq!(v("cryo_verify_duration_seconds_count"), 1.0);
    assert_eq!(v("cryo_restore_duration_seconds_count"), 1.0);
    assert_eq!(v("cryo_unlock_duration_seconds_count"), 1.0);
    assert_eq!(v("cryo_dump_duration_seconds_sum"), 4.2);
    assert_eq!(v("cryo_criu_restore_duration_seconds_sum"), 0.8);
    assert_eq!(v("cryo_stops_total{outcome=\"completed\"}"), 1.0);
    assert_eq!(v("cryo_stops_total{outcome=\"refused\"}"), 1.0);
    assert_eq!(v("cryo_stops_total{outcome=\"unsafe\"}"), 0.0);
    assert_eq!(v("cryo_refusals_total"), 1.0);
    assert_eq!(v("cryo_freezes_total{outcome=\"published\"}"), 1.0);
    assert_eq!(v("cryo_thaws_total{outcome=\"completed\"}"), 1.0);
    assert_eq!(v("cryo_signals_held_total"), 1.0);
    assert_eq!(v("cryo_pins_total"), 1.0);
    assert_eq!(v("cryo_gpu_quarantines_total"), 1.0);
    assert_eq!(v("cryo_journal_appends_total{type=\"locked\"}"), 2.0);
    assert_eq!(
        v("cryo_journal_appends_total{type=\"restore_completed\"}"),
        2.0
    );
    assert_eq!(v("cryo_journal_last_seq"), 19.0);
    // Live state is not the journal's: no owner, no gauge (never a false zero).
    assert!(!text.contains("cryo_pins_held"), "{text}");
}

#[test]
fn live_gauges_are_set_by_their_owner() {
    let m = Metrics::with_live_gauges().unwrap();
    let live = m.live().unwrap();
    live.pins_held.set(3);
    live.guarded_processes.set(7);
    live.gpus_quarantined.set(1);
    let text = m.encode();
    promtool_check(&text);
    assert_eq!(sample(&text, "cryo_pins_held"), Some(3.0));
    assert_eq!(sample(&text, "cryo_guarded_processes"), Some(7.0));
    assert_eq!(sample(&text, "cryo_gpus_quarantined"), Some(1.0));
}

fn get(addr: std::net::SocketAddr, path: &str) -> (String, String) {
    support::tools::http_get(&addr.to_string(), path)
}

#[test]
fn served_over_http_while_following_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let j = busy_journal(dir.path());
    let metrics = Arc::new(Metrics::with_live_gauges().unwrap());
    let _feed = JournalFeed::start(dir.path(), Arc::clone(&metrics)).unwrap();
    let server = MetricsServer::start("127.0.0.1:0", Arc::clone(&metrics)).unwrap();
    assert!(server.local_addr().ip().is_loopback());

    // The whole journal is in the first scrape.
    let (head, body) = get(server.local_addr(), "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    assert!(
        head.contains(&format!("Content-Type: {CONTENT_TYPE}")),
        "{head}"
    );
    promtool_check(&body);
    assert_eq!(sample(&body, "cryo_journal_last_seq"), Some(19.0));

    // A record appended now shows up in a later scrape.
    j.append(Event::Pinned {
        pid: p(9),
        gpu: "GPU-1".into(),
        fds: vec![4],
    })
    .unwrap();
    support::eventually(LONG, "the new pin in /metrics", || {
        let (_, body) = get(server.local_addr(), "/metrics");
        (sample(&body, "cryo_pins_total") == Some(2.0)).then_some(())
    });

    let (head, _) = get(server.local_addr(), "/other");
    assert!(head.starts_with("HTTP/1.1 404"), "{head}");
}

/// After a rotation the feed counts what the active segment holds as its own: no archive read
/// (an agent's start stays bounded), no carried copy counted again.
#[test]
fn the_feed_counts_the_records_since_the_last_rotation_once() {
    let dir = tempfile::tempdir().unwrap();
    let j = busy_journal(dir.path());
    // A live process's pin: carried by the rotation.
    let me = ProcId::of(std::process::id() as i32).unwrap();
    j.append(Event::Pinned {
        pid: me,
        gpu: "GPU-1".into(),
        fds: vec![4],
    })
    .unwrap();
    let rotation = j.rotate().unwrap().unwrap();
    assert!(rotation.carried >= 1);
    // The archive is unreadable to the feed (it is not read).
    std::fs::write(&rotation.archive, b"garbage").unwrap();
    j.append(Event::Pinned {
        pid: p(9),
        gpu: "GPU-1".into(),
        fds: vec![4],
    })
    .unwrap();
    let metrics = Arc::new(Metrics::new().unwrap());
    let _feed = JournalFeed::start(dir.path(), Arc::clone(&metrics)).unwrap();
    let text = metrics.encode();
    assert_eq!(sample(&text, "cryo_pins_total"), Some(1.0), "{text}");
    assert_eq!(
        sample(&text, "cryo_journal_last_seq"),
        Some((rotation.last_seq + 2) as f64)
    );
}

#[test]
fn forwarder_state_is_exposed() {
    let dir = tempfile::tempdir().unwrap();
    let fwd = Forwarder::start(ForwardConfig::new(
        &cryo_state::StateDir::new(dir.path()),
        support::tools::refused_addr(),
    ))
    .unwrap();
    let m = Metrics::new().unwrap();
    m.watch_forwarder(fwd.shared()).unwrap();
    support::eventually(LONG, "a failed connection", || fwd.status().last_error);
    let text = m.encode();
    promtool_check(&text);
    assert_eq!(sample(&text, "cryo_syslog_connected"), Some(0.0));
    assert_eq!(sample(&text, "cryo_syslog_delivered_seq"), Some(0.0));
    assert_eq!(sample(&text, "cryo_syslog_connections_total"), Some(0.0));
    assert_eq!(sample(&text, "cryo_syslog_lost_records_total"), Some(0.0));
}

/// The agent's wiring in one call: journal totals, live gauges, forwarder state, one listener.
#[test]
fn telemetry_starts_every_piece_together() {
    let dir = tempfile::tempdir().unwrap();
    let state = cryo_state::StateDir::new(dir.path());
    drop(busy_journal(&state.journal_dir()));
    let t = cryo_telemetry::Telemetry::start(
        &state,
        &cryo_telemetry::TelemetryConfig {
            metrics_listen: Some("127.0.0.1:0".into()),
            syslog: Some(support::tools::refused_addr()),
        },
    )
    .unwrap();
    t.live().pins_held.set(2);
    let addr = t.metrics_addr().unwrap();
    assert!(addr.ip().is_loopback());
    let (_, body) = get(addr, "/metrics");
    promtool_check(&body);
    assert_eq!(sample(&body, "cryo_journal_last_seq"), Some(19.0));
    assert_eq!(sample(&body, "cryo_pins_held"), Some(2.0));
    assert_eq!(sample(&body, "cryo_syslog_connected"), Some(0.0));
    assert!(t.forwarder().is_some());
}
