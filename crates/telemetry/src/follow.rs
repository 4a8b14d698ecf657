//! Following the journal: every record after a given `seq`, then each new one as it is written.
//!
//! # Design
//! A [`Follow`] wraps the journal's lock-free [`Reader`] (it never takes the writers' lock, so a
//! follower, however slow, never delays an append) and an inotify watch on the journal
//! *directory*: a writer's append is a `write` to a file in it, which wakes the follower at once;
//! the watch also sees the file being created. The watch is set before the first read, so an
//! append between a read and the next wait is never missed (its event is queued). Where inotify
//! is not available the follower polls every [`FALLBACK_POLL`].
//!
//! The journal's `seq` has no gaps and only grows, so "after seq N" is a complete, ordered
//! position, across rotations too: the [`Reader`] finishes the retired segment, skips the copies
//! a rotation carried, and reads what it missed from the archives. If the journal file is
//! replaced by another journal (restored from a backup, deleted and started again: another file
//! that is no rotation of it), the follower starts over from its first record and says so.
//! Records no file holds any more when the follower comes to them (it fell behind the archives'
//! retention) are skipped as seq ranges the consumer is given ([`Follow::take_gaps`]): lost,
//! never silently.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use cryo_journal::{Gap, Reader, Record};
use rustix::event::{poll, PollFd, PollFlags};
use rustix::fs::inotify;

use crate::error::FollowError;

/// How often a follower without an inotify watch (the directory does not exist yet, or inotify
/// is unavailable) looks at the journal.
pub const FALLBACK_POLL: Duration = Duration::from_millis(250);

/// Records of the journal in `dir` after a given `seq`, and each one appended later.
#[derive(Debug)]
pub struct Follow {
    dir: PathBuf,
    reader: Reader,
    /// The last `seq` handed out (or the starting point).
    after: u64,
    queue: VecDeque<Record>,
    /// Seq ranges lost since the last [`Follow::take_gaps`].
    gaps: Vec<Gap>,
    inotify: Option<OwnedFd>,
    watching: bool,
}

/// What ended a [`Follow::wait`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wake {
    /// The journal directory changed (or the fallback poll interval passed): read again.
    Journal,
    /// One of the other descriptors is ready (its index in the slice given).
    Other(usize),
    /// The timeout passed.
    Timeout,
}

impl Follow {
    /// Follows the journal in `dir` from the record after `after` (0: from the first record).
    /// The directory and the file need not exist yet.
    pub fn new(dir: impl AsRef<Path>, after: u64) -> Follow {
        let inotify = match inotify::init(
            inotify::CreateFlags::CLOEXEC | inotify::CreateFlags::NONBLOCK,
        ) {
            Ok(fd) => Some(fd),
            Err(err) => {
                tracing::warn!(%err, "inotify unavailable; polling the journal every {FALLBACK_POLL:?}");
                None
            }
        };
        let mut f = Follow {
            dir: dir.as_ref().to_path_buf(),
            reader: Reader::after(dir.as_ref(), after),
            after,
            queue: VecDeque::new(),
            gaps: Vec::new(),
            inotify,
            watching: false,
        };
        f.watch();
        f
    }

    /// Follows what the journal in `dir` appended since its last rotation (its active segment's
    /// own records, no archive read and no carried copy), then each record appended later.
    pub fn own(dir: impl AsRef<Path>) -> Follow {
        let mut f = Follow::new(dir.as_ref(), 0);
        f.reader = Reader::own(dir.as_ref());
        f
    }

    /// The journal directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The `seq` of the last record handed out (or the starting point).
    pub fn after(&self) -> u64 {
        self.after
    }

    /// The seq ranges this follower skipped since the last call, oldest first: records the
    /// journal no longer holds when the follower comes to them (archives the retention removed
    /// while it was behind, damaged frames). Each lies before the records handed out after it;
    /// a consumer that must not lose records silently reports them (the forwarder sends a
    /// `records_lost` message).
    pub fn take_gaps(&mut self) -> Vec<Gap> {
        std::mem::take(&mut self.gaps)
    }

    /// Every record appended since the last call (after the starting point the first time),
    /// without waiting.
    pub fn poll_new(&mut self) -> Result<Vec<Record>, FollowError> {
        self.fill()?;
        let out: Vec<Record> = self.queue.drain(..).collect();
        if let Some(last) = out.last() {
            self.after = last.seq;
        }
        Ok(out)
    }

