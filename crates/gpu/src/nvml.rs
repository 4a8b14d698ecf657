//! NVML (`libnvidia-ml.so.1`), loaded at run time through `nvml-wrapper`, as a [`GpuInspector`].
//!
//! # Design
//! - NVML is what tells a suspend apart from a kill that would tear a live context down: after
//!   a checkpoint the pid is no longer in `nvmlDeviceGetComputeRunningProcesses`. One query takes
//!   ~0.03 ms, so callers may poll it.
//! - [`GpuInspector::driver_fds`] asks no NVML: the process's fd table (`cryo_proc`) names the
//!   `/dev/nvidia*` fds ([`cryo_proc::DriverFiles::Nvidia`]) that fd pinning must duplicate to keep
//!   a dying process's context alive.
//!
//! # Limitations
//! - NVML reports the driver's pids, which are cryo's only in the host's pid namespace; from any
//!   other, `processes` is an error ([`InspectError::ForeignPidNamespace`]): the host pids are not
//!   visible there (`NSpid` starts at the reader's namespace), and whether the driver translates
//!   them to the caller's namespace is not documented. The agent's DaemonSet sets `hostPID`.
//! - A process whose memory NVML cannot attribute (`NVML_VALUE_NOT_AVAILABLE`) is listed with 0.
//! - Graphics contexts are not listed, only compute ones.

use std::ffi::OsStr;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::{GpuInfo, GpuInspector, GpuProcess, GpuUuid, InspectError, Pid};

/// NVML's SONAME, as the NVIDIA driver installs it.
pub const LIBNVML: &str = "libnvidia-ml.so.1";

/// NVML, initialised.
pub struct NvmlInspector {
    nvml: Nvml,
    /// cryo's pid namespace, when it is not the host's (read once: a process never changes its
    /// own): NVML's process list is then refused rather than matched against the wrong pids.
    foreign_pid_ns: Option<u64>,
}

impl std::fmt::Debug for NvmlInspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlInspector").finish_non_exhaustive()
    }
}

fn nvml_err(what: &str, source: NvmlError) -> InspectError {
    InspectError::Nvml {
        what: what.to_string(),
        source,
    }
}

impl NvmlInspector {
    /// Loads `libnvidia-ml.so.1` and runs `nvmlInit`.
    pub fn load() -> Result<NvmlInspector, InspectError> {
        Self::load_from(LIBNVML)
    }

    /// Loads NVML from `path` (tests, unusual installs).
    pub fn load_from(path: &str) -> Result<NvmlInspector, InspectError> {
        let nvml = Nvml::builder()
            .lib_path(OsStr::new(path))
            .init()
            .map_err(|e| nvml_err(&format!("loading {path}"), e))?;
        let foreign_pid_ns = match cryo_proc::ns::in_initial_pid_namespace() {
            Ok(true) => None,
            // Unreadable counts as foreign: matching pids then is not safe either.
            Ok(false) | Err(_) => {
                Some(cryo_proc::ns::pid_namespace(std::process::id() as Pid).unwrap_or(0))
            }
        };
        Ok(NvmlInspector {
            nvml,
            foreign_pid_ns,
        })
    }

    fn device(&self, index: u32) -> Result<nvml_wrapper::Device<'_>, InspectError> {
        self.nvml
            .device_by_index(index)
            .map_err(|e| nvml_err(&format!("GPU {index}"), e))
    }

    fn count(&self) -> Result<u32, InspectError> {
        self.nvml
            .device_count()
            .map_err(|e| nvml_err("nvmlDeviceGetCount", e))
    }
}

fn parse_uuid(index: u32, s: String) -> Result<GpuUuid, InspectError> {
    s.parse()
        .map_err(|source| InspectError::BadUuid { index, source })
}

fn used_bytes(m: UsedGpuMemory) -> u64 {
    match m {
        UsedGpuMemory::Used(b) => b,
        UsedGpuMemory::Unavailable => 0,
    }
}

/// The UUID of device `index`, as NVML prints it.
fn device_uuid(d: &nvml_wrapper::Device<'_>, index: u32) -> Result<GpuUuid, InspectError> {
    let text = d
        .uuid()
        .map_err(|e| nvml_err(&format!("GPU {index} uuid"), e))?;
    parse_uuid(index, text)
}

