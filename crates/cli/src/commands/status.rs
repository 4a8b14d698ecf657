//! `cryo status`: quarantined GPUs (the fence) and what the running guard watches and pins.

use anyhow::Context as _;

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
    if args.json {
        let v = serde_json::json!({
            "quarantined": quarantined,
            "guard": guard.as_ref().ok().cloned().flatten(),
            "guard_error": guard.as_ref().err(),
        });
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
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
