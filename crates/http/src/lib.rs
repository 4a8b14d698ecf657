//! cryo's one HTTP client: the agent's API client, thaw's health checks, the demo and the tests
//! all send their requests through [`Client`].
//!
//! # Design
//! [`ureq`] (blocking, HTTP/1.1, no TLS built in) with two endpoints: loopback or node TCP
//! (`http://host:port/path`) and a unix socket (`unix:SOCKET:/path`), the latter through a
//! small connector of our own ([`conn`]), which also connects over TCP from inside another
//! process's network namespace ([`Client::from_namespace`]: a worker in a container serves on a
//! loopback of its own): ureq's pluggable transport is meant for exactly that,
//! and a second, hand-written HTTP/1.1 parser (chunked bodies, keep-alive, timeouts) is what this
//! crate exists to avoid. hyper would do both too, but needs a runtime in every blocking caller
//! (the `cuda-checkpoint` front end CRIU execs, the health check of a thaw), and ureq is the
//! workspace's choice for blocking HTTP.
//!
//! Status codes are answers, not errors: a [`Response`] carries any status, and only a failure
//! to exchange (connect, send, read, a malformed answer) is an [`HttpError`]. A connect failure
//! says whether nothing listens there ([`HttpError::nobody_listens`]), which is how the CLI tells
//! "no agent runs" from "the agent runs and failed".
//!
//! # Limitations
//! - Plain `http://` only: no TLS, no redirects followed, no proxies.
//! - ureq's transport API is outside its semver promise: the workspace pins ureq's minor
//!   version, and [`conn`] is the one place to adapt when it moves.

mod conn;

pub use conn::NetNs;

use std::io::{self, BufRead, BufReader, Read};
use std::path::PathBuf;
use std::time::Duration;

/// The largest body [`Response::text`] reads: answers of cryo's API and of health checks are
/// small; a larger one is a misbehaving peer.
pub const MAX_TEXT_BODY: u64 = 64 << 20;

/// Where an HTTP server listens.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// `HOST:PORT` over TCP (`127.0.0.1:8080`, `localhost:80`).
    Tcp(String),
    /// A unix socket.
    Unix(PathBuf),
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Tcp(hostport) => write!(f, "http://{hostport}"),
            Endpoint::Unix(path) => write!(f, "unix:{}", path.display()),
        }
    }
}

impl Endpoint {
    /// Loopback TCP on `port`.
    pub fn loopback(port: u16) -> Self {
        Endpoint::Tcp(format!("127.0.0.1:{port}"))
    }

    /// Splits a URL into where to connect and the path to ask for: `http://host[:port][/path]`
    /// (port 80 when absent) or `unix:SOCKET:/path`. Pure: nothing is resolved or opened.
    pub fn parse_url(url: &str) -> Result<(Endpoint, String), UrlError> {
        let bad = || UrlError(url.to_string());
        if let Some(rest) = url.strip_prefix("unix:") {
            let (sock, path) = rest.rsplit_once(":/").ok_or_else(bad)?;
            if sock.is_empty() {
                return Err(bad());
            }
            return Ok((Endpoint::Unix(sock.into()), format!("/{path}")));
        }
        let rest = url.strip_prefix("http://").ok_or_else(bad)?;
        let (hostport, path) = match rest.find('/') {
            Some(i) => (&rest[..i], &rest[i..]),
            None => (rest, "/"),
        };
        if hostport.is_empty() || hostport.contains('@') {
            return Err(bad());
        }
        let hostport = if hostport
            .rsplit_once(':')
            .is_some_and(|(_, p)| !p.contains(']'))
        {
            hostport.to_string()
        } else {
            format!("{hostport}:80")
        };
        Ok((Endpoint::Tcp(hostport), path.to_string()))
    }

    /// The URL of `path` here, as [`Endpoint::parse_url`] reads it back.
    pub fn url(&self, path: &str) -> String {
        match self {
            Endpoint::Tcp(hostport) => format!("http://{hostport}{path}"),
            Endpoint::Unix(sock) => format!("unix:{}:{path}", sock.display()),
        }
    }
}

/// A URL that is neither `http://host[:port][/path]` nor `unix:SOCKET:/PATH`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not http://host[:port][/path] nor unix:SOCKET:/PATH")]
pub struct UrlError(pub String);

