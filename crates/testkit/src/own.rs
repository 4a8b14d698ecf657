//! Every process a test starts is the test's, and ends when the test does, however it ends.
//!
//! # Design
//! The first time a test process asks ([`own`], which every kit helper that starts a process
//! calls), it moves into a cgroup of its own on the unified (v2) hierarchy, below the one it was
//! started in (so below the run's cgroup when `scripts/test.sh` runs the suite). Everything it
//! starts from then on is in that cgroup whatever it does: a worker that leads its own session
//! or namespaces, a daemon that double-forks, a process CRIU restores (into the cgroup it was
//! dumped from), an image checker a `cryo thaw` starts. No name, pid or process tree is matched.
//!
//! A watchdog started just before the move, outside of the cgroup and in a session of its own
//! (a runner's signal to the test's process group misses it), reads a pipe whose only write end the
//! test process holds (close-on-exec: nothing the test starts inherits it). When the test
//! process is gone, returned, panicked, aborted or SIGKILLed by a runner's timeout, the kernel
//! closes that end; the watchdog writes what is still in the cgroup to `CRYO_TEST_LEFT_DIR` (when
//! set: `scripts/test.sh` lists it), ends the whole cgroup at once (`cgroup.kill`), waits until it
//! is empty and removes it, then removes the test's scratch directory ([`Owner::scratch`]: where
//! the kit puts a simulated driver's directory, a worker binary's copy and images included), which
//! a test that dies never removes itself.
//!
//! # Limitations
//! A process that moves itself to another v2 cgroup leaves the test's (cryo's pin holder does,
//! to `cryo-pins`, unless `CRYO_HOLDER_CGROUP=stay`): the end of `scripts/test.sh` lists those by
//! the run's tag in their environment. Panics, naming what is missing, without a unified
//! hierarchy (cgroup v2 or hybrid): root tests never pass silently without what they need.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::OnceLock;

/// The directory where the watchdogs write what they ended (one file per test that left
/// processes running), when set.
pub const LEFT_DIR_ENV: &str = "CRYO_TEST_LEFT_DIR";

/// The test process's own cgroup and the write end of the watchdog's pipe, held for as long as
/// the process lives.
#[derive(Debug)]
pub struct Owner {
    cgroup: PathBuf,
    scratch: PathBuf,
    _alive: std::os::fd::OwnedFd,
}

impl Owner {
    /// The test's cgroup (unified hierarchy).
    pub fn cgroup(&self) -> &Path {
        &self.cgroup
    }

    /// A directory of the test's own in the temporary directory, removed with everything in it by
    /// the watchdog once the test process is gone and its processes are ended (however the test
    /// ended): make the test's large temporary directories in it.
    pub fn scratch(&self) -> &Path {
        &self.scratch
    }
}

static OWNER: OnceLock<Owner> = OnceLock::new();

/// Puts the calling test process into a cgroup of its own, watched, once (later calls return
/// the same); see the module docs. Call it before starting any process.
pub fn own() -> &'static Owner {
    OWNER.get_or_init(start)
}

/// What the watchdog runs (`sh -c`): `$1` the test's cgroup, `$2` the test's pid, `$3` the file
/// to list what is left in (or empty), `$4` the test's command line, `$5` the test's scratch
/// directory. Its stdin is the pipe.
/// It forks nothing until the pipe's end (a builtin `read`): a test that makes a process take a
/// given pid (`ns_last_pid`) right after its first [`own`] must not see the watchdog take it.
const WATCHDOG: &str = r#"
while read -r _; do :; done
left=""
for p in $(find "$1" -name cgroup.procs -exec cat {} + 2>/dev/null); do
  [ "$p" = "$2" ] && continue
  left="$left$p $(tr '\0' ' ' <"/proc/$p/cmdline" 2>/dev/null)
"
done
# Said first: a watchdog of a test this test ran is in this test's cgroup, ended with it.
if [ -n "$left" ] && [ -n "$3" ]; then
  printf 'ended at the end of %s:\n%s' "$4" "$left" >"$3"
fi
echo 1 >"$1/cgroup.kill"
i=0
while ! grep -qx 'populated 0' "$1/cgroup.events" 2>/dev/null && [ "$i" -lt 600 ]; do
  sleep 0.1
  i=$((i + 1))
done
# Children first: the cgroups of tests this test ran as processes of its own.
find "$1" -depth -type d -exec rmdir {} + 2>/dev/null
# Only once nothing of the test can still write in it. `rm` does not follow links in it.
rm -rf -- "$5"
"#;

fn start() -> Owner {
    let me = std::process::id();
    let parent = cryo_proc::ProcHandle::open(me as cryo_proc::Pid)
        .and_then(|h| h.cgroup_dirs())
        .ok()
        .and_then(|c| c.unified)
        .unwrap_or_else(|| {
            panic!("the test kit owns a test's processes through a cgroup v2 (unified hierarchy) of the test's own: none is mounted")
        });
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("cryo-test-{me}-{nanos}");
    let cgroup = parent.join(&name);
    std::fs::create_dir(&cgroup)
        .unwrap_or_else(|e| panic!("making the test's cgroup {}: {e}", cgroup.display()));
    let scratch = std::env::temp_dir().join(&name);
    if let Err(e) = std::fs::create_dir(&scratch) {
        let _ = std::fs::remove_dir(&cgroup);
        panic!(
            "making the test's scratch directory {}: {e}",
            scratch.display()
        );
    }
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).unwrap();
    let left = std::env::var_os(LEFT_DIR_ENV)
        .map(|d| PathBuf::from(d).join(format!("{me}-{nanos}")))
        .unwrap_or_default();
    let argv: Vec<String> = std::env::args().collect();
    // `setsid --fork`: a session of its own, not a child of the test's (whose children some
    // tests list) once the `setsid` in between has exited.
    let mut watchdog = Command::new("setsid");
    watchdog
        .args(["--fork", "sh", "-c", WATCHDOG, "cryo-test-watchdog"])
        .arg(&cgroup)
        .arg(me.to_string())
        .arg(&left)
        .arg(argv.join(" "))
        .arg(&scratch)
        .stdin(Stdio::from(read))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    crate::fds::close_inherited(&mut watchdog, None);
    match watchdog.status() {
        Ok(s) if s.success() => {}
        other => {
            let _ = std::fs::remove_dir(&cgroup);
            let _ = std::fs::remove_dir(&scratch);
            panic!("starting the test's watchdog (setsid --fork sh): {other:?}");
        }
    }
    // "0": the writer, every thread of it.
    std::fs::write(cgroup.join("cgroup.procs"), "0")
        .unwrap_or_else(|e| panic!("moving the test into {}: {e}", cgroup.display()));
    Owner {
        cgroup,
        scratch,
        _alive: write,
    }
}
