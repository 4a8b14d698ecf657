//! The pre-thawed standby pools the agent keeps (`/v1/standby`): per image, N workers restored
//! by CRIU ahead of demand and kept CHECKPOINTED (no live restored context) until claimed.
//!
//! # Design
//! - **State from evidence.** Every change is journaled first-hand by the lifecycle
//!   ([`cryo_journal::Event::StandbyPool`], `StandbyReady`, `StandbyClaimed`, `StandbyDropped`).
//!   An agent that starts rebuilds its pools from the journal and adopts each ready standby only
//!   if its processes are the recorded ones (pid and start time) and the driver says every CUDA
//!   one is CHECKPOINTED; anything else is dropped (a standby found LOCKED or RUNNING was being
//!   woken: it is left to `cryo wake`, never killed).
//! - **Refill** runs on one thread ([`Pools::refill_loop`]): it drops standbys that died or whose
//!   image changed (stale: another manifest digest), and restores missing ones one at a time on
//!   the agent's parent thread (CRIU restores a tree as a child of the thread that runs it, and
//!   that thread reaps them). A refill that fails or is refused is retried after
//!   [`RETRY`]; the reason is in the pool's status.
//! - **Claims** take a standby out of the pool under its lock, so two claims never get the same
//!   one, then wake it ([`cryo_lifecycle::standby::claim`]): the image is checked again (a stale
//!   standby is never handed out), the fence and free device memory are checked by the wake, the
//!   guard traces it while LOCKED, then it is unlocked. One claim wakes at a time (the wake's
//!   free-memory check and the restore are not atomic across concurrent wakes). A claim refused
//!   before any restore (GPU full, fenced) puts the standby back; one that fails after the
//!   restore removes it safely. No refill starts while a claim runs: a CRIU restore beside the
//!   claim's GPU restore would compete with it on the request path (the pool refills right
//!   after); a refill already under way when a claim comes is not interrupted.
//!
//! - **No orphans.** The tree CRIU restores is journaled (`StandbyRestoring`, every pid and
//!   start time) at CRIU's gate, before any of it runs; an agent killed before that record makes
//!   CRIU abort the restore (the gate waits on a lock the agent holds). One killed after it and
//!   before `StandbyReady` leaves an unfinished standby: the next agent, before adopting, ends
//!   it once the driver says every context is CHECKPOINTED (through the stop path), or, if
//!   anything of it has a live context or cannot be judged, kills nothing and has the guard
//!   trace it ([`cryo_lifecycle::standby::sweep`]).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{ConnectInfo, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use cryo_api::{
    path, Access, ApiError, ErrorKind, PoolStatus, StandbyClaim, StandbyClaimRequest,
    StandbyCreateRequest, StandbyList, StandbyRemoveRequest, StandbyRemoved,
};
use cryo_criu::image::ImageError;
use cryo_journal::Event;
use cryo_lifecycle::standby::{self as sb, ClaimError};
use cryo_lifecycle::{NoProgress, Standby, WakeError};

use crate::auth::Peer;
use crate::server::{allow, blocking, change_request, Failure, Pids};
use crate::Agent;

/// How long a failed refill waits before it is tried again.
pub(crate) const RETRY: Duration = Duration::from_secs(5);

/// How often the refill loop looks at the pools without being woken.
const TICK: Duration = Duration::from_millis(500);

/// The routes of `/v1/standby`, merged into the agent's router.
pub(crate) fn routes() -> Router<Arc<Agent>> {
    Router::new()
        .route(path::STANDBY, get(list))
        .route(&format!("{}/create", path::STANDBY), post(create))
        .route(&format!("{}/claim", path::STANDBY), post(claim))
        .route(&format!("{}/remove", path::STANDBY), post(remove))
}

async fn list(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
) -> Result<Response, Failure> {
    allow(&agent, &peer, Access::Read)?;
    blocking(move || Ok(agent.pools.list())).await
}

async fn create(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: StandbyCreateRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::info!(image = %req.image.display(), count = req.count, ?peer.cred, "standby create");
    blocking(move || agent.standby_create(&req)).await
}

async fn claim(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let requested = Instant::now();
    let req: StandbyClaimRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::info!(image = %req.image.display(), ?peer.cred, "standby claim");
    blocking(move || agent.standby_claim(&req, requested)).await
}

async fn remove(
    State(agent): State<Arc<Agent>>,
    ConnectInfo(peer): ConnectInfo<Peer>,
    body: Bytes,
) -> Result<Response, Failure> {
    let req: StandbyRemoveRequest = change_request(&agent, &peer, &body, Pids::None)?;
    tracing::info!(image = %req.image.display(), ?peer.cred, "standby remove");
    blocking(move || agent.standby_remove(&req)).await
}

