#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo agent run|status|stop` and the commands that go through it, against the simulated GPU.
//! Every test has its own simulated driver, state directory and agent socket.

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{
    eventually, make_restored, ok, procs, run, stderr, stdout, succeeded, AgentProc, Sim, PATIENCE,
};
use cryo_api::{ClientError, ErrorKind};
use cryo_journal::{Event, ProcId};
use cryo_testkit::sim::WorkerSpec;

const NOTE: &str = "nothing guards restored workers";

fn records(state: &Path) -> Vec<Event> {
    cryo_journal::read(state.join("journal"))
        .map(|s| s.records.into_iter().map(|r| r.event).collect())
        .unwrap_or_default()
}

use common::procs::kill;

#[test]
fn stop_goes_through_the_agent_with_the_same_report() {
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let (pid, _) = sim.worker("16MiB");
    let out = run(&sim, &state, &["stop", &pid.to_string(), "--json"]);
    succeeded(&out);
    assert!(!stderr(&out).contains(NOTE), "{}", stderr(&out));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["outcome"], "stopped", "{v}");
    assert_eq!(v["processes"][0]["pid"], pid, "{v}");
    assert!(
        v["processes"][0]["suspended"]["checkpoint_ms"].is_number(),
        "{v}"
    );
    // The agent did it (its log), and progress reached the operator through the stream.
    assert!(agent.log().contains("stop"), "{}", agent.log());
    assert!(
        stderr(&out).contains(&format!("pid {pid}: checkpoint done")),
        "{}",
        stderr(&out)
    );
    assert!(!procs::alive(pid));
    sim.assert_no_wedge();
    // The text report.
    let (pid, _) = sim.worker("4MiB");
    let out = run(&sim, &state, &["stop", &pid.to_string()]);
    succeeded(&out);
    assert!(
        stdout(&out).contains("stopped 1 processes"),
        "{}",
        stdout(&out)
    );
    // A target that does not exist: the same error as standalone.
    let out = run(&sim, &state, &["stop", "999999999"]);
    assert_eq!(out.status.code(), Some(1), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("stopping the process tree of pid 999999999"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn without_an_agent_changes_say_once_that_nothing_guards_and_reads_say_nothing() {
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let (pid, _) = sim.worker("4MiB");
    let out = run(&sim, &state, &["stop", &pid.to_string()]);
    succeeded(&out);
    assert_eq!(stderr(&out).matches(NOTE).count(), 1, "{}", stderr(&out));
    let out = run(&sim, &state, &["status"]);
    succeeded(&out);
    assert!(!stderr(&out).contains(NOTE), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("agent: not running"),
        "{}",
        stdout(&out)
    );
    let out = run(&sim, &state, &["agent", "status"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stderr(&out).contains("no agent runs"), "{}", stderr(&out));
}

#[test]
fn one_agent_per_node() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let first = AgentProc::start(&sim, &state, &[]);
    let out = run(
        &sim,
        &state,
        &["agent", "run", "--metrics-listen", "127.0.0.1:0"],
    );
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains(&format!(
            "another agent runs on this state directory (pid {}, lock",
            first.pid()
        )),
        "{}",
        stderr(&out)
    );
    // The first one still serves.
    first.client().status().unwrap();
}

/// A copy of cryo that an unprivileged user can run, wherever the build lives.
fn cryo_for_nobody(sim: &Sim) -> std::path::PathBuf {
    let exe = sim.path().join("cryo-as-nobody");
    fs::copy(common::CRYO, &exe).unwrap();
    open(&exe, 0o755);
    exe
}

fn open(p: &Path, mode: u32) {
    fs::set_permissions(p, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap()
}

fn as_user(exe: &Path, state: &Path, uid: u32, gid: u32, args: &[&str]) -> Output {
    Command::new(exe)
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .env_remove("CRYO_AGENT_SOCKET")
        .uid(uid)
        .gid(gid)
        .output()
        .unwrap()
}

#[test]
fn peer_credentials_root_changes_the_read_group_reads_others_nothing() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    // nogroup (65534) reads.
    let agent = AgentProc::start(&sim, &state, &["--read-group", "nogroup"]);
    open(sim.path(), 0o755);
    let exe = cryo_for_nobody(&sim);
    // In the read group: reads, and changes nothing.
    let out = as_user(&exe, &state, 65534, 65534, &["agent", "status"]);
    succeeded(&out);
    assert!(
        stdout(&out).contains("reads: root and group nogroup"),
        "{}",
        stdout(&out)
    );
    let out = as_user(&exe, &state, 65534, 65534, &["agent", "stop"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("uid 65534 may not change anything through the agent"),
        "{}",
        stderr(&out)
    );
    let out = as_user(&exe, &state, 65534, 65534, &["stop", "1"]);
    assert!(
        stderr(&out).contains("may not change anything"),
        "{}",
        stderr(&out)
    );
    // Not in the group: the socket's mode keeps it out...
    let out = as_user(&exe, &state, 65534, 1, &["agent", "status"]);
    assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
    assert!(
        stderr(&out).contains("ermission denied"),
        "{}",
        stderr(&out)
    );
    // ...and when someone made the socket reachable by everyone, the peer-credential check is
    // what stands, for reads and changes alike.
    open(&cryo_state::StateDir::new(&state).agent_socket(), 0o666);
    for args in [&["agent", "status"][..], &["agent", "stop"], &["status"]] {
        let out = as_user(&exe, &state, 65534, 1, args);
        assert!(
            stderr(&out).contains("uid 65534 may not"),
            "{args:?}: {}{}",
            stdout(&out),
            stderr(&out)
        );
    }
    // The agent is still there, and root is answered.
    agent.client().status().unwrap();
    assert!(agent.log().contains("refused"), "{}", agent.log());
}

#[test]
fn signals_that_kill_by_default_are_logged_and_ignored_and_sigterm_stops_cleanly() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let mut agent = AgentProc::start(&sim, &state, &[]);
    let client = agent.client();
    for (sig, name) in [
        (libc::SIGHUP, "SIGHUP"),
        (libc::SIGQUIT, "SIGQUIT"),
        (libc::SIGUSR1, "SIGUSR1"),
        (libc::SIGUSR2, "SIGUSR2"),
        (libc::SIGPIPE, "SIGPIPE"),
        (libc::SIGALRM, "SIGALRM"),
        (libc::SIGVTALRM, "SIGVTALRM"),
        (libc::SIGPROF, "SIGPROF"),
        (libc::SIGIO, "SIGIO"),
        (libc::SIGPWR, "SIGPWR"),
        (libc::SIGXCPU, "SIGXCPU"),
        (libc::SIGXFSZ, "SIGXFSZ"),
        (libc::SIGSTKFLT, "SIGSTKFLT"),
        (libc::SIGTRAP, "SIGTRAP"),
        (libc::SIGSEGV, "SIGSEGV"),
        (libc::SIGABRT, "SIGABRT"),
        (libc::SIGRTMIN() + 3, "SIGRTMIN+3"),
    ] {
        kill(agent.pid(), sig);
        eventually(PATIENCE, &format!("the agent to log {name}"), || {
            agent.log().contains(&format!("signal={name}"))
        });
        assert!(
            agent.child.try_wait().unwrap().is_none(),
            "{name} killed the agent"
        );
        client.status().unwrap();
    }
    kill(agent.pid(), libc::SIGTERM);
    let st = procs::wait_exit(&mut agent.child);
    assert!(st.success(), "{st:?}: {}", agent.log());
    assert!(!cryo_state::StateDir::new(&state).agent_socket().exists());
    assert!(matches!(client.status(), Err(ClientError::NotRunning(_))));
}

#[test]
fn a_closed_stderr_does_not_kill_the_agent() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    fs::create_dir_all(&state).unwrap();
    let mut child = sim
        .cmd_at(&state)
        .args(["agent", "run", "--metrics-listen", "127.0.0.1:0"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read until it says it runs, then close the pipe: every later log line meets EPIPE.
    let mut err = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    while !line.contains("agent running") {
        line.clear();
        assert!(err.read_line(&mut line).unwrap() > 0, "the agent ended");
    }
    drop(err);
    let client = cryo_api::AgentClient::new(cryo_state::StateDir::new(&state).agent_socket());
    // Requests and signals that log.
    for _ in 0..3 {
        client.status().unwrap();
        kill(child.id() as i32, libc::SIGUSR1);
        client.metrics().unwrap();
        assert!(child.try_wait().unwrap().is_none());
    }
    client.shutdown().unwrap();
    let st = procs::wait_exit(&mut child);
    common::stop_pin_holder(&state);
    assert!(st.success(), "{st:?}");
}

#[test]
fn a_shutdown_is_refused_while_pins_are_held_and_says_how_to_release_them() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let gpu0 = sim.gpu_uuid(0);
    let mut agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let w = sim.spawn(WorkerSpec::new("8MiB").gpu(0).process_group());
    make_restored(&sim, &state, w.pid);
    let id = ProcId::of(w.pid).unwrap();
    eventually(PATIENCE, "the agent's guard to attach", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::GuardAttached { pid, .. } if *pid == id))
    });
    kill(w.pid, libc::SIGKILL);
    eventually(PATIENCE, "the pin", || {
        !agent.client().status().unwrap().guard.pins.is_empty()
    });
    let out = run(&sim, &state, &["agent", "stop"]);
    assert_eq!(out.status.code(), Some(1));
    let e = stderr(&out);
    assert!(e.contains("holds pinned contexts"), "{e}");
    assert!(
        e.contains(&format!(
            "cryo guard release --gpu {gpu0} --i-understand-this-may-wedge-the-host"
        )),
        "{e}"
    );
    // SIGTERM too.
    kill(agent.pid(), libc::SIGTERM);
    eventually(PATIENCE, "the refusal in the log", || {
        agent.log().contains("refusing to stop")
    });
    let st = agent.client().status().unwrap();
    assert!(!st.stopping);
    assert!(st.guard.pins.iter().any(|p| p.pid == w.pid));
    // The status says what it holds, and why.
    let text = ok({
        let mut c = sim.cmd_at(&state);
        c.args(["agent", "status"]);
        c
    });
    assert!(
        text.contains(&format!("PINNED context of dead pid {}", w.pid)),
        "{text}"
    );
    sim.assert_no_wedge();
    // Released through the agent, the stop goes ahead.
    succeeded(&run(
        &sim,
        &state,
        &[
            "guard",
            "release",
            "--gpu",
            &gpu0,
            "--i-understand-this-may-wedge-the-host",
        ],
    ));
    let out = run(&sim, &state, &["agent", "stop"]);
    succeeded(&out);
    assert!(procs::wait_exit(&mut agent.child).success());
}

