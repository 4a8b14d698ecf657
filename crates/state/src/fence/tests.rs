//! The fence against what the world does to a state file: damage, old and new formats, entries
//! that do not parse, and files someone else could have written or swapped.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::os::unix::fs::{symlink, PermissionsExt};

use super::*;

const A: &str = "GPU-00000000-0000-0000-0000-00000000000a";
const B: &str = "GPU-00000000-0000-0000-0000-00000000000b";

fn gpu(s: &str) -> FencedGpu {
    s.parse().unwrap()
}

fn uuid(s: &str) -> GpuUuid {
    s.parse().unwrap()
}

/// A state directory in a fresh temporary directory (mode 0700, ours).
fn state() -> (tempfile::TempDir, StateDir) {
    let dir = tempfile::tempdir().unwrap();
    let state = StateDir::new(dir.path().join("state"));
    (dir, state)
}

/// `state` with `text` as its quarantine file (written as an old cryo or an attacker would).
fn with_file(text: &str) -> (tempfile::TempDir, StateDir) {
    let (dir, state) = state();
    fs::create_dir(state.root()).unwrap();
    fs::write(state.quarantine_file(), text).unwrap();
    fs::set_permissions(state.quarantine_file(), fs::Permissions::from_mode(0o644)).unwrap();
    (dir, state)
}

/// The files set aside in `state`.
fn set_aside(state: &StateDir) -> Vec<PathBuf> {
    fs::read_dir(state.root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("quarantine.json.bad-")
        })
        .collect()
}

#[test]
fn quarantine_list_release_round_trip() {
    let (_dir, state) = state();
    let fence = state.fence();
    assert!(fence.list().unwrap().is_empty());
    assert!(!fence.fences(&uuid(A)).unwrap());
    fence
        .quarantine(&gpu(A), "pid 7 died of SIGKILL", &[7])
        .unwrap();
    fence
        .quarantine(&gpu(A), "second reason ignored", &[8, 7])
        .unwrap();
    fence.quarantine(&gpu(B), "other", &[9]).unwrap();
    // UUIDs compare without regard to the case of their hex digits.
    assert!(fence.fences(&uuid(&A.to_uppercase())).unwrap());
    let a = fence.get(&gpu(A)).unwrap().unwrap();
    assert_eq!(a.reason, "pid 7 died of SIGKILL");
    assert_eq!(a.pids, vec![7, 8]);
    // A second handle on the same directory (another process) sees the same state.
    assert_eq!(StateDir::new(state.root()).fence().list().unwrap().len(), 2);
    assert_eq!(fence.release(&gpu(A)).unwrap().unwrap().pids, vec![7, 8]);
    assert!(fence.release(&gpu(A)).unwrap().is_none());
    assert!(!fence.fences(&uuid(A)).unwrap());
    assert!(fence.fences(&uuid(B)).unwrap());
    // Nothing but the file and its lock is left behind.
    let mut names: Vec<String> = fs::read_dir(state.root())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    assert_eq!(names, ["quarantine.json", "quarantine.lock"]);
    // Readable by other users (`cryo status`, `cryo gpu ls`), writable by the writer only.
    let mode = fs::metadata(state.quarantine_file()).unwrap().mode() & 0o777;
    assert_eq!(mode, 0o644);
}

#[test]
fn an_unknown_entry_fences_every_gpu() {
    let (_dir, state) = state();
    let fence = state.fence();
    fence
        .quarantine(&FencedGpu::Unknown, "NVML failed at the exit stop", &[7])
        .unwrap();
    assert!(fence.fences(&uuid(A)).unwrap());
    assert!(fence.fences(&uuid(B)).unwrap());
    let text = fs::read_to_string(state.quarantine_file()).unwrap();
    assert!(text.contains("\"gpu\": \"unknown\""), "{text}");
    assert!(text.contains("\"version\": 2"), "{text}");
    // Only the operator's release of that entry lifts it.
    fence.release(&FencedGpu::Unknown).unwrap().unwrap();
    assert!(!fence.fences(&uuid(A)).unwrap());
}

