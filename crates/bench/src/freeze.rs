//! `cryo bench freeze`: `cryo freeze`/`cryo thaw` against the same work done by hand with the
//! `criu` command line and one `cryo cuda-checkpoint` process per action (the bare route), on a
//! private simulated GPU, moment by moment, with the disk's own limits measured in the same run.
//!
//! # Design
//! One run starts its own simulated driver (one GPU, room for one worker of the largest size) in
//! a temporary directory. Each size gets a row. A row starts by measuring what the disk gives
//! for the same amount of data (up to 1 GiB): written and fsync'd, read back from a cold cache
//! (after `drop_caches`), read from the page cache. Then `--rounds` counted rounds of both arms,
//! on fresh workers, the arm that goes first alternating (A B, B A, ...), after one warm-up
//! round of both at the smallest size that is not counted:
//! - **cryo**: `cryo freeze PID --image A --json`, then `cryo thaw A --health-url ...` twice:
//!   from the page cache, and after dropping the caches;
//! - **bare**: `cuda-checkpoint --action lock`, `--action checkpoint`, `criu dump`, then a fsync
//!   of every image file and the directory (what it takes for the image to be durable, which the
//!   bare route never does by itself); thaw = `criu restore -d`, `cuda-checkpoint --action
//!   restore`, `--action unlock`, then the health endpoint polled until it answers; again after
//!   dropping the caches.
//!
//! The moments an operator waits for, from the first process started: **GPU free** (every CUDA
//! process suspended), **worker gone** (the dump done, the tree gone), **published and
//! durable** (cryo's image renamed into place with every file fsync'd; the bare route's dump
//! plus its fsyncs), and the thaws to the first answered health request.
//!
//! Every moment of both arms is measured on `CLOCK_MONOTONIC` ([`Moment`]) from one origin per
//! arm: the instant the benchmark launches the arm's first process (`cryo freeze`, or the first
//! `cuda-checkpoint`; for a thaw, `cryo thaw` or `criu restore`). The bare route's moments are
//! when its tools exited (`cuda-checkpoint --action checkpoint`, `criu dump`, the last fsync:
//! when a script running them would know). cryo reports each of its moments as an absolute
//! `CLOCK_MONOTONIC` time in its `--json` report (`moments`, `first_answer_at`), read as the
//! step that reaches it returns, and the benchmark subtracts the origin: all of cryo's start
//! (exec, listing the tree, opening the journal, connecting to the driver) is counted, and
//! nothing that follows the moment (the journal records after it, the process's exit) is,
//! since the GPU is free when the checkpoint returned, not when `cryo freeze` exits. The bare
//! route's tools are charged their exits (a `cuda-checkpoint` process's exit is about a
//! millisecond), cryo its whole start: neither arm is flattered by what the other is not.
//!
//! Beside each moment, its **overhead**: the moment less the simulated driver's copies of the
//! arm's device memory before it (the checkpoint's for the freeze moments, each thaw's restore
//! for the thaws), as the driver timed them (`cryo_sim::proto::MemCopy`, asked right after each
//! phase). The copies are the same work in both arms, but on the simulator their cost is
//! mostly first-touch page zeroing that swings 2-3x with the host's free memory between rounds,
//! which drowns a difference of a few percent; the overhead is what each route itself adds (cryo,
//! or the tools and their processes), with its own ratio and paired interval. The raw moment
//! stays the headline: it is what an operator waits for. A checkpoint copy ends when the
//! worker has read its last byte (the driver waits for the socket's send queue to drain: up
//! to 8 MiB are still on their way when its last write returns; measured 0.1-7 ms, so that
//! tail is not why the overhead grows with the size in both arms).
//!
//! **The settle step** (`--settle`; [`Bench::settle`], one function both arms call): right
//! before each measured phase (the freeze, once the worker is up; each thaw, once the caches are dropped for
//! the cold one), the benchmark faults in as much memory as the phase's worker will take (its
//! device memory and 64 MiB, on huge pages as the simulated driver's host copy asks) and frees
//! it, then the phase's first process starts. Why: the copies are first-touch page faults,
//! and on this project's machines (VMs whose balloon reports free pages to the hypervisor,
//! `VIRTIO_BALLOON_F_REPORTING`) what a fault costs depends on when the page was freed:
//! memory freed under 2 s earlier is the host's still (measured, 1 GiB: 160 ms of CPU per GiB),
//! memory freed longer ago has been handed back and costs 5-15x more to fault in again (2 s:
//! 1.0 s/GiB, 5 s: 1.3-2.1, 8 s and more: 2.5-2.9, under load 7-10; the kernel reports a
//! fraction of the free lists per pass, every 2 s). Without the step, each arm's copy drew on
//! whatever mix the previous arm's frees (its worker stopped, its image deleted) and the
//! balloon's passes had left, which swung a 4 GiB checkpoint copy by 2x between rounds and
//! arms with the same work. With it, both arms' phases start on memory freed a moment ago, as
//! on a host without a balloon (bare metal, where a GPU's host runs), and the step is never
//! timed. It is off by default: the kernel reports free memory in passes every 2 s, most
//! recently freed first, so a copy that runs past the next pass (under load, a 4 GiB one
//! always does) still meets reported memory, and the A/B runs so far (loaded host) did not
//! show a narrower spread of the copies with it. The host's free memory and page cache at each
//! freeze's start, and each copy's median (min-max) with its paired ratio, are printed either
//! way.
//!
//! **The restore's fault mode** (session 20): on this project's VMs a restore that reads 1 GiB
//! from the page cache into fresh memory (CRIU's restorer: one `preadv` per run of VMAs) runs in
//! one of two modes, at random, in either arm, alone or beside other work: about 0.35 s of CPU
//! per GiB, or 1.45x to 2x that (the lead's probe: 0.36 or 0.75 s, 4 of 30 runs slow, quiet
//! host; `thaw-ab` on real thaws: the restorer's CPU 340-460 ms in the fast mode, 550-1420 in
//! the slow one, 550-590 on a quiet host, and the CRIU step longer by as much). The hypervisor's faults count as the
//! guest's CPU, so the mode shows in the restorer's CPU (the restored root's main thread, read
//! when the thaw answered): a restore is **slow-fault** when that is over [`SLOW_FAULT`] times
//! the median of both arms' restores of its cache state. It is not only the age of the freed
//! memory: a settle step of 2 GiB on small pages right before each thaw (`thaw-ab --settle`)
//! did not remove it (1 of 32 restores slow with it, 0 of 32 without, load 3-4). One slow
//! restore adds about 0.4 s per GiB to its arm's CRIU step, 20 times the ~20 ms gap sought,
//! in either arm, so each cache state's thaw is also compared **like with like**: the paired
//! ratios over the rounds whose two restores both ran fast (a round
//! with a slow one in either arm left out; the blocks kept as they were,
//! `measure::Interval::of_blocks_kept`), with the count of slow restores per arm beside them:
//! if one arm met the slow mode more often, that is its own result, not noise.
//!
//! The dump step (GPU free to worker gone) is split the same way: CRIU's page loop, as CRIU
//! times it in the image's `stats-dump` (`cryo_criu::stats`), is the same pages in both arms,
//! moved at the host's speed (the first touch of the page cache it writes, the load; it swung
//! by more than the routes' difference in every A/B of session 13), and the rest of the step is
//! what each route adds around it: its set-up, CRIU's start and seize, the action scripts (cryo's
//! gate), the kill and the wait for the worker's end. A route that slowed CRIU's page loop itself
//! (work beside CRIU) shows in the loop's line and in the raw moment, not in the rest.
//!
//! *Worker gone* is the same moment in both arms: every process of the tree has exited (its
//! pidfd is readable: it is a zombie or reaped, its memory is released, it can never run
//! again), taken through the worker's pidfd. That is what an operator waits for: the host
//! memory back (after a checkpoint it holds the device memory too) and a worker that cannot
//! serve or write again. Its pid being free (reaped by its parent) is not part of it: the
//! parent reaps when it likes, and a thaw waits for the pids itself (cryo reports pids still
//! held as `pids_held`). The bare route reaches it at `criu dump`'s exit: CRIU kills the tree
//! and, as its tracer, waits for every task it killed before it exits (measured: the dumped
//! worker was a zombie the moment `criu dump` exited); the benchmark checks the pidfd all the
//! same. cryo reaches it once its CRIU has exited and each exit is confirmed by pidfd. Each cell
//! is the median over the rounds with the
//! min-max beside it; ratios are ratios of medians (bare / cryo: above 1, cryo is faster), and
//! beside each the paired ratio: bare / cryo of each round, whose two arms ran back to back (so
//! what drifts between rounds cancels), their median with a 90% bootstrap interval
//! (`measure::Interval`): "at least 1.0x" holds where the interval's low end is at least 1;
//! with 3 rounds the interval spans their spread. The bootstrap resamples **ABBA blocks**, two
//! consecutive rounds (one of each arm order) as one unit ([`BLOCK`],
//! `measure::Interval::of_blocks`), not rounds one by one: neighbouring rounds share the host's
//! state of the moment, and a resample of single rounds takes their likeness for agreement.
//!
//! **What the interval does not see** (session 15): a component that a whole run shares. The
//! simulated copies' paired ratio swung between whole 1 GiB runs from 0.63 [0.43, 0.68] to 1.42
//! [1.23, 1.55] (session 14, 4-5 rounds each, each interval narrow): each run's rounds agreed
//! with each other, not with the next run's. The likely cause is the balloon's timing (above):
//! a copy's cost depends on how long before it the host freed memory, and that time is set by
//! the durations of the steps before it (the other arm's teardown, the worker's start, the
//! route's own start), which are alike in every round of a run and differ between runs with
//! the load: so one arm's copies can fall on the expensive side of the balloon's pass in every
//! round of one run and on the cheap side in the next. No resampling of one run's rounds can
//! show that; two remedies, both the same for both arms: `--jitter MS` starts each measured
//! phase after a pause drawn at random between 0 and MS (not timed), which spreads that time
//! over the rounds so that the interval sees its effect (its cost: the run takes longer); and
//! repeated runs, whose paired medians are to be compared with each other before a verdict. A
//! verdict on a moment dominated by the copies (GPU free, where the copy is 95% of the moment)
//! from one run without `--jitter` holds for that run only.
//!
//! **The lock step** does not grow with the size: the bare route's lock (`cuda-checkpoint
//! --action lock` from its launch to its exit, a fresh worker each, load 4-5) took 19.5 ms
//! (17.2-22.7) at 256 MiB and 17.9 ms (7.1-101.5) at 4 GiB, median (min-max) of 5 (session 15);
//! repeated lock/unlock pairs on one worker took the same at 256 MiB, 1 GiB and 4 GiB. The
//! simulated lock does no work that grows with the size (the worker's restore thread flips a
//! flag once no call is in flight; the device memory is the driver's, untouched), and neither
//! does cryo's. What grows is the spread: a 4 GiB round sometimes meets a lock of 40-100 ms, as
//! the host is busy giving back (the balloon) or zeroing the previous round's 4 GiB when the
//! next round starts. The GPU-free overhead's growth with the size in both arms (12-17 ms at 1
//! GiB, 25-30 at 4 GiB in session 14's final run) is therefore not in the lock's median; where
//! the rest of it lies (that spread, the edges of the copy) is not measured yet.
//! Both arms' steps are printed too (cryo's from its `--json` report, the bare route's timed
//! around each process), so the time each phase takes is visible side by side, and the moments
//! of cryo's CRIU restore (`criu_phases`: its checks before CRIU, CRIU at the gate with every
//! page read, every page checked, the verdict, CRIU's exit), which say whether CRIU or cryo's
//! check was the slow side of a thaw (the bare route's CRIU restore is one process, its step),
//! and of cryo's dump (`dump_phases`: every byte received, CRIU at the gate, the
//! verdict, CRIU's exit, every chunk hashed), which say what the worker's end waited for.
//! Throughputs are image bytes over a moment or step, next to the disk's limit for those bytes.
//! Every worker is stopped with `cryo stop` and the wedge ledger must stay empty; an arm that
//! fails (or panics) ends the workers it started on its way out ([`Workers`]: suspended, then
//! killed by pidfd), so a failed run leaves no worker holding its memory. The host's load
//! average is printed at the start and end.
//!
//! # What the numbers mean, and limitations
//! Needs root (CRIU, `drop_caches`). Only ratios mean anything, and only as far as the paired
//! ratios' interval is narrow: a few rounds on a shared host give a wide one. cryo does more than the bare route: it hashes every byte at
//! publish and checks every byte CRIU reads against the manifest, and the bare route's
//! durability is added by the benchmark. Dropping the caches is host-wide: it slows whatever
//! else runs there, and both arms pay for their binaries' pages alike. The simulated checkpoint
//! is a memory copy between two processes, so the suspend and GPU-restore steps swing with the
//! host; on a real GPU the driver's checkpoint dominates both arms. Images go to the temporary
//! directory (`--dir`): its disk is the one measured.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context as _};
use serde::Serialize;

