//! The guard as a service: the whole life of a guard, from start to a stop that never drops pins.
//!
//! # Design
//! [`run`] starts the guard ([`Guard::start`]: re-attaches to every live restored process of the
//! journal), guards the processes named in [`RunOptions::pids`], serves the control socket, then
//! follows the journal for new restores and watches memory every [`RunOptions::poll`], until
//! `stop()` says so. While the guard holds pins it refuses to stop (closing them is the
//! operator's `cryo guard release`, never a side effect) and says so every 30 s. On the way out
//! it removes its socket and detaches from every process.
//!
//! `cryo guard` runs it in the foreground with its termination flag as `stop`; the node agent
//! will run it on a thread of its own. Nothing here prints: what happens is handed to the
//! caller as [`Notice`]s (their `Display` is the wording `cryo guard` prints).
//!
//! The memory watch runs on a thread of its own ([`Guard::start`] starts it): a memory-pressure
//! stop never delays the journal poll or a restore's request to be guarded; the loop only reports
//! what it stopped.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cryo_gpu::Gpu;
use cryo_journal::ProcId;

use crate::control::{self, ServeError};
use crate::guard::{Guard, GuardAttachError, GuardConfig, StartError};
use cryo_proc::Pid;

/// How often a guard that holds pins repeats that it refuses to stop.
const REFUSAL_REPEAT: Duration = Duration::from_secs(30);

/// What [`run`] guards besides the journal's restored processes, and how often it looks.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Processes restored by other tools (`cryo guard --pid`).
    pub pids: Vec<Pid>,
    /// How often to read the journal for new restores and to look at memory (at least 10 ms).
    pub poll: Duration,
}

/// Something the running guard did or found, for the caller to print or log.
#[derive(Debug)]
pub enum Notice {
    /// At start: a restored process of the journal is guarded again.
    Reattached(ProcId),
    /// At start: a re-attached process is LOCKED (a restore or suspension that did not finish,
    /// such as a thaw whose owner died between the GPU restore and the unlock): it is guarded,
    /// and nothing unlocks it on its own.
    LeftLocked {
        /// The process.
        pid: ProcId,
        /// Why it is not unlocked in recovery ([`Notice::FinishedUnlock`]).
        why: String,
    },
    /// At start: a re-attached process LOCKED by a thaw or wake that died between the GPU
    /// restore and the unlock was unlocked (journaled as a recovery); it serves again.
    FinishedUnlock(ProcId),
    /// At start: a process it had guarded (or that is restored) is not guarded, and why.
    Lost {
        /// The process.
        pid: ProcId,
        /// Why.
        why: String,
    },
    /// At start: the processes of one restore under way (a thaw at CRIU's gate: its intents
    /// journaled, not their completion) are left to it, not traced now: they hold no GPU
    /// context, and CRIU seizes the tree itself before it resumes it. Whoever completes the
    /// restore has them traced then (the thaw's guard-before-unlock, the journal's poll).
    Pending {
        /// The image its intents name.
        image: String,
        /// Its processes.
        pids: Vec<ProcId>,
        /// The cryo process restoring them (the thaw), when an intent names it.
        by: Option<ProcId>,
    },
    /// At start: a suspension an earlier run left half-way was settled (what was found and done).
    Settled(cryo_lifecycle::Settled),
    /// A process of [`RunOptions::pids`] is guarded.
    Guarding(ProcId),
    /// The guard runs and its control socket answers.
    Running {
        /// The tracer thread (`TracerPid` of every guarded process).
        tracer_tid: Pid,
        /// The control socket.
        socket: PathBuf,
    },
    /// A new restore in the journal is guarded.
    GuardingRestored(ProcId),
    /// A CUDA process found by the scan is guarded (`--scan all-cuda`).
    GuardingScanned(ProcId),
    /// The journal could not be read this time (the next poll tries again).
    JournalUnreadable(cryo_journal::ReadError),
    /// The memory watch suspended and stopped a guarded process before the OOM killer could.
    MemoryStopped(ProcId),
    /// Asked to stop while holding pins: it keeps running.
    RefusingToStop,
    /// Stopping: detaching from this many processes.
    Stopping {
        /// How many processes it still guarded.
        guarded: usize,
    },
}

