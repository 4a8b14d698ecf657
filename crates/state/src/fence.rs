//! The fence: GPUs that take no thaw because a live restored context on them is (or may be) held
//! open by the guard.
//!
//! # Design
//! One small JSON file, [`StateDir::quarantine_file`], read by `cryo thaw` (which must refuse a
//! fenced GPU), `cryo status` and `cryo gpu ls`, and written by the guard (at an exit stop, and on
//! the operator's `cryo guard release`). Writers take an exclusive `flock` on
//! [`StateDir::quarantine_lock`], read, change, write a temporary file, `fsync` it, rename it over
//! the old one and `fsync` the directory, so a reader sees either the old or the new set, never
//! half of one, and a power cut loses at most the change in flight. Readers take no lock.
//!
//! Entries are typed ([`FencedGpu`]): a GPU by UUID, or [`FencedGpu::Unknown`], written when the
//! guard pinned a context but could not tell which GPU it is on (NVML failed at the exit stop).
//! An unknown entry fences every GPU of the node.
//!
//! **The fence fails closed.** Whatever the readers cannot trust is an error, never an empty
//! fence, and `cryo thaw` refuses on it:
//! - a file that cannot be read, or does not parse: one entry that is neither a UUID nor
//!   `unknown` spoils the whole file (nothing is dropped), and a format newer than this build
//!   ([`FORMAT`]) is refused;
//! - a file someone other than root (or cryo's own user) could have written: it is opened without
//!   following a symlink (and without blocking on a FIFO), and must be a regular file owned by
//!   root or the current user with no group or other write bit; the state directory must be owned
//!   the same way and not be writable by group or others (else anyone could replace the file or
//!   delete it, which would lift every quarantine).
//!
//! **Writers never lose a fence.** A writer that finds the file unparseable or untrusted (in a
//! trusted directory) moves it aside ([`StateDir::quarantine_set_aside`]) and starts a new file
//! whose first entry is [`FencedGpu::Unknown`], naming where the old one went: the node stays
//! fenced until an operator has looked at it (`cryo guard release --gpu unknown`), and the guard
//! can still record what it pins. A newer format or an I/O error is left alone (an error).
//!
//! Format: `{"version": 2, "gpus": [{"gpu", "reason", "pids", "since_unix"}]}`. Files of the
//! first format (no `version`) read the same: the guard wrote `"unknown"` in them for exactly the
//! case [`FencedGpu::Unknown`] names.
//!
//! # Limitations
//! - The file names GPUs by UUID only; a GPU replaced under the same UUID (never on real hardware)
//!   would stay quarantined.
//! - Only the state directory itself is checked, not its parents: a parent writable by others
//!   lets them swap the whole directory.

use std::fmt;
use std::fs;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::time::{SystemTime, UNIX_EPOCH};

use cryo_gpu::GpuUuid;
use cryo_proc::Pid;
use rustix::fs::{Mode, OFlags};
use serde::{Deserialize, Serialize};

use crate::StateDir;

/// The format this build writes, and the newest it reads.
pub const FORMAT: u32 = 2;

/// A quarantine file larger than this is refused (entries are ~200 bytes).
pub const MAX_FILE_BYTES: u64 = 1 << 20;

/// What one quarantine entry fences.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub enum FencedGpu {
    /// This GPU.
    Gpu(GpuUuid),
    /// The guard could not tell which GPU a pinned context is on: every GPU of the node.
    Unknown,
}

impl FencedGpu {
    /// How [`FencedGpu::Unknown`] is written.
    pub const UNKNOWN: &'static str = "unknown";

    /// Whether a thaw onto `gpu` is fenced by this entry.
    pub fn covers(&self, gpu: &GpuUuid) -> bool {
        match self {
            FencedGpu::Gpu(g) => g == gpu,
            FencedGpu::Unknown => true,
        }
    }
}

impl From<GpuUuid> for FencedGpu {
    fn from(g: GpuUuid) -> Self {
        FencedGpu::Gpu(g)
    }
}

