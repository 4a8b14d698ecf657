//! CRIU versions, as `criu --version` prints them.

use std::fmt;
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
