//! The driver restore of a process's CUDA context, journaled so that restored-ness is never lost:
//! thaw, `cryo gpu restore`, the `cuda-checkpoint` front end (`--action restore`, or a toggle out
//! of CHECKPOINTED), a freeze that resumes its worker in place, a suspension rolled back.
//!
//! # Design
//! [`restore_context`] is the one way cryo restores a context:
//! 1. [`Event::RestoreStarted`] is journaled *before* the driver is asked: from then on the
//!    process counts as restored (`Origins`), so a crash at any later point leaves it known as
//!    restored, guarded and suspended before it ends. If the journal cannot take the record,
//!    nothing is restored.
//! 2. The driver restores it (under a deadline); the process is LOCKED afterwards.
//! 3. [`Event::RestoreCompleted`] is journaled. If that write fails, the process is checkpointed
//!    again (LOCKED -> CHECKPOINTED) rather than left LOCKED with a record that says less than
//!    what happened: the caller gets [`RestoreError::NotRecorded`] saying whether that worked.
//!
//! A thaw journals the intents of its whole tree itself, at CRIU's gate, before the tree runs
//! (one synced write, see [`crate::thaw`]), then restores each CUDA process through
//! [`restore_after_intent`]: steps 2 and 3.
//!
//! Unlocking is the caller's step (an agent traces the process first). A thaw or wake names
//! itself in the intent as the one that unlocks next ([`Event::RestoreStarted`]'s `unlock_by`);
//! if it dies between the restore and the unlock, the restarted guard or agent finishes the
//! unlock ([`finish_unlock`]) once it traces the process again.
//!
//! [`record_restored`] only records a restore cryo did not carry out itself (CRIU's own cuda
//! plugin driving another tool, a benchmark's manual steps).

use std::time::{Duration, Instant};

use cryo_gpu::{DriverError, Gpu, GpuPair, GpuUuid};
use cryo_journal::{Event, Journal, ProcId};
use cryo_proc::{Pid, ProcHandle};
use cryo_state::StateDir;

use crate::suspend::{abandoned, id, me};

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): a journaled
/// restore (a thaw's, a wake's, a resume in place) pauses between the driver's restore (the
/// process is LOCKED, its context restored and live) and its `RestoreCompleted` record, so that
/// a test can fill the disk there.
pub const RESTORE_BEFORE_COMPLETED: &str = "restore-before-completed";

/// Where one process's contexts land on a restore: a wake's placement, a thaw's plan (per CUDA
/// process of the image).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Placement {
    /// The process.
    pub pid: Pid,
    /// Pairs for the driver's restore (a wake's: the GPUs that change; a thaw's: none, or one
    /// for every GPU it used when the map names any of them).
    pub pairs: Vec<GpuPair>,
    /// The GPUs it lands on.
    pub targets: Vec<GpuUuid>,
    /// Device memory, bytes.
    pub bytes: u64,
}

/// The restore did not happen, or happened and could not be recorded.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The intent could not be journaled: nothing was restored (the process is as it was).
    #[error("cannot journal the restore of pid {pid} before it, so it was not restored: {source}")]
    Journal {
        /// The process.
        pid: Pid,
        /// The journal's error.
        source: cryo_journal::AppendError,
    },
    /// The driver's restore failed (the process is journaled as restored anyway: what the driver
    /// did before failing is not known).
    #[error(transparent)]
    Driver(DriverError),
    /// The restore happened but its completion could not be journaled; the process was
    /// checkpointed again (`resuspended`: `None`), or that failed too and it is LOCKED.
    #[error("pid {pid} was restored but the journal could not record it ({source}); {}", match .resuspended { None => "it was checkpointed again".to_string(), Some(e) => format!("checkpointing it again failed too ({e}): it is LOCKED, with a live restored context; its restore intent is journaled") })]
    NotRecorded {
        /// The process.
        pid: Pid,
        /// The journal's error.
        source: cryo_journal::AppendError,
        /// Why the new checkpoint failed, if it did.
        resuspended: Option<DriverError>,
    },
    /// The context was restored in place but the guard could not trace the process before its
    /// unlock: it was not unlocked, and was checkpointed again (`resuspended`: `None`), or that
    /// failed too and it is LOCKED (it runs no GPU work; `cryo stop` ends it safely).
    #[error("pid {pid} was restored in place but the guard could not trace it before its unlock ({error}); {}", match .resuspended { None => "it was checkpointed again (safe)".to_string(), Some(e) => format!("checkpointing it again failed too ({e}): it stays LOCKED") })]
    Unguarded {
        /// The process.
        pid: Pid,
        /// The guard's error.
        error: String,
        /// Why the new checkpoint failed, if it did.
        resuspended: Option<DriverError>,
    },
}

