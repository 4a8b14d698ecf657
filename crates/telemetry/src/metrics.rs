//! Prometheus metrics, fed from journal records, plus gauges of live state set by their owner.
//!
//! # Design
//! The journal already records every fact these metrics count (`Locked { ms }`, `Refused`,
//! `Pinned`...), and it records the standalone CLI's work as well as the agent's. So counters and
//! histograms are derived from journal records only ([`Metrics::observe`]): one source of truth,
//! and a reader that starts from the first record after a restart shows the node's totals, not
//! the totals since the agent started. State that the journal does not hold (pins held *now*,
//! processes guarded *now*, GPUs quarantined *now*) are gauges set by whoever owns that state
//! ([`LiveGauges`]); they are only registered where such an owner exists
//! ([`Metrics::with_live_gauges`]), so a standalone reader never shows a false zero.
//!
//! Durations are histograms in seconds with buckets from 5 ms to 10 min: a lock takes
//! milliseconds, a checkpoint or restore of tens of GiB seconds, a CRIU dump of a large host
//! image minutes.
//!
//! Output is the Prometheus text format 0.0.4 (the `prometheus` crate), which `promtool check
//! metrics` lints; see the crate docs for why not OpenMetrics.

use std::sync::Arc;

use cryo_journal::{Event, Record};
use prometheus::core::{Collector, Desc};
use prometheus::proto::MetricFamily;
use prometheus::{
    Encoder, Histogram, HistogramOpts, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts,
    Registry, TextEncoder,
};

use crate::error::MetricsError;
use crate::event_type;
use crate::forward::ForwardShared;

/// Every metric's name starts with this.
pub const PREFIX: &str = "cryo";

/// Histogram buckets, seconds.
pub const DURATION_BUCKETS: [f64; 15] = [
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 600.0,
];

/// The content type of [`Metrics::encode`]'s output.
pub const CONTENT_TYPE: &str = "text/plain; version=0.0.4; charset=utf-8";

/// The registry and every journal-derived metric.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    lock: Histogram,
    checkpoint: Histogram,
    verify: Histogram,
    restore: Histogram,
    unlock: Histogram,
    dump: Histogram,
    criu_restore: Histogram,
    stop: Histogram,
    thaw: Histogram,
    park: Histogram,
    wake: Histogram,
    checkpointed_bytes: IntCounter,
    stops: IntCounterVec,
    refusals: IntCounter,
    freezes: IntCounterVec,
    thaws: IntCounterVec,
    parks: IntCounterVec,
    wakes: IntCounterVec,
    standbys: IntCounterVec,
    signals_held: IntCounter,
    pins: IntCounter,
    quarantines: IntCounter,
    appends: IntCounterVec,
    last_seq: IntGauge,
    live: Option<LiveGauges>,
}

/// Gauges of live state, set by the component that owns it (the agent's guard and fence).
#[derive(Debug, Clone)]
pub struct LiveGauges {
    /// Driver fds held open by cryo now (`cryo_pins_held`).
    pub pins_held: IntGauge,
    /// Processes the guard watches now (`cryo_guarded_processes`).
    pub guarded_processes: IntGauge,
    /// GPUs in quarantine now (`cryo_gpus_quarantined`).
    pub gpus_quarantined: IntGauge,
    /// Standbys ready now, by image (`cryo_standbys_ready{image}`).
    pub standbys_ready: IntGaugeVec,
    /// Host memory held by ready standbys now, by image (`cryo_standby_host_bytes{image}`).
    pub standby_host_bytes: IntGaugeVec,
}

