#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo guard` on the simulated GPU, as root: the termination matrix on a guarded restored
//! worker, restart of the guard, fresh workers left alone, the fence.
//!
//! Every cell checks, before anything is released: the wedge ledger is empty, the journal names
//! the path taken (suspended: `FatalSignal` + `Verified`, no `Pinned`; or `Pinned` +
//! `GpuQuarantined`), and the fence holds exactly the GPUs it should. A pinned cell then ends
//! through the operator's path (`cryo guard release`), and the test asserts that this release is
//! what records the wedge: the pins were holding a live restored context (on an affected host,
//! the release is the dangerous act, which is why it needs an explicit flag). Nothing is hidden:
//! a wedge before the release fails the test.

mod common;
use common::events as records;

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;

use common::{
    cryo, eventually, http, make_restored, ok, procs, GuardProc, Sim, Worker, WorkerSpec, PATIENCE,
};
use cryo_testkit::cgroup::TestCgroup;
use procs::tracer_pid;

mod sig {
    pub const SIGQUIT: i32 = 3;
    pub const SIGABRT: i32 = 6;
    pub const SIGBUS: i32 = 7;
    pub const SIGKILL: i32 = 9;
    pub const SIGTERM: i32 = 15;
}
use cryo_guard::control::{Detach, GuardClient};
use cryo_journal::{AttachSource, Event, ProcId};
use cryo_state::StateDir;

/// A sim worker on GPU `gpu` in its own process group (a group kill reaches it alone).
fn worker(sim: &Sim, memory: &str, gpu: u32, cgroup: Option<&TestCgroup>) -> Worker {
    let spec = WorkerSpec::new(memory).gpu(gpu).process_group();
    sim.spawn(match cgroup {
        Some(cg) => spec.cgroup(cg.path()),
        None => spec,
    })
}

fn names(events: &[Event], id: ProcId) -> Vec<&'static str> {
    events
        .iter()
        .filter(|e| e.pids().contains(&id))
        .map(|e| e.label())
        .collect()
}

fn wait_attached(state: &Path, id: ProcId, times: usize) {
    eventually(PATIENCE, "GuardAttached in the journal", || {
        records(state)
            .iter()
            .filter(|e| matches!(e, Event::GuardAttached { pid, .. } if *pid == id))
            .count()
            >= times
    });
}

