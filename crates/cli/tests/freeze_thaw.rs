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
use std::process::{Child, Command, Output, Stdio};
use std::time::Duration;

mod common;

use common::{eventually, procs, program, stderr, stdout, Program, Worker, WorkerSpec, CRYO};
use cryo_testkit::eventually_said;
use cryo_testkit::http::{http, Endpoint as Ep};
use cryo_testkit::sim::Sim;
use cryo_testkit::PATIENCE;

use cryo_testkit::require_criu_and_root as criu_present;

struct Env {
    sim: Sim,
    /// A private copy of `cryo` the workers run from.
    bin: Program,
    workers: Vec<Worker>,
    /// Pids (thawed workers) to stop and reap at the end.
    thawed: Vec<i32>,
    /// Thaws through the image streamer (`CRYO_THAW_STREAM=1`) instead of the files.
    stream: bool,
    /// Starts `cryo` with `SIGCHLD` ignored, as a parent that ignores it leaves it (`SIG_IGN`
    /// survives `execve`).
    sigchld_ignored: bool,
}

impl Env {
    fn start(gpu_memory: &str) -> Env {
        Env::start_gpus(gpu_memory, 2)
    }

    fn start_gpus(gpu_memory: &str, gpus: u32) -> Env {
        criu_present();
        nix::sys::prctl::set_child_subreaper(true).unwrap();
        let sim = Sim::start_with(
            &program(),
            &["--gpus", &gpus.to_string(), "--gpu-memory", gpu_memory],
        );
        let bin = program().copied_to(&sim.path().join("cryo-worker"));
        Env {
            sim,
            bin,
            workers: Vec::new(),
            thawed: Vec::new(),
            stream: false,
            sigchld_ignored: false,
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
            .env("CRYO_THAW_STREAM", if self.stream { "1" } else { "0" })
            .stdin(Stdio::null());
        if self.sigchld_ignored {
            use std::os::unix::process::CommandExt;
            // SAFETY: runs in the forked child before exec: one async-signal-safe system call
            // (signal with SIG_IGN, no pointer), no allocation.
            unsafe {
                c.pre_exec(|| {
                    if libc::signal(libc::SIGCHLD, libc::SIG_IGN) == libc::SIG_ERR {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        c
    }

    fn cryo(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap()
    }

    /// `cryo freeze PID --image IMAGE EXTRA...`, whatever its outcome.
    fn try_freeze(&self, pid: i32, image: &Path, extra: &[&str]) -> Output {
        let pid = pid.to_string();
        let mut args = vec!["freeze", &pid, "--image", image.to_str().unwrap()];
        args.extend_from_slice(extra);
        self.cryo(&args)
    }

    fn freeze(&mut self, pid: i32, image: &Path) {
        let out = self.try_freeze(pid, image, &[]);
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

    /// `cryo thaw IMAGE EXTRA...` started, its output piped.
    fn spawn_thaw(&self, image: &Path, extra: &[&str]) -> Child {
        self.cmd()
            .arg("thaw")
            .arg(image)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// `cryo thaw IMAGE EXTRA...`, which must succeed.
    fn thaw_ok(&mut self, image: &Path, extra: &[&str]) -> Output {
        let out = self.thaw(image, extra);
        assert!(out.status.success(), "{}", stderr(&out));
        out
    }

    /// A worker with `memory` on GPU 0 frozen to `img` in the sim directory, after it answered:
    /// `(pid, endpoint, answers, image)`.
    fn frozen(&mut self, memory: &str) -> (i32, Ep, Vec<String>, PathBuf) {
        let (pid, sock) = self.worker(memory, 0);
        let before = answers(&sock);
        let image = self.path().join("img");
        self.freeze(pid, &image);
        (pid, sock, before, image)
    }

    /// `cryo thaw IMAGE` succeeds, the restored `pid` answers `before`, and it is stopped with
    /// nothing torn down live.
    fn thaws_as_before(&mut self, image: &Path, pid: i32, sock: &Ep, before: &[String]) {
        self.thaw_ok(image, &[]);
        assert_eq!(answers(sock), before);
        self.stop_clean(pid);
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

    /// [`Env::stop`], then no context was torn down live by anything so far.
    fn stop_clean(&mut self, pid: i32) {
        self.stop(pid);
        self.sim.assert_no_wedge();
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

/// A running `cryo guard` of `env`'s state directory that reads its journal once an hour (so
/// only a restore's own request can have it trace a process), memory watch off.
fn hourly_guard(env: &Env) -> common::GuardProc {
    common::GuardProc::spawn(
        env.cmd(),
        &env.path().join("state"),
        &["--no-memory-watch", "--poll-ms", "3600000"],
    )
}

/// An [`hourly_guard`], and a worker restored through `cryo gpu` (traced by it); the worker's
/// pid.
fn guarded_worker(env: &mut Env) -> (common::GuardProc, i32) {
    let guard = hourly_guard(env);
    let (pid, _sock) = env.worker("64MiB", 0);
    for action in ["lock", "checkpoint", "restore", "unlock"] {
        let out = env.cryo(&["gpu", action, "--pid", &pid.to_string()]);
        assert!(out.status.success(), "gpu {action}: {}", stderr(&out));
    }
    assert_ne!(
        tracer(pid),
        0,
        "a restore through cryo is traced before its unlock"
    );
    (guard, pid)
}

/// `env`'s journal.
fn events(env: &Env) -> Vec<cryo_journal::Event> {
    common::events(&env.path().join("state"))
}

/// After a SIGKILL of guarded `id`: no wedge, the guard journals its pin, and the operator's
/// release of GPU 0 is what tears the held context down.
fn assert_pinned_then_release(env: &Env, id: cryo_journal::ProcId) {
    use cryo_journal::Event;
    env.sim.assert_no_wedge();
    eventually(PATIENCE, "the guard to journal the pin", || {
        events(env)
            .iter()
            .any(|e| matches!(e, Event::Pinned { pid: p, .. } if *p == id))
    });
    let gpu0 = env.gpus()[0]["uuid"].as_str().unwrap().to_string();
    let out = env.cryo(&[
        "guard",
        "release",
        "--gpu",
        &gpu0,
        "--i-understand-this-may-wedge-the-host",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    eventually(PATIENCE, "the release's teardown in the ledger", || {
        !env.sim.ledger().is_empty()
    });
}

fn sigkill(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
}

use procs::alive;

fn tracer(pid: i32) -> i32 {
    procs::tracer_pid(pid)
}

fn exists(pid: i32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `err` is the thaw's refusal of pids of the image in use, naming `pid` among them
/// (with the image's other pids and thread ids that are taken).
fn in_use(err: &str, pid: i32) -> bool {
    err.split("pids ")
        .filter_map(|rest| rest.split_once(" of the image are in use"))
        .any(|(list, _)| list.split(',').any(|p| p == pid.to_string()))
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
    assert_eq!(m["digest"], "blake3");
    assert!(m["files"]
        .as_array()
        .unwrap()
        .iter()
        .all(|f| f["chunks"]
            .as_array()
            .map_or(f["size"] == 0, |c| c.iter().all(|d| d
                .as_str()
                .unwrap()
                .len()
                == 64))));

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
            assert!(in_use(&stderr(&again), pid), "{}", stderr(&again));
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
    env.sim.assert_no_wedge();
}

#[test]
fn thaw_onto_the_other_gpu_with_gpu_map() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("64MiB");
    let gpus = env.gpus();
    let (g0, g1) = (
        gpus[0]["uuid"].as_str().unwrap().to_string(),
        gpus[1]["uuid"].as_str().unwrap().to_string(),
    );
    env.thaw_ok(
        &image,
        &[
            "--gpu-map",
            &format!("{g0}={g1}"),
            "--health-url",
            &health(&sock),
        ],
    );
    assert_eq!(answers(&sock), before);
    assert_restored_on(&mut env, pid, &g1);
}

/// NVML lists `pid` once, on `gpu`; then it is stopped, and no context was torn down live.
fn assert_restored_on(env: &mut Env, pid: i32, gpu: &str) {
    let ps = env.ps();
    let mine: Vec<_> = ps
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"] == pid)
        .collect();
    assert_eq!(mine.len(), 1, "{ps}");
    assert_eq!(mine[0]["gpu_uuid"], gpu, "{ps}");
    env.stop_clean(pid);
}

/// A process standing for a container given `devices` (`NVIDIA_VISIBLE_DEVICES`); killed on drop.
struct GivenGpus(Child);

impl GivenGpus {
    fn start(devices: &str) -> GivenGpus {
        let c = Command::new("sleep")
            .arg("600")
            .env("NVIDIA_VISIBLE_DEVICES", devices)
            .spawn()
            .unwrap();
        let pid = c.id();
        eventually(PATIENCE, "its environment", || {
            fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|e| e.windows(22).any(|w| w == b"NVIDIA_VISIBLE_DEVICES"))
        });
        GivenGpus(c)
    }

    fn pid(&self) -> String {
        self.0.id().to_string()
    }
}

impl Drop for GivenGpus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Issue 13 item 6: `--gpus-of PID` restores onto the GPUs that process's container was given,
/// by UUID (NVIDIA/cuda-checkpoint#54); a container given GPUs by index is refused before
/// anything runs.
#[test]
fn thaw_onto_the_gpus_a_container_was_given_by_uuid_never_by_index() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("64MiB");
    let g1 = env.gpus()[1]["uuid"].as_str().unwrap().to_string();
    let by_index = GivenGpus::start("1");
    let out = env.thaw(&image, &["--gpus-of", &by_index.pid()]);
    assert_eq!(out.status.code(), Some(2), "{}", stderr(&out));
    assert!(stderr(&out).contains("by index"), "{}", stderr(&out));
    assert!(!exists(pid));
    let given = GivenGpus::start(&g1);
    env.thaw_ok(
        &image,
        &["--gpus-of", &given.pid(), "--health-url", &health(&sock)],
    );
    assert_eq!(answers(&sock), before);
    assert_restored_on(&mut env, pid, &g1);
}

/// Issue 9 item 10: a process with contexts on two GPUs, thawed with a map that moves one of them.
/// The driver takes a pair for every GPU the process used once any pair is given (the simulated
/// driver refuses an incomplete list with INVALID_VALUE), so thaw passes the identity pair for the
/// GPU that stays; a map that lands both GPUs on one is refused before CRIU runs.
#[test]
fn thaw_of_a_two_gpu_worker_passes_a_pair_for_every_gpu_it_used() {
    let mut env = Env::start_gpus("1GiB", 3);
    let spec = WorkerSpec::new("32MiB")
        .gpus(&[0, 1])
        .setsid()
        .http_unix()
        .program(env.bin.clone());
    let w = env.sim.spawn(spec);
    let (pid, sock) = (w.pid, w.endpoint.clone());
    env.workers.push(w);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let gpus = env.gpus();
    let uuid = |i: usize| gpus[i]["uuid"].as_str().unwrap().to_string();
    let (g0, g1, g2) = (uuid(0), uuid(1), uuid(2));

    // GPU 0 onto GPU 1, where its other context already lands: refused, nothing ran.
    let out = env.thaw(&image, &["--gpu-map", &format!("{g0}={g1}")]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(
        err.contains(&format!("two GPUs of the image land on GPU {g1}")),
        "{err}"
    );
    assert!(!err.contains("criu restore"), "CRIU ran: {err}");
    assert!(!exists(pid), "a process was created for a refused map");

    // GPU 0 onto GPU 2; GPU 1 stays (identity pair).
    env.thaw_ok(
        &image,
        &[
            "--gpu-map",
            &format!("{g0}={g2}"),
            "--health-url",
            &health(&sock),
        ],
    );
    assert_eq!(answers(&sock), before);
    let ps = env.ps();
    let mut on: Vec<String> = ps
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["pid"] == pid)
        .map(|p| p["gpu_uuid"].as_str().unwrap().to_string())
        .collect();
    on.sort();
    let mut want = vec![g1.clone(), g2.clone()];
    want.sort();
    assert_eq!(on, want, "{ps}");
    env.stop_clean(pid);
}

fn copy_image(from: &Path, to: &Path) {
    fs::create_dir(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

/// A refused thaw: exit 3, the reason on stderr, CRIU never ran, no process with the pid.
fn assert_refused(env: &mut Env, image: &Path, pid: i32, expect: &[&str]) {
    let err = assert_refused_while_read(env, image, pid, expect);
    assert!(!err.contains("criu restore"), "CRIU ran: {err}");
}

/// A refused thaw that may have started CRIU (the streamer refuses a chunk as CRIU reads it, or
/// the gate before anything is resumed): exit 3, the reason on stderr, and no process with the
/// pid left (nothing restored ever ran). Returns stderr.
fn assert_refused_while_read(env: &mut Env, image: &Path, pid: i32, expect: &[&str]) -> String {
    let out = env.thaw(image, &[]);
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(3), "{err}");
    for e in expect {
        assert!(err.contains(e), "expected {e:?} in: {err}");
    }
    assert!(
        !exists(pid),
        "a process is left from a refused image: {err}"
    );
    err
}

/// The files of an image, manifest aside.
fn image_files(image: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = fs::read_dir(image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap() != "manifest.json")
        .collect();
    v.sort();
    v
}

/// The image's (first) pages file, `pages-N.img`.
fn pages_file(image: &Path) -> PathBuf {
    image_files(image)
        .into_iter()
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("pages-")
        })
        .unwrap()
}

fn flip_byte(file: &Path, at: usize) {
    let mut bytes = fs::read(file).unwrap();
    bytes[at] ^= 0x01;
    fs::write(file, bytes).unwrap();
}

#[test]
fn damaged_or_foreign_images_are_refused_before_anything_runs() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("32MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);

    // A flipped byte in any file, on both routes. From the files (the default): every file
    // but the page contents is checked before CRIU starts; a page flipped is refused at the
    // gate, after CRIU read it into a process that never runs. Through the streamer: refused
    // before CRIU gets the chunk, or at the gate for what CRIU does not read (dump.log,
    // stats-dump).
    let flip = env.path().join("flip");
    for (k, file) in image_files(&image)
        .iter()
        .flat_map(|f| [(false, f), (true, f)])
        .enumerate()
    {
        let (stream, file) = file;
        env.stream = stream;
        let name = file.file_name().unwrap().to_str().unwrap();
        let len = fs::metadata(file).unwrap().len() as usize;
        if len == 0 {
            continue;
        }
        let _ = fs::remove_dir_all(&flip);
        copy_image(&image, &flip);
        let damaged = flip.join(name);
        flip_byte(&damaged, (len / 2 + k) % len);
        assert_refused_while_read(
            &mut env,
            &flip,
            pid,
            &[damaged.to_str().unwrap(), "checksum mismatch"],
        );
    }
    env.stream = false;

    // A truncated pages file and an extra file: refused before CRIU runs.
    let truncated = env.path().join("truncated-pages");
    copy_image(&image, &truncated);
    let pages = pages_file(&truncated);
    let len = fs::metadata(&pages).unwrap().len();
    fs::File::options()
        .write(true)
        .open(&pages)
        .unwrap()
        .set_len(len - 4096)
        .unwrap();
    assert_refused(
        &mut env,
        &truncated,
        pid,
        &[pages.to_str().unwrap(), "truncated"],
    );
    let extra = env.path().join("extra");
    copy_image(&image, &extra);
    fs::write(extra.join("pages-9.img"), b"more").unwrap();
    assert_refused(
        &mut env,
        &extra,
        pid,
        &[extra.join("pages-9.img").to_str().unwrap(), "not listed"],
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
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
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
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
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
    env.thaw_ok(&image, &["--gpu-map", "0=1"]);
    env.stop(pid);
    answers(&other_sock);
    env.stop_clean(other);
}

#[test]
fn leave_running_keeps_serving_and_counts_as_restored() {
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &["--leave-running"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(alive(pid));
    assert_eq!(answers(&sock), before);
    assert!(image.join("manifest.json").exists());
    let timeline = stdout(&env.cryo(&["timeline", "--pid", &pid.to_string()]));
    assert!(timeline.contains("restore completed"), "{timeline}");
    env.stop_clean(pid);
}

/// Reproduced wedge (a) of issue 10: a guarded restored worker is frozen (the guard lets go of it
/// for the dump), thawed (CRIU gives it the same pid) and SIGKILLed the moment the thaw returns.
/// The thaw had the guard trace it while it was still LOCKED, before its unlock: the journal
/// shows `GuardAttached` (source `restore`) before `Unlocked`, the kill is pinned, and no context
/// is torn down. (Before: the thawed worker ran unguarded until the guard's next journal poll,
/// here never: the guard polls once an hour.)
#[test]
fn a_thawed_worker_is_guarded_before_its_unlock() {
    use cryo_journal::{AttachSource, Event, ProcId};
    let mut env = Env::start("1GiB");
    let (mut guard, pid) = guarded_worker(&mut env);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "thaw failed: {}", stderr(&out));
    assert!(
        !stderr(&out).contains("no guard runs"),
        "a guard runs: {}",
        stderr(&out)
    );
    assert_ne!(
        tracer(pid),
        0,
        "the thawed worker is not traced when the thaw returns"
    );
    let id = ProcId::of(pid).unwrap();
    sigkill(pid);
    eventually(PATIENCE, "the thawed worker to die", || !alive(pid));
    procs::reap(pid);
    env.thawed.retain(|p| *p != pid);
    assert_pinned_then_release(&env, id);
    let ev = events(&env);
    let at = |f: &dyn Fn(&Event) -> bool| ev.iter().position(f);
    let attached = at(
        &|e| matches!(e, Event::GuardAttached { pid: p, source: AttachSource::Restore } if *p == id),
    );
    let unlocked = at(&|e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id));
    let restored = at(&|e| matches!(e, Event::RestoreCompleted { pid: p, .. } if *p == id));
    assert!(
        restored.is_some() && restored < attached && attached < unlocked,
        "journal order: restored {restored:?}, attached {attached:?}, unlocked {unlocked:?}"
    );
    guard.kill();
}

/// Waits until `cmd` (stderr piped) says it reached its failpoint.
/// Reads the whole announcement line before the pipe is closed: the write of a part of it after
/// the close would fail (session 17's flaky `a_freeze_killed_at_the_dump_gate_...`: the freeze's
/// `eprintln!` panicked on EPIPE and its unwinding removed the staging directory).
fn wait_failpoint(cmd: &mut std::process::Child) {
    let mut err = cmd.stderr.take().unwrap();
    let mut seen = String::new();
    let mut buf = [0u8; 256];
    while !seen
        .split_once("failpoint")
        .is_some_and(|(_, rest)| rest.contains('\n'))
    {
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "it ended before its failpoint: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
}

/// A freeze killed while the guard has let go of the worker for the dump (every context
/// suspended first, its lease held, nothing dumped yet): the lease was the freeze's connection to
/// the guard, so the guard takes the worker back as soon as the freeze dies; it is still
/// CHECKPOINTED (the journal shows it), so a `kill -9` of it then is the safe kind: nothing pinned,
/// nothing torn down. (Before: the worker stayed on the guard's detached list, unguarded, as long
/// as it lived; and the let-go came before the suspension.)
#[test]
fn a_freeze_killed_mid_lease_hands_the_worker_back_to_the_guard() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let (mut guard, pid) = guarded_worker(&mut env);
    let image = env.path().join("img");
    let mut freeze = freeze_at(&env, pid, &image, false, "freeze-after-let-go");
    assert_eq!(tracer(pid), 0, "the guard lets go for the dump");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed,
        "let go of before its suspension"
    );
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    eventually(PATIENCE, "the guard to take the worker back", || {
        tracer(pid) != 0
    });
    let id = cryo_journal::ProcId::of(pid).unwrap();
    sigkill(pid);
    env.reap_worker(pid);
    eventually(PATIENCE, "the guard to journal the end", || {
        events(&env)
            .iter()
            .any(|e| matches!(e, Event::ProcessExited { pid: p, .. } if *p == id))
    });
    assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());
    assert!(
        !events(&env)
            .iter()
            .any(|e| matches!(e, Event::Pinned { .. } | Event::GpuQuarantined { .. })),
        "{:?}",
        events(&env)
    );
    guard.kill();
}

/// A freeze killed after a driver action whose outcome is not journaled yet: a lock's `Locked`
/// goes to disk with the checkpoint's `CheckpointStarted`, a checkpoint's `Checkpointed` with
/// `Verified` (one `fdatasync` each instead of two), and those after the GPU-free moment
/// (`freeze-after-gpu-free`: NVML already verified the GPU free). The journal then shows the
/// suspension in flight at its last intent (`LockStarted`, `CheckpointStarted`), with the
/// freeze's purpose, and the next stop settles the worker from what the driver says: a locked
/// one is unlocked and serves again; a checkpointed one is left checkpointed (a stop has no
/// guard to resume it under), and `cryo stop` then ends it without a wedge.
#[test]
fn a_freeze_killed_before_its_lock_or_checkpoint_is_journaled_is_settled_by_the_next_stop() {
    use cryo_journal::{Event, Purpose, StopStep};
    for (failpoint, found, step) in [
        ("suspend-after-lock", "locked", StopStep::LockStarted),
        (
            "suspend-after-checkpoint",
            "checkpointed",
            StopStep::CheckpointStarted,
        ),
        (
            "freeze-after-gpu-free",
            "checkpointed",
            StopStep::CheckpointStarted,
        ),
    ] {
        let mut env = Env::start("1GiB");
        let (pid, ep) = env.worker("64MiB", 0);
        let before = answers(&ep);
        let image = env.path().join("img");
        freeze_killed_at(&env, pid, &image, false, failpoint);
        let state = |env: &Env| env.sim.gpu.driver.state(pid).unwrap().to_string();
        assert_eq!(state(&env), found, "{failpoint}");
        let id = cryo_journal::ProcId::of(pid).unwrap();
        let journal = cryo_journal::read(env.path().join("state").join("journal")).unwrap();
        let inflight = cryo_journal::in_flight_stops(&journal.records);
        let f = inflight
            .get(&id)
            .unwrap_or_else(|| panic!("{failpoint}: not in flight: {:?}", events(&env)));
        assert_eq!(f.step, Some(step), "{failpoint}");
        assert_eq!(f.purpose, Some(Purpose::Freeze), "{failpoint}");
        // The outcome of the action it was killed after is not on disk: what recovery gets is
        // the intent alone.
        assert!(
            !events(&env).iter().any(|e| match (failpoint, e) {
                ("suspend-after-lock", Event::Locked { pid: p, .. }) => *p == id,
                (
                    "suspend-after-checkpoint" | "freeze-after-gpu-free",
                    Event::Checkpointed { pid: p, .. } | Event::Verified { pid: p, .. },
                ) => *p == id,
                _ => false,
            }),
            "{failpoint}: {:?}",
            events(&env)
        );
        assert!(!image.exists());

        let (other, _) = env.worker("16MiB", 1);
        let out = env.cryo(&["stop", "--json", &other.to_string()]);
        assert!(out.status.success(), "{}", stderr(&out));
        env.reap_worker(other);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let settled = v["settled"]
            .as_array()
            .cloned()
            .unwrap_or_default()
            .into_iter()
            .find(|s| s["pid"]["pid"] == pid)
            .unwrap_or_else(|| panic!("{failpoint}: not settled: {v}"));
        assert_eq!(settled["found"], found, "{settled}");
        if found == "locked" {
            assert_eq!(settled["action"]["kind"], "unlocked", "{settled}");
            assert_eq!(state(&env), "running");
            assert_eq!(answers(&ep), before, "it serves as before");
        } else {
            assert_eq!(settled["action"]["kind"], "until_watched", "{settled}");
            assert_eq!(state(&env), "checkpointed");
        }
        env.stop_clean(pid);
    }
}

/// A freeze writes some records without an `fdatasync` of their own, carried to disk by the
/// next synced append: `FreezeStarted` (with the suspension's first intent), a checkpoint's
/// `CheckpointStarted` and the lock's `Locked` once the lock's intent is on disk (with the
/// verification's records), `Dumped` (with `ImagePublished`). A kill keeps them; a power cut may
/// lose them. A freeze of a live restored worker killed after its lock and after its checkpoint,
/// its journal then cut back to its last synced record (what a power cut may leave), still names
/// the worker a live restored context (what the guard watches) with its suspension in flight
/// from the lock's intent: an agent started then traces it and, the context found checkpointed,
/// resumes it in place under its guard; it serves as before and stops without a wedge.
#[test]
fn a_freeze_of_a_restored_worker_cut_back_to_its_last_synced_record_is_found_by_the_agent() {
    use cryo_journal::{Event, Purpose, StopStep};
    for (failpoint, unsynced) in [
        ("suspend-after-lock", &[][..]),
        (
            "suspend-after-checkpoint",
            &["Locked", "CheckpointStarted"][..],
        ),
        (
            "freeze-after-gpu-free",
            &["Locked", "CheckpointStarted"][..],
        ),
    ] {
        let mut env = Env::start("1GiB");
        let (pid, ep) = env.worker("64MiB", 0);
        make_restored(&env, pid);
        let before = answers(&ep);
        let id = cryo_journal::ProcId::of(pid).unwrap();
        let image = env.path().join("img");
        freeze_killed_at(&env, pid, &image, false, failpoint);
        let dir = env.path().join("state").join("journal");
        let records = cryo_journal::read(&dir).unwrap().records;
        // The records after the last synced one are the ones written unsynced, in this order.
        let tail: Vec<String> = records[records.len() - unsynced.len()..]
            .iter()
            .map(|r| format!("{:?}", r.event))
            .collect();
        for (kind, said) in unsynced.iter().zip(&tail) {
            assert!(said.starts_with(kind), "{failpoint}: {tail:?}");
        }
        // The lock's intent, synced, carries the freeze's start with it.
        let synced = &records[..records.len() - unsynced.len()];
        let last = synced
            .iter()
            .rev()
            .take(3)
            .map(|r| &r.event)
            .collect::<Vec<_>>();
        assert!(
            matches!(last[..], [Event::LockStarted { pid: p }, Event::SuspendStarted { purpose: Purpose::Freeze, .. }, Event::FreezeStarted { .. }] if *p == id),
            "{failpoint}: {last:?}"
        );
        cut_last_frames(&dir.join(cryo_journal::FILE_NAME), unsynced.len());
        let records = cryo_journal::read(&dir).unwrap().records;
        assert_eq!(
            cryo_journal::Origins::from_records(&records).live_restored(),
            vec![id],
            "{failpoint}"
        );
        let inflight = cryo_journal::in_flight_stops(&records);
        assert_eq!(
            inflight[&id].step,
            Some(StopStep::LockStarted),
            "{failpoint}"
        );

        let agent = Agent::start(&env);
        eventually(PATIENCE, "the agent to trace the worker", || {
            agent.traces(pid)
        });
        eventually(PATIENCE, "the agent to settle the worker", || {
            env.sim.gpu.driver.state(pid).ok() == Some(cryo_gpu::ProcessState::Running)
        });
        assert!(agent.traces(pid), "{failpoint}: resumed unguarded");
        assert_eq!(answers(&ep), before, "{failpoint}: it serves as before");
        env.stop_clean(pid);
        drop(agent);
    }
}

/// Cuts the journal file `path` back to before its last `n` frames: what a power cut may leave
/// of records written but not synced yet.
fn cut_last_frames(path: &Path, n: usize) {
    let bytes = fs::read(path).unwrap();
    let mut starts = Vec::new();
    let mut at = 0;
    while at + 16 <= bytes.len() {
        starts.push(at);
        let len = u32::from_le_bytes(bytes[at + 4..at + 8].try_into().unwrap()) as usize;
        at += 16 + len;
    }
    assert_eq!(at, bytes.len(), "whole frames only");
    let cut = if n == 0 {
        bytes.len()
    } else {
        starts[starts.len() - n]
    };
    fs::OpenOptions::new()
        .write(true)
        .open(path)
        .unwrap()
        .set_len(cut as u64)
        .unwrap();
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
    // An orphaned CRIU finishes or fails on its own: wait until it is gone (it let go of the
    // worker then; an untraced worker alone may be one CRIU has not seized yet).
    eventually(
        PATIENCE * 2,
        &format!("CRIU to end and let go of pid {pid}"),
        || criu_procs(env).is_empty() && (!alive(pid) || tracer(pid) == 0),
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
    // CRIU goes on without cryo, but its post-dump gate never gets cryo's verdict: it resumes
    // the tree instead of killing it (issue 16: CRIU writes the files, cryo's gate decides).
    // Waited for by CRIU's end: the worker is untraced also before CRIU seized it.
    eventually(
        PATIENCE * 2,
        &format!("CRIU to end and let go of pid {pid}"),
        || criu_procs(&env).is_empty() && (!alive(pid) || tracer(pid) == 0),
    );
    assert!(
        alive(pid),
        "the worker died with the freeze that was killed"
    );
    after_killed_freeze(&mut env, pid, &image);

    // SIGKILL after a complete dump, before publishing (failpoint).
    let (pid, _) = env.worker("32MiB", 1);
    let image = env.path().join("img2");
    let mut freeze = freeze_at(&env, pid, &image, false, "freeze-before-publish");
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    assert_eq!(
        staging(&image).len(),
        1,
        "the complete dump stays staged, unpublished"
    );
    after_killed_freeze(&mut env, pid, &image);

    // The next freeze of the same path removes the abandoned staging directory, and the
    // private directories of the killed dumps (CRIU's gate, socket, log) are gone too.
    let (pid, _) = env.worker("16MiB", 1);
    env.freeze(pid, &image);
    assert!(staging(&image).is_empty());
    env.thaw_ok(&image, &[]);
    assert_eq!(criu_dirs(&env), Vec::<PathBuf>::new());
    env.stop_clean(pid);
}

/// Issue 16: cryo's follower hashes CRIU's pages files as CRIU writes them. A freeze killed at
/// CRIU's gate, its follower holding the digests of pages CRIU wrote (their writeback started),
/// publishes nothing and tears nothing down: CRIU gets no verdict and resumes the tree; the
/// next freeze of the path removes the abandoned staging directory, and its image thaws.
#[test]
fn a_freeze_killed_at_the_dump_gate_with_the_pages_followed_publishes_nothing() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("64MiB", 0);
    let image = env.path().join("img");
    let mut freeze = freeze_at(&env, pid, &image, false, "freeze-at-dump-gate");
    eventually(
        PATIENCE,
        "the follower to read a chunk of CRIU's pages before the gate",
        || follower_read(freeze.id()) >= 4 << 20,
    );
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    eventually(
        PATIENCE * 2,
        &format!("CRIU to end and let go of pid {pid}"),
        || criu_procs(&env).is_empty() && (!alive(pid) || tracer(pid) == 0),
    );
    assert!(
        alive(pid),
        "the worker died with the freeze killed at the gate"
    );
    assert_eq!(
        staging(&image).len(),
        1,
        "the dump stays staged, unpublished"
    );
    after_killed_freeze(&mut env, pid, &image);

    let (pid, _) = env.worker("16MiB", 1);
    env.freeze(pid, &image);
    assert!(staging(&image).is_empty());
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// Seam (session 14): the suspension's first intent (its `LockStarted`, synced before the first
/// lock) that cannot be made durable (the journal's `fdatasync` fails with EIO; failpoint)
/// refuses the freeze before the driver is touched: nothing locked, the worker serves on. Before:
/// the failure was only logged and the freeze locked, checkpointed and dumped the worker with
/// nothing on disk for a recovery had it died (and failed only at the end, the worker gone).
#[test]
fn a_freeze_whose_lock_intent_cannot_be_synced_refuses_and_never_locks() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("16MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    let out = env
        .cmd()
        .env("CRYO_FAILPOINT", cryo_journal::SYNC_FAILPOINT)
        .args(["freeze", &pid.to_string(), "--image"])
        .arg(&image)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "refused: {}", stderr(&out));
    assert!(
        stderr(&out).contains("journal cannot take the suspension's intent"),
        "{}",
        stderr(&out)
    );
    assert!(!image.exists());
    assert!(alive(pid), "the worker was ended");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Running
    );
    assert_eq!(answers(&sock), before);
    // Every record was written (only the syncs failed): none says it was locked.
    let locked = events(&env).into_iter().filter(|e| {
        matches!(e, Event::Locked { pid: p, .. } | Event::Checkpointed { pid: p, .. } if p.pid == pid)
    });
    assert_eq!(locked.count(), 0, "the worker was locked");
    env.stop_clean(pid);
}

/// The CPUs the main thread of `pid` may run on.
fn cpus_of(pid: i32) -> Vec<usize> {
    let set = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(pid)).unwrap();
    (0..nix::sched::CpuSet::count())
        .filter(|c| set.is_set(*c).unwrap())
        .collect()
}

/// Lets the main thread of `pid` run on `cpus` only.
fn set_cpus(pid: i32, cpus: &[usize]) {
    let mut set = nix::sched::CpuSet::new();
    for c in cpus {
        set.set(*c).unwrap();
    }
    nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(pid), &set).unwrap();
}

/// A worker's freeze killed at CRIU's gate (its pages dumped, the worker pinned to one CPU for
/// the dump and frozen by CRIU): `at_gate` runs there with the pinned CPU first. CRIU gets no
/// verdict and resumes the worker. Returns the worker's pid, its own CPUs and the CPU it was
/// pinned to.
fn freeze_killed_pinned(
    env: &mut Env,
    at_gate: impl FnOnce(i32, usize),
) -> (i32, Vec<usize>, usize) {
    let (pid, _) = env.worker("16MiB", 0);
    let own = cpus_of(pid);
    assert!(
        own.len() > 1,
        "the attack needs a worker that may run on two CPUs or more: {own:?}"
    );
    let image = env.path().join(format!("img-{pid}"));
    let mut freeze = freeze_at(env, pid, &image, false, "freeze-at-dump-gate");
    let pinned = cpus_of(pid);
    assert_eq!(pinned.len(), 1, "the dump pins the worker to one CPU");
    at_gate(pid, pinned[0]);
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    eventually(
        PATIENCE * 2,
        &format!("CRIU to end and let go of pid {pid}"),
        || criu_procs(env).is_empty() && (!alive(pid) || tracer(pid) == 0),
    );
    assert!(alive(pid), "CRIU resumes the worker without a verdict");
    (pid, own, pinned[0])
}

/// Whoever finds a dead freeze (here a guard that starts, as the agent's start does) closes the
/// CPU pinning of its dump: the journal's `CpusReturned` of the recovery.
fn wait_pins_settled(env: &Env) -> Vec<cryo_journal::ProcId> {
    eventually(
        PATIENCE,
        "the recovery to settle the dump's CPU sets",
        || {
            events(env).iter().find_map(|e| match e {
                cryo_journal::Event::CpusReturned {
                    recovery: true,
                    returned,
                    ..
                } => Some(returned.clone()),
                _ => None,
            })
        },
    )
}

/// Seam (session 14): a dump pins the main thread of every process of the tree to one CPU. A
/// freeze killed at CRIU's gate (SIGKILL, OOM, a crash) gets no verdict: CRIU resumes the
/// worker, still pinned. The guard that starts next (the agent's start does the same) gives it
/// its own CPU set back from the journal. Before: the worker stayed on one CPU for the rest of
/// its life, and nothing in the journal said so.
#[test]
fn a_worker_left_pinned_by_a_freeze_killed_at_the_dump_gate_gets_its_cpus_back() {
    let mut env = Env::start("1GiB");
    let (pid, own, _) = freeze_killed_pinned(&mut env, |_, _| {});
    let guard = hourly_guard(&env);
    // The guard resumes the worker (its freeze left it CHECKPOINTED) after it gave back the
    // dump's CPU sets.
    eventually(PATIENCE, "the guard to resume the worker", || {
        events(&env).iter().any(
            |e| matches!(e, cryo_journal::Event::SuspensionSettled { pid: p, .. } if p.pid == pid),
        )
    });
    assert_eq!(cpus_of(pid), own, "the worker got its own CPU set back");
    let returned = wait_pins_settled(&env);
    assert_eq!(
        returned.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![pid]
    );
    drop(guard);
    env.stop_clean(pid);
}

/// Seam (session 14): the next `cryo freeze` of a worker a dead freeze left pinned gives the
/// worker its own CPU set back once its own dump is over (its own pin given back first), without
/// waiting for a stop or a guard start. Before: the worker stayed on the dead dump's CPU through
/// every later freeze (each gave back the set it found: the pin).
#[test]
fn the_next_freeze_gives_back_what_a_dead_freeze_left_pinned() {
    let mut env = Env::start("1GiB");
    let (pid, own, _) = freeze_killed_pinned(&mut env, |_, _| {});
    let image = env.path().join("img-again");
    let out = env.cryo(&[
        "freeze",
        &pid.to_string(),
        "--leave-running",
        "--image",
        image.to_str().unwrap(),
    ]);
    println!(
        "second freeze: {} {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(cpus_of(pid), own, "the worker got its own CPU set back");
    let returned = wait_pins_settled(&env);
    assert_eq!(
        returned.iter().map(|p| p.pid).collect::<Vec<_>>(),
        vec![pid]
    );
    env.stop_clean(pid);
}

/// The same change of a worker's CPU set at the gate, the freeze let go on (`--leave-running`):
/// the dump gives back only sets that are still its pin. Before: it wrote the saved set over
/// the new one.
#[test]
fn a_cpu_set_changed_during_the_dump_is_not_overwritten_when_the_dump_ends() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("16MiB", 0);
    let image = env.path().join("img");
    let resume = env.path().join("resume");
    // Its stderr in a file: it goes on writing there after the gate.
    let log = env.path().join("freeze.err");
    let mut freeze = env
        .cmd()
        .env("CRYO_FAILPOINT", "freeze-at-dump-gate")
        .env("CRYO_FAILPOINT_RESUME", &resume)
        .args(["freeze", &pid.to_string(), "--leave-running", "--image"])
        .arg(&image)
        .stdout(Stdio::null())
        .stderr(fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the freeze to reach CRIU's gate", || {
        fs::read_to_string(&log).is_ok_and(|l| l.contains("failpoint"))
    });
    let pinned = cpus_of(pid);
    assert_eq!(pinned.len(), 1, "the dump pins the worker to one CPU");
    let moved = usize::from(pinned[0] == 0);
    set_cpus(pid, &[moved]);
    fs::write(&resume, "").unwrap();
    let status = freeze.wait().unwrap();
    assert!(
        status.success(),
        "freeze: {}",
        fs::read_to_string(&log).unwrap()
    );
    assert_eq!(
        cpus_of(pid),
        vec![moved],
        "a set changed since was overwritten"
    );
    assert!(events(&env).iter().any(|e| matches!(
        e,
        cryo_journal::Event::CpusReturned { left, recovery: false, .. }
            if left.iter().map(|p| p.pid).collect::<Vec<_>>() == vec![pid]
    )));
    env.stop_clean(pid);
}

/// As above, the tree forking once CRIU resumed it and before the recovery (a worker starts
/// threads and helpers as it serves): what a pinned main thread starts takes its pin. The
/// recovery gives that back too (the tree's own set, to what started after the pin). Before:
/// the fork stayed on one CPU.
#[test]
fn what_a_tree_left_pinned_forks_before_the_recovery_gets_its_cpus_back() {
    let env = Env::start("1GiB");
    let tree = procs::Procs::reaping_tree(1);
    let root = tree.pid(0);
    let own = cpus_of(root);
    assert!(own.len() > 1, "needs two CPUs or more: {own:?}");
    let image = env.path().join("img");
    let mut freeze = freeze_at(&env, root, &image, false, "freeze-at-dump-gate");
    assert_eq!(cpus_of(root).len(), 1, "the dump pins the root to one CPU");
    freeze.kill().unwrap();
    freeze.wait().unwrap();
    eventually(PATIENCE * 2, "CRIU to end and let go of the tree", || {
        criu_procs(&env).is_empty() && tracer(root) == 0
    });
    let before = cryo_proc::tree(root).unwrap();
    procs::kill(root, nix::sys::signal::Signal::SIGUSR1 as i32);
    let late = eventually(PATIENCE, "the root to fork", || {
        cryo_proc::tree(root)
            .unwrap()
            .into_iter()
            .find(|p| !before.contains(p) && cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep"))
    });
    assert_eq!(cpus_of(late).len(), 1, "the fork took the root's pin");
    let guard = hourly_guard(&env);
    wait_pins_settled(&env);
    assert_eq!(cpus_of(root), own);
    assert_eq!(cpus_of(late), own, "the fork kept the pin");
    drop(guard);
}

/// As above, the worker gone and its pid taken by another process (pinned to the same CPU, as
/// a leftover would be) before the recovery: the recovery opens only the process recorded, so
/// it touches nothing, and closes the record.
#[test]
fn a_reused_pid_of_a_worker_left_pinned_is_not_touched() {
    let mut env = Env::start("1GiB");
    let (pid, _, cpu) = freeze_killed_pinned(&mut env, |_, _| {});
    // CHECKPOINTED by the freeze: its end is the safe kind.
    sigkill(pid);
    env.reap_worker(pid);
    eventually(PATIENCE, &format!("pid {pid} to be free"), || !exists(pid));
    let mut reuser = procs::spawn_with_pid(pid).expect("pid reused");
    set_cpus(pid, &[cpu]);
    let guard = hourly_guard(&env);
    assert_eq!(wait_pins_settled(&env), Vec::new());
    assert_eq!(
        cpus_of(pid),
        vec![cpu],
        "the reused pid's process was touched"
    );
    drop(guard);
    reuser.kill().unwrap();
    reuser.wait().unwrap();
    env.sim.assert_no_wedge();
}

/// As above, the worker's CPU set changed by someone else while CRIU held it at the gate (the
/// CPU manager of Kubernetes rewrites cpusets): the set is theirs, the recovery leaves it.
#[test]
fn a_cpu_set_changed_during_the_dump_is_not_overwritten_by_the_recovery() {
    let mut env = Env::start("1GiB");
    let mut moved = 0;
    let (pid, _, _) = freeze_killed_pinned(&mut env, |pid, cpu| {
        moved = usize::from(cpu == 0);
        set_cpus(pid, &[moved]);
    });
    let guard = hourly_guard(&env);
    assert_eq!(wait_pins_settled(&env), Vec::new());
    assert_eq!(
        cpus_of(pid),
        vec![moved],
        "a set changed since was overwritten"
    );
    drop(guard);
    env.stop_clean(pid);
}

/// `cryo freeze PID --image IMAGE` with `failpoint` active, which must fail it: its stderr.
fn freeze_refused_at(env: &Env, pid: i32, image: &Path, failpoint: &str) -> String {
    let out = env
        .cmd()
        .env("CRYO_FAILPOINT", failpoint)
        .args(["freeze", &pid.to_string(), "--image"])
        .arg(image)
        .output()
        .unwrap();
    assert!(!out.status.success(), "published: {}", stdout(&out));
    stderr(&out)
}

/// A freeze writes its suspension's last records (`Verified`, the outcomes with it) without
/// waiting for stable storage and syncs them beside CRIU's start, so that GPU free waits for one
/// `fdatasync` (the lock's intent): CRIU's gate, where the tree would be ended, waits for that
/// sync. A sync that fails (injected) ends nothing: the gate refuses the dump, CRIU resumes the
/// tree and the freeze resumes the worker in place; it serves as before, nothing is published,
/// nothing was torn down.
#[test]
fn a_freeze_whose_suspension_cannot_be_synced_ends_nothing() {
    let mut env = Env::start("1GiB");
    let (pid, ep) = env.worker("64MiB", 0);
    let before = answers(&ep);
    let image = env.path().join("img");
    let err = freeze_refused_at(&env, pid, &image, "freeze-suspension-unsynced");
    assert!(err.contains("cannot be made durable"), "{err}");
    assert!(
        alive(pid),
        "the worker ended with its suspension not on disk"
    );
    assert!(!image.exists(), "an image was published");
    assert_eq!(answers(&ep), before, "it serves as before");
    env.stop_clean(pid);
}

/// A freeze writes what its verification found (each process's `Checkpointed` and `Verified`)
/// right after GPU free; the guard's let-go and everything after it stand on those records. A
/// write that fails there (a full disk, EIO: injected) must let nothing go and end nothing: the
/// worker is a live restored one (the guard traces it), so the freeze stops there, resumes it in
/// place under its guard and says so; it serves as before, nothing is published, nothing was
/// torn down. (Before: the write's error was only logged, the guard let go on its liveness look,
/// CRIU dumped and ended the worker, and the image was published with no record of the
/// suspension in the journal.)
#[test]
fn a_freeze_whose_verification_cannot_be_journaled_lets_nothing_go_and_resumes_the_worker() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let guard = hourly_guard(&env);
    let (pid, ep) = env.worker("64MiB", 0);
    make_restored(&env, pid);
    assert_ne!(tracer(pid), 0, "a restore through cryo is traced");
    let before = answers(&ep);
    let image = env.path().join("img");
    let err = freeze_refused_at(&env, pid, &image, "freeze-verified-unwritten");
    assert!(!image.exists(), "an image was published");
    assert!(alive(pid), "the worker was ended: {err}");
    assert!(err.contains("verification"), "{err}");
    assert!(err.contains("serves again"), "{err}");
    assert_ne!(tracer(pid), 0, "the guard let go of the worker");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Running
    );
    assert_eq!(answers(&ep), before, "it serves as before");
    env.sim.assert_no_wedge();
    let id = cryo_journal::ProcId::of(pid).unwrap();
    let all = events(&env);
    let freeze = position(&env, |e| matches!(e, Event::FreezeStarted { .. })).unwrap();
    let since = &all[freeze..];
    assert!(
        !since
            .iter()
            .any(|e| matches!(e, Event::Verified { pid: p, .. } if *p == id)),
        "the failpoint wrote the verification: {since:?}"
    );
    assert!(
        since
            .iter()
            .any(|e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id)),
        "not resumed in place: {since:?}"
    );
    drop(guard);
    env.stop_clean(pid);
}

/// The same write on a disk that is full (a real `ENOSPC`: the state directory on a small
/// tmpfs, filled while the freeze is paused at GPU free): that write is refused, and so is every
/// one after it, the undo's restore intent included (journaled before it acts). The worker is
/// left CHECKPOINTED, traced by its guard, neither let go nor torn down, and the freeze names it
/// and how to bring it back; its suspension is in flight in the journal (`CheckpointStarted`),
/// so once there is room again the next guard's start restores and unlocks it in place under
/// watch, and it serves as before.
#[test]
fn a_freeze_meeting_a_full_disk_at_gpu_free_leaves_the_worker_suspended_and_guarded() {
    let mut env = Env::start("1GiB");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&env.path().join("state"), "16M");
    let mut guard = hourly_guard(&env);
    let (pid, ep) = env.worker("64MiB", 0);
    make_restored(&env, pid);
    let before = answers(&ep);
    let image = env.path().join("img");
    let go = env.path().join("go");
    let mut freeze = env
        .cmd()
        .env("CRYO_FAILPOINT", "freeze-after-gpu-free")
        .env("CRYO_FAILPOINT_RESUME", &go)
        .args(["freeze", &pid.to_string(), "--image"])
        .arg(&image)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = freeze.stderr.take().unwrap();
    let mut said = common::said_until(&mut err, "paused until");
    let filler = disk.fill();
    common::fill_journal_page(&env.path().join("state"));
    fs::write(&go, b"").unwrap();
    err.read_to_string(&mut said).unwrap();
    let status = freeze.wait().unwrap();
    assert!(!status.success(), "{said}");
    assert!(!image.exists(), "an image was published");
    assert!(alive(pid), "the worker was ended: {said}");
    assert_ne!(tracer(pid), 0, "the worker is not guarded: {said}");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed
    );
    assert!(said.contains("could not be journaled"), "{said}");
    assert!(said.contains(&format!("pid {pid}:")), "not named: {said}");
    env.sim.assert_no_wedge();

