//! `cryo stop`: the handler. The procedure itself is `cryo_lifecycle::stop`; this file turns the
//! arguments into a target and options, shows progress, and reports (text or JSON, exit codes).

use anyhow::Context as _;
use cryo_api::{SignalSpec, StopRequest};
use cryo_lifecycle::{ProcReport, StopReport, Target};
use serde::Serialize;

use super::Context;
use crate::args::{SignalArg, StopArgs};
use crate::exit;
use crate::route;
use cryo_units::fmt_bytes;

/// What `--json` prints: the lifecycle's report plus the verdict.
#[derive(Debug, Serialize)]
struct JsonReport<'a> {
    /// `stopped` or `refused`.
    outcome: &'static str,
    /// The exit code `cryo stop` returns.
    exit_code: u8,
    #[serde(flatten)]
    report: &'a StopReport,
}

/// `--deadline`'s default, ms: below Kubernetes' default grace period (30 s).
pub const DEFAULT_DEADLINE_MS: u64 = 25_000;

/// The target the arguments name.
pub fn target(args: &StopArgs) -> Target {
    match (&args.cgroup, args.pids.as_slice()) {
        (Some(path), _) => Target::Cgroup(path.clone()),
        (None, [one]) => Target::Tree(*one),
        (None, many) => Target::Pids(many.to_vec()),
    }
}

/// The request the arguments make: to the agent, or (through [`StopRequest::options`], the one
/// conversion to the lifecycle's options) to the standalone stop.
pub fn request(args: &StopArgs) -> anyhow::Result<StopRequest> {
    Ok(StopRequest {
        target: (&target(args)).into(),
        lock_timeout_ms: args.timeout,
        lock_attempts: args.lock_attempts,
        verify_timeout_ms: args.verify_timeout,
        signal: match args.signal {
            SignalArg::Kill => SignalSpec::Kill,
            SignalArg::Term => SignalSpec::Term {
                grace_s: args.grace,
            },
        },
        unsafe_kill: args.unsafe_kill,
        fresh: args.fresh,
        deadline_ms: match args.deadline.unwrap_or(DEFAULT_DEADLINE_MS) {
            0 => None,
            ms => Some(ms),
        },
        shrink: args.shrink.shrink()?,
    })
}

/// Runs `cryo stop`; returns the exit code (0 stopped, 3 refused).
pub fn run(ctx: &Context, args: &StopArgs) -> anyhow::Result<u8> {
    // Before any thread exists, so every thread of the command inherits the mask.
    let _deferred = crate::defer::termination();
    if args.own_container || args.pod.is_some() {
        return super::stop_kube::run(ctx, args);
    }
    let req = request(args)?;
    let target = req.target();
    let result = route::through_agent(
        &ctx.state,
        |client, p| client.stop(&req, p),
        route::error,
        |client, p| {
            route::standalone_note(client);
            standalone(ctx, &req, None, false, p)
        },
    );
    let result = match result {
        Err(e) if in_progress(&e) => {
            eprintln!("cryo: refused: stopping {}: {e}", describe(&target));
            return Ok(exit::REFUSED);
        }
        r => r,
    };
    let report = result.with_context(|| format!("stopping {}", describe(&target)))?;
    let code = exit_code(&report);
    if args.json {
        let outcome = if code == exit::SUCCESS {
            "stopped"
        } else {
            "refused"
        };
        println!(
            "{}",
            serde_json::to_string(&JsonReport {
                outcome,
                exit_code: code,
                report: &report
            })?
        );
    } else {
        print_text(&report, args.unsafe_kill);
    }
    Ok(code)
}

/// Whether a stop failed because a park, a wake, a freeze or another stop is at work on a process
/// of the target (it holds the process's lock; standalone, or the agent's refusal): refused at
/// once, nothing stopped, exit 3 as a park's or a wake's refusal for the same reason.
pub(crate) fn in_progress(e: &anyhow::Error) -> bool {
    matches!(
        e.downcast_ref::<cryo_lifecycle::StopError>(),
        Some(cryo_lifecycle::StopError::InProgress { .. })
    ) || e
        .downcast_ref::<route::AgentSaid>()
        .is_some_and(|a| a.0.kind == cryo_api::ErrorKind::Refused)
}

