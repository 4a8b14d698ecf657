//! SHA-256 of image files, several files at a time.

use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use sha2::{Digest, Sha256};

/// Size and hash of one file.
pub(crate) struct Hashed {
    pub(crate) size: u64,
    pub(crate) sha256: String,
}

/// One file's outcome; the error carries the path.
pub(crate) type HashResult = Result<Hashed, (PathBuf, std::io::Error)>;

/// Hashes `dir/name` for every name, on up to `available_parallelism` threads (files are
/// independent; CRIU writes one pages image per process, so big trees hash in parallel). With
/// `sync`, each file is also fsync'd: it is open anyway. Results are in `names` order.
pub(crate) fn hash_files(dir: &Path, names: &[String], sync: bool) -> Vec<HashResult> {
    let threads = std::thread::available_parallelism()
        .map_or(2, |n| n.get())
        .min(8)
        .min(names.len())
        .max(1);
    let next = AtomicUsize::new(0);
    let results: Mutex<Vec<Option<HashResult>>> =
        Mutex::new((0..names.len()).map(|_| None).collect());
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(name) = names.get(i) else { break };
                let path = dir.join(name);
                let r = hash_one(&path, sync).map_err(|e| (path, e));
                if let Ok(mut v) = results.lock() {
                    v[i] = Some(r);
                }
            });
        }
    });
    results
        .into_inner()
        .unwrap_or_else(|p| p.into_inner())
        .into_iter()
        .zip(names)
        .map(|(r, name)| {
            r.unwrap_or_else(|| {
                Err((
                    dir.join(name),
                    std::io::Error::other("hash worker did not report"),
                ))
            })
        })
        .collect()
}

fn hash_one(path: &Path, sync: bool) -> std::io::Result<Hashed> {
    let mut f = File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        h.update(&buf[..n]);
        size += n as u64;
    }
    if sync {
        f.sync_all()?;
    }
    Ok(Hashed {
        size,
        sha256: hex::encode(h.finalize()),
    })
}
