//! Suspension: lock, checkpoint and verify a set of CUDA processes, all or nothing.

use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, DriverError, Gpu, ProcessState};
use cryo_journal::{Event, Journal, ProcId};
use cryo_proc::Pid;
use cryo_proc::ProcHandle;

use crate::progress::Progress;

/// How hard to try.
#[derive(Debug, Clone)]
pub struct SuspendOptions {
    /// Timeout of one lock attempt (`cuda-checkpoint --timeout`).
    pub lock_timeout: Duration,
    /// Lock attempts before giving up on work that stays in flight.
    pub lock_attempts: u32,
    /// How long to wait for NVML to stop listing a checkpointed process.
    pub verify_timeout: Duration,
    /// On failure, also bring back (restore + unlock) the processes this run checkpointed, so the
    /// worker keeps serving (freeze); otherwise they stay CHECKPOINTED, which is safe (stop).
    pub resume_on_failure: bool,
}

impl Default for SuspendOptions {
    fn default() -> Self {
        SuspendOptions {
            lock_timeout: Duration::from_secs(30),
            lock_attempts: 3,
            verify_timeout: Duration::from_secs(10),
            resume_on_failure: false,
        }
    }
}

/// What one process went through.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Suspended {
    /// The process.
    pub pid: Pid,
    /// State found before acting.
    pub state_before: ProcessState,
    /// Device memory NVML listed before acting, bytes.
    pub device_memory: u64,
    /// Time spent in lock, when this run locked it (JSON: `lock_ms`).
    #[serde(rename = "lock_ms", serialize_with = "opt_ms")]
    pub lock: Option<Duration>,
    /// Time spent in checkpoint, when this run checkpointed it (JSON: `checkpoint_ms`).
    #[serde(rename = "checkpoint_ms", serialize_with = "opt_ms")]
    pub checkpoint: Option<Duration>,
    /// Time from checkpoint return to NVML no longer listing the pid (JSON: `verify_ms`).
    #[serde(rename = "verify_ms", serialize_with = "opt_ms")]
    pub verify: Option<Duration>,
}

/// Durations in JSON as milliseconds (fractional), `null` when absent.
fn opt_ms<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&(d.as_secs_f64() * 1e3)),
        None => s.serialize_none(),
    }
}

/// Why a process could not be suspended.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SuspendFailure {
    /// Work stayed in flight through every lock attempt (`CUDA_ERROR_NOT_READY`).
    LockTimedOut {
        /// Attempts made.
        attempts: u32,
        /// Timeout of each.
        timeout_ms: u64,
    },
    /// The context has a sticky error: the driver cannot lock it.
    StickyError {
        /// The driver's error name.
        code: String,
    },
    /// The driver reports the process FAILED.
    DriverFailedState,
    /// A driver call failed otherwise.
    Driver {
        /// The step.
        step: &'static str,
        /// The driver's message.
        error: String,
    },
    /// NVML still attributes device memory to the process after the deadline.
    MemoryStillListed {
        /// Bytes still listed.
        bytes: u64,
    },
    /// The process exited while being suspended.
    Exited,
    /// The thread carrying a driver call panicked: the call's outcome is unknown.
    Panicked {
        /// The step (`checkpoint`).
        step: &'static str,
    },
}

impl SuspendFailure {
    /// A short reason for humans.
    pub fn reason(&self) -> String {
        match self {
            SuspendFailure::LockTimedOut {
                attempts,
                timeout_ms,
            } => {
                format!("lock timed out with GPU work in flight ({attempts} attempts of {timeout_ms} ms, CUDA_ERROR_NOT_READY)")
            }
            SuspendFailure::StickyError { code } => {
                format!("the CUDA context has a sticky error ({code}): the driver cannot lock it")
            }
            SuspendFailure::DriverFailedState => {
                "the driver reports the process FAILED".to_string()
            }
            SuspendFailure::Driver { step, error } => format!("{step} failed: {error}"),
            SuspendFailure::MemoryStillListed { bytes } => {
                format!(
                    "NVML still lists {} of device memory after checkpoint",
                    cryo_units::fmt_bytes(*bytes)
                )
            }
            SuspendFailure::Exited => "the process exited while being suspended".to_string(),
            SuspendFailure::Panicked { step } => {
                format!("the {step} call panicked in cryo; its outcome is unknown")
            }
        }
    }

