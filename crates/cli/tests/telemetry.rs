#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Telemetry after real work of the `cryo` binary on the simulated GPU (and real CRIU, as root):
//! the metrics after a stop, a freeze/thaw and a guard pin pass `promtool check metrics` and
//! equal what `cryo timeline --json` says; a private rsyslog receives every event of a stop in
//! order, each with the content `cryo timeline --json` prints.

mod common;

// The external tools' harness lives with the telemetry crate's tests.
#[path = "../../telemetry/tests/support/rsyslog.rs"]
mod rsyslog;
#[path = "../../telemetry/tests/support/tools.rs"]
mod tools;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use common::{
    cryo, eventually, make_restored, ok, program, stderr, GuardProc, Sim, WorkerSpec, PATIENCE,
};
use cryo_state::StateDir;
use rsyslog::Rsyslog;
use tools::{promtool_check, sample};

const LONG: Duration = PATIENCE;

/// `cryo timeline --json`, one parsed record per line, and the raw lines.
fn timeline(sim: &Sim, state: &Path) -> (Vec<serde_json::Value>, Vec<String>) {
    let text = ok({
        let mut c = sim.cmd_at(state);
        c.args(["timeline", "--json"]);
        c
    });
    let lines: Vec<String> = text.lines().map(str::to_owned).collect();
    let values = lines
        .iter()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    (values, lines)
}

fn types(records: &[serde_json::Value]) -> Vec<String> {
    records
        .iter()
        .map(|r| r["event"]["type"].as_str().unwrap().to_owned())
        .collect()
}

/// Freezes and thaws a worker (real CRIU), stops the thawed worker, pins a guarded worker
/// killed with SIGKILL: then `cryo metrics`, printed and served, passes promtool and every value
/// equals what the journal says.
#[test]
fn metrics_after_a_stop_a_freeze_thaw_and_a_pin_match_the_journal() {
    cryo_testkit::require_criu_and_root();
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let sim = Sim::start();
    let state = sim.path().join("state");

    // Freeze and thaw: a worker from a private copy of the binary, in its own session, serving
    // on a unix socket (see freeze_thaw.rs for why).
    let bin = program().copied_to(&sim.path().join("cryo-worker"));
    let mut worker = sim.spawn(WorkerSpec::new("32MiB").setsid().http_unix().program(bin));
    let pid = worker.pid;
    let image = sim.path().join("image");
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["freeze", "--image"])
            .arg(&image)
            .arg(pid.to_string());
        c
    });
    // CRIU ended the frozen tree; reap it so that its pid is free for the thaw.
    worker.reap();
    ok({
        let mut c = sim.cmd_at(&state);
        c.arg("thaw").arg(&image);
        c
    });
    // Stop the thawed (restored) worker: suspended, verified, killed.
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["stop", &pid.to_string()]);
        c
    });
    let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);

    // A guard pin: a restored worker killed with SIGKILL is pinned at its exit stop.
    let guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut guarded = sim.spawn(WorkerSpec::new("16MiB"));
    make_restored(&sim, &state, guarded.pid);
    eventually(PATIENCE, "the guard to attach", || {
        types(&timeline(&sim, &state).0).contains(&"guard_attached".to_owned())
    });
    guarded.sigkill();
    guarded.wait_exit();
    eventually(PATIENCE, "the pin in the journal", || {
        types(&timeline(&sim, &state).0).contains(&"gpu_quarantined".to_owned())
    });

    let (records, _) = timeline(&sim, &state);
    let text = ok({
        let mut c = sim.cmd_at(&state);
        c.arg("metrics");
        c
    });
    promtool_check(&text);
    check_against_journal(&text, &records);

    // Served: the same values over HTTP, and a later record shows up.
    let mut server = sim
        .cmd_at(&state)
        .args(["metrics", "--listen", "127.0.0.1:0"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut url = String::new();
    BufReader::new(server.stdout.take().unwrap())
        .read_line(&mut url)
        .unwrap();
    let server = KillOnDrop(server);
    let addr = url
        .trim()
        .strip_prefix("http://")
        .and_then(|u| u.strip_suffix("/metrics"))
        .unwrap_or_else(|| panic!("unexpected first line {url:?}"))
        .to_owned();
    let body = get_metrics(&addr);
    promtool_check(&body);
    check_against_journal(&body, &records);
    // The server follows the journal: a stop done now is in a later scrape.
    let before = sample(&body, "cryo_stops_total{outcome=\"completed\"}").unwrap();
    let mut fresh = sim.spawn(WorkerSpec::new("16MiB"));
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["stop", "--fresh", &fresh.pid.to_string()]);
        c
    });
    fresh.wait_exit();
    eventually(PATIENCE, "the new stop in /metrics", || {
        sample(
            &get_metrics(&addr),
            "cryo_stops_total{outcome=\"completed\"}",
        ) == Some(before + 1.0)
    });
    drop(guard);
    drop(server);
}

