#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo freeze` and `cryo thaw` with real CRIU and the simulated GPU. Needs root and CRIU >= 4.0
//! (`scripts/install-criu.sh`): without them these tests fail loudly.
//!
//! Workers run from a private copy of the `cryo` binary (CRIU refuses to restore a process whose
//! executable changed size, and the shared `target/` is rebuilt under running tests), under
//! `setsid` (CRIU dumps a tree that leads its own session), and serve HTTP on a unix socket (CRIU
//! 4.1.1 cannot dump TCP sockets on Linux >= 6.16). The test process is a child subreaper, so
//! thawed workers (children of the short-lived `cryo thaw`) are reparented to it and reaped here.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

mod common;

use common::{eventually, procs, program, stderr, stdout, Program, Worker, WorkerSpec, CRYO};
use cryo_testkit::http::{http, Endpoint as Ep};
use cryo_testkit::sim::Sim;
use cryo_testkit::PATIENCE;

fn criu_present() {
    let c = cryo_criu::CriuRpc::locate(None);
    assert!(
        c.is_ok(),
        "CRIU is required for these tests (run scripts/install-criu.sh as root): {:?}",
        c.err()
    );
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests need root (CRIU)"
    );
}

struct Env {
    sim: Sim,
    /// A private copy of `cryo` the workers run from.
    bin: Program,
    workers: Vec<Worker>,
    /// Pids (thawed workers) to stop and reap at the end.
    thawed: Vec<i32>,
}

impl Env {
    fn start(gpu_memory: &str) -> Env {
        criu_present();
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        let sim = Sim::start_with(&program(), &["--gpus", "2", "--gpu-memory", gpu_memory]);
        let bin = program().copied_to(&sim.path().join("cryo-worker"));
        Env {
            sim,
            bin,
            workers: Vec::new(),
            thawed: Vec::new(),
        }
    }

    fn path(&self) -> &Path {
        self.sim.path()
    }

    /// A sim worker on `gpu` with `memory`, in its own session, serving on a unix socket.
    fn worker(&mut self, memory: &str, gpu: u32) -> (i32, Ep) {
        self.worker_on(memory, gpu, false)
    }

    /// A sim worker serving on loopback TCP (`tcp`) or on a unix socket.
    fn worker_on(&mut self, memory: &str, gpu: u32, tcp: bool) -> (i32, Ep) {
        let spec = WorkerSpec::new(memory)
            .gpu(gpu)
            .setsid()
            .program(self.bin.clone());
        let w = self.sim.spawn(if tcp { spec } else { spec.http_unix() });
        let out = (w.pid, w.endpoint.clone());
        self.workers.push(w);
        out
    }

    fn cmd(&self) -> Command {
        let mut c = Command::new(CRYO);
        c.env_remove("RUST_LOG")
            .env_remove("CRYO_FAILPOINT")
            .env_remove("CRYO_CRIU")
            .env("CRYO_GPU", "sim")
            .env("CRYO_SIM_DIR", self.path())
            .env("CRYO_STATE_DIR", self.path().join("state"))
            .stdin(Stdio::null());
        c
    }

    fn cryo(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap()
    }

    fn freeze(&mut self, pid: i32, image: &Path) {
        let out = self.cryo(&[
            "freeze",
            &pid.to_string(),
            "--image",
            image.to_str().unwrap(),
        ]);
        assert!(out.status.success(), "freeze failed: {}", stderr(&out));
        self.reap_worker(pid);
    }

    /// Reaps a worker we spawned that CRIU killed after the dump.
    fn reap_worker(&mut self, pid: i32) {
        if let Some(w) = self.workers.iter_mut().find(|w| w.pid == pid) {
            w.reap();
        }
    }

    fn thaw(&mut self, image: &Path, extra: &[&str]) -> Output {
        let mut args = vec!["thaw", image.to_str().unwrap()];
        args.extend_from_slice(extra);
        let out = self.cryo(&args);
        if out.status.success() {
            let m = manifest(image);
            self.thawed.push(m["root_pid"].as_i64().unwrap() as i32);
        }
        out
    }

