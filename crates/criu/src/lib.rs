//! CRIU for cryo: dump and restore of process trees through CRIU's RPC (`criu swrk`), and the
//! image directories they live in.
//!
//! # Design
//! [`CriuRpc::locate`] finds the binary (`explicit`, `$CRYO_CRIU`, `/usr/local/sbin/criu`, `PATH`)
//! and refuses a missing one ([`CriuError::NotFound`]) or one older than 4.2
//! ([`CriuError::TooOld`]: bookworm's 3.17 fails on current kernels). Each operation starts one
//! `criu swrk` worker and speaks protobuf to it over a `SOCK_SEQPACKET` socketpair; the messages
//! are prost code generated from CRIU's vendored `rpc.proto` and committed (see the `rpc`
//! module), so building needs no `protoc`. `rust-criu` was not used: its restore does not return
//! the restored pid, and it hands CRIU its socket without `O_CLOEXEC` in the parent.
//!
//! [`Criu`] is the seam the lifecycle uses (`&dyn Criu`); [`CriuRpc`] implements it.
//!
//! A failed operation is [`CriuError::Failed`] with CRIU's own `Error (...)` lines from its log.
//! Dumps log to `dump.log` in the image directory (part of the image); restores log to a work
//! directory outside it, so a restore never changes a verified image.
//!
//! Restores use CRIU's `rst_sibling`: the tree comes back as a child of the caller, not of the
//! short-lived CRIU worker. [`Criu::dump_staged`] (what `cryo freeze` uses) runs `criu dump
//! --stream` as a command instead, cryo capturing the image (CRIU's RPC has no streaming);
//! [`Criu::restore`] (what `cryo thaw` uses) runs `criu restore` as a command gated by cryo's
//! verdict on the image, checked beside CRIU or served to it ([`ThawRoute`], see [`image`]).
//!
//! The [`image`] module stages, publishes (atomically, crash-safe) and verifies image directories
//! with their [`image::Manifest`].
//!
//! Every dump of a tree with a pid namespace of its own holds the lock of its root's working
//! directory, where CRIU's parasite makes `proc.crtools` ([`crtools`]).
//!
//! # Limitations
//! Needs root and CRIU >= 4.2 (`scripts/install-criu.sh`). Without `shell_job`, the dumped root
//! must lead its own session, and its stdio must not be a terminal outside the tree. The caller
//! reaps: a dumped child of the caller stays a zombie holding its pid (and blocks a restore with
//! that pid) until waited for; a restored root is the caller's child. A restore needs every pid
//! of the image free, also as a process group or session id of a leftover of the dumped tree
//! that init has not reaped yet: [`cryo_proc::pids_in_use`] says which are still taken. Only
//! [`Criu::restore`] has a deadline ([`RestoreOpts::deadline`]); elsewhere a hung CRIU hangs
//! the call. A restore's CRIU that resumed its tree and has not exited is waited for in the
//! background and killed alone at that deadline (its tree runs on); one in state `D` holds its
//! place in [`stuck_crius`] until its wait ends, and past [`MAX_STUCK_CRIUS`] of those a
//! restore is refused.

mod colocate;
mod criu;
pub mod crtools;
mod error;
pub mod image;
pub mod kdat;
mod log;
mod rpc;
pub mod scratch;
pub mod stats;
mod unresumed;
mod version;

pub use colocate::{PinRecord, Unrecorded};
pub use criu::stuck_crius;
pub use criu::{
    dump_gate_verdict, error_lines, AtGate, Criu, CriuFlags, CriuRpc, DumpGate, DumpOpts,
    DumpPhases, RestoreOpts, RestorePhases, Restored, ThawRoute, CRIU_ENV, CRIU_POST_RESUME_HELD,
    DEFAULT_CRIU, DUMP_LOG, DUMP_LOG_LEVEL, FOLLOW_EARLY_ENV, KILLED_GRACE, MAX_STUCK_CRIUS,
    RESTORE_LOG, VERSION_CACHE,
};
pub use error::{CriuError, CriuOp, Stuck};
pub use image::{ImageError, Manifest};
pub use log::LogCap;
pub use rpc::RpcError;
pub use version::CriuVersion;
