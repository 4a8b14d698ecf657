//! A simulated GPU driver daemon per test, in its own temporary directory, and sim workers.
//!
//! The daemon and the workers are separate processes exec'd from the binary the test crate has:
//! [`Program::cryo_sim`] (`cryo-sim driver`, `cryo-sim worker`, in `cryo-sim`'s tests) or
//! [`Program::cryo`] (`cryo sim driver`, in the CLI's tests). Everything is killed on drop; a
//! worker still alive is suspended first (lock, checkpoint), as everything in cryo does.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cryo_gpu::Gpu;
use cryo_proc::Pid;
use cryo_sim::{SimControl, Wedge};

use crate::http::{http, Endpoint};
use crate::{eventually, procs, PATIENCE};

/// The pids of the [`Worker`]s not dropped yet (their drop ends them): what [`Sim`]'s drop
/// does not count as left behind when a test's worker outlives its sim binding.
static OWNED: std::sync::Mutex<Vec<Pid>> = std::sync::Mutex::new(Vec::new());

fn owned() -> std::sync::MutexGuard<'static, Vec<Pid>> {
    OWNED.lock().unwrap_or_else(|e| e.into_inner())
}

/// The binary that runs the simulated GPU's commands, and the words before them.
#[derive(Debug, Clone)]
pub struct Program {
    bin: PathBuf,
    prefix: Vec<&'static str>,
}

impl Program {
    /// `cryo-sim COMMAND` (`env!("CARGO_BIN_EXE_cryo-sim")` in `cryo-sim`'s tests).
    pub fn cryo_sim(bin: impl Into<PathBuf>) -> Self {
        Program {
            bin: bin.into(),
            prefix: Vec::new(),
        }
    }

    /// `cryo sim COMMAND` (`env!("CARGO_BIN_EXE_cryo")` in the CLI's tests).
    pub fn cryo(bin: impl Into<PathBuf>) -> Self {
        Program {
            bin: bin.into(),
            prefix: vec!["sim"],
        }
    }

    /// The same commands from another copy of the binary (CRIU refuses to restore a process
    /// whose executable changed, and `target/` is rebuilt under running tests).
    pub fn copied_to(&self, path: &Path) -> Self {
        std::fs::copy(&self.bin, path).unwrap();
        Program {
            bin: path.to_path_buf(),
            prefix: self.prefix.clone(),
        }
    }

    /// `BIN [sim] COMMAND`, with no cryo settings inherited from the test's environment.
    pub fn command(&self, command: &str) -> Command {
        crate::own();
        let mut c = Command::new(&self.bin);
        clean_env(&mut c);
        c.args(&self.prefix).arg(command);
        c
    }

    /// The binary.
    pub fn bin(&self) -> &Path {
        &self.bin
    }
}

/// Removes every cryo setting a developer's shell may carry (`CRYO_GPU`, `CRYO_SIM_DIR`...).
pub fn clean_env(c: &mut Command) {
    for var in [
        "CRYO_GPU",
        "CRYO_SIM_DIR",
        "CRYO_STATE_DIR",
        "CRYO_FAILPOINT",
        "CRYO_CRIU",
        "RUST_LOG",
    ] {
        c.env_remove(var);
    }
}

/// A driver daemon in its own directory; killed on drop.
#[derive(Debug)]
pub struct Sim {
    dir: tempfile::TempDir,
    daemon: Child,
    program: Program,
    /// The driver and NVML through the client backend.
    pub gpu: Gpu,
    /// Ledger and fault injection.
    pub control: SimControl,
}

impl Sim {
    /// Two GPUs of 16 GiB.
    pub fn start(program: &Program) -> Sim {
        Sim::start_with(program, &["--gpus", "2", "--gpu-memory", "16GiB"])
    }