    // Room again; a guard that starts now settles what the freeze left in flight.
    fs::remove_file(filler).unwrap();
    guard.kill();
    let guard = hourly_guard(&env);
    eventually(PATIENCE, "the new guard to resume the worker", || {
        env.sim.gpu.driver.state(pid).ok() == Some(cryo_gpu::ProcessState::Running)
    });
    assert_ne!(tracer(pid), 0, "resumed unguarded");
    assert_eq!(answers(&ep), before, "it serves as before");
    env.sim.assert_no_wedge();
    env.stop_clean(pid);
    drop(guard);
    drop(disk);
}

/// Bytes the follower thread (`cryo-follow`) of process `pid` has read (`rchar`); 0 if it has
/// none.
fn follower_read(pid: u32) -> u64 {
    let Ok(tasks) = fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim() == "cryo-follow")
        })
        .filter_map(|t| fs::read_to_string(t.path().join("io")).ok())
        .filter_map(|io| {
            io.lines()
                .find_map(|l| l.strip_prefix("rchar: "))
                .and_then(|n| n.trim().parse::<u64>().ok())
        })
        .sum()
}

/// The private directories of CRIU runs under `env`'s state directory.
fn criu_dirs(env: &Env) -> Vec<PathBuf> {
    let root = env.path().join("state").join("criu");
    fs::read_dir(&root)
        .map(|rd| {
            rd.map(|e| e.unwrap().path())
                .filter(|p| {
                    p.file_name()
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .starts_with("cryo-criu-")
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Issue 16 item 4: a thaw killed mid-restore (CRIU restored every process and waits at cryo's
/// gate; none ran) left its private directory (`/tmp/cryo-criu-restore-*`: the gate, CRIU's work
/// files and log) behind for good. It works under the state directory now, and the next command
/// that sets CRIU up removes what the dead thaw left; nothing of the killed thaw ran, and the
/// image thaws and serves.
#[test]
fn a_thaw_killed_mid_restore_leaves_no_directory_behind() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("16MiB");

    let mut thaw = env
        .cmd()
        .env("CRYO_FAILPOINT", cryo_lifecycle::thaw::THAW_AT_CRIU_GATE)
        .arg("thaw")
        .arg(&image)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    wait_failpoint(&mut thaw);
    let left = criu_dirs(&env);
    assert_eq!(left.len(), 1, "the thaw's private directory: {left:?}");
    assert!(
        alive(pid),
        "CRIU restored the tree and holds it at the gate"
    );
    thaw.kill().unwrap();
    thaw.wait().unwrap();
    // No verdict: CRIU aborts the restore and kills the tree, which never ran.
    eventually(PATIENCE, "CRIU to remove the restored tree", || !alive(pid));
    procs::reap(pid);
    assert!(
        left[0].exists(),
        "nobody removed the dead thaw's directory yet"
    );

    env.thaw_ok(&image, &[]);
    assert!(
        !left[0].exists(),
        "the dead thaw's directory is still there"
    );
    assert_eq!(criu_dirs(&env), Vec::<PathBuf>::new());
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
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
        .args([
            "bench", "freeze", "--sizes", "16MiB", "--rounds", "1", "--jitter", "20", "--json",
        ])
        .env_remove("CRYO_GPU")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let row = &rows[0];
    assert_eq!(row["jitter_ms"], 20, "{row}");
    // Every moment measured on both arms: GPU free, worker gone, durable, thaw warm and cold.
    for arm in ["cryo", "bare"] {
        let moments = row[arm].as_array().unwrap();
        assert_eq!(moments.len(), 5, "{row}");
        for m in moments {
            assert!(m[0].as_f64().unwrap() > 0.0, "{arm}: {row}");
        }
    }
    for r in row["ratio"].as_array().unwrap() {
        assert!(r.as_f64().unwrap() > 0.0, "{row}");
    }
    // The simulated driver timed every copy of each arm (checkpoint, both restores), and each
    // moment's overhead is the moment less them: below the moment, above zero.
    for (k, arm) in ["cryo", "bare"].into_iter().enumerate() {
        let copies = row["sim_copies"][k].as_array().unwrap();
        assert_eq!(copies.len(), 3, "{row}");
        for c in copies {
            assert!(c[0].as_f64().unwrap() > 0.0, "{arm}: {row}");
        }
        for (i, o) in row["overhead"][k].as_array().unwrap().iter().enumerate() {
            let o = o[0].as_f64().unwrap();
            assert!(
                o > 0.0 && o < row[arm][i][0].as_f64().unwrap(),
                "{arm}: {row}"
            );
        }
    }
    // CRIU's page loop, as CRIU timed it in each arm's image (its stats-dump), lies inside the
    // dump step (GPU free to worker gone), and the rest of the step is what is left of it.
    for (k, arm) in ["cryo", "bare"].into_iter().enumerate() {
        let pages = row["criu_pages"][k][0].as_f64().unwrap();
        let step = row[arm][1][0].as_f64().unwrap() - row[arm][0][0].as_f64().unwrap();
        assert!(pages > 0.0 && pages < step, "{arm}: {row}");
        let besides = row["dump_besides_pages"][k][0].as_f64().unwrap();
        assert!((besides - (step - pages)).abs() < 1e-6, "{arm}: {row}");
    }
    for k in ["write_fsync", "read_cold", "read_cached"] {
        assert!(row["limits"][k].as_f64().unwrap() > 0.0, "{k}: {row}");
    }
    assert!(row["image_bytes"].as_u64().unwrap() > 16 << 20, "{row}");
    // What each arm's thaws worked with: the restored root's CPU (it ran CRIU's restorer, at
    // least the faulting-in of its memory), the host's free memory at the start, and when the
    // page-cache thaw started after the worker was gone (after it: the image was published).
    let hosts = row["thaw_host"].as_array().unwrap();
    assert_eq!(hosts.len(), 2, "{row}");
    for h in hosts {
        for k in ["restored_cpu", "free_mib"] {
            for warm_cold in h[k].as_array().unwrap() {
                assert!(warm_cold[0].as_f64().unwrap() > 0.0, "{k}: {row}");
            }
        }
        assert!(h["thaw_after_gone"][0].as_f64().unwrap() > 0.0, "{row}");
        // The host's free memory and page cache when each freeze started.
        assert!(h["freeze_host"][0][0].as_f64().unwrap() > 0.0, "{row}");
        assert!(h["freeze_host"][1][0].as_f64().unwrap() >= 0.0, "{row}");
    }
    // Each cache state's restores sorted by their fault mode (one round: two restores each),
    // and the thaw, its overhead and the CRIU step compared over the rounds where both ran fast.
    let modes = row["fault_modes"].as_array().unwrap();
    assert_eq!(modes.len(), 2, "{row}");
    for f in modes {
        assert!(f["median_cpu"].as_f64().unwrap() > 0.0, "{row}");
        let slow: u64 = f["slow"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n.as_u64().unwrap())
            .sum();
        let like = f["like_rounds"].as_u64().unwrap();
        assert!(
            slow <= 2 && like <= 1 && (like == 1) == (slow == 0),
            "{row}"
        );
        let paired = f["like_paired"].as_array().unwrap();
        assert_eq!(paired.len(), 3, "{row}");
        for p in paired {
            assert_eq!(p["samples"].as_u64().unwrap(), like, "{row}");
        }
    }
    // Without --settle no phase starts after the settle step.
    assert_eq!(row["settled"], false, "{row}");
}

/// An arm that fails ends the sim worker it started: here the `criu dump` command line fails
/// (a CRIU that execs the real one for everything else: cryo's own dump goes through), so the
/// warm-up's bare arm fails with its worker suspended; the benchmark fails, and no sim worker
/// of its directory is left running once it has exited (one was, holding its memory, before
/// `Workers`).
#[test]
fn bench_freeze_ends_its_workers_when_an_arm_fails() {
    criu_present();
    let real = cryo_criu::CriuRpc::locate(None)
        .unwrap()
        .path()
        .to_path_buf();
    let dir = tempfile::tempdir().unwrap();
    let criu = dir.path().join("criu");
    fs::write(
        &criu,
        format!(
            "#!/bin/sh\ncase \"$1\" in dump) echo 'dump refused by the test' >&2; exit 1;; esac\nexec {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&criu, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let out = Command::new(CRYO)
        .args([
            "bench", "freeze", "--sizes", "16MiB", "--rounds", "1", "--dir",
        ])
        .arg(dir.path())
        .env_remove("CRYO_GPU")
        .env("CRYO_CRIU", &criu)
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("criu dump failed"), "{err}");
    assert!(err.contains("ending sim worker"), "{err}");
    // The benchmark has exited: whatever it started and did not end runs now.
    let needle = dir.path().to_string_lossy().into_owned();
    let left: Vec<String> = fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| {
            let e = e.ok()?;
            e.file_name().to_str()?.parse::<i32>().ok()?;
            let cmd = fs::read(e.path().join("cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (cmd.contains("sim worker") && cmd.contains(&needle))
                .then(|| format!("{}: {cmd}", e.file_name().to_string_lossy()))
        })
        .collect();
    assert!(left.is_empty(), "sim workers left running: {left:?}; {err}");
}

/// `--thaw-after-gone MS`: both arms' page-cache thaws start no sooner than MS ms after their
/// worker was gone (at once after the freeze without it: well under a second for 16 MiB).
#[test]
fn bench_freeze_thaws_no_sooner_than_asked_after_the_worker_is_gone() {
    criu_present();
    nix::sys::prctl::set_child_subreaper(true).unwrap();
    let out = Command::new(CRYO)
        .args([
            "bench",
            "freeze",
            "--sizes",
            "16MiB",
            "--rounds",
            "1",
            "--json",
            "--thaw-after-gone",
            "1500",
        ])
        .env_remove("CRYO_GPU")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    let rows: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for h in rows[0]["thaw_host"].as_array().unwrap() {
        let after = h["thaw_after_gone"][0].as_f64().unwrap();
        assert!(after >= 1500.0, "{after}: {}", rows[0]);
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

/// Images written by the previous formats (3: no namespace pids; 2: SHA-256 per 64 MiB chunk;
/// 1: whole-file SHA-256) still thaw, through the same streamer, with their own checks.
#[test]
fn images_of_the_previous_formats_still_thaw() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("96MiB");
    assert_eq!(
        manifest(&image)["format_version"],
        cryo_criu::image::FORMAT_VERSION
    );
    for format in [3, 2, 1] {
        let m = cryo_criu::image::rewrite_as_format(&image, format, None).unwrap();
        assert_eq!(manifest(&image)["format_version"], format);
        assert_eq!(
            m.files.iter().all(|f| !f.sha256.is_empty()),
            format < 3,
            "format {format}"
        );
        let out = env.thaw(&image, &[]);
        assert!(out.status.success(), "format {format}: {}", stderr(&out));
        assert_eq!(answers(&sock), before, "format {format}");
        env.stop(pid);
    }
    // A damaged format-2 image is refused as CRIU reads it, like a new one.
    cryo_criu::image::rewrite_as_format(&image, 2, None).unwrap();
    let pages = pages_file(&image);
    flip_byte(&pages, 70 << 20);
    assert_refused_while_read(
        &mut env,
        &image,
        pid,
        &[
            pages.to_str().unwrap(),
            "checksum mismatch in bytes 67108864..",
        ],
    );
    env.sim.assert_no_wedge();
}

/// A `cryo thaw` paused at a failpoint.
struct PausedThaw {
    child: Child,
    /// Made, it lets the thaw go on.
    resume: PathBuf,
    /// Its stderr, a file (it stays open when the thaw is killed, and never fills up).
    said: PathBuf,
}

/// Starts `cryo thaw IMAGE EXTRA...` with the pausing failpoint `failpoint` and returns once it
/// is paused there.
fn thaw_paused_at(env: &Env, image: &Path, failpoint: &str, extra: &[&str]) -> PausedThaw {
    thaw_paused_with(env, image, failpoint, extra, &[])
}

/// [`thaw_paused_at`], with the environment variables `vars` set for the thaw too.
fn thaw_paused_with(
    env: &Env,
    image: &Path,
    failpoint: &str,
    extra: &[&str],
    vars: &[(&str, &Path)],
) -> PausedThaw {
    let resume = env.path().join("resume-thaw");
    let said = env.path().join("thaw.err");
    let _ = fs::remove_file(&resume);
    let child = env
        .cmd()
        .envs(vars.iter().copied())
        .env("CRYO_FAILPOINT", failpoint)
        .env("CRYO_FAILPOINT_RESUME", &resume)
        .arg("thaw")
        .arg(image)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(fs::File::create(&said).unwrap())
        .spawn()
        .unwrap();
    let mut paused = PausedThaw {
        child,
        resume,
        said,
    };
    eventually(PATIENCE, &format!("the thaw at {failpoint}"), || {
        let said = fs::read_to_string(&paused.said).unwrap_or_default();
        assert!(
            paused.child.try_wait().unwrap().is_none(),
            "the thaw ended before {failpoint}: {said}"
        );
        said.contains("is a test hook)")
    });
    paused
}

/// Starts `cryo thaw IMAGE` paused at the failpoint after the image was opened and checked;
/// returns the child and the file whose creation lets it go on.
fn thaw_paused(env: &Env, image: &Path) -> (Child, PathBuf) {
    let p = thaw_paused_at(env, image, cryo_lifecycle::thaw::THAW_BEFORE_RESTORE, &[]);
    (p.child, p.resume)
}

/// Issue 9 item 11: an image is trusted for the whole thaw, not only while it is checked. After
/// cryo checked the image (trust, manifest, sizes) and before CRIU reads it, root edits the
/// pages in place, then swaps a file for a changed copy: neither reaches a restored process.
/// (Before the streamer, CRIU read the files after the verify pass, and both thaws succeeded
/// with the changed bytes.)
#[test]
fn an_image_changed_during_the_thaw_never_reaches_the_worker() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("48MiB");
    let pages = pages_file(&image);
    let original = fs::read(&pages).unwrap();

    // Edited in place (same inode) while the thaw waits.
    let (thaw, resume) = thaw_paused(&env, &image);
    flip_byte(&pages, original.len() / 3);
    fs::write(&resume, b"").unwrap();
    let out = thaw.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "an edited image was thawed: {}",
        fs::read_to_string(env.path().join("thaw.err")).unwrap_or_default()
    );
    assert!(!exists(pid), "a process is left from a refused image");
    fs::write(&pages, &original).unwrap();

    // Swapped for a changed copy (a new inode under the same name).
    let core = image.join(format!("core-{pid}.img"));
    let core_bytes = fs::read(&core).unwrap();
    let (thaw, resume) = thaw_paused(&env, &image);
    let swap = image.join("core.swap");
    let mut changed = core_bytes.clone();
    let at = changed.len() - 1;
    changed[at] ^= 0x01;
    fs::write(&swap, &changed).unwrap();
    fs::rename(&swap, &core).unwrap();
    fs::write(&resume, b"").unwrap();
    let out = thaw.wait_with_output().unwrap();
    assert_eq!(
        out.status.code(),
        Some(3),
        "a swapped image was thawed: {}",
        fs::read_to_string(env.path().join("thaw.err")).unwrap_or_default()
    );
    assert!(!exists(pid), "a process is left from a refused image");

    // Put back, the image thaws and serves what it served.
    fs::write(&core, &core_bytes).unwrap();
    env.thaws_as_before(&image, pid, &sock, &before);
}

/// Attack (session 21): a pages file truncated under a real CRIU restore, which CRIU 4.2's
/// restorer reads by looping on its `preadv` returning 0, never reaching the gate. The thaw
/// pauses once the check's watch is set and the files noted, before CRIU starts (failpoint
/// `image-check-steering-read-stalls`), and the pages file loses its second half (truncated
/// before the watch, it is refused before CRIU starts: `damaged_or_foreign_images_...`). The
/// refusal (the watch's, or the check's hashes, whichever says it first) must end CRIU and
/// what it restored at once: the thaw returns long before the restore's deadline, names the
/// pages file, no process of the image ran or is left, and nothing was journaled restored; the
/// whole image then thaws and serves. (Before: the thaw waited for the deadline, 30 s here,
/// 121 s by default, while CRIU's restorer wrote 1.78 GB of log, and failed with CRIU's
/// timeout, exit 1.)
#[test]
fn a_pages_file_truncated_under_criu_ends_the_restore_at_the_check_s_refusal() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("64MiB");
    let pages = pages_file(&image);
    let whole = fs::read(&pages).unwrap();
    let pids: Vec<i32> = manifest(&image)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_i64().unwrap() as i32)
        .collect();
    let journaled = events(&env).len();
    let deadline = Duration::from_secs(30);
    let paused = thaw_paused_at(
        &env,
        &image,
        cryo_criu::image::CHECK_STEERING_READ_STALLS,
        &["--criu-timeout", &deadline.as_secs().to_string()],
    );
    let half = (whole.len() as u64 / 2) & !4095;
    fs::File::options()
        .write(true)
        .open(&pages)
        .unwrap()
        .set_len(half)
        .unwrap();
    let started = std::time::Instant::now();
    fs::write(&paused.resume, b"").unwrap();
    let PausedThaw {
        mut child, said, ..
    } = paused;
    let status = child.wait().unwrap();
    let took = started.elapsed();
    let err = fs::read_to_string(&said).unwrap();
    assert_eq!(status.code(), Some(3), "after {took:?}: {err}");
    assert!(
        !err.contains("deadline") && took < deadline,
        "the refused restore waited for its deadline ({took:?}): {err}"
    );
    assert!(
        err.contains(pages.to_str().unwrap()),
        "names the pages file (after {took:?}): {err}"
    );
    for p in &pids {
        assert!(!exists(*p), "process {p} of the image is left: {err}");
    }
    let ev = events(&env).split_off(journaled);
    assert!(
        !ev.iter()
            .any(|e| matches!(e, cryo_journal::Event::RestoreCompleted { .. })),
        "journaled restored: {ev:?}"
    );
    assert!(
        matches!(ev.last(), Some(cryo_journal::Event::ThawFailed { .. })),
        "{ev:?}"
    );
    eprintln!("the refused thaw returned after {took:?}: {err}");

    fs::write(&pages, &whole).unwrap();
    env.thaws_as_before(&image, pid, &sock, &before);
}

/// Issue 9 item 11 through the command line: an image directory that another user owns is
/// refused before anything runs, and a freeze will not publish where others could write.
#[test]
fn images_others_could_change_are_refused_by_thaw_and_freeze() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("16MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    std::os::unix::fs::chown(&image, Some(65534), None).unwrap();
    assert_refused(
        &mut env,
        &image,
        pid,
        &[image.to_str().unwrap(), "not trusted", "owned by uid 65534"],
    );
    std::os::unix::fs::chown(&image, Some(0), None).unwrap();

    let (other, _) = env.worker("16MiB", 1);
    let open = env.path().join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, std::os::unix::fs::PermissionsExt::from_mode(0o777)).unwrap();
    let out = env.try_freeze(other, &open.join("img"), &[]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("not trusted") && err.contains("writable by everyone"),
        "{err}"
    );
    assert!(alive(other), "a refused freeze ended the worker");
    env.stop_clean(other);
}

/// Starts `cryo freeze PID --image IMAGE [--replace]` stalled at `failpoint`, then SIGKILLs it
/// there.
fn freeze_killed_at(env: &Env, pid: i32, image: &Path, replace: bool, failpoint: &str) {
    let mut freeze = freeze_at(env, pid, image, replace, failpoint);
    freeze.kill().unwrap();
    freeze.wait().unwrap();
}

/// `cryo freeze PID --image IMAGE [--replace]` stalled at `failpoint` (it said so).
fn freeze_at(env: &Env, pid: i32, image: &Path, replace: bool, failpoint: &str) -> Child {
    let mut c = env.cmd();
    c.env("CRYO_FAILPOINT", failpoint)
        .args(["freeze", &pid.to_string(), "--image"])
        .arg(image);
    if replace {
        c.arg("--replace");
    }
    let mut freeze = c.stderr(Stdio::piped()).spawn().unwrap();
    wait_failpoint(&mut freeze);
    freeze
}

/// A crash at every step of publish (after the dump; files fsync'd; manifest written; renamed
/// but the parent not fsync'd, the replaced image not removed) leaves at the image path no
/// image or a whole one (the old or the new one when replacing), and the next freeze of the
/// path cleans up what the crash left.
#[test]
fn a_crash_at_every_step_of_publish_leaves_no_image_or_a_whole_one() {
    let mut env = Env::start("1GiB");
    let steps = [
        "freeze-before-publish",
        "freeze-publish-synced",
        "freeze-publish-manifest-written",
        "freeze-publish-renamed",
    ];
    for replace in [false, true] {
        for (k, failpoint) in steps.iter().enumerate() {
            let image = env.path().join(format!("img-{replace}-{k}"));
            let old = if replace {
                let (p, _) = env.worker("8MiB", 1);
                env.freeze(p, &image);
                Some(p)
            } else {
                None
            };
            let (pid, _) = env.worker("16MiB", 0);
            freeze_killed_at(&env, pid, &image, replace, failpoint);
            // The dump was complete: CRIU ended the (suspended) worker.
            env.reap_worker(pid);
            let renamed = *failpoint == "freeze-publish-renamed";
            match (image.exists(), old) {
                (false, None) => assert!(!renamed, "{failpoint}: the renamed image is gone"),
                (false, Some(_)) => panic!("{failpoint}: the old image is gone"),
                (true, _) => {
                    let m = cryo_criu::image::verify(&image)
                        .unwrap_or_else(|e| panic!("{failpoint}: a broken image: {e}"));
                    let want = if renamed { pid } else { old.unwrap_or(pid) };
                    assert_eq!(m.root_pid, want, "{failpoint} (replace {replace})");
                }
            }
            // What the crash left (a staging directory, the exchanged old image) goes with the
            // next freeze of the path.
            let (next, _) = env.worker("8MiB", 0);
            let out = env.try_freeze(next, &image, &["--replace"]);
            assert!(out.status.success(), "{failpoint}: {}", stderr(&out));
            env.reap_worker(next);
            assert!(
                staging(&image).is_empty(),
                "{failpoint}: {:?}",
                staging(&image)
            );
            assert_eq!(cryo_criu::image::verify(&image).unwrap().root_pid, next);
        }
    }
    env.sim.assert_no_wedge();
}

/// A `cryo agent run` on this environment's state directory; SIGKILLed on drop.
struct Agent {
    child: std::process::Child,
    log: PathBuf,
    state: PathBuf,
}

impl Agent {
    fn start(env: &Env) -> Agent {
        Agent::spawn(env, None)
    }

    fn spawn(env: &Env, failpoint: Option<&str>) -> Agent {
        Agent::spawn_with(env, |cmd| {
            if let Some(f) = failpoint {
                cmd.env("CRYO_FAILPOINT", f);
            }
        })
    }

    /// An agent whose command `f` adjusted first (its environment: failpoints, `CRYO_CRIU`).
    fn spawn_with(env: &Env, f: impl FnOnce(&mut Command)) -> Agent {
        let agent = Agent::launch_with(env, f);
        let client = agent.client();
        eventually(PATIENCE, "the agent's socket", || client.status().is_ok());
        agent
    }

    /// [`Agent::spawn_with`] without waiting for its socket to answer: an agent stalled at a
    /// failpoint of its start (its guard's settlements run before it serves).
    fn launch_with(env: &Env, f: impl FnOnce(&mut Command)) -> Agent {
        let state = env.path().join("state");
        fs::create_dir_all(&state).unwrap();
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let log = state.join(format!("agent-{n}.log"));
        let file = fs::File::create(&log).unwrap();
        let mut cmd = env.cmd();
        f(&mut cmd);
        let child = cmd
            // The guard's journal poll once an hour: only the thaw's own guard-before-unlock
            // can trace a thawed worker in time.
            .args([
                "agent",
                "run",
                "--no-metrics-listen",
                "--no-memory-watch",
                "--poll-ms",
                "3600000",
                "--scan",
                "none",
            ])
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        Agent { child, log, state }
    }

    fn log(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn client(&self) -> cryo_api::AgentClient {
        cryo_api::AgentClient::new(cryo_state::StateDir::new(&self.state).agent_socket())
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        common::stop_pin_holder(&self.state);
    }
}

#[test]
fn freeze_and_thaw_go_through_the_agent_whose_guard_takes_the_restored_worker() {
    let mut env = Env::start("512MiB");
    let agent = Agent::start(&env);
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze: {}", stderr(&out));
    assert!(!stderr(&out).contains("nothing guards"), "{}", stderr(&out));
    assert!(
        stdout(&out).contains(&format!("frozen pid {pid}")),
        "{}",
        stdout(&out)
    );
    // Progress of the long operation reached the operator.
    assert!(stderr(&out).contains("checkpoint done"), "{}", stderr(&out));
    env.reap_worker(pid);
    assert!(!exists(pid), "the frozen worker must be gone");
    let out = env.thaw(&image, &["--health-url", &health(&sock)]);
    assert!(out.status.success(), "thaw: {}", stderr(&out));
    assert!(!stderr(&out).contains("nothing guards"), "{}", stderr(&out));
    assert_eq!(answers(&sock), before);
    // The agent's guard traced the restored worker before the thaw unlocked it: its tracer is
    // the agent when the thaw returns, and the journal says so in that order.
    let tracer = procs::tracer_pid(pid);
    assert!(
        tracer != 0
            && fs::read_to_string(format!("/proc/{tracer}/status"))
                .map(|s| {
                    s.lines()
                        .any(|l| l == format!("Tgid:\t{}", agent.child.id()))
                })
                .unwrap_or(false),
        "the thawed worker is not traced by the agent when the thaw returns (tracer {tracer})"
    );
    {
        use cryo_journal::{AttachSource, Event, ProcId};
        let id = ProcId::of(pid).unwrap();
        let ev = events(&env);
        let at = |f: &dyn Fn(&Event) -> bool| ev.iter().position(f);
        let restored = at(&|e| matches!(e, Event::RestoreCompleted { pid: p, .. } if *p == id));
        let attached = at(
            &|e| matches!(e, Event::GuardAttached { pid: p, source: AttachSource::Restore } if *p == id),
        );
        let unlocked = at(&|e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id));
        assert!(
            restored.is_some() && restored < attached && attached < unlocked,
            "journal order: restored {restored:?}, attached {attached:?}, unlocked {unlocked:?}"
        );
    }
    // A refusal keeps its exit code through the agent.
    let again = env.cryo(&["thaw", image.to_str().unwrap()]);
    assert_eq!(again.status.code(), Some(3), "{}", stderr(&again));
    assert!(in_use(&stderr(&again), pid), "{}", stderr(&again));
    // The restored root is the agent's child: the agent reaps it once stopped (no zombie).
    let ppid = |pid: i32| {
        fs::read_to_string(format!("/proc/{pid}/status"))
            .unwrap()
            .lines()
            .find_map(|l| l.strip_prefix("PPid:\t").map(|p| p.parse::<u32>().unwrap()))
            .unwrap()
    };
    assert_eq!(ppid(pid), agent.child.id());
    // Untraced (the guard's tracer would reap it itself): only the parent can.
    let out = env.cryo(&["guard", "detach", "--pid", &pid.to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    eventually(PATIENCE, "the guard to let go", || {
        procs::tracer_pid(pid) == 0
    });
    let out = env.cryo(&["stop", &pid.to_string()]);
    assert!(out.status.success(), "{}", stderr(&out));
    env.thawed.retain(|p| *p != pid);
    eventually(PATIENCE, "the agent to reap the stopped worker", || {
        !exists(pid)
    });
    env.sim.assert_no_wedge();
    assert!(agent.log().contains("thaw"), "{}", agent.log());
}

/// Attack (session 20): a page lost under the agent's thaw. The check runs in the agent's
/// process, whose own SIGBUS handler (installed first: it logs a sent signal, and gives a
/// fault the default action, death) is the one before cryo's. The agent's check of the page
/// contents pauses with a span mapped (failpoint `image-check-mapped-span-pauses`), CRIU
/// reaches the gate, the pages file is truncated (its pages gone from the check's mapping: the
/// hash faults on each), and the check goes on. The fault must be the check's error, never the
/// agent's death: the thaw is refused naming the pages file, nothing restored runs, and the
/// agent lives and still answers; the same image, whole again, then thaws through it. (Before:
/// the agent died of SIGBUS, "talking to the agent: ... Peer disconnected": the check's threads
/// are started by the deadline layer's carriers, which block every signal, and a fault's
/// SIGBUS that its thread blocks reaches no handler, cryo's included.)
#[test]
fn a_page_lost_under_the_agents_thaw_is_refused_naming_the_image_and_the_agent_lives() {
    let mut env = Env::start("512MiB");
    let (mut agent, resume) =
        Agent::with_failpoint(&env, cryo_criu::image::CHECK_MAPPED_SPAN_PAUSES);
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let pages = pages_file(&image);
    let whole = fs::read(&pages).unwrap();
    let mut thaw = Killed(
        env.cmd()
            .arg("thaw")
            .arg(&image)
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let reached = format!(
        "failpoint {} reached",
        cryo_criu::image::CHECK_MAPPED_SPAN_PAUSES
    );
    eventually_said(
        PATIENCE,
        || {
            format!(
                "the agent's check never paused on a mapped span: {}",
                agent.log()
            )
        },
        || agent.log().contains(&reached),
    );
    // CRIU has read every page and waits at the gate for the check's verdict: the pages lost
    // now are lost to the check only (CRIU 4.2's restorer reading a truncated pages file loops
    // on its `preadv` returning 0 until the restore's deadline).
    let criu_dir = env.path().join("state").join("criu");
    let at_gate = || {
        fs::read_dir(&criu_dir).into_iter().flatten().any(|d| {
            fs::read_to_string(d.unwrap().path().join("restore.log"))
                .is_ok_and(|l| l.contains("Running post-restore scripts"))
        })
    };
    eventually(PATIENCE, "CRIU to wait at the gate", at_gate);
    fs::File::options()
        .write(true)
        .open(&pages)
        .unwrap()
        .set_len(0)
        .unwrap();
    fs::write(&resume, b"").unwrap();
    let mut err = String::new();
    thaw.0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = thaw.0.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(3),
        "{err}\nthe agent ({:?}) said: {}",
        agent.child.try_wait(),
        agent.log()
    );
    assert!(
        err.contains(pages.to_str().unwrap()),
        "names the pages file: {err}"
    );
    assert!(!exists(pid), "a restored process runs: {err}");
    assert!(
        agent.child_alive() && agent.client().status().is_ok(),
        "the agent died of the fault: {}",
        agent.log()
    );
    fs::write(&pages, &whole).unwrap();
    env.thaw_ok(&image, &["--health-url", &health(&sock)]);
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
    env.sim.assert_no_wedge();
}

/// Attack (session 20): the agent's budget of checks stuck in reads. Each thaw whose check of
/// the page contents never returns (failpoint `image-check-read-stalls`: a hung disk) is given
/// up on at its deadline and leaves its check's thread stuck in the agent, counted. Past
/// `MAX_ABANDONED_CHECKS` of them, the next thaw must be refused at once, before CRIU runs,
/// with words that say why and what ends it; nothing restored runs, nothing is left behind,
/// the agent lives. Once the reads return (the disk answers), the same image thaws and serves.
#[test]
fn past_the_agents_budget_of_stuck_checks_a_thaw_is_refused_before_criu_saying_why() {
    let mut env = Env::start("512MiB");
    let (mut agent, resume) = Agent::with_failpoint(&env, cryo_criu::image::CHECK_READ_STALLS);
    let (pid, sock) = env.worker("16MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    // Each thaw ends at its deadline: CRIU's or the check's, whichever says it first; the
    // check's thread is counted once its own wait ends, which may come a moment after the thaw
    // returned: thawed until refused for the budget.
    let max = cryo_criu::image::MAX_ABANDONED_CHECKS;
    // CRIU's directories: a failed restore keeps its own (its log, which the error names), the
    // newest few of them (`scratch::KEEP_FAILED`).
    let criu_dir = env.path().join("state").join("criu");
    let restores = || -> std::collections::BTreeSet<_> {
        fs::read_dir(&criu_dir)
            .into_iter()
            .flatten()
            .map(|d| d.unwrap().file_name())
            .filter(|n| n.to_string_lossy().starts_with("cryo-criu-restore-"))
            .collect()
    };
    let mut stuck = 0;
    let (status, err, kept) = loop {
        let kept = restores();
        let out = env.thaw(&image, &["--criu-timeout", "1"]);
        let err = stderr(&out);
        assert!(!out.status.success(), "stuck check {stuck}: {err}");
        assert!(
            !exists(pid),
            "stuck check {stuck}: a restored process runs: {err}"
        );
        if err.contains("earlier checks of images are still stuck") {
            break (out.status, err, kept);
        }
        stuck += 1;
        assert!(
            stuck <= max + 2,
            "not refused for its budget after {stuck} stuck checks: {err}"
        );
    };
    assert!(stuck >= max, "refused after {stuck} stuck checks: {err}");
    assert_eq!(status.code(), Some(3), "{err}");
    let said: usize = err
        .split(" earlier checks of images are still stuck in a read")
        .next()
        .and_then(|before| before.rsplit(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("does not say how many are stuck: {err}"));
    assert!(
        said >= max && said <= stuck,
        "{said} stuck, {stuck} thaws: {err}"
    );
    assert!(
        err.contains("until one ends, which it does when its file system answers"),
        "does not say what ends it: {err}"
    );
    assert!(!err.contains("criu restore"), "CRIU ran: {err}");
    let new: Vec<_> = restores().difference(&kept).cloned().collect();
    assert!(new.is_empty(), "the refused thaw left {new:?}: {err}");
    assert!(!exists(pid), "a restored process runs: {err}");
    assert!(
        agent.child_alive() && agent.client().status().is_ok(),
        "{}",
        agent.log()
    );
    // The disk answers: the stuck reads return, their threads end, the budget is free again.
    fs::write(&resume, b"").unwrap();
    eventually(PATIENCE, "a thaw once the stuck checks ended", || {
        env.thaw(&image, &["--health-url", &health(&sock)])
            .status
            .success()
    });
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
    env.sim.assert_no_wedge();
}

/// Issue 12: a parked worker (`cryo park`: CHECKPOINTED in place, NVML lists nothing) is frozen as
/// it is and thawed: the thaw brings its GPU context back, the answers are unchanged, no wedge.
#[test]
fn a_parked_worker_is_frozen_and_thawed_with_its_gpu_state() {
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker_on("32MiB", 0, true);
    let before = answers(&sock);
    let out = env.cryo(&["park", &pid.to_string()]);
    assert!(out.status.success(), "park: {}", stderr(&out));
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let out = env.thaw(
        &image,
        &["--health-url", &health(&sock), "--health-timeout", "30"],
    );
    assert!(out.status.success(), "thaw: {}", stderr(&out));
    assert_eq!(answers(&sock), before);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Running
    );
    env.stop(pid);
    assert!(env.ledger().is_empty());
}

impl Agent {
    /// As [`Agent::start`], with `CRYO_FAILPOINT=failpoint` in the agent's environment.
    fn start_at(env: &Env, failpoint: &str) -> Agent {
        Agent::spawn(env, Some(failpoint))
    }

    /// An agent with `CRYO_FAILPOINT=failpoint`, paused there until the file at the path
    /// returned exists (`CRYO_FAILPOINT_RESUME`).
    fn with_failpoint(env: &Env, failpoint: &str) -> (Agent, PathBuf) {
        let resume = env.path().join("resume");
        let agent = Agent::spawn_with(env, |cmd| {
            cmd.env("CRYO_FAILPOINT", failpoint)
                .env("CRYO_FAILPOINT_RESUME", &resume);
        });
        (agent, resume)
    }

    /// Whether the agent's process has not ended.
    fn child_alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The tgid of `pid`'s tracer is this agent.
    fn traces(&self, pid: i32) -> bool {
        let tracer = procs::tracer_pid(pid);
        tracer != 0 && cryo_proc::tgid(tracer).ok().flatten() == Some(self.child.id() as i32)
    }
}

/// A journal rotation (`cryo journal rotate`) killed at each of its steps: an agent that starts
/// next still finds and traces the live restored worker (its records carried, or the old segment
/// whole), and the journal answers recovery's questions as before.
#[test]
fn an_agent_after_a_rotation_killed_at_each_step_traces_every_live_restored_worker() {
    for failpoint in [
        cryo_journal::ROTATE_NEXT_WRITTEN,
        cryo_journal::ROTATE_LINKED,
        cryo_journal::ROTATE_RENAMED,
    ] {
        let mut env = Env::start("1GiB");
        let (pid, _) = env.worker("16MiB", 0);
        make_restored(&env, pid);
        let id = cryo_journal::ProcId::of(pid).unwrap();
        let dir = env.path().join("state").join("journal");
        {
            // History a rotation drops: a restored process long gone, and notes.
            let j = cryo_journal::Journal::open(&dir).unwrap();
            let gone = cryo_journal::ProcId::new(pid, id.start_time.saturating_sub(1));
            for e in [
                cryo_journal::Event::RestoreCompleted {
                    pid: gone,
                    image: "/old".into(),
                    ms: None,
                },
                cryo_journal::Event::FreezeStarted {
                    image: "/old".into(),
                },
            ] {
                j.append(e).unwrap();
            }
        }
        let mut rotate = env
            .cmd()
            .env("CRYO_FAILPOINT", failpoint)
            .args(["journal", "rotate"])
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        wait_failpoint(&mut rotate);
        rotate.kill().unwrap();
        rotate.wait().unwrap();
        let records = cryo_journal::read(&dir).unwrap().records;
        assert_eq!(
            cryo_journal::Origins::from_records(&records).live_restored(),
            vec![id],
            "{failpoint}"
        );
        let agent = Agent::start(&env);
        eventually(PATIENCE, "the agent to trace the restored worker", || {
            agent.traces(pid)
        });
        // The rotation finishes at the next try, the worker still traced.
        let out = env.cryo(&["journal", "rotate"]);
        assert!(out.status.success(), "{failpoint}: {}", stderr(&out));
        let records = cryo_journal::read(&dir).unwrap().records;
        assert_eq!(
            cryo_journal::Origins::from_records(&records).live_restored(),
            vec![id],
            "{failpoint}"
        );
        assert!(agent.traces(pid), "{failpoint}");
        env.stop_clean(pid);
        drop(agent);
    }
}

/// `cryo gpu lock|checkpoint|restore|unlock` of `pid` (through the agent when one runs).
fn make_restored(env: &Env, pid: i32) {
    for action in ["lock", "checkpoint", "restore", "unlock"] {
        let out = env.cryo(&["gpu", action, "--pid", &pid.to_string()]);
        assert!(out.status.success(), "gpu {action}: {}", stderr(&out));
    }
}

/// Where `f` first holds in `env`'s journal.
fn position(env: &Env, f: impl Fn(&cryo_journal::Event) -> bool) -> Option<usize> {
    events(env).iter().position(f)
}

/// Reproduced wedge (a) of issue 10, through the agent: a worker the agent guards (restored
/// through it) is frozen (the agent lets go of it for the dump under a lease), thawed (traced by
/// the agent before its unlock: the journal's order says so) and `kill -9`ed: pinned, no wedge;
/// only the operator's release tears the context down. (Before: the frozen pid stayed on the
/// guard's detached list and the thawed worker with the same pid was never traced: a wedge.)
#[test]
fn a_guarded_worker_frozen_and_thawed_through_the_agent_is_guarded_and_its_kill_pinned() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let agent = Agent::start(&env);
    let (pid, _sock) = env.worker("64MiB", 0);
    make_restored(&env, pid);
    assert!(agent.traces(pid), "a restore through the agent is traced");
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "thaw: {}", stderr(&out));
    let id = assert_traced_before_unlock(&env, &agent, pid);
    kill_thawed(&mut env, pid);
    eventually(
        PATIENCE,
        "the pins handed to the agent's pin holder",
        || {
            position(
                &env,
                |e| matches!(e, Event::PinsHanded { pid: p, .. } if *p == id),
            )
            .is_some()
        },
    );
    assert_pinned_then_release(&env, id);
}

/// An agent started after one that died mid-thaw guards the half-thawed worker `id` again and
/// finishes the dead thaw's unlock, journaled as a recovery (after the journal's first
/// `before_restart` events): the worker runs.
fn an_agent_restarted_finishes_the_unlock(
    env: &Env,
    id: cryo_journal::ProcId,
    before_restart: usize,
) -> Agent {
    use cryo_journal::Event;
    let agent = Agent::start(env);
    assert!(
        agent.traces(id.pid),
        "the restarted agent does not guard the half-thawed worker"
    );
    eventually(PATIENCE, "the unlock journaled after the restart", || {
        events(env)[before_restart..]
            .iter()
            .any(|e| matches!(e, Event::Unlocked { pid: p, recovery: true, .. } if *p == id))
    });
    assert_eq!(
        env.sim.gpu.driver.state(id.pid).unwrap(),
        cryo_gpu::ProcessState::Running
    );
    agent
}

/// The agent is SIGKILLed while a thaw it runs is between the GPU restore and the unlock (the
/// worker LOCKED, traced by the agent's tracer, which dies with it). Nothing is torn down; the
/// restarted agent traces the worker again at start (the journal knows it as restored and
/// guarded) and finishes the thaw's unlock (the journal names the dead thaw as the one to unlock
/// it, the driver says LOCKED, the agent traces it): the worker serves again, and a `kill -9` of
/// it then is pinned, not a wedge.
#[test]
fn an_agent_killed_between_a_thaws_restore_and_unlock_leaves_nothing_unguarded() {
    use cryo_journal::{Event, ProcId};
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let mut agent = Agent::start_at(&env, cryo_lifecycle::thaw::THAW_BEFORE_UNLOCK);
    let thaw = env
        .cmd()
        .args(["thaw", image.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the agent's thaw at its failpoint", || {
        agent.log().contains("failpoint thaw-before-unlock reached")
    });
    env.thawed.push(pid);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Locked
    );
    assert!(agent.traces(pid), "traced before the unlock");
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    let out = thaw.wait_with_output().unwrap();
    assert!(!out.status.success(), "the thaw cannot have succeeded");
    assert!(alive(pid), "the restored worker died with the agent");
    env.sim.assert_no_wedge();

    let id = ProcId::of(pid).unwrap();
    let before_restart = events(&env).len();
    let agent2 = an_agent_restarted_finishes_the_unlock(&env, id, before_restart);
    assert!(
        agent2.log().contains(&format!(
            "pid {pid} was LOCKED by a thaw or wake that died before the unlock"
        )),
        "{}",
        agent2.log()
    );
    answers(&sock);
    // Nothing was torn down: the same process serves, nothing stopped or killed it.
    assert!(alive(pid), "the worker died");
    env.sim.assert_no_wedge();
    assert!(
        !events(&env).iter().any(|e| e.pids().contains(&id)
            && matches!(
                e,
                Event::StopRequested { .. }
                    | Event::SuspendStarted { .. }
                    | Event::KillStarted { .. }
                    | Event::Killed { .. }
            )),
        "{:?}",
        events(&env)
    );
    assert!(agent2.traces(pid));
    sigkill(pid);
    // Its parent died with the first agent: it is ours (a subreaper) to reap.
    eventually(PATIENCE, "the worker to die", || !alive(pid));
    procs::reap(pid);
    env.thawed.retain(|p| *p != pid);
    assert!(
        position(&env, |e| matches!(e, Event::ThawStarted { .. })).is_some(),
        "{:?}",
        events(&env)
    );
    assert_pinned_then_release(&env, id);
    drop(agent2);
}

/// A thaw of `image` (the frozen worker `pid`) through an agent SIGKILLed between the driver's
/// restore and that restore's `RestoreCompleted` (failpoint `restore-before-completed`): the
/// worker is LOCKED, its context restored and live, and the journal holds only the restore's
/// intent, its writer (the agent) gone. With `criu_held`, the agent's CRIU is held in its
/// `post-resume` stage (the tree resumed) until that file exists. Returns the journal's events
/// then.
fn a_thaw_whose_agent_died_before_its_restores_record(
    env: &mut Env,
    image: &Path,
    pid: i32,
    criu_held: Option<&Path>,
) -> Vec<cryo_journal::Event> {
    use cryo_journal::{Event, ProcId};
    let failpoint = cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED;
    let mut agent = Agent::spawn_with(env, |cmd| {
        cmd.env("CRYO_FAILPOINT", failpoint);
        if let Some(held) = criu_held {
            cmd.env(cryo_criu::CRIU_POST_RESUME_HELD, held);
        }
    });
    let thaw = env
        .cmd()
        .args(["thaw", image.to_str().unwrap()])
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the agent's thaw at its failpoint", || {
        agent
            .log()
            .contains(&format!("failpoint {failpoint} reached"))
    });
    env.thawed.push(pid);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Locked
    );
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    let out = thaw.wait_with_output().unwrap();
    assert!(!out.status.success(), "the thaw cannot have succeeded");
    assert!(alive(pid), "the restored worker died with the agent");
    let id = ProcId::of(pid).unwrap();
    let mine = |e: &Event| e.pids().contains(&id);
    let ev = events(env);
    assert!(
        ev.iter()
            .any(|e| mine(e) && matches!(e, Event::RestoreStarted { .. }))
            && !ev
                .iter()
                .any(|e| mine(e) && matches!(e, Event::RestoreCompleted { .. })),
        "not the journal of a thaw killed before its restore's record: {ev:?}"
    );
    env.sim.assert_no_wedge();
    ev
}

