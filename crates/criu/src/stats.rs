//! CRIU's own account of a dump: the `stats-dump` file it writes into the image directory
//! (its work directory) at the end of every dump, read back for benchmarks.
//!
//! # Why
//! A dump's wall time is mostly CRIU moving the tree's pages into the image (its page loop);
//! that loop's speed is set by the host (first touch of the page cache it writes, the load), not
//! by whoever started CRIU, and it swings by more than the difference a caller makes. CRIU times
//! it itself, so a benchmark can say how much of a dump step was CRIU's page loop and how much
//! was everything else (the caller's set-up, CRIU's start, the gate, the kill, the wait for the
//! tree's end), route by route.
//!
//! # Format
//! Two magic numbers (CRIU's service-image magic and `STATS_MAGIC`), a little-endian `u32`
//! length, and one protobuf `StatsEntry` (CRIU's `images/stats.proto`): its `dump` field holds
//! the times in microseconds and the page counts.

use std::path::Path;

/// The file CRIU writes its dump statistics into, in the dump's work directory.
pub const STATS_DUMP: &str = "stats-dump";

/// CRIU's image magic of its service images (`IMG_SERVICE_MAGIC`).
const SERVICE_MAGIC: u32 = 0x5510_5940;
/// The magic of `stats-dump` (`STATS_MAGIC`).
const STATS_MAGIC: u32 = 0x5709_3306;

/// What CRIU says one dump took, ms (from its microseconds), and how many pages it moved.
#[derive(Debug, Clone, Copy, PartialEq, Default, serde::Serialize, serde::Deserialize)]
pub struct DumpStats {
    /// Freezing the tree (seizing every task).
    pub freezing_ms: f64,
    /// The tree frozen, to its end (killed, or resumed with `--leave-running`): everything CRIU
    /// did with it, the page loop, the action scripts (cryo's gate) and the kill included.
    pub frozen_ms: f64,
    /// The page loop: reading the pages out of the tree and writing them into the image.
    pub memdump_ms: f64,
    /// Of the page loop, writing the pages into the image.
    pub memwrite_ms: f64,
    /// Pages looked at.
    pub pages_scanned: u64,
    /// Pages written into the image.
    pub pages_written: u64,
}

#[derive(Clone, PartialEq, ::prost::Message)]
struct StatsEntry {
    #[prost(message, optional, tag = "1")]
    dump: Option<DumpStatsEntry>,
}

#[derive(Clone, PartialEq, ::prost::Message)]
struct DumpStatsEntry {
    #[prost(uint32, required, tag = "1")]
    freezing_time: u32,
    #[prost(uint32, required, tag = "2")]
    frozen_time: u32,
    #[prost(uint32, required, tag = "3")]
    memdump_time: u32,
    #[prost(uint32, required, tag = "4")]
    memwrite_time: u32,
    #[prost(uint64, required, tag = "5")]
    pages_scanned: u64,
    #[prost(uint64, required, tag = "6")]
    pages_skipped_parent: u64,
    #[prost(uint64, required, tag = "7")]
    pages_written: u64,
}

/// Why a `stats-dump` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StatsError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not CRIU's dump statistics.
    #[error("{path} is not CRIU's dump statistics: {reason}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong with it.
        reason: String,
    },
}

impl DumpStats {
    /// Reads `dir/stats-dump`, the statistics CRIU wrote for the dump into `dir`.
    pub fn read(dir: &Path) -> Result<DumpStats, StatsError> {
        let path = dir.join(STATS_DUMP);
        let bytes = std::fs::read(&path).map_err(|source| StatsError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&bytes).map_err(|reason| StatsError::Format {
            path: path.display().to_string(),
            reason,
        })
    }

    fn parse(bytes: &[u8]) -> Result<DumpStats, String> {
        let word = |at: usize| -> Result<u32, String> {
            bytes
                .get(at..at + 4)
                .and_then(|w| <[u8; 4]>::try_from(w).ok())
                .map(u32::from_le_bytes)
                .ok_or_else(|| format!("{} bytes, too short", bytes.len()))
        };
        let (magic, stats) = (word(0)?, word(4)?);
        if (magic, stats) != (SERVICE_MAGIC, STATS_MAGIC) {
            return Err(format!("magic {magic:#x} {stats:#x}"));
        }
        let len = usize::try_from(word(8)?).map_err(|e| e.to_string())?;
        let body = bytes.get(12..).filter(|b| b.len() == len).ok_or_else(|| {
            format!(
                "an entry of {len} bytes in {} after the header",
                bytes.len().saturating_sub(12)
            )
        })?;
        let entry = <StatsEntry as prost::Message>::decode(body).map_err(|e| e.to_string())?;
        let d = entry.dump.ok_or("no dump statistics in it")?;
        let ms = |us: u32| f64::from(us) / 1e3;
        Ok(DumpStats {
            freezing_ms: ms(d.freezing_time),
            frozen_ms: ms(d.frozen_time),
            memdump_ms: ms(d.memdump_time),
            memwrite_ms: ms(d.memwrite_time),
            pages_scanned: d.pages_scanned,
            pages_written: d.pages_written,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// A `stats-dump` as CRIU 4.2 wrote it for a dumped `sleep` (its bytes, verbatim).
    const SLEEP: [u8; 48] = [
        0x40, 0x59, 0x10, 0x55, 0x06, 0x33, 0x09, 0x57, 0x24, 0x00, 0x00, 0x00, 0x0a, 0x22, 0x08,
        0x95, 0xb6, 0x01, 0x10, 0x9a, 0xa5, 0x06, 0x18, 0xae, 0x2f, 0x20, 0xaf, 0x01, 0x28, 0x3a,
        0x30, 0x00, 0x38, 0x1f, 0x40, 0x00, 0x48, 0x00, 0x50, 0x06, 0x58, 0x06, 0x60, 0x00, 0x68,
        0x00, 0x70, 0x00,
    ];

    #[test]
    fn criu_s_dump_statistics_are_read() {
        let s = DumpStats::parse(&SLEEP).unwrap();
        assert_eq!(
            s,
            DumpStats {
                freezing_ms: 23.317,
                frozen_ms: 103.066,
                memdump_ms: 6.062,
                memwrite_ms: 0.175,
                pages_scanned: 58,
                pages_written: 31,
            }
        );
    }

    #[test]
    fn what_is_not_criu_s_dump_statistics_is_refused() {
        // Another image's magic, a cut file, a length that does not match, no dump entry.
        let mut other = SLEEP;
        other[4] ^= 1;
        assert!(DumpStats::parse(&other).unwrap_err().contains("magic"));
        assert!(DumpStats::parse(&SLEEP[..30]).is_err());
        assert!(DumpStats::parse(&SLEEP[..6])
            .unwrap_err()
            .contains("too short"));
        let empty = [0x40, 0x59, 0x10, 0x55, 0x06, 0x33, 0x09, 0x57, 0, 0, 0, 0];
        assert!(DumpStats::parse(&empty).unwrap_err().contains("no dump"));
        let dir = tempfile::tempdir().unwrap();
        assert!(matches!(
            DumpStats::read(dir.path()),
            Err(StatsError::Read { .. })
        ));
    }
}
