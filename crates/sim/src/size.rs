//! Byte sizes as operators write them (`512MiB`, `4GiB`, `16G`, `1000000`).

/// A size that could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a size (expected e.g. 4096, 512MiB, 4GiB, 2GB)")]
pub struct BadSize(pub String);

/// Parses a size; binary suffixes (`K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `TiB`) are powers of
/// 1024, decimal ones (`KB`, `MB`, `GB`, `TB`) powers of 1000.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("16G"), Ok(16 << 30));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        for s in ["", "GiB", "4 XiB", "-1", "99999999999999999999T"] {
            assert!(parse_size(s).is_err(), "{s}");
        }
    }
}
