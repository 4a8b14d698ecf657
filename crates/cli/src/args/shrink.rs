//! `--shrink`, `--engine-url`, `--shrink-timeout`: the shrink before suspend that `cryo stop`,
//! `cryo freeze` and `cryo park` take, and the grow after `cryo thaw`. Parsed without system
//! calls.

use clap::Args;
use cryo_lifecycle::{Shrink, ShrinkSpec};

/// How a suspension asks the engine to shrink first.
#[derive(Debug, Clone, Args)]
pub struct ShrinkArgs {
    /// Before anything is locked, ask the engine to release what it can rebuild, so less device
    /// memory is copied: `vllm[:1|2]` (sleep mode: level 1 keeps the weights in host memory,
    /// level 2 drops them and reloads them from the model's files on wake-up), `sglang[:TAGS]`
    /// (memory saver; default tags `kv_cache`), `http:RELEASE_URL,RESUME_URL`, or `none`. A
    /// shrink that fails or runs past --shrink-timeout is undone and the whole memory is
    /// suspended instead; the report says which happened.
    #[arg(long, value_name = "SPEC", default_value = "none", value_parser = parse_spec)]
    pub shrink: ShrinkSpec,
    /// The engine's HTTP address for --shrink vllm and sglang (`http://127.0.0.1:8000`,
    /// `unix:/run/engine.sock:/`).
    #[arg(long, value_name = "URL")]
    pub engine_url: Option<String>,
    /// How long the release may take (drain, request, confirmation), in milliseconds.
    #[arg(long, value_name = "MS", default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(1..))]
    pub shrink_timeout: u64,
}

fn parse_spec(s: &str) -> Result<ShrinkSpec, String> {
    s.parse()
        .map_err(|e: cryo_lifecycle::shrink::SpecError| e.to_string())
}

impl ShrinkArgs {
    /// The shrink asked for (`None` for `--shrink none`), checked.
    pub fn shrink(&self) -> anyhow::Result<Option<Shrink>> {
        if self.shrink == ShrinkSpec::None {
            return Ok(None);
        }
        Ok(Some(Shrink::new(
            self.shrink.clone(),
            self.engine_url.clone(),
            std::time::Duration::from_millis(self.shrink_timeout),
        )?))
    }
}

/// How `cryo thaw` grows the engine of an image frozen shrunk.
#[derive(Debug, Clone, Args)]
pub struct GrowArgs {
    /// The shrink to undo once the tree runs: by default the one the image records (`cryo
    /// freeze --shrink`; nothing for an image frozen whole); a spec overrides it, `none` skips
    /// the grow.
    #[arg(long, value_name = "SPEC", value_parser = parse_spec)]
    pub shrink: Option<ShrinkSpec>,
    /// The engine's HTTP address for that grow (default: the one the image records).
    #[arg(long, value_name = "URL", requires = "shrink")]
    pub engine_url: Option<String>,
}

impl GrowArgs {
    /// The grow asked for: `None` as the image records; a `none` spec: no grow.
    pub fn grow(&self) -> anyhow::Result<Option<Shrink>> {
        let Some(spec) = &self.shrink else {
            return Ok(None);
        };
        if *spec == ShrinkSpec::None {
            return Ok(Some(Shrink {
                spec: ShrinkSpec::None,
                engine: None,
                timeout_ms: 0,
            }));
        }
        Ok(Some(Shrink::new(
            spec.clone(),
            self.engine_url.clone(),
            cryo_lifecycle::shrink::DEFAULT_TIMEOUT,
        )?))
    }
}
