//! Finding CRIU and running dump and restore through `criu swrk`.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use cryo_proc::Pid;

use crate::error::{CriuError, CriuOp};
use crate::rpc::{CriuOpts, CriuReq, CriuReqType, Swrk};
use crate::version::CriuVersion;

/// The environment variable naming the CRIU binary.
pub const CRIU_ENV: &str = "CRYO_CRIU";
/// Where `scripts/install-criu.sh` installs CRIU.
pub const DEFAULT_CRIU: &str = "/usr/local/sbin/criu";
/// The log CRIU writes into the image directory while dumping.
pub const DUMP_LOG: &str = "dump.log";
/// The log CRIU writes into the restore work directory.
pub const RESTORE_LOG: &str = "restore.log";
/// How many of CRIU's error lines a [`CriuError::Failed`] carries.
const ERROR_LINES: usize = 8;

/// Options of a dump. The defaults are cryo's: the tree is gone afterwards, no terminal, no
/// established TCP connections, file locks kept, CRIU's log at level 4 (debug).
#[derive(Debug, Clone)]
pub struct DumpOpts {
    /// Keep the tree running after the dump (CRIU's `--leave-running`).
    pub leave_running: bool,
    /// The tree is a shell job: its session or terminal lies outside it (`--shell-job`).
    pub shell_job: bool,
    /// Dump established TCP connections (`--tcp-established`).
    pub tcp_established: bool,
    /// Dump file locks (`--file-locks`).
    pub file_locks: bool,
    /// Dump unix sockets connected to peers outside the tree (`--ext-unix-sk`).
    pub ext_unix_sk: bool,
    /// CRIU's log level, 0-4.
    pub log_level: i32,
    /// Resources declared external (`--external`), passed through as is.
    pub external: Vec<String>,
}

impl Default for DumpOpts {
    fn default() -> Self {
        DumpOpts {
            leave_running: false,
            shell_job: false,
            tcp_established: false,
            file_locks: true,
            ext_unix_sk: false,
            log_level: 4,
            external: Vec::new(),
        }
    }
}

/// Options of a restore. The restored tree always comes back as a sibling of the short-lived
/// CRIU worker, i.e. as a child of the calling process (CRIU's `rst_sibling`).
#[derive(Debug, Clone)]
pub struct RestoreOpts {
    /// See [`DumpOpts::shell_job`].
    pub shell_job: bool,
    /// See [`DumpOpts::tcp_established`].
    pub tcp_established: bool,
    /// See [`DumpOpts::file_locks`].
    pub file_locks: bool,
    /// See [`DumpOpts::ext_unix_sk`].
    pub ext_unix_sk: bool,
    /// CRIU's log level, 0-4.
    pub log_level: i32,
    /// Where CRIU writes `restore.log` and its stats. `None`: a fresh directory under the
    /// system's temporary directory, removed after a success and kept after a failure. Never
    /// the image directory: a restore must leave the image exactly as verified.
    pub work_dir: Option<PathBuf>,
    /// Resources declared external (`--external`), passed through as is.
    pub external: Vec<String>,
}

impl Default for RestoreOpts {
    fn default() -> Self {
        RestoreOpts {
            shell_job: false,
            tcp_established: false,
            file_locks: true,
            ext_unix_sk: false,
            log_level: 4,
            work_dir: None,
            external: Vec::new(),
        }
    }
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

    /// Restores the tree imaged in `images_dir` and returns the pid of its root (the pid it had
    /// when dumped). The restored root is a child of the calling process.
    fn restore(&self, images_dir: &Path, opts: &RestoreOpts) -> Result<Pid, CriuError>;

    /// The ones of `pids` a restore could not have: taken on this host as a pid, a process
    /// group or a session id ([`cryo_proc::pids_in_use`]).
    fn pids_in_use(&self, pids: &[Pid]) -> Vec<Pid> {
        cryo_proc::pids_in_use(pids)
    }
}

