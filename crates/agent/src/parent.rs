//! The thread that thaws, and so is the parent of every restored worker.
//!
//! CRIU restores a tree as a child of the thread that ran the restore (`rst_sibling`), and a
//! long-lived caller must reap it when it ends, or it stays a zombie for the agent's whole life.
//! Reaping is delicate in the agent: the guard's tracer waits for its own tracees (`__WNOTHREAD`),
//! and a `waitpid` from another thread without `__WNOTHREAD` would take their ptrace stops from
//! it; a `waitpid(-1)` would also take children other code waits for (CRIU, health commands).
//! So every thaw runs on this one thread, and between thaws the thread reaps its own children
//! only: at that moment they can only be restored roots, since what a thaw spawns itself is
//! waited for by the thaw before it returns. Those the guard traces are its tracer's to wait for
//! even so: the kernel shows this thread their ptrace stops and their end as if it were the
//! tracer (both in one process), so a plain `waitpid(-1, WNOHANG | __WNOTHREAD)` here took a
//! killed worker's exit stop now and then (the worker stayed held there, never pinned nor let
//! go: session 17's flake) or its end (the tracer kept a process that was gone). Only ends of
//! untraced children are taken ([`cryo_proc::reap_children`]).

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

/// Reaps this thread's children that have ended and that nothing traces, without waiting.
fn reap_own_children() {
    match cryo_proc::reap_children() {
        Ok(r) => {
            for (pid, end) in r.ended {
                tracing::info!(pid, %end, "reaped a restored worker that ended");
            }
            for err in r.failed {
                tracing::warn!(%err, "cannot reap a child of the thaw thread");
            }
        }
        Err(err) => tracing::warn!(%err, "cannot list the thaw thread's children"),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::Parent;
    use nix::sys::ptrace;
    use nix::sys::signal::{kill, Signal};
    use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
    use nix::unistd::Pid;

    /// A process started on the parent thread (its child, as a restored worker is).
    fn child_of(parent: &Parent, program: &str, args: &[&str]) -> Pid {
        let (program, args) = (program.to_string(), args.iter().map(|a| a.to_string()));
        let args: Vec<String> = args.collect();
        // Not waited for here: the parent thread (or the tracer) is what the test is about.
        let child = parent
            .run(move || {
                std::process::Command::new(program)
                    .args(args)
                    .spawn()
                    .map(|c| c.id())
            })
            .unwrap()
            .unwrap();
        Pid::from_raw(i32::try_from(child).unwrap())
    }

    /// Returns once the parent thread has reaped at least once since the call: it reaps after
    /// every job, so the first job's reap is done when the second job runs.
    fn let_it_reap(parent: &Parent) {
        parent.run(|| ()).unwrap();
        parent.run(|| ()).unwrap();
    }

    /// Waits (without taking it) until `pid`, traced by this thread, has something to report.
    fn peek_as_tracer(pid: Pid) -> WaitStatus {
        let flags = WaitPidFlag::WEXITED
            | WaitPidFlag::WSTOPPED
            | WaitPidFlag::WNOWAIT
            | WaitPidFlag::__WALL
            | WaitPidFlag::__WNOTHREAD;
        waitid(Id::Pid(pid), flags).unwrap()
    }

    /// What the tracer (this thread) is owed by `pid` now, taken.
    fn take_as_tracer(pid: Pid) -> nix::Result<WaitStatus> {
        waitpid(
            pid,
            Some(WaitPidFlag::WNOHANG | WaitPidFlag::__WALL | WaitPidFlag::__WNOTHREAD),
        )
    }

    /// Attack (session 17's flake: a worker thawed through the agent and `kill -9`ed never
    /// died). A thawed worker is the parent thread's child and is traced by the guard's tracer,
    /// another thread of the same process: the kernel then lets the real parent's wait take the
    /// child's ptrace stops and its end as if it were the tracer. The reaping between jobs must
    /// take neither: the exit stop (where the guard pins the context) left to a parent thread that
    /// took it left the worker held there for good (and unpinned: a restarted agent lets it tear
    /// its context down), and an end taken from the tracer leaves it tracing a process that is
    /// gone, whose pid the next restore of the image takes again. This test's thread is the tracer.
    #[test]
    fn the_parent_thread_leaves_a_traced_child_s_exit_stop_and_end_to_its_tracer() {
        let parent = Parent::start().unwrap();
        let pid = child_of(&parent, "sleep", &["600"]);
        ptrace::seize(pid, ptrace::Options::PTRACE_O_TRACEEXIT).unwrap();
        kill(pid, Signal::SIGKILL).unwrap();
        let exit_stop = WaitStatus::PtraceEvent(pid, Signal::SIGTRAP, libc::PTRACE_EVENT_EXIT);
        assert_eq!(peek_as_tracer(pid), exit_stop);
        let_it_reap(&parent);
        let stop = take_as_tracer(pid);
        // Whatever happened, the worker must not stay held at its exit stop after the test.
        let _ = ptrace::cont(pid, None);
        assert_eq!(
            stop,
            Ok(exit_stop),
            "the parent thread took the exit stop of a child its process traces"
        );
        let end = WaitStatus::Signaled(pid, Signal::SIGKILL, false);
        assert_eq!(peek_as_tracer(pid), end);
        let_it_reap(&parent);
        assert_eq!(
            take_as_tracer(pid),
            Ok(end),
            "the parent thread took the end of a child its process traces"
        );
    }

    /// What nothing traces is reaped by the parent thread once it ended (a zombie keeps its pid).
    #[test]
    fn the_parent_thread_reaps_an_untraced_child_that_ended() {
        let parent = Parent::start().unwrap();
        let pid = child_of(&parent, "sh", &["-c", "exit 3"]);
        // Waits for its end without taking it. The parent thread reaps every 500 ms as well as
        // after each job, so it may have taken the end already (ECHILD): a poll for the zombie
        // could miss it and wait forever (it did, under load, in a landing's suite).
        let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOWAIT;
        match waitid(Id::Pid(pid), flags) {
            Ok(end) => assert_eq!(end, WaitStatus::Exited(pid, 3)),
            Err(err) => assert_eq!(err, nix::errno::Errno::ECHILD, "waiting for the child"),
        }
        let_it_reap(&parent);
        // Any thread of this process may wait for it: it is gone (ECHILD) once reaped.
        assert_eq!(
            waitpid(pid, Some(WaitPidFlag::WNOHANG)),
            Err(nix::errno::Errno::ECHILD),
            "a child that ended is not reaped"
        );
    }
}
