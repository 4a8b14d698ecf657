//! `cryo sim ...`: start the simulated driver and workers by hand, read the ledger, inject faults.

use std::io::Write;
use std::path::PathBuf;

use clap::{Args, Subcommand, ValueEnum};
use cryo_gpu::{CuResult, GpuUuid};
use cryo_proc::Pid;

use crate::client::{SimClient, SimClientError, SimControl};
use crate::daemon::{DaemonConfig, DaemonError};
use crate::proto::{ApiCall, ApiDone, CallKind, Fault, HangRule, Reply, Request};
use crate::worker::{WorkerConfig, WorkerError};
use cryo_units::parse_size;

/// The simulated GPU's commands.
#[derive(Debug, Clone, Subcommand)]
pub enum SimCommand {
    /// Run the simulated GPU driver daemon (until killed).
    Driver(DriverArgs),
    /// Run a sim worker: an inference-like HTTP server on loopback using simulated device memory.
    Worker(WorkerArgs),
    /// Print the wedge ledger: live restored contexts that were torn down.
    Ledger {
        /// The driver's directory.
        #[arg(long, env = "CRYO_SIM_DIR", default_value_os_t = crate::default_dir())]
        dir: PathBuf,
        /// One JSON array instead of text.
        #[arg(long)]
        json: bool,
    },
    /// One raw checkpoint-API call, as a program linked against libcuda makes it (no pid
    /// normalisation, no state check first); prints one JSON line `{"call", "pid", "result",
    /// "name", "value"}`, as scripts/gpu/driver_call.py does on a real GPU.
    Call {
        /// The driver's directory.
        #[arg(long, env = "CRYO_SIM_DIR", default_value_os_t = crate::default_dir())]
        dir: PathBuf,
        /// Which call.
        #[arg(value_enum)]
        call: RawCall,
        /// The pid (or thread id) handed to the driver as is.
        #[arg(long)]
        pid: Pid,
        /// Lock: `timeoutMs` (0: wait without limit).
        #[arg(long, default_value_t = 0)]
        timeout: u64,
    },
    /// Inject a fault into a worker, or a hang into the driver.
    Inject {
        /// The driver's directory.
        #[arg(long, env = "CRYO_SIM_DIR", default_value_os_t = crate::default_dir())]
        dir: PathBuf,
        /// The process (a worker for `sticky`; for `hang`, only calls on it hang).
        #[arg(long, global = true)]
        pid: Option<Pid>,
        /// What to inject.
        #[command(subcommand)]
        what: InjectArgs,
    },
}

/// What `cryo sim inject` injects.
#[derive(Debug, Clone, Subcommand)]
pub enum InjectArgs {
    /// A kernel of the worker (`--pid`) faults: sticky `CUDA_ERROR_ILLEGAL_ADDRESS` (lock then
    /// fails at once).
    Sticky,
    /// Driver calls of this kind (on `--pid` only, if given) get no answer until `cryo sim
    /// inject release` (or until their caller gives up): a driver that hangs.
    Hang {
        /// Which calls.
        #[arg(long, value_enum)]
        call: CallKind,
        /// Hold only this many calls (default: every one until released).
        #[arg(long)]
        times: Option<u32>,
    },
    /// Let every held call go on, and stop holding new ones; prints how many were held.
    Release,
}

/// The calls `cryo sim call` makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum RawCall {
    /// `cuCheckpointProcessGetState`.
    State,
    /// `cuCheckpointProcessLock`.
    Lock,
    /// `cuCheckpointProcessCheckpoint`.
    Checkpoint,
    /// `cuCheckpointProcessRestore` (no GPU pairs).
    Restore,
    /// `cuCheckpointProcessUnlock`.
    Unlock,
    /// `cuCheckpointProcessGetRestoreThreadId`.
    RestoreTid,
}

impl RawCall {
    fn api(self, timeout_ms: u64) -> ApiCall {
        match self {
            RawCall::State => ApiCall::State,
            RawCall::Lock => ApiCall::Lock {
                timeout_ms: (timeout_ms > 0).then_some(timeout_ms),
            },
            RawCall::Checkpoint => ApiCall::Checkpoint,
            RawCall::Restore => ApiCall::Restore { pairs: Vec::new() },
            RawCall::Unlock => ApiCall::Unlock,
            RawCall::RestoreTid => ApiCall::RestoreTid,
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            RawCall::State => "state",
            RawCall::Lock => "lock",
            RawCall::Checkpoint => "checkpoint",
            RawCall::Restore => "restore",
            RawCall::Unlock => "unlock",
            RawCall::RestoreTid => "restore-tid",
        }
    }
}

