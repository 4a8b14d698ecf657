//! The driver daemon: owns device memory, serves contexts, relays checkpoint-API calls to the
//! workers' restore threads, answers NVML-style queries, and keeps the wedge ledger.
//!
//! # Design
//! One thread per connection, kept between connections: a few threads wait in `accept` on the
//! listener and each serves what it accepted itself; when the last one waiting takes a
//! connection it starts another first (a context's thread serves it for the context's life).
//! The first message says what the connection is: a context
//! (`OpenContext`; the connection then lives as long as the worker's context fd) or a one-shot
//! request. It must come within [`FIRST_MESSAGE_TIMEOUT`], and at most [`MAX_UNIDENTIFIED`]
//! connections wait for theirs at once (one more is refused with an error reply): a flood of
//! connections that never say what they are holds a bounded number of threads, for a bounded
//! time.
//!
//! Why kept threads (session 16): the real NVML answers a query in the caller's process in
//! 0.03 ms (`shared/gpu-facts.md`); a thread started per connection made every simulated query
//! wait for a fresh thread to be scheduled. Measured from a client (a `processes` query, 300
//! of each interleaved, 5 ms apart, load 7 on this project's 2-CPU host): 0.44 ms median, 3.5
//! ms at the 90th percentile with a thread per connection, 0.26 and 0.42 ms with a waiting
//! acceptor (a checkpoint-API call, which the worker's restore thread carries out: 1.35 and
//! 1.17 ms median). Still far above the real 0.03 ms, but no longer a charge that grows with
//! the host's load on every query: a caller that asks NVML more (cryo verifies each checkpoint
//! through it, the bare `cuda-checkpoint` route does not) was charged far more than the real
//! stack would charge it. The context table holds only bookkeeping (pid, GPU, size, whether it came from a
//! restore, the inode of the worker's end); the memory itself belongs to the context's thread.
//!
//! NVML-style queries ([`Request::Processes`], [`Request::Gpus`]) first settle every context whose
//! worker end is closed (the last duplicate gone): they wait until its thread has torn it down,
//! wedge recorded in the ledger included. So an answer given after a process died reflects that
//! death, as the real driver frees a context when its device files are released; tests rely on
//! one such round trip, not on a sleep, before they read the ledger.

use std::collections::{HashMap, HashSet};
use std::io::{self, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, GpuInfo, GpuProcess, GpuUuid};
use cryo_proc::Pid;

use crate::ledger::{self, Wedge};
use crate::proto::{
    self, ApiCall, ApiDone, CallKind, CopyKind, CtxReply, CtxRequest, GpuSel, HangRule, Init,
    MemCopy, OpenContext, Reply, Request, WorkerOp, WorkerRequest,
};
use crate::vram::Vram;
use cryo_proc::{DriverFiles, FdTarget, Liveness};
use cryo_units::Moment;

use crate::memory;

/// What `cryo sim driver` was asked to simulate.
#[derive(Debug, Clone)]
pub struct DaemonConfig {
    /// Directory of `driver.sock` and `ledger.jsonl`.
    pub dir: PathBuf,
    /// Number of GPUs.
    pub gpus: u32,
    /// Device memory per GPU, bytes.
    pub gpu_memory: u64,
    /// Product name.
    pub gpu_name: String,
    /// UUIDs of the first GPUs (the rest are derived from the directory).
    pub gpu_uuids: Vec<GpuUuid>,
}

/// The daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// The directory could not be created.
    #[error("cannot create the simulated driver's directory {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// Another daemon answers on the socket.
    #[error("a simulated GPU driver is already running at {socket}")]
    AlreadyRunning {
        /// The socket.
        socket: String,
    },
    /// The socket could not be bound.
    #[error("cannot listen on {socket}: {source}")]
    Listen {
        /// The socket.
        socket: String,
        /// The error.
        source: io::Error,
    },
    /// Bad GPU count.
    #[error("--gpus must be between 1 and 64, not {0}")]
    GpuCount(u32),
    /// More UUIDs than GPUs, or the same UUID twice.
    #[error("bad --gpu-uuid list for {gpus} GPUs: {reason}")]
    Uuids {
        /// GPU count.
        gpus: u32,
        /// What is wrong.
        reason: String,
    },
}

#[derive(Debug)]
struct GpuSpec {
    uuid: GpuUuid,
    name: String,
    total: u64,
    /// Its memory as the host backs it (kept for the next context, as a GPU's memory is).
    vram: Vram,
}

#[derive(Debug, Clone)]
struct CtxMeta {
    id: u64,
    pid: Pid,
    gpu: usize,
    bytes: u64,
    restored: bool,
    inode: u64,
    /// The daemon's end of the context socket (a duplicate), to see that the worker's end closed.
    sock: Option<Arc<UnixStream>>,
}

#[derive(Debug)]
struct Daemon {
    id: String,
    ledger: PathBuf,
    gpus: Vec<GpuSpec>,
    contexts: Mutex<HashMap<u64, CtxMeta>>,
    /// Signalled whenever a context leaves the table.
    removed: Condvar,
    /// Driver fds without a context (`OpenDriver`): id -> (pid, inode of the worker's end).
    drivers: Mutex<HashMap<u64, (Pid, u64)>>,
    next_ctx: AtomicU64,
    hangs: Hangs,
    /// The last [`COPIES_KEPT`] device-memory copies, oldest first.
    copies: Mutex<std::collections::VecDeque<MemCopy>>,
}

