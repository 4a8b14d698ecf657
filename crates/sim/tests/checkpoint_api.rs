#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The checkpoint API of the simulated driver, call by call, against real worker processes.

mod common;

use std::time::Duration;

use common::code;
use cryo_gpu::{CuResult, GpuPair, ProcessState};
use cryo_testkit::{eventually, PATIENCE};

const MIB: u64 = 1 << 20;

#[test]
fn lock_checkpoint_restore_unlock_keeps_the_answers() {
    let sim = common::sim();
    let w = common::worker(&sim, "256MiB", 0, 7);
    let d = &sim.gpu.driver;
    let before = w.complete("the quick brown fox");
    assert_eq!(
        w.complete("the quick brown fox"),
        before,
        "answers are deterministic"
    );
    assert_ne!(w.complete("another prompt"), before);
    assert_eq!(w.verify()["ok"], true);
    assert_eq!(
        sim.gpu.inspect.process_memory(w.pid).unwrap(),
        Some(256 * MIB)
    );
    let fds = sim.gpu.inspect.driver_fds(w.pid).unwrap();
    assert_eq!(fds.len(), 1, "one context fd: {fds:?}");
    let target = std::fs::read_link(format!("/proc/{}/fd/{}", w.pid, fds[0])).unwrap();
    assert!(
        target.to_str().unwrap().starts_with("socket:["),
        "{target:?}"
    );
    let tid = d.restore_thread_id(w.pid).unwrap();
    assert!(
        std::path::Path::new(&format!("/proc/{}/task/{tid}", w.pid)).exists(),
        "restore tid {tid}"
    );
    assert_ne!(tid, w.pid);

    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Running);
    d.lock(w.pid, Some(Duration::from_secs(10))).unwrap();
    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Locked);
    assert!(sim.listed(w.pid), "NVML lists a locked process");
    let rss_before = w.rss();
    d.checkpoint(w.pid).unwrap();
    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Checkpointed);
    assert!(
        !sim.listed(w.pid),
        "NVML must not list a checkpointed process"
    );
    assert_eq!(sim.gpu.inspect.process_memory(w.pid).unwrap(), None);
    assert!(
        sim.gpu.inspect.driver_fds(w.pid).unwrap().is_empty(),
        "checkpoint closes the context fd"
    );
    let grown = w.rss().saturating_sub(rss_before);
    assert!(
        grown >= 250 * MIB,
        "RSS grew by only {grown} bytes for 256 MiB of device memory"
    );
    assert_eq!(
        sim.gpu.inspect.gpus().unwrap()[0].memory_free,
        16 << 30,
        "checkpoint frees device memory"
    );
    assert_eq!(
        w.http("GET", "/health", "").0,
        200,
        "health answers while checkpointed"
    );

    d.restore(w.pid, &[]).unwrap();
    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Locked);
    assert_eq!(
        sim.gpu.inspect.process_memory(w.pid).unwrap(),
        Some(256 * MIB)
    );
    assert_eq!(sim.gpu.inspect.driver_fds(w.pid).unwrap().len(), 1);
    d.unlock(w.pid).unwrap();
    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Running);
    assert_eq!(w.complete("the quick brown fox"), before);
    assert_eq!(w.verify()["ok"], true);
    assert!(
        w.rss() < rss_before + 64 * MIB,
        "the host copy is freed after restore"
    );
    assert!(sim.ledger().is_empty());
}

#[test]
fn restore_moves_the_context_to_the_gpu_of_a_uuid_pair() {
    let sim = common::sim();
    let gpus = sim.gpu.inspect.gpus().unwrap();
    assert_eq!(gpus.len(), 2);
    assert_ne!(gpus[0].uuid, gpus[1].uuid);
    let w = common::worker(&sim, "32MiB", 0, 3);
    let before = w.complete("hello");
    sim.suspend(w.pid);
    let pair = GpuPair {
        old: gpus[0].uuid.clone(),
        new: gpus[1].uuid.clone(),
    };
    sim.gpu.driver.restore(w.pid, &[pair]).unwrap();
    let procs = sim.gpu.inspect.processes().unwrap();
    let p = procs.iter().find(|p| p.pid == w.pid).unwrap();
    assert_eq!((p.gpu_index, &p.gpu_uuid), (1, &gpus[1].uuid));
    let after = sim.gpu.inspect.gpus().unwrap();
    assert_eq!(after[0].memory_free, after[0].memory_total);
    assert_eq!(after[1].memory_free, after[1].memory_total - 32 * MIB);
    sim.gpu.driver.unlock(w.pid).unwrap();
    assert_eq!(w.complete("hello"), before);
    assert_eq!(w.verify()["ok"], true);
}

