//! `cryo status`: parked workers and the standby pools (what each holds of host memory),
//! quarantined GPUs (the fence), and what the guard watches and pins: the agent's when one
//! runs, else a standalone `cryo guard`'s.

use anyhow::Context as _;
use cryo_guard::GuardStatus;
use cryo_state::fence::Quarantine;
use cryo_units::fmt_bytes;

use super::Context;
use crate::args::guard::StatusArgs;
use crate::route;

/// `cryo status`.
pub fn run(ctx: &Context, args: &StatusArgs) -> anyhow::Result<()> {
    let state = &ctx.state;
    // Parked workers: from the journal and /proc (no driver call). A journal that cannot be read
    // is said, not fatal: the rest of the status still matters.
    let records = state
        .read_journal()
        .map(|scan| scan.records)
        .map_err(|e| e.to_string());
    // A standby's processes are parked too: listed once, as the standby.
    let parked = records.as_ref().map_err(Clone::clone).map(|r| {
        let standby = cryo_lifecycle::standby::standby_pids(r);
        cryo_lifecycle::parked_now(r)
            .into_iter()
            .filter(|w| !standby.contains(&w.pid))
            .collect::<Vec<_>>()
    });
    let pools = records
        .as_ref()
        .map_err(Clone::clone)
        .map(|r| cryo_lifecycle::standby::pools_now(r));
    let client = route::client(state);
    let agent = client.status();
    if !route::not_running(&agent) {
        let s = agent.map_err(route::error)?;
        // What only the agent knows: refills under way and why the last one failed.
        let refills = client.standby_list().map(|l| l.pools).unwrap_or_default();
        let pools = pools.map(|p| with_refills(p, &refills));
        let activators = client
            .activators()
            .map(|l| l.activators)
            .map_err(|e| e.to_string());
        if args.json {
            let v = warm_json(
                &parked,
                &pools,
                serde_json::json!({
                    "activators": activators.as_ref().ok(),
                    "activators_error": activators.as_ref().err(),
                    "quarantined": s.quarantined,
                    "guard": s.guard,
                    "fence_error": s.fence_error,
                    "agent": { "pid": s.pid, "version": s.version, "socket": s.socket },
                }),
            );
            println!("{}", serde_json::to_string_pretty(&v)?);
        } else {
            println!("agent: running as pid {} ({})", s.pid, s.socket.display());
            print_parked(&parked);
            print_pools(&pools, true);
            print_activators(&activators);
            print_fence_and_guard(&s.quarantined, s.fence_error.as_deref(), Ok(Some(&s.guard)));
        }
        return Ok(());
    }
    let fence = state.fence();
    let quarantined = fence
        .list()
        .with_context(|| format!("reading the GPU quarantine {}", fence.path().display()))?;
    let guard = match cryo_guard::control::GuardClient::new(state).status() {
        Ok(s) => Ok(s),
        Err(e) => Err(e.to_string()),
    };
    let pools = pools.map(|p| with_refills(p, &[]));
    if args.json {
        let v = warm_json(
            &parked,
            &pools,
            serde_json::json!({
                "quarantined": quarantined,
                "guard": guard.as_ref().ok().cloned().flatten(),
                "guard_error": guard.as_ref().err(),
            }),
        );
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    println!("agent: not running");
    print_parked(&parked);
    print_pools(&pools, false);
    print_fence_and_guard(
        &quarantined,
        None,
        guard.as_ref().map(Option::as_ref).map_err(String::as_str),
    );
    Ok(())
}

/// `cryo status --json`: the parked workers and the standby pools (the host memory each holds),
/// with `rest` (what the agent or the standalone guard says) merged in.
fn warm_json(
    parked: &Result<Vec<cryo_lifecycle::ParkedWorker>, String>,
    pools: &Result<Vec<Pool>, String>,
    mut rest: serde_json::Value,
) -> serde_json::Value {
    let warm = serde_json::json!({
        "parked": parked.as_ref().ok(),
        "parked_host_bytes": parked.as_ref().ok().map(|p| p.iter().map(|w| w.host_bytes).sum::<u64>()),
        "parked_error": parked.as_ref().err(),
        "standby_pools": pools.as_ref().ok(),
        "standby_host_bytes": pools.as_ref().ok().map(|p| p.iter().map(|x| x.now.host_bytes).sum::<u64>()),
    });
    if let (Some(rest), serde_json::Value::Object(warm)) = (rest.as_object_mut(), warm) {
        rest.extend(warm);
    }
    rest
}

/// The agent's activators in words.
fn print_activators(activators: &Result<Vec<cryo_api::ActivatorStatus>, String>) {
    match activators {
        Err(e) => println!("activators: the agent cannot list them: {e}"),
        Ok(a) if a.is_empty() => println!("activators: none"),
        Ok(a) => {
            println!("activators (the agent's; `cryo activate --remove ADDR` ends one):");
            for x in a {
                let worker = match (&x.spec.standby, &x.claimed) {
                    (Some(image), Some(root)) => {
                        format!("standby of {} claimed as pid {}", image.display(), root.pid)
                    }
                    (Some(image), None) => format!("a standby of {}", image.display()),
                    (None, _) => format!("{:?}", x.spec.target),
                };
                println!(
                    "  {} -> {}  {}  {}  activations {} ({} failed), idle parks {}, forwarded {}{}",
                    x.spec.listen,
                    x.spec.upstream,
                    worker,
                    x.phase,
                    x.activations,
                    x.failed_activations,
                    x.idle_parks,
                    x.forwarded,
                    x.last_error
                        .as_ref()
                        .map(|e| format!(", last error: {e}"))
                        .unwrap_or_default()
                );
            }
        }
    }
}

/// Parked workers in words.
fn print_parked(parked: &Result<Vec<cryo_lifecycle::ParkedWorker>, String>) {
    match parked {
        Err(e) => println!("parked workers: cannot read the journal: {e}"),
        Ok(p) if p.is_empty() => println!("parked workers: none"),
        Ok(p) => {
            println!(
                "parked workers ({} of host memory held; `cryo wake PID` brings one back):",
                fmt_bytes(p.iter().map(|w| w.host_bytes).sum())
            );
            for w in p {
                println!(
                    "  pid {}  {} off GPU {}  holds {} of host memory",
                    w.pid.pid,
                    fmt_bytes(w.device_bytes),
                    w.gpus
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    fmt_bytes(w.host_bytes)
                );
            }
        }
    }
}

/// A pool as `cryo status` shows it: the journal's and `/proc`'s view, and the agent's refills.
#[derive(Debug, serde::Serialize)]
struct Pool {
    #[serde(flatten)]
    now: cryo_lifecycle::standby::PoolNow,
    /// Standbys being restored now (the agent's).
    refilling: u32,
    /// Why the agent's last refill failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    last_error: Option<String>,
}

fn with_refills(
    pools: Vec<cryo_lifecycle::standby::PoolNow>,
    agent: &[cryo_api::PoolStatus],
) -> Vec<Pool> {
    pools
        .into_iter()
        .map(|now| {
            let a = agent.iter().find(|a| a.image == now.image);
            Pool {
                refilling: a.map_or(0, |a| a.refilling),
                last_error: a.and_then(|a| a.last_error.clone()),
                now,
            }
        })
        .collect()
}

/// The standby pools in words.
fn print_pools(pools: &Result<Vec<Pool>, String>, agent: bool) {
    match pools {
        Err(e) => println!("standby pools: cannot read the journal: {e}"),
        Ok(p) if p.is_empty() => println!("standby pools: none"),
        Ok(p) => {
            println!(
                "standby pools ({} ready, {} of host memory held; `cryo standby claim --image DIR` hands one out{}):",
                p.iter().map(|x| x.now.ready.len()).sum::<usize>(),
                fmt_bytes(p.iter().map(|x| x.now.host_bytes).sum()),
                if agent { "" } else { "; the agent is not running: nothing is refilled or claimed" }
            );
            for x in p {
                let state = match (&x.last_error, x.refilling) {
                    (Some(e), _) => format!("refill failing ({e})"),
                    (None, n) if n > 0 => format!("{n} being restored"),
                    (None, _) if x.now.ready.len() as u64 >= u64::from(x.now.count) => {
                        "full".to_string()
                    }
                    (None, _) => "short".to_string(),
                };
                println!(
                    "  {}  {} of {} ready, {}; holds {} of host memory, {} off the GPU",
                    x.now.image.display(),
                    x.now.ready.len(),
                    x.now.count,
                    state,
                    fmt_bytes(x.now.host_bytes),
                    fmt_bytes(x.now.device_bytes),
                );
                for s in &x.now.ready {
                    println!(
                        "    standby root pid {} ({} processes, CHECKPOINTED)  holds {} of host memory",
                        s.root.pid,
                        s.processes,
                        fmt_bytes(s.host_bytes)
                    );
                }
            }
        }
    }
}

/// The fence and the guard in words (`cryo status`, `cryo agent status`).
pub fn print_fence_and_guard(
    quarantined: &[Quarantine],
    fence_error: Option<&str>,
    guard: Result<Option<&GuardStatus>, &str>,
) {
    if let Some(e) = fence_error {
        println!("quarantined GPUs: CANNOT READ THE QUARANTINE ({e}): thaws are refused");
    } else if quarantined.is_empty() {
        println!("quarantined GPUs: none");
    } else {
        println!(
            "quarantined GPUs (no thaw is placed on them; `cryo guard release` closes their pins):"
        );
        for q in quarantined {
            println!(
                "  {}  pids {:?}  since {} (unix)  {}",
                q.gpu, q.pids, q.since_unix, q.reason
            );
        }
    }
    match guard {
        Ok(None) => println!("guard: not running"),
        Err(e) => println!("guard: cannot ask it: {e}"),
        Ok(Some(s)) => {
            println!(
                "guard: running as pid {} (tracer tid {}), endgame {}",
                s.guard_pid, s.tracer_tid, s.endgame
            );
            if s.guarded.is_empty() {
                println!("  guarded: none");
            }
            for g in &s.guarded {
                println!(
                    "  guarded pid {} ({}), oom_score_adj {}",
                    g.pid, g.source, g.oom_score_adj
                );
            }
            for p in &s.paused {
                println!("  detached on request (CRIU dump): pid {p}");
            }
            for p in &s.pins {
                println!(
                    "  PINNED context of dead pid {} on {} ({} fds): {}",
                    p.pid,
                    p.gpus
                        .iter()
                        .map(ToString::to_string)
                        .collect::<Vec<_>>()
                        .join(","),
                    p.fds.len(),
                    p.cause
                );
            }
            // An entry with pids names contexts some guard pinned (an entry without, a quarantine
            // file that could not be trusted).
            for q in quarantined.iter().filter(|q| !q.pids.is_empty()) {
                if !s.pins.iter().any(|p| p.gpus.contains(&q.gpu)) {
                    println!("  WARNING: {} is quarantined but this guard holds no pins for it (a previous guard died?)", q.gpu);
                }
            }
        }
    }
}
