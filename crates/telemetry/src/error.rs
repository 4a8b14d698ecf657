//! One error enum per operation.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

/// Following the journal failed.
#[derive(Debug, thiserror::Error)]
pub enum FollowError {
    /// The journal could not be read.
    #[error(transparent)]
    Read(cryo_journal::ReadError),
    /// Waiting for the journal to change failed.
    #[error("cannot wait for the journal to change: {0}")]
    Poll(io::Error),
}

/// The metrics registry could not be built (a name clash: a bug, not a runtime condition).
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// A metric was refused by the registry.
    #[error("cannot register metric {name}: {source}")]
    Register {
        /// The metric's name.
        name: String,
        /// The registry's answer.
        source: prometheus::Error,
    },
}

/// The metrics listener could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The address could not be bound.
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        /// The address asked for.
        addr: String,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The listener's thread could not be started.
    #[error("cannot start the metrics listener thread: {0}")]
    Thread(io::Error),
    /// The journal could not be read before serving.
    #[error(transparent)]
    Follow(#[from] FollowError),
}

/// The syslog forwarder could not be started.
#[derive(Debug, thiserror::Error)]
pub enum ForwardError {
    /// The collector address does not parse as `HOST:PORT`.
    #[error("collector address {0:?} is not HOST:PORT")]
    BadAddress(String),
    /// Its stop pipe or thread could not be made.
    #[error("cannot start the forwarder: {0}")]
    Start(io::Error),
}

/// Connecting to the collector failed (the forwarder retries; this is what it reports).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    /// The name did not resolve.
    #[error("cannot resolve {addr}: {source}")]
    Resolve {
        /// The collector as configured.
        addr: String,
        /// Why.
        source: io::Error,
    },
    /// No address of the collector accepted a connection.
    #[error("cannot connect to {addr}: {source}")]
    Connect {
        /// The last address tried.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
}

/// The forwarder's offset file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum OffsetError {
    /// Reading it failed (other than its absence).
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// It does not hold an offset.
    #[error("{path} does not hold a forwarder offset: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// Writing it (temporary file, fsync, rename, directory fsync) failed.
    #[error("cannot write {path}: {source}")]
    Write {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
}
