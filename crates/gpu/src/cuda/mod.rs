//! The real CUDA driver's checkpoint API, with `libcuda.so.1` loaded at run time.
//!
//! # Design
//! - No link-time dependency: the library is `dlopen`ed by [`CudaDriver::load`], so cryo builds
//!   and runs where no driver is installed, and `--gpu cuda` there fails with one
//!   [`DriverError::Load`] line.
//! - `cuInit(0)` runs once per process: the default library and the result of `cuInit` are kept
//!   in a `OnceLock`, so a long-lived agent pays the driver's start-up once (17 ms with
//!   persistence mode, seconds without) and every later [`CudaDriver::load`] is free.
//! - The 64-byte args structs are laid out per driver version: the `gpuPairs` restore layout is
//!   used only when `cuDriverGetVersion >= 13000`; asking for GPU pairs on 12.8/12.9 is
//!   [`DriverError::TooOld`], never a struct the driver would misread.
//! - Every non-zero `CUresult` becomes [`DriverError::Cuda`] with the entry point, the pid and the
//!   code, whose `Display` is the driver's name (`CUDA_ERROR_NOT_READY`).
//! - Raw bindings live in `ffi` (the only `unsafe` of this crate); this module only decides.
//!
//! # Limitations
//! - The driver's own checkpoint semantics apply: one context per process and GPU; a context with
//!   a sticky error cannot be locked; the caller must hold a pidfd if the pid could be reused.
//! - Codes that [`CuResult::name`] does not know are named by `cuGetErrorName` only in logs
//!   ([`CudaDriver::error_name`]); the error itself prints `CUresult N`.

mod ffi;

use std::ffi::c_int;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use crate::nvml::NvmlInspector;
use crate::{
    BackendKind, CheckpointDriver, CuResult, DriverError, Gpu, GpuPair, Pid, ProcessState,
};

use ffi::{Api, CheckpointArgs, GpuPairRaw, LockArgs, RestoreArgs, UnlockArgs};

/// The driver library's SONAME, as the NVIDIA driver installs it.
pub const LIBCUDA: &str = "libcuda.so.1";

/// First `cuDriverGetVersion` with the checkpoint API (CUDA 12.8, driver r570).
pub const CHECKPOINT_API_VERSION: i32 = 12080;

/// First `cuDriverGetVersion` whose `CUcheckpointRestoreArgs` carries `gpuPairs`.
pub const GPU_PAIRS_VERSION: i32 = 13000;

/// What failed while loading, kept cloneable so the process-wide cache can hand it out again.
#[derive(Debug, Clone)]
enum LoadFailure {
    Load { library: String, reason: String },
    Init(CuResult),
}

impl From<LoadFailure> for DriverError {
    fn from(f: LoadFailure) -> Self {
        match f {
            LoadFailure::Load { library, reason } => DriverError::Load { library, reason },
            LoadFailure::Init(code) => DriverError::Init(code),
        }
    }
}

/// A loaded and initialised driver.
#[derive(Debug)]
struct Loaded {
    api: Api,
    version: i32,
    library: String,
}

static DEFAULT: OnceLock<Result<Arc<Loaded>, LoadFailure>> = OnceLock::new();

fn open(library: &str) -> Result<Arc<Loaded>, LoadFailure> {
    let api = Api::open(library).map_err(|reason| LoadFailure::Load {
        library: library.to_string(),
        reason,
    })?;
    let init = CuResult(api.init());
    if !init.is_success() {
        return Err(LoadFailure::Init(init));
    }
    let (r, version) = api.driver_version();
    let r = CuResult(r);
    if !r.is_success() {
        return Err(LoadFailure::Init(r));
    }
    tracing::debug!(library, version, "CUDA driver loaded");
    Ok(Arc::new(Loaded {
        api,
        version,
        library: library.to_string(),
    }))
}

/// The CUDA driver's process checkpoint API (`cuCheckpointProcess*`).
#[derive(Debug, Clone)]
pub struct CudaDriver {
    inner: Arc<Loaded>,
}

impl CudaDriver {
    /// Loads `libcuda.so.1` and runs `cuInit(0)`, once per process; later calls return the same
    /// driver (or the same failure).
    pub fn load() -> Result<CudaDriver, DriverError> {
        let loaded = DEFAULT.get_or_init(|| open(LIBCUDA)).clone()?;
        Ok(CudaDriver { inner: loaded })
    }

    /// Loads the driver from `path` (tests, unusual installs). Not cached: `cuInit` runs again,
    /// which the driver treats as a no-op once initialised.
    pub fn load_from(path: &str) -> Result<CudaDriver, DriverError> {
        Ok(CudaDriver { inner: open(path)? })
    }

    /// `cuDriverGetVersion`: 12080 for CUDA 12.8, 13000 for 13.0.
    pub fn api_version(&self) -> i32 {
        self.inner.version
    }

