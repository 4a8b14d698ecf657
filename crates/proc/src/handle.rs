//! [`ProcHandle`]: a process held through a pidfd.

use std::io::{Read, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

use procfs::process::Process;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_getfd, pidfd_open, Pid as RPid, PidfdFlags, PidfdGetfdFlags};

use crate::cgroup::{CgroupEntry, Cgroups};
use crate::fds::{driver_fds, DriverFiles, Fd};
use crate::read::{self, Stat, Status};
use crate::{OomAdjError, Pid, ProcError, Signal};

/// What [`ProcHandle::unpin`] found and did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unpinned {
    /// It was still pinned: its own CPU set is back.
    Returned,
    /// It already had its own CPU set (given back before).
    Already,
    /// Someone changed its CPU set since the pin (to this one): left as it is.
    Changed(nix::sched::CpuSet),
}

/// Whether a process still runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Liveness {
    /// It has not exited.
    Alive,
    /// It has exited and is not reaped yet: no fd table, no threads, but its pid is still taken
    /// (and a tracer sees it first: its real parent reaps it later).
    Zombie,
    /// Reaped (or never existed): its pid may name another process now.
    Gone,
}

/// `PIDFS_MAGIC`: the file system of pidfds from Linux 6.9.
const PIDFS_MAGIC: i64 = 0x5049_4446;

/// The inode of a pidfd on pidfs; `None` elsewhere (see [`ProcHandle::pidfs_inode`]).
fn inode_on_pidfs(pidfd: BorrowedFd<'_>) -> Option<u64> {
    let fs = rustix::fs::fstatfs(pidfd).ok()?;
    #[allow(clippy::unnecessary_cast)]
    if fs.f_type as i64 != PIDFS_MAGIC {
        return None;
    }
    let st = rustix::fs::fstat(pidfd).ok()?;
    // `st_ino`'s type differs between architectures.
    #[allow(clippy::unnecessary_cast, clippy::useless_conversion)]
    Some(st.st_ino as u64)
}

/// The pidfs inode of the process that holds `pid` now, zombie or not (see
/// [`ProcHandle::pidfs_inode`]); `None` when it is gone, is a thread, or the kernel has no pidfs.
/// The caller checks that the pid still names the process it meant after the call.
pub fn pidfs_inode(pid: Pid) -> Option<u64> {
    let rpid = RPid::from_raw(pid)?;
    let pidfd = pidfd_open(rpid, PidfdFlags::empty()).ok()?;
    inode_on_pidfs(pidfd.as_fd())
}

/// A process held through a pidfd.
#[derive(Debug)]
pub struct ProcHandle {
    pid: Pid,
    start_time: u64,
    comm: String,
    pidfd: OwnedFd,
}

impl ProcHandle {
    /// Opens the process that holds `pid` now. A pid that names a thread, or a process that has
    /// already exited (a zombie), is [`ProcError::NoSuchProcess`].
    pub fn open(pid: Pid) -> Result<Self, ProcError> {
        let rpid = RPid::from_raw(pid).ok_or(ProcError::NoSuchProcess(pid))?;
        let pidfd = pidfd_open(rpid, PidfdFlags::empty()).map_err(|e| match e {
            // ENOENT (EINVAL before Linux 6.9): a thread id, not a process.
            rustix::io::Errno::SRCH | rustix::io::Errno::NOENT | rustix::io::Errno::INVAL => {
                ProcError::NoSuchProcess(pid)
            }
            e => ProcError::os("pidfd_open", pid, e.into()),
        })?;
        let st = read::stat(pid)?;
        let handle = ProcHandle {
            pid,
            start_time: st.start_time,
            comm: st.comm,
            pidfd,
        };
        // The stat read belongs to the pidfd's process only if that process was still alive after
        // the read: then the pid cannot have been reused in between.
        if !handle.is_alive() {
            return Err(ProcError::NoSuchProcess(pid));
        }
        Ok(handle)
    }

    /// The inode of its pidfd where pidfds live on pidfs (Linux 6.9+): unique to this process
    /// for as long as the system runs, never reused with its pid. `None` on older kernels (an
    /// anonymous inode, shared by every pidfd).
    pub fn pidfs_inode(&self) -> Option<u64> {
        inode_on_pidfs(self.pidfd.as_fd())
    }

    /// Opens `pid` only if it is still the process that started at `start_time`.
    pub fn open_expected(pid: Pid, start_time: u64) -> Result<Self, ProcError> {
        let h = Self::open(pid)?;
        if h.start_time != start_time {
            return Err(ProcError::Reused {
                pid,
                expected: start_time,
                found: h.start_time,
            });
        }
        Ok(h)
    }

    /// A second handle on the same process (a duplicate of the pidfd), for a component that must
    /// own one (the guard's tracer) while another keeps this one.
    pub fn try_clone(&self) -> Result<Self, ProcError> {
        let pidfd = self
            .pidfd
            .try_clone()
            .map_err(|e| ProcError::os("duplicating the pidfd", self.pid, e))?;
        Ok(ProcHandle {
            pid: self.pid,
            start_time: self.start_time,
            comm: self.comm.clone(),
            pidfd,
        })
    }

    /// The pid.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Start time in clock ticks since boot.
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    /// Command name, as it was when the handle was opened.
    pub fn comm(&self) -> &str {
        &self.comm
    }