#[test]
fn files_of_the_first_format_read_the_same_unknown_included() {
    // As the guard wrote it before the format had a version (and wrote "unknown" when NVML failed).
    let (_dir, state) = with_file(&format!(
        r#"{{"gpus": [
            {{"gpu": "{}", "reason": "r", "pids": [7], "since_unix": 1}},
            {{"gpu": "unknown", "reason": "nvml failed", "pids": [8], "since_unix": 2}}
        ]}}"#,
        A.to_uppercase()
    ));
    let fence = state.fence();
    let list = fence.list().unwrap();
    assert_eq!(list[0].gpu, gpu(A));
    assert_eq!(list[1].gpu, FencedGpu::Unknown);
    assert!(fence.fences(&uuid(B)).unwrap());
    // The next write keeps both entries and writes the current format.
    fence.quarantine(&gpu(B), "x", &[9]).unwrap();
    assert_eq!(fence.list().unwrap().len(), 3);
    assert!(fs::read_to_string(state.quarantine_file())
        .unwrap()
        .contains("\"version\": 2"));
}

#[test]
fn one_entry_that_does_not_parse_spoils_the_whole_file() {
    // Before, such an entry was dropped by thaw: the fence failed open.
    for bad in [
        "GPU-123",
        "",
        "GPU-0000000g-0000-0000-0000-00000000000a",
        "all",
    ] {
        let (_dir, state) = with_file(&format!(
            r#"{{"version": 2, "gpus": [
                {{"gpu": "{A}", "reason": "r", "pids": [7], "since_unix": 1}},
                {{"gpu": "{bad}", "reason": "r", "pids": [8], "since_unix": 1}}
            ]}}"#
        ));
        let err = state.fence().list().unwrap_err();
        assert!(matches!(err, FenceError::Parse { .. }), "{bad:?}: {err}");
        assert!(state.fence().fences(&uuid(B)).is_err(), "{bad:?}");
    }
}

#[test]
fn a_damaged_file_is_an_error_and_a_writer_fences_everything_keeping_it() {
    for damaged in [
        "{not json",
        "",
        "[]",
        r#"{"gpus": {}}"#,
        r#"{"gpus": [], "extra": 1}"#,
    ] {
        let (_dir, state) = with_file(damaged);
        let fence = state.fence();
        assert!(
            matches!(fence.list(), Err(FenceError::Parse { .. })),
            "{damaged:?}"
        );
        // The guard pins a context now: its quarantine must be recorded, and what the damaged
        // file said (unknown to us) must not be lost: every GPU stays fenced.
        fence.quarantine(&gpu(A), "pid 7 died", &[7]).unwrap();
        let list = fence.list().unwrap();
        assert_eq!(list.len(), 2, "{damaged:?}: {list:?}");
        assert_eq!(list[0].gpu, FencedGpu::Unknown);
        assert!(list[0].reason.contains("moved to"), "{}", list[0].reason);
        assert_eq!(list[1].gpu, gpu(A));
        assert!(fence.fences(&uuid(B)).unwrap());
        let saved = set_aside(&state);
        assert_eq!(saved.len(), 1, "{damaged:?}");
        assert_eq!(fs::read_to_string(&saved[0]).unwrap(), damaged);
        assert!(list[0].reason.contains(&saved[0].display().to_string()));
    }
}

#[test]
fn a_newer_format_is_refused_and_left_alone() {
    let text = r#"{"version": 3, "gpus": []}"#;
    let (_dir, state) = with_file(text);
    let fence = state.fence();
    assert!(matches!(
        fence.list(),
        Err(FenceError::Version { found: 3, .. })
    ));
    assert!(fence.quarantine(&gpu(A), "x", &[1]).is_err());
    assert_eq!(fs::read_to_string(state.quarantine_file()).unwrap(), text);
    assert!(set_aside(&state).is_empty());
}

