//! The thaw's check of the page contents in a process of its own (the checker), so that on a
//! host with few cores it takes only the CPU CRIU's restorer leaves while CRIU restores, and all
//! of it once CRIU waits at its gate.
//!
//! # Why a process
//! With autogroups on (`/proc/sys/kernel/sched_autogroup_enabled`, for tasks in the root cpu
//! cgroup), the scheduler shares the CPUs between
//! sessions first: CRIU's restored tree is a session of its own (CRIU's `setsid`), the check's
//! threads run in cryo's. On two cores under load the check's session took the restorer's
//! CPU (its run-queue wait 1557 ms against 315 in the bare route, 4 GiB from the page cache,
//! session 14), and no thread-level priority changes a session's share (`SCHED_IDLE` on the
//! check's threads: measured, no change). A process in a session of its own has a group of its
//! own, whose share its nice value sets (`/proc/PID/autogroup`): nice 19 while CRIU restores
//! (weight 15 against the restorer's 1024: it runs on what the restorer and the host's other
//! sessions leave), nice 0 from CRIU's gate on, with as many threads as the host has cores (the
//! restorer waits at the gate then; what is left of the check is all that stands between it and
//! the tree's start); one that starves before the gate is raised then ([`Parent::watch`]).
//! Where autogroups do not apply (a container, a systemd unit with CPU accounting: the cpu
//! cgroup's weight decides) the nice value changes nothing. Measured slower than the threads
//! under load on this project's host, it is used only when asked for ([`plan`]).
//!
//! # The child's safety
//! The checker is this very binary (`/proc/self/exe`, [`checker_main`] at the top of its
//! `main`), started with the checked image directory's fd (inherited under the same number, as
//! CRIU gets it) and the manifest on its stdin; it opens each file through that fd with the
//! same trust checks as cryo ([`Image::open_file`]). It passes the image only by exiting 0 after
//! writing `ok <the manifest's digest>` on its stdout, a pipe only it holds: a checker that dies,
//! is killed, exits otherwise or says anything else is a refused image; so is one that has not
//! ended by the restore's deadline (then it is killed through the pidfd taken at its spawn). A
//! line written into its pipe by another process (root can open `/proc/PID/fd/1`) cannot pass
//! an image: its exit status is the kernel's word, and only its own `exit(0)` after a passing
//! check makes it. It dies with cryo (`PR_SET_PDEATHSIG`), and exits at once when its stdin
//! ends (cryo gone or no longer waiting). Its session and autogroup only set how fast it
//! checks, never what it decides: a checker slowed down by someone (its autogroup niced) is
//! waited for until the deadline, and refused past it.
//!
//! `PR_SET_PDEATHSIG` fires when the *thread* that spawned the helper ends, not cryo's process.
//! Both helpers (the checker in [`Parent::run`], the opener in `opener::open_apart`) are spawned
//! and waited for on one thread, which returns only once it has the helper's answer or gave up
//! on it (and killed it): the signal cannot come while cryo still needs the helper, from
//! whichever thread (a thaw's scoped thread in the agent, the CLI's main thread). What ends a
//! helper when cryo's process ends, whatever thread spawned it, is its stdin: the last holder
//! of the pipe's other end is gone. A caller that spawned a helper on one thread and waited for
//! it on another would have it killed early: keep the two on one thread.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::process::{ChildStdin, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex};

use super::check::{check_threads, is_page_contents, CHECK_THREADS};
use super::hash::{check_span, Span, SpanError};
use super::open::{spans, Image};
use super::ImageError;

/// The first argument that makes a `cryo` process the checker ([`checker_main`]).
pub const CHECKER_ARG: &str = "__cryo-image-checker";

/// Failpoint (`CRYO_FAILPOINT`, as cryo's others): the checker checked every chunk and pauses
/// before its verdict until the file named by `CRYO_FAILPOINT_RESUME` exists (forever without
/// one), so that tests can kill it, or write into its verdict pipe, at that point.
pub const CHECKER_BEFORE_VERDICT: &str = "image-checker-before-verdict";

/// `CRYO_THAW_CHECKER=child` checks in the checker process (where this binary serves as one);
/// unset, on threads ([`plan`]).
pub const CHECKER_ENV: &str = "CRYO_THAW_CHECKER";

