//! Kubernetes Events for cryo's steps, from the journal, aggregated so a flood cannot hammer the
//! API server.
//!
//! # Design
//! [`step_of`] (pure) says which journal events are steps an operator should see in
//! `kubectl describe` (stop, freeze, thaw, park, wake, pin, quarantine, release, the guard's
//! interventions)
//! and how they read; finer events (lock, checkpoint, verify of each process) stay in the journal.
//! A step is posted on the Pod of the process it is about when that process is in a pod of this
//! node, else on the Node.
//!
//! [`Correlator`] (pure, with the clock passed in) does what client-go's event correlator does:
//! the same step on the same object within [`AGGREGATE_WINDOW`] becomes a patch of the existing
//! Event (`count` + 1, `lastTimestamp`), not a new object; and each object has a token bucket
//! ([`BURST`] Events, then one per [`REFILL`]): beyond it Events are dropped and counted, and the
//! next one posted says how many were dropped. So whatever the journal does, the API server sees
//! at most `BURST` writes per object and then one per `REFILL`.
//!
//! Events are core/v1 Events posted directly, as the kubelet does (kube-runtime's `Recorder`
//! fails for cluster-scoped objects on older servers). Node Events go to the `default`
//! namespace, as the kubelet's.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use cryo_journal::{Event, ProcId};

use crate::identity::{identity_from_path, PodUid};

/// Repeats of one step on one object within this window are aggregated into one Event.
pub const AGGREGATE_WINDOW: Duration = Duration::from_secs(600);
/// Events an object may get at once.
pub const BURST: u32 = 25;
/// Then one per this.
pub const REFILL: Duration = Duration::from_secs(10);
/// Objects remembered by the correlator; the least recently used are forgotten beyond it.
pub const MAX_TRACKED: usize = 4096;

/// `Normal` or `Warning`, as core/v1 Events have it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// Something expected happened.
    Normal,
    /// Something an operator should look at.
    Warning,
}

impl EventType {
    /// The API's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Normal => "Normal",
            EventType::Warning => "Warning",
        }
    }
}

/// Which object a step is about, before it is looked up in the API.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Subject {
    /// A pod of this node.
    Pod(PodUid),
    /// This node.
    Node,
}

/// What the step is about, as the journal says it: resolved to a [`Subject`] by a [`Locate`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum About {
    /// A process.
    Proc(ProcId),
    /// A stop target as `cryo stop` described it (`cgroup /sys/fs/cgroup/...`, `pids 1,2`).
    Target(String),
    /// The node (images, GPUs, the journal).
    Node,
}

/// A step to show as an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    /// `Normal` or `Warning`.
    pub kind: EventType,
    /// The Event's reason (`CryoStopped`).
    pub reason: &'static str,
    /// The Event's message.
    pub message: String,
    /// What it is about.
    pub about: About,
}

