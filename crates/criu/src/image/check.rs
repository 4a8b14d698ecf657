//! The thaw's check beside CRIU: CRIU restores from the image's own files while cryo hashes the
//! same files in parallel, and nothing restored runs before every chunk matched and nothing
//! changed the files in between.
//!
//! # Design
//! [`Check::new`] puts an inotify watch on the image directory (through the fd [`Image::open`]
//! checked, never the path again) and notes each file's identity and times, before any byte is
//! read by anyone; then it checks every file but the page contents (`pages-*.img`) before CRIU
//! starts: those files steer what CRIU does as root (paths it opens, files it creates, archives
//! it unpacks, how many tasks it forks and waits for), and a flipped byte there made CRIU hang
//! for minutes in the tests. They are small (kilobytes to a few megabytes). The page contents
//! only become memory of processes that do not run before the verdict. [`Check::run`] checks
//! every chunk of those while CRIU reads them into place: on threads of cryo's own, or (asked
//! for with `CRYO_THAW_CHECKER=child`) in the background checker process (`checker`, raised at
//! the gate by [`Check::raise`]). [`Check::finish`] is the verdict at
//! CRIU's `post-restore` gate (every process restored, none resumed): it waits for the hashing,
//! then refuses if any chunk did not match, or if anything happened to the directory since the
//! watch was set (a write, truncation, attribute change, link, rename, creation or removal,
//! also of the directory itself), or if any file's identity, size or times differ from those
//! noted. CRIU got its bytes from those same files during that time; unchanged files read the
//! same bytes for CRIU as for cryo, so every byte a restored process gets was checked before it
//! runs. A refusal need not wait for the gate: [`Check::refusals`] become readable once the
//! verdict can only refuse (a chunk did not match; the watch saw anything), and the restore
//! ends CRIU then (CRIU 4.2's restorer never reaches the gate on a pages file truncated under
//! it: it loops on `preadv` returning 0). Once CRIU ended or was killed before a verdict passed
//! (a refusal, its deadline, its own failure), nobody needs the check's answer: [`Check::stop`]
//! makes [`Check::run`] and [`Check::finish`] return at once and the hashing threads stop at
//! their next chunk boundary, so the restore returns then, not when the check would have ended
//! (session 23: a thaw whose CRIU failed at once while the check's read of a hung file system
//! waited returned at its deadline, 30 s later). What the image's refusal is, if any, is known
//! by then (the check's failure, the watch); a CRIU that failed by itself read nothing as
//! instructions that was not checked before it started.
//!
//! A read, an open or a stat that never returns (a hung disk, a FUSE server that stopped
//! answering) cannot be cancelled: the watch, the files' identities and the check of the files
//! CRIU reads as instructions (in [`Check::new_until`]), the check of the page contents, and
//! the verdict's second look at every file's identity all run under a thread that owns what it
//! reads (a duplicate of the image's directory fd and of every file [`Image::open`] holds, its
//! manifest), and past the restore's deadline [`Check::new_until`], [`Check::run`] and
//! [`Check::finish`] give up on it: the image is refused, the restore returns, and the thread is
//! *abandoned* (counted by [`abandoned_checks`]; it ends whenever its read returns), as it is
//! when the check is stopped while such a read holds it. Past
//! [`MAX_ABANDONED_CHECKS`] of them still stuck, [`Check::new`] refuses at once instead of adding
//! threads that would hang the same way (a long-lived agent must not pile them up).
//!
//! # Why not only the stream
//! The streamer (`stream`) hands CRIU cryo's own checked copy of every chunk, so a change of a
//! file after its check cannot reach CRIU at all; the price is a pipe between them (CRIU cannot
//! read its pages into place from a pipe: it premaps and copies, 0.25-0.34 GB/s under load
//! against 1+ GB/s from the files). Here a change is detected instead of made impossible, which
//! is as strong for everything that can change an image: only root can write it (`trust`), and
//! every way root changes a file through the filesystem shows in the watch or the times. What
//! this does not see: a storage device that returns different bytes for two reads of unchanged
//! data when the page cache dropped the page between cryo's read and CRIU's; and writes through
//! a shared mapping made before the thaw started (their time stamp may come later). The stream
//! (`CRYO_THAW_STREAM=1`) remains for those who want the copy.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use cryo_gpu::deadline::{self, Abandoned, GiveUp, Late};

