//! Activations quantised once per step for the block-format matmuls
//! ([`QActs`]): 8-bit values and an f32 scale per 32-value block, rows
//! interleaved in groups of 8 for the SIMD kernels.

use super::flavour::{has, Flavour};
use crate::dispatch::SendPtr;
use crate::qtype::QK;

/// Activation rows per interleaved group: one per lane of an 8 x f32 vector.
pub(super) const GROUP: usize = 8;
/// Bytes of one block of one group: 8 chunks of 4 values, each for 8 rows.
pub(super) const GROUP_BLOCK: usize = GROUP * QK;

/// Activations quantised once per step: each row of `k` values in 32-value
/// blocks, each block an f32 scale d = max|x|/127 (0 for an all-zero block),
/// 32 i8 q = round(x/d) (round half away from zero), and the block's sum of
/// q as i32 (Q4_1 needs it).
///
/// Layout: rows in groups of 8 (the last one padded with zero rows). Value
/// `i` of block `b` of row `8g + l` is `qs[(g*nb + b)*256 + (i/4)*32 + l*4 + i%4]`;
/// its scale, sum and `d * sum` are at `(g*nb + b)*8 + l`. A step's
/// activations without the interleaved copy ([`QActs::quantize_for_step`]:
/// at most [`DIRECT_MAX`] rows) keep them at `b*m + l` instead
/// ([`QActs::at`]): decode's one row writes 3 cache lines of them for
/// SmolLM2's 576 values, not 27. Each line the quantiser writes that
/// another math thread read in the last matmul is taken back from that
/// core first (on this 2-core AMD EPYC, 36 lines written after the other
/// core read them: 340 ns against 57 ns), and read across again by it in
/// the next. Batch-1 decode with the compact scales, alternating with the
/// wide ones every 24 steps in one process (24-30 rounds, medians of the
/// paired ratios): Q4_K_M 1.029, Q4_1 1.025, Q8_0 1.012, the quantiser's
/// time a step a fifth to a third shorter.
///
/// Reusable: [`QActs::quantize`] keeps its buffers' capacity (a step
/// allocates nothing once warm).
pub struct QActs {
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) qs: Vec<i8>,
    /// The same values row-major (`[m, k]`), for rows computed one at a time.
    pub(super) rowq: Vec<i8>,
    /// Whether `qs` holds the values (see [`QActs::quantize_for_step`]).
    interleaved: bool,
    /// Entries between one block's scales and the next's: [`GROUP`], or
    /// `m` without the interleaved copy. Stored, not derived from
    /// `interleaved` and `m` in [`QActs::at`]: the batch-1 Q8_0 kernel ran
    /// 40.2-41.4 -> 37.8-38.3 GB/s with the branch (one thread, in cache,
    /// binaries alternating).
    stride: usize,
    pub(super) d: Vec<f32>,
    pub(super) sum: Vec<i32>,
    /// `d * (sum as f32)`, the activation side of the Q4_1 minimum term.
    pub(super) dsum: Vec<f32>,
    /// The activations rounded to bf16 (`[m, k]` row-major), for BF16
    /// matrices on CPUs with bf16 dot products ([`crate::bf16dot`]).
    bf16: Vec<u16>,
}

impl Default for QActs {
    fn default() -> Self {
        Self::new()
    }
}

impl QActs {
    pub fn new() -> QActs {
        QActs {
            m: 0,
            k: 0,
            qs: Vec::new(),
            rowq: Vec::new(),
            interleaved: true,
            stride: GROUP,
            d: Vec::new(),
            sum: Vec::new(),
            dsum: Vec::new(),
            bf16: Vec::new(),
        }
    }

    /// Rounds `x` to bf16 for [`QActs::bf16`] (independent of [`QActs::quantize`];
    /// CPUs with bf16 dot products only, see [`crate::bf16dot::round_rows`]).
    pub fn round_bf16(&mut self, x: &[f32]) {
        crate::bf16dot::round_rows(x, &mut self.bf16);
    }

