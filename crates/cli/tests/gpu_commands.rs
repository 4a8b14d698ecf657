#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo gpu ...` against the simulated GPU: the cycle, and bad input that must change nothing.

mod common;

use common::*;

/// The row of `cryo gpu ps --json` for `pid`.
fn ps_row(sim: &Sim, pid: i32) -> serde_json::Value {
    let ps = sim.cryo(&["gpu", "ps", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&ps.stdout).unwrap();
    rows.as_array()
        .unwrap()
        .iter()
        .find(|r| r["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not in gpu ps: {rows}"))
        .clone()
}

fn one_line(s: &str) -> bool {
    s.trim_end().lines().count() == 1
}

#[test]
fn full_cycle_through_cryo_gpu_with_gpu_map_by_index() {
    let mut sim = Sim::start();
    let (pid, port) = sim.worker("8MiB");
    let p = pid.to_string();
    let (_, before) = http(port, "POST", "/v1/completions", "hello");

    let ls = sim.cryo(&["gpu", "ls", "--json"]);
    assert!(ls.status.success(), "{}", stderr(&ls));
    let gpus: serde_json::Value = serde_json::from_slice(&ls.stdout).unwrap();
    assert_eq!(gpus.as_array().unwrap().len(), 2);
    // The backend was named (`--gpu sim`): nothing is said about it.
    assert!(
        !stderr(&ls).contains("using"),
        "a named backend is announced: {}",
        stderr(&ls)
    );

    let row = ps_row(&sim, pid);
    assert_eq!(row["state"], "running");
    assert_eq!(row["gpu_index"], 0);

    let lock = sim.cryo(&["gpu", "lock", "--pid", &p, "--timeout", "5000", "--json"]);
    assert!(lock.status.success(), "{}", stderr(&lock));
    let r: serde_json::Value = serde_json::from_slice(&lock.stdout).unwrap();
    assert_eq!(
        (r["before"].as_str(), r["after"].as_str()),
        (Some("running"), Some("locked"))
    );

    assert!(sim
        .cryo(&["gpu", "checkpoint", "--pid", &p])
        .status
        .success());
    assert_eq!(sim.state(pid), "checkpointed");
    let ps = sim.cryo(&["gpu", "ps", "--json"]);
    let rows: serde_json::Value = serde_json::from_slice(&ps.stdout).unwrap();
    assert!(
        rows.as_array().unwrap().iter().all(|r| r["pid"] != pid),
        "checkpointed pid still listed"
    );

    let restore = sim.cryo(&["gpu", "restore", "--pid", &p, "--gpu-map", "0=1"]);
    assert!(restore.status.success(), "{}", stderr(&restore));
    assert_eq!(
        stdout(&restore).trim_end(),
        stdout(&restore).lines().next().unwrap()
    );
    assert!(
        stdout(&restore).contains("checkpointed -> locked"),
        "{}",
        stdout(&restore)
    );
    assert!(sim.cryo(&["gpu", "unlock", "--pid", &p]).status.success());
    assert_eq!(sim.state(pid), "running");

    let row = ps_row(&sim, pid);
    assert_eq!(
        row["gpu_index"], 1,
        "--gpu-map 0=1 did not move the context"
    );
    let (_, after) = http(port, "POST", "/v1/completions", "hello");
    assert_eq!(before, after);

    let tid = sim.cryo(&["gpu", "restore-tid", "--pid", &p]);
    let tid: i32 = stdout(&tid).trim().parse().unwrap();
    assert!(tid > 0);
    assert!(sim.ledger().is_empty());
}

#[test]
fn malformed_gpu_map_is_refused_before_anything_runs() {
    // No driver at all: a parse error must come before any attempt to reach one.
    let out = cryo()
        .args([
            "--gpu",
            "sim",
            "--sim-dir",
            "/nonexistent/cryo",
            "gpu",
            "restore",
            "--pid",
            "1",
            "--gpu-map",
            "GPU-12=0",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("GPU-12"), "{}", stderr(&out));
    assert!(
        !stderr(&out).contains("simulated GPU"),
        "a driver was contacted: {}",
        stderr(&out)
    );
    for bad in ["0", "0=1,", "0=1,0=1", "x=y", ""] {
        let out = cryo()
            .args(["gpu", "restore", "--pid", "1", "--gpu-map", bad])
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{bad:?}: {}", stderr(&out));
    }
}

#[test]
fn gpu_map_index_this_host_lacks_is_a_usage_error_and_changes_nothing() {
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("1MiB");
    let p = pid.to_string();
    assert!(sim.cryo(&["gpu", "lock", "--pid", &p]).status.success());
    assert!(sim
        .cryo(&["gpu", "checkpoint", "--pid", &p])
        .status
        .success());
    let out = sim.cryo(&["gpu", "restore", "--pid", &p, "--gpu-map", "0=7"]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no GPU with index 7"),
        "{}",
        stderr(&out)
    );
    assert_eq!(sim.state(pid), "checkpointed");
}

#[test]
fn unknown_pid_is_refused() {
    let sim = Sim::start();
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let gone = c.id().to_string();
    c.wait().unwrap();
    for cmd in [
        "state",
        "lock",
        "checkpoint",
        "restore",
        "unlock",
        "restore-tid",
    ] {
        let out = sim.cryo(&["gpu", cmd, "--pid", &gone]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        assert_eq!(
            stderr(&out).trim_end(),
            format!("cryo: error: pid {gone} does not exist"),
            "{cmd}"
        );
    }
}

#[test]
fn non_cuda_pid_is_explained() {
    let sim = Sim::start();
    let mut s = sleeper();
    let p = s.id().to_string();
    for cmd in ["state", "lock", "checkpoint"] {
        let out = sim.cryo(&["gpu", cmd, "--pid", &p]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let err = stderr(&out);
        let last = err.lines().last().unwrap();
        assert!(
            last.starts_with(&format!("cryo: error: pid {p} is not a CUDA process")),
            "{cmd}: {err}"
        );
        assert!(last.contains("CUDA_ERROR_NOT_INITIALIZED"), "{cmd}: {err}");
    }
    s.kill().unwrap();
    s.wait().unwrap();
}

#[test]
fn wrong_transitions_are_refused_and_change_nothing() {
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("1MiB");
    let p = pid.to_string();
    let cases: [(&str, &str); 3] = [
        ("checkpoint", "is running; lock it first"),
        ("unlock", "is running; there is nothing to unlock"),
        ("restore", "is running; there is nothing to restore"),
    ];
    for (cmd, why) in cases {
        let out = sim.cryo(&["gpu", cmd, "--pid", &p]);
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        assert!(
            stderr(&out)
                .lines()
                .last()
                .unwrap()
                .ends_with(&format!("pid {p} {why}")),
            "{cmd}: {}",
            stderr(&out)
        );
        assert_eq!(sim.state(pid), "running", "{cmd} changed the state");
    }
    assert!(sim.cryo(&["gpu", "lock", "--pid", &p]).status.success());
    let out = sim.cryo(&["gpu", "lock", "--pid", &p]);
    assert!(
        stderr(&out).contains("is already locked"),
        "{}",
        stderr(&out)
    );
    let out = sim.cryo(&["gpu", "restore", "--pid", &p]);
    assert!(
        stderr(&out).contains("is locked, not checkpointed"),
        "{}",
        stderr(&out)
    );
    assert_eq!(sim.state(pid), "locked");
    assert!(sim.cryo(&["gpu", "unlock", "--pid", &p]).status.success());
}

#[test]
fn lock_timeout_leaves_the_worker_running() {
    let mut sim = Sim::start();
    let (pid, port) = sim.worker("1MiB");
    let (status, _) = http(port, "POST", "/busy?ms=3000", "");
    assert_eq!(status, 200);
    let out = sim.cryo(&["gpu", "lock", "--pid", &pid.to_string(), "--timeout", "100"]);
    assert_eq!(out.status.code(), Some(1));
    let err = stderr(&out);
    assert!(
        err.contains("after 100 ms") && err.contains("CUDA_ERROR_NOT_READY"),
        "{err}"
    );
    assert_eq!(sim.state(pid), "running");
}

#[test]
fn sim_driver_not_running_is_one_clear_line() {
    let dir = tempfile::tempdir().unwrap();
    let out = cryo()
        .arg("--gpu")
        .arg("sim")
        .arg("--sim-dir")
        .arg(dir.path())
        .args(["gpu", "ls"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(one_line(&stderr(&out)), "{}", stderr(&out));
    assert!(stderr(&out).contains("cryo sim driver"), "{}", stderr(&out));
}

/// `--gpu cuda` without a driver: one line, no panic, exit 1. On a host where libcuda loads and
/// sees a GPU, `gpu ls` must work instead.
#[test]
fn gpu_cuda_without_a_driver_is_one_clear_line() {
    let out = cryo()
        .args(["--gpu", "cuda", "gpu", "ls"])
        .output()
        .unwrap();
    let err = stderr(&out);
    if has_libcuda() {
        assert!(
            out.status.success(),
            "a driver is installed but gpu ls failed: {err}"
        );
        return;
    }
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(one_line(&err), "more than one line: {err}");
    assert!(
        err.starts_with("cryo: error: --gpu cuda: no usable CUDA driver: "),
        "{err}"
    );
    assert!(err.contains("libcuda.so.1"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert!(stdout(&out).is_empty());
}

#[test]
fn auto_falls_back_to_the_simulated_gpu_and_says_so() {
    if has_libcuda() {
        return assert!(cryo()
            .args(["gpu", "ls"])
            .output()
            .unwrap()
            .status
            .success());
    }
    let sim = Sim::start();
    let out = cryo()
        .arg("--sim-dir")
        .arg(sim.path())
        .args(["gpu", "ls"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let err = stderr(&out);
    assert!(one_line(&err), "{err}");
    assert!(
        err.contains("using the simulated GPU") && err.contains("--gpu auto"),
        "{err}"
    );
    // The environment variables work as the flags do.
    let out = cryo()
        .env("CRYO_GPU", "sim")
        .env("CRYO_SIM_DIR", sim.path())
        .args(["gpu", "ls"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    // A named backend is used without a word.
    assert_eq!(stderr(&out), "");
}

fn has_libcuda() -> bool {
    let out = std::process::Command::new("ldconfig")
        .arg("-p")
        .output()
        .map(|o| stdout(&o))
        .unwrap_or_default();
    out.contains("libcuda.so.1")
}
