#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Dump and restore with the real CRIU (root, CRIU >= 4.2 from scripts/install-criu.sh).
//! A missing or old CRIU fails these tests; it never skips them.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use cryo_criu::image::{verify, Image, ImageMeta, ProcessEntry, Staging};
use cryo_criu::{Criu, CriuError, CriuOp, CriuRpc, CriuVersion, DumpOpts, RestoreOpts};
use cryo_testkit::image::plain_meta;
use cryo_testkit::{eventually, PATIENCE};
use nix::sys::signal::{kill, killpg, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::Pid as NixPid;

/// CRIU tests run one at a time: each restore needs its image's pids free.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn criu() -> CriuRpc {
    assert!(
        nix::unistd::geteuid().is_root(),
        "these tests drive CRIU and must run as root"
    );
    CriuRpc::locate(None)
        .unwrap_or_else(|e| panic!("{e} (CRIU >= 4.2 is required for these tests)"))
}

/// A shell that counts in memory and writes the count to `out` on SIGUSR1, in its own session
/// with no terminal (so CRIU dumps it without `shell_job`).
fn spawn_counter(dir: &Path) -> std::process::Child {
    let out = dir.join("count");
    let mut cmd = Command::new("bash");
    cmd.arg("-c")
        // Waits on a FIFO rather than forking `sleep`, so the tree's pids stay put (a restore
        // needs every pid of the image free); `sleep` in the background makes it a tree.
        .arg(concat!(
            r#"mkfifo "$OUT.fifo"; exec 9<>"$OUT.fifo"; sleep 100000 & i=0; "#,
            r#"trap 'echo $i > "$OUT.new"; mv "$OUT.new" "$OUT"' USR1; : > "$OUT.ready"; "#,
            r#"while :; do i=$((i+1)); read -t 0.02 -u 9 x; done"#
        ))
        .env("OUT", &out)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    // What a test runner left open (a landing script's flock) must not be dumped with it.
    cryo_testkit::fds::close_inherited(&mut cmd, None);
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
    }
    let child = cmd.spawn().unwrap();
    // SIGUSR1 before the trap is set would kill the shell.
    let ready = dir.join("count.ready");
    eventually(PATIENCE, "the counter to get ready", || ready.exists());
    child
}

/// A counter ([`spawn_counter`]) in a fresh directory, to dump: SIGKILLed with its process
/// group and reaped when dropped, unless a test reaped it already.
struct Counter {
    child: std::process::Child,
    pid: i32,
    dir: tempfile::TempDir,
}

impl Counter {
    /// Starts one and waits until it has counted at least once.
    fn start() -> Counter {
        let dir = tempfile::tempdir().unwrap();
        let child = spawn_counter(dir.path());
        let pid = child.id() as i32;
        let c = Counter { child, pid, dir };
        c.count_at_least(1);
        c
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// Its count, once at least `min`.
    fn count_at_least(&self, min: u64) -> u64 {
        count_at_least(self.pid, self.dir.path(), min)
    }

    /// Whether it runs on (not dumped and killed).
    fn runs(&mut self) -> bool {
        self.child.try_wait().unwrap().is_none()
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = killpg(NixPid::from_raw(self.pid), Signal::SIGKILL);
            let _ = self.child.wait();
        }
    }
}

/// Asks the counter for its count until it is at least `min`.
fn count_at_least(pid: i32, dir: &Path, min: u64) -> u64 {
    let out = dir.join("count");
    eventually(PATIENCE, &format!("counter {pid} to reach {min}"), || {
        let _ = fs::remove_file(&out);
        kill(NixPid::from_raw(pid), Signal::SIGUSR1).unwrap();
        // The answer to this request: the trap writes the file and renames it into place.
        let n: u64 = eventually(PATIENCE, "the counter's answer", || {
            fs::read_to_string(&out).ok()
        })
        .trim()
        .parse()
        .unwrap();
        // The trap forks `mv` to publish the answer: it is over once bash has only its sleep.
        eventually(PATIENCE, "the trap's mv to end", || {
            tree_pids(pid).len() == 2
        });
        (n >= min).then_some(n)
    })
}

/// `pid` and its descendants.
fn tree_pids(pid: i32) -> Vec<i32> {
    cryo_proc::tree(pid).unwrap_or_else(|_| vec![pid])
}

/// The killed tree's other members are reaped by init, at its own pace.
fn wait_pids_free(pids: &[i32]) {
    eventually(PATIENCE, &format!("pids {pids:?} to be free"), || {
        cryo_proc::pids_in_use(pids).is_empty()
    });
}

fn entries(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    v.sort();
    v
}

#[test]
fn dump_publish_verify_restore_keeps_pid_and_memory() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let t = tempfile::tempdir().unwrap();
    let mut child = spawn_counter(t.path());
    let pid = child.id() as i32;
    let before = count_at_least(pid, t.path(), 20);

    // The trap that reported the count forks `mv`: wait until it is gone.
    let tree = eventually(PATIENCE, "bash and its sleep alone in the tree", || {
        let tree = tree_pids(pid);
        (tree.len() == 2).then_some(tree)
    });
    let entries_before: Vec<ProcessEntry> = tree
        .iter()
        .map(|p| ProcessEntry::of(&cryo_proc::ProcHandle::open(*p).unwrap()).unwrap())
        .collect();
    assert_eq!(entries_before[0].comm, "bash");
    assert_eq!(entries_before[0].ppid, std::process::id() as i32);
    assert_eq!(entries_before[1].cmdline, vec!["sleep", "100000"]);

    let dir = t.path().join("image");
    let staging = Staging::create(&dir).unwrap();
    // CRIU writes the files, cryo hashes behind it.
    criu.dump_staged(pid, &staging, &DumpOpts::default(), &|| Ok(()))
        .unwrap();
    // CRIU killed the tree; reap our child so its pid is free for the restore.
    let status = child.wait().unwrap();
    assert!(
        !status.success(),
        "dumped tree should be killed, got {status}"
    );
    wait_pids_free(&tree);
    assert!(staging.path().join("dump.log").exists());

    let manifest = staging
        .publish(
            ImageMeta {
                root_pid: pid,
                processes: entries_before,
                zombies: Vec::new(),
                threads: Vec::new(),
                gpu_model: None,
                driver_version: None,
                criu_version: criu.version(),
                shrunk: None,
            },
            false,
        )
        .unwrap();
    assert!(manifest.files.iter().any(|f| f.name.starts_with("pages-")));
    verify(&dir).unwrap();
    let listing = entries(&dir);

    let image = Image::open(&dir).unwrap();
    let restored = criu.restore(&image, &RestoreOpts::default()).unwrap();
    assert!(restored.served_bytes > 0);
    let restored = restored.pid;
    assert_eq!(
        restored, pid,
        "CRIU restores the root with its original pid"
    );
    // The counter continues from its dumped memory, not from zero.
    let after = count_at_least(pid, t.path(), 0);
    assert!(
        after >= before,
        "count went from {before} to {after}: memory not restored"
    );

    let tree = cryo_proc::tree(pid).unwrap();
    assert_eq!(tree.len(), 2, "the restored tree, root first: {tree:?}");

    // The restore wrote nothing into the image: it still verifies, file for file.
    assert_eq!(entries(&dir), listing);
    verify(&dir).unwrap();

    // rst_sibling: the restored root is our child, so we can reap it.
    killpg(NixPid::from_raw(pid), Signal::SIGKILL).unwrap();
    match waitpid(NixPid::from_raw(pid), None).unwrap() {
        WaitStatus::Signaled(p, Signal::SIGKILL, _) => assert_eq!(p.as_raw(), pid),
        other => panic!("unexpected wait status {other:?}"),
    }
}

