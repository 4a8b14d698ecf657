//! The system calls no safe wrapper covers as cryo needs them: `pidfd_send_signal` with signal 0
//! (rustix's `Signal` has no 0, nix has no pidfds), and what [`crate::isolate`] needs between a
//! `clone` and an `execv` (the clone itself, a raw write, the loopback's flags), and `SIGCHLD`
//! back at its default action ([`default_sigchld`]). The only `unsafe` of this crate.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// `pidfd_send_signal(pidfd, sig, NULL, 0)`; `sig == 0` only checks that the process has not been
/// reaped (a zombie still accepts it).
pub(crate) fn pidfd_send_signal(pidfd: BorrowedFd<'_>, sig: i32) -> io::Result<()> {
    // SAFETY: integer arguments and a null siginfo pointer, which the kernel allows (it fills in a
    // kill()-like one); `pidfd` is a live fd borrowed for the call.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            sig,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Sets `SIGCHLD` back to its default action in this process. An ignored `SIGCHLD` survives
/// `execve`: a process started by a parent that ignored it (some init systems, hook runners)
/// has every child it starts reaped by the kernel, and each of its waits fails with `ECHILD`
/// (`cryo`'s `criu --version` check, its image checker, its opener, health commands; CRIU's own
/// children). `cryo`'s `main` calls it first; `cryo-criu` calls it in CRIU's child before its
/// `exec` (async-signal-safe: one system call, no allocation).
pub fn default_sigchld() -> io::Result<()> {
    // SAFETY: `signal` with `SIG_DFL` passes no pointer and installs no handler; it is
    // async-signal-safe, so it may also run between a fork and an exec.
    if unsafe { libc::signal(libc::SIGCHLD, libc::SIG_DFL) } == libc::SIG_ERR {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `kcmp(pid, getpid(), KCMP_FILE, fd, ours)`: whether fd `fd` of `pid` and our fd `ours` are the
/// same open file description (`Ok(true)`), as opposed to two opens of the same file.
pub(crate) fn kcmp_same_file(pid: i32, fd: i32, ours: BorrowedFd<'_>) -> io::Result<bool> {
    const KCMP_FILE: libc::c_int = 0;
    let me = std::process::id();
    // SAFETY: integer arguments only; `ours` is a live fd borrowed for the call.
    let ret = unsafe { libc::syscall(libc::SYS_kcmp, pid, me, KCMP_FILE, fd, ours.as_raw_fd()) };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret == 0)
    }
}

/// `clone(flags | SIGCHLD)` running `child` in the new process on `stack` (see
/// [`crate::isolate`]); the child's pid.
pub(crate) fn clone_child(
    child: nix::sched::CloneCb<'_>,
    stack: &mut [u8],
    flags: nix::sched::CloneFlags,
) -> nix::Result<crate::Pid> {
    // SAFETY: without CLONE_VM the child runs on a copy of our memory (as after fork), on
    // `stack`, which outlives the call in the parent; `child` only makes system calls on values
    // prepared before the clone (no allocation, no lock) and then execs or returns.
    unsafe { nix::sched::clone(child, stack, flags, Some(libc::SIGCHLD)) }.map(|p| p.as_raw())
}

/// Writes all of `buf` to the raw fd `fd` (in a cloned child: no allocation).
pub(crate) fn write_all(fd: i32, mut buf: &[u8]) -> nix::Result<()> {
    while !buf.is_empty() {
        // SAFETY: `buf` is valid for `buf.len()` bytes; `fd` is a plain integer the kernel checks.
        let n = unsafe { libc::write(fd, buf.as_ptr().cast(), buf.len()) };
        if n < 0 {
            let e = nix::Error::last();
            if e == nix::Error::EINTR {
                continue;
            }
            return Err(e);
        }
        buf = &buf[n.unsigned_abs()..];
    }
    Ok(())
}

/// Brings the loopback interface of the caller's network namespace up (`SIOCSIFFLAGS` with
/// `IFF_UP`), as `ip link set lo up` does; no allocation.
pub(crate) fn loopback_up() -> nix::Result<()> {
    // SAFETY: plain socket(2) with constant arguments.
    let sock = unsafe { libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if sock < 0 {
        return Err(nix::Error::last());
    }
    // SAFETY: `ifreq` is plain old data, all zeroes is a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` is a valid ifreq naming "lo", which SIOCGIFFLAGS fills in.
    let got = unsafe { libc::ioctl(sock, libc::SIOCGIFFLAGS, &mut req) };
    let result = if got < 0 {
        Err(nix::Error::last())
    } else {
        // SAFETY: SIOCGIFFLAGS filled the flags member of the union.
        unsafe { req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short };
        // SAFETY: `req` is a valid ifreq with the name and the flags to set.
        if unsafe { libc::ioctl(sock, libc::SIOCSIFFLAGS, &req) } < 0 {
            Err(nix::Error::last())
        } else {
            Ok(())
        }
    };
    // SAFETY: `sock` is the fd opened above, closed once.
    unsafe { libc::close(sock) };
    result
}

/// `MADV_COLLAPSE` (Linux 6.1; not in the `libc` crate yet).
const MADV_COLLAPSE: i32 = 25;

/// `process_madvise(pidfd, [addr, addr+len), MADV_COLLAPSE)`: the process's range is put in
/// transparent huge pages now (see [`crate::ProcHandle::collapse_huge_pages`]).
pub(crate) fn process_madvise_collapse(
    pidfd: BorrowedFd<'_>,
    addr: u64,
    len: u64,
) -> io::Result<()> {
    let iov = libc::iovec {
        iov_base: addr as *mut libc::c_void,
        iov_len: len as usize,
    };
    // SAFETY: one iovec naming a range of the *other* process's address space (the kernel
    // checks it; nothing of ours is read or written through it); `pidfd` is a live fd.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_process_madvise,
            pidfd.as_raw_fd(),
            &iov as *const libc::iovec,
            1usize,
            MADV_COLLAPSE,
            0u32,
        )
    };
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}
