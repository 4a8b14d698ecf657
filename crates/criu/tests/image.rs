#![allow(clippy::unwrap_used, clippy::expect_used)]
//! Staging, publishing and verifying image directories (no CRIU needed).

use std::fs;
use std::path::{Path, PathBuf};

use cryo_criu::image::{
    self, clean_stale, verify, DeviceUse, ImageError, ImageMeta, ProcessEntry, ProcessGpu, Staging,
    MANIFEST_FILE,
};
use cryo_criu::CriuVersion;
use cryo_gpu::ProcessState;

fn meta() -> ImageMeta {
    ImageMeta {
        root_pid: 4242,
        processes: vec![
            ProcessEntry {
                pid: 4242,
                ppid: 1,
                comm: "worker".into(),
                cmdline: vec!["worker".into(), "--port".into(), "8000".into()],
                gpu: Some(ProcessGpu {
                    state: ProcessState::Checkpointed,
                    devices: vec![DeviceUse {
                        uuid: "GPU-00000000-0000-0000-0000-000000000001".parse().unwrap(),
                        memory_bytes: 1 << 30,
                    }],
                }),
            },
            ProcessEntry {
                pid: 4243,
                ppid: 4242,
                comm: "helper".into(),
                cmdline: vec!["helper".into()],
                gpu: None,
            },
        ],
        gpu_model: Some("Sim GPU".into()),
        driver_version: Some("595.0-sim".into()),
        criu_version: CriuVersion {
            major: 4,
            minor: 1,
            sublevel: 1,
        },
    }
}

/// Publishes an image of a few files at `parent/name` and returns its path.
fn published(parent: &Path, name: &str) -> PathBuf {
    let dir = parent.join(name);
    let st = Staging::create(&dir).unwrap();
    fs::write(st.path().join("pages-1.img"), vec![7u8; 300_000]).unwrap();
    fs::write(st.path().join("core-4242.img"), b"core").unwrap();
    fs::write(st.path().join("dump.log"), b"log\n").unwrap();
    fs::write(st.path().join("empty.img"), b"").unwrap();
    let m = st.publish(meta(), false).unwrap();
    assert_eq!(m.files.len(), 4);
    assert_eq!(m.total_bytes, 300_000 + 4 + 4);
    dir
}

fn leftovers(parent: &Path) -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir(parent)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| image::is_staging_name(n))
        .collect();
    v.sort();
    v
}

fn file_name(p: &Path) -> &str {
    p.file_name().unwrap().to_str().unwrap()
}

#[test]
fn published_image_verifies_and_describes_the_tree() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let m = verify(&dir).unwrap();
    assert_eq!(m, image::read_manifest(&dir.join(MANIFEST_FILE)).unwrap());
    assert_eq!(m.root_pid, 4242);
    assert_eq!(m.pids(), vec![4242, 4243]);
    assert_eq!(m.gpu_uuids().len(), 1);
    assert_eq!(m.device_memory_by_gpu()[0].1, 1 << 30);
    assert_eq!(m.gpu_model.as_deref(), Some("Sim GPU"));
    assert_eq!(m.format_version, image::FORMAT_VERSION);
    assert!(m.files.windows(2).all(|w| w[0].name < w[1].name));
    assert!(leftovers(t.path()).is_empty());
}

#[test]
fn flipped_byte_is_a_checksum_error_naming_the_file() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let p = dir.join("pages-1.img");
    let mut b = fs::read(&p).unwrap();
    b[123_456] ^= 0x01;
    fs::write(&p, b).unwrap();
    match verify(&dir) {
        Err(ImageError::Checksum { file }) => assert_eq!(file_name(&file), "pages-1.img"),
        other => panic!("expected a checksum error, got {other:?}"),
    }
}

#[test]
fn missing_file_is_refused_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    fs::remove_file(dir.join("core-4242.img")).unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(err.to_string().contains("core-4242.img"), "{err}");
    assert!(
        matches!(&err, ImageError::Missing { file } if file_name(file) == "core-4242.img"),
        "{err:?}"
    );
}

#[test]
fn extra_file_is_refused_naming_it() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    fs::write(dir.join("intruder.img"), b"x").unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(
        matches!(&err, ImageError::Unlisted { file } if file_name(file) == "intruder.img"),
        "{err:?}"
    );
}

#[test]
fn truncated_file_is_refused_with_sizes() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let p = dir.join("pages-1.img");
    fs::File::options()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(1000)
        .unwrap();
    match verify(&dir) {
        Err(ImageError::Truncated {
            file,
            expected,
            found,
        }) => {
            assert_eq!(file_name(&file), "pages-1.img");
            assert_eq!((expected, found), (300_000, 1000));
        }
        other => panic!("expected truncated, got {other:?}"),
    }
}

#[test]
fn truncated_manifest_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let mp = dir.join(MANIFEST_FILE);
    let b = fs::read(&mp).unwrap();
    fs::write(&mp, &b[..b.len() / 2]).unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(
        matches!(&err, ImageError::BadManifest { file, .. } if file_name(file) == MANIFEST_FILE),
        "{err:?}"
    );
    assert!(err.to_string().contains(MANIFEST_FILE), "{err}");
}