/// One image's pool.
#[derive(Debug, Default)]
struct Pool {
    count: u32,
    /// The deadline of each standby's CRIU restore (`None`: the image's default).
    criu_timeout: Option<Duration>,
    ready: VecDeque<Standby>,
    refilling: u32,
    last_error: Option<String>,
    retry_at: Option<Instant>,
}

/// Every pool of the agent.
#[derive(Debug, Default)]
pub(crate) struct Pools {
    pools: Mutex<BTreeMap<PathBuf, Pool>>,
    kick: Condvar,
    /// One claim wakes at a time.
    claiming: Mutex<()>,
}

impl Pools {
    fn lock(&self) -> MutexGuard<'_, BTreeMap<PathBuf, Pool>> {
        self.pools.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `GET /v1/standby`.
    pub(crate) fn list(&self) -> StandbyList {
        StandbyList {
            pools: self
                .lock()
                .iter()
                .map(|(image, p)| PoolStatus {
                    image: image.clone(),
                    count: p.count,
                    ready: p.ready.iter().cloned().collect(),
                    refilling: p.refilling,
                    last_error: p.last_error.clone(),
                })
                .collect(),
        }
    }

    /// Per pool: the image, its ready standbys and the host memory (resident) they hold now.
    pub(crate) fn held(&self) -> Vec<(PathBuf, usize, u64)> {
        let ready: Vec<(PathBuf, Vec<Standby>)> = self
            .lock()
            .iter()
            .map(|(image, p)| (image.clone(), p.ready.iter().cloned().collect()))
            .collect();
        ready
            .into_iter()
            .map(|(image, ready)| {
                let host = ready
                    .iter()
                    .filter_map(sb::open)
                    .flat_map(|t| {
                        t.handles()
                            .iter()
                            .map(|h| h.rss().unwrap_or(0))
                            .collect::<Vec<_>>()
                    })
                    .sum();
                (image, ready.len(), host)
            })
            .collect()
    }

    /// Wakes the refill loop.
    fn kick(&self) {
        self.kick.notify_all();
    }
}

/// Wakes the refill loop when dropped.
struct KickOnDrop<'a>(&'a Pools);

impl Drop for KickOnDrop<'_> {
    fn drop(&mut self) {
        self.0.kick();
    }
}

/// Whether `e`, from a look at a pool's image, says the image is not there or not usable any
/// more (its standbys are dropped), rather than that its file system did not answer or failed
/// to read (a dead disk, an NFS hard mount: no word on the image; a claim looks again).
fn tells_the_image_is_gone(e: &ImageError) -> bool {
    match e {
        ImageError::Unanswered { .. } | ImageError::Stream { .. } => false,
        ImageError::Io { source, .. } => source.kind() == std::io::ErrorKind::NotFound,
        _ => true,
    }
}

/// Why a standby leaves the pool, and what became of it.
fn drop_it(agent: &Agent, s: &Standby, why: &str) {
    // What is left of it (all of it, or what outlived a process it needed) is owned by nothing
    // else: removed through the stop path.
    let what = match sb::drop_standby(&agent.gpu, s, &agent.journal, &NoProgress) {
        gone if gone == sb::ALREADY_GONE => {
            "already gone (it was CHECKPOINTED: nothing live was torn down)".into()
        }
        what => what,
    };
    let reason = format!("{why}: {what}");
    tracing::info!(image = %s.image.display(), root = s.root.pid, %reason, "standby dropped");
    if let Err(e) = agent.journal.append(Event::StandbyDropped {
        image: s.image.display().to_string(),
        root: s.root,
        reason,
    }) {
        tracing::error!(error = %e, "cannot journal a dropped standby");
    }
}