    /// With these `driver` arguments (`--gpus N --gpu-memory SIZE`...).
    pub fn start_with(program: &Program, args: &[&str]) -> Sim {
        let owner = crate::own();
        let dir = tempfile::Builder::new()
            .prefix("cryo-sim-test-")
            .tempdir_in(owner.scratch())
            .unwrap();
        let log = std::fs::File::create(dir.path().join("driver.log")).unwrap();
        let daemon = program
            .command("driver")
            .arg("--dir")
            .arg(dir.path())
            .args(args)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let control = SimControl::new(dir.path());
        if let Err(e) = control.wait_up(PATIENCE) {
            panic!(
                "the simulated driver did not come up ({e}): {}",
                std::fs::read_to_string(dir.path().join("driver.log")).unwrap_or_default()
            );
        }
        let gpu = cryo_sim::connect(dir.path()).unwrap();
        Sim {
            dir,
            daemon,
            program: program.clone(),
            gpu,
            control,
        }
    }

    /// The daemon's pid.
    pub fn daemon_pid(&self) -> cryo_proc::Pid {
        self.daemon.id() as cryo_proc::Pid
    }

    /// The daemon's directory (`--sim-dir`).
    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// The program it was started from.
    pub fn program(&self) -> &Program {
        &self.program
    }

    /// A worker with `memory` of device memory on GPU 0 (seed 1).
    pub fn worker(&self, memory: &str) -> Worker {
        self.spawn(WorkerSpec::new(memory))
    }

    /// A worker as `spec` says.
    pub fn spawn(&self, spec: WorkerSpec) -> Worker {
        Worker::spawn(self, spec)
    }

    /// The wedge ledger as it is now. Read it after [`Sim::settled_ledger`] to see deaths.
    pub fn ledger(&self) -> Vec<Wedge> {
        self.control.ledger().unwrap()
    }

    /// The ledger, final for every process that has died before this call: one NVML query
    /// first, which the daemon answers only after tearing down every context whose fds are all
    /// closed (wedge recorded). Call it once the deaths are observed (an exit, a zombie).
    pub fn settled_ledger(&self) -> Vec<Wedge> {
        self.gpu.inspect.processes().unwrap();
        self.ledger()
    }

    /// Asserts that no live restored context was torn down by any death so far (the
    /// [`Sim::settled_ledger`]).
    pub fn assert_no_wedge(&self) {
        let l = self.settled_ledger();
        assert!(l.is_empty(), "wedges recorded: {l:?}");
    }

    /// Waits until the ledger has `n` wedges.
    pub fn wait_ledger(&self, n: usize) -> Vec<Wedge> {
        eventually(PATIENCE, &format!("{n} wedges in the ledger"), || {
            let l = self.ledger();
            (l.len() >= n).then_some(l)
        })
    }

    /// Whether NVML lists `pid` (a round trip: settled as [`Sim::settled_ledger`] says).
    pub fn listed(&self, pid: Pid) -> bool {
        self.gpu
            .inspect
            .processes()
            .unwrap()
            .iter()
            .any(|p| p.pid == pid)
    }

    /// The device memory NVML lists for `pid`: `(GPU index, bytes)`, by GPU.
    pub fn listing(&self, pid: Pid) -> Vec<(u32, u64)> {
        let mut v: Vec<(u32, u64)> = self
            .gpu
            .inspect
            .processes()
            .unwrap()
            .into_iter()
            .filter(|p| p.pid == pid)
            .map(|p| (p.gpu_index, p.used_memory))
            .collect();
        v.sort_unstable();
        v
    }

    /// Lock (10 s) and checkpoint `pid` through the driver.
    pub fn suspend(&self, pid: Pid) {
        self.gpu
            .driver
            .lock(pid, Some(Duration::from_secs(10)))
            .unwrap();
        self.gpu.driver.checkpoint(pid).unwrap();
    }

    /// Lock, checkpoint, restore, unlock: `pid` is now a live *restored* process.
    pub fn cycle(&self, pid: Pid) {
        self.suspend(pid);
        self.gpu.driver.restore(pid, &[]).unwrap();
        self.gpu.driver.unlock(pid).unwrap();
    }

    /// The daemon's log (debug level).
    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.path().join("driver.log")).unwrap_or_default()
    }
}

