//! The GGUF-style block quantiser: f32 rows into any block format the
//! kernels read ([`QType`]), as a GGUF writer lays them out.
//!
//! One conversion for every writer of blocks: synthetic models
//! ([`crate::bench`]), a Hugging Face checkpoint loaded or reloaded into a
//! model served in a block format ([`crate::loader`]), and the tests.
//! Deterministic: the same values give the same bytes.

use half::{bf16, f16};
use rayon::prelude::*;

use crate::qtype::QType;

/// Writes a matrix of rows of `cols` values into `dst` in the block format
/// `q`: row `r`'s values come from `row(r, buf)` (which fills `buf`, `cols`
/// long) and are quantised by [`quantize_row`]. Rows are converted on the
/// math threads, each row on its own, so the bytes do not depend on the
/// number of threads.
///
/// `cols` must be a whole number of `q`'s blocks and `dst` whole rows.
/// A packed format's rows are quantised as its GGUF rows, then packed.
pub fn quantize_rows(
    q: QType,
    cols: usize,
    dst: &mut [u8],
    row: &(dyn Fn(usize, &mut [f32]) + Sync),
) {
    if q.packed() {
        quantize_rows(q.gguf(), cols, dst, row);
        return crate::packed::pack_in_place(q, dst, cols);
    }
    assert!(
        cols > 0 && cols.is_multiple_of(q.block_values()),
        "rows of {cols} values are not whole {q:?} blocks"
    );
    let rb = q.row_bytes(cols);
    assert_eq!(dst.len() % rb, 0, "{} bytes are not whole rows", dst.len());
    crate::dispatch::thread_pool().install(|| {
        dst.par_chunks_mut(rb).enumerate().for_each_init(
            || vec![0f32; cols],
            |buf, (r, out)| {
                row(r, buf);
                quantize_row(q, buf, out);
            },
        );
    });
}

/// 32 values of 4 (or, `five`, 5) bits into a block's tail: the 32 fifth
/// bits first (little-endian u32) when `five`, then the nibbles (value
/// `i < 16` low in byte `i`, value `i + 16` high).
fn pack_nibbles(q: &[u8], five: bool, out: &mut [u8]) {
    let mut at = 0;
    if five {
        let bits = q
            .iter()
            .enumerate()
            .fold(0u32, |b, (i, &v)| b | (((v >> 4) & 1) as u32) << i);
        out[..4].copy_from_slice(&bits.to_le_bytes());
        at = 4;
    }
    for i in 0..16 {
        out[at + i] = (q[i] & 0x0f) | (q[i + 16] & 0x0f) << 4;
    }
}

/// Writes `values` (whole blocks of [`QType::block_values`])
/// in the block format `q`, as a GGUF writer does (Q4_K/Q5_K: see
/// [`quantize_super`]; Q6_K: [`quantize_q6`]): Q8_0 `d = max|x|/127`; Q4_0/Q5_0 `d = max/-8` (`-16`)
/// with `max` the value of largest magnitude; Q4_1/Q5_1 `d = (max-min)/15`
/// (`31`), `m = min`. A packed format is quantised a matrix at a time
/// ([`quantize_rows`]): not here.
pub fn quantize_row(q: QType, values: &[f32], out: &mut [u8]) {
    assert!(
        !q.packed(),
        "{q:?} rows are packed a tile at a time (quantize_rows)"
    );
    let bb = q.block_bytes();
    for (x, o) in values.chunks(q.block_values()).zip(out.chunks_mut(bb)) {
        match q {
            QType::Q4_K | QType::Q5_K => quantize_super(q == QType::Q5_K, x, o),
            QType::Q5_0R8 | QType::Q4_1R8 | QType::Q4_0R8 | QType::Q5_1R8 | QType::Q4_KR8 => {
                unreachable!("refused above")
            }
            QType::Q6_K => quantize_q6(x, o),
            QType::F16 => {
                for (v, b) in x.iter().zip(o.chunks_exact_mut(2)) {
                    b.copy_from_slice(&f16::from_f32(*v).to_le_bytes());
                }
            }
            QType::BF16 => {
                for (v, b) in x.iter().zip(o.chunks_exact_mut(2)) {
                    b.copy_from_slice(&bf16::from_f32(*v).to_le_bytes());
                }
            }
            QType::Q8_0 => {
                let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
                let d = f16::from_f32(amax / 127.0);
                let id = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                o[..2].copy_from_slice(&d.to_le_bytes());
                for (i, v) in x.iter().enumerate() {
                    o[2 + i] = ((v * id).round().clamp(-127.0, 127.0) as i8) as u8;
                }
            }
            QType::Q4_1 => {
                let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = f16::from_f32((hi - lo) / 15.0);
                let m = f16::from_f32(lo);
                let id = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                o[..2].copy_from_slice(&d.to_le_bytes());
                o[2..4].copy_from_slice(&m.to_le_bytes());
                let nib = |v: f32| ((v - m.to_f32()) * id).round().clamp(0.0, 15.0) as u8;
                for i in 0..16 {
                    o[4 + i] = nib(x[i]) | (nib(x[i + 16]) << 4);
                }
            }
            QType::Q4_0 | QType::Q5_0 => {
                // d = (the value of largest magnitude) / -2^(bits-1), q = round(x/d) + 2^(bits-1).
                let five = q == QType::Q5_0;
                let half = if five { 16.0 } else { 8.0 };
                let max = x
                    .iter()
                    .copied()
                    .fold(0f32, |a, v| if v.abs() > a.abs() { v } else { a });
                let d = f16::from_f32(max / -half);
                let id = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                let top = 2.0 * half - 1.0;
                let qv: Vec<u8> = x
                    .iter()
                    .map(|v| (v * id + half).round().clamp(0.0, top) as u8)
                    .collect();
                o[..2].copy_from_slice(&d.to_le_bytes());
                pack_nibbles(&qv, five, &mut o[2..]);
            }
            QType::Q5_1 => {
                let lo = x.iter().copied().fold(f32::INFINITY, f32::min);
                let hi = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let d = f16::from_f32((hi - lo) / 31.0);
                let m = f16::from_f32(lo);
                let id = if d.to_f32() == 0.0 {
                    0.0
                } else {
                    1.0 / d.to_f32()
                };
                let qv: Vec<u8> = x
                    .iter()
                    .map(|v| ((v - m.to_f32()) * id).round().clamp(0.0, 31.0) as u8)
                    .collect();
                o[..2].copy_from_slice(&d.to_le_bytes());
                o[2..4].copy_from_slice(&m.to_le_bytes());
                pack_nibbles(&qv, true, &mut o[4..]);
            }
        }
    }
}