impl Agent {
    /// Rebuilds the pools from the journal at start (see the module docs).
    pub(crate) fn adopt_standbys(&self) {
        let records = match cryo_journal::read(self.journal.dir()) {
            Ok(r) => r.records,
            Err(e) => {
                tracing::error!(error = %e, "cannot read the journal: no standby pool adopted");
                return;
            }
        };
        // Standbys whose agent died between CRIU's restore and their `StandbyReady`.
        for u in sb::unfinished(&records) {
            let what = sb::sweep(
                &self.gpu,
                &u,
                &self.journal,
                self.guard.as_ref(),
                &NoProgress,
            );
            tracing::warn!(image = %u.image, root = u.root.pid, %what, "an unfinished standby");
        }
        let (counts, ready) = sb::from_journal(&records);
        let mut pools = self.pools.lock();
        for (image, config) in counts {
            let pool = pools.entry(image).or_default();
            pool.count = config.count;
            pool.criu_timeout = config.criu_timeout;
        }
        drop(pools);
        for s in ready {
            let (image, root) = (s.image.clone(), s.root);
            let alive = sb::open(&s).is_some();
            let mut pools = self.pools.lock();
            match (
                pools.get_mut(&image),
                alive,
                sb::still_checkpointed(&self.gpu, &s),
            ) {
                (Some(pool), true, Ok(())) => {
                    tracing::info!(image = %image.display(), root = root.pid, "standby adopted");
                    pool.ready.push_back(s);
                }
                (_, true, Err(found)) => {
                    drop(pools);
                    tracing::warn!(%found, root = root.pid, "a standby is not CHECKPOINTED: a claim was cut short; left as it is");
                    let _ = self.journal.append(Event::StandbyDropped {
                        image: image.display().to_string(),
                        root,
                        reason: format!("found {found} at the agent's start (a claim was cut short): left as it is, `cryo wake` finishes it"),
                    });
                }
                (None, true, Ok(())) => {
                    drop(pools);
                    drop_it(self, &s, "its pool is gone");
                }
                (_, false, _) => {
                    drop(pools);
                    drop_it(self, &s, "gone while the agent was not running");
                }
            }
        }
        self.pools.kick();
    }

    /// `POST /v1/standby/create`: sets the pool's count; the refill loop restores them.
    pub(crate) fn standby_create(
        &self,
        req: &StandbyCreateRequest,
    ) -> Result<PoolStatus, ApiError> {
        if req.count == 0 {
            return Err(ApiError::new(
                ErrorKind::BadRequest,
                "--count must be at least 1 (remove a pool with `cryo standby remove`)",
            ));
        }
        // Refused now rather than by every refill: an image that cannot be used. Under the
        // restore's deadline, as a refill's look: a file system that does not answer refuses
        // the request then.
        let limit = req
            .criu_timeout_s
            .map_or_else(|| cryo_lifecycle::criu_deadline(0), Duration::from_secs);
        let opened = cryo_criu::image::Image::open_until(&req.image, Some(Instant::now() + limit))
            .map_err(|e| ApiError::new(ErrorKind::Refused, format!("image refused: {e}")))?;
        if req.count > 1 && !sb::own_namespaces(opened.manifest()) {
            return Err(ApiError::new(
                ErrorKind::Refused,
                format!("{} standbys of {}: a standby keeps the pids and listening ports the worker had, so more than one needs the worker to run in its own pid and network namespaces (as in a container) when it is frozen", req.count, req.image.display()),
            )
            .with_hint("freeze a worker started in fresh namespaces (`cryo run -- PROGRAM...`), or keep one standby"));
        }
        self.journal
            .append(Event::StandbyPool {
                image: req.image.display().to_string(),
                count: req.count,
                criu_timeout_s: req.criu_timeout_s,
            })
            .map_err(|e| ApiError::new(ErrorKind::Failed, format!("cannot journal: {e}")))?;
        let status = {
            let mut pools = self.pools.lock();
            let pool = pools.entry(req.image.clone()).or_default();
            pool.count = req.count;
            pool.criu_timeout = req.criu_timeout_s.map(Duration::from_secs);
            pool.retry_at = None;
            PoolStatus {
                image: req.image.clone(),
                count: pool.count,
                ready: pool.ready.iter().cloned().collect(),
                refilling: pool.refilling,
                last_error: pool.last_error.clone(),
            }
        };
        self.pools.kick();
        Ok(status)
    }

    /// `POST /v1/standby/remove`.
    pub(crate) fn standby_remove(
        &self,
        req: &StandbyRemoveRequest,
    ) -> Result<StandbyRemoved, ApiError> {
        let Some(pool) = self.pools.lock().remove(&req.image) else {
            return Err(ApiError::new(
                ErrorKind::NotFound,
                format!("no standby pool for {}", req.image.display()),
            ));
        };
        self.journal
            .append(Event::StandbyPool {
                image: req.image.display().to_string(),
                count: 0,
                criu_timeout_s: None,
            })
            .map_err(|e| ApiError::new(ErrorKind::Failed, format!("cannot journal: {e}")))?;
        let mut removed = Vec::new();
        for s in pool.ready {
            drop_it(self, &s, "its pool was removed");
            removed.push((s.root, "removed".to_string()));
        }
        Ok(StandbyRemoved { removed })
    }