impl fmt::Display for FencedGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FencedGpu::Gpu(g) => f.write_str(g.as_str()),
            FencedGpu::Unknown => f.write_str(Self::UNKNOWN),
        }
    }
}

/// A string that is neither a GPU UUID nor `unknown`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is neither a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) nor `unknown`")]
pub struct BadFencedGpu(pub String);

impl FromStr for FencedGpu {
    type Err = BadFencedGpu;
    fn from_str(s: &str) -> Result<Self, BadFencedGpu> {
        if s.eq_ignore_ascii_case(Self::UNKNOWN) {
            return Ok(FencedGpu::Unknown);
        }
        s.parse()
            .map(FencedGpu::Gpu)
            .map_err(|_| BadFencedGpu(s.to_string()))
    }
}

impl TryFrom<String> for FencedGpu {
    type Error = BadFencedGpu;
    fn try_from(s: String) -> Result<Self, BadFencedGpu> {
        s.parse()
    }
}

impl From<FencedGpu> for String {
    fn from(g: FencedGpu) -> String {
        g.to_string()
    }
}

/// One quarantine entry.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quarantine {
    /// The GPU, or every GPU ([`FencedGpu::Unknown`]).
    pub gpu: FencedGpu,
    /// Why (which process died how, and what holds its context).
    pub reason: String,
    /// Processes whose pinned contexts live on this GPU.
    pub pids: Vec<Pid>,
    /// When it was quarantined, seconds since the Unix epoch.
    pub since_unix: u64,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    /// Absent in files of the first format.
    #[serde(default = "first_format")]
    version: u32,
    gpus: Vec<Quarantine>,
}

fn first_format() -> u32 {
    1
}

impl File {
    fn empty() -> Self {
        File {
            version: FORMAT,
            gpus: Vec::new(),
        }
    }
}

/// Why a file of the store is not trusted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Distrust {
    /// It is a symbolic link.
    Symlink,
    /// It is not a regular file (a directory, a FIFO...).
    NotRegular,
    /// The directory is not a directory.
    NotDirectory,
    /// It is owned by someone else than root or the current user.
    Owner(u32),
    /// Group or others may write it (its permission bits).
    Writable(u32),
}

impl fmt::Display for Distrust {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Distrust::Symlink => f.write_str("is a symbolic link"),
            Distrust::NotRegular => f.write_str("is not a regular file"),
            Distrust::NotDirectory => f.write_str("is not a directory"),
            Distrust::Owner(uid) => write!(f, "is owned by uid {uid}, neither root nor this user"),
            Distrust::Writable(mode) => {
                write!(f, "is writable by group or others (mode {mode:04o})")
            }
        }
    }
}

/// Reading or writing the quarantine store failed. Every reader treats it as "fenced".
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
    /// The store holds something that is not a quarantine list (or an entry that is neither a
    /// GPU UUID nor `unknown`).
    #[error("{path} is not a valid quarantine list: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parser's complaint.
        source: serde_json::Error,
    },
    /// Someone other than root or this user could have written it.
    #[error("{path} {why}: someone other than root could have written it, so it is not trusted")]
    Untrusted {
        /// The file or directory.
        path: PathBuf,
        /// What is wrong with it.
        why: Distrust,
    },
    /// It was written by a newer cryo.
    #[error(
        "{path} is quarantine format {found}; this cryo reads formats up to {FORMAT}: upgrade it"
    )]
    Version {
        /// The file.
        path: PathBuf,
        /// Its format.
        found: u32,
    },
    /// It is far larger than any quarantine list.
    #[error("{path} is {len} bytes, more than the {MAX_FILE_BYTES} a quarantine list can be")]
    TooLarge {
        /// The file.
        path: PathBuf,
        /// Its size.
        len: u64,
    },
}

impl FenceError {
    /// Whether a writer may set the file aside and start afresh (fenced): the file is damaged or
    /// untrusted, not newer than this build and not unreadable for a reason that may pass.
    fn salvageable(&self) -> bool {
        matches!(
            self,
            FenceError::Parse { .. } | FenceError::Untrusted { .. } | FenceError::TooLarge { .. }
        )
    }
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

