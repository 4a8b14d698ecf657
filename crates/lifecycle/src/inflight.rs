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
//! serve again). LOCKED there means the driver restored it and its writer died before the
//! completion's record, or could not checkpoint it again after a refused one; its context is
//! perhaps restored and live, and nothing in the journal says the restore went through. The
//! state's word is not taken for that: on r580 what `GetState` answers while a restore whose
//! caller died is still under way is not measured (newer drivers say RESTORING, which
//! [`crate::cuda::settled_state`] waits out). So a caller with a watcher checkpoints it again
//! first (LOCKED -> CHECKPOINTED, the driver's word that its context is whole: the call a
//! refused completion and a stop make), journals that, and resumes it as any CHECKPOINTED one,
//! through a restore of its own whose completion is journaled, traced before the unlock; a
//! checkpoint the driver refuses leaves it LOCKED and named, never unlocked. It is never
//! unlocked on the state alone, and never without the watch.
//!
//! That new checkpoint is a suspension of its own ([`Purpose::Recheck`], journaled before the
//! driver is asked: [`crate::restore::checkpoint_again`]), whoever makes it (this settlement,
//! a guard or agent finishing a dead thaw's or wake's unlock, a wake): one whose caller died
//! before its restore is resumed like a freeze's (CHECKPOINTED: restored; LOCKED: checkpointed
//! again first, never unlocked on the state's word).
//!
//! Every settlement of a process takes its lock ([`crate::oplock`], as a settlement's,
//! [`crate::Op::Settle`], whatever it would do: a refusal meeting it says "being settled")
//! before its last look, and holds it until it is done; then
//! it reads the journal again and settles the process only if it is still in flight, its owner
//! gone. A dead park's or freeze's CHECKPOINTED worker (a parked worker parked or frozen again,
//! whose `Parked` record still stands) was resumed by a guard or agent start while a `cryo wake`
//! of it had read it CHECKPOINTED and not yet restored it: two restorers of one process, the
//! wake then failing on the driver's refusal of a second restore. Now one finding the lock held
//! leaves the process to its holder, untouched and named ([`Settlement::Busy`]), and does not
//! journal it as settled: the holder's own records say what became of it, and what a holder
//! leaves in flight (a wake refused for want of a park record) is looked at again by the next
//! start. A stop's own settlement does not take again a lock the stop holds.
//!
//! A park's suspension of a worker parked already (its `Parked` record from before standing,
//! the process CHECKPOINTED) is settled as still parked ([`Settlement::StillParked`]), never
//! resumed: that park found it CHECKPOINTED and did nothing to it, and whether it died before
//! its record or its journal refused the record (EIO), its user asked for the worker parked,
//! twice. Before, a guard or agent start restored and unlocked it: it woke a worker the user
//! had parked. A first park's (no record standing) is resumed in place as before.
//!
//! Each settled process gets an [`Event::SuspensionSettled`] record saying what was found and done,
//! so it is settled once; callers print the returned [`Settled`] list. A process a caller without
//! a watcher (a stop) leaves to resume ([`Settlement::UntilWatched`]) gets none: it stays in
//! flight for the next guard or agent start.
//!
//! Before the suspensions, the CPU sets a dump that died left pinned are given back
//! ([`crate::cpus`]; each such dump closed with an [`Event::CpusReturned`]). After them, a caller
//! with a watcher (a guard or agent start) ends the trees a failed thaw left CHECKPOINTED with
//! nothing to end them ([`crate::leftover`], [`Settlement::ThawEnded`]).

use std::time::Duration;

use cryo_gpu::{Gpu, ProcessState};
use cryo_journal::{Event, Journal, ProcId, Purpose};
use cryo_proc::ProcHandle;

