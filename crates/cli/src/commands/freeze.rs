//! `cryo freeze`: the handler. The procedure is `cryo_lifecycle::freeze` (which asks the running
//! guard, through its socket, to let go of the tree around the dump); this file finds CRIU, shows
//! progress and reports (text or JSON, exit codes: 0 published, 3 refused, 1 error).

use std::time::Duration;

use anyhow::Context as _;
use cryo_criu::CriuRpc;
use cryo_guard::control::GuardClient;
use cryo_lifecycle::{FreezeError, FreezeOptions, Resolved, SuspendOptions};

use super::Context;
use crate::args::FreezeArgs;
use crate::exit;
use cryo_units::fmt_bytes;

/// Runs `cryo freeze`; returns the exit code.
pub fn run(ctx: &Context, args: &FreezeArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    // CRIU first: a missing or old CRIU is one clear line before anything is touched.
    let criu = CriuRpc::locate(None)?;
    // Resolved once: the root must be a process (not a thread), and the freeze acts on exactly
    // the tree found now.
    let tree = Resolved::tree(crate::process::open_process(args.pid)?)
        .with_context(|| format!("listing the process tree of pid {}", args.pid))?;
    let gpu = ctx.gpu()?;
    let journal = ctx.state.open_journal().context("opening the journal")?;
    let opts = FreezeOptions {
        image: args.image.clone(),
        leave_running: args.leave_running,
        replace: args.replace,
        suspend: SuspendOptions {
            lock_timeout: Duration::from_millis(args.timeout),
            resume_on_failure: true,
            ..SuspendOptions::default()
        },
    };
    let progress = crate::progress::for_stderr();
    // CRIU must trace the tree itself: the running guard (if any) lets go of it for the dump.
    let guard = GuardClient::new(&ctx.state);
    let result = cryo_lifecycle::freeze(
        &gpu,
        &criu,
        &tree,
        &opts,
        &journal,
        &guard,
        progress.as_ref(),
    );
    drop(progress);
    let report = match result {
        Ok(r) => r,
        Err(e @ FreezeError::Refused(_)) => {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({ "outcome": "refused", "error": e.to_string() })
                );
            }
            eprintln!("cryo: {e}; the worker keeps serving");
            return Ok(exit::REFUSED);
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!(
                "freezing pid {} into {}",
                args.pid,
                args.image.display()
            )))
        }
    };
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["outcome"] = "published".into();
        println!("{v}");
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
    }
    Ok(exit::SUCCESS)
}