use rustix::fs::inotify;

use super::checker::{plan, serves, Parent, Plan};
use super::open::Image;
use super::ImageError;

/// What identifies a file's content without reading it: noted at the start, compared at the
/// verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    size: u64,
    nlink: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl Stamp {
    fn of(m: &std::fs::Metadata) -> Stamp {
        Stamp {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            nlink: m.nlink(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        }
    }
}

/// Every change to a directory entry or file content inotify reports; reads are not in it.
fn changes() -> inotify::WatchFlags {
    use inotify::WatchFlags as W;
    W::MODIFY
        | W::ATTRIB
        | W::CLOSE_WRITE
        | W::MOVED_FROM
        | W::MOVED_TO
        | W::CREATE
        | W::DELETE
        | W::DELETE_SELF
        | W::MOVE_SELF
}

/// Whether the file named `name` holds page contents (CRIU's `pages-<id>.img`): data copied
/// into the restored memory, never read as instructions by CRIU.
pub(crate) fn is_page_contents(name: &str) -> bool {
    name.strip_prefix("pages-")
        .and_then(|r| r.strip_suffix(".img"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

/// Failpoint (`CRYO_FAILPOINT`, a test hook): the check's first read of the page contents, on
/// the check's threads, does not return (until the file named by `CRYO_FAILPOINT_RESUME`
/// exists; never without one), as a read of a hung disk or of a FUSE server that stopped
/// answering does (a thread in such a read cannot be cancelled).
pub const CHECK_READ_STALLS: &str = "image-check-read-stalls";

/// Failpoint (`CRYO_FAILPOINT`, a test hook): each span of the page contents (`pages-N.img`)
/// hashed through a mapping (its pages cached) pauses once its pages are mapped and before its
/// hash, until the
/// file named by `CRYO_FAILPOINT_RESUME` exists: the moment when a page lost (the file
/// truncated, its storage failed) faults under the hash, in whatever process runs the check
/// (the agent's, with its own SIGBUS handler before cryo's).
pub const CHECK_MAPPED_SPAN_PAUSES: &str = "image-check-mapped-span-pauses";

/// How many checks given up on at their restore's deadline may still be stuck in a read before a
/// new check refuses at once.
pub const MAX_ABANDONED_CHECKS: usize = 16;

static ABANDONED: Abandoned = Abandoned::new(MAX_ABANDONED_CHECKS);

/// Checks of this process given up on at their restore's deadline whose read has still not
/// returned (their threads are still there).
pub fn abandoned_checks() -> usize {
    ABANDONED.get()
}

/// Failpoint (`CRYO_FAILPOINT`, a test hook): as [`CHECK_READ_STALLS`], for the check of the
/// files CRIU reads as instructions, before CRIU starts.
pub const CHECK_STEERING_READ_STALLS: &str = "image-check-steering-read-stalls";

/// Threads that check the page contents beside CRIU's restore, at most.
pub const CHECK_THREADS: usize = 4;

/// How many threads check the page contents on a host of `cores` (see `checker::plan`): one
/// core is left to CRIU's
/// restore, which reads the pages on one thread per process; at least one, at most
/// [`CHECK_THREADS`]. One thread hashes 1 GiB from the page cache in about 370 ms on this
/// project's host, ahead of CRIU (its gate at 540 ms in the same run); two on its two cores
/// slowed CRIU down instead (gate at 730-817 ms, load 4-5). The threads keep the normal
/// policy: idle priority (`SCHED_IDLE`, as the freeze's follower) does not take them out of
/// CRIU's way here, since the scheduler shares the cores between sessions first (autogroups,
/// on in this project's host): the restored tree runs in its own session's group, the check in
/// its caller's, and a group's share does not shrink with its threads' policy (measured at
/// 4 GiB, load 5-7: the restorer's run-queue wait was no shorter with it). What the
/// check costs CRIU's restorer under load is its CPU time (BLAKE3 at about 4 GB/s per thread
/// here) for as long as it runs; it is done well before CRIU's gate from the page cache.
pub fn check_threads(cores: usize) -> usize {
    cores.saturating_sub(1).clamp(1, CHECK_THREADS)
}

/// The inotify instance of one check, closed on another thread when dropped: closing an inotify
/// fd that holds a watch waits for the kernel's SRCU grace period (`fsnotify_destroy_group`),
/// 14-17 ms measured under `strace -T` on this project's host (issue 16), which the thaw paid
/// between CRIU's exit and the GPU restore. Nothing reads the fd after the verdict.
#[derive(Debug)]
struct Watch(Option<OwnedFd>);

impl Watch {
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        self.0.as_ref().map(AsFd::as_fd)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        let Some(fd) = self.0.take() else { return };
        // A thread that cannot be started: the close is paid here instead.
        let closer = std::thread::Builder::new()
            .name("cryo-watch-close".into())
            .spawn(move || drop(fd));
        if let Err(e) = closer {
            tracing::debug!(error = %e, "closing the image watch inline");
        }
    }
}

/// One image checked beside one CRIU restore.
#[derive(Debug)]
pub struct Check<'a> {
    image: &'a Image,
    watch: Watch,
    stamps: Vec<Stamp>,
    done: mpsc::SyncSender<Outcome>,
    outcome: Mutex<mpsc::Receiver<Outcome>>,
    /// When [`Check::run`] ended.
    hashed: std::sync::OnceLock<std::time::Instant>,
    /// How the page contents are checked (decided at [`Check::new`], by the host).
    plan: Plan,
    /// The checker process, when [`Plan::Child`].
    checker: Parent,
    /// Past it, [`Check::finish`] gives up on the check (and ends its checker): refused.
    deadline: Option<std::time::Instant>,
    /// A pipe written once when [`Check::run`] refuses the page contents: its read end is
    /// one of [`Check::refusals`] (the other, the watch).
    refused: (OwnedFd, OwnedFd),
    /// Set by [`Check::stop`]: nobody needs the check's answer any more.
    stop: Stop,
    /// [`Check::finish`] refused only because the check was stopped (said nothing of the image).
    finish_stopped: AtomicBool,
}

/// What [`Check::run`] hands to [`Check::finish`].
#[derive(Debug)]
enum Outcome {
    /// The page contents were all checked (`Ok`), or one of them was refused.
    Checked(Result<(), ImageError>),
    /// [`Check::stop`] came first: the check ended unfinished, and says nothing of the image.
    Stopped,
}

/// A check's stop ([`Check::stop`]): a flag its hashing threads read at every chunk boundary,
/// and the waits of the check's own threads on the deadline layer's threads, each woken and
/// given up on when it is set (a read that never returns holds its thread, counted in
/// [`abandoned_checks`] until it returns; one that returns sees the flag and ends there).
#[derive(Debug, Default)]
struct Stop {
    flag: Arc<AtomicBool>,
    waits: Mutex<Vec<GiveUp>>,
}

impl Stop {
    fn set(&self) {
        self.flag.store(true, Ordering::SeqCst);
        let waits = std::mem::take(&mut *self.waits.lock().unwrap_or_else(|p| p.into_inner()));
        for w in waits {
            w.give_up();
        }
    }

    fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    /// Gives up on `wait` when the stop is set, now if it is set already.
    fn watch(&self, wait: GiveUp) {
        let mut waits = self.waits.lock().unwrap_or_else(|p| p.into_inner());
        // Read under the lock [`Stop::set`] takes after setting the flag: either it finds
        // `wait` here, or the flag is seen set now.
        if self.is_set() {
            drop(waits);
            wait.give_up();
        } else {
            waits.push(wait);
        }
    }
}

impl<'a> Check<'a> {
    /// Watches `image`, notes its files and checks every file but the page contents.
    pub fn new(image: &'a Image) -> Result<Check<'a>, ImageError> {
        Check::new_until(image, None)
    }

    /// [`Check::new`], giving up at `deadline` (the restore's) on the check of the files CRIU
    /// reads as instructions, and on the page contents later ([`Check::until`]): a read that
    /// does not return is refused there (nothing was restored yet), its thread abandoned.
    pub fn new_until(
        image: &'a Image,
        deadline: Option<std::time::Instant>,
    ) -> Result<Check<'a>, ImageError> {
        let dir = image.path();
        let stuck = abandoned_checks();
        if stuck >= MAX_ABANDONED_CHECKS {
            return Err(too_many_stuck(dir, stuck));
        }
        let watch = inotify::init(inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK)
            .map_err(|e| ImageError::Io {
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
        let threads = check_threads(std::thread::available_parallelism().map_or(1, usize::from));
        // The watch, the files' identities and the check of the files CRIU reads as
        // instructions, all before CRIU reads any of them (changes afterwards are the watch's),
        // and all under the deadline: an open or a stat of a hung file system does not return
        // either.
        let steering = on_own_thread(image, deadline, None, move |image| {
            let proc_path = format!("/proc/self/fd/{}", image.dir_fd().as_raw_fd());
            inotify::add_watch(&watch, proc_path.as_str(), changes()).map_err(|e| {
                ImageError::Io {
                    path: image.path().to_path_buf(),
                    source: e.into(),
                }
            })?;
            let stamps = stamps_of(image)?;
            read_stall_failpoint(CHECK_STEERING_READ_STALLS);
            image.verify_files_in_order(|name| !is_page_contents(name), threads)?;
            Ok((watch, stamps))
        });
        let (watch, stamps) =
            match steering {
                Some(r) => r?,
                None => return Err(ImageError::Stream {
                    dir: dir.to_path_buf(),
                    reason:
                        "the check of the image's files did not end before the restore's deadline"
                            .into(),
                }),
            };
        let (done, outcome) = mpsc::sync_channel(1);
        let refused = rustix::pipe::pipe_with(
            rustix::pipe::PipeFlags::CLOEXEC | rustix::pipe::PipeFlags::NONBLOCK,
        )
        .map_err(|e| ImageError::Io {
            path: dir.to_path_buf(),
            source: e.into(),
        })?;
        Ok(Check {
            image,
            watch: Watch(Some(watch)),
            stamps,
            done,
            outcome: Mutex::new(outcome),
            hashed: std::sync::OnceLock::new(),
            plan: plan(
                std::thread::available_parallelism().map_or(1, usize::from),
                serves(),
            ),
            checker: Parent::default(),
            deadline,
            refused,
            stop: Stop::default(),
            finish_stopped: AtomicBool::new(false),
        })
    }

    /// The check gives up at `deadline` (the restore's): [`Check::finish`] refuses the image
    /// then, and a checker process still running is ended.
    pub fn until(mut self, deadline: Option<std::time::Instant>) -> Self {
        self.deadline = deadline;
        self
    }

    /// CRIU reached its gate, or ended: a background checker gets the CPU it was kept from
    /// (see `checker`); nothing else waits for CPU that the check should leave.
    pub fn raise(&self) {
        self.checker.raise();
    }

    /// Nobody needs the check's answer any more (CRIU ended, or was killed, before a verdict
    /// passed): [`Check::run`] and [`Check::finish`] return at once, saying nothing of the
    /// image; the hashing threads stop at their next chunk boundary; a checker process is
    /// ended. A read that never returns (a hung file system) is left to its thread, counted in
    /// [`abandoned_checks`] until it returns, as one given up on at the deadline is.
    pub fn stop(&self) {
        self.stop.set();
        self.checker.end();
    }

    /// Whether [`Check::stop`] was called.
    pub fn stopped(&self) -> bool {
        self.stop.is_set()
    }

    /// Whether [`Check::finish`] refused only because the check was stopped: its error says
    /// nothing of the image.
    pub fn finish_was_stopped(&self) -> bool {
        self.finish_stopped.load(Ordering::SeqCst)
    }

    fn stopped_error(&self) -> ImageError {
        self.finish_stopped.store(true, Ordering::SeqCst);
        self.stream_error(STOPPED.into())
    }

    /// When the page contents were all checked, if they were.
    pub fn hashed_at(&self) -> Option<std::time::Instant> {
        self.hashed.get().copied()
    }

    /// Checks every chunk of the page contents, in the order CRIU reads them (each file front
    /// to back, so the kernel's readahead serves both), on [`check_threads`] threads; the
    /// outcome goes to [`Check::finish`].
    pub fn run(&self) {
        tracing::debug!(plan = ?self.plan, "checking the page contents");
        let r = match self.plan {
            Plan::Threads(n) => match self.run_threads(n) {
                Some(r) => r,
                // Stopped: nobody waits for a verdict.
                None if self.stopped() => {
                    let _ = self.done.send(Outcome::Stopped);
                    return;
                }
                // Given up on at the deadline: no outcome, [`Check::finish`] refuses.
                None => return,
            },
            Plan::Child { at_gate } => self.checker.run(self.image, at_gate, self.deadline),
        };
        // Stopped before the end: what the check says then is that it was stopped (or given up
        // on), not what the image holds. A refusal of the image's bytes (a chunk that did not
        // match, a file cut) stands.
        if self.stopped() && matches!(r, Err(ImageError::Stream { .. })) {
            let _ = self.done.send(Outcome::Stopped);
            return;
        }
        let _ = self.hashed.set(std::time::Instant::now());
        if let Err(e) = &r {
            tracing::warn!(error = %e, "image refused while CRIU reads it");
            // Before the outcome is sent: whoever sees the pipe ready finds the outcome there.
            let _ = rustix::io::write(&self.refused.1, b"r");
        }
        let _ = self.done.send(Outcome::Checked(r));
    }

    /// What becomes readable once the verdict can only refuse the image: the check of the page
    /// contents failed, or the watch saw a change (any event on it refuses, see
    /// [`Check::finish`]). Polled beside CRIU, so that a restore that never reaches its gate
    /// (CRIU 4.2's restorer loops on a pages file truncated under it until the restore's
    /// deadline) ends at the refusal; nothing is read from them here. Why: [`Check::refusal`].
    pub fn refusals(&self) -> [std::os::fd::BorrowedFd<'_>; 2] {
        let watch = self.watch.fd().unwrap_or(self.refused.0.as_fd());
        [self.refused.0.as_fd(), watch]
    }

    /// Why the image is refused, when CRIU ended before a verdict (it failed, or was ended at
    /// a refusal): the check's failure, once [`Check::run`] ended with one, else a change the
    /// watch saw. Only without a verdict that passed: a change after it is not this restore's
    /// (the tree runs).
    pub fn refusal(&self) -> Option<ImageError> {
        self.failure().or_else(|| self.watch_saw().err())
    }

    /// The page contents checked on `threads` threads under a thread that owns what it reads,
    /// waited for until the deadline or [`Check::stop`]: `None` if it had not ended by then
    /// (it is abandoned and counted, see the module docs; stopped, it ends at its next chunk
    /// boundary).
    fn run_threads(&self, threads: usize) -> Option<Result<(), ImageError>> {
        let stop = Arc::clone(&self.stop.flag);
        on_own_thread(self.image, self.deadline, Some(&self.stop), move |image| {
            read_stall_failpoint(CHECK_READ_STALLS);
            image.verify_files_in_order_until(is_page_contents, threads, &stop)
        })
    }

    /// The verdict before anything restored runs: waits for [`Check::run`], then refuses a
    /// chunk that did not match or any change to the image since [`Check::new`].
    pub fn finish(&self) -> Result<(), ImageError> {
        let rx = self
            .outcome
            .lock()
            .map_err(|_| self.stream_error("the check's lock is poisoned".into()))?;
        let outcome = match self.deadline {
            None => rx
                .recv()
                .map_err(|_| self.stream_error("the check ended without an outcome".into()))?,
            Some(d) => {
                match rx.recv_timeout(d.saturating_duration_since(std::time::Instant::now())) {
                    Ok(o) => o,
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        self.checker.end();
                        return Err(self.stream_error(
                        "the check of the page contents did not end before the restore's deadline"
                            .into(),
                    ));
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(self.stream_error("the check ended without an outcome".into()))
                    }
                }
            }
        };
        match outcome {
            Outcome::Checked(r) => r?,
            Outcome::Stopped => return Err(self.stopped_error()),
        }
        self.unchanged()
    }

    /// Why the check refused the image, once [`Check::run`] ended, if [`Check::finish`] did not
    /// take the outcome (CRIU ended before its gate: the image's fault is what to report).
    pub fn failure(&self) -> Option<ImageError> {
        let outcome = self.outcome.lock().ok()?;
        match outcome.try_recv() {
            Ok(Outcome::Checked(Err(e))) => Some(e),
            _ => None,
        }
    }

    /// Whether the watch saw nothing and every file is the one noted.
    fn unchanged(&self) -> Result<(), ImageError> {
        self.watch_saw()?;
        // Opens and stats, under the deadline as the reads are (see the module docs).
        let noted = self.stamps.clone();
        let now = on_own_thread(self.image, self.deadline, Some(&self.stop), move |image| {
            let now = stamps_of(image)?;
            Ok(noted.iter().zip(&now).position(|(noted, now)| noted != now))
        });
        match now {
            Some(Ok(None)) => Ok(()),
            Some(Ok(Some(i))) => Err(self.changed(format!(
                "{}: not the file checked (identity, size or times differ)",
                self.image.manifest().files[i].name
            ))),
            Some(Err(e)) => Err(e),
            None if self.stopped() => Err(self.stopped_error()),
            None => Err(self.stream_error(
                "looking at the image's files again did not end before the restore's deadline"
                    .into(),
            )),
        }
    }

    /// The first change the watch saw, if any (taken from it).
    fn watch_saw(&self) -> Result<(), ImageError> {
        let mut buf = [std::mem::MaybeUninit::<u8>::uninit(); 4096];
        let watch = self
            .watch
            .fd()
            .ok_or_else(|| self.stream_error("the watch is closed".into()))?;
        let mut events = inotify::Reader::new(watch, &mut buf);
        match events.next() {
            Ok(ev) => {
                // The file's whole path: the refusal names the file as the check's own do.
                let name = ev
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .filter(|n| !n.is_empty())
                    .map(|n| self.image.path().join(n).display().to_string())
                    .unwrap_or_else(|| "the directory itself".into());
                Err(self.changed(format!("{name}: {:?}", ev.events())))
            }
            Err(rustix::io::Errno::AGAIN) => Ok(()),
            Err(e) => Err(self.stream_error(format!("reading the watch: {e}"))),
        }
    }

    fn changed(&self, what: String) -> ImageError {
        ImageError::Changed {
            dir: self.image.path().to_path_buf(),
            what,
        }
    }

    fn stream_error(&self, reason: String) -> ImageError {
        ImageError::Stream {
            dir: self.image.path().to_path_buf(),
            reason,
        }
    }
}

/// Every file of `image`, in the manifest's order, opened (through the trust checks) and
/// looked at.
fn stamps_of(image: &Image) -> Result<Vec<Stamp>, ImageError> {
    (0..image.manifest().files.len())
        .map(|i| {
            let (f, _) = image.open_file(i)?;
            f.metadata()
                .map(|m| Stamp::of(&m))
                .map_err(|source| ImageError::Io {
                    path: image.path().join(&image.manifest().files[i].name),
                    source,
                })
        })
        .collect()
}

/// What a stopped check says of the image: nothing (its restore no longer needs a verdict).
const STOPPED: &str = "the check was stopped: CRIU ended before its gate";

/// Runs `work` on a copy of `image` (its directory fd duplicated) on a thread of the deadline
/// layer (`cryo_gpu::deadline`, whose driver calls have the same problem: a call that never
/// returns cannot be cancelled), waited for until `deadline` or `stop`: `None` if it had not
/// ended by then. Such a thread is abandoned and counted in [`abandoned_checks`] until it ends.
/// Without a deadline the work runs here, waited for however long it takes.
fn on_own_thread<T: Send + 'static>(
    image: &Image,
    deadline: Option<std::time::Instant>,
    stop: Option<&Stop>,
    work: impl FnOnce(&Image) -> Result<T, ImageError> + Send + 'static,
) -> Option<Result<T, ImageError>> {
    let Some(deadline) = deadline else {
        return Some(work(image));
    };
    let copy = match image.try_clone() {
        Ok(i) => i,
        Err(e) => return Some(Err(e)),
    };
    within_deadline_or(image.path(), deadline, stop, move || work(&copy))
}

/// Runs `work` (which touches only the image at `dir`) on a thread of the deadline layer,
/// waited for until `deadline`: `None` if it had not ended by then; its thread is then
/// abandoned and counted in [`abandoned_checks`] until it ends. The one place the image's
/// opens, reads and stats meet the deadline ([`on_own_thread`], [`Image::open_until`]).
pub(super) fn within_deadline<T: Send + 'static>(
    dir: &std::path::Path,
    deadline: std::time::Instant,
    work: impl FnOnce() -> Result<T, ImageError> + Send + 'static,
) -> Option<Result<T, ImageError>> {
    within_deadline_or(dir, deadline, None, work)
}

/// [`within_deadline`], given up on at `stop` too ([`Check::stop`]).
fn within_deadline_or<T: Send + 'static>(
    dir: &std::path::Path,
    deadline: std::time::Instant,
    stop: Option<&Stop>,
    work: impl FnOnce() -> Result<T, ImageError> + Send + 'static,
) -> Option<Result<T, ImageError>> {
    let limit = deadline.saturating_duration_since(std::time::Instant::now());
    let late = |_: Result<T, ImageError>| {
        tracing::info!(
            "a look at an image given up on (at its restore's deadline, or stopped) ended"
        );
    };
    let pending = deadline::start_counted(&ABANDONED, limit, work, late);
    if let (Ok(p), Some(stop)) = (&pending, stop) {
        stop.watch(p.give_up_handle());
    }
    match pending.and_then(deadline::Pending::wait) {
        Ok(r) => Some(r),
        Err(Late::Elapsed(_)) if stop.is_some_and(Stop::is_set) => {
            tracing::debug!(
                image = %dir.display(),
                stuck = ABANDONED.get(),
                "a look at the image was stopped (its restore no longer needs it): its thread ends at its next chunk, or is counted while a read holds it"
            );
            None
        }
        Err(Late::Elapsed(_)) => {
            tracing::warn!(
                image = %dir.display(),
                stuck = ABANDONED.get(),
                "a look at the image did not end before the restore's deadline (an open, read or stat that never returns?): its thread is abandoned"
            );
            None
        }
        Err(Late::Unresponsive(stuck)) => Some(Err(too_many_stuck(dir, stuck))),
        Err(Late::NoThread) => Some(Err(ImageError::Stream {
            dir: dir.to_path_buf(),
            reason: "cannot start the check's thread".into(),
        })),
    }
}

