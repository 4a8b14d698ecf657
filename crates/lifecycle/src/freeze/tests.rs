#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `freeze` against the fake driver and the fake CRIU, without root: a refusal dumps nothing,
//! a failed dump resumes every process in place, CRIU only ever sees suspended processes.

use std::path::PathBuf;

use cryo_criu::CriuError;
use cryo_gpu::ProcessState;
use cryo_journal::Journal;
use cryo_proc::Pid;
use cryo_testkit::fake::{Call, FakeGpu};
use cryo_testkit::fake_criu::FakeCriu;
use cryo_testkit::procs::{self, Procs};

use super::*;
use crate::watcher::NoWatcher;
use crate::NoProgress;

struct Scene {
    tree: Procs,
    pids: Vec<Pid>,
    fake: FakeGpu,
    criu: FakeCriu,
    dir: tempfile::TempDir,
    journal: Journal,
}

/// A session-leading tree of a root and one child, both CUDA processes of the fake driver.
fn scene() -> Scene {
    scene_of(Procs::session_tree(1), &[0, 1])
}

/// The scene of `tree`: the processes whose indexes in [`Procs::tree`] `cuda` names (0 = the
/// root) are CUDA processes of the fake driver.
fn scene_of(tree: Procs, cuda: &[usize]) -> Scene {
    let pids = tree.tree();
    let fake = FakeGpu::new();
    for i in cuda {
        fake.add(pids[*i]);
    }
    let criu = FakeCriu::watching(&fake);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("journal")).unwrap();
    Scene {
        tree,
        pids,
        fake,
        criu,
        dir,
        journal,
    }
}

impl Scene {
    fn image(&self) -> PathBuf {
        self.dir.path().join("img")
    }

    fn freeze(&self, leave_running: bool) -> Result<FreezeReport, FreezeError> {
        let tree = crate::Target::Tree(self.tree.pid(0)).resolve().unwrap();
        self.freeze_listed(&tree, leave_running)
    }

    /// The freeze of the tree, whose root forks one more child while its lock hangs (after the
    /// listing, before the suspension's walk); `prepare` sets the fork up in the fake driver
    /// before the lock goes on. The freeze's result and the fork's pid.
    fn freeze_forking_at_lock(
        &self,
        prepare: impl FnOnce(Pid),
    ) -> (Result<FreezeReport, FreezeError>, Pid) {
        let root = self.pids[0];
        let hang = self.fake.hang_next(root, Call::Lock);
        std::thread::scope(|t| {
            let frozen = t.spawn(|| self.freeze(false));
            hang.wait_reached();
            let late = fork_a_child(root);
            prepare(late);
            hang.release();
            (frozen.join().unwrap(), late)
        })
    }

    /// The freeze of `tree`, listed by the test beforehand.
    fn freeze_listed(
        &self,
        tree: &Resolved,
        leave_running: bool,
    ) -> Result<FreezeReport, FreezeError> {
        let opts = FreezeOptions {
            image: self.image(),
            leave_running,
            replace: false,
            suspend: SuspendOptions {
                verify_timeout: std::time::Duration::from_millis(300),
                ..SuspendOptions::default()
            },
            shrink: None,
        };
        freeze(
            &self.fake.gpu(),
            &self.criu,
            tree,
            &opts,
            &self.journal,
            &NoWatcher,
            &NoProgress,
        )
    }

