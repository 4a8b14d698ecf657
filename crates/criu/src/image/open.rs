//! An image directory opened for use: trusted (see `trust`), its manifest read and checked,
//! its listing and sizes matching the manifest. What each byte must hash to is known; the
//! bytes themselves are checked by [`Image::verify`] or, during a thaw, by the streamer as it
//! serves them.

use std::collections::BTreeSet;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use super::hash::{self, Span, SpanError};
use super::manifest::{DigestAlg, Manifest, FORMAT_VERSION, MANIFEST_FILE, OLDEST_FORMAT_VERSION};
use super::{io, is_staging_name, split, trust, ImageError};

/// An opened, trusted image whose manifest and file sizes check out.
#[derive(Debug)]
pub struct Image {
    /// The path as the caller gave it (for messages).
    dir: PathBuf,
    fd: OwnedFd,
    manifest: Manifest,
    /// Every file of the manifest, in its order, as [`Image::open`] checked it
    /// ([`Image::open_file`] reads it once its name is gone: a publish that replaced the image
    /// removes the old one's files). Empty for an image [`Image::adopt`]ed from another
    /// process (its files are opened by name alone then).
    files: Vec<File>,
}

/// How many times [`Image::open`] opens an image again that was replaced while it opened it.
const REPLACED_RETRIES: u32 = 3;

/// Whether `dir` names another directory now than the one `taken` is (a publish exchanged
/// it); a path that cannot be looked at is not taken for a replacement.
fn replaced(dir: &Path, taken: &OwnedFd) -> bool {
    let (Ok(now), Ok(then)) = (rustix::fs::stat(dir), rustix::fs::fstat(taken)) else {
        return false;
    };
    (now.st_dev, now.st_ino) != (then.st_dev, then.st_ino)
}

impl Image {
    /// Opens the image at `dir`: nobody but root can change it or the path to it, the manifest
    /// parses, is of a known format and matches its own digest, the chunk lists cover every
    /// byte, every listed file is there (a regular file of the listed size) and nothing else
    /// is. Reads no file content but the manifest's.
    ///
    /// A publish that replaces the image exchanges the directories and then removes the old
    /// one, so an open that took the old directory just before the exchange may find its files
    /// going: such a failure, when `dir` names another directory by then, is an open of the
    /// image that replaced it (the path held a whole image at every moment), tried again a few
    /// times, never a refusal of an image that is there. Every file stays open from then on
    /// (one descriptor each): a reader of an image replaced after it was opened reads the old
    /// one whole though its files lost their names, and a name that comes to hold another file
    /// is refused ([`Image::open_file`]).
    pub fn open(dir: &Path) -> Result<Image, ImageError> {
        let mut tries = 0;
        loop {
            match Self::open_once(dir) {
                Ok(image) => return Ok(image),
                Err((e, Some(taken))) if tries < REPLACED_RETRIES && replaced(dir, &taken) => {
                    tracing::debug!(dir = %dir.display(), %e, "image replaced while opened: opening the new one");
                    tries += 1;
                }
                Err((e, _)) => return Err(e),
            }
        }
    }

    /// [`Image::open`], given up at `deadline` (the restore's): an image whose file system does
    /// not answer (a dead disk, an NFS hard mount, a FUSE server) is refused then
    /// ([`ImageError::Unanswered`]), and the thread left waiting on it is counted in
    /// `abandoned_checks` until it returns, as the thaw's check does. `None`: no deadline, opened
    /// on the caller's thread.
    pub fn open_until(
        dir: &Path,
        deadline: Option<std::time::Instant>,
    ) -> Result<Image, ImageError> {
        let Some(deadline) = deadline else {
            return Image::open(dir);
        };
        let owned = dir.to_path_buf();
        super::check::within_deadline(dir, deadline, move || Image::open(&owned)).unwrap_or_else(
            || {
                Err(ImageError::Unanswered {
                    dir: dir.to_path_buf(),
                    what: "opening the image and reading its manifest".into(),
                })
            },
        )
    }

