//! Hashing a dump as CRIU writes it: while CRIU writes its image files into the staging
//! directory itself (`criu dump -D STAGING`, the bare route's writes), one thread at idle
//! priority reads back every whole chunk of CRIU's pages files (from the page cache) as CRIU
//! writes them, hashes it and starts its writeback; once CRIU waits at cryo's `post-dump`
//! gate (every file written) it takes every other file too, while CRIU kills the tree and
//! waits for it to exit. Publish, once the worker is gone, hashes only the tails and what the
//! follower did not reach, and its fsync finds the image on its way to the disk.
//!
//! # Design
//! Publish's hashing is CPU: BLAKE3 of a pages file read back from the page cache costs 1.18
//! core-s per 4 GiB on this 2-core VM (issue 16, session 12), so a follower started at the
//! gate (CRIU exits 17-60 ms after the verdict) reached 4-46 MiB of a 4 GiB dump and publish
//! took >= ~590 ms against the bare route's sync of ~466-552 ms. CRIU's dump writes the pages
//! on about one core for ~2.8 s at 4 GiB: the follower hashes them there, on what CRIU leaves
//! of the cores (`SCHED_IDLE`: it runs only on a core nothing else wants), and publish is
//! left with the fsyncs. Measured (session 13, release binaries, interleaved ABBA with the
//! follower started at the gate, fresh worker each, under the other helpers' load):
//! at 1 GiB (6 rounds, load 11.6-13.4) CRIU's CPU time (user + system, /usr/bin/time) 375
//! against 380 ms median, its dump 1262 against 1276 ms; at 4 GiB (5 rounds, load 9.9-11.6)
//! the dump 8716 against 8314 ms (paired ratio 0.986), publish 2260 against 3079 ms (paired
//! 1.195), the follower reaching 2.1 GB of 4.3 before publish. (Sessions 9-10 measured a
//! follower beside CRIU at +100-280 ms of dump at 1 GiB under load 5-9, 8-10 rounds; not seen
//! in CRIU's CPU time here.) Where the cores are not full the follower does run beside CRIU,
//! and costs it (session 21, `scripts/measure/freeze-ab.py`, paired rounds, load 0.5-8,
//! docs/benchmarks.md): with the follower from the gate (`CRYO_FOLLOW_EARLY=0`) CRIU's page
//! loop was 1.08-1.64x faster at 1 GiB in five runs of 10-12 rounds and worker gone 1.05-1.66x
//! sooner, but durable 0.70-1.00x (publish hashes and writes back everything after the worker's
//! end); at 4 GiB one run of three favoured the gate on every moment and two the follower from
//! the dump's start (durable 1.11x, 1.24x): it stays. Its writeback costs CRIU most when it
//! runs right behind CRIU: a follower that only started the writeback of CRIU's whole chunks
//! as CRIU wrote them (reading nothing, hashing from the gate) made the loop 1.59x slower than
//! this one, whose writeback is paced by its hashing, at 1 GiB. Its writeback covers only
//! whole chunks CRIU is done with: the writeback of ranges CRIU was still writing into (partial
//! pages included) cost CRIU's page phase 400-450 -> 600-900 ms at 1 GiB (session 9). Whole files are not
//! written back at once at the gate: a `sync_file_range` over a whole file blocks on the
//! disk's queue and held the hashes back (publish 756 against 450 ms).
//!
//! A chunk is hashed only when it can no longer change. Before the gate only CRIU's pages
//! files (`pages-<id>.img`) are taken: CRIU 4.2 opens each once (`open_page_local_xfer`:
//! `O_WRONLY | O_CREAT | O_TRUNC`, the id from a counter of the CRIU process, so no second
//! open truncates it) and writes it only by `splice` at the file's own position
//! (`write_pages_loc`), i.e. front to back, never seeking back or punching (auto-dedup and
//! parent images, which do, are not used by cryo); `splice` copies the pages into the page
//! cache as it writes them. A file's length grows only once its bytes are in the page
//! cache, so a chunk below the length is final. Every other file (the small images CRIU's
//! buffered writer may still rewrite) is taken only once CRIU is at its gate, done writing.
//! Nothing but CRIU writes in the staging directory: it is cryo's own, made fresh and private
//! to root (0700, see [`super::Staging`]), so a byte changed there after the follower hashed
//! it is root's doing and is refused at thaw (the manifest holds what CRIU wrote); one changed
//! before is what the image holds. Files are opened with `O_NOFOLLOW | O_NONBLOCK` (no link
//! followed, no FIFO waited on) and refused unless fstat says a regular file, and publish
//! takes a followed file's digests only if the file at that name is still the inode the
//! follower read (a file swapped in during the dump is refused) and is not shorter than what
//! was hashed.
//!
//! # Limitations
//! The files the follower is told to skip (CRIU's log, which cryo caps and rewrites) and those
//! it did not reach are hashed whole at publish. One thread: on a host whose cores CRIU and
//! others keep busy it hashes little, and publish does the rest at the normal priority. The
//! pages-file argument is CRIU 4.2's code: a CRIU that rewrote a pages file would make the
//! manifest refuse the image at thaw (safe, but the image lost); `CRYO_FOLLOW_EARLY=0` starts
//! the follower at the gate instead.

