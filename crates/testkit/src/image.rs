//! Small CRIU images published for tests that need an image's files, not a restorable tree.

use std::path::Path;

use cryo_criu::image::{ImageMeta, Staging};
use cryo_criu::CriuVersion;

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
