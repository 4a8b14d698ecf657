//! Image directories: staged next to their final place, described by a manifest, published by
//! an atomic rename, trusted only when nobody but root can change them, checked byte for byte
//! as they are used.
//!
//! # Design
//! A freeze writes into `DIR.tmp-<random>` in DIR's parent ([`Staging`]), so the final rename
//! stays on one filesystem. CRIU writes its dump into it itself; a follower hashes every whole
//! chunk of its pages files as CRIU writes them ([`Staging::follow_pages`]), and of every file
//! once every byte is written (CRIU at its `post-dump` gate, [`Staging::follow_written`]), at
//! idle priority, starting each hashed chunk's writeback (`follow.rs`). (Or CRIU streams its
//! dump to a [`Capture`] ([`Staging::capture`]), which
//! writes each file into the staging directory, hashing every chunk on the way;
//! [`Staging::adopt`] hands those digests to publish.)
//! [`Staging::publish`] hashes every chunk of every file not captured (BLAKE3, chunks in
//! parallel, from the page cache) while fsyncing every file at once, writes `manifest.json`
//! last and fsyncs it and the directory, renames the staging directory to DIR with
//! `renameat2(RENAME_NOREPLACE)` (or `RENAME_EXCHANGE` when replacing, so DIR always holds a
//! whole image, the old or the new) and fsyncs the parent. A crash at any point
//! ([`PublishStep`]) leaves at DIR either nothing, the old image or the new one, never a part.
//! Staging directories hold an `flock` while in use; [`clean_stale`] (run by
//! [`Staging::create`]) removes those nobody holds, i.e. those a crashed freeze left, and
//! [`Image::open`] refuses any staging-named directory.
//!
//! [`Image::open`] applies the trust rule (`trust`: the image, its files and every directory
//! above it can be changed by root only; no symlinks, one link per file) and checks the
//! manifest, the listing and the sizes without reading the files. [`Image::verify`] (and
//! [`verify`]) then hashes every chunk on every core; a thaw instead checks the image beside
//! CRIU while CRIU reads it ([`Check`]: the files that steer CRIU first, the page contents in
//! parallel, any change watched), or, through the image streamer (`stream`), each chunk as it
//! serves it to CRIU; either way the verdict comes at a gate before anything restored runs.
//!
//! # Checksums
//! Format 3: the BLAKE3 of every [`DEFAULT_CHUNK_SIZE`] chunk of every file; the manifest's own
//! SHA-256 covers the lists (format 4 is 3 with every process's namespace pids). Formats 1
//! (whole-file SHA-256), 2 (and per 64 MiB chunk) and 3 are still read and checked;
//! [`rewrite_as_format`] still writes them, for tests.
//!
//! # Limitations
//! Images are flat directories of regular files (what CRIU writes); anything else is refused.
//! The replaced old image is removed after the exchange; if that removal is interrupted, the
//! leftover is a staging-named directory and goes with the next [`clean_stale`].

mod capture;
mod check;
mod checker;
mod follow;
mod hash;
mod manifest;
mod mapped;
mod open;
mod opener;
mod stream;
mod sys;
mod trust;

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::num::NonZeroU64;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{renameat2, Flock, FlockArg, RenameFlags};
use time::format_description::well_known::Rfc3339;

pub(crate) use capture::CAPTURE_SOCKET;
pub use capture::{Capture, CaptureClock};
pub use check::{
    abandoned_checks, Check, CHECK_MAPPED_SPAN_PAUSES, CHECK_READ_STALLS,
    CHECK_STEERING_READ_STALLS, MAX_ABANDONED_CHECKS,
};
pub use checker::{checker_main, CHECKER_ARG, CHECKER_BEFORE_VERDICT, CHECKER_ENV};
pub use manifest::{
    DeviceUse, DigestAlg, FileEntry, FrozenShrink, ImageMeta, Manifest, ProcessEntry, ProcessGpu,
    DEFAULT_CHUNK_SIZE, FORMAT_2_CHUNK_SIZE, FORMAT_VERSION, MANIFEST_FILE, OLDEST_FORMAT_VERSION,
};
pub use open::{read_manifest, Image};
pub use opener::OPENER_ARG;
pub(crate) use stream::{Server, SERVE_SOCKET};
pub(crate) use sys::default_sigchld;
pub(crate) use sys::inherit as inherit_fd;