    /// `POST /v1/standby/claim`.
    pub(crate) fn standby_claim(
        &self,
        req: &StandbyClaimRequest,
        requested: Instant,
    ) -> Result<StandbyClaim, ApiError> {
        let opts = req.wake.options();
        if let Some(h) = &opts.health {
            h.validate()
                .map_err(|e| ApiError::new(ErrorKind::BadRequest, e.to_string()))?;
        }
        // Dropped after `_one` (locals drop in reverse order): the refill loop is woken once
        // the claim is over.
        let _kick = KickOnDrop(&self.pools);
        let _one = self
            .pools
            .claiming
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let queued_ms = requested.elapsed().as_secs_f64() * 1e3;
        loop {
            let next = {
                let mut pools = self.pools.lock();
                let Some(pool) = pools.get_mut(&req.image) else {
                    return Err(ApiError::new(
                        ErrorKind::NotFound,
                        format!("no standby pool for {}", req.image.display()),
                    )
                    .with_hint("create one with `cryo standby create --image DIR`"));
                };
                match pool.ready.pop_front() {
                    Some(s) => s,
                    None => {
                        return Err(ApiError::new(
                            ErrorKind::Refused,
                            format!(
                                "no standby of {} is ready ({} being restored{})",
                                req.image.display(),
                                pool.refilling,
                                pool.last_error
                                    .as_ref()
                                    .map(|e| format!("; the last refill failed: {e}"))
                                    .unwrap_or_default()
                            ),
                        ))
                    }
                }
            };
            // The refill is kicked once this claim is done: a CRIU restore beside the claim's
            // GPU restore competes with it for memory bandwidth and CPU (measured: `cryo bench
            // activate`'s phases).
            let result = sb::claim(
                &self.gpu,
                &next,
                &opts,
                &self.journal,
                &self.state,
                self.guard.as_ref(),
                &NoProgress,
            );
            match result {
                Ok(mut wake) => {
                    // Not on the request path: the guard traced the worker before its unlock;
                    // its journal poll only catches up with the records.
                    let guard = std::sync::Arc::clone(&self.guard);
                    std::thread::spawn(move || {
                        if let Err(e) = guard.poll_journal() {
                            tracing::warn!(err = %e, "cannot read the journal after a claim");
                        }
                    });
                    wake.phases.0.insert(
                        0,
                        ("claim: request to standby taken (agent)".into(), queued_ms),
                    );
                    return Ok(StandbyClaim {
                        standby: next,
                        wake,
                        elapsed_ms: u64::try_from(requested.elapsed().as_millis())
                            .unwrap_or(u64::MAX),
                    });
                }
                // Not the one to hand out; the next may be.
                Err(e @ (ClaimError::Stale { .. } | ClaimError::Gone(_))) => {
                    drop_it(self, &next, &e.to_string());
                }
                Err(ClaimError::Image(e)) => {
                    self.requeue(next);
                    return Err(ApiError::new(
                        ErrorKind::Refused,
                        format!("image refused: {e}"),
                    ));
                }
                // Refused before anything was restored: it stays a standby.
                Err(ClaimError::Wake(e)) if crate::warm::refused_before_restore(&e) => {
                    self.requeue(next);
                    return Err(crate::warm::wake_error(e));
                }
                Err(ClaimError::Wake(e)) => {
                    let msg = e.to_string();
                    if !matches!(e, WakeError::AfterRestore { .. }) {
                        self.requeue(next);
                    } else {
                        drop_it(self, &next, &format!("its claim failed ({msg})"));
                    }
                    return Err(ApiError::new(ErrorKind::Failed, msg));
                }
            }
        }
    }

    /// Puts a standby that was not handed out back at the front of its pool (or removes it
    /// when its pool is gone).
    fn requeue(&self, s: Standby) {
        let mut pools = self.pools.lock();
        if let Some(pool) = pools.get_mut(&s.image) {
            pool.ready.push_front(s);
        } else {
            drop(pools);
            drop_it(self, &s, "its pool is gone");
        }
    }

    /// The refill loop (its own thread, for the agent's life): see the module docs.
    pub(crate) fn refill_loop(self: &Arc<Self>) {
        while !self.stopping() {
            // No refill starts while a claim runs (it is kicked when the claim ends).
            let claiming = self.pools.claiming.try_lock().is_err();
            if claiming {
                let pools = self.pools.lock();
                let _ = self
                    .pools
                    .kick
                    .wait_timeout(pools, TICK)
                    .map(|(g, _)| drop(g));
                continue;
            }
            self.drop_dead_and_stale();
            let next = {
                let mut pools = self.pools.lock();
                let now = Instant::now();
                let todo = pools.iter_mut().find(|(_, p)| {
                    (p.ready.len() as u64 + u64::from(p.refilling)) < u64::from(p.count)
                        && p.retry_at.is_none_or(|t| t <= now)
                });
                match todo {
                    Some((image, p)) => {
                        p.refilling += 1;
                        Some((
                            image.clone(),
                            p.ready.len() + p.refilling as usize - 1,
                            p.criu_timeout,
                        ))
                    }
                    None => {
                        let _ = self
                            .pools
                            .kick
                            .wait_timeout(pools, TICK)
                            .map(|(g, _)| drop(g));
                        None
                    }
                }
            };
            if let Some((image, others, criu_timeout)) = next {
                self.refill_one(&image, others, criu_timeout);
            }
        }
    }

