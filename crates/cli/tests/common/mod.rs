//! A simulated GPU driver and sim workers started through the `cryo` binary under test, in a
//! temporary directory; everything is suspended (if live) and killed on drop.
#![allow(dead_code)]

use std::fs;
use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const CRYO: &str = env!("CARGO_BIN_EXE_cryo");

/// A `cryo` command with no inherited cryo settings.
pub fn cryo() -> Command {
    let mut c = Command::new(CRYO);
    c.env_remove("CRYO_GPU")
        .env_remove("CRYO_SIM_DIR")
        .env_remove("CRYO_STATE_DIR")
        .env_remove("RUST_LOG");
    c
}

pub struct Sim {
    pub dir: tempfile::TempDir,
    driver: Child,
    workers: Vec<Worker>,
}

pub struct Worker {
    pub pid: i32,
    pub port: u16,
    child: Child,
}

impl Sim {
    pub fn start() -> Sim {
        let dir = tempfile::Builder::new()
            .prefix("cryo-cli-test-")
            .tempdir()
            .unwrap();
        let driver = start_driver(dir.path(), "2", "1GiB");
        Sim {
            dir,
            driver,
            workers: Vec::new(),
        }
    }

    pub fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Starts a sim worker with `memory` of device memory; returns its pid and port.
    pub fn worker(&mut self, memory: &str) -> (i32, u16) {
        let n = self.workers.len();
        let ready = self.path().join(format!("worker{n}.ready"));
        let child = cryo()
            .args(["sim", "worker", "--memory", memory, "--dir"])
            .arg(self.path())
            .arg("--ready-file")
            .arg(&ready)
            .arg("--log-file")
            .arg(self.path().join(format!("worker{n}.log")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("cannot start cryo sim worker");
        let info = wait_ready(&ready, Duration::from_secs(60));
        let pid = info["pid"].as_i64().unwrap() as i32;
        let port = info["port"].as_u64().unwrap() as u16;
        self.workers.push(Worker { pid, port, child });
        (pid, port)
    }

    /// `cryo --gpu sim --sim-dir DIR ARGS...`.
    pub fn cryo(&self, args: &[&str]) -> Output {
        cryo()
            .arg("--gpu")
            .arg("sim")
            .arg("--sim-dir")
            .arg(self.path())
            .args(args)
            .output()
            .unwrap()
    }

    /// `cryo cuda-checkpoint ARGS...` against this driver.
    pub fn compat(&self, args: &[&str]) -> Output {
        cryo()
            .arg("--gpu")
            .arg("sim")
            .arg("--sim-dir")
            .arg(self.path())
            .arg("cuda-checkpoint")
            .args(args)
            .output()
            .unwrap()
    }

    /// The checkpoint state of `pid`, read through `cryo gpu state`.
    pub fn state(&self, pid: i32) -> String {
        let out = self.cryo(&["gpu", "state", "--pid", &pid.to_string()]);
        assert!(
            out.status.success(),
            "gpu state failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// The wedge ledger (must stay empty).
    pub fn ledger(&self) -> String {
        fs::read_to_string(self.path().join("ledger.jsonl")).unwrap_or_default()
    }

    pub fn ledger_path(&self) -> PathBuf {
        self.path().join("ledger.jsonl")
    }
}

/// `cryo sim driver --gpus GPUS --gpu-memory MEMORY` in `dir`, its output in `driver.log`, once
/// its socket accepts connections.
pub fn start_driver(dir: &Path, gpus: &str, gpu_memory: &str) -> Child {
    let log = fs::File::create(dir.join("driver.log")).unwrap();
    let driver = cryo()
        .args([
            "sim",
            "driver",
            "--gpus",
            gpus,
            "--gpu-memory",
            gpu_memory,
            "--dir",
        ])
        .arg(dir)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("cannot start cryo sim driver");
    let sock = dir.join("driver.sock");
    let deadline = Instant::now() + Duration::from_secs(10);
    while std::os::unix::net::UnixStream::connect(&sock).is_err() {
        assert!(
            Instant::now() < deadline,
            "cryo sim driver did not come up: {}",
            fs::read_to_string(dir.join("driver.log")).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    driver
}

/// The contents of a sim worker's ready file, once it is there.
pub fn wait_ready(ready: &Path, timeout: Duration) -> serde_json::Value {
    let deadline = Instant::now() + timeout;
    loop {
        if let Ok(t) = fs::read_to_string(ready) {
            return serde_json::from_str(&t).unwrap();
        }
        assert!(Instant::now() < deadline, "sim worker did not start");
        std::thread::sleep(Duration::from_millis(10));
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        for w in &mut self.workers {
            // Suspend before kill, as everything in cryo does.
            let pid = w.pid.to_string();
            let _ = self_compat(
                self.dir.path(),
                &["--action", "lock", "--pid", &pid, "--timeout", "5000"],
            );
            let _ = self_compat(self.dir.path(), &["--action", "checkpoint", "--pid", &pid]);
            let _ = w.child.kill();
            let _ = w.child.wait();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn self_compat(dir: &Path, args: &[&str]) -> Output {
    cryo()
        .args(["--gpu", "sim", "--sim-dir"])
        .arg(dir)
        .arg("cuda-checkpoint")
        .args(args)
        .output()
        .unwrap()
}

/// One HTTP request to a worker; returns (status, body).
pub fn http(port: u16, method: &str, path: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(s, "{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len()).unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    let (head, body) = out.split_once("\r\n\r\n").unwrap();
    (
        head.split_whitespace().nth(1).unwrap().parse().unwrap(),
        body.to_string(),
    )
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A process that is certainly not a CUDA process.
pub fn sleeper() -> Child {
    Command::new("sleep").arg("60").spawn().unwrap()
}
