//! Memory pressure and OOM-kill counters, for acting before the OOM killer does.
//!
//! # Design
//! Two cgroup layouts are supported, chosen per process from its cgroups
//! ([`cryo_proc::ProcHandle::cgroup_dirs`]):
//! - **v2** (the memory controller on the unified hierarchy): OOM kills from `memory.events`
//!   (`oom_kill N`), pressure from the cgroup's `memory.pressure`.
//! - **v1** (a `memory` controller hierarchy, as on hybrid hosts): OOM kills from
//!   `memory.oom_control` (`oom_kill N`, Linux 4.13+). v1 has no PSI file; pressure then comes
//!   from the process's cgroup on the unified hierarchy if one is mounted (PSI is a core cgroup2
//!   file that exists without the memory controller), else from the system-wide one
//!   ([`cryo_proc::SYSTEM_MEMORY_PRESSURE`]).
//!
//! [`PsiTrigger`] arms a kernel PSI trigger (`some|full STALL_US WINDOW_US`) and waits for it with
//! `poll(POLLPRI)`, which is how a watcher reacts within one window instead of polling averages.
//!
//! Finding the cgroup is `cryo_proc`'s (it goes through `/proc`); reading the files inside it is
//! the cgroup filesystem's API and this module's: only the memory watch acts on them, and the PSI
//! trigger is part of how it waits.
//!
//! # Limitations
//! See [`cryo_proc::Cgroups`] for cgroup namespaces.

use std::fs;
use std::io::{self, Write};
use std::os::fd::AsFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use cryo_proc::{Pid, ProcError, ProcHandle};

use crate::sys;

/// Finding or reading a memory cgroup failed.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// reading {path} failed: {source}
    #[error("reading {path} failed: {source}")]
    Read { path: PathBuf, source: io::Error },
    /// process {pid} is in no memory cgroup this process can see (no v1 `memory` mount, no v2 memory controller)
    #[error("process {pid} is in no memory cgroup this process can see (no v1 `memory` mount, no v2 memory controller)")]
    NoMemoryController { pid: Pid },
    /// {path} has no `{key}` line
    #[error("{path} has no `{key}` line")]
    MissingKey { path: PathBuf, key: &'static str },
    /// The process's cgroups could not be looked up.
    #[error(transparent)]
    Proc(#[from] ProcError),
}

fn read(path: &Path) -> Result<String, CgroupError> {
    fs::read_to_string(path).map_err(|source| CgroupError::Read {
        path: path.to_path_buf(),
        source,
    })
}

/// Which cgroup version a memory cgroup belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    V1,
    V2,
}

/// Where a pressure reading comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PressureSource {
    /// A cgroup2 `memory.pressure` file (the process's own cgroup).
    Cgroup(PathBuf),
    /// The whole machine's ([`cryo_proc::SYSTEM_MEMORY_PRESSURE`]).
    System,
}

impl PressureSource {
    /// The file to read or arm a trigger on.
    pub fn path(&self) -> &Path {
        match self {
            Self::Cgroup(p) => p,
            Self::System => Path::new(cryo_proc::SYSTEM_MEMORY_PRESSURE),
        }
    }
}

/// The memory cgroup of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryCgroup {
    pub version: CgroupVersion,
    /// The cgroup's directory.
    pub dir: PathBuf,
    /// Where its memory pressure is read (see the module docs for v1).
    pub pressure: PressureSource,
}

impl MemoryCgroup {
    /// The memory cgroup of `process`: v1 when a v1 `memory` hierarchy holds it, else v2 when the
    /// unified hierarchy has the memory controller for it.
    pub fn of(process: &ProcHandle) -> Result<Self, CgroupError> {
        let pid = process.pid();
        let cgroups = process.cgroup_dirs()?;
        let v2_pressure = cgroups
            .unified
            .as_ref()
            .map(|d| d.join("memory.pressure"))
            .filter(|p| p.exists());
        if let Some(dir) = cgroups.v1("memory") {
            if dir.join("memory.oom_control").exists() {
                return Ok(Self {
                    version: CgroupVersion::V1,
                    dir: dir.to_path_buf(),
                    pressure: v2_pressure.map_or(PressureSource::System, PressureSource::Cgroup),
                });
            }
        }
        if let Some(dir) = cgroups.unified.filter(|d| d.join("memory.events").exists()) {
            return Ok(Self {
                version: CgroupVersion::V2,
                pressure: PressureSource::Cgroup(dir.join("memory.pressure")),
                dir,
            });
        }
        Err(CgroupError::NoMemoryController { pid })
    }

