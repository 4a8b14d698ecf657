//! Journal records as RFC 5424 syslog messages, framed by octet counting (RFC 6587 3.4.1).
//!
//! # Format
//! `LEN SP <PRI>1 TIMESTAMP HOSTNAME APP-NAME PROCID MSGID [cryo@32473 seq=".." ...] MSG`
//! - PRI: facility `daemon` (configurable), severity from the event ([`severity`]).
//! - TIMESTAMP: the record's time, UTC, microseconds (RFC 5424 allows no more digits; the
//!   nanoseconds are in MSG).
//! - HOSTNAME: this host's name (`uname -n`); APP-NAME `cryo`; PROCID: the forwarder's pid (it
//!   changes when the forwarder restarts, which tells a collector that records may repeat);
//!   MSGID: the event's type (`checkpointed`, `gpu_quarantined`).
//! - Structured data, one element `cryo@32473`: `seq`, `type` and every field of the event;
//!   nested objects are flattened with dots (`pid.pid`, `pid.start_time`), lists are compact JSON.
//!   32473 is the private enterprise number RFC 5612 reserves for documentation: cryo has none
//!   registered; set [`SyslogFormat::sd_id`] to an organisation's own.
//! - MSG: the record exactly as `cryo timeline --json` prints it (one JSON object), so a
//!   collector keeps the whole record even for fields this build does not know. No BOM: MSG is
//!   sent as RFC 5424's `MSG-ANY` (the JSON is UTF-8), which collectors pass through untouched.

use std::fmt::Write as _;

use cryo_journal::{Event, Record};

use crate::event_type;

/// Syslog facility `daemon` (3).
pub const FACILITY_DAEMON: u8 = 3;

/// The structured-data ID when none is configured (RFC 5612's documentation enterprise number).
pub const DEFAULT_SD_ID: &str = "cryo@32473";

/// Syslog severities cryo uses (RFC 5424 table 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Severity {
    /// A GPU was fenced or a context pinned: the node needs an operator.
    Critical = 2,
    /// Something could not be done safely (a refusal, a failed step, a held fatal signal).
    Warning = 4,
    /// A whole operation finished (stop, freeze, thaw).
    Notice = 5,
    /// A step.
    Info = 6,
}

/// The severity of an event's syslog message.
pub fn severity(event: &Event) -> Severity {
    use Event::*;
    match event {
        Pinned { .. } | GpuQuarantined { .. } | PinsLost { .. } => Severity::Critical,
        Refused { .. }
        | LockFailed { .. }
        | CheckpointFailed { .. }
        | VerifyFailed { .. }
        | UnsafeKill { .. }
        | FreezeFailed { .. }
        | ThawFailed { .. }
        | ParkFailed { .. }
        | WakeFailed { .. }
        | GrowFailed { .. }
        | FatalSignal { .. }
        | GuardLost { .. }
        | PinsKeptByGuard { .. }
        | JournalRepaired { .. } => Severity::Warning,
        StopCompleted { .. }
        | ImagePublished { .. }
        | ThawCompleted { .. }
        | ParkCompleted { .. }
        | WakeCompleted { .. }
        | PinsReleased { .. } => Severity::Notice,
        _ => Severity::Info,
    }
}

/// How records become syslog messages: the header fields that do not come from the record.
#[derive(Debug, Clone)]
pub struct SyslogFormat {
    /// HOSTNAME (printable ASCII, at most 255 characters; `-` when empty).
    pub hostname: String,
    /// APP-NAME (at most 48 characters).
    pub app_name: String,
    /// PROCID (at most 128 characters).
    pub procid: String,
    /// Facility number (0..=23).
    pub facility: u8,
    /// SD-ID of the structured-data element (`name@enterprise-number`).
    pub sd_id: String,
}

impl Default for SyslogFormat {
    fn default() -> Self {
        SyslogFormat {
            hostname: rustix::system::uname()
                .nodename()
                .to_string_lossy()
                .into_owned(),
            app_name: "cryo".to_owned(),
            procid: std::process::id().to_string(),
            facility: FACILITY_DAEMON,
            sd_id: DEFAULT_SD_ID.to_owned(),
        }
    }
}

