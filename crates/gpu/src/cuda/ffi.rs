//! Raw bindings to `libcuda.so.1`: the C layouts of the checkpoint API and one safe method per
//! driver entry point. Nothing here interprets a result; [`super`] does.
//!
//! Layouts follow CUDA 13.0's `cuda.h`. Every args struct is 64 bytes and must be zero where the
//! header says "reserved"; the tests in [`super`] pin sizes and offsets.

use std::ffi::{c_char, c_int, c_uint, CStr};
use std::marker::PhantomData;

use libloading::Library;

/// `CUresult` (a C enum: int-sized, values are non-negative).
pub(crate) type CuResultRaw = c_uint;

/// `CUcheckpointLockArgs`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct LockArgs {
    /// `timeoutMs`: 0 waits without limit.
    pub timeout_ms: c_uint,
    pub reserved0: c_uint,
    pub reserved1: [u64; 7],
}

/// `CUcheckpointCheckpointArgs`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct CheckpointArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointUnlockArgs`.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct UnlockArgs {
    pub reserved: [u64; 8],
}

/// `CUcheckpointGpuPair`: two `CUuuid`s.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuPairRaw {
    pub old_uuid: [u8; 16],
    pub new_uuid: [u8; 16],
}

/// `CUcheckpointRestoreArgs` as CUDA 13.0 lays it out. On 12.8/12.9 the first 16 bytes are
/// reserved words, so the same struct, left zeroed, is the 12.x layout.
#[repr(C)]
#[derive(Debug)]
pub(crate) struct RestoreArgs<'a> {
    /// `gpuPairs` (13.0+).
    pub gpu_pairs: *const GpuPairRaw,
    /// `gpuPairsCount` (13.0+).
    pub gpu_pairs_count: c_uint,
    pub reserved: [u8; 44],
    pub reserved1: u64,
    /// The pairs must outlive the call that reads `gpu_pairs`.
    pub _pairs: PhantomData<&'a [GpuPairRaw]>,
}

impl Default for RestoreArgs<'_> {
    fn default() -> Self {
        RestoreArgs {
            gpu_pairs: std::ptr::null(),
            gpu_pairs_count: 0,
            reserved: [0; 44],
            reserved1: 0,
            _pairs: PhantomData,
        }
    }
}

impl<'a> RestoreArgs<'a> {
    /// The 13.0 layout pointing at `pairs`.
    pub fn with_pairs(pairs: &'a [GpuPairRaw]) -> Option<Self> {
        Some(RestoreArgs {
            gpu_pairs: if pairs.is_empty() {
                std::ptr::null()
            } else {
                pairs.as_ptr()
            },
            gpu_pairs_count: c_uint::try_from(pairs.len()).ok()?,
            ..RestoreArgs::default()
        })
    }
}

type InitFn = unsafe extern "C" fn(c_uint) -> CuResultRaw;
type IntOutFn = unsafe extern "C" fn(*mut c_int) -> CuResultRaw;
type ErrorNameFn = unsafe extern "C" fn(CuResultRaw, *mut *const c_char) -> CuResultRaw;
type LockFn = unsafe extern "C" fn(c_int, *mut LockArgs) -> CuResultRaw;
type CheckpointFn = unsafe extern "C" fn(c_int, *mut CheckpointArgs) -> CuResultRaw;
type RestoreFn = unsafe extern "C" fn(c_int, *mut RestoreArgs<'_>) -> CuResultRaw;
type UnlockFn = unsafe extern "C" fn(c_int, *mut UnlockArgs) -> CuResultRaw;
type PidIntOutFn = unsafe extern "C" fn(c_int, *mut c_int) -> CuResultRaw;

/// The checkpoint entry points (CUDA 12.8+); absent from older drivers.
#[derive(Debug, Clone, Copy)]
struct CheckpointFns {
    lock: LockFn,
    checkpoint: CheckpointFn,
    restore: RestoreFn,
    unlock: UnlockFn,
    get_state: PidIntOutFn,
    get_restore_tid: PidIntOutFn,
}

/// An open `libcuda` with its entry points resolved. The function pointers stay valid because
/// the `Library` is owned alongside them and never unloaded before them.
#[derive(Debug)]
pub(crate) struct Api {
    init: InitFn,
    driver_get_version: IntOutFn,
    device_get_count: IntOutFn,
    get_error_name: ErrorNameFn,
    ckpt: Option<CheckpointFns>,
    /// Which checkpoint symbol was missing, when `ckpt` is `None`.
    missing: Option<String>,
    _lib: Library,
}

/// Resolves `name` in `lib` as a `T` function pointer.
fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
    // SAFETY: every caller pairs `name` with the C prototype `T` declared in `cuda.h`.
    let s = unsafe { lib.get::<T>(name.as_bytes()) };
    s.map(|s| *s)
        .map_err(|e| format!("missing symbol {name}: {e}"))
}