/// `cryo sim driver`.
#[derive(Debug, Clone, Args)]
pub struct DriverArgs {
    /// Directory for `driver.sock` and `ledger.jsonl` (created if missing).
    #[arg(long, env = "CRYO_SIM_DIR", default_value_os_t = crate::default_dir())]
    pub dir: PathBuf,
    /// Number of simulated GPUs.
    #[arg(long, default_value_t = 2)]
    pub gpus: u32,
    /// Device memory of each GPU (bytes, or e.g. 16GiB).
    #[arg(long, value_parser = parse_size, default_value = "16GiB")]
    pub gpu_memory: u64,
    /// Product name NVML reports.
    #[arg(long, default_value = "cryo simulated GPU")]
    pub gpu_name: String,
    /// UUIDs of the GPUs in index order (repeat the flag); the rest are derived from the directory.
    #[arg(long = "gpu-uuid")]
    pub gpu_uuids: Vec<GpuUuid>,
}

/// `cryo sim worker`.
#[derive(Debug, Clone, Args)]
pub struct WorkerArgs {
    /// The driver's directory.
    #[arg(long, env = "CRYO_SIM_DIR", default_value_os_t = crate::default_dir())]
    pub dir: PathBuf,
    /// NVML index of the GPU to use.
    #[arg(long, default_value_t = 0, conflicts_with = "gpus")]
    pub gpu: u32,
    /// A context on each of these GPUs (NVML indices, e.g. 0,1), all in this process.
    #[arg(long, value_delimiter = ',', num_args = 1..)]
    pub gpus: Vec<u32>,
    /// With --gpus: one child process (rank) per GPU under this one, as a tensor-parallel server.
    #[arg(long, requires = "gpus")]
    pub process_per_gpu: bool,
    /// Only initialise the driver (as `cuInit` does: a driver fd, no context, no device memory);
    /// with --process-per-gpu, the launcher does so.
    #[arg(long, conflicts_with = "gpu")]
    pub init_only: bool,
    /// Device memory to allocate per context (bytes, or e.g. 512MiB, 4GiB).
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    pub memory: u64,
    /// With --gpus: device memory of each context instead, one size per GPU in --gpus order
    /// (e.g. 96MiB,16MiB): a process whose GPUs hold unequal amounts, as the first GPU of a
    /// real multi-GPU process usually holds more.
    #[arg(long, value_delimiter = ',', value_parser = parse_size, requires = "gpus")]
    pub rank_memory: Vec<u64>,
    /// A KV cache per context after the weights (bytes, or e.g. 3GiB; 0: none), which the
    /// engine endpoints (vLLM's `/sleep`, `/wake_up`; SGLang's `/release_memory_occupation`,
    /// `/resume_memory_occupation`) release and take back.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    pub kv_cache: u64,
    /// Leave what an NCCL communicator leaves for the host to see: a mapped, unlinked
    /// `/dev/shm/nccl-*` segment and the abstract socket `/tmp/nccl-socket-RANK-HASH` (in every
    /// rank of a tree).
    #[arg(long)]
    pub nccl: bool,
    /// Seed of the "model weights" in device memory.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// TCP port on 127.0.0.1 (0: any free one).
    #[arg(long, default_value_t = 0)]
    pub port: u16,
    /// Serve HTTP on this unix socket instead of TCP (CRIU before 4.2 cannot dump TCP sockets on
    /// Linux >= 6.16: checkpoint-restore/criu#2705).
    #[arg(long, conflicts_with = "port")]
    pub http_unix: Option<PathBuf>,
    /// Written atomically once serving: `{"pid":..,"port":..,"unix":..}`.
    #[arg(long)]
    pub ready_file: Option<PathBuf>,
    /// Send stdout and stderr here (a plain file, so CRIU can dump the worker).
    #[arg(long)]
    pub log_file: Option<PathBuf>,
}

