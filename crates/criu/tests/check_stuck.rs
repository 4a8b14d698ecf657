#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The thaw's check with a read that does not return (the `image-check-read-stalls` failpoint,
//! set in this test binary's environment: a binary of its own, so no other test sees it): the
//! check is given up on at its deadline without waiting for the read, counted while its thread
//! is stuck, and no longer counted once the read returns; past the most stuck checks, a new one
//! refuses at once. One test (the failpoint and the count are the process's).

use std::fs;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cryo_criu::image::{self, ImageError};

fn published(parent: &Path) -> PathBuf {
    let dir = parent.join("img");
    cryo_testkit::image::publish(
        &dir,
        &[("pages-1.img", &[7u8; 300_000]), ("core-4242.img", b"core")],
    );
    dir
}

#[test]
fn a_check_whose_read_does_not_return_is_given_up_at_its_deadline_and_counted_until_it_ends() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path());
    let resume = t.path().join("resume");
    std::env::set_var("CRYO_FAILPOINT", image::CHECK_READ_STALLS);
    std::env::set_var("CRYO_FAILPOINT_RESUME", &resume);
    assert_eq!(image::abandoned_checks(), 0);

    let img = image::Image::open(&dir).unwrap();
    let deadline = Instant::now() + Duration::from_millis(300);
    let check = image::Check::new(&img).unwrap().until(Some(deadline));
    // Returns at the deadline, without the stuck read's outcome.
    check.run();
    let err = check.finish().unwrap_err();
    assert!(matches!(err, ImageError::Stream { .. }), "{err}");
    assert!(
        err.to_string()
            .contains("did not end before the restore's deadline"),
        "{err}"
    );
    assert!(Instant::now() >= deadline);
    assert_eq!(image::abandoned_checks(), 1, "the stuck thread is counted");
    assert!(check.hashed_at().is_none());
    drop(check);
    drop(img);

    // The read returns: the thread ends and is no longer counted.
    fs::write(&resume, b"").unwrap();
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the stuck check to end", || {
        image::abandoned_checks() == 0
    });
    // A check without the stall passes as before.
    std::env::remove_var("CRYO_FAILPOINT");
    let img = image::Image::open(&dir).unwrap();
    let check = image::Check::new(&img)
        .unwrap()
        .until(Some(Instant::now() + Duration::from_secs(60)));
    check.run();
    check.finish().unwrap();
    drop(check);

    // Past MAX_ABANDONED_CHECKS checks stuck in reads, a new check refuses at once instead of
    // adding one more thread that would hang the same way.
    std::env::set_var("CRYO_FAILPOINT", image::CHECK_READ_STALLS);
    std::env::set_var("CRYO_FAILPOINT_RESUME", t.path().join("never"));
    for i in 0..image::MAX_ABANDONED_CHECKS {
        let check = image::Check::new(&img)
            .unwrap()
            .until(Some(Instant::now() + Duration::from_millis(20)));
        check.run();
        check.finish().unwrap_err();
        assert_eq!(image::abandoned_checks(), i + 1);
    }
    let err = image::Check::new(&img).unwrap_err();
    assert!(err.to_string().contains("still stuck"), "{err}");
}
