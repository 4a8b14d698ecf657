//! Cross-process CUDA (CUDA IPC, NCCL peer-to-peer), as the host can see it.
//!
//! # Why
//! A process that maps another process's device memory (CUDA IPC) or talks to its peers through
//! NCCL cannot be checkpointed and restored on the drivers this project runs on: the checkpoint
//! API gained multi-process jobs (`--launch-job`) in r590 and IPC memory in r610; the H200 hosts
//! run r580. CRIU would dump such a tree and publish an image that can never be restored. So a
//! freeze refuses it, naming the evidence.
//!
//! # What the host sees
//! The driver does not say; the evidence is what NCCL leaves in the process (NCCL's sources):
//! - its shared-memory segments `/dev/shm/nccl-XXXXXX` (`ncclShmOpen`, `src/misc/shmutils.cc`),
//!   mapped by the ranks (unlinked once every rank attached: ` (deleted)` in the maps);
//! - its IPC socket, the abstract datagram socket `/tmp/nccl-socket-RANK-HASH`
//!   (`ncclIpcSocketInit`, `src/misc/ipcsocket.cc`), through which ranks pass cuMem handles
//!   for peer-to-peer.
//!
//! # Limitations
//! Legacy CUDA IPC between processes that do not use NCCL (`cudaIpcOpenMemHandle` with handles
//! passed by the application itself) leaves nothing cryo knows how to read: it is not detected.
//! A library that merely loads NCCL (PyTorch always does) is not evidence; only a communicator
//! that set up transports is.

use cryo_proc::{ProcError, ProcHandle};

/// What betrays cross-process CUDA in a process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", content = "name", rename_all = "snake_case")]
pub enum Evidence {
    /// An NCCL shared-memory segment it maps.
    NcclSharedMemory(String),
    /// NCCL's IPC socket (peer-to-peer through cuMem handles).
    NcclIpcSocket(String),
}

impl std::fmt::Display for Evidence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Evidence::NcclSharedMemory(p) => write!(f, "maps NCCL shared memory {p}"),
            Evidence::NcclIpcSocket(s) => write!(f, "holds NCCL's IPC socket {s}"),
        }
    }
}

/// Whether a mapped file is an NCCL shared-memory segment.
fn is_nccl_shm(path: &str) -> bool {
    path.strip_prefix("/dev/shm/nccl-").is_some()
}

/// Whether a unix socket name is NCCL's IPC socket (abstract: `@/tmp/nccl-socket-...`; the
/// path form when abstract sockets are disabled).
fn is_nccl_socket(name: &str) -> bool {
    name.trim_start_matches('@')
        .starts_with("/tmp/nccl-socket-")
}

/// The evidence of cross-process CUDA in `h`; empty when none.
pub fn cross_process_cuda(h: &ProcHandle) -> Result<Vec<Evidence>, ProcError> {
    let mut found = Vec::new();
    for f in h.mapped_files()? {
        let p = f.to_string_lossy();
        if is_nccl_shm(&p) {
            found.push(Evidence::NcclSharedMemory(p.into_owned()));
        }
    }
    for name in h.unix_socket_names()? {
        if is_nccl_socket(&name) {
            found.push(Evidence::NcclIpcSocket(name));
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_names_are_told_from_others() {
        assert!(is_nccl_shm("/dev/shm/nccl-Ab12Cd"));
        assert!(is_nccl_shm("/dev/shm/nccl-Ab12Cd (deleted)"));
        assert!(!is_nccl_shm("/dev/shm/torch_123"));
        assert!(!is_nccl_shm("/usr/lib/libnccl.so.2"));
        assert!(is_nccl_socket("@/tmp/nccl-socket-0-1f2e"));
        assert!(is_nccl_socket("/tmp/nccl-socket-3-ab"));
        assert!(!is_nccl_socket("@cryo-sim/abc/1-2-3"));
    }

    #[test]
    fn a_plain_process_shows_none() -> Result<(), ProcError> {
        let me = ProcHandle::open(std::process::id() as cryo_proc::Pid)?;
        assert_eq!(cross_process_cuda(&me)?, Vec::new());
        Ok(())
    }
}
