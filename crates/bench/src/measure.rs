//! What the benchmarks share: samples over rounds (median, min-max), a bootstrap interval of a
//! median ([`Interval`]), paired ratios of two arms run back to back, the alternating arm order,
//! and the host's load average as a noise indicator.

use serde::Serialize;

/// The samples of one arm over the counted rounds.
#[derive(Debug, Clone, Default)]
pub(crate) struct Samples(pub(crate) Vec<f64>);

impl Samples {
    pub(crate) fn push(&mut self, v: f64) {
        self.0.push(v);
    }

    fn sorted(&self) -> Vec<f64> {
        let mut v = self.0.clone();
        v.sort_by(f64::total_cmp);
        v
    }

    /// The median (the mean of the middle two for an even count); NaN without samples.
    pub(crate) fn median(&self) -> f64 {
        let v = self.sorted();
        match v.len() {
            0 => f64::NAN,
            n if n % 2 == 1 => v[n / 2],
            n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
        }
    }

    pub(crate) fn min(&self) -> f64 {
        self.sorted().first().copied().unwrap_or(f64::NAN)
    }

    pub(crate) fn max(&self) -> f64 {
        self.sorted().last().copied().unwrap_or(f64::NAN)
    }

    /// `median (min-max)`, in the unit the samples are in, no decimals.
    pub(crate) fn cell(&self) -> String {
        format!("{:.0} ({:.0}-{:.0})", self.median(), self.min(), self.max())
    }

    /// `median (min-max)` with one decimal, for small values.
    pub(crate) fn cell1(&self) -> String {
        format!("{:.1} ({:.1}-{:.1})", self.median(), self.min(), self.max())
    }
}

impl Serialize for Samples {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

/// A median and the interval of it a bootstrap gives at `level` (0.9: the middle 90% of the
/// medians of [`BOOTSTRAP`] resamples with replacement; a fixed seed: the same samples give
/// the same interval). With few samples it is as wide as they are apart: that is the point.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Interval {
    pub(crate) median: f64,
    pub(crate) low: f64,
    pub(crate) high: f64,
    /// The interval's level (0.9, 0.95).
    pub(crate) level: f64,
    pub(crate) samples: usize,
    /// Consecutive samples resampled together as one unit ([`Interval::of_blocks`]; 1: each
    /// sample on its own).
    pub(crate) block: usize,
}

/// Bootstrap resamples.
pub(crate) const BOOTSTRAP: usize = 2000;

impl Interval {
    /// Resamples the samples one by one: for samples that are independent of each other.
    pub(crate) fn of(s: &Samples, level: f64) -> Interval {
        Interval::of_blocks(s, level, 1)
    }

    /// Resamples blocks of `block` consecutive samples as units (the last block shorter when
    /// they do not divide evenly): a block bootstrap, for samples taken in order whose
    /// neighbours are alike (what drifts slowly with the host is kept within a block, so its
    /// spread between blocks shows in the interval instead of averaging out over samples
    /// drawn one by one). With `block` 1 it is the plain bootstrap; with more it is never
    /// narrower than the plain one (it spans both): with few blocks a block bootstrap has few
    /// distinct resamples (one block: none), and that must not read as certainty.
    pub(crate) fn of_blocks(s: &Samples, level: f64, block: usize) -> Interval {
        Interval::of_blocks_kept(s, &vec![true; s.0.len()], level, block)
    }

    /// [`Interval::of_blocks`] over the samples `keep` marks (one flag per sample, in order):
    /// the others are left out of their blocks, which stay where they were (a block keeps the
    /// rounds it had that are kept; a block left empty is dropped), so that leaving a round out
    /// never pairs two rounds of different blocks.
    pub(crate) fn of_blocks_kept(s: &Samples, keep: &[bool], level: f64, block: usize) -> Interval {
        let block = block.max(1);
        let kept = Samples(
            s.0.iter()
                .zip(keep)
                .filter(|(_, k)| **k)
                .map(|(v, _)| *v)
                .collect(),
        );
        let blocks = |b: usize| -> Vec<Vec<f64>> {
            s.0.chunks(b)
                .zip(keep.chunks(b))
                .map(|(v, k)| {
                    v.iter()
                        .zip(k)
                        .filter(|(_, k)| **k)
                        .map(|(v, _)| *v)
                        .collect::<Vec<f64>>()
                })
                .filter(|b| !b.is_empty())
                .collect()
        };
        let blocked = Interval::resampled(&kept, &blocks(block), level, block);
        if block == 1 {
            return blocked;
        }
        let plain = Interval::resampled(&kept, &blocks(1), level, 1);
        Interval {
            low: blocked.low.min(plain.low),
            high: blocked.high.max(plain.high),
            ..blocked
        }
    }

