//! `cryo bench freeze`: `cryo freeze`/`cryo thaw` against the same work done by hand with the
//! `criu` command line and one `cryo cuda-checkpoint` process per action, on a private simulated GPU.
//!
//! # Design
//! One run starts its own simulated driver (one GPU, room for one worker of the largest size) in
//! a temporary directory, and for each size measures two arms on fresh workers (one worker at a
//! time, images removed between arms, to bound memory and disk):
//! - **cryo**: `cryo freeze PID --image A`, then `cryo thaw A --health-url ...` (manifest,
//!   checksums, prechecks, health check included);
//! - **cli**: freeze = `cuda-checkpoint --action lock`, `--action checkpoint`, `criu dump`;
//!   thaw = `criu restore -d`, `cuda-checkpoint --action restore`, `--action unlock`, then the
//!   health endpoint polled until it answers.
//!
//! Freeze is timed from the first process started to the dump's exit; thaw from the first
//! process started to the first answered health request (for cryo also reported by cryo itself as
//! `first_answer_ms`). The run starts with one warm-up round of both arms at the smallest size,
//! not counted (it pays for the page cache of both binaries and CRIU's libraries and the first
//! touches of some guest memory; at the largest size it would add a minute to a default run);
//! then every size gets `--rounds` counted rounds, the arm that goes first alternating from round
//! to round (A B, B A, ...). Each cell is the median over the rounds with the min-max beside it;
//! ratios are ratios of medians. Every worker is stopped with `cryo stop`
//! and the wedge ledger must stay empty. The host's load average is printed at the start and end.
//!
//! # What the numbers mean, and limitations
//! Needs root and CRIU. Only ratios mean anything, and only where the min-max ranges of the two
//! arms do not overlap much. cryo does more than the CLI arm: it hashes and fsyncs the image and
//! verifies the checksums before restoring, which costs time proportional to the image; that is
//! the price of a crash-safe image, not overhead to hide. The simulated checkpoint is a memory
//! copy between two processes, bound on a small VM by faulting in fresh pages, so the suspend and
//! GPU-restore steps swing with the host; on a real GPU the driver's checkpoint dominates both
//! arms. Images go to the temporary directory (`--dir`): its disk speed is part of every number.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use serde::Serialize;

use cryo_proc::ProcHandle;
use cryo_state::StateDir;
use cryo_units::fmt_bytes;

use crate::args::BenchFreezeArgs;
use crate::measure::{a_first, load_average, load_line, Samples};
use crate::private_sim::{private_exe, DriverOptions, PrivateSim, WorkerOptions};

/// One row of the result: medians over the counted rounds (ms), and every sample.
#[derive(Debug, Serialize)]
struct Row {
    memory_bytes: u64,
    image_bytes: u64,
    rounds: usize,
    cryo_freeze_ms: f64,
    cli_freeze_ms: f64,
    /// cli / cryo (medians): above 1, cryo is faster.
    freeze_ratio: f64,
    cryo_thaw_ms: f64,
    cli_thaw_ms: f64,
    /// cli / cryo (medians): above 1, cryo is faster.
    thaw_ratio: f64,
    /// `cryo thaw`: from the request to the first answered health request, as cryo reports it.
    first_answer_ms: f64,
    /// `cryo freeze`'s own steps (medians): suspend, dump, publish (hash + fsync + rename), ms.
    cryo_freeze_steps: [f64; 3],
    /// `cryo thaw`'s own steps (medians): verify (checksums), CRIU restore, GPU restore + unlock.
    cryo_thaw_steps: [f64; 3],
    samples: RowSamples,
    load_before: [f64; 3],
    load_after: [f64; 3],
}

#[derive(Debug, Default, Serialize)]
struct RowSamples {
    cryo_freeze_ms: Samples,
    cli_freeze_ms: Samples,
    cryo_thaw_ms: Samples,
    cli_thaw_ms: Samples,
    first_answer_ms: Samples,
    cryo_freeze_steps: [Samples; 3],
    cryo_thaw_steps: [Samples; 3],
}

