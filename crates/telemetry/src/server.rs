//! Serving the metrics: a journal feed thread and a `/metrics` listener.

use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use crate::error::ServeError;
use crate::follow::{Follow, Wake};
use crate::metrics::{Metrics, CONTENT_TYPE};

/// Where metrics are served when nothing else is configured: loopback only, since the names of
/// processes and GPUs and the rhythm of a node's work are not for every network peer; expose
/// them further (a pod IP, a node port) by choice.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:9477";

/// A thread that feeds every journal record since the journal's last rotation into
/// [`Metrics::observe`], then each new one as it is written. Dropping it stops the thread.
#[derive(Debug)]
pub struct JournalFeed {
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
}

impl JournalFeed {
    /// Reads the journal's active segment into `metrics` before returning (so the first scrape
    /// shows the node's totals since the last rotation: the agent's start reads no archive, and
    /// counts no record a rotation carried), then follows it in a thread.
    pub fn start(dir: &Path, metrics: Arc<Metrics>) -> Result<JournalFeed, ServeError> {
        let mut follow = Follow::own(dir);
        for r in follow.poll_new()? {
            metrics.observe(&r);
        }
        let (stop_rx, stop_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| ServeError::Thread(e.into()))?;
        let thread = std::thread::Builder::new()
            .name("cryo-metrics-feed".into())
            .spawn(move || loop {
                match follow.wait(&[stop_rx.as_fd()], Duration::from_secs(5)) {
                    Ok(Wake::Other(_)) => return,
                    Ok(_) => {}
                    Err(err) => {
                        tracing::error!(%err, "cannot wait for the journal");
                        std::thread::sleep(Duration::from_secs(1));
                    }
                }
                match follow.poll_new() {
                    Ok(records) => records.iter().for_each(|r| metrics.observe(r)),
                    Err(err) => tracing::error!(%err, "cannot read the journal for metrics"),
                }
            })
            .map_err(ServeError::Thread)?;
        Ok(JournalFeed {
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }
}

impl Drop for JournalFeed {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `GET /metrics` on a TCP listener, answered from a [`Metrics`]. Dropping it stops it.
pub struct MetricsServer {
    server: Arc<tiny_http::Server>,
    addr: std::net::SocketAddr,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Listens on `addr` (`HOST:PORT`; port 0 picks one, see [`MetricsServer::local_addr`]).
    pub fn start(addr: &str, metrics: Arc<Metrics>) -> Result<MetricsServer, ServeError> {
        let server = tiny_http::Server::http(addr).map_err(|source| ServeError::Bind {
            addr: addr.to_owned(),
            source,
        })?;
        let local = match server.server_addr() {
            tiny_http::ListenAddr::IP(a) => a,
            // Only TCP listeners are made here.
            tiny_http::ListenAddr::Unix(_) => {
                return Err(ServeError::Bind {
                    addr: addr.to_owned(),
                    source: "not a TCP address".into(),
                })
            }
        };
        let server = Arc::new(server);
        let thread = std::thread::Builder::new()
            .name("cryo-metrics-http".into())
            .spawn({
                let server = Arc::clone(&server);
                move || {
                    for request in server.incoming_requests() {
                        respond(request, &metrics);
                    }
                }
            })
            .map_err(ServeError::Thread)?;
        Ok(MetricsServer {
            server,
            addr: local,
            thread: Some(thread),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl std::fmt::Debug for MetricsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.server.unblock();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn respond(request: tiny_http::Request, metrics: &Metrics) {
    use tiny_http::{Header, Method, Response};
    let path = request.url().split('?').next().unwrap_or("");
    let response = match (request.method(), path) {
        (Method::Get, "/metrics") => {
            let r = Response::from_string(metrics.encode());
            match Header::from_bytes("Content-Type", CONTENT_TYPE) {
                Ok(h) => r.with_header(h),
                Err(()) => r,
            }
        }
        (Method::Get, _) => {
            Response::from_string("not found; metrics are at /metrics\n").with_status_code(404)
        }
        _ => Response::from_string("only GET\n").with_status_code(405),
    };
    if let Err(err) = request.respond(response) {
        tracing::debug!(%err, "metrics client went away");
    }
}
