//! What the daemon reads from `/proc`: a process's socket fds, listening unix sockets, and how a
//! process died (`/proc/PID/stat` through `cryo-proc`).

use std::collections::HashMap;
use std::io;
use std::time::{Duration, Instant};

use cryo_gpu::Pid;

/// Whether `/proc/PID` exists (a zombie still does).
pub fn exists(pid: Pid) -> bool {
    pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether a process still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// Not a zombie.
    Alive,
    /// Dead, not reaped: no fd table, no threads.
    Zombie,
    /// No such process.
    Gone,
}

/// Reads `pid`'s state from `/proc/PID/stat`.
pub fn liveness(pid: Pid) -> Liveness {
    match cryo_proc::stat(pid) {
        Err(_) => Liveness::Gone,
        Ok(st) if matches!(st.state, 'Z' | 'X') => Liveness::Zombie,
        Ok(_) => Liveness::Alive,
    }
}

/// `(fd, inode)` of every socket in `pid`'s fd table.
pub fn socket_fds(pid: Pid) -> io::Result<Vec<(i32, u64)>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))? {
        let entry = entry?;
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<i32>().ok())
        else {
            continue;
        };
        // The fd may close between listing and reading: skip it.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
            .and_then(|t| t.parse::<u64>().ok())
        else {
            continue;
        };
        out.push((fd, inode));
    }
    Ok(out)
}

/// Listening unix sockets whose (abstract) name starts with `prefix` (`@...`): inode -> name.
pub fn listening_unix(prefix: &str) -> io::Result<HashMap<u64, String>> {
    const ACCEPTCON: u32 = 0x0001_0000;
    let text = std::fs::read_to_string("/proc/net/unix")?;
    let mut out = HashMap::new();
    for line in text.lines().skip(1) {
        let cols: Vec<&str> = line.split_whitespace().collect();
        let (Some(flags), Some(inode), Some(path)) = (cols.get(3), cols.get(6), cols.get(7)) else {
            continue;
        };
        let listening = u32::from_str_radix(flags, 16).is_ok_and(|f| f & ACCEPTCON != 0);
        if !listening || !path.starts_with(prefix) {
            continue;
        }
        if let Ok(inode) = inode.parse() {
            out.insert(inode, (*path).to_string());
        }
    }
    Ok(out)
}

/// How `pid` died, read from its zombie's `/proc/PID/stat` (waiting briefly for it to become
/// one: the kernel closes a dying process's files before it turns into a zombie).
pub fn death(pid: Pid) -> String {
    let deadline = Instant::now() + Duration::from_secs(1);
    loop {
        match cryo_proc::stat(pid) {
            Err(_) => return "unknown".to_string(),
            Ok(st) => {
                if let (Some(status), 'Z' | 'X') = (st.exit_code, st.state) {
                    return cryo_proc::describe_wait_status(status);
                }
            }
        }
        if Instant::now() >= deadline {
            return "closed its context while alive".to_string();
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_socket_fds_are_listed() {
        assert!(socket_fds(std::process::id() as Pid).is_ok());
    }
}
