//! Reads of `/proc` by bare pid (see the crate docs for who may use them) and of system-wide files.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};

use procfs::process::Process;

use crate::fds::{DriverFiles, Fd};
use crate::handle::Liveness;
use crate::{Pid, ProcError};

/// The fields of `/proc/PID/stat` cryo uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stat {
    /// Process id.
    pub pid: Pid,
    /// Command name (`comm`).
    pub comm: String,
    /// State letter (`R`, `S`, `Z`, `t`...).
    pub state: char,
    /// Parent pid.
    pub ppid: Pid,
    /// Process group id.
    pub pgrp: Pid,
    /// Session id.
    pub session: Pid,
    /// Start time in clock ticks since boot: with the pid, identifies a process.
    pub start_time: u64,
    /// Resident pages.
    pub rss_pages: u64,
    /// Exit code as `waitpid` would report it; meaningful only for a zombie.
    pub exit_code: Option<i32>,
}

impl From<procfs::process::Stat> for Stat {
    fn from(s: procfs::process::Stat) -> Self {
        Stat {
            pid: s.pid,
            comm: s.comm,
            state: s.state,
            ppid: s.ppid,
            pgrp: s.pgrp,
            session: s.session,
            start_time: s.starttime,
            rss_pages: s.rss,
            exit_code: s.exit_code,
        }
    }
}

/// The fields of `/proc/PID/status` (or of one thread, `/proc/TID/status`) cryo uses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// `State:` letter (`t` = ptrace stop, `T` = stopped, `Z` zombie...).
    pub state: char,
    /// The thread group (process) this task belongs to.
    pub tgid: Pid,
    /// The task's own id (a thread id for a thread).
    pub pid: Pid,
    /// Parent pid.
    pub ppid: Pid,
    /// 0 when untraced; else the tracer *thread* id.
    pub tracer_pid: Pid,
    /// The task's id in each pid namespace it is in, outermost (ours) first.
    pub nspid: Vec<Pid>,
    /// Signals pending for this thread (not the shared queue), bit `n-1` for signal `n`.
    pub sig_pending: u64,
    /// Signals set to `SIG_IGN`.
    pub sig_ignored: u64,
    /// Signals with a handler installed; shared by all threads.
    pub sig_caught: u64,
    /// The number of threads of the process the task belongs to.
    pub threads: u64,
}

impl From<procfs::process::Status> for Status {
    fn from(s: procfs::process::Status) -> Self {
        Status {
            state: s.state.chars().next().unwrap_or('?'),
            tgid: s.tgid,
            pid: s.pid,
            ppid: s.ppid,
            tracer_pid: s.tracerpid,
            nspid: s.nspid.unwrap_or_else(|| vec![s.pid]),
            sig_pending: s.sigpnd,
            sig_ignored: s.sigign,
            sig_caught: s.sigcgt,
            threads: s.threads,
        }
    }
}

pub(crate) fn process(pid: Pid) -> Result<Process, ProcError> {
    if pid <= 0 {
        return Err(ProcError::NoSuchProcess(pid));
    }
    Process::new(pid).map_err(|e| ProcError::read(pid, "", e))
}

/// Reads `/proc/PID/stat`.
pub fn stat(pid: Pid) -> Result<Stat, ProcError> {
    let s = process(pid)?
        .stat()
        .map_err(|e| ProcError::read(pid, "stat", e))?;
    Ok(s.into())
}

/// Where in the kernel `pid` waits (`/proc/PID/wchan`: the function of its wait, such as
/// `request_wait_answer` for a FUSE request or `folio_wait_bit_common` for a page of a hung
/// disk; `0` while it runs).
pub fn wchan(pid: Pid) -> Result<String, ProcError> {
    process(pid)?
        .wchan()
        .map_err(|e| ProcError::read(pid, "wchan", e))
}

/// One thread's name and CPU time so far (`/proc/PID/task/TID/schedstat`: time on a CPU, ns).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ThreadCpu {
    /// The thread.
    pub tid: Pid,
    /// Its name (`comm`, at most 15 bytes).
    pub comm: String,
    /// Nanoseconds it ran on a CPU.
    pub cpu_ns: u64,
}

