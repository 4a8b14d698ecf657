//! `cryo gpu ls|ps|state|lock|checkpoint|restore|unlock|restore-tid`.
//!
//! # Design
//! Every action runs the same checks before it touches the process: the pid exists and is a
//! process (`/proc`, then a pidfd held across the call), the driver knows it as a CUDA process,
//! and its current state allows the transition ([`precheck`], pure, so it is unit-tested). A
//! refused action changes nothing. Driver errors are explained in words ([`explain`]) and keep
//! the driver's own name (`CUDA_ERROR_NOT_READY`) for searching.

use std::time::{Duration, Instant};

use anyhow::{anyhow, Context as _};
use cryo_gpu::{CuResult, DriverError, GpuProcess, ProcessState};
use cryo_proc::Pid;
use serde::Serialize;

use super::Context;
use crate::args::gpu::{LockArgs, OutputArgs, PidArgs, RestoreArgs};
use crate::args::GpuCommand;
use crate::compat::Action;
use crate::exit::UsageError;
use crate::process;
use cryo_units::fmt_bytes;

/// Runs one `cryo gpu` command.
pub fn run(ctx: &Context, cmd: GpuCommand) -> anyhow::Result<()> {
    match cmd {
        GpuCommand::Ls(o) => ls(ctx, &o),
        GpuCommand::Ps(o) => ps(ctx, &o),
        GpuCommand::State(p) => state(ctx, &p),
        GpuCommand::RestoreTid(p) => restore_tid(ctx, &p),
        GpuCommand::Lock(LockArgs { target, timeout }) => {
            let timeout = timeout
                .filter(|t| *t > 0)
                .map(|t| Duration::from_millis(u64::from(t)));
            act(ctx, &target, Action::Lock, timeout, None)
        }
        GpuCommand::Checkpoint(p) => act(ctx, &p, Action::Checkpoint, None, None),
        GpuCommand::Restore(RestoreArgs { target, gpu_map }) => {
            act(ctx, &target, Action::Restore, None, gpu_map.as_ref())
        }
        GpuCommand::Unlock(p) => act(ctx, &p, Action::Unlock, None, None),
    }
}

fn ls(ctx: &Context, o: &OutputArgs) -> anyhow::Result<()> {
    let gpu = ctx.gpu()?;
    let gpus = gpu.inspect.gpus().context("listing GPUs")?;
    if o.json {
        println!("{}", serde_json::to_string_pretty(&gpus)?);
        return Ok(());
    }
    // The guard's fence: a quarantined GPU holds a pinned live context and takes no thaw.
    let fenced = ctx.state.fence().list().unwrap_or_else(|e| {
        eprintln!("cryo: warning: cannot read the GPU quarantine: {e}");
        Vec::new()
    });
    println!(
        "{:<5}  {:<40}  {:<24}  {:>10}  {:>10}",
        "INDEX", "UUID", "NAME", "TOTAL", "FREE"
    );
    for g in &gpus {
        let mark = if fenced.iter().any(|q| q.gpu.covers(&g.uuid)) {
            "  QUARANTINED"
        } else {
            ""
        };
        println!(
            "{:<5}  {:<40}  {:<24}  {:>10}  {:>10}{mark}",
            g.index,
            g.uuid,
            g.name,
            fmt_bytes(g.memory_total),
            fmt_bytes(g.memory_free)
        );
    }
    Ok(())
}

/// One row of `cryo gpu ps --json`.
#[derive(Debug, Serialize)]
struct PsRow {
    #[serde(flatten)]
    process: GpuProcess,
    /// The checkpoint state, `null` when the driver would not say (the error is in `state_error`).
    state: Option<ProcessState>,
    #[serde(skip_serializing_if = "Option::is_none")]
    state_error: Option<String>,
}

