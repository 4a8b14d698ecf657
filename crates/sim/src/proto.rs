//! The wire protocol between the daemon, its clients, and the workers' restore threads.
//!
//! Every message is a 4-byte little-endian length and that many bytes of JSON. Bulk device memory
//! (checkpoint download, restore upload) follows its header as raw bytes on the same stream.

use std::io::{self, Read, Write};

use cryo_gpu::{CuResult, GpuInfo, GpuPair, GpuProcess, GpuUuid, ProcessState};
use cryo_proc::Pid;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

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
    /// Open the driver without a context (what `cuInit` does: `/dev/nvidiactl`): the connection
    /// becomes a driver fd that holds no device memory.
    OpenDriver {
        /// Inode of the worker's end of this socket.
        inode: u64,
    },
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
    /// Every process listed (NVML) or holding a driver file of this daemon: the guard's scan.
    CudaProcesses,
    /// Fault injection.
    Inject {
        /// Target process.
        pid: Pid,
        /// What to inject.
        fault: Fault,
    },
    /// From now on, calls that `rule` matches get no answer until released (or their caller
    /// hangs up): a driver call that does not return.
    Hang(HangRule),
    /// Lets every held call go on (and clears every hang rule).
    Release,
    /// How many calls are held right now.
    Held,
    /// The device-memory copies of the last checkpoints and restores ([`MemCopy`]).
    Copies,
}

/// Which way device memory was copied.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CopyKind {
    /// A checkpoint's copy of device memory to the process (`CtxRequest::Download`).
    Checkpoint,
    /// A restore's copy of the process's host copy into a new context (`Init::Upload`).
    Restore,
}

/// One copy of a context's device memory, as the daemon timed it: from the request to its last
/// byte read by the process (checkpoint: the context socket's send queue drained, not just its
/// last byte queued; up to 8 MiB were still in flight then) or by the daemon (restore). On the simulated GPU this is the bulk of a checkpoint's
/// and a restore's time, and the noisy part: the process's side faults its copy's pages in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemCopy {
    /// The process whose context it was.
    pub pid: Pid,
    /// Which way.
    pub kind: CopyKind,
    /// Bytes copied.
    pub bytes: u64,
    /// Its start on `CLOCK_MONOTONIC`.
    pub start: cryo_units::Moment,
    /// Its end on `CLOCK_MONOTONIC`.
    pub end: cryo_units::Moment,
}

/// Which calls an injected hang holds.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HangRule {
    /// The kind of call.
    pub call: CallKind,
    /// Only calls on this process (a thread id stands for its process); `None`: on any.
    pub pid: Option<Pid>,
    /// Hold this many matching calls, then let the next ones through; `None`: all of them.
    pub times: Option<u32>,
}

/// A kind of driver call, as a hang rule names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreTid,
    /// NVML: the GPUs.
    Gpus,
    /// NVML: the processes.
    Processes,
    /// The driver fds of a process.
    DriverFds,
    /// Every call above.
    Any,
}

impl CallKind {
    /// What a request is, for hang rules: its kind and the process it acts on.
    pub fn of(req: &Request) -> Option<(CallKind, Option<Pid>)> {
        Some(match req {
            Request::Call { pid, call } => (call.kind(), Some(*pid)),
            Request::Gpus => (CallKind::Gpus, None),
            Request::Processes => (CallKind::Processes, None),
            Request::DriverFds { pid } => (CallKind::DriverFds, Some(*pid)),
            _ => return None,
        })
    }

    /// Whether a rule for `self` covers a call of kind `kind`.
    pub fn covers(self, kind: CallKind) -> bool {
        self == CallKind::Any || self == kind
    }
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