/// The step a journal event is, if it is one operators should see as an Event.
pub fn step_of(event: &Event) -> Option<Step> {
    use EventType::{Normal, Warning};
    let detail = event.detail();
    let (kind, reason, message, about) = match event {
        Event::StopRequested { target } => (
            Normal,
            "CryoStopping",
            format!("cryo stop: suspending the CUDA contexts of {target} before ending it"),
            About::Target(target.clone()),
        ),
        Event::StopCompleted { target, refused, .. } if !refused.is_empty() => (
            Warning,
            "CryoStopRefused",
            format!("cryo stop of {target}: {detail}"),
            About::Target(target.clone()),
        ),
        Event::StopCompleted { target, killed, ms, .. } => (
            Normal,
            "CryoStopped",
            format!("cryo stop: {} processes of {target} suspended and ended in {ms} ms", killed.len()),
            About::Target(target.clone()),
        ),
        Event::Refused { pid, .. } => (
            Warning,
            "CryoStopRefused",
            format!("cryo stop refused: nothing was killed: {detail}"),
            About::Proc(*pid),
        ),
        Event::UnsafeKill { pid } => (
            Warning,
            "CryoUnsafeKill",
            format!("pid {} ends without suspension (--unsafe or --fresh)", pid.pid),
            About::Proc(*pid),
        ),
        Event::FreezeStarted { image } => (Normal, "CryoFreezing", format!("freezing into {image}"), About::Node),
        Event::ImagePublished { .. } => (Normal, "CryoFrozen", format!("image published: {detail}"), About::Node),
        Event::FreezeFailed { .. } => (Warning, "CryoFreezeFailed", format!("freeze failed: {detail}"), About::Node),
        Event::ThawStarted { image } => (Normal, "CryoThawing", format!("restoring {image}"), About::Node),
        Event::RestoreCompleted { pid, image, .. } => (
            Normal,
            "CryoRestored",
            format!("pid {} restored from {image}", pid.pid),
            About::Proc(*pid),
        ),
        Event::ThawCompleted { .. } => (Normal, "CryoThawed", format!("thaw done: {detail}"), About::Node),
        Event::ThawFailed { .. } => (Warning, "CryoThawFailed", format!("thaw failed: {detail}"), About::Node),
        Event::ParkCompleted { target, pids, ms } => (
            Normal,
            "CryoParked",
            format!("{} processes of {target} parked in host memory in {ms} ms (their GPUs are free)", pids.len()),
            About::Target(target.clone()),
        ),
        Event::ParkFailed { target, .. } => (
            Warning,
            "CryoParkFailed",
            format!("park of {target} failed: {detail}"),
            About::Target(target.clone()),
        ),
        Event::WakeCompleted { target, pids, ms } => (
            Normal,
            "CryoWoken",
            format!("{} processes of {target} woken in {ms} ms", pids.len()),
            About::Target(target.clone()),
        ),
        Event::WakeFailed { target, .. } => (
            Warning,
            "CryoWakeFailed",
            format!("wake of {target} failed (it stays parked): {detail}"),
            About::Target(target.clone()),
        ),
        Event::FatalSignal { pid, .. } => (
            Warning,
            "CryoFatalSignal",
            format!("pid {} got {detail}: the guard suspends its CUDA context before the signal is delivered", pid.pid),
            About::Proc(*pid),
        ),
        Event::Pinned { pid, .. } => (
            Warning,
            "CryoPinned",
            format!("pid {} died live; its driver files are held open so the context is not torn down: {detail}", pid.pid),
            About::Proc(*pid),
        ),
        Event::GpuQuarantined { .. } => (Warning, "CryoGpuQuarantined", format!("GPU quarantined: {detail}"), About::Node),
        Event::PinsReleased { pid } => (
            Warning,
            "CryoPinsReleased",
            format!("the pins of pid {} were released by the operator", pid.pid),
            About::Node,
        ),
        Event::GuardLost { pid } => (
            Warning,
            "CryoGuardLost",
            format!("the guard no longer watches pid {}", pid.pid),
            About::Proc(*pid),
        ),
        Event::PinsLost { pid, .. } => (
            Warning,
            "CryoPinsLost",
            format!("the pins of pid {} were lost without a release (its context was torn down; the node may be wedged): {detail}", pid.pid),
            About::Node,
        ),
        Event::JournalRepaired { .. } => (Warning, "CryoJournalRepaired", format!("journal: {detail}"), About::Node),
        _ => return None,
    };
    Some(Step {
        kind,
        reason,
        message,
        about,
    })
}

/// Finds the pod of a process of this node (through its cgroup; see [`crate::caller`]).
pub trait Locate {
    /// The pod of the process, if it still runs and is in one.
    fn pod_of(&self, p: ProcId) -> Option<PodUid>;
}

/// The subject of a step: a process's pod, the pod a stop target names (a container's cgroup
/// names it; a pid list is looked up by its first live process), else the node.
pub fn subject_of(about: &About, locate: &impl Locate) -> Subject {
    let pod = match about {
        About::Proc(p) => locate.pod_of(*p),
        About::Target(t) => t
            .split_whitespace()
            .find_map(|w| identity_from_path(w).ok().map(|i| i.pod))
            .or_else(|| {
                t.split(|c: char| !c.is_ascii_digit())
                    .filter_map(|n| n.parse::<i32>().ok())
                    .filter_map(|pid| cryo_proc::stat(pid).ok())
                    .find_map(|st| locate.pod_of(ProcId::new(st.pid, st.start_time)))
            }),
        About::Node => None,
    };
    pod.map_or(Subject::Node, Subject::Pod)
}

/// What to do with an Event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Create a new Event; `dropped` Events on this object were dropped before it.
    Create {
        /// How many were dropped by the spam filter since the last one posted.
        dropped: u64,
    },
    /// The same step on the same object was posted within the window: patch that Event.
    Aggregate {
        /// Its name.
        name: String,
        /// Its new count.
        count: i32,
    },
    /// Over the object's rate: not posted.
    Drop,
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
    dropped: u64,
    used: Instant,
}

#[derive(Debug)]
struct Posted {
    name: String,
    count: i32,
    at: Instant,
}

/// Aggregation and spam filter (see the module's design).
#[derive(Debug, Default)]
pub struct Correlator {
    buckets: HashMap<Subject, Bucket>,
    posted: HashMap<(Subject, EventType, &'static str, String), Posted>,
}

impl Correlator {
    /// A correlator with nothing seen.
    pub fn new() -> Self {
        Self::default()
    }

