//! The few system calls the simulated GPU makes for speed (the only `unsafe` of this crate).

use std::os::unix::net::UnixStream;

/// Bulk copies go over unix sockets; bigger buffers mean fewer context switches per GiB.
const SOCKET_BUFFER: usize = 4 << 20;

/// Asks for transparent huge pages on a large buffer: faulting in GiBs of fresh 4 KiB pages is
/// what bounds checkpoint speed (as on the real driver). Best effort.
pub(crate) fn advise_huge_pages(buf: &mut [u8]) {
    const HUGE: usize = 2 << 20;
    let start = (buf.as_mut_ptr() as usize).next_multiple_of(HUGE);
    let end = (buf.as_mut_ptr() as usize + buf.len()) & !(HUGE - 1);
    if end <= start {
        return;
    }
    let Some(ptr) = std::ptr::NonNull::new(start as *mut std::ffi::c_void) else {
        return;
    };
    // SAFETY: [start, end) is a page-aligned range inside `buf`, which we borrow mutably, and
    // MADV_HUGEPAGE changes only how the kernel backs it, never its contents.
    let r = unsafe {
        nix::sys::mman::madvise(ptr, end - start, nix::sys::mman::MmapAdvise::MADV_HUGEPAGE)
    };
    if let Err(err) = r {
        tracing::debug!(%err, "MADV_HUGEPAGE refused");
    }
}

/// Enlarges a socket's buffers (as root beyond `net.core.[rw]mem_max`). Best effort.
pub(crate) fn grow_socket_buffers(s: &UnixStream) {
    use nix::sys::socket::{setsockopt, sockopt};
    if setsockopt(s, sockopt::SndBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(s, sockopt::SndBuf, &SOCKET_BUFFER);
    }
    if setsockopt(s, sockopt::RcvBufForce, &SOCKET_BUFFER).is_err() {
        let _ = setsockopt(s, sockopt::RcvBuf, &SOCKET_BUFFER);
    }
}
