//! Waiting for what happens asynchronously, without sleeping as proof.

use std::time::{Duration, Instant};

/// Upper bound on any single wait in a test: a hang guard, not a timing assertion. Generous,
/// because the suite shares two cores with other runs.
pub const PATIENCE: Duration = Duration::from_secs(60);

/// What a check returns: `bool` (ready or not), or `Option<T>` (the value once ready).
pub trait Ready {
    /// The value handed back once ready.
    type Output;
    /// `Some` once ready.
    fn ready(self) -> Option<Self::Output>;
}

impl Ready for bool {
    type Output = ();
    fn ready(self) -> Option<()> {
        self.then_some(())
    }
}

impl<T> Ready for Option<T> {
    type Output = T;
    fn ready(self) -> Option<T> {
        self
    }
}

/// Polls `check` until it is ready and returns its value; panics naming `what` once `within` has
/// passed. Polls fast at first (most events come within milliseconds), then every 20 ms.
pub fn eventually<R: Ready>(within: Duration, what: &str, check: impl FnMut() -> R) -> R::Output {
    eventually_said(within, || format!("{what}: never happened"), check)
}

/// [`eventually`], whose failure says what `said` returns then (what is left, what the
/// program said): for a wait whose failure needs the state at that moment to be understood.
pub fn eventually_said<R: Ready>(
    within: Duration,
    said: impl FnOnce() -> String,
    mut check: impl FnMut() -> R,
) -> R::Output {
    let start = Instant::now();
    let mut pause = Duration::from_millis(1);
    loop {
        if let Some(v) = check().ready() {
            return v;
        }
        let waited = start.elapsed();
        if waited >= within {
            panic!("waited {waited:?} for {}", said());
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn returns_the_value_once_ready() {
        let mut n = 0;
        let v = eventually(PATIENCE, "the third poll", || {
            n += 1;
            (n == 3).then_some(n)
        });
        assert_eq!(v, 3);
    }

    #[test]
    #[should_panic(expected = "never happened")]
    fn panics_past_the_deadline() {
        eventually(Duration::from_millis(30), "nothing", || false);
    }

    #[test]
    #[should_panic(expected = "the state then: 7 left")]
    fn says_the_state_at_the_deadline() {
        let n = std::cell::Cell::new(0);
        eventually_said(
            Duration::from_millis(30),
            || format!("the state then: {} left", n.get()),
            || {
                n.set(7);
                false
            },
        );
    }
}
