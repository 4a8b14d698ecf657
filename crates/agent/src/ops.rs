//! What each request does: the lifecycle's and the guard's own entry points, the same the
//! standalone commands call, with the options the request's one conversion gives.

use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use cryo_api::{
    AgentStatus, ApiError, AttachReport, DetachReport, DriverFailure, ErrorKind, FreezeRequest,
    GpuCall, GpuCallAnswer, GpuCallRequest, ProgressEvent, ReleaseReport, ReleaseRequest,
    StopRequest, StreamLine, SyslogStatus, ThawRequest,
};
use cryo_journal::ProcId;
use cryo_lifecycle::{
    FreezeError, FreezeReport, Progress, Resolved, StopReport, ThawError, ThawReport,
};
use cryo_proc::Pid;
use tokio::sync::mpsc;

use crate::Agent;

/// A failure of the operation itself (500), with its message.
fn failed(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorKind::Failed, e.to_string())
}

/// A refusal: nothing was done (409).
fn refused(e: impl std::fmt::Display) -> ApiError {
    ApiError::new(ErrorKind::Refused, e.to_string())
}

impl Agent {
    /// `GET /v1/status`.
    pub(crate) fn status(&self) -> AgentStatus {
        let started_unix = self
            .started
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let uptime_s = SystemTime::now()
            .duration_since(self.started)
            .map_or(0, |d| d.as_secs());
        let (quarantined, fence_error) = match self.state.fence().list() {
            Ok(q) => (q, None),
            Err(e) => (Vec::new(), Some(e.to_string())),
        };
        AgentStatus {
            version: env!("CARGO_PKG_VERSION").to_string(),
            pid: std::process::id(),
            started_unix,
            uptime_s,
            socket: self.socket.clone(),
            state_dir: self.state.root().to_path_buf(),
            read_group: self.read_group.as_ref().map(|g| g.0.clone()),
            backend: self.gpu.kind.to_string(),
            guard: self.guard.status(),
            quarantined,
            fence_error,
            holder: match cryo_holder::HolderClient::new(&self.state).inventory() {
                Ok(Some((info, pins))) => format!(
                    "pid {} (cryo {}), {} pin(s), cgroup {}",
                    info.id.pid,
                    info.version,
                    pins.len(),
                    info.cgroup
                ),
                Ok(None) => {
                    "NOT RUNNING: pins would be held in the agent's own process".to_string()
                }
                Err(e) => format!("cannot ask it: {e}"),
            },
            metrics_addr: self.telemetry.metrics_addr().map(|a| a.to_string()),
            syslog: self.telemetry.forwarder().map(|f| SyslogStatus {
                collector: self.syslog.clone().unwrap_or_default(),
                delivered_seq: f.delivered_seq,
                connected: f.connected,
                last_error: f.last_error,
            }),
            stopping: self.stopping(),
        }
    }

    /// `POST /v1/stop`. `confined`: the caller's container, which every process of the target
    /// must be in (see [`crate::k8s`]).
    pub(crate) fn stop(
        &self,
        req: &StopRequest,
        confined: Option<&cryo_kube::CgroupIdentity>,
        progress: &dyn Progress,
    ) -> Result<StopReport, ApiError> {
        let target = req.target();
        let resolved = target
            .resolve()
            .map_err(|e| ApiError::new(ErrorKind::NotFound, e.to_string()))?;
        if let Some(caller) = confined {
            crate::k8s::authorize_stop(caller, &resolved)?;
        }
        self.stop_resolved(req, &resolved, progress, false)
    }

    /// The stop of a resolved target; `when_free`: waiting for a park or a wake at work on it
    /// (a preStop's, [`cryo_lifecycle::stop_when_free`]) rather than refused at once.
    pub(crate) fn stop_resolved(
        &self,
        req: &StopRequest,
        resolved: &Resolved,
        progress: &dyn Progress,
        when_free: bool,
    ) -> Result<StopReport, ApiError> {
        let stop = if when_free {
            cryo_lifecycle::stop_when_free
        } else {
            cryo_lifecycle::stop
        };
        stop(&self.gpu, resolved, &req.options(), &self.journal, progress).map_err(|e| match e {
            // A park or a wake at work on it: nothing was done (409), as theirs.
            e @ cryo_lifecycle::StopError::InProgress { .. } => refused(e),
            e => failed(e),
        })
    }

