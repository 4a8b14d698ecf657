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

/// `cryo stop PID ARGS... --json`, which must succeed: its report.
fn stop(sim: &cryo_testkit::sim::Sim, st: &Path, pid: i32, args: &[&str]) -> serde_json::Value {
    let mut all = vec!["stop".to_owned(), pid.to_string()];
    all.extend(args.iter().map(|a| (*a).to_owned()));
    all.push("--json".into());
    ok_json(sim, st, &all.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `cryo stop` of `w` with `--shrink SPEC --engine-url` its address, and `extra`: its report.
fn stop_shrunk(
    sim: &cryo_testkit::sim::Sim,
    st: &Path,
    w: &Worker,
    spec: &str,
    extra: &[&str],
) -> serde_json::Value {
    let url = url_of(w);
    let mut args = vec!["--shrink", spec, "--engine-url", &url];
    args.extend(extra);
    stop(sim, st, w.pid, &args)
}

/// `cryo park PID --shrink vllm --engine-url URL --json`.
fn park_args<'a>(pid: &'a str, url: &'a str) -> [&'a str; 7] {
    [
        "park",
        pid,
        "--shrink",
        "vllm",
        "--engine-url",
        url,
        "--json",
    ]
}

/// `cryo ARGS...` against `sim` with the state directory `st`, which must succeed: its stdout as
/// JSON (`null` when it printed none).
fn ok_json(sim: &cryo_testkit::sim::Sim, st: &Path, args: &[&str]) -> serde_json::Value {
    let out = sim_cmd(sim, st).args(args).output().unwrap();
    assert!(
        out.status.success(),
        "cryo {args:?}: {}\n{}",
        stdout(&out),
        stderr(&out)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_default()
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

/// The engine's address for `--engine-url`.
fn url_of(w: &Worker) -> String {
    match &w.endpoint {
        Endpoint::Unix(p) => format!("unix:{}:/", p.display()),
        Endpoint::Tcp(hostport) => format!("http://{hostport}"),
    }
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

    let v = stop_shrunk(&sim, st.path(), &shrunk, "vllm", &[]);
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert_eq!(v["shrink"]["spec"], "vllm:1");
    assert_eq!(suspended_bytes(&v, shrunk.pid), Some(0), "{v}");

    let v = stop(&sim, st.path(), whole.pid, &[]);
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
    sim.assert_no_wedge();
}

/// SGLang's KV cache only: the weights are what the checkpoint copies.
#[test]
fn a_stop_after_an_sglang_release_copies_the_weights_only() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let v = stop_shrunk(&sim, st.path(), &w, "sglang", &[]);
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
    let v = stop_shrunk(&sim, st.path(), &w, "vllm", &["--shrink-timeout", "300"]);
    assert_eq!(v["shrink"]["released"]["outcome"], "whole", "{v}");
    let error = v["shrink"]["released"]["error"].as_str().unwrap();
    assert!(error.contains("in flight"), "{error}");
    assert_eq!(
        suspended_bytes(&v, w.pid),
        Some(64 * MIB),
        "suspended whole, alive until the kill: {v}"
    );
    sim.assert_no_wedge();
}

/// Nothing listens at the engine's address: the stop goes on, whole.
#[test]
fn an_unreachable_engine_never_blocks_the_stop() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("16MiB"));
    let v = stop(
        &sim,
        st.path(),
        w.pid,
        &["--shrink", "sglang", "--engine-url", "http://127.0.0.1:1"],
    );
    assert_eq!(v["shrink"]["released"]["outcome"], "whole", "{v}");
    assert_eq!(suspended_bytes(&v, w.pid), Some(32 * MIB));
}

use cryo_testkit::require_criu_and_root as criu_and_root;

/// `cryo freeze PID --image DIR ARGS... --json`.
fn freeze(
    sim: &cryo_testkit::sim::Sim,
    st: &Path,
    pid: i32,
    image: &Path,
    args: &[&str],
) -> Output {
    sim_cmd(sim, st)
        .arg("freeze")
        .arg(pid.to_string())
        .arg("--image")
        .arg(image)
        .args(args)
        .arg("--json")
        .output()
        .unwrap()
}

