//! `cryo park` and `cryo wake`: the handlers. The procedures are `cryo_lifecycle::park` and
//! `cryo_lifecycle::wake`; this file turns arguments into a target and options, and reports.

use std::time::Duration;

use anyhow::Context as _;
use cryo_lifecycle::park::{PlaceError, WakeError};
use cryo_lifecycle::{
    HealthCheck, ParkError, ParkOptions, SuspendOptions, Target, WakeOptions, WhenFull,
};
use cryo_units::fmt_bytes;

use super::Context;
use crate::args::park::{ParkArgs, TargetArgs, WakeArgs, WhenFullArg};
use crate::exit::{self, UsageError};

/// The target the arguments name.
pub fn target(args: &TargetArgs) -> Target {
    match (&args.cgroup, args.pids.as_slice()) {
        (Some(path), _) => Target::Cgroup(path.clone()),
        (None, [one]) => Target::Tree(*one),
        (None, many) => Target::Pids(many.to_vec()),
    }
}

/// Runs `cryo park`; returns the exit code.
pub fn run_park(ctx: &Context, args: &ParkArgs) -> anyhow::Result<u8> {
    let _deferred = crate::defer::termination();
    let target = target(&args.target);
    let resolved = target
        .resolve()
        .with_context(|| format!("parking {target}"))?;
    let gpu = ctx.gpu()?;
    let journal = ctx.state.open_journal().context("opening the journal")?;
    let opts = ParkOptions {
        suspend: SuspendOptions {
            lock_timeout: Duration::from_millis(args.timeout),
            lock_attempts: args.lock_attempts,
            resume_on_failure: true,
            ..SuspendOptions::default()
        },
        max_parked_host: args.max_parked_host.map(|b| b.0),
    };
    let progress = crate::progress::for_stderr();
    let result = cryo_lifecycle::park(&gpu, &resolved, &opts, &journal, progress.as_ref());
    drop(progress);
    let report = match result {
        Ok(r) => r,
        Err(
            e @ (ParkError::Suspend { .. } | ParkError::HostMemory { .. } | ParkError::NoCuda(_)),
        ) => {
            return Ok(refused(
                &e.to_string(),
                "the worker serves as before",
                args.json,
            ))
        }
        Err(e) => return Err(anyhow::Error::new(e).context(format!("parking {target}"))),
    };
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["outcome"] = "parked".into();
        println!("{v}");
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
    }
    Ok(exit::SUCCESS)
}

/// Runs `cryo wake`; returns the exit code.
pub fn run_wake(ctx: &Context, args: &WakeArgs) -> anyhow::Result<u8> {
    let _deferred = crate::defer::termination();
    let health = args.health_url.clone().map(HealthCheck::Url);
    if let Some(h) = &health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let target = target(&args.target);
    let resolved = target
        .resolve()
        .with_context(|| format!("waking {target}"))?;
    let gpu = ctx.gpu()?;
    let journal = ctx.state.open_journal().context("opening the journal")?;
    let opts = WakeOptions {
        gpus: (!args.onto.is_empty()).then(|| args.onto.clone()),
        when_full: when_full(args.when_full, args.wait),
        health,
        health_timeout: Duration::from_secs(args.health_timeout),
        resuspend: SuspendOptions::default(),
    };
    let guard = cryo_guard::control::GuardClient::new(&ctx.state);
    let progress = crate::progress::for_stderr();
    let result = cryo_lifecycle::wake(
        &gpu,
        &resolved,
        &opts,
        &journal,
        &ctx.state.fence(),
        &guard,
        progress.as_ref(),
    );
    drop(progress);
    let report = match result {
        Ok(r) => r,
        Err(
            e @ (WakeError::Place(
                PlaceError::NoRoom { .. }
                | PlaceError::NodeFenced { .. }
                | PlaceError::NoSuchGpu { .. },
            )
            | WakeError::NotParked(_)
            | WakeError::NoCuda(_)),
        ) => return Ok(refused(&e.to_string(), "nothing was restored", args.json)),
        Err(e) => return Err(anyhow::Error::new(e).context(format!("waking {target}"))),
    };
    if !report.guarded {
        eprintln!("cryo: no guard runs: nothing guards the woken worker against a disorderly death (start `cryo guard` or the agent)");
    }
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["outcome"] = "serving".into();
        println!("{v}");
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
    }
    Ok(exit::SUCCESS)
}

/// `--when-full` (and `--wait` seconds) as the lifecycle takes it.
pub fn when_full(arg: WhenFullArg, wait: u64) -> WhenFull {
    match arg {
        WhenFullArg::Wait => WhenFull::Wait(Duration::from_secs(wait)),
        WhenFullArg::OtherGpu => WhenFull::OtherGpu,
        WhenFullArg::Refuse => WhenFull::Refuse,
    }
}

/// Reports a refusal; returns the exit code.
fn refused(e: &str, left: &str, json: bool) -> u8 {
    if json {
        println!(
            "{}",
            serde_json::json!({ "outcome": "refused", "error": e })
        );
    }
    eprintln!("cryo: refused: {e}; {left}");
    exit::REFUSED
}
