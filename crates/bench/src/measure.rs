//! What the three benchmarks share: samples over rounds (median, min-max), the alternating arm
//! order, and the host's load average as a noise indicator.

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
            dirty_mib: sum(&meminfo, &|k| k == "Dirty" || k == "Writeback") / 1024,
        }
    }
}
