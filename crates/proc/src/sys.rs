//! The one system call no safe wrapper covers as cryo needs it: `pidfd_send_signal` with signal 0
//! (rustix's `Signal` has no 0, nix has no pidfds). The only `unsafe` of this crate.

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
