//! `cryo bench guard`: what the node agent's guard costs a worker, and how fast it turns a fatal
//! signal into a suspension, on a private simulated GPU (loopback HTTP) with a private agent
//! (`cryo agent run`, its own state directory: the guard embedded, pins handed to its holder).
//!
//! # Design
//! 1. **Latency.** One sim worker restored through the agent (`POST /v1/gpu/...`: its guard
//!    traces it before the unlock) serves completions (one new connection per request, as a load
//!    balancer's health or short requests do). The agent runs as deployed (memory watch on) but
//!    without the scan (it would guard the unguarded arm's worker). After one warm-up batch per
//!    arm (not counted), 40 batches per arm interleave on that same worker (A B, B A, A B, ...),
//!    the agent's guard attached (`/v1/guard/attach`) before a guarded batch and detached
//!    (`/v1/guard/detach`) after it, outside the timed requests: both arms see the same worker,
//!    the same memory and the same host noise, and each guarded batch has an unguarded one next
//!    to it in time, so slow drift (another tenant's build) cancels in their ratio. The whole of
//!    it is repeated `--repeats` times. Printed: p50 and p99 of each arm pooled over all its
//!    requests and their ratio; the p99 (p50) ratio of each adjacent pair of batches, as the
//!    median over all pairs with a 95% bootstrap interval (the estimate this bench decides the
//!    budget on: a pair's ratio does not see drift between pairs, and the median is not moved by
//!    the few pairs a burst of host noise hit); the per-repeat ratios (median, min-max, spread).
//!    Beside the latencies, the CPU time (`/proc/PID/task/*/schedstat`) the agent used per second
//!    of each arm's batches, by thread (the guard's steady-state work for one traced worker is
//!    the difference: its standing-duplicate refresh, memory watch, journal poll) and the
//!    worker's CPU per request in each arm (what tracing adds to the traced process itself).
//!    `--pin-cpus` pins the client to the first CPU and the worker to the last.
//! 2. **Fatal signal.** Per round, a fresh worker restored through the agent (guarded from its
//!    restore) is sent SIGTERM; the time from the signal to the worker having exited with its
//!    context suspended (journal `Verified`) is set against a bare suspension
//!    (`cryo_lifecycle::suspend`, in this process, journaled to a journal of its own as every
//!    suspension is) of another fresh restored worker of the same size. One warm-up round of
//!    each, then `--rounds` rounds with the arm order alternating; median (min-max) of each and
//!    the ratio of the medians. Where the time goes: the guard's path step by step (the journal's
//!    timestamps, ms after the signal: fatal signal, suspend, lock, checkpoint, verified, exited;
//!    a record's time is taken before its `fdatasync`), the bare suspension's steps (its progress
//!    callbacks), both split at the checkpoint's copy (the simulated driver copying the device
//!    memory into the worker through a unix socket, a step both arms make and whose time swings
//!    2-4x with the host's CPU contention), and what the kernel's memory management did in each
//!    round (compaction and reclaim stalls, huge pages faulted, THP fallbacks).
//!
//! The wedge ledger must stay empty. The host's load average is printed at the start and end.
//!
//! # What the numbers mean, and limitations
//! The guard traces with ptrace but stops a worker only on signals, clones, execs and exits, none
//! of which a request causes (the worker answers on a fixed pool of threads; no syscall tracing,
//! no seccomp filter), so tracing adds nothing to a request's own path: the worker's CPU per
//! request says whether that holds. What the guard does per second while a traced worker serves
//! runs on the agent's threads (standing-duplicate refresh every second, memory watch every
//! 250 ms, journal poll): on a host with idle CPUs it cannot delay a request at all; on a busy
//! 2-CPU host it can delay only the requests that overlap it, a fraction bounded by its CPU share
//! (agent ms/s / 1000), which moves the p99 only if that fraction nears 1%. The p99 of N requests
//! is decided by the N/100 slowest ones, so on a shared 2-core VM it moves by several percent
//! between runs: read the pairs' interval, not one pooled number. The fatal-signal arm includes
//! what a bare suspension does not: the tracer's stop, the journal's fsyncs and the death
//! itself; the simulated checkpoint is a memory copy whose speed swings with page-fault costs.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use cryo_api::{AgentClient, GpuCall, GpuCallAnswer, GpuCallRequest, PidRequest};
use cryo_journal::{Event, ProcId};
use cryo_lifecycle::{NoProgress, SuspendOptions};
use cryo_proc::ProcHandle;
use serde::Serialize;

use cryo_state::StateDir;

use crate::args::BenchGuardArgs;
use crate::measure::{a_first, load_average, load_line, HostMemory, Interval, Samples};
use crate::private_sim::{DriverOptions, PrivateSim, WorkerOptions};
use crate::stop::PrivateAgent;

