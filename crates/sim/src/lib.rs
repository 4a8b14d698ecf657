//! The simulated GPU: a driver daemon that owns "device memory", a sim worker that uses it like an
//! inference server uses a real GPU, and the client backend of the `cryo-gpu` traits.
//!
//! # Design
//! Faithful to the measured behaviour of the real driver (`shared/gpu-facts.md`), so every layer
//! above is tested without a GPU, real CRIU included:
//! - The **driver daemon** ([`daemon`]) listens on `DIR/driver.sock`. A worker's context is one
//!   connected unix socket to it (its `/dev/nvidia*`); the daemon holds that context's device
//!   memory (a heap buffer) and tears the context down when it sees EOF, i.e. when the last
//!   duplicate of the worker's end is closed. Tearing down a context that came from a restore while
//!   it is live records a [`ledger::Wedge`] in `DIR/ledger.jsonl`.
//! - The **worker** ([`worker`]) keeps its own checkpoint state (RUNNING/LOCKED/CHECKPOINTED),
//!   as a real CUDA process does, and runs a *restore thread* listening on an abstract unix socket
//!   `@cryo-sim/<daemon-id>/<pid>-<tid>-<nonce>`. Every checkpoint-API call but one is carried
//!   out by that thread; the daemon finds it for a pid through `/proc/PID/fd` and
//!   `/proc/net/unix`, and answers `GetRestoreThreadId` itself from the name (the real driver
//!   answers it for a frozen process: CRIU's cuda plugin relies on that). A worker holds contexts
//!   on one or several GPUs, or only a driver fd (`--init-only`), or is a tree of one process
//!   per GPU.
//! - The **client** ([`client`]) implements `CheckpointDriver` and `GpuInspector` by sending one
//!   request per connection to `driver.sock`; driver errors come back as the real `CUresult` codes.
//!
//! # Strict where the real driver is unknown
//! - A call whose restore thread cannot run (the process is stopped by a signal or a debugger,
//!   or frozen, or held by CRIU through a dump: seized, up to its `post-dump` stage, where cryo's
//!   gate judges it) gets no answer, lock with a timeout included, until the caller gives up or
//!   the process dies (then answered as for the dead process); the call stays queued and takes
//!   effect when the thread runs again, even though nobody waits for it any more. Callers need
//!   deadlines of their own and must look at the state afterwards, and must never read no answer
//!   as "no CUDA state": a CHECKPOINTED process so held has no driver files and nothing in NVML,
//!   as a plain one. `GetRestoreThreadId` alone is answered for it. A plain process held so is
//!   still answered "not initialised" at once (it has no restore thread).
//! - A pid that does not exist: `CUDA_ERROR_INVALID_VALUE`. A process without a restore thread (no
//!   CUDA, or a zombie: its files are closed, even while pins keep its context alive and NVML
//!   lists it): `CUDA_ERROR_NOT_INITIALIZED`, the codes a caller may read as "no CUDA state",
//!   so only evidence from the kernel and NVML tells such a zombie apart.
//! - A process that only initialised the driver (`--init-only`) is a CUDA process to the API
//!   (RUNNING, lock and checkpoint work, checkpoint closes its driver fd, restore reopens it) and
//!   invisible to NVML.
//! - Restore takes no GPU pairs or a complete list (one for every GPU of the process, identity
//!   pairs included, onto distinct GPUs); anything else is `CUDA_ERROR_INVALID_VALUE`.
//! - Injected hangs ([`proto::HangRule`]): any driver or NVML call can be made to hang.
//!
//! # Limitations
//! The daemon and its workers share a pid and network namespace. The way a
//! process died is read from `/proc/PID/stat` when its context is torn down: a process already
//! reaped by then is recorded as "unknown". CRIU before 4.2 cannot dump TCP sockets on Linux >=
//! 6.16 (checkpoint-restore/criu#2705); cryo requires 4.2 (`scripts/install-criu.sh`), and the
//! worker can also serve on a unix socket (`--http-unix PATH`).

pub mod cli;
pub mod client;
pub mod daemon;
pub mod ledger;
pub mod memory;
pub mod proto;
mod sys;
mod vram;
pub mod worker;

use std::path::PathBuf;

pub use cli::{SimCommand, SimError};
pub use client::{connect, SimClient, SimClientError, SimControl};
pub use ledger::Wedge;
pub use sys::advise_huge_pages;

/// Where the simulated driver lives unless told otherwise (`--sim-dir`, `CRYO_SIM_DIR`).
pub fn default_dir() -> PathBuf {
    PathBuf::from("/run/cryo-sim")
}

/// The daemon's control socket inside its directory.
pub fn socket_path(dir: &std::path::Path) -> PathBuf {
    dir.join("driver.sock")
}

/// The wedge ledger inside the daemon's directory.
pub fn ledger_path(dir: &std::path::Path) -> PathBuf {
    dir.join("ledger.jsonl")
}

/// A short id naming one daemon directory, so that the restore threads of workers of different
/// daemons (tests run many side by side) are told apart. Stable across daemon restarts.
pub fn daemon_id(dir: &std::path::Path) -> String {
    let canon = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in canon.as_os_str().as_encoded_bytes() {
        h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
}