    /// Every entry (empty when the store does not exist).
    pub fn list(&self) -> Result<Vec<Quarantine>, FenceError> {
        check_dir(self.state.root())?;
        Ok(self.read_file()?.map_or_else(Vec::new, |f| f.gpus))
    }

    /// Whether a thaw onto `gpu` is fenced: an entry names it, or an unknown entry fences every GPU.
    pub fn fences(&self, gpu: &GpuUuid) -> Result<bool, FenceError> {
        Ok(self.list()?.iter().any(|q| q.gpu.covers(gpu)))
    }

    /// The entry for `gpu` exactly, if any.
    pub fn get(&self, gpu: &FencedGpu) -> Result<Option<Quarantine>, FenceError> {
        Ok(self.list()?.into_iter().find(|q| q.gpu == *gpu))
    }

    /// Quarantines `gpu`. A GPU already quarantined keeps its first reason and gains the pids.
    pub fn quarantine(
        &self,
        gpu: &FencedGpu,
        reason: &str,
        pids: &[Pid],
    ) -> Result<(), FenceError> {
        self.update(|f| {
            if let Some(q) = f.gpus.iter_mut().find(|q| q.gpu == *gpu) {
                for p in pids {
                    if !q.pids.contains(p) {
                        q.pids.push(*p);
                    }
                }
            } else {
                f.gpus.push(Quarantine {
                    gpu: gpu.clone(),
                    reason: reason.to_string(),
                    pids: pids.to_vec(),
                    since_unix: unix_now(),
                });
            }
        })
    }

    /// Lifts the quarantine of `gpu`; returns what was lifted (`None`: it was not quarantined).
    pub fn release(&self, gpu: &FencedGpu) -> Result<Option<Quarantine>, FenceError> {
        let mut lifted = None;
        self.update(|f| {
            if let Some(i) = f.gpus.iter().position(|q| q.gpu == *gpu) {
                lifted = Some(f.gpus.remove(i));
            }
        })?;
        Ok(lifted)
    }