/// A worker whose ranks set up NCCL (shared memory, IPC socket) can never be restored on this
/// driver: the freeze refuses it before anything is asked of it, and it keeps serving.
#[test]
fn a_freeze_of_nccl_ranks_is_refused_and_they_keep_serving() {
    criu_and_root();
    let sim =
        cryo_testkit::sim::Sim::start_with(&program(), &["--gpus", "2", "--gpu-memory", "1GiB"]);
    let st = state();
    let w = sim.spawn(
        WorkerSpec::new("8MiB")
            .kv_cache("8MiB")
            .gpus(&[0, 1])
            .process_per_gpu()
            .nccl()
            .setsid()
            .http_unix(),
    );
    let before = w.complete("nccl");
    let image = st.path().join("img");
    let url = url_of(&w);
    let out = freeze(
        &sim,
        st.path(),
        w.pid,
        &image,
        &["--shrink", "vllm", "--engine-url", &url],
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}\n{}",
        stdout(&out),
        stderr(&out)
    );
    let e = stderr(&out);
    assert!(e.contains("NCCL") && e.contains("r610"), "{e}");
    assert!(
        w.children().iter().any(|r| e.contains(&format!("pid {r}"))),
        "names a rank: {e}"
    );
    assert!(!image.exists());
    assert_eq!(
        w.complete("nccl"),
        before,
        "untouched: never put to sleep, never locked"
    );
    let types = journal_types(st.path());
    assert!(
        !types
            .iter()
            .any(|t| t == "shrink_started" || t == "lock_started"),
        "{types:?}"
    );
}

/// Freeze left running, after a vLLM sleep: the image holds the weights (in the worker's heap)
/// but no KV cache, and the worker answers as before once it is woken again.
#[test]
fn a_freeze_left_running_shrinks_the_image_and_wakes_the_engine_after() {
    criu_and_root();
    let sim = sim();
    let st = state();
    let spec = || {
        WorkerSpec::new("8MiB")
            .kv_cache("56MiB")
            .setsid()
            .http_unix()
    };
    let shrunk = sim.spawn(spec());
    let whole = sim.spawn(spec());
    let before = shrunk.complete("freeze");
    let out = freeze(
        &sim,
        st.path(),
        shrunk.pid,
        &st.path().join("shrunk"),
        &[
            "--leave-running",
            "--shrink",
            "vllm:1",
            "--engine-url",
            &url_of(&shrunk),
        ],
    );
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert!(v["shrink"]["grow_ms"].is_u64(), "grown after: {v}");
    let out = freeze(
        &sim,
        st.path(),
        whole.pid,
        &st.path().join("whole"),
        &["--leave-running"],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let w: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();

    let bytes = |v: &serde_json::Value| v["manifest"]["total_bytes"].as_u64().unwrap();
    assert!(
        bytes(&v) + 48 * MIB < bytes(&w),
        "the KV cache is not in the image: {} vs {}",
        bytes(&v),
        bytes(&w)
    );
    assert_eq!(shrunk.complete("freeze"), before);
    assert_eq!(shrunk.verify()["ok"], true);
    let types = journal_types(st.path());
    assert!(types.iter().any(|t| t == "grown"), "{types:?}");
    let _ = std::fs::remove_dir_all(st.path().join("shrunk"));
    let _ = std::fs::remove_dir_all(st.path().join("whole"));
    sim.assert_no_wedge();
}

/// Parked after a level-1 sleep: almost nothing goes through the driver; the wake restores it
/// and wakes the engine, and it answers as before.
#[test]
fn a_park_after_a_sleep_moves_almost_nothing_and_the_wake_grows_it() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB"));
    let before = w.complete("park");
    let url = url_of(&w);
    let pid = w.pid.to_string();
    let v = ok_json(&sim, st.path(), &park_args(&pid, &url));
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert_eq!(v["parked"][0]["device_bytes"], 0, "{v}");

    let v = ok_json(&sim, st.path(), &["wake", &pid, "--json"]);
    assert!(v["shrink"]["grow_ms"].is_u64(), "the wake grows it: {v}");
    assert_eq!(w.complete("park"), before);
    assert_eq!(w.verify()["ok"], true);
    let types = journal_types(st.path());
    let at = |t: &str| types.iter().rposition(|x| x == t).unwrap();
    assert!(
        at("grown") > at("unlocked"),
        "grown once unlocked: {types:?}"
    );

    // A second wake has nothing left to grow.
    ok_json(&sim, st.path(), &["park", &pid, "--json"]);
    let v = ok_json(&sim, st.path(), &["wake", &pid, "--json"]);
    assert!(v.get("shrink").is_none(), "{v}");
    assert_eq!(w.complete("park"), before);
}

