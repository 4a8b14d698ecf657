//! Process identity that survives pid reuse: a pid plus the process's start time.

use std::fmt;

use cryo_proc::{Pid, ProcError};
use serde::{Deserialize, Serialize};

/// A process as the journal names it: its pid, its start time in clock ticks since boot
/// (`stat` field 22), so that a later process that reuses the pid is not taken for the one
/// recorded, and where the kernel has pidfs (Linux 6.9+) the inode of a pidfd of it, which tells
/// apart even two processes that got the same pid within one clock tick.
///
/// Equality, order and hash: pid and start time, then the pidfs inode when both sides have one
/// (a record written by an older build, or on an older kernel, has none and matches on pid and
/// start time alone, as before).
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ProcId {
    /// Host pid.
    pub pid: Pid,
    /// Start time in clock ticks after boot.
    pub start_time: u64,
    /// The pidfs inode of the process (`None`: unknown; the start time decides alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pidfs: Option<u64>,
}

impl PartialEq for ProcId {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == std::cmp::Ordering::Equal
    }
}

impl Eq for ProcId {}

impl PartialOrd for ProcId {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for ProcId {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.pid, self.start_time)
            .cmp(&(other.pid, other.start_time))
            .then_with(|| match (self.pidfs, other.pidfs) {
                (Some(a), Some(b)) => a.cmp(&b),
                _ => std::cmp::Ordering::Equal,
            })
    }
}

impl std::hash::Hash for ProcId {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        // The inode is left out: equal ids must hash alike, and one without it equals any.
        (self.pid, self.start_time).hash(state);
    }
}

impl ProcId {
    /// The process `pid` that started at `start_time` (no pidfs inode known).
    pub fn new(pid: Pid, start_time: u64) -> ProcId {
        ProcId {
            pid,
            start_time,
            pidfs: None,
        }
    }

    /// The identity of the process that holds `pid` now (a zombie included).
    pub fn of(pid: Pid) -> Result<ProcId, ProcError> {
        let start_time = cryo_proc::stat(pid)?.start_time;
        let pidfs = cryo_proc::pidfs_inode(pid);
        // The inode is this process's only if the pid still names it after the pidfd was opened.
        let same = cryo_proc::stat(pid).is_ok_and(|st| st.start_time == start_time);
        Ok(ProcId {
            pid,
            start_time,
            pidfs: pidfs.filter(|_| same),
        })
    }

    /// The identity of the process `handle` names (read when the handle was opened).
    pub fn of_handle(handle: &cryo_proc::ProcHandle) -> ProcId {
        ProcId {
            pid: handle.pid(),
            start_time: handle.start_time(),
            pidfs: handle.pidfs_inode(),
        }
    }

    /// Whether the pid still names this very process (same start time, and same pidfs inode when
    /// one is recorded) and it has not exited (a zombie counts as gone: its memory and fds, GPU
    /// context included, are already released).
    pub fn is_alive_same(&self) -> bool {
        let alive = cryo_proc::stat(self.pid)
            .is_ok_and(|st| st.start_time == self.start_time && st.state != 'Z' && st.state != 'X');
        alive && self.same_pidfs(cryo_proc::pidfs_inode(self.pid))
    }

    /// Opens the process this names, if its pid still does (start time, pidfs inode).
    pub fn open(&self) -> Result<cryo_proc::ProcHandle, ProcError> {
        let h = cryo_proc::ProcHandle::open_expected(self.pid, self.start_time)?;
        if !self.same_pidfs(h.pidfs_inode()) {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        Ok(h)
    }

    /// Whether `found` (the pidfs inode of the process holding the pid now) can be this one.
    fn same_pidfs(&self, found: Option<u64>) -> bool {
        match (self.pidfs, found) {
            (Some(a), Some(b)) => a == b,
            // Recorded with an inode, none readable now: gone (or the kernel changed under us).
            (Some(_), None) => false,
            (None, _) => true,
        }
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
    use cryo_testkit::procs::spawn_with_pid;

    #[test]
    fn own_process_is_alive_and_a_changed_start_time_is_not() {
        let me = ProcId::of(std::process::id() as i32).unwrap();
        assert!(me.is_alive_same());
        let other = ProcId::new(me.pid, me.start_time + 1);
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

    /// Whether this kernel puts pidfds on pidfs (Linux 6.9+), from its release.
    fn kernel_has_pidfs() -> bool {
        let r = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
        let mut it = r
            .trim()
            .split(['.', '-'])
            .map(|p| p.parse::<u32>().unwrap_or(0));
        let (major, minor) = (it.next().unwrap_or(0), it.next().unwrap_or(0));
        (major, minor) >= (6, 9)
    }

    /// Attack: a pid reused (forced through `ns_last_pid`). The dead process's id never matches
    /// the new one: not alive, not openable, not equal, not found in a set; and had the two
    /// started within one clock tick (the dead one's record with the new one's start time,
    /// which a start time alone cannot tell apart: the old `ProcId` matched it), the pidfs inode
    /// still tells them apart. A record without an inode (an older build's) falls back to the
    /// start time, as before.
    #[test]
    fn an_id_of_a_dead_process_never_matches_the_process_that_reused_its_pid() {
        for _ in 0..50 {
            let mut old = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .unwrap();
            let pid = old.id() as Pid;
            let dead = ProcId::of(pid).unwrap();
            assert_eq!(dead.pidfs.is_some(), kernel_has_pidfs(), "{dead:?}");
            old.kill().unwrap();
            old.wait().unwrap();
            let Some(mut new) = spawn_with_pid(pid) else {
                continue;
            };
            let now = ProcId::of(pid).unwrap();
            assert!(now.is_alive_same());
            assert!(!dead.is_alive_same());
            assert!(dead.open().is_err());
            if dead.start_time != now.start_time || dead.pidfs.is_some() {
                assert_ne!(dead, now);
            }
            if kernel_has_pidfs() {
                // The same tick, faked: only the inode differs.
                let same_tick = ProcId {
                    start_time: now.start_time,
                    ..dead
                };
                assert_ne!(same_tick, now);
                assert!(!same_tick.is_alive_same());
                assert!(same_tick.open().is_err());
                let set: std::collections::BTreeSet<ProcId> = [same_tick].into();
                assert!(!set.contains(&now));
                assert_eq!(now.open().unwrap().pid(), pid);
            }
            // Without an inode (an older record), the start time alone decides.
            let by_time = ProcId::new(pid, now.start_time);
            assert_eq!(by_time, now);
            assert!(by_time.is_alive_same());
            new.kill().unwrap();
            new.wait().unwrap();
            return;
        }
        panic!("no pid could be reused in 50 tries");
    }

    #[test]
    fn the_inode_is_optional_on_the_wire() {
        let old: ProcId = serde_json::from_str(r#"{"pid":7,"start_time":9}"#).unwrap();
        assert_eq!(old, ProcId::new(7, 9));
        assert_eq!(
            serde_json::to_string(&old).unwrap(),
            r#"{"pid":7,"start_time":9}"#
        );
        let new = ProcId {
            pidfs: Some(42),
            ..old
        };
        let text = serde_json::to_string(&new).unwrap();
        assert_eq!(text, r#"{"pid":7,"start_time":9,"pidfs":42}"#);
        assert_eq!(
            serde_json::from_str::<ProcId>(&text).unwrap().pidfs,
            Some(42)
        );
    }
}
