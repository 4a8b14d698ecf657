//! Helper process for cryo-guard's integration tests only: victims to trace and a minimal guard.
//!
//! `cryo-guard-testee detach MODE...` starts `cryo-guard-testee MODE...` and exits at once, so
//! the victim is not a child of the test process (see the tracer's limitations).
//! `victim [single]`: prints `pid N`, `helper TID` (`helper 0` with `single`: no other thread,
//! a one-threaded process), `ready`, then runs commands read from stdin (`handle-term` installs
//! a SIGTERM handler that exits 0, as a server's graceful shutdown; `connect PATH` keeps a
//! close-on-exec connection to a unix socket, printing `fd N`; `exec PATH ARG` and
//! `thread-exec PATH ARG` replace the program from the main thread or from a new one,
//! printing `exec failed ERR` when it fails).
//! `guard PID [hold]`: traces PID, prints `attached`, then waits for stdin to close; with `hold`
//! its policy never answers a fatal signal (prints `held TID SIGNAL`).

use std::io::{BufRead, Write};
use std::os::fd::RawFd;
use std::process::{Command, ExitCode};
use std::sync::Arc;

use cryo_guard::{sys, Decision, ExitCause, FatalSignal, PinnedFds, Policy, Tracee, Tracer};
use cryo_proc::Pid;

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

extern "C" fn on_usr1(_: libc::c_int) {
    let msg = b"usr1\n";
    // SAFETY: write(2) is async-signal-safe; the buffer is a static byte string.
    unsafe { libc::write(1, msg.as_ptr().cast(), msg.len()) };
}

extern "C" fn on_term(_: libc::c_int) {
    // SAFETY: _exit(2) is async-signal-safe.
    unsafe { libc::_exit(0) };
}

fn set_term() {
    // SAFETY: sigaction is plain data; all-zero is no flags, empty mask.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = on_term as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: `act` is initialised; the handler only calls _exit(2).
    unsafe { libc::sigaction(libc::SIGTERM, &act, std::ptr::null_mut()) };
}

fn set_usr1(handler: libc::sighandler_t) {
    // SAFETY: sigaction is plain data; all-zero is no flags, empty mask.
    let mut act: libc::sigaction = unsafe { std::mem::zeroed() };
    act.sa_sigaction = handler;
    act.sa_flags = libc::SA_RESTART;
    // SAFETY: `act` is initialised; the handler only calls write(2).
    unsafe { libc::sigaction(libc::SIGUSR1, &act, std::ptr::null_mut()) };
}

/// A real fault: a read from a page mapped PROT_NONE.
fn fault() {
    // SAFETY: anonymous private mapping, no fd; checked below.
    let page = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_NONE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    assert_ne!(page, libc::MAP_FAILED);
    // SAFETY: not safe by design: the page is PROT_NONE and this read raises SIGSEGV.
    let v = unsafe { std::ptr::read_volatile(page.cast::<u8>()) };
    say(&format!("survived fault {v}"));
}

fn park_forever() -> ! {
    loop {
        std::thread::park();
    }
}

fn exec(path: &str, arg: Option<&str>) {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(path);
    cmd.args(arg);
    let err = cmd.exec();
    say(&format!("exec failed {err}"));
}

fn victim(single: bool) -> ExitCode {
    let no_core = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: a valid rlimit struct; failing only means a core file may be written.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
    say(&format!("pid {}", std::process::id()));
    set_usr1(on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t);
    let helper = if single {
        0
    } else {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(sys::gettid());
            park_forever();
        });
        rx.recv().unwrap_or(-1)
    };
    say(&format!("helper {helper}"));
    say("ready");
    let mut kept = Vec::new();
    for line in std::io::stdin().lock().lines() {
        let Ok(line) = line else { break };
        let mut words = line.split_whitespace();
        match words.next() {
            Some("ping") => say("pong"),
            Some("connect") => {
                use std::os::fd::AsRawFd;
                // std opens sockets with SOCK_CLOEXEC, as libcuda opens /dev/nvidia*.
                match std::os::unix::net::UnixStream::connect(words.next().unwrap_or("")) {
                    Ok(s) => {
                        say(&format!("fd {}", s.as_raw_fd()));
                        kept.push(s);
                    }
                    Err(e) => say(&format!("connect failed {e}")),
                }
            }
            Some("exec") => exec(words.next().unwrap_or(""), words.next()),
            Some("thread-exec") => {
                let path = words.next().unwrap_or("").to_string();
                let arg = words.next().map(str::to_string);
                let t = std::thread::spawn(move || exec(&path, arg.as_deref()));
                let _ = t.join();
            }
            Some("segv") => fault(),
            Some("abort") => std::process::abort(),
            Some("thread-segv") => {
                std::thread::spawn(|| {
                    say(&format!("tid {}", sys::gettid()));
                    fault();
                });
            }
            Some("thread") => {
                std::thread::spawn(|| {
                    say(&format!("tid {}", sys::gettid()));
                    park_forever();
                });
            }
            Some("child") => {
                let ok = Command::new("true").status().is_ok_and(|s| s.success());
                say(&format!("child done {ok}"));
            }
            Some("exit") => {
                let code = words.next().and_then(|w| w.parse().ok()).unwrap_or(1);
                std::process::exit(code);
            }
            Some("handle-term") => {
                set_term();
                say("ok");
            }
            Some("default-usr1") => {
                set_usr1(libc::SIG_DFL);
                say("ok");
            }
            Some("alloc") => {
                let mut hold: Vec<Vec<u8>> = Vec::new();
                loop {
                    hold.push(vec![1u8; 1 << 20]);
                }
            }
            _ => say("unknown"),
        }
    }
    ExitCode::SUCCESS
}

struct TestGuardPolicy {
    hold: bool,
}

impl Policy for TestGuardPolicy {
    fn on_fatal_signal(&self, _: &Tracee, signal: &FatalSignal) -> Decision {
        if self.hold {
            say(&format!("held {} {}", signal.tid, signal.signal));
            park_forever();
        }
        Decision::Deliver
    }
    fn fds_to_pin(&self, _: &Tracee) -> Vec<RawFd> {
        Vec::new()
    }
    fn on_exit_stop(&self, _: &Tracee, _: Pid, _: ExitCause, _: PinnedFds) {}
}

fn guard(pid: &str, hold: bool) -> ExitCode {
    let Ok(pid) = pid.parse::<Pid>() else {
        eprintln!("bad pid {pid}");
        return ExitCode::FAILURE;
    };
    let tracer = match Tracer::spawn(Arc::new(TestGuardPolicy { hold })) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::FAILURE;
        }
    };
    if let Err(e) = tracer.attach(pid) {
        eprintln!("{e}");
        return ExitCode::FAILURE;
    }
    say("attached");
    for _ in std::io::stdin().lock().lines() {}
    drop(tracer);
    ExitCode::SUCCESS
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("detach") => {
            let Ok(me) = std::env::current_exe() else {
                return ExitCode::FAILURE;
            };
            match Command::new(me).args(&args[2..]).spawn() {
                Ok(_) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("{e}");
                    ExitCode::FAILURE
                }
            }
        }
        Some("victim") => victim(args.get(2).is_some_and(|a| a == "single")),
        Some("guard") => guard(
            args.get(2).map_or("", String::as_str),
            args.get(3).is_some_and(|a| a == "hold"),
        ),
        _ => {
            eprintln!("usage: cryo-guard-testee detach|victim|guard PID [hold]");
            ExitCode::FAILURE
        }
    }
}