impl RestoreError {
    /// The driver's error, when the driver refused the restore.
    pub fn driver(&self) -> Option<&DriverError> {
        match self {
            RestoreError::Driver(e) => Some(e),
            _ => None,
        }
    }
}

/// Restores `h`'s CUDA context (onto `pairs`), journaled as restored by `how` (an image path, or
/// the command): see the module docs. Returns how long the driver's restore took; the process is
/// LOCKED.
pub fn restore_context(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    pairs: &[GpuPair],
    how: &str,
) -> Result<Duration, RestoreError> {
    restore_journaled(gpu, journal, h, pairs, how, None)
}

/// [`restore_context`] for a caller (thaw, wake, resume in place) that unlocks it next: the
/// journal names this process as the one that will, so that a restarted guard finishes the
/// unlock if it dies first ([`finish_unlock`]).
pub(crate) fn restore_to_unlock(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    pairs: &[GpuPair],
    how: &str,
) -> Result<Duration, RestoreError> {
    restore_journaled(gpu, journal, h, pairs, how, crate::suspend::me())
}

fn restore_journaled(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    pairs: &[GpuPair],
    how: &str,
    unlock_by: Option<ProcId>,
) -> Result<Duration, RestoreError> {
    let pid = h.pid();
    journal
        .append(Event::RestoreStarted {
            pid: id(h),
            image: how.to_string(),
            unlock_by,
        })
        .map_err(|source| RestoreError::Journal { pid, source })?;
    restore_after_intent(gpu, journal, h, pairs, how)
}

/// The driver's restore of `h`'s context (onto `pairs`) and its [`Event::RestoreCompleted`]
/// (steps 2 and 3 of the module docs), for a caller that journaled its intent
/// ([`Event::RestoreStarted`], naming `how` and, when it unlocks next, itself) before: a thaw,
/// at CRIU's gate. Returns how long the driver's restore took; the process is LOCKED.
pub(crate) fn restore_after_intent(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    pairs: &[GpuPair],
    how: &str,
) -> Result<Duration, RestoreError> {
    let pid = h.pid();
    let start = Instant::now();
    if let Err(e) = gpu.driver.restore(pid, pairs) {
        abandoned(Some(journal), h, &e);
        return Err(RestoreError::Driver(e));
    }
    let took = start.elapsed();
    crate::failpoint::pause_if(crate::park::PARK_UNDO_DIES_RESTORED);
    crate::failpoint::pause_if(RESTORE_BEFORE_COMPLETED);
    let completed = if crate::failpoint::active(crate::park::PARK_UNDO_UNRECORDED) {
        Err(crate::failpoint::journal_eio(
            journal,
            crate::park::PARK_UNDO_UNRECORDED,
        ))
    } else {
        journal.append(Event::RestoreCompleted {
            pid: id(h),
            image: how.to_string(),
            ms: Some(u64::try_from(took.as_millis()).unwrap_or(u64::MAX)),
        })
    };
    if let Err(source) = completed {
        let resuspended = gpu.driver.checkpoint(pid).err();
        match &resuspended {
            None => {
                tracing::error!(pid, error = %source, "restored but not journaled: checkpointed again")
            }
            Some(e) => {
                tracing::error!(pid, error = %source, checkpoint = %e, "restored but not journaled, and it cannot be checkpointed again: it stays LOCKED")
            }
        }
        return Err(RestoreError::NotRecorded {
            pid,
            source,
            resuspended,
        });
    }
    Ok(took)
}

