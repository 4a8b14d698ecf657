//! Where the guard's pins go so that they outlive it: the [`PinSink`] seam.
//!
//! # Design
//! At a dying process's exit stop the tracer takes duplicates of its driver fds; the guard
//! journals `Pinned`, fences the GPU, then hands the duplicates to its sink **while the process is
//! still held at its exit stop**. The sink returns only once the fds are held elsewhere (the pin
//! holder acknowledged every one); only then does the guard close its own copies and let the
//! tracer release the process. So at every instant the dying process, the guard's copies or the
//! holder's hold the context open. If the sink cannot take them, the guard keeps them in its own
//! process (journaled loudly: `PinsKeptByGuard`); they then close if the guard dies.
//!
//! [`HolderSink`] is the sink of the agent and of `cryo guard --pin-holder`: the pin holder of
//! the state directory ([`cryo_holder`]). A release goes to the sink too ([`PinSink::release`]).
//!
//! # Limitations
//! Between the duplication and the send (microseconds) the guard's copies are the only ones: a
//! SIGKILL of the guard exactly then lets the kernel release the process and its context is torn
//! down. From the send on, the fds are in the holder's socket buffer, which the guard's death
//! does not empty (the `pin-sent` failpoint test kills the guard there).

use std::os::fd::BorrowedFd;
use std::path::PathBuf;
use std::time::Duration;

use cryo_holder::{ClientError, HeldPin, HolderClient, HolderInfo, PinMeta, Refusal};
use cryo_journal::ProcId;
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;

/// Test hook: when set (to a path), [`HolderSink::hold`] sends the first part of a hold, creates
/// that file, and waits forever instead of reading the holder's acknowledgement, so that a test
/// can SIGKILL the guard at exactly that instant. Only root sets the agent's environment.
pub const FAILPOINT_PIN_SENT_ENV: &str = "CRYO_FAILPOINT_PIN_SENT";

/// How long a hold waits for a holder that is handing over to its successor.
const HANDOVER_PATIENCE: Duration = Duration::from_secs(10);
/// How long an inventory or a release waits when the socket exists but nothing answers (a
/// hand-over's last instant, or the stale socket of a holder that died).
const STALE_PATIENCE: Duration = Duration::from_secs(2);

/// Where pinned fds are held besides the guard's own process.
pub trait PinSink: Send + Sync + std::fmt::Debug {
    /// Hands over `fds` (`fds[i]` is the dead process's fd `meta.fds[i]`); returns once they are
    /// all held there, with who holds them. The caller's fds are untouched either way: it closes
    /// them only after `Ok`.
    fn hold(
        &self,
        meta: &PinMeta,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(ProcId, HeldPin), ClientError>;

    /// Who holds pins there and which; `Ok(None)`: nobody runs there.
    fn inventory(&self) -> Result<Option<(HolderInfo, Vec<HeldPin>)>, ClientError>;

    /// Closes the pins on `gpu` there; the pins closed (none when nothing was held there or
    /// nobody runs there).
    fn release(&self, gpu: &FencedGpu) -> Result<Vec<HeldPin>, ClientError>;
}

/// The pin holder of a state directory as the guard's sink.
#[derive(Debug, Clone)]
pub struct HolderSink {
    client: HolderClient,
    failpoint: Option<PathBuf>,
}

impl HolderSink {
    /// The sink of `state`'s pin holder (started or adopted by the caller: see
    /// [`cryo_holder::ensure`]).
    pub fn new(state: &StateDir) -> Self {
        Self {
            client: HolderClient::new(state),
            failpoint: std::env::var_os(FAILPOINT_PIN_SENT_ENV).map(PathBuf::from),
        }
    }

