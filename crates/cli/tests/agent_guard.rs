#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Issue 10's wedges and the guard's endgame through the node agent (`cryo agent run`, whose
//! guard hands pins to the pin holder), on the simulated GPU, as root. Each test has its own
//! driver, state directory and agent; at every step the wedge ledger says whether a live
//! restored context was torn down, and the journal says what happened.

mod common;

use std::path::Path;

use common::{eventually, make_restored, ok, procs, AgentProc, Sim, Worker, WorkerSpec, PATIENCE};
use cryo_journal::{AttachSource, Event, ProcId};

fn records(state: &Path) -> Vec<Event> {
    cryo_journal::read(state.join("journal"))
        .map(|s| s.records.into_iter().map(|r| r.event).collect())
        .unwrap_or_default()
}

fn attach_sources(state: &Path, id: ProcId) -> Vec<AttachSource> {
    records(state)
        .iter()
        .filter_map(|e| match e {
            Event::GuardAttached { pid, source } if *pid == id => Some(*source),
            _ => None,
        })
        .collect()
}

fn wait_attached(state: &Path, id: ProcId, times: usize) {
    eventually(PATIENCE, "GuardAttached in the journal", || {
        attach_sources(state, id).len() >= times
    });
}

fn wait_pinned(state: &Path, id: ProcId) {
    eventually(PATIENCE, "the pin in the journal", || {
        records(state)
            .iter()
            .any(|e| matches!(e, Event::Pinned { pid, .. } if *pid == id))
    });
}

use common::procs::kill;

/// A sim worker on GPU `gpu` in its own process group.
fn worker(sim: &Sim, gpu: u32) -> Worker {
    sim.spawn(WorkerSpec::new("16MiB").gpu(gpu).process_group())
}

/// Issue 10 item 4, last sentence: a healthy restored worker that exits on its own (`exit(0)`,
/// a server shutting down in an orderly way) is pinned (its context is live, the exit is not
/// intercepted before its threads die) but never drains the node: with `--endgame drain`, the
/// fresh neighbour keeps serving and the restart command does not run. The positive event
/// waited for is the exit's journal record, written after the exit stop where a drain would have
/// been started (`draining` stays set until the restart command has run, so "not draining and no
/// output" means no drain, ever, for this exit). A SIGKILL of a second restored worker then does
/// drain: proof that the endgame was armed.
#[test]
fn an_ordinary_exit_of_a_healthy_restored_worker_never_drains_the_node() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let out = sim.path().join("restart.out");
    let args = common::drain_args(&out);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let agent = AgentProc::start(&sim, &state, &args);
    let mut a = worker(&sim, 0);
    let b = worker(&sim, 1);
    let neighbour = worker(&sim, 1);
    make_restored(&sim, &state, a.pid);
    make_restored(&sim, &state, b.pid);
    let (ida, idb) = (ProcId::of(a.pid).unwrap(), ProcId::of(b.pid).unwrap());
    wait_attached(&state, ida, 1);
    wait_attached(&state, idb, 1);

    assert_eq!(a.http("POST", "/exit?code=0", "").0, 200);
    eventually(PATIENCE, "the exit in the journal", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::ProcessExited { pid, .. } if *pid == ida))
    });
    assert!(a.wait_exit().success());
    // Pinned (nothing tells a healthy exit from a crash once its threads are gone)...
    wait_pinned(&state, ida);
    sim.assert_no_wedge();
    // ...but no drain: read `draining` first; a drain that ran and ended left its output.
    let st = agent.client().status().unwrap();
    assert!(!st.guard.draining, "an ordinary exit started a drain");
    assert!(!out.exists(), "an ordinary exit ran the restart command");
    assert!(procs::alive(neighbour.pid), "the neighbour was stopped");
    assert!(
        agent.log().contains("exited on its own: pinned, no drain"),
        "{}",
        agent.log()
    );

    // A death by a signal drains: the neighbour is stopped safely, the command runs once.
    b.sigkill();
    eventually(PATIENCE, "the restart command", || out.exists());
    eventually(PATIENCE, "the drain to stop the neighbour", || {
        !procs::alive(neighbour.pid)
    });
    sim.assert_no_wedge();
    let gpus = std::fs::read_to_string(&out).unwrap();
    assert_eq!(gpus.lines().count(), 1, "{gpus}");
    assert!(gpus.contains(&sim.gpu_uuid(1)), "{gpus}");
}