/// What marks a staging directory: `NAME.tmp-<random>`.
pub const STAGING_MARK: &str = ".tmp-";

/// An image directory is not usable, or could not be written.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// A filesystem operation failed.
    #[error("{}: {source}", .path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The image path has no parent directory or no name.
    #[error("{}: not a usable image path (needs a parent directory and a name)", .0.display())]
    BadPath(PathBuf),
    /// Publishing would overwrite an existing image and replacing was not asked for.
    #[error("{}: already exists (replace it explicitly)", .dir.display())]
    Exists {
        /// The final directory.
        dir: PathBuf,
    },
    /// Replacing was asked for, but what is at the path is not an image directory.
    #[error("{}: exists and is not an image (no {MANIFEST_FILE}); refusing to replace it", .dir.display())]
    NotAnImage {
        /// The path.
        dir: PathBuf,
    },
    /// The directory is a staging directory (an unpublished or abandoned freeze).
    #[error("{}: a staging directory of an unfinished freeze, not an image", .dir.display())]
    Staging {
        /// The path.
        dir: PathBuf,
    },
    /// An entry of the image that is not a regular file.
    #[error("{}: {reason}", .file.display())]
    Unexpected {
        /// The entry.
        file: PathBuf,
        /// What it is.
        reason: String,
    },
    /// The manifest is unreadable or inconsistent.
    #[error("{}: bad manifest: {reason}", .file.display())]
    BadManifest {
        /// The manifest.
        file: PathBuf,
        /// Why.
        reason: String,
    },
    /// The manifest is of a format this build does not read.
    #[error(
        "{}: manifest format {found}, this cryo reads formats {OLDEST_FORMAT_VERSION} to {supported}",
        .file.display()
    )]
    UnsupportedFormat {
        /// The manifest.
        file: PathBuf,
        /// Its format version.
        found: u64,
        /// [`FORMAT_VERSION`].
        supported: u32,
    },
    /// A file the manifest lists (or the manifest itself) is absent.
    #[error("{}: missing", .file.display())]
    Missing {
        /// The file.
        file: PathBuf,
    },
    /// A file is shorter than the manifest says.
    #[error("{}: truncated: {found} bytes, manifest says {expected}", .file.display())]
    Truncated {
        /// The file.
        file: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size on disk.
        found: u64,
    },
    /// A file is longer than the manifest says.
    #[error("{}: {found} bytes, manifest says {expected}", .file.display())]
    Oversized {
        /// The file.
        file: PathBuf,
        /// Size in the manifest.
        expected: u64,
        /// Size on disk.
        found: u64,
    },
    /// A file's content does not match its SHA-256 in the manifest.
    #[error("{}: checksum mismatch (content differs from the manifest)", .file.display())]
    Checksum {
        /// The file.
        file: PathBuf,
    },
    /// One chunk of a file does not match its SHA-256 in the manifest.
    #[error(
        "{}: checksum mismatch in bytes {offset}..{end} (content differs from the manifest)",
        .file.display()
    )]
    ChunkChecksum {
        /// The file.
        file: PathBuf,
        /// First byte of the chunk.
        offset: u64,
        /// One past its last byte.
        end: u64,
    },
    /// Someone other than root could change the image (or the path to it) while it is used.
    #[error("{}: not trusted: {reason}", .path.display())]
    Untrusted {
        /// The file or directory.
        path: PathBuf,
        /// Who could change it, and how.
        reason: String,
    },
    /// The image's file system did not answer an open, a read or a stat before the restore's
    /// deadline (a dead disk, an NFS hard mount, a FUSE server that stopped answering): the
    /// thread waiting on it is abandoned (counted by `abandoned_checks`).
    #[error("{}: its file system did not answer before the restore's deadline ({what})", .dir.display())]
    Unanswered {
        /// The image.
        dir: PathBuf,
        /// What was waited for.
        what: String,
    },
    /// The first look, made in a process of its own ([`Image::open_apart`]), refused the image:
    /// what [`Image::open`] said there.
    #[error("{said}")]
    RefusedApart {
        /// What the opener said ([`Image::open`]'s refusal, as displayed).
        said: String,
    },
    /// The thaw's streamer stopped before CRIU had read the image (see the log of the restore).
    #[error("{}: image streamer: {reason}", .dir.display())]
    Stream {
        /// The image.
        dir: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// The image changed while CRIU read it (a restore from the files, checked beside CRIU).
    #[error("{}: changed during the thaw: {what}", .dir.display())]
    Changed {
        /// The image.
        dir: PathBuf,
        /// What changed.
        what: String,
    },
    /// A file the manifest does not list.
    #[error("{}: not listed in the manifest", .file.display())]
    Unlisted {
        /// The file.
        file: PathBuf,
    },
    /// The manifest could not be serialized.
    #[error("serializing the manifest: {0}")]
    Serialize(#[source] serde_json::Error),
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Opens a file of a staging directory for reading (the follower's and publish's opens): not
/// following a link, not waiting on a FIFO (root may put one there after the listing; opening
/// it for reading would wait for a writer, i.e. forever), not taking a terminal; then, by fstat
/// of the opened fd, refuses anything but a regular file.
fn open_staged(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = File::options()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY)
        .open(path)?;
    let kind = file.metadata()?.file_type();
    if !kind.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("not a regular file ({kind:?})"),
        ));
    }
    Ok(file)
}

