//! The GPU driver as cryo sees it.
//!
//! # Design
//! Two narrow traits, one per concern, so that every layer above (stop, freeze, thaw, guard) is
//! written once and runs against the real driver or the simulated one:
//! - [`CheckpointDriver`]: the CUDA driver's process checkpoint API
//!   (`cuCheckpointProcess{GetState,Lock,Checkpoint,Restore,Unlock,GetRestoreThreadId}`).
//! - [`GpuInspector`]: what NVML shows (GPUs, per-pid device memory) plus which of a process's fds
//!   are driver files (what fd pinning must hold; recognised by `cryo_proc::DriverFiles`).
//!
//! Backends: [`cuda`] (libcuda loaded at run time), [`nvml`] (libnvidia-ml loaded at run time) and
//! the simulated GPU in the `cryo-sim` crate. Errors from the driver keep the driver's own name
//! (`CUDA_ERROR_NOT_READY`...) so an operator can search for them.
//!
//! # Limitations
//! One CUDA context per process and GPU, as the driver's checkpoint API itself assumes.

pub mod cuda;
pub mod deadline;
pub mod error;
pub mod nvml;
pub mod types;

pub use deadline::Limits;
pub use error::{CuResult, DriverError, InspectError};
pub use types::{GpuInfo, GpuPair, GpuProcess, GpuUuid, ProcessState};

use std::time::Duration;

use cryo_proc::Pid;

/// The CUDA driver's process checkpoint API. Every method acts on another process, identified by
/// pid, exactly as the driver does; callers that did not spawn the process must hold a pidfd
/// across the call to be sure the pid still names the same process.
pub trait CheckpointDriver: Send + Sync {
    /// `cuCheckpointProcessGetState`.
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError>;
    /// `cuCheckpointProcessLock`: blocks further CUDA calls of the process and waits for work in
    /// flight. `None` waits without limit (the driver's `timeoutMs = 0`). On timeout the driver
    /// answers `CUDA_ERROR_NOT_READY` and the process stays RUNNING.
    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError>;
    /// `cuCheckpointProcessCheckpoint`: moves device memory into the process's host memory and
    /// releases its GPU resources. Only from LOCKED.
    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError>;
    /// `cuCheckpointProcessRestore`: reacquires GPUs and uploads device memory; `pairs` moves
    /// contexts onto other GPUs (by UUID). Leaves the process LOCKED.
    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError>;
    /// `cuCheckpointProcessUnlock`: lets the process make CUDA calls again.
    fn unlock(&self, pid: Pid) -> Result<(), DriverError>;
    /// `cuCheckpointProcessGetRestoreThreadId`: the driver's thread inside the process.
    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError>;

    /// The deadline layer this is, if it is one ([`Gpu::bounded`] flattens layers with it);
    /// no backend overrides it.
    #[doc(hidden)]
    fn as_bounded(&self) -> Option<&deadline::Bounded> {
        None
    }
}

/// NVML-style inspection of GPUs and of the processes using them.
pub trait GpuInspector: Send + Sync {
    /// Every GPU, in index order.
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError>;
    /// Every process that holds device memory, one entry per (pid, GPU). NVML reports host pids.
    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError>;
    /// The driver's version string (for image manifests and thaw prechecks).
    fn driver_version(&self) -> Result<String, InspectError>;
    /// The fd numbers in `pid`'s fd table that are driver files (`/dev/nvidia*` for the real
    /// driver): what must be duplicated to keep the process's context from being torn down.
    fn driver_fds(&self, pid: Pid) -> Result<Vec<i32>, InspectError>;

    /// Every process that may hold a context: those NVML lists and those holding driver files
    /// (the guard's scan), ascending, once each. The default knows NVML's list only.
    fn cuda_processes(&self) -> Result<Vec<Pid>, InspectError> {
        let mut pids: Vec<Pid> = self.processes()?.into_iter().map(|p| p.pid).collect();
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// Device memory attributed to `pid` over all GPUs, `None` when NVML does not list it.
    fn process_memory(&self, pid: Pid) -> Result<Option<u64>, InspectError> {
        let mut total = None;
        for p in self.processes()?.into_iter().filter(|p| p.pid == pid) {
            *total.get_or_insert(0) += p.used_memory;
        }
        Ok(total)
    }
}

/// Which implementation stands behind the traits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    /// The real driver: libcuda + NVML.
    Cuda,
    /// The simulated GPU of `cryo-sim`.
    Sim,
}

impl std::fmt::Display for BackendKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            BackendKind::Cuda => "cuda",
            BackendKind::Sim => "sim",
        })
    }
}

/// One backend: the checkpoint API and the inspection API of the same GPUs.
#[derive(Clone)]
pub struct Gpu {
    /// Which backend this is.
    pub kind: BackendKind,
    /// The checkpoint API.
    pub driver: std::sync::Arc<dyn CheckpointDriver>,
    /// The inspection API.
    pub inspect: std::sync::Arc<dyn GpuInspector>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}
