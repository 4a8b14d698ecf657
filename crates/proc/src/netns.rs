//! Acting inside another process's network namespace: reaching an address (a TCP port on its
//! loopback, an abstract unix socket) that only exists there, as a worker restored into a
//! namespace of its own has.
//!
//! # Design
//! A socket belongs to the network namespace it was created in, whoever uses it afterwards. So
//! [`in_net_namespace_of`] runs the code that creates (and connects) it on a short-lived thread
//! that entered the namespace (`setns(2)` changes only the calling thread's), and hands the result
//! back; the caller's threads never change namespace. The namespace is entered through the
//! process's pidfd-checked `/proc/PID/ns/net` file, opened once.

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};

use crate::{same_namespace, NamespaceKind, Pid};

/// Runs `f` in the network namespace of process `pid` and returns its result: at once when that
/// is cryo's own, else on a thread that entered it (needs `CAP_SYS_ADMIN`).
pub fn in_net_namespace_of<T: Send>(
    pid: Pid,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    let me = Pid::try_from(std::process::id()).map_err(io::Error::other)?;
    if same_namespace(pid, me, NamespaceKind::Net).map_err(io::Error::other)? {
        return f();
    }
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    in_net_namespace(ns.as_fd(), f)
}

/// Runs `f` on a thread that entered the network namespace `ns` names (an nsfs file such as
/// `/proc/PID/ns/net`, or a process's pidfd: its namespace while it lives) and returns its
/// result; needs `CAP_SYS_ADMIN`.
pub fn in_net_namespace<T: Send>(
    ns: BorrowedFd<'_>,
    f: impl FnOnce() -> io::Result<T> + Send,
) -> io::Result<T> {
    std::thread::scope(|s| {
        s.spawn(move || {
            nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(io::Error::from)?;
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn our_own_namespace_runs_in_place() {
        let me = Pid::try_from(std::process::id()).unwrap();
        let here = std::thread::current().id();
        let ran_on = in_net_namespace_of(me, || Ok(std::thread::current().id())).unwrap();
        assert_eq!(ran_on, here);
    }
}
