//! The on-disk frame and the scan that splits a byte range into frames.
//!
//! A frame is a 16-byte header and a JSON payload:
//! `magic "CRJ1" | payload length u32 LE | CRC32C(payload) u32 LE | CRC32C(header[0..12]) u32 LE`.
//! The header has its own checksum so that a damaged length is recognised as damage instead of
//! being taken for a record that runs past the end of the file (which would look like a torn
//! tail and make a writer cut good records after it).

use std::fmt;

use crate::Record;

pub(crate) const MAGIC: [u8; 4] = *b"CRJ1";
pub(crate) const HEADER_LEN: usize = 16;
/// Largest payload a frame may carry; a header claiming more is damage.
pub const MAX_PAYLOAD: usize = 1 << 20;

/// Why bytes at some offset are not a valid frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FrameFault {
    /// Fewer bytes than the frame needs: a frame being written right now, or torn by a crash.
    Incomplete,
    /// The header does not start with the magic.
    BadMagic,
    /// The header's checksum does not match.
    BadHeaderChecksum,
    /// The header claims a payload longer than [`MAX_PAYLOAD`].
    TooLong(u32),
    /// The payload's checksum does not match.
    BadPayloadChecksum,
    /// Checksums match but the payload is not a record (written by a broken writer).
    BadPayload(String),
}

impl fmt::Display for FrameFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameFault::Incomplete => write!(f, "incomplete frame"),
            FrameFault::BadMagic => write!(f, "no frame magic"),
            FrameFault::BadHeaderChecksum => write!(f, "header checksum mismatch"),
            FrameFault::TooLong(n) => write!(f, "frame length {n} exceeds {MAX_PAYLOAD}"),
            FrameFault::BadPayloadChecksum => write!(f, "payload checksum mismatch"),
            FrameFault::BadPayload(e) => write!(f, "payload is not a record: {e}"),
        }
    }
}

/// Damaged bytes in the middle of the journal (valid frames follow them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Corruption {
    /// File offset of the first damaged byte range.
    pub offset: u64,
    /// Bytes skipped up to the next valid frame.
    pub len: u64,
    /// What was wrong with the frame at `offset`.
    pub fault: FrameFault,
}

impl fmt::Display for Corruption {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "journal corrupt at offset {}: {} ({} bytes skipped)",
            self.offset, self.fault, self.len
        )
    }
}

/// Bytes after the last valid frame, with no valid frame after them: a record being written now
/// (for a reader) or torn by a crash (for a writer, which holds the lock and cuts it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tail {
    /// Offset of the first byte after the last valid frame.
    pub offset: u64,
    /// Bytes from there to the end of what was read.
    pub len: u64,
    /// What the bytes at `offset` look like.
    pub fault: FrameFault,
}

/// A frame around `payload`.
pub(crate) fn encode(payload: &[u8]) -> Option<Vec<u8>> {
    if payload.len() > MAX_PAYLOAD {
        return None;
    }
    let len = u32::try_from(payload.len()).ok()?;
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    let header_crc = crc32c::crc32c(&out);
    out.extend_from_slice(&header_crc.to_le_bytes());
    out.extend_from_slice(payload);
    Some(out)
}

fn le32(b: &[u8]) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[..4]);
    u32::from_le_bytes(w)
}

/// The payload of the frame at the start of `buf`, checksums verified.
fn parse(buf: &[u8]) -> Result<&[u8], FrameFault> {
    if buf.len() < HEADER_LEN {
        // A prefix of the magic may be a header being written; anything else is damage.
        let n = buf.len().min(4);
        return if buf[..n] == MAGIC[..n] {
            Err(FrameFault::Incomplete)
        } else {
            Err(FrameFault::BadMagic)
        };
    }
    if buf[..4] != MAGIC {
        return Err(FrameFault::BadMagic);
    }
    if crc32c::crc32c(&buf[..12]) != le32(&buf[12..16]) {
        return Err(FrameFault::BadHeaderChecksum);
    }
    let len = le32(&buf[4..8]);
    let ulen = len as usize;
    if ulen > MAX_PAYLOAD {
        return Err(FrameFault::TooLong(len));
    }
    let payload = buf
        .get(HEADER_LEN..HEADER_LEN + ulen)
        .ok_or(FrameFault::Incomplete)?;
    if crc32c::crc32c(payload) != le32(&buf[8..12]) {
        return Err(FrameFault::BadPayloadChecksum);
    }
    Ok(payload)
}

