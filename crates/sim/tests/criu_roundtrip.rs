#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A checkpointed sim worker is an ordinary process: plain CRIU (no cuda plugin) dumps it, and the
//! image restores, GPU restore included, any number of times. Needs `criu` (4.x) on PATH and root.

mod common;

use common::WorkerSpec;
use cryo_gpu::ProcessState;
use cryo_testkit::procs;
use std::path::Path;
use std::process::Command;

fn criu(args: &[&str], log_dir: &Path, what: &str) {
    let out = Command::new("criu")
        .args(args)
        .output()
        .expect("criu must be installed (criu 4.x on PATH)");
    assert!(
        out.status.success(),
        "criu {what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        std::fs::read_to_string(log_dir.join(format!("{what}.log"))).unwrap_or_default()
    );
}

#[test]
fn plain_criu_dumps_a_checkpointed_worker_and_restores_it_twice() {
    round_trip(true);
}

#[test]
fn plain_criu_dumps_a_checkpointed_worker_serving_tcp() {
    round_trip(false);
}

fn round_trip(http_unix: bool) {
    let _ = nix::sys::prctl::set_child_subreaper(true);
    let sim = common::sim();
    let spec = WorkerSpec::new("64MiB").seed(9).setsid();
    let mut w = sim.spawn(if http_unix { spec.http_unix() } else { spec });
    let before = w.complete("frozen");
    sim.suspend(w.pid);
    let img = sim.path().join("img");
    std::fs::create_dir(&img).unwrap();
    let img_s = img.to_str().unwrap();
    let pid = w.pid.to_string();
    criu(
        &["dump", "-t", &pid, "-D", img_s, "-o", "dump.log", "-v4"],
        &img,
        "dump",
    );
    w.reap();

    for round in 0..2 {
        let log = format!("restore-{round}");
        criu(
            &[
                "restore",
                "-d",
                "-D",
                img_s,
                "-o",
                &format!("{log}.log"),
                "-v4",
            ],
            &img,
            &log,
        );
        assert_eq!(
            sim.gpu.driver.state(w.pid).unwrap(),
            ProcessState::Checkpointed,
            "round {round}"
        );
        assert!(!sim.listed(w.pid));
        sim.gpu.driver.restore(w.pid, &[]).unwrap();
        sim.gpu.driver.unlock(w.pid).unwrap();
        assert_eq!(w.complete("frozen"), before, "round {round}");
        assert_eq!(w.verify()["ok"], true, "round {round}");
        // Suspend before kill: no wedge.
        sim.suspend(w.pid);
        w.sigkill();
        procs::reap(w.pid);
    }
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}