/// A restored worker the guard has attached to: proof that the guard polled the journal after
/// everything the test did before.
fn attached_canary(sim: &Sim, state: &Path) -> Worker {
    let canary = worker(sim, "4MiB", 0, None);
    make_restored(sim, state, canary.pid);
    wait_attached(state, ProcId::of(canary.pid).unwrap(), 1);
    canary
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Death {
    Signal(i32),
    Segv,
    Exit1,
    Oom,
    GroupKill,
}

fn cell(death: Death, sticky: bool) {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let gpu0 = sim.gpu_uuid(0);
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let cg = (death == Death::Oom).then(|| TestCgroup::new("guard-cli-oom", 160 << 20));
    let mut w = worker(&sim, "16MiB", 0, cg.as_ref());
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    assert_ne!(tracer_pid(w.pid), 0, "the restored worker is not traced");
    if sticky {
        assert_eq!(http(w.port, "POST", "/fault", "").0, 200);
    }
    match death {
        Death::Signal(sig) => {
            let p = rustix::process::Pid::from_raw(w.pid).unwrap();
            rustix::process::kill_process(p, signal(sig)).unwrap();
            if sig == sig::SIGBUS {
                // Rust's runtime handles SIGBUS (stack-overflow detection): a *sent* SIGBUS
                // only resets the handler to SIG_DFL. The second one is fatal and is the one
                // the guard holds.
                eventually(PATIENCE, "the SIGBUS handler to be reset", || {
                    !procs::catches(w.pid, sig)
                });
                let _ = rustix::process::kill_process(p, signal(sig));
            }
        }
        Death::GroupKill => rustix::process::kill_process_group(
            rustix::process::Pid::from_raw(w.pid).unwrap(),
            rustix::process::Signal::Kill,
        )
        .unwrap(),
        Death::Segv => {
            let _ = std::panic::catch_unwind(|| http(w.port, "POST", "/segv", ""));
        }
        Death::Exit1 => {
            let _ = std::panic::catch_unwind(|| http(w.port, "POST", "/fault?exit=1", ""));
        }
        Death::Oom => {
            let _ = std::panic::catch_unwind(|| http(w.port, "POST", "/alloc?mib=400", ""));
        }
    }
    let status = w.wait_exit();
    // The exit is observed: one round trip through the driver and every fd close it caused is
    // in the ledger.
    let ledger = sim.settled_ledger();
    assert!(
        ledger.is_empty(),
        "{death:?} sticky={sticky}: wedge before any release: {ledger:?}"
    );
    eventually(PATIENCE, "the guard to journal the exit", || {
        names(&records(&state), id).contains(&"exited")
    });
    let events = records(&state);
    let path = names(&events, id);
    let suspendable =
        !sticky && (matches!(death, Death::Signal(s) if s != sig::SIGKILL) || death == Death::Segv);
    let fence = StateDir::new(&state).fence();
    if suspendable {
        assert!(
            path.contains(&"FATAL SIGNAL")
                && path.contains(&"verified")
                && !path.contains(&"pinned"),
            "{death:?}: expected the suspended path, journal says {path:?} (status {status:?})"
        );
        assert!(
            fence.list().unwrap().is_empty(),
            "nothing to fence after a suspension"
        );
    } else {
        assert!(
            path.contains(&"pinned"),
            "{death:?} sticky={sticky}: expected pinned, journal says {path:?} (status {status:?})"
        );
        assert!(
            events
                .iter()
                .any(|e| matches!(e, Event::GpuQuarantined { gpu, .. } if *gpu == gpu0)),
            "no GpuQuarantined for {gpu0}"
        );
        let q = fence
            .get(&gpu0.parse().unwrap())
            .unwrap()
            .expect("GPU 0 is not quarantined");
        assert!(q.pids.contains(&w.pid));
        if sticky
            && death != Death::Signal(sig::SIGKILL)
            && death != Death::GroupKill
            && death != Death::Oom
            && death != Death::Exit1
        {
            assert!(
                path.contains(&"REFUSED"),
                "a fatal signal on a sticky context must journal the refused suspension: {path:?}"
            );
        }
        let st = GuardClient::new(&StateDir::new(&state))
            .status()
            .unwrap()
            .unwrap();
        assert!(
            st.pins
                .iter()
                .any(|p| p.pid == w.pid && p.gpus == vec![gpu0.parse().unwrap()]),
            "{st:?}"
        );
        // Visible to the operator.
        let ls = ok({
            let mut c = sim.cmd_at(&state);
            c.args(["gpu", "ls"]);
            c
        });
        assert!(
            ls.lines()
                .any(|l| l.contains(&gpu0) && l.contains("QUARANTINED")),
            "{ls}"
        );
        assert!(ok({
            let mut c = sim.cmd_at(&state);
            c.arg("status");
            c
        })
        .contains(&gpu0));
        // Closing pins needs the explicit flag.
        let refused = sim
            .cmd_at(&state)
            .args(["guard", "release", "--gpu", &gpu0])
            .output()
            .unwrap();
        assert_eq!(
            refused.status.code(),
            Some(2),
            "release without the flag must be a usage error"
        );
        sim.assert_no_wedge();
        sim.release_pins(&state, &gpu0);
        assert!(!fence.fences(&gpu0.parse().unwrap()).unwrap());
        // The release is what tears the held context down: the ledger names exactly that.
        eventually(PATIENCE, "the release's teardown in the ledger", || {
            !sim.ledger().is_empty()
        });
        let wedges = sim.settled_ledger();
        assert_eq!(wedges.len(), 1, "{wedges:?}");
        assert!(records(&state)
            .iter()
            .any(|e| matches!(e, Event::PinsReleased { pid } if *pid == id)));
    }
}

fn signal(sig: i32) -> rustix::process::Signal {
    rustix::process::Signal::from_raw(sig).unwrap()
}

macro_rules! matrix {
    ($($name:ident: $death:expr, $sticky:expr;)*) => {$(
        #[test]
        fn $name() {
            cell($death, $sticky);
        }
    )*};
}

matrix! {
    sigterm_healthy_is_suspended: Death::Signal(sig::SIGTERM), false;
    sigterm_sticky_is_pinned: Death::Signal(sig::SIGTERM), true;
    sigkill_healthy_is_pinned: Death::Signal(sig::SIGKILL), false;
    sigkill_sticky_is_pinned: Death::Signal(sig::SIGKILL), true;
    segv_healthy_is_suspended: Death::Segv, false;
    segv_sticky_is_pinned: Death::Segv, true;
    sigabrt_healthy_is_suspended: Death::Signal(sig::SIGABRT), false;
    sigabrt_sticky_is_pinned: Death::Signal(sig::SIGABRT), true;
    sigbus_healthy_is_suspended: Death::Signal(sig::SIGBUS), false;
    sigbus_sticky_is_pinned: Death::Signal(sig::SIGBUS), true;
    sigquit_healthy_is_suspended: Death::Signal(sig::SIGQUIT), false;
    sigquit_sticky_is_pinned: Death::Signal(sig::SIGQUIT), true;
    exit1_after_fatal_error_is_pinned: Death::Exit1, true;
    oom_kill_healthy_is_pinned: Death::Oom, false;
    oom_kill_sticky_is_pinned: Death::Oom, true;
    group_kill_healthy_is_pinned: Death::GroupKill, false;
    group_kill_sticky_is_pinned: Death::GroupKill, true;
}

#[test]
fn fresh_worker_is_not_traced() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let w = worker(&sim, "16MiB", 0, None);
    // The guard attaches to a worker restored after the fresh one started: it has polled since.
    let canary = attached_canary(&sim, &state);
    assert_eq!(tracer_pid(w.pid), 0, "a fresh worker must not be traced");
    let fresh = ProcId::of(w.pid).unwrap();
    let attached: Vec<ProcId> = records(&state)
        .iter()
        .filter_map(|e| match e {
            Event::GuardAttached { pid, .. } => Some(*pid),
            _ => None,
        })
        .collect();
    assert!(!attached.contains(&fresh), "{attached:?}");
    assert_eq!(attached, vec![ProcId::of(canary.pid).unwrap()]);
}