/// Every metric the journal determines, checked against the records.
fn check_against_journal(text: &str, records: &[serde_json::Value]) {
    let v = |s: &str| sample(text, s).unwrap_or_else(|| panic!("{s} missing:\n{text}"));
    let of = |t: &str| -> Vec<&serde_json::Value> {
        records
            .iter()
            .filter(|r| r["event"]["type"] == t)
            .map(|r| &r["event"])
            .collect()
    };
    let mut by_type: BTreeMap<String, f64> = BTreeMap::new();
    for t in types(records) {
        *by_type.entry(t).or_default() += 1.0;
    }
    for (t, n) in &by_type {
        assert_eq!(
            v(&format!("cryo_journal_appends_total{{type=\"{t}\"}}")),
            *n,
            "{t}"
        );
    }
    assert_eq!(v("cryo_journal_last_seq"), records.len() as f64);

    // Histograms: count and sum of each duration the journal holds.
    for (metric, ty) in [
        ("lock", "locked"),
        ("checkpoint", "checkpointed"),
        ("verify", "verified"),
        ("restore", "restore_completed"),
        ("unlock", "unlocked"),
        ("dump", "dumped"),
        ("criu_restore", "criu_restored"),
        ("stop", "stop_completed"),
        ("thaw", "thaw_completed"),
    ] {
        let ms: Vec<f64> = of(ty)
            .iter()
            .filter_map(|e| e["ms"].as_u64())
            .map(|m| m as f64 / 1000.0)
            .collect();
        assert!(
            !ms.is_empty(),
            "the scenario journaled no {ty} with a duration"
        );
        let name = format!("cryo_{metric}_duration_seconds");
        assert_eq!(v(&format!("{name}_count")), ms.len() as f64, "{name}");
        let sum: f64 = ms.iter().sum();
        assert!(
            (v(&format!("{name}_sum")) - sum).abs() < 1e-6,
            "{name}: sum {sum}"
        );
    }
    let stops = of("stop_completed");
    let refused = stops
        .iter()
        .filter(|e| e["refused"].as_array().is_some_and(|a| !a.is_empty()))
        .count();
    assert_eq!(
        v("cryo_stops_total{outcome=\"completed\"}"),
        (stops.len() - refused) as f64
    );
    assert_eq!(v("cryo_refusals_total"), of("refused").len() as f64);
    assert_eq!(v("cryo_freezes_total{outcome=\"published\"}"), 1.0);
    assert_eq!(v("cryo_thaws_total{outcome=\"completed\"}"), 1.0);
    assert_eq!(v("cryo_pins_total"), of("pinned").len() as f64);
    assert!(v("cryo_pins_total") >= 1.0);
    assert_eq!(
        v("cryo_gpu_quarantines_total"),
        of("gpu_quarantined").len() as f64
    );
    assert_eq!(
        v("cryo_signals_held_total"),
        of("fatal_signal").len() as f64
    );
    let bytes: u64 = of("checkpointed")
        .iter()
        .map(|e| e["bytes"].as_u64().unwrap())
        .sum();
    assert_eq!(v("cryo_checkpointed_bytes_total"), bytes as f64);
}

fn get_metrics(addr: &str) -> String {
    let (head, body) = tools::http_get(addr, "/metrics");
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A stop forwarded to a real rsyslog: every record, in journal order, each message's MSG the
/// line `cryo timeline --json` prints for it.
#[test]
fn rsyslog_receives_every_event_of_a_stop_as_the_timeline_shows_it() {
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let rs = Rsyslog::start();
    let fwd = cryo_telemetry::Forwarder::start(cryo_telemetry::ForwardConfig::new(
        &StateDir::new(&state),
        rs.addr(),
    ))
    .unwrap();
    let (pid, _) = sim.worker("16MiB");
    make_restored(&sim, &state, pid);
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["stop", &pid.to_string()]);
        c
    });
    let (records, lines) = timeline(&sim, &state);
    let t = types(&records);
    for step in [
        "stop_requested",
        "locked",
        "checkpointed",
        "verified",
        "killed",
        "stop_completed",
    ] {
        assert!(t.contains(&step.to_owned()), "{step} missing from {t:?}");
    }
    let got = rs.wait_for(LONG, "every record of the stop", |g| g.len() >= lines.len());
    assert_eq!(got.len(), lines.len(), "no record twice without an outage");
    for (i, (r, line)) in got.iter().zip(&lines).enumerate() {
        assert_eq!(&r.msg, line, "message {i}");
        assert_eq!(r.seq, records[i]["seq"].as_u64().unwrap());
        assert_eq!(r.msgid, t[i]);
        assert_eq!(r.app_name, "cryo");
    }
    drop(fwd);
}

/// `cryo bench telemetry` runs and reports every arm against its baseline; the forwarder of the
/// live arm sent every record.
#[test]
fn bench_telemetry_smoke() {
    let out = cryo()
        .args([
            "bench",
            "telemetry",
            "--appends",
            "40",
            "--batch",
            "10",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let arms: Vec<&str> = rows.iter().map(|r| r["arm"].as_str().unwrap()).collect();
    assert_eq!(arms, ["none", "refused", "stalled", "live"]);
    assert_eq!(rows[0]["p50_ratio"], 1.0);
    for r in rows {
        assert!(r["p99_ratio"].as_f64().unwrap() > 0.0, "{r}");
    }
    assert_eq!(
        rows[1]["sent"], 0,
        "nothing is sent to a collector that refuses"
    );
    // 4 batches of 10 and a warm-up batch.
    assert_eq!(rows[3]["sent"], 50, "the live collector got every record");
}
