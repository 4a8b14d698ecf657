//! `cryo activate`: the activator in the foreground for one worker parked in place, or for a
//! standby of an image claimed on the first connection. The activator is `cryo_activator`; the
//! waking is the lifecycle's park and wake (`cryo_activator::InPlace`), guarded before unlock by
//! the running guard, or the agent's claim (`cryo_activator::FromStandby`).

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use cryo_activator::{Activation, Activator, FromStandby, InPlace, Phase, Policy};
use cryo_api::{ActivatorRemoveRequest, ActivatorSpec, ParkRequest, TargetSpec, WakeSpec};
use cryo_lifecycle::{HealthCheck, ParkOptions, SuspendOptions, WakeOptions};

use super::park::{target, when_full};
use super::Context;
use crate::args::activate::ActivateArgs;
use crate::args::park::TargetArgs;
use crate::exit::{self, UsageError};

/// Runs `cryo activate`: through the agent when one runs (it owns the activator, which
/// outlives this command and the agent's restarts), else in the foreground until killed.
pub fn run(ctx: &Context, args: &ActivateArgs) -> anyhow::Result<u8> {
    let health = args.health_url.clone().map(HealthCheck::Url);
    if let Some(h) = &health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let client = crate::route::client(&ctx.state);
    if let Some(listen) = &args.remove {
        let a = client
            .activator_remove(&ActivatorRemoveRequest {
                listen: listen.clone(),
            })
            .map_err(crate::route::error)?;
        println!(
            "activator on {} removed (worker {}: left as it is)",
            a.spec.listen, a.phase
        );
        return Ok(exit::SUCCESS);
    }
    let (Some(listen), Some(upstream)) = (&args.listen, &args.upstream) else {
        return Err(UsageError("--listen and --upstream are needed".into()).into());
    };
    let spec = ActivatorSpec {
        listen: listen.to_string(),
        upstream: upstream.to_string(),
        target: args.standby.is_none().then(|| {
            TargetSpec::from(&target(&TargetArgs {
                pids: args.pids.clone(),
                cgroup: args.cgroup.clone(),
            }))
        }),
        standby: args.standby.clone(),
        wake: WakeSpec {
            onto: args.onto.clone(),
            when_full: when_full(args.when_full, args.wait),
            health_url: args.health_url.clone(),
            health_timeout_s: args.activation_timeout,
        },
        idle_timeout_s: args.idle_timeout,
        activation_timeout_s: args.activation_timeout,
        http: !args.no_http,
        max_parked_host: args.max_parked_host.map(|b| b.0),
    };
    let made = client.activator_create(&spec);
    if !crate::route::not_running(&made) {
        let a = made.map_err(crate::route::error)?;
        println!(
            "activator listening on {} for {} (worker {}; the agent's: it outlives this command, see `cryo status`, `cryo activate --remove {}`)",
            a.spec.listen, a.spec.upstream, a.phase, a.spec.listen
        );
        return Ok(exit::SUCCESS);
    }
    eprintln!(
        "cryo: no agent answers on {}: the activator runs in this process and ends with it",
        client.socket().display()
    );
    let park = ParkOptions {
        max_parked_host: args.max_parked_host.map(|b| b.0),
        ..ParkOptions::default()
    };
    let when_full = when_full(args.when_full, args.wait);
    let (activation, initial): (Arc<dyn Activation>, Phase) = match &args.standby {
        Some(image) => {
            let client = crate::route::client(&ctx.state);
            client
                .status()
                .map_err(crate::route::error)
                .context("the standby pools are the agent's: start it with `cryo agent run`")?;
            let wake = WakeSpec {
                onto: args.onto.clone(),
                when_full,
                health_url: None,
                health_timeout_s: args.activation_timeout,
            };
            let park = ParkRequest::of(TargetSpec::Pids { pids: Vec::new() }, &park);
            let from = FromStandby::new(client, image.clone(), wake, park);
            (Arc::new(from), Phase::Parked { last_error: None })
        }
        None => {
            let inplace = InPlace {
                gpu: ctx.gpu()?,
                target: target(&TargetArgs {
                    pids: args.pids.clone(),
                    cgroup: args.cgroup.clone(),
                }),
                state: ctx.state.clone(),
                watcher: Arc::new(cryo_guard::control::GuardClient::new(&ctx.state)),
                park,
                wake: WakeOptions {
                    gpus: (!args.onto.is_empty()).then(|| args.onto.clone()),
                    when_full: when_full.into(),
                    health: None,
                    resuspend: SuspendOptions::default(),
                    ..WakeOptions::default()
                },
            };
            let initial = inplace.phase_now().context("looking at the worker")?;
            (Arc::new(inplace), initial)
        }
    };
    let policy = Policy {
        idle_timeout: (args.idle_timeout > 0).then(|| Duration::from_secs(args.idle_timeout)),
        activation_timeout: Duration::from_secs(args.activation_timeout),
        health,
        http: !args.no_http,
    };
    let activator = Activator::new(upstream.clone(), policy, activation, initial.clone());
    cryo_activator::run_blocking(listen, activator, |addr| {
        println!("activator listening on {addr} for {upstream} (worker {initial:?})");
    })
    .with_context(|| format!("serving on {listen}"))?;
    Ok(exit::SUCCESS)
}
