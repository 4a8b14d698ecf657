//! The sim worker: an inference-like HTTP server whose answers depend on its simulated device
//! memory, with the restore thread that carries out checkpoint-API calls on it.
//!
//! # Design
//! [`state::Worker`] holds the process's checkpoint state, as the CUDA driver's state lives inside
//! a real CUDA process: a CRIU image of a checkpointed worker carries it and can be restored any
//! number of times. Application threads make "GPU calls" through a gate that lock closes.
//! Once checkpointed the worker holds only a listening TCP socket on loopback, the restore
//! thread's listening abstract socket and plain files: nothing CRIU cannot dump.
//!
//! Shapes (`cryo sim worker`): one context (`--gpu N`); one process with a context on each of
//! several GPUs (`--gpus 0,1`: NVML lists it on each, checkpoint and restore take all of them or
//! none); a launcher that only initialised the driver (`--init-only`: a driver fd, a restore
//! thread, no context, no device memory); a tree with one rank process per GPU
//! (`--gpus 0,1 --process-per-gpu`, [`tree`]), whose launcher is plain or, with `--init-only`,
//! initialised the driver.
//!
//! # Limitations
//! GPU work queued by `/busy` is modelled as a deadline, not as kernels running in the daemon.

mod engine;
mod http;
mod nccl;
mod restore;
pub(crate) mod state;
mod tree;

use std::io;
use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cryo_gpu::CuResult;

use self::http::Backend;
use self::state::{OpenError, Worker};

/// What `cryo sim worker` was asked to run.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The driver's directory.
    pub dir: PathBuf,
    /// NVML indices of the GPUs, one context each (in one process, or one rank process each
    /// with `process_per_gpu`). Empty only with `init_only` and no ranks.
    pub gpus: Vec<u32>,
    /// One child process per GPU under a launcher, instead of one process with every context.
    pub process_per_gpu: bool,
    /// The process (the launcher of a tree) only initialises the driver: no context.
    pub init_only: bool,
    /// Device memory per context, bytes: the engine's weights.
    pub memory: u64,
    /// Device memory of each context in `gpus` order instead of `memory` (empty: `memory` each).
    pub rank_memory: Vec<u64>,
    /// KV cache per context after the weights, bytes (0: none): what the engine endpoints
    /// release and take back.
    pub kv_cache: u64,
    /// Leave what an NCCL communicator leaves for the host to see (its shared memory and IPC
    /// socket), in the process or in every rank.
    pub nccl: bool,
    /// Seed of device memory.
    pub seed: u64,
    /// TCP port on 127.0.0.1 (0: any).
    pub port: u16,
    /// Serve on this unix socket instead of TCP.
    pub http_unix: Option<PathBuf>,
    /// Where to write `{"pid":..,"port":..}` once serving.
    pub ready_file: Option<PathBuf>,
}

