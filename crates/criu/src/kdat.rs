//! CRIU's cache of what it learnt about the kernel (`criu.kdat`), and whether this host lets
//! CRIU keep it.
//!
//! # Design
//! Every CRIU run starts by probing the kernel's features (`kerndat_init` in CRIU's
//! `criu/kerndat.c`): about forty probes, among them `iptables -L -n`, `ip6tables -L -n` and `sh
//! -c "iptables -n -w -L"`, each a process. Run as root, CRIU keeps the answers in
//! `/run/criu.kdat` (its build's `RUNDIR`: there is no option or environment variable for it)
//! and loads them instead on every later run, but only when that directory is a tmpfs (so that a
//! reboot into another kernel drops them); anywhere else it warns "Can't keep kdat cache on
//! non-tempfs" and probes again on every dump and every restore. Measured on this project's
//! host (Linux 6.18, CRIU 4.2.1, load about 5, `criu check -v4` timestamps): 12-40 ms of probing
//! before CRIU does anything else, 0.07 ms with the cache loaded.
//!
//! What an operator does: nothing on a systemd host (`/run` is a tmpfs there); in a container,
//! whose `/run` is its image's (overlay, or read-only with `readOnlyRootFilesystem`), mount a
//! tmpfs at `/run` (`deploy/daemonset.yaml` mounts an `emptyDir` with `medium: Memory`; iptables'
//! `xtables.lock` goes there too). [`cache_unkept`] says why a host cannot keep the cache; the
//! agent says it once at its start.
//!
//! A write left behind: CRIU 4.2 saves the cache by creating `criu.kdat.tmp` exclusively
//! (`O_CREAT | O_EXCL`), writing it and renaming it to `criu.kdat` (`kerndat_save_cache` in
//! `criu/kerndat.c`); when that file exists already it takes it for another CRIU's save under
//! way and gives up without a word. A CRIU killed between the create and the rename (cryo kills
//! CRIU at a restore's deadline; the OOM killer, a `kill -9`) leaves it, and then no CRIU ever
//! saves the cache on that tmpfs again: on the DaemonSet's memory `emptyDir`, for the pod's
//! life. So before every CRIU it starts, cryo removes such a file ([`clear_left_write`]) when no
//! cache is beside it, the directory is a tmpfs, and the file has not changed for
//! [`LEFT_AFTER`] (a CRIU's save takes microseconds from the create to the rename). Removing
//! the file of a save that was in fact still under way costs at most that save: its rename then
//! fails and it removes `criu.kdat`, or another CRIU's save lands under the name; CRIU checks
//! the size and both magics of the cache it loads and drops a stale one, so no run ever loads
//! a torn cache. Without a cache, the check is one `stat` more than with one (a few
//! microseconds, against 12-40 ms of probes).
//!
//! # Limitations
//! CRIU 4.2 also leaves `criu.kdat.tmp` behind when it finds the directory is not a tmpfs (it
//! removes `criu.kdat` instead): there cryo leaves it (CRIU would make it again at its next run,
//! and cannot keep the cache there anyway). A file younger than [`LEFT_AFTER`] blocks the saves
//! until it is that old: [`cache_unkept`] names it.

use std::path::{Path, PathBuf};
use std::time::Duration;

/// The directory CRIU keeps `criu.kdat` in, as root (CRIU's default `RUNDIR`, which
/// `scripts/install-criu.sh` keeps).
pub const KDAT_DIR: &str = "/run";

/// The cache's file name in [`KDAT_DIR`].
pub const KDAT_FILE: &str = "criu.kdat";

/// The name of a save under way (or left behind) in [`KDAT_DIR`].
pub const KDAT_TMP: &str = "criu.kdat.tmp";

/// How long a save's `criu.kdat.tmp` may stay unchanged with no cache beside it before
/// [`clear_left_write`] counts it as left by a CRIU that died writing it.
pub const LEFT_AFTER: Duration = Duration::from_secs(10);

