//! The fence's input: the GPUs the quarantine file holds.
//!
//! The quarantine file's own type is being retyped in `cryo-lifecycle` (typed GPU UUIDs and an
//! explicit unknown-GPU entry); until then this is the plain list the fence needs, and the agent
//! passes the file's entries through [`FencedGpu::from_quarantine`].

use std::fmt;

use cryo_gpu::GpuUuid;

/// Which GPU is fenced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GpuRef {
    /// This GPU.
    Uuid(GpuUuid),
    /// A GPU the guard could not name (it fails closed: the node is fenced all the same).
    Unknown,
}

impl fmt::Display for GpuRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuRef::Uuid(u) => write!(f, "{u}"),
            GpuRef::Unknown => f.write_str("unknown GPU"),
        }
    }
}

/// One fenced GPU and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FencedGpu {
    /// The GPU.
    pub gpu: GpuRef,
    /// Why (which process died how, what holds its context).
    pub reason: String,
}

impl FencedGpu {
    /// From the quarantine file's text fields: a GPU field that is not a UUID is an unknown GPU
    /// (fenced all the same).
    pub fn from_file_entry(gpu: &str, reason: &str) -> Self {
        FencedGpu {
            gpu: gpu.parse().map_or(GpuRef::Unknown, GpuRef::Uuid),
            reason: reason.to_owned(),
        }
    }
}

impl From<&cryo_state::fence::Quarantine> for FencedGpu {
    fn from(q: &cryo_state::fence::Quarantine) -> Self {
        FencedGpu::from_file_entry(&q.gpu, &q.reason)
    }
}

impl FencedGpu {
    /// The fence's input from the quarantine file's entries.
    pub fn from_quarantine(entries: &[cryo_state::fence::Quarantine]) -> Vec<FencedGpu> {
        entries.iter().map(FencedGpu::from).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries() {
        let f = FencedGpu::from_file_entry("GPU-0123abcd-4567-89ab-cdef-0123456789ab", "r");
        assert!(matches!(f.gpu, GpuRef::Uuid(_)));
        assert_eq!(FencedGpu::from_file_entry("", "r").gpu, GpuRef::Unknown);
        assert_eq!(
            FencedGpu::from_file_entry("?", "r").gpu.to_string(),
            "unknown GPU"
        );
    }
}