    /// One [`Image::open`]; a failure after the directory was opened comes with its fd.
    fn open_once(dir: &Path) -> Result<Image, (ImageError, Option<OwnedFd>)> {
        let (_, name) = split(dir).map_err(|e| (e, None))?;
        if is_staging_name(&name) {
            return Err((
                ImageError::Staging {
                    dir: dir.to_path_buf(),
                },
                None,
            ));
        }
        let (_, fd) = trust::open_image_dir(dir).map_err(|e| (e, None))?;
        let read = |fd: &OwnedFd| -> Result<Manifest, ImageError> {
            let mpath = dir.join(MANIFEST_FILE);
            let (mut mf, _) = trust::open_image_file(fd, dir, MANIFEST_FILE)?;
            let mut bytes = Vec::new();
            mf.read_to_end(&mut bytes).map_err(io(&mpath))?;
            parse_manifest(&mpath, &bytes)
        };
        let manifest = match read(&fd) {
            Ok(m) => m,
            Err(e) => return Err((e, Some(fd))),
        };
        let mut image = Image {
            dir: dir.to_path_buf(),
            fd,
            manifest,
            files: Vec::new(),
        };
        match image.check_listing() {
            Ok(files) => {
                image.files = files;
                Ok(image)
            }
            Err(e) => Err((e, Some(image.fd))),
        }
    }

    /// The image whose directory `fd` is (opened and checked by another process: the image
    /// checker's, see `checker`), with the manifest that process read; `dir` names it in
    /// messages. Each file is still opened through the trust checks ([`Image::open_file`]).
    pub(crate) fn adopt(dir: PathBuf, fd: OwnedFd, manifest: Manifest) -> Image {
        Image {
            dir,
            fd,
            manifest,
            files: Vec::new(),
        }
    }

    /// An image opened by the opener process ([`super::opener`]): its directory's fd and every
    /// file's, taken out of it, and the manifest as cryo parsed it.
    pub(crate) fn adopt_opened(
        dir: PathBuf,
        fd: OwnedFd,
        manifest: Manifest,
        files: Vec<File>,
    ) -> Image {
        Image {
            dir,
            fd,
            manifest,
            files,
        }
    }

    /// The fd numbers of the directory and of every file held (the opener says them).
    pub(crate) fn raw_fds(&self) -> (std::os::fd::RawFd, Vec<std::os::fd::RawFd>) {
        use std::os::fd::AsRawFd;
        (
            self.fd.as_raw_fd(),
            self.files.iter().map(AsRawFd::as_raw_fd).collect(),
        )
    }

    /// [`Image::open_until`], the look made in a process of its own where this binary serves
    /// as one ([`super::opener`]): for a command that must be able to exit at `deadline` even
    /// when the image's file system never answers (a thread stuck there would keep it alive).
    pub fn open_apart(dir: &Path, deadline: std::time::Instant) -> Result<Image, ImageError> {
        if super::checker::serves() {
            super::opener::open_apart(dir, deadline)
        } else {
            Image::open_until(dir, Some(deadline))
        }
    }

    /// Another handle on the same opened image (the directory's fd and every file's held
    /// open duplicated, so a name that comes to hold another file is refused through it too):
    /// for a thread that may outlive the caller's borrow (the thaw's check, abandoned when its
    /// read, open or stat hangs).
    pub(crate) fn try_clone(&self) -> Result<Image, ImageError> {
        let err = |source| ImageError::Io {
            path: self.dir.clone(),
            source,
        };
        let fd = self.fd.try_clone().map_err(err)?;
        let files = self
            .files
            .iter()
            .map(File::try_clone)
            .collect::<Result<Vec<_>, _>>()
            .map_err(err)?;
        Ok(Image {
            files,
            ..Image::adopt(self.dir.clone(), fd, self.manifest.clone())
        })
    }

    /// The manifest.
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    /// The manifest, giving up the image.
    pub fn into_manifest(self) -> Manifest {
        self.manifest
    }

    /// The image directory as given to [`Image::open`].
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Reads and checks every chunk of every file (all in parallel).
    pub fn verify(&self) -> Result<(), ImageError> {
        self.verify_files(|_| true)
    }

