//! Q5_0 matrices packed in tiles of 8 rows ([`QType::Q5_0R8`]): the
//! layout the batch-1 kernels stream, and the conversions to and from the
//! GGUF rows every other reader takes.
//!
//! A GGUF Q5_0 row is its blocks one after another (22 bytes each: f16
//! scale, 32 fifth bits, 16 nibble bytes), so the batch-1 kernel, which
//! computes 8 rows at once, reads 8 short streams and splices each row's
//! fifth bits into its vectors. Packed, rows `8t..8t + 8` (tile `t`) keep
//! their bytes in the same place in the matrix, `8 * row_bytes` from
//! `8t * row_bytes`, but ordered by block: block `b` of the tile's 8 rows
//! is 176 bytes at `b * 176`,
//!
//! - 16 bytes: the 8 rows' f16 scales, row 0 first;
//! - 32 bytes: the fifth bits as 4 little-endian u64 masks, one per 64
//!   values a kernel vector holds: rows 0..4's bits 0..16 (16 bits a row,
//!   row 0 lowest), rows 0..4's bits 16..32, then the same for rows 4..8;
//! - 128 bytes: the 8 rows' 16 nibble bytes, row 0 first.
//!
//! So a tile is one stream, and each mask loads as it stands. A matrix's
//! last `n % 8` rows stay GGUF rows. Invariant: packing and unpacking are
//! inverse permutations of the bytes (no value changes), so a packed
//! matrix computes every output's bits exactly as its GGUF rows do.
//!
//! A leaf: it imports only [`crate::qtype`].

use crate::qtype::{QType, QK};

/// Rows per packed tile.
pub const TILE: usize = 8;

/// Bytes of a block of one GGUF Q5_0 row.
pub const BLOCK: usize = 22;

/// Bytes of one block of a packed tile (8 rows' blocks).
pub const TILE_BLOCK: usize = TILE * BLOCK;

/// Offset in a tile block of the fifth-bit masks, and of the nibbles.
pub const MASKS_AT: usize = 2 * TILE;
pub const NIBBLES_AT: usize = MASKS_AT + 32;

/// The mask (0..4) and bit shift of row `c`'s fifth bits `half * 16..`.
fn mask_slot(c: usize, half: usize) -> (usize, usize) {
    (2 * (c / 4) + half, 16 * (c % 4))
}

/// Row `r` of a `Q5_0R8` matrix with rows of `k` values (`w`, all its
/// rows) as a GGUF Q5_0 row, into `out` (`k / 32 * 22` bytes).
pub fn row_into(w: &[u8], k: usize, r: usize, out: &mut [u8]) {
    let nb = k / QK;
    let rb = nb * BLOCK;
    assert_eq!(out.len(), rb, "a Q5_0 row of {k} values");
    if rb == 0 {
        return;
    }
    let n = w.len() / rb;
    assert!(
        r < n && w.len() == n * rb,
        "row {r} of {} bytes of rows of {rb}",
        w.len()
    );
    if r >= n / TILE * TILE {
        out.copy_from_slice(&w[r * rb..(r + 1) * rb]);
        return;
    }
    let (t, c) = (r / TILE, r % TILE);
    for b in 0..nb {
        let p = &w[t * TILE * rb + b * TILE_BLOCK..][..TILE_BLOCK];
        out[b * BLOCK..(b + 1) * BLOCK].copy_from_slice(&block(p, c));
    }
}

/// Row `c`'s GGUF Q5_0 block of the tile block `p` ([`TILE_BLOCK`] bytes).
#[inline]
pub fn block(p: &[u8], c: usize) -> [u8; BLOCK] {
    let mut o = [0u8; BLOCK];
    o[..2].copy_from_slice(&p[2 * c..2 * c + 2]);
    let (lo, shift) = mask_slot(c, 0);
    let mask =
        |m: usize| u64::from_le_bytes(p[MASKS_AT + 8 * m..][..8].try_into().expect("8 bytes"));
    let qh = ((mask(lo) >> shift) & 0xffff) | ((mask(lo + 1) >> shift) & 0xffff) << 16;
    o[2..6].copy_from_slice(&(qh as u32).to_le_bytes());
    o[6..].copy_from_slice(&p[NIBBLES_AT + 16 * c..][..16]);
    o
}

/// Packs the GGUF Q5_0 rows `src` (rows of `k` values) into `dst`, the
/// same number of bytes.
pub fn pack(src: &[u8], k: usize, dst: &mut [u8]) {
    let nb = k / QK;
    let rb = nb * BLOCK;
    if rb == 0 {
        return assert_eq!(src.len(), dst.len(), "rows of no values");
    }
    assert!(
        src.len() == dst.len() && src.len().is_multiple_of(rb),
        "{} bytes of Q5_0 rows of {rb} into {}",
        src.len(),
        dst.len()
    );
    let n = src.len() / rb;
    let tiles = n / TILE;
    for t in 0..tiles {
        let tile = &src[t * TILE * rb..(t + 1) * TILE * rb];
        for b in 0..nb {
            let blk = |c: usize| &tile[c * rb + b * BLOCK..][..BLOCK];
            let p = &mut dst[t * TILE * rb + b * TILE_BLOCK..][..TILE_BLOCK];
            let mut masks = [0u64; 4];
            for c in 0..TILE {
                let s = blk(c);
                p[2 * c..2 * c + 2].copy_from_slice(&s[..2]);
                p[NIBBLES_AT + 16 * c..][..16].copy_from_slice(&s[6..]);
                let qh = u32::from_le_bytes(s[2..6].try_into().expect("4 bytes"));
                for half in 0..2 {
                    let (m, shift) = mask_slot(c, half);
                    masks[m] |= u64::from((qh >> (16 * half)) & 0xffff) << shift;
                }
            }
            for (m, mask) in masks.iter().enumerate() {
                p[MASKS_AT + 8 * m..][..8].copy_from_slice(&mask.to_le_bytes());
            }
        }
    }
    dst[tiles * TILE * rb..].copy_from_slice(&src[tiles * TILE * rb..]);
}

