//! `cryo stop --self` (a container's preStop hook) and `cryo stop --pod NS/NAME`: the stop of
//! Kubernetes containers, which the agent resolves (`POST /v1/kube/stop`); this file builds the
//! request, shows progress, and reports.
//!
//! `--self` returns as soon as the stop's kill phase starts: every CUDA process of the container
//! is suspended and verified by then, and in a real container this process dies with its pid
//! namespace when the container's first process is killed (so waiting for the report would only
//! turn a safe stop into a failed preStop hook). Without an agent, `--self` stops its own cgroup
//! standalone (everything but itself), under `--deadline`, and returns at the first kill the same
//! way (the processes left are checkpointed and verified, or plain: whoever ends them now, the
//! kubelet included, ends them safely).

use anyhow::Context as _;
use cryo_api::{KubeStopReport, KubeStopRequest, KubeTarget};
use cryo_lifecycle::{Progress, Target};
use std::path::{Path, PathBuf};

use cryo_proc::{Cgroups, Pid, ProcHandle};

use super::stop::{exit_code, in_progress, print_text, standalone, DEFAULT_DEADLINE_MS};
use super::Context;
use crate::args::StopArgs;
use crate::{exit, route};

/// The request the arguments make.
pub fn request(args: &StopArgs) -> anyhow::Result<KubeStopRequest> {
    Ok(KubeStopRequest {
        what: match &args.pod {
            Some((namespace, name)) => KubeTarget::Pod {
                namespace: namespace.clone(),
                name: name.clone(),
                container: args.container.clone(),
            },
            None => KubeTarget::Caller,
        },
        lock_timeout_ms: args.timeout,
        lock_attempts: args.lock_attempts,
        verify_timeout_ms: args.verify_timeout,
        deadline_ms: args.deadline.filter(|ms| *ms > 0),
        shrink: args.shrink.shrink()?,
    })
}

/// Runs `cryo stop --self` or `--pod`; returns the exit code.
pub fn run(ctx: &Context, args: &StopArgs) -> anyhow::Result<u8> {
    let req = request(args)?;
    let client = route::client(&ctx.state);
    let progress = crate::progress::for_stderr();
    let result = if args.own_container {
        let own = ReturnAtKill(progress.as_ref());
        let r = client.kube_stop(&req, &own);
        if route::not_running(&r) {
            drop(progress);
            route::standalone_note(&client);
            return own_cgroup_standalone(ctx, args);
        }
        r
    } else {
        client.kube_stop(&req, progress.as_ref())
    };
    drop(progress);
    if let Err(cryo_api::ClientError::Api(e)) = &result {
        if e.kind == cryo_api::ErrorKind::Refused {
            // Nothing was done: the same exit status as a stop that refused.
            eprintln!("cryo: refused: {}", route::AgentSaid(e.clone()));
            return Ok(exit::REFUSED);
        }
    }
    let report = result
        .map_err(route::error)
        .with_context(|| match &req.what {
            KubeTarget::Caller => "stopping this container".to_owned(),
            KubeTarget::Pod {
                namespace, name, ..
            } => format!("stopping pod {namespace}/{name}"),
        })?;
    print_report(&report, args.json)
}

fn print_report(report: &KubeStopReport, json: bool) -> anyhow::Result<u8> {
    let code = report
        .containers
        .iter()
        .map(|c| exit_code(&c.report))
        .find(|c| *c != exit::SUCCESS)
        .unwrap_or(exit::SUCCESS);
    if json {
        println!("{}", serde_json::to_string(report)?);
        return Ok(code);
    }
    println!(
        "pod {}: deadline {} ms (from its grace period)",
        report.pod, report.deadline_ms
    );
    for c in &report.containers {
        println!("container {} ({}):", c.container, c.cgroup.display());
        print_text(&c.report, false);
    }
    Ok(code)
}

