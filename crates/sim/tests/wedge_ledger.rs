#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Teardown of contexts and the wedge ledger: only a live context that came from a restore wedges.

mod common;

use std::os::fd::{AsRawFd, OwnedFd};

#[test]
fn sigkill_of_a_live_restored_worker_records_a_wedge() {
    let sim = common::sim();
    let w = common::worker(&sim, "16MiB", 1, 5);
    sim.cycle(w.pid);
    assert!(sim.ledger().is_empty());
    w.sigkill();
    let ledger = sim.wait_ledger(1);
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    let wedge = &ledger[0];
    assert_eq!(wedge.pid, w.pid);
    assert!(wedge.death.contains("SIGKILL"), "{wedge:?}");
    assert!(wedge.restored);
    assert_eq!(wedge.gpu_index, 1);
    assert_eq!(wedge.gpu_uuid, sim.gpu.inspect.gpus().unwrap()[1].uuid);
    assert_eq!(wedge.used_memory, 16 << 20);
    assert!(!sim.listed(w.pid));

    let out = std::process::Command::new(common::BIN)
        .args(["ledger", "--json", "--dir"])
        .arg(sim.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    let printed: Vec<cryo_sim::Wedge> = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(printed, ledger);
}

#[test]
fn a_restored_worker_exiting_after_a_fatal_cuda_error_records_a_wedge() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 5);
    sim.cycle(w.pid);
    let (status, body) = w.http("POST", "/fault?exit=1", "");
    assert_eq!(status, 200, "{body}");
    let ledger = sim.wait_ledger(1);
    assert_eq!(ledger[0].pid, w.pid);
    assert_eq!(ledger[0].death, "exited with status 1");
}

#[test]
fn a_locked_restored_worker_killed_records_a_wedge() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 5);
    sim.suspend(w.pid);
    sim.gpu.driver.restore(w.pid, &[]).unwrap();
    w.sigkill();
    let ledger = sim.wait_ledger(1);
    assert_eq!(ledger[0].pid, w.pid);
    assert!(ledger[0].death.contains("SIGKILL"), "{:?}", ledger[0]);
}

#[test]
fn a_fresh_worker_killed_records_no_wedge() {
    let sim = common::sim();
    let mut w = common::worker(&sim, "8MiB", 0, 5);
    w.sigkill();
    w.wait_exit();
    // One NVML query after the death: the daemon has torn the context down before answering.
    assert!(!sim.listed(w.pid));
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
    // The daemon did tear it down (and would have said so).
    assert!(
        sim.daemon_log().contains("context closed"),
        "{}",
        sim.daemon_log()
    );
}

#[test]
fn a_checkpointed_restored_worker_killed_records_no_wedge() {
    let sim = common::sim();
    let mut w = common::worker(&sim, "8MiB", 0, 5);
    sim.cycle(w.pid);
    sim.suspend(w.pid);
    w.sigkill();
    w.wait_exit();
    sim.assert_no_wedge();
    // A live one killed after it proves the daemon is watching: its wedge is the only one.
    let live = common::worker(&sim, "8MiB", 0, 6);
    sim.cycle(live.pid);
    live.sigkill();
    let ledger = sim.wait_ledger(1);
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert_eq!(ledger[0].pid, live.pid);
}

fn pin(pid: i32, fds: &[i32]) -> Vec<OwnedFd> {
    let pidfd = rustix::process::pidfd_open(
        rustix::process::Pid::from_raw(pid).unwrap(),
        rustix::process::PidfdFlags::empty(),
    )
    .unwrap();
    fds.iter()
        .map(|fd| {
            rustix::process::pidfd_getfd(&pidfd, *fd, rustix::process::PidfdGetfdFlags::empty())
                .unwrap()
        })
        .collect()
}

#[test]
fn pinned_context_fds_keep_a_dead_restored_worker_listed_until_closed() {
    let sim = common::sim();
    let w = common::worker(&sim, "16MiB", 0, 5);
    sim.cycle(w.pid);
    let fds = sim.gpu.inspect.driver_fds(w.pid).unwrap();
    assert_eq!(fds.len(), 1);
    let pins = pin(w.pid, &fds);
    // The pins are driver fds of this process now.
    let mine = sim
        .gpu
        .inspect
        .driver_fds(std::process::id() as i32)
        .unwrap();
    assert!(
        pins.iter().all(|p| mine.contains(&p.as_raw_fd())),
        "{mine:?}"
    );

    w.sigkill();
    // A zombie has closed its files; the NVML query settles every context whose fds are all
    // closed before it answers.
    w.wait_zombie();
    assert!(
        sim.listed(w.pid),
        "a pinned context must stay listed after its process died"
    );
    assert_eq!(
        sim.gpu.inspect.process_memory(w.pid).unwrap(),
        Some(16 << 20)
    );
    assert!(sim.ledger().is_empty(), "no teardown while pinned");

    drop(pins);
    let ledger = sim.wait_ledger(1);
    assert_eq!(ledger[0].pid, w.pid);
    assert!(ledger[0].death.contains("SIGKILL"), "{:?}", ledger[0]);
    assert!(!sim.listed(w.pid));
}

#[test]
fn checkpoint_frees_device_memory_even_while_pinned() {
    let sim = common::sim();
    let w = common::worker(&sim, "16MiB", 0, 5);
    sim.cycle(w.pid);
    let pins = pin(w.pid, &sim.gpu.inspect.driver_fds(w.pid).unwrap());
    sim.suspend(w.pid);
    assert!(!sim.listed(w.pid));
    sim.gpu.driver.restore(w.pid, &[]).unwrap();
    sim.gpu.driver.unlock(w.pid).unwrap();
    assert_eq!(w.verify()["ok"], true);
    // The old context was released: closing its pins is no teardown (the query settles it).
    drop(pins);
    assert!(sim.listed(w.pid));
    sim.assert_no_wedge();
    sim.suspend(w.pid);
    assert!(sim.ledger().is_empty(), "{:?}", sim.ledger());
}

/// The test kit's leak check: a sim worker the test started and never ended (here one outside
/// any [`common::Worker`], as a restore leaves one) fails the test when its sim is dropped, named
/// with its command line, and is killed.
#[test]
fn a_sim_worker_left_running_fails_the_test() {
    let sim = common::sim();
    let ready = sim.path().join("stray.ready");
    let mut stray = common::program()
        .command("worker")
        .args(["--gpu", "0", "--memory", "1MiB", "--ready-file"])
        .arg(&ready)
        .arg("--dir")
        .arg(sim.path())
        .stdin(std::process::Stdio::null())
        .spawn()
        .unwrap();
    cryo_testkit::eventually(
        cryo_testkit::PATIENCE,
        "the stray worker to be ready",
        || ready.exists(),
    );
    let dropped = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| drop(sim)));
    let status = stray.wait().unwrap();
    let panic = dropped.expect_err("the sim's drop let a running worker pass");
    let msg = panic.downcast_ref::<String>().cloned().unwrap_or_default();
    assert!(
        msg.contains("sim workers left running by the test"),
        "{msg}"
    );
    assert!(
        msg.contains(&stray.id().to_string()) && msg.contains("worker --gpu 0"),
        "{msg}"
    );
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{status:?}"
    );
}
