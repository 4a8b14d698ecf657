//! The few system calls the simulated GPU makes for speed (the only `unsafe` of this crate).

use std::os::unix::net::UnixStream;

/// Bulk copies go over unix sockets; bigger buffers mean fewer context switches per GiB.
const SOCKET_BUFFER: usize = 4 << 20;

/// Asks for transparent huge pages on a large buffer: faulting in GiBs of fresh 4 KiB pages is
/// what bounds checkpoint speed (as on the real driver). Best effort. (Public for the benchmark's
/// settle step, which faults memory in as a checkpoint's host copy does.)
pub fn advise_huge_pages(buf: &mut [u8]) {
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

/// Waits until the peer of `s` has read every byte written to it (`SIOCOUTQ` is 0), at most
/// `limit`: a copy is done when the receiver has it, not when its last bytes are queued (up to
/// the send buffer, twice [`SOCKET_BUFFER`], in flight). Best effort: returns at once where the
/// kernel cannot tell.
pub(crate) fn wait_read(s: &UnixStream, limit: std::time::Duration) {
    use std::os::fd::AsRawFd;
    let until = std::time::Instant::now() + limit;
    loop {
        let mut queued: nix::libc::c_int = 0;
        // SAFETY: SIOCOUTQ (TIOCOUTQ) writes one int through the pointer, which points at
        // `queued`, alive for the call; the fd is `s`'s, open for the call.
        let r = unsafe { nix::libc::ioctl(s.as_raw_fd(), nix::libc::TIOCOUTQ, &mut queued) };
        if r != 0 || queued <= 0 || std::time::Instant::now() >= until {
            return;
        }
        std::thread::sleep(std::time::Duration::from_micros(100));
    }
}

/// Whether the peer of a connected unix stream socket has closed its end (every duplicate of
/// it): `POLLHUP` without waiting (the kernel sets it on a stream socket whose peer is released).
pub(crate) fn peer_closed(s: &UnixStream) -> bool {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::ZERO) {
        Ok(n) if n > 0 => fds[0]
            .revents()
            .is_some_and(|r| r.contains(PollFlags::POLLHUP)),
        _ => false,
    }
}

/// Waits up to `wait` for `s` to be readable (data or EOF); `Ok(false)` when it is not yet.
pub(crate) fn readable(s: &UnixStream, wait: std::time::Duration) -> std::io::Result<bool> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    use std::os::fd::AsFd;
    let ms = u16::try_from(wait.as_millis()).unwrap_or(u16::MAX);
    let mut fds = [PollFd::new(s.as_fd(), PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::from(ms)) {
        Ok(n) => Ok(n > 0),
        Err(nix::errno::Errno::EINTR) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// `fork()`: `Ok(None)` in the child, `Ok(Some(child pid))` in the parent. Only for a process
/// that has one thread (the caller checks): the child is then a full copy that may run any code.
pub(crate) fn fork() -> std::io::Result<Option<u32>> {
    // SAFETY: the caller has checked that this process has a single thread, so no lock or
    // allocator state of another thread can be caught half-way in the child.
    match unsafe { nix::unistd::fork() } {
        Ok(nix::unistd::ForkResult::Child) => Ok(None),
        Ok(nix::unistd::ForkResult::Parent { child }) => {
            Ok(Some(u32::try_from(child.as_raw()).unwrap_or(0)))
        }
        Err(e) => Err(e.into()),
    }
}

/// Dies of a real SIGSEGV (`SEGV_ACCERR`, raised by the kernel on a write to an inaccessible
/// page), as a worker with a memory bug does; for the guard's tests (`POST /segv`).
pub(crate) fn segfault() -> ! {
    let len = std::num::NonZeroUsize::new(4096).unwrap_or(std::num::NonZeroUsize::MIN);
    // SAFETY: a fresh anonymous mapping that nothing else refers to.
    let page = unsafe {
        nix::sys::mman::mmap_anonymous(
            None,
            len,
            nix::sys::mman::ProtFlags::PROT_NONE,
            nix::sys::mman::MapFlags::MAP_PRIVATE,
        )
    };
    if let Ok(p) = page {
        // SAFETY: deliberately faults: the page is PROT_NONE, so the kernel raises SIGSEGV before
        // any byte is written; nothing in this process observes a write.
        unsafe { p.cast::<u8>().as_ptr().write_volatile(1) };
    }
    // Unreachable unless the mapping failed; still die of SIGSEGV.
    let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGSEGV);
    std::process::abort()
}

/// Maps `len` bytes of `file` shared, for the life of the process (the mapping is never
/// unmapped), as NCCL maps its `/dev/shm/nccl-*` segments.
pub(crate) fn map_shared_forever(file: &std::fs::File, len: usize) -> std::io::Result<()> {
    let len = std::num::NonZeroUsize::new(len).unwrap_or(std::num::NonZeroUsize::MIN);
    // SAFETY: a fresh shared mapping of a file this process created; nothing in this process
    // reads or writes it through Rust references, and it is never unmapped.
    unsafe {
        nix::sys::mman::mmap(
            None,
            len,
            nix::sys::mman::ProtFlags::PROT_READ | nix::sys::mman::ProtFlags::PROT_WRITE,
            nix::sys::mman::MapFlags::MAP_SHARED,
            file,
            0,
        )
    }?;
    Ok(())
}
