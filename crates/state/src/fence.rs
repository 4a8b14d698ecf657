//! The fence: GPUs quarantined because a live restored context on them is held open by the guard.
//!
//! # Design
//! One small JSON file, `STATE_DIR/quarantine.json`, read by `cryo thaw` (which must refuse a
//! quarantined GPU), `cryo status`, `cryo gpu ls`, and written by the guard and by the operator's
//! `cryo guard release`. Writers take an exclusive `flock` on `STATE_DIR/quarantine.lock`, read,
//! change, write a temporary file, `fsync` it, rename it over the old one and `fsync` the
//! directory, so a reader sees either the old or the new set, never half of one, and a power cut
//! loses at most the change in flight. Readers take no lock.
//!
//! # Limitations
//! The file names GPUs by UUID only; a GPU replaced under the same UUID (never on real hardware)
//! would stay quarantined.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use cryo_gpu::Pid;
use serde::{Deserialize, Serialize};

use crate::StateDir;

/// One quarantined GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quarantine {
    /// GPU UUID (`GPU-...`).
    pub gpu: String,
    /// Why (which process died how, and what holds its context).
    pub reason: String,
    /// Processes whose pinned contexts live on this GPU.
    pub pids: Vec<Pid>,
    /// When it was quarantined, seconds since the Unix epoch.
    pub since_unix: u64,
}

#[derive(Debug, Default, Serialize, Deserialize)]
struct File {
    gpus: Vec<Quarantine>,
}

/// Reading or writing the quarantine store failed.
#[derive(Debug, thiserror::Error)]
pub enum FenceError {
    /// A file of the store could not be read, written or locked.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
    /// The store holds something that is not a quarantine list.
    #[error("{path} is not a valid quarantine list: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        source: serde_json::Error,
    },
}

/// The quarantine store of one state directory.
#[derive(Debug, Clone)]
pub struct Fence {
    state: StateDir,
}

impl Fence {
    /// The store of `state` (nothing is touched until a call); also [`StateDir::fence`].
    pub fn new(state: &StateDir) -> Self {
        Self {
            state: state.clone(),
        }
    }

    /// The store's file.
    pub fn path(&self) -> PathBuf {
        self.state.quarantine_file()
    }

    /// Every quarantined GPU (empty when the store does not exist).
    pub fn list(&self) -> Result<Vec<Quarantine>, FenceError> {
        Ok(self.read()?.gpus)
    }

    /// Whether `gpu` (a UUID) is quarantined.
    pub fn is_quarantined(&self, gpu: &str) -> Result<bool, FenceError> {
        Ok(self
            .read()?
            .gpus
            .iter()
            .any(|q| q.gpu.eq_ignore_ascii_case(gpu)))
    }

    /// The quarantine of `gpu`, if any.
    pub fn get(&self, gpu: &str) -> Result<Option<Quarantine>, FenceError> {
        Ok(self
            .read()?
            .gpus
            .into_iter()
            .find(|q| q.gpu.eq_ignore_ascii_case(gpu)))
    }

    /// Quarantines `gpu`. A GPU already quarantined keeps its first reason and gains the pids.
    pub fn quarantine(&self, gpu: &str, reason: &str, pids: &[Pid]) -> Result<(), FenceError> {
        self.update(|f| {
            if let Some(q) = f.gpus.iter_mut().find(|q| q.gpu.eq_ignore_ascii_case(gpu)) {
                for p in pids {
                    if !q.pids.contains(p) {
                        q.pids.push(*p);
                    }
                }
            } else {
                f.gpus.push(Quarantine {
                    gpu: gpu.to_string(),
                    reason: reason.to_string(),
                    pids: pids.to_vec(),
                    since_unix: SystemTime::now()
                        .duration_since(UNIX_EPOCH)
                        .map_or(0, |d| d.as_secs()),
                });
            }
        })
    }

