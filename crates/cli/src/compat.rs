//! NVIDIA's `cuda-checkpoint` command line, so CRIU's cuda plugin and existing scripts can run cryo.
//!
//! # Design
//! Reached when cryo is run under the name `cuda-checkpoint` (`cryo install-compat`, or
//! `ln -s cryo cuda-checkpoint`) or as `cryo cuda-checkpoint ARGS...`. The syntax is NVIDIA's
//! (r570 help text, plus r580's `--device-map`):
//!
//! ```text
//! --get-state --pid <pid>                 prints running | locked | checkpointed | failed
//! --get-restore-tid --pid <pid>           prints the restore thread's tid
//! --action lock|checkpoint|restore|unlock --pid <pid> [--timeout <ms>] [--device-map OLD=NEW,...]
//! --toggle --pid <pid> [--timeout <ms>] [--device-map OLD=NEW,...]
//! --help | -h
//! ```
//! Short forms `-p`, `-t`; `--opt=value` also accepted. Output conventions, which CRIU relies on:
//! the state word or the tid alone on stdout (CRIU `strtol`s the whole output of
//! `--get-restore-tid`, so nothing else may be printed, not even the backend line); actions print
//! nothing on success; on failure one line on stderr, `Could not <action> on process ID <pid>:
//! "<driver description>"` (`Error toggling CUDA in process ID <pid>: ...` for `--toggle`), and the
//! exit status is the `CUresult` ([`crate::exit::cuda_status`]). `--help` goes to stdout with status 0
//! and mentions `--action` (CRIU probes `cuda-checkpoint -h` for that word). Usage errors print
//! the problem and the help on stderr, status 1 (`CUDA_ERROR_INVALID_VALUE`, as NVIDIA's binary
//! does not document one).
//!
//! `--toggle`: running -> lock (with `--timeout`) + checkpoint; checkpointed -> restore (with
//! `--device-map`) + unlock; any other state is `CUDA_ERROR_ILLEGAL_STATE`. Unlike NVIDIA's
//! binary, a toggle whose checkpoint fails unlocks the process again, so it is left running.
//!
//! # Limitations
//! Only two of NVIDIA's error lines are known verbatim (`Could not restore on process ID ...`,
//! `Error toggling CUDA in process ID ...`); the others follow the same pattern. A tid given as
//! `--pid` (CRIU passes the restore tid to `--get-state`) is taken as its process, as the real
//! driver does; the handler does that translation.

use std::time::Duration;

use cryo_gpu::{CheckpointDriver, CuResult, DriverError, GpuPair, ProcessState};
use cryo_proc::Pid;

use crate::args::GpuMap;
use crate::exit;

/// `cuda-checkpoint --help`.
pub const HELP: &str = "\
CUDA checkpoint and restore utility (cryo's compatible front end).
Checkpoints and restores the CUDA state of one Linux process through the driver's checkpoint API.

Operations:
--get-state --pid <pid>
        Print the checkpoint state of process <pid>: running, locked, checkpointed or failed

--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <map>]
        Perform one action on <pid>. lock waits up to <ms> milliseconds for work in flight
        (0 or none: no limit); restore takes --device-map

--toggle --pid <pid>
        Toggle the CUDA state of <pid> between running and checkpointed

--get-restore-tid --pid <pid>
        Print the thread ID of the CUDA restore thread of <pid>

Options:
--pid|-p <pid>
        The process to operate on

--timeout|-t <timeout>
        Timeout of the lock action, in milliseconds

--device-map <oldUuid>=<newUuid>[,<oldUuid>=<newUuid>...]
        Restore onto other GPUs (GPU UUIDs, as nvidia-smi -L prints them)

--help|-h
        Print this help message
";

/// One of the four driver actions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Action {
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
}

impl Action {
    fn parse(s: &str) -> Option<Action> {
        Some(match s {
            "lock" => Action::Lock,
            "checkpoint" => Action::Checkpoint,
            "restore" => Action::Restore,
            "unlock" => Action::Unlock,
            _ => return None,
        })
    }

    /// The word on the command line.
    pub fn as_str(self) -> &'static str {
        match self {
            Action::Lock => "lock",
            Action::Checkpoint => "checkpoint",
            Action::Restore => "restore",
            Action::Unlock => "unlock",
        }
    }
}

/// What was asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Operation {
    /// `--get-state`.
    GetState,
    /// `--get-restore-tid`.
    GetRestoreTid,
    /// `--action X`.
    Action(Action),
    /// `--toggle`.
    Toggle,
}

