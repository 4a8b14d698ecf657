//! `cryo bench activate`: the time from a request arriving at a scaled-to-zero worker to its
//! answer, side by side in one run, on a private simulated GPU:
//! - **(a) park**: the worker was parked (`cryo park`); `cryo activate` holds its service
//!   address; the request (`GET /health` through the activator) wakes it (restore, guard,
//!   unlock) and is forwarded;
//! - **(c) thaw**: the worker was frozen (`cryo freeze`); `cryo thaw --health-url`, from the
//!   command's start to the first answered health request, image in the page cache;
//! - **(d) bare**: `criu restore -d` + `cuda-checkpoint --action restore` and `--action unlock`
//!   processes, then the health endpoint polled until it answers;
//! - **baseline**: the raw driver restore + unlock of the same worker, in-process, measured right
//!   after its arm (a).
//!
//! - **(b) standby**: the worker was frozen and a private agent (its own state directory) keeps
//!   one standby of the image ready (`cryo standby create`); `cryo standby claim --health-url`,
//!   from the command's start to its end (the claim waits for the first answered health
//!   request). The pool is removed before the claimed worker is stopped, so no refill runs
//!   during another arm.
//!
//! # What the numbers mean, and limitations
//! Needs root and CRIU. One warm-up round at the smallest size, then `--rounds` rounds per size;
//! medians with min-max, ratios of medians. On the simulated GPU a restore is a memory copy
//! between processes, so the baseline swings with the host's load; on a real GPU the driver's
//! restore dominates (a). Every worker is stopped with `cryo stop`; the wedge ledger must stay
//! empty.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{ensure, Context as _};
use serde::Serialize;

use cryo_units::fmt_bytes;

use cryo_state::StateDir;

use crate::args::BenchActivateArgs;
use crate::freeze::Bench;
use crate::measure::{load_average, load_line, HostMemory, Samples};
use crate::stop::PrivateAgent;

#[derive(Debug, Default, Serialize)]
struct Row {
    memory_bytes: u64,
    rounds: usize,
    /// (a) request to answer, woken from park through the activator, ms.
    park_ms: Samples,
    /// (b) `cryo standby claim` request to first answer, ms.
    standby_ms: Samples,
    /// (c) `cryo thaw` request to first answer, ms.
    thaw_ms: Samples,
    /// (d) the bare route, first process to first answer, ms.
    bare_ms: Samples,
    /// The raw driver restore + unlock, ms.
    raw_ms: Samples,
    /// `cryo park` itself (not on the request path), ms.
    parking_ms: Samples,
    /// (b) broken down: the claim's phases in the agent (in order), and the rest (the `cryo`
    /// command's start, the request and the answer over the agent's socket), ms.
    standby_phases: Vec<(String, Samples)>,
    /// The host's memory around the timed request of (a), (b) and the baseline: what the
    /// kernel did meanwhile (compaction and direct-reclaim stalls) and what was free before.
    host: Vec<(&'static str, HostDelta)>,
}

/// What the kernel's memory management did during one timed request.
#[derive(Debug, Clone, Default, Serialize)]
struct HostDelta {
    compact_stalls: Samples,
    reclaim_stalls: Samples,
    thp_fallbacks: Samples,
    available_mib: Samples,
    dirty_mib: Samples,
}

impl HostDelta {
    fn push(&mut self, before: HostMemory, after: HostMemory) {
        let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
        self.compact_stalls
            .push(d(before.compact_stall, after.compact_stall));
        self.reclaim_stalls
            .push(d(before.allocstall, after.allocstall));
        self.thp_fallbacks
            .push(d(before.thp_fault_fallback, after.thp_fault_fallback));
        self.available_mib.push(before.available_mib as f64);
        self.dirty_mib.push(before.dirty_mib as f64);
    }
}

fn host(row: &mut Row, arm: &'static str, before: HostMemory) {
    let after = HostMemory::now();
    match row.host.iter_mut().find(|(a, _)| *a == arm) {
        Some((_, d)) => d.push(before, after),
        None => {
            let mut d = HostDelta::default();
            d.push(before, after);
            row.host.push((arm, d));
        }
    }
}

/// Runs `cryo bench activate` with the binary `cryo`.
pub fn run(args: &BenchActivateArgs, cryo: &Path) -> anyhow::Result<()> {
    ensure!(!args.sizes.is_empty(), "--sizes needs at least one size");
    let criu = cryo_criu::CriuRpc::locate(None)?;
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("becoming a child subreaper")?;
    let mut b = tempfile::Builder::new();
    b.prefix("cryo-bench-activate-");
    let tmp = match &args.dir {
        Some(d) => b.tempdir_in(d),
        None => b.tempdir(),
    }
    .context("creating the benchmark's directory")?;
    let max = args.sizes.iter().copied().max().unwrap_or(0);
    let min = args.sizes.iter().copied().min().unwrap_or(0);
    let bench = Bench::start(tmp.path(), criu.path().to_path_buf(), max, cryo)?;
    let gpu = cryo_sim::connect(bench.dir()).context("connecting to the private simulated GPU")?;
    if !args.json {
        println!(
            "request to answer of a scaled-to-zero worker (simulated GPU, {}); {} rounds per size after 1 warm-up round; cells: median (min-max) ms",
            criu.path().display(),
            args.rounds
        );
        println!("{}", load_line("start", load_average()));
    }
    let exe = std::path::PathBuf::from(bench.cryo().get_program());
    let agent = PrivateAgent::start(
        &exe,
        bench.dir(),
        &StateDir::new(bench.dir().join("state-standby")),
    )?;
    let mut warm = Row::default();
    park_arm(&bench, &gpu, min, &mut warm)?;
    standby_arm(&bench, &agent, min, &mut warm)?;
    bench.cryo_arm(min)?;
    bench.bare_arm(min)?;
    let mut rows = Vec::new();
    for size in &args.sizes {
        let mut row = Row {
            memory_bytes: *size,
            rounds: args.rounds,
            ..Row::default()
        };
        for round in 0..args.rounds {
            // The order of the arms rotates from round to round.
            for k in 0..4 {
                match (round + k) % 4 {
                    0 => park_arm(&bench, &gpu, *size, &mut row)?,
                    3 => standby_arm(&bench, &agent, *size, &mut row)?,
                    // The thaw with the image in the page cache (`cryo bench freeze`'s moment 3).
                    1 => row.thaw_ms.push(bench.cryo_arm(*size)?.moments[3]),
                    _ => row.bare_ms.push(bench.bare_arm(*size)?.moments[3]),
                }
            }
        }
        bench.ledger_empty()?;
        if !args.json {
            print_row(&row);
        }
        rows.push(row);
    }
    agent.stop()?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("targets (issue 12): bare/park and bare/standby >= 3x; park/raw and standby/raw <= 1.2x; wedge ledger empty");
        println!("{}", load_line("end", load_average()));
    }
    Ok(())
}

