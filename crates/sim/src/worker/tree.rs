//! A tensor-parallel server's process tree: a launcher and one child process per GPU (a *rank*),
//! as vLLM and SGLang run with `--tensor-parallel-size N`.
//!
//! # Design
//! The launcher forks its ranks before it starts any thread (so each child is an ordinary copy
//! of it), talks to each over a socketpair (one request at a time, [`proto`] framing), and serves
//! HTTP for the whole tree. Each rank is a sim worker with one context on its GPU (seeded with
//! the tree's seed plus its rank) and a restore thread; it serves its launcher until the
//! socketpair ends (the launcher died), then exits, as ranks of a real server do. The launcher
//! holds no context: with `--init-only` it initialised the driver (a driver fd and a restore
//! thread, as a Python launcher that called `torch.cuda.is_available()`), otherwise it is a plain
//! process. It reaps its ranks. Socketpairs and plain files only: CRIU dumps the tree as it is.
//!
//! # Limitations
//! A rank that dies is not replaced; the launcher answers 502 for the requests that need it.

use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

use super::engine::{EngineOp, EngineStatus};
use super::http::{Backend, Verified};
use super::state::{CallError, Worker};
use super::{open_error, WorkerConfig, WorkerError};
use crate::proto;

/// A request from the launcher to a rank.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum RankRequest {
    Complete(Vec<u8>),
    Verify,
    Busy(u64),
    Fault,
    Engine(EngineOp),
    EngineStatus,
}

/// A rank's answer.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum RankReply {
    /// The rank's context is open (first message of every rank).
    Ready {
        pid: u32,
    },
    /// The rank could not start.
    Failed(String),
    Text(String),
    Verified(Verified),
    Done,
    /// A sticky error (`CUresult`).
    Sticky(u32),
    Status(EngineStatus),
    Sleeping,
    Refused(String),
    Error(String),
}

/// One rank as its launcher sees it.
#[derive(Debug)]
struct Rank {
    pid: u32,
    chan: Mutex<UnixStream>,
}

/// The launcher's view of its ranks.
#[derive(Debug)]
pub(crate) struct Tree {
    ranks: Vec<Rank>,
    /// The launcher's own GPU side when it initialised the driver.
    launcher: Option<Arc<Worker>>,
}

impl Tree {
    /// The ranks' pids, in rank order.
    pub(crate) fn pids(&self) -> Vec<u32> {
        self.ranks.iter().map(|r| r.pid).collect()
    }

    fn ask(&self, rank: usize, req: &RankRequest) -> Result<RankReply, CallError> {
        let r = self
            .ranks
            .get(rank)
            .ok_or_else(|| CallError::Rank(format!("no rank {rank}")))?;
        let mut chan = r.chan.lock().unwrap_or_else(|p| p.into_inner());
        let gone = |e: std::io::Error| CallError::Rank(format!("rank {rank} (pid {}): {e}", r.pid));
        proto::send(&mut *chan, req).map_err(gone)?;
        match proto::recv_some(&mut *chan).map_err(gone)? {
            RankReply::Sticky(code) => Err(CallError::Sticky(cryo_gpu::CuResult(code))),
            RankReply::Sleeping => Err(CallError::Sleeping),
            RankReply::Refused(e) => Err(CallError::Engine(format!("rank {rank}: {e}"))),
            RankReply::Error(e) => Err(CallError::Rank(format!("rank {rank}: {e}"))),
            other => Ok(other),
        }
    }

    fn every(&self, req: &RankRequest) -> Result<Vec<RankReply>, CallError> {
        (0..self.ranks.len()).map(|r| self.ask(r, req)).collect()
    }
}

fn unexpected(what: &str, r: &RankReply) -> CallError {
    CallError::Rank(format!("unexpected answer to {what}: {r:?}"))
}

impl Backend for Tree {
    fn complete(&self, prompt: &[u8]) -> Result<String, CallError> {
        let mut text = String::new();
        for r in self.every(&RankRequest::Complete(prompt.to_vec()))? {
            match r {
                RankReply::Text(t) => text.push_str(&t),
                other => return Err(unexpected("complete", &other)),
            }
        }
        Ok(text)
    }

    fn verify(&self) -> Result<Verified, CallError> {
        let mut all = Verified {
            hashes: Vec::new(),
            bytes: 0,
        };
        for r in self.every(&RankRequest::Verify)? {
            match r {
                RankReply::Verified(v) => {
                    all.hashes.extend(v.hashes);
                    all.bytes += v.bytes;
                }
                other => return Err(unexpected("verify", &other)),
            }
        }
        Ok(all)
    }

    fn enqueue(&self, ms: u64) -> Result<(), CallError> {
        self.every(&RankRequest::Busy(ms)).map(drop)
    }

    fn fault(&self, rank: usize) -> Result<(), CallError> {
        self.ask(rank, &RankRequest::Fault).map(drop)
    }

    fn health(&self) -> serde_json::Value {
        serde_json::json!({
            "ranks": self.ranks.len(),
            "children": self.pids(),
            "launcher_cuda": self.launcher.is_some(),
        })
    }

    fn engine(&self, op: &EngineOp) -> Result<(), CallError> {
        self.every(&RankRequest::Engine(op.clone())).map(drop)
    }

    fn engine_status(&self) -> Result<EngineStatus, CallError> {
        let mut all = EngineStatus {
            sleeping: false,
            running: 0,
        };
        for r in self.every(&RankRequest::EngineStatus)? {
            match r {
                RankReply::Status(st) => {
                    all.sleeping |= st.sleeping;
                    all.running += st.running;
                }
                other => return Err(unexpected("engine status", &other)),
            }
        }
        Ok(all)
    }
}