    /// What the operator can do.
    pub fn hint(&self) -> &'static str {
        match self {
            SuspendFailure::LockTimedOut { .. } => {
                "drain the worker's requests or raise --timeout/--lock-attempts, then run the stop again"
            }
            SuspendFailure::StickyError { .. } => {
                "the context cannot be suspended; keep the process alive and use `cryo guard` (pins its driver fds at exit) or, on a host known not to wedge, --unsafe"
            }
            SuspendFailure::DriverFailedState => "inspect the driver (dmesg, nvidia-smi); on a host known not to wedge, --unsafe",
            SuspendFailure::Driver { .. } => "check the driver and the pid, then run the stop again",
            SuspendFailure::MemoryStillListed { .. } => {
                "do not kill it: check nvidia-smi; another tool may hold the process's driver fds; run the stop again"
            }
            SuspendFailure::Exited => "check the journal and the wedge/host state: the process ended on its own",
            SuspendFailure::Panicked { .. } => "do not kill it: check its state with `cryo gpu state`, run the stop again, and report the panic (stderr has it)",
        }
    }
}

/// The result for one process.
#[derive(Debug, Clone)]
pub struct SuspendOutcome {
    /// The process.
    pub pid: Pid,
    /// What happened.
    pub result: Result<Suspended, SuspendFailure>,
}

/// Suspends every process in `procs` (all must be CUDA processes): lock in parallel, checkpoint
/// in parallel, verify through NVML. All or nothing: if any process fails, the ones this run
/// locked are unlocked again (and, with `resume_on_failure`, the ones it checkpointed are
/// restored and unlocked), so every process is left in a safe state.
pub fn suspend(
    gpu: &Gpu,
    procs: &[&ProcHandle],
    opts: &SuspendOptions,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) -> Vec<SuspendOutcome> {
    let memory_before: Vec<u64> = procs
        .iter()
        .map(|p| {
            gpu.inspect
                .process_memory(p.pid())
                .ok()
                .flatten()
                .unwrap_or(0)
        })
        .collect();
    let mut rows: Vec<Row> = procs
        .iter()
        .zip(memory_before)
        .map(|(p, mem)| Row {
            handle: p,
            state: gpu.driver.state(p.pid()),
            mem,
            lock: None,
            ckpt: None,
            verify: None,
            failure: None,
            locked_here: false,
            ckpt_here: false,
        })
        .collect();

    for row in &mut rows {
        match &row.state {
            Ok(ProcessState::Failed) => row.failure = Some(SuspendFailure::DriverFailedState),
            Ok(_) => {}
            Err(e) => row.failure = Some(classify("get state", e, row.handle)),
        }
    }

    // Lock phase, in parallel.
    if rows.iter().all(|r| r.failure.is_none()) {
        thread::scope(|s| {
            for row in rows
                .iter_mut()
                .filter(|r| matches!(r.state, Ok(ProcessState::Running)))
            {
                s.spawn(move || lock_one(gpu, row, opts, journal, progress));
            }
        });
    }
    // Checkpoint phase, in parallel: concurrent checkpoints are much faster than serial ones.
    if rows.iter().all(|r| r.failure.is_none()) {
        thread::scope(|s| {
            for row in rows
                .iter_mut()
                .filter(|r| r.locked_here || matches!(r.state, Ok(ProcessState::Locked)))
            {
                s.spawn(move || checkpoint_one(gpu, row, journal, progress));
            }
        });
    }
    if rows.iter().all(|r| r.failure.is_none()) {
        verify_all(gpu, &mut rows, opts.verify_timeout, journal);
    }
    if rows.iter().any(|r| r.failure.is_some()) {
        roll_back(gpu, &mut rows, opts.resume_on_failure, journal);
    }

    rows.into_iter()
        .map(|r| {
            let pid = r.handle.pid();
            let result = match (r.failure, r.state) {
                (Some(f), _) => Err(f),
                (None, Ok(state_before)) => Ok(Suspended {
                    pid,
                    state_before,
                    device_memory: r.mem,
                    lock: r.lock,
                    checkpoint: r.ckpt,
                    verify: r.verify,
                }),
                (None, Err(e)) => Err(classify("get state", &e, r.handle)),
            };
            SuspendOutcome { pid, result }
        })
        .collect()
}