#[test]
fn killed_guard_restarts_and_reattaches() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let mut guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, "16MiB", 0, None);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    guard.kill();
    eventually(PATIENCE, "the kernel to detach", || tracer_pid(w.pid) == 0);
    let guard2 = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    wait_attached(&state, id, 2);
    assert_ne!(tracer_pid(w.pid), 0);
    assert!(
        guard2
            .log()
            .contains(&format!("re-attached to restored pid {}", w.pid)),
        "{}",
        guard2.log()
    );
    // Still protected: a SIGTERM now takes the suspended path.
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(w.pid).unwrap(),
        rustix::process::Signal::Term,
    )
    .unwrap();
    w.wait_exit();
    sim.assert_no_wedge();
    assert!(names(&records(&state), id).contains(&"verified"));
}

#[test]
fn restarted_guard_reports_what_died_unwatched() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let mut guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, "16MiB", 0, None);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    guard.kill();
    // Dies safely (suspended first) while no guard watches.
    let pid = w.pid.to_string();
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["stop", &pid]);
        c
    });
    w.wait_exit();
    let _guard2 = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let ev = records(&state);
    // `cryo stop` journaled its kill, so the guard knows how it ended: not lost.
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::GuardLost { pid } if *pid == id)),
        "{:?}",
        names(&ev, id)
    );
    sim.assert_no_wedge();
}

#[test]
fn detach_and_attach_through_the_socket() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let w = worker(&sim, "16MiB", 0, None);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    assert_eq!(
        GuardClient::new(&StateDir::new(&state)).detach(id).unwrap(),
        Detach::Detached
    );
    assert_eq!(tracer_pid(w.pid), 0, "detached for a CRIU dump");
    // A worker restored after the detach is attached: the guard has polled the journal since.
    let _canary = attached_canary(&sim, &state);
    assert_eq!(
        tracer_pid(w.pid),
        0,
        "the journal poll must not re-attach a detached process"
    );
    assert!(GuardClient::new(&StateDir::new(&state)).attach(id).unwrap());
    assert_ne!(tracer_pid(w.pid), 0);
}

