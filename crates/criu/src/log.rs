//! CRIU's log, capped: a file CRIU writes itself, of which the first [`LogCap::head`] and the
//! last [`LogCap::tail`] bytes are kept.
//!
//! # Why
//! CRIU writes its log itself, without a limit: a restorer spinning on a `preadv` that returns 0
//! wrote a 2.7 GB `restore.log` into `/tmp` in minutes (issue 16); a looping CRIU fills the disk
//! the node's images and journal live on. Where CRIU started and where it stopped are what a
//! failure is read from, so both ends are kept, with one line saying what was cut in between.
//!
//! # Design
//! Every CRIU run logs into a file in its work directory ([`FileCap`]): the gated commands
//! (`-o NAME`) and the `criu swrk` routes (CRIU's RPC takes a file name). While CRIU runs, the
//! bytes between the head and the last [`LogCap::tail`] are punched out of the file every
//! 100 ms as it grows (`FALLOC_FL_PUNCH_HOLE`: the disk holds the head and the tail only); once
//! CRIU is done, the file is cut to head, one line and tail.
//!
//! Never a pipe to cryo: CRIU's parasite (dump) and restorer (restore) write the log from inside
//! the dumped or restored processes, and a pipe whose reader died (cryo killed after its gate's
//! verdict, while CRIU still logs) raises `SIGPIPE` in them; blocked in the restorer, it is
//! delivered once the process runs, and kills one that does not handle it. A dump's log through
//! a pipe killed the worker so (session 6's test); a restore's did the same for every process
//! CRIU restored after a cryo that died past the verdict (its context still checkpointed:
//! nothing live torn down, but the worker lost).
//!
//! # Limitations
//! If cryo is killed, the log stays punched (sparse) without the line. A file system that cannot
//! punch holes keeps the log whole until CRIU is done. Between two punches CRIU may write what it
//! writes in 100 ms.

use std::fs::File;
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

/// What keeping a log did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct Copied {
    /// Bytes CRIU wrote.
    pub(crate) total: u64,
    /// Bytes left out of the file.
    pub(crate) cut: u64,
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::Write;

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
}
