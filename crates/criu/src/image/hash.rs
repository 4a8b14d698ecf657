//! SHA-256 of image files. At publish, each file is read once and feeds two hashers: the whole
//! file (what `sha256sum` prints) and its fixed-size chunks (on a second thread for files of
//! several chunks); files go in parallel. At verify,
//! the chunks of all files go in parallel, read with `pread`, so one big pages file uses every
//! core instead of one.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

/// Bytes read per call; one buffer per worker thread.
const BUF: usize = 1 << 20;
/// Most threads at publish (which also fsyncs: more would only queue on the disk).
const PUBLISH_THREADS: usize = 8;
/// Most threads at verify (nodes have 16+ cores; beyond that the disk is the limit).
const VERIFY_THREADS: usize = 16;

/// Size, whole-file hash and chunk hashes of one file.
pub(crate) struct Hashed {
    pub(crate) size: u64,
    pub(crate) sha256: String,
    /// Empty when the file is at most one chunk.
    pub(crate) chunks: Vec<String>,
}

/// One file's outcome; the error carries the path.
pub(crate) type HashResult = Result<Hashed, (PathBuf, std::io::Error)>;

/// Runs `work(i, buffer)` for every `i` of `order` on a rayon pool of up to `cap` threads
/// (bounded by `available_parallelism`), one job at a time per thread, taken in `order`. Once a
/// result is `failed`, no new job starts: the caller reports one failure, and a corrupt image is
/// refused without reading the rest. Results are by job index; `None` for a job that did not run.
fn parallel<T: Send>(
    order: &[usize],
    cap: usize,
    work: impl Fn(usize, &mut [u8]) -> T + Sync,
    failed: impl Fn(&T) -> bool + Sync,
) -> Vec<Option<T>> {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(cap)
        .min(order.len())
        .max(1);
    let stop = AtomicBool::new(false);
    let run = || -> Vec<(usize, T)> {
        order
            .par_iter()
            // One job per task: the biggest (first) jobs start first on every thread.
            .with_max_len(1)
            .map_init(
                || vec![0u8; BUF],
                |buf, &i| {
                    if stop.load(Ordering::Relaxed) {
                        return None;
                    }
                    let r = work(i, buf);
                    if failed(&r) {
                        stop.store(true, Ordering::Relaxed);
                    }
                    Some((i, r))
                },
            )
            .flatten()
            .collect()
    };
    let done = match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
        Ok(pool) => pool.install(run),
        // No threads to be had: the work still gets done, on this one.
        Err(_) => run(),
    };
    let mut results: Vec<Option<T>> = (0..order.len()).map(|_| None).collect();
    for (i, r) in done {
        if let Some(slot) = results.get_mut(i) {
            *slot = Some(r);
        }
    }
    results
}

/// Hashes `dir/name` for every name, whole and in chunks of `chunk_size` bytes, files in
/// parallel. With `sync`, each file is also fsync'd: it is open anyway. Results are in `names`
/// order.
pub(crate) fn hash_files(
    dir: &Path,
    names: &[String],
    sync: bool,
    chunk_size: u64,
) -> Vec<HashResult> {
    let order: Vec<usize> = (0..names.len()).collect();
    let results = parallel(
        &order,
        PUBLISH_THREADS,
        |i, buf| {
            let path = dir.join(&names[i]);
            hash_one(&path, sync, chunk_size, buf).map_err(|e| (path, e))
        },
        Result::is_err,
    );
    results
        .into_iter()
        .zip(names)
        .map(|(r, name)| {
            r.unwrap_or_else(|| {
                Err((
                    dir.join(name),
                    std::io::Error::other("not hashed (another file failed first)"),
                ))
            })
        })
        .collect()
}

fn hash_one(path: &Path, sync: bool, chunk_size: u64, buf: &mut [u8]) -> std::io::Result<Hashed> {
    let mut f = File::open(path)?;
    let mut chunker = Chunker::new(chunk_size);
    let (size, sha256) = if f.metadata()?.len() > chunker.size {
        hash_piped(&mut f, &mut chunker)?
    } else {
        let mut whole = Sha256::new();
        let mut size = 0u64;
        loop {
            let n = read_some(&mut f, buf)?;
            if n == 0 {
                break;
            }
            whole.update(&buf[..n]);
            chunker.update(&buf[..n]);
            size += n as u64;
        }
        (size, hex::encode(whole.finalize()))
    };
    if sync {
        f.sync_all()?;
    }
    Ok(Hashed {
        size,
        sha256,
        chunks: chunker.finish(),
    })
}

/// Buffers in flight between the reader (whole-file hash) and the chunk hasher.
const PIPE: usize = 3;