/// The memory watch suspends a guarded worker whose cgroup is short of room for its checkpoint,
/// then stops it: verified before it exits, nothing pinned, nothing fenced. The worker grows to a
/// known size and then stops growing (200 MiB limit; 32 MiB of device memory plus a 64 MiB margin
/// need 96 MiB of room; it holds at least 120 MiB): the watch must act, and the checkpoint (+32 MiB)
/// still fits far below the limit, so the OOM killer never races the stop. The test waits for the
/// journal's positive events, never for a time. (Before: the worker kept growing until it died,
/// and on a loaded host the OOM killer sometimes beat the stop.)
#[test]
fn memory_watch_suspends_and_stops_before_the_oom_killer() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(
        &sim,
        &state,
        &["--memory-margin", "64MiB", "--poll-ms", "50"],
    );
    let cg = TestCgroup::new("guard-cli-watch", 200 << 20);
    let mut w = worker(&sim, "32MiB", 0, Some(&cg));
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    // Until it holds 120 MiB, or the watch already acted (the process is gone).
    while cryo_proc::ProcHandle::open(w.pid)
        .and_then(|h| h.rss())
        .is_ok_and(|rss| rss < 120 << 20)
    {
        if std::panic::catch_unwind(|| http(w.port, "POST", "/alloc?mib=8", "")).is_err() {
            break;
        }
    }
    eventually(PATIENCE, "the guard to journal the exit", || {
        names(&records(&state), id).contains(&"exited")
    });
    w.wait_exit();
    sim.assert_no_wedge();
    let path = names(&records(&state), id);
    let at = |what: &str| path.iter().position(|s| *s == what);
    assert!(
        at("lock started").is_some()
            && at("verified") > at("lock started")
            && at("verified") < at("exited")
            && !path.contains(&"pinned"),
        "{path:?}"
    );
    assert!(StateDir::new(&state).fence().list().unwrap().is_empty());
}

/// A worker and its identity.
struct Named {
    w: Worker,
    id: ProcId,
}

/// A guard with `--endgame drain` whose restart command appends the quarantined GPUs to `out`
/// (a second run shows as a second line); restored and guarded workers A (GPU 0) and B (GPU 1),
/// and a fresh worker C on GPU 1.
struct DrainScene {
    guard: GuardProc,
    out: std::path::PathBuf,
    a: Named,
    b: Named,
    c: Named,
}

fn drain_scene(sim: &Sim, state: &Path) -> DrainScene {
    let out = sim.path().join("restart.out");
    let cmd = format!("echo $CRYO_QUARANTINED_GPUS >> '{}'", out.display());
    let guard = GuardProc::start(
        sim,
        state,
        &[
            "--no-memory-watch",
            "--endgame",
            "drain",
            "--restart-cmd",
            &cmd,
        ],
    );
    let named = |w: Worker| Named {
        id: ProcId::of(w.pid).unwrap(),
        w,
    };
    let a = worker(sim, "16MiB", 0, None);
    let b = worker(sim, "16MiB", 1, None);
    make_restored(sim, state, a.pid);
    make_restored(sim, state, b.pid);
    let (a, b) = (named(a), named(b));
    let c = named(worker(sim, "16MiB", 1, None));
    wait_attached(state, a.id, 1);
    wait_attached(state, b.id, 1);
    DrainScene {
        guard,
        out,
        a,
        b,
        c,
    }
}

