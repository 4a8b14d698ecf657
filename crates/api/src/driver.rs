//! The CUDA checkpoint API called through the agent: [`AgentDriver`] implements
//! [`cryo_gpu::CheckpointDriver`] by asking the agent (`POST /v1/gpu/{call}`) to make each call,
//! so that `cryo gpu lock|checkpoint|restore|unlock` and the `cuda-checkpoint` front end run their
//! own logic (prechecks, toggles, NVIDIA's output) unchanged while the agent, which guards the
//! node, makes every driver call. A driver's refusal comes back as the same
//! [`cryo_gpu::DriverError::Cuda`], code included.

use std::time::Duration;

use cryo_gpu::{CheckpointDriver, CuResult, DriverError, GpuPair, ProcessState};
use cryo_proc::Pid;
use serde::{Deserialize, Serialize};

use crate::AgentClient;

/// One call of the checkpoint API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuCall {
    /// `cuCheckpointProcessGetState` (a read).
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore`.
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId` (a read).
    RestoreThreadId,
}

impl GpuCall {
    /// Every call.
    pub const ALL: [GpuCall; 6] = [
        GpuCall::State,
        GpuCall::Lock,
        GpuCall::Checkpoint,
        GpuCall::Restore,
        GpuCall::Unlock,
        GpuCall::RestoreThreadId,
    ];

    /// Its word in the path (`/v1/gpu/lock`).
    pub fn as_str(self) -> &'static str {
        match self {
            GpuCall::State => "state",
            GpuCall::Lock => "lock",
            GpuCall::Checkpoint => "checkpoint",
            GpuCall::Restore => "restore",
            GpuCall::Unlock => "unlock",
            GpuCall::RestoreThreadId => "restore_thread_id",
        }
    }

    /// The call a path word names.
    pub fn parse(word: &str) -> Option<GpuCall> {
        GpuCall::ALL.into_iter().find(|c| c.as_str() == word)
    }

    /// The driver's entry point.
    pub fn entry_point(self) -> &'static str {
        match self {
            GpuCall::State => "cuCheckpointProcessGetState",
            GpuCall::Lock => "cuCheckpointProcessLock",
            GpuCall::Checkpoint => "cuCheckpointProcessCheckpoint",
            GpuCall::Restore => "cuCheckpointProcessRestore",
            GpuCall::Unlock => "cuCheckpointProcessUnlock",
            GpuCall::RestoreThreadId => "cuCheckpointProcessGetRestoreThreadId",
        }
    }

    /// Whether it changes the process (root only) or reads (the read group too).
    pub fn access(self) -> crate::Access {
        match self {
            GpuCall::State | GpuCall::RestoreThreadId => crate::Access::Read,
            _ => crate::Access::Change,
        }
    }

    /// `/v1/gpu/{call}`.
    pub fn path(self) -> String {
        format!("{}/{}", crate::path::GPU, self.as_str())
    }
}

/// `POST /v1/gpu/{call}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GpuCallRequest {
    /// The process.
    pub pid: Pid,
    /// Lock timeout, ms (`None`: no limit).
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Restore onto other GPUs.
    #[serde(default)]
    pub pairs: Vec<GpuPair>,
}

/// What a call returned: its value, or the driver's refusal.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GpuCallAnswer {
    /// A call without a value succeeded.
    Done,
    /// `state`.
    State(ProcessState),
    /// `restore_thread_id`.
    Tid(Pid),
    /// The driver refused or failed.
    DriverError(DriverFailure),
}

/// A driver call that failed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverFailure {
    /// The entry point.
    pub call: String,
    /// The `CUresult`, when the driver answered one.
    pub code: Option<u32>,
    /// The whole message.
    pub message: String,
}

impl DriverFailure {
    /// From the agent's driver error.
    pub fn of(e: &DriverError) -> Self {
        let call = match e {
            DriverError::Cuda { call, .. } => (*call).to_string(),
            _ => String::new(),
        };
        DriverFailure {
            call,
            code: e.code().map(|c| c.0),
            message: e.to_string(),
        }
    }

    /// Back to the driver error the caller would have had calling the driver itself.
    pub fn into_driver_error(self, asked: GpuCall, pid: Pid) -> DriverError {
        match self.code {
            Some(code) => DriverError::Cuda {
                call: GpuCall::ALL
                    .into_iter()
                    .map(GpuCall::entry_point)
                    .find(|e| *e == self.call)
                    .unwrap_or(asked.entry_point()),
                pid,
                code: CuResult(code),
            },
            None => DriverError::Remote {
                reason: self.message,
            },
        }
    }
}

/// The checkpoint API, called by the agent.
#[derive(Debug, Clone)]
pub struct AgentDriver {
    client: AgentClient,
}

impl AgentDriver {
    /// Calls through the agent `client` talks to.
    pub fn new(client: AgentClient) -> Self {
        AgentDriver { client }
    }

    fn call(
        &self,
        call: GpuCall,
        pid: Pid,
        timeout: Option<Duration>,
        pairs: &[GpuPair],
    ) -> Result<GpuCallAnswer, DriverError> {
        let req = GpuCallRequest {
            pid,
            timeout_ms: timeout.map(|t| t.as_millis().try_into().unwrap_or(u64::MAX)),
            pairs: pairs.to_vec(),
        };
        match self.client.gpu(call, &req) {
            Ok(GpuCallAnswer::DriverError(f)) => Err(f.into_driver_error(call, pid)),
            Ok(a) => Ok(a),
            Err(e) => Err(DriverError::Remote {
                reason: e.to_string(),
            }),
        }
    }

    fn done(
        &self,
        call: GpuCall,
        pid: Pid,
        t: Option<Duration>,
        p: &[GpuPair],
    ) -> Result<(), DriverError> {
        match self.call(call, pid, t, p)? {
            GpuCallAnswer::Done => Ok(()),
            other => Err(unexpected(call, &other)),
        }
    }
}

fn unexpected(call: GpuCall, a: &GpuCallAnswer) -> DriverError {
    DriverError::Remote {
        reason: format!("the agent answered {a:?} to {}", call.as_str()),
    }
}

impl CheckpointDriver for AgentDriver {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        match self.call(GpuCall::State, pid, None, &[])? {
            GpuCallAnswer::State(s) => Ok(s),
            other => Err(unexpected(GpuCall::State, &other)),
        }
    }

    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        self.done(GpuCall::Lock, pid, timeout, &[])
    }

    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        self.done(GpuCall::Checkpoint, pid, None, &[])
    }

    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.done(GpuCall::Restore, pid, None, pairs)
    }

    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        self.done(GpuCall::Unlock, pid, None, &[])
    }

    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        match self.call(GpuCall::RestoreThreadId, pid, None, &[])? {
            GpuCallAnswer::Tid(t) => Ok(t),
            other => Err(unexpected(GpuCall::RestoreThreadId, &other)),
        }
    }
}
