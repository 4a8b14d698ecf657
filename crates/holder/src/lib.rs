//! cryo-holder: the pin holder, a minimal process that keeps the pinned driver fds of dead
//! restored workers open across the agent's crash, SIGKILL, restart and upgrade, and its client.
//!
//! # Why a process of its own
//! A pinned fd keeps a live restored CUDA context from being torn down (which wedges affected
//! hosts). Held in the guard's own process, the pins die with it: a crash, a SIGKILL, an OOM kill
//! or a restart of the agent closes them all. The holder is the smallest process that can hold
//! them instead (in the spirit of containerd's shim): it receives fds over `SCM_RIGHTS` with
//! their metadata, acknowledges once they are in its table, answers its inventory, and closes a
//! GPU's pins only on an explicit, confirmed release. It does nothing else, so there is little
//! that can make it die: it ignores every signal whose default action kills, sets its
//! `oom_score_adj` to -1000, never panics on a closed stream, allocates only per request, and
//! lives outside the agent's cgroup.
//!
//! It is `cryo guard holder`, the same binary as the agent, not a separate one: the agent (or
//! `cryo guard --pin-holder`) starts it from `/proc/self/exe`, which is exactly its own build
//! even while a package upgrade replaces the file on disk, and there is one artifact to ship (a
//! separate binary could be missing or of another version next to the agent, which is the
//! failure that matters here); the holder's code is this crate only (no async runtime, no GPU
//! library, no Kubernetes client is ever initialised in it), and pages of the binary it never
//! runs are never loaded. It is a `guard` subcommand because it holds the guard's pins, whether
//! the guard runs in the agent or alone.
//!
//! # Modules
//! - [`proto`]: the versioned protocol (one JSON message per `SOCK_SEQPACKET` message, fds
//!   attached to the message that names them).
//! - [`server`]: the holder process (table, socket, handover to a new holder).
//! - [`client`]: [`HolderClient`] and [`Session`], for the guard and the CLI.
//! - [`launch`]: hardening, detaching (`--detach`), and [`launch::ensure`] (adopt or start).
//!
//! # Why not systemd's fd store
//! On systemd hosts the agent could also push the fds into its unit's fd store (`FDSTORE=1`).
//! It does not: the store is flushed when the unit stops (unless `FileDescriptorStorePreserve=`,
//! systemd 254 and later, which most fleet distributions do not ship), so a `systemctl stop`
//! would close that copy at a moment nobody chose; a release would have to close two copies in
//! two processes, and one left behind keeps a context the operator believes released (and lifted
//! the fence for) until systemd drops it, again at a moment nobody chose; and it does not exist
//! under Kubernetes, where most fleets run. The holder covers the agent's crash, restart and
//! upgrade everywhere with one copy and one release path.
//!
//! # Limitations
//! - SIGKILL (root only) ends the holder and closes every pin; nothing can catch it.
//! - The guard duplicates a dying process's fds into its own process before it sends them: if the
//!   agent is SIGKILLed in the microseconds between that duplication and the send, the process
//!   is released by the kernel and its context is torn down. From the send on, the fds are held
//!   by the holder's socket buffer (and then its table) even if the agent dies.

pub mod client;
pub mod launch;
pub mod proto;
pub mod server;
mod sys;

pub use client::{ClientError, HolderClient, Session};
pub use launch::{ensure, Adoption, CgroupChoice, EnsureError, Setup};
pub use proto::{Confirmation, HeldPin, HolderInfo, PinMeta, Refusal, PROTOCOL};
pub use sys::{ignore_killing_signals, killing_signals};
