//! cryod, cryo's node agent (`cryo agent run`): one per node, it owns what must be single there
//! and serves the API of [`cryo_api`] on a unix socket.
//!
//! # Design
//! - **Process model.** One process: a tokio runtime serves the API (axum on a `UnixListener`),
//!   and every lifecycle call runs on a blocking thread (`spawn_blocking`), so a stop that waits
//!   30 s for a lock never holds up a status request. The guard ([`cryo_guard::Service`]) runs
//!   its loop on a thread of its own, its tracer on another; telemetry (journal feed, `/metrics`
//!   on TCP, the syslog forwarder) on theirs ([`cryo_telemetry::Telemetry`]).
//! - **What it owns.** The journal writer (one `Journal`, shared), the guard (every restore is
//!   guarded; its pins; the fence it writes), metrics with the live gauges (pins held, guarded
//!   processes, quarantined GPUs) and the event stream. The handlers call the same lifecycle
//!   functions the standalone CLI calls, with the same options ([`cryo_api::StopRequest::options`]...).
//! - **One per node**: an exclusive `flock` on `STATE_DIR/cryod.lock` ([`lock`]).
//! - **Authorisation**: the peer's credentials on every request ([`auth`]): root for changes,
//!   root and the read group for reads. The socket is mode 0660 with the read group (0600
//!   without one), so others cannot even connect; the check stands on its own all the same.
//! - **Resilience.** Every signal whose default action kills is caught ([`signals`]): SIGTERM
//!   and SIGINT ask for a clean shutdown (refused while pins are held), the rest are logged and
//!   ignored. `oom_score_adj` is set to -1000 where permitted (said once when not). Nothing is
//!   printed with `print!`: logs go through `tracing`, which drops what a closed stderr refuses.
//! - **Kubernetes** ([`k8s`], `--kube-node`): the fence and the journal's steps published to the
//!   API server without ever being in the way of a safety action; `cryo stop --self` / `--pod`;
//!   a caller in a pod's container confined to stopping itself.
//! - **Shutdown**: `cryo agent stop` or SIGTERM; refused while pins are held (the answer says
//!   how to release them); otherwise the guard detaches from every worker, followers of the
//!   event stream are ended, the socket is removed.
//!
//! # Limitations
//! - Pins live in the agent until the pin holder lands: the agent's SIGKILL still closes them.
//! - Pids in requests are read in the agent's pid namespace; a caller in another one is refused
//!   for requests that name pids.

mod activators;
pub mod auth;
mod k8s;
pub mod keeper;
pub mod lock;
mod ops;
mod parent;
mod server;
pub mod signals;
mod standby;
mod sys;
mod warm;

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use cryo_gpu::Gpu;
use cryo_guard::{Guard, GuardConfig, RunOptions, Service};
use cryo_journal::Journal;
use cryo_state::StateDir;
use cryo_telemetry::{Telemetry, TelemetryConfig};

pub use k8s::{KubeConfig, KubeSetupError, RESYNC as KUBE_RESYNC};

/// How the agent runs.
#[derive(Debug, Clone)]
pub struct AgentConfig {
    /// The state directory.
    pub state: StateDir,
    /// The API socket.
    pub socket: PathBuf,
    /// The group whose members may read (status, metrics, events); `None`: root only.
    pub read_group: Option<String>,
    /// The guard's configuration.
    pub guard: GuardConfig,
    /// Processes to guard besides the journal's, and the guard's poll.
    pub guard_run: RunOptions,
    /// Metrics listener and syslog forwarder.
    pub telemetry: TelemetryConfig,
    /// Kubernetes (`--kube-node`): the fence and Events published, containers as targets.
    pub kube: Option<KubeConfig>,
}

