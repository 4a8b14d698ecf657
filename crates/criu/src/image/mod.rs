//! Image directories: staged next to their final place, described by a manifest, published by
//! an atomic rename, verified before use.
//!
//! # Design
//! A freeze writes into `DIR.tmp-<random>` in DIR's parent ([`Staging`]), so the final rename
//! stays on one filesystem. [`Staging::publish`] hashes and fsyncs every file, writes
//! `manifest.json` last and fsyncs it and the directory, renames the staging directory to DIR
//! with `renameat2(RENAME_NOREPLACE)` (or `RENAME_EXCHANGE` when replacing, so DIR always holds
//! a whole image, the old or the new) and fsyncs the parent. A crash at any point leaves at DIR
//! either nothing, the old image or the new one, never a part. Staging directories hold an
//! `flock` while in use; [`clean_stale`] (run by [`Staging::create`]) removes those nobody
//! holds, i.e. those a crashed freeze left, and [`verify`] refuses any staging-named directory.
//!
//! # Limitations
//! Images are flat directories of regular files (what CRIU writes); anything else is refused.
//! The replaced old image is removed after the exchange; if that removal is interrupted, the
//! leftover is a staging-named directory and goes with the next [`clean_stale`].
//!
//! # Checksums
//! The manifest holds each file's SHA-256 (what `sha256sum` prints) and, for files of more
//! than one chunk ([`DEFAULT_CHUNK_SIZE`]), the SHA-256 of each chunk. Publish computes both in
//! one read of each file. [`verify`] checks sizes, then hashes the chunks of all files on all
//! cores (a 20 GB GPU worker is one pages file, and verify runs before every thaw); it does not
//! hash big files whole again: the chunks cover every byte, and the manifest's self-digest
//! covers the chunk list. Format-1 manifests (no chunks) are still read and verified whole-file.

mod hash;
mod manifest;

use std::collections::BTreeSet;
use std::fs::{self, File};
use std::io::Write;
use std::num::NonZeroU64;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{renameat2, Flock, FlockArg, RenameFlags};
use time::format_description::well_known::Rfc3339;

pub use manifest::{
    DeviceUse, FileEntry, ImageMeta, Manifest, ProcessEntry, ProcessGpu, DEFAULT_CHUNK_SIZE,
    FORMAT_VERSION, MANIFEST_FILE, OLDEST_FORMAT_VERSION,
};

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

/// A staging directory for the image that will be published at `dir`.
#[derive(Debug)]
pub struct Staging {
    tmp: Option<tempfile::TempDir>,
    path: PathBuf,
    dir: PathBuf,
    chunk_size: u64,
    _lock: Flock<File>,
}

