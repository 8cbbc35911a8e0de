//! The 32-value unsigned formats (Q4_0, Q4_1, Q5_0, Q5_1) packed in tiles
//! of 8 rows ([`QType::Q5_0R8`] and the other `R8`s): the layout the
//! batch-1 kernels stream, and the conversions to and from the GGUF rows
//! every other reader takes.
//!
//! A GGUF row is its blocks one after another (f16 scale, Q4_1's and
//! Q5_1's f16 minimum, Q5's 32 fifth bits, 16 nibble bytes), so the batch-1
//! kernel, which computes 8 rows at once, reads 8 short streams, gathers
//! the 8 rows' scales a word at a time, and (Q5) splices each row's fifth
//! bits into its vectors. Packed, rows `8t..8t + 8` (tile `t`) keep their
//! bytes in the same place in the matrix, `8 * row_bytes` from `8t *
//! row_bytes`, but ordered by block: block `b` of the tile's 8 rows is `8 *
//! block_bytes` bytes at `b * 8 * block_bytes`,
//!
//! - 16 bytes: the 8 rows' f16 scales, row 0 first;
//! - Q4_1, Q5_1: 16 bytes, the 8 rows' f16 minimums;
//! - Q5_0, Q5_1: 32 bytes, the fifth bits as 4 little-endian u64 masks,
//!   one per 64 values a kernel vector holds: rows 0..4's bits 0..16 (16
//!   bits a row, row 0 lowest), rows 0..4's bits 16..32, then the same for
//!   rows 4..8;
//! - 128 bytes: the 8 rows' 16 nibble bytes, row 0 first.
//!
//! So a tile is one stream, the scales one load, and each mask loads as it
//! stands.
//!
//! Q4_K ([`QType::Q4_KR8`]) packs a tile's 8 rows by super-block (256
//! values, `8 * 144` bytes):
//!
//! - 16 bytes: the 8 rows' f16 `d`, then 16 bytes: their f16 `dmin`;
//! - 96 bytes: the rows' 12 bytes of 6-bit scales and minimums as three
//!   little-endian words each, word `w` of row `c` at `32 w + 4 c` (a
//!   word of the 8 rows one 256-bit load);
//! - per block of 32 values, 128 bytes: the 8 rows' 16 nibble bytes, value
//!   `i < 16` low and `i + 16` high, as the 32-value formats keep theirs
//!   (a GGUF Q4_K row pairs value `i` of block `2j` with value `i` of block
//!   `2j + 1` in a byte: the nibbles move between bytes, none changes).
//!
//! A matrix's last `n % 8` rows stay GGUF rows. Invariant: packing and
//! unpacking are inverse permutations of the values and scales (no value
//! changes), so a packed matrix computes every output's bits exactly as
//! its GGUF rows do.
//!
//! Near a leaf: it imports only [`crate::qtype`] and the GGUF reader's
//! Q4_K value decoding (`gguf::k45_value`).

use crate::gguf::k45_value;
use crate::qtype::QType;

/// Rows per packed tile.
pub const TILE: usize = 8;

/// Offset in a tile block of `ty` of the 8 rows' f16 minimums (Q4_1, Q5_1).
pub fn mins_at(ty: QType) -> Option<usize> {
    ty.stored_min().then_some(2 * TILE)
}

/// Offset in a tile block of `ty` of the fifth-bit masks (Q5_0, Q5_1).
pub fn masks_at(ty: QType) -> Option<usize> {
    ty.gguf()
        .high_bits_at()
        .map(|_| 2 * TILE + mins_at(ty).map_or(0, |_| 2 * TILE))
}

/// Bytes of one block of a tile of the packed format `ty` (8 rows' blocks).
pub fn tile_block(ty: QType) -> usize {
    TILE * ty.block_bytes()
}

/// Offset in a tile block of `ty` of the 8 rows' nibbles (Q4_K: of its
/// first block's, the others following [`Q4K_BLOCK`] apart).
pub fn nibbles_at(ty: QType) -> usize {
    match ty {
        QType::Q4_KR8 => Q4K_NIBBLES,
        _ => tile_block(ty) - 16 * TILE,
    }
}