/// Restores and unlocks `h` in place (a suspension undone: a failed freeze, a rolled-back
/// suspension), journaled as restored, then [`Event::Unlocked`].
///
/// The process is traced by `watcher` (the guard) before its unlock, as after every restore
/// ([`crate::Watcher::guard_before_unlock`]); when it cannot be, it is checkpointed again instead
/// ([`RestoreError::Unguarded`]). A caller with no guard to ask passes [`crate::NoWatcher`].
pub fn resume_in_place(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
    how: &str,
    watcher: &dyn crate::Watcher,
) -> Result<(), RestoreError> {
    restore_to_unlock(gpu, journal, h, &[], how)?;
    if let Err(e) = watcher.guard_before_unlock(&[h]) {
        let t = Instant::now();
        let resuspended = gpu.driver.checkpoint(h.pid()).err();
        if resuspended.is_none() {
            // Suspended since its restore: its end is the safe kind (the guard reads this).
            let ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
            if let Err(j) = journal.append(Event::Checkpointed {
                pid: id(h),
                ms,
                bytes: 0,
            }) {
                tracing::error!(pid = h.pid(), error = %j, "cannot journal the new checkpoint");
            }
        }
        return Err(RestoreError::Unguarded {
            pid: h.pid(),
            error: e.to_string(),
            resuspended,
        });
    }
    let start = Instant::now();
    gpu.driver.unlock(h.pid()).map_err(|e| {
        abandoned(Some(journal), h, &e);
        RestoreError::Driver(e)
    })?;
    // The process runs again: a journal that cannot take the record must not undo that.
    if let Err(e) = journal.append(Event::Unlocked {
        pid: id(h),
        ms: Some(u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)),
        recovery: false,
    }) {
        tracing::error!(pid = h.pid(), error = %e, "cannot journal the unlock");
    }
    Ok(())
}

/// What an undo that resumes processes in place (a park or a freeze that cannot record its
/// suspension) says of the processes it could not bring back (`left`: each pid and why): what
/// happens to them next. Each is CHECKPOINTED or LOCKED with its suspension (or its completed
/// restore) in the journal, so the next guard or agent start settles it under watch
/// ([`crate::settle_in_flight`], [`finish_unlock`]).
pub(crate) fn fmt_left(left: &[(Pid, String)]) -> String {
    if left.is_empty() {
        return "every process it suspended was resumed in place: the worker serves again".into();
    }
    let left: Vec<String> = left
        .iter()
        .map(|(pid, why)| format!("pid {pid}: {why}"))
        .collect();
    format!(
        "not every process could be resumed: those stay suspended (CHECKPOINTED, or LOCKED: they run no GPU work), their device memory in their host memory, never torn down, until the next start of the guard or agent, which resumes each under watch or names why it cannot; `cryo stop PID` ends one safely: {}",
        left.join("; ")
    )
}

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a stall, see `failpoint::stall_if`):
/// [`checkpoint_again`] stalls once the driver checkpointed the process again and the journal
/// says so, before its caller restores it (where a test kills the guard, agent or wake).
pub const CHECKPOINTED_AGAIN: &str = "checkpointed-again";

/// Why [`checkpoint_again`] did not leave a journaled CHECKPOINTED process.
#[derive(Debug, thiserror::Error)]
pub(crate) enum AgainError {
    /// Its intent could not be journaled: nothing was asked of the driver (the process is as
    /// it was).
    #[error("cannot journal the intent to checkpoint it again, so it was not ({0})")]
    Intent(cryo_journal::AppendError),
    /// The driver refused (or did not answer) the checkpoint: the process is as it was.
    #[error("it cannot be checkpointed again to confirm its context is whole ({0})")]
    Driver(DriverError),
    /// Checkpointed (suspended, safe), and the journal cannot say so.
    #[error("it was checkpointed again and the journal cannot say so ({0})")]
    Journal(cryo_journal::AppendError),
}

