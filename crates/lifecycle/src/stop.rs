//! `cryo stop`: suspend-before-kill for every CUDA process of a target, verified through NVML.
//!
//! # Design
//! 0. Every process of the target is locked against parks, wakes and other stops
//!    ([`crate::oplock`]), held until the stop returns: one held already refuses the stop at
//!    once ([`StopError::InProgress`]), nothing journaled, suspended or killed (a preStop's stop,
//!    [`stop_when_free`], tries again while a park or a wake holds it, within half its
//!    deadline: the kubelet kills the container when the preStop returns). Then
//!    suspensions that earlier stops, freezes or guards left half-way (their owner gone) are
//!    settled ([`crate::inflight`]); the report says what was done.
//! 1. The target (a process tree, a cgroup subtree, or a list of pids) comes resolved to pidfd
//!    handles ([`crate::target`]): the caller resolved it once, before any question to a driver.
//! 2. Each process is looked at ([`crate::runnable`], [`crate::cuda`]): one stopped by job
//!    control is resumed with SIGCONT (journaled: the stop ends it anyway), one stopped under a
//!    debugger (or held by CRIU) is refused at once unless nothing of it is on a GPU *and* the
//!    driver answers, within [`HELD_QUERY`], that it holds no CUDA state (a CHECKPOINTED process
//!    so held has nothing on a GPU either, and its holder may restore it: a state or no answer
//!    is a refusal naming the tracer, never a kill as plain); then who is a CUDA process is
//!    decided from the driver's answer and the evidence (NVML, driver files). Evidence that
//!    contradicts the driver, or no answer, is a refusal.
//! 3. Suspend every CUDA process ([`crate::suspend`]): lock in parallel, checkpoint in parallel,
//!    verify. With `fresh`, a process that cannot be suspended and that the journal does not know
//!    as restored is killed without suspension instead of refusing the stop.
//! 4. A cgroup target is listed again, a tree target walked again (its descendants and the
//!    members of the sessions it leads: `forks`); processes that joined (that it forked)
//!    meanwhile are locked as in 0 (one held is a refusal) and go through 2 and 3, until the
//!    set is stable (bounded; a set that keeps changing
//!    is refused, nothing killed).
//! 5. The last look, before the first kill: every CUDA process is CHECKPOINTED, holds no driver
//!    files, and NVML lists nothing for it; every other process holds no context either. Anything
//!    else, or an error on that look, is a refusal, and nothing is killed.
//! 6. End the CUDA processes, then the others, each CUDA process looked at once more right
//!    before its own kill: a refusal there ends the kill phase at once. No wake can restore it
//!    between that look and its signal: the stop holds its lock (0). Every exit is confirmed
//!    through its pidfd, and NVML must attribute no memory to them afterwards. A cgroup is listed
//!    (a tree walked) once more: processes that joined (were forked) during the kills go
//!    through the same steps.
//!
//! Every driver call runs under a caller-side deadline, and the whole stop under
//! [`StopOptions::deadline`] (by default below Kubernetes' default grace period of 30 s): lock
//! attempts get what the checkpoint and the verification leave. A call that does not return is a
//! refusal, never a hang.
//!
//! A process whose origin is unknown is treated as restored. If any CUDA process cannot be
//! suspended, nothing in the target is killed ([`StopReport::refusals`]), unless the operator asked
//! for `unsafe_kill`. A stop that died half-way is finished by the next stop (step 0).

use std::time::{Duration, Instant};

use cryo_gpu::{Gpu, Limits, ProcessState};
use cryo_journal::{Event, Journal, Origin, Origins};
use cryo_proc::{Pid, ProcError, ProcHandle, Signal};

use crate::cuda::{classify, Class};
use crate::failpoint;
use crate::inflight::{SettleError, Settled};
use crate::progress::Progress;
use crate::runnable::{resume, runnable, Runnable};
use crate::suspend::{id, suspend, SuspendFailure, SuspendOptions, Suspended};
use crate::target::{Resolved, Target};

/// How to end the processes once suspended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndSignal {
    /// SIGKILL at once. The default: a checkpointed process cannot make CUDA calls, so a SIGTERM
    /// handler that touches the GPU would hang.
    Kill,
    /// SIGTERM, then SIGKILL after the grace period.
    Term {
        /// How long to wait for the process to exit on its own.
        grace: Duration,
    },
}

/// The default overall deadline of a stop: below Kubernetes' default grace period (30 s), with
/// room for the kubelet's own steps.
pub const DEFAULT_DEADLINE: Duration = Duration::from_secs(25);

