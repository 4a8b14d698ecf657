//! `cryo demo`: the checkpoint/restore cycle on a simulated GPU, step by step, with timings.
//!
//! # Design
//! Always the simulated GPU, even on a host with a real one: the demo starts its own driver
//! daemon (`cryo sim driver`) and sim worker (`cryo sim worker`) as child processes of this binary
//! in a temporary directory, so it needs nothing installed and touches nothing else. The demo is
//! a list of [`Step`]s run in order over one [`Demo`] state; later issues add steps (freeze, thaw)
//! by appending to [`steps`]. The restore is journaled in a state directory of the demo's own, the
//! worker is ended by `cryo stop` (in-process), and the journal is printed as `cryo timeline`
//! would at the end. A step that fails ends the demo with an error and a
//! non-zero exit; the children are suspended (if live) and killed on the way out.
//!
//! # Limitations
//! The worker's device memory lives in the daemon's heap: `--memory` is bounded by host memory.

mod http;

use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _};
use cryo_criu::Criu as _;
use cryo_gpu::{Gpu, ProcessState};
use cryo_proc::Pid;
use cryo_sim::SimControl;

use cryo_proc::ProcHandle;
use cryo_state::StateDir;
use cryo_units::fmt_bytes;

use crate::args::DemoArgs;
use crate::private_sim::{private_exe, retire, DriverOptions, PrivateSim, WorkerOptions};

/// One step: a title and what it does; it returns the line to show.
pub struct Step {
    /// Shown on the left.
    pub title: &'static str,
    /// The work.
    pub run: fn(&mut Demo) -> anyhow::Result<String>,
}

/// The steps, in order.
pub fn steps() -> Vec<Step> {
    vec![
        Step {
            title: "start simulated GPU",
            run: Demo::start_driver,
        },
        Step {
            title: "start sim worker",
            run: Demo::start_worker,
        },
        Step {
            title: "ask a completion",
            run: Demo::ask_first,
        },
        Step {
            title: "NVML view",
            run: Demo::nvml_present,
        },
        Step {
            title: "lock",
            run: |d| d.transition(ProcessState::Locked),
        },
        Step {
            title: "checkpoint",
            run: |d| d.transition(ProcessState::Checkpointed),
        },
        Step {
            title: "NVML view",
            run: Demo::nvml_gone,
        },
        Step {
            title: "restore",
            run: |d| d.transition(ProcessState::Locked),
        },
        Step {
            title: "unlock",
            run: |d| d.transition(ProcessState::Running),
        },
        Step {
            title: "NVML view",
            run: Demo::nvml_present,
        },
        Step {
            title: "ask again",
            run: Demo::ask_again,
        },
        Step {
            title: "cryo freeze",
            run: Demo::freeze,
        },
        Step {
            title: "cryo thaw",
            run: Demo::thaw,
        },
        Step {
            title: "ask after thaw",
            run: Demo::ask_again,
        },
        Step {
            title: "cryo stop",
            run: Demo::stop,
        },
        Step {
            title: "wedge ledger",
            run: Demo::ledger_empty,
        },
    ]
}

/// Runs the demo; `cryo` is the binary its simulated driver and worker run from.
pub fn run(args: &DemoArgs, cryo: &Path) -> anyhow::Result<()> {
    let tmp = tempfile::Builder::new()
        .prefix("cryo-demo-")
        .tempdir()
        .context("creating the demo's directory")?;
    let mut demo = Demo::new(tmp.path().to_path_buf(), args.memory, cryo);
    println!("cryo demo: checkpoint and restore of an inference worker, on the simulated GPU");
    println!(
        "(the demo always uses a simulated driver and worker of its own, in {})",
        tmp.path().display()
    );
    let total = Instant::now();
    let mut result = Ok(());
    for (i, step) in steps().into_iter().enumerate() {
        let start = Instant::now();
        match (step.run)(&mut demo) {
            Ok(line) => println!(
                "{:>3}. {:<19} {:<58} {:>9}",
                i + 1,
                step.title,
                line,
                fmt_duration(start.elapsed())
            ),
            Err(e) => {
                println!("{:>3}. {:<20} FAILED", i + 1, step.title);
                result = Err(e.context(format!("demo step {} ({})", i + 1, step.title)));
                break;
            }
        }
    }
    if result.is_ok() {
        match demo.timeline() {
            Ok(t) => {
                println!(
                    "timeline (cryo timeline --state-dir {}):",
                    demo.state.root().display()
                );
                print!("{t}");
            }
            Err(e) => result = Err(e),
        }
    }
    demo.shut_down();
    if args.keep {
        let kept = tmp.keep();
        println!(
            "kept {} (driver.log, worker.log, ledger.jsonl, state/journal)",
            kept.display()
        );
    }
    result?;
    println!("done in {}: the worker came back with the same answers, and no live restored context was torn down", fmt_duration(total.elapsed()));
    Ok(())
}

