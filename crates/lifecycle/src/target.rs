//! What a procedure acts on: a process tree, a cgroup, or exactly some processes, resolved once
//! to pidfd handles.
//!
//! # Design
//! A [`Target`] is what the operator named; [`Target::resolve`] opens a pidfd for every process
//! of it at once, and the [`Resolved`] handles are what every later step uses (the stop, the
//! freeze, the checks before them): no pid is looked up twice, and none can be reused under the
//! procedure. A tree member or cgroup member that exits while it is listed is simply not part of
//! it; a pid named explicitly, and the root of a tree, must exist. A pid named explicitly that is
//! a thread id stands for its process (its thread group), as it does for the CUDA driver
//! (NVIDIA/cuda-checkpoint#41). A cgroup is taken as a whole subtree: every cgroup below it, and
//! every thread listed in any of them (threaded cgroups on v2, `tasks` on v1) as its process
//! ([`cryo_proc::cgroup_tree_procs`]). A caller that already holds the root (and checked it is a
//! process, not a thread) builds the tree from it: [`Resolved::tree`].

use std::fmt;
use std::path::PathBuf;

use cryo_proc::Pid;
use cryo_proc::{ProcError, ProcHandle};

/// What to act on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A process and every descendant.
    Tree(Pid),
    /// Every process of a cgroup and of every cgroup below it (how a container or a pod is
    /// stopped).
    Cgroup(PathBuf),
    /// Exactly these processes.
    Pids(Vec<Pid>),
}

/// `tree of pid 12`, `cgroup /sys/fs/cgroup/x`, `pids 12,13`: how the journal names a target.
impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Tree(p) => write!(f, "tree of pid {p}"),
            Target::Cgroup(p) => write!(f, "cgroup {}", p.display()),
            Target::Pids(p) => {
                f.write_str("pids ")?;
                for (i, pid) in p.iter().enumerate() {
                    if i > 0 {
                        f.write_str(",")?;
                    }
                    write!(f, "{pid}")?;
                }
                Ok(())
            }
        }
    }
}

/// The target could not be resolved (nothing was done to it).
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// A process could not be looked up or opened.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// The target has no processes.
    #[error("the target has no processes")]
    Empty,
}

/// The one process an operator names (`cryo gpu`, the `cuda-checkpoint` front end, the root of
/// a freeze) could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum OpenProcessError {
    /// No such process.
    #[error("pid {0} does not exist")]
    NoSuchProcess(Pid),
    /// A thread of another process.
    #[error("pid {pid} is a thread of process {tgid}; use --pid {tgid}")]
    Thread {
        /// The thread.
        pid: Pid,
        /// Its process.
        tgid: Pid,
    },
    /// `/proc` or the pidfd failed.
    #[error("opening pid {pid}: {source}")]
    Proc {
        /// The pid.
        pid: Pid,
        /// Why.
        source: ProcError,
    },
}

/// Opens the process `pid` names: it must exist and be a process, not a thread of one. Held
/// through a pidfd from here on, so a pid reused later is never acted upon.
pub fn open_process(pid: Pid) -> Result<ProcHandle, OpenProcessError> {
    let proc_err = |source| OpenProcessError::Proc { pid, source };
    match cryo_proc::tgid(pid).map_err(proc_err)? {
        None => return Err(OpenProcessError::NoSuchProcess(pid)),
        Some(tgid) if tgid != pid => return Err(OpenProcessError::Thread { pid, tgid }),
        Some(_) => {}
    }
    ProcHandle::open(pid).map_err(|e| match e {
        ProcError::NoSuchProcess(_) => OpenProcessError::NoSuchProcess(pid),
        e => proc_err(e),
    })
}

/// A target with a pidfd for each of its processes, opened at once.
#[derive(Debug)]
pub struct Resolved {
    target: Target,
    handles: Vec<ProcHandle>,
    /// Processes of the target left out on purpose (see [`Resolved::spare`]).
    spared: Vec<ProcHandle>,
}

