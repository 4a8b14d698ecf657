//! Checksums of image files.
//!
//! Format 3 (what publish writes): the BLAKE3 of every chunk of every file, chunks hashed in
//! parallel on rayon's pool, read with `pread`, so one big pages file uses every core. Verify
//! and the thaw streamer check the same chunks ([`Span`]s), in parallel too.
//!
//! The thaw's check beside CRIU ([`check_spans_in_order`]) hashes a span whose pages are all
//! cached through a read-only mapping of its file (`mapped`: no copy into a buffer, a page that
//! cannot be read an error, not a SIGBUS that ends the process), and reads the others.
//!
//! Formats 1 and 2 (SHA-256 of each file, and of each 64 MiB chunk in format 2) are still
//! checked; their writer is kept ([`sha256_file`]) so that tests can make images of those
//! formats.

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::FileExt;

use rayon::prelude::*;
use sha2::{Digest, Sha256};

use super::manifest::DigestAlg;
use super::mapped::Mapped;

/// Bytes read per call when a span is checked without keeping it.
pub(crate) const BUF: usize = 1 << 20;

/// A running digest of one of the manifest's algorithms.
enum Hasher {
    Sha256(Box<Sha256>),
    Blake3(Box<blake3::Hasher>),
}

impl Hasher {
    fn new(alg: DigestAlg) -> Hasher {
        match alg {
            DigestAlg::Sha256 => Hasher::Sha256(Box::default()),
            DigestAlg::Blake3 => Hasher::Blake3(Box::default()),
        }
    }

    fn update(&mut self, data: &[u8]) {
        match self {
            Hasher::Sha256(h) => h.update(data),
            Hasher::Blake3(h) => {
                h.update(data);
            }
        }
    }

    fn hex(self) -> String {
        match self {
            Hasher::Sha256(h) => hex::encode(h.finalize()),
            Hasher::Blake3(h) => h.finalize().to_hex().to_string(),
        }
    }
}

/// The digest of `data`, lower-case hex.
pub(crate) fn digest(alg: DigestAlg, data: &[u8]) -> String {
    let mut h = Hasher::new(alg);
    h.update(data);
    h.hex()
}

/// Reads exactly `buf.len()` bytes at `offset`, or fewer at the end of the file; returns how
/// many.
fn read_full_at(f: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(done)
}

/// The BLAKE3 of every `chunk`-byte chunk of the first `size` bytes of `f`, chunks in
/// parallel; `Err(UnexpectedEof)` if the file is shorter than `size`.
#[cfg(test)]
pub(crate) fn chunk_digests(f: &File, size: u64, chunk: u64) -> std::io::Result<Vec<String>> {
    chunk_digests_from(f, 0, size, chunk)
}

/// [`chunk_digests`] of the chunks from byte `from` (a multiple of `chunk`) on.
pub(crate) fn chunk_digests_from(
    f: &File,
    from: u64,
    size: u64,
    chunk: u64,
) -> std::io::Result<Vec<String>> {
    let chunk = chunk.max(1);
    let first = from / chunk;
    let n = size.div_ceil(chunk);
    let buf_len = usize::try_from(chunk.min(size.saturating_sub(from))).unwrap_or(usize::MAX);
    (first..n)
        .into_par_iter()
        .map_init(
            || vec![0u8; buf_len],
            |buf, k| {
                let offset = k * chunk;
                let len = usize::try_from(chunk.min(size - offset)).unwrap_or(usize::MAX);
                let got = read_full_at(f, &mut buf[..len], offset)?;
                if got < len {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                Ok(digest(DigestAlg::Blake3, &buf[..len]))
            },
        )
        .collect()
}

/// Format 1 and 2 checksums of one file, as the writer of those formats made them: size, the
/// whole-file SHA-256, and (with `chunk`) the SHA-256 of each chunk when there is more than one.
pub(crate) fn sha256_file(
    f: &mut File,
    chunk: Option<u64>,
) -> std::io::Result<(u64, String, Vec<String>)> {
    let mut whole = Sha256::new();
    let mut chunks = Vec::new();
    let mut part = Sha256::new();
    let mut filled = 0u64;
    let mut size = 0u64;
    let mut buf = vec![0u8; BUF];
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        whole.update(&buf[..n]);
        size += n as u64;
        let Some(c) = chunk else { continue };
        let mut data = &buf[..n];
        while !data.is_empty() {
            let room = usize::try_from(c - filled).unwrap_or(usize::MAX);
            let (now, rest) = data.split_at(room.min(data.len()));
            part.update(now);
            filled += now.len() as u64;
            data = rest;
            if filled == c {
                chunks.push(hex::encode(part.finalize_reset()));
                filled = 0;
            }
        }
    }
    if filled > 0 {
        chunks.push(hex::encode(part.finalize()));
    }
    if chunks.len() <= 1 {
        chunks.clear();
    }
    Ok((size, hex::encode(whole.finalize()), chunks))
}

