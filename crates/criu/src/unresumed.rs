//! What a CRIU restore left when it ended (or was ended) before its gate, and its end.
//!
//! # Design
//! CRIU's restored tasks resume only after cryo's gate (the `post-restore` stage): before it,
//! none of them ran the image's code, so none holds a live GPU context (the image's contexts are
//! CHECKPOINTED) and SIGKILL is their safe end. What CRIU restored is found by the kernel's
//! evidence, never by the image's pids: a tree that had a pid namespace of its own (a
//! container, `cryo run`) comes back under host pids the image does not name, and by then a
//! host process may hold one of the image's pids. The evidence ([`end_run`]):
//! - while CRIU lives, the root it restored is its tracee: CRIU forks the root as its caller's
//!   child (`--restore-sibling`) and seizes it with ptrace at once;
//! - a caller that outlived CRIU finds that root among its own thread's children (the thread
//!   that spawned CRIU is the root's parent);
//! - CRIU's own children, and every process that runs CRIU's binary and whose command line
//!   still names the run's private directory (CRIU's forks until its restorer replaces their
//!   memory; not an operator's `tail` of the run's log, which names it too);
//! - and every descendant of those.
//!
//! Each is held by a pidfd, must have started after CRIU, and is never killed while it holds a
//! GPU driver fd (named instead).
//!
//! # Limitations
//! A root whose CRIU is gone (killed by someone else) and whose caller died too is found only
//! while it still runs CRIU's command line.

use std::path::Path;
use std::time::{Duration, Instant};

use cryo_proc::{Pid, ProcHandle, Signal};

/// What [`end_run`] ended.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct EndedRun {
    /// CRIU, if it still ran (killed).
    pub(crate) criu: Option<Pid>,
    /// Processes it had restored or forked (none ran the image's code), killed: host pid and
    /// start time, roots first.
    pub(crate) killed: Vec<(Pid, u64)>,
    /// Processes left, and why.
    pub(crate) left: Vec<String>,
}

/// A restore run: its private directory, CRIU's binary and start time.
#[derive(Debug)]
pub(crate) struct Run<'a> {
    /// The run's private directory (CRIU's arguments name it).
    pub(crate) private: &'a Path,
    /// CRIU's binary, as its processes' `/proc/PID/exe` names it; `None`: not recorded (a
    /// record of an older cryo), then a command line naming the directory is all there is.
    pub(crate) bin: Option<&'a Path>,
    /// CRIU's start time: nothing that started before it is touched.
    pub(crate) criu_start: u64,
    /// CRIU's pid, when it may still be there (killed by [`end_run`], or given up on after its
    /// kill and waited for by the deadline layer): with `criu_start`, what tells CRIU from the
    /// forks of it that the evidence finds, so that it is never killed and waited for again as
    /// one of what it restored.
    pub(crate) criu: Option<Pid>,
}

impl Run<'_> {
    /// Whether `h` runs CRIU's binary (a fork of CRIU's), as far as the record tells.
    fn runs_criu(&self, h: &ProcHandle) -> bool {
        self.bin
            .is_none_or(|bin| h.exe().is_ok_and(|exe| exe == bin))
    }
}

/// Ends a restore run that did not pass its gate: CRIU (`criu`, if it still runs: killed
/// first, it would restore further) and everything it restored or forked, by the evidence the
/// module docs list; `roots` are processes the caller knows CRIU restored (its own thread's
/// children born after CRIU), `run` the run (its directory, CRIU's binary and start time).
pub(crate) fn end_run(
    criu: Option<ProcHandle>,
    mut roots: Vec<ProcHandle>,
    run: &Run<'_>,
) -> EndedRun {
    let (private, criu_start) = (run.private, run.criu_start);
    let mut ended = EndedRun::default();
    if let Some(c) = criu.filter(ProcHandle::is_alive) {
        // Looked at before CRIU dies: its tracee (the root) is detached then.
        roots.extend(c.tracees().unwrap_or_default());
        roots.extend(c.children().unwrap_or_default());
        if c.signal(Signal::SIGKILL).is_ok() {
            c.wait_exit(Duration::from_secs(5));
            ended.criu = Some(c.pid());
        }
    }
    let started = |h: &ProcHandle| h.start_time() >= criu_start;
    let is_criu = |h: &ProcHandle| Some(h.pid()) == run.criu && h.start_time() == criu_start;
    let mut killed: Vec<ProcHandle> = Vec::new();
    // Bounded: one may fork between a look and its kill (a killed process forks nothing more,
    // and is gone from the next look); a process left (a driver fd) is named by each look.
    for _ in 0..8 {
        let mut found: Vec<ProcHandle> = Vec::new();
        match cryo_proc::naming(private) {
            Ok(pids) => found.extend(
                pids.into_iter()
                    .filter_map(|p| ProcHandle::open(p).ok())
                    .filter(|h| run.runs_criu(h)),
            ),
            Err(e) => ended
                .left
                .push(format!("cannot look for what CRIU left: {e}")),
        }
        for r in &roots {
            if let Ok(r) = r.try_clone() {
                found.push(r);
            }
        }
        let mut all: Vec<ProcHandle> = Vec::new();
        for h in found
            .into_iter()
            .filter(|h| h.is_alive() && started(h) && !is_criu(h))
        {
            let below = h.descendants();
            all.push(h);
            all.extend(below.into_iter().filter(started));
        }
        all.retain(|h| !killed.iter().any(|k| same(k, h)));
        let mut unique: Vec<ProcHandle> = Vec::new();
        for h in all {
            if !unique.iter().any(|u| same(u, &h)) {
                unique.push(h);
            }
        }
        let (k, left) = kill_unresumed(unique);
        let done = k.is_empty();
        killed.extend(k);
        if done {
            ended.left.extend(left);
            break;
        }
    }
    // Gone, not dying: whoever looks next sees at most zombies. One grace for them all: a
    // process stuck where no signal reaches it (its memory's image on a file system that does
    // not answer) costs the caller that grace once, not once each.
    let until = Instant::now() + crate::KILLED_GRACE;
    let stuck: Vec<&ProcHandle> = killed
        .iter()
        .filter(|h| !h.wait_exit(until.saturating_duration_since(Instant::now())))
        .collect();
    ended.left.extend(give_up_on(&stuck));
    ended.killed = killed.iter().map(|h| (h.pid(), h.start_time())).collect();
    ended
}

