//! Helper process for cryo-holder's integration tests only (the product runs the holder as
//! `cryo guard holder`).
//!
//! - `serve STATE_DIR [--detach] [--take-over] [--cgroup stay|auto|ROOT:NAME]`: runs a holder;
//!   prints its `HolderInfo` as one JSON line once it serves (with `--detach`, then exits).
//! - `connect-as UID STATE_DIR`: drops to `UID` and asks the holder for its inventory; prints
//!   `ok` or the error.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use cryo_holder::launch::{self, DetachError, EXIT_ALREADY_RUNNING};
use cryo_holder::{CgroupChoice, HolderClient};
use cryo_state::StateDir;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("serve") => serve(&args[1..]),
        Some("connect-as") => connect_as(&args[1..]),
        _ => {
            eprintln!("usage: cryo-holder-testee serve|connect-as ...");
            ExitCode::from(2)
        }
    }
}

fn serve(args: &[String]) -> ExitCode {
    let Some(dir) = args.first() else {
        return ExitCode::from(2);
    };
    let state = StateDir::new(PathBuf::from(dir));
    let mut detach = false;
    let mut take_over = false;
    let mut cgroup = CgroupChoice::Stay;
    let mut rest = args[1..].iter();
    while let Some(a) = rest.next() {
        match a.as_str() {
            "--detach" => detach = true,
            "--take-over" => take_over = true,
            "--cgroup" => {
                cgroup = match rest.next().map(String::as_str) {
                    Some("stay") => CgroupChoice::Stay,
                    Some("auto") => CgroupChoice::Auto,
                    Some(spec) => match spec.split_once(':') {
                        Some((root, name)) => CgroupChoice::Under {
                            root: root.into(),
                            name: name.into(),
                        },
                        None => return ExitCode::from(2),
                    },
                    None => return ExitCode::from(2),
                }
            }
            _ => return ExitCode::from(2),
        }
    }
    if detach {
        return match launch::detach(&state, &cgroup, take_over) {
            Ok(info) => {
                say(&serde_json::to_string(&info).unwrap_or_default());
                ExitCode::SUCCESS
            }
            Err(DetachError::AlreadyRunning(m)) => {
                eprintln!("{m}");
                ExitCode::from(EXIT_ALREADY_RUNNING as u8)
            }
            Err(e) => {
                eprintln!("{e}");
                ExitCode::FAILURE
            }
        };
    }
    let err = launch::run_foreground(&state, &cgroup, take_over, |info| {
        say(&serde_json::to_string(info).unwrap_or_default());
    });
    eprintln!("{err}");
    match err {
        cryo_holder::server::ServeError::AlreadyRunning(_) => {
            ExitCode::from(EXIT_ALREADY_RUNNING as u8)
        }
        _ => ExitCode::FAILURE,
    }
}

fn connect_as(args: &[String]) -> ExitCode {
    let (Some(uid), Some(dir)) = (args.first(), args.get(1)) else {
        return ExitCode::from(2);
    };
    let Ok(uid) = uid.parse::<u32>() else {
        return ExitCode::from(2);
    };
    if let Err(e) = nix::unistd::setuid(nix::unistd::Uid::from_raw(uid)) {
        say(&format!("setuid: {e}"));
        return ExitCode::FAILURE;
    }
    match HolderClient::new(&StateDir::new(PathBuf::from(dir))).inventory() {
        Ok(_) => say("ok"),
        Err(e) => say(&format!("{e}")),
    }
    ExitCode::SUCCESS
}