/// The refusal of a check of the image at `dir` while `stuck` earlier ones are stuck in reads:
/// why, where their images are named (the warning logged when each was given up on), and what
/// ends them (a thread in such a read cannot be cancelled, nor its process end).
fn too_many_stuck(dir: &std::path::Path, stuck: usize) -> ImageError {
    ImageError::Stream {
        dir: dir.to_path_buf(),
        reason: format!(
            "{stuck} earlier checks of images are still stuck in a read that never returned (a hung disk or network file system? each was logged with its image when given up on): no new check is started until one ends, which it does when its file system answers or its mount is aborted"
        ),
    }
}

/// Starts `work` (which touches only an image, and that nobody waits for: the prefetch) on a
/// thread of the deadline layer, counted in [`abandoned_checks`] until it ends: a file system
/// that stops answering it holds that thread as it would a check's, and uses up the same
/// budget. Not started (false) past [`MAX_ABANDONED_CHECKS`] stuck, or without a thread.
pub(super) fn in_background(work: impl FnOnce() + Send + 'static) -> bool {
    // Given up on at once: counted from now until it ends, as an abandoned look is.
    match deadline::within_counted(&ABANDONED, std::time::Duration::ZERO, work, |()| ()) {
        Ok(()) | Err(Late::Elapsed(_)) => true,
        Err(Late::Unresponsive(_) | Late::NoThread) => false,
    }
}