/// Attack (session 20): the agent is SIGKILLed while a thaw it runs is between the driver's
/// restore and that restore's `RestoreCompleted` (failpoint `restore-before-completed`): the
/// worker is LOCKED, its context restored and live, and the journal holds only the restore's
/// intent, its writer (the agent) gone. The restarted agent traces it again (the intent makes
/// it restored) and must neither leave it LOCKED for good nor unlock it on the driver's LOCKED
/// alone: it checkpoints it again, restores it itself (intent and completion journaled) and
/// unlocks it as a recovery. It serves as before; nothing is torn down, stopped or killed.
#[test]
fn an_agent_killed_between_a_thaws_restore_and_its_record_is_finished_by_the_next_agent() {
    use cryo_journal::{Event, ProcId};
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let ev = a_thaw_whose_agent_died_before_its_restores_record(&mut env, &image, pid, None);
    let id = ProcId::of(pid).unwrap();
    let before_restart = ev.len();
    let agent2 = an_agent_restarted_finishes_the_unlock(&env, id, before_restart);
    let after = events(&env)[before_restart..].to_vec();
    common::checkpointed_restored_then_unlocked(&after, pid);
    assert_eq!(answers(&sock), before, "it serves as before");
    assert!(alive(pid), "the worker died");
    env.sim.assert_no_wedge();
    assert!(
        !after.iter().any(|e| matches!(
            e,
            Event::StopRequested { .. } | Event::KillStarted { .. } | Event::Killed { .. }
        )),
        "{after:?}"
    );
    env.stop_clean(pid);
    drop(agent2);
}

