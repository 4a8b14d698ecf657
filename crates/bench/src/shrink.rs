//! `cryo bench shrink`: what asking the engine to shrink first saves, side by side in one run.
//!
//! # Design
//! A private simulated GPU and sim workers with `--weights` of weights and a `--kv-cache` (the
//! issue's shape: 1 GiB + 3 GiB). Each round starts fresh workers and measures, without and with
//! `--shrink vllm:1` (the arm that goes first alternates):
//! - **stop**: `cryo stop PID` wall time, and the device memory it checkpointed;
//! - **freeze** (root and CRIU): `cryo freeze` wall time and the image's size;
//! - **park+wake**, the warm path: `cryo park`, then the activation timed from the `cryo wake`
//!   request to the worker's first answer (with the shrink, its weights wait in the engine's own
//!   host copy, only a small device state goes through the driver, and the activation includes
//!   the engine's wake-up); that answer must equal its answer before the park.
//!
//! Rows print medians, min-max and the ratio without/with: above 1, the shrink saves.
//!
//! # Limitations
//! The simulated driver copies memory on the CPU: the real driver's checkpoint moves about
//! 2 GB/s on an H200, so on a GPU the time saved is close to the bytes saved; here memory-copy
//! speed and process start-up weigh more. The engine's own cost (vLLM offloading its weights to
//! pinned host memory) is the simulator's copy through its driver socket.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use serde::Serialize;

use cryo_units::fmt_bytes;

use crate::args::BenchShrinkArgs;
use crate::measure::{a_first, load_average, load_line, Samples};
use crate::private_sim::{private_exe, retire, DriverOptions, PrivateSim, WorkerOptions};

/// One arm pair's result.
#[derive(Debug, Default, Serialize)]
struct Row {
    arm: &'static str,
    /// Median ms without the shrink.
    whole_ms: f64,
    /// Median ms with it.
    shrunk_ms: f64,
    /// `whole_ms / shrunk_ms`: above 1, the shrink saves time.
    ratio: f64,
    /// Bytes moved (checkpointed, or the image), median, without and with.
    whole_bytes: u64,
    shrunk_bytes: u64,
    samples_whole_ms: Samples,
    samples_shrunk_ms: Samples,
}

struct Bench<'a> {
    sim: PrivateSim,
    dir: &'a Path,
    exe: PathBuf,
    cryo: &'a Path,
    weights: u64,
    kv: u64,
    n: usize,
}

/// A worker of the bench, serving on a unix socket.
struct W {
    child: std::process::Child,
    pid: cryo_proc::Pid,
    sock: PathBuf,
}