#[test]
fn metrics_and_events_come_from_the_agent() {
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(&sim, &state, &[]);
    let client = agent.client();
    // Following from the start, before anything happened.
    let mut events = client.events(0, true).unwrap();
    let (pid, _) = sim.worker("4MiB");
    succeeded(&run(&sim, &state, &["stop", &pid.to_string()]));
    let mut seen = Vec::new();
    while !seen
        .iter()
        .any(|l: &String| l.contains("\"stop_completed\""))
    {
        seen.push(events.next().expect("the stream ended").unwrap());
    }
    let first: serde_json::Value = serde_json::from_str(&seen[0]).unwrap();
    assert_eq!(first["seq"], 1, "{}", seen[0]);
    // The same on /v1/metrics and on TCP.
    eventually(PATIENCE, "the stop in the metrics", || {
        client
            .metrics()
            .unwrap()
            .contains("cryo_stops_total{outcome=\"completed\"} 1")
    });
    let addr = client.status().unwrap().metrics_addr.unwrap();
    let port: u16 = addr.rsplit(':').next().unwrap().parse().unwrap();
    let (status, body) = common::http(port, "GET", "/metrics", "");
    assert_eq!(status, 200);
    assert!(body.contains("cryo_guarded_processes"), "{body}");
    // Without follow, the stream ends after what is there.
    match client.events(0, false) {
        Ok(it) => assert!(it.count() >= seen.len()),
        Err(e) => panic!("{e}"),
    }
    // An unknown path is a typed error.
    let e = cryo_http::Client::new(
        cryo_http::Endpoint::Unix(cryo_state::StateDir::new(&state).agent_socket()),
        cryo_http::Timeouts::total(std::time::Duration::from_secs(10)),
    )
    .get("/v2/status")
    .unwrap();
    assert_eq!(e.status, 404);
    let api: cryo_api::ApiError = serde_json::from_str(&e.text().unwrap()).unwrap();
    assert_eq!(api.kind, ErrorKind::NotFound);
}