    /// `POST /v1/freeze`: the guard in this process lets go of the tree around the dump.
    pub(crate) fn freeze(
        &self,
        req: &FreezeRequest,
        progress: &dyn Progress,
    ) -> Result<FreezeReport, ApiError> {
        let criu = cryo_criu::CriuRpc::locate_in(None, &self.state.criu_dir()).map_err(failed)?;
        let root = cryo_lifecycle::open_process(req.pid)
            .map_err(|e| ApiError::new(ErrorKind::NotFound, e.to_string()))?;
        // Walked from the root, settled again at CRIU's gate (`Resolved::tree_walked`).
        let tree = Resolved::tree_walked(root);
        let frozen = cryo_lifecycle::freeze(
            &self.gpu,
            &criu,
            &tree,
            &req.options(),
            &self.journal,
            self.guard.as_ref(),
            progress,
        );
        // What an earlier freeze that died mid-dump left pinned (after this freeze's own pins
        // are given back, and after its report's moments).
        match cryo_lifecycle::cpus::give_back_dead_pins(&self.journal) {
            Ok(settled) => settled.iter().for_each(|s| tracing::warn!("{s}")),
            Err(err) => {
                tracing::warn!(%err, "cannot give back the CPU sets a dead freeze left pinned")
            }
        }
        match frozen {
            Ok(r) => Ok(r),
            Err(
                e @ (FreezeError::Refused(_)
                | FreezeError::CrossProcessCuda { .. }
                | FreezeError::CudaProcessEnded { .. }
                | FreezeError::KeepsForking { .. }
                | FreezeError::InProgress { .. }),
            ) => Err(refused(e)),
            Err(e) => Err(failed(e)),
        }
    }

    /// `POST /v1/thaw`: on the thread that reaps restored workers ([`crate::parent`]); the
    /// guard in this process traces the restored processes while they are LOCKED, before the
    /// thaw unlocks them.
    pub(crate) fn thaw(
        self: &Arc<Self>,
        req: &ThawRequest,
        requested: Instant,
        progress: &StreamProgress,
    ) -> Result<ThawReport, ApiError> {
        let (agent, req, progress) = (Arc::clone(self), req.clone(), progress.clone());
        self.parent
            .run(move || agent.thaw_here(&req, requested, &progress))
            .unwrap_or_else(|| Err(failed("the agent's thaw thread is gone")))
    }

    fn thaw_here(
        &self,
        req: &ThawRequest,
        requested: Instant,
        progress: &dyn Progress,
    ) -> Result<ThawReport, ApiError> {
        let opts = req.options(requested);
        if let Some(h) = &opts.health {
            h.validate()
                .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        }
        let criu = cryo_criu::CriuRpc::locate_in(None, &self.state.criu_dir()).map_err(failed)?;
        match cryo_lifecycle::thaw(
            &self.gpu,
            &criu,
            &req.image,
            &opts,
            &self.journal,
            &self.state.fence(),
            self.guard.as_ref(),
            progress,
        ) {
            Ok(r) => Ok(r),
            Err(e @ (ThawError::Image(_) | ThawError::Precheck(_))) => Err(refused(e)),
            Err(e) => Err(failed(e)),
        }
    }

    /// `POST /v1/gpu/{call}`: the driver call, on this agent's driver. The caller's own logic
    /// (prechecks, the `cuda-checkpoint` front end's toggle) runs on its side around it. A
    /// restore is answered only once the guard traces the process, still LOCKED (see
    /// [`Agent::trace_restored`]): whoever unlocks it next unlocks a guarded process.
    pub(crate) fn gpu_call(
        &self,
        call: GpuCall,
        req: &GpuCallRequest,
    ) -> Result<GpuCallAnswer, ApiError> {
        let d = &self.gpu.driver;
        let pid = req.pid;
        let r = match call {
            GpuCall::State => d.state(pid).map(GpuCallAnswer::State),
            GpuCall::Lock => d
                .lock(pid, req.timeout_ms.map(Duration::from_millis))
                .map(|()| GpuCallAnswer::Done),
            GpuCall::Checkpoint => d.checkpoint(pid).map(|()| GpuCallAnswer::Done),
            GpuCall::Restore => d.restore(pid, &req.pairs).map(|()| GpuCallAnswer::Done),
            GpuCall::Unlock => d.unlock(pid).map(|()| GpuCallAnswer::Done),
            GpuCall::RestoreThreadId => d.restore_thread_id(pid).map(GpuCallAnswer::Tid),
        };
        let answer = r.unwrap_or_else(|e| GpuCallAnswer::DriverError(DriverFailure::of(&e)));
        if call == GpuCall::Restore && answer == GpuCallAnswer::Done {
            self.trace_restored(pid)?;
        }
        Ok(answer)
    }