    /// Its kind, for hang rules.
    pub fn kind(&self) -> CallKind {
        match self {
            ApiCall::State => CallKind::State,
            ApiCall::Lock { .. } => CallKind::Lock,
            ApiCall::Checkpoint => CallKind::Checkpoint,
            ApiCall::Restore { .. } => CallKind::Restore,
            ApiCall::Unlock => CallKind::Unlock,
            ApiCall::RestoreTid => CallKind::RestoreTid,
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
    /// Pids.
    Pids(Vec<Pid>),
    /// Fault injected (or hang rule set).
    Injected,
    /// The driver fd of `OpenDriver` is open.
    DriverOpened,
    /// Calls held by injected hangs (answer to `Held`, and to `Release`: those it let go).
    Held(u32),
    /// The last copies, oldest first (answer to `Copies`).
    Copies(Vec<MemCopy>),
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
    /// An allocation or free at the end of device memory (an engine's KV-cache pool, its
    /// weights): device memory becomes `bytes` long. What grows is filled from `seed` as the
    /// words at its offset (`None`: zeros); growing past the GPU's free memory is
    /// `CUDA_ERROR_OUT_OF_MEMORY`.
    Resize {
        /// The new size.
        bytes: u64,
        /// How the new part is filled.
        seed: Option<u64>,
    },
    /// A host-to-device copy: `len` raw bytes follow, written at `offset`.
    Write {
        /// Where.
        offset: u64,
        /// How many.
        len: u64,
    },
    /// The first `len` bytes are filled from `seed` (weights loaded from the model's files).
    Fill {
        /// How many.
        len: u64,
        /// The seed.
        seed: u64,
    },
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
    /// The upload of a restore (or a `Write`) arrived.
    Uploaded,
    /// A `Resize` or `Fill` is done.
    Done,
    /// The driver refused (`Resize` past the free memory).
    Cuda(CuResult),
    /// The request failed.
    Error(String),
}

/// A request to a worker's restore thread. It is carried out whenever the thread gets to it,
/// even if the caller has given up waiting meanwhile (as a queued driver request would be).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct WorkerRequest {
    /// What to do.
    pub op: WorkerOp,
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

/// The abstract socket name (without the leading `@`) a restore thread listens on:
/// `cryo-sim/<daemon-id>/<pid>-<tid>-<nonce>`. It carries the thread's id, as the real driver
/// knows its restore thread from the moment `cuInit` created it, so the daemon answers
/// `cuCheckpointProcessGetRestoreThreadId` without the thread's help (CRIU's cuda plugin asks it
/// of a frozen process).
pub fn restore_socket_name(daemon_id: &str, pid: Pid, tid: Pid, nonce: u32) -> String {
    format!("cryo-sim/{daemon_id}/{pid}-{tid}-{nonce:08x}")
}

/// The restore thread's id in a name made by [`restore_socket_name`] (with or without `@`).
pub fn restore_tid_of(name: &str) -> Option<Pid> {
    let last = name.rsplit('/').next()?;
    let mut parts = last.split('-');
    let _pid: Pid = parts.next()?.parse().ok()?;
    let tid: Pid = parts.next()?.parse().ok()?;
    u32::from_str_radix(parts.next()?, 16).ok()?;
    parts.next().is_none().then_some(tid)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restore_socket_names_carry_the_thread_id() {
        let n = restore_socket_name("00ff", 41, 43, 0xabc);
        assert_eq!(n, "cryo-sim/00ff/41-43-00000abc");
        assert_eq!(restore_tid_of(&n), Some(43));
        assert_eq!(restore_tid_of(&format!("@{n}")), Some(43));
        for bad in [
            "cryo-sim/00ff/41-00000abc",
            "cryo-sim/00ff/41-x-00000abc",
            "cryo-sim/00ff/41-43-zz",
            "cryo-sim/00ff/41-43-1-2",
            "",
        ] {
            assert_eq!(restore_tid_of(bad), None, "{bad}");
        }
    }

    #[test]
    fn hang_rules_name_calls() {
        let call = |c: ApiCall| CallKind::of(&Request::Call { pid: 5, call: c });
        assert_eq!(
            call(ApiCall::Lock { timeout_ms: None }),
            Some((CallKind::Lock, Some(5)))
        );
        assert_eq!(
            call(ApiCall::RestoreTid),
            Some((CallKind::RestoreTid, Some(5)))
        );
        assert_eq!(
            CallKind::of(&Request::Processes),
            Some((CallKind::Processes, None))
        );
        assert_eq!(CallKind::of(&Request::Hello), None);
        assert!(CallKind::Any.covers(CallKind::Gpus));
        assert!(!CallKind::Lock.covers(CallKind::Unlock));
    }
}
