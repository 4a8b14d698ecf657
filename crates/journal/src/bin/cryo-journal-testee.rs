//! Helper process for cryo-journal's integration tests only (`tests/processes.rs`): a journal
//! writer in a process of its own, so tests can kill it mid-append or race several of them.
//!
//! `cryo-journal-testee write DIR TAG COUNT LEN [unsynced]`: appends COUNT `Refused` records whose
//! reason is `TAG:N:LEN:` padded to LEN bytes, printing `acked SEQ` after each (`unsynced`: with
//! [`Journal::append_unsynced`], acked once written).
//! `cryo-journal-testee intent DIR`: journals the intents of a stop up to `CheckpointStarted`,
//! prints `ready`, and waits to be killed.
//! `cryo-journal-testee rotate DIR`: rotates the journal once, printing `rotated CARRIED LAST`
//! (or `empty`); with a rotation failpoint (`CRYO_FAILPOINT`) it stalls there until killed.
//!
//! A plain binary rather than the test binary re-executed into an ignored test: no test harness
//! between the test and the writer, and no ignored test.

use std::io::Write;
use std::process::ExitCode;

use cryo_journal::{Event, Journal, ProcId};

type Res<T> = Result<T, String>;

/// The reason text of the `n`th record of writer `tag` (the tests check it back).
fn reason(tag: &str, n: u64, len: usize) -> String {
    let fill = char::from(b'a' + (n % 26) as u8);
    let mut s = format!("{tag}:{n}:{len}:");
    let pad = len.saturating_sub(s.len());
    s.extend(std::iter::repeat_n(fill, pad));
    s
}

fn say(out: &mut impl Write, line: &str) -> Res<()> {
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .map_err(|e| format!("writing to stdout: {e}"))
}

fn open(dir: &str) -> Res<Journal> {
    Journal::open(dir).map_err(|e| format!("opening journal {dir}: {e}"))
}

fn run(args: &[String]) -> Res<()> {
    let me = ProcId::of(std::process::id() as i32).map_err(|e| e.to_string())?;
    let mut out = std::io::stdout().lock();
    match args {
        [mode, dir, tag, count, len, how @ ..] if mode == "write" => {
            let journal = open(dir)?;
            let count: u64 = count.parse().map_err(|_| format!("bad COUNT {count}"))?;
            let len: usize = len.parse().map_err(|_| format!("bad LEN {len}"))?;
            let unsynced = match how {
                [] => false,
                [u] if u == "unsynced" => true,
                _ => return Err(format!("bad mode {how:?}")),
            };
            for n in 0..count {
                let event = Event::Refused {
                    pid: me,
                    reason: reason(tag, n, len),
                    hint: String::new(),
                };
                let seq = if unsynced {
                    journal
                        .append_unsynced(vec![event])
                        .map(|r| r.last().map_or(0, |r| r.seq))
                } else {
                    journal.append(event).map(|r| r.seq)
                }
                .map_err(|e| format!("appending record {n}: {e}"))?;
                say(&mut out, &format!("acked {seq}"))?;
            }
            Ok(())
        }
        [mode, dir] if mode == "intent" => {
            let journal = open(dir)?;
            for e in [
                Event::StopRequested {
                    target: format!("pid {}", me.pid),
                },
                Event::LockStarted { pid: me },
                Event::Locked { pid: me, ms: 3 },
                Event::CheckpointStarted { pid: me },
            ] {
                journal
                    .append(e)
                    .map_err(|e| format!("appending an intent: {e}"))?;
            }
            say(&mut out, "ready")?;
            loop {
                std::thread::park();
            }
        }
        [mode, dir] if mode == "rotate" => {
            let journal = open(dir)?;
            match journal.rotate().map_err(|e| format!("rotating: {e}"))? {
                Some(r) => say(&mut out, &format!("rotated {} {}", r.carried, r.last_seq)),
                None => say(&mut out, "empty"),
            }
        }
        _ => Err(
            "usage: cryo-journal-testee write DIR TAG COUNT LEN [unsynced] | intent DIR | rotate DIR"
                .into(),
        ),
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cryo-journal-testee: {e}");
            ExitCode::FAILURE
        }
    }
}
