//! Who a process is, in Kubernetes terms: the pod UID and container ID its cgroup names.
//!
//! # Design
//! The kubelet and the container runtime name cgroups after the pod UID and the container ID, in
//! one of a few fixed ways (cgroup driver x runtime):
//!
//! | driver | runtime | pod | container |
//! | --- | --- | --- | --- |
//! | systemd | containerd | `kubepods-burstable-pod<uid_>.slice` | `cri-containerd-<id>.scope` |
//! | systemd | CRI-O | same | `crio-<id>.scope` (crun adds a `container` child on v2) |
//! | cgroupfs | containerd | `pod<uid>` | `<id>` |
//! | cgroupfs | CRI-O | same | `crio-<id>` |
//!
//! (systemd slices write the UID with `_` for `-`; Guaranteed pods have no QoS level.)
//! The identity of a process is read from its cgroup path: the one pod component, and the
//! component *directly below it* as the container. Anything deeper (crun's `container`, a cgroup
//! the container made for itself) is ignored, so a container cannot claim to be another by
//! creating a sub-cgroup named after it; a path naming two pods is refused.
//!
//! # Limitations
//! A process in conmon's cgroup (`crio-conmon-<id>`) or the pod's own cgroup is no container's.

use std::fmt;
use std::str::FromStr;

/// A pod's UID, canonical form (`0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab`, lower case).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PodUid(String);

/// A string that is not a pod UID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a pod UID")]
pub struct BadPodUid(pub String);

impl FromStr for PodUid {
    type Err = BadPodUid;
    fn from_str(s: &str) -> Result<Self, BadPodUid> {
        let lens: Vec<usize> = s.split('-').map(str::len).collect();
        if lens != [8, 4, 4, 4, 12] || !s.bytes().all(|b| b == b'-' || b.is_ascii_hexdigit()) {
            return Err(BadPodUid(s.to_owned()));
        }
        Ok(PodUid(s.to_ascii_lowercase()))
    }
}

impl PodUid {
    /// The canonical text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// As the systemd cgroup driver writes it in slice names (`-` is systemd's separator).
    pub fn systemd_escaped(&self) -> String {
        self.0.replace('-', "_")
    }
}

impl fmt::Display for PodUid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The container runtime that made a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Runtime {
    /// containerd (`containerd://` in the Pod's status).
    Containerd,
    /// CRI-O (`cri-o://`).
    CriO,
    /// Docker through cri-dockerd (`docker://`).
    Docker,
}

impl Runtime {
    /// The scheme the Pod's status uses (`containerd`, `cri-o`, `docker`).
    pub fn scheme(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::CriO => "cri-o",
            Runtime::Docker => "docker",
        }
    }
}

/// A container, as the Pod's status names it (`containerStatuses[].containerID`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ContainerId {
    /// Who made it.
    pub runtime: Runtime,
    /// The runtime's ID: 64 lower-case hex digits.
    pub id: String,
}

/// A string that is not a container ID as the Pod's status writes it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{0:?} is not a container ID (expected containerd://, cri-o:// or docker:// and 64 hex digits)"
)]
pub struct BadContainerId(pub String);

impl FromStr for ContainerId {
    type Err = BadContainerId;
    fn from_str(s: &str) -> Result<Self, BadContainerId> {
        let bad = || BadContainerId(s.to_owned());
        let (scheme, id) = s.split_once("://").ok_or_else(bad)?;
        let runtime = match scheme {
            "containerd" => Runtime::Containerd,
            "cri-o" => Runtime::CriO,
            "docker" => Runtime::Docker,
            _ => return Err(bad()),
        };
        if !is_container_hex(id) {
            return Err(bad());
        }
        Ok(ContainerId {
            runtime,
            id: id.to_owned(),
        })
    }
}

impl fmt::Display for ContainerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}://{}", self.runtime.scheme(), self.id)
    }
}

fn is_container_hex(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

/// What a cgroup path says about the process in it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CgroupIdentity {
    /// The pod.
    pub pod: PodUid,
    /// The container's ID (64 hex digits), and the runtime where the name tells it (a bare ID,
    /// cgroupfs with containerd or Docker, does not).
    pub container: String,
    /// The runtime, when the cgroup's name says it.
    pub runtime: Option<Runtime>,
}

impl CgroupIdentity {
    /// Whether this is the container the Pod's status names `id`.
    pub fn is(&self, id: &ContainerId) -> bool {
        self.container == id.id && self.runtime.is_none_or(|r| r == id.runtime)
    }
}

