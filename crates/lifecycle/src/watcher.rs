//! Whoever traces processes on this node (the guard), as the lifecycle sees it: asked to let go of
//! a process that CRIU must trace itself, and to take it back afterwards; to trace a restored
//! process before its unlock.
//!
//! # Design
//! A small trait so that the lifecycle does not depend on the guard: the guard implements it
//! in-process (the node agent), and its socket client implements it for a standalone command
//! talking to a running guard. Processes are named by pid and start time, so a pid reused in
//! between is never detached or attached by mistake. [`NoWatcher`] is the node without a guard.
//!
//! Letting go around a dump is a [`Lease`]: the watcher traces the process again when the lease
//! is dropped, and, over the guard's socket, when the asker dies (the lease is its open
//! connection), so a freeze killed mid-dump never leaves a restored process unguarded. A lease
//! never outlives the process: the watcher forgets it when the process is gone.
//!
//! **No gap in coverage**: whatever restores a context through cryo (thaw, `cryo gpu restore`,
//! the cuda-checkpoint front end) calls [`Watcher::guard_before_unlock`] while the process is
//! still LOCKED (its context restored, none of its CUDA calls running yet), and unlocks only once
//! it returned [`Coverage::Guarded`] (or [`Coverage::NoGuard`]: no guard runs on this node). When
//! it returns an error the process was not traced: the caller suspends it again instead of
//! unlocking, so that no restored context ever runs unguarded while a guard runs.

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

/// A process a [`Watcher`] let go of: it traces it again (if it still lives) when this is
/// dropped.
#[must_use = "dropping the lease hands the process back to the watcher at once"]
pub struct Lease<'w> {
    pid: ProcId,
    release: Option<Box<dyn FnOnce() + Send + 'w>>,
}

impl<'w> Lease<'w> {
    /// A lease on `pid` whose end runs `release` (which traces the process again if it lives).
    pub fn new(pid: ProcId, release: impl FnOnce() + Send + 'w) -> Self {
        Self {
            pid,
            release: Some(Box::new(release)),
        }
    }

    /// The process.
    pub fn pid(&self) -> ProcId {
        self.pid
    }
}

impl std::fmt::Debug for Lease<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lease").field("pid", &self.pid).finish()
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        if let Some(release) = self.release.take() {
            release();
        }
    }
}

/// Whoever traces processes on this node.
pub trait Watcher {
    /// Stops tracing `pid` (every thread) before returning, until the lease ends. `Ok(None)`: it
    /// was not tracing it.
    fn let_go(&self, pid: ProcId) -> Result<Option<Lease<'_>>, WatcherError>;

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
    fn let_go(&self, _pid: ProcId) -> Result<Option<Lease<'_>>, WatcherError> {
        Ok(None)
    }

    fn guard_before_unlock(&self, _procs: &[&ProcHandle]) -> Result<Coverage, WatcherError> {
        Ok(Coverage::NoGuard)
    }
}
