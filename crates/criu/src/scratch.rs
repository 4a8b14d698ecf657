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
//! time) as soon as CRIU runs. A restore whose cryo died before CRIU's gate
//! passed (no `ok` in the gate file) can never run what it restored (the gate's script fails
//! without cryo's verdict), but CRIU may go on restoring for minutes, or forever when a restored
//! process waits for a file lock held elsewhere: the sweep ends that CRIU (SIGKILL, by pidfd,
//! if it is still the same process) and what it restored or forked, found by the kernel's
//! evidence (its tracee, its children, their trees: see `unresumed`), never by the image's
//! pids (a tree with a pid namespace of its own comes back under other host pids, and a host
//! process may hold one of the image's by now); none of them ever ran (they wait in CRIU's
//! restorer), and one holding a GPU driver fd is left alone. The sweep says what it ended
//! ([`Swept::ended`]; a thaw journals it). Past the gate the restored tree may run and its
//! processes hold contexts CRIU's caller was to restore: the sweep leaves those alone. An agent
//! waits for the end ([`wait_for_owner`]) of every restore another process has in flight: those
//! it finds as it starts ([`live_restores`]) and those whose directory appears later
//! ([`RestoreWatch`]); it sweeps at once, instead of leaving a dead thaw's CRIU and what it
//! half restored (their host memory and pids) to the next command. A directory appears under
//! its run's name only with its owner's lock already held (made hidden, then renamed).
//!
//! # Limitations
//! A restore killed between spawning CRIU and recording it (one write) is not ended by the
//! sweep; its CRIU still cannot pass the gate. A directory whose owner died before it was
//! renamed into place (microseconds) is hidden and may have no lock file: it is removed once
//! older than [`UNLOCKED_GRACE`]. The sweep looks only at directories the running user owns,
//! never through a link.

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
    /// CRIU's pid and start time (clock ticks since boot).
    pub(crate) criu: cryo_proc::Pid,
    pub(crate) criu_start: u64,
    /// CRIU's binary, links resolved (what its forks' `/proc/PID/exe` names); absent in a
    /// record of an older cryo.
    #[serde(default)]
    pub(crate) bin: Option<PathBuf>,
}

/// A restore whose cryo died before CRIU's gate, ended by [`sweep`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EndedRestore {
    /// The image it restored.
    pub image: PathBuf,
    /// CRIU, if it was still running (killed).
    pub criu: Option<cryo_proc::Pid>,
    /// Processes it had restored or forked (none ran), killed: host pids, found by the
    /// kernel's evidence (never the image's pids).
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
    path: PathBuf,
    kept: bool,
    /// Its device and inode, in [`own`] while this lives.
    id: Option<(u64, u64)>,
    _owner: Flock<File>,
}

/// The run directories this process made and still holds (device, inode): a [`RestoreWatch`]
/// in this process leaves them out. An agent's own restores end with its own call (which
/// removes their directory) or with the agent: no thread waits on them and no sweep follows.
fn own() -> std::sync::MutexGuard<'static, Vec<(u64, u64)>> {
    static OWN: std::sync::Mutex<Vec<(u64, u64)>> = std::sync::Mutex::new(Vec::new());
    OWN.lock().unwrap_or_else(|p| p.into_inner())
}

/// Whether the directory at `path` is one this process holds (see [`own`]).
fn held_here(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok_and(|m| own().contains(&(m.dev(), m.ino())))
}

/// Makes a directory named `prefix` + random under `root` (made if missing, 0700) under a
/// hidden name, makes and locks its lock file, calls `before` with its device and inode, and
/// only then renames it into place (see [`Private::new`]).
fn make_locked(
    root: &Path,
    prefix: &str,
    before: impl FnOnce((u64, u64)),
) -> std::io::Result<(PathBuf, Flock<File>)> {
    make_root(root)?;
    let staging = tempfile::Builder::new()
        .prefix(&format!(".{prefix}"))
        .tempdir_in(root)?;
    let f = File::options()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(staging.path().join(OWNER))?;
    let owner = Flock::lock(f, FlockArg::LockExclusiveNonblock)
        .map_err(|(_, e)| std::io::Error::from(e))?;
    let m = std::fs::symlink_metadata(staging.path())?;
    let hidden = staging
        .path()
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| std::io::Error::other("unusable directory name"))?;
    let path = root.join(hidden.trim_start_matches('.'));
    before((m.dev(), m.ino()));
    rustix::fs::renameat_with(
        rustix::fs::CWD,
        staging.path(),
        rustix::fs::CWD,
        &path,
        rustix::fs::RenameFlags::NOREPLACE,
    )?;
    // Renamed: the staging name is gone, nothing for its guard to remove.
    let _ = staging.keep();
    Ok((path, owner))
}