    /// Restores one standby of `image` on the parent thread and puts it in its pool.
    fn refill_one(self: &Arc<Self>, image: &Path, others: usize, criu_timeout: Option<Duration>) {
        let agent = Arc::clone(self);
        let dir = image.to_path_buf();
        let made = self.parent.run(move || {
            let criu = cryo_criu::CriuRpc::locate_in(None, &agent.state.criu_dir())
                .map_err(|e| e.to_string())?;
            sb::prepare(
                &agent.gpu,
                &criu,
                &dir,
                others,
                criu_timeout,
                &agent.journal,
                &agent.state.fence(),
                &NoProgress,
            )
            .map_err(|e| e.to_string())
        });
        let made = made.unwrap_or_else(|| Err("the agent's parent thread is gone".into()));
        let mut pools = self.pools.lock();
        let pool = pools.get_mut(image);
        match (pool, made) {
            (Some(pool), Ok(s)) => {
                pool.refilling -= 1;
                pool.last_error = None;
                tracing::info!(image = %image.display(), root = s.root.pid, criu_ms = s.criu_ms, "standby ready");
                if pool.ready.len() < pool.count as usize {
                    pool.ready.push_back(s);
                } else {
                    drop(pools);
                    drop_it(self, &s, "its pool needs no more");
                }
            }
            (Some(pool), Err(e)) => {
                pool.refilling -= 1;
                tracing::warn!(image = %image.display(), error = %e, "refill failed; trying again later");
                pool.last_error = Some(e);
                pool.retry_at = Some(Instant::now() + RETRY);
            }
            (None, Ok(s)) => {
                drop(pools);
                drop_it(self, &s, "its pool was removed while it was restored");
            }
            (None, Err(_)) => {}
        }
    }

    /// Drops the ready standbys that died or whose image changed. Each image is looked at
    /// outside the pools' lock (a claim must not wait for a file system), for at most
    /// [`sb::CLAIM_IMAGE_LOOK`]: one that does not answer by then, or fails to read, changes
    /// nothing this time ([`tells_the_image_is_gone`]: its standbys are neither dropped nor
    /// trusted; a claim looks again and hands none out unlooked at).
    fn drop_dead_and_stale(&self) {
        let images: Vec<PathBuf> = self
            .pools
            .lock()
            .iter()
            .filter(|(_, pool)| !pool.ready.is_empty())
            .map(|(image, _)| image.clone())
            .collect();
        let mut digests: BTreeMap<PathBuf, Option<String>> = BTreeMap::new();
        for image in images {
            let until = Some(Instant::now() + sb::CLAIM_IMAGE_LOOK);
            let digest = match cryo_criu::image::Image::open_until(&image, until) {
                Ok(i) => Some(i.manifest().manifest_sha256.clone()),
                Err(e) if !tells_the_image_is_gone(&e) => {
                    tracing::warn!(image = %image.display(), error = %e, "cannot look at the image of ready standbys; they stay as they are");
                    continue;
                }
                Err(_) => None,
            };
            digests.insert(image, digest);
        }
        let mut out: Vec<(Standby, String)> = Vec::new();
        {
            let mut pools = self.pools.lock();
            for (image, pool) in pools.iter_mut() {
                let Some(digest) = digests.get(image) else {
                    continue;
                };
                if pool.ready.is_empty() {
                    continue;
                }
                let (keep, gone): (Vec<Standby>, Vec<Standby>) = pool
                    .ready
                    .drain(..)
                    .partition(|s| sb::open(s).is_some() && digest.as_ref() == Some(&s.digest));
                pool.ready = keep.into();
                for s in gone {
                    let why = if sb::open(&s).is_none() {
                        "it exited while ready (CHECKPOINTED: nothing live was torn down)"
                    } else if digest.is_none() {
                        "its image cannot be opened any more"
                    } else {
                        "its image changed since it was restored (stale)"
                    };
                    out.push((s, why.to_string()));
                }
            }
        }
        for (s, why) in out {
            drop_it(self, &s, &why);
        }
    }
}
