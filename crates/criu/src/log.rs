//! CRIU's log, capped: CRIU writes it to its stdout (`-o -`), a pipe cryo reads into the log
//! file, keeping the first [`LogCap::head`] bytes and the last [`LogCap::tail`] bytes.
//!
//! # Why
//! CRIU writes its log itself, without a limit: a restorer spinning on a `preadv` that returns 0
//! wrote a 2.7 GB `restore.log` into `/tmp` in minutes (issue 16); a looping CRIU fills the disk
//! the node's images and journal live on. Where CRIU started and where it stopped are what a
//! failure is read from, so both ends are kept, with one line saying what was cut in between.
//!
//! # Design
//! A restore logs through a pipe: [`CappedLog::pipe`] makes it and creates the log file (a new
//! file, never through a link); CRIU gets the write end as its stdout. [`CappedLog::copy`] (on its own thread, beside
//! CRIU) writes the head into the file as it comes, so a log being read while CRIU runs shows
//! where it is, and keeps the tail in a ring in memory; it stops at the end of the pipe, or once
//! CRIU has exited (`criu`, a pidfd, readable) and the pipe is drained, so a process that
//! inherited the write end and outlives CRIU cannot hold the copy open. Then the tail is written
//! after a line naming the bytes cut. A file that cannot be written (a full disk) never stops
//! the copy from draining the pipe: a pipe without a reader would raise `SIGPIPE` in whoever
//! writes the log, and CRIU's restorer writes it from inside the restored processes.
//!
//! A dump logs into a file CRIU writes itself ([`FileCap`]): its parasite writes the log from
//! inside the dumped worker, which must never get a `SIGPIPE` (a pipe loses its reader when cryo
//! dies mid-dump, and the worker would die once CRIU resumed it). While CRIU runs, the bytes
//! between the head and the last [`LogCap::tail`] are punched out of the file as it grows
//! (`FALLOC_FL_PUNCH_HOLE`: the disk holds the head and the tail only); once CRIU exited, the
//! file is cut to head, one line and tail.
//!
//! The `criu swrk` routes (`CRYO_DUMP_STREAM=0`, `restore_dir` for tests and tools) log into
//! a file too (CRIU's RPC takes a file name for its log): it is kept capped the same way for as
//! long as the exchange with CRIU lasts.
//!
//! # Limitations
//! If cryo is killed, a restore's log holds the head
//! only and a dump's log stays punched (sparse) without the line; a restore's pipe then has no
//! reader, and a restorer that still logs after cryo's verdict raises `SIGPIPE` in its restored
//! process (its GPU context is still checkpointed then: nothing live is torn down). A file system that cannot
//! punch holes keeps a dump's log whole until CRIU exits.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};

/// How much of CRIU's log is kept: the first `head` and the last `tail` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogCap {
    /// Bytes kept from the start.
    pub head: usize,
    /// Bytes kept from the end.
    pub tail: usize,
}

impl Default for LogCap {
    /// 4 MiB each: a restore of a 4 GiB worker at CRIU's debug level logs about 1 MiB.
    fn default() -> Self {
        LogCap {
            head: 4 << 20,
            tail: 4 << 20,
        }
    }
}

/// The reading end of CRIU's log pipe and the file it is copied into.
#[derive(Debug)]
pub(crate) struct CappedLog {
    pipe: File,
    file: File,
    path: PathBuf,
    cap: LogCap,
}

/// What [`CappedLog::copy`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Copied {
    /// Bytes CRIU wrote.
    pub(crate) total: u64,
    /// Bytes left out of the file.
    pub(crate) cut: u64,
}

impl CappedLog {
    /// Creates the log file at `path` (it must not exist) and a pipe; returns the log and the
    /// write end, for CRIU's stdout.
    pub(crate) fn pipe(path: &Path, cap: LogCap) -> std::io::Result<(CappedLog, OwnedFd)> {
        let file = File::options()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(path)?;
        let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
        Ok((
            CappedLog {
                pipe: File::from(r),
                file,
                path: path.to_path_buf(),
                cap,
            },
            w,
        ))
    }