/// A dump onto a file system too small for its image fails, says why, and leaves the tree
/// running. Why is the kernel's word (the file system is full), not CRIU's error line: CRIU's
/// log is in the same directory and, at its dump level, holds a line per host mount before
/// any error, so on a host with many mounts the log fills the small disk first and takes no
/// error line (session 13: with 700 extra mounts on the host, the error carried only CRIU's
/// mount lines and this test failed; before, it depended on CRIU's log fitting in 64 KiB).
#[test]
fn a_dump_that_cannot_be_written_leaves_the_tree_running() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let mut counter = Counter::start();
    let before = counter.count_at_least(1);
    // A disk too small for the image: the capture's writes fail with ENOSPC mid-dump.
    let small = counter.path().join("small");
    fs::create_dir(&small).unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs"])
        .arg(&small)
        .status()
        .unwrap();
    assert!(mounted.success(), "mount tmpfs: {mounted}");
    let staging = Staging::create(&small.join("image")).unwrap();
    let err = criu
        .dump_staged(counter.pid, &staging, &DumpOpts::default(), &|| Ok(()))
        .unwrap_err();
    drop(staging);
    // The staging's follower (a thread at idle priority, told to stop, not joined) may hold a
    // file of the dump open a while longer on a loaded host: umount succeeds once it let go.
    eventually(PATIENCE, "the small tmpfs to be unmounted", || {
        Command::new("umount")
            .arg(&small)
            .stderr(Stdio::null())
            .status()
            .unwrap()
            .success()
    });
    assert!(
        err.to_string()
            .contains("the image's file system is full (")
            && err.to_string().contains("No space left on device"),
        "not said why: {err}"
    );
    // CRIU resumed the tree instead of killing it: it still counts on.
    assert!(counter.runs(), "the tree died: {err}");
    counter.count_at_least(before + 1);
}

/// The caller's gate runs while CRIU holds the tree frozen, every image written (the tree's
/// process is there, stopped), and its refusal makes CRIU resume the tree instead of killing
/// it, for both dump routes (CRIU's files and the stream).
#[test]
fn a_dump_refused_at_the_caller_s_gate_resumes_the_tree() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    for streamed in [false, true] {
        let mut counter = Counter::start();
        let before = counter.count_at_least(1);
        let staging = Staging::create(&counter.path().join("image")).unwrap();
        let pid = counter.pid;
        let seen = std::sync::Mutex::new(None);
        let at_gate = || {
            *seen.lock().unwrap() = cryo_proc::stat(pid).ok().map(|s| s.state);
            Err("the tree changed".to_string())
        };
        let err = if streamed {
            criu.dump_streamed(pid, &staging, &DumpOpts::default(), &at_gate)
        } else {
            criu.dump_staged(pid, &staging, &DumpOpts::default(), &at_gate)
        }
        .unwrap_err();
        assert!(
            matches!(&err, CriuError::DumpGate(m) if m == "the tree changed"),
            "{err}"
        );
        let state = seen.lock().unwrap().take();
        assert!(
            matches!(state, Some('t' | 'T')),
            "the tree was not held stopped at the gate: {state:?}"
        );
        assert!(counter.runs(), "the tree died: {err}");
        counter.count_at_least(before + 1);
    }
}

/// CRIU and the processes it dumps hand every chunk of pages to each other: for the dump they
/// share one CPU (the tree's main threads are pinned to it before CRIU starts, CRIU when it is
/// spawned), and a tree CRIU resumed (here refused at the gate) gets its CPU sets back, its
/// child's too. Before the pinning, CRIU and its parasite ran wherever the scheduler put them
/// (on two CPUs: 1226 against 736 ms for a 1 GiB page loop, see `colocate`).
#[test]
fn a_dump_runs_criu_and_the_tree_on_one_cpu_and_a_resumed_tree_gets_its_cpus_back() {
    use nix::sched::{sched_getaffinity, sched_setaffinity, CpuSet};
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let all = sched_getaffinity(NixPid::from_raw(0)).unwrap();
    let cpus: Vec<usize> = (0..CpuSet::count())
        .filter(|c| all.is_set(*c).unwrap())
        .collect();
    assert!(cpus.len() >= 2, "this attack needs two CPUs: {cpus:?}");
    let mut counter = Counter::start();
    let pid = counter.pid;
    let child = tree_pids(pid).into_iter().find(|p| *p != pid).unwrap();
    // Sets of their own (as a worker bound to its NUMA node has): two CPUs, then all of them.
    let mut two = CpuSet::new();
    for c in &cpus[..2] {
        two.set(*c).unwrap();
    }
    sched_setaffinity(NixPid::from_raw(pid), &two).unwrap();
    sched_setaffinity(NixPid::from_raw(child), &all).unwrap();
    let criu_pid = |root: i32| -> Option<i32> {
        // CRIU is this test process's child, its command line naming the dumped root.
        let me = std::process::id();
        std::fs::read_dir("/proc").unwrap().flatten().find_map(|e| {
            let p: i32 = e.file_name().to_str()?.parse().ok()?;
            let s = cryo_proc::stat(p).ok()?;
            let cmd = std::fs::read(format!("/proc/{p}/cmdline")).ok()?;
            let cmd = String::from_utf8_lossy(&cmd).replace('\0', " ");
            (s.ppid == me as i32 && cmd.contains(&format!("dump -t {root} "))).then_some(p)
        })
    };
    let seen = std::sync::Mutex::new(None);
    let at_gate = || {
        let one = |p: i32| {
            let set = sched_getaffinity(NixPid::from_raw(p)).unwrap();
            (0..CpuSet::count())
                .filter(|c| set.is_set(*c).unwrap())
                .collect::<Vec<_>>()
        };
        let c = criu_pid(pid).map(one);
        *seen.lock().unwrap() = Some((one(pid), one(child), c));
        Err("refused to resume the tree".to_string())
    };
    let staging = Staging::create(&counter.path().join("image")).unwrap();
    let err = criu
        .dump_staged(pid, &staging, &DumpOpts::default(), &at_gate)
        .unwrap_err();
    assert!(matches!(&err, CriuError::DumpGate(_)), "{err}");
    let (root_at_gate, child_at_gate, criu_at_gate) = seen.lock().unwrap().take().unwrap();
    assert_eq!(
        root_at_gate.len(),
        1,
        "the root at the gate: {root_at_gate:?}"
    );
    assert_eq!(child_at_gate, root_at_gate, "the child at the gate");
    assert_eq!(criu_at_gate, Some(root_at_gate.clone()), "CRIU at the gate");
    assert!(counter.runs(), "the tree died: {err}");
    assert_eq!(sched_getaffinity(NixPid::from_raw(pid)).unwrap(), two);
    assert_eq!(sched_getaffinity(NixPid::from_raw(child)).unwrap(), all);
}

