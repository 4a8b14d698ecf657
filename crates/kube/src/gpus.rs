//! The GPUs a container was given, by UUID, and the map a restore needs from an image's GPUs to
//! them (NVIDIA/cuda-checkpoint#54: restores bound to a GPU *index* break under Kubernetes' device
//! assignment, where index 0 of a container is whichever GPU it was given).
//!
//! # Design
//! What a container was given is in its environment (read from `/proc/PID/environ`):
//! `NVIDIA_VISIBLE_DEVICES` as the NVIDIA container toolkit reads it: a comma list of UUIDs
//! (`GPU-...`), indices, `all`, `none` (no GPU, but the driver's files), `void` or empty (the
//! toolkit does nothing), or fully qualified CDI device names (`nvidia.com/gpu=GPU-...`,
//! `nvidia.com/gpu=0`, `nvidia.com/gpu=all`), which the toolkit's CDI mode and the device
//! plugin's CDI strategies put there. Indices (bare or in a CDI name) are kept as such so that
//! the map can refuse them: an index means a different GPU on another node, or after a reboot.
//!
//! The map keeps a GPU where it is when the container was given the same UUID again, and pairs the
//! rest in the order the image and the assignment list them. It is a bijection onto the given GPUs.
//!
//! # Limitations
//! MIG devices (`MIG-...`) are refused: the checkpoint API's behaviour on MIG instances has not been
//! measured.

use std::collections::BTreeSet;

use cryo_gpu::{GpuPair, GpuUuid};

/// The environment variable the NVIDIA container toolkit reads.
pub const NVIDIA_VISIBLE_DEVICES: &str = "NVIDIA_VISIBLE_DEVICES";

/// The GPUs a container was given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Assigned {
    /// No assignment through the toolkit (variable unset, empty or `void`).
    Unset,
    /// `none`: the driver's files but no GPU.
    NoGpu,
    /// Every GPU of the node.
    All,
    /// These GPUs, in the order given.
    Uuids(Vec<GpuUuid>),
    /// Some devices were named by index (the list as given).
    ByIndex(Vec<String>),
}

/// A device list the toolkit would not accept either.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AssignError {
    /// An entry that is none of UUID, index, `all`, `none`, `void`, CDI name.
    #[error("{var}: {entry:?} is not a GPU UUID, an index or a CDI device name")]
    BadEntry {
        /// The variable.
        var: &'static str,
        /// The entry.
        entry: String,
    },
    /// A MIG device.
    #[error("{var}: {entry:?} is a MIG device; cryo does not checkpoint MIG instances")]
    Mig {
        /// The variable.
        var: &'static str,
        /// The entry.
        entry: String,
    },
    /// `all`/`none`/`void` mixed with a list.
    #[error("{var}: {value:?} mixes {keyword:?} with other entries")]
    Mixed {
        /// The variable.
        var: &'static str,
        /// The whole value.
        value: String,
        /// The keyword.
        keyword: String,
    },
}

enum Entry {
    Uuid(GpuUuid),
    Index(String),
    Keyword(&'static str),
}

fn entry(raw: &str) -> Result<Entry, AssignError> {
    let bad = || AssignError::BadEntry {
        var: NVIDIA_VISIBLE_DEVICES,
        entry: raw.to_owned(),
    };
    // CDI: vendor/class=name; only NVIDIA's GPU class names GPUs.
    let name = match raw.split_once('=') {
        Some(("nvidia.com/gpu", name)) => name,
        Some(_) => return Err(bad()),
        None => raw,
    };
    match name {
        "all" => return Ok(Entry::Keyword("all")),
        "none" if name == raw => return Ok(Entry::Keyword("none")),
        "void" if name == raw => return Ok(Entry::Keyword("void")),
        _ => {}
    }
    if name.starts_with("MIG-") {
        return Err(AssignError::Mig {
            var: NVIDIA_VISIBLE_DEVICES,
            entry: raw.to_owned(),
        });
    }
    if name.starts_with("GPU-") {
        return name.parse().map(Entry::Uuid).map_err(|_| bad());
    }
    // `3` or a MIG index `3:1`
    if !name.is_empty()
        && name
            .split(':')
            .all(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()))
    {
        return Ok(Entry::Index(raw.to_owned()));
    }
    Err(bad())
}

