//! The client side of the simulated GPU: the `sim` backend of the `cryo-gpu` traits, and
//! [`SimControl`] for tests, benchmarks and `cryo sim` (ledger, fault injection).
//!
//! Each call is one connection to `DIR/driver.sock`, so a client holds nothing open between calls
//! (a CLI-per-call tool and a long-lived agent behave the same).

use std::io;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cryo_gpu::{
    BackendKind, CheckpointDriver, CuResult, DriverError, Gpu, GpuInfo, GpuInspector, GpuPair,
    GpuProcess, InspectError, ProcessState,
};
use cryo_proc::Pid;

use crate::ledger::{self, LedgerError, Wedge};
use crate::proto::{self, ApiCall, ApiDone, Fault, HangRule, Reply, Request};

/// The simulated driver could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SimClientError {
    /// Nothing listens on the daemon's socket.
    #[error("no simulated GPU driver is running at {socket} ({source}); start one with `cryo sim driver --dir {dir}`")]
    NotRunning {
        /// The socket tried.
        socket: String,
        /// Its directory.
        dir: String,
        /// Why connecting failed.
        source: io::Error,
    },
    /// The connection broke mid-request.
    #[error("simulated GPU driver at {socket}: {source}")]
    Io {
        /// The socket.
        socket: String,
        /// The error.
        source: io::Error,
    },
    /// The daemon answered something that does not fit the request.
    #[error("simulated GPU driver at {socket}: {reason}")]
    Protocol {
        /// The socket.
        socket: String,
        /// What was wrong.
        reason: String,
    },
    /// The daemon answered with a driver error code.
    #[error("{what} on pid {pid} failed: {code} ({})", code.description())]
    Cuda {
        /// What was asked.
        what: &'static str,
        /// Target process.
        pid: Pid,
        /// The code.
        code: CuResult,
    },
    /// The daemon did not come up in time.
    #[error("the simulated GPU driver at {socket} did not answer within {waited:?}")]
    NotUp {
        /// The socket.
        socket: String,
        /// How long it was given.
        waited: Duration,
    },
    /// The ledger could not be read.
    #[error(transparent)]
    Ledger(#[from] LedgerError),
}

/// A handle on one simulated driver (its directory). Cheap: holds no connection.
#[derive(Debug, Clone)]
pub struct SimClient {
    dir: PathBuf,
    socket: PathBuf,
}

impl SimClient {
    /// A client of the daemon in `dir`; connects nothing yet.
    pub fn new(dir: &Path) -> Self {
        SimClient {
            dir: dir.to_path_buf(),
            socket: crate::socket_path(dir),
        }
    }

    /// The daemon's directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn endpoint(&self) -> String {
        self.socket.display().to_string()
    }

    /// Sends one request on a fresh connection and reads the answer.
    pub fn request(&self, req: &Request) -> Result<Reply, SimClientError> {
        let mut s =
            UnixStream::connect(&self.socket).map_err(|source| SimClientError::NotRunning {
                socket: self.endpoint(),
                dir: self.dir.display().to_string(),
                source,
            })?;
        let io = |source| SimClientError::Io {
            socket: self.endpoint(),
            source,
        };
        proto::send(&mut s, req).map_err(io)?;
        proto::recv_some(&mut s).map_err(io)
    }

    /// The daemon's driver version, checking that it answers.
    pub fn hello(&self) -> Result<String, SimClientError> {
        match self.request(&Request::Hello)? {
            Reply::Hello { driver_version, .. } => Ok(driver_version),
            other => Err(self.unexpected(&other)),
        }
    }

    fn unexpected(&self, reply: &Reply) -> SimClientError {
        let reason = match reply {
            Reply::Error(m) => m.clone(),
            other => format!("unexpected answer {other:?}"),
        };
        SimClientError::Protocol {
            socket: self.endpoint(),
            reason,
        }
    }

    fn call(&self, pid: Pid, call: ApiCall) -> Result<ApiDone, DriverError> {
        let name = call.entry_point();
        match self.request(&Request::Call { pid, call }) {
            Ok(Reply::Api(done)) => Ok(done),
            Ok(Reply::Cuda(code)) => Err(DriverError::Cuda {
                call: name,
                pid,
                code,
            }),
            Ok(other) => Err(self.to_driver(self.unexpected(&other))),
            Err(e) => Err(self.to_driver(e)),
        }
    }

    fn to_driver(&self, e: SimClientError) -> DriverError {
        DriverError::Sim {
            endpoint: self.endpoint(),
            reason: without_endpoint(&e, &self.endpoint()),
        }
    }

    fn to_inspect(&self, e: SimClientError) -> InspectError {
        InspectError::Sim {
            endpoint: self.endpoint(),
            reason: without_endpoint(&e, &self.endpoint()),
        }
    }

    fn inspect_request(&self, req: &Request) -> Result<Reply, InspectError> {
        match self.request(req) {
            Ok(Reply::Error(m)) => Err(InspectError::Sim {
                endpoint: self.endpoint(),
                reason: m,
            }),
            Ok(r) => Ok(r),
            Err(e) => Err(self.to_inspect(e)),
        }
    }
}

