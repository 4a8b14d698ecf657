//! `cryo bench telemetry`: the journal's append latency with a syslog forwarder whose collector is
//! dead (connection refused), stalled (accepts, never reads) or live, against no forwarder at all,
//! in the same run.
//!
//! Each arm appends to a journal of its own (same file system), one record at a time as cryo
//! does (`flock`, one `write`, `fdatasync`), and times every append. The arms take turns in short
//! batches, the order alternating, so that slow spells of the disk or the host fall on every arm
//! alike; the table shows each arm's p50 and p99 over all its appends and their ratio to the
//! baseline's, plus the spread of the batch medians. The forwarder runs
//! in its own thread and reads the journal without a lock, so the claim is a ratio of 1 within
//! noise (on 2 shared cores the forwarder's thread competes for CPU with the writer).

use std::io::Read as _;
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use cryo_journal::{Event, ProcId};
use cryo_state::StateDir;
use cryo_telemetry::{ForwardConfig, Forwarder};
use serde::Serialize;

use crate::args::BenchTelemetryArgs;
use crate::measure::{a_first, load_average, load_line, Samples};

/// The arms, baseline first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
enum Arm {
    /// No forwarder.
    None,
    /// A forwarder whose collector refuses connections (retrying every 100 ms at most).
    Refused,
    /// A forwarder whose collector accepted and never reads (its writes block, then time out).
    Stalled,
    /// A forwarder sending every record to a collector that reads them.
    Live,
}

const ARMS: [Arm; 4] = [Arm::None, Arm::Refused, Arm::Stalled, Arm::Live];

impl Arm {
    fn label(self) -> &'static str {
        match self {
            Arm::None => "no forwarder (baseline)",
            Arm::Refused => "dead collector (refused)",
            Arm::Stalled => "dead collector (never reads)",
            Arm::Live => "live collector",
        }
    }
}

#[derive(Debug, Serialize)]
struct Row {
    arm: Arm,
    /// p50 of one append over every timed append, µs.
    p50_us: f64,
    /// p99 of one append over every timed append, µs.
    p99_us: f64,
    p50_ratio: f64,
    p99_ratio: f64,
    /// The median of each batch, µs: the spread over the run.
    batch_p50_us: Samples,
    /// Records the forwarder sent (resends included; 0 without one).
    sent: u64,
}

/// Collectors for the arms that need one, alive for the whole run.
struct Collectors {
    refused: String,
    stalled: String,
    live: String,
    _stalled: TcpListener,
}

impl Collectors {
    fn start() -> anyhow::Result<Collectors> {
        // A port nothing listens on: bound, noted, closed.
        let refused = TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string();
        // Accepts (the kernel does, from its backlog) and never reads.
        let stalled_l = TcpListener::bind("127.0.0.1:0")?;
        let stalled = stalled_l.local_addr()?.to_string();
        // Reads and drops everything, on a thread per connection.
        let live_l = TcpListener::bind("127.0.0.1:0")?;
        let live = live_l.local_addr()?.to_string();
        std::thread::Builder::new()
            .name("bench-collector".into())
            .spawn(move || {
                for conn in live_l.incoming().flatten() {
                    std::thread::spawn(move || {
                        let mut conn = conn;
                        let mut buf = [0u8; 65536];
                        while matches!(conn.read(&mut buf), Ok(n) if n > 0) {}
                    });
                }
            })?;
        Ok(Collectors {
            refused,
            stalled,
            live,
            _stalled: stalled_l,
        })
    }

    fn addr(&self, arm: Arm) -> Option<&str> {
        match arm {
            Arm::None => None,
            Arm::Refused => Some(&self.refused),
            Arm::Stalled => Some(&self.stalled),
            Arm::Live => Some(&self.live),
        }
    }
}

/// One arm: its own journal, and its forwarder (if any), alive for the whole run.
struct Bench {
    arm: Arm,
    journal: cryo_journal::Journal,
    forwarder: Option<Forwarder>,
    /// Every timed append, µs.
    us: Vec<f64>,
    /// Per-batch medians, µs (the spread shown in the table).
    batch_p50: Samples,
}