/// What the steps share.
pub struct Demo {
    dir: PathBuf,
    /// The demo's own state directory (`DIR/state`): its journal.
    state: StateDir,
    /// The `cryo` binary.
    cryo: PathBuf,
    memory: u64,
    driver: Option<PrivateSim>,
    gpu: Option<Gpu>,
    worker: Option<Child>,
    pid: Pid,
    port: u16,
    prompt: String,
    first_answer: Option<String>,
    /// The worker came back from `cryo thaw`: our child (CRIU's `rst_sibling`), but no `Child`.
    thawed: bool,
}

impl Demo {
    fn new(dir: PathBuf, memory: u64, cryo: &Path) -> Self {
        Demo {
            state: StateDir::new(dir.join("state")),
            cryo: cryo.to_path_buf(),
            dir,
            memory,
            driver: None,
            gpu: None,
            worker: None,
            pid: 0,
            port: 0,
            prompt: "The capital of France is".to_string(),
            first_answer: None,
            thawed: false,
        }
    }

    fn gpu(&self) -> anyhow::Result<&Gpu> {
        self.gpu
            .as_ref()
            .ok_or_else(|| anyhow!("the simulated GPU is not started"))
    }

    fn start_driver(&mut self) -> anyhow::Result<String> {
        let exe = self.cryo.clone();
        // Room for the worker on one GPU, whatever --memory says.
        let gpu_memory = (self.memory * 2).max(16 << 30);
        let sim = PrivateSim::start(
            &self.dir,
            &DriverOptions {
                exe: &exe,
                gpus: None,
                gpu_memory: gpu_memory.to_string(),
                log: true,
            },
        )?;
        let pid = sim.pid();
        self.driver = Some(sim);
        let gpu = cryo_sim::connect(&self.dir).context("connecting to the simulated GPU")?;
        let gpus = gpu.inspect.gpus().context("listing the simulated GPUs")?;
        self.gpu = Some(gpu);
        Ok(format!(
            "driver pid {pid}, {} GPUs of {} each",
            gpus.len(),
            gpus.first()
                .map_or("?".into(), |g| fmt_bytes(g.memory_total))
        ))
    }

    fn start_worker(&mut self) -> anyhow::Result<String> {
        // A private copy of the binary (CRIU refuses to restore a process whose executable changed
        // on disk), in its own session (CRIU dumps a tree that leads its session).
        let exe = private_exe(&self.cryo, &self.dir, "cryo-worker", "the worker's binary")?;
        let driver = self
            .driver
            .as_ref()
            .context("the simulated GPU is not started")?;
        // Filling several GiB of device memory takes a while.
        let w = driver.spawn_worker(&WorkerOptions {
            exe: &exe,
            setsid: true,
            gpu: Some(0),
            memory: self.memory,
            kv_cache: 0,
            http_unix: None,
            ready: self.dir.join("worker.ready"),
            log: Some(self.dir.join("worker.log")),
            timeout: Duration::from_secs(300),
        })?;
        self.pid = w.pid;
        let port = w.tcp_port();
        self.worker = Some(w.child);
        self.port = port?;
        Ok(format!(
            "pid {} on 127.0.0.1:{}, {} of device memory on GPU 0",
            self.pid,
            self.port,
            fmt_bytes(self.memory)
        ))
    }

    fn complete(&self) -> anyhow::Result<String> {
        // The sim worker takes the raw body as the prompt.
        let answer = http::request(
            self.port,
            "POST",
            "/v1/completions",
            &self.prompt,
            Duration::from_secs(30),
        )?;
        Ok(completion_text(&answer))
    }

