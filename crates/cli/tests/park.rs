#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo park` and `cryo wake` on the simulated GPU: answers unchanged across a park and wake,
//! the GPU freed while parked, a parked worker stopped or killed (safe, ledger empty), a wake onto
//! a full GPU (refused, or onto the other GPU), a wake traced by the guard before unlock, and what
//! the timeline, metrics and status show. Each test has its own simulated driver and state.

mod common;
use common::events;

use std::path::Path;
use std::process::Output;

use common::{
    let_go, paused_at, run, stderr, stdout, AgentProc, GuardProc, Sim, Worker, WorkerSpec,
};
use cryo_journal::ProcId;

fn state() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cryo-park-state-")
        .tempdir()
        .unwrap()
}

use common::succeeded as ok;

/// `cryo wake PID` is refused because no GPU it may use has room; nothing was restored.
fn wake_refused_for_room(sim: &Sim, st: &Path, pid: i32) {
    let o = run(sim, st, &["wake", &pid.to_string()]);
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("no GPU it may use has it"),
        "{}",
        stderr(&o)
    );
    assert_eq!(sim.state(pid), "checkpointed");
}

fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", stdout(o), stderr(o)))
}

fn worker(sim: &Sim, memory: &str, gpu: u32) -> Worker {
    sim.spawn(WorkerSpec::new(memory).gpu(gpu))
}

fn park(sim: &Sim, st: &Path, pid: i32) -> serde_json::Value {
    let o = run(sim, st, &["park", &pid.to_string(), "--json"]);
    ok(&o);
    json(&o)
}

#[test]
fn park_and_wake_answer_unchanged_and_free_the_gpu_meanwhile() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    let rss_before = w.rss();

    let v = park(&sim, st.path(), w.pid);
    assert_eq!(v["outcome"], "parked");
    assert_eq!(v["parked"][0]["pid"], w.pid);
    assert_eq!(v["parked"][0]["device_bytes"], 64u64 << 20);
    assert!(!sim.listed(w.pid), "NVML still lists the parked worker");
    assert_eq!(sim.state(w.pid), "checkpointed");
    // Its host memory grew by its device memory, and status says so.
    assert!(w.rss() >= rss_before + (60 << 20), "rss {}", w.rss());
    let status = run(&sim, st.path(), &["status", "--json"]);
    ok(&status);
    let s = json(&status);
    assert_eq!(s["parked"][0]["pid"]["pid"], w.pid, "{s}");
    assert!(s["parked_host_bytes"].as_u64().unwrap() >= 64 << 20, "{s}");

    let o = run(&sim, st.path(), &["wake", &w.pid.to_string(), "--json"]);
    ok(&o);
    let v = json(&o);
    assert_eq!(v["outcome"], "serving");
    assert_eq!(v["guarded"], false);
    assert!(stderr(&o).contains("no guard runs"), "{}", stderr(&o));
    assert_eq!(sim.state(w.pid), "running");
    assert!(sim.listed(w.pid));
    assert_eq!(w.complete("the same question"), before);
    assert_eq!(w.verify()["ok"], true);

    // Nothing parked any more; the timeline and the metrics show both transitions.
    let s = json(&run(&sim, st.path(), &["status", "--json"]));
    assert_eq!(s["parked"], serde_json::json!([]), "{s}");
    let t = stdout(&run(&sim, st.path(), &["timeline"]));
    for line in [
        "park started",
        "parked",
        "park completed",
        "wake started",
        "wake completed",
    ] {
        assert!(t.contains(line), "no {line:?} in the timeline:\n{t}");
    }
    let m = stdout(&run(&sim, st.path(), &["metrics"]));
    assert!(
        m.contains("cryo_parks_total{outcome=\"completed\"} 1"),
        "{m}"
    );
    assert!(
        m.contains("cryo_wakes_total{outcome=\"completed\"} 1"),
        "{m}"
    );
    sim.assert_no_wedge();
}

/// A parked worker that was restored before (woken) is stopped: safe, ledger empty. Then one
/// parked worker is SIGKILLed while parked: nothing live to tear down, ledger empty.
#[test]
fn a_parked_worker_can_be_stopped_or_killed_safely() {
    let sim = Sim::start();
    let st = state();
    let mut a = worker(&sim, "32MiB", 0);
    park(&sim, st.path(), a.pid);
    ok(&run(&sim, st.path(), &["wake", &a.pid.to_string()]));
    // Woken, it is a restored process now; parked again, a stop needs no new suspension.
    park(&sim, st.path(), a.pid);
    let o = run(&sim, st.path(), &["stop", &a.pid.to_string(), "--json"]);
    ok(&o);
    assert_eq!(json(&o)["outcome"], "stopped");
    a.wait_exit();

    let mut b = worker(&sim, "32MiB", 0);
    park(&sim, st.path(), b.pid);
    ok(&run(&sim, st.path(), &["wake", &b.pid.to_string()]));
    park(&sim, st.path(), b.pid);
    b.sigkill();
    b.wait_exit();
    sim.assert_no_wedge();
    let s = json(&run(&sim, st.path(), &["status", "--json"]));
    assert_eq!(s["parked"], serde_json::json!([]), "{s}");
}

/// The GPU it left is full now: the wake refuses (exit 3, still parked, nothing restored), or
/// with `--when-full other-gpu` lands on the other GPU, answers unchanged.
#[test]
fn wake_onto_a_full_gpu_refuses_or_takes_another() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "600MiB", 0);
    let before = w.complete("q");
    park(&sim, st.path(), w.pid);
    let _squatter = worker(&sim, "600MiB", 0);

    wake_refused_for_room(&sim, st.path(), w.pid);

    let o = run(
        &sim,
        st.path(),
        &[
            "wake",
            &w.pid.to_string(),
            "--when-full",
            "other-gpu",
            "--json",
        ],
    );
    ok(&o);
    let v = json(&o);
    let gpus = sim.gpu.inspect.gpus().unwrap();
    assert_eq!(v["woken"][0]["gpus"][0], gpus[1].uuid.to_string(), "{v}");
    assert_eq!(w.complete("q"), before);
    sim.assert_no_wedge();
}

/// With a guard running, the woken process is traced while still LOCKED: the journal has the
/// guard's attach between the restore and the unlock.
#[test]
fn a_wake_is_traced_by_the_guard_before_the_unlock() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "16MiB", 0);
    park(&sim, st.path(), w.pid);
    let _guard = GuardProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let o = run(&sim, st.path(), &["wake", &w.pid.to_string(), "--json"]);
    ok(&o);
    assert_eq!(json(&o)["guarded"], true);
    let id = ProcId::of(w.pid).unwrap();
    let steps: Vec<&str> = events(st.path())
        .iter()
        .filter(|e| e.proc() == Some(id))
        .map(|e| e.label())
        .collect();
    let at = |l: &str| {
        steps
            .iter()
            .rposition(|s| *s == l)
            .unwrap_or_else(|| panic!("no {l}: {steps:?}"))
    };
    assert!(at("restore completed") < at("guard attached"), "{steps:?}");
    assert!(at("guard attached") < at("unlocked"), "{steps:?}");
    assert_ne!(
        common::procs::tracer_pid(w.pid),
        0,
        "the woken worker is not traced"
    );
    sim.assert_no_wedge();
}

/// Attack: a later `cryo stop` of another worker settles suspensions that died half-way. A
/// finished park is not one of them: the parked worker stays parked (not killed, not resumed).
#[test]
fn a_parked_worker_is_not_settled_by_a_later_stop_of_another() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "16MiB", 0);
    let before = w.complete("q");
    park(&sim, st.path(), w.pid);
    let other = worker(&sim, "16MiB", 1);
    ok(&run(&sim, st.path(), &["stop", &other.pid.to_string()]));
    assert!(common::procs::alive(w.pid), "the parked worker was killed");
    assert_eq!(sim.state(w.pid), "checkpointed");
    ok(&run(&sim, st.path(), &["wake", &w.pid.to_string()]));
    assert_eq!(w.complete("q"), before);
    sim.assert_no_wedge();
}

