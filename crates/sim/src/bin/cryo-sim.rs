//! `cryo-sim`: the simulated GPU's commands on their own (what `cryo sim` runs), so tests can
//! exec the driver and workers without the `cryo` binary.

use clap::Parser;

#[derive(Debug, Parser)]
#[command(
    name = "cryo-sim",
    about = "The simulated GPU: driver daemon and sim workers"
)]
struct Cli {
    #[command(subcommand)]
    cmd: cryo_sim::SimCommand,
}

fn main() -> std::process::ExitCode {
    match Cli::parse().cmd.run() {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cryo-sim: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
