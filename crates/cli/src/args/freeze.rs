//! `cryo freeze` and `cryo thaw`: arguments only, validated without system calls.

use std::path::PathBuf;

use clap::Args;

use super::{parse_pid, GpuMap};

/// Printed after `cryo freeze --help`.
pub const FREEZE_AFTER_HELP: &str = "\
Every CUDA process of the tree is locked and checkpointed in parallel and checked through NVML,
then CRIU dumps the tree into DIR.tmp-* next to DIR; the files are hashed and fsync'd, a manifest
is written and the directory is renamed to DIR. A crash leaves either no image or a whole one.
If a CUDA process cannot be suspended, nothing is dumped and the worker keeps serving.

The root must lead its own session (start the worker with `setsid`), and no process of the tree
may be traced (by `cryo guard` or a debugger). Needs root and CRIU >= 4.0
(scripts/install-criu.sh; CRYO_CRIU names another binary).";

/// `cryo freeze`.
#[derive(Debug, Clone, Args)]
#[command(after_help = FREEZE_AFTER_HELP)]
pub struct FreezeArgs {
    /// Root of the process tree to freeze (the worker; it and every descendant are frozen).
    #[arg(value_name = "PID", value_parser = parse_pid)]
    pub pid: cryo_proc::Pid,
    /// Image directory to publish (must not exist, unless --replace).
    #[arg(long, value_name = "DIR")]
    pub image: PathBuf,
    /// Keep the worker running afterwards: its CUDA processes are restored and unlocked in place
    /// (and journaled as restored).
    #[arg(long)]
    pub leave_running: bool,
    /// Replace an existing image at DIR (atomically: DIR holds the old or the new image).
    #[arg(long)]
    pub replace: bool,
    /// Timeout of one lock attempt, in milliseconds (the wait for GPU work in flight).
    #[arg(long, value_name = "MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Shrink the engine first.
    #[command(flatten)]
    pub shrink: super::ShrinkArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// Printed after `cryo thaw --help`.
pub const THAW_AFTER_HELP: &str = "\
Before anything runs: the manifest and the SHA-256 of every file are checked (a corrupt, truncated
or foreign image is refused, naming the file), and so is this host: same GPU model, compatible
driver, GPUs not quarantined, enough free device memory on the target GPUs, every pid of the image
free. Then CRIU restores the tree, every CUDA process is restored onto its GPUs (in parallel) and
unlocked, and the health check runs. If anything fails after the CRIU restore, the restored
processes are suspended and then removed (never killed with a live context).

The restored worker is detached: it outlives `cryo thaw`.";

/// `cryo thaw`.
#[derive(Debug, Clone, Args)]
#[command(after_help = THAW_AFTER_HELP)]
pub struct ThawArgs {
    /// The image directory (as published by `cryo freeze`).
    #[arg(value_name = "DIR")]
    pub image: PathBuf,
    /// Restore onto other GPUs: OLD=NEW pairs (UUIDs, or indices of `cryo gpu ls` on this host).
    #[arg(long, value_name = "OLD=NEW,...", conflicts_with = "gpus_of")]
    pub gpu_map: Option<GpuMap>,
    /// Restore onto the GPUs this process's container was given (Kubernetes: its
    /// NVIDIA_VISIBLE_DEVICES or CDI names, by UUID; a container given GPUs by index is
    /// refused): each GPU of the image onto a distinct one of them, a GPU given again keeping
    /// its place.
    #[arg(long, value_name = "PID", value_parser = parse_pid)]
    pub gpus_of: Option<cryo_proc::Pid>,
    /// Healthy when a GET of this http:// URL answers 2xx.
    #[arg(long, value_name = "URL", conflicts_with = "health_cmd")]
    pub health_url: Option<String>,
    /// Healthy when this shell command exits 0.
    #[arg(long, value_name = "CMD")]
    pub health_cmd: Option<String>,
    /// Seconds the health check may take before the thaw is undone.
    #[arg(long, value_name = "S", default_value_t = 60)]
    pub health_timeout: u64,
    /// Seconds CRIU's restore may take before it is killed with what it restored (nothing of
    /// which ran); default: 120 plus the image at 50 MB/s.
    #[arg(long, value_name = "S")]
    pub criu_timeout: Option<u64>,
    /// How the engine takes its memory back once the tree runs (default: as the image records
    /// the shrink it was frozen after).
    #[command(flatten)]
    pub shrink: super::GrowArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
