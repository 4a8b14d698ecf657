#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo stop` and `cryo timeline` against the simulated GPU. Every test has its own simulated
//! driver and state directory. After a test that expects safety the wedge ledger is empty; after
//! a refusal every process is still alive and serving.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::*;
use cryo_journal::{Event, Journal, ProcId};

/// A state directory (the journal is in `STATE/journal`).
fn state() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cryo-stop-state-")
        .tempdir()
        .unwrap()
}

fn cryo_st(sim: &Sim, st: &Path) -> Command {
    sim.cmd_at(st)
}

use common::succeeded as ok;

/// `cryo stop ... --json`, parsed.
fn stop_json(sim: &Sim, st: &Path, args: &[&str]) -> (Output, serde_json::Value) {
    let mut a = vec!["stop"];
    a.extend_from_slice(args);
    a.push("--json");
    let out = run(sim, st, &a);
    let v = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "--json output does not parse ({e}): {}\n{}",
            stdout(&out),
            stderr(&out)
        )
    });
    (out, v)
}

use procs::alive;

/// Alive and answering its health check.
fn serving(pid: i32, port: u16) {
    assert!(alive(pid), "pid {pid} is not alive");
    let (status, body) = http(port, "GET", "/health", "");
    assert_eq!(status, 200, "pid {pid} does not serve: {body}");
}

/// Lock, checkpoint, restore, unlock through `cryo gpu` (journaled in `st`).
fn restore_via_gpu(sim: &Sim, st: &Path, pid: i32) {
    let p = pid.to_string();
    for action in ["lock", "checkpoint", "restore", "unlock"] {
        ok(&run(sim, st, &["gpu", action, "--pid", &p]));
    }
    assert_eq!(sim.state(pid), "running");
}

/// A worker with `memory` of device memory, restored through `cryo gpu` ([`restore_via_gpu`]):
/// its pid and port.
fn restored_worker(sim: &mut Sim, st: &Path, memory: &str) -> (i32, u16) {
    let (pid, port) = sim.worker(memory);
    restore_via_gpu(sim, st, pid);
    (pid, port)
}

