//! Command-line arguments, parsed and validated without any system call.
//!
//! # Design
//! Two phases, as ripgrep does: everything here is pure (clap derive plus value parsers for
//! `--gpu-map`, `--memory`, pids), so malformed input is refused before a driver is loaded or a
//! process is looked at. Resolving against the system (which backend, which GPU index is which
//! UUID, whether a pid exists) happens in `backend.rs` and the handlers in `commands/`.

pub mod activate;
pub mod agent;
pub mod freeze;
pub mod gpu;
pub mod gpu_map;
pub mod guard;
pub mod park;
pub mod run;
pub mod shrink;
pub mod standby;
pub mod stop;

use std::ffi::OsString;
use std::path::PathBuf;

use clap::{ArgAction, Args, Parser, Subcommand};

pub use agent::{AgentArgs, AgentCommand};
pub use cryo_units::ByteSize;
pub use freeze::{FreezeArgs, ThawArgs};
pub use gpu::{GpuArgs, GpuCommand};
pub use gpu_map::GpuMap;
pub use guard::{GuardArgs, GuardRunArgs, StatusArgs};
pub use shrink::{GrowArgs, ShrinkArgs};
pub use stop::{JournalArgs, JournalCommand, SignalArg, StopArgs, TimelineArgs};

use crate::backend::GpuChoice;

/// Printed at the end of `cryo --help`.
const AFTER_HELP: &str = "\
Exit codes:
  0  success
  1  error (the driver refused, the process is in the wrong state, a system call failed...)
  2  usage error (malformed arguments; nothing was done)
  3  `cryo stop` refused: a CUDA process could not be suspended; nothing was killed

`cryo cuda-checkpoint ...` (or cryo installed under the name `cuda-checkpoint`) follows NVIDIA's
conventions instead: exit 0 on success, else the driver's CUresult (modulo 256, never 0).";

/// cryo: checkpoint, restore and guard GPU inference workers.
#[derive(Debug, Parser)]
#[command(name = "cryo", version, about, after_help = AFTER_HELP)]
pub struct Cli {
    /// Options every command takes.
    #[command(flatten)]
    pub global: GlobalArgs,
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command takes. They come before the command (`cryo --gpu sim gpu ls`): not
/// global, because `cryo sim worker` has a `--gpu` of its own (a GPU index).
#[derive(Debug, Clone, Args)]
pub struct GlobalArgs {
    /// GPU backend: `auto` takes the real driver when libcuda loads and sees a GPU, else the
    /// simulated GPU; `cuda` insists on the real one; `sim` insists on the simulated one.
    #[arg(long, env = "CRYO_GPU", value_enum, default_value_t = GpuChoice::Auto)]
    pub gpu: GpuChoice,
    /// Directory of the simulated GPU driver (its control socket and wedge ledger).
    #[arg(long, env = "CRYO_SIM_DIR", value_name = "PATH", default_value_os_t = cryo_sim::default_dir())]
    pub sim_dir: PathBuf,
    /// Directory of cryo's persistent state: the journal (STATE_DIR/journal), the GPU
    /// quarantine, the guard's socket.
    #[arg(
        long,
        env = "CRYO_STATE_DIR",
        value_name = "PATH",
        default_value = cryo_state::DEFAULT_ROOT
    )]
    pub state_dir: PathBuf,
    /// Log to stderr (-v debug, -vv trace).
    #[arg(short, long, action = ArgAction::Count)]
    pub verbose: u8,
}

/// The commands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// GPUs and the CUDA checkpoint API, one call at a time.
    Gpu(GpuArgs),
    /// NVIDIA's `cuda-checkpoint` command line, verbatim (`cryo cuda-checkpoint --help`).
    #[command(name = "cuda-checkpoint", disable_help_flag = true)]
    CudaCheckpoint(CudaCheckpointArgs),
    /// The simulated GPU: driver daemon and sim workers.
    Sim(SimArgs),
    /// Shows the checkpoint/restore cycle on a simulated GPU and worker (always simulated).
    Demo(cryo_bench::DemoArgs),
    /// Installs cryo under the name `cuda-checkpoint` (a symlink), for CRIU's cuda plugin and scripts.
    InstallCompat(InstallCompatArgs),
    /// Stops a worker safely: suspends every CUDA process (lock, checkpoint, NVML check), then kills.
    Stop(StopArgs),
    /// Prints the journal as an incident timeline (UTC).
    Timeline(TimelineArgs),
    /// The journal itself: rotation.
    Journal(JournalArgs),
    /// Benchmarks on a private simulated GPU.
    Bench(cryo_bench::BenchArgs),
    /// Freezes a worker's process tree into an image (CUDA suspend + CRIU dump), published atomically.
    Freeze(FreezeArgs),
    /// Restores a frozen worker from its image, after checking the image and this host.
    Thaw(ThawArgs),
    /// Parks a worker in place: suspends its CUDA processes (GPU freed), keeps them in host memory.
    Park(park::ParkArgs),
    /// Wakes a parked worker: restores its CUDA processes, guarded before they are unlocked.
    Wake(park::WakeArgs),
    /// Holds a parked worker's service address: wakes it on the first connection, parks it when idle.
    Activate(activate::ActivateArgs),
    /// Pre-thawed standbys (in the agent): workers restored ahead of demand, woken on a claim.
    Standby(standby::StandbyArgs),
    /// Starts a worker in fresh pid and network namespaces (as in a container), so that several
    /// standbys of its image can coexist.
    Run(run::RunArgs),
    /// Guards restored workers against disorderly deaths (fatal signals, OOM kills, kill -9):
    /// suspends on a fatal signal, else pins the context at exit and fences the GPU.
    Guard(GuardArgs),
    /// Quarantined GPUs and what the running guard watches and pins.
    Status(StatusArgs),
    /// Prometheus metrics derived from the journal: printed once, or served at /metrics.
    Metrics(MetricsArgs),
    /// The node agent (cryod): `run` it, ask its `status`, `stop` it.
    Agent(AgentArgs),
}