/// One Q4_K (or, `five`, Q5_K) super-block of 256 values: per 32-value
/// sub-block a scale `(max - min) / (2^bits - 1)` and a minimum `-min`
/// (`min` at most 0), both stored as 6-bit multiples of the super-block's
/// f16 `d` and `dmin` (their largest over 63); values rounded against the
/// stored scale and minimum, as the kernels will read them.
fn quantize_super(five: bool, x: &[f32], o: &mut [u8]) {
    let top = if five { 31.0 } else { 15.0 };
    let mut scale = [0f32; 8];
    let mut min = [0f32; 8];
    for (j, sub) in x.chunks(32).enumerate() {
        let lo = sub.iter().copied().fold(0f32, f32::min);
        let hi = sub.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        scale[j] = (hi - lo) / top;
        min[j] = -lo;
    }
    let d = f16::from_f32(scale.iter().copied().fold(0f32, f32::max) / 63.0);
    let dmin = f16::from_f32(min.iter().copied().fold(0f32, f32::max) / 63.0);
    let code = |v: f32, unit: f16| {
        if unit.to_f32() == 0.0 {
            0u8
        } else {
            (v / unit.to_f32()).round().clamp(0.0, 63.0) as u8
        }
    };
    let sc: [u8; 8] = std::array::from_fn(|j| code(scale[j], d));
    let mn: [u8; 8] = std::array::from_fn(|j| code(min[j], dmin));
    o[..2].copy_from_slice(&d.to_le_bytes());
    o[2..4].copy_from_slice(&dmin.to_le_bytes());
    let packed = &mut o[4..16];
    for j in 0..4 {
        packed[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        packed[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        packed[j + 8] = (sc[j + 4] & 0x0f) | (mn[j + 4] & 0x0f) << 4;
    }
    let (qh, qs) = if five {
        o[16..].split_at_mut(32)
    } else {
        o[16..].split_at_mut(0)
    };
    qh.fill(0);
    for (j, sub) in x.chunks(32).enumerate() {
        let step = d.to_f32() * sc[j] as f32;
        let m = dmin.to_f32() * mn[j] as f32;
        for (l, &v) in sub.iter().enumerate() {
            let q = if step == 0.0 {
                0
            } else {
                ((v + m) / step).round().clamp(0.0, top) as u8
            };
            let byte = &mut qs[(j / 2) * 32 + l];
            if j % 2 == 0 {
                *byte = (*byte & 0xf0) | (q & 0x0f);
            } else {
                *byte = (*byte & 0x0f) | (q & 0x0f) << 4;
            }
            if five {
                qh[l] |= (q >> 4) << j;
            }
        }
    }
}

/// One Q6_K super-block of 256 values: per 16 values a scale
/// `max|x| / 32`, stored as an i8 multiple of the f16 `d` (their largest
/// over 127); values `round(x / (d*sc)) + 32` in 0..64, split into low
/// nibbles and high bit pairs as the format lays them out.
fn quantize_q6(x: &[f32], o: &mut [u8]) {
    let scale: [f32; 16] = std::array::from_fn(|i| {
        x[16 * i..16 * (i + 1)]
            .iter()
            .fold(0f32, |a, v| a.max(v.abs()))
            / 32.0
    });
    let d = f16::from_f32(scale.iter().copied().fold(0f32, f32::max) / 127.0);
    let sc: [i8; 16] = std::array::from_fn(|i| {
        if d.to_f32() == 0.0 {
            0
        } else {
            (scale[i] / d.to_f32()).round().clamp(-128.0, 127.0) as i8
        }
    });
    o[..192].fill(0);
    for (v, &xv) in x.iter().enumerate() {
        let step = d.to_f32() * sc[v / 16] as f32;
        let q = if step == 0.0 {
            32
        } else {
            ((xv / step).round() + 32.0).clamp(0.0, 63.0) as u8
        };
        let (h, g, l) = (v / 128, (v % 128) / 32, v % 32);
        let ql = &mut o[h * 64 + l + (g % 2) * 32];
        *ql |= if g < 2 { q & 0x0f } else { (q & 0x0f) << 4 };
        o[128 + h * 32 + l] |= (q >> 4) << (2 * g);
    }
    for (i, &s) in sc.iter().enumerate() {
        o[192 + i] = s as u8;
    }
    o[208..210].copy_from_slice(&d.to_le_bytes());
}
