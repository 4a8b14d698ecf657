//! Processes as cryo acts on them.
//!
//! # Design
//! cryo acts on processes it did not spawn (inference workers, their children, restored trees), so
//! a bare pid is never enough: between finding a pid and signalling it the process can exit and
//! the pid be reused. Every action goes through a [`ProcHandle`], which holds a pidfd opened while
//! the process was known to be the one meant (same start time), so a signal can only ever reach
//! that process, and exit is observed by polling the pidfd rather than guessed from `/proc`.
//!
//! # Limitations
//! Pids are host pids (the namespace cryo runs in). Exit statuses of processes that are not our
//! children are not available through a pidfd; callers that need how a process died read its
//! zombie's `/proc/PID/stat` while they can.

use std::collections::{BTreeMap, VecDeque};
use std::fs;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use rustix::event::{poll, PollFd, PollFlags};
use rustix::process::{pidfd_open, pidfd_send_signal, Pid as RPid, PidfdFlags, Signal};

/// A process id (host namespace).
pub type Pid = i32;

/// Acting on a process failed.
#[derive(Debug, thiserror::Error)]
pub enum ProcError {
    /// No such process.
    #[error("pid {0} does not exist")]
    NoSuchProcess(Pid),
    /// The pid now names another process than the one recorded.
    #[error("pid {pid} was reused: it started at tick {found}, not {expected} as recorded")]
    Reused {
        /// The pid.
        pid: Pid,
        /// Start time recorded earlier.
        expected: u64,
        /// Start time of the process holding the pid now.
        found: u64,
    },
    /// `/proc/PID/stat` could not be parsed.
    #[error("cannot parse /proc/{pid}/stat: {reason}")]
    BadStat {
        /// The pid.
        pid: Pid,
        /// What was wrong.
        reason: &'static str,
    },
    /// A system call or file access failed.
    #[error("{what} for pid {pid}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The pid.
        pid: Pid,
        /// The error.
        source: std::io::Error,
    },
    /// A cgroup's process list could not be read.
    #[error("cannot read the processes of cgroup {path}: {source}")]
    Cgroup {
        /// `cgroup.procs` path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

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
    /// Session id.
    pub session: Pid,
    /// Start time in clock ticks since boot: with the pid, identifies a process.
    pub start_time: u64,
    /// Exit code as `waitpid` would report it; meaningful only for a zombie.
    pub exit_code: Option<i32>,
}

/// Reads and parses `/proc/PID/stat`.
pub fn stat(pid: Pid) -> Result<Stat, ProcError> {
    let text = match fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ProcError::NoSuchProcess(pid))
        }
        Err(e) if e.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error()) => {
            return Err(ProcError::NoSuchProcess(pid))
        }
        Err(source) => {
            return Err(ProcError::Os {
                what: "reading /proc/PID/stat",
                pid,
                source,
            })
        }
    };
    parse_stat(pid, &text)
}

fn parse_stat(pid: Pid, text: &str) -> Result<Stat, ProcError> {
    let bad = |reason| ProcError::BadStat { pid, reason };
    // comm may itself contain spaces and parentheses: it ends at the last ')'.
    let open = text.find('(').ok_or_else(|| bad("no '('"))?;
    let close = text.rfind(')').ok_or_else(|| bad("no ')'"))?;
    let comm = text
        .get(open + 1..close)
        .ok_or_else(|| bad("bad comm"))?
        .to_string();
    let rest: Vec<&str> = text
        .get(close + 1..)
        .ok_or_else(|| bad("truncated"))?
        .split_whitespace()
        .collect();
    // rest[0] is field 3 (state); field N is rest[N - 3].
    let field = |n: usize| {
        rest.get(n - 3)
            .copied()
            .ok_or_else(|| bad("too few fields"))
    };
    let state = field(3)?.chars().next().ok_or_else(|| bad("empty state"))?;
    let ppid = field(4)?.parse().map_err(|_| bad("bad ppid"))?;
    let session = field(6)?.parse().map_err(|_| bad("bad session"))?;
    let start_time = field(22)?.parse().map_err(|_| bad("bad starttime"))?;
    let exit_code = rest.get(52 - 3).and_then(|s| s.parse().ok());
    Ok(Stat {
        pid,
        comm,
        state,
        ppid,
        session,
        start_time,
        exit_code,
    })
}

