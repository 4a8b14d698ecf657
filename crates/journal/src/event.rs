//! What the journal records: [`Record`]s holding typed [`Event`]s.

use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::ProcId;

/// Why the guard watches a process: what a restarted guard re-attaches it as.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Serialize, Deserialize,
)]
#[serde(rename_all = "snake_case")]
pub enum AttachSource {
    /// Restored through cryo and traced before its unlock (thaw, `cryo gpu restore`, the
    /// cuda-checkpoint front end).
    Restore,
    /// A `RestoreCompleted` of the journal (a restore the guard heard of afterwards).
    Journal,
    /// Named by the operator (`cryo guard --pid`, `attach` on the control socket).
    Operator,
    /// Found by the guard's scan of the node's CUDA processes.
    Scan,
    /// Recorded by an older build, which did not say.
    #[default]
    #[serde(other)]
    Unknown,
}

impl AttachSource {
    /// The word `cryo status` and the logs use.
    pub fn as_str(self) -> &'static str {
        match self {
            AttachSource::Restore => "restore",
            AttachSource::Journal => "journal",
            AttachSource::Operator => "operator",
            AttachSource::Scan => "scan",
            AttachSource::Unknown => "unknown",
        }
    }
}

impl std::fmt::Display for AttachSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One journal entry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Record {
    /// Position in the journal, from 1, without gaps; assigned by the writer under the lock.
    pub seq: u64,
    /// When it was appended (UTC; stored as RFC 3339 with nanoseconds).
    #[serde(with = "rfc3339")]
    pub time: SystemTime,
    /// What happened.
    pub event: Event,
}

