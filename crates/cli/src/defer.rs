//! Termination signals deferred while a command moves a worker between two safe states.
//!
//! # Design
//! A `cryo stop`, `freeze` or `thaw` interrupted half-way can leave a worker locked and not
//! serving, or a thawed tree restored but not yet health-checked or removed. SIGINT, SIGTERM,
//! SIGHUP and SIGQUIT (a terminal, a preStop timeout, a supervisor) are therefore blocked for the
//! whole command and take effect, with their default action, once it has reached a safe end and
//! printed its result. SIGKILL cannot be deferred; every command is written so that a SIGKILL at
//! any point still leaves every process safe, and a rerun finishes the work.
//!
//! This is a signal *mask*, not a handler: blocked signals keep their default action and act the
//! moment the mask is lifted, which is the point. signal-hook installs handlers (it is what the
//! guard's termination flag uses); it has nothing for masks, so this stays on nix's
//! `pthread_sigmask`.
//!
//! # Limitations
//! The mask is per thread: it must be taken before the command spawns any thread, which then
//! inherit it.

use nix::sys::signal::{pthread_sigmask, SigSet, SigmaskHow, Signal};

/// While alive, termination signals stay pending. Dropping it lets a pending one act.
#[derive(Debug)]
pub struct Deferred {
    old: Option<SigSet>,
}

/// Blocks the termination signals in the calling thread (and the threads it spawns from now on).
pub fn termination() -> Deferred {
    let mut set = SigSet::empty();
    for s in [
        Signal::SIGINT,
        Signal::SIGTERM,
        Signal::SIGHUP,
        Signal::SIGQUIT,
    ] {
        set.add(s);
    }
    let mut old = SigSet::empty();
    match pthread_sigmask(SigmaskHow::SIG_BLOCK, Some(&set), Some(&mut old)) {
        Ok(()) => Deferred { old: Some(old) },
        Err(err) => {
            // Not fatal: the command is still safe against any signal, only less tidy.
            tracing::warn!(%err, "cannot defer termination signals");
            Deferred { old: None }
        }
    }
}

impl Drop for Deferred {
    fn drop(&mut self) {
        if let Some(old) = self.old.take() {
            if let Err(err) = pthread_sigmask(SigmaskHow::SIG_SETMASK, Some(&old), None) {
                tracing::warn!(%err, "cannot restore the signal mask");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signals_wait_until_the_guard_drops() {
        let blocked = termination();
        let mut now = SigSet::empty();
        pthread_sigmask(SigmaskHow::SIG_BLOCK, None, Some(&mut now)).unwrap();
        assert!(now.contains(Signal::SIGTERM) && now.contains(Signal::SIGINT));
        drop(blocked);
        pthread_sigmask(SigmaskHow::SIG_BLOCK, None, Some(&mut now)).unwrap();
        assert!(!now.contains(Signal::SIGTERM));
    }
}