/// CRIU processes of `env`'s state directory (CRIU and the scripts it runs: their command
/// lines name its run's private directory). A fork of a script not yet exec'd (the `sleep` of
/// the gate script's loop while CRIU is held past `post-resume`) shows the script's command
/// line for a moment: not counted (its parent is a process of the set other than CRIU; it
/// made two snapshots of a held CRIU differ by one pid under load).
fn crius(env: &Env) -> Vec<i32> {
    let all = cryo_proc::naming(&env.path().join("state").join("criu")).unwrap();
    let stat = |p: i32| cryo_proc::stat(p).ok();
    all.iter()
        .copied()
        .filter(|&p| {
            !stat(p).is_some_and(|s| {
                all.contains(&s.ppid) && stat(s.ppid).is_some_and(|parent| parent.comm != "criu")
            })
        })
        .collect()
}

/// Attack (session 21): a thaw whose CRIU has not exited a second after it resumed the tree
/// (its `post-resume` stage: CRIU 4.2 ends nothing of the tree past it) goes on without it
/// (`RESUMED_EXIT_GRACE`), so its GPU restore runs beside a CRIU still alive. The agent's CRIU
/// is held in `post-resume` (test hook `CRYO_FAILPOINT_CRIU_POST_RESUME`) while the agent
/// restores the worker's context and dies before its record (as above). The
/// restarted agent must finish the unlock with that CRIU still there (its sweep must not end a
/// tree past its gate), nothing torn down; CRIU, let go, exits and leaves nothing; the worker
/// serves as before. (Before: the thaw waited for CRIU's exit, so its GPU restore never began
/// while CRIU was held: "the agent's thaw at its failpoint" timed out.)
#[test]
fn an_agent_killed_in_a_gpu_restore_beside_a_criu_past_post_resume_is_finished_by_the_next() {
    use cryo_journal::ProcId;
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let held = env.path().join("criu-may-exit");
    let ev = a_thaw_whose_agent_died_before_its_restores_record(&mut env, &image, pid, Some(&held));
    let criu = crius(&env);
    assert!(!criu.is_empty(), "no CRIU held past post-resume");
    let id = ProcId::of(pid).unwrap();
    let agent2 = an_agent_restarted_finishes_the_unlock(&env, id, ev.len());
    assert_eq!(crius(&env), criu, "the CRIU past post-resume was ended");
    assert_eq!(answers(&sock), before, "it serves as before");
    env.sim.assert_no_wedge();
    fs::write(&held, b"").unwrap();
    eventually(PATIENCE, "CRIU to exit once let go", || {
        crius(&env).is_empty()
    });
    // Reparented to this test (a subreaper) when its agent died.
    for p in criu {
        procs::reap(p);
    }
    assert!(alive(pid), "the worker died with CRIU");
    assert_eq!(answers(&sock), before, "it serves as before");
    env.stop_clean(pid);
    drop(agent2);
}

/// Attack (session 21): a CRIU slow to exit after it resumed the tree (held in its
/// `post-resume` stage: CRIU 4.2 ends nothing of the tree past it). The thaw must restore,
/// unlock and health-check the worker without waiting for CRIU's exit (a second's grace past
/// `post-resume`), and never end the tree at CRIU's deadline; CRIU, let go, exits and leaves nothing. (Before: the thaw waited for its
/// 20 s deadline, killed CRIU and then the tree that had passed the gate and run, and failed.)
#[test]
fn a_thaw_serves_while_its_criu_has_not_exited_after_resuming_the_worker() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("64MiB");
    let held = env.path().join("criu-may-exit");
    let out = env
        .cmd()
        .env(cryo_criu::CRIU_POST_RESUME_HELD, &held)
        .args(["thaw", image.to_str().unwrap(), "--criu-timeout", "20"])
        .args(["--health-url", &health(&sock)])
        .output()
        .unwrap();
    let criu = crius(&env);
    assert!(out.status.success(), "{}", stderr(&out));
    env.thawed.push(pid);
    assert!(
        !criu.is_empty(),
        "no CRIU held past post-resume: {}",
        stderr(&out)
    );
    assert_eq!(answers(&sock), before, "it serves as before");
    fs::write(&held, b"").unwrap();
    eventually(PATIENCE, "CRIU to exit once let go", || {
        crius(&env).is_empty()
    });
    // Reparented to this test (a subreaper) when the thaw exited.
    for p in criu {
        procs::reap(p);
    }
    assert_eq!(answers(&sock), before, "it serves as before");
    env.stop_clean(pid);
}

/// Attack (session 21): a thaw's agent dies before its restore's record (as above), and the
/// agent restarted after it dies too, between its new checkpoint of the worker (the driver's word
/// that the context is whole: LOCKED -> CHECKPOINTED, journaled) and its own restore's intent
/// (failpoint `checkpointed-again`, then SIGKILL; an OOM kill or a node drain ends an agent
/// there the same way). The worker is CHECKPOINTED: safe, serving nothing. The agent started
/// next must not leave it so for good: it resumes it under watch (restored, traced, unlocked),
/// and it serves as before; nothing is stopped or killed, no wedge.
/// (Before: the new checkpoint was journaled as a bare `Checkpointed` step, with no
/// `SuspendStarted` saying what it was for, so the third agent settled it as "left as it is: the
/// journal does not say what it was suspended for", CHECKPOINTED for good; this test failed
/// waiting for the worker to run.)
#[test]
fn an_agent_killed_between_its_new_checkpoint_and_its_restore_leaves_a_worker_the_next_resumes() {
    use cryo_journal::{Event, ProcId};
    let mut env = Env::start("1GiB");
    let (pid, sock) = env.worker("64MiB", 0);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    a_thaw_whose_agent_died_before_its_restores_record(&mut env, &image, pid, None);

    let failpoint = cryo_lifecycle::restore::CHECKPOINTED_AGAIN;
    let mut agent2 = Agent::launch_with(&env, |c| {
        c.env("CRYO_FAILPOINT", failpoint);
    });
    eventually(PATIENCE, "the restarted agent at its failpoint", || {
        agent2
            .log()
            .contains(&format!("failpoint {failpoint} reached"))
    });
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed,
        "{}",
        agent2.log()
    );
    agent2.child.kill().unwrap();
    agent2.child.wait().unwrap();
    assert!(alive(pid), "the worker died with the second agent");
    env.sim.assert_no_wedge();

    let id = ProcId::of(pid).unwrap();
    let from = events(&env).len();
    let agent3 = Agent::start(&env);
    eventually(PATIENCE, "the third agent to resume the worker", || {
        env.sim.gpu.driver.state(pid).unwrap() == cryo_gpu::ProcessState::Running
    });
    assert!(agent3.traces(pid), "resumed unguarded");
    assert_eq!(answers(&sock), before, "it serves as before");
    let after = events(&env)[from..].to_vec();
    assert!(
        after.iter().any(|e| matches!(
            e,
            Event::SuspensionSettled { pid: p, found, action }
                if *p == id && found == "checkpointed" && action == "resumed"
        )),
        "{after:?}"
    );
    assert!(
        !after.iter().any(|e| matches!(
            e,
            Event::StopRequested { .. } | Event::KillStarted { .. } | Event::Killed { .. }
        )),
        "{after:?}"
    );
    assert!(alive(pid), "the worker died");
    env.sim.assert_no_wedge();
    env.stop_clean(pid);
    drop(agent3);
}

/// Fills `disk` (under the state directory `st`) for good: the freeze's lock files of the
/// frozen (ended) worker, which a removal's stop would sweep (freeing their pages: room for the
/// stop's records), removed first; then the disk filled, and the journal's last page. The
/// filler's path (remove it: room again).
fn fill_for_good(disk: &cryo_testkit::disk::SmallDisk, st: &Path) -> PathBuf {
    for f in fs::read_dir(st.join("oplock")).unwrap() {
        fs::remove_file(f.unwrap().path()).unwrap();
    }
    let filler = disk.fill();
    common::fill_journal_page(st);
    filler
}

/// What [`a_thaw_that_fills_its_disk_after_its_gpu_restore`] leaves: the scene, the small disk
/// under its state directory and the filler (remove it: room again), the frozen worker's pid,
/// socket and answers before the freeze, and its image.
struct FullDiskThaw {
    env: Env,
    disk: cryo_testkit::disk::SmallDisk,
    filler: PathBuf,
    pid: i32,
    sock: Ep,
    before: Vec<String>,
    image: PathBuf,
}

/// A worker frozen, then thawed with its state directory on a 16 MiB tmpfs that fills between
/// the GPU restore and its `RestoreCompleted` (paused at `restore-before-completed` with the
/// worker LOCKED, the journal's last page filled too): the thaw fails, the worker checkpointed
/// again (never LOCKED, never torn down), named with how to end it.
fn a_thaw_that_fills_its_disk_after_its_gpu_restore() -> FullDiskThaw {
    let mut env = Env::start("1GiB");
    let st = env.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let (pid, sock, before, image) = env.frozen("16MiB");
    let PausedThaw {
        child: mut thaw,
        resume,
        said,
    } = thaw_paused_at(
        &env,
        &image,
        cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED,
        &[],
    );
    env.thawed.push(pid);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Locked
    );
    let filler = fill_for_good(&disk, &st);
    fs::write(&resume, b"").unwrap();
    let status = thaw.wait().unwrap();
    let said = fs::read_to_string(&said).unwrap();
    assert!(!status.success(), "thawed on a full disk: {said}");
    assert!(alive(pid), "{said}");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed,
        "{said}"
    );
    assert!(
        said.contains("No space left on device")
            && said.contains("checkpointed again")
            && said.contains(&format!("`cryo stop` on pids {pid}")),
        "not named: {said}"
    );
    env.sim.assert_no_wedge();
    FullDiskThaw {
        env,
        disk,
        filler,
        pid,
        sock,
        before,
        image,
    }
}

/// Attack (session 20): a thaw whose disk fills between the GPU restore and its
/// `RestoreCompleted` (a real `ENOSPC`: the state directory on a 16 MiB tmpfs, filled while the
/// thaw is paused at `restore-before-completed` with the worker LOCKED and its context live, the
/// journal's last page too). Nothing can be recorded from then on, the removal's records
/// included: the thaw must fail without leaving a live restored context unrecorded (the worker
/// is checkpointed again, never LOCKED or running on the GPU, never torn down), and name what it
/// left and how to end it. Once there is room, `cryo stop` ends it with no wedge and the image
/// thaws again with the answers it gave before the freeze: nothing lost.
#[test]
fn a_thaw_meeting_a_full_disk_after_its_gpu_restore_leaves_nothing_live() {
    let FullDiskThaw {
        mut env,
        disk,
        filler,
        pid,
        sock,
        before,
        image,
    } = a_thaw_that_fills_its_disk_after_its_gpu_restore();

    std::fs::remove_file(filler).unwrap();
    env.stop_clean(pid);
    env.thaws_as_before(&image, pid, &sock, &before);
    drop(disk);
}

/// Whether `after` (the journal's events since a guard or agent start) ends `id` as a tree a
/// gone thaw left CHECKPOINTED (`lifecycle/src/leftover.rs`): verified before its kill, and its
/// settlement journaled as such.
fn ended_as_a_left_thaw(after: &[cryo_journal::Event], id: &cryo_journal::ProcId) -> bool {
    use cryo_journal::Event;
    let at = |f: &dyn Fn(&Event) -> bool| after.iter().position(f);
    let (verified, killed, settled) = (
        at(&|e| matches!(e, Event::Verified { pid: p, .. } if p == id)),
        at(&|e| matches!(e, Event::Killed { pid: p, .. } if p == id)),
        at(&|e| {
            matches!(
                e,
                Event::SuspensionSettled { pid: p, found, action }
                    if p == id && found == "checkpointed" && action == "its thaw's restored tree ended"
            )
        }),
    );
    matches!((verified, killed, settled), (Some(v), Some(k), Some(_)) if v < k)
}

/// Attack (session 21): the same thaw on a full disk (its tree left alive, its worker
/// CHECKPOINTED, its removal unable to journal a stop), and then nobody runs `cryo stop`: once
/// there is room, the next agent start must find the tree and end it (CHECKPOINTED: its end is
/// safe; ended rather than resumed: the thaw failed and its caller retries the image, which
/// holds all the tree holds, see `lifecycle/src/leftover.rs`), through a stop that suspends and
/// verifies before its kill: no wedge, the settlement journaled and said. Then the image thaws
/// again with the answers it gave before the freeze. (Before: nothing was in flight in the
/// journal and the worker was not LOCKED, so no start looked at it: this test failed waiting
/// for the tree to end, the worker CHECKPOINTED for good.)
#[test]
fn a_thaw_left_checkpointed_on_a_full_disk_is_ended_by_the_next_agent_start() {
    use cryo_journal::ProcId;
    let FullDiskThaw {
        mut env,
        disk,
        filler,
        pid,
        sock,
        before,
        image,
    } = a_thaw_that_fills_its_disk_after_its_gpu_restore();
    let id = ProcId::of(pid).unwrap();

    std::fs::remove_file(filler).unwrap();
    let from = events(&env).len();
    let agent = Agent::start(&env);
    eventually(PATIENCE, "the agent's start to end the thaw's tree", || {
        !alive(pid)
    });
    procs::reap(pid);
    env.thawed.retain(|p| *p != pid);
    env.sim.assert_no_wedge();
    let after = events(&env)[from..].to_vec();
    assert!(
        ended_as_a_left_thaw(&after, &id),
        "not ended through a verified stop, or not journaled: {after:?}"
    );
    assert!(
        agent.log().contains(&format!(
            "pid {pid}: a thaw that failed or died left it checkpointed"
        )),
        "{}",
        agent.log()
    );
    drop(agent);

    env.thaws_as_before(&image, pid, &sock, &before);
    drop(disk);
}