/// Issue 10's budget for the guard's p99 overhead.
const P99_BUDGET: f64 = 1.05;
/// The level of the pairs' bootstrap interval.
const LEVEL: f64 = 0.95;

/// Batches per arm in each repeat of the latency measurement.
const BATCHES: usize = 40;

struct Sim {
    dir: PathBuf,
    exe: PathBuf,
    // Dropped after `workers`: fields drop in declaration order.
    workers: Vec<(i32, Child)>,
    sim: PrivateSim,
}

impl Sim {
    fn start(dir: &Path, cryo: &Path) -> anyhow::Result<Sim> {
        let exe = cryo.to_path_buf();
        let sim = PrivateSim::start(
            dir,
            &DriverOptions {
                exe: &exe,
                gpus: Some(1),
                gpu_memory: "64GiB".to_string(),
                log: false,
            },
        )?;
        Ok(Sim {
            dir: dir.to_path_buf(),
            exe,
            workers: Vec::new(),
            sim,
        })
    }

    /// A fresh sim worker; pid and port.
    fn spawn(&mut self, memory: u64) -> anyhow::Result<(i32, u16)> {
        let n = self.workers.len();
        let w = self.sim.spawn_worker(&WorkerOptions {
            exe: &self.exe,
            setsid: false,
            gpu: None,
            memory,
            kv_cache: 0,
            http_unix: None,
            ready: self.dir.join(format!("w{n}.ready")),
            log: None,
            timeout: Duration::from_secs(60),
        })?;
        let (pid, port) = (w.pid, w.tcp_port());
        self.workers.push((pid, w.child));
        Ok((pid, port?))
    }

    /// A sim worker made "restored" through the driver directly (no agent); pid and port.
    fn restored_worker(&mut self, gpu: &cryo_gpu::Gpu, memory: u64) -> anyhow::Result<(i32, u16)> {
        let (pid, port) = self.spawn(memory)?;
        gpu.driver.lock(pid, Some(Duration::from_secs(10)))?;
        gpu.driver.checkpoint(pid)?;
        gpu.driver.restore(pid, &[])?;
        gpu.driver.unlock(pid)?;
        Ok((pid, port))
    }

    /// A sim worker restored through the agent (`POST /v1/gpu/...`): journaled as restored and
    /// traced by the agent's guard before its unlock; pid and port.
    fn guarded_worker(&mut self, agent: &AgentClient, memory: u64) -> anyhow::Result<(i32, u16)> {
        let (pid, port) = self.spawn(memory)?;
        for call in [
            GpuCall::Lock,
            GpuCall::Checkpoint,
            GpuCall::Restore,
            GpuCall::Unlock,
        ] {
            let req = GpuCallRequest {
                pid,
                timeout_ms: Some(10_000),
                pairs: Vec::new(),
            };
            match agent
                .gpu(call, &req)
                .with_context(|| format!("{call:?} of pid {pid}"))?
            {
                GpuCallAnswer::Done => {}
                other => bail!("{call:?} of pid {pid} through the agent: {other:?}"),
            }
        }
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
    }
}