    /// The log file.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Copies the pipe into the file, capped, until the pipe ends or, once `criu` (a pidfd of
    /// the writer) is readable (it exited), until the pipe holds nothing more.
    pub(crate) fn copy(mut self, criu: Option<OwnedFd>) -> std::io::Result<Copied> {
        use rustix::event::{poll, PollFd, PollFlags};
        let mut tail = Ring::new(self.cap.tail);
        let mut head_left = self.cap.head;
        let mut total = 0u64;
        let mut buf = vec![0u8; 64 << 10];
        let mut exited = false;
        let mut failed: Option<std::io::Error> = None;
        loop {
            if !exited {
                let mut fds = vec![PollFd::new(&self.pipe, PollFlags::IN)];
                if let Some(c) = &criu {
                    fds.push(PollFd::new(c, PollFlags::IN));
                }
                match poll(&mut fds, -1) {
                    Err(rustix::io::Errno::INTR) => continue,
                    Err(e) => return Err(e.into()),
                    Ok(_) => {}
                }
                let pipe_ready = !fds[0].revents().is_empty();
                if fds.get(1).is_some_and(|f| !f.revents().is_empty()) {
                    // CRIU is gone: take what it left in the pipe, never wait for more.
                    exited = true;
                    rustix::fs::fcntl_setfl(self.pipe.as_fd(), rustix::fs::OFlags::NONBLOCK)?;
                }
                if !pipe_ready && !exited {
                    continue;
                }
            }
            let n = match self.pipe.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => return Err(e),
            };
            total += n as u64;
            let mut data = &buf[..n];
            if head_left > 0 {
                let (now, rest) = data.split_at(head_left.min(data.len()));
                if failed.is_none() {
                    // Kept on draining after a failed write: see the module docs.
                    failed = self.file.write_all(now).err();
                }
                head_left -= now.len();
                data = rest;
            }
            tail.push(data);
        }
        if let Some(e) = failed {
            return Err(e);
        }
        let kept_tail = tail.len() as u64;
        let cut = tail.dropped;
        if cut > 0 {
            writeln!(
                self.file,
                "\n[cryo: {cut} bytes of CRIU's log cut here: {total} bytes in all, the first {} \
                 and the last {kept_tail} kept]",
                self.cap.head
            )?;
        }
        let (a, b) = tail.parts();
        self.file.write_all(a)?;
        self.file.write_all(b)?;
        Ok(Copied { total, cut })
    }
}

/// A dump's log, written by CRIU into a file, kept within its cap (see the module docs).
#[derive(Debug)]
pub(crate) struct FileCap {
    path: PathBuf,
    cap: LogCap,
    /// The file is punched up to here.
    punched: u64,
}

/// How far past its cap a file grows before the next punch.
const PUNCH_SLACK: u64 = 1 << 20;

/// How often a log file CRIU writes is punched (the file gives no event to wait for). CRIU's
/// log grows by at most ~100 MB in that time (a restorer looping on one line wrote 2.7 GB in
/// minutes).
const PUNCH_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

impl FileCap {
    pub(crate) fn new(path: &Path, cap: LogCap) -> FileCap {
        FileCap {
            path: path.to_path_buf(),
            cap,
            punched: 0,
        }
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn open(&self) -> std::io::Result<File> {
        File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&self.path)
    }

    /// While CRIU writes: frees the bytes between the head and the tail's room.
    pub(crate) fn punch(&mut self) -> std::io::Result<()> {
        let f = match self.open() {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let size = f.metadata()?.len();
        let (head, tail) = (self.cap.head as u64, self.cap.tail as u64);
        if size <= head + tail + PUNCH_SLACK {
            return Ok(());
        }
        let from = head.next_multiple_of(4096).max(self.punched);
        let to = (size - tail) / 4096 * 4096;
        if to > from {
            use rustix::fs::FallocateFlags as F;
            rustix::fs::fallocate(&f, F::PUNCH_HOLE | F::KEEP_SIZE, from, to - from)?;
            self.punched = to;
        }
        Ok(())
    }

    /// Keeps the file within its cap while CRIU writes it: punches it every 100 ms until
    /// `done` ends (its sender dropped: CRIU exited or answered), then [`FileCap::finish`]es it.
    pub(crate) fn keep_capped(
        mut self,
        done: &std::sync::mpsc::Receiver<()>,
    ) -> std::io::Result<Copied> {
        use std::sync::mpsc::RecvTimeoutError;
        loop {
            if let Err(e) = self.punch() {
                tracing::debug!(error = %e, "cannot punch CRIU's log");
            }
            match done.recv_timeout(PUNCH_EVERY) {
                Err(RecvTimeoutError::Timeout) => continue,
                _ => break,
            }
        }
        self.finish()
    }

    /// Once CRIU exited: the file becomes its head, one line saying what was cut, and its
    /// tail.
    pub(crate) fn finish(self) -> std::io::Result<Copied> {
        use std::os::unix::fs::FileExt;
        let f = match self.open() {
            Ok(f) => f,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Copied::default()),
            Err(e) => return Err(e),
        };
        let total = f.metadata()?.len();
        let (head, tail) = (self.cap.head as u64, self.cap.tail as u64);
        if total <= head + tail {
            return Ok(Copied { total, cut: 0 });
        }
        let cut = total - head - tail;
        let mut end = vec![0u8; self.cap.tail];
        f.read_exact_at(&mut end, total - tail)?;
        let line = format!(
            "\n[cryo: {cut} bytes of CRIU's log cut here: {total} bytes in all, the first {head} \
             and the last {tail} kept]\n"
        );
        f.write_all_at(line.as_bytes(), head)?;
        f.write_all_at(&end, head + line.len() as u64)?;
        f.set_len(head + line.len() as u64 + tail)?;
        Ok(Copied { total, cut })
    }
}

