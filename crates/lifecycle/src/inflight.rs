//! Suspensions that died half-way: settled by the next stop, guard or agent start.
//!
//! # Design
//! A stop, freeze or guard that dies between lock and checkpoint leaves its worker LOCKED (it
//! serves nothing, forever); one that dies after the checkpoint leaves it CHECKPOINTED and alive;
//! a driver call abandoned for want of an answer may take effect later. The journal knows every
//! such process ([`cryo_journal::in_flight_stops`]): its last suspension step is not final, or an
//! abandoned call is open. [`settle_in_flight`] looks at each one that is still the same live
//! process and whose owner (the cryo process that journaled its `SuspendStarted`) is gone (a
//! live owner is still at work: it is left alone), asks the driver its state, and:
//! - RUNNING: nothing to do (the suspension never took, or was rolled back);
//! - LOCKED: the suspension locked it and went no further: unlock it, it serves again;
//! - CHECKPOINTED: finish what the suspension was for: a stop's or the guard's process is killed
//!   (after the last look: no driver files, nothing listed by NVML), a freeze's or park's is
//!   restored, traced by the guard while still LOCKED, and unlocked in place (journaled as
//!   restored, as a failed freeze does) when the caller has a [`Watcher`] to ask (a guard or agent
//!   starting: the guard itself; no guard on the node: [`crate::NoWatcher`]), and left
//!   checkpointed (safe) by a caller without one (a stop), never unlocked unguarded; one whose
//!   purpose the journal does not say is left checkpointed and named;
//! - anything else (FAILED, no answer, stopped threads): left as it is, and named.
//!
//! Each settled process gets an [`Event::SuspensionSettled`] record saying what was found and done,
//! so it is settled once; callers print the returned [`Settled`] list.
//!
//! Before the suspensions, the CPU sets a dump that died left pinned are given back
//! ([`crate::cpus`]; each such dump closed with an [`Event::CpusReturned`]).

use std::time::Duration;

use cryo_gpu::{Gpu, ProcessState};
use cryo_journal::{Event, Journal, ProcId, Purpose};
use cryo_proc::ProcHandle;

use crate::runnable::{runnable, Runnable};
use crate::suspend::{id, me};
use crate::watcher::Watcher;

/// What was done to one process whose suspension died half-way.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Settlement {
    /// It was RUNNING: nothing to do.
    Nothing,
    /// It was LOCKED by a suspension that went no further: unlocked, it serves again.
    Unlocked,
    /// It was CHECKPOINTED by a stop (or the guard) that did not get to the kill: killed.
    Killed,
    /// It was CHECKPOINTED by a freeze that did not finish: restored and unlocked in place.
    Resumed,
    /// Its main thread was left pinned to one CPU by a dump that did not finish (see
    /// [`crate::cpus`]): its own CPU set is back.
    CpusReturned,
    /// Left as it is, for the reason given.
    Left {
        /// Why.
        why: String,
    },
}

/// One process whose in-flight suspension was looked at.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Settled {
    /// The process.
    pub pid: ProcId,
    /// What the suspension was for, if the journal says.
    pub purpose: Option<Purpose>,
    /// What was found (`locked`, `checkpointed`, ...).
    pub found: String,
    /// What was done.
    pub action: Settlement,
}

impl std::fmt::Display for Settled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.purpose {
            Some(p) => format!("a {p} that did not finish"),
            None => "a suspension that did not finish".to_string(),
        };
        let pid = self.pid.pid;
        match &self.action {
            Settlement::Nothing => {
                write!(f, "pid {pid}: {what} left it {}; nothing to do", self.found)
            }
            Settlement::Unlocked => write!(
                f,
                "pid {pid}: {what} left it locked; unlocked, it serves again"
            ),
            Settlement::Killed => write!(
                f,
                "pid {pid}: {what} left it checkpointed; the stop is finished: killed"
            ),
            Settlement::Resumed => write!(
                f,
                "pid {pid}: {what} left it checkpointed; restored and unlocked in place"
            ),
            Settlement::CpusReturned => {
                write!(f, "pid {pid}: {}; its own CPU set given back", self.found)
            }
            Settlement::Left { why } => write!(
                f,
                "pid {pid}: {what} left it {}; left as it is: {why}",
                self.found
            ),
        }
    }
}

