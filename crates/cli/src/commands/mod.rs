//! One handler per command; [`dispatch`] is all `main` calls.

pub mod activate;
pub mod agent;
pub mod cuda_checkpoint;
pub mod freeze;
pub mod gpu;
pub mod guard;
pub mod install_compat;
pub mod metrics;
pub mod park;
pub mod run;
pub mod sim;
pub mod standby;
pub mod status;
pub mod stop;
pub mod stop_kube;
pub mod thaw;
pub mod timeline;

use anyhow::Context as _;
use cryo_gpu::Gpu;
use cryo_state::StateDir;

use crate::args::{Cli, Command, GlobalArgs};
use crate::backend;

/// What every handler gets: the global options, and the backend on demand.
#[derive(Debug)]
pub struct Context {
    /// `--gpu`, `--sim-dir`, `--state-dir`, `-v`.
    pub global: GlobalArgs,
    /// `--state-dir`.
    pub state: StateDir,
    /// Whether `auto`'s choice was said already.
    announced: std::sync::atomic::AtomicBool,
}

impl Context {
    /// Resolves the backend; says on stderr which one `auto` chose (once per command), nothing
    /// when the user named it.
    pub fn gpu(&self) -> anyhow::Result<Gpu> {
        let r = backend::resolve(self.global.gpu, &self.global.sim_dir)?;
        if let Some(note) = r.note {
            if !self
                .announced
                .swap(true, std::sync::atomic::Ordering::Relaxed)
            {
                eprintln!("cryo: {note}");
            }
        }
        Ok(r.gpu)
    }

    /// The backend for a command that changes a process's GPU state: its driver calls are made
    /// by the agent when one answers, else here (after saying once that nothing guards).
    pub fn gpu_for_change(&self) -> anyhow::Result<Gpu> {
        let mut gpu = self.gpu()?;
        if !crate::route::driver_through_agent(&mut gpu, &self.state)
            .map_err(crate::route::error)?
        {
            crate::route::standalone_note(&crate::route::client(&self.state));
        }
        Ok(gpu)
    }
}

/// Runs the command; the exit status on success (the `cuda-checkpoint` front end has its own).
pub fn dispatch(cli: Cli) -> anyhow::Result<u8> {
    let ctx = Context {
        state: StateDir::new(&cli.global.state_dir),
        global: cli.global,
        announced: Default::default(),
    };
    match cli.command {
        Command::Gpu(g) => gpu::run(&ctx, g.command).map(|()| crate::exit::SUCCESS),
        Command::CudaCheckpoint(a) => Ok(cuda_checkpoint::run(
            ctx.global.gpu,
            &ctx.global.sim_dir,
            &ctx.state,
            a.args,
        )),
        Command::Sim(s) => sim::run(s.command).map(|()| crate::exit::SUCCESS),
        Command::Demo(d) => cryo_bench::demo(&d, &this_binary()?).map(|()| crate::exit::SUCCESS),
        Command::InstallCompat(i) => install_compat::run(&i).map(|()| crate::exit::SUCCESS),
        Command::Stop(a) => stop::run(&ctx, &a),
        Command::Timeline(a) => timeline::run(&ctx, &a).map(|()| crate::exit::SUCCESS),
        Command::Journal(a) => timeline::run_journal(&ctx, &a).map(|()| crate::exit::SUCCESS),
        Command::Bench(b) => cryo_bench::bench(&b, &this_binary()?).map(|()| crate::exit::SUCCESS),
        Command::Freeze(a) => freeze::run(&ctx, &a),
        Command::Thaw(a) => thaw::run(&ctx, &a),
        Command::Park(a) => park::run_park(&ctx, &a),
        Command::Wake(a) => park::run_wake(&ctx, &a),
        Command::Activate(a) => activate::run(&ctx, &a),
        Command::Standby(a) => standby::run(&ctx, &a),
        Command::Run(a) => run::run(&a),
        Command::Guard(a) => guard::run(&ctx, &a),
        Command::Status(a) => status::run(&ctx, &a).map(|()| crate::exit::SUCCESS),
        Command::Metrics(a) => metrics::run(&ctx, &a).map(|()| crate::exit::SUCCESS),
        Command::Agent(a) => agent::run(&ctx, &a),
    }
}

/// The `cryo` binary running now (the demo and the benchmarks run it as an operator would).
fn this_binary() -> anyhow::Result<std::path::PathBuf> {
    std::env::current_exe().context("finding the cryo binary")
}

/// The context of `handle` was just restored (and journaled as restored by the restore itself)
/// and is still LOCKED: has the node's guard trace the process before anything unlocks it.
/// `Err`: a guard runs and could not trace it; the caller must not unlock it (it checkpoints it
/// again). `Ok(Coverage::NoGuard)`: no guard runs on the node (see [`say_unguarded`]).
pub fn guard_restored(
    state: &cryo_state::StateDir,
    handle: &cryo_proc::ProcHandle,
) -> Result<cryo_lifecycle::Coverage, String> {
    let coverage = cryo_lifecycle::Watcher::guard_before_unlock(
        &cryo_guard::control::GuardClient::new(state),
        &[handle],
    )
    .map_err(|e| format!("the node's guard could not trace pid {}: {e}", handle.pid()))?;
    Ok(coverage)
}

/// Says once per command that no guard runs (restored workers are unprotected against teardown).
pub fn say_unguarded() {
    static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
        eprintln!(
            "cryo: note: no guard runs on this node; nothing guards restored workers against a disorderly death (start `cryo guard`)"
        );
    }
}