use cryo_proc::ProcHandle;
use cryo_state::StateDir;
use cryo_units::{fmt_bytes, Moment};

use crate::args::BenchFreezeArgs;
use crate::measure::{
    a_first, load_average, load_line, paired_ratios, HostMemory, Interval, Samples,
};
use crate::private_sim::{private_exe, DriverOptions, PrivateSim, WorkerOptions, Workers};

/// The level of the paired ratios' bootstrap interval.
const LEVEL: f64 = 0.9;

/// Rounds resampled together by the paired ratios' bootstrap ([`Interval::of_blocks`]): an
/// ABBA block, the two rounds of opposite arm order (see the module docs).
const BLOCK: usize = 2;

/// What [`Bench::settle`] faults in beyond the phase's device memory: the worker's own
/// allocations beside its copy of it.
const SETTLE_MARGIN: u64 = 64 << 20;

/// A thaw's CRIU restore is in the **slow-fault mode** when its restorer's CPU (the restored
/// root's main thread, [`main_thread_cpu`]) is over this many times the median of every restore
/// of its cache state in the row, both arms together (one threshold for both): see the module
/// docs. On this project's VMs the slow mode is 1.45x to 2x and more (0.35 against 0.55-0.75 s
/// of CPU per GiB on a quiet host), the fast one within 1.16x of the median: 1.3 lies between.
const SLOW_FAULT: f64 = 1.3;

/// The moments compared, in the order printed.
const MOMENTS: [&str; 5] = [
    "GPU free",
    "worker gone",
    "published, durable",
    "thaw, page cache",
    "thaw, cold cache",
];

/// The moments of cryo's CRIU restore (`cryo_criu::RestorePhases`), in order: its checks
/// before CRIU, CRIU at the gate (every process restored, its memory read), every page checked,
/// the verdict, CRIU's exit.
const PHASES: [&str; 5] = [
    "checked_ms",
    "gate_ms",
    "hashed_ms",
    "verdict_ms",
    "criu_exit_ms",
];

/// The moments of cryo's dump (`cryo_criu::DumpPhases`), in order: every byte CRIU
/// sent in cryo's staging files, CRIU at the gate (`post-dump`), the verdict (CRIU then kills
/// the tree), CRIU's exit, every chunk hashed.
const DUMP_PHASES: [&str; 5] = [
    "received_ms",
    "gate_ms",
    "verdict_ms",
    "criu_exit_ms",
    "hashed_ms",
];

/// What the disk gives for the row's bytes, bytes per second, measured in the same run.
#[derive(Debug, Clone, Copy, Serialize)]
struct Limits {
    /// Bytes of the probe file.
    bytes: u64,
    /// Written and fsync'd.
    write_fsync: f64,
    /// Read after dropping the caches.
    read_cold: f64,
    /// Read from the page cache.
    read_cached: f64,
}