    /// The pidfd.
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// Its network namespace to connect from, when it is not cryo's own (`None`: it is): a
    /// duplicate of the pidfd, which `setns(2)` enters while the process lives (a reused pid can
    /// never stand in for it). See [`crate::in_net_namespace`].
    pub fn net_namespace(&self) -> Result<Option<OwnedFd>, ProcError> {
        // A pid always fits (the kernel's are below 2^22).
        let me = Pid::try_from(std::process::id()).unwrap_or(Pid::MAX);
        if read::same_namespace(self.pid, me, crate::NamespaceKind::Net)? {
            return Ok(None);
        }
        // The answer above is about this process only while it is alive (its pid is not reused
        // before it is reaped).
        if !self.is_alive() {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        self.pidfd
            .try_clone()
            .map(Some)
            .map_err(|e| ProcError::os("duplicating the pidfd", self.pid, e))
    }

    /// Whether the process has not exited yet (a zombie counts as exited).
    pub fn is_alive(&self) -> bool {
        !self.poll_exit(Duration::ZERO)
    }

    /// The CPUs its main thread may run on (`sched_getaffinity`).
    pub fn affinity(&self) -> Result<nix::sched::CpuSet, ProcError> {
        let cpus = nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(self.pid))
            .map_err(|e| ProcError::os("sched_getaffinity", self.pid, e.into()))?;
        // By pid: only this process's answer while its pid is still its own.
        if self.liveness() == Liveness::Gone {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        Ok(cpus)
    }

    /// Lets its main thread run on `cpus` only (`sched_setaffinity`). The kernel takes a pid,
    /// not a pidfd: the call reached this process if its pid was still its own afterwards (alive
    /// or a zombie); reaped by then, it is [`ProcError::NoSuchProcess`] (the pid may have named
    /// another process).
    pub fn set_affinity(&self, cpus: &nix::sched::CpuSet) -> Result<(), ProcError> {
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(self.pid), cpus)
            .map_err(|e| ProcError::os("sched_setaffinity", self.pid, e.into()))?;
        if self.liveness() == Liveness::Gone {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        Ok(())
    }

    /// Gives its main thread `cpus` back if it may still run on `pinned` only, the set this
    /// process was given by whoever pinned it: a set anyone else changed since (Kubernetes' CPU
    /// manager rewrites cpusets; the process may set its own) is theirs, and left as it is.
    /// One look, then one call: a change that falls between them is overwritten (the kernel
    /// has no compare-and-set of an affinity). By pid, as [`ProcHandle::set_affinity`]: checked
    /// against the pidfd before and after.
    pub fn unpin(
        &self,
        pinned: &nix::sched::CpuSet,
        cpus: &nix::sched::CpuSet,
    ) -> Result<Unpinned, ProcError> {
        let now = self.affinity()?;
        if now == *cpus {
            return Ok(Unpinned::Already);
        }
        if now != *pinned {
            return Ok(Unpinned::Changed(now));
        }
        self.set_affinity(cpus)?;
        Ok(Unpinned::Returned)
    }

    /// What inherited a pin of its main thread (a thread takes its creator's CPU set, a child
    /// its parent's): gives `cpus` back to each of its other threads, and to each thread of
    /// each of its descendants, that started at or after `since` (clock ticks after boot, as
    /// [`ProcHandle::start_time`]) and whose set is still exactly `pinned` (one whose set
    /// someone changed since is left). Returns how many were given back. By thread id: each
    /// call is made while the thread is listed under its process with the start time read,
    /// and counted only if it still is afterwards (a thread's id is free for reuse as soon as
    /// it exits: a thread that ends between the look and the call may let the call reach
    /// whatever took its id).
    pub fn unpin_inherited(
        &self,
        pinned: &nix::sched::CpuSet,
        cpus: &nix::sched::CpuSet,
        since: u64,
    ) -> usize {
        let mut n = self.unpin_threads(pinned, cpus, since, false);
        for d in self.descendants().iter().filter(|d| d.start_time >= since) {
            n += d.unpin_threads(pinned, cpus, since, true);
        }
        n
    }

    /// [`ProcHandle::unpin_inherited`] for its own threads (its main thread too if `main`).
    fn unpin_threads(
        &self,
        pinned: &nix::sched::CpuSet,
        cpus: &nix::sched::CpuSet,
        since: u64,
        main: bool,
    ) -> usize {
        let Ok(dir) = self.dir() else { return 0 };
        let Ok(tasks) = dir.tasks() else { return 0 };
        let mut n = 0;
        for t in tasks.flatten() {
            if t.tid == self.pid && !main {
                continue;
            }
            let Ok(start) = t.stat().map(|s| s.starttime) else {
                continue;
            };
            let still = || t.stat().is_ok_and(|s| s.starttime == start);
            let tid = nix::unistd::Pid::from_raw(t.tid);
            if start < since || nix::sched::sched_getaffinity(tid).ok() != Some(*pinned) {
                continue;
            }
            if still() && nix::sched::sched_setaffinity(tid, cpus).is_ok() && still() {
                n += 1;
            }
        }
        n
    }

    /// Alive, a zombie (exited, not reaped), or gone (reaped: its pid is free for reuse).
    pub fn liveness(&self) -> Liveness {
        if self.is_alive() {
            Liveness::Alive
        } else if crate::sys::pidfd_send_signal(self.pidfd(), 0).is_ok() {
            Liveness::Zombie
        } else {
            Liveness::Gone
        }
    }

    /// Waits up to `timeout` for the process to exit; true when it has.
    pub fn wait_exit(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if self.poll_exit(left) {
                return true;
            }
            if left.is_zero() {
                return false;
            }
        }
    }

