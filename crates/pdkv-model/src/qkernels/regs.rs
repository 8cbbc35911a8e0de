//! Register-level pieces of the SIMD flavours that need no flavour's own
//! instructions: the values of a K-quant block as bytes, horizontal sums
//! of 8 integer vectors, the words of a tile's 8 rows in one vector, the
//! K-quant 6-bit scales decoded lane-wise, the weight prefetch and the
//! batch-1 tile's stores. AVX2 and F16C (SSE for the prefetch) alone.

use std::arch::x86_64::*;

use super::job::Job;
use crate::qtype::QType;

/// The 32 values of block `j` of a Q4_K/Q5_K super-block as bytes, in
/// order (see [`super::blocks::super_value`]).
///
/// # Safety
/// The CPU has AVX2; `blk` points at a whole Q4_K (Q5_K if `ty` says so)
/// super-block, `j < 8`.
#[inline(always)]
pub(super) unsafe fn unpack_super(ty: QType, blk: *const u8, j: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and that `blk` is a whole Q4_K/Q5_K
    // super-block: the 32-byte loads at 16 or 48 + 32*(j/2), and of the fifth
    // bits at 16, are inside it (j < 8).
    unsafe {
        let five = ty == QType::Q5_K;
        let low = _mm256_set1_epi8(0x0f);
        let q = _mm256_loadu_si256(
            blk.add(if five { 48 } else { 16 } + (j / 2) * 32) as *const __m256i
        );
        let v = if j.is_multiple_of(2) {
            _mm256_and_si256(q, low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), low)
        };
        if !five {
            return v;
        }
        // Bit j of each fifth-bit byte, moved to bit 4 (16-bit shifts keep
        // every byte's own bit: j < 8).
        let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
        let bit = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(j as i32)),
            _mm256_set1_epi8(1),
        );
        _mm256_or_si256(v, _mm256_slli_epi16::<4>(bit))
    }
}

/// The 16 bytes at `a + o` in the low half, at `b + o` in the high half.
///
/// # Safety
/// The CPU has AVX2; 16 bytes are readable at `a + o` and at `b + o`.
#[inline(always)]
pub(super) unsafe fn halves(a: *const u8, b: *const u8, o: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and both 16-byte reads.
    unsafe {
        _mm256_inserti128_si256::<1>(
            _mm256_castsi128_si256(_mm_loadu_si128(a.add(o) as *const __m128i)),
            _mm_loadu_si128(b.add(o) as *const __m128i),
        )
    }
}

/// An activation block's values 0..16 and 16..32 (32 i8 at `xp`), each
/// in both 128-bit halves: the `x` a row pair's vectors multiply.
///
/// # Safety
/// The CPU has AVX2; 32 bytes are readable at `xp`.
#[inline(always)]
pub(super) unsafe fn x_halves(xp: *const i8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees AVX2 and the 32-byte read.
    unsafe {
        (
            _mm256_broadcastsi128_si256(_mm_loadu_si128(xp as *const __m128i)),
            _mm256_broadcastsi128_si256(_mm_loadu_si128(xp.add(16) as *const __m128i)),
        )
    }
}

/// Block `j` of the Q4_K/Q5_K super-blocks at `a` and `b` (two rows'),
/// paired as `simd::unpack_pair` pairs Q4_0's: `(lo, hi)`, values 0..16
/// (then 16..32) of `a`'s block in the low half and of `b`'s in the high
/// half. A row's 32 nibble bytes hold two blocks (`j` even: the low
/// nibbles), so each half is one 16-byte load.
///
/// # Safety
/// The CPU has AVX2; `a` and `b` point at whole Q4_K (Q5_K if `ty` says
/// so) super-blocks, `j < 8`.
#[inline(always)]
pub(super) unsafe fn unpack_super_pair(
    ty: QType,
    a: *const u8,
    b: *const u8,
    j: usize,
) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees AVX2 and that `a` and `b` are whole
    // Q4_K/Q5_K super-blocks: the 16-byte loads at 16 or 48 + 32*(j/2)
    // (+ 16), and of the fifth bits at 16 (+ 16), are inside them (j < 8).
    unsafe {
        let five = ty == QType::Q5_K;
        let at = if five { 48 } else { 16 } + (j / 2) * 32;
        let (ql, qh) = (halves(a, b, at), halves(a, b, at + 16));
        let low = _mm256_set1_epi8(0x0f);
        let (lo, hi) = if j.is_multiple_of(2) {
            (_mm256_and_si256(ql, low), _mm256_and_si256(qh, low))
        } else {
            (
                _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low),
                _mm256_and_si256(_mm256_srli_epi16::<4>(qh), low),
            )
        };
        if !five {
            return (lo, hi);
        }
        // Bit j of each fifth-bit byte, moved to bit 4, as in `unpack_super`.
        let shift = _mm_cvtsi32_si128(j as i32);
        let one = _mm256_set1_epi8(1);
        let bl = _mm256_and_si256(_mm256_srl_epi16(halves(a, b, 16), shift), one);
        let bh = _mm256_and_si256(_mm256_srl_epi16(halves(a, b, 32), shift), one);
        (
            _mm256_or_si256(lo, _mm256_slli_epi16::<4>(bl)),
            _mm256_or_si256(hi, _mm256_slli_epi16::<4>(bh)),
        )
    }
}