/// `cryo park` and `cryo wake` go through a running agent (its log, no standalone note), the
/// wake is traced by the agent's guard before its unlock, the answers are unchanged, and a
/// refusal through the agent is the same refusal (exit 3) as standalone.
#[test]
fn park_and_wake_go_through_the_agent_and_its_guard_traces_the_wake() {
    let sim = Sim::start();
    let st = state();
    let agent = AgentProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("through the agent");
    let o = run(&sim, st.path(), &["park", &w.pid.to_string(), "--json"]);
    ok(&o);
    assert!(!stderr(&o).contains("working standalone"), "{}", stderr(&o));
    assert_eq!(json(&o)["parked"][0]["pid"], w.pid);
    assert_eq!(sim.state(w.pid), "checkpointed");
    assert!(agent.log().contains("park"), "{}", agent.log());

    // A full GPU: refused through the agent as standalone, nothing restored.
    let hog = worker(&sim, "1000MiB", 0);
    wake_refused_for_room(&sim, st.path(), w.pid);
    drop(hog);

    let o = run(&sim, st.path(), &["wake", &w.pid.to_string(), "--json"]);
    ok(&o);
    assert!(!stderr(&o).contains("no guard runs"), "{}", stderr(&o));
    assert_eq!(json(&o)["guarded"], true);
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "not traced");
    assert_eq!(w.complete("through the agent"), before);
    sim.assert_no_wedge();
    drop(agent);
    common::stop_pin_holder(st.path());
}

/// `cryo park` of `w` with failpoint `failpoint` set: it fails, and `w` serves as before
/// (running, its context on the GPU, the same answer).
fn park_failing_at(sim: &Sim, st: &Path, w: &Worker, failpoint: &str) -> Output {
    let before = w.complete("the same question");
    let o = sim
        .cmd_at(st)
        .env("CRYO_FAILPOINT", failpoint)
        .args(["park", &w.pid.to_string()])
        .output()
        .unwrap();
    assert!(!o.status.success(), "parked unrecorded: {}", stdout(&o));
    assert_eq!(sim.state(w.pid), "running", "{}", stderr(&o));
    assert!(
        sim.listed(w.pid),
        "its context is not on the GPU: {}",
        stderr(&o)
    );
    assert_eq!(w.complete("the same question"), before);
    o
}

/// A park that cannot record its suspension's intent (the journal's `fdatasync` fails: EIO,
/// failpoint) fails closed: it fails before the driver is touched, nothing locked or recorded
/// as parked, the worker serves on, on the GPU it had.
#[test]
fn a_park_that_cannot_be_recorded_never_locks_and_the_worker_serves_on() {
    use cryo_journal::Event;
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let o = park_failing_at(&sim, st.path(), &w, cryo_journal::SYNC_FAILPOINT);
    assert!(stderr(&o).contains("Input/output error"), "{}", stderr(&o));
    // Every record was written (only the syncs failed): none says it was locked or parked.
    let touched = events(st.path()).into_iter().filter(|e| {
        matches!(e, Event::Locked { pid: p, .. } | Event::Checkpointed { pid: p, .. } | Event::Parked { pid: p, .. } if p.pid == w.pid)
    });
    assert_eq!(touched.count(), 0, "the worker was touched");
    sim.assert_no_wedge();
}

/// Attack (session 17): a park whose `Parked` record cannot be written after the suspension
/// (failpoint: the first `Parked` append fails with EIO). The record is what a wake, `cryo
/// status` and the agent find a parked worker by: without it the worker was left CHECKPOINTED
/// and unfound, no longer serving. It must end serving again (resumed in place and unlocked),
/// the error saying so, and nothing recorded as parked. (Before: the park returned the
/// journal's error and the worker stayed CHECKPOINTED: this test failed with state
/// "checkpointed".)
#[test]
fn a_park_whose_record_cannot_be_written_resumes_the_worker_and_says_so() {
    use cryo_journal::Event;
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let o = park_failing_at(&sim, st.path(), &w, cryo_lifecycle::park::PARK_RECORD_FAILS);
    assert!(
        stderr(&o).contains("could not be recorded")
            && stderr(&o).contains("the worker serves again"),
        "{}",
        stderr(&o)
    );
    let ev = events(st.path());
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::Parked { pid, .. } if pid.pid == w.pid)),
        "{ev:?}"
    );
    assert!(
        ev.iter()
            .any(|e| matches!(e, Event::Unlocked { pid, .. } if pid.pid == w.pid)),
        "the resume is not journaled: {ev:?}"
    );
    let s = json(&run(&sim, st.path(), &["status", "--json"]));
    assert_eq!(s["parked"], serde_json::json!([]), "{s}");
    sim.assert_no_wedge();
}

/// A guard started on `st` resumes `w`, which a park left suspended, in place under watch (traced),
/// and it answers `before` again.
fn a_guard_resumes(sim: &Sim, st: &Path, w: &Worker, before: &str) -> GuardProc {
    resumed_by(sim, w, before, || {
        GuardProc::start(sim, st, &["--no-memory-watch"])
    })
}

/// What `start` starts (a guard or an agent on the state directory of `w`'s park) resumes `w`,
/// which a park left suspended, in place under watch (traced), and it answers `before` again.
fn resumed_by<T>(sim: &Sim, w: &Worker, before: &str, start: impl FnOnce() -> T) -> T {
    let watcher = start();
    common::eventually(
        cryo_testkit::PATIENCE,
        "the new guard or agent to resume the worker",
        || sim.state(w.pid) == "running",
    );
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "resumed unguarded");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    watcher
}

/// What an operator reads of the processes a park's undo could not bring back: what happens to
/// them next (they stay suspended until the next guard or agent start resumes them under watch;
/// `cryo stop` ends one), never a manual `cryo gpu restore`/`unlock` (what it said before
/// session 20, though the next guard resumes them, and an unlock by hand is not watched).
fn says_what_happens_next(said: &str) {
    assert!(
        said.contains("stay suspended")
            && said.contains(
                "until the next start of the guard or agent, which resumes each under watch"
            )
            && said.contains("`cryo stop PID` ends one safely")
            && !said.contains("cryo gpu"),
        "{said}"
    );
}

/// `cryo ARGS` on the state directory `st` (on `disk`, a small tmpfs), paused at pausing
/// failpoint `failpoint`; there `at_pause` looks at the world (given what cryo said so far), the
/// disk and the journal's last page are filled (a real `ENOSPC` from then on), and cryo goes on
/// to its end. Returns how it ended, all it said, and the filler (remove it: room again).
fn filled_at(
    sim: &Sim,
    disk: &cryo_testkit::disk::SmallDisk,
    st: &Path,
    failpoint: &str,
    args: &[&str],
    at_pause: impl FnOnce(&str),
) -> (std::process::ExitStatus, String, std::path::PathBuf) {
    use std::io::Read;
    let go = st.with_file_name("go");
    let mut cryo = sim
        .cmd_at(st)
        .env("CRYO_FAILPOINT", failpoint)
        .env("CRYO_FAILPOINT_RESUME", &go)
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = cryo.stderr.take().unwrap();
    let mut said = common::said_until(&mut err, "paused until");
    at_pause(&said);
    let filler = disk.fill();
    common::fill_journal_page(st);
    std::fs::write(&go, b"").unwrap();
    err.read_to_string(&mut said).unwrap();
    (cryo.wait().unwrap(), said, filler)
}

