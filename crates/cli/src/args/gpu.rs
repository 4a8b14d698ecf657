//! `cryo gpu ...`: one subcommand per call of the driver's checkpoint API, plus NVML-style listings.

use clap::{Args, Subcommand};

use super::{parse_pid, GpuMap};

/// `cryo gpu`.
#[derive(Debug, Args)]
pub struct GpuArgs {
    /// Which call.
    #[command(subcommand)]
    pub command: GpuCommand,
}

/// `cryo gpu <command>`.
#[derive(Debug, Subcommand)]
pub enum GpuCommand {
    /// Lists GPUs: index, UUID, name, total and free device memory.
    Ls(OutputArgs),
    /// Lists processes holding device memory, with each pid's checkpoint state.
    Ps(OutputArgs),
    /// Prints a process's checkpoint state (`running`, `locked`, `checkpointed`, `failed`).
    State(PidArgs),
    /// Locks a running process: blocks its CUDA calls and waits for work in flight.
    Lock(LockArgs),
    /// Checkpoints a locked process: device memory moves into its host memory.
    Checkpoint(PidArgs),
    /// Restores a checkpointed process onto its GPUs (or others with --gpu-map); leaves it locked.
    Restore(RestoreArgs),
    /// Unlocks a locked process.
    Unlock(PidArgs),
    /// Prints the tid of the driver's restore thread inside a process.
    RestoreTid(PidArgs),
}

/// Output format.
#[derive(Debug, Clone, Args)]
pub struct OutputArgs {
    /// Print JSON instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A target process.
#[derive(Debug, Clone, Args)]
pub struct PidArgs {
    /// The process (host pid).
    #[arg(short, long, value_parser = parse_pid)]
    pub pid: cryo_proc::Pid,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

/// `cryo gpu lock`.
#[derive(Debug, Clone, Args)]
pub struct LockArgs {
    /// The target.
    #[command(flatten)]
    pub target: PidArgs,
    /// Give up after MS milliseconds of waiting for work in flight (the process stays running);
    /// 0 or absent waits without limit, as the driver does.
    #[arg(short, long, value_name = "MS")]
    pub timeout: Option<u32>,
}

/// `cryo gpu restore`.
#[derive(Debug, Clone, Args)]
pub struct RestoreArgs {
    /// The target.
    #[command(flatten)]
    pub target: PidArgs,
    /// Restore onto other GPUs: comma-separated OLD=NEW pairs, each side a GPU UUID
    /// (`GPU-xxxxxxxx-...`) or an index of `cryo gpu ls` on this host (`0=1`).
    #[arg(long, value_name = "OLD=NEW,...", value_parser = clap::value_parser!(GpuMap))]
    pub gpu_map: Option<GpuMap>,
}