/// One row: every sample, medians derived.
#[derive(Debug, Serialize)]
struct Row {
    memory_bytes: u64,
    image_bytes: u64,
    rounds: usize,
    limits: Limits,
    /// Per moment ([`MOMENTS`]): cryo's and the bare route's samples (ms).
    cryo: [Samples; 5],
    bare: [Samples; 5],
    /// bare / cryo medians per moment: above 1, cryo is faster.
    ratio: [f64; 5],
    /// Per moment, bare / cryo of each round (its two arms ran back to back): their median and
    /// [`LEVEL`] bootstrap interval.
    paired: [Interval; 5],
    /// Per moment, its sample less the simulated driver's device-memory copies before it in
    /// the same arm ([`Arm::copies`]): each route's own cost, cryo's then the bare route's.
    overhead: [[Samples; 5]; 2],
    /// bare / cryo medians of `overhead`.
    overhead_ratio: [f64; 5],
    /// bare / cryo of each round's `overhead`: median and [`LEVEL`] interval.
    overhead_paired: [Interval; 5],
    /// The simulated driver's copies ([`Arm::copies`]), cryo's then the bare route's, ms.
    sim_copies: [[Samples; 3]; 2],
    /// CRIU's page loop in the freeze's dump ([`Arm::criu_pages`]), cryo's then the bare
    /// route's, ms: the same pages in both arms, moved at the host's speed.
    criu_pages: [Samples; 2],
    /// The dump step less CRIU's page loop ([`Arm::dump_besides_pages`]), cryo's then the bare
    /// route's, ms.
    dump_besides_pages: [Samples; 2],
    /// bare / cryo of each round's `dump_besides_pages`: median and [`LEVEL`] interval.
    dump_besides_pages_paired: Interval,
    /// cryo's freeze steps: suspend, dump, publish (hash + fsync + manifest + rename), ms.
    cryo_freeze_steps: [Samples; 3],
    /// cryo's thaw from the page cache: checks before CRIU, CRIU restore (every byte checked
    /// before anything runs, by the route `CRYO_THAW_STREAM` picks), GPU restore + unlock, ms.
    cryo_thaw_warm_steps: [Samples; 3],
    /// The same after dropping the caches.
    cryo_thaw_cold_steps: [Samples; 3],
    /// cryo's CRIU restore from the page cache, then cold, moment by moment ([`PHASES`]), ms
    /// from its start.
    cryo_restore_phases: [[Samples; 5]; 2],
    /// cryo's dump moment by moment ([`DUMP_PHASES`]), ms from the dump's start.
    cryo_dump_phases: [Samples; 5],
    /// Bytes cryo's follower hashed while CRIU wrote them, before publish took over
    /// (`dump_phases.followed_bytes`): what publish did not hash again.
    cryo_followed_bytes: Samples,
    /// The bare route's freeze steps: lock + checkpoint, `criu dump`, fsync of the files, ms.
    bare_freeze_steps: [Samples; 3],
    /// The bare route's thaw from the page cache: nothing (0), `criu restore`, GPU restore +
    /// unlock, ms; the health check is the rest.
    bare_thaw_warm_steps: [Samples; 3],
    /// The same after dropping the caches.
    bare_thaw_cold_steps: [Samples; 3],
    /// What each thaw's CRIU restore had to work with and what it cost, cryo then the bare route
    /// ([`ThawHost`]).
    thaw_host: [ThawHost; 2],
    /// The thaws like with like, page cache then cold ([`FaultModes`]).
    fault_modes: [FaultModes; 2],
    load_before: [f64; 3],
    load_after: [f64; 3],
    /// Whether each phase started after [`Bench::settle`].
    settled: bool,
    /// `--jitter`: each phase started after a pause drawn between 0 and this many ms.
    #[serde(skip_serializing_if = "Option::is_none")]
    jitter_ms: Option<u64>,
}

/// Per arm, what its thaws' CRIU restores had to work with and what they cost: the restored
/// root's CPU time (CRIU's restorer reads the image's pages into it, faulting in every page of
/// its memory: the bulk of a restore's work), the host's free memory when each thaw started,
/// and how long after the worker was gone the page-cache thaw started (freed memory comes back
/// cheaper the sooner it is used again in a VM whose balloon reports free pages: see
/// `cryo_sim`'s `vram`). They say whether a slower restore did more work or waited.
#[derive(Debug, Default, Serialize)]
struct ThawHost {
    /// CPU ms of the restored root's main thread when its thaw answered: page cache, cold.
    restored_cpu: [Samples; 2],
    /// `MemFree` (MiB) when the thaw started: page cache, cold.
    free_mib: [Samples; 2],
    /// ms from the worker gone to the start of the page-cache thaw.
    thaw_after_gone: Samples,
    /// `MemFree` and `Cached` (MiB) when the freeze started.
    freeze_host: [Samples; 2],
}

impl ThawHost {
    fn push(&mut self, arm: &Arm) {
        for k in 0..2 {
            self.restored_cpu[k].push(arm.restored_cpu[k]);
            self.free_mib[k].push(arm.free_mib[k]);
        }
        self.thaw_after_gone.push(arm.thaw_after_gone);
        for k in 0..2 {
            self.freeze_host[k].push(arm.freeze_host[k]);
        }
    }
}

/// One cache state's thaws sorted by the restore's fault mode ([`SLOW_FAULT`]), and the thaws
/// compared like with like: only the rounds whose two restores both ran in the fast mode.
#[derive(Debug, Serialize)]
struct FaultModes {
    /// The median restorer CPU (ms) of both arms' restores: the threshold's base.
    median_cpu: f64,
    /// Restores in the slow-fault mode: cryo's, the bare route's.
    slow: [usize; 2],
    /// The rounds whose two restores both ran in the fast mode.
    like_rounds: usize,
    /// Over those rounds, bare / cryo of each round: the thaw moment, its overhead (less the
    /// simulated copy), the CRIU restore step.
    like_paired: [Interval; 3],
}

impl FaultModes {
    /// `cpu`: each arm's restorer CPU per round (cryo, bare); `pairs`: the per-round samples
    /// compared (cryo's, the bare route's) for the moment, its overhead and the CRIU step.
    fn of(cpu: [&Samples; 2], pairs: [[&Samples; 2]; 3]) -> FaultModes {
        let both = Samples(cpu[0].0.iter().chain(&cpu[1].0).copied().collect());
        let median_cpu = both.median();
        // NaN (an unreadable CPU) is never over the threshold: such a round is kept.
        let slow_at = |s: &Samples| -> Vec<bool> {
            s.0.iter().map(|c| *c > SLOW_FAULT * median_cpu).collect()
        };
        let [sc, sb] = cpu.map(slow_at);
        let keep: Vec<bool> = sc.iter().zip(&sb).map(|(c, b)| !c && !b).collect();
        let count = |v: &[bool]| v.iter().filter(|x| **x).count();
        FaultModes {
            median_cpu,
            slow: [count(&sc), count(&sb)],
            like_rounds: count(&keep),
            like_paired: pairs
                .map(|[c, b]| Interval::of_blocks_kept(&paired_ratios(b, c), &keep, LEVEL, BLOCK)),
        }
    }
}

/// CPU ms so far of the main thread of `pid` (the thread CRIU's restorer ran in); NaN when it
/// cannot be read, since a benchmark should not fail for want of an explanation.
fn main_thread_cpu(pid: i32) -> f64 {
    cryo_proc::threads_cpu(pid)
        .ok()
        .and_then(|ts| ts.into_iter().find(|t| t.tid == pid))
        .map_or(f64::NAN, |t| t.cpu_ns as f64 / 1e6)
}