/// Names each of `stuck` (killed, not exited within [`crate::KILLED_GRACE`]: its SIGKILL is
/// pending, it never runs its own code again) and hands those that are this process's children
/// to the deadline layer, which reaps each when its wait ends ([`crate::criu::reap_stuck_later`]):
/// a zombie of ours would keep its pid (an image's pid) taken for good.
fn give_up_on(stuck: &[&ProcHandle]) -> Vec<String> {
    use rustix::process::{waitid, WaitId, WaitidOptions};
    let grace = crate::KILLED_GRACE.as_secs();
    let mut said = Vec::new();
    let mut ours = Vec::new();
    for h in stuck {
        let pid = h.pid();
        let state = cryo_proc::stat(pid).map_or('?', |s| s.state);
        let wchan = cryo_proc::wchan(pid).unwrap_or_default();
        let first = format!(
            "pid {pid}: killed, stuck in the kernel after {grace} s (state {state}, in {wchan})"
        );
        // Whether it is our child, by the kernel's answer for that very process (not its pid),
        // taking nothing.
        match waitid(
            WaitId::PidFd(h.pidfd()),
            WaitidOptions::EXITED | WaitidOptions::NOHANG | WaitidOptions::NOWAIT,
        ) {
            // Ended just now: reaped with the rest (`reap_children_since`).
            Ok(Some(_)) => {}
            Ok(None) => match h.try_clone() {
                Ok(c) => {
                    ours.push(c);
                    said.push(format!("{first}; reaped when its wait ends"));
                }
                Err(e) => said.push(format!(
                    "{first}; cannot hold it ({e}): it stays a zombie once it exits"
                )),
            },
            // Not our child: its parent reaps it.
            Err(_) => said.push(format!("{first}; it ends when its wait does")),
        }
    }
    if !ours.is_empty() && !crate::criu::reap_stuck_later(ours) {
        said.push(
            "no thread could take the stuck processes: each stays a zombie once it exits".into(),
        );
    }
    said
}

/// The same process (pid and start time).
fn same(a: &ProcHandle, b: &ProcHandle) -> bool {
    a.pid() == b.pid() && a.start_time() == b.start_time()
}

/// SIGKILLs each of `procs` that holds no GPU driver fd; returns those killed and those left,
/// and why.
fn kill_unresumed(procs: Vec<ProcHandle>) -> (Vec<ProcHandle>, Vec<String>) {
    let (mut killed, mut left) = (Vec::new(), Vec::new());
    for h in procs {
        let pid = h.pid();
        match h.driver_fds(cryo_proc::DriverFiles::Nvidia) {
            Ok(fds) if fds.is_empty() => match h.signal(Signal::SIGKILL) {
                Ok(()) => killed.push(h),
                Err(e) => left.push(format!("pid {pid}: cannot kill it: {e}")),
            },
            Ok(fds) => left.push(format!(
                "pid {pid}: holds GPU driver fds {fds:?}, left alone"
            )),
            // Exited meanwhile: nothing to end.
            Err(_) if !h.is_alive() => {}
            Err(e) => left.push(format!("pid {pid}: cannot read its fds ({e}), left alone")),
        }
    }
    (killed, left)
}

/// This thread's children that started at or after `since` (CRIU's start): what CRIU restored
/// as its caller's child (`--restore-sibling`) when this thread spawned CRIU.
pub(crate) fn thread_children_since(since: u64) -> Vec<ProcHandle> {
    cryo_proc::thread_children()
        .unwrap_or_default()
        .into_iter()
        .filter_map(|p| ProcHandle::open(p).ok())
        .filter(|h| h.start_time() >= since)
        .collect()
}

/// Reaps this thread's children that started at or after `since` (CRIU's start) and have
/// exited: what CRIU restored as our child and then killed, or what [`end_run`] killed and
/// waited for (a zombie holds its pid until reaped; one stuck past the grace is reaped by the
/// deadline layer when it exits). `except` (a CRIU given up on, whose waiter reaps it) is left
/// alone. Never waits.
pub(crate) fn reap_children_since(since: u64, except: Option<Pid>) {
    // Our children: each pid names its child until we reap it (a zombie too, which no pidfd
    // opens any more). One a thread of this process traces (the agent's guard) is its tracer's.
    for pid in cryo_proc::thread_children().unwrap_or_default() {
        if Some(pid) == except || !cryo_proc::stat(pid).is_ok_and(|s| s.start_time >= since) {
            continue;
        }
        if let Err(err) = cryo_proc::reap_child(pid) {
            tracing::warn!(pid, %err, "cannot reap a restored process that was ended");
        }
    }
}