/// Attack (session 19): a park whose disk fills between its suspension and its `Parked` record
/// (a real `ENOSPC`: the state directory on a small tmpfs, filled while the park is paused
/// there, the journal's last page too). Nothing can be written from then on, the undo's restore
/// intent included: the worker must be left suspended (CHECKPOINTED, never torn down, never
/// LOCKED) and named, with nothing recorded as parked; its suspension is in flight in the
/// journal, so once there is room again the next guard's start resumes it in place under watch,
/// and it serves as before. No record lost, no half state left for good.
#[test]
fn a_park_meeting_a_full_disk_before_its_record_leaves_the_worker_suspended_then_resumed() {
    let sim = Sim::start();
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    let (status, said, filler) = filled_at(
        &sim,
        &disk,
        &st,
        cryo_lifecycle::park::PARK_BEFORE_RECORD,
        &["park", &w.pid.to_string()],
        |_| {},
    );
    assert!(!status.success(), "parked on a full disk: {said}");
    assert_eq!(sim.state(w.pid), "checkpointed", "{said}");
    assert!(said.contains("could not be recorded"), "{said}");
    says_what_happens_next(&said);
    assert!(
        said.contains(&format!("pid {}:", w.pid)),
        "not named: {said}"
    );
    sim.assert_no_wedge();

    // Room again: a guard that starts now settles the park the full disk left in flight.
    std::fs::remove_file(filler).unwrap();
    let guard = a_guard_resumes(&sim, &st, &w, &before);
    let ev = events(&st);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, cryo_journal::Event::Parked { pid, .. } if pid.pid == w.pid)),
        "recorded as parked: {ev:?}"
    );
    let s = json(&run(&sim, &st, &["status", "--json"]));
    assert_eq!(s["parked"], serde_json::json!([]), "{s}");
    sim.assert_no_wedge();
    drop(guard);
    drop(disk);
}

/// A guard that starts resumes `w` (see [`a_guard_resumes`]) and journals the settlement of its
/// suspension (`found`, `action`): nothing is left parked, no wedge. Returns the guard and the
/// journal's events.
fn a_guard_settles(
    sim: &Sim,
    st: &Path,
    w: &Worker,
    before: &str,
    settled: (&str, &str),
) -> (GuardProc, Vec<cryo_journal::Event>) {
    settles_by(sim, st, w, before, settled, || {
        GuardProc::start(sim, st, &["--no-memory-watch"])
    })
}

/// What `start` starts (a guard or an agent) resumes `w` ([`resumed_by`]) and journals the
/// settlement of its suspension (`found`, `action`): nothing is left parked, no wedge. Returns
/// what it started and the journal's events.
fn settles_by<T>(
    sim: &Sim,
    st: &Path,
    w: &Worker,
    before: &str,
    (found, action): (&str, &str),
    start: impl FnOnce() -> T,
) -> (T, Vec<cryo_journal::Event>) {
    let watcher = resumed_by(sim, w, before, start);
    let ev = events(st);
    assert!(
        ev.iter().any(|e| matches!(
            e,
            cryo_journal::Event::SuspensionSettled { pid, found: f, action: a }
                if pid.pid == w.pid && f == found && a == action
        )),
        "the settlement ({found}: {action}) is not journaled: {ev:?}"
    );
    let s = json(&run(sim, st, &["status", "--json"]));
    assert_eq!(s["parked"], serde_json::json!([]), "{s}");
    sim.assert_no_wedge();
    (watcher, ev)
}

/// `cryo COMMAND W` at the stalling failpoint `failpoint` (no resume file), found with `w`
/// LOCKED there, then SIGKILLed: what the OOM killer or a restarted node agent leaves.
fn killed_locked_at(sim: &Sim, st: &Path, w: &Worker, failpoint: &str, command: &str) {
    let mut cryo = sim
        .cmd_at(st)
        .env("CRYO_FAILPOINT", failpoint)
        .args([command, &w.pid.to_string()])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = cryo.stderr.take().unwrap();
    let said = common::said_until(&mut err, "stalling until killed");
    assert_eq!(sim.state(w.pid), "locked", "{said}");
    cryo.kill().unwrap();
    cryo.wait().unwrap();
}

/// The journal of a park whose undo restored `w` and did not record it: the restore's intent,
/// and no completion, no `Parked`, no unlock.
fn only_the_undos_intent(st: &Path, w: &Worker) {
    use cryo_journal::Event;
    let ev = events(st);
    let mine = |e: &Event| e.pids().iter().any(|p| p.pid == w.pid);
    assert!(
        ev.iter()
            .any(|e| mine(e) && matches!(e, Event::RestoreStarted { .. }))
            && !ev.iter().any(|e| mine(e)
                && matches!(
                    e,
                    Event::RestoreCompleted { .. } | Event::Parked { .. } | Event::Unlocked { .. }
                )),
        "not the journal of an undo that could not record its restore: {ev:?}"
    );
}

/// A stop of another worker: it has no guard to watch a resume, so it leaves `w` as it is
/// (`state`), says it is left until watched, and must not close its suspension for the guard
/// after it (no `SuspensionSettled`).
fn a_stop_leaves_it_until_watched(sim: &Sim, st: &Path, w: &Worker, state: &str) {
    let other = worker(sim, "16MiB", 1);
    let o = run(sim, st, &["stop", "--json", &other.pid.to_string()]);
    ok(&o);
    let v = json(&o);
    assert!(
        v["settled"].as_array().is_some_and(|s| s
            .iter()
            .any(|s| s["pid"]["pid"] == w.pid && s["action"]["kind"] == "until_watched")),
        "{v}"
    );
    assert_eq!(sim.state(w.pid), state);
    assert!(
        !events(st).iter().any(|e| matches!(
            e,
            cryo_journal::Event::SuspensionSettled { pid, .. } if pid.pid == w.pid
        )),
        "a stop closed what it could not settle"
    );
}

/// Attack (session 19): a park whose `Parked` record is refused, and then its undo's
/// `RestoreCompleted` too, its `RestoreStarted` taken (failpoint: both appends fail with EIO, as
/// two transient write errors of a real disk do; a full disk cannot, each refused append leaves
/// a torn frame whose repair the next append must write first). The undo checkpoints the worker
/// again: CHECKPOINTED, with a restore intent that ended its suspension in the journal's eyes.
/// The park must fail naming it, never tear it down nor leave it LOCKED; a stop of another
/// worker (no guard) leaves it suspended; a guard that starts (the park gone) must resume it in
/// place under watch, journaled, and it serves as before.
/// (Before: nothing settled it: the guard's start found no suspension in flight and
/// `finish_unlock` refused a restore not journaled as completed; this test failed waiting for
/// the worker to run, the driver saying "checkpointed".)
#[test]
fn a_park_whose_undo_cannot_record_its_restore_is_resumed_by_the_next_guard() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    let o = sim
        .cmd_at(st.path())
        .env("CRYO_FAILPOINT", cryo_lifecycle::park::PARK_UNDO_UNRECORDED)
        .args(["park", &w.pid.to_string()])
        .output()
        .unwrap();
    assert!(!o.status.success(), "parked unrecorded: {}", stdout(&o));
    assert_eq!(sim.state(w.pid), "checkpointed", "{}", stderr(&o));
    assert!(
        stderr(&o).contains("could not be recorded")
            && stderr(&o).contains(&format!("pid {}:", w.pid)),
        "{}",
        stderr(&o)
    );
    says_what_happens_next(&stderr(&o));
    only_the_undos_intent(st.path(), &w);
    sim.assert_no_wedge();

    // A stop of another worker first (before: journaled as settled, no guard would have
    // resumed it).
    a_stop_leaves_it_until_watched(&sim, st.path(), &w, "checkpointed");

    let (guard, _) = a_guard_settles(&sim, st.path(), &w, &before, ("checkpointed", "resumed"));
    drop(guard);
}

/// A park of a new worker killed between its undo's driver restore and that restore's
/// `RestoreCompleted` (failpoint `park-undo-dies-restored`, its `Parked` record refused first):
/// the worker LOCKED, the journal holding only the undo's intent, no wedge. Returns the scene,
/// its state directory, the worker and its answer before.
fn a_park_killed_mid_undo() -> (Sim, tempfile::TempDir, Worker, String) {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    killed_locked_at(
        &sim,
        st.path(),
        &w,
        cryo_lifecycle::park::PARK_UNDO_DIES_RESTORED,
        "park",
    );
    only_the_undos_intent(st.path(), &w);
    sim.assert_no_wedge();
    (sim, st, w, before)
}