/// Every live thread of `pid` with its CPU time so far (threads that ended are not counted;
/// a thread that ends while listed is left out).
pub fn threads_cpu(pid: Pid) -> Result<Vec<ThreadCpu>, ProcError> {
    let tasks = process(pid)?
        .tasks()
        .map_err(|e| ProcError::read(pid, "task", e))?;
    let mut out = Vec::new();
    for t in tasks.flatten() {
        let (Ok(sched), Ok(stat)) = (t.schedstat(), t.stat()) else {
            continue;
        };
        out.push(ThreadCpu {
            tid: t.tid,
            comm: stat.comm,
            cpu_ns: sched.sum_exec_runtime,
        });
    }
    Ok(out)
}

/// Pins every thread of `pid` to the CPUs `cpus` (threads it starts later inherit their
/// creator's).
pub fn pin_to_cpus(pid: Pid, cpus: impl IntoIterator<Item = usize>) -> Result<(), ProcError> {
    let tasks = process(pid)?
        .tasks()
        .map_err(|e| ProcError::read(pid, "task", e))?;
    let mut set = rustix::process::CpuSet::new();
    for cpu in cpus {
        set.set(cpu);
    }
    for t in tasks.flatten() {
        let tid = rustix::process::Pid::from_raw(t.tid).ok_or(ProcError::NoSuchProcess(t.tid))?;
        rustix::process::sched_setaffinity(Some(tid), &set)
            .map_err(|e| ProcError::os("sched_setaffinity", t.tid, e.into()))?;
    }
    Ok(())
}

/// Reads `/proc/TID/status` (any thread id works, listed in `/proc` or not).
pub fn status(tid: Pid) -> Result<Status, ProcError> {
    let s = process(tid)?
        .status()
        .map_err(|e| ProcError::read(tid, "status", e))?;
    Ok(s.into())
}

/// The thread group (process) `pid` belongs to: itself for a process, its process for a thread.
/// `None` when no such process or thread exists.
pub fn tgid(pid: Pid) -> Result<Option<Pid>, ProcError> {
    match status(pid) {
        Ok(s) => Ok(Some(s.tgid)),
        Err(ProcError::NoSuchProcess(_)) => Ok(None),
        Err(e) => Err(e),
    }
}

/// A kind of namespace a process is in (`/proc/PID/ns/KIND`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NamespaceKind {
    /// Its pid namespace: the pids it sees and is seen by.
    Pid,
    /// Its cgroup namespace: the root its `/proc/PID/cgroup` paths are relative to.
    Cgroup,
    /// Its network namespace: the addresses it listens on, its abstract unix sockets.
    Net,
}

impl NamespaceKind {
    fn file(self) -> &'static str {
        match self {
            NamespaceKind::Pid => "pid",
            NamespaceKind::Cgroup => "cgroup",
            NamespaceKind::Net => "net",
        }
    }
}

/// Whether processes `a` and `b` are in the same namespace of `kind` (the same device and inode
/// behind `/proc/PID/ns/KIND`).
pub fn same_namespace(a: Pid, b: Pid, kind: NamespaceKind) -> Result<bool, ProcError> {
    let id = |pid: Pid| -> Result<(u64, u64), ProcError> {
        let all = process(pid)?
            .namespaces()
            .map_err(|e| ProcError::read(pid, "ns", e))?;
        all.0
            .get(std::ffi::OsStr::new(kind.file()))
            .map(|ns| (ns.device_id, ns.identifier))
            .ok_or_else(|| {
                let path = format!("/proc/{pid}/ns/{}", kind.file());
                ProcError::read(pid, "ns", procfs::ProcError::NotFound(Some(path.into())))
            })
    };
    Ok(id(a)? == id(b)?)
}

/// Whether the task `tid` (a process or a thread) runs the same executable file as this process:
/// how cryo tells its own guard (the same `cryo` binary, or the same test binary) from a
/// debugger among the tracers of a process. `false` when either cannot be read.
pub fn runs_our_executable(tid: Pid) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |path: String| std::fs::metadata(path).map(|m| (m.dev(), m.ino()));
    match (
        id(format!("/proc/{tid}/exe")),
        id("/proc/self/exe".to_string()),
    ) {
        (Ok(a), Ok(b)) => a == b,
        _ => false,
    }
}

