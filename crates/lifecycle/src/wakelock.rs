//! One wake at a time per process: the lock a wake holds on each process it works on.
//!
//! # Design
//! Two wakes of one parked worker (two `cryo wake`, the agent's API and an activation, two
//! activations) both found it CHECKPOINTED and both restored it: the driver refused the second
//! (ILLEGAL_STATE), whose wake then failed with a driver error after journaling a restore intent
//! of its own; or the second found it LOCKED with a completed restore and traced and unlocked
//! it too. Neither the journal nor the driver's state can say "a wake is at work" early enough:
//! the first wake reads both before it journals anything. So every [`crate::wake`] takes an
//! exclusive `flock` on one file per process of its target
//! ([`cryo_state::StateDir::wake_lock`]: pid and start time, so a reused pid names another file)
//! before it reads anything, without waiting, and holds them until it returns. A second wake
//! that finds one held is refused at once ([`crate::WakeError::InProgress`], naming the holder's
//! pid, which the holder writes into the file), with nothing read, journaled or asked of the
//! driver: the first one brings the worker back, or fails and leaves it parked, and a wake after
//! it finds it running (nothing to do) or parked. A wake that dies lets go with its last fd
//! (the kernel's `flock` semantics), so a crash never leaves a process unwakeable.
//!
//! A process's file stays while it lives (taken again by each of its wakes); the files of
//! processes that have ended are removed by the next wake. Removing a file another wake has open
//! is harmless then: nobody can wake a process that has ended.
//!
//! # Limitations
//! Only wakes take the lock: a park, a stop or a guard's settlement of the same process does
//! not wait for it (a settlement already leaves alone a process whose journaled owner is alive).

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use cryo_proc::{Pid, ProcHandle};
use cryo_state::StateDir;

use crate::suspend::id;

/// The locks of one wake: held until dropped.
#[derive(Debug)]
pub(crate) struct WakeLocks {
    _held: Vec<File>,
}

/// Why a wake could not take its locks.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LockError {
    /// Another wake holds process `pid`'s lock.
    #[error("busy")]
    Held {
        /// The process.
        pid: Pid,
        /// The pid of the cryo process that holds it, if it could write it.
        by: Option<Pid>,
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

/// Takes the lock of every process of `handles` (see the module docs), without waiting.
pub(crate) fn take(state: &StateDir, handles: &[ProcHandle]) -> Result<WakeLocks, LockError> {
    let dir = state.wake_locks_dir();
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
    for h in handles {
        let path = state.wake_lock(&id(h));
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
                return Err(LockError::Held {
                    pid: h.pid(),
                    by: holder(&mut file),
                })
            }
            Err(e) => return Err(err("lock", &path)(e.into())),
        }
        // Only for the refusal a second wake prints: a full disk must not fail the wake.
        let _ = file
            .set_len(0)
            .and_then(|()| file.write_all(std::process::id().to_string().as_bytes()));
        held.push(file);
    }
    sweep(&dir);
    Ok(WakeLocks { _held: held })
}

/// `O_NOFOLLOW`: a lock file planted as a symlink is refused, never followed.
fn nofollow() -> i32 {
    i32::try_from(rustix::fs::OFlags::NOFOLLOW.bits()).unwrap_or(0)
}

/// The pid the holder of `file`'s lock wrote into it.
fn holder(file: &mut File) -> Option<Pid> {
    let mut text = String::new();
    file.read_to_string(&mut text).ok()?;
    text.trim().parse().ok()
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

    /// A second taker of any process of a held set is refused at once, naming the holder; the
    /// lock is free again once the first lets go; a reused pid (another start time) is another
    /// lock; the files of ended processes are swept.
    #[test]
    fn one_wake_at_a_time_per_process() {
        let procs = Procs::spawn(2);
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let open = |i: usize| ProcHandle::open(procs.pid(i)).unwrap();
        let first = take(&state, &[open(0), open(1)]).unwrap();
        for i in 0..2 {
            match take(&state, &[open(i)]) {
                Err(LockError::Held { pid, by }) => {
                    assert_eq!(pid, procs.pid(i));
                    assert_eq!(by, Some(std::process::id() as Pid));
                }
                other => panic!("{other:?}"),
            }
        }
        drop(first);
        let again = take(&state, &[open(1)]).unwrap();
        assert!(take(&state, &[open(0)]).is_ok());
        drop(again);

        // An ended process's file is swept by the next wake; a live one's stays.
        let ended = cryo_journal::ProcId::new(procs.pid(0), 1);
        std::fs::write(state.wake_lock(&ended), b"1").unwrap();
        let _l = take(&state, &[open(1)]).unwrap();
        assert!(!state.wake_lock(&ended).exists());
        assert!(state.wake_lock(&id(&open(0))).exists());
    }
}