    /// The bootstrap of [`Interval::of_blocks`], resampling `blocks` (of up to `block` of the
    /// samples `s` each) as units.
    fn resampled(s: &Samples, blocks: &[Vec<f64>], level: f64, block: usize) -> Interval {
        let n = s.0.len();
        let mut rng = 0x9E37_79B9_7F4A_7C15_u64;
        let mut next = move || {
            // xorshift64*: uniform enough for resampling indices.
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let mut medians = Samples::default();
        for _ in 0..BOOTSTRAP {
            let mut r = Samples::default();
            for _ in 0..blocks.len() {
                let i = usize::try_from(next() % (blocks.len().max(1) as u64)).unwrap_or(0);
                match blocks.get(i) {
                    Some(b) => r.0.extend_from_slice(b),
                    None => r.push(f64::NAN),
                }
            }
            medians.push(r.median());
        }
        let m = medians.sorted();
        let at = |q: f64| {
            m.get(((m.len() as f64 - 1.0) * q).round() as usize)
                .copied()
        };
        let tail = (1.0 - level) / 2.0;
        Interval {
            median: s.median(),
            low: at(tail).unwrap_or(f64::NAN),
            high: at(1.0 - tail).unwrap_or(f64::NAN),
            level,
            samples: n,
            block,
        }
    }

    /// `median [low, high]`, three decimals.
    pub(crate) fn cell(&self) -> String {
        format!("{:.3} [{:.3}, {:.3}]", self.median, self.low, self.high)
    }
}

/// The ratio `a / b` of each round's pair of samples (arms run back to back in that round, so
/// what drifts between rounds cancels in it).
pub(crate) fn paired_ratios(a: &Samples, b: &Samples) -> Samples {
    Samples(a.0.iter().zip(&b.0).map(|(x, y)| x / y).collect())
}

/// Whether arm A goes first in round `round` (0 is the warm-up): A B, B A, A B, ...
pub(crate) fn a_first(round: usize) -> bool {
    round.is_multiple_of(2)
}

/// Two arms over one warm-up round (not counted) and `rounds` counted ones, the arm that goes
/// first alternating ([`a_first`]); `arm(k)` runs arm `k` (0 or 1) once and says what it took.
/// Returns each arm's samples.
pub(crate) fn ab_rounds(
    rounds: usize,
    mut arm: impl FnMut(usize) -> anyhow::Result<f64>,
) -> anyhow::Result<[Samples; 2]> {
    let mut out: [Samples; 2] = Default::default();
    for round in 0..=rounds {
        let order = if a_first(round) { [0, 1] } else { [1, 0] };
        for k in order {
            let took = arm(k)?;
            if round > 0 {
                out[k].push(took);
            }
        }
    }
    Ok(out)
}

/// The host's 1, 5 and 15 minute load averages; NaN where unreadable, since a benchmark should
/// not fail for want of a noise indicator.
pub(crate) fn load_average() -> [f64; 3] {
    cryo_proc::load_average().unwrap_or([f64::NAN; 3])
}

/// `load average at start: 0.77 1.20 1.28 (1, 5, 15 min; 2 CPUs)`.
pub(crate) fn load_line(when: &str, l: [f64; 3]) -> String {
    let cpus = std::thread::available_parallelism().map_or(0, std::num::NonZeroUsize::get);
    format!(
        "load average at {when}: {:.2} {:.2} {:.2} (1, 5, 15 min; {cpus} CPUs)",
        l[0], l[1], l[2]
    )
}

/// The kernel's memory counters (`/proc/vmstat`, `/proc/meminfo`) at one moment.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct HostMemory {
    pub(crate) compact_stall: u64,
    pub(crate) allocstall: u64,
    pub(crate) thp_fault_fallback: u64,
    pub(crate) thp_fault_alloc: u64,
    pub(crate) available_mib: u64,
    /// Memory no one uses (`MemFree`): what an allocation gets without reclaiming.
    pub(crate) free_mib: u64,
    /// The page cache (`Cached`).
    pub(crate) cached_mib: u64,
    pub(crate) dirty_mib: u64,
}

