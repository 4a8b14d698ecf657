//! The restore thread: like the CUDA driver's thread inside every CUDA process, it carries out
//! checkpoint-API calls the daemon relays to it, one connection per call.
//!
//! Its socket's name carries its thread id ([`crate::proto::restore_socket_name`]), so the daemon
//! knows the thread without asking it. A call is carried out whenever the thread gets to it: one
//! whose caller gave up meanwhile (the process was stopped) still takes effect, as a queued
//! request to the real driver's thread would.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::{mpsc, Arc};
use std::time::{SystemTime, UNIX_EPOCH};

use crate::proto::{self, Reply, WorkerOp, WorkerRequest};

use super::state::Worker;
use super::WorkerError;

/// Starts the thread, which binds `@cryo-sim/<daemon-id>/<pid>-<tid>-<nonce>`; returns once it
/// listens.
pub(super) fn start(worker: Arc<Worker>, daemon_id: &str) -> Result<(), WorkerError> {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let pid = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(0);
    let daemon_id = daemon_id.to_string();
    let (tx, rx) = mpsc::sync_channel(1);
    let spawned = std::thread::Builder::new()
        .name("cryo-sim-restore".into())
        .spawn(move || {
            let tid = nix::unistd::gettid().as_raw();
            let name = proto::restore_socket_name(&daemon_id, pid, tid, nonce);
            let listener = match SocketAddr::from_abstract_name(name.as_bytes())
                .and_then(|addr| UnixListener::bind_addr(&addr))
            {
                Ok(l) => l,
                Err(source) => {
                    let _ = tx.send(Err(WorkerError::RestoreSocket {
                        name: format!("@{name}"),
                        source,
                    }));
                    return;
                }
            };
            // Before the first accept, so every call sees it.
            worker.set_restore_tid(tid);
            let _ = tx.send(Ok(()));
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => handle(&worker, s),
                    Err(err) => tracing::warn!(%err, "restore thread: accept failed"),
                }
            }
        });
    spawned.map_err(WorkerError::RestoreThread)?;
    rx.recv().map_err(|_| {
        WorkerError::RestoreThread(std::io::Error::other(
            "the restore thread ended before it listened",
        ))
    })?
}

fn handle(worker: &Worker, mut s: UnixStream) {
    let req: WorkerRequest = match proto::recv(&mut s) {
        Ok(Some(r)) => r,
        Ok(None) => return,
        Err(err) => {
            let _ = proto::send(&mut s, &Reply::Error(format!("bad request: {err}")));
            return;
        }
    };
    let reply = match req.op {
        WorkerOp::Api(call) => {
            let r = worker.api(&call);
            tracing::debug!(?call, ?r, "checkpoint API call");
            match r {
                Ok(done) => Reply::Api(done),
                Err(code) => Reply::Cuda(code),
            }
        }
        WorkerOp::Inject(fault) => {
            worker.inject(fault);
            Reply::Injected
        }
    };
    if let Err(err) = proto::send(&mut s, &reply) {
        // The caller gave up (we were stopped): the call took effect all the same.
        tracing::warn!(%err, ?reply, "caller went away before the answer");
    }
}
