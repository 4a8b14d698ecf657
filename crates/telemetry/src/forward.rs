//! Every journal record pushed off the host as RFC 5424 syslog over TCP, caught up after outages.
//!
//! # Design
//! - **Never in the journal's way.** The forwarder tails the journal with a [`Follow`] (a
//!   lock-free reader woken by inotify) in its own thread; writers never wait for it, whatever
//!   the collector does. A collector that is down, slow or black-holed only makes the forwarder
//!   fall behind (see the `telemetry` benchmark for the append latency with and without one).
//! - **Delivery is at least once.** A record counts as *delivered* once the collector's TCP stack
//!   has acknowledged its last byte (the socket's send queue, `SIOCOUTQ`, no longer holds it).
//!   The forwarder keeps its position in the journal durable in an offset file
//!   ([`crate::OffsetFile`]) and, on every reconnect or restart, sends again from there.
//! - **A window of replay.** A collector that is stopped can drop what its kernel acknowledged
//!   but it had not processed yet. So after a connection ends the forwarder also sends again
//!   every record acknowledged in the last [`ForwardConfig::replay`] before the end was noticed,
//!   and the stored position trails the acknowledged one by that window. A collector therefore
//!   sees some records twice after an outage (never one missing); each message carries the
//!   record's `seq` (structured data and MSG) to drop duplicates by.
//! - **A position that a power cut cannot fool.** The journal's unsynced appends can be lost in
//!   a power cut after the forwarder sent them; the records written after the next boot then
//!   take the lost records' seqs. So the stored position carries marks of the records it stands
//!   on (digests of seq, time and type at the position and at up to 63 seqs before it, each at
//!   most twice as far back: [`crate::OffsetFile`]); at start the forwarder resumes after the
//!   newest mark whose record the journal still holds unchanged (the records a power cut leaves
//!   are a prefix of what was written), logging how far it went back. The records after that
//!   mark and up to the stored position are sent again (at most about twice as many as the power
//!   cut took); none is skipped. The collector is told first (a `records_replaced` message with
//!   the seq range): the records with those seqs that follow are other records, not duplicates
//!   to drop by seq.
//! - **Reconnects** back off exponentially from [`ForwardConfig::retry_min`] to
//!   [`ForwardConfig::retry_max`], also after connections that end within 2 s (a collector that
//!   accepts and drops every connection is not hammered). A connection whose oldest unacknowledged byte waits longer than
//!   [`ForwardConfig::ack_timeout`] (a collector host that vanished without a reset) is dropped
//!   and made again. Failures are logged once per outage, not once per attempt.
//!
//! # Limitations
//! - Plain TCP: no TLS yet (a local relay such as rsyslog or stunnel can add it).
//! - Delivery ends at the collector's kernel; what the collector does after that (its own queues
//!   and disks) is its business, as with any syslog transport without application-level acks.
//! - Records of event types this build does not know go out as type `unknown` with their seq and
//!   time only (the journal reader keeps no raw payload).

