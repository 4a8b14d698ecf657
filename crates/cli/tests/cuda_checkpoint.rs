#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The `cuda-checkpoint` front end end to end against the simulated GPU, as `cryo cuda-checkpoint`
//! and through a symlink named `cuda-checkpoint`, with the invocations CRIU's cuda plugin makes.

mod common;

use std::process::Command;

use common::*;

#[test]
fn get_state_toggle_and_restore_tid() {
    let mut sim = Sim::start();
    let (pid, port) = sim.worker("4MiB");
    let p = pid.to_string();
    let (_, before) = http(port, "POST", "/v1/completions", "q");

    let out = sim.compat(&["--get-state", "--pid", &p]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stdout(&out), "running\n");
    assert_eq!(
        stderr(&out),
        "",
        "nothing but the state may be printed (CRIU reads stdout and stderr)"
    );

    let out = sim.compat(&["--get-restore-tid", "--pid", &p]);
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(stderr(&out), "");
    let tid: i32 = stdout(&out)
        .trim()
        .parse()
        .expect("restore tid is not a number");
    // CRIU's cuda plugin asks for the state of the restore tid: it stands for its process.
    let out = sim.compat(&["--get-state", "--pid", &tid.to_string()]);
    assert_eq!(stdout(&out), "running\n", "{}", stderr(&out));

    let out = sim.compat(&["--toggle", "--pid", &p]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!((stdout(&out).as_str(), stderr(&out).as_str()), ("", ""));
    assert_eq!(
        stdout(&sim.compat(&["--get-state", "--pid", &p])),
        "checkpointed\n"
    );

    let out = sim.compat(&["--toggle", "--pid", &p]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert_eq!(
        stdout(&sim.compat(&["--get-state", "--pid", &p])),
        "running\n"
    );
    assert_eq!(http(port, "POST", "/v1/completions", "q").1, before);
    assert!(sim.ledger().is_empty());
}

#[test]
fn criu_dump_and_restore_sequence() {
    // What cuda_plugin.c runs: pause (lock with timeout), checkpoint, then on restore: restore, unlock.
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("2MiB");
    let p = pid.to_string();
    let help = sim.compat(&["-h"]);
    assert_eq!(help.status.code(), Some(0));
    assert!(stdout(&help).contains("--action"));
    for args in [
        vec!["--action", "lock", "--pid", &p, "--timeout", "10000"],
        vec!["--action", "checkpoint", "--pid", &p],
    ] {
        let out = sim.compat(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    assert_eq!(
        stdout(&sim.compat(&["--get-state", "--pid", &p])),
        "checkpointed\n"
    );
    let gpus: serde_json::Value =
        serde_json::from_slice(&sim.cryo(&["gpu", "ls", "--json"]).stdout).unwrap();
    let (g0, g1) = (
        gpus[0]["uuid"].as_str().unwrap(),
        gpus[1]["uuid"].as_str().unwrap(),
    );
    // The driver takes a map only with a pair for every GPU the process used, and nothing else
    // (the simulated driver's reading of NVIDIA's rule): a machine-wide swap is refused as is.
    let swap = format!("{g0}={g1},{g1}={g0}");
    let out = sim.compat(&["--action", "restore", "--pid", &p, "--device-map", &swap]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        format!("Could not restore on process ID {p}: \"invalid argument\"\n")
    );
    let map = format!("{g0}={g1}");
    for args in [
        vec!["--action", "restore", "--pid", &p, "--device-map", &map],
        vec!["--action", "unlock", "--pid", &p],
    ] {
        let out = sim.compat(&args);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {}", stderr(&out));
    }
    let ps: serde_json::Value =
        serde_json::from_slice(&sim.cryo(&["gpu", "ps", "--json"]).stdout).unwrap();
    let row = ps
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["pid"] == pid)
        .unwrap();
    assert_eq!(row["gpu_uuid"], g1, "--device-map did not move the context");
}

#[test]
fn driver_errors_follow_nvidia_conventions() {
    let mut sim = Sim::start();
    let (pid, port) = sim.worker("1MiB");
    let p = pid.to_string();

    // Checkpoint before lock: the driver's ILLEGAL_STATE, as exit status and description.
    let out = sim.compat(&["--action", "checkpoint", "--pid", &p]);
    assert_eq!(out.status.code(), Some(401 & 0xff));
    assert_eq!(stderr(&out), format!("Could not checkpoint on process ID {p}: \"the operation is not permitted in the current state\"\n"));
    assert_eq!(stdout(&out), "");
    assert_eq!(
        stdout(&sim.compat(&["--get-state", "--pid", &p])),
        "running\n"
    );

    // Lock timeout with work in flight: NOT_READY, still running.
    assert_eq!(http(port, "POST", "/busy?ms=3000", "").0, 200);
    let out = sim.compat(&["--action", "lock", "--pid", &p, "--timeout", "100"]);
    assert_eq!(out.status.code(), Some(600 & 0xff), "{}", stderr(&out));
    assert_eq!(
        stderr(&out),
        format!("Could not lock on process ID {p}: \"device not ready\"\n")
    );
    assert_eq!(
        stdout(&sim.compat(&["--get-state", "--pid", &p])),
        "running\n"
    );

    // A process without CUDA: the driver's NOT_INITIALIZED.
    let mut s = sleeper();
    let sp = s.id().to_string();
    let out = sim.compat(&["--get-restore-tid", "--pid", &sp]);
    assert_eq!(out.status.code(), Some(3));
    assert_eq!(
        stderr(&out),
        format!("Could not get restore thread ID of process ID {sp}: \"initialization error\"\n")
    );
    let out = sim.compat(&["--toggle", "--pid", &sp]);
    assert!(
        stderr(&out).starts_with(&format!("Error toggling CUDA in process ID {sp}: ")),
        "{}",
        stderr(&out)
    );
    s.kill().unwrap();
    s.wait().unwrap();

    // A pid that does not exist: INVALID_VALUE.
    let mut c = Command::new("true").spawn().unwrap();
    let gone = c.id().to_string();
    c.wait().unwrap();
    let out = sim.compat(&["--get-state", "--pid", &gone]);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(
        stderr(&out),
        format!("Could not get state of process ID {gone}: \"invalid argument\"\n")
    );
}

#[test]
fn usage_errors_do_not_touch_the_driver() {
    // No driver anywhere: usage errors and --help must not need one.
    let out = cryo()
        .args([
            "--gpu",
            "sim",
            "--sim-dir",
            "/nonexistent/cryo",
            "cuda-checkpoint",
            "--action",
            "freeze",
            "--pid",
            "1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).starts_with("cuda-checkpoint: unknown action \"freeze\""),
        "{}",
        stderr(&out)
    );
    let out = cryo()
        .args([
            "cuda-checkpoint",
            "--action",
            "restore",
            "--pid",
            "1",
            "--device-map",
            "0=1",
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("--device-map takes UUIDs only"),
        "{}",
        stderr(&out)
    );
    let out = cryo().args(["cuda-checkpoint", "--help"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("--get-restore-tid"));
}

#[test]
fn installed_under_the_name_cuda_checkpoint() {
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("1MiB");
    let bin = tempfile::tempdir().unwrap();
    let out = cryo()
        .args(["install-compat", "--dir"])
        .arg(bin.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let link = bin.path().join("cuda-checkpoint");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    // Installing twice is fine; replacing something else needs --force.
    assert!(cryo()
        .args(["install-compat", "--dir"])
        .arg(bin.path())
        .output()
        .unwrap()
        .status
        .success());

    let run = |args: &[&str]| {
        Command::new(&link)
            .env("CRYO_GPU", "sim")
            .env("CRYO_SIM_DIR", sim.path())
            .env("CRYO_STATE_DIR", sim.path().join("state"))
            .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
            .args(args)
            .output()
            .unwrap()
    };
    let p = pid.to_string();
    let out = run(&["--get-state", "--pid", &p]);
    assert_eq!(
        (stdout(&out).as_str(), stderr(&out).as_str()),
        ("running\n", "")
    );
    let out = run(&["-h"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(stdout(&out).contains("--action"));
    assert_eq!(run(&["--toggle", "-p", &p]).status.code(), Some(0));
    assert_eq!(stdout(&run(&["--get-state", "-p", &p])), "checkpointed\n");
    assert_eq!(run(&["--toggle", "-p", &p]).status.code(), Some(0));
    assert_eq!(stdout(&run(&["--get-state", "-p", &p])), "running\n");

    // Found by name on PATH, as CRIU's plugin execs it.
    let out = Command::new("cuda-checkpoint")
        .env("CRYO_GPU", "sim")
        .env("CRYO_SIM_DIR", sim.path())
        .env("PATH", format!("{}:/usr/bin:/bin", bin.path().display()))
        .args(["--get-state", "--pid", &p])
        .output()
        .unwrap();
    assert_eq!(stdout(&out), "running\n");

    let other = tempfile::tempdir().unwrap();
    std::fs::write(other.path().join("cuda-checkpoint"), "not cryo").unwrap();
    let out = cryo()
        .args(["install-compat", "--dir"])
        .arg(other.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("--force"), "{}", stderr(&out));
}

/// `cryo sim call`: one raw call to the simulated driver, as scripts/gpu/driver_call.py makes it
/// through libcuda on a real GPU (scripts/gpu-check.sh section s6 compares the two).
#[test]
fn sim_call_prints_the_drivers_raw_answer() {
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("1MiB");
    let call = |args: &[&str]| -> serde_json::Value {
        let mut c = cryo();
        c.args(["sim", "call"])
            .args(args)
            .arg("--dir")
            .arg(sim.path());
        serde_json::from_str(&ok(c)).unwrap()
    };
    let p = pid.to_string();
    let v = call(&["state", "--pid", &p]);
    assert_eq!(
        (
            v["call"].as_str(),
            v["result"].as_u64(),
            v["name"].as_str(),
            v["value"].as_str()
        ),
        (
            Some("state"),
            Some(0),
            Some("CUDA_SUCCESS"),
            Some("running")
        ),
        "{v}"
    );
    let tid = call(&["restore-tid", "--pid", &p])["value"]
        .as_i64()
        .unwrap();
    assert!(std::path::Path::new(&format!("/proc/{pid}/task/{tid}")).exists());
    // A thread id is handed to the driver as is; the driver takes it for its process.
    let v = call(&["lock", "--pid", &tid.to_string(), "--timeout", "1000"]);
    assert_eq!(v["name"], "CUDA_SUCCESS", "{v}");
    assert_eq!(call(&["state", "--pid", &p])["value"], "locked");
    assert_eq!(call(&["unlock", "--pid", &p])["result"], 0);
    let mut s = sleeper();
    let v = call(&["state", "--pid", &s.id().to_string()]);
    assert_eq!(
        (v["result"].as_u64(), v["name"].as_str(), &v["value"]),
        (
            Some(3),
            Some("CUDA_ERROR_NOT_INITIALIZED"),
            &serde_json::Value::Null
        ),
        "{v}"
    );
    s.kill().unwrap();
    s.wait().unwrap();
}
