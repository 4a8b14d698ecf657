//! cryo's observability: what an operator sees of a node from elsewhere, including after the
//! node wedged silently and must be power cycled (its journal survives on its disk but cannot be
//! read until the host is back).
//!
//! - [`Metrics`]: Prometheus metrics derived from journal records ([`Metrics::observe`]), plus
//!   [`LiveGauges`] set by the owner of live state; [`JournalFeed`] keeps them fed from the
//!   journal, [`MetricsServer`] answers `GET /metrics` on a TCP listener (loopback by default).
//! - [`Forwarder`]: every journal record pushed off the host as it is written, as RFC 5424 syslog
//!   over TCP ([`SyslogFormat`]), caught up from a durable offset ([`OffsetFile`]) after the
//!   collector or the forwarder was down.
//! - [`Follow`]: records of the journal from a given `seq` on, waking on each append: the
//!   building block of the forwarder, the metrics feed and the agent's `GET /v1/events?follow=1`
//!   NDJSON stream ([`ndjson_line`]).
//!
//! # Design
//! One source of truth: the journal. Everything here reads it with the journal's lock-free
//! reader, in threads of its own, so nothing here can block or slow an append, and the
//! standalone CLI's work is counted and forwarded as well as the agent's. The agent (`cryod`)
//! wires these pieces with [`Telemetry::start`] (a [`JournalFeed`] and a [`MetricsServer`] on one
//! [`Metrics`] with [`LiveGauges`], a [`Forwarder`] when a collector is configured), sets the
//! gauges from its guard and fence, and serves [`Follow`] as NDJSON.
//!
//! Metrics use the `prometheus` crate, whose text format (0.0.4) is what `promtool check metrics`
//! lints; `prometheus-client` writes OpenMetrics, whose counters (`# TYPE x counter` then
//! `x_total`) the classic text parser of promtool reads as untyped families without help.
//!
//! # Limitations
//! - Syslog over plain TCP only (no TLS, no RELP); delivery is at least once up to the
//!   collector's kernel (see [`forward`]).
//! - Metrics are computed from the whole journal at start: a journal of many years takes a
//!   moment to read (records are ~200 bytes; a busy node writes a few MB a year).
//! - A journal file replaced under a running [`JournalFeed`] (restored from a backup, started
//!   anew) is followed from its first record, and its records are counted on top of the old
//!   file's (the `prometheus` crate cannot reset a histogram); a restart recounts.
//! - Metrics of a forwarder and of event types this build does not know: unknown events count
//!   as `type="unknown"` and are forwarded with their seq and time only.

mod error;
pub mod follow;
pub mod forward;
mod metrics;
mod offset;
mod server;
mod service;
mod sys;
pub mod syslog;

pub use cryo_journal::{event_type, mark_seqs, record_mark};
pub use error::{ConnectError, FollowError, ForwardError, MetricsError, OffsetError, ServeError};
pub use follow::{ndjson_line, Follow, Wake};
pub use forward::{ForwardConfig, ForwardShared, ForwardStatus, Forwarder};
pub use metrics::{LiveGauges, Metrics, CONTENT_TYPE, DURATION_BUCKETS, PREFIX};
pub use offset::{Offset, OffsetFile};
pub use server::{JournalFeed, MetricsServer, DEFAULT_LISTEN};
pub use service::{StartError, Telemetry, TelemetryConfig};
pub use syslog::{severity, Severity, SyslogFormat};
