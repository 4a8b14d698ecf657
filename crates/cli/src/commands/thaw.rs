//! `cryo thaw`: the handler. The procedure is `cryo_lifecycle::thaw` (which reads the quarantine
//! itself); this file resolves `--gpu-map`, shows progress and reports (exit codes: 0 serving, 3 refused
//! before anything ran, 1 error).

use std::time::{Duration, Instant};

use anyhow::Context as _;
use cryo_criu::CriuRpc;
use cryo_lifecycle::{HealthCheck, StopOptions, ThawError, ThawOptions};

use super::Context;
use crate::args::ThawArgs;
use crate::exit::{self, UsageError};
use cryo_units::fmt_bytes;

/// Runs `cryo thaw`; returns the exit code.
pub fn run(ctx: &Context, args: &ThawArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    let requested = Instant::now();
    let health = match (&args.health_url, &args.health_cmd) {
        (Some(u), _) => Some(HealthCheck::Url(u.clone())),
        (None, Some(c)) => Some(HealthCheck::Cmd(c.clone())),
        (None, None) => None,
    };
    if let Some(h) = &health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    let criu = CriuRpc::locate(None)?;
    // A cheap first look at the image (the full verification, every checksum, runs in the thaw
    // itself): a directory that is no image is refused before the driver is looked for.
    let manifest = args.image.join(cryo_criu::image::MANIFEST_FILE);
    if let Err(e) = cryo_criu::image::read_manifest(&manifest) {
        return Ok(refused(&ThawError::Image(e), args.json));
    }
    let gpu = ctx.gpu()?;
    let gpu_map = match &args.gpu_map {
        None => Vec::new(),
        Some(m) => {
            let gpus = gpu.inspect.gpus().context("listing GPUs")?;
            m.resolve(&gpus)
                .map_err(|e| UsageError(format!("--gpu-map: {e}")))?
        }
    };
    let journal = ctx.state.open_journal().context("opening the journal")?;
    let opts = ThawOptions {
        gpu_map,
        health,
        health_timeout: Duration::from_secs(args.health_timeout),
        // Cleaning up after a failed thaw has no grace period to fit in: it takes what the
        // suspension needs (each driver call still has its own deadline).
        stop: StopOptions {
            deadline: None,
            ..StopOptions::default()
        },
        requested,
    };
    let progress = crate::progress::for_stderr();
    let result = cryo_lifecycle::thaw(
        &gpu,
        &criu,
        &args.image,
        &opts,
        &journal,
        &ctx.state.fence(),
        progress.as_ref(),
    );
    drop(progress);
    let report = match result {
        Ok(r) => r,
        Err(e @ (ThawError::Image(_) | ThawError::Precheck(_))) => {
            return Ok(refused(&e, args.json));
        }
        Err(e) => {
            return Err(anyhow::Error::new(e).context(format!("thawing {}", args.image.display())))
        }
    };
    if args.json {
        let mut v = serde_json::to_value(&report)?;
        v["outcome"] = "serving".into();
        println!("{v}");
    } else {
        let bytes: u64 = report.gpu.iter().map(|g| g.bytes).sum();
        println!(
            "thawed {} into pid {} ({} processes, {} CUDA, {} of device memory)",
            report.image.display(),
            report.root_pid,
            report.pids.len(),
            report.gpu.len(),
            fmt_bytes(bytes)
        );
        println!(
            "  verify {} ms, criu restore {} ms, GPU restore+unlock {} ms, total {} ms",
            report.verify_ms, report.criu_ms, report.gpu_restore_ms, report.elapsed_ms
        );
        if let Some(ms) = report.first_answer_ms {
            println!("  first answered health request {ms} ms after the thaw request");
        }
    }
    Ok(exit::SUCCESS)
}

/// Reports a thaw refused before anything ran; returns the exit code.
fn refused(e: &ThawError, json: bool) -> u8 {
    if json {
        println!(
            "{}",
            serde_json::json!({ "outcome": "refused", "error": e.to_string() })
        );
    }
    eprintln!("cryo: {e}; nothing was restored");
    exit::REFUSED
}