impl Staging {
    /// Cleans stale staging directories of `dir`, then makes and locks a fresh one beside it.
    /// `dir`'s parent must exist. Dropped without [`Staging::publish`], it is removed.
    pub fn create(dir: &Path) -> Result<Staging, ImageError> {
        let (parent, name) = split(dir)?;
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

    /// Hashes and fsyncs every file, writes the manifest, and renames the staging directory to
    /// the final one. With `replace`, an existing image there is swapped out atomically and
    /// removed; without, an existing path is [`ImageError::Exists`] (and the staging directory
    /// is removed as on any error).
    pub fn publish(mut self, meta: ImageMeta, replace: bool) -> Result<Manifest, ImageError> {
        let names = self.list()?;
        let mut files = Vec::with_capacity(names.len());
        let hashed = hash::hash_files(&self.path, &names, true, self.chunk_size);
        for (name, r) in names.iter().zip(hashed) {
            let h = r.map_err(|(p, e)| io(&p)(e))?;
            files.push(FileEntry {
                name: name.clone(),
                size: h.size,
                sha256: h.sha256,
                chunks: h.chunks,
            });
        }
        let created = time::OffsetDateTime::now_utc()
            .format(&Rfc3339)
            .unwrap_or_else(|_| String::from("unknown"));
        let mut manifest = Manifest {
            format_version: FORMAT_VERSION,
            cryo_version: env!("CARGO_PKG_VERSION").to_string(),
            created,
            root_pid: meta.root_pid,
            processes: meta.processes,
            gpu_model: meta.gpu_model,
            driver_version: meta.driver_version,
            criu_version: meta.criu_version,
            total_bytes: files.iter().map(|f| f.size).sum(),
            chunk_size: Some(self.chunk_size),
            files,
            manifest_sha256: String::new(),
        };
        manifest.manifest_sha256 = manifest.self_digest().map_err(ImageError::Serialize)?;
        let bytes = serde_json::to_vec_pretty(&manifest).map_err(ImageError::Serialize)?;
        let mpath = self.path.join(MANIFEST_FILE);
        let mut f = File::options()
            .write(true)
            .create_new(true)
            .open(&mpath)
            .map_err(io(&mpath))?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(io(&mpath))?;
        drop(f);
        fsync_dir(&self.path)?;
        self.rename_into_place(replace)?;
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

    fn rename_into_place(&mut self, replace: bool) -> Result<(), ImageError> {
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
        fsync_dir(&parent)?;
        if let Some(t) = self.tmp.take() {
            if let Err(e) = t.close() {
                tracing::warn!(path = %self.path.display(), %e, "cannot remove the replaced image");
            }
        }
        Ok(())
    }
}

/// Checks the image at `dir` against its manifest and returns the manifest: format version,
/// the manifest's own digest, every listed file present with its size and SHA-256 (per chunk
/// where the manifest has chunk digests, all chunks of all files in parallel), nothing
/// unlisted. Each failure names the file and the reason (and the byte range for a chunk).
pub fn verify(dir: &Path) -> Result<Manifest, ImageError> {
    let (_, name) = split(dir)?;
    if is_staging_name(&name) {
        return Err(ImageError::Staging {
            dir: dir.to_path_buf(),
        });
    }
    let mpath = dir.join(MANIFEST_FILE);
    let manifest = read_manifest(&mpath)?;

    let bad = |reason: String| ImageError::BadManifest {
        file: mpath.clone(),
        reason,
    };
    let mut listed = BTreeSet::new();
    for f in &manifest.files {
        let n = f.name.as_str();
        if n.is_empty() || n == "." || n == ".." || n.contains('/') || n == MANIFEST_FILE {
            return Err(bad(format!("file name {n:?} is not allowed")));
        }
        if !listed.insert(n) {
            return Err(bad(format!("file {n:?} listed twice")));
        }
    }
    let total: u64 = manifest.files.iter().map(|f| f.size).sum();
    if total != manifest.total_bytes {
        return Err(bad(format!(
            "total_bytes {} but the files add up to {total}",
            manifest.total_bytes
        )));
    }
    check_chunk_layout(&manifest).map_err(bad)?;

    for entry in fs::read_dir(dir).map_err(io(dir))? {
        let entry = entry.map_err(io(dir))?;
        let fname = entry.file_name();
        let fname = fname.to_string_lossy();
        if fname != MANIFEST_FILE && !listed.contains(fname.as_ref()) {
            return Err(ImageError::Unlisted { file: entry.path() });
        }
    }
    let mut paths = Vec::with_capacity(manifest.files.len());
    for f in &manifest.files {
        let path = dir.join(&f.name);
        let md = match fs::symlink_metadata(&path) {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Err(ImageError::Missing { file: path })
            }
            Err(e) => return Err(io(&path)(e)),
        };
        if !md.file_type().is_file() {
            return Err(ImageError::Unexpected {
                file: path,
                reason: "not a regular file".into(),
            });
        }
        let found = md.size();
        if found < f.size {
            return Err(ImageError::Truncated {
                file: path,
                expected: f.size,
                found,
            });
        }
        if found > f.size {
            return Err(ImageError::Oversized {
                file: path,
                expected: f.size,
                found,
            });
        }
        paths.push(path);
    }
    let spans = spans(&manifest);
    if let Err((i, e)) = hash::check_spans(&paths, &spans) {
        let s = &spans[i];
        let f = &manifest.files[s.file];
        let file = dir.join(&f.name);
        return Err(match e {
            hash::SpanError::Mismatch if s.len == f.size => ImageError::Checksum { file },
            hash::SpanError::Mismatch => ImageError::ChunkChecksum {
                file,
                offset: s.offset,
                end: s.offset + s.len,
            },
            hash::SpanError::Short { found } => ImageError::Truncated {
                file,
                expected: f.size,
                found,
            },
            hash::SpanError::Long => ImageError::Oversized {
                found: fs::metadata(&file).map_or(f.size + 1, |m| m.len()),
                file,
                expected: f.size,
            },
            hash::SpanError::Io(e) => io(&file)(e),
        });
    }
    Ok(manifest)
}

/// Whether the chunk lists fit the sizes: format 1 has none; format 2 has a chunk size and, for
/// every file longer than one chunk, one digest per chunk (so the chunks cover every byte).
fn check_chunk_layout(m: &Manifest) -> Result<(), String> {
    let Some(chunk) = m.chunk_size else {
        if m.format_version >= 2 {
            return Err(format!("format {} without chunk_size", m.format_version));
        }
        return match m.files.iter().find(|f| !f.chunks.is_empty()) {
            Some(f) => Err(format!(
                "file {:?} has chunk digests but no chunk_size",
                f.name
            )),
            None => Ok(()),
        };
    };
    if m.format_version < 2 {
        return Err(format!("format {} with a chunk_size", m.format_version));
    }
    if chunk == 0 {
        return Err("chunk_size 0".into());
    }
    for f in &m.files {
        let want = if f.size <= chunk {
            0
        } else {
            f.size.div_ceil(chunk)
        };
        if f.chunks.len() as u64 != want {
            return Err(format!(
                "file {:?}: {} chunk digests, its {} bytes in chunks of {chunk} need {want}",
                f.name,
                f.chunks.len(),
                f.size
            ));
        }
    }
    Ok(())
}

/// What verify hashes: every chunk of files that have chunk digests, the whole of the others.
fn spans(m: &Manifest) -> Vec<hash::Span<'_>> {
    let mut out = Vec::new();
    for (i, f) in m.files.iter().enumerate() {
        let chunk = m.chunk_size.filter(|_| !f.chunks.is_empty());
        let Some(chunk) = chunk else {
            out.push(hash::Span {
                file: i,
                offset: 0,
                len: f.size,
                sha256: &f.sha256,
                last: true,
            });
            continue;
        };
        let mut offset = 0;
        for (k, digest) in f.chunks.iter().enumerate() {
            let len = chunk.min(f.size.saturating_sub(offset));
            out.push(hash::Span {
                file: i,
                offset,
                len,
                sha256: digest,
                last: k + 1 == f.chunks.len(),
            });
            offset += len;
        }
    }
    out
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

/// Reads and checks `manifest.json` without looking at the other files.
pub fn read_manifest(mpath: &Path) -> Result<Manifest, ImageError> {
    let bytes = match fs::read(mpath) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ImageError::Missing {
                file: mpath.to_path_buf(),
            })
        }
        Err(e) => return Err(io(mpath)(e)),
    };
    let bad = |reason: String| ImageError::BadManifest {
        file: mpath.to_path_buf(),
        reason,
    };
    // The format version first, so a newer manifest is reported as such, not as a parse error.
    let value: serde_json::Value =
        serde_json::from_slice(&bytes).map_err(|e| bad(format!("not JSON: {e}")))?;
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
    Ok(manifest)
}
