#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Issue 9 item 13: CRIU's own cuda plugin, driven by its real client. The plugin (built from the
//! CRIU source and installed in CRIU's plugin directory by scripts/install-criu.sh) execs
//! `cuda-checkpoint` from PATH: here that is cryo's front end (`cryo install-compat`) against the
//! simulated GPU, and the plugin is forced on without /proc/driver/nvidia by CRIU's fault
//! injection 138. It asks `--get-restore-tid` of a frozen process and resumes that thread alone
//! before `--action checkpoint` (dump) and `--action restore` + `unlock` (restore): the worker must
//! answer the same afterwards and no restored context may be torn down. Needs root, criu 4.2 and
//! the plugin (a missing one is a failure, never a skip).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use cryo_gpu::ProcessState;

/// What scripts/install-criu.sh installs: CRIU's default plugin directory.
const PLUGIN: &str = "/usr/lib/criu/cuda_plugin.so";

/// A directory with `cuda-checkpoint` (cryo, by `cryo install-compat`), a state directory for the
/// journal the front end writes, and the image directory.
struct Setup {
    bin: PathBuf,
    state: PathBuf,
    img: PathBuf,
}

impl Setup {
    fn new(sim: &Sim) -> Setup {
        assert!(
            Path::new(PLUGIN).is_file(),
            "{PLUGIN} is missing: scripts/install-criu.sh builds and installs CRIU's cuda plugin"
        );
        let _ = nix::sys::prctl::set_child_subreaper(true);
        let s = Setup {
            bin: sim.path().join("bin"),
            state: sim.path().join("state"),
            img: sim.path().join("img"),
        };
        std::fs::create_dir_all(&s.img).unwrap();
        let out = ok({
            let mut c = cryo();
            c.arg("install-compat").arg("--dir").arg(&s.bin);
            c
        });
        assert!(out.contains("cuda-checkpoint"), "{out}");
        s
    }

    /// `c` with the plugin forced on (CRIU's fault injection 138) and cryo's front end as
    /// `cuda-checkpoint` first on its PATH, against `sim`, journaling into our state directory.
    fn plugin_env(&self, sim: &Sim, mut c: Command) -> Command {
        let path = format!(
            "{}:{}",
            self.bin.display(),
            std::env::var("PATH").unwrap_or_default()
        );
        c.env("PATH", path)
            .env("CRIU_FAULT", "138")
            .env("CRYO_GPU", "sim")
            .env("CRYO_SIM_DIR", sim.path())
            .env("CRYO_STATE_DIR", &self.state);
        c
    }

    /// `criu ARGS... -D IMG -o WHAT.log -v4` under [`Setup::plugin_env`]; returns CRIU's log.
    fn criu(&self, sim: &Sim, what: &str, args: &[&str]) -> String {
        let mut c = Command::new("criu");
        c.args(args)
            .arg("-D")
            .arg(&self.img)
            .args(["-o", &format!("{what}.log"), "-v4"]);
        let out = self
            .plugin_env(sim, c)
            .output()
            .expect("criu must be installed (scripts/install-criu.sh)");
        let log = std::fs::read_to_string(self.img.join(format!("{what}.log"))).unwrap_or_default();
        assert!(
            out.status.success(),
            "criu {what} failed: {}\n{log}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            log.contains("cuda_plugin: initialized"),
            "the cuda plugin did not run in criu {what}:\n{log}"
        );
        log
    }

    /// `cryo --state-dir STATE ARGS...` against `sim`.
    fn cryo(&self, sim: &Sim, args: &[&str]) -> String {
        ok({
            let mut c = sim.cmd_at(&self.state);
            c.args(args);
            c
        })
    }
}

