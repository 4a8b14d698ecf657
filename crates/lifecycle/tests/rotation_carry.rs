#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The records a journal rotation carries ([`cryo_journal::carried`]) against every question
//! recovery asks of the journal: for random journals and random liveness, each answers the same
//! on the rotated segment as on the whole history, for the processes alive at the rotation (and
//! for the dead ones where a reader acts on them: pins, guard attachments, standbys, pinnings).

use std::time::{Duration, UNIX_EPOCH};

use cryo_journal::{
    carried, guarded, in_flight_stops, open_pins, pinned, AttachSource, Carry, Event, Origins,
    PinnedCpus, ProcId, Purpose, Record,
};
use cryo_lifecycle::park::parked_records;
use cryo_lifecycle::standby::{from_journal, unfinished};

/// xorshift64*: reproducible from the seed printed on failure.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }

    fn pick<T: Copy>(&mut self, from: &[T]) -> T {
        from[self.below(from.len())]
    }

    fn some<T: Copy>(&mut self, from: &[T]) -> Vec<T> {
        let n = 1 + self.below(3);
        (0..n).map(|_| self.pick(from)).collect()
    }
}

/// Processes of a random journal: some pids reused (same pid, another start time), some with a
/// pidfs inode recorded.
fn processes(rng: &mut Rng) -> Vec<ProcId> {
    let mut out = Vec::new();
    for i in 0..10 {
        let pid = 1000 + (i % 7);
        let mut p = ProcId::new(pid, 100 + i as u64);
        if rng.chance(30) {
            p.pidfs = Some(5000 + i as u64);
        }
        out.push(p);
    }
    out
}

fn event(rng: &mut Rng, ps: &[ProcId]) -> Event {
    let p = rng.pick(ps);
    let image = |rng: &mut Rng| format!("/img/{}", rng.below(3));
    match rng.below(40) {
        0 => Event::RestoreStarted {
            pid: p,
            image: image(rng),
            unlock_by: rng.chance(50).then(|| rng.pick(ps)),
        },
        1 => Event::RestoreCompleted {
            pid: p,
            image: image(rng),
            ms: None,
        },
        2 => Event::Resumed { pid: p },
        3 => Event::FreshDeclared { pid: p },
        4 => Event::Execed { pid: p, thread: 1 },
        5 => Event::SuspendStarted {
            pid: p,
            purpose: rng.pick(&[
                Purpose::Stop,
                Purpose::Freeze,
                Purpose::Park,
                Purpose::Guard,
            ]),
            by: rng.chance(70).then(|| rng.pick(ps)),
        },
        6 => Event::LockStarted { pid: p },
        7 => Event::Locked { pid: p, ms: 1 },
        8 => Event::CheckpointStarted { pid: p },
        9 => Event::Checkpointed {
            pid: p,
            ms: 1,
            bytes: 2,
        },
        10 => Event::Verified { pid: p, ms: None },
        11 => Event::KillStarted { pid: p, signal: 9 },
        12 => Event::Killed { pid: p },
        13 => Event::Refused {
            pid: p,
            reason: "r".into(),
            hint: "h".into(),
        },
        14 => Event::CallAbandoned {
            pid: p,
            call: "lock".into(),
            ms: 1,
        },
        15 => Event::SuspensionSettled {
            pid: p,
            found: "locked".into(),
            action: "unlocked".into(),
        },
        16 => Event::Unlocked {
            pid: p,
            ms: None,
            recovery: false,
        },
        17 => Event::Parked {
            pid: p,
            bytes: rng.next() % 100,
            gpus: vec!["GPU-0".into()],
            gpu_bytes: vec![],
        },
        18 => Event::GuardAttached {
            pid: p,
            source: rng.pick(&[AttachSource::Restore, AttachSource::Scan]),
        },
        19 => Event::GuardLost { pid: p },
        20 => Event::ProcessExited {
            pid: p,
            how: "exited".into(),
        },
        21 => Event::Pinned {
            pid: p,
            gpu: format!("GPU-{}", rng.below(2)),
            fds: vec![3],
        },
        22 => Event::PinsReleased { pid: p },
        23 => Event::PinsLost {
            pid: p,
            reason: "x".into(),
        },
        24 => Event::ThawCompleted {
            image: image(rng),
            pids: rng.some(ps),
            ms: 1,
        },
        25 => Event::StopCompleted {
            target: "t".into(),
            killed: rng.some(ps),
            ms: 1,
            refused: vec![],
        },
        26 => Event::ShrinkCompleted {
            target: "t".into(),
            pids: rng.some(ps),
            spec: "vllm".into(),
            engine: None,
            outcome: rng.pick(&["shrunk", "whole", "unknown"]).into(),
            error: None,
            ms: 1,
        },
        27 => Event::Grown {
            target: "t".into(),
            pids: rng.some(ps),
            ms: 1,
        },
        28 => Event::StandbyRestoring {
            image: image(rng),
            root: p,
            pids: std::iter::once(p).chain(rng.some(ps)).collect(),
        },
        29 => Event::StandbyReady {
            image: image(rng),
            digest: "d".into(),
            root: p,
            pids: std::iter::once(p).chain(rng.some(ps)).collect(),
        },
        30 => Event::StandbyClaimed {
            image: image(rng),
            root: p,
        },
        31 => Event::StandbyDropped {
            image: image(rng),
            root: p,
            reason: "x".into(),
        },
        32 => Event::StandbyPool {
            image: image(rng),
            count: rng.below(3) as u32,
            criu_timeout_s: None,
        },
        33 => Event::CpusPinned {
            root: p,
            by: rng.chance(80).then(|| rng.pick(ps)),
            cpu: 0,
            procs: std::iter::once(p)
                .chain(rng.some(ps))
                .map(|pid| PinnedCpus {
                    pid,
                    cpus: vec![0, 1],
                })
                .collect(),
            boot: None,
            since: None,
        },
        34 => Event::CpusReturned {
            root: p,
            by: rng.chance(80).then(|| rng.pick(ps)),
            returned: rng.some(ps),
            left: vec![],
            inherited: 0,
            recovery: false,
        },
        35 => Event::GrowFailed {
            target: "t".into(),
            pids: rng.some(ps),
            error: "x".into(),
        },
        36 => Event::PinsHanded {
            pid: p,
            holder: rng.pick(ps),
        },
        37 => Event::Unknown,
        38 => Event::ThawStarted { image: image(rng) },
        _ => Event::FreezeStarted { image: image(rng) },
    }
}

