//! CRIU versions, as `criu --version` prints them, and a cache of the answer per binary.
//!
//! # Design
//! Every `cryo freeze` and `cryo thaw` (and every agent operation) checks the version of the
//! CRIU it is about to run: a `criu --version` process, 2-11 ms measured on this project's host
//! (issue 16), on the path to the suspend and to the restore. The answer is a property of the
//! binary, so it is kept in a file of cryo's state directory (the CRIU scratch root, root's
//! and 0700) next to the binary's identity: device, inode, size, modification and change
//! times. A binary replaced (another inode) or changed in place (its change time moves, which
//! no user can set back) misses the cache and is asked again. A cache file that is not a
//! regular file of the caller's, or is writable by anyone else, or does not parse, is ignored.
//!
//! # Limitations
//! Libraries beside a carried build (`LD_LIBRARY_PATH`) are not part of the identity: they do
//! not change the version a binary prints, and a build that no longer loads fails at its run.

use std::fmt;
use std::io::{Read, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::Path;
use std::process::{Command, Stdio};

use serde::{Deserialize, Serialize};

use crate::error::CriuError;

/// A CRIU release number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct CriuVersion {
    /// Major.
    pub major: u32,
    /// Minor.
    pub minor: u32,
    /// Sublevel (0 when the release has none).
    pub sublevel: u32,
}

impl CriuVersion {
    /// The oldest CRIU cryo works with: bookworm's 3.17 fails on current kernels (vDSO bounds),
    /// and 4.1 cannot dump TCP sockets on Linux >= 6.16 (SO_PASSCRED became unix/netlink only),
    /// which every inference server holds.
    pub const MIN: CriuVersion = CriuVersion {
        major: 4,
        minor: 2,
        sublevel: 0,
    };

    /// From the output of `criu --version` (`Version: 4.1.1`, maybe a `GitID:` line after).
    pub fn parse_output(out: &str) -> Option<CriuVersion> {
        let v = out
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))?
            .trim();
        let mut it = v.split('.').map(|p| p.trim().parse::<u32>());
        let major = it.next()?.ok()?;
        let minor = it.next()?.ok()?;
        let sublevel = match it.next() {
            Some(p) => p.ok()?,
            None => 0,
        };
        Some(CriuVersion {
            major,
            minor,
            sublevel,
        })
    }

    /// Runs `bin --version` (with `lib_dir` in `LD_LIBRARY_PATH` when given).
    pub(crate) fn of_binary(bin: &Path, lib_dir: Option<&Path>) -> Result<CriuVersion, CriuError> {
        let mut cmd = Command::new(bin);
        cmd.arg("--version")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        if let Some(dir) = lib_dir {
            cmd.env("LD_LIBRARY_PATH", dir);
        }
        let err = |reason: String| CriuError::Version {
            path: bin.to_path_buf(),
            reason,
        };
        let out = cmd.output().map_err(|e| err(e.to_string()))?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(err(format!("{}: {}", out.status, stderr.trim())));
        }
        CriuVersion::parse_output(&stdout)
            .ok_or_else(|| err(format!("no 'Version: X.Y' in {:?}", stdout.trim())))
    }
}

/// What identifies a binary's content without reading it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct BinaryId {
    dev: u64,
    ino: u64,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

impl BinaryId {
    /// Of the file `bin` names (links followed: the binary that would run).
    fn of(bin: &Path) -> Option<BinaryId> {
        let m = std::fs::metadata(bin).ok()?;
        Some(BinaryId {
            dev: m.dev(),
            ino: m.ino(),
            size: m.size(),
            mtime: (m.mtime(), m.mtime_nsec()),
            ctime: (m.ctime(), m.ctime_nsec()),
        })
    }
}

/// The cache file's content.
#[derive(Debug, Serialize, Deserialize)]
struct Cached {
    binary: BinaryId,
    version: CriuVersion,
}

impl CriuVersion {
    /// [`CriuVersion::of_binary`], answered from `cache` when it was written for this very
    /// binary (see the module docs); a version read anew is written there (best effort).
    pub(crate) fn of_binary_cached(
        bin: &Path,
        lib_dir: Option<&Path>,
        cache: &Path,
    ) -> Result<CriuVersion, CriuError> {
        let Some(id) = BinaryId::of(bin) else {
            return Self::of_binary(bin, lib_dir);
        };
        if let Some(c) = read_cache(cache).filter(|c| c.binary == id) {
            return Ok(c.version);
        }
        let version = Self::of_binary(bin, lib_dir)?;
        // Recorded only for the binary that answered: not one replaced while it ran.
        if BinaryId::of(bin).as_ref() == Some(&id) {
            if let Err(e) = write_cache(
                cache,
                &Cached {
                    binary: id,
                    version,
                },
            ) {
                tracing::debug!(cache = %cache.display(), error = %e, "cannot cache CRIU's version");
            }
        }
        Ok(version)
    }
}

/// The cache at `path`, if it is a regular file of ours that nobody else can write, and parses.
fn read_cache(path: &Path) -> Option<Cached> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)
        .ok()?;
    let m = f.metadata().ok()?;
    if !m.is_file() || m.uid() != rustix::process::geteuid().as_raw() || m.mode() & 0o022 != 0 {
        return None;
    }
    serde_json::from_reader(std::io::BufReader::new(f).take(4096)).ok()
}

/// Writes `c` to `path` whole (a new file renamed over the old one), private to its owner.
fn write_cache(path: &Path, c: &Cached) -> std::io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)?;
    let mut tmp = tempfile::Builder::new()
        .prefix(".criu-version-")
        .permissions(std::fs::Permissions::from_mode(0o600))
        .tempfile_in(dir)?;
    // Encoded first, written in one `write`: `to_writer` on the file wrote each JSON token
    // with its own system call (about 70 on a cache miss, measured with strace in session 18).
    let json = serde_json::to_vec(c)?;
    tmp.write_all(&json)?;
    tmp.persist(path).map_err(|e| e.error)?;
    Ok(())
}

impl fmt::Display for CriuVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)?;
        if self.sublevel != 0 {
            write!(f, ".{}", self.sublevel)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_release_and_git_builds() {
        let v = CriuVersion::parse_output("Version: 4.1.1\n").unwrap();
        assert_eq!((v.major, v.minor, v.sublevel), (4, 1, 1));
        let v = CriuVersion::parse_output("Version: 3.17\nGitID: v3.17-1-gabc\n").unwrap();
        assert_eq!((v.major, v.minor, v.sublevel), (3, 17, 0));
        assert!(v < CriuVersion::MIN);
        assert_eq!(v.to_string(), "3.17");
        assert_eq!(CriuVersion::parse_output("criu 4.1"), None);
        assert_eq!(CriuVersion::parse_output("Version: four"), None);
    }
}
