//! `cryo`: checkpoint, restore and guard GPU inference workers.
//!
//! # Design
//! `main` only parses and dispatches: arguments are parsed and validated in [`args`] without
//! system calls, resolved against the system in [`backend`] and the handlers of [`commands`]
//! (one file per command), and errors become one line on stderr and a documented exit code
//! ([`exit`]: 0 ok, 1 error, 2 usage). Run under the name `cuda-checkpoint` (a symlink, see
//! `cryo install-compat`), the binary is NVIDIA's `cuda-checkpoint` command line instead
//! ([`compat`]).
//!
//! Commands that act on processes go through the node agent (`cryo agent run`) when its socket
//! answers, and work standalone otherwise ([`route`]).

mod args;
mod backend;
mod commands;
mod compat;
mod defer;
mod exit;
mod process;
mod progress;
mod route;

use std::ffi::OsString;
use std::path::Path;
use std::process::ExitCode;

use clap::Parser;

fn main() -> ExitCode {
    // First: an ignored `SIGCHLD` survives `execve`, and a `cryo` started by a parent that
    // ignored it (some init systems, hook runners) would have every child it starts reaped by
    // the kernel (its `criu --version` check, image checker, opener, health commands: each
    // wait fails with ECHILD). It fails only for an invalid signal, which `SIGCHLD` is not.
    let _ = cryo_proc::default_sigchld();
    // A thaw's image checker (a child of a thaw of this binary): nothing else of `cryo` runs.
    if let Some(code) = cryo_criu::image::checker_main() {
        return code;
    }
    let mut argv = std::env::args_os();
    let argv0 = argv.next().unwrap_or_default();
    if invoked_as_cuda_checkpoint(&argv0) {
        init_tracing(0, false);
        return ExitCode::from(commands::cuda_checkpoint::run_as_argv0(argv.collect()));
    }
    let cli = args::Cli::parse();
    // The simulated driver and worker set up their own logging.
    // The agent logs what it guards and why (info); commands only warnings.
    let daemon = matches!(
        &cli.command,
        args::Command::Agent(args::AgentArgs {
            command: args::AgentCommand::Run(_)
        })
    );
    if !matches!(cli.command, args::Command::Sim(_)) {
        init_tracing(cli.global.verbose, daemon);
    }
    match commands::dispatch(cli) {
        Ok(code) => ExitCode::from(code),
        Err(err) => {
            exit::report(&err);
            ExitCode::from(exit::code_for(&err))
        }
    }
}

/// Whether `argv[0]`'s basename is `cuda-checkpoint`.
fn invoked_as_cuda_checkpoint(argv0: &OsString) -> bool {
    Path::new(argv0)
        .file_name()
        .is_some_and(|n| n == "cuda-checkpoint")
}

/// Logs to stderr: warnings by default (the agent: info), `-v` debug, `-vv` trace; `RUST_LOG`
/// overrides.
fn init_tracing(verbose: u8, daemon: bool) {
    let level = match verbose {
        0 if daemon => "info",
        0 => "warn",
        1 => "debug",
        _ => "trace",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(level));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(|| LossyStderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .try_init();
}

/// Stderr that drops what it cannot write: a closed or full stderr (the agent's log pipe gone)
/// loses log lines, never panics (tracing-subscriber reports a failed write with `eprintln!`,
/// which panics on the same stderr).
struct LossyStderr;

impl std::io::Write for LossyStderr {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}
