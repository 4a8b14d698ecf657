//! Finding CRIU and running dump and restore through `criu swrk`.

use std::fs::File;
use std::io::{Read, Seek, Write};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cryo_proc::Pid;
use nix::fcntl::{Flock, FlockArg};

use crate::colocate::PinRecord;
use crate::error::{CriuError, CriuOp, Stuck};
use crate::image::{self, Image, Staging};
use crate::log::{FileCap, LogCap};
use crate::rpc::RpcError;
use crate::rpc::{CriuOpts, CriuReq, CriuReqType, Swrk};
use crate::scratch::{self, Private};
use crate::unresumed;
use crate::version::CriuVersion;
use cryo_gpu::deadline::{Abandoned, Late};

/// The environment variable naming the CRIU binary.
pub const CRIU_ENV: &str = "CRYO_CRIU";

/// The file in the scratch root that caches CRIU's version ([`CriuRpc::locate_in`]); not a
/// run's directory, so the sweep leaves it alone.
pub const VERSION_CACHE: &str = "criu-version.json";
/// Where `scripts/install-criu.sh` installs CRIU.
pub const DEFAULT_CRIU: &str = "/usr/local/sbin/criu";
/// The log CRIU writes into the image directory while dumping.
pub const DUMP_LOG: &str = "dump.log";
/// The log CRIU writes into the restore work directory.
pub const RESTORE_LOG: &str = "restore.log";
/// How many of CRIU's error lines a [`CriuError::Failed`] carries.
const ERROR_LINES: usize = 8;

/// The options of CRIU's that dump and restore share. The defaults are cryo's: no terminal,
/// no established TCP connections, file locks kept, CRIU's log at level 4 (debug).
#[derive(Debug, Clone)]
pub struct CriuFlags {
    /// The tree is a shell job: its session or terminal lies outside it (`--shell-job`).
    pub shell_job: bool,
    /// Established TCP connections (`--tcp-established`).
    pub tcp_established: bool,
    /// File locks (`--file-locks`).
    pub file_locks: bool,
    /// Unix sockets connected to peers outside the tree (`--ext-unix-sk`).
    pub ext_unix_sk: bool,
    /// CRIU's log level, 0-4.
    pub log_level: i32,
    /// Resources declared external (`--external`), passed through as is.
    pub external: Vec<String>,
}

impl Default for CriuFlags {
    fn default() -> Self {
        CriuFlags {
            shell_job: false,
            tcp_established: false,
            file_locks: true,
            ext_unix_sk: false,
            log_level: 4,
            external: Vec::new(),
        }
    }
}

/// Options of a dump. The defaults are cryo's: the tree is gone afterwards, and
/// [`CriuFlags`]' defaults but CRIU's log at [`DUMP_LOG_LEVEL`].
#[derive(Debug, Clone)]
pub struct DumpOpts {
    /// Keep the tree running after the dump (CRIU's `--leave-running`).
    pub leave_running: bool,
    /// What dump and restore share.
    pub flags: CriuFlags,
}

/// The level of a dump's log: 3 (errors, warnings and each step's information). At 4 (debug)
/// CRIU and its parasite write a line for every run of pages they move and every command
/// between them (17,600 lines for a 1 GiB worker against 815 at 3; 65,251 for a 4 GiB sim
/// worker, measured), each its own `write` on CRIU's path while the tree is frozen (65,000
/// such writes cost 53-71 ms of CPU here, before formatting), and above the log's cap
/// ([`LogCap`]) cryo punches them out again as CRIU writes; the debug lines of a dump say
/// nothing a failure is read from (its error lines and the steps before them). The bare
/// `criu dump` logs at its default, 2. A restore still logs at 4 ([`CriuFlags`]' default): it
/// writes about 750 lines whatever its size (743 for 1 GiB, 747 for 4 GiB; 282 at 3), since
/// its restorer reads the pages with one `preadv` per run of areas, and the last of its debug
/// lines (`Preadv ...`) say where a restore stuck in that read stopped.
pub const DUMP_LOG_LEVEL: i32 = 3;

impl Default for DumpOpts {
    fn default() -> Self {
        DumpOpts {
            leave_running: false,
            flags: CriuFlags {
                log_level: DUMP_LOG_LEVEL,
                ..CriuFlags::default()
            },
        }
    }
}

/// Options of a restore. The restored tree always comes back as a sibling of the short-lived
/// CRIU worker, i.e. as a child of the calling process (CRIU's `rst_sibling`).
#[derive(Debug, Clone, Default)]
pub struct RestoreOpts {
    /// What dump and restore share.
    pub flags: CriuFlags,
    /// Where CRIU writes `restore.log` and its stats. `None`: a fresh directory under the
    /// system's temporary directory, removed after a success and kept after a failure. Never
    /// the image directory: a restore must leave the image exactly as verified.
    pub work_dir: Option<PathBuf>,
    /// How long CRIU may take ([`Criu::restore`] only; `None`: no limit). Past it CRIU is
    /// killed, and so is every process it had restored or forked (none has run: they were all
    /// before the gate; found by their host identities, never by the image's pids: see
    /// `unresumed`), and the restore is [`CriuError::TimedOut`], which names them. A restore can block
    /// forever: a restored process that must take back a file lock someone else holds waits
    /// for it (`--file-locks`).
    ///
    /// A CRIU that does not exit within [`KILLED_GRACE`] of its kill waits where no signal
    /// reaches it (a read of a dead disk, an NFS hard mount, a FUSE server that stopped
    /// answering: state `D`): the restore returns then all the same, [`CriuError::TimedOut`]
    /// naming it ([`Stuck`]: pid, state, kernel wait), and a thread of the deadline layer
    /// reaps it when its wait ends ([`stuck_crius`]; past [`MAX_STUCK_CRIUS`] of them a new
    /// restore is refused at once, [`CriuError::TooManyStuck`]). Nothing it restored can run:
    /// its SIGKILL is pending, so it never again runs a line of its own to resume the tree,
    /// and the tree was before the gate (no restored process ran the image's code, so none
    /// holds a live GPU context: each is CHECKPOINTED until cryo's GPU restore, which a failed
    /// restore never reaches); what it had restored is killed as at any deadline. Restored
    /// processes stuck the same way cost one more [`KILLED_GRACE`] for all of them (not one
    /// each), are named in the error's `left`, and those that are the caller's children are
    /// reaped by one thread of the deadline layer when their waits end (counted once in
    /// [`stuck_crius`]). The guard
    /// and the agent see a thaw that failed, and no restored process.
    ///
    /// Counted from the restore's start: CRIU's kill and the check's give-up are one instant.
    /// At it, a check ([`ThawRoute::Files`]) that had not given its verdict refuses the image
    /// in its own words ([`CriuError::Image`]), whichever of the two saw the instant first; a
    /// CRIU killed with no check outstanding is [`CriuError::TimedOut`]. A CRIU past its
    /// `post-resume` stage that has not exited is killed at it too, alone (see `Resumed`).
    pub deadline: Option<std::time::Duration>,
}

/// What cryo needs from CRIU, as a seam: dump a process tree into a directory, restore one
/// from it, and say which CRIU it is. [`CriuRpc`] is the real one (`criu swrk`); the lifecycle
/// takes `&dyn Criu`, so its freeze and thaw logic is also tested against a fake, without root.
pub trait Criu: std::fmt::Debug + Send + Sync {
    /// The version (recorded in image manifests).
    fn version(&self) -> CriuVersion;

    /// Dumps the process tree rooted at `pid` into `images_dir` (which must exist), with CRIU's
    /// log in `images_dir/dump.log`. Unless `opts.leave_running`, the tree is killed after a
    /// successful dump, never before; after a failure it is left as it was. The caller reaps
    /// its own children among them.
    fn dump(&self, pid: Pid, images_dir: &Path, opts: &DumpOpts) -> Result<(), CriuError>;

    /// [`Criu::dump`] into `staging`, what a freeze publishes; cryo hashes CRIU's pages files
    /// as CRIU writes them ([`Staging::follow_pages`]), every file once CRIU has written them
    /// ([`Staging::follow_written`]), and publish hashes what is left.
    /// `at_gate` runs at CRIU's `post-dump` stage: every image written, every process CRIU
    /// dumped still frozen (none can exit or fork), none killed yet; an `Err` from it makes
    /// CRIU resume the tree instead of killing it ([`CriuError::DumpGate`]), as the caller
    /// dying there does. [`CriuRpc`] runs CRIU as a command whose `post-dump` stage waits at
    /// cryo's gate (see there), and starts hashing there, while CRIU ends the tree.
    fn dump_staged(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
    ) -> Result<(), CriuError>;

    /// [`Criu::dump_staged`], telling `pins` what the dump pins to one CPU before it pins it
    /// and what it gave back afterwards (see [`PinRecord`]). A [`Criu`] that pins nothing
    /// tells nothing (the default).
    fn dump_staged_recorded(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
        pins: &dyn PinRecord,
    ) -> Result<(), CriuError> {
        let _ = pins;
        self.dump_staged(pid, staging, opts, at_gate)
    }

    /// Restores the tree of `image` (opened and trusted by [`Image::open`]) and returns the pid
    /// of its root as CRIU names it: the host pid, which is the pid it had when dumped unless
    /// the tree has a pid namespace of its own. The restored root is a child of the calling
    /// process. The real one ([`CriuRpc`]) serves the image to CRIU itself, checking every byte
    /// against the manifest before CRIU gets it; a refused image is [`CriuError::Image`].
    fn restore(&self, image: &Image, opts: &RestoreOpts) -> Result<Restored, CriuError> {
        self.restore_gated(image, opts, &|_| Ok(()))
    }

    /// [`Criu::restore`], calling `at_gate` with the root's pid once every process of the tree
    /// is restored and before any of them runs (CRIU's `post-restore` stage, where the image's
    /// verdict is taken): a caller records what it restored there, so that no restored tree
    /// ever runs unrecorded. An `Err` from it aborts the restore ([`CriuError::Gate`]: CRIU
    /// removes the tree), as the caller dying there does.
    fn restore_gated(
        &self,
        image: &Image,
        opts: &RestoreOpts,
        at_gate: &AtGate<'_>,
    ) -> Result<Restored, CriuError>;

    /// Restores of runs that died before CRIU's gate that setting this CRIU up ended (the
    /// sweep of dead runs' directories, [`scratch::sweep`]): what a thaw journals.
    fn ended_restores(&self) -> Vec<scratch::EndedRestore> {
        Vec::new()
    }

    /// The ones of `pids` a restore could not have: taken on this host as a pid, a process
    /// group or a session id ([`cryo_proc::pids_in_use`]).
    fn pids_in_use(&self, pids: &[Pid]) -> Vec<Pid> {
        cryo_proc::pids_in_use(pids)
    }
}

/// What a caller of [`Criu::restore_gated`] runs at the gate, with the restored root's pid.
pub type AtGate<'a> = dyn Fn(Pid) -> Result<(), String> + Sync + 'a;

/// What a caller of [`Criu::dump_staged`] runs at the dump's gate (the tree frozen, every
/// image written, nothing killed): what CRIU dumped is what lives in the tree now.
pub type DumpGate<'a> = dyn Fn() -> Result<(), String> + Sync + 'a;

/// The verdict at a staged dump's gate (CRIU's `post-dump` stage: every image written, the
/// tree frozen, none of it killed yet), one home for every [`Criu`] that writes into a
/// [`Staging`] ([`CriuRpc`], and the tests' fake): the caller's `at_gate` first (its refusal is
/// [`CriuError::DumpGate`]), then the staging directory must still be the one made and locked
/// for the dump, holding only regular files ([`CriuError::Image`] otherwise). Once both passed,
/// the follower takes every file CRIU wrote ([`Staging::follow_written`], CRIU's log left to
/// publish; until then it took only the pages files, [`Staging::follow_pages`]), while CRIU
/// ends the tree. An `Err` makes CRIU resume the tree instead of killing it.
pub fn dump_gate_verdict(staging: &Staging, at_gate: &DumpGate<'_>) -> Result<(), CriuError> {
    at_gate().map_err(CriuError::DumpGate)?;
    staging.check_dumped().map_err(CriuError::Image)?;
    staging.follow_written(&[DUMP_LOG]);
    Ok(())
}