#[test]
fn restore_onto_an_unknown_uuid_is_refused_and_changes_nothing() {
    let sim = common::sim();
    let gpus = sim.gpu.inspect.gpus().unwrap();
    let w = common::worker(&sim, "8MiB", 0, 3);
    sim.suspend(w.pid);
    let pair = GpuPair {
        old: gpus[0].uuid.clone(),
        new: "GPU-00000000-0000-0000-0000-00000000dead".parse().unwrap(),
    };
    assert_eq!(
        code(sim.gpu.driver.restore(w.pid, &[pair])),
        CuResult::INVALID_VALUE
    );
    assert_eq!(
        sim.gpu.driver.state(w.pid).unwrap(),
        ProcessState::Checkpointed
    );
    sim.gpu.driver.restore(w.pid, &[]).unwrap();
    sim.gpu.driver.unlock(w.pid).unwrap();
    assert_eq!(w.verify()["ok"], true);
}

#[test]
fn lock_waits_for_queued_work_and_blocks_gpu_calls() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    let (status, body) = w.http("POST", "/busy?ms=1500", "");
    assert_eq!(status, 200, "{body}");
    assert!(w.health()["queued_ms"].as_u64().unwrap() > 0);
    sim.gpu
        .driver
        .lock(w.pid, Some(Duration::from_secs(30)))
        .unwrap();
    // A lock cannot succeed before the queued work is done.
    assert_eq!(w.health()["queued_ms"], 0, "locked with GPU work queued");
    assert_eq!(sim.gpu.driver.state(w.pid).unwrap(), ProcessState::Locked);

    // A GPU call made while locked waits at the gate until unlock.
    let ep = w.endpoint.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        tx.send(cryo_testkit::http::http(
            ep,
            "POST",
            "/v1/completions",
            "blocked",
        ))
        .unwrap()
    });
    eventually(PATIENCE, "the GPU call to reach the gate", || {
        w.health()["gpu_calls_waiting"] == 1
    });
    assert!(rx.try_recv().is_err(), "a GPU call ran while locked");
    assert_eq!(sim.gpu.driver.state(w.pid).unwrap(), ProcessState::Locked);
    sim.gpu.driver.unlock(w.pid).unwrap();
    let (status, _) = rx
        .recv_timeout(PATIENCE)
        .expect("the blocked call finishes after unlock");
    assert_eq!(status, 200);
    assert_eq!(w.health()["gpu_calls_waiting"], 0);
}

#[test]
fn lock_times_out_with_not_ready_and_leaves_the_process_running() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    assert_eq!(w.http("POST", "/busy?ms=5000", "").0, 200);
    let r = sim.gpu.driver.lock(w.pid, Some(Duration::from_millis(300)));
    assert_eq!(code(r), CuResult::NOT_READY);
    assert_eq!(sim.gpu.driver.state(w.pid).unwrap(), ProcessState::Running);
    // The gate is open again: GPU calls run.
    let _ = w.complete("still serving");
    assert!(sim.listed(w.pid));
}

#[test]
fn a_sticky_error_makes_lock_fail_with_illegal_address() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    let (status, body) = w.http("POST", "/fault", "");
    assert_eq!(status, 200, "{body}");
    assert_eq!(
        code(sim.gpu.driver.lock(w.pid, Some(Duration::from_secs(5)))),
        CuResult::ILLEGAL_ADDRESS
    );
    assert_eq!(sim.gpu.driver.state(w.pid).unwrap(), ProcessState::Running);
    let (status, body) = w.http("POST", "/v1/completions", "x");
    assert_eq!(status, 500);
    assert!(body.contains("CUDA_ERROR_ILLEGAL_ADDRESS"), "{body}");
}

#[test]
fn sticky_errors_can_be_injected_through_the_daemon_also_after_a_restore() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    sim.cycle(w.pid);
    sim.control.inject_sticky(w.pid).unwrap();
    assert_eq!(
        code(sim.gpu.driver.lock(w.pid, None)),
        CuResult::ILLEGAL_ADDRESS
    );
    assert_eq!(sim.gpu.driver.state(w.pid).unwrap(), ProcessState::Running);

    // And through the command line.
    let w2 = common::worker(&sim, "8MiB", 1, 2);
    let out = std::process::Command::new(common::BIN)
        .args(["inject", "--dir"])
        .arg(sim.path())
        .args(["--pid", &w2.pid.to_string(), "sticky"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        code(sim.gpu.driver.lock(w2.pid, None)),
        CuResult::ILLEGAL_ADDRESS
    );
}