/// The stop in this process (no agent runs): what the agent's handler does too. `when_free`: a
/// park or a wake at work on the target is waited for within the deadline (a preStop's,
/// [`cryo_lifecycle::stop_when_free`]) rather than a refusal at once.
pub(crate) fn standalone(
    ctx: &Context,
    req: &StopRequest,
    spare: Option<cryo_proc::ProcHandle>,
    when_free: bool,
    progress: &dyn cryo_lifecycle::Progress,
) -> anyhow::Result<StopReport> {
    // Resolved once, here: a target that does not exist is the operator's first problem, before
    // any driver question, and the stop acts on exactly the processes found now.
    let mut resolved = req.target().resolve()?;
    if let Some(h) = spare {
        resolved.spare(h);
    }
    let gpu = ctx.gpu()?;
    let journal = ctx.state.open_journal().context("opening the journal")?;
    let stop = if when_free {
        cryo_lifecycle::stop_when_free
    } else {
        cryo_lifecycle::stop
    };
    Ok(stop(&gpu, &resolved, &req.options(), &journal, progress)?)
}

/// 0 when every process has ended, 3 when a refusal left some alive.
pub fn exit_code(report: &StopReport) -> u8 {
    if report.processes.iter().all(|p| p.ended) {
        exit::SUCCESS
    } else if !report.refusals.is_empty() {
        exit::REFUSED
    } else {
        exit::FAILURE
    }
}

pub(crate) fn print_text(report: &StopReport, unsafe_kill: bool) {
    if let Some(s) = &report.shrink {
        eprintln!("cryo: {}", s.summary());
    }
    // What earlier stops, freezes or guards left half-way, and what this stop did about it.
    for s in &report.settled {
        eprintln!("cryo: settled first: {s}");
    }
    for p in &report.processes {
        println!("{}", process_line(p, report.unsafe_kills.contains(&p.pid)));
    }
    for r in &report.refusals {
        eprintln!("cryo: refused: pid {}: {}", r.pid, r.reason.reason());
        eprintln!("cryo:   what to do: {}", r.hint);
    }
    let ended = report.processes.iter().filter(|p| p.ended).count();
    let total = report.processes.len();
    if !report.refusals.is_empty() && ended < total {
        let none = if ended == 0 {
            "nothing in the target was killed".to_string()
        } else {
            format!("{ended} of {total} processes had already ended")
        };
        eprintln!(
            "cryo: stop refused: {none}; every CUDA process is serving or checkpointed (safe)"
        );
    } else {
        if unsafe_kill && !report.unsafe_kills.is_empty() {
            eprintln!(
                "cryo: warning: --unsafe: pids {:?} were killed without being suspended",
                report.unsafe_kills
            );
        }
        println!("stopped {total} processes in {} ms", report.elapsed_ms);
    }
}

fn process_line(p: &ProcReport, unsuspended: bool) -> String {
    let origin = match p.restored {
        Some(true) => "restored",
        Some(false) => "fresh",
        None => "origin unknown (treated as restored)",
    };
    let mut steps = Vec::new();
    if let Some(s) = &p.suspended {
        steps.push(format!("was {}", s.state_before));
        if let Some(d) = s.lock {
            steps.push(format!("locked in {} ms", d.as_millis()));
        }
        if let Some(d) = s.checkpoint {
            steps.push(format!(
                "checkpointed {} in {} ms",
                fmt_bytes(s.device_memory),
                d.as_millis()
            ));
        }
        if let Some(d) = s.verify {
            steps.push(format!("NVML: no memory after {} ms", d.as_millis()));
        }
    } else if p.cuda && unsuspended {
        steps.push("killed without suspension".to_string());
    }
    steps.extend(p.notes.iter().cloned());
    steps.push(if p.ended {
        "ended".to_string()
    } else {
        "still running".to_string()
    });
    let kind = if p.cuda {
        format!("CUDA, {origin}")
    } else {
        "no CUDA context".to_string()
    };
    format!(
        "pid {:<8} {:<16} {kind}: {}",
        p.pid,
        p.comm,
        steps.join(", ")
    )
}

