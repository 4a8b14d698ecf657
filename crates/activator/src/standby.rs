//! [`FromStandby`]: the activation of a worker that does not exist yet: the first connection
//! claims a standby of an image from the agent's pool, which is then the worker.
//!
//! # Design
//! - The pool is the agent's: a claim is `POST /v1/standby/claim` (the agent takes one standby
//!   out under its pool's lock, checks the image again, restores its GPU state, has its guard
//!   trace it while LOCKED, unlocks; the pool refills in the background). The activator's one
//!   activation for any number of waiting connections makes that one claim.
//! - The claimed worker runs in its own pid and network namespaces (several standbys of one image
//!   serve on the same port inside theirs): the activator reaches its upstream address and its
//!   health check inside the claimed worker's network namespace ([`Activation::netns`]).
//! - Idle, the claimed worker is parked in place (`POST /v1/park`), not given back: the next
//!   connection wakes it (`POST /v1/wake`), which is cheaper than a claim and leaves the pool to
//!   other activators. A claimed worker that died is forgotten: the next connection claims a
//!   new standby.
//!
//! # Limitations
//! The claimed worker is not returned to the pool when the activator ends: it stays as it is
//! (serving or parked), an ordinary worker for `cryo stop`.

use std::path::PathBuf;
use std::sync::Mutex;

use cryo_api::{
    AgentClient, ClientError, ParkRequest, StandbyClaimRequest, TargetSpec, WakeRequest, WakeSpec,
};
use cryo_journal::ProcId;
use cryo_lifecycle::NoProgress;
use cryo_proc::Pid;

use crate::{Activation, ActivationError};

/// Claims a standby of `image` from the agent on the first activation, then parks and wakes
/// that worker in place (see the module docs).
pub struct FromStandby {
    /// The agent's client.
    pub client: AgentClient,
    /// The image whose pool to claim from.
    pub image: PathBuf,
    /// How the claim and later wakes are done (its health URL is not used: the activator checks
    /// health in the worker's network namespace).
    pub wake: WakeSpec,
    /// How idle parks are done (its target is replaced by the claimed worker).
    pub park: ParkRequest,
    claimed: Mutex<Option<ProcId>>,
}

impl std::fmt::Debug for FromStandby {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FromStandby")
            .field("image", &self.image)
            .field("claimed", &self.claimed())
            .finish_non_exhaustive()
    }
}

impl FromStandby {
    /// Nothing claimed yet.
    pub fn new(client: AgentClient, image: PathBuf, wake: WakeSpec, park: ParkRequest) -> Self {
        FromStandby {
            client,
            image,
            wake: WakeSpec {
                health_url: None,
                ..wake
            },
            park,
            claimed: Mutex::new(None),
        }
    }

    /// With `root` already claimed (an agent that restarted: its activator's worker).
    pub fn with_claimed(self, root: Option<ProcId>) -> Self {
        *self.claimed.lock().unwrap_or_else(|e| e.into_inner()) = root;
        self
    }

    /// The root of the worker claimed, if one was and it lives.
    pub fn claimed(&self) -> Option<ProcId> {
        let mut c = self.claimed.lock().unwrap_or_else(|e| e.into_inner());
        if c.is_some_and(|p| !p.is_alive_same()) {
            *c = None;
        }
        *c
    }
}

fn error(e: ClientError) -> ActivationError {
    match &e {
        ClientError::Api(a) if a.kind == cryo_api::ErrorKind::Refused => {
            ActivationError::Refused(e.to_string())
        }
        _ => ActivationError::Failed(e.to_string()),
    }
}

impl Activation for FromStandby {
    fn wake(&self) -> Result<(), ActivationError> {
        if let Some(root) = self.claimed() {
            let req = WakeRequest {
                target: TargetSpec::Tree { pid: root.pid },
                wake: self.wake.clone(),
            };
            return self.client.wake(&req, &NoProgress).map(drop).map_err(error);
        }
        let req = StandbyClaimRequest {
            image: self.image.clone(),
            wake: self.wake.clone(),
        };
        let claim = self.client.standby_claim(&req).map_err(error)?;
        tracing::info!(
            root = claim.standby.root.pid,
            ms = claim.elapsed_ms,
            "activator: standby claimed"
        );
        *self.claimed.lock().unwrap_or_else(|e| e.into_inner()) = Some(claim.standby.root);
        Ok(())
    }

    fn park(&self) -> Result<(), ActivationError> {
        let Some(root) = self.claimed() else {
            return Ok(());
        };
        let req = ParkRequest {
            target: TargetSpec::Tree { pid: root.pid },
            ..self.park.clone()
        };
        self.client.park(&req, &NoProgress).map(drop).map_err(error)
    }

    fn netns(&self) -> Option<Pid> {
        self.claimed().map(|p| p.pid)
    }
}
