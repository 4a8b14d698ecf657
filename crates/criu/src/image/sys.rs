//! The system calls of the image code that neither `nix` nor `rustix` wraps.

use std::os::fd::AsFd;
use std::os::fd::AsRawFd;

/// Starts the writeback of bytes `offset..offset + len` of `file` without waiting for it
/// (`sync_file_range(SYNC_FILE_RANGE_WRITE)`).
pub(crate) fn start_writeback(file: impl AsFd, offset: u64, len: u64) -> std::io::Result<()> {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return Err(std::io::ErrorKind::InvalidInput.into());
    };
    // SAFETY: a plain system call on an fd we borrow for its duration; no memory is passed.
    let r = unsafe {
        libc::sync_file_range(
            file.as_fd().as_raw_fd(),
            offset,
            len,
            libc::SYNC_FILE_RANGE_WRITE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Lets the child that `cmd` starts inherit `fd` under the same number: its close-on-exec flag
/// is cleared in the child only, after the fork, so no other child of this (threaded) process
/// inherits it.
pub(crate) fn inherit(cmd: &mut std::process::Command, fd: std::os::fd::RawFd) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec; it makes two async-signal-safe
    // system calls (fcntl) on an fd number and allocates nothing (an OS error is not boxed).
    unsafe {
        cmd.pre_exec(move || {
            let flags = libc::fcntl(fd, libc::F_GETFD);
            if flags < 0 || libc::fcntl(fd, libc::F_SETFD, flags & !libc::FD_CLOEXEC) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Makes the calling thread run only when no other thread wants its core (`SCHED_IDLE`), or
/// back at the normal policy (`SCHED_OTHER`).
pub(crate) fn set_idle_priority(idle: bool) -> std::io::Result<()> {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle {
        libc::SCHED_IDLE
    } else {
        libc::SCHED_OTHER
    };
    // SAFETY: a plain system call on the calling thread (0) with a parameter we own for its
    // duration.
    let r = unsafe { libc::sched_setscheduler(0, policy, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
