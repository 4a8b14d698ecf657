//! Victims and a recording policy for the tracer tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::os::fd::{OwnedFd, RawFd};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, Receiver};
use std::sync::{Condvar, Mutex};
use std::time::Instant;

use cryo_guard::{Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee, TracerStats};
use cryo_proc::{Pid, ProcHandle, Signal};

pub use cryo_testkit::{eventually, procs, PATIENCE};

pub fn testee() -> &'static str {
    env!("CARGO_BIN_EXE_cryo-guard-testee")
}

pub fn my_pid() -> Pid {
    Pid::try_from(std::process::id()).unwrap()
}

/// Reads a child's stdout lines on a thread.
pub struct Lines(Receiver<String>);

impl Lines {
    pub fn new(out: impl std::io::Read + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self(rx)
    }

    /// The next line starting with `prefix` (others are skipped), without the prefix.
    pub fn expect(&self, prefix: &str) -> String {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .0
                .recv_timeout(left)
                .unwrap_or_else(|e| panic!("no line starting with {prefix:?}: {e}"));
            if let Some(rest) = line.strip_prefix(prefix) {
                return rest.trim().to_string();
            }
        }
    }
}

/// `cryo-guard-testee victim`, started through `detach` so it is not our child.
pub struct Victim {
    pub pid: Pid,
    pub helper: Pid,
    pub pidfd: ProcHandle,
    stdin: ChildStdin,
    pub lines: Lines,
}

impl Victim {
    pub fn spawn() -> Self {
        Self::spawn_with_stderr(None)
    }

    pub fn spawn_with_stderr(stderr: Option<OwnedFd>) -> Self {
        Self::spawn_as(stderr, false)
    }

    /// A victim with one thread only (`helper` is 0).
    pub fn spawn_single() -> Self {
        Self::spawn_as(None, true)
    }

    fn spawn_as(stderr: Option<OwnedFd>, single: bool) -> Self {
        let mut cmd = Command::new(testee());
        cmd.args(["detach", "victim"])
            .args(single.then_some("single"))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        if let Some(fd) = stderr {
            cmd.stderr(Stdio::from(fd));
        }
        let mut launcher: Child = cmd.spawn().expect("spawn testee");
        let stdin = launcher.stdin.take().unwrap();
        let lines = Lines::new(launcher.stdout.take().unwrap());
        drop(cmd);
        assert!(launcher.wait().unwrap().success());
        let pid: Pid = lines.expect("pid ").parse().unwrap();
        let pidfd = ProcHandle::open(pid).unwrap();
        let helper: Pid = lines.expect("helper ").parse().unwrap();
        lines.expect("ready");
        Self {
            pid,
            helper,
            pidfd,
            stdin,
            lines,
        }
    }

    pub fn send(&mut self, cmd: &str) {
        writeln!(self.stdin, "{cmd}").unwrap();
        self.stdin.flush().unwrap();
    }

    pub fn ping(&mut self) {
        self.send("ping");
        self.lines.expect("pong");
    }

    pub fn signal(&self, sig: i32) {
        self.pidfd.signal(Signal::try_from(sig).unwrap()).unwrap();
    }
}

impl Drop for Victim {
    fn drop(&mut self) {
        let _ = self.pidfd.signal(Signal::SIGKILL);
    }
}

/// `State` letter of one thread.
pub fn thread_state(pid: Pid, tid: Pid) -> char {
    procs::thread_state(pid, tid).unwrap()
}

#[derive(Debug)]
pub enum Ev {
    Fatal(FatalSignal),
    ExitStop {
        tid: Pid,
        cause: ExitCause,
        pinned: Vec<RawFd>,
        failed: usize,
    },
    Gone(ExitCause),
    /// The leader's exit stop of another thread's exec.
    BeforeExec,
    /// An exec stop: the thread that called `execve`.
    Exec(Pid),
}