fn ps(ctx: &Context, o: &OutputArgs) -> anyhow::Result<()> {
    let gpu = ctx.gpu()?;
    let procs = gpu.inspect.processes().context("listing GPU processes")?;
    let rows: Vec<PsRow> = procs
        .into_iter()
        .map(|p| {
            let (state, state_error) = match gpu.driver.state(p.pid) {
                Ok(s) => (Some(s), None),
                Err(e) => (None, Some(e.to_string())),
            };
            PsRow {
                process: p,
                state,
                state_error,
            }
        })
        .collect();
    if o.json {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(());
    }
    println!(
        "{:<8}  {:<3}  {:<40}  {:>10}  STATE",
        "PID", "GPU", "UUID", "MEMORY"
    );
    for r in &rows {
        let state = r.state.map_or("?", ProcessState::as_str);
        let p = &r.process;
        println!(
            "{:<8}  {:<3}  {:<40}  {:>10}  {state}",
            p.pid,
            p.gpu_index,
            p.gpu_uuid,
            fmt_bytes(p.used_memory)
        );
    }
    Ok(())
}

fn state(ctx: &Context, p: &PidArgs) -> anyhow::Result<()> {
    let handle = process::open_process(p.pid)?;
    let gpu = ctx.gpu()?;
    let s = gpu
        .driver
        .state(p.pid)
        .map_err(|e| explain(e, p.pid, None))?;
    process::check_still_alive(&handle)?;
    if p.json {
        println!("{}", serde_json::json!({ "pid": p.pid, "state": s }));
    } else {
        println!("{s}");
    }
    Ok(())
}

fn restore_tid(ctx: &Context, p: &PidArgs) -> anyhow::Result<()> {
    let handle = process::open_process(p.pid)?;
    let gpu = ctx.gpu()?;
    let tid = gpu
        .driver
        .restore_thread_id(p.pid)
        .map_err(|e| explain(e, p.pid, None))?;
    process::check_still_alive(&handle)?;
    if p.json {
        println!(
            "{}",
            serde_json::json!({ "pid": p.pid, "restore_tid": tid })
        );
    } else {
        println!("{tid}");
    }
    Ok(())
}

/// `cryo gpu lock|checkpoint|restore|unlock --json`.
#[derive(Debug, Serialize)]
struct ActionReport {
    pid: Pid,
    action: &'static str,
    before: ProcessState,
    after: Option<ProcessState>,
    elapsed_ms: f64,
}

fn act(
    ctx: &Context,
    p: &PidArgs,
    action: Action,
    timeout: Option<Duration>,
    map: Option<&crate::args::GpuMap>,
) -> anyhow::Result<()> {
    let pid = p.pid;
    let handle = process::open_process(pid)?;
    let gpu = ctx.gpu_for_change()?;
    let before = gpu.driver.state(pid).map_err(|e| explain(e, pid, None))?;
    precheck(action, pid, before).map_err(|m| anyhow!(m))?;
    let pairs = match map {
        Some(m) => {
            let gpus = gpu
                .inspect
                .gpus()
                .context("listing GPUs to resolve --gpu-map")?;
            m.resolve(&gpus)
                .map_err(|e| UsageError(format!("--gpu-map: {e}")))?
        }
        None => Vec::new(),
    };
    let start = Instant::now();
    let result = match action {
        Action::Lock => gpu.driver.lock(pid, timeout),
        Action::Checkpoint => gpu.driver.checkpoint(pid),
        Action::Restore => {
            // Journaled as restored before the driver is asked; a restore that cannot be recorded
            // is checkpointed again (see `cryo_lifecycle::restore`).
            let journal = ctx.state.open_journal().context("opening the journal")?;
            match cryo_lifecycle::restore_context(
                &gpu,
                &journal,
                &handle,
                &pairs,
                "cryo gpu restore",
            ) {
                Ok(_) => Ok(()),
                Err(cryo_lifecycle::RestoreError::Driver(e)) => Err(e),
                Err(e) => return Err(anyhow!(e)),
            }
        }
        Action::Unlock => gpu.driver.unlock(pid),
    };
    let elapsed = start.elapsed();
    result.map_err(|e| explain(e, pid, Some((action, timeout))))?;
    process::check_still_alive(&handle)?;
    if action == Action::Restore {
        // LOCKED now: traced by the node's guard before anything may unlock it, or checkpointed
        // again.
        match super::guard_restored(&ctx.state, &handle) {
            Ok(cryo_lifecycle::Coverage::Guarded) => {}
            Ok(cryo_lifecycle::Coverage::NoGuard) => super::say_unguarded(),
            Err(why) => {
                return Err(match gpu.driver.checkpoint(pid) {
                    Ok(()) => anyhow!("{why}; pid {pid} was checkpointed again"),
                    Err(e) => anyhow!(
                        "{why}; checkpointing pid {pid} again failed too ({e}): it stays LOCKED; do not unlock it unguarded"
                    ),
                });
            }
        }
    }
    let after = gpu.driver.state(pid).ok();
    print_action(
        p.json,
        &ActionReport {
            pid,
            action: action.as_str(),
            before,
            after,
            elapsed_ms: elapsed.as_secs_f64() * 1e3,
        },
    )?;
    Ok(())
}