/// What a scan of a byte range found.
#[derive(Debug, Default)]
pub(crate) struct Scanned {
    pub records: Vec<Record>,
    pub corruptions: Vec<Corruption>,
    /// Offset just after the last valid frame (or the start, if none).
    pub valid_end: u64,
    pub tail: Option<Tail>,
}

/// Splits `buf` (the file's bytes from offset `base`) into frames. Damage followed by a valid
/// frame is a [`Corruption`] and the scan resumes at that frame; damage with no valid frame after
/// it is the [`Tail`].
pub(crate) fn scan(buf: &[u8], base: u64) -> Scanned {
    let mut records = Vec::new();
    let walked = walk(buf, base, |at, payload| {
        match serde_json::from_slice::<Record>(payload) {
            Ok(rec) => {
                records.push(rec);
                None
            }
            // The frame is intact, so its boundary is sure: skip just this frame.
            Err(e) => Some(bad_payload(base, at, payload, &e)),
        }
    });
    Scanned {
        records,
        corruptions: walked.corruptions,
        valid_end: walked.valid_end,
        tail: walked.tail,
    }
}

/// Every intact frame of `buf` whose payload is a record, with where the frame (header and
/// payload) lies in `buf`: what a rotation copies, verbatim. Damage is skipped as [`scan`]
/// skips it. Also returns the end of the last intact frame.
pub(crate) fn frames(buf: &[u8]) -> (Vec<(Record, std::ops::Range<usize>)>, usize) {
    let mut out = Vec::new();
    let walked = walk(buf, 0, |at, payload| {
        if let Ok(rec) = serde_json::from_slice::<Record>(payload) {
            out.push((rec, at..at + HEADER_LEN + payload.len()));
        }
        None
    });
    (out, usize::try_from(walked.valid_end).unwrap_or(buf.len()))
}

/// What a writer needs of a byte range ([`bounds`]): where its frames end and the last
/// record's seq, without the records.
#[derive(Debug, Default)]
pub(crate) struct Bounds {
    /// The seq of the last intact frame whose payload is a record (`None`: no such frame).
    pub last_seq: Option<u64>,
    /// Damage that valid frames follow: what [`scan`] finds, less a payload that is not a
    /// record before the last one that is (a writer needs no payload but that one).
    pub corruptions: Vec<Corruption>,
    /// As [`Scanned::valid_end`].
    pub valid_end: u64,
    /// As [`Scanned::tail`].
    pub tail: Option<Tail>,
}

/// As [`scan`], but decodes only the last record: a writer needs the frames' end, the damage
/// and the tail (checked as [`scan`] checks them: magic, both checksums) and the last seq, which
/// is the last record's (each append is the highest seq so far plus one, under the lock). A
/// writer's open then costs the read and the checksums of the file, not a JSON decode of every
/// record.
pub(crate) fn bounds(buf: &[u8], base: u64) -> Bounds {
    let mut frames: Vec<(usize, &[u8])> = Vec::new();
    let walked = walk(buf, base, |at, payload| {
        frames.push((at, payload));
        None
    });
    let mut corruptions = walked.corruptions;
    let mut last_seq = None;
    let mut bad = Vec::new();
    for &(at, payload) in frames.iter().rev() {
        match serde_json::from_slice::<Record>(payload) {
            Ok(rec) => {
                last_seq = Some(rec.seq);
                break;
            }
            Err(e) => bad.push(bad_payload(base, at, payload, &e)),
        }
    }
    corruptions.extend(bad.into_iter().rev());
    corruptions.sort_by_key(|c| c.offset);
    Bounds {
        last_seq,
        corruptions,
        valid_end: walked.valid_end,
        tail: walked.tail,
    }
}

