//! Plain processes to act on (one with a given pid; a thread of the test's own), and what
//! `/proc` says about a process.

use std::process::{Child, Command, ExitStatus, Stdio};

use cryo_proc::Pid;

use crate::{eventually, PATIENCE};

/// The state letter of `pid` (`R`, `S`, `T`, `t`, `Z`...), `None` once it is reaped.
pub fn state(pid: Pid) -> Option<char> {
    cryo_proc::stat(pid).ok().map(|s| s.state)
}

/// Not exited: it exists and is not a zombie.
pub fn alive(pid: Pid) -> bool {
    state(pid).is_some_and(|s| s != 'Z' && s != 'X')
}

/// Sends signal number `sig` (any, real-time ones included) to `pid`; panics if it cannot.
pub fn kill(pid: Pid, sig: i32) {
    // SAFETY: kill(2) takes no pointer.
    let sent = unsafe { libc::kill(pid, sig) };
    assert_eq!(
        sent,
        0,
        "kill({pid}, {sig}): {}",
        std::io::Error::last_os_error()
    );
}

/// Whether `signal` is pending for `pid`: in the process's shared queue (`ShdPnd`) or one of
/// its threads' (`SigPnd`), i.e. not yet taken.
pub fn pending(pid: Pid, signal: i32) -> bool {
    let bit = 1u64 << (signal - 1);
    let mask = |path: String, field: &str| {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(field))
            .and_then(|m| u64::from_str_radix(m.trim(), 16).ok())
            .unwrap_or(0)
    };
    let threads = std::fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| d.flatten().map(|e| e.path()).collect::<Vec<_>>())
        .unwrap_or_default();
    mask(format!("/proc/{pid}/status"), "ShdPnd:") & bit != 0
        || threads
            .into_iter()
            .any(|t| mask(format!("{}/status", t.display()), "SigPnd:") & bit != 0)
}

/// Alive, not about to die of a signal: none pending that it has not taken, and no SIGKILL
/// queued on its threads (a signal whose default action kills, delivered to a process that
/// neither handles, ignores nor blocks it, queues SIGKILL on every thread at once; one that
/// dumps core is pending until a thread takes it). The positive answer, right after a
/// `kill(pid, signal)`, to "did it survive that signal?".
pub fn survives(pid: Pid, signal: i32) -> bool {
    alive(pid) && !pending(pid, signal) && !pending(pid, libc::SIGKILL)
}

/// Who traces `pid` (0: nobody, or it is gone).
pub fn tracer_pid(pid: Pid) -> Pid {
    cryo_proc::status(pid).map_or(0, |s| s.tracer_pid)
}

/// The process (thread group) that traces `pid`, 0 when none does.
pub fn tracer_process(pid: Pid) -> Pid {
    match tracer_pid(pid) {
        0 => 0,
        t => cryo_proc::tgid(t).ok().flatten().unwrap_or(0),
    }
}

/// Whether `pid` has a handler installed for `signal` (`SigCgt`).
pub fn catches(pid: Pid, signal: i32) -> bool {
    cryo_proc::status(pid).is_ok_and(|s| s.sig_caught & (1u64 << (signal - 1)) != 0)
}

/// `(tid, state letter)` of every thread of `pid`.
pub fn thread_states(pid: Pid) -> Vec<(Pid, char)> {
    let Ok(h) = cryo_proc::ProcHandle::open(pid) else {
        return Vec::new();
    };
    h.tasks()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|tid| Some((tid, h.thread_status(tid).ok()?.state)))
        .collect()
}

/// The state letter of one thread.
pub fn thread_state(pid: Pid, tid: Pid) -> Option<char> {
    thread_states(pid)
        .into_iter()
        .find(|(t, _)| *t == tid)
        .map(|(_, s)| s)
}

/// Whether every thread of `pid` is in one of `states` (and it has threads).
pub fn all_threads_in(pid: Pid, states: &[char]) -> bool {
    let threads = thread_states(pid);
    !threads.is_empty() && threads.iter().all(|(_, s)| states.contains(s))
}

