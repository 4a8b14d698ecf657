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
    // Every read by another process (CRIU) is held; cryo's own are answered.
    let fuse = Stalling::tiny_image(t.path(), "image", Hold::Reads);
    let mnt = fuse.path().to_path_buf();
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
    // One grace, CRIU's: CRIU is not also taken for one of what it restored (it was, found by
    // its command line, and waited for a second time: 12.3 s).
    let bound = deadline + cryo_criu::KILLED_GRACE + Duration::from_secs(2);
    assert!(took < bound, "{took:?}: {err}");
    // Still stuck (its read is still held): counted, and not reaped.
    assert_eq!(cryo_criu::stuck_crius(), 1, "{err}");
    assert!(Path::new(&format!("/proc/{criu_tid}")).exists());

    // The server answers at last: CRIU's read ends, its pending kill ends it, and the deadline
    // layer's thread reaps it (no zombie left).
    fuse.answer_all();
    eventually(PATIENCE, "the stuck CRIU to be reaped", || {
        cryo_criu::stuck_crius() == 0 && !Path::new(&format!("/proc/{criu_tid}")).exists()
    });
    drop(fuse);
}

/// Restores `image` (its files mirrored by FUSE, the reads of the files `hold` names held) with
/// a 2 s deadline on a thread of its own; returns once the server holds `reads` reads (the
/// restored tasks reading their memory, in state `D` from then on): the restore's result
/// arrives on the receiver.
fn restore_held(
    criu: CriuRpc,
    image: &Path,
    mnt: &Path,
    hold: Vec<String>,
) -> (Stalling, std::sync::mpsc::Receiver<Result<i32, CriuError>>) {
    let reads = hold.len();
    let fuse = Stalling::mount(image, mnt, Hold::Reads, move |name| {
        hold.iter().any(|h| h == name)
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let image_dir = mnt.to_path_buf();
    std::thread::spawn(move || {
        let image = Image::open(&image_dir).unwrap();
        let r = criu.restore(
            &image,
            &RestoreOpts {
                deadline: Some(Duration::from_secs(2)),
                ..RestoreOpts::default()
            },
        );
        let _ = tx.send(r.map(|r| r.pid));
    });
    eventually(
        PATIENCE,
        "the restored tasks' reads to reach the server",
        || fuse.held() >= reads,
    );
    (fuse, rx)
}

/// Attack (session 17's seam): processes CRIU restored that are stuck where no signal reaches
/// them when the restore is given up on (their memory's image on a file system that does not
/// answer). They are killed with the CRIU, and the restore waited `KILLED_GRACE` for each of
/// them, one after the other, then again for each that was its caller's child; and such a
/// child, exiting once its wait ended, stayed a zombie of the caller for good. Now the restore
/// waits one `KILLED_GRACE` for them all, hands the stuck ones that are its children to the
/// deadline layer (counted with the stuck CRIUs, [`cryo_criu::stuck_crius`]), which reaps each
/// once its wait ends, and names them in its error.
///
/// Two trees: the restored root stuck (the caller's child: CRIU restores it as the caller's
/// sibling); a root whose two children are stuck (reparented when the root is killed: not the
/// caller's to reap).
#[test]
fn restored_processes_stuck_in_the_kernel_cost_one_grace_and_are_reaped_when_they_end() {
    cryo_testkit::require_criu_and_root();
    let criu = CriuRpc::locate(None).unwrap();
    for (script, procs) in [
        ("exec sleep 100000", 1),
        ("sleep 100000 & sleep 100000 & wait", 3),
    ] {
        let t = tempfile::tempdir().unwrap();
        let image = t.path().join("image");
        let pids = cryo_testkit::image::dumped_tree(&criu, &image, script, procs);
        // Each task reads its own memory's map as CRIU restores it; the root's first, its
        // children's once it has forked them.
        let stuck: Vec<i32> = if procs == 1 {
            pids.clone()
        } else {
            pids[1..].to_vec()
        };
        let hold = stuck.iter().map(|p| format!("pagemap-{p}.img")).collect();
        let scratch = t.path().join("scratch");
        let started = Instant::now();
        let (fuse, rx) = restore_held(
            criu.clone().in_scratch(&scratch),
            &image,
            &t.path().join("mnt"),
            hold,
        );
        let patience = Duration::from_secs(2) + cryo_criu::KILLED_GRACE * 6;
        let result = rx.recv_timeout(patience).unwrap_or_else(|_| {
            panic!("{script}: the restore had not returned after {patience:?}")
        });
        let took = started.elapsed();
        let err = result.unwrap_err();
        let CriuError::TimedOut {
            left,
            killed,
            stuck: criu_stuck,
            ..
        } = &err
        else {
            panic!("{script}: expected the deadline, got {err}");
        };
        assert!(
            criu_stuck.is_none(),
            "{script}: CRIU itself is not stuck: {err}"
        );
        // One grace for them all (a second past it for the rest of the restore's end).
        let bound = Duration::from_secs(2) + cryo_criu::KILLED_GRACE + Duration::from_secs(2);
        assert!(
            took < bound,
            "{script}: the restore took {took:?} (bound {bound:?}): {err}"
        );
        for p in &stuck {
            assert!(
                killed.iter().any(|(k, _)| k == p),
                "{script}: {p} not killed: {err}"
            );
            assert!(
                left.iter()
                    .any(|l| l.starts_with(&format!("pid {p}:")) && l.contains("state D")),
                "{script}: {p} not named stuck: {err}"
            );
        }
        let ours = usize::from(procs == 1);
        assert_eq!(cryo_criu::stuck_crius(), ours, "{script}");

        // The server answers: each stuck task's read ends, its pending kill ends it, and the
        // caller's child among them is reaped (no zombie).
        fuse.answer_all();
        eventually(PATIENCE, "the stuck tasks to be gone", || {
            cryo_criu::stuck_crius() == 0 && cryo_proc::pids_in_use(&stuck).is_empty()
        });
        drop(fuse);
    }
}

/// The budget of CRIUs waited for in the background ([`cryo_criu::MAX_STUCK_CRIUS`]) filled by
/// CRIUs that resumed their trees (their `post-resume` stage: the trees run) and do not exit
/// (held there by the gate's test hook, as a CRIU whose cleanup waits on a hung file system;
/// the last of them also stopped with SIGSTOP), each restore with `deadline`. The next restore
/// is refused at once, and its refusal says what holds the budget (never "killed at their
/// deadlines": none of these was killed, and each of their trees runs), naming each CRIU.
struct HeldBudget {
    t: tempfile::TempDir,
    criu: CriuRpc,
    deadline: Duration,
    /// One image more than the budget: the restore refused, then run once the budget frees.
    images: Vec<std::path::PathBuf>,
    /// The restored roots, running.
    roots: Vec<i32>,
    /// The held CRIUs, oldest first; the last one stopped.
    held: Vec<i32>,
}

impl HeldBudget {
    fn fill(deadline: Duration) -> HeldBudget {
        cryo_testkit::require_criu_and_root();
        let t = tempfile::tempdir().unwrap();
        std::env::set_var(
            cryo_criu::CRIU_POST_RESUME_HELD,
            t.path().join("let-criu-exit"),
        );
        let criu = CriuRpc::locate(None)
            .unwrap()
            .in_scratch(&t.path().join("scratch"));
        assert_eq!(cryo_criu::stuck_crius(), 0);
        let mut budget = HeldBudget {
            t,
            criu,
            deadline,
            images: Vec::new(),
            roots: Vec::new(),
            held: Vec::new(),
        };
        for i in 0..=cryo_criu::MAX_STUCK_CRIUS {
            let image = budget.t.path().join(format!("image-{i}"));
            cryo_testkit::image::dumped_tree(&budget.criu, &image, "exec sleep 100000", 1);
            budget.images.push(image);
        }
        for i in 0..cryo_criu::MAX_STUCK_CRIUS {
            let root = budget.restore(i).unwrap().pid;
            budget.roots.push(root);
            assert_eq!(cryo_criu::stuck_crius(), i + 1);
        }
        // Each held CRIU: a child of this process running CRIU's binary (the gate's script
        // waits in it).
        budget.held = held_crius(budget.criu.path());
        assert_eq!(
            budget.held.len(),
            cryo_criu::MAX_STUCK_CRIUS,
            "{:?}",
            budget.held
        );
        let stopped = *budget.held.last().unwrap();
        cryo_testkit::procs::kill(stopped, libc::SIGSTOP);
        eventually(PATIENCE, "the held CRIU to be stopped", || {
            cryo_proc::stat(stopped).is_ok_and(|s| s.state == 'T')
        });

        let started = Instant::now();
        let err = budget.restore(cryo_criu::MAX_STUCK_CRIUS).unwrap_err();
        assert!(
            matches!(err, CriuError::TooManyStuck { .. }),
            "expected the budget's refusal: {err}"
        );
        assert!(started.elapsed() < Duration::from_secs(5), "{err}");
        let msg = err.to_string();
        eprintln!("the refusal: {msg}");
        assert!(!msg.contains("killed at their deadlines"), "{msg}");
        assert!(msg.contains("post-resume"), "{msg}");
        for pid in &budget.held {
            assert!(
                msg.contains(&format!("pid {pid}")),
                "names CRIU {pid}: {msg}"
            );
        }
        budget
    }

    fn restore(&self, i: usize) -> Result<cryo_criu::Restored, CriuError> {
        self.criu.restore(
            &Image::open(&self.images[i]).unwrap(),
            &RestoreOpts {
                deadline: Some(self.deadline),
                ..RestoreOpts::default()
            },
        )
    }

    /// Once the budget is free again: the refused restore runs, and every tree is ended.
    /// Lets every CRIU's `post-resume` stage end from now on (the killed CRIUs' gate scripts,
    /// orphaned in it, and the last restore's own), restores the refused image, and ends what
    /// the test started: nothing of it is left running.
    fn restore_the_refused_one_and_end(mut self) {
        eventually(PATIENCE, "the held CRIUs to be gone and reaped", || {
            cryo_criu::stuck_crius() == 0 && held_crius(self.criu.path()).is_empty()
        });
        fs::write(self.t.path().join("let-criu-exit"), b"").unwrap();
        let root = self.restore(cryo_criu::MAX_STUCK_CRIUS).unwrap().pid;
        self.roots.push(root);
        for root in &self.roots {
            cryo_testkit::procs::kill(*root, libc::SIGKILL);
            cryo_testkit::procs::reap(*root);
        }
        eventually(
            PATIENCE,
            "the gate scripts of the test's CRIUs to end",
            || gate_scripts(self.t.path()).is_empty(),
        );
    }
}

/// Attack (session 23): the budget filled by CRIUs held past `post-resume` ([`HeldBudget`]).
/// Once those CRIUs exit (let go; the stopped one continued), the budget is free and a restore
/// runs.
#[test]
fn a_restore_past_the_budget_of_crius_not_exited_after_resuming_is_refused_naming_them() {
    let budget = HeldBudget::fill(Duration::from_secs(120));
    fs::write(budget.t.path().join("let-criu-exit"), b"").unwrap();
    cryo_testkit::procs::kill(*budget.held.last().unwrap(), libc::SIGCONT);
    budget.restore_the_refused_one_and_end();
}

/// Attack (session 23, criu23b): the same budget, its CRIUs never let go (one stopped, the
/// others held where their post-resume stage waits). CRIU 4.2 ends nothing of the tree past
/// `post-resume` (every task resumed and detached), so the background wait kills such a CRIU at
/// the restore's original deadline; the budget must free then, with no one letting anything
/// go, while each restored tree runs on untouched (the same process, never signalled: not
/// ended, not stopped). Before: the places stayed held for good, and every later restore of
/// this process was refused.
#[test]
fn crius_held_past_post_resume_are_killed_at_their_deadlines_and_the_trees_run_on() {
    let deadline = Duration::from_secs(20);
    let budget = HeldBudget::fill(deadline);
    let starts: Vec<u64> = budget
        .roots
        .iter()
        .map(|r| cryo_proc::stat(*r).unwrap().start_time)
        .collect();
    let bin = budget.criu.path().to_path_buf();
    cryo_testkit::eventually_said(
        deadline + PATIENCE,
        || {
            format!(
                "the budget still held {} places {:?} after the deadline (held CRIUs {:?})",
                cryo_criu::stuck_crius(),
                PATIENCE,
                held_crius(&bin)
            )
        },
        || cryo_criu::stuck_crius() == 0 && held_crius(&bin).is_empty(),
    );
    for (root, start) in budget.roots.iter().zip(&starts) {
        let stat = cryo_proc::stat(*root).unwrap();
        assert_eq!(stat.start_time, *start, "root {root} is another process");
        assert_eq!(
            stat.state, 'S',
            "root {root} not running on (state {})",
            stat.state
        );
    }
    budget.restore_the_refused_one_and_end();
}

/// The processes running a gate script of a CRIU whose scratch is under `dir` (a killed
/// CRIU's script, orphaned, runs on until its stage lets it end).
fn gate_scripts(dir: &Path) -> Vec<i32> {
    let dir = dir.to_string_lossy().into_owned();
    fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            fs::read(format!("/proc/{p}/cmdline")).is_ok_and(|c| {
                let c = String::from_utf8_lossy(&c);
                c.contains(&dir) && c.contains("gate.sh")
            })
        })
        .collect()
}

/// This process's children that run the CRIU binary `bin`, oldest first.
fn held_crius(bin: &Path) -> Vec<i32> {
    let bin = fs::canonicalize(bin).unwrap();
    let me = std::process::id() as i32;
    let mut pids: Vec<i32> = fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<i32>().ok())
        .filter(|p| {
            cryo_proc::stat(*p).is_ok_and(|s| s.ppid == me)
                && fs::read_link(format!("/proc/{p}/exe")).is_ok_and(|e| e == bin)
        })
        .collect();
    pids.sort_by_key(|p| cryo_proc::stat(*p).map_or(0, |s| s.start_time));
    pids
}