/// Attack (session 21): a thaw whose disk fills before CRIU runs (paused at
/// `thaw-before-restore`, the image checked, `ThawStarted` written) or at CRIU's gate (paused at
/// `thaw-at-criu-gate`: every process restored, none run yet, the gate's verdict still to be
/// written on that disk), a real `ENOSPC` (the state directory's 16 MiB tmpfs filled there, the
/// journal's last page too). Nothing of the image may run unrecorded: the thaw fails naming the
/// disk, no process of the image is left (CRIU ends what it
/// restored when its gate cannot pass), nothing is journaled as restored, no wedge; once there is
/// room the image thaws with the answers it gave before the freeze. (Both held on main: the
/// gate's verdict is written before CRIU lets the tree run, and a verdict that cannot be written
/// refuses it; now pinned.)
#[test]
fn a_thaw_meeting_a_full_disk_before_crius_gate_restores_nothing() {
    for failpoint in [
        cryo_lifecycle::thaw::THAW_BEFORE_RESTORE,
        cryo_lifecycle::thaw::THAW_AT_CRIU_GATE,
    ] {
        let mut env = Env::start("1GiB");
        let st = env.path().join("state");
        let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
        let (pid, sock, before, image) = env.frozen("16MiB");
        let PausedThaw {
            child: mut thaw,
            resume,
            said,
        } = thaw_paused_at(&env, &image, failpoint, &[]);
        let filler = disk.fill();
        common::fill_journal_page(&st);
        fs::write(&resume, b"").unwrap();
        let status = thaw.wait().unwrap();
        let said = fs::read_to_string(&said).unwrap();
        assert!(
            !status.success(),
            "{failpoint}: thawed on a full disk: {said}"
        );
        // Before CRIU: its private directory cannot be made ("restore: directory ...");
        // at the gate: "restore refused at cryo's gate: cannot journal the restored tree
        // before it runs, ..." (the gate's records, written before its verdict). Not the
        // image's fault: never "image refused" (it said "image refused: : image streamer:
        // writing the gate's verdict: No space left on device" until session 22).
        assert!(
            said.contains("No space left on device"),
            "{failpoint}: {said}"
        );
        assert!(!said.contains("image refused"), "{failpoint}: {said}");
        if failpoint == cryo_lifecycle::thaw::THAW_AT_CRIU_GATE {
            assert!(
                said.contains("restore refused at cryo's gate: "),
                "{failpoint}: {said}"
            );
        }
        assert!(!alive(pid), "{failpoint}: the image's process runs: {said}");
        assert!(
            !events(&env).iter().any(|e| matches!(
                e,
                cryo_journal::Event::RestoreStarted { pid: p, .. }
                    | cryo_journal::Event::RestoreCompleted { pid: p, .. } if p.pid == pid
            )),
            "{failpoint}: journaled as restored"
        );
        env.sim.assert_no_wedge();

        std::fs::remove_file(filler).unwrap();
        env.thaws_as_before(&image, pid, &sock, &before);
        drop(disk);
    }
}

/// A tree frozen into `img` in the sim directory after it answered: a plain launcher (no
/// driver fd) serving on a unix socket, and one rank under it with a context of `memory` on
/// GPU 0 (`--gpus 0 --process-per-gpu`): `(launcher, rank, endpoint, answers, image)`.
fn frozen_tree(env: &mut Env, memory: &str) -> (i32, i32, Ep, Vec<String>, PathBuf) {
    let spec = WorkerSpec::new(memory)
        .gpus(&[0])
        .process_per_gpu()
        .setsid()
        .http_unix()
        .program(env.bin.clone());
    let w = env.sim.spawn(spec);
    let (pid, rank, sock) = (w.pid, w.children()[0], w.endpoint.clone());
    env.workers.push(w);
    let before = answers(&sock);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    // Killed by CRIU with its launcher: reparented to this test (a subreaper).
    procs::reap(rank);
    (pid, rank, sock, before, image)
}

/// [`Env::stop_clean`] of a thawed tree's root, then its rank reaped too (a child of this
/// test, a subreaper, once its launcher is gone).
fn stop_tree(env: &mut Env, pid: i32, rank: i32) {
    env.stop_clean(pid);
    procs::reap(rank);
}

/// What [`a_thaw_that_fills_its_disk_before_its_plain_records`] leaves: the scene, the small
/// disk under its state directory and the filler (remove it: room again), the frozen tree's
/// launcher and rank, its endpoint and answers before the freeze, and its image.
struct FullDiskTree {
    env: Env,
    disk: cryo_testkit::disk::SmallDisk,
    filler: PathBuf,
    pid: i32,
    rank: i32,
    sock: Ep,
    before: Vec<String>,
    image: PathBuf,
}

/// A tree (a plain launcher, a CUDA rank) frozen, then thawed with its state directory on a
/// 16 MiB tmpfs that fills between CRIU's exit and the plain processes' `RestoreCompleted`
/// records (paused at `thaw-before-plain-records`: the tree runs, resumed by CRIU, the rank
/// CHECKPOINTED; the journal's last page filled too: a real `ENOSPC`). The thaw fails naming
/// the disk; the tree is removed through a verified stop, or (that stop cannot be journaled
/// either) left with the rank CHECKPOINTED, never restored, and named for `cryo stop`.
fn a_thaw_that_fills_its_disk_before_its_plain_records() -> FullDiskTree {
    let mut env = Env::start("1GiB");
    let st = env.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let (pid, rank, sock, before, image) = frozen_tree(&mut env, "16MiB");
    let PausedThaw {
        child: mut thaw,
        resume,
        said,
    } = thaw_paused_at(
        &env,
        &image,
        cryo_lifecycle::thaw::THAW_BEFORE_PLAIN_RECORDS,
        &[],
    );
    env.thawed.push(pid);
    assert!(alive(pid) && alive(rank), "the tree does not run");
    assert_eq!(
        env.sim.gpu.driver.state(rank).unwrap(),
        cryo_gpu::ProcessState::Checkpointed
    );
    let filler = fill_for_good(&disk, &st);
    fs::write(&resume, b"").unwrap();
    let status = thaw.wait().unwrap();
    let said = fs::read_to_string(&said).unwrap();
    assert!(!status.success(), "thawed on a full disk: {said}");
    assert!(said.contains("No space left on device"), "{said}");
    if alive(rank) {
        assert_eq!(
            env.sim.gpu.driver.state(rank).unwrap(),
            cryo_gpu::ProcessState::Checkpointed,
            "{said}"
        );
        assert!(
            said.contains(&format!("`cryo stop` on pids {pid},{rank}")),
            "the tree is left and not named: {said}"
        );
    } else {
        assert!(!alive(pid), "{said}");
    }
    env.sim.assert_no_wedge();
    FullDiskTree {
        env,
        disk,
        filler,
        pid,
        rank,
        sock,
        before,
        image,
    }
}

/// Attack (session 22): a thaw of a tree whose disk fills before its plain processes' records
/// ([`a_thaw_that_fills_its_disk_before_its_plain_records`]). The thaw must fail without
/// leaving the tree alive and unnamed. Once there is room, `cryo stop` ends it with no wedge and
/// the image thaws with its answers from before the freeze. (Before: the plain records' `?`
/// returned the journal's error as it was, "cannot write the journal", the tree left running
/// and named nowhere.)
#[test]
fn a_thaw_meeting_a_full_disk_before_its_plain_records_leaves_its_tree_named() {
    let FullDiskTree {
        mut env,
        disk,
        filler,
        pid,
        rank,
        sock,
        before,
        image,
    } = a_thaw_that_fills_its_disk_before_its_plain_records();

    std::fs::remove_file(filler).unwrap();
    if alive(pid) {
        stop_tree(&mut env, pid, rank);
    } else {
        procs::reap(pid);
        procs::reap(rank);
        env.thawed.retain(|p| *p != pid);
    }
    env.thaw_ok(&image, &[]);
    assert_eq!(answers(&sock), before);
    stop_tree(&mut env, pid, rank);
    drop(disk);
}

/// Attack (session 23): the same thaw (its tree named at CRIU's gate, left on a full disk with
/// the rank CHECKPOINTED: its removal cannot journal a stop), and then nobody runs `cryo stop`:
/// once there is room, the next agent start must end the tree as it ends a killed thaw's
/// ([`the_next_agent_start_ends_the_thaws_tree`]). Held on main: the rank's last record is
/// the gate's restore intent naming the gone thaw (the failed removal journaled nothing of
/// it), and the driver answers CHECKPOINTED, which is what `leftover.rs` ends; pinned here.
#[test]
fn a_thaw_left_at_its_plain_records_on_a_full_disk_is_ended_by_the_next_agent_start() {
    let FullDiskTree {
        mut env,
        disk,
        filler,
        pid,
        rank,
        sock,
        before,
        image,
    } = a_thaw_that_fills_its_disk_before_its_plain_records();
    assert!(
        alive(pid) && alive(rank),
        "the removal ran on a full disk: nothing was left to end"
    );

    std::fs::remove_file(filler).unwrap();
    the_next_agent_start_ends_the_thaws_tree(&mut env, pid, rank, "a full disk");
    env.thaw_ok(&image, &[]);
    assert_eq!(answers(&sock), before);
    stop_tree(&mut env, pid, rank);
    drop(disk);
}

/// The next agent start ends the tree of launcher `pid` and `rank` (a thaw's, left CHECKPOINTED
/// with its restore intents, its thaw gone) through a verified stop, journaled as a left
/// thaw's ([`ended_as_a_left_thaw`]), with no wedge; `case` names the attack in the messages.
fn the_next_agent_start_ends_the_thaws_tree(env: &mut Env, pid: i32, rank: i32, case: &str) {
    let id = cryo_journal::ProcId::of(rank).unwrap();
    let from = events(env).len();
    let agent = Agent::start(env);
    eventually(PATIENCE, "the agent's start to end the thaw's tree", || {
        !alive(pid) && !alive(rank)
    });
    procs::reap(pid);
    procs::reap(rank);
    env.thawed.retain(|p| *p != pid);
    env.sim.assert_no_wedge();
    let after = events(env)[from..].to_vec();
    assert!(
        ended_as_a_left_thaw(&after, &id),
        "{case}: not ended through a verified stop, or not journaled: {after:?}"
    );
    drop(agent);
}

/// Attack (session 22): a thaw SIGKILLed after CRIU's gate passed and before any CUDA
/// process's restore ([`a_thaw_killed_after_crius_gate`]); once with CRIU gone by then, once
/// with CRIU still in its `post-resume` stage. The next agent start must find the tree and end
/// it through a verified stop (no wedge, the settlement journaled), and the image must thaw
/// again with its answers from before the freeze. (Before: nothing in the journal named the
/// tree, so no start looked at it: the rank stayed CHECKPOINTED for good, its pid taken, and
/// this test failed waiting for the tree to end.)
#[test]
fn a_thaw_killed_between_crius_gate_and_its_gpu_restore_is_ended_by_the_next_agent_start() {
    for criu_held in [false, true] {
        a_thaw_killed_after_crius_gate(criu_held, false);
    }
}

/// Attack (session 23): the same killed thaw, and the journal rotated before the next agent
/// start (`Journal::maintain` with a threshold of one byte: what the agent does past 4 MiB and
/// any command's open past 64 MiB). The rotation carries the live tree's records, its restore
/// intents among them; the thaw's `ThawStarted` names no process, and `leftover.rs` ends only
/// the tree of an intent that a `ThawStarted` of its image comes before. The next agent start
/// must still end the tree. (Before: "the agent's start to end the thaw's tree" timed out: the
/// rotation dropped the `ThawStarted`, the rank stayed CHECKPOINTED for good.)
#[test]
fn a_thaw_killed_after_crius_gate_is_ended_by_the_next_agent_start_after_a_rotation() {
    a_thaw_killed_after_crius_gate(false, true);
}

/// A tree's thaw SIGKILLed after CRIU's gate passed and before any CUDA process's restore
/// (paused at `thaw-after-criu`: CRIU resumed the tree, a plain launcher runs, its CUDA rank
/// waits CHECKPOINTED), as an OOM kill or a node drain would end it there; with `criu_held`,
/// CRIU still in its `post-resume` stage (held there by the test hook
/// `CRYO_FAILPOINT_CRIU_POST_RESUME`). CRIU runs apart from cryo: it is not killed with it, and
/// the tree runs on either way. With `rotated`, the journal is rotated then. The next agent
/// start ends the tree ([`the_next_agent_start_ends_the_thaws_tree`]), and the image thaws
/// again with its answers from before the freeze.
fn a_thaw_killed_after_crius_gate(criu_held: bool, rotated: bool) {
    let mut env = Env::start("1GiB");
    let (pid, rank, sock, before, image) = frozen_tree(&mut env, "16MiB");
    let held = env.path().join("criu-may-exit");
    let vars: Vec<(&str, &Path)> = if criu_held {
        vec![(cryo_criu::CRIU_POST_RESUME_HELD, &held)]
    } else {
        Vec::new()
    };
    let mut paused = thaw_paused_with(
        &env,
        &image,
        cryo_lifecycle::thaw::THAW_AFTER_CRIU,
        &[],
        &vars,
    );
    env.thawed.push(pid);
    let criu = crius(&env);
    assert_eq!(criu.is_empty(), !criu_held, "CRIU held: {criu_held}");
    assert!(alive(pid) && alive(rank), "the tree does not run");
    assert_eq!(
        env.sim.gpu.driver.state(rank).unwrap(),
        cryo_gpu::ProcessState::Checkpointed
    );
    paused.child.kill().unwrap();
    paused.child.wait().unwrap();
    assert!(alive(pid) && alive(rank), "the tree died with its thaw");
    assert_eq!(crius(&env), criu, "CRIU died with its thaw");
    if rotated {
        let journal =
            cryo_journal::Journal::open(env.path().join("state").join("journal")).unwrap();
        let r = journal
            .maintain(1, cryo_journal::Retention::default())
            .unwrap();
        assert!(r.is_some(), "not rotated");
    }

    the_next_agent_start_ends_the_thaws_tree(
        &mut env,
        pid,
        rank,
        &format!("CRIU held: {criu_held}, rotated: {rotated}"),
    );
    fs::write(&held, b"").unwrap();
    eventually(PATIENCE, "CRIU to exit once let go", || {
        crius(&env).is_empty()
    });
    // Reparented to this test (a subreaper) when its thaw died.
    for p in criu {
        procs::reap(p);
    }

    env.thaw_ok(&image, &[]);
    assert_eq!(answers(&sock), before);
    stop_tree(&mut env, pid, rank);
}

/// The events of `after` (the journal since some point) that stop, kill or settle any of
/// `pids`: none may name a worker that serves.
fn stops_of(after: &[cryo_journal::Event], pids: &[i32]) -> Vec<cryo_journal::Event> {
    use cryo_journal::Event;
    after
        .iter()
        .filter(|e| {
            matches!(
                e,
                Event::StopRequested { .. }
                    | Event::SuspendStarted { .. }
                    | Event::KillStarted { .. }
                    | Event::Killed { .. }
                    | Event::SuspensionSettled { .. }
            ) && e.pids().iter().any(|p| pids.contains(&p.pid))
        })
        .cloned()
        .collect()
}

/// Attack (session 23): a thaw whose disk fills once its worker runs (paused at
/// `thaw-after-unlock`: every CUDA process unlocked, its `Unlocked` journaled; the state
/// directory's 16 MiB tmpfs filled there, the journal's last page too: a real `ENOSPC`), of an
/// image frozen after a vLLM sleep (so the thaw grows the engine) and thawed with a health
/// check: its `HealthOk`, `Grown` and `ThawCompleted` cannot be written. The worker serves:
/// the thaw must succeed (its caller, told it failed, would retry an image whose worker runs)
/// and say what it did not record. Once there is room, the next agent start must not take the
/// unrecorded completion for a dead thaw (`leftover.rs` ends only a CHECKPOINTED process whose
/// last record is its thaw's restore intent): it traces the worker, which serves on, nothing
/// stopped, no wedge. (Before: exit 1, "cannot write the journal: ... No space left on
/// device", from the grow's record, the worker serving and named nowhere.)
#[test]
fn a_thaw_meeting_a_full_disk_once_its_worker_runs_succeeds_and_says_what_it_did_not_record() {
    let mut env = Env::start("1GiB");
    let st = env.path().join("state");
    let disk = cryo_testkit::disk::SmallDisk::mount_at(&st, "16M");
    let w = env.sim.spawn(
        WorkerSpec::new("8MiB")
            .kv_cache("8MiB")
            .setsid()
            .http_unix()
            .program(env.bin.clone()),
    );
    let (pid, sock) = (w.pid, w.endpoint.clone());
    env.workers.push(w);
    let before = answers(&sock);
    let image = env.path().join("img");
    let engine = match &sock {
        Ep::Unix(p) => format!("unix:{}:/", p.display()),
        Ep::Tcp(hostport) => format!("http://{hostport}"),
    };
    let out = env.try_freeze(pid, &image, &["--shrink", "vllm", "--engine-url", &engine]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    env.reap_worker(pid);
    let PausedThaw {
        child: mut thaw,
        resume,
        said,
    } = thaw_paused_at(
        &env,
        &image,
        cryo_lifecycle::thaw::THAW_AFTER_UNLOCK,
        &["--health-url", &health(&sock), "--health-timeout", "30"],
    );
    env.thawed.push(pid);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Running
    );
    let filler = disk.fill();
    common::fill_journal_page(&st);
    fs::write(&resume, b"").unwrap();
    let status = thaw.wait().unwrap();
    let said = fs::read_to_string(&said).unwrap();
    assert!(
        status.success(),
        "the thaw of a serving worker failed: {said}"
    );
    assert!(
        said.contains("the worker serves, but the journal could not record")
            && said.contains("the health check's answer")
            && said.contains("the engine's grow")
            && said.contains("the completed thaw")
            && said.contains("No space left on device"),
        "not said: {said}"
    );
    assert_eq!(answers(&sock), before, "{said}");
    env.sim.assert_no_wedge();

    fs::remove_file(filler).unwrap();
    let from = events(&env).len();
    let agent = Agent::start(&env);
    eventually(PATIENCE, "the agent to trace the thawed worker", || {
        agent.traces(pid)
    });
    let after = events(&env)[from..].to_vec();
    let stops = stops_of(&after, &[pid]);
    assert!(stops.is_empty(), "{stops:?} in {after:?}");
    assert!(alive(pid), "the worker died");
    assert_eq!(answers(&sock), before, "it serves as before");
    env.sim.assert_no_wedge();
    env.stop_clean(pid);
    drop(agent);
    drop(disk);
}

/// Attack (session 23): a guard or an agent that starts while a thaw of a tree (a plain
/// launcher, a CUDA rank) is at CRIU's gate, the tree's restore intents journaled and the
/// gate's verdict not written (paused at `thaw-gate-recorded`: CRIU holds every process, none
/// resumed). Its start finds restored processes in the journal that it may not trace yet; then
/// the thaw goes on. The worker must thaw and serve, the rank traced by that guard or agent
/// (the thaw's guard-before-unlock asks it), nothing of the tree stopped, killed or settled,
/// no wedge.
#[test]
fn a_guard_or_agent_starting_at_a_thaws_gate_leaves_the_thaw_to_serve() {
    for agent in [true, false] {
        let mut env = Env::start("1GiB");
        let (pid, rank, sock, before, image) = frozen_tree(&mut env, "16MiB");
        let PausedThaw {
            child: mut thaw,
            resume,
            said,
        } = thaw_paused_at(&env, &image, cryo_lifecycle::thaw::THAW_GATE_RECORDED, &[]);
        env.thawed.push(pid);
        let from = events(&env).len();
        // Started once its socket answers.
        let a = agent.then(|| Agent::start(&env));
        let g = (!agent).then(|| hourly_guard(&env));
        let (log, watcher) = match (&a, &g) {
            (Some(a), _) => (a.log.clone(), a.child.id() as i32),
            (_, Some(g)) => (g.log_path().to_path_buf(), g.pid()),
            _ => unreachable!(),
        };
        let started = events(&env)[from..].to_vec();
        fs::write(&resume, b"").unwrap();
        let status = thaw.wait().unwrap();
        let said = fs::read_to_string(&said).unwrap();
        let log = fs::read_to_string(&log).unwrap_or_default();
        assert!(
            status.success(),
            "agent: {agent}: {said}\nits start journaled {started:?}\nits log: {log}"
        );
        assert_eq!(
            cryo_proc::tgid(procs::tracer_pid(rank)).ok().flatten(),
            Some(watcher),
            "agent: {agent}: the rank is not traced by the start's guard: {said}\nits log: {log}"
        );
        assert_eq!(answers(&sock), before, "agent: {agent}");
        // Said once, with the pids and the thaw's (session 23: `StartReport::pending` was filled
        // and neither printed by `cryo guard` nor logged by the agent).
        let said_left: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("to the restore of"))
            .collect();
        let thaw_pid = format!("by cryo pid {}: a thaw at CRIU's gate", thaw.id());
        assert!(
            matches!(&said_left[..], [l] if (l.contains(&format!("left pid {pid}, {rank}"))
                || l.contains(&format!("left pid {rank}, {pid}"))) && l.contains(&thaw_pid)),
            "agent: {agent}: its start did not say, once, what it left to the thaw: {log}"
        );
        let after = events(&env)[from..].to_vec();
        let stops = stops_of(&after, &[pid, rank]);
        assert!(stops.is_empty(), "agent: {agent}: {stops:?} in {after:?}");
        env.sim.assert_no_wedge();
        stop_tree(&mut env, pid, rank);
        drop((a, g));
    }
}

/// A plain process that holds a `flock` whose lock this test also holds (it inherited the fd),
/// frozen into `img`: CRIU's restore of it waits for the lock as long as the returned guard
/// lives. Returns the guard, the process's pid and the image.
fn frozen_holding_a_lock(env: &Env) -> (nix::fcntl::Flock<fs::File>, i32, PathBuf) {
    let lock = fs::File::create(env.path().join("held.lock")).unwrap();
    let held = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive).unwrap();
    let fd = std::os::fd::AsRawFd::as_raw_fd(&*held);
    // A plain process (sim workers close what they inherit at start), in its own session.
    let mut cmd = Command::new("setsid");
    cmd.args(["sleep", "1000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    cryo_testkit::fds::close_inherited(&mut cmd, Some(fd));
    let mut sleeper = cmd.spawn().unwrap();
    let pid = sleeper.id() as i32;
    eventually(PATIENCE, "the sleeper to exec", || {
        fs::read_to_string(format!("/proc/{pid}/comm"))
            .ok()
            .filter(|c| c.trim() == "sleep")
    });
    let info = fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).unwrap();
    assert!(
        info.contains("lock:"),
        "the sleeper holds no lock on fd {fd}: {info}"
    );
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    sleeper.wait().unwrap();
    (held, pid, image)
}

/// Issue 16 item 2: a worker that holds a `flock` whose lock is also held outside it (it
/// inherited the fd from a test runner's lock) is dumped holding the lock, and CRIU's restore
/// waits for that lock forever. The thaw must end at its CRIU deadline, CRIU and what it
/// restored (which never ran) killed, and the image must thaw once the lock is free. (Before
/// the deadline, this thaw never returned.)
#[test]
fn a_criu_restore_that_blocks_ends_at_its_deadline_with_nothing_left() {
    let mut env = Env::start("1GiB");
    let (held, pid, image) = frozen_holding_a_lock(&env);

    let mut thaw = env.spawn_thaw(&image, &["--criu-timeout", "5"]);
    // Far above the deadline: a thaw still running then hangs.
    eventually(
        Duration::from_secs(120),
        "the thaw to end (it hangs behind CRIU's restore)",
        || thaw.try_wait().unwrap(),
    );
    let out = thaw.wait_with_output().unwrap();
    let err = stderr(&out);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("did not finish within 5 s"), "{err}");
    assert!(!exists(pid), "a restored process is left: {err}");

    drop(held);
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// Issue 10 item 4 with real CRIU: a worker frozen and thawed through the agent (traced before
/// its unlock) replaces its program from a thread other than the leader (`execve` closes its
/// close-on-exec driver fds before any ptrace stop after it): the agent's standing duplicates
/// hold the context, which is pinned in the pin holder (journal: `Pinned`, `PinsHanded`,
/// `Execed`), never torn down; the operator's release is what tears it down.
#[test]
fn a_thawed_worker_that_execs_is_pinned_not_torn_down() {
    use cryo_journal::{Event, ProcId};
    let mut env = Env::start("1GiB");
    let agent = Agent::start(&env);
    let (pid, ep) = env.worker_on("64MiB", 0, true);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let out = env.thaw(&image, &[]);
    assert!(out.status.success(), "thaw: {}", stderr(&out));
    assert!(
        agent.traces(pid),
        "the thawed worker is not traced by the agent"
    );
    let id = ProcId::of(pid).unwrap();
    // A successful exec closes the connection unanswered.
    let r = cryo_http::fetch(
        "POST",
        &ep.url("/exec?path=/bin/sleep&arg=3600&thread=other"),
        None,
        PATIENCE,
    );
    assert!(r.is_err(), "the exec failed: {r:?}");
    eventually(PATIENCE, "Execed in the journal", || {
        position(
            &env,
            |e| matches!(e, Event::Execed { pid: p, .. } if *p == id),
        )
        .is_some()
    });
    let handed = position(
        &env,
        |e| matches!(e, Event::PinsHanded { pid: p, .. } if *p == id),
    );
    let execed = position(
        &env,
        |e| matches!(e, Event::Execed { pid: p, .. } if *p == id),
    );
    assert!(handed.is_some() && handed < execed, "{handed:?} {execed:?}");
    assert_pinned_then_release(&env, id);
}

/// `cryo freeze PID --image IMAGE` through `agent`, once the agent says its freeze reached
/// `failpoint` (the agent runs with it).
fn freeze_paused_in(env: &Env, agent: &Agent, pid: i32, image: &Path, failpoint: &str) -> Child {
    let freeze = env
        .cmd()
        .args(["freeze", &pid.to_string(), "--image"])
        .arg(image)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    eventually(PATIENCE, "the agent's freeze at its failpoint", || {
        agent
            .log()
            .contains(&format!("failpoint {failpoint} reached"))
    });
    freeze
}

/// A worker the agent guards (restored through it) whose freeze through the agent is paused at
/// `failpoint` (the agent said so in its log) until `resume` exists.
struct PausedFreeze {
    agent: Agent,
    pid: i32,
    ep: Ep,
    id: cryo_journal::ProcId,
    freeze: Child,
    resume: PathBuf,
}

impl PausedFreeze {
    /// `criu`: the CRIU the agent runs (`CRYO_CRIU`), the real one when `None`.
    fn start(env: &mut Env, failpoint: &str, criu: Option<&Path>) -> PausedFreeze {
        let resume = env.path().join(format!("resume-{failpoint}"));
        let agent = Agent::spawn_with(env, |c| {
            c.env("CRYO_FAILPOINT", failpoint)
                .env("CRYO_FAILPOINT_RESUME", &resume);
            if let Some(criu) = criu {
                c.env("CRYO_CRIU", criu);
            }
        });
        let (pid, ep) = env.worker("64MiB", 0);
        make_restored(env, pid);
        assert!(agent.traces(pid), "a restore through the agent is traced");
        let id = cryo_journal::ProcId::of(pid).unwrap();
        let image = env.path().join(format!("img-{failpoint}"));
        let freeze = freeze_paused_in(env, &agent, pid, &image, failpoint);
        PausedFreeze {
            agent,
            pid,
            ep,
            id,
            freeze,
            resume,
        }
    }

