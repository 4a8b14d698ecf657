//! Failpoints: test hooks that make a step stall, so that tests can kill cryo at an exact point
//! and check that a second run recovers.
//!
//! # Design
//! A failpoint is named by the environment variable [`ENV`] (`CRYO_FAILPOINT=stop-before-kill`).
//! When the name matches, the step announces itself on stderr and sleeps until the process is
//! killed. Nothing else reads the variable; unset (always, outside tests) it costs one `getenv`.
//!
//! # Limitations
//! Only stalls are supported (no injected errors): the crash itself is the test's SIGKILL.

use std::time::Duration;

/// The environment variable that names the active failpoint.
pub const ENV: &str = "CRYO_FAILPOINT";

/// `cryo stop`: every CUDA process is suspended and verified (the journal holds `Verified`),
/// nothing is killed yet.
pub const STOP_BEFORE_KILL: &str = "stop-before-kill";

/// Whether failpoint `name` is active.
pub fn active(name: &str) -> bool {
    std::env::var(ENV).is_ok_and(|v| v == name)
}

/// Stalls forever if failpoint `name` is active.
pub fn stall_if(name: &str) {
    if active(name) {
        eprintln!("cryo: failpoint {name} reached; stalling until killed ({ENV} is a test hook)");
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}