/// Reproduced wedge (b) of issue 10, through the agent: a worker restored by another tool and
/// attached by pid through the agent (`cryo guard attach --pid`) is attached again by a
/// restarted agent (SIGKILLed, started again), so its `kill -9` is pinned, not torn down.
#[test]
fn a_restarted_agent_reattaches_what_the_operator_attached() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let mut agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, 0);
    // Restored by another tool: journaled elsewhere, so only the operator's attach names it.
    make_restored(&sim, &sim.path().join("other-tool"), w.pid);
    let id = ProcId::of(w.pid).unwrap();
    ok({
        let mut c = sim.cmd_at(&state);
        c.args(["guard", "attach", "--pid", &w.pid.to_string()]);
        c
    });
    wait_attached(&state, id, 1);
    assert!(agent.log().contains("attach"), "{}", agent.log());
    agent.kill();
    eventually(PATIENCE, "the kernel to detach", || {
        procs::tracer_pid(w.pid) == 0
    });
    let agent2 = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    // Attached again before its socket answered (the guard re-attaches at start).
    let tracer = procs::tracer_pid(w.pid);
    assert_eq!(
        cryo_proc::tgid(tracer).ok().flatten(),
        Some(agent2.pid()),
        "the restarted agent dropped the worker (tracer {tracer})"
    );
    assert_eq!(
        attach_sources(&state, id),
        vec![AttachSource::Operator, AttachSource::Operator],
        "the journal must say why it is guarded, both times"
    );
    w.sigkill();
    w.wait_exit();
    wait_pinned(&state, id);
    sim.assert_no_wedge();
    assert!(agent2
        .client()
        .status()
        .unwrap()
        .guard
        .pins
        .iter()
        .any(|p| p.pid == w.pid));
}

/// Reproduced wedge (c) of issue 10, through the agent: the agent holds a pin (in its pin
/// holder), gets SIGQUIT (logged, ignored: it still answers), then SIGKILL: the pinned context
/// outlives it (still listed, no wedge), a restarted agent adopts the pin (its GPU stays fenced,
/// nothing journaled as lost), and only the operator's release tears the context down.
#[test]
fn pins_survive_sigquit_and_sigkill_of_the_agent_and_are_adopted_by_the_next_one() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let gpu0 = sim.gpu_uuid(0);
    let mut agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let mut w = worker(&sim, 0);
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    wait_attached(&state, id, 1);
    w.sigkill();
    w.wait_exit();
    wait_pinned(&state, id);
    eventually(PATIENCE, "the pins handed to the holder", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::PinsHanded { pid, .. } if *pid == id))
    });

    kill(agent.pid(), libc::SIGQUIT);
    eventually(PATIENCE, "the agent to log SIGQUIT", || {
        agent.log().contains("signal=SIGQUIT")
    });
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "SIGQUIT killed the agent"
    );
    agent.client().status().unwrap();
    agent.kill();
    assert!(sim.listed(w.pid), "the pinned context died with the agent");
    sim.assert_no_wedge();

    let agent2 = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let st = agent2.client().status().unwrap();
    assert!(st.guard.pins.iter().any(|p| p.pid == w.pid), "{st:?}");
    assert!(!records(&state)
        .iter()
        .any(|e| matches!(e, Event::PinsLost { .. })));
    let fence = cryo_state::StateDir::new(&state).fence();
    assert!(fence.fences(&gpu0.parse().unwrap()).unwrap());
    sim.assert_no_wedge();
    sim.release_pins(&state, &gpu0);
    assert_eq!(sim.wait_ledger(1).len(), 1, "the release tears it down");
    assert!(!fence.fences(&gpu0.parse().unwrap()).unwrap());
}