    /// The context of `pid` was just restored and is LOCKED: the guard traces the process before
    /// the restore is answered. When it cannot, the context is checkpointed again (never left
    /// to be unlocked unguarded) and the restore fails.
    fn trace_restored(&self, pid: Pid) -> Result<(), ApiError> {
        let process = cryo_proc::tgid(pid).ok().flatten().unwrap_or(pid);
        let traced = cryo_proc::ProcHandle::open(process)
            .map_err(|e| e.to_string())
            .and_then(|h| {
                cryo_lifecycle::Watcher::guard_before_unlock(self.guard.as_ref(), &[&h])
                    .map_err(|e| e.to_string())
            });
        let Err(why) = traced else {
            return Ok(());
        };
        tracing::error!(pid = process, %why, "a restored context could not be traced before its unlock");
        let t = std::time::Instant::now();
        let again = match self.gpu.driver.checkpoint(pid) {
            Ok(()) => {
                // Suspended since its restore: its end is the safe kind (the exit-stop decision
                // reads this).
                if let Ok(id) = ProcId::of(process) {
                    let ms = u64::try_from(t.elapsed().as_millis()).unwrap_or(u64::MAX);
                    if let Err(e) = self.journal.append(cryo_journal::Event::Checkpointed {
                        pid: id,
                        ms,
                        bytes: 0,
                    }) {
                        tracing::error!(pid = process, error = %e, "cannot journal the checkpoint");
                    }
                }
                "its context was checkpointed again, not unlocked".to_string()
            }
            Err(e) => format!("checkpointing it again failed too ({e}): it stays LOCKED; do not unlock it unguarded"),
        };
        let because =
            format!("the agent's guard could not trace pid {process} after its restore ({why})");
        // CRIU's cuda plugin keeps 127 bytes of the front end's output (`Could not restore on
        // process ID P: "through the node agent: ` takes 63-65): the reason and the supported
        // path come first.
        Err(failed(match criu_tracer(process) {
            Some(t) => format!(
                "traced by CRIU: use `cryo thaw`, not CRIU's cuda plugin; {again}. CRIU's cuda \
                 plugin restores a process while CRIU (here pid {t}) still traces it, so no guard \
                 can trace it before its unlock ({because}); with the \
                 agent running, restore CUDA workers with `cryo thaw IMAGE`, which has the agent \
                 trace them while LOCKED, or bring this one back with `cryo gpu restore` and \
                 `cryo gpu unlock` once CRIU has let go of it"
            ),
            None => format!("{because}; {again}"),
        }))
    }

    /// `POST /v1/guard/attach`.
    pub(crate) fn attach(&self, pid: ProcId) -> Result<AttachReport, ApiError> {
        use cryo_guard::guard::GuardAttachError;
        match self.guard.attach_id(pid) {
            Ok(()) => Ok(AttachReport { pid }),
            Err(e @ GuardAttachError::Proc(_)) => {
                Err(ApiError::new(ErrorKind::NotFound, e.to_string()))
            }
            Err(e @ GuardAttachError::Attach(_)) => Err(refused(e)),
            Err(e) => Err(failed(e)),
        }
    }

    /// `POST /v1/guard/detach`.
    pub(crate) fn detach(&self, pid: ProcId) -> Result<DetachReport, ApiError> {
        use cryo_guard::guard::GuardDetachError;
        match self.guard.detach(pid) {
            Ok(()) => Ok(DetachReport::Detached),
            Err(GuardDetachError::NotTraced { .. }) => Ok(DetachReport::NotTraced),
            Err(e) => Err(failed(e)),
        }
    }

