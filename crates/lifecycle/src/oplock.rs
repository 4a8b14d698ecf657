//! One lifecycle operation at a time per process: the lock a park, a wake, a stop, a freeze or
//! a settlement holds on each process it works on.
//!
//! # Design
//! Two wakes of one parked worker (two `cryo wake`, the agent's API and an activation, two
//! activations) both found it CHECKPOINTED and both restored it: the driver refused the second
//! (ILLEGAL_STATE), whose wake then failed with a driver error after journaling a restore intent
//! of its own; or the second found it LOCKED with a completed restore and traced and unlocked
//! it too. A park and a wake of one worker at once (the activator parking an idle worker while
//! an operator wakes it, an operator's `cryo park` meeting an activation's wake) did the same
//! to each other: a park of a worker a wake had restored and not yet unlocked checkpointed it
//! under the wake, whose unlock the driver then refused; a wake of a worker a park had locked
//! and not yet checkpointed unlocked it under the park, whose checkpoint the driver then
//! refused. Neither the journal nor the driver's state can say "a park or a wake is at work"
//! early enough: each reads both before it journals anything. So every [`crate::park()`] and
//! every [`crate::wake`] takes an exclusive `flock` on one file per process of its target
//! ([`cryo_state::StateDir::op_lock`]: pid and start time, so a reused pid names another file)
//! before it reads or journals anything, without waiting, and holds them until it returns. One
//! that finds one held is refused at once ([`crate::ParkError::InProgress`],
//! [`crate::WakeError::InProgress`], naming the holder's pid and what it does, which the holder
//! writes into the file), with nothing read, journaled or asked of the driver: the first one
//! finishes (or fails and undoes what it did), and the next one finds the worker as it left it.
//! One that dies lets go with its last fd (the kernel's `flock` semantics), so a crash never
//! leaves a process locked out.
//!
//! A stop takes the same lock ([`Op::Stop`]) on every process of its target at its entry, before
//! it journals, reads or suspends anything, and on every process that joins the target (a
//! cgroup's joiner, a tree's fork) before it looks at it; it holds them all until it returns,
//! after its last kill. A stop of a parked worker checked it CHECKPOINTED right before its kill
//! and then killed it: a wake in between (nothing kept it out) restored and unlocked it, and the
//! stop tore the restored running context down (the wedge); a wake at work before the stop
//! (before its restore, or before its unlock) had its worker killed, or checkpointed and killed,
//! under it. Now a stop that finds a park's or a wake's lock is refused at once
//! ([`crate::StopError::InProgress`], exit 3 as theirs; a joiner whose lock is held is a refusal
//! of the stop, nothing more killed), and a wake or a park that finds a stop's is refused as it
//! is by each other's.
//!
//! A settlement ([`crate::settle_in_flight`]: a stop's, a guard's or the agent's start) takes
//! it too, on each process whose suspension it settles, before its last look and until it is
//! done, as a settlement ([`Op::Settle`], the word `settle` in the file): whether it would resume
//! a dead park's or freeze's process in place, finish a dead stop's kill or unlock what a
//! suspension left LOCKED. (It took it as a wake or a stop before, and a wake refused by a guard
//! start's settlement said "pid N is being woken by cryo pid G": an operator looked for a wake
//! that nobody ran.) A guard start resumed a dead park's CHECKPOINTED worker while a wake
//! that had read it CHECKPOINTED was about to restore it (two restorers; the wake failed on the
//! driver's refusal); a wake meeting a settlement at work is refused now as by a wake, and a
//! settlement meeting any operation's lock leaves the process to it, untouched, named and still
//! in flight. A stop's own settlement settles a process the stop already holds without taking
//! it again (a second open file of the same process's lock would refuse it).
//!
//! A lock is taken once per operation, at its entry: a park's undo (restoring what it
//! suspended) and a failed wake's park again run under the lock their operation holds and take
//! none. `flock` locks belong to the open file, so two operations in one process (the agent's
//! API and its activators) exclude each other as two processes do.
//!
//! A process's file stays while it lives (taken again by each of its operations); the files of
//! processes that have ended are removed by the next one. Removing a file another operation has
//! open is harmless then: nobody can park or wake a process that has ended.
//!
//! A freeze takes it too ([`Op::Freeze`]) on every process of its tree before its first look,
//! and on every fork before it looks at it, and holds them until it returns, the worker gone
//! (or given back as found): a wake of a parked worker whose freeze had verified it
//! CHECKPOINTED restored and unlocked it before the dump, and the freeze then dumped a live
//! restored context for CRIU to end. A freeze finding a lock held is refused at once
//! ([`crate::FreezeError::InProgress`]); a park, a wake or a stop finding a freeze's is refused
//! as by each other's.
//!
//! # Limitations
//! Parks, wakes, stops, freezes, settlements of in-flight suspensions and a guard's or agent's
//! finishing of a dead thaw's or wake's unlock ([`crate::restore::finish_unlock`]) take the
//! lock (the last two as [`Op::Settle`]); a thaw and the ending of a dead thaw's tree
//! (`leftover`) do not: a thaw's
//! tree is new, and a dead thaw's tree is nobody's to park or wake. A thaw's
//! removal of a tree it restored stops it through [`crate::stop()`], which takes the tree's
//! locks: no one holds them (a thaw takes none, and its tree is not parked).
//!
//! A stop finds the state directory of the lock files from its journal's
//! ([`state_of`]: every cryo command, the agent and the guard open the journal at
//! `STATE/journal`); a journal opened anywhere else keeps the locks inside its own directory,
//! which parks and wakes given that state directory would not share.
//!
//! A stop refused because one process of its target is at work stops none of them: its
//! caller runs it again once the park or the wake has returned.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use cryo_proc::{Pid, ProcHandle};
use cryo_state::StateDir;