    fn ask_first(&mut self) -> anyhow::Result<String> {
        let text = self.complete()?;
        let line = format!("{:?} -> {:?}", self.prompt, ellipsis(&text, 24));
        self.first_answer = Some(text);
        Ok(line)
    }

    fn ask_again(&mut self) -> anyhow::Result<String> {
        let text = self.complete()?;
        let first = self
            .first_answer
            .as_deref()
            .context("no first answer to compare with")?;
        ensure!(
            text == first,
            "the restored worker answers {text:?}, not {first:?} as before"
        );
        let verify = http::request(self.port, "GET", "/verify", "", Duration::from_secs(300))?;
        let v: serde_json::Value = serde_json::from_str(&verify)
            .with_context(|| format!("reading /verify's answer {verify:?}"))?;
        ensure!(
            v["ok"] == serde_json::Value::Bool(true),
            "device memory differs from what it was: {verify}"
        );
        Ok(format!(
            "{:?}: same answer, memory verified",
            ellipsis(&text, 24)
        ))
    }

    fn nvml_present(&mut self) -> anyhow::Result<String> {
        let mem = self
            .gpu()?
            .inspect
            .process_memory(self.pid)
            .context("querying device memory")?;
        let mem = mem.with_context(|| format!("NVML does not list pid {}", self.pid))?;
        Ok(format!(
            "pid {} holds {} of device memory",
            self.pid,
            fmt_bytes(mem)
        ))
    }

    fn nvml_gone(&mut self) -> anyhow::Result<String> {
        let gpu = self.gpu()?;
        if let Some(mem) = gpu
            .inspect
            .process_memory(self.pid)
            .context("querying device memory")?
        {
            bail!("NVML still lists pid {} with {}", self.pid, fmt_bytes(mem));
        }
        let free = gpu
            .inspect
            .gpus()
            .context("listing GPUs")?
            .first()
            .map_or(0, |g| g.memory_free);
        Ok(format!(
            "pid {} is gone from the GPU (GPU 0 free: {})",
            self.pid,
            fmt_bytes(free)
        ))
    }

    /// One driver call, the one that leads from the current state to `to`.
    fn transition(&mut self, to: ProcessState) -> anyhow::Result<String> {
        let gpu = self.gpu()?;
        let pid = self.pid;
        let from = gpu.driver.state(pid).context("reading the state")?;
        let r = match (from, to) {
            (ProcessState::Running, ProcessState::Locked) => {
                gpu.driver.lock(pid, Some(Duration::from_secs(30)))
            }
            (ProcessState::Locked, ProcessState::Checkpointed) => gpu.driver.checkpoint(pid),
            (ProcessState::Checkpointed, ProcessState::Locked) => {
                let r = gpu.driver.restore(pid, &[]);
                if r.is_ok() {
                    let handle = ProcHandle::open(pid)?;
                    cryo_lifecycle::record_restored(&self.state, &handle, "cryo demo")
                        .context("journaling the restore")?;
                }
                r
            }
            (ProcessState::Locked, ProcessState::Running) => gpu.driver.unlock(pid),
            _ => bail!("no single driver call leads from {from} to {to}"),
        };
        r?;
        let now = gpu.driver.state(pid).context("reading the state")?;
        ensure!(now == to, "pid {pid} is {now}, expected {to}");
        Ok(match to {
            ProcessState::Checkpointed => format!(
                "{from} -> {now} ({} moved into the worker)",
                fmt_bytes(self.memory)
            ),
            _ if from == ProcessState::Checkpointed => {
                format!("{from} -> {now} ({} back on GPU 0)", fmt_bytes(self.memory))
            }
            _ => format!("{from} -> {now}"),
        })
    }

