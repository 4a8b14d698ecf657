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

/// Makes the child that `cmd` starts the leader of a new session (`setsid` after the fork), so
/// that it gets a scheduling group of its own where autogroups apply (the image checker).
pub(crate) fn new_session(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec; it makes one async-signal-safe
    // system call (setsid) and allocates nothing (an OS error is not boxed).
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Starts the child that `cmd` starts with `SIGCHLD` at its default action: an ignored
/// `SIGCHLD` survives `execve`, and a CRIU that inherits it has its own children reaped by the
/// kernel: its waits fail ("waitpid() failed: No child processes") and so does the restore.
pub(crate) fn default_sigchld(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec; `default_sigchld` makes one
    // async-signal-safe system call (signal with SIG_DFL, no pointer) and allocates nothing.
    unsafe {
        cmd.pre_exec(cryo_proc::default_sigchld);
    }
}

/// Takes ownership of `fd`, inherited from the process that started this one (the image
/// checker's image directory), after checking that it is an open directory.
pub(crate) fn adopt_inherited(fd: std::os::fd::RawFd) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::FromRawFd;
    if fd < 3 {
        return Err(std::io::ErrorKind::InvalidInput.into());
    }
    // SAFETY: fcntl and fstat on an fd number only read the kernel's fd table; no memory but
    // the stat buffer we own is passed.
    let is_dir = unsafe {
        if libc::fcntl(fd, libc::F_GETFD) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
        if libc::fstat(fd, st.as_mut_ptr()) < 0 {
            return Err(std::io::Error::last_os_error());
        }
        st.assume_init().st_mode & libc::S_IFMT == libc::S_IFDIR
    };
    if !is_dir {
        return Err(std::io::Error::other("not a directory"));
    }
    // SAFETY: the fd is open (checked above), was inherited for this process to use, and
    // nothing else in this process owns it (it is only named by the checker's arguments).
    let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
    // Not inherited further.
    rustix::io::fcntl_setfd(&fd, rustix::io::FdFlags::CLOEXEC)?;
    Ok(fd)
}

/// Puts the thread `t` of this process back at the normal policy (`SCHED_OTHER`), e.g. one
/// that made itself idle and is now waited for.
pub(crate) fn set_normal_priority_of<T>(t: &std::thread::JoinHandle<T>) -> std::io::Result<()> {
    use std::os::unix::thread::JoinHandleExt;
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: `t` is not joined yet (we borrow its handle), so its `pthread_t` is valid; the
    // parameter is ours for the call's duration.
    let r = unsafe { libc::pthread_setschedparam(t.as_pthread_t(), libc::SCHED_OTHER, &param) };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(r))
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn policy() -> i32 {
        // SAFETY: a plain system call about the calling thread.
        unsafe { libc::sched_getscheduler(0) }
    }

    /// A thread that made itself idle is put back at the normal policy by the thread that is
    /// about to wait for it (what `Follower::finish` does before its join).
    #[test]
    fn an_idle_thread_waited_for_runs_at_the_normal_policy_again() {
        let (idle_tx, idle_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            set_idle_priority(true).unwrap();
            idle_tx.send(policy()).unwrap();
            go_rx.recv().unwrap();
            policy()
        });
        assert_eq!(idle_rx.recv().unwrap(), libc::SCHED_IDLE);
        set_normal_priority_of(&t).unwrap();
        go_tx.send(()).unwrap();
        assert_eq!(t.join().unwrap(), libc::SCHED_OTHER);
    }
}
