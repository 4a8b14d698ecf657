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

/// Whether `dir` is the root of its cgroup hierarchy as mounted here (its parent directory is on
/// another file system): every process of that hierarchy (of this cgroup namespace) is in it or
/// below it.
pub fn is_hierarchy_root(dir: &Path) -> std::io::Result<bool> {
    use std::os::unix::fs::MetadataExt;
    Ok(fs::metadata(dir)?.dev() != fs::metadata(dir.join(".."))?.dev())
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
    let mut pids = match cgroup_procs(&top) {
        Ok(p) => p,
        // A threaded cgroup: its threads are read below.
        Err(ProcError::Cgroup { source, .. })
            if source.raw_os_error() == Some(libc::EOPNOTSUPP) =>
        {
            Vec::new()
        }
        Err(e) => return Err(e),
    };
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;
    use std::path::PathBuf;
    use std::process::{Child, Command};

    /// Cgroups made for one test under `root`, named uniquely, removed (deepest first) on drop.
    struct Tree {
        dirs: Vec<PathBuf>,
        kids: Vec<Child>,
    }

    impl Tree {
        fn new(root: &str, tag: &str) -> Tree {
            let root = Path::new(root);
            assert!(
                root.join("cgroup.procs").exists(),
                "this test needs a cgroup hierarchy at {} (and root)",
                root.display()
            );
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let top = root.join(format!("cryo-test-{tag}-{}-{nanos}", std::process::id()));
            fs::create_dir(&top).unwrap();
            Tree {
                dirs: vec![top],
                kids: Vec::new(),
            }
        }
        fn top(&self) -> PathBuf {
            self.dirs[0].clone()
        }
        fn sub(&mut self, rel: &str) -> PathBuf {
            let d = self.top().join(rel);
            fs::create_dir(&d).unwrap();
            self.dirs.push(d.clone());
            d
        }
        /// A new process in `dir`.
        fn spawn_in(&mut self, dir: &Path) -> Pid {
            let child = Command::new("sleep").arg("60").spawn().unwrap();
            let pid = child.id() as Pid;
            self.kids.push(child);
            fs::write(dir.join("cgroup.procs"), pid.to_string()).unwrap();
            pid
        }
    }

    impl Drop for Tree {
        fn drop(&mut self) {
            for k in &mut self.kids {
                let _ = k.kill();
                let _ = k.wait();
            }
            for d in self.dirs.iter().rev() {
                let _ = fs::remove_dir(d);
            }
        }
    }

    /// Issue 9 item 6, cgroup v2: a pod-like cgroup lists no processes of its own, its
    /// containers do; a threaded cgroup lists threads only (its `cgroup.procs` cannot be read),
    /// each taken as its process. Main read only the top `cgroup.procs`: nothing.
    #[test]
    fn a_mounted_hierarchys_root_is_told_from_a_cgroup_below_it() {
        let mounts = procfs::process::Process::myself()
            .unwrap()
            .mountinfo()
            .unwrap();
        let root = mounts
            .into_iter()
            .find(|m| m.fs_type == "cgroup2" || m.fs_type == "cgroup")
            .expect("a cgroup hierarchy is mounted")
            .mount_point;
        assert!(is_hierarchy_root(&root).unwrap());
        // a directory below a mount (the cgroups below a root are checked by the CLI's prestop tests)
        assert!(!is_hierarchy_root(Path::new("/proc/self")).unwrap());
    }

    #[test]
    fn a_v2_subtree_is_taken_whole_threaded_cgroups_included() {
        let mut t = Tree::new("/sys/fs/cgroup/unified", "pod");
        let a = t.sub("container-a");
        let b = t.sub("container-b");
        let pa = t.spawn_in(&a);
        let pb = t.spawn_in(&b);
        // A worker whose thread sits in a threaded child cgroup.
        let w = t.sub("container-b/worker");
        let pw = t.spawn_in(&w);
        let threaded = t.sub("container-b/worker/threads");
        fs::write(threaded.join("cgroup.type"), "threaded").unwrap();
        fs::write(threaded.join("cgroup.threads"), pw.to_string()).unwrap();
        assert!(cgroup_procs(&t.top()).unwrap().is_empty());
        let mut want = vec![pa, pb, pw];
        want.sort_unstable();
        assert_eq!(cgroup_tree_procs(&t.top()).unwrap(), want);
        assert_eq!(cgroup_tree_procs(&threaded).unwrap(), vec![pw]);
    }

    /// Issue 9 item 6, the v1 hierarchies of a hybrid host: the same, with a thread moved
    /// alone into another cgroup through `tasks`.
    #[test]
    fn a_v1_subtree_is_taken_whole_threads_included() {
        let mut t = Tree::new("/sys/fs/cgroup/pids", "pod");
        let a = t.sub("container-a");
        let scope = t.sub("container-a/sub-scope");
        let pa = t.spawn_in(&a);
        let ps = t.spawn_in(&scope);
        let lone = t.sub("lone-thread");
        // This test's own thread: a process whose thread sits in a cgroup its leader is not in.
        let me = Pid::try_from(std::process::id()).unwrap();
        let thread = cryo_testkit::procs::Thread::start();
        let tid = thread.tid;
        let home = fs::read_to_string(format!("/proc/{tid}/cgroup")).unwrap();
        let home = home
            .lines()
            .find_map(|l| l.split_once(":pids:").map(|(_, p)| p.to_string()))
            .expect("no v1 pids cgroup for this thread");
        fs::write(lone.join("tasks"), tid.to_string()).unwrap();
        let listed = cgroup_tree_procs(&t.top());
        // Back home before anything can fail, so the cgroup can be removed.
        fs::write(
            Path::new("/sys/fs/cgroup/pids")
                .join(home.trim_start_matches('/'))
                .join("tasks"),
            tid.to_string(),
        )
        .unwrap();
        drop(thread);
        let mut want = vec![pa, ps, me];
        want.sort_unstable();
        assert_eq!(listed.unwrap(), want);
    }
}