    fn steps(&self, pid: Pid) -> Vec<&'static str> {
        cryo_journal::read(self.journal.dir())
            .unwrap()
            .records
            .iter()
            .filter(|r| r.event.pids().iter().any(|p| p.pid == pid))
            .map(|r| r.event.label())
            .collect()
    }

    /// Whether the journal knows `pid` as restored.
    fn restored(&self, pid: Pid) -> bool {
        let records = cryo_journal::read(self.journal.dir()).unwrap().records;
        let id = cryo_journal::ProcId::of(pid).unwrap();
        matches!(
            cryo_journal::Origins::from_records(&records).of(&id),
            cryo_journal::Origin::Restored { .. }
        )
    }

    /// The manifest names what CRIU dumped (its first dump), no more, no less.
    fn assert_manifest_names_the_dump(&self, report: &FreezeReport) {
        let dumps = self.criu.dumps();
        assert_eq!(
            sorted(dumps[0].states.iter().map(|(p, _)| *p).collect()),
            sorted(report.manifest.pids()),
            "the manifest does not name what CRIU dumped"
        );
    }

    /// Nothing at the image path, and no staging directory left beside it.
    fn assert_no_image(&self) {
        assert!(!self.image().exists(), "an image was published");
        let left: Vec<_> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("img.tmp-"))
            .collect();
        assert!(left.is_empty(), "staging left behind: {left:?}");
    }
}

/// A session-leading shell that reaps its `children` `sleep`s as they end and forks one more on
/// SIGUSR1 ([`Procs::reaping_tree`]); the root is a CUDA process of the fake driver, and so are
/// the children whose indexes (1 = the first child) `cuda` names.
fn reaping_scene(children: usize, cuda: &[usize]) -> Scene {
    let cuda: Vec<usize> = std::iter::once(0).chain(cuda.iter().copied()).collect();
    scene_of(Procs::reaping_tree(children), &cuda)
}

/// Has the root of a [`Procs::reaping_tree`] fork one more `sleep` (SIGUSR1 to its trap) and
/// returns the new child's pid once it runs `sleep`.
fn fork_a_child(root: Pid) -> Pid {
    let before = cryo_proc::tree(root).unwrap();
    procs::kill(root, nix::sys::signal::Signal::SIGUSR1 as i32);
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the root to fork", || {
        cryo_proc::tree(root)
            .unwrap()
            .into_iter()
            .find(|p| !before.contains(p) && cryo_proc::stat(*p).is_ok_and(|s| s.comm == "sleep"))
    })
}

/// SIGKILLs `pid`, a child of a [`Procs::reaping_tree`]'s root, and waits until its parent has
/// reaped it (its pid free: every look at it now fails).
fn end_and_wait_reaped(pid: Pid) {
    let h = ProcHandle::open(pid).unwrap();
    procs::kill(pid, nix::sys::signal::Signal::SIGKILL as i32);
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the child to be reaped", || {
        h.liveness() == cryo_proc::Liveness::Gone
    });
}

fn sorted(mut pids: Vec<Pid>) -> Vec<Pid> {
    pids.sort_unstable();
    pids
}

/// Attack (session 11): a child of the tree ends (and is reaped) between the tree's listing
/// and the freeze's looks at it, as a fork loop's child does. It is simply not part of the
/// tree: the freeze publishes an image of the rest, which does not name it. (Before: "pid N
/// does not exist", the freeze refused.)
#[test]
fn a_child_that_ends_between_the_listing_and_the_looks_is_left_out() {
    let s = reaping_scene(2, &[]);
    let tree = crate::Target::Tree(s.pids[0]).resolve().unwrap();
    assert_eq!(tree.handles().len(), 3);
    end_and_wait_reaped(s.pids[1]);
    let report = s.freeze_listed(&tree, false).unwrap();
    assert_eq!(
        sorted(report.manifest.pids()),
        sorted(vec![s.pids[0], s.pids[2]])
    );
    assert_eq!(report.ended, vec![s.pids[1]]);
    s.assert_manifest_names_the_dump(&report);
    assert!(s.fake.wedges().is_empty());
}

/// Attack (session 11): a child ends after every look of the freeze and before CRIU freezes
/// the tree. CRIU's image does not hold it, so neither may the manifest (a thaw pairs every
/// process the manifest names with one CRIU restored: such an image could never be thawed).
#[test]
fn a_child_that_ends_before_criu_freezes_the_tree_is_not_in_the_manifest() {
    let s = reaping_scene(2, &[]);
    let gone = s.pids[1];
    s.criu.before_next_dump(move || end_and_wait_reaped(gone));
    let report = s.freeze(false).unwrap();
    assert_eq!(
        sorted(report.manifest.pids()),
        sorted(vec![s.pids[0], s.pids[2]])
    );
    assert_eq!(report.ended, vec![gone]);
    s.assert_manifest_names_the_dump(&report);
}

