//! Who could change an image: the rule that decides whether cryo trusts an image directory.
//!
//! # Design
//! An image is code: CRIU restores its processes as root with the credentials the image names,
//! and the manifest's own digest proves nothing against someone who can rewrite the manifest
//! too. So an image is trusted only when nobody but root can change it or the path to it:
//! - every directory from `/` down to the image (after resolving symlinks once, then walked with
//!   `openat(O_NOFOLLOW)` on the resolved path, so nothing swapped in between is followed) is
//!   owned by root and not writable by group or others, except that a sticky directory
//!   (`/tmp`) may be writable by others above the image: there only an entry's owner can rename
//!   or remove it, and the next directory must be root's;
//! - the image directory itself: owned by root, not writable by group or others;
//! - every file: a regular file (a symlink is refused, never followed), owned by root, not
//!   writable by group or others, with no second link (a second name could live anywhere; no
//!   name at all once a replace removed it).
//!
//! Group write is accepted for group 0 (root's group), as anything else would be arbitrary.
//!
//! These checks make a swap or an edit by anyone but root impossible during the thaw. What
//! root itself (or a bug) changes while CRIU reads is caught by the streamer: CRIU gets no byte
//! that was not checked against the manifest in cryo's own memory (see `stream`).

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use nix::fcntl::{openat, OFlag};
use nix::sys::stat::{fstat, FileStat, Mode, SFlag};

use super::ImageError;

const GROUP_WRITE: u32 = 0o020;
const OTHER_WRITE: u32 = 0o002;
const STICKY: u32 = 0o1000;

fn untrusted(path: &Path, reason: String) -> ImageError {
    ImageError::Untrusted {
        path: path.to_path_buf(),
        reason,
    }
}

/// Why `st` makes `path` changeable by someone other than root, if it does. `sticky_ok`: a
/// directory above the image, where a sticky bit makes others' write harmless.
fn writable_by_others(st: &FileStat, sticky_ok: bool) -> Option<String> {
    let mode = st.st_mode & 0o7777;
    if st.st_uid != 0 {
        return Some(format!(
            "owned by uid {} (an image and every directory above it must be owned by root)",
            st.st_uid
        ));
    }
    if mode & GROUP_WRITE != 0 && st.st_gid != 0 && !(sticky_ok && mode & STICKY != 0) {
        return Some(format!(
            "writable by group {} (mode {mode:04o}); only root may be able to change an image",
            st.st_gid
        ));
    }
    if mode & OTHER_WRITE != 0 && !(sticky_ok && mode & STICKY != 0) {
        return Some(format!(
            "writable by everyone (mode {mode:04o}); only root may be able to change an image"
        ));
    }
    None
}

fn is(st: &FileStat, kind: SFlag) -> bool {
    SFlag::from_bits_truncate(st.st_mode) & SFlag::S_IFMT == kind
}

/// Opens directory `name` in `parent` without following a symlink.
fn open_dir_at(parent: &OwnedFd, name: &OsStr, path: &Path) -> Result<OwnedFd, ImageError> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    match openat(
        Some(std::os::fd::AsRawFd::as_raw_fd(parent)),
        name,
        flags,
        Mode::empty(),
    ) {
        // SAFETY: openat returned a new fd that nothing else owns.
        Ok(fd) => Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(fd) }),
        Err(nix::Error::ELOOP) => Err(untrusted(path, "a symbolic link".into())),
        Err(nix::Error::ENOENT) => Err(ImageError::Missing {
            file: path.to_path_buf(),
        }),
        Err(e) => Err(ImageError::Io {
            path: path.to_path_buf(),
            source: e.into(),
        }),
    }
}

fn stat(fd: impl AsFd, path: &Path) -> Result<FileStat, ImageError> {
    fstat(std::os::fd::AsRawFd::as_raw_fd(&fd.as_fd())).map_err(|e| ImageError::Io {
        path: path.to_path_buf(),
        source: e.into(),
    })
}

fn canonical(dir: &Path) -> Result<PathBuf, ImageError> {
    std::fs::canonicalize(dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => ImageError::Missing {
            file: dir.to_path_buf(),
        },
        _ => ImageError::Io {
            path: dir.to_path_buf(),
            source: e,
        },
    })
}

/// Walks the resolved path `real` from `/` with `O_NOFOLLOW`, checking every directory on the
/// way, `real` included, as a directory above an image; returns `real`'s fd.
fn walk(real: &Path) -> Result<OwnedFd, ImageError> {
    let root = File::open("/").map_err(|e| ImageError::Io {
        path: PathBuf::from("/"),
        source: e,
    })?;
    let mut fd: OwnedFd = root.into();
    let mut at = PathBuf::from("/");
    check_dir(&fd, &at, true)?;
    for c in real.components() {
        let Component::Normal(name) = c else { continue };
        at.push(name);
        fd = open_dir_at(&fd, name, &at)?;
        check_dir(&fd, &at, true)?;
    }
    Ok(fd)
}