    fn poll_exit(&self, timeout: Duration) -> bool {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        let mut fds = [PollFd::new(&self.pidfd, PollFlags::IN)];
        match poll(&mut fds, ms) {
            Ok(n) => n > 0 && fds[0].revents().intersects(PollFlags::IN | PollFlags::HUP),
            // EINTR: report "not yet"; callers loop on their own deadline.
            Err(_) => false,
        }
    }

    /// Sends `signal` to this process (never to a process that reused its pid).
    pub fn signal(&self, signal: Signal) -> Result<(), ProcError> {
        crate::sys::pidfd_send_signal(self.pidfd(), signal as i32)
            .map_err(|e| ProcError::os("pidfd_send_signal", self.pid, e))
    }

    /// A duplicate of fd `fd` of this process (`pidfd_getfd`). Needs ptrace-attach rights over
    /// the process; works at the exit stop, where the fd table is still intact.
    pub fn get_fd(&self, fd: RawFd) -> Result<OwnedFd, ProcError> {
        pidfd_getfd(self.pidfd(), fd, PidfdGetfdFlags::empty()).map_err(|e| ProcError::GetFd {
            pid: self.pid,
            fd,
            source: e.into(),
        })
    }

    /// Whether its fd `fd` is our `dup` (the same open file description: `kcmp(KCMP_FILE)`), as
    /// opposed to another file, or another open of the same device, at that number now. Needs
    /// ptrace-attach rights over the process, as [`ProcHandle::get_fd`].
    pub fn same_file(&self, fd: RawFd, dup: BorrowedFd<'_>) -> Result<bool, ProcError> {
        crate::sys::kcmp_same_file(self.pid, fd, dup)
            .map_err(|e| ProcError::os("kcmp", self.pid, e))
    }

