//! The few HTTP/1.1 requests the demo sends to the sim worker on loopback (no client crate needed
//! for `Connection: close` requests and answers).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpStream};
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
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port);
    let mut s = TcpStream::connect_timeout(&addr.into(), timeout)
        .with_context(|| format!("connecting to {addr}"))?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes())
        .with_context(|| format!("sending {method} {path}"))?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw)
        .with_context(|| format!("reading the answer to {method} {path}"))?;
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .with_context(|| format!("{method} {path}: malformed answer"))?;
    let status = head.split_whitespace().nth(1).unwrap_or("?");
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        dechunk(body)?
    } else {
        body.to_string()
    };
    if !status.starts_with('2') {
        bail!("{method} {path} answered {status}: {}", body.trim());
    }
    Ok(body)
}

fn dechunk(mut s: &str) -> anyhow::Result<String> {
    let mut out = String::new();
    loop {
        let (size, rest) = s.split_once("\r\n").context("malformed chunk")?;
        let n = usize::from_str_radix(size.split(';').next().unwrap_or("").trim(), 16)
            .context("malformed chunk size")?;
        if n == 0 {
            return Ok(out);
        }
        out.push_str(rest.get(..n).context("truncated chunk")?);
        s = rest.get(n + 2..).context("truncated chunk")?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dechunks() {
        assert_eq!(
            dechunk("5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n").unwrap(),
            "hello world"
        );
        assert!(dechunk("5\r\nhel").is_err());
    }
}
