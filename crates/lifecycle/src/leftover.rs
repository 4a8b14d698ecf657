//! Thawed trees a thaw left CHECKPOINTED with nothing to end them: ended at the next guard or
//! agent start.
//!
//! # Design
//! A thaw that fails after CRIU removes its restored tree (`thaw::remove_with_forks`: each CUDA
//! process suspended and verified before its kill, as any stop's). On a full disk that removal
//! cannot journal its stop, so it does not run: the thaw's GPU restore was checkpointed again
//! (its `RestoreCompleted` refused: [`crate::restore::RestoreError::NotRecorded`]) and the whole
//! tree is left alive, its CUDA processes CHECKPOINTED, the thaw's error naming them for `cryo
//! stop`. Nothing of it is in flight in the journal (no suspension began), so once there is room
//! nothing ended it: the journal holds the thaw's restore intent ([`Event::RestoreStarted`]
//! naming the thaw as the one to unlock it), no completion, and the thaw is gone. A thaw killed
//! between that intent and the driver's restore leaves the same. The thaw journals those
//! intents at CRIU's gate, for every process of the tree, before CRIU resumes any of it
//! (`thaw::gate_intents`, one synced write, as a standby's restore journals its tree there; a
//! journal that cannot take them refuses the gate): a thaw killed anywhere between CRIU's
//! resume and its GPU restore (CRIU, not killed with it, resumes the tree all the same) leaves
//! the same too. Before (session 22) the intents were
//! journaled after CRIU's exit, one per CUDA process, and a thaw killed before the first left
//! a tree nothing named, its CUDA processes CHECKPOINTED for good.
//!
//! [`end_left_thaws`] (every guard and agent start: [`crate::settle_in_flight`] with a watcher)
//! finds each such process: its last lifecycle record is that intent (guard attachments and
//! losses aside: [`crate::restore::last_restore`]), its writer gone; it was never parked (a
//! wake's intent on a parked worker looks the same, and that worker stays parked until a
//! wake); a thaw of that
//! image is journaled before it ([`Event::ThawStarted`]); it is the same live process, and the
//! driver answers CHECKPOINTED. It ends the tree the thaw restored (walked up from it through
//! the processes that thaw journaled, to its root, then every process under the root, and what
//! they forked since) through the thaw's own removal, and journals the settlement once.
//!
//! Ended, not resumed, by the evidence:
//! - The thaw failed and said so (its error names these pids for `cryo stop`), or died
//!   before it could answer, which its caller sees as a failure too: its caller
//!   (an operator, the agent's client, a controller) holds a failed thaw and retries the image
//!   or places the worker elsewhere. A tree resumed later, at whatever start comes next, would
//!   be a second worker nobody asked for, never health-checked, holding GPU memory the retry
//!   needs; while it lives, a retry that restores the image's pids is refused (taken).
//! - Nothing is lost: the image still holds everything the tree holds (CHECKPOINTED, it has
//!   served nothing since CRIU restored it), and the thaw never consumes its image.
//! - It is safe: CHECKPOINTED, it holds no live context; the stop verifies that (no device
//!   memory listed, no driver files) before its kill, as every stop.
//!
//! A LOCKED one (the thaw died after the driver's restore) is left to
//! [`crate::finish_unlock`], which completes the thaw instead (session 20's choice: the driver
//! restored it, only its record and unlock were missing).
//!
//! # Limitations
//! Nothing here ends a tree without a CHECKPOINTED CUDA process: an image of plain processes
//! only, whose thaw died after CRIU's gate, runs on (journaled as restored, no context to
//! tear down). A thaw of a cryo before session 22 (intents journaled after CRIU's exit) may
//! have left a tree that no record names. A thaw that journaled its gate's intents and then
//! had the gate refused (the image refused meanwhile, its verdict unwritable) leaves intents
//! of processes CRIU ended: dead, never looked at here. A guard or agent that starts during
//! the gate's intents and CRIU's resume leaves the tree alone (its processes' restores pending,
//! no driver file held: `cryo_guard`'s start, session 23; its seize there made CRIU abort the
//! restore, "Can't attach to PID: Operation not permitted"): the thaw's own guard-before-unlock
//! traces each CUDA process later, a polling guard the plain ones at their `RestoreCompleted`.
//! A `GuardLost` after an intent (a guard that could not trace the process) is the guard's
//! bookkeeping: the intent stays the process's last step (until session 23 it hid the tree).
//! A journal rotation carries the thaw's `ThawStarted` with the intents
//! (`cryo_journal::carried`; until session 23 it was dropped, naming no process, and the tree
//! was never ended).

use std::collections::BTreeSet;

use cryo_gpu::{Gpu, ProcessState};
use cryo_journal::{Event, Journal, ProcId, Record};
use cryo_proc::{Pid, ProcHandle};

use crate::inflight::{SettleError, Settled, Settlement};
use crate::suspend::{id, me};
use crate::target::Resolved;

/// What the settlement of a process whose thaw's tree was ended journals.
pub(crate) const ENDED: &str = "its thaw's restored tree ended";

