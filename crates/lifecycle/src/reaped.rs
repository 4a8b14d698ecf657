//! Whether a dumped tree's pids are free again: a process that has exited keeps its pid until its
//! parent reaps it (a supervisor, a container shim, an init that reaps late), and CRIU restores
//! every process with its original pid.
//!
//! # Design
//! [`wait_reaped`] asks who holds the pids ([`cryo_proc::pid_holders`]) until they are free, for
//! as long as only zombies hold them (bounded): a zombie frees its pid as soon as it is reaped,
//! a live process does not. What still holds them afterwards is returned, each holder named
//! (a zombie names the parent that has not reaped it), so freeze says "gone" only when the pids
//! are free and thaw tells a zombie from a live original.

use std::time::{Duration, Instant};

use cryo_proc::{Pid, PidHolder};

/// How long freeze and thaw wait for the zombies holding an image's pids to be reaped.
pub const REAP_WAIT: Duration = Duration::from_secs(5);

/// Waits up to `timeout` while only zombies hold pids that `taken` reports in use; returns what
/// holds them at the end (empty: every pid is free). A live holder ends the wait at once.
pub fn wait_reaped(taken: impl Fn() -> Vec<Pid>, timeout: Duration) -> Vec<PidHolder> {
    let deadline = Instant::now() + timeout;
    loop {
        let busy = taken();
        if busy.is_empty() {
            return Vec::new();
        }
        let holders = cryo_proc::pid_holders(&busy);
        let waiting = holders.iter().all(PidHolder::is_zombie);
        if !waiting || Instant::now() >= deadline {
            if holders.is_empty() {
                // Taken by the seam's account but no holder could be named (freed meanwhile, or
                // held in a way /proc does not show): say the pid, not a guess.
                return busy
                    .into_iter()
                    .map(|pid| PidHolder::Live {
                        pid,
                        process: pid,
                        comm: String::new(),
                    })
                    .collect();
            }
            return holders;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// `holders` in one line.
pub fn describe(holders: &[PidHolder]) -> String {
    holders
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use std::process::Command;

    /// A zombie's pid is waited for while it stays a zombie, and free once it is reaped; a live
    /// holder is reported at once.
    #[test]
    fn zombies_are_waited_for_and_live_holders_are_not() {
        let mut live = Command::new("sleep").arg("30").spawn().unwrap();
        let pid = live.id() as Pid;
        let t = Instant::now();
        let held = wait_reaped(|| cryo_proc::pids_in_use(&[pid]), Duration::from_secs(30));
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "waited on a live holder"
        );
        assert!(matches!(held[..], [PidHolder::Live { .. }]), "{held:?}");
        live.kill().unwrap();
        // The kill lands when the kernel gets to it, not when kill(2) returns (seen live right
        // after it on a loaded host): its end is waited for first, leaving it a zombie.
        rustix::process::waitid(
            rustix::process::WaitId::Pid(rustix::process::Pid::from_raw(pid).unwrap()),
            rustix::process::WaitidOptions::EXITED | rustix::process::WaitidOptions::NOWAIT,
        )
        .unwrap();
        // A zombie of ours: named with us as the parent that has not reaped it.
        let held = wait_reaped(
            || cryo_proc::pids_in_use(&[pid]),
            Duration::from_millis(200),
        );
        let me = Pid::try_from(std::process::id()).unwrap();
        assert!(
            matches!(held[..], [PidHolder::Zombie { parent, .. }] if parent == me),
            "{held:?}"
        );
        // Reaped while waited for: free.
        let reaper = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            live.wait().unwrap();
        });
        let held = wait_reaped(|| cryo_proc::pids_in_use(&[pid]), Duration::from_secs(30));
        assert!(held.is_empty(), "{held:?}");
        reaper.join().unwrap();
    }
}