#[test]
fn drain_endgame_stops_the_others_safely_then_runs_the_restart_command() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let gpus: Vec<String> = cryo_sim::connect(sim.path())
        .unwrap()
        .inspect
        .gpus()
        .unwrap()
        .iter()
        .map(|g| g.uuid.to_string())
        .collect();
    let (gpu0, gpu1) = (gpus[0].clone(), gpus[1].clone());
    let DrainScene {
        guard,
        out,
        mut a,
        mut b,
        mut c,
    } = drain_scene(&sim, &state);
    let (ida, idb, idc) = (a.id, b.id, c.id);
    let (a, b, c) = (&mut a.w, &mut b.w, &mut c.w);
    assert_ne!(tracer_pid(a.pid), 0, "restored worker A is not traced");
    assert_ne!(tracer_pid(b.pid), 0, "restored worker B is not traced");
    assert_eq!(
        tracer_pid(c.pid),
        0,
        "the fresh worker C must not be traced"
    );

    rustix::process::kill_process(
        rustix::process::Pid::from_raw(a.pid).unwrap(),
        rustix::process::Signal::Kill,
    )
    .unwrap();
    a.wait_exit();
    // The drain ends the other GPU processes of the node, B (restored) and C (fresh).
    let sb = b.wait_exit();
    let sc = c.wait_exit();
    // Every death is observed: one round trip and every fd close it caused is in the ledger.
    let ledger = sim.settled_ledger();
    assert!(ledger.is_empty(), "wedge before any release: {ledger:?}");
    eventually(PATIENCE, "the guard to journal the exits", || {
        let ev = records(&state);
        names(&ev, ida).contains(&"exited") && names(&ev, idb).contains(&"exited")
    });
    // The drain ran to its end (one pin, one drain): the command's output is complete.
    eventually(PATIENCE, "the drain to finish", || {
        guard.log().contains("drain: restart command finished")
    });
    let written = fs::read_to_string(&out).unwrap();
    assert_eq!(
        written,
        format!("{gpu0}\n"),
        "the restart command must run once, naming exactly the quarantined GPU"
    );
    let events = records(&state);
    let (pa, pb, pc) = (
        names(&events, ida),
        names(&events, idb),
        names(&events, idc),
    );
    assert!(
        pa.contains(&"pinned"),
        "A: expected pinned, journal says {pa:?}"
    );
    for step in ["locked", "checkpointed", "verified", "killed"] {
        assert!(
            pb.contains(&step),
            "B must be suspended before it dies ({step} missing): {pb:?} (status {sb:?})"
        );
        assert!(
            pc.contains(&step),
            "C must be stopped safely ({step} missing): {pc:?} (status {sc:?})"
        );
    }
    let order = |p: &[&str], what: &str| p.iter().position(|s| *s == what).unwrap();
    assert!(
        order(&pb, "verified") < order(&pb, "killed"),
        "B killed before it was verified suspended: {pb:?}"
    );
    assert!(
        !pb.contains(&"pinned") && !pc.contains(&"pinned"),
        "B: {pb:?}, C: {pc:?}"
    );

    let fence = StateDir::new(&state).fence();
    let q = fence
        .get(&gpu0.parse().unwrap())
        .unwrap()
        .expect("GPU 0 is not quarantined");
    assert!(q.pids.contains(&a.pid));
    assert!(
        !fence.fences(&gpu1.parse().unwrap()).unwrap(),
        "GPU 1 held only safely stopped workers"
    );
    let status: serde_json::Value = serde_json::from_str(&ok({
        let mut c = sim.cmd_at(&state);
        c.args(["status", "--json"]);
        c
    }))
    .unwrap();
    let quarantined: Vec<&str> = status["quarantined"]
        .as_array()
        .unwrap()
        .iter()
        .map(|q| q["gpu"].as_str().unwrap())
        .collect();
    assert_eq!(quarantined, vec![gpu0.as_str()], "{status}");
    assert_eq!(status["guard"]["endgame"], "drain", "{status}");
    let pins = status["guard"]["pins"].as_array().unwrap();
    assert_eq!(pins.len(), 1, "{status}");
    assert_eq!(pins[0]["pid"], a.pid, "{status}");
    assert_eq!(pins[0]["gpus"], serde_json::json!([gpu0]), "{status}");

    // The operator's release: the explicit flag, then the teardown it causes.
    sim.assert_no_wedge();
    sim.release_pins(&state, &gpu0);
    assert!(!fence.fences(&gpu0.parse().unwrap()).unwrap());
    eventually(PATIENCE, "the release's teardown in the ledger", || {
        !sim.ledger().is_empty()
    });
    let wedges = sim.settled_ledger();
    assert_eq!(wedges.len(), 1, "{wedges:?}");
    assert!(records(&state)
        .iter()
        .any(|e| matches!(e, Event::PinsReleased { pid } if *pid == ida)));
}

