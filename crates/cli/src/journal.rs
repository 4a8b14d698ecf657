//! Where the CLI keeps its journal (`STATE_DIR/journal`), and the records that commands outside
//! `cryo stop` add to it.
//!
//! # Design
//! `cryo gpu restore` and the `cuda-checkpoint` front end's restore (and toggle back to running)
//! record [`Event::RestoreCompleted`], so that `cryo stop` and the guard know the process came
//! from a restore. That record is best effort: the driver action already happened, so a state
//! directory that cannot be written is a warning on stderr, never a failed restore (and an
//! unrecorded process is treated as restored anyway, the safe default).

use std::path::{Path, PathBuf};

use anyhow::Context as _;
use cryo_gpu::Pid;
use cryo_journal::{Event, Journal, ProcId};

/// The journal directory under `state_dir`.
pub fn dir(state_dir: &Path) -> PathBuf {
    state_dir.join("journal")
}

/// Records that `pid` was restored (`how`: the command that did it); warns on failure.
pub fn record_restore(state_dir: &Path, pid: Pid, how: &str) {
    if let Err(e) = try_record_restore(state_dir, pid, how) {
        eprintln!(
            "cryo: warning: pid {pid} was restored, but the journal could not record it ({}); cryo will treat it as restored anyway",
            crate::exit::one_line(&e)
        );
    }
}

fn try_record_restore(state_dir: &Path, pid: Pid, how: &str) -> anyhow::Result<()> {
    let proc = ProcId::of(pid).with_context(|| format!("reading the identity of pid {pid}"))?;
    let dir = dir(state_dir);
    let journal =
        Journal::open(&dir).with_context(|| format!("opening the journal in {}", dir.display()))?;
    journal
        .append(Event::RestoreCompleted {
            pid: proc,
            image: how.to_string(),
            ms: None,
        })
        .context("appending to the journal")?;
    Ok(())
}