impl SyslogFormat {
    /// The RFC 5424 message for `record`, without framing.
    pub fn message(&self, record: &Record) -> String {
        let pri = u16::from(self.facility.min(23)) * 8 + severity(&record.event) as u16;
        let time = rfc5424_time(record);
        let msgid = header_field(&event_type(&record.event), 32);
        let mut out = format!(
            "<{pri}>1 {time} {} {} {} {msgid} ",
            header_field(&self.hostname, 255),
            header_field(&self.app_name, 48),
            header_field(&self.procid, 128),
        );
        self.structured_data(record, &mut out);
        out.push(' ');
        out.push_str(
            cryo_journal::render_json(std::iter::once(record), &Default::default()).trim_end(),
        );
        out
    }

    /// The message framed for a TCP stream: `LEN SP MESSAGE` (RFC 6587 octet counting).
    pub fn frame(&self, record: &Record) -> Vec<u8> {
        let msg = self.message(record);
        let mut out = format!("{} ", msg.len()).into_bytes();
        out.extend_from_slice(msg.as_bytes());
        out
    }

    /// The framed message that tells the collector the records with seqs `first..=last` will
    /// never come (`lost` of them; the journal no longer held them when the forwarder came to
    /// them): MSGID `records_lost`, severity warning, no `seq` (it is no record), the current
    /// time; MSG `{"type":"records_lost","first":..,"last":..,"lost":..}`.
    pub fn lost_frame(&self, first: u64, last: u64, lost: u64) -> Vec<u8> {
        self.notice_frame(
            "records_lost",
            &[("first", first), ("last", last), ("lost", lost)],
        )
    }

    /// The framed message that tells the collector the records with seqs `first..=last` it may
    /// have got are no longer the node's (a power cut took back unsynced records after they were
    /// sent; new records took their seqs): the records with those seqs that follow are other
    /// records, not copies to drop. MSGID `records_replaced`, severity warning, no `seq`; MSG
    /// `{"type":"records_replaced","first":..,"last":..}`.
    pub fn replaced_frame(&self, first: u64, last: u64) -> Vec<u8> {
        self.notice_frame("records_replaced", &[("first", first), ("last", last)])
    }

    /// A message of the forwarder's own (`kind` as MSGID and type), numbers as its fields.
    fn notice_frame(&self, kind: &str, fields: &[(&str, u64)]) -> Vec<u8> {
        let pri = u16::from(self.facility.min(23)) * 8 + Severity::Warning as u16;
        let time =
            cryo_journal::fmt_utc(std::time::SystemTime::now(), cryo_journal::Subsec::Micros)
                .unwrap_or_else(|| "-".to_owned());
        let mut sd = format!("[{} type=\"{kind}\"", header_field(&self.sd_id, 32));
        let mut json = serde_json::Map::new();
        json.insert("type".into(), kind.into());
        for (name, v) in fields {
            let _ = write!(sd, " {name}=\"{v}\"");
            json.insert((*name).into(), (*v).into());
        }
        sd.push(']');
        let msg = format!(
            "<{pri}>1 {time} {} {} {} {kind} {sd} {}",
            header_field(&self.hostname, 255),
            header_field(&self.app_name, 48),
            header_field(&self.procid, 128),
            serde_json::Value::Object(json),
        );
        let mut out = format!("{} ", msg.len()).into_bytes();
        out.extend_from_slice(msg.as_bytes());
        out
    }

    fn structured_data(&self, record: &Record, out: &mut String) {
        let _ = write!(
            out,
            "[{} seq=\"{}\"",
            header_field(&self.sd_id, 32),
            record.seq
        );
        let value = serde_json::to_value(&record.event).unwrap_or_default();
        let _ = write!(out, " type=\"");
        escape_param(&event_type(&record.event), out);
        out.push('"');
        if let serde_json::Value::Object(fields) = value {
            for (name, v) in &fields {
                if name != "type" {
                    param(name, v, out);
                }
            }
        }
        out.push(']');
    }
}

/// Appends `name="value"` for a scalar, one param per leaf for an object, compact JSON for a
/// list; nothing for null.
fn param(name: &str, value: &serde_json::Value, out: &mut String) {
    use serde_json::Value;
    if !valid_param_name(name) {
        tracing::debug!(name, "field name is not a valid SD-PARAM name; left to MSG");
        return;
    }
    let text = match value {
        Value::Null => return,
        Value::Object(fields) => {
            for (sub, v) in fields {
                param(&format!("{name}.{sub}"), v, out);
            }
            return;
        }
        Value::String(s) => s.clone(),
        Value::Bool(_) | Value::Number(_) | Value::Array(_) => value.to_string(),
    };
    let _ = write!(out, " {name}=\"");
    escape_param(&text, out);
    out.push('"');
}

