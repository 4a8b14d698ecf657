//! `cryo standby create|list|claim|remove`: arguments only, validated without system calls.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::park::WakeHowArgs;

/// Printed after `cryo standby --help`.
pub const STANDBY_AFTER_HELP: &str = "\
A standby is a worker restored by CRIU from a verified image ahead of demand, without its GPU
restore: its CUDA processes stay CHECKPOINTED (their device memory in host memory, no live
context), so a claim is only the driver's restore, the guard and the unlock. The node agent keeps
the pools (`cryo agent run`) and refills them in the background after each claim.

CRIU restores a worker with the pids and listening ports it had: more than one standby of an
image needs the worker to have run in its own pid and network namespaces (as in a container) when
it was frozen; each standby then gets fresh ones. A standby whose image changed since it was
restored is never handed out; a claim checks the GPU quarantine and free device memory first.

Exit codes: 0 done; 1 error; 3 refused (nothing handed out or changed).";

/// `cryo standby`.
#[derive(Debug, Args)]
#[command(after_help = STANDBY_AFTER_HELP)]
pub struct StandbyArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: StandbyCommand,
}

/// `cryo standby` subcommands.
#[derive(Debug, Subcommand)]
pub enum StandbyCommand {
    /// Keeps N standbys of an image ready (sets the count of an existing pool).
    Create(StandbyCreateArgs),
    /// Lists the pools and their standbys.
    List(JsonArg),
    /// Hands out one standby of an image, woken (restored, guarded, unlocked).
    Claim(StandbyClaimArgs),
    /// Removes a pool; its standbys are removed safely (CHECKPOINTED, verified, killed).
    Remove(StandbyImageArgs),
}

/// `--json`.
#[derive(Debug, Args)]
pub struct JsonArg {
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `cryo standby create`.
#[derive(Debug, Args)]
pub struct StandbyCreateArgs {
    /// The image (a directory published by `cryo freeze`).
    #[arg(long, value_name = "DIR")]
    pub image: PathBuf,
    /// How many standbys to keep ready.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub count: u32,
    /// Seconds each standby's CRIU restore may take before it is killed with what it restored
    /// (nothing of which ran); default: 120 plus the image at 50 MB/s.
    #[arg(long, value_name = "S", value_parser = clap::value_parser!(u64).range(1..))]
    pub criu_timeout: Option<u64>,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `cryo standby claim`.
#[derive(Debug, Args)]
pub struct StandbyClaimArgs {
    /// The image whose pool to claim from.
    #[arg(long, value_name = "DIR")]
    pub image: PathBuf,
    /// How to wake it.
    #[command(flatten)]
    pub how: WakeHowArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `cryo standby remove`.
#[derive(Debug, Args)]
pub struct StandbyImageArgs {
    /// The image whose pool to remove.
    #[arg(long, value_name = "DIR")]
    pub image: PathBuf,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}
