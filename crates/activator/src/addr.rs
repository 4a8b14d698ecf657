//! Service addresses: `HOST:PORT` (TCP) or `unix:/PATH` (a unix socket).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::str::FromStr;

use tokio::net::{TcpListener, TcpStream, UnixListener, UnixStream};

use crate::Io;

/// Where to listen or connect.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Addr {
    /// A TCP address.
    Tcp(SocketAddr),
    /// A unix socket path.
    Unix(PathBuf),
}

/// Not an address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is neither HOST:PORT (an IP address and a port) nor unix:/PATH")]
pub struct AddrError(pub String);

impl FromStr for Addr {
    type Err = AddrError;
    fn from_str(s: &str) -> Result<Self, AddrError> {
        if let Some(path) = s.strip_prefix("unix:") {
            if path.starts_with('/') {
                return Ok(Addr::Unix(PathBuf::from(path)));
            }
            return Err(AddrError(s.to_string()));
        }
        s.parse()
            .map(Addr::Tcp)
            .map_err(|_| AddrError(s.to_string()))
    }
}

impl std::fmt::Display for Addr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Addr::Tcp(a) => write!(f, "{a}"),
            Addr::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

impl Addr {
    /// Connects to it.
    pub async fn connect(&self) -> std::io::Result<Box<dyn Io>> {
        Ok(match self {
            Addr::Tcp(a) => Box::new(TcpStream::connect(a).await?),
            Addr::Unix(p) => Box::new(UnixStream::connect(p).await?),
        })
    }

    /// Listens on it (a unix socket path must not exist).
    pub async fn listen(&self) -> std::io::Result<Listener> {
        Ok(match self {
            Addr::Tcp(a) => Listener::Tcp(TcpListener::bind(a).await?),
            Addr::Unix(p) => Listener::Unix(UnixListener::bind(p)?),
        })
    }

    /// Listens on it again after the listener's owner died: a unix socket left behind is
    /// replaced when nothing listens on it any more (a connection is refused) and it is a
    /// socket; anything else there is an error (TCP binds with `SO_REUSEADDR`, as tokio does).
    pub async fn listen_again(&self) -> std::io::Result<Listener> {
        if let Addr::Unix(p) = self {
            use std::os::unix::fs::FileTypeExt;
            let stale = std::fs::symlink_metadata(p).is_ok_and(|m| m.file_type().is_socket())
                && std::os::unix::net::UnixStream::connect(p)
                    .is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionRefused);
            if stale {
                std::fs::remove_file(p)?;
            }
        }
        self.listen().await
    }
}

/// A bound listener.
#[derive(Debug)]
pub enum Listener {
    /// TCP.
    Tcp(TcpListener),
    /// A unix socket.
    Unix(UnixListener),
}

impl Listener {
    /// The address it listens on (a TCP port 0 resolved).
    pub fn local_addr(&self) -> std::io::Result<Addr> {
        match self {
            Listener::Tcp(l) => l.local_addr().map(Addr::Tcp),
            Listener::Unix(l) => l
                .local_addr()?
                .as_pathname()
                .map(|p| Addr::Unix(p.to_path_buf()))
                .ok_or_else(|| std::io::Error::other("unnamed unix socket")),
        }
    }

    /// The next connection.
    pub async fn accept(&self) -> std::io::Result<Box<dyn Io>> {
        Ok(match self {
            Listener::Tcp(l) => Box::new(l.accept().await?.0),
            Listener::Unix(l) => Box::new(l.accept().await?.0),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn parses_tcp_and_unix() {
        assert_eq!(
            "127.0.0.1:80".parse::<Addr>().unwrap(),
            Addr::Tcp("127.0.0.1:80".parse().unwrap())
        );
        assert_eq!(
            "unix:/run/w.sock".parse::<Addr>().unwrap(),
            Addr::Unix("/run/w.sock".into())
        );
        for bad in ["unix:rel", "localhost", "1.2.3.4", ""] {
            assert!(bad.parse::<Addr>().is_err(), "{bad}");
        }
    }
}
