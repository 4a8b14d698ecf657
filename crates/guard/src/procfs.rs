//! What the guard reads from and writes to `/proc/PID`.

use std::fs;
use std::io;
use std::os::fd::RawFd;
use std::path::PathBuf;

use crate::pidfd::PidFd;
use crate::Pid;

/// Reading `/proc` failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// reading {path} failed: {source}
    #[error("reading {path} failed: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// {path} has no valid `{field}` line
    #[error("{path} has no valid `{field}` line")]
    Field { path: PathBuf, field: &'static str },
}

fn read(path: PathBuf) -> Result<String, ProcError> {
    fs::read_to_string(&path).map_err(|source| ProcError::Read { path, source })
}

fn numeric_entries(path: PathBuf) -> Result<Vec<i32>, ProcError> {
    let dir = fs::read_dir(&path).map_err(|source| ProcError::Read {
        path: path.clone(),
        source,
    })?;
    let mut out = Vec::new();
    for entry in dir {
        let entry = entry.map_err(|source| ProcError::Read {
            path: path.clone(),
            source,
        })?;
        if let Some(n) = entry.file_name().to_str().and_then(|s| s.parse().ok()) {
            out.push(n);
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// The thread ids of `pid` (`/proc/PID/task`).
pub fn task_ids(pid: Pid) -> Result<Vec<Pid>, ProcError> {
    numeric_entries(PathBuf::from(format!("/proc/{pid}/task")))
}

/// The open fd numbers of `pid` (`/proc/PID/fd`).
pub fn fd_numbers(pid: Pid) -> Result<Vec<RawFd>, ProcError> {
    numeric_entries(PathBuf::from(format!("/proc/{pid}/fd")))
}

/// What fd `fd` of `pid` refers to (`/proc/PID/fd/N`).
pub fn fd_target(pid: Pid, fd: RawFd) -> Result<PathBuf, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/fd/{fd}"));
    fs::read_link(&path).map_err(|source| ProcError::Read { path, source })
}

/// The fields of `/proc/TID/status` the guard uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskStatus {
    /// `State:` letter (`t` = ptrace stop, `T` = stopped, `Z` zombie...).
    pub state: char,
    pub tgid: Pid,
    /// 0 when untraced; else the tracer *thread* id.
    pub tracer_pid: Pid,
    /// Signals with a handler installed (bit `n-1` for signal `n`); shared by all threads.
    pub sig_caught: u64,
    /// Signals set to `SIG_IGN`.
    pub sig_ignored: u64,
    /// Signals pending for this thread (not the shared queue).
    pub sig_pending: u64,
}

/// Parses `/proc/TID/status` (any thread id works, listed in `/proc` or not).
pub fn task_status(tid: Pid) -> Result<TaskStatus, ProcError> {
    let path = PathBuf::from(format!("/proc/{tid}/status"));
    let text = read(path.clone())?;
    parse_status(&text).map_err(|field| ProcError::Field { path, field })
}

fn parse_status(text: &str) -> Result<TaskStatus, &'static str> {
    let field = |name: &'static str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
            .map(str::trim)
            .ok_or(name)
    };
    let int = |name| field(name)?.parse::<Pid>().map_err(|_| name);
    let mask = |name| u64::from_str_radix(field(name)?, 16).map_err(|_| name);
    Ok(TaskStatus {
        state: field("State")?.chars().next().ok_or("State")?,
        tgid: int("Tgid")?,
        tracer_pid: int("TracerPid")?,
        sig_caught: mask("SigCgt")?,
        sig_ignored: mask("SigIgn")?,
        sig_pending: mask("SigPnd")?,
    })
}

/// Setting `oom_score_adj` failed.
#[derive(Debug, thiserror::Error)]
pub enum OomAdjError {
    /// value {value} is outside -1000..=1000
    #[error("oom_score_adj value {value} is outside -1000..=1000")]
    Range { value: i32 },
    /// this machine does not permit setting oom_score_adj of {pid} to {value} (lowering it needs CAP_SYS_RESOURCE): {source}
    #[error("this machine does not permit setting oom_score_adj of {pid} to {value} (lowering it needs CAP_SYS_RESOURCE): {source}")]
    NotPermitted {
        pid: Pid,
        value: i32,
        source: io::Error,
    },
    /// process {pid} is gone
    #[error("process {pid} is gone")]
    Gone { pid: Pid },
    /// writing oom_score_adj of {pid} failed: {source}
    #[error("writing oom_score_adj of {pid} failed: {source}")]
    Io { pid: Pid, source: io::Error },
}

/// Reads `/proc/PID/oom_score_adj`.
pub fn oom_score_adj(pid: Pid) -> Result<i32, ProcError> {
    let path = PathBuf::from(format!("/proc/{pid}/oom_score_adj"));
    let text = read(path.clone())?;
    text.trim().parse().map_err(|_| ProcError::Field {
        path,
        field: "oom_score_adj",
    })
}

/// Sets `oom_score_adj` of the pidfd's process. The `/proc/PID` directory is opened first and
/// the pidfd checked alive after, so the write lands on that process even if the pid is reused
/// (a `/proc/PID` directory fd stays bound to the process it was opened for).
pub fn set_oom_score_adj(process: &PidFd, value: i32) -> Result<(), OomAdjError> {
    use std::io::Write;
    use std::os::fd::AsRawFd;
    let pid = process.pid();
    if !(-1000..=1000).contains(&value) {
        return Err(OomAdjError::Range { value });
    }
    let dir = fs::File::open(format!("/proc/{pid}")).map_err(|_| OomAdjError::Gone { pid })?;
    if !process.is_alive() {
        return Err(OomAdjError::Gone { pid });
    }
    let path = format!("/proc/self/fd/{}/oom_score_adj", dir.as_raw_fd());
    let classify = |source: io::Error| match source.raw_os_error() {
        Some(libc::EPERM | libc::EACCES) => OomAdjError::NotPermitted { pid, value, source },
        Some(libc::ESRCH) => OomAdjError::Gone { pid },
        _ => OomAdjError::Io { pid, source },
    };
    let mut f = fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map_err(classify)?;
    f.write_all(value.to_string().as_bytes()).map_err(classify)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn status_fields_parse() {
        let text = "Name:\tx\nState:\tt (tracing stop)\nTgid:\t42\nPid:\t43\nTracerPid:\t7\n\
                    SigPnd:\t0000000000000100\nShdPnd:\t0\nSigBlk:\t0\n\
                    SigIgn:\t0000000000001000\nSigCgt:\t0000000180004002\n";
        let s = parse_status(text).unwrap();
        assert_eq!(s.state, 't');
        assert_eq!((s.tgid, s.tracer_pid), (42, 7));
        assert_eq!(s.sig_caught, 0x1_8000_4002);
        assert_eq!(s.sig_ignored, 0x1000);
        assert_eq!(s.sig_pending, 0x100);
        assert_eq!(parse_status("State:\tR\n"), Err("Tgid"));
    }

    #[test]
    fn own_status_and_tasks() {
        let me = i32::try_from(std::process::id()).unwrap();
        assert_eq!(task_status(me).unwrap().tgid, me);
        assert!(task_ids(me).unwrap().contains(&me));
        assert!(fd_numbers(me).unwrap().contains(&0));
    }
}