/// Checkpoints LOCKED `h` again and journals it ([`Event::Checkpointed`]): for a process whose
/// restore is not journaled as done and whose writer is gone. The driver's LOCKED alone does not
/// say that restore went through (on r580 what `GetState` answers while a restore whose caller
/// died is under way is not measured); a checkpoint, which the driver carries out only for a
/// whole context (LOCKED -> CHECKPOINTED, the safe direction: the call a refused completion and a
/// stop make), does. The caller then restores it itself, through [`restore_to_unlock`].
///
/// Its intent is journaled first, as a suspension of its own ([`Event::SuspendStarted`] for
/// [`Purpose::Recheck`](cryo_journal::Purpose::Recheck) by this process, then
/// [`Event::CheckpointStarted`]): a caller that dies anywhere between here and its own
/// `RestoreStarted` leaves it in flight, and the next guard or agent start resumes it under
/// watch ([`crate::settle_in_flight`]). Before, only `Checkpointed` was journaled: the journal
/// did not say what that suspension was for, and the next start left the process CHECKPOINTED
/// for good.
pub(crate) fn checkpoint_again(
    gpu: &Gpu,
    journal: &Journal,
    h: &ProcHandle,
) -> Result<(), AgainError> {
    journal
        .append_all(vec![
            Event::SuspendStarted {
                pid: id(h),
                purpose: cryo_journal::Purpose::Recheck,
                by: me(),
            },
            Event::CheckpointStarted { pid: id(h) },
        ])
        .map_err(AgainError::Intent)?;
    let start = Instant::now();
    gpu.driver.checkpoint(h.pid()).map_err(|e| {
        abandoned(Some(journal), h, &e);
        AgainError::Driver(e)
    })?;
    journal
        .append(Event::Checkpointed {
            pid: id(h),
            ms: u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX),
            bytes: 0,
        })
        .map_err(AgainError::Journal)?;
    crate::failpoint::stall_if(CHECKPOINTED_AGAIN);
    Ok(())
}

/// What [`finish_unlock`] did with a re-attached process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishUnlock {
    /// The thaw or wake that restored it died before the unlock: unlocked, journaled as a
    /// recovery ([`Event::Unlocked`] with `recovery`); it serves again.
    Unlocked,
    /// Left as it is, for the reason given.
    Left(String),
}

