//! Reading the weight blocks of each format: scales, minimums and values,
//! as the kernels of every flavour take them.

use crate::qtype::{QType, QK};

/// Exact f16 -> f32 by bit manipulation (normal, subnormal, infinite and NaN
/// values), so no F16C instruction is needed. Subnormals rely on the default
/// floating-point environment (no flush to zero).
#[inline(always)]
pub(super) fn f16_to_f32(h: u16) -> f32 {
    let em = (h as u32 & 0x7fff) << 13;
    let sign = (h as u32 & 0x8000) << 16;
    let bits = if em >= 0x7c00 << 13 {
        em | 0x7f80_0000
    } else {
        // 2^112 moves the exponent bias from 15 to 127, exactly.
        (f32::from_bits(em) * f32::from_bits((127 + 112) << 23)).to_bits()
    };
    f32::from_bits(bits | sign)
}

/// The little-endian f16 at `p`, exactly.
///
/// # Safety
/// `p` points at 2 readable bytes.
#[inline(always)]
pub(super) unsafe fn f16_at(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees 2 readable bytes at `p`.
    f16_to_f32(u16::from_le_bytes(unsafe { [*p, *p.add(1)] }))
}

/// The little-endian f16 at byte `i` of `blk`, exactly ([`f16_at`] on a
/// slice, bounds checked).
#[inline(always)]
pub(super) fn f16_in(blk: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([blk[i], blk[i + 1]]))
}

/// Value `i` (0..32) of an unsigned-format block.
pub(super) fn unsigned_value(ty: QType, blk: &[u8], i: usize) -> u8 {
    let byte = blk[ty.nibbles_at() + i % 16];
    let mut v = if i < 16 { byte & 0x0f } else { byte >> 4 };
    if let Some(h) = ty.high_bits_at() {
        let bits = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
        v |= (((bits >> i) & 1) as u8) << 4;
    }
    v
}

/// `mw` of an unsigned-format block: `x = d*q + mw`.
pub(super) fn min_of(ty: QType, blk: &[u8]) -> f32 {
    if ty.stored_min() {
        f16_in(blk, 2)
    } else {
        ty.min_factor() * f16_in(blk, 0)
    }
}

/// Block `b` (32 values) of a super-block-format row: its scale and
/// minimum (`x = dw*q + mw`: `dw = d*sc`, `mw = -dmin*m`, both exact in f32)
/// and where its super-block starts.
///
/// # Safety
/// `row` points at a readable row of `ty` (Q4_K or Q5_K) that holds
/// super-block `b / 8`: at least `(b / 8 + 1) * ty.block_bytes()` bytes.
pub(super) unsafe fn super_params(ty: QType, row: *const u8, b: usize) -> (f32, f32, *const u8) {
    // SAFETY: the caller guarantees that the row holds super-block `b / 8`,
    // so its start is inside the row.
    let blk = unsafe { row.add(b / 8 * ty.block_bytes()) };
    // SAFETY: bytes 0..16 of the super-block (144 or 176 bytes) are its
    // `d`, `dmin` and 12 bytes of scales; `[u8; 16]` has alignment 1.
    let (dw, mw) = k_params(unsafe { &*(blk as *const [u8; 16]) }, b % 8);
    (dw, mw, blk)
}

/// Block `j` (0..8) of a Q4_K/Q5_K super-block whose first 16 bytes
/// (`d`, `dmin`, the 12 bytes of 6-bit scales and minimums) are `head`:
/// `(dw, mw)` as [`super_params`] gives them.
pub(super) fn k_params(head: &[u8; 16], j: usize) -> (f32, f32) {
    let scales: &[u8; 12] = head[4..].try_into().expect("12 bytes");
    let (sc, m) = crate::gguf::k_scale_min(scales, j);
    let (d, dmin) = (f16_in(head, 0), f16_in(head, 2));
    (d * sc as f32, -(dmin * m as f32))
}

/// Value `i` (0..32) of block `j` (0..8) of a Q4_K/Q5_K super-block.
pub(super) fn super_value(ty: QType, blk: &[u8], j: usize, i: usize) -> u8 {
    crate::gguf::k45_value(blk, ty == QType::Q5_K, j, i)
}

/// Block `b` (32 values) of a Q6_K row: `d`, the i8 scales of its two
/// halves of 16 values, and its super-block.
///
/// # Safety
/// `row` points at a readable Q6_K row that holds super-block `b / 8`: at
/// least `(b / 8 + 1) * 210` bytes.
pub(super) unsafe fn q6_params(row: *const u8, b: usize) -> (f32, [i32; 2], *const u8) {
    // SAFETY: the caller guarantees that the row holds super-block `b / 8`,
    // so its start is inside the row.
    let blk = unsafe { row.add(b / 8 * QType::Q6_K.block_bytes()) };
    let (h, g) = ((b % 8) / 4, b % 4);
    // SAFETY: the scales are bytes 192..208 of the 210-byte super-block,
    // and `h * 8 + 2 * g + i < 16`.
    let sc = |i: usize| unsafe { *blk.add(192 + h * 8 + 2 * g + i) } as i8 as i32;
    // SAFETY: `d` is the super-block's last 2 bytes, 208..210.
    (unsafe { f16_at(blk.add(208)) }, [sc(0), sc(1)], blk)
}

/// Value `i` (0..32, unsigned: the weight is `q - 32`) of block `j` (0..8)
/// of a Q6_K super-block.
pub(super) fn q6_value(blk: &[u8], j: usize, i: usize) -> u8 {
    crate::gguf::k6_value(blk, j * QK + i)
}
