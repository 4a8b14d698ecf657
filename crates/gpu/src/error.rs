//! Errors of the driver layer. A driver error keeps the driver's own `CUresult` name.

use std::fmt;

use cryo_proc::Pid;

/// A `CUresult` returned by the CUDA driver (or by the simulated one, which uses the same codes).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(transparent)]
pub struct CuResult(pub u32);

impl CuResult {
    /// `CUDA_SUCCESS`.
    pub const SUCCESS: CuResult = CuResult(0);
    /// Bad argument, or a pid the driver cannot find.
    pub const INVALID_VALUE: CuResult = CuResult(1);
    /// Allocation failed (a restore without enough free device memory).
    pub const OUT_OF_MEMORY: CuResult = CuResult(2);
    /// The driver, or the target process, has no CUDA state.
    pub const NOT_INITIALIZED: CuResult = CuResult(3);
    /// No device.
    pub const NO_DEVICE: CuResult = CuResult(100);
    /// Lock timed out with work in flight.
    pub const NOT_READY: CuResult = CuResult(600);
    /// Sticky error: a kernel faulted; the context is unusable.
    pub const ILLEGAL_ADDRESS: CuResult = CuResult(700);
    /// An operating-system call failed (what a restore after a failed restore returns).
    pub const OPERATING_SYSTEM: CuResult = CuResult(304);
    /// The operation is not valid in the process's current state.
    pub const ILLEGAL_STATE: CuResult = CuResult(401);
    /// Not supported by this driver or device.
    pub const NOT_SUPPORTED: CuResult = CuResult(801);
    /// The driver could not find what was asked for.
    pub const NOT_FOUND: CuResult = CuResult(500);
    /// Unknown error.
    pub const UNKNOWN: CuResult = CuResult(999);

    /// The driver's name for the code (`CUDA_ERROR_NOT_READY`), as `cuGetErrorName` gives it.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "CUDA_SUCCESS",
            1 => "CUDA_ERROR_INVALID_VALUE",
            2 => "CUDA_ERROR_OUT_OF_MEMORY",
            3 => "CUDA_ERROR_NOT_INITIALIZED",
            4 => "CUDA_ERROR_DEINITIALIZED",
            34 => "CUDA_ERROR_STUB_LIBRARY",
            46 => "CUDA_ERROR_DEVICE_UNAVAILABLE",
            100 => "CUDA_ERROR_NO_DEVICE",
            101 => "CUDA_ERROR_INVALID_DEVICE",
            201 => "CUDA_ERROR_INVALID_CONTEXT",
            304 => "CUDA_ERROR_OPERATING_SYSTEM",
            400 => "CUDA_ERROR_INVALID_HANDLE",
            401 => "CUDA_ERROR_ILLEGAL_STATE",
            500 => "CUDA_ERROR_NOT_FOUND",
            600 => "CUDA_ERROR_NOT_READY",
            700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
            709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
            710 => "CUDA_ERROR_ASSERT",
            714 => "CUDA_ERROR_HARDWARE_STACK_ERROR",
            715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
            716 => "CUDA_ERROR_MISALIGNED_ADDRESS",
            719 => "CUDA_ERROR_LAUNCH_FAILED",
            800 => "CUDA_ERROR_NOT_PERMITTED",
            801 => "CUDA_ERROR_NOT_SUPPORTED",
            802 => "CUDA_ERROR_SYSTEM_NOT_READY",
            803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
            999 => "CUDA_ERROR_UNKNOWN",
            _ => return None,
        })
    }

    /// The driver's description, as `cuGetErrorString` gives it (what `cuda-checkpoint` prints).
    pub fn description(self) -> &'static str {
        match self.0 {
            0 => "no error",
            1 => "invalid argument",
            2 => "out of memory",
            3 => "initialization error",
            100 => "no CUDA-capable device is detected",
            304 => "OS call failed or operation not supported on this OS",
            401 => "the operation is not permitted in the current state",
            500 => "named symbol not found",
            600 => "device not ready",
            700 => "an illegal memory access was encountered",
            801 => "operation not supported",
            _ => "unknown error",
        }
    }

    /// Whether this is `CUDA_SUCCESS`.
    pub fn is_success(self) -> bool {
        self.0 == 0
    }

    /// Whether the error is sticky: the context is corrupt and cannot be locked or checkpointed.
    pub fn is_sticky(self) -> bool {
        matches!(self.0, 700 | 710 | 714 | 715 | 716 | 719)
    }
}

impl fmt::Display for CuResult {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "CUresult {}", self.0),
        }
    }
}

