//! Arguments of `cryo guard` and `cryo status`.

use clap::{Args, Subcommand, ValueEnum};

use super::ByteSize;

/// `cryo guard`: without a subcommand, runs the guard until SIGTERM.
#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct GuardArgs {
    /// Talk to the running guard instead of starting one.
    #[command(subcommand)]
    pub command: Option<GuardCommand>,
    /// How to run.
    #[command(flatten)]
    pub run: GuardRunArgs,
}

/// `cryo guard` (run) options.
#[derive(Debug, Clone, Args)]
pub struct GuardRunArgs {
    /// Also guard this process (restored by another tool); repeat for several.
    #[arg(long = "pid", value_parser = super::parse_pid)]
    pub pids: Vec<cryo_proc::Pid>,
    /// What to do once a GPU is quarantined: `hold` keeps the pins and waits for the operator;
    /// `drain` stops every other GPU process of the node (suspend-before-kill) and runs
    /// --restart-cmd.
    #[arg(long, value_enum, default_value_t = EndgameArg::Hold)]
    pub endgame: EndgameArg,
    /// The operator's command for `--endgame drain` (run with `sh -c`; `CRYO_QUARANTINED_GPUS`
    /// names the fenced GPUs).
    #[arg(long, requires = "endgame")]
    pub restart_cmd: Option<String>,
    /// Lock timeout of the suspension tried on a fatal signal, in ms (the signal is held that long).
    #[arg(long, default_value_t = 10_000)]
    pub lock_timeout_ms: u64,
    /// `oom_score_adj` for guarded processes (lower: the OOM killer prefers other processes).
    #[arg(long, default_value_t = -900, allow_hyphen_values = true)]
    pub oom_score_adj: i32,
    /// Suspend and stop a guarded worker when its memory cgroup's free room falls below its
    /// device memory plus this margin (a checkpoint needs that much host memory).
    #[arg(long, default_value = "64MiB")]
    pub memory_margin: ByteSize,
    /// Also act when the cgroup's memory PSI `full avg10` (every task stalled) stays at or above
    /// this percentage for several samples.
    #[arg(long)]
    pub psi_avg10: Option<f64>,
    /// Do not watch memory (an OOM kill is then only caught at the exit stop).
    #[arg(long)]
    pub no_memory_watch: bool,
    /// How often to read the journal for new restores, in ms.
    #[arg(long, default_value_t = 200)]
    pub poll_ms: u64,
    /// Hand pinned driver fds to the pin holder (`cryo guard holder`, started detached when none
    /// runs) so that they outlive this process; without it they stay in this process.
    #[arg(long)]
    pub pin_holder: bool,
    /// Which CUDA processes that cryo did not restore are guarded: `all-cuda` (every process
    /// NVML lists or that holds driver files, found by a scan every second: the safe choice on
    /// a node where other tools restore contexts, since nothing tells those from fresh ones; the
    /// ordinary exit of any of them is then pinned), or `none` (restores through cryo, the
    /// journal's, and `--pid`).
    #[arg(long, value_enum, default_value = "all-cuda")]
    pub scan: ScanArg,
}

/// `--scan`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ScanArg {
    /// Every CUDA process.
    AllCuda,
    /// Only what cryo restored or was told of.
    None,
}

/// `--endgame`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum EndgameArg {
    /// Keep the pins, wait for the operator.
    Hold,
    /// Stop every other GPU process, then run --restart-cmd.
    Drain,
}

/// Requests to the running guard (its socket `STATE_DIR/guard.sock`, root only).
#[derive(Debug, Subcommand)]
pub enum GuardCommand {
    /// Closes the pins on a GPU and lifts its quarantine. On affected hosts the driver then tears
    /// the held contexts down, which is what wedges the machine: do it only in a controlled
    /// window (after draining the node, or before a reboot).
    Release {
        /// The GPU (UUID), or `unknown` for the quarantine of contexts whose GPU the guard could
        /// not tell (it fences every GPU). Repeat it to release several GPUs together: a process
        /// pinned with contexts on several GPUs is released only when every one is named.
        #[arg(long, required = true)]
        gpu: Vec<cryo_state::fence::FencedGpu>,
        /// Required: says you read the above.
        #[arg(long)]
        i_understand_this_may_wedge_the_host: bool,
    },
    /// Stops guarding a process (before a CRIU dump; `cryo freeze` does it itself).
    Detach {
        /// The process.
        #[arg(long, value_parser = super::parse_pid)]
        pid: cryo_proc::Pid,
    },
    /// Guards a process (after a `detach`, or one restored by another tool).
    Attach {
        /// The process.
        #[arg(long, value_parser = super::parse_pid)]
        pid: cryo_proc::Pid,
    },
    /// Runs the pin holder of the state directory: the minimal process that keeps pinned driver
    /// fds open across the guard's (and the agent's) crash, SIGKILL, restart and upgrade. The
    /// guard and the agent start it themselves; its cgroup is chosen by `CRYO_HOLDER_CGROUP`
    /// (`auto`: a cgroup of its own, `stay`, or `ROOT:NAME`).
    Holder(HolderArgs),
}

/// `cryo guard holder`.
#[derive(Debug, Args)]
pub struct HolderArgs {
    /// Start it in a session of its own and return once it serves (prints its pid).
    #[arg(long)]
    pub detach: bool,
    /// Take every pin of the running holder over before serving (an upgrade of the holder; the
    /// old one exits once this one holds them all).
    #[arg(long)]
    pub take_over: bool,
    /// Print the running holder's pins instead.
    #[arg(long, conflicts_with_all = ["detach", "take_over"])]
    pub list: bool,
}

/// `cryo status`.
#[derive(Debug, Args)]
pub struct StatusArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}
