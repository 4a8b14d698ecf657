//! `cryo park` and `cryo wake`: the handlers. The procedures are `cryo_lifecycle::park` and
//! `cryo_lifecycle::wake`; this file turns arguments into a target and options, and reports.

use anyhow::Context as _;
use cryo_api::{ParkRequest, TargetSpec, WakeRequest, WakeSpec, WhenFullSpec};
use cryo_lifecycle::park::{PlaceError, WakeError};
use cryo_lifecycle::{ParkError, ParkReport, Target, WakeReport};
use cryo_units::fmt_bytes;

use super::Context;
use crate::args::park::{ParkArgs, TargetArgs, WakeArgs, WakeHowArgs, WhenFullArg};
use crate::exit::{self, UsageError};
use crate::route::{self, Outcome};

/// The target the arguments name.
pub fn target(args: &TargetArgs) -> Target {
    match (&args.cgroup, args.pids.as_slice()) {
        (Some(path), _) => Target::Cgroup(path.clone()),
        (None, [one]) => Target::Tree(*one),
        (None, many) => Target::Pids(many.to_vec()),
    }
}

/// Runs `cryo park` (through the agent when one runs); returns the exit code.
pub fn run_park(ctx: &Context, args: &ParkArgs) -> anyhow::Result<u8> {
    let _deferred = crate::defer::termination();
    let target = target(&args.target);
    let req = ParkRequest {
        target: TargetSpec::from(&target),
        lock_timeout_ms: args.timeout,
        lock_attempts: args.lock_attempts,
        max_parked_host: args.max_parked_host.map(|b| b.0),
        shrink: args.shrink.shrink()?,
    };
    let result = route::through_agent(
        &ctx.state,
        |client, p| client.park(&req, p),
        route::outcome,
        |client, p| {
            route::standalone_note(client);
            park_standalone(ctx, &req, &target, p)
        },
    );
    let report = match result {
        Ok(r) => r,
        Err(Outcome::Refused(e)) => {
            return Ok(refused(&e, "the worker serves as before", args.json))
        }
        Err(Outcome::Failed(e)) => return Err(e.context(format!("parking {target}"))),
    };
    if args.json {
        route::print_outcome(&report, "parked")?;
    } else {
        for p in &report.parked {
            println!(
                "pid {}: parked{}, {} off GPU {}, holds {} of host memory",
                p.pid,
                if p.already { " already" } else { "" },
                fmt_bytes(p.device_bytes),
                p.gpus
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                fmt_bytes(p.host_bytes)
            );
        }
        println!(
            "parked {} CUDA processes of {} in {} ms",
            report.parked.len(),
            report.target,
            report.elapsed_ms
        );
        if let Some(s) = &report.shrink {
            println!("{}", s.summary());
        }
    }
    Ok(exit::SUCCESS)
}

/// Runs `cryo wake` (through the agent when one runs); returns the exit code.
pub fn run_wake(ctx: &Context, args: &WakeArgs) -> anyhow::Result<u8> {
    let _deferred = crate::defer::termination();
    let target = target(&args.target);
    let req = WakeRequest {
        target: TargetSpec::from(&target),
        wake: wake_spec(&args.how),
    };
    if let Some(h) = &req.wake.options().health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let result = route::through_agent(
        &ctx.state,
        |client, p| client.wake(&req, p),
        route::outcome,
        |client, p| {
            route::standalone_note(client);
            wake_standalone(ctx, &req, &target, p)
        },
    );
    let report = match result {
        Ok(r) => r,
        Err(Outcome::Refused(e)) => return Ok(refused(&e, "nothing was restored", args.json)),
        Err(Outcome::Failed(e)) => return Err(e.context(format!("waking {target}"))),
    };
    if !report.guarded {
        eprintln!("cryo: no guard runs: nothing guards the woken worker against a disorderly death (start `cryo guard` or the agent)");
    }
    if args.json {
        route::print_outcome(&report, "serving")?;
    } else if report.woken.is_empty() {
        // A wake that found nothing parked (another wake brought it back first).
        println!(
            "nothing to wake: every CUDA process of {} already runs",
            report.target
        );
    } else {
        for w in &report.woken {
            println!(
                "pid {}: woken on GPU {} ({}{})",
                w.pid,
                w.gpus
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(","),
                fmt_bytes(w.bytes),
                w.restore_ms
                    .map_or(String::new(), |ms| format!(", restore {ms} ms"))
            );
        }
        println!(
            "woke {} CUDA processes of {}: waited {} ms for GPU memory, restore+guard+unlock {} ms, total {} ms{}",
            report.woken.len(),
            report.target,
            report.waited_ms,
            report.gpu_ms,
            report.elapsed_ms,
            report
                .first_answer_ms
                .map_or(String::new(), |ms| format!(", first healthy answer at {ms} ms"))
        );
        if let Some(s) = &report.shrink {
            println!("{}", s.summary());
        }
    }
    Ok(exit::SUCCESS)
}

