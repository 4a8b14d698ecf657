//! `cryo bench` and `cryo demo`: arguments only, validated without system calls (the CLI embeds
//! them in its own command line).

use std::path::PathBuf;

use clap::{Args, Subcommand};
use cryo_units::parse_size;

/// `cryo demo`.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Device memory of the demo worker (`512MiB`, `2GiB`, `1000000` bytes...).
    #[arg(long, default_value = "512MiB", value_parser = parse_size)]
    pub memory: u64,
    /// Keep the demo's temporary directory (driver socket, ledger, logs) and print its path.
    #[arg(long)]
    pub keep: bool,
}

/// `cryo bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// What to measure.
    #[command(subcommand)]
    pub command: BenchCommand,
}

/// `cryo bench <what>`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// `cryo stop` against the operators' procedure (one cuda-checkpoint process per action per
    /// pid, serially, plus polling the process listing), for 1, 2 and 4 restored workers, on a
    /// private simulated GPU.
    Stop(BenchStopArgs),
    /// `cryo freeze` and `cryo thaw` against the `criu` command line plus one `cryo cuda-checkpoint`
    /// process per action, for 1 GiB and 4 GiB workers (needs root and CRIU).
    Freeze(BenchFreezeArgs),
    /// Time from a request arriving at a scaled-to-zero worker to its answer: woken from park
    /// through `cryo activate`, `cryo thaw`, and the bare route (`criu restore` + cuda-checkpoint
    /// processes), with the raw driver restore + unlock as the baseline (needs root and CRIU).
    Activate(BenchActivateArgs),
    /// The guard's cost on a worker's request latency (p50/p99, guarded vs not) and the time from
    /// a fatal signal to a suspended exit against a bare suspension, on a private simulated GPU.
    Guard(BenchGuardArgs),
    /// The journal's append latency with a syslog forwarder whose collector is dead (refused,
    /// or accepting and never reading) or live, against no forwarder, in the same run.
    Telemetry(BenchTelemetryArgs),
    /// `cryo stop` through the node agent against standalone `cryo stop`, on a private
    /// simulated GPU with a private agent.
    Agent(BenchStopArgs),
    /// `cryo stop`, `cryo freeze` (root and CRIU) and park + wake of a worker with weights and a
    /// KV cache, with `--shrink vllm:1` against without: time and bytes, side by side.
    Shrink(BenchShrinkArgs),
}

/// `cryo bench shrink`.
#[derive(Debug, Clone, Args)]
pub struct BenchShrinkArgs {
    /// The worker's weights.
    #[arg(long, default_value = "1GiB", value_parser = parse_size)]
    pub weights: u64,
    /// The worker's KV cache.
    #[arg(long, default_value = "3GiB", value_parser = parse_size)]
    pub kv_cache: u64,
    /// Counted rounds per arm, after one warm-up round; which side goes first alternates.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_rounds)]
    pub rounds: usize,
    /// Where the images and sockets go (a temporary directory under it; default: the system's
    /// temp dir).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Print the rows as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `cryo bench stop`.
#[derive(Debug, Clone, Args)]
pub struct BenchStopArgs {
    /// Device memory of each worker.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub memory: u64,
    /// Counted rounds per row, after one warm-up round; the arm that goes first alternates.
    #[arg(long, value_name = "N", default_value_t = 7, value_parser = parse_rounds)]
    pub rounds: usize,
    /// Print the rows as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `--rounds` of the benchmarks: counted rounds, 1 to 1000.
fn parse_rounds(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=1000) => Ok(n),
        _ => Err(format!("{s:?} is not a number of rounds from 1 to 1000")),
    }
}

/// `--batch` of `cryo bench telemetry`: 1 to 10000 appends.
fn parse_batch(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n @ 1..=10_000) => Ok(n),
        _ => Err(format!("{s:?} is not a batch size from 1 to 10000")),
    }
}

/// `cryo bench freeze`.
#[derive(Debug, Clone, Args)]
pub struct BenchFreezeArgs {
    #[command(flatten)]
    pub sizes: BenchSizesArgs,
    /// Start each page-cache thaw no sooner than MS ms after its worker was gone, in both arms
    /// alike (default: at once after the freeze, the arm's own freeze deciding when). Memory
    /// the host freed a moment ago can cost less to fault in again than memory freed longer
    /// ago (a VM's balloon reporting free pages): this takes the freeze's length out of the
    /// thaw's number.
    #[arg(long, value_name = "MS")]
    pub thaw_after_gone: Option<u64>,
    /// Start each freeze and thaw after the settle step, the same in both arms: as much memory
    /// as the phase's worker will take faulted in and freed just before, so that its copies
    /// start on memory the host freed a moment ago rather than memory the VM's balloon has
    /// handed back to the hypervisor (see the module docs; not yet shown to narrow the copies'
    /// spread, so off by default).
    #[arg(long)]
    pub settle: bool,
    /// Start each freeze and thaw of both arms after a pause drawn at random between 0 and MS
    /// (the same distribution for both arms, a fixed seed): the copies' cost depends on how long
    /// before them the host freed memory, and without it that time is set by the arms' own
    /// durations, the same in every round of a run; the pause spreads it over the rounds, so
    /// that the paired interval sees what it does to the copies (see the module docs).
    #[arg(long, value_name = "MS")]
    pub jitter: Option<u64>,
}

/// `cryo bench activate`.
pub type BenchActivateArgs = BenchSizesArgs;

/// What `cryo bench freeze` and `cryo bench activate` take: sizes, where the images go, rounds.
#[derive(Debug, Clone, Args)]
pub struct BenchSizesArgs {
    /// Device memory of the workers, one row each.
    #[arg(long, value_delimiter = ',', default_value = "1GiB,4GiB", value_parser = parse_size)]
    pub sizes: Vec<u64>,
    /// Where the images go (a temporary directory under it; default: the system's temp dir).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Counted rounds per size, after one warm-up round; the order of the arms changes from
    /// round to round.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = parse_rounds)]
    pub rounds: usize,
    /// Print the rows as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `cryo bench telemetry`.
#[derive(Debug, Clone, Args)]
pub struct BenchTelemetryArgs {
    /// Timed appends per arm (each one fdatasync'd, as cryo appends).
    #[arg(long, default_value_t = 2000)]
    pub appends: usize,
    /// Appends per batch; the arms take turns batch by batch, the order alternating.
    #[arg(long, default_value_t = 20, value_parser = parse_batch)]
    pub batch: usize,
    /// Where the bench journals go (a temporary directory under it; default: the system's temp
    /// dir). Put it on the file system of the state directory to measure that one.
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Print the rows as JSON.
    #[arg(long)]
    pub json: bool,
}

/// `cryo bench guard`.
#[derive(Debug, Clone, Args)]
pub struct BenchGuardArgs {
    /// Requests per arm (with and without the guard) in each repeat, sent in 40 batches per arm
    /// that alternate between the arms on the same worker.
    #[arg(long, default_value_t = 4000)]
    pub requests: usize,
    /// Repeats of the whole latency measurement: the p99 ratio is given pooled over all of
    /// them and per repeat (median, min-max, spread), so its stability can be read.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = parse_rounds)]
    pub repeats: usize,
    /// Fatal-signal suspensions to time (and as many bare suspensions), after one warm-up round;
    /// the arm that goes first alternates.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = parse_rounds)]
    pub rounds: usize,
    /// Device memory of the bench worker.
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub memory: u64,
    /// Pin the client (this process's measuring thread) to the first CPU and the worker to the
    /// last one during the latency measurement (the agent runs where the scheduler puts it).
    #[arg(long)]
    pub pin_cpus: bool,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}
