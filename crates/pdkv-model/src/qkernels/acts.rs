//! Activations quantised once per step for the block-format matmuls
//! ([`QActs`]): 8-bit values and an f32 scale per 32-value block, rows
//! interleaved in groups of 8 for the SIMD kernels.

use super::flavour::{has, Flavour};
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
/// its scale, sum and `d * sum` are at `(g*nb + b)*8 + l`.
///
/// Reusable: [`QActs::quantize`] keeps its buffers' capacity (a step
/// allocates nothing once warm).
pub struct QActs {
    pub(super) m: usize,
    pub(super) k: usize,
    pub(super) qs: Vec<i8>,
    /// The same values row-major (`[m, k]`), for rows computed one at a time.
    pub(super) rowq: Vec<i8>,
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
        self.m = m;
        self.k = k;
        self.qs.clear();
        self.qs.resize(groups * nb * GROUP_BLOCK, 0);
        self.rowq.clear();
        self.rowq.resize(m * k, 0);
        for v in [&mut self.d, &mut self.dsum] {
            v.clear();
            v.resize(groups * nb * GROUP, 0.0);
        }
        self.sum.clear();
        self.sum.resize(groups * nb * GROUP, 0);
        if m * k == 0 {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        let avx2 = has(Flavour::Avx2);
        let group = |g: GroupSlices<'_>| {
            #[cfg(target_arch = "x86_64")]
            if avx2 {
                // SAFETY: the CPU has AVX2 and FMA.
                return unsafe { fill_group_avx2(k, g) };
            }
            fill_group(k, g)
        };
        // Groups are independent (each owns its slice of every buffer), so
        // a prefill's are quantised on every math thread; the bits are the
        // same either way.
        let x = &x[..m * k];
        let (rows, blocks) = (GROUP * k, nb * GROUP);
        let mut rowq = self.rowq.chunks_mut(rows);
        let mut qs = self.qs.chunks_mut(nb * GROUP_BLOCK);
        let mut d = self.d.chunks_mut(blocks);
        let mut sum = self.sum.chunks_mut(blocks);
        let mut dsum = self.dsum.chunks_mut(blocks);
        const EACH: &str = "a slice of each buffer per group";
        let all = x.chunks(rows).map(|xs| {
            (
                xs,
                rowq.next().expect(EACH),
                qs.next().expect(EACH),
                d.next().expect(EACH),
                sum.next().expect(EACH),
                dsum.next().expect(EACH),
            )
        });
        if groups >= PARALLEL_GROUPS {
            let mut each: Vec<Option<GroupSlices<'_>>> = all.map(Some).collect();
            crate::team::par_for_each_mut(&mut each, |_, g| {
                group(g.take().expect("each group taken once"))
            });
        } else {
            all.for_each(group);
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
}

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

/// [`fill_group`] compiled for AVX2, so the block loops vectorise.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fill_group_avx2(k: usize, g: GroupSlices<'_>) {
    fill_group(k, g)
}

/// Quantises one group's rows (`xs`, at most [`GROUP`] rows of `k`) into
/// the group's slices of the [`QActs`] buffers.
#[inline(always)]
fn fill_group(k: usize, (xs, rowq, qs, d, sum, dsum): GroupSlices<'_>) {
    let nb = k / QK;
    for (lane, x) in xs.chunks_exact(k).enumerate() {
        for b in 0..nb {
            let xb: &[f32; QK] = x[b * QK..][..QK].try_into().expect("a whole block");
            let (db, q, sb) = quantize_block(xb);
            let s = b * GROUP + lane;
            d[s] = db;
            sum[s] = sb;
            dsum[s] = db * sb as f32;
            rowq[lane * k + b * QK..][..QK].copy_from_slice(&q);
            let base = b * GROUP_BLOCK + lane * 4;
            for (t, chunk) in q.chunks_exact(4).enumerate() {
                qs[base + t * 32..][..4].copy_from_slice(chunk);
            }
        }
    }
}

/// One block: `(d, q, Σq)`.
#[inline(always)]
pub(super) fn quantize_block(x: &[f32; QK]) -> (f32, [i8; QK], i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
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
