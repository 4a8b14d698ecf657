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

    #[test]
    fn a_peer_in_our_namespace_names_our_pids() {
        let me = std::process::id() as Pid;
        assert_eq!(translate_pid(me, 1).unwrap(), Some(1));
        assert_eq!(translate_pid(me, me).unwrap(), Some(me));
    }
}
