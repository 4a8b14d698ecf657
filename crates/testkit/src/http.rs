//! One HTTP request to a worker, on loopback TCP or on a unix socket, through cryo's one HTTP
//! client (`cryo_http`; a worker frozen by CRIU serves on a unix socket, `--http-unix`).

use std::time::Duration;

pub use cryo_http::Endpoint;

/// A worker's port on loopback, or its endpoint.
#[derive(Debug, Clone)]
pub struct To(pub Endpoint);

impl From<u16> for To {
    fn from(port: u16) -> Self {
        To(Endpoint::loopback(port))
    }
}

impl From<Endpoint> for To {
    fn from(e: Endpoint) -> Self {
        To(e)
    }
}

impl From<&Endpoint> for To {
    fn from(e: &Endpoint) -> Self {
        To(e.clone())
    }
}

/// Sends one request and returns `(status, body)`. Panics when the worker cannot be reached
/// within a minute or answers something that is not HTTP: in a test, that is the failure.
pub fn http(to: impl Into<To>, method: &str, path: &str, body: &str) -> (u16, String) {
    let url = to.into().0.url(path);
    let body = (!body.is_empty()).then_some(("application/json", body.as_bytes()));
    cryo_http::fetch(method, &url, body, Duration::from_secs(60))
        .unwrap_or_else(|e| panic!("{method} {url}: {e}"))
}
