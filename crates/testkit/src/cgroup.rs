//! A memory cgroup made for one test and removed after it.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use cryo_proc::Pid;

/// The cgroup v1 memory hierarchy the tests use (the guard's OOM and memory-watch tests need its
/// `memory.oom_control`).
pub const V1_MEMORY: &str = "/sys/fs/cgroup/memory";

/// A v1 memory cgroup with a memory limit, named uniquely (test runs share the machine);
/// removed on drop once its processes are gone.
#[derive(Debug)]
pub struct TestCgroup {
    dir: PathBuf,
}

impl TestCgroup {
    /// `/sys/fs/cgroup/memory/cryo-test-TAG-PID-N-NANOS` limited to `limit` bytes (memory+swap
    /// too where the kernel accounts swap). Panics, naming what is missing, where there is no v1
    /// memory controller: the tests that need one must not pass silently without it.
    pub fn new(tag: &str, limit: u64) -> Self {
        static N: AtomicU32 = AtomicU32::new(0);
        let root = Path::new(V1_MEMORY);
        assert!(
            root.join("memory.oom_control").exists(),
            "this test needs the cgroup v1 memory controller at {V1_MEMORY}"
        );
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let dir = root.join(format!(
            "cryo-test-{tag}-{}-{}-{nanos}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string()).unwrap();
        let memsw = dir.join("memory.memsw.limit_in_bytes");
        if memsw.exists() {
            std::fs::write(memsw, limit.to_string()).unwrap();
        }
        TestCgroup { dir }
    }

    /// Its directory.
    pub fn path(&self) -> &Path {
        &self.dir
    }

    /// Moves `pid` (and its threads) into it.
    pub fn add(&self, pid: Pid) {
        std::fs::OpenOptions::new()
            .write(true)
            .open(self.dir.join("cgroup.procs"))
            .unwrap()
            .write_all(pid.to_string().as_bytes())
            .unwrap();
    }
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        // A killed process leaves the cgroup once it is reaped, which its parent does at its pace.
        for _ in 0..500 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        eprintln!("could not remove {}", self.dir.display());
    }
}