/// `CRYO_FOLLOW_EARLY=0` starts the follower at the dump's gate instead of with the dump (see
/// [`follow_early`]); for A/B measurements.
pub const FOLLOW_EARLY_ENV: &str = "CRYO_FOLLOW_EARLY";

/// cryo's own side of a gate failed (its verdict could not be written, CRIU's script could not
/// be read, the judge panicked): the restore or dump is refused there, as a refusing verdict
/// refuses it (CRIU ends what it restored, or resumes the dumped tree). Not the image's fault,
/// so not an [`ImageError`]: a thaw's caller takes that for an image that is bad (`cryo thaw`
/// said "image refused: : image streamer: writing the gate's verdict: No space left on
/// device", blaming an image that was whole for a full disk).
fn gate_failed(op: CriuOp, reason: String) -> CriuError {
    match op {
        CriuOp::Restore => CriuError::Gate(reason),
        CriuOp::Dump => CriuError::DumpGate(reason),
    }
}

/// Whether a dump CRIU writes itself is followed from its start ([`Staging::follow_pages`]):
/// unless [`FOLLOW_EARLY_ENV`] is `0`.
fn follow_early() -> bool {
    std::env::var_os(FOLLOW_EARLY_ENV).is_none_or(|v| v != "0")
}

/// A CRIU binary that was found and is recent enough, driven through `criu swrk` RPC.
#[derive(Debug, Clone)]
pub struct CriuRpc {
    bin: PathBuf,
    lib_dir: Option<PathBuf>,
    version: CriuVersion,
    /// Where each CRIU command gets its private directory; `None`: the temporary directory.
    scratch: Option<PathBuf>,
    log_cap: LogCap,
    /// Restores of runs that died before CRIU's gate, ended by [`CriuRpc::in_scratch`]'s sweep.
    ended: Vec<scratch::EndedRestore>,
}

impl CriuRpc {
    /// Finds CRIU and checks its version. Looks at `explicit`, else `$CRYO_CRIU`, else
    /// `/usr/local/sbin/criu`, else `criu` on `PATH`. An explicit path or `$CRYO_CRIU` that does
    /// not exist is [`CriuError::NotFound`], not a reason to look elsewhere. A binary whose
    /// directory also holds shared libraries (a carried build: `.carry/criu/`) runs with that
    /// directory in `LD_LIBRARY_PATH`.
    pub fn locate(explicit: Option<&Path>) -> Result<CriuRpc, CriuError> {
        Self::at_with(Self::find(explicit)?, None)
    }

    /// [`CriuRpc::locate`] for cryo's commands: the version is answered from a cache in
    /// `scratch` when this very binary was asked before (the `version` module), and every
    /// CRIU command gets its private directory there ([`CriuRpc::in_scratch`]).
    pub fn locate_in(explicit: Option<&Path>, scratch: &Path) -> Result<CriuRpc, CriuError> {
        let cache = scratch.join(VERSION_CACHE);
        Ok(Self::at_with(Self::find(explicit)?, Some(&cache))?.in_scratch(scratch))
    }

    fn find(explicit: Option<&Path>) -> Result<PathBuf, CriuError> {
        let env = std::env::var_os(CRIU_ENV).filter(|v| !v.is_empty());
        match (explicit, env) {
            (Some(p), _) => Self::exists(p.to_path_buf()),
            (None, Some(p)) => Self::exists(PathBuf::from(p)),
            (None, None) => Self::search(),
        }
    }

    /// Uses the binary at `bin` (no search), checking its version.
    pub fn at(bin: PathBuf) -> Result<CriuRpc, CriuError> {
        Self::at_with(bin, None)
    }

    fn at_with(bin: PathBuf, cache: Option<&Path>) -> Result<CriuRpc, CriuError> {
        let bin = Self::exists(bin)?;
        let lib_dir = bin.parent().filter(|d| has_libs(d)).map(Path::to_path_buf);
        let version = match cache {
            Some(c) => CriuVersion::of_binary_cached(&bin, lib_dir.as_deref(), c)?,
            None => CriuVersion::of_binary(&bin, lib_dir.as_deref())?,
        };
        if version < CriuVersion::MIN {
            return Err(CriuError::TooOld {
                path: bin,
                found: version,
                needed: CriuVersion::MIN,
            });
        }
        Ok(CriuRpc {
            bin,
            lib_dir,
            version,
            scratch: None,
            log_cap: LogCap::default(),
            ended: Vec::new(),
        })
    }

    /// Gives every CRIU command a private directory under `root` (cryo's: the state
    /// directory's `criu/`, made 0700 if missing) instead of the temporary directory, and first
    /// removes what runs that died left there ([`scratch::sweep`]).
    pub fn in_scratch(mut self, root: &Path) -> CriuRpc {
        let swept = scratch::sweep(root);
        for (path, error) in &swept.failed {
            tracing::warn!(path = %path.display(), %error, "cannot remove a dead CRIU run's directory");
        }
        self.scratch = Some(root.to_path_buf());
        self.ended = swept.ended;
        self
    }

    /// Caps CRIU's logs at `cap` instead of [`LogCap::default`].
    pub fn with_log_cap(mut self, cap: LogCap) -> CriuRpc {
        self.log_cap = cap;
        self
    }

    /// The lock of the working directory of `pid`, the root of a tree about to be dumped, when
    /// it has a pid namespace of its own (see [`crate::crtools`]), in the scratch root.
    fn cwd_lock(&self, pid: Pid) -> Result<Option<crate::crtools::CwdLock>, CriuError> {
        let root = self.scratch.clone().unwrap_or_else(std::env::temp_dir);
        crate::crtools::CwdLock::take(pid, &root).map_err(|source| CriuError::Dir {
            op: CriuOp::Dump,
            path: root,
            source,
        })
    }

    /// A fresh private directory for one command.
    fn private(&self, op: CriuOp, prefix: &str) -> Result<Private, CriuError> {
        let root = self.scratch.clone().unwrap_or_else(std::env::temp_dir);
        Private::new(&root, prefix).map_err(|source| CriuError::Dir {
            op,
            path: root,
            source,
        })
    }

    fn exists(p: PathBuf) -> Result<PathBuf, CriuError> {
        // A bare name ("criu") is looked up on PATH, as a shell would.
        if p.components().count() == 1 && !p.is_file() {
            if let Some(found) = std::env::var_os("PATH")
                .map(|path| {
                    std::env::split_paths(&path)
                        .map(|d| d.join(&p))
                        .collect::<Vec<_>>()
                })
                .and_then(|c| c.into_iter().find(|c| c.is_file()))
            {
                return Ok(found);
            }
        }
        if p.is_file() {
            Ok(p)
        } else {
            Err(CriuError::NotFound { tried: vec![p] })
        }
    }

    fn search() -> Result<PathBuf, CriuError> {
        let mut tried = vec![PathBuf::from(DEFAULT_CRIU)];
        if let Some(path) = std::env::var_os("PATH") {
            tried.extend(std::env::split_paths(&path).map(|d| d.join("criu")));
        }
        match tried.iter().find(|p| p.is_file()) {
            Some(p) => Ok(p.clone()),
            None => Err(CriuError::NotFound { tried }),
        }
    }

    /// The binary.
    pub fn path(&self) -> &Path {
        &self.bin
    }

