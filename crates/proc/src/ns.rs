//! Pid namespaces: translating a pid named by a process in another pid namespace (a client of
//! the guard inside a container, say) into cryo's.

use std::os::unix::fs::MetadataExt;

use crate::{Pid, ProcError};

/// The pid namespace of process `pid` (the inode of `/proc/PID/ns/pid`).
pub fn pid_namespace(pid: Pid) -> Result<u64, ProcError> {
    std::fs::metadata(format!("/proc/{pid}/ns/pid"))
        .map(|m| m.ino())
        .map_err(|e| ProcError::os("stat ns/pid", pid, e))
}

/// The inode of the initial pid namespace, fixed by the kernel (`PROC_PID_INIT_INO`).
pub const INITIAL_PID_NAMESPACE: u64 = 0xEFFF_FFFC;

/// The inode of the initial cgroup namespace, fixed by the kernel (`PROC_CGROUP_INIT_INO`).
pub const INITIAL_CGROUP_NAMESPACE: u64 = 0xEFFF_FFFB;

/// Whether cryo runs in the initial (host's) cgroup namespace, where the root of a cgroup
/// hierarchy is the whole host's (in a container's own namespace it is the container's).
pub fn in_initial_cgroup_namespace() -> Result<bool, ProcError> {
    std::fs::metadata("/proc/self/ns/cgroup")
        .map(|m| m.ino() == INITIAL_CGROUP_NAMESPACE)
        .map_err(|e| ProcError::os("stat ns/cgroup", std::process::id() as Pid, e))
}

/// Whether cryo runs in the initial (host's) pid namespace, where the GPU driver's pids (NVML's
/// process list) are cryo's pids. In any other (a container without the host's pid namespace)
/// they cannot be told apart: the driver records host pids, which `NSpid` does not show from
/// inside, and whether it translates them to the caller's namespace is not documented.
pub fn in_initial_pid_namespace() -> Result<bool, ProcError> {
    std::fs::metadata("/proc/self/ns/pid")
        .map(|m| m.ino() == INITIAL_PID_NAMESPACE)
        .map_err(|e| ProcError::os("stat ns/pid", std::process::id() as Pid, e))
}

/// The pid, in cryo's namespace, of the process that `peer` (a process cryo sees) names `pid`
/// in its own pid namespace. `Ok(None)`: no process of that namespace has that pid.
///
/// The same namespace as cryo's: `pid` as it is. Otherwise the process must be in the peer's
/// very namespace (not one nested below it): its `NSpid` ends in `pid` (`/proc/PID/status`).
pub fn translate_pid(peer: Pid, pid: Pid) -> Result<Option<Pid>, ProcError> {
    let theirs = pid_namespace(peer)?;
    if theirs == pid_namespace(std::process::id() as Pid)? {
        return Ok(Some(pid));
    }
    let all = procfs::process::all_processes()
        .map_err(|source| ProcError::ReadSystem { file: "", source })?;
    for p in all.flatten() {
        // Processes vanish while we scan; that is not an error.
        let Ok(status) = crate::status(p.pid()) else {
            continue;
        };
        if status.nspid.last() == Some(&pid)
            && status.nspid.len() > 1
            && pid_namespace(p.pid()).is_ok_and(|ns| ns == theirs)
        {
            return Ok(Some(p.pid()));
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A grandchild after `unshare(CLONE_NEWPID)` is never in the initial pid namespace (it
    /// answers through its exit status: forked from a threaded harness, it only makes syscalls
    /// before `_exit`).
    #[test]
    fn the_initial_pid_namespace_is_told_from_a_nested_one() {
        use nix::sched::{unshare, CloneFlags};
        use nix::sys::wait::{waitpid, WaitStatus};
        use nix::unistd::{fork, ForkResult};
        // Ours, by the link's text ("pid:[4026531836]" in the host's).
        let link = std::fs::read_link("/proc/self/ns/pid").unwrap();
        assert_eq!(
            in_initial_pid_namespace().unwrap(),
            link.to_str() == Some(&format!("pid:[{INITIAL_PID_NAMESPACE}]")),
            "{link:?}"
        );
        // SAFETY: the child only makes syscalls and `_exit`s.
        match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                let code = (|| {
                    unshare(CloneFlags::CLONE_NEWPID).ok()?;
                    // SAFETY: as above.
                    match unsafe { fork() }.ok()? {
                        ForkResult::Child => {
                            let nested = matches!(in_initial_pid_namespace(), Ok(false));
                            // SAFETY: _exit ends the forked child at once.
                            unsafe { libc::_exit(if nested { 0 } else { 2 }) }
                        }
                        ForkResult::Parent { child } => match waitpid(child, None).ok()? {
                            WaitStatus::Exited(_, c) => Some(c),
                            _ => None,
                        },
                    }
                })()
                .unwrap_or(3);
                // SAFETY: as above.
                unsafe { libc::_exit(code) }
            }
            ForkResult::Parent { child } => {
                assert_eq!(waitpid(child, None).unwrap(), WaitStatus::Exited(child, 0));
            }
        }
    }

    #[test]
    fn a_peer_in_our_namespace_names_our_pids() {
        let me = std::process::id() as Pid;
        assert_eq!(translate_pid(me, 1).unwrap(), Some(1));
        assert_eq!(translate_pid(me, me).unwrap(), Some(me));
    }
}