/// Parses the value of `NVIDIA_VISIBLE_DEVICES` (`None`: not set).
pub fn parse_visible_devices(value: Option<&str>) -> Result<Assigned, AssignError> {
    let Some(value) = value else {
        return Ok(Assigned::Unset);
    };
    let items: Vec<&str> = value
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    if items.is_empty() {
        return Ok(Assigned::Unset);
    }
    let mut uuids = Vec::new();
    let mut indices = Vec::new();
    let mut keyword = None;
    for raw in &items {
        match entry(raw)? {
            Entry::Uuid(u) => {
                if !uuids.contains(&u) {
                    uuids.push(u);
                }
            }
            Entry::Index(i) => indices.push(i),
            Entry::Keyword(k) => keyword = Some(k),
        }
    }
    if let Some(k) = keyword {
        if items.len() > 1 {
            return Err(AssignError::Mixed {
                var: NVIDIA_VISIBLE_DEVICES,
                value: value.to_owned(),
                keyword: k.to_owned(),
            });
        }
        return Ok(match k {
            "all" => Assigned::All,
            "none" => Assigned::NoGpu,
            _ => Assigned::Unset,
        });
    }
    if !indices.is_empty() {
        return Ok(Assigned::ByIndex(
            items.iter().map(|s| (*s).to_owned()).collect(),
        ));
    }
    Ok(Assigned::Uuids(uuids))
}

/// What a container was given, from its environment (`NAME=VALUE` pairs, as
/// `cryo_proc::ProcHandle::environ` returns them; the last definition wins, as in `getenv`).
pub fn assigned_from_environ(env: &[(String, String)]) -> Result<Assigned, AssignError> {
    let value = env
        .iter()
        .rev()
        .find(|(k, _)| k == NVIDIA_VISIBLE_DEVICES)
        .map(|(_, v)| v.as_str());
    parse_visible_devices(value)
}

/// Reading what a container's process was given failed.
#[derive(Debug, thiserror::Error)]
pub enum AssignedError {
    /// Its environment could not be read.
    #[error(transparent)]
    Proc(#[from] cryo_proc::ProcError),
    /// The variable holds something the toolkit would not accept either.
    #[error(transparent)]
    Bad(#[from] AssignError),
}

/// What the process `handle` holds (a process of the container) was given, from its environment.
pub fn assigned_to(handle: &cryo_proc::ProcHandle) -> Result<Assigned, AssignedError> {
    Ok(assigned_from_environ(&handle.environ()?)?)
}

/// The restore cannot be mapped onto the container's GPUs.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuMapError {
    /// The container's GPUs were named by index.
    #[error("the container was given GPUs by index ({0}): a restore is mapped by UUID only (NVIDIA/cuda-checkpoint#54); give GPUs by UUID (NVIDIA device plugin: deviceIDStrategy=uuid)")]
    ByIndex(String),
    /// The container was given no GPU.
    #[error("the container was given no GPU (NVIDIA_VISIBLE_DEVICES unset, empty, void or none)")]
    NoGpu,
    /// Fewer GPUs than the image used.
    #[error(
        "the image used {needed} GPUs ({image}), the container was given {given} ({assigned})"
    )]
    TooFew {
        /// GPUs of the image.
        needed: usize,
        /// GPUs given.
        given: usize,
        /// The image's UUIDs.
        image: String,
        /// The given UUIDs.
        assigned: String,
    },
    /// `all`, but the node's GPU list is empty.
    #[error("the container was given all GPUs, but the node lists none")]
    NodeHasNone,
}

fn list(u: &[GpuUuid]) -> String {
    u.iter().map(GpuUuid::as_str).collect::<Vec<_>>().join(", ")
}