/// Attack (session 20): a park killed between its undo's driver restore and that restore's
/// `RestoreCompleted` (its `Parked` record refused first; the OOM killer or a restarted node
/// agent ends a park the same way). The worker is LOCKED, its context restored and live, and the
/// journal holds only the undo's restore intent, its writer gone. A stop of another worker has
/// no guard to watch an unlock: it leaves the worker as it is, says so, and must keep it in
/// flight. A guard that starts then must not leave it LOCKED for good, nor unlock what the
/// driver has not confirmed whole: it checkpoints it again (the driver does that only for a
/// whole context; LOCKED -> CHECKPOINTED), restores it under its own journaled intent, traces it
/// and unlocks it. It serves as before; no wedge.
#[test]
fn a_park_killed_between_its_undos_restore_and_its_record_is_resumed_by_the_next_guard() {
    let (sim, st, w, before) = a_park_killed_mid_undo();
    a_stop_leaves_it_until_watched(&sim, st.path(), &w, "locked");

    let from = events(st.path()).len();
    let (guard, ev) = a_guard_settles(
        &sim,
        st.path(),
        &w,
        &before,
        ("locked", "checkpointed again, then resumed"),
    );
    common::checkpointed_restored_then_unlocked(&ev[from..], w.pid);
    drop(guard);
}

/// Attack (session 21): the same park killed between its undo's driver restore and that
/// restore's record (the worker LOCKED, its context restored and live, the journal holding only
/// the undo's intent), settled this time by the node agent's start (`cryo agent run`: its
/// embedded guard settles what is in flight before it serves), which session 20 attacked only
/// through `cryo guard`. The agent must neither leave it LOCKED for good nor unlock it on the
/// driver's word: checkpointed again, restored under its own intent, traced by the agent, then
/// unlocked; it serves as before, nothing parked, no wedge. (It held on main: the agent's start
/// goes through the same `Guard::start` and `settle_in_flight`; now pinned end to end.)
#[test]
fn a_park_killed_between_its_undos_restore_and_its_record_is_resumed_by_the_next_agent() {
    let (sim, st, w, before) = a_park_killed_mid_undo();

    let from = events(st.path()).len();
    let (agent, ev) = settles_by(
        &sim,
        st.path(),
        &w,
        &before,
        ("locked", "checkpointed again, then resumed"),
        || AgentProc::start(&sim, st.path(), &["--no-memory-watch"]),
    );
    common::checkpointed_restored_then_unlocked(&ev[from..], w.pid);
    let tracer = common::procs::tracer_pid(w.pid);
    assert_eq!(
        cryo_proc::tgid(tracer).ok().flatten(),
        Some(agent.pid()),
        "not traced by the agent"
    );
    drop(agent);
    common::stop_pin_holder(st.path());
}

/// Attack (session 20): a wake whose disk fills between the driver's restore and its
/// `RestoreCompleted` (a real `ENOSPC`: the state directory on a 16 MiB tmpfs, filled while the
/// wake is paused there, the journal's last page too). The worker is LOCKED then, its context
/// restored and live, and the journal cannot say so: it must not be left LOCKED with a record
/// that says less than what happened, nor torn down. It must be checkpointed again and named,
/// and stay parked; once there is room, `cryo wake` brings it back and it serves as before. No
/// wedge at any point.
#[test]
fn a_wake_meeting_a_full_disk_after_its_restore_leaves_the_worker_parked_then_wakes() {
    a_wake_on_a_disk_filled_at(
        cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED,
        "locked",
        |_, _, _| {},
    );
}

/// `cryo wake` of a parked worker whose disk (the state directory on a 16 MiB tmpfs, the
/// journal's last page too) fills at the pausing failpoint `failpoint`, where the worker is
/// `at_pause`: the wake fails naming the worker and the disk, the worker is CHECKPOINTED (never
/// left LOCKED, never torn down), no wedge, and `check` looks at what it said and the state
/// directory. Room again: the worker is still parked, and a wake brings it back with the same
/// answer.
fn a_wake_on_a_disk_filled_at(
    failpoint: &str,
    at_pause: &str,
    check: impl FnOnce(&str, &Path, i32),
) {
    let sim = Sim::start();
    let t = tempfile::tempdir().unwrap();
    let st = t.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    ok(&run(&sim, &st, &["park", &w.pid.to_string()]));
    let (status, said, filler) = filled_at(
        &sim,
        &disk,
        &st,
        failpoint,
        &["wake", &w.pid.to_string()],
        |said| assert_eq!(sim.state(w.pid), at_pause, "{said}"),
    );
    assert!(!status.success(), "woke on a full disk: {said}");
    assert_eq!(sim.state(w.pid), "checkpointed", "{said}");
    assert!(
        said.contains(&format!("pid {}", w.pid)) && said.contains("No space left on device"),
        "not named: {said}"
    );
    check(&said, &st, w.pid);
    sim.assert_no_wedge();

    // Room again: still parked, and a wake brings it back.
    std::fs::remove_file(filler).unwrap();
    let s = json(&run(&sim, &st, &["status", "--json"]));
    assert_eq!(s["parked"][0]["pid"]["pid"], w.pid, "{s}");
    ok(&run(&sim, &st, &["wake", &w.pid.to_string()]));
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    sim.assert_no_wedge();
    drop(disk);
}

/// Attack (session 21): a wake whose disk fills after it read the worker's state and before its
/// restore's intent (a real `ENOSPC`: paused at `wake-before-restore`, the state directory's
/// 16 MiB tmpfs filled there, the journal's last page too). The intent cannot be journaled, so
/// nothing may be restored: the wake fails naming the disk, the worker stays CHECKPOINTED and
/// parked (never LOCKED, never torn down, never journaled as restored); once there is room a
/// wake brings it back with the same answer. (It held on main: `restore_context` journals its
/// intent before the driver is asked; now pinned.)
#[test]
fn a_wake_meeting_a_full_disk_before_its_restore_restores_nothing_then_wakes() {
    a_wake_on_a_disk_filled_at(
        cryo_lifecycle::park::WAKE_BEFORE_RESTORE,
        "checkpointed",
        |said, st, pid| {
            assert!(said.contains("was not restored"), "{said}");
            assert!(
                !events(st).iter().any(|e| matches!(
                    e,
                    cryo_journal::Event::RestoreStarted { pid: p, .. } if p.pid == pid
                )),
                "journaled as restored"
            );
        },
    );
}

/// Attack (session 20): a wake killed between the driver's restore and its `RestoreCompleted`
/// (failpoint `restore-before-completed`, then SIGKILL): the worker is LOCKED and still parked,
/// the journal holding only the restore's intent. A second `cryo wake` must not unlock it on the
/// driver's LOCKED alone (as it may after a wake that died past its record): it checkpoints it
/// again and restores it itself (journaled), then traces and unlocks it. It serves as before;
/// no wedge.
#[test]
fn a_wake_killed_before_recording_its_restore_is_woken_again_through_a_new_checkpoint() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &w.pid.to_string()]));
    killed_locked_at(
        &sim,
        st.path(),
        &w,
        cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED,
        "wake",
    );
    let killed_at = events(st.path()).len();

    ok(&run(&sim, st.path(), &["wake", &w.pid.to_string()]));
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    common::checkpointed_restored_then_unlocked(&events(st.path())[killed_at..], w.pid);
    sim.assert_no_wedge();
}

/// A park whose process cannot be suspended (its context faulted: a sticky error, the lock
/// fails at once) fails closed: the worker keeps its context on the GPU (never torn down, never
/// left locked), the failure is journaled and nothing is recorded as parked.
#[test]
fn a_park_that_cannot_suspend_its_worker_leaves_it_running_and_unparked() {
    use cryo_journal::Event;
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    sim.control.inject_sticky(w.pid).unwrap();
    let o = run(&sim, st.path(), &["park", &w.pid.to_string()]);
    assert!(
        !o.status.success(),
        "parked a faulted context: {}",
        stdout(&o)
    );
    assert_eq!(sim.state(w.pid), "running", "{}", stderr(&o));
    assert!(
        sim.listed(w.pid),
        "its context left the GPU: {}",
        stderr(&o)
    );
    let ev = events(st.path());
    assert!(
        ev.iter().any(|e| matches!(e, Event::ParkFailed { .. })),
        "{ev:?}"
    );
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::Parked { pid, .. } if pid.pid == w.pid)),
        "{ev:?}"
    );
    sim.assert_no_wedge();
}

