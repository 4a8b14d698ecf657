//! Questions the rest of cryo asks the journal: where did a process come from, and what was in
//! flight when cryo last stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::{Event, ProcId, Record};

/// Which records a timeline or query keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Filter {
    /// Only records at or after this time.
    pub since: Option<SystemTime>,
    /// Only records naming this pid (any start time: the operator types a bare pid).
    pub pid: Option<i32>,
}

impl Filter {
    /// Whether `record` passes.
    pub fn matches(&self, record: &Record) -> bool {
        self.since.is_none_or(|t| record.time >= t)
            && self
                .pid
                .is_none_or(|pid| record.event.pids().iter().any(|p| p.pid == pid))
    }
}

/// Where a process came from, as the journal knows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// Restored by cryo from `image` (a `RestoreCompleted` names it).
    Restored {
        /// The image.
        image: String,
    },
    /// Declared never restored (`FreshDeclared`) and not restored by cryo.
    Fresh,
    /// Not in the journal. Callers treat this as restored (the safe default).
    Unknown,
}

/// The origin of every process the journal names.
#[derive(Debug, Clone, Default)]
pub struct Origins {
    /// Processes restored by cryo, with their image.
    pub restored: BTreeMap<ProcId, String>,
    /// Processes declared fresh and never restored.
    pub fresh: BTreeSet<ProcId>,
}

impl Origins {
    /// Collects origins from `records` (in journal order). A restore always wins over a
    /// declaration of freshness, whatever their order: being wrong the other way wedges hosts.
    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a Record>) -> Origins {
        let mut out = Origins::default();
        for r in records {
            match &r.event {
                Event::RestoreCompleted { pid, image, .. } => {
                    out.restored.insert(*pid, image.clone());
                }
                Event::FreshDeclared { pid } => {
                    out.fresh.insert(*pid);
                }
                _ => {}
            }
        }
        let restored = &out.restored;
        out.fresh.retain(|p| !restored.contains_key(p));
        out
    }

    /// Where `proc` came from.
    pub fn of(&self, proc: &ProcId) -> Origin {
        match self.restored.get(proc) {
            Some(image) => Origin::Restored {
                image: image.clone(),
            },
            None if self.fresh.contains(proc) => Origin::Fresh,
            None => Origin::Unknown,
        }
    }

    /// Drops every process that has exited or whose pid now names another process.
    pub fn retain_alive(&mut self) {
        self.restored.retain(|p, _| p.is_alive_same());
        self.fresh.retain(ProcId::is_alive_same);
    }

    /// Restored processes still alive (same pid and start time), what the guard must watch.
    pub fn live_restored(&self) -> Vec<ProcId> {
        self.restored
            .keys()
            .copied()
            .filter(ProcId::is_alive_same)
            .collect()
    }
}

/// The last record naming each process (any kind of event).
pub fn last_steps<'a>(records: impl IntoIterator<Item = &'a Record>) -> BTreeMap<ProcId, Record> {
    let mut out = BTreeMap::new();
    for r in records {
        if let Some(p) = r.event.proc() {
            out.insert(p, r.clone());
        }
    }
    out
}

/// How far `cryo stop` got with one process.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StopStep {
    /// Lock about to be taken (the process may be LOCKED or RUNNING).
    LockStarted,
    /// Locked.
    Locked,
    /// Lock failed; process RUNNING.
    LockFailed,
    /// Checkpoint about to run (the process may be LOCKED or CHECKPOINTED).
    CheckpointStarted,
    /// Checkpointed.
    Checkpointed,
    /// Checkpoint failed.
    CheckpointFailed,
    /// Device memory still shown at the deadline.
    VerifyFailed,
    /// Device memory verified gone.
    Verified,
    /// Signal about to be sent (the process may have exited).
    KillStarted,
    /// Exited. Done.
    Killed,
    /// Refused. Done.
    Refused,
}

impl StopStep {
    /// The stop step an event records, if it is one.
    pub fn of(event: &Event) -> Option<StopStep> {
        Some(match event {
            Event::LockStarted { .. } => StopStep::LockStarted,
            Event::Locked { .. } => StopStep::Locked,
            Event::LockFailed { .. } => StopStep::LockFailed,
            Event::CheckpointStarted { .. } => StopStep::CheckpointStarted,
            Event::Checkpointed { .. } => StopStep::Checkpointed,
            Event::CheckpointFailed { .. } => StopStep::CheckpointFailed,
            Event::VerifyFailed { .. } => StopStep::VerifyFailed,
            Event::Verified { .. } => StopStep::Verified,
            Event::KillStarted { .. } => StopStep::KillStarted,
            Event::Killed { .. } => StopStep::Killed,
            Event::Refused { .. } => StopStep::Refused,
            _ => return None,
        })
    }

    /// Whether the stop of the process is over (nothing to resume).
    pub fn is_done(self) -> bool {
        matches!(self, StopStep::Killed | StopStep::Refused)
    }
}

/// A stop that did not finish for one process.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    /// The last stop step journaled for the process.
    pub step: StopStep,
    /// Its record.
    pub record: Record,
}

/// Processes whose last `cryo stop` step is not final (not `Killed` nor `Refused`): what a new
/// `cryo stop` must resume (after checking [`ProcId::is_alive_same`]).
pub fn in_flight_stops<'a>(
    records: impl IntoIterator<Item = &'a Record>,
) -> BTreeMap<ProcId, InFlight> {
    let mut last: BTreeMap<ProcId, InFlight> = BTreeMap::new();
    for r in records {
        if let (Some(step), Some(p)) = (StopStep::of(&r.event), r.event.proc()) {
            last.insert(
                p,
                InFlight {
                    step,
                    record: r.clone(),
                },
            );
        }
    }
    last.retain(|_, f| !f.step.is_done());
    last
}