type Hook = Box<dyn Fn(&Tracee, &FatalSignal) + Send + Sync>;

/// Records every callback; decides with `decision`; pins `pin`; keeps the pins.
pub struct Recorder {
    events: Mutex<Vec<Ev>>,
    cv: Condvar,
    pub decision: Mutex<Decision>,
    pub pin: Mutex<Vec<RawFd>>,
    pub pinned: Mutex<Vec<PinnedFds>>,
    pub hook: Mutex<Option<Hook>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Self {
            events: Mutex::new(Vec::new()),
            cv: Condvar::new(),
            decision: Mutex::new(Decision::Deliver),
            pin: Mutex::new(Vec::new()),
            pinned: Mutex::new(Vec::new()),
            hook: Mutex::new(None),
        }
    }
}

impl Recorder {
    fn push(&self, ev: Ev) {
        self.events.lock().unwrap().push(ev);
        self.cv.notify_all();
    }

    /// Waits until `pred` holds over the events so far.
    pub fn wait_for(&self, what: &str, pred: impl Fn(&[Ev]) -> bool) {
        let deadline = Instant::now() + PATIENCE;
        let mut ev = self.events.lock().unwrap();
        while !pred(&ev) {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(!left.is_zero(), "waited for {what}; events: {ev:?}");
            ev = self.cv.wait_timeout(ev, left).unwrap().0;
        }
    }

    pub fn wait_gone(&self) -> ExitCause {
        self.wait_for("process gone", |e| {
            e.iter().any(|e| matches!(e, Ev::Gone(_)))
        });
        self.with(|e| {
            e.iter()
                .find_map(|e| match e {
                    Ev::Gone(c) => Some(*c),
                    _ => None,
                })
                .unwrap()
        })
    }

    pub fn with<T>(&self, f: impl FnOnce(&[Ev]) -> T) -> T {
        f(&self.events.lock().unwrap())
    }

    pub fn fatals(&self) -> Vec<FatalSignal> {
        self.with(|e| {
            e.iter()
                .filter_map(|e| match e {
                    Ev::Fatal(f) => Some(*f),
                    _ => None,
                })
                .collect()
        })
    }
}

impl Policy for Recorder {
    fn on_fatal_signal(&self, target: &Tracee, signal: &FatalSignal) -> Decision {
        if let Some(hook) = self.hook.lock().unwrap().as_ref() {
            hook(target, signal);
        }
        self.push(Ev::Fatal(*signal));
        *self.decision.lock().unwrap()
    }

    fn fds_to_pin(&self, _: &Tracee) -> Vec<RawFd> {
        self.pin.lock().unwrap().clone()
    }

    fn on_exit_stop(&self, target: &Tracee, tid: Pid, cause: ExitCause, pinned: PinnedFds) {
        // The leader is held right here: it must still show its fd table.
        assert!(target.handle().fds().is_ok());
        let fds = pinned.fds.iter().map(|(n, _)| *n).collect();
        let failed = pinned.failed.len();
        self.pinned.lock().unwrap().push(pinned);
        self.push(Ev::ExitStop {
            tid,
            cause,
            pinned: fds,
            failed,
        });
    }

    fn on_gone(&self, _: &Tracee, cause: ExitCause) {
        self.push(Ev::Gone(cause));
    }

    fn before_exec(&self, target: &Tracee) {
        // The leader is held right here: the fd table is still intact.
        assert!(target.handle().fds().is_ok_and(|f| !f.is_empty()));
        self.push(Ev::BeforeExec);
    }

    fn on_exec(&self, _: &Tracee, thread: Pid) -> cryo_guard::AfterExec {
        self.push(Ev::Exec(thread));
        cryo_guard::AfterExec::Keep
    }
}

pub fn stats_eventually(tracer: &cryo_guard::Tracer, what: &str, f: impl Fn(&TracerStats) -> bool) {
    eventually(PATIENCE, what, || f(&tracer.stats()));
}