    /// Starts reading the front of the page contents (`pages-*.img`, the image's bulk) into the
    /// page cache, on a thread of its own, and returns at once, so that CRIU's first reads and
    /// the check's find them there after the prechecks. One `POSIX_FADV_WILLNEED` per file:
    /// the kernel reads at most one readahead window of it per call (`force_page_cache_ra`
    /// caps the request at the larger of the device's largest request and the readahead
    /// window: 8 MiB on this project's host), not the whole file; from there CRIU's and the
    /// check's own readahead carry the reads. Asking for the whole file in window-sized steps
    /// was measured worse (issue 16, session 18, 4 GiB cold at load 8-9: CRIU's step about
    /// twice as long; docs/benchmarks.md). Only advice: nothing is read into cryo's memory or
    /// mapped (a file truncated meanwhile is the check's to refuse), the kernel drops the
    /// request under memory pressure, and a file that does not open is left to the check to
    /// report. At most half the memory the host has available is asked for.
    pub fn prefetch_page_contents(&self) {
        let Ok(available) = cryo_proc::mem_available() else {
            return;
        };
        // The opens too on the prefetch's thread: on a file system that stops answering they
        // hang it, never the thaw (whose own opens are under its deadline); it is counted with
        // the checks' stuck looks until it ends, and none is started past their budget.
        let Ok(image) = self.try_clone() else {
            return;
        };
        let advise = move || {
            let mut budget = available / 2;
            let mut files = Vec::new();
            for i in 0..image.manifest.files.len() {
                if budget == 0 || !super::check::is_page_contents(&image.manifest.files[i].name) {
                    continue;
                }
                if let Ok((f, len)) = image.open_file(i) {
                    files.push((f, len.min(budget)));
                    budget -= len.min(budget);
                }
            }
            for (f, len) in files {
                if let Err(e) = rustix::fs::fadvise(&f, 0, len, rustix::fs::Advice::WillNeed) {
                    tracing::debug!(error = %e, "prefetching the page contents");
                }
            }
        };
        if !super::check::in_background(advise) {
            tracing::debug!(
                stuck = super::check::abandoned_checks(),
                "no prefetch of the page contents (earlier looks at images are stuck, or no thread)"
            );
        }
    }

    /// Reads and checks every chunk of the files whose name `pick` takes (all in parallel).
    pub(crate) fn verify_files(&self, pick: impl Fn(&str) -> bool) -> Result<(), ImageError> {
        let spans: Vec<Span<'_>> = spans(&self.manifest)
            .into_iter()
            .filter(|s| pick(&self.manifest.files[s.file].name))
            .collect();
        hash::check_spans(&spans, self.alg(), |i| {
            self.open_file(i).map(|(f, _)| f).map_err(to_io)
        })
        .map_err(|(i, e)| self.span_error(&spans[i], e))
    }

    /// Reads and checks every chunk of the files whose name `pick` takes, in the manifest's
    /// order, each file front to back, `threads` at a time ([`hash::check_spans_in_order_until`]).
    pub(crate) fn verify_files_in_order(
        &self,
        pick: impl Fn(&str) -> bool,
        threads: usize,
    ) -> Result<(), ImageError> {
        let never = std::sync::atomic::AtomicBool::new(false);
        self.verify_files_in_order_until(pick, threads, &never)
    }

