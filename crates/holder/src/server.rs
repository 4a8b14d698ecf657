//! The holder process: a table of pinned fds, a socket, and nothing else.
//!
//! # Design
//! - **One holder per state directory**: it holds `pins.lock` (`flock`) for as long as it lives;
//!   a second one started on the same directory stops at once ([`ServeError::AlreadyRunning`]).
//!   The lock dies with the process, so there is never a stale one.
//! - **The socket** (`pins.sock`, mode 0600, `SOCK_SEQPACKET`) is bound under a temporary name
//!   and renamed into place, so a client never connects to a half-set-up socket. Every
//!   connection gets a thread of its own (at most [`MAX_CLIENTS`]; a client that stalls holds
//!   only its thread), is checked (peer credentials: root only) and greeted ([`Reply::Hello`]).
//! - **The table** is the only state. A hold is acknowledged once its fds are in the table. Fds
//!   leave the table only on [`Request::Release`] (by GPU, with the confirmation) and with the
//!   process at the end of a handover; never because a client misbehaved, disconnected, or sent
//!   something unreadable (those fds are held on the unknown GPU).
//! - **Handover** (upgrading the holder itself): the new holder ([`ServeOptions::take_over`])
//!   connects to the old one and asks for its pins; the old one sends copies of every pin with
//!   its fds, the new one acknowledges once it holds them all, and only then does the old one
//!   exit. Holds keep being accepted during a handover (they are sent in a further round before
//!   the old holder exits); releases wait (refused with [`Refusal::HandingOver`]: closing a pin
//!   the new holder already has a copy of would not close it). If the new holder goes away
//!   before acknowledging, the old one keeps everything and carries on. The new holder then
//!   takes `pins.lock` (free once the old one has exited) and the socket.
//!
//! Nothing here panics on a closed stream (every write's error is looked at or ignored, SIGPIPE
//! is ignored and every send uses `MSG_NOSIGNAL`), and a panic in a connection's thread ends that
//! thread only: the table lives outside it.
//!
//! # Limitations
//! - A hold that reaches the old holder in the instant between its last check of the table and
//!   its exit is not acknowledged; the client still has its copies and retries on the new holder.
//! - The log is a plain file appended line by line; it is never rotated (the holder logs a line
//!   per pin, release and client refused).

use std::collections::BTreeSet;
use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use cryo_journal::ProcId;
use cryo_state::fence::FencedGpu;
use cryo_state::StateDir;
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::proto::{
    self, HeldPin, HolderInfo, PinMeta, Received, Refusal, Reply, Request, MAX_FDS, PROTOCOL,
};

/// Clients served at once; more are refused with [`Refusal::Busy`].
pub const MAX_CLIENTS: usize = 32;
/// A client that sends nothing for this long is disconnected (its pins stay held).
const IDLE: Duration = Duration::from_secs(60);
/// A send that blocks this long (a client that does not read) ends the connection.
const SEND_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a new holder waits for the old one to exit after taking its pins.
const TAKE_OVER_WAIT: Duration = Duration::from_secs(30);

/// How the holder runs.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// The state directory whose pins it holds (`pins.sock`, `pins.lock`).
    pub state: StateDir,
    /// Take the pins of the running holder before serving (an upgrade of the holder).
    pub take_over: bool,
    /// What hardening found (`oom_score_adj`, cgroup), shown in every [`HolderInfo`].
    pub setup: crate::launch::Setup,
}

