//! A fake CRIU: the `cryo_criu::Criu` seam in process, for the lifecycle's freeze logic.
//!
//! A dump writes a few small image files and, unless asked to leave the tree running, SIGKILLs
//! every process of the tree afterwards, as CRIU does after a complete dump (never before). It
//! records, for every dump, the driver state each process of the tree had at that moment (from
//! the [`FakeGpu`] it watches): CRIU must only ever see suspended CUDA processes. A failure is
//! injected with [`FakeCriu::fail_next_dump`]: CRIU's log then holds the error line, nothing is
//! killed. A restore needs the image's pids, which only CRIU can hand out: the fake "restores"
//! processes the test started itself ([`FakeCriu::restores`]), which count as free until then.
//! What the restored tree does once CRIU resumes it and before CRIU exits (a process of it
//! exits, forks) is the test's [`FakeCriu::on_resume`].
//! A staged dump runs the caller's gate after writing and before killing, as CRIU's
//! `post-dump` stage does; [`FakeCriu::before_next_dump`] changes the tree just before the
//! fake looks at it (where the real CRIU seizes it), so a test can end or fork a process of
//! the tree between the freeze's listing and CRIU's.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use cryo_criu::image::Image;
use cryo_criu::image::Staging;
use cryo_criu::{
    AtGate, Criu, CriuError, CriuOp, CriuVersion, DumpGate, DumpOpts, RestoreOpts, Restored,
    DUMP_LOG,
};
use cryo_gpu::ProcessState;
use cryo_proc::Pid;

use crate::fake::FakeGpu;
use crate::{eventually, procs, PATIENCE};

/// One dump the fake CRIU was asked for.
#[derive(Debug, Clone)]
pub struct Dump {
    /// The tree's root.
    pub root: Pid,
    /// The images directory.
    pub dir: PathBuf,
    /// `leave_running` as asked.
    pub leave_running: bool,
    /// Every process of the tree and its driver state when CRIU dumped it (`None`: not a CUDA
    /// process).
    pub states: Vec<(Pid, Option<ProcessState>)>,
    /// Whether the dump succeeded.
    pub ok: bool,
}

/// The verdict a dump asks at its gate.
type Verdict<'a> = dyn Fn() -> Result<(), CriuError> + Sync + 'a;

/// What [`FakeCriu::before_next_dump`] runs.
type Hook = Box<dyn FnOnce() + Send>;

#[derive(Default)]
struct Inner {
    dumps: Vec<Dump>,
    fail_next: Option<String>,
    before_next: Option<Hook>,
    /// The processes a restore brings back (root first), and how many restores ran.
    image: Vec<Pid>,
    restores: usize,
}

/// What the restored tree does between CRIU's resume (its gate let it through) and CRIU's exit.
type OnResume = Arc<dyn Fn() + Send + Sync>;

impl std::fmt::Debug for Inner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inner")
            .field("dumps", &self.dumps)
            .field("fail_next", &self.fail_next)
            .field("before_next", &self.before_next.is_some())
            .field("image", &self.image)
            .field("restores", &self.restores)
            .finish()
    }
}

/// The fake CRIU; clones share one record.
#[derive(Clone)]
pub struct FakeCriu {
    inner: Arc<Mutex<Inner>>,
    gpu: FakeGpu,
    on_resume: Arc<Mutex<Option<OnResume>>>,
}

impl std::fmt::Debug for FakeCriu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FakeCriu")
            .field("inner", &self.inner)
            .field("gpu", &self.gpu)
            .finish_non_exhaustive()
    }
}

impl FakeCriu {
    /// A CRIU that asks `gpu` for the state of every process it dumps.
    pub fn watching(gpu: &FakeGpu) -> Self {
        FakeCriu {
            inner: Arc::default(),
            gpu: gpu.clone(),
            on_resume: Arc::default(),
        }
    }

    /// Every restore runs `f` once its gate let the tree through, before it returns: what the
    /// restored tree does once CRIU resumed it and before CRIU exits (a process of it exits,
    /// forks, its pid is taken by another).
    pub fn on_resume(&self, f: impl Fn() + Send + Sync + 'static) -> &Self {
        *self.on_resume.lock().unwrap_or_else(|p| p.into_inner()) = Some(Arc::new(f));
        self
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The next dump fails with `line` as CRIU's error, the tree left as it was.
    pub fn fail_next_dump(&self, line: &str) -> &Self {
        self.inner().fail_next = Some(line.to_string());
        self
    }

    /// The next dump runs `hook` first, before it looks at the tree (where CRIU seizes it).
    pub fn before_next_dump(&self, hook: impl FnOnce() + Send + 'static) -> &Self {
        self.inner().before_next = Some(Box::new(hook));
        self
    }

    /// A restore brings back `pids` (root first): processes the test started, which the fake
    /// reports free until then, as the image's pids are on a host where it was not restored.
    pub fn restores(&self, pids: &[Pid]) -> &Self {
        self.inner().image = pids.to_vec();
        self
    }

    /// How many restores ran.
    pub fn restore_count(&self) -> usize {
        self.inner().restores
    }

    /// Every dump so far.
    pub fn dumps(&self) -> Vec<Dump> {
        self.inner().dumps.clone()
    }
}

impl Criu for FakeCriu {
    fn version(&self) -> CriuVersion {
        CriuVersion::MIN
    }

