//! A process named by a pidfd, so that a reused pid is never acted on.

use std::io;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};

use crate::sys;
use crate::Pid;

/// Opening a pidfd failed.
#[derive(Debug, thiserror::Error)]
pub enum PidFdError {
    /// pidfd_open({pid}) failed: {source}
    #[error("pidfd_open({pid}) failed: {source}")]
    Open { pid: Pid, source: io::Error },
    /// pidfd_send_signal to {pid} (signal {signal}) failed: {source}
    #[error("pidfd_send_signal to {pid} (signal {signal}) failed: {source}")]
    Signal {
        pid: Pid,
        signal: i32,
        source: io::Error,
    },
    /// pidfd_getfd of fd {fd} of {pid} failed: {source}
    #[error("pidfd_getfd of fd {fd} of {pid} failed: {source}")]
    GetFd {
        pid: Pid,
        fd: RawFd,
        source: io::Error,
    },
}

/// A pidfd plus the pid it was opened for.
#[derive(Debug)]
pub struct PidFd {
    pid: Pid,
    fd: OwnedFd,
}

impl PidFd {
    /// `pidfd_open(pid)`. The caller must know `pid` names the process meant at this moment (for
    /// example because it is its child, or it checked the start time); from then on the pidfd
    /// keeps naming that process even if the pid is reused.
    pub fn open(pid: Pid) -> Result<Self, PidFdError> {
        let fd = sys::pidfd_open(pid).map_err(|source| PidFdError::Open { pid, source })?;
        Ok(Self { pid, fd })
    }

    /// Wraps a pidfd opened elsewhere (a duplicate of a `cryo_proc::ProcHandle`'s, so both name
    /// the process that handle checked by start time).
    pub fn from_owned(pid: Pid, fd: OwnedFd) -> Self {
        Self { pid, fd }
    }

    /// The pid this pidfd was opened for.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Sends `signal` to exactly this process.
    pub fn send_signal(&self, signal: i32) -> Result<(), PidFdError> {
        sys::pidfd_send_signal(self.fd.as_fd(), signal).map_err(|source| PidFdError::Signal {
            pid: self.pid,
            signal,
            source,
        })
    }

    /// Whether the process has not been reaped yet (a zombie still counts: its pid is not free
    /// for reuse until it is reaped).
    pub fn is_alive(&self) -> bool {
        sys::pidfd_send_signal(self.fd.as_fd(), 0).is_ok()
    }

    /// A duplicate of fd `fd` of this process (`pidfd_getfd`). Needs ptrace-attach rights over
    /// the process; works at the exit stop, where the fd table is still intact.
    pub fn get_fd(&self, fd: RawFd) -> Result<OwnedFd, PidFdError> {
        sys::pidfd_getfd(self.fd.as_fd(), fd).map_err(|source| PidFdError::GetFd {
            pid: self.pid,
            fd,
            source,
        })
    }

    /// Duplicates of each fd in `fds`: what could be taken and what failed (an fd closed since
    /// it was listed fails with `EBADF`).
    pub fn get_fds(&self, fds: &[RawFd]) -> (Vec<(RawFd, OwnedFd)>, Vec<PidFdError>) {
        let mut got = Vec::with_capacity(fds.len());
        let mut failed = Vec::new();
        for &fd in fds {
            match self.get_fd(fd) {
                Ok(dup) => got.push((fd, dup)),
                Err(e) => failed.push(e),
            }
        }
        (got, failed)
    }
}

impl AsFd for PidFd {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }
}