/// A CRIU binary that was found and is recent enough, driven through `criu swrk` RPC.
#[derive(Debug, Clone)]
pub struct CriuRpc {
    bin: PathBuf,
    lib_dir: Option<PathBuf>,
    version: CriuVersion,
}

impl CriuRpc {
    /// Finds CRIU and checks its version. Looks at `explicit`, else `$CRYO_CRIU`, else
    /// `/usr/local/sbin/criu`, else `criu` on `PATH`. An explicit path or `$CRYO_CRIU` that does
    /// not exist is [`CriuError::NotFound`], not a reason to look elsewhere. A binary whose
    /// directory also holds shared libraries (a carried build: `.carry/criu/`) runs with that
    /// directory in `LD_LIBRARY_PATH`.
    pub fn locate(explicit: Option<&Path>) -> Result<CriuRpc, CriuError> {
        let env = std::env::var_os(CRIU_ENV).filter(|v| !v.is_empty());
        let bin = match (explicit, env) {
            (Some(p), _) => Self::exists(p.to_path_buf())?,
            (None, Some(p)) => Self::exists(PathBuf::from(p))?,
            (None, None) => Self::search()?,
        };
        Self::at(bin)
    }

    /// Uses the binary at `bin` (no search), checking its version.
    pub fn at(bin: PathBuf) -> Result<CriuRpc, CriuError> {
        let bin = Self::exists(bin)?;
        let lib_dir = bin.parent().filter(|d| has_libs(d)).map(Path::to_path_buf);
        let version = CriuVersion::of_binary(&bin, lib_dir.as_deref())?;
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

    fn call(&self, op: CriuOp, req: &CriuReq) -> Result<crate::rpc::CriuResp, CriuError> {
        Swrk::start(&self.bin, self.lib_dir.as_deref())
            .and_then(|s| s.call(req))
            .map_err(|source| CriuError::Rpc { op, source })
    }
}

impl Criu for CriuRpc {
    fn version(&self) -> CriuVersion {
        self.version
    }

    fn dump(&self, pid: Pid, images_dir: &Path, opts: &DumpOpts) -> Result<(), CriuError> {
        let op = CriuOp::Dump;
        let dir = open_dir(op, images_dir)?;
        let req = CriuReq {
            r#type: CriuReqType::Dump as i32,
            opts: Some(CriuOpts {
                // CRIU opens /proc/<our pid>/fd/<n>: the fd need not be inherited.
                images_dir_fd: dir.as_raw_fd(),
                pid: Some(pid),
                leave_running: Some(opts.leave_running),
                shell_job: Some(opts.shell_job),
                tcp_established: Some(opts.tcp_established),
                file_locks: Some(opts.file_locks),
                ext_unix_sk: Some(opts.ext_unix_sk),
                log_level: Some(opts.log_level),
                log_file: Some(DUMP_LOG.to_string()),
                external: opts.external.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        tracing::debug!(pid, dir = %images_dir.display(), criu = %self.bin.display(), "criu dump");
        let resp = self.call(op, &req)?;
        drop(dir);
        if resp.success {
            Ok(())
        } else {
            Err(failed(op, images_dir.join(DUMP_LOG), resp.cr_errmsg))
        }
    }

    /// CRIU's worker exits right after the restore; the caller reaps (or, exiting, hands the
    /// tree to its reaper).
    fn restore(&self, images_dir: &Path, opts: &RestoreOpts) -> Result<Pid, CriuError> {
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
                shell_job: Some(opts.shell_job),
                tcp_established: Some(opts.tcp_established),
                file_locks: Some(opts.file_locks),
                ext_unix_sk: Some(opts.ext_unix_sk),
                log_level: Some(opts.log_level),
                log_file: Some(RESTORE_LOG.to_string()),
                external: opts.external.clone(),
                ..Default::default()
            }),
            ..Default::default()
        };
        tracing::debug!(dir = %images_dir.display(), work = %work_path.display(), "criu restore");
        let resp = self.call(op, &req)?;
        drop((dir, work));
        let log = work_path.join(RESTORE_LOG);
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
