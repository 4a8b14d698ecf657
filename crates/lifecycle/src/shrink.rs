//! Shrink before suspend, as the lifecycle runs it: the engine of a target is asked to release
//! what it can rebuild before the suspension (stop, freeze, park), journaled, and to take it back
//! once the worker runs again (a freeze left running or refused, a park undone, a wake, a thaw).
//!
//! # Design
//! [`release`] runs before anything is locked and never fails the operation: its outcome
//! ([`cryo_shrink::Outcome`]) is journaled (`shrink_started`, `shrink_completed`) and reported,
//! and the suspension goes on either way, copying what is left on the device. [`Shrunk::grow`]
//! asks for the memory back only when the release may have taken some (shrunk, or unknown) and
//! journals `grown` or `grow_failed` (the worker serves again either way: the CUDA side is whole;
//! only the engine's own memory may be missing until someone asks it to grow). Stops never grow:
//! the worker ends.
//!
//! The engine is reached from the worker's network namespace (its root process's): `--engine-url
//! http://127.0.0.1:PORT` is the worker's loopback, in a container or a standby as on the host. A
//! namespace that cannot be entered is never replaced by cryo's own (its loopback may hold
//! another engine): the release is not sent, the grow fails, and both say why.

use std::time::Duration;

use cryo_gpu::{Gpu, ProcessState};
use cryo_journal::{AppendError, Event, Journal, ProcId, Record};
use cryo_proc::ProcHandle;
use serde::{Deserialize, Serialize};

pub use cryo_shrink::{
    NetNs, Outcome, Released, Shrink, ShrinkError, ShrinkSpec, SpecError, DEFAULT_TIMEOUT,
};

use crate::progress::Progress;
use crate::suspend::id;

/// What the shrink of an operation did, for its report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShrinkReport {
    /// The `--shrink` spec.
    pub spec: ShrinkSpec,
    /// The release.
    pub released: Released,
    /// The grow after the restore, ms, when one succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grow_ms: Option<u64>,
    /// Why the grow failed, when it did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grow_error: Option<String>,
}

impl ShrinkReport {
    /// One line for the operator: `shrink vllm:1: shrunk in 120 ms` or why not.
    pub fn summary(&self) -> String {
        let mut s = match &self.released.outcome {
            Outcome::Shrunk => format!("shrink {}: shrunk in {} ms", self.spec, self.released.ms),
            Outcome::Whole { error } => format!(
                "shrink {}: NOT shrunk ({error}); the suspension copied all of its memory",
                self.spec
            ),
            Outcome::Unknown { error, undo_error } => format!(
                "shrink {}: FAILED ({error}) and could not be undone ({undo_error})",
                self.spec
            ),
        };
        match (&self.grow_ms, &self.grow_error) {
            (Some(ms), _) => s.push_str(&format!("; grown again in {ms} ms")),
            (None, Some(e)) => s.push_str(&format!(
                "; GROW FAILED ({e}): the engine may answer errors until it is woken"
            )),
            (None, None) => {}
        }
        s
    }
}

/// A release done, to grow after the restore.
#[derive(Debug)]
pub struct Shrunk {
    shrink: Shrink,
    target: String,
    pids: Vec<ProcId>,
    /// The worker's network namespace (`None`: cryo's own), or why it cannot be entered.
    from: Result<Option<NetNs>, String>,
    /// What happened so far.
    pub report: ShrinkReport,
}