    /// The safe teardown of a restored worker, as operators run it: `cryo stop` (lock, checkpoint,
    /// NVML shows no memory, then SIGKILL), journaled.
    fn stop(&mut self) -> anyhow::Result<String> {
        let gpu = self.gpu()?.clone();
        let pid = self.pid;
        let journal = self
            .state
            .open_journal()
            .context("opening the demo's journal")?;
        let tree = cryo_lifecycle::Target::Tree(pid)
            .resolve()
            .context("cryo stop")?;
        let report = cryo_lifecycle::stop(
            &gpu,
            &tree,
            &cryo_lifecycle::StopOptions::default(),
            &journal,
            &cryo_lifecycle::NoProgress,
        )
        .context("cryo stop")?;
        if let Some(r) = report.refusals.first() {
            bail!(
                "cryo stop refused pid {}: {} ({})",
                r.pid,
                r.reason.reason(),
                r.hint
            );
        }
        ensure!(
            report.stopped(),
            "cryo stop left processes running: {:?}",
            report.processes
        );
        let signal = self.reap_worker()?;
        ensure!(
            signal == Some(9),
            "the worker ended with signal {signal:?}, not by SIGKILL"
        );
        let p = report
            .processes
            .iter()
            .find(|p| p.pid == pid)
            .context("the worker is not in the stop's report")?;
        let s = p
            .suspended
            .as_ref()
            .context("the worker was not suspended")?;
        Ok(format!(
            "restored: {}; lock + checkpoint, NVML: no memory after {} ms, SIGKILL",
            match p.restored {
                Some(true) => "yes (journal)",
                Some(false) => "no",
                None => "unknown",
            },
            s.verify.map_or(0, |d| d.as_millis())
        ))
    }

    /// `cryo freeze`: suspend, CRIU dump, publish the image; the worker is gone afterwards.
    fn freeze(&mut self) -> anyhow::Result<String> {
        // CRIU's private directories under the demo's state directory, as `cryo freeze` puts
        // them: a demo killed mid-dump leaves nothing in /tmp.
        let criu = cryo_criu::CriuRpc::locate(None)
            .context(
                "the freeze and thaw steps need root and CRIU >= 4.2 (scripts/install-criu.sh)",
            )?
            .in_scratch(&self.state.criu_dir());
        let gpu = self.gpu()?.clone();
        let journal = self
            .state
            .open_journal()
            .context("opening the demo's journal")?;
        let opts = cryo_lifecycle::FreezeOptions {
            image: self.dir.join("image"),
            leave_running: false,
            replace: false,
            suspend: cryo_lifecycle::SuspendOptions::default(),
            shrink: None,
        };
        let tree = cryo_lifecycle::Target::Tree(self.pid)
            .resolve()
            .context("cryo freeze")?;
        let r = cryo_lifecycle::freeze(
            &gpu,
            &criu,
            &tree,
            &opts,
            &journal,
            &cryo_lifecycle::NoWatcher,
            &cryo_lifecycle::NoProgress,
        )
        .context("cryo freeze")?;
        // CRIU ended the (suspended) worker after the dump, and the freeze reaped our child.
        drop(self.worker.take());
        Ok(format!(
            "image of {} (CRIU {}), suspend {} ms, dump {} ms, publish {} ms",
            fmt_bytes(r.manifest.total_bytes),
            criu.version(),
            r.suspend_ms,
            r.dump_ms,
            r.publish_ms
        ))
    }

    /// `cryo thaw`: verify, precheck, CRIU restore, GPU restore, unlock, health check.
    fn thaw(&mut self) -> anyhow::Result<String> {
        let criu = cryo_criu::CriuRpc::locate(None)
            .context("the thaw step needs CRIU")?
            .in_scratch(&self.state.criu_dir());
        let gpu = self.gpu()?.clone();
        let journal = self
            .state
            .open_journal()
            .context("opening the demo's journal")?;
        let opts = cryo_lifecycle::ThawOptions {
            gpu_map: Vec::new(),
            health: Some(cryo_lifecycle::HealthCheck::Url(format!(
                "http://127.0.0.1:{}/health",
                self.port
            ))),
            health_timeout: Duration::from_secs(60),
            stop: cryo_lifecycle::StopOptions::default(),
            requested: Instant::now(),
            shrunk: None,
            criu_timeout: None,
        };
        let r = cryo_lifecycle::thaw(
            &gpu,
            &criu,
            &self.dir.join("image"),
            &opts,
            &journal,
            &self.state.fence(),
            &cryo_lifecycle::NoWatcher,
            &cryo_lifecycle::NoProgress,
        )
        .context("cryo thaw")?;
        self.thawed = true;
        ensure!(
            r.root_pid == self.pid,
            "thawed as pid {}, not {}",
            r.root_pid,
            self.pid
        );
        Ok(format!(
            "pid {} back, criu {} ms, GPU {} ms, first answer {} ms after the request",
            r.root_pid,
            r.criu_ms,
            r.gpu_restore_ms,
            r.first_answer_ms.unwrap_or(0)
        ))
    }