fn errno(path: &Path) -> impl FnOnce(nix::Error) -> ImageError + '_ {
    move |e| ImageError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    }
}

/// Splits DIR into its parent and name.
fn split(dir: &Path) -> Result<(PathBuf, String), ImageError> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .ok_or_else(|| ImageError::BadPath(dir.to_path_buf()))?;
    let parent = match dir.parent() {
        Some(p) if p.as_os_str().is_empty() => PathBuf::from("."),
        Some(p) => p.to_path_buf(),
        None => return Err(ImageError::BadPath(dir.to_path_buf())),
    };
    Ok((parent, name.to_string()))
}

/// Whether `name` is a staging directory's name.
pub fn is_staging_name(name: &str) -> bool {
    name.contains(STAGING_MARK)
}

fn fsync_dir(dir: &Path) -> Result<(), ImageError> {
    File::open(dir).and_then(|f| f.sync_all()).map_err(io(dir))
}

/// Most fsyncs in flight at publish.
const SYNC_THREADS: usize = 16;

/// Format-3 checksums of every file of `dir` (BLAKE3 per chunk, on rayon's pool), while every
/// file is fsync'd on plain threads, the biggest first (a fsync waits on the disk, not on a
/// core). The files `known` gives (waited for while the fsyncs run) were hashed as they were
/// written (the capture): only their size is checked.
fn hash_and_sync(
    dir: &Path,
    names: &[String],
    chunk: u64,
    known: impl FnOnce() -> Result<BTreeMap<String, FileEntry>, ImageError>,
    followed: &follow::Follow,
) -> Result<Vec<FileEntry>, ImageError> {
    let mut opened = Vec::with_capacity(names.len());
    for n in names {
        let path = dir.join(n);
        let f = open_staged(&path).map_err(io(&path))?;
        let size = f.metadata().map_err(io(&path))?.len();
        opened.push((path, f, size));
    }
    // The biggest files first: the pages file's fsync is the one that waits for the disk, and
    // queued behind small files' fsyncs (each a journal commit) it started 4-74 ms late (4 GiB
    // dumps: 24 files on 16 threads, sorted by name).
    let mut order: Vec<&(PathBuf, File, u64)> = opened.iter().collect();
    order.sort_by_key(|(_, _, size)| std::cmp::Reverse(*size));
    let next = std::sync::atomic::AtomicUsize::new(0);
    let sync_one = || -> Result<(), ImageError> {
        loop {
            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let Some((path, f, _)) = order.get(i) else {
                return Ok(());
            };
            f.sync_all().map_err(io(path))?;
        }
    };
    std::thread::scope(|s| {
        let syncers: Vec<_> = (0..SYNC_THREADS.min(opened.len()))
            .map(|_| s.spawn(sync_one))
            .collect();
        let known = known();
        let hashed: Result<Vec<FileEntry>, ImageError> = known.and_then(|known| {
            opened
                .iter()
                .zip(names)
                .map(|((path, f, size), name)| {
                    if let Some(e) = known.get(name) {
                        if e.size != *size {
                            return Err(ImageError::Unexpected {
                                file: path.clone(),
                                reason: format!(
                                    "{size} bytes after the dump, {} written by the capture",
                                    e.size
                                ),
                            });
                        }
                        return Ok(e.clone());
                    }
                    let chunks = follow::finish(path, f, *size, chunk, followed.get(name))?;
                    Ok(FileEntry {
                        name: name.clone(),
                        size: *size,
                        sha256: String::new(),
                        chunks,
                    })
                })
                .collect()
        });
        for h in syncers {
            h.join()
                .map_err(|_| io(dir)(std::io::Error::other("fsync thread panicked")))??;
        }
        hashed
    })
}

