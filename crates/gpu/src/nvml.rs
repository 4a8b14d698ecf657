//! NVML (`libnvidia-ml.so.1`), loaded at run time through `nvml-wrapper`, as a [`GpuInspector`].
//!
//! # Design
//! - NVML is what tells a suspend apart from a kill that would tear a live context down: after
//!   a checkpoint the pid is no longer in `nvmlDeviceGetComputeRunningProcesses`. One query takes
//!   ~0.03 ms, so callers may poll it.
//! - [`driver_fds`] reads `/proc/PID/fd` directly (no NVML): it names the `/dev/nvidia*` fds that
//!   fd pinning must duplicate to keep a dying process's context alive.
//!
//! # Limitations
//! - NVML reports host pids; a caller inside a pid namespace must translate (NSpid).
//! - A process whose memory NVML cannot attribute (`NVML_VALUE_NOT_AVAILABLE`) is listed with 0.
//! - Graphics contexts are not listed, only compute ones.

use std::ffi::OsStr;
use std::io;
use std::path::Path;

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::Nvml;

use crate::{GpuInfo, GpuInspector, GpuProcess, GpuUuid, InspectError, Pid};

/// NVML's SONAME, as the NVIDIA driver installs it.
pub const LIBNVML: &str = "libnvidia-ml.so.1";

/// Where the real driver's device files live; an fd linking under this prefix is a driver fd.
pub const NVIDIA_DEV_PREFIX: &str = "/dev/nvidia";

/// NVML, initialised.
pub struct NvmlInspector {
    nvml: Nvml,
}

impl std::fmt::Debug for NvmlInspector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmlInspector").finish_non_exhaustive()
    }
}

fn nvml_err(what: &str, e: NvmlError) -> InspectError {
    InspectError::Nvml(format!("{what}: {e}"))
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
        Ok(NvmlInspector { nvml })
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
        .map_err(|e| InspectError::Nvml(format!("GPU {index}: {e}")))
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
        let mut out = Vec::new();
        for index in 0..self.count()? {
            let d = self.device(index)?;
            let uuid = device_uuid(&d, index)?;
            let procs = d
                .running_compute_processes()
                .map_err(|e| nvml_err(&format!("GPU {index} compute processes"), e))?;
            for p in procs {
                let pid = Pid::try_from(p.pid).map_err(|_| {
                    InspectError::Nvml(format!("GPU {index}: pid {} out of range", p.pid))
                })?;
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
}

/// The fds of `pid` that are NVIDIA device files (`/dev/nvidia*`), in ascending order.
pub fn driver_fds(pid: Pid) -> Result<Vec<i32>, InspectError> {
    fds_linking_under(Path::new("/proc"), pid, NVIDIA_DEV_PREFIX)
}

/// The fds in `PROC/PID/fd` whose link target starts with `prefix`, ascending. An fd closed
/// between listing and reading its link is skipped (the table changes under us); any other
/// error is reported.
pub fn fds_linking_under(
    proc_root: &Path,
    pid: Pid,
    prefix: &str,
) -> Result<Vec<i32>, InspectError> {
    let fail = |source: io::Error| InspectError::Fds { pid, source };
    let dir = proc_root.join(pid.to_string()).join("fd");
    let mut fds = Vec::new();
    for entry in std::fs::read_dir(&dir).map_err(fail)? {
        let entry = entry.map_err(fail)?;
        let Some(fd) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        let target = match std::fs::read_link(entry.path()) {
            Ok(t) => t,
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(e) => return Err(fail(e)),
        };
        if target
            .as_os_str()
            .as_encoded_bytes()
            .starts_with(prefix.as_bytes())
        {
            fds.push(fd);
        }
    }
    fds.sort_unstable();
    Ok(fds)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]
    use super::*;

    #[test]
    fn loading_nvml_from_a_missing_library_names_it() {
        let err = NvmlInspector::load_from("/nonexistent/libnvidia-ml.so.1").unwrap_err();
        let msg = err.to_string();
        assert!(matches!(err, InspectError::Nvml(_)), "{err:?}");
        assert!(msg.contains("/nonexistent/libnvidia-ml.so.1"), "{msg}");
    }

    #[test]
    fn loading_nvml_from_a_library_without_its_symbols_fails_cleanly() {
        let err = NvmlInspector::load_from("libc.so.6").unwrap_err();
        assert!(err.to_string().contains("libc.so.6"), "{err}");
    }

    #[test]
    fn nvml_load_matches_whether_a_driver_is_present() {
        let driver = Path::new("/proc/driver/nvidia").exists();
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
    fn a_plain_process_has_no_nvidia_fds_and_fd_tables_are_read() {
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
        let me = Pid::try_from(std::process::id()).unwrap();
        let f = std::fs::File::open("/proc/self/stat").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let proc_fds = fds_linking_under(Path::new("/proc"), me, "/proc/").unwrap();
        assert!(
            proc_fds.contains(&fd),
            "fd {fd} of /proc/self/stat not in {proc_fds:?}"
        );
        let stdio = fds_linking_under(Path::new("/proc"), me, "").unwrap();
        assert!(
            stdio.contains(&fd) && stdio.windows(2).all(|w| w[0] < w[1]),
            "{stdio:?}"
        );
    }

    #[test]
    fn nvidia_fds_are_found_in_a_fake_proc_tree() {
        let root = tempfile::tempdir().unwrap();
        let fd_dir = root.path().join("4242").join("fd");
        std::fs::create_dir_all(&fd_dir).unwrap();
        for (fd, target) in [
            ("0", "/dev/null"),
            ("3", "/dev/nvidiactl"),
            ("12", "/dev/nvidia0"),
            ("7", "/dev/nvidia-uvm"),
            ("9", "socket:[123]"),
            ("5", "/home/dev/nvidia0"),
        ] {
            std::os::unix::fs::symlink(target, fd_dir.join(fd)).unwrap();
        }
        let fds = fds_linking_under(root.path(), 4242, NVIDIA_DEV_PREFIX).unwrap();
        assert_eq!(fds, vec![3, 7, 12]);
    }

    #[test]
    fn missing_process_is_an_fds_error_naming_the_pid() {
        let root = tempfile::tempdir().unwrap();
        let err = fds_linking_under(root.path(), 77, NVIDIA_DEV_PREFIX).unwrap_err();
        assert!(matches!(err, InspectError::Fds { pid: 77, .. }), "{err:?}");
        assert!(err.to_string().contains("pid 77"), "{err}");
    }
}
