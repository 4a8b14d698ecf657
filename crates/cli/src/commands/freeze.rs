//! `cryo freeze`: the handler. The procedure is `cryo_lifecycle::freeze` (which asks the running
//! guard, through its socket, to let go of the tree around the dump); this file finds CRIU, shows
//! progress and reports (text or JSON, exit codes: 0 published, 3 refused, 1 error).

use anyhow::Context as _;
use cryo_api::FreezeRequest;
use cryo_criu::CriuRpc;
use cryo_guard::control::GuardClient;
use cryo_lifecycle::{FreezeError, FreezeReport, Resolved};

use super::Context;
use crate::args::FreezeArgs;
use crate::exit;
use crate::route::{self, Outcome};
use cryo_units::fmt_bytes;

/// Runs `cryo freeze`; returns the exit code.
pub fn run(ctx: &Context, args: &FreezeArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    let req = FreezeRequest {
        pid: args.pid,
        image: args.image.clone(),
        leave_running: args.leave_running,
        replace: args.replace,
        lock_timeout_ms: args.timeout,
        shrink: args.shrink.shrink()?,
    };
    let result = route::through_agent(
        &ctx.state,
        |client, p| client.freeze(&req, p),
        route::outcome,
        |client, p| standalone(ctx, client, &req, p),
    );
    let report = match result {
        Ok(r) => r,
        Err(Outcome::Refused(e)) => {
            return Ok(route::refused(
                &e,
                &format!("{e}; the worker keeps serving"),
                args.json,
            ))
        }
        Err(Outcome::Failed(e)) => {
            return Err(e.context(format!(
                "freezing pid {} into {}",
                args.pid,
                args.image.display()
            )))
        }
    };
    if args.json {
        route::print_outcome(&report, "published")?;
    } else {
        let m = &report.manifest;
        println!(
            "frozen pid {} ({} processes, {} CUDA) into {}: {} image, {} of device memory",
            m.root_pid,
            m.processes.len(),
            report.suspended.len(),
            report.image.display(),
            fmt_bytes(m.total_bytes),
            fmt_bytes(report.suspended.iter().map(|s| s.device_memory).sum()),
        );
        println!(
            "  suspend {} ms, dump {} ms, publish {} ms, total {} ms; {}",
            report.suspend_ms,
            report.dump_ms,
            report.publish_ms,
            report.elapsed_ms,
            if report.left_running {
                "the worker keeps running (restored in place)".to_string()
            } else if report.pids_held.is_empty() {
                "the worker is gone (its contexts were suspended first)".to_string()
            } else {
                format!(
                    "the worker has exited (its contexts were suspended first), but its pids are not free yet: {}",
                    cryo_lifecycle::reaped::describe(&report.pids_held)
                )
            }
        );
        if !report.ended.is_empty() || !report.forked.is_empty() {
            println!(
                "  the tree changed during the freeze: ended before the dump (not in the image): {}; forked before the dump (in the image): {}",
                fmt_pid_list(&report.ended),
                fmt_pid_list(&report.forked)
            );
        }
        if !report.left.is_empty() {
            println!(
                "  left the tree before the dump (reparented out; not in the image, left running): {}",
                fmt_pid_list(&report.left)
            );
        }
        if let Some(s) = &report.shrink {
            println!("  {}", s.summary());
        }
    }
    Ok(exit::SUCCESS)
}

/// The freeze in this process (no agent runs): what the agent's handler does too.
fn standalone(
    ctx: &Context,
    client: &cryo_api::AgentClient,
    req: &FreezeRequest,
    progress: &dyn cryo_lifecycle::Progress,
) -> Result<FreezeReport, Outcome> {
    let failed = Outcome::Failed;
    // CRIU first: a missing or old CRIU is one clear line before anything is touched.
    let criu = CriuRpc::locate_in(None, &ctx.state.criu_dir()).map_err(|e| failed(e.into()))?;
    route::standalone_note(client);
    // Resolved once: the root must be a process (not a thread), and the freeze acts on the tree
    // found now, walked from its root (settled again at CRIU's gate: `Resolved::tree_walked`).
    let root = crate::process::open_process(req.pid).map_err(failed)?;
    let tree = Resolved::tree_walked(root);
    let gpu = ctx.gpu().map_err(failed)?;
    let journal = ctx
        .state
        .open_journal()
        .context("opening the journal")
        .map_err(failed)?;
    // CRIU must trace the tree itself: a running standalone guard lets go of it for the dump.
    let guard = GuardClient::new(&ctx.state);
    let frozen = cryo_lifecycle::freeze(
        &gpu,
        &criu,
        &tree,
        &req.options(),
        &journal,
        &guard,
        progress,
    );
    give_back_dead_pins(&journal);
    match frozen {
        Ok(r) => Ok(r),
        Err(
            e @ (FreezeError::Refused(_)
            | FreezeError::CrossProcessCuda { .. }
            | FreezeError::CudaProcessEnded { .. }
            | FreezeError::KeepsForking { .. }
            | FreezeError::InProgress { .. }),
        ) => Err(Outcome::Refused(e.to_string())),
        Err(e) => Err(failed(e.into())),
    }
}

/// After a freeze (whatever its outcome): the CPU sets an earlier freeze that died mid-dump left
/// pinned are given back (`cryo_lifecycle::cpus::give_back_dead_pins`); a failure is only
/// logged, the freeze's outcome stands.
pub(crate) fn give_back_dead_pins(journal: &cryo_journal::Journal) {
    match cryo_lifecycle::cpus::give_back_dead_pins(journal) {
        Ok(settled) => {
            for s in settled {
                tracing::warn!("{s}");
            }
        }
        Err(err) => {
            tracing::warn!(%err, "cannot give back the CPU sets a dead freeze left pinned")
        }
    }
}

/// `12,13`, or `none`.
fn fmt_pid_list(pids: &[i32]) -> String {
    if pids.is_empty() {
        return "none".into();
    }
    pids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}
