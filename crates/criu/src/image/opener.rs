//! The thaw's first look at an image in a process of its own (the opener), for a command that
//! must be able to exit at its deadline (`cryo thaw`).
//!
//! # Why a process
//! A look at an image whose file system stops answering (a dead disk, an NFS hard mount, a FUSE
//! server) waits in the kernel uninterruptibly, SIGKILL included. On a thread of the deadline
//! layer ([`Image::open_until`]) the look is given up on at the deadline and the command refuses
//! then, but a process ends only once all its threads have: `cryo thaw` said its refusal and
//! stayed until the file system answered, and so did whatever waited for it (an operator's
//! script, a Kubernetes hook). In a child, the stuck look is the child's: cryo kills it (the kill
//! waits, pending, for the look to end), never waits for it, and exits; whoever inherits the
//! child reaps it once the file system answers.
//!
//! # The protocol
//! The opener is this very binary (`/proc/self/exe`, [`OPENER_ARG`], dispatched by
//! [`super::checker_main`] at the top of `main`), started with the image's path and cryo's pid.
//! It runs [`Image::open`] (trust, manifest, listing, sizes: the same code as in cryo), then
//! writes on its stdout, a pipe only it and cryo hold, one line (`{"opened":{"dir":FD,
//! "files":[FD...],"manifest":LEN}}`, or `{"refused":"why"}`) and, when opened, the manifest's
//! LEN bytes, and waits for its stdin to end. cryo takes those fds out of it with `pidfd_getfd`
//! through the pidfd opened at its spawn (its child, not reaped: the pid is still its, a zombie
//! too, as an opener that refused at once is), parses
//! the manifest itself (its own digest checked), checks that it got one file per manifest
//! entry, then ends the opener's stdin: it exits. The fds cryo holds are the open file
//! descriptions the opener checked, so what is restored is what was looked at, as with
//! [`Image::open`] in cryo's own process.
//!
//! # Limitations
//! Only the first look moves: the check's looks and CRIU's reads later are cryo's own (each under
//! the restore's deadline); a file system that stops answering after the first look still keeps
//! a `cryo thaw` that refused at its deadline from exiting until it answers. Used only where
//! this binary serves as the opener ([`super::checker::serves`]); elsewhere (a library's tests)
//! the look runs on the deadline layer in this process.

use std::ffi::OsString;
use std::io::{Read, Write};
use std::os::fd::RawFd;
use std::path::Path;
use std::process::{Command, ExitCode, Stdio};
use std::time::Instant;

use super::open::{parse_manifest, Image};
use super::{ImageError, MANIFEST_FILE};

/// The first argument that makes a `cryo` process the opener (see the module docs).
pub const OPENER_ARG: &str = "__cryo-image-opener";

/// What the opener says first.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Said {
    /// Opened: its fds of the directory and of each file (in the manifest's order), and the
    /// length of the manifest's bytes that follow.
    Opened {
        dir: RawFd,
        files: Vec<RawFd>,
        manifest: usize,
    },
    /// Refused: why, as [`Image::open`] said it.
    Refused(String),
}

/// The most the opener's first line may hold (a few fd numbers per file); more is not an
/// opener's.
const MAX_LINE: usize = 1 << 20;

/// The most a manifest may hold (a 100 TB image in 64 MiB chunks is ~100 MB of hashes: far
/// past any image cryo makes).
const MAX_MANIFEST: usize = 256 << 20;

/// [`Image::open`] in the opener (see the module docs), given up on at `deadline`: then
/// [`ImageError::Unanswered`], the opener killed and left to whoever inherits it.
pub(crate) fn open_apart(dir: &Path, deadline: Instant) -> Result<Image, ImageError> {
    let stream_err = |reason: String| ImageError::Stream {
        dir: dir.to_path_buf(),
        reason,
    };
    let mut child = Command::new("/proc/self/exe")
        .arg(OPENER_ARG)
        .arg(dir)
        .arg(std::process::id().to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| stream_err(format!("cannot start the image opener: {e}")))?;
    let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
    let pidfd = super::checker::pidfd_of_child(&mut child)
        .map_err(|e| stream_err(format!("no pidfd for the image opener: {e}")))?;
    let kill = || {
        let _ = rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::Kill);
    };
    let (Some(stdin), Some(mut stdout)) = (child.stdin.take(), child.stdout.take()) else {
        kill();
        let _ = child.wait();
        return Err(stream_err("the image opener has no pipes".into()));
    };
    let said = read_until(&mut stdout, deadline);
    let said = match said {
        Heard::Said(line, manifest) => (line, manifest),
        Heard::Late => {
            // Stuck in the file system (or slowed past the deadline): ended, never waited for.
            kill();
            tracing::warn!(
                image = %dir.display(),
                pid,
                "the image opener did not answer before the restore's deadline: killed and left to end when its file system answers"
            );
            return Err(ImageError::Unanswered {
                dir: dir.to_path_buf(),
                what: "opening the image and reading its manifest, in a process of its own".into(),
            });
        }
        Heard::Failed(why) => {
            kill();
            drop(stdin);
            let _ = child.wait();
            return Err(stream_err(format!("the image opener: {why}")));
        }
    };
    let taken = take(dir, &pidfd, said);
    // Its stdin ends: it exits (a refusal exited already).
    drop(stdin);
    let _ = child.wait();
    taken
}

/// What the opener's stdout gave.
enum Heard {
    /// Its first line and the manifest's bytes that followed (none after a refusal).
    Said(Vec<u8>, Vec<u8>),
    /// Nothing whole before the deadline.
    Late,
    /// It ended or said something no opener says.
    Failed(String),
}