/// How two wakes of one worker at once ended: exactly one woke it, the other was refused
/// because the first was at work on it (never a driver error, never a failed wake that parks it
/// again). `first` and `second` are each one's status and all it said.
fn one_woke_and_the_other_said_it_was_at_work(
    w: &Worker,
    (first, first_said): (std::process::ExitStatus, String),
    (second, second_said): (std::process::ExitStatus, String),
) {
    assert!(first.success(), "the first wake failed: {first_said}");
    assert_eq!(
        second.code(),
        Some(3),
        "the second wake was not refused: {second_said}"
    );
    assert!(
        second_said.contains(&format!("pid {} is being woken by cryo pid", w.pid))
            && !second_said.contains("ILLEGAL")
            && !second_said.contains("driver"),
        "{second_said}"
    );
}

/// The first of two wakes of `w` (paused, `first`: the child and its stderr) let go (its resume
/// file `st/go` written) after the `second` ended: exactly one woke `w`, the other said the first
/// was at work ([`one_woke_and_the_other_said_it_was_at_work`]), `w` runs and answers `before`,
/// restored once ([`restored_once`]).
fn the_first_let_go_wakes_it_once(
    sim: &Sim,
    st: &Path,
    w: &Worker,
    (mut first, mut err): (std::process::Child, std::process::ChildStderr),
    second: &Output,
    before: &str,
) {
    use std::io::Read;
    std::fs::write(st.join("go"), b"").unwrap();
    let mut first_said = String::new();
    err.read_to_string(&mut first_said).unwrap();
    let status = first.wait().unwrap();
    one_woke_and_the_other_said_it_was_at_work(
        w,
        (status, first_said),
        (second.status, stderr(second)),
    );
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    restored_once(st, w);
}

/// The journal of `st` shows `w` restored once since its park (one `RestoreStarted`, one
/// `RestoreCompleted`, one `Unlocked`), nothing stopped or killed, and nothing parked again.
fn restored_once(st: &Path, w: &Worker) {
    use cryo_journal::Event;
    let ev = events(st);
    let parked = ev
        .iter()
        .rposition(|e| matches!(e, Event::Parked { pid, .. } if pid.pid == w.pid))
        .unwrap();
    let mine: Vec<&Event> = ev[parked + 1..]
        .iter()
        .filter(|e| e.pids().iter().any(|p| p.pid == w.pid))
        .collect();
    let count = |f: &dyn Fn(&Event) -> bool| mine.iter().filter(|e| f(e)).count();
    assert_eq!(
        (
            count(&|e| matches!(e, Event::RestoreStarted { .. })),
            count(&|e| matches!(e, Event::RestoreCompleted { .. })),
            count(&|e| matches!(e, Event::Unlocked { .. })),
            count(&|e| matches!(
                e,
                Event::SuspendStarted { .. } | Event::KillStarted { .. } | Event::Killed { .. }
            )),
        ),
        (1, 1, 1, 0),
        "{mine:?}"
    );
}

/// Attack (session 21): two `cryo wake` of one parked worker at once, the first paused after it
/// read the worker's state (CHECKPOINTED) and before its restore (failpoint
/// `wake-before-restore`), the second run meanwhile. Exactly one may restore it; the other must
/// say the wake is in progress (refused, nothing restored), not fail with the driver's
/// ILLEGAL_STATE; nothing is torn down or parked again. A wake after both finds it running and
/// says so. (Before: both read CHECKPOINTED; the second restored, traced and unlocked it, and
/// the first, let go, asked the driver to restore a RUNNING worker: this test failed with the
/// second wake exiting 0 and the first failing "GPU restore failed: pid N: ... ILLEGAL_STATE".)
#[test]
fn two_wakes_at_once_restore_once_and_the_second_says_the_first_is_at_work() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &w.pid.to_string()]));
    let (first, err) = common::a_wake_paused_before_its_restore(&sim, st.path(), w.pid, None);
    let second = run(&sim, st.path(), &["wake", &w.pid.to_string()]);
    the_first_let_go_wakes_it_once(&sim, st.path(), &w, (first, err), &second, &before);

    let again = run(&sim, st.path(), &["wake", &w.pid.to_string()]);
    ok(&again);
    assert!(
        stdout(&again).contains("already runs"),
        "{}",
        stdout(&again)
    );
    restored_once(st.path(), &w);
    sim.assert_no_wedge();
}

/// The same attack through the agent: two wakes of one parked worker reach it at once (two
/// `cryo wake`, each a request to the agent), the agent's first paused before its restore. One
/// restores it (traced by the agent's guard), the other is refused at once saying the first is at
/// work. (Before: both requests paused at the failpoint, both having read CHECKPOINTED; let go,
/// one failed with the driver's ILLEGAL_STATE.)
#[test]
fn two_wakes_at_once_through_the_agent_restore_once() {
    let sim = Sim::start();
    let st = state();
    let go = st.path().join("go");
    let agent = AgentProc::start_with(&sim, st.path(), &["--no-memory-watch"], |c| {
        c.env("CRYO_FAILPOINT", cryo_lifecycle::park::WAKE_BEFORE_RESTORE)
            .env("CRYO_FAILPOINT_RESUME", &go);
    });
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &w.pid.to_string()]));
    let (first, err) =
        common::a_wake_paused_before_its_restore(&sim, st.path(), w.pid, Some(&agent));
    // The second in the background: before the fix it paused at the failpoint too.
    let mut second = sim
        .cmd_at(st.path())
        .args(["wake", &w.pid.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let failpoint = format!(
        "failpoint {} reached",
        cryo_lifecycle::park::WAKE_BEFORE_RESTORE
    );
    common::eventually(
        cryo_testkit::PATIENCE,
        "the second wake to end or reach the failpoint",
        || matches!(second.try_wait(), Ok(Some(_))) || agent.log().matches(&failpoint).count() > 1,
    );
    std::fs::write(&go, b"").unwrap();
    let second = second.wait_with_output().unwrap();
    the_first_let_go_wakes_it_once(&sim, st.path(), &w, (first, err), &second, &before);
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "not traced");
    sim.assert_no_wedge();
    drop(agent);
    common::stop_pin_holder(st.path());
}

/// `second` was refused at once (exit 3) because cryo pid `by` is `doing` `w`: never a driver
/// error.
fn refused_as_in_progress(w: &Worker, second: &Output, doing: &str, by: u32) {
    let said = stderr(second);
    assert_eq!(
        second.status.code(),
        Some(3),
        "not refused: {said}{}",
        stdout(second)
    );
    assert!(
        said.contains(&format!("pid {} is being {doing} by cryo pid {by}", w.pid))
            && !said.contains("ILLEGAL"),
        "{said}"
    );
}

/// Attack (session 22): a `cryo park` of a worker whose wake is at work on it: paused before its
/// restore (`wake-before-restore`: it read the worker CHECKPOINTED) or between its restore and
/// its unlock (`restore-before-completed`: the context restored, LOCKED, its restore's intent
/// journaled). The park must be refused at once naming the wake, touching nothing (the worker
/// stays as the wake has it); the wake, let go, brings it back: it runs and serves as before,
/// restored once, never parked again; no wedge. (Before: paused before the restore, the park
/// said it parked the worker, already parked, and the wake then woke it: a park that
/// "succeeded" on a worker left running; paused before the unlock, the park checkpointed the
/// restored context under the wake, exiting 0, and the wake then failed "unlock failed: pid N:
/// cuCheckpointProcessUnlock on pid N failed: CUDA_ERROR_ILLEGAL_STATE (...); the restored
/// processes were parked again".)
#[test]
fn a_park_meeting_a_wake_at_work_is_refused_and_the_wake_wakes() {
    meets_a_wake_at_work("park");
}

