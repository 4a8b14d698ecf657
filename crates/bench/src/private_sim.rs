//! A private simulated GPU for the demo and the benchmarks: a child `cryo sim driver` in a
//! directory of the caller's, and sim workers started against it.
//!
//! # Design
//! [`PrivateSim`] owns the driver process: it is killed and reaped on drop. Workers are handed to
//! the caller as [`SimWorker`]s, since each caller ends them its own way (`cryo stop`, a freeze,
//! a kill after a suspension); [`retire`] is the best-effort suspend-then-kill for a failure path,
//! and [`Workers`] does it on drop for every worker a caller started (and the restored trees it
//! adopted), so an error or a panic anywhere in a benchmark's arm ends what it started.
//! What differs between callers is a parameter: the binary (a private copy where CRIU will restore
//! the worker: CRIU refuses a process whose executable changed on disk), whether the driver logs
//! to `driver.log`, and for workers `setsid` (CRIU dumps a tree that leads its session), the GPU,
//! a unix socket instead of TCP, a log file and how long to wait.
//!
//! # Limitations
//! The driver is killed without any care for its workers: callers suspend or end restored workers
//! before dropping the [`PrivateSim`].

use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context as _};
use cryo_gpu::{Gpu, ProcessState};
use cryo_proc::{Pid, ProcHandle, Signal};
use cryo_sim::SimControl;

/// A `cryo sim driver` child serving in `dir`.
pub(crate) struct PrivateSim {
    dir: PathBuf,
    driver: Child,
}

/// How to start the driver.
pub(crate) struct DriverOptions<'a> {
    /// The binary to run (`std::env::current_exe()`, or a private copy).
    pub exe: &'a Path,
    /// `--gpus N`; the driver's default when `None`.
    pub gpus: Option<u32>,
    /// `--gpu-memory`, as the command line takes it.
    pub gpu_memory: String,
    /// The driver's output to `dir/driver.log` (else discarded).
    pub log: bool,
}

/// How to start one sim worker.
pub(crate) struct WorkerOptions<'a> {
    /// The binary to run.
    pub exe: &'a Path,
    /// Under `setsid`, so that the worker leads its own session.
    pub setsid: bool,
    /// `--gpu N`; the worker's default when `None`.
    pub gpu: Option<usize>,
    /// `--memory`, bytes.
    pub memory: u64,
    /// `--kv-cache`, bytes (0: none).
    pub kv_cache: u64,
    /// `--http-unix SOCKET` instead of a TCP port.
    pub http_unix: Option<&'a Path>,
    /// `--ready-file`.
    pub ready: PathBuf,
    /// `--log-file`.
    pub log: Option<PathBuf>,
    /// How long it may take to fill its memory and answer.
    pub timeout: Duration,
}

/// A started sim worker: the caller's child.
pub(crate) struct SimWorker {
    pub child: Child,
    pub pid: Pid,
    /// The TCP port, where it serves on one.
    pub port: Option<u16>,
}

impl SimWorker {
    /// The TCP port, or an error naming the ready file's lack.
    pub fn tcp_port(&self) -> anyhow::Result<u16> {
        self.port.context("no port in the ready file")
    }
}

/// A private copy of the binary `cryo` at `dir/name`, for processes CRIU will restore.
pub(crate) fn private_exe(
    cryo: &Path,
    dir: &Path,
    name: &str,
    what: &str,
) -> anyhow::Result<PathBuf> {
    let exe = dir.join(name);
    fs::copy(cryo, &exe).with_context(|| format!("copying {what}"))?;
    Ok(exe)
}

impl PrivateSim {
    /// Starts the driver in `dir` and waits (10 s at most) until it answers.
    pub fn start(dir: &Path, o: &DriverOptions<'_>) -> anyhow::Result<PrivateSim> {
        let mut c = Command::new(o.exe);
        c.args(["sim", "driver"]);
        if let Some(n) = o.gpus {
            c.args(["--gpus", &n.to_string()]);
        }
        c.args(["--gpu-memory", &o.gpu_memory, "--dir"])
            .arg(dir)
            .stdin(Stdio::null());
        let log = dir.join("driver.log");
        if o.log {
            let f = File::create(&log).context("creating driver.log")?;
            c.stdout(f.try_clone().context("duplicating driver.log")?)
                .stderr(f);
        } else {
            c.stdout(Stdio::null()).stderr(Stdio::null());
        }
        let driver = c
            .spawn()
            .with_context(|| format!("starting {} sim driver", o.exe.display()))?;
        let sim = PrivateSim {
            dir: dir.to_path_buf(),
            driver,
        };
        SimControl::new(dir)
            .wait_up(Duration::from_secs(10))
            .map_err(|e| {
                let e = anyhow!(e).context("waiting for the simulated driver");
                if o.log {
                    e.context(log_tail(&log))
                } else {
                    e
                }
            })?;
        Ok(sim)
    }