/// Failpoint (`CRYO_FAILPOINT`, a test hook; a pause, see `failpoint::pause_if`): a stop pauses
/// in its kill phase once a CUDA process was read CHECKPOINTED right before its kill, before its
/// signal (where a wake of the same worker would find it still CHECKPOINTED).
pub const STOP_KILL_AFTER_LOOK: &str = "stop-kill-after-look";

/// Options of a stop.
#[derive(Debug, Clone)]
pub struct StopOptions {
    /// How to suspend.
    pub suspend: SuspendOptions,
    /// How to end.
    pub signal: EndSignal,
    /// Kill even what could not be suspended (the host-wedging path on affected hosts).
    pub unsafe_kill: bool,
    /// The operator declares the processes were never restored: a process that cannot be
    /// suspended and that the journal does not know as restored is killed without suspension.
    pub fresh: bool,
    /// How long to wait for a killed process to exit.
    pub exit_timeout: Duration,
    /// The whole stop's deadline (lock attempts, checkpoint, verification, kills); `None`: none.
    pub deadline: Option<Duration>,
    /// Ask the engine to release what it can rebuild before anything is locked (at most half of
    /// what is left of the deadline: the other half is the suspension of all of its memory when
    /// the engine does not shrink).
    pub shrink: Option<crate::shrink::Shrink>,
}

impl Default for StopOptions {
    fn default() -> Self {
        StopOptions {
            suspend: SuspendOptions::default(),
            signal: EndSignal::Kill,
            unsafe_kill: false,
            fresh: false,
            exit_timeout: Duration::from_secs(10),
            deadline: Some(DEFAULT_DEADLINE),
            shrink: None,
        }
    }
}

/// A CUDA process that could not be suspended.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct Refusal {
    /// The process.
    pub pid: Pid,
    /// Why.
    pub reason: RefusalReason,
    /// What the operator can do.
    pub hint: String,
}

/// Why a process could not be suspended.
pub type RefusalReason = SuspendFailure;

/// One process of the target.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct ProcReport {
    /// The process.
    pub pid: Pid,
    /// Its command name.
    pub comm: String,
    /// Whether it holds (or held) a CUDA context.
    pub cuda: bool,
    /// Whether cryo knows it came from a restore (`None`: unknown, treated as restored).
    pub restored: Option<bool>,
    /// The suspension, when it was suspended.
    pub suspended: Option<Suspended>,
    /// Whether it has exited by the end of the stop.
    pub ended: bool,
    /// What else the stop found or did (`resumed from a job-control stop`, `joined the cgroup
    /// during the stop`, `opened the driver but holds no context`...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub notes: Vec<String>,
}

/// The result of a stop. Refusals are results, not errors.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct StopReport {
    /// Every process of the target.
    pub processes: Vec<ProcReport>,
    /// CUDA processes that could not be suspended (then nothing was killed, unless unsafe).
    pub refusals: Vec<Refusal>,
    /// Whether processes were killed without suspension (`unsafe_kill` or `fresh`).
    pub unsafe_kills: Vec<Pid>,
    /// Suspensions of earlier runs that died half-way, settled before this stop.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settled: Vec<Settled>,
    /// Wall time of the whole stop.
    pub elapsed_ms: u64,
    /// The engine's shrink before the suspension, if one was asked for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shrink: Option<crate::shrink::ShrinkReport>,
}

impl StopReport {
    /// Whether every process of the target has ended.
    pub fn stopped(&self) -> bool {
        self.refusals.is_empty() && self.processes.iter().all(|p| p.ended)
    }

    /// The processes a tree target forked during the stop, found by its later looks.
    pub fn forked(&self) -> Vec<Pid> {
        self.processes
            .iter()
            .filter(|p| p.notes.iter().any(|n| n.starts_with(FORKED)))
            .map(|p| p.pid)
            .collect()
    }
}

/// The stop could not be carried out at all (nothing was killed).
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// A process could not be signalled.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// The journal could not be written before acting.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    JournalRead(#[from] cryo_journal::ReadError),
    /// Earlier in-flight suspensions could not be settled.
    #[error("settling earlier stops: {0}")]
    Settle(#[from] SettleError),
    /// The inspection API (NVML) could not list processes.
    #[error("cannot list GPU processes: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
    /// A park or a wake (or another stop) is at work on a process of the target: it holds the
    /// process's lock ([`crate::oplock`]). Nothing was read, journaled, suspended or killed by
    /// this stop.
    #[error("pid {pid} is being {} by {}: left to it; nothing was stopped", crate::park::fmt_doing(*.doing), crate::park::fmt_by(*.by))]
    InProgress {
        /// The process.
        pid: Pid,
        /// The cryo process at work on it, when known.
        by: Option<Pid>,
        /// What that one does, when known.
        doing: Option<crate::Op>,
    },
    /// A process's lock could not be taken (its file could not be created, opened or locked);
    /// nothing was suspended or killed.
    #[error("cannot take the stop's lock: {0}")]
    Lock(String),
    /// A process did not exit after SIGKILL.
    #[error("pid {0} did not exit after SIGKILL")]
    NotExited(Pid),
    /// NVML still lists memory for a process that has exited.
    #[error("pid {pid} has exited but NVML still attributes {bytes} bytes to it: its driver files are held elsewhere")]
    MemoryAfterExit {
        /// The process.
        pid: Pid,
        /// Bytes listed.
        bytes: u64,
    },
}