/// Writes `manifest.json` into `dir` and fsyncs it; with `over`, replaces an existing one
/// atomically (through a temporary name and a rename).
fn write_manifest(dir: &Path, manifest: &Manifest, over: bool) -> Result<(), ImageError> {
    let bytes = serde_json::to_vec_pretty(manifest).map_err(ImageError::Serialize)?;
    let mpath = dir.join(MANIFEST_FILE);
    let target = if over {
        dir.join(format!("{MANIFEST_FILE}{STAGING_MARK}rewrite"))
    } else {
        mpath.clone()
    };
    let mut f = File::options()
        .write(true)
        .create_new(true)
        .open(&target)
        .map_err(io(&target))?;
    f.write_all(&bytes)
        .and_then(|()| f.sync_all())
        .map_err(io(&target))?;
    if over {
        fs::rename(&target, &mpath).map_err(io(&mpath))?;
        fsync_dir(dir)?;
    }
    Ok(())
}

/// Rewrites the manifest of the image at `dir` in format 1 (whole-file SHA-256), 2 (and a
/// SHA-256 per `chunk_size` bytes, default [`FORMAT_2_CHUNK_SIZE`]) or 3 (BLAKE3 chunks as
/// written, no namespace pids), as the cryo of those formats wrote it. The writer of the
/// previous formats, kept so that tests make images of them from what this build dumps.
pub fn rewrite_as_format(
    dir: &Path,
    format: u32,
    chunk_size: Option<NonZeroU64>,
) -> Result<Manifest, ImageError> {
    let mpath = dir.join(MANIFEST_FILE);
    let mut m = read_manifest(&mpath)?;
    for p in &mut m.processes {
        p.nspid.clear();
    }
    let chunk = match format {
        1 => None,
        2 => Some(chunk_size.map_or(FORMAT_2_CHUNK_SIZE, NonZeroU64::get)),
        3 if m.format_version >= 3 => {
            m.format_version = format;
            m.manifest_sha256 = m.self_digest().map_err(ImageError::Serialize)?;
            write_manifest(dir, &m, true)?;
            return Ok(m);
        }
        other => {
            return Err(ImageError::UnsupportedFormat {
                file: mpath,
                found: u64::from(other),
                supported: 3,
            })
        }
    };
    for f in &mut m.files {
        let path = dir.join(&f.name);
        let mut file = File::open(&path).map_err(io(&path))?;
        let (size, whole, chunks) = hash::sha256_file(&mut file, chunk).map_err(io(&path))?;
        f.size = size;
        f.sha256 = whole;
        f.chunks = chunks;
    }
    m.format_version = format;
    m.digest = None;
    m.chunk_size = chunk;
    m.total_bytes = m.files.iter().map(|f| f.size).sum();
    m.manifest_sha256 = m.self_digest().map_err(ImageError::Serialize)?;
    write_manifest(dir, &m, true)?;
    Ok(m)
}