    /// The driver's pid.
    pub fn pid(&self) -> u32 {
        self.driver.id()
    }

    /// Starts a worker and waits for its ready file; a worker that does not get there is killed
    /// (it never held a restored context).
    pub fn spawn_worker(&self, o: &WorkerOptions<'_>) -> anyhow::Result<SimWorker> {
        let mut c = if o.setsid {
            let mut c = Command::new("setsid");
            c.arg(o.exe);
            c
        } else {
            Command::new(o.exe)
        };
        c.args(["sim", "worker"]);
        if let Some(g) = o.gpu {
            c.args(["--gpu", &g.to_string()]);
        }
        c.args(["--memory", &o.memory.to_string()]);
        if o.kv_cache > 0 {
            c.args(["--kv-cache", &o.kv_cache.to_string()]);
        }
        c.arg("--dir").arg(&self.dir);
        if let Some(s) = o.http_unix {
            c.arg("--http-unix").arg(s);
        }
        c.arg("--ready-file").arg(&o.ready);
        if let Some(l) = &o.log {
            c.arg("--log-file").arg(l);
        }
        let mut child = c
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                let under = if o.setsid { " under setsid" } else { "" };
                format!("starting {} sim worker{under}", o.exe.display())
            })?;
        match wait_ready(&mut child, o) {
            Ok((pid, port)) => Ok(SimWorker { child, pid, port }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for PrivateSim {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn wait_ready(child: &mut Child, o: &WorkerOptions<'_>) -> anyhow::Result<(Pid, Option<u16>)> {
    let deadline = Instant::now() + o.timeout;
    let info: serde_json::Value = loop {
        if let Ok(text) = fs::read_to_string(&o.ready) {
            break serde_json::from_str(&text)
                .with_context(|| format!("reading {}", o.ready.display()))?;
        }
        if let Ok(Some(status)) = child.try_wait() {
            let tail = o
                .log
                .as_deref()
                .map(|l| format!("; {}", log_tail(l)))
                .unwrap_or_default();
            bail!("the sim worker exited ({status}) before serving{tail}");
        }
        if Instant::now() >= deadline {
            bail!(
                "the sim worker did not start serving within {} s",
                o.timeout.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let pid = info["pid"]
        .as_i64()
        .and_then(|p| Pid::try_from(p).ok())
        .context("no pid in the ready file")?;
    let port = info["port"].as_u64().and_then(|p| u16::try_from(p).ok());
    Ok((pid, port))
}

/// Ends a worker on a failure path: a running or locked context is suspended first, as the
/// invariant demands, then the worker is killed and reaped.
pub(crate) fn retire(gpu: Option<&Gpu>, pid: Pid, child: &mut Child) {
    if let Some(gpu) = gpu {
        if matches!(gpu.driver.state(pid), Ok(ProcessState::Running)) {
            let _ = gpu.driver.lock(pid, Some(Duration::from_secs(10)));
        }
        if matches!(gpu.driver.state(pid), Ok(ProcessState::Locked)) {
            let _ = gpu.driver.checkpoint(pid);
        }
    }
    let _ = child.kill();
    let _ = child.wait();
}

/// The end of a child's log, for an error message.
pub(crate) fn log_tail(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().rev().take(5).collect();
    let tail: Vec<&str> = lines.into_iter().rev().collect();
    format!("{} ends with: {}", path.display(), tail.join(" | "))
}

/// The sim workers of one benchmark arm, ended on drop whatever ends the arm: its success (then
/// they are already stopped and reaped, and nothing is left to do), an error returned with `?`
/// anywhere, or a panic (drop runs while unwinding). A worker the arm gave up on (a `cryo stop`
/// that timed out, a failed freeze that resumed it, a thaw that failed after CRIU restored it)
/// would otherwise run on with its memory after the benchmark exits.
///
/// A worker is known by its pid, because a thaw brings it back as another process with the
/// same pid. It is this arm's only while it is the benchmark's child: the worker was spawned by
/// it, and a restored tree's root is adopted by it (the benchmark is a child subreaper, and
/// `cryo thaw` / `criu restore -d` have exited by then); a child's pid is not reused before its
/// parent reaps it. So on drop each pid is opened as a pidfd and acted on only if the process
/// of that pidfd is alive and the benchmark's child; it is then suspended as the invariant
/// demands (lock and checkpoint, bounded: a driver that does not answer is given up on),
/// SIGKILLed through the pidfd and reaped. Its descendants (a worker's helpers, the rest of a
/// restored tree) are ended the same way first, by pidfds taken from the live worker: killed
/// after it, they would be reparented away from it.
pub(crate) struct Workers {
    /// The private driver's directory, to suspend a worker before its kill.
    dir: PathBuf,
    pids: Vec<Pid>,
}

impl Workers {
    /// No worker yet, on the driver in `dir`.
    pub(crate) fn new(dir: &Path) -> Workers {
        Workers {
            dir: dir.to_path_buf(),
            pids: Vec::new(),
        }
    }

    /// A worker this arm started (its pid also names the tree a thaw restores).
    pub(crate) fn hold(&mut self, pid: Pid) {
        if !self.pids.contains(&pid) {
            self.pids.push(pid);
        }
    }
}

impl Drop for Workers {
    fn drop(&mut self) {
        let mut gpu = None;
        for &pid in &self.pids {
            let Some(h) = own_child(pid) else {
                continue;
            };
            let gpu = gpu.get_or_insert_with(|| {
                cryo_sim::connect(&self.dir).ok().map(|g| {
                    g.bounded(cryo_gpu::Limits {
                        until: Some(Instant::now() + Duration::from_secs(30)),
                        ..cryo_gpu::Limits::default()
                    })
                })
            });
            eprintln!("cryo bench: ending sim worker {pid}, left running by a failed arm");
            // Its descendants first, while it is alive to hold them under it: killed after it,
            // they would be reparented away. Walked again until none is left (bounded).
            for _ in 0..8 {
                let below = h.descendants();
                if below.is_empty() {
                    break;
                }
                for d in &below {
                    eprintln!("cryo bench: ending pid {} of sim worker {pid}", d.pid());
                    suspend(gpu.as_ref(), d);
                    let _ = d.signal(Signal::SIGKILL);
                }
                for d in &below {
                    d.wait_exit(Duration::from_secs(10));
                }
            }
            suspend(gpu.as_ref(), &h);
            if let Err(e) = h.signal(Signal::SIGKILL) {
                eprintln!("cryo bench: cannot kill sim worker {pid}: {e}");
                continue;
            }
            h.wait_exit(Duration::from_secs(10));
            if let Some(p) = rustix::process::Pid::from_raw(pid) {
                let _ = rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG);
            }
        }
    }
}

/// A pidfd on `pid` if the process it names is alive and this process's child (a child's pid
/// is not reused before we reap it, so what is read through the pidfd is about that child).
fn own_child(pid: Pid) -> Option<ProcHandle> {
    let h = ProcHandle::open(pid).ok()?;
    let me = rustix::process::getpid().as_raw_nonzero().get();
    let st = h.stat().ok()?;
    (st.ppid == me && h.is_alive()).then_some(h)
}

/// Suspends the process of `h` if it holds a running or locked context (best effort, within
/// `gpu`'s deadline): a live context is never torn down by a kill. The driver names a process
/// by its pid: each call is made only while `h`'s process is alive, so its pid is still its
/// own (a pid is not reused before its process is reaped). A descendant that ended since it
/// was listed, its pid taken by another process, is not acted on.
fn suspend(gpu: Option<&Gpu>, h: &ProcHandle) {
    let Some(gpu) = gpu else {
        return;
    };
    let pid = h.pid();
    let in_state =
        |s: ProcessState| h.is_alive() && matches!(gpu.driver.state(pid), Ok(x) if x == s);
    if in_state(ProcessState::Running) && h.is_alive() {
        let _ = gpu.driver.lock(pid, Some(Duration::from_secs(10)));
    }
    if in_state(ProcessState::Locked) && h.is_alive() {
        let _ = gpu.driver.checkpoint(pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sleeper() -> (std::process::Child, ProcHandle) {
        let child = Command::new("sleep").arg("1000").spawn().unwrap();
        let h = ProcHandle::open(Pid::try_from(child.id()).unwrap()).unwrap();
        (child, h)
    }

    /// A panic in an arm ends the workers it held (by pidfd, and reaps them), not the others.
    #[test]
    fn a_panicking_arm_ends_the_workers_it_started() {
        let dir = tempfile::tempdir().unwrap();
        let (mut held, held_h) = sleeper();
        let (mut other, other_h) = sleeper();
        let pid = held_h.pid();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut w = Workers::new(dir.path());
            w.hold(pid);
            panic!("the arm failed");
        }));
        assert!(panicked.is_err());
        assert!(
            held_h.wait_exit(Duration::from_secs(10)),
            "worker {pid} left running"
        );
        // Reaped by the guard: its pid is free.
        assert_eq!(held_h.liveness(), cryo_proc::Liveness::Gone);
        assert!(held.try_wait().is_err());
        assert!(
            other_h.is_alive(),
            "a process the arm did not hold was ended"
        );
        other.kill().unwrap();
        other.wait().unwrap();
    }

    /// A shell (this process's child) running `sleep` in the background (its child, not
    /// ours), and the sleep's pid.
    fn shell_with_a_child() -> (std::process::Child, Pid) {
        let mut sh = Command::new("sh")
            .args(["-c", "sleep 1000 & echo $!; wait"])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(sh.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        (sh, line.trim().parse().unwrap())
    }

    /// Attack (session 13): a held worker has a child of its own (a worker's helper, or a
    /// restored tree's other process). A failed arm ends it too, not only the worker's root:
    /// killed first, the root's children are reparented away and nothing ends them. (Before:
    /// only each root pid was held, and the child outlived the arm.)
    #[test]
    fn a_failed_arm_ends_the_children_of_its_workers_too() {
        let dir = tempfile::tempdir().unwrap();
        let (mut sh, child) = shell_with_a_child();
        let child = ProcHandle::open(child).unwrap();
        let root = ProcHandle::open(Pid::try_from(sh.id()).unwrap()).unwrap();
        drop({
            let mut w = Workers::new(dir.path());
            w.hold(root.pid());
            w
        });
        assert!(
            child.wait_exit(Duration::from_secs(10)),
            "the worker's child {} outlived the arm",
            child.pid()
        );
        assert!(root.wait_exit(Duration::from_secs(10)));
        let _ = sh.wait();
    }

    /// Attack (session 14): a descendant the guard listed ends, and its pid is taken by another
    /// CUDA process before the guard suspends it. The guard acts through the descendant's
    /// pidfd: the other process is never locked. (Before: suspended by bare pid, the other
    /// process was locked and checkpointed.)
    #[test]
    fn a_descendant_whose_pid_was_reused_is_not_suspended() {
        use cryo_testkit::fake::{Call, FakeGpu};
        let (mut child, h) = sleeper();
        let pid = h.pid();
        child.kill().unwrap();
        child.wait().unwrap();
        let mut reuser = cryo_testkit::procs::spawn_with_pid(pid).expect("pid reused");
        let fake = FakeGpu::new();
        fake.add(pid);
        suspend(Some(&fake.gpu()), &h);
        assert_eq!(
            fake.count(pid, Call::Lock),
            0,
            "the pid's new process was locked"
        );
        assert_eq!(fake.state_of(pid), ProcessState::Running);
        reuser.kill().unwrap();
        reuser.wait().unwrap();
    }

    /// A held pid that is not this process's child (a pid freed and taken by someone else) is
    /// never signalled.
    #[test]
    fn a_held_pid_that_is_not_our_child_is_left_alone() {
        let dir = tempfile::tempdir().unwrap();
        // A grandchild: its parent is the shell, not this process.
        let (mut sh, pid) = shell_with_a_child();
        let h = ProcHandle::open(pid).unwrap();
        drop({
            let mut w = Workers::new(dir.path());
            w.hold(pid);
            w
        });
        assert!(h.is_alive(), "pid {pid}, not our child, was ended");
        h.signal(Signal::SIGKILL).unwrap();
        sh.wait().unwrap();
    }
}