impl StopError {
    /// A stop's lock that could not be taken.
    fn from_lock(e: crate::oplock::LockError) -> Self {
        match e {
            crate::oplock::LockError::Held { pid, by, doing } => {
                StopError::InProgress { pid, by, doing }
            }
            e => StopError::Lock(e.to_string()),
        }
    }
}

/// How many times a cgroup is listed again for processes that joined it during the stop.
const JOIN_ROUNDS: usize = 8;

/// How long a verified-suspended process the driver no longer answers for is given to finish
/// exiting before that counts as a refusal. A process closes its files (and so its driver
/// state) before it becomes a zombie: a rank that ends itself when its launcher is killed
/// (as ranks of a real server do) is caught in between. Its context was verified
/// CHECKPOINTED, so its own end is safe.
const ENDING_GRACE: Duration = Duration::from_secs(1);

/// How long the driver is given to say that a process stopped under a debugger (or held by
/// CRIU) holds no CUDA state: it answers that without the process's restore thread, and gets
/// no answer for a CUDA process whose restore thread cannot run.
const HELD_QUERY: Duration = Duration::from_secs(2);

/// One process of the stop.
struct Member {
    h: ProcHandle,
    class: Option<Class>,
    report: ProcReport,
    /// Killed without suspension (`--unsafe`, `--fresh`).
    unsuspended: bool,
}

impl Member {
    fn is_cuda(&self) -> bool {
        self.class.as_ref().is_some_and(Class::is_cuda)
    }
}

/// What a stop carries from step to step.
struct Run<'a> {
    gpu: &'a Gpu,
    opts: &'a StopOptions,
    journal: &'a Journal,
    progress: &'a dyn Progress,
    origins: Origins,
    until: Option<Instant>,
    members: Vec<Member>,
    refusals: Vec<Refusal>,
}