    /// `cryo stop PID`, then reap it (it is ours: thawed workers are reparented to us).
    fn stop(&mut self, pid: i32) {
        let out = self.cryo(&["stop", &pid.to_string()]);
        assert!(
            out.status.success(),
            "cryo stop {pid} failed ({}): {}{}",
            out.status,
            stdout(&out),
            stderr(&out)
        );
        // Our own worker (never frozen) is reaped through its Child, a thawed one by pid.
        match self
            .workers
            .iter_mut()
            .find(|w| w.pid == pid && w.is_ours())
        {
            Some(w) => w.reap(),
            None => procs::reap(pid),
        }
        self.thawed.retain(|p| *p != pid);
    }

    /// The wedge ledger after a round trip through the driver (every death seen is in it).
    fn ledger(&self) -> Vec<cryo_sim::Wedge> {
        self.sim.settled_ledger()
    }

    fn gpus(&self) -> serde_json::Value {
        serde_json::from_slice(&self.cryo(&["gpu", "ls", "--json"]).stdout).unwrap()
    }

    fn ps(&self) -> serde_json::Value {
        serde_json::from_slice(&self.cryo(&["gpu", "ps", "--json"]).stdout).unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // Everything still alive is stopped safely (suspend, verify, kill).
        let mut pids: Vec<i32> = self.thawed.clone();
        pids.extend(self.workers.iter().filter(|w| w.is_ours()).map(|w| w.pid));
        for pid in pids {
            if procs::alive(pid) {
                let _ = self.cryo(&["stop", &pid.to_string()]);
            }
            if !self.workers.iter().any(|w| w.pid == pid && w.is_ours()) {
                procs::reap(pid);
            }
        }
    }
}

use procs::alive;

fn tracer(pid: i32) -> i32 {
    procs::tracer_pid(pid)
}

fn exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

fn manifest(image: &Path) -> serde_json::Value {
    serde_json::from_slice(&fs::read(image.join("manifest.json")).unwrap()).unwrap()
}

fn answers(sock: &Ep) -> Vec<String> {
    let mut out = Vec::new();
    for prompt in ["hello", "the quick brown fox", "scale to zero"] {
        let (st, body) = http(
            sock,
            "POST",
            "/v1/completions",
            &format!("{{\"prompt\":\"{prompt}\"}}"),
        );
        assert_eq!(st, 200, "{body}");
        out.push(body);
    }
    let (st, verify) = http(sock, "GET", "/verify", "");
    assert_eq!(st, 200);
    let v: serde_json::Value = serde_json::from_str(&verify).unwrap();
    assert_eq!(v["ok"], true, "device memory corrupt: {verify}");
    out.push(verify);
    out
}

fn health(ep: &Ep) -> String {
    ep.url("/health")
}