/// One request on a new connection, timed to its whole answer (cryo's one HTTP client).
fn request(port: u16, prompt: &str) -> anyhow::Result<Duration> {
    let t = Instant::now();
    let (status, body) = cryo_http::fetch(
        "POST",
        &format!("http://127.0.0.1:{port}/v1/completions"),
        Some(("text/plain", prompt.as_bytes())),
        Duration::from_secs(60),
    )?;
    if status != 200 {
        bail!("the worker answered {status}: {body}");
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

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// One arm's request latencies, µs.
#[derive(Debug, Serialize)]
struct Latency {
    requests: usize,
    p50_us: f64,
    p99_us: f64,
}

impl Latency {
    fn of(mut v: Vec<Duration>) -> Latency {
        v.sort_unstable();
        Latency {
            requests: v.len(),
            p50_us: us(pct(&v, 0.5)),
            p99_us: us(pct(&v, 0.99)),
        }
    }
}

/// CPU time (ns) of every live thread of `pid`, by thread name.
fn cpu_by_thread(pid: i32) -> BTreeMap<String, u64> {
    let mut out = BTreeMap::new();
    for t in cryo_proc::threads_cpu(pid).unwrap_or_default() {
        *out.entry(t.comm).or_insert(0) += t.cpu_ns;
    }
    out
}

/// What one arm cost beside its latencies: CPU of the agent (by thread) and of the worker, and
/// the wall time of its batches.
#[derive(Debug, Default)]
struct ArmCost {
    agent_ns: BTreeMap<String, u64>,
    worker_ns: u64,
    wall: Duration,
    requests: usize,
}

impl ArmCost {
    fn agent_total_ns(&self) -> u64 {
        self.agent_ns.values().sum()
    }

    /// The agent's CPU per second of wall, ms.
    fn agent_ms_per_s(&self) -> f64 {
        self.agent_total_ns() as f64 / 1e6 / self.wall.as_secs_f64().max(1e-9)
    }

    /// The worker's CPU per request, µs.
    fn worker_us_per_request(&self) -> f64 {
        self.worker_ns as f64 / 1e3 / (self.requests.max(1) as f64)
    }
}

/// What the agent's CPU went to in one arm, by thread, ms per second of wall.
#[derive(Debug, Serialize)]
struct ThreadCost {
    thread: String,
    unguarded_ms_per_s: f64,
    guarded_ms_per_s: f64,
}

#[derive(Debug, Serialize)]
struct CpuResult {
    /// The agent's CPU per second of wall while the batches ran, ms.
    agent_unguarded_ms_per_s: f64,
    agent_guarded_ms_per_s: f64,
    /// The worker's CPU per request, µs.
    worker_unguarded_us_per_request: f64,
    worker_guarded_us_per_request: f64,
    /// The agent's threads whose CPU differs between the arms, or that used any.
    agent_threads: Vec<ThreadCost>,
}

#[derive(Debug, Serialize)]
struct LatencyResult {
    repeats: usize,
    batches_per_arm: usize,
    /// Client and worker pinned to CPUs of their own (`--pin-cpus`).
    pinned: bool,
    /// The p50 and p99 ratios of each repeat.
    p50_ratio_per_repeat: Samples,
    p99_ratio_per_repeat: Samples,
    /// (max - min) / median of the per-repeat p99 ratios, percent.
    p99_ratio_spread_pct: f64,
    /// The p99 (p50) ratio of each guarded batch to the unguarded batch next to it in time (so
    /// drift cancels): median and bootstrap interval over all pairs of all repeats.
    p99_ratio_per_pair: Interval,
    p50_ratio_per_pair: Interval,
    unguarded: Latency,
    guarded: Latency,
    p50_ratio: f64,
    p99_ratio: f64,
    /// The pairs' median p99 ratio at most 1.05 (issue 10's budget), and the pooled one.
    p99_within_budget: bool,
    cpu: CpuResult,
}

#[derive(Debug, Serialize)]
struct SignalResult {
    rounds: usize,
    memory_bytes: u64,
    /// Median, ms.
    via_guard_ms: f64,
    /// Median, ms.
    bare_suspend_ms: f64,
    /// Median via the guard / median bare suspension.
    ratio: f64,
    via_guard_samples_ms: Samples,
    bare_suspend_samples_ms: Samples,
    /// Each step of the guard's path ([`STEPS`]), ms after the signal, per counted round.
    via_guard_steps_ms: Vec<(String, Samples)>,
    /// The checkpoint's copy (checkpoint started to checkpointed: the driver copying device
    /// memory into the worker, a step both arms share), per round: guard, bare.
    copy_ms: [Samples; 2],
    /// Each round's time outside that copy (what the guard's path adds shows here): guard, bare.
    outside_copy_ms: [Samples; 2],
}

/// `(copy, rest)` of one round: the checkpoint's copy (between the steps at `started` and
/// `done`) and the total less it.
fn split_copy(total: f64, started: Option<f64>, done: Option<f64>) -> Option<(f64, f64)> {
    let copy = done? - started?;
    Some((copy, total - copy))
}

#[derive(Debug, Serialize)]
struct Report {
    latency: LatencyResult,
    fatal_signal: SignalResult,
    load_start: [f64; 3],
    load_end: [f64; 3],
}

/// The processes of the latency measurement.
struct Parties<'a> {
    agent: &'a AgentClient,
    agent_pid: i32,
    worker: ProcId,
    port: u16,
}

/// Sends one batch of requests, with the agent's guard attached around it when `guarded`; its
/// latencies, and its costs added to `cost`.
fn batch(
    p: &Parties<'_>,
    guarded: bool,
    n: usize,
    tag: usize,
    cost: &mut ArmCost,
) -> anyhow::Result<Vec<Duration>> {
    let req = PidRequest { pid: p.worker };
    if guarded {
        p.agent
            .attach(&req)
            .context("attaching through the agent")?;
    }
    let (agent0, worker0) = (
        cpu_by_thread(p.agent_pid),
        cpu_by_thread(p.worker.pid).values().sum::<u64>(),
    );
    let t = Instant::now();
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        out.push(request(p.port, &format!("prompt {tag} {i}"))?);
    }
    cost.wall += t.elapsed();
    let worker1: u64 = cpu_by_thread(p.worker.pid).values().sum();
    for (name, ns) in cpu_by_thread(p.agent_pid) {
        let before = agent0.get(&name).copied().unwrap_or(0);
        *cost.agent_ns.entry(name).or_insert(0) += ns.saturating_sub(before);
    }
    cost.worker_ns += worker1.saturating_sub(worker0);
    cost.requests += n;
    if guarded {
        p.agent
            .detach(&req)
            .context("detaching through the agent")?;
    }
    Ok(out)
}