    /// Waits for the worker to end; the signal that ended it.
    fn reap_worker(&mut self) -> anyhow::Result<Option<i32>> {
        if let Some(mut w) = self.worker.take() {
            let status = w.wait().context("waiting for the worker")?;
            return Ok(status.signal());
        }
        ensure!(self.thawed, "no worker to reap");
        self.thawed = false;
        let pid = rustix::process::Pid::from_raw(self.pid).context("bad pid")?;
        let status = rustix::process::waitpid(Some(pid), rustix::process::WaitOptions::empty())
            .context("waiting for the thawed worker")?
            .context("no status for the thawed worker")?;
        Ok(status
            .terminating_signal()
            .and_then(|s| i32::try_from(s).ok()))
    }

    /// The journal of the demo, as `cryo timeline` prints it.
    fn timeline(&self) -> anyhow::Result<String> {
        let scan = self
            .state
            .read_journal()
            .context("reading the demo's journal")?;
        Ok(cryo_journal::render_timeline(
            &scan.records,
            &cryo_journal::Filter::default(),
        ))
    }

    fn ledger_empty(&mut self) -> anyhow::Result<String> {
        // One round trip, so the daemon has handled every teardown it saw before this.
        SimControl::new(&self.dir).wait_up(Duration::from_secs(5))?;
        let wedges = SimControl::new(&self.dir)
            .ledger()
            .context("reading the wedge ledger")?;
        if let Some(w) = wedges.first() {
            bail!(
                "{} wedge(s) recorded: pid {} on GPU {} ({})",
                wedges.len(),
                w.pid,
                w.gpu_index,
                w.death
            );
        }
        Ok("empty: no live restored context was torn down".to_string())
    }

    /// Ends the children: a live worker is suspended first, as the invariant demands.
    fn shut_down(&mut self) {
        if self.thawed && self.worker.is_none() {
            self.thawed = false;
            let target = cryo_lifecycle::Target::Pids(vec![self.pid]).resolve();
            if let (Some(gpu), Ok(journal), Ok(target)) =
                (&self.gpu, self.state.open_journal(), target)
            {
                // Suspend-before-kill; if it refuses, the worker is left alive (and safe).
                let _ = cryo_lifecycle::stop(
                    gpu,
                    &target,
                    &cryo_lifecycle::StopOptions::default(),
                    &journal,
                    &cryo_lifecycle::NoProgress,
                );
            }
            let _ = self.reap_worker();
        }
        if let Some(mut w) = self.worker.take() {
            retire(self.gpu.as_ref(), self.pid, &mut w);
        }
        drop(self.driver.take());
    }
}

impl Drop for Demo {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// The generated text of an OpenAI-style completion answer, or the whole body.
fn completion_text(body: &str) -> String {
    let v: serde_json::Value = match serde_json::from_str(body) {
        Ok(v) => v,
        Err(_) => return body.trim().to_string(),
    };
    v["choices"][0]["text"]
        .as_str()
        .or_else(|| v["text"].as_str())
        .or_else(|| v["completion"].as_str())
        .map_or_else(|| body.trim().to_string(), str::to_string)
}

fn ellipsis(s: &str, n: usize) -> String {
    if s.chars().count() <= n {
        s.to_string()
    } else {
        s.chars().take(n).collect::<String>() + "..."
    }
}

fn fmt_duration(d: Duration) -> String {
    let ms = d.as_secs_f64() * 1e3;
    if ms < 1000.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{:.2} s", ms / 1e3)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn completion_text_reads_openai_style_answers() {
        assert_eq!(
            completion_text(r#"{"choices":[{"text":"Paris"}]}"#),
            "Paris"
        );
        assert_eq!(completion_text(r#"{"text":"Paris"}"#), "Paris");
        assert_eq!(completion_text("plain\n"), "plain");
    }

    #[test]
    fn the_demo_ends_with_the_ledger() {
        let s = steps();
        assert_eq!(s.last().map(|s| s.title), Some("wedge ledger"));
        assert!(s.iter().filter(|s| s.title == "NVML view").count() >= 3);
    }
}