/// Starts `work` (reads of the image at `dir` whose caller may leave them: the streamer's) on a
/// thread of the deadline layer, and returns at once: dropped before `work` ended, the returned
/// call is abandoned and counted in [`abandoned_checks`] until `work` ends. Refused past
/// [`MAX_ABANDONED_CHECKS`] stuck, or without a thread.
pub(super) fn on_look_thread(
    dir: &std::path::Path,
    work: impl FnOnce() + Send + 'static,
) -> Result<deadline::Pending<()>, ImageError> {
    match deadline::start_counted(&ABANDONED, std::time::Duration::ZERO, work, |()| ()) {
        Ok(p) => Ok(p),
        Err(Late::Unresponsive(stuck)) => Err(too_many_stuck(dir, stuck)),
        Err(Late::Elapsed(_) | Late::NoThread) => Err(ImageError::Stream {
            dir: dir.to_path_buf(),
            reason: "cannot start a thread to read the image".into(),
        }),
    }
}

/// Failpoint `name` ([`CHECK_READ_STALLS`], [`CHECK_STEERING_READ_STALLS`],
/// [`CHECK_MAPPED_SPAN_PAUSES`]): the read does not return until the file named by
/// `CRYO_FAILPOINT_RESUME` exists (never without one).
pub(crate) fn read_stall_failpoint(name: &str) {
    if std::env::var("CRYO_FAILPOINT").is_ok_and(|v| v == name) {
        let resume = std::env::var_os("CRYO_FAILPOINT_RESUME").map(std::path::PathBuf::from);
        eprintln!(
            "cryo: failpoint {name} reached; the check's read waits for CRYO_FAILPOINT_RESUME (CRYO_FAILPOINT is a test hook)"
        );
        while !resume.as_ref().is_some_and(|r| r.exists()) {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_core_is_left_to_criu() {
        assert_eq!(check_threads(1), 1);
        assert_eq!(check_threads(2), 1);
        assert_eq!(check_threads(3), 2);
        assert_eq!(check_threads(64), CHECK_THREADS);
    }

    #[test]
    fn only_pages_files_are_page_contents() {
        assert!(is_page_contents("pages-1.img"));
        assert!(is_page_contents("pages-123.img"));
        for n in [
            "pagemap-1.img",
            "pages-.img",
            "pages-1.img.x",
            "xpages-1.img",
            "pages-a.img",
        ] {
            assert!(!is_page_contents(n), "{n}");
        }
    }
}
