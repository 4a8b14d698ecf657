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
//! CRIU is pinned to the same CPU as soon as it is spawned. After CRIU exited, every process
//! still alive (a failed dump resumed it, or `leave_running`) gets its CPU set back. The dumped
//! processes are frozen by CRIU for all of the dump but the few milliseconds before its seize,
//! so they lose nothing; a process pinned and not restored (cryo killed during the dump) runs
//! on one CPU until it sets its own affinity again: slower, never wrong.
//!
//! # Limitations
//! Main threads only (where CRIU runs its parasite); a process forked after the pinning runs
//! where the scheduler puts it. Affinity takes a pid: each call is checked against the
//! process's pidfd afterwards (see [`cryo_proc::ProcHandle::set_affinity`]). Nothing is pinned
//! when no CPU is allowed to both cryo and the tree's root.

use cryo_proc::{Pid, ProcHandle};
use nix::sched::CpuSet;

/// The tree's main threads pinned to [`Colocated::cpu`], with the CPU sets they had.
#[derive(Debug)]
pub(crate) struct Colocated {
    cpu: Option<usize>,
    pinned: Vec<(ProcHandle, CpuSet)>,
}

impl Colocated {
    /// Pins the main thread of `root` and of each of its descendants to one CPU both this
    /// process and `root` may run on. Best effort: what cannot be pinned is left alone.
    pub(crate) fn pin_tree(root: Pid) -> Colocated {
        let mut c = Colocated {
            cpu: None,
            pinned: Vec::new(),
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
        c.cpu = Some(cpu);
        let descendants = root.descendants();
        for h in std::iter::once(root).chain(descendants) {
            let Ok(kept) = h.affinity() else { continue };
            match h.set_affinity(&one) {
                Ok(()) => c.pinned.push((h, kept)),
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

impl Drop for Colocated {
    /// Gives every pinned process still alive its CPU set back.
    fn drop(&mut self) {
        for (h, kept) in self.pinned.drain(..) {
            if !h.is_alive() {
                continue;
            }
            if let Err(e) = h.set_affinity(&kept) {
                tracing::warn!(pid = h.pid(), error = %e, "cannot give a dumped process its CPU set back");
            }
        }
    }
}
