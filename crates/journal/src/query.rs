//! Questions the rest of cryo asks the journal: where did a process come from, and what was in
//! flight when cryo last stopped.

use std::collections::{BTreeMap, BTreeSet};
use std::time::SystemTime;

use crate::event::Purpose;
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
    /// Its context went through a driver restore by cryo: a `RestoreStarted` or
    /// `RestoreCompleted` names it (with the image or the command), or a `Resumed` (restored in
    /// place after a failed suspension).
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
    /// The intent of a restore counts as much as its completion: a crash between the two leaves a
    /// context that may be live and restored.
    pub fn from_records<'a>(records: impl IntoIterator<Item = &'a Record>) -> Origins {
        let mut out = Origins::default();
        for r in records {
            match &r.event {
                Event::RestoreCompleted { pid, image, .. }
                | Event::RestoreStarted { pid, image, .. } => {
                    out.restored.insert(*pid, image.clone());
                }
                Event::Resumed { pid } => {
                    out.restored
                        .entry(*pid)
                        .or_insert_with(|| "resumed in place after a failed suspension".into());
                }
                Event::FreshDeclared { pid } => {
                    out.fresh.insert(*pid);
                }
                // The restored program is gone; its pid and start time name a new one.
                Event::Execed { pid, .. } => {
                    out.restored.remove(pid);
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

/// A suspension that did not finish for one process.
#[derive(Debug, Clone, PartialEq)]
pub struct InFlight {
    /// The last stop step journaled for the process (`None`: only an abandoned call is open).
    pub step: Option<StopStep>,
    /// Its record (the abandoned call's when there is no open step).
    pub record: Record,
    /// What the suspension was for, from its `SuspendStarted` (`None` in older journals).
    pub purpose: Option<Purpose>,
    /// The cryo process that ran it, from its `SuspendStarted` (`None` in older journals).
    pub by: Option<ProcId>,
    /// A driver call abandoned since (its entry point): the process's state is unknown.
    pub abandoned: Option<String>,
    /// The intent ([`Event::RestoreStarted`]) of a restore that undoes this suspension (a park or
    /// freeze resuming its worker in place), when its completion is not journaled: the restore
    /// may have been checkpointed again (its completion refused) or its writer died. Its
    /// `unlock_by` is the writer at work on it.
    pub restore_started: Option<Record>,
}

/// Processes whose suspension did not finish: the last stop step is not final (not `Killed` nor
/// `Refused`) and no later record settled it (`Unlocked`, `Resumed`, a completed restore, or
/// `SuspensionSettled`), or a driver call on them was abandoned and nobody has looked since. A
/// restore's intent alone does not settle a suspension ([`InFlight::restore_started`]): a
/// completion refused by the journal checkpoints the process again. What
/// a new stop or guard must settle (after checking [`ProcId::is_alive_same`], and that the owner
/// [`InFlight::by`] is gone).
pub fn in_flight_stops<'a>(
    records: impl IntoIterator<Item = &'a Record>,
) -> BTreeMap<ProcId, InFlight> {
    let mut all: BTreeMap<ProcId, InFlight> = BTreeMap::new();
    for r in records {
        let Some(p) = r.event.proc() else { continue };
        let entry = all.entry(p).or_insert_with(|| InFlight {
            step: None,
            record: r.clone(),
            purpose: None,
            by: None,
            abandoned: None,
            restore_started: None,
        });
        match &r.event {
            Event::SuspendStarted { purpose, by, .. } => {
                entry.step = None;
                entry.purpose = Some(*purpose);
                entry.by = *by;
                entry.record = r.clone();
                entry.restore_started = None;
            }
            Event::CallAbandoned { call, .. } => {
                entry.abandoned = Some(call.clone());
                if entry.step.is_none() {
                    entry.record = r.clone();
                }
            }
            // The undo of a suspension started: in flight until its completion.
            Event::RestoreStarted { .. } if entry.step.is_some_and(|s| !s.is_done()) => {
                entry.restore_started = Some(r.clone());
            }
            Event::Unlocked { .. }
            | Event::Resumed { .. }
            | Event::Parked { .. }
            | Event::RestoreStarted { .. }
            | Event::RestoreCompleted { .. } => {
                entry.step = None;
                entry.restore_started = None;
            }
            Event::SuspensionSettled { .. } | Event::Killed { .. } => {
                entry.step = None;
                entry.abandoned = None;
                entry.restore_started = None;
            }
            event => {
                if let Some(step) = StopStep::of(event) {
                    entry.step = Some(step);
                    entry.record = r.clone();
                    entry.restore_started = None;
                }
            }
        }
    }
    all.retain(|_, f| f.step.is_some_and(|s| !s.is_done()) || f.abandoned.is_some());
    all
}

/// A dump's CPU pinning that nothing has settled yet: its [`Event::CpusPinned`] record, with no
/// [`Event::CpusReturned`] of the same root and owner after it.
#[derive(Debug, Clone)]
pub struct OpenPins {
    /// The record (an [`Event::CpusPinned`]).
    pub record: Record,
    /// Its tree's root.
    pub root: ProcId,
    /// The cryo process that pinned it (`None`: not recorded; settled like a dead owner's).
    pub by: Option<ProcId>,
}

/// Every dump's CPU pinning not given back yet, oldest first: what whoever finds its owner
/// ([`OpenPins::by`]) gone gives back.
pub fn open_pins<'a>(records: impl IntoIterator<Item = &'a Record>) -> Vec<OpenPins> {
    let mut open: Vec<OpenPins> = Vec::new();
    for r in records {
        match &r.event {
            Event::CpusPinned { root, by, .. } => open.push(OpenPins {
                record: r.clone(),
                root: *root,
                by: *by,
            }),
            Event::CpusReturned { root, by, .. } => {
                open.retain(|o| !(o.root == *root && o.by == *by));
            }
            _ => {}
        }
    }
    open
}

/// Processes a guard attached and has not let go of since (no `GuardLost`, `ProcessExited`,
/// `Pinned`, `Execed` or `Killed` after its last `GuardAttached`), with why it was guarded: what
/// a guard that starts re-attaches, or journals as lost when the process died unwatched.
pub fn guarded<'a>(
    records: impl IntoIterator<Item = &'a Record>,
) -> BTreeMap<ProcId, crate::AttachSource> {
    let mut open = BTreeMap::new();
    for r in records {
        match &r.event {
            Event::GuardAttached { pid, source } => {
                open.insert(*pid, *source);
            }
            Event::GuardLost { pid }
            | Event::ProcessExited { pid, .. }
            | Event::Pinned { pid, .. }
            | Event::Execed { pid, .. }
            | Event::Killed { pid } => {
                open.remove(pid);
            }
            _ => {}
        }
    }
    open
}

/// Processes (dead ones above all) whose driver fds were pinned and never released nor
/// declared lost (`Pinned` with no `PinsReleased` or `PinsLost` after it), with the GPUs of
/// their pins as journaled: what a guard that starts finds held by the pin holder, or declares
/// lost (and keeps fenced).
pub fn pinned<'a>(records: impl IntoIterator<Item = &'a Record>) -> BTreeMap<ProcId, Vec<String>> {
    let mut open: BTreeMap<ProcId, Vec<String>> = BTreeMap::new();
    for r in records {
        match &r.event {
            Event::Pinned { pid, gpu, .. } => open.entry(*pid).or_default().push(gpu.clone()),
            Event::PinsReleased { pid } | Event::PinsLost { pid, .. } => {
                open.remove(pid);
            }
            _ => {}
        }
    }
    open
}