impl RowSamples {
    fn add(&mut self, cryo: &Arm, cli: &Arm) {
        self.cryo_freeze_ms.push(cryo.freeze_ms);
        self.cli_freeze_ms.push(cli.freeze_ms);
        self.cryo_thaw_ms.push(cryo.thaw_ms);
        self.cli_thaw_ms.push(cli.thaw_ms);
        self.first_answer_ms.push(cryo.first_answer_ms);
        for i in 0..3 {
            self.cryo_freeze_steps[i].push(cryo.freeze_steps[i]);
            self.cryo_thaw_steps[i].push(cryo.thaw_steps[i]);
        }
    }
}

/// Runs `cryo bench freeze` with the binary `cryo`.
pub fn run(args: &BenchFreezeArgs, cryo: &Path) -> anyhow::Result<()> {
    ensure!(!args.sizes.is_empty(), "--sizes needs at least one size");
    let criu = cryo_criu::CriuRpc::locate(None)?;
    // Thawed workers are children of the short-lived `cryo thaw` / `criu restore -d`: adopt them.
    rustix::process::set_child_subreaper(Some(rustix::process::getpid()))
        .context("becoming a child subreaper")?;
    let mut b = tempfile::Builder::new();
    b.prefix("cryo-bench-freeze-");
    let tmp = match &args.dir {
        Some(d) => b.tempdir_in(d),
        None => b.tempdir(),
    }
    .context("creating the benchmark's directory")?;
    let max = args.sizes.iter().copied().max().unwrap_or(0);
    let min = args.sizes.iter().copied().min().unwrap_or(0);
    let bench = Bench::start(tmp.path(), criu.path().to_path_buf(), max, cryo)?;
    let load_start = load_average();
    if !args.json {
        println!(
            "cryo freeze/thaw against criu + cuda-checkpoint processes (simulated GPU, {})",
            criu.path().display()
        );
        println!(
            "{} rounds per size after 1 warm-up round at {}, arm order alternating (ABBA), \
             fresh worker per arm; cells: median (min-max) ms",
            args.rounds,
            fmt_bytes(min)
        );
        println!("{}", load_line("start", load_start));
    }
    // Warm-up, not counted.
    bench.cryo_arm(min)?;
    bench.cli_arm(min)?;
    let mut rows = Vec::new();
    for size in &args.sizes {
        let load_before = load_average();
        let mut s = RowSamples::default();
        let mut image_bytes = 0;
        for round in 1..=args.rounds {
            let (cryo, cli) = if a_first(round) {
                let c = bench.cryo_arm(*size)?;
                (c, bench.cli_arm(*size)?)
            } else {
                let l = bench.cli_arm(*size)?;
                (bench.cryo_arm(*size)?, l)
            };
            image_bytes = cryo.image_bytes;
            s.add(&cryo, &cli);
        }
        let row = Row {
            memory_bytes: *size,
            image_bytes,
            rounds: args.rounds,
            cryo_freeze_ms: s.cryo_freeze_ms.median(),
            cli_freeze_ms: s.cli_freeze_ms.median(),
            freeze_ratio: s.cli_freeze_ms.median() / s.cryo_freeze_ms.median(),
            cryo_thaw_ms: s.cryo_thaw_ms.median(),
            cli_thaw_ms: s.cli_thaw_ms.median(),
            thaw_ratio: s.cli_thaw_ms.median() / s.cryo_thaw_ms.median(),
            first_answer_ms: s.first_answer_ms.median(),
            cryo_freeze_steps: s.cryo_freeze_steps.each_ref().map(Samples::median),
            cryo_thaw_steps: s.cryo_thaw_steps.each_ref().map(Samples::median),
            load_before,
            load_after: load_average(),
            samples: s,
        };
        if !args.json {
            print_row(&row);
        }
        rows.push(row);
        bench.ledger_empty()?;
    }
    if args.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
    } else {
        println!(
            "ratio = median cli / median cryo (above 1: cryo faster); cryo also hashes, fsyncs, \
             verifies and prechecks the image; wedge ledger empty"
        );
        println!("{}", load_line("end", load_average()));
    }
    Ok(())
}