fn print_action(json: bool, r: &ActionReport) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string(r)?);
    } else {
        let after = r.after.map_or("?", ProcessState::as_str);
        println!(
            "pid {}: {} -> {} ({} in {:.1} ms)",
            r.pid, r.before, after, r.action, r.elapsed_ms
        );
    }
    Ok(())
}

/// Whether `action` is allowed from `state`; the refusal says what to do instead.
pub fn precheck(action: Action, pid: Pid, state: ProcessState) -> Result<(), String> {
    use Action as A;
    use ProcessState as S;
    let refusal = match (action, state) {
        (A::Lock, S::Running)
        | (A::Checkpoint, S::Locked)
        | (A::Restore, S::Checkpointed)
        | (A::Unlock, S::Locked) => return Ok(()),
        (_, S::Failed) => {
            "is in state failed (the driver gave up on it); nothing can be done but to end it"
                .to_string()
        }
        (A::Lock, S::Locked) => "is already locked".to_string(),
        (A::Lock, S::Checkpointed) => "is checkpointed; restore it first".to_string(),
        (A::Checkpoint, S::Running) => "is running; lock it first".to_string(),
        (A::Checkpoint, S::Checkpointed) => "is already checkpointed".to_string(),
        (A::Restore, S::Running) => "is running; there is nothing to restore".to_string(),
        (A::Restore, S::Locked) => {
            "is locked, not checkpointed; there is nothing to restore (unlock it to resume)"
                .to_string()
        }
        (A::Unlock, S::Running) => "is running; there is nothing to unlock".to_string(),
        (A::Unlock, S::Checkpointed) => "is checkpointed; restore it first".to_string(),
    };
    Err(format!("pid {pid} {refusal}"))
}

/// Why the driver may give no answer for `pid` in time, and what to do: a process whose threads
/// CRIU (a dump, or a restore at its gate) or a debugger holds stopped gets none (its driver
/// thread cannot answer; a CHECKPOINTED process included, see the sim's strictness). Names the
/// tracer (`TracerPid` of `/proc/PID/status`, and its command name) when there is one, or that
/// it is stopped untraced (a tracer let it go stopped): `kill -CONT` lets it answer.
fn no_answer(pid: Pid) -> String {
    let held = "a process whose threads CRIU (a dump, a restore at its gate) or a debugger holds \
                stopped gets none";
    let status = cryo_proc::ProcHandle::open(pid)
        .ok()
        .and_then(|h| h.status().ok());
    let tracer = status.as_ref().map(|s| s.tracer_pid).filter(|t| *t != 0);
    let stopped = status.is_some_and(|s| s.state == 'T');
    match tracer {
        Some(t) => {
            let name = cryo_proc::ProcHandle::open(t)
                .map(|h| format!(" ({})", h.comm()))
                .unwrap_or_default();
            format!(
                "the driver gave no answer for pid {pid} in time: it is traced by pid {t}{name}, \
                 and {held}; ask again once that one has let it go (a CRIU finishes or ends on \
                 its own)"
            )
        }
        None if stopped => format!(
            "the driver gave no answer for pid {pid} in time: it is stopped (a SIGSTOP, or left \
             stopped by a tracer that let it go), and {held}; `kill -CONT {pid}` lets it answer"
        ),
        None => format!(
            "the driver gave no answer for pid {pid} in time ({held}; nothing traces it now: \
             ask again, and if it still gets none, the driver itself is stuck on it)"
        ),
    }
}

