use super::*;

const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

fn u(s: &str) -> GpuUuid {
    s.parse().unwrap()
}

fn gpus(free_a: u64, free_b: u64) -> Vec<GpuInfo> {
    [(A, free_a), (B, free_b)]
        .iter()
        .enumerate()
        .map(|(i, (x, free))| GpuInfo {
            index: i as u32,
            uuid: u(x),
            name: "M".into(),
            memory_total: 1000,
            memory_free: *free,
        })
        .collect()
}

fn rec(bytes: u64, gpu: &str) -> ParkedRecord {
    ParkedRecord {
        pid: ProcId::new(10, 1),
        device_bytes: bytes,
        gpus: vec![u(gpu)],
        gpu_bytes: vec![bytes],
    }
}

/// A process on GPUs A and B holding `on_a` and `on_b` (`per_gpu: false`: a record written
/// before the per-GPU amounts were kept).
fn rec2(on_a: u64, on_b: u64, per_gpu: bool) -> ParkedRecord {
    ParkedRecord {
        pid: ProcId::new(10, 1),
        device_bytes: on_a + on_b,
        gpus: vec![u(A), u(B)],
        gpu_bytes: if per_gpu {
            vec![on_a, on_b]
        } else {
            Vec::new()
        },
    }
}

/// A process on two GPUs needs its own amount free on each: 600 on A and 100 on B do not fit
/// where A has 400 free, although the average (350) would.
#[test]
fn a_two_gpu_process_needs_room_on_each_gpu_for_what_it_held_there() {
    let r = rec2(600, 100, true);
    let e = place(&[(10, &r)], &gpus(400, 1000), &[], None, false).unwrap_err();
    match &e {
        PlaceError::NoRoom { pid: 10, tried, .. } => {
            assert!(tried.contains(A) && tried.contains("needs"), "{e}")
        }
        other => panic!("{other}"),
    }
    // Room on both: back where it was, no pairs.
    let p = place(&[(10, &r)], &gpus(600, 100), &[], None, false).unwrap();
    assert_eq!(p[0].targets, vec![u(A), u(B)]);
    assert!(p[0].pairs.is_empty());
    // One GPU short, B: refused too, naming B.
    let e = place(&[(10, &r)], &gpus(1000, 99), &[], None, true).unwrap_err();
    assert!(
        matches!(&e, PlaceError::NoRoom { tried, .. } if tried.contains(B)),
        "{e}"
    );
    // A record without the per-GPU amounts splits evenly (what older records mean).
    let old = rec2(600, 100, false);
    assert!(place(&[(10, &old)], &gpus(350, 350), &[], None, false).is_ok());
    assert!(place(&[(10, &old)], &gpus(349, 1000), &[], None, false).is_err());
}

/// Two processes of a tree, one per GPU, and a two-GPU process: what one takes on a GPU is not
/// free for the next.
#[test]
fn per_gpu_room_is_shared_between_the_processes_of_a_wake() {
    let both = rec2(300, 300, true);
    let on_b = ParkedRecord {
        gpus: vec![u(B)],
        gpu_bytes: vec![500],
        device_bytes: 500,
        ..rec(500, B)
    };
    let e = place(
        &[(10, &both), (11, &on_b)],
        &gpus(1000, 700),
        &[],
        None,
        false,
    )
    .unwrap_err();
    assert!(matches!(e, PlaceError::NoRoom { pid: 11, .. }), "{e}");
    assert!(place(
        &[(10, &both), (11, &on_b)],
        &gpus(1000, 800),
        &[],
        None,
        false
    )
    .is_ok());
}

fn fenced(gpu: FencedGpu) -> Quarantine {
    Quarantine {
        gpu,
        reason: "r".into(),
        pids: vec![7],
        since_unix: 0,
    }
}

#[test]
fn back_where_it_was_without_pairs() {
    let r = rec(100, A);
    let p = place(&[(10, &r)], &gpus(1000, 1000), &[], None, false).unwrap();
    assert_eq!(p[0].targets, vec![u(A)]);
    assert!(p[0].pairs.is_empty());
}