/// A dump's CRIU run directory (its gate, its plugin-less plugin directory) is removed once
/// publish has fsync'd the image, not between CRIU's exit and the worker gone, where removing
/// it waited on the file system's journal, itself waiting for the image's writeback; and it is
/// removed all the same when the staging directory goes unpublished (a freeze that failed).
#[test]
fn a_dump_s_criu_directory_goes_after_publish_or_with_the_unpublished_staging() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let scratch = tempfile::tempdir().unwrap();
    let criu = criu().in_scratch(scratch.path());
    let runs = || -> Vec<String> {
        entries(scratch.path())
            .into_iter()
            .filter(|n| n.contains("cryo-criu-dump-"))
            .collect()
    };
    for publish in [true, false] {
        let mut counter = Counter::start();
        let dir = counter.path().join("image");
        let staging = Staging::create(&dir).unwrap();
        criu.dump_staged(counter.pid, &staging, &DumpOpts::default(), &|| Ok(()))
            .unwrap();
        assert!(
            !counter.child.wait().unwrap().success(),
            "the dumped tree is killed"
        );
        assert_eq!(
            runs().len(),
            1,
            "CRIU's run directory outlives the worker until publish"
        );
        if publish {
            let meta = plain_meta(counter.pid, criu.version());
            staging.publish(meta, false).unwrap();
            verify(&dir).unwrap();
        } else {
            drop(staging);
            assert!(!dir.exists(), "nothing published");
        }
        assert_eq!(runs(), Vec::<String>::new(), "published: {publish}");
    }
}

/// The streamed route (`CRYO_DUMP_STREAM=1`, kept to measure against) still dumps a tree that
/// publishes and verifies.
#[test]
fn a_streamed_dump_publishes_and_verifies() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let mut counter = Counter::start();
    let dir = counter.path().join("image");
    let staging = Staging::create(&dir).unwrap();
    criu.dump_streamed(counter.pid, &staging, &DumpOpts::default(), &|| Ok(()))
        .unwrap();
    assert!(
        !counter.child.wait().unwrap().success(),
        "the dumped tree is killed"
    );
    let meta = plain_meta(counter.pid, criu.version());
    let manifest = staging.publish(meta, false).unwrap();
    assert!(manifest.files.iter().any(|f| f.name.starts_with("pages-")));
    verify(&dir).unwrap();
}

/// Issue 16: CRIU writes the dump into the staging directory itself, while cryo hashes behind
/// it. Nobody but root can write there (0700, root's: a writer of another uid is refused), and
/// what root planted there (a link, here one that was there all along) is refused at CRIU's
/// `post-dump` gate: CRIU resumes the tree instead of killing it, and nothing is published.
#[test]
fn a_link_in_the_staging_directory_refuses_the_dump_and_the_tree_runs_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let mut counter = Counter::start();
    let before = counter.count_at_least(1);
    let staging = Staging::create(&counter.path().join("image")).unwrap();
    let mode = fs::metadata(staging.path()).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o700, "the staging directory is root's alone");
    let foreign = Command::new("sh")
        .arg("-c")
        .arg(r#"echo evil > "$1/pages-1.img""#)
        .arg("sh")
        .arg(staging.path())
        .uid(65534)
        .gid(65534)
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(
        !foreign.success(),
        "another uid wrote into the staging directory"
    );
    std::os::unix::fs::symlink("/etc/hostname", staging.path().join("evil.img")).unwrap();
    let err = criu
        .dump_staged(counter.pid, &staging, &DumpOpts::default(), &|| Ok(()))
        .unwrap_err();
    assert!(err.to_string().contains("evil.img"), "{err}");
    assert!(counter.runs(), "the tree died: {err}");
    counter.count_at_least(before + 1);
    assert!(!counter.path().join("image").exists());
}

#[test]
fn leave_running_dump_keeps_the_tree() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let mut counter = Counter::start();
    let images = counter.path().join("img");
    fs::create_dir(&images).unwrap();
    let opts = DumpOpts {
        leave_running: true,
        ..DumpOpts::default()
    };
    criu.dump(counter.pid, &images, &opts).unwrap();
    let n = counter.count_at_least(0);
    counter.count_at_least(n + 1);
    assert!(counter.runs());
}

#[test]
fn failed_dump_reports_criu_error_lines() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let t = tempfile::tempdir().unwrap();
    let pid_max: i32 = fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let pid = (2..pid_max)
        .rev()
        .find(|p| !Path::new(&format!("/proc/{p}")).exists())
        .unwrap();
    let err = criu.dump(pid, t.path(), &DumpOpts::default()).unwrap_err();
    match &err {
        CriuError::Failed { op, log, lines } => {
            assert_eq!(*op, CriuOp::Dump);
            assert_eq!(log, &t.path().join("dump.log"));
            assert!(!lines.is_empty());
            assert!(lines.iter().all(|l| l.contains("Error")), "{lines:?}");
        }
        other => panic!("expected CriuError::Failed, got {other:?}"),
    }
    let msg = err.to_string();
    eprintln!("{msg}");
    assert!(msg.starts_with("criu dump failed"), "{msg}");
    assert!(msg.contains("Error ("), "{msg}");
}

#[test]
fn restore_of_a_non_image_reports_criu_error_lines() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    let t = tempfile::tempdir().unwrap();
    let work = t.path().join("work");
    let opts = RestoreOpts {
        work_dir: Some(work.clone()),
        ..RestoreOpts::default()
    };
    match criu.restore_dir(t.path(), &opts).unwrap_err() {
        CriuError::Failed { op, log, lines } => {
            assert_eq!(op, CriuOp::Restore);
            assert_eq!(log, work.join("restore.log"));
            assert!(lines.iter().any(|l| l.contains("Error (")), "{lines:?}");
        }
        other => panic!("expected CriuError::Failed, got {other:?}"),
    }
}

fn fake_criu(dir: &Path, version_line: &str) -> PathBuf {
    let p = dir.join("criu");
    fs::write(&p, format!("#!/bin/sh\necho '{version_line}'\n")).unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    p
}

#[test]
fn old_criu_is_too_old() {
    let t = tempfile::tempdir().unwrap();
    let fake = fake_criu(t.path(), "Version: 3.17");
    let err = CriuRpc::locate(Some(&fake)).unwrap_err();
    match &err {
        CriuError::TooOld {
            path,
            found,
            needed,
        } => {
            assert_eq!(path, &fake);
            assert_eq!(found.to_string(), "3.17");
            assert_eq!(*needed, CriuVersion::MIN);
        }
        other => panic!("expected TooOld, got {other:?}"),
    }
    let msg = err.to_string();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert!(msg.contains("3.17") && msg.contains(">= 4.2"), "{msg}");
}

/// 4.1 dumps processes but not their TCP sockets on Linux >= 6.16: refused too.
#[test]
fn criu_4_1_is_too_old() {
    let t = tempfile::tempdir().unwrap();
    let fake = fake_criu(t.path(), "Version: 4.1.1");
    let err = CriuRpc::locate(Some(&fake)).unwrap_err();
    assert!(matches!(err, CriuError::TooOld { .. }), "{err:?}");
}

#[test]
fn recent_fake_criu_is_accepted_and_garbage_is_not() {
    let t = tempfile::tempdir().unwrap();
    let fake = fake_criu(t.path(), "Version: 4.2");
    assert_eq!(CriuRpc::at(fake).unwrap().version().to_string(), "4.2");
    let t2 = tempfile::tempdir().unwrap();
    let junk = fake_criu(t2.path(), "hello");
    assert!(matches!(CriuRpc::at(junk), Err(CriuError::Version { .. })));
}