    /// Paused before the suspension (the guard still traces the worker, as a live one).
    fn before_suspend(env: &mut Env) -> PausedFreeze {
        PausedFreeze::start(env, cryo_lifecycle::freeze::FREEZE_BEFORE_SUSPEND, None)
    }

    /// SIGKILLs the worker here (no wedge at once), lets the freeze go on and checks it failed.
    fn kill_worker_then_resume(self, env: &mut Env) -> Agent {
        sigkill(self.pid);
        env.reap_worker(self.pid);
        assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());
        let (agent, out) = self.resume();
        assert!(
            !out.status.success(),
            "the freeze of a dead worker succeeded"
        );
        agent
    }

    /// Lets the freeze go on; its output.
    fn resume(self) -> (Agent, Output) {
        fs::write(&self.resume, "").unwrap();
        let out = self.freeze.wait_with_output().unwrap();
        (self.agent, out)
    }
}

/// Issue 10, the freeze's let-go (attack, watched failing first: the ledger recorded the
/// teardown): the agent's guard let go of the worker for the dump before the engine's shrink and
/// the suspension, so a SIGKILL there tore a live restored context down. Now the guard keeps it
/// until the journal shows it suspended: the kill is pinned, nothing torn down, the freeze fails.
#[test]
fn a_worker_killed_before_its_freeze_suspended_it_is_pinned() {
    let mut env = Env::start("1GiB");
    let p = PausedFreeze::before_suspend(&mut env);
    let id = p.id;
    let _agent = p.kill_worker_then_resume(&mut env);
    assert_pinned_then_release(&env, id);
}

/// The same window, an `execve` of the worker (its close-on-exec driver fds closed): the guard
/// still traces it and still holds its standing duplicates, so the old context is pinned (before:
/// the lease had dropped them, and the exec tore the context down).
#[test]
fn a_worker_that_execs_before_its_freeze_suspended_it_is_pinned() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let p = PausedFreeze::before_suspend(&mut env);
    let (pid, id) = (p.pid, p.id);
    // A successful exec closes the connection unanswered.
    let r = cryo_http::fetch(
        "POST",
        &p.ep.url("/exec?path=/bin/sleep&arg=3600&thread=leader"),
        None,
        PATIENCE,
    );
    assert!(r.is_err(), "the exec failed: {r:?}");
    eventually(PATIENCE, "the new program", || {
        fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == "sleep")
    });
    assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());
    eventually(PATIENCE, "Execed in the journal", || {
        position(
            &env,
            |e| matches!(e, Event::Execed { pid: p, .. } if *p == id),
        )
        .is_some()
    });
    let (_agent, out) = p.resume();
    assert!(
        !out.status.success(),
        "the freeze of an exec'd worker succeeded"
    );
    if alive(pid) {
        sigkill(pid);
    }
    env.reap_worker(pid);
    assert_pinned_then_release(&env, id);
}

/// A SIGKILL after the suspension and the let-go, before CRIU's dump: the worker's context is
/// checkpointed (the journal shows it), so its teardown is the safe kind: nothing pinned, no
/// wedge, and the journal says it ended while frozen for the dump.
#[test]
fn a_worker_killed_between_the_let_go_and_the_dump_is_torn_down_safely() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let p = PausedFreeze::start(&mut env, cryo_lifecycle::freeze::FREEZE_AFTER_LET_GO, None);
    let (pid, id) = (p.pid, p.id);
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed,
        "let go of before its suspension"
    );
    assert_eq!(tracer(pid), 0, "the guard lets go for the dump");
    let _agent = p.kill_worker_then_resume(&mut env);
    let ev = events(&env);
    assert!(
        ev.iter().any(
            |e| matches!(e, Event::ProcessExited { pid: p, how } if *p == id && how.contains("checkpointed"))
        ),
        "the journal does not say how it ended: {ev:?}"
    );
    assert!(
        !ev.iter()
            .any(|e| matches!(e, Event::Pinned { .. } | Event::GpuQuarantined { .. })),
        "{ev:?}"
    );
    assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());
}

/// The agent SIGKILLed between the freeze's let-go and CRIU's dump (the worker CHECKPOINTED and
/// untraced), then restarted (attack, watched failing first: the restarted agent settled the dead
/// freeze by resuming the worker before its guard traced it, so it ran unguarded until the
/// attach). Now the restarted agent's guard traces it before the unlock, in that journal order,
/// and a `kill -9` of it then is pinned, not torn down.
#[test]
fn an_agent_killed_between_the_let_go_and_the_dump_resumes_the_worker_under_watch() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let p = PausedFreeze::start(&mut env, cryo_lifecycle::freeze::FREEZE_AFTER_LET_GO, None);
    let (pid, id, sock) = (p.pid, p.id, p.ep.clone());
    let PausedFreeze {
        mut agent, freeze, ..
    } = p;
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();
    let out = freeze.wait_with_output().unwrap();
    assert!(!out.status.success(), "the freeze cannot have succeeded");
    assert!(alive(pid), "the worker died with the agent");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed
    );
    assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());
    let mark = events(&env).len();
    let agent2 = Agent::start(&env);
    assert!(agent2.traces(pid), "the restarted agent does not guard it");
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Running,
        "the dead freeze was not settled"
    );
    answers(&sock);
    let ev = &events(&env)[mark..];
    let at = |f: &dyn Fn(&Event) -> bool| ev.iter().position(f);
    let restored = at(&|e| matches!(e, Event::RestoreCompleted { pid: p, .. } if *p == id));
    let attached = at(&|e| matches!(e, Event::GuardAttached { pid: p, .. } if *p == id));
    let unlocked = at(&|e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id));
    assert!(
        restored.is_some() && restored < attached && attached < unlocked,
        "journal order after the restart: restored {restored:?}, attached {attached:?}, unlocked {unlocked:?}: {ev:?}"
    );
    sigkill(pid);
    env.reap_worker(pid);
    assert_pinned_then_release(&env, id);
    drop(agent2);
}

/// A CRIU that refuses every dump, in `dir`: the freeze fails after the suspension and the let-go.
fn criu_refusing_dumps(dir: &Path) -> PathBuf {
    let real = cryo_criu::CriuRpc::locate(None)
        .unwrap()
        .path()
        .to_path_buf();
    let wrapper = dir.join("criu-refusing-dumps");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nfor a in \"$@\"; do\n  if [ \"$a\" = dump ]; then echo 'cryo test: this CRIU refuses to dump' >&2; exit 1; fi\ndone\nexec {} \"$@\"\n",
            real.display()
        ),
    )
    .unwrap();
    fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    wrapper
}

/// A freeze through the agent refused after the suspension and the let-go (CRIU fails): the
/// guard takes the worker back while it is still CHECKPOINTED, and it is resumed in place traced
/// before its unlock (journal order: checkpointed, attached, restored, unlocked; before, the
/// lease ended after the unlock: a live restored context ran untraced in between), with its
/// standing duplicates taken again. It serves the same answers, and a `kill -9` of it is pinned.
#[test]
fn a_freeze_refused_after_the_suspension_gives_the_worker_back_before_its_unlock() {
    use cryo_journal::Event;
    let mut env = Env::start("1GiB");
    let criu = criu_refusing_dumps(env.path());
    let agent = Agent::spawn_with(&env, |c| {
        c.env("CRYO_CRIU", &criu);
    });
    let (pid, sock) = env.worker("64MiB", 0);
    make_restored(&env, pid);
    let before = answers(&sock);
    let id = cryo_journal::ProcId::of(pid).unwrap();
    let mark = events(&env).len();
    let out = env.try_freeze(pid, &env.path().join("img"), &[]);
    assert!(!out.status.success(), "the freeze succeeded");
    assert!(stderr(&out).contains("refuses to dump"), "{}", stderr(&out));
    assert!(agent.traces(pid), "not traced after the refused freeze");
    assert_eq!(answers(&sock), before);
    let ev = &events(&env)[mark..];
    let at = |f: &dyn Fn(&Event) -> bool| ev.iter().position(f);
    let checkpointed = at(&|e| matches!(e, Event::Checkpointed { pid: p, .. } if *p == id));
    let attached = at(&|e| matches!(e, Event::GuardAttached { pid: p, .. } if *p == id));
    let restored = at(&|e| matches!(e, Event::RestoreCompleted { pid: p, .. } if *p == id));
    let unlocked = at(&|e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id));
    assert!(
        checkpointed.is_some()
            && checkpointed < attached
            && attached < restored
            && restored < unlocked,
        "journal order: checkpointed {checkpointed:?}, attached {attached:?}, restored {restored:?}, unlocked {unlocked:?}: {ev:?}"
    );
    let driver = env.sim.gpu.inspect.driver_fds(pid).unwrap().len();
    assert_eq!(
        common::standing_fds(&agent.client(), pid),
        driver,
        "standing duplicates not taken again"
    );
    sigkill(pid);
    env.reap_worker(pid);
    assert_pinned_then_release(&env, id);
}

/// The seam between the lease and a thaw (attack): a worker killed while its freeze held the
/// lease (checkpointed, untraced), the freeze refused, and right after, an older image of the
/// same worker thawed through the agent: the thawed process has the dead one's pid, and the
/// guard's record of the lease (by pid and start time) must neither take it for the leased
/// process nor skip it. It is traced before its unlock (journal order), and its `kill -9` is
/// pinned, not torn down.
#[test]
fn a_thaw_right_after_a_freeze_refused_after_the_suspension_is_guarded() {
    use cryo_journal::ProcId;
    let mut env = Env::start("1GiB");
    let (pid, _sock) = env.worker("64MiB", 0);
    // An older image of the worker, taken while no agent runs (it keeps running, restored).
    let older = env.path().join("older");
    let out = env.try_freeze(pid, &older, &["--leave-running"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let resume = env.path().join("resume");
    let agent = Agent::spawn_with(&env, |c| {
        c.env(
            "CRYO_FAILPOINT",
            cryo_lifecycle::freeze::FREEZE_AFTER_LET_GO,
        )
        .env("CRYO_FAILPOINT_RESUME", &resume);
    });
    assert!(
        agent.traces(pid),
        "the agent does not guard the restored worker"
    );
    let leased = ProcId::of(pid).unwrap();
    let freeze = freeze_paused_in(
        &env,
        &agent,
        pid,
        &env.path().join("newer"),
        cryo_lifecycle::freeze::FREEZE_AFTER_LET_GO,
    );
    sigkill(pid);
    env.reap_worker(pid);
    fs::write(&resume, "").unwrap();
    let out = freeze.wait_with_output().unwrap();
    assert!(
        !out.status.success(),
        "the freeze of a dead worker succeeded"
    );
    assert!(env.ledger().is_empty(), "wedge: {:?}", env.ledger());

    let out = env.thaw(&older, &[]);
    assert!(out.status.success(), "thaw: {}", stderr(&out));
    let id = assert_traced_before_unlock(&env, &agent, pid);
    assert_ne!(id, leased, "the same process thawed?");
    kill_thawed(&mut env, pid);
    assert_pinned_then_release(&env, id);
}

/// The thawed `pid` is traced by `agent`, and the journal shows it attached (source `restore`)
/// before its unlock; its id.
fn assert_traced_before_unlock(env: &Env, agent: &Agent, pid: i32) -> cryo_journal::ProcId {
    use cryo_journal::{AttachSource, Event, ProcId};
    assert!(
        agent.traces(pid),
        "the thawed worker is not traced by the agent"
    );
    let id = ProcId::of(pid).unwrap();
    let attached = position(
        env,
        |e| matches!(e, Event::GuardAttached { pid: p, source: AttachSource::Restore } if *p == id),
    );
    let unlocked = position(
        env,
        |e| matches!(e, Event::Unlocked { pid: p, .. } if *p == id),
    );
    assert!(
        attached.is_some() && attached < unlocked,
        "journal order: attached {attached:?}, unlocked {unlocked:?}"
    );
    id
}

/// SIGKILLs the thawed `pid` and waits until it is gone.
fn kill_thawed(env: &mut Env, pid: i32) {
    sigkill(pid);
    eventually(PATIENCE, "the thawed worker to die", || !exists(pid));
    env.thawed.retain(|p| *p != pid);
}

/// The CRIU processes working for `env` (their command line names its state directory).
fn criu_procs(env: &Env) -> Vec<i32> {
    let dir = env.path().join("state").join("criu");
    let dir = dir.to_str().unwrap();
    fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.split('\0').next().is_some_and(|a| a.ends_with("criu")) && c.contains(dir)
            })
        })
        .collect()
}

/// Issue 16: a thaw killed before CRIU's gate left that CRIU running, and the processes it had
/// restored (which never ran) with it: forever when a restored process waits for a file lock
/// held elsewhere. What must happen: nothing restored ran nor holds a context before the gate,
/// so ending CRIU and them is the safe teardown; the next command that sets CRIU up (here a
/// second thaw) does it, the journal names what was ended, nothing live is torn down, and the
/// image thaws once the lock is free. The thaw is SIGKILLed at two points before the gate: CRIU
/// just started, and CRIU blocked with the image's processes half restored. (Before: CRIU and
/// the half-restored root stayed; the next thaw found the image's pids taken.)
#[test]
fn a_thaw_killed_before_criu_s_gate_leaves_no_criu_and_nothing_it_restored() {
    let mut env = Env::start("1GiB");
    let (held, pid, image) = frozen_holding_a_lock(&env);

    for point in ["CRIU started", "the image's processes half restored"] {
        let mut thaw = env
            .cmd()
            .args(["thaw", image.to_str().unwrap()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        match point {
            "CRIU started" => eventually(PATIENCE, "CRIU to start", || {
                criu_dirs(&env)
                    .iter()
                    .any(|d| d.join("restoring.json").exists())
            }),
            _ => eventually(PATIENCE, "CRIU to restore the root", || exists(pid)),
        }
        thaw.kill().unwrap();
        thaw.wait().unwrap();
        let criu = criu_procs(&env);
        assert!(!criu.is_empty(), "{point}: CRIU went with the thaw");

        // The next thaw sets CRIU up: it ends what the dead one left, then fails at its own
        // deadline (the lock is still held) and removes what it restored itself.
        let second = env.spawn_thaw(&image, &["--criu-timeout", "3"]);
        // The dead thaw's CRIU and restored root are this test's (a subreaper's) to reap once
        // killed, as init reaps them on a host.
        let reap = || reap_exited(criu.iter().chain([&pid]));
        let mut second = second;
        eventually(Duration::from_secs(120), "the second thaw to end", || {
            reap();
            second.try_wait().unwrap()
        });
        reap();
        let out = second.wait_with_output().unwrap();
        let err = stderr(&out);
        assert!(err.contains("did not finish within 3 s"), "{point}: {err}");
        for c in &criu {
            assert!(!exists(*c), "{point}: the dead thaw's CRIU {c} still runs");
        }
        // What the second thaw's own CRIU forked may still be on its way out.
        eventually_said(
            PATIENCE,
            || {
                format!(
                "{point}: no CRIU of this test left; left: {} (the image's pids {:?}, CRIU's directories {:?}, the dead thaw's CRIU {criu:?}; the second thaw said: {err})",
                describe_procs(&criu_procs(&env)),
                manifest(&image)["pids"],
                criu_dirs(&env)
            )
            },
            || criu_procs(&env).is_empty(),
        );
        reap();
        assert!(!exists(pid), "{point}: a half-restored process is left");
        let ended = ended_before_the_gate(&env);
        assert!(
            ended.iter().any(|e| criu
                .iter()
                .any(|c| e.contains(&format!("CRIU (pid {c}) killed")))),
            "{point}: the journal does not say what was ended: {ended:?}"
        );
        env.sim.assert_no_wedge();
    }

    drop(held);
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// Attack (session 8) on the restore log's SIGPIPE seam: CRIU's restorer writes CRIU's log from
/// inside the restored processes, so a log that is a pipe to cryo raises SIGPIPE in them once
/// cryo died after its verdict. The thaw pauses at CRIU's gate (failpoint `thaw-at-criu-gate`),
/// CRIU is stopped (SIGSTOP), the thaw writes its verdict `ok` and is SIGKILLed, and only then
/// does CRIU go on: everything CRIU does after the verdict (resume the tree, log, exit) happens
/// with its cryo dead. What must hold: CRIU ends well and its log is whole in its file; the
/// restored worker runs on (it answers) with no SIGPIPE taken or pending, its context still
/// CHECKPOINTED (the thaw died before its GPU restore: nothing live, the ledger stays empty);
/// restored through `cryo gpu restore`, the guard traces it before its unlock and it serves the
/// answers it gave before it was frozen. Passes on main since 567b1e2 (the log became a capped
/// file, never a pipe): kept as the proof.
#[test]
fn a_thaw_killed_between_its_verdict_and_criu_s_exit_leaves_the_worker_running_without_sigpipe() {
    use nix::sys::signal::Signal;
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let mut env = Env::start("1GiB");
    let _guard = hourly_guard(&env);
    let (pid, sock, before, image) = env.frozen("16MiB");

    // Its stderr into a file that stays open: it writes on after its failpoint.
    let PausedThaw {
        child: mut thaw,
        resume,
        said,
    } = thaw_paused_at(&env, &image, cryo_lifecycle::thaw::THAW_AT_CRIU_GATE, &[]);
    let (criu, dir) = match (&criu_procs(&env)[..], &criu_dirs(&env)[..]) {
        ([criu], [dir]) => (*criu, dir.clone()),
        (c, d) => panic!("one CRIU and one directory expected: {c:?} {d:?}"),
    };
    procs::kill(criu, libc::SIGSTOP);
    eventually(PATIENCE, "CRIU to be stopped", || {
        procs::all_threads_in(criu, &['T'])
    });
    fs::write(&resume, b"").unwrap();
    eventually(PATIENCE, "the thaw's verdict", || {
        fs::read(dir.join("gate")).is_ok_and(|g| g.starts_with(b"ok"))
            || thaw.try_wait().unwrap().is_some()
    });
    assert!(
        thaw.try_wait().unwrap().is_none(),
        "the thaw ended: {}",
        fs::read_to_string(&said).unwrap_or_default()
    );
    // What could raise SIGPIPE once the thaw is gone: a pipe the thaw holds an end of (not one
    // it inherited from this test, such as cargo's jobserver), held by CRIU or by a restored
    // process (CRIU's restorer logs from inside them).
    let thaws: std::collections::BTreeSet<String> = pipes(thaw.id() as i32)
        .difference(&pipes(std::process::id() as i32))
        .cloned()
        .collect();
    for p in [criu, pid] {
        let shared: Vec<_> = pipes(p).intersection(&thaws).cloned().collect();
        assert!(
            shared.is_empty(),
            "pid {p} ({}) shares pipes with the thaw: {shared:?}; its fds: {:?}; the thaw's: {:?}",
            fs::read_to_string(format!("/proc/{p}/comm"))
                .unwrap_or_default()
                .trim(),
            fds(p),
            fds(thaw.id() as i32)
        );
    }
    thaw.kill().unwrap();
    thaw.wait().unwrap();
    env.thawed.push(pid);
    procs::kill(criu, libc::SIGCONT);
    // CRIU's parent died: it is this test's (a subreaper's) child now.
    let ended = eventually(PATIENCE, "CRIU's exit", || {
        match waitpid(nix::unistd::Pid::from_raw(criu), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => None,
            Ok(s) => Some(s),
            Err(e) => panic!("waiting for CRIU {criu}: {e}"),
        }
    });
    assert_eq!(
        ended,
        WaitStatus::Exited(nix::unistd::Pid::from_raw(criu), 0)
    );
    let log = fs::read_to_string(dir.join(cryo_criu::RESTORE_LOG)).unwrap();
    assert!(
        log.contains("Restore finished successfully"),
        "CRIU's log after the verdict: {}",
        log.lines().rev().take(5).collect::<Vec<_>>().join("\n")
    );

    // It runs: it answers (no GPU call), and so has taken every signal pending for it.
    let (code, body) = http(&sock, "GET", "/health", "");
    assert_eq!(code, 200, "{body}");
    assert!(
        procs::survives(pid, Signal::SIGPIPE as i32),
        "the restored worker took a SIGPIPE"
    );
    assert_eq!(
        env.sim.gpu.driver.state(pid).unwrap(),
        cryo_gpu::ProcessState::Checkpointed
    );
    env.sim.assert_no_wedge();

    for action in ["restore", "unlock"] {
        let out = env.cryo(&["gpu", action, "--pid", &pid.to_string()]);
        assert!(out.status.success(), "gpu {action}: {}", stderr(&out));
        if action == "restore" {
            assert_ne!(tracer(pid), 0, "restored and not traced before its unlock");
        }
    }
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
}

/// `pid`'s open files: fd number and what it links to.
fn fds(pid: i32) -> Vec<(String, String)> {
    fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| {
                    let l = fs::read_link(e.path()).ok()?;
                    Some((
                        e.file_name().to_string_lossy().into_owned(),
                        l.display().to_string(),
                    ))
                })
                .collect()
        })
        .unwrap_or_default()
}

/// The pipes (`pipe:[INODE]`) among `pid`'s open files.
fn pipes(pid: i32) -> std::collections::BTreeSet<String> {
    fds(pid)
        .into_iter()
        .map(|(_, l)| l)
        .filter(|l| l.starts_with("pipe:"))
        .collect()
}

/// Attack (session 8): a thaw killed before CRIU's gate while an agent runs. The thaw began
/// standalone (no agent answered yet) on an image whose restore blocks before the gate (a
/// `flock` held outside); an agent starts; the thaw is SIGKILLed. Nothing it restored ran or
/// holds a live context, so ending its CRIU and the half-restored processes is the safe kind,
/// and waiting for the next command costs their host memory and the image's pids for as long
/// as none comes. What must happen, with no other command: the agent learns of the thaw's end
/// (the kernel gives its lock on the run's directory back) and sweeps at once; the journal's
/// `ThawFailed` names the CRIU it killed; CRIU and the half-restored root are gone, the
/// directory too, nothing was torn down live. (Before: nothing happened until the next command
/// or agent start.)
#[test]
fn a_thaw_killed_before_criu_s_gate_while_an_agent_runs_is_swept_by_the_agent_at_once() {
    thaw_killed_before_the_gate_with_an_agent(AgentStarts::WhileCriuRestores);
}

/// Attack (session 9): as above, but the agent starts while the standalone thaw is still
/// checking the image, before its CRIU run's directory exists: the agent's first look at the
/// restores in flight cannot see it. It must still be swept at once when the thaw dies, with
/// no other command. (Before: it waited for the next command.)
#[test]
fn a_thaw_whose_criu_starts_after_the_agent_and_dies_before_the_gate_is_swept_at_once() {
    thaw_killed_before_the_gate_with_an_agent(AgentStarts::BeforeCriu);
}

/// When the agent starts, relative to a standalone thaw.
#[derive(Debug, Clone, Copy)]
enum AgentStarts {
    /// The thaw's CRIU runs (its directory exists).
    WhileCriuRestores,
    /// The thaw checked the image; CRIU has not started (failpoint `thaw-before-restore`).
    BeforeCriu,
}

