#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Workers that span GPUs (issues 9 and 14): one process with contexts on several GPUs
//! (checkpoint and restore take all of them or none; restore takes no pairs or a complete list),
//! and a tree with one rank process per GPU under a launcher.

mod common;

use std::time::Duration;

use common::{code, WorkerSpec};
use cryo_gpu::{CuResult, GpuPair, GpuUuid, ProcessState};
use cryo_testkit::{eventually, procs, PATIENCE};

const MIB: u64 = 1 << 20;

fn pair(old: &GpuUuid, new: &GpuUuid) -> GpuPair {
    GpuPair {
        old: old.clone(),
        new: new.clone(),
    }
}

#[test]
fn a_process_on_two_gpus_is_listed_on_both_and_restored_only_with_complete_pairs() {
    let sim = common::sim_with(&["--gpus", "3", "--gpu-memory", "1GiB"]);
    let gpus = sim.gpu.inspect.gpus().unwrap();
    let (g0, g1, g2) = (&gpus[0].uuid, &gpus[1].uuid, &gpus[2].uuid);
    let w = sim.spawn(WorkerSpec::new("32MiB").gpus(&[0, 1]).seed(5));
    let d = &sim.gpu.driver;
    assert_eq!(sim.listing(w.pid), vec![(0, 32 * MIB), (1, 32 * MIB)]);
    assert_eq!(sim.gpu.inspect.driver_fds(w.pid).unwrap().len(), 2);
    let v = w.verify();
    assert_eq!(
        (v["ok"].clone(), v["ranks"].clone()),
        (true.into(), 2.into()),
        "{v}"
    );
    let before = w.complete("two gpus");
    assert_eq!(w.complete("two gpus"), before);

    sim.suspend(w.pid);
    assert!(
        sim.listing(w.pid).is_empty(),
        "checkpoint releases every GPU"
    );
    assert!(sim.gpu.inspect.driver_fds(w.pid).unwrap().is_empty());
    assert!(sim
        .gpu
        .inspect
        .gpus()
        .unwrap()
        .iter()
        .all(|g| g.memory_free == g.memory_total));

    for bad in [
        vec![pair(g0, g2)],                             // GPU 1 left out
        vec![pair(g0, g2), pair(g1, g2)],               // two onto one
        vec![pair(g0, g1)],                             // onto the other's GPU, other left out
        vec![pair(g0, g2), pair(g1, g1), pair(g2, g0)], // a GPU it never used
    ] {
        assert_eq!(
            code(d.restore(w.pid, &bad)),
            CuResult::INVALID_VALUE,
            "{bad:?}"
        );
        assert_eq!(d.state(w.pid).unwrap(), ProcessState::Checkpointed);
        assert!(
            sim.listing(w.pid).is_empty(),
            "a refused restore opens nothing"
        );
    }
    // Complete: GPU 0 moves to GPU 2, GPU 1 stays (an identity pair).
    d.restore(w.pid, &[pair(g1, g1), pair(g0, g2)]).unwrap();
    assert_eq!(sim.listing(w.pid), vec![(1, 32 * MIB), (2, 32 * MIB)]);
    d.unlock(w.pid).unwrap();
    assert_eq!(w.complete("two gpus"), before, "ranks keep their order");
    assert_eq!(w.verify()["ok"], true);

    // Its GPUs are now 2 and 1: a second move must name those.
    sim.suspend(w.pid);
    assert_eq!(
        code(d.restore(w.pid, &[pair(g0, g0), pair(g1, g1)])),
        CuResult::INVALID_VALUE
    );
    d.restore(w.pid, &[pair(g2, g0), pair(g1, g1)]).unwrap();
    d.unlock(w.pid).unwrap();
    assert_eq!(sim.listing(w.pid), vec![(0, 32 * MIB), (1, 32 * MIB)]);
    assert_eq!(w.complete("two gpus"), before);
    sim.suspend(w.pid);
    sim.assert_no_wedge();
}

