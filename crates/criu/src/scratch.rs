//! Private directories of CRIU runs (the gate, the streamer's socket, CRIU's work files and
//! log), and the sweep of those whose owner died.
//!
//! # Design
//! Each dump and restore works in a fresh directory `PREFIX-XXXXXX` (0700, root's) under a
//! scratch root: the state directory's `criu/` for cryo's commands and agent
//! ([`crate::CriuRpc::in_scratch`]), the system's temporary directory otherwise. Its owner holds
//! an exclusive `flock` on the `owner` file inside it for as long as it lives, so a process that
//! dies mid-restore (SIGKILL, OOM) gives its lock back with its life. [`sweep`], run when a
//! command or the agent sets CRIU up, removes every such directory whose lock it can take: its
//! owner is gone. A directory kept after a failure (it holds the log the error names, marked
//! `kept`) survives the sweep, the newest [`KEEP_FAILED`] of them.
//!
//! A restore records in its directory what it started ([`Restoring`]: CRIU's pid and start
//! time, the image's pids) as soon as CRIU runs. A restore whose cryo died before CRIU's gate
//! passed (no `ok` in the gate file) can never run what it restored (the gate's script fails
//! without cryo's verdict), but CRIU may go on restoring for minutes, or forever when a restored
//! process waits for a file lock held elsewhere: the sweep ends that CRIU (SIGKILL, by pidfd,
//! if it is still the same process) and every process of the image that started after it and
//! holds no GPU driver fd (none of them ever ran: they wait in CRIU's restorer), and says so
//! ([`Swept::ended`]; a thaw journals it). Past the gate the restored tree may run and its
//! processes hold contexts CRIU's caller was to restore: the sweep leaves those alone. An agent
//! that starts while another process restores ([`live_restores`]) waits for that owner's end
//! ([`wait_for_owner`]) and sweeps at once, instead of leaving a dead thaw's CRIU and what it
//! half restored (their host memory, the image's pids) to the next command.
//!
//! # Limitations
//! A restore killed between spawning CRIU and recording it (one write) is not ended by the
//! sweep; its CRIU still cannot pass the gate. A directory whose owner died between making it and locking it (microseconds) has no lock
//! file: it is removed once older than [`UNLOCKED_GRACE`]. The sweep looks only at directories
//! the running user owns, never through a link.

use std::fs::File;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use nix::fcntl::{Flock, FlockArg};

/// Names of restore directories.
pub(crate) const RESTORE_PREFIX: &str = "cryo-criu-restore-";
/// Names of dump directories.
pub(crate) const DUMP_PREFIX: &str = "cryo-criu-dump-";
/// The lock file inside each directory.
const OWNER: &str = "owner";
/// What a restore started ([`Restoring`]).
const RESTORING: &str = "restoring.json";
/// The gate's verdict file (`ok` once cryo let CRIU go on; see `criu.rs`'s `Gate`).
pub(crate) const GATE: &str = "gate";

/// What a restore started, recorded in its directory for the sweep.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub(crate) struct Restoring {
    /// The image.
    pub(crate) image: PathBuf,
    /// Its processes' pids (CRIU restores them with these).
    pub(crate) pids: Vec<cryo_proc::Pid>,
    /// CRIU's pid and start time (clock ticks since boot).
    pub(crate) criu: cryo_proc::Pid,
    pub(crate) criu_start: u64,
}

/// A restore whose cryo died before CRIU's gate, ended by [`sweep`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedRestore {
    /// The image it restored.
    pub image: PathBuf,
    /// CRIU, if it was still running (killed).
    pub criu: Option<cryo_proc::Pid>,
    /// Processes of the image it had restored (none ran), killed.
    pub killed: Vec<cryo_proc::Pid>,
    /// Processes left, and why (one holding a GPU driver fd is never killed here).
    pub left: Vec<String>,
}

impl std::fmt::Display for EndedRestore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "a restore of {} whose cryo died before CRIU's gate: ",
            self.image.display()
        )?;
        match self.criu {
            Some(p) => write!(f, "CRIU (pid {p}) killed")?,
            None => write!(f, "CRIU already gone")?,
        }
        write!(
            f,
            ", processes it had restored (none ran) killed: {:?}",
            self.killed
        )?;
        if !self.left.is_empty() {
            write!(f, "; left: {}", self.left.join("; "))?;
        }
        Ok(())
    }
}
/// The mark of a directory kept for its log.
const KEPT: &str = "kept";
/// How many kept directories (failed runs' logs) the sweep leaves, the newest.
pub const KEEP_FAILED: usize = 8;
/// How old a directory without a lock file must be before the sweep takes its owner for dead.
pub const UNLOCKED_GRACE: Duration = Duration::from_secs(60);

