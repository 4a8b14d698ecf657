#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The pre-thawed standby pool in the agent (`cryo standby`), with real CRIU and the simulated
//! GPU. Needs root and CRIU (`scripts/install-criu.sh`): without them these tests fail loudly.
//!
//! The worker runs in its own pid and network namespaces (as in a container), so several
//! standbys of one image coexist with the same pids and port inside; each is reached in its own
//! network namespace. Attacks: two claims at once, a standby SIGKILLed while ready, the image
//! replaced under the pool, the agent killed mid-refill, a fenced GPU, a second standby of an
//! image without namespaces.

mod common;

use std::path::{Path, PathBuf};
use std::process::Output;

use common::{eventually, program, stderr, stdout, AgentProc, Sim, WorkerSpec, PATIENCE};
use cryo_journal::Event;

use cryo_testkit::require_criu_and_root as criu_present;

/// A simulated GPU, a private copy of `cryo` for the workers (CRIU refuses an executable that
/// changed), the agent's state directory, and the agent.
struct Env {
    sim: Sim,
    bin: common::Program,
    state: PathBuf,
    agent: Option<AgentProc>,
}

impl Env {
    fn start() -> Env {
        criu_present();
        let sim = Sim::start();
        let bin = program().copied_to(&sim.path().join("cryo-worker"));
        let state = sim.path().join("state");
        let agent = Some(AgentProc::start(&sim, &state, &["--no-memory-watch"]));
        Env {
            sim,
            bin,
            state,
            agent,
        }
    }

    fn run(&self, args: &[&str]) -> Output {
        self.sim.cmd_at(&self.state).args(args).output().unwrap()
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.run(args);
        assert!(
            o.status.success(),
            "cryo {args:?}: {}\n{}",
            stdout(&o),
            stderr(&o)
        );
        stdout(&o)
    }

    /// A worker in its own namespaces (seed `seed`), frozen into `image`; returns what it
    /// answered to "q" before.
    fn frozen(&self, image: &Path, seed: u64, replace: bool) -> String {
        self.frozen_at(image, seed, replace).0
    }

    /// [`Env::frozen`], and the port it served on (in its namespace).
    fn frozen_at(&self, image: &Path, seed: u64, replace: bool) -> (String, u16) {
        let mut w = self.sim.spawn(
            WorkerSpec::new("32MiB")
                .seed(seed)
                .own_namespaces()
                .program(self.bin.clone()),
        );
        let answer = w.complete("q");
        let port = w.port;
        let pid = w.pid.to_string();
        let mut args = vec!["freeze", &pid, "--image", image.to_str().unwrap()];
        if replace {
            args.push("--replace");
        }
        self.ok(&args);
        w.reap();
        (answer, port)
    }

    /// A worker (seed `seed`) frozen into `img` in the test's directory and a pool of one
    /// standby of it, ready: the image, what the worker answered to "q", the port it serves on
    /// (in its namespace), the standby's root (host pid).
    fn pool_of_one(&self, seed: u64) -> (PathBuf, String, u16, i32) {
        let image = self.sim.path().join("img");
        let (before, port) = self.frozen_at(&image, seed, false);
        self.ok(&create_args(image.to_str().unwrap(), "1", &[]));
        let root = self.wait_ready(1)[0];
        (image, before, port, root)
    }

    /// An agent of this state directory (the test dropped the one before) that stops at the
    /// failpoint `failpoint`; let through once `resume` exists, if named.
    fn agent_at(&self, failpoint: &str, resume: Option<&Path>) -> AgentProc {
        AgentProc::start_with(&self.sim, &self.state, &["--no-memory-watch"], |c| {
            c.env("CRYO_FAILPOINT", failpoint);
            if let Some(r) = resume {
                c.env("CRYO_FAILPOINT_RESUME", r);
            }
        })
    }

    fn list(&self) -> serde_json::Value {
        serde_json::from_str(&self.ok(&["standby", "list", "--json"])).unwrap()
    }

    /// The ready standbys of the one pool.
    fn ready(&self) -> Vec<serde_json::Value> {
        let l = self.list();
        l["pools"][0]["ready"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// Waits until the pool has `n` ready standbys; returns their root pids.
    fn wait_ready(&self, n: usize) -> Vec<i32> {
        eventually(PATIENCE, "the standbys to be ready", || {
            let r = self.ready();
            (r.len() == n).then(|| {
                r.iter()
                    .map(|s| s["root"]["pid"].as_i64().unwrap() as i32)
                    .collect::<Vec<_>>()
            })
        })
    }

    fn claim(&self, image: &Path) -> Output {
        self.run(&[
            "standby",
            "claim",
            "--image",
            image.to_str().unwrap(),
            "--json",
        ])
    }

    fn events(&self) -> Vec<Event> {
        cryo_journal::read(self.state.join("journal"))
            .unwrap()
            .records
            .into_iter()
            .map(|r| r.event)
            .collect()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Every worker of the test, suspend-before-kill through the stop path; again once the
        // agent is gone: a refill it finished meanwhile (after a claim) was left running for
        // good. (The agent stays up through the first pass: killed mid-refill, it can leave what
        // its CRIU half restored.)
        let stop_all = |env: &Env| {
            for p in procs_of(&env.bin) {
                let _ = env.run(&["stop", &p.to_string()]);
            }
        };
        stop_all(self);
        // No refill starts once the pools are removed; one under way when the agent is killed
        // can leave a standby restored and never made ready, which the next agent ends.
        if self.agent.is_some() {
            if let Ok(l) = serde_json::from_str::<serde_json::Value>(&stdout(
                &self.run(&["standby", "list", "--json"]),
            )) {
                for p in l["pools"].as_array().into_iter().flatten() {
                    if let Some(image) = p["image"].as_str() {
                        let _ = self.run(&["standby", "remove", "--image", image]);
                    }
                }
            }
        }
        drop(self.agent.take());
        drop(AgentProc::start(
            &self.sim,
            &self.state,
            &["--no-memory-watch"],
        ));
        stop_all(self);
        common::stop_pin_holder(&self.state);
    }
}

/// Pids running the workers' private binary (host pids).
fn procs_of(bin: &common::Program) -> Vec<i32> {
    let want = std::fs::canonicalize(bin.bin()).unwrap();
    let mut out = Vec::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = e.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        if std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|x| x == want) {
            out.push(pid);
        }
    }
    out
}

