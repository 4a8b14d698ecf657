//! Failpoints: test hooks that make a step stall, so that tests can kill cryo at an exact point
//! and check that a second run recovers.
//!
//! # Design
//! A failpoint is named by the environment variable [`ENV`] (`CRYO_FAILPOINT=stop-before-kill`).
//! When the name matches, the step announces itself on stderr and sleeps until the process is
//! killed. Only the journal's writer reads it besides ([`cryo_journal::SYNC_FAILPOINT`]), and
//! the thaw's image checker ([`cryo_criu::image::CHECKER_BEFORE_VERDICT`], a pause); unset (always, outside tests) it costs one `getenv`.
//!
//! A pausing failpoint ([`pause_if`]) waits instead until a file the test names exists, so the
//! test can change the world at that exact point and let the step go on.
//!
//! # Limitations
//! No injected errors (the crash itself is the test's SIGKILL), except seven:
//! [`crate::park::PARK_RECORD_FAILS`] fails a park's first `Parked` record after its
//! suspension (so that the park's undo runs), [`crate::park::PARK_UNDO_UNRECORDED`] fails it
//! and then the undo's `RestoreCompleted` (so that the undo checkpoints its worker again),
//! [`crate::park::PARK_UNDO_DIES_RESTORED`] fails it and pauses the undo after its driver
//! restore, before its `RestoreCompleted` (where a test kills the park),
//! [`crate::suspend::SUSPEND_ROLL_BACK`] fails a suspension that succeeded, so that its roll-back
//! runs, the journal's [`cryo_journal::SYNC_FAILPOINT`] (read by the journal's writer from
//! the same variable) fails every `fdatasync` of the journal with EIO, and
//! [`crate::freeze::FREEZE_SUSPENSION_UNSYNCED`] fails only the sync of a freeze's suspension
//! records (started at GPU free), so that CRIU's gate refuses to let the tree end, and
//! [`crate::freeze::FREEZE_VERIFIED_UNWRITTEN`] fails the write of those records (EIO), so that
//! the freeze undoes its suspension before anything is let go.

use std::time::Duration;

/// The environment variable that names the active failpoint.
pub const ENV: &str = "CRYO_FAILPOINT";

/// `cryo stop`: every CUDA process is suspended and verified (the journal holds `Verified`),
/// nothing is killed yet. A pause ([`pause_if`]): stalls until killed without a resume file.
pub const STOP_BEFORE_KILL: &str = "stop-before-kill";

/// With a pausing failpoint ([`pause_if`]), the file whose creation lets the step go on.
pub const RESUME_ENV: &str = "CRYO_FAILPOINT_RESUME";

/// Whether failpoint `name` is active.
pub fn active(name: &str) -> bool {
    std::env::var(ENV).is_ok_and(|v| v == name)
}

/// The error a journal that cannot be written gives (EIO), for an injected failpoint `name`.
pub(crate) fn journal_eio(
    journal: &cryo_journal::Journal,
    name: &str,
) -> cryo_journal::AppendError {
    cryo_journal::AppendError::File(cryo_journal::FileError {
        what: match name {
            crate::park::PARK_RECORD_FAILS => "cannot write (failpoint park-record-fails) to",
            crate::park::PARK_UNDO_UNRECORDED => "cannot write (failpoint park-undo-unrecorded) to",
            crate::park::PARK_UNDO_DIES_RESTORED => {
                "cannot write (failpoint park-undo-dies-restored) to"
            }
            crate::freeze::FREEZE_VERIFIED_UNWRITTEN => {
                "cannot write (failpoint freeze-verified-unwritten) to"
            }
            _ => "cannot write (a failpoint) to",
        },
        path: journal.path().to_path_buf(),
        source: std::io::Error::from(rustix::io::Errno::IO),
    })
}

/// Says on stderr that a failpoint was reached: one `write`, its error ignored. `eprintln!`
/// writes each piece of its format separately, so a test that stopped reading at the word
/// "failpoint" and closed its pipe made the next piece fail with EPIPE, and `eprintln!` panics
/// then: the step it marks unwound (a freeze removed its staging directory) instead of stalling.
fn announce(line: String) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(line.as_bytes());
}

/// Stalls forever if failpoint `name` is active.
pub fn stall_if(name: &str) {
    if active(name) {
        announce(format!(
            "cryo: failpoint {name} reached; stalling until killed ({ENV} is a test hook)\n"
        ));
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
}

/// Pauses at failpoint `name` if it is active: announces it on stderr, then waits until the file
/// named by [`RESUME_ENV`] exists (stalls forever without one), so a test can act at this point
/// and let the step go on.
pub fn pause_if(name: &str) {
    if !active(name) {
        return;
    }
    let Some(resume) = std::env::var_os(RESUME_ENV) else {
        return stall_if(name);
    };
    announce(format!(
        "cryo: failpoint {name} reached; paused until {} exists ({ENV} is a test hook)\n",
        std::path::Path::new(&resume).display()
    ));
    while !std::path::Path::new(&resume).exists() {
        std::thread::sleep(Duration::from_millis(10));
    }
}
