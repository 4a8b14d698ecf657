//! The worker's checkpoint state and its GPU calls.
//!
//! A worker holds one context per GPU it was started on (its *ranks*, in order), or none at all
//! when it only initialised the driver (`--init-only`: a launcher that called `cuInit`, holding a
//! driver fd and no device memory). Checkpoint and restore act on every context at once and are
//! all-or-nothing, as the driver's are.

use std::io::{self, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, GpuPair, GpuUuid, ProcessState};
use cryo_proc::Pid;

use crate::memory;
use crate::proto::{
    self, ApiCall, ApiDone, CtxReply, CtxRequest, Fault, GpuSel, Init, OpenContext, Reply, Request,
};

/// Opening a context failed.
#[derive(Debug)]
pub(crate) enum OpenError {
    /// The driver is not reachable.
    Connect(io::Error),
    /// The driver refused.
    Cuda(CuResult),
    /// The conversation broke.
    Protocol(String),
}

/// A GPU call from an application thread failed.
#[derive(Debug)]
pub(crate) enum CallError {
    /// The context has a sticky error.
    Sticky(CuResult),
    /// No context (cannot happen while the gate is open).
    NoContext,
    /// The driver connection broke.
    Io(io::Error),
    /// A rank of a tree did not answer (its process is gone, or the channel broke).
    Rank(String),
    /// The engine is asleep (weights or KV cache released): it serves nothing.
    Sleeping,
    /// An engine memory request that does not fit the engine's state.
    Engine(String),
}

#[derive(Debug)]
struct State {
    phase: ProcessState,
    /// Closed by lock: application GPU calls wait.
    gate_closed: bool,
    /// Application GPU calls in progress.
    inflight: u32,
    /// Application GPU calls waiting at the closed gate.
    waiting: u32,
    /// Queued GPU work runs until then.
    busy_until: Instant,
    sticky: Option<CuResult>,
    /// A restore failed for lack of device memory: the process can never be restored
    /// (NVIDIA/cuda-checkpoint#44).
    stuck: bool,
    /// The GPU of each context, in rank order (what a restore's pairs must cover).
    gpu_uuids: Vec<GpuUuid>,
    /// Device memory of each context while checkpointed.
    host_copy: Option<Vec<Vec<u8>>>,
    restore_tid: Pid,
}

/// One context fd: the worker's end of its connection to the daemon.
#[derive(Debug)]
pub(crate) struct Context {
    s: UnixStream,
}

impl Context {
    fn request(&mut self, req: &CtxRequest) -> io::Result<CtxReply> {
        proto::send(&mut self.s, req)?;
        proto::recv_some(&mut self.s)
    }

    /// Device memory becomes `bytes` long; what grows is filled from `seed` (or zeros).
    pub(crate) fn resize(&mut self, bytes: u64, seed: Option<u64>) -> io::Result<()> {
        match self.request(&CtxRequest::Resize { bytes, seed })? {
            CtxReply::Done => Ok(()),
            CtxReply::Cuda(code) => {
                Err(io::Error::other(format!("{code} ({})", code.description())))
            }
            other => Err(protocol("resize", other)),
        }
    }

    /// Copies `data` to device memory at `offset`.
    pub(crate) fn write(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        let len = data.len() as u64;
        proto::send(&mut self.s, &CtxRequest::Write { offset, len })?;
        self.s.write_all(data)?;
        match proto::recv_some(&mut self.s)? {
            CtxReply::Uploaded => Ok(()),
            other => Err(protocol("write", other)),
        }
    }

    /// Fills the first `len` bytes from `seed`.
    pub(crate) fn fill(&mut self, len: u64, seed: u64) -> io::Result<()> {
        match self.request(&CtxRequest::Fill { len, seed })? {
            CtxReply::Done => Ok(()),
            other => Err(protocol("fill", other)),
        }
    }

    /// Copies all of device memory to the host.
    pub(crate) fn download(&mut self) -> io::Result<Vec<u8>> {
        download(self)
    }
}

