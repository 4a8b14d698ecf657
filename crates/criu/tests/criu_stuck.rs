#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A restore whose CRIU is stuck where no signal reaches it: the real CRIU reads an image whose
//! files live on a FUSE file system whose server takes the read and never answers (the
//! testkit's `fuse::Stalling`): CRIU waits in the kernel (state `D`), and its SIGKILL at the
//! deadline does not end it. A binary of its own: the count of stuck CRIUs is the process's.

use std::fs;
use std::path::Path;
use std::time::{Duration, Instant};

use cryo_criu::image::Image;
use cryo_criu::{Criu, CriuError, CriuRpc, RestoreOpts};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::{eventually, PATIENCE};

/// Attack (session 17): CRIU stuck in an uninterruptible read past the restore's deadline.
/// cryo kills it at the deadline; the restore must return soon after all the same, naming the
/// stuck CRIU (pid, state `D`, where the kernel holds it), count it while it is stuck, and reap
/// it once its read ends. (Before: the restore waited for the killed CRIU without bound:
/// `wait_until` killed it and called `Child::wait`, so the thaw never returned; this test
/// failed with "the restore had not returned 25 s past its 2 s deadline", CRIU in state D in
/// `request_wait_answer`.)
#[test]
fn a_criu_stuck_in_an_uninterruptible_read_is_given_up_on_at_its_deadline_and_reaped_later() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let backing = t.path().join("backing");
    cryo_testkit::image::publish_tiny(&backing);
    let mnt = t.path().join("image");
    fs::create_dir(&mnt).unwrap();
    // Every read by another process (CRIU) is held; cryo's own are answered.
    let fuse = Stalling::mount(&backing, &mnt, Hold::Reads, |_| true);
    let criu = CriuRpc::locate(None)
        .unwrap()
        .in_scratch(&t.path().join("scratch"));
    assert_eq!(cryo_criu::stuck_crius(), 0);

    let deadline = Duration::from_secs(2);
    let (tx, rx) = std::sync::mpsc::channel();
    let started = Instant::now();
    let image_dir = mnt.clone();
    std::thread::spawn(move || {
        let image = Image::open(&image_dir).unwrap();
        let r = criu.restore(
            &image,
            &RestoreOpts {
                deadline: Some(deadline),
                ..RestoreOpts::default()
            },
        );
        let _ = tx.send(r.map(|r| r.pid));
    });
    eventually(PATIENCE, "CRIU's read to reach the server", || {
        fuse.held() > 0
    });
    let criu_tid = fuse.senders()[0];
    let patience = deadline + cryo_criu::KILLED_GRACE + Duration::from_secs(18);
    let Ok(result) = rx.recv_timeout(patience) else {
        let stat = fs::read_to_string(format!("/proc/{criu_tid}/stat")).unwrap_or_default();
        let state = stat.rsplit(") ").next().and_then(|r| r.split(' ').next());
        let wchan = fs::read_to_string(format!("/proc/{criu_tid}/wchan")).unwrap_or_default();
        panic!(
            "the restore had not returned {} s past its {} s deadline: CRIU {criu_tid} in state {state:?}, in {wchan}",
            patience.as_secs() - deadline.as_secs(),
            deadline.as_secs()
        );
    };
    let took = started.elapsed();
    let err = result.unwrap_err();
    let CriuError::TimedOut { stuck, .. } = &err else {
        panic!("expected the deadline, got {err}");
    };
    let stuck = stuck
        .as_ref()
        .unwrap_or_else(|| panic!("no stuck CRIU named: {err}"));
    // The server's sender is CRIU's one thread: its tid is its pid.
    assert_eq!(stuck.pid as u32, criu_tid, "{err}");
    assert_eq!(stuck.state, 'D', "{err}");
    assert!(!stuck.wchan.is_empty(), "{err}");
    let msg = err.to_string();
    assert!(
        msg.contains(&format!("CRIU (pid {criu_tid}) did not exit")),
        "{msg}"
    );
    assert!(took < patience, "{took:?}");
    // Still stuck (its read is still held): counted, and not reaped.
    assert_eq!(cryo_criu::stuck_crius(), 1);
    assert!(Path::new(&format!("/proc/{criu_tid}")).exists());

    // The server answers at last: CRIU's read ends, its pending kill ends it, and the deadline
    // layer's thread reaps it (no zombie left).
    fuse.answer_all();
    eventually(PATIENCE, "the stuck CRIU to be reaped", || {
        cryo_criu::stuck_crius() == 0 && !Path::new(&format!("/proc/{criu_tid}")).exists()
    });
    drop(fuse);
}
