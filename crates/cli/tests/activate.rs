#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo activate` in front of a parked sim worker: 20 concurrent requests wake it once and are
//! all answered (as before the park); an idle worker is parked again; the activator SIGKILLed in
//! the middle of an activation leaves the worker safe (ledger empty), and `cryo wake` finishes.

mod common;
use common::events;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};

use common::{eventually, http, stderr, stdout, Endpoint, Sim, WorkerSpec, PATIENCE};
use cryo_journal::Event;

fn state() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("cryo-activate-state-")
        .tempdir()
        .unwrap()
}

fn count(st: &Path, f: impl Fn(&Event) -> bool) -> usize {
    events(st).iter().filter(|e| f(e)).count()
}

/// `cryo activate` for `pid`, listening on a unix socket in `st`; returns once it listens.
struct Activate {
    child: Child,
    sock: PathBuf,
}

impl Activate {
    fn start(sim: &Sim, st: &Path, pid: i32, port: u16, extra: &[&str]) -> Activate {
        let sock = st.join("svc.sock");
        let mut child = sim
            .cmd_at(st)
            .args(["activate", &pid.to_string(), "--upstream"])
            .arg(format!("127.0.0.1:{port}"))
            .arg("--listen")
            .arg(format!("unix:{}", sock.display()))
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert!(line.contains("activator listening"), "{line:?}");
        Activate { child, sock }
    }

    fn complete(&self, prompt: &str) -> (u16, String) {
        http(
            Endpoint::Unix(self.sock.clone()),
            "POST",
            "/v1/completions",
            prompt,
        )
    }
}