/// How long a [`Client`] waits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Timeouts {
    /// To connect.
    pub connect: Duration,
    /// For the whole exchange, body included; `None`: no limit (long operations whose answer
    /// streams progress, followed event streams).
    pub total: Option<Duration>,
}

impl Timeouts {
    /// `total` for the whole exchange, and at most that (or 5 s) to connect.
    pub fn total(total: Duration) -> Self {
        Timeouts {
            connect: total.min(Duration::from_secs(5)),
            total: Some(total),
        }
    }

    /// 5 s to connect, then as long as the answer takes.
    pub fn unlimited() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            total: None,
        }
    }
}

/// A request could not be exchanged.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Nothing could be connected to.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// Where.
        endpoint: Endpoint,
        /// Why (`NotFound`/`ConnectionRefused`: nothing listens; `PermissionDenied`...).
        source: io::Error,
    },
    /// The exchange failed after connecting (or the answer is not HTTP).
    #[error("{method} {url}: {source}")]
    Exchange {
        /// The method.
        method: String,
        /// The URL.
        url: String,
        /// What went wrong.
        source: Box<ureq::Error>,
    },
    /// The answer's body could not be read.
    #[error("reading the answer from {url}: {source}")]
    Body {
        /// The URL.
        url: String,
        /// What went wrong.
        source: io::Error,
    },
    /// The URL is malformed.
    #[error(transparent)]
    Url(#[from] UrlError),
}

impl HttpError {
    /// Whether the connection failed because nothing listens there (no socket file, or nobody
    /// accepting on it): a server that is not running, as opposed to one that failed.
    pub fn nobody_listens(&self) -> bool {
        matches!(self, HttpError::Connect { source, .. }
            if matches!(source.kind(), io::ErrorKind::NotFound | io::ErrorKind::ConnectionRefused))
    }
}

/// An HTTP client of one endpoint. Cheap to clone; keeps idle connections for reuse.
#[derive(Debug, Clone)]
pub struct Client {
    endpoint: Endpoint,
    agent: ureq::Agent,
}

impl Client {
    /// A client of `endpoint`; nothing is connected until a request.
    pub fn new(endpoint: Endpoint, timeouts: Timeouts) -> Self {
        Self::from_namespace(endpoint, timeouts, None)
    }

    /// A client of `endpoint` as seen from the network namespace `netns` (`None`: cryo's own):
    /// its TCP connections are made there. A unix socket is named by its path, which the network
    /// namespace does not change.
    pub fn from_namespace(endpoint: Endpoint, timeouts: Timeouts, netns: Option<NetNs>) -> Self {
        let config = ureq::Agent::config_builder()
            // Statuses are answers: the caller reads them.
            .http_status_as_error(false)
            .timeout_connect(Some(timeouts.connect))
            .timeout_global(timeouts.total)
            .user_agent(concat!("cryo/", env!("CARGO_PKG_VERSION")))
            .build();
        let agent = match (&endpoint, netns) {
            (Endpoint::Tcp(_), None) => ureq::Agent::new_with_config(config),
            (Endpoint::Tcp(_), Some(ns)) => conn::netns_agent(config, ns, timeouts.connect),
            (Endpoint::Unix(path), _) => conn::unix_agent(config, path.clone(), timeouts.connect),
        };
        Client { endpoint, agent }
    }

    /// Where it connects.
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// `GET path`.
    pub fn get(&self, path: &str) -> Result<Response, HttpError> {
        self.send("GET", path, None)
    }

    /// `POST path` with a JSON body.
    pub fn post_json(&self, path: &str, json: &[u8]) -> Result<Response, HttpError> {
        self.send("POST", path, Some(("application/json", json)))
    }