/// A byte range of a file and the digest it must have.
#[derive(Debug, Clone)]
pub(crate) struct Span<'a> {
    /// Index of the file in the manifest.
    pub(crate) file: usize,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) digest: &'a str,
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

/// Reads span `s` of `f` into `out` (replacing its content) and checks it: the bytes in `out`
/// are then exactly the ones that matched, whatever happens to the file afterwards.
pub(crate) fn read_checked(
    f: &File,
    s: &Span<'_>,
    alg: DigestAlg,
    out: &mut Vec<u8>,
) -> Result<(), SpanError> {
    let len = usize::try_from(s.len)
        .map_err(|_| SpanError::Io(std::io::ErrorKind::OutOfMemory.into()))?;
    // Resized only when the span's length changes: zeroing 4 MiB per chunk would cost as much
    // as another copy of the image.
    if out.len() != len {
        out.resize(len, 0);
    }
    let got = read_full_at(f, out, s.offset).map_err(SpanError::Io)?;
    if got < len {
        return Err(SpanError::Short {
            found: s.offset + got as u64,
        });
    }
    if s.last {
        ends_at(f, s.offset + s.len)?;
    }
    if matches(alg, s, out) {
        Ok(())
    } else {
        Err(SpanError::Mismatch)
    }
}

/// Checks span `s` of `f` without keeping its bytes (`buf` is scratch space).
pub(crate) fn check_span(
    f: &File,
    s: &Span<'_>,
    alg: DigestAlg,
    buf: &mut [u8],
) -> Result<(), SpanError> {
    let mut h = Hasher::new(alg);
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
    verdict(f, s, h)
}

/// Checks span `s` of `f` through `m`, `f` mapped ([`Mapped`]): hashed where its bytes lie in
/// the page cache, no copy. A page that cannot be read (the file shrank, its storage failed) is
/// an error, never a signal that ends the process, as long as [`Mapped::guarded`] holds (the
/// caller asks just before, and again after: a span hashed while it did not is read again).
pub(crate) fn check_span_mapped(
    m: &Mapped,
    f: &File,
    s: &Span<'_>,
    alg: DigestAlg,
) -> Result<(), SpanError> {
    let end = s.offset + s.len;
    let (Ok(offset), Ok(len)) = (usize::try_from(s.offset), usize::try_from(s.len)) else {
        return Err(SpanError::Io(std::io::ErrorKind::OutOfMemory.into()));
    };
    if offset.saturating_add(len) > m.len() {
        // Mapped as long as the file was when opened: it was shorter than the span then.
        return Err(SpanError::Short {
            found: m.len() as u64,
        });
    }
    m.populate(offset, len).map_err(|e| lost(f, end, e))?;
    mapped_span_failpoint(f);
    #[cfg(test)]
    if let Some(hook) = AFTER_POPULATE
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .as_ref()
    {
        hook();
    }
    let mut h = Hasher::new(alg);
    h.update(&m.bytes()[offset..offset + len]);
    m.release(offset, len);
    if m.faulted() {
        return Err(lost(f, end, std::io::Error::from_raw_os_error(libc::EIO)));
    }
    verdict(f, s, h)
}

