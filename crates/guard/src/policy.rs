//! What the tracer asks of the policy that plugs into it.

use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;

use cryo_proc::{Pid, ProcError, ProcHandle};

/// A traced process: the handle (pidfd) taken before it was attached.
#[derive(Debug, Clone)]
pub struct Tracee {
    pub(crate) handle: Arc<ProcHandle>,
}

impl Tracee {
    /// The process id (thread-group id).
    pub fn pid(&self) -> Pid {
        self.handle.pid()
    }

    /// The handle naming exactly this process (signal it, take its fds, read it).
    pub fn handle(&self) -> &ProcHandle {
        &self.handle
    }
}

/// A signal about to be delivered that would kill the process, or a graceful end it handles
/// (see [`crate::signals`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatalSignal {
    /// The thread held at its signal-delivery-stop; all other threads keep running.
    pub tid: Pid,
    pub signal: i32,
    /// `si_code`: > 0 for a fault raised by the kernel (`SEGV_MAPERR`...), <= 0 when sent.
    pub code: i32,
    /// The sending process for `kill`/`tgkill`/`sigqueue`.
    pub sender: Option<Pid>,
    /// The process handles it (SIGTERM, SIGINT, SIGHUP with a handler: a graceful end it would
    /// carry out itself); false for a signal that would kill it outright.
    pub handled: bool,
}

/// What to do with a held fatal signal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Let the signal through now (the process dies of it).
    Deliver,
    /// Drop it; the thread resumes as if it never came. For a fault the faulting instruction runs
    /// again and faults again.
    Discard,
}

/// What the tracer does with a process once [`Policy::on_exec`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterExec {
    /// Keep tracing the new program.
    Keep,
    /// Let it go (it is not the process that was guarded any more).
    Detach,
}

/// How a thread or process ended, as in a wait status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExitCause {
    /// `exit`/`exit_group` with this code.
    Exited(i32),
    /// Killed by a signal.
    Signaled { signal: i32, core_dumped: bool },
}

impl ExitCause {
    pub(crate) fn from_wait_status(status: i32) -> Self {
        if let Some((signal, core_dumped)) = crate::sys::status::signaled(status) {
            Self::Signaled {
                signal,
                core_dumped,
            }
        } else {
            Self::Exited(crate::sys::status::exited(status).unwrap_or(status))
        }
    }
}

/// Duplicates of a dying process's fds, taken at its exit stop. Holding them keeps the files open
/// (a GPU context stays alive while its driver fds are open); dropping closes them all.
#[derive(Debug)]
pub struct PinnedFds {
    pub target: Pid,
    /// `(fd number in the target, our duplicate)`.
    pub fds: Vec<(RawFd, OwnedFd)>,
    /// The fds that could not be taken.
    pub failed: Vec<ProcError>,
}

/// The decisions the tracer leaves to its owner. Every method runs on a thread of its own, never
/// on the tracer thread, so the tracer keeps serving other tracees while one runs; the thread that
/// a call is about stays stopped until it returns.
pub trait Policy: Send + Sync + 'static {
    /// A thread of `target` is about to receive a signal that would kill the process. The thread
    /// is held at its signal-delivery-stop until this returns. If the process is killed meanwhile
    /// (by the policy itself after suspending it, say), the held stop is gone, the return value is
    /// ignored and [`Policy::on_exit_stop`] follows.
    fn on_fatal_signal(&self, target: &Tracee, signal: &FatalSignal) -> Decision;

    /// The process is dying (its thread-group leader reached its exit stop: SIGKILL, OOM kill,
    /// `exit_group`, a fatal signal let through). Which of its fds to duplicate before it goes
    /// (for example `GpuInspector::driver_fds`). The fd table is intact at this point.
    fn fds_to_pin(&self, target: &Tracee) -> Vec<RawFd>;

    /// The duplicates of [`Policy::fds_to_pin`]'s fds have been taken; the leader is still held at
    /// its exit stop and exits once this returns. Keep `pinned` to keep the files open.
    fn on_exit_stop(&self, target: &Tracee, tid: Pid, cause: ExitCause, pinned: PinnedFds);

    /// The process has been reaped by the kernel (its leader's final wait status).
    fn on_gone(&self, target: &Tracee, cause: ExitCause) {
        let _ = (target, cause);
    }

    /// A thread other than the leader is inside `execve`, which has killed every other thread:
    /// the leader is held at its exit stop (the fd table still intact, the close-on-exec fds
    /// not closed yet) until this returns, then the exec goes on. Not a death: no
    /// [`Policy::on_exit_stop`] follows, but [`Policy::on_exec`] does if the exec succeeds.
    fn before_exec(&self, target: &Tracee) {
        let _ = target;
    }

    /// The process replaced its program (`PTRACE_EVENT_EXEC`): its close-on-exec fds are closed
    /// and its old memory is gone; `thread` called `execve` (the tid it had; it runs on as the
    /// leader). The process is held until this returns. A failed `execve` changes nothing and
    /// is not reported.
    fn on_exec(&self, target: &Tracee, thread: Pid) -> AfterExec {
        let _ = (target, thread);
        AfterExec::Keep
    }
}