impl Api {
    /// dlopens `path` and resolves the entry points. Does not call `cuInit`.
    pub fn open(path: &str) -> Result<Api, String> {
        // SAFETY: libcuda's ELF initialisers only set up driver-private state; loading it has
        // no preconditions on our side (we hold no locks that its init could take).
        let lib = unsafe { Library::new(path) }.map_err(|e| e.to_string())?;
        let init = sym::<InitFn>(&lib, "cuInit")?;
        let driver_get_version = sym::<IntOutFn>(&lib, "cuDriverGetVersion")?;
        let device_get_count = sym::<IntOutFn>(&lib, "cuDeviceGetCount")?;
        let get_error_name = sym::<ErrorNameFn>(&lib, "cuGetErrorName")?;
        let ckpt = (|| {
            Ok::<_, String>(CheckpointFns {
                lock: sym(&lib, "cuCheckpointProcessLock")?,
                checkpoint: sym(&lib, "cuCheckpointProcessCheckpoint")?,
                restore: sym(&lib, "cuCheckpointProcessRestore")?,
                unlock: sym(&lib, "cuCheckpointProcessUnlock")?,
                get_state: sym(&lib, "cuCheckpointProcessGetState")?,
                get_restore_tid: sym(&lib, "cuCheckpointProcessGetRestoreThreadId")?,
            })
        })();
        let (ckpt, missing) = match ckpt {
            Ok(f) => (Some(f), None),
            Err(e) => (None, Some(e)),
        };
        Ok(Api {
            init,
            driver_get_version,
            device_get_count,
            get_error_name,
            ckpt,
            missing,
            _lib: lib,
        })
    }

    /// Why the checkpoint API is unavailable, if it is.
    pub fn checkpoint_api_missing(&self) -> Option<&str> {
        self.missing.as_deref()
    }

    /// `cuInit(0)`.
    pub fn init(&self) -> CuResultRaw {
        // SAFETY: `cuInit(unsigned int)`; flags must be 0, which they are.
        unsafe { (self.init)(0) }
    }

    /// `cuDriverGetVersion`.
    pub fn driver_version(&self) -> (CuResultRaw, c_int) {
        let mut v: c_int = 0;
        // SAFETY: `v` is a valid, writable int for the duration of the call.
        let r = unsafe { (self.driver_get_version)(&mut v) };
        (r, v)
    }

    /// `cuDeviceGetCount`.
    pub fn device_count(&self) -> (CuResultRaw, c_int) {
        let mut n: c_int = 0;
        // SAFETY: `n` is a valid, writable int for the duration of the call.
        let r = unsafe { (self.device_get_count)(&mut n) };
        (r, n)
    }

    /// `cuGetErrorName`, copied out of the driver's static string table.
    pub fn error_name(&self, code: CuResultRaw) -> Option<String> {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: `p` is a valid out-pointer; the driver stores a pointer to a static string
        // or leaves it null for codes it does not know.
        let r = unsafe { (self.get_error_name)(code, &mut p) };
        if r != 0 || p.is_null() {
            return None;
        }
        // SAFETY: non-null `p` points to a NUL-terminated string that lives as long as the
        // library, which `self` keeps loaded.
        let s = unsafe { CStr::from_ptr(p) };
        Some(s.to_string_lossy().into_owned())
    }

    fn fns(&self) -> Option<&CheckpointFns> {
        self.ckpt.as_ref()
    }

    /// `cuCheckpointProcessLock`; `None` when the driver lacks the checkpoint API.
    pub fn lock(&self, pid: c_int, args: &mut LockArgs) -> Option<CuResultRaw> {
        let f = self.fns()?.lock;
        // SAFETY: `args` is a live, 64-byte `CUcheckpointLockArgs` with reserved words zeroed.
        Some(unsafe { f(pid, args) })
    }

    /// `cuCheckpointProcessCheckpoint`.
    pub fn checkpoint(&self, pid: c_int, args: &mut CheckpointArgs) -> Option<CuResultRaw> {
        let f = self.fns()?.checkpoint;
        // SAFETY: `args` is a live, zeroed 64-byte `CUcheckpointCheckpointArgs`.
        Some(unsafe { f(pid, args) })
    }

    /// `cuCheckpointProcessRestore`.
    pub fn restore(&self, pid: c_int, args: &mut RestoreArgs<'_>) -> Option<CuResultRaw> {
        let f = self.fns()?.restore;
        // SAFETY: `args` is a live 64-byte `CUcheckpointRestoreArgs`; `gpu_pairs` is null or
        // points at `gpu_pairs_count` pairs borrowed for `args`' lifetime (its PhantomData).
        Some(unsafe { f(pid, args) })
    }

    /// `cuCheckpointProcessUnlock`.
    pub fn unlock(&self, pid: c_int, args: &mut UnlockArgs) -> Option<CuResultRaw> {
        let f = self.fns()?.unlock;
        // SAFETY: `args` is a live, zeroed 64-byte `CUcheckpointUnlockArgs`.
        Some(unsafe { f(pid, args) })
    }

    /// `cuCheckpointProcessGetState`: the raw `CUprocessState`.
    pub fn get_state(&self, pid: c_int) -> Option<(CuResultRaw, c_int)> {
        let f = self.fns()?.get_state;
        let mut s: c_int = -1;
        // SAFETY: `CUprocessState` is an int-sized C enum; `s` is a valid out-pointer.
        let r = unsafe { f(pid, &mut s) };
        Some((r, s))
    }

    /// `cuCheckpointProcessGetRestoreThreadId`.
    pub fn get_restore_tid(&self, pid: c_int) -> Option<(CuResultRaw, c_int)> {
        let f = self.fns()?.get_restore_tid;
        let mut t: c_int = 0;
        // SAFETY: `t` is a valid, writable int for the duration of the call.
        let r = unsafe { f(pid, &mut t) };
        Some((r, t))
    }
}