/// Checks the image at `dir` (see [`Image::open`]: trust, manifest, listing, sizes) and every
/// byte of it against its manifest (all chunks of all files in parallel), and returns the
/// manifest. Each failure names the file and the reason (and the byte range for a chunk).
pub fn verify(dir: &Path) -> Result<Manifest, ImageError> {
    let image = Image::open(dir)?;
    image.verify()?;
    Ok(image.into_manifest())
}

/// Checks that an image published at `dir` would be trusted: nobody but root can change the
/// directories it goes into.
pub fn check_destination(dir: &Path) -> Result<(), ImageError> {
    trust::check_parent(dir)
}

/// Removes the staging directories of `dir` (`DIR.tmp-*` beside it) that no live freeze holds,
/// and returns them.
pub fn clean_stale(dir: &Path) -> Result<Vec<PathBuf>, ImageError> {
    let (parent, name) = split(dir)?;
    let prefix = format!("{name}{STAGING_MARK}");
    let mut removed = Vec::new();
    let entries = match fs::read_dir(&parent) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(io(&parent)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(io(&parent))?;
        let fname = entry.file_name();
        let Some(fname) = fname.to_str() else {
            continue;
        };
        if !fname.starts_with(&prefix) {
            continue;
        }
        let path = entry.path();
        // A staging directory in use is locked by its freeze; a crashed freeze's lock is gone.
        let Ok(f) = File::open(&path) else { continue };
        let Ok(lock) = Flock::lock(f, FlockArg::LockExclusiveNonblock) else {
            tracing::debug!(path = %path.display(), "staging directory in use, left alone");
            continue;
        };
        let r = if entry.file_type().map_err(io(&path))?.is_dir() {
            fs::remove_dir_all(&path)
        } else {
            fs::remove_file(&path)
        };
        drop(lock);
        r.map_err(io(&path))?;
        tracing::info!(path = %path.display(), "removed a stale staging directory");
        removed.push(path);
    }
    Ok(removed)
}

/// The points of [`Staging::publish_with`] at which a crash must leave no image or a whole one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PublishStep {
    /// Every file hashed and fsync'd; no manifest yet.
    Synced,
    /// The manifest written and fsync'd, the staging directory fsync'd; not renamed yet.
    ManifestWritten,
    /// Renamed (or exchanged) into place; the parent directory not fsync'd yet, and a replaced
    /// image not removed yet.
    Renamed,
}

impl PublishStep {
    /// Every step, in order.
    pub const ALL: [PublishStep; 3] = [
        PublishStep::Synced,
        PublishStep::ManifestWritten,
        PublishStep::Renamed,
    ];

    /// Its name (`synced`, `manifest-written`, `renamed`).
    pub fn name(self) -> &'static str {
        match self {
            PublishStep::Synced => "synced",
            PublishStep::ManifestWritten => "manifest-written",
            PublishStep::Renamed => "renamed",
        }
    }
}

