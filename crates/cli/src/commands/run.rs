//! `cryo run`: starts a worker in fresh pid and network namespaces
//! ([`cryo_proc::isolate::spawn_isolated`]), prints its pid, and waits for it unless detached.

use anyhow::Context as _;
use nix::sys::signal::{SigSet, Signal};

use crate::args::run::RunArgs;

/// `cryo run`.
pub fn run(args: &RunArgs) -> anyhow::Result<u8> {
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => std::env::current_dir().context("reading the working directory")?,
    };
    let cmd = cryo_proc::isolate::IsolatedCommand {
        argv: args.argv.clone(),
        dir,
        log: args.log.clone(),
    };
    // Blocked before the clone so that none is lost; the worker gets the mask back.
    let mut forward = SigSet::empty();
    for s in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        forward.add(s);
    }
    let old = forward.thread_swap_mask(nix::sys::signal::SigmaskHow::SIG_BLOCK)?;
    let pid = cryo_proc::isolate::spawn_isolated(&cmd, Some(&old))?;
    if args.json {
        println!("{}", serde_json::json!({ "pid": pid, "namespace_pid": 1 }));
    } else {
        println!("pid {pid} (pid 1 of its own pid and network namespaces)");
    }
    if args.detach {
        return Ok(crate::exit::SUCCESS);
    }
    // The worker is our child: reaped on a thread, which exits with its status; this thread
    // passes the signals on (through a pidfd opened while it cannot have been reaped).
    let reap = move || {
        use nix::sys::wait::{waitpid, WaitStatus};
        match waitpid(nix::unistd::Pid::from_raw(pid), None) {
            Ok(WaitStatus::Exited(_, code)) => code,
            Ok(WaitStatus::Signaled(_, sig, _)) => 128 + sig as i32,
            _ => 1,
        }
    };
    let Ok(handle) = cryo_proc::ProcHandle::open(pid) else {
        // It ended already (a zombie): nothing to pass signals on to.
        return Ok(u8::try_from(reap()).unwrap_or(1));
    };
    std::thread::spawn(move || std::process::exit(reap()));
    loop {
        if let Ok(sig) = forward.wait() {
            let _ = handle.signal(sig);
        }
    }
}