/// A fake CRIU that prints `version_line` and counts its runs in `runs` beside it.
fn counting_criu(dir: &Path, version_line: &str) -> PathBuf {
    let p = dir.join("criu");
    let runs = dir.join("runs");
    fs::write(
        &p,
        format!(
            "#!/bin/sh\necho x >> '{}'\necho '{version_line}'\n",
            runs.display()
        ),
    )
    .unwrap();
    fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
    p
}

fn runs(dir: &Path) -> usize {
    fs::read_to_string(dir.join("runs")).map_or(0, |s| s.lines().count())
}

/// Issue 16: `criu --version` is asked once per binary; a binary changed in place or replaced
/// by an older CRIU is asked again and refused, never answered from the cache.
#[test]
fn criu_s_version_is_cached_per_binary_and_asked_again_when_the_binary_changes() {
    let t = tempfile::tempdir().unwrap();
    let scratch = t.path().join("scratch");
    let fake = counting_criu(t.path(), "Version: 4.2");
    for _ in 0..3 {
        let c = CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
        assert_eq!(c.version().to_string(), "4.2");
    }
    assert_eq!(runs(t.path()), 1, "asked more than once");
    // Changed in place (same inode): its change time moved.
    let script = fs::read_to_string(&fake).unwrap().replace("4.2", "3.17");
    fs::write(&fake, &script).unwrap();
    let err = CriuRpc::locate_in(Some(&fake), &scratch).unwrap_err();
    assert!(matches!(err, CriuError::TooOld { .. }), "{err:?}");
    assert_eq!(runs(t.path()), 2);
    // Replaced by another file renamed over it.
    let new = t.path().join("criu.new");
    fs::write(&new, script.replace("3.17", "4.1.1")).unwrap();
    fs::set_permissions(&new, fs::Permissions::from_mode(0o755)).unwrap();
    fs::rename(&new, &fake).unwrap();
    let err = CriuRpc::locate_in(Some(&fake), &scratch).unwrap_err();
    assert!(matches!(err, CriuError::TooOld { found, .. } if found.to_string() == "4.1.1"));
    assert_eq!(runs(t.path()), 3);
}

/// A cache file anyone else could have written, or reached through a link, is not believed.
#[test]
fn a_criu_version_cache_others_can_write_or_a_link_to_one_is_ignored() {
    let t = tempfile::tempdir().unwrap();
    let scratch = t.path().join("scratch");
    let fake = counting_criu(t.path(), "Version: 4.2");
    CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
    let cache = scratch.join(cryo_criu::VERSION_CACHE);
    fs::set_permissions(&cache, fs::Permissions::from_mode(0o666)).unwrap();
    CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
    assert_eq!(runs(t.path()), 2, "a world-writable cache was believed");
    let real = t.path().join("elsewhere.json");
    fs::rename(&cache, &real).unwrap();
    fs::set_permissions(&real, fs::Permissions::from_mode(0o600)).unwrap();
    std::os::unix::fs::symlink(&real, &cache).unwrap();
    CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
    assert_eq!(
        runs(t.path()),
        3,
        "a cache reached through a link was believed"
    );
    // Without a usable cache the answer is written anew, and believed next time.
    fs::remove_file(&cache).unwrap();
    CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
    CriuRpc::locate_in(Some(&fake), &scratch).unwrap();
    assert_eq!(runs(t.path()), 4);
}

#[test]
fn missing_criu_is_not_found() {
    let p = PathBuf::from("/nonexistent/cryo-test/criu");
    let err = CriuRpc::locate(Some(&p)).unwrap_err();
    assert!(
        matches!(&err, CriuError::NotFound { tried } if tried == &vec![p.clone()]),
        "{err:?}"
    );
    let msg = err.to_string();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    assert!(msg.contains("/nonexistent/cryo-test/criu"), "{msg}");
}

#[test]
fn installed_criu_is_recent() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let criu = criu();
    assert!(criu.version() >= CriuVersion::MIN, "{}", criu.version());
}

/// Issue 16 item 3: a CRIU that logs without end (its restorer did, spinning on a `preadv` that
/// returned 0: 2.7 GB of `restore.log` in `/tmp` within minutes) no longer fills the disk: the
/// log keeps its first and last bytes and says what was cut between them, and the restore ends
/// at its deadline with the last lines in the error. (Before: CRIU wrote its log itself,
/// uncapped.)
#[test]
fn a_criu_that_logs_without_end_is_cut_to_its_cap() {
    assert!(nix::unistd::geteuid().is_root(), "trusted images need root");
    let t = tempfile::tempdir().unwrap();
    let fake = t.path().join("criu");
    // Answers `--version`; a restore logs one first line into the log it is given (`-o NAME`
    // in `-W DIR`), then the same error line without end until it is killed at its deadline.
    // CRIU itself writes (`exec`): nothing outlives its kill to write past the cap after the
    // log was finished. (A `yes | head -c 300M` pipeline did: under load its `head`, orphaned
    // by the deadline's kill, kept appending to the finished log, 721,009 bytes against the
    // cap of 128 KiB.)
    fs::write(
        &fake,
        "#!/bin/sh\ncase \"$*\" in *--version*) echo 'Version: 4.2'; exit 0;; esac\n\
         while [ $# -gt 0 ]; do case \"$1\" in -W) w=$2;; -o) o=$2;; esac; shift; done\n\
         echo '(00.000001) the first line' >>\"$w/$o\"\n\
         exec yes '(00.000002) pie: 1: Error (criu/pie/restorer.c:1): preadv returned 0' \
         >>\"$w/$o\"\n",
    )
    .unwrap();
    let scratch = t.path().join("scratch");
    let err = restore_past_a_2s_deadline(&fake, t.path(), &scratch);
    let CriuError::TimedOut { log, lines, .. } = &err else {
        panic!("expected the deadline, got {err}");
    };
    assert!(log.starts_with(&scratch), "{}", log.display());
    assert_capped_to_128k(log);
    assert!(
        lines.iter().any(|l| l.ends_with("preadv returned 0")),
        "{lines:?}"
    );
}