    /// Restores the tree imaged in the directory `images_dir` through `criu swrk`, CRIU reading
    /// the files itself, unchecked: for tests and tools only (`cryo thaw` uses
    /// [`Criu::restore`], which checks every byte). Returns the root's pid; CRIU's worker exits
    /// right after the restore, the caller reaps.
    pub fn restore_dir(&self, images_dir: &Path, opts: &RestoreOpts) -> Result<Pid, CriuError> {
        let op = CriuOp::Restore;
        let dir = open_dir(op, images_dir)?;
        let (work_path, temp) = match &opts.work_dir {
            Some(w) => {
                std::fs::create_dir_all(w).map_err(|source| CriuError::Dir {
                    op,
                    path: w.clone(),
                    source,
                })?;
                (w.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("cryo-criu-restore-")
                    .tempdir()
                    .map_err(|source| CriuError::Dir {
                        op,
                        path: std::env::temp_dir(),
                        source,
                    })?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let work = open_dir(op, &work_path)?;
        let req = CriuReq {
            r#type: CriuReqType::Restore as i32,
            opts: Some(CriuOpts {
                images_dir_fd: dir.as_raw_fd(),
                work_dir_fd: Some(work.as_raw_fd()),
                rst_sibling: Some(true),
                shell_job: Some(opts.flags.shell_job),
                tcp_established: Some(opts.flags.tcp_established),
                file_locks: Some(opts.flags.file_locks),
                ext_unix_sk: Some(opts.flags.ext_unix_sk),
                log_level: Some(opts.flags.log_level),
                log_file: Some(RESTORE_LOG.to_string()),
                external: opts.flags.external.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        tracing::debug!(dir = %images_dir.display(), work = %work_path.display(), "criu restore");
        let log = work_path.join(RESTORE_LOG);
        let resp = self.call(op, &req, &log)?;
        drop((dir, work));
        match resp.restore {
            Some(r) if resp.success => Ok(r.pid),
            _ => {
                // Keep the log of a failed restore for whoever reads the error.
                if let Some(t) = temp {
                    let _ = t.keep();
                }
                let mut err = failed(op, log, resp.cr_errmsg);
                if resp.success {
                    if let CriuError::Failed { lines, .. } = &mut err {
                        lines.push("CRIU answered success without a restored pid".into());
                    }
                }
                Err(err)
            }
        }
    }

    /// `criu` with the carried libraries' directory in `LD_LIBRARY_PATH` and no plugins: its
    /// plugin directory (`-L`) is an empty directory made in `private` (why: see
    /// [`Swrk::start`]; CRIU loads its installed cuda plugin otherwise). A save of CRIU's
    /// kernel-feature cache that a dead CRIU left behind is removed first, so that this CRIU
    /// saves the cache again ([`crate::kdat::clear_left_write`]).
    fn command(&self, private: &Path) -> std::io::Result<Command> {
        crate::kdat::clear_and_say(Path::new(crate::kdat::KDAT_DIR));
        let no_plugins = private.join("no-plugins");
        std::fs::create_dir(&no_plugins)?;
        let mut cmd = Command::new(&self.bin);
        image::default_sigchld(&mut cmd);
        cmd.arg("-L").arg(no_plugins);
        if let Some(dir) = &self.lib_dir {
            let mut path = dir.as_os_str().to_owned();
            if let Some(old) = std::env::var_os("LD_LIBRARY_PATH") {
                path.push(":");
                path.push(old);
            }
            cmd.env("LD_LIBRARY_PATH", path);
        }
        Ok(cmd)
    }

    /// `criu HEAD...` reading or writing `images`, with `private` holding the gate's files
    /// (and the streamer's socket), CRIU's work directory `work` and its log `work/log`
    /// (capped, see [`crate::log`]: a restore's through a pipe on CRIU's stdout, a dump's written
    /// by CRIU), `flags`, `gate`'s action script; stdin empty, stderr into the unnamed file
    /// returned (read back after a failure). The one set-up of every CRIU command cryo runs.
    #[allow(clippy::too_many_arguments)]
    fn gated_command(
        &self,
        head: &[&str],
        images: Images<'_>,
        private: &Path,
        work: &Path,
        log: &str,
        flags: &CriuFlags,
        gate: &Gate,
    ) -> std::io::Result<(Command, File, FileCap)> {
        let mut cmd = self.command(private)?;
        cmd.args(head);
        match images {
            Images::Stream => {
                cmd.arg("--stream").arg("-D").arg(private);
            }
            Images::Dir(fd) => {
                // The very directory cryo checked, whatever the path names by now.
                image::inherit_fd(&mut cmd, fd.as_raw_fd());
                cmd.arg("-D")
                    .arg(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            }
        }
        // A file CRIU writes, kept within the cap: never a pipe to cryo, since CRIU's restorer
        // and its parasite write the log from inside the restored or dumped processes, and a pipe
        // whose reader (cryo) died raises SIGPIPE in them (see `crate::log`).
        cmd.args(["-o", log]);
        let log = FileCap::new(&work.join(log), self.log_cap);
        let stdout = Stdio::null();
        cmd.arg("-W")
            .arg(work)
            .arg(format!("-v{}", flags.log_level))
            .arg("--action-script")
            .arg(gate.script());
        for (on, flag) in [
            (flags.shell_job, "--shell-job"),
            (flags.tcp_established, "--tcp-established"),
            (flags.file_locks, "--file-locks"),
            (flags.ext_unix_sk, "--ext-unix-sk"),
        ] {
            if on {
                cmd.arg(flag);
            }
        }
        for e in &flags.external {
            cmd.arg("--external").arg(e);
        }
        let stderr = tempfile::tempfile()?;
        cmd.stdin(Stdio::null())
            .stdout(stdout)
            .stderr(Stdio::from(stderr.try_clone()?));
        Ok((cmd, stderr, log))
    }

    /// Spawns `cmd` (CRIU with `gate`'s action script), copies its `log` (capped), runs `work`
    /// beside it (serving or capturing the image on `listener`, or checking it), and, when CRIU
    /// reaches the gate's stage, `verdict`, and waits for CRIU, past `until` (the restore's
    /// deadline, counted from the restore's start as its check's is) no longer: then it kills
    /// CRIU. Any of `refusals` readable (the image is refused: no verdict can pass)
    /// before a verdict passed, it kills CRIU at once too: a CRIU that never reaches its gate
    /// would otherwise hold the restore until its deadline. Returns its exit status and the
    /// verdict (`None`: CRIU ended before it reached the gate); the log is whole (as capped)
    /// when it returns. `give_up` runs once no verdict can pass any more and none did (CRIU is
    /// killed at a refusal or its deadline, or ended by itself before a verdict passed; its
    /// argument: at the deadline): what `work` and `verdict` still wait for (the check's reads)
    /// is given up on there, so that neither holds the return (nor the next CRIU's budget)
    /// until the deadline. `ended` runs once CRIU
    /// was waited for and its verdict is known, before its log is cut (on the thread that
    /// spawned CRIU): what ends the processes CRIU left (a restore's, at its deadline) ends them
    /// there, since they write the log too (CRIU's restorer runs inside them), and whatever
    /// writes it after the cut appends past the cap.
    #[allow(clippy::too_many_arguments)]
    fn run_gated(
        &self,
        op: CriuOp,
        mut cmd: Command,
        log: FileCap,
        listener: Option<&UnixListener>,
        gate: Gate,
        until: Option<std::time::Instant>,
        refusals: &[BorrowedFd<'_>],
        give_up: &(dyn Fn(bool) + Sync),
        work: impl FnOnce() + Send,
        verdict: impl FnOnce(Option<Pid>) -> Result<(), CriuError> + Send,
        spawned: impl FnOnce(Pid),
        ended: impl FnOnce(&Gated),
    ) -> Result<Gated, CriuError> {
        let spawn_err = |source| CriuError::Rpc {
            op,
            source: RpcError::Spawn {
                path: self.bin.display().to_string(),
                source,
            },
        };
        let stuck = STUCK.get();
        if until.is_some() && stuck >= MAX_STUCK_CRIUS {
            return Err(CriuError::TooManyStuck {
                op,
                stuck,
                held: HeldPlace::said(),
            });
        }
        // The judge's way out when CRIU neither reaches the gate nor exits (stuck past its
        // kill): its write end goes when CRIU was waited for or given up on.
        let (stop_rx, stop_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| spawn_err(e.into()))?;
        let child = cmd.spawn().map_err(spawn_err)?;
        spawned(child.id() as Pid);
        // Our copy of a log pipe's write end goes with the command: the copy sees its end.
        drop(cmd);
        let gate_pidfd = rustix::process::pidfd_open(
            rustix::process::Pid::from_child(&child),
            rustix::process::PidfdFlags::empty(),
        )
        .ok();
        // Dropped once what CRIU left was ended: a log file's keeper finishes it then.
        let (done, done_rx) = std::sync::mpsc::channel::<()>();
        // Between the judge's passing verdict and a refusal's kill: whichever comes first.
        let decision = Decision::default();
        // Written by the judge once CRIU is past `post-resume` (a restore's gate only).
        let (resumed_rx, resumed_tx) = match gate.resumes {
            true => rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
                .map(|(r, w)| (Some(r), Some(w)))
                .map_err(|e| spawn_err(e.into()))?,
            false => (None, None),
        };
        // Not a scoped thread: a CRIU past `post-resume` is waited for, and its log finished,
        // after this returns ([`Resumed`]).
        let log_path = log.path().to_path_buf();
        let copied = std::thread::spawn(move || log.keep_capped(&done_rx));
        std::thread::scope(|s| {
            s.spawn(work);
            let decided = &decision;
            let judged =
                s.spawn(move || gate.judge(op, verdict, gate_pidfd, stop_rx, decided, resumed_tx));
            let Waited {
                status,
                timed_out,
                refused,
                stuck,
                resumed,
            } = wait_until(
                child,
                until,
                refusals,
                &decision,
                resumed_rx.as_ref().map(AsFd::as_fd),
                give_up,
            );
            // CRIU ended (or was given up on) with no verdict passed: none will pass now
            // (CRIU is gone), nor is one waited for.
            if !decision.passed() {
                give_up(timed_out);
            }
            drop(stop_tx);
            // Unblocks the accept if CRIU never connected (a connection ends with CRIU).
            if let Some(l) = listener {
                let _ = nix::sys::socket::shutdown(l.as_raw_fd(), nix::sys::socket::Shutdown::Both);
            }
            let verdict = judged
                .join()
                .unwrap_or_else(|_| Some(Err(gate_failed(op, "the gate thread panicked".into()))));
            if let Some(criu) = resumed {
                // The verdict passed and the tree runs: nothing of it is to be ended.
                return Ok(Gated {
                    status: None,
                    verdict,
                    timed_out: false,
                    refused: false,
                    stuck: None,
                    resumed: Some(Resumed {
                        criu,
                        kill_at: until,
                        done,
                        copied,
                        log: log_path,
                    }),
                    past_resume: true,
                });
            }
            // CRIU exited, maybe past `post-resume` (the judge said so before it returned).
            // Data, not a hang-up: the judge drops its end when it returns.
            let past_resume = resumed_rx.as_ref().is_some_and(|r| {
                use nix::poll::{PollFd, PollFlags};
                let mut fds = [PollFd::new(r.as_fd(), PollFlags::POLLIN)];
                nix::poll::poll(&mut fds, nix::poll::PollTimeout::ZERO).is_ok_and(|n| n > 0)
                    && fds[0]
                        .revents()
                        .is_some_and(|e| e.contains(PollFlags::POLLIN))
            });
            let gated = status.map_err(spawn_err).map(|status| Gated {
                status,
                verdict,
                timed_out,
                refused,
                stuck,
                resumed: None,
                past_resume,
            });
            if let Ok(g) = &gated {
                ended(g);
            }
            drop(done);
            report_log(&log_path, copied.join());
            gated
        })
    }

    /// One `criu swrk` exchange, CRIU's log file `log` (the one `req` names) kept within the
    /// cap for as long as it lasts ([`FileCap::keep_capped`]): CRIU's RPC takes only a file
    /// name for its log, and a looping CRIU would otherwise fill the disk.
    fn call(
        &self,
        op: CriuOp,
        req: &CriuReq,
        log: &Path,
    ) -> Result<crate::rpc::CriuResp, CriuError> {
        let (done, done_rx) = std::sync::mpsc::channel::<()>();
        let keeper = FileCap::new(log, self.log_cap);
        std::thread::scope(|s| {
            let kept = s.spawn(move || keeper.keep_capped(&done_rx));
            let resp = Swrk::start(&self.bin, self.lib_dir.as_deref())
                .and_then(|s| s.call(req))
                .map_err(|source| CriuError::Rpc { op, source });
            drop(done);
            report_log(log, kept.join());
            resp
        })
    }
}

impl Criu for CriuRpc {
    fn version(&self) -> CriuVersion {
        self.version
    }

    fn ended_restores(&self) -> Vec<scratch::EndedRestore> {
        self.ended.clone()
    }

    fn dump(&self, pid: Pid, images_dir: &Path, opts: &DumpOpts) -> Result<(), CriuError> {
        let op = CriuOp::Dump;
        let _cwd = self.cwd_lock(pid)?;
        let dir = open_dir(op, images_dir)?;
        let req = CriuReq {
            r#type: CriuReqType::Dump as i32,
            opts: Some(CriuOpts {
                // CRIU opens /proc/<our pid>/fd/<n>: the fd need not be inherited.
                images_dir_fd: dir.as_raw_fd(),
                pid: Some(pid),
                leave_running: Some(opts.leave_running),
                shell_job: Some(opts.flags.shell_job),
                tcp_established: Some(opts.flags.tcp_established),
                file_locks: Some(opts.flags.file_locks),
                ext_unix_sk: Some(opts.flags.ext_unix_sk),
                log_level: Some(opts.flags.log_level),
                log_file: Some(DUMP_LOG.to_string()),
                external: opts.flags.external.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        tracing::debug!(pid, dir = %images_dir.display(), criu = %self.bin.display(), "criu dump");
        let resp = self.call(op, &req, &images_dir.join(DUMP_LOG))?;
        drop(dir);
        if resp.success {
            Ok(())
        } else {
            Err(failed(op, images_dir.join(DUMP_LOG), resp.cr_errmsg))
        }
    }

    /// Dumps into the staging directory as the bare `criu dump -D` does: CRIU writes its files
    /// itself; cryo's follower, one thread at idle priority, hashes every whole chunk of
    /// CRIU's pages files as CRIU writes them and starts its writeback
    /// ([`Staging::follow_pages`], unless [`FOLLOW_EARLY_ENV`] is `0`), and from the gate on
    /// every file ([`Staging::follow_written`]) while CRIU ends the tree; publish hashes the
    /// rest while it fsyncs, and only then is CRIU's private directory removed
    /// ([`Staging::drop_after_publish`]). CRIU runs as a command (`criu dump -D
    /// /proc/self/fd/N`, the staging directory cryo made and opened) whose `post-dump` action
    /// script waits at cryo's gate: CRIU kills the tree only once cryo checked that the
    /// staging directory holds nothing but regular files, and a cryo that died meanwhile never
    /// wrote its verdict, so CRIU resumes the tree instead of killing it (the worker outlives a
    /// killed freeze). Measured (issue 16, 1 GiB,
    /// 2 cores, load 3-4, 8 rounds interleaved): this dump 553 ms median against the bare
    /// `criu dump`'s 494 in the same run; streamed through cryo's capture
    /// (`CRYO_DUMP_STREAM=1`, [`CriuRpc::dump_streamed`]) 789 against 476 (load 5-6), and
    /// CRIU writing its files with the writeback started behind it every 50 ms (the previous
    /// `criu swrk` route) 920 against 450: the writeback of ranges CRIU was still writing into
    /// and the pipe's hand-over cost CRIU its core. The follower beside CRIU's writing (from
    /// the dump's start) costs CRIU little where the cores are full, but up to 20-210 ms of
    /// its page loop per GiB where they are not; starting it at the gate instead trades that
    /// for the durable moment (see `image/follow.rs`).
    fn dump_staged(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
    ) -> Result<(), CriuError> {
        self.dump_staged_recorded(pid, staging, opts, at_gate, &crate::colocate::Unrecorded)
    }

    fn dump_staged_recorded(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
        pins: &dyn PinRecord,
    ) -> Result<(), CriuError> {
        if std::env::var_os("CRYO_DUMP_STREAM").is_some_and(|v| v == "1") {
            return self.dump_streamed(pid, staging, opts, at_gate);
        }
        let op = CriuOp::Dump;
        let _cwd = self.cwd_lock(pid)?;
        // Private to root (0700): the gate.
        let private = self.private(op, scratch::DUMP_PREFIX)?;
        let p = private.path().to_path_buf();
        let dir = open_dir(op, staging.path())?;
        let (cmd, stderr, log, gate) =
            self.dump_command(pid, staging, opts, Images::Dir(dir.as_fd()), &p)?;
        // CRIU and its parasite in the tree hand every chunk of pages to each other: one CPU
        // for both (see `colocate`); the tree gets its CPU sets back when CRIU has exited.
        let colocated = crate::colocate::Colocated::pin_tree(pid, pins);
        tracing::debug!(pid, staging = %staging.path().display(), cpu = ?colocated.cpu(), "criu dump");
        let clock = staging.dump_clock();
        if follow_early() {
            staging.follow_pages(&[DUMP_LOG]);
        }
        let start = std::time::Instant::now();
        let gated = self.run_gated(
            op,
            cmd,
            log,
            None,
            gate,
            None,
            &[],
            &|_| {},
            || {},
            |_| {
                // CRIU wrote every byte before its post-dump stage.
                image::CaptureClock::mark(&clock.received);
                image::CaptureClock::mark(&clock.gate);
                let v = dump_gate_verdict(staging, at_gate);
                image::CaptureClock::mark(&clock.verdict);
                v
            },
            |criu| colocated.pin_criu(criu),
            |_| {},
        )?;
        image::CaptureClock::mark(&clock.criu_exit);
        drop(colocated);
        drop(dir);
        tracing::debug!(status = ?gated.status, ms = start.elapsed().as_millis() as u64, "criu dump ended");
        let outcome = self.dump_outcome(op, staging, gated, &stderr);
        // Removed once publish has fsync'd the image, not while the worker's end is awaited.
        staging.drop_after_publish((private, stderr));
        outcome
    }

    /// Restores the tree of the opened image `image` and returns the pid of its root; no
    /// restored process runs before every byte of the image matched the manifest. CRIU runs as
    /// `criu restore` with an action script whose `post-restore` stage (every process restored,
    /// none resumed) waits for cryo's verdict; CRIU aborts the restore and removes what it
    /// restored when the verdict is not `ok`. How CRIU gets the bytes ([`ThawRoute`]): from the
    /// image's files while cryo checks the same files beside it and watches them for changes
    /// ([`image::Check`], the default), or through cryo's image streamer, which hands CRIU
    /// only chunks it checked (`CRYO_THAW_STREAM=1`, [`image::Server`]). A refused image is
    /// [`CriuError::Image`]. The root is a child of the caller. `at_gate` runs once the image
    /// passed, before the verdict is written: the tree runs only if it returned `Ok`.
    fn restore_gated(
        &self,
        image: &Image,
        opts: &RestoreOpts,
        at_gate: &AtGate<'_>,
    ) -> Result<Restored, CriuError> {
        let op = CriuOp::Restore;
        let dir_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CriuError::Dir { op, path, source }
        };
        let route = ThawRoute::from_env();
        let t0 = std::time::Instant::now();
        let since = |t: std::time::Instant| {
            Some(u64::try_from(t.saturating_duration_since(t0).as_millis()).unwrap_or(u64::MAX))
        };
        let (gate_at, verdict_at) = (std::sync::OnceLock::new(), std::sync::OnceLock::new());
        let mut phases = RestorePhases::default();
        // Private to root (0700): the gate, CRIU's work files, the streamer's socket.
        let mut private = self.private(op, scratch::RESTORE_PREFIX)?;
        let p = private.path().to_path_buf();
        let work = match &opts.work_dir {
            Some(w) => {
                std::fs::create_dir_all(w).map_err(dir_err(w))?;
                w.clone()
            }
            None => p.clone(),
        };
        let gate = Gate::new(&p, "post-restore", true).map_err(dir_err(&p))?;
        let images = match route {
            ThawRoute::Stream => Images::Stream,
            ThawRoute::Files => Images::Dir(image.dir_fd()),
        };
        let (cmd, stderr, log) = self
            .gated_command(
                &[
                    "restore",
                    "--restore-detached",
                    "--restore-sibling",
                    "--pidfile",
                    RESTORED_PID,
                ],
                images,
                &p,
                &work,
                RESTORE_LOG,
                &opts.flags,
                &gate,
            )
            .map_err(dir_err(&p))?;
        tracing::debug!(image = %image.path().display(), private = %p.display(), ?route, "criu restore");
        let deadline = opts.deadline;
        // One instant for every deadline of the restore: CRIU's kill and the check's give-up
        // (counted from CRIU's spawn, a few ms later, CRIU's deadline raced the check's, and a
        // loaded host's judge let CRIU's kill pass first: another refusal, in other words).
        let until = deadline.map(|d| t0 + d);
        // CRIU's start time: what it restored started after it (see `unresumed`).
        let criu_start = std::sync::OnceLock::new();
        // Its binary as its processes' `/proc/PID/exe` name it (links resolved).
        let bin = std::fs::canonicalize(&self.bin).ok();
        // What the sweep ends should this process die before the gate (see `scratch`).
        let record = |criu: Pid| {
            let rec = cryo_proc::stat(criu).map(|s| {
                let _ = criu_start.set(s.start_time);
                scratch::Restoring {
                    image: image.path().to_path_buf(),
                    criu,
                    criu_start: s.start_time,
                    bin: bin.clone(),
                }
            });
            if let Err(e) = rec
                .map_err(std::io::Error::other)
                .and_then(|r| private.record_restoring(&r))
            {
                tracing::warn!(error = %e, "cannot record the restore for the sweep");
            }
        };
        // The restored root's host pid, as CRIU named it at the gate.
        let gate_root = std::sync::OnceLock::new();
        let at_gate = |root: Option<Pid>| {
            let root = root.ok_or_else(|| {
                CriuError::Gate("CRIU's action script named no restored root".into())
            })?;
            let _ = gate_root.set(root);
            let r = at_gate(root).map_err(CriuError::Gate);
            let _ = verdict_at.set(std::time::Instant::now());
            r
        };
        // CRIU ended without passing the gate: what it restored never ran. CRIU removes it when
        // it fails by itself, not when it was killed (at its deadline, or by anyone else). Ended
        // before CRIU's log is cut: CRIU's restorer writes the log from inside those processes.
        let left: std::sync::OnceLock<unresumed::EndedRun> = std::sync::OnceLock::new();
        let end_left = |g: &Gated| {
            let passed = matches!(g.verdict, Some(Ok(())));
            let Some(since) = criu_start.get().copied() else {
                return;
            };
            // A CRIU given up on after its kill is waited for by the deadline layer's thread
            // (see `wait_until`): neither ended again nor reaped here.
            let criu = g.stuck.as_ref().map(|s| s.pid);
            if g.timed_out || (!passed && !g.succeeded()) {
                let run = unresumed::Run {
                    private: &p,
                    bin: bin.as_deref(),
                    criu_start: since,
                    criu,
                };
                let mut roots = unresumed::thread_children_since(since);
                roots.retain(|h| Some(h.pid()) != criu);
                // Every child of ours since CRIU started is among the roots: killed and waited
                // for (one grace for all), or handed to the deadline layer if stuck.
                let ended = unresumed::end_run(None, roots, &run);
                unresumed::reap_children_since(since, criu);
                let _ = left.set(ended);
            } else if !g.succeeded() {
                unresumed::reap_children_since(since, criu);
            }
        };
        let (gated, served, refused) = match route {
            ThawRoute::Stream => {
                let listener =
                    UnixListener::bind(p.join(image::SERVE_SOCKET)).map_err(dir_err(&p))?;
                let server = image::Server::new(image);
                let gated = self.run_gated(
                    op,
                    cmd,
                    log,
                    Some(&listener),
                    gate,
                    until,
                    &[],
                    // CRIU ended or was killed before a verdict passed: the streamer stops, never
                    // waiting for a read that does not return (see `stream`).
                    &|_| server.stop(),
                    || server.serve(&listener),
                    |root| {
                        let _ = gate_at.set(std::time::Instant::now());
                        server.finish().map_err(CriuError::Image)?;
                        at_gate(root)
                    },
                    record,
                    end_left,
                )?;
                (gated, server.served_bytes(), server.failure())
            }
            ThawRoute::Files => {
                let check = image::Check::new_until(image, until).map_err(CriuError::Image)?;
                phases.checked_ms = since(std::time::Instant::now());
                let mut gated = self.run_gated(
                    op,
                    cmd,
                    log,
                    None,
                    gate,
                    until,
                    &check.refusals(),
                    // CRIU ended or was killed before a verdict passed: the check is stopped
                    // (its threads at their next chunk, a read that never returns left to its
                    // thread), never waited for to its end. Why the image was refused, if it
                    // was, is known by then (the check's failure, the watch); a CRIU that failed
                    // by itself failed on what it read as instructions, every byte of which was
                    // checked before it started, so the rest of the page contents could not say
                    // why (session 23: a thaw whose CRIU failed while the check's read hung
                    // returned at its deadline). At the deadline it is not stopped: every wait of
                    // the check ends at that same instant by itself, and says so in its own
                    // words, which are the restore's refusal then, whichever of the two saw the
                    // instant first (a stopped check says nothing of the image).
                    &|at_deadline| {
                        if !at_deadline {
                            check.stop()
                        }
                    },
                    || check.run(),
                    |root| {
                        let _ = gate_at.set(std::time::Instant::now());
                        check.raise();
                        check.finish().map_err(CriuError::Image)?;
                        at_gate(root)
                    },
                    record,
                    end_left,
                )?;
                phases.hashed_ms = check.hashed_at().and_then(since);
                // Why the image was refused, if the verdict did not say it (none was given)
                // or said nothing of the image (a change after a verdict that passed is not
                // this restore's: its tree runs). A verdict that failed only because the check
                // was stopped (CRIU ended while at its gate) says nothing of the image either.
                if check.finish_was_stopped()
                    && matches!(&gated.verdict, Some(Err(CriuError::Image(_))))
                {
                    gated.verdict = None;
                }
                let refused = match gated.verdict {
                    Some(Ok(()) | Err(CriuError::Image(_))) => None,
                    _ => check.refusal(),
                };
                (gated, image.manifest().total_bytes, refused)
            }
        };
        let succeeded = gated.succeeded();
        let Gated {
            status,
            verdict,
            timed_out,
            refused: ended_at_refusal,
            stuck,
            resumed,
            past_resume,
        } = gated;
        phases.criu_exit_ms = since(std::time::Instant::now());
        phases.gate_ms = gate_at.get().copied().and_then(since);
        phases.verdict_ms = verdict_at.get().copied().and_then(since);
        tracing::debug!(?phases, "criu restore phases");
        let log = work.join(RESTORE_LOG);
        let passed = matches!(verdict, Some(Ok(())));
        // At the deadline, a check that had not given its verdict gave up at the same instant
        // (see `until`): its refusal is the restore's, whichever saw the instant first.
        let check_refused = matches!(route, ThawRoute::Files)
            && (refused.is_some() || matches!(verdict, Some(Err(CriuError::Image(_)))));
        if timed_out || (!passed && !succeeded) {
            let ended = left.into_inner().unwrap_or_default();
            if timed_out && check_refused {
                tracing::warn!(killed = ?ended.killed, left = ?ended.left, "the restore's deadline passed with the image's check unfinished: CRIU and what it restored (none of which ran) were ended");
                private.keep();
            } else if timed_out {
                private.keep();
                return Err(CriuError::TimedOut {
                    op,
                    after: deadline.unwrap_or_default(),
                    lines: last_lines(&log).into_boxed_slice(),
                    log,
                    killed: ended.killed,
                    left: ended.left,
                    stuck,
                });
            }
            if !ended.killed.is_empty() || !ended.left.is_empty() {
                tracing::warn!(killed = ?ended.killed, left = ?ended.left, "CRIU ended before its gate: what it left was ended");
            }
            if ended_at_refusal {
                tracing::info!(killed = ?ended.killed, "the image was refused before CRIU's gate: CRIU and what it restored (none of which ran) were ended");
            }
            if let Some(s) = &stuck {
                // Named when given up on (see `wait_until`); its directory stays with its log.
                tracing::error!(
                    pid = s.pid,
                    "CRIU, ended at the image's refusal, did not exit"
                );
                private.keep();
            }
        }
        tracing::debug!(?status, served, "criu restore ended");
        if past_resume && !status.is_none_or(|s| s.success()) {
            tracing::warn!(?status, "CRIU exited with an error after it resumed the tree (its post-resume stage): the tree runs, and is restored on");
        }
        // A refused image: the reason is the image's, CRIU's log of it is of no use.
        if let Some(e) = refused {
            return Err(CriuError::Image(e));
        }
        match verdict {
            Some(Err(e)) => return Err(e),
            Some(Ok(())) if succeeded => {}
            _ => {
                private.keep();
                let mut err = failed(op, log, None);
                if let CriuError::Failed { lines, .. } = &mut err {
                    if succeeded {
                        lines.push("CRIU resumed the tree without passing cryo's gate".into());
                    }
                    if lines.iter().all(|l| l.starts_with("cannot read")) {
                        lines.extend(stderr_tail(&stderr));
                    }
                }
                return Err(err);
            }
        }
        // The root's host pid as CRIU names it (its pidfile, else what it named at the gate),
        // never the image's: a tree with a pid namespace of its own is back under another.
        let Some(pid) = std::fs::read_to_string(work.join(RESTORED_PID))
            .ok()
            .and_then(|t| t.trim().parse::<Pid>().ok())
            .or_else(|| gate_root.get().copied())
        else {
            return Err(CriuError::Failed {
                op,
                log,
                lines: vec!["CRIU named no restored root (no pidfile, none at the gate)".into()],
            });
        };
        if let Some(r) = resumed {
            r.finish_later(private);
        }
        Ok(Restored {
            pid,
            served_bytes: served,
            phases,
        })
    }
}

impl CriuRpc {
    /// `criu dump -t PID` into `staging` (`images`: the staging directory's fd or cryo's
    /// capture), with the `post-dump` gate in the private directory `private` and CRIU's log
    /// in the staging directory (its work directory).
    fn dump_command(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        images: Images<'_>,
        private: &Path,
    ) -> Result<(Command, File, FileCap, Gate), CriuError> {
        let dir_err = |source| CriuError::Dir {
            op: CriuOp::Dump,
            path: private.to_path_buf(),
            source,
        };
        let gate = Gate::new(private, "post-dump", false).map_err(dir_err)?;
        let pid_arg = pid.to_string();
        let mut head = vec!["dump", "-t", &pid_arg];
        if opts.leave_running {
            head.push("--leave-running");
        }
        let (cmd, stderr, log) = self
            .gated_command(
                &head,
                images,
                private,
                staging.path(),
                DUMP_LOG,
                &opts.flags,
                &gate,
            )
            .map_err(dir_err)?;
        Ok((cmd, stderr, log, gate))
    }

    /// What a gated dump's end (`gated`) says: the gate's refusal, CRIU's failure (with its log's
    /// error lines, or its stderr when the log cannot be read), or success.
    fn dump_outcome(
        &self,
        op: CriuOp,
        staging: &Staging,
        gated: Gated,
        stderr: &File,
    ) -> Result<(), CriuError> {
        let succeeded = gated.succeeded();
        match gated.verdict {
            Some(Err(e)) => Err(e),
            Some(Ok(())) if succeeded => Ok(()),
            _ => {
                let mut err = failed(op, staging.path().join(DUMP_LOG), None);
                if let CriuError::Failed { lines, .. } = &mut err {
                    if succeeded {
                        lines.push("CRIU ended the dump without passing cryo's gate".into());
                    }
                    if lines.iter().all(|l| l.starts_with("cannot read")) {
                        lines.extend(stderr_tail(stderr));
                    }
                    lines.extend(full_file_system(staging.path()));
                }
                Err(err)
            }
        }
    }

    /// Dumps through cryo's image capture (`CRYO_DUMP_STREAM=1`): CRIU runs as `criu dump
    /// --stream` (CRIU's RPC cannot stream) and sends every image file to cryo, which writes
    /// it into the staging directory and hashes it on the way ([`image::Capture`]); CRIU's log
    /// goes into the staging directory (its work directory). CRIU's `post-dump` action script
    /// waits at the gate until every byte is written, so the tree is killed only after that,
    /// and resumed by CRIU if anything was refused ([`CriuError::Image`]).
    pub fn dump_streamed(
        &self,
        pid: Pid,
        staging: &Staging,
        opts: &DumpOpts,
        at_gate: &DumpGate<'_>,
    ) -> Result<(), CriuError> {
        let op = CriuOp::Dump;
        let dir_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| CriuError::Dir { op, path, source }
        };
        let _cwd = self.cwd_lock(pid)?;
        // Private to root (0700): the capture's socket, the gate.
        let private = self.private(op, scratch::DUMP_PREFIX)?;
        let p = private.path().to_path_buf();
        let listener = UnixListener::bind(p.join(image::CAPTURE_SOCKET)).map_err(dir_err(&p))?;
        let (cmd, stderr, log, gate) = self.dump_command(pid, staging, opts, Images::Stream, &p)?;
        tracing::debug!(pid, staging = %staging.path().display(), "criu dump --stream");
        let capture = staging.capture();
        let clock = capture.clock();
        let gated = self.run_gated(
            op,
            cmd,
            log,
            Some(&listener),
            gate,
            None,
            &[],
            &|_| {},
            || capture.serve(&listener),
            |_| {
                image::CaptureClock::mark(&clock.gate);
                let v = at_gate()
                    .map_err(CriuError::DumpGate)
                    .and_then(|()| capture.written().map_err(CriuError::Image));
                image::CaptureClock::mark(&clock.verdict);
                v
            },
            |_| {},
            |_| {},
        )?;
        image::CaptureClock::mark(&clock.criu_exit);
        tracing::debug!(status = ?gated.status, written = capture.written_bytes(), "criu dump --stream ended");
        if let Some(e) = capture.failure() {
            return Err(CriuError::Image(e));
        }
        self.dump_outcome(op, staging, gated, &stderr)?;
        staging.adopt(capture).map_err(CriuError::Image)
    }
}

/// How a thaw's CRIU gets the image's bytes; either way nothing restored runs before every
/// byte matched. Chosen by measurement (see [`image::Check`] and `cryo bench freeze`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThawRoute {
    /// CRIU reads the image's files itself (its fastest path: pages read into place) while cryo
    /// checks the same files beside it and watches them for changes.
    Files,
    /// CRIU reads through cryo's image streamer, chunk by checked chunk (`--stream`).
    Stream,
}

impl ThawRoute {
    /// `CRYO_THAW_STREAM=1`: the stream; otherwise the files.
    pub fn from_env() -> ThawRoute {
        if std::env::var_os("CRYO_THAW_STREAM").is_some_and(|v| v == "1") {
            ThawRoute::Stream
        } else {
            ThawRoute::Files
        }
    }
}

/// Says what happened to CRIU's capped log `log` (its keeper thread's result).
fn report_log(log: &Path, joined: std::thread::Result<std::io::Result<crate::log::Copied>>) {
    match joined {
        Ok(Ok(c)) if c.cut > 0 => {
            tracing::warn!(log = %log.display(), total = c.total, cut = c.cut, "CRIU's log was cut to its cap");
        }
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            tracing::warn!(log = %log.display(), error = %e, "keeping CRIU's log failed");
        }
        Err(_) => tracing::warn!("the log thread panicked"),
    }
}

/// Where a gated CRIU command reads or writes the image.
enum Images<'a> {
    /// Through cryo's streamer socket in the private directory (`--stream`).
    Stream,
    /// In the image directory itself, the one cryo opened (inherited by CRIU).
    Dir(std::os::fd::BorrowedFd<'a>),
}

/// What [`Criu::restore_image`] restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Restored {
    /// The restored root's host pid.
    pub pid: Pid,
    /// Bytes of the image checked for the restore: every byte of it when CRIU reads the files
    /// ([`ThawRoute::Files`]); through the streamer, those CRIU was sent (the rest is checked at
    /// the gate).
    pub served_bytes: u64,
    /// Where the restore's time went.
    pub phases: RestorePhases,
}

/// The moments of one restore, ms from its start (`None`: not reached or not measured), so a
/// slow restore says whether CRIU or cryo's check was the slow one.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct RestorePhases {
    /// cryo's checks before CRIU starts (the watch, every file but the page contents), done.
    pub checked_ms: Option<u64>,
    /// CRIU reached cryo's gate: every process restored, its memory read.
    pub gate_ms: Option<u64>,
    /// The page contents all checked ([`ThawRoute::Files`]).
    pub hashed_ms: Option<u64>,
    /// The verdict written (the gate waited for the check until then).
    pub verdict_ms: Option<u64>,
    /// CRIU exited, or was let go [`RESUMED_EXIT_GRACE`] past its `post-resume` stage after a
    /// verdict that passed (every task resumed and detached; see `Resumed`).
    pub criu_exit_ms: Option<u64>,
}

/// The moments of one streamed dump, ms from the start of the dump (`None`: not reached or
/// not measured), so a slow freeze says whether CRIU, the capture or the hashes were the slow
/// side.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub struct DumpPhases {
    /// Every byte CRIU sent is in the staging files (page cache).
    pub received_ms: Option<u64>,
    /// CRIU reached cryo's gate (`post-dump`): every image sent, the tree still frozen.
    pub gate_ms: Option<u64>,
    /// The gate's verdict (it waited for every byte to be written); CRIU then kills the tree.
    pub verdict_ms: Option<u64>,
    /// CRIU exited.
    pub criu_exit_ms: Option<u64>,
    /// Every chunk hashed (publish waits for it while it fsyncs); `None` when CRIU wrote the
    /// files itself (publish hashes what the follower left beside its fsyncs).
    pub hashed_ms: Option<u64>,
    /// Bytes cryo's follower hashed before publish took over (a dump CRIU wrote itself):
    /// what publish did not hash again.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub followed_bytes: Option<u64>,
}

impl DumpPhases {
    /// The moments `clock` holds, from `start`.
    pub fn of(clock: &image::CaptureClock, start: std::time::Instant) -> DumpPhases {
        let since = |t: Option<std::time::Instant>| {
            t.map(|t| {
                u64::try_from(t.saturating_duration_since(start).as_millis()).unwrap_or(u64::MAX)
            })
        };
        DumpPhases {
            received_ms: since(clock.received()),
            gate_ms: since(clock.gate()),
            verdict_ms: since(clock.verdict()),
            criu_exit_ms: since(clock.criu_exit()),
            hashed_ms: since(clock.hashed()),
            followed_bytes: clock.followed(),
        }
    }
}

/// What [`CriuRpc::run_gated`] saw.
struct Gated {
    /// CRIU's exit status; `None`: it did not exit after its kill ([`Gated::stuck`]).
    status: Option<std::process::ExitStatus>,
    verdict: Option<Result<(), CriuError>>,
    /// CRIU ran past its deadline and was killed.
    timed_out: bool,
    /// The image was refused before any verdict passed, and CRIU was killed then.
    refused: bool,
    /// CRIU, killed at its deadline or at the refusal, had not exited a while later: given
    /// up on (reaped later).
    stuck: Option<Box<Stuck>>,
    /// CRIU resumed the tree after a verdict that passed (its `post-resume` stage) and had
    /// not exited [`RESUMED_EXIT_GRACE`] later: see [`Resumed::finish_later`].
    resumed: Option<Resumed>,
    /// CRIU reached `post-resume` after a verdict that passed (every task resumed and
    /// detached), whether it was waited for or not: whatever its status, the tree runs.
    past_resume: bool,
}

impl Gated {
    /// CRIU exited successfully, or resumed the tree after a verdict that passed (its status
    /// past `post-resume` says nothing of the tree: CRIU 4.2 ends nothing of it there).
    fn succeeded(&self) -> bool {
        self.past_resume || self.status.is_some_and(|s| s.success())
    }
}

/// A CRIU past its `post-resume` stage after a verdict that passed that has not exited within
/// [`RESUMED_EXIT_GRACE`]: every task resumed and detached, and CRIU 4.2 ends nothing of them
/// past it (`restore_root_task`), whatever it does next (it only cleans up and exits; killed,
/// it leaves the tree running). The restore goes on without it rather than wait for its
/// deadline and then end the tree that ran. (Returning at `post-resume` itself, every time, was
/// measured not to pay: 1 GiB from the page cache, load 3-4.8, 8 rounds, the verdict to the
/// restore's return 18 ms median against 12 waiting for CRIU's exit, the GPU step's time past
/// its copy 60 against 38 ms, whole thaw 1.026 [0.960, 1.049]: the hand-offs and CRIU's exit
/// beside the GPU restore cost more on 2 vCPUs than the 3.2 ms of CRIU's exit they hide.)
///
/// Such a CRIU is killed at the restore's original deadline ([`Resumed::finish_later`]): a
/// CRIU stopped (SIGSTOP) or stuck in a wait that a signal ends held its place in
/// [`stuck_crius`] for good, and nine of them refused every restore of this process (session
/// 23). Killing it there is safe for the same reason it is let go: its tasks are resumed and
/// detached, and nothing of CRIU ends them. The deadline rather than a grace past
/// `post-resume`: it is the bound the caller set on CRIU's whole run, never earlier than the
/// restore would have killed it anyway, so a slow but healthy cleanup keeps the time it had.
/// A CRIU in state `D` (a wait no signal ends) still holds its place until that wait ends.
#[derive(Debug)]
struct Resumed {
    criu: std::process::Child,
    /// The restore's deadline: CRIU is killed if it has not exited by then (`None`: the
    /// restore had none, and CRIU is waited for without a bound).
    kill_at: Option<std::time::Instant>,
    /// Dropped once CRIU exited: its log's keeper finishes the log then.
    done: std::sync::mpsc::Sender<()>,
    copied: std::thread::JoinHandle<std::io::Result<crate::log::Copied>>,
    log: PathBuf,
}

impl Resumed {
    /// Waits for CRIU, finishes its log, then drops `keep` (the run's private directory), on a
    /// thread of the deadline layer, counted in [`stuck_crius`] until CRIU exits; past the
    /// restore's deadline (`kill_at`), CRIU is killed (SIGKILL: its tree runs on untouched).
    /// A CRIU that never exits even then (state `D`) holds that thread as a stuck one does. A
    /// CRIU that exits with an error there is logged: the tree it resumed runs all the same,
    /// and is the caller's.
    fn finish_later(self, keep: impl Send + 'static) {
        let Resumed {
            mut criu,
            kill_at,
            done,
            copied,
            log,
        } = self;
        let pid = criu.id();
        let said = move |status: std::io::Result<std::process::ExitStatus>| match status {
            Ok(s) if s.success() => {}
            Ok(s) => {
                tracing::warn!(pid, %s, "CRIU exited with an error after it resumed the tree (its post-resume stage): the tree runs")
            }
            // Reaped by a reaper of this thread's ended children (the agent's thaw thread).
            Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {}
            Err(e) => {
                tracing::warn!(pid, error = %e, "waiting for a CRIU past its post-resume stage")
            }
        };
        let place = HeldPlace::new(
            "CRIUs that resumed their trees (their post-resume stage: the trees run) and have not exited",
            vec![pid as Pid],
        );
        let late = cryo_gpu::deadline::within_counted(
            &STUCK,
            std::time::Duration::ZERO,
            move || {
                let _place = place;
                kill_at_deadline(&criu, kill_at);
                let status = criu.wait();
                drop(done);
                report_log(&log, copied.join());
                drop(keep);
                status
            },
            said,
        );
        match late {
            Ok(status) => said(status),
            Err(Late::Elapsed(_)) => {}
            Err(e) => {
                tracing::error!(pid, ?e, "no thread to wait for a CRIU past its post-resume stage: it stays a zombie once it exits")
            }
        }
    }
}

/// Kills `criu` (past its `post-resume` stage: see [`Resumed`]) if it has not exited by
/// `kill_at`; returns at once when it exits first, or when there is no `kill_at`. Signalled by
/// its pidfd, so never another process that took its pid (one reaped by the kernel, `SIGCHLD`
/// ignored).
fn kill_at_deadline(criu: &std::process::Child, kill_at: Option<std::time::Instant>) {
    let Some(at) = kill_at else {
        return;
    };
    let pid = criu.id();
    let Ok(pidfd) = rustix::process::pidfd_open(
        rustix::process::Pid::from_child(criu),
        rustix::process::PidfdFlags::empty(),
    ) else {
        // Reaped already (by the kernel, SIGCHLD ignored): nothing to kill.
        return;
    };
    let left = at.saturating_duration_since(std::time::Instant::now());
    match exits_within(&pidfd, left) {
        Ok(true) => {}
        Ok(false) => {
            let state = cryo_proc::stat(pid as Pid).map_or('?', |s| s.state);
            tracing::warn!(pid, %state, "CRIU, past its post-resume stage (its tree runs), had not exited at the restore's deadline: killing it (its tree runs on)");
            if let Err(e) =
                rustix::process::pidfd_send_signal(&pidfd, rustix::process::Signal::Kill)
            {
                tracing::warn!(pid, error = %e, "cannot kill a CRIU past its post-resume stage");
            }
        }
        Err(e) => {
            tracing::warn!(pid, error = %e, "cannot wait for a CRIU past its post-resume stage until the restore's deadline");
        }
    }
}

/// How long a restore waits for CRIU's exit once CRIU has resumed the tree after a verdict that
/// passed (its `post-resume` stage), before it goes on without it ([`Resumed`]): CRIU only
/// cleans up and exits there (1.3-9.3 ms measured, 1 GiB, load 2.5-4.8), and ends nothing of
/// the tree whatever it does.
pub const RESUMED_EXIT_GRACE: std::time::Duration = std::time::Duration::from_secs(1);

/// How long a CRIU killed at its deadline may take to exit before cryo gives up on it: a killed
/// process exits within milliseconds unless it waits where no signal reaches it.
pub const KILLED_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// How many CRIUs given up on after their kill ([`Stuck`]), and groups of restored processes
/// given up on with them, may still be waited for before a new CRIU with a deadline is refused
/// ([`CriuError::TooManyStuck`]): each holds a thread of the deadline layer until it exits.
pub const MAX_STUCK_CRIUS: usize = 8;

static STUCK: Abandoned = Abandoned::new(MAX_STUCK_CRIUS);

/// What holds each place of [`STUCK`] ([`HeldPlace`]), said when a CRIU is refused past the
/// budget ([`CriuError::TooManyStuck`]).
static HELD: std::sync::Mutex<Vec<(u64, &'static str, Vec<Pid>)>> =
    std::sync::Mutex::new(Vec::new());

static NEXT_HELD: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// One place of [`STUCK`] as a refusal names it: what waits (`what`) and its pids; given back
/// when dropped (by the thread of the deadline layer that waited, once its wait ended).
struct HeldPlace(u64);

impl HeldPlace {
    fn new(what: &'static str, pids: Vec<Pid>) -> HeldPlace {
        let id = NEXT_HELD.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        HELD.lock()
            .unwrap_or_else(|p| p.into_inner())
            .push((id, what, pids));
        HeldPlace(id)
    }

    /// The places held now, by kind: how many, what they are, and each pid's state and kernel
    /// wait as `/proc` says them now.
    fn said() -> Vec<String> {
        let held = HELD.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut kinds: Vec<(&'static str, usize, Vec<String>)> = Vec::new();
        for (_, what, pids) in held {
            let said = pids.iter().map(|&p| {
                let state = cryo_proc::stat(p).map_or('?', |s| s.state);
                match cryo_proc::wchan(p).unwrap_or_default() {
                    w if w.is_empty() || w == "0" => format!("pid {p} (state {state})"),
                    w => format!("pid {p} (state {state}, in {w})"),
                }
            });
            match kinds.iter_mut().find(|(w, _, _)| *w == what) {
                Some((_, n, all)) => {
                    *n += 1;
                    all.extend(said);
                }
                None => kinds.push((what, 1, said.collect())),
            }
        }
        kinds
            .into_iter()
            .map(|(what, n, pids)| format!("{n} of {what}: {}", pids.join(", ")))
            .collect()
    }
}

impl Drop for HeldPlace {
    fn drop(&mut self) {
        HELD.lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|(id, _, _)| *id != self.0);
    }
}

/// CRIUs of this process killed at their deadlines and given up on that have still not exited
/// (each is waited for by a thread of the deadline layer, which reaps it when it exits), and
/// groups of restored processes of one restore given up on after their kill (one thread
/// reaps each of a group as it exits; the group counts until its last is reaped).
pub fn stuck_crius() -> usize {
    STUCK.get()
}

/// What [`wait_until`] found.
struct Waited {
    /// CRIU's exit status; `Ok(None)`: it is stuck, and waited for elsewhere.
    status: std::io::Result<Option<std::process::ExitStatus>>,
    /// Killed at the deadline.
    timed_out: bool,
    /// Killed at a refusal of the image.
    refused: bool,
    /// Killed and not exited within [`KILLED_GRACE`].
    stuck: Option<Box<Stuck>>,
    /// CRIU resumed the tree (its `post-resume` stage) and had not exited
    /// [`RESUMED_EXIT_GRACE`] later: not waited for here.
    resumed: Option<std::process::Child>,
}

/// What [`wait_for`] saw first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Came {
    /// The process exited.
    Exited,
    /// The other fd of this index became readable (`true`: it has data), or hung up.
    Other(usize, bool),
    /// The limit passed.
    Elapsed,
}

/// Waits until the process of `pidfd` exits or one of `others` is readable, `limit` at most
/// (`None`: without one).
fn wait_for(
    pidfd: &OwnedFd,
    others: &[BorrowedFd<'_>],
    limit: Option<std::time::Duration>,
) -> std::io::Result<Came> {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    let until = limit.map(|l| std::time::Instant::now() + l);
    loop {
        let timeout = match until {
            None => PollTimeout::NONE,
            Some(until) => {
                let left = until.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    return Ok(Came::Elapsed);
                }
                PollTimeout::from(u16::try_from(left.as_millis()).unwrap_or(u16::MAX))
            }
        };
        let mut fds = vec![PollFd::new(pidfd.as_fd(), PollFlags::POLLIN)];
        fds.extend(others.iter().map(|f| PollFd::new(*f, PollFlags::POLLIN)));
        match poll(&mut fds, timeout) {
            Ok(0) | Err(nix::Error::EINTR) => continue,
            Ok(_) => {}
            Err(e) => return Err(e.into()),
        }
        let ready = |f: &PollFd<'_>| f.revents().is_some_and(|r| !r.is_empty());
        if ready(&fds[0]) {
            return Ok(Came::Exited);
        }
        if let Some(i) = fds[1..].iter().position(ready) {
            let data = fds[i + 1]
                .revents()
                .is_some_and(|r| r.contains(PollFlags::POLLIN));
            return Ok(Came::Other(i, data));
        }
    }
}

/// Whether the process of `pidfd` exits within `limit`.
fn exits_within(pidfd: &OwnedFd, limit: std::time::Duration) -> std::io::Result<bool> {
    wait_for(pidfd, &[], Some(limit)).map(|c| c == Came::Exited)
}

/// Between the gate's passing verdict and the kill of CRIU at a refusal of its image
/// ([`CriuRpc::run_gated`]): the first decides, the other does not happen. A verdict that
/// passed lets CRIU resume the tree, which must then never be ended for the image (it runs);
/// a CRIU killed at a refusal must never be told its image passed.
#[derive(Debug, Default)]
struct Decision(std::sync::atomic::AtomicU8);

impl Decision {
    const PASSED: u8 = 1;
    const REFUSED: u8 = 2;

    /// The verdict passes, unless CRIU was already killed at a refusal (`false`).
    fn pass(&self) -> bool {
        self.settle(Decision::PASSED)
    }

    /// CRIU is killed at a refusal, unless a verdict already passed (`false`).
    fn refuse(&self) -> bool {
        self.settle(Decision::REFUSED)
    }

    /// Whether a verdict passed.
    fn passed(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::SeqCst) == Decision::PASSED
    }

    fn settle(&self, to: u8) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        match self.0.compare_exchange(0, to, SeqCst, SeqCst) {
            Ok(_) => true,
            Err(was) => was == to,
        }
    }
}

/// Waits for `child`, past `until` no longer, nor past any of `refusals` readable while no
/// verdict passed (`decision`): then kills it (SIGKILL) and reaps it. A child
/// that has not exited [`KILLED_GRACE`] after its kill is stuck where no signal reaches it (an
/// uninterruptible wait: a read of a hung disk or file server, see [`Stuck`]): it is named, from
/// `/proc` while it is still this process's unreaped child, and handed to a thread of the
/// deadline layer that reaps it whenever its wait ends, and the caller gets on at once. Once
/// `resumed` has data (CRIU past `post-resume` after a verdict that passed), the deadline no
/// longer applies: CRIU is waited for [`RESUMED_EXIT_GRACE`] at most, then returned unkilled.
/// `give_up` runs at a kill that no verdict passed before (see [`CriuRpc::run_gated`]; its
/// argument: the kill is at `until`), before the wait for CRIU's exit.
fn wait_until(
    mut child: std::process::Child,
    until: Option<std::time::Instant>,
    refusals: &[BorrowedFd<'_>],
    decision: &Decision,
    resumed: Option<BorrowedFd<'_>>,
    give_up: &(dyn Fn(bool) + Sync),
) -> Waited {
    let exited = |status: std::io::Result<std::process::ExitStatus>, timed_out, refused| Waited {
        status: status.map(Some),
        timed_out,
        refused,
        stuck: None,
        resumed: None,
    };
    if until.is_none() && refusals.is_empty() && resumed.is_none() {
        return exited(status_of(&mut child), false, false);
    }
    let pidfd = match rustix::process::pidfd_open(
        rustix::process::Pid::from_child(&child),
        rustix::process::PidfdFlags::empty(),
    ) {
        Ok(fd) => fd,
        Err(e) => return exited(Err(e.into()), false, false),
    };
    // The resumed pipe first, then the refusals (until a verdict passed).
    let (mut resumed, mut refusals, mut until) = (resumed, refusals, until);
    let mut past_resume = false;
    let pid = child.id() as Pid;
    let timed_out = loop {
        let left = until.map(|u| u.saturating_duration_since(std::time::Instant::now()));
        let watched: Vec<BorrowedFd<'_>> = resumed
            .into_iter()
            .chain(refusals.iter().copied())
            .collect();
        match wait_for(&pidfd, &watched, left) {
            Ok(Came::Exited) => return exited(status_of(&mut child), false, false),
            // Past `post-resume` and its grace: let go, never killed (nor what it resumed).
            Ok(Came::Elapsed) if past_resume => {
                tracing::warn!(pid, grace = ?RESUMED_EXIT_GRACE, "CRIU has not exited since it resumed the tree: the restore goes on without it");
                return Waited {
                    status: Ok(None),
                    timed_out: false,
                    refused: false,
                    stuck: None,
                    resumed: Some(child),
                };
            }
            Ok(Came::Elapsed) => {
                tracing::warn!(pid, "CRIU ran past its deadline: killing it");
                break true;
            }
            // Past `post-resume` (after a verdict that passed): CRIU ends nothing of the tree
            // any more; its exit, due within milliseconds, is waited for [`RESUMED_EXIT_GRACE`]
            // at most, and its deadline no longer applies. (The data stays in the pipe: the
            // caller reads from it that CRIU got there.)
            Ok(Came::Other(0, true)) if resumed.is_some() => {
                (past_resume, resumed, refusals) = (true, None, &[]);
                until = Some(std::time::Instant::now() + RESUMED_EXIT_GRACE);
            }
            // The judge returned without saying so (no verdict passed, or CRIU ended first):
            // its end of the pipe is gone, and CRIU is waited for as before.
            Ok(Came::Other(0, false)) if resumed.is_some() => resumed = None,
            Ok(Came::Other(..)) if decision.refuse() => {
                tracing::warn!(
                    pid,
                    "the image was refused before CRIU's gate: killing CRIU"
                );
                break false;
            }
            // A verdict passed first: CRIU resumes the tree, which is no longer ended for
            // the image (the caller finds the change, if it cares, once CRIU exited).
            Ok(Came::Other(..)) => refusals = &[],
            Err(e) => return exited(Err(e), false, false),
        }
    };
    let refused = !timed_out;
    let _ = child.kill();
    if !decision.passed() {
        give_up(timed_out);
    }
    match exits_within(&pidfd, KILLED_GRACE) {
        Ok(true) => return exited(status_of(&mut child), timed_out, refused),
        Ok(false) => {}
        Err(e) => return exited(Err(e), timed_out, refused),
    }
    // Not reaped: the pid is still this child's, a bare pid names it.
    let stuck = Stuck {
        pid,
        state: cryo_proc::stat(pid).map_or('?', |s| s.state),
        wchan: cryo_proc::wchan(pid).unwrap_or_default(),
        waited: KILLED_GRACE,
    };
    tracing::error!(pid, state = %stuck.state, wchan = %stuck.wchan, "CRIU did not exit after its kill: given up on, reaped when its wait ends");
    reap_later(child);
    Waited {
        status: Ok(None),
        timed_out,
        refused,
        stuck: Some(Box::new(stuck)),
        resumed: None,
    }
}

/// CRIU's exit status, once it exited. Taken by another waiter of this process first (a
/// process that ignores `SIGCHLD`, which `execve` keeps ignored from a parent that did, has
/// every child reaped by the kernel; a reaper of any child of this process's), it is not known:
/// CRIU is taken for one that failed (exit status 255), and a restore whose CRIU passed
/// `post-resume` hands its tree over all the same (the status says nothing of the tree then).
/// (Session 23: with `SIGCHLD` ignored, a restore whose CRIU had resumed the tree and exited
/// failed with "cannot start /usr/local/sbin/criu swrk: No child processes", its tree left
/// running, owned by nobody.)
fn status_of(child: &mut std::process::Child) -> std::io::Result<std::process::ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    match child.wait() {
        Err(e) if e.raw_os_error() == Some(libc::ECHILD) => {
            tracing::warn!(
                pid = child.id(),
                "CRIU's exit status was taken by another waiter (SIGCHLD ignored?): taken for a failure"
            );
            Ok(std::process::ExitStatus::from_raw(255 << 8))
        }
        r => r,
    }
}

/// Hands `child` (killed, stuck) to a thread of the deadline layer that waits for it and reaps
/// it, counted in [`stuck_crius`] until then.
fn reap_later(mut child: std::process::Child) {
    let pid = child.id();
    let place = HeldPlace::new(
        "CRIUs killed (at their deadlines or at a refusal) that have not exited",
        vec![pid as Pid],
    );
    let late = cryo_gpu::deadline::within_counted(
        &STUCK,
        std::time::Duration::ZERO,
        move || {
            let _place = place;
            child.wait()
        },
        move |waited| match waited {
            Ok(status) => {
                tracing::warn!(pid, %status, "a CRIU given up on after its kill exited: reaped")
            }
            Err(e) => {
                tracing::warn!(pid, error = %e, "waiting for a CRIU given up on after its kill")
            }
        },
    );
    match late {
        // Exited meanwhile (reaped) or handed over (counted, reaped when it exits).
        Ok(_) | Err(Late::Elapsed(_)) => {}
        Err(e) => {
            tracing::error!(
                pid,
                ?e,
                "no thread to wait for a stuck CRIU: it stays a zombie once it exits"
            );
        }
    }
}

/// Hands `procs` (restored processes that did not exit within [`KILLED_GRACE`] of their kill:
/// stuck where no signal reaches them; this process's children) to one thread of the deadline
/// layer, which reaps each as soon as it exits, counted in [`stuck_crius`] (once for them all)
/// until the last is reaped. `false`: no thread took them (past [`MAX_STUCK_CRIUS`], or none
/// could start): each stays a zombie once it exits, until this process reaps its children
/// otherwise or ends.
pub(crate) fn reap_stuck_later(procs: Vec<cryo_proc::ProcHandle>) -> bool {
    let pids: Vec<Pid> = procs.iter().map(cryo_proc::ProcHandle::pid).collect();
    let place = HeldPlace::new(
        "groups of processes a CRIU restored, killed (none ran), that have not exited",
        pids.clone(),
    );
    let late = cryo_gpu::deadline::within_counted(
        &STUCK,
        std::time::Duration::ZERO,
        move || {
            let _place = place;
            reap_each_when_ended(procs)
        },
        move |()| {
            tracing::warn!(
                ?pids,
                "restored processes given up on after their kill exited: reaped"
            )
        },
    );
    match late {
        // Exited meanwhile (reaped) or handed over (counted, reaped when they exit).
        Ok(()) | Err(Late::Elapsed(_)) => true,
        Err(e) => {
            tracing::error!(?e, "no thread to reap restored processes stuck after their kill: each stays a zombie once it exits");
            false
        }
    }
}

/// Waits for every one of `procs` (this process's children) to exit, reaping each as it does
/// ([`cryo_proc::reap_ended`]: by its pidfd, so exactly that process, and never what a tracer of
/// this process is owed).
fn reap_each_when_ended(mut procs: Vec<cryo_proc::ProcHandle>) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    while !procs.is_empty() {
        let ended: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = procs
                .iter()
                .map(|h| PollFd::new(h.pidfd(), PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::Error::EINTR) => {}
                Err(e) => {
                    tracing::error!(error = %e, "cannot wait for restored processes stuck after their kill: each stays a zombie once it exits");
                    return;
                }
            }
            fds.iter()
                .map(|f| f.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        let mut left = Vec::with_capacity(procs.len());
        for (h, ended) in procs.into_iter().zip(ended) {
            if !ended {
                left.push(h);
                continue;
            }
            // `None`: reaped by another waiter of this process already (the agent's thaw
            // thread reaps its own children), or its tracer's.
            match cryo_proc::reap_ended(&h) {
                Ok(Some(end)) => tracing::warn!(
                    pid = h.pid(),
                    %end,
                    "a restored process given up on after its kill ended: reaped"
                ),
                Ok(None) => {}
                Err(e) => {
                    tracing::warn!(pid = h.pid(), error = %e, "cannot reap a restored process given up on after its kill")
                }
            }
        }
        procs = left;
    }
}

/// Test hook: the environment variable naming a file; while it is set and the file does not
/// exist, a restore's CRIU is held in its `post-resume` stage (its tree resumed), as a CRIU
/// slow to exit after it would be (see `Gate::new`).
pub const CRIU_POST_RESUME_HELD: &str = "CRYO_FAILPOINT_CRIU_POST_RESUME";

/// The file CRIU writes the restored root's pid into (in the work directory).
const RESTORED_PID: &str = "restored.pid";

/// The last lines of CRIU's log (where it was when it stopped).
fn last_lines(log: &Path) -> Vec<String> {
    let text = match std::fs::read(log) {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(e) => return vec![format!("cannot read {}: {e}", log.display())],
    };
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    all[all.len().saturating_sub(3)..]
        .iter()
        .map(|l| l.trim().to_string())
        .collect()
}

fn stderr_tail(mut f: &File) -> Vec<String> {
    let mut text = String::new();
    let _ = f.rewind();
    let _ = f.read_to_string(&mut text);
    let lines: Vec<String> = text
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_string)
        .collect();
    lines[lines.len().saturating_sub(5)..].to_vec()
}

/// The hand-off between CRIU's action script at one stage and the streamer's verdict.
///
/// CRIU runs its action script (`sh -c SCRIPT`) at every stage; at `post-restore` (every
/// process restored, none resumed; a failing script makes CRIU abort and kill the tree) or
/// `post-dump` (every image written, the tree still frozen; a failing script makes CRIU resume
/// it instead of killing it) the script writes a line with the tree's root pid (CRIU's
/// `CRTOOLS_INIT_PID`) into the FIFO `reached` (opened read-write, so it never blocks) and then
/// takes a shared `flock` on `gate`, which cryo holds exclusively until it has written its
/// verdict there; it succeeds only if the verdict reads `ok`. The script opens `gate` itself,
/// has `flock` lock that open file, and reads the verdict with the shell's own `read`: one
/// program started besides the shell (`exec flock -s GATE grep -qx ok GATE` started two, and
/// the gate stands between CRIU's last write and the tree's end: 3.0 against 1.6 ms median
/// for the script alone, 30 runs, load 6). If cryo dies, its lock goes with
/// it and the verdict was never written: the restore is aborted, never resumed unchecked, and
/// the dumped tree is resumed, never killed.
#[derive(Debug)]
struct Gate {
    reached: File,
    verdict: Flock<File>,
    script: String,
    /// Its script says when CRIU reached `post-resume` (a restore's gate).
    resumes: bool,
}

impl Gate {
    /// A gate in `dir` for CRIU's stage `stage` (`post-restore`, `post-dump`); with
    /// `resumed` (a restore), the script also says when CRIU reached its `post-resume` stage
    /// (see [`Gate::judge`]).
    fn new(dir: &Path, stage: &str, resumed: bool) -> std::io::Result<Gate> {
        let reached = dir.join("reached");
        let gate = dir.join(scratch::GATE);
        let quote = |p: &Path| -> std::io::Result<String> {
            let s = p.to_str().filter(|s| !s.contains('\''));
            s.map(|s| format!("'{s}'"))
                .ok_or_else(|| std::io::Error::other(format!("unusable path {}", p.display())))
        };
        // CRIU 4.2 runs `post-resume` once it has resumed and detached every task; past it,
        // nothing of CRIU ends the tree (`restore_root_task`). The line is all: CRIU ignores
        // the script's status there. A test hook ([`CRIU_POST_RESUME_HELD`], a file) holds
        // CRIU in that stage until the file exists: a CRIU slow to exit after it.
        let post_resume = if resumed {
            format!(
                "if [ \"$CRTOOLS_SCRIPT_ACTION\" = post-resume ]; then\n\
                 {{ echo \"resumed ${{CRTOOLS_INIT_PID:-0}}\" >&3; }} 3<>{r}\n\
                 while [ -n \"${held}\" ] && [ ! -e \"${held}\" ]; do sleep 0.05; done\n\
                 exit 0\nfi\n",
                r = quote(&reached)?,
                held = CRIU_POST_RESUME_HELD,
            )
        } else {
            String::new()
        };
        let script = format!(
            "#!/bin/sh\n# cryo's gate: CRIU resumes nothing unless cryo wrote its verdict 'ok'.\n\
             {post_resume}\
             [ \"$CRTOOLS_SCRIPT_ACTION\" = {stage} ] || exit 0\n\
             {{ echo \"reached ${{CRTOOLS_INIT_PID:-0}}\" >&3; }} 3<>{r} || exit 1\n\
             exec 4<{g} && flock -s 4 && read -r v <&4 && [ \"$v\" = ok ]\n",
            r = quote(&reached)?,
            g = quote(&gate)?,
        );
        let script_path = dir.join("gate.sh");
        let mut sf = File::options()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(&script_path)?;
        sf.write_all(script.as_bytes())?;
        drop(sf);
        let script = script_path
            .to_str()
            .ok_or_else(|| std::io::Error::other("unusable path"))?
            .to_string();
        nix::unistd::mkfifo(
            &reached,
            nix::sys::stat::Mode::S_IRUSR | nix::sys::stat::Mode::S_IWUSR,
        )?;
        let reached = File::options()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&reached)?;
        let f = File::options()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&gate)?;
        let verdict = Flock::lock(f, FlockArg::LockExclusiveNonblock)
            .map_err(|(_, e)| std::io::Error::from(e))?;
        Ok(Gate {
            reached,
            verdict,
            script,
            resumes: resumed,
        })
    }

    fn script(&self) -> &str {
        &self.script
    }

    /// Waits until CRIU reaches the stage (or exits, `criu` readable: then `None`), then asks
    /// for the `verdict` (on the whole image, given the root pid the script named), writes `ok`
    /// if it passed and `decision` lets it (CRIU was not killed at a refusal meanwhile), and
    /// lets the script go. With `resumed` (a restore's gate), after a verdict that passed it
    /// waits on for CRIU's `post-resume` stage (every task resumed and detached: past it CRIU
    /// ends nothing) and writes a byte into `resumed` then, unless CRIU ended first.
    fn judge(
        self,
        op: CriuOp,
        verdict: impl FnOnce(Option<Pid>) -> Result<(), CriuError>,
        criu: Option<OwnedFd>,
        stop: OwnedFd,
        decision: &Decision,
        resumed: Option<OwnedFd>,
    ) -> Option<Result<(), CriuError>> {
        // "reached PID": the line is short, written at once by the script's one `echo`.
        let line = match self.line(criu.as_ref(), &stop) {
            Ok(Some(l)) => l,
            Ok(None) => return None,
            Err(e) => {
                return Some(Err(gate_failed(
                    op,
                    format!("waiting for CRIU's action script: {e}"),
                )))
            }
        };
        let root = line
            .trim()
            .strip_prefix("reached ")
            .and_then(|p| p.trim().parse::<Pid>().ok())
            .filter(|p| *p > 0);
        let verdict = verdict(root).and_then(|()| {
            if decision.pass() {
                Ok(())
            } else {
                Err(CriuError::Gate(
                    "the image was refused while CRIU waited at the gate: CRIU was ended".into(),
                ))
            }
        });
        let Gate {
            reached,
            verdict: f,
            script: _,
            resumes,
        } = self;
        if verdict.is_ok() {
            if let Err(e) = f.write_all_at(b"ok\n", 0) {
                return Some(Err(gate_failed(
                    op,
                    format!("writing the gate's verdict: {e}"),
                )));
            }
        }
        // Dropping the lock lets CRIU's script read the verdict.
        drop(f);
        if let (Ok(()), Some(tx), true) = (&verdict, resumed, resumes) {
            let rest = Gate::line_of(&reached, criu.as_ref(), &stop);
            if matches!(&rest, Ok(Some(l)) if l.starts_with("resumed")) {
                let _ = rustix::io::write(&tx, b"r");
            }
        }
        Some(verdict)
    }

    /// The next line of the gate's FIFO, once there is one; `None`: CRIU exited (`criu`
    /// readable) or was waited for or given up on (`stop` hung up) first.
    fn line(&self, criu: Option<&OwnedFd>, stop: &OwnedFd) -> std::io::Result<Option<String>> {
        Gate::line_of(&self.reached, criu, stop)
    }

    fn line_of(
        reached: &File,
        criu: Option<&OwnedFd>,
        stop: &OwnedFd,
    ) -> std::io::Result<Option<String>> {
        use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
        loop {
            // `stop` ends (hangs up) once CRIU was waited for or given up on (stuck).
            let mut fds = vec![
                PollFd::new(reached.as_fd(), PollFlags::POLLIN),
                PollFd::new(stop.as_fd(), PollFlags::POLLIN),
            ];
            if let Some(c) = criu {
                fds.push(PollFd::new(c.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Err(nix::Error::EINTR) => continue,
                Err(e) => return Err(e.into()),
                Ok(_) => {}
            }
            let ready =
                |f: &PollFd<'_>, on: PollFlags| f.revents().is_some_and(|r| r.intersects(on));
            if ready(&fds[0], PollFlags::POLLIN) {
                break;
            }
            if fds[1..]
                .iter()
                .any(|f| ready(f, PollFlags::POLLIN | PollFlags::POLLHUP))
            {
                return Ok(None);
            }
        }
        // Each line is short, written at once by one `echo` of the script.
        let mut line = [0u8; 64];
        let n = (&*reached).read(&mut line).unwrap_or(0);
        Ok(Some(String::from_utf8_lossy(&line[..n]).into_owned()))
    }
}

fn has_libs(dir: &Path) -> bool {
    std::fs::read_dir(dir).is_ok_and(|rd| {
        rd.flatten().any(|e| {
            let n = e.file_name();
            let n = n.to_string_lossy();
            n.starts_with("lib") && n.contains(".so")
        })
    })
}

fn open_dir(op: CriuOp, path: &Path) -> Result<File, CriuError> {
    let f = File::open(path).map_err(|source| CriuError::Dir {
        op,
        path: path.to_path_buf(),
        source,
    })?;
    match f.metadata() {
        Ok(m) if m.is_dir() => Ok(f),
        Ok(_) => Err(CriuError::Dir {
            op,
            path: path.to_path_buf(),
            source: std::io::Error::from(std::io::ErrorKind::NotADirectory),
        }),
        Err(source) => Err(CriuError::Dir {
            op,
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn failed(op: CriuOp, log: PathBuf, errmsg: Option<String>) -> CriuError {
    let mut lines = error_lines(&log);
    if lines.is_empty() {
        if let Some(m) = errmsg.filter(|m| !m.trim().is_empty()) {
            lines.push(m.trim().to_string());
        }
    }
    CriuError::Failed { op, log, lines }
}

/// Below this many bytes free, the file system of a failed dump's image counts as full.
const FULL_BELOW: u64 = 1 << 20;

/// A line saying that the file system of `dir` (a failed dump's staging directory) is full,
/// when it is: the kernel's word for why the dump failed, where CRIU's own error line may be
/// missing (its log is in the same directory: filled by CRIU's lines first, one per host
/// mount at its dump level, it takes no error line any more).
fn full_file_system(dir: &Path) -> Option<String> {
    let st = rustix::fs::statvfs(dir).ok()?;
    let free = st.f_bavail.saturating_mul(st.f_frsize);
    (free < FULL_BELOW).then(|| {
        format!(
            "the image's file system is full ({free} bytes free of {} at {}): No space left on device",
            st.f_blocks.saturating_mul(st.f_frsize),
            dir.display()
        )
    })
}

/// CRIU's own `Error (file:line): ...` lines from `log`, the last few; the log's last lines when
/// it has none; one line saying so when it cannot be read.
pub fn error_lines(log: &Path) -> Vec<String> {
    let text = match std::fs::read(log) {
        Ok(b) => String::from_utf8_lossy(&b).into_owned(),
        Err(e) => return vec![format!("cannot read {}: {e}", log.display())],
    };
    let all: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let errors: Vec<&str> = all
        .iter()
        .copied()
        .filter(|l| l.contains("Error (") || l.contains("Error:"))
        // Logged at error level on every run without CAP_SYS_RESOURCE, and CRIU carries on.
        .filter(|l| !l.contains("Can't setup RLIMIT_NOFILE"))
        .collect();
    let pick = if errors.is_empty() { &all } else { &errors };
    pick[pick.len().saturating_sub(ERROR_LINES)..]
        .iter()
        .map(|l| l.trim().to_string())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_lines_prefer_criu_errors_and_keep_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("x.log");
        let mut text = String::from("(00.000001) starting\n");
        for i in 0..12 {
            text.push_str(&format!(
                "(00.0000{i:02}) Error (criu/cr-dump.c:{i}): bad {i}\n"
            ));
            text.push_str("(00.000100) noise\n");
        }
        std::fs::write(&log, text).unwrap();
        let lines = error_lines(&log);
        assert_eq!(lines.len(), ERROR_LINES);
        assert!(lines.last().unwrap().ends_with("bad 11"));
        assert!(lines.iter().all(|l| l.contains("Error (")));

        std::fs::write(&log, "a\nb\n").unwrap();
        assert_eq!(error_lines(&log), vec!["a", "b"]);
        assert!(error_lines(&dir.path().join("none"))[0].contains("cannot read"));
    }
}
