//! `cryo guard`: runs the guard (until SIGTERM, and not while it holds pins), or talks to it.
//!
//! # Design
//! The guard runs in this process, in the foreground: [`cryo_guard::run`] re-attaches to every
//! live restored process of the journal, attaches `--pid` ones, then polls the journal for new
//! restores and checks memory every `--poll-ms`; this file prints what it reports. Its control
//! socket (`STATE_DIR/guard.sock`, root only) serves `cryo status`, `cryo guard
//! release|attach|detach` and `cryo freeze` (which detaches before a CRIU dump).
//! SIGTERM/SIGINT/SIGHUP/SIGQUIT end it, detaching from every worker, unless it holds pins: then
//! it refuses (closing pins is `cryo guard release`, never a side effect). Every other signal
//! whose default action kills (SIGUSR1, SIGALRM, SIGPIPE...) is ignored. Its notices go to
//! stderr; a closed stderr loses them and nothing else.
//!
//! # Limitations
//! SIGKILL of the guard closes its pins (the kernel closes its files): on affected hosts that is
//! the wedge the pins held off. Its tracees are detached by the kernel; a thread held at a fatal
//! signal at that moment loses the signal.

use std::time::Duration;

use anyhow::{bail, Context as _};
use cryo_api::{PidRequest, ReleaseRequest};
use cryo_guard::control::{Confirmation, Detach, GuardClient};
use cryo_guard::{Endgame, GuardConfig, MemoryWatch, RunOptions};

use super::Context;
use crate::args::guard::{EndgameArg, GuardArgs, GuardCommand, GuardRunArgs, HolderArgs, ScanArg};
use crate::route;