/// The progress shown, and the moment `--self` returns: the first kill (see the module docs).
struct ReturnAtKill<'a>(&'a dyn Progress);

impl Progress for ReturnAtKill<'_> {
    fn begin(&self, pid: Pid, step: &'static str, total: u64) {
        if step == "kill" {
            eprintln!(
                "cryo: every CUDA process of this container is suspended and verified; its processes are being ended (the outcome: the Pod's Events, `cryo timeline` on the node)"
            );
            println!("suspended; ending the container");
            std::process::exit(i32::from(exit::SUCCESS));
        }
        self.0.begin(pid, step, total);
    }
    fn advance(&self, pid: Pid, done: u64) {
        self.0.advance(pid, done);
    }
    fn end(&self, pid: Pid, step: &'static str, ok: bool, detail: &str) {
        self.0.end(pid, step, ok, detail);
    }
    fn shows_advance(&self) -> bool {
        self.0.shows_advance()
    }
}

/// The cgroup `--self` stops without an agent: the first of this process's v2 and v1 `pids`
/// cgroups that is not the root of its hierarchy. A root holds every process of the hierarchy:
/// inside a container with its own cgroup namespace that is the container, but in the host's it
/// is the whole host (a hybrid host leaves every process at the v2 root), which is refused.
fn container_cgroup(dirs: &Cgroups) -> anyhow::Result<PathBuf> {
    let candidates: Vec<PathBuf> = dirs
        .unified
        .iter()
        .cloned()
        .chain(dirs.v1("pids").map(Path::to_path_buf))
        .collect();
    for dir in &candidates {
        let root = cryo_proc::is_hierarchy_root(dir)
            .with_context(|| format!("reading cgroup {}", dir.display()))?;
        if !root {
            return Ok(dir.clone());
        }
    }
    let first = candidates
        .first()
        .context("this process's cgroup is in no v2 tree and no v1 pids hierarchy")?;
    if cryo_proc::ns::in_initial_cgroup_namespace()
        .context("reading this process's cgroup namespace")?
    {
        anyhow::bail!(
            "this process is at the root of its cgroup hierarchies ({}) in the host's cgroup \
             namespace: `--self` would stop every process of the host; nothing was done (run it \
             from a container's preStop hook, or name the target: cryo stop PID|--cgroup DIR)",
            first.display()
        );
    }
    Ok(first.clone())
}

/// No agent: this process's own cgroup (its container's, seen from inside), everything in it but
/// this process, under `--deadline`.
fn own_cgroup_standalone(ctx: &Context, args: &StopArgs) -> anyhow::Result<u8> {
    let me = ProcHandle::open(std::process::id() as Pid).context("opening this process")?;
    let dirs = me.cgroup_dirs().context("reading this process's cgroup")?;
    let dir = container_cgroup(&dirs)?;
    let deadline = args.deadline.unwrap_or(DEFAULT_DEADLINE_MS);
    let mut req = super::stop::request(args)?;
    req.target = (&Target::Cgroup(dir.clone())).into();
    req.deadline_ms = (deadline > 0).then_some(deadline);
    let progress = crate::progress::for_stderr();
    // The kubelet kills the container once this returns: a park or a wake at work is waited
    // for (within the deadline), never a reason to return with the worker unsuspended.
    let r = standalone(ctx, &req, Some(me), true, &ReturnAtKill(progress.as_ref()));
    drop(progress);
    let what = || format!("stopping this container (cgroup {})", dir.display());
    let report = match r {
        // A park, a wake, a freeze or a stop at work on one of its processes: nothing was done,
        // the exit status of `cryo stop`'s refusal and of the agent's (see `run`).
        Err(e) if in_progress(&e) => {
            eprintln!("cryo: refused: {}: {e}", what());
            return Ok(exit::REFUSED);
        }
        r => r.with_context(what)?,
    };
    let code = exit_code(&report);
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_text(&report, false);
    }
    Ok(code)
}
