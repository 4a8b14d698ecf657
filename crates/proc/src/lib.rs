//! Processes as cryo acts on them: the one home for everything cryo reads from `/proc` and every
//! action on a process it did not spawn.
//!
//! # Design
//! cryo acts on processes it did not spawn (inference workers, their children, restored trees), so
//! a bare pid is never enough: between finding a pid and signalling it the process can exit and
//! the pid be reused. Every action goes through a [`ProcHandle`], which holds a pidfd opened while
//! the process was known to be the one meant (same start time), so a signal, an fd duplicated with
//! `pidfd_getfd` or an `oom_score_adj` written can only ever reach that process, and exit is
//! observed by polling the pidfd rather than guessed from `/proc`. What a handle reads from
//! `/proc/PID` is read through a directory fd opened while the pidfd's process was not yet reaped,
//! so it is that process's (a `/proc/PID` directory fd stays bound to the process it was opened
//! for).
//!
//! Parsing is the `procfs` crate's; this crate decides what cryo needs from it and maps its errors
//! into one [`ProcError`]. The free functions ([`stat`], [`status`], [`fds`], [`liveness`],
//! [`tree`], [`pids_in_use`], [`wchan`]) take bare pids: for those who have nothing else (the simulated
//! driver answers for a pid, as the real one does; a tracer names threads by tid; a command looks a
//! pid up before it opens it).
//!
//! Which fds are a GPU driver's ([`DriverFiles`]) is decided here, once, for the real driver
//! (`/dev/nvidia*`) and for the simulated one (its context sockets): fd pinning must hold exactly
//! those.
//!
//! # Limitations
//! A start time has clock-tick resolution (10 ms at the usual `CLK_TCK` of 100): a pid reused
//! within the same tick is not told apart by [`ProcHandle::open_expected`] alone. Where pidfds
//! live on pidfs (Linux 6.9+) [`ProcHandle::pidfs_inode`] does (the journal's `ProcId` records
//! it); on older kernels the start time is all there is. A held handle is not affected: its
//! pidfd never names another process.
//!
//! Pids are host pids (the namespace cryo runs in; [`Status::nspid`] gives the others). Exit
//! statuses of processes that are not our children are not available through a pidfd; callers that
//! need how a process died read its zombie's [`Stat::exit_code`] while they can.

mod cgroup;
mod error;
mod fds;
mod handle;
pub mod isolate;
mod netns;
pub mod ns;
mod read;
mod reap;
mod signal;
mod sys;

pub use cgroup::{cgroup_procs, cgroup_tree_procs, is_hierarchy_root, CgroupEntry, Cgroups};
pub use error::{OomAdjError, ProcError};
pub use fds::{driver_fds, DriverFiles, Fd, FdTarget};
pub use handle::{pidfs_inode, Liveness, ProcHandle, Unpinned};
pub use netns::{in_net_namespace, in_net_namespace_of};
/// A set of CPUs, as [`ProcHandle::affinity`] answers it.
pub use nix::sched::CpuSet;
pub use read::{
    boot_id, boot_ticks, driver_file_holders, fds, liveness, load_average, mem_available, naming,
    pid_holders, pid_max, pids_in_use, pin_to_cpus, runs_our_executable, same_namespace, stat,
    status, tgid, thread_children, thread_named, threads_cpu, tree, unix_listeners_of, wchan,
    NamespaceKind, PidHolder, Stat, Status, ThreadCpu, SYSTEM_MEMORY_PRESSURE,
};
pub use reap::{reap_child, reap_children, reap_ended, ChildEnd, Reaped};
pub use signal::{describe_wait_status, signal_name, Signal};
pub use sys::default_sigchld;

/// A process or thread id, in cryo's pid namespace (the host's). The one name for it in cryo.
pub type Pid = i32;
