//! Raw system calls the guard needs and that no safe wrapper covers as we need them (real-time
//! signal numbers, `PTRACE_LISTEN`, `__WNOTHREAD`). The only module with `unsafe`; every function
//! is one call, checks the return at once and maps it to `io::Error`.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::sync::Once;

/// A kernel thread id or process id.
pub type Tid = i32;

pub(crate) const PTRACE_EVENT_CLONE: i32 = 3;
pub(crate) const PTRACE_EVENT_EXEC: i32 = 4;
pub(crate) const PTRACE_EVENT_EXIT: i32 = 6;
pub(crate) const PTRACE_EVENT_STOP: i32 = 128;
const PTRACE_O_TRACECLONE: libc::c_long = 0x08;
const PTRACE_O_TRACEEXEC: libc::c_long = 0x10;
const PTRACE_O_TRACEEXIT: libc::c_long = 0x40;

fn check(ret: libc::c_long) -> io::Result<libc::c_long> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret)
    }
}

/// `gettid()`.
pub fn gettid() -> Tid {
    // SAFETY: no arguments; cannot fail.
    let tid = unsafe { libc::syscall(libc::SYS_gettid) };
    Tid::try_from(tid).unwrap_or(-1)
}

/// `tgkill(getpid(), tid, sig)`: signal one thread of this process.
pub fn tgkill_self(tid: Tid, sig: i32) -> io::Result<()> {
    let pid = std::process::id();
    // SAFETY: integer arguments only.
    let ret = unsafe { libc::syscall(libc::SYS_tgkill, pid, tid, sig) };
    check(ret).map(drop)
}

fn ptrace(req: libc::c_uint, tid: Tid, addr: usize, data: usize) -> io::Result<libc::c_long> {
    // SAFETY: every request used here takes integers, or in `data` a pointer to a buffer that the
    // caller owns and that is large enough for the request (GETEVENTMSG: u64, GETSIGINFO: siginfo_t).
    let ret = unsafe { libc::syscall(libc::SYS_ptrace, req, tid, addr, data) };
    check(ret)
}

/// `PTRACE_SEIZE` with exit, exec and clone events, never `PTRACE_O_EXITKILL`.
pub fn ptrace_seize(tid: Tid) -> io::Result<()> {
    let opts = PTRACE_O_TRACEEXIT | PTRACE_O_TRACEEXEC | PTRACE_O_TRACECLONE;
    ptrace(libc::PTRACE_SEIZE, tid, 0, opts as usize).map(drop)
}

fn sig_arg(sig: i32) -> usize {
    usize::try_from(sig).unwrap_or(0)
}

/// `PTRACE_CONT`, injecting `sig` (0: none).
pub fn ptrace_cont(tid: Tid, sig: i32) -> io::Result<()> {
    ptrace(libc::PTRACE_CONT, tid, 0, sig_arg(sig)).map(drop)
}

/// `PTRACE_LISTEN`: leave a seized tracee in group-stop but be told when it ends.
pub fn ptrace_listen(tid: Tid) -> io::Result<()> {
    ptrace(libc::PTRACE_LISTEN, tid, 0, 0).map(drop)
}

/// `PTRACE_INTERRUPT`: trap a seized tracee (reported as `PTRACE_EVENT_STOP`).
pub fn ptrace_interrupt(tid: Tid) -> io::Result<()> {
    ptrace(libc::PTRACE_INTERRUPT, tid, 0, 0).map(drop)
}

/// `PTRACE_DETACH`, injecting `sig` (0: none).
pub fn ptrace_detach(tid: Tid, sig: i32) -> io::Result<()> {
    ptrace(libc::PTRACE_DETACH, tid, 0, sig_arg(sig)).map(drop)
}

/// `PTRACE_GETEVENTMSG`.
pub fn ptrace_geteventmsg(tid: Tid) -> io::Result<u64> {
    let mut msg: libc::c_ulong = 0;
    ptrace(
        libc::PTRACE_GETEVENTMSG,
        tid,
        0,
        std::ptr::addr_of_mut!(msg) as usize,
    )?;
    Ok(msg)
}