/// The nice value of the checker's autogroup while CRIU restores.
pub const BACKGROUND_NICE: i32 = 19;

/// Whether this binary serves as the checker (its `main` called [`checker_main`]).
static SERVES: AtomicBool = AtomicBool::new(false);

/// The checker's entry point, called first thing in `main` by a binary that can be the checker
/// (`cryo`): `Some(exit code)` when this process was started as the checker (it did its work),
/// `None` otherwise (go on; the thaws of this process may then use a checker).
/// The opener of a thaw's first look ([`super::opener`], [`super::OPENER_ARG`]) starts here too.
pub fn checker_main() -> Option<ExitCode> {
    let mut args = std::env::args_os().skip(1);
    match args.next() {
        Some(a) if a == CHECKER_ARG => Some(child_main(args.collect())),
        Some(a) if a == super::OPENER_ARG => Some(super::opener::child_main(args.collect())),
        _ => {
            SERVES.store(true, Relaxed);
            None
        }
    }
}

/// How a thaw checks the page contents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// On this many threads of cryo's own, at the normal priority.
    Threads(usize),
    /// In a checker process whose autogroup is niced to [`BACKGROUND_NICE`] while CRIU
    /// restores (one thread), and raised to 0 with `at_gate` threads at CRIU's gate.
    Child {
        /// Threads once CRIU waits at its gate.
        at_gate: usize,
    },
}

/// How to check on a host of `cores` where this binary serves as the checker or not
/// (`checker`): on threads of cryo's own ([`check_threads`]) unless `CRYO_THAW_CHECKER=child`
/// ([`CHECKER_ENV`]) asks for the checker process. Why the threads stay the default: on this
/// project's 2-core host under load the checker made the thaw slower, not faster (issue 16,
/// session 15, thaw-only A/B against the threads, interleaved: 4 GiB from the page cache, 5
/// rounds, load 5-7: CRIU's step 1.13x and the first answer 1.15x the threads' median, the niced
/// checker hashing nothing before the gate and 1.7-2.6 s after it; with the starvation raise
/// ([`Parent::watch`]), 2 GiB, 5 rounds, load 7-8: first answer 1.17x). When every session is
/// busy, a niced group gets no CPU until it is raised and then only its group's share, while
/// the check on threads takes its session's share from the start: the thaw as a whole gets more
/// of the host. The checker can only win where the restorer leaves idle CPU, which was not
/// measured here (the host was never quiet); it stays for that measurement.
pub(crate) fn plan(cores: usize, checker: bool) -> Plan {
    if checker && std::env::var(CHECKER_ENV).is_ok_and(|v| v == "child") {
        return Plan::Child {
            at_gate: cores.clamp(1, CHECK_THREADS),
        };
    }
    Plan::Threads(check_threads(cores))
}

/// Whether this binary serves as the checker ([`checker_main`] ran in it).
pub(crate) fn serves() -> bool {
    SERVES.load(Relaxed)
}

/// A running checker, as the gate needs it: to raise it, or end it.
#[derive(Debug)]
struct Running {
    pid: i32,
    /// Taken at its spawn, before anything could reap it.
    pidfd: OwnedFd,
    /// Its stdin: a line `g` asks for the gate's threads; its end ends the checker.
    stdin: ChildStdin,
}

/// The parent's side of one checker.
#[derive(Debug, Default)]
pub(crate) struct Parent {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// CRIU reached its gate (or ended): the checker runs at full speed from then on.
    raised: bool,
    /// Given up on: a checker started after this is ended at once.
    ended: bool,
    running: Option<Running>,
    /// Written by [`Parent::end`]: wakes [`Parent::run`] from its wait for the verdict.
    wake: Option<Arc<OwnedFd>>,
}