/// The journal could not be read or written: nothing was unlocked.
#[derive(Debug, thiserror::Error)]
pub enum FinishUnlockError {
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    Read(#[from] cryo_journal::ReadError),
}

/// Finishes the unlock of `pid`, which the caller (a restarted guard or agent) traces now, when
/// the journal and the driver both say a thaw or wake restored it and died before unlocking it:
/// its last lifecycle record is that restore (intent with `unlock_by`, then
/// [`Event::RestoreCompleted`]; guard attachments and losses aside), `unlock_by` is gone, `pid` is the same
/// process (pid and start time), and the driver answers LOCKED. When the intent is its last
/// record (the thaw or wake died between the driver's restore and its completion's record), the
/// driver's LOCKED alone is not taken as a whole restored context: it is checkpointed again
/// ([`checkpoint_again`]) and restored by the caller, the completion journaled, before the
/// unlock; a checkpoint the driver refuses leaves it LOCKED. That new checkpoint is journaled as
/// a suspension of its own before the driver is asked, so a caller that dies before its restore
/// leaves it in flight for the next start, which resumes it under watch. Anything else is left
/// as it is. The unlock is journaled after it happened (it runs again; a failed write is only
/// logged). All of it under the process's lock ([`crate::oplock`], as a settlement,
/// [`crate::Op::Settle`]): one a wake holds
/// is left to that wake, which unlocks it itself.
pub fn finish_unlock(
    gpu: &Gpu,
    journal: &Journal,
    pid: ProcId,
) -> Result<FinishUnlock, FinishUnlockError> {
    let left = |why: &str| Ok(FinishUnlock::Left(why.to_string()));
    let Ok(h) = pid.open() else {
        return left("it is no longer the process the journal names");
    };
    // Its lock ([`crate::oplock`]), as a settlement's, before the journal and the driver are read: a
    // wake at work on it (it traces and unlocks what it finds LOCKED with its restore complete)
    // is left to it. Before, this unlocked it under such a wake, whose own unlock the driver
    // then refused (ILLEGAL_STATE), and the wake parked the worker again.
    let _lock = match crate::oplock::take(
        &crate::oplock::state_of(journal),
        std::slice::from_ref(&h),
        crate::Op::Settle,
    ) {
        Ok(l) => l,
        Err(crate::oplock::LockError::Held { by, doing, .. }) => {
            return left(&format!(
                "it is being {} by {}: left to it",
                crate::park::fmt_doing(doing),
                crate::park::fmt_by(by)
            ))
        }
        Err(e) => return left(&format!("its lock cannot be taken: {e}")),
    };
    let records = cryo_journal::read(journal.dir())?.records;
    let (by, completed) = match last_restore(&records, pid) {
        Some((Some(by), completed)) => (by, completed),
        Some((None, true)) => return left(
            "its restore leaves it LOCKED on purpose, or the journal does not say who unlocks it",
        ),
        Some((None, false)) => {
            return left("the journal does not say its restore completed, nor who unlocks it")
        }
        None => return left("its last journal record is not a thaw's or wake's restore"),
    };
    if Some(by) == me() || by.is_alive_same() {
        return left("the thaw or wake that restored it is still at work on it");
    }
    let gpu = gpu.bounded(cryo_gpu::Limits::default());
    match gpu.driver.state(h.pid()) {
        Ok(cryo_gpu::ProcessState::Locked) => {}
        Ok(s) => return left(&format!("the driver reports it {s}, not LOCKED")),
        Err(e) => return left(&format!("the driver cannot say its state: {e}")),
    }
    if !completed {
        if let Err(e) = checkpoint_again(&gpu, journal, &h) {
            return left(&format!(
                "its restore is not journaled as done, and {e}: never unlocked"
            ));
        }
        if let Err(e) = restore_to_unlock(&gpu, journal, &h, &[], RESTORED_AGAIN) {
            return left(&format!(
                "its restore was not journaled as done; checkpointed again, it cannot be restored: {e}"
            ));
        }
    }
    let start = Instant::now();
    if let Err(e) = gpu.driver.unlock(h.pid()) {
        abandoned(Some(journal), &h, &e);
        return left(&format!("cannot unlock it: {e}"));
    }
    if let Err(e) = journal.append(Event::Unlocked {
        pid: id(&h),
        ms: Some(u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)),
        recovery: true,
    }) {
        tracing::error!(pid = h.pid(), error = %e, "cannot journal the unlock");
    }
    Ok(FinishUnlock::Unlocked)
}

/// Whether `pid`'s last lifecycle step in `records` (guard attachments aside) is a restore
/// intent whose completion is not journaled: a restore under way (a thaw at CRIU's gate, before
/// its GPU restore), or one whose writer died before its completion.
pub fn restore_pending(records: &[cryo_journal::Record], pid: ProcId) -> bool {
    matches!(last_restore(records, pid), Some((_, false)))
}

/// A restore under way ([`restore_pending`]): what a guard or agent start that leaves the
/// process to it says (the image, and the cryo process that restores it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingRestore {
    /// The image (or what restores it) its intent names.
    pub image: String,
    /// The cryo process that is to unlock it (a thaw's), when the intent names one (a thaw
    /// names itself for its CUDA processes only).
    pub by: Option<ProcId>,
}

