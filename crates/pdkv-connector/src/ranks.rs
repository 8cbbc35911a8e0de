//! KV caches split over tensor-parallel ranks, as transfers see them.
//!
//! An engine's KV cache is one registration per rank; every rank has the
//! same block ids, and block `b` of a rank holding `n` KV heads is the
//! range `b * n * head_bytes` of its registration, head-major, so the whole
//! model's block is the ranks' blocks one after the other. Two engines of
//! the same model agree on `head_bytes` (their layouts are checked equal)
//! but may split the heads differently: a block then moves as one copy per
//! pair of ranks whose heads overlap — P TP2 → D TP2 one per rank, P TP2 →
//! D TP1 two into each D block, P TP1 → D TP2 one from each half of P's.

use std::ops::Range;

use pdkv_transfer::Registration;
use serde::{Deserialize, Serialize};

/// One rank's KV cache registration, as a peer addresses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RankReg {
    /// The KV heads `[first, end)` its blocks hold.
    pub heads: (usize, usize),
    pub reg: Registration,
}

impl RankReg {
    pub fn heads(&self) -> Range<usize> {
        self.heads.0..self.heads.1
    }
}

/// One contiguous copy of a block transfer: `len` bytes at `local_offset`
/// of this engine's rank `local` to or from `remote_offset` of the peer's
/// rank `remote`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Copy {
    pub local: usize,
    pub remote: usize,
    pub local_offset: u64,
    pub remote_offset: u64,
    pub len: u64,
}

/// Why a split of KV heads over ranks was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HeadsError {
    /// A rank with a gap or an overlap before it, or no heads.
    #[error(
        "rank {rank} holds KV heads {heads:?}; the ranks must hold 0..{num_kv_heads} in order, each at least one"
    )]
    OutOfOrder {
        rank: usize,
        heads: Range<usize>,
        num_kv_heads: usize,
    },
    /// The ranks end short of (or past) the model's heads, or there are none.
    #[error("the ranks hold KV heads 0..{held}; the model has {num_kv_heads}")]
    NotAll { held: usize, num_kv_heads: usize },
}

/// Whether `ranks` (head ranges in rank order) cover `0..num_kv_heads`
/// without gap, overlap or an empty rank.
pub fn check_heads(ranks: &[Range<usize>], num_kv_heads: usize) -> Result<(), HeadsError> {
    let mut next = 0;
    for (i, h) in ranks.iter().enumerate() {
        if h.start != next || h.end <= h.start {
            return Err(HeadsError::OutOfOrder {
                rank: i,
                heads: h.clone(),
                num_kv_heads,
            });
        }
        next = h.end;
    }
    if next != num_kv_heads || ranks.is_empty() {
        return Err(HeadsError::NotAll {
            held: next,
            num_kv_heads,
        });
    }
    Ok(())
}

/// The copies that move whole blocks `pairs` (local block id, remote block
/// id) between a local split `local` and a remote split `remote` of the same
/// heads: for each pair of blocks, for each pair of ranks whose heads
/// overlap, in rank order. Both splits must pass [`check_heads`].
pub fn copies(
    local: &[Range<usize>],
    remote: &[Range<usize>],
    head_bytes: u64,
    pairs: &[(u32, u32)],
) -> Vec<Copy> {
    let mut pieces = Vec::new();
    for (l, lh) in local.iter().enumerate() {
        for (r, rh) in remote.iter().enumerate() {
            let (h0, h1) = (lh.start.max(rh.start), lh.end.min(rh.end));
            if h0 < h1 {
                pieces.push((l, r, h0, h1));
            }
        }
    }
    let mut out = Vec::with_capacity(pairs.len() * pieces.len());
    for &(lb, rb) in pairs {
        for &(l, r, h0, h1) in &pieces {
            let lbb = local[l].len() as u64 * head_bytes;
            let rbb = remote[r].len() as u64 * head_bytes;
            out.push(Copy {
                local: l,
                remote: r,
                local_offset: lb as u64 * lbb + (h0 - local[l].start) as u64 * head_bytes,
                remote_offset: rb as u64 * rbb + (h0 - remote[r].start) as u64 * head_bytes,
                len: (h1 - h0) as u64 * head_bytes,
            });
        }
    }
    out
}