#[test]
fn freeze_thaw_serves_the_same_answers_twice_and_refuses_while_the_original_runs() {
    let mut env = Env::start("1GiB");
    // Served on TCP, as inference servers are (CRIU >= 4.2 dumps TCP sockets on Linux >= 6.16).
    let (pid, sock) = env.worker_on("300MiB", 0, true);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    assert!(!exists(pid), "the frozen worker must be gone");
    let m = manifest(&image);
    assert_eq!(m["root_pid"], pid);
    assert_eq!(
        m["processes"][0]["gpu"]["devices"][0]["memory_bytes"],
        300 * 1024 * 1024
    );
    assert_eq!(m["gpu_model"], "cryo simulated GPU");
    assert!(m["files"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["sha256"].as_str().unwrap().len() == 64));

    for round in 0..2 {
        let out = env.thaw(
            &image,
            &["--health-url", &health(&sock), "--health-timeout", "30"],
        );
        assert!(out.status.success(), "thaw round {round}: {}", stderr(&out));
        assert!(
            stdout(&out).contains("first answered health request"),
            "{}",
            stdout(&out)
        );
        assert!(alive(pid));
        assert_eq!(answers(&sock), before, "round {round}");
        if round == 0 {
            // The original (here: the first thaw) still running: refused before CRIU runs.
            let again = env.cryo(&["thaw", image.to_str().unwrap()]);
            assert_eq!(again.status.code(), Some(3), "{}", stderr(&again));
            assert!(
                stderr(&again).contains(&format!("pids {pid} of the image are in use")),
                "{}",
                stderr(&again)
            );
            assert_eq!(answers(&sock), before);
        }
        env.stop(pid);
        assert!(!exists(pid));
    }
    let timeline = stdout(&env.cryo(&["timeline"]));
    for step in [
        "freeze started",
        "image published",
        "thaw started",
        "restore completed",
        "health ok",
        "thaw completed",
    ] {
        assert!(timeline.contains(step), "{step} missing from\n{timeline}");
    }
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

#[test]
fn thaw_onto_the_other_gpu_with_gpu_map() {
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let gpus = env.gpus();
    let (g0, g1) = (
        gpus[0]["uuid"].as_str().unwrap().to_string(),
        gpus[1]["uuid"].as_str().unwrap().to_string(),
    );
    let out = env.thaw(
        &image,
        &[
            "--gpu-map",
            &format!("{g0}={g1}"),
            "--health-url",
            &health(&sock),
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(answers(&sock), before);
    let ps = env.ps();
    let mine: Vec<_> = ps
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"] == pid)
        .collect();
    assert_eq!(mine.len(), 1, "{ps}");
    assert_eq!(mine[0]["gpu_uuid"], g1.as_str(), "{ps}");
    env.stop(pid);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

fn copy_image(from: &Path, to: &Path) {
    fs::create_dir(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A refused thaw: exit 3, the reason on stderr, and CRIU never ran (no process with the pid).
fn assert_refused(env: &mut Env, image: &Path, pid: i32, expect: &[&str]) {
    let out = env.thaw(image, &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    for e in expect {
        assert!(err.contains(e), "expected {e:?} in: {err}");
    }
    assert!(!err.contains("criu restore"), "CRIU ran: {err}");
    assert!(!exists(pid), "a process was created for a refused image");
}

#[test]
fn damaged_or_foreign_images_are_refused_before_criu_runs() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("32MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);

    let flip = env.path().join("flip");
    copy_image(&image, &flip);
    let pages = fs::read_dir(&flip)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("pages-")
        })
        .unwrap();
    let mut bytes = fs::read(&pages).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    fs::write(&pages, bytes).unwrap();
    assert_refused(
        &mut env,
        &flip,
        pid,
        &[pages.to_str().unwrap(), "checksum mismatch"],
    );

    let missing = env.path().join("missing");
    copy_image(&image, &missing);
    let core = missing.join(format!("core-{pid}.img"));
    fs::remove_file(&core).unwrap();
    assert_refused(
        &mut env,
        &missing,
        pid,
        &[core.to_str().unwrap(), "missing"],
    );

    let truncated = env.path().join("truncated");
    copy_image(&image, &truncated);
    let mpath = truncated.join("manifest.json");
    let text = fs::read(&mpath).unwrap();
    fs::write(&mpath, &text[..text.len() / 2]).unwrap();
    assert_refused(
        &mut env,
        &truncated,
        pid,
        &[mpath.to_str().unwrap(), "bad manifest"],
    );

    let foreign = env.path().join("foreign");
    copy_image(&image, &foreign);
    let mpath = foreign.join("manifest.json");
    let mut m: cryo_criu::Manifest = serde_json::from_slice(&fs::read(&mpath).unwrap()).unwrap();
    m.gpu_model = Some("NVIDIA H200".into());
    m.manifest_sha256 = m.self_digest().unwrap();
    fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    assert_refused(
        &mut env,
        &foreign,
        pid,
        &["frozen on \"NVIDIA H200\" GPUs", "cryo simulated GPU"],
    );

    // The untouched image still thaws.
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.stop(pid);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

#[test]
fn a_quarantine_that_fences_the_gpu_or_cannot_be_trusted_refuses_the_thaw() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("32MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let gpu0 = env.gpus()[0]["uuid"].as_str().unwrap().to_string();
    let quarantine = env.path().join("state").join("quarantine.json");
    let entry = |gpu: &str| {
        format!(
            r#"{{"gpus": [{{"gpu": "{gpu}", "reason": "pid 7 died", "pids": [7], "since_unix": 1}}]}}"#
        )
    };
    let write = |text: &str, mode: u32| {
        fs::write(&quarantine, text).unwrap();
        fs::set_permissions(
            &quarantine,
            std::os::unix::fs::PermissionsExt::from_mode(mode),
        )
        .unwrap();
    };
    // Its GPU is fenced (a file of the first format, as an older guard wrote it).
    write(&entry(&gpu0), 0o644);
    assert_refused(
        &mut env,
        &image,
        pid,
        &[&format!("GPU {gpu0} is quarantined")],
    );
    // The guard could not tell which GPU a pinned context is on: every GPU is fenced.
    write(&entry("unknown"), 0o644);
    assert_refused(
        &mut env,
        &image,
        pid,
        &["every GPU of this node is quarantined: pid 7 died"],
    );
    // What cannot be read or trusted fences everything too, as an error (exit 1), never as an
    // empty quarantine.
    for (text, mode, expect) in [
        (
            "{not json".to_string(),
            0o644,
            "is not a valid quarantine list",
        ),
        (entry("GPU-123"), 0o644, "neither a GPU UUID"),
        (
            entry(&gpu0.replace("GPU-", "GPU-x")),
            0o644,
            "neither a GPU UUID",
        ),
        (
            r#"{"gpus": []}"#.to_string(),
            0o666,
            "writable by group or others",
        ),
    ] {
        write(&text, mode);
        let out = env.thaw(&image, &[]);
        let err = stderr(&out);
        assert_eq!(out.status.code(), Some(1), "{text}: {err}");
        assert!(err.contains("cannot read the GPU quarantine"), "{err}");
        assert!(err.contains(expect), "expected {expect:?} in: {err}");
        assert!(!exists(pid), "a process was created despite the quarantine");
    }
    // Lifted: the same image thaws.
    fs::remove_file(&quarantine).unwrap();
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.stop(pid);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

#[test]
fn not_enough_free_device_memory_is_refused_before_criu_runs() {
    let mut env = Env::start("256MiB");
    let (pid, _) = env.worker("160MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    // Another worker takes the GPU.
    let (other, other_sock) = env.worker("160MiB", 0);
    let out = env.thaw(&image, &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("free, the image needs 160 MiB"), "{err}");
    assert!(!exists(pid));
    // On the other GPU it fits.
    let out = env.thaw(&image, &["--gpu-map", "0=1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.stop(pid);
    answers(&other_sock);
    env.stop(other);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

#[test]
fn leave_running_keeps_serving_and_counts_as_restored() {
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    let out = env.cryo(&[
        "freeze",
        &pid.to_string(),
        "--image",
        image.to_str().unwrap(),
        "--leave-running",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(alive(pid));
    assert_eq!(answers(&sock), before);
    assert!(image.join("manifest.json").exists());
    let timeline = stdout(&env.cryo(&["timeline", "--pid", &pid.to_string()]));
    assert!(timeline.contains("restore completed"), "{timeline}");
    env.stop(pid);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

/// The staging directories beside `image`.
fn staging(image: &Path) -> Vec<PathBuf> {
    let name = format!("{}.tmp-", image.file_name().unwrap().to_str().unwrap());
    fs::read_dir(image.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with(&name))
        .collect()
}

/// After a killed freeze: no image, and the worker either serving or suspended; `cryo stop`
/// then ends it without a wedge.
fn after_killed_freeze(env: &mut Env, pid: i32, image: &Path) {
    assert!(!image.exists(), "an image was published by a killed freeze");
    // An orphaned CRIU finishes or fails on its own: wait until it lets go of the worker.
    eventually(
        PATIENCE * 2,
        &format!("CRIU to let go of pid {pid}"),
        || !alive(pid) || tracer(pid) == 0,
    );
    // CRIU that finished its dump ends the (suspended) tree right after letting go of it.
    let out = env.cryo(&["gpu", "state", "--pid", &pid.to_string()]);
    if !out.status.success() && stderr(&out).contains("not a CUDA process") {
        eventually(
            PATIENCE,
            &format!("pid {pid}, which lost its CUDA state, to end"),
            || !alive(pid),
        );
    }
    if alive(pid) {
        let state = stdout(&out);
        assert!(
            state.contains("running") || state.contains("checkpointed"),
            "half-frozen worker: {state} {}",
            stderr(&out)
        );
        env.stop(pid);
    } else {
        env.reap_worker(pid);
    }
    assert!(env.ledger().is_empty(), "a context was torn down live");
}

#[test]
fn killing_cryo_during_the_dump_publishes_nothing_and_tears_nothing_down() {
    let mut env = Env::start("2GiB");
    // SIGKILL while CRIU writes the pages.
    let (pid, _) = env.worker("512MiB", 0);
    let image = env.path().join("img");
    let mut freeze = env
        .cmd()
        .args([
            "freeze",
            &pid.to_string(),
            "--image",
            image.to_str().unwrap(),
        ])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the dump to start", || {
        staging(&image)
            .iter()
            .any(|s| s.join("inventory.img").exists() || s.join("dump.log").exists())
    });
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    after_killed_freeze(&mut env, pid, &image);

    // SIGKILL after a complete dump, before publishing (failpoint).
    let (pid, _) = env.worker("32MiB", 1);
    let image = env.path().join("img2");
    let mut freeze = env
        .cmd()
        .env("CRYO_FAILPOINT", "freeze-before-publish")
        .args([
            "freeze",
            &pid.to_string(),
            "--image",
            image.to_str().unwrap(),
        ])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = freeze.stderr.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 256];
    while !seen.contains("failpoint") {
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "freeze ended before its failpoint: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    assert_eq!(
        staging(&image).len(),
        1,
        "the complete dump stays staged, unpublished"
    );
    after_killed_freeze(&mut env, pid, &image);

    // The next freeze of the same path removes the abandoned staging directory.
    let (pid, _) = env.worker("16MiB", 1);
    env.freeze(pid, &image);
    assert!(staging(&image).is_empty());
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.stop(pid);
    assert!(env.ledger().is_empty(), "{:?}", env.ledger());
}

#[test]
fn missing_or_old_criu_is_one_clear_line() {
    let env = Env::start("256MiB");
    let mut sleeper = Command::new("setsid")
        .args(["sleep", "60"])
        .spawn()
        .unwrap();
    let pid = sleeper.id().to_string();
    let fake = env.path().join("criu");
    fs::write(&fake, "#!/bin/sh\necho 'Version: 3.17'\n").unwrap();
    std::os::unix::fs::PermissionsExt::set_mode(
        &mut fs::metadata(&fake).unwrap().permissions(),
        0o755,
    );
    fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let image = env.path().join("img");
    for (criu, expect) in [
        ("/nonexistent", "criu not found"),
        (fake.to_str().unwrap(), "is version 3.17, cryo needs >="),
    ] {
        for args in [
            vec!["freeze", pid.as_str(), "--image", image.to_str().unwrap()],
            vec!["thaw", image.to_str().unwrap()],
        ] {
            let out = env
                .cmd()
                .env("CRYO_CRIU", criu)
                .args(&args)
                .output()
                .unwrap();
            let err = stderr(&out);
            assert_eq!(out.status.code(), Some(1), "{err}");
            assert_eq!(err.lines().count(), 1, "{err}");
            assert!(err.contains(expect), "{err}");
        }
    }
    sleeper.kill().unwrap();
    sleeper.wait().unwrap();
}

#[test]
fn bench_freeze_runs_tiny() {
    criu_present();
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let out = Command::new(CRYO)
        .args(["bench", "freeze", "--sizes", "16MiB", "--json"])
        .env_remove("CRYO_GPU")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &rows[0];
    for k in [
        "cryo_freeze_ms",
        "cli_freeze_ms",
        "cryo_thaw_ms",
        "cli_thaw_ms",
        "freeze_ratio",
        "thaw_ratio",
        "first_answer_ms",
    ] {
        assert!(row[k].as_f64().unwrap() > 0.0, "{k}: {row}");
    }
}

/// A directory that is no image is refused (exit 3, nothing run) before the driver is looked for.
#[test]
fn a_directory_that_is_no_image_is_refused_before_the_driver() {
    criu_present();
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(CRYO)
        .args([
            "--gpu",
            "sim",
            "--sim-dir",
            "/nonexistent-cryo-sim",
            "--state-dir",
        ])
        .arg(dir.path().join("state"))
        .arg("thaw")
        .arg(dir.path())
        .output()
        .unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("manifest.json: missing"), "{err}");
    assert!(!err.contains("simulated GPU driver"), "{err}");
}
