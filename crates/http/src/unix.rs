//! HTTP over a unix socket: a ureq connector that dials one socket path whatever the URL's host,
//! and its transport (ureq's TCP transport, on a `UnixStream`).

use std::io::{self, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use ureq::config::Config;
use ureq::unversioned::resolver::{ResolvedSocketAddrs, Resolver};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, LazyBuffers, NextTimeout, Transport,
};
use ureq::Error;

/// An agent whose every connection goes to the socket at `path`.
pub fn agent(config: Config, path: PathBuf, connect_timeout: Duration) -> ureq::Agent {
    ureq::Agent::with_parts(
        config,
        UnixConnector {
            path,
            connect_timeout,
        },
        NoLookup,
    )
}

/// Dials the socket.
#[derive(Debug)]
struct UnixConnector {
    path: PathBuf,
    connect_timeout: Duration,
}

impl Connector for UnixConnector {
    type Out = UnixTransport;

    fn connect(
        &self,
        details: &ConnectionDetails,
        _chained: Option<()>,
    ) -> Result<Option<Self::Out>, Error> {
        // connect(2) on a unix socket does not block on the peer beyond the accept backlog; the
        // timeout bounds the exchange that follows.
        let stream = UnixStream::connect(&self.path)?;
        stream.set_write_timeout(Some(self.connect_timeout))?;
        let stream = Arc::new(Shared(stream));
        (details.register_shutdown)(Arc::downgrade(&stream) as _)?;
        let config = details.config;
        Ok(Some(UnixTransport {
            stream,
            buffers: LazyBuffers::new(config.input_buffer_size(), config.output_buffer_size()),
        }))
    }
}

/// One connection.
#[derive(Debug)]
struct UnixTransport {
    stream: Arc<Shared>,
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

impl Transport for UnixTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        let timeout = timeout.for_write();
        self.stream
            .set_write_timeout(timeout.not_zero().map(|t| *t))?;
        let output = &self.buffers.output()[..amount];
        (&self.stream.0)
            .write_all(output)
            .map_err(|e| timed_out(e, timeout))
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let timeout = timeout.for_read();
        self.stream
            .set_read_timeout(timeout.not_zero().map(|t| *t))?;
        let input = self.buffers.input_append_buf();
        let amount = loop {
            match (&self.stream.0).read(input) {
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
            && matches!((&self.stream.0).read(&mut probe),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock);
        open && self.stream.set_nonblocking(false).is_ok()
    }
}

/// The stream, shared with the agent's shutdown handle (which interrupts blocked I/O).
#[derive(Debug)]
struct Shared(UnixStream);

impl std::ops::Deref for Shared {
    type Target = UnixStream;
    fn deref(&self) -> &UnixStream {
        &self.0
    }
}

impl ureq::unversioned::transport::ShutdownHandle for Shared {
    fn shutdown(&self) {
        let _ = self.0.shutdown(std::net::Shutdown::Both);
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
