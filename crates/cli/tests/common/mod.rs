//! The test kit's simulated GPU run from the `cryo` binary under test (`cryo sim driver`,
//! `cryo sim worker`), and the `cryo` command lines the tests run against it.
#![allow(dead_code, unused_imports)]

use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

pub use cryo_testkit::http::{http, Endpoint};
pub use cryo_testkit::sim::{Program, Worker, WorkerSpec};
pub use cryo_testkit::{eventually, procs, PATIENCE};

pub const CRYO: &str = env!("CARGO_BIN_EXE_cryo");

/// The simulated GPU's commands through the `cryo` binary.
pub fn program() -> Program {
    Program::cryo(CRYO)
}

/// A `cryo` command with no inherited cryo settings.
pub fn cryo() -> Command {
    cryo_testkit::own();
    let mut c = Command::new(CRYO);
    cryo_testkit::sim::clean_env(&mut c);
    c
}

/// A simulated driver (2 GPUs of 1 GiB) and the workers started through it.
pub struct Sim {
    core: cryo_testkit::sim::Sim,
    workers: Vec<Worker>,
}

impl Deref for Sim {
    type Target = cryo_testkit::sim::Sim;
    fn deref(&self) -> &Self::Target {
        &self.core
    }
}

impl Sim {
    pub fn start() -> Sim {
        Sim {
            core: cryo_testkit::sim::Sim::start_with(
                &program(),
                &["--gpus", "2", "--gpu-memory", "1GiB"],
            ),
            workers: Vec::new(),
        }
    }

    /// Starts a sim worker with `memory` of device memory; returns its pid and port.
    pub fn worker(&mut self, memory: &str) -> (i32, u16) {
        let w = self.core.worker(memory);
        let out = (w.pid, w.port);
        self.workers.push(w);
        out
    }

    /// `cryo --gpu sim --sim-dir DIR ARGS...`.
    pub fn cryo(&self, args: &[&str]) -> Output {
        self.cmd().args(args).output().unwrap()
    }

    /// `cryo --gpu sim --sim-dir DIR` (more arguments to come).
    pub fn cmd(&self) -> Command {
        let mut c = cryo();
        c.args(["--gpu", "sim", "--sim-dir"]).arg(self.path());
        c
    }

    /// `cryo --gpu sim --sim-dir DIR --state-dir STATE` (more arguments to come).
    pub fn cmd_at(&self, state: &Path) -> Command {
        let mut c = self.cmd();
        c.arg("--state-dir").arg(state);
        c
    }

    /// `cryo cuda-checkpoint ARGS...` against this driver, journaling into a state directory of
    /// this test (never the host's).
    pub fn compat(&self, args: &[&str]) -> Output {
        self.cmd_at(&self.path().join("state"))
            .arg("cuda-checkpoint")
            .args(args)
            .output()
            .unwrap()
    }

    /// The checkpoint state of `pid`, read through `cryo gpu state`.
    pub fn state(&self, pid: i32) -> String {
        let out = self.cryo(&["gpu", "state", "--pid", &pid.to_string()]);
        assert!(
            out.status.success(),
            "gpu state failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap().trim().to_string()
    }

    /// The UUID of GPU `index` of the simulated driver.
    pub fn gpu_uuid(&self, index: usize) -> String {
        self.gpu.inspect.gpus().unwrap()[index].uuid.to_string()
    }

    /// `cryo guard release --gpu GPU --i-understand-this-may-wedge-the-host` on `state` (through
    /// its agent when one runs); its stdout.
    pub fn release_pins(&self, state: &Path, gpu: &str) -> String {
        ok({
            let mut c = self.cmd_at(state);
            c.args([
                "guard",
                "release",
                "--gpu",
                gpu,
                "--i-understand-this-may-wedge-the-host",
            ]);
            c
        })
    }
}

/// Runs `c`, asserts it succeeded, returns its stdout.
pub fn ok(mut c: Command) -> String {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed ({}): {}{}",
        out.status,
        stdout(&out),
        stderr(&out)
    );
    stdout(&out)
}

