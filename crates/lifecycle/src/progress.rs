//! Progress of long operations, rendered by the caller (a bar on a terminal, lines otherwise).

use cryo_proc::Pid;

/// Receives progress of a suspension. Called from worker threads.
pub trait Progress: Sync {
    /// `pid` starts a step (`"lock"`, `"checkpoint"`, ...) that moves `total` bytes (0 if unknown).
    fn begin(&self, pid: Pid, step: &'static str, total: u64);
    /// `done` of `total` bytes moved so far.
    fn advance(&self, pid: Pid, done: u64);
    /// The step ended; `ok` tells whether it succeeded, `detail` is a short human summary.
    fn end(&self, pid: Pid, step: &'static str, ok: bool, detail: &str);
    /// Whether [`Progress::advance`] goes anywhere. When it does not, a step that would sample
    /// its progress (a checkpoint: a thread beside the driver call reading the process's
    /// memory) makes its call on the calling thread: one thread and one wake-up less between
    /// the driver's answer and the next step, which a loaded host charges in scheduling delay.
    fn shows_advance(&self) -> bool {
        true
    }
}

/// The steps this crate names, by the literals it passes to [`Progress`] and journals.
pub const STEPS: &[&str] = &[
    "lock",
    "checkpoint",
    "verify",
    "restore",
    "unlock",
    "kill",
    "dump",
    "publish",
    "criu restore",
    "gpu restore",
    "shrink",
    "grow",
];

/// A step's name received from elsewhere (the agent streams progress and reports to the CLI)
/// as the `&'static str` the [`Progress`] trait and the reports carry: the literal of a known
/// step, else the name leaked (a client reads one answer per command, so a few names at most).
pub fn step_literal(name: String) -> &'static str {
    STEPS
        .iter()
        .find(|k| **k == name)
        .copied()
        .unwrap_or_else(|| Box::leak(name.into_boxed_str()))
}

/// Discards progress.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoProgress;

impl Progress for NoProgress {
    fn begin(&self, _: Pid, _: &'static str, _: u64) {}
    fn advance(&self, _: Pid, _: u64) {}
    fn end(&self, _: Pid, _: &'static str, _: bool, _: &str) {}
    fn shows_advance(&self) -> bool {
        false
    }
}

/// The time spent in each step of one operation, in order, ms (for reports and benchmarks:
/// `cryo bench activate` breaks a standby's claim down with it).
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Phases(pub Vec<(String, f64)>);

impl Phases {
    /// The phases named `name` (summed).
    pub fn get(&self, name: &str) -> f64 {
        self.0
            .iter()
            .filter(|(n, _)| n == name)
            .map(|(_, ms)| ms)
            .sum()
    }
}

/// Times consecutive phases: [`Stopwatch::mark`] ends one.
#[derive(Debug, Clone)]
pub struct Stopwatch {
    last: std::time::Instant,
    /// What was marked so far.
    pub phases: Phases,
}

impl Default for Stopwatch {
    fn default() -> Self {
        Stopwatch {
            last: std::time::Instant::now(),
            phases: Phases::default(),
        }
    }
}

impl Stopwatch {
    /// Ends the phase `name` (it began at the last mark, or at the start).
    pub fn mark(&mut self, name: &str) {
        let now = std::time::Instant::now();
        let ms = now.duration_since(self.last).as_secs_f64() * 1e3;
        self.last = now;
        self.phases.0.push((name.to_string(), ms));
    }
}