/// The agent could not start (nothing is left running).
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    /// Another agent runs.
    #[error(transparent)]
    Lock(#[from] lock::LockError),
    /// The signal handlers could not be installed.
    #[error("cannot install the signal handlers: {0}")]
    Signals(std::io::Error),
    /// The read group does not exist.
    #[error("--read-group {0:?}: no such group")]
    NoSuchGroup(String),
    /// The journal could not be opened.
    #[error("cannot open the journal: {0}")]
    Journal(#[from] cryo_journal::OpenError),
    /// Telemetry could not start (the metrics port is taken?).
    #[error("cannot start telemetry: {0}")]
    Telemetry(#[from] cryo_telemetry::StartError),
    /// The guard could not start.
    #[error(transparent)]
    Guard(#[from] cryo_guard::RunError),
    /// The Kubernetes side could not be set up.
    #[error(transparent)]
    Kube(#[from] KubeSetupError),
    /// The socket could not be served.
    #[error("cannot serve {}: {source}", .path.display())]
    Socket {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// Something answers on the socket already.
    #[error("an agent already answers on {}", .0.display())]
    SocketTaken(PathBuf),
}

/// What every handler shares.
pub(crate) struct Agent {
    gpu: Gpu,
    state: StateDir,
    journal: Journal,
    guard: Arc<Guard>,
    telemetry: Telemetry,
    socket: PathBuf,
    read_group: Option<(String, u32)>,
    /// The syslog collector, if forwarding.
    syslog: Option<String>,
    started: SystemTime,
    /// A shutdown was asked for and accepted (no pins were held).
    stopping: AtomicBool,
    /// The thread that thaws and reaps restored workers.
    parent: parent::Parent,
    /// Kubernetes, when the agent runs with it.
    kube: Option<k8s::Kube>,
    /// The pod container the agent runs in, if any (see [`k8s::own_container`]).
    own_container: Option<cryo_kube::CgroupIdentity>,
    /// The pre-thawed standby pools.
    pools: standby::Pools,
    /// The activators it owns (`/v1/activators`).
    activators: activators::Activators,
}

impl std::fmt::Debug for Agent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Agent")
            .field("state", &self.state)
            .field("socket", &self.socket)
            .finish_non_exhaustive()
    }
}

impl Agent {
    /// Accepts a shutdown unless pins are held; the refusal says how to release them.
    pub(crate) fn request_shutdown(&self) -> Result<(), cryo_api::ApiError> {
        let pins = self.guard.status().pins;
        if !pins.is_empty() {
            let gpus: Vec<String> = pins
                .iter()
                .flat_map(|p| p.gpus.iter().map(ToString::to_string))
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect();
            return Err(cryo_api::ApiError::new(
                cryo_api::ErrorKind::PinsHeld,
                format!(
                    "the agent holds pinned contexts of {} dead process(es) on {}; stopping it would close them, which may wedge the host",
                    pins.len(),
                    gpus.join(", ")
                ),
            )
            .with_hint(format!(
                "drain the node, then `cryo guard release --gpu {} --i-understand-this-may-wedge-the-host` for each GPU, then stop the agent",
                gpus.first().map_or("UUID", String::as_str)
            )));
        }
        self.stopping.store(true, Ordering::SeqCst);
        Ok(())
    }

    fn stopping(&self) -> bool {
        self.stopping.load(Ordering::SeqCst)
    }

    /// For each restore another process had in flight under `criu_dir` when the agent started
    /// (`in_flight`: a `cryo thaw` that began while no agent answered), and each one whose
    /// directory appears later (`watch`: such a thaw was still checking its image when the
    /// agent looked), a thread that waits for that process's end (its lock on the run's
    /// directory, given back by the kernel with its life: no polling) and then sweeps: a thaw
    /// killed before CRIU's gate has its CRIU and what it half restored ended at once (nothing
    /// of it ran, no live context: the safe kind), journaled `ThawFailed`, instead of holding
    /// their host memory until the next command. The agent's own restores (thaws and standbys
    /// it runs) are left out: they end in the agent's own call, which removes their directory.
    fn sweep_when_restores_end(
        self: &Arc<Self>,
        in_flight: Vec<PathBuf>,
        watch: Option<cryo_criu::scratch::RestoreWatch>,
        criu_dir: &std::path::Path,
    ) {
        for dir in in_flight {
            self.sweep_when_owner_ends(dir, criu_dir);
        }
        let Some(mut watch) = watch else { return };
        let agent = Arc::clone(self);
        let root = criu_dir.to_path_buf();
        let spawned = std::thread::Builder::new()
            .name("cryod-restore-dirs".into())
            .spawn(move || loop {
                match watch.wait_new() {
                    Ok(dirs) => {
                        for dir in dirs {
                            agent.sweep_when_owner_ends(dir, &root);
                        }
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot watch for restores: a thaw that dies before CRIU's gate is swept at the next command");
                        return;
                    }
                }
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch for restores: a thaw that dies before CRIU's gate is swept at the next command");
        }
    }

    /// A thread that waits for the end of the owner of the restore directory `dir`, then sweeps
    /// `criu_dir` and journals what it ended.
    fn sweep_when_owner_ends(self: &Arc<Self>, dir: PathBuf, criu_dir: &std::path::Path) {
        let agent = Arc::clone(self);
        let root = criu_dir.to_path_buf();
        let spawned = std::thread::Builder::new()
            .name("cryod-restore-watch".into())
            .spawn(move || {
                match cryo_criu::scratch::wait_for_owner(&dir) {
                    Ok(()) => {}
                    // Done and removed already: nothing of it to sweep.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return,
                    Err(e) => {
                        tracing::warn!(dir = %dir.display(), error = %e, "cannot wait for a restore's end");
                        return;
                    }
                }
                let swept = cryo_criu::scratch::sweep(&root);
                cryo_lifecycle::thaw::journal_ended_restores(&agent.journal, &swept.ended);
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "cannot watch a restore in flight: its sweep waits for the next command");
        }
    }

    /// Sets the live gauges from the guard and the fence.
    fn update_gauges(&self) {
        let status = self.guard.status();
        let live = self.telemetry.live();
        live.pins_held
            .set(status.pins.iter().map(|p| p.fds.len() as i64).sum());
        live.guarded_processes.set(status.guarded.len() as i64);
        if let Ok(q) = self.state.fence().list() {
            live.gpus_quarantined.set(q.len() as i64);
        }
        live.standbys_ready.reset();
        live.standby_host_bytes.reset();
        for (image, ready, host) in self.pools.held() {
            let image = image.display().to_string();
            live.standbys_ready
                .with_label_values(&[image.as_str()])
                .set(ready as i64);
            live.standby_host_bytes
                .with_label_values(&[image.as_str()])
                .set(i64::try_from(host).unwrap_or(i64::MAX));
        }
    }
}

/// How often the agent looks at the journal's size.
const JOURNAL_CHECK: Duration = Duration::from_secs(30);

/// How long the journal must have had no append for a rotation to start past
/// [`cryo_journal::AGENT_ROTATE_BYTES`] (a rotation holds the writers' lock for what was
/// appended while it decoded, the carried records' write and its fsyncs).
const QUIET: Duration = Duration::from_secs(2);

/// Past this size the agent rotates the journal even if it is never quiet: a node whose journal
/// gets a record at least every [`QUIET`] would otherwise grow it to
/// [`cryo_journal::STANDALONE_ROTATE_BYTES`], where the next command's open rotates it on that
/// command's path (a freeze before its GPU free included). The rotator decodes before it takes
/// the writers' lock, so a busy moment costs the appends tens of milliseconds (40 ms median
/// longest append at 4 MiB, `rotate_bench`), not the whole decode.
const BUSY_ROTATE_BYTES: u64 = 2 * cryo_journal::AGENT_ROTATE_BYTES;

/// Rotates the journal if it is past [`cryo_journal::AGENT_ROTATE_BYTES`] and quiet, or past
/// [`BUSY_ROTATE_BYTES`] whatever, and prunes its archives
/// ([`cryo_journal::Retention::default`]).
fn maintain_journal(journal: &cryo_journal::Journal) {
    let Ok(meta) = std::fs::metadata(journal.path()) else {
        return;
    };
    let quiet = meta
        .modified()
        .ok()
        .and_then(|m| m.elapsed().ok())
        .is_some_and(|e| e >= QUIET);
    if meta.len() <= cryo_journal::AGENT_ROTATE_BYTES || (!quiet && meta.len() <= BUSY_ROTATE_BYTES)
    {
        return;
    }
    match journal.maintain(
        cryo_journal::AGENT_ROTATE_BYTES,
        cryo_journal::Retention::default(),
    ) {
        Ok(Some(r)) => tracing::info!(
            archive = %r.archive.display(),
            records = r.records,
            carried = r.carried,
            "journal rotated"
        ),
        Ok(None) => {}
        Err(err) => tracing::warn!(%err, "cannot rotate the journal; it stays as it is"),
    }
}

/// Runs the agent until a shutdown is asked for (and accepted). See the module docs.
pub fn run(gpu: Gpu, cfg: AgentConfig) -> Result<(), AgentError> {
    // Before any thread exists, so that no thread runs with the default dispositions.
    let (caught_tx, caught_rx) = std::sync::mpsc::channel();
    signals::catch(move |c| {
        let _ = caught_tx.send(c);
    })
    .map_err(AgentError::Signals)?;
    std::fs::create_dir_all(cfg.state.root()).map_err(|source| AgentError::Socket {
        path: cfg.state.root().to_path_buf(),
        source,
    })?;
    let _lock = lock::NodeLock::take(&cfg.state.agent_lock())?;
    // Restores other processes have in flight (looked at first: one that ends meanwhile is the
    // sweep's), then what dumps and restores that died with an earlier agent left.
    // The watch first: a restore directory made after it is never missed by both looks.
    let watch = cryo_criu::scratch::RestoreWatch::start(&cfg.state.criu_dir())
        .map_err(|e| tracing::warn!(error = %e, "cannot watch for restores: a thaw that dies before CRIU's gate is swept at the next command"))
        .ok();
    let in_flight = cryo_criu::scratch::live_restores(&cfg.state.criu_dir());
    let swept = cryo_criu::scratch::sweep(&cfg.state.criu_dir());
    protect_from_oom();
    // Said once, at the start: on a host whose `/run` is not a tmpfs every CRIU run (each
    // freeze's dump, each thaw's restore) pays its kernel probes again. A save a dead CRIU
    // left is removed first (and again before every CRIU run).
    let kdat_dir = std::path::Path::new(cryo_criu::kdat::KDAT_DIR);
    cryo_criu::kdat::clear_and_say(kdat_dir);
    if let Some(why) = cryo_criu::kdat::cache_unkept(kdat_dir) {
        tracing::warn!("{why}");
    }
    let read_group = match &cfg.read_group {
        None => None,
        Some(name) => match nix::unistd::Group::from_name(name) {
            Ok(Some(g)) => Some((name.clone(), g.gid.as_raw())),
            _ => return Err(AgentError::NoSuchGroup(name.clone())),
        },
    };
    let drain = matches!(cfg.guard.endgame, cryo_guard::Endgame::Drain { .. });
    let kube = cfg
        .kube
        .as_ref()
        .map(|k| k8s::Kube::configure(k, drain))
        .transpose()?;
    let journal = cfg.state.open_journal()?;
    cryo_lifecycle::thaw::journal_ended_restores(&journal, &swept.ended);
    let telemetry = Telemetry::start(&cfg.state, &cfg.telemetry)?;
    if let Some(addr) = telemetry.metrics_addr() {
        tracing::info!(%addr, "serving /metrics");
    }
    let listener = bind(&cfg.socket, read_group.as_ref().map(|g| g.1))?;
    let service = Service::start(
        gpu.clone(),
        cfg.guard.clone(),
        &cfg.guard_run,
        &mut log_notice,
    )?;
    let agent = Arc::new(Agent {
        gpu,
        state: cfg.state.clone(),
        journal,
        guard: Arc::clone(service.guard()),
        telemetry,
        socket: cfg.socket.clone(),
        read_group,
        syslog: cfg.telemetry.syslog.clone(),
        started: SystemTime::now(),
        stopping: AtomicBool::new(false),
        parent: parent::Parent::start().map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?,
        kube,
        own_container: k8s::own_identity(),
        pools: standby::Pools::default(),
        activators: activators::Activators::new(&cfg.state.activators_file()).map_err(
            |source| AgentError::Socket {
                path: cfg.socket.clone(),
                source,
            },
        )?,
    });
    log_guarded(&agent.guard);
    agent.sweep_when_restores_end(in_flight, watch, &cfg.state.criu_dir());
    agent.adopt_standbys();
    agent.restore_activators();
    std::thread::Builder::new()
        .name("cryod-standby".into())
        .spawn({
            let agent = Arc::clone(&agent);
            move || agent.refill_loop()
        })
        .map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    agent.update_gauges();

    // Signals: SIGTERM/SIGINT ask for a shutdown, the rest are logged.
    std::thread::Builder::new()
        .name("cryod-signal-log".into())
        .spawn({
            let agent = Arc::clone(&agent);
            move || {
                for c in caught_rx {
                    on_signal(&agent, c);
                }
            }
        })
        .map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    // The guard's loop; when it ends (a shutdown accepted, no pins), the server stops.
    let (guard_done_tx, guard_done_rx) = tokio::sync::oneshot::channel::<()>();
    let guard_thread = std::thread::Builder::new()
        .name("cryod-guard".into())
        .spawn({
            let agent = Arc::clone(&agent);
            move || {
                service.run_until(&|| agent.stopping(), &mut log_notice);
                let _ = guard_done_tx.send(());
            }
        })
        .map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    // The journal rotated past AGENT_ROTATE_BYTES at a quiet moment (nothing appended for
    // QUIET), or past BUSY_ROTATE_BYTES whatever, its oldest archives pruned: what every
    // command's recovery reads stays bounded.
    std::thread::Builder::new()
        .name("cryod-journal".into())
        .spawn({
            let agent = Arc::downgrade(&agent);
            move || {
                while let Some(agent) = agent.upgrade() {
                    maintain_journal(&agent.journal);
                    drop(agent);
                    std::thread::sleep(JOURNAL_CHECK);
                }
            }
        })
        .map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;
    // The live gauges follow the guard and the fence.
    std::thread::Builder::new()
        .name("cryod-gauges".into())
        .spawn({
            let agent = Arc::downgrade(&agent);
            move || {
                while let Some(agent) = agent.upgrade() {
                    agent.update_gauges();
                    drop(agent);
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        })
        .map_err(|source| AgentError::Socket {
            path: cfg.socket.clone(),
            source,
        })?;

    tracing::info!(
        socket = %cfg.socket.display(),
        state = %cfg.state.root().display(),
        pid = std::process::id(),
        version = env!("CARGO_PKG_VERSION"),
        "agent running"
    );
    let served = server::serve(Arc::clone(&agent), listener, guard_done_rx);
    let _ = std::fs::remove_file(&cfg.socket);
    if let Err(e) = &served {
        // The server failed: the guard must still end cleanly (detach, never drop pins).
        tracing::error!(err = %e, "the API server failed; stopping");
        agent.stopping.store(true, Ordering::SeqCst);
    }
    let _ = guard_thread.join();
    tracing::info!("agent stopped");
    served.map_err(|source| AgentError::Socket {
        path: cfg.socket,
        source,
    })
}

/// Binds the socket: refuses when something answers on it, replaces a stale one, mode 0660
/// with the read group (0600 without).
fn bind(
    path: &std::path::Path,
    read_gid: Option<u32>,
) -> Result<std::os::unix::net::UnixListener, AgentError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| AgentError::Socket {
        path: path.to_path_buf(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(err)?;
    }
    if std::os::unix::net::UnixStream::connect(path).is_ok() {
        return Err(AgentError::SocketTaken(path.to_path_buf()));
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(err(e)),
    }
    let listener = std::os::unix::net::UnixListener::bind(path).map_err(err)?;
    let mode = if read_gid.is_some() { 0o660 } else { 0o600 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).map_err(err)?;
    if let Some(gid) = read_gid {
        std::os::unix::fs::chown(path, None, Some(gid)).map_err(err)?;
    }
    listener.set_nonblocking(true).map_err(err)?;
    Ok(listener)
}

/// -1000: the OOM killer never picks the agent (its death would leave restored workers
/// unguarded). Said once when the kernel refuses (no `CAP_SYS_RESOURCE`).
fn protect_from_oom() {
    let me = std::process::id() as cryo_proc::Pid;
    match cryo_proc::ProcHandle::open(me).map(|h| h.set_oom_score_adj(-1000)) {
        Ok(Ok(())) => tracing::info!("oom_score_adj set to -1000"),
        Ok(Err(e)) => tracing::warn!(err = %e, "cannot protect the agent from the OOM killer"),
        Err(e) => tracing::warn!(err = %e, "cannot protect the agent from the OOM killer"),
    }
}

fn on_signal(agent: &Agent, c: signals::Caught) {
    match c {
        signals::Caught::Shutdown { signal, from } => match agent.request_shutdown() {
            Ok(()) => tracing::info!(signal = %signals::name(signal), from, "shutting down"),
            Err(e) => tracing::warn!(
                signal = %signals::name(signal),
                from,
                "refusing to stop: {}; {}",
                e.message,
                e.hint.unwrap_or_default()
            ),
        },
        signals::Caught::Ignored { signal, from } => {
            tracing::warn!(signal = %signals::name(signal), from, "signal ignored (the agent stops only on SIGTERM, SIGINT or `cryo agent stop`)")
        }
    }
}

/// The guard's notices, in the agent's log.
fn log_notice(n: cryo_guard::Notice) {
    use cryo_guard::Notice;
    match &n {
        Notice::Lost { .. }
        | Notice::LeftLocked { .. }
        | Notice::FinishedUnlock(_)
        | Notice::JournalUnreadable(_)
        | Notice::RefusingToStop => {
            tracing::warn!("guard: {n}")
        }
        _ => tracing::info!("guard: {n}"),
    }
}

/// What the guard guards at start, and why, in the log.
fn log_guarded(guard: &Guard) {
    let s = guard.status();
    if s.guarded.is_empty() {
        tracing::info!(
            "guarding no process yet (restores through cryo are guarded as they happen)"
        );
    }
    for g in &s.guarded {
        tracing::info!(pid = g.pid, source = %g.source, "guarding");
    }
    for p in &s.pins {
        tracing::warn!(pid = p.pid, cause = %p.cause, "holding a pinned context");
    }
}

#[cfg(test)]
mod journal_tests {
    #![allow(clippy::unwrap_used)]
    //! The agent's journal rotation: past its size at a quiet moment, past twice it whatever.

    use std::time::{Duration, SystemTime};

    use cryo_journal::{Event, Journal};

    fn set_mtime(path: &std::path::Path, ago: Duration) {
        let f = std::fs::File::options().write(true).open(path).unwrap();
        f.set_modified(SystemTime::now() - ago).unwrap();
    }

    #[test]
    fn the_agent_rotates_a_large_journal_once_it_is_quiet() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let filler: Vec<Event> = (0..1000)
            .map(|i| Event::FreezeStarted {
                image: format!("/var/lib/cryo/images/{i:0>120}"),
            })
            .collect();
        while std::fs::metadata(journal.path()).unwrap().len() <= cryo_journal::AGENT_ROTATE_BYTES {
            journal.append_all(filler.clone()).unwrap();
        }
        // Appended to just now: not quiet, left as it is.
        super::maintain_journal(&journal);
        assert!(cryo_journal::archives(dir.path()).unwrap().is_empty());
        // Quiet for longer than QUIET: rotated, the new segment small.
        set_mtime(journal.path(), super::QUIET + Duration::from_secs(1));
        super::maintain_journal(&journal);
        assert_eq!(cryo_journal::archives(dir.path()).unwrap().len(), 1);
        assert!(std::fs::metadata(journal.path()).unwrap().len() < 4096);
        // Small now: nothing more, however quiet.
        set_mtime(journal.path(), super::QUIET + Duration::from_secs(1));
        super::maintain_journal(&journal);
        assert_eq!(cryo_journal::archives(dir.path()).unwrap().len(), 1);
    }

    /// A journal that is never quiet (a record at least every QUIET) is still rotated by the
    /// agent once past BUSY_ROTATE_BYTES, long before a command's open would have to (64 MiB).
    #[test]
    fn the_agent_rotates_a_journal_that_is_never_quiet_past_twice_its_size() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let filler: Vec<Event> = (0..1000)
            .map(|i| Event::FreezeStarted {
                image: format!("/var/lib/cryo/images/{i:0>120}"),
            })
            .collect();
        let size = || std::fs::metadata(journal.path()).unwrap().len();
        while size() <= cryo_journal::AGENT_ROTATE_BYTES {
            journal.append_all(filler.clone()).unwrap();
        }
        // Busy (appended to just now), past the quiet size only: left for a quiet moment.
        super::maintain_journal(&journal);
        assert!(cryo_journal::archives(dir.path()).unwrap().is_empty());
        while size() <= super::BUSY_ROTATE_BYTES {
            journal.append_all(filler.clone()).unwrap();
        }
        // Still busy, past twice the size: rotated all the same.
        super::maintain_journal(&journal);
        assert_eq!(cryo_journal::archives(dir.path()).unwrap().len(), 1);
        assert!(size() < 4096);
    }
}
