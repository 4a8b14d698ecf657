//! Signal names for logs, journals and messages, from nix's table.

pub use nix::sys::signal::Signal;

/// `SIGTERM`, `SIGRT34`, `signal 99`: a signal's name for logs, journals and messages.
pub fn signal_name(signal: i32) -> String {
    match Signal::try_from(signal) {
        Ok(s) => s.as_str().to_string(),
        // glibc reserves 32 and 33 for itself; SIGRTMIN..=SIGRTMAX by number, as `kill -l` does.
        Err(_) if (32..=64).contains(&signal) => format!("SIGRT{signal}"),
        Err(_) => format!("signal {signal}"),
    }
}

/// How a process that is now a zombie ended, in words (`killed by SIGKILL`, `exited with status 1`),
/// from its wait status ([`crate::Stat::exit_code`] of a zombie, or a `waitpid` status).
pub fn describe_wait_status(status: i32) -> String {
    if libc::WIFSIGNALED(status) {
        let core = if libc::WCOREDUMP(status) {
            " (core dumped)"
        } else {
            ""
        };
        format!("killed by {}{core}", signal_name(libc::WTERMSIG(status)))
    } else {
        format!("exited with status {}", libc::WEXITSTATUS(status))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_status_words() {
        assert_eq!(describe_wait_status(9), "killed by SIGKILL");
        assert_eq!(describe_wait_status(1 << 8), "exited with status 1");
        assert_eq!(
            describe_wait_status(11 | 0x80),
            "killed by SIGSEGV (core dumped)"
        );
        assert_eq!(describe_wait_status(0), "exited with status 0");
    }

    #[test]
    fn names() {
        assert_eq!(signal_name(libc::SIGSEGV), "SIGSEGV");
        assert_eq!(signal_name(libc::SIGSTKFLT), "SIGSTKFLT");
        assert_eq!(signal_name(libc::SIGPWR), "SIGPWR");
        assert_eq!(signal_name(34), "SIGRT34");
        assert_eq!(signal_name(99), "signal 99");
        assert_eq!(signal_name(0), "signal 0");
    }
}
