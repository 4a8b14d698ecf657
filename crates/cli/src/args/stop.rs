//! `cryo stop` and `cryo timeline`: arguments only, validated without system calls.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use super::parse_pid;

/// Printed after `cryo stop --help`.
pub const STOP_AFTER_HELP: &str = "\
Every CUDA process of the target is locked (in parallel), checkpointed (in parallel) and checked
through NVML to hold no device memory; only then is anything killed (CUDA processes first, then the
others). If any CUDA process cannot be suspended, nothing is killed.

Exit codes:
  0  every process of the target has ended
  1  error (the target could not be resolved, the driver or journal failed...); nothing was killed
     unless the error says so
  3  refused: a CUDA process could not be suspended (the message names the pid, why, and what to
     do); nothing in the target was killed, and every process was left serving or checkpointed

Every stop first settles the suspensions that earlier stops, freezes or guards left half-way
(their owner gone): a worker only locked is unlocked, one checkpointed by a stop is killed after
the same last look, one checkpointed by a freeze is resumed; the report says what it did.
A process stopped by job control is resumed with SIGCONT first; one stopped under a debugger is
refused. Every driver call has a deadline of its own, and --deadline bounds the whole stop.
CRYO_FAILPOINT=stop-before-kill is a test hook: the stop stalls once everything is verified.";

/// `cryo stop`.
#[derive(Debug, Clone, Args)]
#[command(after_help = STOP_AFTER_HELP)]
pub struct StopArgs {
    /// The processes: one pid stops it and its whole process tree; several pids stop exactly
    /// those.
    #[arg(value_name = "PID", value_parser = parse_pid, required_unless_present_any = ["cgroup", "own_container", "pod"], conflicts_with_all = ["cgroup", "own_container", "pod"])]
    pub pids: Vec<cryo_proc::Pid>,
    /// Stop every process of this cgroup (a directory under /sys/fs/cgroup), as a container is
    /// stopped.
    #[arg(long, value_name = "PATH", conflicts_with_all = ["own_container", "pod"])]
    pub cgroup: Option<PathBuf>,
    /// Stop this process's own Kubernetes container (a preStop hook): the agent finds the
    /// container from the caller's cgroup and stops its whole cgroup but the caller, within the
    /// Pod's grace period. Returns once everything is suspended and the container's processes
    /// are being ended. Without an agent, stops its own cgroup standalone.
    #[arg(long = "self", id = "own_container", conflicts_with = "pod")]
    pub own_container: bool,
    /// Stop the running containers of this pod of the agent's node (NAMESPACE/NAME), within
    /// the Pod's grace period (through the agent, which finds their cgroups).
    #[arg(long, value_name = "NS/NAME", value_parser = parse_pod)]
    pub pod: Option<(String, String)>,
    /// With --pod: only this container.
    #[arg(long, value_name = "NAME", requires = "pod")]
    pub container: Option<String>,
    /// Timeout of one lock attempt, in milliseconds (the wait for GPU work in flight).
    #[arg(long, value_name = "MS", default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub timeout: u64,
    /// Lock attempts before refusing because work stays in flight.
    #[arg(long, value_name = "N", default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..))]
    pub lock_attempts: u32,
    /// The whole stop's deadline, in milliseconds (0: none): lock attempts get what the
    /// checkpoint (estimated from the device memory NVML lists) and the verification leave, and no
    /// driver call is waited for past it. The default stays below Kubernetes' default grace period
    /// (30 s), after which the kubelet kills the stop and the worker it locked; under Kubernetes,
    /// set it a few seconds below the pod's terminationGracePeriodSeconds.
    /// [default: 25000; with --self and --pod: the Pod's grace period less a margin, and
    /// at most this when given]
    #[arg(long, value_name = "MS")]
    pub deadline: Option<u64>,
    /// How long NVML may keep listing a checkpointed process's memory, in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 10_000)]
    pub verify_timeout: u64,
    /// How to end the suspended processes. KILL (the default) is right for CUDA workers: a
    /// checkpointed process cannot make CUDA calls, so a SIGTERM handler touching the GPU hangs.
    #[arg(long, value_enum, default_value_t = SignalArg::Kill)]
    pub signal: SignalArg,
    /// With --signal TERM: seconds to wait before SIGKILL.
    #[arg(long, value_name = "S", default_value_t = 10)]
    pub grace: u64,
    /// Kill even the processes that could not be suspended. On affected hosts (restored CUDA
    /// contexts torn down while live) this is the path that WEDGES THE HOST about 35 s later.
    /// Only for hosts known not to wedge, or when losing the host is accepted.
    #[arg(long = "unsafe")]
    pub unsafe_kill: bool,
    /// Declare that the processes were never restored, so a plain kill of their CUDA contexts is
    /// safe. Processes the journal knows as restored are suspended anyway.
    #[arg(long)]
    pub fresh: bool,
    /// Shrink the engine first.
    #[command(flatten)]
    pub shrink: super::ShrinkArgs,
    /// Print the result as one JSON object on stdout.
    #[arg(long)]
    pub json: bool,
}

/// `NAMESPACE/NAME`.
fn parse_pod(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((ns, name)) if !ns.is_empty() && !name.is_empty() && !name.contains('/') => {
            Ok((ns.to_owned(), name.to_owned()))
        }
        _ => Err(format!("{s:?} is not NAMESPACE/NAME")),
    }
}

/// `--signal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
#[value(rename_all = "UPPER")]
pub enum SignalArg {
    /// SIGKILL at once.
    Kill,
    /// SIGTERM, then SIGKILL after --grace seconds.
    Term,
}

/// `cryo timeline`.
#[derive(Debug, Clone, Args)]
pub struct TimelineArgs {
    /// Only events at or after T: RFC 3339 (`2026-11-30T02:41:07Z`) or a duration ago (`10m`, `2h`).
    #[arg(long, value_name = "T")]
    pub since: Option<String>,
    /// Only events naming this pid.
    #[arg(long, value_name = "N", value_parser = parse_pid)]
    pub pid: Option<cryo_proc::Pid>,
    /// One JSON record per line, as stored.
    #[arg(long)]
    pub json: bool,
    /// The whole history the node keeps: the journal's archives, then its active segment (each
    /// record once), not only the active segment (which starts with the records a rotation
    /// carried).
    #[arg(long)]
    pub all: bool,
}

/// `cryo journal`.
#[derive(Debug, clap::Args)]
pub struct JournalArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: JournalCommand,
}

/// `cryo journal` commands.
#[derive(Debug, clap::Subcommand)]
pub enum JournalCommand {
    /// Rotates the journal now: archives the active segment (`journal.<seq>.log`) and starts a
    /// new one with the records recovery still needs, then removes the oldest archives beyond
    /// the retention (16 archives, 256 MiB). The agent does this by itself past 4 MiB.
    Rotate,
}