impl Parent {
    /// Runs the checker on `image`'s page contents and returns its verdict (after it exited),
    /// or gives up on it at `deadline` or when [`Parent::end`] is called: a checker stuck in a
    /// read that never returns (a hung disk, a FUSE server that stopped answering) waits there
    /// uninterruptibly, SIGKILL included, and keeps its end of the verdict pipe open, so neither
    /// its verdict nor its exit is waited for then: it is killed and handed to the reaper of the
    /// restore's stuck processes ([`crate::criu::reap_stuck_later`]), reaped whenever it ends.
    pub(crate) fn run(
        &self,
        image: &Image,
        at_gate: usize,
        deadline: Option<std::time::Instant>,
    ) -> Result<(), ImageError> {
        let stream_err = |reason: String| ImageError::Stream {
            dir: image.path().to_path_buf(),
            reason,
        };
        let wake = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)
            .map(Arc::new)
            .map_err(|e| stream_err(format!("no eventfd to wait for the image checker: {e}")))?;
        let fd = image.dir_fd().as_raw_fd();
        let mut cmd = Command::new("/proc/self/exe");
        cmd.arg(CHECKER_ARG)
            .arg(fd.to_string())
            .arg(at_gate.to_string())
            .arg(std::process::id().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        super::inherit_fd(&mut cmd, fd);
        super::sys::new_session(&mut cmd);
        let mut child = cmd
            .spawn()
            .map_err(|e| stream_err(format!("cannot start the image checker: {e}")))?;
        let pid = i32::try_from(child.id()).unwrap_or(i32::MAX);
        let (Some(mut stdin), Some(stdout)) = (child.stdin.take(), child.stdout.take()) else {
            let _ = child.kill();
            let _ = child.wait();
            return Err(stream_err("the image checker has no pipes".into()));
        };
        let pidfd = pidfd_of_child(&mut child)
            .map_err(|e| stream_err(format!("no pidfd for the image checker: {e}")))?;
        let manifest = serde_json::to_vec(image.manifest()).map_err(ImageError::Serialize);
        let sent = manifest.and_then(|mut m| {
            m.push(b'\n');
            stdin
                .write_all(&m)
                .map_err(|e| stream_err(format!("cannot give the image checker its manifest: {e}")))
        });
        {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            st.wake = Some(Arc::clone(&wake));
            let running = Running { pid, pidfd, stdin };
            if st.ended || sent.is_err() {
                kill(&running);
            } else if st.raised {
                raise(&running);
            } else if let Err(e) = set_autogroup_nice(pid, BACKGROUND_NICE) {
                tracing::debug!(pid, error = %e, "the image checker runs at the normal priority");
            }
            st.running = Some(running);
        }
        // Its verdict is one short line; more is not a checker's. Meanwhile it is watched for
        // starving (see `Parent::watch`).
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let said = std::thread::scope(|s| {
            s.spawn(move || self.watch(pid, &stopped));
            let said = read_verdict(stdout, &wake, deadline);
            drop(stop);
            said
        });
        // Its stdout ended (it exited), or it was given up on. Forgotten before it is reaped,
        // so that nothing is asked of its pid afterwards (the pid is ours until the wait).
        let ended = {
            let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            let running = st.running.take();
            if let (Said::GivenUp, Some(r)) = (&said, &running) {
                kill(r);
            }
            st.wake = None;
            st.ended
        };
        if let Said::GivenUp = said {
            leave(child, pid);
            sent?;
            return Err(stream_err(if ended {
                "the image checker was ended: the check did not end before the restore's deadline"
                    .into()
            } else {
                "the image checker gave no verdict before the restore's deadline (a read that never returns?): it was ended and left".into()
            }));
        }
        let status = child.wait();
        sent?;
        if ended {
            return Err(stream_err(
                "the image checker was ended: the check did not end before the restore's deadline"
                    .into(),
            ));
        }
        let Said::Verdict(read, said) = said else {
            return Err(stream_err("the image checker's verdict was lost".into()));
        };
        let status =
            status.map_err(|e| stream_err(format!("cannot wait for the image checker: {e}")))?;
        if let Err(e) = read {
            return Err(stream_err(format!(
                "reading the image checker's verdict: {e}"
            )));
        }
        verdict(image, said.trim_end(), status).map_err(|reason| match reason {
            Verdict::Refused(e) => e,
            Verdict::NoVerdict(why) => stream_err(why),
        })
    }

