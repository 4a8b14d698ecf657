//! A FUSE file system whose server takes a request and never answers it: the faithful way to put
//! a process into an uninterruptible wait (a dead disk, an NFS hard mount, a FUSE server that
//! stopped answering).
//!
//! # Why FUSE
//! A request the kernel already handed to the server is waited for uninterruptibly: the
//! kernel's `request_wait_answer` (`fs/fuse/dev.c`) waits interruptibly first, then (a signal
//! came) killably, and once the request was sent it waits with `wait_event`: the caller stays in
//! state `D`, SIGKILL included, until the server answers or the connection is aborted. No
//! failpoint in cryo fakes that: the process that reads is any process (CRIU, a checker).
//!
//! [`Stalling::mount`] mirrors a flat directory read-only (names, sizes, modes, owners, times;
//! every open direct, so no read is served from the page cache) and holds the requests it is
//! told to ([`Hold`]) for the files whose names a predicate takes, from every process but the
//! test's own (cryo's reads are answered; CRIU's, a child's, are not; cryo's too once
//! [`Stalling::hold_own`] was called), until
//! [`Stalling::answer_all`] answers each held one with `EIO` (or the value is dropped).
//! [`Stalling::mount_failing`] mirrors the same way with opens served from the page cache (so
//! that the files can be mapped) and holds nothing; once told ([`Stalling::fail_reads`]) it
//! drops the cached pages of the files the predicate takes and answers every read of them with
//! `EIO`: a disk that starts failing under a reader, a mapped one included. Built on `fuser`
//! (pure Rust, mounts directly as root: no libfuse, no `fusermount`).
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeMap;
use std::ffi::OsStr;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use fuser::{
    Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags, INodeNo, LockOwner, MountOption,
    OpenFlags, ReplyAttr, ReplyData, ReplyDirectory, ReplyEntry, ReplyOpen, Request,
};

/// Which requests the server holds (never answers) for the files it picks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Hold {
    /// Reads of the file's content.
    Reads,
    /// Opens of the file.
    Opens,
    /// Looks at the file's attributes (`stat` after a cached lookup, `fstat`).
    Stats,
}

/// A request held unanswered.
enum Held {
    Data(ReplyData),
    Open(ReplyOpen),
    Attr(ReplyAttr),
}

impl Held {
    fn fail(self) {
        match self {
            Held::Data(r) => r.error(Errno::EIO),
            Held::Open(r) => r.error(Errno::EIO),
            Held::Attr(r) => r.error(Errno::EIO),
        }
    }
}

#[derive(Default)]
struct Shared {
    held: Vec<Held>,
    /// Who sent each request held so far (the thread id the kernel names).
    senders: Vec<u32>,
    /// Once answered: nothing more is held.
    released: bool,
    /// This process's requests are held too (see [`Stalling::hold_own`]).
    own: bool,
    /// Reads of the picked files are answered with `EIO` (see [`Stalling::fail_reads`]).
    failing: bool,
}

struct Mirror {
    backing: PathBuf,
    /// Inode (2..) -> name, in the backing directory.
    names: BTreeMap<u64, String>,
    /// `None`: nothing is held ([`Stalling::mount_failing`]).
    hold: Option<Hold>,
    /// Opens bypass the page cache (`FOPEN_DIRECT_IO`).
    direct: bool,
    pick: Box<dyn Fn(&str) -> bool + Send + Sync>,
    /// Whose requests are held, by the id of the thread that sent them.
    from: Box<dyn Fn(u32) -> bool + Send + Sync>,
    shared: Arc<Mutex<Shared>>,
}

// Nothing cached: every open looks the name up, every stat asks the server.
const TTL: Duration = Duration::ZERO;