use crate::suspend::id;

/// How often a caller that waits out another operation's hold on a process tries again (a
/// preStop's stop, [`crate::stop_when_free`]; an activation's wake): each try that meets the
/// hold is refused at once with nothing done, so trying again is safe.
pub const BUSY_RETRY: std::time::Duration = std::time::Duration::from_millis(50);

/// What holds a process's lock: named in the refusal of the next one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    /// A park ([`crate::park()`]).
    Park,
    /// A wake ([`crate::wake`]).
    Wake,
    /// A stop ([`crate::stop()`]).
    Stop,
    /// A freeze ([`crate::freeze()`]), from before its first look until the worker is gone.
    Freeze,
    /// A settlement of what a dead operation left ([`crate::settle_in_flight`]: a guard's or the
    /// agent's start, or a stop's settlement of a process outside its target; and a guard's or
    /// agent's finishing of a dead wake's or thaw's unlock,
    /// [`crate::restore::finish_unlock`]): resuming a dead park's or freeze's process in place,
    /// finishing a dead stop's kill, or unlocking what a dead suspension left LOCKED.
    Settle,
}

impl Op {
    /// How its holder writes it into the file.
    fn word(self) -> &'static str {
        match self {
            Op::Park => "park",
            Op::Wake => "wake",
            Op::Stop => "stop",
            Op::Freeze => "freeze",
            Op::Settle => "settle",
        }
    }
}

impl std::fmt::Display for Op {
    /// As in "pid N is being parked".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Op::Park => "parked",
            Op::Wake => "woken",
            Op::Stop => "stopped",
            Op::Freeze => "frozen",
            Op::Settle => "settled",
        })
    }
}

/// The locks of one park, wake or stop: held until dropped.
#[derive(Debug)]
pub(crate) struct OpLocks {
    _held: Vec<File>,
    /// The processes whose locks these are.
    ids: Vec<cryo_journal::ProcId>,
}

impl OpLocks {
    /// Whether these hold process `pid`'s lock (so that a step of the same operation does not
    /// take it again on a second open file, which its own lock would refuse).
    pub(crate) fn holds(&self, pid: &cryo_journal::ProcId) -> bool {
        self.ids.contains(pid)
    }

    /// Adds the locks of `more` (taken by the same operation later) to these.
    pub(crate) fn extend(&mut self, more: OpLocks) {
        self._held.extend(more._held);
        self.ids.extend(more.ids);
    }
}

/// Why a park, a wake or a stop could not take its locks.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    /// Another park, wake or stop holds process `pid`'s lock.
    #[error("busy")]
    Held {
        /// The process.
        pid: Pid,
        /// The pid of the cryo process that holds it, if it could write it.
        by: Option<Pid>,
        /// What that one does, if it could write it.
        doing: Option<Op>,
    },
    /// The lock file could not be created, opened or locked.
    #[error("cannot {what} {}: {source}", .path.display())]
    File {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// Takes the lock of every process of `handles` for `op` (see the module docs), without waiting.
pub(crate) fn take(state: &StateDir, handles: &[ProcHandle], op: Op) -> Result<OpLocks, LockError> {
    let dir = state.op_locks_dir();
    let err = |what, path: &Path| {
        let path = path.to_path_buf();
        move |source| LockError::File { what, path, source }
    };
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(err("create", &dir))?;
    let mut held = Vec::with_capacity(handles.len());
    let mut ids = Vec::with_capacity(handles.len());
    for h in handles {
        let pid = id(h);
        let path = state.op_lock(&pid);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nofollow())
            .open(&path)
            .map_err(err("open", &path))?;
        match rustix::fs::flock(&file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                let (by, doing) = holder(&mut file);
                return Err(LockError::Held {
                    pid: h.pid(),
                    by,
                    doing,
                });
            }
            Err(e) => return Err(err("lock", &path)(e.into())),
        }
        // Only for the refusal the next one prints: a full disk must not fail this one.
        let _ = file.set_len(0).and_then(|()| {
            file.write_all(format!("{} {}", std::process::id(), op.word()).as_bytes())
        });
        held.push(file);
        ids.push(pid);
    }
    sweep(&dir);
    Ok(OpLocks { _held: held, ids })
}