use crate::restore::AgainError;
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
    /// It was CHECKPOINTED, parked already (its `Parked` record from before standing), by a park
    /// of it again that did not finish or could not record it again (a journal's EIO): that
    /// park did nothing to it, and its user asked for it parked twice. Left parked; journaled as
    /// settled, so no later start resumes it (`cryo wake` does).
    StillParked,
    /// It was LOCKED after a restore undoing its suspension that is not journaled as done:
    /// checkpointed again (the driver's word that its context is whole), then restored and
    /// unlocked in place under watch.
    ResumedAfterCheckpoint,
    /// Its suspension is to be undone under watch and the caller has no watcher (a stop): left
    /// as it is (CHECKPOINTED or LOCKED: it runs no GPU work, its context is never torn down)
    /// and *not* journaled as settled, so the next guard or agent start resumes it.
    UntilWatched,
    /// CHECKPOINTED by a thaw that failed (on a full disk, whose removal could not journal its
    /// stop) or died before its restore, the thaw gone, nothing ending it: the tree that thaw
    /// restored (`tree`, root first) was ended through the thaw's own removal (see
    /// [`crate::leftover`]); the image thaws again.
    ThawEnded {
        /// The processes ended.
        tree: Vec<cryo_proc::Pid>,
    },
    /// Its main thread was left pinned to one CPU by a dump that did not finish (see
    /// [`crate::cpus`]): its own CPU set is back.
    CpusReturned,
    /// Left as it is, for the reason given.
    Left {
        /// Why.
        why: String,
    },
    /// Another operation (a park, a wake, a stop, a freeze, another settlement) holds its lock
    /// ([`crate::oplock`]): it is alive and at work on it, and decides what it becomes; nothing
    /// was asked of the driver. *Not* journaled as settled: what that operation leaves (a wake
    /// that refuses a process it finds no park record of does nothing to it) is still in
    /// flight, and the next stop, guard or agent start looks at it again.
    Busy {
        /// Who holds it.
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
            Settlement::StillParked => write!(
                f,
                "pid {pid}: {what} left it {}; it was parked already (its park record stands): left parked, `cryo wake` brings it back",
                self.found
            ),
            Settlement::ResumedAfterCheckpoint => write!(
                f,
                "pid {pid}: {what} left it {}, its restore not journaled as done; checkpointed again (the driver's word that its context is whole), then restored and unlocked in place under watch",
                self.found
            ),
            Settlement::UntilWatched => write!(
                f,
                "pid {pid}: {what} left it {}; left as it is (it runs no GPU work, its context is never torn down): the next start of the agent or guard resumes it under watch, `cryo stop` ends it safely",
                self.found
            ),
            Settlement::CpusReturned => {
                write!(f, "pid {pid}: {}; its own CPU set given back", self.found)
            }
            Settlement::ThawEnded { tree } => write!(
                f,
                "pid {pid}: a thaw that failed or died left it {} (its restore not journaled as done, the thaw gone); the tree it restored was ended safely (pids {}): the image thaws again",
                self.found,
                crate::thaw::fmt_pids(tree)
            ),
            Settlement::Left { why } => write!(
                f,
                "pid {pid}: {what} left it {}; left as it is: {why}",
                self.found
            ),
            Settlement::Busy { why } => write!(
                f,
                "pid {pid}: {what}, and {why}: left to it, untouched (still in flight: the next start of the agent or guard looks at it again)"
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
    settle_in_flight_holding(gpu, journal, watcher, None)
}

/// [`settle_in_flight`] by an operation that holds `held` (a stop's locks): every process it
/// settles it locks first ([`crate::oplock`]) unless `held` has it already, and it leaves alone
/// (untouched, still in flight) a process whose lock another operation holds.
pub(crate) fn settle_in_flight_holding(
    gpu: &Gpu,
    journal: &Journal,
    watcher: Option<&dyn Watcher>,
    held: Option<&crate::oplock::OpLocks>,
) -> Result<Vec<Settled>, SettleError> {
    let gpu = &gpu.bounded(cryo_gpu::Limits::default());
    let records = cryo_journal::read(journal.dir())?.records;
    let mine = me();
    // First the CPU sets a dead dump left pinned: a worker resumed below runs on all of them.
    let mut out = crate::cpus::give_back_dead(journal, &records)?;
    for (pid, f) in cryo_journal::in_flight_stops(&records) {
        if !pid.is_alive_same() || owner_at_work(&f, mine) {
            continue;
        }
        let Ok(h) = pid.open() else {
            continue;
        };
        // Its lock first, before the last look (see the module docs): a park, wake, stop or
        // freeze at work on it (or another settlement) is alive and decides what it becomes.
        let _lock = match lock(journal, &h, held) {
            Ok(l) => l,
            Err(why) => {
                out.push(Settled {
                    pid,
                    purpose: f.purpose,
                    found: "in use".into(),
                    action: Settlement::Busy { why },
                });
                continue;
            }
        };
        // Read again under the lock: what the lock's last holder did (a wake that restored it, a
        // park that parked it again) is in the journal now, and only that journal says whether
        // it is still in flight, and whose.
        let fresh = cryo_journal::read(journal.dir())?.records;
        let Some(f) = cryo_journal::in_flight_stops(&fresh).remove(&pid) else {
            continue;
        };
        if owner_at_work(&f, mine) {
            continue;
        }
        let restoring = f.restore_started.is_some();
        let parked = crate::park::parked_records(&fresh).contains_key(&pid);
        let (found, action) = settle_one(
            gpu,
            journal,
            &h,
            Suspension {
                purpose: f.purpose,
                restoring,
                parked,
            },
            watcher,
        )?;
        if let Some(done) = journaled(&action) {
            journal.append(Event::SuspensionSettled {
                pid,
                found: found.clone(),
                action: done,
            })?;
        }
        out.push(Settled {
            pid,
            purpose: f.purpose,
            found,
            action,
        });
    }
    // A thaw's tree left CHECKPOINTED with nothing to end it: a guard or agent start only (a
    // stop of one worker does not end another's tree unasked).
    if watcher.is_some() {
        out.extend(crate::leftover::end_left_thaws(gpu, journal, &records)?);
    }
    Ok(out)
}

/// Whether the owner of in-flight suspension `f`, or the writer of the restore undoing it (a
/// guard that settled it, say), is this process or alive: at work on it right now.
fn owner_at_work(f: &cryo_journal::InFlight, mine: Option<ProcId>) -> bool {
    let restorer = f.restore_started.as_ref().and_then(|r| match r.event {
        Event::RestoreStarted { unlock_by, .. } => unlock_by,
        _ => None,
    });
    [f.by, restorer]
        .into_iter()
        .flatten()
        .any(|by| Some(by) == mine || by.is_alive_same())
}

/// The lock ([`crate::oplock`]) of `h`, whose suspension a settlement is about to look at, taken
/// as a settlement's ([`crate::Op::Settle`]: whatever it would do, resume, kill or unlock, so
/// that the refusal of an operation meeting it names a settlement, not a wake or a stop nobody
/// ran); `None` when `held` (the settling stop's own) has it already. Held by another: why,
/// named.
fn lock(
    journal: &Journal,
    h: &ProcHandle,
    held: Option<&crate::oplock::OpLocks>,
) -> Result<Option<crate::oplock::OpLocks>, String> {
    if held.is_some_and(|l| l.holds(&id(h))) {
        return Ok(None);
    }
    match crate::oplock::take(
        &crate::oplock::state_of(journal),
        std::slice::from_ref(h),
        crate::Op::Settle,
    ) {
        Ok(l) => Ok(Some(l)),
        Err(crate::oplock::LockError::Held { by, doing, .. }) => Err(format!(
            "it is being {} by {}",
            crate::park::fmt_doing(doing),
            crate::park::fmt_by(by)
        )),
        Err(e) => Err(format!("its lock cannot be taken: {e}")),
    }
}

/// What a settlement's [`Event::SuspensionSettled`] record says was done; `None` for one that
/// is said and not journaled (it stays in flight: journaled as settled, no guard would ever
/// resume it).
fn journaled(action: &Settlement) -> Option<String> {
    Some(match action {
        Settlement::UntilWatched | Settlement::Busy { .. } => return None,
        Settlement::Nothing => "nothing".to_string(),
        Settlement::Unlocked => "unlocked".to_string(),
        Settlement::Killed => "killed".to_string(),
        Settlement::Resumed => "resumed".to_string(),
        Settlement::StillParked => "left parked: its park record stands".to_string(),
        Settlement::ResumedAfterCheckpoint => "checkpointed again, then resumed".to_string(),
        Settlement::CpusReturned => "its CPU set given back".to_string(),
        Settlement::ThawEnded { .. } => crate::leftover::ENDED.to_string(),
        Settlement::Left { why } => format!("left as it is: {why}"),
    })
}

/// What the journal says of a suspension a settlement is about to settle.
#[derive(Debug, Clone, Copy)]
struct Suspension {
    /// What it was for.
    purpose: Option<Purpose>,
    /// A restore undoing it was under way.
    restoring: bool,
    /// The process's `Parked` record (from a park before it) stands.
    parked: bool,
}

#[allow(clippy::too_many_arguments)]
fn settle_one(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    Suspension {
        purpose,
        restoring,
        parked,
    }: Suspension,
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
        // Its context may be restored and live, or not whole: never unlocked on the state's
        // word (see the module docs). A re-checkpoint that died before its checkpoint left it
        // so too: its restore was never journaled as done.
        ProcessState::Locked if restoring || purpose == Some(Purpose::Recheck) => match watcher {
            Some(watcher) => checkpoint_then_resume(gpu, journal, h, found, watcher),
            None => Ok((found, Settlement::UntilWatched)),
        },
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
            // A park of a parked worker (its record from before standing, nothing after it):
            // that park found it CHECKPOINTED and did nothing to it, and whether it died or its
            // journal refused its record, the worker stays as parked as its user asked. Before,
            // this resumed it: a guard or agent start woke a worker the user had parked.
            Some(Purpose::Park) if parked => Ok((found, Settlement::StillParked)),
            // A re-checkpoint's caller meant to restore it next, under watch.
            Some(Purpose::Freeze) | Some(Purpose::Park) | Some(Purpose::Recheck) => {
                resume(gpu, journal, h, found, watcher)
            }
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
        return Ok((found, Settlement::UntilWatched));
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

/// A LOCKED process whose restore (undoing its suspension) is not journaled as done, its writer
/// gone: checkpointed again (LOCKED -> CHECKPOINTED: the driver copies out only a whole
/// context), journaled, then [`resume`]d under `watcher` through a restore of its own. A
/// checkpoint the driver refuses leaves it LOCKED and named, never unlocked.
fn checkpoint_then_resume(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    found: String,
    watcher: &dyn Watcher,
) -> Result<(String, Settlement), SettleError> {
    match crate::restore::checkpoint_again(gpu, journal, h) {
        Ok(()) => {}
        Err(AgainError::Driver(e)) => {
            return Ok((
                found,
                Settlement::Left {
                    why: format!("its restore began and is not journaled as done, and {}: its context may be live, so it is left LOCKED, never unlocked; `cryo stop` ends it safely", AgainError::Driver(e)),
                },
            ))
        }
        // Not touched (its intent refused), or suspended again unrecorded: either way it is in
        // flight, and the next start finds it LOCKED or CHECKPOINTED and resumes it.
        Err(AgainError::Intent(e) | AgainError::Journal(e)) => return Err(e.into()),
    }
    match resume(gpu, journal, h, found, Some(watcher))? {
        (found, Settlement::Resumed) => Ok((found, Settlement::ResumedAfterCheckpoint)),
        other => Ok(other),
    }
}

/// The kill a stop did not get to, after the same last look a stop takes (under the process's
/// lock, taken before the look: a wake after it meets this one).
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
    use cryo_proc::Pid;
    use cryo_testkit::fake::{Call, FakeGpu};
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
    /// refused it, or its writer died after the driver's restore). Its writer alive: left alone.
    /// Gone: a caller without a watcher (a stop) resumes and unlocks nothing and journals
    /// nothing, so both stay in flight (before, a stop journaled it settled: the guard after it
    /// found nothing to resume, this test failed with `None` for `Resumed`; and LOCKED was
    /// journaled "left as it is" by the stop, the guard never looked at it again). A guard's
    /// start then resumes CHECKPOINTED under watch, and LOCKED (a context perhaps restored and
    /// live, perhaps not whole: the state alone does not say) only after the driver checkpointed
    /// it again, through a restore of its own: never an unlock of what it found. A LOCKED one
    /// the driver will not checkpoint again stays LOCKED, named, never unlocked. Each settled
    /// once.
    #[test]
    fn an_undo_whose_restore_is_not_journaled_as_done_is_resumed_only_once_its_writer_is_gone() {
        let (procs, ids, fake, dir, journal) = scene(5);
        let p = procs.pids();
        let dead = gone();
        // 0: writer alive (process 4); 1: writer gone, CHECKPOINTED; 2: writer gone, LOCKED;
        // 3: writer gone, LOCKED, and the driver refuses its new checkpoint.
        for (i, (writer, state)) in [
            (ids[4], ProcessState::Checkpointed),
            (dead, ProcessState::Checkpointed),
            (dead, ProcessState::Locked),
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
        let flying = |dir: &std::path::Path| {
            cryo_journal::in_flight_stops(&cryo_journal::read(dir).unwrap().records)
        };
        assert_eq!(flying(dir.path()).len(), 4);

        // A stop (no watcher) resumes nothing, unlocks nothing, journals nothing.
        let settled = settle_in_flight(&fake.gpu(), &journal, None).unwrap();
        assert!(settled.iter().all(|s| s.pid != ids[0]), "{settled:?}");
        for id in &ids[1..4] {
            assert_eq!(
                action_of(&settled, *id),
                Some(Settlement::UntilWatched),
                "{settled:?}"
            );
        }
        assert_eq!(flying(dir.path()).len(), 4, "a stop closed what it left");
        assert_eq!(fake.state_of(p[1]), ProcessState::Checkpointed);
        assert_eq!(fake.state_of(p[2]), ProcessState::Locked);
        assert!(fake.calls().iter().all(|(_, c)| *c == Call::State));

        // A guard's start after it.
        fake.fail_next_on(p[3], Call::Checkpoint, cryo_gpu::CuResult::UNKNOWN);
        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        let action = |i: usize| action_of(&settled, ids[i]);
        assert_eq!(action(0), None, "a live writer's restore was touched");
        assert_eq!(action(1), Some(Settlement::Resumed), "{settled:?}");
        assert_eq!(
            action(2),
            Some(Settlement::ResumedAfterCheckpoint),
            "{settled:?}"
        );
        assert!(
            matches!(action(3), Some(Settlement::Left { why }) if why.contains("never unlocked")),
            "{settled:?}"
        );
        assert_eq!(fake.state_of(p[0]), ProcessState::Checkpointed);
        assert_eq!(fake.state_of(p[1]), ProcessState::Running);
        assert_eq!(fake.state_of(p[2]), ProcessState::Running);
        assert_eq!(fake.state_of(p[3]), ProcessState::Locked);
        assert_eq!(fake.count(p[3], Call::Unlock), 0, "unlocked unconfirmed");
        // LOCKED was unlocked only after the driver checkpointed it and restored it again.
        let order: Vec<Call> = fake
            .calls()
            .into_iter()
            .filter(|(pid, c)| *pid == p[2] && *c != Call::State)
            .map(|(_, c)| c)
            .collect();
        assert_eq!(
            order,
            [Call::Checkpoint, Call::Restore, Call::Unlock],
            "{order:?}"
        );
        assert!(p[..4].iter().all(|p| procs::alive(*p)));
        assert!(fake.wedges().is_empty(), "{:?}", fake.wedges());
        for s in &settled {
            assert!(s.to_string().contains(&s.pid.pid.to_string()), "{s}");
        }
        // Settled once.
        assert_eq!(
            settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap(),
            Vec::new()
        );
    }

    /// A re-checkpoint (a guard, agent or wake checkpointing again a LOCKED process whose restore
    /// is not journaled as done, before restoring it itself: `restore::checkpoint_again`) whose
    /// caller died before its own restore's intent: before the driver's checkpoint (LOCKED, its
    /// context perhaps not whole) and after it (CHECKPOINTED). A stop leaves both until watched;
    /// a guard's start resumes both under watch, LOCKED only after a checkpoint of its own
    /// (never unlocked on the state's word), once each. (Before session 21 the re-checkpoint
    /// journaled only `Checkpointed`: no purpose, so CHECKPOINTED was "left as it is" for good.)
    #[test]
    fn a_recheckpoint_whose_caller_died_before_its_restore_is_resumed_under_watch() {
        let (procs, ids, fake, dir, journal) = scene(2);
        let p = procs.pids();
        let dead = gone();
        for (i, state) in [ProcessState::Locked, ProcessState::Checkpointed]
            .into_iter()
            .enumerate()
        {
            fake.add(p[i]).set_state(p[i], state);
            journal
                .append(Event::RestoreStarted {
                    pid: ids[i],
                    image: "/img/a".into(),
                    unlock_by: Some(dead),
                })
                .unwrap();
            journal
                .append(Event::SuspendStarted {
                    pid: ids[i],
                    purpose: Purpose::Recheck,
                    by: Some(dead),
                })
                .unwrap();
            journal
                .append(Event::CheckpointStarted { pid: ids[i] })
                .unwrap();
            if state == ProcessState::Checkpointed {
                journal
                    .append(Event::Checkpointed {
                        pid: ids[i],
                        ms: 1,
                        bytes: 0,
                    })
                    .unwrap();
            }
        }
        let settled = settle_in_flight(&fake.gpu(), &journal, None).unwrap();
        for id in &ids {
            assert_eq!(
                action_of(&settled, *id),
                Some(Settlement::UntilWatched),
                "{settled:?}"
            );
        }
        assert!(fake.calls().iter().all(|(_, c)| *c == Call::State));

        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        assert_eq!(
            action_of(&settled, ids[0]),
            Some(Settlement::ResumedAfterCheckpoint),
            "{settled:?}"
        );
        assert_eq!(
            action_of(&settled, ids[1]),
            Some(Settlement::Resumed),
            "{settled:?}"
        );
        let order = |pid: Pid| -> Vec<Call> {
            fake.calls()
                .into_iter()
                .filter(|(q, c)| *q == pid && *c != Call::State)
                .map(|(_, c)| c)
                .collect()
        };
        assert_eq!(order(p[0]), [Call::Checkpoint, Call::Restore, Call::Unlock]);
        assert_eq!(order(p[1]), [Call::Restore, Call::Unlock]);
        assert!(p.iter().all(|p| fake.state_of(*p) == ProcessState::Running));
        assert!(fake.wedges().is_empty(), "{:?}", fake.wedges());
        for s in &settled {
            assert!(s.to_string().contains("re-checkpoint"), "{s}");
        }
        assert_eq!(
            settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap(),
            Vec::new()
        );
        let records = cryo_journal::read(dir.path()).unwrap().records;
        assert!(cryo_journal::in_flight_stops(&records).is_empty());
    }

    /// A settlement the caller only says ([`Settlement::UntilWatched`]) is never journaled as
    /// settled, and every other one is, whatever its words: the decision is the variant's, not a
    /// message's (before, `why == UNTIL_WATCHED` decided it, so rewording one of the two
    /// messages would have journaled "said" as settled: no guard would have resumed it). Each
    /// way a caller without a watcher can leave a suspension to resume reaches the variant.
    #[test]
    fn only_what_is_left_until_watched_stays_in_flight() {
        for action in [
            Settlement::Nothing,
            Settlement::Unlocked,
            Settlement::Killed,
            Settlement::Resumed,
            Settlement::ResumedAfterCheckpoint,
            Settlement::ThawEnded { tree: vec![1] },
            Settlement::CpusReturned,
            Settlement::Left {
                why: "the next start of the agent or guard resumes it under watch".into(),
            },
        ] {
            assert!(journaled(&action).is_some(), "{action:?}");
        }
        assert_eq!(journaled(&Settlement::UntilWatched), None);

        // Checkpointed by a freeze, by a park, and an undo's restore left CHECKPOINTED and
        // LOCKED: a stop leaves all four until watched, says why, and the journal keeps them in
        // flight.
        let (procs, ids, fake, dir, journal) = scene(4);
        let p = procs.pids();
        let dead = gone();
        for (i, (purpose, state, undo)) in [
            (Purpose::Freeze, ProcessState::Checkpointed, false),
            (Purpose::Park, ProcessState::Checkpointed, false),
            (Purpose::Park, ProcessState::Checkpointed, true),
            (Purpose::Freeze, ProcessState::Locked, true),
        ]
        .into_iter()
        .enumerate()
        {
            fake.add(p[i]).set_state(p[i], state);
            died_at(&journal, ids[i], purpose, ProcessState::Checkpointed);
            if undo {
                journal
                    .append(Event::RestoreStarted {
                        pid: ids[i],
                        image: "resumed in place".into(),
                        unlock_by: Some(dead),
                    })
                    .unwrap();
            }
        }
        let settled = settle_in_flight(&fake.gpu(), &journal, None).unwrap();
        assert_eq!(settled.len(), 4, "{settled:?}");
        for s in &settled {
            assert_eq!(s.action, Settlement::UntilWatched, "{s}");
            let said = s.to_string();
            assert!(
                said.contains("resumes it under watch") && said.contains(&s.found),
                "{said}"
            );
        }
        let records = cryo_journal::read(dir.path()).unwrap().records;
        assert!(
            !records
                .iter()
                .any(|r| matches!(r.event, Event::SuspensionSettled { .. })),
            "{records:?}"
        );
        assert_eq!(cryo_journal::in_flight_stops(&records).len(), 4);
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

    /// A dead stop's CHECKPOINTED process whose lock a wake holds (the wake restores what it
    /// finds CHECKPOINTED), and a dead park's and a dead freeze's whose lock a wake holds (a
    /// guard or agent start would resume them: two restorers of one process), are left to the
    /// wake, named, untouched (not even asked their state), never killed nor restored, and not
    /// journaled as settled (what the wake leaves is looked at again). A stop that holds the
    /// lock itself finishes one without taking it again.
    #[test]
    fn a_dead_stop_s_process_a_wake_holds_is_left_to_the_wake() {
        let (procs, ids, fake, dir, journal) = scene(3);
        let p = procs.pids();
        let id = ids[0];
        for (i, purpose) in [Purpose::Stop, Purpose::Park, Purpose::Freeze]
            .into_iter()
            .enumerate()
        {
            fake.add(p[i]).set_state(p[i], ProcessState::Checkpointed);
            died_at(&journal, ids[i], purpose, ProcessState::Checkpointed);
        }
        let state = crate::oplock::state_of(&journal);
        let handles: Vec<ProcHandle> = p.iter().map(|p| ProcHandle::open(*p).unwrap()).collect();
        let wake = crate::oplock::take(&state, &handles, crate::Op::Wake).unwrap();
        for watcher in [None, Some(&crate::NoWatcher as &dyn Watcher)] {
            let settled = settle_in_flight(&fake.gpu(), &journal, watcher).unwrap();
            assert_eq!(settled.len(), 3, "{settled:?}");
            for s in &settled {
                assert!(
                    matches!(&s.action, Settlement::Busy { why } if why.contains("being woken by cryo pid")),
                    "{settled:?}"
                );
                assert!(s.to_string().contains("left to it, untouched"), "{s}");
            }
        }
        assert!(p.iter().all(|p| procs::alive(*p)), "killed under a wake");
        assert!(fake.calls().is_empty(), "{:?}", fake.calls());
        let records = cryo_journal::read(dir.path()).unwrap().records;
        assert_eq!(cryo_journal::in_flight_stops(&records).len(), 3);
        drop(wake);
        let h = ProcHandle::open(p[0]).unwrap();

        // The wake let go without touching them: still in flight. A stop holding the first's
        // lock finishes its kill without taking it twice (the two others it leaves until
        // watched); a guard's start then resumes the two others under its locks.
        let stop = crate::oplock::take(&state, std::slice::from_ref(&h), crate::Op::Stop).unwrap();
        let settled = settle_in_flight_holding(&fake.gpu(), &journal, None, Some(&stop)).unwrap();
        assert_eq!(
            action_of(&settled, id),
            Some(Settlement::Killed),
            "{settled:?}"
        );
        for id in &ids[1..] {
            assert_eq!(
                action_of(&settled, *id),
                Some(Settlement::UntilWatched),
                "{settled:?}"
            );
        }
        drop(stop);
        let settled = settle_in_flight(&fake.gpu(), &journal, Some(&crate::NoWatcher)).unwrap();
        for (id, p) in ids[1..].iter().zip(&p[1..]) {
            assert_eq!(
                action_of(&settled, *id),
                Some(Settlement::Resumed),
                "{settled:?}"
            );
            assert_eq!(fake.state_of(*p), ProcessState::Running);
        }
        assert!(fake.wedges().is_empty());
    }
}