/// The pairs `image GPU -> GPU to restore onto` for a container given `assigned` on a node whose
/// GPUs are `node_gpus` (NVML's list, used only for `all`). Every image GPU gets a distinct target;
/// a GPU given again keeps its place. The result lists the image's GPUs in the image's order.
pub fn gpu_map(
    image: &[GpuUuid],
    assigned: &Assigned,
    node_gpus: &[GpuUuid],
) -> Result<Vec<GpuPair>, GpuMapError> {
    let given: Vec<GpuUuid> = match assigned {
        Assigned::ByIndex(i) => return Err(GpuMapError::ByIndex(i.join(","))),
        Assigned::Unset | Assigned::NoGpu => return Err(GpuMapError::NoGpu),
        Assigned::All if node_gpus.is_empty() => return Err(GpuMapError::NodeHasNone),
        Assigned::All => dedup(node_gpus),
        Assigned::Uuids(u) => dedup(u),
    };
    let image = dedup(image);
    if image.len() > given.len() {
        return Err(GpuMapError::TooFew {
            needed: image.len(),
            given: given.len(),
            image: list(&image),
            assigned: list(&given),
        });
    }
    let given_set: BTreeSet<&GpuUuid> = given.iter().collect();
    let kept: BTreeSet<&GpuUuid> = image.iter().filter(|u| given_set.contains(u)).collect();
    let mut free = given.iter().filter(|u| !kept.contains(u));
    let mut out = Vec::with_capacity(image.len());
    for old in &image {
        let new = if kept.contains(old) {
            old.clone()
        } else {
            // len checked above: there are as many free GPUs as image GPUs not kept
            match free.next() {
                Some(n) => n.clone(),
                None => {
                    return Err(GpuMapError::TooFew {
                        needed: image.len(),
                        given: given.len(),
                        image: list(&image),
                        assigned: list(&given),
                    })
                }
            }
        };
        out.push(GpuPair {
            old: old.clone(),
            new,
        });
    }
    Ok(out)
}

