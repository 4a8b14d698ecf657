//! `cryo freeze`: the handler. The procedure is `cryo_lifecycle::freeze`; this file finds CRIU,
//! asks `cryo guard` to let go of the tree (CRIU must trace it itself) and takes it back after,
//! shows progress and reports (text or JSON, exit codes: 0 published, 3 refused, 1 error).

use std::time::Duration;

use anyhow::Context as _;
use cryo_criu::Criu;
use cryo_lifecycle::{FreezeError, FreezeOptions, SuspendOptions};

use super::Context;
use crate::args::size::human;
use crate::args::FreezeArgs;
use crate::exit;

/// Runs `cryo freeze`; returns the exit code.
pub fn run(ctx: &Context, args: &FreezeArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    // CRIU first: a missing or old CRIU is one clear line before anything is touched.
    let criu = Criu::locate(None)?;
    crate::target::open_process(args.pid)?;
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
    let detached = detach_guard(&ctx.state, args.pid)?;
    let progress = crate::progress::for_stderr();
    let result = cryo_lifecycle::freeze(&gpu, &criu, args.pid, &opts, &journal, progress.as_ref());
    drop(progress);
    // Whatever is still alive (a refused or failed freeze, --leave-running) goes back under the guard.
    for pid in detached
        .iter()
        .filter(|p| std::path::Path::new(&format!("/proc/{p}")).exists())
    {
        if let Err(e) = cryo_guard::control::attach(&ctx.state, *pid) {
            eprintln!("cryo: warning: cannot hand pid {pid} back to the guard: {e}; run `cryo guard attach {pid}`");
        }
    }
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
            human(m.total_bytes),
            human(report.suspended.iter().map(|s| s.device_memory).sum()),
        );
        println!(
            "  suspend {} ms, dump {} ms, publish {} ms, total {} ms; {}",
            report.suspend_ms,
            report.dump_ms,
            report.publish_ms,
            report.elapsed_ms,
            if report.left_running {
                "the worker keeps running (restored in place)"
            } else {
                "the worker is gone (its contexts were suspended first)"
            }
        );
    }
    Ok(exit::SUCCESS)
}

/// CRIU must trace the tree itself: asks the running guard (`cryo guard`) to let go of every
/// process of the tree it traces. Returns the pids it let go of. A process traced by anything else
/// is refused later by the freeze, naming its tracer.
fn detach_guard(
    state: &cryo_state::StateDir,
    root: cryo_gpu::Pid,
) -> anyhow::Result<Vec<cryo_gpu::Pid>> {
    let mut detached = Vec::new();
    for pid in
        cryo_proc::tree(root).with_context(|| format!("listing the process tree of pid {root}"))?
    {
        if cryo_lifecycle::freeze::tracer_of(pid).unwrap_or(0) == 0 {
            continue;
        }
        if cryo_guard::control::detach(state, pid)
            .with_context(|| format!("asking the guard to detach from pid {pid}"))?
        {
            detached.push(pid);
            // The detach is carried out by the guard's tracer thread: give it a moment.
            let deadline = std::time::Instant::now() + Duration::from_secs(2);
            while cryo_lifecycle::freeze::tracer_of(pid).unwrap_or(0) != 0
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(5));
            }
        }
    }
    Ok(detached)
}