/// RFC 5424 PARAM-NAME: 1 to 32 printable ASCII characters except `=`, space, `]` and `"`.
fn valid_param_name(name: &str) -> bool {
    (1..=32).contains(&name.len())
        && name
            .bytes()
            .all(|b| (33..=126).contains(&b) && !matches!(b, b'=' | b']' | b'"'))
}

/// PARAM-VALUE escaping: `"`, `\` and `]` take a backslash.
fn escape_param(value: &str, out: &mut String) {
    for c in value.chars() {
        if matches!(c, '"' | '\\' | ']') {
            out.push('\\');
        }
        out.push(c);
    }
}

/// A header field: printable ASCII without spaces, at most `max` characters; `-` if empty.
fn header_field(value: &str, max: usize) -> String {
    let s: String = value
        .chars()
        .filter(|c| c.is_ascii_graphic())
        .take(max)
        .collect();
    if s.is_empty() {
        "-".to_owned()
    } else {
        s
    }
}

/// The record's time with microseconds, or `-` outside the years RFC 3339 can write.
fn rfc5424_time(record: &Record) -> String {
    cryo_journal::fmt_utc(record.time, cryo_journal::Subsec::Micros)
        .unwrap_or_else(|| "-".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use cryo_journal::ProcId;
    use std::time::{Duration, UNIX_EPOCH};

    fn fmt() -> SyslogFormat {
        SyslogFormat {
            hostname: "node 7".into(),
            app_name: "cryo".into(),
            procid: "42".into(),
            facility: FACILITY_DAEMON,
            sd_id: DEFAULT_SD_ID.into(),
        }
    }

    fn rec(event: Event) -> Record {
        Record {
            seq: 12,
            time: UNIX_EPOCH + Duration::new(1_796_006_467, 123_456_789),
            event,
        }
    }

    #[test]
    fn a_record_becomes_one_rfc5424_message() {
        let r = rec(Event::Refused {
            pid: ProcId::new(4242, 99),
            reason: "lock \"timed\" out]".into(),
            hint: "a\\b".into(),
        });
        let m = fmt().message(&r);
        let json = cryo_journal::render_json([&r], &Default::default());
        assert_eq!(
            m,
            format!(
                "<28>1 2026-11-30T02:41:07.123456Z node7 cryo 42 refused [cryo@32473 seq=\"12\" type=\"refused\" hint=\"a\\\\b\" pid.pid=\"4242\" pid.start_time=\"99\" reason=\"lock \\\"timed\\\" out\\]\"] {}",
                json.trim_end()
            )
        );
    }

    #[test]
    fn frames_count_octets_not_characters() {
        let r = rec(Event::ThawFailed {
            image: "/img/é".into(),
            error: "ü".into(),
        });
        let f = fmt().frame(&r);
        let text = String::from_utf8(f).unwrap();
        let (len, msg) = text.split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), msg.len());
        assert!(msg.len() > msg.chars().count());
    }

    #[test]
    fn lists_are_json_and_severity_follows_the_event() {
        let p = ProcId::new(1, 2);
        let m = fmt().message(&rec(Event::Pinned {
            pid: p,
            gpu: "GPU-1".into(),
            fds: vec![5, 6],
        }));
        assert!(m.starts_with("<26>1 "), "{m}");
        assert!(m.contains(r#" fds="[5,6\]""#), "{m}");
        let m = fmt().message(&rec(Event::Locked { pid: p, ms: 3 }));
        assert!(m.starts_with("<30>1 "), "{m}");
        assert!(
            m.contains(" locked [cryo@32473 seq=\"12\" type=\"locked\" ms=\"3\""),
            "{m}"
        );
    }

    #[test]
    fn lost_records_are_one_warning_with_their_range() {
        let f = String::from_utf8(fmt().lost_frame(4, 9, 6)).unwrap();
        let (len, m) = f.split_once(' ').unwrap();
        assert_eq!(len.parse::<usize>().unwrap(), m.len());
        assert!(m.starts_with("<28>1 "), "{m}");
        assert!(
            m.contains(
                " node7 cryo 42 records_lost [cryo@32473 type=\"records_lost\" first=\"4\" last=\"9\" lost=\"6\"] {\"first\":4,"
            ),
            "{m}"
        );
    }

    #[test]
    fn unknown_events_keep_seq_and_time() {
        let m = fmt().message(&rec(Event::Unknown));
        assert!(
            m.contains(" unknown [cryo@32473 seq=\"12\" type=\"unknown\"]"),
            "{m}"
        );
    }
}