/// One line of `/proc/PID/cgroup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupEntry {
    /// Hierarchy id (0 for the cgroup v2 unified hierarchy).
    pub hierarchy: u32,
    /// Controllers bound to the hierarchy (`memory`, `cpu,cpuacct`, `name=systemd`; empty for v2).
    pub controllers: String,
    /// The cgroup's path inside the hierarchy.
    pub path: String,
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
    /// Opens the process that holds `pid` now.
    pub fn open(pid: Pid) -> Result<Self, ProcError> {
        let rpid = RPid::from_raw(pid).ok_or(ProcError::NoSuchProcess(pid))?;
        let pidfd = pidfd_open(rpid, PidfdFlags::empty()).map_err(|e| {
            if e == rustix::io::Errno::SRCH {
                ProcError::NoSuchProcess(pid)
            } else {
                ProcError::Os {
                    what: "pidfd_open",
                    pid,
                    source: e.into(),
                }
            }
        })?;
        let st = stat(pid)?;
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

    /// The pid.
    pub fn pid(&self) -> Pid {
        self.pid
    }

    /// Start time in clock ticks since boot.
    pub fn start_time(&self) -> u64 {
        self.start_time
    }

    /// Command name.
    pub fn comm(&self) -> &str {
        &self.comm
    }

    /// The pidfd.
    pub fn pidfd(&self) -> &OwnedFd {
        &self.pidfd
    }

    /// Whether the process has not exited yet (a zombie counts as exited).
    pub fn is_alive(&self) -> bool {
        !self.poll_exit(Duration::ZERO)
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

    /// The cgroups of this process, one entry per line of `/proc/PID/cgroup`
    /// (`hierarchy:controllers:path`; on cgroup v2 the single line `0::path`). Paths are as the
    /// kernel shows them to the reader, relative to the reader's cgroup namespace.
    pub fn cgroups(&self) -> Result<Vec<CgroupEntry>, ProcError> {
        let text = self.read_proc_file("cgroup", "reading /proc/PID/cgroup")?;
        Ok(text
            .lines()
            .filter_map(|l| {
                let mut f = l.splitn(3, ':');
                Some(CgroupEntry {
                    hierarchy: f.next()?.parse().ok()?,
                    controllers: f.next()?.to_owned(),
                    path: f.next()?.to_owned(),
                })
            })
            .collect())
    }

    /// The environment this process started with (`/proc/PID/environ`), as `NAME=VALUE` pairs in
    /// order; bytes that are not UTF-8 are replaced.
    pub fn environ(&self) -> Result<Vec<(String, String)>, ProcError> {
        let path = format!("/proc/{}/environ", self.pid);
        let bytes = fs::read(&path)
            .map_err(|source| self.read_error("reading /proc/PID/environ", source))?;
        self.check_read_was_ours()?;
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

    /// Reads `/proc/PID/NAME`; the content is this process's only if it is still alive after the read.
    fn read_proc_file(&self, name: &str, what: &'static str) -> Result<String, ProcError> {
        let text = fs::read_to_string(format!("/proc/{}/{name}", self.pid))
            .map_err(|source| self.read_error(what, source))?;
        self.check_read_was_ours()?;
        Ok(text)
    }

    fn read_error(&self, what: &'static str, source: std::io::Error) -> ProcError {
        if source.kind() == std::io::ErrorKind::NotFound
            || source.raw_os_error() == Some(rustix::io::Errno::SRCH.raw_os_error())
        {
            ProcError::NoSuchProcess(self.pid)
        } else {
            ProcError::Os {
                what,
                pid: self.pid,
                source,
            }
        }
    }

    /// After a read of `/proc/PID/...`: if the process is alive now, the pid was not reused
    /// during the read, so what was read is this process's.
    fn check_read_was_ours(&self) -> Result<(), ProcError> {
        if self.is_alive() {
            Ok(())
        } else {
            Err(ProcError::NoSuchProcess(self.pid))
        }
    }

    /// Sends `signal` to this process (never to a process that reused its pid).
    pub fn signal(&self, signal: Signal) -> Result<(), ProcError> {
        match pidfd_send_signal(self.pidfd.as_fd(), signal) {
            Ok(()) => Ok(()),
            Err(e) if e == rustix::io::Errno::SRCH => Err(ProcError::NoSuchProcess(self.pid)),
            Err(e) => Err(ProcError::Os {
                what: "pidfd_send_signal",
                pid: self.pid,
                source: e.into(),
            }),
        }
    }
}

/// Every process in the tree rooted at `root`, parents before children (root first).
pub fn tree(root: Pid) -> Result<Vec<Pid>, ProcError> {
    stat(root)?;
    let mut children: BTreeMap<Pid, Vec<Pid>> = BTreeMap::new();
    let entries = fs::read_dir("/proc").map_err(|source| ProcError::Os {
        what: "listing /proc",
        pid: root,
        source,
    })?;
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|s| s.parse::<Pid>().ok())
        else {
            continue;
        };
        // Processes vanish while we scan; that is not an error.
        if let Ok(st) = stat(pid) {
            children.entry(st.ppid).or_default().push(pid);
        }
    }
    let mut out = Vec::new();
    let mut queue = VecDeque::from([root]);
    while let Some(p) = queue.pop_front() {
        out.push(p);
        if let Some(kids) = children.get(&p) {
            queue.extend(kids.iter().copied());
        }
    }
    Ok(out)
}

