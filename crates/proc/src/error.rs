//! The errors of acting on a process.

use std::io;
use std::path::PathBuf;

use crate::Pid;

/// Reading or acting on a process failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// No such process (never was, exited and reaped, or, for a read, exited).
    #[error("pid {0} does not exist")]
    NoSuchProcess(Pid),
    /// The pid now names another process than the one recorded.
    #[error("pid {pid} was reused: it started at tick {found}, not {expected} as recorded")]
    Reused {
        /// The pid.
        pid: Pid,
        /// Start time recorded earlier.
        expected: u64,
        /// Start time of the process holding the pid now.
        found: u64,
    },
    /// A file under `/proc` could not be read or parsed.
    #[error("cannot read /proc/{pid}/{file}: {source}")]
    Read {
        /// The pid (or thread id).
        pid: Pid,
        /// The file under `/proc/PID`.
        file: &'static str,
        /// What `procfs` said.
        source: procfs::ProcError,
    },
    /// A system-wide `/proc` file could not be read or parsed.
    #[error("cannot read /proc/{file}: {source}")]
    ReadSystem {
        /// The file under `/proc`.
        file: &'static str,
        /// What `procfs` said.
        source: procfs::ProcError,
    },
    /// A system call on the process failed.
    #[error("{what} for pid {pid}: {source}")]
    Os {
        /// The call.
        what: &'static str,
        /// The pid.
        pid: Pid,
        /// The error.
        source: io::Error,
    },
    /// Duplicating fd `fd` of the process (`pidfd_getfd`) failed.
    #[error("pidfd_getfd of fd {fd} of pid {pid} failed: {source}")]
    GetFd {
        /// The pid.
        pid: Pid,
        /// The fd number in the process.
        fd: i32,
        /// The error (`EBADF`: closed since it was listed; `EPERM`: no ptrace rights).
        source: io::Error,
    },
    /// A cgroup's process list could not be read.
    #[error("cannot read the processes of cgroup {path}: {source}")]
    Cgroup {
        /// `cgroup.procs` path.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl ProcError {
    /// Maps a `procfs` error on `/proc/PID/file`: a process that is gone is [`ProcError::NoSuchProcess`].
    pub(crate) fn read(pid: Pid, file: &'static str, source: procfs::ProcError) -> Self {
        let gone = match &source {
            procfs::ProcError::NotFound(_) => true,
            procfs::ProcError::Io(e, _) => e.raw_os_error() == Some(libc::ESRCH),
            _ => false,
        };
        if gone {
            ProcError::NoSuchProcess(pid)
        } else {
            ProcError::Read { pid, file, source }
        }
    }

    /// Maps an error of a system call on `pid`: `ESRCH` is [`ProcError::NoSuchProcess`].
    pub(crate) fn os(what: &'static str, pid: Pid, source: io::Error) -> Self {
        if source.raw_os_error() == Some(libc::ESRCH) {
            ProcError::NoSuchProcess(pid)
        } else {
            ProcError::Os { what, pid, source }
        }
    }
}

/// Setting `oom_score_adj` failed.
#[derive(Debug, thiserror::Error)]
pub enum OomAdjError {
    /// The value is outside what the kernel accepts.
    #[error("oom_score_adj value {value} is outside -1000..=1000")]
    Range {
        /// The value asked for.
        value: i32,
    },
    /// The kernel refused: lowering it needs `CAP_SYS_RESOURCE`.
    #[error("this machine does not permit setting oom_score_adj of {pid} to {value} (lowering it needs CAP_SYS_RESOURCE): {source}")]
    NotPermitted {
        /// The process.
        pid: Pid,
        /// The value asked for.
        value: i32,
        /// The error.
        source: io::Error,
    },
    /// The process is gone.
    #[error("process {pid} is gone")]
    Gone {
        /// The process.
        pid: Pid,
    },
    /// Writing failed otherwise.
    #[error("writing oom_score_adj of {pid} failed: {source}")]
    Io {
        /// The process.
        pid: Pid,
        /// The error.
        source: io::Error,
    },
}