/// Runs `cryo bench freeze` with the binary `cryo`.
pub fn run(freeze_args: &BenchFreezeArgs, cryo: &Path) -> anyhow::Result<()> {
    let args = &freeze_args.sizes;
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
    let mut bench = Bench::start(tmp.path(), criu.path().to_path_buf(), max, cryo)?;
    bench.thaw_after_gone = freeze_args.thaw_after_gone.map(Duration::from_millis);
    bench.settle = freeze_args.settle;
    bench.jitter = freeze_args.jitter.map(Duration::from_millis);
    let load_start = load_average();
    if !args.json {
        println!(
            "cryo freeze/thaw against the bare route: criu + cuda-checkpoint processes (simulated \
             GPU, {}); cryo's thaw: {}",
            criu.path().display(),
            match cryo_criu::ThawRoute::from_env() {
                cryo_criu::ThawRoute::Files => "CRIU reads the files, cryo checks them beside it",
                cryo_criu::ThawRoute::Stream =>
                    "through cryo's image streamer (CRYO_THAW_STREAM=1)",
            }
        );
        println!(
            "{} rounds per size after 1 warm-up round at {}, arm order alternating (ABBA), \
             fresh worker per arm; cells: median (min-max) ms from the first process started",
            args.rounds,
            fmt_bytes(min)
        );
        if bench.settle {
            println!(
                "each freeze and thaw of both arms starts after the same settle step: as much \
                 memory as its worker's faulted in (huge pages) and freed at once, so that \
                 both arms' copies fault in the host's freshly freed memory (--settle)"
            );
        }
        if let Some(ms) = freeze_args.jitter {
            println!(
                "each freeze and thaw of both arms starts after a pause drawn between 0 and \
                 {ms} ms, not timed (--jitter)"
            );
        }
        if let Some(ms) = freeze_args.thaw_after_gone {
            println!(
                "each page-cache thaw starts no sooner than {ms} ms after its worker was gone \
                 (--thaw-after-gone), in both arms"
            );
        }
        println!("{}", load_line("start", load_start));
    }
    // Warm-up, not counted.
    bench.cryo_arm(min)?;
    bench.bare_arm(min)?;
    let mut rows = Vec::new();
    for size in &args.sizes {
        let load_before = load_average();
        let limits = bench.limits((*size).min(1 << 30))?;
        let mut cryo_s: [Samples; 5] = Default::default();
        let mut bare_s: [Samples; 5] = Default::default();
        let mut steps: [[Samples; 3]; 3] = Default::default();
        let mut bare_steps: [[Samples; 3]; 3] = Default::default();
        let mut phases: [[Samples; 5]; 2] = Default::default();
        let mut dump_phases: [Samples; 5] = Default::default();
        let mut followed = Samples::default();
        let mut thaw_host: [ThawHost; 2] = Default::default();
        let mut overhead: [[Samples; 5]; 2] = Default::default();
        let mut sim_copies: [[Samples; 3]; 2] = Default::default();
        let mut criu_pages: [Samples; 2] = Default::default();
        let mut dump_besides_pages: [Samples; 2] = Default::default();
        let mut image_bytes = 0;
        for round in 1..=args.rounds {
            let (c, b) = if a_first(round) {
                let c = bench.cryo_arm(*size)?;
                (c, bench.bare_arm(*size)?)
            } else {
                let b = bench.bare_arm(*size)?;
                (bench.cryo_arm(*size)?, b)
            };
            image_bytes = c.image_bytes;
            thaw_host[0].push(&c);
            thaw_host[1].push(&b);
            for i in 0..5 {
                cryo_s[i].push(c.moments[i]);
                bare_s[i].push(b.moments[i]);
            }
            for (k, arm) in [&c, &b].into_iter().enumerate() {
                for (i, v) in arm.overhead().into_iter().enumerate() {
                    overhead[k][i].push(v);
                }
                for (j, v) in arm.copies.into_iter().enumerate() {
                    sim_copies[k][j].push(v);
                }
                criu_pages[k].push(arm.criu_pages);
                dump_besides_pages[k].push(arm.dump_besides_pages());
            }
            for (j, v) in c.dump_phases.iter().enumerate() {
                dump_phases[j].push(*v);
            }
            followed.push(c.followed_bytes);
            for (k, warm_cold) in c.phases.iter().enumerate() {
                for (j, v) in warm_cold.iter().enumerate() {
                    phases[k][j].push(*v);
                }
            }
            for (arm, into) in [(&c, &mut steps), (&b, &mut bare_steps)] {
                for (j, st) in arm.steps.iter().enumerate() {
                    for (k, v) in st.iter().enumerate() {
                        into[j][k].push(*v);
                    }
                }
            }
        }
        let ratio: [f64; 5] = std::array::from_fn(|i| bare_s[i].median() / cryo_s[i].median());
        let paired: [Interval; 5] = std::array::from_fn(|i| {
            Interval::of_blocks(&paired_ratios(&bare_s[i], &cryo_s[i]), LEVEL, BLOCK)
        });
        let overhead_ratio: [f64; 5] =
            std::array::from_fn(|i| overhead[1][i].median() / overhead[0][i].median());
        let overhead_paired: [Interval; 5] = std::array::from_fn(|i| {
            Interval::of_blocks(
                &paired_ratios(&overhead[1][i], &overhead[0][i]),
                LEVEL,
                BLOCK,
            )
        });
        let dump_besides_pages_paired = Interval::of_blocks(
            &paired_ratios(&dump_besides_pages[1], &dump_besides_pages[0]),
            LEVEL,
            BLOCK,
        );
        let fault_modes: [FaultModes; 2] = std::array::from_fn(|k| {
            FaultModes::of(
                [&thaw_host[0].restored_cpu[k], &thaw_host[1].restored_cpu[k]],
                [
                    [&cryo_s[3 + k], &bare_s[3 + k]],
                    [&overhead[0][3 + k], &overhead[1][3 + k]],
                    [&steps[1 + k][1], &bare_steps[1 + k][1]],
                ],
            )
        });
        let [freeze_steps, warm_steps, cold_steps] = steps;
        let [bare_freeze_steps, bare_warm_steps, bare_cold_steps] = bare_steps;
        let row = Row {
            memory_bytes: *size,
            image_bytes,
            rounds: args.rounds,
            limits,
            cryo: cryo_s,
            bare: bare_s,
            ratio,
            paired,
            overhead,
            overhead_ratio,
            overhead_paired,
            sim_copies,
            criu_pages,
            dump_besides_pages,
            dump_besides_pages_paired,
            cryo_freeze_steps: freeze_steps,
            cryo_thaw_warm_steps: warm_steps,
            cryo_thaw_cold_steps: cold_steps,
            cryo_restore_phases: phases,
            cryo_dump_phases: dump_phases,
            cryo_followed_bytes: followed,
            bare_freeze_steps,
            bare_thaw_warm_steps: bare_warm_steps,
            bare_thaw_cold_steps: bare_cold_steps,
            thaw_host,
            fault_modes,
            load_before,
            load_after: load_average(),
            settled: bench.settle,
            jitter_ms: freeze_args.jitter,
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
            "ratio = median bare / median cryo (above 1: cryo faster); paired = bare / cryo of \
             each round (its arms ran back to back), median [{:.0}% bootstrap interval, ABBA \
             blocks of {BLOCK} rounds resampled as units; it does not see what a whole run \
             shares]: a moment is at least at parity only where the interval's low end is; cryo \
             hashes every byte at publish and checks every byte CRIU reads; wedge ledger empty",
            LEVEL * 100.0
        );
        println!("{}", load_line("end", load_average()));
    }
    Ok(())
}

fn gbps(bytes: u64, ms: f64) -> f64 {
    bytes as f64 / (ms / 1e3) / 1e9
}

