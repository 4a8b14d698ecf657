//! cryo's one test kit, used by every crate's tests (and only by tests: no library depends on it
//! except as a dev-dependency).
//!
//! # Design
//! - [`eventually`]: the one way to wait for something the system does asynchronously. A test
//!   waits for the positive event that must come first (a journal entry, an exit, a round trip
//!   through the simulated driver), never sleeps and then asserts that nothing happened.
//!   [`PATIENCE`] bounds every wait: a hang guard, not a timing assertion.
//! - [`sim`]: a simulated GPU driver daemon in a temporary directory and sim workers, started
//!   from whichever binary the test crate has (`cryo-sim`, or `cryo sim`).
//! - [`http`]: one HTTP/1.1 request to a worker on loopback TCP or on a unix socket.
//! - [`fake`]: [`fake::FakeGpu`], an in-process driver implementing the `cryo-gpu` traits
//!   (`CheckpointDriver`, `GpuInspector`) with state scripting and error injection
//!   ([`fake::FakeGpu::fail_next`], hangs, a process that dies when a call reaches it, memory
//!   that NVML keeps listing); it records every call and every live restored context torn down.
//! - [`fake_criu`]: [`fake_criu::FakeCriu`], the `cryo-criu` seam (`Criu`) in process: dumps
//!   that kill the tree after a complete dump, failures on demand, and a record of the driver
//!   state of every process at the moment it was dumped.
//! - [`image`]: small published images for tests of the image's files (not restorable).
//! - [`fuse`]: a FUSE mirror of a directory whose server never answers the requests it is told
//!   to hold: a real uninterruptible wait (state `D`) for the process that sent one.
//! - [`cgroup`]: a memory cgroup per test with a unique name (several test runs share a machine).
//! - [`own`]: every process a test starts is in a cgroup of the test's own, ended by a watchdog
//!   once the test process is gone, however it ended (a panic, an abort, a runner's SIGKILL).
//!   Every kit helper that starts a process calls [`own()`] first; a test that starts processes
//!   by other means calls it before.
//! - [`procs`]: plain processes to act on (one with a given pid, to reuse a dead one's; a
//!   thread of the test's own process), and what `/proc` says about a process.
//!
//! # Layering
//! The kit may depend on every library; a library depends on it only as a dev-dependency. Cargo
//! accepts the cycle that makes (`cryo-sim`'s tests use the kit, the kit uses `cryo-sim`): an
//! integration test links the one `cryo-sim` library the kit was built against. A crate's own
//! unit tests (`#[cfg(test)]` inside `src/`) see a second copy of their crate through the kit, so
//! they may use the kit only with types of crates below them (`cryo-gpu`, `cryo-criu`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

pub mod cgroup;
pub mod disk;
pub mod fake;
pub mod fake_criu;
pub mod fds;
pub mod fuse;
pub mod http;
pub mod image;
pub mod own;
pub mod procs;
pub mod sim;
mod wait;

pub use own::own;
pub use wait::{eventually, eventually_said, Ready, PATIENCE};

/// Fails the test loudly unless it runs as root with CRIU >= 4.2 found (what the tests that
/// drive real CRIU need: `scripts/install-criu.sh`, root); never a silent skip.
pub fn require_criu_and_root() {
    own();
    if let Err(e) = cryo_criu::CriuRpc::locate(None) {
        panic!("CRIU is required for this test (run scripts/install-criu.sh as root): {e}");
    }
    assert!(
        nix::unistd::geteuid().is_root(),
        "this test needs root (CRIU)"
    );
}

/// The driver's code of a call that must have failed with one.
pub fn cu_code<T: std::fmt::Debug>(r: Result<T, cryo_gpu::DriverError>) -> cryo_gpu::CuResult {
    match r {
        Err(cryo_gpu::DriverError::Cuda { code, .. }) => code,
        other => panic!("expected a CUDA error, got {other:?}"),
    }
}