/// Attack (session 12): a listed child ends before CRIU freezes the tree and its parent (a
/// `sleep`) never reaps it: CRIU dumps it as a zombie and restores it as one under its pid.
/// It is no process of the image, but the manifest names its pid among the tree's zombies, so
/// that the freeze's wait and a thaw's pid check cover it. (Before: the manifest left it out
/// altogether, and a thaw found its pid free when CRIU needed it.)
#[test]
fn a_child_that_is_a_zombie_when_criu_freezes_the_tree_is_a_zombie_of_the_image() {
    let tree = Procs::session_tree(1);
    let pids = tree.tree();
    let (root, child) = (pids[0], pids[1]);
    let fake = FakeGpu::new();
    fake.add(root);
    let criu = FakeCriu::watching(&fake);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("journal")).unwrap();
    let s = Scene {
        tree,
        pids,
        fake,
        criu,
        dir,
        journal,
    };
    s.criu.before_next_dump(move || {
        procs::kill(child, nix::sys::signal::Signal::SIGKILL as i32);
        cryo_testkit::eventually(cryo_testkit::PATIENCE, "the child to be a zombie", || {
            procs::state(child) == Some('Z')
        });
    });
    let report = s.freeze(false).unwrap();
    assert_eq!(report.manifest.pids(), vec![root]);
    assert_eq!(report.manifest.zombies, vec![child]);
    assert_eq!(report.manifest.restore_pids(), vec![root, child]);
    assert_eq!(report.ended, vec![child]);
    assert!(s.fake.wedges().is_empty());
}

/// Attack (session 11): a child forked after the tree was listed and before CRIU froze it is
/// in CRIU's image: the manifest names it too (a plain process), and the freeze waits for its
/// end as for the others'.
#[test]
fn a_child_forked_before_criu_freezes_the_tree_is_in_the_manifest() {
    let s = reaping_scene(1, &[]);
    let (tx, rx) = std::sync::mpsc::channel();
    let root = s.pids[0];
    let tree = crate::Target::Tree(root).resolve().unwrap();
    // The hook runs in the freeze's thread: the tree forks through its root's trap.
    s.criu
        .before_next_dump(move || tx.send(fork_a_child(root)).unwrap());
    let report = s.freeze_listed(&tree, false).unwrap();
    let forked = rx.recv().unwrap();
    assert_eq!(
        sorted(report.manifest.pids()),
        sorted(vec![s.pids[0], s.pids[1], forked])
    );
    assert_eq!(report.forked, vec![forked]);
    assert!(!procs::alive(forked), "the forked child outlived the dump");
    s.assert_manifest_names_the_dump(&report);
}

/// The tree as the walk missed a child of it (the children files the freeze lists through are
/// unreliable while the tree forks or exits): the root alone.
fn missed_child(s: &Scene) -> Resolved {
    Resolved::from_handles(
        crate::Target::Tree(s.pids[0]),
        vec![ProcHandle::open(s.pids[0]).unwrap()],
    )
}

/// Attack (session 12): the freeze lists its tree by walking the children files, which may miss
/// a process that forks or exits meanwhile. A plain child the listing missed is seen at CRIU's
/// gate, with the tree frozen, and is in the manifest as CRIU dumped it.
#[test]
fn a_plain_child_the_listing_missed_is_in_the_image() {
    let s = reaping_scene(1, &[]);
    let report = s.freeze_listed(&missed_child(&s), false).unwrap();
    assert_eq!(sorted(report.manifest.pids()), sorted(s.pids.clone()));
    assert_eq!(report.forked, vec![s.pids[1]]);
    assert!(
        !procs::alive(s.pids[1]),
        "the missed child outlived the dump"
    );
}

