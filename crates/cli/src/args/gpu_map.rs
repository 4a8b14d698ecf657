//! `--gpu-map OLD=NEW,...` (cryo) and `--device-map OLD=NEW,...` (cuda-checkpoint syntax).
//!
//! # Design
//! Parsed in full before anything touches the system: each side is a GPU UUID
//! (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, case-insensitive) or, for `--gpu-map` only, an index
//! as `cryo gpu ls` prints it. Indices are resolved later against this host's GPUs
//! ([`GpuMap::resolve`]); an OLD UUID is taken as given (it names a GPU of the host the process
//! was checkpointed on), a NEW one must exist here. A GPU may appear at most once on each side.

use std::collections::HashSet;
use std::fmt;
use std::str::FromStr;

use cryo_gpu::{GpuInfo, GpuPair, GpuUuid};

/// One side of a pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum GpuRef {
    /// A GPU UUID.
    Uuid(GpuUuid),
    /// An index of `cryo gpu ls` on this host.
    Index(u32),
}

impl fmt::Display for GpuRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRef::Uuid(u) => write!(f, "{u}"),
            GpuRef::Index(i) => write!(f, "{i}"),
        }
    }
}

/// A parsed `--gpu-map`: OLD=NEW pairs in the order given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GpuMap(pub Vec<(GpuRef, GpuRef)>);

/// A malformed map.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GpuMapError {
    /// Nothing between two commas, or an empty map.
    #[error("empty entry in GPU map {0:?} (expected OLD=NEW[,OLD=NEW...])")]
    Empty(String),
    /// An entry without `=`.
    #[error("{0:?} is not an OLD=NEW pair")]
    NotAPair(String),
    /// A side that is neither a UUID nor an index.
    #[error(
        "{0:?} is neither a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx) nor a GPU index"
    )]
    BadGpu(String),
    /// An index where only UUIDs are accepted.
    #[error("{0:?} is not a GPU UUID (GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx); --device-map takes UUIDs only")]
    UuidOnly(String),
    /// A GPU twice on the same side.
    #[error("GPU {0} appears twice on the {1} side of the map")]
    Duplicate(String, &'static str),
    /// An index this host does not have.
    #[error("no GPU with index {index} on this host ({count} GPUs: see `cryo gpu ls`)")]
    NoSuchIndex {
        /// The index given.
        index: u32,
        /// How many GPUs there are.
        count: usize,
    },
    /// A target UUID this host does not have.
    #[error("no GPU {0} on this host (see `cryo gpu ls`)")]
    NoSuchGpu(GpuUuid),
}

impl GpuMap {
    /// Parses `OLD=NEW,...`; `indices` allows GPU indices besides UUIDs.
    pub fn parse(s: &str, indices: bool) -> Result<Self, GpuMapError> {
        let mut pairs = Vec::new();
        for entry in s.split(',') {
            if entry.is_empty() {
                return Err(GpuMapError::Empty(s.to_string()));
            }
            let (old, new) = entry
                .split_once('=')
                .ok_or_else(|| GpuMapError::NotAPair(entry.to_string()))?;
            pairs.push((parse_side(old, indices)?, parse_side(new, indices)?));
        }
        check_unique(pairs.iter().map(|(o, _)| o.to_string()), "OLD")?;
        check_unique(pairs.iter().map(|(_, n)| n.to_string()), "NEW")?;
        Ok(GpuMap(pairs))
    }

    /// The pairs as the driver takes them, indices resolved against `gpus` (this host's GPUs).
    pub fn resolve(&self, gpus: &[GpuInfo]) -> Result<Vec<GpuPair>, GpuMapError> {
        let lookup = |r: &GpuRef| -> Result<GpuUuid, GpuMapError> {
            match r {
                GpuRef::Uuid(u) => Ok(u.clone()),
                GpuRef::Index(i) => gpus
                    .iter()
                    .find(|g| g.index == *i)
                    .map(|g| g.uuid.clone())
                    .ok_or(GpuMapError::NoSuchIndex {
                        index: *i,
                        count: gpus.len(),
                    }),
            }
        };
        let mut out = Vec::with_capacity(self.0.len());
        for (old, new) in &self.0 {
            let new = lookup(new)?;
            if !gpus.iter().any(|g| g.uuid == new) {
                return Err(GpuMapError::NoSuchGpu(new));
            }
            out.push(GpuPair {
                old: lookup(old)?,
                new,
            });
        }
        // `0=GPU-b` and `GPU-a=...` may name the same GPU twice once resolved.
        check_unique(out.iter().map(|p| p.old.to_string()), "OLD")?;
        check_unique(out.iter().map(|p| p.new.to_string()), "NEW")?;
        Ok(out)
    }

