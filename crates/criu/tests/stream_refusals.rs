#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Refusals of the thaw's image streamer (`CRYO_THAW_STREAM=1`, set in this test binary's
//! environment: a binary of its own, so no other test restores through the streamer) under the
//! real CRIU: an image damaged after it was opened (a pages file cut or a byte flipped), and an
//! image whose file system stops answering the streamer's reads (the test kit's FUSE server:
//! its thread waits in the kernel, uninterruptibly, as on a dead disk or an NFS hard mount).

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use cryo_criu::image::{Image, ImageError};
use cryo_criu::{Criu, CriuError, CriuRpc, RestoreOpts};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::{eventually, PATIENCE};

/// The restore's deadline in the attacks on a damaged image: far past what a refusal takes.
const DEADLINE: Duration = Duration::from_secs(30);

/// A tree with some memory (perl holding 8 MiB, its child asleep) dumped by the real CRIU into
/// a published image under `dir`; CRIU and the image's
/// directory, its pids, and its (first) pages file.
fn dumped(dir: &Path) -> (CriuRpc, PathBuf, Vec<i32>, PathBuf) {
    cryo_testkit::require_criu_and_root();
    std::env::set_var("CRYO_THAW_STREAM", "1");
    let criu = CriuRpc::locate(None)
        .unwrap()
        .in_scratch(&dir.join("scratch"));
    let image = dir.join("image");
    // Pages a few chunks long (4 MiB each): perl holds an 8 MiB string in its heap, then
    // starts its child (the tree is whole once the memory is there).
    let pids = cryo_testkit::image::dumped_tree(
        &criu,
        &image,
        "exec perl -e '$s = \"x\" x (8 << 20); system(\"sleep\", \"100000\")'",
        2,
    );
    let pages = fs::read_dir(&image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("pages-")
        })
        .max_by_key(|p| fs::metadata(p).unwrap().len())
        .unwrap();
    (criu, image, pids, pages)
}

/// Restores `image` (opened before `damage` ran on its pages file) through the streamer at
/// [`DEADLINE`]: the error, how long it took, and whether any of `pids` was left.
fn refused_after(
    criu: &CriuRpc,
    image: &Path,
    pids: &[i32],
    pages: &Path,
    damage: impl FnOnce(&Path),
) -> (CriuError, Duration) {
    let img = Image::open(image).unwrap();
    let whole = fs::read(pages).unwrap();
    damage(pages);
    let started = Instant::now();
    let r = criu.restore(
        &img,
        &RestoreOpts {
            deadline: Some(DEADLINE),
            ..RestoreOpts::default()
        },
    );
    let took = started.elapsed();
    fs::write(pages, &whole).unwrap();
    let err = match r {
        Ok(r) => panic!("a damaged image was restored through the streamer: {r:?}"),
        Err(e) => e,
    };
    eventually(PATIENCE, "no process of the image to be left", || {
        cryo_proc::pids_in_use(pids).is_empty()
    });
    (err, took)
}

/// Attack (session 23): the streamer watches no refusals beside CRIU (`run_gated` gets none on
/// this route). A pages file cut to half, or a byte of it flipped, after the image was opened
/// (what the thaw checked first) and before CRIU reads it: the streamer must refuse the chunk
/// before CRIU gets it, the restore end with the image's refusal, naming the pages file, long
/// before its deadline, and no process of the image be left (none ran). Session 21 measured the
/// files route's refusal of a cut pages file at 16-53 ms. Pinned, nothing broke (79 ms cut,
/// 266 ms flipped before session 23's changes): the streamer refuses the chunk before CRIU gets
/// it and closes CRIU's pipe short (or answers that the file is not there), and CRIU fails on
/// that at once; the refusal needs no watch beside CRIU.
#[test]
fn a_pages_file_cut_or_flipped_under_the_streamer_is_refused_long_before_the_deadline() {
    let t = tempfile::tempdir().unwrap();
    let (criu, image, pids, pages) = dumped(t.path());
    let name = pages.display().to_string();

    let (err, took) = refused_after(&criu, &image, &pids, &pages, |p| {
        let len = fs::metadata(p).unwrap().len();
        fs::File::options()
            .write(true)
            .open(p)
            .unwrap()
            .set_len((len / 2) & !4095)
            .unwrap();
    });
    eprintln!("cut: refused after {took:?}: {err}");
    assert!(
        matches!(&err, CriuError::Image(ImageError::Truncated { .. })),
        "after {took:?}: {err}"
    );
    assert!(err.to_string().contains(&name), "{err}");
    assert!(took < DEADLINE / 3, "waited {took:?}: {err}");

    let (err, took) = refused_after(&criu, &image, &pids, &pages, |p| {
        let mut bytes = fs::read(p).unwrap();
        let at = bytes.len() * 3 / 4;
        bytes[at] ^= 1;
        fs::write(p, bytes).unwrap();
    });
    eprintln!("flipped: refused after {took:?}: {err}");
    assert!(
        err.to_string().contains("checksum mismatch") && err.to_string().contains(&name),
        "after {took:?}: {err}"
    );
    assert!(took < DEADLINE / 3, "waited {took:?}: {err}");
}

/// Attack (session 23): the image's file system stops answering the streamer's reads of the
/// pages file (CRIU's requests are answered: it waits on its pipe, killable). At its deadline
/// CRIU is killed; the restore must return then (the deadline, naming nothing stuck of CRIU's),
/// with the streamer's stuck read left to its thread, never wait for the file system. (Before:
/// "the restore had not returned 23s after the streamer's read hung (deadline 3s)"; it
/// returned CRIU's timeout only once the file system answered: the streamer's reads ran on
/// threads of the restore's own scope, which it joined before it returned.)
#[test]
fn a_streamer_whose_read_does_not_return_gives_up_at_the_restore_s_deadline() {
    let t = tempfile::tempdir().unwrap();
    let (criu, image, pids, _) = dumped(t.path());
    let fuse = Stalling::mount(&image, &t.path().join("mnt"), Hold::Reads, |n| {
        n.starts_with("pages-")
    });
    let img = Image::open(fuse.path()).unwrap();
    fuse.hold_own();
    let deadline = Duration::from_secs(3);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let r = criu.restore(
            &img,
            &RestoreOpts {
                deadline: Some(deadline),
                ..RestoreOpts::default()
            },
        );
        let _ = tx.send(r.map(|r| r.pid));
    });
    eventually(PATIENCE, "the streamer's read to reach the server", || {
        fuse.held() > 0
    });
    let patience = deadline + cryo_criu::KILLED_GRACE + Duration::from_secs(15);
    let result = rx.recv_timeout(patience).unwrap_or_else(|_| {
        fuse.answer_all();
        let late = rx.recv_timeout(PATIENCE);
        panic!(
            "the restore had not returned {patience:?} after the streamer's read hung (deadline {deadline:?}); once the file system answered: {late:?}"
        )
    });
    let err = result.unwrap_err();
    assert!(matches!(err, CriuError::TimedOut { .. }), "{err}");
    fuse.answer_all();
    eventually(PATIENCE, "no process of the image to be left", || {
        cryo_proc::pids_in_use(&pids).is_empty()
    });
    drop(fuse);
}