    /// The values of the last [`QActs::round_bf16`].
    pub fn bf16(&self) -> &[u16] {
        &self.bf16
    }

    /// Quantises `x` = `[m, k]` row-major (k % 32 == 0; panics otherwise with a message).
    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        self.quantize_with(x, m, k, true)
    }

    /// [`QActs::quantize`] for the default backend's kernels only: a step
    /// of at most `DIRECT_MAX` rows on AVX2 is read row-major alone, so the
    /// interleaved copy (for the tiles and the portable kernel) is not
    /// written; writing it costs a decode step a few percent. The block
    /// matmuls refuse activations without the copy they need.
    pub fn quantize_for_step(&mut self, x: &[f32], m: usize, k: usize) {
        let direct = Flavour::of(crate::dispatch::backend()) != Flavour::Portable;
        self.quantize_with(x, m, k, !(direct && m <= DIRECT_MAX))
    }

    /// Whether the interleaved copy (`qs`) was written.
    pub(super) fn interleaved(&self) -> bool {
        self.interleaved
    }

    fn quantize_with(&mut self, x: &[f32], m: usize, k: usize, interleave: bool) {
        assert!(
            k.is_multiple_of(QK),
            "QActs::quantize: k = {k} is not a multiple of the block size {QK}"
        );
        assert!(
            x.len() >= m * k,
            "x has {} floats, need {}x{}",
            x.len(),
            m,
            k
        );
        let nb = k / QK;
        let groups = m.div_ceil(GROUP);
        debug_assert!(interleave || m <= GROUP, "rows past a group need the copy");
        let stride = if interleave { GROUP } else { m.max(1) };
        self.m = m;
        self.k = k;
        self.interleaved = interleave;
        self.stride = stride;
        self.qs.clear();
        if interleave {
            self.qs.resize(groups * nb * GROUP_BLOCK, 0);
        }
        // Without the copy every entry is written below: the buffers keep
        // their contents (no zeros written first) when their size stays.
        fit(&mut self.rowq, m * k, interleave);
        let scales = groups * nb * stride;
        fit(&mut self.d, scales, interleave);
        fit(&mut self.dsum, scales, interleave);
        fit(&mut self.sum, scales, interleave);
        if m * k == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let avx2 = has(Flavour::Avx2);
        let group = |g: GroupSlices<'_>| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA.
                return unsafe { fill_group_avx2(k, stride, g) };
            }
            fill_group(k, stride, g, quantize_block)
        };
        // Groups are independent (each owns its slice of every buffer), so
        // a prefill's are quantised on every math thread; the bits are the
        // same either way.
        let x = &x[..m * k];
        let (rows, blocks) = (GROUP * k, nb * stride);
        let qs_len = if interleave { nb * GROUP_BLOCK } else { 0 };
        if groups >= PARALLEL_GROUPS {
            // Each job takes its group's range of every buffer (sized above
            // for `groups` groups): the ranges of two groups never overlap,
            // so the pointers below hand out disjoint slices, and nothing
            // is allocated.
            let rowq = SendPtr(self.rowq.as_mut_ptr());
            let qs = SendPtr(self.qs.as_mut_ptr());
            let d = SendPtr(self.d.as_mut_ptr());
            let sum = SendPtr(self.sum.as_mut_ptr());
            let dsum = SendPtr(self.dsum.as_mut_ptr());
            crate::team::par_for(groups, |g| {
                let (r0, r1) = (g * rows, ((g + 1) * rows).min(m * k));
                // SAFETY: as above: group `g`'s ranges lie inside the buffers
                // (`rowq` holds `m * k` values, `qs` `groups * qs_len`, the
                // others `groups * blocks`) and are this job's alone.
                unsafe {
                    group((
                        &x[r0..r1],
                        std::slice::from_raw_parts_mut(rowq.get().add(r0), r1 - r0),
                        std::slice::from_raw_parts_mut(qs.get().add(g * qs_len), qs_len),
                        std::slice::from_raw_parts_mut(d.get().add(g * blocks), blocks),
                        std::slice::from_raw_parts_mut(sum.get().add(g * blocks), blocks),
                        std::slice::from_raw_parts_mut(dsum.get().add(g * blocks), blocks),
                    ))
                }
            });
            return;
        }
        let mut rowq = self.rowq.chunks_mut(rows);
        let mut qs = self.qs.chunks_mut(qs_len.max(1));
        let mut d = self.d.chunks_mut(blocks);
        let mut sum = self.sum.chunks_mut(blocks);
        let mut dsum = self.dsum.chunks_mut(blocks);
        const EACH: &str = "a slice of each buffer per group";
        for xs in x.chunks(rows) {
            group((
                xs,
                rowq.next().expect(EACH),
                if interleave {
                    qs.next().expect(EACH)
                } else {
                    &mut []
                },
                d.next().expect(EACH),
                sum.next().expect(EACH),
                dsum.next().expect(EACH),
            ));
        }
    }

    pub fn rows(&self) -> usize {
        self.m
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    pub(super) fn blocks(&self) -> usize {
        self.k / QK
    }

    pub(super) fn groups(&self) -> usize {
        self.m.div_ceil(GROUP)
    }

    /// Where row `r`'s scale, sum and `d * sum` of block `b` are, for a
    /// step of at most [`GROUP`] rows (all in group 0).
    #[inline(always)]
    pub(super) fn at(&self, b: usize, r: usize) -> usize {
        b * self.stride + r
    }
}

