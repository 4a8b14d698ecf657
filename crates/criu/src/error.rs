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
    /// (none had run); `lines` are the last of its log (where it was).
    #[error(
        "criu {op} did not finish within {} s and was killed with what it had restored{}{} (log {}): {}",
        .after.as_secs(),
        fmt_killed(.killed),
        fmt_left(.left),
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
        /// Its last lines.
        lines: Vec<String>,
        /// Processes it had restored or forked, killed: host pid and start time, the restored
        /// root first (found by the kernel's evidence, never by the image's pids).
        killed: Vec<(Pid, u64)>,
        /// Restored processes that could not be removed, and why.
        left: Vec<String>,
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
