#![allow(clippy::unwrap_used, clippy::expect_used)]
//! `cryo thaw` of an image whose file system stops answering before the thaw's first look (the
//! test kit's FUSE server holding every open of the image's files from the `cryo` process: its
//! thread waits in the kernel, uninterruptibly, as on a dead disk or an NFS hard mount), plain
//! and with `--gpus-of`.

use std::fs;
use std::io::{BufRead, BufReader};
use std::process::Stdio;
use std::sync::mpsc;
use std::time::{Duration, Instant};

mod common;

use common::{eventually, state_dir, Sim};
use cryo_testkit::fuse::{Hold, Stalling};
use cryo_testkit::PATIENCE;

/// The `--criu-timeout` of the attack, s: the restore's deadline.
const DEADLINE_S: u64 = 2;

/// How long past its deadline the thaw may take to say so before the test calls it hung.
const PAST_DEADLINE: Duration = Duration::from_secs(20);

/// Attack (session 17): the operator thaws an image whose file system does not answer the open
/// of its manifest. At its deadline (`--criu-timeout`) the thaw must refuse, naming the image
/// and that its file system did not answer; nothing is restored or journaled as started.
/// (Before: the CLI's first look read the manifest by name on its own thread, with no
/// deadline: "cryo thaw had not refused 20 s past its 2 s deadline (its threads then:
/// [\"S request_wait_answer\"]); it said: []".)
///
/// Attack (session 18): the `cryo` process must also exit at the deadline, before the file
/// system answers. A process ends only when all its threads have, and one whose FUSE request
/// was sent waits for the answer uninterruptibly (`request_wait_answer`), SIGKILL included: the
/// look runs in a process of its own (the opener), which cryo kills and leaves. (Before, with
/// the look on a thread of cryo's: "cryo said \"cryo: image refused: ...; nothing was
/// restored\" but had not exited 20 s past its 2 s deadline (its threads then: [\"Z 0\", \"D
/// request_wait_answer\"])".)
#[test]
fn a_thaw_whose_image_file_system_does_not_answer_refuses_at_its_deadline() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let (mnt, fuse) = stalled_image(t.path());
    let sim = Sim::start();
    let state = state_dir("thaw-hung-fs");

    let mut thaw = sim.cmd_at(state.path());
    thaw.arg("thaw")
        .arg(&mnt)
        .args(["--criu-timeout", &DEADLINE_S.to_string()]);
    let (refusal, status, said) = refused_in_time(thaw, &fuse, "image refused");
    let image = mnt.display().to_string();
    assert!(refusal.contains(&image), "names the image: {refusal}");
    assert!(
        refusal.contains("its file system did not answer before the restore's deadline"),
        "says its file system did not answer: {refusal}"
    );
    assert!(refusal.contains("nothing was restored"), "{refusal}");
    assert_eq!(
        status.code(),
        Some(3),
        "refused before anything ran: {said:?}"
    );
    // Nothing of the thaw started: no CRIU ran, nothing journaled as started.
    if state.path().join("journal").exists() {
        let events = common::events(state.path());
        assert!(
            !events
                .iter()
                .any(|e| matches!(e, cryo_journal::Event::ThawStarted { .. })),
            "{events:?}"
        );
    }
}

/// Attack (session 18): `cryo thaw --gpus-of PID` (the image's GPUs onto those PID's container
/// was given, by UUID) read the image's manifest on the caller's thread with no deadline, before
/// the thaw's own first look. On an image whose file system does not answer it must give up at
/// the thaw's deadline as the thaw does, naming the image. (Before: "cryo had not said
/// \"did not answer\" 20 s past its 2 s deadline (its threads then: [\"S
/// request_wait_answer\"])".)
#[test]
fn a_thaw_mapped_by_gpus_of_whose_image_file_system_does_not_answer_gives_up_at_its_deadline() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let (mnt, fuse) = stalled_image(t.path());
    let sim = Sim::start();
    let state = state_dir("thaw-hung-fs-gpus-of");
    // A process of a container given the first GPU, by UUID.
    let mut container = std::process::Command::new("sleep")
        .arg("600")
        .env("NVIDIA_VISIBLE_DEVICES", sim.gpu_uuid(0))
        .spawn()
        .unwrap();

    let mut thaw = sim.cmd_at(state.path());
    thaw.arg("thaw")
        .arg(&mnt)
        .args(["--gpus-of", &container.id().to_string()])
        .args(["--criu-timeout", &DEADLINE_S.to_string()]);
    let (line, status, said) = refused_in_time(thaw, &fuse, "did not answer");
    let _ = container.kill();
    let _ = container.wait();
    assert!(
        line.contains(&mnt.display().to_string()),
        "names the image: {line}"
    );
    assert!(!status.success(), "{said:?}");
}