/// The journal could not be read or written; nothing was settled after the failure.
#[derive(Debug, thiserror::Error)]
pub enum SettleError {
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    Read(#[from] cryo_journal::ReadError),
    /// The journal could not be written before acting.
    #[error("cannot write the journal: {0}")]
    Append(#[from] cryo_journal::AppendError),
}

/// How long a killed process may take to exit.
const EXIT_TIMEOUT: Duration = Duration::from_secs(10);

/// Settles every in-flight suspension of the journal whose owner is gone (see the module docs).
/// The entry point for every stop (`watcher`: `None`), every guard start and the agent's start
/// (the guard, already tracing: it traces what it resumes before the unlock).
pub fn settle_in_flight(
    gpu: &Gpu,
    journal: &Journal,
    watcher: Option<&dyn Watcher>,
) -> Result<Vec<Settled>, SettleError> {
    let gpu = &gpu.bounded(cryo_gpu::Limits::default());
    let records = cryo_journal::read(journal.dir())?.records;
    let mine = me();
    // First the CPU sets a dead dump left pinned: a worker resumed below runs on all of them.
    let mut out = crate::cpus::give_back_dead(journal, &records)?;
    for (pid, f) in cryo_journal::in_flight_stops(&records) {
        if !pid.is_alive_same() {
            continue;
        }
        if let Some(by) = f.by {
            if Some(by) == mine || by.is_alive_same() {
                // Its owner is at work on it right now.
                continue;
            }
        }
        let Ok(h) = pid.open() else {
            continue;
        };
        let (found, action) = settle_one(gpu, journal, &h, f.purpose, watcher)?;
        journal.append(Event::SuspensionSettled {
            pid,
            found: found.clone(),
            action: match &action {
                Settlement::Nothing => "nothing".to_string(),
                Settlement::Unlocked => "unlocked".to_string(),
                Settlement::Killed => "killed".to_string(),
                Settlement::Resumed => "resumed".to_string(),
                Settlement::CpusReturned => "its CPU set given back".to_string(),
                Settlement::Left { why } => format!("left as it is: {why}"),
            },
        })?;
        out.push(Settled {
            pid,
            purpose: f.purpose,
            found,
            action,
        });
    }
    Ok(out)
}

fn settle_one(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    purpose: Option<Purpose>,
    watcher: Option<&dyn Watcher>,
) -> Result<(String, Settlement), SettleError> {
    let left = |found: &str, why: String| Ok((found.to_string(), Settlement::Left { why }));
    match runnable(h) {
        Ok(Runnable::Runs) => {}
        Ok(Runnable::Exited) => return Ok(("exited".into(), Settlement::Nothing)),
        Ok(r) => return left("stopped", r.why_not(h.pid()).unwrap_or_default()),
        Err(e) => return left("unreadable", e.to_string()),
    }
    let state = match crate::cuda::settled_state(gpu, h.pid(), crate::cuda::SETTLE) {
        Ok(s) => s,
        Err(e) => return left("no state", e.to_string()),
    };
    let found = state.to_string();
    match state {
        ProcessState::Running => Ok((found, Settlement::Nothing)),
        ProcessState::Locked => match gpu.driver.unlock(h.pid()) {
            Ok(()) => {
                journal.append(Event::Unlocked {
                    pid: id(h),
                    ms: None,
                    recovery: false,
                })?;
                Ok((found, Settlement::Unlocked))
            }
            Err(e) => left(&found, format!("cannot unlock it: {e}")),
        },
        ProcessState::Checkpointed => match purpose {
            Some(Purpose::Stop) | Some(Purpose::Guard) => finish_stop(gpu, journal, h, found),
            Some(Purpose::Freeze) | Some(Purpose::Park) => match watcher {
                Some(watcher) => match crate::restore::resume_in_place(
                    gpu,
                    journal,
                    h,
                    "resumed in place after a freeze that did not finish",
                    watcher,
                ) {
                    Ok(()) => Ok((found, Settlement::Resumed)),
                    Err(e) => left(&found, format!("cannot resume it: {e}")),
                },
                None => left(
                    &found,
                    "its context is suspended (safe); the next start of the agent or guard resumes it under watch, `cryo stop` ends it".into(),
                ),
            },
            Some(Purpose::Other) | None => left(
                &found,
                "the journal does not say what it was suspended for; `cryo stop` ends it, `cryo gpu restore` and `cryo gpu unlock` bring it back".into(),
            ),
        },
        ProcessState::Failed => left(&found, "the driver reports it FAILED".into()),
    }
}

/// The kill a stop did not get to, after the same last look a stop takes.
fn finish_stop(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    found: String,
) -> Result<(String, Settlement), SettleError> {
    let pid = h.pid();
    let left = |why: String| Ok((found.clone(), Settlement::Left { why }));
    match gpu.inspect.driver_fds(pid) {
        Ok(fds) if fds.is_empty() => {}
        Ok(fds) => return left(format!("it holds {} driver files again", fds.len())),
        Err(e) => return left(format!("its driver files cannot be listed: {e}")),
    }
    match gpu.inspect.process_memory(pid) {
        Ok(None) => {}
        Ok(Some(bytes)) => return left(format!("NVML lists {bytes} bytes for it")),
        Err(e) => return left(format!("NVML cannot be asked: {e}")),
    }
    let opts = crate::stop::StopOptions {
        exit_timeout: EXIT_TIMEOUT,
        ..crate::stop::StopOptions::default()
    };
    match crate::stop::end_one(h, &opts, journal, false) {
        Ok(()) => {}
        Err(crate::stop::StopError::Journal(e)) => return Err(e.into()),
        Err(e) => return left(e.to_string()),
    }
    Ok((found, Settlement::Killed))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::fake::FakeGpu;
    use cryo_testkit::procs::{self, Procs};

    /// A suspension of `pid` for `purpose` that went as far as `state` and whose owner is gone.
    fn died_at(journal: &Journal, pid: ProcId, purpose: Purpose, state: ProcessState) {
        // An owner that has exited: this test's own child, reaped.
        let mut owner = std::process::Command::new("true").spawn().unwrap();
        let by = ProcId::of(owner.id() as i32).unwrap();
        owner.wait().unwrap();
        journal
            .append(Event::SuspendStarted {
                pid,
                purpose,
                by: Some(by),
            })
            .unwrap();
        journal.append(Event::LockStarted { pid }).unwrap();
        journal.append(Event::Locked { pid, ms: 1 }).unwrap();
        if state == ProcessState::Checkpointed {
            journal.append(Event::CheckpointStarted { pid }).unwrap();
            journal
                .append(Event::Checkpointed {
                    pid,
                    ms: 1,
                    bytes: 1,
                })
                .unwrap();
        }
    }

    /// Each half-way suspension is finished or undone by what it was for, said, journaled, and
    /// settled once: locked -> unlocked; checkpointed by a stop -> killed (after the last look);
    /// checkpointed by a freeze -> resumed as restored; running -> nothing.
    #[test]
    fn half_way_suspensions_are_finished_or_undone_once() {
        let procs = Procs::spawn(4);
        let p = procs.pids();
        let fake = FakeGpu::new();
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let ids: Vec<ProcId> = p.iter().map(|p| ProcId::of(*p).unwrap()).collect();
        let cases = [
            (Purpose::Stop, ProcessState::Locked),
            (Purpose::Stop, ProcessState::Checkpointed),
            (Purpose::Freeze, ProcessState::Checkpointed),
            (Purpose::Guard, ProcessState::Running),
        ];
        for (i, (purpose, state)) in cases.iter().enumerate() {
            fake.add(p[i]).set_state(p[i], *state);
            died_at(&journal, ids[i], *purpose, *state);
        }
        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        let action = |i: usize| {
            settled
                .iter()
                .find(|s| s.pid == ids[i])
                .map(|s| s.action.clone())
        };
        assert_eq!(action(0), Some(Settlement::Unlocked), "{settled:?}");
        assert_eq!(action(1), Some(Settlement::Killed), "{settled:?}");
        assert_eq!(action(2), Some(Settlement::Resumed), "{settled:?}");
        assert_eq!(action(3), Some(Settlement::Nothing), "{settled:?}");
        assert_eq!(fake.state_of(p[0]), ProcessState::Running);
        assert!(!procs::alive(p[1]), "the stop was not finished");
        assert_eq!(fake.state_of(p[2]), ProcessState::Running);
        assert!(procs::alive(p[0]) && procs::alive(p[2]) && procs::alive(p[3]));
        assert!(fake.wedges().is_empty(), "{:?}", fake.wedges());
        // The freeze's worker came back through a driver restore: known as restored now.
        let records = cryo_journal::read(journal.dir()).unwrap().records;
        assert!(matches!(
            cryo_journal::Origins::from_records(&records).of(&ids[2]),
            cryo_journal::Origin::Restored { .. }
        ));
        for s in &settled {
            assert!(s.to_string().contains(&s.pid.pid.to_string()), "{s}");
        }
        // Settled once: the next run finds nothing in flight.
        assert_eq!(
            settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap(),
            Vec::new()
        );
    }

    /// A suspension whose owner is still alive is at work: left alone. One checkpointed by a stop
    /// that holds driver files again is left as it is and named, never killed.
    #[test]
    fn a_live_owner_is_left_alone_and_a_stop_is_finished_only_after_the_last_look() {
        let procs = Procs::spawn(2);
        let p = procs.pids();
        let fake = FakeGpu::new();
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let owner = ProcId::of(p[1]).unwrap();
        let id = ProcId::of(p[0]).unwrap();
        fake.add(p[0]).set_state(p[0], ProcessState::Locked);
        journal
            .append(Event::SuspendStarted {
                pid: id,
                purpose: Purpose::Stop,
                by: Some(owner),
            })
            .unwrap();
        journal.append(Event::Locked { pid: id, ms: 1 }).unwrap();
        assert_eq!(
            settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap(),
            Vec::new()
        );
        assert_eq!(fake.state_of(p[0]), ProcessState::Locked);

        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        fake.set_state(p[0], ProcessState::Checkpointed)
            .driver_files(p[0], &[7]);
        died_at(&journal, id, Purpose::Stop, ProcessState::Checkpointed);
        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        assert!(
            matches!(&settled[..], [Settled { action: Settlement::Left { why }, .. }] if why.contains("driver files")),
            "{settled:?}"
        );
        assert!(procs::alive(p[0]));
    }
}