#[test]
fn full_gpu_refuses_unless_another_is_allowed() {
    let r = rec(100, A);
    let e = place(&[(10, &r)], &gpus(50, 1000), &[], None, false).unwrap_err();
    assert!(matches!(e, PlaceError::NoRoom { needed: 100, .. }), "{e}");
    let p = place(&[(10, &r)], &gpus(50, 1000), &[], None, true).unwrap();
    assert_eq!(p[0].targets, vec![u(B)]);
    assert_eq!(
        p[0].pairs,
        vec![GpuPair {
            old: u(A),
            new: u(B)
        }]
    );
    // Another GPU, but not one the policy allows.
    let e = place(&[(10, &r)], &gpus(50, 1000), &[], Some(&[u(A)]), true).unwrap_err();
    assert!(matches!(e, PlaceError::NoRoom { .. }), "{e}");
}

#[test]
fn two_processes_share_the_free_memory() {
    let r1 = rec(600, A);
    let r2 = rec(600, A);
    let e = place(&[(10, &r1), (11, &r2)], &gpus(1000, 0), &[], None, false).unwrap_err();
    assert!(matches!(e, PlaceError::NoRoom { pid: 11, .. }), "{e}");
    let p = place(&[(10, &r1), (11, &r2)], &gpus(1000, 1000), &[], None, true).unwrap();
    assert_eq!(p[1].targets, vec![u(B)]);
}

#[test]
fn fence_refuses() {
    let r = rec(100, A);
    let e = place(
        &[(10, &r)],
        &gpus(1000, 1000),
        &[fenced(FencedGpu::Unknown)],
        None,
        true,
    )
    .unwrap_err();
    assert!(matches!(e, PlaceError::NodeFenced { .. }));
    let q = fenced(FencedGpu::Gpu(u(A)));
    assert!(place(
        &[(10, &r)],
        &gpus(1000, 1000),
        std::slice::from_ref(&q),
        None,
        false
    )
    .is_err());
    let p = place(&[(10, &r)], &gpus(1000, 1000), &[q], None, true).unwrap();
    assert_eq!(p[0].targets, vec![u(B)]);
}

#[test]
fn the_park_record_ends_with_a_restore_or_an_exit() {
    let id = ProcId::new(10, 1);
    let r = |seq, event| Record {
        seq,
        time: std::time::SystemTime::now(),
        event,
    };
    let parked = r(
        1,
        Event::Parked {
            pid: id,
            bytes: 5,
            gpus: vec![A.into()],
            gpu_bytes: Vec::new(),
        },
    );
    assert_eq!(
        parked_records(std::slice::from_ref(&parked))[&id].device_bytes,
        5
    );
    for end in [
        Event::RestoreCompleted {
            pid: id,
            image: "wake".into(),
            ms: None,
        },
        Event::Killed { pid: id },
        Event::ProcessExited {
            pid: id,
            how: "x".into(),
        },
    ] {
        assert!(parked_records(&[parked.clone(), r(2, end)]).is_empty());
    }
}

mod with_fake_driver {
    //! park and wake against the fake driver and real (non-CUDA) processes, without root.
    use std::time::Duration;

    use cryo_gpu::{CuResult, ProcessState};
    use cryo_journal::{Event, Journal, ProcId};
    use cryo_proc::ProcHandle;
    use cryo_state::StateDir;
    use cryo_testkit::fake::{Call, FakeGpu};
    use cryo_testkit::procs::Procs;

    use crate::park::*;
    use crate::target::{Resolved, Target};
    use crate::watcher::Lease;
    use crate::watcher::{Coverage, Watcher, WatcherError};
    use crate::NoProgress;

    struct Scene {
        procs: Procs,
        fake: FakeGpu,
        _dir: tempfile::TempDir,
        state: StateDir,
        journal: Journal,
    }

    fn scene(n: usize) -> Scene {
        let procs = Procs::spawn(n);
        let fake = FakeGpu::new();
        for p in procs.pids() {
            fake.add(p);
        }
        let dir = tempfile::tempdir().unwrap();
        let state = StateDir::new(dir.path());
        let journal = state.open_journal().unwrap();
        Scene {
            procs,
            fake,
            _dir: dir,
            state,
            journal,
        }
    }