/// The last `cap` bytes pushed, and how many fell out.
struct Ring {
    buf: Vec<u8>,
    cap: usize,
    /// Where the next byte goes once `buf` is full.
    start: usize,
    dropped: u64,
}

impl Ring {
    fn new(cap: usize) -> Ring {
        Ring {
            buf: Vec::new(),
            cap,
            start: 0,
            dropped: 0,
        }
    }

    fn len(&self) -> usize {
        self.buf.len()
    }

    fn push(&mut self, mut data: &[u8]) {
        if self.cap == 0 {
            self.dropped += data.len() as u64;
            return;
        }
        if data.len() > self.cap {
            let skip = data.len() - self.cap;
            self.dropped += self.buf.len() as u64 + skip as u64;
            self.buf.clear();
            self.start = 0;
            data = &data[skip..];
        }
        let room = self.cap - self.buf.len();
        let (fill, rest) = data.split_at(room.min(data.len()));
        self.buf.extend_from_slice(fill);
        // Full: overwrite the oldest bytes. `rest` is at most `cap` bytes.
        self.dropped += rest.len() as u64;
        let mut rest = rest;
        while !rest.is_empty() {
            let n = rest.len().min(self.cap - self.start);
            self.buf[self.start..self.start + n].copy_from_slice(&rest[..n]);
            self.start = (self.start + n) % self.cap;
            rest = &rest[n..];
        }
    }