/// `cryo metrics`.
#[derive(Debug, Args)]
pub struct MetricsArgs {
    /// Serve `GET /metrics` on this address (`HOST:PORT`; port 0 picks one) and follow the
    /// journal, until killed, instead of printing once. The agent serves the same with its live
    /// gauges; this is for hosts and tests without it.
    #[arg(long, value_name = "ADDR", num_args = 0..=1, default_missing_value = cryo_telemetry::DEFAULT_LISTEN)]
    pub listen: Option<String>,
}

/// `cryo cuda-checkpoint ARGS...`: parsed by the compat front end, not by clap.
#[derive(Debug, Args)]
pub struct CudaCheckpointArgs {
    /// Arguments in `cuda-checkpoint` syntax.
    #[arg(trailing_var_arg = true, allow_hyphen_values = true, num_args = 0..)]
    pub args: Vec<OsString>,
}

/// `cryo sim ...`.
#[derive(Debug, Args)]
pub struct SimArgs {
    /// The simulated GPU's own commands.
    #[command(subcommand)]
    pub command: cryo_sim::cli::SimCommand,
}

/// `cryo install-compat`.
#[derive(Debug, Args)]
pub struct InstallCompatArgs {
    /// Directory to put the `cuda-checkpoint` symlink in (it should be on CRIU's PATH).
    #[arg(long, default_value = "/usr/local/bin")]
    pub dir: PathBuf,
    /// Replace an existing `cuda-checkpoint` there (NVIDIA's binary, for instance).
    #[arg(long)]
    pub force: bool,
}

/// A pid as given on the command line: a positive integer.
pub fn parse_pid(s: &str) -> Result<cryo_proc::Pid, String> {
    match s.parse::<cryo_proc::Pid>() {
        Ok(p) if p > 0 => Ok(p),
        _ => Err(format!("{s:?} is not a process id (a positive integer)")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn clap_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn sim_worker_keeps_its_own_gpu_flag() {
        let cli =
            Cli::try_parse_from(["cryo", "--gpu", "sim", "sim", "worker", "--gpu", "1"]).unwrap();
        assert_eq!(cli.global.gpu, GpuChoice::Sim);
    }

    #[test]
    fn pids_are_positive_integers() {
        assert_eq!(parse_pid("42"), Ok(42));
        for bad in ["0", "-1", "x", "", "99999999999"] {
            assert!(parse_pid(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn malformed_gpu_map_is_a_usage_error() {
        let err = Cli::try_parse_from([
            "cryo",
            "gpu",
            "restore",
            "--pid",
            "1",
            "--gpu-map",
            "GPU-1=2",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
    }

    #[test]
    fn timeout_only_on_lock() {
        assert!(
            Cli::try_parse_from(["cryo", "gpu", "lock", "--pid", "1", "--timeout", "500"]).is_ok()
        );
        assert!(Cli::try_parse_from([
            "cryo",
            "gpu",
            "checkpoint",
            "--pid",
            "1",
            "--timeout",
            "500"
        ])
        .is_err());
    }

    #[test]
    fn cuda_checkpoint_takes_its_arguments_raw() {
        let cli = Cli::try_parse_from(["cryo", "cuda-checkpoint", "--help"]).unwrap();
        let Command::CudaCheckpoint(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.args, vec![OsString::from("--help")]);
        let cli = Cli::try_parse_from([
            "cryo",
            "cuda-checkpoint",
            "--action",
            "lock",
            "--pid",
            "7",
            "-t",
            "10",
        ])
        .unwrap();
        let Command::CudaCheckpoint(a) = cli.command else {
            panic!("wrong command")
        };
        assert_eq!(a.args.len(), 6);
    }
}