struct Row<'a> {
    handle: &'a ProcHandle,
    state: Result<ProcessState, DriverError>,
    mem: u64,
    lock: Option<Duration>,
    ckpt: Option<Duration>,
    verify: Option<Duration>,
    failure: Option<SuspendFailure>,
    locked_here: bool,
    ckpt_here: bool,
}

fn record(journal: Option<&Journal>, event: Event) {
    if let Some(j) = journal {
        // The journal is the record of what happened, but a suspension that is under way must not
        // be abandoned half-way because the log disk is full: the step is still taken, and the
        // failure is loud.
        if let Err(e) = j.append(event) {
            tracing::error!(error = %e, "cannot write the journal");
        }
    }
}

fn classify(step: &'static str, e: &DriverError, h: &ProcHandle) -> SuspendFailure {
    // The driver stops knowing a process as it exits ("not a CUDA process", "no such process"):
    // for one it knew a moment ago, that means it is going away, which is not a driver failure.
    if matches!(
        e.code(),
        Some(CuResult::NOT_INITIALIZED) | Some(CuResult::INVALID_VALUE)
    ) && h.wait_exit(Duration::from_secs(1))
    {
        return SuspendFailure::Exited;
    }
    match e.code() {
        Some(code) if code.is_sticky() => SuspendFailure::StickyError {
            code: code.to_string(),
        },
        _ => SuspendFailure::Driver {
            step,
            error: e.to_string(),
        },
    }
}

fn lock_one(
    gpu: &Gpu,
    row: &mut Row<'_>,
    opts: &SuspendOptions,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) {
    let pid = row.handle.pid();
    progress.begin(pid, "lock", 0);
    let start = Instant::now();
    let attempts = opts.lock_attempts.max(1);
    for attempt in 1..=attempts {
        if !row.handle.is_alive() {
            row.failure = Some(SuspendFailure::Exited);
            break;
        }
        record(
            journal,
            Event::LockStarted {
                pid: id(row.handle),
            },
        );
        match gpu.driver.lock(pid, Some(opts.lock_timeout)) {
            Ok(()) => {
                let took = start.elapsed();
                row.lock = Some(took);
                row.locked_here = true;
                record(
                    journal,
                    Event::Locked {
                        pid: id(row.handle),
                        ms: ms(took),
                    },
                );
                progress.end(pid, "lock", true, &format!("{} ms", took.as_millis()));
                return;
            }
            Err(e) if e.code() == Some(CuResult::NOT_READY) && attempt < attempts => {
                record(
                    journal,
                    Event::LockFailed {
                        pid: id(row.handle),
                        error: e.to_string(),
                    },
                );
                tracing::warn!(pid, attempt, "lock timed out with work in flight; retrying");
            }
            Err(e) => {
                record(
                    journal,
                    Event::LockFailed {
                        pid: id(row.handle),
                        error: e.to_string(),
                    },
                );
                row.failure = Some(if e.code() == Some(CuResult::NOT_READY) {
                    SuspendFailure::LockTimedOut {
                        attempts,
                        timeout_ms: ms(opts.lock_timeout),
                    }
                } else {
                    classify("lock", &e, row.handle)
                });
                break;
            }
        }
    }
    progress.end(
        pid,
        "lock",
        false,
        &row.failure.as_ref().map(|f| f.reason()).unwrap_or_default(),
    );
}

