//! `cryo metrics`: the Prometheus exposition derived from the journal (only reads it, no lock),
//! printed once or served at `/metrics` while following the journal.

use std::io::Write as _;
use std::sync::Arc;

use anyhow::Context as _;
use cryo_telemetry::{JournalFeed, Metrics, MetricsServer};

use super::Context;
use crate::args::MetricsArgs;

/// Runs `cryo metrics`.
pub fn run(ctx: &Context, args: &MetricsArgs) -> anyhow::Result<()> {
    let metrics = Arc::new(Metrics::new().context("building the metrics registry")?);
    let dir = ctx.state.journal_dir();
    let feed = JournalFeed::start(&dir, Arc::clone(&metrics))
        .with_context(|| format!("reading the journal in {}", dir.display()))?;
    let Some(addr) = &args.listen else {
        drop(feed);
        print!("{}", metrics.encode());
        return Ok(());
    };
    let server = MetricsServer::start(addr, metrics).context("starting the metrics listener")?;
    // The first line says where (with port 0, the port the kernel chose).
    println!("http://{}/metrics", server.local_addr());
    std::io::stdout().flush().context("writing to stdout")?;
    // Serves until killed; the feed and the listener run in their own threads.
    loop {
        std::thread::park();
    }
}