fn describe(target: &Target) -> String {
    match target {
        Target::Tree(p) => format!("the process tree of pid {p}"),
        Target::Cgroup(p) => format!("cgroup {}", p.display()),
        Target::Pids(p) => format!("pids {p:?}"),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use std::time::Duration;

    use cryo_lifecycle::EndSignal;

    use super::*;
    use crate::args::{Cli, Command};

    fn stop_args(argv: &[&str]) -> StopArgs {
        let cli = Cli::try_parse_from(argv).unwrap();
        let Command::Stop(a) = cli.command else {
            panic!("not stop")
        };
        a
    }

    #[test]
    fn one_pid_is_a_tree_several_are_exact() {
        assert_eq!(
            target(&stop_args(&["cryo", "stop", "12"])),
            Target::Tree(12)
        );
        assert_eq!(
            target(&stop_args(&["cryo", "stop", "12", "13"])),
            Target::Pids(vec![12, 13])
        );
        assert_eq!(
            target(&stop_args(&[
                "cryo",
                "stop",
                "--cgroup",
                "/sys/fs/cgroup/x"
            ])),
            Target::Cgroup("/sys/fs/cgroup/x".into())
        );
    }

    #[test]
    fn defaults_and_term() {
        let o = request(&stop_args(&["cryo", "stop", "1"]))
            .unwrap()
            .options();
        assert!(o.shrink.is_none());
        assert_eq!(o.suspend.lock_timeout, Duration::from_secs(30));
        assert_eq!(o.suspend.lock_attempts, 3);
        assert_eq!(o.signal, EndSignal::Kill);
        assert!(!o.unsafe_kill && !o.fresh && !o.suspend.resume_on_failure);
        // Below Kubernetes' default grace period (30 s), and the library's default.
        assert_eq!(o.deadline, Some(cryo_lifecycle::stop::DEFAULT_DEADLINE));
        assert!(o.deadline < Some(Duration::from_secs(30)));
        assert_eq!(
            request(&stop_args(&["cryo", "stop", "1", "--deadline", "0"]))
                .unwrap()
                .options()
                .deadline,
            None
        );
        let o = request(&stop_args(&[
            "cryo", "stop", "1", "--signal", "TERM", "--grace", "1",
        ]))
        .unwrap()
        .options();
        assert_eq!(
            o.signal,
            EndSignal::Term {
                grace: Duration::from_secs(1)
            }
        );
    }

    #[test]
    fn bad_command_lines_are_usage_errors() {
        for bad in [
            &["cryo", "stop"][..],
            &["cryo", "stop", "0"],
            &["cryo", "stop", "1", "--cgroup", "/x"],
            &["cryo", "stop", "1", "--signal", "HUP"],
            &["cryo", "stop", "1", "--lock-attempts", "0"],
            &["cryo", "stop", "1", "--timeout", "0"],
            &["cryo", "stop", "1", "--shrink", "vllm:3"],
            &["cryo", "stop", "1", "--shrink", "sglang:attention"],
        ] {
            assert!(Cli::try_parse_from(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_shrink_goes_into_the_request_and_vllm_needs_the_engine() {
        let err = request(&stop_args(&["cryo", "stop", "1", "--shrink", "vllm"]))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(err.contains("--engine-url"), "{err}");
        let o = request(&stop_args(&[
            "cryo",
            "stop",
            "1",
            "--shrink",
            "vllm:2",
            "--engine-url",
            "http://127.0.0.1:8000",
            "--shrink-timeout",
            "2500",
        ]))
        .unwrap()
        .options();
        let s = o.shrink.unwrap();
        assert_eq!(s.spec, cryo_lifecycle::ShrinkSpec::Vllm { level: 2 });
        assert_eq!(s.timeout(), Duration::from_millis(2500));
    }
}