use std::collections::BTreeMap;
use std::fs::File;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use super::manifest::DigestAlg;
use super::{hash, sys, ImageError};

/// How often the follower looks for what CRIU wrote since.
const FOLLOW_EVERY: Duration = Duration::from_millis(20);

/// One file the follower read: the digests of its first `chunks.len()` whole chunks.
#[derive(Debug)]
pub(crate) struct Followed {
    /// The file, opened without following a link.
    pub(crate) file: File,
    /// Its device and inode when opened.
    pub(crate) dev: u64,
    pub(crate) ino: u64,
    /// The digests of its first chunks, in order.
    pub(crate) chunks: Vec<String>,
}

impl Followed {
    /// Bytes hashed (whole chunks).
    pub(crate) fn hashed(&self, chunk: u64) -> u64 {
        self.chunks.len() as u64 * chunk
    }

    /// Whether `f` (opened at the same name) is the file the follower read, and it is at least
    /// as long as what was hashed; the reason why not otherwise.
    pub(crate) fn still(&self, f: &File, size: u64, chunk: u64) -> Result<(), String> {
        let m = f.metadata().map_err(|e| e.to_string())?;
        if (m.dev(), m.ino()) != (self.dev, self.ino) {
            return Err("replaced by another file during the dump".into());
        }
        let hashed = self.hashed(chunk);
        if size < hashed {
            return Err(format!(
                "{size} bytes at publish, {hashed} hashed as CRIU wrote them"
            ));
        }
        Ok(())
    }
}

/// What the follower read, by file name.
pub(crate) type Follow = BTreeMap<String, Followed>;

/// A follower thread, stopped and waited for when dropped.
#[derive(Debug)]
pub(crate) struct Follower {
    stop: std::sync::Arc<AtomicBool>,
    /// Set once CRIU wrote every file (its gate): the follower takes every file from then on,
    /// only the pages files before.
    all: std::sync::Arc<AtomicBool>,
    /// Bytes hashed so far.
    hashed: std::sync::Arc<AtomicU64>,
    thread: Option<std::thread::JoinHandle<Follow>>,
}

