#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Issue 10 item 4, last sentence: `execve` by a guarded restored worker, through the node agent
//! (`cryo agent run`), on the simulated GPU, as root. An exec closes the worker's driver fds
//! (close-on-exec, as libcuda opens them) before any ptrace stop after it; the agent's guard
//! holds standing duplicates of them, so the old context is pinned (handed to the pin holder,
//! journaled, its GPU fenced), never torn down. The wedge ledger says whether it was.

mod common;

use std::io::{Read, Write};
use std::path::Path;

use common::{eventually, make_restored, procs, AgentProc, Sim, Worker, WorkerSpec, PATIENCE};
use cryo_journal::{Event, ProcId};

fn records(state: &Path) -> Vec<Event> {
    common::events(state)
}

fn wait_attached(state: &Path, id: ProcId) {
    eventually(PATIENCE, "GuardAttached in the journal", || {
        records(state)
            .iter()
            .any(|e| matches!(e, Event::GuardAttached { pid, .. } if *pid == id))
    });
}

/// `POST /exec?...` to the worker, raw: a successful exec closes the connection unanswered.
/// The answer's status line and body, empty when none came.
fn post_exec(w: &Worker, query: &str) -> String {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", w.port)).unwrap();
    s.set_read_timeout(Some(PATIENCE)).unwrap();
    write!(
        s,
        "POST /exec?{query} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut out = String::new();
    let _ = s.read_to_string(&mut out);
    out
}

/// Whether fd `fd` of `pid` is close-on-exec (`flags:` of `/proc/PID/fdinfo/FD`, octal).
fn cloexec(pid: i32, fd: i32) -> bool {
    let info = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
    let flags = info
        .lines()
        .find_map(|l| l.strip_prefix("flags:"))
        .map(|v| u64::from_str_radix(v.trim(), 8).unwrap())
        .unwrap();
    flags & libc::O_CLOEXEC as u64 != 0
}

fn worker(sim: &Sim) -> Worker {
    sim.spawn(WorkerSpec::new("16MiB").gpu(0).process_group())
}

/// The agent and one restored worker it guards, its driver fds close-on-exec as libcuda's
/// (NVIDIA/cuda-checkpoint#10's strace: `openat("/dev/nvidia1", O_RDWR|O_CLOEXEC)`,
/// `fcntl(F_GETFD) = FD_CLOEXEC`).
fn guarded_worker(sim: &Sim, state: &Path) -> (AgentProc, Worker, ProcId) {
    let agent = AgentProc::start(sim, state, &["--no-memory-watch"]);
    let w = worker(sim);
    make_restored(sim, state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(state, id);
    let fds = sim.gpu.inspect.driver_fds(w.pid).unwrap();
    assert!(!fds.is_empty(), "the worker holds no driver fd");
    for fd in &fds {
        assert!(cloexec(w.pid, *fd), "driver fd {fd} is not close-on-exec");
    }
    (agent, w, id)
}

/// An exec from `thread` (`leader` or `other`): the old context is pinned, not torn down; the
/// journal says so (`Pinned`, `PinsHanded`, `Execed` naming the execing thread), the GPU is
/// fenced, no drain; the new program runs on untraced. Only the operator's release tears the
/// context down (the ledger then has it: the pin was what held it).
fn exec_is_pinned(thread: &str) {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let (_agent, w, id) = guarded_worker(&sim, &state);
    let answer = post_exec(&w, &format!("path=/bin/sleep&arg=3600&thread={thread}"));
    assert!(answer.is_empty(), "the exec failed: {answer}");
    let execed = eventually(PATIENCE, "Execed in the journal", || {
        records(&state).into_iter().find_map(|e| match e {
            Event::Execed { pid, thread } if pid == id => Some(thread),
            _ => None,
        })
    });
    if thread == "leader" {
        assert_eq!(execed, w.pid, "the leader called execve");
    } else {
        assert_ne!(execed, w.pid, "another thread called execve");
    }
    // The new program runs (same pid), untraced.
    eventually(PATIENCE, "the new program", || {
        std::fs::read_to_string(format!("/proc/{}/comm", w.pid)).is_ok_and(|c| c.trim() == "sleep")
    });
    eventually(PATIENCE, "the guard to let go of the new program", || {
        procs::tracer_pid(w.pid) == 0
    });
    sim.assert_no_wedge();
    let ev = records(&state);
    let at = |f: &dyn Fn(&Event) -> bool| ev.iter().position(f);
    let pinned = at(&|e| matches!(e, Event::Pinned { pid, .. } if *pid == id));
    let handed = at(&|e| matches!(e, Event::PinsHanded { pid, .. } if *pid == id));
    let exec = at(&|e| matches!(e, Event::Execed { pid, .. } if *pid == id));
    assert!(
        pinned.is_some() && pinned < handed && handed < exec,
        "journal order: pinned {pinned:?}, handed {handed:?}, execed {exec:?}: {ev:?}"
    );
    let gpu0 = sim.gpu_uuid(0);
    let fence = std::fs::read_to_string(state.join("quarantine.json")).unwrap();
    assert!(fence.contains(&gpu0), "{fence}");
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::ProcessExited { pid, .. } if *pid == id)),
        "{ev:?}"
    );
    // The pin is what holds the context: released, it is torn down.
    sim.release_pins(&state, &gpu0);
    let l = sim.wait_ledger(1);
    assert_eq!(l[0].pid, w.pid, "{l:?}");
}