/// Whether `pid` runs, is a zombie, or is gone. A bare pid can be reused: holders of a
/// [`crate::ProcHandle`] ask it instead.
pub fn liveness(pid: Pid) -> Liveness {
    match stat(pid) {
        Err(_) => Liveness::Gone,
        Ok(st) if matches!(st.state, 'Z' | 'X') => Liveness::Zombie,
        Ok(_) => Liveness::Alive,
    }
}

/// The open fds of `pid` (`/proc/PID/fd`), ascending. An fd closed between listing and reading
/// its link is left out (the table changes under us).
pub fn fds(pid: Pid) -> Result<Vec<Fd>, ProcError> {
    fds_of(&process(pid)?, pid)
}

/// Every process (pid as this process's `/proc` shows it) holding at least one of `files`, in
/// ascending order: the guard's scan for CUDA processes that NVML may not list. A process whose
/// fd table cannot be read (it exited meanwhile) is left out.
pub fn driver_file_holders(files: DriverFiles<'_>) -> Result<Vec<Pid>, ProcError> {
    let all =
        procfs::process::all_processes().map_err(|e| ProcError::read(0, "the process list", e))?;
    let mut out: Vec<Pid> = all
        .flatten()
        .filter(|p| {
            fds_of(p, p.pid()).is_ok_and(|f| f.iter().any(|f| files.is_driver_file(&f.target)))
        })
        .map(|p| p.pid())
        .collect();
    out.sort_unstable();
    Ok(out)
}

pub(crate) fn fds_of(p: &Process, pid: Pid) -> Result<Vec<Fd>, ProcError> {
    let mut out = Vec::new();
    for info in p.fd().map_err(|e| ProcError::read(pid, "fd", e))? {
        match info {
            Ok(i) => out.push(Fd {
                fd: i.fd,
                target: i.target,
            }),
            Err(procfs::ProcError::NotFound(_)) => {}
            Err(e) => return Err(ProcError::read(pid, "fd", e)),
        }
    }
    out.sort_unstable_by_key(|f| f.fd);
    Ok(out)
}

pub(crate) fn tasks_of(p: &Process, pid: Pid) -> Result<Vec<Pid>, ProcError> {
    let mut out = Vec::new();
    for task in p.tasks().map_err(|e| ProcError::read(pid, "task", e))? {
        match task {
            Ok(t) => out.push(t.tid),
            Err(procfs::ProcError::NotFound(_)) => {}
            Err(e) => return Err(ProcError::read(pid, "task", e)),
        }
    }
    out.sort_unstable();
    Ok(out)
}

/// The processes whose command line names `dir` or a path under it, as an argument of its
/// own (CRIU's, whose arguments name the run's private directory: CRIU itself and what it
/// forked or restored before its restorer replaced their memory). A process may write any
/// command line: callers use this only for what a match could cost the matching process itself.
pub fn naming(dir: &std::path::Path) -> Result<Vec<Pid>, ProcError> {
    let Some(dir) = dir.to_str() else {
        return Ok(Vec::new());
    };
    let under = format!("{}/", dir.trim_end_matches('/'));
    let all = procfs::process::all_processes()
        .map_err(|source| ProcError::ReadSystem { file: "", source })?;
    // Processes vanish while we scan; that is not an error.
    Ok(all
        .flatten()
        .filter(|p| {
            p.cmdline()
                .is_ok_and(|c| c.iter().any(|a| a == dir || a.starts_with(&under)))
        })
        .map(|p| p.pid)
        .collect())
}

