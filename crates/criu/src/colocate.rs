//! One CPU for CRIU and the processes it dumps, for the time of a dump.
//!
//! # Why
//! A dump's time is CRIU's page loop: for every 7 MiB of memory CRIU asks its parasite (code it
//! runs inside the dumped process's main thread) to splice the pages into a pipe, waits, splices
//! them into the image, and asks for the next: one side always waits for the other. Where the
//! scheduler puts the two sides on two CPUs (it picks an idle CPU for a woken task), every
//! hand-over is a wake-up on another CPU, an inter-processor interrupt (in a VM, an exit to the
//! hypervisor). Measured (issue 16, 1 GiB sim worker, 8 interleaved rounds, load ~13, 2 CPUs,
//! /work/notes/s13/dumpgap): the bare `criu dump` with CRIU and the worker pinned to one CPU
//! 736 ms median, to two CPUs 1226, left to the scheduler 963; the parasite's CPU time 37, 84
//! and 50 ms. Where the scheduler happened to put the two sides was the largest term of the
//! difference between cryo's dump and the bare one (up to 40% of the page loop, either way).
//!
//! # Design
//! Before CRIU starts, the main threads of the tree's processes are pinned to one CPU that both
//! cryo and the tree may run on (the one cryo runs on, if allowed), their own CPU sets kept;
//! CRIU is pinned to the same CPU as soon as it is spawned. Before the first process is pinned,
//! the caller's [`PinRecord`] is told what will be pinned and each process's own CPU set (the
//! freeze journals it): if cryo dies during the dump, CRIU resumes the tree, and whoever finds
//! that dump dead gives the sets back from that record (`cryo_lifecycle::settle_in_flight`). A
//! record that cannot be kept pins nothing. After CRIU exited, every process still alive (a
//! failed dump resumed it, or `leave_running`) gets its CPU set back, if its set is still the
//! pin: one someone else changed during the dump (Kubernetes' CPU manager rewrites cpusets) is
//! theirs, left as it is ([`ProcHandle::unpin`]), and so does what inherited the pin from a
//! pinned main thread since (a thread it started, a child it forked once CRIU resumed it:
//! [`ProcHandle::unpin_inherited`]); the record is told what was given back. The
//! dumped processes are frozen by CRIU for all of the dump but the few milliseconds before its
//! seize, so they lose nothing.
//!
//! # Limitations
//! Main threads only (where CRIU runs its parasite); a process forked after the pinning by an
//! unpinned thread runs where the scheduler puts it. Affinity takes a pid: each call is checked against the
//! process's pidfd afterwards (see [`cryo_proc::ProcHandle::set_affinity`]). Nothing is pinned
//! when no CPU is allowed to both cryo and the tree's root.

use cryo_proc::{Pid, ProcHandle, Unpinned};
use nix::sched::CpuSet;

/// Who keeps the record of the CPU sets a dump takes from the tree it pins: told before the
/// first process is pinned, and once CRIU has exited and the sets are given back.
pub trait PinRecord: Sync {
    /// Before anything is pinned: each of `procs` (with its own CPU set) is to run on `cpu`
    /// only. An `Err` (the record cannot be kept) pins nothing.
    fn pinning(&self, cpu: usize, procs: &[(&ProcHandle, CpuSet)]) -> Result<(), String>;

    /// After CRIU exited: `returned` got their own CPU sets back; `left` were left as they
    /// are (someone else changed their sets since the pin, or they cannot be looked at); the
    /// others have ended.
    fn given_back(&self, returned: &[&ProcHandle], left: &[&ProcHandle]);
}

/// No record kept (a dump outside a freeze: the tests', the bench's bare use of the wrapper).
#[derive(Debug, Clone, Copy)]
pub struct Unrecorded;

impl PinRecord for Unrecorded {
    fn pinning(&self, _cpu: usize, _procs: &[(&ProcHandle, CpuSet)]) -> Result<(), String> {
        Ok(())
    }

    fn given_back(&self, _returned: &[&ProcHandle], _left: &[&ProcHandle]) {}
}

/// The tree's main threads pinned to [`Colocated::cpu`], with the CPU sets they had.
pub(crate) struct Colocated<'r> {
    cpu: Option<usize>,
    pinned: Vec<(ProcHandle, CpuSet)>,
    /// When they were pinned (clock ticks after boot): what started since in the tree
    /// inherited the pin.
    since: Option<u64>,
    record: &'r dyn PinRecord,
}

