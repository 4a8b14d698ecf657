//! The worker's checkpoint state and its GPU calls.

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
    gpu_uuid: Option<GpuUuid>,
    /// Device memory while checkpointed.
    host_copy: Option<Vec<u8>>,
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
}

/// The worker process's GPU side.
#[derive(Debug)]
pub(crate) struct Worker {
    dir: PathBuf,
    bytes: u64,
    seed: u64,
    st: Mutex<State>,
    cv: Condvar,
    ctx: Mutex<Option<Context>>,
    expected: OnceLock<u64>,
}

fn protocol(what: &str, reply: impl std::fmt::Debug) -> io::Error {
    io::Error::other(format!("unexpected answer to {what}: {reply:?}"))
}

impl Worker {
    pub(crate) fn new(dir: PathBuf, bytes: u64, seed: u64) -> Self {
        Worker {
            dir,
            bytes,
            seed,
            st: Mutex::new(State {
                phase: ProcessState::Running,
                gate_closed: false,
                inflight: 0,
                waiting: 0,
                busy_until: Instant::now(),
                sticky: None,
                stuck: false,
                gpu_uuid: None,
                host_copy: None,
                restore_tid: 0,
            }),
            cv: Condvar::new(),
            ctx: Mutex::new(None),
            expected: OnceLock::new(),
        }
    }

    fn st(&self) -> MutexGuard<'_, State> {
        self.st.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn ctx(&self) -> MutexGuard<'_, Option<Context>> {
        self.ctx.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn set_restore_tid(&self, tid: Pid) {
        self.st().restore_tid = tid;
    }

    /// Opens the first context, filled from the seed.
    pub(crate) fn open_fresh(&self, gpu: u32) -> Result<(), OpenError> {
        let (ctx, uuid) = self.open(GpuSel::Index(gpu), Init::Seed(self.seed), None)?;
        *self.ctx() = Some(ctx);
        self.st().gpu_uuid = Some(uuid);
        Ok(())
    }

    fn open(
        &self,
        gpu: GpuSel,
        init: Init,
        upload: Option<&[u8]>,
    ) -> Result<(Context, GpuUuid), OpenError> {
        let mut s =
            UnixStream::connect(crate::socket_path(&self.dir)).map_err(OpenError::Connect)?;
        crate::sys::grow_socket_buffers(&s);
        let perr = |e: io::Error| OpenError::Protocol(e.to_string());
        let inode = nix::sys::stat::fstat(s.as_raw_fd())
            .map_err(|e| perr(e.into()))?
            .st_ino;
        proto::send(
            &mut s,
            &Request::OpenContext(OpenContext {
                gpu,
                bytes: self.bytes,
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
        f: impl FnOnce(&mut Context) -> io::Result<T>,
    ) -> Result<T, CallError> {
        {
            let mut st = self.pass_gate(self.st());
            if let Some(code) = st.sticky {
                return Err(CallError::Sticky(code));
            }
            st.inflight += 1;
        }
        let r = match self.ctx().as_mut() {
            Some(c) => f(c).map_err(CallError::Io),
            None => Err(CallError::NoContext),
        };
        self.st().inflight -= 1;
        self.cv.notify_all();
        r
    }

    /// Reads device-memory words (a "kernel" sampling the weights).
    pub(crate) fn read_words(&self, words: Vec<u64>) -> Result<Vec<u64>, CallError> {
        self.gpu_call(|c| match c.request(&CtxRequest::Read(words))? {
            CtxReply::Words(w) => Ok(w),
            other => Err(protocol("read", other)),
        })
    }

    /// `(actual, expected)` content hash of device memory.
    pub(crate) fn verify(&self) -> Result<(u64, u64), CallError> {
        let actual = self.gpu_call(|c| match c.request(&CtxRequest::Hash)? {
            CtxReply::Hash(h) => Ok(h),
            other => Err(protocol("hash", other)),
        })?;
        let expected = *self
            .expected
            .get_or_init(|| memory::expected_hash(self.seed, self.bytes));
        Ok((actual, expected))
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
        let mut slot = self.ctx();
        let Some(ctx) = slot.as_mut() else {
            return Err(CuResult::ILLEGAL_STATE);
        };
        let copy = download(ctx).map_err(|err| {
            tracing::error!(%err, "checkpoint failed");
            CuResult::UNKNOWN
        })?;
        // Closing our end: only duplicates held elsewhere (pins) keep the socket open now, and
        // the daemon has already freed the memory.
        *slot = None;
        st.host_copy = Some(copy);
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
        let Some(old) = st.gpu_uuid.clone() else {
            return Err(CuResult::ILLEGAL_STATE);
        };
        let target = pairs
            .iter()
            .find(|p| p.old == old)
            .map_or(old, |p| p.new.clone());
        let Some(copy) = st.host_copy.as_deref() else {
            return Err(CuResult::ILLEGAL_STATE);
        };
        match self.open(GpuSel::Uuid(target), Init::Upload, Some(copy)) {
            Ok((ctx, uuid)) => {
                *self.ctx() = Some(ctx);
                st.gpu_uuid = Some(uuid);
                st.host_copy = None;
                st.phase = ProcessState::Locked;
                Ok(ApiDone::Done)
            }
            Err(OpenError::Cuda(CuResult::OUT_OF_MEMORY)) => {
                st.stuck = true;
                Err(CuResult::OUT_OF_MEMORY)
            }
            Err(OpenError::Cuda(code)) => Err(code),
            Err(err) => {
                tracing::error!(?err, "restore failed");
                Err(CuResult::OPERATING_SYSTEM)
            }
        }
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
    match ctx.request(&CtxRequest::Release)? {
        CtxReply::Released => Ok(copy),
        other => Err(protocol("release", other)),
    }
}
