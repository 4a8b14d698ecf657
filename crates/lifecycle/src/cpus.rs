//! The CPU sets a dump takes from the tree it pins to one CPU, on record, and given back by
//! whoever finds that dump dead.
//!
//! # Design
//! A freeze's dump runs CRIU and the main thread of each process of the tree on one CPU
//! (`cryo_criu`'s `colocate`). Before the first process is pinned, [`Journaled`] writes
//! [`Event::CpusPinned`]: the CPU, and each process with its own CPU set; after CRIU exited the
//! dump gives the sets back and writes [`Event::CpusReturned`]. If cryo dies in between (killed,
//! OOM, a crash), CRIU gets no verdict and resumes the tree, still pinned: the record stays open,
//! and [`give_back_dead`] (run by [`crate::settle_in_flight`]: every stop, every guard start,
//! the agent's start; and by every freeze once its own dump is over: [`give_back_dead_pins`])
//! gives each process whose owner is gone its own set back, through its
//! pidfd (opened from the recorded identity: a process whose pid was reused since is never
//! touched), and only where its set is still the pin (a set changed since is someone else's:
//! Kubernetes' CPU manager, the process itself), then closes the record.
//!
//! The record is written, not synced: against cryo's death the page cache keeps it (the kernel
//! writes it out even though cryo is gone); a power cut needs no record at all, since it ends
//! every process the record names, and a record that survives one names another boot
//! ([`Event::CpusPinned`]'s `boot`): closed, nothing touched.
//!
//! # Limitations
//! Between the look at a process's set and the call that gives its own back, a change by someone
//! else is overwritten (the kernel has no compare-and-set of an affinity). Main threads only, as
//! the pinning.

use cryo_criu::PinRecord;
use cryo_journal::{Event, Journal, PinnedCpus, ProcId, Purpose, Record};
use cryo_proc::{CpuSet, ProcHandle, Unpinned};

use crate::inflight::{SettleError, Settled, Settlement};
use crate::suspend::{id, me};

/// The freeze's [`PinRecord`]: the journal, for the tree rooted at `root`.
#[derive(Debug)]
pub(crate) struct Journaled<'a> {
    journal: &'a Journal,
    root: ProcId,
    by: Option<ProcId>,
}

impl<'a> Journaled<'a> {
    /// The record of a dump of the tree rooted at `root`, by this process.
    pub(crate) fn new(journal: &'a Journal, root: &ProcHandle) -> Journaled<'a> {
        Journaled {
            journal,
            root: id(root),
            by: me(),
        }
    }
}

impl PinRecord for Journaled<'_> {
    fn pinning(&self, cpu: usize, procs: &[(&ProcHandle, CpuSet)]) -> Result<(), String> {
        let cpu = u32::try_from(cpu).map_err(|e| e.to_string())?;
        let procs = procs
            .iter()
            .map(|(h, cpus)| PinnedCpus {
                pid: id(h),
                cpus: cpu_list(cpus),
            })
            .collect();
        // Unsynced: see the module docs (cryo's death keeps it; a power cut needs none).
        self.journal
            .append_unsynced(vec![Event::CpusPinned {
                root: self.root,
                by: self.by,
                cpu,
                procs,
                boot: cryo_proc::boot_id(),
                since: cryo_proc::boot_ticks(),
            }])
            .map(|_| ())
            .map_err(|e| e.to_string())
    }

    fn given_back(&self, returned: &[&ProcHandle], left: &[&ProcHandle]) {
        let event = Event::CpusReturned {
            root: self.root,
            by: self.by,
            returned: returned.iter().map(|h| id(h)).collect(),
            left: left.iter().map(|h| id(h)).collect(),
            inherited: 0,
            recovery: false,
        };
        // Unsynced: lost, the record stays open and a later run finds every set already given
        // back (or changed since): nothing to do.
        if let Err(e) = self.journal.append_unsynced(vec![event]) {
            tracing::error!(error = %e, "cannot journal the CPU sets given back");
        }
    }
}

/// The CPU numbers of `cpus`, ascending.
fn cpu_list(cpus: &CpuSet) -> Vec<u32> {
    (0..CpuSet::count())
        .filter(|c| cpus.is_set(*c).unwrap_or(false))
        .filter_map(|c| u32::try_from(c).ok())
        .collect()
}

