//! CRIU's `proc.crtools`. Dumping the root of a tree with a pid namespace of its own (`cryo
//! run`, a container), CRIU's parasite (criu/pie/parasite.c, `get_proc_fd`) makes a directory
//! `proc.crtools` in the dumped task's working directory, mounts a proc there, opens it,
//! unmounts and removes it. Two dumps of such trees that share a working directory (workers
//! started in one directory) collide there, and one left by a CRIU killed in that window fails
//! every later dump there: "Can't create a directory (-17)", the dump fails and the tree runs on.
//!
//! # Design
//! [`CwdLock::take`] holds, for the whole dump, an exclusive `flock` on a file of CRIU's scratch
//! root named by the working directory's device and inode: no two cryo dumps use one directory's
//! `proc.crtools` at once. Under it, a `proc.crtools` found there belongs to no cryo dump: an
//! empty directory on the working directory's own file system (no proc mounted on it) is a
//! leftover and is removed; anything else is left alone (the dump then fails as before, safely).
//!
//! # Limitations
//! A CRIU that cryo does not run takes no lock: a dump of it beside cryo's can still collide
//! (both fail safe), and one that made the directory and has not mounted yet loses it to the
//! removal (its dump fails).

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::time::{Duration, Instant};

use rustix::fs::{AtFlags, FileType, FlockOperation, Mode, OFlags};

use cryo_proc::Pid;

/// The directory CRIU's parasite makes in the dumped task's working directory.
pub const PROC_CRTOOLS: &str = "proc.crtools";

/// How long a dump waits for another cryo dump of a tree in the same working directory.
pub const CWD_WAIT: Duration = Duration::from_secs(60);

/// The lock of one working directory, held for a dump (released when dropped).
#[derive(Debug)]
pub struct CwdLock {
    _file: File,
}

impl CwdLock {
    /// For the root `pid` of a tree about to be dumped: `None` unless it is in a pid namespace
    /// of its own (then CRIU does not use its working directory) or its working directory
    /// cannot be read (gone: CRIU's dump says so). Otherwise waits (up to [`CWD_WAIT`]) for the
    /// lock of its working directory in `scratch`, and removes a leftover `proc.crtools` there.
    pub fn take(pid: Pid, scratch: &Path) -> std::io::Result<Option<CwdLock>> {
        let namespaced = cryo_proc::status(pid).is_ok_and(|s| s.nspid.len() > 1);
        if !namespaced {
            return Ok(None);
        }
        let cwd = match rustix::fs::open(
            format!("/proc/{pid}/cwd"),
            OFlags::RDONLY | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        ) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::debug!(pid, error = %e, "the dumped root's working directory");
                return Ok(None);
            }
        };
        let st = rustix::fs::fstat(&cwd)?;
        // Made as for a CRIU run's private directory, if this is the first use of it.
        crate::scratch::make_root(scratch)?;
        let path = scratch.join(format!("cwd-{}-{}.lock", st.st_dev, st.st_ino));
        let file = std::fs::OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&path)?;
        let deadline = Instant::now() + CWD_WAIT;
        loop {
            match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
                Ok(()) => break,
                Err(rustix::io::Errno::WOULDBLOCK) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(rustix::io::Errno::WOULDBLOCK) => {
                    tracing::warn!(pid, lock = %path.display(), "another dump in the same working directory holds its lock: dumping without it");
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
        remove_leftover(pid, &cwd, st.st_dev);
        Ok(Some(CwdLock { _file: file }))
    }
}

/// Removes `proc.crtools` from the working directory `cwd` (on device `dev`) if it is an empty
/// directory of that file system (nothing mounted on it).
fn remove_leftover(pid: Pid, cwd: &OwnedFd, dev: u64) {
    let st = match rustix::fs::statat(cwd.as_fd(), PROC_CRTOOLS, AtFlags::SYMLINK_NOFOLLOW) {
        Ok(st) => st,
        Err(rustix::io::Errno::NOENT) => return,
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot look at {PROC_CRTOOLS} in the dumped root's working directory");
            return;
        }
    };
    if FileType::from_raw_mode(st.st_mode) != FileType::Directory || st.st_dev != dev {
        tracing::warn!(pid, "{PROC_CRTOOLS} in the dumped root's working directory is no directory of it (a mount?): left alone; CRIU's dump will fail");
        return;
    }
    match rustix::fs::unlinkat(cwd.as_fd(), PROC_CRTOOLS, AtFlags::REMOVEDIR) {
        Ok(()) => tracing::warn!(pid, "removed a leftover {PROC_CRTOOLS} (of a CRIU that died mid-dump) from the dumped root's working directory"),
        Err(e) => tracing::warn!(pid, error = %e, "cannot remove {PROC_CRTOOLS} from the dumped root's working directory: left alone; CRIU's dump will fail"),
    }
}
