//! Which GPU backend a command runs against.
//!
//! # Design
//! `--gpu auto|cuda|sim` (env `CRYO_GPU`). `auto` takes the real driver when `libcuda.so.1`
//! loads, `cuInit` succeeds and at least one device is present (then NVML must load too: a host
//! with a GPU but no NVML is an error, never a silent switch to the simulated GPU); otherwise it
//! takes the simulated GPU at `--sim-dir`. The choice is resolved only by commands that need a
//! GPU, after their arguments are validated. What `auto` chose, and why, is said once on stderr
//! (except by the `cuda-checkpoint` front end, whose output CRIU parses); a backend the user
//! named is used without a word.
//!
//! # Limitations
//! `auto` cannot tell "no driver" from "a broken driver": both fall back to the simulated GPU,
//! and the reason is in the announcement line.

use std::path::{Path, PathBuf};

use cryo_gpu::cuda::CudaDriver;
use cryo_gpu::{DriverError, Gpu};

/// `--gpu`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum GpuChoice {
    /// The real driver when present, else the simulated GPU.
    Auto,
    /// The real driver (libcuda + NVML), or fail.
    Cuda,
    /// The simulated GPU (`cryo sim driver`).
    Sim,
}

/// No backend could be had.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// `--gpu cuda` (or `auto` on a host with a GPU) and the real driver is unusable.
    #[error("--gpu {choice}: no usable CUDA driver: {source}")]
    Cuda {
        /// What was asked (`cuda` or `auto`).
        choice: &'static str,
        /// Why.
        source: DriverError,
    },
    /// The simulated GPU's daemon cannot be reached.
    #[error("{why}: {source}")]
    Sim {
        /// Its directory.
        dir: PathBuf,
        /// Why the simulated GPU was wanted (`--gpu sim`, or auto's reason).
        why: String,
        /// Why.
        source: cryo_sim::SimClientError,
    },
}

/// A backend and, when `auto` chose it, the line that says which and why.
#[derive(Debug)]
pub struct Resolved {
    /// The backend.
    pub gpu: Gpu,
    /// `--gpu auto: using the real CUDA driver (API 13000, 1 GPUs)` or `--gpu auto: using the
    /// simulated GPU at DIR (no real GPU: ...)`; `None` when the user named the backend.
    pub note: Option<String>,
}

/// Resolves `choice` against the system. Every call of the backend is bounded by the default
/// [`cryo_gpu::Limits`]: a driver call that does not return is an error, never a hung command.
pub fn resolve(choice: GpuChoice, sim_dir: &Path) -> Result<Resolved, BackendError> {
    resolve_unbounded(choice, sim_dir).map(|r| Resolved {
        gpu: r.gpu.bounded(cryo_gpu::Limits::default()),
        note: r.note,
    })
}

fn resolve_unbounded(choice: GpuChoice, sim_dir: &Path) -> Result<Resolved, BackendError> {
    match choice {
        GpuChoice::Cuda => real("cuda").map(|(gpu, _)| Resolved { gpu, note: None }),
        GpuChoice::Sim => Ok(Resolved {
            gpu: sim(sim_dir, "--gpu sim".to_string())?,
            note: None,
        }),
        GpuChoice::Auto => match probe() {
            Ok(()) => real("auto").map(|(gpu, what)| Resolved {
                gpu,
                note: Some(format!("--gpu auto: using {what}")),
            }),
            Err(why) => Ok(Resolved {
                gpu: sim(sim_dir, format!("--gpu auto: no real GPU ({why})"))?,
                note: Some(format!(
                    "--gpu auto: using the simulated GPU at {} (no real GPU: {why})",
                    sim_dir.display()
                )),
            }),
        },
    }
}

/// Whether the real driver is usable and sees a GPU; the reason when not.
fn probe() -> Result<(), String> {
    let driver = CudaDriver::load().map_err(|e| e.to_string())?;
    match driver.device_count() {
        Ok(n) if n > 0 => Ok(()),
        Ok(_) => Err("the CUDA driver sees no GPU".to_string()),
        Err(e) => Err(e.to_string()),
    }
}

/// The real backend, and what it is in words.
fn real(choice: &'static str) -> Result<(Gpu, String), BackendError> {
    let gpu = cryo_gpu::cuda::backend().map_err(|source| BackendError::Cuda { choice, source })?;
    let (version, count) = match CudaDriver::load() {
        Ok(d) => (d.api_version(), d.device_count().unwrap_or(0)),
        Err(_) => (0, 0),
    };
    Ok((
        gpu,
        format!("the real CUDA driver (API {version}, {count} GPUs)"),
    ))
}

fn sim(dir: &Path, why: String) -> Result<Gpu, BackendError> {
    cryo_sim::connect(dir).map_err(|source| BackendError::Sim {
        dir: dir.to_path_buf(),
        why,
        source,
    })
}