    /// [`Image::verify_files_in_order`], stopping at the next chunk once `stop` is set (see
    /// `Check::stop`): then never `Ok`, since what was not checked cannot pass.
    pub(crate) fn verify_files_in_order_until(
        &self,
        pick: impl Fn(&str) -> bool,
        threads: usize,
        stop: &std::sync::atomic::AtomicBool,
    ) -> Result<(), ImageError> {
        let spans: Vec<Span<'_>> = spans(&self.manifest)
            .into_iter()
            .filter(|s| pick(&self.manifest.files[s.file].name))
            .collect();
        hash::check_spans_in_order_until(&spans, self.alg(), threads, stop, |i| {
            self.open_file(i).map(|(f, _)| f).map_err(to_io)
        })
        .map_err(|(i, e)| self.span_error(&spans[i], e))?;
        if stop.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(ImageError::Stream {
                dir: self.dir.clone(),
                reason: "the check was stopped before it read every chunk".into(),
            });
        }
        Ok(())
    }

    /// The directory, as opened and checked.
    pub(crate) fn dir_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        std::os::fd::AsFd::as_fd(&self.fd)
    }

    pub(crate) fn alg(&self) -> DigestAlg {
        self.manifest.digest_alg()
    }

    /// Opens file `i` of the manifest (trusted, see `trust`) by its name in the directory (what
    /// CRIU reads, so what is checked is what is restored); checks its size. The name must
    /// still be the file [`Image::open`] checked (another file there: refused as changed);
    /// once gone (a publish that replaced the image removes the old one's files), it is that
    /// file still, a description of its own.
    pub(crate) fn open_file(&self, i: usize) -> Result<(File, u64), ImageError> {
        let f = &self.manifest.files[i];
        let path = self.dir.join(&f.name);
        let (file, size) = match trust::open_image_file(&self.fd, &self.dir, &f.name) {
            Ok((file, size)) => {
                if let Some(held) = self.files.get(i) {
                    if !same_file(&file, held, &path)? {
                        return Err(ImageError::Changed {
                            dir: self.dir.clone(),
                            what: format!("{}: another file than the one opened", f.name),
                        });
                    }
                }
                (file, size)
            }
            Err(ImageError::Missing { .. }) if i < self.files.len() => {
                trust::reopen_image_file(&self.files[i], &path)?
            }
            Err(e) => return Err(e),
        };
        if size < f.size {
            return Err(ImageError::Truncated {
                file: path,
                expected: f.size,
                found: size,
            });
        }
        if size > f.size {
            return Err(ImageError::Oversized {
                file: path,
                expected: f.size,
                found: size,
            });
        }
        Ok((file, size))
    }

    /// Index of the file named `name` in the manifest.
    pub(crate) fn index_of(&self, name: &str) -> Option<usize> {
        self.manifest.files.iter().position(|f| f.name == name)
    }

    /// The error for span `s` failing with `e`.
    pub(crate) fn span_error(&self, s: &Span<'_>, e: SpanError) -> ImageError {
        let f = &self.manifest.files[s.file];
        let file = self.dir.join(&f.name);
        match e {
            SpanError::Mismatch if s.len == f.size && f.chunks.len() <= 1 => {
                ImageError::Checksum { file }
            }
            SpanError::Mismatch => ImageError::ChunkChecksum {
                file,
                offset: s.offset,
                end: s.offset + s.len,
            },
            SpanError::Short { found } => ImageError::Truncated {
                file,
                expected: f.size,
                found,
            },
            SpanError::Long => ImageError::Oversized {
                found: std::fs::metadata(&file).map_or(f.size + 1, |m| m.len()),
                file,
                expected: f.size,
            },
            SpanError::Io(e) => io(&file)(e),
        }
    }

    /// Every entry of the directory is the manifest or a listed file; every listed file opens
    /// as a trusted regular file of its listed size.
    /// Checks that the directory holds the manifest's files and nothing else; returns them,
    /// opened and checked, in the manifest's order.
    fn check_listing(&self) -> Result<Vec<File>, ImageError> {
        let listed: BTreeSet<&str> = self
            .manifest
            .files
            .iter()
            .map(|f| f.name.as_str())
            .collect();
        // Read through our own fd: the listing is of the directory that was checked.
        let proc_path = PathBuf::from(format!("/proc/self/fd/{}", self.fd.as_raw_fd()));
        for entry in std::fs::read_dir(&proc_path).map_err(io(&self.dir))? {
            let entry = entry.map_err(io(&self.dir))?;
            let fname = entry.file_name();
            let fname = fname.to_string_lossy();
            if fname != MANIFEST_FILE && !listed.contains(fname.as_ref()) {
                return Err(ImageError::Unlisted {
                    file: self.dir.join(fname.as_ref()),
                });
            }
        }
        (0..self.manifest.files.len())
            .map(|i| self.open_file(i).map(|(f, _)| f))
            .collect()
    }
}

/// Whether `a` and `b` are the same file (device and inode); `path` names `a` in messages.
fn same_file(a: &File, b: &File, path: &Path) -> Result<bool, ImageError> {
    use std::os::unix::fs::MetadataExt;
    let (a, b) = (
        a.metadata().map_err(io(path))?,
        b.metadata().map_err(io(path))?,
    );
    Ok((a.dev(), a.ino()) == (b.dev(), b.ino()))
}

fn to_io(e: ImageError) -> std::io::Error {
    std::io::Error::other(e.to_string())
}

/// What gets hashed: every chunk of files that have chunk digests, the whole of the others.
pub(crate) fn spans(m: &Manifest) -> Vec<Span<'_>> {
    (0..m.files.len()).flat_map(|i| file_spans(m, i)).collect()
}

/// The spans of file `i`, in order.
pub(crate) fn file_spans(m: &Manifest, i: usize) -> Vec<Span<'_>> {
    let f = &m.files[i];
    let chunk = m.chunk_size.filter(|_| !f.chunks.is_empty());
    let Some(chunk) = chunk else {
        if f.chunks.is_empty() && f.sha256.is_empty() {
            // Format 3, empty file: nothing to hash, but nothing may be there either.
            return vec![Span {
                file: i,
                offset: 0,
                len: 0,
                digest: "",
                last: true,
            }];
        }
        return vec![Span {
            file: i,
            offset: 0,
            len: f.size,
            digest: &f.sha256,
            last: true,
        }];
    };
    let mut out = Vec::with_capacity(f.chunks.len());
    let mut offset = 0;
    for (k, digest) in f.chunks.iter().enumerate() {
        let len = chunk.min(f.size.saturating_sub(offset));
        out.push(Span {
            file: i,
            offset,
            len,
            digest,
            last: k + 1 == f.chunks.len(),
        });
        offset += len;
    }
    out
}

