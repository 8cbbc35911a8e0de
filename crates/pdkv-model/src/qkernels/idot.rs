//! How the SIMD flavours reach a block's exact integer dots ([`IDot`]):
//! AVX2's `maddubs`/`madd` ([`Avx2`]) and AVX-512 VNNI's `vpdpbusd`
//! ([`Vnni`]), for the tiles (8 activation rows a lane each) and the
//! batch-1 rows (8 weight rows a lane each, or two to a vector). A leaf
//! beside [`super::simd`], which runs the kernels on them.

use std::arch::x86_64::*;

use super::job::Scratch;
use super::regs::{lanes8, DR};
use crate::qtype::QK;

/// Where a tile's weights are: `C` rows from `w` (stride `rb` bytes)
/// and their unpacked form in `s`.
pub(super) struct Tile<'a> {
    pub(super) w: *const u8,
    pub(super) rb: usize,
    pub(super) nb: usize,
    pub(super) s: &'a Scratch,
}

/// The integer half of a block dot: 8 exact i32 lanes (one per activation
/// row of the group) for each of `C` weight rows.
/// Every method is unsafe: it needs a CPU with the flavour's instructions
/// (AVX2, or AVX-512 VNNI, VL and BW), besides what its own contract says.
pub(super) trait IDot {
    /// Activation groups a tile takes in one pass ([`IDot::q8`], [`IDot::qu`]):
    /// VNNI 2 (AVX-512's 32 vector registers hold both groups' sums, and
    /// each weight chunk is broadcast once for both), AVX2 1 (its 16 would
    /// not).
    const GROUPS: usize;
    /// For each of `G` groups (`G` at most [`IDot::GROUPS`]): `xb[h]` is
    /// group `h`'s block `b` (256 bytes), `sumx[h]` its 8 sums; `t` holds
    /// `C` rows, and `t.s` their blocks as [`IDot::scratch8`] keeps them.
    ///
    /// # Safety
    /// As said, with the flavour's instructions.
    unsafe fn q8<const C: usize, const G: usize>(
        xb: [*const i8; G],
        sumx: [*const i32; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G];
    /// The same for an unsigned format, from the unpacked values.
    ///
    /// # Safety
    /// `xb[h]` is group `h`'s block `b` (256 bytes); `t.s` holds `C`
    /// unpacked rows.
    unsafe fn qu<const C: usize, const G: usize>(
        xb: [*const i8; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G];
    /// A Q8_0 block's 16 values (as loaded) as the tiles keep them in
    /// the scratch: `w + 128` for VNNI's unsigned operand, `|w|` for AVX2's.
    unsafe fn scratch8(w: __m128i) -> __m128i;
    /// Whether [`IDot::r8`] leaves `128 * Σx` to subtract.
    const R8_OFFSET: bool;
    /// How [`IDot::r8`] wants a Q8_0 block's 32 values (as loaded).
    unsafe fn w8(w: __m256i) -> __m256i;
    /// One row's block `x` (32 i8) against a weight block prepared by
    /// [`IDot::w8`]: 8 i32 lanes summing to the dot.
    unsafe fn r8(x: __m256i, w: __m256i) -> __m256i;
    /// The same for 32 unsigned weight values (at most 31) as bytes.
    unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i;
    /// Lane `c`: the exact dot of `x` (one block, 32 i8) with the 32
    /// unsigned weight values (at most 31) of `w[c]`, as bytes.
    unsafe fn dots_u(x: __m256i, w: &[__m256i; DR]) -> __m256i;
    /// `v` (32 values below 16, byte `i` value `i`) with 16 added to byte
    /// `i` where bit `i` of `bits` is set: a Q5 block's fifth bits.
    unsafe fn fifth(v: __m256i, bits: u32) -> __m256i;
    /// Lane `c`: the exact dot of one block `x` with the 32 unsigned
    /// weight values (at most 31) of row `c`, from rows paired as
    /// `simd::unpack_pair` leaves them: `lo[p]` holds values 0..16 of rows
    /// `p` and `p + 4` (one per 128-bit half), `hi[p]` their values
    /// 16..32; `xl` and `xh` are the block's values 0..16 and 16..32,
    /// each in both halves.
    unsafe fn dots_pairs(
        xl: __m256i,
        xh: __m256i,
        lo: &[__m256i; PAIRS],
        hi: &[__m256i; PAIRS],
    ) -> __m256i;
}

/// Row pairs of a `simd::direct` tile: row `p` beside row `p + PAIRS`.
pub(super) const PAIRS: usize = DR / 2;

/// Lane `c` of the result: the sum of the 4 lanes of row `c`'s pair
/// vector half (`v[c % 4]`'s low half for `c < 4`, its high half else).
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn pair_lanes(v: &[__m256i; PAIRS]) -> __m256i {
    // SAFETY: the caller guarantees AVX2; registers only, no memory.
    unsafe {
        // Per 128-bit half: [v0 v0 v1 v1], [v2 v2 v3 v3], then [v0 v1 v2 v3].
        _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]))
    }
}