impl Follower {
    /// Starts following `dir` (see [`follow`]); `None` if no thread could be started (then
    /// publish hashes everything).
    pub(crate) fn start(dir: &Path, chunk: u64, skip: &[&str], all: bool) -> Option<Follower> {
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let all = std::sync::Arc::new(AtomicBool::new(all));
        let hashed = std::sync::Arc::new(AtomicU64::new(0));
        let (dir, skip_owned) = (
            dir.to_path_buf(),
            skip.iter().map(|s| s.to_string()).collect::<Vec<_>>(),
        );
        let (s, a, h) = (
            std::sync::Arc::clone(&stop),
            std::sync::Arc::clone(&all),
            std::sync::Arc::clone(&hashed),
        );
        let thread = std::thread::Builder::new()
            .name("cryo-follow".into())
            .spawn(move || {
                let skip: Vec<&str> = skip_owned.iter().map(String::as_str).collect();
                follow(&dir, chunk, &skip, &s, &a, &h)
            })
            .map_err(|e| tracing::warn!(error = %e, "no follower: publish hashes the whole dump"))
            .ok()?;
        Some(Follower {
            stop,
            all,
            hashed,
            thread: Some(thread),
        })
    }

    /// Bytes hashed so far.
    pub(crate) fn hashed(&self) -> u64 {
        self.hashed.load(Ordering::SeqCst)
    }

    /// CRIU wrote every file: the follower takes them all from its next look on.
    pub(crate) fn take_all(&self) {
        self.all.store(true, Ordering::SeqCst);
        if let Some(t) = &self.thread {
            t.thread().unpark();
        }
    }

    /// Stops the follower and takes what it hashed. Publish waits for it here, so it runs at
    /// the normal priority from now on: an idle thread stopped mid-chunk on a busy host would
    /// otherwise hold publish back for as long as the other threads keep the cores.
    pub(crate) fn finish(mut self) -> Follow {
        self.stop_and_join()
    }

    /// Tells the thread to stop, puts it back at the normal priority and waits for it (at most
    /// the chunk it is reading).
    fn stop_and_join(&mut self) -> Follow {
        self.stop.store(true, Ordering::SeqCst);
        let Some(t) = self.thread.take() else {
            return Follow::new();
        };
        // Made idle before it looked at `stop` (see `follow`): this comes after, or it saw
        // `stop` and put itself back.
        if let Err(e) = sys::set_normal_priority_of(&t) {
            tracing::debug!(error = %e, "the follower stays idle while publish waits for it");
        }
        t.thread().unpark();
        let followed = t.join().unwrap_or_default();
        tracing::debug!(bytes = self.hashed(), "the follower stopped");
        followed
    }
}

/// A dump that failed (its staging directory dropped unpublished) waits for its follower too:
/// in a long-lived process (the agent) a follower left to run at idle priority on a busy host
/// would keep its thread and the dump's files (their disk space) for as long as the host stays
/// busy, one more each failed dump.
impl Drop for Follower {
    fn drop(&mut self) {
        drop(self.stop_and_join());
    }
}

/// Follows `dir` until `stop` is set: every [`FOLLOW_EVERY`] (and once more when stopped,
/// hashing nothing more then), each regular file not in `skip` is opened (once) and every
/// whole `chunk` CRIU has written since is hashed (all of them at once when started at the
/// gate, CRIU done writing). Runs at
/// idle priority where the kernel lets it. Never fails: what it cannot read is left to publish.
pub(crate) fn follow(
    dir: &Path,
    chunk: u64,
    skip: &[&str],
    stop: &AtomicBool,
    all: &AtomicBool,
    hashed: &AtomicU64,
) -> Follow {
    if let Err(e) = sys::set_idle_priority(true) {
        tracing::debug!(error = %e, "the follower keeps its priority");
    }
    // Stopped before it made itself idle: [`Follower::finish`] may have put it back at the
    // normal priority before that, and waits for it.
    if stop.load(Ordering::SeqCst) {
        let _ = sys::set_idle_priority(false);
    }
    let chunk = chunk.max(1);
    let mut files = Follow::new();
    let mut dropped: Vec<String> = Vec::new();
    let mut buf = vec![0u8; usize::try_from(chunk).unwrap_or(usize::MAX)];
    loop {
        // Read before the listing: a file listed after CRIU's gate is one CRIU wrote whole.
        let every = all.load(Ordering::SeqCst);
        if let Ok(rd) = std::fs::read_dir(dir) {
            for e in rd.flatten() {
                let Ok(name) = e.file_name().into_string() else {
                    continue;
                };
                if !(every || is_pages(&name))
                    || skip.contains(&name.as_str())
                    || files.contains_key(&name)
                    || dropped.contains(&name)
                    || !e.file_type().is_ok_and(|t| t.is_file())
                {
                    continue;
                }
                match open(&dir.join(&name)) {
                    Ok(f) => {
                        files.insert(name, f);
                    }
                    Err(e) => {
                        tracing::debug!(file = name, error = %e, "not followed: publish hashes it");
                        dropped.push(name);
                    }
                }
            }
        }
        for (name, f) in &mut files {
            if !catch_up(f, chunk, &mut buf, stop, hashed) {
                dropped.push(name.clone());
            }
        }
        files.retain(|n, _| !dropped.contains(n));
        if stop.load(Ordering::Relaxed) {
            return files;
        }
        // Woken early when told to stop.
        std::thread::park_timeout(FOLLOW_EVERY);
    }
}

