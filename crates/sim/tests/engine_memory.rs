#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The simulated engine's memory (issue 14): vLLM's sleep mode and SGLang's memory saver on the
//! sim worker's KV cache and weights, through the driver, so what a checkpoint copies shrinks,
//! and answers after taking everything back equal those before.

mod common;

use common::WorkerSpec;

const MIB: u64 = 1 << 20;

fn sleeping(w: &common::Worker) -> bool {
    let (status, body) = w.http("GET", "/is_sleeping", "");
    assert_eq!(status, 200, "{body}");
    serde_json::from_str::<serde_json::Value>(&body).unwrap()["is_sleeping"]
        .as_bool()
        .unwrap()
}

fn ok(w: &common::Worker, method: &str, path: &str, body: &str) {
    let (status, answer) = w.http(method, path, body);
    assert_eq!(status, 200, "{method} {path}: {answer}");
}

#[test]
fn vllm_level_1_keeps_the_weights_in_host_memory_and_a_checkpoint_copies_almost_nothing() {
    let sim = common::sim();
    let w = sim.spawn(WorkerSpec::new("16MiB").kv_cache("48MiB").seed(3));
    assert_eq!(sim.listing(w.pid), vec![(0, 64 * MIB)]);
    assert_eq!(w.verify()["ok"], true, "the KV cache is checked too");
    let before = w.complete("shrink me");
    assert!(!sleeping(&w));

    ok(&w, "POST", "/sleep?level=1", "");
    assert!(sleeping(&w));
    assert_eq!(
        sim.listing(w.pid),
        vec![(0, 0)],
        "weights and KV cache left the GPU"
    );
    let (status, _) = w.http("POST", "/v1/completions", "shrink me");
    assert_eq!(status, 503, "a sleeping engine serves nothing");

    // The checkpoint copies what is left on the device: nothing; the weights are in the heap.
    let rss = w.rss();
    sim.cycle(w.pid);
    assert!(
        w.rss() < rss + 8 * MIB,
        "a checkpoint of a sleeping engine copies almost nothing: {} -> {}",
        rss,
        w.rss()
    );
    ok(&w, "POST", "/wake_up", "");
    assert!(!sleeping(&w));
    assert_eq!(sim.listing(w.pid), vec![(0, 64 * MIB)]);
    assert_eq!(w.complete("shrink me"), before);
    assert_eq!(w.verify()["ok"], true);
    sim.assert_no_wedge();
}

#[test]
fn vllm_level_2_answers_differently_until_the_weights_are_reloaded() {
    let sim = common::sim();
    let w = sim.spawn(WorkerSpec::new("8MiB").kv_cache("8MiB").seed(4));
    let before = w.complete("level two");
    ok(&w, "POST", "/sleep?level=2", "");
    assert_eq!(sim.listing(w.pid), vec![(0, 0)]);
    sim.cycle(w.pid);
    ok(&w, "POST", "/wake_up?tags=weights", "");
    assert!(sleeping(&w), "the KV cache is still released");
    let (status, _) = w.http("POST", "/wake_up?tags=kv_cache", "");
    assert_eq!(status, 200);
    assert_ne!(
        w.complete("level two"),
        before,
        "discarded weights come back as zeros"
    );
    ok(
        &w,
        "POST",
        "/collective_rpc",
        r#"{"method":"reload_weights"}"#,
    );
    assert_eq!(w.complete("level two"), before);
    assert_eq!(w.verify()["ok"], true);
}

#[test]
fn sglang_releases_the_kv_cache_alone_or_with_the_weights() {
    let sim = common::sim();
    let w = sim.spawn(WorkerSpec::new("8MiB").kv_cache("24MiB").seed(5));
    let before = w.complete("sglang");
    ok(
        &w,
        "POST",
        "/release_memory_occupation",
        r#"{"tags":["kv_cache"]}"#,
    );
    assert_eq!(sim.listing(w.pid), vec![(0, 8 * MIB)], "the weights stay");
    sim.cycle(w.pid);
    assert_eq!(sim.listing(w.pid), vec![(0, 8 * MIB)], "restored as shrunk");
    ok(
        &w,
        "POST",
        "/resume_memory_occupation",
        r#"{"tags":["kv_cache"]}"#,
    );
    assert_eq!(sim.listing(w.pid), vec![(0, 32 * MIB)]);
    assert_eq!(w.complete("sglang"), before);

    // No body: every tag.
    ok(&w, "POST", "/release_memory_occupation", "");
    assert_eq!(sim.listing(w.pid), vec![(0, 0)]);
    ok(&w, "POST", "/resume_memory_occupation", "");
    assert_eq!(w.complete("sglang"), before);
    assert_eq!(w.verify()["ok"], true);
    let (status, _) = w.http(
        "POST",
        "/release_memory_occupation",
        r#"{"tags":["attention"]}"#,
    );
    assert_eq!(status, 400);
}

#[test]
fn every_rank_of_a_tree_sleeps_and_wakes() {
    let sim = common::sim();
    let w = sim.spawn(
        WorkerSpec::new("8MiB")
            .kv_cache("8MiB")
            .gpus(&[0, 1])
            .process_per_gpu(),
    );
    let before = w.complete("tree");
    ok(&w, "POST", "/sleep?level=1", "");
    assert!(sleeping(&w));
    for (i, rank) in w.children().iter().enumerate() {
        assert_eq!(sim.listing(*rank), vec![(i as u32, 0)]);
    }
    ok(&w, "POST", "/wake_up", "");
    for (i, rank) in w.children().iter().enumerate() {
        assert_eq!(sim.listing(*rank), vec![(i as u32, 16 * MIB)]);
    }
    assert_eq!(w.complete("tree"), before);
}

/// vLLM has crashed when put to sleep with requests in flight: so does the simulator.
#[test]
fn sleeping_with_requests_in_flight_kills_the_engine() {
    let sim = common::sim();
    let mut w = sim.spawn(WorkerSpec::new("8MiB").kv_cache("8MiB"));
    ok(&w, "POST", "/busy?ms=60000", "");
    let (status, body) = w.http("GET", "/metrics", "");
    assert_eq!(status, 200);
    assert!(
        body.contains("vllm:num_requests_running{model_name=\"sim\"} 1"),
        "{body}"
    );
    // The answer never comes (the connection is reset): sent by hand.
    let mut s = std::net::TcpStream::connect(("127.0.0.1", w.port)).unwrap();
    std::io::Write::write_all(
        &mut s,
        b"POST /sleep?level=1 HTTP/1.1\r\nHost: sim\r\nContent-Length: 0\r\n\r\n",
    )
    .unwrap();
    assert!(!w.wait_exit().success());
}

/// Taking the KV cache back on a GPU that filled up meanwhile fails with the driver's
/// out-of-memory; the engine stays asleep and a later wake-up succeeds.
#[test]
fn waking_on_a_full_gpu_fails_and_can_be_retried() {
    let sim = common::sim_with(&["--gpus", "1", "--gpu-memory", "64MiB"]);
    let w = sim.spawn(WorkerSpec::new("8MiB").kv_cache("40MiB"));
    let before = w.complete("full");
    ok(&w, "POST", "/sleep?level=1", "");
    let hog = common::worker(&sim, "40MiB", 0, 9);
    let (status, body) = w.http("POST", "/wake_up", "");
    assert_eq!(status, 500, "{body}");
    assert!(body.contains("OUT_OF_MEMORY"), "{body}");
    assert!(sleeping(&w));
    drop(hog);
    ok(&w, "POST", "/wake_up", "");
    assert_eq!(w.complete("full"), before);
}
