//! The activator: in front of a scaled-to-zero worker, a listener on the worker's service address
//! that accepts while the worker is parked, wakes it once for any number of waiting connections,
//! forwards once the worker answers its health check, and parks it again when idle.
//!
//! # Design
//! - The worker serves on an address of its own (its *upstream*); the activator owns the service
//!   address clients use (TCP or a unix socket) and forwards every connection byte for byte
//!   (`copy_bidirectional`), so it works for any protocol. With [`Policy::http`] a connection
//!   that cannot be served gets an `HTTP/1.1 503` whose body says why; otherwise it is closed.
//! - One phase for the worker ([`Phase`], a `watch` channel): `Active`, `Parked`, `Waking`,
//!   `Parking`. The first connection that finds it parked moves it to `Waking` (a compare and
//!   set under the channel's lock) and starts the one activation; every other connection waits
//!   on the channel. Concurrent requests trigger one activation.
//! - The waking is behind a trait ([`Activation`]: blocking `wake` and `park`, run in
//!   `spawn_blocking`), so the agent wires in its own (the lifecycle's park/wake with its
//!   in-process guard: [`InPlace`]), and tests a fake.
//! - An activation is done when the worker answers its health check ([`Policy::health`]); a
//!   wake that fails, or a worker that does not answer in time, fails every waiting connection
//!   with the reason, the worker is parked again, and the next connection tries again.
//! - A wake that finds another wake or park of the worker at work (an operator's `cryo wake`,
//!   the agent's API; [`ActivationError::Busy`]) is not a failed activation: the connections wait
//!   for that one to finish and are served by whichever wake brings the worker back (the
//!   activation tries again until it finds the worker running or wakes it itself), within the
//!   same deadline; a stop or a freeze at work refuses it at once (the worker is going away).
//! - Waits are bounded ([`Policy::activation_timeout`]). An idle worker (no open connection for
//!   [`Policy::idle_timeout`]) is parked again; a connection that arrives meanwhile waits for
//!   the park to finish and wakes it again.
//!
//! - The worker may have network namespaces of its own (a claimed standby: [`FromStandby`]):
//!   then its upstream address and health check are reached in there ([`Activation::netns`]).
//!
//! # Limitations
//! Idle means no open connection: a client holding a keep-alive connection open keeps the
//! worker awake. The activator must own the service address: the worker listens elsewhere.

pub mod addr;
pub mod inplace;
pub mod standby;

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use cryo_lifecycle::HealthCheck;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use tokio::sync::watch;

pub use addr::{Addr, AddrError, Listener};
pub use inplace::InPlace;
pub use standby::FromStandby;

/// What the waking could not do.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ActivationError {
    /// The wake was refused before anything was restored (no GPU with room, a fence...).
    #[error("activation refused: {0}")]
    Refused(String),
    /// The wake or park failed.
    #[error("activation failed: {0}")]
    Failed(String),
    /// Another wake or park of the worker is at work (it holds the worker's lock): this one did
    /// nothing. The activator tries again until that one is done or its deadline passes.
    #[error("another wake or park of the worker is at work: {0}")]
    Busy(String),
}

/// Brings the worker back and puts it to sleep. Blocking (driver calls): the activator runs it
/// in `spawn_blocking`.
pub trait Activation: Send + Sync + 'static {
    /// Wakes the worker (restore, guard, unlock). Returns once it runs.
    fn wake(&self) -> Result<(), ActivationError>;
    /// Parks the worker (suspend in place).
    fn park(&self) -> Result<(), ActivationError>;
    /// The process in whose network namespace the upstream address and the health check are
    /// reached (a worker in its own namespaces, as a claimed standby); `None`: the activator's.
    fn netns(&self) -> Option<cryo_proc::Pid> {
        None
    }
}

/// The operator's knobs.
#[derive(Debug, Clone)]
pub struct Policy {
    /// Park the worker after this long without an open connection (`None`: never).
    pub idle_timeout: Option<Duration>,
    /// How long a connection waits for an activation before it is answered with an error.
    pub activation_timeout: Duration,
    /// How to tell the woken worker serves (`None`: the wake returning is enough).
    pub health: Option<HealthCheck>,
    /// The protocol is HTTP: a connection that cannot be served gets a 503 with the reason.
    pub http: bool,
}

impl Default for Policy {
    fn default() -> Self {
        Policy {
            idle_timeout: Some(Duration::from_secs(300)),
            activation_timeout: Duration::from_secs(60),
            health: None,
            http: true,
        }
    }
}