/// The error's message without the "simulated GPU driver at X:" prefix the wrapping error repeats.
fn without_endpoint(e: &SimClientError, endpoint: &str) -> String {
    let msg = e.to_string();
    msg.strip_prefix(&format!("simulated GPU driver at {endpoint}: "))
        .map(str::to_string)
        .unwrap_or(msg)
}

/// Connects to the simulated driver in `dir` (checking that it answers) and returns it as a
/// `cryo-gpu` backend.
pub fn connect(dir: &Path) -> Result<Gpu, SimClientError> {
    let client = Arc::new(SimClient::new(dir));
    client.hello()?;
    Ok(Gpu {
        kind: BackendKind::Sim,
        driver: client.clone(),
        inspect: client,
    })
}

impl CheckpointDriver for SimClient {
    fn state(&self, pid: Pid) -> Result<ProcessState, DriverError> {
        match self.call(pid, ApiCall::State)? {
            ApiDone::State(s) => Ok(s),
            other => Err(self.to_driver(self.unexpected(&Reply::Api(other)))),
        }
    }

    fn lock(&self, pid: Pid, timeout: Option<Duration>) -> Result<(), DriverError> {
        let timeout_ms = timeout.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX).max(1));
        self.call(pid, ApiCall::Lock { timeout_ms }).map(drop)
    }

    fn checkpoint(&self, pid: Pid) -> Result<(), DriverError> {
        self.call(pid, ApiCall::Checkpoint).map(drop)
    }

    fn restore(&self, pid: Pid, pairs: &[GpuPair]) -> Result<(), DriverError> {
        self.call(
            pid,
            ApiCall::Restore {
                pairs: pairs.to_vec(),
            },
        )
        .map(drop)
    }

    fn unlock(&self, pid: Pid) -> Result<(), DriverError> {
        self.call(pid, ApiCall::Unlock).map(drop)
    }

    fn restore_thread_id(&self, pid: Pid) -> Result<Pid, DriverError> {
        match self.call(pid, ApiCall::RestoreTid)? {
            ApiDone::Tid(t) => Ok(t),
            other => Err(self.to_driver(self.unexpected(&Reply::Api(other)))),
        }
    }
}

impl GpuInspector for SimClient {
    fn gpus(&self) -> Result<Vec<GpuInfo>, InspectError> {
        match self.inspect_request(&Request::Gpus)? {
            Reply::Gpus(g) => Ok(g),
            other => Err(self.to_inspect(self.unexpected(&other))),
        }
    }

    fn processes(&self) -> Result<Vec<GpuProcess>, InspectError> {
        match self.inspect_request(&Request::Processes)? {
            Reply::Processes(p) => Ok(p),
            other => Err(self.to_inspect(self.unexpected(&other))),
        }
    }

    fn driver_version(&self) -> Result<String, InspectError> {
        self.hello().map_err(|e| self.to_inspect(e))
    }