/// The byte ranges of blocks `blocks` in a rank's registration whose block
/// is `rank_block_bytes` long (a grant's ranges).
pub fn block_ranges(blocks: &[u32], rank_block_bytes: u64) -> Vec<(u64, u64)> {
    blocks
        .iter()
        .map(|&b| (b as u64 * rank_block_bytes, rank_block_bytes))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Applies `copies` from `src` (ranks' regions) into `dst`, byte by byte.
    fn apply(cs: &[Copy], src: &[Vec<u8>], dst: &mut [Vec<u8>]) {
        for c in cs {
            let (s, d, n) = (
                c.local_offset as usize,
                c.remote_offset as usize,
                c.len as usize,
            );
            dst[c.remote][d..d + n].copy_from_slice(&src[c.local][s..s + n]);
        }
    }

    /// The whole model's blocks `ids` of a split: the ranks' blocks one
    /// after the other.
    fn whole(split: &[Range<usize>], regions: &[Vec<u8>], hb: usize, ids: &[u32]) -> Vec<u8> {
        let mut out = Vec::new();
        for &b in ids {
            for (r, h) in split.iter().enumerate() {
                let bb = h.len() * hb;
                out.extend_from_slice(&regions[r][b as usize * bb..(b as usize + 1) * bb]);
            }
        }
        out
    }

    #[test]
    fn every_split_moves_every_head_of_every_block_to_its_place() {
        let (heads, hb, blocks) = (6usize, 8usize, 5usize);
        let one_rank: Vec<Range<usize>> = std::iter::once(0..6).collect();
        let splits: Vec<Vec<Range<usize>>> = vec![
            one_rank,
            vec![0..3, 3..6],
            vec![0..4, 4..6],
            vec![0..2, 2..4, 4..6],
            vec![0..1, 1..2, 2..3, 3..4, 4..5, 5..6],
        ];
        for a in &splits {
            for b in &splits {
                check_heads(a, heads).unwrap();
                let src: Vec<Vec<u8>> = a
                    .iter()
                    .enumerate()
                    .map(|(r, h)| {
                        (0..blocks * h.len() * hb)
                            .map(|i| (r * 97 + i * 7 + 1) as u8)
                            .collect()
                    })
                    .collect();
                let mut dst: Vec<Vec<u8>> =
                    b.iter().map(|h| vec![0u8; blocks * h.len() * hb]).collect();
                let pairs = [(3u32, 0u32), (0, 4), (4, 2)];
                let cs = copies(a, b, hb as u64, &pairs);
                let pieces = a
                    .iter()
                    .flat_map(|x| b.iter().filter(|y| x.start < y.end && y.start < x.end))
                    .count();
                assert_eq!(cs.len(), pairs.len() * pieces);
                apply(&cs, &src, &mut dst);
                assert_eq!(
                    whole(b, &dst, hb, &[0, 4, 2]),
                    whole(a, &src, hb, &[3, 0, 4]),
                    "{a:?} -> {b:?}"
                );
                // Blocks no pair names stay untouched.
                assert!(whole(b, &dst, hb, &[1, 3]).iter().all(|&x| x == 0));
            }
        }
    }

    #[test]
    fn a_split_with_a_gap_an_overlap_or_missing_heads_is_refused() {
        assert!(check_heads(&[0..2, 3..4], 4).is_err());
        assert!(check_heads(&[0..2, 1..4], 4).is_err());
        assert!(check_heads(&[0..2, 2..3], 4).is_err());
        assert!(check_heads(&[0..2, 2..2, 2..4], 4).is_err());
        assert!(check_heads(&[], 4).is_err());
        let whole_but_one: Vec<Range<usize>> = std::iter::once(0..3).collect();
        let e = check_heads(&whole_but_one, 4).unwrap_err().to_string();
        assert!(e.contains("the model has 4"), "{e}");
        check_heads(&[0..1, 1..4], 4).unwrap();
    }
}