impl Drop for Activate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn park(sim: &Sim, st: &Path, pid: i32) {
    let o = sim
        .cmd_at(st)
        .args(["park", &pid.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
}

fn text(body: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["text"].as_str().unwrap().to_string()
}

#[test]
fn twenty_concurrent_requests_wake_a_parked_worker_once_and_idle_parks_it_again() {
    let sim = Sim::start();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("64MiB"));
    let before = w.complete("same prompt");
    park(&sim, st.path(), w.pid);
    let a = Activate::start(&sim, st.path(), w.pid, w.port, &["--idle-timeout", "1"]);

    let answers: Vec<(u16, String)> = std::thread::scope(|s| {
        let jobs: Vec<_> = (0..20)
            .map(|_| s.spawn(|| a.complete("same prompt")))
            .collect();
        jobs.into_iter().map(|j| j.join().unwrap()).collect()
    });
    for (status, body) in &answers {
        assert_eq!(*status, 200, "{body}");
        assert_eq!(text(body), before);
    }
    assert_eq!(
        count(st.path(), |e| matches!(e, Event::WakeStarted { .. })),
        1
    );
    assert_eq!(
        count(st.path(), |e| matches!(e, Event::WakeCompleted { .. })),
        1
    );

    // Idle for a second: parked again (the positive event: a second park completed).
    eventually(PATIENCE, "the idle park", || {
        (count(st.path(), |e| matches!(e, Event::ParkCompleted { .. })) == 2).then_some(())
    });
    assert!(!sim.listed(w.pid));
    // And the next request wakes it again.
    let (status, body) = a.complete("same prompt");
    assert_eq!(status, 200, "{body}");
    assert_eq!(text(&body), before);
    assert_eq!(
        count(st.path(), |e| matches!(e, Event::WakeStarted { .. })),
        2
    );
    sim.assert_no_wedge();
}

/// Attack: the activator dies (SIGKILL) as soon as it has started a wake. Whatever point the
/// wake had reached (CHECKPOINTED, LOCKED with its context restored, or running), nothing is
/// torn down, and `cryo wake` brings the worker back with its answers unchanged.
#[test]
fn the_activator_killed_mid_activation_leaves_the_worker_safe() {
    let sim = Sim::start();
    let st = state();
    let w = sim.spawn(WorkerSpec::new("256MiB"));
    let before = w.complete("p");
    park(&sim, st.path(), w.pid);
    let mut a = Activate::start(&sim, st.path(), w.pid, w.port, &["--idle-timeout", "0"]);
    let sock = a.sock.clone();
    let client = std::thread::spawn(move || {
        // The connection dies with the activator: any outcome but a hang is fine here.
        let _ =
            std::panic::catch_unwind(|| http(Endpoint::Unix(sock), "POST", "/v1/completions", "p"));
    });
    eventually(PATIENCE, "the wake to start", || {
        (count(st.path(), |e| matches!(e, Event::WakeStarted { .. })) == 1).then_some(())
    });
    a.child.kill().unwrap();
    a.child.wait().unwrap();
    client.join().unwrap();
    sim.assert_no_wedge();
    let o = sim
        .cmd_at(st.path())
        .args(["wake", &w.pid.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(sim.state(w.pid), "running");
    assert_eq!(w.complete("p"), before);
    sim.assert_no_wedge();
}

/// `cryo bench activate` runs end to end at a tiny size (root and CRIU: every arm is real).
#[test]
fn bench_activate_runs_tiny() {
    cryo_testkit::require_criu_and_root();
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let out = common::cryo()
        .args([
            "bench", "activate", "--sizes", "16MiB", "--rounds", "1", "--json",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in [
        "park_ms",
        "standby_ms",
        "thaw_ms",
        "bare_ms",
        "raw_ms",
        "parking_ms",
    ] {
        let v = rows[0][k][0].as_f64().unwrap_or(f64::NAN);
        assert!(v > 0.0, "{k}: {rows}");
    }
}

/// Issue 12 item 3: the activator is the agent's. With an agent running, `cryo activate`
/// returns once the agent listens, and `cryo status` lists it. The agent is SIGKILLed while the
/// worker is parked behind the activator, and a new agent starts: it listens on the same
/// address again (its predecessor's unix socket replaced), and the next request wakes the
/// worker once (answers unchanged, traced by the new agent's guard). `--remove` ends the
/// activator and leaves the worker as it is.
#[test]
fn an_agent_owned_activator_survives_an_agent_restart_and_still_wakes_the_worker() {
    let sim = Sim::start();
    let st = state();
    let mut agent = common::AgentProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let w = sim.spawn(WorkerSpec::new("64MiB"));
    let before = w.complete("p");
    park(&sim, st.path(), w.pid);
    let sock = st.path().join("svc.sock");
    let listen = format!("unix:{}", sock.display());
    let o = sim
        .cmd_at(st.path())
        .args(["activate", &w.pid.to_string(), "--upstream"])
        .arg(format!("127.0.0.1:{}", w.port))
        .args(["--listen", &listen, "--idle-timeout", "0"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("activator listening on") && stdout(&o).contains("the agent's"),
        "{}",
        stdout(&o)
    );
    let status = || -> serde_json::Value {
        let o = sim
            .cmd_at(st.path())
            .args(["status", "--json"])
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let v = status();
    assert_eq!(v["activators"][0]["spec"]["listen"], listen.as_str(), "{v}");
    assert_eq!(v["activators"][0]["phase"], "parked", "{v}");

    // The agent dies with the worker parked behind its activator; a new one starts.
    agent.kill();
    drop(agent);
    let agent = common::AgentProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let (code, body) = http(Endpoint::Unix(sock.clone()), "POST", "/v1/completions", "p");
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), before);
    assert_eq!(
        count(st.path(), |e| matches!(e, Event::WakeCompleted { .. })),
        1
    );
    assert_ne!(
        common::procs::tracer_pid(w.pid),
        0,
        "woken untraced by the new agent's guard"
    );
    assert_eq!(status()["activators"][0]["activations"], 1);

    // Removed: the address is free, the worker serves as it is.
    let o = sim
        .cmd_at(st.path())
        .args(["activate", "--remove", &listen])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(!sock.exists());
    assert_eq!(status()["activators"], serde_json::json!([]));
    assert_eq!(w.complete("p"), before);
    stop_then_end(&sim, st.path(), w.pid, agent);
}

/// `cryo stop PID` through `agent`, which must succeed; then the agent and its pin holder
/// end, and nothing was torn down live.
fn stop_then_end(sim: &Sim, st: &Path, pid: i32, agent: common::AgentProc) {
    let o = sim
        .cmd_at(st)
        .args(["stop", &pid.to_string()])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    drop(agent);
    common::stop_pin_holder(st);
    sim.assert_no_wedge();
}

/// `cryo activate` through the agent for worker `w` (parked), listening on `svc.sock` in `st`;
/// the socket's path.
fn agent_activator(sim: &Sim, st: &Path, w: &common::Worker) -> PathBuf {
    let sock = st.join("svc.sock");
    let o = sim
        .cmd_at(st)
        .args(["activate", &w.pid.to_string(), "--upstream"])
        .arg(format!("127.0.0.1:{}", w.port))
        .arg("--listen")
        .arg(format!("unix:{}", sock.display()))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    assert!(stdout(&o).contains("the agent's"), "{}", stdout(&o));
    sock
}

/// A simulated GPU, an agent, a worker (what it answers to "p") and the agent's activator in
/// front of it on `svc.sock`.
struct Fronted {
    sim: Sim,
    st: tempfile::TempDir,
    agent: common::AgentProc,
    w: common::Worker,
    before: String,
    sock: PathBuf,
}

impl Fronted {
    /// `parked`: the worker is parked before the activator is made.
    fn start(parked: bool) -> Fronted {
        Self::start_with(parked, |_, _| {})
    }

    /// As [`Fronted::start`], `f` adjusting the agent's command first (given the state
    /// directory).
    fn start_with(parked: bool, f: impl FnOnce(&mut std::process::Command, &Path)) -> Fronted {
        let sim = Sim::start();
        let st = state();
        let agent = common::AgentProc::start_with(&sim, st.path(), &["--no-memory-watch"], |c| {
            f(c, st.path())
        });
        let w = sim.spawn(WorkerSpec::new("64MiB"));
        let before = w.complete("p");
        if parked {
            park(&sim, st.path(), w.pid);
        }
        let sock = agent_activator(&sim, st.path(), &w);
        Fronted {
            sim,
            st,
            agent,
            w,
            before,
            sock,
        }
    }
}

/// The journal says an agent listened again for an activator, the socket taken from its keeper
/// (`handed`) or bound again.
fn assert_listening_again(st: &Path, handed: bool) {
    let events = events(st);
    assert!(
        events.iter().any(|e| matches!(
            e,
            Event::ActivatorListening { again: true, handed: h, .. } if *h == handed
        )),
        "{events:?}"
    );
}

/// Attack (session 7): the agent is SIGKILLed while a client's bytes are being forwarded
/// through its activator to the woken worker, and a new agent starts. What must hold: the
/// worker's context is never torn down (ledger empty) and it keeps serving; the new agent's
/// guard traces it; the client is not left hanging (its connection ends, within a deadline);
/// a new client is served without a second wake; and the journal says what the new agent did
/// with the activator (listening again, the worker found active).
#[test]
fn an_agent_killed_mid_forward_leaves_the_worker_serving_guarded_and_the_client_not_hanging() {
    use std::io::Write;
    let Fronted {
        sim,
        st,
        mut agent,
        w,
        before,
        sock,
    } = Fronted::start(true);

    // A client wakes the worker and sends half a request: the activator has connected to the
    // worker and forwards the bytes as they come.
    let mut client = std::os::unix::net::UnixStream::connect(&sock).unwrap();
    client.set_read_timeout(Some(PATIENCE)).unwrap();
    client
        .write_all(
            b"POST /v1/completions HTTP/1.1\r\nhost: w\r\ncontent-length: 64\r\n\r\nhalf a prompt",
        )
        .unwrap();
    let forwarded = || {
        let o = sim
            .cmd_at(st.path())
            .args(["status", "--json"])
            .output()
            .unwrap();
        let v: serde_json::Value = serde_json::from_str(&stdout(&o)).unwrap_or_default();
        v["activators"][0]["forwarded"].as_u64() == Some(1)
    };
    eventually(PATIENCE, "the connection to be forwarded", forwarded);
    assert_eq!(
        common::procs::tracer_process(w.pid),
        agent.child.id() as i32
    );

    agent.kill();
    drop(agent);
    // The client: its connection ends (EOF or a reset), never a hang.
    cryo_testkit::http::assert_ends(&mut client);
    assert!(
        common::procs::alive(w.pid),
        "the worker died with the agent"
    );
    sim.assert_no_wedge();

    let agent = common::AgentProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let me = agent.child.id() as i32;
    eventually(
        PATIENCE,
        "the new agent's guard to trace the worker",
        || common::procs::tracer_process(w.pid) == me,
    );
    let (code, body) = http(Endpoint::Unix(sock.clone()), "POST", "/v1/completions", "p");
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), before);
    assert_eq!(
        count(st.path(), |e| matches!(e, Event::WakeCompleted { .. })),
        1,
        "woken twice"
    );
    let listening: Vec<Event> = events(st.path())
        .into_iter()
        .filter(|e| matches!(e, Event::ActivatorListening { .. }))
        .collect();
    assert!(
        matches!(
            &listening[..],
            [Event::ActivatorListening { again: false, found: p0, .. }, Event::ActivatorListening { again: true, handed: true, found: p1, pids, .. }]
                if p0 == "parked" && p1 == "active" && pids.iter().any(|p| p.pid == w.pid)
        ),
        "{listening:?}"
    );
    stop_then_end(&sim, st.path(), w.pid, agent);
}

/// Stops `agent` (SIGSTOP: nothing is accepted), connects `queued` clients through its
/// activator on `sock` and sends their requests, SIGKILLs the agent, connects one more client
/// while no agent runs, and starts a new agent; returns it and how many of the `queued + 1`
/// clients the worker answered (each with `before`).
fn served_across_an_agent_death(
    sim: &Sim,
    st: &Path,
    mut agent: common::AgentProc,
    sock: &Path,
    before: &str,
    queued: usize,
) -> (common::AgentProc, usize) {
    use std::io::{Read, Write};
    let request = b"POST /v1/completions HTTP/1.1\r\nhost: w\r\nconnection: close\r\ncontent-length: 1\r\n\r\np";
    // A connection refused, or whose request cannot be sent, is not served.
    let send = || {
        let mut c = std::os::unix::net::UnixStream::connect(sock).ok()?;
        c.set_read_timeout(Some(PATIENCE)).unwrap();
        c.write_all(request).ok()?;
        Some(c)
    };
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGSTOP,
    )
    .unwrap();
    // Every thread stopped (the signal is asynchronous): nothing is accepted from here on.
    eventually(PATIENCE, "the agent to be stopped", || {
        common::procs::all_threads_in(agent.pid(), &['T'])
    });
    let mut clients: Vec<_> = (0..queued).map(|_| send()).collect();
    agent.kill();
    drop(agent);
    clients.push(send());
    let agent = common::AgentProc::start(sim, st, &["--no-memory-watch"]);
    let mut served = 0;
    for mut c in clients.into_iter().flatten() {
        let mut answer = String::new();
        if c.read_to_string(&mut answer).is_ok() && answer.starts_with("HTTP/1.1 200") {
            let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
            assert_eq!(text(body), before, "{answer}");
            served += 1;
        }
    }
    (agent, served)
}

/// Attack (session 7): connections that wait in the listening socket's backlog when the agent
/// dies, and connections made while no agent runs. The agent is stopped (SIGSTOP: nothing is
/// accepted), five clients connect through its activator and send their requests, the agent is
/// SIGKILLed, a sixth client connects, and a new agent starts: every one of the six is
/// answered, by the worker, once (the listening socket was handed over, never bound again).
/// Before the keeper (a socket bound again by the next agent): 0 of 6, the five queued ones
/// reset when the agent died and the sixth refused.
#[test]
fn connections_queued_when_the_agent_dies_are_served_by_the_next_agent() {
    let Fronted {
        sim,
        st,
        agent,
        w: _w,
        before,
        sock,
    } = Fronted::start(false);
    let (_agent, served) = served_across_an_agent_death(&sim, st.path(), agent, &sock, &before, 5);
    assert_eq!(served, 6, "of 6 connections made while no agent accepted");
    // The socket was taken from the dead agent's keeper, not bound again.
    assert_listening_again(st.path(), true);
    sim.assert_no_wedge();
}

/// The keeper of the (one) activator in `st`, as its record names it.
fn keeper_of(st: &Path) -> i32 {
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(st.join("activators.json")).unwrap()).unwrap();
    let keeper = saved[0]["keeper"]["pid"].as_i64().unwrap() as i32;
    assert!(common::procs::alive(keeper), "{saved}");
    keeper
}

/// Attack (session 8): every signal whose default action ends or stops a process, but SIGKILL
/// and SIGSTOP (the classic ones, SIGALRM, SIGXCPU, SIGXFSZ, SIGVTALRM, SIGPROF, SIGUSR1/2,
/// SIGHUP, SIGPIPE, SIGTERM, SIGINT, SIGQUIT... and the real-time ones), sent to an
/// activator's keeper one by one while a client connects through the activator. The keeper must
/// survive each, as the pin holder does (it holds the socket the next agent takes; only its
/// agent ends it, with SIGKILL); each client is served by the agent; and afterwards connections
/// queued when the agent dies are still served by the next agent, the socket taken from that
/// keeper. Before (session 7's keeper blocked HUP INT QUIT TERM PIPE USR1 USR2 only): the first
/// signal it neither blocked nor ignored (SIGILL) killed it.
#[test]
fn an_activators_keeper_survives_every_killing_signal_and_still_hands_the_socket_over() {
    let Fronted {
        sim,
        st,
        agent,
        w: _w,
        before,
        sock,
    } = Fronted::start(false);
    let keeper = keeper_of(st.path());
    for s in cryo_holder::killing_signals() {
        let client = {
            let sock = sock.clone();
            std::thread::spawn(move || http(Endpoint::Unix(sock), "POST", "/v1/completions", "p"))
        };
        common::procs::kill(keeper, s);
        eventually(
            PATIENCE,
            &format!("the keeper to survive signal {s}"),
            || common::procs::survives(keeper, s),
        );
        let (code, body) = client.join().unwrap();
        assert_eq!(code, 200, "signal {s}: {body}");
        assert_eq!(text(&body), before);
    }
    let (_agent, served) = served_across_an_agent_death(&sim, st.path(), agent, &sock, &before, 3);
    assert_eq!(served, 4, "of 4 connections made while no agent accepted");
    assert_listening_again(st.path(), true);
    sim.assert_no_wedge();
}

/// Attack (session 7): the keeper that holds an activator's socket for the next agent dies
/// (SIGKILL) before the agent does. The next agent cannot take the socket over: it binds the
/// address again and serves, and the journal says the socket was not handed over.
#[test]
fn a_dead_keeper_makes_the_next_agent_bind_again() {
    let Fronted {
        sim,
        st,
        mut agent,
        w: _w,
        before,
        sock,
    } = Fronted::start(false);
    let keeper = keeper_of(st.path());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(keeper),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    common::procs::reap(keeper);
    agent.kill();
    drop(agent);
    let _agent = common::AgentProc::start(&sim, st.path(), &["--no-memory-watch"]);
    let (code, body) = http(Endpoint::Unix(sock), "POST", "/v1/completions", "p");
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), before);
    assert_listening_again(st.path(), false);
    sim.assert_no_wedge();
}

