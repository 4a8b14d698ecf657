//! Starting the holder so that it outlives whoever started it, and finding or starting it from
//! the guard's side.
//!
//! # Design
//! - [`harden`] is what the holder does to itself before it serves: every signal whose default
//!   action ends or stops a process is ignored (`SIG_IGN`: the kernel discards it), its
//!   `oom_score_adj` is set to -1000, its fd limit raised to the hard limit (every pinned fd is
//!   one), and it moves into a cgroup of its own ([`CgroupChoice`]), so that what kills the
//!   agent's cgroup (`systemctl kill`, `KillMode=control-group`, a container restart that kills
//!   the container's cgroup) does not reach it.
//! - [`detach`] is `cryo guard holder --detach`: fork (the process is single-threaded then), the
//!   child starts a session of its own (no terminal, no process group of the caller's),
//!   chdir `/`, stdin and stdout on `/dev/null`, stderr on the holder's log, hardens itself and
//!   serves; the parent returns once the child's socket answers (or with the child's error), and
//!   exits: the holder's parent is then init (or the nearest subreaper), never the agent.
//! - [`ensure`] is the guard's side: adopt the holder that answers, or run the launch command
//!   (`cryo guard holder --detach`) and adopt the one it started.
//!
//! # Limitations
//! - Moving into a cgroup of its own needs the host's cgroup tree: on Kubernetes the agent's
//!   container sees its own cgroup namespace, so the DaemonSet mounts the host's tree and names it
//!   in `CRYO_CGROUP_ROOT`; without it the holder stays in the container's cgroup and says so
//!   ([`Setup::cgroup`]), and a restart of the container then ends it.
//! - Under systemd the cgroup is created at the root of the tree, outside every unit (systemd does
//!   not manage or kill it, but `systemd-cgls` shows it outside any unit).
//! - `oom_score_adj` below 0 needs `CAP_SYS_RESOURCE`; without it the holder runs with what it
//!   inherited and says so.

use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use crate::client::{ClientError, HolderClient};
use crate::proto::HolderInfo;
use crate::server::{self, Log, ServeError, ServeOptions};
use crate::sys;
use cryo_state::StateDir;

/// The cgroup the holder moves into, under the cgroup tree's root.
pub const CGROUP_NAME: &str = "cryo-pins";
/// The environment variable that names the host's cgroup tree when `/sys/fs/cgroup` is not it
/// (the agent's container on Kubernetes), as the agent's other cgroup lookups read it.
pub const CGROUP_ROOT_ENV: &str = "CRYO_CGROUP_ROOT";
/// The environment variable that chooses the holder's cgroup ([`CgroupChoice::from_env`]).
pub const CGROUP_CHOICE_ENV: &str = "CRYO_HOLDER_CGROUP";
/// The exit status of `cryo guard holder` when another holder runs on the state directory.
pub const EXIT_ALREADY_RUNNING: i32 = 3;

/// Where the holder puts itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CgroupChoice {
    /// `CRYO_CGROUP_ROOT` if set, else `/sys/fs/cgroup`: a [`CGROUP_NAME`] cgroup there.
    Auto,
    /// Stay in the cgroup it was started in.
    Stay,
    /// A cgroup named `name` under the tree mounted at `root` (v2: `root/name`; v1: `root/*/name`
    /// in every hierarchy).
    Under {
        /// The tree's root (`/sys/fs/cgroup`).
        root: PathBuf,
        /// The cgroup's name.
        name: String,
    },
}

impl CgroupChoice {
    /// From [`CGROUP_CHOICE_ENV`]: `auto` (or unset), `stay`, or `ROOT:NAME`.
    pub fn from_env() -> Result<Self, String> {
        match std::env::var(CGROUP_CHOICE_ENV).as_deref() {
            Err(_) | Ok("" | "auto") => Ok(Self::Auto),
            Ok("stay") => Ok(Self::Stay),
            Ok(spec) => match spec.split_once(':') {
                Some((root, name)) if !name.is_empty() && !name.contains('/') => Ok(Self::Under {
                    root: root.into(),
                    name: name.into(),
                }),
                _ => Err(format!(
                    "{CGROUP_CHOICE_ENV}={spec:?}: expected auto, stay or ROOT:NAME"
                )),
            },
        }
    }
}

/// What [`harden`] achieved, as the holder reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setup {
    /// `-1000`, or what it is and why -1000 could not be set.
    pub oom_score_adj: String,
    /// Where it moved, or why it stayed.
    pub cgroup: String,
    /// Signals that could not be ignored (none on Linux).
    pub signals_not_ignored: Vec<i32>,
}