    /// The library path or name this driver was loaded from.
    pub fn library(&self) -> &str {
        &self.inner.library
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> Result<i32, DriverError> {
        let (r, n) = self.inner.api.device_count();
        let r = CuResult(r);
        if r.is_success() {
            Ok(n)
        } else {
            Err(DriverError::Init(r))
        }
    }

    /// The driver's own name for `code` (`cuGetErrorName`), falling back to [`CuResult::name`].
    pub fn error_name(&self, code: CuResult) -> Option<String> {
        self.inner
            .api
            .error_name(code.0)
            .or_else(|| code.name().map(str::to_string))
    }

    /// Turns a driver result into `Ok` or a [`DriverError::Cuda`]; `None` means the entry point is
    /// missing from this driver.
    fn check(&self, call: &'static str, pid: Pid, r: Option<u32>) -> Result<(), DriverError> {
        let code = CuResult(r.ok_or_else(|| self.missing(call))?);
        if code.is_success() {
            return Ok(());
        }
        if code.name().is_none() {
            // The error prints the number only; put the driver's own name in the log.
            tracing::warn!(call, pid, code = code.0, name = ?self.error_name(code), "unnamed CUresult");
        }
        Err(DriverError::Cuda { call, pid, code })
    }

    fn missing(&self, call: &'static str) -> DriverError {
        tracing::debug!(call, reason = ?self.inner.api.checkpoint_api_missing(), "no checkpoint API");
        DriverError::TooOld {
            what: call,
            needed: CHECKPOINT_API_VERSION,
            found: self.inner.version,
        }
    }
}

/// The driver's `timeoutMs` for a lock: 0 waits forever, so a zero or sub-millisecond `Some`
/// rounds up to 1 ms rather than silently meaning "no limit".
pub(crate) fn timeout_ms(timeout: Option<Duration>) -> u32 {
    match timeout {
        None => 0,
        Some(d) => {
            let ms = d.as_nanos().div_ceil(1_000_000).max(1);
            u32::try_from(ms).unwrap_or(u32::MAX)
        }
    }
}

/// The raw pairs for `cuCheckpointProcessRestore`, refused on drivers whose restore args have no
/// `gpuPairs` field. An empty list is valid on every version (zeroed args).
pub(crate) fn restore_pairs(
    api_version: i32,
    pairs: &[GpuPair],
) -> Result<Vec<GpuPairRaw>, DriverError> {
    if !pairs.is_empty() && api_version < GPU_PAIRS_VERSION {
        return Err(DriverError::TooOld {
            what: "restore onto other GPUs (CUcheckpointRestoreArgs.gpuPairs)",
            needed: GPU_PAIRS_VERSION,
            found: api_version,
        });
    }
    Ok(pairs
        .iter()
        .map(|p| GpuPairRaw {
            old_uuid: p.old.bytes(),
            new_uuid: p.new.bytes(),
        })
        .collect())
}

/// The process state from the driver's raw `CUprocessState`.
pub(crate) fn state_from_raw(pid: Pid, raw: c_int) -> Result<ProcessState, DriverError> {
    let raw = u32::try_from(raw).unwrap_or(u32::MAX);
    ProcessState::from_raw(raw).ok_or(DriverError::UnknownState { pid, raw })
}

impl CheckpointDriver for CudaDriver {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        const CALL: &str = "cuCheckpointProcessGetState";
        let (r, raw) = self
            .inner
            .api
            .get_state(pid)
            .ok_or_else(|| self.missing(CALL))?;
        self.check(CALL, pid, Some(r))?;
        state_from_raw(pid, raw)
    }

    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        let mut args = LockArgs {
            timeout_ms: timeout_ms(timeout),
            ..LockArgs::default()
        };
        self.check(
            "cuCheckpointProcessLock",
            pid,
            self.inner.api.lock(pid, &mut args),
        )
    }

    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        let mut args = CheckpointArgs::default();
        self.check(
            "cuCheckpointProcessCheckpoint",
            pid,
            self.inner.api.checkpoint(pid, &mut args),
        )
    }

    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        const CALL: &str = "cuCheckpointProcessRestore";
        let raw = restore_pairs(self.inner.version, pairs)?;
        let mut args = RestoreArgs::with_pairs(&raw).ok_or(DriverError::Cuda {
            call: CALL,
            pid,
            code: CuResult::INVALID_VALUE,
        })?;
        self.check(CALL, pid, self.inner.api.restore(pid, &mut args))
    }

    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        let mut args = UnlockArgs::default();
        self.check(
            "cuCheckpointProcessUnlock",
            pid,
            self.inner.api.unlock(pid, &mut args),
        )
    }

    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        const CALL: &str = "cuCheckpointProcessGetRestoreThreadId";
        let (r, tid) = self
            .inner
            .api
            .get_restore_tid(pid)
            .ok_or_else(|| self.missing(CALL))?;
        self.check(CALL, pid, Some(r))?;
        Ok(tid)
    }
}

/// The real backend: the CUDA driver plus NVML. Fails if either cannot be loaded.
pub fn backend() -> Result<Gpu, DriverError> {
    let driver = CudaDriver::load()?;
    let inspect = NvmlInspector::load().map_err(|e| DriverError::Load {
        library: crate::nvml::LIBNVML.to_string(),
        reason: e.to_string(),
    })?;
    Ok(Gpu {
        kind: BackendKind::Cuda,
        driver: Arc::new(driver),
        inspect: Arc::new(inspect),
    })
}

#[cfg(test)]
mod tests;
