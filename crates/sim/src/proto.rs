//! The wire protocol between the daemon, its clients, and the workers' restore threads.
//!
//! Every message is a 4-byte little-endian length and that many bytes of JSON. Bulk device memory
//! (checkpoint download, restore upload) follows its header as raw bytes on the same stream.

use std::io::{self, Read, Write};
use std::time::Duration;

use cryo_gpu::{CuResult, GpuInfo, GpuPair, GpuProcess, GpuUuid, ProcessState};
use cryo_proc::Pid;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// How long the daemon waits for a worker's restore thread to answer a call other than lock,
/// checkpoint and restore before giving up on it (its threads may be stopped).
pub const WORKER_CALL_GRACE: Duration = Duration::from_secs(30);

/// How long past a lock's own timeout the daemon waits for the restore thread.
pub const LOCK_GRACE: Duration = Duration::from_secs(2);

/// Largest JSON message accepted (bulk data does not count).
const MAX_MESSAGE: u32 = 16 << 20;

/// The first (and, except for contexts, only) request on a connection to `driver.sock`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Request {
    /// Is the daemon there, and which one is it.
    Hello,
    /// Open a context: the connection becomes the context fd.
    OpenContext(OpenContext),
    /// A checkpoint-API call on a process, carried out by its restore thread.
    Call {
        /// Target process.
        pid: Pid,
        /// Which call.
        call: ApiCall,
    },
    /// NVML: the GPUs.
    Gpus,
    /// NVML: processes with live contexts.
    Processes,
    /// Which of `pid`'s fds are context fds.
    DriverFds {
        /// Target process.
        pid: Pid,
    },
    /// Fault injection.
    Inject {
        /// Target process.
        pid: Pid,
        /// What to inject.
        fault: Fault,
    },
}

/// A context being opened by a worker.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct OpenContext {
    /// Which GPU.
    pub gpu: GpuSel,
    /// Device memory to allocate.
    pub bytes: u64,
    /// How to initialise it.
    pub init: Init,
    /// Inode of the worker's end of this socket (what `/proc/PID/fd` shows as `socket:[N]`).
    pub inode: u64,
}

/// A GPU named by index or UUID.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuSel {
    /// NVML index.
    Index(u32),
    /// UUID.
    Uuid(GpuUuid),
}

/// How a new context's memory is initialised.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Init {
    /// A fresh context: the "model weights" come from this seed.
    Seed(u64),
    /// A restore: the worker uploads `bytes` raw bytes after the daemon accepts.
    Upload,
}

/// The checkpoint API, one variant per driver entry point.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiCall {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`; `None` waits without limit.
    Lock {
        /// Milliseconds.
        timeout_ms: Option<u64>,
    },
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore {
        /// GPU remapping.
        pairs: Vec<GpuPair>,
    },
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreTid,
}

impl ApiCall {
    /// The driver entry point's name.
    pub fn entry_point(&self) -> &'static str {
        match self {
            ApiCall::State => "cuCheckpointProcessGetState",
            ApiCall::Lock { .. } => "cuCheckpointProcessLock",
            ApiCall::Checkpoint => "cuCheckpointProcessCheckpoint",
            ApiCall::Restore { .. } => "cuCheckpointProcessRestore",
            ApiCall::Unlock => "cuCheckpointProcessUnlock",
            ApiCall::RestoreTid => "cuCheckpointProcessGetRestoreThreadId",
        }
    }

    /// How long the daemon waits for the restore thread's answer.
    pub fn deadline(&self) -> Duration {
        match self {
            ApiCall::Lock {
                timeout_ms: Some(ms),
            } => Duration::from_millis(*ms) + LOCK_GRACE,
            // A lock without limit waits for the work, however long; a restore uploads GiBs.
            ApiCall::Lock { timeout_ms: None } | ApiCall::Restore { .. } | ApiCall::Checkpoint => {
                Duration::from_secs(3600)
            }
            _ => WORKER_CALL_GRACE,
        }
    }
}

/// Injectable faults.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// A kernel faults: the context gets the sticky `CUDA_ERROR_ILLEGAL_ADDRESS`.
    Sticky,
}

/// What a successful checkpoint-API call returns.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiDone {
    /// Nothing (lock, checkpoint, restore, unlock).
    Done,
    /// The process's state.
    State(ProcessState),
    /// The restore thread's tid.
    Tid(Pid),
}

/// The daemon's (or a restore thread's) answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reply {
    /// Answer to `Hello`.
    Hello {
        /// What `driver_version` reports.
        driver_version: String,
        /// The daemon id (part of restore-thread socket names).
        daemon_id: String,
    },
    /// The context is open (for `Init::Upload`: send the bytes now).
    Opened {
        /// Where.
        gpu_index: u32,
        /// Where.
        gpu_uuid: GpuUuid,
    },
    /// A checkpoint-API call succeeded.
    Api(ApiDone),
    /// GPUs.
    Gpus(Vec<GpuInfo>),
    /// Processes.
    Processes(Vec<GpuProcess>),
    /// Fd numbers.
    Fds(Vec<i32>),
    /// Fault injected.
    Injected,
    /// The driver answered with an error code.
    Cuda(CuResult),
    /// Something outside the driver model went wrong (bad request, I/O).
    Error(String),
}

/// A request on an open context (a "GPU call" of the worker's application threads).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CtxRequest {
    /// Read words at these word indices.
    Read(Vec<u64>),
    /// Hash all of device memory.
    Hash,
    /// Checkpoint, step 1: send all device memory (raw bytes follow the reply).
    Download,
    /// Checkpoint, step 2: free device memory; the context is no longer live.
    Release,
}

/// The answer on an open context.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CtxReply {
    /// The words asked for.
    Words(Vec<u64>),
    /// Content hash of device memory.
    Hash(u64),
    /// This many raw bytes follow.
    Download(u64),
    /// Device memory freed.
    Released,
    /// The upload of a restore arrived.
    Uploaded,
    /// The request failed.
    Error(String),
}

/// A request to a worker's restore thread.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerRequest {
    /// What to do.
    pub op: WorkerOp,
    /// Wall-clock time (ms since the epoch) after which the daemon no longer waits for the
    /// answer: a thread that was stopped past it must not carry the call out (nobody would know).
    pub expires_unix_ms: u64,
}

/// What a restore thread is asked to do.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum WorkerOp {
    /// Carry out a checkpoint-API call.
    Api(ApiCall),
    /// Inject a fault.
    Inject(Fault),
}

/// Milliseconds since the epoch, now.
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// Writes one message.
pub fn send<T: Serialize>(w: &mut impl Write, msg: &T) -> io::Result<()> {
    let body = serde_json::to_vec(msg).map_err(io::Error::other)?;
    let len = u32::try_from(body.len()).map_err(|_| io::Error::other("message too large"))?;
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&len.to_le_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame)?;
    w.flush()
}

/// Reads one message; `Ok(None)` on a clean EOF before it.
pub fn recv<T: DeserializeOwned>(r: &mut impl Read) -> io::Result<Option<T>> {
    let mut len = [0u8; 4];
    match r.read_exact(&mut len) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let len = u32::from_le_bytes(len);
    if len > MAX_MESSAGE {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("message of {len} bytes"),
        ));
    }
    let mut body = vec![0u8; len as usize];
    r.read_exact(&mut body)?;
    serde_json::from_slice(&body)
        .map(Some)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Reads one message; EOF is an error.
pub fn recv_some<T: DeserializeOwned>(r: &mut impl Read) -> io::Result<T> {
    recv(r)?.ok_or_else(|| io::Error::new(io::ErrorKind::UnexpectedEof, "connection closed"))
}
