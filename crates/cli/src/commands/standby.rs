//! `cryo standby`: the handlers. The pools live in the node agent (`/v1/standby`): a standby
//! needs an owner that outlives the command, refills the pool and reaps what it restored.

use anyhow::Context as _;
use cryo_api::{StandbyClaimRequest, StandbyCreateRequest, StandbyRemoveRequest};
use cryo_units::fmt_bytes;

use super::park::wake_spec;
use super::Context;
use crate::args::standby::{StandbyArgs, StandbyCommand};
use crate::exit;
use crate::route::{self, Outcome};

/// Runs `cryo standby ...`; returns the exit code.
pub fn run(ctx: &Context, args: &StandbyArgs) -> anyhow::Result<u8> {
    let client = route::client(&ctx.state);
    let need_agent = |e: cryo_api::ClientError| -> Outcome {
        if matches!(e, cryo_api::ClientError::NotRunning(_)) {
            Outcome::Failed(anyhow::anyhow!(
                "{e}: the standby pools live in the node agent; start it with `cryo agent run`"
            ))
        } else {
            route::outcome(e)
        }
    };
    let done = |r: Result<(), Outcome>, json: bool| -> anyhow::Result<u8> {
        match r {
            Ok(()) => Ok(exit::SUCCESS),
            Err(Outcome::Refused(e)) => {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({ "outcome": "refused", "error": e })
                    );
                }
                eprintln!("cryo: refused: {e}");
                Ok(exit::REFUSED)
            }
            Err(Outcome::Failed(e)) => Err(e),
        }
    };
    match &args.command {
        StandbyCommand::Create(a) => {
            let r = client
                .standby_create(&StandbyCreateRequest {
                    image: a.image.clone(),
                    count: a.count,
                    criu_timeout_s: a.criu_timeout,
                })
                .map_err(need_agent)
                .map(|p| {
                    if a.json {
                        println!("{}", serde_json::to_string(&p).unwrap_or_default());
                    } else {
                        println!(
                            "keeping {} standby(s) of {} ready ({} ready now; the agent restores the rest in the background)",
                            p.count,
                            p.image.display(),
                            p.ready.len()
                        );
                    }
                });
            done(r, a.json)
        }
        StandbyCommand::List(a) => {
            let list = client
                .standby_list()
                .map_err(route::error)
                .context("listing the standby pools")?;
            if a.json {
                println!("{}", serde_json::to_string(&list)?);
                return Ok(exit::SUCCESS);
            }
            if list.pools.is_empty() {
                println!("no standby pool");
            }
            for p in &list.pools {
                println!(
                    "{}: {} of {} ready, {} being restored{}",
                    p.image.display(),
                    p.ready.len(),
                    p.count,
                    p.refilling,
                    p.last_error
                        .as_ref()
                        .map(|e| format!("; last refill failed: {e}"))
                        .unwrap_or_default()
                );
                for s in &p.ready {
                    println!(
                        "  root pid {}: {} processes, {} of device memory held in {} of host memory",
                        s.root.pid,
                        s.pids.len(),
                        fmt_bytes(s.device_bytes),
                        fmt_bytes(s.host_bytes)
                    );
                }
            }
            Ok(exit::SUCCESS)
        }
        StandbyCommand::Claim(a) => {
            let req = StandbyClaimRequest {
                image: a.image.clone(),
                wake: wake_spec(&a.how),
            };
            let r = client.standby_claim(&req).map_err(need_agent).map(|c| {
                if a.json {
                    let mut v = serde_json::to_value(&c).unwrap_or_default();
                    v["outcome"] = "serving".into();
                    println!("{v}");
                } else {
                    println!(
                        "claimed the standby of {} (root pid {}): restore+guard+unlock {} ms, total {} ms",
                        c.standby.image.display(),
                        c.standby.root.pid,
                        c.wake.gpu_ms,
                        c.elapsed_ms
                    );
                }
            });
            done(r, a.json)
        }
        StandbyCommand::Remove(a) => {
            let r = client
                .standby_remove(&StandbyRemoveRequest {
                    image: a.image.clone(),
                })
                .map_err(need_agent)
                .map(|r| {
                    if a.json {
                        println!("{}", serde_json::to_string(&r).unwrap_or_default());
                    } else {
                        println!(
                            "removed the pool of {} ({} standby(s))",
                            a.image.display(),
                            r.removed.len()
                        );
                    }
                });
            done(r, a.json)
        }
    }
}
