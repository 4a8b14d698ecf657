//! `cryo status`: parked workers and the host memory they hold, quarantined GPUs (the fence),
//! and what the running guard watches and pins.

use anyhow::Context as _;

use cryo_units::fmt_bytes;

use super::Context;
use crate::args::guard::StatusArgs;

/// `cryo status`.
pub fn run(ctx: &Context, args: &StatusArgs) -> anyhow::Result<()> {
    let state = &ctx.state;
    let fence = state.fence();
    let quarantined = fence
        .list()
        .with_context(|| format!("reading the GPU quarantine {}", fence.path().display()))?;
    let guard = match cryo_guard::control::GuardClient::new(state).status() {
        Ok(s) => Ok(s),
        Err(e) => Err(e.to_string()),
    };
    // Parked workers: from the journal and /proc (no driver call). A journal that cannot be read
    // is said, not fatal: the rest of the status still matters.
    let parked = state
        .read_journal()
        .map(|scan| cryo_lifecycle::parked_now(&scan.records))
        .map_err(|e| e.to_string());
    if args.json {
        let v = serde_json::json!({
            "parked": parked.as_ref().ok(),
            "parked_host_bytes": parked.as_ref().ok().map(|p| p.iter().map(|w| w.host_bytes).sum::<u64>()),
            "parked_error": parked.as_ref().err(),
            "quarantined": quarantined,
            "guard": guard.as_ref().ok().cloned().flatten(),
            "guard_error": guard.as_ref().err(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    match &parked {
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
    if quarantined.is_empty() {
        println!("quarantined GPUs: none");
    } else {
        println!(
            "quarantined GPUs (no thaw is placed on them; `cryo guard release` closes their pins):"
        );
        for q in &quarantined {
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
    Ok(())
}