#[test]
fn bench_guard_smoke() {
    let out = cryo()
        .args([
            "bench",
            "guard",
            "--requests",
            "20",
            "--repeats",
            "2",
            "--rounds",
            "1",
            "--memory",
            "8MiB",
            "--pin-cpus",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        text.contains("ratio guarded/unguarded")
            && text.contains("per adjacent pair of batches (80 pairs)")
            && text.contains("client and worker each pinned to a CPU")
            && text.contains("CPU while the batches ran")
            && text.contains("issue 10's p99 budget")
            && text.contains("per repeat: p99 ratio")
            && text.contains("ratio guard/bare")
            && text.contains("the agent's guard")
            && text.contains("wedge ledger empty"),
        "{text}"
    );
}

#[test]
fn the_control_socket_answers_root_only_even_when_anyone_can_connect() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    // Someone made the socket reachable by every user: the peer-credential check is what stands.
    let open = |p: &Path, mode| {
        fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap()
    };
    open(sim.path(), 0o755);
    open(&StateDir::new(&state).guard_socket(), 0o666);
    // A copy of cryo that an unprivileged user can run, wherever the build lives.
    let exe = sim.path().join("cryo-as-nobody");
    fs::copy(common::CRYO, &exe).unwrap();
    open(&exe, 0o755);
    let out = Command::new(&exe)
        .args(["--state-dir"])
        .arg(&state)
        .arg("status")
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("guard: cannot ask it: the guard says: only root may control the guard (peer uid 65534)"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Root still is answered.
    let mut status = sim.cmd_at(&state);
    status.arg("status");
    assert!(ok(status).contains("guard: running"));
}

/// Restores `pid`'s context as another tool would: through the driver, journaled in `elsewhere`
/// (not in the guard's journal, so only an operator's attach tells the guard about it).
fn restored_by_another_tool(sim: &Sim, elsewhere: &Path, pid: i32) {
    make_restored(sim, elsewhere, pid);
}

/// Reproduced wedge (b) of issue 10: a worker the operator attached by pid (restored by another
/// tool) is guarded again by a restarted guard, so its `kill -9` is pinned, not torn down.
/// (Before: a restarted guard re-attached only the journal's restores and dropped it silently.)
#[test]
fn a_restarted_guard_reattaches_what_the_operator_attached() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let mut guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, "16MiB", 0, None);
    restored_by_another_tool(&sim, &sim.path().join("other-tool"), w.pid);
    let id = ProcId::of(w.pid).unwrap();
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["guard", "attach", "--pid", &w.pid.to_string()]);
        c
    });
    wait_attached(&state, id, 1);
    guard.kill();
    eventually(PATIENCE, "the kernel to detach", || tracer_pid(w.pid) == 0);
    let _guard2 = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    // Attached again before its socket answered (it re-attaches at start).
    assert_ne!(
        tracer_pid(w.pid),
        0,
        "the restarted guard dropped the worker"
    );
    let ev = records(&state);
    let sources: Vec<AttachSource> = ev
        .iter()
        .filter_map(|e| match e {
            Event::GuardAttached { pid, source } if *pid == id => Some(*source),
            _ => None,
        })
        .collect();
    assert_eq!(
        sources,
        vec![AttachSource::Operator, AttachSource::Operator],
        "the journal must say why it is guarded, both times"
    );
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(w.pid).unwrap(),
        rustix::process::Signal::Kill,
    )
    .unwrap();
    w.wait_exit();
    sim.assert_no_wedge();
    eventually(PATIENCE, "the guard to journal the pin", || {
        names(&records(&state), id).contains(&"pinned")
    });
}

use common::procs::pending;

/// Reproduced wedge (c) of issue 10: a guard holding pins gets SIGQUIT, then every other signal
/// whose default action kills: it handles each (the signal is consumed) and is still there,
/// holding its pins, and says it refuses to stop. (Before: SIGQUIT, SIGUSR1, SIGALRM... killed
/// it, and its pins with it: every pinned context torn down.)
#[test]
fn a_guard_holding_pins_survives_every_killing_signal() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, "16MiB", 0, None);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    rustix::process::kill_process(
        rustix::process::Pid::from_raw(w.pid).unwrap(),
        rustix::process::Signal::Kill,
    )
    .unwrap();
    w.wait_exit();
    eventually(PATIENCE, "the pin", || {
        names(&records(&state), id).contains(&"pinned")
    });
    let client = GuardClient::new(&StateDir::new(&state));
    // QUIT, then USR1 USR2 PIPE ALRM STKFLT XCPU XFSZ VTALRM PROF IO PWR and the real-time
    // signals (glibc's own first ones and the tracer's wake-up signal left out).
    let rtmin = 34;
    let mut sent = vec![sig::SIGQUIT, 10, 12, 13, 14, 16, 24, 25, 26, 27, 29, 30];
    sent.extend((rtmin..=64).filter(|s| *s != rtmin + 4));
    for s in sent {
        let killed = Command::new("kill")
            .arg(format!("-{s}"))
            .arg(guard.pid().to_string())
            .status()
            .unwrap();
        assert!(killed.success(), "kill -{s}");
        eventually(PATIENCE, "the guard to take the signal", || {
            !pending(guard.pid(), s)
        });
        assert!(
            procs::alive(guard.pid()),
            "the guard died of signal {s}; log: {}",
            guard.log()
        );
    }
    eventually(PATIENCE, "the guard to refuse to stop", || {
        guard.log().contains("refusing to stop")
    });
    let st = client.status().unwrap().expect("the guard answers");
    assert!(st.pins.iter().any(|p| p.pid == id.pid), "{st:?}");
    sim.assert_no_wedge();
}

fn gpu_action(sim: &Sim, state: &Path, action: &str, pid: i32) -> std::process::Output {
    sim.cmd_at(state)
        .args(["gpu", action, "--pid", &pid.to_string()])
        .output()
        .unwrap()
}

