//! `cryo timeline`: the journal as an incident timeline. Only reads (no lock): never blocks the
//! writers (`cryo stop`, the guard) and is safe to run while they write.

use anyhow::Context as _;
use cryo_journal::{parse_since, render_json, render_timeline, Filter};

use super::Context;
use crate::args::TimelineArgs;
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
    let scan = ctx
        .state
        .read_journal()
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
