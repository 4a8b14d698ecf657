//! Workers start without the fds of whoever ran the tests. A test runner's fd holding a
//! `flock` (a landing script's lock) reached every worker; CRIU (`--file-locks`) dumped the
//! worker as holding that lock, and its restore waited for the lock forever.

use std::os::fd::RawFd;
use std::process::Command;

/// Makes every fd above stderr close at `cmd`'s exec, `keep` aside (its close-on-exec flag is
/// cleared instead, so the worker gets it under the same number).
pub fn close_inherited(cmd: &mut Command, keep: Option<RawFd>) {
    use std::os::unix::process::CommandExt;
    // SAFETY: the closure runs in the forked child before exec and makes only async-signal-safe
    // system calls (close_range, fcntl) on fd numbers; it allocates nothing. Marking fds
    // close-on-exec (rather than closing them) leaves the pipe std uses to report a failed
    // exec working.
    unsafe {
        cmd.pre_exec(move || {
            let r = libc::syscall(
                libc::SYS_close_range,
                3u32,
                u32::MAX,
                libc::CLOSE_RANGE_CLOEXEC,
            );
            if r != 0 {
                return Err(std::io::Error::last_os_error());
            }
            if let Some(fd) = keep {
                if libc::fcntl(fd, libc::F_SETFD, 0) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            Ok(())
        });
    }
}
