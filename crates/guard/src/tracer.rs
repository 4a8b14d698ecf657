//! The tracer: one dedicated thread owns every ptrace relationship of the guard.
//!
//! # Design
//! ptrace requests must come from the thread that attached, so one thread ([`Tracer::spawn`])
//! does all of them: it blocks in `waitpid(-1, __WALL | __WNOTHREAD)` (its own tracees only,
//! never children other threads spawned) and takes commands (attach, detach, resume a held
//! thread) from a channel. A queued command interrupts the `waitpid` with a real-time signal
//! ([`crate::sys::kick_signal`]) whose handler does nothing and lacks `SA_RESTART`; the sender
//! re-sends the signal until the command is answered, which closes the window where the signal
//! lands just before the tracer enters `waitpid`.
//!
//! Each thread of a target is seized with `PTRACE_O_TRACEEXIT | PTRACE_O_TRACEEXEC |
//! PTRACE_O_TRACECLONE` (no `PTRACE_O_EXITKILL`: a dying guard leaves its workers running). New threads are attached by
//! the kernel (clone events). Stops are handled as follows:
//! - signal-delivery-stop of a non-fatal signal: continued at once with the same signal;
//! - of a fatal one ([`crate::signals::is_fatal`]), or of SIGTERM, SIGINT or SIGHUP that the
//!   process handles ([`crate::signals::is_graceful_end`]): the thread is held,
//!   [`Policy::on_fatal_signal`] runs on its own thread, then the signal is delivered or
//!   discarded;
//! - group-stop (`PTRACE_EVENT_STOP` with a stop signal): `PTRACE_LISTEN`, so the thread stays
//!   stopped as it would untraced while the tracer hears of `SIGCONT`;
//! - exit stop of the thread-group leader: the leader is held, the policy names fds, their
//!   duplicates are taken through the pidfd and handed to [`Policy::on_exit_stop`], then the leader
//!   exits. The leader's `files` stay intact while it is held, whatever the other threads do.
//!   Unless another thread of the process is blocked in `execve` (`/proc/PID/task/TID/syscall`):
//!   then the exec killed the leader, the process lives on, and [`Policy::before_exec`] runs
//!   instead (the fd table is still intact; the exec's close-on-exec comes after);
//! - exec stop (`PTRACE_EVENT_EXEC`, after a successful `execve`, from any thread: the kernel
//!   has given the execing thread the leader's tid, every other thread is gone, the
//!   close-on-exec fds are closed): the process is held for [`Policy::on_exec`], then continued
//!   or detached as it says.
//!
//! A held thread has a token; a resume carrying an old token (the thread was SIGKILLed while
//! held and now sits at its exit stop) is ignored.
//!
//! # Limitations
//! - A target that is a child of the guard process is reaped by the tracer thread when it dies
//!   (the kernel gives a tracer in the parent's thread group the only wait), so `Child::wait` then
//!   fails. The guard traces restored workers, which are never its children.
//! - Pinning happens at the leader's exit stop. A leader that left early with `pthread_exit`
//!   (its `files` already released) yields nothing to pin when the rest of the process dies later.
//! - Threads a target creates with `clone` but without `CLONE_THREAD` (not `fork`, which is not
//!   traced) are detached at once.
//! - When the guard dies the kernel detaches every tracee; a thread held for the policy at that
//!   moment loses its signal (see the crate docs).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, TryRecvError};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use cryo_proc::{Pid, ProcError, ProcHandle};

use crate::policy::{AfterExec, Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee};
use crate::signals;
use crate::sys::{self, status};

/// How long a caller waits for an answer before signalling the tracer thread again.
const KICK_RETRY: Duration = Duration::from_millis(20);
/// How long the leader's exit stop looks for another thread blocked in `execve` while some
/// thread still runs.
const EXEC_PROBE: Duration = Duration::from_millis(100);
/// Rounds of "list /proc/PID/task, seize the new ones" before giving up on a thread storm.
const ATTACH_ROUNDS: usize = 64;

/// The tracer thread has stopped (shut down, or its thread could not run).
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("the guard's tracer thread has stopped")]
pub struct TracerGone;

/// Starting the tracer failed.
#[derive(Debug, thiserror::Error)]
pub enum SpawnError {
    /// installing the handler of the tracer's wake-up signal failed: {0}
    #[error("installing the handler of the tracer's wake-up signal failed: {0}")]
    Kick(io::Error),
    /// starting the tracer thread failed: {0}
    #[error("starting the tracer thread failed: {0}")]
    Thread(io::Error),
}