    /// Raises the checker (nice 0, no more threads) when it starves before the gate: when in
    /// a window of [`STARVE_WINDOW`] it got less than [`STARVE_SHARE`] of a core, the host's
    /// other sessions leave the restorer no idle CPU, and a check left for after the gate would
    /// be all on the thaw's path (measured: 4 GiB from the page cache, load 4-5, the niced
    /// checker hashed nothing before the gate and 1.7-2.6 s after it); at nice 0 it takes its
    /// session's share beside the restorer, as the threads of old did. Ends when `stop` does.
    fn watch(&self, pid: i32, stop: &std::sync::mpsc::Receiver<()>) {
        let mut last = (std::time::Instant::now(), cpu_ticks(pid));
        loop {
            match stop.recv_timeout(STARVE_WINDOW) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                _ => return,
            }
            let st = self.state.lock().unwrap_or_else(|p| p.into_inner());
            if st.raised || st.running.is_none() {
                return;
            }
            let now = (std::time::Instant::now(), cpu_ticks(pid));
            let (Some(before), Some(after)) = (last.1, now.1) else {
                return;
            };
            let ticks = rustix::param::clock_ticks_per_second() as f64;
            let share = (after.saturating_sub(before) as f64 / ticks)
                / now.0.duration_since(last.0).as_secs_f64().max(1e-3);
            if share < STARVE_SHARE {
                if let Some(r) = &st.running {
                    tracing::debug!(pid, share, "the image checker starves: raised");
                    if let Err(e) = set_autogroup_nice(r.pid, 0) {
                        tracing::warn!(pid, error = %e, "cannot raise the image checker's priority");
                    }
                }
                return;
            }
            drop(st);
            last = now;
        }
    }

    /// CRIU reached its gate (or ended): the checker gets its share back and more threads.
    pub(crate) fn raise(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        if st.raised {
            return;
        }
        st.raised = true;
        if let Some(r) = &mut st.running {
            raise(r);
        }
    }

    /// Ends the checker (the restore gave up on it), and [`Parent::run`]'s wait for it; one
    /// started later is ended at once.
    pub(crate) fn end(&self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.ended = true;
        if let Some(r) = &st.running {
            kill(r);
        }
        if let Some(w) = &st.wake {
            if let Err(e) = rustix::io::write(&**w, &1u64.to_ne_bytes()) {
                tracing::debug!(error = %e, "waking the wait for the image checker");
            }
        }
    }
}

/// What the checker said, or that it was given up on before its stdout ended.
enum Said {
    /// Its stdout ended (or said more than a verdict): what it said, and how the read went.
    Verdict(std::io::Result<()>, String),
    /// [`Parent::end`] was called, or the deadline passed, first.
    GivenUp,
}

/// Reads the checker's stdout to its end (4096 bytes at most: a verdict is one short line),
/// unless `wake` is written or `deadline` passes first.
fn read_verdict(
    mut stdout: std::process::ChildStdout,
    wake: &OwnedFd,
    deadline: Option<std::time::Instant>,
) -> Said {
    use rustix::event::{poll, PollFd, PollFlags};
    let mut said = Vec::new();
    let mut buf = [0u8; 512];
    let read = loop {
        let ms = deadline.map_or(-1, |d| {
            let left = d.saturating_duration_since(std::time::Instant::now());
            i32::try_from(left.as_millis().max(1)).unwrap_or(i32::MAX)
        });
        if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
            return Said::GivenUp;
        }
        let mut fds = [
            PollFd::new(&stdout, PollFlags::IN),
            PollFd::new(wake, PollFlags::IN),
        ];
        match poll(&mut fds, ms) {
            Ok(_) | Err(rustix::io::Errno::INTR) => {}
            Err(e) => break Err(e.into()),
        }
        if !fds[1].revents().is_empty() {
            return Said::GivenUp;
        }
        if fds[0].revents().is_empty() {
            continue;
        }
        match stdout.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => {
                said.extend_from_slice(&buf[..n]);
                if said.len() >= 4096 {
                    break Ok(());
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => break Err(e),
        }
    };
    let said = String::from_utf8(said);
    match (read, said) {
        (Ok(()), Ok(s)) => Said::Verdict(Ok(()), s),
        (Err(e), s) => Said::Verdict(Err(e), s.unwrap_or_default()),
        (Ok(()), Err(e)) => Said::Verdict(
            Err(std::io::Error::new(std::io::ErrorKind::InvalidData, e)),
            String::new(),
        ),
    }
}

