#![allow(clippy::unwrap_used, clippy::expect_used)]
//! How long a writer's append waits while the journal rotates: a journal of N records (about
//! the agent's 4 MiB at the default 28,000; one record in 100 names this process, alive, so
//! those are carried, the others name 30,000 dead pids), a writer appending synced records in
//! a loop through a journal handle of its own (as the guard or another command does), and one
//! rotation; per round, the longest append against the median append of the same round, and
//! the rotation's own time.
//! `cargo run --release -p cryo-journal --example rotate_bench [DIR] [N] [ROUNDS]`

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cryo_journal::{Event, Journal, ProcId};

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() {
    let mut args = std::env::args().skip(1);
    let base = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    let n: usize = args.next().map_or(28_000, |r| r.parse().unwrap());
    let rounds: usize = args.next().map_or(5, |r| r.parse().unwrap());
    let me = ProcId::of(std::process::id() as i32).unwrap();
    let (mut longest, mut typical, mut rotations) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let dir = base.join(format!(
            "cryo-journal-rotate-bench-{}-{round}",
            std::process::id()
        ));
        {
            let j = Journal::open(&dir).unwrap();
            let events: Vec<Event> = (0..n)
                .map(|i| {
                    let pid = if i % 100 == 0 {
                        me
                    } else {
                        ProcId::new(1000 + (i % 30_000) as i32, 7)
                    };
                    match i % 4 {
                        0 => Event::LockStarted { pid },
                        1 => Event::Locked { pid, ms: 3 },
                        2 => Event::Checkpointed {
                            pid,
                            ms: 250,
                            bytes: 1 << 30,
                        },
                        _ => Event::FreezeStarted {
                            image: format!("/var/lib/cryo/images/worker-{i}"),
                        },
                    }
                })
                .collect();
            for c in events.chunks(1000) {
                j.append_all(c.to_vec()).unwrap();
            }
        }
        let size = std::fs::metadata(dir.join(cryo_journal::FILE_NAME))
            .unwrap()
            .len();
        let stop = Arc::new(AtomicBool::new(false));
        let appended = Arc::new(AtomicUsize::new(0));
        let writer = std::thread::spawn({
            let (dir, stop, appended) = (dir.clone(), Arc::clone(&stop), Arc::clone(&appended));
            move || {
                let j = Journal::open(&dir).unwrap();
                let mut waits = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let t = Instant::now();
                    j.append(Event::Locked { pid: me, ms: 1 }).unwrap();
                    waits.push((t, t.elapsed().as_secs_f64() * 1e3));
                    appended.fetch_add(1, Ordering::Relaxed);
                }
                waits
            }
        });
        while appended.load(Ordering::Relaxed) < 50 {
            std::thread::sleep(Duration::from_millis(1));
        }
        let rotator = Journal::open(&dir).unwrap();
        let t = Instant::now();
        let rotation = rotator.rotate().unwrap().unwrap();
        let rotate_ms = t.elapsed().as_secs_f64() * 1e3;
        let after = appended.load(Ordering::Relaxed);
        while appended.load(Ordering::Relaxed) < after + 50 {
            std::thread::sleep(Duration::from_millis(1));
        }
        stop.store(true, Ordering::Relaxed);
        let waits = writer.join().unwrap();
        let max = waits.iter().map(|w| w.1).fold(0.0, f64::max);
        let mut all: Vec<f64> = waits.iter().map(|w| w.1).collect();
        let med = median(&mut all);
        println!(
            "round {round}: {n} records ({size} B), rotated in {rotate_ms:.1} ms ({} carried); {} appends, longest {max:.1} ms, median {med:.2} ms",
            rotation.carried,
            waits.len()
        );
        longest.push(max);
        typical.push(med);
        rotations.push(rotate_ms);
        std::fs::remove_dir_all(&dir).unwrap();
    }
    println!(
        "median of {rounds} rounds: longest append {:.1} ms, median append {:.2} ms, rotation {:.1} ms",
        median(&mut longest),
        median(&mut typical),
        median(&mut rotations)
    );
}