/// A `cryo OP` of a parked worker whose wake is paused before its restore
/// (`wake-before-restore`: CHECKPOINTED) or between its restore and its unlock
/// (`restore-before-completed`: LOCKED, restored): OP is refused at once naming the wake,
/// touching nothing; the wake, let go, brings the worker back serving as before, restored once;
/// no wedge.
fn meets_a_wake_at_work(op: &str) {
    for (failpoint, found) in [
        (cryo_lifecycle::park::WAKE_BEFORE_RESTORE, "checkpointed"),
        (cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED, "locked"),
    ] {
        let sim = Sim::start();
        let st = state();
        let w = worker(&sim, "64MiB", 0);
        let pid = w.pid.to_string();
        let before = w.complete("the same question");
        ok(&run(&sim, st.path(), &["park", &pid]));
        let wake = paused_at(&sim, st.path(), &["wake", &pid], failpoint);
        let by = wake.0.id();
        assert_eq!(sim.state(w.pid), found, "{failpoint}");
        let second = run(&sim, st.path(), &[op, &pid]);
        refused_as_in_progress(&w, &second, "woken", by);
        assert_eq!(sim.state(w.pid), found, "{failpoint}: the {op} touched it");
        let (status, said) = let_go(st.path(), wake);
        assert!(status.success(), "{failpoint}: the wake failed: {said}");
        assert_eq!(sim.state(w.pid), "running", "{failpoint}");
        assert_eq!(
            w.complete("the same question"),
            before,
            "{failpoint}: it serves as before"
        );
        restored_once(st.path(), &w);
        sim.assert_no_wedge();
    }
}

/// Attack (session 22): a `cryo wake` of a worker (parked and woken before: its last restore is
/// journaled complete) whose park is between its lock and its checkpoint (paused at
/// `suspend-after-lock`, made a pause for this: LOCKED, nothing checkpointed). The wake must be
/// refused at once naming the park, touching nothing (the worker stays LOCKED for the park);
/// the park, let go, parks it; a wake then brings it back, serving as before; no wedge.
/// (Before: the wake was refused for the wrong reason, with advice that would have restored the
/// worker under the park: "refused: pid N was not parked by cryo (no record of its device
/// memory); restore it with `cryo gpu restore`; nothing was restored".)
#[test]
fn a_wake_meeting_a_park_before_its_checkpoint_is_refused_and_the_park_parks() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &pid]));
    ok(&run(&sim, st.path(), &["wake", &pid]));
    let park = paused_at(
        &sim,
        st.path(),
        &["park", &pid],
        cryo_lifecycle::suspend::SUSPEND_AFTER_LOCK,
    );
    let by = park.0.id();
    assert_eq!(sim.state(w.pid), "locked");
    let wake = run(&sim, st.path(), &["wake", &pid]);
    refused_as_in_progress(&w, &wake, "parked", by);
    assert_eq!(sim.state(w.pid), "locked", "the wake touched it");
    let (status, said) = let_go(st.path(), park);
    assert!(status.success(), "the park failed: {said}");
    assert_eq!(sim.state(w.pid), "checkpointed");
    ok(&run(&sim, st.path(), &["wake", &pid]));
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    sim.assert_no_wedge();
}

/// The first attack through the agent, which runs both the wake and the park (its locks two open
/// files of one process, which exclude each other as two processes' do): a `cryo wake` reaches
/// the agent, paused between its restore and its unlock, then a `cryo park` of the same worker.
/// The park is refused at once naming the agent; the wake, let go, traces (the agent's guard)
/// and unlocks the worker, which serves as before, restored once; no wedge.
#[test]
fn a_park_meeting_a_wake_before_its_unlock_through_the_agent_is_refused() {
    meets_a_wake_before_its_unlock_through_the_agent(&["park"]);
}

/// A `cryo OP... PID` of a worker whose wake the agent runs, paused between its restore and its
/// unlock: OP (run by the agent too) is refused (exit 3) naming the agent, touching nothing;
/// the wake, let go, traces (the agent's guard) and unlocks the worker, which serves as before,
/// restored once; no wedge. `op`: the command and its options, before the pid.
fn meets_a_wake_before_its_unlock_through_the_agent(op: &[&str]) {
    let sim = Sim::start();
    let st = state();
    let go = st.path().join("go");
    let failpoint = cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED;
    let agent = AgentProc::start_with(&sim, st.path(), &["--no-memory-watch"], |c| {
        c.env("CRYO_FAILPOINT", failpoint)
            .env("CRYO_FAILPOINT_RESUME", &go);
    });
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &pid]));
    let wake = sim
        .cmd_at(st.path())
        .args(["wake", &pid])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    common::eventually(
        cryo_testkit::PATIENCE,
        "the agent's wake at its failpoint",
        || {
            agent
                .log()
                .contains(&format!("failpoint {failpoint} reached"))
        },
    );
    assert_eq!(sim.state(w.pid), "locked");
    let second = run(&sim, st.path(), &[op, &[pid.as_str()]].concat());
    refused_as_in_progress(&w, &second, "woken", agent.child.id());
    assert_eq!(sim.state(w.pid), "locked", "the {op:?} touched it");
    std::fs::write(&go, b"").unwrap();
    let wake = wake.wait_with_output().unwrap();
    ok(&wake);
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    restored_once(st.path(), &w);
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "not traced");
    sim.assert_no_wedge();
    drop(agent);
    common::stop_pin_holder(st.path());
}

/// Attack (session 22): a `cryo stop` of a parked worker paused in its kill phase once it read
/// the worker CHECKPOINTED right before its kill, before its signal (`stop-kill-after-look`,
/// made a pause for this), then a `cryo wake` of the same worker. The wake must be refused at
/// once naming the stop, touching nothing (the worker stays CHECKPOINTED); the stop, let go,
/// kills it safely (CHECKPOINTED); no wedge. (Before: the wake restored and unlocked the worker,
/// exit 0, "gpu restore done", and the stop, let go, killed the running restored context,
/// exit 0: "wedges recorded: [Wedge { .., used_memory: 67108864, death: \"killed by
/// SIGKILL\", restored: true }]".)
#[test]
fn a_wake_meeting_a_stop_before_its_kill_is_refused_and_the_stop_ends_it_safely() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    ok(&run(&sim, st.path(), &["park", &pid]));
    let stop = paused_at(
        &sim,
        st.path(),
        &["stop", &pid],
        cryo_lifecycle::stop::STOP_KILL_AFTER_LOOK,
    );
    let by = stop.0.id();
    assert_eq!(sim.state(w.pid), "checkpointed");
    let wake = run(&sim, st.path(), &["wake", &pid]);
    refused_as_in_progress(&w, &wake, "stopped", by);
    assert_eq!(sim.state(w.pid), "checkpointed", "the wake touched it");
    let (status, said) = let_go(st.path(), stop);
    assert!(status.success(), "the stop failed: {said}");
    let mut w = w;
    w.wait_exit();
    sim.assert_no_wedge();
}

/// Attack (session 22), the other order: a `cryo wake` of a parked worker paused before its
/// restore (`wake-before-restore`: it read the worker CHECKPOINTED) or between its restore and
/// its unlock (`restore-before-completed`: LOCKED, restored), then a `cryo stop` of it. The stop
/// must be refused at once (exit 3) naming the wake, touching nothing; the wake, let go, brings
/// the worker back serving as before; no wedge. (Before, no wedge but each broke the other:
/// paused before the restore, the stop killed the CHECKPOINTED worker (exit 0, "ended") and the
/// wake then failed "GPU restore failed: pid N: cuCheckpointProcessRestore on pid N failed:
/// CUDA_ERROR_NOT_INITIALIZED"; paused before the unlock, the stop checkpointed the restored
/// context under the wake and killed it (exit 0), and the wake failed "unlock failed: pid N:
/// cuCheckpointProcessUnlock on pid N failed: CUDA_ERROR_NOT_INITIALIZED (...); NOT parked
/// again".)
#[test]
fn a_stop_meeting_a_wake_at_work_is_refused_and_the_wake_wakes() {
    meets_a_wake_at_work("stop");
}