    fn driver_fds(&self, pid: Pid) -> Result<Vec<i32>, InspectError> {
        match self.inspect_request(&Request::DriverFds { pid })? {
            Reply::Fds(f) => Ok(f),
            other => Err(self.to_inspect(self.unexpected(&other))),
        }
    }

    fn cuda_processes(&self) -> Result<Vec<Pid>, InspectError> {
        match self.inspect_request(&Request::CudaProcesses)? {
            Reply::Pids(p) => Ok(p),
            other => Err(self.to_inspect(self.unexpected(&other))),
        }
    }
}

/// Test and benchmark controls of one simulated driver: the wedge ledger and fault injection.
#[derive(Debug, Clone)]
pub struct SimControl {
    client: SimClient,
}

impl SimControl {
    /// Controls of the daemon in `dir`.
    pub fn new(dir: &Path) -> Self {
        SimControl {
            client: SimClient::new(dir),
        }
    }

    /// The client underneath.
    pub fn client(&self) -> &SimClient {
        &self.client
    }

    /// Every wedge recorded (read from `DIR/ledger.jsonl`; works with the daemon down).
    pub fn ledger(&self) -> Result<Vec<Wedge>, SimClientError> {
        Ok(ledger::read(&crate::ledger_path(&self.client.dir))?)
    }

    /// Gives `pid`'s context a sticky `CUDA_ERROR_ILLEGAL_ADDRESS`, as a faulting kernel would.
    pub fn inject_sticky(&self, pid: Pid) -> Result<(), SimClientError> {
        self.inject(pid, Fault::Sticky)
    }

    /// Injects `fault` into `pid` (through its restore thread).
    pub fn inject(&self, pid: Pid, fault: Fault) -> Result<(), SimClientError> {
        match self.client.request(&Request::Inject { pid, fault })? {
            Reply::Injected => Ok(()),
            Reply::Cuda(code) => Err(SimClientError::Cuda {
                what: "fault injection",
                pid,
                code,
            }),
            other => Err(self.client.unexpected(&other)),
        }
    }

    /// From now on, calls that `rule` matches get no answer until [`SimControl::release`] (or
    /// until their caller hangs up, which drops them): a driver call that does not return.
    pub fn hang(&self, rule: HangRule) -> Result<(), SimClientError> {
        match self.client.request(&Request::Hang(rule))? {
            Reply::Injected => Ok(()),
            other => Err(self.client.unexpected(&other)),
        }
    }

    /// Lets every held call go on and clears the hang rules; returns how many calls were held.
    pub fn release(&self) -> Result<u32, SimClientError> {
        match self.client.request(&Request::Release)? {
            Reply::Held(n) => Ok(n),
            other => Err(self.client.unexpected(&other)),
        }
    }

    /// The device-memory copies of the last checkpoints and restores, oldest first (the
    /// daemon keeps [`crate::daemon::COPIES_KEPT`]).
    pub fn copies(&self) -> Result<Vec<crate::proto::MemCopy>, SimClientError> {
        match self.client.request(&Request::Copies)? {
            Reply::Copies(c) => Ok(c),
            other => Err(self.client.unexpected(&other)),
        }
    }

    /// How many calls injected hangs hold right now (wait for it to know a call is held).
    pub fn held(&self) -> Result<u32, SimClientError> {
        match self.client.request(&Request::Held)? {
            Reply::Held(n) => Ok(n),
            other => Err(self.client.unexpected(&other)),
        }
    }

    /// Waits until the daemon answers.
    pub fn wait_up(&self, timeout: Duration) -> Result<(), SimClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            match self.client.hello() {
                Ok(_) => return Ok(()),
                Err(SimClientError::NotRunning { .. }) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(10));
                }
                Err(SimClientError::NotRunning { .. }) => {
                    return Err(SimClientError::NotUp {
                        socket: self.client.endpoint(),
                        waited: timeout,
                    })
                }
                Err(e) => return Err(e),
            }
        }
    }
}