/// The set of `list`'s CPUs (`None`: a CPU this build cannot name, or none).
fn cpu_set(list: &[u32]) -> Option<CpuSet> {
    let mut set = CpuSet::new();
    for c in list {
        set.set(usize::try_from(*c).ok()?).ok()?;
    }
    (!list.is_empty()).then_some(set)
}

/// [`give_back_dead`] from the journal's active segment (a rotation carries every open pinning):
/// what `cryo freeze` runs once its own dump is over (after its own pins are given back, and
/// after its report's moments), so that a worker a dead earlier freeze left on one CPU gets its
/// CPU set back at the next freeze, not only at the next stop or guard start. Returns what was
/// done to each process it found.
pub fn give_back_dead_pins(journal: &Journal) -> Result<Vec<Settled>, SettleError> {
    let records = cryo_journal::read(journal.dir())?.records;
    give_back_dead(journal, &records)
}

/// Gives back the CPU sets of every dump in `records` that pinned its tree and died before it
/// gave them back (its owner gone; a live owner is still at work): each process still the one
/// recorded gets its own set back if its set is still the pin; each open record is closed with
/// [`Event::CpusReturned`] (`recovery`). Returns what was done to each process it found.
pub(crate) fn give_back_dead(
    journal: &Journal,
    records: &[Record],
) -> Result<Vec<Settled>, SettleError> {
    let mine = me();
    let boot = cryo_proc::boot_id();
    let mut out = Vec::new();
    for open in cryo_journal::open_pins(records) {
        if let Some(by) = open.by {
            if Some(by) == mine || by.is_alive_same() {
                continue;
            }
        }
        let Event::CpusPinned {
            cpu,
            procs,
            boot: pinned_boot,
            since,
            ..
        } = &open.record.event
        else {
            continue;
        };
        let (mut returned, mut left, mut inherited) = (Vec::new(), Vec::new(), 0u64);
        // Of another boot: every process it names ended with that boot.
        let this_boot = pinned_boot.is_none() || *pinned_boot == boot;
        let one = cpu_set(&[*cpu]);
        for p in procs.iter().filter(|_| this_boot) {
            // Its pid may name another process now: only the one recorded is opened.
            let Ok(h) = p.pid.open() else { continue };
            let found = format!("pinned to CPU {cpu} by a dump that did not finish");
            let done = |action| Settled {
                pid: p.pid,
                purpose: Some(Purpose::Freeze),
                found: found.clone(),
                action,
            };
            let (Some(one), Some(own)) = (one, cpu_set(&p.cpus)) else {
                left.push(p.pid);
                out.push(done(Settlement::Left {
                    why: "its CPU set names CPUs this build cannot".into(),
                }));
                continue;
            };
            match h.unpin(&one, &own) {
                Ok(Unpinned::Returned) => {
                    returned.push(p.pid);
                    out.push(done(Settlement::CpusReturned));
                }
                // Given back before its dump could journal it.
                Ok(Unpinned::Already) => returned.push(p.pid),
                Ok(Unpinned::Changed(now)) => {
                    left.push(p.pid);
                    out.push(done(Settlement::Left {
                        why: format!(
                            "its CPU set was changed since (to {}): not ours to give back",
                            fmt_cpus(&cpu_list(&now))
                        ),
                    }));
                }
                Err(e) if !h.is_alive() => {
                    tracing::debug!(pid = p.pid.pid, error = %e, "ended as its CPU set was given back");
                }
                Err(e) => {
                    left.push(p.pid);
                    out.push(done(Settlement::Left {
                        why: format!("its CPU set cannot be given back: {e}"),
                    }));
                }
            }
            // What it started since the pin (a thread, a child) took the pin from it; after
            // its own set is back, so that what it starts from now on does not.
            if let Some(since) = since {
                let n = h.unpin_inherited(&one, &own, *since);
                if n > 0 {
                    inherited += n as u64;
                    out.push(Settled {
                        pid: p.pid,
                        purpose: Some(Purpose::Freeze),
                        found: format!(
                            "{n} threads or child processes it started since inherited the pin to CPU {cpu} of a dump that did not finish"
                        ),
                        action: Settlement::CpusReturned,
                    });
                }
            }
        }
        journal.append(Event::CpusReturned {
            root: open.root,
            by: open.by,
            returned,
            left,
            inherited,
            recovery: true,
        })?;
    }
    Ok(out)
}