/// Every process in the tree rooted at `root`, parents before children (root first).
pub fn tree(root: Pid) -> Result<Vec<Pid>, ProcError> {
    stat(root)?;
    let mut children: BTreeMap<Pid, Vec<Pid>> = BTreeMap::new();
    let all = procfs::process::all_processes()
        .map_err(|source| ProcError::ReadSystem { file: "", source })?;
    for p in all.flatten() {
        // Processes vanish while we scan; that is not an error.
        if let Ok(st) = p.stat() {
            children.entry(st.ppid).or_default().push(st.pid);
        }
    }
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        out.push(p);
        if let Some(kids) = children.get_mut(&p) {
            kids.sort_unstable();
            queue.extend(kids.iter().copied());
        }
    }
    Ok(out)
}

/// Every process whose session id is one of `sessions` now (a scan of `/proc`; a process that
/// exits meanwhile is left out). Bare pids: [`crate::ProcHandle::in_sessions`] opens and checks
/// them.
pub(crate) fn in_sessions(sessions: &[Pid]) -> Result<Vec<Pid>, ProcError> {
    let all = procfs::process::all_processes()
        .map_err(|source| ProcError::ReadSystem { file: "", source })?;
    Ok(all
        .flatten()
        .filter_map(|p| p.stat().ok())
        .filter(|st| sessions.contains(&st.session))
        .map(|st| st.pid)
        .collect())
}

/// The pids of `wanted` that the kernel still has allocated: as a process or thread id, or as
/// the process group or session id of any process. CRIU restores every process with its
/// original pid and fails with `EEXIST` ("Can't fork for N: File exists") on any of these. A
/// dumped tree's pids stay taken until its last member is reaped, including members reparented
/// to an init that reaps lazily, so thaw prechecks and tests wait on this, not on the root's exit.
pub fn pids_in_use(wanted: &[Pid]) -> Vec<Pid> {
    let wanted: BTreeSet<Pid> = wanted.iter().copied().collect();
    let Ok(all) = procfs::process::all_processes() else {
        // Without /proc nothing can be ruled out: report everything as taken.
        return wanted.into_iter().collect();
    };
    // A process or thread id: `/proc/ID` is there for every task the kernel has, threads
    // (which `/proc` does not list) and zombies included. One lookup per wanted id instead
    // of listing every thread of the host (issue 16: the thaw's precheck walked every task
    // directory before CRIU could start).
    let mut busy: BTreeSet<Pid> = wanted
        .iter()
        .copied()
        .filter(|id| std::fs::symlink_metadata(format!("/proc/{id}")).is_ok())
        .collect();
    // A group or session id outlives its leader while a member lives: only the members'
    // `stat` says so.
    for p in all.flatten() {
        if let Ok(st) = p.stat() {
            busy.extend(
                [st.pgrp, st.session]
                    .into_iter()
                    .filter(|id| wanted.contains(id)),
            );
        }
    }
    busy.into_iter().collect()
}

/// Who holds a pid that [`pids_in_use`] reports taken.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum PidHolder {
    /// A live process (or one of its threads) has the pid.
    Live {
        /// The pid asked about.
        pid: Pid,
        /// The process holding it.
        process: Pid,
        /// Its command name.
        comm: String,
    },
    /// A process that has exited and that its parent has not reaped yet (a zombie): the pid is
    /// freed by the parent's `wait`, or when the parent exits and init reaps it.
    Zombie {
        /// The pid.
        pid: Pid,
        /// The parent that has not reaped it.
        parent: Pid,
        /// The parent's command name (empty when it cannot be read).
        parent_comm: String,
    },
    /// The pid is the process group or session id of a live process.
    Group {
        /// The pid.
        pid: Pid,
        /// A process in that group or session.
        member: Pid,
    },
}

impl PidHolder {
    /// The pid held.
    pub fn pid(&self) -> Pid {
        match self {
            PidHolder::Live { pid, .. }
            | PidHolder::Zombie { pid, .. }
            | PidHolder::Group { pid, .. } => *pid,
        }
    }

    /// Whether only an unreaped exit holds it (it frees itself once reaped).
    pub fn is_zombie(&self) -> bool {
        matches!(self, PidHolder::Zombie { .. })
    }
}

