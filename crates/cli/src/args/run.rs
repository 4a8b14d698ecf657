//! `cryo run`: arguments only.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::Args;

/// Printed after `cryo run --help`.
pub const RUN_AFTER_HELP: &str = "\
The worker runs as pid 1 of a fresh pid namespace and session leader, in a fresh network namespace
with only loopback (up), as in a container. CRIU dumps both namespaces with it, and restores every
copy of the image into fresh ones, so several standbys of one image (`cryo standby create --count
N`) coexist with the same pids and ports inside. Its service is reached inside its namespace
(`nsenter --net --target PID`), or through an activator. As an init, it ignores signals it has
no handler for; `cryo stop PID` ends it safely. Its stdin is /dev/null; give --log so that its
output is no pipe or terminal of yours, which CRIU could not dump. Without --detach, cryo waits
for it, passes on SIGINT, SIGTERM and SIGHUP, and exits with its status.";

/// `cryo run`.
#[derive(Debug, Clone, Args)]
#[command(after_help = RUN_AFTER_HELP)]
pub struct RunArgs {
    /// Its stdout and stderr (appended); inherited without.
    #[arg(long, value_name = "FILE")]
    pub log: Option<PathBuf>,
    /// Its working directory (default: this one).
    #[arg(long, value_name = "DIR")]
    pub dir: Option<PathBuf>,
    /// Print its pid and return at once (it keeps running).
    #[arg(long)]
    pub detach: bool,
    /// Print its pid as JSON.
    #[arg(long)]
    pub json: bool,
    /// The program and its arguments.
    #[arg(required = true, trailing_var_arg = true, value_name = "PROGRAM")]
    pub argv: Vec<OsString>,
}
