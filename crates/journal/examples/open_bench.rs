#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Open cost: `Journal::open` of a journal of N records against two baselines measured in the
//! same run: a bare read of the same file (what any open must at least do without a rotation),
//! and `cryo_journal::read`, which decodes every record as a writer's open did before it
//! decoded only the last one (and as every reader still does). Then the journal is rotated (one
//! record in 100 names this process, alive: those are carried) and the readers' decode measured
//! again on the new active segment, with the rotation's own cost.
//! `cargo run --release -p cryo-journal --example open_bench [DIR] [N,N,...] [ROUNDS]`

use std::time::Instant;

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
    let sizes: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "100,10000,100000".into())
        .split(',')
        .map(|n| n.parse().unwrap())
        .collect();
    let rounds: usize = args.next().map_or(20, |r| r.parse().unwrap());
    for n in sizes {
        let dir = base.join(format!(
            "cryo-journal-open-bench-{}-{n}",
            std::process::id()
        ));
        let me = ProcId::of(std::process::id() as i32).unwrap();
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
        let file = dir.join(cryo_journal::FILE_NAME);
        let size = std::fs::metadata(&file).unwrap().len();
        let (mut open, mut read, mut decode) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..rounds {
            let t = Instant::now();
            drop(Journal::open(&dir).unwrap());
            open.push(t.elapsed().as_secs_f64() * 1e3);
            let t = Instant::now();
            let bytes = std::fs::read(&file).unwrap();
            read.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(bytes.len() as u64, size);
            let t = Instant::now();
            let all = cryo_journal::read(&dir).unwrap();
            decode.push(t.elapsed().as_secs_f64() * 1e3);
            assert_eq!(all.records.len(), n);
        }
        let (o, r, d) = (median(&mut open), median(&mut read), median(&mut decode));
        println!(
            "{n} records ({size} B): open median {o:.2} ms (min {:.2}); bare read {r:.2} ms, open/read {:.1}; decode all {d:.2} ms, open/decode {:.2}",
            open[0],
            o / r,
            o / d
        );
        let t = Instant::now();
        let rotation = Journal::open(&dir).unwrap().rotate().unwrap().unwrap();
        let rotate_ms = t.elapsed().as_secs_f64() * 1e3;
        let mut after = Vec::new();
        let mut kept = 0;
        for _ in 0..rounds {
            let t = Instant::now();
            kept = cryo_journal::read(&dir).unwrap().records.len();
            after.push(t.elapsed().as_secs_f64() * 1e3);
        }
        let a = median(&mut after);
        println!(
            "  rotated in {rotate_ms:.1} ms ({} carried, {} B): decode all after {a:.3} ms, before/after {:.0}",
            rotation.carried,
            rotation.new_bytes,
            d / a
        );
        assert_eq!(kept as u64, rotation.carried + 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