    /// Lifts the quarantine of `gpu`; returns what was lifted (`None`: it was not quarantined).
    pub fn release(&self, gpu: &str) -> Result<Option<Quarantine>, FenceError> {
        let mut lifted = None;
        self.update(|f| {
            if let Some(i) = f.gpus.iter().position(|q| q.gpu.eq_ignore_ascii_case(gpu)) {
                lifted = Some(f.gpus.remove(i));
            }
        })?;
        Ok(lifted)
    }

    fn read(&self) -> Result<File, FenceError> {
        let path = self.path();
        match fs::read(&path) {
            Ok(bytes) => {
                serde_json::from_slice(&bytes).map_err(|source| FenceError::Parse { path, source })
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(File::default()),
            Err(source) => Err(FenceError::Io {
                what: "reading",
                path,
                source,
            }),
        }
    }

    fn update(&self, change: impl FnOnce(&mut File)) -> Result<(), FenceError> {
        let dir = self.state.root();
        fs::create_dir_all(dir).map_err(io_err("creating", dir))?;
        let lock_path = self.state.quarantine_lock();
        let lock = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(io_err("opening", &lock_path))?;
        // Held until `lock` is dropped at the end of this function.
        rustix::fs::flock(lock.as_fd(), rustix::fs::FlockOperation::LockExclusive).map_err(
            |e| FenceError::Io {
                what: "locking",
                path: lock_path.clone(),
                source: e.into(),
            },
        )?;
        let mut file = self.read()?;
        change(&mut file);
        let path = self.path();
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_vec_pretty(&file).map_err(|source| FenceError::Parse {
            path: path.clone(),
            source,
        })?;
        {
            let mut f = fs::File::create(&tmp).map_err(io_err("creating", &tmp))?;
            f.write_all(&text).map_err(io_err("writing", &tmp))?;
            f.sync_all().map_err(io_err("syncing", &tmp))?;
        }
        fs::rename(&tmp, &path).map_err(io_err("renaming into place", &path))?;
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("syncing", dir))?;
        drop(lock);
        Ok(())
    }
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FenceError {
    let path = path.to_path_buf();
    move |source| FenceError::Io { what, path, source }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
    const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

    #[test]
    fn quarantine_list_release_round_trip() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path().join("state"));
        let fence = state.fence();
        assert!(fence.list().unwrap().is_empty());
        assert!(!fence.is_quarantined(A).unwrap());
        fence.quarantine(A, "pid 7 died of SIGKILL", &[7]).unwrap();
        fence
            .quarantine(A, "second reason ignored", &[8, 7])
            .unwrap();
        fence.quarantine(B, "other", &[9]).unwrap();
        // UUIDs compare without regard to the case of their hex digits.
        assert!(fence.is_quarantined(&A.to_uppercase()).unwrap());
        let a = fence.get(A).unwrap().unwrap();
        assert_eq!(a.reason, "pid 7 died of SIGKILL");
        assert_eq!(a.pids, vec![7, 8]);
        // A second handle on the same directory (another process) sees the same state.
        assert_eq!(
            StateDir::new(dir.path().join("state"))
                .fence()
                .list()
                .unwrap()
                .len(),
            2
        );
        assert_eq!(fence.release(A).unwrap().unwrap().pids, vec![7, 8]);
        assert!(fence.release(A).unwrap().is_none());
        assert!(!fence.is_quarantined(A).unwrap());
        assert!(fence.is_quarantined(B).unwrap());
        assert!(!state.quarantine_file().with_extension("json.tmp").exists());
    }

    #[test]
    fn a_damaged_store_is_an_error_not_an_empty_fence() {
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        fs::write(state.quarantine_file(), b"{not json").unwrap();
        let fence = state.fence();
        assert!(matches!(
            fence.is_quarantined(A),
            Err(FenceError::Parse { .. })
        ));
        assert!(fence.quarantine(A, "x", &[1]).is_err());
    }
}
