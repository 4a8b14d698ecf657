#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A restore in a process that ignores `SIGCHLD` (`SIG_IGN` survives `execve`: a parent that
//! ignores it leaves it ignored in `cryo`): the kernel reaps every child of the process as it
//! exits, CRIU included, so no wait of cryo's ever gets CRIU's status. A binary of its own: the
//! disposition and the count of CRIUs waited for are the process's.

use std::fs;
use std::time::Duration;

use cryo_criu::image::Image;
use cryo_criu::{Criu, CriuRpc, RestoreOpts};
use cryo_testkit::{eventually, PATIENCE};

/// Attack (session 23): with `SIGCHLD` ignored, a restore whose CRIU passed the gate, resumed the
/// tree and exited must hand the tree over (it runs), and one whose CRIU lingers past
/// `post-resume` must too, its background wait ending once CRIU exits (`ECHILD`: reaped by
/// the kernel) and its place in the budget given back.
#[test]
fn a_restore_in_a_process_that_ignores_sigchld_hands_over_its_tree() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let criu = CriuRpc::locate(None)
        .unwrap()
        .in_scratch(&t.path().join("scratch"));
    let image = t.path().join("image");
    cryo_testkit::image::dumped_tree(&criu, &image, "exec sleep 100000", 1);
    let restore = || {
        criu.restore(
            &Image::open(&image).unwrap(),
            &RestoreOpts {
                deadline: Some(Duration::from_secs(30)),
                ..RestoreOpts::default()
            },
        )
    };
    // SAFETY: signal(2) with SIG_IGN takes no pointer.
    unsafe { libc::signal(libc::SIGCHLD, libc::SIG_IGN) };

    let root = restore()
        .unwrap_or_else(|e| panic!("the resumed tree was not handed over: {e}"))
        .pid;
    assert!(cryo_testkit::procs::alive(root));
    cryo_testkit::procs::kill(root, libc::SIGKILL);
    eventually(PATIENCE, "the restored root to be gone", || {
        !fs::exists(format!("/proc/{root}")).unwrap()
    });

    // CRIU held past post-resume: waited for in the background.
    let release = t.path().join("let-criu-exit");
    std::env::set_var(cryo_criu::CRIU_POST_RESUME_HELD, &release);
    let root = restore()
        .unwrap_or_else(|e| panic!("the resumed tree was not handed over: {e}"))
        .pid;
    assert_eq!(cryo_criu::stuck_crius(), 1);
    fs::write(&release, b"").unwrap();
    eventually(PATIENCE, "the background wait for CRIU to end", || {
        cryo_criu::stuck_crius() == 0
    });
    cryo_testkit::procs::kill(root, libc::SIGKILL);
}