fn answer(pid: i32, port: u16) -> String {
    let (status, body) =
        cryo_testkit::http::http_in_netns(pid, port, "POST", "/v1/completions", "q");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    v["text"].as_str().unwrap().to_string()
}

/// Two standbys of one image, each in its own pid and network namespaces (same pid 1 and port
/// inside, distinct host pids), CHECKPOINTED and off the GPU; two claims at once get one each,
/// both serve the original's answers, guarded; the pool refills to two.
#[test]
fn two_standbys_of_one_image_two_claims_at_once_and_the_pool_refills() {
    let env = Env::start();
    let image = env.sim.path().join("img");
    let before = env.frozen(&image, 7, false);
    let img = image.to_str().unwrap();
    env.ok(&create_args(img, "2", &[]));
    let roots = env.wait_ready(2);
    assert_ne!(roots[0], roots[1]);
    for r in &roots {
        assert_eq!(env.sim.state(*r), "checkpointed");
        assert!(!env.sim.listed(*r), "a standby holds device memory");
        let st = cryo_proc::status(*r).unwrap();
        assert_eq!(st.nspid.last(), Some(&1), "pid 1 of its own namespace");
    }
    // `cryo status`: the pool, its standbys and the host memory they hold, not as parked workers.
    let st: serde_json::Value = serde_json::from_str(&env.ok(&["status", "--json"])).unwrap();
    let pool = &st["standby_pools"][0];
    assert_eq!(pool["image"], img, "{st}");
    assert_eq!(pool["count"], 2);
    assert_eq!(pool["ready"].as_array().unwrap().len(), 2, "{st}");
    let held = pool["host_bytes"].as_u64().unwrap();
    assert!(
        held > 64 << 20,
        "two standbys of 32 MiB of device memory hold {held} bytes"
    );
    assert_eq!(pool["device_bytes"], 64u64 << 20, "{st}");
    assert_eq!(st["parked"].as_array().unwrap().len(), 0, "{st}");
    let words = env.ok(&["status"]);
    assert!(words.contains("2 of 2 ready, full"), "{words}");
    // Metrics: ready standbys and their host memory per image, standbys made.
    let client = env.agent.as_ref().unwrap().client();
    eventually(PATIENCE, "the standbys in the metrics", || {
        let m = client.metrics().unwrap();
        m.contains(&format!("cryo_standbys_ready{{image=\"{img}\"}} 2"))
            && m.contains("cryo_standby_host_bytes{image=")
            && m.contains("cryo_standbys_total{event=\"ready\"} 2")
    });

    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(|| env.claim(&image));
        let b = s.spawn(|| env.claim(&image));
        (a.join().unwrap(), b.join().unwrap())
    });
    let mut claimed = Vec::new();
    for o in [&a, &b] {
        assert!(o.status.success(), "{}\n{}", stdout(o), stderr(o));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        assert_eq!(v["outcome"], "serving");
        assert_eq!(v["wake"]["guarded"], true, "{v}");
        claimed.push(v["standby"]["root"]["pid"].as_i64().unwrap() as i32);
    }
    claimed.sort_unstable();
    let mut want = roots.clone();
    want.sort_unstable();
    assert_eq!(claimed, want, "two claims got the same standby");
    let port = served_port(&env, claimed[0]);
    for pid in &claimed {
        assert_eq!(env.sim.state(*pid), "running");
        assert_eq!(answer(*pid, port), before);
        assert_ne!(
            common::procs::tracer_pid(*pid),
            0,
            "claimed but not guarded"
        );
    }
    // Refilled in the background, with new ones.
    let again = env.wait_ready(2);
    assert!(again.iter().all(|p| !claimed.contains(p)), "{again:?}");
    env.sim.assert_no_wedge();
}

/// The port the (one) worker of a standby listens on, from its own network namespace's view.
fn served_port(_env: &Env, pid: i32) -> u16 {
    let tcp = std::fs::read_to_string(format!("/proc/{pid}/net/tcp")).unwrap();
    for line in tcp.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        // st 0A: LISTEN, local address 0100007F:PORT.
        if f.get(3) == Some(&"0A") {
            if let Some((_, port)) = f[1].split_once(':') {
                return u16::from_str_radix(port, 16).unwrap();
            }
        }
    }
    panic!("pid {pid} listens on no TCP port:\n{tcp}");
}