/// The processes a start left to their restore ([`crate::StartReport::pending`]), one entry per
/// restore (its image): its processes and its writer (the one intent that names it: a thaw
/// names itself for its CUDA processes, not for the plain root).
fn pending_by_image(
    pending: Vec<(ProcId, cryo_lifecycle::PendingRestore)>,
) -> std::collections::BTreeMap<String, (Vec<ProcId>, Option<ProcId>)> {
    let mut out = std::collections::BTreeMap::<String, (Vec<ProcId>, Option<ProcId>)>::new();
    for (id, p) in pending {
        let e = out.entry(p.image).or_default();
        e.0.push(id);
        e.1 = e.1.or(p.by);
    }
    out
}

impl fmt::Display for Notice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Notice::Reattached(id) => write!(f, "re-attached to restored pid {id}"),
            Notice::LeftLocked { pid: id, why } => write!(
                f,
                "pid {id} is LOCKED (a restore or suspension that did not finish, such as a thaw \
                 whose owner died before the unlock); it is guarded: `cryo gpu unlock --pid {id}` \
                 brings it back, `cryo stop {id}` ends it (not unlocked in recovery: {why})"
            ),
            Notice::FinishedUnlock(id) => write!(
                f,
                "pid {id} was LOCKED by a thaw or wake that died before the unlock; it is guarded, \
                 so it was unlocked (recovery): it serves again"
            ),
            Notice::Lost { pid, why } => write!(f, "LOST track of pid {pid}: {why}"),
            Notice::Pending { image, pids, by } => {
                let pids: Vec<String> = pids.iter().map(ToString::to_string).collect();
                let by = by.map_or_else(
                    || "its restorer unnamed".to_string(),
                    |b| format!("by cryo pid {}", b.pid),
                );
                write!(
                    f,
                    "left pid {} to the restore of {image} under way ({by}: a thaw at CRIU's \
                     gate): no GPU context yet; traced once the restore completes",
                    pids.join(", ")
                )
            }
            Notice::Settled(s) => write!(f, "settled: {s}"),
            Notice::Guarding(id) => write!(f, "guarding pid {id}"),
            Notice::Running { tracer_tid, socket } => write!(
                f,
                "running (tracer tid {tracer_tid}); control socket {}",
                socket.display()
            ),
            Notice::GuardingRestored(id) => write!(f, "guarding restored pid {id}"),
            Notice::GuardingScanned(id) => {
                write!(
                    f,
                    "guarding CUDA pid {id} found by the scan (--scan all-cuda)"
                )
            }
            Notice::JournalUnreadable(e) => write!(f, "cannot read the journal: {e}"),
            Notice::MemoryStopped(id) => {
                write!(f, "memory pressure: suspended and stopped pid {id}")
            }
            Notice::RefusingToStop => f.write_str(
                "refusing to stop: it holds pinned contexts (closing them may wedge the host); \
                 use `cryo guard release` first",
            ),
            Notice::Stopping { guarded } => {
                write!(f, "stopping; detaching from {guarded} process(es)")
            }
        }
    }
}