use std::collections::VecDeque;
use std::io::{self, Write as _};
use std::net::{SocketAddr, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use cryo_state::StateDir;
use rustix::event::{poll, PollFd, PollFlags};
use rustix::net::RecvFlags;

use crate::error::{ConnectError, ForwardError};
use crate::follow::{Follow, Wake};
use crate::offset::{Offset, OffsetFile};
use crate::syslog::SyslogFormat;
use cryo_journal::Marks;

/// Where and how to forward.
#[derive(Debug, Clone)]
pub struct ForwardConfig {
    /// The journal directory.
    pub journal_dir: PathBuf,
    /// The durable position (`STATE_DIR/syslog.offset`).
    pub offset_file: PathBuf,
    /// The collector, `HOST:PORT` (resolved again at every connection).
    pub collector: String,
    /// Header fields of the messages.
    pub format: SyslogFormat,
    /// How long one connection attempt may take.
    pub connect_timeout: Duration,
    /// How long one write may block (a collector that stopped reading).
    pub write_timeout: Duration,
    /// How long sent bytes may stay unacknowledged before the connection is made again.
    pub ack_timeout: Duration,
    /// First wait between failed connection attempts.
    pub retry_min: Duration,
    /// Longest wait between failed connection attempts.
    pub retry_max: Duration,
    /// Records acknowledged this long before a connection ended are sent again.
    pub replay: Duration,
}

impl ForwardConfig {
    /// Forwards the journal of `state` to `collector` (`HOST:PORT`), keeping the offset in
    /// `state`. Defaults: connect 5 s, write 10 s, ack 30 s, retry 100 ms doubling to 10 s,
    /// replay 5 s.
    pub fn new(state: &StateDir, collector: impl Into<String>) -> ForwardConfig {
        ForwardConfig {
            journal_dir: state.journal_dir(),
            offset_file: state.syslog_offset_file(),
            collector: collector.into(),
            format: SyslogFormat::default(),
            connect_timeout: Duration::from_secs(5),
            write_timeout: Duration::from_secs(10),
            ack_timeout: Duration::from_secs(30),
            retry_min: Duration::from_millis(100),
            retry_max: Duration::from_secs(10),
            replay: Duration::from_secs(5),
        }
    }
}

/// The forwarder's counters, shared with its thread (and [`crate::Metrics`]).
#[derive(Debug, Default)]
pub struct ForwardShared {
    delivered: AtomicU64,
    sent: AtomicU64,
    resent: AtomicU64,
    connections: AtomicU64,
    lost: AtomicU64,
    connected: AtomicBool,
    last_error: Mutex<Option<String>>,
}

/// A snapshot of the forwarder's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardStatus {
    /// The highest `seq` the collector acknowledged.
    pub delivered_seq: u64,
    /// Messages written (resends included).
    pub sent_total: u64,
    /// Messages written again after a connection ended.
    pub resent_total: u64,
    /// Connections made.
    pub connections_total: u64,
    /// Records the collector will never get: the journal no longer held them when the
    /// forwarder came to them (archives removed by the retention while it was behind, damaged
    /// frames). Each range was reported to the collector in a `records_lost` message.
    pub lost_total: u64,
    /// Whether a connection is up now.
    pub connected: bool,
    /// The last connection failure, if any since the start.
    pub last_error: Option<String>,
}

impl ForwardShared {
    /// A snapshot.
    pub fn status(&self) -> ForwardStatus {
        ForwardStatus {
            delivered_seq: self.delivered.load(Ordering::Relaxed),
            sent_total: self.sent.load(Ordering::Relaxed),
            resent_total: self.resent.load(Ordering::Relaxed),
            connections_total: self.connections.load(Ordering::Relaxed),
            lost_total: self.lost.load(Ordering::Relaxed),
            connected: self.connected.load(Ordering::Relaxed),
            last_error: self
                .last_error
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .clone(),
        }
    }
}

/// A running forwarder thread. Dropping it stops the thread (storing its position).
#[derive(Debug)]
pub struct Forwarder {
    stop: Option<OwnedFd>,
    thread: Option<JoinHandle<()>>,
    shared: Arc<ForwardShared>,
}