fn print_row(r: &Row) {
    let (a, b, c, d, raw) = (
        r.park_ms.median(),
        r.standby_ms.median(),
        r.thaw_ms.median(),
        r.bare_ms.median(),
        r.raw_ms.median(),
    );
    println!("{}:", fmt_bytes(r.memory_bytes));
    println!("  (a) woken from park     {:>22}", r.park_ms.cell());
    println!("  (b) from standby        {:>22}", r.standby_ms.cell());
    println!("  (c) cryo thaw           {:>22}", r.thaw_ms.cell());
    println!("  (d) bare route          {:>22}", r.bare_ms.cell());
    println!("  raw restore + unlock    {:>22}", r.raw_ms.cell());
    println!(
        "  bare/park {:.2}x   thaw/park {:.2}x   park/raw {:.2}x   (cryo park itself: {} ms, off the request path)",
        d / a,
        c / a,
        a / raw,
        r.parking_ms.cell()
    );
    println!(
        "  bare/standby {:.2}x   thaw/standby {:.2}x   standby/raw {:.2}x   park/standby {:.2}x",
        d / b,
        c / b,
        b / raw,
        a / b
    );
    println!("  (b) broken down, median (min-max) ms:");
    for (name, s) in &r.standby_phases {
        println!("      {:<44} {:>20}", name, s.cell1());
    }
    println!("  host memory during the request: compaction stalls, direct-reclaim stalls, THP fallbacks; MemAvailable and dirty+writeback before (MiB), medians");
    for (arm, d) in &r.host {
        println!(
            "      {:<12} {:>6.0} {:>6.0} {:>6.0}   {:>7.0} {:>6.0}",
            arm,
            d.compact_stalls.median(),
            d.reclaim_stalls.median(),
            d.thp_fallbacks.median(),
            d.available_mib.median(),
            d.dirty_mib.median()
        );
    }
}