impl Bench<'_> {
    fn worker(&mut self) -> anyhow::Result<W> {
        self.n += 1;
        let sock = self.dir.join(format!("w{}.sock", self.n));
        let w = self.sim.spawn_worker(&WorkerOptions {
            exe: &self.exe,
            setsid: true,
            gpu: Some(0),
            memory: self.weights,
            kv_cache: self.kv,
            http_unix: Some(&sock),
            ready: self.dir.join(format!("w{}.ready", self.n)),
            log: Some(self.dir.join(format!("w{}.log", self.n))),
            timeout: Duration::from_secs(120),
        })?;
        Ok(W {
            child: w.child,
            pid: w.pid,
            sock,
        })
    }

    fn cryo(&self, args: &[&str]) -> anyhow::Result<(Output, f64)> {
        let t = Instant::now();
        let out = Command::new(self.cryo)
            .args(["--gpu", "sim", "--sim-dir"])
            .arg(self.sim_dir())
            .arg("--state-dir")
            .arg(self.dir.join("state"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("running cryo {}", args.join(" ")))?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ensure!(
            out.status.success(),
            "cryo {} failed ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        Ok((out, ms))
    }

    fn sim_dir(&self) -> PathBuf {
        self.dir.join("sim")
    }

    fn shrink_args(w: &W, shrink: bool) -> Vec<String> {
        if shrink {
            vec![
                "--shrink".into(),
                "vllm:1".into(),
                "--engine-url".into(),
                format!("unix:{}:/", w.sock.display()),
                "--shrink-timeout".into(),
                "60000".into(),
            ]
        } else {
            Vec::new()
        }
    }

    fn complete(w: &W) -> anyhow::Result<String> {
        let c = cryo_http::Client::new(
            cryo_http::Endpoint::Unix(w.sock.clone()),
            cryo_http::Timeouts::total(Duration::from_secs(60)),
        );
        let r = c.send("POST", "/v1/completions", Some(("text/plain", b"bench")))?;
        ensure!(r.status == 200, "the worker answered {}", r.status);
        Ok(r.text()?)
    }

    /// `cryo stop`: (ms, device bytes checkpointed).
    fn stop(&mut self, shrink: bool) -> anyhow::Result<(f64, u64)> {
        let mut w = self.worker()?;
        let mut args = vec!["stop".to_owned(), w.pid.to_string(), "--json".into()];
        args.extend(Self::shrink_args(&w, shrink));
        let r = self.cryo(&args.iter().map(String::as_str).collect::<Vec<_>>());
        let _ = w.child.wait();
        let (out, ms) = r?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        if shrink && v["shrink"]["released"]["outcome"] != "shrunk" {
            bail!("the engine did not shrink: {}", v["shrink"]);
        }
        let bytes = v["processes"]
            .as_array()
            .map(|ps| {
                ps.iter()
                    .filter_map(|p| p["suspended"]["device_memory"].as_u64())
                    .sum()
            })
            .unwrap_or(0);
        Ok((ms, bytes))
    }

    /// `cryo freeze`: (ms, image bytes).
    fn freeze(&mut self, shrink: bool) -> anyhow::Result<(f64, u64)> {
        let mut w = self.worker()?;
        let image = self.dir.join(format!("img{}", self.n));
        let mut args = vec![
            "freeze".to_owned(),
            w.pid.to_string(),
            "--image".into(),
            image.display().to_string(),
            "--json".into(),
        ];
        args.extend(Self::shrink_args(&w, shrink));
        let r = self.cryo(&args.iter().map(String::as_str).collect::<Vec<_>>());
        if r.is_err() {
            retire(None, w.pid, &mut w.child);
        }
        let _ = w.child.wait();
        let _ = std::fs::remove_dir_all(&image);
        let (out, ms) = r?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        Ok((ms, v["manifest"]["total_bytes"].as_u64().unwrap_or(0)))
    }

    /// `cryo park`, then `cryo wake` and the first answer: (activation ms, device bytes
    /// parked); the answer must survive.
    fn park_wake(&mut self, shrink: bool) -> anyhow::Result<(f64, u64)> {
        let mut w = self.worker()?;
        let r = self.park_wake_on(&w, shrink);
        let pid = w.pid.to_string();
        let stopped = self.cryo(&["stop", &pid]);
        if stopped.is_err() {
            retire(None, w.pid, &mut w.child);
        }
        let _ = w.child.wait();
        r
    }

    fn park_wake_on(&self, w: &W, shrink: bool) -> anyhow::Result<(f64, u64)> {
        let before = Self::complete(w)?;
        let pid = w.pid.to_string();
        let mut args = vec!["park".to_owned(), pid.clone(), "--json".into()];
        args.extend(Self::shrink_args(w, shrink));
        let (out, _) = self.cryo(&args.iter().map(String::as_str).collect::<Vec<_>>())?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)?;
        let bytes = v["parked"]
            .as_array()
            .map(|ps| ps.iter().filter_map(|p| p["device_bytes"].as_u64()).sum())
            .unwrap_or(0);
        let t = Instant::now();
        self.cryo(&["wake", &pid, "--json"])?;
        let after = Self::complete(w)?;
        let ms = t.elapsed().as_secs_f64() * 1e3;
        ensure!(
            after == before,
            "the worker answers differently after the wake"
        );
        Ok((ms, bytes))
    }
}

/// What an arm measures.
#[derive(Debug, Clone, Copy)]
enum Arm {
    Stop,
    Freeze,
    ParkWake,
}

impl Bench<'_> {
    fn arm(&mut self, arm: Arm, shrink: bool) -> anyhow::Result<(f64, u64)> {
        match arm {
            Arm::Stop => self.stop(shrink),
            Arm::Freeze => self.freeze(shrink),
            Arm::ParkWake => self.park_wake(shrink),
        }
    }
}

