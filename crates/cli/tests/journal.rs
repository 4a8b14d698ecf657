#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo journal rotate` and `cryo timeline --all`: an operator's rotation, and the whole
//! history read back across it (no GPU needed).

use std::process::Command;

use cryo_journal::{Event, Journal, ProcId};

const CRYO: &str = env!("CARGO_BIN_EXE_cryo");

fn cryo(state: &std::path::Path, args: &[&str]) -> String {
    let out = Command::new(CRYO)
        .arg("--state-dir")
        .arg(state)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "cryo {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn seqs(json: &str) -> Vec<u64> {
    json.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["seq"].as_u64().unwrap()
        })
        .collect()
}

#[test]
fn an_operator_rotates_and_the_timeline_reads_the_whole_history_with_all() {
    let state = tempfile::tempdir().unwrap();
    let journal = Journal::open(state.path().join("journal")).unwrap();
    let me = ProcId::of(std::process::id() as i32).unwrap();
    journal
        .append(Event::RestoreCompleted {
            pid: me,
            image: "/img".into(),
            ms: None,
        })
        .unwrap();
    for i in 0..5 {
        journal
            .append(Event::FreezeStarted {
                image: format!("/img/{i}"),
            })
            .unwrap();
    }
    let said = cryo(state.path(), &["journal", "rotate"]);
    assert!(said.contains("journal rotated: records 1..6"), "{said}");
    journal.append(Event::Killed { pid: me }).unwrap();
    // The active segment: the carried restore, the rotation, the kill.
    assert_eq!(
        seqs(&cryo(state.path(), &["timeline", "--json"])),
        [1, 7, 8]
    );
    // Everything, each record once.
    assert_eq!(
        seqs(&cryo(state.path(), &["timeline", "--json", "--all"])),
        (1..=8).collect::<Vec<_>>()
    );
    let text = cryo(state.path(), &["timeline", "--all"]);
    assert!(text.contains("journal rotated"), "{text}");
}
