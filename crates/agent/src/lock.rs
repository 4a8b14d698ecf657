//! One agent per node: an exclusive `flock` on [`cryo_state::StateDir::agent_lock`], held for
//! the agent's whole life (the kernel drops it when the agent dies, however it dies).

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

use rustix::fs::FlockOperation;

/// The lock could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another agent holds it.
    #[error("another agent runs on this state directory (pid {pid}, lock {})", .path.display())]
    Held {
        /// The lock file.
        path: PathBuf,
        /// The pid it wrote (`?` when unreadable).
        pid: String,
    },
    /// The lock file could not be opened or written.
    #[error("cannot take the agent lock {}: {source}", .path.display())]
    Io {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// The held lock; dropping it releases it.
#[derive(Debug)]
pub struct NodeLock {
    _file: File,
}

impl NodeLock {
    /// Takes the lock at `path` (creating the file), or says who holds it.
    pub fn take(path: &Path) -> Result<NodeLock, LockError> {
        let io = |source| LockError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o644)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)
            .map_err(io)?;
        match rustix::fs::flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let mut pid = String::new();
                let _ = file.read_to_string(&mut pid);
                let pid = pid.trim();
                return Err(LockError::Held {
                    path: path.to_path_buf(),
                    pid: if pid.is_empty() { "?" } else { pid }.to_string(),
                });
            }
            Err(e) => return Err(io(e.into())),
        }
        file.set_len(0).map_err(io)?;
        file.rewind().map_err(io)?;
        writeln!(file, "{}", std::process::id()).map_err(io)?;
        Ok(NodeLock { _file: file })
    }
}