fn latency(
    p: &Parties<'_>,
    requests: usize,
    repeats: usize,
    pinned: bool,
) -> anyhow::Result<LatencyResult> {
    let per_batch = (requests / BATCHES).max(1);
    // Warm-up, one batch per arm: not counted.
    let mut scratch = ArmCost::default();
    batch(p, false, per_batch, 0, &mut scratch)?;
    batch(p, true, per_batch, 1, &mut scratch)?;
    let (mut all_bare, mut all_guarded) = (Vec::new(), Vec::new());
    let (mut p50s, mut p99s) = (Samples::default(), Samples::default());
    let (mut pair50, mut pair99) = (Samples::default(), Samples::default());
    let (mut cost_bare, mut cost_guarded) = (ArmCost::default(), ArmCost::default());
    let mut tag = 2;
    for _ in 0..repeats {
        let (mut bare, mut guarded) = (Vec::new(), Vec::new());
        for pair in 0..BATCHES {
            // A B, B A, ...: each guarded batch next to its unguarded one in time.
            let order = if a_first(pair) {
                [false, true]
            } else {
                [true, false]
            };
            let mut lat: [Latency; 2] = [Latency::of(Vec::new()), Latency::of(Vec::new())];
            for on in order {
                let cost = if on {
                    &mut cost_guarded
                } else {
                    &mut cost_bare
                };
                let v = batch(p, on, per_batch, tag, cost)?;
                tag += 1;
                (if on { &mut guarded } else { &mut bare }).extend_from_slice(&v);
                lat[usize::from(on)] = Latency::of(v);
            }
            pair50.push(lat[1].p50_us / lat[0].p50_us.max(1e-9));
            pair99.push(lat[1].p99_us / lat[0].p99_us.max(1e-9));
        }
        all_bare.extend_from_slice(&bare);
        all_guarded.extend_from_slice(&guarded);
        let (b, g) = (Latency::of(bare), Latency::of(guarded));
        p50s.push(g.p50_us / b.p50_us.max(1e-9));
        p99s.push(g.p99_us / b.p99_us.max(1e-9));
    }
    let (bare, guarded) = (Latency::of(all_bare), Latency::of(all_guarded));
    let p99_ratio = guarded.p99_us / bare.p99_us.max(1e-9);
    let p99_ratio_per_pair = Interval::of(&pair99, LEVEL);
    let threads: std::collections::BTreeSet<&String> = cost_bare
        .agent_ns
        .keys()
        .chain(cost_guarded.agent_ns.keys())
        .collect();
    let per_s = |c: &ArmCost, name: &String| {
        c.agent_ns.get(name).copied().unwrap_or(0) as f64 / 1e6 / c.wall.as_secs_f64().max(1e-9)
    };
    let mut agent_threads: Vec<ThreadCost> = threads
        .into_iter()
        .map(|name| ThreadCost {
            thread: name.clone(),
            unguarded_ms_per_s: per_s(&cost_bare, name),
            guarded_ms_per_s: per_s(&cost_guarded, name),
        })
        .filter(|t| t.unguarded_ms_per_s > 0.0 || t.guarded_ms_per_s > 0.0)
        .collect();
    agent_threads.sort_by(|a, b| b.guarded_ms_per_s.total_cmp(&a.guarded_ms_per_s));
    Ok(LatencyResult {
        repeats,
        batches_per_arm: BATCHES,
        pinned,
        p99_ratio_spread_pct: 100.0 * (p99s.max() - p99s.min()) / p99s.median().max(1e-9),
        p50_ratio_per_repeat: p50s,
        p99_ratio_per_repeat: p99s,
        p50_ratio_per_pair: Interval::of(&pair50, LEVEL),
        p99_within_budget: p99_ratio_per_pair.median <= P99_BUDGET && p99_ratio <= P99_BUDGET,
        p99_ratio_per_pair,
        p50_ratio: guarded.p50_us / bare.p50_us.max(1e-9),
        p99_ratio,
        unguarded: bare,
        guarded,
        cpu: CpuResult {
            agent_unguarded_ms_per_s: cost_bare.agent_ms_per_s(),
            agent_guarded_ms_per_s: cost_guarded.agent_ms_per_s(),
            worker_unguarded_us_per_request: cost_bare.worker_us_per_request(),
            worker_guarded_us_per_request: cost_guarded.worker_us_per_request(),
            agent_threads,
        },
    })
}