/// Ignores every signal whose default action ends or stops a process, sets `oom_score_adj` to
/// -1000, raises the fd limit, and moves into a cgroup of its own. Never fails: what could not be
/// done is in the [`Setup`].
pub fn harden(cgroup: &CgroupChoice) -> Setup {
    let signals_not_ignored = sys::ignore_killing_signals()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    // Every pinned fd counts against the limit.
    let lim = rustix::process::getrlimit(rustix::process::Resource::Nofile);
    if lim.maximum.is_some() || lim.current.is_some() {
        let _ = rustix::process::setrlimit(
            rustix::process::Resource::Nofile,
            rustix::process::Rlimit {
                current: lim.maximum,
                maximum: lim.maximum,
            },
        );
    }
    let me = std::process::id() as i32;
    let oom_score_adj = match cryo_proc::ProcHandle::open(me) {
        Ok(h) => match h.set_oom_score_adj(-1000) {
            Ok(()) => "-1000".to_string(),
            Err(e) => format!(
                "{} (-1000 refused: {e})",
                h.oom_score_adj()
                    .map_or_else(|e| e.to_string(), |v| v.to_string())
            ),
        },
        Err(e) => format!("unknown ({e})"),
    };
    let cgroup = match cgroup {
        CgroupChoice::Stay => format!("{} (stayed where it was started)", own_cgroup()),
        CgroupChoice::Auto => {
            let root = std::env::var_os(CGROUP_ROOT_ENV);
            let named = root.is_some();
            let root = root.map_or_else(|| PathBuf::from("/sys/fs/cgroup"), PathBuf::from);
            let mut report = move_under(&root, CGROUP_NAME);
            if !named && in_private_cgroup_namespace() {
                report.push_str(&format!(
                    "; WARNING: this is a cgroup namespace of its own (a container?): the cgroup is \
                     inside the container's and a restart of the container ends the holder and \
                     closes every pin; mount the host's cgroup tree and name it in {CGROUP_ROOT_ENV}"
                ));
            }
            report
        }
        CgroupChoice::Under { root, name } => move_under(root, name),
    };
    Setup {
        oom_score_adj,
        cgroup,
        signals_not_ignored,
    }
}