/// Removes the `criu.kdat.tmp` in `dir` (CRIU's `RUNDIR`, [`KDAT_DIR`]) a CRIU that died
/// while saving its kernel-feature cache left behind (see the module docs): only when `dir`
/// holds no `criu.kdat`, is a tmpfs, and the file is a regular file of this user's unchanged
/// for [`LEFT_AFTER`]. Returns the file removed, if any; `Err` when it could not be looked at or
/// removed (the saves stay blocked; CRIU runs all the same).
pub fn clear_left_write(dir: &Path) -> std::io::Result<Option<PathBuf>> {
    use std::os::unix::fs::MetadataExt;
    let absent = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
    match std::fs::symlink_metadata(dir.join(KDAT_FILE)) {
        // A cache is there: CRIU loads it and saves nothing.
        Ok(_) => return Ok(None),
        Err(e) if absent(&e) => {}
        Err(e) => return Err(e),
    }
    let tmp = dir.join(KDAT_TMP);
    let meta = match std::fs::symlink_metadata(&tmp) {
        Ok(m) => m,
        Err(e) if absent(&e) => return Ok(None),
        Err(e) => return Err(e),
    };
    if !meta.is_file() || meta.uid() != rustix::process::geteuid().as_raw() {
        return Ok(None);
    }
    if !is_tmpfs(dir)? {
        return Ok(None);
    }
    // A clock set back makes it look new: left for a later run.
    let age = meta.modified()?.elapsed().unwrap_or(Duration::ZERO);
    if age < LEFT_AFTER {
        return Ok(None);
    }
    match std::fs::remove_file(&tmp) {
        Ok(()) => Ok(Some(tmp)),
        // Another cryo removed it first.
        Err(e) if absent(&e) => Ok(None),
        Err(e) => Err(e),
    }
}

/// [`clear_left_write`], saying what it removed (a warning: a CRIU died mid-save) or why it
/// could not look (debug: CRIU runs all the same).
pub fn clear_and_say(dir: &Path) {
    match clear_left_write(dir) {
        Ok(Some(tmp)) => tracing::warn!(
            path = %tmp.display(),
            "removed a save of CRIU's kernel-feature cache left by a CRIU that died writing it: \
             CRIU keeps its cache again"
        ),
        Ok(None) => {}
        Err(e) => {
            tracing::debug!(dir = %dir.display(), error = %e, "cannot look for a save of CRIU's kernel-feature cache left behind")
        }
    }
}

/// Whether `dir` is on a tmpfs.
fn is_tmpfs(dir: &Path) -> std::io::Result<bool> {
    let fs = rustix::fs::statfs(dir)?;
    // `f_type`'s C type differs between architectures; the magic fits all of them.
    #[allow(clippy::unnecessary_cast)]
    Ok(fs.f_type as i64 == libc::TMPFS_MAGIC as i64)
}