/// Forks one rank per GPU of `cfg`, then sets the launcher up; returns in the launcher only.
pub(super) fn start(cfg: &WorkerConfig) -> Result<Tree, WorkerError> {
    let me = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(0);
    let threads = cryo_proc::ProcHandle::open(me)
        .and_then(|h| h.tasks())
        .map_err(|e| WorkerError::Fork(std::io::Error::other(e.to_string())))?
        .len();
    if threads != 1 {
        // fork() copies only the calling thread: a child of a threaded process may deadlock.
        return Err(WorkerError::Fork(std::io::Error::other(format!(
            "the launcher has {threads} threads before forking its ranks"
        ))));
    }
    let mut chans: Vec<UnixStream> = Vec::new();
    let mut pids = Vec::new();
    for (rank, gpu) in cfg.gpus.iter().enumerate() {
        let (ours, theirs) = UnixStream::pair().map_err(WorkerError::Fork)?;
        match crate::sys::fork().map_err(WorkerError::Fork)? {
            None => {
                // The rank: nothing of the launcher's other channels may stay open here, or a
                // sibling would not see its launcher go.
                drop(chans);
                drop(ours);
                rank_main(cfg, rank, *gpu, theirs);
            }
            Some(pid) => {
                drop(theirs);
                chans.push(ours);
                pids.push(pid);
            }
        }
    }
    let launcher = if cfg.init_only {
        let w = Arc::new(Worker::new(cfg.dir.clone(), 0, cfg.seed, Vec::new()));
        super::restore::start(w.clone(), &crate::daemon_id(&cfg.dir))?;
        w.open_fresh().map_err(|e| open_error(cfg, e))?;
        Some(w)
    } else {
        None
    };
    std::thread::Builder::new()
        .name("cryo-sim-reaper".into())
        .spawn(reap)
        .map_err(WorkerError::Fork)?;
    let mut ranks = Vec::new();
    for (rank, (mut chan, pid)) in chans.into_iter().zip(pids).enumerate() {
        match proto::recv_some::<RankReply>(&mut chan) {
            Ok(RankReply::Ready { .. }) => ranks.push(Rank {
                pid,
                chan: Mutex::new(chan),
            }),
            Ok(RankReply::Failed(reason)) => return Err(WorkerError::Rank { rank, reason }),
            Ok(other) => {
                return Err(WorkerError::Rank {
                    rank,
                    reason: format!("unexpected first message {other:?}"),
                })
            }
            Err(e) => {
                return Err(WorkerError::Rank {
                    rank,
                    reason: format!("it ended before it was ready ({e}); see the log"),
                })
            }
        }
    }
    Ok(Tree { ranks, launcher })
}

/// Reaps the ranks as they end (they are this process's children and nobody else's).
fn reap() {
    loop {
        match nix::sys::wait::wait() {
            Ok(status) => tracing::warn!(?status, "a rank ended"),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return,
        }
    }
}

/// A rank's whole life: one context on `gpu`, then serving the launcher until it goes.
fn rank_main(cfg: &WorkerConfig, rank: usize, gpu: u32, mut chan: UnixStream) -> ! {
    let seed = super::state::rank_seed(cfg.seed, rank);
    let worker = Arc::new(
        Worker::new(
            cfg.dir.clone(),
            cfg.rank_memory.get(rank).copied().unwrap_or(cfg.memory),
            seed,
            vec![gpu],
        )
        .with_kv_cache(cfg.kv_cache),
    );
    let started = super::restore::start(worker.clone(), &crate::daemon_id(&cfg.dir))
        .and_then(|()| worker.open_fresh().map_err(|e| open_error(cfg, e)))
        .and_then(|()| match cfg.nccl {
            true => super::nccl::start(rank).map_err(WorkerError::Nccl),
            false => Ok(()),
        });
    if let Err(e) = started {
        tracing::error!(rank, gpu, %e, "rank cannot start");
        let _ = proto::send(&mut chan, &RankReply::Failed(e.to_string()));
        std::process::exit(1);
    }
    tracing::info!(rank, gpu, pid = std::process::id(), "rank serving");
    if proto::send(
        &mut chan,
        &RankReply::Ready {
            pid: std::process::id(),
        },
    )
    .is_err()
    {
        std::process::exit(1);
    }
    loop {
        let req: RankRequest = match proto::recv(&mut chan) {
            Ok(Some(r)) => r,
            Ok(None) | Err(_) => {
                tracing::error!(rank, "the launcher went away: exiting");
                std::process::exit(1);
            }
        };
        let reply = match req {
            RankRequest::Complete(prompt) => worker.complete(&prompt).map(RankReply::Text),
            RankRequest::Verify => Backend::verify(worker.as_ref()).map(RankReply::Verified),
            RankRequest::Busy(ms) => {
                Backend::enqueue(worker.as_ref(), ms).map(|()| RankReply::Done)
            }
            RankRequest::Fault => Backend::fault(worker.as_ref(), 0).map(|()| RankReply::Done),
            RankRequest::Engine(op) => worker.engine(&op).map(|()| RankReply::Done),
            RankRequest::EngineStatus => Ok(RankReply::Status(worker.engine_status())),
        }
        .unwrap_or_else(|e| match e {
            CallError::Sticky(code) => RankReply::Sticky(code.0),
            CallError::Sleeping => RankReply::Sleeping,
            CallError::Engine(e) => RankReply::Refused(e),
            other => RankReply::Error(format!("{other:?}")),
        });
        if proto::send(&mut chan, &reply).is_err() {
            tracing::error!(rank, "the launcher went away: exiting");
            std::process::exit(1);
        }
    }
}

/// The ready file of a tree: the launcher's and its ranks' pids.
pub(super) fn ready_extra(tree: &Tree) -> serde_json::Value {
    serde_json::json!({ "children": tree.pids() })
}