fn print_row(row: &Row) {
    let l = &row.limits;
    println!(
        "{}: image {}; the disk for {}: write+fsync {:.2} GB/s, read cold {:.2} GB/s, page \
         cache {:.2} GB/s",
        fmt_bytes(row.memory_bytes),
        fmt_bytes(row.image_bytes),
        fmt_bytes(l.bytes),
        l.write_fsync / 1e9,
        l.read_cold / 1e9,
        l.read_cached / 1e9,
    );
    println!(
        "  {:<28} {:>22} {:>22} {:>7}  {}",
        "moment",
        "cryo ms",
        "bare ms",
        "ratio",
        format_args!("paired: median [{:.0}% interval]", LEVEL * 100.0)
    );
    for (i, m) in MOMENTS.iter().enumerate() {
        println!(
            "  {:<28} {:>22} {:>22} {:>6.2}x  {}",
            m,
            row.cryo[i].cell(),
            row.bare[i].cell(),
            row.ratio[i],
            row.paired[i].cell()
        );
    }
    println!(
        "  each moment less the simulated driver's device-memory copies before it in its arm \
         (the same work in both arms, and the noisy part: first-touch page faults): each \
         route's own cost"
    );
    for (i, m) in MOMENTS.iter().enumerate() {
        println!(
            "  {:<28} {:>22} {:>22} {:>6.2}x  {}",
            format!("{m}, overhead"),
            row.overhead[0][i].cell(),
            row.overhead[1][i].cell(),
            row.overhead_ratio[i],
            row.overhead_paired[i].cell()
        );
    }
    let copy = |j: usize| {
        format!(
            "cryo {}, bare {} ms, paired {}",
            row.sim_copies[0][j].cell(),
            row.sim_copies[1][j].cell(),
            Interval::of_blocks(
                &paired_ratios(&row.sim_copies[1][j], &row.sim_copies[0][j]),
                LEVEL,
                BLOCK
            )
            .cell()
        )
    };
    println!(
        "  the simulated driver's copies, median (min-max): checkpoint {}; restore page cache \
         {}; cold {}",
        copy(0),
        copy(1),
        copy(2)
    );
    let [hc, hb] = &row.thaw_host;
    println!(
        "  host memory at each freeze's start (medians{}): free cryo {:.0}, bare {:.0} MiB; page \
         cache cryo {:.0}, bare {:.0} MiB",
        if row.settled {
            ", after the settle step"
        } else {
            ", no settle step"
        },
        hc.freeze_host[0].median(),
        hb.freeze_host[0].median(),
        hc.freeze_host[1].median(),
        hb.freeze_host[1].median(),
    );
    let [pc, pb] = row.criu_pages.each_ref().map(Samples::median);
    let [oc, ob] = row.dump_besides_pages.each_ref().map(Samples::median);
    println!(
        "  CRIU's page loop in the dump (CRIU's own timing, its stats-dump; the same pages in \
         both arms, moved at the host's speed), medians: cryo {pc:.0}, bare {pb:.0} ms; the dump \
         step (GPU free to worker gone) besides it: cryo {oc:.0}, bare {ob:.0} ms, {:.2}x  {}",
        ob / oc,
        row.dump_besides_pages_paired.cell()
    );
    let med = |s: &[Samples; 3]| s.each_ref().map(Samples::median);
    let [sp, d, p] = med(&row.cryo_freeze_steps);
    let [wv, wc, wg] = med(&row.cryo_thaw_warm_steps);
    let [cv, cc, cg] = med(&row.cryo_thaw_cold_steps);
    let img = row.image_bytes;
    println!(
        "  cryo's steps (medians): freeze = suspend {sp:.0} + dump {d:.0} + publish {p:.0} ms; \
         thaw = checks {wv:.0} + CRIU restore {wc:.0} + GPU {wg:.0} ms (cold: {cv:.0} + {cc:.0} + \
         {cg:.0})"
    );
    let ph = |k: usize| {
        row.cryo_restore_phases[k]
            .iter()
            .zip(PHASES)
            .map(|(s, name)| phase_cell(name, s))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "  cryo's CRIU restore, ms from its start (medians): page cache: {}; cold: {}",
        ph(0),
        ph(1)
    );
    let dump = row
        .cryo_dump_phases
        .iter()
        .zip(DUMP_PHASES)
        .map(|(s, name)| phase_cell(name, s))
        .collect::<Vec<_>>()
        .join(", ");
    println!(
        "  cryo's dump, ms from its start (medians): {dump}; {}",
        followed_cell(&row.cryo_followed_bytes, img)
    );
    let [bs, bd, bf] = med(&row.bare_freeze_steps);
    let [_, bwc, bwg] = med(&row.bare_thaw_warm_steps);
    let [_, bcc, bcg] = med(&row.bare_thaw_cold_steps);
    println!(
        "  bare steps (medians):   freeze = suspend {bs:.0} + dump {bd:.0} + fsync {bf:.0} ms; \
         thaw = criu restore {bwc:.0} + GPU {bwg:.0} ms (cold: {bcc:.0} + {bcg:.0})"
    );
    let m = |s: &Samples| s.median();
    println!(
        "  each thaw's CRIU restore (medians): the restored root's CPU ms (CRIU's restorer \
         faults its memory in) page cache cryo {:.0}, bare {:.0}; cold cryo {:.0}, bare {:.0}; \
         host memory free at the thaw's start page cache cryo {:.0}, bare {:.0} MiB; cold cryo \
         {:.0}, bare {:.0} MiB; page-cache thaw started {:.0} (cryo) and {:.0} (bare) ms after \
         the worker was gone",
        m(&hc.restored_cpu[0]),
        m(&hb.restored_cpu[0]),
        m(&hc.restored_cpu[1]),
        m(&hb.restored_cpu[1]),
        m(&hc.free_mib[0]),
        m(&hb.free_mib[0]),
        m(&hc.free_mib[1]),
        m(&hb.free_mib[1]),
        m(&hc.thaw_after_gone),
        m(&hb.thaw_after_gone),
    );
    let fm = |k: usize| {
        let f = &row.fault_modes[k];
        format!(
            "slow cryo {}/{n}, bare {}/{n} (median {:.0} ms); like with like, the {} rounds \
             whose restores both ran fast: thaw {}, overhead {}, CRIU step {}",
            f.slow[0],
            f.slow[1],
            f.median_cpu,
            f.like_rounds,
            f.like_paired[0].cell(),
            f.like_paired[1].cell(),
            f.like_paired[2].cell(),
            n = row.rounds,
        )
    };
    println!(
        "  each thaw's restore by its fault mode (slow: the restorer's CPU over {SLOW_FAULT}x the \
         median of both arms' restores, the hypervisor's faults, at random in either arm), \
         paired bare/cryo: page cache: {}; cold: {}",
        fm(0),
        fm(1)
    );
    println!(
        "  throughput of the dump (image bytes / time): cryo to every byte received {:.2}, to \
         CRIU's exit {:.2}; bare CRIU into the page cache {:.2} GB/s (page cache read {:.2})",
        gbps(img, row.cryo_dump_phases[0].median()),
        gbps(img, row.cryo_dump_phases[3].median()),
        gbps(img, bd),
        l.read_cached / 1e9,
    );
    println!(
        "  throughput (image bytes / time): published+durable cryo {:.2}, bare {:.2} GB/s \
         (disk write+fsync {:.2}); publish step alone {:.2} GB/s",
        gbps(img, row.cryo[2].median()),
        gbps(img, row.bare[2].median()),
        l.write_fsync / 1e9,
        gbps(img, p),
    );
    println!(
        "  throughput of cryo's CRIU restore (every byte read and checked): page cache {:.2} GB/s \
         (page cache read {:.2}), cold {:.2} GB/s (cold read {:.2})",
        gbps(img, wc),
        l.read_cached / 1e9,
        gbps(img, cc),
        l.read_cold / 1e9,
    );
}

/// One phase's median as printed: `name ms`, or `name n/a (why)` where cryo's report had no
/// such moment in any round (a dump's `hashed_ms` when CRIU wrote the files itself).
fn phase_cell(name: &str, s: &Samples) -> String {
    let short = name.trim_end_matches("_ms");
    let median = s.median();
    if !median.is_nan() {
        return format!("{short} {median:.0}");
    }
    let why = match name {
        "hashed_ms" => "CRIU wrote the files itself: its follower hashed them as they came",
        _ => "not in cryo's report",
    };
    format!("{short} n/a ({why})")
}

/// What cryo's follower hashed while CRIU wrote the image (median of `followed`, bytes) against
/// the image's `image_bytes`: publish hashed only the rest.
fn followed_cell(followed: &Samples, image_bytes: u64) -> String {
    let median = followed.median();
    if median.is_nan() {
        return "followed n/a (not in cryo's report: publish hashed every byte)".to_string();
    }
    format!(
        "the follower hashed {} of the image's {} while CRIU wrote it (publish hashed the rest)",
        fmt_bytes(median as u64),
        fmt_bytes(image_bytes)
    )
}

pub(crate) struct Arm {
    /// Per moment ([`MOMENTS`]), ms.
    pub(crate) moments: [f64; 5],
    /// The simulated driver's device-memory copies of the arm's worker, ms, as the driver timed
    /// them ([`cryo_sim::proto::MemCopy`]): the checkpoint's (before GPU free, so before every
    /// freeze moment), the page-cache thaw's restore, the cold thaw's restore.
    copies: [f64; 3],
    /// Freeze, warm thaw, cold thaw steps (see [`Row`]).
    steps: [[f64; 3]; 3],
    /// cryo's CRIU restore phases ([`PHASES`]), warm then cold; NaN for the bare route.
    phases: [[f64; 5]; 2],
    /// cryo's dump phases ([`DUMP_PHASES`]); NaN for the bare route.
    dump_phases: [f64; 5],
    /// Bytes cryo's follower hashed before publish (`dump_phases.followed_bytes`); NaN for the
    /// bare route.
    followed_bytes: f64,
    /// CPU ms of the restored root's main thread when each thaw answered: page cache, cold.
    restored_cpu: [f64; 2],
    /// `MemFree` (MiB) when each thaw started: page cache, cold.
    free_mib: [f64; 2],
    /// ms from the worker gone to the start of the page-cache thaw.
    thaw_after_gone: f64,
    /// `MemFree` and `Cached` (MiB) when the freeze started (after [`Bench::settle`]).
    freeze_host: [f64; 2],
    image_bytes: u64,
    /// CRIU's page loop in the freeze's dump, ms, as CRIU timed it (its `stats-dump`:
    /// [`cryo_criu::stats::DumpStats::memdump_ms`]).
    criu_pages: f64,
}

impl Arm {
    /// Each moment less the copies before it in its phase (the freeze's checkpoint, each
    /// thaw's restore).
    fn overhead(&self) -> [f64; 5] {
        let [checkpoint, warm, cold] = self.copies;
        let m = self.moments;
        [
            m[0] - checkpoint,
            m[1] - checkpoint,
            m[2] - checkpoint,
            m[3] - warm,
            m[4] - cold,
        ]
    }

    /// The dump step (GPU free to worker gone) less CRIU's page loop: what each route adds to
    /// moving the pages (its set-up, CRIU's start and seize, the gate, the kill, the wait for
    /// the worker's end).
    fn dump_besides_pages(&self) -> f64 {
        self.moments[1] - self.moments[0] - self.criu_pages
    }
}

/// CRIU's page loop of the dump into `dir`, ms (its `stats-dump`).
fn criu_pages(dir: &Path) -> anyhow::Result<f64> {
    let stats =
        cryo_criu::stats::DumpStats::read(dir).context("reading CRIU's statistics of the dump")?;
    Ok(stats.memdump_ms)
}