/// Every answer recovery gets from `records`, for the processes `alive` says are alive, as text
/// (the answers' types need not compare).
fn answers(records: &[Record], alive: &dyn Fn(&ProcId) -> bool, ps: &[ProcId]) -> Vec<String> {
    let live: Vec<ProcId> = ps.iter().copied().filter(|p| alive(p)).collect();
    let mut out = Vec::new();
    let origins = Origins::from_records(records);
    for p in &live {
        out.push(format!("origin {p:?}: {:?}", origins.of(p)));
        // Every per-process fold (finish_unlock's restore step among them) reads the records
        // naming the process, in order.
        let named: Vec<u64> = records
            .iter()
            .filter(|r| r.event.pids().contains(p) || r.event.proc() == Some(*p))
            .map(|r| r.seq)
            .collect();
        out.push(format!("records of {p:?}: {named:?}"));
    }
    // `leftover`'s question: the thaw each live process's last restore intent came from (the
    // last `ThawStarted` of its image before it), by its seq.
    for p in &live {
        let intent = records
            .iter()
            .rposition(|r| matches!(&r.event, Event::RestoreStarted { pid, .. } if pid == p));
        let thaw = intent.and_then(|at| match &records[at].event {
            Event::RestoreStarted { image, .. } => records[..at]
                .iter()
                .rev()
                .find(|r| matches!(&r.event, Event::ThawStarted { image: i } if i == image))
                .map(|r| r.seq),
            _ => None,
        });
        out.push(format!("thaw of {p:?}'s last intent: {thaw:?}"));
    }
    let flying: Vec<_> = in_flight_stops(records)
        .into_iter()
        .filter(|(p, _)| alive(p))
        .collect();
    out.push(format!("in flight: {flying:?}"));
    out.push(format!("open pins: {:?}", open_pins(records)));
    out.push(format!("pinned: {:?}", pinned(records)));
    out.push(format!("guarded: {:?}", guarded(records)));
    let parked: Vec<_> = parked_records(records)
        .into_iter()
        .filter(|(p, _)| alive(p))
        .collect();
    out.push(format!("parked: {parked:?}"));
    out.push(format!("unfinished standbys: {:?}", unfinished(records)));
    out.push(format!("standbys: {:?}", from_journal(records)));
    // Shrinks to grow, for every set of live processes of one or two.
    for a in &live {
        for b in &live {
            let pids = if a == b { vec![*a] } else { vec![*a, *b] };
            let pending = cryo_lifecycle::shrink::pending(records, &pids);
            out.push(format!("shrink of {pids:?}: {pending:?}"));
        }
    }
    out
}

#[test]
fn every_recovery_question_answers_the_same_on_the_rotated_segment() {
    let cases = std::env::var("CRYO_ROTATION_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400u64);
    let mut dropped = 0usize;
    let mut total = 0usize;
    for seed in 1..=cases {
        let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        let ps = processes(&mut rng);
        let live_mask = rng.next();
        let alive = move |p: &ProcId| {
            // Liveness by pid and start time, as `/proc` tells it (a pidfs inode recorded on
            // one record and not another names the same process).
            let i = (p.start_time - 100) as u32;
            live_mask & (1 << i) != 0
        };
        let n = 20 + rng.below(120);
        let records: Vec<Record> = (1..=n as u64)
            .map(|seq| Record {
                seq,
                time: UNIX_EPOCH + Duration::from_secs(seq),
                event: event(&mut rng, &ps),
            })
            .collect();
        let keep = carried(&records, alive);
        let rotated: Vec<Record> = keep.iter().map(|&i| records[i].clone()).collect();
        total += records.len();
        dropped += records.len() - rotated.len();
        let whole = answers(&records, &alive, &ps);
        let after = answers(&rotated, &alive, &ps);
        for (w, a) in whole.iter().zip(&after) {
            assert_eq!(
                w, a,
                "seed {seed}: the rotated segment answers differently (live mask {live_mask:b})"
            );
        }
        // Rotating the rotated segment again changes nothing (nothing dies in between).
        assert_eq!(carried(&rotated, alive).len(), rotated.len(), "seed {seed}");
        // Chosen as a rotation does (before its lock, for the records there then; under it,
        // extended by those appended since), at any point: the same answers, never less kept.
        let split = rng.below(n + 1);
        let extended = Carry::of(&records[..split], alive).extend(&records, alive);
        assert!(
            keep.iter().all(|i| extended.contains(i)),
            "seed {seed}, split {split}: fewer carried than carried() keeps"
        );
        let rotated: Vec<Record> = extended.iter().map(|&i| records[i].clone()).collect();
        let after = answers(&rotated, &alive, &ps);
        for (w, a) in whole.iter().zip(&after) {
            assert_eq!(
                w, a,
                "seed {seed}, split {split}: the segment chosen around the lock answers differently (live mask {live_mask:b})"
            );
        }
    }
    println!("{cases} journals, {dropped} of {total} records dropped");
    assert!(dropped > 0, "the selection never drops anything");
}