/// An intact frame at `at` whose payload is not a record.
fn bad_payload(base: u64, at: usize, payload: &[u8], e: &serde_json::Error) -> Corruption {
    Corruption {
        offset: base + at as u64,
        len: (HEADER_LEN + payload.len()) as u64,
        fault: FrameFault::BadPayload(e.to_string()),
    }
}

/// The frame structure of a byte range: damage, the end of the last intact frame, the tail.
#[derive(Debug, Default)]
struct Walked {
    corruptions: Vec<Corruption>,
    valid_end: u64,
    tail: Option<Tail>,
}

/// Walks the frames of `buf` (the file's bytes from offset `base`): `frame` gets each intact
/// frame's offset in `buf` and its payload, and says whether that payload is damage (a
/// [`Corruption`], in file order with the others). Damage followed by an intact frame is a
/// [`Corruption`] and the walk resumes at that frame; damage with no intact frame after it is
/// the [`Tail`].
fn walk<'b>(
    buf: &'b [u8],
    base: u64,
    mut frame: impl FnMut(usize, &'b [u8]) -> Option<Corruption>,
) -> Walked {
    let mut out = Walked {
        valid_end: base,
        ..Walked::default()
    };
    let mut at = 0usize;
    while at < buf.len() {
        match parse(&buf[at..]) {
            Ok(payload) => {
                let next = at + HEADER_LEN + payload.len();
                if let Some(c) = frame(at, payload) {
                    out.corruptions.push(c);
                }
                at = next;
                out.valid_end = base + at as u64;
            }
            Err(fault) => match resync(buf, at + 1) {
                Some(next) => {
                    out.corruptions.push(Corruption {
                        offset: base + at as u64,
                        len: (next - at) as u64,
                        fault,
                    });
                    at = next;
                }
                None => {
                    out.tail = Some(Tail {
                        offset: base + at as u64,
                        len: (buf.len() - at) as u64,
                        fault,
                    });
                    break;
                }
            },
        }
    }
    out
}