/// Attack: a ready standby is SIGKILLed (CHECKPOINTED: nothing live to tear down, ledger
/// empty); the pool drops it and refills. Then the image is replaced under the pool: the old
/// standbys are stale, dropped, never handed out; a claim serves the new image's answers.
#[test]
fn a_killed_standby_is_refilled_and_a_replaced_image_makes_the_pool_stale() {
    let env = Env::start();
    let image = env.sim.path().join("img");
    let old = env.frozen(&image, 7, false);
    let img = image.to_str().unwrap();
    env.ok(&create_args(img, "1", &[]));
    let first = env.wait_ready(1)[0];
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(first),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let second = eventually(PATIENCE, "a new standby", || {
        env.wait_ready(1).first().copied().filter(|p| *p != first)
    });
    assert!(env.events().iter().any(|e| matches!(e,
        Event::StandbyDropped { root, reason, .. } if root.pid == first && reason.contains("exited"))));
    env.sim.assert_no_wedge();

    let new = env.frozen(&image, 8, true);
    assert_ne!(old, new);
    let third = eventually(PATIENCE, "a standby of the new image", || {
        env.wait_ready(1).first().copied().filter(|p| *p != second)
    });
    assert!(env.events().iter().any(|e| matches!(e,
        Event::StandbyDropped { root, reason, .. } if root.pid == second && reason.contains("stale"))));
    let o = env.claim(&image);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["standby"]["root"]["pid"], third);
    assert_eq!(answer(third, served_port(&env, third)), new);
    env.sim.assert_no_wedge();
}

/// Attack: the agent is SIGKILLed while a refill is under way; the next agent rebuilds the pool
/// from the journal and refills it, leaving no unowned tree. A standby whose GPU is fenced is
/// never handed out (the claim is refused, the standby stays); a second standby of an image
/// without namespaces is refused with the reason.
#[test]
fn the_agent_killed_mid_refill_a_fenced_gpu_and_an_image_without_namespaces() {
    let mut env = Env::start();
    let image = env.sim.path().join("img");
    env.frozen(&image, 7, false);
    let img = image.to_str().unwrap();
    // An agent that stalls in the refill, CRIU not yet started.
    drop(env.agent.take());
    let stalled = env.agent_at(cryo_lifecycle::standby::STANDBY_BEFORE_RESTORE, None);
    env.ok(&create_args(img, "1", &[]));
    eventually(PATIENCE, "the refill to reach the failpoint", || {
        stalled
            .log()
            .contains("failpoint standby-before-restore reached")
    });
    let mut stalled = stalled;
    stalled.kill();
    drop(stalled);
    env.agent = Some(AgentProc::start(
        &env.sim,
        &env.state,
        &["--no-memory-watch"],
    ));
    let root = env.wait_ready(1)[0];
    // One tree of the image lives: the standby (nothing was left behind by the killed agent).
    let workers = procs_of(&env.bin);
    assert_eq!(workers, vec![root], "trees of the image: {workers:?}");

    // The GPU is fenced: the claim is refused, nothing restored, the standby kept.
    let gpu = env.sim.gpu.inspect.gpus().unwrap()[0].uuid.clone();
    cryo_state::StateDir::new(&env.state)
        .fence()
        .quarantine(&cryo_state::fence::FencedGpu::Gpu(gpu), "test fence", &[])
        .unwrap();
    let o = env.claim(&image);
    assert_eq!(o.status.code(), Some(3), "{}\n{}", stdout(&o), stderr(&o));
    assert_eq!(env.sim.state(root), "checkpointed");
    assert_eq!(env.wait_ready(1), vec![root]);

    // No namespaces: one standby at most.
    let flat = env.sim.path().join("flat");
    let mut w = env.sim.spawn(
        WorkerSpec::new("16MiB")
            .setsid()
            .http_unix()
            .program(env.bin.clone()),
    );
    env.ok(&[
        "freeze",
        &w.pid.to_string(),
        "--image",
        flat.to_str().unwrap(),
    ]);
    w.reap();
    let o = env.run(&create_args(flat.to_str().unwrap(), "2", &[]));
    assert_eq!(o.status.code(), Some(3), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("its own pid and network namespaces"),
        "{}",
        stderr(&o)
    );
    env.sim.assert_no_wedge();
}

/// `cryo standby create --image IMAGE --count COUNT EXTRA...`'s arguments.
fn create_args<'a>(image: &'a str, count: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec!["standby", "create", "--image", image, "--count", count];
    args.extend_from_slice(extra);
    args
}

/// Starts an agent of `env` that stalls between a standby's restore and its `StandbyReady`
/// (the orphan window), has it refill one standby (`count` in the pool), and SIGKILLs it there;
/// returns the root of the tree it left (CHECKPOINTED, unrecorded as ready).
fn orphan_left_by_a_killed_agent(env: &mut Env, count: &str) -> i32 {
    drop(env.agent.take());
    let before = procs_of(&env.bin);
    let mut stalled = env.agent_at(cryo_lifecycle::standby::STANDBY_BEFORE_READY, None);
    let img = env.sim.path().join("img");
    env.ok(&create_args(img.to_str().unwrap(), count, &[]));
    eventually(PATIENCE, "the refill to reach the failpoint", || {
        stalled
            .log()
            .contains("failpoint standby-before-ready reached")
    });
    let new: Vec<i32> = procs_of(&env.bin)
        .into_iter()
        .filter(|p| !before.contains(p))
        .collect();
    assert_eq!(new.len(), 1, "trees restored by the stalled agent: {new:?}");
    assert_eq!(env.sim.state(new[0]), "checkpointed");
    stalled.kill();
    new[0]
}