fn print_row(row: &Row) {
    let s = &row.samples;
    println!(
        "{}: image {}",
        fmt_bytes(row.memory_bytes),
        fmt_bytes(row.image_bytes)
    );
    println!(
        "  freeze: cryo {:>20}  cli {:>20}  ratio {:.2}x",
        s.cryo_freeze_ms.cell(),
        s.cli_freeze_ms.cell(),
        row.freeze_ratio
    );
    println!(
        "  thaw:   cryo {:>20}  cli {:>20}  ratio {:.2}x",
        s.cryo_thaw_ms.cell(),
        s.cli_thaw_ms.cell(),
        row.thaw_ratio
    );
    println!(
        "  thaw request to first answered request (cryo): {}",
        s.first_answer_ms.cell()
    );
    let [sp, d, p] = row.cryo_freeze_steps;
    let [v, c, g] = row.cryo_thaw_steps;
    println!(
        "  cryo's steps (medians): freeze = suspend {sp:.0} + dump {d:.0} + publish {p:.0} ms; \
         thaw = verify {v:.0} + criu {c:.0} + GPU {g:.0} ms"
    );
}

struct Arm {
    freeze_steps: [f64; 3],
    thaw_steps: [f64; 3],
    freeze_ms: f64,
    thaw_ms: f64,
    first_answer_ms: f64,
    image_bytes: u64,
}

