//! `cryo bench stop`: `cryo stop` against the procedure it replaces, on a private simulated GPU,
//! and the measurement helpers the three benchmarks share (rounds, medians, load average).
//!
//! # Design
//! One run starts its own simulated driver (a child `cryo sim driver` in a temporary directory)
//! and, for 1, 2 and 4 workers, measures two arms on fresh sets of workers, each worker first
//! taken through lock, checkpoint, restore and unlock through the GPU API so that it is a
//! *restored* worker (the simulated driver records a wedge if one is torn down live):
//! - **cryo stop**: the `cryo stop PID...` binary, as an operator or a preStop hook runs it;
//! - **procedure**: the operators' hook, one `cryo cuda-checkpoint` process per action per pid,
//!   serially (`--action lock --timeout 30000`, then `--action checkpoint`), then the process
//!   listing (`cryo gpu ps --json`, as `nvidia-smi` is read) polled once a second until no pid
//!   is listed, then SIGKILL.
//!
//! Both arms are timed from the first process started to the last worker reaped. Each row runs
//! one warm-up round (both arms, not counted: it pays for first touches of guest memory, page
//! cache and the like), then `--rounds` counted rounds; the arm that goes first alternates from
//! round to round (A B, B A, A B...), and every arm gets fresh workers. A row prints each arm's
//! median and min-max over the counted rounds and the ratio of the medians. The wedge ledger must
//! stay empty after every arm, or the benchmark fails. The host's load average is printed at the
//! start and the end so a reader can judge how noisy the host was.
//!
//! # What the numbers mean, and limitations
//! Only ratios mean anything: absolute times depend on the host. The simulated driver runs on the
//! CPU: its checkpoint is a memory copy between two processes, far faster per byte than the real
//! driver's, so exec and polling costs weigh more here than on a GPU, where the driver's own
//! checkpoint time dominates both arms (`gpu-facts.md`: one process gains little, a tree gains by
//! parallelism). On a small VM the copy is bound by faulting in fresh pages, whose cost swings
//! with the host (the simulated driver and worker already ask for transparent huge pages, as the
//! real driver's fast path does, and get them; what remains is the VM's own first touch of guest
//! memory, which the warm-up round pays for in part): a min-max range wider than the gap between
//! the medians means the run cannot tell the arms apart. With three rounds the median is the
//! middle sample, not a distribution.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use cryo_gpu::Gpu;
use cryo_proc::Pid;
use cryo_sim::SimControl;
use serde::Serialize;

use cryo_proc::ProcHandle;
use cryo_state::StateDir;
use cryo_units::fmt_bytes;

use crate::args::BenchStopArgs;
use crate::measure::{ab_rounds, load_average, load_line, Samples};
use crate::private_sim::{retire, DriverOptions, PrivateSim, WorkerOptions};

/// One row of a two-arm table (`cryo bench stop`, `cryo bench agent`): medians over the counted
/// rounds, and every sample. In JSON each arm is named `NAME_ms` (its median, and its samples
/// under `samples`), fields in this order.
#[derive(Debug)]
struct Row {
    /// The arms' names: `cryo_stop` and `procedure`, `standalone` and `agent`.
    names: [&'static str; 2],
    workers: usize,
    memory_bytes: u64,
    rounds: usize,
    samples: [Samples; 2],
    /// The host's load average before and after the row.
    load_before: [f64; 3],
    load_after: [f64; 3],
}

impl Row {
    /// The second arm's median over the first's.
    fn ratio(&self) -> f64 {
        self.samples[1].median() / self.samples[0].median()
    }
}

impl Serialize for Row {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let names = self.names.map(|n| format!("{n}_ms"));
        let arms = Arms(&names, &self.samples);
        let mut m = s.serialize_map(Some(9))?;
        m.serialize_entry("workers", &self.workers)?;
        m.serialize_entry("memory_bytes", &self.memory_bytes)?;
        m.serialize_entry("rounds", &self.rounds)?;
        for (name, samples) in names.iter().zip(&self.samples) {
            m.serialize_entry(name, &samples.median())?;
        }
        m.serialize_entry("ratio", &self.ratio())?;
        m.serialize_entry("samples", &arms)?;
        m.serialize_entry("load_before", &self.load_before)?;
        m.serialize_entry("load_after", &self.load_after)?;
        m.end()
    }
}