    /// The file's content, `None` when there is none. The directory is checked by the caller.
    fn read_file(&self) -> Result<Option<File>, FenceError> {
        let path = self.path();
        let file = match open_trusted(&path, OFlags::RDONLY, Mode::empty()) {
            Ok(f) => f,
            Err(FenceError::Io { source, .. }) if source.kind() == io::ErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        let mut bytes = Vec::new();
        (&file)
            .take(MAX_FILE_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(io_err("reading", &path))?;
        if bytes.len() as u64 > MAX_FILE_BYTES {
            return Err(FenceError::TooLarge {
                len: file.metadata().map_or(bytes.len() as u64, |m| m.len()),
                path,
            });
        }
        let parsed: File = serde_json::from_slice(&bytes).map_err(|source| FenceError::Parse {
            path: path.clone(),
            source,
        })?;
        if parsed.version > FORMAT {
            return Err(FenceError::Version {
                path,
                found: parsed.version,
            });
        }
        Ok(Some(parsed))
    }

    fn update(&self, change: impl FnOnce(&mut File)) -> Result<(), FenceError> {
        let dir = self.state.root();
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o755)
            .create(dir)
            .map_err(io_err("creating", dir))?;
        check_dir(dir)?;
        let lock_path = self.state.quarantine_lock();
        let lock = open_trusted(
            &lock_path,
            OFlags::RDWR | OFlags::CREATE,
            Mode::from_raw_mode(0o600),
        )?;
        // Held until `lock` is dropped at the end of this function.
        rustix::fs::flock(lock.as_fd(), rustix::fs::FlockOperation::LockExclusive).map_err(
            |e| FenceError::Io {
                what: "locking",
                path: lock_path.clone(),
                source: e.into(),
            },
        )?;
        let mut file = match self.read_file() {
            Ok(f) => f.unwrap_or_else(File::empty),
            Err(e) if e.salvageable() => self.set_aside(&e)?,
            Err(e) => return Err(e),
        };
        change(&mut file);
        file.version = FORMAT;
        let path = self.path();
        let text = serde_json::to_vec_pretty(&file).map_err(|source| FenceError::Parse {
            path: path.clone(),
            source,
        })?;
        // A fresh, exclusively created name: nothing at a fixed temporary path can redirect it.
        let mut tmp = tempfile::Builder::new()
            .prefix(".quarantine.")
            .tempfile_in(dir)
            .map_err(io_err("creating a temporary file in", dir))?;
        tmp.as_file()
            .set_permissions(fs::Permissions::from_mode(0o644))
            .map_err(io_err("setting the mode of", tmp.path()))?;
        tmp.write_all(&text)
            .map_err(io_err("writing", tmp.path()))?;
        tmp.as_file()
            .sync_all()
            .map_err(io_err("syncing", tmp.path()))?;
        tmp.persist(&path).map_err(|e| FenceError::Io {
            what: "renaming into place",
            path: path.clone(),
            source: e.error,
        })?;
        fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(io_err("syncing", dir))?;
        drop(lock);
        Ok(())
    }

    /// Moves a damaged or untrusted file aside; the new content: one unknown entry saying so.
    fn set_aside(&self, why: &FenceError) -> Result<File, FenceError> {
        let since = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let saved = self.state.quarantine_set_aside(since.as_nanos());
        let path = self.path();
        fs::rename(&path, &saved).map_err(io_err("moving aside", &path))?;
        let mut file = File::empty();
        file.gpus.push(Quarantine {
            gpu: FencedGpu::Unknown,
            reason: format!(
                "the quarantine file could not be trusted ({why}); it was moved to {} and every GPU \
                 stays fenced until an operator has reviewed it",
                saved.display()
            ),
            pids: Vec::new(),
            since_unix: since.as_secs(),
        });
        Ok(file)
    }
}

/// Opens `path` without following a symlink or blocking on a FIFO, and checks that only root or
/// this user can have written it.
fn open_trusted(path: &Path, flags: OFlags, mode: Mode) -> Result<fs::File, FenceError> {
    let fd = rustix::fs::open(
        path,
        flags | OFlags::NOFOLLOW | OFlags::NONBLOCK | OFlags::CLOEXEC,
        mode,
    )
    .map_err(|e| {
        if e == rustix::io::Errno::LOOP {
            FenceError::Untrusted {
                path: path.to_path_buf(),
                why: Distrust::Symlink,
            }
        } else {
            FenceError::Io {
                what: "opening",
                path: path.to_path_buf(),
                source: e.into(),
            }
        }
    })?;
    let file = fs::File::from(fd);
    let meta = file.metadata().map_err(io_err("inspecting", path))?;
    if !meta.file_type().is_file() {
        return Err(FenceError::Untrusted {
            path: path.to_path_buf(),
            why: Distrust::NotRegular,
        });
    }
    check_owner(path, &meta)?;
    Ok(file)
}

/// The state directory must be a directory only root or this user can write. A directory that
/// does not exist is fine (nothing is quarantined, and nobody can have removed anything from it).
fn check_dir(dir: &Path) -> Result<(), FenceError> {
    let meta = match fs::metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(io_err("inspecting", dir)(e)),
    };
    if !meta.is_dir() {
        return Err(FenceError::Untrusted {
            path: dir.to_path_buf(),
            why: Distrust::NotDirectory,
        });
    }
    check_owner(dir, &meta)
}

fn check_owner(path: &Path, meta: &fs::Metadata) -> Result<(), FenceError> {
    let uid = meta.uid();
    if uid != 0 && uid != rustix::process::geteuid().as_raw() {
        return Err(FenceError::Untrusted {
            path: path.to_path_buf(),
            why: Distrust::Owner(uid),
        });
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(FenceError::Untrusted {
            path: path.to_path_buf(),
            why: Distrust::Writable(mode),
        });
    }
    Ok(())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn io_err(what: &'static str, path: &Path) -> impl FnOnce(io::Error) -> FenceError {
    let path = path.to_path_buf();
    move |source| FenceError::Io { what, path, source }
}

#[cfg(test)]
mod tests;