/// Everything cryo journals. Steps that act come in pairs: an intent (`*Started`, `StopRequested`),
/// written before acting, and an outcome, written after; a crash between them leaves the intent as
/// the last step of that process (see [`crate::in_flight_stops`]).
///
/// To add an event: add the variant (fields named as they should read in JSON), then the arms the
/// compiler asks for in [`Event::pids`], [`Event::label`], [`Event::detail`], [`Event::phase`].
/// Readers of an older build see an unknown variant as [`Event::Unknown`] instead of failing.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Event {
    // ---- stop ----
    /// `cryo stop` was asked to stop `target` (how the operator named it: `pid 4242`, a cgroup...).
    StopRequested {
        /// The target as given.
        target: String,
    },
    /// About to lock the process's CUDA context.
    LockStarted {
        /// The process.
        pid: ProcId,
    },
    /// Lock succeeded.
    Locked {
        /// The process.
        pid: ProcId,
        /// How long the lock took.
        ms: u64,
    },
    /// Lock failed (timeout, sticky error...); the process is still RUNNING.
    LockFailed {
        /// The process.
        pid: ProcId,
        /// The driver's error.
        error: String,
    },
    /// About to checkpoint the (locked) process's device memory into host memory.
    CheckpointStarted {
        /// The process.
        pid: ProcId,
    },
    /// Checkpoint succeeded.
    Checkpointed {
        /// The process.
        pid: ProcId,
        /// How long it took.
        ms: u64,
        /// Device memory moved (as NVML reported it before).
        bytes: u64,
    },
    /// Checkpoint failed.
    CheckpointFailed {
        /// The process.
        pid: ProcId,
        /// The driver's error.
        error: String,
    },
    /// NVML shows no device memory for the process any more.
    Verified {
        /// The process.
        pid: ProcId,
        /// How long after the checkpoint NVML stopped listing it (absent in older journals).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ms: Option<u64>,
    },
    /// NVML still showed device memory at the deadline.
    VerifyFailed {
        /// The process.
        pid: ProcId,
        /// Device memory still attributed to it.
        bytes_left: u64,
    },
    /// About to send `signal` to the process.
    KillStarted {
        /// The process.
        pid: ProcId,
        /// Signal number.
        signal: i32,
    },
    /// The process has exited (seen through its pidfd).
    Killed {
        /// The process.
        pid: ProcId,
    },
    /// cryo refused to end the process (and so every process of its target).
    Refused {
        /// The process that could not be made safe.
        pid: ProcId,
        /// Why.
        reason: String,
        /// What the operator can do.
        hint: String,
    },
    /// `cryo stop` finished.
    StopCompleted {
        /// The target as given.
        target: String,
        /// Processes ended.
        killed: Vec<ProcId>,
        /// Wall time of the whole stop.
        ms: u64,
        /// Processes cryo refused to end (each has its own [`Event::Refused`]); when not empty,
        /// the stop was refused (nothing ended) unless it was forced with `--unsafe`. Absent in
        /// older journals.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        refused: Vec<ProcId>,
    },
    /// The process is about to be killed without having been suspended (`--unsafe` or `--fresh`).
    UnsafeKill {
        /// The process.
        pid: ProcId,
    },
    /// The process's context was unlocked and runs again: after its restore (thaw), or because
    /// a suspension failed elsewhere in its target and this process, locked by it, was unlocked
    /// again and is serving.
    Unlocked {
        /// The process.
        pid: ProcId,
        /// How long the unlock took (absent in older journals).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ms: Option<u64>,
        /// True when a restarted guard or agent unlocked it in recovery: a thaw or wake whose
        /// owner died between the GPU restore and the unlock (absent when false).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        recovery: bool,
    },
    /// A suspension failed elsewhere in the target: this process, checkpointed by it, was
    /// restored and unlocked again and is serving.
    Resumed {
        /// The process.
        pid: ProcId,
    },
    /// The operator declared the process never restored (`--fresh`).
    FreshDeclared {
        /// The process.
        pid: ProcId,
    },
    /// About to suspend the process (lock, checkpoint, verify) for `purpose`, by the cryo process
    /// `by`: what a later run needs to finish or undo a suspension that died half-way.
    SuspendStarted {
        /// The process.
        pid: ProcId,
        /// What the suspension is for.
        purpose: Purpose,
        /// The cryo process that suspends it (a later run acts only once this one is gone).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<ProcId>,
    },
    /// The process was stopped by job control (SIGSTOP, SIGTSTP): about to resume it with
    /// SIGCONT, since the driver's restore thread inside it must run to suspend it.
    Continued {
        /// The process.
        pid: ProcId,
    },
    /// A driver call on the process did not return in time and was abandoned: the driver may
    /// still carry it out, so the process's state is unknown until someone looks again.
    CallAbandoned {
        /// The process.
        pid: ProcId,
        /// The driver's entry point.
        call: String,
        /// How long the caller waited.
        ms: u64,
    },
    /// What became of a suspension that did not end in a kill: settled by a later run after it
    /// died half-way (its [`Event::SuspendStarted`] owner gone), or left as it is by a stop that
    /// was refused. Either way it is no longer in flight.
    SuspensionSettled {
        /// The process.
        pid: ProcId,
        /// The driver's state found (`running`, `locked`, `checkpointed`...), or what was wrong.
        found: String,
        /// What was done (`unlocked`, `killed`, `resumed`, `checkpointed again, then resumed`,
        /// `nothing`, `left as it is: ...`).
        action: String,
    },

    // ---- freeze ----
    /// About to freeze a process tree into `image`.
    FreezeStarted {
        /// Image directory or name.
        image: String,
    },
    /// CRIU dumped the tree into the staging directory (not published yet).
    Dumped {
        /// Image directory or name.
        image: String,
        /// How long CRIU took (and the tree took to exit, unless left running).
        ms: u64,
        /// Size of what CRIU wrote.
        bytes: u64,
    },
    /// The image was published (complete, checksummed, renamed into place).
    ImagePublished {
        /// Image directory or name.
        image: String,
        /// Size of the image.
        bytes: u64,
    },
    /// Freeze failed.
    FreezeFailed {
        /// Image directory or name.
        image: String,
        /// What went wrong.
        error: String,
    },

    /// A dump is about to run CRIU and the main thread of every process of the tree rooted at
    /// `root` on one CPU (`cpu`), each one's own CPU set kept here; written (not synced) before
    /// the first is pinned. The dump gives the sets back once CRIU has exited
    /// ([`Event::CpusReturned`]); a dump that died first leaves this record open, and whoever
    /// finds its owner `by` gone gives them back (a power cut needs nothing: it ends every
    /// process the record names, and the record says which boot it is of).
    CpusPinned {
        /// The tree's root.
        root: ProcId,
        /// The cryo process that dumps it.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<ProcId>,
        /// The one CPU.
        cpu: u32,
        /// Every process to be pinned, with the CPUs its main thread may run on before.
        procs: Vec<PinnedCpus>,
        /// The host's boot (`/proc/sys/kernel/random/boot_id`).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        boot: Option<String>,
        /// When (clock ticks after boot, as start times): a thread or child a pinned main
        /// thread started since inherited the pin.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        since: Option<u64>,
    },
    /// The CPU sets a dump of `root` took are settled: given back to `returned`; left to
    /// `left`, whose sets someone else changed since the pin (theirs now) or that cannot be
    /// looked at; the others have ended (or their pids name other processes now).
    CpusReturned {
        /// The tree's root.
        root: ProcId,
        /// The cryo process that dumped it (the owner of its [`Event::CpusPinned`]).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        by: Option<ProcId>,
        /// Given back their own CPU sets.
        returned: Vec<ProcId>,
        /// Left as they are.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        left: Vec<ProcId>,
        /// Threads and child processes that inherited the pin since (started by a pinned main
        /// thread) given the CPU set of the process they came from.
        #[serde(default, skip_serializing_if = "is_zero")]
        inherited: u64,
        /// Settled by a later run: the dump died before it gave them back.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        recovery: bool,
    },

    // ---- thaw ----
    /// About to restore `image`.
    ThawStarted {
        /// Image directory or name.
        image: String,
    },
    /// CRIU restored the process tree of `image` (its CUDA contexts are still CHECKPOINTED).
    CriuRestored {
        /// Image directory or name.
        image: String,
        /// How long CRIU took.
        ms: u64,
    },
    /// About to restore the process's CUDA context through the driver (thaw, `cryo gpu restore`,
    /// the `cuda-checkpoint` front end, a freeze or stop resuming it in place): from this record
    /// on it counts as *restored*, whether or not the restore is ever seen to complete.
    RestoreStarted {
        /// The process.
        pid: ProcId,
        /// Image directory, or the command that restores it.
        image: String,
        /// The cryo process (a thaw or wake) that restores it and unlocks it next; absent when
        /// the restore leaves it LOCKED on purpose (`cryo gpu restore`, the `cuda-checkpoint`
        /// front end) and in older journals.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        unlock_by: Option<ProcId>,
    },
    /// A process of `image` was restored (CRIU and GPU): from now on it is a *restored* process.
    RestoreCompleted {
        /// The restored process (its new identity on this host).
        pid: ProcId,
        /// Image directory or name.
        image: String,
        /// How long the driver's restore of its context took; absent when there was none
        /// (a process without CUDA state), when it was not measured, and in older journals.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        ms: Option<u64>,
    },
    /// The restored worker answered its health check.
    HealthOk {
        /// The process.
        pid: ProcId,
        /// How long the check took.
        ms: u64,
    },
    /// Thaw finished.
    ThawCompleted {
        /// Image directory or name.
        image: String,
        /// Every restored process.
        pids: Vec<ProcId>,
        /// Wall time of the whole thaw.
        ms: u64,
    },
    /// Thaw failed.
    ThawFailed {
        /// Image directory or name.
        image: String,
        /// What went wrong.
        error: String,
    },

    // ---- park and wake (scale to zero in place) ----
    /// `cryo park` was asked to park `target`: suspend its CUDA processes in place (lock,
    /// checkpoint, verify) and keep them in host memory.
    ParkStarted {
        /// The target as given.
        target: String,
    },
    /// The process is parked: its device memory is in its host memory, its GPU free.
    Parked {
        /// The process.
        pid: ProcId,
        /// Device memory moved to host memory (as NVML listed it before).
        bytes: u64,
        /// The GPUs (UUIDs) it held, where a wake puts it back unless told otherwise.
        gpus: Vec<String>,
        /// Device memory on each GPU of `gpus`, in that order: what a wake needs free on each
        /// (absent in records written before it was kept: `bytes` split evenly).
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        gpu_bytes: Vec<u64>,
    },
    /// Park finished: every CUDA process of the target is parked.
    ParkCompleted {
        /// The target as given.
        target: String,
        /// The parked processes.
        pids: Vec<ProcId>,
        /// Wall time of the park.
        ms: u64,
    },
    /// Park failed; the processes it had suspended were brought back (the worker serves).
    ParkFailed {
        /// The target as given.
        target: String,
        /// What went wrong.
        error: String,
    },
    /// `cryo wake` (or an activation) was asked to wake `target`: restore, guard, unlock.
    WakeStarted {
        /// The target as given.
        target: String,
    },
    /// The wake found no GPU with room for a process and waits for room (`--when-full wait`);
    /// journaled once per wake, before its first wait.
    WakeWaiting {
        /// The target as given.
        target: String,
        /// Why it waits: "waiting for room on GPU ..." with what each GPU tried had.
        reason: String,
    },
    /// Wake finished: every parked process of the target runs again (restored, guarded when a
    /// guard runs, unlocked).
    WakeCompleted {
        /// The target as given.
        target: String,
        /// The woken processes.
        pids: Vec<ProcId>,
        /// Wall time of the wake.
        ms: u64,
    },
    /// Wake failed; the processes stay (or were put back) parked.
    WakeFailed {
        /// The target as given.
        target: String,
        /// What went wrong.
        error: String,
    },

    // ---- shrink before suspend ----
    /// About to ask the engine of `target` to release what it can rebuild (`spec`, its
    /// `--shrink`) before a suspension.
    ShrinkStarted {
        /// The target as given.
        target: String,
        /// The `--shrink` spec.
        spec: String,
    },
    /// The engine's answer: `outcome` `shrunk` (grow it after the restore), `whole` (it did not
    /// shrink and is whole: the suspension copies all of its memory) or `unknown` (a failed
    /// release that could not be undone: grow it after the restore).
    ShrinkCompleted {
        /// The target as given.
        target: String,
        /// Its processes.
        pids: Vec<ProcId>,
        /// The `--shrink` spec.
        spec: String,
        /// The engine's address, if the spec needs one.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        engine: Option<String>,
        /// `shrunk`, `whole` or `unknown`.
        outcome: String,
        /// Why it did not shrink.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
        /// Wall time, ms.
        ms: u64,
    },
    /// The engine took back what it released.
    Grown {
        /// The target as given.
        target: String,
        /// Its processes.
        pids: Vec<ProcId>,
        /// Wall time, ms.
        ms: u64,
    },
    /// The engine could not be asked to take back what it released (it may answer 503 until
    /// someone does).
    GrowFailed {
        /// The target as given.
        target: String,
        /// Its processes.
        pids: Vec<ProcId>,
        /// What went wrong.
        error: String,
    },

    // ---- the pre-thawed standby pool (the agent) ----
    /// The agent keeps `count` standbys of `image` ready (0: the pool is removed).
    StandbyPool {
        /// The image directory.
        image: String,
        /// How many to keep ready.
        count: u32,
        /// The deadline of each standby's CRIU restore, s (absent: the default for the image's
        /// size, as a thaw's).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        criu_timeout_s: Option<u64>,
    },
    /// CRIU restored a standby's tree (every process restored, none run yet: written at CRIU's
    /// gate, before the tree may run). Until its `StandbyReady` or `StandbyDropped`, the
    /// standby is unfinished: an agent that starts ends it (every process CHECKPOINTED, as the
    /// driver says) or guards it (anything else).
    StandbyRestoring {
        /// The image directory.
        image: String,
        /// Its root.
        root: ProcId,
        /// Every process of it, root first.
        pids: Vec<ProcId>,
    },
    /// A standby is ready: `image` restored by CRIU without its GPU restore, every CUDA process
    /// CHECKPOINTED (and journaled `Parked`), kept for a claim.
    StandbyReady {
        /// The image directory.
        image: String,
        /// The manifest digest of the image it came from.
        digest: String,
        /// Its root.
        root: ProcId,
        /// Every process of it.
        pids: Vec<ProcId>,
    },
    /// A standby was handed out (woken: restored, guarded, unlocked).
    StandbyClaimed {
        /// The image directory.
        image: String,
        /// Its root.
        root: ProcId,
    },
    /// A standby left the pool without being handed out (why: exited, stale image, removed).
    StandbyDropped {
        /// The image directory.
        image: String,
        /// Its root.
        root: ProcId,
        /// Why, and what became of it.
        reason: String,
    },

    // ---- activators (the agent) ----
    /// An activator of the agent listens on `listen` in front of a worker (`again`: an agent that
    /// started listens where its predecessor's activator did, the worker found `found`).
    ActivatorListening {
        /// The service address (`127.0.0.1:8000`, `unix:/run/svc.sock`).
        listen: String,
        /// The worker's processes (a pid target's, a standby activator's claimed root; none for
        /// a cgroup or a standby not claimed yet).
        pids: Vec<ProcId>,
        /// What the driver said of the worker: `active`, `parked`, `waking`, `parking`.
        found: String,
        /// Listening again after an agent restart (the dead agent's open connections ended with
        /// it; see the agent's activators).
        again: bool,
        /// The listening socket was taken from the last agent's keeper (the connections queued
        /// in it kept), not bound again.
        #[serde(default)]
        handed: bool,
    },
    /// An activator of the agent stopped listening on `listen` (removed on request, or dropped
    /// by an agent that started: its worker is gone).
    ActivatorRemoved {
        /// The service address.
        listen: String,
        /// Why.
        reason: String,
    },

    // ---- guard ----
    /// The guard watches the process.
    GuardAttached {
        /// The process.
        pid: ProcId,
        /// Why it is guarded (what a restarted guard re-attaches it as); older journals have none.
        #[serde(default)]
        source: AttachSource,
    },
    /// The process received a fatal signal (intercepted by the guard).
    FatalSignal {
        /// The process.
        pid: ProcId,
        /// Signal number.
        signal: i32,
    },
    /// The process's driver fds are held open by cryo so its context is not torn down.
    Pinned {
        /// The process.
        pid: ProcId,
        /// GPU (UUID) whose context is pinned.
        gpu: String,
        /// Fd numbers (in the process) that were duplicated.
        fds: Vec<i32>,
    },
    /// The GPU was fenced.
    GpuQuarantined {
        /// GPU UUID.
        gpu: String,
        /// Why.
        reason: String,
    },
    /// The pins of the process were released (controlled endgame).
    PinsReleased {
        /// The process.
        pid: ProcId,
    },
    /// The guard lost the process (detached or the guard itself failed).
    GuardLost {
        /// The process.
        pid: ProcId,
    },
    /// A process the guard watched has exited (seen by the guard, after whatever it did).
    ProcessExited {
        /// The process.
        pid: ProcId,
        /// How it ended (`killed by SIGSEGV`, `exited with status 1`).
        how: String,
    },
    /// A process the guard watched replaced its program (`execve`): the restored program is gone
    /// (its close-on-exec driver fds closed, its memory dropped; what the guard held of its
    /// context is pinned, `Pinned` before this), and the same pid and start time now name a new
    /// program that was never restored.
    Execed {
        /// The process (same pid and start time before and after the exec).
        pid: ProcId,
        /// The thread that called `execve` (its id before the kernel gave it the leader's); 0
        /// when no exec stop saw it: the process closed every driver file between the guard's
        /// look before its seize and its look after it, as an `execve`'s close-on-exec does.
        thread: i32,
    },
    /// The pin holder acknowledged the pinned fds of the process: they outlive the guard now.
    PinsHanded {
        /// The dead process whose fds are pinned.
        pid: ProcId,
        /// The pin holder that holds them.
        holder: ProcId,
    },
    /// The pin holder could not take the pinned fds of the process: the guard keeps them in its
    /// own process, and they close if it dies.
    PinsKeptByGuard {
        /// The dead process whose fds are pinned.
        pid: ProcId,
        /// Why the holder did not take them.
        error: String,
    },
    /// Pins of the process are gone without a release (the process that held them died): its
    /// context was torn down, which wedges affected hosts. Its GPUs stay quarantined.
    PinsLost {
        /// The dead process whose fds were pinned.
        pid: ProcId,
        /// What is known about how they were lost.
        reason: String,
    },

    // ---- the journal itself ----
    /// A writer cut a torn or corrupt tail (after a crash of a writer or a power cut).
    JournalRepaired {
        /// Offset where the cut bytes began.
        offset: u64,
        /// How many bytes were cut.
        bytes: u64,
    },

    /// The journal was rotated ([`crate::Journal::rotate`]): the segment before this record is
    /// kept as the archive `archive`, and this segment begins with copies of its records that
    /// recovery still needs (their own seq and time), then this record, then new appends. A
    /// follower that has returned every record up to `last_seq` goes on in this segment; one
    /// behind it finds the records it has not seen in `archive` (and the archives before it).
    Rotated {
        /// File name of the archive in the journal directory (`journal.<first_seq>.log`).
        archive: String,
        /// The seq of the first record appended to the archived segment (after its own carried
        /// records and rotation record, if it had any).
        first_seq: u64,
        /// The last seq of the archived segment: this segment holds every record after it.
        last_seq: u64,
        /// How many records were carried (copied before this record).
        carried: u64,
        /// Time of the journal's first record (seq 1), as it was stored (RFC 3339): the journal's
        /// identity, kept across rotations for followers that store a position.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        origin: Option<String>,
    },

    /// An event of a newer cryo that this build does not know.
    #[serde(other)]
    Unknown,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// A process a dump pins to one CPU, with the CPUs its main thread may run on before