/// The holder could not start (it holds nothing then).
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Another holder lives on this state directory.
    #[error("a pin holder already runs on {0} (it holds pins.lock)")]
    AlreadyRunning(PathBuf),
    /// The lock file could not be opened or locked.
    #[error("cannot lock {path}: {source}")]
    Lock {
        /// The lock file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// The socket could not be set up.
    #[error("cannot listen on {path}: {source}")]
    Listen {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// Taking over from the running holder failed; it keeps its pins.
    #[error("taking over the pins of the running holder: {0}")]
    TakeOver(String),
    /// The old holder did not exit after handing its pins over (both hold them now; this one
    /// closes its copies by exiting).
    #[error("the old holder (pid {0}) still holds pins.lock {1:?} after handing its pins over")]
    OldHolderStays(i32, Duration),
}

/// The holder's log: one timestamped line per event, errors ignored (a full disk or a closed
/// file must never stop the holder).
#[derive(Debug)]
pub struct Log(Mutex<Option<File>>);

impl Log {
    /// Appends to `path` (created 0600), or writes to stderr if it cannot be opened.
    pub fn open(path: &std::path::Path) -> Self {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(path)
            .ok();
        Log(Mutex::new(file))
    }

    /// Writes to stderr.
    pub fn stderr() -> Self {
        Log(Mutex::new(None))
    }

    /// One line.
    pub fn line(&self, args: fmt::Arguments<'_>) {
        let now = time::OffsetDateTime::now_utc()
            .format(&time::format_description::well_known::Rfc3339)
            .unwrap_or_default();
        let line = format!("{now} cryo-holder[{}]: {args}\n", std::process::id());
        match &mut *lock(&self.0) {
            Some(f) => {
                let _ = f.write_all(line.as_bytes());
            }
            None => {
                let _ = io::stderr().write_all(line.as_bytes());
            }
        }
    }
}

struct Held {
    pin: HeldPin,
    fds: Vec<OwnedFd>,
}

#[derive(Default)]
struct Table {
    pins: Vec<Held>,
    next_id: u64,
    handing_over: bool,
}

impl Table {
    /// Adds `fds` to the pin of `meta.pid` (a later chunk) or to a new pin.
    fn hold(&mut self, meta: PinMeta, fds: Vec<OwnedFd>) -> HeldPin {
        let same = |h: &&mut Held| h.pin.meta.pid == meta.pid && meta.pid.pid != 0;
        if let Some(h) = self.pins.iter_mut().find(|h| same(h)) {
            h.pin.meta.fds.extend(&meta.fds);
            for g in meta.gpus {
                if !h.pin.meta.gpus.contains(&g) {
                    h.pin.meta.gpus.push(g);
                }
            }
            h.pin.held += fds.len();
            h.fds.extend(fds);
            return h.pin.clone();
        }
        self.next_id += 1;
        let pin = HeldPin {
            id: self.next_id,
            held: fds.len(),
            meta,
            since_unix: unix_now(),
        };
        self.pins.push(Held {
            pin: pin.clone(),
            fds,
        });
        pin
    }

    /// Takes a pin handed over by the old holder as it was there (its id, fd numbers, the time it
    /// was first held, how many fds it has), or adds a later chunk's fds to it. Returns how many
    /// fds of it are here now.
    fn adopt(&mut self, pin: HeldPin, fds: Vec<OwnedFd>) -> usize {
        if let Some(h) = self.pins.iter_mut().find(|h| h.pin.id == pin.id) {
            h.fds.extend(fds);
            return h.fds.len();
        }
        self.next_id = self.next_id.max(pin.id);
        let n = fds.len();
        self.pins.push(Held { pin, fds });
        n
    }

    fn list(&self) -> Vec<HeldPin> {
        self.pins.iter().map(|h| h.pin.clone()).collect()
    }
}

struct Shared {
    table: Mutex<Table>,
    info: HolderInfo,
    log: Log,
    clients: AtomicUsize,
}

impl Shared {
    fn info(&self) -> HolderInfo {
        HolderInfo {
            pins: lock(&self.table).pins.len(),
            ..self.info.clone()
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A thread that panicked while holding the table left it as it was: still the truth.
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// Runs the holder: takes the lock (and, with [`ServeOptions::take_over`], the running holder's
/// pins), publishes the socket, calls `ready`, then serves until a request ends the process.
/// Returns only if it cannot start.
pub fn serve(
    opts: &ServeOptions,
    log: Log,
    ready: impl FnOnce(&HolderInfo),
) -> Result<std::convert::Infallible, ServeError> {
    let state = &opts.state;
    let me =
        ProcId::of(std::process::id() as i32).unwrap_or(ProcId::new(std::process::id() as i32, 0));
    let info = HolderInfo {
        id: me,
        protocol: PROTOCOL,
        version: env!("CARGO_PKG_VERSION").to_string(),
        started_unix: unix_now(),
        oom_score_adj: opts.setup.oom_score_adj.clone(),
        cgroup: opts.setup.cgroup.clone(),
        pins: 0,
    };
    let shared = Arc::new(Shared {
        table: Mutex::new(Table::default()),
        info,
        log,
        clients: AtomicUsize::new(0),
    });
    std::fs::create_dir_all(state.root()).map_err(|source| ServeError::Listen {
        path: state.root().to_path_buf(),
        source,
    })?;
    let lock_path = state.pin_holder_lock();
    let lock_err = |source| ServeError::Lock {
        path: lock_path.clone(),
        source,
    };
    let lock_file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_CLOEXEC)
        .open(&lock_path)
        .map_err(lock_err)?;
    if opts.take_over {
        let old = take_over(&shared, state)?;
        wait_for_lock(&lock_file).map_err(|e| match e {
            Ok(waited) => ServeError::OldHolderStays(old.pid, waited),
            Err(e) => lock_err(e),
        })?;
    } else {
        match rustix::fs::flock(
            &lock_file,
            rustix::fs::FlockOperation::NonBlockingLockExclusive,
        ) {
            Ok(()) => {}
            Err(rustix::io::Errno::WOULDBLOCK) => {
                return Err(ServeError::AlreadyRunning(state.root().to_path_buf()))
            }
            Err(e) => return Err(lock_err(e.into())),
        }
    }
    let listener = publish(state)?;
    let info = shared.info();
    shared.log.line(format_args!(
        "holding pins for {} (protocol {}, cryo {}; oom_score_adj {}; cgroup {}; {} pin(s) taken over)",
        state.root().display(),
        info.protocol,
        info.version,
        info.oom_score_adj,
        info.cgroup,
        info.pins
    ));
    ready(&info);
    // The lock lives as long as the process: it is released by the kernel when the holder exits.
    let _lock = lock_file;
    loop {
        let conn = match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(c) => c,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                shared.log.line(format_args!("accept failed: {e}"));
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        if shared.clients.fetch_add(1, Ordering::SeqCst) >= MAX_CLIENTS {
            shared.clients.fetch_sub(1, Ordering::SeqCst);
            let _ = set_timeouts(&conn);
            let _ = proto::send(
                &conn,
                &Reply::Refused {
                    refusal: Refusal::Busy { max: MAX_CLIENTS },
                },
                &[],
            );
            continue;
        }
        let s = Arc::clone(&shared);
        let spawned = std::thread::Builder::new()
            .name("cryo-holder-client".into())
            .stack_size(256 << 10)
            .spawn(move || {
                let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    client(&s, &conn);
                }));
                s.clients.fetch_sub(1, Ordering::SeqCst);
            });
        if let Err(e) = spawned {
            shared.clients.fetch_sub(1, Ordering::SeqCst);
            shared
                .log
                .line(format_args!("cannot start a client thread: {e}"));
        }
    }
}