/// Attack: the agent is SIGKILLed after CRIU restored a standby and before its `StandbyReady`
/// (the orphan window). The next agent ends the orphan (the driver says CHECKPOINTED: nothing
/// live torn down, its host memory freed) and refills: one tree of the image, ledger empty.
/// Then the same window with the orphan's context made live behind cryo's back (restored and
/// unlocked): the next agent kills nothing of it and guards it.
#[test]
fn the_agent_killed_between_restore_and_ready_leaves_no_orphan_and_kills_no_live_context() {
    let mut env = Env::start();
    let image = env.sim.path().join("img");
    env.frozen(&image, 7, false);

    let orphan = orphan_left_by_a_killed_agent(&mut env, "1");
    env.agent = Some(AgentProc::start(
        &env.sim,
        &env.state,
        &["--no-memory-watch"],
    ));
    let root = env.wait_ready(1)[0];
    assert_ne!(root, orphan);
    eventually(PATIENCE, "the orphan to be ended", || {
        procs_of(&env.bin) == vec![root]
    });
    assert!(env.events().iter().any(|e| matches!(e,
        Event::StandbyDropped { root, reason, .. } if root.pid == orphan && reason.contains("unfinished") && reason.contains("removed"))));
    env.sim.assert_no_wedge();

    // The orphan's context is restored and unlocked behind cryo's back: a live context.
    let live = orphan_left_by_a_killed_agent(&mut env, "2");
    for call in ["restore", "unlock"] {
        let dir = env.sim.path().to_str().unwrap().to_string();
        let o = env.sim.cryo(&[
            "sim",
            "call",
            call,
            "--dir",
            &dir,
            "--pid",
            &live.to_string(),
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    assert_eq!(env.sim.state(live), "running");
    env.agent = Some(AgentProc::start(
        &env.sim,
        &env.state,
        &["--no-memory-watch"],
    ));
    eventually(PATIENCE, "the live orphan to be guarded", || {
        common::procs::tracer_pid(live) != 0
    });
    assert!(cryo_testkit::procs::alive(live));
    assert_eq!(env.sim.state(live), "running");
    assert!(env.events().iter().any(|e| matches!(e,
        Event::StandbyDropped { root, reason, .. } if root.pid == live && reason.contains("NOT killed"))));
    env.sim.assert_no_wedge();
}

/// Attack (issue 12 item 3): the standby's CRIU restore runs past its deadline. CRIU is held at
/// its gate (every process restored, none run, journaled `standby_restoring`) until the deadline
/// kills it; the restored tree lives in fresh namespaces, so CRIU's own clean-up (by the image's
/// pids) cannot find it. The agent must end that tree (it never ran: no driver fds, nothing
/// listed) and journal it dropped: no orphan, no live context torn down; the pool refills once
/// CRIU is let through. (Before the deadline the refill waited on CRIU forever.)
#[test]
fn a_standby_restore_past_its_criu_deadline_leaves_no_orphan_and_no_live_context() {
    let mut env = Env::start();
    let image = env.sim.path().join("img");
    env.frozen(&image, 7, false);
    let img = image.to_str().unwrap();
    drop(env.agent.take());
    let resume = env.sim.path().join("let-the-gate-go");
    let agent = env.agent_at(cryo_lifecycle::standby::STANDBY_AT_GATE, Some(&resume));
    env.ok(&create_args(img, "1", &["--criu-timeout", "3"]));
    eventually(PATIENCE, "CRIU to reach its gate", || {
        agent.log().contains("failpoint standby-at-gate reached")
    });
    let restoring: Vec<i32> = env
        .events()
        .iter()
        .find_map(|e| match e {
            Event::StandbyRestoring { pids, .. } => Some(pids.iter().map(|p| p.pid).collect()),
            _ => None,
        })
        .unwrap();
    assert!(restoring.iter().all(|p| cryo_testkit::procs::alive(*p)));
    // The positive event: the deadline killed CRIU (no CRIU left under the agent).
    let criu_under_agent = || {
        cryo_proc::tree(agent.pid())
            .unwrap_or_default()
            .into_iter()
            .any(|p| {
                std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "criu")
            })
    };
    eventually(PATIENCE, "CRIU to be killed at its deadline", || {
        !criu_under_agent()
    });
    std::fs::write(&resume, "").unwrap();
    let reason = eventually(PATIENCE, "the timed-out standby to be dropped", || {
        env.events().into_iter().find_map(|e| match e {
            Event::StandbyDropped { root, reason, .. } if root.pid == restoring[0] => Some(reason),
            _ => None,
        })
    });
    assert!(reason.contains("did not finish within 3 s"), "{reason}");
    for p in &restoring {
        eventually(PATIENCE, "the unresumed tree to be gone", || {
            !cryo_testkit::procs::alive(*p)
        });
    }
    env.sim.assert_no_wedge();
    // The pool recovers: the next refill passes the gate.
    let root = env.wait_ready(1)[0];
    assert!(!restoring.contains(&root));
    assert_eq!(procs_of(&env.bin), vec![root]);
    env.agent = Some(agent);
    env.sim.assert_no_wedge();
}

/// `cryo run`: the program is pid 1 of fresh pid and network namespaces (its own network
/// namespace, loopback up), session leader, stdin `/dev/null`, output in `--log`; `cryo run`
/// exits with its status; a program that is nowhere is refused.
#[test]
fn cryo_run_starts_a_program_in_fresh_namespaces() {
    criu_present();
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("log");
    let o = common::cryo()
        .args(["run", "--log", log.to_str().unwrap(), "--", "sh", "-c"])
        .arg("echo pid=$$; echo sid=$(cut -d' ' -f6 /proc/self/stat); readlink /proc/self/ns/net; ip -o link show lo; cat; exit 7")
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    let out = std::fs::read_to_string(&log).unwrap();
    // Its session id as /proc (the host's pid namespace) shows it: its host pid.
    let host: i32 = stdout(&o)
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {:?}", stdout(&o)));
    assert!(out.contains("pid=1\n"), "{out}");
    assert!(
        out.contains(&format!("sid={host}\n")),
        "not a session leader: {out}"
    );
    let ours = std::fs::read_link("/proc/self/ns/net").unwrap();
    assert!(
        !out.contains(ours.to_str().unwrap()),
        "the same network namespace: {out}"
    );
    assert!(out.contains("lo: <LOOPBACK,UP"), "{out}");
    let o = common::cryo()
        .args(["run", "--", "cryo-no-such-program"])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("no such program"), "{}", stderr(&o));
}

/// `cryo activate --standby IMAGE` through `env`'s agent, on a free loopback port, in front of
/// a worker that serves on `port` in its namespace (health checked there); the port it listens
/// on.
fn standby_activator(env: &Env, img: &str, port: u16, extra: &[&str]) -> u16 {
    let upstream = format!("127.0.0.1:{port}");
    let health = format!("http://127.0.0.1:{port}/health");
    let mut act = env
        .sim
        .cmd_at(&env.state)
        .args(["activate", "--standby", img, "--listen", "127.0.0.1:0"])
        .args(["--upstream", &upstream, "--health-url", &health])
        .args(extra)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(act.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let _ = act.kill();
    let _ = act.wait();
    line.split_whitespace()
        .nth(3)
        .and_then(|a| a.rsplit(':').next())
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no address in {line:?}"))
}

/// An activator in front of a standby pool (`cryo activate --standby IMAGE`): 20 concurrent
/// requests make one claim (every request answered with the image's answer, forwarded into the
/// claimed worker's network namespace, its health checked there); idle, the worker is parked in
/// place; the next request wakes it, with no second claim.
#[test]
fn an_activator_in_front_of_a_standby_pool_claims_once_for_20_requests_and_parks_when_idle() {
    let mut env = Env::start();
    let (image, before, port, root) = env.pool_of_one(7);
    let img = image.to_str().unwrap();
    let listen = standby_activator(&env, img, port, &["--idle-timeout", "1"]);
    let claims = || {
        env.events()
            .iter()
            .filter(|e| matches!(e, Event::StandbyClaimed { .. }))
            .count()
    };
    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let all: Vec<_> = (0..20)
            .map(|_| s.spawn(|| cryo_testkit::http::http(listen, "POST", "/v1/completions", "q")))
            .collect();
        all.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(body).unwrap();
        assert_eq!(v["text"], before.as_str());
    }
    assert_eq!(claims(), 1, "one claim for 20 concurrent requests");
    assert_eq!(env.sim.state(root), "running");
    // Idle: parked in place.
    eventually(PATIENCE, "the idle worker to be parked", || {
        env.sim.state(root) == "checkpointed"
    });
    let (status, body) = cryo_testkit::http::http(listen, "POST", "/v1/completions", "q");
    assert_eq!(status, 200, "{body}");
    assert_eq!(env.sim.state(root), "running");
    assert_eq!(claims(), 1, "woken in place, not claimed again");

    // The agent owns the activator: SIGKILLed and restarted, it listens again for the worker it
    // had claimed (kept with the activator), parks it when idle and wakes it in place: no
    // second claim.
    let mut old = env.agent.take().unwrap();
    old.kill();
    drop(old);
    env.agent = Some(AgentProc::start(
        &env.sim,
        &env.state,
        &["--no-memory-watch"],
    ));
    eventually(PATIENCE, "the idle worker to be parked again", || {
        env.sim.state(root) == "checkpointed"
    });
    let (status, body) = cryo_testkit::http::http(listen, "POST", "/v1/completions", "q");
    assert_eq!(status, 200, "{body}");
    assert_eq!(env.sim.state(root), "running");
    let claims = env
        .events()
        .iter()
        .filter(|e| matches!(e, Event::StandbyClaimed { .. }))
        .count();
    assert_eq!(claims, 1, "the restarted agent claimed again");
    env.sim.assert_no_wedge();
}

/// Attack (session 8): an activator in front of a standby pool, the agent SIGKILLed while it
/// forwards a client's connection to the worker it claimed from the pool (half a request
/// sent, the worker woken from its standby and traced by the agent), then a new agent. What
/// must hold: the worker is never torn down (the ledger stays empty) and keeps running; the
/// client's connection ends at once (EOF or reset, never a hang); the new agent's guard traces
/// the worker again, the next client is served with the image's answer and no second claim; the
/// journal says the new agent listens again on the socket its keeper handed over, for that
/// worker, found active. Passed on main before any change (session 7's keeper and re-listen
/// cover it): kept as the proof.
#[test]
fn a_standby_fronted_activator_s_agent_killed_mid_forward_tears_nothing_down() {
    use std::io::Write;
    let mut env = Env::start();
    let (image, before, port, root) = env.pool_of_one(11);
    let img = image.to_str().unwrap();
    let listen = standby_activator(&env, img, port, &[]);

    let mut client = std::net::TcpStream::connect(("127.0.0.1", listen)).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    client
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-length: 64\r\n\r\nhalf a prompt",
        )
        .unwrap();
    eventually(PATIENCE, "the connection to be forwarded", || {
        let o = env.run(&["status", "--json"]);
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap_or_default();
        v["activators"][0]["forwarded"].as_u64() == Some(1)
    });
    let mut agent = env.agent.take().unwrap();
    assert_eq!(common::procs::tracer_process(root), agent.pid());
    assert_eq!(env.sim.state(root), "running");

    agent.kill();
    drop(agent);
    cryo_testkit::http::assert_ends(&mut client);
    assert!(common::procs::alive(root), "the worker died with the agent");
    env.sim.assert_no_wedge();

    env.agent = Some(AgentProc::start(
        &env.sim,
        &env.state,
        &["--no-memory-watch"],
    ));
    let me = env.agent.as_ref().unwrap().pid();
    eventually(
        PATIENCE,
        "the new agent's guard to trace the worker",
        || common::procs::tracer_process(root) == me,
    );
    let (status, body) = cryo_testkit::http::http(listen, "POST", "/v1/completions", "q");
    assert_eq!(status, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["text"], before.as_str());
    let events = env.events();
    let claims = events
        .iter()
        .filter(|e| matches!(e, Event::StandbyClaimed { .. }))
        .count();
    assert_eq!(claims, 1, "claimed again");
    assert!(
        events.iter().any(|e| matches!(
            e,
            Event::ActivatorListening { again: true, handed: true, found, pids, .. }
                if found == "active" && pids.iter().any(|p| p.pid == root)
        )),
        "{events:?}"
    );
    env.sim.assert_no_wedge();
}