/// ([`Event::CpusPinned`]).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PinnedCpus {
    /// The process.
    pub pid: ProcId,
    /// Its own CPU set (CPU numbers, ascending).
    pub cpus: Vec<u32>,
}

/// Whether an event is written before an action or after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// Written before acting: if it is a process's last step, the action may be half done.
    Intent,
    /// Written after acting.
    Outcome,
    /// Neither (declarations, repairs, unknown events).
    Note,
}

impl Event {
    /// The process this event is mainly about, if any.
    pub fn proc(&self) -> Option<ProcId> {
        use Event::*;
        match self {
            PinsHanded { pid, .. } | PinsKeptByGuard { pid, .. } | PinsLost { pid, .. } => {
                Some(*pid)
            }
            LockStarted { pid }
            | Locked { pid, .. }
            | LockFailed { pid, .. }
            | CheckpointStarted { pid }
            | Checkpointed { pid, .. }
            | CheckpointFailed { pid, .. }
            | Verified { pid, .. }
            | VerifyFailed { pid, .. }
            | KillStarted { pid, .. }
            | Killed { pid }
            | Refused { pid, .. }
            | FreshDeclared { pid }
            | SuspendStarted { pid, .. }
            | Continued { pid }
            | CallAbandoned { pid, .. }
            | SuspensionSettled { pid, .. }
            | RestoreStarted { pid, .. }
            | UnsafeKill { pid }
            | Unlocked { pid, .. }
            | Resumed { pid }
            | RestoreCompleted { pid, .. }
            | Parked { pid, .. }
            | StandbyRestoring { root: pid, .. }
            | StandbyClaimed { root: pid, .. }
            | StandbyDropped { root: pid, .. }
            | HealthOk { pid, .. }
            | GuardAttached { pid, .. }
            | FatalSignal { pid, .. }
            | Pinned { pid, .. }
            | PinsReleased { pid }
            | GuardLost { pid }
            | Execed { pid, .. }
            | ProcessExited { pid, .. } => Some(*pid),
            StopRequested { .. }
            | StopCompleted { .. }
            | FreezeStarted { .. }
            | Dumped { .. }
            | ImagePublished { .. }
            | FreezeFailed { .. }
            | ThawStarted { .. }
            | CriuRestored { .. }
            | ThawCompleted { .. }
            | ThawFailed { .. }
            | ParkStarted { .. }
            | ParkCompleted { .. }
            | ParkFailed { .. }
            | WakeStarted { .. }
            | WakeWaiting { .. }
            | WakeCompleted { .. }
            | WakeFailed { .. }
            | ShrinkStarted { .. }
            | ShrinkCompleted { .. }
            | Grown { .. }
            | GrowFailed { .. }
            | StandbyPool { .. }
            | StandbyReady { .. }
            | ActivatorListening { .. }
            | ActivatorRemoved { .. }
            | GpuQuarantined { .. }
            | JournalRepaired { .. }
            | Rotated { .. }
            | CpusPinned { .. }
            | CpusReturned { .. }
            | Unknown => None,
        }
    }

