//! The test kit's simulated GPU, run from this crate's `cryo-sim` binary.
#![allow(dead_code)]

#[allow(unused_imports)]
pub use cryo_testkit::cu_code as code;
pub use cryo_testkit::sim::{Program, Sim, Worker, WorkerSpec};

pub const BIN: &str = env!("CARGO_BIN_EXE_cryo-sim");

pub fn program() -> Program {
    Program::cryo_sim(BIN)
}

/// A daemon with two GPUs of 16 GiB.
pub fn sim() -> Sim {
    Sim::start(&program())
}

/// A daemon started with these `driver` arguments.
pub fn sim_with(args: &[&str]) -> Sim {
    Sim::start_with(&program(), args)
}

/// A worker with `memory` on GPU `gpu`, device memory from `seed`.
pub fn worker(sim: &Sim, memory: &str, gpu: u32, seed: u64) -> Worker {
    sim.spawn(WorkerSpec::new(memory).gpu(gpu).seed(seed))
}
