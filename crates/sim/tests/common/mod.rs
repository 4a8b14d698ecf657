//! Test harness: a daemon per test in its own temp dir, workers exec'd from the `cryo-sim` binary.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, DriverError, Gpu};
use cryo_proc::Pid;
use cryo_sim::{SimControl, Wedge};

pub const BIN: &str = env!("CARGO_BIN_EXE_cryo-sim");

/// A driver daemon in its own directory; killed on drop.
pub struct Sim {
    pub dir: tempfile::TempDir,
    daemon: Child,
    pub gpu: Gpu,
    pub control: SimControl,
}

impl Sim {
    pub fn start() -> Sim {
        Sim::start_with(&["--gpus", "2", "--gpu-memory", "16GiB"])
    }

    pub fn start_with(args: &[&str]) -> Sim {
        let dir = tempfile::tempdir().unwrap();
        let log = std::fs::File::create(dir.path().join("driver.log")).unwrap();
        let daemon = Command::new(BIN)
            .arg("driver")
            .arg("--dir")
            .arg(dir.path())
            .args(args)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap();
        let control = SimControl::new(dir.path());
        control.wait_up(Duration::from_secs(30)).expect("daemon up");
        let gpu = cryo_sim::connect(dir.path()).unwrap();
        Sim {
            dir,
            daemon,
            gpu,
            control,
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    pub fn worker(&self, memory: &str, gpu: u32, seed: u64) -> Worker {
        Worker::spawn(self.path(), memory, gpu, seed)
    }

    pub fn ledger(&self) -> Vec<Wedge> {
        self.control.ledger().unwrap()
    }

    /// Waits until the ledger has `n` wedges (the daemon writes it when it sees the teardown).
    pub fn wait_ledger(&self, n: usize) -> Vec<Wedge> {
        wait_for(Duration::from_secs(20), "wedges in the ledger", || {
            let l = self.ledger();
            (l.len() >= n).then_some(l)
        })
    }

    pub fn listed(&self, pid: Pid) -> bool {
        self.gpu
            .inspect
            .processes()
            .unwrap()
            .iter()
            .any(|p| p.pid == pid)
    }

    /// Waits until NVML stops listing `pid` (the daemon has torn its context down).
    pub fn wait_unlisted(&self, pid: Pid) {
        wait_for(
            Duration::from_secs(20),
            "pid to leave the NVML listing",
            || (!self.listed(pid)).then_some(()),
        );
    }

    pub fn daemon_log(&self) -> String {
        std::fs::read_to_string(self.path().join("driver.log")).unwrap_or_default()
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        let _ = self.daemon.kill();
        let _ = self.daemon.wait();
    }
}

pub fn wait_for<T>(limit: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A sim worker; SIGKILLed and reaped on drop.
pub struct Worker {
    pub child: Child,
    pub pid: Pid,
    pub port: u16,
    pub unix: Option<PathBuf>,
    pub log: PathBuf,
}

impl Worker {
    pub fn spawn(dir: &Path, memory: &str, gpu: u32, seed: u64) -> Worker {
        Worker::spawn_via(None, false, dir, memory, gpu, seed)
    }

    /// Spawns through `wrapper` (e.g. `setsid`, which execs in place: same pid), serving HTTP on
    /// a unix socket when `http_unix`.
    pub fn spawn_via(
        wrapper: Option<&str>,
        http_unix: bool,
        dir: &Path,
        memory: &str,
        gpu: u32,
        seed: u64,
    ) -> Worker {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = &N;
        let tag = format!(
            "{}-{}",
            std::process::id(),
            n.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        );
        let ready = dir.join(format!("worker-{gpu}-{seed}-{tag}-{}.ready", rand_suffix()));
        let log = ready.with_extension("log");
        let mut cmd = match wrapper {
            Some(w) => {
                let mut c = Command::new(w);
                c.arg(BIN);
                c
            }
            None => Command::new(BIN),
        };
        cmd.arg("worker");
        let unix = http_unix.then(|| ready.with_extension("http.sock"));
        if let Some(u) = &unix {
            cmd.arg("--http-unix").arg(u);
        }
        let mut child = cmd
            .arg("--dir")
            .arg(dir)
            .args([
                "--gpu",
                &gpu.to_string(),
                "--memory",
                memory,
                "--seed",
                &seed.to_string(),
            ])
            .arg("--ready-file")
            .arg(&ready)
            .arg("--log-file")
            .arg(&log)
            .env("RUST_LOG", "debug")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let v: serde_json::Value = wait_for(Duration::from_secs(120), "worker ready file", || {
            if let Some(status) = child.try_wait().unwrap() {
                panic!(
                    "worker exited with {status}: {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            std::fs::read(&ready)
                .ok()
                .map(|b| serde_json::from_slice(&b).unwrap())
        });
        let pid = v["pid"].as_i64().unwrap() as Pid;
        assert_eq!(pid, child.id() as Pid);
        Worker {
            child,
            pid,
            port: v["port"].as_u64().unwrap() as u16,
            unix,
            log,
        }
    }

    pub fn http(&self, method: &str, path: &str, body: &str) -> (u16, String) {
        match &self.unix {
            Some(u) => exchange(
                std::os::unix::net::UnixStream::connect(u).unwrap(),
                method,
                path,
                body,
            ),
            None => http(self.port, method, path, body),
        }
    }

    pub fn complete(&self, prompt: &str) -> String {
        let (status, body) = self.http("POST", "/v1/completions", prompt);
        assert_eq!(status, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        v["text"].as_str().unwrap().to_string()
    }

    pub fn verify(&self) -> serde_json::Value {
        let (status, body) = self.http("GET", "/verify", "");
        assert_eq!(status, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    pub fn rss(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.pid)).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace()
            .nth(1)
            .unwrap()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    pub fn sigkill(&self) {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .unwrap();
    }

    /// Waits until the (unreaped) worker is a zombie.
    pub fn wait_zombie(&self) {
        wait_for(Duration::from_secs(20), "worker to become a zombie", || {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap();
            let state = stat[stat.rfind(')').unwrap() + 2..].chars().next().unwrap();
            (state == 'Z').then_some(())
        });
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos()
}

/// One HTTP/1.1 request with `Connection: close`.
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    exchange(
        TcpStream::connect(("127.0.0.1", port)).unwrap(),
        method,
        path,
        body,
    )
}

fn exchange(mut s: impl Read + Write, method: &str, path: &str, body: &str) -> (u16, String) {
    write!(
        s,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let status: u16 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
    let body = out
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (status, body)
}

/// The driver code of a failed call.
pub fn code<T: std::fmt::Debug>(r: Result<T, DriverError>) -> CuResult {
    match r {
        Err(DriverError::Cuda { code, .. }) => code,
        other => panic!("expected a CUDA error, got {other:?}"),
    }
}

/// lock (10 s), checkpoint.
pub fn suspend(sim: &Sim, pid: Pid) {
    sim.gpu
        .driver
        .lock(pid, Some(Duration::from_secs(10)))
        .unwrap();
    sim.gpu.driver.checkpoint(pid).unwrap();
}

/// lock, checkpoint, restore, unlock: the worker is now a live *restored* process.
pub fn cycle(sim: &Sim, pid: Pid) {
    suspend(sim, pid);
    sim.gpu.driver.restore(pid, &[]).unwrap();
    sim.gpu.driver.unlock(pid).unwrap();
}