/// Attack (session 12): a CUDA child the listing missed was never suspended: CRIU must not dump
/// (and kill) it live. Since session 14 the walk after the suspension finds it: suspended as
/// the listed ones, dumped CHECKPOINTED, in the manifest with its device memory (session 12's
/// refusal at the gate stays for a fork after that walk:
/// `a_forked_process_with_cuda_state_refuses_the_dump`).
#[test]
fn a_cuda_child_the_listing_missed_is_suspended_and_in_the_image() {
    let s = reaping_scene(1, &[1]);
    let report = s.freeze_listed(&missed_child(&s), false).unwrap();
    assert_eq!(sorted(report.manifest.pids()), sorted(s.pids.clone()));
    let child = report
        .manifest
        .processes
        .iter()
        .find(|e| e.pid == s.pids[1]);
    assert!(child.is_some_and(|e| e.gpu.is_some()), "{report:?}");
    assert_eq!(
        s.criu.dumps()[0].states,
        vec![
            (s.pids[0], Some(ProcessState::Checkpointed)),
            (s.pids[1], Some(ProcessState::Checkpointed))
        ]
    );
    assert!(s.fake.wedges().is_empty());
}

/// The walk lists what the scan of /proc lists for a tree that does not change: the root
/// first, then every descendant, grandchildren included.
#[test]
fn the_walk_lists_the_tree_the_scan_lists() {
    // A root shell, a subshell with its own `sleep` (a grandchild), and a `sleep`.
    let mut child = std::process::Command::new("setsid")
        .args(["sh", "-c", "(sleep 1000; true) & sleep 1000 & wait"])
        .spawn()
        .unwrap();
    let root_pid = Pid::try_from(child.id()).unwrap();
    cryo_testkit::eventually(
        cryo_testkit::PATIENCE,
        "the tree to have 4 processes",
        || cryo_proc::tree(root_pid).is_ok_and(|t| t.len() == 4),
    );
    let root = ProcHandle::open(root_pid).unwrap();
    let walked: Vec<Pid> = Resolved::tree_walked(root.try_clone().unwrap())
        .handles()
        .iter()
        .map(ProcHandle::pid)
        .collect();
    let scanned: Vec<Pid> = Resolved::tree(root)
        .unwrap()
        .handles()
        .iter()
        .map(ProcHandle::pid)
        .collect();
    procs::kill(-root_pid, nix::sys::signal::Signal::SIGKILL as i32);
    child.wait().unwrap();
    assert_eq!(walked[0], root_pid);
    assert_eq!(walked.len(), 4, "{walked:?}");
    assert_eq!(sorted(walked), sorted(scanned));
}

/// Attack (session 11): a CUDA process ends after its suspension, before CRIU froze the tree.
/// The image would lack a CUDA process of the worker: never left out unseen. CRIU resumes the
/// tree at cryo's gate, the rest is resumed in place, and the death is journaled as the safe
/// kind (its context was checkpointed).
#[test]
fn a_cuda_process_that_ends_before_criu_freezes_the_tree_refuses_the_dump() {
    let s = reaping_scene(2, &[1]);
    let gone = s.pids[1];
    s.criu.before_next_dump(move || end_and_wait_reaped(gone));
    let err = s.freeze(false).unwrap_err();
    assert!(
        matches!(&err, FreezeError::Criu(CriuError::DumpGate(m)) if m.contains(&format!("pid {gone}"))),
        "{err}"
    );
    assert!(!s.criu.dumps()[0].ok);
    assert!(procs::alive(s.pids[0]) && procs::alive(s.pids[2]));
    assert_eq!(s.fake.state_of(s.pids[0]), ProcessState::Running);
    assert!(
        s.steps(gone).contains(&"exited"),
        "the end is not journaled: {:?}",
        s.steps(gone)
    );
    s.assert_no_image();
    assert!(s.fake.wedges().is_empty());
}