/// The other order through the agent, which runs both the wake and the stop (its locks two open
/// files of one process): a `cryo wake` reaches the agent, paused between its restore and its
/// unlock, then a `cryo stop` of the same worker, which the agent runs too. The stop is refused
/// (exit 3) naming the agent, touching nothing; the wake, let go, unlocks the worker, which
/// serves as before; no wedge.
#[test]
fn a_stop_meeting_a_wake_before_its_unlock_through_the_agent_is_refused() {
    meets_a_wake_before_its_unlock_through_the_agent(&["stop"]);
}

/// Attack (session 23): a `cryo freeze` of a worker whose wake the agent runs, paused between
/// its restore and its unlock (`POST /v1/freeze` meeting `POST /v1/wake` in one agent: two open
/// files of one process's lock). The freeze must be refused at once (exit 3) naming the agent,
/// nothing suspended or dumped (no image); the wake, let go, brings the worker back serving as
/// before, restored once; no wedge. (It held on main: the agent's freeze takes the tree's locks
/// before its first look, on files of their own; now pinned, through the park's and the stop's
/// body.)
#[test]
fn a_freeze_meeting_a_wake_before_its_unlock_through_the_agent_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("img");
    meets_a_wake_before_its_unlock_through_the_agent(&[
        "freeze",
        "--image",
        image.to_str().unwrap(),
    ]);
    assert!(!image.exists(), "the freeze dumped it");
}

/// A parked worker `w` (its `Parked` record standing) parked again by a `cryo park` SIGKILLed
/// at `park-before-record` ([`parked_by_a_dead_park`]): that park found it CHECKPOINTED and did
/// nothing to it, so the next guard or agent start leaves it parked (and journals it settled so).
/// Returns how many events the journal held then.
fn parked_again_by_a_dead_park(sim: &Sim, st: &Path, w: &Worker) -> usize {
    ok(&run(sim, st, &["park", &w.pid.to_string()]));
    parked_by_a_dead_park(sim, st, w).1
}

/// `w` parked by a `cryo park` SIGKILLed at `park-before-record` (its suspension verified `w`
/// CHECKPOINTED, nothing recorded after): a park suspension in flight whose owner is dead. On a
/// worker not parked before (no `Parked` record), the next guard or agent start resumes it in
/// place. Returns the dead park's pid and how many events the journal held then.
fn parked_by_a_dead_park(sim: &Sim, st: &Path, w: &Worker) -> (u32, usize) {
    let (mut park, _err) = paused_at(
        sim,
        st,
        &["park", &w.pid.to_string()],
        cryo_lifecycle::park::PARK_BEFORE_RECORD,
    );
    let dead = park.id();
    park.kill().unwrap();
    park.wait().unwrap();
    assert_eq!(sim.state(w.pid), "checkpointed");
    let records = cryo_journal::read(st.join("journal")).unwrap().records;
    assert!(
        cryo_journal::in_flight_stops(&records)
            .keys()
            .any(|p| p.pid == w.pid),
        "the dead park's suspension is not in flight"
    );
    (dead, records.len())
}

/// Attack (session 23): a worker parked by a `cryo park` SIGKILLed at `park-before-record`
/// (CHECKPOINTED, no `Parked` record, the park in flight, its owner gone), then a `cryo wake` of
/// it. The wake cannot restore it (what it held on the GPU is unknown) and must say what is
/// true: the next guard or agent start resumes it in place, and a restore by hand would race
/// that. Nothing is restored; it stays CHECKPOINTED; a guard's start then resumes it, serving as
/// before; no wedge. (Before: "refused: pid N was not parked by cryo (no record of its device
/// memory); restore it with `cryo gpu restore`".)
#[test]
fn a_wake_of_a_dead_park_s_worker_says_the_next_guard_or_agent_start_resumes_it() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    let (dead, _) = parked_by_a_dead_park(&sim, st.path(), &w);
    let wake = run(&sim, st.path(), &["wake", &pid]);
    let said = stderr(&wake);
    assert!(
        !wake.status.success()
            && !said.contains("cryo gpu restore`;")
            && said.contains(&format!("a park that did not finish (cryo pid {dead})"))
            && said.contains("the next `cryo guard` start or agent start resumes it in place"),
        "{said}"
    );
    assert_eq!(sim.state(w.pid), "checkpointed", "the wake touched it");
    let guard = GuardProc::start(&sim, st.path(), &["--no-memory-watch"]);
    assert_eq!(sim.state(w.pid), "running", "{}", guard.log());
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    sim.assert_no_wedge();
    drop(guard);
}

/// `events` (since the dead park) hold exactly one restore of `w`, by cryo pid `by`, journaled
/// complete and unlocked: no second restorer.
fn one_restore_by(events: &[cryo_journal::Event], w: &Worker, by: u32) {
    use cryo_journal::Event;
    let mine: Vec<&Event> = events
        .iter()
        .filter(|e| e.pids().iter().any(|p| p.pid == w.pid))
        .collect();
    let restores: Vec<&&Event> = mine
        .iter()
        .filter(|e| matches!(e, Event::RestoreStarted { .. }))
        .collect();
    assert!(
        matches!(&restores[..], [Event::RestoreStarted { unlock_by: Some(u), .. }] if u.pid == by as i32),
        "not one restore by {by}: {mine:?}"
    );
    let count = |f: &dyn Fn(&Event) -> bool| mine.iter().filter(|e| f(e)).count();
    assert_eq!(
        (
            count(&|e| matches!(e, Event::RestoreCompleted { .. })),
            count(&|e| matches!(e, Event::Unlocked { .. }))
        ),
        (1, 1),
        "{mine:?}"
    );
}

/// Attack (session 23): a guard's start settling a dead park's worker (parked, then parked again
/// by a park SIGKILLed before its record: CHECKPOINTED, its park in flight, its owner gone) while
/// a `cryo wake` of it has read it CHECKPOINTED and not restored it yet (`wake-before-restore`).
/// Two restorers of one process: the guard must leave it to the wake, untouched and named (the
/// wake holds its lock); the wake, let go, restores it once, traced by the guard before its
/// unlock; it serves as before; nothing is in flight for it any more; no wedge.
#[test]
fn a_guard_settling_a_dead_park_leaves_the_worker_to_a_wake_at_work() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let before = w.complete("the same question");
    let from = parked_again_by_a_dead_park(&sim, st.path(), &w);
    let (guard, by) =
        a_guard_start_leaves_it_to_a_wake_at_work(&sim, st.path(), &w, "checkpointed", &before);
    assert!(
        guard.log().contains(&format!("pid {}:", w.pid)),
        "{}",
        guard.log()
    );
    let records = cryo_journal::read(st.path().join("journal"))
        .unwrap()
        .records;
    let since: Vec<_> = records[from..].iter().map(|r| r.event.clone()).collect();
    one_restore_by(&since, &w, by);
    assert!(
        !cryo_journal::in_flight_stops(&records)
            .keys()
            .any(|p| p.pid == w.pid),
        "still in flight after the wake"
    );
    sim.assert_no_wedge();
    drop(guard);
}

