//! `cryo install-compat`: makes cryo callable as `cuda-checkpoint` (a symlink to this binary),
//! which is all CRIU's cuda plugin needs (it execs `cuda-checkpoint` from PATH).

use std::fs;
use std::io;
use std::os::unix::fs::symlink;

use anyhow::{bail, Context as _};

use crate::args::InstallCompatArgs;

/// Creates `DIR/cuda-checkpoint -> current exe`.
pub fn run(args: &InstallCompatArgs) -> anyhow::Result<()> {
    let exe = std::env::current_exe().context("finding this binary")?;
    let exe = fs::canonicalize(&exe).with_context(|| format!("resolving {}", exe.display()))?;
    let link = args.dir.join("cuda-checkpoint");
    match fs::symlink_metadata(&link) {
        Ok(_) => {
            let ours = fs::canonicalize(&link).is_ok_and(|t| t == exe);
            if ours {
                println!("{} already points to {}", link.display(), exe.display());
                return Ok(());
            }
            if !args.force {
                bail!(
                    "{} exists and is not cryo; pass --force to replace it",
                    link.display()
                );
            }
            fs::remove_file(&link).with_context(|| format!("removing {}", link.display()))?;
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("looking at {}", link.display())),
    }
    fs::create_dir_all(&args.dir).with_context(|| format!("creating {}", args.dir.display()))?;
    symlink(&exe, &link)
        .with_context(|| format!("creating {} -> {}", link.display(), exe.display()))?;
    println!("installed {} -> {}", link.display(), exe.display());
    Ok(())
}