/// `--when-full` (and `--wait` seconds) as the API and the lifecycle take it.
pub fn when_full(arg: WhenFullArg, wait: u64) -> WhenFullSpec {
    match arg {
        WhenFullArg::Wait => WhenFullSpec::Wait { wait_s: wait },
        WhenFullArg::OtherGpu => WhenFullSpec::OtherGpu,
        WhenFullArg::Refuse => WhenFullSpec::Refuse,
    }
}

/// How the arguments wake (`cryo wake`, and a claim of `cryo standby`).
pub fn wake_spec(args: &WakeHowArgs) -> WakeSpec {
    WakeSpec {
        onto: args.onto.clone(),
        when_full: when_full(args.when_full, args.wait),
        health_url: args.health_url.clone(),
        health_timeout_s: args.health_timeout,
    }
}

/// What a park or wake without the agent needs: the target's processes, the driver, the journal.
fn standalone(
    ctx: &Context,
    target: &Target,
) -> anyhow::Result<(
    cryo_lifecycle::Resolved,
    cryo_gpu::Gpu,
    cryo_journal::Journal,
)> {
    let resolved = target.resolve()?;
    let gpu = ctx.gpu()?;
    let journal = ctx.state.open_journal().context("opening the journal")?;
    Ok((resolved, gpu, journal))
}

fn park_standalone(
    ctx: &Context,
    req: &ParkRequest,
    target: &Target,
    progress: &dyn cryo_lifecycle::Progress,
) -> Result<ParkReport, Outcome> {
    let failed = |e: anyhow::Error| Outcome::Failed(e.context(format!("parking {target}")));
    let (resolved, gpu, journal) = standalone(ctx, target).map_err(failed)?;
    let guard = cryo_guard::control::GuardClient::new(&ctx.state);
    match cryo_lifecycle::park(
        &gpu,
        &resolved,
        &req.options(),
        &journal,
        &ctx.state,
        &guard,
        progress,
    ) {
        Ok(r) => Ok(r),
        Err(
            e @ (ParkError::Suspend { .. }
            | ParkError::HostMemory { .. }
            | ParkError::NoCuda(_)
            | ParkError::InProgress { .. }),
        ) => Err(Outcome::Refused(e.to_string())),
        Err(e) => Err(failed(e.into())),
    }
}

fn wake_standalone(
    ctx: &Context,
    req: &WakeRequest,
    target: &Target,
    progress: &dyn cryo_lifecycle::Progress,
) -> Result<WakeReport, Outcome> {
    let failed = |e: anyhow::Error| Outcome::Failed(e.context(format!("waking {target}")));
    let (resolved, gpu, journal) = standalone(ctx, target).map_err(failed)?;
    let guard = cryo_guard::control::GuardClient::new(&ctx.state);
    match cryo_lifecycle::wake(
        &gpu,
        &resolved,
        &req.wake.options(),
        &journal,
        &ctx.state,
        &guard,
        progress,
    ) {
        Ok(r) => Ok(r),
        Err(
            e @ (WakeError::Place(
                PlaceError::NoRoom { .. }
                | PlaceError::NodeFenced { .. }
                | PlaceError::NoSuchGpu { .. },
            )
            | WakeError::NotParked(_)
            | WakeError::DeadPark { .. }
            | WakeError::NoCuda(_)
            | WakeError::InProgress { .. }),
        ) => Err(Outcome::Refused(e.to_string())),
        Err(e) => Err(failed(e.into())),
    }
}

/// Reports a refusal; returns the exit code.
fn refused(e: &str, left: &str, json: bool) -> u8 {
    route::refused(e, &format!("refused: {e}; {left}"), json)
}
