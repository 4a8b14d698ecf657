//! `cryo timeline`: the journal as an incident timeline. Only reads (no lock): never blocks the
//! writers (`cryo stop`, the guard) and is safe to run while they write.

use anyhow::Context as _;
use cryo_journal::{parse_since, render_json, render_timeline, Filter};

use super::Context;
use crate::args::{JournalArgs, JournalCommand, TimelineArgs};
use crate::exit::UsageError;

/// Runs `cryo timeline`.
pub fn run(ctx: &Context, args: &TimelineArgs) -> anyhow::Result<()> {
    let since = match &args.since {
        Some(s) => Some(parse_since(s).map_err(|e| UsageError(format!("--since: {e}")))?),
        None => None,
    };
    let filter = Filter {
        since,
        pid: args.pid,
    };
    let dir = ctx.state.journal_dir();
    let scan = if args.all {
        cryo_journal::read_all(&dir)
    } else {
        ctx.state.read_journal()
    }
    .with_context(|| format!("reading the journal in {}", dir.display()))?;
    for c in &scan.corruptions {
        eprintln!("cryo: warning: {c}; the records there are lost, the rest are shown");
    }
    let out = if args.json {
        render_json(&scan.records, &filter)
    } else {
        render_timeline(&scan.records, &filter)
    };
    if out.is_empty() && !args.json {
        eprintln!(
            "cryo: no journal records match (journal: {})",
            dir.display()
        );
    }
    print!("{out}");
    Ok(())
}

/// Runs `cryo journal`.
pub fn run_journal(ctx: &Context, args: &JournalArgs) -> anyhow::Result<()> {
    match args.command {
        JournalCommand::Rotate => {
            let journal = ctx.state.open_journal().context("opening the journal")?;
            let rotated = journal
                .maintain(0, cryo_journal::Retention::default())
                .context("rotating the journal")?;
            match rotated {
                Some(r) => println!(
                    "journal rotated: records {}..{} ({} bytes) archived as {}; {} carried ({} bytes)",
                    r.first_seq,
                    r.last_seq,
                    r.old_bytes,
                    r.archive.display(),
                    r.carried,
                    r.new_bytes
                ),
                None => println!("the journal is empty: nothing to rotate"),
            }
            Ok(())
        }
    }
}
