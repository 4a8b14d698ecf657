//! Who is a CUDA process: the one decision that says which processes must be suspended before
//! they end, made from evidence the kernel and NVML give, never from a driver error code alone.
//!
//! # Design
//! The driver's answer to `cuCheckpointProcessGetState` comes first:
//! - a state (RUNNING, LOCKED, CHECKPOINTED, FAILED): a CUDA process in that state;
//! - a state this build does not know (newer drivers add CHECKPOINTING and RESTORING, 4 and 5):
//!   the driver is in the middle of something; ask again until it settles (bounded), and refuse
//!   if it does not. Never "not CUDA".
//! - an error: then the evidence decides. The evidence is what NVML lists for the pid (device
//!   memory: a live context) and the driver files it holds (`/dev/nvidia*`; the simulated
//!   driver's sockets; recognised in one place, `cryo_proc::DriverFiles`, through the backend's
//!   [`cryo_gpu::GpuInspector::driver_fds`]). A context cannot exist without driver files: the
//!   driver frees it when the last one closes.
//!   - `CUDA_ERROR_NOT_INITIALIZED` or `CUDA_ERROR_INVALID_VALUE` (what NVIDIA's own agent reads
//!     as "no CUDA state"): without driver files and unlisted, a plain process; with driver files
//!     but no memory listed, a process that only opened the driver (`cuInit` in a launcher or an
//!     API server): it holds no context to tear down, so it ends like a plain process, said as
//!     such; listed by NVML: the answers contradict each other, a refusal.
//!   - no answer in time (the caller's deadline, [`DriverError::is_no_answer`]): a refusal naming
//!     the pid, whatever the evidence. A driver that answers nothing for one process may be
//!     waiting for its restore thread, which cannot run while CRIU or a debugger holds the
//!     process: a CHECKPOINTED CUDA process held so has no driver files and nothing in NVML,
//!     exactly as a plain process (the simulated driver answers so; the real one's answer for a
//!     held process is unknown). Never read as plain: ending it as plain, while its holder can
//!     still restore it, could tear a live restored context down.
//!   - any other answer (another code, an unreachable driver): with driver files or listed by
//!     NVML, a refusal naming the pid, the call and the answer; without either, nothing of it
//!     lives on a GPU, a plain process.
//! - A process that exits while it is looked at has left the target.
//!
//! Pids are processes (thread group ids): a [`ProcHandle`] only ever names a process, and a
//! target resolves thread ids to their process first (the driver takes a thread id for its
//! process, NVIDIA/cuda-checkpoint#41).

use std::time::{Duration, Instant};

use cryo_gpu::{CuResult, DriverError, Gpu, GpuProcess, ProcessState};
use cryo_proc::{Pid, ProcHandle};

/// What a process is, as far as ending it goes.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Class {
    /// The driver holds CUDA state for it: it is suspended before it ends.
    Cuda {
        /// The state the driver answered.
        state: ProcessState,
    },
    /// No CUDA context: no driver files, not listed by NVML, and the driver knows no state.
    Plain,
    /// It opened the driver (`cuInit`) but holds no context: driver files, nothing listed by NVML,
    /// and the driver knows no checkpoint state for it. Ending it tears nothing down.
    DriverOnly {
        /// Its driver fds.
        fds: Vec<i32>,
    },
    /// It exited while it was looked at.
    Exited,
}

impl Class {
    /// Whether it must be suspended before it ends.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Class::Cuda { .. })
    }
}

/// The evidence contradicts itself or cannot be had: the process is neither known to be plain
/// nor known to be a CUDA process that can be suspended. A refusal, never a kill.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("pid {pid}: {call} answered {answer}{}", evidence_text(.evidence))]
pub struct Unsure {
    /// The process.
    pub pid: Pid,
    /// The driver entry point (or the question) that answered.
    pub call: String,
    /// Its answer: the driver's code (`CUDA_ERROR_UNKNOWN`), or the error.
    pub answer: String,
    /// What the kernel and NVML show that makes the answer unusable (empty when the evidence
    /// itself could not be read).
    pub evidence: String,
}