impl Sim {
    /// The sim workers still running of this sim (by the sim's directory in their command line
    /// or their executable, so also those in their own pid namespaces, which the test's pids do
    /// not name): `(host pid, NSpid line, command line)`.
    pub fn leftover_workers(&self) -> Vec<(Pid, String, String)> {
        let dir = self.path().to_string_lossy().into_owned();
        let me = std::process::id();
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in entries.flatten() {
            let Ok(pid) = e.file_name().to_string_lossy().parse::<Pid>() else {
                continue;
            };
            if pid as u32 == me || pid as u32 == self.daemon.id() || owned().contains(&pid) {
                continue;
            }
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline"))
                .map(|b| String::from_utf8_lossy(&b).replace('\0', " "))
                .unwrap_or_default();
            let exe = std::fs::read_link(format!("/proc/{pid}/exe"))
                .map(|x| x.to_string_lossy().into_owned())
                .unwrap_or_default();
            let worker = cmdline.contains(" worker ") && cmdline.contains(&dir);
            if worker || exe.starts_with(&format!("{dir}/")) {
                let nspid = std::fs::read_to_string(format!("/proc/{pid}/status"))
                    .unwrap_or_default()
                    .lines()
                    .find(|l| l.starts_with("NSpid:"))
                    .unwrap_or_default()
                    .to_string();
                out.push((pid, nspid, cmdline.trim().to_string()));
            }
        }
        out
    }
}

impl Drop for Sim {
    /// Kills the daemon; a sim worker of this sim still running (the test's cleanup missed it,
    /// or the product left it) is killed and fails the test, listed with its command line.
    fn drop(&mut self) {
        let left = self.leftover_workers();
        for (pid, _, _) in &left {
            // Gone meanwhile is fine.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
        if !left.is_empty() && !std::thread::panicking() {
            panic!("sim workers left running by the test (killed now): {left:#?}");
        }
    }
}

/// How to start a worker.
#[derive(Debug, Clone)]
pub struct WorkerSpec {
    memory: String,
    rank_memory: Option<String>,
    kv_cache: Option<String>,
    nccl: bool,
    gpu: u32,
    /// `--gpus`: a context on each (or one rank each with `process_per_gpu`).
    gpus: Vec<u32>,
    process_per_gpu: bool,
    init_only: bool,
    seed: u64,
    setsid: bool,
    http_unix: bool,
    process_group: bool,
    cgroup: Option<PathBuf>,
    program: Option<Program>,
    own_namespaces: bool,
    port: Option<u16>,
    inherit_fd: Option<std::os::fd::RawFd>,
}

impl WorkerSpec {
    /// `memory` of device memory, GPU 0, seed 1, TCP, a plain child of the test.
    pub fn new(memory: &str) -> Self {
        WorkerSpec {
            memory: memory.to_string(),
            rank_memory: None,
            kv_cache: None,
            nccl: false,
            gpu: 0,
            gpus: Vec::new(),
            process_per_gpu: false,
            init_only: false,
            seed: 1,
            setsid: false,
            http_unix: false,
            process_group: false,
            cgroup: None,
            program: None,
            own_namespaces: false,
            port: None,
            inherit_fd: None,
        }
    }

    /// Hands the worker this fd of the test (same number): a worker starts with no fd of its
    /// parent but its stdio otherwise ([`crate::fds::close_inherited`]).
    pub fn inherit_fd(mut self, fd: std::os::fd::RawFd) -> Self {
        self.inherit_fd = Some(fd);
        self
    }

    /// A KV cache of this size per context after the weights (`--kv-cache`), which the engine
    /// endpoints release and take back.
    pub fn kv_cache(mut self, size: &str) -> Self {
        self.kv_cache = Some(size.to_string());
        self
    }

    /// With [`WorkerSpec::gpus`]: device memory of each context in their order
    /// (`--rank-memory 96MiB,16MiB`), a process whose GPUs hold unequal amounts.
    pub fn rank_memory(mut self, sizes: &str) -> Self {
        self.rank_memory = Some(sizes.to_string());
        self
    }

    /// Leaving what an NCCL communicator leaves for the host to see (`--nccl`).
    pub fn nccl(mut self) -> Self {
        self.nccl = true;
        self
    }