fn journal_types(st: &Path, pid: i32) -> Vec<String> {
    let scan = cryo_journal::read(st.join("journal")).unwrap();
    scan.records
        .iter()
        .filter(|r| r.event.pids().iter().any(|p| p.pid == pid))
        .map(|r| {
            serde_json::to_value(&r.event).unwrap()["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect()
}

fn proc_row(v: &serde_json::Value, pid: i32) -> &serde_json::Value {
    v["processes"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["pid"] == pid)
        .unwrap_or_else(|| panic!("pid {pid} not in {v}"))
}

#[test]
fn stops_a_fresh_worker() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = sim.worker("8MiB");
    let (out, v) = stop_json(&sim, st.path(), &[&pid.to_string()]);
    ok(&out);
    assert_eq!(v["outcome"], "stopped");
    assert_eq!(v["exit_code"], 0);
    let row = proc_row(&v, pid);
    assert_eq!(row["cuda"], true);
    assert!(row["restored"].is_null(), "origin should be unknown: {row}");
    assert_eq!(row["suspended"]["state_before"], "running");
    assert!(row["suspended"]["checkpoint_ms"].is_number(), "{row}");
    assert_eq!(row["ended"], true);
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

#[test]
fn stops_a_restored_worker_known_from_the_journal() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = restored_worker(&mut sim, st.path(), "8MiB");
    serving(pid, port);
    assert!(journal_types(st.path(), pid).contains(&"restore_completed".to_string()));
    let out = run(&sim, st.path(), &["stop", &pid.to_string()]);
    ok(&out);
    assert!(stdout(&out).contains("CUDA, restored"), "{}", stdout(&out));
    assert!(
        stdout(&out).contains("stopped 1 processes"),
        "{}",
        stdout(&out)
    );
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

#[test]
fn toggle_through_the_cuda_checkpoint_front_end_is_journaled_as_a_restore() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = sim.worker("4MiB");
    let p = pid.to_string();
    ok(&run(
        &sim,
        st.path(),
        &["cuda-checkpoint", "--toggle", "--pid", &p],
    ));
    assert_eq!(sim.state(pid), "checkpointed");
    assert!(
        journal_types(st.path(), pid).is_empty(),
        "a checkpoint is not a restore"
    );
    ok(&run(
        &sim,
        st.path(),
        &["cuda-checkpoint", "--toggle", "--pid", &p],
    ));
    assert_eq!(sim.state(pid), "running");
    let scan = cryo_journal::read(st.path().join("journal")).unwrap();
    assert!(
        scan.records.iter().any(|r| matches!(&r.event, Event::RestoreCompleted { pid: id, image, .. } if id.pid == pid && image.contains("toggle"))),
        "{:?}",
        scan.records
    );
    let (out, v) = stop_json(&sim, st.path(), &[&p]);
    ok(&out);
    assert_eq!(proc_row(&v, pid)["restored"], true);
    sim.assert_no_wedge();
}

/// Issue 9 item 8: a restore is journaled before the driver is asked; a state directory that
/// cannot take the record means no restore (main restored, then only warned: a live restored
/// context nobody knew about).
#[test]
fn restore_with_an_unwritable_state_dir_is_refused_before_the_driver_is_asked() {
    let mut sim = Sim::start();
    let (pid, _) = sim.worker("1MiB");
    let p = pid.to_string();
    let bad = Path::new("/proc/cryo-no-such-dir");
    ok(&run(&sim, bad, &["gpu", "lock", "--pid", &p]));
    ok(&run(&sim, bad, &["gpu", "checkpoint", "--pid", &p]));
    let out = run(&sim, bad, &["gpu", "restore", "--pid", &p]);
    assert!(!out.status.success(), "{}", stderr(&out));
    assert!(stderr(&out).contains("journal"), "{}", stderr(&out));
    assert_eq!(sim.state(pid), "checkpointed");
    // The front end the same way.
    let out = run(&sim, bad, &["cuda-checkpoint", "--toggle", "--pid", &p]);
    assert!(!out.status.success(), "{}", stderr(&out));
    assert_eq!(sim.state(pid), "checkpointed");
    let st = state();
    ok(&run(&sim, st.path(), &["gpu", "restore", "--pid", &p]));
    ok(&run(&sim, st.path(), &["gpu", "unlock", "--pid", &p]));
    let steps = journal_types(st.path(), pid);
    assert!(
        steps.iter().position(|s| s == "restore_started")
            < steps.iter().position(|s| s == "restore_completed"),
        "{steps:?}"
    );
}

/// Starts `sh -c 'worker & worker & wait'`; returns the shell and the two workers' pids.
fn tree(sim: &Sim) -> (std::process::Child, i32, i32) {
    let dir = sim.path().to_str().unwrap();
    let w = |n: u32| {
        format!("{CRYO} sim worker --memory 4MiB --gpu {n} --dir {dir} --ready-file {dir}/tree{n}.ready --log-file {dir}/tree{n}.log")
    };
    let script = format!("{} & {} & wait", w(0), w(1));
    let sh = Command::new("sh")
        .arg("-c")
        .arg(&script)
        .stdin(Stdio::null())
        .spawn()
        .unwrap();
    let read = |n: u32| -> i32 {
        let path = sim.path().join(format!("tree{n}.ready"));
        eventually(PATIENCE, &format!("tree worker {n}"), || {
            let t = std::fs::read_to_string(&path).ok()?;
            let v: serde_json::Value = serde_json::from_str(&t).ok()?;
            Some(v["pid"].as_i64().unwrap() as i32)
        })
    };
    let (a, b) = (read(0), read(1));
    (sh, a, b)
}

#[test]
fn stops_a_tree_with_a_parent_and_two_cuda_children() {
    let sim = Sim::start();
    let st = state();
    let (mut sh, a, b) = tree(&sim);
    restore_via_gpu(&sim, st.path(), a);
    restore_via_gpu(&sim, st.path(), b);
    let shpid = sh.id() as i32;
    let (out, v) = stop_json(&sim, st.path(), &[&shpid.to_string()]);
    ok(&out);
    assert_eq!(v["processes"].as_array().unwrap().len(), 3, "{v}");
    assert_eq!(proc_row(&v, shpid)["cuda"], false);
    for pid in [a, b] {
        let row = proc_row(&v, pid);
        assert_eq!(
            (row["cuda"].as_bool(), row["restored"].as_bool()),
            (Some(true), Some(true)),
            "{row}"
        );
        assert!(row["suspended"].is_object(), "{row}");
        assert!(!alive(pid));
    }
    sh.wait().unwrap();
    sim.assert_no_wedge();
}

#[test]
fn lock_waits_for_work_in_flight_then_succeeds() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = restored_worker(&mut sim, st.path(), "4MiB");
    let (status, body) = http(port, "POST", "/busy?ms=1500", "");
    assert_eq!(status, 200, "{body}");
    let (out, v) = stop_json(&sim, st.path(), &[&pid.to_string()]);
    ok(&out);
    assert!(proc_row(&v, pid)["suspended"]["lock_ms"].is_number());
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

#[test]
fn lock_timeout_is_refused_and_nothing_is_killed() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = sim.worker("4MiB");
    let (other, other_port) = sim.worker("4MiB");
    restore_via_gpu(&sim, st.path(), pid);
    restore_via_gpu(&sim, st.path(), other);
    let (status, _) = http(port, "POST", "/busy?ms=8000", "");
    assert_eq!(status, 200);
    let (p, o) = (pid.to_string(), other.to_string());
    let out = run(
        &sim,
        st.path(),
        &["stop", &p, &o, "--timeout", "200", "--lock-attempts", "2"],
    );
    assert_eq!(
        out.status.code(),
        Some(3),
        "{}\n{}",
        stdout(&out),
        stderr(&out)
    );
    let err = stderr(&out);
    assert!(
        err.contains(&format!("refused: pid {pid}")) && err.contains("lock timed out"),
        "{err}"
    );
    assert!(
        err.contains("what to do") && err.contains("--timeout"),
        "{err}"
    );
    assert!(err.contains("nothing in the target was killed"), "{err}");
    // Both stay alive and serving; the one that could be locked was unlocked again.
    for (pid, port) in [(pid, port), (other, other_port)] {
        serving(pid, port);
        assert_eq!(sim.state(pid), "running");
    }
    assert!(journal_types(st.path(), pid).contains(&"refused".to_string()));
    assert!(journal_types(st.path(), other).contains(&"unlocked".to_string()));
    sim.assert_no_wedge();
    // Once the work drains, the same stop goes through.
    let out = run(&sim, st.path(), &["stop", &p, &o]);
    ok(&out);
    assert!(!alive(pid) && !alive(other));
    sim.assert_no_wedge();
}

#[test]
fn sticky_error_is_refused_nothing_killed_ledger_empty() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = sim.worker("4MiB");
    let inject = cryo()
        .args(["sim", "inject", "--dir"])
        .arg(sim.path())
        .args(["--pid", &pid.to_string(), "sticky"])
        .output()
        .unwrap();
    ok(&inject);
    let (out, v) = stop_json(&sim, st.path(), &[&pid.to_string()]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert_eq!(v["outcome"], "refused");
    let refusal = &v["refusals"][0];
    assert_eq!(refusal["pid"], pid);
    assert_eq!(refusal["reason"]["kind"], "sticky_error", "{refusal}");
    assert!(
        refusal["hint"].as_str().unwrap().contains("guard"),
        "{refusal}"
    );
    serving(pid, port);
    sim.assert_no_wedge();
    // --unsafe is the only way through (this worker was never restored, so the sim does not wedge).
    let out = run(&sim, st.path(), &["stop", &pid.to_string(), "--unsafe"]);
    ok(&out);
    assert!(
        stderr(&out).contains("without being suspended"),
        "{}",
        stderr(&out)
    );
    assert!(!alive(pid));
    assert!(journal_types(st.path(), pid).contains(&"unsafe_kill".to_string()));
    sim.assert_no_wedge();
}

/// Issue 9 item 7: `--fresh` still suspends first; only a worker that cannot be suspended (a
/// sticky fault) and that the journal does not know as restored is killed without it. Main
/// killed every fresh worker unsuspended.
#[test]
fn fresh_flag_suspends_first_and_kills_plainly_only_what_cannot_be() {
    let mut sim = Sim::start();
    let st = state();
    let (fresh, _) = sim.worker("4MiB");
    let (faulted, port) = sim.worker("4MiB");
    let (restored, _) = restored_worker(&mut sim, st.path(), "4MiB");
    assert_eq!(http(port, "POST", "/fault", "").0, 200);
    let (out, v) = stop_json(
        &sim,
        st.path(),
        &[
            &fresh.to_string(),
            &faulted.to_string(),
            &restored.to_string(),
            "--fresh",
        ],
    );
    ok(&out);
    assert!(proc_row(&v, fresh)["suspended"].is_object(), "{v}");
    assert!(proc_row(&v, faulted)["suspended"].is_null(), "{v}");
    assert!(
        proc_row(&v, restored)["suspended"].is_object(),
        "the journal's restore must win over --fresh: {v}"
    );
    assert_eq!(v["unsafe_kills"], serde_json::json!([faulted]));
    sim.assert_no_wedge();
}

#[test]
fn an_already_checkpointed_worker_is_only_verified_and_killed() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = sim.worker("4MiB");
    let p = pid.to_string();
    ok(&run(&sim, st.path(), &["gpu", "lock", "--pid", &p]));
    ok(&run(&sim, st.path(), &["gpu", "checkpoint", "--pid", &p]));
    let (out, v) = stop_json(&sim, st.path(), &[&p]);
    ok(&out);
    let s = &proc_row(&v, pid)["suspended"];
    assert_eq!(s["state_before"], "checkpointed");
    assert!(
        s["lock_ms"].is_null() && s["checkpoint_ms"].is_null(),
        "{s}"
    );
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

#[test]
fn a_pid_that_is_gone_is_an_error_and_nothing_is_killed() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = sim.worker("1MiB");
    let mut gone = Command::new("true").spawn().unwrap();
    let g = gone.id() as i32;
    gone.wait().unwrap();
    let out = run(&sim, st.path(), &["stop", &g.to_string()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(stderr(&out).contains(&g.to_string()), "{}", stderr(&out));
    let out = run(&sim, st.path(), &["stop", &pid.to_string(), &g.to_string()]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    serving(pid, port);
    assert_eq!(sim.state(pid), "running");
    sim.assert_no_wedge();
}

#[test]
fn a_reused_pid_is_not_taken_for_the_journaled_process() {
    let mut sim = Sim::start();
    let st = state();
    let elsewhere = state();
    let (pid, _) = sim.worker("4MiB");
    // Restored for real (the sim marks its context restored), journaled in another state dir.
    restore_via_gpu(&sim, elsewhere.path(), pid);
    // This journal says pid was a restored process that started at another time, and that
    // process was declared fresh: neither may be applied to the process holding the pid now.
    let now = ProcId::of(pid).unwrap();
    let old = ProcId::new(pid, now.start_time.saturating_sub(1000));
    let j = Journal::open(st.path().join("journal")).unwrap();
    j.append(Event::FreshDeclared { pid: old }).unwrap();
    let (out, v) = stop_json(&sim, st.path(), &[&pid.to_string()]);
    ok(&out);
    let row = proc_row(&v, pid);
    assert!(
        row["restored"].is_null(),
        "another process's record was applied: {row}"
    );
    assert!(row["suspended"].is_object(), "{row}");
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

#[test]
fn stop_killed_between_checkpoint_and_kill_completes_on_rerun() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = restored_worker(&mut sim, st.path(), "4MiB");
    let mut first = cryo_st(&sim, st.path())
        .args(["stop", &pid.to_string()])
        .env("CRYO_FAILPOINT", "stop-before-kill")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "a Verified record", || {
        assert!(
            first.try_wait().unwrap().is_none(),
            "cryo stop ended before the failpoint"
        );
        journal_types(st.path(), pid).contains(&"verified".to_string())
    });
    first.kill().unwrap();
    first.wait().unwrap();
    assert!(alive(pid));
    assert_eq!(sim.state(pid), "checkpointed");
    let scan = cryo_journal::read(st.path().join("journal")).unwrap();
    let inflight = cryo_journal::in_flight_stops(&scan.records);
    assert!(
        inflight.keys().any(|p| p.pid == pid),
        "the journal does not show the stop in flight"
    );
    // The next stop (of anything) settles it first, and says so.
    next_stop_kills(&mut sim, st.path(), pid);
}

/// `cryo stop` of another worker settles `pid`'s stop left in flight first: killed, said, and
/// the other stopped too, without a wedge.
fn next_stop_kills(sim: &mut Sim, st: &Path, pid: i32) {
    let (other, _) = sim.worker("1MiB");
    let (out, v) = stop_json(sim, st, &[&other.to_string()]);
    ok(&out);
    let settled = v["settled"].as_array().cloned().unwrap_or_default();
    assert!(
        settled
            .iter()
            .any(|s| s["pid"]["pid"] == pid && s["action"]["kind"] == "killed"),
        "{v}"
    );
    assert!(!alive(pid));
    assert!(!alive(other));
    sim.assert_no_wedge();
}

/// Attack (session 19): a stop whose disk fills after its suspension, before its kill (a real
/// `ENOSPC`: the state directory on a small tmpfs, filled while the stop is paused there, the
/// journal's last page too). The kill's intent cannot be journaled: the worker must not be
/// killed unrecorded nor resumed, it stays CHECKPOINTED (its device memory verified gone, never
/// torn down) and the stop fails naming it; room again, the next stop of anything finishes it
/// (killed after the last look), without a wedge.
#[test]
fn a_stop_meeting_a_full_disk_before_its_kill_is_finished_by_the_next_stop() {
    use std::io::Read;
    let mut sim = Sim::start();
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let (pid, _) = restored_worker(&mut sim, &st, "4MiB");
    let go = t.path().join("go");
    let mut stop = cryo_st(&sim, &st)
        .env(
            "CRYO_FAILPOINT",
            cryo_lifecycle::failpoint::STOP_BEFORE_KILL,
        )
        .env("CRYO_FAILPOINT_RESUME", &go)
        .args(["stop", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = stop.stderr.take().unwrap();
    let mut said = common::said_until(&mut err, "paused until");
    let filler = disk.fill();
    common::fill_journal_page(&st);
    std::fs::write(&go, b"").unwrap();
    err.read_to_string(&mut said).unwrap();
    let status = stop.wait().unwrap();
    assert!(
        !status.success(),
        "stopped unrecorded on a full disk: {said}"
    );
    assert!(alive(pid), "killed unrecorded: {said}");
    assert_eq!(sim.state(pid), "checkpointed", "{said}");
    assert!(
        said.contains(&pid.to_string()) && said.contains("No space left on device"),
        "not named, or not the full disk: {said}"
    );
    sim.assert_no_wedge();

    std::fs::remove_file(filler).unwrap();
    next_stop_kills(&mut sim, &st, pid);
    drop(disk);
}

#[test]
fn timeline_shows_each_step_of_the_stop() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = sim.worker("4MiB");
    let (other, _) = sim.worker("1MiB");
    restore_via_gpu(&sim, st.path(), pid);
    ok(&run(&sim, st.path(), &["stop", &pid.to_string()]));
    ok(&run(&sim, st.path(), &["stop", &other.to_string()]));
    let p = pid.to_string();
    let out = run(&sim, st.path(), &["timeline", "--pid", &p, "--json"]);
    ok(&out);
    let types: Vec<String> = stdout(&out)
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["event"]["type"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let pos = |t: &str| {
        types
            .iter()
            .position(|x| x == t)
            .unwrap_or_else(|| panic!("{t} missing from {types:?}"))
    };
    assert!(pos("restore_completed") < pos("locked"));
    assert!(
        pos("locked") < pos("checkpointed")
            && pos("checkpointed") < pos("verified")
            && pos("verified") < pos("killed"),
        "{types:?}"
    );
    let text = stdout(&run(
        &sim,
        st.path(),
        &["timeline", "--pid", &p, "--since", "1h"],
    ));
    for label in [
        "restore completed",
        "locked",
        "checkpointed",
        "verified",
        "killed",
    ] {
        assert!(text.contains(label), "{label} missing:\n{text}");
    }
    assert!(
        text.lines()
            .all(|l| l.contains(&format!("pid {pid}")) || l.contains(" - ")),
        "{text}"
    );
    assert!(
        text.lines()
            .all(|l| l.get(..24).is_some_and(|t| t.ends_with('Z'))),
        "not UTC:\n{text}"
    );
    let all = stdout(&run(&sim, st.path(), &["timeline"]));
    assert!(all.contains(&format!("pid {other}")), "{all}");
    let future = run(
        &sim,
        st.path(),
        &["timeline", "--since", "2099-01-01T00:00:00Z"],
    );
    ok(&future);
    assert!(stdout(&future).is_empty());
    assert_eq!(
        run(&sim, st.path(), &["timeline", "--since", "yesterday-ish"])
            .status
            .code(),
        Some(2)
    );
    sim.assert_no_wedge();
}

#[test]
fn term_with_grace() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = restored_worker(&mut sim, st.path(), "4MiB");
    let (out, _) = stop_json(
        &sim,
        st.path(),
        &[&pid.to_string(), "--signal", "TERM", "--grace", "1"],
    );
    ok(&out);
    assert!(!alive(pid));
    let scan = cryo_journal::read(st.path().join("journal")).unwrap();
    assert!(
        scan.records
            .iter()
            .any(|r| matches!(r.event, Event::KillStarted { pid: p, signal: 15 } if p.pid == pid)),
        "no SIGTERM in the journal"
    );
    sim.assert_no_wedge();
}

#[test]
fn bench_stop_runs_with_tiny_workers() {
    let out = cryo()
        .args(["bench", "stop", "--memory", "8MiB", "--rounds", "2"])
        .output()
        .unwrap();
    ok(&out);
    let o = stdout(&out);
    assert!(o.contains("ratio"), "{o}");
    let rows: Vec<&str> = o.lines().filter(|l| l.trim_end().ends_with('x')).collect();
    assert_eq!(rows.len(), 3, "{o}");
    let json = cryo()
        .args([
            "bench", "stop", "--memory", "1MiB", "--rounds", "1", "--json",
        ])
        .output()
        .unwrap();
    ok(&json);
    let v: serde_json::Value = serde_json::from_slice(&json.stdout).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 3);
    assert!(v[2]["ratio"].as_f64().unwrap() > 0.0);
}

/// SIGTERM (a preStop timeout, a supervisor) while the stop waits for work in flight: the stop
/// finishes first, then cryo dies of the deferred signal. Nothing is left locked.
#[test]
fn sigterm_during_a_stop_is_deferred_until_it_is_done() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = restored_worker(&mut sim, st.path(), "4MiB");
    let (status, body) = http(port, "POST", "/busy?ms=1500", "");
    assert_eq!(status, 200, "{body}");
    let mut child = cryo_st(&sim, st.path())
        .args(["stop", &pid.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Wait until the lock is under way, then ask cryo to terminate.
    eventually(PATIENCE, "the stop to start locking", || {
        journal_types(st.path(), pid)
            .iter()
            .any(|t| t == "lock_started")
    });
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    let status = child.wait().unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(
        status.signal(),
        Some(15),
        "cryo ends by the deferred SIGTERM: {status:?}"
    );
    let types = journal_types(st.path(), pid);
    for step in ["locked", "checkpointed", "verified", "killed"] {
        assert!(
            types.iter().any(|t| t == step),
            "{step} missing from {types:?}"
        );
    }
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

/// A target that does not exist is reported as such, before any question to a driver (here
/// there is none running at all).
#[test]
fn a_missing_target_is_named_before_the_driver_is_looked_for() {
    let st = state();
    let out = cryo()
        .args([
            "--gpu",
            "sim",
            "--sim-dir",
            "/nonexistent-cryo-sim",
            "--state-dir",
        ])
        .arg(st.path())
        .args(["stop", "999999999"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("pid 999999999 does not exist"), "{err}");
    assert!(!err.contains("simulated GPU driver"), "{err}");
}

/// Issue 9 item 5, on the simulated driver (whose calls on a stopped process get no answer, as
/// the real driver's restore thread cannot run): a worker stopped by job control is resumed
/// with SIGCONT and stopped (main spent 3 x 30 s on locks, then failed); one stopped under a
/// debugger is refused at once, naming it, and keeps its context.
#[test]
fn stopped_workers_are_continued_or_refused_at_once() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, _) = sim.worker("4MiB");
    let stopped = Command::new("kill")
        .args(["-STOP", &pid.to_string()])
        .status()
        .unwrap();
    assert!(stopped.success());
    eventually(PATIENCE, "the worker to stop", || {
        procs::all_threads_in(pid, &['T'])
    });
    let (out, v) = stop_json(&sim, st.path(), &[&pid.to_string()]);
    ok(&out);
    let notes = proc_row(&v, pid)["notes"].to_string();
    assert!(notes.contains("SIGCONT"), "{v}");
    assert!(proc_row(&v, pid)["suspended"].is_object(), "{v}");
    assert!(!alive(pid));

    let (pid, _) = sim.worker("4MiB");
    let debugger = procs::Debugger::attach(pid);
    let out = run(&sim, st.path(), &["stop", &pid.to_string()]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("debugger") && stderr(&out).contains(&debugger.pid().to_string()),
        "{}",
        stderr(&out)
    );
    assert!(alive(pid));
    drop(debugger);
    sim.assert_no_wedge();
}

/// A CHECKPOINTED restored worker held by a tracer that is not cryo's (a debugger here; CRIU at
/// its dump gate holds it the same way, and its cuda plugin can restore it): no driver files,
/// nothing in NVML, and no answer from the driver, whose restore thread cannot run. `cryo stop`
/// must never take it for a plain process: refused, exit 3, naming the tracer; it lives on
/// CHECKPOINTED, and once let go a stop ends it as the CUDA process it is. No wedge.
/// Attack (session 23): the stop killed it as plain, exit 0, its row `"cuda": false` with the
/// note "stopped under a debugger, but holds no driver file".
#[test]
fn a_checkpointed_worker_held_by_a_foreign_tracer_is_never_stopped_as_plain() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, debugger) = held_checkpointed_worker(&mut sim, st.path());
    let p = pid.to_string();
    let (out, v) = stop_json(&sim, st.path(), &[&p]);
    assert_eq!(out.status.code(), Some(3), "{v}\n{}", stderr(&out));
    assert!(alive(pid), "{v}");
    let why = v["refusals"][0]["reason"].to_string();
    assert!(
        why.contains("debugger") && why.contains(&debugger.pid().to_string()),
        "{v}"
    );
    // Let go (perhaps left stopped by the attach: the stop resumes it with SIGCONT).
    drop(debugger);
    let (out, v) = stop_json(&sim, st.path(), &[&p]);
    ok(&out);
    assert_eq!(proc_row(&v, pid)["cuda"], true, "{v}");
    assert_eq!(
        proc_row(&v, pid)["suspended"]["state_before"],
        "checkpointed",
        "{v}"
    );
    assert!(!alive(pid));
    sim.assert_no_wedge();
}

/// A restored worker, locked and checkpointed through `cryo gpu`, then held by a foreign tracer
/// (a ptrace attach from perl: not cryo's). Returns its pid and the tracer.
fn held_checkpointed_worker(sim: &mut Sim, st: &Path) -> (i32, procs::Debugger) {
    let (pid, _) = restored_worker(sim, st, "4MiB");
    let p = pid.to_string();
    ok(&run(sim, st, &["gpu", "lock", "--pid", &p]));
    ok(&run(sim, st, &["gpu", "checkpoint", "--pid", &p]));
    (pid, procs::Debugger::attach(pid))
}

/// Attack (session 23): `cryo gpu state PID` of a CHECKPOINTED worker that a debugger holds
/// gets no answer from the driver. It must fail at its deadline with a hint that names the
/// tracer and what to do, and leave the worker as it was; once the tracer is gone (the worker
/// left stopped by its attach) the hint says it is stopped and how to let it answer; continued,
/// it answers "checkpointed". (Before: "cryo: error: cuCheckpointProcessGetState
/// on pid N: no answer ...", with no hint of the hold.)
#[test]
fn a_gpu_state_of_a_held_checkpointed_worker_names_its_tracer() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, debugger) = held_checkpointed_worker(&mut sim, st.path());
    let p = pid.to_string();
    let out = run(&sim, st.path(), &["gpu", "state", "--pid", &p]);
    let said = stderr(&out);
    assert!(
        !out.status.success()
            && said.contains(&format!(
                "the driver gave no answer for pid {pid} in time: it is traced by pid {}",
                debugger.pid()
            ))
            && said.contains("a debugger holds stopped gets none"),
        "{said}"
    );
    drop(debugger);
    let out = run(&sim, st.path(), &["gpu", "state", "--pid", &p]);
    let said = stderr(&out);
    assert!(
        !out.status.success()
            && said.contains("it is stopped")
            && said.contains(&format!("`kill -CONT {pid}`")),
        "{said}"
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGCONT,
    )
    .unwrap();
    let out = run(&sim, st.path(), &["gpu", "state", "--pid", &p]);
    ok(&out);
    assert!(stdout(&out).contains("checkpointed"), "{}", stdout(&out));
    sim.assert_no_wedge();
}

