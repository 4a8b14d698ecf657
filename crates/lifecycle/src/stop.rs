//! `cryo stop`: suspend-before-kill for every CUDA process of a target, verified through NVML.
//!
//! # Design
//! 1. The target (a process tree, a cgroup, or a list of pids) comes resolved to pidfd handles
//!    ([`crate::target`]): the caller resolved it once, before any question to a driver.
//! 2. Ask the driver which of them are CUDA processes (the driver answers a state for them).
//! 3. Suspend them all ([`crate::suspend`]): lock in parallel, checkpoint in parallel, verify.
//! 4. Only if every one is suspended: end the CUDA processes, then the others, confirming every
//!    exit through its pidfd and that NVML attributes no memory to them afterwards.
//!
//! A process whose origin is unknown is treated as restored. If any CUDA process cannot be
//! suspended, nothing in the target is killed ([`StopReport::refusals`]), unless the operator asked
//! for `unsafe_kill`. A stop that died half-way is resumed by running it again: the driver's state
//! says what is left to do.

use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, Gpu, ProcessState};
use cryo_journal::{Event, Journal, Origin, Origins};
use cryo_proc::{Pid, ProcError, ProcHandle, Signal};

use crate::failpoint;
use crate::progress::Progress;
use crate::suspend::{id, suspend, SuspendFailure, SuspendOptions, Suspended};
use crate::target::Resolved;

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

/// Options of a stop.
#[derive(Debug, Clone)]
pub struct StopOptions {
    /// How to suspend.
    pub suspend: SuspendOptions,
    /// How to end.
    pub signal: EndSignal,
    /// Kill even what could not be suspended (the host-wedging path on affected hosts).
    pub unsafe_kill: bool,
    /// The operator declares the processes were never restored: a plain kill is allowed.
    pub fresh: bool,
    /// How long to wait for a killed process to exit.
    pub exit_timeout: Duration,
}

impl Default for StopOptions {
    fn default() -> Self {
        StopOptions {
            suspend: SuspendOptions::default(),
            signal: EndSignal::Kill,
            unsafe_kill: false,
            fresh: false,
            exit_timeout: Duration::from_secs(10),
        }
    }
}

/// A CUDA process that could not be suspended.
#[derive(Debug, Clone, serde::Serialize)]
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
#[derive(Debug, Clone, serde::Serialize)]
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
}

/// The result of a stop. Refusals are results, not errors.
#[derive(Debug, Clone, serde::Serialize)]
pub struct StopReport {
    /// Every process of the target.
    pub processes: Vec<ProcReport>,
    /// CUDA processes that could not be suspended (then nothing was killed, unless unsafe).
    pub refusals: Vec<Refusal>,
    /// Whether processes were killed without suspension (`unsafe_kill` or `fresh`).
    pub unsafe_kills: Vec<Pid>,
    /// Wall time of the whole stop.
    pub elapsed_ms: u64,
}

impl StopReport {
    /// Whether every process of the target has ended.
    pub fn stopped(&self) -> bool {
        self.refusals.is_empty() && self.processes.iter().all(|p| p.ended)
    }
}

