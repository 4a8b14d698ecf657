//! The `cuda-checkpoint` front end's handler: parse (no system calls), then resolve the backend
//! silently, then act; prints exactly what NVIDIA's binary would (see `crate::compat`).

use std::ffi::OsString;
use std::io::Write;
use std::path::{Path, PathBuf};

use cryo_gpu::{CuResult, DriverError, ProcessState};
use cryo_proc::Pid;
use cryo_state::StateDir;

use crate::backend::{self, GpuChoice};
use crate::compat::{self, Outcome, Request};

/// Runs the front end on `args` (without `argv[0]`); returns the exit status.
pub fn run(choice: GpuChoice, sim_dir: &Path, state: &StateDir, args: Vec<OsString>) -> u8 {
    let outcome = outcome(choice, sim_dir, state, args);
    // Output errors (a closed pipe) cannot be reported anywhere better than the status.
    let _ = std::io::stdout().write_all(outcome.stdout.as_bytes());
    let _ = std::io::stderr().write_all(outcome.stderr.as_bytes());
    outcome.status
}

/// Runs the front end when cryo was started as `cuda-checkpoint`: the backend comes from the
/// environment (`CRYO_GPU`, `CRYO_SIM_DIR`) since NVIDIA's syntax has no flag for it.
pub fn run_as_argv0(args: Vec<OsString>) -> u8 {
    let choice = match std::env::var("CRYO_GPU").as_deref() {
        Ok("cuda") => GpuChoice::Cuda,
        Ok("sim") => GpuChoice::Sim,
        Ok("auto") | Err(_) => GpuChoice::Auto,
        Ok(other) => {
            eprintln!("cuda-checkpoint: CRYO_GPU={other:?} is not one of auto, cuda, sim");
            return crate::exit::FAILURE;
        }
    };
    let sim_dir = std::env::var_os("CRYO_SIM_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(cryo_sim::default_dir);
    let state = std::env::var_os("CRYO_STATE_DIR")
        .map(StateDir::new)
        .unwrap_or_default();
    run(choice, &sim_dir, &state, args)
}

fn outcome(choice: GpuChoice, sim_dir: &Path, state: &StateDir, args: Vec<OsString>) -> Outcome {
    let args: Vec<String> = args
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let (op, pid, timeout_ms, map) = match compat::parse(&args) {
        Ok(Request::Help) => return Outcome::help(),
        Ok(Request::Run {
            op,
            pid,
            timeout_ms,
            device_map,
        }) => (op, pid, timeout_ms, device_map),
        Err(e) => return Outcome::usage(&e),
    };
    // A tid stands for its process, as with the real driver (CRIU passes the restore tid).
    let pid = match cryo_proc::tgid(pid) {
        Ok(Some(tgid)) => tgid,
        Ok(None) => return no_such_process(op, pid),
        Err(e) => {
            return Outcome {
                stdout: String::new(),
                stderr: format!("cuda-checkpoint: pid {pid}: {e}\n"),
                status: crate::exit::FAILURE,
            }
        }
    };
    let handle = match cryo_proc::ProcHandle::open(pid) {
        Ok(h) => h,
        Err(cryo_proc::ProcError::NoSuchProcess(_)) => return no_such_process(op, pid),
        Err(e) => {
            return Outcome {
                stdout: String::new(),
                stderr: format!("cuda-checkpoint: {e}\n"),
                status: crate::exit::FAILURE,
            }
        }
    };
    let gpu = match backend::resolve(choice, sim_dir) {
        Ok(r) => {
            tracing::debug!(note = ?r.note, "backend");
            let mut gpu = r.gpu;
            // The agent makes the driver calls when it runs (it guards the node); NVIDIA's
            // output is the same either way.
            match crate::route::driver_through_agent(&mut gpu, state) {
                Ok(through) => tracing::debug!(through_agent = through, "driver"),
                Err(e) => {
                    return Outcome {
                        stdout: String::new(),
                        stderr: format!("cuda-checkpoint: {e}\n"),
                        status: crate::exit::FAILURE,
                    }
                }
            }
            gpu
        }
        Err(e) => {
            return Outcome {
                stdout: String::new(),
                stderr: format!("cuda-checkpoint: {e}\n"),
                status: crate::exit::FAILURE,
            }
        }
    };
    // A toggle restores only what it finds checkpointed.
    let restores = match op {
        compat::Operation::Action(compat::Action::Restore) => {
            Some("cuda-checkpoint --action restore")
        }
        compat::Operation::Toggle
            if matches!(gpu.driver.state(pid), Ok(ProcessState::Checkpointed)) =>
        {
            Some("cuda-checkpoint --toggle")
        }
        _ => None,
    };
    let out = match restores {
        Some(how) => restore(&gpu, state, &handle, op, &map, how),
        None => compat::execute(gpu.driver.as_ref(), op, pid, timeout_ms, &map),
    };
    if out.status == crate::exit::SUCCESS && !handle.is_alive() {
        return no_such_process(op, pid);
    }
    out
}

/// A restore (`--action restore`, or a toggle out of CHECKPOINTED, which unlocks too), journaled
/// as restored before the driver is asked: a journal that cannot take the record means no
/// restore, and one that fails after it means the process is checkpointed again
/// (`cryo_lifecycle::restore_context`).
fn restore(
    gpu: &cryo_gpu::Gpu,
    state: &StateDir,
    handle: &cryo_proc::ProcHandle,
    op: compat::Operation,
    map: &[cryo_gpu::GpuPair],
    how: &str,
) -> Outcome {
    let pid = handle.pid();
    let failed = |stderr: String| Outcome {
        stdout: String::new(),
        stderr,
        status: crate::exit::FAILURE,
    };
    let journal = match state.open_journal() {
        Ok(j) => j,
        Err(e) => {
            return failed(format!(
                "cuda-checkpoint: pid {pid} not restored: cannot open the journal to record it first: {e}\n"
            ))
        }
    };
    let restored = cryo_lifecycle::restore_context(gpu, &journal, handle, map, how);
    if restored.is_ok() {
        // LOCKED: traced by the node's guard before anything may unlock it, or checkpointed
        // again. (Nothing is said when no guard runs: the output is NVIDIA's.)
        if let Err(why) = super::guard_restored(state, handle) {
            let again = match gpu.driver.checkpoint(pid) {
                Ok(()) => "the context was checkpointed again, not unlocked".to_string(),
                Err(e) => {
                    format!(
                        "checkpointing it again failed too ({e}): it stays LOCKED, not unlocked"
                    )
                }
            };
            return Outcome::failed_because(
                op,
                pid,
                &format!("{why}; {again}"),
                crate::exit::FAILURE,
            );
        }
    }
    let result = match restored {
        Ok(_) if op == compat::Operation::Toggle => gpu.driver.unlock(pid),
        Ok(_) => Ok(()),
        Err(cryo_lifecycle::RestoreError::Driver(e)) => Err(e),
        Err(e) => return failed(format!("cuda-checkpoint: {e}\n")),
    };
    match result {
        Ok(()) => Outcome::ok(String::new()),
        Err(e) => Outcome::failed(op, pid, &e),
    }
}

/// What the driver answers for a pid that does not exist.
fn no_such_process(op: compat::Operation, pid: Pid) -> Outcome {
    Outcome::failed(
        op,
        pid,
        &DriverError::Cuda {
            call: "cuCheckpointProcessGetState",
            pid,
            code: CuResult::INVALID_VALUE,
        },
    )
}