/// A re-attached LOCKED process: unlocked when the thaw or wake that restored it died before the
/// unlock and the guard traces it (`cryo_lifecycle::finish_unlock` decides from the journal and
/// the driver); otherwise left LOCKED, guarded, and said so.
fn finish_unlock(gpu: &Gpu, guard: &Guard, state: &cryo_state::StateDir, id: ProcId) -> Notice {
    let left = |why: String| Notice::LeftLocked { pid: id, why };
    if !guard.guarded().contains(&id) {
        return left("the guard does not trace it".into());
    }
    let done = state
        .open_journal()
        .map_err(|e| e.to_string())
        .and_then(|j| cryo_lifecycle::finish_unlock(gpu, &j, id).map_err(|e| e.to_string()));
    match done {
        Ok(cryo_lifecycle::FinishUnlock::Unlocked) => Notice::FinishedUnlock(id),
        Ok(cryo_lifecycle::FinishUnlock::Left(why)) => left(why),
        Err(e) => left(e),
    }
}

/// Raises this process's soft fd limit to its hard one: every guarded process costs the guard
/// two pidfds and one standing duplicate per driver fd it holds ([`crate::standing`]), and a
/// duplicate not taken for want of an fd is a context an `execve` would tear down. Best effort.
fn raise_fd_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let lim = getrlimit(Resource::Nofile);
    if lim.current != lim.maximum {
        if let Err(err) = setrlimit(
            Resource::Nofile,
            Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            },
        ) {
            tracing::warn!(%err, "cannot raise the fd limit");
        }
    }
}

/// The guard could not start (nothing is left running).
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The guard itself could not start.
    #[error("starting the guard: {0}")]
    Start(#[from] StartError),
    /// A process of [`RunOptions::pids`] could not be guarded.
    #[error("guarding pid {pid}: {source}")]
    Attach {
        /// The pid.
        pid: Pid,
        /// Why.
        source: GuardAttachError,
    },
    /// The control socket could not be served.
    #[error("opening the guard's control socket: {0}")]
    Control(#[from] ServeError),
}

/// A flag that SIGTERM, SIGINT, SIGHUP and SIGQUIT set instead of killing the process (a guard
/// holding pins must not die of a stray signal); hand `|| flag.load(..)` to [`run`] as its `stop`.
/// Every other signal whose default action would kill the guard (SIGUSR1, SIGALRM, SIGPIPE, the
/// real-time signals...) is caught and ignored; synchronous faults (SIGSEGV, SIGBUS, SIGILL,
/// SIGFPE, SIGTRAP, SIGSYS, SIGABRT) keep their default: ignoring a real fault would loop.
pub fn termination_flag() -> std::io::Result<Arc<std::sync::atomic::AtomicBool>> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
    let flag = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in [SIGTERM, SIGINT, SIGHUP, SIGQUIT] {
        signal_hook::flag::register(sig, Arc::clone(&flag))?;
    }
    // A handler, not SIG_IGN: a disposition of "ignore" would be inherited by the commands the
    // guard runs (the drain's restart command).
    let ignored = Arc::new(std::sync::atomic::AtomicBool::new(false));
    for sig in ignored_signals() {
        signal_hook::flag::register(sig, Arc::clone(&ignored))?;
    }
    Ok(flag)
}

/// The signals [`termination_flag`] ignores: the ones that kill by default, less the stop
/// requests, the synchronous faults and the tracer's own wake-up signal.
fn ignored_signals() -> Vec<i32> {
    use signal_hook::consts::{SIGHUP, SIGINT, SIGQUIT, SIGTERM};
    let keep = [
        SIGTERM,
        SIGINT,
        SIGHUP,
        SIGQUIT,
        libc::SIGSEGV,
        libc::SIGBUS,
        libc::SIGILL,
        libc::SIGFPE,
        libc::SIGTRAP,
        libc::SIGSYS,
        libc::SIGABRT,
        crate::sys::kick_signal(),
    ];
    (1..=libc::SIGRTMAX())
        .filter(|s| crate::signals::default_terminates(*s) && !keep.contains(s))
        // glibc keeps the first real-time signals for itself (threads, timers).
        .filter(|s| *s < 32 || *s >= libc::SIGRTMIN())
        .collect()
}

