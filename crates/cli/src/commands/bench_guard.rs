//! `cryo bench guard`: what the guard costs a worker, and how fast it turns a fatal signal into a
//! suspension, on a private simulated GPU (loopback HTTP).
//!
//! # Design
//! 1. One restored sim worker serves completions; blocks of requests alternate between unguarded
//!    and guarded (attach/detach between blocks), so both sides see the same machine state; p50
//!    and p99 of each side and their ratio are printed.
//! 2. For each round, a fresh restored worker is guarded and sent SIGTERM; the time from the
//!    signal to the worker having exited with its context suspended (journal `Verified`, NVML
//!    empty) is set against a bare suspension (`cryo_lifecycle::suspend`) of another fresh
//!    restored worker of the same size.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use cryo_guard::{Guard, GuardConfig};
use cryo_journal::Event;
use cryo_lifecycle::{NoProgress, SuspendOptions};
use cryo_proc::ProcHandle;

use crate::args::guard::BenchGuardArgs;

const BLOCKS: usize = 10;

struct Sim {
    dir: PathBuf,
    driver: Child,
    workers: Vec<(i32, Child)>,
}

impl Sim {
    fn start(dir: &Path) -> anyhow::Result<Sim> {
        let exe = std::env::current_exe().context("finding the cryo binary")?;
        let driver = Command::new(&exe)
            .args([
                "sim",
                "driver",
                "--gpus",
                "1",
                "--gpu-memory",
                "64GiB",
                "--dir",
            ])
            .arg(dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting the simulated driver")?;
        let sim = Sim {
            dir: dir.to_path_buf(),
            driver,
            workers: Vec::new(),
        };
        cryo_sim::SimControl::new(dir)
            .wait_up(Duration::from_secs(10))
            .context("waiting for the simulated driver")?;
        Ok(sim)
    }

    /// A sim worker made "restored" (checkpointed and restored through the driver); pid and port.
    fn restored_worker(&mut self, gpu: &cryo_gpu::Gpu, memory: u64) -> anyhow::Result<(i32, u16)> {
        let exe = std::env::current_exe().context("finding the cryo binary")?;
        let n = self.workers.len();
        let ready = self.dir.join(format!("w{n}.ready"));
        let child = Command::new(&exe)
            .args(["sim", "worker", "--memory", &memory.to_string(), "--dir"])
            .arg(&self.dir)
            .arg("--ready-file")
            .arg(&ready)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("starting a sim worker")?;
        let pid = i32::try_from(child.id()).context("pid")?;
        self.workers.push((pid, child));
        let deadline = Instant::now() + Duration::from_secs(60);
        let info: serde_json::Value = loop {
            if let Ok(t) = std::fs::read_to_string(&ready) {
                break serde_json::from_str(&t).context("reading the worker's ready file")?;
            }
            if Instant::now() > deadline {
                bail!("the sim worker did not start");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let port = info["port"]
            .as_u64()
            .and_then(|p| u16::try_from(p).ok())
            .context("no port in the ready file")?;
        gpu.driver.lock(pid, Some(Duration::from_secs(10)))?;
        gpu.driver.checkpoint(pid)?;
        gpu.driver.restore(pid, &[])?;
        gpu.driver.unlock(pid)?;
        Ok((pid, port))
    }
}

impl Drop for Sim {
    fn drop(&mut self) {
        // Everything here is on a private driver that dies with the bench; suspended or not,
        // nothing touches a real GPU.
        for (_, c) in &mut self.workers {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}

fn request(port: u16, prompt: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let mut s = TcpStream::connect(("127.0.0.1", port))?;
    write!(s, "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{prompt}", prompt.len())?;
    let mut out = Vec::new();
    s.read_to_end(&mut out)?;
    if !out.starts_with(b"HTTP/1.1 200") {
        bail!("the worker answered {}", String::from_utf8_lossy(&out));
    }
    Ok(t.elapsed())
}

fn pct(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i.min(sorted.len() - 1)]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// `cryo bench guard`.
pub fn run(a: &BenchGuardArgs) -> anyhow::Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("cryo-bench-guard-")
        .tempdir()?;
    let sim_dir = tmp.path().join("sim");
    let state = tmp.path().join("state");
    let mut sim = Sim::start(&sim_dir)?;
    let gpu = cryo_sim::connect(&sim_dir)?;
    let mut cfg = GuardConfig::new(&state);
    cfg.memory = None;
    let (guard, _) = Guard::start(gpu.clone(), cfg).context("starting the guard")?;

    // 1. Latency, guarded and not, in alternating blocks.
    let (pid, port) = sim.restored_worker(&gpu, a.memory.0)?;
    let per_block = (a.requests / BLOCKS).max(1);
    let (mut bare, mut guarded) = (Vec::new(), Vec::new());
    for _ in 0..per_block.min(50) {
        request(port, "warm up")?;
    }
    for b in 0..BLOCKS * 2 {
        let on = b % 2 == 1;
        if on {
            guard.attach_pid(pid).context("attaching")?;
        }
        for i in 0..per_block {
            let d = request(port, &format!("prompt {b} {i}"))?;
            if on {
                guarded.push(d)
            } else {
                bare.push(d)
            }
        }
        if on {
            guard.detach(pid).context("detaching")?;
        }
    }
    bare.sort_unstable();
    guarded.sort_unstable();
    let (b50, b99, g50, g99) = (
        pct(&bare, 0.5),
        pct(&bare, 0.99),
        pct(&guarded, 0.5),
        pct(&guarded, 0.99),
    );
    println!(
        "request latency over loopback, {} requests each side, {BLOCKS} alternating blocks:",
        bare.len()
    );
    println!(
        "  unguarded: p50 {:>8.1} us  p99 {:>8.1} us",
        us(b50),
        us(b99)
    );
    println!(
        "  guarded:   p50 {:>8.1} us  p99 {:>8.1} us",
        us(g50),
        us(g99)
    );
    println!(
        "  ratio guarded/unguarded: p50 {:.3}  p99 {:.3}",
        us(g50) / us(b50).max(1e-9),
        us(g99) / us(b99).max(1e-9)
    );

    // Suspended before the bench ends, so that killing it is safe.
    let h = ProcHandle::open(pid)?;
    if cryo_lifecycle::suspend(&gpu, &[&h], &SuspendOptions::default(), None, &NoProgress)
        .iter()
        .any(|o| o.result.is_err())
    {
        bail!("cannot suspend the latency worker");
    }

    // 2. Fatal signal to suspended, against a bare suspension.
    let journal_dir = state.join("journal");
    let mut via_guard = Vec::new();
    let mut bare_suspend = Vec::new();
    for _ in 0..a.rounds {
        let (p, _) = sim.restored_worker(&gpu, a.memory.0)?;
        let h = ProcHandle::open(p)?;
        let t = Instant::now();
        let outcome =
            cryo_lifecycle::suspend(&gpu, &[&h], &SuspendOptions::default(), None, &NoProgress);
        if outcome.iter().any(|o| o.result.is_err()) {
            bail!("bare suspension failed: {outcome:?}");
        }
        bare_suspend.push(t.elapsed());

        let (p, _) = sim.restored_worker(&gpu, a.memory.0)?;
        let id = guard.attach_pid(p)?;
        let h = ProcHandle::open(p)?;
        let t = Instant::now();
        h.signal(rustix::process::Signal::Term)?;
        if !h.wait_exit(Duration::from_secs(60)) {
            bail!("pid {p} did not die of SIGTERM under the guard");
        }
        let died = t.elapsed();
        let recs = cryo_journal::read(&journal_dir)?.records;
        if !recs
            .iter()
            .any(|r| matches!(&r.event, Event::Verified { pid } if *pid == id))
        {
            bail!("pid {p} died without a verified suspension: the guard's path failed");
        }
        via_guard.push(died);
    }
    let mean =
        |v: &[Duration]| v.iter().sum::<Duration>() / u32::try_from(v.len().max(1)).unwrap_or(1);
    println!(
        "fatal signal (SIGTERM) to dead-with-context-suspended, {} rounds, {} of device memory:",
        a.rounds,
        crate::args::ByteSize(a.memory.0)
    );
    println!(
        "  via the guard:    mean {:>8.2} ms",
        mean(&via_guard).as_secs_f64() * 1e3
    );
    println!(
        "  bare suspension:  mean {:>8.2} ms",
        mean(&bare_suspend).as_secs_f64() * 1e3
    );
    println!(
        "  ratio guard/bare: {:.3}",
        mean(&via_guard).as_secs_f64() / mean(&bare_suspend).as_secs_f64().max(1e-9)
    );
    let wedges = cryo_sim::SimControl::new(&sim_dir).ledger()?;
    if !wedges.is_empty() {
        bail!("the wedge ledger is not empty: {wedges:?}");
    }
    guard.shutdown();
    drop(guard);
    drop(sim);
    Ok(())
}