/// Why CRIU (as root) cannot keep or load its kernel-feature cache in `dir`, its `RUNDIR`
/// ([`KDAT_DIR`]); `None` when it can. What each run then costs: see the module docs.
pub fn cache_unkept(dir: &Path) -> Option<String> {
    let probes = "every CRIU run probes the kernel again (iptables x3 among ~40 probes: 12-40 ms \
                  measured)";
    let tmpfs = match is_tmpfs(dir) {
        Ok(t) => t,
        Err(e) => return Some(format!("cannot statfs {}: {e}; {probes}", dir.display())),
    };
    if !tmpfs {
        return Some(format!(
            "{} is not a tmpfs, so CRIU does not keep its kernel-feature cache ({KDAT_FILE}) \
             there: {probes} (mount a tmpfs there: see docs/kubernetes.md)",
            dir.display()
        ));
    }
    let tmp = dir.join(KDAT_TMP);
    if !dir.join(KDAT_FILE).exists() && tmp.exists() {
        return Some(format!(
            "{} is left from a CRIU that did not finish writing its kernel-feature cache: no \
             CRIU saves the cache while it exists, so {probes} (cryo removes it before a CRIU \
             run once it has not changed for {} s)",
            tmp.display(),
            LEFT_AFTER.as_secs()
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A directory on this host's tmpfs (`/dev/shm`), no mount of the test's own.
    fn on_tmpfs() -> tempfile::TempDir {
        tempfile::tempdir_in("/dev/shm").unwrap()
    }

    #[test]
    fn a_tmpfs_keeps_the_cache() {
        let d = on_tmpfs();
        assert_eq!(cache_unkept(d.path()), None);
        // A cache already there, with a write under way beside it: loaded all the same.
        std::fs::write(d.path().join(KDAT_FILE), b"x").unwrap();
        std::fs::write(d.path().join("criu.kdat.tmp"), b"").unwrap();
        assert_eq!(cache_unkept(d.path()), None);
    }

    #[test]
    fn a_directory_on_another_file_system_does_not() {
        // procfs: never a tmpfs, wherever the tests run.
        let why = cache_unkept(Path::new("/proc")).unwrap();
        assert!(why.contains("is not a tmpfs"), "{why}");
    }

    #[test]
    fn a_write_left_behind_without_a_cache_blocks_every_later_save() {
        let d = on_tmpfs();
        std::fs::write(d.path().join("criu.kdat.tmp"), b"").unwrap();
        let why = cache_unkept(d.path()).unwrap();
        assert!(why.contains("criu.kdat.tmp is left"), "{why}");
    }

    /// `criu.kdat.tmp` in `d`, last changed `ago`.
    fn left_write(d: &Path, ago: Duration) -> PathBuf {
        let tmp = d.join(KDAT_TMP);
        let f = std::fs::File::create(&tmp).unwrap();
        f.set_modified(std::time::SystemTime::now() - ago).unwrap();
        tmp
    }

    #[test]
    fn a_write_left_behind_is_removed_once_it_is_old_enough() {
        let d = on_tmpfs();
        let tmp = left_write(d.path(), LEFT_AFTER + Duration::from_secs(1));
        assert_eq!(clear_left_write(d.path()).unwrap(), Some(tmp.clone()));
        assert!(!tmp.exists());
        assert_eq!(cache_unkept(d.path()), None);
        // Nothing left: nothing to do.
        assert_eq!(clear_left_write(d.path()).unwrap(), None);
    }

    #[test]
    fn a_save_that_may_be_under_way_is_left_alone() {
        let d = on_tmpfs();
        // Younger than the bound: a CRIU may be between its create and its rename.
        let tmp = left_write(d.path(), Duration::ZERO);
        assert_eq!(clear_left_write(d.path()).unwrap(), None);
        assert!(tmp.exists());
        // With a cache beside it, CRIU saves nothing: whatever the file is, it stays.
        let tmp = left_write(d.path(), LEFT_AFTER * 2);
        std::fs::write(d.path().join(KDAT_FILE), b"x").unwrap();
        assert_eq!(clear_left_write(d.path()).unwrap(), None);
        assert!(tmp.exists());
    }

    #[test]
    fn a_link_or_a_directory_under_the_name_is_left_alone() {
        let d = on_tmpfs();
        let target = left_write(d.path(), LEFT_AFTER * 2);
        let elsewhere = d.path().join("elsewhere");
        std::fs::rename(&target, &elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, d.path().join(KDAT_TMP)).unwrap();
        assert_eq!(clear_left_write(d.path()).unwrap(), None);
        assert!(d.path().join(KDAT_TMP).symlink_metadata().is_ok());
        std::fs::remove_file(d.path().join(KDAT_TMP)).unwrap();
        std::fs::create_dir(d.path().join(KDAT_TMP)).unwrap();
        assert_eq!(clear_left_write(d.path()).unwrap(), None);
        assert!(d.path().join(KDAT_TMP).is_dir());
    }

    #[test]
    fn a_missing_directory_is_said() {
        let why = cache_unkept(Path::new("/nonexistent-cryo-kdat-dir")).unwrap();
        assert!(why.contains("cannot statfs"), "{why}");
    }
}