/// Binds the socket under a temporary name and renames it over `pins.sock`.
fn publish(state: &StateDir) -> Result<OwnedFd, ServeError> {
    let path = state.pin_holder_socket();
    let tmp = path.with_extension(format!("sock.new-{}", std::process::id()));
    let err = |source: io::Error| ServeError::Listen {
        path: path.clone(),
        source,
    };
    let _ = std::fs::remove_file(&tmp);
    let sock = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .map_err(|e| err(e.into()))?;
    let addr = SocketAddrUnix::new(&tmp).map_err(|e| err(e.into()))?;
    rustix::net::bind_unix(&sock, &addr).map_err(|e| err(e.into()))?;
    let published = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
        .and_then(|()| rustix::net::listen(&sock, 64).map_err(io::Error::from))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = published {
        let _ = std::fs::remove_file(&tmp);
        return Err(err(e));
    }
    Ok(sock)
}

fn set_timeouts(sock: &OwnedFd) -> io::Result<()> {
    use rustix::net::sockopt::{set_socket_timeout, Timeout};
    set_socket_timeout(sock, Timeout::Recv, Some(IDLE))?;
    set_socket_timeout(sock, Timeout::Send, Some(SEND_TIMEOUT))?;
    Ok(())
}

/// Whether the peer may talk to the holder: root, or the holder's own user.
fn authorised(sock: &OwnedFd) -> Result<(), Refusal> {
    match rustix::net::sockopt::get_socket_peercred(sock) {
        Ok(c) if c.uid.is_root() || c.uid == rustix::process::geteuid() => Ok(()),
        Ok(c) => Err(Refusal::NotRoot {
            uid: c.uid.as_raw(),
        }),
        Err(e) => Err(Refusal::NoCredentials {
            error: e.to_string(),
        }),
    }
}