    /// The system call each of its threads is blocked in now, from `/proc/PID/task/TID/syscall`:
    /// `(tid, Some(number))`, or `(tid, None)` for a thread that is running (the kernel names the
    /// call only of a thread that is not) or in none (`-1` is reported as `Some(-1)`). A
    /// multi-threaded `execve` kills every other thread first (its thread-group leader
    /// included, whose exit stop a tracer sees while the fd table is still intact) and waits for
    /// them blocked in the call: this tells such an exit from a real one.
    pub fn thread_syscalls(&self) -> Result<Vec<(Pid, Option<i64>)>, ProcError> {
        let mut out = Vec::new();
        for tid in self.tasks()? {
            let path = format!("/proc/{}/task/{tid}/syscall", self.pid);
            // Gone since listed: not a thread any more.
            let Ok(text) = std::fs::read_to_string(&path) else {
                continue;
            };
            let nr = text
                .split_whitespace()
                .next()
                .and_then(|w| w.parse::<i64>().ok());
            out.push((tid, nr));
        }
        if self.liveness() == Liveness::Gone {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        Ok(out)
    }

    /// Duplicates of each fd in `fds`: what could be taken and what failed (an fd closed since
    /// it was listed fails with `EBADF`).
    pub fn get_fds(&self, fds: &[RawFd]) -> (Vec<(RawFd, OwnedFd)>, Vec<ProcError>) {
        let mut got = Vec::with_capacity(fds.len());
        let mut failed = Vec::new();
        for &fd in fds {
            match self.get_fd(fd) {
                Ok(dup) => got.push((fd, dup)),
                Err(e) => failed.push(e),
            }
        }
        (got, failed)
    }

    /// `/proc/PID`, opened while this handle's process was not yet reaped, so that everything read
    /// through it is that process's and never a later holder of the pid's.
    fn dir(&self) -> Result<Process, ProcError> {
        let dir = read::process(self.pid)?;
        if self.liveness() == Liveness::Gone {
            return Err(ProcError::NoSuchProcess(self.pid));
        }
        Ok(dir)
    }

    /// `/proc/PID/stat` now.
    pub fn stat(&self) -> Result<Stat, ProcError> {
        let s = self
            .dir()?
            .stat()
            .map_err(|e| ProcError::read(self.pid, "stat", e))?;
        Ok(s.into())
    }

    /// `/proc/PID/status` now (state, tgid, tracer, pid namespaces, signal masks).
    pub fn status(&self) -> Result<Status, ProcError> {
        let s = self
            .dir()?
            .status()
            .map_err(|e| ProcError::read(self.pid, "status", e))?;
        Ok(s.into())
    }

    /// `/proc/PID/task/TID/status` of one of its threads.
    pub fn thread_status(&self, tid: Pid) -> Result<Status, ProcError> {
        let task = self
            .dir()?
            .task_from_tid(tid)
            .map_err(|e| ProcError::read(tid, "task", e))?;
        let s = task
            .status()
            .map_err(|e| ProcError::read(tid, "status", e))?;
        Ok(s.into())
    }

    /// The thread id tracing it, `None` when it is not traced.
    pub fn tracer(&self) -> Result<Option<Pid>, ProcError> {
        let t = self.status()?.tracer_pid;
        Ok((t != 0).then_some(t))
    }

    /// Its thread group id: the pid itself (a pidfd names a process, never a lone thread).
    pub fn tgid(&self) -> Result<Pid, ProcError> {
        Ok(self.status()?.tgid)
    }

    /// Resident memory, bytes.
    pub fn rss(&self) -> Result<u64, ProcError> {
        let pages = self
            .dir()?
            .statm()
            .map_err(|e| ProcError::read(self.pid, "statm", e))?
            .resident;
        Ok(pages.saturating_mul(procfs::page_size()))
    }

    /// Its command line, split at NULs (empty for a zombie or a kernel thread).
    pub fn cmdline(&self) -> Result<Vec<String>, ProcError> {
        self.dir()?
            .cmdline()
            .map_err(|e| ProcError::read(self.pid, "cmdline", e))
    }

    /// The file it executes (`/proc/PID/exe`), as the kernel names it (one deleted or
    /// replaced since ends in ` (deleted)`).
    pub fn exe(&self) -> Result<std::path::PathBuf, ProcError> {
        self.dir()?
            .exe()
            .map_err(|e| ProcError::read(self.pid, "exe", e))
    }

    /// Its open fds, ascending.
    pub fn fds(&self) -> Result<Vec<Fd>, ProcError> {
        read::fds_of(&self.dir()?, self.pid)
    }

    /// The files it maps (`/proc/PID/maps`), each once, as the kernel names them (a file
    /// unlinked since ends in ` (deleted)`).
    pub fn mapped_files(&self) -> Result<Vec<std::path::PathBuf>, ProcError> {
        let maps = self
            .dir()?
            .maps()
            .map_err(|e| ProcError::read(self.pid, "maps", e))?;
        let mut files: Vec<std::path::PathBuf> = maps
            .0
            .into_iter()
            .filter_map(|m| match m.pathname {
                procfs::process::MMapPath::Path(p) => Some(p),
                _ => None,
            })
            .collect();
        files.sort();
        files.dedup();
        Ok(files)
    }

    /// Puts back in transparent huge pages the anonymous memory the process asked huge pages for
    /// (`MADV_HUGEPAGE`: `hg` in `/proc/PID/smaps`) and holds in small pages, as after a CRIU
    /// restore, which writes every page back 4 KiB at a time: `process_madvise(MADV_COLLAPSE)`,
    /// synchronous, best effort (a range the kernel cannot collapse now, for lack of free huge
    /// pages, is left as it is). Returns the bytes backed by huge pages afterwards. Needs Linux
    /// 6.1 (`MADV_COLLAPSE`).
    pub fn collapse_huge_pages(&self) -> Result<u64, ProcError> {
        const HUGE: u64 = 2 << 20;
        // process_madvise moves at most MAX_RW_COUNT (2 GiB - 4 KiB) per call.
        const CHUNK: u64 = 1 << 30;
        const COLLAPSE_TRIES: usize = 4;
        let maps = self
            .dir()?
            .smaps()
            .map_err(|e| ProcError::read(self.pid, "smaps", e))?;
        let mut huge = 0;
        for m in maps.0 {
            let anonymous = matches!(
                m.pathname,
                procfs::process::MMapPath::Anonymous | procfs::process::MMapPath::Heap
            );
            let asked = m.extension.vm_flags.contains(procfs::process::VmFlags::HG);
            let had = m.extension.map.get("AnonHugePages").copied().unwrap_or(0);
            let (start, end) = (
                m.address.0.next_multiple_of(HUGE),
                m.address.1 & !(HUGE - 1),
            );
            if !anonymous || !asked || end <= start || had >= end - start {
                huge += had;
                continue;
            }
            let mut at = start;
            while at < end {
                let len = (end - at).min(CHUNK);
                // Best effort: ENOMEM (no huge page free now) or EINVAL (a kernel before 6.1)
                // leave the range as it is; the bytes returned say what was achieved. EAGAIN is
                // the kernel's transient failure (a page locked or isolated by compaction or
                // reclaim at that moment): tried again, a bounded number of times (a landing
                // under load once ended with no huge page at all).
                for _ in 0..COLLAPSE_TRIES {
                    match crate::sys::process_madvise_collapse(self.pidfd.as_fd(), at, len) {
                        Err(e) if e.raw_os_error() == Some(libc::EAGAIN) => continue,
                        _ => break,
                    }
                }
                at += len;
            }
        }
        let after = self
            .dir()?
            .smaps()
            .map_err(|e| ProcError::read(self.pid, "smaps", e))?;
        huge = huge.max(
            after
                .0
                .iter()
                .filter_map(|m| m.extension.map.get("AnonHugePages"))
                .sum(),
        );
        Ok(huge)
    }

    /// The names of the bound unix sockets among its fds (abstract ones start with `@`), as its
    /// own network namespace lists them (`/proc/PID/net/unix`).
    pub fn unix_socket_names(&self) -> Result<Vec<String>, ProcError> {
        let inodes: std::collections::HashSet<u64> = self
            .fds()?
            .into_iter()
            .filter_map(|f| match f.target {
                crate::fds::FdTarget::Socket(inode) => Some(inode),
                _ => None,
            })
            .collect();
        let entries = self
            .dir()?
            .unix()
            .map_err(|e| ProcError::read(self.pid, "net/unix", e))?;
        let mut names: Vec<String> = entries
            .into_iter()
            .filter(|e| inodes.contains(&e.inode))
            .filter_map(|e| Some(e.path?.to_string_lossy().into_owned()))
            .collect();
        names.sort();
        names.dedup();
        Ok(names)
    }

    /// The numbers of its fds that are `files` (see [`DriverFiles`]), ascending.
    pub fn driver_fds(&self, files: DriverFiles<'_>) -> Result<Vec<RawFd>, ProcError> {
        Ok(driver_fds(&self.fds()?, files))
    }

    /// Its thread ids, ascending.
    pub fn tasks(&self) -> Result<Vec<Pid>, ProcError> {
        read::tasks_of(&self.dir()?, self.pid)
    }

    /// Its children (of any of its threads, `/proc/PID/task/TID/children`), each opened and
    /// then checked to still be its child: never a process that took a child's pid since.
    pub fn children(&self) -> Result<Vec<ProcHandle>, ProcError> {
        Ok(self
            .child_pids()?
            .into_iter()
            .filter_map(|c| ProcHandle::open(c).ok())
            .filter(|c| self.is_parent_of(c))
            .collect())
    }

    /// Its children that have exited and that it has not reaped (zombies: each keeps its pid
    /// until then), ascending; each read as a zombie whose parent is this process, while this
    /// process was not reaped (so the pid was still its own). No handle: a zombie has none
    /// ([`ProcHandle::open`]).
    pub fn zombie_children(&self) -> Result<Vec<Pid>, ProcError> {
        let mut zombies: Vec<Pid> = self
            .child_pids()?
            .into_iter()
            .filter(|c| read::stat(*c).is_ok_and(|s| s.state == 'Z' && s.ppid == self.pid))
            .collect();
        if self.liveness() == Liveness::Gone {
            zombies.clear();
        }
        zombies.sort_unstable();
        Ok(zombies)
    }

    /// The pids `/proc/PID/task/TID/children` lists for each of its threads.
    fn child_pids(&self) -> Result<Vec<Pid>, ProcError> {
        let dir = self.dir()?;
        let mut pids = Vec::new();
        for task in dir
            .tasks()
            .map_err(|e| ProcError::read(self.pid, "task", e))?
            .flatten()
        {
            // A thread that ended meanwhile has no children left to list.
            pids.extend(task.children().unwrap_or_default());
        }
        Ok(pids
            .into_iter()
            .filter_map(|c| Pid::try_from(c).ok())
            .collect())
    }

    /// Whether `child` is its child now: `child`'s parent is its pid, read while this process
    /// was not reaped (so the pid was still its own).
    fn is_parent_of(&self, child: &ProcHandle) -> bool {
        child.stat().is_ok_and(|s| s.ppid == self.pid) && self.liveness() != Liveness::Gone
    }

    /// Its descendants (children, their children...), parents before children, each opened and
    /// checked as [`ProcHandle::children`] does. A child forked while the tree is walked may be
    /// missed: a caller that must see every one walks again after it stopped the tree growing.
    pub fn descendants(&self) -> Vec<ProcHandle> {
        let mut out: Vec<ProcHandle> = self.children().unwrap_or_default();
        let mut at = 0;
        while at < out.len() {
            let kids = out[at].children().unwrap_or_default();
            out.extend(kids);
            at += 1;
        }
        out
    }

    /// Every process in one of `sessions` now, each opened and then checked through its pidfd
    /// to still be in one of them: never a process that took a listed pid since. A session
    /// cannot be joined (`setsid` starts a new one, `setpgid` stays within its own), so the
    /// members of a session a process of a tree started are that tree's, its descendants
    /// reparented out of it included, as long as the session id was never free meanwhile (it
    /// stays taken while any member lives). A process that exits meanwhile is left out.
    pub fn in_sessions(sessions: &[Pid]) -> Result<Vec<ProcHandle>, ProcError> {
        if sessions.is_empty() {
            return Ok(Vec::new());
        }
        Ok(read::in_sessions(sessions)?
            .into_iter()
            .filter_map(|p| ProcHandle::open(p).ok())
            .filter(|h| h.stat().is_ok_and(|s| sessions.contains(&s.session)))
            .collect())
    }

    /// The processes it traces (`TracerPid` in their `/proc/PID/status` names one of its
    /// threads), each opened and then checked to still be traced by it.
    pub fn tracees(&self) -> Result<Vec<ProcHandle>, ProcError> {
        let threads = self.tasks()?;
        let all = procfs::process::all_processes()
            .map_err(|source| ProcError::ReadSystem { file: "", source })?;
        let traced: Vec<Pid> = all
            .flatten()
            // Processes vanish while we scan; that is not an error.
            .filter(|p| {
                p.status()
                    .is_ok_and(|s| s.tracerpid != 0 && threads.contains(&s.tracerpid))
            })
            .map(|p| p.pid)
            .collect();
        Ok(traced
            .into_iter()
            .filter_map(|p| ProcHandle::open(p).ok())
            .filter(|h| {
                h.tracer()
                    .is_ok_and(|t| t.is_some_and(|t| threads.contains(&t)))
                    && self.liveness() == Liveness::Alive
            })
            .collect())
    }

    /// Its cgroups, one entry per line of `/proc/PID/cgroup` (`hierarchy:controllers:path`; on
    /// cgroup v2 the single line `0::path`), as the kernel shows them to the reader.
    pub fn cgroups(&self) -> Result<Vec<CgroupEntry>, ProcError> {
        let memberships = self
            .dir()?
            .cgroups()
            .map_err(|e| ProcError::read(self.pid, "cgroup", e))?;
        Ok(memberships.into_iter().map(CgroupEntry::from).collect())
    }

    /// The directories of its cgroups, joined to the cgroup mounts this process sees.
    pub fn cgroup_dirs(&self) -> Result<Cgroups, ProcError> {
        Cgroups::resolve(self.pid, &self.cgroups()?)
    }

    /// The environment it started with (`/proc/PID/environ`), as `NAME=VALUE` pairs in order;
    /// bytes that are not UTF-8 are replaced.
    pub fn environ(&self) -> Result<Vec<(String, String)>, ProcError> {
        let mut bytes = Vec::new();
        self.dir()?
            .open_relative("environ")
            .map_err(|e| ProcError::read(self.pid, "environ", e))?
            .read_to_end(&mut bytes)
            .map_err(|e| ProcError::read(self.pid, "environ", e.into()))?;
        Ok(bytes
            .split(|b| *b == 0)
            .filter(|e| !e.is_empty())
            .map(|e| {
                let e = String::from_utf8_lossy(e);
                match e.split_once('=') {
                    Some((k, v)) => (k.to_owned(), v.to_owned()),
                    None => (e.into_owned(), String::new()),
                }
            })
            .collect())
    }

    /// `/proc/PID/oom_score_adj`.
    pub fn oom_score_adj(&self) -> Result<i32, ProcError> {
        self.dir()?
            .oom_score_adj()
            .map(i32::from)
            .map_err(|e| ProcError::read(self.pid, "oom_score_adj", e))
    }

    /// Sets `oom_score_adj` (lower: the OOM killer prefers others). Written through the process's
    /// `/proc/PID` directory fd, so it lands on this process even if the pid is reused.
    pub fn set_oom_score_adj(&self, value: i32) -> Result<(), OomAdjError> {
        let pid = self.pid;
        if !(-1000..=1000).contains(&value) {
            return Err(OomAdjError::Range { value });
        }
        use rustix::fs::{openat, Mode, OFlags, CWD};
        let classify = |source: std::io::Error| match source.raw_os_error() {
            Some(libc::EPERM | libc::EACCES) => OomAdjError::NotPermitted { pid, value, source },
            Some(libc::ESRCH | libc::ENOENT) => OomAdjError::Gone { pid },
            _ => OomAdjError::Io { pid, source },
        };
        let dir = openat(
            CWD,
            format!("/proc/{pid}"),
            OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| classify(e.into()))?;
        // The directory is this process's only if it was not reaped before it was opened.
        if self.liveness() == Liveness::Gone {
            return Err(OomAdjError::Gone { pid });
        }
        let file = openat(
            &dir,
            "oom_score_adj",
            OFlags::WRONLY | OFlags::CLOEXEC,
            Mode::empty(),
        )
        .map_err(|e| classify(e.into()))?;
        std::fs::File::from(file)
            .write_all(value.to_string().as_bytes())
            .map_err(classify)
    }
}

impl AsFd for ProcHandle {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryo_testkit::procs::{spawn_with_pid, Thread};
    use std::process::Command;

