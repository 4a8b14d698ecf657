//! Whoever traces processes on this node (the guard), as the lifecycle sees it: asked to let go of
//! a process that CRIU must trace itself, and to take it back afterwards.
//!
//! # Design
//! A small trait so that the lifecycle does not depend on the guard: the guard implements it
//! in-process (the node agent), and its socket client implements it for a standalone command
//! talking to a running guard. Processes are named by pid and start time, so a pid reused in
//! between is never detached or attached by mistake. [`NoWatcher`] is the node without a guard.

use cryo_journal::ProcId;

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
}
