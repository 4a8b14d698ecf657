//! The few HTTP requests the demo sends to the sim worker on loopback, through cryo's one HTTP
//! client (`cryo_http`).

use std::time::Duration;

use anyhow::{bail, Context as _};

/// Sends one request to `127.0.0.1:port`; returns the body of a 2xx answer.
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let url = cryo_http::Endpoint::loopback(port).url(path);
    let body = (!body.is_empty()).then_some(("application/json", body.as_bytes()));
    let (status, answer) =
        cryo_http::fetch(method, &url, body, timeout).with_context(|| format!("{method} {url}"))?;
    if !(200..300).contains(&status) {
        bail!("{method} {path} answered {status}: {}", answer.trim());
    }
    Ok(answer)
}