/// Runs a guard until `stop()` returns true and it holds no pins. See the module docs.
pub fn run(
    gpu: Gpu,
    cfg: GuardConfig,
    opts: &RunOptions,
    stop: &dyn Fn() -> bool,
    notify: &mut dyn FnMut(Notice),
) -> Result<(), RunError> {
    Service::start(gpu, cfg, opts, notify)?.run_until(stop, notify);
    Ok(())
}

/// A started guard whose loop has not run yet: what [`run`] is made of, for an owner (the node
/// agent) that needs the [`Guard`] itself while the loop runs on a thread of its own.
#[derive(Debug)]
pub struct Service {
    guard: Arc<Guard>,
    state: cryo_state::StateDir,
    poll: Duration,
}

impl Service {
    /// Starts the guard, guards `opts.pids`, serves the control socket.
    pub fn start(
        gpu: Gpu,
        cfg: GuardConfig,
        opts: &RunOptions,
        notify: &mut dyn FnMut(Notice),
    ) -> Result<Service, RunError> {
        let state = cfg.state.clone();
        raise_fd_limit();
        let bounded = gpu.bounded(cryo_gpu::Limits::default());
        let (guard, report) = Guard::start(gpu, cfg)?;
        let guard = Arc::new(guard);
        for s in report.settled {
            notify(Notice::Settled(s));
        }
        for id in report.attached {
            notify(Notice::Reattached(id));
            if matches!(
                bounded.driver.state(id.pid),
                Ok(cryo_gpu::ProcessState::Locked)
            ) {
                notify(finish_unlock(&bounded, &guard, &state, id));
            }
        }
        for (pid, why) in report.lost {
            notify(Notice::Lost { pid, why });
        }
        for (image, (pids, by)) in pending_by_image(report.pending) {
            notify(Notice::Pending { image, pids, by });
        }
        for pid in &opts.pids {
            let id = guard
                .attach_pid(*pid)
                .map_err(|source| RunError::Attach { pid: *pid, source })?;
            notify(Notice::Guarding(id));
        }
        control::serve(Arc::clone(&guard), &state)?;
        notify(Notice::Running {
            tracer_tid: guard.tracer_tid(),
            socket: state.guard_socket(),
        });
        Ok(Service {
            guard,
            state,
            poll: opts.poll.max(Duration::from_millis(10)),
        })
    }

    /// The guard.
    pub fn guard(&self) -> &Arc<Guard> {
        &self.guard
    }

    /// Follows the journal and watches memory until `stop()` says so and no pins are held;
    /// then removes the control socket and detaches from every process.
    pub fn run_until(self, stop: &dyn Fn() -> bool, notify: &mut dyn FnMut(Notice)) {
        let guard = self.guard;
        let mut refused_at = None::<Instant>;
        let mut scanned_at = None::<Instant>;
        loop {
            if stop() {
                if !guard.has_pins() {
                    break;
                }
                if refused_at.is_none_or(|t| t.elapsed() > REFUSAL_REPEAT) {
                    notify(Notice::RefusingToStop);
                    refused_at = Some(Instant::now());
                }
            }
            match guard.poll_journal() {
                Ok(ids) => ids
                    .into_iter()
                    .for_each(|id| notify(Notice::GuardingRestored(id))),
                Err(e) => notify(Notice::JournalUnreadable(e)),
            }
            if scanned_at.is_none_or(|t| t.elapsed() >= crate::SCAN_INTERVAL) {
                scanned_at = Some(Instant::now());
                guard.refresh_standing();
                guard
                    .scan()
                    .into_iter()
                    .for_each(|id| notify(Notice::GuardingScanned(id)));
            }
            for id in guard.check_memory() {
                notify(Notice::MemoryStopped(id));
            }
            std::thread::sleep(self.poll);
        }
        notify(Notice::Stopping {
            guarded: guard.guarded().len(),
        });
        let _ = std::fs::remove_file(self.state.guard_socket());
        guard.shutdown();
    }
}