/// `cryo bench shrink` with tiny workers: every arm, a ratio measured in the same run, and the
/// bytes the shrink saves.
#[test]
fn bench_shrink_runs_with_tiny_workers() {
    criu_and_root();
    let out = cryo()
        .args([
            "bench",
            "shrink",
            "--weights",
            "4MiB",
            "--kv-cache",
            "12MiB",
            "--rounds",
            "1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let text = stdout(&out);
    let start = text.find('[').unwrap();
    let end = text.rfind(']').unwrap();
    let rows: serde_json::Value = serde_json::from_str(&text[start..=end]).unwrap();
    let arms: Vec<&str> = rows
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["arm"].as_str().unwrap())
        .collect();
    assert_eq!(arms, ["stop", "freeze", "park+wake"], "{text}");
    for r in rows.as_array().unwrap() {
        assert!(r["ratio"].as_f64().unwrap() > 0.0, "{r}");
        assert!(
            r["shrunk_bytes"].as_u64().unwrap() + 8 * MIB <= r["whole_bytes"].as_u64().unwrap(),
            "{r}"
        );
    }
}

/// Frozen after a vLLM sleep, the image records the shrink, and `cryo thaw` without --shrink
/// wakes the engine once the tree runs: it answers as before. Thawed again with `--shrink none`,
/// the engine is left asleep (the operator's choice). Each restored worker is stopped through
/// cryo (suspended first).
#[test]
fn a_thaw_of_a_shrunk_image_wakes_the_engine_as_the_image_records() {
    criu_and_root();
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let sim = sim();
    let st = state();
    // CRIU restores a process only from an unchanged executable: a private copy.
    let bin = program().copied_to(&sim.path().join("cryo-worker"));
    let mut w = sim.spawn(
        WorkerSpec::new("8MiB")
            .kv_cache("24MiB")
            .setsid()
            .http_unix()
            .program(bin),
    );
    let before = w.complete("thaw");
    let url = url_of(&w);
    let image = st.path().join("img");
    let out = freeze(
        &sim,
        st.path(),
        w.pid,
        &image,
        &["--shrink", "vllm", "--engine-url", &url],
    );
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    w.reap();
    let manifest = cryo_criu::image::read_manifest(&image.join("manifest.json")).unwrap();
    let recorded = manifest
        .shrunk
        .expect("the image does not record its shrink");
    assert_eq!(
        (
            recorded.spec.as_str(),
            recorded.engine.as_deref(),
            recorded.outcome.as_str()
        ),
        ("vllm:1", Some(url.as_str()), "shrunk")
    );

    let img = image.to_str().unwrap();
    let thaw = |args: &[&str]| ok_json(&sim, st.path(), &[&["thaw", img, "--json"], args].concat());
    let stop = |pid: i32| {
        ok_json(&sim, st.path(), &["stop", &pid.to_string()]);
        procs::reap(pid);
    };
    let v = thaw(&[]);
    assert!(v["shrink"]["grow_ms"].is_u64(), "{v}");
    assert_eq!(v["shrink"]["spec"], "vllm:1", "{v}");
    let (status, answer) = http(w.endpoint.clone(), "POST", "/v1/completions", "thaw");
    assert_eq!(status, 200, "{answer}");
    assert!(answer.contains(&before), "{answer} vs {before}");
    stop(v["root_pid"].as_i64().unwrap() as i32);

    // --shrink none: the operator grows it some other way; nothing is asked of the engine.
    let v = thaw(&["--shrink", "none"]);
    assert!(v.get("shrink").is_none(), "{v}");
    let (status, sleeping) = http(w.endpoint.clone(), "GET", "/is_sleeping", "");
    assert_eq!(
        (status, sleeping.contains("true")),
        (200, true),
        "{sleeping}"
    );
    let (status, answer) = http(w.endpoint.clone(), "POST", "/v1/completions", "thaw");
    assert_ne!(status, 200, "an engine left asleep answered: {answer}");
    stop(v["root_pid"].as_i64().unwrap() as i32);
    let _ = std::fs::remove_dir_all(&image);
    sim.assert_no_wedge();
}

/// Attack: the worker serves in a network namespace of its own (a container, a standby) on
/// `127.0.0.1:PORT`, and another engine listens on the same port of the host's loopback. The
/// shrink must reach the worker's engine in its namespace, never the host's: the decoy stays
/// awake, the worker parks shrunk, the wake grows it there and it answers as before.
#[test]
fn the_engine_is_reached_in_the_workers_network_namespace() {
    let sim = sim();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB").own_namespaces());
    let decoy = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB").port(w.port));
    let before = w.complete("netns");
    let url = format!("http://127.0.0.1:{}", w.port);
    let pid = w.pid.to_string();
    let v = ok_json(&sim, st.path(), &park_args(&pid, &url));
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    assert_eq!(v["parked"][0]["device_bytes"], 0, "{v}");
    let (_, sleeping) = decoy.http("GET", "/is_sleeping", "");
    assert!(
        sleeping.contains("false"),
        "the host's engine was put to sleep: {sleeping}"
    );

    let v = ok_json(&sim, st.path(), &["wake", &pid, "--json"]);
    assert!(v["shrink"]["grow_ms"].is_u64(), "the wake grows it: {v}");
    assert_eq!(w.complete("netns"), before);
    assert_eq!(w.verify()["ok"], true);
    ok_json(&sim, st.path(), &["stop", &pid]);
    sim.assert_no_wedge();
}

/// A standby of an image frozen shrunk (a worker in its own namespaces, as standbys need): the
/// claim wakes the engine as the image records, in the standby's own network namespace, and it
/// answers as the original did.
#[test]
fn a_claimed_standby_of_a_shrunk_image_grows_its_engine_in_its_namespace() {
    criu_and_root();
    let sim = common::Sim::start();
    let bin = program().copied_to(&sim.path().join("cryo-worker"));
    let st = sim.path().join("state");
    let agent = AgentProc::start(&sim, &st, &["--no-memory-watch"]);
    let mut w = sim.spawn(
        WorkerSpec::new("8MiB")
            .kv_cache("24MiB")
            .own_namespaces()
            .program(bin),
    );
    let before = w.complete("standby");
    let port = w.port;
    let url = format!("http://127.0.0.1:{port}");
    let image = sim.path().join("img");
    let out = freeze(
        &sim,
        &st,
        w.pid,
        &image,
        &["--shrink", "vllm", "--engine-url", &url],
    );
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["shrink"]["released"]["outcome"], "shrunk", "{v}");
    w.reap();
    let run = |args: &[&str]| ok_json(&sim, &st, args);
    let img = image.to_str().unwrap();
    run(&["standby", "create", "--image", img, "--count", "1"]);
    eventually(PATIENCE, "the standby to be ready", || {
        run(&["standby", "list", "--json"])["pools"][0]["ready"]
            .as_array()
            .is_some_and(|r| r.len() == 1)
    });
    let v = run(&["standby", "claim", "--image", img, "--json"]);
    assert!(v["wake"]["shrink"]["grow_ms"].is_u64(), "{v}");
    let root = v["standby"]["root"]["pid"].as_i64().unwrap() as i32;
    let (status, body) =
        cryo_testkit::http::http_in_netns(root, port, "POST", "/v1/completions", "standby");
    assert_eq!(status, 200, "{body}");
    assert!(body.contains(&before), "{body} vs {before}");
    run(&["standby", "remove", "--image", img]);
    run(&["stop", &root.to_string()]);
    // The claim started a refill that the removal does not wait for: the agent dropped here
    // (SIGKILL) can leave a standby CRIU restored and never made ready (journaled restoring).
    // The next agent ends it (every context CHECKPOINTED); the pool is gone, so it restores none.
    drop(agent);
    let next = AgentProc::start(&sim, &st, &["--no-memory-watch"]);
    eventually(PATIENCE, "no sim worker left", || {
        sim.leftover_workers().is_empty()
    });
    drop(next);
    common::stop_pin_holder(&st);
    let _ = std::fs::remove_dir_all(&image);
    sim.assert_no_wedge();
}
