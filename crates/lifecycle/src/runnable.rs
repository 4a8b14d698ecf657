//! Whether a process can run at all: the driver's restore thread inside it must run for any lock,
//! checkpoint or restore to happen.
//!
//! # Design
//! A process whose every thread is stopped (`T`: SIGSTOP, job control; `t`: a ptrace stop) cannot
//! run the driver's restore thread, so a lock on it waits out its timeout and the other calls
//! hang. [`runnable`] tells this up front from `/proc` (every thread's state and tracer):
//! - [`Runnable::JobControl`]: stopped by a signal, untraced (or traced by cryo's own guard, the
//!   same executable as this process, which lets a group stop end on SIGCONT). [`resume`] sends
//!   SIGCONT and waits for a thread to run.
//! - [`Runnable::Debugger`]: stopped and traced by anything else. Nothing but its tracer can
//!   resume it; callers refuse at once, naming the tracer.
//!
//! A process with one thread held in a signal-delivery stop (the guard holding a fatal signal)
//! still runs its other threads, restore thread included: it is [`Runnable::Runs`].

use std::time::{Duration, Instant};

use cryo_proc::{Pid, ProcError, ProcHandle, Signal};

/// Whether a process can run its driver's restore thread.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Runnable {
    /// At least one thread can run.
    Runs,
    /// Every thread is stopped by job control (SIGSTOP, SIGTSTP...): SIGCONT resumes it.
    JobControl,
    /// Every thread is stopped and traced by `tracer` (a debugger, `strace`...).
    Debugger {
        /// The tracer's thread id.
        tracer: Pid,
        /// Its command name (empty when it cannot be read).
        comm: String,
    },
    /// It has exited.
    Exited,
}

/// Whether `h` can run (see the module docs).
pub fn runnable(h: &ProcHandle) -> Result<Runnable, ProcError> {
    let tids = match h.tasks() {
        Ok(t) => t,
        Err(_) if !h.is_alive() => return Ok(Runnable::Exited),
        Err(e) => return Err(e),
    };
    let mut foreign_tracer = None;
    let mut any = false;
    for tid in tids {
        let st = match h.thread_status(tid) {
            Ok(st) => st,
            // A thread that exited meanwhile does not run.
            Err(ProcError::NoSuchProcess(_)) => continue,
            Err(e) if !h.is_alive() => {
                tracing::debug!(error = %e, "exited while its threads were read");
                return Ok(Runnable::Exited);
            }
            Err(e) => return Err(e),
        };
        any = true;
        match st.state {
            'T' | 't' => {
                if st.tracer_pid != 0 && !cryo_proc::runs_our_executable(st.tracer_pid) {
                    foreign_tracer.get_or_insert(st.tracer_pid);
                }
            }
            'Z' | 'X' => {}
            _ => return Ok(Runnable::Runs),
        }
    }
    if !any || !h.is_alive() {
        return Ok(Runnable::Exited);
    }
    Ok(match foreign_tracer {
        Some(tracer) => Runnable::Debugger {
            tracer,
            comm: cryo_proc::stat(tracer).map(|s| s.comm).unwrap_or_default(),
        },
        None => Runnable::JobControl,
    })
}

/// Resumes a process stopped by job control (SIGCONT) and waits up to `timeout` for one of its
/// threads to run; what it is then.
pub fn resume(h: &ProcHandle, timeout: Duration) -> Result<Runnable, ProcError> {
    h.signal(Signal::SIGCONT)?;
    let deadline = Instant::now() + timeout;
    loop {
        let now = runnable(h)?;
        if now != Runnable::JobControl || Instant::now() >= deadline {
            return Ok(now);
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

impl Runnable {
    /// Why it cannot be suspended, in words (`None` when it runs).
    pub fn why_not(&self, pid: Pid) -> Option<String> {
        match self {
            Runnable::Runs => None,
            Runnable::JobControl => Some(format!(
                "pid {pid} is stopped (job control: SIGSTOP or SIGTSTP); the driver's restore thread cannot run"
            )),
            Runnable::Debugger { tracer, comm } => Some(format!(
                "pid {pid} is stopped under a debugger (traced by pid {tracer} {comm:?}); the driver's restore thread cannot run"
            )),
            Runnable::Exited => Some(format!("pid {pid} has exited")),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::procs::{self, Procs};
    use cryo_testkit::{eventually, PATIENCE};

    #[test]
    fn a_stopped_process_is_job_control_and_sigcont_resumes_it() {
        let p = Procs::spawn(1);
        let h = ProcHandle::open(p.pid(0)).unwrap();
        assert_eq!(runnable(&h).unwrap(), Runnable::Runs);
        h.signal(Signal::SIGSTOP).unwrap();
        eventually(PATIENCE, "the process to stop", || {
            procs::all_threads_in(p.pid(0), &['T'])
        });
        assert_eq!(runnable(&h).unwrap(), Runnable::JobControl);
        assert_eq!(resume(&h, PATIENCE).unwrap(), Runnable::Runs);
    }

    #[test]
    fn a_process_stopped_under_a_debugger_names_it() {
        let p = Procs::spawn(1);
        let h = ProcHandle::open(p.pid(0)).unwrap();
        let debugger = procs::Debugger::attach(p.pid(0));
        assert_eq!(
            runnable(&h).unwrap(),
            Runnable::Debugger {
                tracer: debugger.pid(),
                comm: "perl".into()
            }
        );
    }

    #[test]
    fn a_process_stopped_under_cryos_own_tracer_is_job_control() {
        let p = Procs::spawn(1);
        let h = ProcHandle::open(p.pid(0)).unwrap();
        let me = rustix::thread::gettid().as_raw_nonzero().get();
        let target = nix::unistd::Pid::from_raw(p.pid(0));
        nix::sys::ptrace::attach(target).unwrap();
        eventually(PATIENCE, "the tracee to stop", || {
            procs::all_threads_in(p.pid(0), &['t'])
        });
        // This test binary is its own tracer's executable: that is how cryo's guard looks.
        assert_eq!(runnable(&h).unwrap(), Runnable::JobControl);
        assert!(cryo_proc::runs_our_executable(me));
        nix::sys::ptrace::detach(target, None).unwrap();
    }
}