/// `v` as `len` zeros, or (`zeros` false) as `len` entries, kept as they
/// are where the length stays.
fn fit<T: Default + Clone>(v: &mut Vec<T>, len: usize, zeros: bool) {
    if zeros || v.len() != len {
        v.clear();
        v.resize(len, T::default());
    }
}

/// Steps of at most this many rows are multiplied by the AVX2 kernels'
/// direct path, which reads the activations row-major.
pub(super) const DIRECT_MAX: usize = 8;

/// Activation groups from which [`QActs::quantize`] spreads the groups
/// over the math threads (fewer: one thread, no hand-off).
const PARALLEL_GROUPS: usize = 4;

/// One group's rows of `x` and its slices of each [`QActs`] buffer.
type GroupSlices<'a> = (
    &'a [f32],
    &'a mut [i8],
    &'a mut [i8],
    &'a mut [f32],
    &'a mut [i32],
    &'a mut [f32],
);

/// [`fill_group`] with [`quantize_block_avx2`], its blocks' bits.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_group_avx2(k: usize, stride: usize, g: GroupSlices<'_>) {
    // SAFETY: this function's callers checked the CPU has AVX2.
    fill_group(k, stride, g, |x| unsafe { quantize_block_avx2(x) })
}

/// Quantises one group's rows (`xs`, at most [`GROUP`] rows of `k`) into
/// the group's slices of the [`QActs`] buffers (a block's scales `stride`
/// entries from the last's), a block at a time with `quant` (one of the
/// bit-identical [`quantize_block`]s).
#[inline(always)]
fn fill_group(
    k: usize,
    stride: usize,
    (xs, rowq, qs, d, sum, dsum): GroupSlices<'_>,
    quant: impl Fn(&[f32; QK]) -> (f32, [i8; QK], i32),
) {
    let nb = k / QK;
    for (lane, x) in xs.chunks_exact(k).enumerate() {
        for b in 0..nb {
            let xb: &[f32; QK] = x[b * QK..][..QK].try_into().expect("a whole block");
            let (db, q, sb) = quant(xb);
            let s = b * stride + lane;
            d[s] = db;
            sum[s] = sb;
            dsum[s] = db * sb as f32;
            rowq[lane * k + b * QK..][..QK].copy_from_slice(&q);
            if qs.is_empty() {
                continue;
            }
            let base = b * GROUP_BLOCK + lane * 4;
            for (t, chunk) in q.chunks_exact(4).enumerate() {
                qs[base + t * 32..][..4].copy_from_slice(chunk);
            }
        }
    }
}