/// A driver error in words, the driver's own text kept as the cause.
pub fn explain(
    err: DriverError,
    pid: Pid,
    action: Option<(Action, Option<Duration>)>,
) -> anyhow::Error {
    let what = match err.code() {
        Some(CuResult::NOT_INITIALIZED) => Some(format!("pid {pid} is not a CUDA process (the driver holds no CUDA state for it)")),
        Some(CuResult::INVALID_VALUE) => Some(format!("the driver does not know pid {pid} as a CUDA process")),
        Some(CuResult::NOT_READY) => Some(match action {
            Some((Action::Lock, Some(t))) => format!("pid {pid} still had GPU work in flight after {} ms; it was not locked and keeps running", t.as_millis()),
            _ => format!("pid {pid} was not ready"),
        }),
        Some(code) if code.is_sticky() => Some(format!(
            "pid {pid}'s CUDA context has a sticky error: it cannot be locked or checkpointed any more"
        )),
        Some(CuResult::OUT_OF_MEMORY) => Some(format!(
            "not enough free device memory to restore pid {pid}; it stays checkpointed and, as with the real driver, will not restore again (NVIDIA/cuda-checkpoint#44)"
        )),
        Some(CuResult::OPERATING_SYSTEM) if matches!(action, Some((Action::Restore, _))) => Some(format!(
            "pid {pid} cannot be restored (a previous restore failed, NVIDIA/cuda-checkpoint#44)"
        )),
        Some(CuResult::ILLEGAL_STATE) => Some(format!("pid {pid} is not in a state that allows this")),
        _ if err.is_no_answer() => Some(no_answer(pid)),
        _ => None,
    };
    match what {
        Some(w) => anyhow::Error::new(err).context(w),
        None => match action {
            Some((a, _)) => {
                anyhow::Error::new(err).context(format!("could not {} pid {pid}", a.as_str()))
            }
            None => anyhow::Error::new(err),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_driver_transitions_pass() {
        let states = [
            ProcessState::Running,
            ProcessState::Locked,
            ProcessState::Checkpointed,
            ProcessState::Failed,
        ];
        for a in [
            Action::Lock,
            Action::Checkpoint,
            Action::Restore,
            Action::Unlock,
        ] {
            for s in states {
                let ok = matches!(
                    (a, s),
                    (Action::Lock, ProcessState::Running)
                        | (Action::Checkpoint, ProcessState::Locked)
                        | (Action::Restore, ProcessState::Checkpointed)
                        | (Action::Unlock, ProcessState::Locked)
                );
                assert_eq!(precheck(a, 9, s).is_ok(), ok, "{a:?} from {s:?}");
            }
        }
    }

    #[test]
    fn checkpoint_before_lock_says_lock_first() {
        assert_eq!(
            precheck(Action::Checkpoint, 42, ProcessState::Running).unwrap_err(),
            "pid 42 is running; lock it first"
        );
    }

    #[test]
    fn non_cuda_pid_is_explained() {
        let e = explain(
            DriverError::Cuda {
                call: "cuCheckpointProcessGetState",
                pid: 5,
                code: CuResult::NOT_INITIALIZED,
            },
            5,
            None,
        );
        let line = format!("{e:#}");
        assert!(line.starts_with("pid 5 is not a CUDA process"), "{line}");
        assert!(line.contains("CUDA_ERROR_NOT_INITIALIZED"), "{line}");
    }

    #[test]
    fn lock_timeout_is_explained() {
        let e = explain(
            DriverError::Cuda {
                call: "cuCheckpointProcessLock",
                pid: 5,
                code: CuResult::NOT_READY,
            },
            5,
            Some((Action::Lock, Some(Duration::from_millis(250)))),
        );
        let line = format!("{e:#}");
        assert!(
            line.contains("after 250 ms") && line.contains("CUDA_ERROR_NOT_READY"),
            "{line}"
        );
    }
}