impl Metrics {
    /// The journal-derived metrics only (what a reader of the journal alone can know).
    pub fn new() -> Result<Metrics, MetricsError> {
        let registry = Registry::new_custom(Some(PREFIX.to_owned()), None).map_err(|source| {
            MetricsError::Register {
                name: PREFIX.to_owned(),
                source,
            }
        })?;
        let r = Reg(&registry);
        let m = Metrics {
            lock: r.histogram("lock_duration_seconds", "Time to lock a CUDA context (Locked records).")?,
            checkpoint: r.histogram("checkpoint_duration_seconds", "Time to checkpoint a locked context's device memory into host memory (Checkpointed records).")?,
            verify: r.histogram("verify_duration_seconds", "Time from checkpoint until NVML lists no device memory for the process (Verified records).")?,
            restore: r.histogram("restore_duration_seconds", "Time of the driver's restore of a context (RestoreCompleted records that measured one).")?,
            unlock: r.histogram("unlock_duration_seconds", "Time to unlock a context (Unlocked records).")?,
            dump: r.histogram("dump_duration_seconds", "Time of CRIU's dump of a process tree in a freeze (Dumped records).")?,
            criu_restore: r.histogram("criu_restore_duration_seconds", "Time of CRIU's restore of a process tree in a thaw (CriuRestored records).")?,
            stop: r.histogram("stop_duration_seconds", "Wall time of a whole cryo stop (StopCompleted records).")?,
            thaw: r.histogram("thaw_duration_seconds", "Wall time of a whole thaw (ThawCompleted records).")?,
            park: r.histogram("park_duration_seconds", "Wall time of a whole park: suspend in place, verified (ParkCompleted records).")?,
            wake: r.histogram("wake_duration_seconds", "Wall time of a whole wake of a parked worker: restore, guard, unlock (WakeCompleted records).")?,
            checkpointed_bytes: r.counter("checkpointed_bytes_total", "Device memory moved into host memory by checkpoints.")?,
            stops: r.counter_vec("stops_total", "Stops finished, by outcome: completed, refused (nothing ended), unsafe (refused processes ended anyway).", "outcome", &["completed", "refused", "unsafe"])?,
            refusals: r.counter("refusals_total", "Processes cryo refused to end because their context could not be suspended (Refused records, stop and guard).")?,
            freezes: r.counter_vec("freezes_total", "Freezes finished, by outcome.", "outcome", &["published", "failed"])?,
            thaws: r.counter_vec("thaws_total", "Thaws finished, by outcome.", "outcome", &["completed", "failed"])?,
            parks: r.counter_vec("parks_total", "Parks finished, by outcome.", "outcome", &["completed", "failed"])?,
            wakes: r.counter_vec("wakes_total", "Wakes of parked workers finished, by outcome.", "outcome", &["completed", "failed"])?,
            standbys: r.counter_vec("standbys_total", "Standbys restored ready, claimed (handed out) and dropped (exited, stale, removed, unfinished), by event.", "event", &["ready", "claimed", "dropped"])?,
            signals_held: r.counter("signals_held_total", "Fatal signals the guard held to suspend the context first (FatalSignal records).")?,
            pins: r.counter("pins_total", "Contexts whose driver fds the guard pinned at exit (Pinned records).")?,
            quarantines: r.counter("gpu_quarantines_total", "GPUs put in quarantine (GpuQuarantined records).")?,
            appends: r.counter_vec("journal_appends_total", "Journal records, by event type.", "type", &[])?,
            last_seq: r.gauge("journal_last_seq", "Sequence number of the last journal record observed.")?,
            live: None,
            registry,
        };
        Ok(m)
    }

    /// The journal-derived metrics and the [`LiveGauges`] (for the owner of the live state).
    pub fn with_live_gauges() -> Result<Metrics, MetricsError> {
        Ok(Metrics::and_live_gauges()?.0)
    }

    /// [`Metrics::with_live_gauges`], and the gauges themselves (handles to the same values).
    pub fn and_live_gauges() -> Result<(Metrics, LiveGauges), MetricsError> {
        let mut m = Metrics::new()?;
        let r = Reg(&m.registry);
        let live = LiveGauges {
            pins_held: r.gauge(
                "pins_held",
                "Driver fds of dead restored processes that cryo holds open now.",
            )?,
            guarded_processes: r.gauge("guarded_processes", "Processes the guard watches now.")?,
            gpus_quarantined: r.gauge("gpus_quarantined", "GPUs in quarantine now.")?,
            standbys_ready: r.gauge_vec(
                "standbys_ready",
                "Standbys ready now (restored, CHECKPOINTED, off the GPU), by image.",
                "image",
            )?,
            standby_host_bytes: r.gauge_vec(
                "standby_host_bytes",
                "Host memory (resident) held by the ready standbys now, by image.",
                "image",
            )?,
        };
        m.live = Some(live.clone());
        Ok((m, live))
    }

    /// The live gauges, if registered.
    pub fn live(&self) -> Option<&LiveGauges> {
        self.live.as_ref()
    }

    /// Exposes a forwarder's state: `cryo_syslog_connected`, `cryo_syslog_delivered_seq`,
    /// `cryo_syslog_sent_total`, `cryo_syslog_resent_total`, `cryo_syslog_connections_total`,
    /// `cryo_syslog_lost_records_total`.
    pub fn watch_forwarder(&self, shared: Arc<ForwardShared>) -> Result<(), MetricsError> {
        let c = ForwarderCollector::new(shared)?;
        self.registry
            .register(Box::new(c))
            .map_err(|source| MetricsError::Register {
                name: "syslog_*".to_owned(),
                source,
            })
    }

