//! The record of a restore done outside [`crate::thaw()`]: `cryo gpu restore`, the
//! `cuda-checkpoint` front end (`--action restore`, or a toggle out of CHECKPOINTED), the demo and
//! the benchmarks.
//!
//! # Design
//! [`record_restored`] appends [`Event::RestoreCompleted`] for the process, so that `cryo stop`
//! and the guard know its context came from a restore. It runs after the driver restored the
//! context, so its failure is no reason to undo anything: callers report it as a warning (a
//! process with no record is treated as restored anyway, the safe default).

use cryo_journal::{Event, ProcId};
use cryo_proc::ProcHandle;
use cryo_state::StateDir;

use crate::suspend::id;

/// The restore happened but could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    /// The journal could not be opened.
    #[error(transparent)]
    Open(#[from] cryo_journal::OpenError),
    /// The record could not be appended.
    #[error(transparent)]
    Append(#[from] cryo_journal::AppendError),
}

/// Journals that the process `handle` holds was restored; `how` names the command that did it.
/// Returns the identity recorded.
pub fn record_restored(
    state: &StateDir,
    handle: &ProcHandle,
    how: &str,
) -> Result<ProcId, RecordError> {
    let pid = id(handle);
    state.open_journal()?.append(Event::RestoreCompleted {
        pid,
        image: how.to_string(),
        ms: None,
    })?;
    Ok(pid)
}
