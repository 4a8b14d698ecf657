//! Whether a command goes through the node agent.
//!
//! # Design
//! Every command that acts on processes asks the agent first (its socket: `CRYO_AGENT_SOCKET`,
//! else `STATE_DIR/cryod.sock`). Only when nothing answers there
//! ([`cryo_api::ClientError::NotRunning`]) does it work standalone, calling the same library
//! entry point the agent would; a command that changes something then says once on stderr that
//! nothing guards restored workers. Any other failure of the agent (it refused, it died
//! mid-request, the caller may not connect) is the command's error: never a reason to act behind
//! a running agent's back.

use std::sync::atomic::{AtomicBool, Ordering};

use cryo_api::{AgentClient, ClientError};
use cryo_lifecycle::Progress;
use cryo_state::StateDir;

/// The client of this node's agent.
pub fn client(state: &StateDir) -> AgentClient {
    AgentClient::new(cryo_api::socket_path(state))
}

/// A command's operation through the agent when one answers (`via_agent`, its failure mapped by
/// `agent_error`), else `standalone` in this process (which says so: [`standalone_note`]); the
/// progress on stderr for either, finished before the result is returned.
pub fn through_agent<T, E>(
    state: &StateDir,
    via_agent: impl FnOnce(&AgentClient, &dyn Progress) -> Result<T, ClientError>,
    agent_error: impl FnOnce(ClientError) -> E,
    standalone: impl FnOnce(&AgentClient, &dyn Progress) -> Result<T, E>,
) -> Result<T, E> {
    let progress = crate::progress::for_stderr();
    let client = client(state);
    let via = via_agent(&client, progress.as_ref());
    let result = if not_running(&via) {
        standalone(&client, progress.as_ref())
    } else {
        via.map_err(agent_error)
    };
    // Finish the bars before anything else is printed.
    drop(progress);
    result
}

/// A refusal (exit 3) as every command reports it: with `--json` the line
/// `{"outcome":"refused","error":E}`, and `cryo: SAID` on stderr.
pub fn refused(e: &str, said: &str, json: bool) -> u8 {
    if json {
        println!(
            "{}",
            serde_json::json!({ "outcome": "refused", "error": e })
        );
    }
    eprintln!("cryo: {said}");
    crate::exit::REFUSED
}

/// `report` as one JSON line with its `outcome` (`published`, `serving`, `parked`...).
pub fn print_outcome<T: serde::Serialize>(report: &T, outcome: &str) -> anyhow::Result<()> {
    let mut v = serde_json::to_value(report)?;
    v["outcome"] = outcome.into();
    println!("{v}");
    Ok(())
}

/// Whether `r` says that no agent runs (the cue to work standalone).
pub fn not_running<T>(r: &Result<T, ClientError>) -> bool {
    matches!(r, Err(ClientError::NotRunning(_)))
}

static SAID: AtomicBool = AtomicBool::new(false);

/// Says, once per command, that a change is made without an agent.
pub fn standalone_note(client: &AgentClient) {
    if !SAID.swap(true, Ordering::Relaxed) {
        eprintln!(
            "cryo: no agent answers on {}: working standalone; nothing guards restored workers (run `cryo agent run`)",
            client.socket().display()
        );
    }
}

/// The agent's error as the command's error (`anyhow`), with the agent's hint.
pub fn error(e: ClientError) -> anyhow::Error {
    match e {
        ClientError::Api(api) => anyhow::Error::new(AgentSaid(api)),
        e => anyhow::Error::new(e),
    }
}

/// An error the agent answered, printed with its hint.
#[derive(Debug, thiserror::Error)]
#[error("{}{}", .0.message, .0.hint.as_ref().map(|h| format!("; what to do: {h}")).unwrap_or_default())]
pub struct AgentSaid(pub cryo_api::ApiError);

/// `gpu` with its checkpoint-API calls made by the agent when one answers (NVML reads stay in
/// this process); `Ok(false)` when none runs and `gpu` is left as it is.
pub fn driver_through_agent(
    gpu: &mut cryo_gpu::Gpu,
    state: &StateDir,
) -> Result<bool, ClientError> {
    let client = client(state);
    match client.status() {
        Ok(_) => {
            gpu.driver = std::sync::Arc::new(cryo_api::AgentDriver::new(client));
            Ok(true)
        }
        Err(ClientError::NotRunning(_)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// How a long operation (freeze, thaw) ended without its result, through the agent or not.
pub enum Outcome {
    /// Refused before anything was done (exit 3), with why.
    Refused(String),
    /// Failed.
    Failed(anyhow::Error),
}

/// The agent's answer as an [`Outcome`]: its `refused` kind is a refusal.
pub fn outcome(e: ClientError) -> Outcome {
    match e {
        ClientError::Api(a) if a.kind == cryo_api::ErrorKind::Refused => {
            Outcome::Refused(a.message)
        }
        e => Outcome::Failed(error(e)),
    }
}
