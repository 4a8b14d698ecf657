//! `cryo guard`: runs the guard (until SIGTERM, and not while it holds pins), or talks to it.
//!
//! # Design
//! The guard runs in this process, in the foreground: [`cryo_guard::run`] re-attaches to every
//! live restored process of the journal, attaches `--pid` ones, then polls the journal for new
//! restores and checks memory every `--poll-ms`; this file prints what it reports. Its control
//! socket (`STATE_DIR/guard.sock`, root only) serves `cryo status`, `cryo guard
//! release|attach|detach` and `cryo freeze` (which detaches before a CRIU dump).
//! SIGTERM/SIGINT/SIGHUP end it, detaching from every worker, unless it holds pins: then it
//! refuses (closing pins is `cryo guard release`, never a side effect).
//!
//! # Limitations
//! SIGKILL of the guard closes its pins (the kernel closes its files): on affected hosts that is
//! the wedge the pins held off. Its tracees are detached by the kernel; a thread held at a fatal
//! signal at that moment loses the signal.

use std::time::Duration;

use anyhow::{bail, Context as _};
use cryo_guard::control::{Detach, GuardClient};
use cryo_guard::{Endgame, GuardConfig, MemoryWatch, RunOptions};

use super::Context;
use crate::args::guard::{EndgameArg, GuardArgs, GuardCommand, GuardRunArgs};

/// `cryo guard ...`.
pub fn run(ctx: &Context, args: &GuardArgs) -> anyhow::Result<u8> {
    let state = &ctx.state;
    match &args.command {
        None => serve(ctx, &args.run).map(|()| crate::exit::SUCCESS),
        Some(GuardCommand::Release {
            gpu,
            i_understand_this_may_wedge_the_host,
        }) => {
            if !i_understand_this_may_wedge_the_host {
                bail!(crate::exit::UsageError(format!(
                    "closing the pins on {gpu} lets the driver tear down a live restored context, which wedges affected hosts; \
                     drain the node first, then repeat with --i-understand-this-may-wedge-the-host"
                )));
            }
            eprintln!("cryo: WARNING: closing the pins on {gpu}: on affected hosts the machine may wedge within ~35 s");
            let pids: Vec<_> = GuardClient::new(state)
                .release(gpu)
                .context("releasing pins")?
                .into_iter()
                .map(|p| p.pid)
                .collect();
            println!(
                "released pins of {} process(es) on {gpu}: {pids:?}; quarantine lifted",
                pids.len()
            );
            Ok(crate::exit::SUCCESS)
        }
        Some(GuardCommand::Detach { pid }) => {
            let id = GuardClient::identify(*pid)?;
            match GuardClient::new(state)
                .detach(id)
                .context("asking the guard to detach")?
            {
                Detach::Detached | Detach::NotTraced => println!("guard detached from {pid}"),
                Detach::NoGuard => println!("no guard is running"),
            }
            Ok(crate::exit::SUCCESS)
        }
        Some(GuardCommand::Attach { pid }) => {
            let id = GuardClient::identify(*pid)?;
            if !GuardClient::new(state)
                .attach(id)
                .context("asking the guard to attach")?
            {
                bail!("no guard is running (start `cryo guard --pid {pid}`)");
            }
            println!("guard attached to {pid}");
            Ok(crate::exit::SUCCESS)
        }
    }
}

fn config(ctx: &Context, a: &GuardRunArgs) -> GuardConfig {
    let mut cfg = GuardConfig::new(ctx.state.clone());
    cfg.endgame = match a.endgame {
        EndgameArg::Hold => Endgame::Hold,
        EndgameArg::Drain => Endgame::Drain {
            restart_cmd: a.restart_cmd.clone(),
        },
    };
    cfg.suspend.lock_timeout = Duration::from_millis(a.lock_timeout_ms);
    cfg.oom_score_adj = a.oom_score_adj;
    cfg.memory = (!a.no_memory_watch).then(|| MemoryWatch {
        margin: a.memory_margin.0,
        psi_some_avg10: a.psi_avg10,
        interval: Duration::from_millis(a.poll_ms),
    });
    cfg
}

fn serve(ctx: &Context, a: &GuardRunArgs) -> anyhow::Result<()> {
    if a.restart_cmd.is_some() && a.endgame != EndgameArg::Drain {
        bail!(crate::exit::UsageError(
            "--restart-cmd needs --endgame drain".into()
        ));
    }
    let terminate = cryo_guard::termination_flag().context("installing the SIGTERM handler")?;
    let gpu = ctx.gpu()?;
    let opts = RunOptions {
        pids: a.pids.clone(),
        poll: Duration::from_millis(a.poll_ms),
    };
    cryo_guard::run(
        gpu,
        config(ctx, a),
        &opts,
        &|| terminate.load(std::sync::atomic::Ordering::SeqCst),
        &mut |notice| eprintln!("cryo guard: {notice}"),
    )?;
    Ok(())
}
