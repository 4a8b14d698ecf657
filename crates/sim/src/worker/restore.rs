//! The restore thread: like the CUDA driver's thread inside every CUDA process, it carries out
//! checkpoint-API calls the daemon relays to it, one connection per call.

use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::proto::{self, ApiCall, Reply, WorkerOp, WorkerRequest};

use super::state::Worker;
use super::WorkerError;

/// Binds `@cryo-sim/<daemon-id>/<pid>-<nonce>` and starts the thread.
pub(super) fn start(worker: Arc<Worker>, daemon_id: &str) -> Result<(), WorkerError> {
    let nonce = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let name = format!("cryo-sim/{daemon_id}/{}-{nonce:08x}", std::process::id());
    let err = |source| WorkerError::RestoreSocket {
        name: format!("@{name}"),
        source,
    };
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(err)?;
    let listener = UnixListener::bind_addr(&addr).map_err(err)?;
    std::thread::Builder::new()
        .name("cryo-sim-restore".into())
        .spawn(move || {
            // Before the first accept, so every call sees it.
            worker.set_restore_tid(nix::unistd::gettid().as_raw());
            for conn in listener.incoming() {
                match conn {
                    Ok(s) => handle(&worker, s),
                    Err(err) => tracing::warn!(%err, "restore thread: accept failed"),
                }
            }
        })
        .map_err(err)?;
    Ok(())
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
    if proto::unix_ms() > req.expires_unix_ms {
        tracing::warn!(op = ?req.op, "dropping a checkpoint-API call whose caller gave up (were we stopped?)");
        return;
    }
    let mut locked_now = false;
    let reply = match req.op {
        WorkerOp::Api(call) => {
            let r = worker.api(&call);
            tracing::debug!(?call, ?r, "checkpoint API call");
            locked_now = matches!(call, ApiCall::Lock { .. }) && r.is_ok();
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
        tracing::warn!(%err, "caller went away before the answer");
        if locked_now {
            // It gave up waiting: a lock nobody knows about would block the process forever.
            let _ = worker.api(&ApiCall::Unlock);
        }
    }
}
