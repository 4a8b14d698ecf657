//! Connections ureq's own TCP connector cannot make: to a unix socket (whatever the URL's host
//! says), and over TCP from inside another process's network namespace (a worker in a container
//! or a standby serves on a loopback that only exists there). Both use one transport (ureq's TCP
//! transport, on either kind of stream).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpStream};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ureq::config::Config;
use ureq::unversioned::resolver::{DefaultResolver, ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport,
};
use ureq::Error;

/// A network namespace to connect from: a process's pidfd (its namespace while it lives) or an
/// open `/proc/PID/ns/net`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct NetNs(Arc<OwnedFd>);

impl NetNs {
    /// The namespace `fd` names (a pidfd or an nsfs file; `setns(2)` checks which when used).
    pub fn new(fd: OwnedFd) -> Self {
        NetNs(Arc::new(fd))
    }

    fn fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// An agent whose every connection goes to the socket at `path`.
pub fn unix_agent(config: Config, path: PathBuf, connect_timeout: Duration) -> ureq::Agent {
    ureq::Agent::with_parts(
        config,
        Dialer {
            dial: Dial::Unix(path),
            connect_timeout,
        },
        NoLookup,
    )
}

/// An agent whose TCP connections are made inside `netns` (the URL's host is resolved here: a
/// numeric address, or a name this host resolves the same way).
pub fn netns_agent(config: Config, netns: NetNs, connect_timeout: Duration) -> ureq::Agent {
    ureq::Agent::with_parts(
        config,
        Dialer {
            dial: Dial::TcpIn(netns),
            connect_timeout,
        },
        DefaultResolver::default(),
    )
}

#[derive(Debug)]
enum Dial {
    Unix(PathBuf),
    TcpIn(NetNs),
}

/// Dials the socket, or the address in the namespace.
#[derive(Debug)]
struct Dialer {
    dial: Dial,
    connect_timeout: Duration,
}

impl Connector for Dialer {
    type Out = StreamTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<()>,
    ) -> Result<Option<Self::Out>, Error> {
        let stream = match &self.dial {
            Dial::Unix(path) => {
                // connect(2) on a unix socket does not block on the peer beyond the accept
                // backlog; the timeout bounds the exchange that follows.
                let s = UnixStream::connect(path)?;
                s.set_write_timeout(Some(self.connect_timeout))?;
                Stream::Unix(s)
            }
            Dial::TcpIn(ns) => {
                let addrs: Vec<SocketAddr> = details.addrs.iter().copied().collect();
                let timeout = self.connect_timeout;
                // The socket belongs to the namespace it is made in, whoever uses it later.
                let s = cryo_proc::in_net_namespace(ns.fd(), move || connect_any(&addrs, timeout))?;
                s.set_nodelay(true)?;
                Stream::Tcp(s)
            }
        };
        let stream = Arc::new(stream);
        (details.register_shutdown)(Arc::downgrade(&stream) as _)?;
        let config = details.config;
        Ok(Some(StreamTransport {
            stream,
            buffers: LazyBuffers::new(config.input_buffer_size(), config.output_buffer_size()),
        }))
    }
}

fn connect_any(addrs: &[SocketAddr], timeout: Duration) -> io::Result<TcpStream> {
    let mut last = None;
    for a in addrs {
        match TcpStream::connect_timeout(a, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address to connect to")))
}

/// One connection.
#[derive(Debug)]
struct StreamTransport {
    stream: Arc<Stream>,
    buffers: LazyBuffers,
}

fn timed_out(e: io::Error, timeout: NextTimeout) -> Error {
    if matches!(
        e.kind(),
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock
    ) {
        Error::Timeout(timeout.reason)
    } else {
        Error::Io(e)
    }
}

impl Transport for StreamTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        let timeout = timeout.for_write();
        self.stream
            .set_write_timeout(timeout.not_zero().map(|t| *t))?;
        let output = &self.buffers.output()[..amount];
        (&*self.stream)
            .write_all(output)
            .map_err(|e| timed_out(e, timeout))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let timeout = timeout.for_read();
        self.stream
            .set_read_timeout(timeout.not_zero().map(|t| *t))?;
        let input = self.buffers.input_append_buf();
        let amount = loop {
            match (&*self.stream).read(input) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                r => break r.map_err(|e| timed_out(e, timeout))?,
            }
        };
        self.buffers.input_appended(amount);
        Ok(amount > 0)
    }

    fn is_open(&mut self) -> bool {
        // Open when a read would block: no EOF, and no bytes we did not ask for.
        let mut probe = [0u8; 1];
        let open = self.stream.set_nonblocking(true).is_ok()
            && matches!((&*self.stream).read(&mut probe),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        open && self.stream.set_nonblocking(false).is_ok()
    }
}

/// The stream, shared with the agent's shutdown handle (which interrupts blocked I/O).
#[derive(Debug)]
enum Stream {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Stream {
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_nonblocking(on),
            Stream::Tcp(s) => s.set_nonblocking(on),
        }
    }
}

impl Read for &Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).read(buf),
            Stream::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => (&*s).write(buf),
            Stream::Tcp(s) => (&*s).write(buf),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => (&*s).flush(),
            Stream::Tcp(s) => (&*s).flush(),
        }
    }
}

impl ureq::unversioned::transport::ShutdownHandle for Stream {
    fn shutdown(&self) {
        let _ = match self {
            Stream::Unix(s) => s.shutdown(std::net::Shutdown::Both),
            Stream::Tcp(s) => s.shutdown(std::net::Shutdown::Both),
        };
    }
}

/// The URL's host names nothing to look up: the connector dials the socket.
#[derive(Debug)]
struct NoLookup;

impl Resolver for NoLookup {
    fn resolve(
        &self,
        _uri: &ureq::http::Uri,
        _config: &Config,
        _timeout: NextTimeout,
    ) -> Result<ResolvedSocketAddrs, Error> {
        let mut addrs = self.empty();
        addrs.push(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 80)));
        Ok(addrs)
    }
}