    fn hold_once(
        &self,
        meta: &PinMeta,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(ProcId, HeldPin), ClientError> {
        let mut session = self.client.connect_within(HANDOVER_PATIENCE)?;
        if let Some(path) = &self.failpoint {
            let first = &fds[..fds.len().min(cryo_holder::proto::MAX_FDS)];
            let part = PinMeta {
                fds: meta.fds.iter().take(first.len()).copied().collect(),
                ..meta.clone()
            };
            session.send_hold(&part, first)?;
            let _ = std::fs::write(path, std::process::id().to_string());
            tracing::error!("failpoint {FAILPOINT_PIN_SENT_ENV}: hold sent, waiting forever");
            loop {
                std::thread::park();
            }
        }
        let holder = session.holder.id;
        session.hold(meta, fds).map(|pin| (holder, pin))
    }
}

impl PinSink for HolderSink {
    fn hold(
        &self,
        meta: &PinMeta,
        fds: &[BorrowedFd<'_>],
    ) -> Result<(ProcId, HeldPin), ClientError> {
        match self.hold_once(meta, fds) {
            // The holder went away between our connection and its answer (it handed over to a
            // successor in that instant, or died): the successor, if any, gets the fds again.
            // Fds held twice are harmless; fds held nowhere are a wedge.
            Err(ClientError::Io { .. } | ClientError::Exiting(_)) => self.hold_once(meta, fds),
            other => other,
        }
    }

    fn inventory(&self) -> Result<Option<(HolderInfo, Vec<HeldPin>)>, ClientError> {
        match self.client.connect_patiently(STALE_PATIENCE) {
            Ok(mut s) => s.inventory().map(Some),
            Err(ClientError::NotRunning(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    fn release(&self, gpu: &FencedGpu) -> Result<Vec<HeldPin>, ClientError> {
        let mut session = match self.client.connect_patiently(STALE_PATIENCE) {
            Ok(s) => s,
            Err(ClientError::NotRunning(_)) => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        match session.release(gpu) {
            Err(ClientError::Refused(Refusal::NotHeld { .. })) => Ok(Vec::new()),
            other => other,
        }
    }
}

/// The pins `holder` holds, as the status shows them (none, with an error logged, when it cannot
/// be asked).
pub fn holder_pins(holder: &dyn PinSink) -> Vec<crate::guard::PinInfo> {
    match holder.inventory() {
        Ok(Some((info, pins))) => pins
            .into_iter()
            .map(|p| crate::guard::PinInfo {
                pid: p.meta.pid.pid,
                start_time: p.meta.pid.start_time,
                gpus: p.meta.gpus,
                fds: p.meta.fds,
                cause: p.meta.cause,
                holder: Some(info.id.pid),
            })
            .collect(),
        Ok(None) => Vec::new(),
        Err(err) => {
            tracing::error!(%err, "cannot ask the pin holder for its pins");
            Vec::new()
        }
    }
}

/// A pin a release would close (it holds a context on a GPU the release names) that also holds
/// contexts on GPUs it does not name: its process and those GPUs. A pin cannot be closed for
/// one GPU only (see [`closed_elsewhere`]), so such a release would tear down contexts the
/// operator did not name; it is refused before anything is closed.
pub(crate) fn spans_unnamed<'a>(
    pins: impl IntoIterator<Item = (ProcId, &'a [FencedGpu])>,
    named: &[FencedGpu],
) -> Option<(ProcId, Vec<FencedGpu>)> {
    pins.into_iter().find_map(|(pid, gpus)| {
        let others: Vec<FencedGpu> = gpus
            .iter()
            .filter(|g| !named.contains(g))
            .cloned()
            .collect();
        (gpus.iter().any(|g| named.contains(g)) && !others.is_empty()).then_some((pid, others))
    })
}

/// Journals `PinsReleased` for each pin the holder closed on `gpu` (of a release naming
/// `named`); the processes.
pub(crate) fn journal_released(
    journal: &cryo_journal::Journal,
    gpu: &FencedGpu,
    named: &[FencedGpu],
    closed: &[HeldPin],
) -> Vec<ProcId> {
    let mut pids = Vec::new();
    for p in closed {
        tracing::warn!(pid = p.meta.pid.pid, %gpu, fds = p.held, "the pin holder closed pins on the operator's request");
        if let Err(err) = journal.append(cryo_journal::Event::PinsReleased { pid: p.meta.pid }) {
            tracing::error!(%err, "cannot write the journal");
        }
        closed_elsewhere(journal, gpu, named, p.meta.pid, &p.meta.gpus);
        pids.push(p.meta.pid);
    }
    pids
}

/// A pin holds a process's contexts on every GPU it used, and its driver fds cannot be told
/// apart per GPU (on the real driver `/dev/nvidiactl` and `/dev/nvidia-uvm` serve all of them,
/// and what closing only `/dev/nvidiaN` frees was never measured): releasing it for `released`
/// closes its contexts on its other GPUs too. A release is refused unless it names all of them
/// ([`spans_unnamed`]); one that closed a pin on a GPU it did not name all the same (a pin taken
/// between the check and the close) leaves that GPU fenced (never lifted without the operator
/// naming it) and says so, in the log and the journal.
pub(crate) fn closed_elsewhere(
    journal: &cryo_journal::Journal,
    released: &FencedGpu,
    named: &[FencedGpu],
    pid: ProcId,
    gpus: &[FencedGpu],
) {
    for other in gpus.iter().filter(|g| !named.contains(g)) {
        let reason = format!(
            "the release of GPU {released} closed pid {}'s pins, which held its contexts on every GPU it used: its context on GPU {other} is gone too; GPU {other} stays fenced until released",
            pid.pid
        );
        tracing::warn!(pid = pid.pid, %released, %other, "{reason}");
        if let Err(err) = journal.append(cryo_journal::Event::GpuQuarantined {
            gpu: other.to_string(),
            reason,
        }) {
            tracing::error!(%err, "cannot write the journal");
        }
    }
}

/// Releasing without a running guard failed.
#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    /// The pin holder could not be asked (nothing was closed, the fence holds).
    #[error("the pin holder could not release {gpu}: {source}")]
    Holder {
        /// The GPU.
        gpu: FencedGpu,
        /// Why.
        source: ClientError,
    },
    /// The journal could not be opened.
    #[error("cannot open the journal: {0}")]
    Journal(#[from] cryo_journal::OpenError),
    /// The fence store failed.
    #[error(transparent)]
    Fence(#[from] cryo_state::fence::FenceError),
    /// Nothing is pinned or quarantined for that GPU.
    #[error("GPU {0} is neither pinned by the pin holder nor quarantined (and no guard runs)")]
    NotPinned(FencedGpu),
    /// A pin the release would close also holds contexts on GPUs it does not name.
    #[error("{}", other_gpus_message(*.pid, .others))]
    OtherGpus {
        /// The process whose pin it is.
        pid: ProcId,
        /// The GPUs not named.
        others: Vec<FencedGpu>,
    },
}

/// The refusal of a release that would close contexts on GPUs it does not name.
pub(crate) fn other_gpus_message(pid: ProcId, others: &[FencedGpu]) -> String {
    let list: Vec<String> = others.iter().map(ToString::to_string).collect();
    format!(
        "pid {}'s pins also hold its contexts on {} (a pin cannot be closed for one GPU only: its driver fds serve every GPU it used); nothing was closed: name every one of them to release them together (--gpu {})",
        pid.pid,
        list.join(", "),
        list.join(" --gpu ")
    )
}

/// The operator's release when no guard runs (the agent is down): closes the pin holder's pins on
/// the GPUs `gpus` names, journals `PinsReleased` for each, and lifts their quarantine; refused
/// before anything is closed when a pin also holds contexts on a GPU not named
/// ([`ReleaseError::OtherGpus`]). Returns the processes whose pins were closed.
pub fn release_without_guard(
    state: &StateDir,
    gpus: &[FencedGpu],
) -> Result<Vec<ProcId>, ReleaseError> {
    let holder = HolderSink::new(state);
    let first = gpus.first().cloned().unwrap_or(FencedGpu::Unknown);
    let held = match holder.inventory() {
        Ok(Some((_, pins))) => pins,
        Ok(None) => Vec::new(),
        Err(source) => return Err(ReleaseError::Holder { gpu: first, source }),
    };
    if let Some((pid, others)) =
        spans_unnamed(held.iter().map(|p| (p.meta.pid, &p.meta.gpus[..])), gpus)
    {
        return Err(ReleaseError::OtherGpus { pid, others });
    }
    let journal = state.open_journal()?;
    let mut released = Vec::new();
    let mut anything = false;
    for gpu in gpus {
        let closed = holder.release(gpu).map_err(|source| ReleaseError::Holder {
            gpu: gpu.clone(),
            source,
        })?;
        let lifted = state.fence().release(gpu)?;
        anything |= !closed.is_empty() || lifted.is_some();
        released.extend(journal_released(&journal, gpu, gpus, &closed));
    }
    if !anything {
        return Err(ReleaseError::NotPinned(first));
    }
    Ok(released)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(n: u8) -> FencedGpu {
        FencedGpu::Gpu(cryo_gpu::GpuUuid::from_bytes([n; 16]))
    }

    /// A release closes a pin only when it names every GPU the pin holds contexts on; pins on
    /// GPUs it does not touch at all are none of its business.
    #[test]
    fn a_release_must_name_every_gpu_of_the_pins_it_closes() {
        let (a, b) = (ProcId::new(10, 1), ProcId::new(11, 1));
        let both = [gpu(1), gpu(2)];
        let other = [gpu(3)];
        let pins = || [(a, &both[..]), (b, &other[..])];
        assert_eq!(spans_unnamed(pins(), &[gpu(1)]), Some((a, vec![gpu(2)])));
        assert_eq!(spans_unnamed(pins(), &[gpu(2)]), Some((a, vec![gpu(1)])));
        assert_eq!(spans_unnamed(pins(), &[gpu(1), gpu(2)]), None);
        assert_eq!(spans_unnamed(pins(), &[gpu(3)]), None);
        assert_eq!(spans_unnamed(pins(), &[FencedGpu::Unknown]), None);
    }
}