/// A caller of `GET /v1/events` behind the journal's archive retention is told which records it
/// will never get: a `records_lost` line with the seq range, before the records after it.
#[test]
fn events_behind_a_pruned_archive_say_which_records_are_lost() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    {
        let j =
            cryo_journal::Journal::open(cryo_state::StateDir::new(&state).journal_dir()).unwrap();
        let freeze = || Event::FreezeStarted {
            image: "/img/x".into(),
        };
        for _ in 1..=5 {
            j.append(freeze()).unwrap();
        }
        j.rotate().unwrap().unwrap(); // 6; journal.1.log holds 1..=5
        j.append(freeze()).unwrap();
        j.append(freeze()).unwrap();
        j.rotate().unwrap().unwrap(); // 9; journal.6.log holds 6..=8
        let keep_one = cryo_journal::Retention {
            count: 1,
            bytes: u64::MAX,
        };
        assert_eq!(j.prune(keep_one).unwrap().len(), 1, "1..=5 pruned");
    }
    let agent = AgentProc::start(&sim, &state, &[]);
    let lines: Vec<String> = agent
        .client()
        .events(2, false)
        .unwrap()
        .map(Result::unwrap)
        .collect();
    let at = lines
        .iter()
        .position(|l| l.contains("\"records_lost\""))
        .unwrap_or_else(|| panic!("no records_lost line: {lines:#?}"));
    assert_eq!(at, 0, "{lines:#?}");
    let lost: serde_json::Value = serde_json::from_str(&lines[at]).unwrap();
    assert_eq!(
        (&lost["first"], &lost["last"], &lost["lost"]),
        (&3.into(), &5.into(), &3.into()),
        "{}",
        lines[at]
    );
    let seqs: Vec<u64> = lines[at + 1..]
        .iter()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["seq"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(&seqs[..4], [6, 7, 8, 9], "{lines:#?}");
}

