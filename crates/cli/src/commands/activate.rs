//! `cryo activate`: the activator in the foreground for one worker parked in place. The
//! activator is `cryo_activator`; the waking is the lifecycle's park and wake
//! (`cryo_activator::InPlace`), guarded before unlock by the running guard.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cryo_activator::{Activator, InPlace, Policy};
use cryo_lifecycle::{HealthCheck, ParkOptions, SuspendOptions, WakeOptions};

use super::park::{target, when_full};
use super::Context;
use crate::args::activate::ActivateArgs;
use crate::exit::{self, UsageError};

/// Runs `cryo activate` until killed.
pub fn run(ctx: &Context, args: &ActivateArgs) -> anyhow::Result<u8> {
    let health = args.health_url.clone().map(HealthCheck::Url);
    if let Some(h) = &health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let inplace = InPlace {
        gpu: ctx.gpu()?,
        target: target(&args.target),
        state: ctx.state.clone(),
        watcher: Arc::new(cryo_guard::control::GuardClient::new(&ctx.state)),
        park: ParkOptions {
            max_parked_host: args.max_parked_host.map(|b| b.0),
            ..ParkOptions::default()
        },
        wake: WakeOptions {
            gpus: (!args.onto.is_empty()).then(|| args.onto.clone()),
            when_full: when_full(args.when_full, args.wait).into(),
            health: None,
            resuspend: SuspendOptions::default(),
            ..WakeOptions::default()
        },
    };
    let initial = inplace.phase_now().context("looking at the worker")?;
    let policy = Policy {
        idle_timeout: (args.idle_timeout > 0).then(|| Duration::from_secs(args.idle_timeout)),
        activation_timeout: Duration::from_secs(args.activation_timeout),
        health,
        http: !args.no_http,
    };
    let activator = Activator::new(
        args.upstream.clone(),
        policy,
        Arc::new(inplace),
        initial.clone(),
    );
    cryo_activator::run_blocking(&args.listen, activator, |addr| {
        println!(
            "activator listening on {addr} for {} (worker {initial:?})",
            args.upstream
        );
    })
    .with_context(|| format!("serving on {}", args.listen))?;
    Ok(exit::SUCCESS)
}
