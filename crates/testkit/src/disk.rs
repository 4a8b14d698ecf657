//! A small disk to fill at the worst moment: a tmpfs of a chosen size, mounted by root, so that
//! a write meets the real `ENOSPC` (whole, or torn part-way through, as the kernel has it), not
//! an error a failpoint invents.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

/// A tmpfs mounted on a directory, unmounted (lazily: a process may still hold a file there)
/// when dropped.
#[derive(Debug)]
pub struct SmallDisk {
    path: PathBuf,
    /// The directory it is mounted on, when the kit made it.
    _dir: Option<tempfile::TempDir>,
}

impl SmallDisk {
    /// A tmpfs of `size` (`mount -o size=SIZE`: `64k`, `16M`) on a fresh directory of its own.
    pub fn mount(size: &str) -> SmallDisk {
        let dir = tempfile::tempdir().unwrap();
        let mut disk = SmallDisk::mount_at(dir.path(), size);
        disk._dir = Some(dir);
        disk
    }

    /// A tmpfs of `size` mounted at `path` (made if missing, mode 0755).
    pub fn mount_at(path: &Path, size: &str) -> SmallDisk {
        std::fs::create_dir_all(path).unwrap();
        let mounted = Command::new("mount")
            .args([
                "-t",
                "tmpfs",
                "-o",
                &format!("size={size},mode=0755"),
                "tmpfs",
            ])
            .arg(path)
            .status()
            .unwrap();
        assert!(
            mounted.success(),
            "mount a tmpfs at {} (these tests run as root): {mounted}",
            path.display()
        );
        SmallDisk {
            path: path.to_path_buf(),
            _dir: None,
        }
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Fills what is left of it with one file (512-byte writes until `ENOSPC`); the file's path
    /// (remove it to make room again).
    pub fn fill(&self) -> PathBuf {
        use std::io::Write;
        let filler = self.path.join("filler");
        let mut f = std::fs::File::create(&filler).unwrap();
        let block = [0xaau8; 512];
        loop {
            match f.write(&block) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling {}: {e}", self.path.display()),
            }
        }
        filler
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.path).status();
    }
}
