#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Pins that outlive the guard (`cryo guard --pin-holder`, as the agent runs it) on the simulated
//! GPU, as root: the guard is killed every way it can be (SIGQUIT, SIGKILL, SIGKILL in the middle
//! of handing fds over), the holder is upgraded and killed, and at every step the wedge ledger
//! says whether a live restored context was torn down, and the journal says what happened.

mod common;
use common::events as records;

use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use common::{eventually, make_restored, ok, Sim, Worker, WorkerSpec, PATIENCE};
use cryo_holder::{HeldPin, HolderClient, HolderInfo};
use cryo_journal::{Event, ProcId};
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;

/// The holder stays in the test's cgroup (tests must not create cgroups they do not remove);
/// moving into a cgroup of its own is tested in crates/holder.
const HOLDER_CGROUP: (&str, &str) = ("CRYO_HOLDER_CGROUP", "stay");

/// `cryo guard --pin-holder` with its log, SIGKILLed on drop.
struct Guard {
    child: Child,
    log: PathBuf,
}

impl Guard {
    fn start(sim: &Sim, state: &Path, env: &[(&str, &str)]) -> Guard {
        std::fs::create_dir_all(state).unwrap();
        let log = state.join(format!(
            "guard-{}.log",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        let f = std::fs::File::create(&log).unwrap();
        let child = sim
            .cmd_at(state)
            .args([
                "guard",
                "--pin-holder",
                "--no-memory-watch",
                "--scan",
                "none",
            ])
            .env("RUST_LOG", "info")
            .env(HOLDER_CGROUP.0, HOLDER_CGROUP.1)
            // A core dump (SIGQUIT) lands in the state directory, not in the source tree.
            .current_dir(state)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        let st = StateDir::new(state);
        eventually(PATIENCE, "the guard's socket", || {
            cryo_guard::control::GuardClient::new(&st)
                .status()
                .ok()
                .flatten()
                .is_some()
        });
        Guard { child, log }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn signal(&self, sig: rustix::process::Signal) {
        let _ = rustix::process::kill_process(
            rustix::process::Pid::from_raw(self.child.id() as i32).unwrap(),
            sig,
        );
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Asks the state directory's holder to exit on drop (it refuses while it holds pins: then it is
/// SIGKILLed, which is the end of the test anyway).
struct HolderCleanup(StateDir);

impl Drop for HolderCleanup {
    fn drop(&mut self) {
        let c = HolderClient::new(&self.0);
        let Ok(mut s) = c.connect() else { return };
        let pid = s.holder.id;
        if s.exit().is_err() {
            if let Ok(h) = pid.open() {
                let _ = h.signal(cryo_proc::Signal::SIGKILL);
            }
        }
    }
}

/// A simulated GPU, a state directory, and its holder asked to exit at the end.
struct Scene {
    _cleanup: HolderCleanup,
    st: StateDir,
    state: PathBuf,
    sim: Sim,
}

impl Scene {
    fn new() -> Scene {
        let sim = Sim::start();
        let state = sim.path().join("state");
        let st = StateDir::new(&state);
        Scene {
            _cleanup: HolderCleanup(st.clone()),
            st,
            state,
            sim,
        }
    }
}

fn labels(state: &Path, id: ProcId) -> Vec<&'static str> {
    records(state)
        .iter()
        .filter(|e| e.pids().contains(&id))
        .map(Event::label)
        .collect()
}

fn inventory(state: &Path) -> (HolderInfo, Vec<HeldPin>) {
    HolderClient::new(&StateDir::new(state))
        .inventory()
        .unwrap()
        .expect("no pin holder runs")
}

/// A restored worker on GPU 0, guarded, then SIGKILLed: its context is pinned (the guard must
/// not let it exit before the pins are safe). Returns its identity and GPU 0's UUID.
fn pinned_worker(sim: &Sim, state: &Path) -> (Worker, ProcId, String) {
    let gpu0 = sim.gpu_uuid(0);
    let w = sim.spawn(WorkerSpec::new("16MiB").gpu(0).process_group());
    make_restored(sim, state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    eventually(PATIENCE, "the guard to attach", || {
        labels(state, id).contains(&"guard attached")
    });
    w.sigkill();
    (w, id, gpu0)
}

#[test]
fn pins_outlive_the_guard_through_sigquit_sigkill_and_a_restart() {
    let s = Scene::new();
    let mut guard = Guard::start(&s.sim, &s.state, &[]);
    let (mut w, id, gpu0) = pinned_worker(&s.sim, &s.state);
    w.wait_exit();
    assert!(
        s.sim.settled_ledger().is_empty(),
        "wedge at the worker's death"
    );
    let journal = labels(&s.state, id);
    assert!(
        journal.contains(&"pinned") && journal.contains(&"pins handed to the holder"),
        "{journal:?}"
    );
    let (holder, pins) = inventory(&s.state);
    assert_eq!(pins.len(), 1, "{pins:?}");
    assert_eq!(pins[0].meta.pid, id);
    assert_eq!(pins[0].meta.gpus, vec![gpu0.parse::<FencedGpu>().unwrap()]);
    assert!(guard.log().contains("pin holder"), "{}", guard.log());
    // The holder is not the guard's child and leads its own session.
    let stat = cryo_proc::stat(holder.id.pid).unwrap();
    assert_ne!(stat.ppid, guard.child.id() as i32);
    assert_eq!(stat.session, holder.id.pid);
    // The status shows the pin, held by the holder.
    let status = cryo_guard::control::GuardClient::new(&s.st)
        .status()
        .unwrap()
        .unwrap();
    assert!(
        status
            .pins
            .iter()
            .any(|p| p.pid == id.pid && p.holder == Some(holder.id.pid)),
        "{status:?}"
    );

    // The guard dies: SIGQUIT (a core-dumping signal), then SIGKILL.
    guard.signal(rustix::process::Signal::Quit);
    guard.signal(rustix::process::Signal::Kill);
    let _ = guard.child.wait();
    assert!(s.sim.listed(id.pid), "the dead worker's context is gone");
    assert!(
        s.sim.settled_ledger().is_empty(),
        "wedge at the guard's death"
    );
    assert_eq!(inventory(&s.state).1, pins);
    assert!(s.st.fence().fences(&gpu0.parse().unwrap()).unwrap());

    // A new guard adopts the running holder and its pins.
    let guard2 = Guard::start(&s.sim, &s.state, &[]);
    assert!(
        guard2.log().contains("adopted the running pin holder"),
        "{}",
        guard2.log()
    );
    let status = cryo_guard::control::GuardClient::new(&s.st)
        .status()
        .unwrap()
        .unwrap();
    assert!(status.pins.iter().any(|p| p.pid == id.pid), "{status:?}");
    assert!(!labels(&s.state, id).contains(&"PINS LOST (likely wedge)"));
    let shown = ok({
        let mut c = s.sim.cmd_at(&s.state);
        c.arg("status");
        c
    });
    assert!(shown.contains(&gpu0), "{shown}");

    // The operator's release goes to the holder: that (and only that) tears the context down.
    assert!(s.sim.settled_ledger().is_empty());
    s.sim.release_pins(&s.state, &gpu0);
    assert_eq!(s.sim.wait_ledger(1).len(), 1);
    assert!(inventory(&s.state).1.is_empty());
    assert!(!s.st.fence().fences(&gpu0.parse().unwrap()).unwrap());
    assert!(records(&s.state)
        .iter()
        .any(|e| matches!(e, Event::PinsReleased { pid } if *pid == id)));
}

#[test]
fn a_guard_killed_after_sending_and_before_the_ack_loses_no_pin() {
    let s = Scene::new();
    let failpoint = s.state.join("pin-sent");
    let mut guard = Guard::start(
        &s.sim,
        &s.state,
        &[(
            cryo_guard::pins::FAILPOINT_PIN_SENT_ENV,
            failpoint.to_str().unwrap(),
        )],
    );
    let (mut w, id, gpu0) = pinned_worker(&s.sim, &s.state);
    eventually(PATIENCE, "the guard to send the pins", || {
        failpoint.exists()
    });
    // The worker is still held at its exit stop: the guard has not seen an acknowledgement.
    assert!(!w.has_exited());
    guard.kill();
    w.wait_exit();
    assert!(s.sim.settled_ledger().is_empty(), "a pin was lost");
    let pins = inventory(&s.state).1;
    assert_eq!(pins.len(), 1, "{pins:?}");
    assert_eq!(pins[0].meta.pid, id);
    // The next guard adopts it as held (the journal has no PinsHanded: it died first).
    let _guard2 = Guard::start(&s.sim, &s.state, &[]);
    let journal = labels(&s.state, id);
    assert!(journal.contains(&"pinned"), "{journal:?}");
    assert!(
        !journal.contains(&"PINS LOST (likely wedge)"),
        "{journal:?}"
    );
    assert!(s.st.fence().fences(&gpu0.parse().unwrap()).unwrap());
    s.sim.release_pins(&s.state, &gpu0);
    assert_eq!(s.sim.wait_ledger(1).len(), 1);
}

#[test]
fn the_holder_is_upgraded_while_it_holds_pins() {
    let s = Scene::new();
    let guard = Guard::start(&s.sim, &s.state, &[]);
    let (mut w, id, gpu0) = pinned_worker(&s.sim, &s.state);
    w.wait_exit();
    let (old, pins) = inventory(&s.state);
    assert_eq!(pins.len(), 1, "{pins:?}");
    let old_handle = old.id.open().unwrap();
    let out = ok({
        let mut c = s.sim.cmd_at(&s.state);
        c.args(["guard", "holder", "--detach", "--take-over"])
            .env(HOLDER_CGROUP.0, HOLDER_CGROUP.1);
        c
    });
    let new_pid: i32 = out.trim().parse().unwrap();
    assert_ne!(new_pid, old.id.pid);
    assert!(old_handle.wait_exit(PATIENCE), "the old holder stays");
    let (new, after) = inventory(&s.state);
    assert_eq!(new.id.pid, new_pid);
    assert_eq!(after, pins);
    assert!(s.sim.listed(id.pid));
    assert!(
        s.sim.settled_ledger().is_empty(),
        "wedge during the hand-over"
    );
    drop(guard);
    s.sim.release_pins(&s.state, &gpu0);
    assert_eq!(s.sim.wait_ledger(1).len(), 1);
}

#[test]
fn a_holder_that_died_is_journaled_as_lost_pins_and_the_fence_stays() {
    let s = Scene::new();
    let mut guard = Guard::start(&s.sim, &s.state, &[]);
    let (mut w, id, gpu0) = pinned_worker(&s.sim, &s.state);
    w.wait_exit();
    guard.kill();
    // The holder is SIGKILLed (the one signal it cannot ignore): the context is torn down.
    let (holder, pins) = inventory(&s.state);
    assert_eq!(pins.len(), 1, "{pins:?}");
    let h = holder.id.open().unwrap();
    h.signal(cryo_proc::Signal::SIGKILL).unwrap();
    assert!(h.wait_exit(PATIENCE));
    assert_eq!(s.sim.wait_ledger(1).len(), 1);
    let guard2 = Guard::start(&s.sim, &s.state, &[]);
    let journal = labels(&s.state, id);
    assert!(journal.contains(&"PINS LOST (likely wedge)"), "{journal:?}");
    assert!(guard2.log().contains("PINS LOST"), "{}", guard2.log());
    // The fence is not lifted by the holder's death.
    assert!(s.st.fence().fences(&gpu0.parse().unwrap()).unwrap());
    // Journaled once: a third start does not say it again.
    drop(guard2);
    let _guard3 = Guard::start(&s.sim, &s.state, &[]);
    let lost = labels(&s.state, id)
        .iter()
        .filter(|l| **l == "PINS LOST (likely wedge)")
        .count();
    assert_eq!(lost, 1);
}