/// This process's cgroups as `/proc/self/cgroup` shows them, one `hierarchy:controllers:path` each.
fn own_cgroup() -> String {
    let me = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(cryo_proc::Pid::MAX);
    cryo_proc::ProcHandle::open(me)
        .and_then(|h| h.cgroups())
        .map(|all| {
            all.iter()
                .map(|c| format!("{}:{}:{}", c.hierarchy, c.controllers, c.path))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

/// Whether this process's cgroup namespace differs from init's (pid 1 of this pid namespace).
fn in_private_cgroup_namespace() -> bool {
    let me = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(cryo_proc::Pid::MAX);
    matches!(
        cryo_proc::same_namespace(me, 1, cryo_proc::NamespaceKind::Cgroup),
        Ok(false)
    )
}

/// Creates `name` under the tree at `root` (v2: one directory; v1: one per hierarchy, the unified
/// one of a hybrid host included) and moves this process there. Returns what was done.
fn move_under(root: &Path, name: &str) -> String {
    let me = std::process::id().to_string();
    let trees: Vec<PathBuf> = if root.join("cgroup.controllers").is_file() {
        vec![root.to_path_buf()]
    } else {
        match fs::read_dir(root) {
            Ok(rd) => {
                let mut t: Vec<PathBuf> = rd
                    .filter_map(Result::ok)
                    .map(|e| e.path())
                    .filter(|p| {
                        p.join("cgroup.procs").is_file()
                            && !fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_symlink())
                    })
                    .collect();
                t.sort();
                t
            }
            Err(e) => {
                return format!(
                    "stayed in {} (cannot read {}: {e})",
                    own_cgroup(),
                    root.display()
                )
            }
        }
    };
    if trees.is_empty() {
        return format!(
            "stayed in {} (no cgroup tree at {})",
            own_cgroup(),
            root.display()
        );
    }
    let mut moved = Vec::new();
    let mut failed = Vec::new();
    for tree in trees {
        let dir = tree.join(name);
        let r = fs::create_dir(&dir)
            .or_else(|e| {
                if e.kind() == io::ErrorKind::AlreadyExists {
                    Ok(())
                } else {
                    Err(e)
                }
            })
            .and_then(|()| {
                // A v1 cpuset cgroup takes no process until it has CPUs and memory nodes.
                for f in ["cpuset.cpus", "cpuset.mems"] {
                    let own = dir.join(f);
                    if own.is_file() && fs::read_to_string(&own)?.trim().is_empty() {
                        fs::write(&own, fs::read_to_string(tree.join(f))?.trim())?;
                    }
                }
                fs::write(dir.join("cgroup.procs"), &me)
            });
        match r {
            Ok(()) => moved.push(dir.display().to_string()),
            Err(e) => failed.push(format!("{}: {e}", dir.display())),
        }
    }
    let mut out = if moved.is_empty() {
        format!("stayed in {}", own_cgroup())
    } else {
        format!("moved to {}", moved.join(" "))
    };
    if !failed.is_empty() {
        out.push_str(&format!("; could not move into {}", failed.join("; ")));
    }
    out
}

/// What a detaching holder tells its parent through the readiness pipe.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum Readiness {
    Ready(HolderInfo),
    AlreadyRunning(String),
    Failed(String),
}

/// Starting a detached holder failed.
#[derive(Debug, thiserror::Error)]
pub enum DetachError {
    /// Another holder runs on the state directory.
    #[error("{0}")]
    AlreadyRunning(String),
    /// The holder could not start.
    #[error("the pin holder could not start: {0}")]
    Failed(String),
    /// Forking failed.
    #[error("cannot start the pin holder: {0}")]
    Fork(io::Error),
}

/// `cryo guard holder --detach`: forks the holder off in a session of its own and returns its
/// info once it serves. Call it from a single-threaded process (before any thread is started).
pub fn detach(
    state: &StateDir,
    cgroup: &CgroupChoice,
    take_over: bool,
) -> Result<HolderInfo, DetachError> {
    let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
        .map_err(|e| DetachError::Fork(e.into()))?;
    match sys::fork().map_err(DetachError::Fork)? {
        sys::Forked::Parent(_child) => {
            drop(write);
            let mut text = String::new();
            let _ = fs::File::from(read).read_to_string(&mut text);
            match serde_json::from_str::<Readiness>(&text) {
                Ok(Readiness::Ready(info)) => Ok(info),
                Ok(Readiness::AlreadyRunning(m)) => Err(DetachError::AlreadyRunning(m)),
                Ok(Readiness::Failed(m)) => Err(DetachError::Failed(m)),
                Err(_) => Err(DetachError::Failed(format!(
                    "it exited before it was ready (see {})",
                    state.pin_holder_log().display()
                ))),
            }
        }
        sys::Forked::Child => {
            drop(read);
            // Closed once the readiness is written: the parent reads to the end of the pipe.
            let mut write = Some(fs::File::from(write));
            let log_path = state.pin_holder_log();
            let _ = fs::create_dir_all(state.root());
            let ready = detach_child(&log_path);
            let opts = ServeOptions {
                state: state.clone(),
                take_over,
                setup: harden(cgroup),
            };
            let log = if ready {
                Log::open(&log_path)
            } else {
                Log::stderr()
            };
            let result = server::serve(&opts, log, |info| {
                if let Some(mut w) = write.take() {
                    let msg =
                        serde_json::to_string(&Readiness::Ready(info.clone())).unwrap_or_default();
                    let _ = w.write_all(msg.as_bytes());
                }
            });
            let why = match result {
                Ok(never) => match never {},
                Err(ServeError::AlreadyRunning(p)) => Readiness::AlreadyRunning(format!(
                    "a pin holder already runs on {}",
                    p.display()
                )),
                Err(e) => Readiness::Failed(e.to_string()),
            };
            if let Some(mut w) = write.take() {
                let msg = serde_json::to_string(&why).unwrap_or_default();
                let _ = w.write_all(msg.as_bytes());
            }
            std::process::exit(match why {
                Readiness::AlreadyRunning(_) => EXIT_ALREADY_RUNNING,
                _ => 1,
            });
        }
    }
}

/// In the forked child: a session of its own, `/` as working directory, stdin and stdout on
/// `/dev/null`, stderr appended to the log. Returns whether the log could be opened.
fn detach_child(log: &Path) -> bool {
    let _ = rustix::process::setsid();
    let _ = std::env::set_current_dir("/");
    if let Ok(null) = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/null")
    {
        let null = OwnedFd::from(null);
        for fd in [0, 1] {
            let _ = dup2(&null, fd);
        }
    }
    match fs::OpenOptions::new().create(true).append(true).open(log) {
        Ok(f) => {
            let f = OwnedFd::from(f);
            let _ = dup2(&f, 2);
            true
        }
        Err(_) => false,
    }
}

/// Puts a copy of `from` on the standard stream `to` (replacing it, never closing another
/// owner's fd).
fn dup2(from: &OwnedFd, to: i32) -> io::Result<()> {
    nix::unistd::dup2(from.as_raw_fd(), to)
        .map(drop)
        .map_err(io::Error::from)
}

/// Whether the guard found the holder running or started it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Adoption {
    /// A holder was running: it is adopted as it is (pins and all).
    Adopted(HolderInfo),
    /// No holder answered: this one was started.
    Started(HolderInfo),
}