/// The state directory whose `oplock/` the operations writing `journal` share: the journal's
/// parent when the journal sits where [`StateDir::journal_dir`] puts it (`STATE/journal`: every
/// cryo command, the agent and the guard open it so), so that a stop, whose callers pass only
/// the journal, locks the files parks and wakes lock. A journal opened elsewhere (a test's own
/// directory) keeps its locks inside its own directory, never in the directory around it.
pub(crate) fn state_of(journal: &cryo_journal::Journal) -> StateDir {
    let dir = journal.dir();
    match dir.parent() {
        Some(root) if dir.file_name().is_some_and(|n| n == "journal") => StateDir::new(root),
        _ => StateDir::new(dir),
    }
}

/// `O_NOFOLLOW`: a lock file planted as a symlink is refused, never followed.
fn nofollow() -> i32 {
    i32::try_from(rustix::fs::OFlags::NOFOLLOW.bits()).unwrap_or(0)
}

/// The pid and the operation the holder of `file`'s lock wrote into it (`PID OP`; a bare pid
/// from a cryo before parks took the lock is a wake).
fn holder(file: &mut File) -> (Option<Pid>, Option<Op>) {
    let mut text = String::new();
    if file.read_to_string(&mut text).is_err() {
        return (None, None);
    }
    let mut words = text.split_whitespace();
    let by = words.next().and_then(|p| p.parse().ok());
    let doing = match words.next() {
        Some("park") => Some(Op::Park),
        Some("wake") | None => Some(Op::Wake),
        Some("stop") => Some(Op::Stop),
        Some("freeze") => Some(Op::Freeze),
        Some("settle") => Some(Op::Settle),
        Some(_) => None,
    };
    (by, doing)
}

/// Removes the lock files of processes that have ended (best effort).
fn sweep(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some((pid, start)) = name
            .to_str()
            .and_then(|n| n.strip_suffix(".lock"))
            .and_then(|n| n.split_once('-'))
        else {
            continue;
        };
        let (Ok(pid), Ok(start)) = (pid.parse(), start.parse()) else {
            continue;
        };
        if !cryo_journal::ProcId::new(pid, start).is_alive_same() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::procs::Procs;

    /// A second taker (park or wake) of any process of a held set is refused at once, naming
    /// the holder and what it does; the lock is free again once the first lets go; a reused pid
    /// (another start time) is another lock; the files of ended processes are swept.
    #[test]
    fn one_operation_at_a_time_per_process() {
        let procs = Procs::spawn(2);
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let open = |i: usize| ProcHandle::open(procs.pid(i)).unwrap();
        for (first_op, second_op) in [
            (Op::Wake, Op::Park),
            (Op::Park, Op::Wake),
            (Op::Settle, Op::Wake),
        ] {
            let first = take(&state, &[open(0), open(1)], first_op).unwrap();
            for i in 0..2 {
                for op in [first_op, second_op] {
                    match take(&state, &[open(i)], op) {
                        Err(LockError::Held { pid, by, doing }) => {
                            assert_eq!(pid, procs.pid(i));
                            assert_eq!(by, Some(std::process::id() as Pid));
                            assert_eq!(doing, Some(first_op));
                        }
                        other => panic!("{other:?}"),
                    }
                }
            }
            drop(first);
        }
        let again = take(&state, &[open(1)], Op::Park).unwrap();
        assert!(take(&state, &[open(0)], Op::Wake).is_ok());
        drop(again);

        // An ended process's file is swept by the next wake; a live one's stays.
        let ended = cryo_journal::ProcId::new(procs.pid(0), 1);
        std::fs::write(state.op_lock(&ended), b"1").unwrap();
        let _l = take(&state, &[open(1)], Op::Wake).unwrap();
        assert!(!state.op_lock(&ended).exists());
        assert!(state.op_lock(&id(&open(0))).exists());
    }
}