/// A 4-value chunk of a weight row, broadcast to every lane.
///
/// # Safety
/// The CPU has AVX2; `p` points at 4 readable bytes.
#[inline(always)]
unsafe fn bcast(p: *const u8) -> __m256i {
    // SAFETY: the CPU has AVX2 and `p` points at 4 readable bytes
    // (this function's contract); the read is unaligned.
    unsafe { _mm256_set1_epi32((p as *const i32).read_unaligned()) }
}

/// Chunk `i` (values `4i..4i+4`) of Q8_0 block `b` of tile row `c`.
///
/// # Safety
/// The CPU has AVX2; `t` holds Q8_0 row `c` with its block `b`, `i < 8`.
#[inline(always)]
unsafe fn q8_chunk(t: &Tile<'_>, c: usize, b: usize, i: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and that `t` holds row `c`'s block
    // `b`, whose 32 values start 2 bytes in.
    unsafe { bcast(t.w.add(c * t.rb + b * 34 + 2 + i * 4)) }
}

/// Chunk `i` of the unpacked block `b` of tile row `c` (an unsigned
/// format's values, or Q8_0's as [`IDot::scratch8`] keeps them).
///
/// # Safety
/// The CPU has AVX2; `t.s` holds the unpacked block `b` of row `c`, `i < 8`.
#[inline(always)]
pub(super) unsafe fn unpacked_chunk(t: &Tile<'_>, c: usize, b: usize, i: usize) -> __m256i {
    // SAFETY: the caller guarantees AVX2 and that `t.s` holds the unpacked
    // block `b` of row `c` (32 bytes).
    unsafe { bcast(t.s.vals.as_ptr().add((c * t.nb + b) * QK + i * 4)) }
}

pub(super) struct Avx2;

impl IDot for Avx2 {
    /// One group a pass: with only 16 vector registers, two groups' sums
    /// and accumulators do not fit (measured with this flavour on an AMD
    /// EPYC, in cache: batch 32 and 512, two a pass 0.9-1.2x one's, no
    /// consistent gain).
    const GROUPS: usize = 1;

    /// `|w|` (from the scratch) as unsigned times `x` with the sign of `w`
    /// (`|w|` may be 128; pair sums stay within i16), then pairs of i16
    /// summed to i32.
    #[inline(always)]
    unsafe fn q8<const C: usize, const G: usize>(
        xb: [*const i8; G],
        _sumx: [*const i32; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G] {
        // SAFETY: the caller guarantees AVX2 and the trait's contract: each
        // `xb` is a group's 256-byte block and `t` (and `t.s`) holds `C` rows
        // with block `b`.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut isum = [[_mm256_setzero_si256(); C]; G];
            for i in 0..QK / 4 {
                for (xb, isum) in xb.iter().zip(isum.iter_mut()) {
                    let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                    for (c, acc) in isum.iter_mut().enumerate() {
                        let p = _mm256_maddubs_epi16(
                            unpacked_chunk(t, c, b, i),
                            _mm256_sign_epi8(xv, q8_chunk(t, c, b, i)),
                        );
                        *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
                    }
                }
            }
            isum
        }
    }

    /// Unsigned values (at most 31) times `x`; 4 chunks of i16 pair sums
    /// stay below 4 * 2 * 31 * 127 = 31496, so each half block adds up
    /// in i16 before it is widened.
    #[inline(always)]
    unsafe fn qu<const C: usize, const G: usize>(
        xb: [*const i8; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G] {
        // SAFETY: the caller guarantees AVX2 and the trait's contract: each
        // `xb` is a group's 256-byte block and `t.s` holds `C` unpacked rows
        // with block `b`.
        unsafe {
            let ones = _mm256_set1_epi16(1);
            let mut isum = [[_mm256_setzero_si256(); C]; G];
            for half in [0, QK / 8] {
                let mut s16 = [[_mm256_setzero_si256(); C]; G];
                for i in half..half + QK / 8 {
                    for (xb, s16) in xb.iter().zip(s16.iter_mut()) {
                        let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                        for (c, acc) in s16.iter_mut().enumerate() {
                            *acc = _mm256_add_epi16(
                                *acc,
                                _mm256_maddubs_epi16(unpacked_chunk(t, c, b, i), xv),
                            );
                        }
                    }
                }
                for (isum, s16) in isum.iter_mut().zip(s16) {
                    for (acc, v) in isum.iter_mut().zip(s16) {
                        *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(v, ones));
                    }
                }
            }
            isum
        }
    }

