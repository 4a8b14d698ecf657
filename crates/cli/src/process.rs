//! The one process an operator command names (`cryo gpu ...`, the `cuda-checkpoint` front end, the
//! root of `cryo freeze`): looked up (`cryo_proc`) and held through a pidfd before any driver call,
//! so that a pid that does not exist, names a thread, or is reused mid-call is reported rather
//! than acted upon blindly. What a procedure acts on as a whole is a `cryo_lifecycle::Target`.

use anyhow::bail;
use cryo_proc::Pid;
use cryo_proc::ProcHandle;

/// Opens the process `pid` names for an operator command: it must exist and be a process, not a
/// thread of one ([`cryo_lifecycle::open_process`]).
pub fn open_process(pid: Pid) -> anyhow::Result<ProcHandle> {
    Ok(cryo_lifecycle::open_process(pid)?)
}

/// After an action: the process held by `handle` must still be there, else the pid may have
/// named another process by the time the driver looked it up.
pub fn check_still_alive(handle: &ProcHandle) -> anyhow::Result<()> {
    if !handle.is_alive() {
        bail!(
            "pid {} exited during the call; its result applies to a process that is gone",
            handle.pid()
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_is_its_own_thread_group() {
        let me = std::process::id() as Pid;
        assert!(open_process(me).is_ok());
    }

    #[test]
    fn a_thread_is_refused_with_its_process_named() {
        let thread = cryo_testkit::procs::Thread::start();
        let tid = thread.tid;
        let me = std::process::id() as Pid;
        let err = open_process(tid).unwrap_err().to_string();
        assert_eq!(
            err,
            format!("pid {tid} is a thread of process {me}; use --pid {me}")
        );
    }

    #[test]
    fn a_missing_pid_is_refused() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as Pid;
        child.wait().unwrap();
        assert_eq!(
            open_process(pid).unwrap_err().to_string(),
            format!("pid {pid} does not exist")
        );
    }
}