/// A checker given up on (killed already): reaped now if it ended, else handed to the reaper
/// of the restore's stuck processes, which reaps it whenever it ends.
fn leave(mut child: std::process::Child, pid: i32) {
    match cryo_proc::ProcHandle::open(pid) {
        Ok(h) => {
            if !crate::criu::reap_stuck_later(vec![h]) {
                tracing::warn!(
                    pid,
                    "the image checker given up on stays a zombie once it ends"
                );
            }
        }
        // Ended already (a zombie, ours to reap: the wait returns at once).
        Err(_) => {
            let _ = child.wait();
        }
    }
}

fn raise(r: &Running) {
    if let Err(e) = set_autogroup_nice(r.pid, 0) {
        tracing::warn!(pid = r.pid, error = %e, "cannot raise the image checker's priority");
    }
    let mut stdin = &r.stdin;
    if let Err(e) = stdin.write_all(b"g\n") {
        tracing::debug!(pid = r.pid, error = %e, "the image checker did not take its threads");
    }
}

fn kill(r: &Running) {
    if let Err(e) = rustix::process::pidfd_send_signal(&r.pidfd, rustix::process::Signal::Kill) {
        tracing::debug!(pid = r.pid, error = %e, "ending the image checker");
    }
}

/// How long the checker is watched for starving at a time ([`Parent::watch`]).
const STARVE_WINDOW: std::time::Duration = std::time::Duration::from_millis(250);

/// The share of a core under which the background checker starves ([`Parent::watch`]).
const STARVE_SHARE: f64 = 0.25;

/// CPU time of process `pid` so far (all its threads), clock ticks.
fn cpu_ticks(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let mut f = stat.rsplit_once(')')?.1.split_whitespace().skip(11);
    Some(f.next()?.parse::<u64>().ok()? + f.next()?.parse::<u64>().ok()?)
}

/// Sets the nice value of the autogroup of `pid` (its session's scheduling group).
fn set_autogroup_nice(pid: i32, nice: i32) -> std::io::Result<()> {
    std::fs::write(format!("/proc/{pid}/autogroup"), format!("{nice}\n"))
}

/// Why a checker's exit does not pass the image.
#[derive(Debug)]
enum Verdict {
    /// It refused the image, for this reason.
    Refused(ImageError),
    /// It ended without a verdict that passes: the image is refused all the same.
    NoVerdict(String),
}

/// The checker's verdict from what it said (`said`, its stdout) and how it exited: only an
/// exit 0 after `ok <the manifest's digest>` passes.
fn verdict(image: &Image, said: &str, status: std::process::ExitStatus) -> Result<(), Verdict> {
    let ok = format!("ok {}", image.manifest().manifest_sha256);
    if status.success() && said == ok {
        return Ok(());
    }
    if status.code() == Some(1) {
        if let Some(e) = said.strip_prefix("refused ").and_then(parse_refusal) {
            let spans = page_spans(image);
            if let Some(s) = spans.get(e.0) {
                return Err(Verdict::Refused(image.span_error(s, e.1)));
            }
        }
    }
    let status = match status.code() {
        Some(c) => format!("exit code {c}"),
        None => {
            use std::os::unix::process::ExitStatusExt;
            cryo_proc::describe_wait_status(status.into_raw())
        }
    };
    Err(Verdict::NoVerdict(format!(
        "the image checker ended without passing the image ({status}; it said {said:?})"
    )))
}

/// The spans the checker checks: every chunk of the page contents, in the manifest's order.
fn page_spans(image: &Image) -> Vec<Span<'_>> {
    spans(image.manifest())
        .into_iter()
        .filter(|s| is_page_contents(&image.manifest().files[s.file].name))
        .collect()
}