/// Offset in a Q4_K tile super-block of the 8 rows' f16 `dmin`.
pub const Q4K_DMIN: usize = 2 * TILE;
/// Offset in a Q4_K tile super-block of the scale words.
pub const Q4K_SCALES: usize = 4 * TILE;
/// Offset in a Q4_K tile super-block of block 0's nibbles.
pub const Q4K_NIBBLES: usize = Q4K_SCALES + 12 * TILE;
/// Bytes of one block's nibbles in a Q4_K tile super-block.
pub const Q4K_BLOCK: usize = 16 * TILE;

/// The mask (0..4) and bit shift of Q5_0 row `c`'s fifth bits `half * 16..`.
fn mask_slot(c: usize, half: usize) -> (usize, usize) {
    (2 * (c / 4) + half, 16 * (c % 4))
}

/// Whether `ty` is one this module packs, and its GGUF format's block bytes.
fn gguf_block(ty: QType) -> usize {
    assert!(ty.packed(), "{ty:?} is not a packed format");
    ty.block_bytes()
}

/// Row `c`'s 32 fifth bits (bit `i` value `i`'s) of a tile block `p`
/// whose masks start at `at` ([`masks_at`]).
#[inline]
pub fn fifth_bits(p: &[u8], at: usize, c: usize) -> u32 {
    let (lo, shift) = mask_slot(c, 0);
    let mask = |m: usize| u64::from_le_bytes(p[at + 8 * m..][..8].try_into().expect("8 bytes"));
    (((mask(lo) >> shift) & 0xffff) | ((mask(lo + 1) >> shift) & 0xffff) << 16) as u32
}

/// Row `c`'s GGUF block of the tile block `p` of `ty`, into `out`.
#[inline]
pub fn block_into(ty: QType, p: &[u8], c: usize, out: &mut [u8]) {
    if ty == QType::Q4_KR8 {
        return q4k_block_into(p, c, out);
    }
    let bb = out.len();
    out[..2].copy_from_slice(&p[2 * c..2 * c + 2]);
    if let Some(at) = mins_at(ty) {
        out[2..4].copy_from_slice(&p[at + 2 * c..][..2]);
    }
    if let (Some(at), Some(h)) = (masks_at(ty), ty.gguf().high_bits_at()) {
        out[h..h + 4].copy_from_slice(&fifth_bits(p, at, c).to_le_bytes());
    }
    out[bb - 16..].copy_from_slice(&p[nibbles_at(ty) + 16 * c..][..16]);
}

/// Row `r` of a packed matrix of `ty` with rows of `k` values (`w`, all
/// its rows) as a GGUF row, into `out` (`ty.row_bytes(k)` bytes).
pub fn row_into(ty: QType, w: &[u8], k: usize, r: usize, out: &mut [u8]) {
    let (bb, nb) = (gguf_block(ty), k / ty.block_values());
    let rb = nb * bb;
    assert_eq!(out.len(), rb, "a {ty:?} row of {k} values");
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
    let (t, c, tb) = (r / TILE, r % TILE, tile_block(ty));
    for b in 0..nb {
        let p = &w[t * TILE * rb + b * tb..][..tb];
        block_into(ty, p, c, &mut out[b * bb..(b + 1) * bb]);
    }
}

/// Packs the GGUF rows `src` (rows of `k` values) of `ty`'s format into
/// `dst`, the same number of bytes, as `ty` lays them out.
pub fn pack(ty: QType, src: &[u8], k: usize, dst: &mut [u8]) {
    let (bb, nb, tb) = (gguf_block(ty), k / ty.block_values(), tile_block(ty));
    let rb = nb * bb;
    if rb == 0 {
        return assert_eq!(src.len(), dst.len(), "rows of no values");
    }
    assert!(
        src.len() == dst.len() && src.len().is_multiple_of(rb),
        "{} bytes of {ty:?} rows of {rb} into {}",
        src.len(),
        dst.len()
    );
    let tiles = src.len() / rb / TILE;
    for t in 0..tiles {
        let tile = &src[t * TILE * rb..(t + 1) * TILE * rb];
        for b in 0..nb {
            let blk = |c: usize| &tile[c * rb + b * bb..][..bb];
            pack_block(ty, blk, &mut dst[t * TILE * rb + b * tb..][..tb]);
        }
    }
    dst[tiles * TILE * rb..].copy_from_slice(&src[tiles * TILE * rb..]);
}