impl Bench {
    fn start(dir: &Path, arm: Arm, collectors: &Collectors) -> anyhow::Result<Bench> {
        let state = StateDir::new(dir);
        let journal = state.open_journal().context("opening the bench journal")?;
        let forwarder = match collectors.addr(arm) {
            Some(addr) => {
                let mut cfg = ForwardConfig::new(&state, addr);
                cfg.retry_max = Duration::from_millis(100);
                cfg.write_timeout = Duration::from_millis(500);
                let f = Forwarder::start(cfg).context("starting the forwarder")?;
                // Up (connected, or failing) before the timed appends.
                let deadline = Instant::now() + Duration::from_secs(5);
                while !f.status().connected
                    && f.status().last_error.is_none()
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(5));
                }
                Some(f)
            }
            None => None,
        };
        Ok(Bench {
            arm,
            journal,
            forwarder,
            us: Vec::new(),
            batch_p50: Samples::default(),
        })
    }

    /// `n` appends, each timed; `timed`: keep the times (not during the warm-up).
    fn batch(&mut self, n: usize, timed: bool) -> anyhow::Result<()> {
        let mut us = Vec::with_capacity(n);
        for i in 0..n {
            let event = Event::Checkpointed {
                pid: ProcId::new(i32::try_from(i).unwrap_or(i32::MAX), 1),
                ms: 1830,
                bytes: 5_800_000_000,
            };
            let t = Instant::now();
            self.journal.append(event).context("appending")?;
            us.push(t.elapsed().as_secs_f64() * 1e6);
        }
        if timed {
            self.batch_p50.push(percentile(&mut us.clone(), 0.50));
            self.us.extend(us);
        }
        Ok(())
    }

    /// Untimed: waits (at most 30 s) until a live collector has every record; what was sent.
    fn finish(&self, appended: u64) -> u64 {
        let Some(f) = &self.forwarder else { return 0 };
        if self.arm == Arm::Live {
            let deadline = Instant::now() + Duration::from_secs(30);
            while f.status().delivered_seq < appended && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
        f.status().sent_total
    }
}

/// The `p` quantile of `v` (nearest rank); NaN when empty.
fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    if v.is_empty() {
        return f64::NAN;
    }
    let i = ((v.len() - 1) as f64 * p).round() as usize;
    v[i.min(v.len() - 1)]
}

/// Runs the benchmark.
pub(crate) fn run(args: &BenchTelemetryArgs) -> anyhow::Result<()> {
    let load_start = load_average();
    let base = tempfile::Builder::new()
        .prefix("cryo-bench-telemetry-")
        .tempdir_in(args.dir.clone().unwrap_or_else(std::env::temp_dir))
        .context("creating the bench directory")?;
    let collectors = Collectors::start().context("starting the bench collectors")?;
    let mut benches = ARMS
        .iter()
        .enumerate()
        .map(|(i, &arm)| Bench::start(&base.path().join(format!("arm{i}")), arm, &collectors))
        .collect::<anyhow::Result<Vec<_>>>()?;
    // Short batches, the arm order alternating, so that the disk's and the host's slow spells
    // fall on every arm alike; batch 0 of each arm is a warm-up.
    let batches = args.appends.div_ceil(args.batch);
    for b in 0..=batches {
        let mut order: Vec<usize> = (0..benches.len()).collect();
        if !a_first(b) {
            order.reverse();
        }
        for i in order {
            benches[i].batch(args.batch, b > 0)?;
        }
    }
    let appended = u64::try_from((batches + 1) * args.batch).unwrap_or(u64::MAX);
    let mut pooled: Vec<(f64, f64)> = Vec::new();
    for b in &mut benches {
        let mut us = b.us.clone();
        pooled.push((percentile(&mut us, 0.50), percentile(&mut us, 0.99)));
    }
    let rows: Vec<Row> = benches
        .iter()
        .zip(&pooled)
        .map(|(b, &(p50, p99))| Row {
            arm: b.arm,
            p50_us: p50,
            p99_us: p99,
            p50_ratio: p50 / pooled[0].0,
            p99_ratio: p99 / pooled[0].1,
            batch_p50_us: b.batch_p50.clone(),
            sent: b.finish(appended),
        })
        .collect();
    drop(benches);
    let load_end = load_average();
    if args.json {
        let out = serde_json::json!({
            "appends": args.appends,
            "batch": args.batch,
            "rows": rows,
            "load_start": load_start,
            "load_end": load_end,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!(
        "journal append latency with a syslog forwarder: {} timed appends per arm (fdatasync each), in batches of {} alternating between the arms, after a warm-up batch",
        batches * args.batch, args.batch
    );
    println!(
        "{:<30} {:>8} {:>8} {:>7} {:>7} {:>26} {:>6}",
        "arm", "p50 µs", "p99 µs", "p50 x", "p99 x", "batch p50 µs median (range)", "sent"
    );
    for row in &rows {
        println!(
            "{:<30} {:>8.0} {:>8.0} {:>7.2} {:>7.2} {:>26} {:>6}",
            row.arm.label(),
            row.p50_us,
            row.p99_us,
            row.p50_ratio,
            row.p99_ratio,
            row.batch_p50_us.cell(),
            row.sent
        );
    }
    println!("(x: the arm's median over the baseline's, measured in this run)");
    println!("{}", load_line("start", load_start));
    println!("{}", load_line("end", load_end));
    Ok(())
}