/// Waits for a child of ours to exit and returns its status.
pub fn wait_exit(child: &mut Child) -> ExitStatus {
    let pid = child.id();
    eventually(PATIENCE, &format!("pid {pid} to exit"), || {
        child.try_wait().unwrap()
    })
}

/// Reaps `pid` once it has exited, when it is a child of ours (thawed workers are reparented to a
/// subreaper test). Returns at once for a pid that is not our child.
pub fn reap(pid: Pid) {
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    let p = nix::unistd::Pid::from_raw(pid);
    eventually(PATIENCE, &format!("pid {pid} to be reaped"), || {
        !matches!(
            waitpid(p, Some(WaitPidFlag::WNOHANG)),
            Ok(WaitStatus::StillAlive)
        )
    });
}

/// Plain processes (`sleep`) that are certainly not CUDA processes; SIGKILLed (with their
/// process group, for a tree) and reaped on drop.
#[derive(Debug)]
pub struct Procs(Vec<Child>, bool);

impl Procs {
    /// `n` sleepers, children of the test.
    pub fn spawn(n: usize) -> Procs {
        Procs((0..n).map(|_| sleeper(false)).collect(), false)
    }

    /// One sleeper that leads its own session (what CRIU can dump without `shell_job`).
    pub fn session_leader() -> Procs {
        Procs(vec![sleeper(true)], false)
    }

    /// A tree that leads its own session: a `sleep` with `children` `sleep` children (what
    /// CRIU dumps as a whole). [`Procs::pids`] gives the root only; [`Procs::tree`] all.
    pub fn session_tree(children: usize) -> Procs {
        let script = format!("{}exec sleep 600", "sleep 600 & ".repeat(children));
        let procs = Self::session_shell(&script, children);
        eventually(PATIENCE, "the session tree's root to run sleep", || {
            cryo_proc::stat(procs.pid(0)).is_ok_and(|s| s.comm == "sleep")
        });
        procs
    }