/// Failpoint [`super::check::CHECK_MAPPED_SPAN_PAUSES`] for a span of `f` (only where
/// `CRYO_FAILPOINT` names it: the file's name is read then, to pause page contents only).
fn mapped_span_failpoint(f: &File) {
    use super::check::{is_page_contents, read_stall_failpoint, CHECK_MAPPED_SPAN_PAUSES};
    use std::os::fd::AsRawFd;
    if std::env::var_os("CRYO_FAILPOINT").is_some_and(|v| v == CHECK_MAPPED_SPAN_PAUSES)
        && std::fs::read_link(format!("/proc/self/fd/{}", f.as_raw_fd())).is_ok_and(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(is_page_contents)
        })
    {
        read_stall_failpoint(CHECK_MAPPED_SPAN_PAUSES);
    }
}

/// Test hook: runs on the checking thread between a mapped span's populate and its hash, where
/// a page lost faults under the hash (what no file system does on cue).
#[cfg(test)]
pub(crate) static AFTER_POPULATE: std::sync::Mutex<Option<Box<dyn Fn() + Send>>> =
    std::sync::Mutex::new(None);

/// The verdict on span `s` of `f`, hashed into `h`: nothing may follow a file's last span, and
/// the digest must match (an empty span without a digest is an empty file of format 3).
fn verdict(f: &File, s: &Span<'_>, h: Hasher) -> Result<(), SpanError> {
    if s.last {
        ends_at(f, s.offset + s.len)?;
    }
    if s.len == 0 && s.digest.is_empty() || h.hex().eq_ignore_ascii_case(s.digest) {
        Ok(())
    } else {
        Err(SpanError::Mismatch)
    }
}

/// Whether all of span `s` of the file mapped by `m` is in the page cache.
fn resident(m: &Mapped, s: &Span<'_>) -> bool {
    match (usize::try_from(s.offset), usize::try_from(s.len)) {
        (Ok(offset), Ok(len)) => m.resident(offset, len),
        _ => false,
    }
}

/// Why a page of a mapped file up to `end` could not be read: the file is shorter now, or
/// else its storage failed (`e`).
fn lost(f: &File, end: u64, e: std::io::Error) -> SpanError {
    match f.metadata() {
        Ok(m) if m.len() < end => SpanError::Short { found: m.len() },
        _ => SpanError::Io(e),
    }
}

/// Whether `data` (all of span `s`) matches; an empty span without a digest (an empty file of
/// format 3, which has no chunks) matches nothing but emptiness.
fn matches(alg: DigestAlg, s: &Span<'_>, data: &[u8]) -> bool {
    if s.len == 0 && s.digest.is_empty() {
        return data.is_empty();
    }
    digest(alg, data).eq_ignore_ascii_case(s.digest)
}

fn ends_at(f: &File, end: u64) -> Result<(), SpanError> {
    let mut b = [0u8; 1];
    loop {
        match f.read_at(&mut b, end) {
            Ok(0) => return Ok(()),
            Ok(_) => return Err(SpanError::Long),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(SpanError::Io(e)),
        }
    }
}