/// Attack (watched failing before the standing duplicates: the ledger recorded the teardown
/// at the exec): `execve` from the thread-group leader of a guarded restored worker.
#[test]
fn an_exec_from_the_leader_of_a_guarded_restored_worker_is_pinned() {
    exec_is_pinned("leader");
}

/// Attack: `execve` from another thread (the kernel kills the leader first, then gives the
/// execing thread its tid): the leader's exit stop is not taken for a death.
#[test]
fn an_exec_from_another_thread_of_a_guarded_restored_worker_is_pinned() {
    exec_is_pinned("other");
}

/// An exec that fails (ENOENT) changes nothing: no pin, no fence, still guarded, still serving.
#[test]
fn a_failed_exec_changes_nothing() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let (agent, w, id) = guarded_worker(&sim, &state);
    for thread in ["leader", "other"] {
        let answer = post_exec(&w, &format!("path=/nonexistent/cryo-exec&thread={thread}"));
        assert!(answer.contains("500"), "{answer}");
        assert!(answer.contains("No such file"), "{answer}");
    }
    let ev = records(&state);
    assert!(
        !ev.iter().any(|e| matches!(
            e,
            Event::Pinned { .. } | Event::Execed { .. } | Event::GpuQuarantined { .. }
        )),
        "{ev:?}"
    );
    assert!(
        !state.join("quarantine.json").exists() || {
            let f = std::fs::read_to_string(state.join("quarantine.json")).unwrap();
            !f.contains(&sim.gpu_uuid(0))
        }
    );
    let st = agent.client().status().unwrap();
    assert!(
        st.guard.guarded.iter().any(|g| g.pid == id.pid),
        "{:?}",
        st.guard
    );
    assert_eq!(w.http("GET", "/health", "").0, 200);
    sim.assert_no_wedge();
}