/// The 32 unsigned values (`q`, the weight being `q - 32`) of block `j`
/// of a Q6_K super-block as bytes, in order (see [`super::blocks::q6_value`]).
///
/// # Safety
/// The CPU has AVX2; `blk` points at a whole Q6_K super-block, `j < 8`.
#[inline(always)]
pub(super) unsafe fn unpack_q6(blk: *const u8, j: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and that `blk` is a whole Q6_K
    // super-block: the loads at `64h + 32(g%2)` and `128 + 32h` are inside its
    // 210 bytes (h < 2).
    unsafe {
        let (h, g) = (j / 4, j % 4);
        let low = _mm256_set1_epi8(0x0f);
        let ql = _mm256_loadu_si256(blk.add(h * 64 + (g % 2) * 32) as *const __m256i);
        let lo = if g < 2 {
            _mm256_and_si256(ql, low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low)
        };
        // Bits 2g..2g+2 of each high-bit byte moved to bits 4..6 by one
        // 16-bit shift: what crosses into the next byte lands outside them.
        let qh = _mm256_loadu_si256(blk.add(128 + h * 32) as *const __m256i);
        let at4 = match g {
            0 => _mm256_slli_epi16::<4>(qh),
            1 => _mm256_slli_epi16::<2>(qh),
            2 => qh,
            _ => _mm256_srli_epi16::<2>(qh),
        };
        _mm256_or_si256(lo, _mm256_and_si256(at4, _mm256_set1_epi8(0x30)))
    }
}

/// Weight rows per `simd::direct` tile: one per lane.
pub(super) const DR: usize = 8;

/// Writes a `simd::direct` tile's results: lane `c` of `acc[r]` is output
/// `j + c` of activation row `r`, for the tile's `nr` real rows.
///
/// # Safety
/// The CPU has AVX2; `job.y` has rows `0..acc.len()` of `job.n` floats, of
/// which this job alone writes columns `j..j + nr`.
#[inline(always)]
pub(super) unsafe fn store_tile(acc: &[__m256], nr: usize, job: &Job, j: usize) {
    // SAFETY: the caller guarantees AVX2 and that the job owns columns
    // `j..j + nr` of rows `0..acc.len()` of `job.y`.
    unsafe {
        for (r, a) in acc.iter().enumerate() {
            let mut out = [0f32; DR];
            _mm256_storeu_ps(out.as_mut_ptr(), *a);
            for (c, &v) in out[..nr].iter().enumerate() {
                *job.y.add(r * job.n + j + c) = v;
            }
        }
    }
}

/// Entry `c` is the byte offset of a `simd::direct` tile's row `c` (a
/// short tile of `nr` rows repeats its last).
#[inline(always)]
pub(super) fn row_offsets(nr: usize, rb: usize) -> [usize; DR] {
    std::array::from_fn(|c| c.min(nr - 1) * rb)
}

/// The 4 bytes at `p + offs[c]` in lane `c` (a tile's rows' words at one
/// offset of their blocks). Eight loads and inserts, not a gather: on AMD
/// Zen 3, where a gather is microcoded, batch-1 decode gained 11 % (Q4_1)
/// and 17 % (Q4_K_M) tok/s from this, medians of 3 alternated runs.
///
/// # Safety
/// The CPU has AVX2; the 4 bytes at each `p + offs[c]` are readable.
#[inline(always)]
pub(super) unsafe fn rows_word(p: *const u8, offs: &[usize; DR]) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and that every row's 4 bytes are
    // readable (read unaligned).
    unsafe {
        let mut w = [0i32; DR];
        for (wc, &o) in w.iter_mut().zip(offs) {
            *wc = (p.add(o) as *const i32).read_unaligned();
        }
        _mm256_setr_epi32(w[0], w[1], w[2], w[3], w[4], w[5], w[6], w[7])
    }
}

