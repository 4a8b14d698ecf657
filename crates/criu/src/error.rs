//! Errors of the CRIU operations.

use std::fmt;
use std::path::PathBuf;

use crate::image::ImageError;
use crate::rpc::RpcError;
use crate::version::CriuVersion;
use cryo_proc::Pid;

/// Which CRIU operation failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CriuOp {
    /// Checkpoint of a process tree.
    Dump,
    /// Restore of a process tree.
    Restore,
}

impl fmt::Display for CriuOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CriuOp::Dump => "dump",
            CriuOp::Restore => "restore",
        })
    }
}

/// Finding, checking or running CRIU failed.
#[derive(Debug, thiserror::Error)]
pub enum CriuError {
    /// No CRIU binary where cryo looks.
    #[error("criu not found (looked at {}); run scripts/install-criu.sh or set CRYO_CRIU", fmt_paths(.tried))]
    NotFound {
        /// Every place looked at, in order.
        tried: Vec<PathBuf>,
    },
    /// The CRIU found is older than cryo needs.
    #[error("criu at {} is version {found}, cryo needs >= {needed}; run scripts/install-criu.sh", .path.display())]
    TooOld {
        /// The binary.
        path: PathBuf,
        /// Its version.
        found: CriuVersion,
        /// The oldest version cryo works with.
        needed: CriuVersion,
    },
    /// `criu --version` did not run or did not print a version.
    #[error("cannot read the version of {}: {reason}", .path.display())]
    Version {
        /// The binary.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The images or work directory could not be opened or made.
    #[error("{op}: directory {}: {source}", .path.display())]
    Dir {
        /// The operation.
        op: CriuOp,
        /// The directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// Talking to `criu swrk` broke.
    #[error("{op}: {source}")]
    Rpc {
        /// The operation.
        op: CriuOp,
        /// What broke.
        #[source]
        source: RpcError,
    },
    /// The image was refused while CRIU restored it (a chunk that does not match the manifest,
    /// a file that changed or vanished): CRIU got nothing of it and no restored process ran.
    #[error("{0}")]
    Image(#[source] ImageError),
    /// CRIU did not finish its work in time and was killed, with every process it had restored
    /// (none had run); `lines` are the last of its log (where it was). A CRIU that did not exit
    /// after its kill is named in `stuck`: the restore returned without it.
    #[error(
        "criu {op} did not finish within {} s and was killed with what it had restored{}{}{} (log {}): {}",
        .after.as_secs(),
        fmt_killed(.killed),
        fmt_left(.left),
        fmt_stuck(.stuck.as_deref()),
        .log.display(),
        fmt_lines(.lines)
    )]
    TimedOut {
        /// The operation.
        op: CriuOp,
        /// The deadline.
        after: std::time::Duration,
        /// CRIU's log file.
        log: PathBuf,
        /// Its last lines (a boxed slice, as `stuck` is boxed: every `Result` of this crate
        /// carries this error's size).
        lines: Box<[String]>,
        /// Processes it had restored or forked, killed: host pid and start time, the restored
        /// root first (found by the kernel's evidence, never by the image's pids).
        killed: Vec<(Pid, u64)>,
        /// Restored processes that could not be removed, and why.
        left: Vec<String>,
        /// CRIU itself, when it did not exit after its kill (boxed: the error stays small).
        stuck: Option<Box<Stuck>>,
    },
    /// Too many CRIUs (or processes they restored) are still waited for in the background,
    /// each holding a thread until it exits: CRIUs killed at their deadline or at a refusal
    /// and stuck where no signal reaches them (see [`Stuck`]), restored processes stuck the
    /// same way, CRIUs that resumed their trees and have not exited. No new one is started,
    /// since it would most likely hang the same way.
    #[error(
        "criu {op} not started: {stuck} earlier CRIUs or processes they restored have still not exited, each waited for by a thread until it does: {}; each frees its place when it exits (a kernel wait ends when its disk or file server answers)",
        .held.join("; ")
    )]
    TooManyStuck {
        /// The operation.
        op: CriuOp,
        /// How many are waited for.
        stuck: usize,
        /// Each of them: what it is, its pid(s), and its state now.
        held: Vec<String>,
    },
    /// CRIU ran and reported failure; `lines` are its own `Error (...)` lines from `log`
    /// (the last few), or the log's last lines when it has none.
    #[error("criu {op} failed (log {}): {}", .log.display(), fmt_lines(.lines))]
    Failed {
        /// The operation.
        op: CriuOp,
        /// CRIU's log file.
        log: PathBuf,
        /// CRIU's error lines.
        lines: Vec<String>,
    },
    /// The caller's check at the gate (every process restored, none run yet) refused the tree:
    /// CRIU aborted the restore and removed it.
    #[error("restore refused at cryo's gate: {0}; CRIU removed the restored tree")]
    Gate(String),
    /// The caller's check at the dump's gate (every image written, the tree still frozen)
    /// refused the tree: CRIU resumed it instead of killing it.
    #[error("dump refused at cryo's gate: {0}; CRIU resumed the tree")]
    DumpGate(String),
}

/// A CRIU killed (SIGKILL) at its deadline that had not exited a while later: it waits where no
/// signal reaches it, in an uninterruptible wait (state `D`: a read of a dead disk, of an NFS
/// hard mount, of a FUSE server that stopped answering) that ends only when the kernel's wait
/// does. Its kill is pending: it never runs CRIU's code again, so it resumes nothing; it exits
/// when its wait ends, and is reaped then by a thread of cryo's deadline layer
/// (`cryo_gpu::deadline`, counted by [`crate::stuck_crius`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stuck {
    /// CRIU's pid (cryo's child, not reaped: the pid is still its).
    pub pid: Pid,
    /// Its state letter from `/proc/PID/stat` (`D`: uninterruptible) when cryo gave up on it;
    /// `?` when it could not be read.
    pub state: char,
    /// Where in the kernel it waited (`/proc/PID/wchan`), empty when unknown.
    pub wchan: String,
    /// How long cryo waited for it to exit after its kill.
    pub waited: std::time::Duration,
}

fn fmt_stuck(stuck: Option<&Stuck>) -> String {
    let Some(s) = stuck else {
        return String::new();
    };
    let wchan = if s.wchan.is_empty() || s.wchan == "0" {
        String::new()
    } else {
        format!(" in {}", s.wchan)
    };
    format!(
        "; CRIU (pid {}) did not exit within {} ms of its kill: state {}{wchan} (an uninterruptible wait: a hung disk or file server?); it is reaped when that wait ends",
        s.pid,
        s.waited.as_millis(),
        s.state
    )
}

fn fmt_paths(p: &[PathBuf]) -> String {
    p.iter()
        .map(|p| p.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

fn fmt_killed(killed: &[(Pid, u64)]) -> String {
    if killed.is_empty() {
        String::new()
    } else {
        let pids: Vec<String> = killed.iter().map(|(p, _)| p.to_string()).collect();
        format!(" (pids {})", pids.join(", "))
    }
}

fn fmt_left(left: &[String]) -> String {
    if left.is_empty() {
        String::new()
    } else {
        format!(" except: {}", left.join("; "))
    }
}

fn fmt_lines(lines: &[String]) -> String {
    if lines.is_empty() {
        "no error lines in the log".to_string()
    } else {
        lines.join(" | ")
    }
}