impl Forwarder {
    /// Starts forwarding from the position stored in the offset file (from the first record if
    /// there is none, or if it belongs to another journal).
    pub fn start(cfg: ForwardConfig) -> Result<Forwarder, ForwardError> {
        if !cfg.collector.contains(':') {
            return Err(ForwardError::BadAddress(cfg.collector));
        }
        let (stop_rx, stop_tx) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)
            .map_err(|e| ForwardError::Start(e.into()))?;
        let shared = Arc::new(ForwardShared::default());
        let thread = std::thread::Builder::new()
            .name("cryo-syslog".into())
            .spawn({
                let shared = Arc::clone(&shared);
                move || Run::new(cfg, shared, stop_rx).run()
            })
            .map_err(ForwardError::Start)?;
        Ok(Forwarder {
            stop: Some(stop_tx),
            thread: Some(thread),
            shared,
        })
    }

    /// A snapshot of its state.
    pub fn status(&self) -> ForwardStatus {
        self.shared.status()
    }

    /// Its shared counters (for [`crate::Metrics::watch_forwarder`]).
    pub fn shared(&self) -> Arc<ForwardShared> {
        Arc::clone(&self.shared)
    }

    /// Stops the thread and waits for it (it stores its position first).
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        // Closing the write end wakes the thread (its read end polls readable at EOF).
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the syslog forwarder thread panicked");
            }
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Most acknowledgements remembered for the replay window (bounds memory in a huge burst).
const MAX_REMEMBERED_ACKS: usize = 65_536;
/// How often the acknowledgement of in-flight bytes is looked at.
const ACK_POLL: Duration = Duration::from_millis(10);
/// How long an idle forwarder sleeps between looks at its replay window.
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// A connection up this long resets the reconnect back-off.
const STABLE: Duration = Duration::from_secs(2);
/// The position is stored at most this often while records flow (and whenever idle).
const STORE_EVERY: Duration = Duration::from_millis(200);

struct Conn {
    stream: TcpStream,
    /// Bytes written on this connection.
    written: u64,
    /// (seq, end offset of its frame in the stream, when written), oldest first.
    inflight: VecDeque<(u64, u64, Instant)>,
    /// When it was made.
    since: Instant,
    /// Whether the `records_replaced` notice went out on it.
    told_replaced: bool,
}

struct Run {
    cfg: ForwardConfig,
    shared: Arc<ForwardShared>,
    stop: OwnedFd,
    file: OffsetFile,
    /// What the offset file holds (or will hold at the next store).
    stored: Offset,
    stored_at: Instant,
    /// The highest seq acknowledged.
    delivered: u64,
    /// The highest seq ever written (to count resends).
    max_sent: u64,
    /// The highest seq counted as lost (a gap found again after a reconnect counts once).
    lost_to: u64,
    /// Seqs the collector may have got other records for (the start found the journal no
    /// longer holds what its offset counted as sent): told on each connection until records
    /// past them are delivered.
    replaced: Option<(u64, u64)>,
    /// Acknowledged records with the time of their acknowledgement, oldest first.
    acks: VecDeque<(u64, Instant)>,
    /// The highest seq acknowledged before the replay window (or the position this run or its
    /// last connection resumed from): where to send again from.
    settled: u64,
    /// Marks of the records this position may stand on, and the journal's identity
    /// ([`cryo_journal::Marks`]).
    marks: Marks,
}

impl Run {
    fn new(cfg: ForwardConfig, shared: Arc<ForwardShared>, stop: OwnedFd) -> Run {
        let file = OffsetFile::new(&cfg.offset_file);
        let stored = match file.load() {
            Ok(o) => o,
            Err(err) => {
                tracing::error!(%err, "forwarding every journal record again");
                Offset::default()
            }
        };
        let mut run = Run {
            cfg,
            shared,
            stop,
            file,
            delivered: stored.seq,
            max_sent: stored.seq,
            lost_to: 0,
            replaced: None,
            settled: stored.seq,
            marks: Marks::of(&stored, None),
            stored,
            stored_at: Instant::now(),
            acks: VecDeque::new(),
        };
        run.check_journal();
        run.shared.delivered.store(run.delivered, Ordering::Relaxed);
        run
    }

    /// Where to resume ([`cryo_journal::Position::resume`]): from the first record when the
    /// stored position belongs to another journal than the one there now, after the last record
    /// proven sent when a power cut replaced records it counts as sent (the collector is told
    /// which seqs, `replaced`).
    fn check_journal(&mut self) {
        let scan = match cryo_journal::read(&self.cfg.journal_dir) {
            Ok(s) => s,
            Err(err) => {
                tracing::warn!(%err, "cannot read the journal to check the forwarder's offset");
                return;
            }
        };
        let resume = self
            .stored
            .resume(&self.cfg.journal_dir, &scan, "the syslog forwarder");
        self.marks = Marks::of(&self.stored, resume.journal_first);
        if resume.other_journal || resume.replaced.is_some() {
            self.replaced = resume.replaced;
            self.resume_from(resume.after);
        }
    }