/// How many copies the daemon remembers (bounded: a long-lived daemon keeps no history).
pub const COPIES_KEPT: usize = 256;

/// A process's restore thread, found through its listening socket.
#[derive(Debug)]
struct RestoreThread {
    addr: SocketAddr,
    tid: Pid,
}

/// Injected hangs: calls that rules match are held until released or their caller hangs up.
#[derive(Debug, Default)]
struct Hangs {
    state: Mutex<HangState>,
    changed: Condvar,
}

#[derive(Debug, Default)]
struct HangState {
    rules: Vec<HangRule>,
    /// Calls held now.
    held: u32,
    /// Bumped by every release: a held call goes on once it changes.
    generation: u64,
}

/// A pid as its thread group (a thread id stands for its process).
fn group_of(pid: Pid) -> Pid {
    cryo_proc::tgid(pid).ok().flatten().unwrap_or(pid)
}

impl Hangs {
    fn state(&self) -> MutexGuard<'_, HangState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn add(&self, mut rule: HangRule) {
        rule.pid = rule.pid.map(group_of);
        if rule.times != Some(0) {
            self.state().rules.push(rule);
        }
    }

    /// Releases every held call and clears the rules; returns how many calls were held.
    fn release(&self) -> u32 {
        let mut st = self.state();
        st.rules.clear();
        st.generation += 1;
        self.changed.notify_all();
        st.held
    }

    fn held(&self) -> u32 {
        self.state().held
    }

    /// Holds a call of `kind` on `pid` while a rule matches it, until released. `false` when the
    /// caller hung up meanwhile (the call is then dropped: it never reached the driver).
    fn hold(&self, kind: CallKind, pid: Option<Pid>, caller: &UnixStream) -> bool {
        let mut st = self.state();
        if st.rules.is_empty() {
            return true;
        }
        let pid = pid.map(group_of);
        let Some(i) = st
            .rules
            .iter()
            .position(|r| r.call.covers(kind) && (r.pid.is_none() || r.pid == pid))
        else {
            return true;
        };
        if let Some(n) = st.rules[i].times.as_mut() {
            *n -= 1;
            if *n == 0 {
                st.rules.remove(i);
            }
        }
        let generation = st.generation;
        st.held += 1;
        tracing::info!(?kind, ?pid, "call held by an injected hang");
        let went_on = loop {
            // A caller that gave up is dropped even if a release came meanwhile.
            if crate::sys::peer_closed(caller) {
                break false;
            }
            if st.generation != generation {
                break true;
            }
            st = self
                .changed
                .wait_timeout(st, Duration::from_millis(50))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        };
        st.held -= 1;
        tracing::info!(?kind, ?pid, went_on, "held call ends");
        went_on
    }
}

/// Runs the daemon until the process is killed.
pub fn run(cfg: DaemonConfig) -> Result<(), DaemonError> {
    let (daemon, listener, socket) = start(cfg)?;
    tracing::info!(socket = %socket.display(), gpus = daemon.gpus.len(), "simulated GPU driver listening");
    let acceptors = Arc::new(Acceptors {
        listener,
        daemon,
        idle: Mutex::new(0),
        unidentified: AtomicUsize::new(0),
    });
    // The daemon's own thread is an acceptor that never ends.
    acceptors.accept_and_serve(true);
    Ok(())
}

/// How many acceptors may wait in `accept` at once; one more ends after its connection.
const ACCEPTORS_KEPT: usize = 4;

/// How many accepted connections may wait for their first message (what says what they are) at
/// once, each on a thread of its own; one more is refused at once with an error reply. Contexts
/// and calls under way are not counted: a worker's context is as long-lived as its fd.
pub const MAX_UNIDENTIFIED: usize = 64;

/// How long a connection may take to send its first message before the daemon closes it (a
/// client sends it as soon as it connected).
pub const FIRST_MESSAGE_TIMEOUT: Duration = Duration::from_secs(5);

/// The threads that serve connections (see the module docs): each waits in `accept` on the one
/// listener and serves what it accepted itself.
struct Acceptors {
    listener: UnixListener,
    daemon: Arc<Daemon>,
    /// Acceptors waiting in `accept`.
    idle: Mutex<usize>,
    /// Connections accepted whose first message has not come yet.
    unidentified: AtomicUsize,
}

/// One of [`Acceptors::unidentified`], given back when dropped (the first message came, or the
/// connection ended).
struct Unidentified<'a>(&'a AtomicUsize);