/// Every process in a cgroup (`path` is the cgroup directory, v1 or v2).
pub fn cgroup_procs(path: &Path) -> Result<Vec<Pid>, ProcError> {
    let file = if path.ends_with("cgroup.procs") {
        path.to_path_buf()
    } else {
        path.join("cgroup.procs")
    };
    let text = fs::read_to_string(&file).map_err(|source| ProcError::Cgroup {
        path: file.clone(),
        source,
    })?;
    let mut pids: Vec<Pid> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// How a process that is now a zombie ended, in words (`killed by SIGKILL`, `exited with status 1`),
/// from its wait status (`/proc/PID/stat` field 52 of a zombie).
pub fn describe_wait_status(status: i32) -> String {
    let sig = status & 0x7f;
    if sig == 0 {
        format!("exited with status {}", (status >> 8) & 0xff)
    } else {
        let core = if status & 0x80 != 0 {
            " (core dumped)"
        } else {
            ""
        };
        format!("killed by {}{core}", signal_name(sig))
    }
}

/// `SIGTERM`, `SIGRT34`, `signal 99`: a signal's name for logs, journals and messages.
pub fn signal_name(signal: i32) -> String {
    let fixed = match signal {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGTRAP => "SIGTRAP",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGUSR2 => "SIGUSR2",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGALRM => "SIGALRM",
        libc::SIGTERM => "SIGTERM",
        libc::SIGSTKFLT => "SIGSTKFLT",
        libc::SIGCHLD => "SIGCHLD",
        libc::SIGCONT => "SIGCONT",
        libc::SIGSTOP => "SIGSTOP",
        libc::SIGTSTP => "SIGTSTP",
        libc::SIGTTIN => "SIGTTIN",
        libc::SIGTTOU => "SIGTTOU",
        libc::SIGURG => "SIGURG",
        libc::SIGXCPU => "SIGXCPU",
        libc::SIGXFSZ => "SIGXFSZ",
        libc::SIGVTALRM => "SIGVTALRM",
        libc::SIGPROF => "SIGPROF",
        libc::SIGWINCH => "SIGWINCH",
        libc::SIGIO => "SIGIO",
        libc::SIGPWR => "SIGPWR",
        libc::SIGSYS => "SIGSYS",
        n if (32..=64).contains(&n) => return format!("SIGRT{n}"),
        n => return format!("signal {n}"),
    };
    fixed.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn parses_stat_with_odd_comm() {
        let line = "42 (a) b (c)) S 7 42 42 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1000 10 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 1 0 0 0 0 0 0 0 0 0 0 0 0 256\n";
        let st = parse_stat(42, line).unwrap();
        assert_eq!(st.comm, "a) b (c)");
        assert_eq!(st.state, 'S');
        assert_eq!(st.ppid, 7);
        assert_eq!(st.session, 42);
        assert_eq!(st.start_time, 987654);
        assert_eq!(st.exit_code, Some(256));
    }

    #[test]
    fn handle_signals_and_sees_exit() {
        let mut child = Command::new("sleep").arg("30").spawn().unwrap();
        let h = ProcHandle::open(child.id() as Pid).unwrap();
        assert!(h.is_alive());
        assert!(!h.wait_exit(Duration::from_millis(50)));
        h.signal(Signal::Kill).unwrap();
        assert!(h.wait_exit(Duration::from_secs(5)));
        child.wait().unwrap();
        assert!(matches!(
            h.signal(Signal::Kill),
            Err(ProcError::NoSuchProcess(_))
        ));
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
    fn tree_lists_descendants_parent_first() {
        let mut child = Command::new("sh")
            .args(["-c", "sleep 30 & sleep 30 & wait"])
            .spawn()
            .unwrap();
        let root = child.id() as Pid;
        let mut pids = Vec::new();
        for _ in 0..100 {
            pids = tree(root).unwrap();
            if pids.len() == 3 {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(pids.len(), 3, "{pids:?}");
        assert_eq!(pids[0], root);
        for p in &pids[1..] {
            assert_eq!(stat(*p).unwrap().ppid, root);
            ProcHandle::open(*p).unwrap().signal(Signal::Kill).unwrap();
        }
        child.kill().unwrap();
        child.wait().unwrap();
    }

    #[test]
    fn wait_status_words() {
        assert_eq!(describe_wait_status(9), "killed by SIGKILL");
        assert_eq!(describe_wait_status(1 << 8), "exited with status 1");
        assert_eq!(
            describe_wait_status(11 | 0x80),
            "killed by SIGSEGV (core dumped)"
        );
        assert_eq!(describe_wait_status(0), "exited with status 0");
        assert_eq!(signal_name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(signal_name(99), "signal 99");
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
        while stat(pid).unwrap().comm != "sleep"
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