#[test]
fn gpu_actions_and_the_cuda_checkpoint_front_end_go_through_the_agent_with_the_same_output() {
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let alone = sim.path().join("state-standalone");
    let agent = AgentProc::start(&sim, &state, &["--no-memory-watch"]);
    let (pid, _) = sim.worker("8MiB");
    let p = pid.to_string();
    for action in ["lock", "checkpoint", "restore", "unlock"] {
        let out = run(&sim, &state, &["gpu", action, "--pid", &p]);
        succeeded(&out);
        assert!(!stderr(&out).contains(NOTE), "{}", stderr(&out));
        assert!(
            agent
                .log()
                .contains(&format!("pid={pid} call=\"{action}\"")),
            "{action}: {}",
            agent.log()
        );
    }
    // The restore was journaled: the agent's guard takes the worker.
    let id = ProcId::of(pid).unwrap();
    eventually(PATIENCE, "the agent's guard to attach", || {
        records(&state)
            .iter()
            .any(|e| matches!(e, Event::GuardAttached { pid, .. } if *pid == id))
    });
    // Refusals and driver errors read the same through the agent as standalone: the client's
    // prechecks, and the driver's own code (the front end's exit status is the CUresult).
    let compat = |st: &Path, args: &[&str]| {
        let mut c = sim.cmd_at(st);
        c.arg("cuda-checkpoint").args(args);
        c.output().unwrap()
    };
    for args in [
        &["--action", "checkpoint", "--pid", p.as_str()][..],
        &["--action", "unlock", "--pid", p.as_str()],
        &["--get-state", "--pid", p.as_str()],
    ] {
        let (through, standalone) = (compat(&state, args), compat(&alone, args));
        assert_eq!(through.status.code(), standalone.status.code(), "{args:?}");
        assert_eq!(stdout(&through), stdout(&standalone), "{args:?}");
        assert_eq!(stderr(&through), stderr(&standalone), "{args:?}");
    }
    let (through, standalone) = (
        run(&sim, &state, &["gpu", "unlock", "--pid", &p]),
        run(&sim, &alone, &["gpu", "unlock", "--pid", &p]),
    );
    assert_eq!(through.status.code(), Some(1));
    assert!(stderr(&through).contains(&format!("pid {pid} is running; there is nothing to unlock")));
    assert!(stderr(&standalone).contains(NOTE));
    // A toggle through the agent: suspended, then back.
    for expect in ["checkpointed", "running"] {
        let out = compat(&state, &["--toggle", "--pid", &p]);
        succeeded(&out);
        assert_eq!(sim.state(pid), expect);
    }
    sim.assert_no_wedge();
}

#[test]
fn bench_agent_smoke() {
    let out = common::cryo()
        .args(["bench", "agent", "--memory", "16MiB", "--rounds", "1"])
        .output()
        .unwrap();
    succeeded(&out);
    let text = stdout(&out);
    assert!(
        text.contains("ratio = median through the agent / median standalone"),
        "{text}"
    );
    assert_eq!(
        text.lines().filter(|l| l.trim_end().ends_with('x')).count(),
        3,
        "{text}"
    );
}