fn peer(sock: &OwnedFd) -> String {
    rustix::net::sockopt::get_socket_peercred(sock).map_or_else(
        |_| "an unknown peer".to_string(),
        |c| format!("pid {} uid {}", c.pid.as_raw_nonzero(), c.uid.as_raw()),
    )
}

fn reply(sock: &OwnedFd, r: &Reply) -> io::Result<()> {
    proto::send(sock, r, &[])
}

fn refuse(sock: &OwnedFd, refusal: Refusal) -> io::Result<()> {
    reply(sock, &Reply::Refused { refusal })
}

/// One connection, until it ends. Nothing in here closes a held fd except a release.
fn client(shared: &Shared, sock: &OwnedFd) {
    if set_timeouts(sock).is_err() {
        return;
    }
    if let Err(refusal) = authorised(sock) {
        shared
            .log
            .line(format_args!("refused {}: {refusal}", peer(sock)));
        let _ = refuse(sock, refusal);
        return;
    }
    if reply(
        sock,
        &Reply::Hello {
            holder: shared.info(),
        },
    )
    .is_err()
    {
        return;
    }
    let mut buf = Vec::new();
    loop {
        let msg = match proto::recv(sock, &mut buf) {
            Ok(Some(m)) => m,
            Ok(None) => return,
            Err(e) => {
                if e.kind() != io::ErrorKind::WouldBlock {
                    shared.log.line(format_args!("client {}: {e}", peer(sock)));
                }
                return;
            }
        };
        if answer(shared, sock, msg).is_err() {
            return;
        }
    }
}

/// Keeps fds that came with a message that is not a usable hold: on the unknown GPU.
fn keep_stray(shared: &Shared, sock: &OwnedFd, fds: Vec<OwnedFd>, why: &str) -> usize {
    let n = fds.len();
    if n == 0 {
        return 0;
    }
    let pin = lock(&shared.table).hold(
        PinMeta {
            pid: ProcId::new(0, 0),
            gpus: vec![FencedGpu::Unknown],
            fds: vec![-1; n],
            cause: format!("fds that came with a request that was not a usable hold ({why})"),
            from: peer(sock),
        },
        fds,
    );
    shared.log.line(format_args!(
        "HOLDING {n} stray fd(s) from {} as pin {} on the unknown GPU: {why}",
        peer(sock),
        pin.id
    ));
    n
}