    /// Every process the event names (for `--pid` filtering).
    pub fn pids(&self) -> Vec<ProcId> {
        match self {
            Event::StopCompleted {
                killed, refused, ..
            } => killed.iter().chain(refused).copied().collect(),
            Event::ThawCompleted { pids, .. }
            | Event::ParkCompleted { pids, .. }
            | Event::WakeCompleted { pids, .. }
            | Event::ShrinkCompleted { pids, .. }
            | Event::Grown { pids, .. }
            | Event::GrowFailed { pids, .. }
            | Event::StandbyRestoring { pids, .. }
            | Event::StandbyReady { pids, .. }
            | Event::ActivatorListening { pids, .. } => pids.clone(),
            Event::CpusPinned { procs, .. } => procs.iter().map(|p| p.pid).collect(),
            Event::CpusReturned { returned, left, .. } => {
                returned.iter().chain(left).copied().collect()
            }
            other => other.proc().into_iter().collect(),
        }
    }

    /// Intent, outcome or note.
    pub fn phase(&self) -> Phase {
        use Event::*;
        match self {
            PinsHanded { .. } | PinsKeptByGuard { .. } | PinsLost { .. } => Phase::Outcome,
            StopRequested { .. }
            | LockStarted { .. }
            | CheckpointStarted { .. }
            | KillStarted { .. }
            | UnsafeKill { .. }
            | FreezeStarted { .. }
            | ThawStarted { .. }
            | SuspendStarted { .. }
            | Continued { .. }
            | RestoreStarted { .. }
            | ParkStarted { .. }
            | WakeStarted { .. }
            | ShrinkStarted { .. }
            | StandbyRestoring { .. }
            | CpusPinned { .. } => Phase::Intent,
            Locked { .. }
            | LockFailed { .. }
            | Checkpointed { .. }
            | CheckpointFailed { .. }
            | Verified { .. }
            | VerifyFailed { .. }
            | Killed { .. }
            | Refused { .. }
            | Unlocked { .. }
            | Resumed { .. }
            | StopCompleted { .. }
            | Dumped { .. }
            | ImagePublished { .. }
            | FreezeFailed { .. }
            | CriuRestored { .. }
            | RestoreCompleted { .. }
            | HealthOk { .. }
            | ThawCompleted { .. }
            | ThawFailed { .. }
            | Parked { .. }
            | ParkCompleted { .. }
            | ParkFailed { .. }
            | WakeCompleted { .. }
            | WakeFailed { .. }
            | ShrinkCompleted { .. }
            | Grown { .. }
            | GrowFailed { .. }
            | StandbyReady { .. }
            | StandbyClaimed { .. }
            | StandbyDropped { .. }
            | GuardAttached { .. }
            | FatalSignal { .. }
            | Pinned { .. }
            | GpuQuarantined { .. }
            | PinsReleased { .. }
            | GuardLost { .. }
            | ProcessExited { .. }
            | Execed { .. }
            | CallAbandoned { .. }
            | SuspensionSettled { .. }
            | CpusReturned { .. } => Phase::Outcome,
            FreshDeclared { .. }
            | StandbyPool { .. }
            | ActivatorListening { .. }
            | ActivatorRemoved { .. }
            | JournalRepaired { .. }
            | Rotated { .. }
            | WakeWaiting { .. }
            | Unknown => Phase::Note,
        }
    }