/// When each step of a suspension began and ended (the lifecycle's progress callbacks).
struct StepClock {
    start: Instant,
    marks: std::sync::Mutex<Vec<(&'static str, bool, f64)>>,
}

impl StepClock {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            marks: std::sync::Mutex::new(Vec::new()),
        }
    }

    fn mark(&self, step: &'static str, end: bool) {
        let at = ms(self.start.elapsed());
        if let Ok(mut m) = self.marks.lock() {
            m.push((step, end, at));
        }
    }

    /// Ms after the start at which `step` began (`end`: ended).
    fn at(&self, step: &str, end: bool) -> Option<f64> {
        let m = self.marks.lock().ok()?;
        m.iter()
            .find(|(s, e, _)| *s == step && *e == end)
            .map(|(_, _, at)| *at)
    }
}

impl cryo_lifecycle::Progress for StepClock {
    fn begin(&self, _: cryo_proc::Pid, step: &'static str, _: u64) {
        self.mark(step, false);
    }
    fn advance(&self, _: cryo_proc::Pid, _: u64) {}
    fn end(&self, _: cryo_proc::Pid, step: &'static str, _: bool, _: &str) {
        self.mark(step, true);
    }
}

/// The bare arm's steps, timed by [`StepClock`].
const BARE_STEPS: [&str; 4] = [
    "lock started",
    "locked",
    "checkpoint started",
    "checkpointed",
];

/// One round of the bare arm: ms of the whole suspension, and each step's time after its start.
struct BareRound {
    took_ms: f64,
    steps: Vec<Option<f64>>,
    host: String,
}

/// A fresh restored worker suspended bare (journaled to `journal`, as `cryo stop` journals a
/// suspension); ms.
fn bare_round(
    sim: &mut Sim,
    gpu: &cryo_gpu::Gpu,
    journal: &cryo_journal::Journal,
    memory: u64,
) -> anyhow::Result<BareRound> {
    let (p, _) = sim.restored_worker(gpu, memory)?;
    let h = ProcHandle::open(p)?;
    let before = HostMemory::now();
    let clock = StepClock::new();
    let t = Instant::now();
    let outcome = cryo_lifecycle::suspend(
        gpu,
        &[&h],
        &SuspendOptions::default(),
        Some(journal),
        &clock,
    );
    let took = t.elapsed();
    let host = host_since(before);
    if outcome.iter().any(|o| o.result.is_err()) {
        bail!("bare suspension failed: {outcome:?}");
    }
    Ok(BareRound {
        took_ms: ms(took),
        steps: vec![
            clock.at("lock", false),
            clock.at("lock", true),
            clock.at("checkpoint", false),
            clock.at("checkpoint", true),
        ],
        host,
    })
}

/// The steps of the guard's path from a fatal signal to the death, as the journal names them.
const STEPS: [&str; 9] = [
    "fatal signal",
    "suspend started",
    "lock started",
    "locked",
    "checkpoint started",
    "checkpointed",
    "verified",
    "kill started",
    "exited",
];

fn step_of(e: &Event) -> Option<&'static str> {
    Some(match e {
        Event::FatalSignal { .. } => STEPS[0],
        Event::SuspendStarted { .. } => STEPS[1],
        Event::LockStarted { .. } => STEPS[2],
        Event::Locked { .. } => STEPS[3],
        Event::CheckpointStarted { .. } => STEPS[4],
        Event::Checkpointed { .. } => STEPS[5],
        Event::Verified { .. } => STEPS[6],
        Event::KillStarted { .. } => STEPS[7],
        Event::ProcessExited { .. } => STEPS[8],
        _ => return None,
    })
}

/// When each step of [`STEPS`] was journaled for `id`, in ms after `sent` (the first record of
/// each kind at or after it); `None` for a step with no record.
fn step_times(
    records: &[cryo_journal::Record],
    id: ProcId,
    sent: std::time::SystemTime,
) -> Vec<Option<f64>> {
    let mut at = vec![None; STEPS.len()];
    for r in records.iter().filter(|r| r.event.pids().contains(&id)) {
        let (Some(step), Ok(after)) = (step_of(&r.event), r.time.duration_since(sent)) else {
            continue;
        };
        if let Some(i) = STEPS.iter().position(|s| *s == step) {
            at[i].get_or_insert(ms(after));
        }
    }
    at
}