/// The standing duplicates cost one fd of the agent per driver fd of each guarded process, are
/// dropped once the journal shows it suspended, die with a SIGKILLed agent without touching the
/// worker (it holds its own), are taken again by the next agent, and never pin a healthy
/// process: no pin, no fence, no wedge, the worker serves throughout.
#[test]
fn standing_duplicates_neither_leak_nor_pin_a_healthy_worker() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let (mut agent, w, id) = guarded_worker(&sim, &state);
    let driver = sim.gpu.inspect.driver_fds(w.pid).unwrap().len();
    let standing = |agent: &AgentProc| common::standing_fds(&agent.client(), id.pid);
    eventually(PATIENCE, "standing duplicates of every driver fd", || {
        standing(&agent) == driver
    });
    agent.kill();
    eventually(PATIENCE, "the kernel to detach", || {
        procs::tracer_pid(w.pid) == 0
    });
    sim.assert_no_wedge();
    assert_eq!(w.http("GET", "/health", "").0, 200);
    let agent2 = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    eventually(PATIENCE, "standing duplicates taken again", || {
        standing(&agent2) == driver
    });
    // Parked (the journal shows it checkpointed): nothing live to hold, dropped.
    let cryo = |verb: &str| {
        common::ok({
            let mut c = sim.cmd_at(&state);
            c.args([verb, &w.pid.to_string()]);
            c
        })
    };
    cryo("park");
    eventually(PATIENCE, "standing duplicates dropped", || {
        standing(&agent2) == 0
    });
    // Woken: taken again before its unlock (the wake returns once it is traced and unlocked).
    cryo("wake");
    assert_eq!(standing(&agent2), driver);
    let ev = records(&state);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::Pinned { .. } | Event::GpuQuarantined { .. })),
        "{ev:?}"
    );
    assert_eq!(w.http("GET", "/health", "").0, 200);
    sim.assert_no_wedge();
}

/// `cmd` started, its output piped, once the agent's log says it reached failpoint `name`.
fn until_failpoint(
    agent: &AgentProc,
    mut cmd: std::process::Command,
    name: &str,
) -> std::process::Child {
    let child = cmd
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the agent at its failpoint", || {
        agent.log().contains(&format!("failpoint {name} reached"))
    });
    child
}

/// The agent (started with `extra`) and a worker that replaced its program (`POST /exec?QUERY`)
/// between the guard taking its standing duplicates and its seize (failpoint
/// `guard-before-seize`, on the attach a restore through the agent asks for while the worker is
/// still LOCKED); returned once that restore (`cryo gpu restore`) has ended, with its output.
fn exec_before_seize(
    sim: &Sim,
    state: &Path,
    extra: &[&str],
    query: &str,
) -> (AgentProc, Worker, ProcId, std::process::Output) {
    let resume = sim.path().join("resume");
    let agent = AgentProc::start_with(sim, state, extra, |c| {
        c.env("CRYO_FAILPOINT", cryo_guard::GUARD_BEFORE_SEIZE)
            .env("CRYO_FAILPOINT_RESUME", &resume);
    });
    let w = worker(sim);
    let id = ProcId::of(w.pid).unwrap();
    let gpu = |action: &str| {
        let mut c = sim.cmd_at(state);
        c.args(["gpu", action, "--pid", &w.pid.to_string()]);
        c
    };
    common::ok(gpu("lock"));
    common::ok(gpu("checkpoint"));
    let restore = until_failpoint(&agent, gpu("restore"), cryo_guard::GUARD_BEFORE_SEIZE);
    assert_eq!(procs::tracer_pid(w.pid), 0, "seized before the failpoint");
    let answer = post_exec(&w, query);
    assert!(answer.is_empty(), "the exec failed: {answer}");
    eventually(PATIENCE, "the new program", || {
        std::fs::read_to_string(format!("/proc/{}/comm", w.pid)).is_ok_and(|c| c.trim() == "sleep")
    });
    sim.assert_no_wedge();
    std::fs::write(&resume, "").unwrap();
    let out = restore.wait_with_output().unwrap();
    (agent, w, id, out)
}

