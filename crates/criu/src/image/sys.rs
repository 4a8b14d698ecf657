//! The one system call of the image code that neither `nix` nor `rustix` wraps.

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