    fn cpus_of(tid: Pid) -> nix::sched::CpuSet {
        nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(tid)).unwrap()
    }

    /// Seam (session 14): a pinned main thread's set is taken by what it starts (a thread, a
    /// child process): `unpin_inherited` gives theirs back too, and leaves one started before
    /// the pin or whose set someone changed since.
    #[test]
    fn what_inherited_a_pin_gets_its_cpus_back() {
        let own = cpus_of(0);
        let first = (0..nix::sched::CpuSet::count())
            .find(|c| own.is_set(*c).unwrap())
            .unwrap();
        let mut one = nix::sched::CpuSet::new();
        one.set(first).unwrap();
        assert_ne!(own, one, "needs two CPUs or more");
        // A process: the shell pinned, then it forks a child (which takes the pin).
        let sh = cryo_testkit::procs::Procs::reaping_tree(1);
        let root = ProcHandle::open(sh.pid(0)).unwrap();
        let before = root.descendants();
        let since = crate::boot_ticks().unwrap();
        root.set_affinity(&one).unwrap();
        before[0].set_affinity(&one).unwrap();
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(root.pid()),
            nix::sys::signal::Signal::SIGUSR1,
        )
        .unwrap();
        let late = cryo_testkit::eventually(cryo_testkit::PATIENCE, "the fork", || {
            root.descendants()
                .into_iter()
                .find(|d| d.pid() != before[0].pid())
        });
        assert_eq!(cpus_of(late.pid()), one, "the fork took the pin");
        assert_eq!(root.unpin(&one, &own).unwrap(), Unpinned::Returned);
        let n = root.unpin_inherited(&one, &own, since);
        assert_eq!(cpus_of(late.pid()), own, "the fork kept the pin");
        // Started before the pin: not the pin's (its set was someone's choice).
        if before[0].start_time() < since {
            assert_eq!(cpus_of(before[0].pid()), one);
            assert_eq!(n, 1);
        }
        // A thread: this one pinned, then it starts one.
        let since = crate::boot_ticks().unwrap();
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &one).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            tx.send(rustix::thread::gettid().as_raw_nonzero().get())
                .unwrap();
            let _ = stop_rx.recv();
        });
        let tid = rx.recv().unwrap();
        nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(0), &own).unwrap();
        assert_eq!(cpus_of(tid), one, "the thread took the pin");
        let me = ProcHandle::open(std::process::id() as Pid).unwrap();
        assert!(me.unpin_inherited(&one, &own, since) >= 1);
        assert_eq!(cpus_of(tid), own, "the thread kept the pin");
        stop_tx.send(()).unwrap();
        t.join().unwrap();
    }

    /// A process's children and descendants are found by the kernel's parent links, and its
    /// tracees by their `TracerPid`; nothing else is.
    #[test]
    fn children_descendants_and_tracees_are_the_kernel_s() {
        let mut sh = Command::new("sh")
            .args(["-c", "sleep 100 & sleep 100 & wait"])
            .spawn()
            .unwrap();
        let mut other = Command::new("sleep").arg("100").spawn().unwrap();
        let sh_h = ProcHandle::open(sh.id() as Pid).unwrap();
        let below = cryo_testkit::eventually(cryo_testkit::PATIENCE, "two sleeps forked", || {
            let d = sh_h.descendants();
            (d.len() == 2 && d.iter().all(|h| h.stat().is_ok_and(|s| s.comm == "sleep")))
                .then_some(d)
        });
        assert!(below
            .iter()
            .all(|h| h.stat().unwrap().ppid == sh.id() as Pid));
        let me = ProcHandle::open(std::process::id() as Pid).unwrap();
        let mine: Vec<Pid> = me.children().unwrap().iter().map(ProcHandle::pid).collect();
        assert!(mine.contains(&(sh.id() as Pid)) && mine.contains(&(other.id() as Pid)));
        assert!(!mine.contains(&below[0].pid()));

        assert!(me.tracees().unwrap().is_empty());
        let target = nix::unistd::Pid::from_raw(other.id() as Pid);
        nix::sys::ptrace::seize(target, nix::sys::ptrace::Options::empty()).unwrap();
        let traced: Vec<Pid> = me.tracees().unwrap().iter().map(ProcHandle::pid).collect();
        assert_eq!(traced, vec![other.id() as Pid]);
        assert!(sh_h.tracees().unwrap().is_empty());

        other.kill().unwrap();
        other.wait().unwrap();
        sh.kill().unwrap();
        sh.wait().unwrap();
        for h in below {
            h.signal(Signal::SIGKILL).unwrap();
        }
    }

    /// Memory that asked for huge pages but was faulted in small ones (as CRIU's restore leaves
    /// it) is in huge pages after `collapse_huge_pages`.
    #[test]
    fn memory_that_asked_for_huge_pages_is_collapsed_into_them() {
        use nix::sys::mman::{madvise, mmap_anonymous, munmap, MapFlags, MmapAdvise, ProtFlags};
        let thp = std::fs::read_to_string("/sys/kernel/mm/transparent_hugepage/enabled").unwrap();
        assert!(
            !thp.contains("[never]"),
            "transparent huge pages are off: {thp}"
        );
        const LEN: usize = 16 << 20;
        // SAFETY: a fresh private anonymous mapping, used only through `bytes` below and
        // unmapped at the end of the test.
        let ptr = unsafe {
            mmap_anonymous(
                None,
                std::num::NonZeroUsize::new(LEN).unwrap(),
                ProtFlags::PROT_READ | ProtFlags::PROT_WRITE,
                MapFlags::MAP_PRIVATE,
            )
        }
        .unwrap();
        // Small pages first (as CRIU writes them), then the worker's wish for huge ones.
        // SAFETY: the range is the mapping made above.
        unsafe { madvise(ptr, LEN, MmapAdvise::MADV_NOHUGEPAGE) }.unwrap();
        // SAFETY: `ptr` points at LEN writable bytes that nothing else uses.
        let bytes = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr().cast::<u8>(), LEN) };
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = i as u8;
        }
        // SAFETY: as above.
        unsafe { madvise(ptr, LEN, MmapAdvise::MADV_HUGEPAGE) }.unwrap();
        let me = ProcHandle::open(std::process::id() as Pid).unwrap();
        let before = huge_in(ptr.as_ptr() as u64);
        assert_eq!(before, 0, "faulted in small pages");
        me.collapse_huge_pages().unwrap();
        let after = huge_in(ptr.as_ptr() as u64);
        assert!(
            after >= 2 << 20,
            "no huge page after the collapse ({after} bytes)"
        );
        assert!(
            bytes.iter().enumerate().all(|(i, b)| *b == i as u8),
            "contents changed"
        );
        // SAFETY: the mapping made above, no longer used.
        unsafe { munmap(ptr, LEN) }.unwrap();
    }

    /// `AnonHugePages` of our mapping that starts at `start`.
    fn huge_in(start: u64) -> u64 {
        let maps = procfs::process::Process::myself().unwrap().smaps().unwrap();
        maps.0
            .iter()
            .find(|m| m.address.0 <= start && start < m.address.1)
            .and_then(|m| m.extension.map.get("AnonHugePages").copied())
            .unwrap_or(0)
    }

    #[test]
    fn handle_signals_and_sees_exit_then_reap() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let h = ProcHandle::open(child.id() as Pid).unwrap();
        assert!(h.is_alive());
        assert_eq!(h.liveness(), Liveness::Alive);
        assert!(!h.wait_exit(Duration::from_millis(50)));
        h.signal(Signal::SIGKILL).unwrap();
        assert!(h.wait_exit(Duration::from_secs(5)));
        assert_eq!(h.liveness(), Liveness::Zombie);
        // A zombie still accepts signals (nothing happens); it is not "gone" yet.
        h.signal(Signal::SIGKILL).unwrap();
        child.wait().unwrap();
        assert_eq!(h.liveness(), Liveness::Gone);
        assert!(matches!(
            h.signal(Signal::SIGKILL),
            Err(ProcError::NoSuchProcess(_))
        ));
        assert!(matches!(h.status(), Err(ProcError::NoSuchProcess(_))));
    }

    #[test]
    fn reused_pid_is_refused() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = child.id() as Pid;
        let h = ProcHandle::open(pid).unwrap();
        let err = ProcHandle::open_expected(pid, h.start_time() + 1).unwrap_err();
        assert!(matches!(err, ProcError::Reused { .. }));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(
            ProcHandle::open(pid),
            Err(ProcError::NoSuchProcess(_))
        ));
    }

    #[test]
    fn a_handle_never_reaches_the_process_that_reused_its_pid() {
        for _ in 0..50 {
            let mut old = Command::new("sleep").arg("30").spawn().unwrap();
            let pid = old.id() as Pid;
            let h = ProcHandle::open(pid).unwrap();
            old.kill().unwrap();
            old.wait().unwrap();
            let Some(mut new) = spawn_with_pid(pid) else {
                continue;
            };
            // The pid names `new` now; the handle still names the reaped `old`.
            assert_eq!(h.liveness(), Liveness::Gone);
            assert!(matches!(
                h.signal(Signal::SIGKILL),
                Err(ProcError::NoSuchProcess(_))
            ));
            assert!(matches!(h.status(), Err(ProcError::NoSuchProcess(_))));
            assert!(matches!(h.fds(), Err(ProcError::NoSuchProcess(_))));
            assert!(matches!(h.get_fd(0), Err(ProcError::GetFd { .. })));
            assert!(matches!(
                h.set_oom_score_adj(900),
                Err(OomAdjError::Gone { .. })
            ));
            // And `new` was left alone.
            let n = ProcHandle::open(pid).unwrap();
            // A start time has clock-tick resolution: only a later tick tells the two apart.
            if n.start_time() != h.start_time() {
                assert!(matches!(
                    ProcHandle::open_expected(pid, h.start_time()),
                    Err(ProcError::Reused { .. })
                ));
            }
            assert!(n.is_alive());
            let mine = ProcHandle::open(std::process::id() as Pid).unwrap();
            assert_eq!(n.oom_score_adj().unwrap(), mine.oom_score_adj().unwrap());
            new.kill().unwrap();
            new.wait().unwrap();
            return;
        }
        panic!("no pid could be reused in 50 tries");
    }

    #[test]
    fn a_thread_is_not_a_process() {
        let thread = Thread::start();
        let tid = thread.tid;
        let me = std::process::id() as Pid;
        assert!(matches!(ProcHandle::open(tid), Err(ProcError::NoSuchProcess(p)) if p == tid));
        assert_eq!(read::tgid(tid).unwrap(), Some(me));
        let h = ProcHandle::open(me).unwrap();
        assert!(h.tasks().unwrap().contains(&tid));
        assert_eq!(h.thread_status(tid).unwrap().tgid, me);
    }

    #[test]
    fn reads_of_a_live_process() {
        let mut child = Command::new("sleep")
            .arg("30")
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let h = ProcHandle::open(child.id() as Pid).unwrap();
        assert_eq!(h.comm(), "sleep");
        // Right after exec the new command line can read empty for a moment.
        let deadline = Instant::now() + Duration::from_secs(10);
        while h.cmdline().unwrap().is_empty() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(2));
        }
        assert_eq!(h.cmdline().unwrap(), ["sleep", "30"]);
        assert_eq!(h.tracer().unwrap(), None);
        assert_eq!(h.tgid().unwrap(), h.pid());
        assert_eq!(h.stat().unwrap().ppid, std::process::id() as Pid);
        assert!(h.rss().unwrap() > 0);
        assert_eq!(
            h.driver_fds(DriverFiles::Nvidia).unwrap(),
            Vec::<RawFd>::new()
        );
        assert!(h.fds().unwrap().iter().any(|f| f.fd == 0));
        let dup = h.get_fd(0).unwrap();
        drop(dup);
        let clone = h.try_clone().unwrap();
        assert_eq!((clone.pid(), clone.start_time()), (h.pid(), h.start_time()));
        let cg = h.cgroup_dirs().unwrap();
        assert!(cg.unified.is_some() || !cg.v1.is_empty(), "{cg:?}");
        h.set_oom_score_adj(500).unwrap();
        assert_eq!(h.oom_score_adj().unwrap(), 500);
        assert!(matches!(
            h.set_oom_score_adj(5000),
            Err(OomAdjError::Range { value: 5000 })
        ));
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(
            h.set_oom_score_adj(100),
            Err(OomAdjError::Gone { .. })
        ));
    }

    #[test]
    fn cgroups_and_environ_of_a_live_process_and_none_of_a_dead_one() {
        let mut child = Command::new("sleep")
            .arg("60")
            .env("CRYO_PROC_TEST", "a=b")
            .spawn()
            .unwrap();
        let pid = child.id() as Pid;
        // environ is the new program's only once it has exec'd, and the kernel sets the command
        // name before the environment
        let t0 = Instant::now();
        while read::stat(pid).unwrap().comm != "sleep"
            || ProcHandle::open(pid).unwrap().environ().unwrap().is_empty()
        {
            assert!(t0.elapsed() < Duration::from_secs(10), "sleep did not exec");
            std::thread::sleep(Duration::from_millis(5));
        }
        let h = ProcHandle::open(pid).unwrap();
        let cg = h.cgroups().unwrap();
        assert!(!cg.is_empty());
        assert_eq!(
            cg,
            ProcHandle::open(std::process::id() as Pid)
                .unwrap()
                .cgroups()
                .unwrap()
        );
        let env = h.environ().unwrap();
        assert!(
            env.contains(&("CRYO_PROC_TEST".to_owned(), "a=b".to_owned())),
            "{env:?}"
        );
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(matches!(h.cgroups(), Err(ProcError::NoSuchProcess(_))));
        assert!(matches!(h.environ(), Err(ProcError::NoSuchProcess(_))));
    }
}