/// A valid command line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    /// `--help`.
    Help,
    /// An operation on a process.
    Run {
        /// Which.
        op: Operation,
        /// `--pid`.
        pid: Pid,
        /// `--timeout` in ms (lock only; 0 means no limit).
        timeout_ms: Option<u32>,
        /// `--device-map` (restore only).
        device_map: Vec<GpuPair>,
    },
}

/// A command line that is not `cuda-checkpoint` syntax.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UsageError {
    /// Nothing asked.
    #[error("no operation given (one of --get-state, --get-restore-tid, --action, --toggle)")]
    NoOperation,
    /// Two operations.
    #[error("only one operation at a time ({0} and {1} given)")]
    TwoOperations(String, String),
    /// An option this front end does not know.
    #[error("unknown option {0:?}")]
    Unknown(String),
    /// An option without its value.
    #[error("option {0} needs a value")]
    MissingValue(String),
    /// `--action` with something else than the four words.
    #[error("unknown action {0:?} (lock, checkpoint, restore or unlock)")]
    BadAction(String),
    /// `--pid` that is not a pid.
    #[error("{0:?} is not a process ID")]
    BadPid(String),
    /// `--timeout` that is not a number of milliseconds.
    #[error("{0:?} is not a timeout in milliseconds")]
    BadTimeout(String),
    /// A malformed `--device-map`.
    #[error("--device-map: {0}")]
    BadMap(crate::args::gpu_map::GpuMapError),
    /// No `--pid`.
    #[error("--pid is required")]
    NoPid,
    /// An option given twice.
    #[error("option {0} given twice")]
    Repeated(&'static str),
}

/// Parses `cuda-checkpoint` arguments (without `argv[0]`).
pub fn parse<I, S>(args: I) -> Result<Request, UsageError>
where
    I: IntoIterator<Item = S>,
    S: AsRef<str>,
{
    let args: Vec<String> = args.into_iter().map(|s| s.as_ref().to_string()).collect();
    let mut op: Option<(Operation, String)> = None;
    let mut pid = None;
    let mut timeout_ms = None;
    let mut device_map = None;
    let mut it = args.iter();
    let set_op = |op: &mut Option<(Operation, String)>, new: Operation, flag: &str| match op {
        Some((_, prev)) => Err(UsageError::TwoOperations(prev.clone(), flag.to_string())),
        None => {
            *op = Some((new, flag.to_string()));
            Ok(())
        }
    };
    while let Some(arg) = it.next() {
        let (name, inline) = match arg.split_once('=') {
            Some((n, v)) if n.starts_with("--") => (n, Some(v.to_string())),
            _ => (arg.as_str(), None),
        };
        let value = |it: &mut std::slice::Iter<'_, String>| -> Result<String, UsageError> {
            match inline.clone() {
                Some(v) => Ok(v),
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| UsageError::MissingValue(name.to_string())),
            }
        };
        match name {
            "--help" | "-h" => return Ok(Request::Help),
            "--get-state" => set_op(&mut op, Operation::GetState, name)?,
            "--get-restore-tid" => set_op(&mut op, Operation::GetRestoreTid, name)?,
            "--toggle" => set_op(&mut op, Operation::Toggle, name)?,
            "--action" => {
                let v = value(&mut it)?;
                let a = Action::parse(&v).ok_or(UsageError::BadAction(v))?;
                set_op(&mut op, Operation::Action(a), "--action")?;
            }
            "--pid" | "-p" => {
                let v = value(&mut it)?;
                let p = crate::args::parse_pid(&v).map_err(|_| UsageError::BadPid(v))?;
                if pid.replace(p).is_some() {
                    return Err(UsageError::Repeated("--pid"));
                }
            }
            "--timeout" | "-t" => {
                let v = value(&mut it)?;
                let t: u32 = v.parse().map_err(|_| UsageError::BadTimeout(v))?;
                if timeout_ms.replace(t).is_some() {
                    return Err(UsageError::Repeated("--timeout"));
                }
            }
            "--device-map" => {
                let v = value(&mut it)?;
                let map = GpuMap::parse(&v, false).map_err(UsageError::BadMap)?;
                // Parsed without indices, so every side is a UUID.
                let pairs = map.uuid_pairs().unwrap_or_default();
                if device_map.replace(pairs).is_some() {
                    return Err(UsageError::Repeated("--device-map"));
                }
            }
            other => return Err(UsageError::Unknown(other.to_string())),
        }
    }
    let (op, _) = op.ok_or(UsageError::NoOperation)?;
    let pid = pid.ok_or(UsageError::NoPid)?;
    Ok(Request::Run {
        op,
        pid,
        timeout_ms,
        device_map: device_map.unwrap_or_default(),
    })
}