    /// Short lower-case name for the timeline (`checkpointed`, `lock started`).
    pub fn label(&self) -> &'static str {
        use Event::*;
        match self {
            StopRequested { .. } => "stop requested",
            LockStarted { .. } => "lock started",
            Locked { .. } => "locked",
            LockFailed { .. } => "lock failed",
            CheckpointStarted { .. } => "checkpoint started",
            Checkpointed { .. } => "checkpointed",
            CheckpointFailed { .. } => "checkpoint failed",
            Verified { .. } => "verified",
            VerifyFailed { .. } => "verify failed",
            KillStarted { .. } => "kill started",
            Killed { .. } => "killed",
            Refused { .. } => "REFUSED",
            StopCompleted { .. } => "stop completed",
            FreshDeclared { .. } => "declared fresh",
            SuspendStarted { .. } => "suspend started",
            Continued { .. } => "continued (was stopped)",
            CallAbandoned { .. } => "DRIVER CALL ABANDONED",
            SuspensionSettled { .. } => "suspension settled",
            RestoreStarted { .. } => "restore started",
            UnsafeKill { .. } => "UNSAFE KILL (not suspended)",
            Unlocked { .. } => "unlocked",
            Resumed { .. } => "resumed (suspension refused)",
            FreezeStarted { .. } => "freeze started",
            Dumped { .. } => "dumped",
            ImagePublished { .. } => "image published",
            FreezeFailed { .. } => "freeze failed",
            CpusPinned { .. } => "dump pinned to one CPU",
            CpusReturned {
                recovery: false, ..
            } => "CPU sets given back",
            CpusReturned { recovery: true, .. } => "CPU sets given back (recovery)",
            ThawStarted { .. } => "thaw started",
            CriuRestored { .. } => "criu restored",
            RestoreCompleted { .. } => "restore completed",
            HealthOk { .. } => "health ok",
            ThawCompleted { .. } => "thaw completed",
            ThawFailed { .. } => "thaw failed",
            ParkStarted { .. } => "park started",
            Parked { .. } => "parked",
            ParkCompleted { .. } => "park completed",
            ParkFailed { .. } => "park failed",
            WakeStarted { .. } => "wake started",
            WakeWaiting { .. } => "wake waiting",
            WakeCompleted { .. } => "wake completed",
            WakeFailed { .. } => "wake failed",
            ShrinkStarted { .. } => "shrink started",
            ShrinkCompleted { .. } => "shrink completed",
            Grown { .. } => "grown",
            GrowFailed { .. } => "GROW FAILED",
            StandbyPool { .. } => "standby pool set",
            StandbyRestoring { .. } => "standby restoring",
            StandbyReady { .. } => "standby ready",
            StandbyClaimed { .. } => "standby claimed",
            StandbyDropped { .. } => "standby dropped",
            ActivatorListening { again: false, .. } => "activator listening",
            ActivatorListening { again: true, .. } => "activator listening again",
            ActivatorRemoved { .. } => "activator removed",
            GuardAttached { .. } => "guard attached",
            FatalSignal { .. } => "FATAL SIGNAL",
            Pinned { .. } => "pinned",
            GpuQuarantined { .. } => "GPU QUARANTINED",
            PinsReleased { .. } => "pins released",
            GuardLost { .. } => "GUARD LOST",
            ProcessExited { .. } => "exited",
            Execed { .. } => "replaced its program (execve)",
            PinsHanded { .. } => "pins handed to the holder",
            PinsKeptByGuard { .. } => "PINS KEPT BY THE GUARD (no holder)",
            PinsLost { .. } => "PINS LOST (likely wedge)",
            JournalRepaired { .. } => "journal repaired",
            Rotated { .. } => "journal rotated",
            Unknown => "unknown event",
        }
    }

    /// The event's values as the timeline shows them (`1830 ms, 5.8 GB`); empty when none.
    pub fn detail(&self) -> String {
        use cryo_units::fmt_bytes;
        use Event::*;
        match self {
            PinsHanded { holder, .. } => format!("pin holder pid {}", holder.pid),
            PinsKeptByGuard { error, .. } => error.clone(),
            PinsLost { reason, .. } => reason.clone(),
            StopRequested { target } => format!("target {target}"),
            GuardAttached { source, .. } => format!("source {source}"),
            Locked { ms, .. } | HealthOk { ms, .. } => format!("{ms} ms"),
            LockFailed { error, .. } | CheckpointFailed { error, .. } => error.clone(),
            Checkpointed { ms, bytes, .. } => format!("{ms} ms, {}", fmt_bytes(*bytes)),
            Verified { ms: None, .. } => "no device memory left".to_owned(),
            VerifyFailed { bytes_left, .. } => {
                format!("{} still on the GPU", fmt_bytes(*bytes_left))
            }
            KillStarted { signal, .. } | FatalSignal { signal, .. } => {
                cryo_proc::signal_name(*signal)
            }
            Refused { reason, hint, .. } => format!("{reason} (hint: {hint})"),
            StopCompleted {
                target,
                killed,
                ms,
                refused,
            } => {
                let refused = match refused.len() {
                    0 => String::new(),
                    n => format!(", {n} refused"),
                };
                format!("target {target}, {} ended{refused}, {ms} ms", killed.len())
            }
            Verified { ms: Some(ms), .. } => format!("no device memory left, {ms} ms"),
            Unlocked {
                ms: Some(ms),
                recovery: false,
                ..
            } => format!("{ms} ms"),
            Unlocked { recovery: true, .. } => {
                "recovery: the thaw or wake that restored it died before the unlock".to_string()
            }
            RestoreCompleted {
                image,
                ms: Some(ms),
                ..
            } => format!("image {image}, {ms} ms"),
            FreezeStarted { image } | ThawStarted { image } | RestoreCompleted { image, .. } => {
                format!("image {image}")
            }
            Dumped { image, ms, bytes } => {
                format!("image {image}, {ms} ms, {}", fmt_bytes(*bytes))
            }
            CriuRestored { image, ms } => format!("image {image}, {ms} ms"),
            ImagePublished { image, bytes } => format!("image {image}, {}", fmt_bytes(*bytes)),
            FreezeFailed { image, error } | ThawFailed { image, error } => {
                format!("image {image}: {error}")
            }
            ThawCompleted { image, pids, ms } => {
                let list: Vec<String> = pids.iter().map(|p| p.pid.to_string()).collect();
                format!("image {image}, pids [{}], {ms} ms", list.join(", "))
            }
            Pinned { gpu, fds, .. } => format!("GPU {gpu}, {} fds", fds.len()),
            SuspendStarted { purpose, by, .. } => match by {
                Some(by) => format!("for {purpose}, by pid {}", by.pid),
                None => format!("for {purpose}"),
            },
            CallAbandoned { call, ms, .. } => format!("{call}: no answer in {ms} ms"),
            SuspensionSettled { found, action, .. } => format!("found {found}: {action}"),
            RestoreStarted { image, .. } => format!("image {image}"),
            ParkStarted { target } | WakeStarted { target } => format!("target {target}"),
            WakeWaiting { target, reason } => format!("target {target}: {reason}"),
            Parked { bytes, gpus, .. } => {
                format!("{} off GPU {}", fmt_bytes(*bytes), gpus.join(","))
            }
            ParkCompleted { target, pids, ms } | WakeCompleted { target, pids, ms } => {
                let list: Vec<String> = pids.iter().map(|p| p.pid.to_string()).collect();
                format!("target {target}, pids [{}], {ms} ms", list.join(", "))
            }
            ParkFailed { target, error } | WakeFailed { target, error } => {
                format!("target {target}: {error}")
            }
            ShrinkStarted { target, spec } => format!("target {target}, {spec}"),
            ShrinkCompleted {
                target,
                spec,
                outcome,
                error,
                ms,
                ..
            } => match error {
                Some(e) => format!("target {target}, {spec}: {outcome} ({e}), {ms} ms"),
                None => format!("target {target}, {spec}: {outcome}, {ms} ms"),
            },
            Grown { target, ms, .. } => format!("target {target}, {ms} ms"),
            GrowFailed { target, error, .. } => format!("target {target}: {error}"),
            StandbyPool { image, count, .. } => format!("image {image}, {count} kept ready"),
            StandbyRestoring {
                image, root, pids, ..
            }
            | StandbyReady {
                image, root, pids, ..
            } => {
                format!(
                    "image {image}, root pid {}, {} processes",
                    root.pid,
                    pids.len()
                )
            }
            StandbyClaimed { image, .. } => format!("image {image}"),
            StandbyDropped { image, reason, .. } => format!("image {image}: {reason}"),
            ActivatorListening {
                listen,
                found,
                handed,
                ..
            } => format!(
                "on {listen}, the worker {found}{}",
                if *handed {
                    ", the socket taken over"
                } else {
                    ""
                }
            ),
            ActivatorRemoved { listen, reason } => format!("on {listen}: {reason}"),
            GpuQuarantined { gpu, reason } => format!("GPU {gpu}: {reason}"),
            ProcessExited { how, .. } => how.clone(),
            Execed { thread: 0, .. } => {
                "execve while the guard was attaching (its driver files were gone at the seize)"
                    .into()
            }
            Execed { thread, .. } => format!("execve by thread {thread}"),
            CpusPinned {
                root, cpu, procs, ..
            } => format!(
                "tree of pid {}: {} processes on CPU {cpu}",
                root.pid,
                procs.len()
            ),
            CpusReturned {
                root,
                returned,
                left,
                ..
            } => {
                let list = |l: &[ProcId]| -> String {
                    let pids: Vec<String> = l.iter().map(|p| p.pid.to_string()).collect();
                    pids.join(", ")
                };
                match left.len() {
                    0 => format!("tree of pid {}: [{}]", root.pid, list(returned)),
                    _ => format!(
                        "tree of pid {}: [{}]; left as they are (changed since): [{}]",
                        root.pid,
                        list(returned),
                        list(left)
                    ),
                }
            }
            JournalRepaired { offset, bytes } => {
                format!("cut {bytes} torn bytes at offset {offset}")
            }
            Rotated {
                archive,
                first_seq,
                last_seq,
                carried,
                ..
            } => {
                format!("records {first_seq}..{last_seq} archived as {archive}, {carried} carried")
            }
            LockStarted { .. }
            | CheckpointStarted { .. }
            | Killed { .. }
            | FreshDeclared { .. }
            | Continued { .. }
            | UnsafeKill { .. }
            | Unlocked {
                ms: None,
                recovery: false,
                ..
            }
            | Resumed { .. }
            | PinsReleased { .. }
            | GuardLost { .. }
            | Unknown => String::new(),
        }
    }
}