/// Dumps `w` (and its ranks) through the plugin, restores it, checks that it answers as before
/// and is journaled as restored; then `cryo stop` ends it safely.
fn dump_and_restore(sim: &Sim, mut w: Worker) {
    let setup = Setup::new(sim);
    let pids: Vec<i32> = std::iter::once(w.pid)
        .chain(w.children().iter().copied())
        .collect();
    let ranks: Vec<i32> = if w.children().is_empty() {
        vec![w.pid]
    } else {
        w.children().to_vec()
    };
    let before = w.complete("plugin");
    let pid = w.pid.to_string();

    let log = setup.criu(sim, "dump", &["dump", "-t", &pid]);
    for p in &pids {
        assert!(
            log.contains(&format!("cuda_plugin: pausing devices on pid {p}\n")),
            "no lock of {p}:\n{log}"
        );
        assert!(
            log.contains(&format!(
                "cuda_plugin: Checkpointing CUDA devices on pid {p} restore_tid"
            )),
            "the plugin did not checkpoint {p} (restore tid of a frozen process?):\n{log}"
        );
    }
    // CRIU killed the tree: the launcher is reaped through its handle, its ranks (reparented to
    // us, the subreaper) by pid: their zombies would hold the session's and group's ids.
    w.reap();
    for p in w.children() {
        reap_gone(*p);
    }
    for p in &ranks {
        assert!(
            !sim.listed(*p),
            "pid {p} still holds device memory after the dump"
        );
    }
    sim.assert_no_wedge();

    let log = setup.criu(sim, "restore", &["restore", "-d"]);
    for p in &pids {
        assert!(
            log.contains(&format!("cuda_plugin: resuming devices on pid {p}\n")),
            "no restore of {p}:\n{log}"
        );
        assert_eq!(sim.gpu.driver.state(*p).unwrap(), ProcessState::Running);
    }
    for p in &ranks {
        assert!(
            sim.listed(*p),
            "pid {p} has no device memory after the restore"
        );
    }
    assert_eq!(w.complete("plugin"), before);
    assert_eq!(w.verify()["ok"], true);
    // The front end journaled every restore it did: cryo knows these processes as restored.
    for p in &pids {
        let t = setup.cryo(sim, &["timeline", "--pid", &p.to_string()]);
        assert!(t.contains("restore completed"), "pid {p}:\n{t}");
    }

    // Suspend before kill (cryo stop refuses to kill a restored process it cannot suspend).
    setup.cryo(sim, &["stop", &pid]);
    for p in &pids {
        reap_gone(*p);
    }
    sim.assert_no_wedge();
}

/// Waits until `pid` is gone, reaping it when it is (or becomes) our child: a rank whose
/// launcher died is reparented to us, the subreaper.
fn reap_gone(pid: i32) {
    use nix::sys::wait::{waitpid, WaitPidFlag};
    eventually(PATIENCE, &format!("pid {pid} to be gone"), || {
        let _ = waitpid(nix::unistd::Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG));
        procs::state(pid).is_none()
    });
}

/// A worker spec run from a private copy of `cryo` (CRIU refuses to restore a process whose
/// executable changed, and `target/` may be rebuilt while tests run), in its own session.
fn spec(sim: &Sim, memory: &str, seed: u64) -> WorkerSpec {
    let bin = sim.path().join("cryo-worker");
    let program = if bin.exists() {
        Program::cryo(&bin)
    } else {
        program().copied_to(&bin)
    };
    WorkerSpec::new(memory).seed(seed).setsid().program(program)
}

#[test]
fn criu_cuda_plugin_dumps_and_restores_a_worker_through_the_front_end() {
    let sim = Sim::start();
    let w = sim.spawn(spec(&sim, "8MiB", 13));
    dump_and_restore(&sim, w);
}

#[test]
fn criu_cuda_plugin_dumps_and_restores_a_tree_with_a_cuinit_only_launcher() {
    // A tensor-parallel server: a launcher that only ran cuInit and one rank per GPU.
    let sim = Sim::start();
    let w = sim.spawn(
        spec(&sim, "4MiB", 14)
            .gpus(&[0, 1])
            .process_per_gpu()
            .init_only(),
    );
    dump_and_restore(&sim, w);
}