/// A cgroup path that does not name exactly one container of one pod.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdentityError {
    /// No pod is named in the path: not a Kubernetes container.
    #[error("cgroup {0} is not a pod's")]
    NotInAPod(String),
    /// The pod is named but no container directly below it (the pod's own cgroup, conmon's...).
    #[error("cgroup {0} belongs to a pod but to none of its containers")]
    NotAContainer(String),
    /// More than one pod component: refused rather than guessed.
    #[error("cgroup {0} names more than one pod")]
    Ambiguous(String),
    /// The process's hierarchies (cgroup v1) do not agree on who it is.
    #[error("the cgroups of the process disagree: {0} and {1}")]
    Inconsistent(String, String),
}

/// The pod UID a cgroup directory name stands for: `pod<uid>` (cgroupfs) or `...-pod<uid_>.slice`
/// (systemd).
pub fn pod_component(name: &str) -> Option<PodUid> {
    if let Some(uid) = name.strip_prefix("pod") {
        if let Ok(u) = uid.parse() {
            return Some(u);
        }
    }
    let stem = name.strip_suffix(".slice")?;
    let idx = stem.rfind("pod")?;
    let before = &stem[..idx];
    if !(before.is_empty() || before.ends_with('-')) {
        return None;
    }
    stem[idx + 3..].replace('_', "-").parse().ok()
}

/// The container a cgroup directory name stands for (`cri-containerd-<id>.scope`, `crio-<id>`...).
pub fn container_component(name: &str) -> Option<(String, Option<Runtime>)> {
    let scope = name.strip_suffix(".scope");
    let (id, runtime) = match scope {
        Some(s) => {
            if let Some(id) = s.strip_prefix("cri-containerd-") {
                (id, Some(Runtime::Containerd))
            } else if let Some(id) = s.strip_prefix("crio-") {
                (id, Some(Runtime::CriO))
            } else if let Some(id) = s.strip_prefix("docker-") {
                (id, Some(Runtime::Docker))
            } else {
                return None;
            }
        }
        None => match name.strip_prefix("crio-") {
            Some(id) => (id, Some(Runtime::CriO)),
            None => (name, None),
        },
    };
    is_container_hex(id).then(|| (id.to_owned(), runtime))
}

/// Who the process in the cgroup `path` is (a path as `/proc/PID/cgroup` shows it; `..`
/// components, seen from inside another cgroup namespace, are skipped).
pub fn identity_from_path(path: &str) -> Result<CgroupIdentity, IdentityError> {
    let parts: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != "..")
        .collect();
    let pods: Vec<(usize, PodUid)> = parts
        .iter()
        .enumerate()
        .filter_map(|(i, c)| pod_component(c).map(|u| (i, u)))
        .collect();
    let (i, pod) = match pods.as_slice() {
        [] => return Err(IdentityError::NotInAPod(path.to_owned())),
        [one] => one.clone(),
        _ => return Err(IdentityError::Ambiguous(path.to_owned())),
    };
    let (container, runtime) = parts
        .get(i + 1)
        .and_then(|c| container_component(c))
        .ok_or_else(|| IdentityError::NotAContainer(path.to_owned()))?;
    Ok(CgroupIdentity {
        pod,
        container,
        runtime,
    })
}