/// The checkpoint API failed.
#[derive(Debug, thiserror::Error)]
pub enum DriverError {
    /// The driver call returned an error code.
    #[error("{call} on pid {pid} failed: {code} ({})", code.description())]
    Cuda {
        /// Entry point (`cuCheckpointProcessLock`).
        call: &'static str,
        /// Target process.
        pid: Pid,
        /// What the driver returned.
        code: CuResult,
    },
    /// The driver library could not be loaded or lacks an entry point.
    #[error("cannot load the CUDA driver ({library}): {reason}")]
    Load {
        /// Library name or path.
        library: String,
        /// Why (dlopen's message, missing symbol, ...).
        reason: String,
    },
    /// `cuInit` failed: no usable GPU or driver.
    #[error("cuInit failed: {0} ({desc})", desc = .0.description())]
    Init(CuResult),
    /// The driver is too old for what was asked.
    #[error("{what} needs CUDA driver API {needed} or newer; this driver is {found}")]
    TooOld {
        /// The feature.
        what: &'static str,
        /// Minimum `cuDriverGetVersion` value.
        needed: i32,
        /// This driver's value.
        found: i32,
    },
    /// The driver reported a process state this build does not know.
    #[error("pid {pid}: the driver reports unknown process state {raw}")]
    UnknownState {
        /// Target process.
        pid: Pid,
        /// Raw `CUprocessState`.
        raw: u32,
    },
    /// The simulated driver could not be reached or answered nonsense.
    #[error("simulated GPU driver at {endpoint}: {reason}")]
    Sim {
        /// Its control socket.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
    /// The call did not return in time; it was abandoned and may still take effect later.
    #[error("{call} on pid {pid} did not return within {} ms (abandoned; the driver may still carry it out)", .after.as_millis())]
    NoAnswer {
        /// Entry point.
        call: &'static str,
        /// Target process.
        pid: Pid,
        /// How long the caller waited.
        after: std::time::Duration,
    },
    /// Earlier calls never returned: this one was not made.
    #[error("{call} on pid {pid} was not made: {pending} earlier driver calls have not returned")]
    Unresponsive {
        /// Entry point.
        call: &'static str,
        /// Target process.
        pid: Pid,
        /// Calls still blocked in the driver.
        pending: usize,
    },
    /// The node agent, which makes the driver calls when it runs, failed otherwise than by a
    /// driver error (unreachable mid-call, refused the caller, its driver could not be loaded).
    #[error("through the node agent: {reason}")]
    Remote {
        /// What went wrong.
        reason: String,
    },
}

impl DriverError {
    /// Whether the driver gave no answer (the call's effect is unknown).
    pub fn is_no_answer(&self) -> bool {
        matches!(
            self,
            DriverError::NoAnswer { .. } | DriverError::Unresponsive { .. }
        )
    }

    /// The driver's code, when the driver answered with one.
    pub fn code(&self) -> Option<CuResult> {
        match self {
            DriverError::Cuda { code, .. } | DriverError::Init(code) => Some(*code),
            _ => None,
        }
    }
}

/// Inspection (NVML-style) failed.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// An NVML call failed (or NVML could not be loaded or initialised).
    #[error("cannot use NVML ({what}): {source}")]
    Nvml {
        /// What was asked (`loading libnvidia-ml.so.1`, `GPU 0 memory`).
        what: String,
        /// NVML's error.
        source: nvml_wrapper::error::NvmlError,
    },
    /// NVML named a GPU by something that is not a UUID.
    #[error("NVML: GPU {index}: {source}")]
    BadUuid {
        /// The GPU's index.
        index: u32,
        /// What was wrong.
        source: crate::types::BadUuid,
    },
    /// NVML listed a pid outside the kernel's range.
    #[error("NVML: GPU {index} lists pid {pid}, which is not a pid")]
    BadPid {
        /// The GPU's index.
        index: u32,
        /// What NVML said.
        pid: u32,
    },
    /// A process's fd table could not be read.
    #[error("cannot read the fd table of pid {pid}: {source}")]
    Fds {
        /// Target process.
        pid: Pid,
        /// Why.
        source: cryo_proc::ProcError,
    },
    /// The simulated driver could not be reached or answered nonsense.
    #[error("simulated GPU driver at {endpoint}: {reason}")]
    Sim {
        /// Its control socket.
        endpoint: String,
        /// What went wrong.
        reason: String,
    },
    /// cryo runs in a pid namespace other than the host's: the driver's pids cannot be matched.
    #[error("NVML names processes by the host's pids and cryo runs in another pid namespace (inode {namespace}), where they cannot be matched; run cryo in the host's pid namespace (hostPID: true)")]
    ForeignPidNamespace {
        /// The inode of cryo's pid namespace.
        namespace: u64,
    },
    /// The query did not return in time.
    #[error("NVML query ({what}) did not return within {} ms", .after.as_millis())]
    NoAnswer {
        /// What was asked.
        what: &'static str,
        /// How long the caller waited.
        after: std::time::Duration,
    },
}