    /// `POST /v1/guard/release`.
    pub(crate) fn release(&self, req: &ReleaseRequest) -> Result<ReleaseReport, ApiError> {
        use cryo_guard::guard::ReleaseError;
        match self
            .guard
            .release(&[vec![req.gpu.clone()], req.also.clone()].concat())
        {
            Ok(pids) => Ok(ReleaseReport { pids }),
            Err(e @ ReleaseError::NotPinned(_)) => {
                Err(ApiError::new(ErrorKind::NotFound, e.to_string()))
            }
            Err(e @ ReleaseError::OtherGpus { .. }) => {
                Err(ApiError::new(ErrorKind::Refused, e.to_string()))
            }
            Err(e) => Err(failed(e)),
        }
    }
}

/// Progress of a long operation, sent to its caller as NDJSON lines. A caller that left (or
/// reads slowly) loses lines, never holds up the operation.
#[derive(Debug, Clone)]
pub(crate) struct StreamProgress {
    tx: mpsc::Sender<Bytes>,
}

impl StreamProgress {
    pub(crate) fn new(tx: mpsc::Sender<Bytes>) -> Self {
        StreamProgress { tx }
    }

    fn send(&self, e: ProgressEvent) {
        let line: StreamLine<()> = StreamLine::Progress(e);
        let _ = self.tx.try_send(crate::server::ndjson(&line));
    }
}

impl Progress for StreamProgress {
    fn begin(&self, pid: Pid, step: &'static str, total: u64) {
        self.send(ProgressEvent::Begin {
            pid,
            step: step.to_string(),
            total,
        });
    }

    fn advance(&self, pid: Pid, done: u64) {
        self.send(ProgressEvent::Advance { pid, done });
    }

    fn end(&self, pid: Pid, step: &'static str, ok: bool, detail: &str) {
        self.send(ProgressEvent::End {
            pid,
            step: step.to_string(),
            ok,
            detail: detail.to_string(),
        });
    }
}

/// How often a follower checks that its caller is still there and the agent still runs.
const FOLLOW_TICK: Duration = Duration::from_millis(500);

/// `GET /v1/events`: the journal's records after `since` as NDJSON; with `follow`, then each
/// one as it is written, until the caller leaves or the agent stops.
pub(crate) fn follow_events(agent: &Agent, since: u64, follow: bool, tx: &mpsc::Sender<Bytes>) {
    let mut f = cryo_telemetry::Follow::new(agent.state.journal_dir(), since);
    loop {
        let records = match f.poll_new() {
            Ok(r) => r,
            Err(e) => {
                let line: StreamLine<()> =
                    StreamLine::Error(failed(format!("reading the journal: {e}")));
                let _ = tx.blocking_send(crate::server::ndjson(&line));
                return;
            }
        };
        // Seqs no file holds any more (archives the retention removed while the caller was
        // behind): one line each, `{"type":"records_lost","first":..,"last":..,"lost":..}`,
        // before the first record after them.
        let mut gaps = f.take_gaps().into_iter().peekable();
        for r in &records {
            while let Some(g) = gaps.next_if(|g| g.first < r.seq) {
                if tx.blocking_send(lost_line(&g)).is_err() {
                    return;
                }
            }
            let mut line = cryo_telemetry::ndjson_line(r);
            if !line.ends_with('\n') {
                line.push('\n');
            }
            if tx.blocking_send(Bytes::from(line)).is_err() {
                return; // the caller left
            }
        }
        for g in gaps {
            if tx.blocking_send(lost_line(&g)).is_err() {
                return;
            }
        }
        if !follow || agent.stopping() || tx.is_closed() {
            return;
        }
        if let Err(e) = f.wait(&[], FOLLOW_TICK) {
            tracing::warn!(err = %e, "following the journal");
            std::thread::sleep(FOLLOW_TICK);
        }
    }
}

/// The `GET /v1/events` line for seqs lost to the caller.
fn lost_line(g: &cryo_journal::Gap) -> Bytes {
    let mut line = serde_json::json!({
        "type": "records_lost",
        "first": g.first,
        "last": g.last,
        "lost": g.lost(),
    })
    .to_string();
    line.push('\n');
    Bytes::from(line)
}

/// CRIU's pid, when CRIU traces `process` (its cuda plugin restores under CRIU's ptrace).
fn criu_tracer(process: Pid) -> Option<Pid> {
    let t = cryo_proc::ProcHandle::open(process)
        .and_then(|h| h.tracer())
        .ok()
        .flatten()?;
    let comm = cryo_proc::stat(t).map(|s| s.comm).ok()?;
    (comm == "criu").then_some(t)
}