/// `pid`'s restore under way, if [`restore_pending`]: its intent's image and writer.
pub fn pending_restore(records: &[cryo_journal::Record], pid: ProcId) -> Option<PendingRestore> {
    if !restore_pending(records, pid) {
        return None;
    }
    records.iter().rev().find_map(|r| match &r.event {
        Event::RestoreStarted {
            pid: p,
            image,
            unlock_by,
        } if *p == pid => Some(PendingRestore {
            image: image.clone(),
            by: *unlock_by,
        }),
        _ => None,
    })
}

/// The restore that is `pid`'s last lifecycle step in `records` (guard attachments and losses
/// aside), if it is one: its intent's `unlock_by`, and whether its completion is journaled.
pub(crate) fn last_restore(
    records: &[cryo_journal::Record],
    pid: ProcId,
) -> Option<(Option<ProcId>, bool)> {
    let mut restore = None::<(Option<ProcId>, bool)>;
    for r in records.iter().filter(|r| r.event.pids().contains(&pid)) {
        restore = match &r.event {
            Event::RestoreStarted { unlock_by, .. } => Some((*unlock_by, false)),
            Event::RestoreCompleted { .. } => restore.map(|(by, _)| (by, true)),
            // The guard's bookkeeping (traced, or not traceable then: a guard that started
            // while CRIU held the tree at its gate), not a lifecycle step.
            Event::GuardAttached { .. } | Event::GuardLost { .. } => restore,
            _ => None,
        };
    }
    restore
}

/// How [`finish_unlock`] names the restore it makes of a process it checkpointed again.
const RESTORED_AGAIN: &str =
    "restored again by the guard: the thaw or wake that restored it died before recording it";

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

