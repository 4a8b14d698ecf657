//! `cryo park` and `cryo wake`: arguments only, validated without system calls.

use std::path::PathBuf;

use clap::{Args, ValueEnum};
use cryo_gpu::GpuUuid;

use super::parse_pid;
use cryo_units::ByteSize;

/// Printed after `cryo park --help`.
pub const PARK_AFTER_HELP: &str = "\
Every CUDA process of the target is locked (in parallel), checkpointed (in parallel) and checked
through NVML to hold no device memory: its GPU is free, the process stays alive in host memory
(its resident memory grows by its device memory). If any process cannot be suspended, the ones
that were are brought back and the worker keeps serving. `cryo wake` brings it back; a parked
worker can also be stopped (`cryo stop`) or frozen (`cryo freeze`).

Exit codes: 0 parked; 1 error; 3 refused (nothing parked, the worker serves).";

/// Printed after `cryo wake --help`.
pub const WAKE_AFTER_HELP: &str = "\
Before anything is restored: the GPU quarantine (a fenced GPU takes no wake) and the free device
memory of the GPU each process goes to (a restore short of memory leaves a process stuck
CHECKPOINTED for good). Then every parked process is restored (in parallel), traced by the running
guard while still locked (if it cannot be traced, it is parked again instead of unlocked), and
unlocked. Without a running guard, nothing guards the woken worker, as after `cryo thaw`.

Exit codes: 0 serving; 1 error; 3 refused (nothing restored, the worker stays parked).";

/// What to act on: the processes of a park or a wake.
#[derive(Debug, Clone, Args)]
pub struct TargetArgs {
    /// The processes: one pid is it and its whole process tree; several pids exactly those.
    #[arg(value_name = "PID", value_parser = parse_pid, required_unless_present = "cgroup", conflicts_with = "cgroup")]
    pub pids: Vec<cryo_proc::Pid>,
    /// Every process of this cgroup (a directory under /sys/fs/cgroup), as a container.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Option<PathBuf>,
}

/// `cryo park`.
#[derive(Debug, Clone, Args)]
#[command(after_help = PARK_AFTER_HELP)]
pub struct ParkArgs {
    /// What to park.
    #[command(flatten)]
    pub target: TargetArgs,
    /// Timeout of one lock attempt, in milliseconds (the wait for GPU work in flight).
    #[arg(long, value_name = "MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Lock attempts before refusing because work stays in flight.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub lock_attempts: u32,
    /// Refuse when parked workers would hold more host memory than this (`64GiB`).
    #[arg(long, value_name = "SIZE")]
    pub max_parked_host: Option<ByteSize>,
    /// Shrink the engine first (`cryo wake` grows it again).
    #[command(flatten)]
    pub shrink: super::ShrinkArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `--when-full`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum WhenFullArg {
    /// Wait up to --wait seconds for memory to be freed, then refuse.
    Wait,
    /// Restore onto another allowed GPU of the same model with room.
    OtherGpu,
    /// Refuse at once.
    Refuse,
}

/// How a wake is done (`cryo wake`, `cryo standby claim`).
#[derive(Debug, Clone, Args)]
pub struct WakeHowArgs {
    /// GPUs the wake may use (UUIDs, comma-separated); default: the ones the worker left, and
    /// with --when-full other-gpu any GPU of the node.
    #[arg(long, value_name = "UUID,...", value_delimiter = ',')]
    pub onto: Vec<GpuUuid>,
    /// When the GPU has too little free memory: wait, take another GPU, or refuse.
    #[arg(long, value_enum, default_value_t = WhenFullArg::Refuse)]
    pub when_full: WhenFullArg,
    /// With --when-full wait: seconds to wait for memory.
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub wait: u64,
    /// Healthy when a GET of this http:// (or unix:SOCKET:/PATH) URL answers 2xx.
    #[arg(long, value_name = "URL")]
    pub health_url: Option<String>,
    /// Seconds the health check may take.
    #[arg(long, value_name = "S", default_value_t = 60)]
    pub health_timeout: u64,
}

/// `cryo wake`.
#[derive(Debug, Clone, Args)]
#[command(after_help = WAKE_AFTER_HELP)]
pub struct WakeArgs {
    /// What to wake.
    #[command(flatten)]
    pub target: TargetArgs,
    /// How.
    #[command(flatten)]
    pub how: WakeHowArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
