//! Every piece started together, for the agent: a few lines of wiring.
//!
//! ```no_run
//! # fn main() -> Result<(), cryo_telemetry::StartError> {
//! let state = cryo_state::StateDir::default();
//! let cfg = cryo_telemetry::TelemetryConfig {
//!     metrics_listen: Some(cryo_telemetry::DEFAULT_LISTEN.to_owned()),
//!     syslog: Some("logs.example:6514".to_owned()),
//! };
//! let telemetry = cryo_telemetry::Telemetry::start(&state, &cfg)?;
//! telemetry.live().pins_held.set(0);
//! # Ok(()) }
//! ```

use std::sync::Arc;

use cryo_state::StateDir;

use crate::error::{ForwardError, MetricsError, ServeError};
use crate::forward::{ForwardConfig, ForwardStatus, Forwarder};
use crate::metrics::{LiveGauges, Metrics};
use crate::server::{JournalFeed, MetricsServer};

/// What to start.
#[derive(Debug, Clone, Default)]
pub struct TelemetryConfig {
    /// Serve `/metrics` here (`HOST:PORT`); `None`: no listener (the metrics are still kept).
    pub metrics_listen: Option<String>,
    /// Forward every journal record to this syslog collector (`HOST:PORT`, TCP); `None`: none.
    pub syslog: Option<String>,
}

/// Starting the telemetry failed.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The metrics registry.
    #[error(transparent)]
    Metrics(#[from] MetricsError),
    /// The journal feed or the listener.
    #[error(transparent)]
    Serve(#[from] ServeError),
    /// The forwarder.
    #[error(transparent)]
    Forward(#[from] ForwardError),
}

/// The running telemetry of a node: metrics fed from the journal (with the live gauges), the
/// `/metrics` listener and the syslog forwarder, as configured. Dropping it stops them all.
#[derive(Debug)]
pub struct Telemetry {
    metrics: Arc<Metrics>,
    live: LiveGauges,
    // Stopped in this order on drop: the listener, the feed, the forwarder.
    server: Option<MetricsServer>,
    _feed: JournalFeed,
    forwarder: Option<Forwarder>,
}

impl Telemetry {
    /// Reads the journal of `state` into the metrics, then starts what `cfg` asks for.
    pub fn start(state: &StateDir, cfg: &TelemetryConfig) -> Result<Telemetry, StartError> {
        let (metrics, live) = Metrics::and_live_gauges()?;
        let metrics = Arc::new(metrics);
        let feed = JournalFeed::start(&state.journal_dir(), Arc::clone(&metrics))?;
        let forwarder = match &cfg.syslog {
            Some(addr) => {
                let f = Forwarder::start(ForwardConfig::new(state, addr.clone()))?;
                metrics.watch_forwarder(f.shared())?;
                Some(f)
            }
            None => None,
        };
        let server = match &cfg.metrics_listen {
            Some(addr) => Some(MetricsServer::start(addr, Arc::clone(&metrics))?),
            None => None,
        };
        Ok(Telemetry {
            metrics,
            live,
            server,
            _feed: feed,
            forwarder,
        })
    }

    /// The metrics (to encode them elsewhere, e.g. on the agent's own HTTP server).
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    /// The gauges of live state, for their owner to set.
    pub fn live(&self) -> &LiveGauges {
        &self.live
    }

    /// Where `/metrics` is served, if it is.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.server.as_ref().map(MetricsServer::local_addr)
    }

    /// The forwarder's state, if one runs.
    pub fn forwarder(&self) -> Option<ForwardStatus> {
        self.forwarder.as_ref().map(Forwarder::status)
    }
}