/// The worker could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// Too little device memory asked for.
    #[error("--memory {0} is too small: at least 4096 bytes")]
    MemoryTooSmall(u64),
    /// The restore thread's socket could not be set up.
    #[error("cannot listen on the restore thread's socket {name}: {source}")]
    RestoreSocket {
        /// Abstract socket name.
        name: String,
        /// The error.
        source: io::Error,
    },
    /// The restore thread could not be started.
    #[error("cannot start the restore thread: {0}")]
    RestoreThread(io::Error),
    /// The GPUs asked for do not make a worker.
    #[error("{0}")]
    Shape(&'static str),
    /// The ranks of a tree could not be forked.
    #[error("cannot fork the ranks: {0}")]
    Fork(io::Error),
    /// A rank of a tree did not start.
    #[error("rank {rank} did not start: {reason}")]
    Rank {
        /// Its rank.
        rank: usize,
        /// Why.
        reason: String,
    },
    /// The driver is not running.
    #[error("no simulated GPU driver is running at {socket} ({source}); start one with `cryo sim driver --dir {dir}`")]
    Driver {
        /// Its socket.
        socket: String,
        /// Its directory.
        dir: String,
        /// Why connecting failed.
        source: io::Error,
    },
    /// The driver refused the context.
    #[error("cannot open a context of {bytes} bytes on GPUs {gpus:?}: {code} ({})", code.description())]
    Context {
        /// GPU indices.
        gpus: Vec<u32>,
        /// Size asked for.
        bytes: u64,
        /// The driver's answer.
        code: CuResult,
    },
    /// Talking to the driver failed.
    #[error("simulated GPU driver at {socket}: {reason}")]
    Protocol {
        /// Its socket.
        socket: String,
        /// What went wrong.
        reason: String,
    },
    /// The HTTP server could not start.
    #[error("cannot listen on {listen}: {reason}")]
    Http {
        /// Address asked for.
        listen: String,
        /// Why.
        reason: String,
    },
    /// The ready file could not be written.
    #[error("cannot write the ready file {path}: {source}")]
    ReadyFile {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// NCCL's evidence could not be set up.
    #[error("cannot set up the NCCL communicator's shared memory and socket: {0}")]
    Nccl(io::Error),
    /// The log file could not be opened or installed as stdout/stderr.
    #[error("cannot log to {path}: {source}")]
    Log {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
}

/// Detaches the worker from whoever started it, so that nothing CRIU cannot dump stays open:
/// stdin becomes `/dev/null`, stdout and stderr go to `log` (append) when given, and every other
/// inherited fd (a jobserver pipe, a parent's socket) is closed.
pub fn detach(log: Option<&Path>) -> Result<(), WorkerError> {
    use std::os::fd::AsRawFd;
    let me = cryo_proc::Pid::try_from(std::process::id()).unwrap_or(0);
    let inherited = cryo_proc::fds(me).unwrap_or_default();
    for fd in inherited.iter().map(|f| f.fd).filter(|fd| *fd > 2) {
        // The listing's own directory fd is gone already: EBADF is expected for it.
        let _ = nix::unistd::close(fd);
    }
    let null = std::fs::File::open("/dev/null").map_err(|source| WorkerError::Log {
        path: "/dev/null".into(),
        source,
    })?;
    nix::unistd::dup2(null.as_raw_fd(), 0).map_err(|e| WorkerError::Log {
        path: "/dev/null".into(),
        source: e.into(),
    })?;
    let Some(path) = log else { return Ok(()) };
    let err = |source| WorkerError::Log {
        path: path.display().to_string(),
        source,
    };
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(err)?;
    for target in [1, 2] {
        nix::unistd::dup2(f.as_raw_fd(), target).map_err(|e| err(e.into()))?;
    }
    Ok(())
}

/// What opening the driver or a context failed with, as the worker reports it.
pub(super) fn open_error(cfg: &WorkerConfig, e: OpenError) -> WorkerError {
    match e {
        OpenError::Connect(source) => WorkerError::Driver {
            socket: crate::socket_path(&cfg.dir).display().to_string(),
            dir: cfg.dir.display().to_string(),
            source,
        },
        OpenError::Cuda(code) => WorkerError::Context {
            gpus: cfg.gpus.clone(),
            bytes: cfg.memory,
            code,
        },
        OpenError::Protocol(reason) => WorkerError::Protocol {
            socket: crate::socket_path(&cfg.dir).display().to_string(),
            reason,
        },
    }
}

/// Runs the worker until it is killed (or `/fault?exit=1`).
pub fn run(cfg: WorkerConfig) -> Result<(), WorkerError> {
    if cfg.process_per_gpu && cfg.gpus.is_empty() {
        return Err(WorkerError::Shape("--process-per-gpu needs --gpus"));
    }
    if !cfg.process_per_gpu && cfg.init_only != cfg.gpus.is_empty() {
        return Err(WorkerError::Shape(
            "--init-only holds no context: it takes no GPU (except as the launcher of --process-per-gpu)",
        ));
    }
    if !cfg.rank_memory.is_empty() && cfg.rank_memory.len() != cfg.gpus.len() {
        return Err(WorkerError::Shape(
            "--rank-memory takes one size per GPU of --gpus",
        ));
    }
    for &m in std::iter::once(&cfg.memory).chain(&cfg.rank_memory) {
        if !cfg.gpus.is_empty() && m < 4096 {
            return Err(WorkerError::MemoryTooSmall(m));
        }
    }
    if cfg.kv_cache > 0
        && !std::iter::once(&cfg.memory)
            .chain(&cfg.rank_memory)
            .all(|m| m.is_multiple_of(8))
    {
        return Err(WorkerError::Shape(
            "--memory must be a multiple of 8 bytes with --kv-cache (the KV cache starts at a word)",
        ));
    }
    // Ranks are forked before this process starts any thread.
    let (backend, extra): (Arc<dyn Backend>, serde_json::Value) = if cfg.process_per_gpu {
        let t = tree::start(&cfg)?;
        let extra = tree::ready_extra(&t);
        (Arc::new(t), extra)
    } else {
        let ctx_gpus = if cfg.init_only {
            Vec::new()
        } else {
            cfg.gpus.clone()
        };
        let worker = Arc::new(
            Worker::new(cfg.dir.clone(), cfg.memory, cfg.seed, ctx_gpus)
                .with_rank_bytes(cfg.rank_memory.clone())
                .with_kv_cache(cfg.kv_cache),
        );
        restore::start(worker.clone(), &crate::daemon_id(&cfg.dir))?;
        worker.open_fresh().map_err(|e| open_error(&cfg, e))?;
        if cfg.nccl {
            nccl::start(0).map_err(WorkerError::Nccl)?;
        }
        (worker, serde_json::json!({}))
    };
    let server = match &cfg.http_unix {
        Some(path) => tiny_http::Server::http_unix(path).map_err(|e| WorkerError::Http {
            listen: path.display().to_string(),
            reason: e.to_string(),
        })?,
        None => tiny_http::Server::http(SocketAddrV4::new(Ipv4Addr::LOCALHOST, cfg.port)).map_err(
            |e| WorkerError::Http {
                listen: format!("127.0.0.1:{}", cfg.port),
                reason: e.to_string(),
            },
        )?,
    };
    let port = server.server_addr().to_ip().map_or(0, |a| a.port());
    if let Some(path) = &cfg.ready_file {
        write_ready(path, port, cfg.http_unix.as_deref(), extra).map_err(|source| {
            WorkerError::ReadyFile {
                path: path.display().to_string(),
                source,
            }
        })?;
    }
    tracing::info!(pid = std::process::id(), port, unix = ?cfg.http_unix, bytes = cfg.memory, gpus = ?cfg.gpus, tree = cfg.process_per_gpu, init_only = cfg.init_only, "sim worker serving");
    http::serve(backend, Arc::new(server));
    Ok(())
}

fn write_ready(
    path: &Path,
    port: u16,
    unix: Option<&Path>,
    extra: serde_json::Value,
) -> io::Result<()> {
    let mut body = serde_json::json!({ "pid": std::process::id(), "port": port, "unix": unix });
    if let (Some(b), serde_json::Value::Object(extra)) = (body.as_object_mut(), extra) {
        b.extend(extra);
    }
    let body = body.to_string();
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, body)?;
    std::fs::rename(&tmp, path)
}