    /// The next record, waiting at most `timeout` for one to be appended; `None` if none came.
    pub fn next_timeout(&mut self, timeout: Duration) -> Result<Option<Record>, FollowError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.queue.is_empty() {
                self.fill()?;
            }
            if let Some(r) = self.queue.pop_front() {
                self.after = r.seq;
                return Ok(Some(r));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Ok(None);
            }
            self.wait(&[], left)?;
        }
    }

    /// Blocks until the journal may have grown, one of `others` is readable (or hung up), or
    /// `timeout` passed. Call [`Follow::poll_new`] afterwards: a wake-up may be spurious.
    pub fn wait(
        &mut self,
        others: &[BorrowedFd<'_>],
        timeout: Duration,
    ) -> Result<Wake, FollowError> {
        self.watch();
        let timeout = if self.watching {
            timeout
        } else {
            timeout.min(FALLBACK_POLL)
        };
        let mut fds: Vec<PollFd<'_>> = others
            .iter()
            .map(|fd| PollFd::from_borrowed_fd(*fd, PollFlags::IN | PollFlags::RDHUP))
            .collect();
        let journal = fds.len();
        if let (true, Some(ino)) = (self.watching, &self.inotify) {
            fds.push(PollFd::new(ino, PollFlags::IN));
        }
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        match poll(&mut fds, ms) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => return Ok(Wake::Journal),
            Err(e) => return Err(FollowError::Poll(e.into())),
        }
        if let Some(i) = fds[..journal].iter().position(|p| !p.revents().is_empty()) {
            return Ok(Wake::Other(i));
        }
        if fds.get(journal).is_some_and(|p| !p.revents().is_empty()) {
            self.drain_inotify();
            return Ok(Wake::Journal);
        }
        Ok(if self.watching {
            Wake::Timeout
        } else {
            Wake::Journal
        })
    }

    /// Reads what was appended into the queue, skipping what is at or before `after`.
    fn fill(&mut self) -> Result<(), FollowError> {
        let scan = self.reader.read_new().map_err(FollowError::Read)?;
        if scan.restarted {
            tracing::warn!(
                dir = %self.dir.display(),
                after = self.after,
                "the journal file was replaced; following it from its first record"
            );
            self.queue.clear();
            self.gaps.clear();
            self.after = 0;
        }
        for g in &scan.gaps {
            tracing::warn!(
                dir = %self.dir.display(),
                first = g.first,
                last = g.last,
                "journal records lost to this follower: no file holds them any more (archives removed by the retention, or damaged)"
            );
        }
        self.gaps.extend(scan.gaps);
        for c in &scan.corruptions {
            tracing::error!(dir = %self.dir.display(), "{c}; the records after it are followed");
        }
        let last = self.queue.back().map_or(self.after, |r| r.seq);
        self.queue
            .extend(scan.records.into_iter().filter(|r| r.seq > last));
        Ok(())
    }

    fn watch(&mut self) {
        if self.watching {
            return;
        }
        let Some(ino) = &self.inotify else { return };
        let flags = inotify::WatchFlags::MODIFY
            | inotify::WatchFlags::CREATE
            | inotify::WatchFlags::MOVED_TO
            | inotify::WatchFlags::CLOSE_WRITE;
        match inotify::add_watch(ino, &self.dir, flags) {
            Ok(_) => self.watching = true,
            Err(rustix::io::Errno::NOENT) => {}
            Err(err) => {
                tracing::warn!(%err, dir = %self.dir.display(), "cannot watch the journal directory; polling it");
            }
        }
    }

    /// Discards queued inotify events (they only say "look again").
    fn drain_inotify(&mut self) {
        let Some(ino) = &self.inotify else { return };
        let mut buf = [0u8; 4096];
        loop {
            match rustix::io::read(ino.as_fd(), &mut buf) {
                Ok(n) if n > 0 => continue,
                Ok(_) | Err(_) => break,
            }
        }
        // The directory itself may have gone (IN_IGNORED): set the watch again next time.
        if !self.dir.is_dir() {
            self.watching = false;
        }
    }
}

/// Blocks forever between records: each item is the next record (or a read error, after which
/// following goes on).
impl Iterator for Follow {
    type Item = Result<Record, FollowError>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.next_timeout(Duration::from_secs(3600)) {
                Ok(Some(r)) => return Some(Ok(r)),
                Ok(None) => continue,
                Err(e) => return Some(Err(e)),
            }
        }
    }
}

/// One record as a line of NDJSON (`GET /v1/events`): exactly the line `cryo timeline --json`
/// prints for it, newline included.
pub fn ndjson_line(record: &Record) -> String {
    cryo_journal::render_json(std::iter::once(record), &cryo_journal::Filter::default())
}