impl Drop for Unidentified<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Acceptors {
    fn idle(&self) -> MutexGuard<'_, usize> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// An acceptor's life: accept a connection, make sure another acceptor waits (the one that
    /// serves a context serves it for the context's life), serve it, and wait again, until
    /// [`ACCEPTORS_KEPT`] others wait (unless it is `lasting`).
    fn accept_and_serve(self: &Arc<Self>, lasting: bool) {
        loop {
            *self.idle() += 1;
            let conn = self.listener.accept();
            let none_waits = {
                let mut idle = self.idle();
                *idle -= 1;
                *idle == 0
            };
            let conn = match conn {
                Ok((s, _)) => match self.unidentified(s) {
                    Some(c) => Ok(c),
                    // Refused at once: this thread accepts again, no other is needed.
                    None => continue,
                },
                Err(e) => Err(e),
            };
            if none_waits {
                let next = Arc::clone(self);
                if let Err(err) = std::thread::Builder::new()
                    .name("sim-acceptor".into())
                    .spawn(move || next.accept_and_serve(false))
                {
                    // This thread accepts again after its connection: late, not lost.
                    tracing::warn!(%err, "cannot start another acceptor");
                }
            }
            match conn {
                Ok((s, slot)) => self.daemon.serve(s, slot),
                Err(err) => tracing::warn!(%err, "accept failed"),
            }
            if !lasting && *self.idle() >= ACCEPTORS_KEPT {
                return;
            }
        }
    }
}

impl Acceptors {
    /// `s` counted among the connections not identified yet, or refused (an error reply, then
    /// closed) when [`MAX_UNIDENTIFIED`] of them wait already: a flood of connections that never
    /// say what they are does not take a thread each.
    fn unidentified(&self, mut s: UnixStream) -> Option<(UnixStream, Unidentified<'_>)> {
        let waiting = self.unidentified.fetch_add(1, Ordering::Relaxed);
        let slot = Unidentified(&self.unidentified);
        if waiting < MAX_UNIDENTIFIED {
            return Some((s, slot));
        }
        tracing::warn!(
            waiting,
            "too many connections that have not said what they are: refusing one"
        );
        let _ = proto::send(
            &mut s,
            &Reply::Error(format!(
                "the simulated driver is waiting for the first message of {MAX_UNIDENTIFIED} connections already; try again"
            )),
        );
        None
    }
}

fn start(cfg: DaemonConfig) -> Result<(Arc<Daemon>, UnixListener, PathBuf), DaemonError> {
    if cfg.gpus == 0 || cfg.gpus > 64 {
        return Err(DaemonError::GpuCount(cfg.gpus));
    }
    if cfg.gpu_uuids.len() > cfg.gpus as usize {
        return Err(DaemonError::Uuids {
            gpus: cfg.gpus,
            reason: format!("{} UUIDs given", cfg.gpu_uuids.len()),
        });
    }
    std::fs::create_dir_all(&cfg.dir).map_err(|source| DaemonError::Dir {
        path: cfg.dir.display().to_string(),
        source,
    })?;
    let id = crate::daemon_id(&cfg.dir);
    let mut gpus = Vec::new();
    for i in 0..cfg.gpus {
        let uuid = cfg
            .gpu_uuids
            .get(i as usize)
            .cloned()
            .unwrap_or_else(|| derived_uuid(&id, i));
        if gpus.iter().any(|g: &GpuSpec| g.uuid == uuid) {
            return Err(DaemonError::Uuids {
                gpus: cfg.gpus,
                reason: format!("{uuid} given twice"),
            });
        }
        gpus.push(GpuSpec {
            uuid,
            name: cfg.gpu_name.clone(),
            total: cfg.gpu_memory,
            vram: Vram::new(cfg.gpu_memory),
        });
    }
    let socket = crate::socket_path(&cfg.dir);
    let sock_str = socket.display().to_string();
    if UnixStream::connect(&socket).is_ok() {
        return Err(DaemonError::AlreadyRunning { socket: sock_str });
    }
    // Nothing answers: a stale socket of a dead daemon.
    let _ = std::fs::remove_file(&socket);
    let listener = UnixListener::bind(&socket).map_err(|source| DaemonError::Listen {
        socket: sock_str,
        source,
    })?;
    let daemon = Arc::new(Daemon {
        id,
        ledger: crate::ledger_path(&cfg.dir),
        gpus,
        contexts: Mutex::new(HashMap::new()),
        removed: Condvar::new(),
        drivers: Mutex::new(HashMap::new()),
        next_ctx: AtomicU64::new(1),
        hangs: Hangs::default(),
        copies: Mutex::new(std::collections::VecDeque::new()),
    });
    Ok((daemon, listener, socket))
}

/// The answer for a process whose restore thread hung up because it is dying: what a call on it
/// will answer once it is dead. `None` when it stays alive.
fn dead_answer(pid: Pid) -> Option<Reply> {
    // A dying process closes its files before it turns into a zombie: give it a moment.
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match cryo_proc::liveness(pid) {
            Liveness::Gone => return Some(Reply::Cuda(CuResult::INVALID_VALUE)),
            Liveness::Zombie => return Some(Reply::Cuda(CuResult::NOT_INITIALIZED)),
            Liveness::Alive if Instant::now() >= deadline => return None,
            Liveness::Alive => std::thread::sleep(Duration::from_millis(5)),
        }
    }
}