/// Runs `cryo bench shrink` with the binary `cryo`.
pub fn run(args: &BenchShrinkArgs, cryo: &Path) -> anyhow::Result<()> {
    let mut tb = tempfile::Builder::new();
    tb.prefix("cryo-bench-shrink-");
    let tmp = match &args.dir {
        Some(d) => tb.tempdir_in(d),
        None => tb.tempdir(),
    }
    .context("creating the benchmark's directory")?;
    let dir = tmp.path();
    std::fs::create_dir_all(dir.join("sim"))?;
    let exe = private_exe(cryo, dir, "cryo-worker", "the worker binary")?;
    let per = args.weights + args.kv_cache;
    let sim = PrivateSim::start(
        &dir.join("sim"),
        &DriverOptions {
            exe: &exe,
            gpus: Some(1),
            gpu_memory: (2 * per + (64 << 20)).to_string(),
            log: false,
        },
    )?;
    let mut b = Bench {
        sim,
        dir,
        exe: exe.clone(),
        cryo,
        weights: args.weights,
        kv: args.kv_cache,
        n: 0,
    };
    let freeze_ok =
        rustix::process::geteuid().is_root() && cryo_criu::CriuRpc::locate(None).is_ok();
    let load_before = load_average();
    println!(
        "cryo bench shrink: workers of {} weights + {} KV cache, --shrink vllm:1 against none, {} rounds after a warm-up (simulated GPU)",
        fmt_bytes(args.weights),
        fmt_bytes(args.kv_cache),
        args.rounds
    );
    println!("{}", load_line("start", load_before));
    let mut arms: Vec<(&'static str, Arm)> = vec![("stop", Arm::Stop)];
    if freeze_ok {
        arms.push(("freeze", Arm::Freeze));
    } else {
        println!("freeze arm NOT RUN: it needs root and CRIU (scripts/install-criu.sh)");
    }
    arms.push(("park+wake", Arm::ParkWake));
    let mut rows = Vec::new();
    for (name, arm) in arms {
        let mut row = Row {
            arm: name,
            ..Row::default()
        };
        let (mut wb, mut sb) = (Vec::new(), Vec::new());
        for round in 0..=args.rounds {
            let order = if a_first(round) {
                [false, true]
            } else {
                [true, false]
            };
            for shrink in order {
                let (ms, bytes) = b.arm(arm, shrink).with_context(|| {
                    format!(
                        "{name} {}",
                        if shrink { "with the shrink" } else { "whole" }
                    )
                })?;
                if round == 0 {
                    continue;
                }
                if shrink {
                    row.samples_shrunk_ms.push(ms);
                    sb.push(bytes);
                } else {
                    row.samples_whole_ms.push(ms);
                    wb.push(bytes);
                }
            }
        }
        row.whole_ms = row.samples_whole_ms.median();
        row.shrunk_ms = row.samples_shrunk_ms.median();
        row.ratio = row.whole_ms / row.shrunk_ms;
        row.whole_bytes = median(&mut wb);
        row.shrunk_bytes = median(&mut sb);
        rows.push(row);
    }
    let ledger = SimLedger::of(&b.sim_dir())?;
    drop(b);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "{:<10} {:>22} {:>22} {:>7} {:>12} {:>12}",
            "arm", "whole ms", "shrunk ms", "ratio", "whole", "shrunk"
        );
        for r in &rows {
            println!(
                "{:<10} {:>22} {:>22} {:>7.2} {:>12} {:>12}",
                r.arm,
                r.samples_whole_ms.cell(),
                r.samples_shrunk_ms.cell(),
                r.ratio,
                fmt_bytes(r.whole_bytes),
                fmt_bytes(r.shrunk_bytes)
            );
        }
        println!("(stop: time of `cryo stop`, device memory checkpointed; freeze: time of `cryo freeze`, image size; park+wake: activation, from `cryo wake` to the first answer, and device memory parked; ratio = whole ms / shrunk ms, above 1 the shrink is faster)");
    }
    println!("{}", load_line("end", load_average()));
    ensure!(
        ledger.0 == 0,
        "the simulated driver recorded {} wedges",
        ledger.0
    );
    Ok(())
}

fn median(v: &mut [u64]) -> u64 {
    v.sort_unstable();
    v.get(v.len() / 2).copied().unwrap_or(0)
}

/// Wedges in the driver's ledger.
struct SimLedger(usize);

impl SimLedger {
    fn of(dir: &Path) -> anyhow::Result<SimLedger> {
        Ok(SimLedger(cryo_sim::SimControl::new(dir).ledger()?.len()))
    }
}