/// Byte `i` of each lane of `w` moved to the bottom of the lane, `i = 0..4`.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
pub(super) unsafe fn word_bytes(w: __m256i) -> [__m256i; 4] {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        [
            w,
            _mm256_srli_epi32::<8>(w),
            _mm256_srli_epi32::<16>(w),
            _mm256_srli_epi32::<24>(w),
        ]
    }
}

/// Lane `c`: the f16 in the low 16 bits of lane `c` of `g`, widened (a
/// gathered row word's scale).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[inline(always)]
pub(super) unsafe fn f16_low(g: __m256i) -> __m256 {
    // SAFETY: the caller guarantees AVX2 and F16C; registers only, no memory.
    unsafe {
        let w = _mm256_and_si256(g, _mm256_set1_epi32(0xffff));
        // Per 128-bit half: lanes 0..4 twice; the 64-bit pieces 0 and 2 hold all 8.
        let p = _mm256_packus_epi32(w, w);
        _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(
            p,
        )))
    }
}

/// Lane `c`: the f16 in the high 16 bits of lane `c` of `g`, widened (a
/// gathered row word's minimum, or the scale two bytes into the word).
///
/// # Safety
/// The CPU has AVX2 and F16C.
#[inline(always)]
pub(super) unsafe fn f16_high(g: __m256i) -> __m256 {
    // SAFETY: the caller guarantees AVX2 and F16C; registers only, no memory.
    unsafe { f16_low(_mm256_srli_epi32::<16>(g)) }
}

/// Lane `c` of the result is the sum of the 8 lanes of `v[c]`.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
pub(super) unsafe fn lanes8(v: &[__m256i; DR]) -> __m256i {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        let (lo, hi) = lanes8_halves(v);
        _mm256_add_epi32(lo, hi)
    }
}

/// Lane `c` of the first result is the sum of lanes 0..4 of `v[c]`, of
/// the second the sum of its lanes 4..8.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
pub(super) unsafe fn lanes8_halves(v: &[__m256i; DR]) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        // a = [v0..v3 low-half sums | v0..v3 high-half sums], b likewise for v4..v7.
        (
            _mm256_permute2x128_si256::<0x20>(a, b),
            _mm256_permute2x128_si256::<0x31>(a, b),
        )
    }
}

/// The 8 rows' `(dw, mw)` of a Q4_K/Q5_K block from their super-blocks'
/// `d` and `dmin` and the block's 6-bit scale `sc` and minimum `m`
/// ([`k_scales`]): the exact products `super_params` forms, `d * sc` and
/// `-(dmin * m)` (a sign flip, a zero product's too).
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
pub(super) unsafe fn k_block_scales(
    d: __m256,
    dmin: __m256,
    sc: __m256i,
    m: __m256i,
) -> (__m256, __m256) {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        let dw = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        let mw = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m));
        (dw, _mm256_xor_ps(mw, _mm256_set1_ps(-0.0)))
    }
}

/// The 6-bit scales and minimums of a Q4_K/Q5_K super-block's 8 blocks,
/// lane-wise from its 12 scale bytes as three words `w0`, `w1`, `w2`
/// (bytes 0..4, 4..8, 8..12): `(sc[j], mn[j])` as
/// [`crate::gguf::k_scale_min`] decodes block `j`.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
pub(super) unsafe fn k_scales(
    w0: __m256i,
    w1: __m256i,
    w2: __m256i,
) -> ([__m256i; 8], [__m256i; 8]) {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        let (b0, b1, b2) = (word_bytes(w0), word_bytes(w1), word_bytes(w2));
        let six = _mm256_set1_epi32(63);
        let four = _mm256_set1_epi32(15);
        let two = _mm256_set1_epi32(3);
        let mut sc = [_mm256_setzero_si256(); 8];
        let mut mn = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            // Blocks 0..4: the low 6 bits of bytes i and 4 + i.
            sc[i] = _mm256_and_si256(b0[i], six);
            mn[i] = _mm256_and_si256(b1[i], six);
            // Blocks 4..8: a nibble of byte 8 + i, and above it the top two
            // bits of byte i (scale) or 4 + i (minimum).
            sc[4 + i] = _mm256_or_si256(
                _mm256_and_si256(b2[i], four),
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(b0[i]), two)),
            );
            mn[4 + i] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi32::<4>(b2[i]), four),
                _mm256_slli_epi32::<4>(_mm256_and_si256(_mm256_srli_epi32::<6>(b1[i]), two)),
            );
        }
        (sc, mn)
    }
}