/// Checks every span in the order given, `threads` at a time, each thread taking the next span
/// not taken yet, so that together they read each file front to back, as CRIU's restore does
/// (each thread keeps its file open: the kernel's sequential readahead serves it). No more
/// than that is asked of the disk: reading 64 MiB ahead (`POSIX_FADV_WILLNEED`) queued CRIU's
/// own small reads behind it and slowed a cold 1 GiB restore from 0.53 to 0.9-1.3 s. `open`
/// opens a file of the manifest by index. Stops early after a failure and returns the first failing span (in
/// `spans` order among those that ran) and why. Stops before the next span once `stop` is set
/// (its restore no longer needs the answer): `Ok` then says only that no span checked failed,
/// not that every span was checked (the caller reads `stop` to tell).
pub(crate) fn check_spans_in_order_until(
    spans: &[Span<'_>],
    alg: DigestAlg,
    threads: usize,
    stop: &std::sync::atomic::AtomicBool,
    open: impl Fn(usize) -> std::io::Result<File> + Sync,
) -> Result<(), (usize, SpanError)> {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering::Relaxed};
    let next = AtomicUsize::new(0);
    let failed = AtomicBool::new(false);
    let errors = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..threads.max(1) {
            s.spawn(|| {
                let mut buf = vec![0u8; BUF];
                // The file the last span was in, kept open (and mapped, where it can be: see
                // `mapped`) for the next ones.
                let mut cur: Option<(usize, File, Option<Mapped>)> = None;
                loop {
                    let i = next.fetch_add(1, Relaxed);
                    if i >= spans.len() || failed.load(Relaxed) || stop.load(Relaxed) {
                        return;
                    }
                    let sp = &spans[i];
                    if cur.as_ref().map(|c| c.0) != Some(sp.file) {
                        drop(cur.take());
                        cur = match open(sp.file) {
                            Ok(f) => {
                                let m = f.metadata().ok().and_then(|md| Mapped::of(&f, md.len()));
                                Some((sp.file, f, m))
                            }
                            Err(e) => {
                                failed.store(true, Relaxed);
                                let mut errs = errors.lock().unwrap_or_else(|p| p.into_inner());
                                errs.push((i, SpanError::Io(e)));
                                return;
                            }
                        };
                    }
                    let Some((_, f, m)) = &cur else { return };
                    // Cached: hashed where it lies. Not (yet) cached, from a cold disk: read,
                    // whose readahead streams the file (a mapping's faults read it in
                    // smaller pieces). Nor while a SIGBUS handler installed after cryo's
                    // would get a lost page's fault (`mapped`); one installed during the
                    // hash may have been given a fault of the span and answered it its own
                    // way (the bytes hashed then are not the file's): the span is read again.
                    let r = match m {
                        Some(m) if resident(m, sp) && m.guarded() => {
                            match check_span_mapped(m, f, sp, alg) {
                                _ if !m.guarded() => check_span(f, sp, alg, &mut buf),
                                r => r,
                            }
                        }
                        _ => check_span(f, sp, alg, &mut buf),
                    };
                    if let Err(e) = r {
                        failed.store(true, Relaxed);
                        errors
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .push((i, e));
                        return;
                    }
                }
            });
        }
    });
    let mut errors = errors.into_inner().unwrap_or_else(|p| p.into_inner());
    errors.sort_by_key(|(i, _)| *i);
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// [`check_spans_in_order_until`], never stopped (the tests').
#[cfg(test)]
pub(crate) fn check_spans_in_order(
    spans: &[Span<'_>],
    alg: DigestAlg,
    threads: usize,
    open: impl Fn(usize) -> std::io::Result<File> + Sync,
) -> Result<(), (usize, SpanError)> {
    let never = std::sync::atomic::AtomicBool::new(false);
    check_spans_in_order_until(spans, alg, threads, &never, open)
}

/// Checks every span, in parallel, bigger spans first; `open` opens a file of the manifest by
/// index (each span opens its file: an image of many processes has more files than the fd limit
/// allows open at once). Stops early after a failure and returns the first failing span (in
/// `spans` order among those that ran) and why.
pub(crate) fn check_spans(
    spans: &[Span<'_>],
    alg: DigestAlg,
    open: impl Fn(usize) -> std::io::Result<File> + Sync,
) -> Result<(), (usize, SpanError)> {
    let mut order: Vec<usize> = (0..spans.len()).collect();
    order.sort_by_key(|&i| std::cmp::Reverse(spans[i].len));
    let failed = std::sync::atomic::AtomicBool::new(false);
    let mut errors: Vec<(usize, SpanError)> = order
        .par_iter()
        .map_init(
            || vec![0u8; BUF],
            |buf, &i| {
                if failed.load(std::sync::atomic::Ordering::Relaxed) {
                    return None;
                }
                let r = open(spans[i].file)
                    .map_err(SpanError::Io)
                    .and_then(|f| check_span(&f, &spans[i], alg, buf));
                match r {
                    Ok(()) => None,
                    Err(e) => {
                        failed.store(true, std::sync::atomic::Ordering::Relaxed);
                        Some((i, e))
                    }
                }
            },
        )
        .flatten()
        .collect();
    errors.sort_by_key(|(i, _)| *i);
    match errors.into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    const CHUNK: u64 = 64 << 10;

    /// A file of `n` chunks and a trailing partial one, and its spans.
    fn file_and_digests(n: u64) -> (tempfile::NamedTempFile, Vec<String>, u64) {
        let size = n * CHUNK + 1234;
        let data: Vec<u8> = (0..size).map(|i| (i * 13 + i / 777) as u8).collect();
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), &data).unwrap();
        let digests = data
            .chunks(CHUNK as usize)
            .map(|c| digest(DigestAlg::Blake3, c))
            .collect();
        (f, digests, size)
    }

    fn spans_of(digests: &[String], size: u64) -> Vec<Span<'_>> {
        digests
            .iter()
            .enumerate()
            .map(|(k, d)| {
                let offset = k as u64 * CHUNK;
                Span {
                    file: 0,
                    offset,
                    len: CHUNK.min(size - offset),
                    digest: d,
                    last: k + 1 == digests.len(),
                }
            })
            .collect()
    }

    #[test]
    fn in_order_check_passes_a_whole_file_and_names_the_first_bad_chunk() {
        let (f, digests, size) = file_and_digests(20);
        let spans = spans_of(&digests, size);
        let open = |_| File::open(f.path());
        for threads in [1, 3] {
            check_spans_in_order(&spans, DigestAlg::Blake3, threads, open).unwrap();
        }
        // One flipped byte in chunk 7 and one in chunk 15: chunk 7 is named.
        let mut data = std::fs::read(f.path()).unwrap();
        data[(7 * CHUNK + 5) as usize] ^= 1;
        data[(15 * CHUNK + 5) as usize] ^= 1;
        std::fs::write(f.path(), &data).unwrap();
        for threads in [1, 3] {
            let (i, e) =
                check_spans_in_order(&spans, DigestAlg::Blake3, threads, open).unwrap_err();
            assert!(matches!(e, SpanError::Mismatch), "{e:?}");
            assert!(
                i == 7 || (threads > 1 && i == 15),
                "{threads} threads: chunk {i}"
            );
        }
    }

    #[test]
    fn in_order_check_refuses_a_file_that_shrank_or_grew() {
        let (f, digests, size) = file_and_digests(5);
        let spans = spans_of(&digests, size);
        let open = |_| File::open(f.path());
        let data = std::fs::read(f.path()).unwrap();
        std::fs::write(f.path(), &data[..data.len() - 10]).unwrap();
        let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 2, open).unwrap_err();
        assert_eq!(i, 5);
        assert!(matches!(e, SpanError::Short { .. }), "{e:?}");
        let mut longer = data.clone();
        longer.push(0);
        std::fs::write(f.path(), &longer).unwrap();
        let (_, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 2, open).unwrap_err();
        assert!(matches!(e, SpanError::Long), "{e:?}");
        let gone = |_| File::open("/nonexistent/cryo-test");
        let (i, e) = check_spans_in_order(&spans, DigestAlg::Blake3, 1, gone).unwrap_err();
        assert_eq!(i, 0);
        assert!(matches!(e, SpanError::Io(_)), "{e:?}");
    }
}