fn checkpoint_one(
    gpu: &Gpu,
    row: &mut Row<'_>,
    journal: Option<&Journal>,
    progress: &dyn Progress,
) {
    let pid = row.handle.pid();
    let rss_before = row.handle.rss().unwrap_or(0);
    progress.begin(pid, "checkpoint", row.mem);
    record(
        journal,
        Event::CheckpointStarted {
            pid: id(row.handle),
        },
    );
    let start = Instant::now();
    let result = thread::scope(|s| {
        let (tx, rx) = mpsc::channel();
        let call = s.spawn(move || {
            let r = gpu.driver.checkpoint(pid);
            // The receiver only goes away once this thread is joined.
            let _ = tx.send(());
            r
        });
        // The driver gives no progress; the process's resident memory grows by its device memory
        // as the checkpoint moves it, which is the best estimate there is. The wait wakes as soon
        // as the call returns, so sampling adds no latency to the checkpoint.
        while let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(Duration::from_millis(100))
        {
            if let Ok(rss) = row.handle.rss() {
                progress.advance(pid, rss.saturating_sub(rss_before).min(row.mem));
            }
        }
        call.join()
    });
    let took = start.elapsed();
    match result {
        Err(_panic) => {
            let f = SuspendFailure::Panicked { step: "checkpoint" };
            record(
                journal,
                Event::CheckpointFailed {
                    pid: id(row.handle),
                    error: f.reason(),
                },
            );
            progress.end(pid, "checkpoint", false, &f.reason());
            row.failure = Some(f);
        }
        Ok(Ok(())) => {
            row.ckpt = Some(took);
            row.ckpt_here = true;
            record(
                journal,
                Event::Checkpointed {
                    pid: id(row.handle),
                    ms: ms(took),
                    bytes: row.mem,
                },
            );
            progress.end(
                pid,
                "checkpoint",
                true,
                &format!(
                    "{} ms, {}",
                    took.as_millis(),
                    cryo_units::fmt_bytes(row.mem)
                ),
            );
        }
        Ok(Err(e)) => {
            record(
                journal,
                Event::CheckpointFailed {
                    pid: id(row.handle),
                    error: e.to_string(),
                },
            );
            let f = classify("checkpoint", &e, row.handle);
            progress.end(pid, "checkpoint", false, &f.reason());
            row.failure = Some(f);
        }
    }
}

fn verify_all(gpu: &Gpu, rows: &mut [Row<'_>], timeout: Duration, journal: Option<&Journal>) {
    let start = Instant::now();
    let deadline = start + timeout;
    let mut pending: Vec<usize> = (0..rows.len()).collect();
    loop {
        let listed = match gpu.inspect.processes() {
            Ok(l) => l,
            Err(e) => {
                for &i in &pending {
                    rows[i].failure = Some(SuspendFailure::Driver {
                        step: "verify",
                        error: e.to_string(),
                    });
                }
                return;
            }
        };
        pending.retain(|&i| {
            let pid = rows[i].handle.pid();
            let bytes: u64 = listed
                .iter()
                .filter(|p| p.pid == pid)
                .map(|p| p.used_memory)
                .sum();
            let still = listed.iter().any(|p| p.pid == pid);
            if !still {
                let took = start.elapsed();
                rows[i].verify = Some(took);
                record(
                    journal,
                    Event::Verified {
                        pid: id(rows[i].handle),
                        ms: Some(ms(took)),
                    },
                );
                return false;
            }
            if Instant::now() >= deadline {
                record(
                    journal,
                    Event::VerifyFailed {
                        pid: id(rows[i].handle),
                        bytes_left: bytes,
                    },
                );
                rows[i].failure = Some(SuspendFailure::MemoryStillListed { bytes });
                return false;
            }
            true
        });
        if pending.is_empty() {
            return;
        }
        thread::sleep(Duration::from_millis(20));
    }
}

fn roll_back(gpu: &Gpu, rows: &mut [Row<'_>], resume: bool, journal: Option<&Journal>) {
    for row in rows.iter_mut() {
        let pid = row.handle.pid();
        if row.ckpt_here && resume {
            match gpu
                .driver
                .restore(pid, &[])
                .and_then(|()| gpu.driver.unlock(pid))
            {
                Ok(()) => record(
                    journal,
                    Event::Resumed {
                        pid: id(row.handle),
                    },
                ),
                Err(e) => {
                    tracing::error!(pid, error = %e, "cannot bring the process back after a failed suspension; it stays CHECKPOINTED (safe)")
                }
            }
        } else if row.locked_here && !row.ckpt_here {
            let start = Instant::now();
            match gpu.driver.unlock(pid) {
                Ok(()) => record(
                    journal,
                    Event::Unlocked {
                        pid: id(row.handle),
                        ms: Some(ms(start.elapsed())),
                    },
                ),
                Err(e) => {
                    tracing::error!(pid, error = %e, "cannot unlock the process after a failed suspension")
                }
            }
        }
    }
}

/// The journal's identity of a process held by a handle.
pub fn id(h: &ProcHandle) -> ProcId {
    ProcId {
        pid: h.pid(),
        start_time: h.start_time(),
    }
}

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests;