/// (b) on one fresh worker: frozen, one standby of it made ready by the private agent (not
/// timed), then `cryo standby claim` timed to its end (it waits for the health check).
fn standby_arm(
    bench: &Bench,
    agent: &PrivateAgent,
    memory: u64,
    row: &mut Row,
) -> anyhow::Result<()> {
    let (mut child, pid, sock) = bench.worker(memory)?;
    let image = bench.dir().join("standby-img");
    let mut c = bench.cryo();
    c.args(["freeze", &pid.to_string(), "--replace", "--image"])
        .arg(&image);
    bench.run(c, "cryo freeze")?;
    let _ = child.wait();
    let digest = cryo_criu::image::Image::open(&image)
        .context("opening the standby image")?
        .manifest()
        .manifest_sha256
        .clone();
    let client = agent.client();
    client
        .standby_create(&cryo_api::StandbyCreateRequest {
            image: image.clone(),
            count: 1,
            criu_timeout_s: None,
        })
        .context("cryo standby create")?;
    let start = Instant::now();
    loop {
        let list = client.standby_list().context("cryo standby list")?;
        let pool = list.pools.iter().find(|p| p.image == image);
        if pool.is_some_and(|p| p.ready.iter().any(|s| s.digest == digest)) {
            break;
        }
        ensure!(
            start.elapsed() < Duration::from_secs(300),
            "no standby ready within 300 s: {:?}",
            pool.and_then(|p| p.last_error.clone())
        );
        std::thread::sleep(Duration::from_millis(20));
    }

    let mut c = bench.cryo();
    c.env("CRYO_STATE_DIR", bench.dir().join("state-standby"))
        .args(["standby", "claim", "--json", "--image"])
        .arg(&image)
        .arg("--health-url")
        .arg(format!("unix:{}:/health", sock.display()));
    let mem = HostMemory::now();
    let t = Instant::now();
    let out = bench.run(c, "cryo standby claim")?;
    let total = ms(t.elapsed());
    host(row, "(b) standby", mem);
    row.standby_ms.push(total);
    let v: serde_json::Value =
        serde_json::from_str(&out).context("parsing cryo standby claim --json")?;
    let phases: cryo_lifecycle::Phases =
        serde_json::from_value(v["wake"]["phases"].clone()).unwrap_or_default();
    let in_agent = v["elapsed_ms"].as_f64().unwrap_or(f64::NAN);
    let outside = (
        "the cryo command, the socket round trip".to_string(),
        total - in_agent,
    );
    for (name, ms) in phases.0.into_iter().chain([outside]) {
        match row.standby_phases.iter_mut().find(|(n, _)| *n == name) {
            Some((_, s)) => s.push(ms),
            None => row.standby_phases.push((name, Samples(vec![ms]))),
        }
    }
    let root = v["standby"]["root"]["pid"]
        .as_i64()
        .and_then(|p| i32::try_from(p).ok())
        .context("no root pid in the claim's answer")?;
    client
        .standby_remove(&cryo_api::StandbyRemoveRequest { image })
        .context("cryo standby remove")?;
    let mut c = bench.cryo();
    c.env("CRYO_STATE_DIR", bench.dir().join("state-standby"))
        .args(["stop", &root.to_string()]);
    bench.run(c, "cryo stop (the claimed standby)")?;
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// (a) and the baseline on one fresh worker.
fn park_arm(bench: &Bench, gpu: &cryo_gpu::Gpu, memory: u64, row: &mut Row) -> anyhow::Result<()> {
    let (mut child, pid, sock) = bench.worker(memory)?;
    let t = Instant::now();
    let mut c = bench.cryo();
    c.args(["park", &pid.to_string()]);
    bench.run(c, "cryo park")?;
    row.parking_ms.push(ms(t.elapsed()));

    let svc = bench.dir().join(format!("svc-{pid}.sock"));
    let mut c = bench.cryo();
    c.args([
        "activate",
        &pid.to_string(),
        "--idle-timeout",
        "0",
        "--listen",
    ])
    .arg(format!("unix:{}", svc.display()))
    .arg("--upstream")
    .arg(format!("unix:{}", sock.display()))
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    let mut activator = c.spawn().context("starting cryo activate")?;
    let mut line = String::new();
    if let Some(out) = activator.stdout.take() {
        BufReader::new(out)
            .read_line(&mut line)
            .context("reading cryo activate's first line")?;
    }
    ensure!(
        line.contains("listening"),
        "cryo activate did not start: {line:?}"
    );
    let mem = HostMemory::now();
    let t = Instant::now();
    let answered = cryo_lifecycle::HealthCheck::Url(format!("unix:{}:/health", svc.display()))
        .wait(Duration::from_secs(120));
    let took = ms(t.elapsed());
    host(row, "(a) park", mem);
    let _ = activator.kill();
    let _ = activator.wait();
    answered.context("no answer through the activator")?;
    row.park_ms.push(took);

    // The baseline: the raw driver restore + unlock of the same worker.
    gpu.driver
        .lock(pid, Some(Duration::from_secs(30)))
        .context("lock for the baseline")?;
    gpu.driver
        .checkpoint(pid)
        .context("checkpoint for the baseline")?;
    let mem = HostMemory::now();
    let t = Instant::now();
    gpu.driver
        .restore(pid, &[])
        .context("restore for the baseline")?;
    gpu.driver.unlock(pid).context("unlock for the baseline")?;
    row.raw_ms.push(ms(t.elapsed()));
    host(row, "raw", mem);
    bench.stop(pid)?;
    let _ = child.wait();
    Ok(())
}