/// ms the simulated driver spent copying `pid`'s device memory `kind`-wise in copies that
/// started at `from` or later: one phase's copies, when asked right after it.
fn copy_ms(
    copies: &[cryo_sim::proto::MemCopy],
    pid: i32,
    kind: cryo_sim::proto::CopyKind,
    from: Moment,
) -> anyhow::Result<f64> {
    let mine: Vec<_> = copies
        .iter()
        .filter(|c| c.pid == pid && c.kind == kind && c.start >= from)
        .collect();
    ensure!(
        !mine.is_empty(),
        "the simulated driver reports no {kind:?} copy of worker {pid}"
    );
    Ok(mine.iter().map(|c| c.end.ms_since(c.start)).sum())
}

/// One thaw of either route, to the first answered health request.
struct Thawed {
    /// ms to the answer.
    wall: f64,
    /// The restore's copies of device memory ([`copy_ms`]), ms.
    copy: f64,
    /// The arm's thaw steps (see [`Row`]).
    steps: [f64; 3],
    /// cryo's CRIU restore phases ([`PHASES`]); NaN for the bare route.
    phases: [f64; 5],
    /// CPU ms of the restored root's main thread at the answer ([`main_thread_cpu`]).
    restored_cpu: f64,
    /// `MemFree` (MiB) when the thaw started.
    free_mib: f64,
}