/// Attack (session 13): a restore past its deadline whose restored task still logs (CRIU's
/// restorer writes the log from inside the restored processes). CRIU is killed at the deadline,
/// and what it restored is ended too; the log must be cut once nothing writes it any more.
/// The fake CRIU (perl) forks its "restored task" as its caller's child
/// (`clone(CLONE_PARENT)`, as `--restore-sibling` does), which writes the log without end,
/// and waits. (Before: the log was cut when CRIU died, and the task, killed only after,
/// appended uncut bytes past the cap.)
#[test]
fn a_restored_task_that_logs_past_the_deadline_is_ended_before_the_log_is_cut() {
    assert!(nix::unistd::geteuid().is_root(), "trusted images need root");
    let t = tempfile::tempdir().unwrap();
    let fake = t.path().join("criu");
    fs::write(
        &fake,
        concat!(
            "#!/usr/bin/perl\n",
            "if (\"@ARGV\" =~ /--version/) { print \"Version: 4.2\\n\"; exit 0 }\n",
            "my ($w, $o);\n",
            "for my $i (0 .. $#ARGV) { $w = $ARGV[$i + 1] if $ARGV[$i] eq '-W'; ",
            "$o = $ARGV[$i + 1] if $ARGV[$i] eq '-o' }\n",
            "open(my $log, '>>', \"$w/$o\") or die \"$w/$o: $!\";\n",
            "$log->autoflush(1);\n",
            "print $log \"(00.000001) the first line\\n\";\n",
            // x86_64 clone(CLONE_PARENT | SIGCHLD): a sibling of CRIU, its caller's child.
            "my $pid = syscall(56, 0x8000 | 17, 0, 0, 0, 0);\n",
            "die \"clone: $!\" if $pid < 0;\n",
            "if ($pid == 0) { while (1) { print $log ",
            "\"(00.000002) pie: 1: Error (criu/pie/restorer.c:1): preadv returned 0\\n\" } }\n",
            "sleep 1000;\n",
        ),
    )
    .unwrap();
    let scratch = t.path().join("scratch");
    let err = restore_past_a_2s_deadline(&fake, t.path(), &scratch);
    let CriuError::TimedOut { log, killed, .. } = &err else {
        panic!("expected the deadline, got {err}");
    };
    assert_eq!(killed.len(), 1, "the restored task was not ended: {err}");
    let task = killed[0].0;
    assert!(
        !Path::new(&format!("/proc/{task}")).exists(),
        "the restored task {task} is still there: {err}"
    );
    let text = fs::read(log).unwrap();
    let at = text
        .windows(10)
        .position(|w| w == b"cut here: ")
        .expect("no cut line");
    assert!(
        text.len() <= (128 << 10) + 200,
        "{}: {} bytes, {} after the cut line",
        log.display(),
        text.len(),
        text.len() - at
    );
}

/// Attack (session 21): the image changes under a restore that never reaches its gate, with
/// a check that passes (the bytes stay the same: only a file's times change, which the watch
/// sees and the hashes cannot). The fake CRIU changes the pages file's times through the
/// directory it was given, then waits (see [`restore_before_a_gate_never_reached`]). The change
/// is the verdict's refusal whenever it comes: the restore must end CRIU and its task at once
/// and return the change, never wait for the deadline. (Before: the restore waited for its
/// 30 s deadline and failed with CRIU's timeout.)
#[test]
fn a_change_to_the_image_under_a_restore_before_its_gate_ends_the_restore_at_once() {
    let err = restore_before_a_gate_never_reached(true, |_| {});
    assert!(
        matches!(&err, CriuError::Image(cryo_criu::image::ImageError::Changed { what, .. }) if what.contains("pages-1.img")),
        "{err:?}"
    );
}

/// Attack (session 21): the check's hashes refuse a page while CRIU has not reached its gate
/// (a byte of the pages file flipped in place after the image was opened and before the
/// restore set its watch: only the hashes see it), CRIU never reaching it (see
/// [`restore_before_a_gate_never_reached`]). The restore must end CRIU and its task at the
/// check's refusal and return it, never wait for the deadline. (Before: the restore waited
/// for its 30 s deadline and failed with CRIU's timeout.)
#[test]
fn a_page_the_check_refuses_before_criu_s_gate_ends_the_restore_at_once() {
    let err = restore_before_a_gate_never_reached(false, |dir| {
        let pages = dir.join("pages-1.img");
        let mut bytes = fs::read(&pages).unwrap();
        bytes[50_000] ^= 1;
        fs::write(&pages, bytes).unwrap();
    });
    assert!(err.to_string().contains("checksum mismatch"), "{err:?}");
}

/// Attack (session 21): the image changes once the gate's verdict passed, while CRIU still
/// runs (it resumes the tree). The kill at a refusal must never follow a verdict that passed:
/// the tree runs, so the restore returns it, and its task is never ended for a change that
/// came after its check. The fake CRIU passes cryo's gate (runs its action script at
/// `post-restore` with its task as the root, as CRIU does), names the root in its pidfile,
/// then changes the pages file's times and exits after a while.
#[test]
fn a_change_after_the_gate_passed_never_ends_the_restored_tree() {
    let t = tempfile::tempdir().unwrap();
    let (criu, image, task) = fake_restore(
        t.path(),
        concat!(
            "$ENV{CRTOOLS_SCRIPT_ACTION} = 'post-restore'; $ENV{CRTOOLS_INIT_PID} = $pid;\n",
            "system('/bin/sh', '-c', $script) == 0 or exit 1;\n",
            "open(my $p, '>', \"$w/restored.pid\") or die; print $p \"$pid\\n\"; close $p;\n",
            "utime(1, 1, \"$d/pages-1.img\") or die \"utime: $!\";\n",
            "select(undef, undef, undef, 0.5);\n",
        ),
    );
    let restored = criu.restore(
        &image,
        &RestoreOpts {
            deadline: Some(std::time::Duration::from_secs(30)),
            ..RestoreOpts::default()
        },
    );
    let task = Task(task());
    let restored =
        restored.unwrap_or_else(|e| panic!("the tree that passed the gate was not returned: {e}"));
    assert_eq!(restored.pid, task.0, "the root CRIU named");
    assert!(
        Path::new(&format!("/proc/{}", task.0)).exists(),
        "the restored task was ended"
    );
}

