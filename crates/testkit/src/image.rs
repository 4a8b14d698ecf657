//! Small CRIU images published for tests that need an image's files, not a restorable tree,
//! and images of real plain trees dumped by the real CRIU ([`dumped_tree`]).

use std::path::Path;

use cryo_criu::image::{ImageMeta, Staging};
use cryo_criu::{Criu, CriuRpc, CriuVersion, DumpOpts};

use crate::{eventually, PATIENCE};

/// The meta of a test image of a plain tree rooted at `root_pid`, dumped by CRIU
/// `criu_version` (no process list, no GPU).
pub fn plain_meta(root_pid: i32, criu_version: CriuVersion) -> ImageMeta {
    ImageMeta {
        root_pid,
        processes: Vec::new(),
        zombies: Vec::new(),
        threads: Vec::new(),
        gpu_model: None,
        driver_version: None,
        criu_version,
        shrunk: None,
    }
}

/// Publishes at `dir` an image of `files` (name, content) whose manifest names one process,
/// 4242, without GPU state, dumped by CRIU 4.2.
pub fn publish(dir: &Path, files: &[(&str, &[u8])]) {
    let st = Staging::create(dir).unwrap();
    for (name, content) in files {
        std::fs::write(st.path().join(name), content).unwrap();
    }
    st.publish(
        ImageMeta {
            root_pid: 4242,
            processes: vec![cryo_criu::image::ProcessEntry {
                pid: 4242,
                ppid: 1,
                comm: "worker".into(),
                cmdline: vec!["worker".into()],
                nspid: vec![4242],
                gpu: None,
            }],
            zombies: Vec::new(),
            threads: Vec::new(),
            gpu_model: None,
            driver_version: None,
            criu_version: CriuVersion {
                major: 4,
                minor: 2,
                sublevel: 0,
            },
            shrunk: None,
        },
        false,
    )
    .unwrap();
}

/// [`publish`]es at `dir` a tiny image that the real CRIU starts to read: its `inventory.img`
/// (the first file CRIU reads, not a valid one), a pages file and a core file.
pub fn publish_tiny(dir: &Path) {
    publish(
        dir,
        &[
            ("inventory.img", &[0x5a; 64]),
            ("pages-1.img", &[7u8; 100_000]),
            ("core-4242.img", b"core"),
        ],
    );
}

/// A real process tree dumped by `criu` into a published image in `dir`: `setsid sh -c SCRIPT`,
/// its session's leader, stdio null; the tree's pids, the root first, once it has `procs`
/// processes. The tree is ended by the dump (and reaped: its pids are free again).
pub fn dumped_tree(criu: &CriuRpc, dir: &Path, script: &str, procs: usize) -> Vec<i32> {
    use std::os::unix::process::CommandExt;
    crate::own();
    let mut cmd = std::process::Command::new("sh");
    cmd.args(["-c", script])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    crate::fds::close_inherited(&mut cmd, None);
    // SAFETY: setsid is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| nix::unistd::setsid().map(|_| ()).map_err(Into::into));
    }
    let mut child = cmd.spawn().unwrap();
    let root = child.id() as i32;
    let pids = eventually(PATIENCE, "the tree to start", || {
        let pids = cryo_proc::tree(root).unwrap_or_default();
        (pids.len() == procs).then_some(pids)
    });
    let staging = Staging::create(dir).unwrap();
    criu.dump_staged(root, &staging, &DumpOpts::default(), &|| Ok(()))
        .unwrap();
    child.wait().unwrap();
    staging
        .publish(plain_meta(root, criu.version()), false)
        .unwrap();
    // The root's children were reparented when CRIU killed the tree: their reaper's pace.
    eventually(PATIENCE, "the dumped tree's pids to be free", || {
        cryo_proc::pids_in_use(&pids).is_empty()
    });
    pids
}