/// One run's private directory, removed when dropped unless [`Private::keep`] was called.
#[derive(Debug)]
pub(crate) struct Private {
    dir: Option<tempfile::TempDir>,
    path: PathBuf,
    _owner: Flock<File>,
}

impl Private {
    /// A fresh directory named `prefix` + random under `root` (made if missing, 0700), locked.
    pub(crate) fn new(root: &Path, prefix: &str) -> std::io::Result<Private> {
        make_root(root)?;
        let dir = tempfile::Builder::new().prefix(prefix).tempdir_in(root)?;
        let f = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(dir.path().join(OWNER))?;
        let owner = Flock::lock(f, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| std::io::Error::from(e))?;
        Ok(Private {
            path: dir.path().to_path_buf(),
            dir: Some(dir),
            _owner: owner,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Records what a restore started, for the sweep should this process die before the gate.
    pub(crate) fn record_restoring(&self, r: &Restoring) -> std::io::Result<()> {
        let tmp = self.path.join(format!("{RESTORING}.new"));
        std::fs::write(&tmp, serde_json::to_vec(r).map_err(std::io::Error::other)?)?;
        std::fs::rename(tmp, self.path.join(RESTORING))
    }

    /// Leaves the directory in place (it holds the log an error names); the sweep keeps the
    /// newest [`KEEP_FAILED`] of those.
    pub(crate) fn keep(&mut self) {
        if let Some(d) = self.dir.take() {
            let _ = File::create(d.path().join(KEPT));
            let _ = d.keep();
        }
    }
}

/// Makes `root` (and its parents) if missing; `root` itself 0700.
fn make_root(root: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::DirBuilderExt;
    match std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(root)
    {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Ok(()),
        Err(e) => Err(e),
    }
}

/// What [`sweep`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    /// Directories removed (their owner had died).
    pub removed: Vec<PathBuf>,
    /// Directories that could not be removed, and why.
    pub failed: Vec<(PathBuf, String)>,
    /// Restores whose cryo died before CRIU's gate, ended.
    pub ended: Vec<EndedRestore>,
}

/// Removes the private directories under `root` whose owner is gone (see the module docs),
/// keeping the newest [`KEEP_FAILED`] kept ones. A missing `root` has nothing to sweep.
pub fn sweep(root: &Path) -> Swept {
    let mut swept = Swept::default();
    let Ok(entries) = std::fs::read_dir(root) else {
        return swept;
    };
    let me = rustix::process::geteuid().as_raw();
    let mut kept: Vec<(SystemTime, PathBuf, Flock<File>)> = Vec::new();
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(name) = name.to_str() else { continue };
        if !(name.starts_with(RESTORE_PREFIX) || name.starts_with(DUMP_PREFIX)) {
            continue;
        }
        let path = e.path();
        // Never through a link, never someone else's.
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if !meta.is_dir() || meta.uid() != me {
            continue;
        }
        let lock = match owner(&path) {
            Ok(f) => match Flock::lock(f, FlockArg::LockExclusiveNonblock) {
                Ok(l) => Some(l),
                // Its owner lives.
                Err(_) => continue,
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let age = meta
                    .modified()
                    .ok()
                    .and_then(|m| m.elapsed().ok())
                    .unwrap_or_default();
                if age < UNLOCKED_GRACE {
                    continue;
                }
                None
            }
            Err(_) => continue,
        };
        if let Some(l) = lock {
            if path.join(KEPT).exists() {
                kept.push((meta.modified().unwrap_or(SystemTime::UNIX_EPOCH), path, l));
                continue;
            }
            if name.starts_with(RESTORE_PREFIX) {
                if let Some(e) = end_restore(&path) {
                    tracing::warn!("{e}");
                    swept.ended.push(e);
                }
            }
        }
        remove(&path, &mut swept);
    }
    kept.sort_by_key(|k| std::cmp::Reverse(k.0));
    for (_, path, _lock) in kept.into_iter().skip(KEEP_FAILED) {
        remove(&path, &mut swept);
    }
    if !swept.removed.is_empty() {
        tracing::info!(removed = ?swept.removed, "removed CRIU directories of runs that died");
    }
    swept
}

/// The restore directories under `root` whose owner lives (its lock is held, by this process
/// or another): restores in flight. An agent that starts watches those of other processes
/// ([`wait_for_owner`]) so that one that dies before CRIU's gate is swept at once.
pub fn live_restores(root: &Path) -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root) else {
        return Vec::new();
    };
    let me = rustix::process::geteuid().as_raw();
    entries
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_str()
                .is_some_and(|n| n.starts_with(RESTORE_PREFIX))
        })
        .map(|e| e.path())
        .filter(|p| {
            std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == me)
                && owner(p).is_ok_and(|f| Flock::lock(f, FlockArg::LockExclusiveNonblock).is_err())
        })
        .collect()
}

