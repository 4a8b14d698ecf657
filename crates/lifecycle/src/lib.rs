//! The lifecycle of a GPU worker: suspend, stop, freeze and thaw.
//!
//! # Design
//! Every path that ends a process that may hold a restored CUDA context goes through
//! [`suspend`]: lock every CUDA process in parallel, checkpoint them in parallel, then verify
//! through the inspection API (NVML) that their device memory is gone. An OK return code alone is
//! never taken as proof. [`stop`] builds suspend-before-kill on it; freeze and thaw (CRIU) build on
//! both. Each step is written to the journal before it acts and after, so a crash leaves a trace of
//! what was in flight, and a second run resumes from the driver's own state (a process already
//! CHECKPOINTED is not checkpointed again).
//!
//! Refusal is a result, not an error: when a CUDA process cannot be suspended, nothing in the
//! target is killed and every process is left in a safe state (unlocked and serving, or
//! checkpointed).
//!
//! # Limitations
//! Test hooks: [`failpoint`] (`CRYO_FAILPOINT=stop-before-kill`) makes `stop` stall after the
//! suspension is verified and before anything is killed, so crash recovery can be tested.

pub mod cpus;
pub mod cuda;
pub mod failpoint;
mod forks;
pub mod freeze;
pub mod health;
pub mod inflight;
pub mod ipc;
mod leftover;
mod oplock;
pub mod park;
pub mod progress;
pub mod reaped;
pub mod restore;
pub mod runnable;
pub mod shrink;
pub mod standby;
pub mod stop;
pub mod suspend;
pub mod target;
pub mod thaw;
pub mod watcher;

pub use cuda::{classify, Class, Unsure};
pub use freeze::{freeze, FreezeError, FreezeMoments, FreezeOptions, FreezeReport};
pub use health::HealthCheck;
pub use inflight::{settle_in_flight, SettleError, Settled, Settlement};
pub use oplock::{Op, BUSY_RETRY};
pub use park::{
    park, parked_now, wake, ParkError, ParkOptions, ParkReport, ParkedWorker, WakeError,
    WakeOptions, WakeReport, WhenFull,
};
pub use progress::{NoProgress, Phases, Progress, Stopwatch};
pub use restore::{
    finish_unlock, pending_restore, record_restored, restore_context, restore_pending,
    resume_in_place, FinishUnlock, FinishUnlockError, PendingRestore, Placement, RecordError,
    RestoreError,
};
pub use runnable::{runnable, Runnable};
pub use shrink::{Shrink, ShrinkReport, ShrinkSpec};
pub use standby::{claim, prepare, ClaimError, Standby, StandbyError, StandbyRefusal};
pub use stop::{
    stop, stop_when_free, EndSignal, ProcReport, Refusal, RefusalReason, StopError, StopOptions,
    StopReport,
};
pub use suspend::{suspend, suspend_watched, SuspendOptions, SuspendOutcome, Suspended};
pub use target::{open_process, OpenProcessError, ResolveError, Resolved, Target};
pub use thaw::{
    criu_deadline, open_image, open_image_apart, thaw, thaw_opened, PrecheckError, ThawError,
    ThawOptions, ThawReport,
};
pub use watcher::{Coverage, Lease, NoWatcher, Watcher, WatcherError};