impl Mirror {
    fn attr(&self, ino: u64) -> Option<FileAttr> {
        let path = match ino {
            1 => self.backing.clone(),
            n => self.backing.join(self.names.get(&n)?),
        };
        let m = std::fs::symlink_metadata(&path).ok()?;
        let time = |s: i64, ns: i64| {
            UNIX_EPOCH
                + Duration::new(
                    u64::try_from(s).unwrap_or(0),
                    u32::try_from(ns).unwrap_or(0),
                )
        };
        Some(FileAttr {
            ino: INodeNo(ino),
            size: m.size(),
            blocks: m.blocks(),
            atime: time(m.atime(), m.atime_nsec()),
            mtime: time(m.mtime(), m.mtime_nsec()),
            ctime: time(m.ctime(), m.ctime_nsec()),
            crtime: time(m.ctime(), m.ctime_nsec()),
            kind: if m.is_dir() {
                FileType::Directory
            } else {
                FileType::RegularFile
            },
            perm: u16::try_from(m.mode() & 0o7777).unwrap_or(0o600),
            nlink: u32::try_from(m.nlink()).unwrap_or(1),
            uid: m.uid(),
            gid: m.gid(),
            rdev: 0,
            flags: 0,
            blksize: 4096,
        })
    }

    /// Whether a request of kind `hold` from `req` on inode `ino` is to be held.
    fn holds(&self, hold: Hold, req: &Request, ino: u64) -> bool {
        if Some(hold) != self.hold || ino == 1 {
            return false;
        }
        let Some(name) = self.names.get(&ino) else {
            return false;
        };
        let s = self.shared.lock().unwrap();
        // The test's own threads (cryo's) are answered unless asked for.
        let own = Path::new(&format!("/proc/self/task/{}", req.pid())).exists();
        (self.pick)(name) && !s.released && (s.own || !own) && (self.from)(req.pid())
    }

    fn hold(&self, req: &Request, held: Held) {
        let mut s = self.shared.lock().unwrap();
        s.senders.push(req.pid());
        s.held.push(held);
    }
}