/// [`quantize_block`] in AVX2 registers, with its bits: the same maximum
/// (exact in any order), the same division, rounding half away from zero
/// (the float below a half added with the quotient's sign, then truncated:
/// exact), the same clamp, and NaN quotients to 0 as Rust's float-to-int
/// cast makes them.
///
/// # Safety
/// The CPU has AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_block_avx2(x: &[f32; QK]) -> (f32, [i8; QK], i32) {
    use std::arch::x86_64::*;
    // SAFETY: the CPU has AVX2 (this function's contract); the loads read
    // the 32 floats of `x` and the store writes the 32 bytes of `q`.
    unsafe {
        let p = x.as_ptr();
        let v = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(p.add(o)));
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fff_ffff));
        // `max_ps` returns its second operand when the first is NaN: a NaN
        // value is skipped, as `f32::max` skips it.
        let mut m = _mm256_setzero_ps();
        for vi in v {
            m = _mm256_max_ps(_mm256_and_ps(vi, abs), m);
        }
        // The lanes' maximum in registers: exact in any order (no lane is
        // NaN, every lane at least 0).
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let m = _mm_max_ss(m, _mm_movehdup_ps(m));
        let amax = _mm_cvtss_f32(m);
        let d = amax / 127.0;
        let mut q = [0i8; QK];
        if d == 0.0 {
            return (0.0, q, 0);
        }
        let dv = _mm256_set1_ps(d);
        // The float just below 0.5: `y + ±below_half`, rounded to f32 and
        // truncated, is `y` rounded half away from zero for every finite
        // `y` (a sum that lands between two floats can round up to the next
        // integer only where the fraction is exactly one half, and one a
        // float below a half, 0.5 - 2^-25, stays below 1), and keeps
        // infinities and NaN. Four operations fewer per vector than taking
        // the fraction apart.
        let below_half = _mm256_set1_ps(f32::from_bits(0x3eff_ffff)); // 0.5 - 2^-25
        let sign = _mm256_castsi256_ps(_mm256_set1_epi32(i32::MIN));
        let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
        let ints = v.map(|vi| {
            let y = _mm256_div_ps(vi, dv);
            let r = _mm256_add_ps(y, _mm256_or_ps(below_half, _mm256_and_ps(y, sign)));
            // NaN lanes to 0, then the clamp; the conversion truncates.
            let r = _mm256_and_ps(r, _mm256_cmp_ps::<_CMP_ORD_Q>(r, r));
            _mm256_cvttps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi))
        });
        let s = _mm256_add_epi32(
            _mm256_add_epi32(ints[0], ints[1]),
            _mm256_add_epi32(ints[2], ints[3]),
        );
        // The sum in registers: integers, exact in any order.
        let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256::<1>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s));
        // i32 -> i16 -> i8 packs work within 128-bit halves: the final
        // permutation puts the four 8-value runs back in order.
        let w01 = _mm256_packs_epi32(ints[0], ints[1]);
        let w23 = _mm256_packs_epi32(ints[2], ints[3]);
        let b = _mm256_packs_epi16(w01, w23);
        let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, b);
        (d, q, _mm_cvtsi128_si32(s))
    }
}

/// One block: `(d, q, Σq)`.
#[inline(always)]
pub(super) fn quantize_block(x: &[f32; QK]) -> (f32, [i8; QK], i32) {
    // The largest magnitude, in 8 lanes (a maximum is exact in any order,
    // so this is the left-to-right fold's value, without its dependency chain).
    let mut lanes = [0f32; 8];
    for c in x.chunks_exact(8) {
        for (m, v) in lanes.iter_mut().zip(c) {
            *m = m.max(v.abs());
        }
    }
    let amax = lanes.iter().fold(0f32, |a, &v| a.max(v));
    let d = amax / 127.0;
    let mut q = [0i8; QK];
    let mut sum = 0;
    if d != 0.0 {
        for (qi, &v) in q.iter_mut().zip(x) {
            *qi = (v / d).round().clamp(-127.0, 127.0) as i8;
            sum += *qi as i32;
        }
    }
    (if d != 0.0 { d } else { 0.0 }, q, sum)
}