impl std::fmt::Debug for Colocated<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Colocated")
            .field("cpu", &self.cpu)
            .field("pinned", &self.pinned)
            .finish_non_exhaustive()
    }
}

impl<'r> Colocated<'r> {
    /// Pins the main thread of `root` and of each of its descendants to one CPU both this
    /// process and `root` may run on, once `record` took what is to be pinned. Best effort:
    /// what cannot be pinned is left alone.
    pub(crate) fn pin_tree(root: Pid, record: &'r dyn PinRecord) -> Colocated<'r> {
        let mut c = Colocated {
            cpu: None,
            pinned: Vec::new(),
            since: None,
            record,
        };
        let Ok(root) = ProcHandle::open(root) else {
            return c;
        };
        let (Ok(ours), Ok(theirs)) = (
            nix::sched::sched_getaffinity(nix::unistd::Pid::from_raw(0)),
            root.affinity(),
        ) else {
            return c;
        };
        let both =
            |cpu: usize| ours.is_set(cpu).unwrap_or(false) && theirs.is_set(cpu).unwrap_or(false);
        let here = nix::sched::sched_getcpu().ok().filter(|c| both(*c));
        let Some(cpu) = here.or_else(|| (0..CpuSet::count()).find(|c| both(*c))) else {
            return c;
        };
        let mut one = CpuSet::new();
        if one.set(cpu).is_err() {
            return c;
        }
        let descendants = root.descendants();
        let kept: Vec<(ProcHandle, CpuSet)> = std::iter::once(root)
            .chain(descendants)
            .filter_map(|h| h.affinity().ok().map(|k| (h, k)))
            .collect();
        let listed: Vec<(&ProcHandle, CpuSet)> = kept.iter().map(|(h, k)| (h, *k)).collect();
        if let Err(e) = record.pinning(cpu, &listed) {
            tracing::warn!(error = %e, "the tree's CPU sets cannot be recorded: the dump runs unpinned");
            return c;
        }
        c.cpu = Some(cpu);
        c.since = cryo_proc::boot_ticks();
        for (h, k) in kept {
            match h.set_affinity(&one) {
                Ok(()) => c.pinned.push((h, k)),
                Err(e) => tracing::debug!(pid = h.pid(), error = %e, "not pinned for the dump"),
            }
        }
        c
    }

    /// Pins `criu` (CRIU, just spawned by this process) to the tree's CPU.
    pub(crate) fn pin_criu(&self, criu: Pid) {
        let Some(cpu) = self.cpu else { return };
        let mut one = CpuSet::new();
        if one.set(cpu).is_ok() {
            if let Err(e) = nix::sched::sched_setaffinity(nix::unistd::Pid::from_raw(criu), &one) {
                tracing::debug!(criu, error = %e, "CRIU not pinned for the dump");
            }
        }
    }

    /// The CPU the dump runs on (`None`: nothing was pinned).
    pub(crate) fn cpu(&self) -> Option<usize> {
        self.cpu
    }
}

impl Drop for Colocated<'_> {
    /// Gives every pinned process still alive its CPU set back, unless someone else changed
    /// it since; tells the record.
    fn drop(&mut self) {
        let Some(cpu) = self.cpu else { return };
        let mut one = CpuSet::new();
        if one.set(cpu).is_err() {
            return;
        }
        let (mut returned, mut left) = (Vec::new(), Vec::new());
        for (h, kept) in &self.pinned {
            if !h.is_alive() {
                continue;
            }
            match h.unpin(&one, kept) {
                Ok(Unpinned::Returned | Unpinned::Already) => returned.push(h),
                Ok(Unpinned::Changed(_)) => {
                    tracing::info!(
                        pid = h.pid(),
                        "its CPU set was changed during the dump: left as it is"
                    );
                    left.push(h);
                }
                Err(e) if !h.is_alive() => {
                    tracing::debug!(pid = h.pid(), error = %e, "ended as its CPU set was given back");
                }
                Err(e) => {
                    tracing::warn!(pid = h.pid(), error = %e, "cannot give a dumped process its CPU set back");
                    left.push(h);
                }
            }
            // What it started between CRIU's resume and now (a thread, a child) took the pin;
            // after its own set is back, so that what it starts from now on does not.
            if let Some(since) = self.since {
                h.unpin_inherited(&one, kept, since);
            }
        }
        self.record.given_back(&returned, &left);
    }
}
