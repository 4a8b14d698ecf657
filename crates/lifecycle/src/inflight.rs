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
//! A restore that undoes a suspension (a park or freeze resuming its worker in place) and whose
//! completion is not journaled keeps the suspension in flight
//! ([`cryo_journal::InFlight::restore_started`]): a completion the journal refused (two transient
//! EIOs: the park's record, then the restore's) checkpoints the process again, and nothing else
//! would ever resume it. Its writer (the intent's `unlock_by`) must be gone too; then
//! CHECKPOINTED is resumed under watch whatever the suspension was for (its writer meant it to
//! serve again), and LOCKED (a context perhaps restored and live) is left as it is and named,
//! never unlocked here.
//!
//! Each settled process gets an [`Event::SuspensionSettled`] record saying what was found and done,
//! so it is settled once; callers print the returned [`Settled`] list. A process left to resume
//! by a caller without a watcher gets none: it stays in flight for the next guard or agent start.
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

/// Why a caller without a watcher (a stop) leaves a suspension to resume as it is. Not journaled
/// as settled: it stays in flight for the next guard or agent start.
const UNTIL_WATCHED: &str = "its context is suspended (safe); the next start of the agent or guard resumes it under watch, `cryo stop` ends it";

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
        // The restore undoing it names its own writer (a guard that settled it, say).
        let restorer = f.restore_started.as_ref().and_then(|r| match r.event {
            Event::RestoreStarted { unlock_by, .. } => unlock_by,
            _ => None,
        });
        if [f.by, restorer]
            .into_iter()
            .flatten()
            .any(|by| Some(by) == mine || by.is_alive_same())
        {
            // Its owner, or the writer of the restore undoing it, is at work on it right now.
            continue;
        }
        let Ok(h) = pid.open() else {
            continue;
        };
        let restoring = f.restore_started.is_some();
        let (found, action) = settle_one(gpu, journal, &h, f.purpose, restoring, watcher)?;
        if matches!(&action, Settlement::Left { why } if why == UNTIL_WATCHED) {
            // Said, not settled: journaled as settled, no guard would ever resume it.
            out.push(Settled {
                pid,
                purpose: f.purpose,
                found,
                action,
            });
            continue;
        }
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
    restoring: bool,
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
        // Its context may be restored and live: unlocked only by a thaw's or wake's recovery
        // under watch ([`crate::restore::finish_unlock`]), never here.
        ProcessState::Locked if restoring => left(
            &found,
            "a restore undoing its suspension began and is not journaled as done: its context may be live; `cryo stop` ends it safely".into(),
        ),
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
        // A restore undoing the suspension was under way: its writer meant it to serve again.
        ProcessState::Checkpointed if restoring => resume(gpu, journal, h, found, watcher),
        ProcessState::Checkpointed => match purpose {
            Some(Purpose::Stop) | Some(Purpose::Guard) => finish_stop(gpu, journal, h, found),
            Some(Purpose::Freeze) | Some(Purpose::Park) => resume(gpu, journal, h, found, watcher),
            Some(Purpose::Other) | None => left(
                &found,
                "the journal does not say what it was suspended for; `cryo stop` ends it, `cryo gpu restore` and `cryo gpu unlock` bring it back".into(),
            ),
        },
        ProcessState::Failed => left(&found, "the driver reports it FAILED".into()),
    }
}