/// Reads the opener's line and the manifest after it, until `deadline`.
fn read_until(stdout: &mut std::process::ChildStdout, deadline: Instant) -> Heard {
    let mut buf: Vec<u8> = Vec::new();
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        if let Some(end) = buf.iter().position(|b| *b == b'\n') {
            let wanted = match serde_json::from_slice::<Said>(&buf[..end]) {
                Ok(Said::Opened { manifest, .. }) if manifest <= MAX_MANIFEST => manifest,
                Ok(Said::Opened { manifest, .. }) => {
                    return Heard::Failed(format!("a manifest of {manifest} bytes"))
                }
                Ok(Said::Refused(_)) => 0,
                Err(e) => return Heard::Failed(format!("said something else: {e}")),
            };
            if buf.len() > end + 1 + wanted {
                return Heard::Failed("said more than its manifest".into());
            }
            if buf.len() == end + 1 + wanted {
                let manifest = buf.split_off(end + 1);
                buf.truncate(end);
                return Heard::Said(buf, manifest);
            }
        } else if buf.len() > MAX_LINE {
            return Heard::Failed("a line longer than an opener's".into());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let ms = i32::try_from(left.as_millis()).unwrap_or(i32::MAX);
        let mut fds = [rustix::event::PollFd::new(
            &*stdout,
            rustix::event::PollFlags::IN,
        )];
        match rustix::event::poll(&mut fds, ms) {
            Ok(0) => return Heard::Late,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Heard::Failed(format!("waiting for it: {e}")),
        }
        match stdout.read(&mut chunk) {
            Ok(0) => return Heard::Failed("it ended before it said what it opened".into()),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Heard::Failed(format!("reading what it said: {e}")),
        }
    }
}

/// The image the opener said it opened, its fds taken out of it; or its refusal.
fn take(
    dir: &Path,
    pidfd: &std::os::fd::OwnedFd,
    (line, manifest): (Vec<u8>, Vec<u8>),
) -> Result<Image, ImageError> {
    let stream_err = |reason: String| ImageError::Stream {
        dir: dir.to_path_buf(),
        reason,
    };
    let (dir_fd, files) = match serde_json::from_slice::<Said>(&line) {
        Ok(Said::Opened { dir, files, .. }) => (dir, files),
        Ok(Said::Refused(said)) => return Err(ImageError::RefusedApart { said }),
        Err(e) => return Err(stream_err(format!("the image opener said: {e}"))),
    };
    let manifest = parse_manifest(&dir.join(MANIFEST_FILE), &manifest)?;
    if files.len() != manifest.files.len() {
        return Err(stream_err(format!(
            "the image opener handed {} files for a manifest of {}",
            files.len(),
            manifest.files.len()
        )));
    }
    // Taken while it waits for its stdin to end: its fds are still the ones it said.
    let mut got = Vec::with_capacity(files.len() + 1);
    for fd in std::iter::once(dir_fd).chain(files.iter().copied()) {
        let taken =
            rustix::process::pidfd_getfd(pidfd, fd, rustix::process::PidfdGetfdFlags::empty())
                .map_err(|e| stream_err(format!("cannot take fd {fd} of the image opener: {e}")))?;
        got.push(taken);
    }
    let dir_fd = got.remove(0);
    let files = got.into_iter().map(std::fs::File::from).collect();
    Ok(Image::adopt_opened(
        dir.to_path_buf(),
        dir_fd,
        manifest,
        files,
    ))
}

/// The opener: `DIR PARENT` (see the module docs). Exit 0: opened and handed over; 1: refused
/// (said why); 2: unusable arguments or output; 3: cryo went away.
pub(super) fn child_main(args: Vec<OsString>) -> ExitCode {
    match opener(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cryo image opener: {e}");
            ExitCode::from(2)
        }
    }
}

fn opener(args: &[OsString]) -> Result<u8, String> {
    let (Some(dir), Some(parent)) = (args.first(), args.get(1)) else {
        return Err("usage: DIR PARENT".into());
    };
    let parent: i32 = parent
        .to_str()
        .and_then(|p| p.parse().ok())
        .ok_or("PARENT is not a pid")?;
    // Dies with cryo; and cryo must still be the one that started it.
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::Kill))
        .map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    if rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get()) != parent {
        return Ok(3);
    }
    let mut out = std::io::stdout().lock();
    let write = |out: &mut std::io::StdoutLock<'_>, bytes: &[u8]| {
        out.write_all(bytes)
            .and_then(|()| out.flush())
            .map_err(|e| format!("writing to cryo: {e}"))
    };
    let image = match Image::open(Path::new(dir)) {
        Ok(i) => i,
        Err(e) => {
            let mut line =
                serde_json::to_vec(&Said::Refused(e.to_string())).map_err(|e| e.to_string())?;
            line.push(b'\n');
            write(&mut out, &line)?;
            return Ok(1);
        }
    };
    let manifest = serde_json::to_vec(image.manifest()).map_err(|e| e.to_string())?;
    let (dir_fd, files) = image.raw_fds();
    let mut line = serde_json::to_vec(&Said::Opened {
        dir: dir_fd,
        files,
        manifest: manifest.len(),
    })
    .map_err(|e| e.to_string())?;
    line.push(b'\n');
    line.extend_from_slice(&manifest);
    write(&mut out, &line)?;
    // Held open until cryo has taken them: the end of stdin says so (or that cryo is gone).
    let mut rest = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut rest);
    drop(image);
    Ok(0)
}