/// Who a process is, from all its cgroup lines (`/proc/PID/cgroup`): the hierarchies that name a
/// pod must all name the same container (on cgroup v1 a process is in one cgroup per hierarchy,
/// and some, the v2 line of a hybrid host with the cgroupfs driver, name none).
pub fn identity_from_cgroups<'a>(
    paths: impl IntoIterator<Item = &'a str>,
) -> Result<CgroupIdentity, IdentityError> {
    let mut found: Option<(CgroupIdentity, &str)> = None;
    let mut first_err = None;
    for path in paths {
        match identity_from_path(path) {
            Ok(id) => match &found {
                Some((prev, prev_path)) if *prev != id => {
                    return Err(IdentityError::Inconsistent(
                        (*prev_path).to_owned(),
                        path.to_owned(),
                    ))
                }
                Some(_) => {}
                None => found = Some((id, path)),
            },
            // A pod named wrongly is refused even if another hierarchy looks fine.
            Err(e @ (IdentityError::Ambiguous(_) | IdentityError::NotAContainer(_))) => {
                return Err(e)
            }
            Err(e) => {
                first_err.get_or_insert(e);
            }
        }
    }
    match (found, first_err) {
        (Some((id, _)), _) => Ok(id),
        (None, Some(e)) => Err(e),
        (None, None) => Err(IdentityError::NotInAPod(String::new())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";
    const UID_: &str = "0b8e4f4c_1f2a_4c3d_9e8f_0123456789ab";
    const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";
    const B: &str = "b1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    fn id(c: &str, r: Option<Runtime>) -> CgroupIdentity {
        CgroupIdentity {
            pod: UID.parse().unwrap(),
            container: c.to_owned(),
            runtime: r,
        }
    }

    #[test]
    fn every_driver_and_runtime_layout_is_read() {
        let cases = [
            (
                format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice/cri-containerd-{A}.scope"),
                Some(Runtime::Containerd),
            ),
            (
                format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{A}.scope/container"),
                Some(Runtime::CriO),
            ),
            (
                format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/docker-{A}.scope"),
                Some(Runtime::Docker),
            ),
            (format!("/kubepods/burstable/pod{UID}/{A}"), None),
            (format!("/kubepods/pod{UID}/crio-{A}"), Some(Runtime::CriO)),
            // seen from inside another cgroup namespace
            (format!("/../../kubepods/besteffort/pod{UID}/{A}"), None),
            // kubelet with --cgroup-root (kind and other nested setups)
            (
                format!("/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{UID_}.slice/cri-containerd-{A}.scope"),
                Some(Runtime::Containerd),
            ),
        ];
        for (path, runtime) in cases {
            assert_eq!(identity_from_path(&path), Ok(id(A, runtime)), "{path}");
        }
    }

    #[test]
    fn not_a_container() {
        assert!(matches!(
            identity_from_path("/"),
            Err(IdentityError::NotInAPod(_))
        ));
        assert!(matches!(
            identity_from_path("/system.slice/containerd.service"),
            Err(IdentityError::NotInAPod(_))
        ));
        for p in [
            format!("/kubepods/pod{UID}"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{A}.scope"),
            format!("/kubepods/pod{UID}/crio-conmon-{A}"),
            format!("/kubepods/pod{UID}/{}", &A[..63]),
            format!("/kubepods/pod{UID}/{}", A.to_uppercase()),
        ] {
            assert!(
                matches!(identity_from_path(&p), Err(IdentityError::NotAContainer(_))),
                "{p}"
            );
        }
        // look-alikes of a pod component
        assert!(pod_component(&format!("xpod{UID_}.slice")).is_none());
        assert!(pod_component(&format!("pod{UID}x")).is_none());
    }

    #[test]
    fn a_container_cannot_claim_another_by_making_a_sub_cgroup() {
        // the attacker in A names a cgroup of its own after B: the container is still A
        let p = format!("/kubepods/pod{UID}/{A}/{B}");
        assert_eq!(identity_from_path(&p), Ok(id(A, None)));
        let p = format!(
            "/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{A}.scope/cri-containerd-{B}.scope"
        );
        assert_eq!(identity_from_path(&p), Ok(id(A, Some(Runtime::Containerd))));
        // ... or after another pod and its container: refused outright
        let other = "ffffffff-1f2a-4c3d-9e8f-0123456789ab";
        let p = format!("/kubepods/pod{UID}/{A}/pod{other}/{B}");
        assert!(matches!(
            identity_from_path(&p),
            Err(IdentityError::Ambiguous(_))
        ));
    }

    #[test]
    fn v1_hierarchies_must_agree() {
        let a = format!("/kubepods/burstable/pod{UID}/{A}");
        let b = format!("/kubepods/burstable/pod{UID}/{B}");
        assert_eq!(
            identity_from_cgroups(["/", a.as_str(), a.as_str()]),
            Ok(id(A, None))
        );
        assert!(matches!(
            identity_from_cgroups([a.as_str(), b.as_str()]),
            Err(IdentityError::Inconsistent(..))
        ));
        let pod_only = format!("/kubepods/burstable/pod{UID}");
        assert!(matches!(
            identity_from_cgroups([a.as_str(), pod_only.as_str()]),
            Err(IdentityError::NotAContainer(_))
        ));
        assert!(matches!(
            identity_from_cgroups(["/", "/user.slice"]),
            Err(IdentityError::NotInAPod(_))
        ));
    }

    #[test]
    fn container_ids_from_pod_status() {
        let c: ContainerId = format!("containerd://{A}").parse().unwrap();
        assert_eq!(c.runtime, Runtime::Containerd);
        assert_eq!(c.to_string(), format!("containerd://{A}"));
        let c: ContainerId = format!("cri-o://{A}").parse().unwrap();
        assert!(id(A, Some(Runtime::CriO)).is(&c));
        assert!(id(A, None).is(&c));
        assert!(!id(A, Some(Runtime::Containerd)).is(&c));
        assert!(!id(B, None).is(&c));
        for bad in [
            A.to_owned(),
            format!("rkt://{A}"),
            format!("containerd://{}", &A[1..]),
            String::new(),
        ] {
            assert!(bad.parse::<ContainerId>().is_err(), "{bad}");
        }
        assert_eq!(UID.to_uppercase().parse::<PodUid>().unwrap().as_str(), UID);
        assert!("not-a-uid".parse::<PodUid>().is_err());
    }
}