#[test]
fn a_symlink_is_not_followed() {
    // Someone points the quarantine at a file of theirs that says nothing is fenced.
    let (dir, state) = state();
    fs::create_dir(state.root()).unwrap();
    let theirs = dir.path().join("theirs.json");
    fs::write(&theirs, r#"{"version": 2, "gpus": []}"#).unwrap();
    symlink(&theirs, state.quarantine_file()).unwrap();
    let fence = state.fence();
    assert!(matches!(
        fence.list(),
        Err(FenceError::Untrusted {
            why: Distrust::Symlink,
            ..
        })
    ));
    // A writer moves the link aside (never writes through it) and fences everything.
    fence.quarantine(&gpu(A), "x", &[1]).unwrap();
    assert_eq!(
        fs::read_to_string(&theirs).unwrap(),
        r#"{"version": 2, "gpus": []}"#
    );
    assert!(fs::symlink_metadata(state.quarantine_file())
        .unwrap()
        .file_type()
        .is_file());
    assert_eq!(fence.list().unwrap()[0].gpu, FencedGpu::Unknown);
    assert!(fence.fences(&uuid(B)).unwrap());
}

#[test]
fn a_file_others_could_write_is_not_trusted() {
    let (_dir, state) = with_file(&format!(
        r#"{{"version": 2, "gpus": [{{"gpu": "{A}", "reason": "r", "pids": [7], "since_unix": 1}}]}}"#
    ));
    let fence = state.fence();
    for mode in [0o666, 0o646, 0o664] {
        fs::set_permissions(state.quarantine_file(), fs::Permissions::from_mode(mode)).unwrap();
        let err = fence.list().unwrap_err();
        assert!(
            matches!(err, FenceError::Untrusted { why: Distrust::Writable(m), .. } if m == mode),
            "{mode:o}: {err}"
        );
    }
    fs::set_permissions(state.quarantine_file(), fs::Permissions::from_mode(0o644)).unwrap();
    assert!(fence.fences(&uuid(A)).unwrap());
}

#[test]
fn a_file_owned_by_another_user_is_not_trusted() {
    // Needs root (as the whole suite does in CI): only root can give a file away.
    assert_eq!(
        rustix::process::geteuid().as_raw(),
        0,
        "this test must run as root (scripts/test.sh does)"
    );
    let (_dir, state) = with_file(r#"{"version": 2, "gpus": []}"#);
    std::os::unix::fs::chown(state.quarantine_file(), Some(65534), None).unwrap();
    assert!(matches!(
        state.fence().list(),
        Err(FenceError::Untrusted {
            why: Distrust::Owner(65534),
            ..
        })
    ));
    // The same for the state directory: its owner could replace or delete the file.
    std::os::unix::fs::chown(state.quarantine_file(), Some(0), None).unwrap();
    std::os::unix::fs::chown(state.root(), Some(65534), None).unwrap();
    assert!(matches!(
        state.fence().list(),
        Err(FenceError::Untrusted {
            why: Distrust::Owner(65534),
            ..
        })
    ));
}

#[test]
fn a_state_directory_others_could_write_is_not_trusted_by_readers_or_writers() {
    let (_dir, state) = state();
    let fence = state.fence();
    fence.quarantine(&gpu(A), "x", &[1]).unwrap();
    // Anyone could now delete the file, which would lift the quarantine.
    fs::set_permissions(state.root(), fs::Permissions::from_mode(0o777)).unwrap();
    assert!(matches!(
        fence.list(),
        Err(FenceError::Untrusted {
            why: Distrust::Writable(0o777),
            ..
        })
    ));
    assert!(fence.fences(&uuid(A)).is_err());
    assert!(fence.quarantine(&gpu(B), "y", &[2]).is_err());
    fs::set_permissions(state.root(), fs::Permissions::from_mode(0o755)).unwrap();
    assert_eq!(fence.list().unwrap().len(), 1);
}

#[test]
fn a_fifo_in_place_of_the_file_is_refused_without_hanging() {
    let (_dir, state) = state();
    fs::create_dir(state.root()).unwrap();
    rustix::fs::mknodat(
        rustix::fs::CWD,
        state.quarantine_file(),
        rustix::fs::FileType::Fifo,
        Mode::from_raw_mode(0o644),
        0,
    )
    .unwrap();
    assert!(matches!(
        state.fence().list(),
        Err(FenceError::Untrusted {
            why: Distrust::NotRegular,
            ..
        })
    ));
}

#[test]
fn a_huge_file_is_refused() {
    let (_dir, state) = with_file(&" ".repeat(MAX_FILE_BYTES as usize + 1));
    assert!(matches!(
        state.fence().list(),
        Err(FenceError::TooLarge { .. })
    ));
}

#[test]
fn no_state_directory_means_nothing_is_fenced() {
    let (_dir, state) = state();
    assert!(state.fence().list().unwrap().is_empty());
    assert!(!state.root().exists(), "reading must not create anything");
}

#[test]
fn fenced_gpu_text() {
    assert_eq!(gpu("unknown"), FencedGpu::Unknown);
    assert_eq!(gpu("UNKNOWN"), FencedGpu::Unknown);
    assert_eq!(gpu(&A.to_uppercase()).to_string(), A);
    assert_eq!(FencedGpu::Unknown.to_string(), "unknown");
    assert!("GPU-1".parse::<FencedGpu>().is_err());
    assert!("".parse::<FencedGpu>().is_err());
    assert!(FencedGpu::Unknown.covers(&uuid(A)));
    assert!(gpu(A).covers(&uuid(A)) && !gpu(A).covers(&uuid(B)));
    let json = serde_json::to_string(&vec![gpu(A), FencedGpu::Unknown]).unwrap();
    assert_eq!(json, format!(r#"["{A}","unknown"]"#));
}