/// Whether `name` is a pages file of CRIU's (`pages-<id>.img`), the only files followed while
/// CRIU writes (see the module's notes).
fn is_pages(name: &str) -> bool {
    name.strip_prefix("pages-")
        .and_then(|n| n.strip_suffix(".img"))
        .is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_digit()))
}

/// A regular file opened for reading ([`super::open_staged`]: no link followed, no FIFO
/// waited on).
fn open(path: &Path) -> std::io::Result<Followed> {
    let file = super::open_staged(path)?;
    let m = file.metadata()?;
    Ok(Followed {
        file,
        dev: m.dev(),
        ino: m.ino(),
        chunks: Vec::new(),
    })
}

/// Hashes every whole chunk of `f` written since; `false` if it cannot be read (publish then
/// hashes it whole).
fn catch_up(
    f: &mut Followed,
    chunk: u64,
    buf: &mut [u8],
    stop: &AtomicBool,
    hashed: &AtomicU64,
) -> bool {
    let Ok(size) = f.file.metadata().map(|m| m.len()) else {
        return false;
    };
    while f.hashed(chunk) + chunk <= size && !stop.load(Ordering::Relaxed) {
        if f.file.read_exact_at(buf, f.hashed(chunk)).is_err() {
            return false;
        }
        f.chunks.push(hash::digest(DigestAlg::Blake3, buf));
        hashed.fetch_add(chunk, Ordering::SeqCst);
        // Only a hint (publish's fsync does what it did not): a whole chunk CRIU is done
        // with, never the page it still writes into.
        let _ = sys::start_writeback(&f.file, f.hashed(chunk) - chunk, chunk);
    }
    true
}

