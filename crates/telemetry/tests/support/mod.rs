//! Helpers of this crate's integration tests.
#![allow(dead_code)]

pub mod rsyslog;
pub mod tools;

#[allow(unused_imports)]
pub use tools::{promtool_check, sample, which};

use std::time::{Duration, Instant};

/// Polls `f` until it returns `Some`, or panics with `what` after `timeout`.
pub fn eventually<T>(timeout: Duration, what: &str, mut f: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return v;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
