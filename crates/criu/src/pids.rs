//! Which pids a restore would collide with.

use std::collections::BTreeSet;
use std::fs;

use cryo_gpu::Pid;

/// The pids of `wanted` that the kernel still has allocated: as a process or thread id, or as
/// the process group or session id of any process. CRIU restores every process with its
/// original pid and fails with `EEXIST` ("Can't fork for N: File exists") on any of these. A
/// dumped tree's pids stay taken until its last member is reaped, including members reparented
/// to an init that reaps lazily, so thaw prechecks and tests wait on this, not on the root's exit.
pub fn pids_in_use(wanted: &[Pid]) -> Vec<Pid> {
    let wanted: BTreeSet<Pid> = wanted.iter().copied().collect();
    let mut busy = BTreeSet::new();
    let Ok(proc) = fs::read_dir("/proc") else {
        // Without /proc nothing can be ruled out: report everything as taken.
        return wanted.into_iter().collect();
    };
    for entry in proc.flatten() {
        let name = entry.file_name();
        let Some(pid) = name.to_str().and_then(|n| n.parse::<Pid>().ok()) else {
            continue;
        };
        if let Ok(stat) = fs::read_to_string(entry.path().join("stat")) {
            // Fields after the parenthesised comm: state ppid pgrp session ...
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                for v in [f.get(2), f.get(3)].into_iter().flatten() {
                    if let Ok(id) = v.parse::<Pid>() {
                        if wanted.contains(&id) {
                            busy.insert(id);
                        }
                    }
                }
            }
        }
        if wanted.contains(&pid) {
            busy.insert(pid);
        }
        if let Ok(tasks) = fs::read_dir(entry.path().join("task")) {
            for t in tasks.flatten() {
                if let Some(tid) = t.file_name().to_str().and_then(|n| n.parse::<Pid>().ok()) {
                    if wanted.contains(&tid) {
                        busy.insert(tid);
                    }
                }
            }
        }
    }
    busy.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_pid_group_and_session_are_in_use() {
        let me = std::process::id() as Pid;
        let pgrp = nix::unistd::getpgrp().as_raw();
        let sid = nix::unistd::getsid(None).unwrap().as_raw();
        let busy = pids_in_use(&[me, pgrp, sid]);
        assert!(busy.contains(&me) && busy.contains(&pgrp) && busy.contains(&sid));
        let pid_max: Pid = fs::read_to_string("/proc/sys/kernel/pid_max")
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        assert!(pids_in_use(&[pid_max + 1]).is_empty());
    }
}