    /// On the GPU with this NVML index.
    pub fn gpu(mut self, index: u32) -> Self {
        self.gpu = index;
        self
    }

    /// A context on each of these GPUs, in one process (`--gpus`).
    pub fn gpus(mut self, indices: &[u32]) -> Self {
        self.gpus = indices.to_vec();
        self
    }

    /// With [`WorkerSpec::gpus`]: a tree, one rank process per GPU under a launcher
    /// (`--process-per-gpu`); [`Worker::children`] are the ranks.
    pub fn process_per_gpu(mut self) -> Self {
        self.process_per_gpu = true;
        self
    }

    /// Only initialise the driver, no context (`--init-only`: a launcher that called `cuInit`);
    /// with [`WorkerSpec::process_per_gpu`], the launcher does so.
    pub fn init_only(mut self) -> Self {
        self.init_only = true;
        self
    }

    /// Device memory filled from this seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Leading its own session (`setsid`, which execs in place: same pid), as CRIU needs.
    pub fn setsid(mut self) -> Self {
        self.setsid = true;
        self
    }

    /// Serving HTTP on a unix socket in the sim directory instead of TCP.
    pub fn http_unix(mut self) -> Self {
        self.http_unix = true;
        self
    }

    /// In its own process group (a group kill reaches it alone).
    pub fn process_group(mut self) -> Self {
        self.process_group = true;
        self
    }

    /// Moved into this cgroup right after it starts, before it allocates its memory.
    pub fn cgroup(mut self, dir: &Path) -> Self {
        self.cgroup = Some(dir.to_path_buf());
        self
    }

    /// In fresh pid and network namespaces, as in a container (`cryo run` for the cryo binary,
    /// else `unshare --pid --net --fork`, loopback up): the worker is its namespace's pid 1 and session leader (what CRIU needs to
    /// dump both namespaces) and serves on loopback there; [`Worker::pid`] is its host pid and
    /// [`Worker::http`] reaches it in its namespace.
    pub fn own_namespaces(mut self) -> Self {
        self.own_namespaces = true;
        self
    }

    /// Serving on this TCP port of loopback (`--port`; default: any free one).
    pub fn port(mut self, port: u16) -> Self {
        self.port = Some(port);
        self
    }

