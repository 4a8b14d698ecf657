//! [`InPlace`]: the activation of a worker parked in place, through the lifecycle's park and wake.

use std::sync::Arc;

use cryo_gpu::{Gpu, ProcessState};
use cryo_lifecycle::park::PlaceError;
use cryo_lifecycle::{
    NoProgress, Op, ParkError, ParkOptions, Target, WakeError, WakeOptions, Watcher,
};
use cryo_state::StateDir;

use crate::{Activation, ActivationError, Phase};

/// Wakes and parks `target` in place ([`cryo_lifecycle::wake`], [`cryo_lifecycle::park`]),
/// journaled in `state`, guarded before unlock by `watcher` (the agent's in-process guard, or
/// the standalone guard's socket client).
pub struct InPlace {
    /// The driver.
    pub gpu: Gpu,
    /// The worker.
    pub target: Target,
    /// Where the journal and the fence are.
    pub state: StateDir,
    /// Who traces woken processes before their unlock.
    pub watcher: Arc<dyn Watcher + Send + Sync>,
    /// How to park.
    pub park: ParkOptions,
    /// How to wake (which GPUs, what to do when full).
    pub wake: WakeOptions,
}

impl std::fmt::Debug for InPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InPlace")
            .field("target", &self.target)
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl InPlace {
    /// Where the worker is now: parked when one of its CUDA processes is CHECKPOINTED (or
    /// LOCKED: a wake that died half-way), active otherwise.
    pub fn phase_now(&self) -> Result<Phase, ActivationError> {
        let resolved = self
            .target
            .resolve()
            .map_err(|e| ActivationError::Failed(e.to_string()))?;
        let parked = resolved.handles().iter().any(|h| {
            matches!(
                self.gpu.driver.state(h.pid()),
                Ok(ProcessState::Checkpointed | ProcessState::Locked)
            )
        });
        Ok(if parked {
            Phase::Parked { last_error: None }
        } else {
            Phase::Active
        })
    }
}

impl Activation for InPlace {
    fn wake(&self) -> Result<(), ActivationError> {
        let failed = |e: &dyn std::fmt::Display| ActivationError::Failed(e.to_string());
        let resolved = self.target.resolve().map_err(|e| failed(&e))?;
        let journal = self.state.open_journal().map_err(|e| failed(&e))?;
        match cryo_lifecycle::wake(
            &self.gpu,
            &resolved,
            &self.wake,
            &journal,
            &self.state,
            self.watcher.as_ref(),
            &NoProgress,
        ) {
            Ok(_) => Ok(()),
            // A wake, a park or a settlement at work on it (or something restoring it): the
            // activator waits for it (the worker is about to serve, or to be parked and woken by
            // this activation, or resumed by a guard's or the agent's start).
            Err(
                e @ WakeError::InProgress {
                    doing: None | Some(Op::Wake | Op::Park | Op::Settle),
                    ..
                },
            ) => Err(ActivationError::Busy(e.to_string())),
            // Nothing done and nothing worth waiting for: no room, a fence, not parked, a stop or
            // a freeze at work (the worker is going away).
            Err(
                e @ (WakeError::Place(PlaceError::NoRoom { .. })
                | WakeError::Place(_)
                | WakeError::Fence(_)
                | WakeError::NotParked(_)
                | WakeError::DeadPark { .. }
                | WakeError::InProgress { .. }),
            ) => Err(ActivationError::Refused(e.to_string())),
            Err(e) => Err(failed(&e)),
        }
    }

    fn park(&self) -> Result<(), ActivationError> {
        let failed = |e: &dyn std::fmt::Display| ActivationError::Failed(e.to_string());
        let resolved = self.target.resolve().map_err(|e| failed(&e))?;
        let journal = self.state.open_journal().map_err(|e| failed(&e))?;
        match cryo_lifecycle::park(
            &self.gpu,
            &resolved,
            &self.park,
            &journal,
            &self.state,
            self.watcher.as_ref(),
            &NoProgress,
        ) {
            Ok(_) => Ok(()),
            Err(
                e @ (ParkError::HostMemory { .. }
                | ParkError::Suspend { .. }
                | ParkError::InProgress { .. }),
            ) => Err(ActivationError::Refused(e.to_string())),
            Err(e) => Err(failed(&e)),
        }
    }
}