/// How `pid` died, read from its zombie's stat (waiting briefly for it to become one: the kernel
/// closes a dying process's files before it turns into a zombie).
fn death(pid: Pid) -> String {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match cryo_proc::stat(pid) {
            Err(_) => return "unknown".to_string(),
            Ok(st) => {
                if let (Some(status), 'Z' | 'X') = (st.exit_code, st.state) {
                    return cryo_proc::describe_wait_status(status);
                }
            }
        }
        if Instant::now() >= deadline {
            return "closed its context while alive".to_string();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// A stable UUID per (directory, index), so restarts of a daemon keep their GPUs.
fn derived_uuid(id: &str, index: u32) -> GpuUuid {
    let h = u64::from_str_radix(id, 16).unwrap_or(0);
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&h.to_be_bytes());
    b[8..].copy_from_slice(&(0x5157_0000_0000_0000u64 | u64::from(index)).to_be_bytes());
    GpuUuid::from_bytes(b)
}

impl Daemon {
    fn table(&self) -> MutexGuard<'_, HashMap<u64, CtxMeta>> {
        // A panic elsewhere must not take NVML down with it: the table stays consistent because
        // every change is one insert or remove.
        self.contexts.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn serve(&self, mut s: UnixStream, first: Unidentified<'_>) {
        // The first message within its timeout; a connection silent past it is closed.
        let _ = s.set_read_timeout(Some(FIRST_MESSAGE_TIMEOUT));
        let req: Option<Request> = match proto::recv(&mut s) {
            Ok(r) => r,
            Err(err)
                if matches!(
                    err.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                tracing::debug!(
                    "a connection sent nothing within {FIRST_MESSAGE_TIMEOUT:?}: closed"
                );
                None
            }
            Err(err) => {
                let _ = proto::send(&mut s, &Reply::Error(format!("bad request: {err}")));
                None
            }
        };
        drop(first);
        let Some(req) = req else { return };
        if let Err(err) = s.set_read_timeout(None) {
            tracing::warn!(%err, "cannot clear a connection's first-message timeout");
            return;
        }
        if let Some((kind, pid)) = CallKind::of(&req) {
            if !self.hangs.hold(kind, pid, &s) {
                return;
            }
        }
        let reply = match req {
            Request::OpenContext(open) => return self.context(s, open),
            Request::OpenDriver { inode } => return self.driver_open(s, inode),
            Request::Hello => Reply::Hello {
                driver_version: format!("cryo-sim {}", env!("CARGO_PKG_VERSION")),
                daemon_id: self.id.clone(),
            },
            Request::Call { pid, call } => match self.api_call(&s, pid, call) {
                Some(r) => r,
                None => return,
            },
            Request::Inject { pid, fault } => {
                let answer = match self.restore_thread(pid) {
                    Ok(t) => self.relay(&s, pid, &t, WorkerOp::Inject(fault)),
                    Err(reply) => Some(reply),
                };
                match answer {
                    Some(r) => r,
                    None => return,
                }
            }
            Request::Hang(rule) => {
                tracing::info!(?rule, "injected hang");
                self.hangs.add(rule);
                Reply::Injected
            }
            Request::Release => Reply::Held(self.hangs.release()),
            Request::Held => Reply::Held(self.hangs.held()),
            Request::Copies => Reply::Copies(self.copies().iter().copied().collect()),
            Request::Gpus => {
                self.settle();
                Reply::Gpus(self.gpus())
            }
            Request::Processes => {
                self.settle();
                Reply::Processes(self.processes())
            }
            Request::DriverFds { pid } => self.driver_fds(pid),
            Request::CudaProcesses => self.cuda_processes(),
        };
        if let Err(err) = proto::send(&mut s, &reply) {
            tracing::debug!(%err, "client went away before the answer");
        }
    }

    /// Waits until every context whose worker end is closed has been torn down by its thread
    /// (ledger written, table entry removed). Bounded: a thread that never gets there (it cannot)
    /// does not hang the query.
    fn copies(&self) -> MutexGuard<'_, std::collections::VecDeque<MemCopy>> {
        // A panic while holding the lock leaves a list with one copy more or less.
        self.copies.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Remembers a copy of `meta`'s device memory that started at `start` and ends now.
    fn copied(&self, meta: &CtxMeta, kind: CopyKind, bytes: u64, start: Moment) {
        let mut copies = self.copies();
        if copies.len() == COPIES_KEPT {
            copies.pop_front();
        }
        copies.push_back(MemCopy {
            pid: meta.pid,
            kind,
            bytes,
            start,
            end: Moment::now(),
        });
    }

    fn settle(&self) {
        let deadline = Instant::now() + Duration::from_secs(5);
        let mut table = self.table();
        loop {
            let closing = table
                .values()
                .any(|c| c.sock.as_deref().is_some_and(crate::sys::peer_closed));
            let left = deadline.saturating_duration_since(Instant::now());
            if !closing || left.is_zero() {
                return;
            }
            table = self
                .removed
                .wait_timeout(table, left.min(Duration::from_millis(50)))
                .map(|(t, _)| t)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }

    /// Removes a context from the table and wakes whoever settles.
    fn remove(&self, id: u64) {
        self.table().remove(&id);
        self.removed.notify_all();
    }

    fn gpus(&self) -> Vec<GpuInfo> {
        let table = self.table();
        self.gpus
            .iter()
            .enumerate()
            .map(|(i, g)| {
                let used: u64 = table.values().filter(|c| c.gpu == i).map(|c| c.bytes).sum();
                GpuInfo {
                    index: i as u32,
                    uuid: g.uuid.clone(),
                    name: g.name.clone(),
                    memory_total: g.total,
                    memory_free: g.total.saturating_sub(used),
                }
            })
            .collect()
    }

    fn processes(&self) -> Vec<GpuProcess> {
        let mut out: Vec<GpuProcess> = self
            .table()
            .values()
            .map(|c| GpuProcess {
                pid: c.pid,
                gpu_index: c.gpu as u32,
                gpu_uuid: self.gpus[c.gpu].uuid.clone(),
                used_memory: c.bytes,
            })
            .collect();
        out.sort_by_key(|p| (p.pid, p.gpu_index));
        out
    }

    fn driver_fds(&self, pid: Pid) -> Reply {
        let fds = match cryo_proc::fds(pid) {
            Ok(f) => f,
            Err(err) => return Reply::Error(format!("cannot read the fd table: {err}")),
        };
        let mut contexts: HashSet<u64> = self.table().values().map(|c| c.inode).collect();
        contexts.extend(self.drivers().values().map(|(_, inode)| *inode));
        Reply::Fds(cryo_proc::driver_fds(
            &fds,
            DriverFiles::SimContexts(&contexts),
        ))
    }

    /// Every process NVML lists or that holds one of this daemon's driver files.
    fn cuda_processes(&self) -> Reply {
        let mut contexts: HashSet<u64> = self.table().values().map(|c| c.inode).collect();
        contexts.extend(self.drivers().values().map(|(_, inode)| *inode));
        let mut pids = match cryo_proc::driver_file_holders(DriverFiles::SimContexts(&contexts)) {
            Ok(p) => p,
            Err(err) => return Reply::Error(format!("cannot list the processes: {err}")),
        };
        pids.extend(self.processes().into_iter().map(|p| p.pid));
        pids.sort_unstable();
        pids.dedup();
        Reply::Pids(pids)
    }

    /// `pid`'s restore thread, or what the driver answers when there is none: a pid that does
    /// not exist is `CUDA_ERROR_INVALID_VALUE`; a process without one (never initialised CUDA, a
    /// zombie whose files are closed, a child that inherited its parent's socket across `fork`)
    /// is `CUDA_ERROR_NOT_INITIALIZED`.
    fn restore_thread(&self, pid: Pid) -> Result<RestoreThread, Reply> {
        let gone = || cryo_proc::liveness(pid) == Liveness::Gone;
        if gone() {
            return Err(Reply::Cuda(CuResult::INVALID_VALUE));
        }
        let fds = match cryo_proc::fds(pid) {
            Ok(f) => f,
            Err(_) if gone() => return Err(Reply::Cuda(CuResult::INVALID_VALUE)),
            Err(err) => return Err(Reply::Error(format!("cannot read the fd table: {err}"))),
        };
        let sockets: Vec<u64> = fds
            .iter()
            .filter_map(|f| match f.target {
                FdTarget::Socket(inode) => Some(inode),
                _ => None,
            })
            .collect();
        let Some(name) = self.restore_socket(pid, &sockets)? else {
            return Err(Reply::Cuda(CuResult::NOT_INITIALIZED));
        };
        let Some(ns_tid) = proto::restore_tid_of(&name) else {
            return Err(Reply::Error(format!(
                "malformed restore-thread socket name {name}"
            )));
        };
        // The name carries the thread's id as its own pid namespace knows it; the driver answers
        // in the caller's (cryo's), as NVML's pids are.
        let tid = match cryo_proc::thread_named(pid, ns_tid) {
            Ok(Some(t)) => t,
            Ok(None) => return Err(Reply::Cuda(CuResult::NOT_INITIALIZED)),
            Err(_) if gone() => return Err(Reply::Cuda(CuResult::INVALID_VALUE)),
            Err(err) => return Err(Reply::Error(err.to_string())),
        };
        // The thread must belong to this process: a child forked without exec holds its
        // parent's socket but not its CUDA state.
        let group = |p| cryo_proc::tgid(p).ok().flatten();
        match (group(pid), group(tid)) {
            (Some(a), Some(b)) if a == b => {}
            (None, _) => return Err(Reply::Cuda(CuResult::INVALID_VALUE)),
            _ => return Err(Reply::Cuda(CuResult::NOT_INITIALIZED)),
        }
        let addr = SocketAddr::from_abstract_name(name.trim_start_matches('@').as_bytes())
            .map_err(|err| Reply::Error(format!("bad restore-thread socket name {name}: {err}")))?;
        Ok(RestoreThread { addr, tid })
    }

    /// The restore-thread socket name among the socket inodes `sockets` of process `pid`, `None`
    /// when none of them is one. The process's own view of its network namespace is read
    /// (`/proc/PID/net/unix`): a worker in a namespace of its own (a container, a standby restored
    /// into fresh namespaces) listens where only that view shows it. It is read in pieces and the kernel walks its
    /// table by position: a socket closed elsewhere while it is read (another process of the
    /// tree dying) shifts the rest and one entry can be skipped. A miss is therefore read again
    /// a few times before it counts: a real driver never answers "not initialised" for a
    /// process it holds state of, and neither may the simulated one.
    fn restore_socket(&self, pid: Pid, sockets: &[u64]) -> Result<Option<String>, Reply> {
        const READS: usize = 4;
        if sockets.is_empty() {
            return Ok(None);
        }
        for _ in 0..READS {
            let listening =
                match cryo_proc::unix_listeners_of(pid, &format!("@cryo-sim/{}/", self.id)) {
                    Ok(l) => l,
                    Err(_) if cryo_proc::liveness(pid) == Liveness::Gone => {
                        return Err(Reply::Cuda(CuResult::INVALID_VALUE))
                    }
                    Err(err) => return Err(Reply::Error(err.to_string())),
                };
            if let Some(name) = sockets.iter().find_map(|inode| listening.get(inode)) {
                return Ok(Some(name.clone()));
            }
        }
        Ok(None)
    }

    /// A checkpoint-API call. `None`: the caller hung up before the answer.
    fn api_call(&self, caller: &UnixStream, pid: Pid, call: ApiCall) -> Option<Reply> {
        let thread = match self.restore_thread(pid) {
            Ok(t) => t,
            Err(reply) => return Some(reply),
        };
        if call == ApiCall::RestoreTid {
            // The driver knows its thread without asking it: this works on a frozen process.
            return Some(Reply::Api(ApiDone::Tid(thread.tid)));
        }
        self.relay(caller, pid, &thread, WorkerOp::Api(call))
    }

    /// Has `pid`'s restore thread carry out `op`. Waits as long as it takes: a thread that cannot
    /// run (the process is stopped, frozen, or traced and held) leaves the call unanswered until
    /// the caller gives up (`None`; the request stays queued and the thread carries it out when
    /// it runs again) or the process dies (answered as a call on the dead process is).
    fn relay(
        &self,
        caller: &UnixStream,
        pid: Pid,
        thread: &RestoreThread,
        op: WorkerOp,
    ) -> Option<Reply> {
        // In the process's network namespace, where its abstract name lives.
        let addr = &thread.addr;
        let mut s = match cryo_proc::in_net_namespace_of(pid, || UnixStream::connect_addr(addr)) {
            Ok(s) => s,
            // Closed between the lookup and now: the process is going away.
            Err(_) => return Some(Reply::Cuda(CuResult::NOT_INITIALIZED)),
        };
        if let Err(err) = proto::send(&mut s, &WorkerRequest { op }) {
            return Some(Reply::Error(format!(
                "cannot reach the restore thread of pid {pid}: {err}"
            )));
        }
        tracing::debug!(pid, "call handed to the restore thread");
        loop {
            match crate::sys::readable(&s, Duration::from_millis(50)) {
                Ok(true) => break,
                Ok(false) => {}
                Err(err) => {
                    return Some(Reply::Error(format!(
                        "cannot wait for the restore thread of pid {pid}: {err}"
                    )))
                }
            }
            if cryo_proc::liveness(pid) != Liveness::Alive {
                if let Some(answer) = dead_answer(pid) {
                    return Some(answer);
                }
            }
            if crate::sys::peer_closed(caller) {
                tracing::info!(
                    pid,
                    "caller gave up on a call its restore thread has not taken yet"
                );
                return None;
            }
        }
        match proto::recv_some::<Reply>(&mut s) {
            Ok(r) => {
                // Answer only once the restore thread closed its end: a caller that dumps the
                // process with CRIU next must not find a connected socket to us in it.
                let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
                let _ = io::Read::read(&mut s, &mut [0u8; 1]);
                Some(r)
            }
            Err(err) => Some(dead_answer(pid).unwrap_or_else(|| {
                Reply::Error(format!("restore thread of pid {pid} failed: {err}"))
            })),
        }
    }

    /// A driver fd without a context (`cuInit`'s `/dev/nvidiactl`), open until its last
    /// duplicate closes.
    fn driver_open(&self, mut s: UnixStream, inode: u64) {
        let pid = match nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        {
            Ok(c) => c.pid(),
            Err(err) => {
                let _ = proto::send(&mut s, &Reply::Error(format!("no peer credentials: {err}")));
                return;
            }
        };
        let id = self.next_ctx.fetch_add(1, Ordering::Relaxed);
        self.drivers().insert(id, (pid, inode));
        tracing::debug!(pid, "driver opened without a context");
        if proto::send(&mut s, &Reply::DriverOpened).is_ok() {
            // Nothing is asked on such an fd; wait for the last duplicate to close.
            while let Ok(Some(_)) = proto::recv::<CtxRequest>(&mut s) {
                if proto::send(&mut s, &CtxReply::Error("no context on this fd".into())).is_err() {
                    break;
                }
            }
        }
        self.drivers().remove(&id);
        tracing::debug!(pid, "driver fd closed");
    }

    fn drivers(&self) -> MutexGuard<'_, HashMap<u64, (Pid, u64)>> {
        self.drivers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn resolve(&self, sel: &GpuSel) -> Option<usize> {
        match sel {
            GpuSel::Index(i) => Some(*i as usize).filter(|i| *i < self.gpus.len()),
            GpuSel::Uuid(u) => self.gpus.iter().position(|g| &g.uuid == u),
        }
    }

    /// Serves one context from open to teardown.
    fn context(&self, mut s: UnixStream, open: OpenContext) {
        let pid = match nix::sys::socket::getsockopt(&s, nix::sys::socket::sockopt::PeerCredentials)
        {
            Ok(c) => c.pid(),
            Err(err) => {
                let _ = proto::send(&mut s, &Reply::Error(format!("no peer credentials: {err}")));
                return;
            }
        };
        let Some(gpu) = self.resolve(&open.gpu) else {
            let _ = proto::send(&mut s, &Reply::Cuda(CuResult::INVALID_VALUE));
            return;
        };
        let restored = open.init == Init::Upload;
        let ctx_id = self.next_ctx.fetch_add(1, Ordering::Relaxed);
        let sock = s.try_clone().ok().map(Arc::new);
        {
            let mut table = self.table();
            let used: u64 = table
                .values()
                .filter(|c| c.gpu == gpu)
                .map(|c| c.bytes)
                .sum();
            if used.saturating_add(open.bytes) > self.gpus[gpu].total {
                drop(table);
                tracing::info!(
                    pid,
                    gpu,
                    bytes = open.bytes,
                    used,
                    "context refused: out of device memory"
                );
                let _ = proto::send(&mut s, &Reply::Cuda(CuResult::OUT_OF_MEMORY));
                return;
            }
            table.insert(
                ctx_id,
                CtxMeta {
                    id: ctx_id,
                    pid,
                    gpu,
                    bytes: open.bytes,
                    restored,
                    inode: open.inode,
                    sock,
                },
            );
        }
        let meta = CtxMeta {
            id: ctx_id,
            pid,
            gpu,
            bytes: open.bytes,
            restored,
            inode: open.inode,
            sock: None,
        };
        tracing::debug!(pid, gpu, bytes = open.bytes, restored, "context opened");
        let released = self.context_loop(&mut s, &open, &meta);
        // The wedge is in the ledger before the context leaves the listing: whoever sees it
        // unlisted (or settles a query on it) can read the ledger as final for this death.
        if !released && meta.restored {
            self.wedge(&meta);
        } else {
            tracing::debug!(pid, released, "context closed");
        }
        self.remove(ctx_id);
    }

    /// Returns whether the context was released by a checkpoint before its fd closed.
    fn context_loop(&self, s: &mut UnixStream, open: &OpenContext, meta: &CtxMeta) -> bool {
        let Ok(len) = usize::try_from(open.bytes) else {
            return false;
        };
        let vram = &self.gpus[meta.gpu].vram;
        let mut mem = vram.take(len);
        let released = self.serve_context(s, open, meta, &mut mem);
        vram.give(mem);
        released
    }

    /// [`Self::context_loop`] on its device memory `mem` (contents unspecified: written whole
    /// before anything reads it).
    fn serve_context(
        &self,
        s: &mut UnixStream,
        open: &OpenContext,
        meta: &CtxMeta,
        mem: &mut Vec<u8>,
    ) -> bool {
        let mut r = match s.try_clone() {
            Ok(c) => BufReader::with_capacity(1 << 20, c),
            Err(err) => {
                tracing::warn!(%err, "cannot clone a context socket");
                return false;
            }
        };
        crate::sys::grow_socket_buffers(s);
        match open.init {
            Init::Seed(seed) => memory::fill(mem, seed),
            Init::Upload => {
                if proto::send(
                    s,
                    &Reply::Opened {
                        gpu_index: meta.gpu as u32,
                        gpu_uuid: self.gpus[meta.gpu].uuid.clone(),
                    },
                )
                .is_err()
                {
                    return false;
                }
                let start = Moment::now();
                if io::Read::read_exact(&mut r, mem).is_err() {
                    return false;
                }
                self.copied(meta, CopyKind::Restore, mem.len() as u64, start);
                if proto::send(s, &CtxReply::Uploaded).is_err() {
                    return false;
                }
            }
        }
        if open.init != Init::Upload
            && proto::send(
                s,
                &Reply::Opened {
                    gpu_index: meta.gpu as u32,
                    gpu_uuid: self.gpus[meta.gpu].uuid.clone(),
                },
            )
            .is_err()
        {
            return false;
        }
        let mut released = false;
        loop {
            let req: CtxRequest = match proto::recv(&mut r) {
                Ok(Some(q)) => q,
                Ok(None) => return released,
                Err(err) => {
                    tracing::debug!(pid = meta.pid, %err, "context socket failed");
                    return released;
                }
            };
            let sent = match (req, released) {
                (_, true) => {
                    proto::send(s, &CtxReply::Error("context released by checkpoint".into()))
                }
                (CtxRequest::Read(words), false) => proto::send(
                    s,
                    &CtxReply::Words(words.iter().map(|w| memory::read_word(mem, *w)).collect()),
                ),
                (CtxRequest::Hash, false) => proto::send(s, &CtxReply::Hash(memory::hash(mem))),
                (CtxRequest::Download, false) => {
                    let start = Moment::now();
                    let sent = proto::send(s, &CtxReply::Download(mem.len() as u64))
                        .and_then(|()| s.write_all(mem));
                    if sent.is_ok() {
                        // Copied once the worker has read it all: the last socket buffer's
                        // worth is still on its way when the write returns.
                        let written = Instant::now();
                        crate::sys::wait_read(s, Duration::from_secs(5));
                        tracing::debug!(
                            pid = meta.pid,
                            tail_ms = written.elapsed().as_secs_f64() * 1e3,
                            "checkpoint copy: the worker read its last bytes"
                        );
                        self.copied(meta, CopyKind::Checkpoint, mem.len() as u64, start);
                    }
                    sent
                }
                (CtxRequest::Release, false) => {
                    // Checkpoint frees device memory now, even while duplicates of the fd live.
                    self.gpus[meta.gpu].vram.give(std::mem::take(mem));
                    released = true;
                    self.remove(meta.id);
                    proto::send(s, &CtxReply::Released)
                }
                (CtxRequest::Resize { bytes, seed }, false) => {
                    match self.resize(meta, mem, bytes, seed) {
                        Ok(()) => proto::send(s, &CtxReply::Done),
                        Err(code) => proto::send(s, &CtxReply::Cuda(code)),
                    }
                }
                (CtxRequest::Write { offset, len }, false) => {
                    let range = usize::try_from(offset)
                        .ok()
                        .zip(usize::try_from(len).ok())
                        .and_then(|(o, l)| Some(o..o.checked_add(l)?))
                        .filter(|range| range.end <= mem.len());
                    let Some(range) = range else {
                        // The bytes that follow cannot be placed: the stream is lost.
                        tracing::warn!(pid = meta.pid, offset, len, "write outside device memory");
                        return released;
                    };
                    match io::Read::read_exact(&mut r, &mut mem[range]) {
                        Ok(()) => proto::send(s, &CtxReply::Uploaded),
                        Err(err) => Err(err),
                    }
                }
                (CtxRequest::Fill { len, seed }, false) => match usize::try_from(len) {
                    Ok(n) if n <= mem.len() => {
                        memory::fill(&mut mem[..n], seed);
                        proto::send(s, &CtxReply::Done)
                    }
                    _ => proto::send(
                        s,
                        &CtxReply::Error(format!("fill of {len} bytes: outside device memory")),
                    ),
                },
            };
            if let Err(err) = sent {
                tracing::debug!(pid = meta.pid, %err, "context socket failed");
                return released;
            }
        }
    }

    /// Resizes a context's device memory (an engine allocating or freeing at its end), within
    /// the GPU's free memory.
    fn resize(
        &self,
        meta: &CtxMeta,
        mem: &mut Vec<u8>,
        bytes: u64,
        seed: Option<u64>,
    ) -> Result<(), CuResult> {
        let new_len = usize::try_from(bytes).map_err(|_| CuResult::OUT_OF_MEMORY)?;
        let old_len = mem.len();
        {
            let mut table = self.table();
            let used: u64 = table
                .values()
                .filter(|c| c.gpu == meta.gpu && c.id != meta.id)
                .map(|c| c.bytes)
                .sum();
            if new_len > old_len && used.saturating_add(bytes) > self.gpus[meta.gpu].total {
                tracing::info!(
                    pid = meta.pid,
                    bytes,
                    used,
                    "allocation refused: out of device memory"
                );
                return Err(CuResult::OUT_OF_MEMORY);
            }
            if let Some(c) = table.get_mut(&meta.id) {
                c.bytes = bytes;
            }
        }
        if new_len <= old_len {
            mem.truncate(new_len);
            mem.shrink_to_fit();
            return Ok(());
        }
        // A fresh allocation is zeros (the kernel's, faulted in lazily), as a cudaMalloc is
        // whatever the pool held: no copy of what was there.
        mem.resize(new_len, 0);
        if let Some(seed) = seed {
            memory::fill_at(&mut mem[old_len..], seed, (old_len / 8) as u64);
        }
        Ok(())
    }

    fn wedge(&self, meta: &CtxMeta) {
        let death = death(meta.pid);
        let time = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_else(|_| "unknown".to_string());
        let w = Wedge {
            time,
            pid: meta.pid,
            gpu_index: meta.gpu as u32,
            gpu_uuid: self.gpus[meta.gpu].uuid.clone(),
            // What it held when torn down (an engine may have resized it since it opened).
            used_memory: self.table().get(&meta.id).map_or(meta.bytes, |c| c.bytes),
            death,
            restored: true,
        };
        tracing::warn!(pid = w.pid, gpu = %w.gpu_uuid, death = %w.death, "WEDGE: a live restored context was torn down");
        if let Err(err) = ledger::append(&self.ledger, &w) {
            tracing::error!(%err, "cannot record a wedge");
        }
    }
}
