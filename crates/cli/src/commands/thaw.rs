//! `cryo thaw`: the handler. The procedure is `cryo_lifecycle::thaw` (which reads the quarantine
//! itself); this file resolves `--gpu-map`, shows progress and reports (exit codes: 0 serving, 3 refused
//! before anything ran, 1 error).

use std::time::Instant;

use anyhow::Context as _;
use cryo_api::{HealthSpec, ThawRequest};
use cryo_criu::CriuRpc;
use cryo_lifecycle::{ThawError, ThawReport};

use super::Context;
use crate::args::ThawArgs;
use crate::exit::{self, UsageError};
use crate::route::{self, Outcome};
use cryo_units::fmt_bytes;

/// Runs `cryo thaw`; returns the exit code.
pub fn run(ctx: &Context, args: &ThawArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    let requested = Instant::now();
    let health = match (&args.health_url, &args.health_cmd) {
        (Some(u), _) => Some(HealthSpec::Url(u.clone())),
        (None, Some(c)) => Some(HealthSpec::Cmd(c.clone())),
        (None, None) => None,
    };
    let mut req = ThawRequest {
        image: args.image.clone(),
        gpu_map: Vec::new(),
        health,
        health_timeout_s: args.health_timeout,
        shrunk: args.shrink.grow()?,
        criu_timeout_s: args.criu_timeout,
    };
    if let Some(h) = &req.options(requested).health {
        h.validate().map_err(|e| UsageError(e.to_string()))?;
    }
    if let Some(pid) = args.gpus_of {
        req.gpu_map = gpus_of(ctx, &args.image, pid, &req.options(requested))?;
    }
    if let Some(m) = &args.gpu_map {
        // Indices name this host's GPUs as its driver numbers them: resolved here, once.
        let gpus = ctx.gpu()?.inspect.gpus().context("listing GPUs")?;
        req.gpu_map = m
            .resolve(&gpus)
            .map_err(|e| UsageError(format!("--gpu-map: {e}")))?;
    }
    let result = route::through_agent(
        &ctx.state,
        |client, p| client.thaw(&req, p),
        route::outcome,
        |client, p| standalone(ctx, client, &req, requested, p),
    );
    let report = match result {
        Ok(r) => r,
        Err(Outcome::Refused(e)) => {
            return Ok(route::refused(
                &e,
                &format!("{e}; nothing was restored"),
                args.json,
            ))
        }
        Err(Outcome::Failed(e)) => {
            return Err(e.context(format!("thawing {}", args.image.display())))
        }
    };
    if !report.unrecorded.is_empty() {
        // The worker serves: said, never a failure (its caller would retry a running image).
        eprintln!(
            "cryo: warning: the worker serves, but the journal could not record {}",
            report.unrecorded.join("; ")
        );
    }
    if args.json {
        route::print_outcome(&report, "serving")?;
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
        if !report.extras.is_empty() {
            println!(
                "  {} of them restored beside the image's processes (its manifest does not name them): pids {}",
                report.extras.len(),
                report
                    .extras
                    .iter()
                    .map(|p| p.to_string())
                    .collect::<Vec<_>>()
                    .join(",")
            );
        }
        if let Some(ms) = report.first_answer_ms {
            println!("  first answered health request {ms} ms after the thaw request");
        }
        if let Some(s) = &report.shrink {
            println!("  {}", s.summary());
        }
    }
    Ok(exit::SUCCESS)
}

/// The thaw in this process (no agent runs): what the agent's handler does too.
fn standalone(
    ctx: &Context,
    client: &cryo_api::AgentClient,
    req: &ThawRequest,
    requested: Instant,
    progress: &dyn cryo_lifecycle::Progress,
) -> Result<ThawReport, Outcome> {
    let failed = Outcome::Failed;
    let criu = CriuRpc::locate_in(None, &ctx.state.criu_dir()).map_err(|e| failed(e.into()))?;
    let opts = req.options(requested);
    // The image opened once, under the restore's deadline (a file system that does not answer
    // is refused there), in a process of its own (this one can then exit at the deadline), and
    // passed on: a directory that is no image is refused before the driver is looked for; every
    // checksum is checked in the thaw itself.
    let opened = cryo_lifecycle::open_image_apart(&req.image, &opts)
        .map_err(|e| Outcome::Refused(e.to_string()))?;
    route::standalone_note(client);
    let gpu = ctx.gpu().map_err(failed)?;
    let journal = ctx
        .state
        .open_journal()
        .context("opening the journal")
        .map_err(failed)?;
    match cryo_lifecycle::thaw_opened(
        &gpu,
        &criu,
        opened,
        &opts,
        &journal,
        &ctx.state.fence(),
        &cryo_guard::control::GuardClient::new(&ctx.state),
        progress,
    ) {
        Ok(r) => {
            if !r.guarded {
                super::say_unguarded();
            }
            Ok(r)
        }
        Err(e @ (ThawError::Image(_) | ThawError::Precheck(_))) => {
            Err(Outcome::Refused(e.to_string()))
        }
        Err(e) => Err(failed(e.into())),
    }
}

/// Reports a thaw refused before anything ran; returns the exit code.
/// `--gpus-of PID`: the image's GPUs onto those PID's container was given, by UUID
/// (NVIDIA/cuda-checkpoint#54: restores bound to the GPU index break under Kubernetes' device
/// assignment). Refused (usage) before anything runs when the container was given GPUs by index,
/// none, or fewer than the image used. The image is looked at under the thaw's deadline, in a
/// process of its own ([`cryo_lifecycle::open_image_apart`]).
fn gpus_of(
    ctx: &Context,
    image: &std::path::Path,
    pid: cryo_proc::Pid,
    opts: &cryo_lifecycle::ThawOptions,
) -> anyhow::Result<Vec<cryo_gpu::GpuPair>> {
    let h = cryo_proc::ProcHandle::open(pid).with_context(|| format!("--gpus-of {pid}"))?;
    let assigned = cryo_kube::gpus::assigned_to(&h)
        .map_err(|e| UsageError(format!("--gpus-of {pid}: {e}")))?;
    let img = cryo_lifecycle::open_image_apart(image, opts)
        .with_context(|| format!("reading the image {}", image.display()))?;
    let image_gpus: Vec<_> = img.manifest().gpu_uuids().into_iter().collect();
    let node: Vec<_> = ctx
        .gpu()?
        .inspect
        .gpus()
        .context("listing GPUs")?
        .into_iter()
        .map(|g| g.uuid)
        .collect();
    cryo_kube::gpu_map(&image_gpus, &assigned, &node)
        .map_err(|e| UsageError(format!("--gpus-of {pid}: {e}")).into())
}