/// Attack (session 7): a standby's CRIU killed at its deadline *before* its gate, in an image
/// with namespaces of its own. The image is of a program (`cryo run`, pid 1 of its namespaces)
/// that holds a `flock` also held outside it, so CRIU's restore waits for the lock and never
/// reaches its gate. What CRIU restored half-way never ran (no context of it is live: the safe
/// kind to end) and lives in namespaces CRIU's own clean-up cannot see: it must be ended, and
/// the journal must say so; once the lock is free the pool fills.
#[test]
fn a_standby_restore_killed_before_its_gate_leaves_no_half_restored_process() {
    use std::os::fd::AsRawFd;
    let env = Env::start();
    let lock = std::fs::File::create(env.sim.path().join("held.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let isolated =
        common::run_isolated_sleep(common::cryo(), env.sim.path(), Some(held.as_raw_fd()));
    let pid = isolated.pid;
    let image = env.sim.path().join("img");
    env.ok(&[
        "freeze",
        &pid.to_string(),
        "--image",
        image.to_str().unwrap(),
    ]);
    let agent = env.agent.as_ref().unwrap().pid();
    env.ok(&create_args(
        image.to_str().unwrap(),
        "1",
        &["--criu-timeout", "3"],
    ));
    // The positive event: the refill failed at its CRIU deadline.
    eventually(PATIENCE, "the refill to fail at its CRIU deadline", || {
        env.list()["pools"][0]["last_error"]
            .as_str()
            .is_some_and(|e| e.contains("did not finish within 3 s"))
    });
    // Nothing half-restored left: no process under the agent in a pid namespace of its own.
    let me = std::process::id() as i32;
    let left: Vec<i32> = cryo_proc::tree(agent)
        .unwrap_or_default()
        .into_iter()
        .filter(|p| {
            cryo_proc::same_namespace(*p, me, cryo_proc::NamespaceKind::Pid).is_ok_and(|same| !same)
        })
        .collect();
    assert!(left.is_empty(), "half-restored processes left: {left:?}");
    assert!(
        env.events().iter().any(|e| matches!(
            e,
            Event::StandbyDropped { reason, .. } if reason.contains("before its gate")
        )),
        "{:?}",
        env.events()
    );
    env.sim.assert_no_wedge();
    drop(held);
    let root = env.wait_ready(1)[0];
    // The pool's standby is no worker of the test's binary: removed with its pool.
    env.ok(&["standby", "remove", "--image", image.to_str().unwrap()]);
    eventually(PATIENCE, "the standby to be removed", || {
        !cryo_testkit::procs::alive(root)
    });
}

/// Attack (the standby analogue of freeze_thaw's fork-loop test): the image's tree is a shell
/// (pid 1 of its namespaces, `cryo run`) and a child that spins until a file exists; the file
/// is made after the freeze, so the restored child exits as soon as CRIU resumes it, and the
/// root reaps it and forks a `sleep` in its place. A standby that lists and pairs its tree
/// after CRIU's exit finds the image's child gone and drops a sound standby, again and again;
/// paired at CRIU's gate (every process restored, none run), the standby is ready: its root,
/// the exited child left out (the worker's business: no context).
#[test]
fn a_standby_whose_child_exits_as_soon_as_it_resumes_is_paired_at_criu_s_gate() {
    let env = Env::start();
    let go = env.sim.path().join("go");
    let script = format!(
        "sh -c 'while [ ! -e {} ]; do :; done' & wait; while :; do sleep 1000; done",
        go.display()
    );
    let isolated =
        common::run_isolated(common::cryo(), env.sim.path(), None, &["sh", "-c", &script]);
    let pid = isolated.pid;
    eventually(PATIENCE, "the spinning child", || {
        cryo_proc::tree(pid).is_ok_and(|t| t.len() == 2)
    });
    let image = env.sim.path().join("img");
    let frozen = env.run(&[
        "freeze",
        &pid.to_string(),
        "--image",
        image.to_str().unwrap(),
    ]);
    assert!(frozen.status.success(), "{}", stderr(&frozen));
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(image.join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["processes"].as_array().unwrap().len(), 2);
    std::fs::write(&go, "").unwrap();
    env.ok(&create_args(image.to_str().unwrap(), "1", &[]));
    // The positive event: the first refill ended, ready or dropped.
    let first = eventually(PATIENCE, "the first standby to be ready or dropped", || {
        env.events()
            .into_iter()
            .find(|e| matches!(e, Event::StandbyReady { .. } | Event::StandbyDropped { .. }))
    });
    let Event::StandbyReady { root, pids, .. } = first else {
        panic!("the standby was dropped: {first:?}");
    };
    // The image's child exits as soon as it runs; still alive when the standby was kept (a
    // loaded host), it is named as a plain process of the standby, and then exits (the forked
    // `sleep` never does): either way the standby is its root, ready.
    assert_eq!(pids[0], root, "{pids:?}");
    assert!(pids.len() <= 2, "{pids:?}");
    if let Some(child) = pids.get(1) {
        eventually(PATIENCE, "the image's child to exit", || {
            !cryo_testkit::procs::alive(child.pid)
        });
    }
    assert_eq!(env.wait_ready(1), vec![root.pid]);
    env.ok(&["standby", "remove", "--image", image.to_str().unwrap()]);
    eventually(PATIENCE, "the standby to be removed", || {
        !cryo_testkit::procs::alive(root.pid)
    });
    env.sim.assert_no_wedge();
}

/// Attack (the real-CRIU half of standby::tests::a_standby_tree_that_cannot_be_paired_is_
/// refused_at_criu_s_gate): a pool's refill of an image whose restored tree cannot be paired
/// with its manifest is refused at CRIU's gate, where nothing of the tree has run: the refill
/// fails saying so, nothing is journaled restoring or ready, and the tree never runs. The image
/// is of a `cryo run` shell that spins until a file made after the freeze exists, then writes
/// `ran` (a resumed shell writes it at once); its manifest is re-signed with another command
/// name for the shell. The untampered image then makes a standby whose shell writes `ran`.
#[test]
fn a_standby_refill_refused_at_criu_s_gate_never_runs() {
    let env = Env::start();
    let dir = env.sim.path().to_path_buf();
    let (go, ran) = (dir.join("go"), dir.join("ran"));
    let script = format!(
        "while [ ! -e {} ]; do :; done; echo ran > {}; while :; do sleep 1000; done",
        go.display(),
        ran.display()
    );
    let isolated = common::run_isolated(common::cryo(), &dir, None, &["sh", "-c", &script]);
    let image = dir.join("img");
    let frozen = env.run(&[
        "freeze",
        &isolated.pid.to_string(),
        "--image",
        image.to_str().unwrap(),
    ]);
    assert!(frozen.status.success(), "{}", stderr(&frozen));
    std::fs::write(&go, "").unwrap();

    let renamed = dir.join("renamed");
    std::fs::create_dir(&renamed).unwrap();
    for e in std::fs::read_dir(&image).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), renamed.join(e.file_name())).unwrap();
    }
    let mpath = renamed.join("manifest.json");
    let mut m: cryo_criu::Manifest =
        serde_json::from_slice(&std::fs::read(&mpath).unwrap()).unwrap();
    m.processes[0].comm = "not-sh".into();
    m.manifest_sha256 = m.self_digest().unwrap();
    std::fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let renamed = renamed.to_str().unwrap();
    env.ok(&create_args(renamed, "1", &[]));
    let error = eventually(PATIENCE, "the refill to fail", || {
        env.list()["pools"][0]["last_error"]
            .as_str()
            .map(str::to_string)
    });
    assert!(error.contains("refused at cryo's gate"), "{error}");
    assert!(error.contains("\"not-sh\""), "{error}");
    env.ok(&["standby", "remove", "--image", renamed]);
    // The positive event first: nothing of a restored tree is left (the shell's command line
    // names the file it waits for).
    let marker = go.to_str().unwrap().to_string();
    eventually(PATIENCE, "the refused trees to be gone", || {
        !std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&marker))
        })
    });
    assert!(!ran.exists(), "a refused tree ran");
    let events = env.events();
    assert!(
        !events.iter().any(|e| matches!(
            e,
            Event::StandbyRestoring { .. } | Event::StandbyReady { .. } | Event::Parked { .. }
        )),
        "{events:?}"
    );

    // The image as frozen makes a standby, and its shell runs.
    env.ok(&create_args(image.to_str().unwrap(), "1", &[]));
    let root = env.wait_ready(1)[0];
    eventually(PATIENCE, "the standby's shell to write its file", || {
        ran.exists()
    });
    env.ok(&["standby", "remove", "--image", image.to_str().unwrap()]);
    eventually(PATIENCE, "the standby to be removed", || {
        !cryo_testkit::procs::alive(root)
    });
}

