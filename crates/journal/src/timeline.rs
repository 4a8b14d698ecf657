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
        let time = fmt_utc(r.time, Subsec::Millis).unwrap_or_else(|| format!("{:?}", r.time));
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
    let ago = parse_ago(text).ok_or_else(err)?;
    now.checked_sub(ago).ok_or_else(err)
}

/// `10m`, `2h`, `1h 30m`, `90s`, `2d`: numbers with units (`s`, `m`, `h`, `d`, `w` and their
/// words), summed. The `time` crate parses instants, not durations like these; this is the one
/// thing cryo needs that it lacks.
fn parse_ago(text: &str) -> Option<Duration> {
    let mut rest = text.trim();
    if rest.is_empty() {
        return None;
    }
    let mut total = Duration::ZERO;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit())
            .unwrap_or(rest.len());
        let n: u64 = rest.get(..digits)?.parse().ok()?;
        rest = rest.get(digits..)?.trim_start();
        let letters = rest
            .find(|c: char| !c.is_ascii_alphabetic())
            .unwrap_or(rest.len());
        let unit: u64 = match rest.get(..letters)? {
            "s" | "sec" | "secs" | "second" | "seconds" => 1,
            "m" | "min" | "mins" | "minute" | "minutes" => 60,
            "h" | "hr" | "hrs" | "hour" | "hours" => 3600,
            "d" | "day" | "days" => 86_400,
            "w" | "week" | "weeks" => 604_800,
            _ => return None,
        };
        total = total.checked_add(Duration::from_secs(n.checked_mul(unit)?))?;
        rest = rest.get(letters..)?.trim_start();
    }
    Some(total)
}

/// How many digits of the second's fraction [`fmt_utc`] writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subsec {
    /// `.123`
    Millis,
    /// `.123456`
    Micros,
    /// `.123456789`
    Nanos,
}

/// `t` in RFC 3339 UTC with a fixed number of fraction digits (`2026-11-30T02:41:07.123Z`), as
/// the timeline, the journal's records and the syslog forwarder write it; `None` outside years
/// 1970..=9999, which RFC 3339 cannot write.
pub fn fmt_utc(t: SystemTime, digits: Subsec) -> Option<String> {
    use time::macros::format_description;
    const YEAR_10000: u64 = 253_402_300_800;
    let since = t.duration_since(UNIX_EPOCH).ok()?;
    if since.as_secs() >= YEAR_10000 {
        return None;
    }
    let at = time::OffsetDateTime::UNIX_EPOCH.checked_add(since.try_into().ok()?)?;
    match digits {
        Subsec::Millis => at.format(format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z"
        )),
        Subsec::Micros => at.format(format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:6]Z"
        )),
        Subsec::Nanos => at.format(format_description!(
            "[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:9]Z"
        )),
    }
    .ok()
}