/// Attack (session 21): a CRIU that resumed the tree (its `post-resume` stage, every task
/// detached: CRIU 4.2 ends nothing of the tree past it) and then does not exit (a cleanup that
/// hangs; here it sleeps). The restore must return the tree that runs (a grace of a second
/// past `post-resume`, `RESUMED_EXIT_GRACE`), leave CRIU to exit when it does, and never end
/// the tree at CRIU's deadline. (Before: the restore waited for its 10 s deadline, killed CRIU and
/// then the tree that had passed the gate and run: "criu restore did not finish within 10 s
/// and was killed with what it had restored".)
#[test]
fn a_criu_that_does_not_exit_after_resuming_the_tree_holds_nothing_and_ends_nothing() {
    let t = tempfile::tempdir().unwrap();
    let criu_pid = t.path().join("criu.pid");
    let (criu, image, task) = fake_restore(
        t.path(),
        &format!(
            "open(my $c, '>', '{}') or die; print $c \"$$\\n\"; close $c;\n{}sleep 1000;\n",
            criu_pid.display(),
            PASS_THE_GATE_AND_RESUME,
        ),
    );
    let restored = restore_at_10s(&criu, &image);
    let task = Task(task());
    // Our child, not reaped while it runs (the restore's waiter holds it): its pid is its own.
    let criu_pid: i32 = fs::read_to_string(&criu_pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let _criu = Task(criu_pid);
    let restored = restored.unwrap_or_else(|e| panic!("the resumed tree was not returned: {e}"));
    assert_eq!(restored.pid, task.0);
    assert!(
        Path::new(&format!("/proc/{}", task.0)).exists(),
        "the resumed task was ended"
    );
    assert!(
        Path::new(&format!("/proc/{criu_pid}")).exists(),
        "CRIU ended: the test shows nothing"
    );
}

/// Attack (session 21): a CRIU that resumed the tree (`post-resume`) and then exits with an
/// error (its status there says nothing of the tree, which runs detached). The restore must
/// return the tree, never fail with it left running and owned by nobody. (Before: "criu
/// restore failed", the task left running.)
#[test]
fn a_criu_that_fails_after_resuming_the_tree_still_hands_it_over() {
    let t = tempfile::tempdir().unwrap();
    let (criu, image, task) =
        fake_restore(t.path(), &format!("{PASS_THE_GATE_AND_RESUME}exit 3;\n"));
    let restored = restore_at_10s(&criu, &image);
    let task = Task(task());
    let restored = restored.unwrap_or_else(|e| panic!("the resumed tree was not returned: {e}"));
    assert_eq!(restored.pid, task.0);
    assert!(
        Path::new(&format!("/proc/{}", task.0)).exists(),
        "the resumed task was ended"
    );
}

/// Attack (session 23): a CRIU that resumed its tree (`post-resume`) and then logs without end
/// (a cleanup that loops) until it is let go, waited for in the background past the restore's
/// return (`Resumed::finish_later`), and reaped by another waiter of this process (an agent's
/// reaper of its ended children) racing that background wait. Pinned, nothing broke: the
/// log past `post-resume` is cut to its cap like the rest (its keeper runs until CRIU is
/// waited for, then finishes it), and the background wait ends whoever reaps CRIU (a wait that
/// finds CRIU reaped returns `ECHILD` once: no spin, no thread left), its place in the budget
/// of CRIUs waited for given back.
#[test]
fn a_criu_that_logs_after_resuming_is_cut_to_its_cap_and_its_wait_ends_whoever_reaps_it() {
    let t = tempfile::tempdir().unwrap();
    let criu_pid = t.path().join("criu.pid");
    let go = t.path().join("go");
    let (criu, image, task) = fake_restore(
        t.path(),
        &format!(
            concat!(
                "open(my $c, '>', '{pid}') or die; print $c \"$$\\n\"; close $c;\n{pass}",
                "open(my $l, '>>', \"$w/restore.log\") or die;\n",
                "while (! -e '{go}') {{ print $l \"(00.000003) Error (criu/cr-restore.c:1): ",
                "cleaning up\\n\" }}\n",
            ),
            pid = criu_pid.display(),
            pass = PASS_THE_GATE_AND_RESUME,
            go = go.display(),
        ),
    );
    let criu = criu.with_log_cap(cryo_criu::LogCap {
        head: 64 << 10,
        tail: 64 << 10,
    });
    let work = t.path().join("work");
    let restored = criu.restore(
        &image,
        &RestoreOpts {
            deadline: Some(std::time::Duration::from_secs(10)),
            work_dir: Some(work.clone()),
            ..RestoreOpts::default()
        },
    );
    let task = Task(task());
    let restored = restored.unwrap_or_else(|e| panic!("the resumed tree was not returned: {e}"));
    assert_eq!(restored.pid, task.0);
    let criu_pid: i32 = fs::read_to_string(&criu_pid)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        cryo_criu::stuck_crius(),
        1,
        "CRIU is waited for in the background"
    );
    // Another waiter of this process, blocked for CRIU's end before it comes.
    let other = std::thread::spawn(move || waitpid(NixPid::from_raw(criu_pid), None));
    fs::write(&go, b"").unwrap();
    let reaped = other.join().unwrap();
    assert!(
        matches!(
            reaped,
            Ok(WaitStatus::Exited(_, 0)) | Err(nix::errno::Errno::ECHILD)
        ),
        "{reaped:?}"
    );
    eventually(PATIENCE, "the background wait to end", || {
        cryo_criu::stuck_crius() == 0
    });
    assert!(!Path::new(&format!("/proc/{criu_pid}")).exists());
    let text = within_128k(&work.join(cryo_criu::RESTORE_LOG));
    assert!(
        text.contains("cleaning up"),
        "{}",
        &text[text.len() - 200..]
    );
}

/// The fake CRIU's steps (perl, see [`fake_restore`]) through cryo's gate as CRIU 4.2 takes
/// them: its action script at `post-restore` (which must pass), the pidfile, then the script at
/// `post-resume` (its status ignored).
const PASS_THE_GATE_AND_RESUME: &str = concat!(
    "$ENV{CRTOOLS_SCRIPT_ACTION} = 'post-restore'; $ENV{CRTOOLS_INIT_PID} = $pid;\n",
    "system('/bin/sh', '-c', $script) == 0 or exit 1;\n",
    "open(my $p, '>', \"$w/restored.pid\") or die; print $p \"$pid\\n\"; close $p;\n",
    "$ENV{CRTOOLS_SCRIPT_ACTION} = 'post-resume';\n",
    "system('/bin/sh', '-c', $script);\n",
);

/// `criu.restore(image)` at a 10 s deadline.
fn restore_at_10s(criu: &CriuRpc, image: &Image) -> Result<cryo_criu::Restored, CriuError> {
    criu.restore(
        image,
        &RestoreOpts {
            deadline: Some(std::time::Duration::from_secs(10)),
            ..RestoreOpts::default()
        },
    )
}

/// A fake CRIU's restored task (our child, not reaped by the restore: it passed the gate),
/// killed and reaped when dropped.
struct Task(i32);

impl Drop for Task {
    fn drop(&mut self) {
        let pid = NixPid::from_raw(self.0);
        if kill(pid, Signal::SIGKILL).is_ok() {
            let _ = waitpid(pid, None);
        }
    }
}

/// Restores a tiny image (published under a temporary directory, then given to `damage` once
/// opened) with a fake CRIU that never reaches its gate, at a 30 s deadline: it forks its
/// "restored task" as its caller's child (as `--restore-sibling` does), which waits where a
/// restorer reading a truncated pages file loops; with `touch`, CRIU changes the pages file's
/// times through the directory it was given; then it waits. The restore must return the
/// image's refusal before the deadline, naming the image, with CRIU and its task ended: its
/// error.
fn restore_before_a_gate_never_reached(touch: bool, damage: impl FnOnce(&Path)) -> CriuError {
    let t = tempfile::tempdir().unwrap();
    let then = if touch {
        "utime(1, 1, \"$d/pages-1.img\") or die \"utime: $!\";\nsleep 1000;\n"
    } else {
        "sleep 1000;\n"
    };
    let (criu, image, _) = fake_restore(t.path(), then);
    damage(image.path());
    let deadline = std::time::Duration::from_secs(30);
    let started = std::time::Instant::now();
    let err = criu
        .restore(
            &image,
            &RestoreOpts {
                deadline: Some(deadline),
                ..RestoreOpts::default()
            },
        )
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        took < deadline && !matches!(err, CriuError::TimedOut { .. }),
        "waited for the deadline ({took:?}): {err}"
    );
    assert!(
        err.to_string().contains(image.path().to_str().unwrap()),
        "{err}"
    );
    // The fake, its task (forked or not yet when the refusal came) and its forks all name the
    // test's directory on their command lines. Not killed here if left: each ends by itself
    // within a minute.
    let left = cryo_proc::naming(t.path()).unwrap();
    assert!(left.is_empty(), "left: {left:?}: {err}");
    err
}

