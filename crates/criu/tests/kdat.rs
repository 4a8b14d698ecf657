#![allow(clippy::unwrap_used, clippy::expect_used)]
//! CRIU's kernel-feature cache (`criu.kdat`) and a save of it left behind by a CRIU that died
//! writing it, with the real CRIU (root, CRIU >= 4.2 from scripts/install-criu.sh). A missing
//! CRIU fails this test; it never skips it.
//!
//! As root CRIU keeps the cache only in its build's `RUNDIR` (`/run`), which a test cannot
//! replace on a shared host; with `--unprivileged` it keeps it in `$XDG_RUNTIME_DIR` instead,
//! through the same save (`kerndat_save_cache`: `criu.kdat.tmp` created exclusively, written,
//! renamed), so the test points that at a directory of its own on a tmpfs (`/dev/shm`).

use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime};

use cryo_criu::kdat::{clear_left_write, KDAT_FILE, KDAT_TMP, LEFT_AFTER};

/// `criu check` with its cache in `dir`: every check starts with the kernel probes, then
/// loads the cache or saves it. CRIU's log.
fn check(dir: &Path) -> String {
    let criu = cryo_criu::CriuRpc::locate(None).unwrap();
    let log = dir.join("check.log");
    let out = Command::new(criu.path())
        .args(["check", "--unprivileged", "-v4", "-o"])
        .arg(&log)
        .env("XDG_RUNTIME_DIR", dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "criu check: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let said = std::fs::read_to_string(&log).unwrap();
    std::fs::remove_file(&log).unwrap();
    said
}

/// A CRIU killed between creating `criu.kdat.tmp` and renaming it (cryo kills CRIU at a
/// restore's deadline; the OOM killer) leaves the file: every later CRIU takes it for another's
/// save under way and saves nothing, so each probes the kernel again (12-40 ms), on the
/// DaemonSet's memory `/run` for the pod's life. Once the file is [`LEFT_AFTER`] old with no
/// cache beside it, `clear_left_write` (run before every CRIU cryo starts) removes it, and the
/// next CRIU saves the cache and the one after loads it.
#[test]
fn a_cache_save_left_by_a_dead_criu_no_longer_blocks_the_cache() {
    cryo_testkit::require_criu_and_root();
    let dir = tempfile::tempdir_in("/dev/shm").unwrap();
    let (cache, tmp) = (dir.path().join(KDAT_FILE), dir.path().join(KDAT_TMP));
    // What the dead CRIU left: the file it created (0600, as CRIU makes it), nothing written.
    let f = std::fs::File::create(&tmp).unwrap();
    f.set_modified(SystemTime::now() - LEFT_AFTER - Duration::from_secs(1))
        .unwrap();
    drop(f);

    // The seam, with the real CRIU: two runs, and neither keeps the cache.
    for _ in 0..2 {
        let said = check(dir.path());
        assert!(!cache.exists(), "CRIU saved the cache beside a left write");
        assert!(!said.contains("Loaded kdat cache"), "{said}");
    }

    assert_eq!(clear_left_write(dir.path()).unwrap(), Some(tmp.clone()));
    check(dir.path());
    assert!(cache.exists(), "the next CRIU did not save the cache");
    assert!(!tmp.exists());
    let said = check(dir.path());
    assert!(
        said.contains("Loaded kdat cache"),
        "the cache saved is not loaded: {said}"
    );
}