/// One round of the guard's arm: ms from the signal to the death seen by the pidfd, and each
/// step's time after the signal as journaled.
struct GuardRound {
    died_ms: f64,
    steps: Vec<Option<f64>>,
    host: String,
}

/// What the kernel's memory management did between `before` and now: direct-compaction stalls,
/// direct-reclaim stalls, huge pages faulted in, and faults that fell back to small pages.
fn host_since(before: HostMemory) -> String {
    let after = HostMemory::now();
    format!(
        "{}/{}/{}/{}",
        after.compact_stall.saturating_sub(before.compact_stall),
        after.allocstall.saturating_sub(before.allocstall),
        after.thp_fault_alloc.saturating_sub(before.thp_fault_alloc),
        after
            .thp_fault_fallback
            .saturating_sub(before.thp_fault_fallback)
    )
}

/// A fresh worker restored through the agent (so guarded), sent SIGTERM; ms from the signal to
/// its death after a verified suspension.
fn guard_round(
    sim: &mut Sim,
    agent: &AgentClient,
    state: &StateDir,
    memory: u64,
) -> anyhow::Result<GuardRound> {
    let (p, _) = sim.guarded_worker(agent, memory)?;
    let h = ProcHandle::open(p)?;
    let id = ProcId::of(p)?;
    let before = HostMemory::now();
    let sent = std::time::SystemTime::now();
    let t = Instant::now();
    h.signal(cryo_proc::Signal::SIGTERM)?;
    if !h.wait_exit(Duration::from_secs(60)) {
        bail!("pid {p} did not die of SIGTERM under the agent's guard");
    }
    let died = t.elapsed();
    let host = host_since(before);
    let recs = eventually_exited(state, id)?;
    if !recs
        .iter()
        .any(|r| matches!(&r.event, Event::Verified { pid, .. } if *pid == id))
    {
        bail!("pid {p} died without a verified suspension: the guard's path failed");
    }
    Ok(GuardRound {
        died_ms: ms(died),
        steps: step_times(&recs, id, sent),
        host,
    })
}

/// The journal once it holds the guard's record of `id`'s exit (written after the exit stop
/// let it go, so possibly just after the pidfd said it died).
fn eventually_exited(state: &StateDir, id: ProcId) -> anyhow::Result<Vec<cryo_journal::Record>> {
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let recs = state.read_journal()?.records;
        if recs
            .iter()
            .any(|r| matches!(&r.event, Event::ProcessExited { pid, .. } if *pid == id))
            || Instant::now() > until
        {
            return Ok(recs);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// `median (min-max)` of ratios, three decimals.
fn ratio_cell(s: &Samples) -> String {
    format!("{:.3} ({:.3}-{:.3})", s.median(), s.min(), s.max())
}

/// The CPUs of this host.
fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get)
}

/// This thread (the client).
fn client_tid() -> i32 {
    rustix::thread::gettid().as_raw_nonzero().get()
}

/// Pins this thread (the client) to the first CPU and the worker to the last one.
fn pin_client_and_worker(worker: i32) -> anyhow::Result<()> {
    let cpus = cpus();
    if cpus < 2 {
        bail!("--pin-cpus needs two CPUs at least");
    }
    cryo_proc::pin_to_cpus(client_tid(), [0]).context("pinning the client")?;
    cryo_proc::pin_to_cpus(worker, [cpus - 1]).context("pinning the worker")?;
    Ok(())
}