/// Where the worker is.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum Phase {
    /// Serving: connections are forwarded at once.
    Active,
    /// Parked (or in standby): the next connection wakes it. `last_error`: why the last
    /// activation failed, if it did.
    Parked {
        /// Why the last activation failed.
        last_error: Option<String>,
    },
    /// One activation is under way.
    Waking,
    /// Being parked after an idle period.
    Parking,
}

/// Counters, for tests, `cryo status` and metrics.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct Stats {
    /// Activations started.
    pub activations: u64,
    /// Activations that failed.
    pub failed_activations: u64,
    /// Parks after an idle period.
    pub idle_parks: u64,
    /// Connections forwarded to the worker.
    pub forwarded: u64,
    /// Connections answered with an error (or closed) because the worker could not be woken.
    pub rejected: u64,
}

struct Shared {
    phase: watch::Sender<Phase>,
    activation: Arc<dyn Activation>,
    upstream: Addr,
    policy: Policy,
    open: AtomicUsize,
    last_activity: Mutex<Instant>,
    activations: AtomicU64,
    failed_activations: AtomicU64,
    idle_parks: AtomicU64,
    forwarded: AtomicU64,
    rejected: AtomicU64,
}

/// A running activator (see the module docs). Dropping it stops accepting.
#[derive(Clone)]
pub struct Activator {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Activator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Activator")
            .field("upstream", &self.shared.upstream)
            .field("phase", &*self.shared.phase.borrow())
            .finish_non_exhaustive()
    }
}

impl Activator {
    /// An activator for the worker at `upstream`, which is now in `initial` (`Active` or
    /// `Parked`).
    pub fn new(
        upstream: Addr,
        policy: Policy,
        activation: Arc<dyn Activation>,
        initial: Phase,
    ) -> Activator {
        let (phase, _) = watch::channel(initial);
        Activator {
            shared: Arc::new(Shared {
                phase,
                activation,
                upstream,
                policy,
                open: AtomicUsize::new(0),
                last_activity: Mutex::new(Instant::now()),
                activations: AtomicU64::new(0),
                failed_activations: AtomicU64::new(0),
                idle_parks: AtomicU64::new(0),
                forwarded: AtomicU64::new(0),
                rejected: AtomicU64::new(0),
            }),
        }
    }

    /// The worker's phase now.
    pub fn phase(&self) -> Phase {
        self.shared.phase.borrow().clone()
    }

    /// A receiver of every phase change (tests wait on it for the positive event).
    pub fn watch(&self) -> watch::Receiver<Phase> {
        self.shared.phase.subscribe()
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        let s = &self.shared;
        Stats {
            activations: s.activations.load(Ordering::Relaxed),
            failed_activations: s.failed_activations.load(Ordering::Relaxed),
            idle_parks: s.idle_parks.load(Ordering::Relaxed),
            forwarded: s.forwarded.load(Ordering::Relaxed),
            rejected: s.rejected.load(Ordering::Relaxed),
        }
    }

