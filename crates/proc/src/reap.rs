//! Reaping the calling thread's own children without taking what a tracer is owed.
//!
//! # Design
//! A child that a thread of this same process traces (the agent's guard traces the workers its
//! thaw thread restored, and so is the parent of) is the tracer's to wait for. The kernel lets any
//! wait of the real parent's process see such a child's ptrace stops and its end as if it were the
//! tracer (`wait_consider_task`: "if it is traced by its real parent's group, just pretend the
//! caller is ptrace_parent"; stops are reported whatever the flags), and what one wait takes the
//! other never sees: a parent's `waitpid(-1)` that takes the exit stop leaves the child held there
//! for good (the tracer never hears of it, so never pins nor lets it go), and one that takes its
//! end leaves the tracer tracing a process that is gone, whose pid a restore gives out again.
//!
//! So [`reap_child`] first looks without taking (`WNOWAIT`), only at an end (never at a stop), and
//! takes it only when nothing traces the zombie: nothing can attach to a zombie, so the answer
//! cannot change between the look and the reap. A traced zombie is left to its tracer, whose wait
//! reaps it (a tracer in the parent's process is given the reap).
//!
//! # Limitations
//! Only the calling thread's children (`__WNOTHREAD`), found by `/proc/PID/task/TID/children`
//! ([`crate::thread_children`]), which can miss a child while another exits: a periodic reaper
//! finds it next time.

use std::fmt;

use rustix::io::Errno;
use rustix::process::{waitid, Pid as RPid, WaitId, WaitidOptions, WaitidStatus};

use crate::{Pid, ProcError};

/// How a reaped child ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    /// It exited with this status.
    Exited(i32),
    /// A signal ended it (this one).
    Killed(i32),
}

impl fmt::Display for ChildEnd {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildEnd::Exited(code) => write!(f, "exited with status {code}"),
            ChildEnd::Killed(sig) => write!(f, "killed by {}", crate::signal_name(*sig)),
        }
    }
}

/// Only children of the calling thread (`__WNOTHREAD`): other threads wait for their own.
fn this_thread_only() -> WaitidOptions {
    // `__WNOTHREAD` has no name in rustix; its flags keep unknown bits.
    WaitidOptions::from_bits_retain(libc::__WNOTHREAD as u32)
}

/// Reaps `pid`, a child of the calling thread, if it has ended and nothing traces it; how it
/// ended, or `None` (still running or stopped, traced: its tracer's to wait for, or not this
/// thread's child). See the module docs.
pub fn reap_child(pid: Pid) -> Result<Option<ChildEnd>, ProcError> {
    let Some(rpid) = RPid::from_raw(pid) else {
        return Ok(None);
    };
    reap(|| WaitId::Pid(rpid), pid, this_thread_only())
}

/// As [`reap_child`], for `h`, a child of any thread of this process (a carrier thread reaps
/// what another thread's restore left stuck), named by its pidfd: exactly that process, never
/// one that took its pid since.
pub fn reap_ended(h: &crate::ProcHandle) -> Result<Option<ChildEnd>, ProcError> {
    reap(|| WaitId::PidFd(h.pidfd()), h.pid(), WaitidOptions::empty())
}

/// [`reap_child`]'s look, then reap, of the child `id` names (`pid`), with `scope`'s flags.
fn reap<'a>(
    id: impl Fn() -> WaitId<'a>,
    pid: Pid,
    scope: WaitidOptions,
) -> Result<Option<ChildEnd>, ProcError> {
    let wait = |options: WaitidOptions| match waitid(
        id(),
        options | WaitidOptions::EXITED | WaitidOptions::NOHANG | scope,
    ) {
        Ok(st) => Ok(st),
        // Not (or no longer) this thread's child: a tracer reaped it.
        Err(Errno::CHILD) => Ok(None),
        Err(e) => Err(ProcError::os("waitid", pid, e.into())),
    };
    // A look that takes nothing: a traced child's stop is reported here whatever the flags.
    let Some(seen) = wait(WaitidOptions::NOWAIT)? else {
        return Ok(None);
    };
    if end_of(&seen).is_none() {
        return Ok(None);
    }
    // A zombie: nothing attaches to it any more, so whether it is traced stays as read.
    match crate::status(pid) {
        Ok(s) if s.tracer_pid == 0 => {}
        Ok(_) | Err(ProcError::NoSuchProcess(_)) => return Ok(None),
        Err(e) => return Err(e),
    }
    Ok(wait(WaitidOptions::empty())?.as_ref().and_then(end_of))
}

/// What [`reap_children`] did.
#[derive(Debug, Default)]
pub struct Reaped {
    /// The children reaped, with how they ended.
    pub ended: Vec<(Pid, ChildEnd)>,
    /// The children that could not be looked at.
    pub failed: Vec<ProcError>,
}

/// Reaps every child of the calling thread that ended and that nothing traces ([`reap_child`]).
pub fn reap_children() -> Result<Reaped, ProcError> {
    let mut out = Reaped::default();
    for pid in crate::thread_children()? {
        match reap_child(pid) {
            Ok(Some(end)) => out.ended.push((pid, end)),
            Ok(None) => {}
            Err(e) => out.failed.push(e),
        }
    }
    Ok(out)
}

/// How `st` says the child ended; `None`: a stop (only a tracer's wait is owed one).
fn end_of(st: &WaitidStatus) -> Option<ChildEnd> {
    let code = |v: Option<u32>| i32::try_from(v.unwrap_or(0)).unwrap_or(i32::MAX);
    if st.exited() {
        Some(ChildEnd::Exited(code(st.exit_status())))
    } else if st.killed() || st.dumped() {
        Some(ChildEnd::Killed(code(st.terminating_signal())))
    } else {
        None
    }
}