impl Target {
    /// Opens every process of the target (see the module docs).
    pub fn resolve(&self) -> Result<Resolved, ResolveError> {
        let pids = match self {
            Target::Tree(root) => return Resolved::tree(ProcHandle::open(process_of(*root)?)?),
            Target::Cgroup(path) => cryo_proc::cgroup_tree_procs(path)?,
            Target::Pids(p) => {
                let mut procs = Vec::with_capacity(p.len());
                for pid in p {
                    let tgid = process_of(*pid)?;
                    if !procs.contains(&tgid) {
                        procs.push(tgid);
                    }
                }
                procs
            }
        };
        let mut handles = Vec::with_capacity(pids.len());
        for pid in pids {
            match ProcHandle::open(pid) {
                Ok(h) => handles.push(h),
                // A cgroup member that exited while we listed is simply not part of the target;
                // a pid named explicitly must exist.
                Err(ProcError::NoSuchProcess(_)) if matches!(self, Target::Cgroup(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if handles.is_empty() {
            return Err(ResolveError::Empty);
        }
        Ok(Resolved {
            target: self.clone(),
            handles,
            spared: Vec::new(),
        })
    }
}

/// The process (thread group) `pid` belongs to: itself for a process, its process for a thread.
fn process_of(pid: Pid) -> Result<Pid, ProcError> {
    cryo_proc::tgid(pid)?.ok_or(ProcError::NoSuchProcess(pid))
}

impl Resolved {
    /// The tree under `root` walked through its children files (`/proc/PID/task/TID/children`,
    /// [`ProcHandle::descendants`]: each child opened and checked to still be its parent's),
    /// parents before children: what a freeze lists. It reads the tree's own processes only,
    /// where [`Resolved::tree`] reads every process of the host (measured at load ~14, median
    /// of 30: 0.07 ms against 17.5 ms with 126 processes on the host, 23.7 ms with 327, 141 ms
    /// with 2133). The kernel documents those files as unreliable while the tree forks or
    /// exits: a process forked or ended during the walk may be missed (as a scan of /proc
    /// misses one forked while it runs). So only for a caller that settles the tree again once
    /// it cannot change, as the freeze does at CRIU's post-dump gate with the tree frozen
    /// (`freeze::at_dump_gate`): a process the walk missed is seen there, a plain one added to
    /// the image as forked since, one with CUDA state or driver files refusing the dump (the
    /// tree resumed, nothing published).
    pub fn tree_walked(root: ProcHandle) -> Resolved {
        let mut handles = root.descendants();
        handles.insert(0, root);
        Resolved {
            target: Target::Tree(handles[0].pid()),
            handles,
            spared: Vec::new(),
        }
    }

    /// The tree under `root`, a process the caller already holds (and checked).
    pub fn tree(root: ProcHandle) -> Result<Resolved, ResolveError> {
        let pids = cryo_proc::tree(root.pid())?;
        let mut handles = Vec::with_capacity(pids.len());
        for pid in pids.into_iter().filter(|p| *p != root.pid()) {
            match ProcHandle::open(pid) {
                Ok(h) => handles.push(h),
                // A member that exited while we walked is simply not part of the tree.
                Err(ProcError::NoSuchProcess(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        handles.insert(0, root);
        Ok(Resolved {
            target: Target::Tree(handles[0].pid()),
            handles,
            spared: Vec::new(),
        })
    }

    /// Handles already open (a procedure's own processes), named as `target`.
    pub fn from_handles(target: Target, handles: Vec<ProcHandle>) -> Self {
        Self {
            target,
            handles,
            spared: Vec::new(),
        }
    }

    /// Leaves `keep` out of the target, now and when a cgroup is listed again: the caller of a
    /// preStop stop of its own container (`cryo stop --self`) is in that container and waits
    /// for the answer. Only that very process (its pidfd): a process that later gets its pid is
    /// a member like any other.
    pub fn spare(&mut self, keep: ProcHandle) {
        self.handles.retain(|h| h.pid() != keep.pid());
        self.spared.push(keep);
    }

    /// Whether `pid` is a process left out by [`Resolved::spare`] (and still that process).
    pub fn spares(&self, pid: Pid) -> bool {
        self.spared.iter().any(|h| h.pid() == pid && h.is_alive())
    }

    /// What was named.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// Every process, the root of a tree first.
    pub fn handles(&self) -> &[ProcHandle] {
        &self.handles
    }

    /// Every process, the root of a tree first, handed over.
    pub fn into_handles(self) -> Vec<ProcHandle> {
        self.handles
    }

    /// The root of a tree (`None` for another kind of target).
    pub fn root(&self) -> Option<&ProcHandle> {
        match self.target {
            Target::Tree(root) => self.handles.iter().find(|h| h.pid() == root),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// Issue 9 item 1: a thread id stands for its process, as it does for the driver (main
    /// refused it as "no such process", or let a driver call act on the whole process under a
    /// thread's name).
    #[test]
    fn a_thread_id_resolves_to_its_process() {
        let thread = cryo_testkit::procs::Thread::start();
        let tid = thread.tid;
        let me = Pid::try_from(std::process::id()).unwrap();
        assert_ne!(tid, me);
        let r = Target::Pids(vec![tid, me]).resolve().unwrap();
        let pids: Vec<Pid> = r.handles().iter().map(ProcHandle::pid).collect();
        assert_eq!(pids, vec![me]);
    }
}