/// `SPAN KIND [DETAIL]` of a `refused` line.
fn parse_refusal(s: &str) -> Option<(usize, SpanError)> {
    let mut w = s.splitn(3, ' ');
    let span = w.next()?.parse().ok()?;
    let e = match (w.next()?, w.next()) {
        ("mismatch", None) => SpanError::Mismatch,
        ("long", None) => SpanError::Long,
        ("short", Some(found)) => SpanError::Short {
            found: found.parse().ok()?,
        },
        ("io", Some(msg)) => SpanError::Io(std::io::Error::other(msg.to_string())),
        _ => return None,
    };
    Some((span, e))
}

fn refusal(span: usize, e: &SpanError) -> String {
    match e {
        SpanError::Mismatch => format!("refused {span} mismatch"),
        SpanError::Long => format!("refused {span} long"),
        SpanError::Short { found } => format!("refused {span} short {found}"),
        SpanError::Io(e) => format!("refused {span} io {}", e.to_string().replace('\n', " ")),
    }
}

/// The checker: `DIRFD AT_GATE PARENT` (see the module docs). Exit 0: passed (after `ok DIGEST`
/// on stdout); 1: refused (`refused SPAN KIND...`); 2: unusable arguments or input; 3: cryo went
/// away before the verdict.
fn child_main(args: Vec<OsString>) -> ExitCode {
    match checker(&args) {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("cryo image checker: {e}");
            ExitCode::from(2)
        }
    }
}

fn checker(args: &[OsString]) -> Result<u8, String> {
    let arg = |i: usize| -> Result<i64, String> {
        args.get(i)
            .and_then(|a| a.to_str())
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| format!("argument {} missing or not a number", i + 1))
    };
    let (fd, at_gate, parent) = (arg(0)?, arg(1)?, arg(2)?);
    // Dies with cryo; and cryo must still be the one that started it (it may have died
    // before the line above ran).
    rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::Kill))
        .map_err(|e| format!("PR_SET_PDEATHSIG: {e}"))?;
    if i64::from(rustix::process::getppid().map_or(0, |p| p.as_raw_nonzero().get())) != parent {
        return Ok(3);
    }
    let fd = i32::try_from(fd).map_err(|_| "no such fd".to_string())?;
    let dir = super::sys::adopt_inherited(fd).map_err(|e| format!("the image directory: {e}"))?;
    let mut stdin = BufReader::new(std::io::stdin());
    let mut line = Vec::new();
    stdin
        .read_until(b'\n', &mut line)
        .map_err(|e| format!("reading the manifest: {e}"))?;
    let path = PathBuf::from(format!("/proc/self/fd/{fd}"));
    let manifest = super::open::parse_manifest(&path.join(super::MANIFEST_FILE), &line)
        .map_err(|e| e.to_string())?;
    let image = Image::adopt(path, dir, manifest);
    let spans = page_spans(&image);
    let work = Arc::new(Work::default());
    let at_gate = usize::try_from(at_gate)
        .unwrap_or(1)
        .clamp(1, CHECK_THREADS);
    std::thread::scope(|s| {
        let image = &image;
        let spans = &spans;
        s.spawn(|| work.check(image, spans));
        // Waits for `g` (CRIU at its gate: more threads) or the end of stdin (cryo gone or no
        // longer waiting: the checker ends at once, without a verdict).
        let grow = std::thread::Builder::new().spawn({
            let work = Arc::clone(&work);
            move || {
                let mut line = String::new();
                match stdin.read_line(&mut line) {
                    Ok(n) if n > 0 && line.trim() == "g" => work.grow(at_gate.saturating_sub(1)),
                    _ => std::process::exit(3),
                }
                // Nothing else is said; its end still ends the checker.
                let mut rest = Vec::new();
                let _ = stdin.read_to_end(&mut rest);
                std::process::exit(3);
            }
        });
        if let Err(e) = grow {
            eprintln!("cryo image checker: no thread for cryo's requests: {e}");
        }
        work.wait(spans.len());
        // More threads were asked for while the first one worked: they run here.
        let extra = work.extra.swap(0, Relaxed);
        for _ in 0..extra {
            s.spawn(|| work.check(image, spans));
        }
        work.wait(spans.len());
    });
    pause_before_verdict();
    let mut out = std::io::stdout().lock();
    let failure = work
        .failure
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .take();
    let (line, code) = match failure {
        None => (format!("ok {}\n", image.manifest().manifest_sha256), 0),
        Some((i, e)) => (format!("{}\n", refusal(i, &e)), 1),
    };
    out.write_all(line.as_bytes())
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing the verdict: {e}"))?;
    Ok(code)
}