    /// Counts one journal record.
    pub fn observe(&self, record: &Record) {
        let secs = |ms: u64| ms as f64 / 1000.0;
        self.appends
            .with_label_values(&[event_type(&record.event).as_str()])
            .inc();
        self.last_seq.set(
            i64::try_from(record.seq)
                .unwrap_or(i64::MAX)
                .max(self.last_seq.get()),
        );
        match &record.event {
            Event::Locked { ms, .. } => self.lock.observe(secs(*ms)),
            Event::Checkpointed { ms, bytes, .. } => {
                self.checkpoint.observe(secs(*ms));
                self.checkpointed_bytes.inc_by(*bytes);
            }
            Event::Verified { ms: Some(ms), .. } => self.verify.observe(secs(*ms)),
            Event::RestoreCompleted { ms: Some(ms), .. } => self.restore.observe(secs(*ms)),
            Event::Unlocked { ms: Some(ms), .. } => self.unlock.observe(secs(*ms)),
            Event::Dumped { ms, .. } => self.dump.observe(secs(*ms)),
            Event::CriuRestored { ms, .. } => self.criu_restore.observe(secs(*ms)),
            Event::StopCompleted {
                ms,
                refused,
                killed,
                ..
            } => {
                self.stop.observe(secs(*ms));
                let outcome = match (refused.is_empty(), killed.is_empty()) {
                    (true, _) => "completed",
                    (false, true) => "refused",
                    (false, false) => "unsafe",
                };
                self.stops.with_label_values(&[outcome]).inc();
            }
            Event::Refused { .. } => self.refusals.inc(),
            Event::ImagePublished { .. } => self.freezes.with_label_values(&["published"]).inc(),
            Event::FreezeFailed { .. } => self.freezes.with_label_values(&["failed"]).inc(),
            Event::ThawCompleted { ms, .. } => {
                self.thaw.observe(secs(*ms));
                self.thaws.with_label_values(&["completed"]).inc();
            }
            Event::ThawFailed { .. } => self.thaws.with_label_values(&["failed"]).inc(),
            Event::ParkCompleted { ms, .. } => {
                self.park.observe(secs(*ms));
                self.parks.with_label_values(&["completed"]).inc();
            }
            Event::ParkFailed { .. } => self.parks.with_label_values(&["failed"]).inc(),
            Event::WakeCompleted { ms, .. } => {
                self.wake.observe(secs(*ms));
                self.wakes.with_label_values(&["completed"]).inc();
            }
            Event::WakeFailed { .. } => self.wakes.with_label_values(&["failed"]).inc(),
            Event::StandbyReady { .. } => self.standbys.with_label_values(&["ready"]).inc(),
            Event::StandbyClaimed { .. } => self.standbys.with_label_values(&["claimed"]).inc(),
            Event::StandbyDropped { .. } => self.standbys.with_label_values(&["dropped"]).inc(),
            Event::FatalSignal { .. } => self.signals_held.inc(),
            Event::Pinned { .. } => self.pins.inc(),
            Event::GpuQuarantined { .. } => self.quarantines.inc(),
            _ => {}
        }
    }

    /// The exposition text (Prometheus text format 0.0.4, [`CONTENT_TYPE`]).
    pub fn encode(&self) -> String {
        let mut buf = Vec::new();
        if let Err(err) = TextEncoder::new().encode(&self.registry.gather(), &mut buf) {
            tracing::error!(%err, "cannot encode the metrics");
        }
        String::from_utf8_lossy(&buf).into_owned()
    }
}

/// Registration helpers: every metric gets the registry's prefix.
struct Reg<'a>(&'a Registry);