    /// Exec'd from this program instead of the daemon's.
    pub fn program(mut self, program: Program) -> Self {
        self.program = Some(program);
        self
    }
}

impl WorkerSpec {
    /// `--gpu N`, `--gpus LIST [--process-per-gpu]` and `--init-only` as the spec says.
    fn gpu_args(&self) -> Vec<String> {
        let mut a = Vec::new();
        if !self.gpus.is_empty() {
            let list: Vec<String> = self.gpus.iter().map(u32::to_string).collect();
            a.extend(["--gpus".to_string(), list.join(",")]);
            if self.process_per_gpu {
                a.push("--process-per-gpu".into());
            }
        } else if !self.init_only {
            a.extend(["--gpu".to_string(), self.gpu.to_string()]);
        }
        if self.init_only {
            a.push("--init-only".into());
        }
        a
    }
}

/// A sim worker; suspended (if live) then SIGKILLed and reaped on drop.
#[derive(Debug)]
pub struct Worker {
    child: Option<Child>,
    /// Its pid.
    pub pid: Pid,
    /// Where it serves HTTP.
    pub endpoint: Endpoint,
    /// Its TCP port (0 when it serves on a unix socket).
    pub port: u16,
    log: PathBuf,
    gpu: Gpu,
    /// The ranks of a tree (`--process-per-gpu`), in rank order.
    children: Vec<Pid>,
    /// It serves in a network namespace of its own ([`WorkerSpec::own_namespaces`]).
    netns: bool,
}

impl Worker {
    fn spawn(sim: &Sim, spec: WorkerSpec) -> Worker {
        crate::own();
        static N: AtomicU32 = AtomicU32::new(0);
        let tag = format!(
            "worker-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        );
        let ready = sim.path().join(format!("{tag}.ready"));
        let log = sim.path().join(format!("{tag}.log"));
        let program = spec.program.as_ref().unwrap_or(&sim.program);
        let mut cmd = if spec.own_namespaces && program.prefix == ["sim"] {
            // The cryo binary: `cryo run`, what an operator uses.
            let mut c = Command::new(program.bin());
            clean_env(&mut c);
            c.args(["run", "--"])
                .arg(program.bin())
                .args(&program.prefix)
                .arg("worker")
                // See below.
                .current_dir(sim.path());
            c
        } else if spec.own_namespaces {
            let mut c = Command::new("unshare");
            clean_env(&mut c);
            c.args(["--pid", "--net", "--fork", "setsid", "sh", "-c"])
                .arg("ip link set lo up && exec \"$0\" \"$@\"")
                .arg(program.bin())
                .args(&program.prefix)
                .arg("worker")
                // CRIU's parasite makes a fixed-name scratch directory (`proc.crtools`) in the
                // working directory of a process whose /proc is not its pid namespace's: two
                // such dumps at once in one directory collide (EEXIST). One per simulator.
                .current_dir(sim.path());
            c
        } else if spec.setsid {
            let mut c = Command::new("setsid");
            clean_env(&mut c);
            c.arg(program.bin()).args(&program.prefix).arg("worker");
            c
        } else {
            program.command("worker")
        };
        let unix = spec
            .http_unix
            .then(|| sim.path().join(format!("{tag}.sock")));
        if let Some(u) = &unix {
            cmd.arg("--http-unix").arg(u);
        }
        if let Some(p) = spec.port {
            cmd.args(["--port", &p.to_string()]);
        }
        cmd.arg("--dir")
            .arg(sim.path())
            .args(spec.gpu_args())
            .args(["--memory", &spec.memory])
            .args(
                spec.rank_memory
                    .iter()
                    .flat_map(|m| ["--rank-memory", m.as_str()]),
            )
            .args(
                spec.kv_cache
                    .iter()
                    .flat_map(|k| ["--kv-cache", k.as_str()]),
            )
            .args(spec.nccl.then_some("--nccl"))
            .args(["--seed", &spec.seed.to_string()])
            .arg("--ready-file")
            .arg(&ready)
            .arg("--log-file")
            .arg(&log)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if spec.process_group {
            std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        }
        crate::fds::close_inherited(&mut cmd, spec.inherit_fd);
        let mut child = cmd.spawn().unwrap();
        let mut pid = child.id() as Pid;
        if let Some(cg) = &spec.cgroup {
            std::fs::OpenOptions::new()
                .write(true)
                .open(cg.join("cgroup.procs"))
                .and_then(|mut f| std::io::Write::write_all(&mut f, pid.to_string().as_bytes()))
                .unwrap_or_else(|e| panic!("cannot move pid {pid} into {}: {e}", cg.display()));
        }
        let info: serde_json::Value = eventually(PATIENCE, "the worker's ready file", || {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "worker exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::fs::read(&ready)
                .ok()
                .and_then(|b| serde_json::from_slice(&b).ok())
        });
        if spec.own_namespaces {
            // `cryo run` (or `unshare`) forked it: its only child, pid 1 of the new namespace
            // (the tree lists the root's children right after it).
            pid = cryo_proc::tree(pid).unwrap()[1];
            assert_eq!(info["pid"].as_i64(), Some(1), "pid 1 of its namespace");
        } else {
            assert_eq!(
                info["pid"].as_i64(),
                Some(i64::from(pid)),
                "the worker must run as the spawned pid (setsid execs in place)"
            );
        }
        let port = info["port"].as_u64().unwrap_or(0) as u16;
        let children: Vec<Pid> = info["children"]
            .as_array()
            .map(|c| {
                c.iter()
                    .filter_map(|p| p.as_i64())
                    .map(|p| p as Pid)
                    .collect()
            })
            .unwrap_or_default();
        owned().extend(std::iter::once(pid).chain(children.iter().copied()));
        Worker {
            child: Some(child),
            children,
            pid,
            endpoint: match unix {
                Some(u) => Endpoint::Unix(u),
                None => Endpoint::loopback(port),
            },
            port,
            netns: spec.own_namespaces,
            log,
            gpu: sim.gpu.clone(),
        }
    }

    /// The ranks of a tree ([`WorkerSpec::process_per_gpu`]), in rank order; empty otherwise.
    pub fn children(&self) -> &[Pid] {
        &self.children
    }

    /// One HTTP request to it: `(status, body)`.
    pub fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        if self.netns {
            return crate::http::http_in_netns(self.pid, self.port, method, path, body);
        }
        http(&self.endpoint, method, path, body)
    }

