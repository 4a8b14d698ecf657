//! What a tree forked since it was listed: the one walk that a stop of a tree (while it is
//! suspended and killed), a failed thaw and a dropped standby (while the restored tree is
//! removed) look again with, until nothing new turns up.
//!
//! # Design
//! A process forked after the listing is found two ways: as a descendant of a process of the
//! tree still alive, and, once its parent has ended (killed first, it is reparented out of the
//! tree), as a member of a session the tree leads ([`own_sessions`]): a session cannot be
//! joined, so every member of it descends from the tree. Every process is opened as a pidfd.
//!
//! # Limitations
//! A fork that started a session of its own and whose parent then ended is out of both: not
//! found. A tree that leads no session of its own (its root runs in the operator's shell
//! session) is looked at through its descendants only.

use cryo_proc::{Pid, ProcHandle};

/// How many times a tree is looked at again for what it forked meanwhile, before a tree that
/// keeps forking is given up on (and named).
pub(crate) const ROUNDS: usize = 8;

/// The sessions the tree leads: each led by one of `tree`'s processes, with that leader's
/// handle. Read from the tree's live processes, so each session id has been the tree's since it
/// was listed (a member was in it all along: a session cannot be joined).
pub(crate) fn own_sessions(tree: &[ProcHandle]) -> Vec<(Pid, &ProcHandle)> {
    let mut out: Vec<(Pid, &ProcHandle)> = Vec::new();
    for h in tree {
        let Ok(st) = h.stat() else { continue };
        if out.iter().any(|(s, _)| *s == st.session) {
            continue;
        }
        if let Some(leader) = tree.iter().find(|l| l.pid() == st.session) {
            out.push((st.session, leader));
        }
    }
    out
}

/// The processes of the tree that `held` (what was listed, and found by earlier looks) does
/// not hold: the descendants of every one of them still alive, and every member of the tree's
/// own sessions (`sessions`, [`own_sessions`]), where a process forked since and reparented out
/// of the tree (its parent exited) still is. A session whose leader was reaped and whose id
/// another process holds now is no longer the tree's and is not looked at.
pub(crate) fn forked_since(
    held: &[&ProcHandle],
    sessions: &[(Pid, &ProcHandle)],
) -> Vec<ProcHandle> {
    forked_below(held, held, sessions)
}

/// [`forked_since`], walking the descendants of `from` only (a freeze: what CRIU dumps is
/// the root's tree, one walk of it; each process's children are listed per thread, and a
/// worker has hundreds of threads).
pub(crate) fn forked_below(
    from: &[&ProcHandle],
    held: &[&ProcHandle],
    sessions: &[(Pid, &ProcHandle)],
) -> Vec<ProcHandle> {
    let holds = |pid: Pid| held.iter().any(|h| h.pid() == pid && h.is_alive());
    let ours: Vec<Pid> = sessions
        .iter()
        .filter(|(sid, leader)| {
            leader.liveness() != cryo_proc::Liveness::Gone
                || cryo_proc::liveness(*sid) == cryo_proc::Liveness::Gone
        })
        .map(|(sid, _)| *sid)
        .collect();
    let members = ProcHandle::in_sessions(&ours).unwrap_or_else(|e| {
        tracing::error!(error = %e, "cannot list the tree's sessions");
        Vec::new()
    });
    let mut out: Vec<ProcHandle> = Vec::new();
    let descendants = from
        .iter()
        .filter(|h| h.is_alive())
        .flat_map(|h| h.descendants());
    for h in descendants.chain(members) {
        if !holds(h.pid()) && !out.iter().any(|o| o.pid() == h.pid()) {
            out.push(h);
        }
    }
    out
}