impl Private {
    /// A fresh directory named `prefix` + random under `root` (made if missing, 0700), locked.
    /// It is made under a hidden name (`.` first), its lock file made and locked there, and
    /// only then renamed into place: a directory under a run's name always holds its owner's
    /// lock, so whoever sees it appear ([`RestoreWatch`]) can wait on that lock at once. (A
    /// hidden one whose maker died is swept as a directory without a lock.)
    pub(crate) fn new(root: &Path, prefix: &str) -> std::io::Result<Private> {
        // Known as this process's before it appears under its name: a watch in this process
        // never takes it for another's.
        let mut id = None;
        let made = make_locked(root, prefix, |dir| {
            id = Some(dir);
            own().push(dir);
        });
        let (path, owner) = made.inspect_err(|_| {
            if let Some(id) = id {
                own().retain(|o| *o != id);
            }
        })?;
        Ok(Private {
            path,
            kept: false,
            id,
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
        if !self.kept {
            let _ = File::create(self.path.join(KEPT));
            self.kept = true;
        }
    }
}

impl Drop for Private {
    /// Removes the directory unless kept; its lock goes after (with the fields).
    fn drop(&mut self) {
        if !self.kept {
            let _ = std::fs::remove_dir_all(&self.path);
        }
        if let Some(id) = self.id {
            own().retain(|o| *o != id);
        }
    }
}

/// Makes `root` (and its parents) if missing; `root` itself 0700.
pub(crate) fn make_root(root: &Path) -> std::io::Result<()> {
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
        // A hidden one is still being made (see `Private::new`), or its maker died first.
        let run = name.strip_prefix('.').unwrap_or(name);
        if !(run.starts_with(RESTORE_PREFIX) || run.starts_with(DUMP_PREFIX)) {
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
    restore_dirs(root)
        .into_iter()
        .filter(|p| {
            owner(p).is_ok_and(|f| Flock::lock(f, FlockArg::LockExclusiveNonblock).is_err())
        })
        .collect()
}

/// The restore directories under `root` (under their run's name), the running user's, never
/// through a link.
fn restore_dirs(root: &Path) -> Vec<PathBuf> {
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
        .filter(|p| std::fs::symlink_metadata(p).is_ok_and(|m| m.is_dir() && m.uid() == me))
        .collect()
}

/// A watch on a scratch root for restore directories made after it started (an inotify watch:
/// the kernel queues each creation, so none made between two looks is missed). An agent runs
/// one so that a restore begun by a command that found no agent, whose directory appeared after
/// the agent's first look ([`live_restores`]), is still watched ([`wait_for_owner`]) and swept
/// at once when its owner dies.
#[derive(Debug)]
pub struct RestoreWatch {
    inotify: std::os::fd::OwnedFd,
    root: PathBuf,
    /// Restore directories already named (existing when the watch started, or returned since).
    seen: std::collections::HashSet<PathBuf>,
}

impl RestoreWatch {
    /// Starts watching `root` (made, 0700, if missing). Directories there now are not returned
    /// by [`RestoreWatch::wait_new`]: the caller's own look ([`live_restores`], [`sweep`]), made
    /// after this, covers them.
    pub fn start(root: &Path) -> std::io::Result<RestoreWatch> {
        use rustix::fs::inotify;
        make_root(root)?;
        let fd = inotify::init(inotify::CreateFlags::CLOEXEC)?;
        inotify::add_watch(
            &fd,
            root,
            inotify::WatchFlags::CREATE | inotify::WatchFlags::MOVED_TO,
        )?;
        Ok(RestoreWatch {
            inotify: fd,
            root: root.to_path_buf(),
            seen: restore_dirs(root).into_iter().collect(),
        })
    }

    /// Blocks until directories are made under the root, then returns the restore directories
    /// not returned before (whether their owner still lives or not: [`wait_for_owner`] returns
    /// at once for a dead one), but this process's own.
    pub fn wait_new(&mut self) -> std::io::Result<Vec<PathBuf>> {
        let mut buf = [0u8; 4096];
        loop {
            match rustix::io::read(&self.inotify, &mut buf) {
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            }
            let now = restore_dirs(&self.root);
            // Forget what is gone (a finished run's directory), so the set stays small.
            self.seen.retain(|d| now.contains(d));
            let new: Vec<PathBuf> = now
                .into_iter()
                .filter(|d| self.seen.insert(d.clone()) && !held_here(d))
                .collect();
            if !new.is_empty() {
                return Ok(new);
            }
        }
    }
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
    // CRIU, if it is still that process, and what it restored or forked: found by the kernel's
    // evidence (its tracee, its children, their trees), never by the image's pids.
    let criu = cryo_proc::ProcHandle::open_expected(rec.criu, rec.criu_start).ok();
    let run = crate::unresumed::end_run(
        criu,
        Vec::new(),
        &crate::unresumed::Run {
            private: dir,
            bin: rec.bin.as_deref(),
            criu_start: rec.criu_start,
            criu: Some(rec.criu),
        },
    );
    let ended = EndedRestore {
        image: rec.image,
        criu: run.criu,
        killed: run.killed.iter().map(|(pid, _)| *pid).collect(),
        left: run.left,
    };
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
        let mut dead = dead;
        let dead_path = dead.path().to_path_buf();
        std::fs::write(dead_path.join("restore.log"), b"x").unwrap();
        // Its owner dies without cleaning up: the directory stays, the lock goes.
        dead.kept = true;
        drop(dead);
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

    /// A restore directory as another process makes it ([`Private::new`] there): locked by
    /// an open file of its own, not this process's.
    fn another_process_s(root: &Path) -> (PathBuf, Flock<File>) {
        make_locked(root, RESTORE_PREFIX, |_| {}).unwrap()
    }

    /// A restore directory appears under its name only with its owner's lock held, so an agent
    /// that sees it appear waits on that lock (no window where it would take the run for done).
    #[test]
    fn a_watch_sees_each_new_restore_directory_with_its_owner_s_lock_held() {
        let root = tempfile::tempdir().unwrap();
        let before = Private::new(root.path(), RESTORE_PREFIX).unwrap();
        let mut watch = RestoreWatch::start(root.path()).unwrap();
        let _dump = Private::new(root.path(), DUMP_PREFIX).unwrap();
        let (new, _lock) = another_process_s(root.path());
        assert_eq!(watch.wait_new().unwrap(), vec![new.clone()]);
        let mut live = live_restores(root.path());
        live.sort();
        let mut both = vec![before.path().to_path_buf(), new];
        both.sort();
        assert_eq!(live, both);
        let names: Vec<String> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(names.iter().all(|n| !n.starts_with('.')), "{names:?}");
    }

    /// Attack (session 10) on an agent's watch: the restores the agent runs itself (its
    /// thaws, its standbys) are its own to clean up; the watch must not hand them over to a
    /// thread that waits for their end and sweeps after (work done for nothing), only another
    /// process's. (Before: every restore directory was returned, the agent's own too.)
    #[test]
    fn a_watch_leaves_out_this_process_s_own_restores() {
        let root = tempfile::tempdir().unwrap();
        let mut watch = RestoreWatch::start(root.path()).unwrap();
        let mine = Private::new(root.path(), RESTORE_PREFIX).unwrap();
        let (theirs, _lock) = another_process_s(root.path());
        assert_eq!(
            watch.wait_new().unwrap(),
            vec![theirs],
            "this process's own restore {} was returned",
            mine.path().display()
        );
        // Once this process let its directory go (kept for its log, owner gone), it is no
        // longer its own: a later watch's look at it is the sweep's business.
        let mut mine = mine;
        mine.keep();
        let kept = mine.path().to_path_buf();
        drop(mine);
        assert!(!held_here(&kept));
    }

    #[test]
    fn a_hidden_directory_whose_maker_died_is_swept_after_the_grace() {
        let root = tempfile::tempdir().unwrap();
        let stale = root.path().join(format!(".{RESTORE_PREFIX}stale"));
        std::fs::create_dir(&stale).unwrap();
        assert!(sweep(root.path()).removed.is_empty());
        File::open(&stale)
            .unwrap()
            .set_modified(SystemTime::now() - UNLOCKED_GRACE - Duration::from_secs(1))
            .unwrap();
        assert_eq!(sweep(root.path()).removed, vec![stale.clone()]);
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
