//! What NCCL leaves for the host to see once a communicator is up (`cryo sim worker --nccl`),
//! so cryo's detection of cross-process CUDA is tested: a shared-memory segment
//! `/dev/shm/nccl-XXXXXX` mapped and unlinked (NCCL's SHM transport, `ncclShmOpen`), and the
//! abstract datagram socket `/tmp/nccl-socket-RANK-HASH` through which ranks pass cuMem handles
//! (`ncclIpcSocketInit`). Nothing else of NCCL is simulated.

use std::io;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixDatagram};

/// Sets the evidence up for `rank`; it lives as long as the process.
pub(super) fn start(rank: usize) -> io::Result<()> {
    let hash = u64::from(std::process::id()).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let path = format!("/dev/shm/nccl-sim{:06x}", hash & 0xff_ffff);
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    file.set_len(4096)?;
    crate::sys::map_shared_forever(&file, 4096)?;
    // Every rank attached: NCCL unlinks the segment, the mapping stays.
    std::fs::remove_file(&path)?;
    let name = format!("/tmp/nccl-socket-{rank}-{hash:x}");
    let sock = UnixDatagram::bind_addr(&SocketAddr::from_abstract_name(name.as_bytes())?)?;
    std::mem::forget(sock);
    tracing::info!(rank, %path, socket = %name, "NCCL communicator evidence set up");
    Ok(())
}
