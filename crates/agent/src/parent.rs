//! The thread that thaws, and so is the parent of every restored worker.
//!
//! CRIU restores a tree as a child of the thread that ran the restore (`rst_sibling`), and a
//! long-lived caller must reap it when it ends, or it stays a zombie for the agent's whole life.
//! Reaping is delicate in the agent: the guard's tracer waits for its own tracees (`__WNOTHREAD`),
//! and a `waitpid` from another thread without `__WNOTHREAD` would take their ptrace stops from
//! it; a `waitpid(-1)` would also take children other code waits for (CRIU, health commands).
//! So every thaw runs on this one thread, and between thaws the thread reaps its own children
//! only (`waitpid(-1, WNOHANG | __WNOTHREAD)`): at that moment they can only be restored roots,
//! since what a thaw spawns itself is waited for by the thaw before it returns.

use std::sync::mpsc;
use std::time::Duration;

/// How often the thread reaps between jobs.
const REAP_EVERY: Duration = Duration::from_millis(500);

type Job = Box<dyn FnOnce() + Send>;

/// The thread's handle: jobs go in, one at a time.
#[derive(Debug)]
pub(crate) struct Parent {
    jobs: mpsc::Sender<Job>,
}

impl Parent {
    /// Starts the thread.
    pub(crate) fn start() -> std::io::Result<Parent> {
        let (jobs, rx) = mpsc::channel::<Job>();
        std::thread::Builder::new()
            .name("cryod-parent".into())
            .spawn(move || loop {
                match rx.recv_timeout(REAP_EVERY) {
                    Ok(job) => job(),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => break,
                }
                reap_own_children();
            })?;
        Ok(Parent { jobs })
    }

    /// Runs `f` on the thread and returns its result (`None`: the thread is gone).
    pub(crate) fn run<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (tx, rx) = mpsc::sync_channel(1);
        let job: Job = Box::new(move || {
            let _ = tx.send(f());
        });
        self.jobs.send(job).ok()?;
        rx.recv().ok()
    }
}

/// Reaps this thread's children that have ended, without waiting.
fn reap_own_children() {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WNOTHREAD)) {
            Ok(WaitStatus::StillAlive) | Err(_) => return,
            Ok(st) => tracing::info!(?st, "reaped a restored worker that ended"),
        }
    }
}