/// Attaching to a process failed; on every error nothing stays attached.
#[derive(Debug, thiserror::Error)]
pub enum AttachError {
    /// The process could not be opened (gone, or a thread id).
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// process {pid} is already traced by this guard
    #[error("process {pid} is already traced by this guard")]
    AlreadyTraced { pid: Pid },
    /// listing the threads of {pid} failed: {source}
    #[error("listing the threads of {pid} failed: {source}")]
    ListThreads { pid: Pid, source: ProcError },
    /// PTRACE_SEIZE of thread {tid} of {pid} failed: {source}
    #[error("PTRACE_SEIZE of thread {tid} of {pid} failed (traced by someone else, or no permission): {source}")]
    Seize {
        pid: Pid,
        tid: Pid,
        source: io::Error,
    },
    /// thread {tid} listed under {pid} belongs to process {tgid}
    #[error("thread {tid} listed under {pid} belongs to process {tgid} (pid reused)")]
    WrongProcess { pid: Pid, tid: Pid, tgid: Pid },
    /// process {pid} exited (or its pid was reused) while being attached
    #[error("process {pid} exited (or its pid was reused) while being attached")]
    Gone { pid: Pid },
    /// process {pid} kept creating threads through {ATTACH_ROUNDS} rounds of attaching
    #[error("process {pid} kept creating threads through {ATTACH_ROUNDS} rounds of attaching")]
    ThreadStorm { pid: Pid },
    #[error(transparent)]
    TracerGone(#[from] TracerGone),
}

/// Detaching from a process failed.
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    /// process {pid} is not traced by this guard
    #[error("process {pid} is not traced by this guard")]
    NotTraced { pid: Pid },
    /// thread {tid} of {pid} is held for the policy; detach after it decides
    #[error("thread {tid} of {pid} is held for the policy; detach after it decides")]
    Busy { pid: Pid, tid: Pid },
    #[error(transparent)]
    TracerGone(#[from] TracerGone),
}

/// Counters since the tracer started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TracerStats {
    /// Non-fatal signals let through at once.
    pub signals_passed: u64,
    /// Fatal signals held for the policy.
    pub fatal_held: u64,
    /// Exit stops seen (every thread).
    pub exit_stops: u64,
    /// Leader exit stops at which fds were pinned for the policy.
    pub pin_stops: u64,
    /// Successful `execve`s seen (exec stops).
    pub exec_stops: u64,
    /// Threads attached through clone events.
    pub threads_followed: u64,
    /// Group-stops answered with `PTRACE_LISTEN`.
    pub group_stops: u64,
    /// Traced processes reaped.
    pub processes_gone: u64,
}

#[derive(Debug, Default)]
struct Stats {
    signals_passed: AtomicU64,
    fatal_held: AtomicU64,
    exit_stops: AtomicU64,
    pin_stops: AtomicU64,
    exec_stops: AtomicU64,
    threads_followed: AtomicU64,
    group_stops: AtomicU64,
    processes_gone: AtomicU64,
}

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

enum Command {
    Attach {
        handle: ProcHandle,
        reply: Sender<Result<Tracee, AttachError>>,
    },
    Detach {
        pid: Pid,
        reply: Sender<Result<(), DetachError>>,
    },
    Resume {
        tid: Pid,
        token: u64,
        signal: i32,
        /// Detach the whole process instead of continuing it.
        detach: bool,
        reply: Sender<()>,
    },
    Threads {
        pid: Pid,
        reply: Sender<Option<Vec<Pid>>>,
    },
    Traced {
        reply: Sender<Vec<Pid>>,
    },
    Shutdown {
        reply: Sender<()>,
    },
}

#[derive(Clone)]
struct Mailbox {
    tx: Sender<Command>,
    tracer_tid: Pid,
}

impl Mailbox {
    fn call<T>(&self, make: impl FnOnce(Sender<T>) -> Command) -> Result<T, TracerGone> {
        let (tx, rx) = mpsc::channel();
        self.tx.send(make(tx)).map_err(|_| TracerGone)?;
        loop {
            // A failed kick means the thread is gone; the closed channel says so below.
            let _ = sys::tgkill_self(self.tracer_tid, sys::kick_signal());
            match rx.recv_timeout(KICK_RETRY) {
                Ok(v) => return Ok(v),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => return Err(TracerGone),
            }
        }
    }
}