impl Adoption {
    /// The holder.
    pub fn holder(&self) -> &HolderInfo {
        match self {
            Adoption::Adopted(h) | Adoption::Started(h) => h,
        }
    }
}

/// Finding or starting the holder failed.
#[derive(Debug, thiserror::Error)]
pub enum EnsureError {
    /// The running holder cannot be used (not root, too old, refuses).
    #[error(transparent)]
    Client(#[from] ClientError),
    /// The launch command could not run.
    #[error("cannot run the pin holder's launch command {command}: {source}")]
    Spawn {
        /// The command.
        command: String,
        /// Why.
        source: io::Error,
    },
    /// The launch command failed.
    #[error("the pin holder's launch command {command} failed ({status}): {stderr}")]
    Launch {
        /// The command.
        command: String,
        /// Its exit status.
        status: String,
        /// What it said.
        stderr: String,
    },
}

/// How long to wait for a holder that another launcher is starting.
const RACE_PATIENCE: Duration = Duration::from_secs(10);
/// How long one round of [`ensure`] waits for a holder it did not start to answer.
const RACE_ROUND: Duration = Duration::from_secs(1);

/// Adopts the holder of `state`, or runs `launch` (a `cryo guard holder --detach` command line
/// for the same state directory) and adopts the holder it started.
///
/// A holder that is exiting (it closes the connection before its greeting, and holds
/// `pins.lock` until it is gone) is waited out: the launch command then says another holder
/// runs, and this tries again, connecting and launching, until [`RACE_PATIENCE`] has passed.
pub fn ensure(state: &StateDir, mut launch: Command) -> Result<Adoption, EnsureError> {
    let client = HolderClient::new(state);
    let command = format!("{launch:?}");
    let deadline = Instant::now() + RACE_PATIENCE;
    loop {
        match client.connect() {
            Ok(s) => return Ok(Adoption::Adopted(s.holder)),
            Err(ClientError::NotRunning(_) | ClientError::Exiting(_)) => {}
            Err(e) => return Err(e.into()),
        }
        let out = launch
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .output()
            .map_err(|source| EnsureError::Spawn {
                command: command.clone(),
                source,
            })?;
        match out.status.code() {
            Some(0) => {
                return Ok(Adoption::Started(
                    client.connect_within(RACE_PATIENCE)?.holder,
                ))
            }
            // Another holder holds the lock: one that another launcher is starting (adopt it
            // once it answers), or one that is exiting (then launch again).
            Some(EXIT_ALREADY_RUNNING) => {
                let left = deadline.saturating_duration_since(Instant::now());
                match client.connect_within(left.min(RACE_ROUND)) {
                    Ok(s) => return Ok(Adoption::Adopted(s.holder)),
                    Err(ClientError::NotRunning(_) | ClientError::Exiting(_))
                        if Instant::now() < deadline => {}
                    Err(e) => return Err(e.into()),
                }
            }
            _ => {
                return Err(EnsureError::Launch {
                    command,
                    status: out.status.to_string(),
                    stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                })
            }
        }
    }
}

/// Runs the holder in this process (foreground): hardens, serves; returns only if it cannot
/// start.
pub fn run_foreground(
    state: &StateDir,
    cgroup: &CgroupChoice,
    take_over: bool,
    ready: impl FnOnce(&HolderInfo),
) -> ServeError {
    let opts = ServeOptions {
        state: state.clone(),
        take_over,
        setup: harden(cgroup),
    };
    match server::serve(&opts, Log::stderr(), ready) {
        Ok(never) => match never {},
        Err(e) => e,
    }
}
