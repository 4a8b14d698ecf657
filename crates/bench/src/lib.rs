//! cryo's benchmarks (`cryo bench stop|freeze|guard`) and its demo (`cryo demo`).
//!
//! # Design
//! Each runs on a private simulated GPU: a child `cryo sim driver` in a temporary directory of its
//! own (`private_sim`), and sim workers started against it, so they need nothing installed and
//! touch nothing else on the host. They drive cryo the way an operator does: the `cryo` binary
//! whose path the caller passes in (the CLI passes itself) for `cryo stop`, `cryo freeze`,
//! `cryo thaw` and `cuda-checkpoint`, and the libraries in-process where the measurement needs it
//! (the guard, a bare suspension, the demo's `cryo stop`).
//! - `stop`: `cryo stop` against the operators' procedure (one `cuda-checkpoint` per action).
//! - `agent`: `cryo stop` through the node agent against standalone `cryo stop`.
//! - `freeze`: `cryo freeze`/`thaw` against the `criu` command line plus `cuda-checkpoint`.
//! - `activate`: request-to-answer time of a scaled-to-zero worker: woken from park through
//!   `cryo activate`, claimed from a standby, `cryo thaw`, the bare route, against the raw
//!   driver restore + unlock.
//! - `guard`: the guard's cost on request latency, and signal-to-suspended time.
//! - `shrink`: stop, freeze and park + wake with `--shrink vllm:1` against without.
//! - `telemetry`: the journal's append latency with a syslog forwarder and a dead, stalled or
//!   live collector, against none (no simulated GPU needed).
//! - `demo`: the checkpoint/restore cycle step by step, with timings (the README's main job).
//!
//! Every benchmark prints ratios against a baseline measured in the same run (`measure`), never
//! absolute thresholds, and fails if the simulated driver's wedge ledger records a wedge.
//!
//! Errors are `anyhow`: these are programs whose errors are read by a person at the end of a run
//! (which step failed, with what), not values a caller branches on.
//!
//! # Limitations
//! Simulated GPU only: on a real GPU the driver's own checkpoint time dominates every arm.

mod activate;
pub mod args;
mod demo;
mod freeze;
mod guard;
mod measure;
mod private_sim;
mod shrink;
mod stop;
mod telemetry;

use std::path::Path;

pub use args::{BenchArgs, BenchCommand, DemoArgs};

/// Runs `cryo bench ...`; `cryo` is the binary the benchmarks run as an operator would.
pub fn bench(args: &BenchArgs, cryo: &Path) -> anyhow::Result<()> {
    match &args.command {
        BenchCommand::Stop(a) => stop::run(a, cryo),
        BenchCommand::Freeze(a) => freeze::run(a, cryo),
        BenchCommand::Activate(a) => activate::run(a, cryo),
        BenchCommand::Guard(a) => guard::run(a, cryo),
        BenchCommand::Telemetry(a) => telemetry::run(a),
        BenchCommand::Agent(a) => stop::run_agent(a, cryo),
        BenchCommand::Shrink(a) => shrink::run(a, cryo),
    }
}

/// Runs `cryo demo`; `cryo` is the binary the demo starts its simulated driver and worker from.
pub fn demo(args: &DemoArgs, cryo: &Path) -> anyhow::Result<()> {
    demo::run(args, cryo)
}