/// What to print and how to exit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome {
    /// For stdout (with its newline).
    pub stdout: String,
    /// For stderr (with its newline).
    pub stderr: String,
    /// Exit status.
    pub status: u8,
}

impl Outcome {
    /// Success, printing `stdout`.
    pub fn ok(stdout: String) -> Self {
        Outcome {
            stdout,
            stderr: String::new(),
            status: exit::SUCCESS,
        }
    }

    /// A failure line for `pid` under the verb of `op`.
    pub fn failed(op: Operation, pid: Pid, err: &DriverError) -> Self {
        let (desc, status) = match err.code() {
            Some(code) => (code.description().to_string(), exit::cuda_status(code)),
            None => (err.to_string(), exit::FAILURE),
        };
        Self::failed_because(op, pid, &desc, status)
    }

    /// `op` on `pid` failed for the reason `desc`, in NVIDIA's wording.
    pub fn failed_because(op: Operation, pid: Pid, desc: &str, status: u8) -> Self {
        let line = match op {
            Operation::GetState => format!("Could not get state of process ID {pid}: \"{desc}\"\n"),
            Operation::GetRestoreTid => {
                format!("Could not get restore thread ID of process ID {pid}: \"{desc}\"\n")
            }
            Operation::Action(a) => {
                format!("Could not {} on process ID {pid}: \"{desc}\"\n", a.as_str())
            }
            Operation::Toggle => format!("Error toggling CUDA in process ID {pid}: \"{desc}\"\n"),
        };
        Outcome {
            stdout: String::new(),
            stderr: line,
            status,
        }
    }

    /// `--help` on stdout.
    pub fn help() -> Self {
        Outcome::ok(HELP.to_string())
    }

    /// A usage error: the problem, then the help, on stderr.
    pub fn usage(err: &UsageError) -> Self {
        Outcome {
            stdout: String::new(),
            stderr: format!("cuda-checkpoint: {err}\n\n{HELP}"),
            status: exit::FAILURE,
        }
    }
}

/// Carries out `op` on `pid` against `driver`.
pub fn execute(
    driver: &dyn CheckpointDriver,
    op: Operation,
    pid: Pid,
    timeout_ms: Option<u32>,
    map: &[GpuPair],
) -> Outcome {
    let timeout = timeout_ms
        .filter(|t| *t > 0)
        .map(|t| Duration::from_millis(u64::from(t)));
    let result = match op {
        Operation::GetState => driver.state(pid).map(|s| format!("{s}\n")),
        Operation::GetRestoreTid => driver.restore_thread_id(pid).map(|t| format!("{t}\n")),
        Operation::Action(a) => act(driver, a, pid, timeout, map).map(|()| String::new()),
        Operation::Toggle => toggle(driver, pid, timeout, map).map(|()| String::new()),
    };
    match result {
        Ok(out) => Outcome::ok(out),
        Err(e) => Outcome::failed(op, pid, &e),
    }
}

fn act(
    driver: &dyn CheckpointDriver,
    a: Action,
    pid: Pid,
    timeout: Option<Duration>,
    map: &[GpuPair],
) -> Result<(), DriverError> {
    match a {
        Action::Lock => driver.lock(pid, timeout),
        Action::Checkpoint => driver.checkpoint(pid),
        Action::Restore => driver.restore(pid, map),
        Action::Unlock => driver.unlock(pid),
    }
}

fn toggle(
    driver: &dyn CheckpointDriver,
    pid: Pid,
    timeout: Option<Duration>,
    map: &[GpuPair],
) -> Result<(), DriverError> {
    match driver.state(pid)? {
        ProcessState::Running => {
            driver.lock(pid, timeout)?;
            if let Err(e) = driver.checkpoint(pid) {
                // Leave the process as it was found rather than locked.
                if let Err(unlock) = driver.unlock(pid) {
                    tracing::warn!(pid, %unlock, "could not unlock after a failed checkpoint");
                }
                return Err(e);
            }
            Ok(())
        }
        ProcessState::Checkpointed => {
            driver.restore(pid, map)?;
            driver.unlock(pid)
        }
        ProcessState::Locked | ProcessState::Failed => Err(DriverError::Cuda {
            call: "toggle",
            pid,
            code: CuResult::ILLEGAL_STATE,
        }),
    }
}

#[cfg(test)]
mod tests;