fn check_dir(fd: &OwnedFd, path: &Path, above_image: bool) -> Result<(), ImageError> {
    let st = stat(fd, path)?;
    match writable_by_others(&st, above_image) {
        Some(reason) => Err(untrusted(path, reason)),
        None => Ok(()),
    }
}

fn parent_of(dir: &Path) -> Result<&Path, ImageError> {
    match dir.parent() {
        Some(p) if p.as_os_str().is_empty() => Ok(Path::new(".")),
        Some(p) => Ok(p),
        None => Err(ImageError::BadPath(dir.to_path_buf())),
    }
}

/// Checks that nobody but root can change what is at `dir` (see the module docs) and opens it.
/// Returns the resolved path and the directory's fd.
pub(crate) fn open_image_dir(dir: &Path) -> Result<(PathBuf, OwnedFd), ImageError> {
    let real = canonical(dir)?;
    let name = real
        .file_name()
        .ok_or_else(|| ImageError::BadPath(dir.to_path_buf()))?;
    let parent = walk(parent_of(&real)?)?;
    let fd = open_dir_at(&parent, name, &real)?;
    check_dir(&fd, &real, false)?;
    Ok((real, fd))
}

/// Checks the directories an image will be published into (`dir`'s parent and above): an image
/// made where others could change it would never be trusted by a thaw.
pub(crate) fn check_parent(dir: &Path) -> Result<(), ImageError> {
    walk(&canonical(parent_of(dir)?)?).map(drop)
}

/// Opens file `name` of the image directory `dir` (whose path is `path`) for reading: not
/// following a symlink, not blocking on a FIFO; then checks it is a regular file that only root
/// can change, with no second link. Returns the file and its size.
pub(crate) fn open_image_file(
    dir: &OwnedFd,
    path: &Path,
    name: &str,
) -> Result<(File, u64), ImageError> {
    let file = path.join(name);
    let flags = OFlag::O_RDONLY
        | OFlag::O_NOFOLLOW
        | OFlag::O_NONBLOCK
        | OFlag::O_NOCTTY
        | OFlag::O_CLOEXEC;
    let fd = match openat(
        Some(std::os::fd::AsRawFd::as_raw_fd(dir)),
        name,
        flags,
        Mode::empty(),
    ) {
        // SAFETY: openat returned a new fd that nothing else owns.
        Ok(fd) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
        Err(nix::Error::ELOOP) => {
            return Err(untrusted(
                &file,
                "a symbolic link (image files are never followed)".into(),
            ))
        }
        Err(nix::Error::ENOENT) => return Err(ImageError::Missing { file }),
        Err(e) => {
            return Err(ImageError::Io {
                path: file,
                source: e.into(),
            })
        }
    };
    checked_image_file(fd, file)
}

/// A description of its own (its own offset) of `held`, an image file [`open_image_file`]
/// opened, through `/proc/self/fd` (the inode `held` is, never a name that could have been
/// swapped), checked as then; `path` names it in messages. The file may have lost its name
/// since (a publish that replaced the image removes the old one): no link is fine, another one
/// is not.
pub(crate) fn reopen_image_file(held: &File, path: &Path) -> Result<(File, u64), ImageError> {
    let flags = OFlag::O_RDONLY | OFlag::O_NONBLOCK | OFlag::O_NOCTTY | OFlag::O_CLOEXEC;
    let proc = format!("/proc/self/fd/{}", std::os::fd::AsRawFd::as_raw_fd(held));
    let fd = match nix::fcntl::open(proc.as_str(), flags, Mode::empty()) {
        // SAFETY: open returned a new fd that nothing else owns.
        Ok(fd) => unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd) },
        Err(e) => {
            return Err(ImageError::Io {
                path: path.to_path_buf(),
                source: e.into(),
            })
        }
    };
    checked_image_file(fd, path.to_path_buf())
}

/// `fd`, the image file `file`, is a regular file that only root can change, with no other
/// link than its name (none once removed: a publish that replaced the image removes the old
/// one's files, maybe between an open by name and this look).
fn checked_image_file(fd: OwnedFd, file: PathBuf) -> Result<(File, u64), ImageError> {
    let st = stat(&fd, &file)?;
    if !is(&st, SFlag::S_IFREG) {
        return Err(ImageError::Unexpected {
            file,
            reason: "not a regular file".into(),
        });
    }
    if let Some(reason) = writable_by_others(&st, false) {
        return Err(untrusted(&file, reason));
    }
    if st.st_nlink > 1 {
        return Err(untrusted(
            &file,
            format!(
                "has {} hard links: another name elsewhere reaches the same file; an image file must have one at most",
                st.st_nlink
            ),
        ));
    }
    let size = u64::try_from(st.st_size).unwrap_or(0);
    Ok((File::from(fd), size))
}