    /// A tree that leads its own session: `sh -c script`, once it has `children` children, each
    /// of them running `sleep` (its root is `sh` unless the script `exec`s).
    pub fn session_shell(script: &str, children: usize) -> Procs {
        let root = session_sh(script);
        let pid = root.id() as Pid;
        eventually(PATIENCE, "the session shell's tree", || {
            cryo_proc::stat(pid).is_ok_and(|s| s.session == pid)
                && cryo_proc::tree(pid).is_ok_and(|t| {
                    t.len() == children + 1
                        && t[1..]
                            .iter()
                            .all(|p| cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep"))
                })
        });
        Procs(vec![root], true)
    }

    /// A tree that leads its own session: `sh -c script`, once its tree has `size` processes
    /// (the root included), whatever they run.
    pub fn session_script(script: &str, size: usize) -> Procs {
        let root = session_sh(script);
        let pid = root.id() as Pid;
        eventually(PATIENCE, "the session script's tree", || {
            cryo_proc::stat(pid).is_ok_and(|s| s.session == pid)
                && cryo_proc::tree(pid).is_ok_and(|t| t.len() == size)
        });
        Procs(vec![root], true)
    }

    /// A tree that leads its own session whose root is a shell that reaps its `children`
    /// `sleep` children as they end (a child killed is gone, its pid free, not a zombie) and
    /// forks one more `sleep` on every SIGUSR1.
    pub fn reaping_tree(children: usize) -> Procs {
        let script = format!(
            "trap 'sleep 600 &' USR1; {}while :; do wait; done",
            "sleep 600 & ".repeat(children)
        );
        let root = session_sh(&script);
        let pid = root.id() as Pid;
        eventually(PATIENCE, "the reaping tree", || {
            cryo_proc::stat(pid).is_ok_and(|s| s.session == pid && s.comm == "sh")
                && catches(pid, libc::SIGUSR1)
                && cryo_proc::tree(pid).is_ok_and(|t| t.len() == children + 1)
        });
        Procs(vec![root], true)
    }

    /// Every process of the tree of the first one (root first).
    pub fn tree(&self) -> Vec<Pid> {
        cryo_proc::tree(self.pid(0)).unwrap()
    }

    /// The pid of the `i`th.
    pub fn pid(&self, i: usize) -> Pid {
        self.0[i].id() as Pid
    }

    /// Every pid.
    pub fn pids(&self) -> Vec<Pid> {
        (0..self.0.len()).map(|i| self.pid(i)).collect()
    }

    /// Whether the `i`th has not exited (reaping it if it has).
    pub fn alive(&mut self, i: usize) -> bool {
        self.0[i].try_wait().unwrap().is_none()
    }
}

impl Drop for Procs {
    fn drop(&mut self) {
        if self.1 {
            // Its own session, so its own process group: the children go with it.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(self.pid(0)),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `sh -c script` leading a session of its own (`setsid` execs in place), stdio null, none of
/// the test's descriptors inherited; the caller waits for the tree it builds.
fn session_sh(script: &str) -> Child {
    crate::own();
    let mut cmd = Command::new("setsid");
    cmd.args(["sh", "-c", script])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    crate::fds::close_inherited(&mut cmd, None);
    cmd.spawn().unwrap()
}

fn sleeper(session: bool) -> Child {
    crate::own();
    // `setsid` execs in place: a child of ours is never a process-group leader.
    let mut c = if session {
        let mut c = Command::new("setsid");
        c.arg("sleep");
        c
    } else {
        Command::new("sleep")
    };
    crate::fds::close_inherited(&mut c, None);
    let child = c
        .arg("600")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    if session {
        let pid = child.id() as Pid;
        eventually(PATIENCE, "setsid to exec sleep", || {
            cryo_proc::stat(pid).is_ok_and(|s| s.session == pid && s.comm == "sleep")
        });
    }
    child
}

/// A debugger attached to a process: another executable (`perl`, part of every Debian system)
/// that ptrace-attaches to it, which stops it (`t`), and holds it until dropped. On drop the
/// tracer is killed, which detaches it; the process may then be left stopped by the attach's
/// SIGSTOP (`T`).
#[derive(Debug)]
pub struct Debugger(Child);

impl Debugger {
    /// Attaches to every thread of `pid` (`PTRACE_ATTACH`) and waits until they are all stopped.
    pub fn attach(pid: Pid) -> Debugger {
        crate::own();
        use std::io::BufRead;
        // ptrace(PTRACE_ATTACH = 16, pid, 0, 0) is system call 101 on x86_64, 117 on aarch64.
        let nr = if cfg!(target_arch = "aarch64") {
            117
        } else {
            101
        };
        // Every thread, as gdb does (a ptrace attach stops only the thread named).
        let script = format!(
            "opendir(my $d, \"/proc/{pid}/task\") or die \"task: $!\\n\"; for my $t (grep {{ /^\\d+$/ }} readdir($d)) {{ syscall({nr}, 16, $t + 0, 0, 0) == 0 or die \"ptrace $t: $!\\n\"; }} $| = 1; print \"attached\\n\"; sleep 3600;"
        );
        let mut child = Command::new("perl")
            .args(["-e", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("perl (the test debugger) cannot be started");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(
            line, "attached\n",
            "the test debugger could not attach to {pid}"
        );
        eventually(
            PATIENCE,
            &format!("pid {pid} to stop under the debugger"),
            || all_threads_in(pid, &['t']),
        );
        Debugger(child)
    }

    /// The tracer's pid.
    pub fn pid(&self) -> Pid {
        self.0.id() as Pid
    }
}

impl Drop for Debugger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Spawns `sleep 30` with exactly `pid` (root: through the host's `ns_last_pid`), to reuse the
/// pid of a process that is gone; `None` when another process took the pid first.
pub fn spawn_with_pid(pid: Pid) -> Option<Child> {
    crate::own();
    std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string())
        .expect("setting ns_last_pid (the tests run as root)");
    let mut child = Command::new("sleep").arg("30").spawn().unwrap();
    if child.id() as Pid == pid {
        return Some(child);
    }
    child.kill().unwrap();
    child.wait().unwrap();
    None
}

/// A `sleep 1000` of the test's that has exactly the host pid it was made with, killed and
/// reaped when dropped (see [`sleep_at_pid`]).
#[derive(Debug)]
pub struct AtPid {
    /// Its pid.
    pub pid: Pid,
}

impl Drop for AtPid {
    fn drop(&mut self) {
        // Our child until reaped: its pid cannot name another process before the wait.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        );
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), None);
    }
}

/// Starts `sleep 1000` with exactly the host pid `pid` (root: `clone3` with `set_tid`, as CRIU
/// restores pids), to play a process that took a pid some other process had. Deterministic,
/// unlike [`spawn_with_pid`]: it fails only when `pid` is taken now (`EEXIST`), never because
/// another process forked in between.
pub fn sleep_at_pid(pid: Pid) -> std::io::Result<AtPid> {
    crate::own();
    use std::ffi::CString;
    // `struct clone_args` of linux/sched.h, up to `set_tid_size` (CLONE_ARGS_SIZE_VER1).
    #[repr(C)]
    #[derive(Default)]
    struct CloneArgs {
        flags: u64,
        pidfd: u64,
        child_tid: u64,
        parent_tid: u64,
        exit_signal: u64,
        stack: u64,
        stack_size: u64,
        tls: u64,
        set_tid: u64,
        set_tid_size: u64,
    }
    let path = CString::new("/bin/sleep")?;
    let (a0, a1) = (CString::new("sleep")?, CString::new("1000")?);
    let argv = [a0.as_ptr(), a1.as_ptr(), std::ptr::null()];
    let envp = [std::ptr::null::<libc::c_char>()];
    let tid: [libc::pid_t; 1] = [pid];
    let args = CloneArgs {
        exit_signal: libc::SIGCHLD as u64,
        set_tid: tid.as_ptr() as u64,
        set_tid_size: 1,
        ..CloneArgs::default()
    };
    // SAFETY: clone3 without CLONE_VM is a fork: the child gets a copy of this memory (`args`,
    // `tid`, `path`, `argv`, `envp` were made before and stay alive here), and calls only
    // execve and _exit, which are async-signal-safe, before it replaces or ends itself.
    let r = unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const CloneArgs,
            std::mem::size_of::<CloneArgs>(),
        )
    };
    if r == 0 {
        // SAFETY: in the child, see above; nothing else runs here.
        unsafe {
            libc::execve(path.as_ptr(), argv.as_ptr(), envp.as_ptr());
            libc::_exit(127);
        }
    }
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(AtPid { pid: r as Pid })
}

/// A thread of the test's own process, waiting until dropped: a thread id that is not a
/// process's.
#[derive(Debug)]
pub struct Thread {
    /// Its thread id.
    pub tid: Pid,
    done: Option<std::sync::mpsc::Sender<()>>,
    join: Option<std::thread::JoinHandle<()>>,
}

impl Thread {
    /// Starts it; returns once its thread id is known.
    pub fn start() -> Thread {
        let (tx, rx) = std::sync::mpsc::channel();
        let (done, done_rx) = std::sync::mpsc::channel::<()>();
        let join = std::thread::spawn(move || {
            tx.send(nix::unistd::gettid().as_raw()).unwrap();
            let _ = done_rx.recv();
        });
        Thread {
            tid: rx.recv().unwrap(),
            done: Some(done),
            join: Some(join),
        }
    }
}

impl Drop for Thread {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(j) = self.join.take() {
            let _ = j.join();
        }
    }
}