/// The stop could not be carried out at all (nothing was killed).
#[derive(Debug, thiserror::Error)]
pub enum StopError {
    /// A process could not be signalled.
    #[error(transparent)]
    Proc(#[from] ProcError),
    /// The driver could not tell which processes use CUDA.
    #[error("cannot ask the driver about pid {pid}: {error}")]
    Driver {
        /// The process.
        pid: Pid,
        /// The driver's error.
        error: cryo_gpu::DriverError,
    },
    /// The journal could not be written before acting.
    #[error("cannot write the journal: {0}")]
    Journal(#[from] cryo_journal::AppendError),
    /// The journal could not be read.
    #[error("cannot read the journal: {0}")]
    JournalRead(#[from] cryo_journal::ReadError),
    /// The inspection API (NVML) could not list processes.
    #[error("cannot list GPU processes: {0}")]
    Inspect(#[from] cryo_gpu::InspectError),
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

/// Stops `target`. See the module docs for the order of things and what a refusal leaves behind.
pub fn stop(
    gpu: &Gpu,
    target: &Resolved,
    opts: &StopOptions,
    journal: &Journal,
    progress: &dyn Progress,
) -> Result<StopReport, StopError> {
    let start = Instant::now();
    let handles = target.handles();
    let described = target.target().to_string();
    journal.append(Event::StopRequested {
        target: described.clone(),
    })?;

    // Which processes hold CUDA state: those the driver answers a state for.
    let mut cuda = Vec::new();
    let mut plain = Vec::new();
    for h in handles {
        match gpu.driver.state(h.pid()) {
            Ok(_) => cuda.push(h),
            Err(e)
                if matches!(
                    e.code(),
                    Some(CuResult::NOT_INITIALIZED) | Some(CuResult::INVALID_VALUE)
                ) && h.is_alive() =>
            {
                plain.push(h)
            }
            Err(e) if !h.is_alive() => {
                tracing::debug!(pid = h.pid(), error = %e, "exited before it could be classified");
            }
            Err(error) => {
                return Err(StopError::Driver {
                    pid: h.pid(),
                    error,
                })
            }
        }
    }

    let origins = Origins::from_records(&cryo_journal::read(journal.dir())?.records);
    let origin = |h: &ProcHandle| -> Option<bool> {
        match origins.of(&id(h)) {
            Origin::Restored { .. } => Some(true),
            Origin::Fresh => Some(false),
            Origin::Unknown => None,
        }
    };
    let mut reports: Vec<ProcReport> = handles
        .iter()
        .map(|h| ProcReport {
            pid: h.pid(),
            comm: h.comm().to_string(),
            cuda: cuda.iter().any(|c| c.pid() == h.pid()),
            restored: origin(h),
            suspended: None,
            ended: false,
        })
        .collect();

    let mut refusals = Vec::new();
    let mut unsafe_kills = Vec::new();
    let mut to_suspend: Vec<&ProcHandle> = cuda.clone();
    if opts.fresh {
        // Declared never restored: tearing down its context is the ordinary, safe kind of exit.
        // The journal wins over the declaration: a process cryo itself restored is suspended
        // whatever the operator says, since being wrong that way wedges the host.
        to_suspend.retain(|h| origin(h) == Some(true));
        for h in cuda.iter().filter(|h| origin(h) != Some(true)) {
            journal.append(Event::FreshDeclared { pid: id(h) })?;
            unsafe_kills.push(h.pid());
        }
    }
    // A process that exits on its own during the suspension (a dying worker, CRIU ending a
    // dumped tree) has left the target; the others are suspended again without it. Suspension is
    // all or nothing, so such an exit rolled the others back: a few rounds at most, each cheap
    // since what was checkpointed stays checkpointed.
    for round in 1..=3 {
        if to_suspend.is_empty() {
            break;
        }
        let outcomes = suspend(gpu, &to_suspend, &opts.suspend, Some(journal), progress);
        let exited: Vec<Pid> = outcomes
            .iter()
            .filter(|o| matches!(o.result, Err(SuspendFailure::Exited)))
            .map(|o| o.pid)
            .collect();
        let others_failed = outcomes
            .iter()
            .any(|o| matches!(&o.result, Err(f) if *f != SuspendFailure::Exited));
        if !exited.is_empty() && !others_failed && round < 3 {
            for h in to_suspend.iter().filter(|h| exited.contains(&h.pid())) {
                journal.append(Event::ProcessExited {
                    pid: id(h),
                    how: "exited on its own during the stop".into(),
                })?;
            }
            to_suspend.retain(|h| !exited.contains(&h.pid()));
            continue;
        }
        for outcome in outcomes {
            match outcome.result {
                Ok(s) => {
                    if let Some(r) = reports.iter_mut().find(|r| r.pid == outcome.pid) {
                        r.suspended = Some(s);
                    }
                }
                Err(f) => refusals.push(Refusal {
                    pid: outcome.pid,
                    hint: f.hint().to_string(),
                    reason: f,
                }),
            }
        }
        break;
    }

    if !refusals.is_empty() {
        for r in &refusals {
            if let Some(h) = handles.iter().find(|h| h.pid() == r.pid) {
                journal.append(Event::Refused {
                    pid: id(h),
                    reason: r.reason.reason(),
                    hint: r.hint.clone(),
                })?;
            }
        }
        if !opts.unsafe_kill {
            journal.append(Event::StopCompleted {
                target: described.clone(),
                killed: Vec::new(),
                ms: elapsed_ms(start),
                refused: refused_ids(handles, &refusals),
            })?;
            return Ok(StopReport {
                processes: reports,
                refusals,
                unsafe_kills,
                elapsed_ms: elapsed_ms(start),
            });
        }
        unsafe_kills.extend(refusals.iter().map(|r| r.pid));
    }

    failpoint::stall_if(failpoint::STOP_BEFORE_KILL);

    // Last look before any kill: something else may have restored a process since it was
    // verified (a concurrent thaw or toggle). Then this is a refusal like any other, and nothing
    // in the target is killed. Each process gets one more look right before its own kill.
    let changed: Vec<(&ProcHandle, ProcessState)> = cuda
        .iter()
        .filter(|h| !unsafe_kills.contains(&h.pid()))
        .filter_map(|h| match gpu.driver.state(h.pid()) {
            Ok(ProcessState::Checkpointed) => None,
            Ok(other) if h.is_alive() => Some((*h, other)),
            _ => None,
        })
        .collect();
    if !changed.is_empty() {
        for (h, state) in changed {
            refusals.push(late_refusal(h, state, journal)?);
        }
        journal.append(Event::StopCompleted {
            target: described.clone(),
            killed: Vec::new(),
            ms: elapsed_ms(start),
            refused: refused_ids(handles, &refusals),
        })?;
        return Ok(StopReport {
            processes: reports,
            refusals,
            unsafe_kills,
            elapsed_ms: elapsed_ms(start),
        });
    }

    // CUDA processes first, then the rest: a parent that dies first could take its children's
    // state with it in ways the driver does not expect.
    for h in cuda.iter().chain(plain.iter()) {
        let suspended = !unsafe_kills.contains(&h.pid()) && cuda.iter().any(|c| c.pid() == h.pid());
        if suspended {
            // One more look right before its own kill.
            match gpu.driver.state(h.pid()) {
                Ok(ProcessState::Checkpointed) => {}
                Ok(other) if h.is_alive() => {
                    refusals.push(late_refusal(h, other, journal)?);
                    continue;
                }
                _ => {}
            }
        }
        end_one(h, opts, journal, unsafe_kills.contains(&h.pid()))?;
        if let Some(r) = reports.iter_mut().find(|r| r.pid == h.pid()) {
            r.ended = !h.is_alive();
        }
    }

    // After exit, NVML must attribute nothing to them: otherwise someone holds their driver files.
    // The driver releases a context shortly after the process's files close (a plain kill of a
    // fresh process), so this polls until the verification deadline.
    let deadline = Instant::now() + opts.suspend.verify_timeout;
    loop {
        let listed = gpu.inspect.processes()?;
        let held = handles.iter().filter(|h| !h.is_alive()).find_map(|h| {
            let mine: Vec<_> = listed.iter().filter(|p| p.pid == h.pid()).collect();
            (!mine.is_empty()).then(|| (h.pid(), mine.iter().map(|p| p.used_memory).sum::<u64>()))
        });
        match held {
            None => break,
            Some((pid, bytes)) if Instant::now() >= deadline => {
                return Err(StopError::MemoryAfterExit { pid, bytes })
            }
            Some(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    }
    // A process that exited on its own meanwhile (it was never classified, or died while we
    // looked at it) has ended too: the target is stopped when every one of them is gone.
    for r in reports.iter_mut() {
        if let Some(h) = handles.iter().find(|h| h.pid() == r.pid) {
            r.ended = !h.is_alive();
        }
    }
    journal.append(Event::StopCompleted {
        target: described.clone(),
        killed: handles.iter().filter(|h| !h.is_alive()).map(id).collect(),
        ms: elapsed_ms(start),
        refused: refused_ids(handles, &refusals),
    })?;
    Ok(StopReport {
        processes: reports,
        refusals,
        unsafe_kills,
        elapsed_ms: elapsed_ms(start),
    })
}

/// The journal's identities of the refused processes.
fn refused_ids(handles: &[ProcHandle], refusals: &[Refusal]) -> Vec<cryo_journal::ProcId> {
    handles
        .iter()
        .filter(|h| refusals.iter().any(|r| r.pid == h.pid()))
        .map(id)
        .collect()
}

/// A process whose state changed after it was verified suspended: refused, and journaled so.
fn late_refusal(
    h: &ProcHandle,
    state: ProcessState,
    journal: &Journal,
) -> Result<Refusal, StopError> {
    let reason = SuspendFailure::Driver {
        step: "kill",
        error: format!("state changed to {state} after verification"),
    };
    let hint = "something else restored it meanwhile; run the stop again".to_string();
    journal.append(Event::Refused {
        pid: id(h),
        reason: reason.reason(),
        hint: hint.clone(),
    })?;
    Ok(Refusal {
        pid: h.pid(),
        hint,
        reason,
    })
}

fn end_one(
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