/// A `cryo wake` of `w` paused before its restore (`wake-before-restore`: holding its lock),
/// then a guard's start (it settles what is in flight before its socket answers): the guard
/// must find the worker `found`, untouched, and leave it to the wake, its log naming the wake;
/// the wake, let go, succeeds: `w` runs, traced by the guard, and answers as `before`. Returns
/// the guard and the wake's pid.
fn a_guard_start_leaves_it_to_a_wake_at_work(
    sim: &Sim,
    st: &Path,
    w: &Worker,
    found: &str,
    before: &str,
) -> (GuardProc, u32) {
    let pid = w.pid.to_string();
    let wake = paused_at(
        sim,
        st,
        &["wake", &pid],
        cryo_lifecycle::park::WAKE_BEFORE_RESTORE,
    );
    let by = wake.0.id();
    let guard = GuardProc::start(sim, st, &["--no-memory-watch"]);
    let seen = sim.state(w.pid);
    let (status, said) = let_go(st, wake);
    let log = guard.log();
    assert!(
        seen == found && status.success(),
        "after the guard's start: {seen} (not {found}); the wake, let go: {status}: {said}\nthe guard: {log}"
    );
    assert!(
        log.contains(&format!("it is being woken by cryo pid {by}")),
        "{log}"
    );
    assert_eq!(sim.state(w.pid), "running");
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "woken unguarded");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    (guard, by)
}

/// The other order: a guard's start paused in its settlement's resume of a dead park's worker
/// (`restore-before-completed`: restored, LOCKED, not yet traced or unlocked; a first park's, as
/// a re-park's worker is left parked), then a `cryo wake` of it. The wake must be refused at once (exit 3) naming the guard as waking it,
/// touching nothing; the guard, let go, traces and unlocks the worker, restored once; it serves
/// as before; no wedge.
#[test]
fn a_wake_meeting_a_guard_resuming_a_dead_park_s_worker_is_refused() {
    use std::io::Read;
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    let (_, from) = parked_by_a_dead_park(&sim, st.path(), &w);
    let (mut guard, mut err) = paused_at(
        &sim,
        st.path(),
        &["guard", "--scan", "none", "--no-memory-watch"],
        cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED,
    );
    let by = guard.id();
    assert_eq!(sim.state(w.pid), "locked");
    let wake = run(&sim, st.path(), &["wake", &pid]);
    // A settlement names itself (session 23: it said "is being woken by cryo pid G").
    refused_as_in_progress(&w, &wake, "settled", by);
    assert_eq!(sim.state(w.pid), "locked", "the wake touched it");
    // Let go; its log drained meanwhile (it runs on).
    std::fs::write(st.path().join("go"), b"").unwrap();
    let log = std::thread::spawn(move || {
        let mut said = String::new();
        let _ = err.read_to_string(&mut said);
        said
    });
    common::eventually(
        cryo_testkit::PATIENCE,
        "the guard's unlock, journaled",
        || {
            events(st.path())[from..]
                .iter()
                .any(|e| matches!(e, cryo_journal::Event::Unlocked { pid, .. } if pid.pid == w.pid))
        },
    );
    assert_eq!(sim.state(w.pid), "running");
    assert_ne!(common::procs::tracer_pid(w.pid), 0, "resumed unguarded");
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    let records = cryo_journal::read(st.path().join("journal"))
        .unwrap()
        .records;
    let since: Vec<_> = records[from..].iter().map(|r| r.event.clone()).collect();
    one_restore_by(&since, &w, by);
    sim.assert_no_wedge();
    guard.kill().unwrap();
    guard.wait().unwrap();
    let _ = log.join();
}

/// Attack (session 23): a parked worker parked again (`cryo park` of it succeeds, nothing to
/// do), then a guard starts. The worker must stay parked: its second park finished, nothing of it
/// is in flight, and a guard's start resumes only what a dead park or freeze left.
#[test]
fn a_worker_parked_twice_stays_parked_across_a_guard_start() {
    parked_again_stays_parked(|sim, st, w| {
        ok(&run(sim, st, &["park", &w.pid.to_string()]));
    });
}

/// Attack (session 23): a parked worker parked again by a `cryo park` whose journal refuses its
/// `Parked` record (EIO, failpoint `park-record-fails`). The park fails; its error must say what
/// is true (the worker stays parked, its first record standing; not "the worker serves again":
/// this park suspended nothing), and the park's suspension, left in flight by the refused
/// record, must not make the next guard start wake a worker the user parked. (Before: the error
/// said "...; every process it suspended was resumed in place: the worker serves again", and the
/// guard's start said "settled: pid N: a park that did not finish left it checkpointed; restored
/// and unlocked in place".)
#[test]
fn a_worker_parked_again_by_a_park_whose_record_fails_stays_parked() {
    parked_again_stays_parked(|sim, st, w| {
        let o = sim
            .cmd_at(st)
            .env("CRYO_FAILPOINT", cryo_lifecycle::park::PARK_RECORD_FAILS)
            .args(["park", &w.pid.to_string()])
            .output()
            .unwrap();
        let said = stderr(&o);
        assert!(
            !o.status.success()
                && !said.contains("serves again")
                && said.contains("it was parked already and stays parked"),
            "{said}"
        );
    });
}

/// Attack (session 23): a parked worker parked again by a `cryo park` SIGKILLed at
/// `park-before-record` (nothing recorded after its suspension, which found it CHECKPOINTED
/// and did nothing to it). The next guard start must leave it parked: the user parked it, and
/// its first `Parked` record stands. (Before: the guard's start resumed it, "settled: pid N: a
/// park that did not finish left it checkpointed; restored and unlocked in place".)
#[test]
fn a_worker_parked_again_by_a_park_that_died_stays_parked() {
    parked_again_stays_parked(|sim, st, w| {
        parked_again_by_a_dead_park(sim, st, w);
    });
}

/// A parked worker (`cryo park`) parked again by `again`, then a guard start: the worker stays
/// CHECKPOINTED and listed parked, nothing of it left in flight; a `cryo wake` then brings it
/// back, serving as before; no wedge.
fn parked_again_stays_parked(again: impl Fn(&Sim, &Path, &Worker)) {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &pid]));
    again(&sim, st.path(), &w);
    assert_eq!(sim.state(w.pid), "checkpointed");
    // Its start settles what is in flight before its socket answers.
    let guard = GuardProc::start(&sim, st.path(), &["--no-memory-watch"]);
    assert_eq!(
        sim.state(w.pid),
        "checkpointed",
        "the guard's start woke a parked worker: {}",
        guard.log()
    );
    let s = json(&run(&sim, st.path(), &["status", "--json"]));
    assert_eq!(s["parked"][0]["pid"]["pid"], w.pid, "{s}");
    let records = cryo_journal::read(st.path().join("journal"))
        .unwrap()
        .records;
    assert!(
        !cryo_journal::in_flight_stops(&records)
            .keys()
            .any(|p| p.pid == w.pid),
        "still in flight after the guard's start: {}",
        guard.log()
    );
    ok(&run(&sim, st.path(), &["wake", &pid]));
    assert_eq!(
        w.complete("the same question"),
        before,
        "it serves as before"
    );
    sim.assert_no_wedge();
    drop(guard);
}

/// Attack (session 23): a guard's start finishing the unlock of a dead wake's worker (a `cryo
/// wake` SIGKILLed at `wake-before-unlock`: LOCKED, its restore journaled complete, its writer
/// gone) while a second `cryo wake` of it is at work (paused at `wake-before-restore`: it read
/// the worker LOCKED with its restore complete, and will trace and unlock it). The guard must
/// leave it to that wake, untouched and named; the wake, let go, traces and unlocks it; it
/// serves as before, running (never parked again); no wedge.
#[test]
fn a_guard_finishing_a_dead_wake_s_unlock_leaves_the_worker_to_a_wake_at_work() {
    let sim = Sim::start();
    let st = state();
    let w = worker(&sim, "64MiB", 0);
    let pid = w.pid.to_string();
    let before = w.complete("the same question");
    ok(&run(&sim, st.path(), &["park", &pid]));
    let (mut dead, _err) = paused_at(
        &sim,
        st.path(),
        &["wake", &pid],
        cryo_lifecycle::park::WAKE_BEFORE_UNLOCK,
    );
    dead.kill().unwrap();
    dead.wait().unwrap();
    assert_eq!(sim.state(w.pid), "locked");
    let (guard, _) =
        a_guard_start_leaves_it_to_a_wake_at_work(&sim, st.path(), &w, "locked", &before);
    sim.assert_no_wedge();
    drop(guard);
}