/// One GPU short of memory: the contexts already reopened are released again (no live restored
/// context is torn down), nothing stays listed, and the process is stuck as after any restore
/// that ran out of memory (NVIDIA/cuda-checkpoint#44).
#[test]
fn a_multi_gpu_restore_short_of_memory_on_one_gpu_restores_nothing() {
    let sim = common::sim_with(&["--gpus", "2", "--gpu-memory", "256MiB"]);
    let w = sim.spawn(WorkerSpec::new("96MiB").gpus(&[0, 1]));
    sim.suspend(w.pid);
    let hog = common::worker(&sim, "200MiB", 1, 2);
    let d = &sim.gpu.driver;
    assert_eq!(code(d.restore(w.pid, &[])), CuResult::OUT_OF_MEMORY);
    assert!(sim.listing(w.pid).is_empty(), "GPU 0's context was undone");
    assert_eq!(d.state(w.pid).unwrap(), ProcessState::Checkpointed);
    assert_eq!(code(d.restore(w.pid, &[])), CuResult::OPERATING_SYSTEM);
    drop(hog);
    sim.assert_no_wedge();
}

#[test]
fn a_tree_has_one_rank_process_per_gpu_under_a_launcher_that_called_cuinit() {
    let sim = common::sim();
    let w = sim.spawn(
        WorkerSpec::new("16MiB")
            .gpus(&[0, 1])
            .process_per_gpu()
            .init_only(),
    );
    let ranks = w.children().to_vec();
    assert_eq!(ranks.len(), 2);
    for r in &ranks {
        assert_eq!(cryo_proc::stat(*r).unwrap().ppid, w.pid, "rank {r}");
    }
    assert!(
        sim.listing(w.pid).is_empty(),
        "the launcher holds no context"
    );
    assert_eq!(sim.listing(ranks[0]), vec![(0, 16 * MIB)]);
    assert_eq!(sim.listing(ranks[1]), vec![(1, 16 * MIB)]);
    assert_eq!(sim.gpu.inspect.driver_fds(w.pid).unwrap().len(), 1);
    let d = &sim.gpu.driver;
    let all = [w.pid, ranks[0], ranks[1]];
    for p in all {
        assert_eq!(d.state(p).unwrap(), ProcessState::Running, "pid {p}");
    }
    let before = w.complete("tensor parallel");
    let v = w.verify();
    assert_eq!(
        (v["ok"].clone(), v["ranks"].clone()),
        (true.into(), 2.into()),
        "{v}"
    );

    // A sticky error in one rank: that rank cannot be locked, the other can.
    let (s, body) = w.http("POST", "/fault?rank=1", "");
    assert_eq!(s, 200, "{body}");
    assert_eq!(
        code(d.lock(ranks[1], Some(Duration::from_secs(5)))),
        CuResult::ILLEGAL_ADDRESS
    );
    d.lock(ranks[0], Some(Duration::from_secs(5))).unwrap();
    d.unlock(ranks[0]).unwrap();
    drop(w);
    // The launcher is gone: its ranks follow it.
    for r in ranks {
        eventually(PATIENCE, "a rank to follow its launcher", || {
            !procs::alive(r)
        });
    }
    sim.assert_no_wedge();
    assert!(!before.is_empty());
}

#[test]
fn a_tree_is_suspended_and_restored_rank_by_rank_with_the_same_answers() {
    let sim = common::sim();
    let w = sim.spawn(WorkerSpec::new("8MiB").gpus(&[1, 0]).process_per_gpu());
    let ranks = w.children().to_vec();
    let d = &sim.gpu.driver;
    assert_eq!(
        code(d.state(w.pid)),
        CuResult::NOT_INITIALIZED,
        "a plain launcher is no CUDA process"
    );
    assert!(sim.gpu.inspect.driver_fds(w.pid).unwrap().is_empty());
    assert_eq!(sim.listing(ranks[0]), vec![(1, 8 * MIB)], "rank 0 on GPU 1");
    let before = w.complete("ranks");
    for r in &ranks {
        sim.suspend(*r);
    }
    for r in &ranks {
        d.restore(*r, &[]).unwrap();
        d.unlock(*r).unwrap();
    }
    assert_eq!(w.complete("ranks"), before);
    assert_eq!(w.verify()["ok"], true);
    // Restored and live: suspended before the tree ends.
    for r in &ranks {
        sim.suspend(*r);
    }
    drop(w);
    for r in ranks {
        eventually(PATIENCE, "a rank to follow its launcher", || {
            !procs::alive(r)
        });
    }
    sim.assert_no_wedge();
}

#[test]
fn worker_shapes_that_make_no_sense_are_refused() {
    let sim = common::sim();
    for args in [
        &["--gpus", "0", "--init-only"][..],
        &["--process-per-gpu"][..],
        &["--gpu", "1", "--init-only"][..],
    ] {
        let out = std::process::Command::new(common::BIN)
            .arg("worker")
            .arg("--dir")
            .arg(sim.path())
            .args(args)
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?} was accepted");
    }
}