/// A CHECKPOINTED process restored, traced by `watcher` and unlocked in place; left suspended
/// (safe) without a watcher.
fn resume(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    found: String,
    watcher: Option<&dyn Watcher>,
) -> Result<(String, Settlement), SettleError> {
    let Some(watcher) = watcher else {
        return Ok((
            found,
            Settlement::Left {
                why: UNTIL_WATCHED.into(),
            },
        ));
    };
    match crate::restore::resume_in_place(
        gpu,
        journal,
        h,
        "resumed in place after a freeze that did not finish",
        watcher,
    ) {
        Ok(()) => Ok((found, Settlement::Resumed)),
        Err(e) => Ok((
            found,
            Settlement::Left {
                why: format!("cannot resume it: {e}"),
            },
        )),
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

    /// A process that has exited: this test's own child, reaped.
    fn gone() -> ProcId {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let id = ProcId::of(child.id() as i32).unwrap();
        child.wait().unwrap();
        id
    }

    /// `n` live processes of the fake driver (and their identities), and an empty journal.
    fn scene(n: usize) -> (Procs, Vec<ProcId>, FakeGpu, tempfile::TempDir, Journal) {
        let procs = Procs::spawn(n);
        let ids = procs
            .pids()
            .iter()
            .map(|p| ProcId::of(*p).unwrap())
            .collect();
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        (procs, ids, FakeGpu::new(), dir, journal)
    }

    /// What `settled` says was done to `id`.
    fn action_of(settled: &[Settled], id: ProcId) -> Option<Settlement> {
        settled
            .iter()
            .find(|s| s.pid == id)
            .map(|s| s.action.clone())
    }

    /// A suspension of `pid` for `purpose` that went as far as `state` and whose owner is gone.
    fn died_at(journal: &Journal, pid: ProcId, purpose: Purpose, state: ProcessState) {
        let by = gone();
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
        let (procs, ids, fake, _dir, journal) = scene(4);
        let p = procs.pids();
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
        let action = |i: usize| action_of(&settled, ids[i]);
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

    /// A park's undo whose restore intent is journaled and its completion not (the journal
    /// refused it: the undo checkpointed the worker again): still in flight. Its writer alive:
    /// left alone. Gone: CHECKPOINTED is resumed under watch, and left suspended by a caller
    /// without a watcher (a stop) *and still in flight* for the next guard's start (before, a
    /// stop journaled it settled: the guard after it found nothing to resume, this test failed
    /// with `None` for `Resumed`); LOCKED (a context perhaps restored and live) is left as it
    /// is, never unlocked. Each settled once.
    #[test]
    fn an_undo_whose_restore_is_not_journaled_as_done_is_resumed_only_once_its_writer_is_gone() {
        let (procs, ids, fake, dir, journal) = scene(4);
        let p = procs.pids();
        let dead = gone();
        // 0: writer alive (process 3); 1: writer gone, CHECKPOINTED; 2: writer gone, LOCKED.
        for (i, (writer, state)) in [
            (ids[3], ProcessState::Checkpointed),
            (dead, ProcessState::Checkpointed),
            (dead, ProcessState::Locked),
        ]
        .into_iter()
        .enumerate()
        {
            fake.add(p[i]).set_state(p[i], state);
            died_at(&journal, ids[i], Purpose::Park, ProcessState::Checkpointed);
            journal
                .append(Event::RestoreStarted {
                    pid: ids[i],
                    image: "resumed in place: its park could not be recorded".into(),
                    unlock_by: Some(writer),
                })
                .unwrap();
        }
        let flying =
            cryo_journal::in_flight_stops(&cryo_journal::read(dir.path()).unwrap().records);
        assert_eq!(flying.len(), 3, "{flying:?}");

        // A stop (no watcher) resumes nothing and unlocks nothing.
        let settled = settle_in_flight(&fake.gpu(), &journal, None).unwrap();
        assert!(settled.iter().all(|s| s.pid != ids[0]), "{settled:?}");
        assert!(
            settled
                .iter()
                .all(|s| matches!(s.action, Settlement::Left { .. })),
            "{settled:?}"
        );
        let why = |i: usize| match action_of(&settled, ids[i]) {
            Some(Settlement::Left { why }) => why,
            other => panic!("{other:?}"),
        };
        assert!(why(1).contains("resumes it under watch"), "{settled:?}");
        assert!(why(2).contains("may be live"), "{settled:?}");
        assert_eq!(fake.state_of(p[1]), ProcessState::Checkpointed);
        assert_eq!(fake.state_of(p[2]), ProcessState::Locked);

        // A guard's start after it: what the stop left suspended is resumed under watch.
        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        let action = |i: usize| action_of(&settled, ids[i]);
        assert_eq!(action(0), None, "a live writer's restore was touched");
        assert_eq!(action(1), Some(Settlement::Resumed), "{settled:?}");
        assert_eq!(action(2), None, "settled twice: {settled:?}");
        assert_eq!(fake.state_of(p[0]), ProcessState::Checkpointed);
        assert_eq!(fake.state_of(p[1]), ProcessState::Running);
        assert_eq!(fake.state_of(p[2]), ProcessState::Locked);
        assert!(p[..3].iter().all(|p| procs::alive(*p)));
        assert!(fake.wedges().is_empty(), "{:?}", fake.wedges());
        // Settled once.
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