/// The worker process's GPU side.
#[derive(Debug)]
pub(crate) struct Worker {
    dir: PathBuf,
    /// Device memory of each context: its weights.
    bytes: u64,
    /// Device memory of each context in rank order, where they differ (empty: `bytes` each).
    rank_bytes: Vec<u64>,
    /// Device memory of each context's KV cache, after its weights.
    kv_bytes: u64,
    seed: u64,
    /// NVML indices of the GPUs to open contexts on at start; empty: driver only (`cuInit`).
    gpus: Vec<u32>,
    st: Mutex<State>,
    cv: Condvar,
    /// The contexts, in rank order; empty while checkpointed.
    ctx: Mutex<Vec<Context>>,
    /// The driver fd of a worker without contexts; closed while checkpointed.
    driver: Mutex<Option<UnixStream>>,
    expected: OnceLock<Vec<u64>>,
    /// Where the engine's weights and KV cache are (taken before `st` and `ctx`).
    pub(super) engine: Mutex<super::engine::EngineMem>,
}

fn protocol(what: &str, reply: impl std::fmt::Debug) -> io::Error {
    io::Error::other(format!("unexpected answer to {what}: {reply:?}"))
}

/// The seed of rank `rank`'s device memory (rank 0 keeps the worker's seed).
pub(crate) fn rank_seed(seed: u64, rank: usize) -> u64 {
    seed.wrapping_add(rank as u64)
}

/// Where each context of a process checkpointed on `used` lands with `pairs`, checked as the
/// driver's documentation demands: no pairs, or a pair for *every* GPU the process used (each
/// once), onto distinct GPUs. Anything else is `CUDA_ERROR_INVALID_VALUE` (NVIDIA documents the
/// rule, not the code: that one is the safe guess) and changes nothing.
pub(crate) fn restore_targets(
    used: &[GpuUuid],
    pairs: &[GpuPair],
) -> Result<Vec<GpuUuid>, CuResult> {
    if pairs.is_empty() {
        return Ok(used.to_vec());
    }
    let mut targets = Vec::with_capacity(used.len());
    for old in used {
        let mut found = pairs.iter().filter(|p| p.old == *old);
        match (found.next(), found.next()) {
            (Some(p), None) => targets.push(p.new.clone()),
            _ => return Err(CuResult::INVALID_VALUE),
        }
    }
    let distinct: std::collections::HashSet<&GpuUuid> = targets.iter().collect();
    if pairs.len() != used.len() || distinct.len() != targets.len() {
        return Err(CuResult::INVALID_VALUE);
    }
    Ok(targets)
}

impl Worker {
    /// A worker with a context of `bytes` on each of `gpus` (none: the driver only).
    pub(crate) fn new(dir: PathBuf, bytes: u64, seed: u64, gpus: Vec<u32>) -> Self {
        Worker {
            dir,
            bytes,
            rank_bytes: Vec::new(),
            kv_bytes: 0,
            seed,
            gpus,
            st: Mutex::new(State {
                phase: ProcessState::Running,
                gate_closed: false,
                inflight: 0,
                waiting: 0,
                busy_until: Instant::now(),
                sticky: None,
                stuck: false,
                gpu_uuids: Vec::new(),
                host_copy: None,
                restore_tid: 0,
            }),
            cv: Condvar::new(),
            ctx: Mutex::new(Vec::new()),
            driver: Mutex::new(None),
            expected: OnceLock::new(),
            engine: Mutex::new(super::engine::EngineMem::default()),
        }
    }

    /// With a KV cache of `kv_bytes` per context after the weights.
    pub(crate) fn with_kv_cache(mut self, kv_bytes: u64) -> Self {
        self.kv_bytes = kv_bytes;
        self
    }

    /// With device memory `rank_bytes[r]` for context `r` instead (empty: the same for each).
    pub(crate) fn with_rank_bytes(mut self, rank_bytes: Vec<u64>) -> Self {
        self.rank_bytes = rank_bytes;
        self
    }

    /// Device memory of each context's KV cache.
    pub(crate) fn kv_bytes(&self) -> u64 {
        self.kv_bytes
    }

    /// The seed of context `rank`'s memory.
    pub(crate) fn seed_of(&self, rank: usize) -> u64 {
        rank_seed(self.seed, rank)
    }