/// A tiny image published in `dir` and opened, and a fake CRIU 4.2 (perl) for it, which on a
/// restore forks its "restored task" as its caller's child (as `--restore-sibling` does: it
/// waits a minute, so that a test that fails leaves nothing for long), writes its pid into a file, and runs `then` (perl, with `$pid` the task,
/// `$d` the image directory it was given, `$w` its work directory, `$script` cryo's action
/// script), then exits 0. Returns the CRIU, the image, and what reads the task's pid.
fn fake_restore(dir: &Path, then: &str) -> (CriuRpc, Image, impl Fn() -> i32) {
    assert!(nix::unistd::geteuid().is_root(), "trusted images need root");
    let fake = dir.join("criu");
    let task = dir.join("task.pid");
    fs::write(
        &fake,
        format!(
            concat!(
                "#!/usr/bin/perl\n",
                "if (\"@ARGV\" =~ /--version/) {{ print \"Version: 4.2\\n\"; exit 0 }}\n",
                "my ($d, $w, $script);\n",
                "for my $i (0 .. $#ARGV) {{ my $v = $ARGV[$i + 1]; $d = $v if $ARGV[$i] eq '-D'; ",
                "$w = $v if $ARGV[$i] eq '-W'; $script = $v if $ARGV[$i] eq '--action-script' }}\n",
                // x86_64 clone(CLONE_PARENT | SIGCHLD): a sibling of CRIU, its caller's child.
                "my $pid = syscall(56, 0x8000 | 17, 0, 0, 0, 0);\n",
                "die \"clone: $!\" if $pid < 0;\n",
                "if ($pid == 0) {{ sleep 60; exit 0 }}\n",
                "open(my $f, '>', '{task}') or die; print $f \"$pid\\n\"; close $f;\n",
                "{then}",
                "exit 0;\n",
            ),
            task = task.display(),
            then = then,
        ),
    )
    .unwrap();
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let image = dir.join("image");
    publish_tiny(&image);
    let criu = CriuRpc::at(fake).unwrap().in_scratch(&dir.join("scratch"));
    let image = Image::open(&image).unwrap();
    let task = move || -> i32 { fs::read_to_string(&task).unwrap().trim().parse().unwrap() };
    (criu, image, task)
}

/// Publishes a tiny image of a plain process (pid 4242, CRIU 4.2) at `dir`: a pages file of
/// 100,000 bytes and a core file.
fn publish_tiny(dir: &Path) {
    let st = Staging::create(dir).unwrap();
    fs::write(st.path().join("pages-1.img"), vec![7u8; 100_000]).unwrap();
    fs::write(st.path().join("core-4242.img"), b"core").unwrap();
    st.publish(
        plain_meta(
            4242,
            CriuVersion {
                major: 4,
                minor: 2,
                sublevel: 0,
            },
        ),
        false,
    )
    .unwrap();
}

/// Makes `fake` (a fake CRIU script) executable, publishes a tiny image under `dir`, and
/// restores it with `fake` at a 2 s deadline and a 64 KiB + 64 KiB log cap, scratch files in
/// `scratch`: the restore's error (the deadline, for the callers' fakes that never end).
fn restore_past_a_2s_deadline(fake: &Path, dir: &Path, scratch: &Path) -> CriuError {
    fs::set_permissions(fake, fs::Permissions::from_mode(0o755)).unwrap();
    let dir = dir.join("image");
    publish_tiny(&dir);
    let cap = cryo_criu::LogCap {
        head: 64 << 10,
        tail: 64 << 10,
    };
    let criu = CriuRpc::at(fake.to_path_buf())
        .unwrap()
        .with_log_cap(cap)
        .in_scratch(scratch);
    let image = Image::open(&dir).unwrap();
    criu.restore(
        &image,
        &RestoreOpts {
            deadline: Some(std::time::Duration::from_secs(2)),
            ..RestoreOpts::default()
        },
    )
    .unwrap_err()
}

/// The fake CRIU's endless log, kept within a 64 KiB + 64 KiB cap: its first line, the cut
/// line, and where CRIU was when it stopped or was killed (possibly mid-line) at the end.
fn assert_capped_to_128k(log: &Path) {
    let text = within_128k(log);
    assert!(
        text.starts_with("(00.000001) the first line\n"),
        "{}",
        &text[..80]
    );
    let tail = &text[text.len() - 1000..];
    assert!(tail.contains("preadv returned 0\n"), "{tail}");
}

/// The text of CRIU's log `log`, cut to a 64 KiB + 64 KiB cap: within it, with the cut line.
fn within_128k(log: &Path) -> String {
    let text = fs::read_to_string(log).unwrap();
    assert!(
        text.len() <= (128 << 10) + 200,
        "{}: {} bytes",
        log.display(),
        text.len()
    );
    assert!(text.contains("bytes of CRIU's log cut here"), "no cut line");
    text
}

/// Issue 16: the `criu swrk` routes (`Criu::dump`, `restore_dir`) take CRIU's
/// log as a file name, and CRIU writes it itself: a CRIU that logs without end behind them no
/// longer fills the disk. The fake CRIU writes 300 MB into the log the request names, then exits
/// without answering; the log keeps its head and tail with the cut line, and its disk blocks
/// stay within the cap. (Before: the whole 300 MB stayed.)
#[test]
fn a_criu_behind_swrk_that_logs_without_end_is_cut_to_its_cap() {
    use std::os::unix::fs::MetadataExt;
    let t = tempfile::tempdir().unwrap();
    let images = t.path().join("images");
    let work = t.path().join("work");
    fs::create_dir_all(&images).unwrap();
    fs::create_dir_all(&work).unwrap();
    let fake = t.path().join("criu");
    let line = "(00.000002) pie: 1: Error (criu/pie/restorer.c:1): preadv returned 0";
    // `swrk` gets its request on a socket; the fake writes where this test's request points.
    fs::write(
        &fake,
        format!(
            "#!/bin/sh\ncase \"$*\" in *--version*) echo 'Version: 4.2'; exit 0;; esac\n\
             for log in '{d}' '{r}'; do [ -e \"$log.go\" ] || continue; rm \"$log.go\"; \
             {{ echo '(00.000001) the first line'; yes '{line}' | head -c 300000000; }} >>\"$log\"; done\n\
             exit 1\n",
            d = images.join("dump.log").display(),
            r = work.join("restore.log").display(),
        ),
    )
    .unwrap();
    fs::set_permissions(&fake, fs::Permissions::from_mode(0o755)).unwrap();
    let cap = cryo_criu::LogCap {
        head: 64 << 10,
        tail: 64 << 10,
    };
    let criu = CriuRpc::at(fake).unwrap().with_log_cap(cap);
    let check = |log: &Path| {
        let m = fs::metadata(log).unwrap();
        assert!(
            m.blocks() * 512 <= (128 << 10) + 8192,
            "{}: {} on disk",
            log.display(),
            m.blocks() * 512
        );
        assert_capped_to_128k(log);
    };

    let dump_log = images.join("dump.log");
    fs::write(t.path().join("images/dump.log.go"), b"").unwrap();
    let err = criu.dump(1, &images, &DumpOpts::default()).unwrap_err();
    assert!(matches!(err, CriuError::Rpc { .. }), "{err}");
    check(&dump_log);

    let restore_log = work.join("restore.log");
    fs::write(work.join("restore.log.go"), b"").unwrap();
    let err = criu
        .restore_dir(
            &images,
            &RestoreOpts {
                work_dir: Some(work.clone()),
                ..RestoreOpts::default()
            },
        )
        .unwrap_err();
    assert!(matches!(err, CriuError::Rpc { .. }), "{err}");
    check(&restore_log);
}

/// A `sleep 1000` in fresh pid and network namespaces (`cryo run`'s), working in `dir`;
/// SIGKILLed and reaped when dropped.
struct Isolated(i32);