impl HostMemory {
    pub(crate) fn now() -> HostMemory {
        let vmstat = std::fs::read_to_string("/proc/vmstat").unwrap_or_default();
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let sum = |text: &str, pick: &dyn Fn(&str) -> bool| -> u64 {
            text.lines()
                .filter(|l| pick(l.split([' ', ':']).next().unwrap_or("")))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .sum()
        };
        HostMemory {
            compact_stall: sum(&vmstat, &|k| k == "compact_stall"),
            allocstall: sum(&vmstat, &|k| k.starts_with("allocstall_")),
            thp_fault_fallback: sum(&vmstat, &|k| k == "thp_fault_fallback"),
            thp_fault_alloc: sum(&vmstat, &|k| k == "thp_fault_alloc"),
            available_mib: sum(&meminfo, &|k| k == "MemAvailable") / 1024,
            free_mib: sum(&meminfo, &|k| k == "MemFree") / 1024,
            cached_mib: sum(&meminfo, &|k| k == "Cached") / 1024,
            dirty_mib: sum(&meminfo, &|k| k == "Dirty" || k == "Writeback") / 1024,
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    /// Deterministic pseudo-random noise in [0, 1) for synthetic samples.
    fn noise(seed: u64, n: usize) -> Vec<f64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 11) as f64 / (1u64 << 53) as f64
            })
            .collect()
    }

    #[test]
    fn the_interval_of_equal_samples_is_that_value() {
        let i = Interval::of(&Samples(vec![1.25; 7]), 0.9);
        assert_eq!((i.median, i.low, i.high, i.samples), (1.25, 1.25, 1.25, 7));
    }

    #[test]
    fn the_interval_holds_the_median_within_the_samples_and_is_reproducible() {
        let s = Samples(noise(7, 15).iter().map(|u| 0.8 + 0.4 * u).collect());
        let (i90, i95) = (Interval::of(&s, 0.9), Interval::of(&s, 0.95));
        assert!(s.min() <= i95.low && i95.low <= i90.low, "{i90:?} {i95:?}");
        assert!(i90.low <= i90.median && i90.median <= i90.high, "{i90:?}");
        assert!(
            i90.high <= i95.high && i95.high <= s.max(),
            "{i90:?} {i95:?}"
        );
        assert!(i90.high > i90.low, "{i90:?}");
        let again = Interval::of(&s, 0.9);
        assert_eq!((again.low, again.high), (i90.low, i90.high));
    }

    /// Rounds whose host speed drifts (both arms of a round slowed alike, 0.7x-1.6x) and one
    /// arm 10% faster: every paired ratio is the true 1.1 and so is its whole interval, while
    /// the arms' own samples swing by the drift.
    #[test]
    fn paired_ratios_cancel_what_drifts_between_rounds() {
        let drift: Vec<f64> = noise(3, 9).iter().map(|u| 0.7 + 0.9 * u).collect();
        let cryo = Samples(drift.iter().map(|d| 1000.0 * d).collect());
        let bare = Samples(drift.iter().map(|d| 1100.0 * d).collect());
        assert!(cryo.max() / cryo.min() > 1.3, "{cryo:?}");
        let i = Interval::of(&paired_ratios(&bare, &cryo), 0.9);
        for v in [i.median, i.low, i.high] {
            assert!((v - 1.1).abs() < 1e-9, "{i:?}");
        }
    }

    /// Rounds that come in pairs alike (each pair drawn from the host's state of the moment,
    /// the two rounds of a pair within 1% of each other): resampled one by one, the pairs'
    /// likeness passes for agreement and the interval narrows; resampled as blocks of two it
    /// is as wide as the pairs are apart, and never narrower.
    #[test]
    fn blocks_of_alike_neighbours_widen_the_interval_to_their_spread() {
        let u = noise(5, 6);
        let pairs: Vec<f64> = u
            .iter()
            .flat_map(|x| {
                let v = 0.6 + 0.8 * x;
                [v, v * 1.01]
            })
            .collect();
        let s = Samples(pairs);
        let (one, two) = (Interval::of(&s, 0.9), Interval::of_blocks(&s, 0.9, 2));
        assert_eq!((one.block, two.block), (1, 2));
        assert_eq!(one.median, two.median);
        assert!(two.high - two.low > one.high - one.low, "{one:?} {two:?}");
        assert!(s.min() <= two.low && two.high <= s.max(), "{two:?}");
        // A single block (two rounds) has one resample: the interval is still the rounds'.
        let lone = Samples(vec![0.8, 1.3]);
        let (p, b) = (Interval::of(&lone, 0.9), Interval::of_blocks(&lone, 0.9, 2));
        assert!(
            b.low <= p.low && p.high <= b.high && b.high > b.low,
            "{p:?} {b:?}"
        );
        // Equal blocks: the value, however they are cut; a last block shorter than the rest.
        let flat = Interval::of_blocks(&Samples(vec![0.97; 5]), 0.9, 2);
        assert_eq!((flat.low, flat.high, flat.samples), (0.97, 0.97, 5));
    }

    /// Rounds left out (a restore in the hypervisor's slow-fault mode) are out of the median
    /// and of every resample, whatever their value, and their block partners stay in their
    /// own block: keeping every round is `of_blocks` itself.
    #[test]
    fn rounds_left_out_are_in_no_resample_and_no_block_moves() {
        let u = noise(11, 8);
        let s = Samples(u.iter().map(|x| 0.9 + 0.2 * x).collect());
        let all = Interval::of_blocks_kept(&s, &[true; 8], 0.9, 2);
        let plain = Interval::of_blocks(&s, 0.9, 2);
        assert_eq!(
            (all.median, all.low, all.high, all.samples),
            (plain.median, plain.low, plain.high, plain.samples)
        );
        // Two rounds far out (a 2x restore), in two blocks, left out: as if never run.
        let mut wild = s.clone();
        wild.0[1] = 2.2;
        wild.0[4] = 0.45;
        let keep = [true, false, true, true, false, true, true, true];
        let out = Interval::of_blocks_kept(&wild, &keep, 0.9, 2);
        let rest = Samples(
            s.0.iter()
                .zip(keep)
                .filter(|(_, k)| *k)
                .map(|(v, _)| *v)
                .collect(),
        );
        assert_eq!(out.samples, 6);
        assert_eq!(out.median, rest.median());
        assert!(rest.min() <= out.low && out.high <= rest.max(), "{out:?}");
        // Only one round kept: its value, never a NaN from an empty block.
        let one = Interval::of_blocks_kept(
            &wild,
            &[false, false, false, true, false, false, false, false],
            0.9,
            2,
        );
        assert_eq!((one.median, one.low, one.high), (s.0[3], s.0[3], s.0[3]));
    }

    /// Paired ratios scattered around 1.0: the 90% interval straddles 1 (no verdict either
    /// way); around 1.2 with the same scatter it lies above 1.
    #[test]
    fn the_interval_says_whether_a_ratio_is_told_apart_from_one() {
        let u = noise(11, 21);
        let around = |c: f64| Samples(u.iter().map(|x| c + 0.2 * (x - 0.5)).collect());
        let even = Interval::of(&around(1.0), 0.9);
        assert!(even.low < 1.0 && 1.0 < even.high, "{even:?}");
        let faster = Interval::of(&around(1.2), 0.9);
        assert!(faster.low > 1.0, "{faster:?}");
    }
}