    /// The bytes kept, oldest first, as two slices.
    fn parts(&self) -> (&[u8], &[u8]) {
        let (a, b) = self.buf.split_at(self.start);
        (b, a)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    fn ring_text(r: &Ring) -> Vec<u8> {
        let (a, b) = r.parts();
        [a, b].concat()
    }

    #[test]
    fn the_ring_keeps_the_last_bytes_and_counts_the_rest() {
        let mut r = Ring::new(5);
        r.push(b"abc");
        assert_eq!(ring_text(&r), b"abc");
        r.push(b"defg");
        assert_eq!(ring_text(&r), b"cdefg");
        assert_eq!(r.dropped, 2);
        r.push(b"0123456789");
        assert_eq!(ring_text(&r), b"56789");
        assert_eq!(r.dropped, 12);
        r.push(b"x");
        assert_eq!(ring_text(&r), b"6789x");
        assert_eq!(r.dropped, 13);
    }

    /// A writer that logs far past the cap: the file holds the head, one line saying what was
    /// cut, and the tail, and never more than the cap and that line.
    #[test]
    fn a_log_past_its_cap_keeps_head_and_tail() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("restore.log");
        let cap = LogCap {
            head: 1000,
            tail: 3000,
        };
        let (log, w) = CappedLog::pipe(&path, cap).unwrap();
        let lines: Vec<String> = (0..50_000).map(|i| format!("line {i}\n")).collect();
        let all = lines.concat();
        let writer = {
            let all = all.clone();
            std::thread::spawn(move || {
                let mut w = File::from(w);
                w.write_all(all.as_bytes()).unwrap();
            })
        };
        let copied = log.copy(None).unwrap();
        writer.join().unwrap();
        assert_eq!(copied.total, all.len() as u64);
        assert_eq!(copied.cut, all.len() as u64 - 4000);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.starts_with(&all[..1000]), "{}", &text[..100]);
        assert!(text.ends_with(&all[all.len() - 3000..]));
        assert!(text.contains(&format!("{} bytes of CRIU's log cut here", copied.cut)));
        assert!(text.len() < 4000 + 200, "{}", text.len());
    }

    #[test]
    fn a_short_log_is_copied_whole() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dump.log");
        let (log, w) = CappedLog::pipe(&path, LogCap::default()).unwrap();
        File::from(w).write_all(b"(00.000001) hello\n").unwrap();
        let copied = log.copy(None).unwrap();
        assert_eq!(copied, Copied { total: 18, cut: 0 });
        assert_eq!(std::fs::read(&path).unwrap(), b"(00.000001) hello\n");
    }

    /// A dump's log grows far past its cap while CRIU runs: the disk holds the head and the
    /// tail only, and once CRIU is done the file is head, the cut line and tail.
    #[test]
    fn a_dump_log_is_punched_while_written_and_cut_at_the_end() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("dump.log");
        let cap = LogCap {
            head: 8192,
            tail: 8192,
        };
        let mut fc = FileCap::new(&path, cap);
        fc.punch().unwrap();
        let mut w = File::options()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap();
        let mut all = Vec::new();
        for i in 0..20_000 {
            let line = format!("({i:08}) pie: 1: preadv returned 0\n");
            w.write_all(line.as_bytes()).unwrap();
            all.extend_from_slice(line.as_bytes());
            if i % 5000 == 4999 {
                fc.punch().unwrap();
                let m = std::fs::metadata(&path).unwrap();
                assert!(
                    m.blocks() * 512 <= 8192 + 8192 + PUNCH_SLACK + (1 << 20),
                    "{} bytes on disk for {} written",
                    m.blocks() * 512,
                    all.len()
                );
            }
        }
        drop(w);
        let copied = fc.finish().unwrap();
        assert_eq!(copied.total, all.len() as u64);
        assert_eq!(copied.cut, all.len() as u64 - 16384);
        let text = std::fs::read(&path).unwrap();
        assert!(text.starts_with(&all[..8192]));
        assert!(text.ends_with(&all[all.len() - 8192..]));
        let middle = String::from_utf8_lossy(&text[8192..text.len() - 8192]).into_owned();
        assert!(middle.contains("bytes of CRIU's log cut here"), "{middle}");

        // A short log is left as it is.
        std::fs::write(&path, b"short\n").unwrap();
        let fc = FileCap::new(&path, cap);
        assert_eq!(fc.finish().unwrap(), Copied { total: 6, cut: 0 });
        assert_eq!(std::fs::read(&path).unwrap(), b"short\n");
    }

    /// A log file that cannot be written (a full disk) never stops the pipe from being drained:
    /// a pipe without a reader would raise SIGPIPE in whoever writes the log.
    #[test]
    fn a_log_that_cannot_be_written_is_still_drained() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("restore.log");
        let (mut log, w) = CappedLog::pipe(&path, LogCap::default()).unwrap();
        // Every write fails, as on a full disk.
        log.file = File::open("/dev/null").unwrap();
        let writer = std::thread::spawn(move || {
            let mut w = File::from(w);
            let chunk = vec![b'x'; 1 << 20];
            for _ in 0..8 {
                w.write_all(&chunk).unwrap();
            }
        });
        assert!(log.copy(None).is_err());
        writer.join().unwrap();
    }

    /// The writer exited but someone else (a restored process that inherited it) still holds
    /// the pipe's write end: the copy ends once what is in the pipe is taken.
    #[test]
    fn the_copy_ends_when_the_writer_exits_even_if_the_pipe_stays_open() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("restore.log");
        let (log, w) = CappedLog::pipe(&path, LogCap::default()).unwrap();
        let mut w = File::from(w);
        w.write_all(b"before exit\n").unwrap();
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_child(&child),
            rustix::process::PidfdFlags::empty(),
        )
        .unwrap();
        child.wait().unwrap();
        let copied = log.copy(Some(pidfd)).unwrap();
        assert_eq!(copied.total, 12);
        assert_eq!(std::fs::read(&path).unwrap(), b"before exit\n");
        drop(w);
    }
}
