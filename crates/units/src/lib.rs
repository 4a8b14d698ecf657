//! Byte sizes as cryo reads them from operators (`512MiB`, `4GiB`, `16G`, `100MB`, `4096`) and
//! prints them (`1.5 GiB`, `512 MiB`, `12 B`): the one parser and the one formatter, so that
//! `cryo sim worker --memory`, `cryo demo --memory`, `cryo guard --memory-margin`, the timeline
//! and every report agree.
//!
//! # Design
//! Own code rather than a crate: the syntax is part of cryo's interface and differs from the
//! common crates' (`bytesize` reads `16G` as 16·10⁹; here a single letter is binary, as in
//! `nvidia-smi` and the simulated GPU's `--memory`, and `GB` is decimal), and the output is the
//! binary units NVML uses.
//!
//! Moments ([`Moment`]): absolute times on `CLOCK_MONOTONIC`, the one clock cryo's reports give
//! absolute times on, so a caller measures from its own origin (see `clock`).

mod clock;

pub use clock::Moment;

use std::fmt;
use std::str::FromStr;

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a size (expected e.g. 4096, 512MiB, 4GiB, 2GB)")]
pub struct BadSize(pub String);

/// Parses a size; binary suffixes (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `TiB`) are powers of
/// 1024, decimal ones (`KB`, `MB`, `GB`, `TB`) powers of 1000; case does not matter.
pub fn parse_size(s: &str) -> Result<u64, BadSize> {
    let bad = || BadSize(s.to_string());
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| bad())?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// Sizes for people, in the binary units NVML and `nvidia-smi` use: `1.5 GiB`, `512 MiB`, `12 B`.
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

/// A number of bytes: parsed with [`parse_size`], shown with [`fmt_bytes`] (a clap argument type).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = BadSize;
    fn from_str(s: &str) -> Result<Self, BadSize> {
        parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&fmt_bytes(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!("100MB".parse::<ByteSize>(), Ok(ByteSize(100_000_000)));
        for s in [
            "",
            "GiB",
            "4 XiB",
            "12XB",
            "-1",
            "99999999999999999999T",
            "99999999999999999999GiB",
        ] {
            assert!(parse_size(s).is_err(), "{s}");
        }
    }

    #[test]
    fn sizes_print() {
        assert_eq!(fmt_bytes(512 << 20), "512 MiB");
        assert_eq!(fmt_bytes(3 << 29), "1.5 GiB");
        assert_eq!(fmt_bytes(12), "12 B");
        assert_eq!(ByteSize(2 << 30).to_string(), "2 GiB");
    }
}