    /// Accepts on `listener` until the task is dropped (the idle parks end with it); parks the
    /// worker when idle.
    pub async fn serve(&self, listener: Listener) {
        struct AbortOnDrop(Option<tokio::task::JoinHandle<()>>);
        impl Drop for AbortOnDrop {
            fn drop(&mut self) {
                if let Some(t) = &self.0 {
                    t.abort();
                }
            }
        }
        let _idle = AbortOnDrop(self.shared.policy.idle_timeout.map(|idle| {
            let me = self.clone();
            tokio::spawn(async move { me.idle_loop(idle).await })
        }));
        loop {
            match listener.accept().await {
                Ok(conn) => {
                    let me = self.clone();
                    tokio::spawn(async move { me.handle(conn).await });
                }
                Err(e) => {
                    // EMFILE and the like: say it, back off a little, keep serving.
                    tracing::warn!(error = %e, "activator: accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    }

    /// Makes sure the worker is active (waking it once for every waiter); bounded by the
    /// policy's activation timeout.
    pub async fn ensure_active(&self) -> Result<(), String> {
        let timeout = self.shared.policy.activation_timeout;
        match tokio::time::timeout(timeout, self.ensure_active_unbounded()).await {
            Ok(r) => r,
            Err(_) => Err(format!(
                "the worker did not become ready within {} ms",
                timeout.as_millis()
            )),
        }
    }

    async fn ensure_active_unbounded(&self) -> Result<(), String> {
        let mut rx = self.shared.phase.subscribe();
        let mut saw_waking = false;
        loop {
            let phase = rx.borrow_and_update().clone();
            match phase {
                Phase::Active => return Ok(()),
                Phase::Parked { last_error } => {
                    if saw_waking {
                        return Err(
                            last_error.unwrap_or_else(|| "the worker was parked again".into())
                        );
                    }
                    // Claim the activation: only one waiter moves Parked to Waking.
                    let won = self.shared.phase.send_if_modified(|p| {
                        if matches!(p, Phase::Parked { .. }) {
                            *p = Phase::Waking;
                            true
                        } else {
                            false
                        }
                    });
                    if won {
                        let me = self.clone();
                        tokio::spawn(async move { me.activate().await });
                    }
                    continue;
                }
                Phase::Waking => saw_waking = true,
                Phase::Parking => {}
            }
            if rx.changed().await.is_err() {
                return Err("the activator is shutting down".into());
            }
        }
    }

    /// The one activation: wake, health check; on failure park again and tell every waiter.
    async fn activate(&self) {
        let s = &self.shared;
        s.activations.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let woke = self.wake_when_free(started).await;
        // Refused because another wake or park was at work until the deadline: this activation
        // did nothing, and parking the worker would undo what that one does.
        let busy = matches!(woke, Err(ActivationError::Busy(_)));
        let result = match woke {
            Err(e) => Err(e.to_string()),
            Ok(()) => match s.policy.health.clone() {
                None => Ok(()),
                Some(check) => {
                    let left = s
                        .policy
                        .activation_timeout
                        .saturating_sub(started.elapsed());
                    let netns = s.activation.netns();
                    let checked = tokio::task::spawn_blocking(move || match netns {
                        None => check.wait(left).map_err(|e| e.to_string()),
                        Some(pid) => cryo_proc::in_net_namespace_of(pid, || {
                            check.wait(left).map_err(std::io::Error::other)
                        })
                        .map_err(|e| e.to_string()),
                    });
                    match checked.await {
                        Ok(Ok(_)) => Ok(()),
                        Ok(Err(e)) => Err(format!("woken, but not healthy: {e}")),
                        Err(e) => Err(format!("the health check panicked: {e}")),
                    }
                }
            },
        };
        match result {
            Ok(()) => {
                tracing::info!(
                    ms = started.elapsed().as_millis() as u64,
                    "activator: worker active"
                );
                self.touch();
                s.phase.send_replace(Phase::Active);
            }
            Err(reason) => {
                s.failed_activations.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%reason, "activator: activation failed");
                // Whatever the wake left running goes back to sleep (a wake that failed
                // already left it parked: parking it again is a no-op).
                let activation = s.activation.clone();
                if !busy {
                    if let Ok(Err(e)) = tokio::task::spawn_blocking(move || activation.park()).await
                    {
                        tracing::error!(error = %e, "activator: cannot park the worker after a failed activation");
                    }
                }
                s.phase.send_replace(Phase::Parked {
                    last_error: Some(reason),
                });
            }
        }
    }

    /// The activation's wake. One refused because another wake or park of the worker is at
    /// work ([`ActivationError::Busy`]: an operator's `cryo wake`, an activation of another
    /// activator) is tried again every [`cryo_lifecycle::BUSY_RETRY`] until that one is done (then the worker
    /// serves, and this wake finds it running; or it is parked, and this wake wakes it) or the
    /// activation's deadline has passed: the waiting connections are served by whichever wake
    /// brings the worker back, never refused for a worker about to serve.
    async fn wake_when_free(&self, started: Instant) -> Result<(), ActivationError> {
        let s = &self.shared;
        let mut said = false;
        loop {
            let activation = s.activation.clone();
            let woke = tokio::task::spawn_blocking(move || activation.wake())
                .await
                .unwrap_or_else(|e| {
                    Err(ActivationError::Failed(format!("the wake panicked: {e}")))
                });
            match woke {
                Err(ActivationError::Busy(why))
                    if started.elapsed() + cryo_lifecycle::BUSY_RETRY
                        < s.policy.activation_timeout =>
                {
                    if !said {
                        said = true;
                        tracing::info!(%why, "activator: another wake or park of the worker is at work; waiting for it");
                    }
                    tokio::time::sleep(cryo_lifecycle::BUSY_RETRY).await;
                }
                other => return other,
            }
        }
    }

    fn touch(&self) {
        if let Ok(mut t) = self.shared.last_activity.lock() {
            *t = Instant::now();
        }
    }

    async fn idle_loop(&self, idle: Duration) {
        let tick = (idle / 4).clamp(Duration::from_millis(10), Duration::from_secs(5));
        loop {
            tokio::time::sleep(tick).await;
            let s = &self.shared;
            let quiet = s
                .last_activity
                .lock()
                .map(|t| t.elapsed() >= idle)
                .unwrap_or(false);
            // Under the channel's lock: a connection that opens after this sees Parking and waits.
            let claimed = s.phase.send_if_modified(|p| {
                if *p == Phase::Active && quiet && s.open.load(Ordering::SeqCst) == 0 {
                    *p = Phase::Parking;
                    true
                } else {
                    false
                }
            });
            if !claimed {
                continue;
            }
            let activation = s.activation.clone();
            match tokio::task::spawn_blocking(move || activation.park()).await {
                Ok(Ok(())) => {
                    s.idle_parks.fetch_add(1, Ordering::Relaxed);
                    tracing::info!("activator: idle, worker parked");
                    s.phase.send_replace(Phase::Parked { last_error: None });
                }
                Ok(Err(e)) => {
                    // A park that fails leaves the worker serving (all or nothing).
                    tracing::warn!(error = %e, "activator: idle park failed; the worker keeps serving");
                    self.touch();
                    s.phase.send_replace(Phase::Active);
                }
                Err(e) => {
                    tracing::error!(error = %e, "activator: the park panicked");
                    self.touch();
                    s.phase.send_replace(Phase::Active);
                }
            }
        }
    }

    async fn handle(&self, mut conn: Box<dyn Io>) {
        let s = &self.shared;
        s.open.fetch_add(1, Ordering::SeqCst);
        let _open = OpenGuard(self.shared.clone());
        self.touch();
        if let Err(reason) = self.ensure_active().await {
            s.rejected.fetch_add(1, Ordering::Relaxed);
            self.reject(&mut conn, &reason).await;
            return;
        }
        let mut up = match self.connect_upstream().await {
            Ok(u) => u,
            Err(e) => {
                s.rejected.fetch_add(1, Ordering::Relaxed);
                self.reject(
                    &mut conn,
                    &format!("the worker does not accept connections: {e}"),
                )
                .await;
                return;
            }
        };
        s.forwarded.fetch_add(1, Ordering::Relaxed);
        if let Err(e) = tokio::io::copy_bidirectional(&mut conn, &mut up).await {
            tracing::debug!(error = %e, "activator: connection ended with an error");
        }
        self.touch();
    }

    /// A connection to the worker, in its network namespace when it has its own.
    async fn connect_upstream(&self) -> std::io::Result<Box<dyn Io>> {
        let s = &self.shared;
        match (s.activation.netns(), &s.upstream) {
            (Some(pid), Addr::Tcp(a)) => {
                let a = *a;
                let std = tokio::task::spawn_blocking(move || {
                    cryo_proc::in_net_namespace_of(pid, || std::net::TcpStream::connect(a))
                })
                .await
                .map_err(std::io::Error::other)??;
                std.set_nonblocking(true)?;
                Ok(Box::new(tokio::net::TcpStream::from_std(std)?))
            }
            // A path is the same in every network namespace.
            _ => s.upstream.connect().await,
        }
    }

    async fn reject(&self, conn: &mut Box<dyn Io>, reason: &str) {
        if self.shared.policy.http {
            let body = format!("cryo activator: the worker could not be activated: {reason}\n");
            let msg = format!(
                "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nretry-after: 5\r\nconnection: close\r\ncontent-length: {}\r\n\r\n{body}",
                body.len()
            );
            let _ = conn.write_all(msg.as_bytes()).await;
            let _ = conn.shutdown().await;
        }
    }
}

/// Serves `activator` on `listen` in a runtime of its own, until the process ends; `bound` is
/// called with the address once it listens (a TCP port 0 resolved). For a foreground command.
pub fn run_blocking(
    listen: &Addr,
    activator: Activator,
    bound: impl FnOnce(&Addr),
) -> std::io::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let l = listen.listen().await?;
        bound(&l.local_addr()?);
        activator.serve(l).await;
        Ok(())
    })
}

struct OpenGuard(Arc<Shared>);

impl Drop for OpenGuard {
    fn drop(&mut self) {
        if let Ok(mut t) = self.0.last_activity.lock() {
            *t = Instant::now();
        }
        self.0.open.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A connection, TCP or unix.
pub trait Io: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Io for T {}