/// Attack (session 11): a process forked before CRIU froze the tree holds CUDA state the freeze
/// never suspended: CRIU must not dump (and kill) it. Refused at the gate, the tree resumed.
#[test]
fn a_forked_process_with_cuda_state_refuses_the_dump() {
    let s = reaping_scene(1, &[]);
    let root = s.pids[0];
    let fake = s.fake.clone();
    s.criu.before_next_dump(move || {
        fake.add(fork_a_child(root));
    });
    let err = s.freeze(false).unwrap_err();
    assert!(
        matches!(&err, FreezeError::Criu(CriuError::DumpGate(m)) if m.contains("CUDA state")),
        "{err}"
    );
    assert!(procs::alive(root) && procs::alive(s.pids[1]));
    assert_eq!(s.fake.state_of(root), ProcessState::Running);
    s.assert_no_image();
}

/// Seam (session 14): a CUDA tree forks during its freeze (here while the root's lock is
/// held): the new CUDA process is found by the walk after the suspension, suspended too, and
/// dumped CHECKPOINTED, named in the manifest with its device memory. Before: listed once, it
/// reached CRIU with a live context (the real CRIU fails on it, "External socket is used";
/// here the gate refuses it): a tree forking every second was refused 8 times in 8.
#[test]
fn a_cuda_child_forked_during_the_suspension_is_suspended_and_dumped() {
    let s = reaping_scene(1, &[]);
    let (report, late) = s.freeze_forking_at_lock(|late| {
        s.fake.add(late);
    });
    let report = report.unwrap();
    let entry = report
        .manifest
        .processes
        .iter()
        .find(|e| e.pid == late)
        .unwrap_or_else(|| panic!("pid {late} not in the manifest: {report:?}"));
    assert!(entry.gpu.is_some(), "{entry:?}");
    assert!(report.suspended.iter().any(|x| x.pid == late));
    let dumps = s.criu.dumps();
    assert!(
        dumps[0]
            .states
            .iter()
            .all(|(_, st)| !matches!(st, Some(ProcessState::Running | ProcessState::Locked))),
        "CRIU saw a live context: {:?}",
        dumps[0].states
    );
    s.assert_manifest_names_the_dump(&report);
    assert!(s.fake.wedges().is_empty());
}

/// The same fork, a CUDA process that cannot be suspended (a sticky error): the freeze is
/// refused before CRIU runs, every process resumed and serving, no image. Before: CRIU ran on
/// the tree with the fork's live context (refused only at its gate).
#[test]
fn a_fork_that_cannot_be_suspended_refuses_the_freeze_and_resumes_every_process() {
    let s = reaping_scene(1, &[]);
    let root = s.pids[0];
    let (result, late) = s.freeze_forking_at_lock(|late| {
        s.fake.add(late).make_sticky(late);
    });
    let err = result.unwrap_err();
    assert!(
        matches!(&err, FreezeError::Refused(r) if r.iter().any(|x| x.pid == late)),
        "{err}"
    );
    assert!(s.criu.dumps().is_empty(), "CRIU ran");
    assert!(procs::alive(root) && procs::alive(late));
    assert_eq!(s.fake.state_of(root), ProcessState::Running);
    assert_eq!(s.fake.state_of(late), ProcessState::Running);
    assert!(s.restored(root), "the root went through a driver restore");
    s.assert_no_image();
    assert!(s.fake.wedges().is_empty());
}

/// The same fork, still opening the driver (driver files, no context) at every look: the tree
/// does not settle within the looks' bound, so the freeze is refused before CRIU runs, the
/// root resumed and serving, no image.
#[test]
fn a_fork_still_opening_the_driver_at_every_look_refuses_the_freeze() {
    let s = reaping_scene(1, &[]);
    let root = s.pids[0];
    let (result, late) = s.freeze_forking_at_lock(|late| {
        s.fake.driver_files(late, &[5]);
    });
    let err = result.unwrap_err();
    assert!(
        matches!(&err, FreezeError::KeepsForking { pids, .. } if pids == &vec![late]),
        "{err}"
    );
    assert!(s.criu.dumps().is_empty(), "CRIU ran");
    assert!(procs::alive(root) && procs::alive(late));
    assert_eq!(s.fake.state_of(root), ProcessState::Running);
    s.assert_no_image();
}