    /// How many processes the OOM killer killed in this cgroup (and below, for v2) so far.
    pub fn oom_kills(&self) -> Result<u64, CgroupError> {
        let file = match self.version {
            CgroupVersion::V1 => "memory.oom_control",
            CgroupVersion::V2 => "memory.events",
        };
        let path = self.dir.join(file);
        let text = read(&path)?;
        text.lines()
            .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
            .ok_or(CgroupError::MissingKey {
                path,
                key: "oom_kill",
            })
    }

    /// The cgroup's limit, bytes (`None`: unlimited).
    pub fn limit(&self) -> Result<Option<u64>, CgroupError> {
        let file = match self.version {
            CgroupVersion::V1 => "memory.limit_in_bytes",
            CgroupVersion::V2 => "memory.max",
        };
        let path = self.dir.join(file);
        let text = read(&path)?;
        let text = text.trim();
        if text == "max" {
            return Ok(None);
        }
        let limit: u64 = text.parse().map_err(|_| CgroupError::MissingKey {
            path: path.clone(),
            key: "a number",
        })?;
        // v1 says "no limit" with a huge page-rounded number.
        Ok((limit < (1 << 60)).then_some(limit))
    }

    /// Memory the kernel cannot reclaim in this cgroup (and below), bytes: anonymous memory
    /// (shmem and tmpfs included) plus unevictable pages, from `memory.stat`. Page cache, which
    /// the kernel drops under pressure, is left out.
    pub fn unreclaimable(&self) -> Result<u64, CgroupError> {
        let path = self.dir.join("memory.stat");
        let text = read(&path)?;
        // v1's `total_*` count the hierarchy below, as v2's keys do.
        let keys: [&'static str; 3] = match self.version {
            CgroupVersion::V1 => ["total_rss", "total_shmem", "total_unevictable"],
            CgroupVersion::V2 => ["anon", "shmem", "unevictable"],
        };
        let value = |key: &'static str| {
            text.lines()
                .find_map(|l| {
                    let (k, v) = l.split_once(' ')?;
                    (k == key).then(|| v.trim().parse::<u64>().ok()).flatten()
                })
                .ok_or(CgroupError::MissingKey {
                    path: path.clone(),
                    key,
                })
        };
        // shmem (tmpfs) is file-backed in the stats but cannot be dropped without swap. Mlocked
        // anonymous pages count twice (anon and unevictable): an overestimate, acting early.
        Ok(value(keys[0])? + value(keys[1]).unwrap_or(0) + value(keys[2]).unwrap_or(0))
    }

    /// How often this cgroup hit its limit and could not reclaim enough (`oom` in
    /// `memory.events`; v1: `under_oom` turns to 1, counted as 0 or 1).
    pub fn oom_events(&self) -> Result<u64, CgroupError> {
        let (file, key) = match self.version {
            CgroupVersion::V1 => ("memory.oom_control", "under_oom "),
            CgroupVersion::V2 => ("memory.events", "oom "),
        };
        let path = self.dir.join(file);
        let text = read(&path)?;
        text.lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .ok_or(CgroupError::MissingKey {
                path,
                key: key.trim_end(),
            })
    }

    /// The current pressure reading for this cgroup (see [`PressureSource`]).
    pub fn pressure(&self) -> Result<Psi, CgroupError> {
        Psi::read(self.pressure.path())
    }
}

/// One PSI line: share of wall time some (or all) tasks stalled on memory.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PsiLine {
    pub avg10: f64,
    pub avg60: f64,
    pub avg300: f64,
    /// Total stall time, microseconds.
    pub total_us: u64,
}