/// The GGUF Q5_0 rows of the packed `src` (rows of `k` values) into `dst`.
pub fn unpack(src: &[u8], k: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "unpacking into another size");
    rows_into(src, k, 0, dst);
}

/// Rows `r0..` of the packed matrix `w` (rows of `k` values) as GGUF
/// Q5_0 rows, as many as `dst` holds.
pub fn rows_into(w: &[u8], k: usize, r0: usize, dst: &mut [u8]) {
    let nb = k / QK;
    let rb = nb * BLOCK;
    if rb == 0 {
        return;
    }
    let rows = dst.len() / rb;
    let tiled = (w.len() / rb) / TILE * TILE;
    let mut i = 0;
    while i < rows {
        let r = r0 + i;
        if r.is_multiple_of(TILE) && r + TILE <= tiled && i + TILE <= rows {
            let tile = &w[r * rb..(r + TILE) * rb];
            tile_into(tile, nb, &mut dst[i * rb..(i + TILE) * rb]);
            i += TILE;
        } else {
            row_into(w, k, r, &mut dst[i * rb..(i + 1) * rb]);
            i += 1;
        }
    }
}

/// One packed tile of `nb` blocks a row as its 8 GGUF rows.
fn tile_into(tile: &[u8], nb: usize, out: &mut [u8]) {
    let rb = nb * BLOCK;
    for (b, p) in tile.chunks_exact(TILE_BLOCK).enumerate() {
        for c in 0..TILE {
            out[c * rb + b * BLOCK..][..BLOCK].copy_from_slice(&block(p, c));
        }
    }
}

/// The bytes of `w` (a matrix of `ty`, rows of `k` values) as GGUF rows:
/// borrowed as they are, or unpacked into a copy.
pub fn gguf_rows(ty: QType, w: &[u8], k: usize) -> std::borrow::Cow<'_, [u8]> {
    if ty != QType::Q5_0R8 {
        return std::borrow::Cow::Borrowed(w);
    }
    let mut out = vec![0u8; w.len()];
    unpack(w, k, &mut out);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let mut s = seed;
        (0..len)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (s >> 56) as u8
            })
            .collect()
    }

    #[test]
    fn packing_round_trips_and_moves_every_byte_within_its_tile() {
        for (n, k) in [(8, 32), (16, 64), (13, 96), (3, 32), (24, 576)] {
            let rb = k / QK * BLOCK;
            let src = bytes(n as u64 * 1000 + k as u64, n * rb);
            let mut packed = vec![0u8; src.len()];
            pack(&src, k, &mut packed);
            let mut back = vec![0u8; src.len()];
            unpack(&packed, k, &mut back);
            assert_eq!(back, src, "n {n}, k {k}");
            for t in 0..n / TILE {
                let span = t * TILE * rb..(t + 1) * TILE * rb;
                let (mut a, mut b) = (src[span.clone()].to_vec(), packed[span].to_vec());
                a.sort_unstable();
                b.sort_unstable();
                // The nibble bytes and scales move as bytes; the fifth
                // bits are regrouped, so compare bit counts too.
                let ones = |v: &[u8]| v.iter().map(|x| x.count_ones()).sum::<u32>();
                assert_eq!(ones(&a), ones(&b), "tile {t}");
            }
            let tail = n / TILE * TILE * rb;
            assert_eq!(packed[tail..], src[tail..], "the last rows stay GGUF rows");
        }
    }

    #[test]
    fn a_packed_block_holds_its_rows_scales_masks_and_nibbles_where_the_kernels_read_them() {
        let (n, k) = (8, 64);
        let rb = k / QK * BLOCK;
        let src = bytes(7, n * rb);
        let mut p = vec![0u8; src.len()];
        pack(&src, k, &mut p);
        let b = 1;
        let blk = |c: usize| &src[c * rb + b * BLOCK..][..BLOCK];
        let at = b * TILE_BLOCK;
        for c in 0..TILE {
            assert_eq!(p[at + 2 * c..at + 2 * c + 2], blk(c)[..2]);
            assert_eq!(p[at + NIBBLES_AT + 16 * c..][..16], blk(c)[6..]);
            let qh = u32::from_le_bytes(blk(c)[2..6].try_into().unwrap());
            for i in 0..32 {
                // Value i of row c: mask (c / 4) * 2 + i / 16, bit (c % 4) * 16 + i % 16.
                let m = 2 * (c / 4) + i / 16;
                let mask = u64::from_le_bytes(p[at + MASKS_AT + 8 * m..][..8].try_into().unwrap());
                let bit = (mask >> ((c % 4) * 16 + i % 16)) & 1;
                assert_eq!(bit, u64::from((qh >> i) & 1), "row {c} value {i}");
            }
        }
    }
}