    /// Starts this run's position over at `seq`, keeping only the marks at or before it.
    fn resume_from(&mut self, seq: u64) {
        self.delivered = seq;
        self.max_sent = seq;
        self.settled = seq;
        self.marks.resume_after(seq);
        self.stored = Offset {
            seq,
            journal_first: None,
            marks: Vec::new(),
        };
    }

    fn run(mut self) {
        let mut follow = Follow::new(&self.cfg.journal_dir, self.delivered);
        let mut retry = self.cfg.retry_min;
        let mut failing = false;
        let mut conn: Option<Conn> = None;
        // Whether the last connection ended before it was up for STABLE: then the next attempt
        // backs off too (a collector that accepts and closes at once, or resets every connection,
        // is not hammered; its kernel may even have acknowledged what it then threw away).
        let mut fruitless = false;
        loop {
            if self.stop_requested(Duration::ZERO) {
                break;
            }
            let Some(c) = conn.as_mut() else {
                if fruitless {
                    fruitless = false;
                    if self.stop_requested(retry) {
                        break;
                    }
                    retry = (retry * 2).min(self.cfg.retry_max);
                }
                match connect(&self.cfg) {
                    Ok(c) => {
                        tracing::info!(collector = %self.cfg.collector, after = follow.after(), "connected to the syslog collector");
                        self.shared.connected.store(true, Ordering::Relaxed);
                        self.shared.connections.fetch_add(1, Ordering::Relaxed);
                        failing = false;
                        conn = Some(c);
                    }
                    Err(err) => {
                        if !failing {
                            tracing::warn!(%err, "syslog collector unreachable; the journal is kept and sent once it is back");
                        } else {
                            tracing::debug!(%err, "syslog collector still unreachable");
                        }
                        failing = true;
                        self.note_error(err.to_string());
                        self.store_if_due(false);
                        if self.stop_requested(retry) {
                            break;
                        }
                        retry = (retry * 2).min(self.cfg.retry_max);
                    }
                }
                continue;
            };

            if let Err(err) = self.send_new(&mut follow, c) {
                fruitless = c.since.elapsed() < STABLE;
                self.lose(&mut conn, &mut follow, &format!("write failed: {err}"));
                continue;
            }
            if let Err(err) = self.acknowledge(c) {
                fruitless = c.since.elapsed() < STABLE;
                self.lose(&mut conn, &mut follow, &err);
                continue;
            }
            if c.since.elapsed() >= STABLE {
                retry = self.cfg.retry_min;
            }
            self.store_if_due(false);

            let busy = !c.inflight.is_empty();
            let wait = if busy { ACK_POLL } else { IDLE_WAIT };
            match follow.wait(&[c.stream.as_fd(), self.stop.as_fd()], wait) {
                Ok(Wake::Other(0)) => {
                    if peer_closed(&c.stream) {
                        fruitless = c.since.elapsed() < STABLE;
                        self.lose(
                            &mut conn,
                            &mut follow,
                            "the collector closed the connection",
                        );
                    }
                }
                Ok(Wake::Other(_)) => break,
                Ok(Wake::Journal | Wake::Timeout) => {}
                Err(err) => {
                    tracing::error!(%err, "cannot wait for the journal");
                    if self.stop_requested(Duration::from_secs(1)) {
                        break;
                    }
                }
            }
        }
        // On a clean stop over a healthy connection, what the collector acknowledged is with a
        // collector that still runs: store it, not the replay point (no resend at the next start).
        let healthy = conn.as_mut().is_some_and(|c| self.acknowledge(c).is_ok());
        self.shared.connected.store(false, Ordering::Relaxed);
        let seq = if healthy {
            self.delivered
        } else {
            self.resume_point()
        };
        self.store(seq, true);
    }

