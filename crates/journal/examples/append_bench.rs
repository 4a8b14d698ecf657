#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Append cost: `Journal::append` against a baseline of a bare `write` + `fdatasync` of the same
//! number of bytes on the same filesystem, measured in the same run.
//! `cargo run --release -p cryo-journal --example append_bench [DIR]`

use std::io::Write;
use std::time::Instant;

use cryo_journal::{Event, Journal, ProcId};

fn main() {
    let base = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let dir = base.join(format!("cryo-journal-bench-{}", std::process::id()));
    let n = 2000u64;
    let event = |i| Event::Checkpointed {
        pid: ProcId::new(4242, 1),
        ms: i,
        bytes: 5_800_000_000,
    };

    let j = Journal::open(&dir).unwrap();
    let t = Instant::now();
    for i in 0..n {
        j.append(event(i)).unwrap();
    }
    let journal = t.elapsed();
    let frame = std::fs::metadata(j.path()).unwrap().len() / n;

    let mut f = std::fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(dir.join("baseline"))
        .unwrap();
    let buf = vec![b'x'; frame as usize];
    let t = Instant::now();
    for _ in 0..n {
        f.write_all(&buf).unwrap();
        f.sync_data().unwrap();
    }
    let bare = t.elapsed();
    std::fs::remove_dir_all(&dir).unwrap();
    println!("{n} appends of {frame} B: journal {:.1} us each, bare write+fdatasync {:.1} us each, ratio {:.2}",
        journal.as_secs_f64() * 1e6 / n as f64, bare.as_secs_f64() * 1e6 / n as f64,
        journal.as_secs_f64() / bare.as_secs_f64());
}
