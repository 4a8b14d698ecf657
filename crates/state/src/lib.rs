//! cryo's state directory: where every file cryo keeps on a node lives, in one type.
//!
//! # Design
//! [`StateDir`] is the only place that knows the layout under the state directory (`--state-dir`,
//! env `CRYO_STATE_DIR`, default [`DEFAULT_ROOT`]). Every user (the CLI, the guard, the lifecycle
//! procedures, later the node agent) is handed a `StateDir` and asks it for a path or a store;
//! nobody joins file names onto the root by hand.
//!
//! | path | what | who writes it |
//! | --- | --- | --- |
//! | `journal/journal.log` | the event log ([`cryo_journal`]) | every command that acts, the guard |
//! | `quarantine.json`, `quarantine.lock` | the fence: GPUs that take no thaw | the guard, `cryo guard release` |
//! | `guard.sock` | the running guard's control socket (root only) | `cryo guard` |
//! | `cryod.sock` | the node agent's API socket (issue 10) | `cryod` |
//! | `cryod.lock` | one agent per node: the running agent's lock, holding its pid | `cryod` |
//! | `pins.sock` | the pin holder's socket: pinned driver fds that outlive the agent (issue 10) | the pin holder |
//! | `pins.lock` | held (`flock`) by the one pin holder of this directory while it lives | the pin holder |
//! | `pins.log` | the pin holder's log (it has no terminal) | the pin holder |
//! | `standby/` | warm-pool (standby) state (issue 12) | `cryod` |
//! | `syslog.offset` | the syslog forwarder's position in the journal (issue 11) | the forwarder |
//! | `oplock/PID-START.lock` | one park or wake at a time per process: held (`flock`) by the park or wake at work on it (its pid and `park` or `wake` inside, for the refusal the next one prints); a dead process's file is removed by the next one | every park and wake (`cryo park`, `cryo wake`, the agent, an activation, a standby claim) |
//! | `criu/` | one private directory per running CRIU dump or restore (its gate, work files, capped log), swept when its owner died (`cryo_criu::scratch`) | freeze, thaw, the standby's restore |
//!
//! The crate sits above `cryo-gpu`, `cryo-proc` and `cryo-journal` and below `cryo-lifecycle`, so
//! that the lifecycle, the guard and the CLI all reach it without importing one another.
//!
//! # Limitations
//! A unix socket path must fit in 108 bytes: a state directory deeper than about 90 bytes cannot
//! host the sockets (binding them fails with a clear error from the kernel).

pub mod fence;

use std::path::{Path, PathBuf};

use cryo_journal::{Journal, OpenError, ReadError, Reader, Scan};

/// The state directory when neither `--state-dir` nor `CRYO_STATE_DIR` is given.
pub const DEFAULT_ROOT: &str = "/var/lib/cryo";

/// The layout of one state directory. Cheap to clone; touches nothing until a call opens a file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StateDir {
    root: PathBuf,
}

impl Default for StateDir {
    fn default() -> Self {
        Self::new(DEFAULT_ROOT)
    }
}

impl StateDir {
    /// The state directory at `root`.
    pub fn new(root: impl Into<PathBuf>) -> Self {
        Self { root: root.into() }
    }

    /// The directory itself.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The journal's directory (`journal/`).
    pub fn journal_dir(&self) -> PathBuf {
        self.root.join("journal")
    }

    /// Opens the journal for appending (creating the directories if needed).
    pub fn open_journal(&self) -> Result<Journal, OpenError> {
        Journal::open(self.journal_dir())
    }

    /// Reads every record of the journal (no lock, nothing written).
    pub fn read_journal(&self) -> Result<Scan, ReadError> {
        cryo_journal::read(self.journal_dir())
    }

    /// A reader that follows the journal as it grows.
    pub fn journal_reader(&self) -> Reader {
        Reader::new(self.journal_dir())
    }

    /// The quarantine store (`quarantine.json`, locked through `quarantine.lock`).
    pub fn fence(&self) -> fence::Fence {
        fence::Fence::new(self)
    }

    /// The quarantine file.
    pub fn quarantine_file(&self) -> PathBuf {
        self.root.join("quarantine.json")
    }

