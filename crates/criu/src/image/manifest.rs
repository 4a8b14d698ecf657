//! The manifest of an image directory: what was frozen, on what, and the checksum of every file.

use std::collections::BTreeSet;

use cryo_gpu::{GpuUuid, ProcessState};
use cryo_proc::{Pid, ProcError, ProcHandle};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::version::CriuVersion;

/// The manifest's file name inside an image directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The manifest format this build writes. 2 added [`Manifest::chunk_size`] and
/// [`FileEntry::chunks`] (SHA-256); 3 hashes with BLAKE3 ([`Manifest::digest`]), gives every
/// file chunk digests and drops the whole-file SHA-256; 4 records every process's pid in each
/// pid namespace it was in ([`ProcessEntry::nspid`]).
pub const FORMAT_VERSION: u32 = 4;
/// The oldest manifest format this build still reads (1: whole-file checksums only).
pub const OLDEST_FORMAT_VERSION: u32 = 1;
/// The chunk size [`super::Staging::publish`] uses unless told otherwise. Thaw serves an image
/// to CRIU one verified chunk at a time, so a chunk is what the streamer holds in memory per
/// chunk in flight: 4 MiB keeps that small and still hashes at full speed (a 20 GiB file has
/// 5120 digests, about 350 KB of manifest).
pub const DEFAULT_CHUNK_SIZE: u64 = 4 << 20;
/// The chunk size of format 2 (SHA-256 per 64 MiB), which [`super::rewrite_as_format`] writes.
pub const FORMAT_2_CHUNK_SIZE: u64 = 64 << 20;

/// The digest of a manifest's file and chunk checksums.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DigestAlg {
    /// SHA-256 (formats 1 and 2, where the manifest names no digest).
    Sha256,
    /// BLAKE3, 32 bytes (format 3): several times faster than SHA-256 on one core.
    Blake3,
}

/// `manifest.json`. Written last, just before the image is published; `files` lists every
/// other file of the image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// [`FORMAT_VERSION`] of the writer.
    pub format_version: u32,
    /// The cryo version that froze the image.
    pub cryo_version: String,
    /// When the image was published, RFC 3339, UTC.
    pub created: String,
    /// Root of the dumped process tree.
    pub root_pid: Pid,
    /// Every process of the tree, root first.
    pub processes: Vec<ProcessEntry>,
    /// The pids of the tree's zombies when CRIU dumped it (children that had exited and that
    /// their parents had not reaped): no process of the image, but CRIU restores each as a
    /// zombie under its pid, so a restore in this pid namespace needs those pids free too
    /// ([`Manifest::restore_pids`]). Absent when there were none (and in images from before
    /// they were recorded), so those manifests read and digest as they always did.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub zombies: Vec<Pid>,
    /// The ids of the tree's threads when CRIU dumped it, each process's main thread aside
    /// (whose id is its pid): CRIU restores every thread under its id, so a restore in this pid
    /// namespace needs those free too ([`Manifest::restore_pids`]). Absent when there were none
    /// (and in images from before they were recorded).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub threads: Vec<Pid>,
    /// The GPU model the CUDA processes ran on (NVML's product name); `None` without any.
    pub gpu_model: Option<String>,
    /// The driver version at freeze; `None` without CUDA processes.
    pub driver_version: Option<String>,
    /// The CRIU that dumped the tree.
    pub criu_version: CriuVersion,
    /// Sum of the sizes of `files`, bytes.
    pub total_bytes: u64,
    /// The digest of `files`' checksums; absent (SHA-256) before format 3.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub digest: Option<DigestAlg>,
    /// Bytes per chunk of [`FileEntry::chunks`]; `None` in format 1, which has no chunks.
    /// Absent rather than null when `None`, so a format-1 manifest re-serializes byte for byte
    /// and its self-digest still matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk_size: Option<u64>,
    /// Every file of the image but the manifest, sorted by name.
    pub files: Vec<FileEntry>,
    /// The engine's shrink the tree was frozen after, when it may have released memory: what a
    /// thaw asks the engine to take back. Absent when there was none (and in images from before
    /// it was recorded), so those manifests read and digest as they always did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrunk: Option<FrozenShrink>,
    /// SHA-256 (hex) of this manifest serialized with this field empty: catches an edit of the
    /// manifest itself that still parses.
    pub manifest_sha256: String,
}

/// One process of the dumped tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessEntry {
    /// Its pid (CRIU restores it with the same pid).
    pub pid: Pid,
    /// Its parent's pid.
    pub ppid: Pid,
    /// Its command name (`comm`).
    pub comm: String,
    /// Its command line, split at NULs.
    pub cmdline: Vec<String>,
    /// Its pid in each pid namespace it was in, ours (the host's for cryo) first, its own last
    /// (`NSpid`): what tells the processes of a tree with a pid namespace of its own apart once
    /// CRIU restores them under other host pids. Format 4 on; empty (absent) before.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub nspid: Vec<Pid>,
    /// Its CUDA state, `None` for a process without a CUDA context.
    pub gpu: Option<ProcessGpu>,
}

impl ProcessEntry {
    /// What the manifest records of `process` now: pid, ppid, comm, cmdline and namespace pids
    /// (without the GPU side: the caller adds it).
    pub fn of(process: &ProcHandle) -> Result<ProcessEntry, ProcError> {
        let stat = process.stat()?;
        Ok(ProcessEntry {
            pid: process.pid(),
            ppid: stat.ppid,
            comm: stat.comm,
            cmdline: process.cmdline()?,
            nspid: process.status()?.nspid,
            gpu: None,
        })
    }
}