    /// Writes every record appended since the last call.
    fn send_new(&mut self, follow: &mut Follow, c: &mut Conn) -> io::Result<()> {
        let records = match follow.poll_new() {
            Ok(r) => r,
            Err(err) => {
                tracing::error!(%err, "cannot read the journal; retrying");
                return Ok(());
            }
        };
        if let Some((first, last)) = self.replaced {
            if self.delivered >= last {
                self.replaced = None;
            } else if !c.told_replaced {
                let frame = self.cfg.format.replaced_frame(first, last);
                c.stream.write_all(&frame)?;
                c.written += frame.len() as u64;
                self.shared.sent.fetch_add(1, Ordering::Relaxed);
                c.told_replaced = true;
            }
        }
        let gaps = follow.take_gaps();
        if let (Some(first), Some(last)) = (gaps.first(), gaps.last()) {
            // One message for what one read skipped (a pruned stretch between carried copies is
            // several ranges): its first and last seq and how many records are lost.
            let lost: u64 = gaps.iter().map(cryo_journal::Gap::lost).sum();
            let new: u64 = gaps
                .iter()
                .map(|g| {
                    g.last
                        .saturating_sub(g.first.max(self.lost_to + 1).saturating_sub(1))
                })
                .sum();
            tracing::warn!(
                first = first.first,
                last = last.last,
                lost,
                "journal records lost before they were forwarded (the journal no longer holds them); telling the collector"
            );
            let frame = self.cfg.format.lost_frame(first.first, last.last, lost);
            c.stream.write_all(&frame)?;
            c.written += frame.len() as u64;
            self.shared.sent.fetch_add(1, Ordering::Relaxed);
            self.shared.lost.fetch_add(new, Ordering::Relaxed);
            self.lost_to = self.lost_to.max(last.last);
        }
        for r in records {
            self.marks.note(&r);
            let frame = self.cfg.format.frame(&r);
            c.stream.write_all(&frame)?;
            c.written += frame.len() as u64;
            c.inflight.push_back((r.seq, c.written, Instant::now()));
            self.shared.sent.fetch_add(1, Ordering::Relaxed);
            if r.seq <= self.max_sent {
                self.shared.resent.fetch_add(1, Ordering::Relaxed);
            }
            self.max_sent = self.max_sent.max(r.seq);
        }
        Ok(())
    }

    /// Moves what the collector acknowledged out of flight; an error if it waited too long.
    fn acknowledge(&mut self, c: &mut Conn) -> Result<(), String> {
        if c.inflight.is_empty() {
            return Ok(());
        }
        let unacked = crate::sys::unacked_bytes(c.stream.as_fd())
            .map_err(|e| format!("cannot read the socket's send queue: {e}"))?;
        // A reset empties the send queue: the count means "acknowledged" only on a connection
        // still established after it was read.
        match crate::sys::tcp_established(c.stream.as_fd()) {
            Ok(true) => {}
            Ok(false) => return Err("the connection is closing".to_owned()),
            Err(e) => return Err(format!("cannot read the connection's state: {e}")),
        }
        let acked = c.written.saturating_sub(unacked);
        let now = Instant::now();
        while let Some(&(seq, end, _)) = c.inflight.front() {
            if end > acked {
                break;
            }
            c.inflight.pop_front();
            self.delivered = self.delivered.max(seq);
            self.acks.push_back((seq, now));
            if self.acks.len() > MAX_REMEMBERED_ACKS {
                if let Some((old, _)) = self.acks.pop_front() {
                    self.settled = self.settled.max(old);
                }
            }
        }
        self.shared
            .delivered
            .store(self.delivered, Ordering::Relaxed);
        match c.inflight.front() {
            Some(&(_, _, at)) if at.elapsed() > self.cfg.ack_timeout => Err(format!(
                "the collector acknowledged nothing for {:?}",
                self.cfg.ack_timeout
            )),
            _ => Ok(()),
        }
    }

    /// The position to send again from: the last record acknowledged before the replay window
    /// (every record acknowledged within it is sent again), else where this run or its last
    /// connection resumed from.
    fn resume_point(&mut self) -> u64 {
        let now = Instant::now();
        while let Some(&(seq, at)) = self.acks.front() {
            if now.duration_since(at) <= self.cfg.replay {
                break;
            }
            self.acks.pop_front();
            self.settled = self.settled.max(seq);
        }
        self.settled.min(self.delivered)
    }