/// `0-3,8`.
fn fmt_cpus(list: &[u32]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < list.len() {
        let mut j = i;
        while j + 1 < list.len() && list[j + 1] == list[j] + 1 {
            j += 1;
        }
        out.push(if i == j {
            list[i].to_string()
        } else {
            format!("{}-{}", list[i], list[j])
        });
        i = j + 1;
    }
    out.join(",")
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use cryo_testkit::procs::Procs;

    fn set_of(cpus: &[u32]) -> CpuSet {
        cpu_set(cpus).unwrap()
    }

    fn pinned(journal: &Journal, p: ProcId, by: ProcId, own: &[u32], boot: Option<String>) {
        journal
            .append(Event::CpusPinned {
                root: p,
                by: Some(by),
                cpu: 0,
                procs: vec![PinnedCpus {
                    pid: p,
                    cpus: own.to_vec(),
                }],
                boot,
                since: None,
            })
            .unwrap();
    }

    /// Only dumps whose owner is gone are settled, only processes of this boot, and each once:
    /// a process still pinned gets its own set back, its record closed; a live owner's dump and
    /// another boot's record leave their processes as they are.
    #[test]
    fn only_a_dead_dumps_pins_of_this_boot_are_given_back_once() {
        let procs = Procs::spawn(4);
        let ids: Vec<ProcId> = procs
            .pids()
            .iter()
            .map(|p| ProcId::of(*p).unwrap())
            .collect();
        let own: Vec<u32> = cpu_list(&ProcHandle::open(ids[0].pid).unwrap().affinity().unwrap());
        assert!(own.len() > 1, "needs two CPUs or more: {own:?}");
        let one = set_of(&[0]);
        for p in &ids[..3] {
            ProcHandle::open(p.pid).unwrap().set_affinity(&one).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let mut gone = std::process::Command::new("true").spawn().unwrap();
        let dead = ProcId::of(gone.id() as i32).unwrap();
        gone.wait().unwrap();
        pinned(&journal, ids[0], dead, &own, cryo_proc::boot_id());
        // Its owner (a live process) is still at work.
        pinned(&journal, ids[1], ids[3], &own, cryo_proc::boot_id());
        pinned(&journal, ids[2], dead, &own, Some("another boot".into()));
        let records = cryo_journal::read(journal.dir()).unwrap().records;
        let settled = give_back_dead(&journal, &records).unwrap();
        assert_eq!(
            settled
                .iter()
                .map(|s| (s.pid, s.action.clone()))
                .collect::<Vec<_>>(),
            vec![(ids[0], Settlement::CpusReturned)]
        );
        let cpus = |i: usize| cpu_list(&ProcHandle::open(ids[i].pid).unwrap().affinity().unwrap());
        assert_eq!(cpus(0), own);
        assert_eq!(cpus(1), vec![0], "a live owner's pin was taken");
        assert_eq!(cpus(2), vec![0], "another boot's record touched a process");
        let records = cryo_journal::read(journal.dir()).unwrap().records;
        let open: Vec<ProcId> = cryo_journal::open_pins(&records)
            .iter()
            .map(|o| o.root)
            .collect();
        assert_eq!(open, vec![ids[1]], "the settled records are closed");
        assert!(give_back_dead(&journal, &records).unwrap().is_empty());
    }

    #[test]
    fn cpu_lists_print_as_ranges() {
        assert_eq!(fmt_cpus(&[0, 1, 2, 3, 8, 10, 11]), "0-3,8,10-11");
        assert_eq!(fmt_cpus(&[5]), "5");
        assert_eq!(fmt_cpus(&[]), "");
        let set = cpu_set(&[0, 2]).unwrap();
        assert_eq!(cpu_list(&set), vec![0, 2]);
        assert!(cpu_set(&[]).is_none());
    }
}