/// Attack (session 19): the thaw's check of the page contents in the checker process
/// (`CRYO_THAW_CHECKER=child`), whose read of `pages-1.img` never returns (the file system holds
/// the checker's reads, and only its: CRIU's are answered). The checker is then in `D`: killed,
/// it stays, and so does its end of the verdict pipe. The thaw must still end at its deadline,
/// refusing, and `cryo` exit. The image is a real plain tree's, so that CRIU restores it and
/// waits at its gate for the checker's verdict (the kit's tiny image makes CRIU fail at once,
/// and since session 23 a thaw whose CRIU failed stops its check: the checker never got to
/// its read).
#[test]
fn a_thaw_whose_image_checker_is_stuck_in_a_read_ends_at_its_deadline() {
    cryo_testkit::require_criu_and_root();
    let t = tempfile::tempdir().unwrap();
    let backing = t.path().join("backing");
    let criu = cryo_criu::CriuRpc::locate(None)
        .unwrap()
        .in_scratch(&t.path().join("scratch"));
    cryo_testkit::image::dumped_tree(&criu, &backing, "exec sleep 100000", 1);
    let fuse = Stalling::mount_from(
        &backing,
        &t.path().join("img"),
        Hold::Reads,
        |n| n.starts_with("pages-"),
        cryo_criu::image::CHECKER_ARG,
    );
    let sim = Sim::start();
    let state = state_dir("thaw-hung-checker");
    let mut thaw = sim.cmd_at(state.path());
    thaw.env("CRYO_THAW_CHECKER", "child")
        .arg("thaw")
        .arg(fuse.path())
        .args(["--criu-timeout", &DEADLINE_S.to_string()]);
    let (line, status, said) = refused_in_time(thaw, &fuse, "image refused");
    // The checker's own deadline and the check's race to give it up, each in its own words
    // (`checker.rs`, `check.rs`): either names the deadline.
    assert!(line.contains("before the restore's deadline"), "{line}");
    assert!(!status.success(), "{line}: {said:?}");
}

/// The tiny image published under `dir`, and a mount of it (`DIR/img`) whose server holds every
/// open of its files from other processes.
fn stalled_image(dir: &std::path::Path) -> (std::path::PathBuf, Stalling) {
    let fuse = Stalling::tiny_image(dir, "img", Hold::Opens);
    (fuse.path().to_path_buf(), fuse)
}

/// Runs `cmd` (a command whose opens of the image `fuse` serves are held), waits for its open
/// to reach the server, then for a line of its stderr that contains `refusal` and for its exit,
/// each within [`DEADLINE_S`] + [`PAST_DEADLINE`], while the server still holds the open; then
/// has the server answer. The line, the exit status, and what it said before.
fn refused_in_time(
    mut cmd: std::process::Command,
    fuse: &Stalling,
    refusal: &str,
) -> (String, std::process::ExitStatus, Vec<String>) {
    let mut child = cmd
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (lines_tx, lines) = mpsc::channel();
    let err_pipe = child.stderr.take().unwrap();
    std::thread::spawn(move || {
        for line in BufReader::new(err_pipe).lines() {
            let Ok(line) = line else { return };
            if lines_tx.send(line).is_err() {
                return;
            }
        }
    });
    // The positive event first: the command's open reached the server and is held there.
    eventually(
        PATIENCE,
        "the command's open of the image to reach the server",
        || fuse.held() > 0,
    );
    let patience = Instant::now() + Duration::from_secs(DEADLINE_S) + PAST_DEADLINE;
    let mut said = Vec::new();
    let line = loop {
        let left = patience.saturating_duration_since(Instant::now());
        match lines.recv_timeout(left) {
            Ok(line) if line.contains(refusal) => break line,
            Ok(line) => said.push(line),
            Err(_) => {
                let threads = threads_of(child.id());
                fuse.answer_all();
                let _ = child.kill();
                let _ = child.wait();
                panic!(
                    "cryo had not said {refusal:?} {} s past its {DEADLINE_S} s deadline (its threads then: {threads:?}); it said: {said:?}",
                    PAST_DEADLINE.as_secs()
                );
            }
        }
    };
    // It exits too, while the server still holds the open: the stuck look was a process of its
    // own, killed and left to end when the file system answers.
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() >= patience {
            let threads = threads_of(child.id());
            fuse.answer_all();
            let _ = child.wait();
            panic!(
                "cryo said {line:?} but had not exited {} s past its {DEADLINE_S} s deadline (its threads then: {threads:?})",
                PAST_DEADLINE.as_secs()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    fuse.answer_all();
    (line, status, said)
}

/// Each thread of `pid`: its state letter and kernel wait.
fn threads_of(pid: u32) -> Vec<String> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .map(|d| {
            d.flatten()
                .map(|t| {
                    let stat = fs::read_to_string(t.path().join("stat")).unwrap_or_default();
                    let state = stat.rsplit(") ").next().and_then(|s| s.chars().next());
                    let wchan = fs::read_to_string(t.path().join("wchan")).unwrap_or_default();
                    format!("{} {wchan}", state.unwrap_or('?'))
                })
                .collect()
        })
        .unwrap_or_default()
}