    /// The pairs when every side is a UUID (always so for a map parsed without indices).
    pub fn uuid_pairs(&self) -> Option<Vec<GpuPair>> {
        self.0
            .iter()
            .map(|(o, n)| match (o, n) {
                (GpuRef::Uuid(o), GpuRef::Uuid(n)) => Some(GpuPair {
                    old: o.clone(),
                    new: n.clone(),
                }),
                _ => None,
            })
            .collect()
    }
}

impl FromStr for GpuMap {
    type Err = GpuMapError;
    fn from_str(s: &str) -> Result<Self, GpuMapError> {
        GpuMap::parse(s, true)
    }
}

fn parse_side(s: &str, indices: bool) -> Result<GpuRef, GpuMapError> {
    if !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()) {
        if !indices {
            return Err(GpuMapError::UuidOnly(s.to_string()));
        }
        return s
            .parse()
            .map(GpuRef::Index)
            .map_err(|_| GpuMapError::BadGpu(s.to_string()));
    }
    match s.parse::<GpuUuid>() {
        Ok(u) => Ok(GpuRef::Uuid(u)),
        Err(_) if indices => Err(GpuMapError::BadGpu(s.to_string())),
        Err(_) => Err(GpuMapError::UuidOnly(s.to_string())),
    }
}

fn check_unique(
    items: impl Iterator<Item = String>,
    side: &'static str,
) -> Result<(), GpuMapError> {
    let mut seen = HashSet::new();
    for it in items {
        if !seen.insert(it.clone()) {
            return Err(GpuMapError::Duplicate(it, side));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const A: &str = "GPU-aaaaaaaa-0000-0000-0000-000000000000";
    const B: &str = "GPU-bbbbbbbb-0000-0000-0000-000000000000";

    fn gpus() -> Vec<GpuInfo> {
        [A, B]
            .iter()
            .enumerate()
            .map(|(i, u)| GpuInfo {
                index: i as u32,
                uuid: u.parse().unwrap(),
                name: "x".into(),
                memory_total: 1,
                memory_free: 1,
            })
            .collect()
    }

    #[test]
    fn parses_uuid_pairs() {
        let m: GpuMap = format!("{A}={B},{B}={A}").parse().unwrap();
        let pairs = m.uuid_pairs().unwrap();
        assert_eq!(pairs[0].old.as_str(), A);
        assert_eq!(pairs[0].new.as_str(), B);
        assert_eq!(m.resolve(&gpus()).unwrap(), pairs);
    }

    #[test]
    fn uuids_are_case_insensitive() {
        let m = GpuMap::parse(&format!("{}={B}", A.to_uppercase()), false).unwrap();
        assert_eq!(m.uuid_pairs().unwrap()[0].old.as_str(), A);
    }

    #[test]
    fn indices_resolve_through_gpu_ls() {
        let m: GpuMap = "0=1".parse().unwrap();
        assert_eq!(m.uuid_pairs(), None);
        let pairs = m.resolve(&gpus()).unwrap();
        assert_eq!((pairs[0].old.as_str(), pairs[0].new.as_str()), (A, B));
        let m: GpuMap = "0=7".parse().unwrap();
        assert_eq!(
            m.resolve(&gpus()),
            Err(GpuMapError::NoSuchIndex { index: 7, count: 2 })
        );
    }

    #[test]
    fn new_side_must_exist_here() {
        let c = "GPU-cccccccc-0000-0000-0000-000000000000";
        let m: GpuMap = format!("{A}={c}").parse().unwrap();
        assert!(matches!(m.resolve(&gpus()), Err(GpuMapError::NoSuchGpu(_))));
        // The old side names the checkpointing host's GPU and is taken as given.
        let m: GpuMap = format!("{c}={A}").parse().unwrap();
        assert_eq!(m.resolve(&gpus()).unwrap()[0].old.as_str(), c);
    }

    #[test]
    fn malformed_maps_are_refused() {
        for bad in [
            "", ",", "0", "0=", "=1", "0=1,", "0=1,,1=0", "GPU-1=0", "x=y", "0=1=2", "0=1,0=0",
            "0=1,1=1", "-1=0",
        ] {
            assert!(bad.parse::<GpuMap>().is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            GpuMap::parse("0=1", false),
            Err(GpuMapError::UuidOnly("0".into()))
        );
    }

    #[test]
    fn resolved_duplicates_are_refused() {
        let m: GpuMap = format!("0={B},{A}={A}").parse().unwrap();
        assert!(matches!(
            m.resolve(&gpus()),
            Err(GpuMapError::Duplicate(_, "OLD"))
        ));
    }
}