/// Attack (session 23): a request through the agent's activator in front of a parked worker
/// while a `cryo wake` of it is at work (paused at `wake-before-restore`: it holds the worker's
/// lock, read it CHECKPOINTED). The worker is about to serve: the request must wait for that
/// wake (within its activation deadline) and be served, with the answer it had before the park,
/// never answered 503 nor the worker parked again by the activator; the worker is restored once;
/// no wedge.
#[test]
fn a_request_meeting_a_wake_at_work_waits_for_it_and_is_served() {
    let failpoint = cryo_lifecycle::park::WAKE_BEFORE_RESTORE;
    let f = Fronted::start_with(true, |c, st| {
        c.env("CRYO_FAILPOINT", failpoint)
            .env("CRYO_FAILPOINT_RESUME", st.join("go"));
    });
    let st = f.st.path();
    let wake = common::a_wake_paused_before_its_restore(&f.sim, st, f.w.pid, Some(&f.agent));
    let sock = f.sock.clone();
    let request =
        std::thread::spawn(move || http(Endpoint::Unix(sock), "POST", "/v1/completions", "p"));
    // The activator's wake met the wake at work (it says it waits), or the request ended.
    eventually(PATIENCE, "the activator to meet the wake at work", || {
        request.is_finished() || f.agent.log().contains("waiting for it")
    });
    let (status, said) = common::let_go(st, wake);
    assert!(status.success(), "the wake failed: {said}");
    let (code, body) = request.join().unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(text(&body), f.before);
    assert_eq!(f.sim.state(f.w.pid), "running");
    assert_eq!(
        count(
            st,
            |e| matches!(e, Event::RestoreStarted { pid, .. } if pid.pid == f.w.pid)
        ),
        1
    );
    assert_eq!(
        count(st, |e| matches!(e, Event::ParkStarted { .. })),
        1,
        "parked again by the activator"
    );
    let Fronted {
        sim, st, agent, w, ..
    } = f;
    stop_then_end(&sim, st.path(), w.pid, agent);
}
