//! Plain data shared by every backend.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use cryo_proc::Pid;

/// `CUprocessState`, as `cuCheckpointProcessGetState` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ProcessState {
    /// `CU_PROCESS_STATE_RUNNING` (0): CUDA calls run normally.
    Running,
    /// `CU_PROCESS_STATE_LOCKED` (1): CUDA calls are blocked, no work in flight.
    Locked,
    /// `CU_PROCESS_STATE_CHECKPOINTED` (2): device memory lives in host memory, no GPU resources.
    Checkpointed,
    /// `CU_PROCESS_STATE_FAILED` (3): the driver gave up on the process.
    Failed,
}

impl ProcessState {
    /// The driver's numeric value.
    pub fn as_raw(self) -> u32 {
        match self {
            ProcessState::Running => 0,
            ProcessState::Locked => 1,
            ProcessState::Checkpointed => 2,
            ProcessState::Failed => 3,
        }
    }

    /// From the driver's numeric value; newer drivers add states this build does not know.
    pub fn from_raw(raw: u32) -> Option<Self> {
        Some(match raw {
            0 => ProcessState::Running,
            1 => ProcessState::Locked,
            2 => ProcessState::Checkpointed,
            3 => ProcessState::Failed,
            _ => return None,
        })
    }

    /// The word `cuda-checkpoint --get-state` prints.
    pub fn as_str(self) -> &'static str {
        match self {
            ProcessState::Running => "running",
            ProcessState::Locked => "locked",
            ProcessState::Checkpointed => "checkpointed",
            ProcessState::Failed => "failed",
        }
    }
}

impl fmt::Display for ProcessState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A GPU's UUID as NVML and `cuDeviceGetUuid` print it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct GpuUuid(String);

/// A string that is not a GPU UUID.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a GPU UUID (expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx)")]
pub struct BadUuid(pub String);

impl GpuUuid {
    /// The 16 raw bytes (the driver's `CUuuid`).
    pub fn bytes(&self) -> [u8; 16] {
        let hex: Vec<u8> = self.0[4..].bytes().filter(|b| *b != b'-').collect();
        let mut out = [0u8; 16];
        for (i, pair) in hex.chunks(2).enumerate().take(16) {
            // Validated at construction: 32 hex digits.
            let hi = (pair[0] as char).to_digit(16).unwrap_or(0) as u8;
            let lo = (pair[1] as char).to_digit(16).unwrap_or(0) as u8;
            out[i] = (hi << 4) | lo;
        }
        out
    }

    /// From the driver's 16 raw bytes.
    pub fn from_bytes(b: [u8; 16]) -> Self {
        let h: String = b.iter().map(|x| format!("{x:02x}")).collect();
        GpuUuid(format!(
            "GPU-{}-{}-{}-{}-{}",
            &h[0..8],
            &h[8..12],
            &h[12..16],
            &h[16..20],
            &h[20..32]
        ))
    }

    /// The canonical text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl FromStr for GpuUuid {
    type Err = BadUuid;
    fn from_str(s: &str) -> Result<Self, BadUuid> {
        let bad = || BadUuid(s.to_string());
        let rest = s.strip_prefix("GPU-").ok_or_else(bad)?;
        let groups: Vec<&str> = rest.split('-').collect();
        let lens: Vec<usize> = groups.iter().map(|g| g.len()).collect();
        if lens != [8, 4, 4, 4, 12]
            || !groups
                .iter()
                .all(|g| g.bytes().all(|b| b.is_ascii_hexdigit()))
        {
            return Err(bad());
        }
        Ok(GpuUuid(format!("GPU-{}", rest.to_ascii_lowercase())))
    }
}

impl TryFrom<String> for GpuUuid {
    type Error = BadUuid;
    fn try_from(s: String) -> Result<Self, BadUuid> {
        s.parse()
    }
}

impl From<GpuUuid> for String {
    fn from(u: GpuUuid) -> String {
        u.0
    }
}

impl fmt::Display for GpuUuid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A restore onto another GPU: the context that ran on `old` lands on `new`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuPair {
    /// The GPU the process was checkpointed on.
    pub old: GpuUuid,
    /// The GPU to restore it onto.
    pub new: GpuUuid,
}

/// One GPU as NVML describes it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuInfo {
    /// NVML index.
    pub index: u32,
    /// UUID.
    pub uuid: GpuUuid,
    /// Product name (`NVIDIA H200`).
    pub name: String,
    /// Total device memory, bytes.
    pub memory_total: u64,
    /// Free device memory, bytes.
    pub memory_free: u64,
}

/// One process's device memory on one GPU, as `nvmlDeviceGetComputeRunningProcesses` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuProcess {
    /// Host pid.
    pub pid: Pid,
    /// NVML index of the GPU.
    pub gpu_index: u32,
    /// UUID of the GPU.
    pub gpu_uuid: GpuUuid,
    /// Device memory used, bytes.
    pub used_memory: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_round_trips_through_bytes() {
        let u: GpuUuid = "GPU-0123abcd-4567-89ab-cdef-0123456789AB".parse().unwrap();
        assert_eq!(u.as_str(), "GPU-0123abcd-4567-89ab-cdef-0123456789ab");
        assert_eq!(GpuUuid::from_bytes(u.bytes()), u);
    }

    #[test]
    fn malformed_uuids_are_refused() {
        for s in [
            "",
            "GPU-",
            "0123abcd-4567-89ab-cdef-0123456789ab",
            "GPU-0123abcd-4567-89ab-cdef-0123456789a",
            "GPU-zz23abcd-4567-89ab-cdef-0123456789ab",
        ] {
            assert!(s.parse::<GpuUuid>().is_err(), "{s}");
        }
    }

    #[test]
    fn states_match_the_driver_numbering() {
        for (raw, s) in [
            (0, ProcessState::Running),
            (1, ProcessState::Locked),
            (2, ProcessState::Checkpointed),
            (3, ProcessState::Failed),
        ] {
            assert_eq!(ProcessState::from_raw(raw), Some(s));
            assert_eq!(s.as_raw(), raw);
        }
        assert_eq!(ProcessState::from_raw(7), None);
    }
}