    /// Decides for `step` on `subject` at `now`. After a `Create`, call [`Correlator::created`]
    /// with the new Event's name once the API accepted it.
    pub fn decide(&mut self, subject: &Subject, step: &Step, now: Instant) -> Decision {
        self.forget_old(now);
        let key = (
            subject.clone(),
            step.kind,
            step.reason,
            step.message.clone(),
        );
        let bucket = self.buckets.entry(subject.clone()).or_insert(Bucket {
            tokens: f64::from(BURST),
            at: now,
            dropped: 0,
            used: now,
        });
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() / REFILL.as_secs_f64();
        bucket.tokens = (bucket.tokens + refill).min(f64::from(BURST));
        bucket.at = now;
        bucket.used = now;
        if bucket.tokens < 1.0 {
            bucket.dropped += 1;
            return Decision::Drop;
        }
        bucket.tokens -= 1.0;
        if let Some(p) = self.posted.get_mut(&key) {
            if now.saturating_duration_since(p.at) < AGGREGATE_WINDOW {
                p.count = p.count.saturating_add(1);
                p.at = now;
                return Decision::Aggregate {
                    name: p.name.clone(),
                    count: p.count,
                };
            }
        }
        Decision::Create {
            dropped: std::mem::take(&mut bucket.dropped),
        }
    }

    /// Records that the Event `name` was created for `step` on `subject`.
    pub fn created(&mut self, subject: &Subject, step: &Step, name: String, now: Instant) {
        let key = (
            subject.clone(),
            step.kind,
            step.reason,
            step.message.clone(),
        );
        self.posted.insert(
            key,
            Posted {
                name,
                count: 1,
                at: now,
            },
        );
    }

    /// An aggregate patch failed (the Event expired or was deleted): the next repeat creates anew.
    pub fn lost(&mut self, subject: &Subject, step: &Step) {
        let key = (
            subject.clone(),
            step.kind,
            step.reason,
            step.message.clone(),
        );
        self.posted.remove(&key);
    }