/// Ends every tree a gone thaw left CHECKPOINTED (see the module docs); `records` is the
/// journal as read before. One [`Settled`] per CUDA process found, journaled as settled.
pub(crate) fn end_left_thaws(
    gpu: &Gpu,
    journal: &Journal,
    records: &[Record],
) -> Result<Vec<Settled>, SettleError> {
    let mut out = Vec::new();
    let mut ended: BTreeSet<ProcId> = BTreeSet::new();
    for (pid, thaw) in left(records) {
        if ended.contains(&pid) {
            continue;
        }
        let Ok(h) = pid.open() else { continue };
        match crate::cuda::settled_state(gpu, h.pid(), crate::cuda::SETTLE) {
            Ok(ProcessState::Checkpointed) => {}
            // LOCKED: `finish_unlock`'s; anything else: not what a thaw left.
            _ => continue,
        }
        let found = ProcessState::Checkpointed.to_string();
        let action = match tree_of(&h, &thaw) {
            Err(why) => Settlement::Left { why },
            Ok(tree) => {
                ended.extend(tree.handles().iter().map(id));
                let r = crate::thaw::remove_with_forks(
                    gpu,
                    &tree,
                    &crate::stop::StopOptions::default(),
                    journal,
                    &crate::progress::NoProgress,
                );
                match r.failure {
                    None => Settlement::ThawEnded {
                        tree: tree.handles().iter().map(ProcHandle::pid).collect(),
                    },
                    Some(why) => Settlement::Left { why },
                }
            }
        };
        journal.append(Event::SuspensionSettled {
            pid,
            found: found.clone(),
            action: match &action {
                Settlement::Left { why } => format!("left as it is: {why}"),
                _ => ENDED.to_string(),
            },
        })?;
        out.push(Settled {
            pid,
            purpose: None,
            found,
            action,
        });
    }
    Ok(out)
}

/// The processes of the thaw whose restore intents name them from the journal's `at`-th record
/// on (its `ThawStarted`), and the image.
#[derive(Debug, Clone)]
struct Thaw {
    image: String,
    procs: BTreeSet<ProcId>,
}

/// Each live process whose last lifecycle record is a thaw's restore intent, not completed, its
/// writer gone, never parked, with the thaw it came from. One pass over `records` (the rules of
/// [`crate::restore::last_restore`], for every process at once), then the live checks.
fn left(records: &[Record]) -> Vec<(ProcId, Thaw)> {
    use std::collections::BTreeMap;
    let mine = me();
    let mut parked: BTreeSet<ProcId> = BTreeSet::new();
    // Each process's last lifecycle step, when it is a restore intent not completed: the
    // intent's index in `records`.
    let mut intent: BTreeMap<ProcId, Option<usize>> = BTreeMap::new();
    for (at, r) in records.iter().enumerate() {
        if let Event::Parked { pid, .. } = &r.event {
            parked.insert(*pid);
        }
        for pid in r.event.pids() {
            let step = match &r.event {
                Event::RestoreStarted { .. } => Some(at),
                // The guard's bookkeeping, not a lifecycle step: a guard that started while
                // CRIU still held the tree at its gate journals `GuardLost` for each process
                // it could not trace then.
                Event::GuardAttached { .. } | Event::GuardLost { .. } => continue,
                _ => None,
            };
            intent.insert(pid, step);
        }
    }
    let mut out = Vec::new();
    for (pid, at) in intent {
        let Some(at) = at else { continue };
        let Event::RestoreStarted {
            image,
            unlock_by: Some(by),
            ..
        } = &records[at].event
        else {
            continue;
        };
        if parked.contains(&pid) || Some(*by) == mine || by.is_alive_same() || !pid.is_alive_same()
        {
            continue;
        }
        // The thaw of that image it came from: the last one started before its intent.
        let Some(started) = records[..at]
            .iter()
            .rposition(|r| matches!(&r.event, Event::ThawStarted { image: i } if i == image))
        else {
            continue;
        };
        let procs = records[started..]
            .iter()
            .filter_map(|r| match &r.event {
                Event::RestoreStarted { pid, image: i, .. }
                | Event::RestoreCompleted { pid, image: i, .. }
                    if i == image =>
                {
                    Some(*pid)
                }
                _ => None,
            })
            .collect();
        out.push((
            pid,
            Thaw {
                image: image.clone(),
                procs,
            },
        ));
    }
    out
}