/// `si_code` and, for signals sent by a process, the sender's pid.
#[derive(Debug, Clone, Copy)]
pub struct SigInfo {
    pub code: i32,
    pub sender: Option<Tid>,
}

/// `PTRACE_GETSIGINFO`.
pub fn ptrace_getsiginfo(tid: Tid) -> io::Result<SigInfo> {
    // SAFETY: siginfo_t is plain data; all-zero is a valid value.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    ptrace(
        libc::PTRACE_GETSIGINFO,
        tid,
        0,
        std::ptr::addr_of_mut!(info) as usize,
    )?;
    // SI_USER (0), SI_TKILL (-6), SI_QUEUE (-1): the union holds the sender's pid.
    let sender = if matches!(info.si_code, 0 | -1 | -6) {
        // SAFETY: for these codes the kernel filled the kill/rt member of the union.
        Some(unsafe { info.si_pid() })
    } else {
        None
    };
    Ok(SigInfo {
        code: info.si_code,
        sender,
    })
}

/// One `waitpid(-1, __WALL | __WNOTHREAD)`: this thread's tracees only, so children that other
/// threads of the process spawned are never reaped here.
pub fn wait_tracee() -> io::Result<(Tid, i32)> {
    let mut status: libc::c_int = 0;
    // SAFETY: `status` is a valid out-pointer for the call.
    let ret = unsafe { libc::waitpid(-1, &mut status, libc::__WALL | libc::__WNOTHREAD) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((ret, status))
}

/// The signal used to interrupt the tracer thread's `waitpid` when a command is queued.
pub fn kick_signal() -> i32 {
    libc::SIGRTMIN() + 4
}

extern "C" fn on_kick(_: libc::c_int) {}

/// Installs a no-op handler for [`kick_signal`] without `SA_RESTART`, so that a blocked `waitpid`
/// returns `EINTR`. Idempotent. Hand-written because that is the point of it: signal-hook installs
/// its handlers with `SA_RESTART`, which would resume the `waitpid` instead of waking the tracer.
pub fn install_kick_handler() -> io::Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        // SAFETY: sigaction is plain data; all-zero means no flags and an empty mask.
        let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
        act.sa_sigaction = on_kick as extern "C" fn(libc::c_int) as usize;
        // SAFETY: `act` is fully initialised; the handler is async-signal-safe (does nothing).
        let ret = unsafe { libc::sigaction(kick_signal(), &act, std::ptr::null_mut()) };
        if ret < 0 {
            result = Err(io::Error::last_os_error());
        }
    });
    result
}

/// Unblocks [`kick_signal`] in the calling thread (threads inherit their creator's mask).
pub fn unblock_kick_signal() -> io::Result<()> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t owned by this frame.
    unsafe {
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, kick_signal());
    }
    // SAFETY: `set` is initialised; the old mask is not requested.
    let ret = unsafe { libc::pthread_sigmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut()) };
    if ret != 0 {
        return Err(io::Error::from_raw_os_error(ret));
    }
    Ok(())
}

/// `poll` for `POLLPRI` on one fd (PSI triggers); `Ok(true)` when the event fired.
pub fn poll_pri(fd: BorrowedFd<'_>, timeout_ms: i32) -> io::Result<bool> {
    let mut pfd = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLPRI,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let ret = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    if pfd.revents & libc::POLLERR != 0 {
        return Err(io::Error::from_raw_os_error(libc::ENODEV));
    }
    Ok(pfd.revents & libc::POLLPRI != 0)
}

/// Decoded wait status helpers (the libc macros are `const fn`s over `i32`).
pub mod status {
    pub fn exited(s: i32) -> Option<i32> {
        libc::WIFEXITED(s).then(|| libc::WEXITSTATUS(s))
    }
    pub fn signaled(s: i32) -> Option<(i32, bool)> {
        libc::WIFSIGNALED(s).then(|| (libc::WTERMSIG(s), libc::WCOREDUMP(s)))
    }
    pub fn stopped(s: i32) -> Option<(i32, i32)> {
        libc::WIFSTOPPED(s).then(|| (libc::WSTOPSIG(s), (s >> 16) & 0xffff))
    }
}