    impl Scene {
        fn target(&self) -> Resolved {
            Target::Pids(self.procs.pids()).resolve().unwrap()
        }
        /// `park` of every process with [`park_opts`].
        fn park(&self) -> Result<ParkReport, ParkError> {
            park(
                &self.fake.gpu(),
                &self.target(),
                &park_opts(),
                &self.journal,
                &self.state,
                &crate::NoWatcher,
                &NoProgress,
            )
        }
        /// `wake` of every process with the default options, traced by `watcher`.
        fn wake(&self, watcher: &dyn Watcher) -> Result<WakeReport, WakeError> {
            wake(
                &self.fake.gpu(),
                &self.target(),
                &WakeOptions::default(),
                &self.journal,
                &self.state,
                watcher,
                &NoProgress,
            )
        }
        fn events(&self) -> Vec<Event> {
            self.state
                .read_journal()
                .unwrap()
                .records
                .into_iter()
                .map(|r| r.event)
                .collect()
        }
    }

    fn park_opts() -> ParkOptions {
        let mut o = ParkOptions::default();
        o.suspend.lock_timeout = Duration::from_millis(200);
        o.suspend.lock_attempts = 1;
        o.suspend.verify_timeout = Duration::from_millis(300);
        o
    }

    /// A guard that cannot trace anything.
    struct Broken;
    #[derive(Debug, thiserror::Error)]
    #[error("the tracer is gone")]
    struct Gone;
    impl Watcher for Broken {
        fn let_go(&self, _: ProcId) -> Result<Option<Lease<'_>>, WatcherError> {
            Ok(None)
        }
        fn guard_before_unlock(&self, _: &[&ProcHandle]) -> Result<Coverage, WatcherError> {
            Err(WatcherError::new(Gone))
        }
    }

    /// A guard that records when it was asked, and the driver state of each process then.
    struct Recording<'a>(&'a FakeGpu, std::sync::Mutex<Vec<ProcessState>>);
    impl Watcher for Recording<'_> {
        fn let_go(&self, _: ProcId) -> Result<Option<Lease<'_>>, WatcherError> {
            Ok(None)
        }
        fn guard_before_unlock(&self, procs: &[&ProcHandle]) -> Result<Coverage, WatcherError> {
            let mut seen = self.1.lock().unwrap();
            for p in procs {
                seen.push(self.0.state_of(p.pid()));
            }
            Ok(Coverage::Guarded)
        }
    }

    #[test]
    fn park_then_wake_is_guarded_while_locked() {
        let s = scene(2);
        let report = s.park().unwrap();
        assert_eq!(report.parked.len(), 2);
        for p in s.procs.pids() {
            assert_eq!(s.fake.state_of(p), ProcessState::Checkpointed);
        }
        let w = Recording(&s.fake, Default::default());
        let r = s.wake(&w).unwrap();
        assert!(r.guarded);
        // Asked while every process was LOCKED: restored, not yet running.
        assert_eq!(*w.1.lock().unwrap(), vec![ProcessState::Locked; 2]);
        for p in s.procs.pids() {
            assert_eq!(s.fake.state_of(p), ProcessState::Running);
        }
        assert!(s
            .events()
            .iter()
            .any(|e| matches!(e, Event::WakeCompleted { pids, .. } if pids.len() == 2)));
    }

    /// Attack: the guard cannot trace the restored processes. They must not be unlocked: they go
    /// back to CHECKPOINTED (parked again), and a later wake still knows what they need.
    #[test]
    fn a_guard_that_cannot_trace_parks_them_again_instead_of_unlocking() {
        let s = scene(2);
        s.park().unwrap();
        let e = s.wake(&Broken).unwrap_err();
        assert!(
            matches!(&e, WakeError::AfterRestore { step: "guard before unlock", cleanup, .. } if cleanup.contains("parked again")),
            "{e}"
        );
        for p in s.procs.pids() {
            assert_eq!(s.fake.state_of(p), ProcessState::Checkpointed);
            assert_eq!(s.fake.count(p, Call::Unlock), 0, "pid {p} was unlocked");
        }
        assert!(s.fake.wedges().is_empty());
        let records = s.state.read_journal().unwrap().records;
        assert_eq!(parked_records(&records).len(), 2);
    }

    /// All or nothing: one process that cannot be suspended (sticky error) leaves the worker
    /// serving: the other one is brought back, nothing stays parked.
    #[test]
    fn a_park_that_fails_for_one_process_brings_the_others_back() {
        let s = scene(2);
        let pids = s.procs.pids();
        s.fake.make_sticky(pids[1]);
        let e = s.park().unwrap_err();
        assert!(
            matches!(e, ParkError::Suspend { pid, .. } if pid == pids[1]),
            "{e}"
        );
        for p in &pids {
            assert_eq!(s.fake.state_of(*p), ProcessState::Running, "pid {p}");
        }
        let records = s.state.read_journal().unwrap().records;
        assert!(parked_records(&records).is_empty());
        assert!(s
            .events()
            .iter()
            .any(|e| matches!(e, Event::ParkFailed { .. })));
    }

    /// A restore that fails (the driver refuses) parks the others again, and never unlocks.
    #[test]
    fn a_failed_restore_leaves_everything_parked() {
        let s = scene(2);
        let pids = s.procs.pids();
        s.park().unwrap();
        s.fake
            .fail_next_on(pids[0], Call::Restore, CuResult::OUT_OF_MEMORY);
        let e = s.wake(&crate::NoWatcher).unwrap_err();
        assert!(
            matches!(
                e,
                WakeError::AfterRestore {
                    step: "GPU restore",
                    ..
                }
            ),
            "{e}"
        );
        for p in &pids {
            assert_eq!(s.fake.count(*p, Call::Unlock), 0);
        }
        assert_eq!(s.fake.state_of(pids[1]), ProcessState::Checkpointed);
        assert!(s.fake.wedges().is_empty());
    }

    /// A park of a process whose lock a wake holds, and a wake of one whose lock a park holds,
    /// are refused at once naming the holder and what it does: nothing journaled, nothing asked
    /// of the driver. Once the holder lets go, each goes through.
    #[test]
    fn a_park_and_a_wake_of_one_process_refuse_each_other() {
        let s = scene(1);
        let pid = s.procs.pids()[0];
        let me = Some(std::process::id() as Pid);
        let held = crate::oplock::take(&s.state, s.target().handles(), crate::Op::Wake).unwrap();
        let n = s.events().len();
        let e = s.park().unwrap_err();
        assert!(
            matches!(e, ParkError::InProgress { pid: p, by, doing: Some(crate::Op::Wake) } if p == pid && by == me),
            "{e}"
        );
        assert!(e.to_string().contains("is being woken by cryo pid"), "{e}");
        assert_eq!(s.fake.count(pid, Call::Lock), 0);
        assert_eq!(s.events().len(), n, "journaled");
        drop(held);
        s.park().unwrap();

        let held = crate::oplock::take(&s.state, s.target().handles(), crate::Op::Park).unwrap();
        let n = s.events().len();
        let e = s.wake(&crate::NoWatcher).unwrap_err();
        assert!(
            matches!(e, WakeError::InProgress { pid: p, by, doing: Some(crate::Op::Park) } if p == pid && by == me),
            "{e}"
        );
        assert!(e.to_string().contains("is being parked by cryo pid"), "{e}");
        assert_eq!(s.fake.count(pid, Call::Restore), 0);
        assert_eq!(s.events().len(), n, "journaled");
        drop(held);
        s.wake(&crate::NoWatcher).unwrap();
        assert_eq!(s.fake.state_of(pid), ProcessState::Running);
    }

    /// The host memory limit counts the workers parked already.
    #[test]
    fn max_parked_host_memory_refuses_before_acting() {
        let s = scene(1);
        let mut o = park_opts();
        o.max_parked_host = Some(1);
        let e = park(
            &s.fake.gpu(),
            &s.target(),
            &o,
            &s.journal,
            &s.state,
            &crate::NoWatcher,
            &NoProgress,
        )
        .unwrap_err();
        assert!(matches!(e, ParkError::HostMemory { limit: 1, .. }), "{e}");
        assert_eq!(s.fake.state_of(s.procs.pids()[0]), ProcessState::Running);
        assert_eq!(s.fake.count(s.procs.pids()[0], Call::Lock), 0);
    }
}
