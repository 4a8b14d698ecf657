//! A process's fd table, and the one place that decides which of its fds are a GPU driver's.
//!
//! The driver keeps a process's GPU context alive while any duplicate of its driver files is open
//! (see the project's GPU facts); fd pinning duplicates exactly these at the exit stop, so the
//! recognition below is the definition of "driver fd" for all of cryo.

use std::collections::HashSet;
use std::os::fd::RawFd;
use std::os::unix::ffi::OsStrExt;

pub use procfs::process::FDTarget as FdTarget;

/// One open fd of a process.
#[derive(Debug, Clone)]
pub struct Fd {
    /// Its number in the process.
    pub fd: RawFd,
    /// What it refers to.
    pub target: FdTarget,
}

/// Where the real driver's device files live: `/dev/nvidiactl`, `/dev/nvidiaN`, `/dev/nvidia-uvm`,
/// `/dev/nvidia-uvm-tools`, `/dev/nvidia-modeset`, `/dev/nvidia-caps/*`.
const NVIDIA_DEV_PREFIX: &[u8] = b"/dev/nvidia";

/// Which files are a GPU driver's.
#[derive(Debug, Clone, Copy)]
pub enum DriverFiles<'a> {
    /// The NVIDIA kernel driver: every device file under `/dev/nvidia*`.
    Nvidia,
    /// The simulated driver: a context is one connected unix socket to its daemon (its
    /// `/dev/nvidia*`), recognised by the socket's inode, which the daemon records when the worker
    /// opens the context. These are the inodes of the contexts the daemon serves now.
    SimContexts(&'a HashSet<u64>),
}

impl DriverFiles<'_> {
    /// Whether an fd referring to `target` is one of the driver's files.
    pub fn is_driver_file(&self, target: &FdTarget) -> bool {
        match (self, target) {
            (DriverFiles::Nvidia, FdTarget::Path(p)) => {
                p.as_os_str().as_bytes().starts_with(NVIDIA_DEV_PREFIX)
            }
            (DriverFiles::SimContexts(inodes), FdTarget::Socket(inode)) => inodes.contains(inode),
            _ => false,
        }
    }
}

/// The fd numbers among `fds` that are driver files, ascending.
pub fn driver_fds(fds: &[Fd], files: DriverFiles<'_>) -> Vec<RawFd> {
    let mut out: Vec<RawFd> = fds
        .iter()
        .filter(|f| files.is_driver_file(&f.target))
        .map(|f| f.fd)
        .collect();
    out.sort_unstable();
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn fd(fd: RawFd, target: FdTarget) -> Fd {
        Fd { fd, target }
    }

    #[test]
    fn nvidia_device_files_are_driver_fds_and_nothing_else_is() {
        let path = |p: &str| FdTarget::Path(PathBuf::from(p));
        let table = [
            fd(0, path("/dev/null")),
            fd(12, path("/dev/nvidia0")),
            fd(3, path("/dev/nvidiactl")),
            fd(7, path("/dev/nvidia-uvm")),
            fd(8, path("/dev/nvidia-caps/nvidia-cap1")),
            fd(9, FdTarget::Socket(123)),
            fd(5, path("/home/dev/nvidia0")),
            fd(6, path("/dev/nvme0n1")),
        ];
        assert_eq!(driver_fds(&table, DriverFiles::Nvidia), vec![3, 7, 8, 12]);
    }

    #[test]
    fn sim_contexts_are_recognised_by_socket_inode() {
        let contexts: HashSet<u64> = [123, 456].into();
        let table = [
            fd(4, FdTarget::Socket(456)),
            fd(9, FdTarget::Socket(123)),
            fd(10, FdTarget::Socket(789)),
            fd(11, FdTarget::Pipe(123)),
            fd(12, FdTarget::Path(PathBuf::from("/dev/nvidia0"))),
        ];
        assert_eq!(
            driver_fds(&table, DriverFiles::SimContexts(&contexts)),
            vec![4, 9]
        );
    }
}