impl Filesystem for Mirror {
    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let found = (u64::from(parent) == 1)
            .then(|| {
                self.names
                    .iter()
                    .find(|(_, n)| OsStr::new(n.as_str()) == name)
                    .map(|(i, _)| *i)
            })
            .flatten()
            .and_then(|i| self.attr(i));
        match found {
            Some(a) => reply.entry(&TTL, &a, fuser::Generation(0)),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        if self.holds(Hold::Stats, req, ino.into()) {
            return self.hold(req, Held::Attr(reply));
        }
        match self.attr(ino.into()) {
            Some(a) => reply.attr(&TTL, &a),
            None => reply.error(Errno::ENOENT),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        if self.holds(Hold::Opens, req, ino.into()) {
            return self.hold(req, Held::Open(reply));
        }
        let flags = if self.direct {
            FopenFlags::FOPEN_DIRECT_IO
        } else {
            FopenFlags::empty()
        };
        reply.opened(FileHandle(0), flags);
    }

    fn read(
        &self,
        req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        if self.holds(Hold::Reads, req, ino.into()) {
            return self.hold(req, Held::Data(reply));
        }
        let Some(name) = self.names.get(&u64::from(ino)) else {
            return reply.error(Errno::ENOENT);
        };
        if self.shared.lock().unwrap().failing && (self.pick)(name) {
            return reply.error(Errno::EIO);
        }
        let Ok(f) = std::fs::File::open(self.backing.join(name)) else {
            return reply.error(Errno::EIO);
        };
        let mut buf = vec![0u8; size as usize];
        let mut n = 0;
        while n < buf.len() {
            match std::os::unix::fs::FileExt::read_at(&f, &mut buf[n..], offset + n as u64) {
                Ok(0) => break,
                Ok(k) => n += k,
                Err(_) => return reply.error(Errno::EIO),
            }
        }
        reply.data(&buf[..n]);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        if u64::from(ino) != 1 {
            return reply.error(Errno::ENOTDIR);
        }
        let mut entries = vec![
            (1, FileType::Directory, ".".to_string()),
            (1, FileType::Directory, "..".to_string()),
        ];
        entries.extend(
            self.names
                .iter()
                .map(|(i, n)| (*i, FileType::RegularFile, n.clone())),
        );
        for (k, (i, kind, name)) in entries.into_iter().enumerate().skip(offset as usize) {
            if reply.add(INodeNo(i), (k + 1) as u64, kind, name) {
                break;
            }
        }
        reply.ok();
    }
}

/// A mounted stalling mirror (see the module docs); unmounted when dropped, after every held
/// request was answered.
pub struct Stalling {
    mountpoint: PathBuf,
    names: BTreeMap<u64, String>,
    shared: Arc<Mutex<Shared>>,
    session: Option<fuser::BackgroundSession>,
}

impl Stalling {
    /// Mounts at `mountpoint` (an empty directory, made if missing) a read-only mirror of the
    /// flat directory `backing` (its regular files), holding `hold` requests for the files
    /// `pick` takes, from every process but this one.
    pub fn mount(
        backing: &Path,
        mountpoint: &Path,
        hold: Hold,
        pick: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Stalling {
        Stalling::mount_as(backing, mountpoint, Some(hold), true, pick, |_| true)
    }

    /// [`Stalling::mount`], holding only the requests of the processes whose command line
    /// (`/proc/TID/cmdline`, its arguments joined by spaces) contains `from`: one helper
    /// process of many stuck (the image checker, never the CRIU beside it).
    pub fn mount_from(
        backing: &Path,
        mountpoint: &Path,
        hold: Hold,
        pick: impl Fn(&str) -> bool + Send + Sync + 'static,
        from: &str,
    ) -> Stalling {
        let from = from.to_string();
        Stalling::mount_as(backing, mountpoint, Some(hold), true, pick, move |tid| {
            std::fs::read(format!("/proc/{tid}/cmdline"))
                .map(|c| {
                    String::from_utf8_lossy(&c)
                        .replace('\0', " ")
                        .contains(&from)
                })
                .unwrap_or(false)
        })
    }

    /// Mounts at `mountpoint` a read-only mirror of `backing` whose opens are served from the
    /// page cache (so that its files can be mapped) and that holds reads of the files `pick`
    /// takes, from every process but this one, and from this one too once
    /// [`Stalling::hold_own`] dropped what was cached: a disk that stops answering under a
    /// mapping, whose next fault waits for good.
    pub fn mount_cached(
        backing: &Path,
        mountpoint: &Path,
        pick: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Stalling {
        Stalling::mount_as(backing, mountpoint, Some(Hold::Reads), false, pick, |_| {
            true
        })
    }

    /// Mounts at `mountpoint` a read-only mirror of `backing` whose opens are served from the
    /// page cache and that holds nothing; reads of the files `pick` takes fail once
    /// [`Stalling::fail_reads`] was called.
    pub fn mount_failing(
        backing: &Path,
        mountpoint: &Path,
        pick: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> Stalling {
        Stalling::mount_as(backing, mountpoint, None, false, pick, |_| true)
    }

    fn mount_as(
        backing: &Path,
        mountpoint: &Path,
        hold: Option<Hold>,
        direct: bool,
        pick: impl Fn(&str) -> bool + Send + Sync + 'static,
        from: impl Fn(u32) -> bool + Send + Sync + 'static,
    ) -> Stalling {
        std::fs::create_dir_all(mountpoint).unwrap();
        let mut names = BTreeMap::new();
        let mut listed: Vec<String> = std::fs::read_dir(backing)
            .unwrap()
            .map(|e| e.unwrap())
            .filter(|e| e.file_type().unwrap().is_file())
            .map(|e| e.file_name().into_string().unwrap())
            .collect();
        listed.sort();
        for (i, n) in listed.into_iter().enumerate() {
            names.insert(i as u64 + 2, n);
        }
        let shared = Arc::new(Mutex::new(Shared::default()));
        let fs = Mirror {
            backing: backing.to_path_buf(),
            names: names.clone(),
            hold,
            direct,
            pick: Box::new(pick),
            from: Box::new(from),
            shared: Arc::clone(&shared),
        };
        let mut config = fuser::Config::default();
        config.mount_options = vec![
            MountOption::RO,
            MountOption::FSName("cryo-stalling".into()),
            MountOption::DefaultPermissions,
        ];
        // Two loops: one may be taken by a request it holds while the other answers.
        config.n_threads = Some(2);
        let session = fuser::spawn_mount(fs, mountpoint, &config).unwrap_or_else(|e| {
            panic!(
                "mounting FUSE at {}: {e} (needs root and /dev/fuse: the fuse module)",
                mountpoint.display()
            )
        });
        Stalling {
            mountpoint: mountpoint.to_path_buf(),
            names,
            shared,
            session: Some(session),
        }
    }

    /// The kit's tiny image ([`crate::image::publish_tiny`], published in `dir/backing` unless
    /// it is there already) mirrored at `dir/NAME`, `hold` requests held for every file: what
    /// the attacks on a file system that stops answering start from.
    pub fn tiny_image(dir: &Path, name: &str, hold: Hold) -> Stalling {
        let backing = dir.join("backing");
        if !backing.exists() {
            crate::image::publish_tiny(&backing);
        }
        Stalling::mount(&backing, &dir.join(name), hold, |_| true)
    }

    /// Where it is mounted.
    pub fn path(&self) -> &Path {
        &self.mountpoint
    }

    /// From now on, this process's requests are held too (cryo's own opens, stats, reads).
    /// What the kernel cached of every file (its name, its attributes, its pages: unmapped
    /// from every mapping of them too) is dropped, so the next open, stat or read of each
    /// asks the server.
    pub fn hold_own(&self) {
        self.shared.lock().unwrap().own = true;
        if let Some(session) = &self.session {
            let notifier = session.notifier();
            for (ino, name) in &self.names {
                // Never looked up yet: nothing cached, nothing to drop.
                let _ = notifier.inval_entry(INodeNo::ROOT, OsStr::new(name));
                let _ = notifier.inval_inode(INodeNo(*ino), 0, 0);
            }
        }
    }

    /// From now on every read of the picked files fails with `EIO`, and what the kernel cached
    /// of their pages is dropped (unmapped from every mapping of them too), so that the next
    /// read of any of it, through a mapping as well, asks the server.
    pub fn fail_reads(&self) {
        self.shared.lock().unwrap().failing = true;
        if let Some(session) = &self.session {
            let notifier = session.notifier();
            for ino in self.names.keys() {
                notifier.inval_inode(INodeNo(*ino), 0, 0).unwrap();
            }
        }
    }

    /// Requests held so far (answered ones included).
    pub fn held(&self) -> usize {
        self.shared.lock().unwrap().senders.len()
    }

    /// The thread ids that sent the requests held so far.
    pub fn senders(&self) -> Vec<u32> {
        self.shared.lock().unwrap().senders.clone()
    }

    /// Answers every held request with `EIO`, and every later read of the picked files too
    /// (nothing is held from then on): a disk that stopped answering, then failed. A fault
    /// that was waiting on a held read of a mapped file's page then ends as SIGBUS (the kernel's
    /// one retry of the read fails as well), at the moment the test chooses.
    pub fn fail_all(&self) {
        self.shared.lock().unwrap().failing = true;
        self.answer_all();
    }

    /// Answers every held request with `EIO`; nothing is held from then on.
    pub fn answer_all(&self) {
        let held = {
            let mut s = self.shared.lock().unwrap();
            s.released = true;
            std::mem::take(&mut s.held)
        };
        for h in held {
            h.fail();
        }
    }
}

impl std::fmt::Debug for Stalling {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stalling")
            .field("mountpoint", &self.mountpoint)
            .field("held", &self.held())
            .finish_non_exhaustive()
    }
}

impl Drop for Stalling {
    fn drop(&mut self) {
        self.answer_all();
        if let Some(s) = self.session.take() {
            if let Err(e) = s.umount_and_join() {
                // Busy: a process whose request was just answered (or a test that failed
                // while one was held) has not let go of it yet. Detached instead: gone from
                // the tree now, released by the kernel once the last user lets go, never left
                // behind for the next suite (its server is gone with the session).
                let detached = detach(&self.mountpoint);
                eprintln!(
                    "unmounting {}: {e}; detached instead: {detached:?}",
                    self.mountpoint.display()
                );
            }
        }
    }
}

/// `umount2(path, MNT_DETACH)`: the mount leaves the tree at once, and the kernel releases it
/// once its last user lets go.
fn detach(path: &Path) -> std::io::Result<()> {
    use std::os::unix::ffi::OsStrExt;
    let path = std::ffi::CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: umount2 only reads the NUL-terminated path, which outlives the call.
    let rc = unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}
