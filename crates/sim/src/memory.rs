//! "Device memory" contents: a counter-based PRNG (word `i` of seed `s` is computable on its own,
//! so a worker can check any sample against its seed) and a fast, parallel content hash.

/// Bytes per hash chunk; chunk hashes are combined in order, so the result does not depend on
/// how many threads computed it.
const CHUNK: usize = 1 << 20;

/// Word `i` (little-endian, at byte offset `8 * i`) of memory filled from `seed` (splitmix64).
pub fn word(seed: u64, i: u64) -> u64 {
    let mut z = seed.wrapping_add(i.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fills `buf` from `seed`, on every core.
pub fn fill(buf: &mut [u8], seed: u64) {
    fill_at(buf, seed, 0);
}

/// Fills `buf` as the words from `first_word` on of memory filled from `seed` (the tail of a
/// region that starts at byte `8 * first_word`), on every core.
pub fn fill_at(buf: &mut [u8], seed: u64, first_word: u64) {
    for_pieces(buf, |first_chunk, piece| {
        let mut i = first_word + (first_chunk * CHUNK / 8) as u64;
        let mut words = piece.chunks_exact_mut(8);
        for w in &mut words {
            w.copy_from_slice(&word(seed, i).to_le_bytes());
            i += 1;
        }
        let tail = words.into_remainder();
        let n = tail.len();
        tail.copy_from_slice(&word(seed, i).to_le_bytes()[..n]);
    });
}

/// The word at index `i` of `buf`, zero-padded past its end.
pub fn read_word(buf: &[u8], i: u64) -> u64 {
    let start = (i as usize).saturating_mul(8);
    let mut b = [0u8; 8];
    if let Some(s) = buf.get(start..) {
        let n = s.len().min(8);
        b[..n].copy_from_slice(&s[..n]);
    }
    u64::from_le_bytes(b)
}

/// The content hash of `buf`.
pub fn hash(buf: &[u8]) -> u64 {
    let chunks = buf.len().div_ceil(CHUNK);
    let mut out = vec![0u64; chunks];
    hash_chunks(&mut out, |k| {
        let end = ((k + 1) * CHUNK).min(buf.len());
        let c = &buf[k * CHUNK..end];
        let mut h = Lanes::default();
        let mut words = c.chunks_exact(8);
        for w in &mut words {
            let mut b = [0u8; 8];
            b.copy_from_slice(w);
            h.push(u64::from_le_bytes(b));
        }
        let tail = words.remainder();
        if !tail.is_empty() {
            let mut b = [0u8; 8];
            b[..tail.len()].copy_from_slice(tail);
            h.push(u64::from_le_bytes(b));
        }
        h.finish()
    });
    combine(&out, buf.len() as u64)
}

/// The content hash that `len` bytes filled from `seed` have, computed without the memory.
pub fn expected_hash(seed: u64, len: u64) -> u64 {
    expected_hash_filled(seed, len, len)
}

/// The content hash of `len` bytes whose first `filled` are filled from `seed` and the rest are
/// zeros (weights loaded, then a fresh allocation after them), computed without the memory.
pub fn expected_hash_filled(seed: u64, filled: u64, len: u64) -> u64 {
    let len_us = usize::try_from(len).unwrap_or(usize::MAX);
    let chunks = len_us.div_ceil(CHUNK);
    let mut out = vec![0u64; chunks];
    // Word `g` as memory holds it: seeded below `filled`, zero above, masked where it straddles.
    let at = |g: u64| -> u64 {
        let start = g.saturating_mul(8);
        if start >= filled {
            0
        } else if start + 8 <= filled {
            word(seed, g)
        } else {
            word(seed, g) & ((1u64 << (8 * (filled - start))) - 1)
        }
    };
    hash_chunks(&mut out, |k| {
        let end = ((k + 1) * CHUNK).min(len_us);
        let bytes = end - k * CHUNK;
        let first = (k * CHUNK / 8) as u64;
        let mut h = Lanes::default();
        for j in 0..(bytes / 8) as u64 {
            h.push(at(first + j));
        }
        let tail = bytes % 8;
        if tail != 0 {
            let w = at(first + (bytes / 8) as u64);
            h.push(w & ((1u64 << (8 * tail)) - 1));
        }
        h.finish()
    });
    combine(&out, len)
}

/// Four independent multiply chains, so the hash runs at memory speed rather than at the latency
/// of one chain.
#[derive(Default)]
struct Lanes {
    l: [u64; 4],
    n: usize,
}

impl Lanes {
    fn push(&mut self, w: u64) {
        let l = &mut self.l[self.n & 3];
        *l = (*l ^ w).wrapping_mul(0x9fb2_1c65_1e98_df25).rotate_left(29);
        self.n += 1;
    }

    fn finish(&self) -> u64 {
        let mut h = self.n as u64;
        for l in self.l {
            h = (h ^ l).wrapping_mul(0xff51_afd7_ed55_8ccd).rotate_left(31);
        }
        h
    }
}

fn combine(chunks: &[u64], len: u64) -> u64 {
    let mut h = len ^ 0x6a09_e667_f3bc_c908;
    for c in chunks {
        h = (h ^ c).wrapping_mul(0xc4ce_b9fe_1a85_ec53).rotate_left(27);
    }
    h
}

fn threads() -> usize {
    std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .min(16)
}

/// Runs `f(first_chunk_index, piece)` over `buf` cut into one chunk-aligned piece per thread.
fn for_pieces(buf: &mut [u8], f: impl Fn(usize, &mut [u8]) + Sync) {
    let chunks = buf.len().div_ceil(CHUNK).max(1);
    let per = chunks.div_ceil(threads());
    std::thread::scope(|s| {
        for (p, piece) in buf.chunks_mut(per * CHUNK).enumerate() {
            let f = &f;
            s.spawn(move || f(p * per, piece));
        }
    });
}

/// Fills `out[k] = f(k)` on every core.
fn hash_chunks(out: &mut [u64], f: impl Fn(usize) -> u64 + Sync) {
    let per = out.len().div_ceil(threads()).max(1);
    std::thread::scope(|s| {
        for (p, piece) in out.chunks_mut(per).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, o) in piece.iter_mut().enumerate() {
                    *o = f(p * per + j);
                }
            });
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filled_memory_hashes_as_the_seed_implies() {
        for len in [0usize, 5, 8, 4096 + 3, 3 * CHUNK + 17] {
            let mut buf = vec![0u8; len];
            fill(&mut buf, 42);
            assert_eq!(hash(&buf), expected_hash(42, len as u64), "len {len}");
            if len > 0 {
                buf[len / 2] ^= 1;
                assert_ne!(hash(&buf), expected_hash(42, len as u64), "len {len}");
            }
        }
    }

    #[test]
    fn a_region_filled_in_two_parts_is_the_whole() {
        let (head, len) = (CHUNK + 8 * 1000, 3 * CHUNK + 17);
        let mut buf = vec![0u8; len];
        fill(&mut buf[..head], 9);
        fill_at(&mut buf[head..], 9, (head / 8) as u64);
        assert_eq!(hash(&buf), expected_hash(9, len as u64));
    }

    #[test]
    fn a_seeded_region_before_zeros_hashes_as_expected() {
        for (filled, len) in [
            (0usize, 16usize),
            (8, 8),
            (4096, 3 * CHUNK + 5),
            (CHUNK + 3, 2 * CHUNK),
        ] {
            let mut buf = vec![0u8; len];
            fill(&mut buf[..filled], 5);
            assert_eq!(
                hash(&buf),
                expected_hash_filled(5, filled as u64, len as u64),
                "{filled} of {len}"
            );
        }
    }

    #[test]
    fn words_are_addressable() {
        let mut buf = vec![0u8; 3 * CHUNK];
        fill(&mut buf, 7);
        for i in [0u64, 1, 131_071, 131_072, 393_215] {
            assert_eq!(read_word(&buf, i), word(7, i));
        }
        assert_ne!(word(7, 0), word(8, 0));
    }
}