/// A restore through the cuda-checkpoint front end (what CRIU's cuda plugin runs) is traced by
/// the guard before the toggle unlocks it: the guard polls its journal once an hour, so only the
/// front end's own request can have attached it, and the journal shows it before the process ran.
#[test]
fn a_toggle_out_of_checkpointed_is_traced_before_its_unlock() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch", "--poll-ms", "3600000"]);
    let w = worker(&sim, "16MiB", 0, None);
    for action in ["lock", "checkpoint"] {
        assert!(gpu_action(&sim, &state, action, w.pid).status.success());
    }
    let out = sim
        .cmd_at(&state)
        .args(["cuda-checkpoint", "--toggle", "--pid", &w.pid.to_string()])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", common::stderr(&out));
    assert!(out.stdout.is_empty() && out.stderr.is_empty(), "{out:?}");
    assert_ne!(
        tracer_pid(w.pid),
        0,
        "the toggle unlocked an untraced process"
    );
    assert_eq!(sim.state(w.pid), "running");
    let id = ProcId::of(w.pid).unwrap();
    let ev = records(&state);
    let restored = ev
        .iter()
        .position(|e| matches!(e, Event::RestoreCompleted { pid, .. } if *pid == id));
    let attached = ev.iter().position(
        |e| matches!(e, Event::GuardAttached { pid, source: AttachSource::Restore } if *pid == id),
    );
    assert!(
        restored.is_some() && restored < attached,
        "{:?}",
        names(&ev, id)
    );
}

/// A guard runs but cannot trace the restored process (someone else traces it): `cryo gpu
/// restore` checkpoints it again instead of leaving it to be unlocked unguarded, and fails.
#[test]
fn a_restore_the_guard_cannot_trace_is_checkpointed_again() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let w = worker(&sim, "16MiB", 0, None);
    for action in ["lock", "checkpoint"] {
        assert!(gpu_action(&sim, &state, action, w.pid).status.success());
    }
    // This test process traces it now: the guard's seize is refused.
    nix::sys::ptrace::seize(
        nix::unistd::Pid::from_raw(w.pid),
        nix::sys::ptrace::Options::empty(),
    )
    .unwrap();
    let out = gpu_action(&sim, &state, "restore", w.pid);
    let err = common::stderr(&out);
    assert!(!out.status.success(), "the restore must fail: {err}");
    assert!(
        err.contains("could not trace") && err.contains("checkpointed again"),
        "{err}"
    );
    assert_eq!(sim.state(w.pid), "checkpointed");
    sim.assert_no_wedge();
}

/// Two deaths at once with `--endgame drain` (issue 10 item 6): one drain runs, the restart
/// command runs once, naming both quarantined GPUs; the second dying worker (held at its exit
/// stop while the drain looked) is pinned, not counted as a stop that failed. (Before: two
/// drains, two runs of the restart command, and a "could not be stopped safely".)
#[test]
fn two_deaths_at_once_run_one_drain_and_the_restart_command_once() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let DrainScene {
        guard,
        out,
        mut a,
        mut b,
        mut c,
    } = drain_scene(&sim, &state);
    let (ida, idb, idc) = (a.id, b.id, c.id);
    let (a, b, c) = (&mut a.w, &mut b.w, &mut c.w);
    for w in [&*a, &*b] {
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(w.pid).unwrap(),
            rustix::process::Signal::Kill,
        )
        .unwrap();
    }
    a.wait_exit();
    b.wait_exit();
    c.wait_exit();
    sim.assert_no_wedge();
    let client = GuardClient::new(&StateDir::new(&state));
    eventually(PATIENCE, "both pins, and the drain over", || {
        let st = client.status().unwrap().unwrap();
        st.pins.len() == 2 && !st.draining && out.exists()
    });
    let written = fs::read_to_string(&out).unwrap();
    assert_eq!(
        written.lines().count(),
        1,
        "the restart command must run once: {written:?}"
    );
    let log = guard.log();
    assert!(!log.contains("could not be stopped safely"), "{log}");
    let ev = records(&state);
    assert!(names(&ev, ida).contains(&"pinned") && names(&ev, idb).contains(&"pinned"));
    let pc = names(&ev, idc);
    assert!(
        pc.contains(&"verified") && pc.contains(&"killed") && !pc.contains(&"pinned"),
        "{pc:?}"
    );
}