struct Bench {
    dir: PathBuf,
    exe: PathBuf,
    criu: PathBuf,
    sim: PrivateSim,
    started: std::cell::Cell<usize>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl Bench {
    fn start(dir: &Path, criu: PathBuf, max: u64, cryo: &Path) -> anyhow::Result<Bench> {
        // A private copy: CRIU refuses to restore a process whose executable changed on disk.
        let exe = private_exe(cryo, dir, "cryo", "cryo")?;
        let sim = PrivateSim::start(
            dir,
            &DriverOptions {
                exe: &exe,
                gpus: Some(1),
                gpu_memory: (max + (64 << 20)).to_string(),
                log: true,
            },
        )?;
        Ok(Bench {
            dir: dir.to_path_buf(),
            exe,
            criu,
            sim,
            started: std::cell::Cell::new(0),
        })
    }

    fn cryo(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.env("CRYO_GPU", "sim")
            .env("CRYO_SIM_DIR", &self.dir)
            .env("CRYO_STATE_DIR", self.dir.join("state"))
            .env("CRYO_CRIU", &self.criu)
            .env_remove("CRYO_FAILPOINT")
            .stdin(Stdio::null());
        c
    }

    fn run(&self, mut c: Command, what: &str) -> anyhow::Result<String> {
        let out = c
            .stderr(Stdio::piped())
            .stdout(Stdio::piped())
            .output()
            .with_context(|| format!("running {what}"))?;
        if !out.status.success() {
            bail!(
                "{what} failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// A worker in its own session serving on a unix socket; returns its child, pid and socket.
    fn worker(&self, memory: u64) -> anyhow::Result<(std::process::Child, i32, PathBuf)> {
        let k = self.started.get();
        self.started.set(k + 1);
        let sock = self.dir.join(format!("w{k}.sock"));
        let w = self.sim.spawn_worker(&WorkerOptions {
            exe: &self.exe,
            setsid: true,
            gpu: None,
            memory,
            http_unix: Some(&sock),
            ready: self.dir.join(format!("w{k}.ready")),
            log: None,
            timeout: Duration::from_secs(300),
        })?;
        Ok((w.child, w.pid, sock))
    }

    fn stop(&self, pid: i32) -> anyhow::Result<()> {
        let mut c = self.cryo();
        c.args(["stop", &pid.to_string()]);
        self.run(c, "cryo stop")?;
        reap(pid);
        Ok(())
    }

    fn cryo_arm(&self, memory: u64) -> anyhow::Result<Arm> {
        let (mut child, pid, sock) = self.worker(memory)?;
        let image = self.dir.join("cryo-img");
        let t = Instant::now();
        let mut c = self.cryo();
        c.args(["freeze", "--json", &pid.to_string(), "--image"])
            .arg(&image);
        let out = self.run(c, "cryo freeze")?;
        let freeze_ms = ms(t.elapsed());
        let f: serde_json::Value =
            serde_json::from_str(&out).context("parsing cryo freeze --json")?;
        let freeze_steps = steps(&f, ["suspend_ms", "dump_ms", "publish_ms"]);
        child.wait().context("reaping the frozen worker")?;
        let image_bytes = cryo_criu::image::dir_bytes(&image);

        let t = Instant::now();
        let mut c = self.cryo();
        c.arg("thaw").arg(&image).args([
            "--json",
            "--health-url",
            &format!("unix:{}:/health", sock.display()),
        ]);
        let out = self.run(c, "cryo thaw")?;
        let thaw_ms = ms(t.elapsed());
        let v: serde_json::Value =
            serde_json::from_str(&out).context("parsing cryo thaw --json")?;
        let first_answer_ms = v["first_answer_ms"].as_f64().unwrap_or(f64::NAN);
        let thaw_steps = steps(&v, ["verify_ms", "criu_ms", "gpu_restore_ms"]);
        self.stop(pid)?;
        fs::remove_dir_all(&image).context("removing the image")?;
        Ok(Arm {
            freeze_steps,
            thaw_steps,
            freeze_ms,
            thaw_ms,
            first_answer_ms,
            image_bytes,
        })
    }

    fn compat(&self, action: &str, pid: i32) -> anyhow::Result<()> {
        let mut c = self.cryo();
        c.args([
            "cuda-checkpoint",
            "--action",
            action,
            "--pid",
            &pid.to_string(),
        ]);
        if action == "lock" {
            c.args(["--timeout", "30000"]);
        }
        self.run(c, &format!("cuda-checkpoint --action {action}"))
            .map(|_| ())
    }

    fn criu_cmd(&self) -> Command {
        let mut c = Command::new(&self.criu);
        // A carried CRIU build brings its libraries beside it.
        if let Some(d) = self.criu.parent() {
            c.env("LD_LIBRARY_PATH", d);
        }
        c.stdin(Stdio::null());
        c
    }

    fn cli_arm(&self, memory: u64) -> anyhow::Result<Arm> {
        let (mut child, pid, sock) = self.worker(memory)?;
        let image = self.dir.join("cli-img");
        fs::create_dir(&image).context("creating the CLI arm's image directory")?;
        let t = Instant::now();
        self.compat("lock", pid)?;
        self.compat("checkpoint", pid)?;
        let mut c = self.criu_cmd();
        c.args(["dump", "-t", &pid.to_string(), "-D"])
            .arg(&image)
            .args(["-o", "dump.log"]);
        self.run(c, "criu dump")?;
        let freeze_ms = ms(t.elapsed());
        child.wait().context("reaping the frozen worker")?;

        let t = Instant::now();
        let mut c = self.criu_cmd();
        c.args(["restore", "-d", "-D"])
            .arg(&image)
            .args(["-o", "restore.log"]);
        self.run(c, "criu restore")?;
        self.compat("restore", pid)?;
        self.compat("unlock", pid)?;
        let deadline = Instant::now() + Duration::from_secs(60);
        let check = cryo_lifecycle::HealthCheck::Url(format!("unix:{}:/health", sock.display()));
        check
            .wait(deadline.saturating_duration_since(Instant::now()))
            .context("the CLI arm's worker never answered")?;
        let thaw_ms = ms(t.elapsed());
        let handle = ProcHandle::open(pid)?;
        cryo_lifecycle::record_restored(
            &StateDir::new(self.dir.join("state")),
            &handle,
            "cryo bench freeze (criu restore)",
        )
        .with_context(|| format!("journaling the restore of worker {pid}"))?;
        self.stop(pid)?;
        fs::remove_dir_all(&image).context("removing the image")?;
        Ok(Arm {
            freeze_steps: [f64::NAN; 3],
            thaw_steps: [f64::NAN; 3],
            freeze_ms,
            thaw_ms,
            first_answer_ms: thaw_ms,
            image_bytes: 0,
        })
    }

    fn ledger_empty(&self) -> anyhow::Result<()> {
        let ledger = fs::read_to_string(self.dir.join("ledger.jsonl")).unwrap_or_default();
        ensure!(
            ledger.trim().is_empty(),
            "the wedge ledger is not empty: {ledger}"
        );
        Ok(())
    }
}

fn reap(pid: i32) {
    let Some(p) = rustix::process::Pid::from_raw(pid) else {
        return;
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        match rustix::process::waitpid(Some(p), rustix::process::WaitOptions::NOHANG) {
            Ok(None) => std::thread::sleep(Duration::from_millis(10)),
            _ => return,
        }
    }
}

fn steps(v: &serde_json::Value, keys: [&str; 3]) -> [f64; 3] {
    keys.map(|k| v[k].as_f64().unwrap_or(f64::NAN))
}
