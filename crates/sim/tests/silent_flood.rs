#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The simulated driver's daemon under a flood of connections that never say what they are.

mod common;

use std::io::{ErrorKind, Read};
use std::os::unix::net::UnixStream;

use cryo_sim::proto::{self, Reply, Request};
use cryo_testkit::{eventually, PATIENCE};

/// The daemon's threads now.
fn threads(pid: cryo_proc::Pid) -> u64 {
    cryo_proc::status(pid).unwrap().threads
}

/// Attack (session 17): 200 connections that never send a first message. Each took a thread
/// of the daemon until its client closed it, so a flood of them grew the daemon without bound.
/// The daemon must keep its threads for connections not yet identified within a bound, refuse
/// (with an error reply) what comes past it, close a silent connection after the first-message
/// timeout, and answer queries again once they are gone. (Before: this test failed with the
/// daemon at 200+ threads, every silent connection still open.)
#[test]
fn a_flood_of_silent_connections_is_bounded_and_closed() {
    let sim = common::sim();
    let daemon = sim.daemon_pid();
    let socket = cryo_sim::socket_path(sim.path());
    let asked = |req: &Request| {
        let mut s = UnixStream::connect(&socket).unwrap();
        proto::send(&mut s, req).unwrap();
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        proto::recv::<Reply>(&mut s).unwrap()
    };
    assert!(matches!(
        asked(&Request::Processes),
        Some(Reply::Processes(_))
    ));
    let before = threads(daemon);
    let flooded = std::time::Instant::now();
    let mut silent: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&socket).unwrap())
        .collect();
    // A connection past the bound is told so at once (unless the silent ones already timed out:
    // a host too loaded to get here within the first-message timeout).
    let refused = asked(&Request::Processes);
    assert!(
        matches!(&refused, Some(Reply::Error(e)) if e.contains("connections"))
            || flooded.elapsed() >= cryo_sim::daemon::FIRST_MESSAGE_TIMEOUT,
        "{refused:?}"
    );
    let bound = before + cryo_sim::daemon::MAX_UNIDENTIFIED as u64 + 2;
    assert!(
        threads(daemon) <= bound,
        "{} threads for 200 silent connections (bound {bound})",
        threads(daemon)
    );
    // Every silent connection is closed by the daemon (end of file, or the error reply of one
    // refused), within the first-message timeout.
    for s in &mut silent {
        s.set_read_timeout(Some(PATIENCE)).unwrap();
        let mut buf = Vec::new();
        match s.read_to_end(&mut buf) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::ConnectionReset => {}
            Err(e) => panic!("a silent connection was not closed: {e}"),
        }
    }
    drop(silent);
    eventually(PATIENCE, "queries to be answered again", || {
        matches!(asked(&Request::Processes), Some(Reply::Processes(_)))
    });
}
