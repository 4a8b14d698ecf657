//! The engine's memory: what an inference engine can release before a suspension and take back
//! after it, as vLLM's sleep mode and SGLang's memory saver do.
//!
//! # Design
//! Each context's device memory is the engine's weights (`--memory`, seeded: the "model files")
//! followed by its KV cache (`--kv-cache`: a fresh allocation, zeros, at start and after a
//! release; `/verify` checks both). Releasing and taking back are application GPU calls (they
//! wait while the process is locked, like every other), resizing device memory through the
//! driver, so a checkpoint after a release copies measurably less:
//! - KV cache released: device memory shrinks to the weights;
//! - weights offloaded (vLLM level 1, SGLang's `weights` tag, which the simulator keeps a host
//!   copy of as SGLang does with `--enable-weights-cpu-backup`): they are copied into this
//!   process's heap (the engine's own host copy), then device memory is freed;
//! - weights discarded (vLLM level 2): freed; taken back they are zeros until
//!   `reload_weights`, so an engine woken without the reload answers differently.
//!
//! Weights can be released only with the KV cache (the KV cache sits after them), and the KV
//! cache taken back only once the weights are on the device.

use serde::{Deserialize, Serialize};

use super::state::{CallError, Worker};

/// Where the weights are.
#[derive(Debug, Default)]
pub(crate) enum Weights {
    /// On the device, loaded.
    #[default]
    Loaded,
    /// Offloaded: the engine's host copy, one per context.
    Host(Vec<Vec<u8>>),
    /// Discarded (vLLM level 2): not on the device, no copy.
    Dropped,
    /// On the device again after a discard, not reloaded: zeros.
    Zeroed,
}

/// The engine's memory state.
#[derive(Debug, Default)]
pub(crate) struct EngineMem {
    pub(crate) weights: Weights,
    /// The KV cache is released.
    pub(crate) kv_released: bool,
}

impl EngineMem {
    /// Whether the engine serves (from zeroed weights too: vLLM woken from level 2 without a
    /// reload answers, wrongly).
    pub(crate) fn awake(&self) -> bool {
        matches!(self.weights, Weights::Loaded | Weights::Zeroed) && !self.kv_released
    }
}

/// How weights are released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum WeightsRelease {
    /// Copied to host memory first.
    Offload,
    /// Forgotten.
    Discard,
}

/// An engine memory request (forwarded as is to the ranks of a tree).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub(crate) enum EngineOp {
    /// Release the KV cache, and the weights if asked.
    Release {
        /// What happens to the weights (`None`: they stay).
        weights: Option<WeightsRelease>,
    },
    /// Take back what was released.
    Resume {
        /// The weights.
        weights: bool,
        /// The KV cache.
        kv: bool,
    },
    /// Load the weights from the model's files (after a discard).
    ReloadWeights,
}

/// What `/is_sleeping` and `/metrics` read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct EngineStatus {
    /// Weights or KV cache released.
    pub(crate) sleeping: bool,
    /// Requests running (GPU calls in progress or waiting, queued GPU work).
    pub(crate) running: u64,
}

impl Worker {
    fn mem(&self) -> std::sync::MutexGuard<'_, EngineMem> {
        self.engine.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fails with [`CallError::Sleeping`] unless the engine can serve.
    pub(crate) fn check_awake(&self) -> Result<(), CallError> {
        if self.ranks() == 0 || self.mem().awake() {
            Ok(())
        } else {
            Err(CallError::Sleeping)
        }
    }

    /// The engine's status.
    pub(crate) fn engine_status(&self) -> EngineStatus {
        EngineStatus {
            sleeping: self.ranks() > 0 && !self.mem().awake(),
            running: self.running(),
        }
    }

    /// Carries out an engine memory request on every context.
    pub(crate) fn engine(&self, op: &EngineOp) -> Result<(), CallError> {
        if self.ranks() == 0 {
            // A launcher holds no engine memory.
            return Ok(());
        }
        let mut mem = self.mem();
        let kv = self.kv_bytes();
        let w = |rank: usize| self.bytes_of(rank);
        match *op {
            EngineOp::Release { weights } => {
                if weights.is_none() && !matches!(mem.weights, Weights::Loaded | Weights::Zeroed) {
                    // The KV cache alone, weights already gone: it is gone too.
                    return Ok(());
                }
                if !mem.kv_released {
                    self.gpu_call(|c| {
                        c.iter_mut()
                            .enumerate()
                            .try_for_each(|(r, ctx)| ctx.resize(w(r), None))
                    })?;
                    mem.kv_released = true;
                }
                match (weights, &mem.weights) {
                    (None, _) | (Some(_), Weights::Host(_) | Weights::Dropped) => {}
                    (Some(WeightsRelease::Offload), Weights::Loaded | Weights::Zeroed) => {
                        let copies = self.gpu_call(|c| {
                            c.iter_mut()
                                .map(|ctx| {
                                    let copy = ctx.download()?;
                                    ctx.resize(0, None)?;
                                    Ok(copy)
                                })
                                .collect::<std::io::Result<Vec<_>>>()
                        })?;
                        mem.weights = Weights::Host(copies);
                    }
                    (Some(WeightsRelease::Discard), Weights::Loaded | Weights::Zeroed) => {
                        self.gpu_call(|c| c.iter_mut().try_for_each(|ctx| ctx.resize(0, None)))?;
                        mem.weights = Weights::Dropped;
                    }
                }
                Ok(())
            }
            EngineOp::Resume {
                weights,
                kv: want_kv,
            } => {
                if weights {
                    match std::mem::take(&mut mem.weights) {
                        Weights::Host(copies) => {
                            let back = self.gpu_call(|c| {
                                c.iter_mut().zip(&copies).enumerate().try_for_each(
                                    |(r, (ctx, copy))| {
                                        ctx.resize(w(r), None)?;
                                        ctx.write(0, copy)
                                    },
                                )
                            });
                            if let Err(e) = back {
                                mem.weights = Weights::Host(copies);
                                return Err(e);
                            }
                        }
                        Weights::Dropped => {
                            let back = self.gpu_call(|c| {
                                c.iter_mut()
                                    .enumerate()
                                    .try_for_each(|(r, ctx)| ctx.resize(w(r), None))
                            });
                            mem.weights = Weights::Zeroed;
                            if let Err(e) = back {
                                mem.weights = Weights::Dropped;
                                return Err(e);
                            }
                        }
                        other => mem.weights = other,
                    }
                }
                if want_kv && mem.kv_released {
                    if matches!(mem.weights, Weights::Host(_) | Weights::Dropped) {
                        return Err(CallError::Engine(
                            "the KV cache comes back after the weights: resume the weights first"
                                .into(),
                        ));
                    }
                    self.gpu_call(|c| {
                        c.iter_mut()
                            .enumerate()
                            .try_for_each(|(r, ctx)| ctx.resize(w(r) + kv, None))
                    })?;
                    mem.kv_released = false;
                }
                Ok(())
            }
            EngineOp::ReloadWeights => {
                if matches!(mem.weights, Weights::Host(_) | Weights::Dropped) {
                    return Err(CallError::Engine(
                        "the weights are not on the device: wake up first".into(),
                    ));
                }
                self.gpu_call(|c| {
                    c.iter_mut()
                        .enumerate()
                        .try_for_each(|(rank, ctx)| ctx.fill(w(rank), self.seed_of(rank)))
                })?;
                mem.weights = Weights::Loaded;
                Ok(())
            }
        }
    }
}
