//! Process identity that survives pid reuse: a pid plus the process's start time.

use std::fmt;

use cryo_proc::{Pid, ProcError};
use serde::{Deserialize, Serialize};

/// A process as the journal names it: its pid and its start time in clock ticks since boot
/// (`stat` field 22), so that a later process that reuses the pid is not taken for the
/// one recorded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ProcId {
    /// Host pid.
    pub pid: Pid,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
}

impl ProcId {
    /// The identity of the process that holds `pid` now.
    pub fn of(pid: Pid) -> Result<ProcId, ProcError> {
        let start_time = cryo_proc::stat(pid)?.start_time;
        Ok(ProcId { pid, start_time })
    }

    /// The identity of the process `handle` names (read when the handle was opened).
    pub fn of_handle(handle: &cryo_proc::ProcHandle) -> ProcId {
        ProcId {
            pid: handle.pid(),
            start_time: handle.start_time(),
        }
    }

    /// Whether the pid still names this very process (same start time) and it has not exited
    /// (a zombie counts as gone: its memory and fds, GPU context included, are already released).
    pub fn is_alive_same(&self) -> bool {
        cryo_proc::stat(self.pid)
            .is_ok_and(|st| st.start_time == self.start_time && st.state != 'Z' && st.state != 'X')
    }
}

impl fmt::Display for ProcId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.pid)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_process_is_alive_and_a_changed_start_time_is_not() {
        let me = ProcId::of(std::process::id() as i32).unwrap();
        assert!(me.is_alive_same());
        let other = ProcId {
            start_time: me.start_time + 1,
            ..me
        };
        assert!(!other.is_alive_same());
    }

    #[test]
    fn exited_child_is_not_alive() {
        let mut child = std::process::Command::new("sleep")
            .arg("100")
            .spawn()
            .unwrap();
        let id = ProcId::of(child.id() as i32).unwrap();
        assert!(id.is_alive_same());
        child.kill().unwrap();
        // Not reaped yet: the zombie must already count as gone.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while id.is_alive_same() {
            assert!(
                std::time::Instant::now() < deadline,
                "killed child never became a zombie"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!(
            ProcId::of(id.pid).unwrap(),
            id,
            "the zombie still holds its pid"
        );
        child.wait().unwrap();
        assert!(!id.is_alive_same());
    }
}