    /// Where a quarantine file that could not be trusted is moved by the writer that found it
    /// (`quarantine.json.bad-NANOS`, nanoseconds since the Unix epoch when it was found).
    pub fn quarantine_set_aside(&self, unix_nanos: u128) -> PathBuf {
        self.root.join(format!("quarantine.json.bad-{unix_nanos}"))
    }

    /// The lock file writers of the quarantine take.
    pub fn quarantine_lock(&self) -> PathBuf {
        self.root.join("quarantine.lock")
    }

    /// The running guard's control socket.
    pub fn guard_socket(&self) -> PathBuf {
        self.root.join("guard.sock")
    }

    /// The node agent's API socket (`cryod`, issue 10).
    pub fn agent_socket(&self) -> PathBuf {
        self.root.join("cryod.sock")
    }

    /// The node agent's lock: held (`flock`) by the one agent of the node for its whole life; it
    /// holds that agent's pid, for the refusal a second agent prints.
    pub fn agent_lock(&self) -> PathBuf {
        self.root.join("cryod.lock")
    }

    /// The pin holder's socket: the minimal process that keeps pinned driver fds open across an
    /// agent restart (issue 10).
    pub fn pin_holder_socket(&self) -> PathBuf {
        self.root.join("pins.sock")
    }

    /// The lock the one pin holder of this state directory holds while it lives (`flock`).
    pub fn pin_holder_lock(&self) -> PathBuf {
        self.root.join("pins.lock")
    }

    /// The pin holder's log.
    pub fn pin_holder_log(&self) -> PathBuf {
        self.root.join("pins.log")
    }

    /// The agent's activators (what each listens on and for which worker), so that a restarted
    /// agent listens again.
    pub fn activators_file(&self) -> PathBuf {
        self.root.join("activators.json")
    }

    /// The warm pool's standby state (issue 12).
    pub fn standby_dir(&self) -> PathBuf {
        self.root.join("standby")
    }

    /// The syslog forwarder's durable position in the journal (`cryo-telemetry`).
    pub fn syslog_offset_file(&self) -> PathBuf {
        self.root.join("syslog.offset")
    }

    /// The per-process locks of parks and wakes (`oplock/`).
    pub fn op_locks_dir(&self) -> PathBuf {
        self.root.join("oplock")
    }

    /// The lock a park or a wake holds (`flock`) on process `pid` (its pid and start time: a pid
    /// reused names another file) while it works on it: one of them at a time per process.
    pub fn op_lock(&self, pid: &cryo_journal::ProcId) -> PathBuf {
        self.op_locks_dir()
            .join(format!("{}-{}.lock", pid.pid, pid.start_time))
    }

    /// The private directories of CRIU's dumps and restores (`cryo_criu::CriuRpc::in_scratch`).
    pub fn criu_dir(&self) -> PathBuf {
        self.root.join("criu")
    }

    /// The last journal record the agent posted as a Kubernetes Event (`cryo-agent`'s publisher).
    pub fn kube_events_offset_file(&self) -> PathBuf {
        self.root.join("kube-events.offset")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_path_is_under_the_root_and_distinct() {
        let s = StateDir::new("/st");
        let paths = [
            s.journal_dir(),
            s.quarantine_file(),
            s.quarantine_lock(),
            s.quarantine_set_aside(1),
            s.guard_socket(),
            s.agent_socket(),
            s.agent_lock(),
            s.pin_holder_socket(),
            s.kube_events_offset_file(),
            s.pin_holder_lock(),
            s.pin_holder_log(),
            s.standby_dir(),
            s.syslog_offset_file(),
            s.criu_dir(),
            s.op_locks_dir(),
        ];
        for p in &paths {
            assert_eq!(p.parent(), Some(Path::new("/st")), "{}", p.display());
        }
        let mut unique = paths.to_vec();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), paths.len());
        assert_eq!(StateDir::default().root(), Path::new(DEFAULT_ROOT));
        let (a, b) = (
            cryo_journal::ProcId::new(7, 100),
            cryo_journal::ProcId::new(7, 101),
        );
        assert_eq!(s.op_lock(&a).parent(), Some(s.op_locks_dir().as_path()));
        assert_ne!(s.op_lock(&a), s.op_lock(&b), "a reused pid shares a lock");
    }
}