impl std::fmt::Display for PidHolder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PidHolder::Live { pid, process, comm } if pid == process => {
                write!(f, "pid {pid} is a live process ({comm})")
            }
            PidHolder::Live { pid, process, comm } => {
                write!(f, "pid {pid} is a thread of live process {process} ({comm})")
            }
            PidHolder::Zombie {
                pid,
                parent,
                parent_comm,
            } => write!(
                f,
                "pid {pid} has exited but its parent, pid {parent} ({parent_comm}), has not reaped it"
            ),
            PidHolder::Group { pid, member } => {
                write!(f, "pid {pid} is the process group or session of live process {member}")
            }
        }
    }
}

/// Who holds each of the pids of `wanted` that are taken (see [`pids_in_use`]): a live process,
/// a zombie whose parent has not reaped it, or a group or session. Pids freed meanwhile are left
/// out.
pub fn pid_holders(wanted: &[Pid]) -> Vec<PidHolder> {
    let mut out = Vec::new();
    for pid in pids_in_use(wanted) {
        let holder = match (stat(pid), tgid(pid)) {
            (Ok(st), Ok(Some(tgid))) if tgid == pid && matches!(st.state, 'Z' | 'X') => {
                PidHolder::Zombie {
                    pid,
                    parent: st.ppid,
                    parent_comm: stat(st.ppid).map(|p| p.comm).unwrap_or_default(),
                }
            }
            (_, Ok(Some(process))) => PidHolder::Live {
                pid,
                process,
                comm: stat(process).map(|p| p.comm).unwrap_or_default(),
            },
            _ => match group_member(pid) {
                Some(member) => PidHolder::Group { pid, member },
                // Freed since it was listed.
                None => continue,
            },
        };
        out.push(holder);
    }
    out
}

/// A process whose process group or session is `id`.
fn group_member(id: Pid) -> Option<Pid> {
    procfs::process::all_processes()
        .ok()?
        .flatten()
        .find_map(|p| {
            let st = p.stat().ok()?;
            (st.pgrp == id || st.session == id).then_some(p.pid())
        })
}

/// The largest pid the kernel hands out (`/proc/sys/kernel/pid_max`).
pub fn pid_max() -> Result<Pid, ProcError> {
    procfs::sys::kernel::pid_max().map_err(|source| ProcError::ReadSystem {
        file: "sys/kernel/pid_max",
        source,
    })
}

/// Listening unix sockets in the network namespace of process `pid` (`/proc/PID/net/unix`)
/// whose name starts with `prefix`: inode -> name. An abstract name lives in one network
/// namespace: a process in its own (a container) is seen only through its own view.
pub fn unix_listeners_of(pid: Pid, prefix: &str) -> Result<HashMap<u64, String>, ProcError> {
    let entries = process(pid)?
        .unix()
        .map_err(|e| ProcError::read(pid, "net/unix", e))?;
    Ok(entries
        .into_iter()
        // A listening socket is unconnected; the connections it accepted show its name too, but
        // connected.
        .filter(|e| e.state == procfs::net::UnixState::UNCONNECTED)
        .filter_map(|e| {
            let name = e.path?.to_str()?.to_string();
            name.starts_with(prefix).then_some((e.inode, name))
        })
        .collect())
}

/// The thread of process `pid` that its own pid namespace calls `ns_tid` (the last entry of its
/// `NSpid`), in cryo's pid namespace; `Ok(None)`: it has no such thread. A process in cryo's own
/// namespace names its threads as cryo does.
pub fn thread_named(pid: Pid, ns_tid: Pid) -> Result<Option<Pid>, ProcError> {
    let tasks = process(pid)?
        .tasks()
        .map_err(|e| ProcError::read(pid, "task", e))?;
    for t in tasks.flatten() {
        // Threads end while we look: not an error.
        let Ok(st) = t.status() else { continue };
        if st.nspid.as_ref().and_then(|n| n.last()) == Some(&ns_tid) {
            return Ok(Some(t.tid));
        }
    }
    Ok(None)
}