fn thaw_killed_before_the_gate_with_an_agent(when: AgentStarts) {
    let mut env = Env::start("1GiB");
    let (held, pid, image) = frozen_holding_a_lock(&env);
    let limit = ["--criu-timeout", "600"];
    let (mut thaw, agent) = match when {
        AgentStarts::BeforeCriu => {
            let paused = thaw_paused_at(
                &env,
                &image,
                cryo_lifecycle::thaw::THAW_BEFORE_RESTORE,
                &limit,
            );
            assert_eq!(criu_dirs(&env), Vec::<PathBuf>::new());
            let agent = Agent::start(&env);
            fs::write(&paused.resume, b"").unwrap();
            eventually(PATIENCE, "CRIU to restore the root", || exists(pid));
            (paused.child, agent)
        }
        AgentStarts::WhileCriuRestores => {
            let thaw = env
                .cmd()
                .arg("thaw")
                .arg(&image)
                .args(limit)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            eventually(PATIENCE, "CRIU to restore the root", || exists(pid));
            (thaw, Agent::start(&env))
        }
    };
    let criu = criu_procs(&env);
    assert!(!criu.is_empty(), "no CRIU runs for the thaw");
    thaw.kill().unwrap();
    thaw.wait().unwrap();
    // The dead thaw's CRIU and restored root are this test's (a subreaper's) to reap once
    // killed, as init reaps them on a host.
    let reap = || reap_exited(criu.iter().chain([&pid]));
    let ended = eventually(PATIENCE, "the agent to journal what it ended", || {
        reap();
        Some(ended_before_the_gate(&env)).filter(|e| !e.is_empty())
    });
    assert!(
        ended.iter().any(|e| criu
            .iter()
            .any(|c| e.contains(&format!("CRIU (pid {c}) killed")))),
        "{when:?}: {ended:?}"
    );
    eventually(
        PATIENCE,
        "CRIU and the half-restored root to be gone",
        || {
            reap();
            criu.iter().all(|c| !exists(*c)) && !exists(pid)
        },
    );
    assert_eq!(criu_dirs(&env), Vec::<PathBuf>::new());
    env.sim.assert_no_wedge();
    drop(agent);
    drop(held);
    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// `pid ppid state wchan: cmdline` of each of `pids`, for a failure message.
fn describe_procs(pids: &[i32]) -> String {
    pids.iter()
        .map(|p| {
            let stat = fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
            let after = stat.rsplit_once(") ").map_or("", |(_, a)| a);
            let mut f = after.split(' ');
            let (state, ppid) = (f.next().unwrap_or("?"), f.next().unwrap_or("?"));
            let wchan = fs::read_to_string(format!("/proc/{p}/wchan")).unwrap_or_default();
            let cmd = fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default();
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            format!("{p} ppid {ppid} {state} {wchan}: {cmd}")
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Reaps those of `pids` that exited (children of this test, a subreaper).
fn reap_exited<'a>(pids: impl IntoIterator<Item = &'a i32>) {
    for p in pids {
        let _ = nix::sys::wait::waitpid(
            nix::unistd::Pid::from_raw(*p),
            Some(nix::sys::wait::WaitPidFlag::WNOHANG),
        );
    }
}

/// What the journal says was ended of restores whose cryo died before CRIU's gate.
fn ended_before_the_gate(env: &Env) -> Vec<String> {
    events(env)
        .into_iter()
        .filter_map(|e| match e {
            cryo_journal::Event::ThawFailed { error, .. }
                if error.contains("before CRIU's gate") =>
            {
                Some(error)
            }
            _ => None,
        })
        .collect()
}

/// A program in pid and network namespaces of its own (`cryo run`: pid 1 there, as in a
/// container), frozen into `img`; with `lock`, it holds a `flock` the test holds too (returned),
/// so that CRIU's restore of it waits for the lock before its gate. Its host pids as the image
/// names them (freed by the freeze: reaped here).
fn frozen_namespaced(
    env: &Env,
    lock: bool,
) -> (Option<nix::fcntl::Flock<fs::File>>, PathBuf, Vec<i32>) {
    use std::os::fd::AsRawFd;
    let held = lock.then(|| {
        let f = fs::File::create(env.path().join("held.lock")).unwrap();
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive).unwrap()
    });
    let isolated =
        common::run_isolated_sleep(env.cmd(), env.path(), held.as_ref().map(|h| h.as_raw_fd()));
    let pid = isolated.pid;
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    // `cryo run --detach` left it to this test (a subreaper).
    procs::reap(pid);
    let pids: Vec<i32> = manifest(&image)["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_i64().unwrap() as i32)
        .collect();
    assert_eq!(pids.first(), Some(&pid));
    (held, image, pids)
}

/// The root CRIU restored for `thaw` from an image with a pid namespace of its own: the
/// thaw's child (`--restore-sibling`) that is pid 1 of a namespace below ours, by its host pid.
fn restored_root(thaw: u32) -> Option<i32> {
    let mut kids = Vec::new();
    for t in fs::read_dir(format!("/proc/{thaw}/task"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let k = fs::read_to_string(t.path().join("children")).unwrap_or_default();
        kids.extend(k.split_whitespace().filter_map(|k| k.parse::<i32>().ok()));
    }
    kids.into_iter().find(|k| {
        let ns = nspid(*k);
        ns.len() > 1 && ns.last() == Some(&1)
    })
}
/// The restored root a successful `cryo thaw` printed, kept in `env.thawed` (stopped with it).
fn thawed_root(env: &mut Env, out: &std::process::Output) -> i32 {
    let root: i32 = stdout(out)
        .split_whitespace()
        .find_map(|w| w.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {:?}", stdout(out)));
    env.thawed.push(root);
    root
}

/// The pids each journaled `ThawCompleted` names, in order.
fn thaws_completed(env: &Env) -> Vec<Vec<i32>> {
    events(env)
        .into_iter()
        .filter_map(|e| match e {
            cryo_journal::Event::ThawCompleted { pids, .. } => {
                Some(pids.iter().map(|p| p.pid).collect())
            }
            _ => None,
        })
        .collect()
}

/// Its `NSpid` line: its pid in each pid namespace it is in, the host's first.
fn nspid(pid: i32) -> Vec<i32> {
    cryo_proc::status(pid).map(|s| s.nspid).unwrap_or_default()
}

/// Attack (session 9) on the sweep of a thaw that died before CRIU's gate, with an image of a
/// program in a pid namespace of its own (`cryo run`, a container): CRIU restores it under host
/// pids of its own, not the ones the image names (those were freed by the freeze). The thaw is
/// SIGKILLed at CRIU's gate (every process restored, none run; CRIU's restorer has given them
/// the image's memory and command line) while its CRIU is stopped (as a loaded host may leave
/// it: it has not yet aborted the restore itself), a bystander (a plain `sleep`, no GPU
/// driver fd) started after that CRIU has taken the image's root pid on the host, and an
/// operator's `tail -f` of the run's log names the run's directory as CRIU's forks do. The next
/// agent's sweep must end CRIU and the half-restored tree by their host identities, say so,
/// and leave the bystander and the reader alone. (Before: the sweep went by the image's pids:
/// it SIGKILLed the bystander and left the half-restored root stopped for good; and it killed
/// any process whose command line named the run's directory.)
#[test]
fn a_namespaced_thaw_killed_at_criu_s_gate_is_swept_by_host_identity_not_by_the_image_s_pids() {
    use cryo_testkit::procs::sleep_at_pid;
    let env = Env::start("1GiB");
    let (_, image, pids) = frozen_namespaced(&env, false);
    let mut thaw = thaw_paused_at(&env, &image, cryo_lifecycle::thaw::THAW_AT_CRIU_GATE, &[]).child;
    let criu = match &criu_procs(&env)[..] {
        [c] => *c,
        c => panic!("one CRIU expected: {}", describe_procs(c)),
    };
    let root = restored_root(thaw.id()).expect("a restored root at the gate");
    assert!(!pids.contains(&root), "restored under an image pid {root}");
    let tree = cryo_proc::tree(root).unwrap();
    procs::kill(criu, libc::SIGSTOP);
    eventually(PATIENCE, "CRIU to be stopped", || {
        procs::all_threads_in(criu, &['T', 't'])
    });
    let bystander = sleep_at_pid(pids[0])
        .unwrap_or_else(|e| panic!("a bystander with the image's pid {}: {e}", pids[0]));
    // An operator reads the run's log: a process whose command line names the run's directory
    // too, started after CRIU, but no fork of CRIU's.
    let dir = criu_dirs(&env).pop().expect("the run's directory");
    let mut reader = Command::new("tail")
        .arg("-f")
        .arg(dir.join(cryo_criu::RESTORE_LOG))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    thaw.kill().unwrap();
    thaw.wait().unwrap();

    // An agent sweeps as it starts (before it answers).
    let agent = Agent::start(&env);
    let ended = ended_before_the_gate(&env);
    assert!(
        procs::alive(bystander.pid),
        "the bystander {} with the image's pid was killed; the sweep said {ended:?}",
        bystander.pid
    );
    assert!(
        reader.try_wait().unwrap().is_none(),
        "the operator's reader of the run's log was killed; the sweep said {ended:?}"
    );
    reader.kill().unwrap();
    reader.wait().unwrap();
    eventually_said(
        PATIENCE,
        || {
            format!(
                "CRIU {criu} and the half-restored tree to be gone; left: {}; the sweep said {ended:?}",
                describe_procs(&tree)
            )
        },
        || {
            reap_exited(tree.iter().chain([&criu]));
            !exists(criu) && tree.iter().all(|p| !exists(*p))
        },
    );
    assert!(
        ended
            .iter()
            .any(|e| e.contains(&format!("CRIU (pid {criu}) killed"))
                && e.contains(&root.to_string())),
        "the journal does not say what was ended (CRIU {criu}, root {root}): {ended:?}"
    );
    assert_eq!(criu_procs(&env), Vec::<i32>::new());
    env.sim.assert_no_wedge();
    drop(agent);
}

/// Attack (session 9) on the removal after CRIU's deadline, with an image of a program in a
/// pid namespace of its own (`cryo run`) that holds a `flock` held outside too: CRIU's restore
/// waits for the lock before its gate and is killed at its deadline. What CRIU restored
/// half-way never ran; it lives under host pids the image does not name and must be ended (and
/// named in the error), with nothing of CRIU's left. (Before: the removal went by the image's
/// pids and left the half-restored root, reparented, for good.)
#[test]
fn a_namespaced_thaw_s_criu_killed_at_its_deadline_leaves_nothing_it_forked() {
    let env = Env::start("1GiB");
    let (held, image, _) = frozen_namespaced(&env, true);
    let mut thaw = env.spawn_thaw(&image, &["--criu-timeout", "3"]);
    let root = eventually(PATIENCE, "CRIU to restore the root", || {
        restored_root(thaw.id())
    });
    let out = eventually(Duration::from_secs(120), "the thaw to end", || {
        thaw.try_wait().unwrap()
    });
    let mut err = String::new();
    thaw.stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!out.success(), "{err}");
    assert!(err.contains("did not finish within 3 s"), "{err}");
    // Reparented to this test (a subreaper) when the thaw ended, if it was left.
    reap_exited([&root]);
    assert!(
        !exists(root),
        "the half-restored root {root} is left: {}; the thaw said: {err}",
        describe_procs(&[root])
    );
    assert!(err.contains(&root.to_string()), "{err}");
    assert_eq!(criu_procs(&env), Vec::<i32>::new(), "{err}");
    env.sim.assert_no_wedge();
    drop(held);
}

/// Attack (session 9) on a thaw that succeeds, with an image of a program in a pid namespace of
/// its own (`cryo run`): CRIU brings it back under a host pid the image does not name. The
/// thaw must take the restored tree from CRIU's answer (the root's host pid) and its
/// descendants, never from the image's pids: it succeeds, the journal's `ThawCompleted` names
/// the restored root, and the worker is stopped through its host pid. (Before: the thaw opened
/// the image's pids on the host, found none, and failed with "0 of 1 processes came back; the
/// restored tree was already gone" while the restored tree ran on, unguarded and unnamed; had
/// a host process taken the image's pid after the precheck, it would have been taken for the
/// worker.)
#[test]
fn a_namespaced_thaw_takes_the_restored_tree_by_its_host_pid() {
    let mut env = Env::start("1GiB");
    let (_, image, pids) = frozen_namespaced(&env, false);
    assert_eq!(
        manifest(&image)["processes"][0]["nspid"],
        serde_json::json!([pids[0], 1])
    );
    // As written, then as format 3 wrote it (no namespace pids: paired by order).
    for format in [None, Some(3)] {
        if let Some(f) = format {
            cryo_criu::image::rewrite_as_format(&image, f, None).unwrap();
            assert_eq!(manifest(&image)["format_version"], f);
        }
        let out = env.cryo(&["thaw", image.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(out.status.success(), "format {format:?}: {err}");
        let root = thawed_root(&mut env, &out);
        assert!(!pids.contains(&root), "restored under an image pid {root}");
        assert_eq!(nspid(root).last(), Some(&1), "{err}");
        let done = thaws_completed(&env);
        assert_eq!(done.last(), Some(&vec![root]), "format {format:?}: {err}");
        env.stop(root);
    }
    env.sim.assert_no_wedge();
}

/// Attack (session 10) on the pairing of a tree with a pid namespace of its own (`cryo run`),
/// whose manifest names only host pids: its namespace numbered its children out of the order
/// they were forked in (a process of the namespace set `ns_last_pid`, as CRIU itself and
/// checkpointing runtimes do), so the host pids' order and the namespace's disagree. A `sleep`
/// forked first is the namespace's pid 101, a copy of `sleep` named `nap` forked second its pid
/// 11. The thaw must take each restored process for its own entry of the image and succeed.
/// (Before: the thaw paired by order, `nap` against the image's `sleep`, and refused a sound
/// image with "cannot tell the processes apart"; two children of one command name would have
/// been swapped silently, a CUDA one given the other's GPU plan.)
#[test]
fn a_namespaced_tree_numbered_out_of_fork_order_is_paired_process_by_process() {
    let mut env = Env::start("1GiB");
    let nap = env.path().join("nap");
    fs::copy("/bin/sleep", &nap).unwrap();
    let script = format!(
        "echo 100 > /proc/sys/kernel/ns_last_pid; sleep 1000 & \
         echo 10 > /proc/sys/kernel/ns_last_pid; {} 1000 & wait",
        nap.display()
    );
    let isolated = common::run_isolated(env.cmd(), env.path(), None, &["sh", "-c", &script]);
    let pid = isolated.pid;
    let comms = |root: i32| -> Vec<(i32, String)> {
        let mut v: Vec<(i32, String)> = cryo_proc::tree(root)
            .unwrap_or_default()
            .into_iter()
            .map(|p| {
                let comm = cryo_proc::ProcHandle::open(p)
                    .and_then(|h| h.stat())
                    .map(|s| s.comm)
                    .unwrap_or_default();
                (nspid(p).last().copied().unwrap_or(0), comm)
            })
            .collect();
        v.sort();
        v
    };
    let want = vec![
        (1, "sh".to_string()),
        (11, "nap".to_string()),
        (101, "sleep".to_string()),
    ];
    eventually(PATIENCE, "the namespace's children to run", || {
        comms(pid) == want
    });
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    procs::reap(pid);
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let root = thawed_root(&mut env, &out);
    assert_eq!(comms(root), want, "{err}");
    env.stop(root);
    env.sim.assert_no_wedge();
}

/// The restored root when CRIU writes no pidfile (session 9's fallback had no test: CRIU 4.2
/// always writes it here). A CRIU run without `--pidfile` (a wrapper drops it and says so)
/// restores an image of a program in a pid namespace of its own: the thaw must take the root
/// CRIU named at its gate, the restored pid 1 of the namespace under its new host pid (not the
/// image's), succeed, and journal that root.
#[test]
fn without_criu_s_pidfile_the_thaw_takes_the_root_criu_named_at_its_gate() {
    let mut env = Env::start("1GiB");
    let (_, image, pids) = frozen_namespaced(&env, false);
    let real = cryo_criu::CriuRpc::locate(None)
        .unwrap()
        .path()
        .to_path_buf();
    let said = env.path().join("pidfile-dropped");
    let wrapper = env.path().join("criu-without-pidfile");
    fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nskip=0\nfor a in \"$@\"; do\n  shift\n  if [ $skip = 1 ]; then skip=0; continue; fi\n  \
             if [ \"$a\" = --pidfile ]; then skip=1; echo dropped >> '{}'; continue; fi\n  \
             set -- \"$@\" \"$a\"\ndone\nexec {} \"$@\"\n",
            said.display(),
            real.display()
        ),
    )
    .unwrap();
    fs::set_permissions(
        &wrapper,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let out = env
        .cmd()
        .env("CRYO_CRIU", &wrapper)
        .args(["thaw", image.to_str().unwrap()])
        .output()
        .unwrap();
    let err = stderr(&out);
    assert!(
        fs::read_to_string(&said).is_ok_and(|s| s.contains("dropped")),
        "the wrapper never dropped CRIU's --pidfile: {err}"
    );
    assert!(out.status.success(), "{err}");
    let root = thawed_root(&mut env, &out);
    assert!(!pids.contains(&root), "restored under an image pid {root}");
    assert_eq!(nspid(root).last(), Some(&1), "{err}");
    let done = thaws_completed(&env);
    assert_eq!(done, vec![vec![root]], "{err}");
    env.stop(root);
    env.sim.assert_no_wedge();
}

/// Attack (session 10) on the thaw's pid check, with an image of a program in a pid namespace
/// of its own (`cryo run`): CRIU restores it into a fresh namespace under host pids of its
/// own, so the host pid it had at freeze may be taken by anyone since (here a bystander made at
/// that pid). The thaw must restore it and leave the bystander alone. (Before: refused, "pids
/// of the image are in use on this host", a refusal that could last as long as the bystander.)
/// An image of format 3 says nothing of its namespaces: its pids must still be free.
#[test]
fn a_namespaced_image_thaws_while_a_host_process_holds_its_freeze_time_pid() {
    use cryo_testkit::procs::sleep_at_pid;
    let mut env = Env::start("1GiB");
    let (_, image, pids) = frozen_namespaced(&env, false);
    let bystander = sleep_at_pid(pids[0])
        .unwrap_or_else(|e| panic!("a bystander with the image's pid {}: {e}", pids[0]));
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let root = thawed_root(&mut env, &out);
    assert_ne!(root, pids[0], "{err}");
    assert_eq!(nspid(root).last(), Some(&1), "{err}");
    assert!(
        procs::alive(bystander.pid),
        "the bystander was touched: {err}"
    );
    env.stop(root);
    cryo_criu::image::rewrite_as_format(&image, 3, None).unwrap();
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("in use on this host"), "{err}");
    assert!(
        procs::alive(bystander.pid),
        "the bystander was touched: {err}"
    );
    env.sim.assert_no_wedge();
}

/// Attack (session 11) on e04ea30's pairing of a format-4 image with a process CRIU dumped that
/// the manifest does not name (what a freeze before session 11 made of a child forked between
/// its listing and CRIU's seize; made here by leaving the namespaced root's `sleep` child out
/// of the manifest, its digest recomputed as cryo writes it). The thaw pairs the image's
/// processes by their namespace pids and leaves the other out, as in cryo's own namespace: it
/// is restored by CRIU and runs, under its namespace pid, but is none of the image's processes.
/// It runs as part of the worker's tree, so the thaw names it (session 13: ThawCompleted names
/// the root and it, `cryo thaw` prints it apart as restored beside the image's; before,
/// ThawCompleted named the root alone and the extra ran on unnamed). A format-3 image of it, paired by order, still
/// needs every process and no other: refused at CRIU's gate, where nothing of it has run.
#[test]
fn a_format_4_image_with_a_process_its_manifest_does_not_name_is_paired_without_it() {
    let mut env = Env::start("1GiB");
    let isolated = common::run_isolated(
        env.cmd(),
        env.path(),
        None,
        &["sh", "-c", "sleep 1000 & wait"],
    );
    let pid = isolated.pid;
    eventually(PATIENCE, "the root's sleep child", || {
        cryo_proc::tree(pid)
            .is_ok_and(|t| t.len() == 2 && cryo_proc::stat(t[1]).is_ok_and(|s| s.comm == "sleep"))
    });
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    procs::reap(pid);
    let mpath = image.join("manifest.json");
    let mut m = cryo_criu::image::read_manifest(&mpath).unwrap();
    assert_eq!(m.format_version, 4);
    assert_eq!(m.processes.len(), 2, "{:?}", m.processes);
    let at = m.processes.iter().position(|p| p.comm == "sleep").unwrap();
    let left_out = m.processes.remove(at);
    m.manifest_sha256 = m.self_digest().unwrap();
    fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();

    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    let root = thawed_root(&mut env, &out);
    assert_eq!(nspid(root).last(), Some(&1), "{err}");
    let extra = eventually(PATIENCE, "the restored sleep", || {
        cryo_proc::tree(root).ok().and_then(|t| {
            t.into_iter()
                .find(|p| cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep"))
        })
    });
    assert_eq!(
        nspid(extra).last(),
        left_out.nspid.last(),
        "CRIU restored the left-out process under its namespace pid"
    );
    assert_eq!(thaws_completed(&env), vec![vec![root, extra]], "{err}");
    assert!(
        stdout(&out).contains(&format!(
            "1 of them restored beside the image's processes (its manifest does not name them): pids {extra}"
        )),
        "{}",
        stdout(&out)
    );
    env.stop(root);

    cryo_criu::image::rewrite_as_format(&image, 3, None).unwrap();
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("2 of 1 processes came back"), "{err}");
    assert_eq!(thaws_completed(&env).len(), 1, "{err}");
    env.sim.assert_no_wedge();
}

/// Attack (session 11) on the tests' own hygiene: a test built on `common::run_isolated` that
/// fails before it froze its process (here: panics) leaves nothing running. The guard ends the
/// isolated fork loop and every process of its pid namespace (a `sleep` beside the loop) as the
/// test unwinds. (Before: `run_isolated` gave a bare pid, and such a loop ran on for good.)
#[test]
fn an_isolated_fork_loop_of_a_test_that_fails_before_its_freeze_is_ended() {
    let env = Env::start("1GiB");
    let (tx, rx) = std::sync::mpsc::channel();
    let failed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let isolated = common::run_isolated(
            env.cmd(),
            env.path(),
            None,
            &["sh", "-c", "sleep 1000 & while :; do /bin/true; done"],
        );
        let root = isolated.handle();
        let sleep = eventually(PATIENCE, "the loop's sleep", || {
            root.descendants().into_iter().find(|d| d.comm() == "sleep")
        });
        tx.send((root, sleep)).unwrap();
        panic!("a test that fails before its freeze");
    }));
    assert!(failed.is_err());
    let (root, sleep) = rx.recv().unwrap();
    assert!(
        root.wait_exit(PATIENCE),
        "the isolated fork loop outlived its failed test"
    );
    assert!(
        sleep.wait_exit(PATIENCE),
        "a process of its pid namespace outlived its failed test"
    );
}

/// Attack (session 10) on the thaw's pairing of the restored tree with its image: a worker in a
/// pid namespace of its own (`cryo run`) whose shell forks and reaps a `/bin/true` all the
/// time has, from the moment CRIU resumes it, other processes than its image's (the image's
/// child exits, new ones come). The thaw must pair the image's processes as CRIU restored them
/// (at CRIU's gate, before any of them ran) and complete, every time. (Before: the tree was
/// listed after CRIU's exit, with the loop running: "N of M processes came back" or "not one
/// restored process", and the thaw failed.)
#[test]
fn a_tree_that_forks_as_soon_as_it_resumes_is_paired_by_its_image_s_processes() {
    let mut env = Env::start("1GiB");
    let isolated = common::run_isolated(
        env.cmd(),
        env.path(),
        None,
        &["sh", "-c", "while :; do /bin/true; done"],
    );
    let pid = isolated.pid;
    let image = env.path().join("img");
    // A child of the loop ends between the freeze's listing and its looks, or before CRIU
    // froze the tree, and another is forked: the freeze leaves the first out and lists the
    // other, as CRIU dumped them (session 11; before, "pid N does not exist" refused it).
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    procs::reap(pid);
    let n = manifest(&image)["processes"].as_array().unwrap().len();
    for round in 0..3 {
        let out = env.cryo(&["thaw", image.to_str().unwrap()]);
        let err = stderr(&out);
        assert!(out.status.success(), "round {round}: {err}");
        let root = thawed_root(&mut env, &out);
        assert_eq!(nspid(root).last(), Some(&1), "{err}");
        // The image's processes and no other; a child of the image that ended once resumed
        // (a `/bin/true` CRIU dumped) is no longer there to be named.
        let done = thaws_completed(&env);
        assert_eq!(done.len(), round + 1, "round {round}: {err}");
        let last = &done[round];
        assert!(
            last.contains(&root) && last.len() <= n,
            "round {round}: {last:?} of an image of {n}: {err}"
        );
        env.stop(root);
    }
    env.sim.assert_no_wedge();
}

/// Attack (session 23, criu23b): `cryo` started by a parent that ignores `SIGCHLD` (some init
/// systems, hook runners; `SIG_IGN` survives `execve`) has every child it starts reaped by the
/// kernel, so each of its waits fails with ECHILD: its `criu --version` check, its image
/// checker, its opener, its health command. `cryo`'s `main` sets `SIGCHLD` back to its default
/// first (`cryo_proc::default_sigchld`). A freeze, a thaw with a health check, and a stop of a
/// sim worker, each `cryo` started with `SIGCHLD` ignored: the answers as before, nothing torn
/// down live.
#[test]
fn freeze_thaw_and_stop_started_by_a_parent_that_ignores_sigchld() {
    let mut env = Env::start("1GiB");
    env.sigchld_ignored = true;
    let (pid, sock, before, image) = env.frozen("64MiB");
    env.thaw_ok(
        &image,
        &["--health-url", &health(&sock), "--health-timeout", "30"],
    );
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
    env.sim.assert_no_wedge();
}

/// Attack (the real-CRIU half of thaw::tests::after_restore::a_tree_that_cannot_be_paired_is_
/// refused_at_criu_s_gate): an image whose restored tree cannot be paired with its manifest is
/// refused at CRIU's gate, where every process is restored and none has run: the restored tree
/// is ended by CRIU without ever running, and no GPU restore is asked. The tree is a shell (pid
/// 1 of its namespaces, `cryo run`) with a sim worker child (a CUDA process); the shell spins
/// until a file exists, which is made after the freeze, then writes `ran`: once resumed it
/// would write it at once. The manifest is re-signed with another command name for the shell
/// (as a tree that changed its name between the freeze's listing and CRIU's dump shows it).
/// Then the untampered image thaws, and its shell writes `ran`: the proof the check can fail.
#[test]
fn a_tree_refused_at_criu_s_gate_never_runs_and_no_gpu_restore_is_asked() {
    let mut env = Env::start("1GiB");
    let dir = env.path().to_path_buf();
    let (go, ran, ready) = (dir.join("go"), dir.join("ran"), dir.join("worker.ready"));
    let worker = format!(
        "{} sim worker --dir {} --gpu 0 --memory 32MiB --ready-file {}",
        env.bin.bin().display(),
        dir.display(),
        ready.display()
    );
    let script = format!(
        "{worker} & while [ ! -e {} ]; do :; done; echo ran > {}; wait",
        go.display(),
        ran.display()
    );
    let isolated = common::run_isolated(env.cmd(), &dir, None, &["sh", "-c", &script]);
    let pid = isolated.pid;
    eventually(PATIENCE, "the worker to be ready", || ready.exists());
    let image = dir.join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    procs::reap(pid);
    let m = manifest(&image);
    let processes = m["processes"].as_array().unwrap();
    assert_eq!(processes.len(), 2, "{m}");
    assert!(
        processes[0]["gpu"].is_null() && !processes[1]["gpu"].is_null(),
        "{m}"
    );
    fs::write(&go, "").unwrap();

    let renamed = dir.join("renamed");
    copy_image(&image, &renamed);
    let mpath = renamed.join("manifest.json");
    let mut m: cryo_criu::Manifest = serde_json::from_slice(&fs::read(&mpath).unwrap()).unwrap();
    m.processes[0].comm = "not-sh".into();
    m.manifest_sha256 = m.self_digest().unwrap();
    fs::write(&mpath, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    let before = events(&env).len();
    let out = env.cryo(&["thaw", renamed.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("refused at cryo's gate"), "{err}");
    assert!(err.contains("\"not-sh\""), "{err}");
    // The positive event first: nothing of the restored tree is left (the shell's command line
    // names the ready file, the worker's too).
    let marker = ready.to_str().unwrap().to_string();
    eventually(PATIENCE, "the refused tree to be gone", || {
        !std::fs::read_dir("/proc").unwrap().flatten().any(|e| {
            std::fs::read(e.path().join("cmdline"))
                .is_ok_and(|c| String::from_utf8_lossy(&c).contains(&marker))
        })
    });
    assert!(!ran.exists(), "the refused tree ran");
    let labels: Vec<&str> = events(&env)[before..].iter().map(|e| e.label()).collect();
    assert!(labels.contains(&"thaw failed"), "{labels:?}");
    assert!(
        !labels
            .iter()
            .any(|l| l.contains("restore") || l.contains("unlock")),
        "{labels:?}"
    );
    env.sim.assert_no_wedge();

    // The image as frozen thaws, and its shell runs.
    let out = env.thaw_ok(&image, &[]);
    let root = thawed_root(&mut env, &out);
    eventually(PATIENCE, "the thawed shell to write its file", || {
        ran.exists()
    });
    env.stop_clean(root);
}

/// The children of `pid` (of its main thread) that are zombies now.
fn zombie_children(pid: i32) -> Vec<i32> {
    fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|c| c.parse().ok())
        .filter(|c| procs::state(*c) == Some('Z'))
        .collect()
}

/// Attack (session 12) on the pids a thaw in cryo's own pid namespace needs: a zombie of the
/// frozen tree (a child its parent has not reaped when CRIU seizes it) is dumped by CRIU and
/// restored by it as a zombie, under its pid (CRIU 4.2, checked by hand: "Can't fork for N:
/// File exists" when another process holds it). The image must say so, so that the freeze
/// waits for that pid as for the others and the thaw's pid check refuses, before CRIU runs,
/// while another process holds it; once it is free the thaw restores the zombie. (Before: the
/// manifest left the zombie out, the pid check passed, and the thaw failed inside CRIU.)
#[test]
fn a_zombie_of_the_frozen_tree_is_a_pid_of_its_image_that_the_thaw_checks() {
    use cryo_testkit::procs::sleep_at_pid;
    let mut env = Env::start("1GiB");
    // A root that never reaps (`sleep`): its child exits and stays a zombie.
    let mut cmd = Command::new("setsid");
    cmd.args(["sh", "-c", "sh -c 'exit 0' & exec sleep 1000"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // Nothing of the test's (a file another process holds a lock on) for CRIU to restore.
    cryo_testkit::fds::close_inherited(&mut cmd, None);
    let mut root = cmd.spawn().unwrap();
    let pid = root.id() as i32;
    let zombie = eventually(PATIENCE, "the root's child to be a zombie", || {
        let ready = cryo_proc::stat(pid).is_ok_and(|s| s.comm == "sleep" && s.session == pid);
        zombie_children(pid).first().copied().filter(|_| ready)
    });
    let image = env.path().join("img");
    let out = env.try_freeze(pid, &image, &[]);
    assert!(out.status.success(), "freeze failed: {}", stderr(&out));
    root.wait().unwrap();
    // CRIU killed the root: its zombie child is ours now (the test is a subreaper).
    procs::reap(zombie);
    let m = manifest(&image);
    assert_eq!(m["zombies"], serde_json::json!([zombie]), "{m}");

    let holder = sleep_at_pid(zombie)
        .unwrap_or_else(|e| panic!("a process with the zombie's pid {zombie}: {e}"));
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains(&format!("pids {zombie} of the image are in use")),
        "{err}"
    );
    assert!(!err.contains("File exists"), "CRIU ran: {err}");
    assert!(procs::alive(holder.pid), "the holder was touched: {err}");
    drop(holder);

    let out = env.thaw_ok(&image, &[]);
    let root = thawed_root(&mut env, &out);
    assert_eq!(root, pid);
    assert_eq!(zombie_children(root), vec![zombie]);
    env.stop(root);
    procs::reap(zombie);
    env.sim.assert_no_wedge();
}

/// Attack (session 12) on the ids a thaw in cryo's own pid namespace needs: CRIU restores every
/// thread of the tree under its thread id, not only every process under its pid (CRIU 4.2,
/// checked by hand: "Unable to create a thread: -17" when another process holds one). A sim
/// worker (threads beside its main one) is frozen, and one of its thread ids is then held by
/// another process: the thaw's pid check must refuse before CRIU runs, naming it; once it is
/// free the thaw restores the worker. (Before: the manifest named no thread, the check passed,
/// and the thaw failed inside CRIU.)
#[test]
fn a_thread_id_of_the_image_held_by_another_process_refuses_the_thaw_before_criu() {
    use cryo_testkit::procs::sleep_at_pid;
    let mut env = Env::start("1GiB");
    let (pid, _ep) = env.worker("64MiB", 0);
    // A thread of the idle worker (its threads are made at its start).
    let tid = fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .find(|t| *t != pid)
        .expect("the sim worker has threads beside its main one");
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let m = manifest(&image);
    let threads: Vec<i32> = m["threads"]
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|t| t.as_i64())
                .map(|t| t as i32)
                .collect()
        })
        .unwrap_or_default();
    assert!(threads.contains(&tid) && !threads.contains(&pid), "{m}");
    let holder = sleep_at_pid(tid)
        .unwrap_or_else(|e| panic!("a process with the worker's thread id {tid}: {e}"));
    let out = env.cryo(&["thaw", image.to_str().unwrap()]);
    let err = stderr(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("of the image are in use") && err.contains(&tid.to_string()),
        "{err}"
    );
    assert!(
        !err.contains("Unable to create a thread"),
        "CRIU ran: {err}"
    );
    assert!(procs::alive(holder.pid), "the holder was touched: {err}");
    drop(holder);
    let out = env.thaw_ok(&image, &[]);
    let root = thawed_root(&mut env, &out);
    assert_eq!(root, pid);
    env.stop_clean(root);
}

