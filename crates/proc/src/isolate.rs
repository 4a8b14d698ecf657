//! Starting a process in fresh pid and network namespaces (`cryo run`), as a container runtime
//! does: it is pid 1 of its own pid namespace, session leader, with only a loopback interface
//! (up) in its own network namespace. CRIU restores such a tree into fresh namespaces again, so
//! several restores of one image (standbys) coexist with the same pids and ports inside.
//!
//! # Design
//! One `clone(CLONE_NEWPID | CLONE_NEWNET)`: the child is pid 1 of the new pid namespace from its
//! first instruction (no `unshare --fork` middleman in the tree). Between the clone and the
//! `execv` the child only makes system calls on what the parent prepared (no allocation): it
//! brings `lo` up (`SIOCSIFFLAGS`), calls `setsid`, changes directory, points its standard
//! files, restores the signal mask and execs. An `execv` that fails writes its errno into a
//! close-on-exec pipe, so the parent reports why (EOF on the pipe: the exec happened).
//!
//! # Limitations
//! As pid 1 of its namespace, the process ignores signals it installed no handler for (the
//! kernel's rule for an init), as in a container without an init process; SIGKILL from outside
//! always works. No user namespace, mount namespace or cgroup: root starts it, as root.

use std::ffi::{CString, OsString};
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use nix::sched::CloneFlags;
use nix::sys::signal::{SigSet, SigmaskHow};

use crate::Pid;

/// `spawn_isolated` did not start the process.
#[derive(Debug, thiserror::Error)]
pub enum IsolateError {
    /// No such program (not a path, not on `PATH`).
    #[error("{0}: no such program (not found on PATH)")]
    NotFound(String),
    /// An argument holds a NUL byte.
    #[error("argument {0:?} holds a NUL byte")]
    Nul(String),
    /// The clone failed (no privilege for new namespaces?).
    #[error("cannot make new pid and network namespaces (clone): {0}")]
    Clone(nix::Error),
    /// The pipe that reports a failed exec could not be made.
    #[error("cannot make a pipe: {0}")]
    Pipe(std::io::Error),
    /// The child could not run the program.
    #[error("cannot run {program} in the new namespaces: {step}: {error}")]
    Child {
        /// The program.
        program: String,
        /// What failed (`execv`, `setsid`, bringing up loopback...).
        step: &'static str,
        /// The errno.
        error: nix::Error,
    },
}

/// What to start.
#[derive(Debug, Clone)]
pub struct IsolatedCommand {
    /// The program and its arguments (`argv[0]` is looked up on `PATH` without a `/`).
    pub argv: Vec<OsString>,
    /// Its working directory.
    pub dir: PathBuf,
    /// Where its stdout and stderr go (`None`: inherited). Its stdin is `/dev/null`.
    pub log: Option<PathBuf>,
}