/// Asks the engine of `target` (its processes `handles`) to release its memory within `budget`
/// (at most the shrink's own deadline); `None` when there is no shrink to do: none asked for,
/// or no CUDA process of the target runs (a parked or locked engine cannot answer: its GPU calls
/// wait for the unlock).
pub fn release(
    gpu: &Gpu,
    shrink: Option<&Shrink>,
    target: &str,
    handles: &[ProcHandle],
    budget: Duration,
    journal: &Journal,
    progress: &dyn Progress,
) -> Result<Option<Shrunk>, AppendError> {
    let Some(shrink) = shrink.filter(|s| !s.is_none()) else {
        return Ok(None);
    };
    let Some(engine) = engine_process(gpu, handles) else {
        tracing::info!(
            target,
            "no CUDA process of the target runs: nothing to shrink"
        );
        return Ok(None);
    };
    let pids: Vec<ProcId> = handles.iter().map(id).collect();
    let root = handles.first().map_or(0, ProcHandle::pid);
    let from = namespace_of(Some(engine));
    journal.append(Event::ShrinkStarted {
        target: target.to_owned(),
        spec: shrink.spec.to_string(),
    })?;
    progress.begin(root, "shrink", 0);
    let released = match &from {
        Ok(ns) => shrink.release_from(budget, ns.as_ref()),
        Err(error) => Released {
            outcome: Outcome::Whole {
                error: error.clone(),
            },
            ms: 0,
        },
    };
    let (outcome, error) = match &released.outcome {
        Outcome::Shrunk => ("shrunk", None),
        Outcome::Whole { error } => ("whole", Some(error.clone())),
        Outcome::Unknown { error, undo_error } => (
            "unknown",
            Some(format!("{error}; undoing it failed: {undo_error}")),
        ),
    };
    progress.end(
        root,
        "shrink",
        matches!(released.outcome, Outcome::Shrunk),
        error.as_deref().unwrap_or("shrunk"),
    );
    journal.append(Event::ShrinkCompleted {
        target: target.to_owned(),
        pids: pids.clone(),
        spec: shrink.spec.to_string(),
        engine: shrink.engine.clone(),
        outcome: outcome.to_owned(),
        error,
        ms: released.ms,
    })?;
    if let Outcome::Whole { error } | Outcome::Unknown { error, .. } = &released.outcome {
        tracing::warn!(target, %error, "the engine did not shrink: suspending all of its memory");
    }
    Ok(Some(Shrunk {
        report: ShrinkReport {
            spec: shrink.spec.clone(),
            released,
            grow_ms: None,
            grow_error: None,
        },
        shrink: shrink.clone(),
        target: target.to_owned(),
        pids,
        from,
    }))
}

/// The engine's process among `handles`: the first CUDA process that runs (a cgroup target may
/// list cryo's own caller, or a sidecar in another namespace, first).
fn engine_process<'a>(gpu: &Gpu, handles: &'a [ProcHandle]) -> Option<&'a ProcHandle> {
    handles
        .iter()
        .find(|h| matches!(gpu.driver.state(h.pid()), Ok(ProcessState::Running)))
}

/// The network namespace to reach `root`'s engine from: `None` for cryo's own.
fn namespace_of(root: Option<&ProcHandle>) -> Result<Option<NetNs>, String> {
    let Some(h) = root else { return Ok(None) };
    h.net_namespace().map(|ns| ns.map(NetNs::new)).map_err(|e| {
        format!(
            "cannot enter the network namespace of pid {} to reach its engine: {e}",
            h.pid()
        )
    })
}

impl Shrunk {
    /// Asks the engine to take its memory back (the worker runs again), when the release may
    /// have taken some; journaled. A failure is reported, never an error of the operation.
    pub fn grow(&mut self, journal: &Journal, progress: &dyn Progress) -> Result<(), AppendError> {
        if !self.report.released.outcome.needs_grow() {
            return Ok(());
        }
        let root = self.pids.first().map_or(0, |p| p.pid);
        progress.begin(root, "grow", 0);
        // Its own deadline again: the engine reloads what it dropped.
        let grown = match &self.from {
            Ok(ns) => self.shrink.grow_from(
                self.shrink.timeout().max(cryo_shrink::DEFAULT_TIMEOUT),
                ns.as_ref(),
            ),
            Err(e) => Err(ShrinkError::Namespace(e.clone())),
        };
        match grown {
            Ok(ms) => {
                progress.end(root, "grow", true, "grown");
                self.report.grow_ms = Some(ms);
                journal
                    .append(Event::Grown {
                        target: self.target.clone(),
                        pids: self.pids.clone(),
                        ms,
                    })
                    .map(drop)
            }
            Err(e) => {
                let error = e.to_string();
                progress.end(root, "grow", false, &error);
                tracing::error!(target = %self.target, %error, "the engine could not take its memory back");
                self.report.grow_error = Some(error.clone());
                journal
                    .append(Event::GrowFailed {
                        target: self.target.clone(),
                        pids: self.pids.clone(),
                        error,
                    })
                    .map(drop)
            }
        }
    }
}

