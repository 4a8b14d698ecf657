//! The one system call the standard library and rustix do not wrap for us.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};

/// Bytes in a TCP socket's send queue that the peer has not acknowledged yet (`SIOCOUTQ`,
/// `tcp(7)`): sent but unacknowledged, plus not yet sent.
pub(crate) fn unacked_bytes(socket: BorrowedFd<'_>) -> io::Result<u64> {
    let mut n: libc::c_int = 0;
    // SAFETY: TIOCOUTQ (= SIOCOUTQ) writes one c_int through the pointer, which points at a
    // live, aligned c_int; the fd is borrowed, so it is open for the whole call.
    let r = unsafe { libc::ioctl(socket.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(u64::try_from(n).unwrap_or(0))
}

/// Whether a TCP socket is still in the ESTABLISHED state (`TCP_INFO`, `tcp(7)`). After a reset
/// the kernel empties the send queue, so [`unacked_bytes`] means "acknowledged" only while this
/// holds: read the queue first, then this.
pub(crate) fn tcp_established(socket: BorrowedFd<'_>) -> io::Result<bool> {
    // SAFETY: tcp_info is plain old data; all zeroes is a valid value.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = libc::socklen_t::try_from(std::mem::size_of::<libc::tcp_info>())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: getsockopt writes at most `len` bytes into `info`, which is that large and lives
    // for the call; `len` is a live socklen_t; the fd is borrowed, so it is open.
    let r = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    // TCP_ESTABLISHED in the kernel's tcp_states.h (libc does not name it).
    const TCP_ESTABLISHED: u8 = 1;
    Ok(info.tcpi_state == TCP_ESTABLISHED)
}
