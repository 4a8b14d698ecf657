#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `--shrink` (issue 14) on the simulated GPU: the engine releases its KV cache and weights
//! before the suspension (less device memory copied), a shrink that cannot happen never blocks
//! the stop (the whole memory is suspended instead, and the report says so), and no sleep is
//! ever sent to an engine with requests in flight.

mod common;

use std::path::Path;
use std::process::Output;

use common::*;

const MIB: u64 = 1 << 20;

fn state() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cryo-shrink-state-")
        .tempdir()
        .unwrap()
}

/// `cryo stop PID ARGS... --json`: the output and its report.
fn stop(
    sim: &cryo_testkit::sim::Sim,
    st: &Path,
    pid: i32,
    args: &[&str],
) -> (Output, serde_json::Value) {
    let out = sim_cmd(sim, st)
        .arg("stop")
        .arg(pid.to_string())
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "--json does not parse ({e}): {}\n{}",
            stdout(&out),
            stderr(&out)
        )
    });
    (out, v)
}

fn sim_cmd(sim: &cryo_testkit::sim::Sim, st: &Path) -> std::process::Command {
    let mut c = cryo();
    c.args(["--gpu", "sim", "--sim-dir"])
        .arg(sim.path())
        .arg("--state-dir")
        .arg(st);
    c
}

/// Device memory the stop checkpointed for `pid`.
fn suspended_bytes(v: &serde_json::Value, pid: i32) -> Option<u64> {
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .and_then(|p| p["suspended"]["device_memory"].as_u64())
}

fn journal_types(st: &Path) -> Vec<String> {
    let r = cryo_journal::read(st.join("journal")).unwrap();
    r.records
        .iter()
        .map(|r| {
            serde_json::to_value(&r.event).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect()
}

fn sim() -> cryo_testkit::sim::Sim {
    cryo_testkit::sim::Sim::start_with(&program(), &["--gpus", "1", "--gpu-memory", "1GiB"])
}

#[test]
fn a_stop_after_a_vllm_sleep_checkpoints_almost_nothing() {
    let sim = sim();
    let st = state();
    let shrunk = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let whole = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let url = format!("http://127.0.0.1:{}", shrunk.port);

    let (out, v) = stop(
        &sim,
        st.path(),
        shrunk.pid,
        &["--shrink", "vllm", "--engine-url", &url],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert_eq!(v["shrink"]["spec"], "vllm:1");
    assert_eq!(suspended_bytes(&v, shrunk.pid), Some(0), "{v}");

    let (out, v) = stop(&sim, st.path(), whole.pid, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(v.get("shrink").is_none(), "{v}");
    assert_eq!(suspended_bytes(&v, whole.pid), Some(64 * MIB));

    let types = journal_types(st.path());
    let at = |t: &str| {
        types
            .iter()
            .position(|x| x == t)
            .unwrap_or_else(|| panic!("no {t}: {types:?}"))
    };
    assert!(at("shrink_started") < at("shrink_completed"));
    assert!(
        at("shrink_completed") < at("lock_started"),
        "released before the lock: {types:?}"
    );
    assert!(sim.settled_ledger().is_empty(), "{:?}", sim.ledger());
}

/// SGLang's KV cache only: the weights are what the checkpoint copies.
#[test]
fn a_stop_after_an_sglang_release_copies_the_weights_only() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let url = format!("http://127.0.0.1:{}", w.port);
    let (out, v) = stop(
        &sim,
        st.path(),
        w.pid,
        &["--shrink", "sglang", "--engine-url", &url],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert_eq!(suspended_bytes(&v, w.pid), Some(16 * MIB), "{v}");
}

/// A vLLM with requests in flight is never put to sleep (the simulator, like vLLM, would crash):
/// the shrink gives up at its deadline and the stop suspends the whole memory.
#[test]
fn a_busy_engine_is_stopped_whole_and_never_put_to_sleep() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let (status, _) = w.http("POST", "/busy?ms=1500", "");
    assert_eq!(status, 200);
    let url = format!("http://127.0.0.1:{}", w.port);
    let (out, v) = stop(
        &sim,
        st.path(),
        w.pid,
        &[
            "--shrink",
            "vllm",
            "--engine-url",
            &url,
            "--shrink-timeout",
            "300",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(v["shrink"]["released"]["outcome"], "whole", "{v}");
    let error = v["shrink"]["released"]["error"].as_str().unwrap();
    assert!(error.contains("in flight"), "{error}");
    assert_eq!(
        suspended_bytes(&v, w.pid),
        Some(64 * MIB),
        "suspended whole, alive until the kill: {v}"
    );
    assert!(sim.settled_ledger().is_empty(), "{:?}", sim.ledger());
}

/// Nothing listens at the engine's address: the stop goes on, whole.
#[test]
fn an_unreachable_engine_never_blocks_the_stop() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("16MiB"));
    let (out, v) = stop(
        &sim,
        st.path(),
        w.pid,
        &["--shrink", "sglang", "--engine-url", "http://127.0.0.1:1"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(v["shrink"]["released"]["outcome"], "whole", "{v}");
    assert_eq!(suspended_bytes(&v, w.pid), Some(32 * MIB));
}
