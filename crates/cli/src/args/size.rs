//! Byte sizes on the command line (`512MiB`, `2GiB`, `100MB`, `4096`), in the simulated GPU's syntax.

use std::fmt;
use std::str::FromStr;

/// A number of bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = cryo_sim::size::BadSize;
    /// The simulated GPU's own size syntax, so `cryo demo --memory` and `cryo sim worker --memory` agree.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        cryo_sim::size::parse_size(s).map(ByteSize)
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&human(self.0))
    }
}

/// `1.5 GiB`, `512 MiB`, `12 B`: the formatter every size cryo prints goes through.
pub use cryo_journal::fmt_bytes as human;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_units() {
        assert_eq!("512MiB".parse::<ByteSize>().unwrap().0, 512 << 20);
        assert_eq!("2GiB".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert_eq!("2g".parse::<ByteSize>().unwrap().0, 2 << 30);
        assert_eq!("100MB".parse::<ByteSize>().unwrap().0, 100_000_000);
        assert_eq!("4096".parse::<ByteSize>().unwrap().0, 4096);
        for bad in ["", "MiB", "12XB", "-1", "99999999999999999999GiB"] {
            assert!(bad.parse::<ByteSize>().is_err(), "{bad}");
        }
    }

    #[test]
    fn prints_human() {
        assert_eq!(human(512 << 20), "512 MiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(human(12), "12 B");
    }
}
