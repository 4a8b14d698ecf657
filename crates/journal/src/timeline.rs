//! The timeline as `cryo timeline` prints it, and `--since` parsing.

use std::fmt::Write as _;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::error::SinceError;
use crate::{Filter, Record};

/// One line per kept record, in UTC, like an incident timeline:
/// `2026-11-30T02:41:07.123Z  pid 4242   checkpointed  1830 ms, 5.8 GB`.
pub fn render_timeline<'a>(
    records: impl IntoIterator<Item = &'a Record>,
    filter: &Filter,
) -> String {
    let mut out = String::new();
    for r in records.into_iter().filter(|r| filter.matches(r)) {
        let time = fmt_utc(r.time, false).unwrap_or_else(|| format!("{:?}", r.time));
        let who = match r.event.proc() {
            Some(p) => format!("pid {}", p.pid),
            None => "-".to_owned(),
        };
        let detail = r.event.detail();
        let line = format!("{time}  {who:<10}  {:<18}  {detail}", r.event.label());
        let _ = writeln!(out, "{}", line.trim_end());
    }
    out
}

/// One JSON object per kept record, one per line (JSON Lines), as stored.
pub fn render_json<'a>(records: impl IntoIterator<Item = &'a Record>, filter: &Filter) -> String {
    let mut out = String::new();
    for r in records.into_iter().filter(|r| filter.matches(r)) {
        match serde_json::to_string(r) {
            Ok(line) => {
                out.push_str(&line);
                out.push('\n');
            }
            // Only an out-of-range time can fail; such a record could not have been read.
            Err(err) => tracing::warn!(seq = r.seq, %err, "cannot render record as JSON"),
        }
    }
    out
}

/// A `--since` value: RFC 3339 (`2026-11-30T02:41:07Z`, `2026-11-30T03:41:07+01:00`) or a
/// duration before now (`10m`, `2h`, `1h 30m`, `90s`).
pub fn parse_since(input: &str) -> Result<SystemTime, SinceError> {
    parse_since_at(input, SystemTime::now())
}

/// [`parse_since`] relative to `now`.
pub fn parse_since_at(input: &str, now: SystemTime) -> Result<SystemTime, SinceError> {
    let text = input.trim();
    let err = || SinceError {
        input: input.to_owned(),
    };
    if let Ok(t) = time::OffsetDateTime::parse(text, &time::format_description::well_known::Rfc3339)
    {
        let nanos = t.unix_timestamp_nanos();
        return if nanos >= 0 {
            let nanos = u64::try_from(nanos).map_err(|_| err())?;
            Ok(UNIX_EPOCH + Duration::from_nanos(nanos))
        } else {
            Err(err())
        };
    }
    let ago = humantime::parse_duration(text).map_err(|_| err())?;
    now.checked_sub(ago).ok_or_else(err)
}

/// `t` in RFC 3339 UTC, with milliseconds or nanoseconds; `None` outside years 1970..=9999.
pub(crate) fn fmt_utc(t: SystemTime, nanos: bool) -> Option<String> {
    // humantime panics outside this range.
    const YEAR_10000: u64 = 253_402_300_800;
    let secs = t.duration_since(UNIX_EPOCH).ok()?.as_secs();
    if secs >= YEAR_10000 {
        return None;
    }
    Some(if nanos {
        humantime::format_rfc3339_nanos(t).to_string()
    } else {
        humantime::format_rfc3339_millis(t).to_string()
    })
}

/// Sizes for people, in the binary units NVML and `nvidia-smi` use: `1.5 GiB`, `512 MiB`, `12 B`.
/// Every size cryo prints goes through here, so the timeline and the commands agree.
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else if v.fract() == 0.0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}