    /// A completion (device memory sampled at prompt-derived offsets).
    pub fn complete(&self, prompt: &str) -> String {
        let (status, body) = self.http("POST", "/v1/completions", prompt);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["text"].as_str().unwrap().to_string()
    }

    /// `GET /verify`: all of device memory hashed against the seed.
    pub fn verify(&self) -> serde_json::Value {
        let (status, body) = self.http("GET", "/verify", "");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// `GET /health`: also the GPU work queued and the GPU calls waiting at a locked gate.
    pub fn health(&self) -> serde_json::Value {
        let (status, body) = self.http("GET", "/health", "");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    /// Resident memory, bytes.
    pub fn rss(&self) -> u64 {
        cryo_proc::ProcHandle::open(self.pid)
            .and_then(|h| h.rss())
            .unwrap()
    }

    /// SIGKILL (the caller waits for what it expects next).
    pub fn sigkill(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }

    /// Waits until the (unreaped) worker is a zombie: its files are closed by then.
    pub fn wait_zombie(&self) {
        eventually(PATIENCE, "the worker to become a zombie", || {
            procs::state(self.pid) == Some('Z')
        });
    }

    /// Waits for it to exit and reaps it.
    pub fn wait_exit(&mut self) -> ExitStatus {
        let child = self.child.as_mut().expect("the worker was reaped already");
        let status = procs::wait_exit(child);
        self.disown();
        status
    }

    /// Whether it has exited (reaping it then).
    pub fn has_exited(&mut self) -> bool {
        let exited = self
            .child
            .as_mut()
            .is_none_or(|c| c.try_wait().unwrap().is_some());
        if exited {
            self.disown();
        }
        exited
    }

    /// Reaps it after something else ended it (CRIU after a dump); no-op once reaped.
    pub fn reap(&mut self) {
        if let Some(mut c) = self.child.take() {
            c.wait().unwrap();
        }
        self.disown();
    }

    /// Reaped, its pid no longer names it: a process with that pid later (its thaw) is no
    /// longer this handle's to end, and [`Sim`]'s drop counts it as left behind.
    fn disown(&self) {
        owned().retain(|p| *p != self.pid);
    }

    /// Whether this handle still owns the (unreaped) child.
    pub fn is_ours(&self) -> bool {
        self.child.is_some()
    }

    /// Its log (stdout and stderr, debug level).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        owned().retain(|p| *p != self.pid && !self.children.contains(p));
        let Some(mut child) = self.child.take() else {
            return;
        };
        // Suspend before kill, as everything in cryo does (the ranks of a tree too: they exit
        // when their launcher goes); a stopped process cannot answer.
        let running = child.try_wait().ok().flatten().is_none();
        for pid in std::iter::once(self.pid).chain(self.children.iter().copied()) {
            if running && procs::alive(pid) && !procs::all_threads_in(pid, &['T', 't']) {
                let _ = self.gpu.driver.lock(pid, Some(Duration::from_secs(5)));
                let _ = self.gpu.driver.checkpoint(pid);
            }
        }
        if self.netns {
            // `unshare` waits for it; it is not our child.
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        // The ranks exit on their own once their launcher is gone, a moment after it: held by
        // pidfd (no pid reuse) and waited for, so the sim's leftover check never sees one still
        // exiting.
        let ranks: Vec<cryo_proc::ProcHandle> = self
            .children
            .iter()
            .filter_map(|p| cryo_proc::ProcHandle::open(*p).ok())
            .collect();
        let _ = child.kill();
        let _ = child.wait();
        for rank in &ranks {
            rank.wait_exit(PATIENCE);
        }
    }
}