/// One read pass over a file of several chunks, with the whole-file hash on this thread and
/// the chunk hashes on a second one, fed the same buffers: a big file then publishes in about
/// the time of one SHA-256 pass, not two. Returns the size and the whole-file hash.
fn hash_piped(f: &mut File, chunker: &mut Chunker) -> std::io::Result<(u64, String)> {
    let (full_tx, full_rx) = mpsc::sync_channel::<(Vec<u8>, usize)>(PIPE);
    let (free_tx, free_rx) = mpsc::sync_channel::<Vec<u8>>(PIPE);
    for _ in 0..PIPE {
        free_tx
            .send(vec![0u8; BUF])
            .map_err(|_| std::io::Error::other("chunk hasher pipe closed"))?;
    }
    std::thread::scope(|s| {
        let chunks = s.spawn(move || {
            for (buf, n) in full_rx {
                chunker.update(&buf[..n]);
                // The reader may have stopped on an error; then the buffer is not needed.
                let _ = free_tx.send(buf);
            }
        });
        let mut whole = Sha256::new();
        let mut size = 0u64;
        let read = loop {
            let Ok(mut buf) = free_rx.recv() else {
                break Err(std::io::Error::other("chunk hasher stopped"));
            };
            let n = match read_some(f, &mut buf) {
                Ok(0) => break Ok(()),
                Ok(n) => n,
                Err(e) => break Err(e),
            };
            whole.update(&buf[..n]);
            size += n as u64;
            if full_tx.send((buf, n)).is_err() {
                break Err(std::io::Error::other("chunk hasher stopped"));
            }
        };
        drop(full_tx);
        chunks
            .join()
            .map_err(|_| std::io::Error::other("chunk hasher panicked"))?;
        read.map(|()| (size, hex::encode(whole.finalize())))
    })
}

fn read_some(f: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        match f.read(buf) {
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            r => return r,
        }
    }
}

/// SHA-256 of consecutive `size`-byte chunks of a stream.
struct Chunker {
    size: u64,
    hasher: Sha256,
    filled: u64,
    digests: Vec<String>,
}

impl Chunker {
    fn new(size: u64) -> Chunker {
        Chunker {
            size: size.max(1),
            hasher: Sha256::new(),
            filled: 0,
            digests: Vec::new(),
        }
    }

    fn update(&mut self, mut data: &[u8]) {
        while !data.is_empty() {
            let room = usize::try_from(self.size - self.filled).unwrap_or(usize::MAX);
            let (now, rest) = data.split_at(room.min(data.len()));
            self.hasher.update(now);
            self.filled += now.len() as u64;
            data = rest;
            if self.filled == self.size {
                self.digests.push(hex::encode(self.hasher.finalize_reset()));
                self.filled = 0;
            }
        }
    }

    /// The digests; none for a stream of at most one chunk (its whole hash is its check).
    fn finish(mut self) -> Vec<String> {
        if self.filled > 0 {
            self.digests.push(hex::encode(self.hasher.finalize()));
        }
        if self.digests.len() <= 1 {
            self.digests.clear();
        }
        self.digests
    }
}

/// A byte range of an open file and the SHA-256 it must have.
pub(crate) struct Span<'a> {
    /// Index of the file in the slice given to [`check_spans`].
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) sha256: &'a str,
    /// The span ends the file: nothing may follow it.
    pub(crate) last: bool,
}

/// Why a span failed.
#[derive(Debug)]
pub(crate) enum SpanError {
    Io(std::io::Error),
    /// The content differs.
    Mismatch,
    /// The file ended at `found` bytes, inside the span (it shrank after the size check).
    Short {
        found: u64,
    },
    /// The file goes on after its last span (it grew after the size check).
    Long,
}

/// Checks every span, in parallel on up to 16 threads, bigger spans first. Each span opens its
/// file (an image of many processes has more files than the fd limit allows open at once).
/// Returns the first failing span (in `spans` order among those that ran) and why.
pub(crate) fn check_spans(files: &[PathBuf], spans: &[Span<'_>]) -> Result<(), (usize, SpanError)> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(spans[i].len));
    let results = parallel(
        &order,
        VERIFY_THREADS,
        |i, buf| match files.get(spans[i].file) {
            Some(path) => File::open(path)
                .map_err(SpanError::Io)
                .and_then(|f| check_span(&f, &spans[i], buf)),
            None => Err(SpanError::Io(std::io::Error::other("span of no file"))),
        },
        Result::is_err,
    );
    let mut ran_all = true;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err((i, e)),
            None => ran_all = false,
        }
    }
    if ran_all {
        return Ok(());
    }
    // Jobs are skipped only after a failure, which is returned above.
    Err((
        0,
        SpanError::Io(std::io::Error::other("a verify worker did not report")),
    ))
}

fn check_span(f: &File, s: &Span<'_>, buf: &mut [u8]) -> Result<(), SpanError> {
    let mut h = Sha256::new();
    let end = s.offset + s.len;
    let mut pos = s.offset;
    while pos < end {
        let want = usize::try_from(end - pos).map_or(buf.len(), |r| r.min(buf.len()));
        let n = match f.read_at(&mut buf[..want], pos) {
            Ok(0) => return Err(SpanError::Short { found: pos }),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SpanError::Io(e)),
        };
        h.update(&buf[..n]);
        pos += n as u64;
    }
    if s.last {
        loop {
            match f.read_at(&mut buf[..1], end) {
                Ok(0) => break,
                Ok(_) => return Err(SpanError::Long),
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(SpanError::Io(e)),
            }
        }
    }
    if hex::encode(h.finalize()).eq_ignore_ascii_case(s.sha256) {
        Ok(())
    } else {
        Err(SpanError::Mismatch)
    }
}