/// The tree `thaw` restored around `h`: from `h` up through its parents while they are processes
/// that thaw journaled, to that tree's root; then the root and every process under it.
fn tree_of(h: &ProcHandle, thaw: &Thaw) -> Result<Resolved, String> {
    let parent = |h: &ProcHandle| -> Option<ProcHandle> {
        let ppid: Pid = h.stat().ok()?.ppid;
        let p = ProcHandle::open(ppid).ok()?;
        thaw.procs.contains(&id(&p)).then_some(p)
    };
    let mut root = h.try_clone().map_err(|e| e.to_string())?;
    while let Some(p) = parent(&root) {
        root = p;
    }
    Resolved::tree(root).map_err(|e| {
        format!(
            "the tree a thaw of {} restored cannot be listed ({e}); `cryo stop` ends it",
            thaw.image
        )
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::procs::Procs;

    fn rec(seq: u64, event: Event) -> Record {
        Record {
            seq,
            time: std::time::SystemTime::now(),
            event,
        }
    }

    /// Only a live process whose last step is a thaw's restore intent, its writer gone, never
    /// parked, after a `ThawStarted` of that image, is what a thaw left; its thaw's processes are
    /// those journaled under the image since that thaw started.
    #[test]
    fn only_a_gone_thaws_unfinished_intent_is_left_behind() {
        let procs = Procs::spawn(6);
        let ids: Vec<ProcId> = procs
            .pids()
            .iter()
            .map(|p| ProcId::of(*p).unwrap())
            .collect();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = ProcId::of(child.id() as i32).unwrap();
        child.wait().unwrap();
        let alive = ids[5];
        let intent = |pid, image: &str, by| Event::RestoreStarted {
            pid,
            image: image.into(),
            unlock_by: Some(by),
        };
        let mut events = vec![
            Event::ThawStarted { image: "/a".into() },
            // 0: a plain process of the thaw of /a (its intent at CRIU's gate names no one to
            // unlock it, its completion after CRIU's exit); 1: its CUDA process, left.
            Event::RestoreStarted {
                pid: ids[0],
                image: "/a".into(),
                unlock_by: None,
            },
            intent(ids[1], "/a", dead),
            Event::RestoreCompleted {
                pid: ids[0],
                image: "/a".into(),
                ms: None,
            },
            Event::GuardAttached {
                pid: ids[1],
                source: cryo_journal::AttachSource::Restore,
            },
            // 2: completed; 3: its writer alive.
            intent(ids[2], "/a", dead),
            Event::RestoreCompleted {
                pid: ids[2],
                image: "/a".into(),
                ms: Some(1),
            },
            intent(ids[3], "/a", alive),
            // 4: a parked worker's wake (no thaw of "wake" either).
            Event::Parked {
                pid: ids[4],
                bytes: 1,
                gpus: vec![],
                gpu_bytes: vec![],
            },
            intent(ids[4], "wake", dead),
        ];
        // A restore intent with no thaw of its image before it.
        events.insert(0, intent(ids[0], "/b", dead));
        let records: Vec<Record> = events
            .into_iter()
            .enumerate()
            .map(|(i, e)| rec(i as u64 + 1, e))
            .collect();
        let found = left(&records);
        assert_eq!(
            found.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            vec![ids[1]]
        );
        // A thaw killed before its plain processes' completions: their gate intents (no one
        // to unlock them) are not left behind, and they are the thaw's processes still.
        let cut = records
            .iter()
            .position(|r| matches!(r.event, Event::RestoreCompleted { pid, .. } if pid == ids[0]))
            .unwrap();
        let mut before: Vec<Record> = records[..cut].to_vec();
        before.extend(records[cut + 1..].iter().cloned());
        let found_before = left(&before);
        assert_eq!(
            found_before.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            vec![ids[1]]
        );
        assert!(found_before[0].1.procs.contains(&ids[0]));
        let thaw = &found[0].1;
        assert_eq!(thaw.image, "/a");
        assert!(
            thaw.procs.contains(&ids[0]) && thaw.procs.contains(&ids[1]),
            "{:?}",
            thaw.procs
        );
    }

    /// Attack (session 23): a guard or agent that started while a thaw was at CRIU's gate (the
    /// tree's intents journaled) could not trace the root, which CRIU traces there, and
    /// journaled `GuardLost` for it (freeze_thaw.rs, `a_guard_or_agent_starting_at_a_thaws_gate_
    /// leaves_the_thaw_to_serve`, before its start left pending restores alone). That is the
    /// guard's bookkeeping, not a lifecycle step: a thaw that dies after it (before its GPU
    /// restore) still leaves its tree for the next start to end. (Before: the `GuardLost`
    /// counted as the process's last step, `left` found nothing ("left: []"), and the tree
    /// stayed CHECKPOINTED for good.)
    #[test]
    fn a_guard_lost_at_the_gate_still_leaves_the_intent_behind() {
        let procs = Procs::spawn(1);
        let rank = ProcId::of(procs.pids()[0]).unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = ProcId::of(child.id() as i32).unwrap();
        child.wait().unwrap();
        let records: Vec<Record> = [
            Event::ThawStarted { image: "/a".into() },
            Event::RestoreStarted {
                pid: rank,
                image: "/a".into(),
                unlock_by: Some(dead),
            },
            Event::GuardLost { pid: rank },
        ]
        .into_iter()
        .enumerate()
        .map(|(i, e)| rec(i as u64 + 1, e))
        .collect();
        assert_eq!(
            left(&records).iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            vec![rank]
        );
    }
}
