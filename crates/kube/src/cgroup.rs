//! Containers as targets: a pod's container -> its cgroup directory on this node.
//!
//! # Design
//! The layouts are those of [`crate::identity`] (systemd and cgroupfs drivers, containerd and
//! CRI-O, and Docker through cri-dockerd). The cgroup filesystem is either cgroup v2 (one tree,
//! `ROOT/cgroup.controllers` exists) or v1/hybrid (one tree per controller under `ROOT/<name>`,
//! plus `ROOT/unified` on hybrid hosts). The pod's directory is looked for where the kubelet puts
//! it for the pod's QoS class, under each of the hierarchies that list every process
//! (`pids`, `memory`, `cpu,cpuacct`, `systemd`, in that order, on v1), and, for a kubelet started
//! with another `--cgroup-root`, by a bounded search for the pod's directory name. Symbolic links
//! are never followed. The container's directory is the child of the pod's that the runtime names
//! after the container ID; the stop takes its whole subtree (crun puts processes in a `container`
//! child on v2).
//!
//! `ROOT` is `/sys/fs/cgroup` on a host; in the agent's pod it is the host's tree mounted
//! elsewhere (the container's own `/sys/fs/cgroup` is its private cgroup namespace).

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use cryo_proc::Pid;

use crate::identity::{pod_component, ContainerId, PodUid, Runtime};

/// The pod's QoS class (`status.qosClass`), which decides where the kubelet puts its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosClass {
    /// Requests equal limits for every resource of every container.
    Guaranteed,
    /// Some requests.
    Burstable,
    /// No requests or limits.
    BestEffort,
}

impl QosClass {
    /// From `status.qosClass`.
    pub fn from_status(s: &str) -> Option<Self> {
        match s {
            "Guaranteed" => Some(QosClass::Guaranteed),
            "Burstable" => Some(QosClass::Burstable),
            "BestEffort" => Some(QosClass::BestEffort),
            _ => None,
        }
    }

    fn level(self) -> Option<&'static str> {
        match self {
            QosClass::Guaranteed => None,
            QosClass::Burstable => Some("burstable"),
            QosClass::BestEffort => Some("besteffort"),
        }
    }
}

/// Which cgroup version the tree is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupVersion {
    /// One unified tree.
    V2,
    /// One tree per controller (with or without the unified tree beside them: hybrid).
    V1,
}

/// Resolving a container or a pod to its cgroup failed.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// The cgroup root has neither a v2 tree nor any v1 hierarchy cryo can use.
    #[error("{0} is not a cgroup filesystem cryo understands (no cgroup.controllers, no pids/memory/cpu,cpuacct/systemd hierarchy)")]
    NoCgroupFs(PathBuf),
    /// The pod's cgroup is not on this node (wrong node, pod gone, or a layout cryo does not know).
    #[error("pod {pod}: no cgroup under {root} (looked for {looked})")]
    PodNotFound {
        /// The pod.
        pod: PodUid,
        /// Where.
        root: PathBuf,
        /// The directory names tried.
        looked: String,
    },
    /// The container's cgroup is not in the pod's (not running, or gone).
    #[error("container {container} has no cgroup in {pod_dir}")]
    ContainerNotFound {
        /// The container.
        container: ContainerId,
        /// The pod's cgroup directory.
        pod_dir: PathBuf,
    },
    /// The pod's cgroup was found twice (two kubelet roots?): refused rather than guessed.
    #[error("pod {pod}: more than one cgroup: {first} and {second}")]
    Ambiguous {
        /// The pod.
        pod: PodUid,
        /// One.
        first: PathBuf,
        /// The other.
        second: PathBuf,
    },
    /// Reading the cgroup tree failed.
    #[error("reading {path}: {source}")]
    Io {
        /// What was read.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
}

/// The v1 hierarchies whose `cgroup.procs` list every process of a container, most common first.
const V1_HIERARCHIES: [&str; 4] = ["pids", "memory", "cpu,cpuacct", "systemd"];

/// How deep the fallback search for a pod directory goes below a hierarchy's root.
const SEARCH_DEPTH: usize = 5;

/// A node's cgroup filesystem.
#[derive(Debug, Clone)]
pub struct CgroupFs {
    root: PathBuf,
    version: CgroupVersion,
    /// Trees to search, in order: the root itself on v2, the usable v1 hierarchies on v1.
    trees: Vec<PathBuf>,
}

/// A container's cgroup.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerCgroup {
    /// The container.
    pub container: ContainerId,
    /// Its directory (the whole subtree is the container).
    pub dir: PathBuf,
}