/// The tile block `p` of `ty` from its 8 rows' GGUF blocks (`blk(c)`: row
/// `c`'s).
fn pack_block<'a>(ty: QType, blk: impl Fn(usize) -> &'a [u8], p: &mut [u8]) {
    if ty == QType::Q4_KR8 {
        return q4k_pack(blk, p);
    }
    let (bb, nib) = (ty.block_bytes(), nibbles_at(ty));
    let mut masks = [0u64; 4];
    for c in 0..TILE {
        let s = blk(c);
        p[2 * c..2 * c + 2].copy_from_slice(&s[..2]);
        p[nib + 16 * c..][..16].copy_from_slice(&s[bb - 16..]);
        if let Some(at) = mins_at(ty) {
            p[at + 2 * c..][..2].copy_from_slice(&s[2..4]);
        }
        if let Some(h) = ty.gguf().high_bits_at() {
            let qh = u32::from_le_bytes(s[h..h + 4].try_into().expect("4 bytes"));
            for half in 0..2 {
                let (m, shift) = mask_slot(c, half);
                masks[m] |= u64::from((qh >> (16 * half)) & 0xffff) << shift;
            }
        }
    }
    if let Some(at) = masks_at(ty) {
        for (m, mask) in masks.iter().enumerate() {
            p[at + 8 * m..][..8].copy_from_slice(&mask.to_le_bytes());
        }
    }
}

/// [`pack_block`] for Q4_K: a tile super-block from 8 rows' super-blocks.
fn q4k_pack<'a>(blk: impl Fn(usize) -> &'a [u8], p: &mut [u8]) {
    for c in 0..TILE {
        let s = blk(c);
        p[2 * c..2 * c + 2].copy_from_slice(&s[..2]);
        p[Q4K_DMIN + 2 * c..][..2].copy_from_slice(&s[2..4]);
        for w in 0..3 {
            p[Q4K_SCALES + 32 * w + 4 * c..][..4].copy_from_slice(&s[4 + 4 * w..8 + 4 * w]);
        }
        for j in 0..8 {
            let out = &mut p[Q4K_NIBBLES + Q4K_BLOCK * j + 16 * c..][..16];
            for (i, o) in out.iter_mut().enumerate() {
                *o = k45_value(s, false, j, i) | k45_value(s, false, j, i + 16) << 4;
            }
        }
    }
}

/// Row `c`'s GGUF Q4_K super-block header (f16 `d`, f16 `dmin`, 12 bytes
/// of scales and minimums) of the tile super-block `p`, into `out`.
pub fn q4k_header_into(p: &[u8], c: usize, out: &mut [u8; 16]) {
    out[..2].copy_from_slice(&p[2 * c..2 * c + 2]);
    out[2..4].copy_from_slice(&p[Q4K_DMIN + 2 * c..][..2]);
    for w in 0..3 {
        out[4 + 4 * w..8 + 4 * w].copy_from_slice(&p[Q4K_SCALES + 32 * w + 4 * c..][..4]);
    }
}

/// [`block_into`] for Q4_K: row `c`'s GGUF super-block of the tile
/// super-block `p`.
fn q4k_block_into(p: &[u8], c: usize, out: &mut [u8]) {
    let mut hdr = [0u8; 16];
    q4k_header_into(p, c, &mut hdr);
    out[..16].copy_from_slice(&hdr);
    for j in 0..8 {
        let nib = &p[Q4K_NIBBLES + Q4K_BLOCK * j + 16 * c..][..16];
        let shift = if j.is_multiple_of(2) { 0 } else { 4 };
        let keep = if j.is_multiple_of(2) { 0xf0 } else { 0x0f };
        let qs = &mut out[16 + 32 * (j / 2)..][..32];
        for (i, &b) in nib.iter().enumerate() {
            qs[i] = (qs[i] & keep) | (b & 0x0f) << shift;
            qs[i + 16] = (qs[i + 16] & keep) | (b >> 4) << shift;
        }
    }
}