#[test]
fn a_restore_without_device_memory_fails_and_leaves_the_process_stuck() {
    let sim = common::sim_with(&["--gpus", "1", "--gpu-memory", "48MiB"]);
    let a = common::worker(&sim, "32MiB", 0, 1);
    sim.suspend(a.pid);
    let b = common::worker(&sim, "32MiB", 0, 2);
    assert_eq!(
        code(sim.gpu.driver.restore(a.pid, &[])),
        CuResult::OUT_OF_MEMORY
    );
    assert_eq!(
        sim.gpu.driver.state(a.pid).unwrap(),
        ProcessState::Checkpointed
    );
    assert!(!sim.listed(a.pid));
    // Even with the memory back, the process is stuck (NVIDIA/cuda-checkpoint#44).
    drop(b);
    assert_eq!(
        code(sim.gpu.driver.restore(a.pid, &[])),
        CuResult::OPERATING_SYSTEM
    );
    assert_eq!(code(sim.gpu.driver.unlock(a.pid)), CuResult::ILLEGAL_STATE);
    assert_eq!(
        sim.gpu.driver.state(a.pid).unwrap(),
        ProcessState::Checkpointed
    );
}

#[test]
fn wrong_transitions_answer_illegal_state_and_change_nothing() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    let d = &sim.gpu.driver;
    let state = || d.state(w.pid).unwrap();
    assert_eq!(code(d.checkpoint(w.pid)), CuResult::ILLEGAL_STATE);
    assert_eq!(code(d.unlock(w.pid)), CuResult::ILLEGAL_STATE);
    assert_eq!(code(d.restore(w.pid, &[])), CuResult::ILLEGAL_STATE);
    assert_eq!(state(), ProcessState::Running);
    assert!(sim.listed(w.pid));
    let _ = w.complete("still running");

    d.lock(w.pid, None).unwrap();
    assert_eq!(code(d.lock(w.pid, None)), CuResult::ILLEGAL_STATE);
    assert_eq!(code(d.restore(w.pid, &[])), CuResult::ILLEGAL_STATE);
    assert_eq!(state(), ProcessState::Locked);

    d.checkpoint(w.pid).unwrap();
    assert_eq!(code(d.checkpoint(w.pid)), CuResult::ILLEGAL_STATE);
    assert_eq!(code(d.unlock(w.pid)), CuResult::ILLEGAL_STATE);
    assert_eq!(code(d.lock(w.pid, None)), CuResult::ILLEGAL_STATE);
    assert_eq!(state(), ProcessState::Checkpointed);
    d.restore(w.pid, &[]).unwrap();
    d.unlock(w.pid).unwrap();
    assert_eq!(w.verify()["ok"], true);
}

#[test]
fn pids_without_cuda_or_without_a_process_get_the_drivers_codes() {
    let sim = common::sim();
    let d = &sim.gpu.driver;
    let me = std::process::id() as i32;
    assert_eq!(code(d.state(me)), CuResult::NOT_INITIALIZED);
    assert_eq!(code(d.lock(me, None)), CuResult::NOT_INITIALIZED);
    let mut sleeper = std::process::Command::new("sleep")
        .arg("60")
        .spawn()
        .unwrap();
    assert_eq!(
        code(d.checkpoint(sleeper.id() as i32)),
        CuResult::NOT_INITIALIZED
    );
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
    assert_eq!(code(d.state(sleeper.id() as i32)), CuResult::INVALID_VALUE);
    assert_eq!(code(d.state(i32::MAX)), CuResult::INVALID_VALUE);
    assert_eq!(code(d.unlock(-5)), CuResult::INVALID_VALUE);
    // A worker of another daemon is not a CUDA process for this one.
    let other = common::sim();
    let w = common::worker(&other, "8MiB", 0, 1);
    assert_eq!(code(d.state(w.pid)), CuResult::NOT_INITIALIZED);
    assert_eq!(
        other.gpu.driver.state(w.pid).unwrap(),
        ProcessState::Running
    );
}

#[test]
fn a_missing_daemon_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let err = cryo_sim::connect(dir.path()).unwrap_err().to_string();
    assert!(
        err.contains("no simulated GPU driver is running") && err.contains("cryo sim driver --dir"),
        "{err}"
    );
}

#[test]
fn a_worker_asking_for_more_than_the_gpu_has_fails_to_start() {
    let sim = common::sim_with(&["--gpus", "1", "--gpu-memory", "16MiB"]);
    let out = std::process::Command::new(common::BIN)
        .args(["worker", "--memory", "32MiB", "--dir"])
        .arg(sim.path())
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("CUDA_ERROR_OUT_OF_MEMORY"), "{err}");
}

