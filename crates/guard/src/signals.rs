//! Which signals the guard holds.
//!
//! A signal is *fatal* here when its default action ends the process and the process has neither
//! a handler installed (`SigCgt`) nor `SIG_IGN` (`SigIgn`) for it at the moment the signal is
//! about to be delivered. A process that handles SIGTERM handles its own shutdown (and an orderly
//! shutdown is the stop path's business); a handler that re-raises after resetting to `SIG_DFL`
//! (abort handlers, Python's faulthandler) is caught on the second delivery. A synchronous fault
//! (SEGV, BUS, ILL, FPE) that is blocked or ignored is reset to `SIG_DFL` by the kernel before it
//! is queued, so the masks read at the stop already say "default".
//!
//! Signal names come from [`cryo_proc::signal_name`].

/// Signal numbers whose default action terminates the process (with or without a core dump).
/// SIGKILL is left out: it never reaches a signal-delivery-stop, the exit stop catches it.
pub fn default_terminates(signal: i32) -> bool {
    matches!(
        signal,
        libc::SIGHUP
            | libc::SIGINT
            | libc::SIGQUIT
            | libc::SIGILL
            | libc::SIGTRAP
            | libc::SIGABRT
            | libc::SIGBUS
            | libc::SIGFPE
            | libc::SIGUSR1
            | libc::SIGSEGV
            | libc::SIGUSR2
            | libc::SIGPIPE
            | libc::SIGALRM
            | libc::SIGTERM
            | libc::SIGSTKFLT
            | libc::SIGXCPU
            | libc::SIGXFSZ
            | libc::SIGVTALRM
            | libc::SIGPROF
            | libc::SIGIO
            | libc::SIGPWR
            | libc::SIGSYS
    ) || (32..=64).contains(&signal)
}

fn bit(mask: u64, signal: i32) -> bool {
    u32::try_from(signal - 1)
        .ok()
        .filter(|b| *b < 64)
        .is_some_and(|b| mask & (1u64 << b) != 0)
}

/// Whether delivering `signal` now would kill the process, given its caught and ignored masks
/// (`/proc/PID/status` `SigCgt`, `SigIgn`).
pub fn is_fatal(signal: i32, caught: u64, ignored: u64) -> bool {
    default_terminates(signal) && !bit(caught, signal) && !bit(ignored, signal)
}

/// Whether `signal` asks for a graceful end (SIGTERM, SIGINT, SIGHUP) that the process handles
/// itself (a handler installed): the guard holds it too, since a handler that touches the GPU
/// after a checkpoint would hang, and an ordinary shutdown must not end in a pin.
pub fn is_graceful_end(signal: i32, caught: u64, ignored: u64) -> bool {
    matches!(signal, libc::SIGTERM | libc::SIGINT | libc::SIGHUP)
        && bit(caught, signal)
        && !bit(ignored, signal)
}

/// Whether `signal` is one of the four stop signals (their stop becomes a group-stop).
pub fn is_stop_signal(signal: i32) -> bool {
    matches!(
        signal,
        libc::SIGSTOP | libc::SIGTSTP | libc::SIGTTIN | libc::SIGTTOU
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fatality_follows_the_masks() {
        let term_bit = 1u64 << (libc::SIGTERM - 1);
        assert!(is_fatal(libc::SIGTERM, 0, 0));
        assert!(!is_fatal(libc::SIGTERM, term_bit, 0));
        assert!(!is_fatal(libc::SIGTERM, 0, term_bit));
        assert!(is_fatal(libc::SIGSEGV, term_bit, 0));
        assert!(!is_fatal(libc::SIGCHLD, 0, 0));
        assert!(!is_fatal(libc::SIGWINCH, 0, 0));
        assert!(!is_fatal(libc::SIGKILL, 0, 0));
        assert!(!is_fatal(libc::SIGSTOP, 0, 0));
        assert!(is_fatal(libc::SIGRTMIN() + 1, 0, 0));
        assert!(is_fatal(64, 0, 0));
        assert!(!is_fatal(65, 0, 0));
        assert!(is_graceful_end(libc::SIGTERM, term_bit, 0));
        assert!(
            !is_graceful_end(libc::SIGTERM, 0, 0),
            "unhandled: fatal, not graceful"
        );
        assert!(!is_graceful_end(libc::SIGTERM, term_bit, term_bit));
        let usr1_bit = 1u64 << (libc::SIGUSR1 - 1);
        assert!(!is_graceful_end(libc::SIGUSR1, usr1_bit, 0));
    }
}