impl GpuInspector for NvmlInspector {
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
        (0..self.count()?)
            .map(|index| {
                let d = self.device(index)?;
                let uuid = device_uuid(&d, index)?;
                let name = d
                    .name()
                    .map_err(|e| nvml_err(&format!("GPU {index} name"), e))?;
                let mem = d
                    .memory_info()
                    .map_err(|e| nvml_err(&format!("GPU {index} memory"), e))?;
                Ok(GpuInfo {
                    index,
                    uuid,
                    name,
                    memory_total: mem.total,
                    memory_free: mem.free,
                })
            })
            .collect()
    }

    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
        // Every decision that reads this list matches its pids against cryo's own: from another
        // pid namespace that match would be silently wrong (an unlisted live context), so it is
        // an error, which every caller treats as "cannot tell" (a refusal, every GPU fenced).
        if let Some(namespace) = self.foreign_pid_ns {
            return Err(InspectError::ForeignPidNamespace { namespace });
        }
        let mut out = Vec::new();
        for index in 0..self.count()? {
            let d = self.device(index)?;
            let uuid = device_uuid(&d, index)?;
            let procs = d
                .running_compute_processes()
                .map_err(|e| nvml_err(&format!("GPU {index} compute processes"), e))?;
            for p in procs {
                let pid =
                    Pid::try_from(p.pid).map_err(|_| InspectError::BadPid { index, pid: p.pid })?;
                out.push(GpuProcess {
                    pid,
                    gpu_index: index,
                    gpu_uuid: uuid.clone(),
                    used_memory: used_bytes(p.used_gpu_memory),
                });
            }
        }
        Ok(out)
    }

    fn driver_version(&self) -> Result<String, InspectError> {
        self.nvml
            .sys_driver_version()
            .map_err(|e| nvml_err("nvmlSystemGetDriverVersion", e))
    }

    fn driver_fds(&self, pid: Pid) -> Result<Vec<i32>, InspectError> {
        driver_fds(pid)
    }

    fn cuda_processes(&self) -> Result<Vec<Pid>, InspectError> {
        let mut pids: Vec<Pid> = self.processes()?.into_iter().map(|p| p.pid).collect();
        pids.extend(
            cryo_proc::driver_file_holders(cryo_proc::DriverFiles::Nvidia)
                .map_err(|source| InspectError::Fds { pid: 0, source })?,
        );
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }
}

/// The fds of `pid` that are NVIDIA device files (`/dev/nvidia*`), in ascending order.
pub fn driver_fds(pid: Pid) -> Result<Vec<i32>, InspectError> {
    let fds = cryo_proc::fds(pid).map_err(|source| InspectError::Fds { pid, source })?;
    Ok(cryo_proc::driver_fds(&fds, cryo_proc::DriverFiles::Nvidia))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn loading_nvml_from_a_missing_library_names_it() {
        let err = NvmlInspector::load_from("/nonexistent/libnvidia-ml.so.1").unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, InspectError::Nvml { .. }), "{err:?}");
        assert!(msg.contains("/nonexistent/libnvidia-ml.so.1"), "{msg}");
    }

    #[test]
    fn loading_nvml_from_a_library_without_its_symbols_fails_cleanly() {
        let err = NvmlInspector::load_from("libc.so.6").unwrap_err();
        assert!(err.to_string().contains("libc.so.6"), "{err}");
    }

    #[test]
    fn nvml_load_matches_whether_a_driver_is_present() {
        let driver = std::path::Path::new("/proc/driver/nvidia").exists();
        match NvmlInspector::load() {
            Ok(n) => {
                assert!(driver, "NVML loaded without an NVIDIA kernel driver");
                assert!(!n.driver_version().unwrap().is_empty());
            }
            Err(e) => {
                assert!(!driver, "NVIDIA driver present but NVML failed: {e}");
                assert!(e.to_string().contains(LIBNVML), "{e}");
            }
        }
    }

    #[test]
    fn a_plain_process_has_no_nvidia_fds() {
        // A fresh child: this test binary may itself hold NVML's fds on a GPU machine.
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let found = driver_fds(Pid::try_from(child.id()).unwrap());
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(found.unwrap(), Vec::<i32>::new());
    }

    #[test]
    fn missing_process_is_an_fds_error_naming_the_pid() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = Pid::try_from(child.id()).unwrap();
        child.wait().unwrap();
        let err = driver_fds(pid).unwrap_err();
        assert!(
            matches!(err, InspectError::Fds { pid: p, .. } if p == pid),
            "{err:?}"
        );
        assert!(err.to_string().contains(&format!("pid {pid}")), "{err}");
    }
}
