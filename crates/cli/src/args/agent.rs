//! Arguments of `cryo agent run|status|stop`.

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::GuardRunArgs;

/// `cryo agent`.
#[derive(Debug, Args)]
pub struct AgentArgs {
    /// What to do.
    #[command(subcommand)]
    pub command: AgentCommand,
}

/// `cryo agent ...`.
#[derive(Debug, Subcommand)]
pub enum AgentCommand {
    /// Runs the node agent (cryod) in the foreground until `cryo agent stop` or SIGTERM (refused
    /// while it holds pinned contexts): it guards every restore, owns the journal writer, the
    /// fence, metrics and the event stream, and serves the API every other `cryo` command uses
    /// when it answers.
    Run(Box<AgentRunArgs>),
    /// What the running agent guards and why, its pins, the fence, version and uptime.
    Status(AgentStatusArgs),
    /// Asks the running agent to stop (refused while it holds pins: the answer says how to
    /// release them).
    Stop,
    /// Internal: holds an activator's listening socket (its stdin) for the agent's successor
    /// (`cryo_agent::keeper`); started by the agent, not by hand.
    #[command(hide = true)]
    KeepListener(KeepListenerArgs),
}

/// `cryo agent keep-listener`.
#[derive(Debug, Args)]
pub struct KeepListenerArgs {
    /// The agent that started it, `PID:START_TIME` (it lingers a while after that one is gone).
    #[arg(long, value_name = "PID:START", value_parser = parse_agent_id)]
    pub agent: (i32, u64),
}

fn parse_agent_id(s: &str) -> Result<(i32, u64), String> {
    let (pid, start) = s
        .split_once(':')
        .ok_or_else(|| format!("{s:?} is not PID:START_TIME"))?;
    Ok((
        pid.parse().map_err(|e| format!("pid {pid:?}: {e}"))?,
        start
            .parse()
            .map_err(|e| format!("start time {start:?}: {e}"))?,
    ))
}

/// `cryo agent run`.
#[derive(Debug, Args)]
pub struct AgentRunArgs {
    /// The API socket (default: STATE_DIR/cryod.sock).
    #[arg(long, env = cryo_api::SOCKET_ENV, value_name = "PATH")]
    pub socket: Option<PathBuf>,
    /// Members of this group may read (status, metrics, events); changes are for root only.
    /// Without it, only root may talk to the agent.
    #[arg(long, value_name = "GROUP")]
    pub read_group: Option<String>,
    /// Serve Prometheus `GET /metrics` on this TCP address (`HOST:PORT`, port 0 picks one).
    #[arg(long, value_name = "ADDR", default_value = cryo_telemetry::DEFAULT_LISTEN, conflicts_with = "no_metrics_listen")]
    pub metrics_listen: String,
    /// Serve metrics only on the socket (`/v1/metrics`), not on TCP.
    #[arg(long)]
    pub no_metrics_listen: bool,
    /// Forward every journal record to this syslog collector (`HOST:PORT`, TCP, RFC 5424).
    #[arg(long, value_name = "HOST:PORT")]
    pub syslog: Option<String>,
    /// Run on Kubernetes as this node (the DaemonSet passes `spec.nodeName`): the fence becomes
    /// the node's taint `cryo.dev/gpu-fenced`, condition and Event, journal steps become Events
    /// on the Pod or Node, and `cryo stop --self` / `--pod` are served.
    #[arg(long, env = "CRYO_NODE_NAME", value_name = "NODE")]
    pub kube_node: Option<String>,
    /// The kubeconfig to use with --kube-node (default: the in-cluster ServiceAccount, else
    /// $KUBECONFIG).
    #[arg(
        long,
        env = "CRYO_KUBECONFIG",
        value_name = "PATH",
        requires = "kube_node"
    )]
    pub kubeconfig: Option<PathBuf>,
    /// The host's cgroup tree, where containers are found (in the agent's pod: the host's
    /// /sys/fs/cgroup mounted elsewhere).
    #[arg(
        long,
        env = "CRYO_CGROUP_ROOT",
        value_name = "PATH",
        default_value = "/sys/fs/cgroup"
    )]
    pub cgroup_root: PathBuf,
    /// The guard's options.
    #[command(flatten)]
    pub guard: GuardRunArgs,
}

/// `cryo agent status`.
#[derive(Debug, Args)]
pub struct AgentStatusArgs {
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}