/// Something [`Staging::drop_after_publish`] keeps.
#[derive(Debug)]
struct AfterPublish(#[allow(dead_code)] Box<dyn std::fmt::Debug + Send>);

/// A staging directory for the image that will be published at `dir`.
#[derive(Debug)]
pub struct Staging {
    tmp: Option<tempfile::TempDir>,
    path: PathBuf,
    dir: PathBuf,
    chunk_size: u64,
    /// The captures whose files publish takes (their hashes may still be running).
    captured: std::sync::Mutex<Vec<Capture>>,
    /// The last capture's clock.
    clock: std::sync::Mutex<Option<std::sync::Arc<CaptureClock>>>,
    /// What hashes a dump CRIU wrote itself ([`Staging::follow_written`]).
    follower: std::sync::Mutex<Option<follow::Follower>>,
    /// What the dump leaves to be removed or closed once publish has fsync'd the image (see
    /// [`Staging::drop_after_publish`]).
    after_publish: std::sync::Mutex<Vec<AfterPublish>>,
    _lock: Flock<File>,
}

impl Staging {
    /// Cleans stale staging directories of `dir`, then makes and locks a fresh one beside it.
    /// `dir`'s parent must exist. Dropped without [`Staging::publish`], it is removed.
    pub fn create(dir: &Path) -> Result<Staging, ImageError> {
        let (parent, name) = split(dir)?;
        check_destination(dir)?;
        clean_stale(dir)?;
        // Between making the directory and locking it, a concurrent clean_stale may take it for
        // stale and remove it: check that what is locked is still what is there.
        let mut attempts = 0;
        loop {
            attempts += 1;
            let tmp = tempfile::Builder::new()
                .prefix(&format!("{name}{STAGING_MARK}"))
                .rand_bytes(12)
                .tempdir_in(&parent)
                .map_err(io(&parent))?;
            let path = tmp.path().to_path_buf();
            // Root's alone (the dump holds the worker's memory): nobody else may enter it
            // while CRIU writes there, nor read the image later.
            fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o700))
                .map_err(io(&path))?;
            let f = File::open(&path).map_err(io(&path))?;
            let lock = Flock::lock(f, FlockArg::LockExclusiveNonblock)
                .map_err(|(_, e)| errno(&path)(e))?;
            let locked = lock.metadata().map_err(io(&path))?.ino();
            match fs::symlink_metadata(&path) {
                Ok(m) if m.ino() == locked => {
                    return Ok(Staging {
                        tmp: Some(tmp),
                        path,
                        dir: dir.to_path_buf(),
                        chunk_size: DEFAULT_CHUNK_SIZE,
                        captured: std::sync::Mutex::default(),
                        clock: std::sync::Mutex::default(),
                        follower: std::sync::Mutex::default(),
                        after_publish: std::sync::Mutex::default(),
                        _lock: lock,
                    })
                }
                Ok(_) | Err(_) if attempts < 3 => continue,
                Ok(_) => return Err(io(&path)(std::io::ErrorKind::AlreadyExists.into())),
                Err(e) => return Err(io(&path)(e)),
            }
        }
    }

    /// The staging directory: where CRIU dumps.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Sets the chunk size of the manifest's per-chunk checksums (default
    /// [`DEFAULT_CHUNK_SIZE`]); tests use small ones to get many chunks from small files.
    pub fn with_chunk_size(mut self, bytes: NonZeroU64) -> Staging {
        self.chunk_size = bytes.get();
        self
    }

    /// The directory the image will be published at.
    pub fn final_dir(&self) -> &Path {
        &self.dir
    }

    /// CRIU wrote every file (a dump CRIU writes itself calls it at its `post-dump` gate): the
    /// follower (see `follow.rs`) takes every file from now on, the pages files it followed
    /// since [`Staging::follow_pages`] included; started here if it was not then. The files
    /// named in `skip` (CRIU's log) are left to publish, which hashes what the follower did
    /// not. The follower goes on until publish.
    pub fn follow_written(&self, skip: &[&str]) {
        let mut held = self.follower.lock().unwrap_or_else(|p| p.into_inner());
        match &*held {
            Some(f) => f.take_all(),
            None => *held = follow::Follower::start(&self.path, self.chunk_size, skip, true),
        }
    }

    /// Starts the follower as CRIU starts writing: until [`Staging::follow_written`] it hashes
    /// only CRIU's pages files, each written once front to back (see `follow.rs`), at idle
    /// priority beside CRIU.
    pub fn follow_pages(&self, skip: &[&str]) {
        let mut held = self.follower.lock().unwrap_or_else(|p| p.into_inner());
        if held.is_none() {
            *held = follow::Follower::start(&self.path, self.chunk_size, skip, false);
        }
    }

    /// Keeps `what` (a CRIU run's private directory, its stderr file) until publish has
    /// fsync'd the image, or until the staging directory goes. Removing a directory or closing
    /// a deleted file takes a handle on the file system's journal, and from the gate on the
    /// journal's commits wait for the image's writeback (the follower starts it; ext4's
    /// ordered data): done between CRIU's exit and the worker gone it held that moment back,
    /// 3-5 ms median at 1 GiB, and 67 ms (an `unlinkat` of 22 ms, a `close` of 46 ms) when the
    /// whole image's writeback had been started at the gate. After publish's fsyncs it waits
    /// for nothing.
    pub(crate) fn drop_after_publish(&self, what: impl std::fmt::Debug + Send + 'static) {
        self.after_publish
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(AfterPublish(Box::new(what)));
    }

    /// A fresh clock for the moments of a dump CRIU writes itself (the freeze's report).
    pub(crate) fn dump_clock(&self) -> std::sync::Arc<CaptureClock> {
        let c = std::sync::Arc::new(CaptureClock::default());
        *self.clock.lock().unwrap_or_else(|p| p.into_inner()) = Some(std::sync::Arc::clone(&c));
        c
    }

    /// The gate's check once CRIU wrote its dump (before it kills the tree): the staging
    /// directory is still the one made and locked here, and holds only regular files and no
    /// manifest. A link or anything else planted there refuses the dump, and CRIU resumes
    /// the tree.
    pub(crate) fn check_dumped(&self) -> Result<(), ImageError> {
        let locked = self._lock.metadata().map_err(io(&self.path))?;
        let now = fs::symlink_metadata(&self.path).map_err(io(&self.path))?;
        if (now.dev(), now.ino()) != (locked.dev(), locked.ino()) {
            return Err(ImageError::Unexpected {
                file: self.path.clone(),
                reason: "the staging directory was replaced during the dump".into(),
            });
        }
        self.list().map(|_| ())
    }

    /// A capture of a streamed dump into the staging directory (see [`Capture`]).
    pub fn capture(&self) -> Capture {
        let c = Capture::new(&self.path, self.chunk_size);
        *self.clock.lock().unwrap_or_else(|p| p.into_inner()) = Some(c.clock());
        c
    }

    /// When the last capture (and the dump around it) reached its moments.
    pub fn capture_clock(&self) -> Option<std::sync::Arc<CaptureClock>> {
        self.clock.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Takes the files `capture` wrote: publish waits for its hashes (while it fsyncs), checks
    /// their sizes and does not hash them again. Refuses a capture that was refused.
    pub fn adopt(&self, capture: Capture) -> Result<(), ImageError> {
        if let Some(e) = capture.failure() {
            return Err(e);
        }
        self.captured
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(capture);
        Ok(())
    }

    /// Hashes and fsyncs every file (chunks hashed in parallel on every core while every file
    /// is fsync'd at once on its own thread), writes the manifest, and renames the staging
    /// directory to the final one. With `replace`, an existing image there is swapped out
    /// atomically and removed; without, an existing path is [`ImageError::Exists`] (and the
    /// staging directory is removed as on any error).
    pub fn publish(self, meta: ImageMeta, replace: bool) -> Result<Manifest, ImageError> {
        self.publish_with(meta, replace, &|_| {})
    }

    /// [`Staging::publish`], calling `step` after each step (tests stall there to crash the
    /// publish at every point).
    pub fn publish_with(
        mut self,
        meta: ImageMeta,
        replace: bool,
        step: &dyn Fn(PublishStep),
    ) -> Result<Manifest, ImageError> {
        let names = self.list()?;
        let captures =
            std::mem::take(&mut *self.captured.lock().unwrap_or_else(|p| p.into_inner()));
        let path = self.path.clone();
        let known = || -> Result<BTreeMap<String, FileEntry>, ImageError> {
            let mut known = BTreeMap::new();
            for c in captures {
                known.extend(c.into_files()?);
            }
            if let Some(gone) = known.keys().find(|k| !names.contains(k)) {
                return Err(ImageError::Missing {
                    file: path.join(gone),
                });
            }
            Ok(known)
        };
        let follower = self
            .follower
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        let was_followed = follower.is_some();
        let followed = follower.map(follow::Follower::finish).unwrap_or_default();
        if let (true, Some(c)) = (was_followed, self.capture_clock()) {
            let bytes = followed.values().map(|f| f.hashed(self.chunk_size)).sum();
            *c.followed.lock().unwrap_or_else(|p| p.into_inner()) = Some(bytes);
        }
        let files = hash_and_sync(&self.path, &names, self.chunk_size, known, &followed)?;
        drop(std::mem::take(
            &mut *self.after_publish.lock().unwrap_or_else(|p| p.into_inner()),
        ));
        step(PublishStep::Synced);
        let created = time::OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_else(|_| String::from("unknown"));
        let mut manifest = Manifest {
            format_version: FORMAT_VERSION,
            cryo_version: env!("CARGO_PKG_VERSION").to_string(),
            created,
            root_pid: meta.root_pid,
            processes: meta.processes,
            zombies: meta.zombies,
            threads: meta.threads,
            gpu_model: meta.gpu_model,
            driver_version: meta.driver_version,
            criu_version: meta.criu_version,
            shrunk: meta.shrunk,
            total_bytes: files.iter().map(|f| f.size).sum(),
            digest: Some(DigestAlg::Blake3),
            chunk_size: Some(self.chunk_size),
            files,
            manifest_sha256: String::new(),
        };
        manifest.manifest_sha256 = manifest.self_digest().map_err(ImageError::Serialize)?;
        write_manifest(&self.path, &manifest, false)?;
        fsync_dir(&self.path)?;
        step(PublishStep::ManifestWritten);
        self.rename_into_place(replace, step)?;
        Ok(manifest)
    }

    /// The staging directory's files, sorted; anything but regular files is refused.
    fn list(&self) -> Result<Vec<String>, ImageError> {
        let mut names = Vec::new();
        for entry in fs::read_dir(&self.path).map_err(io(&self.path))? {
            let entry = entry.map_err(io(&self.path))?;
            let path = entry.path();
            let ft = entry.file_type().map_err(io(&path))?;
            let name = entry
                .file_name()
                .into_string()
                .map_err(|_| ImageError::Unexpected {
                    file: path.clone(),
                    reason: "name is not UTF-8".into(),
                })?;
            if !ft.is_file() {
                return Err(ImageError::Unexpected {
                    file: path,
                    reason: format!("not a regular file ({ft:?})"),
                });
            }
            if name == MANIFEST_FILE {
                return Err(ImageError::Unexpected {
                    file: path,
                    reason: "a manifest before publishing".into(),
                });
            }
            names.push(name);
        }
        names.sort();
        Ok(names)
    }

    fn rename_into_place(
        &mut self,
        replace: bool,
        step: &dyn Fn(PublishStep),
    ) -> Result<(), ImageError> {
        let (parent, _) = split(&self.dir)?;
        match renameat2(
            None,
            &self.path,
            None,
            &self.dir,
            RenameFlags::RENAME_NOREPLACE,
        ) {
            Ok(()) => {
                // The rename moved the directory away; nothing is left for TempDir to remove.
                if let Some(t) = self.tmp.take() {
                    let _ = t.keep();
                }
                step(PublishStep::Renamed);
                return fsync_dir(&parent);
            }
            Err(nix::Error::EEXIST) if !replace => {
                return Err(ImageError::Exists {
                    dir: self.dir.clone(),
                })
            }
            Err(nix::Error::EEXIST) => {}
            Err(e) => return Err(errno(&self.dir)(e)),
        }
        if !self.dir.join(MANIFEST_FILE).exists() {
            return Err(ImageError::NotAnImage {
                dir: self.dir.clone(),
            });
        }
        // Atomic swap: DIR holds the new image, the staging path the old one, which the
        // TempDir then removes (or, after a crash, the next clean_stale).
        renameat2(
            None,
            &self.path,
            None,
            &self.dir,
            RenameFlags::RENAME_EXCHANGE,
        )
        .map_err(errno(&self.dir))?;
        step(PublishStep::Renamed);
        fsync_dir(&parent)?;
        if let Some(t) = self.tmp.take() {
            if let Err(e) = t.close() {
                tracing::warn!(path = %self.path.display(), %e, "cannot remove the replaced image");
            }
        }
        Ok(())
    }
}

/// The bytes of the files directly in `dir` (an image, published or being dumped); 0 for what
/// cannot be read. For progress and reports, never for a decision.
pub fn dir_bytes(dir: &Path) -> u64 {
    fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .filter_map(|e| e.metadata().ok())
                .map(|m| m.len())
                .sum()
        })
        .unwrap_or(0)
}
