#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo demo` runs green end to end.

mod common;

use common::*;

#[test]
fn demo_runs_green() {
    let out = cryo().args(["demo", "--memory", "16MiB"]).output().unwrap();
    let (o, e) = (stdout(&out), stderr(&out));
    assert!(out.status.success(), "demo failed:\n{o}\n{e}");
    for step in [
        "lock",
        "checkpoint",
        "NVML view",
        "restore",
        "unlock",
        "ask again",
        "cryo stop",
        "restored: yes (journal)",
        "timeline",
        "checkpointed",
        "killed",
        "wedge ledger",
    ] {
        assert!(o.contains(step), "step {step:?} missing:\n{o}");
    }
    assert!(o.contains("is gone from the GPU"), "{o}");
    assert!(o.contains("same answer"), "{o}");
    assert!(
        o.contains("empty: no live restored context was torn down"),
        "{o}"
    );
    assert!(!o.contains("FAILED"), "{o}");
}