fn answer(shared: &Shared, sock: &OwnedFd, msg: Received) -> io::Result<()> {
    let Received {
        bytes,
        fds,
        truncated,
        fds_cut,
    } = msg;
    if fds_cut {
        shared.log.line(format_args!(
            "the kernel could not pass every fd {} sent (fd limit?): {} arrived",
            peer(sock),
            fds.len()
        ));
    }
    let request = if truncated {
        Err(format!("message longer than {} bytes", proto::MAX_MESSAGE))
    } else {
        serde_json::from_slice::<Request>(&bytes).map_err(|e| e.to_string())
    };
    let request = match request {
        Ok(r) => r,
        Err(error) => {
            let kept_fds = keep_stray(shared, sock, fds, &error);
            return refuse(sock, Refusal::BadRequest { error, kept_fds });
        }
    };
    if !matches!(request, Request::Hold { .. }) && !fds.is_empty() {
        let kept_fds = keep_stray(shared, sock, fds, "fds with a request that takes none");
        return refuse(
            sock,
            Refusal::BadRequest {
                error: "this request takes no fds".into(),
                kept_fds,
            },
        );
    }
    match request {
        Request::Inventory => {
            let pins = lock(&shared.table).list();
            let holder = shared.info();
            let parts = proto::chunks(pins);
            let n = parts.len();
            for (i, pins) in parts.into_iter().enumerate() {
                reply(
                    sock,
                    &Reply::Inventory {
                        holder: holder.clone(),
                        pins,
                        more: i + 1 < n,
                    },
                )?;
            }
            Ok(())
        }
        Request::Hold { pin } => {
            if fds.is_empty() {
                return refuse(sock, Refusal::NoFds);
            }
            let received = fds.len();
            let from = pin.from.clone();
            let held = lock(&shared.table).hold(pin, fds);
            shared.log.line(format_args!(
                "holding {received} fd(s) of dead pid {} on {} ({}), from {from} ({}): pin {}, {} fd(s) in all",
                held.meta.pid.pid,
                gpus(&held.meta.gpus),
                held.meta.cause,
                peer(sock),
                held.id,
                held.held
            ));
            reply(
                sock,
                &Reply::Held {
                    pin: held,
                    received,
                },
            )
        }
        Request::Release { gpu, confirm: _ } => {
            let closed = {
                let mut table = lock(&shared.table);
                if table.handing_over {
                    drop(table);
                    return refuse(sock, Refusal::HandingOver);
                }
                let (closed, kept): (Vec<Held>, Vec<Held>) = std::mem::take(&mut table.pins)
                    .into_iter()
                    .partition(|h| h.pin.on(&gpu));
                table.pins = kept;
                closed
            };
            if closed.is_empty() {
                return refuse(sock, Refusal::NotHeld { gpu });
            }
            let pins: Vec<HeldPin> = closed.iter().map(|h| h.pin.clone()).collect();
            for h in closed {
                shared.log.line(format_args!(
                    "RELEASING pin {} (dead pid {}, {} fd(s)) on {gpu}, asked by {}: the driver may now tear the context down",
                    h.pin.id,
                    h.pin.meta.pid.pid,
                    h.fds.len(),
                    peer(sock)
                ));
                drop(h.fds);
            }
            let parts = proto::chunks(pins);
            let n = parts.len();
            for (i, pins) in parts.into_iter().enumerate() {
                reply(
                    sock,
                    &Reply::Released {
                        pins,
                        more: i + 1 < n,
                    },
                )?;
            }
            Ok(())
        }
        Request::Exit => {
            let table = lock(&shared.table);
            if !table.pins.is_empty() || table.handing_over {
                let pins = table.pins.len();
                drop(table);
                return refuse(sock, Refusal::HoldsPins { pins });
            }
            shared.log.line(format_args!(
                "exiting on request of {}: no pins held",
                peer(sock)
            ));
            let _ = reply(sock, &Reply::Exiting);
            // Still holding the table's lock: no hold can come in between.
            std::process::exit(0);
        }
        Request::HandOver => hand_over(shared, sock),
        Request::TookAll { .. } => refuse(
            sock,
            Refusal::Unexpected {
                error: "took_all outside a handover".into(),
            },
        ),
    }
}