/// The offset of the next intact frame at or after `from`.
fn resync(buf: &[u8], from: usize) -> Option<usize> {
    let mut at = from;
    while at + HEADER_LEN <= buf.len() {
        let rel = buf[at..].windows(4).position(|w| w == MAGIC)?;
        at += rel;
        if parse(&buf[at..]).is_ok() {
            return Some(at);
        }
        at += 1;
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Event, ProcId};
    use std::time::{Duration, UNIX_EPOCH};

    fn rec(seq: u64) -> Record {
        Record {
            seq,
            time: UNIX_EPOCH + Duration::from_millis(1_800_000_000_000 + seq),
            event: Event::Locked {
                pid: ProcId::new(100 + seq as i32, 7),
                ms: seq,
            },
        }
    }

    fn file(n: u64) -> (Vec<u8>, Vec<usize>) {
        let mut buf = Vec::new();
        let mut starts = Vec::new();
        for s in 1..=n {
            starts.push(buf.len());
            buf.extend(encode(&serde_json::to_vec(&rec(s)).unwrap()).unwrap());
        }
        (buf, starts)
    }

    #[test]
    fn every_truncation_of_the_last_frame_is_a_tail_never_a_record() {
        let (buf, starts) = file(3);
        let last = starts[2];
        for cut in last..buf.len() {
            let s = scan(&buf[..cut], 0);
            assert_eq!(s.records, vec![rec(1), rec(2)], "cut at {cut}");
            assert!(s.corruptions.is_empty(), "cut at {cut}");
            assert_eq!(s.valid_end, last as u64);
            assert_eq!(s.tail.is_some(), cut > last, "cut at {cut}");
        }
    }

    #[test]
    fn every_single_byte_flip_is_detected_and_never_misread() {
        let (buf, starts) = file(4);
        for i in 0..buf.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = buf.clone();
                bad[i] ^= bit;
                let s = scan(&bad, 0);
                let hit = starts.iter().rposition(|&st| st <= i).unwrap();
                let expect: Vec<Record> =
                    (1..=4).filter(|&k| k != hit as u64 + 1).map(rec).collect();
                assert_eq!(s.records, expect, "flip at {i}");
                if hit == 3 {
                    assert!(s.corruptions.is_empty());
                    assert_eq!(s.tail.as_ref().unwrap().offset, starts[3] as u64);
                } else {
                    assert_eq!(s.corruptions.len(), 1, "flip at {i}");
                    assert_eq!(s.corruptions[0].offset, starts[hit] as u64);
                    assert_eq!(s.corruptions[0].len, (starts[hit + 1] - starts[hit]) as u64);
                    assert!(s.tail.is_none());
                }
            }
        }
    }

    /// What a writer's [`bounds`] must agree with [`scan`] on: the frames' end, the tail, the
    /// damage (none of it a payload that is not a record, here) and the last seq.
    fn agrees(buf: &[u8], what: &str) {
        for base in [0u64, 4096] {
            let s = scan(buf, base);
            let b = bounds(buf, base);
            assert_eq!(b.valid_end, s.valid_end, "{what}");
            assert_eq!(b.tail, s.tail, "{what}");
            assert_eq!(b.corruptions, s.corruptions, "{what}");
            assert_eq!(b.last_seq, s.records.iter().map(|r| r.seq).max(), "{what}");
        }
    }

    #[test]
    fn bounds_agree_with_the_whole_scan_on_every_truncation_and_byte_flip() {
        let (buf, _) = file(4);
        for cut in 0..=buf.len() {
            agrees(&buf[..cut], &format!("cut at {cut}"));
        }
        for i in 0..buf.len() {
            for bit in [0x01u8, 0x80] {
                let mut bad = buf.clone();
                bad[i] ^= bit;
                agrees(&bad, &format!("flip at {i}"));
                // Torn after the damage, too.
                agrees(&bad[..buf.len() - 7], &format!("flip at {i}, torn"));
            }
        }
        let mut zeros = buf.clone();
        zeros.extend(std::iter::repeat_n(0u8, 4096));
        agrees(&zeros, "zero-filled tail");
    }

    #[test]
    fn bounds_take_the_seq_of_the_last_frame_that_is_a_record() {
        // Intact frames (both checksums hold) whose payloads are not records: a broken writer.
        let (mut buf, starts) = file(3);
        let not_a_record = encode(br#"{"seq": 99}"#).unwrap();
        let at = buf.len() as u64;
        buf.extend_from_slice(&not_a_record);
        let b = bounds(&buf, 0);
        assert_eq!(b.last_seq, Some(3));
        assert_eq!(b.valid_end, buf.len() as u64, "an intact frame is no tail");
        assert!(b.tail.is_none());
        assert_eq!(b.corruptions.len(), 1);
        assert_eq!(b.corruptions[0].offset, at);
        assert!(matches!(b.corruptions[0].fault, FrameFault::BadPayload(_)));
        // Only damage after the last record matters to a writer: one before it is left to the
        // readers (which report it).
        let mut mid = buf[..starts[2]].to_vec();
        mid.extend_from_slice(&not_a_record);
        mid.extend_from_slice(&buf[starts[2]..at as usize]);
        let b = bounds(&mid, 0);
        assert_eq!(b.last_seq, Some(3));
        assert!(b.corruptions.is_empty(), "{:?}", b.corruptions);
        assert_eq!(scan(&mid, 0).corruptions.len(), 1);
    }

    #[test]
    fn zero_filled_tail_after_power_cut_is_a_tail() {
        let (mut buf, _) = file(2);
        let end = buf.len() as u64;
        buf.extend(std::iter::repeat_n(0u8, 4096));
        let s = scan(&buf, 0);
        assert_eq!(s.records.len(), 2);
        assert_eq!(s.valid_end, end);
        assert_eq!(s.tail.unwrap().fault, FrameFault::BadMagic);
    }

    #[test]
    fn oversized_payload_is_refused() {
        assert!(encode(&vec![b'x'; MAX_PAYLOAD + 1]).is_none());
    }
}