/// The CUDA side of one process at freeze time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProcessGpu {
    /// Its state when dumped (CHECKPOINTED for a proper freeze).
    pub state: ProcessState,
    /// The GPUs it held device memory on, and how much, measured before the checkpoint.
    pub devices: Vec<DeviceUse>,
}

/// Device memory of one process on one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeviceUse {
    /// The GPU.
    pub uuid: GpuUuid,
    /// Bytes of device memory.
    pub memory_bytes: u64,
}

/// The engine's shrink before a freeze, as the image records it (the policy that reads it is the
/// lifecycle's: this crate only keeps it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrozenShrink {
    /// The `--shrink` spec as given (`vllm:1`, `sglang:kv_cache`, `http:REL,RES`).
    pub spec: String,
    /// The engine's address it was asked at (`--engine-url`), for vLLM and SGLang.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub engine: Option<String>,
    /// How the release ended: `shrunk`, or `unknown` (it failed and could not be undone).
    pub outcome: String,
}

/// One file of the image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    /// Its name inside the image directory (no `/`).
    pub name: String,
    /// Its size, bytes.
    pub size: u64,
    /// Its SHA-256, lower-case hex: what `sha256sum` prints (formats 1 and 2; absent in 3).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub sha256: String,
    /// The digest (lower-case hex) of each [`Manifest::chunk_size`] bytes of the file, in order
    /// (the last chunk may be shorter). Format 3: every byte is in a chunk (none for an empty
    /// file). Format 2: empty for a file of at most one chunk, whose `sha256` is its check.
    /// Lets verification hash one big file on many cores, and thaw check each chunk before
    /// CRIU reads it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub chunks: Vec<String>,
}

/// What the caller knows about a freeze; [`super::Staging::publish`] adds the rest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageMeta {
    /// See [`Manifest::root_pid`].
    pub root_pid: Pid,
    /// See [`Manifest::processes`].
    pub processes: Vec<ProcessEntry>,
    /// See [`Manifest::zombies`].
    pub zombies: Vec<Pid>,
    /// See [`Manifest::threads`].
    pub threads: Vec<Pid>,
    /// See [`Manifest::gpu_model`].
    pub gpu_model: Option<String>,
    /// See [`Manifest::driver_version`].
    pub driver_version: Option<String>,
    /// See [`Manifest::criu_version`].
    pub criu_version: CriuVersion,
    /// See [`Manifest::shrunk`].
    pub shrunk: Option<FrozenShrink>,
}

impl Manifest {
    /// Device memory of the whole tree on each GPU, bytes.
    pub fn device_memory_by_gpu(&self) -> Vec<(GpuUuid, u64)> {
        let mut out: Vec<(GpuUuid, u64)> = Vec::new();
        for d in self.cuda_processes().flat_map(|(_, g)| g.devices.iter()) {
            match out.iter_mut().find(|(u, _)| *u == d.uuid) {
                Some((_, n)) => *n += d.memory_bytes,
                None => out.push((d.uuid.clone(), d.memory_bytes)),
            }
        }
        out
    }

    /// Every GPU the tree used.
    pub fn gpu_uuids(&self) -> BTreeSet<GpuUuid> {
        self.cuda_processes()
            .flat_map(|(_, g)| g.devices.iter().map(|d| d.uuid.clone()))
            .collect()
    }

    /// The processes with a CUDA context, with their GPU side.
    pub fn cuda_processes(&self) -> impl Iterator<Item = (&ProcessEntry, &ProcessGpu)> {
        self.processes
            .iter()
            .filter_map(|p| p.gpu.as_ref().map(|g| (p, g)))
    }

    /// The digest of the file and chunk checksums.
    pub fn digest_alg(&self) -> DigestAlg {
        self.digest.unwrap_or(DigestAlg::Sha256)
    }

    /// Whether the tree's root was in a pid namespace of its own at freeze (its namespace pids,
    /// format 4 on, name more than one namespace): CRIU restores such a tree into a fresh pid
    /// namespace, under host pids of its own. `false` for older images (nothing says so).
    pub fn own_pid_namespace(&self) -> bool {
        self.processes.first().is_some_and(|r| r.nspid.len() > 1)
    }

    /// The pids of the tree.
    pub fn pids(&self) -> Vec<Pid> {
        self.processes.iter().map(|p| p.pid).collect()
    }

    /// Every id CRIU restores the tree with: its processes', its zombies'
    /// ([`Manifest::zombies`]) and its threads' ([`Manifest::threads`]). A restore in the pid
    /// namespace the tree was dumped from needs each of them free.
    pub fn restore_pids(&self) -> Vec<Pid> {
        self.pids()
            .into_iter()
            .chain(self.zombies.iter().copied())
            .chain(self.threads.iter().copied())
            .collect()
    }

    /// The SHA-256 that `manifest_sha256` must hold.
    pub fn self_digest(&self) -> Result<String, serde_json::Error> {
        let mut blank = self.clone();
        blank.manifest_sha256 = String::new();
        let bytes = serde_json::to_vec_pretty(&blank)?;
        Ok(hex::encode(Sha256::digest(&bytes)))
    }
}
