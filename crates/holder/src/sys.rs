//! The holder's raw system calls: the only `unsafe` of the crate.

use std::io;

/// Signals whose default action does not end the process (or that cannot be caught): left as
/// they are. `SIGCHLD`, `SIGURG` and `SIGWINCH` are ignored by default; `SIGCONT` continues;
/// `SIGKILL` and `SIGSTOP` cannot be caught or ignored.
const LEFT_ALONE: [i32; 6] = [
    libc::SIGKILL,
    libc::SIGSTOP,
    libc::SIGCHLD,
    libc::SIGCONT,
    libc::SIGURG,
    libc::SIGWINCH,
];

/// Every signal whose default action ends or stops the process: the classic ones, then
/// `SIGRTMIN..=SIGRTMAX` (all terminate by default).
pub fn killing_signals() -> Vec<i32> {
    (1..=libc::SIGRTMAX())
        .filter(|s| !LEFT_ALONE.contains(s))
        // 32 and 33 are glibc's own (thread cancellation, setxid): not in SIGRTMIN's range and
        // not usable by programs.
        .filter(|s| *s < 32 || *s >= libc::SIGRTMIN())
        .collect()
}

/// Sets `SIG_IGN` for every signal of [`killing_signals`]: a signal sent to the holder is then
/// discarded by the kernel. (A real fault, a SIGSEGV raised by the holder's own code, is still
/// fatal: the kernel restores the default action for it.) Returns the signals that could not be
/// ignored, with why.
pub fn ignore_killing_signals() -> Vec<(i32, io::Error)> {
    let mut failed = Vec::new();
    for sig in killing_signals() {
        // SAFETY: sigaction is plain data; all-zero is "no flags, empty mask"; SIG_IGN is a valid
        // disposition for every signal but SIGKILL and SIGSTOP, which are not in the list.
        let ret = unsafe {
            let mut act: libc::sigaction = std::mem::zeroed();
            act.sa_sigaction = libc::SIG_IGN;
            libc::sigaction(sig, &act, std::ptr::null_mut())
        };
        if ret != 0 {
            failed.push((sig, io::Error::last_os_error()));
        }
    }
    failed
}

/// The number of threads of this process.
fn threads() -> Option<u64> {
    let me = cryo_proc::Pid::try_from(std::process::id()).ok()?;
    cryo_proc::status(me).ok().map(|s| s.threads)
}

/// What [`fork`] returned.
#[derive(Debug)]
pub enum Forked {
    /// In the parent: the child's pid.
    Parent(i32),
    /// In the child.
    Child,
}

/// `fork()`, only while this process has a single thread (a forked multi-threaded process may
/// deadlock on a lock another thread held).
pub fn fork() -> io::Result<Forked> {
    if threads() != Some(1) {
        return Err(io::Error::other(
            "cannot fork: the process has more than one thread",
        ));
    }
    // SAFETY: the process has one thread (checked above), so the child inherits no lock held by
    // another thread and may run any code.
    match unsafe { nix::unistd::fork() }.map_err(io::Error::from)? {
        nix::unistd::ForkResult::Parent { child } => Ok(Forked::Parent(child.as_raw())),
        nix::unistd::ForkResult::Child => Ok(Forked::Child),
    }
}