    /// Ends the connection and rewinds the follower to the resume point.
    fn lose(&mut self, conn: &mut Option<Conn>, follow: &mut Follow, why: &str) {
        // Nothing more counts as acknowledged on a connection that failed.
        *conn = None;
        self.shared.connected.store(false, Ordering::Relaxed);
        let resume = self.resume_point();
        tracing::warn!(
            why,
            delivered = self.delivered,
            resume_after = resume,
            "lost the syslog collector; reconnecting and sending again from the resume point"
        );
        self.note_error(why.to_string());
        *follow = Follow::new(&self.cfg.journal_dir, resume);
        // Delivered again only once the new connection acknowledges the replay: until then the
        // resume point is what is stored and reported.
        self.acks.clear();
        self.delivered = resume;
        self.settled = resume;
        self.shared.delivered.store(resume, Ordering::Relaxed);
    }

    /// Stores the resume point if it changed and the last store is old enough (or `now`): a
    /// forwarder that dies sends again from there.
    fn store_if_due(&mut self, now: bool) {
        let seq = self.resume_point();
        self.store(seq, now);
    }

    fn store(&mut self, seq: u64, now: bool) {
        if seq == self.stored.seq
            && self.marks.journal_first() == self.stored.journal_first.as_ref()
        {
            return;
        }
        if !now && self.stored_at.elapsed() < STORE_EVERY {
            return;
        }
        let next = self.marks.position(seq);
        match self.file.store(&next) {
            Ok(()) => self.stored = next,
            Err(err) => {
                tracing::error!(%err, "cannot store the forwarder's offset; records may be sent again after a restart")
            }
        }
        self.stored_at = Instant::now();
    }

    fn note_error(&self, err: String) {
        *self
            .shared
            .last_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = Some(err);
    }

    /// Whether a stop was asked for, waiting at most `wait` for one.
    fn stop_requested(&self, wait: Duration) -> bool {
        let mut fds = [PollFd::new(&self.stop, PollFlags::IN)];
        let ms = i32::try_from(wait.as_millis()).unwrap_or(i32::MAX);
        matches!(poll(&mut fds, ms), Ok(n) if n > 0)
    }
}

fn connect(cfg: &ForwardConfig) -> Result<Conn, ConnectError> {
    let addrs: Vec<SocketAddr> = cfg
        .collector
        .to_socket_addrs()
        .map_err(|source| ConnectError::Resolve {
            addr: cfg.collector.clone(),
            source,
        })?
        .collect();
    let mut last = None;
    for addr in addrs {
        match TcpStream::connect_timeout(&addr, cfg.connect_timeout) {
            Ok(stream) => {
                // Each message should leave at once; losing a few µs of batching costs nothing.
                let _ = stream.set_nodelay(true);
                let _ = stream.set_write_timeout(Some(cfg.write_timeout));
                return Ok(Conn {
                    stream,
                    written: 0,
                    inflight: VecDeque::new(),
                    since: Instant::now(),
                    told_replaced: false,
                });
            }
            Err(source) => last = Some(ConnectError::Connect { addr, source }),
        }
    }
    Err(last.unwrap_or_else(|| ConnectError::Resolve {
        addr: cfg.collector.clone(),
        source: io::Error::new(io::ErrorKind::NotFound, "no address"),
    }))
}

/// Whether the collector closed or reset the connection (it never sends anything else; what it
/// sends anyway is read and dropped, at most 64 KiB a call, so a collector that talks without
/// end cannot keep the forwarder from sending).
fn peer_closed(stream: &TcpStream) -> bool {
    let mut buf = [0u8; 4096];
    for _ in 0..16 {
        match rustix::net::recv(stream, &mut buf, RecvFlags::DONTWAIT) {
            Ok(0) => return true,
            Ok(_) | Err(rustix::io::Errno::INTR) => continue,
            Err(rustix::io::Errno::AGAIN) => return false,
            Err(_) => return true,
        }
    }
    false
}