/// Attack (session 12) on a standby's claim: a plain helper of the worker (no CUDA state)
/// exits while the standby waits for its claim. The worker (its shell and its CUDA process) is
/// there, CHECKPOINTED: the pool keeps the standby and the claim hands that very one out,
/// serving, the exited helper left out. (Before: a claim needed every process of the standby
/// alive; the pool dropped it as "exited while ready" and the claim got another, or none.)
#[test]
fn a_standby_whose_plain_helper_exited_while_ready_is_kept_and_claimed() {
    let env = Env::start();
    let dir = env.sim.path().to_path_buf();
    let ready = dir.join("worker.ready");
    let script = format!(
        "{} sim worker --dir {} --gpu 0 --memory 32MiB --ready-file {} & sleep 1000 & wait",
        env.bin.bin().display(),
        dir.display(),
        ready.display()
    );
    let isolated = common::run_isolated(common::cryo(), &dir, None, &["sh", "-c", &script]);
    eventually(PATIENCE, "the worker to be ready", || ready.exists());
    let image = dir.join("img");
    let img = image.to_str().unwrap();
    let frozen = env.run(&["freeze", &isolated.pid.to_string(), "--image", img]);
    assert!(frozen.status.success(), "{}", stderr(&frozen));
    env.ok(&["standby", "create", "--image", img, "--count", "1"]);
    let root = env.wait_ready(1)[0];
    let helper = cryo_proc::tree(root)
        .unwrap()
        .into_iter()
        .find(|p| cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep"))
        .expect("the standby's helper");
    cryo_testkit::procs::kill(helper, nix::libc::SIGKILL);
    eventually(PATIENCE, "the helper to exit", || {
        !cryo_testkit::procs::alive(helper)
    });
    let out = env.claim(&image);
    assert!(out.status.success(), "{}\n{}", stdout(&out), stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["outcome"], "serving", "{v}");
    assert_eq!(
        v["standby"]["root"]["pid"], root,
        "another standby was handed out: {v}"
    );
    let dropped: Vec<Event> = env
        .events()
        .into_iter()
        .filter(|e| matches!(e, Event::StandbyDropped { .. }))
        .collect();
    assert!(dropped.is_empty(), "{dropped:?}");
    env.sim.assert_no_wedge();
}

/// How long past its bound a command on a stalled image may take before the test calls it hung.
const PAST_BOUND: std::time::Duration = std::time::Duration::from_secs(20);

/// `cmd`'s output if it ends within `limit`; else its pid (left running: what it waits for is
/// answered when the test's FUSE server goes).
fn output_within(
    mut cmd: std::process::Command,
    limit: std::time::Duration,
) -> Result<Output, u32> {
    use std::process::Stdio;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    rx.recv_timeout(limit).map(|o| o.unwrap()).map_err(|_| pid)
}

/// Attack (session 18): the file system of a pool's image stops answering once a standby of it
/// is ready (a dead disk, an NFS hard mount: the test kit's FUSE server holds the agent's
/// opens from then on). The agent looked at the image with no deadline, and its stale check did
/// so holding the pools' lock: the refill loop, every claim and `standby list` then waited for
/// the file system for good. Now a claim is refused within
/// `cryo_lifecycle::standby::CLAIM_IMAGE_LOOK`, naming the image, and hands nothing out
/// unlooked at; `standby create` of such an image is refused at its `--criu-timeout`; the
/// standby stays ready, and once the file system answers it is claimed and serves as before.
/// (Before: "the claim had not returned 30 s after it started".)
#[test]
fn a_standby_whose_image_stops_answering_stays_ready_and_its_claim_is_refused_in_time() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    use cryo_testkit::fuse::{Hold, Stalling};
    let env = Env::start();
    let backing = env.sim.path().join("img");
    let before = env.frozen(&backing, 11, false);
    let mnt = env.sim.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let stalled = Arc::new(AtomicBool::new(false));
    let hold = Arc::clone(&stalled);
    // Declared after `env`: dropped (every held request answered) before the agent is ended.
    let fuse = Stalling::mount(&backing, &mnt, Hold::Opens, move |_| {
        hold.load(Ordering::SeqCst)
    });
    let img = mnt.to_str().unwrap();
    env.ok(&create_args(img, "1", &[]));
    let root = env.wait_ready(1)[0];

    stalled.store(true, Ordering::SeqCst);
    let limit = cryo_lifecycle::standby::CLAIM_IMAGE_LOOK + PAST_BOUND;
    let mut claim = env.sim.cmd_at(&env.state);
    claim.args(["standby", "claim", "--image", img]);
    let out = output_within(claim, limit).unwrap_or_else(|pid| {
        panic!(
            "the claim (pid {pid}) had not returned {} s after it started",
            limit.as_secs()
        )
    });
    let err = stderr(&out);
    assert!(!out.status.success(), "claimed from a stalled image: {err}");
    assert!(
        err.contains(img) && err.contains("its file system did not answer"),
        "names the image and why: {err}"
    );
    assert!(fuse.held() > 0, "no open of the agent reached the server");

    let mut create = env.sim.cmd_at(&env.state);
    create.args(create_args(img, "2", &["--criu-timeout", "2"]));
    let limit = std::time::Duration::from_secs(2) + PAST_BOUND;
    let out = output_within(create, limit).unwrap_or_else(|pid| {
        panic!(
            "standby create (pid {pid}) had not returned {} s after it started",
            limit.as_secs()
        )
    });
    let err = stderr(&out);
    assert!(
        !out.status.success() && err.contains("its file system did not answer"),
        "a pool of a stalled image: {err}"
    );

    // Once the file system answers, the standby that stayed ready is claimed and serves.
    fuse.answer_all();
    let o = env.claim(&mnt);
    assert!(o.status.success(), "{}", stderr(&o));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["standby"]["root"]["pid"], root, "{v}");
    assert_eq!(answer(root, served_port(&env, root)), before);
    env.sim.assert_no_wedge();
    // No look of the agent's at the image any more (the refill loop looks at a pool's image
    // every tick), so that the mount goes with the server, never left busy.
    env.ok(&["standby", "remove", "--image", img]);
    drop(fuse);
}