    fn forget_old(&mut self, now: Instant) {
        self.posted
            .retain(|_, p| now.saturating_duration_since(p.at) < AGGREGATE_WINDOW);
        if self.buckets.len() > MAX_TRACKED {
            // A full bucket that was not used for a while carries nothing worth keeping.
            let full_after = REFILL * BURST;
            self.buckets
                .retain(|_, b| b.dropped > 0 || now.saturating_duration_since(b.used) < full_after);
        }
        if self.buckets.len() > MAX_TRACKED {
            let mut by_age: Vec<(Instant, Subject)> = self
                .buckets
                .iter()
                .map(|(s, b)| (b.used, s.clone()))
                .collect();
            by_age.sort_by_key(|(t, _)| *t);
            for (_, s) in by_age.into_iter().take(self.buckets.len() - MAX_TRACKED) {
                self.buckets.remove(&s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pid(n: i32) -> ProcId {
        ProcId::new(n, 7)
    }

    struct NoPods;
    impl Locate for NoPods {
        fn pod_of(&self, _: ProcId) -> Option<PodUid> {
            None
        }
    }

    struct AllIn(PodUid);
    impl Locate for AllIn {
        fn pod_of(&self, _: ProcId) -> Option<PodUid> {
            Some(self.0.clone())
        }
    }

    const UID: &str = "0b8e4f4c-1f2a-4c3d-9e8f-0123456789ab";
    const A: &str = "a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f90";

    #[test]
    fn park_and_wake_are_steps_on_their_pod() {
        let cg = format!("cgroup /sys/fs/cgroup/kubepods/burstable/pod{UID}/{A}");
        let uid: PodUid = UID.parse().unwrap();
        let parked = step_of(&Event::ParkCompleted {
            target: cg.clone(),
            pids: vec![pid(1)],
            ms: 900,
        })
        .unwrap();
        assert_eq!(
            (parked.kind, parked.reason),
            (EventType::Normal, "CryoParked")
        );
        assert_eq!(
            subject_of(&parked.about, &NoPods),
            Subject::Pod(uid.clone())
        );
        let failed = step_of(&Event::WakeFailed {
            target: cg,
            error: "no GPU has room".into(),
        })
        .unwrap();
        assert_eq!(
            (failed.kind, failed.reason),
            (EventType::Warning, "CryoWakeFailed")
        );
        assert!(
            failed.message.contains("stays parked"),
            "{}",
            failed.message
        );
        assert_eq!(subject_of(&failed.about, &NoPods), Subject::Pod(uid));
        assert!(step_of(&Event::ParkStarted { target: "x".into() }).is_none());
    }

    #[test]
    fn steps_and_their_subjects() {
        let cg = format!("cgroup /sys/fs/cgroup/kubepods/burstable/pod{UID}/{A}");
        let stop = step_of(&Event::StopRequested { target: cg.clone() }).unwrap();
        assert_eq!(stop.reason, "CryoStopping");
        let uid: PodUid = UID.parse().unwrap();
        assert_eq!(subject_of(&stop.about, &NoPods), Subject::Pod(uid.clone()));
        let done = step_of(&Event::StopCompleted {
            target: cg.clone(),
            killed: vec![pid(1), pid(2)],
            ms: 1830,
            refused: vec![],
        })
        .unwrap();
        assert!(done.message.contains("2 processes"), "{}", done.message);
        assert_eq!(subject_of(&done.about, &NoPods), Subject::Pod(uid.clone()));
        let refused = step_of(&Event::StopCompleted {
            target: cg,
            killed: vec![],
            ms: 5,
            refused: vec![pid(1)],
        })
        .unwrap();
        assert_eq!(
            (refused.kind, refused.reason),
            (EventType::Warning, "CryoStopRefused")
        );
        // a pid target: looked up (the test process is alive, the locator says which pod)
        let me = std::process::id();
        let t = About::Target(format!("pids {me}"));
        assert_eq!(
            subject_of(&t, &AllIn(uid.clone())),
            Subject::Pod(uid.clone())
        );
        assert_eq!(subject_of(&t, &NoPods), Subject::Node);
        let pinned = step_of(&Event::Pinned {
            pid: pid(5),
            gpu: "GPU-x".into(),
            fds: vec![3, 4],
        })
        .unwrap();
        assert_eq!(pinned.kind, EventType::Warning);
        assert_eq!(
            subject_of(&pinned.about, &AllIn(uid.clone())),
            Subject::Pod(uid)
        );
        let q = step_of(&Event::GpuQuarantined {
            gpu: "GPU-x".into(),
            reason: "pinned".into(),
        })
        .unwrap();
        assert_eq!(subject_of(&q.about, &NoPods), Subject::Node);
        // fine-grained steps stay in the journal
        assert!(step_of(&Event::LockStarted { pid: pid(1) }).is_none());
        assert!(step_of(&Event::Checkpointed {
            pid: pid(1),
            ms: 1,
            bytes: 1
        })
        .is_none());
        assert!(step_of(&Event::Unknown).is_none());
    }

    fn step(msg: &str) -> Step {
        Step {
            kind: EventType::Warning,
            reason: "CryoPinned",
            message: msg.to_owned(),
            about: About::Node,
        }
    }

    #[test]
    fn repeats_are_aggregated_within_the_window() {
        let mut c = Correlator::new();
        let t0 = Instant::now();
        let s = step("m");
        assert_eq!(
            c.decide(&Subject::Node, &s, t0),
            Decision::Create { dropped: 0 }
        );
        c.created(&Subject::Node, &s, "node.1".into(), t0);
        assert_eq!(
            c.decide(&Subject::Node, &s, t0 + Duration::from_secs(1)),
            Decision::Aggregate {
                name: "node.1".into(),
                count: 2
            }
        );
        // another message is another Event
        assert_eq!(
            c.decide(&Subject::Node, &step("n"), t0 + Duration::from_secs(2)),
            Decision::Create { dropped: 0 }
        );
        // after the window: a new Event
        assert_eq!(
            c.decide(
                &Subject::Node,
                &s,
                t0 + AGGREGATE_WINDOW + Duration::from_secs(5)
            ),
            Decision::Create { dropped: 0 }
        );
    }

    #[test]
    fn a_flood_is_cut_to_the_burst_then_the_refill_rate() {
        let mut c = Correlator::new();
        let t0 = Instant::now();
        let mut posted = 0;
        for i in 0..10_000 {
            // all different messages: nothing to aggregate
            if c.decide(&Subject::Node, &step(&i.to_string()), t0) != Decision::Drop {
                posted += 1;
            }
        }
        assert_eq!(posted, BURST);
        // one refill later one more goes out, and says how many were dropped
        assert_eq!(
            c.decide(&Subject::Node, &step("x"), t0 + REFILL),
            Decision::Create {
                dropped: 10_000 - u64::from(BURST)
            }
        );
        assert_eq!(
            c.decide(&Subject::Node, &step("y"), t0 + REFILL),
            Decision::Drop
        );
        // another object has its own bucket
        let pod = Subject::Pod(UID.parse().unwrap());
        assert_eq!(
            c.decide(&pod, &step("z"), t0),
            Decision::Create { dropped: 0 }
        );
    }

    #[test]
    fn memory_is_bounded() {
        let mut c = Correlator::new();
        let t0 = Instant::now();
        for i in 0..(MAX_TRACKED as u64 + 100) {
            let uid = format!("{:08x}-0000-0000-0000-000000000000", i);
            c.decide(
                &Subject::Pod(uid.parse().unwrap()),
                &step("m"),
                t0 + Duration::from_millis(i),
            );
        }
        assert!(c.buckets.len() <= MAX_TRACKED + 1, "{}", c.buckets.len());
    }
}
