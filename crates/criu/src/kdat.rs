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
//! # Limitations
//! CRIU 4.2 leaves `criu.kdat.tmp` behind when it finds the directory is not a tmpfs (it removes
//! `criu.kdat` instead), and so does a CRIU killed between creating that file and renaming it
//! (cryo kills CRIU at a restore's deadline). As long as that file exists, no CRIU saves the
//! cache (it creates it exclusively): [`cache_unkept`] names it, and cryo does not remove it
//! (another CRIU may be writing it at that moment).

use std::path::Path;

/// The directory CRIU keeps `criu.kdat` in, as root (CRIU's default `RUNDIR`, which
/// `scripts/install-criu.sh` keeps).
pub const KDAT_DIR: &str = "/run";

/// The cache's file name in [`KDAT_DIR`].
pub const KDAT_FILE: &str = "criu.kdat";

/// Why CRIU (as root) cannot keep or load its kernel-feature cache in `dir`, its `RUNDIR`
/// ([`KDAT_DIR`]); `None` when it can. What each run then costs: see the module docs.
pub fn cache_unkept(dir: &Path) -> Option<String> {
    let probes = "every CRIU run probes the kernel again (iptables x3 among ~40 probes: 12-40 ms \
                  measured)";
    let fs = match rustix::fs::statfs(dir) {
        Ok(fs) => fs,
        Err(e) => return Some(format!("cannot statfs {}: {e}; {probes}", dir.display())),
    };
    // `f_type`'s C type differs between architectures; the magic fits all of them.
    #[allow(clippy::unnecessary_cast)]
    if fs.f_type as i64 != libc::TMPFS_MAGIC as i64 {
        return Some(format!(
            "{} is not a tmpfs, so CRIU does not keep its kernel-feature cache ({KDAT_FILE}) \
             there: {probes} (mount a tmpfs there: see docs/kubernetes.md)",
            dir.display()
        ));
    }
    let tmp = dir.join(format!("{KDAT_FILE}.tmp"));
    if !dir.join(KDAT_FILE).exists() && tmp.exists() {
        return Some(format!(
            "{} is left from a CRIU that did not finish writing its kernel-feature cache: no \
             CRIU saves the cache while it exists, so {probes} (remove it when no CRIU runs)",
            tmp.display()
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

    #[test]
    fn a_missing_directory_is_said() {
        let why = cache_unkept(Path::new("/nonexistent-cryo-kdat-dir")).unwrap();
        assert!(why.contains("cannot statfs"), "{why}");
    }
}
