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
//! (b), activation from a pre-thawed standby, is not built yet and has no column.
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

use crate::args::BenchActivateArgs;
use crate::freeze::Bench;
use crate::measure::{load_average, load_line, Samples};

#[derive(Debug, Default, Serialize)]
struct Row {
    memory_bytes: u64,
    rounds: usize,
    /// (a) request to answer, woken from park through the activator, ms.
    park_ms: Samples,
    /// (c) `cryo thaw` request to first answer, ms.
    thaw_ms: Samples,
    /// (d) the bare route, first process to first answer, ms.
    bare_ms: Samples,
    /// The raw driver restore + unlock, ms.
    raw_ms: Samples,
    /// `cryo park` itself (not on the request path), ms.
    parking_ms: Samples,
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
    let mut warm = Row::default();
    park_arm(&bench, &gpu, min, &mut warm)?;
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
            for k in 0..3 {
                match (round + k) % 3 {
                    0 => park_arm(&bench, &gpu, *size, &mut row)?,
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
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!("targets (issue 12): bare/park >= 3x; park/raw <= 1.2x; wedge ledger empty");
        println!("{}", load_line("end", load_average()));
    }
    Ok(())
}

fn print_row(r: &Row) {
    let (a, c, d, raw) = (
        r.park_ms.median(),
        r.thaw_ms.median(),
        r.bare_ms.median(),
        r.raw_ms.median(),
    );
    println!("{}:", fmt_bytes(r.memory_bytes));
    println!("  (a) woken from park     {:>22}", r.park_ms.cell());
    println!("  (b) from standby        not built yet");
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
    let t = Instant::now();
    let answered = cryo_lifecycle::HealthCheck::Url(format!("unix:{}:/health", svc.display()))
        .wait(Duration::from_secs(120));
    let took = ms(t.elapsed());
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
    let t = Instant::now();
    gpu.driver
        .restore(pid, &[])
        .context("restore for the baseline")?;
    gpu.driver.unlock(pid).context("unlock for the baseline")?;
    row.raw_ms.push(ms(t.elapsed()));
    bench.stop(pid)?;
    let _ = child.wait();
    Ok(())
}