/// `cryo guard ...`.
pub fn run(ctx: &Context, args: &GuardArgs) -> anyhow::Result<u8> {
    let state = &ctx.state;
    match &args.command {
        None => serve(ctx, &args.run).map(|()| crate::exit::SUCCESS),
        Some(GuardCommand::Release {
            gpu,
            i_understand_this_may_wedge_the_host,
        }) => {
            let named: Vec<String> = gpu.iter().map(ToString::to_string).collect();
            let named = named.join(", ");
            if !i_understand_this_may_wedge_the_host {
                bail!(crate::exit::UsageError(format!(
                    "closing the pins on {named} lets the driver tear down a live restored context, which wedges affected hosts; \
                     drain the node first, then repeat with --i-understand-this-may-wedge-the-host"
                )));
            }
            eprintln!("cryo: WARNING: closing the pins on {named}: on affected hosts the machine may wedge within ~35 s");
            let (first, also) = gpu
                .split_first()
                .context("--gpu names the GPU to release")?;
            let via_agent = route::client(state).release(&ReleaseRequest {
                gpu: first.clone(),
                confirm: Confirmation::MayWedgeTheHost,
                also: also.to_vec(),
            });
            let pids = if route::not_running(&via_agent) {
                match GuardClient::new(state).release(gpu) {
                    // No guard runs (the agent is down): the pin holder holds what is pinned.
                    Err(cryo_guard::control::ControlError::NotRunning(_)) => {
                        cryo_guard::pins::release_without_guard(state, gpu)
                            .context("releasing pins")?
                    }
                    other => other.context("releasing pins")?,
                }
            } else {
                via_agent
                    .map_err(route::error)
                    .context("releasing pins")?
                    .pids
            };
            let pids: Vec<_> = pids.into_iter().map(|p| p.pid).collect();
            println!(
                "released pins of {} process(es) on {named}: {pids:?}; quarantine lifted",
                pids.len()
            );
            Ok(crate::exit::SUCCESS)
        }
        Some(GuardCommand::Detach { pid }) => {
            let id = GuardClient::identify(*pid)?;
            let via_agent = route::client(state).detach(&PidRequest { pid: id });
            if !route::not_running(&via_agent) {
                via_agent
                    .map_err(route::error)
                    .context("asking the agent's guard to detach")?;
                println!("guard detached from {pid}");
                return Ok(crate::exit::SUCCESS);
            }
            match GuardClient::new(state)
                .detach(id)
                .context("asking the guard to detach")?
            {
                Detach::Detached | Detach::NotTraced => println!("guard detached from {pid}"),
                Detach::NoGuard => println!("no guard is running"),
            }
            Ok(crate::exit::SUCCESS)
        }
        Some(GuardCommand::Holder(h)) => holder(ctx, h),
        Some(GuardCommand::Attach { pid }) => {
            let id = GuardClient::identify(*pid)?;
            let via_agent = route::client(state).attach(&PidRequest { pid: id });
            if !route::not_running(&via_agent) {
                via_agent
                    .map_err(route::error)
                    .context("asking the agent's guard to attach")?;
                println!("guard attached to {pid}");
                return Ok(crate::exit::SUCCESS);
            }
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

/// `cryo guard holder`: runs the pin holder (foreground or detached), or lists its pins.
fn holder(ctx: &Context, a: &HolderArgs) -> anyhow::Result<u8> {
    let state = &ctx.state;
    if a.list {
        let Some((info, pins)) = cryo_holder::HolderClient::new(state).inventory()? else {
            println!("no pin holder runs on {}", state.root().display());
            return Ok(crate::exit::SUCCESS);
        };
        println!(
            "pin holder pid {} (cryo {}, protocol {}): {} pin(s); oom_score_adj {}; cgroup {}",
            info.id.pid,
            info.version,
            info.protocol,
            pins.len(),
            info.oom_score_adj,
            info.cgroup
        );
        for p in pins {
            let gpus: Vec<String> = p.meta.gpus.iter().map(ToString::to_string).collect();
            println!(
                "  pin {}: dead pid {} ({}), {} fd(s), GPU {}",
                p.id,
                p.meta.pid.pid,
                p.meta.cause,
                p.held,
                gpus.join(",")
            );
        }
        return Ok(crate::exit::SUCCESS);
    }
    let cgroup = cryo_holder::CgroupChoice::from_env().map_err(anyhow::Error::msg)?;
    if a.detach {
        return match cryo_holder::launch::detach(state, &cgroup, a.take_over) {
            Ok(info) => {
                println!("{}", info.id.pid);
                Ok(crate::exit::SUCCESS)
            }
            Err(cryo_holder::launch::DetachError::AlreadyRunning(m)) => {
                eprintln!("cryo guard holder: {m}");
                Ok(cryo_holder::launch::EXIT_ALREADY_RUNNING as u8)
            }
            Err(e) => Err(e.into()),
        };
    }
    let err = cryo_holder::launch::run_foreground(state, &cgroup, a.take_over, |info| {
        eprintln!(
            "cryo guard holder: pid {} holds pins for {}",
            info.id.pid,
            state.root().display()
        );
    });
    match err {
        cryo_holder::server::ServeError::AlreadyRunning(_) => {
            eprintln!("cryo guard holder: {err}");
            Ok(cryo_holder::launch::EXIT_ALREADY_RUNNING as u8)
        }
        e => Err(e.into()),
    }
}

/// The pin holder of the state directory, started (`/proc/self/exe guard holder --detach`: this
/// very build, even while a package upgrade replaces the file) unless one runs.
pub fn pin_sink(ctx: &Context) -> anyhow::Result<std::sync::Arc<dyn cryo_guard::PinSink>> {
    let mut launch = std::process::Command::new("/proc/self/exe");
    launch
        .arg("--state-dir")
        .arg(ctx.state.root())
        .args(["guard", "holder", "--detach"]);
    let adoption = cryo_holder::ensure(&ctx.state, launch).context("starting the pin holder")?;
    let h = adoption.holder();
    let how = match adoption {
        cryo_holder::Adoption::Adopted(_) => "adopted the running",
        cryo_holder::Adoption::Started(_) => "started the",
    };
    eprintln!(
        "cryo guard: {how} pin holder (pid {}, cryo {}, {} pin(s); oom_score_adj {}; cgroup {})",
        h.id.pid, h.version, h.pins, h.oom_score_adj, h.cgroup
    );
    Ok(std::sync::Arc::new(cryo_guard::HolderSink::new(&ctx.state)))
}

/// The guard's configuration the options ask for (`cryo guard`, `cryo agent run`).
pub fn config(ctx: &Context, a: &GuardRunArgs) -> GuardConfig {
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
        psi_full_avg10: a.psi_avg10,
        interval: Duration::from_millis(a.poll_ms),
    });
    cfg.scan = match a.scan {
        ScanArg::AllCuda => cryo_guard::Scan::AllCuda,
        ScanArg::None => cryo_guard::Scan::None,
    };
    cfg
}

/// Refuses options that do not go together.
pub fn check(a: &GuardRunArgs) -> anyhow::Result<()> {
    if a.restart_cmd.is_some() && a.endgame != EndgameArg::Drain {
        bail!(crate::exit::UsageError(
            "--restart-cmd needs --endgame drain".into()
        ));
    }
    Ok(())
}

fn serve(ctx: &Context, a: &GuardRunArgs) -> anyhow::Result<()> {
    check(a)?;
    let sink = a.pin_holder.then(|| pin_sink(ctx)).transpose()?;
    let terminate = cryo_guard::termination_flag().context("installing the SIGTERM handler")?;
    let gpu = ctx.gpu()?;
    let opts = RunOptions {
        pids: a.pids.clone(),
        poll: Duration::from_millis(a.poll_ms),
    };
    let mut cfg = config(ctx, a);
    cfg.pin_sink = sink;
    cryo_guard::run(
        gpu,
        cfg,
        &opts,
        &|| terminate.load(std::sync::atomic::Ordering::SeqCst),
        // Never `eprintln!`: it panics on a closed stderr, and the guard must outlive its terminal.
        &mut |notice| {
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "cryo guard: {notice}");
        },
    )?;
    Ok(())
}