/// Publish's side: the digests of every chunk of `f` (`size` bytes, at `path`), the first
/// ones from `followed` when it is still that file.
pub(crate) fn finish(
    path: &Path,
    f: &File,
    size: u64,
    chunk: u64,
    followed: Option<&Followed>,
) -> Result<Vec<String>, ImageError> {
    let Some(fo) = followed else {
        return hash::chunk_digests_from(f, 0, size, chunk).map_err(super::io(path));
    };
    fo.still(f, size, chunk)
        .map_err(|reason| ImageError::Unexpected {
            file: path.to_path_buf(),
            reason,
        })?;
    let mut chunks = fo.chunks.clone();
    chunks.extend(
        hash::chunk_digests_from(f, fo.hashed(chunk), size, chunk).map_err(super::io(path))?,
    );
    Ok(chunks)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;

    const CHUNK: u64 = 4096;

    fn blake3_chunks(data: &[u8]) -> Vec<String> {
        data.chunks(CHUNK as usize)
            .map(|c| blake3::hash(c).to_hex().to_string())
            .collect()
    }

    /// Opens `path` as publish does.
    fn reopen(path: &Path) -> (File, u64) {
        let f = super::super::open_staged(path).unwrap();
        let size = f.metadata().unwrap().len();
        (f, size)
    }

    /// A file CRIU is writing, followed: `chunks` whole chunks and a half one written, and
    /// the follower caught up with them.
    fn followed(chunks: usize) -> (tempfile::TempDir, std::path::PathBuf, Vec<u8>, Followed) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pages-1.img");
        let data: Vec<u8> = (0..chunks * CHUNK as usize + 100)
            .map(|i| (i * 13 + i / 4096) as u8)
            .collect();
        fs_write(&path, &data);
        let mut f = open(&path).unwrap();
        caught_up(&mut f);
        assert_eq!(f.chunks.len(), chunks, "whole chunks only");
        (dir, path, data, f)
    }

    /// The follower takes every whole chunk written so far (never stopped, nothing to yield to).
    fn caught_up(f: &mut Followed) {
        let mut buf = vec![0u8; CHUNK as usize];
        assert!(catch_up(
            f,
            CHUNK,
            &mut buf,
            &AtomicBool::new(false),
            &AtomicU64::new(0)
        ));
    }

    fn fs_write(path: &Path, data: &[u8]) {
        let mut w = File::create(path).unwrap();
        w.write_all(data).unwrap();
    }

    #[test]
    fn chunks_hashed_behind_the_writer_and_the_rest_at_publish_are_every_chunk() {
        let (_dir, path, mut data, mut f) = followed(2);
        // CRIU writes on: the follower takes the next whole chunk, publish the tail.
        let more: Vec<u8> = (0..CHUNK as usize + 7).map(|i| i as u8).collect();
        std::fs::OpenOptions::new()
            .append(true)
            .open(&path)
            .unwrap()
            .write_all(&more)
            .unwrap();
        data.extend_from_slice(&more);
        caught_up(&mut f);
        assert_eq!(f.chunks.len(), 3);
        let (pf, size) = reopen(&path);
        let got = finish(&path, &pf, size, CHUNK, Some(&f)).unwrap();
        assert_eq!(got, blake3_chunks(&data));
        // Not followed at all: publish hashes it whole, to the same digests.
        assert_eq!(finish(&path, &pf, size, CHUNK, None).unwrap(), got);
    }

    #[test]
    fn a_file_swapped_in_after_it_was_followed_is_refused() {
        let (dir, path, data, f) = followed(2);
        // Another file renamed over the name CRIU wrote (root's doing: the directory is 0700).
        let other = dir.path().join("other");
        fs_write(&other, &data);
        std::fs::rename(&other, &path).unwrap();
        let (pf, size) = reopen(&path);
        let err = finish(&path, &pf, size, CHUNK, Some(&f)).unwrap_err();
        assert!(err.to_string().contains("replaced"), "{err}");
    }

    #[test]
    fn a_file_cut_below_what_was_hashed_is_refused() {
        let (_dir, path, _data, f) = followed(3);
        File::options()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(CHUNK + 5)
            .unwrap();
        let (pf, size) = reopen(&path);
        let err = finish(&path, &pf, size, CHUNK, Some(&f)).unwrap_err();
        assert!(
            err.to_string().contains("hashed as CRIU wrote them"),
            "{err}"
        );
    }

    #[test]
    fn a_byte_flipped_after_the_follower_read_it_keeps_criu_s_digest() {
        let (_dir, path, data, f) = followed(2);
        let w = File::options().write(true).open(&path).unwrap();
        w.write_all_at(&[data[10] ^ 0xff], 10).unwrap();
        let (pf, size) = reopen(&path);
        let got = finish(&path, &pf, size, CHUNK, Some(&f)).unwrap();
        // The manifest holds what CRIU wrote: the image's check refuses the flipped file.
        assert_eq!(got, blake3_chunks(&data));
        assert_ne!(got, finish(&path, &pf, size, CHUNK, None).unwrap());
    }

    /// Waits until `f` hashed `bytes` (the positive event the follower's tests wait for).
    fn until_hashed(f: &Follower, bytes: u64) {
        let deadline = std::time::Instant::now() + cryo_testkit::PATIENCE;
        while f.hashed() < bytes {
            assert!(
                std::time::Instant::now() < deadline,
                "the follower hashed {} of {bytes} bytes",
                f.hashed()
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Attack: a follower started with CRIU's dump hashes what CRIU has not finished with.
    /// CRIU writes its pages files once, front to back; any other file (a small image CRIU's
    /// buffered writer may still rewrite, one it truncates and writes again) is taken only
    /// once CRIU reached its gate. Here a non-pages file is rewritten in place, to the same
    /// length, after the follower has seen it (it listed a pages file made after it and
    /// hashed that whole): the manifest must hold what the file holds at the gate.
    #[test]
    fn before_the_gate_only_pages_files_are_hashed() {
        let dir = tempfile::tempdir().unwrap();
        let other = dir.path().join("files.img");
        let before = vec![1u8; 2 * CHUNK as usize];
        fs_write(&other, &before);
        let f = Follower::start(dir.path(), CHUNK, &["dump.log"], false).unwrap();
        let pages = dir.path().join("pages-1.img");
        let data: Vec<u8> = (0..3 * CHUNK as usize).map(|i| i as u8).collect();
        fs_write(&pages, &data);
        until_hashed(&f, 3 * CHUNK);
        // CRIU writes `files.img` again before its gate.
        let after = vec![2u8; 2 * CHUNK as usize];
        fs_write(&other, &after);
        f.take_all();
        let followed = f.finish();
        let (pf, size) = reopen(&other);
        let got = finish(&other, &pf, size, CHUNK, followed.get("files.img")).unwrap();
        assert_eq!(
            got,
            blake3_chunks(&after),
            "a chunk CRIU rewrote was hashed early"
        );
        let (pf, size) = reopen(&pages);
        let got = finish(&pages, &pf, size, CHUNK, followed.get("pages-1.img")).unwrap();
        assert_eq!(got, blake3_chunks(&data));
        assert_eq!(followed["pages-1.img"].chunks.len(), 3, "hashed as written");
    }

    /// Past the gate the follower takes every file CRIU wrote, the pages files it followed
    /// keeping what it hashed of them.
    #[test]
    fn past_the_gate_every_file_is_followed() {
        let dir = tempfile::tempdir().unwrap();
        let pages = dir.path().join("pages-1.img");
        fs_write(&pages, &[3u8; 2 * CHUNK as usize]);
        let f = Follower::start(dir.path(), CHUNK, &["dump.log"], false).unwrap();
        until_hashed(&f, 2 * CHUNK);
        fs_write(&dir.path().join("core-1.img"), &[4u8; 2 * CHUNK as usize]);
        fs_write(&dir.path().join("dump.log"), &[5u8; 2 * CHUNK as usize]);
        f.take_all();
        until_hashed(&f, 4 * CHUNK);
        let followed = f.finish();
        assert_eq!(
            followed.keys().collect::<Vec<_>>(),
            ["core-1.img", "pages-1.img"]
        );
        assert_eq!(
            followed["core-1.img"].chunks,
            blake3_chunks(&[4u8; 2 * CHUNK as usize])
        );
    }

    #[test]
    fn only_criu_s_pages_file_names_are_pages_files() {
        for n in ["pages-1.img", "pages-65537.img"] {
            assert!(is_pages(n), "{n}");
        }
        for n in [
            "pages-.img",
            "pages-1.img.tmp",
            "pagemap-1.img",
            "pages-1a.img",
            "xpages-1.img",
        ] {
            assert!(!is_pages(n), "{n}");
        }
    }

    #[test]
    fn a_link_is_never_followed() {
        let dir = tempfile::tempdir().unwrap();
        let target = dir.path().join("target");
        fs_write(&target, &[1u8; 3 * CHUNK as usize]);
        let link = dir.path().join("pages-1.img");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(open(&link).is_err());
        fs_write(&dir.path().join("core-1.img"), b"core");
        fs_write(&dir.path().join("dump.log"), b"log");
        // Stopped at once: one pass opens what is there and hashes nothing.
        let files = follow(
            dir.path(),
            CHUNK,
            &["dump.log"],
            &AtomicBool::new(true),
            &AtomicBool::new(true),
            &AtomicU64::new(0),
        );
        assert_eq!(files.keys().collect::<Vec<_>>(), ["core-1.img", "target"]);
    }

    /// Runs `f` on a thread; its result, or `None` if it did not return within the test kit's
    /// patience (it blocks: the thread is left to `unblock`, which must make it return).
    fn returns<T: Send + 'static>(
        f: impl FnOnce() -> T + Send + 'static,
        unblock: impl FnOnce(),
    ) -> Option<T> {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        let got = rx.recv_timeout(cryo_testkit::PATIENCE).ok();
        if got.is_none() {
            unblock();
        }
        t.join().unwrap();
        got
    }

    /// A staging directory holding a FIFO named as a pages file; the directory and the FIFO.
    fn staged_fifo() -> (tempfile::TempDir, std::path::PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("pages-1.img");
        nix::unistd::mkfifo(
            &fifo,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )
        .unwrap();
        (dir, fifo)
    }

    /// Opens `fifo` for writing without blocking (a reader blocked in its open returns).
    fn release(fifo: &Path) {
        let _ = File::options()
            .read(true)
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(fifo);
    }

    /// Attack: a FIFO put in the staging directory (by root, after the gate's listing: the
    /// follower lists regular files, then opens them) is never waited on: opening it for
    /// reading would block until a writer comes, i.e. forever, and the follower with it
    /// (publish waits for the follower). It is refused (not a regular file) at once.
    #[test]
    fn the_follower_never_waits_on_a_fifo_put_in_the_staging_directory() {
        let (_dir, fifo) = staged_fifo();
        let path = fifo.clone();
        let got = returns(move || open(&path).map(drop), || release(&fifo));
        let err = got.expect("the follower blocked opening a FIFO");
        assert!(err.is_err(), "a FIFO was followed");
    }

    /// Attack: the same FIFO reaches publish (put there between publish's listing and its
    /// open): refused at once, never waited on.
    #[test]
    fn publish_never_waits_on_a_fifo_put_in_the_staging_directory() {
        let (dir, fifo) = staged_fifo();
        let d = dir.path().to_path_buf();
        let got = returns(
            move || {
                super::super::hash_and_sync(
                    &d,
                    &["pages-1.img".to_string()],
                    CHUNK,
                    || Ok(BTreeMap::new()),
                    &Follow::new(),
                )
                .map(drop)
                .map_err(|e| e.to_string())
            },
            || release(&fifo),
        );
        let err = got.expect("publish blocked opening a FIFO").unwrap_err();
        assert!(err.contains("pages-1.img"), "{err}");
    }

    #[test]
    fn the_gate_refuses_a_staging_directory_with_anything_but_files() {
        let parent = tempfile::tempdir().unwrap();
        let staging = super::super::Staging::create(&parent.path().join("img")).unwrap();
        fs_write(&staging.path().join("core-1.img"), b"core");
        staging.check_dumped().unwrap();
        let link = staging.path().join("pages-1.img");
        std::os::unix::fs::symlink("/etc/hostname", &link).unwrap();
        let err = staging.check_dumped().unwrap_err();
        assert!(err.to_string().contains("pages-1.img"), "{err}");
        std::fs::remove_file(&link).unwrap();
        nix::unistd::mkfifo(&link, nix::sys::stat::Mode::S_IRUSR).unwrap();
        assert!(staging.check_dumped().is_err());
        std::fs::remove_file(&link).unwrap();
        // The directory itself swapped for another of the same name.
        let away = parent.path().join("away");
        std::fs::rename(staging.path(), &away).unwrap();
        std::fs::create_dir(staging.path()).unwrap();
        let err = staging.check_dumped().unwrap_err();
        assert!(err.to_string().contains("replaced"), "{err}");
        std::fs::remove_dir(staging.path()).unwrap();
        std::fs::rename(&away, staging.path()).unwrap();
    }
}