#[test]
fn cryo_freeze_and_thaw_run_criu_without_its_plugins() {
    // Where the plugin is on (a GPU host; here forced by CRIU_FAULT=138, with cryo's front end
    // on PATH), cryo's own CRIU runs must not load it: at restore it would restore and unlock the
    // worker with no GPU map, before cryo's thaw restores it where the map says.
    let sim = Sim::start();
    let setup = Setup::new(&sim);
    let mut w = sim.spawn(spec(&sim, "8MiB", 15));
    let pid = w.pid.to_string();
    let before = w.complete("plugin");
    let image = sim.path().join("frozen");
    ok(setup.plugin_env(&sim, {
        let mut c = sim.cmd_at(&setup.state);
        c.args(["freeze", &pid, "--image", image.to_str().unwrap()]);
        c
    }));
    w.reap();
    let gpus: serde_json::Value =
        serde_json::from_str(&setup.cryo(&sim, &["gpu", "ls", "--json"])).unwrap();
    let (g0, g1) = (
        gpus[0]["uuid"].as_str().unwrap(),
        gpus[1]["uuid"].as_str().unwrap(),
    );
    ok(setup.plugin_env(&sim, {
        let mut c = sim.cmd_at(&setup.state);
        c.args([
            "thaw",
            image.to_str().unwrap(),
            "--gpu-map",
            &format!("{g0}={g1}"),
            "--health-url",
            &format!("http://127.0.0.1:{}/health", w.port),
        ]);
        c
    }));
    let ps: serde_json::Value =
        serde_json::from_str(&setup.cryo(&sim, &["gpu", "ps", "--json"])).unwrap();
    let on: Vec<&str> = ps
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"] == w.pid)
        .map(|p| p["gpu_uuid"].as_str().unwrap())
        .collect();
    assert_eq!(on, vec![g1], "{ps}");
    assert_eq!(w.complete("plugin"), before);
    setup.cryo(&sim, &["stop", &pid]);
    procs::reap(w.pid);
    sim.assert_no_wedge();
}

/// Issue 10 item 5: CRIU's cuda plugin run by hand on a node whose agent runs. The dump goes
/// through the agent (the front end's lock and checkpoint); at restore, the plugin restores each
/// process while CRIU itself still traces it (it resumes the restore thread alone), so the
/// agent's guard cannot trace it before its unlock: the agent checkpoints the context again (and
/// journals it) and the front end's restore fails, by design: never a restored context running
/// unguarded. CRIU 4.2 ignores its plugin's failure and resumes the tree: the worker runs with
/// its context CHECKPOINTED (nothing live, nothing to tear down). The front end's output, which
/// CRIU's log keeps to 127 bytes, names CRIU and the supported path, `cryo thaw`. Once CRIU has
/// let go, `cryo gpu restore` + `unlock` through the agent bring it back, traced before the
/// unlock.
#[test]
fn criu_cuda_plugin_restore_under_a_running_agent_fails_safe_and_names_cryo_thaw() {
    let sim = Sim::start();
    let setup = Setup::new(&sim);
    let agent = AgentProc::start(&sim, &setup.state, &["--no-memory-watch"]);
    let mut w = sim.spawn(spec(&sim, "8MiB", 16));
    let before = w.complete("plugin");
    let pid = w.pid.to_string();
    setup.criu(&sim, "dump", &["dump", "-t", &pid]);
    w.reap();
    assert!(
        agent
            .log()
            .contains(&format!("pid={pid} call=\"checkpoint\"")),
        "the dump's checkpoint did not go through the agent: {}",
        agent.log()
    );
    let log = setup.criu(&sim, "restore", &["restore", "-d"]);
    assert!(
        log.contains("traced by CRIU: use `cryo thaw`, not CRIU's cuda plugin;"),
        "CRIU's log does not say why, nor the supported path:\n{log}"
    );
    assert_eq!(
        sim.gpu.driver.state(w.pid).unwrap(),
        ProcessState::Checkpointed
    );
    assert!(!sim.listed(w.pid));
    assert!(
        agent
            .log()
            .contains("could not be traced before its unlock"),
        "{}",
        agent.log()
    );
    sim.assert_no_wedge();
    // CRIU let go (`-d`): back through the agent, which traces it before the restore answers.
    setup.cryo(&sim, &["gpu", "restore", "--pid", &pid]);
    assert_eq!(
        cryo_proc::tgid(procs::tracer_pid(w.pid)).ok().flatten(),
        Some(agent.pid())
    );
    setup.cryo(&sim, &["gpu", "unlock", "--pid", &pid]);
    assert_eq!(w.complete("plugin"), before);
    setup.cryo(&sim, &["stop", &pid]);
    reap_gone(w.pid);
    sim.assert_no_wedge();
}
