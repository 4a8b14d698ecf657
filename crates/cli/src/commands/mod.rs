//! One handler per command; [`dispatch`] is all `main` calls.

pub mod bench;
pub mod bench_freeze;
pub mod bench_guard;
pub mod cuda_checkpoint;
pub mod demo;
pub mod freeze;
pub mod gpu;
pub mod guard;
pub mod install_compat;
mod private_sim;
pub mod sim;
pub mod status;
pub mod stop;
pub mod thaw;
pub mod timeline;

use cryo_gpu::Gpu;

use crate::args::{Cli, Command, GlobalArgs};
use crate::backend;

/// What every handler gets: the global options, and the backend on demand.
#[derive(Debug)]
pub struct Context {
    /// `--gpu`, `--sim-dir`, `--state-dir`, `-v`.
    pub global: GlobalArgs,
}

impl Context {
    /// Resolves the backend and says which on stderr (one line).
    pub fn gpu(&self) -> anyhow::Result<Gpu> {
        let r = backend::resolve(self.global.gpu, &self.global.sim_dir)?;
        eprintln!("cryo: {}", r.note);
        Ok(r.gpu)
    }
}

/// Runs the command; the exit status on success (the `cuda-checkpoint` front end has its own).
pub fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    let ctx = Context { global: cli.global };
    match cli.command {
        Command::Gpu(g) => gpu::run(&ctx, g.command).map(|()| crate::exit::SUCCESS),
        Command::CudaCheckpoint(a) => Ok(cuda_checkpoint::run(
            ctx.global.gpu,
            &ctx.global.sim_dir,
            &ctx.global.state_dir,
            a.args,
        )),
        Command::Sim(s) => sim::run(s.command).map(|()| crate::exit::SUCCESS),
        Command::Demo(d) => demo::run(&d).map(|()| crate::exit::SUCCESS),
        Command::InstallCompat(i) => install_compat::run(&i).map(|()| crate::exit::SUCCESS),
        Command::Stop(a) => stop::run(&ctx, &a),
        Command::Timeline(a) => timeline::run(&ctx, &a).map(|()| crate::exit::SUCCESS),
        Command::Bench(b) => bench::run(&b),
        Command::Freeze(a) => freeze::run(&ctx, &a),
        Command::Thaw(a) => thaw::run(&ctx, &a),
        Command::Guard(a) => guard::run(&ctx, &a),
        Command::Status(a) => status::run(&ctx, &a).map(|()| crate::exit::SUCCESS),
    }
}