/// A PSI file: the `some` line and, for memory, the `full` line.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Psi {
    pub some: PsiLine,
    pub full: Option<PsiLine>,
}

impl Psi {
    /// Parses the text of a PSI file; `None` when it has no `some` line.
    pub fn parse(text: &str) -> Option<Self> {
        let mut psi = Psi::default();
        let mut saw_some = false;
        for line in text.lines() {
            let mut words = line.split_whitespace();
            let kind = words.next();
            let mut l = PsiLine::default();
            for w in words {
                let (k, v) = w.split_once('=')?;
                match k {
                    "avg10" => l.avg10 = v.parse().ok()?,
                    "avg60" => l.avg60 = v.parse().ok()?,
                    "avg300" => l.avg300 = v.parse().ok()?,
                    "total" => l.total_us = v.parse().ok()?,
                    _ => {}
                }
            }
            match kind {
                Some("some") => {
                    psi.some = l;
                    saw_some = true;
                }
                Some("full") => psi.full = Some(l),
                _ => {}
            }
        }
        saw_some.then_some(psi)
    }

    /// Reads a PSI file.
    pub fn read(path: &Path) -> Result<Self, CgroupError> {
        Self::parse(&read(path)?).ok_or(CgroupError::MissingKey {
            path: path.to_path_buf(),
            key: "some",
        })
    }

    /// The machine's memory pressure.
    pub fn system() -> Result<Self, CgroupError> {
        Self::read(PressureSource::System.path())
    }
}

/// Arming or waiting on a PSI trigger failed.
#[derive(Debug, thiserror::Error)]
pub enum TriggerError {
    /// arming a PSI trigger on {path} failed: {source}
    #[error("arming a PSI trigger on {path} failed: {source}")]
    Arm { path: PathBuf, source: io::Error },
    /// waiting on the PSI trigger on {path} failed: {source}
    #[error("waiting on the PSI trigger on {path} failed: {source}")]
    Wait { path: PathBuf, source: io::Error },
}

/// Which PSI line a trigger watches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stall {
    Some,
    Full,
}

/// A kernel PSI trigger: fires when the stall time within `window` exceeds `threshold`.
#[derive(Debug)]
pub struct PsiTrigger {
    path: PathBuf,
    file: fs::File,
}

impl PsiTrigger {
    /// Arms a trigger on a PSI file. The kernel requires `window` in 500 ms..=10 s and
    /// `threshold <= window`; unprivileged users need a window that is a multiple of 2 s.
    pub fn arm(
        source: &PressureSource,
        stall: Stall,
        threshold: Duration,
        window: Duration,
    ) -> Result<Self, TriggerError> {
        let path = source.path().to_path_buf();
        let kind = match stall {
            Stall::Some => "some",
            Stall::Full => "full",
        };
        let spec = format!("{kind} {} {}\0", threshold.as_micros(), window.as_micros());
        let arm_err = |source| TriggerError::Arm {
            path: path.clone(),
            source,
        };
        let mut file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(&path)
            .map_err(arm_err)?;
        file.write_all(spec.as_bytes()).map_err(arm_err)?;
        Ok(Self { path, file })
    }

    /// Waits up to `timeout` (`None`: forever); `Ok(true)` when the trigger fired.
    pub fn wait(&self, timeout: Option<Duration>) -> Result<bool, TriggerError> {
        let ms = timeout.map_or(-1, |t| i32::try_from(t.as_millis()).unwrap_or(i32::MAX));
        sys::poll_pri(self.file.as_fd(), ms).map_err(|source| TriggerError::Wait {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn psi_parses() {
        let p = Psi::parse(
            "some avg10=1.50 avg60=0.00 avg300=0.00 total=123\n\
             full avg10=0.25 avg60=0.00 avg300=0.00 total=7\n",
        )
        .unwrap();
        assert_eq!(p.some.avg10, 1.5);
        assert_eq!(p.some.total_us, 123);
        assert_eq!(p.full.unwrap().total_us, 7);
        assert!(Psi::parse("garbage\n").is_none());
    }

    #[test]
    fn system_pressure_reads() {
        Psi::system().unwrap();
    }
}