impl Reg<'_> {
    fn add<C: Collector + Clone + 'static>(&self, name: &str, c: C) -> Result<C, MetricsError> {
        self.0
            .register(Box::new(c.clone()))
            .map_err(|source| MetricsError::Register {
                name: name.to_owned(),
                source,
            })?;
        Ok(c)
    }

    fn err(name: &str) -> impl FnOnce(prometheus::Error) -> MetricsError + '_ {
        move |source| MetricsError::Register {
            name: name.to_owned(),
            source,
        }
    }

    fn histogram(&self, name: &str, help: &str) -> Result<Histogram, MetricsError> {
        let h =
            Histogram::with_opts(HistogramOpts::new(name, help).buckets(DURATION_BUCKETS.to_vec()))
                .map_err(Self::err(name))?;
        self.add(name, h)
    }

    fn counter(&self, name: &str, help: &str) -> Result<IntCounter, MetricsError> {
        let c = IntCounter::new(name, help).map_err(Self::err(name))?;
        self.add(name, c)
    }

    fn gauge_vec(&self, name: &str, help: &str, label: &str) -> Result<IntGaugeVec, MetricsError> {
        let g = IntGaugeVec::new(Opts::new(name, help), &[label]).map_err(Self::err(name))?;
        self.add(name, g)
    }

    fn gauge(&self, name: &str, help: &str) -> Result<IntGauge, MetricsError> {
        let g = IntGauge::new(name, help).map_err(Self::err(name))?;
        self.add(name, g)
    }

    /// A counter with one label; `known` values are created at zero so they show before the
    /// first event (a rate over a series that appears mid-way misses its first increment).
    fn counter_vec(
        &self,
        name: &str,
        help: &str,
        label: &str,
        known: &[&str],
    ) -> Result<IntCounterVec, MetricsError> {
        let c = IntCounterVec::new(Opts::new(name, help), &[label]).map_err(Self::err(name))?;
        for v in known {
            c.with_label_values(&[v]);
        }
        self.add(name, c)
    }
}

/// Reads a forwarder's shared counters at each scrape.
struct ForwarderCollector {
    shared: Arc<ForwardShared>,
    connected: IntGauge,
    delivered: IntGauge,
    sent: IntCounter,
    resent: IntCounter,
    connections: IntCounter,
    lost: IntCounter,
    descs: Vec<Desc>,
}

impl ForwarderCollector {
    fn new(shared: Arc<ForwardShared>) -> Result<ForwarderCollector, MetricsError> {
        // Names without the prefix: the registry adds it.
        let gauge = |name: &str, help: &str| {
            IntGauge::new(name, help).map_err(|source| MetricsError::Register {
                name: name.to_owned(),
                source,
            })
        };
        let counter = |name: &str, help: &str| {
            IntCounter::new(name, help).map_err(|source| MetricsError::Register {
                name: name.to_owned(),
                source,
            })
        };
        let connected = gauge(
            "syslog_connected",
            "Whether the syslog forwarder is connected to its collector (1) or not (0).",
        )?;
        let delivered = gauge(
            "syslog_delivered_seq",
            "Journal seq up to which the collector acknowledged every record.",
        )?;
        let sent = counter(
            "syslog_sent_total",
            "Syslog messages written to the collector, resends included.",
        )?;
        let resent = counter(
            "syslog_resent_total",
            "Syslog messages written again after a connection ended (at-least-once delivery).",
        )?;
        let connections = counter(
            "syslog_connections_total",
            "Connections made to the syslog collector.",
        )?;
        let lost = counter(
            "syslog_lost_records_total",
            "Journal records the collector will never get: the journal no longer held them when the forwarder came to them (archives removed by the retention while it was behind); each range is sent as a records_lost message.",
        )?;
        let descs = [
            connected.desc(),
            delivered.desc(),
            sent.desc(),
            resent.desc(),
            connections.desc(),
            lost.desc(),
        ]
        .into_iter()
        .flatten()
        .cloned()
        .collect();
        Ok(ForwarderCollector {
            shared,
            connected,
            delivered,
            sent,
            resent,
            connections,
            lost,
            descs,
        })
    }
}

impl Collector for ForwarderCollector {
    fn desc(&self) -> Vec<&Desc> {
        self.descs.iter().collect()
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let s = self.shared.status();
        self.connected.set(i64::from(s.connected));
        self.delivered
            .set(i64::try_from(s.delivered_seq).unwrap_or(i64::MAX));
        // Counters only go up: bring each to the shared value.
        let bump = |c: &IntCounter, to: u64| c.inc_by(to.saturating_sub(c.get()));
        bump(&self.sent, s.sent_total);
        bump(&self.resent, s.resent_total);
        bump(&self.connections, s.connections_total);
        bump(&self.lost, s.lost_total);
        [
            &self.connected as &dyn Collector,
            &self.delivered,
            &self.sent,
            &self.resent,
            &self.connections,
            &self.lost,
        ]
        .iter()
        .flat_map(|c| c.collect())
        .collect()
    }
}