/// Issue 9 item 3, on the simulated driver: a driver call that never returns is a refusal
/// within the stop's deadline, never a hung `cryo stop`; `cryo gpu ps` with an NVML query that
/// never returns is an error, not a hang.
#[test]
fn a_hung_driver_is_a_refusal_not_a_hung_command() {
    let mut sim = Sim::start();
    let st = state();
    let (pid, port) = sim.worker("4MiB");
    let p = pid.to_string();
    let dir = sim.path().to_str().unwrap().to_string();
    ok(&run(
        &sim,
        st.path(),
        &[
            "sim", "inject", "--dir", &dir, "--pid", &p, "hang", "--call", "lock",
        ],
    ));
    // Not 3 s: the lock is tried only with 2.1 s of the suspension's part of the deadline
    // left, which left 300 ms for everything before it (a loaded host: refused out of time).
    let out = run(&sim, st.path(), &["stop", "--deadline", "6000", &p]);
    assert_eq!(out.status.code(), Some(3), "{}", stderr(&out));
    assert!(stderr(&out).contains("did not answer"), "{}", stderr(&out));
    assert!(alive(pid));
    ok(&run(
        &sim,
        st.path(),
        &["sim", "inject", "--dir", &dir, "release"],
    ));
    // The held lock was dropped when the stop hung up: the worker serves as before.
    assert_eq!(sim.state(pid), "running");
    serving(pid, port);
    // An NVML query that never returns: `cryo gpu ps` fails within its deadline.
    ok(&run(
        &sim,
        st.path(),
        &[
            "sim",
            "inject",
            "--dir",
            &dir,
            "hang",
            "--call",
            "processes",
        ],
    ));
    let out = run(&sim, st.path(), &["gpu", "ps"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("did not return"), "{}", stderr(&out));
    ok(&run(
        &sim,
        st.path(),
        &["sim", "inject", "--dir", &dir, "release"],
    ));
    assert!(
        journal_types(st.path(), pid).contains(&"call_abandoned".to_string()),
        "{:?}",
        journal_types(st.path(), pid)
    );
    sim.assert_no_wedge();
}

/// Issue 9 item 6, on the simulated driver: `--cgroup` takes a pod-like cgroup whole (it holds
/// no process of its own, its containers do), every worker suspended before its kill. Main
/// read only the pod's own `cgroup.procs`: "the target has no processes".
#[test]
fn a_pod_cgroup_is_stopped_with_every_container_below_it() {
    let sim = Sim::start();
    let st = state();
    let pod = cryo_testkit::cgroup::TestCgroup::new("stop-pod", 1 << 30);
    let containers: Vec<_> = ["container-a", "container-b"]
        .iter()
        .map(|c| pod.path().join(c))
        .collect();
    for c in &containers {
        std::fs::create_dir(c).unwrap();
    }
    let mut workers: Vec<Worker> = containers
        .iter()
        .map(|c| sim.spawn(WorkerSpec::new("4MiB").cgroup(c)))
        .collect();
    let (out, v) = stop_json(&sim, st.path(), &["--cgroup", pod.path().to_str().unwrap()]);
    ok(&out);
    for w in &mut workers {
        assert!(proc_row(&v, w.pid)["suspended"].is_object(), "{v}");
        w.wait_exit();
    }
    sim.assert_no_wedge();
    for c in &containers {
        eventually(PATIENCE, "the container cgroup to empty", || {
            std::fs::remove_dir(c).is_ok()
        });
    }
}

/// Issue 9 item 1, on the simulated driver: a launcher that only ran `cuInit` (a driver fd, no
/// context) with a rank per GPU below it is stopped as a whole: every process suspended or
/// ended on purpose, no live context torn down.
#[test]
fn a_tree_under_an_init_only_launcher_is_stopped_whole() {
    let sim = Sim::start();
    let st = state();
    let mut w = sim.spawn(
        WorkerSpec::new("4MiB")
            .gpus(&[0, 1])
            .process_per_gpu()
            .init_only(),
    );
    let ranks = w.children().to_vec();
    assert_eq!(ranks.len(), 2);
    let (out, v) = stop_json(&sim, st.path(), &[&w.pid.to_string()]);
    ok(&out);
    for r in &ranks {
        assert!(proc_row(&v, *r)["suspended"].is_object(), "{v}");
        assert!(!alive(*r));
    }
    assert_eq!(proc_row(&v, w.pid)["ended"], true, "{v}");
    w.wait_exit();
    sim.assert_no_wedge();
}
