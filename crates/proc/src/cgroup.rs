//! Which cgroups a process is in, and which processes a cgroup holds.
//!
//! # Design
//! Only the lookups that go through `/proc` live here: `/proc/PID/cgroup` joined with the cgroup
//! mounts of `/proc/self/mountinfo` gives the directories of a process's cgroups. What is read
//! inside those directories (memory events, PSI, limits) is the cgroup filesystem's API and belongs
//! to whoever acts on it (the guard's memory watch).
//!
//! # Limitations
//! Paths in `/proc/PID/cgroup` are joined to the mount point as they are; a cgroup namespace whose
//! root differs from the mount's root is not translated.

use std::fs;
use std::path::{Path, PathBuf};

use crate::{Pid, ProcError};

/// One line of `/proc/PID/cgroup`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupEntry {
    /// Hierarchy id (0 for the cgroup v2 unified hierarchy).
    pub hierarchy: u32,
    /// Controllers bound to the hierarchy (`memory`, `cpu,cpuacct`, `name=systemd`; empty for v2).
    pub controllers: String,
    /// The cgroup's path inside the hierarchy, as the kernel shows it to the reader (relative to
    /// the reader's cgroup namespace).
    pub path: String,
}

impl From<procfs::ProcessCGroup> for CgroupEntry {
    fn from(c: procfs::ProcessCGroup) -> Self {
        CgroupEntry {
            hierarchy: c.hierarchy,
            controllers: c.controllers.join(","),
            path: c.pathname,
        }
    }
}

/// The cgroup directories of one process, as this process sees the cgroup mounts.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Cgroups {
    /// Its cgroup on the unified (v2) hierarchy, when one is mounted.
    pub unified: Option<PathBuf>,
    /// Its cgroups on v1 hierarchies that are mounted: the controllers and the directory.
    pub v1: Vec<(Vec<String>, PathBuf)>,
}

impl Cgroups {
    /// Its cgroup on the v1 hierarchy of `controller` (`memory`), when one is mounted.
    pub fn v1(&self, controller: &str) -> Option<&Path> {
        self.v1
            .iter()
            .find(|(ctrls, _)| ctrls.iter().any(|c| c == controller))
            .map(|(_, dir)| dir.as_path())
    }

    /// Joins the entries of `/proc/PID/cgroup` to the cgroup mounts of `/proc/self/mountinfo`.
    pub(crate) fn resolve(pid: Pid, memberships: &[CgroupEntry]) -> Result<Cgroups, ProcError> {
        let mounts = procfs::process::Process::myself()
            .and_then(|me| me.mountinfo())
            .map_err(|source| ProcError::read(pid, "mountinfo (of cryo)", source))?;
        let mut unified_mount = None;
        let mut v1_mounts: Vec<(Vec<String>, PathBuf)> = Vec::new();
        for m in mounts {
            match m.fs_type.as_str() {
                "cgroup2" if unified_mount.is_none() => unified_mount = Some(m.mount_point),
                "cgroup" => {
                    let ctrls = m.super_options.keys().cloned().collect();
                    v1_mounts.push((ctrls, m.mount_point));
                }
                _ => {}
            }
        }
        let join = |mount: &Path, path: &str| mount.join(path.trim_start_matches('/'));
        let mut out = Cgroups::default();
        for cg in memberships {
            let ctrls: Vec<String> = cg
                .controllers
                .split(',')
                .filter(|c| !c.is_empty())
                .map(str::to_string)
                .collect();
            if cg.hierarchy == 0 && ctrls.is_empty() {
                out.unified = unified_mount.as_deref().map(|m| join(m, &cg.path));
            } else if let Some((_, mount)) = v1_mounts
                .iter()
                .find(|(opts, _)| ctrls.iter().any(|c| opts.contains(c)))
            {
                out.v1.push((ctrls, join(mount, &cg.path)));
            }
        }
        Ok(out)
    }
}

/// Every process in a cgroup (`path` is the cgroup directory, v1 or v2), ascending.
pub fn cgroup_procs(path: &Path) -> Result<Vec<Pid>, ProcError> {
    let file = if path.ends_with("cgroup.procs") {
        path.to_path_buf()
    } else {
        path.join("cgroup.procs")
    };
    let text = fs::read_to_string(&file).map_err(|source| ProcError::Cgroup {
        path: file.clone(),
        source,
    })?;
    let mut pids: Vec<Pid> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// Every process with a task anywhere in the cgroup subtree at `path` (the directory, v1 or v2,
/// and every cgroup below it), ascending: how a pod (whose cgroup holds only the containers'
/// cgroups on v2) or a systemd unit (with sub-scopes) is taken as a whole. Each cgroup's
/// `cgroup.procs` is read, and so are its thread lists (`cgroup.threads` on v2, `tasks` on v1),
/// each thread taken as its process: a threaded cgroup lists no processes of its own (its
/// `cgroup.procs` cannot be read), and a process may have threads in a cgroup its leader is
/// not in. A cgroup removed while it is walked is simply not part of the result; the top one must
/// be readable.
pub fn cgroup_tree_procs(path: &Path) -> Result<Vec<Pid>, ProcError> {
    let top = if path.ends_with("cgroup.procs") {
        path.parent().unwrap_or(path).to_path_buf()
    } else {
        path.to_path_buf()
    };
    let mut pids = cgroup_procs(&top)?;
    let mut dirs = vec![top.clone()];
    while let Some(dir) = dirs.pop() {
        if dir != top {
            match cgroup_procs(&dir) {
                Ok(p) => pids.extend(p),
                Err(ProcError::Cgroup { source, .. }) if vanished_or_threaded(&source) => {}
                Err(e) => return Err(e),
            }
        }
        for list in ["cgroup.threads", "tasks"] {
            let file = dir.join(list);
            match fs::read_to_string(&file) {
                Ok(text) => {
                    for tid in text.lines().filter_map(|l| l.trim().parse::<Pid>().ok()) {
                        // A thread that exited since the listing is not part of it.
                        if let Ok(Some(tgid)) = crate::read::tgid(tid) {
                            pids.push(tgid);
                        }
                    }
                }
                Err(e) if vanished_or_threaded(&e) => {}
                Err(source) => return Err(ProcError::Cgroup { path: file, source }),
            }
        }
        let entries = match fs::read_dir(&dir) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && dir != top => continue,
            Err(source) => return Err(ProcError::Cgroup { path: dir, source }),
        };
        for entry in entries.flatten() {
            // Child cgroups are directories; a symlink is never followed out of the subtree.
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                dirs.push(entry.path());
            }
        }
    }
    pids.sort_unstable();
    pids.dedup();
    Ok(pids)
}

/// A cgroup file that is gone (the cgroup was removed, or the file does not exist on this
/// version) or that the kernel will not list (`cgroup.procs` of a threaded cgroup).
fn vanished_or_threaded(e: &std::io::Error) -> bool {
    e.kind() == std::io::ErrorKind::NotFound
        || matches!(
            e.raw_os_error(),
            Some(libc::EOPNOTSUPP) | Some(libc::ENODEV)
        )
}