/// The children of the calling thread (`/proc/PID/task/TID/children`): the processes it started,
/// and those a child of it made its siblings (`CLONE_PARENT`, as CRIU's `--restore-sibling`
/// does with the root it restores). A child that exits while this reads may hide others
/// (procfs(5)): read it when the ones that matter are stuck or stopped.
pub fn thread_children() -> Result<Vec<Pid>, ProcError> {
    let me = Pid::try_from(std::process::id()).unwrap_or(Pid::MAX);
    let tid = rustix::thread::gettid().as_raw_nonzero().get();
    let task = process(me)?
        .task_from_tid(tid)
        .map_err(|e| ProcError::read(tid, "task", e))?;
    let children = task
        .children()
        .map_err(|e| ProcError::read(tid, "children", e))?;
    Ok(children
        .into_iter()
        .filter_map(|c| Pid::try_from(c).ok())
        .collect())
}

/// Memory the kernel can give new work without swapping (`MemAvailable` of `/proc/meminfo`),
/// bytes.
pub fn mem_available() -> Result<u64, ProcError> {
    use procfs::Current;
    let m = procfs::Meminfo::current().map_err(|source| ProcError::ReadSystem {
        file: "meminfo",
        source,
    })?;
    Ok(m.mem_available.unwrap_or(m.mem_free + m.cached))
}

/// The machine's memory pressure (PSI) file, for readers and triggers.
pub const SYSTEM_MEMORY_PRESSURE: &str = "/proc/pressure/memory";

/// The host's 1, 5 and 15 minute load averages (`/proc/loadavg`).
pub fn load_average() -> Result<[f64; 3], ProcError> {
    use procfs::Current;
    let l = procfs::LoadAverage::current().map_err(|source| ProcError::ReadSystem {
        file: "loadavg",
        source,
    })?;
    Ok([l.one.into(), l.five.into(), l.fifteen.into()])
}

/// Now, in clock ticks after boot (`/proc/uptime`, rounded down): comparable with a process's
/// or thread's start time ([`Stat::start_time`]). `None` if it cannot be read.
pub fn boot_ticks() -> Option<u64> {
    let up = std::fs::read_to_string("/proc/uptime").ok()?;
    let (secs, cs) = up.split_whitespace().next()?.split_once('.')?;
    let cs: u64 = format!("{cs:0<2}").get(..2)?.parse().ok()?;
    let centis = secs
        .parse::<u64>()
        .ok()?
        .checked_mul(100)?
        .checked_add(cs)?;
    Some(centis.checked_mul(procfs::ticks_per_second())? / 100)
}

