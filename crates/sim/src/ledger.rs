//! The wedge ledger: one JSON line per live restored context that was torn down. On a real host
//! each of these would have wedged the machine; tests assert the ledger stays empty.

use std::fs::OpenOptions;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;

use cryo_gpu::GpuUuid;
use cryo_proc::Pid;
use serde::{Deserialize, Serialize};

/// One teardown of a live restored context.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Wedge {
    /// When the daemon saw the teardown (RFC 3339, UTC).
    pub time: String,
    /// The process that owned the context.
    pub pid: Pid,
    /// NVML index of its GPU.
    pub gpu_index: u32,
    /// UUID of its GPU.
    pub gpu_uuid: GpuUuid,
    /// Device memory the context held, bytes.
    pub used_memory: u64,
    /// How the process died: `killed by SIGKILL`, `exited with status 1`,
    /// `closed its context while alive`, or `unknown`.
    pub death: String,
    /// The context came from a restore (always true: only those wedge).
    pub restored: bool,
}

/// The ledger could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// I/O on the ledger file.
    #[error("wedge ledger {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// A line is not a wedge.
    #[error("wedge ledger {path}, line {line}: {source}")]
    Parse {
        /// The file.
        path: String,
        /// 1-based line.
        line: usize,
        /// The error.
        source: serde_json::Error,
    },
}

/// Appends a wedge and fsyncs it before returning.
pub fn append(path: &Path, wedge: &Wedge) -> Result<(), LedgerError> {
    let io = |source| LedgerError::Io {
        path: path.display().to_string(),
        source,
    };
    let mut line = serde_json::to_vec(wedge).map_err(|e| io(std::io::Error::other(e)))?;
    line.push(b'\n');
    let mut f = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io)?;
    f.write_all(&line).map_err(io)?;
    f.sync_all().map_err(io)
}

/// Every wedge recorded so far; a missing ledger is an empty one.
pub fn read(path: &Path) -> Result<Vec<Wedge>, LedgerError> {
    let p = || path.display().to_string();
    let f = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => return Err(LedgerError::Io { path: p(), source }),
    };
    let mut out = Vec::new();
    for (i, line) in BufReader::new(f).lines().enumerate() {
        let line = line.map_err(|source| LedgerError::Io { path: p(), source })?;
        if line.trim().is_empty() {
            continue;
        }
        out.push(
            serde_json::from_str(&line).map_err(|source| LedgerError::Parse {
                path: p(),
                line: i + 1,
                source,
            })?,
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wedges_round_trip() {
        let dir = std::env::temp_dir().join(format!("cryo-sim-ledger-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("ledger.jsonl");
        let _ = std::fs::remove_file(&path);
        assert!(read(&path).unwrap().is_empty());
        let w = Wedge {
            time: "2026-11-30T00:00:00Z".into(),
            pid: 7,
            gpu_index: 1,
            gpu_uuid: "GPU-00000000-0000-0000-0000-000000000001".parse().unwrap(),
            used_memory: 4096,
            death: "killed by SIGKILL".into(),
            restored: true,
        };
        append(&path, &w).unwrap();
        append(&path, &w).unwrap();
        assert_eq!(read(&path).unwrap(), vec![w.clone(), w]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