/// Reads and checks `manifest.json` at `mpath` without looking at the other files (and without
/// the trust checks of [`Image::open`]).
pub fn read_manifest(mpath: &Path) -> Result<Manifest, ImageError> {
    let bytes = match std::fs::read(mpath) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ImageError::Missing {
                file: mpath.to_path_buf(),
            })
        }
        Err(e) => return Err(io(mpath)(e)),
    };
    parse_manifest(mpath, &bytes)
}

pub(crate) fn parse_manifest(mpath: &Path, bytes: &[u8]) -> Result<Manifest, ImageError> {
    let bad = |reason: String| ImageError::BadManifest {
        file: mpath.to_path_buf(),
        reason,
    };
    // The format version first, so a newer manifest is reported as such, not as a parse error.
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
    let found = value
        .get("format_version")
        .and_then(serde_json::Value::as_u64)
        .ok_or_else(|| bad("no format_version".into()))?;
    if !(u64::from(OLDEST_FORMAT_VERSION)..=u64::from(FORMAT_VERSION)).contains(&found) {
        return Err(ImageError::UnsupportedFormat {
            file: mpath.to_path_buf(),
            found,
            supported: FORMAT_VERSION,
        });
    }
    let manifest: Manifest = serde_json::from_value(value).map_err(|e| bad(e.to_string()))?;
    let digest = manifest.self_digest().map_err(ImageError::Serialize)?;
    if !digest.eq_ignore_ascii_case(&manifest.manifest_sha256) {
        return Err(ImageError::Checksum {
            file: mpath.to_path_buf(),
        });
    }
    check_names(&manifest).map_err(bad)?;
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    if total != manifest.total_bytes {
        return Err(bad(format!(
            "total_bytes {} but the files add up to {total}",
            manifest.total_bytes
        )));
    }
    check_chunk_layout(&manifest).map_err(bad)?;
    check_nspids(&manifest).map_err(bad)?;
    Ok(manifest)
}

/// Whether the processes' namespace pids fit the format: from format 4 every process has them,
/// its pid (ours) first; before, none has.
fn check_nspids(m: &Manifest) -> Result<(), String> {
    for p in &m.processes {
        match (m.format_version >= 4, p.nspid.first()) {
            (true, Some(first)) if *first == p.pid => {}
            (true, _) => {
                return Err(format!(
                    "process {}: namespace pids {:?} do not start with its pid",
                    p.pid, p.nspid
                ))
            }
            (false, None) => {}
            (false, Some(_)) => {
                return Err(format!(
                    "process {}: namespace pids are format 4 on, this is format {}",
                    p.pid, m.format_version
                ))
            }
        }
    }
    Ok(())
}

fn check_names(m: &Manifest) -> Result<(), String> {
    let mut listed = BTreeSet::new();
    for f in &m.files {
        let n = f.name.as_str();
        if n.is_empty() || n == "." || n == ".." || n.contains('/') || n == MANIFEST_FILE {
            return Err(format!("file name {n:?} is not allowed"));
        }
        if !listed.insert(n) {
            return Err(format!("file {n:?} listed twice"));
        }
    }
    Ok(())
}

/// Whether the digests fit the sizes: format 1 has whole-file SHA-256 only; format 2 a chunk
/// size and, for every file longer than one chunk, one SHA-256 per chunk; format 3 BLAKE3, a
/// chunk size and one digest per chunk of every file (so the chunks cover every byte), as 4.
fn check_chunk_layout(m: &Manifest) -> Result<(), String> {
    let v = m.format_version;
    match (v, m.digest) {
        (1 | 2, None) | (3 | 4, Some(DigestAlg::Blake3)) => {}
        (_, d) => return Err(format!("format {v} with digest {d:?}")),
    }
    let Some(chunk) = m.chunk_size else {
        if v >= 2 {
            return Err(format!("format {v} without chunk_size"));
        }
        return match m.files.iter().find(|f| !f.chunks.is_empty()) {
            Some(f) => Err(format!(
                "file {:?} has chunk digests but no chunk_size",
                f.name
            )),
            None => Ok(()),
        };
    };
    if v < 2 {
        return Err(format!("format {v} with a chunk_size"));
    }
    if chunk == 0 {
        return Err("chunk_size 0".into());
    }
    for f in &m.files {
        let want = match v {
            2 if f.size <= chunk => 0,
            _ => f.size.div_ceil(chunk),
        };
        if f.chunks.len() as u64 != want {
            return Err(format!(
                "file {:?}: {} chunk digests, its {} bytes in chunks of {chunk} need {want}",
                f.name,
                f.chunks.len(),
                f.size
            ));
        }
        if (v >= 3) != f.sha256.is_empty() {
            return Err(format!(
                "file {:?}: a whole-file sha256 is format 1-2 only",
                f.name
            ));
        }
    }
    Ok(())
}