/// The handle to the tracer thread. Dropping it detaches every tracee (waiting for held threads
/// to be decided) and stops the thread.
pub struct Tracer {
    mailbox: Mailbox,
    stats: Arc<Stats>,
    thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("tracer_tid", &self.mailbox.tracer_tid)
            .finish_non_exhaustive()
    }
}

impl Tracer {
    /// Starts the tracer thread; `policy` decides for every process it will trace.
    pub fn spawn(policy: Arc<dyn Policy>) -> Result<Self, SpawnError> {
        sys::install_kick_handler().map_err(SpawnError::Kick)?;
        let (tx, rx) = mpsc::channel();
        let (tid_tx, tid_rx) = mpsc::channel();
        let stats = Arc::new(Stats::default());
        let engine_stats = Arc::clone(&stats);
        let engine_tx = tx.clone();
        let thread = std::thread::Builder::new()
            .name("cryo-guard-tracer".into())
            .spawn(move || {
                let me = sys::gettid();
                if let Err(err) = sys::unblock_kick_signal() {
                    tracing::warn!(?err, "could not unblock the tracer's wake-up signal");
                }
                let _ = tid_tx.send(me);
                Engine {
                    policy,
                    mailbox: Mailbox {
                        tx: engine_tx,
                        tracer_tid: me,
                    },
                    stats: engine_stats,
                    procs: BTreeMap::new(),
                    threads: HashMap::new(),
                    next_token: 1,
                    shutdown: None,
                    shutting_down: false,
                    me,
                }
                .run(rx);
            })
            .map_err(SpawnError::Thread)?;
        let tracer_tid = tid_rx.recv().map_err(|_| {
            SpawnError::Thread(io::Error::other("tracer thread ended before starting"))
        })?;
        Ok(Self {
            mailbox: Mailbox { tx, tracer_tid },
            stats,
            thread: Some(thread),
        })
    }

    /// Attaches to every thread of `pid`. The pidfd is opened first, so if `pid` is reused
    /// meanwhile the attach fails instead of tracing a stranger.
    pub fn attach(&self, pid: Pid) -> Result<Tracee, AttachError> {
        self.attach_handle(ProcHandle::open(pid)?)
    }

    /// Attaches to every thread of the handle's process.
    pub fn attach_handle(&self, handle: ProcHandle) -> Result<Tracee, AttachError> {
        self.mailbox
            .call(|reply| Command::Attach { handle, reply })?
    }

    /// Detaches from every thread of `pid` (before a CRIU dump: CRIU cannot dump a traced
    /// process). Returns once no thread is traced any more. Threads in group-stop stay stopped;
    /// a signal caught at the moment of detaching is delivered.
    pub fn detach(&self, pid: Pid) -> Result<(), DetachError> {
        self.mailbox.call(|reply| Command::Detach { pid, reply })?
    }

    /// The traced processes.
    pub fn traced(&self) -> Result<Vec<Pid>, TracerGone> {
        self.mailbox.call(|reply| Command::Traced { reply })
    }

    /// The traced threads of `pid`, `None` when it is not traced.
    pub fn threads(&self, pid: Pid) -> Result<Option<Vec<Pid>>, TracerGone> {
        self.mailbox.call(|reply| Command::Threads { pid, reply })
    }

    /// The tracer thread's id (what `/proc/PID/status` shows as `TracerPid` of a tracee).
    pub fn tracer_tid(&self) -> Pid {
        self.mailbox.tracer_tid
    }

    /// Counters since start.
    pub fn stats(&self) -> TracerStats {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        TracerStats {
            signals_passed: get(&s.signals_passed),
            fatal_held: get(&s.fatal_held),
            exit_stops: get(&s.exit_stops),
            pin_stops: get(&s.pin_stops),
            exec_stops: get(&s.exec_stops),
            threads_followed: get(&s.threads_followed),
            group_stops: get(&s.group_stops),
            processes_gone: get(&s.processes_gone),
        }
    }

    /// Detaches everything (waiting for held threads to be decided) and stops the thread.
    pub fn shutdown(mut self) -> Result<(), TracerGone> {
        self.stop()
    }

    fn stop(&mut self) -> Result<(), TracerGone> {
        let Some(thread) = self.thread.take() else {
            return Ok(());
        };
        let result = self.mailbox.call(|reply| Command::Shutdown { reply });
        let _ = thread.join();
        result
    }
}