/// A CUDA process NVML listed ends before the freeze suspends it: refused, nothing suspended.
#[test]
fn a_cuda_process_that_ends_before_its_suspension_refuses_the_freeze() {
    let s = reaping_scene(2, &[1]);
    let gone = s.pids[1];
    s.fake.keep_listed(gone);
    let tree = crate::Target::Tree(s.pids[0]).resolve().unwrap();
    end_and_wait_reaped(gone);
    let err = s.freeze_listed(&tree, false).unwrap_err();
    assert!(
        matches!(&err, FreezeError::CudaProcessEnded { pid } if *pid == gone),
        "{err}"
    );
    assert!(s.criu.dumps().is_empty());
    assert_eq!(s.fake.state_of(s.pids[0]), ProcessState::Running);
    s.assert_no_image();
}

/// A process that cannot be suspended refuses the freeze: CRIU never runs, and the tree keeps
/// serving (what was locked is unlocked, what was checkpointed is resumed).
#[test]
fn a_refused_freeze_dumps_nothing_and_leaves_the_tree_serving() {
    let s = scene();
    s.fake.make_sticky(s.pids[1]);
    let err = s.freeze(false).unwrap_err();
    match &err {
        FreezeError::Refused(r) => {
            assert_eq!(r.len(), 1, "{r:?}");
            assert_eq!(r[0].pid, s.pids[1]);
        }
        other => panic!("expected a refusal, got {other}"),
    }
    assert!(s.criu.dumps().is_empty(), "CRIU ran for a refused freeze");
    for p in &s.pids {
        assert!(procs::alive(*p));
        assert_eq!(s.fake.state_of(*p), ProcessState::Running, "pid {p}");
    }
    s.assert_no_image();
}