fn dedup(u: &[GpuUuid]) -> Vec<GpuUuid> {
    let mut seen = BTreeSet::new();
    u.iter()
        .filter(|x| seen.insert((*x).clone()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(n: u8) -> GpuUuid {
        format!("GPU-{n:08x}-0000-0000-0000-000000000000")
            .parse()
            .unwrap()
    }

    fn pairs(p: &[GpuPair]) -> Vec<(GpuUuid, GpuUuid)> {
        p.iter().map(|p| (p.old.clone(), p.new.clone())).collect()
    }

    #[test]
    fn visible_devices_forms() {
        let (a, b) = (g(1), g(2));
        assert_eq!(parse_visible_devices(None), Ok(Assigned::Unset));
        assert_eq!(parse_visible_devices(Some("")), Ok(Assigned::Unset));
        assert_eq!(parse_visible_devices(Some("void")), Ok(Assigned::Unset));
        assert_eq!(parse_visible_devices(Some("none")), Ok(Assigned::NoGpu));
        assert_eq!(parse_visible_devices(Some("all")), Ok(Assigned::All));
        assert_eq!(
            parse_visible_devices(Some("nvidia.com/gpu=all")),
            Ok(Assigned::All)
        );
        assert_eq!(
            parse_visible_devices(Some(&format!("{b},{a}"))),
            Ok(Assigned::Uuids(vec![b.clone(), a.clone()]))
        );
        // CDI names, upper-case hex, spaces, a repeat
        let upper = "GPU-0123ABCD-4567-89AB-CDEF-0123456789AB";
        let lower: GpuUuid = "GPU-0123abcd-4567-89ab-cdef-0123456789ab".parse().unwrap();
        let v = format!("nvidia.com/gpu={upper}, {b},{lower}");
        assert_eq!(
            parse_visible_devices(Some(&v)),
            Ok(Assigned::Uuids(vec![lower, b.clone()]))
        );
        assert_eq!(
            parse_visible_devices(Some("0,1")),
            Ok(Assigned::ByIndex(vec!["0".into(), "1".into()]))
        );
        assert_eq!(
            parse_visible_devices(Some(&format!("{a},nvidia.com/gpu=1"))),
            Ok(Assigned::ByIndex(vec![
                a.to_string(),
                "nvidia.com/gpu=1".into()
            ]))
        );
        assert!(matches!(
            parse_visible_devices(Some("0:1")),
            Ok(Assigned::ByIndex(_))
        ));
    }

    #[test]
    fn visible_devices_refusals() {
        for bad in [
            "GPU-123",
            "gpu0",
            "nvidia.com/gpu=GPU-xyz",
            "example.com/fpga=0",
            "1,,x",
            "nvidia.com/gpu=none",
        ] {
            assert!(
                matches!(
                    parse_visible_devices(Some(bad)),
                    Err(AssignError::BadEntry { .. })
                ),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_visible_devices(Some("MIG-0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab")),
            Err(AssignError::Mig { .. })
        ));
        assert!(matches!(
            parse_visible_devices(Some(&format!("all,{}", g(1)))),
            Err(AssignError::Mixed { .. })
        ));
    }

    #[test]
    fn environ_last_definition_wins() {
        let env = vec![
            ("PATH".to_owned(), "/bin".to_owned()),
            (NVIDIA_VISIBLE_DEVICES.to_owned(), "0".to_owned()),
            (NVIDIA_VISIBLE_DEVICES.to_owned(), g(3).to_string()),
        ];
        assert_eq!(assigned_from_environ(&env), Ok(Assigned::Uuids(vec![g(3)])));
        assert_eq!(assigned_from_environ(&[]), Ok(Assigned::Unset));
    }

    #[test]
    fn map_keeps_what_it_can_and_pairs_the_rest_in_order() {
        // same GPUs again, other order: nothing moves
        let m = gpu_map(&[g(1), g(2)], &Assigned::Uuids(vec![g(2), g(1)]), &[]).unwrap();
        assert_eq!(pairs(&m), vec![(g(1), g(1)), (g(2), g(2))]);
        // one kept, one moved
        let m = gpu_map(&[g(1), g(2)], &Assigned::Uuids(vec![g(7), g(1)]), &[]).unwrap();
        assert_eq!(pairs(&m), vec![(g(1), g(1)), (g(2), g(7))]);
        // other node entirely
        let m = gpu_map(&[g(1), g(2)], &Assigned::Uuids(vec![g(8), g(9)]), &[]).unwrap();
        assert_eq!(pairs(&m), vec![(g(1), g(8)), (g(2), g(9))]);
        // more given than needed: the first free ones
        let m = gpu_map(&[g(1)], &Assigned::Uuids(vec![g(8), g(9)]), &[]).unwrap();
        assert_eq!(pairs(&m), vec![(g(1), g(8))]);
        // all: the node's list
        let m = gpu_map(&[g(1), g(5)], &Assigned::All, &[g(4), g(5), g(6)]).unwrap();
        assert_eq!(pairs(&m), vec![(g(1), g(4)), (g(5), g(5))]);
    }

    #[test]
    fn map_is_a_bijection_even_with_repeats() {
        let m = gpu_map(
            &[g(1), g(1), g(2)],
            &Assigned::Uuids(vec![g(3), g(3), g(4)]),
            &[],
        )
        .unwrap();
        let news: BTreeSet<_> = m.iter().map(|p| p.new.clone()).collect();
        assert_eq!(m.len(), 2);
        assert_eq!(news.len(), 2);
    }

    #[test]
    fn map_refusals() {
        assert!(matches!(
            gpu_map(&[g(1)], &Assigned::ByIndex(vec!["0".into()]), &[g(1)]),
            Err(GpuMapError::ByIndex(_))
        ));
        assert_eq!(
            gpu_map(&[g(1)], &Assigned::NoGpu, &[g(1)]),
            Err(GpuMapError::NoGpu)
        );
        assert_eq!(
            gpu_map(&[g(1)], &Assigned::Unset, &[g(1)]),
            Err(GpuMapError::NoGpu)
        );
        assert_eq!(
            gpu_map(&[g(1)], &Assigned::All, &[]),
            Err(GpuMapError::NodeHasNone)
        );
        let e = gpu_map(&[g(1), g(2)], &Assigned::Uuids(vec![g(1)]), &[]).unwrap_err();
        assert!(
            matches!(
                e,
                GpuMapError::TooFew {
                    needed: 2,
                    given: 1,
                    ..
                }
            ),
            "{e}"
        );
    }
}