fn gpus(g: &[FencedGpu]) -> String {
    g.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The old holder's side of a handover: sends every pin until the new holder has them all, then
/// exits. Returns (having kept everything) if the new holder fails or goes away.
fn hand_over(shared: &Shared, sock: &OwnedFd) -> io::Result<()> {
    {
        let mut table = lock(&shared.table);
        if table.handing_over {
            drop(table);
            return refuse(
                sock,
                Refusal::Unexpected {
                    error: "a handover is already under way".into(),
                },
            );
        }
        table.handing_over = true;
    }
    let who = peer(sock);
    shared.log.line(format_args!(
        "handing every pin over to a new holder ({who})"
    ));
    let result = hand_over_rounds(shared, sock);
    lock(&shared.table).handing_over = false;
    match result {
        Ok(never) => match never {},
        Err(e) => {
            shared.log.line(format_args!(
                "handover to {who} failed ({e}); keeping every pin"
            ));
            Err(e)
        }
    }
}

fn hand_over_rounds(shared: &Shared, sock: &OwnedFd) -> io::Result<std::convert::Infallible> {
    let mut sent: BTreeSet<u64> = BTreeSet::new();
    let mut buf = Vec::new();
    loop {
        // Copies of what is not sent yet: the table keeps its own until the process exits.
        let batch: Vec<(HeldPin, Vec<OwnedFd>)> = {
            let table = lock(&shared.table);
            let mut batch = Vec::new();
            for h in table.pins.iter().filter(|h| !sent.contains(&h.pin.id)) {
                let fds = h
                    .fds
                    .iter()
                    .map(OwnedFd::try_clone)
                    .collect::<io::Result<Vec<_>>>()?;
                batch.push((h.pin.clone(), fds));
            }
            batch
        };
        for (pin, fds) in &batch {
            for chunk in fds.chunks(MAX_FDS) {
                let borrowed: Vec<BorrowedFd<'_>> = chunk.iter().map(AsFd::as_fd).collect();
                proto::send(sock, &Reply::Handing { pin: pin.clone() }, &borrowed)?;
            }
            sent.insert(pin.id);
        }
        drop(batch);
        reply(sock, &Reply::HandedAll { pins: sent.len() })?;
        let took = match proto::recv(sock, &mut buf)? {
            Some(m) if m.fds.is_empty() => serde_json::from_slice::<Request>(&m.bytes).ok(),
            Some(m) => {
                keep_stray(shared, sock, m.fds, "fds sent to a holder handing over");
                None
            }
            None => None,
        };
        match took {
            Some(Request::TookAll { pins }) if pins == sent.len() => {}
            other => {
                return Err(io::Error::other(format!(
                    "the new holder answered {other:?} instead of took_all {{ pins: {} }}",
                    sent.len()
                )))
            }
        }
        let table = lock(&shared.table);
        if table.pins.iter().all(|h| sent.contains(&h.pin.id)) {
            shared.log.line(format_args!(
                "the new holder holds all {} pin(s); exiting",
                sent.len()
            ));
            // Still holding the table's lock: no hold can come in between.
            std::process::exit(0);
        }
        // Holds came in meanwhile: another round.
    }
}

/// The new holder's side of a handover: takes every pin of the running holder, acknowledges
/// once it holds them all, and returns the old holder's identity once that one has closed the
/// connection (it exits right after the acknowledgement).
fn take_over(shared: &Shared, state: &StateDir) -> Result<ProcId, ServeError> {
    let fail = |e: &dyn fmt::Display| ServeError::TakeOver(e.to_string());
    let mut session = crate::client::HolderClient::new(state)
        .connect()
        .map_err(|e| fail(&e))?;
    let old = session.holder.id;
    shared.log.line(format_args!(
        "taking over the pins of holder pid {} (protocol {}, cryo {})",
        old.pid, session.holder.protocol, session.holder.version
    ));
    session
        .send(&Request::HandOver, &[])
        .map_err(|e| fail(&e))?;
    let mut acknowledged = false;
    loop {
        let (r, fds) = match session.recv_raw() {
            Ok(Some(m)) => m,
            // The old holder exited after our acknowledgement: everything is here.
            Ok(None) if acknowledged => return Ok(old),
            Ok(None) => return Err(fail(&"the old holder closed the connection")),
            Err(e) => return Err(fail(&e)),
        };
        match r {
            Reply::Handing { pin } => {
                let (id, dead) = (pin.id, pin.meta.pid.pid);
                let n = fds.len();
                let here = lock(&shared.table).adopt(pin, fds);
                shared.log.line(format_args!(
                    "took {n} fd(s) of pin {id} (dead pid {dead}; {here} fd(s) of it here)"
                ));
            }
            Reply::HandedAll { pins } => {
                let table = lock(&shared.table);
                let short: Vec<(u64, usize, usize)> = table
                    .pins
                    .iter()
                    .filter(|h| h.fds.len() != h.pin.held)
                    .map(|h| (h.pin.id, h.fds.len(), h.pin.held))
                    .collect();
                if pins != table.pins.len() || !short.is_empty() {
                    return Err(fail(&format!(
                        "the old holder sent {pins} pin(s), {} arrived; incomplete (id, here, sent): {short:?}",
                        table.pins.len()
                    )));
                }
                drop(table);
                session
                    .send(&Request::TookAll { pins }, &[])
                    .map_err(|e| fail(&e))?;
                acknowledged = true;
            }
            other => return Err(fail(&format!("unexpected {other:?} during a handover"))),
        }
    }
}

/// Waits (bounded) for the old holder to exit and release `pins.lock`; `Err(Ok(waited))` if it
/// does not.
fn wait_for_lock(file: &File) -> Result<(), Result<Duration, io::Error>> {
    let start = Instant::now();
    loop {
        match rustix::fs::flock(file, rustix::fs::FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) if start.elapsed() < TAKE_OVER_WAIT => {
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(rustix::io::Errno::WOULDBLOCK) => return Err(Ok(start.elapsed())),
            Err(e) => return Err(Err(e.into())),
        }
    }
}