/// What a suspension is for: what a later run does with a process whose suspension died half-way.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// `cryo stop`: the process is to end (a later run finishes the stop).
    Stop,
    /// `cryo freeze`: the process is to be dumped (a later run resumes it).
    Freeze,
    /// The guard, before letting a fatal signal through (a later run finishes it like a stop).
    Guard,
    /// `cryo park`: the process is to stay suspended in place; once `Parked` is journaled the
    /// suspension is final (a later run that finds it half-way resumes it, as for a freeze).
    Park,
    /// A restarted guard or agent (or a wake) checkpoints again a LOCKED process whose restore
    /// is not journaled as done, its writer gone, to have the driver's word that its context is
    /// whole, then restores and unlocks it under watch: a later run that finds it half-way
    /// resumes it under watch (LOCKED: checkpointed again first, never unlocked on the state's
    /// word; CHECKPOINTED: restored), as for a freeze. An older cryo reads it as
    /// [`Purpose::Other`] and leaves the process as it is (safe).
    Recheck,
    /// A purpose of a newer cryo (a later run leaves the process as it is).
    #[serde(other)]
    Other,
}

impl std::fmt::Display for Purpose {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Purpose::Stop => "stop",
            Purpose::Freeze => "freeze",
            Purpose::Park => "park",
            Purpose::Guard => "guard",
            Purpose::Recheck => "re-checkpoint",
            Purpose::Other => "other",
        })
    }
}

/// `SystemTime` as an RFC 3339 UTC string with nanoseconds (`2026-11-30T02:41:07.123456789Z`).
mod rfc3339 {
    use std::time::SystemTime;

    use serde::{de::Error as _, ser::Error as _, Deserialize, Deserializer, Serializer};

    pub(super) fn serialize<S: Serializer>(t: &SystemTime, s: S) -> Result<S::Ok, S::Error> {
        let text = crate::timeline::fmt_utc(*t, crate::timeline::Subsec::Nanos)
            .ok_or_else(|| S::Error::custom(format!("time {t:?} is outside years 1970..9999")))?;
        s.serialize_str(&text)
    }

    pub(super) fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
        let text = String::deserialize(d)?;
        time::OffsetDateTime::parse(&text, &time::format_description::well_known::Rfc3339)
            .map(SystemTime::from)
            .map_err(D::Error::custom)
    }
}