    #[inline(always)]
    unsafe fn scratch8(w: __m128i) -> __m128i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe { _mm_abs_epi8(w) }
    }

    const R8_OFFSET: bool = false;

    #[inline(always)]
    unsafe fn w8(w: __m256i) -> __m256i {
        w
    }

    #[inline(always)]
    unsafe fn r8(x: __m256i, w: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe {
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }
    }

    #[inline(always)]
    unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe { _mm256_madd_epi16(_mm256_maddubs_epi16(nib, x), _mm256_set1_epi16(1)) }
    }

    /// The pair sums of `maddubs` (at most 2 * 31 * 127 = 7874) are added
    /// across rows in i16 twice (at most 4 * 7874 = 31496, no overflow)
    /// before they widen: fewer instructions than widening each row first.
    #[inline(always)]
    unsafe fn dots_u(x: __m256i, w: &[__m256i; DR]) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe {
            let p: [__m256i; DR] = [
                _mm256_maddubs_epi16(w[0], x),
                _mm256_maddubs_epi16(w[1], x),
                _mm256_maddubs_epi16(w[2], x),
                _mm256_maddubs_epi16(w[3], x),
                _mm256_maddubs_epi16(w[4], x),
                _mm256_maddubs_epi16(w[5], x),
                _mm256_maddubs_epi16(w[6], x),
                _mm256_maddubs_epi16(w[7], x),
            ];
            // Per 128-bit half: rows 0..4 (then 4..8), two i16 each.
            let q0 =
                _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
            let q1 =
                _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
            let ones = _mm256_set1_epi16(1);
            // a = [rows 0..4 low-half sums | rows 0..4 high-half sums], b for rows 4..8.
            let a = _mm256_madd_epi16(q0, ones);
            let b = _mm256_madd_epi16(q1, ones);
            _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(a, b),
                _mm256_permute2x128_si256::<0x31>(a, b),
            )
        }
    }

    #[inline(always)]
    unsafe fn fifth(v: __m256i, bits: u32) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe {
            // Byte i takes byte i/8 of the 32 bits, then keeps its bit i%8.
            let spread = _mm256_shuffle_epi8(
                _mm256_set1_epi32(bits as i32),
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                ),
            );
            let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
            _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)))
        }
    }

    /// A pair's two `maddubs` (each i16 at most 2 * 31 * 128 = 7936) added
    /// in i16, two pairs' adjacent sums added once more (at most 31744,
    /// no overflow), then widened.
    #[inline(always)]
    unsafe fn dots_pairs(
        xl: __m256i,
        xh: __m256i,
        lo: &[__m256i; PAIRS],
        hi: &[__m256i; PAIRS],
    ) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe {
            // A plain loop, not `array::from_fn`: a closure body is compiled
            // without the caller's target features.
            let mut s = [_mm256_setzero_si256(); PAIRS];
            for (p, sp) in s.iter_mut().enumerate() {
                *sp = _mm256_add_epi16(
                    _mm256_maddubs_epi16(lo[p], xl),
                    _mm256_maddubs_epi16(hi[p], xh),
                );
            }
            let ones = _mm256_set1_epi16(1);
            // Per 128-bit half: rows [p, p+1] (then [p+2, p+3]), 2 i32 each.
            let a = _mm256_madd_epi16(_mm256_hadd_epi16(s[0], s[1]), ones);
            let b = _mm256_madd_epi16(_mm256_hadd_epi16(s[2], s[3]), ones);
            _mm256_hadd_epi32(a, b)
        }
    }
}

pub(super) struct Vnni;

impl IDot for Vnni {
    /// Two groups a pass: with one, every `vpdpbusd` had a broadcast load
    /// of its weight chunk of its own; two groups share each. On an AMD
    /// EPYC (2 threads, in one process alternating with one group a
    /// pass): the matmuls at batch 32 and
    /// 512 in cache 1.3x as fast (Q8_0, Q5_0R8, Q4_KR8), batch-32 decode
    /// steps at context 128 1.11-1.14x, prefill of 512 and 2,048 tokens
    /// 1.15x / 1.09x (Q8_0) and 1.25x / 1.22x (Q4_K_M). Three groups a
    /// pass were no faster than two.
    const GROUPS: usize = 2;