/// What CRIU cannot dump without help: pipes, anonymous inodes (eventfd, epoll, inotify),
/// connected sockets. A checkpointed worker must hold none of them.
#[test]
fn a_checkpointed_worker_holds_only_files_and_listening_sockets() {
    let sim = common::sim();
    let w = common::worker(&sim, "8MiB", 0, 1);
    let _ = w.complete("warm up every thread");
    sim.suspend(w.pid);
    // tiny_http closes a finished connection's socket just after the client saw the answer: a
    // TCP connection may linger a moment. Anything else must be gone when checkpoint returns.
    let sockets = eventually(
        PATIENCE,
        "lingering TCP connections to close",
        || match unusual_fds(w.pid) {
            Ok(sockets) => Some(sockets),
            Err((true, _)) => None,
            Err((false, e)) => panic!("{e}"),
        },
    );
    assert_eq!(
        sockets, 2,
        "the HTTP listener and the restore thread's listener"
    );
}

/// `Ok(number of sockets)` when every fd is a plain file or a listening socket; else whether the
/// culprit is a TCP socket, and what it is.
fn unusual_fds(pid: i32) -> Result<usize, (bool, String)> {
    let unix = std::fs::read_to_string("/proc/net/unix").unwrap();
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap();
    let column = |table: &str, ino: &str, col: usize| -> Option<String> {
        table.lines().find_map(|l| {
            let c: Vec<&str> = l.split_whitespace().collect();
            (c.get(col) == Some(&ino)).then(|| l.to_string())
        })
    };
    let mut sockets = 0;
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let Ok(target) = std::fs::read_link(entry.unwrap().path()) else {
            continue;
        };
        let target = target.to_string_lossy().into_owned();
        let Some(ino) = target
            .strip_prefix("socket:[")
            .and_then(|t| t.strip_suffix(']'))
        else {
            if !target.starts_with('/') {
                return Err((false, format!("not a plain file: {target}")));
            }
            continue;
        };
        sockets += 1;
        if let Some(line) = column(&unix, ino, 6) {
            let c: Vec<&str> = line.split_whitespace().collect();
            if !(c[5] == "01" && c[3].ends_with("10000")) {
                return Err((
                    false,
                    format!("a unix socket that is not listening: {line}"),
                ));
            }
        } else if let Some(line) = column(&tcp, ino, 9) {
            if line.split_whitespace().nth(3) != Some("0A") {
                return Err((true, format!("a TCP socket that is not listening: {line}")));
            }
        } else {
            return Err((
                false,
                format!("a socket neither unix nor TCP/IPv4: {target}"),
            ));
        }
    }
    Ok(sockets)
}

/// The daemon times every copy of device memory, checkpoint and restore, per process, on
/// `CLOCK_MONOTONIC`, within the call that made it: what `cryo bench freeze` takes out of its
/// moments to see the rest of each route's cost.
#[test]
fn every_checkpoint_and_restore_copy_is_timed_within_its_call() {
    use cryo_sim::proto::CopyKind;
    use cryo_units::Moment;
    let sim = common::sim();
    let w = common::worker(&sim, "64MiB", 0, 3);
    let other = common::worker(&sim, "16MiB", 0, 4);
    let d = &sim.gpu.driver;
    d.lock(w.pid, Some(Duration::from_secs(10))).unwrap();
    let before = Moment::now();
    d.checkpoint(w.pid).unwrap();
    let checkpointed = Moment::now();
    d.restore(w.pid, &[]).unwrap();
    let restored = Moment::now();
    d.unlock(w.pid).unwrap();
    let copies: Vec<_> = sim
        .control
        .copies()
        .unwrap()
        .into_iter()
        .filter(|c| c.pid == w.pid)
        .collect();
    assert_eq!(copies.len(), 2, "{copies:?}");
    let [ck, rs] = [copies[0], copies[1]];
    assert_eq!((ck.kind, ck.bytes), (CopyKind::Checkpoint, 64 * MIB));
    assert_eq!((rs.kind, rs.bytes), (CopyKind::Restore, 64 * MIB));
    assert!(
        before <= ck.start && ck.start <= ck.end && ck.end <= checkpointed,
        "{ck:?}"
    );
    assert!(
        checkpointed <= rs.start && rs.start <= rs.end && rs.end <= restored,
        "{rs:?}"
    );
    // The other worker's contexts were never copied.
    assert!(sim
        .control
        .copies()
        .unwrap()
        .iter()
        .all(|c| c.pid != other.pid));
    assert_eq!(w.verify()["ok"], true);
}