/// Blocks until the owner of the run directory `dir` is gone or done: the kernel gives its lock
/// back with its life (a blocking `flock`, no polling). Then [`sweep`] ends what it left.
pub fn wait_for_owner(dir: &Path) -> std::io::Result<()> {
    let mut f = owner(dir)?;
    loop {
        match Flock::lock(f, FlockArg::LockExclusive) {
            Ok(lock) => {
                drop(lock);
                return Ok(());
            }
            // A signal handled by this process interrupted the wait.
            Err((back, nix::errno::Errno::EINTR)) => f = back,
            Err((_, e)) => return Err(e.into()),
        }
    }
}

/// The lock file of the run directory `dir`, never through a link.
fn owner(dir: &Path) -> std::io::Result<File> {
    File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(dir.join(OWNER))
}

/// Ends what a restore recorded in `dir` started, if its cryo died before the gate.
fn end_restore(dir: &Path) -> Option<EndedRestore> {
    let rec: Restoring = serde_json::from_slice(&std::fs::read(dir.join(RESTORING)).ok()?).ok()?;
    // Past the gate the tree may run: not the sweep's to end.
    if std::fs::read(dir.join(GATE)).is_ok_and(|g| g.starts_with(b"ok")) {
        return None;
    }
    let mut ended = EndedRestore {
        image: rec.image.clone(),
        criu: None,
        killed: Vec::new(),
        left: Vec::new(),
    };
    // CRIU first: it would restore further.
    if let Ok(h) = cryo_proc::ProcHandle::open(rec.criu) {
        if h.stat().is_ok_and(|s| s.start_time == rec.criu_start)
            && h.signal(nix::sys::signal::Signal::SIGKILL).is_ok()
        {
            h.wait_exit(Duration::from_secs(5));
            ended.criu = Some(rec.criu);
        }
    }
    let (killed, left) = crate::criu::end_unresumed(&rec.pids, |s| s.start_time >= rec.criu_start);
    ended.killed = killed;
    ended.left = left;
    // What CRIU forked that no pid of the image names, or that still runs CRIU's command line.
    let (killed, left) = crate::criu::end_criu_forks(dir, |s| s.start_time >= rec.criu_start);
    ended.killed.extend(killed);
    ended.left.extend(left);
    (ended.criu.is_some() || !ended.killed.is_empty() || !ended.left.is_empty()).then_some(ended)
}

fn remove(path: &Path, swept: &mut Swept) {
    match std::fs::remove_dir_all(path) {
        Ok(()) => swept.removed.push(path.to_path_buf()),
        Err(e) => swept.failed.push((path.to_path_buf(), e.to_string())),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn the_sweep_leaves_live_runs_and_removes_dead_ones() {
        let root = tempfile::tempdir().unwrap();
        let live = Private::new(root.path(), RESTORE_PREFIX).unwrap();
        let dead = Private::new(root.path(), DUMP_PREFIX).unwrap();
        let dead_path = dead.path().to_path_buf();
        std::fs::write(dead_path.join("restore.log"), b"x").unwrap();
        // Its owner dies without cleaning up: the directory stays, the lock goes.
        let Private { dir, _owner, .. } = dead;
        let _ = dir.unwrap().keep();
        drop(_owner);
        // Not a run's directory: never touched.
        std::fs::create_dir(root.path().join("other")).unwrap();

        let swept = sweep(root.path());
        assert_eq!(swept.removed, vec![dead_path.clone()]);
        assert!(!dead_path.exists());
        assert!(live.path().exists());
        assert!(root.path().join("other").exists());
        drop(live);
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 1);
    }

    #[test]
    fn kept_directories_survive_up_to_the_newest_few() {
        let root = tempfile::tempdir().unwrap();
        let mut paths = Vec::new();
        for i in 0..KEEP_FAILED + 3 {
            let mut p = Private::new(root.path(), RESTORE_PREFIX).unwrap();
            p.keep();
            paths.push(p.path().to_path_buf());
            // Distinct modification times, oldest first.
            File::open(p.path())
                .unwrap()
                .set_modified(SystemTime::UNIX_EPOCH + Duration::from_secs(1000 + i as u64))
                .unwrap();
            drop(p);
        }
        let swept = sweep(root.path());
        assert_eq!(swept.removed.len(), 3, "{swept:?}");
        for p in &paths[..3] {
            assert!(!p.exists(), "{}", p.display());
        }
        for p in &paths[3..] {
            assert!(p.exists(), "{}", p.display());
        }
    }

    #[test]
    fn a_fresh_directory_without_a_lock_is_left_for_its_owner() {
        let root = tempfile::tempdir().unwrap();
        let young = root.path().join(format!("{RESTORE_PREFIX}young"));
        std::fs::create_dir(&young).unwrap();
        assert!(sweep(root.path()).removed.is_empty());
        assert!(young.exists());
        assert!(sweep(&root.path().join("missing")).removed.is_empty());
    }
}