impl CgroupFs {
    /// Looks at the tree mounted at `root` (`/sys/fs/cgroup` on a host).
    pub fn detect(root: impl Into<PathBuf>) -> Result<Self, ResolveError> {
        let root = root.into();
        if root.join("cgroup.controllers").is_file() {
            return Ok(CgroupFs {
                trees: vec![root.clone()],
                root,
                version: CgroupVersion::V2,
            });
        }
        let trees: Vec<PathBuf> = V1_HIERARCHIES
            .iter()
            .map(|h| root.join(h))
            .filter(|p| p.join("cgroup.procs").is_file())
            .collect();
        if trees.is_empty() {
            return Err(ResolveError::NoCgroupFs(root));
        }
        Ok(CgroupFs {
            root,
            version: CgroupVersion::V1,
            trees,
        })
    }

    /// The version.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The pod's cgroup directory. `qos` narrows the places looked at first; `None` tries all.
    pub fn pod_dir(&self, pod: &PodUid, qos: Option<QosClass>) -> Result<PathBuf, ResolveError> {
        let expected = expected_pod_dirs(pod, qos);
        for tree in &self.trees {
            for rel in &expected {
                let p = tree.join(rel);
                if is_real_dir(&p)? {
                    return Ok(p);
                }
            }
        }
        // Another --cgroup-root: search by name.
        for tree in &self.trees {
            let mut hits = Vec::new();
            search_pod(tree, pod, SEARCH_DEPTH, false, &mut hits)?;
            match hits.len() {
                0 => continue,
                1 => return Ok(hits.remove(0)),
                _ => {
                    return Err(ResolveError::Ambiguous {
                        pod: pod.clone(),
                        first: hits.remove(0),
                        second: hits.remove(0),
                    })
                }
            }
        }
        Err(ResolveError::PodNotFound {
            pod: pod.clone(),
            root: self.root.clone(),
            looked: expected
                .iter()
                .map(|p| p.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
    }

    /// The container's cgroup directory.
    pub fn container(
        &self,
        pod: &PodUid,
        qos: Option<QosClass>,
        container: &ContainerId,
    ) -> Result<ContainerCgroup, ResolveError> {
        let pod_dir = self.pod_dir(pod, qos)?;
        for name in container_dir_names(container) {
            let p = pod_dir.join(&name);
            if is_real_dir(&p)? {
                return Ok(ContainerCgroup {
                    container: container.clone(),
                    dir: p,
                });
            }
        }
        Err(ResolveError::ContainerNotFound {
            container: container.clone(),
            pod_dir,
        })
    }
}

impl ContainerCgroup {
    /// Every process of the container: its cgroup and all cgroups below (depth-first, each pid
    /// once). Processes come and go while this reads; a cgroup removed meanwhile is skipped.
    pub fn pids(&self) -> Result<Vec<Pid>, ResolveError> {
        let mut out = BTreeSet::new();
        subtree_pids(&self.dir, &mut out)?;
        Ok(out.into_iter().collect())
    }
}

fn subtree_pids(dir: &Path, out: &mut BTreeSet<Pid>) -> Result<(), ResolveError> {
    match cryo_proc::cgroup_procs(dir) {
        Ok(p) => out.extend(p),
        Err(cryo_proc::ProcError::Cgroup { source, .. })
            if source.kind() == std::io::ErrorKind::NotFound =>
        {
            return Ok(())
        }
        Err(cryo_proc::ProcError::Cgroup { path, source }) => {
            return Err(ResolveError::Io { path, source })
        }
        Err(other) => {
            return Err(ResolveError::Io {
                path: dir.to_path_buf(),
                source: std::io::Error::other(other.to_string()),
            })
        }
    }
    for child in child_dirs(dir)? {
        subtree_pids(&child, out)?;
    }
    Ok(())
}

/// The directories where the kubelet puts a pod's cgroup, relative to a hierarchy's root.
pub fn expected_pod_dirs(pod: &PodUid, qos: Option<QosClass>) -> Vec<PathBuf> {
    let classes: Vec<QosClass> = match qos {
        Some(q) => vec![q],
        None => vec![
            QosClass::Burstable,
            QosClass::BestEffort,
            QosClass::Guaranteed,
        ],
    };
    let mut out = Vec::new();
    for q in classes {
        let u = pod.systemd_escaped();
        match q.level() {
            Some(l) => {
                out.push(PathBuf::from(format!(
                    "kubepods.slice/kubepods-{l}.slice/kubepods-{l}-pod{u}.slice"
                )));
                out.push(PathBuf::from(format!("kubepods/{l}/pod{pod}")));
            }
            None => {
                out.push(PathBuf::from(format!(
                    "kubepods.slice/kubepods-pod{u}.slice"
                )));
                out.push(PathBuf::from(format!("kubepods/pod{pod}")));
            }
        }
    }
    out
}

/// The names a runtime gives a container's cgroup, systemd driver first.
pub fn container_dir_names(c: &ContainerId) -> Vec<String> {
    let id = &c.id;
    match c.runtime {
        Runtime::Containerd => vec![format!("cri-containerd-{id}.scope"), id.clone()],
        Runtime::CriO => vec![format!("crio-{id}.scope"), format!("crio-{id}")],
        Runtime::Docker => vec![format!("docker-{id}.scope"), id.clone()],
    }
}

fn is_real_dir(p: &Path) -> Result<bool, ResolveError> {
    match fs::symlink_metadata(p) {
        Ok(m) => Ok(m.file_type().is_dir()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(source) => Err(ResolveError::Io {
            path: p.to_path_buf(),
            source,
        }),
    }
}

fn child_dirs(dir: &Path) -> Result<Vec<PathBuf>, ResolveError> {
    let entries = match fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(source) => {
            return Err(ResolveError::Io {
                path: dir.to_path_buf(),
                source,
            })
        }
    };
    let mut out = Vec::new();
    for e in entries.flatten() {
        // file_type() does not follow links: a symlink is never a child cgroup.
        if e.file_type().is_ok_and(|t| t.is_dir()) {
            out.push(e.path());
        }
    }
    out.sort();
    Ok(out)
}

/// Looks for the pod's directory below `dir`. Only where a kubelet's tree can be: slices, and
/// anything below a `kube*` directory (the QoS levels of the cgroupfs driver); not into every
/// container and service of the host.
fn search_pod(
    dir: &Path,
    pod: &PodUid,
    depth: usize,
    in_kube: bool,
    hits: &mut Vec<PathBuf>,
) -> Result<(), ResolveError> {
    if depth == 0 {
        return Ok(());
    }
    for child in child_dirs(dir)? {
        let name = child.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if pod_component(name).as_ref() == Some(pod) {
            hits.push(child);
        } else if in_kube || name.starts_with("kube") || name.ends_with(".slice") {
            let kube = in_kube || name.starts_with("kube");
            search_pod(&child, pod, depth - 1, kube, hits)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";
    const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    fn mk(root: &Path, rel: &str) -> PathBuf {
        let p = root.join(rel);
        fs::create_dir_all(&p).unwrap();
        fs::write(p.join("cgroup.procs"), "").unwrap();
        p
    }

    fn v2(root: &Path) {
        fs::create_dir_all(root).unwrap();
        fs::write(root.join("cgroup.controllers"), "cpu memory pids").unwrap();
        fs::write(root.join("cgroup.procs"), "1\n").unwrap();
    }

    fn hybrid(root: &Path) {
        for h in ["pids", "memory", "cpu,cpuacct", "systemd", "freezer"] {
            mk(root, h);
        }
        v2(&root.join("unified"));
    }

    fn cid(rt: &str) -> ContainerId {
        format!("{rt}://{A}").parse().unwrap()
    }

    #[test]
    fn every_layout_on_v2_and_hybrid_v1() {
        let uid: PodUid = UID.parse().unwrap();
        let u_ = uid.systemd_escaped();
        let cases = [
            ("containerd", Some(QosClass::Burstable), format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/cri-containerd-{A}.scope")),
            ("containerd", Some(QosClass::Guaranteed), format!("kubepods.slice/kubepods-pod{u_}.slice/cri-containerd-{A}.scope")),
            ("containerd", Some(QosClass::BestEffort), format!("kubepods/besteffort/pod{UID}/{A}")),
            ("containerd", None, format!("kubepods/pod{UID}/{A}")),
            ("cri-o", Some(QosClass::Burstable), format!("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{u_}.slice/crio-{A}.scope")),
            ("cri-o", Some(QosClass::Guaranteed), format!("kubepods/pod{UID}/crio-{A}")),
            ("cri-o", None, format!("kubepods/burstable/pod{UID}/crio-{A}")),
        ];
        for (rt, qos, rel) in cases {
            // v2
            let t = tempfile::tempdir().unwrap();
            let root = t.path().join("cg");
            v2(&root);
            let dir = mk(&root, &rel);
            let fs_ = CgroupFs::detect(&root).unwrap();
            assert_eq!(fs_.version(), CgroupVersion::V2);
            assert_eq!(
                fs_.container(&uid, qos, &cid(rt)).unwrap().dir,
                dir,
                "v2 {rel}"
            );
            // hybrid v1: in the pids hierarchy (and memory), not in unified
            let t = tempfile::tempdir().unwrap();
            let root = t.path().join("cg");
            hybrid(&root);
            let dir = mk(&root.join("pids"), &rel);
            mk(&root.join("memory"), &rel);
            let fs_ = CgroupFs::detect(&root).unwrap();
            assert_eq!(fs_.version(), CgroupVersion::V1);
            assert_eq!(
                fs_.container(&uid, qos, &cid(rt)).unwrap().dir,
                dir,
                "v1 {rel}"
            );
        }
    }

    #[test]
    fn v1_without_pids_uses_the_next_hierarchy() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path();
        for h in ["memory", "systemd"] {
            mk(root, h);
        }
        let dir = mk(&root.join("systemd"), &format!("kubepods/pod{UID}/{A}"));
        let fs_ = CgroupFs::detect(root).unwrap();
        let got = fs_
            .container(&UID.parse().unwrap(), None, &cid("containerd"))
            .unwrap();
        assert_eq!(got.dir, dir);
    }

    #[test]
    fn another_cgroup_root_is_found_by_search_and_links_are_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("cg");
        v2(&root);
        let uid: PodUid = UID.parse().unwrap();
        let u_ = uid.systemd_escaped();
        let rel = format!("kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{u_}.slice/cri-containerd-{A}.scope");
        let dir = mk(&root, &rel);
        let fs_ = CgroupFs::detect(&root).unwrap();
        assert_eq!(
            fs_.container(&uid, Some(QosClass::Burstable), &cid("containerd"))
                .unwrap()
                .dir,
            dir
        );

        // a link named like the pod, pointing at a planted tree, is not a pod cgroup
        let t2 = tempfile::tempdir().unwrap();
        let root2 = t2.path().join("cg");
        v2(&root2);
        let planted = mk(t2.path(), &format!("elsewhere/{A}"));
        fs::create_dir_all(root2.join("kubepods")).unwrap();
        std::os::unix::fs::symlink(
            planted.parent().unwrap(),
            root2.join(format!("kubepods/pod{UID}")),
        )
        .unwrap();
        let fs2 = CgroupFs::detect(&root2).unwrap();
        assert!(matches!(
            fs2.container(&uid, None, &cid("containerd")),
            Err(ResolveError::PodNotFound { .. })
        ));
    }

    #[test]
    fn a_cgroupfs_tree_under_another_root_is_found() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("cg");
        v2(&root);
        let dir = mk(
            &root,
            &format!("custom.slice/kubepods/besteffort/pod{UID}/{A}"),
        );
        mk(&root, "system.slice/other/deeper/still");
        let fs_ = CgroupFs::detect(&root).unwrap();
        let got = fs_
            .container(&UID.parse().unwrap(), None, &cid("containerd"))
            .unwrap();
        assert_eq!(got.dir, dir);
    }

    #[test]
    fn two_kubelet_trees_with_the_pod_are_refused() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("cg");
        v2(&root);
        mk(&root, &format!("kubeA.slice/pod{UID}"));
        mk(&root, &format!("kubeB.slice/pod{UID}"));
        let fs_ = CgroupFs::detect(&root).unwrap();
        assert!(matches!(
            fs_.pod_dir(&UID.parse().unwrap(), None),
            Err(ResolveError::Ambiguous { .. })
        ));
    }

    #[test]
    fn missing_things_are_named() {
        let t = tempfile::tempdir().unwrap();
        assert!(matches!(
            CgroupFs::detect(t.path()),
            Err(ResolveError::NoCgroupFs(_))
        ));
        let root = t.path().join("cg");
        v2(&root);
        mk(&root, &format!("kubepods/pod{UID}/{A}"));
        let fs_ = CgroupFs::detect(&root).unwrap();
        let other: PodUid = "ffffffff-1f2a-4c3d-9e8f-0123456789ab".parse().unwrap();
        let e = fs_.pod_dir(&other, None).unwrap_err();
        assert!(e.to_string().contains("ffffffff-1f2a"), "{e}");
        // right pod, container made by another runtime
        assert!(matches!(
            fs_.container(&UID.parse().unwrap(), None, &cid("cri-o")),
            Err(ResolveError::ContainerNotFound { .. })
        ));
    }

    #[test]
    fn pids_cover_the_subtree() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("c");
        fs::create_dir_all(dir.join("container/deeper")).unwrap();
        fs::write(dir.join("cgroup.procs"), "10\n").unwrap();
        fs::write(dir.join("container/cgroup.procs"), "12\n11\n").unwrap();
        fs::write(dir.join("container/deeper/cgroup.procs"), "11\n13\n").unwrap();
        let c = ContainerCgroup {
            container: cid("cri-o"),
            dir,
        };
        assert_eq!(c.pids().unwrap(), vec![10, 11, 12, 13]);
    }
}