/// Lock, checkpoint, restore, unlock through `cryo gpu`, which journals `RestoreCompleted` in
/// `state`: `pid` is now a live restored process cryo knows as such.
pub fn make_restored(sim: &Sim, state: &Path, pid: i32) {
    for action in ["lock", "checkpoint", "restore", "unlock"] {
        ok({
            let mut c = sim.cmd_at(state);
            c.args(["gpu", action, "--pid", &pid.to_string()]);
            c
        });
    }
}

/// A running `cryo guard` with its log in the state directory; SIGKILLed on drop.
pub struct GuardProc {
    child: Child,
    log: PathBuf,
}

impl GuardProc {
    /// `cryo guard EXTRA...`, once its control socket answers.
    pub fn start(sim: &Sim, state: &Path, extra: &[&str]) -> GuardProc {
        Self::spawn(sim.cmd_at(state), state, extra)
    }

    /// `CMD guard EXTRA...` (`cmd`: `cryo` with its backend and `state` chosen), once its control
    /// socket answers.
    pub fn spawn(mut cmd: Command, state: &Path, extra: &[&str]) -> GuardProc {
        cryo_testkit::own();
        static N: AtomicU32 = AtomicU32::new(0);
        let log = state.join(format!("guard-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(state).unwrap();
        let f = std::fs::File::create(&log).unwrap();
        let child = cmd
            .arg("guard")
            .args(scan_none_unless_asked(extra))
            .args(extra)
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(f.try_clone().unwrap())
            .stderr(f)
            .spawn()
            .unwrap();
        let st = cryo_state::StateDir::new(state);
        eventually(PATIENCE, "the guard's socket", || {
            cryo_guard::control::GuardClient::new(&st)
                .status()
                .ok()
                .flatten()
                .is_some()
        });
        GuardProc { child, log }
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Where its log is.
    pub fn log_path(&self) -> &Path {
        &self.log
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for GuardProc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A running `cryo agent run` with its log in the state directory; SIGKILLed on drop.
pub struct AgentProc {
    pub child: Child,
    pub log: PathBuf,
    pub state: PathBuf,
}

impl AgentProc {
    /// `cryo agent run --metrics-listen 127.0.0.1:0 EXTRA...`, once its socket answers.
    pub fn start(sim: &Sim, state: &Path, extra: &[&str]) -> AgentProc {
        Self::start_with(sim, state, extra, |_| {})
    }

    /// As [`AgentProc::start`], with `f` adjusting the command first.
    pub fn start_with(
        sim: &Sim,
        state: &Path,
        extra: &[&str],
        f: impl FnOnce(&mut Command),
    ) -> AgentProc {
        static N: AtomicU32 = AtomicU32::new(0);
        let log = state.join(format!("agent-{}.log", N.fetch_add(1, Ordering::Relaxed)));
        std::fs::create_dir_all(state).unwrap();
        let file = std::fs::File::create(&log).unwrap();
        let mut c = sim.cmd_at(state);
        c.args(["agent", "run", "--metrics-listen", "127.0.0.1:0"])
            .args(scan_none_unless_asked(extra))
            .args(extra)
            .stdin(Stdio::null())
            .stdout(file.try_clone().unwrap())
            .stderr(file);
        f(&mut c);
        let mut child = c.spawn().unwrap();
        let client = cryo_api::AgentClient::new(cryo_state::StateDir::new(state).agent_socket());
        eventually(PATIENCE, "the agent's socket", || {
            if let Ok(Some(st)) = child.try_wait() {
                panic!(
                    "the agent exited ({st}): {}",
                    std::fs::read_to_string(&log).unwrap_or_default()
                );
            }
            client.status().is_ok()
        });
        AgentProc {
            child,
            log,
            state: state.to_path_buf(),
        }
    }

    /// The client of its socket.
    pub fn client(&self) -> cryo_api::AgentClient {
        cryo_api::AgentClient::new(cryo_state::StateDir::new(&self.state).agent_socket())
    }

    /// What it logged so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// SIGKILL, and reap.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `--scan none` unless `extra` chooses: the tests' workers are fresh CUDA processes that only
/// the tests of the scan want guarded (the default, `all-cuda`, would pin each one's exit).
pub fn scan_none_unless_asked(extra: &[&str]) -> &'static [&'static str] {
    if extra.contains(&"--scan") {
        &[]
    } else {
        &["--scan", "none"]
    }
}

/// Asks the pin holder of `state` to exit (it outlives the agent by design); SIGKILLs it when it
/// refuses (it holds pins: the end of the test anyway).
pub fn stop_pin_holder(state: &Path) {
    let c = cryo_holder::HolderClient::new(&cryo_state::StateDir::new(state));
    let Ok(mut s) = c.connect() else { return };
    let pid = s.holder.id;
    let Ok(h) = pid.open() else {
        return;
    };
    if s.exit().is_err() {
        let _ = h.signal(cryo_proc::Signal::SIGKILL);
    }
    // Gone before the next agent of the test looks for a holder.
    assert!(
        h.wait_exit(PATIENCE),
        "the pin holder {} did not exit",
        pid.pid
    );
}

impl Drop for AgentProc {
    fn drop(&mut self) {
        let id = cryo_journal::ProcId::of(self.pid()).ok();
        self.kill();
        stop_pin_holder(&self.state);
        if let Some(id) = id {
            end_keepers_of(id);
        }
    }
}

/// SIGKILLs (by pidfd) the keepers of activator sockets that agent `agent` started (`cryo agent
/// keep-listener --agent PID:START`, see `cryo_agent::keeper`): a keeper outlives its agent by
/// design (`LINGER`, for the next agent), so a test that is done with its agent ends them, or
/// the test kit finds them running after the test. Keepers of other agents (a next one the
/// test started) are left alone.
pub fn end_keepers_of(agent: cryo_journal::ProcId) {
    let ours = [
        "agent",
        "keep-listener",
        "--agent",
        &format!("{}:{}", agent.pid, agent.start_time),
    ];
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return;
    };
    for pid in entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
    {
        let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else {
            continue;
        };
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).skip(1).take(4).collect();
        if args
            .iter()
            .map(|a| String::from_utf8_lossy(a))
            .ne(ours.iter().map(|a| std::borrow::Cow::Borrowed(*a)))
        {
            continue;
        }
        if let Ok(h) = cryo_proc::ProcHandle::open(pid) {
            let _ = h.signal(cryo_proc::Signal::SIGKILL);
            h.wait_exit(PATIENCE);
            procs::reap(pid);
        }
    }
}

/// `cryo --gpu sim --sim-dir DIR --state-dir STATE ARGS...`, whatever its outcome.
pub fn run(sim: &Sim, state: &Path, args: &[&str]) -> Output {
    sim.cmd_at(state).args(args).output().unwrap()
}

/// Asserts the command succeeded, showing its output when not.
pub fn succeeded(o: &Output) {
    assert!(
        o.status.success(),
        "status {:?}\nstdout: {}\nstderr: {}",
        o.status,
        stdout(o),
        stderr(o)
    );
}

/// The command's stdout as one JSON value (`--json`), showing its output when it is not.
pub fn json(o: &Output) -> serde_json::Value {
    serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}\n{}", stdout(o), stderr(o)))
}

/// The events of the journal of the state directory `state`, in order.
/// `events` (oldest first) show process `pid` of a restore not journaled as done checkpointed
/// again, restored with its completion journaled, and only then unlocked: never unlocked on the
/// driver's LOCKED alone.
pub fn checkpointed_restored_then_unlocked(events: &[cryo_journal::Event], pid: i32) {
    use cryo_journal::Event;
    let mine: Vec<&Event> = events
        .iter()
        .filter(|e| e.pids().iter().any(|p| p.pid == pid))
        .collect();
    let at = |f: &dyn Fn(&Event) -> bool| mine.iter().position(|e| f(e));
    let order = [
        at(&|e| matches!(e, Event::Checkpointed { .. })),
        at(&|e| matches!(e, Event::RestoreCompleted { .. })),
        at(&|e| matches!(e, Event::Unlocked { .. })),
    ];
    assert!(
        matches!(order, [Some(c), Some(r), Some(u)] if c < r && r < u),
        "pid {pid} unlocked on the driver's LOCKED alone: {mine:?}"
    );
}

pub fn events(state: &Path) -> Vec<cryo_journal::Event> {
    cryo_journal::read(state.join("journal"))
        .unwrap()
        .records
        .into_iter()
        .map(|r| r.event)
        .collect()
}

/// Reads `err` (a command's stderr) until what it said contains `what` (a pausing failpoint's
/// "paused until"); what it said. Fails if it ends first.
pub fn said_until(err: &mut impl std::io::Read, what: &str) -> String {
    let mut said = String::new();
    let mut buf = [0u8; 256];
    while !said.contains(what) {
        let n = err.read(&mut buf).unwrap();
        assert!(n > 0, "it ended before saying {what:?}: {said}");
        said.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    said
}

/// Fills the last page of the journal of the state directory `state`, on a disk already full
/// (`cryo_testkit::disk::SmallDisk::fill`): a full disk still takes a write into the slack of a
/// file's last page, so records are appended until one is refused (the last one, torn, is the
/// next writer's to cut).
pub fn fill_journal_page(state: &Path) {
    let journal = cryo_journal::Journal::open(state.join("journal")).unwrap();
    let filled = (0..1000).find(|_| {
        journal
            .append_unsynced(vec![cryo_journal::Event::Dumped {
                image: "filler".into(),
                ms: 0,
                bytes: 0,
            }])
            .is_err()
    });
    assert!(filled.is_some(), "the journal's last page never filled");
}

/// A fresh state directory for one test, named after it.
pub fn state_dir(prefix: &str) -> tempfile::TempDir {
    tempfile::Builder::new().prefix(prefix).tempdir().unwrap()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A program `cryo run --detach` started as pid 1 of pid and network namespaces of its own
/// ([`run_isolated`]). Dropped (at the end of the test, or while a failed test unwinds), it
/// SIGKILLs that process through its pidfd (never a process that took its pid since), which
/// ends every process of its pid namespace with it, waits for its end and reaps it if it is
/// the test's child. So a test that fails before it froze or stopped it leaves nothing
/// running (session 10: a fork loop left so ran for 27 minutes). A process frozen since (CRIU
/// killed it) or stopped is already gone: nothing to do.
pub struct Isolated {
    /// Its host pid.
    pub pid: i32,
    handle: cryo_proc::ProcHandle,
}

impl Isolated {
    /// Another handle on the process (its pidfd), which outlives this guard.
    pub fn handle(&self) -> cryo_proc::ProcHandle {
        self.handle.try_clone().unwrap()
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        // ESRCH: it already exited.
        let _ = self.handle.signal(cryo_proc::Signal::SIGKILL);
        if !self.handle.wait_exit(PATIENCE) {
            eprintln!("the isolated pid {} survived its SIGKILL", self.pid);
            return;
        }
        // Our zombie holds its pid until reaped: the pid is still this process's when it is
        // our child that started when the handle's did.
        let ours = cryo_proc::stat(self.pid).is_ok_and(|s| {
            s.ppid == std::process::id() as i32 && s.start_time == self.handle.start_time()
        });
        if ours {
            let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(self.pid), None);
        }
    }
}

/// `sleep 1000` as pid 1 of pid and network namespaces of its own (`cryo run --detach` through
/// `cmd`, a `cryo` command), working in `dir` (CRIU's parasite mounts a /proc of its namespace
/// at `proc.crtools` there: two dumps at once in one directory collide), its log there too,
/// with none of the test's fds but `lock` (a lock the test holds: it waits until the program
/// holds it too). Ended when the guard drops ([`Isolated`]).
pub fn run_isolated_sleep(cmd: Command, dir: &Path, lock: Option<std::os::fd::RawFd>) -> Isolated {
    run_isolated(cmd, dir, lock, &["sleep", "1000"])
}

/// [`run_isolated_sleep`] of any program: `argv` run detached by `cryo run` in `dir`.
pub fn run_isolated(
    mut cmd: Command,
    dir: &Path,
    lock: Option<std::os::fd::RawFd>,
    argv: &[&str],
) -> Isolated {
    cryo_testkit::own();
    let log = dir.join("run.log");
    cmd.args(["run", "--detach", "--log", log.to_str().unwrap()])
        .args(["--dir", dir.to_str().unwrap()])
        .arg("--")
        .args(argv);
    cryo_testkit::fds::close_inherited(&mut cmd, lock);
    let o = cmd.output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let pid: i32 = stdout(&o)
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or_else(|| panic!("no pid in {:?}", stdout(&o)));
    // Detached and running: nothing can have reaped it yet.
    let guard = Isolated {
        pid,
        handle: cryo_proc::ProcHandle::open(pid)
            .unwrap_or_else(|e| panic!("the isolated pid {pid}: {e}")),
    };
    if let Some(fd) = lock {
        eventually(PATIENCE, "the program to hold the lock", || {
            std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}"))
                .is_ok_and(|i| i.contains("lock:"))
        });
    }
    guard
}

/// A process that is certainly not a CUDA process.
pub fn sleeper() -> Child {
    cryo_testkit::own();
    Command::new("sleep").arg("60").spawn().unwrap()
}

/// How many standing duplicates of `pid`'s driver fds the agent behind `client` holds (0 when it
/// does not guard it).
pub fn standing_fds(client: &cryo_api::AgentClient, pid: i32) -> usize {
    client
        .status()
        .unwrap()
        .guard
        .guarded
        .iter()
        .find(|g| g.pid == pid)
        .map_or(0, |g| g.standing_fds)
}

/// The agent's arguments for the drain endgame (memory watch off) whose restart command appends
/// the quarantined GPUs to `out`: the file exists once a drain has run its command.
pub fn drain_args(out: &Path) -> Vec<String> {
    [
        "--no-memory-watch",
        "--endgame",
        "drain",
        "--restart-cmd",
        &format!("echo $CRYO_QUARANTINED_GPUS >> '{}'", out.display()),
    ]
    .map(String::from)
    .to_vec()
}

/// `cryo ARGS` paused at failpoint `failpoint` (its resume file `st/go`): the child and its
/// stderr, once it said it paused.
pub fn paused_at(
    sim: &Sim,
    st: &Path,
    args: &[&str],
    failpoint: &str,
) -> (std::process::Child, std::process::ChildStderr) {
    let mut child = sim
        .cmd_at(st)
        .env("CRYO_FAILPOINT", failpoint)
        .env("CRYO_FAILPOINT_RESUME", st.join("go"))
        .args(args)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = child.stderr.take().unwrap();
    said_until(&mut err, "paused until");
    (child, err)
}

/// `paused`, let go (`st/go` written): its status and all it said.
pub fn let_go(
    st: &Path,
    (mut child, mut err): (std::process::Child, std::process::ChildStderr),
) -> (std::process::ExitStatus, String) {
    use std::io::Read;
    std::fs::write(st.join("go"), b"").unwrap();
    let mut said = String::new();
    err.read_to_string(&mut said).unwrap();
    (child.wait().unwrap(), said)
}

/// `cryo wake PID` paused at failpoint `wake-before-restore` (it has read PID's state, CHECKPOINTED,
/// and not restored it yet), in the environment `agent` adds to (`None`: standalone, where the
/// failpoint is set on the command itself; its resume file is `st/go`): the child and its stderr.
pub fn a_wake_paused_before_its_restore(
    sim: &Sim,
    st: &Path,
    pid: i32,
    agent: Option<&AgentProc>,
) -> (std::process::Child, std::process::ChildStderr) {
    let failpoint = cryo_lifecycle::park::WAKE_BEFORE_RESTORE;
    let mut cmd = sim.cmd_at(st);
    if agent.is_none() {
        cmd.env("CRYO_FAILPOINT", failpoint)
            .env("CRYO_FAILPOINT_RESUME", st.join("go"));
    }
    let mut first = cmd
        .args(["wake", &pid.to_string()])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = first.stderr.take().unwrap();
    match agent {
        None => {
            said_until(&mut err, "paused until");
        }
        Some(a) => eventually(PATIENCE, "the agent's wake at its failpoint", || {
            a.log().contains(&format!("failpoint {failpoint} reached"))
        }),
    }
    assert_eq!(sim.state(pid), "checkpointed");
    (first, err)
}
