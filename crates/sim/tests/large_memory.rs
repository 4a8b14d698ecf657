#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A worker with GiBs of device memory checkpoints and restores intact.

mod common;

use std::time::{Duration, Instant};

use cryo_gpu::ProcessState;

#[test]
fn a_two_gib_worker_checkpoints_and_restores() {
    const GIB: u64 = 1 << 30;
    let sim = common::sim();
    let t = Instant::now();
    let w = common::worker(&sim, "2GiB", 0, 11);
    let start = t.elapsed();
    let before = w.complete("large");
    assert_eq!(
        sim.gpu.inspect.process_memory(w.pid).unwrap(),
        Some(2 * GIB)
    );
    let rss = w.rss();

    let t = Instant::now();
    sim.gpu
        .driver
        .lock(w.pid, Some(Duration::from_secs(10)))
        .unwrap();
    sim.gpu.driver.checkpoint(w.pid).unwrap();
    let checkpoint = t.elapsed();
    assert_eq!(
        sim.gpu.driver.state(w.pid).unwrap(),
        ProcessState::Checkpointed
    );
    assert!(!sim.listed(w.pid));
    assert!(
        w.rss() >= rss + 2 * GIB - (64 << 20),
        "RSS {} after checkpoint, {rss} before",
        w.rss()
    );

    let t = Instant::now();
    sim.gpu.driver.restore(w.pid, &[]).unwrap();
    let restore = t.elapsed();
    sim.gpu.driver.unlock(w.pid).unwrap();
    assert_eq!(w.complete("large"), before);
    let t = Instant::now();
    assert_eq!(w.verify()["ok"], true);
    let verify = t.elapsed();
    eprintln!("2 GiB: start {start:?}, lock+checkpoint {checkpoint:?}, restore {restore:?}, verify {verify:?}");
    assert!(sim.ledger().is_empty());
}