impl Drop for Tracer {
    fn drop(&mut self) {
        let _ = self.stop();
    }
}

struct Proc {
    target: Tracee,
    threads: BTreeSet<Pid>,
    /// `Some` while detaching; the inner reply is absent for detaches nobody waits on.
    detach: Option<Option<Sender<Result<(), DetachError>>>>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    Running,
    Listening,
    Held { token: u64 },
}

struct Thread {
    tgid: Pid,
    state: State,
}

struct Engine {
    policy: Arc<dyn Policy>,
    mailbox: Mailbox,
    stats: Arc<Stats>,
    procs: BTreeMap<Pid, Proc>,
    threads: HashMap<Pid, Thread>,
    next_token: u64,
    shutdown: Option<Sender<()>>,
    shutting_down: bool,
    me: Pid,
}

fn errno(e: &io::Error) -> i32 {
    e.raw_os_error().unwrap_or(0)
}

impl Engine {
    fn run(mut self, rx: Receiver<Command>) {
        loop {
            loop {
                match rx.try_recv() {
                    Ok(cmd) => self.command(cmd),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.begin_shutdown(None);
                        break;
                    }
                }
            }
            if self.shutting_down && self.procs.is_empty() {
                break;
            }
            match sys::wait_tracee() {
                Ok((tid, st)) => self.on_wait(tid, st),
                Err(e) if errno(&e) == libc::EINTR => {}
                Err(e) if errno(&e) == libc::ECHILD => {
                    self.forget_all();
                    if self.shutting_down {
                        break;
                    }
                    match rx.recv() {
                        Ok(cmd) => self.command(cmd),
                        Err(_) => self.begin_shutdown(None),
                    }
                }
                Err(err) => {
                    tracing::error!(?err, "waitpid failed in the tracer");
                    std::thread::sleep(KICK_RETRY);
                }
            }
        }
        if let Some(reply) = self.shutdown.take() {
            let _ = reply.send(());
        }
    }

    /// The kernel says nothing is traced: any record left is stale.
    fn forget_all(&mut self) {
        for (pid, proc) in std::mem::take(&mut self.procs) {
            match proc.detach {
                Some(Some(reply)) => {
                    let _ = reply.send(Ok(()));
                }
                Some(None) => {}
                None => tracing::warn!(pid, "tracer lost a process without seeing it exit"),
            }
        }
        self.threads.clear();
    }

    fn command(&mut self, cmd: Command) {
        match cmd {
            Command::Attach { handle, reply } => {
                let r = self.attach(handle);
                let _ = reply.send(r);
            }
            Command::Detach { pid, reply } => self.detach(pid, reply),
            Command::Resume {
                tid,
                token,
                signal,
                detach,
                reply,
            } => {
                self.resume_held(tid, token, signal, detach);
                let _ = reply.send(());
            }
            Command::Threads { pid, reply } => {
                let t = self
                    .procs
                    .get(&pid)
                    .map(|p| p.threads.iter().copied().collect());
                let _ = reply.send(t);
            }
            Command::Traced { reply } => {
                let _ = reply.send(
                    self.procs
                        .iter()
                        .filter(|(_, p)| p.detach.is_none())
                        .map(|(pid, _)| *pid)
                        .collect(),
                );
            }
            Command::Shutdown { reply } => self.begin_shutdown(Some(reply)),
        }
    }

    fn begin_shutdown(&mut self, reply: Option<Sender<()>>) {
        self.shutting_down = true;
        if reply.is_some() {
            self.shutdown = reply;
        }
        let pids: Vec<Pid> = self
            .procs
            .iter()
            .filter(|(_, p)| p.detach.is_none())
            .map(|(pid, _)| *pid)
            .collect();
        for pid in pids {
            self.start_detach(pid, None);
        }
    }

    fn attach(&mut self, handle: ProcHandle) -> Result<Tracee, AttachError> {
        let pid = handle.pid();
        if self.shutting_down {
            return Err(TracerGone.into());
        }
        if self.procs.contains_key(&pid) {
            return Err(AttachError::AlreadyTraced { pid });
        }
        let target = Tracee {
            handle: Arc::new(handle),
        };
        let mut seized = BTreeSet::new();
        let result = self.seize_all(target.handle(), &mut seized);
        let result = result.and_then(|()| {
            for &tid in &seized {
                match cryo_proc::status(tid) {
                    Ok(s) if s.tgid != pid => {
                        return Err(AttachError::WrongProcess {
                            pid,
                            tid,
                            tgid: s.tgid,
                        })
                    }
                    _ => {}
                }
            }
            // The pidfd was opened before listing: if its process still exists, the pid was not
            // reused and every thread seized is that process's.
            if target.handle.liveness() != cryo_proc::Liveness::Gone {
                Ok(())
            } else {
                Err(AttachError::Gone { pid })
            }
        });
        for &tid in &seized {
            self.threads.insert(
                tid,
                Thread {
                    tgid: pid,
                    state: State::Running,
                },
            );
        }
        self.procs.insert(
            pid,
            Proc {
                target: target.clone(),
                threads: seized,
                detach: None,
            },
        );
        match result {
            Ok(()) => {
                tracing::info!(pid, "attached");
                Ok(target)
            }
            Err(e) => {
                self.start_detach(pid, None);
                Err(e)
            }
        }
    }

    fn seize_all(
        &self,
        handle: &ProcHandle,
        seized: &mut BTreeSet<Pid>,
    ) -> Result<(), AttachError> {
        let pid = handle.pid();
        for _ in 0..ATTACH_ROUNDS {
            let tids = handle
                .tasks()
                .map_err(|source| AttachError::ListThreads { pid, source })?;
            let new: Vec<Pid> = tids
                .into_iter()
                .filter(|t| !seized.contains(t) && !self.threads.contains_key(t))
                .collect();
            if new.is_empty() {
                return if seized.is_empty() {
                    Err(AttachError::Gone { pid })
                } else {
                    Ok(())
                };
            }
            for tid in new {
                match sys::ptrace_seize(tid) {
                    Ok(()) => {
                        seized.insert(tid);
                    }
                    // Exited since listed.
                    Err(e) if errno(&e) == libc::ESRCH => {}
                    // Already ours: a thread cloned by a thread seized a moment ago.
                    Err(_) if cryo_proc::status(tid).is_ok_and(|s| s.tracer_pid == self.me) => {
                        seized.insert(tid);
                    }
                    Err(source) => return Err(AttachError::Seize { pid, tid, source }),
                }
            }
        }
        Err(AttachError::ThreadStorm { pid })
    }

    fn detach(&mut self, pid: Pid, reply: Sender<Result<(), DetachError>>) {
        let Some(proc) = self.procs.get(&pid).filter(|p| p.detach.is_none()) else {
            let _ = reply.send(Err(DetachError::NotTraced { pid }));
            return;
        };
        let held = proc.threads.iter().copied().find(|t| {
            self.threads
                .get(t)
                .is_some_and(|th| matches!(th.state, State::Held { .. }))
        });
        if let Some(tid) = held {
            let _ = reply.send(Err(DetachError::Busy { pid, tid }));
            return;
        }
        self.start_detach(pid, Some(reply));
    }

    fn start_detach(&mut self, pid: Pid, reply: Option<Sender<Result<(), DetachError>>>) {
        let Some(proc) = self.procs.get_mut(&pid) else {
            return;
        };
        proc.detach = Some(reply);
        for tid in &proc.threads {
            let running = self
                .threads
                .get(tid)
                .is_some_and(|t| !matches!(t.state, State::Held { .. }));
            // Held threads are detached when their policy answers; the rest trap first.
            if running {
                if let Err(err) = sys::ptrace_interrupt(*tid) {
                    tracing::debug!(?err, tid, "PTRACE_INTERRUPT failed");
                }
            }
        }
        self.maybe_finish_detach(pid);
    }

    fn maybe_finish_detach(&mut self, pid: Pid) {
        let done = self
            .procs
            .get(&pid)
            .is_some_and(|p| p.detach.is_some() && p.threads.is_empty());
        if done {
            if let Some(Proc {
                detach: Some(Some(reply)),
                ..
            }) = self.procs.remove(&pid)
            {
                let _ = reply.send(Ok(()));
            }
            tracing::info!(pid, "detached");
        }
    }

    fn is_detaching(&self, pid: Pid) -> bool {
        self.procs.get(&pid).is_some_and(|p| p.detach.is_some())
    }

    /// Lets a stopped thread go on, or lets it go entirely when its process is being detached.
    fn release(&mut self, pid: Pid, tid: Pid, signal: i32) {
        if self.is_detaching(pid) {
            if let Err(err) = sys::ptrace_detach(tid, signal) {
                tracing::debug!(?err, tid, "PTRACE_DETACH failed");
            }
            self.threads.remove(&tid);
            if let Some(p) = self.procs.get_mut(&pid) {
                p.threads.remove(&tid);
            }
            self.maybe_finish_detach(pid);
        } else {
            if let Err(err) = sys::ptrace_cont(tid, signal) {
                // ESRCH: killed meanwhile; its exit stop or exit is reported next.
                tracing::debug!(?err, tid, "PTRACE_CONT failed");
            }
            if let Some(t) = self.threads.get_mut(&tid) {
                t.state = State::Running;
            }
        }
    }

    fn resume_held(&mut self, tid: Pid, token: u64, signal: i32, detach: bool) {
        let pid = match self.threads.get(&tid) {
            Some(t) if t.state == State::Held { token } => t.tgid,
            // Stale: the thread left that stop (killed while held) and was reported again.
            _ => return,
        };
        if detach && !self.is_detaching(pid) {
            self.start_detach(pid, None);
        }
        self.release(pid, tid, signal);
    }

    fn hold(&mut self, tid: Pid) -> u64 {
        let token = self.next_token;
        self.next_token += 1;
        if let Some(t) = self.threads.get_mut(&tid) {
            t.state = State::Held { token };
        }
        token
    }

    fn add_thread(&mut self, pid: Pid, tid: Pid) {
        if let Some(p) = self.procs.get_mut(&pid) {
            p.threads.insert(tid);
            self.threads.insert(
                tid,
                Thread {
                    tgid: pid,
                    state: State::Running,
                },
            );
        }
    }

    fn on_wait(&mut self, tid: Pid, st: i32) {
        match status::stopped(st) {
            Some((signal, event)) => self.on_stop(tid, signal, event),
            None => self.on_exit(tid, st),
        }
    }

    fn on_exit(&mut self, tid: Pid, st: i32) {
        let Some(thread) = self.threads.remove(&tid) else {
            return;
        };
        let pid = thread.tgid;
        if tid != pid {
            if let Some(p) = self.procs.get_mut(&pid) {
                p.threads.remove(&tid);
            }
            self.maybe_finish_detach(pid);
            return;
        }
        // The leader is reaped only after every other thread: the process is gone.
        let Some(proc) = self.procs.remove(&pid) else {
            return;
        };
        for t in &proc.threads {
            self.threads.remove(t);
        }
        bump(&self.stats.processes_gone);
        match proc.detach {
            Some(Some(reply)) => {
                let _ = reply.send(Ok(()));
            }
            Some(None) => {}
            None => {
                let cause = ExitCause::from_wait_status(st);
                tracing::info!(pid, ?cause, "traced process gone");
                let policy = Arc::clone(&self.policy);
                let target = proc.target;
                self.spawn_worker(
                    move || policy.on_gone(&target, cause),
                    || tracing::error!(pid, "could not run on_gone"),
                );
            }
        }
    }

    /// A stop of a thread not on record: a clone reported before its parent's clone event.
    fn adopt(&mut self, tid: Pid, signal: i32, event: i32) -> Option<Pid> {
        let tgid = cryo_proc::tgid(tid).ok().flatten();
        match tgid {
            Some(pid) if self.procs.contains_key(&pid) => {
                self.add_thread(pid, tid);
                bump(&self.stats.threads_followed);
                Some(pid)
            }
            _ => {
                tracing::warn!(tid, ?tgid, "detaching an unexpected tracee");
                let sig = if event == 0 { signal } else { 0 };
                let _ = sys::ptrace_detach(tid, sig);
                None
            }
        }
    }

    fn on_stop(&mut self, tid: Pid, signal: i32, event: i32) {
        let pid = match self.threads.get(&tid) {
            Some(t) => t.tgid,
            None => match self.adopt(tid, signal, event) {
                Some(pid) => pid,
                None => return,
            },
        };
        match event {
            sys::PTRACE_EVENT_CLONE => {
                if let Ok(new) = sys::ptrace_geteventmsg(tid) {
                    let new = Pid::try_from(new).unwrap_or(0);
                    if new > 0 && !self.threads.contains_key(&new) {
                        self.add_thread(pid, new);
                        bump(&self.stats.threads_followed);
                    }
                }
                self.release(pid, tid, 0);
            }
            sys::PTRACE_EVENT_EXIT => {
                bump(&self.stats.exit_stops);
                if tid != pid || self.is_detaching(pid) {
                    self.release(pid, tid, 0);
                } else if self.exec_in_progress(pid) {
                    self.on_leader_killed_by_exec(pid, tid);
                } else {
                    self.on_leader_exit_stop(pid, tid);
                }
            }
            sys::PTRACE_EVENT_EXEC => {
                if self.is_detaching(pid) {
                    self.release(pid, tid, 0);
                } else {
                    self.on_exec_stop(pid, tid);
                }
            }
            sys::PTRACE_EVENT_STOP => {
                if signals::is_stop_signal(signal) && !self.is_detaching(pid) {
                    bump(&self.stats.group_stops);
                    if let Err(err) = sys::ptrace_listen(tid) {
                        tracing::debug!(?err, tid, "PTRACE_LISTEN failed");
                    }
                    if let Some(t) = self.threads.get_mut(&tid) {
                        t.state = State::Listening;
                    }
                } else {
                    self.release(pid, tid, 0);
                }
            }
            0 => self.on_signal_stop(pid, tid, signal),
            _ => self.release(pid, tid, 0),
        }
    }

    fn on_signal_stop(&mut self, pid: Pid, tid: Pid, signal: i32) {
        if self.is_detaching(pid) {
            self.release(pid, tid, signal);
            return;
        }
        let (fatal, handled) = match cryo_proc::status(tid) {
            Ok(s) => (
                signals::is_fatal(signal, s.sig_caught, s.sig_ignored),
                signals::is_graceful_end(signal, s.sig_caught, s.sig_ignored),
            ),
            // Unreadable: err on the side of holding; the policy sees the signal anyway.
            Err(_) => (signals::default_terminates(signal), false),
        };
        if !fatal && !handled {
            bump(&self.stats.signals_passed);
            self.release(pid, tid, signal);
            return;
        }
        bump(&self.stats.fatal_held);
        let info = sys::ptrace_getsiginfo(tid).ok();
        let fatal = FatalSignal {
            tid,
            signal,
            code: info.map_or(0, |i| i.code),
            sender: info.and_then(|i| i.sender),
            handled,
        };
        tracing::info!(pid, tid, signal = %cryo_proc::signal_name(signal), "holding a fatal signal");
        let Some(target) = self.procs.get(&pid).map(|p| p.target.clone()) else {
            return;
        };
        self.hold_for_policy(
            pid,
            tid,
            "on a fatal signal (delivering it)",
            signal,
            move |policy| {
                let decision =
                    catch_unwind(AssertUnwindSafe(|| policy.on_fatal_signal(&target, &fatal)))
                        .unwrap_or_else(|_| {
                            tracing::error!(
                                pid,
                                "policy panicked on a fatal signal; delivering it"
                            );
                            Decision::Deliver
                        });
                match decision {
                    Decision::Deliver => Resume::with(fatal.signal),
                    Decision::Discard => Resume::with(0),
                }
            },
        );
    }

    fn on_leader_exit_stop(&mut self, pid: Pid, tid: Pid) {
        let cause = sys::ptrace_geteventmsg(tid)
            .map(|m| ExitCause::from_wait_status(i32::try_from(m).unwrap_or(0)))
            .unwrap_or(ExitCause::Exited(0));
        let Some(target) = self.procs.get(&pid).map(|p| p.target.clone()) else {
            return;
        };
        bump(&self.stats.pin_stops);
        tracing::info!(pid, ?cause, "process at its exit stop");
        self.hold_for_policy(pid, tid, "at the exit stop", 0, move |policy| {
            let fds =
                catch_unwind(AssertUnwindSafe(|| policy.fds_to_pin(&target))).unwrap_or_default();
            let (fds, failed) = target.handle().get_fds(&fds);
            let pinned = PinnedFds {
                target: pid,
                fds,
                failed,
            };
            if catch_unwind(AssertUnwindSafe(|| {
                policy.on_exit_stop(&target, tid, cause, pinned);
            }))
            .is_err()
            {
                tracing::error!(pid, "policy panicked at an exit stop");
            }
            Resume::with(0)
        });
    }

    /// Whether another thread of `pid` is inside `execve` (see
    /// [`ProcHandle::thread_syscalls`]): asked at the leader's exit stop, while the leader is held.
    /// The execing thread blocks there waiting for the leader; a thread still running is looked
    /// at again, for up to [`EXEC_PROBE`] (in a real death every other thread is dying too).
    fn exec_in_progress(&self, pid: Pid) -> bool {
        let Some(p) = self.procs.get(&pid) else {
            return false;
        };
        let is_exec = |nr: i64| nr == libc::SYS_execve || nr == libc::SYS_execveat;
        let deadline = std::time::Instant::now() + EXEC_PROBE;
        loop {
            let Ok(calls) = p.target.handle().thread_syscalls() else {
                return false;
            };
            let others = calls.iter().filter(|(t, _)| *t != pid);
            let mut running = false;
            for (_, nr) in others {
                match nr {
                    Some(nr) if is_exec(*nr) => return true,
                    Some(_) => {}
                    None => running = true,
                }
            }
            if !running || std::time::Instant::now() >= deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The leader's exit stop of a multi-threaded `execve` by another thread: the fd table is
    /// intact until the leader goes; the policy looks at it first.
    fn on_leader_killed_by_exec(&mut self, pid: Pid, tid: Pid) {
        let Some(target) = self.procs.get(&pid).map(|p| p.target.clone()) else {
            return;
        };
        tracing::info!(pid, "leader killed by another thread's execve");
        self.hold_for_policy(pid, tid, "before an exec", 0, move |policy| {
            if catch_unwind(AssertUnwindSafe(|| policy.before_exec(&target))).is_err() {
                tracing::error!(pid, "policy panicked before an exec");
            }
            Resume::with(0)
        });
    }

    /// `PTRACE_EVENT_EXEC`: the exec succeeded. The execing thread has the leader's tid now and
    /// every other thread is gone (their exits, reported or not, are stale).
    fn on_exec_stop(&mut self, pid: Pid, tid: Pid) {
        bump(&self.stats.exec_stops);
        let thread = sys::ptrace_geteventmsg(tid)
            .ok()
            .and_then(|m| Pid::try_from(m).ok())
            .unwrap_or(tid);
        let Some(p) = self.procs.get_mut(&pid) else {
            return;
        };
        let target = p.target.clone();
        let gone: Vec<Pid> = p.threads.iter().copied().filter(|t| *t != pid).collect();
        for t in &gone {
            p.threads.remove(t);
        }
        p.threads.insert(pid);
        for t in &gone {
            self.threads.remove(t);
        }
        self.threads.insert(
            pid,
            Thread {
                tgid: pid,
                state: State::Running,
            },
        );
        tracing::info!(pid, thread, "execve");
        self.hold_for_policy(pid, tid, "at an exec", 0, move |policy| {
            let after = catch_unwind(AssertUnwindSafe(|| policy.on_exec(&target, thread)))
                .unwrap_or_else(|_| {
                    tracing::error!(pid, "policy panicked at an exec");
                    AfterExec::Keep
                });
            Resume {
                signal: 0,
                detach: after == AfterExec::Detach,
            }
        });
    }

    /// Holds thread `tid` of `pid` at its stop while `decide` asks the policy, on a thread of
    /// its own (a policy may take seconds: a suspension), then resumes it as decided. When no
    /// thread can be started, says so (`what`: where it stopped) and lets the thread go with
    /// `fallback` (the signal it stopped with, or none).
    fn hold_for_policy(
        &mut self,
        pid: Pid,
        tid: Pid,
        what: &'static str,
        fallback: i32,
        decide: impl FnOnce(&dyn Policy) -> Resume + Send + 'static,
    ) {
        let token = self.hold(tid);
        let policy = Arc::clone(&self.policy);
        let mailbox = self.mailbox.clone();
        let spawned = self.spawn_worker(
            move || {
                let r = decide(&*policy);
                let _ = mailbox.call(|reply| Command::Resume {
                    tid,
                    token,
                    signal: r.signal,
                    detach: r.detach,
                    reply,
                });
            },
            || tracing::error!(pid, "could not run the policy {what}"),
        );
        if !spawned {
            self.release(pid, tid, fallback);
        }
    }

    fn spawn_worker(&self, work: impl FnOnce() + Send + 'static, on_fail: impl FnOnce()) -> bool {
        let ok = std::thread::Builder::new()
            .name("cryo-guard-policy".into())
            .spawn(work)
            .is_ok();
        if !ok {
            on_fail();
        }
        ok
    }
}

/// How a thread held for the policy goes on.
struct Resume {
    /// The signal to deliver (0: none).
    signal: i32,
    /// Detach the whole process instead of continuing it.
    detach: bool,
}

impl Resume {
    /// Continue, delivering `signal`.
    fn with(signal: i32) -> Resume {
        Resume {
            signal,
            detach: false,
        }
    }
}