    /// `METHOD path`, with a body of the given content type when there is one.
    pub fn send(
        &self,
        method: &str,
        path: &str,
        body: Option<(&str, &[u8])>,
    ) -> Result<Response, HttpError> {
        let url = self.url(path);
        let exchange = |source: ureq::Error| HttpError::Exchange {
            method: method.to_string(),
            url: self.endpoint.url(path),
            source: Box::new(source),
        };
        let request = ureq::http::Request::builder()
            .method(method)
            .uri(&url)
            .header(
                "Accept",
                "application/json, application/x-ndjson, text/plain",
            );
        let result = match body {
            Some((content_type, bytes)) => {
                let request = request
                    .header("Content-Type", content_type)
                    .body(bytes)
                    .map_err(|e| exchange(e.into()))?;
                self.agent.run(request)
            }
            None => {
                let request = request.body(()).map_err(|e| exchange(e.into()))?;
                self.agent.run(request)
            }
        };
        let response = result.map_err(|e| match e {
            ureq::Error::Io(source) if is_connect_error(&source) => HttpError::Connect {
                endpoint: self.endpoint.clone(),
                source,
            },
            ureq::Error::ConnectionFailed => HttpError::Connect {
                endpoint: self.endpoint.clone(),
                source: io::ErrorKind::ConnectionRefused.into(),
            },
            e => exchange(e),
        })?;
        let status = response.status().as_u16();
        let content_type = response
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        Ok(Response {
            status,
            content_type,
            url: self.endpoint.url(path),
            body: response.into_body(),
        })
    }

    fn url(&self, path: &str) -> String {
        match &self.endpoint {
            Endpoint::Tcp(hostport) => format!("http://{hostport}{path}"),
            // The host is never looked up (the connector dials the socket); it is what the
            // server sees in `Host`.
            Endpoint::Unix(_) => format!("http://localhost{path}"),
        }
    }
}

/// A connect error as the connectors report it (the server-side errors come later, as protocol
/// errors or resets on an established connection).
fn is_connect_error(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::NotFound
            | io::ErrorKind::ConnectionRefused
            | io::ErrorKind::PermissionDenied
            | io::ErrorKind::AddrNotAvailable
            | io::ErrorKind::HostUnreachable
            | io::ErrorKind::NetworkUnreachable
    )
}

/// An answer: its status, and its body to read (whole, or as a stream of lines).
#[derive(Debug)]
pub struct Response {
    /// The status code.
    pub status: u16,
    /// The `Content-Type`, if any.
    pub content_type: Option<String>,
    url: String,
    body: ureq::Body,
}

impl Response {
    /// Whether the status is 2xx.
    pub fn is_success(&self) -> bool {
        (200..300).contains(&self.status)
    }

    /// The whole body as text (at most [`MAX_TEXT_BODY`]; invalid UTF-8 replaced).
    pub fn text(mut self) -> Result<String, HttpError> {
        let mut raw = Vec::new();
        self.body
            .as_reader()
            .take(MAX_TEXT_BODY)
            .read_to_end(&mut raw)
            .map_err(|source| HttpError::Body {
                url: self.url.clone(),
                source,
            })?;
        Ok(String::from_utf8_lossy(&raw).into_owned())
    }

    /// The body as a stream, read as it arrives (NDJSON progress, followed event streams).
    pub fn lines(self) -> Lines {
        Lines {
            url: self.url,
            reader: BufReader::new(Box::new(self.body.into_reader())),
        }
    }
}

/// The lines of a streamed body.
pub struct Lines {
    url: String,
    reader: BufReader<Box<dyn Read + Send>>,
}

impl std::fmt::Debug for Lines {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lines").field("url", &self.url).finish()
    }
}

impl Iterator for Lines {
    type Item = Result<String, HttpError>;

    fn next(&mut self) -> Option<Self::Item> {
        let mut line = String::new();
        match self.reader.read_line(&mut line) {
            Ok(0) => None,
            Ok(_) => Some(Ok(line.trim_end_matches(['\r', '\n']).to_string())),
            Err(source) => Some(Err(HttpError::Body {
                url: self.url.clone(),
                source,
            })),
        }
    }
}

/// One request to a URL (`http://...` or `unix:SOCKET:/path`), answered in full within
/// `timeout`: the health checks' and scripts' call.
pub fn fetch(
    method: &str,
    url: &str,
    body: Option<(&str, &[u8])>,
    timeout: Duration,
) -> Result<(u16, String), HttpError> {
    let (endpoint, path) = Endpoint::parse_url(url)?;
    let response = Client::new(endpoint, Timeouts::total(timeout)).send(method, &path, body)?;
    let status = response.status;
    Ok((status, response.text()?))
}

#[cfg(test)]
mod tests;
