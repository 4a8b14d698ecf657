//! cryo-guard: the mechanics of guarding restored workers against disorderly deaths.
//!
//! # Design
//! - [`tracer::Tracer`]: one thread owns all ptrace state. It seizes every thread of a target
//!   (exit and clone events, never kill-on-tracer-exit), lets non-fatal signals through at once,
//!   holds a thread that is about to receive a fatal signal while the others run and asks the
//!   [`policy::Policy`], and at the leader's exit stop (SIGKILL, OOM kill, `exit_group`) takes
//!   duplicates of the fds the policy names (`pidfd_getfd`) and hands them over before letting the
//!   process exit. Policy callbacks run off the tracer thread.
//! - Every action on a process that is not our child goes through a [`cryo_proc::ProcHandle`]
//!   (pidfd), and every read of `/proc` through `cryo_proc` (threads, fds, signal masks,
//!   `oom_score_adj`, cgroups).
//! - [`memory`]: PSI and cgroup OOM-kill counters, cgroup v1 and v2.
//! - [`signals`]: which signals count as fatal (no handler installed, default action kills).
//! - `sys`: the raw syscalls, the only `unsafe` code.
//!
//! Pinned fds go to a [`pins::PinSink`] (the pin holder, [`cryo_holder`]) before the process is
//! released, so that they outlive the guard; without one, or when it cannot take them, the guard
//! keeps them in its own process.
//!
//! The policy that suspends, journals and fences ([`guard::Guard`]) plugs in through
//! [`policy::Policy`]; [`control`] is its unix socket (status, attach/detach around a CRIU dump,
//! the operator's release of pins); [`service::run`] is a guard's whole life (start, socket,
//! journal poll, memory watch, a stop that never drops pins), for `cryo guard` and the agent.
//!
//! # Kernel behaviour this relies on
//! - A `PTRACE_EVENT_EXIT` stop is reported for every death, SIGKILL and memcg OOM kill included,
//!   with the fd table intact, and `pidfd_getfd` works there.
//! - At a signal-delivery-stop only the signalled thread is stopped.
//! - When the tracer (thread) dies the kernel detaches its tracees; running ones keep running,
//!   and a thread held at a signal-delivery-stop resumes *without* the held signal (measured on
//!   6.18: a held SIGTERM is lost; a held fault re-executes and faults again, untraced, so it
//!   kills). Threads in group-stop stay stopped.
//! - A traced process that is not the guard's child is reported to the tracer first when it dies,
//!   then handed to its real parent; until that parent reaps it, it is a zombie and its pidfd
//!   still accepts signal 0 ([`cryo_proc::ProcHandle::liveness`] says `Zombie`, not `Gone`).
//! - Lowering `oom_score_adj` and PSI trigger windows that are not multiples of 2 s both need
//!   `CAP_SYS_RESOURCE` (which the development container lacks).
//!
//! # Limitations
//! See [`tracer`]. Lowering `oom_score_adj` needs `CAP_SYS_RESOURCE`
//! ([`cryo_proc::OomAdjError::NotPermitted`] says so).

pub mod control;
pub mod guard;
pub mod memory;
pub mod pins;
pub mod policy;
pub mod service;
pub mod signals;
mod standing;
pub mod sys;
pub mod tracer;

pub use guard::{
    Endgame, Guard, GuardConfig, GuardStatus, MemoryWatch, Scan, StartReport, GUARD_BEFORE_SEIZE,
    SCAN_INTERVAL,
};
pub use pins::{HolderSink, PinSink};
pub use policy::{AfterExec, Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee};
pub use service::{run, termination_flag, Notice, RunError, RunOptions, Service};
pub use tracer::{AttachError, DetachError, SpawnError, Tracer, TracerGone, TracerStats};