impl Isolated {
    fn start(dir: &Path) -> Isolated {
        let pid = cryo_proc::isolate::spawn_isolated(
            &cryo_proc::isolate::IsolatedCommand {
                argv: vec!["sleep".into(), "1000".into()],
                dir: dir.to_path_buf(),
                log: Some(dir.join("sleep.log")),
            },
            None,
        )
        .unwrap();
        eventually(PATIENCE, "the isolated sleep to run", || {
            cryo_proc::stat(pid).is_ok_and(|s| s.comm == "sleep")
        });
        Isolated(pid)
    }
}

impl Drop for Isolated {
    fn drop(&mut self) {
        let _ = kill(NixPid::from_raw(self.0), Signal::SIGKILL);
        let _ = waitpid(NixPid::from_raw(self.0), None);
    }
}

/// Attack (session 13) on the lock of a namespaced root's working directory (6bad3fa): two
/// cryo dumps, at once, of two trees with pid namespaces of their own that work in one
/// directory (where CRIU's parasite makes its `proc.crtools`). The second waits for the first:
/// with the first held at its gate (its CRIU mid-dump), the second holds the directory's lock
/// file open, waiting, and reaches its own gate only once the first let go; both dumps
/// succeed and both images are whole (published, every file verified, each with its root's
/// core and pages). (Two CRIUs there at once collide: "Can't create a directory (-17)".)
#[test]
fn two_dumps_of_trees_in_one_working_directory_wait_for_each_other_and_both_are_whole() {
    use std::sync::atomic::{AtomicBool, Ordering};
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let scratch = tempfile::tempdir().unwrap();
    let criu = criu().in_scratch(scratch.path());
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    fs::create_dir(&work).unwrap();
    let (a, b) = (Isolated::start(&work), Isolated::start(&work));
    let opts = DumpOpts {
        leave_running: true,
        ..DumpOpts::default()
    };
    // The working directory's lock files this test process holds open (one per dump in it).
    let lock_fds = || {
        fs::read_dir("/proc/self/fd")
            .unwrap()
            .flatten()
            .filter_map(|e| fs::read_link(e.path()).ok())
            .filter(|t| {
                t.parent() == Some(scratch.path())
                    && t.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with("cwd-"))
            })
            .count()
    };
    let (at_gate, first_at_gate) = std::sync::mpsc::channel::<()>();
    let (release, released_rx) = std::sync::mpsc::channel::<()>();
    let (at_gate, released_rx) = (
        std::sync::Mutex::new(at_gate),
        std::sync::Mutex::new(released_rx),
    );
    let released = AtomicBool::new(false);
    let second_saw_first_released = AtomicBool::new(false);
    let publish = |st: Staging, root: i32| {
        let m = st.publish(plain_meta(root, criu.version()), false).unwrap();
        for kind in ["core-", "pages-"] {
            assert!(
                m.files.iter().any(|f| f.name.starts_with(kind)),
                "no {kind} file: {:?}",
                m.files
            );
        }
    };
    std::thread::scope(|s| {
        // Dropped if the test fails in here: the first dump's gate then lets go at once.
        let release = release;
        let first = s.spawn(|| {
            let st = Staging::create(&dir.path().join("img-a")).unwrap();
            criu.dump_staged(a.0, &st, &opts, &|| {
                at_gate.lock().unwrap().send(()).unwrap();
                // Bounded, and ended by the test's failure (its sender dropped): never a hang.
                released_rx
                    .lock()
                    .unwrap()
                    .recv_timeout(PATIENCE)
                    .map_err(|e| format!("the test never let the first dump go: {e}"))
            })
            .map(|()| st)
        });
        first_at_gate.recv().unwrap();
        assert_eq!(
            lock_fds(),
            1,
            "the first dump holds no lock of its directory"
        );
        let second = s.spawn(|| {
            let st = Staging::create(&dir.path().join("img-b")).unwrap();
            criu.dump_staged(b.0, &st, &opts, &|| {
                second_saw_first_released.store(released.load(Ordering::SeqCst), Ordering::SeqCst);
                Ok(())
            })
            .map(|()| st)
        });
        eventually(PATIENCE, "the second dump to wait for the lock", || {
            lock_fds() == 2
        });
        released.store(true, Ordering::SeqCst);
        release.send(()).unwrap();
        let first = first.join().unwrap();
        let second = second.join().unwrap();
        let (first, second) = (
            first.unwrap_or_else(|e| panic!("the first dump failed: {e}")),
            second.unwrap_or_else(|e| panic!("the second dump failed: {e}")),
        );
        publish(first, a.0);
        publish(second, b.0);
    });
    assert!(
        second_saw_first_released.load(Ordering::SeqCst),
        "the second dump reached its gate while the first was held at its own"
    );
    for img in ["img-a", "img-b"] {
        verify(&dir.path().join(img)).unwrap_or_else(|e| panic!("{img}: {e}"));
    }
    assert!(!work.join("proc.crtools").exists());
    for t in [&a, &b] {
        assert!(cryo_proc::stat(t.0).is_ok_and(|s| s.state != 'Z'));
    }
}

/// Attack (session 12) on CRIU's `proc.crtools`: dumping the root of a tree with a pid
/// namespace of its own, CRIU's parasite makes that directory in the root's working directory
/// (and mounts a proc there); one left there by a CRIU that died in that window (or a
/// concurrent dump's, made in the same directory) failed the dump: "Can't create a directory
/// (-17)", every later dump of a worker working there too. cryo holds a lock of that working
/// directory for each dump, so a `proc.crtools` found there under it is nobody's: an empty one
/// is removed and the dump succeeds. Anything else there is left alone (the dump fails as
/// before and the tree runs on). (Before: the first dump failed.)
#[test]
fn a_leftover_proc_crtools_in_a_namespaced_root_s_working_directory_is_removed_for_its_dump() {
    let _serial = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let scratch = tempfile::tempdir().unwrap();
    let criu = criu().in_scratch(scratch.path());
    let dir = tempfile::tempdir().unwrap();
    let work = dir.path().join("work");
    fs::create_dir(&work).unwrap();
    let leftover = work.join("proc.crtools");
    fs::create_dir(&leftover).unwrap();
    let tree = Isolated::start(&work);
    let opts = DumpOpts {
        leave_running: true,
        ..DumpOpts::default()
    };
    let staging = Staging::create(&dir.path().join("img")).unwrap();
    criu.dump_staged(tree.0, &staging, &opts, &|| Ok(()))
        .unwrap_or_else(|e| panic!("the dump failed on the leftover: {e}"));
    drop(staging);
    assert!(!leftover.exists(), "the leftover is still there");
    assert!(cryo_proc::stat(tree.0).is_ok_and(|s| s.state != 'Z'));

    // Not an empty directory: not CRIU's leftover, left alone; the dump fails, safely.
    fs::create_dir(&leftover).unwrap();
    fs::write(leftover.join("keep"), "not CRIU's").unwrap();
    let staging = Staging::create(&dir.path().join("img2")).unwrap();
    let err = criu
        .dump_staged(tree.0, &staging, &opts, &|| Ok(()))
        .unwrap_err();
    drop(staging);
    assert!(
        err.to_string().contains("Can't create a directory"),
        "{err}"
    );
    assert!(leftover.join("keep").exists());
    assert!(
        cryo_proc::stat(tree.0).is_ok_and(|s| s.state != 'Z'),
        "{err}"
    );
}