fn evidence_text(e: &str) -> String {
    if e.is_empty() {
        String::new()
    } else {
        format!(", but {e}")
    }
}

/// How long an unknown or in-progress driver state is waited for by default before refusing.
pub const SETTLE: Duration = Duration::from_secs(5);

/// What the driver answers for `pid`, asked again while it reports a state this build does not
/// know (an operation in progress), until it settles or `settle` has passed.
pub fn settled_state(gpu: &Gpu, pid: Pid, settle: Duration) -> Result<ProcessState, DriverError> {
    let until = Instant::now() + settle;
    loop {
        match gpu.driver.state(pid) {
            Err(DriverError::UnknownState { .. }) if Instant::now() < until => {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

/// Classifies `h` (see the module docs). `listed` is NVML's process list, taken once for all the
/// processes being classified; `settle` bounds the wait for an in-progress state.
pub fn classify(
    gpu: &Gpu,
    h: &ProcHandle,
    listed: &[GpuProcess],
    settle: Duration,
) -> Result<Class, Unsure> {
    let pid = h.pid();
    let err = match settled_state(gpu, pid, settle) {
        Ok(state) => return Ok(Class::Cuda { state }),
        Err(e) => e,
    };
    if !h.is_alive() {
        return Ok(Class::Exited);
    }
    let call = "cuCheckpointProcessGetState".to_string();
    let answer = match (&err, err.code()) {
        (_, Some(code)) => code.to_string(),
        (DriverError::UnknownState { raw, .. }, None) => {
            // The driver holds state for it, in a step this build does not know: never plain.
            return Err(Unsure {
                pid,
                call,
                answer: format!(
                    "state {raw} (unknown to this cryo: an operation in progress?) for {} ms",
                    settle.as_millis()
                ),
                evidence: String::new(),
            });
        }
        (e, None) => e.to_string(),
    };
    let memory: u64 = listed
        .iter()
        .filter(|p| p.pid == pid)
        .map(|p| p.used_memory)
        .sum();
    let is_listed = listed.iter().any(|p| p.pid == pid);
    let fds = match gpu.inspect.driver_fds(pid) {
        Ok(fds) => fds,
        Err(_) if !h.is_alive() => return Ok(Class::Exited),
        Err(e) => {
            return Err(Unsure {
                pid,
                call,
                answer,
                evidence: format!("its driver files cannot be listed ({e})"),
            })
        }
    };
    let no_state = matches!(
        err.code(),
        Some(CuResult::NOT_INITIALIZED) | Some(CuResult::INVALID_VALUE)
    );
    let evidence = if err.is_no_answer() {
        // Perhaps a CUDA process whose restore thread cannot run (see the module docs).
        "no answer from the driver: perhaps a CUDA process that cannot run its restore thread (held by CRIU or a debugger)".to_string()
    } else if is_listed {
        format!(
            "NVML lists {} of device memory for it",
            cryo_units::fmt_bytes(memory)
        )
    } else if !fds.is_empty() && !no_state {
        format!("it holds {} driver files", fds.len())
    } else if !h.is_alive() {
        return Ok(Class::Exited);
    } else if fds.is_empty() {
        return Ok(Class::Plain);
    } else {
        return Ok(Class::DriverOnly { fds });
    };
    Err(Unsure {
        pid,
        call,
        answer,
        evidence,
    })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::fake::{Call, FakeGpu};
    use cryo_testkit::procs::Procs;

    fn class(fake: &FakeGpu, pid: Pid) -> Result<Class, Unsure> {
        let gpu = fake.gpu();
        let listed = cryo_gpu::GpuInspector::processes(fake).unwrap();
        classify(
            &gpu,
            &ProcHandle::open(pid).unwrap(),
            &listed,
            Duration::from_millis(300),
        )
    }

    #[test]
    fn a_state_is_a_cuda_process_and_no_state_without_evidence_is_plain() {
        let p = Procs::spawn(2);
        let fake = FakeGpu::new();
        fake.add(p.pid(0));
        assert_eq!(
            class(&fake, p.pid(0)),
            Ok(Class::Cuda {
                state: ProcessState::Running
            })
        );
        assert_eq!(class(&fake, p.pid(1)), Ok(Class::Plain));
    }

    #[test]
    fn driver_files_without_a_context_end_like_a_plain_process_said_as_such() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.driver_files(p.pid(0), &[5, 6]);
        assert_eq!(
            class(&fake, p.pid(0)),
            Ok(Class::DriverOnly { fds: vec![5, 6] })
        );
    }

    #[test]
    fn an_unexpected_answer_with_driver_files_is_a_refusal_naming_pid_call_and_code() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.driver_files(p.pid(0), &[5]);
        fake.fail_next_on(p.pid(0), Call::State, CuResult::UNKNOWN);
        let u = class(&fake, p.pid(0)).unwrap_err();
        assert_eq!(u.pid, p.pid(0));
        assert_eq!(u.call, "cuCheckpointProcessGetState");
        assert_eq!(u.answer, "CUDA_ERROR_UNKNOWN");
        assert!(u.evidence.contains("driver files"), "{u}");
    }

    #[test]
    fn an_unexpected_answer_without_evidence_is_plain() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.fail_next_on(p.pid(0), Call::State, CuResult::UNKNOWN);
        assert_eq!(class(&fake, p.pid(0)), Ok(Class::Plain));
    }

    /// A CHECKPOINTED process that CRIU or a debugger holds has no driver files and nothing in
    /// NVML; a driver that waits for its restore thread never answers for it. No answer is
    /// never "plain", whatever the evidence (it was until session 23: killed as plain).
    #[test]
    fn no_answer_without_evidence_is_a_refusal_naming_the_pid() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        let hang = fake.hang_next(p.pid(0), Call::State);
        let gpu = fake.gpu().bounded(cryo_gpu::Limits {
            query: Duration::from_millis(300),
            ..cryo_gpu::Limits::default()
        });
        let listed = cryo_gpu::GpuInspector::processes(&fake).unwrap();
        let h = ProcHandle::open(p.pid(0)).unwrap();
        let u = classify(&gpu, &h, &listed, Duration::from_millis(300)).unwrap_err();
        hang.release();
        assert_eq!(u.pid, p.pid(0));
        assert_eq!(u.call, "cuCheckpointProcessGetState");
        assert!(u.answer.contains("did not return"), "{u}");
        assert!(u.evidence.contains("no answer from the driver"), "{u}");
    }

    #[test]
    fn no_state_while_nvml_lists_memory_is_a_refusal() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.add(p.pid(0)).keep_listed(p.pid(0));
        fake.fail_next_on(p.pid(0), Call::State, CuResult::NOT_INITIALIZED);
        let u = class(&fake, p.pid(0)).unwrap_err();
        assert_eq!(u.answer, "CUDA_ERROR_NOT_INITIALIZED");
        assert!(u.evidence.contains("NVML lists"), "{u}");
    }

    #[test]
    fn an_in_progress_state_is_waited_for_then_decided() {
        let p = Procs::spawn(1);
        let fake = FakeGpu::new();
        fake.add(p.pid(0))
            .set_state(p.pid(0), ProcessState::Checkpointed);
        fake.unknown_state_next(p.pid(0), 4, 2);
        assert_eq!(
            class(&fake, p.pid(0)),
            Ok(Class::Cuda {
                state: ProcessState::Checkpointed
            })
        );
        // One that never settles is a refusal, never "not CUDA".
        fake.unknown_state_next(p.pid(0), 5, 1000);
        let u = class(&fake, p.pid(0)).unwrap_err();
        assert!(u.answer.contains("state 5"), "{u}");
    }
}
