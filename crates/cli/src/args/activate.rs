//! `cryo activate`: arguments only, validated without system calls.

use clap::Args;
use cryo_activator::Addr;
use cryo_gpu::GpuUuid;
use cryo_units::ByteSize;

use super::park::WhenFullArg;

/// Printed after `cryo activate --help`.
pub const ACTIVATE_AFTER_HELP: &str = "\
The worker serves on --upstream; clients use --listen, which the activator owns. With --standby
IMAGE there is no worker yet: the first connection claims one standby of the image from the agent
(one claim for any number of waiting connections), reached in its own network namespace. While
the worker is parked, a connection wakes it (one wake for any number of waiting connections: restore, traced
by the running guard, unlock), waits for its health check, and is forwarded byte for byte. If the
wake fails or takes longer than --activation-timeout, an HTTP client gets a 503 with the reason
(--no-http: the connection is closed). After --idle-timeout without an open connection the worker
is parked again. When the node agent runs, it owns the activator (this command returns once it
listens; it outlives the command and the agent's restarts; `cryo status` lists it, --remove ends
it). Without an agent it runs in the foreground until killed; the worker stays as it is then (a
wake that was cut short is finished by `cryo wake`).";

/// `cryo activate`.
#[derive(Debug, Clone, Args)]
#[command(after_help = ACTIVATE_AFTER_HELP)]
pub struct ActivateArgs {
    /// The worker's processes: one pid is it and its whole process tree; several pids exactly
    /// those.
    #[arg(value_name = "PID", value_parser = super::parse_pid, required_unless_present_any = ["cgroup", "standby", "remove"], conflicts_with_all = ["cgroup", "standby"])]
    pub pids: Vec<cryo_proc::Pid>,
    /// Every process of this cgroup (a directory under /sys/fs/cgroup), as a container.
    #[arg(long, value_name = "PATH", conflicts_with = "standby")]
    pub cgroup: Option<std::path::PathBuf>,
    /// No worker yet: the first connection claims a standby of this image from the agent's
    /// pool (`cryo standby create`); --upstream and --health-url are reached in the claimed
    /// worker's network namespace; idle, it is parked in place, and woken again.
    #[arg(long, value_name = "IMAGE")]
    pub standby: Option<std::path::PathBuf>,
    /// The service address clients use: HOST:PORT or unix:/PATH.
    #[arg(long, value_name = "ADDR", required_unless_present = "remove")]
    pub listen: Option<Addr>,
    /// Where the worker itself serves: HOST:PORT or unix:/PATH.
    #[arg(long, value_name = "ADDR", required_unless_present = "remove")]
    pub upstream: Option<Addr>,
    /// Remove the agent's activator listening on this address (as `cryo status` lists it); the
    /// worker stays as it is.
    #[arg(long, value_name = "ADDR", conflicts_with_all = ["pids", "cgroup", "standby", "listen", "upstream"])]
    pub remove: Option<String>,
    /// Park the worker after this many seconds without an open connection (0: never).
    #[arg(long, value_name = "S", default_value_t = 300)]
    pub idle_timeout: u64,
    /// How long a connection waits for an activation, in seconds.
    #[arg(long, value_name = "S", default_value_t = 60)]
    pub activation_timeout: u64,
    /// Healthy when a GET of this http:// (or unix:SOCKET:/PATH) URL answers 2xx.
    #[arg(long, value_name = "URL")]
    pub health_url: Option<String>,
    /// The protocol is not HTTP: close a connection that cannot be served instead of a 503.
    #[arg(long)]
    pub no_http: bool,
    /// GPUs a wake may use (UUIDs, comma-separated).
    #[arg(long, value_name = "UUID,...", value_delimiter = ',')]
    pub onto: Vec<GpuUuid>,
    /// When the GPU has too little free memory: wait, take another GPU, or refuse.
    #[arg(long, value_enum, default_value_t = WhenFullArg::Wait)]
    pub when_full: WhenFullArg,
    /// With --when-full wait: seconds to wait for memory.
    #[arg(long, value_name = "S", default_value_t = 30)]
    pub wait: u64,
    /// Refuse an idle park when parked workers would hold more host memory than this.
    #[arg(long, value_name = "SIZE")]
    pub max_parked_host: Option<ByteSize>,
}
