//! How `cryo stop` shows a suspension under way: a bar per process on a terminal (bytes of device
//! memory moved by the checkpoint), plain lines otherwise (logs, pipes, CI).

use std::collections::HashMap;
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::Duration;

use cryo_lifecycle::Progress;
use cryo_proc::Pid;
use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use cryo_units::fmt_bytes;

/// The display for this stderr: bars on a terminal, lines otherwise.
pub fn for_stderr() -> Box<dyn Progress> {
    if std::io::stderr().is_terminal() {
        Box::new(Bars::new())
    } else {
        Box::new(Lines)
    }
}

/// One line per step on stderr.
#[derive(Debug)]
pub struct Lines;

impl Progress for Lines {
    fn begin(&self, pid: Pid, step: &'static str, total: u64) {
        if total > 0 {
            eprintln!("cryo: pid {pid}: {step} of {} started", fmt_bytes(total));
        }
    }
    fn advance(&self, _: Pid, _: u64) {}
    fn end(&self, pid: Pid, step: &'static str, ok: bool, detail: &str) {
        let verdict = if ok { "done" } else { "FAILED" };
        eprintln!("cryo: pid {pid}: {step} {verdict} ({detail})");
    }
    fn shows_advance(&self) -> bool {
        false
    }
}

/// A bar per process on stderr.
#[derive(Debug)]
pub struct Bars {
    multi: MultiProgress,
    bars: Mutex<HashMap<Pid, ProgressBar>>,
}

impl Bars {
    fn new() -> Self {
        Bars {
            multi: MultiProgress::with_draw_target(ProgressDrawTarget::stderr()),
            bars: Mutex::new(HashMap::new()),
        }
    }

    fn with_bar(&self, pid: Pid, f: impl FnOnce(&ProgressBar)) {
        // A poisoned lock only means another progress call panicked: drawing is not worth failing for.
        let mut bars = self
            .bars
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let bar = bars.entry(pid).or_insert_with(|| {
            let b = self.multi.add(ProgressBar::new_spinner());
            b.set_prefix(format!("pid {pid:<8}"));
            b.enable_steady_tick(Duration::from_millis(120));
            b
        });
        f(bar);
    }
}

fn spinner_style() -> ProgressStyle {
    ProgressStyle::with_template("{prefix} {spinner} {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_spinner())
}

fn bytes_style() -> ProgressStyle {
    ProgressStyle::with_template(
        "{prefix} {msg:<11} [{bar:32}] {bytes:>10}/{total_bytes:<10} {binary_bytes_per_sec}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| ProgressStyle::default_bar())
}

impl Progress for Bars {
    fn begin(&self, pid: Pid, step: &'static str, total: u64) {
        self.with_bar(pid, |b| {
            b.reset();
            if total > 0 {
                b.set_style(bytes_style());
                b.set_length(total);
                b.set_position(0);
            } else {
                b.set_style(spinner_style());
            }
            b.set_message(step);
        });
    }

    fn advance(&self, pid: Pid, done: u64) {
        self.with_bar(pid, |b| b.set_position(done));
    }

    fn end(&self, pid: Pid, step: &'static str, ok: bool, detail: &str) {
        self.with_bar(pid, |b| {
            if let Some(len) = b.length().filter(|_| ok) {
                b.set_position(len);
            }
            let verdict = if ok { "done" } else { "FAILED" };
            b.set_style(spinner_style());
            b.set_message(format!("{step} {verdict} ({detail})"));
            if step == "checkpoint" || !ok {
                b.finish();
            }
        });
    }
}

impl Drop for Bars {
    fn drop(&mut self) {
        let bars = self
            .bars
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for b in bars.values() {
            if !b.is_finished() {
                b.finish();
            }
        }
    }
}