/// A neighbour fills the page cache of the worker's cgroup (writes a file twice the cgroup's
/// limit): usage sits at the limit, but the memory watch counts only what the kernel cannot
/// reclaim, so the healthy worker keeps serving. (Before: it counted the page cache and stopped
/// the worker.) Proof that the watch looked while the cache was full: a second guarded worker,
/// in a cgroup of its own and growing for real, is stopped afterwards (every look covers every
/// guarded worker).
#[test]
fn a_neighbour_filling_the_page_cache_does_not_stop_a_healthy_worker() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let guard = GuardProc::start(
        &sim,
        &state,
        &["--memory-margin", "16MiB", "--poll-ms", "50"],
    );
    let limit: u64 = 200 << 20;
    let cg = TestCgroup::new("guard-cache", limit);
    let mut w = worker(&sim, "32MiB", 0, Some(&cg));
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    let file = sim.path().join("neighbour.dat");
    let written = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "echo $$ > '{}/cgroup.procs' && exec dd if=/dev/zero of='{}' bs=1M count=400 conv=fsync status=none",
            cg.path().display(),
            file.display()
        ))
        .status()
        .unwrap();
    assert!(written.success());
    let usage: u64 = fs::read_to_string(cg.path().join("memory.usage_in_bytes"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        usage > limit - (48 << 20),
        "the page cache should fill the cgroup (usage {usage} of {limit})"
    );
    // The canary: short of room for real (its unreclaimable memory plus 40 MiB, less than its
    // 32 MiB of device memory plus the 16 MiB margin), without growing.
    let cg2 = TestCgroup::new("guard-cache-canary", 2 * limit);
    let mut canary = worker(&sim, "32MiB", 1, Some(&cg2));
    make_restored(&sim, &state, canary.pid);
    let idc = ProcId::of(canary.pid).unwrap();
    wait_attached(&state, idc, 1);
    let stat = fs::read_to_string(cg2.path().join("memory.stat")).unwrap();
    let value = |key: &str| -> u64 {
        stat.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or(0)
    };
    let unreclaimable = value("total_rss ") + value("total_shmem ") + value("total_unevictable ");
    fs::write(
        cg2.path().join("memory.limit_in_bytes"),
        (unreclaimable + (40 << 20)).to_string(),
    )
    .unwrap();
    eventually(PATIENCE, "the watch to stop the canary", || {
        guard.log().contains(&format!(
            "memory pressure: suspended and stopped pid {}",
            canary.pid
        ))
    });
    canary.wait_exit();
    assert!(names(&records(&state), idc).contains(&"verified"));
    assert!(!w.has_exited(), "the healthy worker was stopped");
    let path = names(&records(&state), id);
    assert!(
        !path.contains(&"checkpointed") && !path.contains(&"killed"),
        "{path:?}"
    );
    assert_eq!(http(w.port, "GET", "/health", "").0, 200);
    sim.assert_no_wedge();
    let _ = fs::remove_file(&file);
}

/// A client in another pid namespace (a container) names a process by its pid there: the guard
/// translates it (`NSpid`) and attaches to that very process. (Before: the guard took the pid as
/// its own, naming another process or none.)
#[test]
fn an_attach_from_another_pid_namespace_guards_the_process_it_names() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let _guard = GuardProc::start(&sim, &state, &["--no-memory-watch"]);
    let script = format!(
        "sleep 600 & '{}' --state-dir '{}' guard attach --pid $! >/dev/null && echo attached $! || echo failed; wait",
        common::CRYO,
        state.display()
    );
    let mut ns = Command::new("unshare")
        .args(["--pid", "--kill-child", "--mount-proc", "sh", "-c", &script])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(ns.stdout.as_mut().unwrap()),
        &mut line,
    )
    .unwrap();
    let inner: i32 = match line.trim().strip_prefix("attached ") {
        Some(p) => p.parse().unwrap(),
        None => {
            let _ = ns.kill();
            let out = ns.wait_with_output().unwrap();
            panic!(
                "the attach from the namespace failed: {line}{}",
                common::stderr(&out)
            );
        }
    };
    let st = GuardClient::new(&StateDir::new(&state))
        .status()
        .unwrap()
        .unwrap();
    let host: Vec<i32> = st
        .guarded
        .iter()
        .map(|g| g.pid)
        .filter(|p| cryo_proc::status(*p).is_ok_and(|s| s.nspid.len() == 2 && s.nspid[1] == inner))
        .collect();
    assert_eq!(host.len(), 1, "the guard guards {st:?}");
    assert_ne!(tracer_pid(host[0]), 0);
    assert_eq!(
        fs::read_to_string(format!("/proc/{}/comm", host[0]))
            .unwrap()
            .trim(),
        "sleep"
    );
    let _ = ns.kill();
    let _ = ns.wait();
}
