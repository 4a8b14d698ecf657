#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A restore whose CRIU fails while the thaw's check of the page contents waits in a read that
//! never returns (the test kit's FUSE server holds cryo's reads of the pages file: its thread
//! waits in the kernel, uninterruptibly, as on a dead disk or an NFS hard mount). One test: the
//! count of abandoned checks is the process's.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cryo_criu::image::{self, Image};
use cryo_criu::{Criu, CriuError, CriuRpc, RestoreOpts};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::{eventually, PATIENCE};

/// The restore's deadline: far past what the restore should take.
const DEADLINE: Duration = Duration::from_secs(30);

/// How long after the check's read reached the server the restore may take to return.
const PROMPTLY: Duration = Duration::from_secs(10);

/// Attack (session 23): the real CRIU fails at once (the kit's tiny image: its `inventory.img`
/// is not one) while the check's read of `pages-1.img` hangs. Nobody needs the check's answer
/// any more: the restore must return CRIU's failure promptly, not wait for the check until its
/// deadline; the stuck read is counted (its thread cannot end) until the file system answers,
/// and then no longer, and a later restore is not refused for it. (Before: "the restore had
/// not returned 10s after the check's read hung (CRIU failed at once)": `run_gated`'s scope
/// joined the check, which waited for its read to the 30 s deadline; once the test's file
/// system answered, 10.1 s in, the restore returned the check's EIO as the image's refusal.)
#[test]
fn a_restore_whose_criu_fails_returns_without_waiting_for_a_check_stuck_in_a_read() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let backing = t.path().join("backing");
    cryo_testkit::image::publish_tiny(&backing);
    let fuse = Stalling::mount(&backing, &t.path().join("img"), Hold::Reads, |n| {
        n.starts_with("pages-")
    });
    let img = Image::open(fuse.path()).unwrap();
    // cryo's reads of the pages file are held from now on (CRIU never gets that far).
    fuse.hold_own();
    let criu = CriuRpc::locate(None)
        .unwrap()
        .in_scratch(&t.path().join("scratch"));
    assert_eq!(image::abandoned_checks(), 0);

    let (tx, rx) = mpsc::channel();
    let restoring = criu.clone();
    std::thread::spawn(move || {
        let r = restoring.restore(
            &img,
            &RestoreOpts {
                deadline: Some(DEADLINE),
                ..RestoreOpts::default()
            },
        );
        let _ = tx.send(r.map(|r| r.pid));
    });
    eventually(PATIENCE, "the check's read to reach the server", || {
        fuse.held() > 0
    });
    let held = Instant::now();
    let result = rx.recv_timeout(PROMPTLY).unwrap_or_else(|_| {
        fuse.answer_all();
        let late = rx.recv_timeout(DEADLINE);
        panic!(
            "the restore had not returned {PROMPTLY:?} after the check's read hung (CRIU failed at once); it returned after {:?}: {late:?}",
            held.elapsed()
        )
    });
    let err = result.unwrap_err();
    assert!(
        matches!(err, CriuError::Failed { .. }),
        "CRIU's failure, not the check's: {err}"
    );
    // The stuck read holds its thread: counted until the file system answers.
    assert_eq!(image::abandoned_checks(), 1, "{err}");
    fuse.answer_all();
    eventually(PATIENCE, "the stuck check to end", || {
        image::abandoned_checks() == 0
    });

    // The next restore (the same image, from its own directory) is checked to its end and
    // fails on CRIU's side as before; nothing of the budget is left used.
    let img = Image::open(&backing).unwrap();
    let err = criu
        .restore(
            &img,
            &RestoreOpts {
                deadline: Some(DEADLINE),
                ..RestoreOpts::default()
            },
        )
        .unwrap_err();
    assert!(matches!(err, CriuError::Failed { .. }), "{err}");
    eventually(PATIENCE, "the second restore's check to end", || {
        image::abandoned_checks() == 0
    });
    drop(fuse);
}