/// [`pack`] of the GGUF rows `buf` holds, in place (through a copy).
pub fn pack_in_place(ty: QType, buf: &mut [u8], k: usize) {
    let rows = buf.to_vec();
    pack(ty, &rows, k, buf);
}

/// The GGUF rows of the packed `src` of `ty` (rows of `k` values) into
/// `dst`.
pub fn unpack(ty: QType, src: &[u8], k: usize, dst: &mut [u8]) {
    assert_eq!(src.len(), dst.len(), "unpacking into another size");
    rows_into(ty, src, k, 0, dst);
}

/// Rows `r0..` of the packed matrix `w` of `ty` (rows of `k` values) as
/// GGUF rows, as many as `dst` holds.
pub fn rows_into(ty: QType, w: &[u8], k: usize, r0: usize, dst: &mut [u8]) {
    let (bb, nb) = (gguf_block(ty), k / ty.block_values());
    let rb = nb * bb;
    if rb == 0 {
        return;
    }
    let rows = dst.len() / rb;
    let tiled = (w.len() / rb) / TILE * TILE;
    let tb = tile_block(ty);
    let mut i = 0;
    while i < rows {
        let r = r0 + i;
        if r.is_multiple_of(TILE) && r + TILE <= tiled && i + TILE <= rows {
            // A whole tile: each tile block read once for its 8 rows.
            let tile = &w[r * rb..(r + TILE) * rb];
            let out = &mut dst[i * rb..(i + TILE) * rb];
            for (b, p) in tile.chunks_exact(tb).enumerate() {
                for c in 0..TILE {
                    block_into(ty, p, c, &mut out[c * rb + b * bb..][..bb]);
                }
            }
            i += TILE;
        } else {
            row_into(ty, w, k, r, &mut dst[i * rb..(i + 1) * rb]);
            i += 1;
        }
    }
}