#[test]
fn edited_manifest_that_still_parses_is_refused() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let mp = dir.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mp).unwrap();
    let edited = text.replace("\"root_pid\": 4242", "\"root_pid\": 4243");
    assert_ne!(text, edited);
    fs::write(&mp, edited).unwrap();
    let err = verify(&dir).unwrap_err();
    assert!(
        matches!(&err, ImageError::Checksum { file } if file_name(file) == MANIFEST_FILE),
        "{err:?}"
    );
}

#[test]
fn newer_format_and_missing_manifest_are_refused() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");
    let mp = dir.join(MANIFEST_FILE);
    let text = fs::read_to_string(&mp).unwrap();
    fs::write(
        &mp,
        text.replace("\"format_version\": 1", "\"format_version\": 9"),
    )
    .unwrap();
    assert!(matches!(
        verify(&dir),
        Err(ImageError::UnsupportedFormat {
            found: 9,
            supported: 1,
            ..
        })
    ));
    fs::remove_file(&mp).unwrap();
    assert!(
        matches!(verify(&dir), Err(ImageError::Missing { file }) if file_name(&file) == MANIFEST_FILE)
    );
}

#[test]
fn publishing_over_an_image_needs_replace_and_replaces_whole() {
    let t = tempfile::tempdir().unwrap();
    let dir = published(t.path(), "img");

    let st = Staging::create(&dir).unwrap();
    fs::write(st.path().join("new.img"), b"new").unwrap();
    let staged = st.path().to_path_buf();
    let err = st.publish(meta(), false).unwrap_err();
    assert!(
        matches!(&err, ImageError::Exists { dir: d } if *d == dir),
        "{err:?}"
    );
    assert!(
        !staged.exists(),
        "a failed publish leaves its staging directory"
    );
    verify(&dir).unwrap();

    let st = Staging::create(&dir).unwrap();
    fs::write(st.path().join("new.img"), b"new").unwrap();
    let m = st.publish(meta(), true).unwrap();
    assert_eq!(m.files.len(), 1);
    assert_eq!(verify(&dir).unwrap(), m);
    assert!(!dir.join("pages-1.img").exists());
    assert!(leftovers(t.path()).is_empty(), "{:?}", leftovers(t.path()));
}

#[test]
fn replace_refuses_a_directory_that_is_not_an_image() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("precious");
    fs::create_dir(&dir).unwrap();
    fs::write(dir.join("data"), b"keep me").unwrap();
    let st = Staging::create(&dir).unwrap();
    fs::write(st.path().join("x.img"), b"x").unwrap();
    let err = st.publish(meta(), true).unwrap_err();
    assert!(matches!(err, ImageError::NotAnImage { .. }), "{err:?}");
    assert_eq!(fs::read(dir.join("data")).unwrap(), b"keep me");
    // An empty directory is not silently replaced either (plain rename(2) would).
    let empty = t.path().join("empty");
    fs::create_dir(&empty).unwrap();
    let st = Staging::create(&empty).unwrap();
    assert!(matches!(
        st.publish(meta(), false),
        Err(ImageError::Exists { .. })
    ));
}

#[test]
fn crashed_freeze_is_invisible_and_cleaned_by_the_next() {
    let t = tempfile::tempdir().unwrap();
    let dir = t.path().join("img");
    // What a freeze killed just before the rename leaves: a complete-looking staging directory
    // (manifest included) whose lock died with the process.
    let other = published(t.path(), "donor");
    let crashed = t.path().join("img.tmp-crashed00001");
    fs::rename(&other, &crashed).unwrap();

    assert!(!dir.exists());
    assert!(matches!(verify(&dir), Err(ImageError::Missing { .. })));
    assert!(matches!(verify(&crashed), Err(ImageError::Staging { .. })));

    // A staging directory of a live freeze is left alone.
    let live = Staging::create(&t.path().join("other")).unwrap();
    let st = Staging::create(&dir).unwrap();
    assert!(!crashed.exists(), "stale staging directory not cleaned");
    assert!(live.path().exists());
    assert_eq!(
        clean_stale(&t.path().join("other")).unwrap(),
        Vec::<PathBuf>::new()
    );
    assert!(
        live.path().exists(),
        "clean_stale removed a staging directory in use"
    );

    fs::write(st.path().join("a.img"), b"a").unwrap();
    st.publish(meta(), false).unwrap();
    verify(&dir).unwrap();
    drop(live);
    assert!(leftovers(t.path()).is_empty(), "{:?}", leftovers(t.path()));
}

#[test]
fn dropped_staging_is_removed() {
    let t = tempfile::tempdir().unwrap();
    let st = Staging::create(&t.path().join("img")).unwrap();
    let p = st.path().to_path_buf();
    fs::write(p.join("x"), b"x").unwrap();
    drop(st);
    assert!(!p.exists());
}