/// Each arm's samples under its name, in the arms' order.
struct Arms<'a>(&'a [String; 2], &'a [Samples; 2]);

impl Serialize for Arms<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(2))?;
        for (name, samples) in self.0.iter().zip(self.1) {
            m.serialize_entry(name, samples)?;
        }
        m.end()
    }
}

/// What a two-arm table says: its first line, the arms' names (JSON) and column heads, and the
/// line that says what the ratio means.
struct Table {
    title: String,
    names: [&'static str; 2],
    heads: [&'static str; 2],
    ratio: &'static str,
}

impl Table {
    /// For 1, 2 and 4 workers, the arms' rounds ([`ab_rounds`]: `arm(workers, k)` runs arm `k`
    /// once), one row each; printed as a table, or as JSON with `--json`.
    fn run(
        &self,
        args: &BenchStopArgs,
        mut arm: impl FnMut(usize, usize) -> anyhow::Result<f64>,
    ) -> anyhow::Result<()> {
        if !args.json {
            println!("{}", self.title);
            println!("{}", load_line("start", load_average()));
            println!(
                "{:>7}  {:>24}  {:>24}  {:>6}",
                "workers", self.heads[0], self.heads[1], "ratio"
            );
        }
        let mut rows = Vec::new();
        for n in [1usize, 2, 4] {
            let load_before = load_average();
            let samples = ab_rounds(args.rounds, |k| arm(n, k))?;
            let row = Row {
                names: self.names,
                workers: n,
                memory_bytes: args.memory,
                rounds: args.rounds,
                samples,
                load_before,
                load_after: load_average(),
            };
            if !args.json {
                println!(
                    "{:>7}  {:>24}  {:>24}  {:>5.2}x",
                    row.workers,
                    row.samples[0].cell1(),
                    row.samples[1].cell1(),
                    row.ratio()
                );
            }
            rows.push(row);
        }
        if args.json {
            println!("{}", serde_json::to_string_pretty(&rows)?);
        } else {
            println!("{}", self.ratio);
            println!("{}", load_line("end", load_average()));
        }
        Ok(())
    }
}

/// Runs `cryo bench stop` with the binary `cryo`.
pub fn run(args: &BenchStopArgs, cryo: &Path) -> anyhow::Result<()> {
    let memory = args.memory;
    ensure!(memory > 0, "--memory must be more than 0 bytes");
    let tmp = tempfile::Builder::new()
        .prefix("cryo-bench-")
        .tempdir()
        .context("creating the benchmark's directory")?;
    let mut bench = Bench::start(tmp.path(), memory, cryo)?;
    Table {
        title: format!(
            "cryo bench stop: restored workers of {} device memory each, simulated GPU; \
             {} rounds per row after 1 warm-up, arm order alternating (ABBA), fresh workers per arm",
            fmt_bytes(memory),
            args.rounds
        ),
        names: ["cryo_stop", "procedure"],
        heads: ["cryo stop ms (min-max)", "procedure ms (min-max)"],
        ratio: "ratio = median procedure / median cryo stop (above 1: cryo stop faster); \
             wedge ledger empty after every arm",
    }
    .run(args, |n, arm| {
        bench.restored_workers(n)?;
        let took = if arm == 0 {
            bench.cryo_stop()?
        } else {
            bench.procedure()?
        };
        bench.ledger_empty()?;
        Ok(took)
    })
}

/// Runs `cryo bench agent` with the binary `cryo`: the same `cryo stop PID...` command line,
/// standalone (a state directory no agent serves) and through a private agent (its state
/// directory), on fresh restored workers per arm, rounds alternating as `cryo bench stop`'s.
/// Through the agent the workers are guarded (its guard traces them) before the clock starts,
/// as on a node that runs the agent; standalone nothing traces them.
pub fn run_agent(args: &BenchStopArgs, cryo: &Path) -> anyhow::Result<()> {
    let memory = args.memory;
    ensure!(memory > 0, "--memory must be more than 0 bytes");
    let tmp = tempfile::Builder::new()
        .prefix("cryo-bench-agent-")
        .tempdir()
        .context("creating the benchmark's directory")?;
    let mut bench = Bench::start(tmp.path(), memory, cryo)?;
    let standalone = StateDir::new(tmp.path().join("state-standalone"));
    let agent_state = bench.state.clone();
    let agent = PrivateAgent::start(&bench.exe, &bench.dir, &agent_state)?;
    Table {
        title: format!(
            "cryo bench agent: `cryo stop` of restored workers of {} device memory each, through the agent and standalone, simulated GPU; \
             {} rounds per row after 1 warm-up, arm order alternating (ABBA), fresh workers per arm",
            fmt_bytes(memory),
            args.rounds
        ),
        names: ["standalone", "agent"],
        heads: ["standalone ms (min-max)", "agent ms (min-max)"],
        ratio: "ratio = median through the agent / median standalone (above 1: the agent costs time); \
             wedge ledger empty after every arm",
    }
    .run(args, |n, arm| {
        bench.state = if arm == 0 {
            standalone.clone()
        } else {
            agent_state.clone()
        };
        bench.restored_workers(n)?;
        if arm == 1 {
            // Steady state: the agent guards what it would stop, as on a node.
            let pids: Vec<Pid> = bench.live.iter().map(|w| w.pid).collect();
            agent.wait_guarded(&pids)?;
        }
        let took = bench.cryo_stop()?;
        bench.ledger_empty()?;
        Ok(took)
    })?;
    agent.stop()
}

/// A `cryo agent run` of the benchmark's own (no TCP listener, no scan; no memory watch unless
/// asked); killed on drop if it was not stopped.
pub(crate) struct PrivateAgent {
    child: Child,
    client: cryo_api::AgentClient,
    state: StateDir,
}

impl PrivateAgent {
    /// `exe agent run` on the simulated driver in `dir` (its log there too), state in `state`.
    pub(crate) fn start(exe: &Path, dir: &Path, state: &StateDir) -> anyhow::Result<PrivateAgent> {
        Self::start_with(exe, dir, state, &["--no-memory-watch"])
    }

    /// As [`PrivateAgent::start`], with the memory watch as deployed (on, its default
    /// interval): `extra` are more arguments of `agent run`.
    pub(crate) fn start_with(
        exe: &Path,
        dir: &Path,
        state: &StateDir,
        extra: &[&str],
    ) -> anyhow::Result<PrivateAgent> {
        std::fs::create_dir_all(state.root()).context("creating the agent's state directory")?;
        let log =
            std::fs::File::create(dir.join("agent.log")).context("creating the agent's log")?;
        let mut child = Command::new(exe)
            .args(["--gpu", "sim", "--sim-dir"])
            .arg(dir)
            .arg("--state-dir")
            .arg(state.root())
            .args(["agent", "run", "--no-metrics-listen", "--scan", "none"])
            .args(extra)
            .env_remove(cryo_api::SOCKET_ENV)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting cryo agent run")?;
        let client = cryo_api::AgentClient::new(state.agent_socket());
        let start = Instant::now();
        while client.status().is_err() {
            if let Some(st) = child.try_wait()? {
                bail!(
                    "the agent exited ({st}); see {}",
                    dir.join("agent.log").display()
                );
            }
            ensure!(
                start.elapsed() < Duration::from_secs(60),
                "the agent did not answer within 60 s"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(PrivateAgent {
            child,
            client,
            state: state.clone(),
        })
    }

    /// Waits until the agent's guard traces every one of `pids`.
    fn wait_guarded(&self, pids: &[Pid]) -> anyhow::Result<()> {
        let start = Instant::now();
        loop {
            let st = self.client.status().context("asking the agent")?;
            if pids
                .iter()
                .all(|p| st.guard.guarded.iter().any(|g| g.pid == *p))
            {
                return Ok(());
            }
            ensure!(
                start.elapsed() < Duration::from_secs(60),
                "the agent's guard did not attach to {pids:?} within 60 s"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Its pid.
    pub(crate) fn pid(&self) -> Pid {
        Pid::try_from(self.child.id()).unwrap_or(0)
    }

    /// Its client.
    pub(crate) fn client(&self) -> &cryo_api::AgentClient {
        &self.client
    }

    pub(crate) fn stop(mut self) -> anyhow::Result<()> {
        self.client.shutdown().context("stopping the agent")?;
        let st = self.child.wait().context("reaping the agent")?;
        ensure!(st.success(), "the agent ended with {st}");
        Ok(())
    }
}

impl Drop for PrivateAgent {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
        // The pin holder outlives an agent by design; the benchmark's holds nothing.
        if let Ok(mut h) = cryo_holder::HolderClient::new(&self.state).connect() {
            let _ = h.exit();
        }
    }
}

struct Worker {
    pid: Pid,
    child: Child,
}

struct Bench {
    dir: PathBuf,
    state: StateDir,
    exe: PathBuf,
    memory: u64,
    gpu: Option<Gpu>,
    started: usize,
    /// The workers of the arm under way (suspended and killed on drop if the benchmark fails).
    live: Vec<Worker>,
    // Dropped after `Bench::drop` has ended the workers.
    sim: PrivateSim,
}

impl Bench {
    fn start(dir: &Path, memory: u64, cryo: &Path) -> anyhow::Result<Bench> {
        let exe = cryo.to_path_buf();
        // Four workers alternate over two GPUs; leave room for all of them.
        let gpu_memory = memory.saturating_mul(4).max(256 << 20);
        let sim = PrivateSim::start(
            dir,
            &DriverOptions {
                exe: &exe,
                gpus: Some(2),
                gpu_memory: gpu_memory.to_string(),
                log: true,
            },
        )?;
        let mut bench = Bench {
            dir: dir.to_path_buf(),
            state: StateDir::new(dir.join("state")),
            exe,
            memory,
            gpu: None,
            started: 0,
            live: Vec::new(),
            sim,
        };
        bench.gpu = Some(cryo_sim::connect(dir).context("connecting to the simulated GPU")?);
        Ok(bench)
    }

    fn gpu(&self) -> anyhow::Result<&Gpu> {
        self.gpu
            .as_ref()
            .ok_or_else(|| anyhow!("the simulated GPU is not connected"))
    }

    /// Starts `n` new workers (into `live`), each restored once through the GPU API and journaled
    /// as restored.
    fn restored_workers(&mut self, n: usize) -> anyhow::Result<()> {
        for i in 0..n {
            let w = self.worker(i % 2)?;
            self.live.push(w);
        }
        let gpu = self.gpu()?;
        for w in &self.live {
            let (d, pid) = (&gpu.driver, w.pid);
            d.lock(pid, Some(Duration::from_secs(30)))
                .and_then(|()| d.checkpoint(pid))
                .and_then(|()| d.restore(pid, &[]))
                .and_then(|()| d.unlock(pid))
                .with_context(|| format!("restoring worker {pid} before the measurement"))?;
            let handle = ProcHandle::open(pid)?;
            cryo_lifecycle::record_restored(&self.state, &handle, "cryo bench")
                .with_context(|| format!("journaling the restore of worker {pid}"))?;
        }
        Ok(())
    }

    fn worker(&mut self, gpu: usize) -> anyhow::Result<Worker> {
        let k = self.started;
        self.started += 1;
        let w = self.sim.spawn_worker(&WorkerOptions {
            exe: &self.exe,
            setsid: false,
            gpu: Some(gpu),
            memory: self.memory,
            kv_cache: 0,
            http_unix: None,
            ready: self.dir.join(format!("worker{k}.ready")),
            log: Some(self.dir.join(format!("worker{k}.log"))),
            timeout: Duration::from_secs(300),
        })?;
        Ok(Worker {
            pid: w.pid,
            child: w.child,
        })
    }

    fn cryo(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.args(["--gpu", "sim", "--sim-dir"])
            .arg(&self.dir)
            .arg("--state-dir")
            .arg(self.state.root());
        c.env_remove("CRYO_FAILPOINT").stdin(Stdio::null());
        c
    }

    /// `cryo stop PID...`, timed until every worker is reaped.
    fn cryo_stop(&mut self) -> anyhow::Result<f64> {
        let start = Instant::now();
        let out = self
            .cryo()
            .arg("stop")
            .args(self.live.iter().map(|w| w.pid.to_string()))
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .output()
            .context("running cryo stop")?;
        ensure!(
            out.status.success(),
            "cryo stop failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        for w in &mut self.live {
            w.child.wait().context("reaping a worker")?;
        }
        let took = start.elapsed();
        self.live.clear();
        Ok(took.as_secs_f64() * 1e3)
    }

    /// The operators' procedure, timed until every worker is reaped.
    fn procedure(&mut self) -> anyhow::Result<f64> {
        let start = Instant::now();
        for w in &self.live {
            let pid = w.pid.to_string();
            for action in [
                &["--action", "lock", "--timeout", "30000"][..],
                &["--action", "checkpoint"],
            ] {
                let out = self
                    .cryo()
                    .arg("cuda-checkpoint")
                    .args(action)
                    .args(["--pid", &pid])
                    .output()
                    .context("running cryo cuda-checkpoint")?;
                ensure!(
                    out.status.success(),
                    "cuda-checkpoint {} on {pid} failed: {}",
                    action[1],
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        // Once a second, as an operator's script runs nvidia-smi, until no pid is listed.
        loop {
            let out = self
                .cryo()
                .args(["gpu", "ps", "--json"])
                .stderr(Stdio::null())
                .output()
                .context("running cryo gpu ps")?;
            ensure!(out.status.success(), "cryo gpu ps failed ({})", out.status);
            let rows: Vec<serde_json::Value> =
                serde_json::from_slice(&out.stdout).context("reading cryo gpu ps --json")?;
            if !rows
                .iter()
                .any(|r| self.live.iter().any(|w| r["pid"] == w.pid))
            {
                break;
            }
            ensure!(
                start.elapsed() < Duration::from_secs(300),
                "the workers stayed listed for 300 s"
            );
            std::thread::sleep(Duration::from_secs(1));
        }
        for w in &mut self.live {
            w.child.kill().context("killing a worker")?;
            w.child.wait().context("reaping a worker")?;
        }
        let took = start.elapsed();
        self.live.clear();
        Ok(took.as_secs_f64() * 1e3)
    }

    fn ledger_empty(&self) -> anyhow::Result<()> {
        let control = SimControl::new(&self.dir);
        control.wait_up(Duration::from_secs(5))?;
        let wedges = control.ledger().context("reading the wedge ledger")?;
        if let Some(w) = wedges.first() {
            bail!(
                "{} wedge(s) recorded: pid {} on GPU {} ({}): the benchmark is invalid",
                wedges.len(),
                w.pid,
                w.gpu_index,
                w.death
            );
        }
        Ok(())
    }
}

impl Drop for Bench {
    /// A benchmark that failed half-way leaves restored workers: suspend them before the kill.
    fn drop(&mut self) {
        for w in &mut self.live {
            retire(self.gpu.as_ref(), w.pid, &mut w.child);
        }
    }
}
