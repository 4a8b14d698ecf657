//! Standing duplicates of every guarded process's driver fds: what holds a context whose process
//! replaced its program.
//!
//! # Why
//! `execve` closes the close-on-exec fds (libcuda opens `/dev/nvidia*` with `O_CLOEXEC`) and
//! drops the old memory before any ptrace stop after it: at the exec stop there is nothing left
//! to duplicate. So the guard holds duplicates from the moment it traces a process (taken through
//! the pidfd, `pidfd_getfd`), and at the exec stop they are the only holders of the old context,
//! which is then pinned exactly as at an exit stop. The driver frees a context at the last
//! release of its device files; duplicates kept across a SIGKILL keep it (the measured fact an
//! exec has the same shape as), and checkpoint and restore both work while they are held.
//!
//! # Rules
//! - Taken before the tracer seizes a process (an exec between the two would otherwise close
//!   them unseen) and again right after; refreshed after every restore the guard hears of and
//!   every [`crate::SCAN_INTERVAL`] (new driver fds; an fd whose number now names another file,
//!   told by `kcmp(KCMP_FILE)`).
//! - Never dropped while the context may be live: a driver fd the process no longer holds is kept
//!   ([`Standing::vanished`]) until the journal shows the process suspended, the exec stop pins
//!   it, or the process is gone. Dropped as a whole when the journal shows the process
//!   checkpointed since its last restore (nothing live to hold; a dump's lease is granted only
//!   then), when the guard lets go of it, and when it is gone.
//! - They live in the guard's own process and are never handed to the pin holder until they
//!   become a pin: an agent that dies or restarts closes them, and the process, which still holds
//!   its own fds, loses nothing; the next guard takes them again when it attaches.

use std::collections::BTreeMap;
use std::os::fd::{AsFd, OwnedFd, RawFd};

use cryo_journal::ProcId;
use cryo_proc::{Pid, ProcHandle};

/// The duplicates held for one process.
#[derive(Debug)]
pub(crate) struct Standing {
    pub(crate) id: ProcId,
    /// `(fd number in the process, our duplicate)` of the driver fds it holds now.
    pub(crate) fds: Vec<(RawFd, OwnedFd)>,
    /// Duplicates of driver files it held and no longer holds at that number.
    pub(crate) vanished: Vec<(RawFd, OwnedFd)>,
}

impl Standing {
    /// Every duplicate held (current first).
    pub(crate) fn into_all(self) -> Vec<(RawFd, OwnedFd)> {
        let mut all = self.fds;
        all.extend(self.vanished);
        all
    }
}

/// What a refresh changed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Refreshed {
    /// Duplicates newly taken.
    pub(crate) taken: usize,
    /// Driver files no longer held at their number since the last look.
    pub(crate) vanished: usize,
}

/// Every guarded process's standing duplicates, by pid.
#[derive(Debug, Default)]
pub(crate) struct StandingSet {
    map: BTreeMap<Pid, Standing>,
}

impl StandingSet {
    /// Brings `id`'s duplicates up to its driver fds `now` (numbers, as the inspector listed
    /// them): takes what is new, keeps what is the same open file, moves what is gone to
    /// `vanished`.
    pub(crate) fn refresh(&mut self, id: ProcId, handle: &ProcHandle, now: &[RawFd]) -> Refreshed {
        let entry = self.map.entry(id.pid).or_insert_with(|| Standing {
            id,
            fds: Vec::new(),
            vanished: Vec::new(),
        });
        if entry.id != id {
            // The pid names another process now: what was held is the old one's (gone).
            *entry = Standing {
                id,
                fds: Vec::new(),
                vanished: Vec::new(),
            };
        }
        let mut out = Refreshed::default();
        let mut old = std::mem::take(&mut entry.fds);
        let mut kept = Vec::with_capacity(now.len());
        for &n in now {
            // kcmp unavailable: take the number as unchanged rather than pile up duplicates.
            let same = old
                .iter()
                .position(|(m, d)| *m == n && handle.same_file(n, d.as_fd()).unwrap_or(true));
            match same {
                Some(i) => kept.push(old.swap_remove(i)),
                None => match handle.get_fd(n) {
                    Ok(dup) => {
                        out.taken += 1;
                        kept.push((n, dup));
                    }
                    // Closed since listed: the next look sees the table as it is.
                    Err(err) => {
                        tracing::debug!(pid = id.pid, fd = n, %err, "no standing duplicate")
                    }
                },
            }
        }
        out.vanished = old.len();
        entry.vanished.extend(old);
        entry.fds = kept;
        out
    }

    /// Takes `pid`'s duplicates out (to pin them, or to drop them).
    pub(crate) fn take(&mut self, pid: Pid) -> Option<Standing> {
        self.map.remove(&pid)
    }

    /// Takes out only the vanished duplicates of `pid`.
    pub(crate) fn take_vanished(&mut self, pid: Pid) -> Vec<(RawFd, OwnedFd)> {
        self.map
            .get_mut(&pid)
            .map(|s| std::mem::take(&mut s.vanished))
            .unwrap_or_default()
    }

    /// How many duplicates are held for `pid`.
    pub(crate) fn count(&self, pid: Pid) -> usize {
        self.map
            .get(&pid)
            .map_or(0, |s| s.fds.len() + s.vanished.len())
    }
}
