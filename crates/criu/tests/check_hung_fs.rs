#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The thaw's check on an image whose file system stops answering opens and stats (the
//! testkit's FUSE server that holds them: cryo's own thread waits in the kernel, uninterruptibly,
//! as on a dead disk or an NFS hard mount). One test: the count of abandoned checks is the
//! process's.

use std::sync::mpsc;
use std::time::{Duration, Instant};

use cryo_criu::image::{self, Image};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::{eventually, PATIENCE};

/// How long past its deadline a check may take to return before the test calls it hung.
const PAST_DEADLINE: Duration = Duration::from_secs(20);

/// Waits for what a check thread sends, `deadline` + [`PAST_DEADLINE`] at most.
fn answer<T>(rx: &mpsc::Receiver<T>, deadline: Instant, what: &str) -> T {
    rx.recv_timeout(deadline.saturating_duration_since(Instant::now()) + PAST_DEADLINE)
        .unwrap_or_else(|_| {
            panic!(
                "{what} had not returned {} s past the restore's deadline",
                PAST_DEADLINE.as_secs()
            )
        })
}

/// Attack (session 17): the image's file system stops answering (1) the opens of the check's
/// first look, before CRIU starts (`Check::new_until`: the files' identities were noted by
/// opening and looking at each on the thaw's own thread), and (2) the stats of the verdict at
/// CRIU's gate (`unchanged`: each file opened and looked at again, on the gate's thread). Each
/// must give up at the restore's deadline, refuse the image, and leave its stuck thread
/// counted until the file system answers. (Before: both waited without bound: the test failed
/// with "Check::new_until had not returned 20 s past the restore's deadline"; the page reads
/// alone were bounded, commit 9e94730.)
#[test]
fn a_check_whose_opens_or_stats_do_not_return_gives_up_at_the_restores_deadline() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    assert_eq!(image::abandoned_checks(), 0);

    // (1) The first look's opens.
    let fuse = Stalling::tiny_image(t.path(), "opens", Hold::Opens);
    let img = Image::open(fuse.path()).unwrap();
    fuse.hold_own();
    let deadline = Instant::now() + Duration::from_millis(500);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = image::Check::new_until(&img, Some(deadline)).map(|_| ());
        let _ = tx.send(r);
    });
    let err = answer(&rx, deadline, "Check::new_until").unwrap_err();
    given_up(&err, &fuse);
    drop(fuse);

    // (2) The verdict's stats, once the page contents were checked.
    let fuse = Stalling::tiny_image(t.path(), "stats", Hold::Stats);
    let img = Image::open(fuse.path()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let (ran_tx, ran_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let check = image::Check::new_until(&img, Some(deadline)).unwrap();
        check.run();
        ran_tx.send(()).unwrap();
        go_rx.recv().unwrap();
        let _ = tx.send(check.finish());
    });
    answer(&ran_rx, deadline, "the check of the page contents");
    fuse.hold_own();
    go_tx.send(()).unwrap();
    let err = answer(&rx, deadline, "Check::finish").unwrap_err();
    given_up(&err, &fuse);
}

/// `err` is the check's refusal at the deadline, after one of its requests reached `fuse`;
/// its stuck thread is counted until `fuse` answers, and no longer after.
fn given_up(err: &image::ImageError, fuse: &Stalling) {
    assert!(fuse.held() > 0, "no request reached the server: {err}");
    assert!(
        err.to_string()
            .contains("did not end before the restore's deadline"),
        "{err}"
    );
    assert_eq!(image::abandoned_checks(), 1, "the stuck thread is counted");
    fuse.answer_all();
    eventually(PATIENCE, "the stuck check to end", || {
        image::abandoned_checks() == 0
    });
}