/// A `cryo sim` command failed.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// The daemon failed.
    #[error(transparent)]
    Daemon(#[from] DaemonError),
    /// The worker failed.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// Talking to the daemon failed.
    #[error(transparent)]
    Client(#[from] SimClientError),
    /// Writing the output failed.
    #[error("cannot write the output: {0}")]
    Output(std::io::Error),
    /// The daemon answered a call with something that is not a driver answer.
    #[error("the simulated driver answered {0}")]
    Answer(String),
    /// An injection that acts on a process was not told which.
    #[error("`cryo sim inject {0}` needs --pid")]
    NeedsPid(&'static str),
}

impl SimCommand {
    /// Runs the command; `driver` and `worker` return only when they fail.
    pub fn run(self) -> Result<(), SimError> {
        match self {
            SimCommand::Driver(a) => {
                init_logging();
                crate::daemon::run(DaemonConfig {
                    dir: a.dir,
                    gpus: a.gpus,
                    gpu_memory: a.gpu_memory,
                    gpu_name: a.gpu_name,
                    gpu_uuids: a.gpu_uuids,
                })?;
                Ok(())
            }
            SimCommand::Worker(a) => {
                crate::worker::detach(a.log_file.as_deref())?;
                init_logging();
                let gpus = match (a.gpus.is_empty(), a.init_only) {
                    (false, _) => a.gpus,
                    (true, true) => Vec::new(),
                    (true, false) => vec![a.gpu],
                };
                crate::worker::run(WorkerConfig {
                    dir: a.dir,
                    gpus,
                    process_per_gpu: a.process_per_gpu,
                    init_only: a.init_only,
                    memory: a.memory,
                    rank_memory: a.rank_memory,
                    kv_cache: a.kv_cache,
                    nccl: a.nccl,
                    seed: a.seed,
                    port: a.port,
                    http_unix: a.http_unix,
                    ready_file: a.ready_file,
                })?;
                Ok(())
            }
            SimCommand::Ledger { dir, json } => {
                let wedges = SimControl::new(&dir).ledger()?;
                let mut out = std::io::stdout().lock();
                let text = if json {
                    serde_json::to_string_pretty(&wedges).map_err(|e| SimError::Output(e.into()))?
                        + "\n"
                } else if wedges.is_empty() {
                    "no wedges\n".to_string()
                } else {
                    let mut t =
                        String::from("TIME                            PID      GPU  DEATH\n");
                    for w in &wedges {
                        t += &format!(
                            "{:<31} {:<8} {:<4} {}\n",
                            w.time, w.pid, w.gpu_index, w.death
                        );
                    }
                    t
                };
                out.write_all(text.as_bytes()).map_err(SimError::Output)
            }
            SimCommand::Call {
                dir,
                call,
                pid,
                timeout,
            } => {
                let request = Request::Call {
                    pid,
                    call: call.api(timeout),
                };
                let (code, value) = match SimClient::new(&dir).request(&request)? {
                    Reply::Api(ApiDone::Done) => (CuResult::SUCCESS, serde_json::Value::Null),
                    Reply::Api(ApiDone::State(s)) => (CuResult::SUCCESS, s.as_str().into()),
                    Reply::Api(ApiDone::Tid(t)) => (CuResult::SUCCESS, t.into()),
                    Reply::Cuda(code) => (code, serde_json::Value::Null),
                    Reply::Error(m) => return Err(SimError::Answer(m)),
                    other => return Err(SimError::Answer(format!("{other:?}"))),
                };
                let line = serde_json::json!({
                    "call": call.as_str(),
                    "pid": pid,
                    "result": code.0,
                    "name": code.name().map_or_else(|| format!("CUresult {}", code.0), str::to_string),
                    "value": value,
                });
                writeln!(std::io::stdout(), "{line}").map_err(SimError::Output)
            }
            SimCommand::Inject { dir, pid, what } => {
                let control = SimControl::new(&dir);
                match what {
                    InjectArgs::Sticky => {
                        control.inject(pid.ok_or(SimError::NeedsPid("sticky"))?, Fault::Sticky)?
                    }
                    InjectArgs::Hang { call, times } => {
                        control.hang(HangRule { call, pid, times })?
                    }
                    InjectArgs::Release => {
                        let held = control.release()?;
                        writeln!(std::io::stdout(), "{held} calls were held")
                            .map_err(SimError::Output)?;
                    }
                }
                Ok(())
            }
        }
    }
}

/// Logs to stderr, `info` unless `RUST_LOG` says otherwise; a subscriber already set (by the
/// `cryo` binary) wins.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}
