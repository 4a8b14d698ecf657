//! `cryo agent run|status|stop`: the daemon is `cryo_agent::run`; this file turns the arguments
//! into its configuration, and asks a running agent through `cryo_api`.

use std::time::{Duration, Instant};

use anyhow::{bail, Context as _};
use cryo_agent::AgentConfig;
use cryo_api::{AgentStatus, ClientError};
use cryo_guard::RunOptions;
use cryo_telemetry::TelemetryConfig;

use super::Context;
use crate::args::agent::{AgentArgs, AgentCommand, AgentRunArgs};
use crate::route;

/// How long `cryo agent stop` waits for the agent to be gone.
const STOP_WAIT: Duration = Duration::from_secs(60);

/// `cryo agent ...`.
pub fn run(ctx: &Context, args: &AgentArgs) -> anyhow::Result<u8> {
    match &args.command {
        AgentCommand::Run(a) => serve(ctx, a).map(|()| crate::exit::SUCCESS),
        AgentCommand::Status(s) => {
            let status = route::client(&ctx.state).status().map_err(not_running)?;
            if s.json {
                println!("{}", serde_json::to_string_pretty(&status)?);
            } else {
                print_status(&status);
            }
            Ok(crate::exit::SUCCESS)
        }
        AgentCommand::Stop => stop(ctx).map(|()| crate::exit::SUCCESS),
        AgentCommand::KeepListener(k) => {
            cryo_agent::keeper::keep_listener(k.agent).context("keeping a listening socket")?;
            Ok(crate::exit::SUCCESS)
        }
    }
}

fn not_running(e: ClientError) -> anyhow::Error {
    match e {
        ClientError::NotRunning(s) => {
            anyhow::anyhow!("no agent runs (nothing answers on {})", s.display())
        }
        e => route::error(e),
    }
}

fn serve(ctx: &Context, a: &AgentRunArgs) -> anyhow::Result<()> {
    super::guard::check(&a.guard)?;
    // Said in the log (the agent writes nothing to stderr but its log).
    let backend = crate::backend::resolve(ctx.global.gpu, &ctx.global.sim_dir)?;
    if let Some(note) = backend.note {
        tracing::info!("{note}");
    }
    let gpu = backend.gpu;
    let cfg = AgentConfig {
        state: ctx.state.clone(),
        socket: a.socket.clone().unwrap_or_else(|| ctx.state.agent_socket()),
        read_group: a.read_group.clone(),
        guard: {
            // The agent's pins live in the pin holder (started, or the running one adopted), so
            // that the agent's death or restart never closes them.
            let mut g = super::guard::config(ctx, &a.guard);
            g.pin_sink = Some(super::guard::pin_sink(ctx)?);
            g
        },
        guard_run: RunOptions {
            pids: a.guard.pids.clone(),
            poll: Duration::from_millis(a.guard.poll_ms),
        },
        telemetry: TelemetryConfig {
            metrics_listen: (!a.no_metrics_listen).then(|| a.metrics_listen.clone()),
            syslog: a.syslog.clone(),
        },
        kube: a.kube_node.as_ref().map(|node| cryo_agent::KubeConfig {
            node: node.clone(),
            kubeconfig: a.kubeconfig.clone(),
            cgroup_root: a.cgroup_root.clone(),
        }),
    };
    cryo_agent::run(gpu, cfg).context("running the agent")?;
    Ok(())
}

fn stop(ctx: &Context) -> anyhow::Result<()> {
    let client = route::client(&ctx.state);
    let report = client.shutdown().map_err(not_running)?;
    eprintln!("cryo: the agent (pid {}) is stopping", report.pid);
    // Done once its socket no longer answers (requests in flight finish first).
    let deadline = Instant::now() + STOP_WAIT;
    loop {
        match client.status() {
            Err(ClientError::NotRunning(_)) => break,
            // Mid-shutdown the connection may be cut: ask again.
            Ok(_) | Err(ClientError::Http(_)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(50));
            }
            Ok(_) | Err(ClientError::Http(_)) => bail!(
                "the agent (pid {}) accepted the stop but still answers after {} s (requests in flight?)",
                report.pid,
                STOP_WAIT.as_secs()
            ),
            Err(e) => return Err(route::error(e)),
        }
    }
    println!("agent stopped");
    Ok(())
}

/// `cryo agent status` in words.
fn print_status(s: &AgentStatus) {
    println!(
        "agent: pid {}, cryo {}, up {} s, backend {}",
        s.pid, s.version, s.uptime_s, s.backend
    );
    println!(
        "  socket {} (reads: {}), state {}",
        s.socket.display(),
        s.read_group
            .as_deref()
            .map_or("root only".to_string(), |g| format!("root and group {g}")),
        s.state_dir.display()
    );
    println!(
        "  metrics: {}",
        s.metrics_addr
            .as_deref()
            .map_or("on the socket only (/v1/metrics)".to_string(), |a| format!(
                "http://{a}/metrics and /v1/metrics"
            ))
    );
    if let Some(f) = &s.syslog {
        println!(
            "  syslog: {} ({}; delivered up to seq {}{})",
            f.collector,
            if f.connected {
                "connected"
            } else {
                "NOT connected"
            },
            f.delivered_seq,
            f.last_error
                .as_deref()
                .map(|e| format!("; last error: {e}"))
                .unwrap_or_default()
        );
    }
    println!("  pin holder: {}", s.holder);
    if s.stopping {
        println!("  STOPPING (a shutdown was accepted)");
    }
    super::status::print_fence_and_guard(
        &s.quarantined,
        s.fence_error.as_deref(),
        Ok(Some(&s.guard)),
    );
}
