//! Whoever traces processes on this node (the guard), as the lifecycle sees it: asked to let go of
//! a process that CRIU must trace itself, and to take it back afterwards.
//!
//! # Design
//! A small trait so that the lifecycle does not depend on the guard: the guard implements it
//! in-process (the node agent), and its socket client implements it for a standalone command
//! talking to a running guard. Processes are named by pid and start time, so a pid reused in
//! between is never detached or attached by mistake. [`NoWatcher`] is the node without a guard.
//!
//! **No gap in coverage**: a restore through cryo calls [`Watcher::guard_before_unlock`] while
//! the process is still LOCKED (its context restored, none of its CUDA calls running yet), and
//! unlocks only once it returned [`Coverage::Guarded`] (or [`Coverage::NoGuard`]: no guard runs
//! on this node). When it returns an error the process was not traced: the caller suspends it
//! again instead of unlocking, so that no restored context ever runs unguarded while a guard runs.

use cryo_journal::ProcId;
use cryo_proc::ProcHandle;

/// The watcher could not do what was asked.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct WatcherError(Box<dyn std::error::Error + Send + Sync>);

impl WatcherError {
    /// Wraps the implementation's own error.
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }
}

/// Whoever traces processes on this node.
pub trait Watcher {
    /// Stops tracing `pid` (every thread) before returning. `Ok(true)`: it let go and expects
    /// [`Watcher::attach`] later; `Ok(false)`: it was not tracing it.
    fn detach(&self, pid: ProcId) -> Result<bool, WatcherError>;

    /// Traces `pid` again (it was detached and is still alive).
    fn attach(&self, pid: ProcId) -> Result<(), WatcherError>;

    /// Traces every process of `procs` (restored, still LOCKED) before returning. See the module
    /// docs: on an error, the caller must not unlock them.
    fn guard_before_unlock(&self, procs: &[&ProcHandle]) -> Result<Coverage, WatcherError>;
}

/// What [`Watcher::guard_before_unlock`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Coverage {
    /// Every process is traced.
    Guarded,
    /// No guard runs on this node: nothing traces them (the caller says so once).
    NoGuard,
}

/// A node where nothing traces processes for cryo.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoWatcher;

impl Watcher for NoWatcher {
    fn detach(&self, _pid: ProcId) -> Result<bool, WatcherError> {
        Ok(false)
    }

    fn attach(&self, _pid: ProcId) -> Result<(), WatcherError> {
        Ok(())
    }

    fn guard_before_unlock(&self, _procs: &[&ProcHandle]) -> Result<Coverage, WatcherError> {
        Ok(Coverage::NoGuard)
    }
}