impl Shrunk {
    /// What an image frozen after this release records (`None` when the engine stayed whole:
    /// nothing to grow after a thaw).
    pub fn frozen(&self) -> Option<cryo_criu::image::FrozenShrink> {
        let outcome = match &self.report.released.outcome {
            Outcome::Shrunk => "shrunk",
            Outcome::Unknown { .. } => "unknown",
            Outcome::Whole { .. } => return None,
        };
        Some(cryo_criu::image::FrozenShrink {
            spec: self.shrink.spec.to_string(),
            engine: self.shrink.engine.clone(),
            outcome: outcome.to_owned(),
        })
    }

    /// The shrink an image records, to grow once its tree runs again; an error when this build
    /// cannot carry it out (a spec it does not know, an address it cannot use).
    pub fn of_image(frozen: &cryo_criu::image::FrozenShrink) -> Result<Shrink, String> {
        let spec = frozen.spec.parse::<ShrinkSpec>().map_err(|e| {
            format!(
                "the image records --shrink {}, which this cryo cannot read: {e}",
                frozen.spec
            )
        })?;
        Shrink::new(spec, frozen.engine.clone(), cryo_shrink::DEFAULT_TIMEOUT).map_err(|e| {
            format!(
                "the image records --shrink {}, which cannot be carried out: {e}",
                frozen.spec
            )
        })
    }

    /// Reaches the engine from the network namespace of its process among `handles` (the
    /// first CUDA process that runs, once a thaw or a wake unlocked them), which may be one of
    /// its own.
    pub fn reached_through(&mut self, gpu: &Gpu, handles: &[ProcHandle]) {
        self.from = match engine_process(gpu, handles) {
            Some(h) => namespace_of(Some(h)),
            None => Err("no CUDA process of the target runs: its engine cannot answer".into()),
        };
    }

    /// An engine shrunk elsewhere (a freeze whose image is restored now) to grow: `target`'s
    /// processes `pids`.
    pub fn to_grow(shrink: &Shrink, target: &str, pids: Vec<ProcId>) -> Shrunk {
        Shrunk {
            report: ShrinkReport {
                spec: shrink.spec.clone(),
                released: Released {
                    outcome: Outcome::Shrunk,
                    ms: 0,
                },
                grow_ms: None,
                grow_error: None,
            },
            shrink: shrink.clone(),
            target: target.to_owned(),
            pids,
            from: Ok(None),
        }
    }
}

/// The shrink still to grow for any of `pids`, from the journal: the last `shrink_completed`
/// naming one of them whose outcome was `shrunk` or `unknown`, with no `grown` or `grow_failed`
/// for them since.
pub fn pending(records: &[Record], pids: &[ProcId]) -> Option<Shrunk> {
    let mut found: Option<Shrunk> = None;
    let names = |ps: &[ProcId]| ps.iter().any(|p| pids.contains(p));
    for r in records {
        match &r.event {
            Event::ShrinkCompleted {
                target,
                pids: ps,
                spec,
                engine,
                outcome,
                error,
                ms,
            } if names(ps) => {
                let spec: Option<ShrinkSpec> = spec.parse().ok();
                found = match (spec, outcome.as_str()) {
                    (Some(spec), "shrunk" | "unknown") => {
                        let released = Released {
                            outcome: match outcome.as_str() {
                                "shrunk" => Outcome::Shrunk,
                                _ => Outcome::Unknown {
                                    error: error.clone().unwrap_or_default(),
                                    undo_error: String::new(),
                                },
                            },
                            ms: *ms,
                        };
                        Some(Shrunk {
                            shrink: Shrink {
                                spec: spec.clone(),
                                engine: engine.clone(),
                                timeout_ms: ms_of(cryo_shrink::DEFAULT_TIMEOUT),
                            },
                            target: target.clone(),
                            pids: ps.clone(),
                            from: Ok(None),
                            report: ShrinkReport {
                                spec,
                                released,
                                grow_ms: None,
                                grow_error: None,
                            },
                        })
                    }
                    _ => None,
                };
            }
            Event::Grown { pids: ps, .. } | Event::GrowFailed { pids: ps, .. } if names(ps) => {
                found = None;
            }
            _ => {}
        }
    }
    found
}

fn ms_of(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}