/// This boot of the host (`/proc/sys/kernel/random/boot_id`): what a record about live
/// processes names so that it is not taken, after a reboot, for one about this boot's (pids and
/// start times from boot repeat across boots). `None` if the kernel does not say.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::time::Duration;

    fn me() -> Pid {
        Pid::try_from(std::process::id()).unwrap()
    }

    #[test]
    fn own_stat_status_and_fds() {
        let st = stat(me()).unwrap();
        assert_eq!(st.pid, me());
        assert_eq!(st.ppid, nix::unistd::getppid().as_raw());
        let s = status(me()).unwrap();
        assert_eq!((s.tgid, s.pid), (me(), me()));
        assert_eq!(s.nspid.first(), Some(&me()));
        assert_eq!(tgid(me()).unwrap(), Some(me()));
        let fds = fds(me()).unwrap();
        assert!(fds.windows(2).all(|w| w[0].fd < w[1].fd));
        assert!(fds.iter().any(|f| f.fd == 0));
        assert_eq!(liveness(me()), Liveness::Alive);
    }

    #[test]
    fn a_missing_pid_is_no_such_process() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as Pid;
        child.wait().unwrap();
        assert!(matches!(stat(pid), Err(ProcError::NoSuchProcess(p)) if p == pid));
        assert!(matches!(fds(pid), Err(ProcError::NoSuchProcess(_))));
        assert_eq!(tgid(pid).unwrap(), None);
        assert_eq!(liveness(pid), Liveness::Gone);
        assert!(matches!(stat(0), Err(ProcError::NoSuchProcess(0))));
    }

    #[test]
    fn a_zombie_is_a_zombie_until_reaped() {
        let mut child = Command::new("true").spawn().unwrap();
        let pid = child.id() as Pid;
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while liveness(pid) != Liveness::Zombie {
            assert!(std::time::Instant::now() < deadline, "never a zombie");
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(stat(pid).unwrap().exit_code, Some(0));
        child.wait().unwrap();
        assert_eq!(liveness(pid), Liveness::Gone);
    }

    #[test]
    fn a_zombie_holds_its_pid_and_names_the_parent_that_has_not_reaped_it() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as Pid;
        assert_eq!(
            pid_holders(&[pid]),
            vec![PidHolder::Live {
                pid,
                process: pid,
                comm: "sleep".into()
            }]
        );
        child.kill().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while liveness(pid) != Liveness::Zombie {
            assert!(std::time::Instant::now() < deadline, "never a zombie");
            std::thread::sleep(Duration::from_millis(2));
        }
        let held = pid_holders(&[pid]);
        assert_eq!(held.len(), 1, "{held:?}");
        match &held[0] {
            PidHolder::Zombie { pid: z, parent, .. } => {
                assert_eq!((*z, *parent), (pid, me()));
            }
            other => panic!("a zombie read as {other}"),
        }
        assert!(
            held[0].to_string().contains("has not reaped it"),
            "{}",
            held[0]
        );
        child.wait().unwrap();
        assert!(pid_holders(&[pid]).is_empty());
    }

    #[test]
    fn tree_lists_descendants_parent_first() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let root = child.id() as Pid;
        let mut pids = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while pids.len() != 3 && std::time::Instant::now() < deadline {
            pids = tree(root).unwrap();
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pids.len(), 3, "{pids:?}");
        assert_eq!(pids[0], root);
        for p in &pids[1..] {
            assert_eq!(stat(*p).unwrap().ppid, root);
            crate::ProcHandle::open(*p)
                .unwrap()
                .signal(crate::Signal::SIGKILL)
                .unwrap();
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    /// A thread's id is taken although `/proc` does not list it: CRIU cannot give it to a
    /// restored process; it is free once the thread has ended.
    #[test]
    fn a_thread_id_is_in_use_until_the_thread_ends() {
        let thread = cryo_testkit::procs::Thread::start();
        let tid = thread.tid;
        assert_ne!(tid, me());
        assert!(
            !std::fs::read_dir("/proc")
                .unwrap()
                .any(|e| e.unwrap().file_name().to_str() == Some(&tid.to_string())),
            "/proc lists thread {tid}"
        );
        assert_eq!(pids_in_use(&[tid]), vec![tid]);
        drop(thread);
        assert!(pids_in_use(&[tid]).is_empty());
    }

    #[test]
    fn own_pid_group_and_session_are_in_use_and_a_pid_past_the_max_is_not() {
        let pgrp = nix::unistd::getpgrp().as_raw();
        let sid = nix::unistd::getsid(None).unwrap().as_raw();
        let busy = pids_in_use(&[me(), pgrp, sid]);
        assert!(busy.contains(&me()) && busy.contains(&pgrp) && busy.contains(&sid));
        assert!(pids_in_use(&[pid_max().unwrap() + 1]).is_empty());
    }

    #[test]
    fn listening_unix_sockets_are_found_by_name_and_their_connections_are_not() {
        let name = format!("cryo-proc-test/{}", me());
        let addr = <std::os::unix::net::SocketAddr as std::os::linux::net::SocketAddrExt>::from_abstract_name(name.as_bytes()).unwrap();
        let l = std::os::unix::net::UnixListener::bind_addr(&addr).unwrap();
        let _c = std::os::unix::net::UnixStream::connect_addr(&addr).unwrap();
        let _s = l.accept().unwrap();
        let found = unix_listeners_of(me(), &format!("@{name}")).unwrap();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found.values().next().unwrap(), &format!("@{name}"));
        let own: Vec<u64> = fds(me())
            .unwrap()
            .into_iter()
            .filter_map(|f| match f.target {
                crate::FdTarget::Socket(i) => Some(i),
                _ => None,
            })
            .collect();
        assert!(own.contains(found.keys().next().unwrap()));
    }

    #[test]
    fn load_average_reads() {
        assert!(load_average().unwrap().iter().all(|l| *l >= 0.0));
    }
}