    /// `(w + 128)` as unsigned times `x`, minus `128 * Σx`.
    #[inline(always)]
    unsafe fn q8<const C: usize, const G: usize>(
        xb: [*const i8; G],
        sumx: [*const i32; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G] {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL and the trait's
        // contract: each `xb` is a group's 256-byte block, `sumx` its 8
        // sums, and `t.s` holds `C` unpacked rows with block `b`.
        unsafe {
            // `prep` left `w + 128` in the scratch, where Q4_1 keeps its nibbles.
            let mut isum = Self::qu::<C, G>(xb, t, b);
            for (isum, sumx) in isum.iter_mut().zip(sumx) {
                let corr = _mm256_slli_epi32::<7>(_mm256_loadu_si256(sumx as *const __m256i));
                for v in isum.iter_mut() {
                    *v = _mm256_sub_epi32(*v, corr);
                }
            }
            isum
        }
    }

    /// Each weight chunk broadcast once for the `G` groups.
    #[inline(always)]
    unsafe fn qu<const C: usize, const G: usize>(
        xb: [*const i8; G],
        t: &Tile<'_>,
        b: usize,
    ) -> [[__m256i; C]; G] {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL and the trait's
        // contract: each `xb` is a group's 256-byte block and `t.s` holds
        // `C` unpacked rows with block `b`.
        unsafe {
            let mut isum = [[_mm256_setzero_si256(); C]; G];
            for i in 0..QK / 4 {
                let mut xv = [_mm256_setzero_si256(); G];
                for (v, xb) in xv.iter_mut().zip(xb) {
                    *v = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                }
                for c in 0..C {
                    let w = unpacked_chunk(t, c, b, i);
                    for (acc, &xv) in isum.iter_mut().zip(&xv) {
                        acc[c] = _mm256_dpbusd_epi32(acc[c], w, xv);
                    }
                }
            }
            isum
        }
    }

    #[inline(always)]
    unsafe fn scratch8(w: __m128i) -> __m128i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe { _mm_xor_si128(w, _mm_set1_epi8(-128)) }
    }

    const R8_OFFSET: bool = true;

    /// `w + 128` as unsigned bytes.
    #[inline(always)]
    unsafe fn w8(w: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX2; registers only, no memory.
        unsafe { _mm256_xor_si256(w, _mm256_set1_epi8(-128)) }
    }

    #[inline(always)]
    unsafe fn r8(x: __m256i, w: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL; registers only.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x) }
    }

    #[inline(always)]
    unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL; registers only.
        unsafe { _mm256_dpbusd_epi32(_mm256_setzero_si256(), nib, x) }
    }

    #[inline(always)]
    unsafe fn dots_u(x: __m256i, w: &[__m256i; DR]) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL; registers only.
        unsafe {
            let mut v = [_mm256_setzero_si256(); DR];
            for (vc, &wc) in v.iter_mut().zip(w) {
                *vc = Self::r4(x, wc);
            }
            lanes8(&v)
        }
    }

    /// The 32 bits are a byte mask as they stand (AVX-512 BW): one masked
    /// byte shuffle looks each set byte's value up in a table of `i + 16`.
    /// (A masked add says the same, but the compiler, knowing the values
    /// are below 16, turns it into an OR and a blend: two instructions.)
    #[inline(always)]
    unsafe fn fifth(v: __m256i, bits: u32) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 BW and VL; registers only.
        unsafe {
            let plus16 = _mm256_setr_epi8(
                16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 16, 17, 18, 19, 20,
                21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31,
            );
            _mm256_mask_shuffle_epi8(v, bits, plus16, v)
        }
    }

    /// A pair's two halves chained in one accumulator: one zeroing and
    /// 4 lanes a row to bring together, where a row alone has 8.
    #[inline(always)]
    unsafe fn dots_pairs(
        xl: __m256i,
        xh: __m256i,
        lo: &[__m256i; PAIRS],
        hi: &[__m256i; PAIRS],
    ) -> __m256i {
        // SAFETY: the caller guarantees AVX-512 VNNI and VL; registers only.
        unsafe {
            let mut v = [_mm256_setzero_si256(); PAIRS];
            for (p, vp) in v.iter_mut().enumerate() {
                *vp = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(*vp, lo[p], xl), hi[p], xh);
            }
            pair_lanes(&v)
        }
    }
}