/// Runs `cryo bench guard` with the binary `cryo`.
pub fn run(a: &BenchGuardArgs, cryo: &Path) -> anyhow::Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("cryo-bench-guard-")
        .tempdir()?;
    let sim_dir = tmp.path().join("sim");
    let state = StateDir::new(tmp.path().join("state"));
    let mut sim = Sim::start(&sim_dir, cryo)?;
    let gpu = cryo_sim::connect(&sim_dir)?;
    // As deployed (memory watch on), but no scan: it would guard the unguarded arm's worker.
    let agent =
        PrivateAgent::start_with(cryo, &sim_dir, &state, &[]).context("starting the agent")?;
    let client = agent.client();
    let load_start = load_average();
    if !a.json {
        println!("{}", load_line("start", load_start));
    }

    // 1. Latency, guarded and not, in alternating batches on one worker.
    let (pid, port) = sim.guarded_worker(client, a.memory)?;
    let id = ProcId::of(pid)?;
    // Guarded since its restore: let go, so that the first arm starts unguarded.
    client
        .detach(&PidRequest { pid: id })
        .context("detaching through the agent")?;
    if a.pin_cpus {
        pin_client_and_worker(pid)?;
    }
    let parties = Parties {
        agent: client,
        agent_pid: agent.pid(),
        worker: id,
        port,
    };
    let lat = latency(&parties, a.requests, a.repeats, a.pin_cpus)?;
    if a.pin_cpus {
        // The rest (fatal signals, bare suspensions) runs where the scheduler puts it.
        cryo_proc::pin_to_cpus(client_tid(), 0..cpus()).context("unpinning the client")?;
    }
    if !a.json {
        println!(
            "request latency over loopback, one worker, {} repeats of {} requests per arm in {} \
             interleaved batches per arm (AB BA AB ..., the agent's guard attached/detached \
             around each guarded batch), after 1 warm-up batch per arm{}; pooled over {} \
             requests per arm:",
            lat.repeats,
            lat.unguarded.requests / lat.repeats.max(1),
            lat.batches_per_arm,
            if lat.pinned {
                ", client and worker each pinned to a CPU"
            } else {
                ""
            },
            lat.unguarded.requests
        );
        for (name, l) in [("unguarded", &lat.unguarded), ("guarded", &lat.guarded)] {
            println!(
                "  {:<10} p50 {:>8.1} us  p99 {:>8.1} us",
                format!("{name}:"),
                l.p50_us,
                l.p99_us
            );
        }
        println!(
            "  ratio guarded/unguarded, pooled: p50 {:.3}  p99 {:.3}",
            lat.p50_ratio, lat.p99_ratio
        );
        println!(
            "  ratio guarded/unguarded, per adjacent pair of batches ({} pairs): p99 {}  p50 {} \
             median [95% bootstrap interval]; {} issue 10's p99 budget of {:.2}",
            lat.p99_ratio_per_pair.samples,
            lat.p99_ratio_per_pair.cell(),
            lat.p50_ratio_per_pair.cell(),
            if lat.p99_within_budget {
                "within"
            } else {
                "OVER"
            },
            P99_BUDGET
        );
        println!(
            "  per repeat: p99 ratio {} median (min-max), spread {:.1}% of the median; \
             p50 ratio {}",
            ratio_cell(&lat.p99_ratio_per_repeat),
            lat.p99_ratio_spread_pct,
            ratio_cell(&lat.p50_ratio_per_repeat)
        );
        let c = &lat.cpu;
        println!(
            "  CPU while the batches ran: agent {:.2} ms/s unguarded, {:.2} ms/s guarded \
             (difference {:+.2} ms/s: the guard's steady-state work for one traced worker); \
             worker {:.1} us/request unguarded, {:.1} guarded (ratio {:.3})",
            c.agent_unguarded_ms_per_s,
            c.agent_guarded_ms_per_s,
            c.agent_guarded_ms_per_s - c.agent_unguarded_ms_per_s,
            c.worker_unguarded_us_per_request,
            c.worker_guarded_us_per_request,
            c.worker_guarded_us_per_request / c.worker_unguarded_us_per_request.max(1e-9)
        );
        for t in &c.agent_threads {
            println!(
                "    agent thread {:<16} {:>7.3} ms/s unguarded  {:>7.3} ms/s guarded",
                t.thread, t.unguarded_ms_per_s, t.guarded_ms_per_s
            );
        }
    }

    // Suspended before the bench ends, so that killing it is safe.
    let h = ProcHandle::open(pid)?;
    if cryo_lifecycle::suspend(&gpu, &[&h], &SuspendOptions::default(), None, &NoProgress)
        .iter()
        .any(|o| o.result.is_err())
    {
        bail!("cannot suspend the latency worker");
    }

    // 2. Fatal signal to suspended, against a bare suspension; round 0 is the warm-up.
    let (mut via_guard, mut bare) = (Samples::default(), Samples::default());
    // The bare arm journals its suspension as every suspension does (its own journal, on the
    // same filesystem as the agent's): the arms differ by the guard's path only.
    let bare_journal = cryo_journal::Journal::open(tmp.path().join("bare-journal"))?;
    let mut steps: Vec<Samples> = vec![Samples::default(); STEPS.len()];
    let mut rounds = Vec::new();
    let mut bare_rounds = Vec::new();
    for round in 0..=a.rounds {
        let order = if a_first(round) {
            [true, false]
        } else {
            [false, true]
        };
        for use_guard in order {
            if use_guard {
                let r = guard_round(&mut sim, client, &state, a.memory)?;
                if round > 0 {
                    via_guard.push(r.died_ms);
                    for (s, at) in steps.iter_mut().zip(&r.steps) {
                        if let Some(at) = at {
                            s.push(*at);
                        }
                    }
                    rounds.push(r);
                }
            } else {
                let r = bare_round(&mut sim, &gpu, &bare_journal, a.memory)?;
                if round > 0 {
                    bare.push(r.took_ms);
                    bare_rounds.push(r);
                }
            }
        }
    }
    let (mut copy, mut outside): ([Samples; 2], [Samples; 2]) = Default::default();
    let splits = rounds
        .iter()
        .map(|r| (0, split_copy(r.died_ms, r.steps[4], r.steps[5])))
        .chain(
            bare_rounds
                .iter()
                .map(|r| (1, split_copy(r.took_ms, r.steps[2], r.steps[3]))),
        );
    for (arm, split) in splits {
        if let Some((c, o)) = split {
            copy[arm].push(c);
            outside[arm].push(o);
        }
    }
    let sig = SignalResult {
        copy_ms: copy,
        outside_copy_ms: outside,
        rounds: a.rounds,
        memory_bytes: a.memory,
        via_guard_ms: via_guard.median(),
        bare_suspend_ms: bare.median(),
        ratio: via_guard.median() / bare.median().max(1e-9),
        via_guard_samples_ms: via_guard,
        bare_suspend_samples_ms: bare,
        via_guard_steps_ms: STEPS
            .iter()
            .zip(steps)
            .map(|(s, v)| ((*s).to_string(), v))
            .collect(),
    };
    let wedges = cryo_sim::SimControl::new(&sim_dir).ledger()?;
    if !wedges.is_empty() {
        bail!("the wedge ledger is not empty: {wedges:?}");
    }
    let report = Report {
        latency: lat,
        fatal_signal: sig,
        load_start,
        load_end: load_average(),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        let sig = &report.fatal_signal;
        println!(
            "fatal signal (SIGTERM) to dead-with-context-suspended, {} rounds after 1 warm-up, \
             arm order alternating, fresh worker of {} device memory per arm:",
            sig.rounds,
            cryo_units::fmt_bytes(sig.memory_bytes)
        );
        println!(
            "  via the agent's guard: {} ms, median (min-max)",
            sig.via_guard_samples_ms.cell1()
        );
        println!(
            "  bare suspension:       {} ms, median (min-max)",
            sig.bare_suspend_samples_ms.cell1()
        );
        println!("  ratio guard/bare:      {:.3} (medians)", sig.ratio);
        println!(
            "  split at the checkpoint's copy (the simulated driver copying device memory into \
             the worker; both arms make it): outside the copy guard {} vs bare {} ms, ratio {:.2} \
             (what the guard's path adds); the copy guard {} vs bare {} ms, ratio {:.2}",
            sig.outside_copy_ms[0].cell1(),
            sig.outside_copy_ms[1].cell1(),
            sig.outside_copy_ms[0].median() / sig.outside_copy_ms[1].median().max(1e-9),
            sig.copy_ms[0].cell1(),
            sig.copy_ms[1].cell1(),
            sig.copy_ms[0].median() / sig.copy_ms[1].median().max(1e-9)
        );
        println!("  the guard's path, ms after the signal as journaled, median (min-max), and per round:");
        for (i, (step, v)) in sig.via_guard_steps_ms.iter().enumerate() {
            let per_round: Vec<String> = rounds
                .iter()
                .map(|r| r.steps[i].map_or_else(|| "-".into(), |v| format!("{v:.1}")))
                .collect();
            println!("    {step:<18} {:<22} {}", v.cell1(), per_round.join(" "));
        }
        let seen: Vec<String> = rounds.iter().map(|r| format!("{:.1}", r.died_ms)).collect();
        println!(
            "    {:<18} {:<22} {}",
            "death seen",
            sig.via_guard_samples_ms.cell1(),
            seen.join(" ")
        );
        println!("  the bare suspension, ms after its start, per round:");
        for (i, step) in BARE_STEPS.iter().enumerate() {
            let per_round: Vec<String> = bare_rounds
                .iter()
                .map(|r| r.steps[i].map_or_else(|| "-".into(), |v| format!("{v:.1}")))
                .collect();
            println!("    {step:<18} {}", per_round.join(" "));
        }
        let took: Vec<String> = bare_rounds
            .iter()
            .map(|r| format!("{:.1}", r.took_ms))
            .collect();
        println!("    {:<18} {}", "done (verified)", took.join(" "));
        let cells = |v: Vec<&str>| v.join(" ");
        println!(
            "  the kernel meanwhile, per round (compaction stalls/reclaim stalls/huge pages faulted/THP fallbacks): guard {}; bare {}",
            cells(rounds.iter().map(|r| r.host.as_str()).collect()),
            cells(bare_rounds.iter().map(|r| r.host.as_str()).collect())
        );
        println!("wedge ledger empty");
        println!("{}", load_line("end", report.load_end));
    }
    // No pins (every guarded worker died suspended): the agent stops cleanly.
    agent.stop()?;
    drop(sim);
    Ok(())
}
