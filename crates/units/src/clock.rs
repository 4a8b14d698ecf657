//! Moments on the host's `CLOCK_MONOTONIC`, the one clock cryo reports absolute times on.
//!
//! # Design
//! A report that says "GPU free 250 ms after the freeze started" leaves out what happened
//! before its own start (the process's start, listing the tree, opening the journal) and says
//! nothing about when the caller could have known. A [`Moment`] is an absolute time on the
//! clock every process of the host shares, so a caller (`cryo bench freeze`, a script) takes
//! its own origin (the instant it started `cryo freeze`) and subtracts: every cost between its
//! origin and the moment is counted, and nothing after it (the process's exit) is.
//! `std::time::Instant` is that clock on Linux but does not say its value, so a moment is read
//! with `clock_gettime(CLOCK_MONOTONIC)` itself; [`Moment::of`] converts an `Instant` taken
//! earlier (the lifecycle keeps its `Instant`s) by subtracting its age from now.
//!
//! # Limitations
//! Comparable only between processes of one boot and one time namespace; nanoseconds as a `u64`
//! (584 years of uptime).

use std::time::{Duration, Instant};

/// An absolute time on `CLOCK_MONOTONIC`, ns (serialized as that number).
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct Moment(pub u64);

impl Moment {
    /// Now.
    pub fn now() -> Moment {
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
        let secs = u64::try_from(t.tv_sec).unwrap_or(0);
        let nanos = u64::try_from(t.tv_nsec).unwrap_or(0);
        Moment(secs.saturating_mul(1_000_000_000).saturating_add(nanos))
    }

    /// The moment `t` was taken (an `Instant` is `CLOCK_MONOTONIC` on Linux): now less its
    /// age, so off by the few nanoseconds between the two reads.
    pub fn of(t: Instant) -> Moment {
        let age = u64::try_from(t.elapsed().as_nanos()).unwrap_or(u64::MAX);
        Moment(Moment::now().0.saturating_sub(age))
    }

    /// Nanoseconds on `CLOCK_MONOTONIC`.
    pub fn ns(self) -> u64 {
        self.0
    }

    /// Time from `origin` to this moment, ms; negative when this moment came first.
    pub fn ms_since(self, origin: Moment) -> f64 {
        (self.0 as f64 - origin.0 as f64) / 1e6
    }

    /// Time from `origin` to this moment; zero when this moment came first.
    pub fn since(self, origin: Moment) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(origin.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_moment_is_on_the_clock_instant_uses() {
        // Instant is CLOCK_MONOTONIC: an Instant taken between two moments converts to a
        // moment between them, and a sleep between two moments is seen whole.
        let before = Moment::now();
        let t = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let after = Moment::now();
        let at = Moment::of(t);
        assert!(before <= at && at <= after, "{before:?} {at:?} {after:?}");
        assert!(after.since(before) >= Duration::from_millis(20));
        assert!(after.ms_since(before) >= 20.0);
        assert!(before.ms_since(after) <= -20.0);
        assert_eq!(before.since(after), Duration::ZERO);
    }

    #[test]
    fn a_moment_is_serialized_as_its_nanoseconds() {
        let m = Moment(1_234_567_890);
        assert_eq!(serde_json::to_string(&m).unwrap(), "1234567890");
        assert_eq!(serde_json::from_str::<Moment>("42").unwrap(), Moment(42));
    }
}