/// The last seam of the exec work (issue 10): an `execve` between the guard taking a process's
/// standing duplicates and its seize. No exec stop can see it; the standing duplicates hold the
/// old context, and the look right after the seize finds its driver files gone and pins them:
/// nothing torn down, and the journal says so (`Pinned`, the GPU quarantined "while the guard
/// was attaching").
#[test]
fn an_exec_between_the_standing_duplicates_and_the_seize_is_pinned() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let (_agent, w, id, out) = exec_before_seize(
        &sim,
        &state,
        &["--no-memory-watch"],
        "path=/bin/sleep&arg=3600&thread=leader",
    );
    let ev = eventually(PATIENCE, "the pin in the journal", || {
        let ev = records(&state);
        ev.iter()
            .any(|e| matches!(e, Event::Pinned { pid, .. } if *pid == id))
            .then_some(ev)
    });
    sim.assert_no_wedge();
    assert!(
        ev.iter().any(|e| matches!(e, Event::GpuQuarantined { reason, .. } if reason.contains("while the guard was attaching"))),
        "{ev:?}\n{}",
        common::stderr(&out)
    );
    // The pin is what holds the context: released, it is torn down.
    sim.release_pins(&state, &sim.gpu_uuid(0));
    let l = sim.wait_ledger(1);
    assert_eq!(l[0].pid, w.pid, "{l:?}");
}

/// Attack (issue 10 follow-up): the process that replaced its program between the standing
/// duplicates and the seize no longer holds the restored context (the pin does). Its new
/// program then ends, normally (`kill`: false) or by SIGKILL, with `--endgame drain`: that end
/// is no restored context's teardown, so no second pin or quarantine and no drain (the
/// neighbour keeps running, the restart command never runs), and the pinned context is still
/// held (the ledger stays empty until the operator's release). The positive event waited for
/// is the process's exit, which a tracer holding it at its exit stop would have decided first.
/// Watched failing first: the death was pinned again ("none of its driver fds could be
/// pinned") and, killed, drained the node.
fn a_program_execed_before_the_seize_ends(kill: bool) {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let out = sim.path().join("restart.out");
    let args = common::drain_args(&out);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let neighbour = sim.spawn(WorkerSpec::new("16MiB").gpu(1).process_group());
    let query = format!(
        "path=/bin/sleep&arg={}&thread=leader",
        if kill { 3600 } else { 3 }
    );
    let (agent, mut w, id, _) = exec_before_seize(&sim, &state, &args, &query);
    eventually(PATIENCE, "the pin in the journal", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::Pinned { pid, .. } if *pid == id))
    });
    // Let go as at an exec stop: journaled, untraced, not guarded.
    assert!(
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::Execed { pid, thread: 0 } if *pid == id)),
        "{:?}",
        records(&state)
    );
    assert_eq!(procs::tracer_pid(w.pid), 0, "still traced");
    assert!(
        !agent
            .client()
            .status()
            .unwrap()
            .guard
            .guarded
            .iter()
            .any(|g| g.pid == id.pid),
        "still guarded"
    );
    if kill {
        w.sigkill();
    }
    let status = w.wait_exit();
    assert_eq!(status.success(), !kill, "{status:?}");
    sim.assert_no_wedge();
    let ev = records(&state);
    let pins = ev
        .iter()
        .filter(|e| matches!(e, Event::Pinned { pid, .. } if *pid == id))
        .count();
    let quarantines = ev
        .iter()
        .filter(|e| matches!(e, Event::GpuQuarantined { .. }))
        .count();
    assert_eq!(
        (pins, quarantines),
        (1, 1),
        "pinned or quarantined again: {ev:?}"
    );
    let st = agent.client().status().unwrap();
    assert!(!st.guard.draining, "its end started a drain");
    assert!(!out.exists(), "its end ran the restart command");
    assert!(procs::alive(neighbour.pid), "the neighbour was stopped");
    assert!(
        st.guard.pins.iter().any(|p| p.pid == id.pid),
        "the pin is gone: {:?}",
        st.guard
    );
    // Still held: released, the context is torn down.
    sim.release_pins(&state, &sim.gpu_uuid(0));
    let l = sim.wait_ledger(1);
    assert_eq!(l[0].pid, w.pid, "{l:?}");
}