pub(crate) struct Bench {
    dir: PathBuf,
    exe: PathBuf,
    criu: PathBuf,
    sim: PrivateSim,
    started: std::cell::Cell<usize>,
    /// `--thaw-after-gone`: the earliest start of a page-cache thaw after the worker was gone.
    pub(crate) thaw_after_gone: Option<Duration>,
    /// Whether each measured phase starts after [`Bench::settle`] (`--settle`).
    pub(crate) settle: bool,
    /// `--jitter`: each measured phase starts after a pause drawn between 0 and this
    /// ([`Bench::settle`]).
    pub(crate) jitter: Option<Duration>,
    /// The state of the pauses' generator (a fixed seed: every run draws the same pauses).
    draws: std::cell::Cell<u64>,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Writes back everything dirty and drops the page cache (host-wide; needs root).
fn drop_caches() -> anyhow::Result<()> {
    rustix::fs::sync();
    fs::write("/proc/sys/vm/drop_caches", "3\n").context("dropping the caches (needs root)")
}

/// fsyncs every file of `dir`, one after the other as `sync FILE...` does, then `dir`.
fn sync_dir(dir: &Path) -> anyhow::Result<()> {
    let mut names: Vec<PathBuf> = fs::read_dir(dir)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    names.sort();
    for p in names.iter().chain(std::iter::once(&dir.to_path_buf())) {
        fs::File::open(p)
            .and_then(|f| f.sync_all())
            .with_context(|| format!("fsync {}", p.display()))?;
    }
    Ok(())
}

impl Bench {
    pub(crate) fn start(dir: &Path, criu: PathBuf, max: u64, cryo: &Path) -> anyhow::Result<Bench> {
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
            thaw_after_gone: None,
            settle: false,
            jitter: None,
            draws: std::cell::Cell::new(0x2545_F491_4F6C_DD1D),
        })
    }

    /// What the disk under the benchmark's directory gives for `bytes`.
    fn limits(&self, bytes: u64) -> anyhow::Result<Limits> {
        let path = self.dir.join("disk-probe");
        let block: Vec<u8> = (0..(1usize << 20))
            .map(|i| (i * 31 + i / 4096) as u8)
            .collect();
        let t = Instant::now();
        let mut f = fs::File::create(&path).context("creating the disk probe")?;
        let mut left = bytes;
        while left > 0 {
            let n = left.min(block.len() as u64) as usize;
            f.write_all(&block[..n])?;
            left -= n as u64;
        }
        f.sync_all()?;
        let write_fsync = bytes as f64 / t.elapsed().as_secs_f64();
        drop(f);
        let read = || -> anyhow::Result<f64> {
            let t = Instant::now();
            let mut f = fs::File::open(&path)?;
            let mut buf = vec![0u8; 4 << 20];
            let mut total = 0u64;
            loop {
                let n = f.read(&mut buf)?;
                if n == 0 {
                    break;
                }
                total += n as u64;
            }
            ensure!(
                total == bytes,
                "the disk probe read {total} of {bytes} bytes"
            );
            Ok(bytes as f64 / t.elapsed().as_secs_f64())
        };
        drop_caches()?;
        let read_cold = read()?;
        let read_cached = read()?;
        fs::remove_file(&path)?;
        Ok(Limits {
            bytes,
            write_fsync,
            read_cold,
            read_cached,
        })
    }

    /// The simulated driver's copies of `pid`'s device memory `kind`-wise since `from`, ms.
    fn sim_copy(
        &self,
        pid: i32,
        kind: cryo_sim::proto::CopyKind,
        from: Moment,
    ) -> anyhow::Result<f64> {
        let copies = cryo_sim::SimControl::new(&self.dir)
            .copies()
            .context("asking the simulated driver for its copies")?;
        copy_ms(&copies, pid, kind, from)
    }

    /// The benchmark's directory (the simulated driver's too).
    pub(crate) fn dir(&self) -> &Path {
        &self.dir
    }

    pub(crate) fn cryo(&self) -> Command {
        let mut c = Command::new(&self.exe);
        c.env("CRYO_GPU", "sim")
            .env("CRYO_SIM_DIR", &self.dir)
            .env("CRYO_STATE_DIR", self.dir.join("state"))
            .env("CRYO_CRIU", &self.criu)
            .env_remove("CRYO_FAILPOINT")
            .stdin(Stdio::null());
        c
    }

    pub(crate) fn run(&self, mut c: Command, what: &str) -> anyhow::Result<String> {
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
    pub(crate) fn worker(
        &self,
        memory: u64,
    ) -> anyhow::Result<(std::process::Child, i32, PathBuf)> {
        let k = self.started.get();
        self.started.set(k + 1);
        let sock = self.dir.join(format!("w{k}.sock"));
        let w = self.sim.spawn_worker(&WorkerOptions {
            exe: &self.exe,
            setsid: true,
            gpu: None,
            memory,
            kv_cache: 0,
            http_unix: Some(&sock),
            ready: self.dir.join(format!("w{k}.ready")),
            log: None,
            timeout: Duration::from_secs(300),
        })?;
        Ok((w.child, w.pid, sock))
    }

    pub(crate) fn stop(&self, pid: i32) -> anyhow::Result<()> {
        let mut c = self.cryo();
        // No deadline: an arm's teardown is not measured, and a 4 GiB checkpoint of memory the
        // host must fault in again took past the default 25 s under load (the run failed).
        c.args(["stop", &pid.to_string(), "--deadline", "0"]);
        self.run(c, "cryo stop")?;
        reap(pid);
        Ok(())
    }

    /// `cryo thaw` of the worker `pid` to the first answered health request.
    fn cryo_thaw(
        &self,
        image: &Path,
        pid: i32,
        sock: &Path,
        memory: u64,
    ) -> anyhow::Result<Thawed> {
        let free_mib = self.settle(memory)?.free_mib as f64;
        let origin = Moment::now();
        let mut c = self.cryo();
        c.arg("thaw").arg(image).args([
            "--json",
            "--health-url",
            &format!("unix:{}:/health", sock.display()),
        ]);
        let out = self.run(c, "cryo thaw")?;
        let restored_cpu = main_thread_cpu(pid);
        let v: serde_json::Value =
            serde_json::from_str(&out).context("parsing cryo thaw --json")?;
        Ok(Thawed {
            wall: thaw_answered(&v, origin)?,
            copy: self.sim_copy(pid, cryo_sim::proto::CopyKind::Restore, origin)?,
            steps: steps(&v, ["verify_ms", "criu_ms", "gpu_restore_ms"]),
            phases: PHASES.map(|k| v["criu_phases"][k].as_f64().unwrap_or(f64::NAN)),
            restored_cpu,
            free_mib,
        })
    }

    pub(crate) fn cryo_arm(&self, memory: u64) -> anyhow::Result<Arm> {
        // Ends the worker (or its restored tree) on any error or panic of this arm.
        let mut workers = Workers::new(&self.dir);
        let (mut child, pid, sock) = self.worker(memory)?;
        workers.hold(pid);
        let host = self.settle(memory)?;
        let image = self.dir.join("cryo-img");
        // The worker's parent reaps it as soon as CRIU ends it, as a real parent does: `cryo
        // freeze` waits for its pids to be free before it reports the image published.
        let reaper = std::thread::spawn(move || child.wait());
        let origin = Moment::now();
        let t = Instant::now();
        let mut c = self.cryo();
        c.args(["freeze", "--json", &pid.to_string(), "--image"])
            .arg(&image);
        let out = self.run(c, "cryo freeze")?;
        let f: serde_json::Value =
            serde_json::from_str(&out).context("parsing cryo freeze --json")?;
        let freeze_steps = steps(&f, ["suspend_ms", "dump_ms", "publish_ms"]);
        let dump_phases = DUMP_PHASES.map(|k| f["dump_phases"][k].as_f64().unwrap_or(f64::NAN));
        let followed_bytes = f["dump_phases"]["followed_bytes"]
            .as_f64()
            .unwrap_or(f64::NAN);
        let [gpu_free, gone, durable] = freeze_moments(&f, origin)?;
        let checkpoint_copy = self.sim_copy(pid, cryo_sim::proto::CopyKind::Checkpoint, origin)?;
        reaper
            .join()
            .map_err(|_| anyhow::anyhow!("the reaper thread panicked"))?
            .context("reaping the frozen worker")?;
        let image_bytes = cryo_criu::image::dir_bytes(&image);
        let pages = criu_pages(&image)?;

        self.wait_to_thaw(t, gone);
        let thaw_after_gone = ms(t.elapsed()) - gone;
        let warm = self.cryo_thaw(&image, pid, &sock, memory)?;
        self.stop(pid)?;
        drop_caches()?;
        let cold = self.cryo_thaw(&image, pid, &sock, memory)?;
        self.stop(pid)?;
        fs::remove_dir_all(&image).context("removing the image")?;
        Ok(Arm {
            moments: [gpu_free, gone, durable, warm.wall, cold.wall],
            copies: [checkpoint_copy, warm.copy, cold.copy],
            steps: [freeze_steps, warm.steps, cold.steps],
            phases: [warm.phases, cold.phases],
            dump_phases,
            followed_bytes,
            restored_cpu: [warm.restored_cpu, cold.restored_cpu],
            free_mib: [warm.free_mib, cold.free_mib],
            thaw_after_gone,
            freeze_host: [host.free_mib as f64, host.cached_mib as f64],
            image_bytes,
            criu_pages: pages,
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

    /// The bare thaw: `criu restore -d`, GPU restore and unlock, health; its steps are 0,
    /// `criu restore`, GPU restore + unlock.
    fn bare_thaw(
        &self,
        image: &Path,
        pid: i32,
        sock: &Path,
        memory: u64,
    ) -> anyhow::Result<Thawed> {
        let free_mib = self.settle(memory)?.free_mib as f64;
        let origin = Moment::now();
        let mut c = self.criu_cmd();
        c.args(["restore", "-d", "-D"])
            .arg(image)
            .args(["-o", "restore.log"]);
        self.run(c, "criu restore")?;
        let criu_ms = Moment::now().ms_since(origin);
        self.compat("restore", pid)?;
        self.compat("unlock", pid)?;
        let gpu_ms = Moment::now().ms_since(origin) - criu_ms;
        let deadline = Instant::now() + Duration::from_secs(60);
        let check = cryo_lifecycle::HealthCheck::Url(format!("unix:{}:/health", sock.display()));
        check
            .wait(deadline.saturating_duration_since(Instant::now()))
            .context("the bare route's worker never answered")?;
        let thaw_ms = Moment::now().ms_since(origin);
        let restored_cpu = main_thread_cpu(pid);
        let copy = self.sim_copy(pid, cryo_sim::proto::CopyKind::Restore, origin)?;
        let handle = ProcHandle::open(pid)?;
        cryo_lifecycle::record_restored(
            &StateDir::new(self.dir.join("state")),
            &handle,
            "cryo bench freeze (criu restore)",
        )
        .with_context(|| format!("journaling the restore of worker {pid}"))?;
        self.stop(pid)?;
        Ok(Thawed {
            wall: thaw_ms,
            copy,
            steps: [0.0, criu_ms, gpu_ms],
            phases: [f64::NAN; 5],
            restored_cpu,
            free_mib,
        })
    }

    pub(crate) fn bare_arm(&self, memory: u64) -> anyhow::Result<Arm> {
        // Ends the worker (or its restored tree) on any error or panic of this arm.
        let mut workers = Workers::new(&self.dir);
        let (mut child, pid, sock) = self.worker(memory)?;
        workers.hold(pid);
        let image = self.dir.join("bare-img");
        fs::create_dir(&image).context("creating the bare route's image directory")?;
        let host = self.settle(memory)?;
        // Each moment is when its tool exited (when a script running them would know), on the
        // clock cryo's moments are read on, from the same kind of origin: the first launch.
        let origin = Moment::now();
        let t = Instant::now();
        self.compat("lock", pid)?;
        self.compat("checkpoint", pid)?;
        let gpu_free = Moment::now().ms_since(origin);
        // Opened before the dump: the worker's own pidfd says when it has exited.
        let handle = ProcHandle::open(pid)?;
        let mut c = self.criu_cmd();
        c.args(["dump", "-t", &pid.to_string(), "-D"])
            .arg(&image)
            .args(["-o", "dump.log"]);
        self.run(c, "criu dump")?;
        // CRIU kills the tree and waits for every task it killed before it exits, so this is
        // at once; taken by pidfd all the same, as cryo's moment is (see the module docs).
        ensure!(
            handle.wait_exit(Duration::from_secs(30)),
            "worker {pid} still alive 30 s after `criu dump`"
        );
        let gone = Moment::now().ms_since(origin);
        sync_dir(&image)?;
        let pages = criu_pages(&image)?;
        let durable = Moment::now().ms_since(origin);
        let checkpoint_copy = self.sim_copy(pid, cryo_sim::proto::CopyKind::Checkpoint, origin)?;
        child.wait().context("reaping the frozen worker")?;

        self.wait_to_thaw(t, gone);
        let thaw_after_gone = ms(t.elapsed()) - gone;
        let warm = self.bare_thaw(&image, pid, &sock, memory)?;
        drop_caches()?;
        let cold = self.bare_thaw(&image, pid, &sock, memory)?;
        fs::remove_dir_all(&image).context("removing the image")?;
        Ok(Arm {
            moments: [gpu_free, gone, durable, warm.wall, cold.wall],
            copies: [checkpoint_copy, warm.copy, cold.copy],
            steps: [
                [gpu_free, gone - gpu_free, durable - gone],
                warm.steps,
                cold.steps,
            ],
            phases: [warm.phases, cold.phases],
            dump_phases: [f64::NAN; 5],
            followed_bytes: f64::NAN,
            restored_cpu: [warm.restored_cpu, cold.restored_cpu],
            free_mib: [warm.free_mib, cold.free_mib],
            thaw_after_gone,
            freeze_host: [host.free_mib as f64, host.cached_mib as f64],
            image_bytes: 0,
            criu_pages: pages,
        })
    }

    /// The step both arms take right before each measured phase (the freeze, each thaw), in
    /// this one place so that both are treated alike (see the module docs): fault in as much
    /// memory as the phase's worker will take ([`SETTLE_MARGIN`] more), on huge pages as the
    /// simulated driver's host copy asks, and free it. The memory the phase then faults in
    /// (the checkpoint's host copy, CRIU's restore of the worker) is the host's memory freed a
    /// moment ago in both arms, never memory the VM's balloon has since handed back to the
    /// hypervisor (which costs several times more to fault in again, how much depending on
    /// how long ago it was freed: the arms' copies swung by 2x and more with it). Returns the
    /// host's memory at its end: what the phase starts with.
    ///
    /// With `--jitter`, a pause drawn between 0 and its value comes first, never timed: the
    /// phase's start then falls at a random time after the frees before it, in both arms alike.
    fn settle(&self, memory: u64) -> anyhow::Result<HostMemory> {
        if let Some(jitter) = self.jitter {
            // xorshift64*: uniform enough for a pause.
            let mut x = self.draws.get();
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            self.draws.set(x);
            let u = (x.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64;
            std::thread::sleep(jitter.mul_f64(u));
        }
        if self.settle {
            let len = usize::try_from(memory.saturating_add(SETTLE_MARGIN))
                .context("the settle step's size")?;
            let mut ballast = vec![0u8; len];
            cryo_sim::advise_huge_pages(&mut ballast);
            // Every page written (a read would map the shared zero page): each is faulted in.
            ballast.fill(1);
            std::hint::black_box(&mut ballast);
        }
        Ok(HostMemory::now())
    }

    /// Waits until `--thaw-after-gone` ms after the worker was gone (`gone` ms after `t`), if
    /// asked to and not already past it.
    fn wait_to_thaw(&self, t: Instant, gone: f64) {
        let Some(after) = self.thaw_after_gone else {
            return;
        };
        let gone = Duration::from_secs_f64((gone / 1e3).max(0.0));
        if let Some(left) = (t + gone + after).checked_duration_since(Instant::now()) {
            std::thread::sleep(left);
        }
    }

    pub(crate) fn ledger_empty(&self) -> anyhow::Result<()> {
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

/// cryo's freeze moments, GPU free, worker gone, published and durable, ms from `origin` (the
/// instant `cryo freeze` was launched), from the absolute `CLOCK_MONOTONIC` times of its
/// `--json` report (`moments`): all of its start is counted, nothing after the moment is.
fn freeze_moments(report: &serde_json::Value, origin: Moment) -> anyhow::Result<[f64; 3]> {
    let m = &report["moments"];
    let at = |k: &str| -> anyhow::Result<f64> {
        let ns = m[k]
            .as_u64()
            .with_context(|| format!("cryo freeze --json reports no moments.{k}: {report}"))?;
        let ms = Moment(ns).ms_since(origin);
        ensure!(
            ms >= 0.0,
            "cryo freeze reports moments.{k} {ms:.3} ms before it was launched"
        );
        Ok(ms)
    };
    Ok([at("gpu_free")?, at("worker_gone")?, at("published")?])
}

/// cryo's thaw moment, its first answered health request, ms from `origin` (the instant `cryo
/// thaw` was launched), from the `first_answer_at` of its `--json` report.
fn thaw_answered(report: &serde_json::Value, origin: Moment) -> anyhow::Result<f64> {
    let ns = report["first_answer_at"]
        .as_u64()
        .with_context(|| format!("cryo thaw --json reports no first_answer_at: {report}"))?;
    let ms = Moment(ns).ms_since(origin);
    ensure!(
        ms >= 0.0,
        "cryo thaw reports its first answer {ms:.3} ms before it was launched"
    );
    Ok(ms)
}

fn steps(v: &serde_json::Value, keys: [&str; 3]) -> [f64; 3] {
    keys.map(|k| v[k].as_f64().unwrap_or(f64::NAN))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A restore whose restorer took twice the CPU (the hypervisor's slow faults), in either
    /// arm, is counted for its arm and its round is left out of the like-with-like ratios; an
    /// unreadable CPU (NaN) is never taken for the slow mode.
    #[test]
    fn a_round_with_a_slow_fault_restore_in_either_arm_is_left_out_of_like_with_like() {
        let cpu_cryo = Samples(vec![350.0, 760.0, 340.0, 360.0, 355.0, f64::NAN]);
        let cpu_bare = Samples(vec![365.0, 350.0, 345.0, 740.0, 362.0, 358.0]);
        // cryo 20 ms slower in every fast round; a slow round doubles its restore.
        let cryo = Samples(vec![420.0, 800.0, 420.0, 420.0, 420.0, 420.0]);
        let bare = Samples(vec![400.0, 400.0, 400.0, 790.0, 400.0, 400.0]);
        let f = FaultModes::of([&cpu_cryo, &cpu_bare], [[&cryo, &bare]; 3]);
        assert_eq!(f.slow, [1, 1]);
        assert_eq!(f.like_rounds, 4);
        for i in &f.like_paired {
            assert_eq!(i.samples, 4);
            for v in [i.median, i.low, i.high] {
                assert!((v - 400.0 / 420.0).abs() < 1e-9, "{i:?}");
            }
        }
        // All rounds: the slow ones pull the interval apart.
        let all = Interval::of_blocks(&paired_ratios(&bare, &cryo), LEVEL, BLOCK);
        assert!(all.high - all.low > 0.5, "{all:?}");
    }

    /// cryo's moments are its report's absolute clocks less the benchmark's origin: what came
    /// before its own start is counted, its exit (long after, here) is not.
    #[test]
    fn cryo_moments_are_its_clocks_from_the_launch() {
        let origin = Moment(5_000_000_000);
        let report = serde_json::json!({
            "gpu_free_ms": 100,
            "worker_gone_ms": 300,
            "elapsed_ms": 900,
            "moments": {
                "started": 5_040_000_000_u64,
                "gpu_free": 5_140_500_000_u64,
                "worker_gone": 5_340_000_000_u64,
                "published": 5_700_250_000_u64,
            },
        });
        let [gpu_free, gone, durable] = freeze_moments(&report, origin).unwrap();
        assert!((gpu_free - 140.5).abs() < 1e-9, "{gpu_free}");
        assert!((gone - 340.0).abs() < 1e-9, "{gone}");
        assert!((durable - 700.25).abs() < 1e-9, "{durable}");
        let thaw = serde_json::json!({"first_answer_at": 5_012_000_000_u64});
        assert!((thaw_answered(&thaw, origin).unwrap() - 12.0).abs() < 1e-9);
    }

    /// A report without the clocks (an older cryo) or with one before the launch (another
    /// clock, another boot) is an error, never a moment made up from elapsed times.
    #[test]
    fn a_report_without_clocks_or_with_one_before_the_launch_is_refused() {
        let origin = Moment(5_000_000_000);
        let old = serde_json::json!({"gpu_free_ms": 100, "worker_gone_ms": 300});
        let e = freeze_moments(&old, origin).unwrap_err().to_string();
        assert!(e.contains("moments.gpu_free"), "{e}");
        let early = serde_json::json!({"moments": {
            "gpu_free": 4_999_000_000_u64, "worker_gone": 5_100_000_000_u64,
            "published": 5_200_000_000_u64,
        }});
        let e = freeze_moments(&early, origin).unwrap_err().to_string();
        assert!(e.contains("before it was launched"), "{e}");
        let e = thaw_answered(&serde_json::json!({}), origin)
            .unwrap_err()
            .to_string();
        assert!(e.contains("first_answer_at"), "{e}");
    }

    /// A phase's copies are the worker's own of that kind since the phase's origin, summed (a
    /// worker of several contexts); a phase without one is an error, never a zero taken off.
    #[test]
    fn a_phase_takes_off_the_copies_of_its_worker_since_its_origin() {
        use cryo_sim::proto::{CopyKind, MemCopy};
        let c = |pid, kind, start: u64, end: u64| MemCopy {
            pid,
            kind,
            bytes: 1,
            start: Moment(start),
            end: Moment(end),
        };
        let copies = [
            c(7, CopyKind::Checkpoint, 1_000_000, 90_000_000), // an earlier phase
            c(7, CopyKind::Checkpoint, 100_000_000, 150_000_000),
            c(7, CopyKind::Checkpoint, 150_000_000, 175_500_000),
            c(8, CopyKind::Checkpoint, 100_000_000, 900_000_000), // another worker
            c(7, CopyKind::Restore, 200_000_000, 260_000_000),
        ];
        let origin = Moment(100_000_000);
        let ms = copy_ms(&copies, 7, CopyKind::Checkpoint, origin).unwrap();
        assert!((ms - 75.5).abs() < 1e-9, "{ms}");
        let ms = copy_ms(&copies, 7, CopyKind::Restore, origin).unwrap();
        assert!((ms - 60.0).abs() < 1e-9, "{ms}");
        let e = copy_ms(&copies, 9, CopyKind::Restore, origin).unwrap_err();
        assert!(e.to_string().contains("no Restore copy of worker 9"), "{e}");
        let arm = Arm {
            moments: [200.0, 400.0, 600.0, 300.0, 700.0],
            copies: [75.5, 60.0, 80.0],
            steps: Default::default(),
            phases: [[f64::NAN; 5]; 2],
            dump_phases: [f64::NAN; 5],
            followed_bytes: f64::NAN,
            restored_cpu: [0.0; 2],
            free_mib: [0.0; 2],
            thaw_after_gone: 0.0,
            freeze_host: [0.0; 2],
            image_bytes: 0,
            criu_pages: 150.0,
        };
        assert_eq!(arm.overhead(), [124.5, 324.5, 524.5, 240.0, 620.0]);
        assert_eq!(arm.dump_besides_pages(), 50.0);
    }

    /// A phase cryo's report never had prints as n/a with its reason, never as NaN.
    #[test]
    fn a_missing_phase_prints_na_with_its_reason() {
        let none = Samples(vec![f64::NAN, f64::NAN]);
        let cell = phase_cell("hashed_ms", &none);
        assert!(
            cell.starts_with("hashed n/a (CRIU wrote the files"),
            "{cell}"
        );
        assert!(!cell.contains("NaN"), "{cell}");
        let gib = f64::from(1u32 << 30);
        let followed = followed_cell(&Samples(vec![3.0 * gib, 2.0 * gib, 2.5 * gib]), 4 << 30);
        assert!(
            followed.contains("hashed 2.5 GiB of the image's 4 GiB"),
            "{followed}"
        );
        assert!(followed_cell(&none, 1 << 30).contains("n/a"));
        assert_eq!(phase_cell("gate_ms", &Samples(vec![12.4])), "gate 12");
        assert!(phase_cell("gate_ms", &none).contains("n/a"));
    }
}