    fn dump(&self, pid: Pid, images_dir: &Path, opts: &DumpOpts) -> Result<(), CriuError> {
        self.dump_gated(pid, images_dir, opts, &|| Ok(()))
    }

    /// The gate's verdict is the real CRIU's ([`cryo_criu::dump_gate_verdict`]): the caller's
    /// `at_gate`, the staging directory's check, then the follower, all before the kill.
    fn dump_staged(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
    ) -> Result<(), CriuError> {
        self.dump_gated(pid, staging.path(), opts, &|| {
            cryo_criu::dump_gate_verdict(staging, at_gate)
        })
    }

    /// The "restored" processes already run: `at_gate` is told of them, a refusal is CRIU's;
    /// then [`FakeCriu::on_resume`]'s action, as the tree runs before CRIU exits.
    fn restore_gated(
        &self,
        image: &Image,
        _opts: &RestoreOpts,
        at_gate: &AtGate<'_>,
    ) -> Result<Restored, CriuError> {
        let mut g = self.inner();
        g.restores += 1;
        match g.image.first().copied() {
            Some(root) => {
                drop(g);
                at_gate(root).map_err(CriuError::Gate)?;
                let resume = self
                    .on_resume
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone();
                if let Some(f) = resume {
                    f();
                }
                Ok(Restored {
                    pid: root,
                    served_bytes: 0,
                    phases: Default::default(),
                })
            }
            None => Err(CriuError::Failed {
                op: CriuOp::Restore,
                log: image.path().join("restore.log"),
                lines: vec!["the fake CRIU was given nothing to restore".into()],
            }),
        }
    }

    fn pids_in_use(&self, pids: &[Pid]) -> Vec<Pid> {
        let g = self.inner();
        if g.restores > 0 {
            return cryo_proc::pids_in_use(pids);
        }
        cryo_proc::pids_in_use(pids)
            .into_iter()
            .filter(|p| !g.image.contains(p))
            .collect()
    }
}

impl FakeCriu {
    /// A dump that asks `verdict` once every file is written, before the tree is killed, as
    /// CRIU's `post-dump` stage waits at cryo's gate; a refusal there leaves the tree as it was.
    fn dump_gated(
        &self,
        pid: Pid,
        images_dir: &Path,
        opts: &DumpOpts,
        verdict: &Verdict<'_>,
    ) -> Result<(), CriuError> {
        let hook = self.inner().before_next.take();
        if let Some(hook) = hook {
            hook();
        }
        let tree = cryo_proc::tree(pid)
            .unwrap_or_else(|e| panic!("CRIU cannot see the tree of {pid}: {e}"));
        let states = tree
            .iter()
            .map(|p| (*p, self.gpu.driver_state(*p)))
            .collect();
        let failure = self.inner().fail_next.take();
        let log = images_dir.join(DUMP_LOG);
        let write = |name: &str, text: &str| {
            std::fs::write(images_dir.join(name), text).map_err(|source| CriuError::Dir {
                op: CriuOp::Dump,
                path: images_dir.to_path_buf(),
                source,
            })
        };
        let mut dump = Dump {
            root: pid,
            dir: images_dir.to_path_buf(),
            leave_running: opts.leave_running,
            states,
            ok: failure.is_none(),
        };
        if let Some(line) = failure {
            write(DUMP_LOG, &format!("(00.000001) Error (fake.c:1): {line}\n"))?;
            self.inner().dumps.push(dump);
            return Err(CriuError::Failed {
                op: CriuOp::Dump,
                log,
                lines: vec![format!("Error (fake.c:1): {line}")],
            });
        }
        write(DUMP_LOG, "(00.000001) Dumping finished successfully\n")?;
        write("inventory.img", "fake inventory\n")?;
        for p in &tree {
            write(&format!("core-{p}.img"), &format!("fake core of {p}\n"))?;
        }
        if let Err(e) = verdict() {
            dump.ok = false;
            self.inner().dumps.push(dump);
            return Err(e);
        }
        if !opts.leave_running {
            for p in &tree {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(*p),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
            for p in &tree {
                eventually(PATIENCE, "the dumped tree to die", || !procs::alive(*p));
            }
        }
        dump.ok = true;
        self.inner().dumps.push(dump);
        Ok(())
    }
}