/// The checker's shared work: the next span to take, how many are done, the first failure.
#[derive(Default)]
struct Work {
    next: AtomicUsize,
    done: Mutex<usize>,
    changed: Condvar,
    failure: Mutex<Option<(usize, SpanError)>>,
    /// Threads asked for but not started yet.
    extra: AtomicUsize,
    /// Asked for more threads: [`Work::wait`] returns to start them.
    grown: AtomicBool,
}

impl Work {
    /// Checks spans, each the next not taken, until none is left or one failed.
    fn check(&self, image: &Image, spans: &[Span<'_>]) {
        let mut buf = vec![0u8; super::hash::BUF];
        let mut cur: Option<(usize, std::fs::File)> = None;
        loop {
            let i = self.next.fetch_add(1, Relaxed);
            let Some(sp) = spans.get(i) else { return };
            if self.failed() {
                return;
            }
            if cur.as_ref().map(|c| c.0) != Some(sp.file) {
                cur = match image.open_file(sp.file) {
                    Ok((f, _)) => Some((sp.file, f)),
                    Err(e) => {
                        self.fail(i, SpanError::Io(std::io::Error::other(e.to_string())));
                        return;
                    }
                };
            }
            let Some((_, f)) = &cur else { return };
            if let Err(e) = check_span(f, sp, image.alg(), &mut buf) {
                self.fail(i, e);
                return;
            }
            let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
            *done += 1;
            self.changed.notify_all();
        }
    }

    fn failed(&self) -> bool {
        self.failure
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .is_some()
    }

    fn fail(&self, i: usize, e: SpanError) {
        let mut f = self.failure.lock().unwrap_or_else(|p| p.into_inner());
        if f.as_ref().is_none_or(|(j, _)| i < *j) {
            *f = Some((i, e));
        }
        drop(f);
        let _done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        self.changed.notify_all();
    }

    /// Asks for `n` more threads.
    fn grow(&self, n: usize) {
        self.extra.fetch_add(n, Relaxed);
        self.grown.store(true, Relaxed);
        let _done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        self.changed.notify_all();
    }

    /// Waits until all `total` spans are done, one failed, or more threads were asked for.
    fn wait(&self, total: usize) {
        let mut done = self.done.lock().unwrap_or_else(|p| p.into_inner());
        while *done < total && !self.failed() && !self.grown.swap(false, Relaxed) {
            done = self.changed.wait(done).unwrap_or_else(|p| p.into_inner());
        }
    }
}

/// [`CHECKER_BEFORE_VERDICT`]: waits until the resume file exists (forever without one).
fn pause_before_verdict() {
    if std::env::var("CRYO_FAILPOINT").ok().as_deref() != Some(CHECKER_BEFORE_VERDICT) {
        return;
    }
    let resume = std::env::var_os("CRYO_FAILPOINT_RESUME").map(PathBuf::from);
    eprintln!(
        "cryo: failpoint {CHECKER_BEFORE_VERDICT} reached in the image checker (pid {}); paused \
         (CRYO_FAILPOINT is a test hook)",
        std::process::id()
    );
    loop {
        if resume.as_ref().is_some_and(|r| r.exists()) {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// A pidfd for `child`, a child of ours not waited for yet (the pid is still its, a zombie too:
/// a child that refused at once may have exited already). When none can be had the child is
/// killed and reaped: a helper process cryo cannot kill by pidfd is not left behind.
pub(super) fn pidfd_of_child(child: &mut std::process::Child) -> std::io::Result<OwnedFd> {
    rustix::process::pidfd_open(
        rustix::process::Pid::from_child(child),
        rustix::process::PidfdFlags::empty(),
    )
    .map_err(|e| {
        let _ = child.kill();
        let _ = child.wait();
        std::io::Error::from(e)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The threads unless the checker is asked for and this binary serves as one.
    #[test]
    fn the_checker_only_when_asked_for_and_served() {
        assert_eq!(plan(2, true), Plan::Threads(1));
        assert_eq!(plan(64, true), Plan::Threads(CHECK_THREADS));
        // nextest runs each test in a process of its own.
        std::env::set_var(CHECKER_ENV, "child");
        assert_eq!(plan(2, true), Plan::Child { at_gate: 2 });
        assert_eq!(
            plan(64, true),
            Plan::Child {
                at_gate: CHECK_THREADS
            }
        );
        assert_eq!(plan(2, false), Plan::Threads(1));
        std::env::remove_var(CHECKER_ENV);
    }

    /// An image of one page file (`pages`) and one core file (`core`), published under `parent`.
    fn image_of(parent: &std::path::Path, name: &str, pages: &[u8], core: &[u8]) -> Image {
        let dir = parent.join(name);
        let st = crate::image::Staging::create(&dir).unwrap();
        std::fs::write(st.path().join("pages-1.img"), pages).unwrap();
        std::fs::write(st.path().join("core-7.img"), core).unwrap();
        let meta = crate::image::ImageMeta {
            root_pid: 7,
            processes: vec![crate::image::ProcessEntry {
                pid: 7,
                ppid: 1,
                comm: "w".into(),
                cmdline: vec!["w".into()],
                nspid: vec![7],
                gpu: None,
            }],
            zombies: Vec::new(),
            threads: Vec::new(),
            gpu_model: None,
            driver_version: None,
            criu_version: crate::CriuVersion {
                major: 4,
                minor: 2,
                sublevel: 0,
            },
            shrunk: None,
        };
        st.publish(meta, false).unwrap();
        Image::open(&dir).unwrap()
    }

    /// A checker handed another manifest than the image's (here one whose page contents are the
    /// image's very bytes, so its check passes: only the core file differs) says `ok` with that
    /// manifest's digest and exits 0: the image is refused all the same. Only the digest of the
    /// image's own manifest passes it.
    #[test]
    fn a_checker_that_checked_another_manifest_does_not_pass_the_image() {
        use std::os::unix::process::ExitStatusExt;
        let t = tempfile::tempdir().unwrap();
        let pages = vec![3u8; 70_000];
        let image = image_of(t.path(), "a", &pages, b"core of a");
        let other = image_of(t.path(), "b", &pages, b"core of b");
        let (mine, theirs) = (
            &image.manifest().manifest_sha256,
            &other.manifest().manifest_sha256,
        );
        assert_ne!(mine, theirs);
        let exited_0 = std::process::ExitStatus::from_raw(0);
        match verdict(&image, &format!("ok {theirs}"), exited_0) {
            Err(Verdict::NoVerdict(why)) => assert!(why.contains("without passing"), "{why}"),
            other => panic!("another manifest's ok passed or was misread: {other:?}"),
        }
        // The same words with the image's own digest pass; and the right words with another
        // exit, or more said after them, do not.
        assert!(verdict(&image, &format!("ok {mine}"), exited_0).is_ok());
        let exited_1 = std::process::ExitStatus::from_raw(1 << 8);
        assert!(verdict(&image, &format!("ok {mine}"), exited_1).is_err());
        assert!(verdict(&image, &format!("ok {mine} {theirs}"), exited_0).is_err());
        assert!(verdict(&image, &format!("ok {mine}\nok {mine}"), exited_0).is_err());
    }

    #[test]
    fn refusals_read_back_as_written() {
        for e in [
            SpanError::Mismatch,
            SpanError::Long,
            SpanError::Short { found: 77 },
            SpanError::Io(std::io::Error::other("disk on fire\nreally")),
        ] {
            let line = refusal(5, &e);
            let (i, back) = parse_refusal(line.strip_prefix("refused ").unwrap_or(""))
                .unwrap_or((0, SpanError::Long));
            assert_eq!(i, 5, "{line}");
            assert_eq!(
                format!("{e:?}").split('(').next(),
                format!("{back:?}").split('(').next()
            );
        }
        assert!(parse_refusal("x mismatch").is_none());
        assert!(parse_refusal("1 short").is_none());
        assert!(parse_refusal("1 wrong").is_none());
    }
}