#[test]
fn the_agent_sets_its_oom_score_adj_or_says_once_why_not() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(&sim, &state, &[]);
    let adj: i32 = fs::read_to_string(format!("/proc/{}/oom_score_adj", agent.pid()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let log = agent.log();
    if adj == -1000 {
        assert_eq!(
            log.matches("oom_score_adj set to -1000").count(),
            1,
            "{log}"
        );
    } else {
        // Where the kernel does not permit it (no CAP_SYS_RESOURCE): said once, and the agent runs.
        assert_eq!(
            log.matches("cannot protect the agent from the OOM killer")
                .count(),
            1,
            "oom_score_adj {adj}: {log}"
        );
        agent.client().status().unwrap();
    }
}

/// `POST /v1/gpu/restore` answers only once the agent's guard traces the process (still LOCKED),
/// whoever asks (here the API client itself, with no CLI around it to attach it): the caller's
/// unlock can only ever unlock a guarded process. The guard's journal poll runs once an hour, so
/// nothing else can have attached it. When the guard cannot trace it (someone else traces it),
/// the context is checkpointed again and the restore fails: never left LOCKED for an unguarded
/// unlock.
#[test]
fn a_restore_through_the_agent_is_traced_before_it_is_answered_or_checkpointed_again() {
    use cryo_api::{GpuCall, GpuCallAnswer, GpuCallRequest};
    let mut sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(&sim, &state, &["--no-memory-watch", "--poll-ms", "3600000"]);
    let client = agent.client();
    let call = |c: GpuCall, pid: i32| {
        client.gpu(
            c,
            &GpuCallRequest {
                pid,
                timeout_ms: None,
                pairs: Vec::new(),
            },
        )
    };
    let (pid, _) = sim.worker("8MiB");
    let (other, _) = sim.worker("8MiB");
    for p in [pid, other] {
        for c in [GpuCall::Lock, GpuCall::Checkpoint] {
            assert_eq!(call(c, p).unwrap(), GpuCallAnswer::Done, "{c:?} of {p}");
        }
    }
    assert_eq!(call(GpuCall::Restore, pid).unwrap(), GpuCallAnswer::Done);
    let tracer = procs::tracer_pid(pid);
    assert_eq!(
        cryo_proc::tgid(tracer).ok().flatten(),
        Some(agent.pid()),
        "restored and answered, but not traced by the agent (tracer {tracer})"
    );
    assert_eq!(sim.state(pid), "locked");
    let id = ProcId::of(pid).unwrap();
    assert!(records(&state).iter().any(|e| matches!(
        e,
        Event::GuardAttached { pid, source: cryo_journal::AttachSource::Restore } if *pid == id
    )));
    assert_eq!(call(GpuCall::Unlock, pid).unwrap(), GpuCallAnswer::Done);

    // This test traces `other`: the agent's seize is refused.
    nix::sys::ptrace::seize(
        nix::unistd::Pid::from_raw(other),
        nix::sys::ptrace::Options::empty(),
    )
    .unwrap();
    let e = call(GpuCall::Restore, other).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains("could not trace") && msg.contains("checkpointed again"),
        "{msg}"
    );
    assert_eq!(sim.state(other), "checkpointed");
    sim.assert_no_wedge();
}

/// A context restored by another tool (raw driver calls: nothing journaled, nothing asks the
/// agent) on a node whose agent guards every CUDA process (`--scan all-cuda`, the default): the
/// scan finds it and guards it (journaled with source `scan`), so its `kill -9` is pinned, not
/// torn down. (Before: nothing but cryo's own restores and the journal's were guarded: a wedge.)
#[test]
fn a_context_restored_by_another_tool_is_found_by_the_scan_and_its_kill_is_pinned() {
    let sim = Sim::start();
    let state = sim.path().join("state");
    let agent = AgentProc::start(&sim, &state, &["--no-memory-watch", "--scan", "all-cuda"]);
    let w = sim.spawn(WorkerSpec::new("8MiB").gpu(0).process_group());
    let p = w.pid.to_string();
    for call in ["lock", "checkpoint", "restore", "unlock"] {
        let dir = sim.path().to_str().unwrap();
        succeeded(&run(
            &sim,
            &state,
            &["sim", "call", call, "--pid", &p, "--dir", dir],
        ));
    }
    assert_eq!(sim.state(w.pid), "running");
    let id = ProcId::of(w.pid).unwrap();
    eventually(PATIENCE, "the scan to guard the worker", || {
        records(&state).iter().any(|e| {
            matches!(e, Event::GuardAttached { pid, source: cryo_journal::AttachSource::Scan } if *pid == id)
        })
    });
    // The journal's record comes first; the agent's log says it once the scan returns.
    eventually(PATIENCE, "the agent's log to say why it guards it", || {
        agent.log().contains("found by the scan")
    });
    kill(w.pid, libc::SIGKILL);
    eventually(PATIENCE, "the pin", || {
        agent
            .client()
            .status()
            .unwrap()
            .guard
            .pins
            .iter()
            .any(|p| p.pid == w.pid)
    });
    assert!(
        sim.settled_ledger().is_empty(),
        "{:?}",
        sim.settled_ledger()
    );
}