#[test]
fn a_program_execed_before_the_seize_that_exits_is_no_restored_death() {
    a_program_execed_before_the_seize_ends(false);
}

#[test]
fn a_program_execed_before_the_seize_that_is_killed_drains_nothing() {
    a_program_execed_before_the_seize_ends(true);
}

/// Attack (issue 10 follow-up, the rolled-back suspension): a park that fails after its
/// checkpoint (failpoint `suspend-roll-back`) resumes the worker in place. The guard dropped the
/// worker's standing duplicates once the journal showed it checkpointed; an `execve` right after
/// the roll-back's unlock, before the guard's next look (its loop runs every 3 s here), must
/// still find them: the roll-back has the guard take them again before the unlock
/// (`GuardAttached` source `restore` between the restore and the unlock) and the old context is
/// pinned, never torn down. Watched failing first: the ledger recorded the teardown at the exec.
#[test]
fn an_exec_right_after_a_rolled_back_park_is_pinned() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let resume = sim.path().join("resume");
    let agent = AgentProc::start_with(
        &sim,
        &state,
        &["--no-memory-watch", "--poll-ms", "3000"],
        |c| {
            c.env("CRYO_FAILPOINT", cryo_lifecycle::suspend::SUSPEND_ROLL_BACK)
                .env("CRYO_FAILPOINT_RESUME", &resume);
        },
    );
    let w = worker(&sim);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id);
    let driver = sim.gpu.inspect.driver_fds(w.pid).unwrap().len();
    assert!(driver > 0, "the worker holds no driver fd");
    let standing = || common::standing_fds(&agent.client(), id.pid);
    eventually(PATIENCE, "standing duplicates of every driver fd", || {
        standing() == driver
    });
    let mut park = sim.cmd_at(&state);
    park.args(["park", &w.pid.to_string()]);
    let park = until_failpoint(&agent, park, cryo_lifecycle::suspend::SUSPEND_ROLL_BACK);
    // Checkpointed and journaled so: the guard's next look drops the standing duplicates.
    eventually(PATIENCE, "standing duplicates dropped", || standing() == 0);
    let unlocks = |ev: &[Event]| {
        ev.iter()
            .filter(|e| matches!(e, Event::Unlocked { pid, .. } if *pid == id))
            .count()
    };
    let before = unlocks(&records(&state));
    std::fs::write(&resume, "").unwrap();
    eventually(PATIENCE, "the roll-back's unlock", || {
        unlocks(&records(&state)) > before
    });
    let answer = post_exec(&w, "path=/bin/sleep&arg=3600&thread=leader");
    assert!(answer.is_empty(), "the exec failed: {answer}");
    let out = park.wait_with_output().unwrap();
    assert!(!out.status.success(), "{}", common::stderr(&out));
    eventually(PATIENCE, "Execed in the journal", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::Execed { pid, .. } if *pid == id))
    });
    sim.assert_no_wedge();
    let ev = records(&state);
    let at = |f: &dyn Fn(&Event) -> bool| ev.iter().rposition(f);
    let restored = at(&|e| matches!(e, Event::RestoreCompleted { pid, .. } if *pid == id));
    let announced = at(&|e| matches!(e, Event::GuardAttached { pid, .. } if *pid == id));
    let unlocked = at(&|e| matches!(e, Event::Unlocked { pid, .. } if *pid == id));
    assert!(
        restored < announced && announced < unlocked,
        "journal order: restored {restored:?}, guard {announced:?}, unlocked {unlocked:?}: {ev:?}"
    );
    assert!(
        ev.iter()
            .any(|e| matches!(e, Event::Pinned { pid, .. } if *pid == id)),
        "{ev:?}"
    );
    // The pin is what holds the context: released, it is torn down.
    sim.release_pins(&state, &sim.gpu_uuid(0));
    let l = sim.wait_ledger(1);
    assert_eq!(l[0].pid, w.pid, "{l:?}");
}