/// [`stop`] for a caller that must not give up at once: a preStop hook, after which the kubelet
/// kills the container whether or not it is suspended. A stop refused because a park, a wake or
/// a settlement (or an unnamed restorer) is at work on a process of the target ([`StopError::InProgress`]:
/// nothing done, so trying again is safe) is tried again every 50 ms until that one returns, for
/// at most half of `opts.deadline` (the other half is the stop's own, and each try gets what is
/// left of the deadline); without a deadline, or against a freeze or another stop (the worker is
/// going away), it is not tried again. Refused at once, a preStop left a worker that a wake was
/// bringing back to the kubelet's kill, running and restored, unsuspended.
pub fn stop_when_free(
    gpu: &Gpu,
    target: &Resolved,
    opts: &StopOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> Result<StopReport, StopError> {
    let start = Instant::now();
    let wait = opts.deadline.map_or(Duration::ZERO, |d| d / 2);
    let mut said = false;
    loop {
        let left = StopOptions {
            deadline: opts.deadline.map(|d| d.saturating_sub(start.elapsed())),
            ..opts.clone()
        };
        match stop(gpu, target, &left, journal, progress) {
            Err(StopError::InProgress {
                pid,
                by,
                doing: doing @ (None | Some(crate::Op::Wake | crate::Op::Park | crate::Op::Settle)),
            }) if start.elapsed() + crate::BUSY_RETRY < wait => {
                if !said {
                    said = true;
                    tracing::warn!(
                        "pid {pid} is being {} by {}: the stop waits for it to return (at most {} ms)",
                        crate::park::fmt_doing(doing),
                        crate::park::fmt_by(by),
                        wait.as_millis()
                    );
                }
                std::thread::sleep(crate::BUSY_RETRY);
            }
            r => return r,
        }
    }
}

/// Stops `target`. See the module docs for the order of things and what a refusal leaves behind.
pub fn stop(
    gpu: &Gpu,
    target: &Resolved,
    opts: &StopOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> Result<StopReport, StopError> {
    let start = Instant::now();
    let until = opts.deadline.map(|d| start + d);
    let gpu = &gpu.bounded(until.map_or(Limits::default(), |u| Limits::default().until(u)));
    let described = target.target().to_string();
    // One operation at a time per process, held from before the first look at a process until
    // after its kill: a park or a wake at work refuses this stop before it reads, journals or
    // suspends anything; a wake meeting this stop is refused the same way, so nothing this
    // stop verified CHECKPOINTED is restored under it before its kill.
    let state = crate::oplock::state_of(journal);
    let mut locks = crate::oplock::take(&state, target.handles(), crate::Op::Stop)
        .map_err(StopError::from_lock)?;
    journal.append(Event::StopRequested {
        target: described.clone(),
    })?;
    // No guard to trace what it would resume: a dead freeze's worker stays suspended (safe).
    // What this stop holds is not taken again by the settlement's kills.
    let settled = crate::inflight::settle_in_flight_holding(gpu, journal, None, Some(&locks))?;
    // Before anything is locked: a shrink that does not happen leaves the engine whole.
    let budget = opts
        .shrink
        .as_ref()
        .map_or(Duration::ZERO, |s| match until {
            Some(u) => s
                .timeout()
                .min(u.saturating_duration_since(Instant::now()) / 2),
            None => s.timeout(),
        });
    let shrunk = crate::shrink::release(
        gpu,
        opts.shrink.as_ref(),
        &described,
        target.handles(),
        budget,
        journal,
        progress,
    )?;
    let origins = Origins::from_records(&cryo_journal::read(journal.dir())?.records);
    let mut run = Run {
        gpu,
        opts,
        journal,
        progress,
        origins,
        until,
        members: Vec::new(),
        refusals: Vec::new(),
    };
    for h in target.handles() {
        run.add(h.try_clone()?);
    }
    // A tree is taken as a whole: what it forks during the stop is looked for again (its
    // descendants, the members of the sessions it leads), as a cgroup is listed again.
    let sessions = match target.target() {
        Target::Tree(_) => crate::forks::own_sessions(target.handles()),
        _ => Vec::new(),
    };

    let mut from = 0;
    let mut round = 0;
    let outcome = loop {
        run.prepare(from)?;
        run.suspend_new(from)?;
        if run.blocked() {
            break Outcome::Refused;
        }
        // A cgroup (a tree) is taken as a whole: processes that joined it (that it forked)
        // meanwhile go through the same.
        let joined = run.joiners(target, &sessions, round)?;
        if !run.lock_joined(&state, &mut locks, &joined)? {
            break Outcome::Refused;
        }
        if !joined.is_empty() {
            from = run.add_joined(joined, joined_note(target, "during the stop"));
            round += 1;
            continue;
        }
        failpoint::pause_if(failpoint::STOP_BEFORE_KILL);
        if !run.last_look()? {
            break Outcome::Refused;
        }
        if !run.kill_all()? {
            break Outcome::Refused;
        }
        let joined = run.joiners(target, &sessions, round)?;
        if !run.lock_joined(&state, &mut locks, &joined)? {
            break Outcome::Refused;
        }
        if joined.is_empty() {
            break Outcome::Ended;
        }
        from = run.add_joined(joined, joined_note(target, "during the kills"));
        round += 1;
    };

    if outcome == Outcome::Ended {
        run.verify_released()?;
    }
    for m in &mut run.members {
        m.report.ended = !m.h.is_alive();
    }
    if outcome == Outcome::Refused {
        // What this refused stop checkpointed stays so, on purpose: it is not in flight.
        for m in run.members.iter().filter(|m| m.h.is_alive()) {
            if m.report.suspended.is_some() && !run.refusals.iter().any(|r| r.pid == m.h.pid()) {
                journal.append(Event::SuspensionSettled {
                    pid: id(&m.h),
                    found: ProcessState::Checkpointed.to_string(),
                    action: "left checkpointed: the stop was refused".into(),
                })?;
            }
        }
    }
    let ids = |f: &dyn Fn(&Member) -> bool| -> Vec<cryo_journal::ProcId> {
        run.members
            .iter()
            .filter(|m| f(m))
            .map(|m| id(&m.h))
            .collect()
    };
    journal.append(Event::StopCompleted {
        target: described,
        killed: ids(&|m| !m.h.is_alive()),
        ms: elapsed_ms(start),
        refused: ids(&|m| run.refusals.iter().any(|r| r.pid == m.h.pid())),
    })?;
    Ok(StopReport {
        unsafe_kills: run
            .members
            .iter()
            .filter(|m| m.unsuspended)
            .map(|m| m.h.pid())
            .collect(),
        processes: run.members.into_iter().map(|m| m.report).collect(),
        refusals: run.refusals,
        settled,
        elapsed_ms: elapsed_ms(start),
        shrink: shrunk.map(|s| s.report),
    })
}

/// What a process found by a later look at the target is noted as (`when`: `during the
/// stop`): it joined the cgroup, or the tree forked it.
fn joined_note(target: &Resolved, when: &str) -> String {
    match target.target() {
        Target::Tree(_) => format!("{FORKED} {when}"),
        _ => format!("joined the cgroup {when}"),
    }
}

/// The start of the note of a process a tree forked during its stop ([`StopReport::forked`]).
const FORKED: &str = "forked by the tree";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Ended,
    Refused,
}

impl Run<'_> {
    fn origin(&self, h: &ProcHandle) -> Option<bool> {
        match self.origins.of(&id(h)) {
            Origin::Restored { .. } => Some(true),
            Origin::Fresh => Some(false),
            Origin::Unknown => None,
        }
    }

    fn add(&mut self, h: ProcHandle) {
        let report = ProcReport {
            pid: h.pid(),
            comm: h.comm().to_string(),
            cuda: false,
            restored: self.origin(&h),
            suspended: None,
            ended: false,
            notes: Vec::new(),
        };
        self.members.push(Member {
            h,
            class: None,
            report,
            unsuspended: false,
        });
    }

    /// Adds processes that joined a cgroup target (that a tree forked), noted as such; returns
    /// the index of the first.
    fn add_joined(&mut self, joined: Vec<ProcHandle>, note: String) -> usize {
        let from = self.members.len();
        for h in joined {
            self.add(h);
            if let Some(m) = self.members.last_mut() {
                m.report.notes.push(note.clone());
            }
        }
        from
    }

    fn left(&self) -> Option<Duration> {
        self.until
            .map(|u| u.saturating_duration_since(Instant::now()))
    }

    /// Journals and records a refusal of `h`.
    fn refuse(&mut self, h: &ProcHandle, reason: SuspendFailure) -> Result<(), StopError> {
        let hint = reason.hint().to_string();
        self.journal.append(Event::Refused {
            pid: id(h),
            reason: reason.reason(),
            hint: hint.clone(),
        })?;
        self.refusals.push(Refusal {
            pid: h.pid(),
            reason,
            hint,
        });
        Ok(())
    }

    /// Step 2 for `members[from..]`: stopped processes, then who is a CUDA process.
    fn prepare(&mut self, from: usize) -> Result<(), StopError> {
        let listed = self.gpu.inspect.processes()?;
        let settle = self
            .left()
            .map_or(crate::cuda::SETTLE, |l| l.min(crate::cuda::SETTLE));
        for i in from..self.members.len() {
            let h = self.members[i].h.try_clone()?;
            let pid = h.pid();
            let r = match runnable(&h) {
                Ok(r) => r,
                Err(_) if !h.is_alive() => Runnable::Exited,
                Err(e) => return Err(e.into()),
            };
            let class = match r {
                Runnable::Exited => Ok(Class::Exited),
                Runnable::Runs => classify(self.gpu, &h, &listed, settle),
                Runnable::JobControl => {
                    self.journal.append(Event::Continued { pid: id(&h) })?;
                    match resume(&h, Duration::from_secs(2))? {
                        Runnable::Runs => {
                            self.members[i]
                                .report
                                .notes
                                .push("was stopped (job control): resumed with SIGCONT".into());
                            classify(self.gpu, &h, &listed, settle)
                        }
                        Runnable::Exited => Ok(Class::Exited),
                        still => {
                            self.refuse(
                                &h,
                                SuspendFailure::NotRunnable {
                                    runnable: still,
                                    pid,
                                },
                            )?;
                            continue;
                        }
                    }
                }
                Runnable::Debugger { .. } => {
                    // Nothing but its tracer can resume it. With a trace of it on a GPU it is
                    // refused at once. Without one it may still be a CUDA process its tracer
                    // holds CHECKPOINTED (CRIU at its dump gate, with its cuda plugin able to
                    // restore it): only the driver's word that it holds no CUDA state, asked
                    // under a short deadline, makes it plain; a state or no answer is a refusal.
                    let fds = self
                        .gpu
                        .inspect
                        .driver_fds(pid)
                        .unwrap_or_else(|_| vec![-1]);
                    let held = self.gpu.bounded(Limits {
                        query: HELD_QUERY,
                        ..Limits::default()
                    });
                    let class = if fds.is_empty() && !listed.iter().any(|p| p.pid == pid) {
                        classify(&held, &h, &listed, HELD_QUERY)
                    } else {
                        Ok(Class::Cuda {
                            state: ProcessState::Running,
                        })
                    };
                    match class {
                        Ok(Class::Plain) => {
                            self.members[i].report.notes.push(
                                "stopped under a debugger, but holds no driver file and the driver knows no CUDA state of it"
                                    .into(),
                            );
                            Ok(Class::Plain)
                        }
                        Ok(Class::Exited) => Ok(Class::Exited),
                        Ok(Class::Cuda { .. } | Class::DriverOnly { .. }) | Err(_) => {
                            self.refuse(&h, SuspendFailure::NotRunnable { runnable: r, pid })?;
                            continue;
                        }
                    }
                }
            };
            match class {
                Ok(c) => {
                    if let Class::DriverOnly { fds } = &c {
                        self.members[i].report.notes.push(format!(
                            "opened the driver ({} driver files) but holds no CUDA context",
                            fds.len()
                        ));
                    }
                    self.members[i].report.cuda = c.is_cuda();
                    self.members[i].class = Some(c);
                }
                Err(u) => self.refuse(&h, SuspendFailure::Unclassified(u))?,
            }
        }
        Ok(())
    }

    /// Step 3 for the CUDA processes among `members[from..]`.
    fn suspend_new(&mut self, from: usize) -> Result<(), StopError> {
        let mut sopts = self.opts.suspend.clone();
        sopts.purpose = cryo_journal::Purpose::Stop;
        if let Some(u) = self.until {
            // Room for the kills and the checks after them.
            let total = self.opts.deadline.unwrap_or_default();
            sopts.until = Some(u - (total / 5).min(Duration::from_secs(2)));
        }
        let mut todo: Vec<usize> = (from..self.members.len())
            .filter(|&i| self.members[i].is_cuda())
            .collect();
        // Suspension is all or nothing: a process that leaves the target (it exits) or, with
        // `fresh`, one that is killed without suspension rolled the others back, and they are
        // suspended again without it (what was checkpointed stays checkpointed, so it is cheap).
        let rounds = todo.len() + 1;
        for round in 1..=rounds {
            if todo.is_empty() {
                break;
            }
            let handles: Vec<&ProcHandle> = todo.iter().map(|&i| &self.members[i].h).collect();
            let outcomes = suspend(
                self.gpu,
                &handles,
                &sopts,
                Some(self.journal),
                self.progress,
            );
            let mut retry = Vec::new();
            let mut refused = Vec::new();
            for o in &outcomes {
                let Some(&i) = todo.iter().find(|&&i| self.members[i].h.pid() == o.pid) else {
                    continue;
                };
                match &o.result {
                    Ok(_) => {}
                    Err(SuspendFailure::Exited) => retry.push((i, None)),
                    Err(f) if self.opts.fresh && self.members[i].report.restored != Some(true) => {
                        retry.push((i, Some(f.clone())))
                    }
                    Err(f) => refused.push((i, f.clone())),
                }
            }
            if refused.is_empty() && !retry.is_empty() && round < rounds {
                for (i, why) in retry {
                    let h = &self.members[i].h;
                    match why {
                        None => {
                            self.journal.append(Event::ProcessExited {
                                pid: id(h),
                                how: "exited on its own during the stop".into(),
                            })?;
                        }
                        Some(f) => {
                            // Declared never restored, and the journal agrees: tearing its
                            // context down is the ordinary, safe kind of exit.
                            self.journal.append(Event::FreshDeclared { pid: id(h) })?;
                            let m = &mut self.members[i];
                            m.unsuspended = true;
                            m.report.notes.push(format!(
                                "could not be suspended ({}); killed without suspension (--fresh)",
                                f.reason()
                            ));
                        }
                    }
                    todo.retain(|&t| t != i);
                }
                continue;
            }
            for o in outcomes {
                let Some(&i) = todo.iter().find(|&&i| self.members[i].h.pid() == o.pid) else {
                    continue;
                };
                match o.result {
                    Ok(s) => self.members[i].report.suspended = Some(s),
                    Err(SuspendFailure::Exited) => {}
                    Err(f) => {
                        let h = self.members[i].h.try_clone()?;
                        self.refuse(&h, f)?;
                    }
                }
            }
            break;
        }
        if self.opts.unsafe_kill {
            // Forced: the refusals stay journaled and reported, and the stop goes on to kill
            // them without suspension.
            for r in &self.refusals {
                if let Some(m) = self.members.iter_mut().find(|m| m.h.pid() == r.pid) {
                    m.unsuspended = true;
                }
            }
        }
        Ok(())
    }

    /// Whether a refusal stops the stop (one that `--unsafe` did not override).
    fn blocked(&self) -> bool {
        self.refusals.iter().any(|r| {
            !self
                .members
                .iter()
                .any(|m| m.h.pid() == r.pid && m.unsuspended)
        })
    }

    /// Processes that joined a cgroup target since it was listed (none for other targets).
    fn joiners(
        &mut self,
        target: &Resolved,
        sessions: &[(Pid, &ProcHandle)],
        round: usize,
    ) -> Result<Vec<ProcHandle>, StopError> {
        let out = match target.target() {
            Target::Cgroup(path) => self.cgroup_joiners(target, path)?,
            Target::Tree(_) => {
                let held: Vec<&ProcHandle> = self.members.iter().map(|m| &m.h).collect();
                let mut forked = crate::forks::forked_since(&held, sessions);
                forked.retain(|h| !target.spares(h.pid()));
                forked
            }
            Target::Pids(_) => return Ok(Vec::new()),
        };
        if !out.is_empty() && (round >= JOIN_ROUNDS || self.left() == Some(Duration::ZERO)) {
            // It does not settle: refuse rather than kill a set that keeps changing.
            let found = match target.target() {
                Target::Tree(_) => format!(
                    "processes still forked by the tree after {} looks",
                    round + 1
                ),
                _ => format!(
                    "processes still joining the cgroup after {} listings",
                    round + 1
                ),
            };
            for h in &out {
                self.refuse(
                    h,
                    SuspendFailure::LastLook {
                        found: found.clone(),
                    },
                )?;
            }
            return Ok(Vec::new());
        }
        Ok(out)
    }

    /// The processes of the cgroup `path` that are not members yet.
    fn cgroup_joiners(
        &mut self,
        target: &Resolved,
        path: &std::path::Path,
    ) -> Result<Vec<ProcHandle>, StopError> {
        let mut out = Vec::new();
        for pid in cryo_proc::cgroup_tree_procs(path)? {
            if target.spares(pid) {
                continue;
            }
            if self
                .members
                .iter()
                .any(|m| m.h.pid() == pid && m.h.is_alive())
            {
                continue;
            }
            match ProcHandle::open(pid) {
                Ok(h) => out.push(h),
                Err(ProcError::NoSuchProcess(_)) => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(out)
    }

    /// Takes the locks of the processes that joined the target (that it forked) during the
    /// stop, as the target's were at its start. `false`: one is held by a park, a wake or
    /// another stop, and is refused (the stop kills nothing more).
    fn lock_joined(
        &mut self,
        state: &cryo_state::StateDir,
        locks: &mut crate::oplock::OpLocks,
        joined: &[ProcHandle],
    ) -> Result<bool, StopError> {
        if joined.is_empty() {
            return Ok(true);
        }
        match crate::oplock::take(state, joined, crate::Op::Stop) {
            Ok(more) => {
                locks.extend(more);
                Ok(true)
            }
            Err(crate::oplock::LockError::Held { pid, by, doing }) => {
                if let Some(h) = joined.iter().find(|h| h.pid() == pid) {
                    let h = h.try_clone()?;
                    self.refuse(
                        &h,
                        SuspendFailure::LastLook {
                            found: format!(
                                "being {} by {}",
                                crate::park::fmt_doing(doing),
                                crate::park::fmt_by(by)
                            ),
                        },
                    )?;
                }
                Ok(false)
            }
            Err(e) => Err(StopError::Lock(e.to_string())),
        }
    }

    /// Step 5: the last look before the first kill. `false`: refused, nothing killed.
    fn last_look(&mut self) -> Result<bool, StopError> {
        let listed = match self.gpu.inspect.processes() {
            Ok(l) => l,
            Err(e) => {
                if let Some(m) = self.members.iter().find(|m| m.is_cuda() && !m.unsuspended) {
                    let h = m.h.try_clone()?;
                    self.refuse(
                        &h,
                        SuspendFailure::LastLook {
                            found: format!("NVML cannot be asked: {e}"),
                        },
                    )?;
                    return Ok(false);
                }
                Vec::new()
            }
        };
        let mut found = Vec::new();
        for m in &self.members {
            if m.unsuspended || !m.h.is_alive() {
                continue;
            }
            let pid = m.h.pid();
            let mut wrong = Vec::new();
            if m.is_cuda() {
                match self.gpu.driver.state(pid) {
                    Ok(ProcessState::Checkpointed) => {}
                    Ok(other) => wrong.push(format!("state {other}")),
                    Err(_) if m.h.wait_exit(ENDING_GRACE) => continue,
                    Err(e) => wrong.push(format!("no state from the driver ({e})")),
                }
            }
            match self.gpu.inspect.driver_fds(pid) {
                Ok(fds) if fds.is_empty() => {}
                Ok(_) if matches!(m.class, Some(Class::DriverOnly { .. })) => {}
                Ok(fds) => wrong.push(format!("{} driver files open", fds.len())),
                Err(_) if m.h.wait_exit(ENDING_GRACE) => continue,
                Err(e) => wrong.push(format!("driver files that cannot be listed ({e})")),
            }
            if let Some(p) = listed.iter().find(|p| p.pid == pid) {
                wrong.push(format!(
                    "{} of device memory listed by NVML",
                    cryo_units::fmt_bytes(p.used_memory)
                ));
            }
            if !wrong.is_empty() {
                found.push((m.h.try_clone()?, wrong.join(", ")));
            }
        }
        let ok = found.is_empty();
        for (h, what) in found {
            self.refuse(&h, SuspendFailure::LastLook { found: what })?;
        }
        Ok(ok)
    }

    /// Step 6: CUDA processes first, then the rest. `false`: a late refusal ended the kill phase.
    fn kill_all(&mut self) -> Result<bool, StopError> {
        let mut order: Vec<usize> = (0..self.members.len())
            .filter(|&i| self.members[i].is_cuda())
            .collect();
        order.extend((0..self.members.len()).filter(|&i| !self.members[i].is_cuda()));
        for i in order {
            let m = &self.members[i];
            if !m.h.is_alive() {
                continue;
            }
            if m.is_cuda() && !m.unsuspended {
                // One more look right before its own kill.
                match self.gpu.driver.state(m.h.pid()) {
                    Ok(ProcessState::Checkpointed) => {}
                    Err(_) if m.h.wait_exit(ENDING_GRACE) => continue,
                    other => {
                        let found = match other {
                            Ok(s) => format!("state {s} right before its kill"),
                            Err(e) => {
                                format!("no state from the driver right before its kill ({e})")
                            }
                        };
                        let h = m.h.try_clone()?;
                        self.refuse(&h, SuspendFailure::LastLook { found })?;
                        return Ok(false);
                    }
                }
            }
            if m.is_cuda() && !m.unsuspended {
                failpoint::pause_if(STOP_KILL_AFTER_LOOK);
            }
            let h = self.members[i].h.try_clone()?;
            let unsuspended = self.members[i].unsuspended;
            // Said before the signal: past the last look, whoever ends the process now (the
            // kubelet after a preStop returned) ends it safely.
            self.progress.begin(h.pid(), "kill", 0);
            end_one(&h, self.opts, self.journal, unsuspended)?;
        }
        Ok(true)
    }

    /// After exit, NVML must attribute nothing to them: otherwise someone holds their driver
    /// files. The driver releases a context shortly after the process's files close (a plain
    /// kill of a fresh process), so this polls until the verification deadline.
    fn verify_released(&self) -> Result<(), StopError> {
        let mut deadline = Instant::now() + self.opts.suspend.verify_timeout;
        if let Some(u) = self.until {
            deadline = deadline.min(u.max(Instant::now() + Duration::from_millis(200)));
        }
        loop {
            let listed = self.gpu.inspect.processes()?;
            let held = self
                .members
                .iter()
                .filter(|m| !m.h.is_alive())
                .find_map(|m| {
                    let mine: Vec<_> = listed.iter().filter(|p| p.pid == m.h.pid()).collect();
                    (!mine.is_empty())
                        .then(|| (m.h.pid(), mine.iter().map(|p| p.used_memory).sum::<u64>()))
                });
            match held {
                None => return Ok(()),
                Some((pid, bytes)) if Instant::now() >= deadline => {
                    return Err(StopError::MemoryAfterExit { pid, bytes })
                }
                Some(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }
}

pub(crate) fn end_one(
    h: &ProcHandle,
    opts: &StopOptions,
    journal: &Journal,
    unsafe_kill: bool,
) -> Result<(), StopError> {
    if !h.is_alive() {
        return Ok(());
    }
    let pid = h.pid();
    let first = match opts.signal {
        EndSignal::Kill => Signal::SIGKILL,
        EndSignal::Term { .. } => Signal::SIGTERM,
    };
    if unsafe_kill {
        journal.append(Event::UnsafeKill { pid: id(h) })?;
    }
    journal.append(Event::KillStarted {
        pid: id(h),
        signal: first as i32,
    })?;
    if let Err(e) = h.signal(first) {
        if h.is_alive() {
            return Err(e.into());
        }
    }
    if let EndSignal::Term { grace } = opts.signal {
        if !h.wait_exit(grace) {
            journal.append(Event::KillStarted {
                pid: id(h),
                signal: Signal::SIGKILL as i32,
            })?;
            if let Err(e) = h.signal(Signal::SIGKILL) {
                if h.is_alive() {
                    return Err(e.into());
                }
            }
        }
    }
    if !h.wait_exit(opts.exit_timeout) {
        return Err(StopError::NotExited(pid));
    }
    journal.append(Event::Killed { pid: id(h) })?;
    Ok(())
}

fn elapsed_ms(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