/// CRIU fails after the suspension: every process is restored and unlocked in place, CRIU's
/// log is kept beside the image path, nothing is published.
#[test]
fn a_failed_dump_resumes_every_process_in_place() {
    let s = scene();
    s.criu.fail_next_dump("cannot dump the tree");
    let err = s.freeze(false).unwrap_err();
    assert!(
        matches!(&err, FreezeError::Criu(CriuError::Failed { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("cannot dump the tree"), "{err}");
    let dumps = s.criu.dumps();
    assert_eq!(dumps.len(), 1);
    for p in &s.pids {
        assert!(procs::alive(*p));
        assert_eq!(s.fake.state_of(*p), ProcessState::Running, "pid {p}");
        // Its context went through a driver restore: journaled as restored before it (and so
        // guarded and suspended before it ends), never as merely "resumed".
        let steps = s.steps(*p);
        let at = |what: &str| steps.iter().position(|x| *x == what);
        assert!(
            at("restore started").is_some() && at("restore started") < at("restore completed"),
            "{steps:?}"
        );
        assert!(
            s.restored(*p),
            "pid {p} is not known as restored: {steps:?}"
        );
    }
    s.assert_no_image();
    let kept = s.dir.path().join("img.dump.log");
    assert!(
        std::fs::read_to_string(&kept)
            .unwrap()
            .contains("cannot dump the tree"),
        "CRIU's log is not kept at {}",
        kept.display()
    );
}

/// CRIU only ever sees suspended CUDA processes; after the dump the tree is gone and the image
/// names every process.
#[test]
fn criu_dumps_only_suspended_processes_and_the_image_is_published() {
    let s = scene();
    let report = s.freeze(false).unwrap();
    let dumps = s.criu.dumps();
    assert_eq!(dumps.len(), 1);
    for (pid, state) in &dumps[0].states {
        assert_eq!(
            *state,
            Some(ProcessState::Checkpointed),
            "CRIU dumped pid {pid} in state {state:?}"
        );
    }
    assert_eq!(dumps[0].states.len(), s.pids.len());
    for p in &s.pids {
        assert!(!procs::alive(*p), "pid {p} outlived its dump");
    }
    let mut pids = report.manifest.pids();
    pids.sort_unstable();
    let mut want = s.pids.clone();
    want.sort_unstable();
    assert_eq!(pids, want);
    assert!(s.image().join("manifest.json").exists());
    assert!(s.fake.wedges().is_empty());
}

/// Issue 16: the freeze asks the driver each process's state once (its classification's answer
/// is the suspension's), and journals every step of the suspension, in order, each intent
/// before its action although outcomes go to disk with the next intent.
#[test]
fn a_freeze_asks_each_state_once_and_journals_every_step_in_order() {
    use cryo_journal::Event;
    use cryo_testkit::fake::Call;
    let s = scene();
    s.freeze(false).unwrap();
    let records = cryo_journal::read(s.journal.dir()).unwrap().records;
    for p in &s.pids {
        assert_eq!(s.fake.count(*p, Call::State), 1, "pid {p}");
        let kinds: Vec<u8> = records
            .iter()
            .filter(|r| r.event.pids().iter().any(|x| x.pid == *p))
            .filter_map(|r| match r.event {
                Event::SuspendStarted { .. } => Some(0),
                Event::LockStarted { .. } => Some(1),
                Event::Locked { .. } => Some(2),
                Event::CheckpointStarted { .. } => Some(3),
                Event::Checkpointed { .. } => Some(4),
                Event::Verified { .. } => Some(5),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, vec![0, 1, 2, 3, 4, 5], "pid {p}: {:?}", s.steps(*p));
    }
}

/// `leave_running`: the tree is restored and unlocked in place, and journaled as restored
/// before its contexts come back (from then on they get a restored process's protection).
#[test]
fn leave_running_resumes_in_place_as_restored() {
    let s = scene();
    s.freeze(true).unwrap();
    for p in &s.pids {
        assert!(procs::alive(*p));
        assert_eq!(s.fake.state_of(*p), ProcessState::Running);
        let steps = s.steps(*p);
        assert!(steps.contains(&"restore completed"), "{steps:?}");
    }
    assert!(s.criu.dumps()[0].leave_running);
    assert!(s.image().join("manifest.json").exists());
}

/// The dumped worker's parent does not reap it (a supervisor, a shim, an init that reaps late):
/// its pid stays taken, so the freeze does not call it gone; it names the parent holding it.
#[test]
fn a_dumped_worker_whose_parent_has_not_reaped_it_is_not_gone() {
    use std::io::BufRead;
    use std::process::{Command, Stdio};
    // A parent that never reaps: perl with SIGCHLD at its default, asleep.
    let mut parent = Command::new("perl")
        .args([
            "-MPOSIX",
            "-e",
            "$| = 1; my $p = fork(); if ($p == 0) { POSIX::setsid(); exec('sleep', '3600'); } print \"$p\\n\"; sleep 3600;",
        ])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut line = String::new();
    std::io::BufReader::new(parent.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    let worker: Pid = line.trim().parse().unwrap();
    cryo_testkit::eventually(
        cryo_testkit::PATIENCE,
        "the worker to lead its session",
        || cryo_proc::stat(worker).is_ok_and(|s| s.session == worker && s.comm == "sleep"),
    );
    let fake = FakeGpu::new();
    fake.add(worker);
    let criu = FakeCriu::watching(&fake);
    let dir = tempfile::tempdir().unwrap();
    let journal = Journal::open(dir.path().join("journal")).unwrap();
    let opts = FreezeOptions {
        image: dir.path().join("img"),
        leave_running: false,
        replace: false,
        suspend: SuspendOptions {
            verify_timeout: std::time::Duration::from_millis(300),
            ..SuspendOptions::default()
        },
        shrink: None,
    };
    let report = freeze(
        &fake.gpu(),
        &criu,
        &crate::Target::Tree(worker).resolve().unwrap(),
        &opts,
        &journal,
        &NoWatcher,
        &NoProgress,
    )
    .unwrap();
    let perl = parent.id() as Pid;
    assert!(
        matches!(report.pids_held[..], [cryo_proc::PidHolder::Zombie { pid, parent, .. }] if pid == worker && parent == perl),
        "{:?}",
        report.pids_held
    );
    parent.kill().unwrap();
    parent.wait().unwrap();
}

/// Attack (session 12): a listed plain process leaves the tree before CRIU freezes it: its
/// parent (a shell of the worker) ends, and it is reparented out of the tree (as a daemonized
/// child is). CRIU does not dump it, so the manifest must not name it, and the freeze must not
/// wait for its end (CRIU does not kill it): it is left out, said in the report, and runs on,
/// no longer the worker's. The image is what CRIU dumped: the root, and the shell as a zombie.
/// (Before: the dump was refused at CRIU's gate, "left the tree", and a worker that daemonizes
/// helpers all the time could never be frozen.)
#[test]
fn a_plain_process_reparented_out_of_the_tree_before_criu_freezes_it_is_left_out() {
    let s = scene_of(
        Procs::session_script("sh -c 'sleep 600 & wait' & exec sleep 600", 3),
        &[0],
    );
    let (root, shell, daemon) = (s.pids[0], s.pids[1], s.pids[2]);
    cryo_testkit::eventually(cryo_testkit::PATIENCE, "the root to run sleep", || {
        cryo_proc::stat(root).is_ok_and(|s| s.comm == "sleep")
    });
    assert_eq!(cryo_proc::stat(daemon).unwrap().ppid, shell);
    s.criu.before_next_dump(move || {
        procs::kill(shell, nix::sys::signal::Signal::SIGKILL as i32);
        cryo_testkit::eventually(
            cryo_testkit::PATIENCE,
            "the daemon to leave the tree",
            || {
                cryo_proc::stat(daemon).is_ok_and(|s| s.ppid != shell)
                    && procs::state(shell) == Some('Z')
            },
        );
    });
    let report = s.freeze(false);
    let alive = procs::alive(daemon);
    procs::kill(daemon, nix::sys::signal::Signal::SIGKILL as i32);
    let report = report.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(report.manifest.pids(), vec![root]);
    assert_eq!(report.manifest.zombies, vec![shell]);
    assert_eq!(report.left, vec![daemon]);
    assert!(alive, "the daemon, no longer the worker's, was killed");
    // The image names what CRIU dumped: its processes and its zombie, not the daemon.
    let dumps = s.criu.dumps();
    assert_eq!(
        sorted(dumps[0].states.iter().map(|(p, _)| *p).collect()),
        sorted(report.manifest.restore_pids())
    );
    assert!(s.fake.wedges().is_empty());
}

/// A listed CUDA process (suspended for the freeze) leaves the tree before CRIU freezes it:
/// CRIU did not dump it, and a CUDA process is never left out unseen. The dump is refused at
/// CRIU's gate and every CUDA process, the departed one included, is resumed in place.
#[test]
fn a_cuda_process_reparented_out_of_the_tree_before_criu_freezes_it_refuses_the_dump() {
    let s = scene_of(
        Procs::session_script("sh -c 'sleep 600 & wait' & exec sleep 600", 3),
        &[0, 2],
    );
    let (root, shell, daemon) = (s.pids[0], s.pids[1], s.pids[2]);
    s.criu.before_next_dump(move || {
        procs::kill(shell, nix::sys::signal::Signal::SIGKILL as i32);
        cryo_testkit::eventually(
            cryo_testkit::PATIENCE,
            "the daemon to leave the tree",
            || cryo_proc::stat(daemon).is_ok_and(|s| s.ppid != shell),
        );
    });
    let err = s.freeze(false);
    let alive = procs::alive(daemon);
    let state = s.fake.state_of(daemon);
    // Before the test ends the daemon (resumed in place: a live restored context).
    let wedges = s.fake.wedges();
    procs::kill(daemon, nix::sys::signal::Signal::SIGKILL as i32);
    let err = err.unwrap_err();
    assert!(
        err.to_string()
            .contains(&format!("pid {daemon} left the tree before CRIU froze it")),
        "{err}"
    );
    assert!(alive, "{err}");
    assert_eq!(state, ProcessState::Running, "{err}");
    assert_eq!(s.fake.state_of(root), ProcessState::Running, "{err}");
    s.assert_no_image();
    assert!(wedges.is_empty(), "{wedges:?}");
}