/// A `cryo thaw` whose image checker (a process of its own, forced with `CRYO_THAW_CHECKER`
/// whatever the host's load) paused before its verdict.
struct CheckerPaused {
    thaw: Child,
    /// The checker's pid (our grandchild).
    checker: i32,
    resume: PathBuf,
    said: PathBuf,
}

fn thaw_with_checker_paused(env: &Env, image: &Path, extra: &[&str]) -> CheckerPaused {
    let resume = env.path().join("resume-checker");
    let said = env.path().join("thaw-checker.err");
    let _ = fs::remove_file(&resume);
    let mut thaw = env
        .cmd()
        .env(cryo_criu::image::CHECKER_ENV, "child")
        .env("CRYO_FAILPOINT", cryo_criu::image::CHECKER_BEFORE_VERDICT)
        .env("CRYO_FAILPOINT_RESUME", &resume)
        // Says when the checker is raised because it starves (as a paused one does).
        .env("RUST_LOG", "warn,cryo_criu::image::checker=debug")
        .arg("thaw")
        .arg(image)
        .args(extra)
        .stdout(Stdio::null())
        .stderr(fs::File::create(&said).unwrap())
        .spawn()
        .unwrap();
    let mut checker = None;
    eventually(PATIENCE, "the image checker at its failpoint", || {
        let text = fs::read_to_string(&said).unwrap_or_default();
        assert!(
            thaw.try_wait().unwrap().is_none(),
            "the thaw ended first: {text}"
        );
        checker = text
            .split("reached in the image checker (pid ")
            .nth(1)
            .and_then(|r| r.split(')').next())
            .and_then(|p| p.parse::<i32>().ok());
        checker.is_some()
    });
    CheckerPaused {
        thaw,
        checker: checker.unwrap(),
        resume,
        said,
    }
}

impl CheckerPaused {
    fn wait(mut self) -> (std::process::ExitStatus, String) {
        let status = self.thaw.wait().unwrap();
        (status, fs::read_to_string(&self.said).unwrap())
    }
}

/// Issue 16 (the thaw's checker in a process of its own): a checker that dies before its
/// verdict, killed or with a passing line forged into its verdict pipe by another process (root
/// can open `/proc/PID/fd/1`) for an image with a flipped byte, never passes the image: the
/// thaw is refused and no restored process runs. The intact image then thaws and serves as
/// before.
#[test]
fn a_thaw_whose_image_checker_dies_or_is_forged_is_refused_before_anything_runs() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("48MiB");

    // Killed before its verdict.
    let paused = thaw_with_checker_paused(&env, &image, &[]);
    sigkill(paused.checker);
    let (status, err) = paused.wait();
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(err.contains("image checker ended without passing"), "{err}");
    assert!(!exists(pid), "a restored process runs: {err}");

    // A flipped byte, and the passing line forged into the verdict pipe, the checker killed
    // before it could say anything else.
    let pages = pages_file(&image);
    let original = fs::read(&pages).unwrap();
    flip_byte(&pages, original.len() / 2);
    let paused = thaw_with_checker_paused(&env, &image, &[]);
    let digest = manifest(&image)["manifest_sha256"]
        .as_str()
        .unwrap()
        .to_string();
    let mut pipe = fs::OpenOptions::new()
        .write(true)
        .open(format!("/proc/{}/fd/1", paused.checker))
        .unwrap();
    std::io::Write::write_all(&mut pipe, format!("ok {digest}\n").as_bytes()).unwrap();
    drop(pipe);
    sigkill(paused.checker);
    let (status, err) = paused.wait();
    assert_eq!(status.code(), Some(3), "a forged verdict passed: {err}");
    assert!(!exists(pid), "a restored process runs: {err}");

    // Left to say its own verdict, the checker names the damage.
    let paused = thaw_with_checker_paused(&env, &image, &[]);
    fs::write(&paused.resume, b"").unwrap();
    let (status, err) = paused.wait();
    assert_eq!(status.code(), Some(3), "{err}");
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(!exists(pid), "a restored process runs: {err}");

    fs::write(&pages, &original).unwrap();
    env.thaws_as_before(&image, pid, &sock, &before);
}

/// Issue 16: a checker that never gives its verdict (hung) is given up at the restore's
/// deadline: the thaw fails, nothing restored runs, and the checker is ended.
#[test]
fn a_hung_image_checker_is_ended_at_the_restore_s_deadline_and_nothing_runs() {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("16MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);

    // No resume file is ever made: the checker stays at its failpoint.
    let paused = thaw_with_checker_paused(&env, &image, &["--criu-timeout", "5"]);
    let checker = paused.checker;
    let (status, err) = paused.wait();
    assert!(!status.success(), "{err}");
    // The check's refusal at the restore's deadline, never CRIU's own: both count from the
    // restore's start, and CRIU's kill at that instant leaves the check to give up by itself
    // (session 23: CRIU's deadline, counted from its spawn a few ms later, let a loaded host's
    // judge pass it first: "criu restore did not finish within 5 s"). Two waits of the check
    // may be the one to give the checker up, each in its own words ("the check did not end
    // before the restore's deadline", "the image checker gave no verdict before the restore's
    // deadline"): either, never a verdict.
    assert!(err.contains("before the restore's deadline"), "{err}");
    assert!(!err.contains("did not finish within"), "{err}");
    assert!(!exists(pid), "a restored process runs: {err}");
    eventually(PATIENCE, "the hung checker to be ended", || {
        !exists(checker)
    });

    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// A child process killed (and reaped) when dropped: a test that fails while waiting for it
/// leaves nothing running.
struct Killed(Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// With the check's threads (the default route), a read of the page contents that never returns
/// (a hung disk, a FUSE server that stopped answering: the failpoint stalls the check's read for
/// good) is refused at the restore's deadline and the thaw returns: the stuck thread is
/// abandoned, not waited for, and nothing restored runs. The image then thaws as before.
#[test]
fn a_thaw_whose_check_read_never_returns_is_refused_at_the_deadline_and_nothing_runs() {
    thaw_with_a_check_read_stuck(cryo_criu::image::CHECK_READ_STALLS);
}

/// The same for the check of the files CRIU reads as instructions, before CRIU starts.
#[test]
fn a_thaw_whose_check_of_criu_s_files_never_returns_is_refused_at_the_deadline() {
    thaw_with_a_check_read_stuck(cryo_criu::image::CHECK_STEERING_READ_STALLS);
}

fn thaw_with_a_check_read_stuck(failpoint: &str) {
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("16MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);

    let said = env.path().join("thaw-stuck.err");
    let mut thaw = Killed(
        env.cmd()
            .env("CRYO_FAILPOINT", failpoint)
            .arg("thaw")
            .arg(&image)
            .args(["--criu-timeout", "5"])
            .stdout(Stdio::null())
            .stderr(fs::File::create(&said).unwrap())
            .spawn()
            .unwrap(),
    );
    // The deadline is 5 s; PATIENCE (60 s) leaves CRIU's teardown all the time it needs.
    let mut status = None;
    eventually(PATIENCE, "the thaw to return after its deadline", || {
        status = thaw.0.try_wait().unwrap();
        status.is_some()
    });
    let status = status.unwrap();
    let err = fs::read_to_string(&said).unwrap();
    assert!(
        err.contains(&format!("failpoint {failpoint} reached")),
        "the check's read never stalled: {err}"
    );
    assert!(!status.success(), "{err}");
    assert!(
        err.contains("did not end before the restore's deadline"),
        "{err}"
    );
    assert!(!exists(pid), "a restored process runs: {err}");
    drop(thaw);

    env.thaw_ok(&image, &[]);
    env.stop_clean(pid);
}

/// Issue 16: the checker leads a session of its own (its own scheduling group), is never at
/// full priority before CRIU's gate, is raised at the gate; its group niced again by someone
/// else only slows it: the image it checked still thaws and serves.
#[test]
fn the_image_checker_runs_in_its_own_session_raised_at_criu_s_gate_and_tampering_only_slows_it() {
    let mut env = Env::start("1GiB");
    let (pid, sock, before, image) = env.frozen("48MiB");

    let paused = thaw_with_checker_paused(&env, &image, &[]);
    let c = paused.checker;
    let stat = fs::read_to_string(format!("/proc/{c}/stat")).unwrap();
    let sid: i32 = stat
        .rsplit(')')
        .next()
        .unwrap()
        .split_whitespace()
        .nth(3)
        .unwrap()
        .parse()
        .unwrap();
    assert_eq!(sid, c, "the checker does not lead a session of its own");
    let nice = || fs::read_to_string(format!("/proc/{c}/autogroup")).unwrap();
    let autogroups = fs::read_to_string("/proc/sys/kernel/sched_autogroup_enabled")
        .is_ok_and(|s| s.trim() == "1");
    if autogroups {
        // Before the gate niced; at the gate (the restored tree exists then) raised. Or raised
        // before because it starved: a checker paused at its failpoint gets no CPU, and a
        // loaded host can keep the test from looking within the starvation window (read
        // after the nice value: the thaw says so before it raises it).
        let starved = || {
            fs::read_to_string(&paused.said)
                .unwrap_or_default()
                .contains("the image checker starves: raised")
        };
        let n = nice();
        assert!(
            n.ends_with("nice 19\n") || (n.ends_with("nice 0\n") && (exists(pid) || starved())),
            "{n}"
        );
        eventually(PATIENCE, "the checker raised at CRIU's gate", || {
            nice().ends_with("nice 0\n")
        });
        assert!(exists(pid) || starved(), "raised before CRIU's gate");
        fs::write(format!("/proc/{c}/autogroup"), "19\n").unwrap();
    }
    fs::write(&paused.resume, b"").unwrap();
    let (status, err) = paused.wait();
    assert!(status.success(), "{err}");
    env.thawed.push(pid);
    assert_eq!(answers(&sock), before);
    env.stop_clean(pid);
}

/// Set in the child test process of
/// [`a_test_that_dies_in_the_middle_of_a_thaw_leaves_nothing_running`]: how it dies (`panic` or
/// `sigkill`), and the directory where it says it is ready and is told to go on.
const DIES_MID_THAW: &str = "CRYO_TEST_DIES_MID_THAW";

/// The test kit owns every process a test starts: a test that dies in the middle of a thaw
/// (its image checker paused before its verdict, the restored worker held at CRIU's gate) by a
/// panic or by a SIGKILL of the test process (what a runner's timeout or an operator's ^C does)
/// leaves nothing running: not the sim driver, the `cryo thaw`, CRIU, the checker (a session
/// of its own) or the restored worker. Session 15: a test killed so left a sim worker running
/// for two hours. Nor its simulated driver's directory (a worker binary's copy and an image,
/// ~150 MB: session 16's killed tests left ten). The test runs itself again as the dying test, takes every process of that
/// test's tree (by pidfd) while it is paused, then makes it die.
#[test]
fn a_test_that_dies_in_the_middle_of_a_thaw_leaves_nothing_running() {
    const NAME: &str = "a_test_that_dies_in_the_middle_of_a_thaw_leaves_nothing_running";
    if let Ok(how) = std::env::var(DIES_MID_THAW) {
        return dies_mid_thaw(&how);
    }
    criu_present();
    for how in ["panic", "sigkill"] {
        let dir = tempfile::Builder::new()
            .prefix("cryo-dies-mid-thaw-")
            .tempdir()
            .unwrap();
        let mut test = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", NAME, "--nocapture", "--test-threads", "1"])
            .env(DIES_MID_THAW, format!("{how}:{}", dir.path().display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(fs::File::create(dir.path().join("test.err")).unwrap())
            .spawn()
            .unwrap();
        let tpid = test.id() as i32;
        eventually_said(
            PATIENCE,
            || fs::read_to_string(dir.path().join("test.err")).unwrap_or_default(),
            || {
                assert!(test.try_wait().unwrap().is_none(), "the test ended first");
                dir.path().join("ready").exists()
            },
        );
        // Everything the test started, held by pidfd from now on.
        let held: Vec<(i32, String, cryo_proc::ProcHandle)> = cryo_proc::tree(tpid)
            .unwrap()
            .into_iter()
            .filter(|p| *p != tpid)
            .filter_map(|p| {
                let cmd = fs::read(format!("/proc/{p}/cmdline"))
                    .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                    .unwrap_or_default();
                Some((p, cmd, cryo_proc::ProcHandle::open(p).ok()?))
            })
            .collect();
        // The restored worker (the frozen one's pid, said in `ready`) may not have its command
        // line back yet at CRIU's gate.
        let worker: i32 = fs::read_to_string(dir.path().join("ready"))
            .unwrap()
            .parse()
            .unwrap();
        assert!(
            held.iter().any(|(p, _, _)| *p == worker),
            "{how}: the restored worker {worker} is not among {held:#?}"
        );
        for part in [" sim driver ", " thaw ", "criu"] {
            assert!(
                held.iter().any(|(_, c, _)| c.contains(part)),
                "{how}: no {part:?} among {held:#?}"
            );
        }
        if how == "sigkill" {
            test.kill().unwrap();
        } else {
            fs::write(dir.path().join("go"), b"").unwrap();
        }
        let status = test.wait().unwrap();
        assert!(!status.success(), "{how}: the dying test passed");
        // Every one gone, waited for together (each pidfd turns readable at its exit).
        let deadline = std::time::Instant::now() + PATIENCE;
        let left: Vec<&(i32, String, cryo_proc::ProcHandle)> = held
            .iter()
            .filter(|(_, _, h)| {
                !h.wait_exit(deadline.saturating_duration_since(std::time::Instant::now()))
            })
            .collect();
        let listed = format!("{left:#?}");
        for (_, _, h) in &left {
            let _ = h.signal(cryo_proc::Signal::SIGKILL);
        }
        assert!(
            left.is_empty(),
            "{how}: left running by the test that died: {listed}"
        );
        let sim_dir = PathBuf::from(fs::read_to_string(dir.path().join("sim")).unwrap());
        eventually(PATIENCE, "the dead test's sim directory removed", || {
            !sim_dir.exists()
        });
    }
}

/// The dying test: a worker frozen, its thaw paused with the restored worker at CRIU's gate,
/// then `ready` made in `DIR` (holding the worker's pid), and a panic once `go` is made there
/// (`panic:DIR`), or a wait for the SIGKILL (`sigkill:DIR`).
fn dies_mid_thaw(how: &str) {
    let (how, dir) = how.split_once(':').unwrap();
    let dir = Path::new(dir);
    let mut env = Env::start("1GiB");
    let (pid, _) = env.worker("16MiB", 0);
    let image = env.path().join("img");
    env.freeze(pid, &image);
    let _paused = thaw_with_checker_paused(&env, &image, &[]);
    eventually(PATIENCE, "the restored worker at CRIU's gate", || {
        exists(pid)
    });
    fs::write(dir.join("sim"), env.path().as_os_str().as_encoded_bytes()).unwrap();
    fs::write(dir.join("ready.tmp"), pid.to_string()).unwrap();
    fs::rename(dir.join("ready.tmp"), dir.join("ready")).unwrap();
    let go = dir.join("go");
    if how == "sigkill" {
        // Until the SIGKILL: the wait is the hang guard.
        eventually(PATIENCE, "the SIGKILL", || false);
    }
    eventually(PATIENCE, "the go", || go.exists());
    panic!("dying in the middle of a thaw, as asked");
}

/// `cryo ARGS` paused at pausing failpoint `failpoint` until `resume` exists: the child and its
/// stderr (kept open: a command writing to a closed stderr would panic).
fn paused_at(
    env: &Env,
    args: &[&str],
    failpoint: &str,
    resume: &Path,
) -> (Child, std::process::ChildStderr) {
    let mut child = env
        .cmd()
        .env("CRYO_FAILPOINT", failpoint)
        .env("CRYO_FAILPOINT_RESUME", resume)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    common::said_until(&mut err, "paused until");
    (child, err)
}

/// `cryo freeze PID --image IMAGE` paused at `failpoint` until `resume` exists ([`paused_at`]).
fn freeze_paused_at(
    env: &Env,
    pid: i32,
    image: &Path,
    failpoint: &str,
    resume: &Path,
) -> (Child, std::process::ChildStderr) {
    let pid = pid.to_string();
    paused_at(
        env,
        &["freeze", &pid, "--image", image.to_str().unwrap()],
        failpoint,
        resume,
    )
}

/// `cryo OP PID` of a parked worker whose freeze is paused after its suspension's verification
/// (`freeze-after-gpu-free`: CHECKPOINTED, nothing let go or dumped) or at CRIU's gate
/// (`freeze-at-dump-gate`: the tree dumped and seized, not yet ended): OP is refused at once
/// (exit 3) naming the freeze, touching nothing; the freeze, let go, publishes the image and
/// ends the worker (CHECKPOINTED: safe); no wedge.
fn meets_a_freeze_at_work(op: &str) {
    for failpoint in [
        cryo_lifecycle::freeze::FREEZE_AFTER_GPU_FREE,
        cryo_lifecycle::freeze::FREEZE_AT_DUMP_GATE,
    ] {
        let mut env = Env::start("1GiB");
        let (pid, _sock) = env.worker("64MiB", 0);
        let out = env.cryo(&["park", &pid.to_string()]);
        assert!(out.status.success(), "park: {}", stderr(&out));
        let image = env.path().join("img");
        let resume = env.path().join("go");
        let (freeze, mut err) = freeze_paused_at(&env, pid, &image, failpoint, &resume);
        let by = freeze.id();
        let second = env.cryo(&[op, &pid.to_string()]);
        assert_eq!(
            second.status.code(),
            Some(3),
            "{failpoint}: {}",
            stderr(&second)
        );
        assert!(
            stderr(&second).contains(&format!("pid {pid} is being frozen by cryo pid {by}")),
            "{failpoint}: {}",
            stderr(&second)
        );
        assert!(alive(pid), "{failpoint}: the {op} ended it");
        fs::write(&resume, b"").unwrap();
        let mut said = String::new();
        err.read_to_string(&mut said).unwrap();
        let freeze = freeze.wait_with_output().unwrap();
        assert!(
            freeze.status.success(),
            "{failpoint}: the freeze failed: {said}"
        );
        assert!(image.exists(), "{failpoint}");
        env.reap_worker(pid);
        assert!(!alive(pid), "{failpoint}");
        env.sim.assert_no_wedge();
    }
}

/// Attack (session 22): a `cryo freeze` of a parked worker paused after its suspension's
/// verification (`freeze-after-gpu-free`: CHECKPOINTED, nothing let go or dumped) or at CRIU's
/// gate (`freeze-at-dump-gate`: the tree dumped and seized, not yet ended), then a `cryo wake`
/// of it. The wake must be refused at once (exit 3) naming the freeze, touching nothing; the
/// freeze, let go, publishes the image and ends the worker (CHECKPOINTED: safe); no wedge.
/// (Before, paused after GPU free: the wake restored and unlocked the worker, exit 0, "gpu
/// restore done", and the freeze then dumped a RUNNING restored worker: CRIU happened to fail
/// ("criu dump failed ...: unix: External socket is used"), the freeze exited 1 and the worker
/// ran on; a dump that succeeded would have ended the live restored context. Paused at the gate:
/// the simulated driver answered the seized worker's GetState with NOT_INITIALIZED and the wake
/// said "tree of pid N holds no CUDA process: nothing to wake", a wrong reason.)
#[test]
fn a_wake_meeting_a_freeze_after_its_verification_is_refused_and_the_freeze_ends_it_safely() {
    meets_a_freeze_at_work("wake");
}

/// Attack (session 23): a `cryo park` and a `cryo stop` meeting a freeze of the worker after its
/// verification or at CRIU's gate (the same lock, never attacked with these two). Each must be
/// refused at once (exit 3) naming the freeze, touching nothing (a stop's kill of the
/// CHECKPOINTED worker would be safe, but it would have dumped nothing for the freeze to
/// publish); the freeze, let go, publishes the image and ends the worker safely; no wedge. (It
/// held on main: the freeze takes the lock of every process of its tree before its first look,
/// and a park or a stop takes it before anything; now pinned. What holds a stop that takes no
/// such lock is `stop.rs`'s `a_checkpointed_worker_held_by_a_foreign_tracer_is_never_stopped_as_plain`.)
#[test]
fn a_park_or_a_stop_meeting_a_freeze_at_work_is_refused_and_the_freeze_ends_it_safely() {
    meets_a_freeze_at_work("park");
    meets_a_freeze_at_work("stop");
}

/// The other order (session 22): a `cryo wake` of a parked worker paused before its restore
/// (`wake-before-restore`) or between its restore and its unlock (`restore-before-completed`),
/// then a `cryo freeze` of it. The freeze must be refused at once (exit 3) naming the wake,
/// nothing suspended or dumped; the wake, let go, brings the worker back running; no wedge.
#[test]
fn a_freeze_meeting_a_wake_at_work_is_refused_and_the_wake_wakes() {
    for failpoint in [
        cryo_lifecycle::park::WAKE_BEFORE_RESTORE,
        cryo_lifecycle::restore::RESTORE_BEFORE_COMPLETED,
    ] {
        a_freeze_meeting(
            "wake",
            failpoint,
            "woken",
            Some(cryo_gpu::ProcessState::Running),
        );
    }
}

/// Attack (session 23): a `cryo freeze` of a worker whose `cryo park` holds its lock between its
/// lock and its checkpoint (`suspend-after-lock`: LOCKED), or whose `cryo stop` (of the parked
/// worker) holds it after its last look before its kill (`stop-kill-after-look`). The freeze
/// must be refused at once (`FreezeError::InProgress`, exit 3) naming the park or the stop,
/// nothing suspended or dumped; the park, let go, parks the worker, the stop ends it safely; no
/// wedge. (It held on main: a park holds the lock from its entry to its return, a stop from
/// before its first look until after its kill, and a freeze takes it before its first look;
/// now pinned.)
#[test]
fn a_freeze_meeting_a_park_or_a_stop_at_work_is_refused() {
    a_freeze_meeting(
        "park",
        cryo_lifecycle::suspend::SUSPEND_AFTER_LOCK,
        "parked",
        Some(cryo_gpu::ProcessState::Checkpointed),
    );
    a_freeze_meeting(
        "stop",
        cryo_lifecycle::stop::STOP_KILL_AFTER_LOOK,
        "stopped",
        None,
    );
}

/// A `cryo freeze` of a worker whose `cryo OP` (a wake or a stop of it parked, a park of it
/// running) is paused at `failpoint` holding its lock: the freeze is refused at once (exit 3)
/// naming OP as `doing` it, nothing dumped; OP, let go, succeeds and leaves the worker `then`
/// (its driver state; `None`: ended); no wedge.
fn a_freeze_meeting(op: &str, failpoint: &str, doing: &str, then: Option<cryo_gpu::ProcessState>) {
    let mut env = Env::start("1GiB");
    let (pid, _sock) = env.worker("64MiB", 0);
    if op != "park" {
        let out = env.cryo(&["park", &pid.to_string()]);
        assert!(out.status.success(), "park: {}", stderr(&out));
    }
    let resume = env.path().join("go");
    let (held, mut err) = paused_at(&env, &[op, &pid.to_string()], failpoint, &resume);
    let by = held.id();
    let image = env.path().join("img");
    let freeze = env.try_freeze(pid, &image, &[]);
    assert_eq!(
        freeze.status.code(),
        Some(3),
        "{failpoint}: {}",
        stderr(&freeze)
    );
    assert!(
        stderr(&freeze).contains(&format!("pid {pid} is being {doing} by cryo pid {by}")),
        "{failpoint}: {}",
        stderr(&freeze)
    );
    assert!(!image.exists(), "{failpoint}");
    fs::write(&resume, b"").unwrap();
    let mut said = String::new();
    err.read_to_string(&mut said).unwrap();
    let held = held.wait_with_output().unwrap();
    assert!(held.status.success(), "{failpoint}: {said}");
    match then {
        Some(state) => {
            assert_eq!(env.sim.gpu.driver.state(pid).unwrap(), state, "{failpoint}");
            env.stop_clean(pid);
        }
        None => {
            env.reap_worker(pid);
            assert!(!alive(pid), "{failpoint}");
            env.sim.assert_no_wedge();
        }
    }
}