    /// Application GPU calls in progress or waiting at the gate, and queued GPU work (1 while
    /// any is queued): what an engine counts as requests running.
    pub(crate) fn running(&self) -> u64 {
        let st = self.st();
        let busy = u64::from(st.busy_until > Instant::now());
        u64::from(st.inflight) + u64::from(st.waiting) + busy
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx(&self) -> MutexGuard<'_, Vec<Context>> {
        self.ctx.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn driver(&self) -> MutexGuard<'_, Option<UnixStream>> {
        self.driver.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Device memory (the weights) of context `rank`.
    pub(crate) fn bytes_of(&self, rank: usize) -> u64 {
        self.rank_bytes.get(rank).copied().unwrap_or(self.bytes)
    }

    /// How many contexts (ranks) it has; 0 for a driver-only worker.
    pub(crate) fn ranks(&self) -> usize {
        self.gpus.len()
    }

    pub(crate) fn set_restore_tid(&self, tid: Pid) {
        self.st().restore_tid = tid;
    }

    /// Opens the driver and the first contexts, filled from the seeds.
    pub(crate) fn open_fresh(&self) -> Result<(), OpenError> {
        if self.gpus.is_empty() {
            *self.driver() = Some(self.open_driver()?);
            return Ok(());
        }
        let mut opened = Vec::new();
        let mut uuids = Vec::new();
        for (rank, gpu) in self.gpus.iter().enumerate() {
            let init = Init::Seed(rank_seed(self.seed, rank));
            let bytes = self.bytes_of(rank);
            let (mut ctx, uuid) = self.open(GpuSel::Index(*gpu), init, bytes, None)?;
            if self.kv_bytes > 0 {
                // The KV cache: allocated after the weights are loaded, zeros until used.
                ctx.resize(bytes + self.kv_bytes, None)
                    .map_err(|e| match e.to_string() {
                        m if m.contains("OUT_OF_MEMORY") => {
                            OpenError::Cuda(CuResult::OUT_OF_MEMORY)
                        }
                        m => OpenError::Protocol(m),
                    })?;
            }
            opened.push(ctx);
            uuids.push(uuid);
        }
        *self.ctx() = opened;
        self.st().gpu_uuids = uuids;
        Ok(())
    }

    fn connect(&self) -> Result<(UnixStream, u64), OpenError> {
        let s = UnixStream::connect(crate::socket_path(&self.dir)).map_err(OpenError::Connect)?;
        crate::sys::grow_socket_buffers(&s);
        let inode = nix::sys::stat::fstat(s.as_raw_fd())
            .map_err(|e| OpenError::Protocol(e.to_string()))?
            .st_ino;
        Ok((s, inode))
    }

    /// What `cuInit` opens: a driver fd without a context.
    fn open_driver(&self) -> Result<UnixStream, OpenError> {
        let (mut s, inode) = self.connect()?;
        let perr = |e: io::Error| OpenError::Protocol(e.to_string());
        proto::send(&mut s, &Request::OpenDriver { inode }).map_err(perr)?;
        match proto::recv_some(&mut s).map_err(perr)? {
            Reply::DriverOpened => Ok(s),
            Reply::Cuda(code) => Err(OpenError::Cuda(code)),
            other => Err(OpenError::Protocol(format!(
                "unexpected answer to open: {other:?}"
            ))),
        }
    }

    fn open(
        &self,
        gpu: GpuSel,
        init: Init,
        bytes: u64,
        upload: Option<&[u8]>,
    ) -> Result<(Context, GpuUuid), OpenError> {
        let (mut s, inode) = self.connect()?;
        let perr = |e: io::Error| OpenError::Protocol(e.to_string());
        proto::send(
            &mut s,
            &Request::OpenContext(OpenContext {
                gpu,
                bytes,
                init,
                inode,
            }),
        )
        .map_err(perr)?;
        let uuid = match proto::recv_some(&mut s).map_err(perr)? {
            Reply::Opened { gpu_uuid, .. } => gpu_uuid,
            Reply::Cuda(code) => return Err(OpenError::Cuda(code)),
            other => {
                return Err(OpenError::Protocol(format!(
                    "unexpected answer to open: {other:?}"
                )))
            }
        };
        if let Some(data) = upload {
            s.write_all(data).map_err(perr)?;
            match proto::recv_some(&mut s).map_err(perr)? {
                CtxReply::Uploaded => {}
                other => {
                    return Err(OpenError::Protocol(format!(
                        "unexpected answer to upload: {other:?}"
                    )))
                }
            }
        }
        Ok((Context { s }, uuid))
    }

    /// Waits while the gate is closed (the process is locked), counted in `waiting`.
    fn pass_gate<'a>(&self, mut st: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        st.waiting += 1;
        while st.gate_closed {
            st = self.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.waiting -= 1;
        st
    }

    /// `(queued GPU work left, GPU calls waiting at the gate)`, for `GET /health`.
    pub(crate) fn load(&self) -> (Duration, u32) {
        let st = self.st();
        (
            st.busy_until.saturating_duration_since(Instant::now()),
            st.waiting,
        )
    }

    /// Runs an application GPU call: waits while locked, fails on a sticky error.
    pub(crate) fn gpu_call<T>(
        &self,
        f: impl FnOnce(&mut [Context]) -> io::Result<T>,
    ) -> Result<T, CallError> {
        {
            let mut st = self.pass_gate(self.st());
            if let Some(code) = st.sticky {
                return Err(CallError::Sticky(code));
            }
            st.inflight += 1;
        }
        let r = {
            let mut ctx = self.ctx();
            if ctx.is_empty() {
                Err(CallError::NoContext)
            } else {
                f(&mut ctx).map_err(CallError::Io)
            }
        };
        self.st().inflight -= 1;
        self.cv.notify_all();
        r
    }

    /// Reads device-memory words of rank `rank` (a "kernel" sampling the weights).
    pub(crate) fn read_words(&self, rank: usize, words: Vec<u64>) -> Result<Vec<u64>, CallError> {
        self.gpu_call(|c| {
            let ctx = c
                .get_mut(rank)
                .ok_or_else(|| io::Error::other(format!("no rank {rank}")))?;
            match ctx.request(&CtxRequest::Read(words))? {
                CtxReply::Words(w) => Ok(w),
                other => Err(protocol("read", other)),
            }
        })
    }

    /// `(actual, expected)` content hash of each context's device memory, in rank order.
    pub(crate) fn verify(&self) -> Result<Vec<(u64, u64)>, CallError> {
        if self.gpus.is_empty() {
            return Ok(Vec::new());
        }
        let actual = self.gpu_call(|c| {
            c.iter_mut()
                .map(|ctx| match ctx.request(&CtxRequest::Hash)? {
                    CtxReply::Hash(h) => Ok(h),
                    other => Err(protocol("hash", other)),
                })
                .collect::<io::Result<Vec<u64>>>()
        })?;
        let expected = self.expected.get_or_init(|| {
            (0..self.gpus.len())
                .map(|r| {
                    memory::expected_hash_filled(
                        rank_seed(self.seed, r),
                        self.bytes_of(r),
                        self.bytes_of(r) + self.kv_bytes,
                    )
                })
                .collect()
        });
        Ok(actual.into_iter().zip(expected.iter().copied()).collect())
    }

    /// Queues `ms` of GPU work.
    pub(crate) fn enqueue(&self, ms: u64) -> Result<(), CallError> {
        let mut st = self.pass_gate(self.st());
        if let Some(code) = st.sticky {
            return Err(CallError::Sticky(code));
        }
        let now = Instant::now();
        st.busy_until = st.busy_until.max(now) + Duration::from_millis(ms);
        Ok(())
    }

    /// A kernel faults: the context's error is sticky from now on.
    pub(crate) fn fault(&self) -> Result<(), CallError> {
        let mut st = self.pass_gate(self.st());
        st.sticky = Some(CuResult::ILLEGAL_ADDRESS);
        Ok(())
    }

    /// Carries out a checkpoint-API call (on the restore thread).
    pub(crate) fn api(&self, call: &ApiCall) -> Result<ApiDone, CuResult> {
        match call {
            ApiCall::State => Ok(ApiDone::State(self.st().phase)),
            ApiCall::RestoreTid => Ok(ApiDone::Tid(self.st().restore_tid)),
            ApiCall::Lock { timeout_ms } => self.lock(timeout_ms.map(Duration::from_millis)),
            ApiCall::Checkpoint => self.checkpoint(),
            ApiCall::Restore { pairs } => self.restore(pairs),
            ApiCall::Unlock => self.unlock(),
        }
    }

    pub(crate) fn inject(&self, fault: Fault) {
        match fault {
            Fault::Sticky => self.st().sticky = Some(CuResult::ILLEGAL_ADDRESS),
        }
    }

    fn lock(&self, timeout: Option<Duration>) -> Result<ApiDone, CuResult> {
        let mut st = self.st();
        if st.phase != ProcessState::Running {
            return Err(CuResult::ILLEGAL_STATE);
        }
        if st.sticky.is_some() {
            return Err(CuResult::ILLEGAL_ADDRESS);
        }
        st.gate_closed = true;
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let now = Instant::now();
            if st.inflight == 0 && st.busy_until <= now {
                st.phase = ProcessState::Locked;
                return Ok(ApiDone::Done);
            }
            let mut wait = st
                .busy_until
                .saturating_duration_since(now)
                .max(Duration::from_millis(1));
            if let Some(d) = deadline {
                if now >= d {
                    st.gate_closed = false;
                    self.cv.notify_all();
                    return Err(CuResult::NOT_READY);
                }
                wait = wait.min(d - now);
            }
            st = self
                .cv
                .wait_timeout(st, wait)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn checkpoint(&self) -> Result<ApiDone, CuResult> {
        let mut st = self.st();
        if st.phase != ProcessState::Locked {
            return Err(CuResult::ILLEGAL_STATE);
        }
        if self.gpus.is_empty() {
            // Nothing on a GPU: the driver fd is released, as every driver fd is by checkpoint.
            *self.driver() = None;
            st.host_copy = Some(Vec::new());
            st.phase = ProcessState::Checkpointed;
            return Ok(ApiDone::Done);
        }
        let mut slot = self.ctx();
        if slot.is_empty() {
            return Err(CuResult::ILLEGAL_STATE);
        }
        // All or nothing: every context is copied before any is released.
        let mut copies = Vec::with_capacity(slot.len());
        for ctx in slot.iter_mut() {
            copies.push(download(ctx).map_err(|err| {
                tracing::error!(%err, "checkpoint failed while copying device memory");
                CuResult::UNKNOWN
            })?);
        }
        for ctx in slot.iter_mut() {
            if let Err(err) = release(ctx) {
                // Some contexts are gone, some not: the driver gives up on such a process.
                tracing::error!(%err, "checkpoint failed while releasing a context");
                st.phase = ProcessState::Failed;
                return Err(CuResult::UNKNOWN);
            }
        }
        // Closing our ends: only duplicates held elsewhere (pins) keep the sockets open now, and
        // the daemon has already freed the memory.
        slot.clear();
        st.host_copy = Some(copies);
        st.phase = ProcessState::Checkpointed;
        Ok(ApiDone::Done)
    }

    fn restore(&self, pairs: &[GpuPair]) -> Result<ApiDone, CuResult> {
        let mut st = self.st();
        if st.stuck {
            return Err(CuResult::OPERATING_SYSTEM);
        }
        if st.phase != ProcessState::Checkpointed {
            return Err(CuResult::ILLEGAL_STATE);
        }
        let targets = restore_targets(&st.gpu_uuids, pairs)?;
        if self.gpus.is_empty() {
            return match self.open_driver() {
                Ok(s) => {
                    *self.driver() = Some(s);
                    st.host_copy = None;
                    st.phase = ProcessState::Locked;
                    Ok(ApiDone::Done)
                }
                Err(err) => {
                    tracing::error!(?err, "restore failed");
                    Err(CuResult::OPERATING_SYSTEM)
                }
            };
        }
        let Some(copies) = st.host_copy.as_deref() else {
            return Err(CuResult::ILLEGAL_STATE);
        };
        // All or nothing: a context that cannot be opened undoes the ones that were.
        let mut opened = Vec::with_capacity(targets.len());
        let mut uuids = Vec::with_capacity(targets.len());
        let mut failure = None;
        for (target, copy) in targets.into_iter().zip(copies) {
            // As much device memory as it held at checkpoint (an engine may have shrunk it).
            let bytes = copy.len() as u64;
            match self.open(GpuSel::Uuid(target), Init::Upload, bytes, Some(copy)) {
                Ok((ctx, uuid)) => {
                    opened.push(ctx);
                    uuids.push(uuid);
                }
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if let Some(err) = failure {
            for mut ctx in opened {
                // Released before closed: an undone restore is no live restored context.
                if let Err(e) = release(&mut ctx) {
                    tracing::error!(%e, "cannot release a context of a failed restore");
                }
            }
            return match err {
                OpenError::Cuda(CuResult::OUT_OF_MEMORY) => {
                    st.stuck = true;
                    Err(CuResult::OUT_OF_MEMORY)
                }
                OpenError::Cuda(code) => Err(code),
                err => {
                    tracing::error!(?err, "restore failed");
                    Err(CuResult::OPERATING_SYSTEM)
                }
            };
        }
        *self.ctx() = opened;
        st.gpu_uuids = uuids;
        st.host_copy = None;
        st.phase = ProcessState::Locked;
        Ok(ApiDone::Done)
    }

    fn unlock(&self) -> Result<ApiDone, CuResult> {
        let mut st = self.st();
        if st.phase != ProcessState::Locked {
            return Err(CuResult::ILLEGAL_STATE);
        }
        st.phase = ProcessState::Running;
        st.gate_closed = false;
        self.cv.notify_all();
        Ok(ApiDone::Done)
    }
}

fn download(ctx: &mut Context) -> io::Result<Vec<u8>> {
    let n = match ctx.request(&CtxRequest::Download)? {
        CtxReply::Download(n) => n,
        other => return Err(protocol("download", other)),
    };
    let n = usize::try_from(n).map_err(io::Error::other)?;
    let mut copy = vec![0u8; n];
    crate::sys::advise_huge_pages(&mut copy);
    io::Read::read_exact(&mut ctx.s, &mut copy)?;
    Ok(copy)
}

fn release(ctx: &mut Context) -> io::Result<()> {
    match ctx.request(&CtxRequest::Release)? {
        CtxReply::Released => Ok(()),
        other => Err(protocol("release", other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn u(n: u8) -> GpuUuid {
        GpuUuid::from_bytes([n; 16])
    }

    fn pair(o: u8, n: u8) -> GpuPair {
        GpuPair {
            old: u(o),
            new: u(n),
        }
    }

    #[test]
    fn restore_takes_no_pairs_or_a_complete_list() {
        let used = [u(1), u(2)];
        assert_eq!(restore_targets(&used, &[]), Ok(vec![u(1), u(2)]));
        assert_eq!(
            restore_targets(&used, &[pair(2, 2), pair(1, 3)]),
            Ok(vec![u(3), u(2)])
        );
        assert_eq!(
            restore_targets(&used, &[pair(1, 2), pair(2, 1)]),
            Ok(vec![u(2), u(1)])
        );
        for bad in [
            vec![pair(1, 3)],                         // GPU 2 left out
            vec![pair(1, 3), pair(2, 3)],             // two onto one
            vec![pair(1, 3), pair(2, 2), pair(4, 5)], // a GPU the process did not use
            vec![pair(1, 3), pair(1, 4), pair(2, 2)], // GPU 1 twice
            vec![pair(1, 2)],                         // onto the other's GPU, other missing
        ] {
            assert_eq!(
                restore_targets(&used, &bad),
                Err(CuResult::INVALID_VALUE),
                "{bad:?}"
            );
        }
        // A process without contexts takes no pairs.
        assert_eq!(restore_targets(&[], &[]), Ok(vec![]));
        assert_eq!(
            restore_targets(&[], &[pair(1, 1)]),
            Err(CuResult::INVALID_VALUE)
        );
    }
}