/// The bytes of `w` (a matrix of `ty`, rows of `k` values) as GGUF rows:
/// borrowed as they are, or unpacked into a copy.
pub fn gguf_rows(ty: QType, w: &[u8], k: usize) -> std::borrow::Cow<'_, [u8]> {
    if !ty.packed() {
        return std::borrow::Cow::Borrowed(w);
    }
    let mut out = vec![0u8; w.len()];
    unpack(ty, w, k, &mut out);
    std::borrow::Cow::Owned(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Any bytes: the low bits of the kernels' test floats.
    fn bytes(seed: u64, len: usize) -> Vec<u8> {
        let x = crate::kernels::tests::rand_vec(seed, len);
        x.iter()
            .map(|v| (v.to_bits() ^ (v.to_bits() >> 11)) as u8)
            .collect()
    }

    const PACKED: [QType; 5] = [
        QType::Q5_0R8,
        QType::Q4_1R8,
        QType::Q4_0R8,
        QType::Q5_1R8,
        QType::Q4_KR8,
    ];

    #[test]
    fn packing_round_trips_and_keeps_every_tile_in_its_place() {
        for ty in PACKED {
            for (n, k) in [(8, 32), (16, 64), (13, 96), (3, 32), (24, 576)] {
                // Super-blocks: 256 values each.
                let k = k / 32 * ty.block_values();
                let rb = ty.row_bytes(k);
                let src = bytes(n as u64 * 1000 + k as u64, n * rb);
                let mut packed = vec![0u8; src.len()];
                pack(ty, &src, k, &mut packed);
                let mut back = vec![0u8; src.len()];
                unpack(ty, &packed, k, &mut back);
                assert_eq!(back, src, "{ty:?} n {n}, k {k}");
                for t in 0..n / TILE {
                    // The same bits (Q5_0's fifth bits regrouped, Q4_K's
                    // nibbles: the same number of ones) within the tile's
                    // own span.
                    let span = t * TILE * rb..(t + 1) * TILE * rb;
                    let ones = |v: &[u8]| v.iter().map(|x| x.count_ones()).sum::<u32>();
                    assert_eq!(ones(&src[span.clone()]), ones(&packed[span]), "tile {t}");
                }
                let tail = n / TILE * TILE * rb;
                assert_eq!(packed[tail..], src[tail..], "the last rows stay GGUF rows");
                for r in 0..n {
                    let mut row = vec![0u8; rb];
                    row_into(ty, &packed, k, r, &mut row);
                    assert_eq!(row, src[r * rb..(r + 1) * rb], "{ty:?} row {r}");
                }
            }
        }
    }

    #[test]
    fn a_packed_block_holds_its_rows_fields_where_the_kernels_read_them() {
        let (n, k, b) = (8, 64, 1);
        for ty in PACKED.into_iter().filter(|&ty| ty != QType::Q4_KR8) {
            let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
            let src = bytes(7, n * rb);
            let mut p = vec![0u8; src.len()];
            pack(ty, &src, k, &mut p);
            let blk = |c: usize| &src[c * rb + b * bb..][..bb];
            let at = b * tile_block(ty);
            for c in 0..TILE {
                assert_eq!(p[at + 2 * c..at + 2 * c + 2], blk(c)[..2]);
                assert_eq!(p[at + nibbles_at(ty) + 16 * c..][..16], blk(c)[bb - 16..]);
                if let Some(m) = mins_at(ty) {
                    assert_eq!(p[at + m + 2 * c..][..2], blk(c)[2..4]);
                }
                let (Some(masks), Some(h)) = (masks_at(ty), ty.gguf().high_bits_at()) else {
                    continue;
                };
                let qh = u32::from_le_bytes(blk(c)[h..h + 4].try_into().unwrap());
                for i in 0..32 {
                    // Value i of row c: mask (c / 4) * 2 + i / 16, bit (c % 4) * 16 + i % 16.
                    let m = 2 * (c / 4) + i / 16;
                    let mask = u64::from_le_bytes(p[at + masks + 8 * m..][..8].try_into().unwrap());
                    let bit = (mask >> ((c % 4) * 16 + i % 16)) & 1;
                    assert_eq!(bit, u64::from((qh >> i) & 1), "row {c} value {i}");
                }
            }
        }
    }

    #[test]
    fn a_packed_q4_k_super_block_holds_its_rows_fields_where_the_kernels_read_them() {
        let (n, k, sb) = (8, 512, 1);
        let ty = QType::Q4_KR8;
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        let src = bytes(9, n * rb);
        let mut p = vec![0u8; src.len()];
        pack(ty, &src, k, &mut p);
        let at = sb * tile_block(ty);
        for c in 0..TILE {
            let s = &src[c * rb + sb * bb..][..bb];
            assert_eq!(p[at + 2 * c..][..2], s[..2], "d of row {c}");
            assert_eq!(p[at + Q4K_DMIN + 2 * c..][..2], s[2..4], "dmin of row {c}");
            for w in 0..3 {
                let word = &p[at + Q4K_SCALES + 32 * w + 4 * c..][..4];
                assert_eq!(word, &s[4 + 4 * w..8 + 4 * w], "scale word {w} of row {c}");
            }
            for j in 0..8 {
                for i in 0..32 {
                    // GGUF: value i of block j is a nibble of byte 16 + 32 (j / 2) + i.
                    let byte = s[16 + 32 * (j / 2) + i];
                    let want = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                    let nib = p[at + Q4K_NIBBLES + Q4K_BLOCK * j + 16 * c + i % 16];
                    let got = if i < 16 { nib & 15 } else { nib >> 4 };
                    assert_eq!(got, want, "row {c} block {j} value {i}");
                }
            }
        }
    }
}
