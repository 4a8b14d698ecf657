#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The thaw's prefetch of the page contents on an image whose file system stops answering once
//! the image was opened (the testkit's FUSE server holds its opens: its thread waits in the
//! kernel, uninterruptibly, as on a dead disk or an NFS hard mount). One test: the count of
//! abandoned checks is the process's.

use cryo_criu::image::{self, Image};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::{eventually, PATIENCE};

/// Attack (session 18): the prefetch (`Image::prefetch_page_contents`, started by every thaw
/// and never waited for) opens the page contents on a thread of its own. On a file system that
/// stops answering after the thaw's first look, each thaw left one more such thread stuck in the
/// kernel, counted nowhere: the budget of stuck looks at images (`abandoned_checks`, past which
/// new ones are refused at once) did not see them. It must count it until the file system
/// answers. (Before: "the stuck prefetch is counted: left 0, right 1".)
#[test]
fn a_prefetch_whose_opens_do_not_return_is_counted_until_they_do() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    assert_eq!(image::abandoned_checks(), 0);
    let fuse = Stalling::tiny_image(t.path(), "opens", Hold::Opens);
    let img = Image::open(fuse.path()).unwrap();
    fuse.hold_own();
    img.prefetch_page_contents();
    eventually(PATIENCE, "the prefetch's open to reach the server", || {
        fuse.held() > 0
    });
    assert_eq!(
        image::abandoned_checks(),
        1,
        "the stuck prefetch is counted"
    );
    fuse.answer_all();
    eventually(PATIENCE, "the stuck prefetch to end", || {
        image::abandoned_checks() == 0
    });
}
