//! `cryo sim ...`: the simulated GPU's own commands, run as they are.

/// Runs one `cryo sim` command.
pub fn run(cmd: cryo_sim::cli::SimCommand) -> anyhow::Result<()> {
    cmd.run()?;
    Ok(())
}