/// Starts `cmd` in fresh pid and network namespaces (see the module docs); returns its pid in
/// cryo's namespace. It is a child of the caller, who reaps it. The caller's signal mask is
/// the child's (restored to `mask` before the exec, when given).
pub fn spawn_isolated(cmd: &IsolatedCommand, mask: Option<&SigSet>) -> Result<Pid, IsolateError> {
    let name = cmd
        .argv
        .first()
        .map(|a| a.to_string_lossy().into_owned())
        .unwrap_or_default();
    let program = resolve(
        cmd.argv
            .first()
            .map(OsString::as_os_str)
            .unwrap_or_default(),
    )
    .ok_or_else(|| IsolateError::NotFound(name.clone()))?;
    let cstr = |b: &[u8]| {
        CString::new(b).map_err(|_| IsolateError::Nul(String::from_utf8_lossy(b).into_owned()))
    };
    let path = cstr(program.as_os_str().as_bytes())?;
    let argv: Vec<CString> = cmd
        .argv
        .iter()
        .map(|a| cstr(a.as_bytes()))
        .collect::<Result<_, _>>()?;
    let dir = cstr(cmd.dir.as_os_str().as_bytes())?;
    let null = File::open("/dev/null").map_err(IsolateError::Pipe)?;
    let log: Option<File> = match &cmd.log {
        Some(p) => Some(
            File::options()
                .create(true)
                .append(true)
                .open(p)
                .map_err(IsolateError::Pipe)?,
        ),
        None => None,
    };
    let (report_r, report_w): (OwnedFd, OwnedFd) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| IsolateError::Pipe(e.into()))?;
    let mask = mask.copied();
    let (null_fd, log_fd, report_fd) = (
        null.as_raw_fd(),
        log.as_ref().map(AsRawFd::as_raw_fd),
        report_w.as_raw_fd(),
    );
    let mut stack = vec![0u8; 256 * 1024];
    let child = move || -> isize {
        let fail = |step: u8, e: nix::Error| -> isize {
            let msg = [step, 0, 0, 0, 0];
            let mut msg = msg;
            msg[1..].copy_from_slice(&(e as i32).to_ne_bytes());
            let _ = crate::sys::write_all(report_fd, &msg);
            127
        };
        if let Err(e) = crate::sys::loopback_up() {
            return fail(1, e);
        }
        if let Err(e) = nix::unistd::setsid() {
            return fail(2, e);
        }
        if let Err(e) = nix::unistd::chdir(dir.as_c_str()) {
            return fail(3, e);
        }
        for (from, to) in [(Some(null_fd), 0), (log_fd, 1), (log_fd, 2)] {
            if let Some(from) = from {
                if let Err(e) = nix::unistd::dup2(from, to) {
                    return fail(4, e);
                }
            }
        }
        if let Some(m) = &mask {
            if let Err(e) = nix::sys::signal::sigprocmask(SigmaskHow::SIG_SETMASK, Some(m), None) {
                return fail(5, e);
            }
        }
        let e = match nix::unistd::execv(&path, &argv) {
            Err(e) => e,
            Ok(never) => match never {},
        };
        fail(6, e)
    };
    let pid = crate::sys::clone_child(
        Box::new(child),
        &mut stack,
        CloneFlags::CLONE_NEWPID | CloneFlags::CLONE_NEWNET,
    )
    .map_err(IsolateError::Clone)?;
    drop(report_w);
    drop((null, log));
    let mut msg = Vec::new();
    let _ = File::from(report_r).read_to_end(&mut msg);
    if msg.len() >= 5 {
        let step = match msg[0] {
            1 => "bringing up loopback",
            2 => "setsid",
            3 => "chdir",
            4 => "dup2",
            5 => "sigprocmask",
            _ => "execv",
        };
        let errno = i32::from_ne_bytes([msg[1], msg[2], msg[3], msg[4]]);
        // It exited (127): reaped here, the caller never sees it.
        let _ = nix::sys::wait::waitpid(nix::unistd::Pid::from_raw(pid), None);
        return Err(IsolateError::Child {
            program: name,
            step,
            error: nix::Error::from_raw(errno),
        });
    }
    Ok(pid)
}

/// `name` as `execvp` would find it: a name with a `/` as is, else the first executable file of
/// that name on `PATH`.
fn resolve(name: &std::ffi::OsStr) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    if name.is_empty() {
        return None;
    }
    let exec = |p: &Path| {
        std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
    };
    if name.as_bytes().contains(&b'/') {
        let p = PathBuf::from(name);
        return exec(&p).then_some(p);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| exec(p))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_program_that_is_nowhere_is_refused_before_any_clone() {
        let cmd = IsolatedCommand {
            argv: vec!["cryo-no-such-program-anywhere".into()],
            dir: "/".into(),
            log: None,
        };
        assert!(matches!(
            spawn_isolated(&cmd, None),
            Err(IsolateError::NotFound(_))
        ));
    }
}
