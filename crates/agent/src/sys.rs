//! The agent's raw system calls: the only `unsafe` code of the crate.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicI32, Ordering};

/// The supplementary groups of the peer of a connected unix socket, as they were when it
/// connected (`SO_PEERGROUPS`, Linux >= 4.13).
pub fn peer_groups(sock: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut groups: Vec<libc::gid_t> = vec![0; 64];
    loop {
        let mut len = (groups.len() * std::mem::size_of::<libc::gid_t>()) as libc::socklen_t;
        // SAFETY: the buffer is valid for `len` bytes and the kernel writes at most that much,
        // setting `len` to what it wrote (or, with ERANGE, to what it needs).
        let rc = unsafe {
            libc::getsockopt(
                sock.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_PEERGROUPS,
                groups.as_mut_ptr().cast(),
                &mut len,
            )
        };
        let n = len as usize / std::mem::size_of::<libc::gid_t>();
        if rc == 0 {
            groups.truncate(n);
            return Ok(groups);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ERANGE) && n > groups.len() {
            groups.resize(n, 0);
            continue;
        }
        return Err(err);
    }
}

/// Where the signal handler writes what it caught.
static SIGNAL_PIPE: AtomicI32 = AtomicI32::new(-1);

/// One caught signal: its number, the sending pid (0 from the kernel), `si_code`.
pub const RECORD: usize = 3 * std::mem::size_of::<i32>();

/// Signals whose kernel-generated form is a fault of this process (the default action must
/// happen then: returning from the handler would re-run the faulting instruction forever).
fn is_fault(sig: libc::c_int) -> bool {
    matches!(
        sig,
        libc::SIGSEGV | libc::SIGBUS | libc::SIGILL | libc::SIGFPE | libc::SIGTRAP | libc::SIGSYS
    )
}

extern "C" fn on_signal(sig: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: errno is thread-local and this reads and restores it only (async-signal-safe).
    let errno = unsafe { *libc::__errno_location() };
    // SAFETY: with SA_SIGINFO the kernel passes a valid siginfo_t for the signal.
    let (code, pid) = unsafe { ((*info).si_code, (*info).si_pid()) };
    if code > 0 && is_fault(sig) {
        // A real fault (si_code > 0: sent by the kernel): let it kill, with its core.
        // SAFETY: signal(2) with SIG_DFL is async-signal-safe and takes no pointer.
        unsafe { libc::signal(sig, libc::SIG_DFL) };
    } else {
        let record: [i32; 3] = [sig, pid, code];
        let fd = SIGNAL_PIPE.load(Ordering::Relaxed);
        // SAFETY: write(2) is async-signal-safe; the buffer is valid for RECORD bytes. The pipe
        // is non-blocking: a full pipe loses the record, never blocks the handler.
        unsafe { libc::write(fd, record.as_ptr().cast(), RECORD) };
    }
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = errno };
}

/// Installs [`on_signal`] for `signals`, writing records to `pipe` (non-blocking). Handlers,
/// unlike `SIG_IGN`, are reset by `execve`: CRIU and the commands the agent runs start with the
/// default dispositions.
pub fn catch_signals(signals: &[libc::c_int], pipe: RawFd) -> io::Result<()> {
    SIGNAL_PIPE.store(pipe, Ordering::Relaxed);
    for &sig in signals {
        // SAFETY: a zeroed sigaction is a valid value to fill in.
        let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
        action.sa_sigaction = on_signal as *const () as usize;
        action.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
        // SAFETY: `action.sa_mask` is a valid sigset_t to initialise.
        unsafe { libc::sigemptyset(&mut action.sa_mask) };
        // SAFETY: `action` is fully initialised, the handler only makes async-signal-safe calls,
        // and the old action is not asked for.
        if unsafe { libc::sigaction(sig, &action, std::ptr::null_mut()) } != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes `cmd`'s program start with every signal blocked (after std's reset of the mask in the
/// child, before `execve`): a keeper then cannot die of a signal sent before it set its
/// dispositions; it unblocks them once it ignores them.
pub fn exec_with_signals_blocked(cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and calls only sigfillset and
    // sigprocmask, both async-signal-safe, on a set of its own stack.
    unsafe {
        cmd.pre_exec(|| {
            let mut all: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            if libc::sigprocmask(libc::SIG_SETMASK, &all, std::ptr::null_mut()) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}