/// Journals that the process `handle` holds was restored by something other than cryo; `how`
/// names what did it. Returns the identity recorded. Restores cryo carries out itself go through
/// [`restore_context`], which journals the intent first.
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_gpu::ProcessState;
    use cryo_testkit::fake::{Call, FakeGpu};
    use cryo_testkit::procs::Procs;
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    use nix::sys::signal::{signal, SigHandler, Signal};

    fn restored(journal: &Journal, pid: Pid) -> bool {
        let records = cryo_journal::read(journal.dir()).unwrap().records;
        matches!(
            cryo_journal::Origins::from_records(&records).of(&ProcId::of(pid).unwrap()),
            cryo_journal::Origin::Restored { .. }
        )
    }

    /// A CHECKPOINTED process of the fake driver and an empty journal.
    fn scene() -> (Procs, FakeGpu, tempfile::TempDir, Journal) {
        let procs = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.add(procs.pid(0))
            .set_state(procs.pid(0), ProcessState::Checkpointed);
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        (procs, fake, dir, journal)
    }

    /// From now on the journal in `dir` cannot grow: a file-size limit at its size (this test's
    /// process only; the caller puts the limit back).
    fn journal_full(dir: &std::path::Path) {
        let size = std::fs::metadata(dir.join(cryo_journal::FILE_NAME))
            .unwrap()
            .len();
        let (_, hard) = getrlimit(Resource::RLIMIT_FSIZE).unwrap();
        // SAFETY: ignoring a signal installs no handler; nothing else in this test process
        // depends on SIGXFSZ.
        unsafe { signal(Signal::SIGXFSZ, SigHandler::SigIgn) }.unwrap();
        setrlimit(Resource::RLIMIT_FSIZE, size, hard).unwrap();
    }

    /// Issue 9 item 8: the intent is journaled before the driver restores (a crash during the
    /// restore leaves the process known as restored), and a completion the journal cannot take
    /// checkpoints the process again instead of leaving it LOCKED and unrecorded. The journal is
    /// made to fail with a file-size limit (nextest runs each test in a process of its own).
    #[test]
    fn the_intent_comes_first_and_an_unrecorded_restore_is_checkpointed_again() {
        let (procs, fake, dir, journal) = scene();
        let p = procs.pid(0);
        let h = ProcHandle::open(p).unwrap();
        let hang = fake.hang_next(p, Call::Restore);
        let gpu = fake.gpu();
        let before = getrlimit(Resource::RLIMIT_FSIZE).unwrap();
        let r = std::thread::scope(|s| {
            let t = s.spawn(|| restore_context(&gpu, &journal, &h, &[], "test restore"));
            hang.wait_reached();
            assert!(
                restored(&journal, p),
                "not journaled as restored before the driver restore"
            );
            journal_full(dir.path());
            hang.release();
            t.join().unwrap()
        });
        setrlimit(Resource::RLIMIT_FSIZE, before.0, before.1).unwrap();
        assert!(
            matches!(
                r,
                Err(RestoreError::NotRecorded {
                    resuspended: None,
                    ..
                })
            ),
            "{r:?}"
        );
        assert_eq!(fake.state_of(p), ProcessState::Checkpointed);
        assert!(restored(&journal, p));
    }

    /// No intent in the journal, no restore: the process stays as it was.
    #[test]
    fn no_record_no_restore() {
        let (procs, fake, dir, journal) = scene();
        let p = procs.pid(0);
        let h = ProcHandle::open(p).unwrap();
        let before = getrlimit(Resource::RLIMIT_FSIZE).unwrap();
        journal_full(dir.path());
        let r = restore_context(&fake.gpu(), &journal, &h, &[], "test restore");
        setrlimit(Resource::RLIMIT_FSIZE, before.0, before.1).unwrap();
        assert!(matches!(r, Err(RestoreError::Journal { .. })), "{r:?}");
        assert_eq!(fake.count(p, Call::Restore), 0);
        assert_eq!(fake.state_of(p), ProcessState::Checkpointed);
    }
    /// How far a restore of `pid` got in the journal before its owner `by` stopped.
    #[derive(Clone, Copy)]
    enum Story {
        /// `RestoreStarted` and `RestoreCompleted`, then the guard attached.
        Completed,
        /// Only `RestoreStarted`.
        StartedOnly,
        /// Completed, then unlocked (and locked again by something else).
        ThenUnlocked,
    }

    fn journaled(journal: &Journal, pid: ProcId, by: Option<ProcId>, story: Story) {
        let image = "/img/a".to_string();
        let mut events = vec![Event::RestoreStarted {
            pid,
            image: image.clone(),
            unlock_by: by,
        }];
        if !matches!(story, Story::StartedOnly) {
            events.push(Event::RestoreCompleted {
                pid,
                image,
                ms: Some(1),
            });
            events.push(Event::GuardAttached {
                pid,
                source: cryo_journal::AttachSource::Restore,
            });
        }
        if matches!(story, Story::ThenUnlocked) {
            events.push(Event::Unlocked {
                pid,
                ms: Some(1),
                recovery: false,
            });
        }
        for e in events {
            journal.append(e).unwrap();
        }
    }

    /// A thaw's owner that has exited: this test's own child, reaped.
    fn dead_owner() -> ProcId {
        let mut owner = std::process::Command::new("true").spawn().unwrap();
        let by = ProcId::of(owner.id() as i32).unwrap();
        owner.wait().unwrap();
        by
    }

    /// A thaw's restore not journaled as done, its owner gone, LOCKED, and the driver refuses to
    /// checkpoint it again: it stays LOCKED, never unlocked, and the reason says so.
    #[test]
    fn an_unconfirmed_restore_the_driver_will_not_checkpoint_again_stays_locked() {
        let (procs, fake, _dir, journal) = scene();
        let p = procs.pid(0);
        fake.set_state(p, ProcessState::Locked).fail_next_on(
            p,
            Call::Checkpoint,
            cryo_gpu::CuResult::UNKNOWN,
        );
        let pid = ProcId::of(p).unwrap();
        journaled(&journal, pid, Some(dead_owner()), Story::StartedOnly);
        let r = finish_unlock(&fake.gpu(), &journal, pid).unwrap();
        assert!(
            matches!(&r, FinishUnlock::Left(why) if why.contains("never unlocked")),
            "{r:?}"
        );
        assert_eq!(fake.count(p, Call::Unlock), 0);
        assert_eq!(fake.count(p, Call::Restore), 0);
        assert_eq!(fake.state_of(p), ProcessState::Locked);
    }

    /// Issue 10: a thaw or wake that died between the restore and the unlock is finished by
    /// [`finish_unlock`] only when the journal names a dead owner after a completed restore, the
    /// process is the same and the driver answers LOCKED; every other case is left as it is
    /// (no unlock call, no record).
    #[test]
    fn only_a_dead_thaws_completed_restore_of_a_locked_process_is_unlocked() {
        let live = Procs::spawn(1);
        let live_owner = Some(ProcId::of(live.pid(0)).unwrap());
        let cases = [
            (
                "dead owner, LOCKED",
                Some(dead_owner()),
                Story::Completed,
                ProcessState::Locked,
                true,
                true,
            ),
            (
                "live owner",
                live_owner,
                Story::Completed,
                ProcessState::Locked,
                true,
                false,
            ),
            (
                "itself the owner",
                me(),
                Story::Completed,
                ProcessState::Locked,
                true,
                false,
            ),
            (
                "no owner (cryo gpu restore)",
                None,
                Story::Completed,
                ProcessState::Locked,
                true,
                false,
            ),
            (
                "restore not completed: checkpointed and restored again first",
                Some(dead_owner()),
                Story::StartedOnly,
                ProcessState::Locked,
                true,
                true,
            ),
            (
                "restore not completed, no owner named",
                None,
                Story::StartedOnly,
                ProcessState::Locked,
                true,
                false,
            ),
            (
                "already unlocked",
                Some(dead_owner()),
                Story::ThenUnlocked,
                ProcessState::Locked,
                true,
                false,
            ),
            (
                "RUNNING",
                Some(dead_owner()),
                Story::Completed,
                ProcessState::Running,
                true,
                false,
            ),
            (
                "another process (start time)",
                Some(dead_owner()),
                Story::Completed,
                ProcessState::Locked,
                false,
                false,
            ),
        ];
        for (what, by, story, state, same, unlocks) in cases {
            let (procs, fake, _dir, journal) = scene();
            let p = procs.pid(0);
            fake.set_state(p, state);
            let mut pid = ProcId::of(p).unwrap();
            if !same {
                pid.start_time += 1;
            }
            journaled(&journal, pid, by, story);
            let r = finish_unlock(&fake.gpu(), &journal, pid).unwrap();
            let recovered = cryo_journal::read(journal.dir())
                .unwrap()
                .records
                .iter()
                .any(|r| matches!(r.event, Event::Unlocked { recovery: true, .. }));
            if unlocks {
                assert_eq!(r, FinishUnlock::Unlocked, "{what}");
                assert_eq!(fake.state_of(p), ProcessState::Running, "{what}");
                assert!(
                    recovered,
                    "{what}: the unlock is not journaled as a recovery"
                );
                // Unlocked on the driver's LOCKED alone only after a completed restore.
                let calls: Vec<Call> = fake
                    .calls()
                    .into_iter()
                    .filter(|(q, c)| *q == p && *c != Call::State)
                    .map(|(_, c)| c)
                    .collect();
                let expected: &[Call] = match story {
                    Story::StartedOnly => &[Call::Checkpoint, Call::Restore, Call::Unlock],
                    _ => &[Call::Unlock],
                };
                assert_eq!(calls, expected, "{what}");
            } else {
                assert!(matches!(r, FinishUnlock::Left(_)), "{what}: {r:?}");
                assert_eq!(fake.count(p, Call::Unlock), 0, "{what}");
                assert_eq!(fake.state_of(p), state, "{what}");
                assert!(!recovered, "{what}");
            }
        }
    }
}
