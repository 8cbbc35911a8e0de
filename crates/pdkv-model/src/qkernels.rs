//! Matrix multiply of f32 activations against weights kept in GGUF block
//! formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1), computing on the blocks directly.
//!
//! Activations are quantised once per step ([`QActs`]): every 32-value block
//! of a row gets an f32 scale `d = max|x| / 127` and 32 `i8` values
//! `q = round(x / d)`. They are stored interleaved in groups of 8 rows, so
//! that one 256-bit vector holds the same 4 values of a block for 8 rows and
//! the SIMD kernels compute 8 output rows at once, one per lane.
//!
//! Invariant (as in [`crate::kernels`]): every output element is produced by
//! one fixed sequence of floating-point operations on its own inputs. Per
//! block `b` the integer dot `I_b = Σ qw·qx` is exact in i32 (however it is
//! computed: its magnitude stays below 2^20), and then, from `acc = 0` and
//! for `b = 0, 1, ...` in order,
//!
//! - Q8_0 (signed values): `acc = fma(I_b, dw_b * dx_b, acc)`,
//! - the unsigned formats (Q4_0, Q4_1, Q5_0, Q5_1; `x = dw*q + mw` with
//!   `mw` Q4_0's `-8 dw`, Q5_0's `-16 dw`, or the stored minimum): the same,
//!   then `acc = fma(mw_b, dx_b * Σqx_b, acc)`,
//!
//! and `y = acc` (the portable backend rounds the multiply and the add
//! separately instead of fusing them). A vector lane is one output element,
//! never part of one, so the batch size, a row's position in it, the tiling
//! and the thread split change nothing. The AVX2 and AVX-512 VNNI flavours
//! differ only in how they reach the exact `I_b`, so they agree bit for bit
//! and the choice between them cannot show in results.

use std::cell::RefCell;
use std::sync::OnceLock;

use rayon::prelude::*;

use crate::dispatch::Backend;

pub use crate::qtype::{QType, QK, QK_K};

/// Activation rows per interleaved group: one per lane of an 8 x f32 vector.
const GROUP: usize = 8;
/// Bytes of one block of one group: 8 chunks of 4 values, each for 8 rows.
const GROUP_BLOCK: usize = GROUP * QK;

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
    m: usize,
    k: usize,
    qs: Vec<i8>,
    /// The same values row-major (`[m, k]`), for rows computed one at a time.
    rowq: Vec<i8>,
    d: Vec<f32>,
    sum: Vec<i32>,
    /// `d * (sum as f32)`, the activation side of the Q4_1 minimum term.
    dsum: Vec<f32>,
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
        if groups >= PARALLEL_GROUPS {
            (
                x.par_chunks(rows),
                self.rowq.par_chunks_mut(rows),
                self.qs.par_chunks_mut(nb * GROUP_BLOCK),
                self.d.par_chunks_mut(blocks),
                self.sum.par_chunks_mut(blocks),
                self.dsum.par_chunks_mut(blocks),
            )
                .into_par_iter()
                .for_each(group);
        } else {
            let mut rowq = self.rowq.chunks_mut(rows);
            let mut qs = self.qs.chunks_mut(nb * GROUP_BLOCK);
            let mut d = self.d.chunks_mut(blocks);
            let mut sum = self.sum.chunks_mut(blocks);
            let mut dsum = self.dsum.chunks_mut(blocks);
            const EACH: &str = "a slice of each buffer per group";
            for xs in x.chunks(rows) {
                group((
                    xs,
                    rowq.next().expect(EACH),
                    qs.next().expect(EACH),
                    d.next().expect(EACH),
                    sum.next().expect(EACH),
                    dsum.next().expect(EACH),
                ));
            }
        }
    }

    pub fn rows(&self) -> usize {
        self.m
    }

    pub fn cols(&self) -> usize {
        self.k
    }

    fn blocks(&self) -> usize {
        self.k / QK
    }

    fn groups(&self) -> usize {
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
fn quantize_block(x: &[f32; QK]) -> (f32, [i8; QK], i32) {
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

/// Exact f16 -> f32 by bit manipulation (normal, subnormal, infinite and NaN
/// values), so no F16C instruction is needed. Subnormals rely on the default
/// floating-point environment (no flush to zero).
#[inline(always)]
fn f16_to_f32(h: u16) -> f32 {
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

#[inline(always)]
fn f16_at(p: *const u8) -> f32 {
    // SAFETY (callers): `p` points at 2 readable bytes.
    f16_to_f32(u16::from_le_bytes(unsafe { [*p, *p.add(1)] }))
}

/// One quantised weight matrix `[n, k]` (rows of `ty.row_bytes(k)` bytes, GGUF block layout) and its output `[m, n]`.
pub struct QLinear<'a> {
    pub ty: QType,
    pub w: &'a [u8],
    pub n: usize,
    pub y: &'a mut [f32],
}

/// `y[r][j] = Σ_blocks dot(x_block, w_block)` for every matrix, on the
/// current rayon pool (like [`crate::kernels::matmul_many`]: output features
/// `j` are split into jobs, never `k`).
pub fn qmatmul_many(x: &QActs, outs: &mut [QLinear<'_>]) {
    qmatmul_many_with(crate::dispatch::backend(), x, outs)
}

/// [`qmatmul_many`] with an explicit backend (tests exercise every one available).
pub fn qmatmul_many_with(be: Backend, x: &QActs, outs: &mut [QLinear<'_>]) {
    run_many(Flavour::of(be), x, outs)
}

/// How a backend computes the integer block dots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Flavour {
    Portable,
    /// `maddubs` + `madd`, AVX2, FMA and F16C.
    Avx2,
    /// `vpdpbusd` on 256-bit vectors (AVX-512 VNNI and VL), plus AVX2 and FMA.
    Vnni,
}

impl Flavour {
    /// The flavour of a backend: [`Backend::Avx2Fma`] uses VNNI when the CPU has it.
    fn of(be: Backend) -> Flavour {
        match be {
            Backend::Portable => Flavour::Portable,
            Backend::Avx2Fma => {
                assert!(
                    has(Flavour::Avx2),
                    "the Avx2Fma backend needs a CPU with AVX2 and FMA"
                );
                if has(Flavour::Vnni) {
                    Flavour::Vnni
                } else {
                    Flavour::Avx2
                }
            }
        }
    }
}

/// Whether this CPU can run `f` (detected once).
fn has(f: Flavour) -> bool {
    static CPU: OnceLock<(bool, bool)> = OnceLock::new();
    let &(avx2, vnni) = CPU.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            let avx2 = is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c");
            let vnni = avx2
                && is_x86_feature_detected!("avx512vnni")
                && is_x86_feature_detected!("avx512vl");
            (avx2, vnni)
        }
        #[cfg(not(target_arch = "x86_64"))]
        (false, false)
    });
    match f {
        Flavour::Portable => true,
        Flavour::Avx2 => avx2,
        Flavour::Vnni => vnni,
    }
}

use crate::dispatch::{for_each_job_of, SendConstPtr, SendPtr};

/// Weight rows per register tile of the SIMD flavours.
const NR: usize = 4;

/// Columns `j0..j1` of one matrix's output.
struct Job {
    ty: QType,
    w: *const u8,
    y: *mut f32,
    n: usize,
    j0: usize,
    j1: usize,
}

fn run_many(fl: Flavour, x: &QActs, outs: &mut [QLinear<'_>]) {
    let (m, k) = (x.m, x.k);
    for o in outs.iter() {
        assert!(!o.ty.is_half(), "{:?} takes f32 activations", o.ty);
        assert!(
            k % o.ty.block_values() == 0,
            "{:?} rows are whole blocks of {} values, k = {k}",
            o.ty,
            o.ty.block_values()
        );
        let rb = o.ty.row_bytes(k);
        assert!(
            o.w.len() >= o.n * rb,
            "w has {} bytes, need {} rows of {} ({:?}, k = {})",
            o.w.len(),
            o.n,
            rb,
            o.ty,
            k
        );
        assert!(
            o.y.len() >= m * o.n,
            "y has {} floats, need {}x{}",
            o.y.len(),
            m,
            o.n
        );
    }
    assert!(has(fl), "{fl:?} is not available on this CPU");
    if m == 0 {
        return;
    }
    let view = |o: &mut QLinear<'_>| {
        let p = (
            o.ty,
            SendConstPtr(o.w.as_ptr()),
            SendPtr(o.y.as_mut_ptr()),
            o.n,
        );
        (p, o.n)
    };
    for_each_job_of(outs, NR, view, |(ty, w, y, n), j0, j1| {
        let job = Job {
            ty,
            w: w.get(),
            y: y.0,
            n,
            j0,
            j1,
        };
        // SAFETY: shapes were checked above; jobs write disjoint column
        // ranges of their `y`, every `y` is a distinct &mut borrow, and the
        // flavour was checked against the CPU.
        unsafe { run_job(fl, x, &job) }
    });
}

/// # Safety
/// `job.w` holds `job.n` rows, `job.y` `m * job.n` floats of which no one
/// else writes columns `j0..j1`; the CPU supports `fl`.
unsafe fn run_job(fl: Flavour, x: &QActs, job: &Job) {
    match fl {
        #[cfg(target_arch = "x86_64")]
        Flavour::Avx2 | Flavour::Vnni => SCRATCH.with(|s| {
            let s = &mut *s.borrow_mut();
            if fl == Flavour::Vnni {
                simd::run_job_vnni(x, job, s)
            } else {
                simd::run_job_avx2(x, job, s)
            }
        }),
        _ => portable::run_job(x, job),
    }
}

/// Weight rows of one register tile, unpacked once and reused by every
/// activation group: per row `c`, block `b`, the scale `dw[c*nb + b]`, and
/// the 32 values as bytes at `vals[(c*nb + b)*32..]` (an unsigned format's
/// values; Q8_0's plus 128, for VNNI's unsigned operand), and an unsigned
/// format's minimum `mw[c*nb + b]`.
#[derive(Default)]
struct Scratch {
    vals: Vec<u8>,
    dw: Vec<f32>,
    mw: Vec<f32>,
    /// Q6_K's two i8 scales per block.
    sc6: Vec<[i32; 2]>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

impl Scratch {
    /// Makes room for `rows` weight rows of `nb` blocks (growing only).
    fn reserve(&mut self, rows: usize, nb: usize) {
        let grow = |len: usize, want: usize| want.saturating_sub(len);
        self.vals.extend(std::iter::repeat_n(
            0,
            grow(self.vals.len(), rows * nb * QK),
        ));
        self.dw
            .extend(std::iter::repeat_n(0.0, grow(self.dw.len(), rows * nb)));
        self.mw
            .extend(std::iter::repeat_n(0.0, grow(self.mw.len(), rows * nb)));
        self.sc6
            .extend(std::iter::repeat_n([0; 2], grow(self.sc6.len(), rows * nb)));
    }
}

/// Value `i` (0..32) of an unsigned-format block.
fn unsigned_value(ty: QType, blk: &[u8], i: usize) -> u8 {
    let byte = blk[ty.nibbles_at() + i % 16];
    let mut v = if i < 16 { byte & 0x0f } else { byte >> 4 };
    if let Some(h) = ty.high_bits_at() {
        let bits = u32::from_le_bytes([blk[h], blk[h + 1], blk[h + 2], blk[h + 3]]);
        v |= (((bits >> i) & 1) as u8) << 4;
    }
    v
}

/// `mw` of an unsigned-format block: `x = d*q + mw`.
fn min_of(ty: QType, blk: &[u8]) -> f32 {
    if ty.stored_min() {
        f16_at(blk[2..].as_ptr())
    } else {
        ty.min_factor() * f16_at(blk.as_ptr())
    }
}

/// Block `b` (32 values) of a super-block-format row: its scale and
/// minimum (`x = dw*q + mw`: `dw = d*sc`, `mw = -dmin*m`, both exact in f32)
/// and where its super-block starts.
fn super_params(ty: QType, row: *const u8, b: usize) -> (f32, f32, *const u8) {
    // SAFETY (callers): `row` holds the super-block of block `b`.
    let blk = unsafe { row.add(b / 8 * ty.block_bytes()) };
    let scales: &[u8; 12] = unsafe { &*(blk.add(4) as *const [u8; 12]) };
    let (sc, m) = crate::gguf::k_scale_min(scales, b % 8);
    let (d, dmin) = (f16_at(blk), f16_at(unsafe { blk.add(2) }));
    (d * sc as f32, -(dmin * m as f32), blk)
}

/// Value `i` (0..32) of block `j` (0..8) of a Q4_K/Q5_K super-block.
fn super_value(ty: QType, blk: &[u8], j: usize, i: usize) -> u8 {
    crate::gguf::k45_value(blk, ty == QType::Q5_K, j, i)
}

/// Block `b` (32 values) of a Q6_K row: `d`, the i8 scales of its two
/// halves of 16 values, and its super-block.
fn q6_params(row: *const u8, b: usize) -> (f32, [i32; 2], *const u8) {
    // SAFETY (callers): `row` holds the super-block of block `b`.
    let blk = unsafe { row.add(b / 8 * QType::Q6_K.block_bytes()) };
    let (h, g) = ((b % 8) / 4, b % 4);
    let sc = |i: usize| unsafe { *blk.add(192 + h * 8 + 2 * g + i) } as i8 as i32;
    (f16_at(unsafe { blk.add(208) }), [sc(0), sc(1)], blk)
}

/// Value `i` (0..32, unsigned: the weight is `q - 32`) of block `j` (0..8)
/// of a Q6_K super-block.
fn q6_value(blk: &[u8], j: usize, i: usize) -> u8 {
    crate::gguf::k6_value(blk, j * QK + i)
}

mod portable {
    use super::{
        f16_at, min_of, q6_params, q6_value, super_params, super_value, unsigned_value, Job, QActs,
        QType, GROUP, GROUP_BLOCK, QK,
    };

    /// One element at a time, straight from the GGUF blocks.
    pub(super) unsafe fn run_job(x: &QActs, job: &Job) {
        let nb = x.blocks();
        let (bb, rb) = (job.ty.block_bytes(), job.ty.row_bytes(x.k));
        for j in job.j0..job.j1 {
            let wr = job.w.add(j * rb);
            for r in 0..x.m {
                let (g, lane) = (r / GROUP, r % GROUP);
                let mut acc = 0f32;
                for b in 0..nb {
                    let s = (g * nb + b) * GROUP + lane;
                    let xq = &x.qs[(g * nb + b) * GROUP_BLOCK + lane * 4..];
                    let qx = |i: usize| xq[(i / 4) * 32 + i % 4] as i32;
                    if job.ty == QType::Q6_K {
                        let (d, sc, blk) = q6_params(wr, b);
                        let blk = std::slice::from_raw_parts(blk, bb);
                        let isum: i32 = (0..QK)
                            .map(|i| sc[i / 16] * (q6_value(blk, b % 8, i) as i32 - 32) * qx(i))
                            .sum();
                        acc += isum as f32 * (d * x.d[s]);
                        continue;
                    }
                    if job.ty.is_super() {
                        let (dw, mw, blk) = super_params(job.ty, wr, b);
                        let blk = std::slice::from_raw_parts(blk, bb);
                        let isum: i32 = (0..QK)
                            .map(|i| super_value(job.ty, blk, b % 8, i) as i32 * qx(i))
                            .sum();
                        acc += isum as f32 * (dw * x.d[s]);
                        acc += mw * x.dsum[s];
                        continue;
                    }
                    let blk = std::slice::from_raw_parts(wr.add(b * bb), bb);
                    let dw = f16_at(blk.as_ptr());
                    if job.ty.unsigned() {
                        let isum: i32 = (0..QK)
                            .map(|i| unsigned_value(job.ty, blk, i) as i32 * qx(i))
                            .sum();
                        acc += isum as f32 * (dw * x.d[s]);
                        acc += min_of(job.ty, blk) * x.dsum[s];
                    } else {
                        let isum: i32 = (0..QK).map(|i| blk[2 + i] as i8 as i32 * qx(i)).sum();
                        acc += isum as f32 * (dw * x.d[s]);
                    }
                }
                *job.y.add(r * job.n + j) = acc;
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use std::arch::x86_64::*;

    use super::{
        f16_at, min_of, q6_params, super_params, Job, QActs, QType, Scratch, GROUP, GROUP_BLOCK,
        NR, QK,
    };

    /// Where a tile's weights are: `C` rows from `w` (stride `rb` bytes)
    /// and their unpacked form in `s`.
    struct Tile<'a> {
        w: *const u8,
        rb: usize,
        nb: usize,
        s: &'a Scratch,
    }

    /// The integer half of a block dot: 8 exact i32 lanes (one per activation
    /// row of the group) for each of `C` weight rows.
    trait IDot {
        /// # Safety
        /// `xb` is a group's block `b` (256 bytes), `sumx` its 8 sums; `t`
        /// holds `C` rows.
        unsafe fn q8<const C: usize>(
            xb: *const i8,
            sumx: *const i32,
            t: &Tile<'_>,
            b: usize,
        ) -> [__m256i; C];
        unsafe fn qu<const C: usize>(xb: *const i8, t: &Tile<'_>, b: usize) -> [__m256i; C];
        /// Whether [`IDot::r8`] leaves `128 * Σx` to subtract.
        const R8_OFFSET: bool;
        /// How [`IDot::r8`] wants a Q8_0 block's 32 values (as loaded).
        unsafe fn w8(w: __m256i) -> __m256i;
        /// One row's block `x` (32 i8) against a weight block prepared by
        /// [`IDot::w8`]: 8 i32 lanes summing to the dot.
        unsafe fn r8(x: __m256i, w: __m256i) -> __m256i;
        /// The same for 32 unsigned weight values (at most 31) as bytes.
        unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i;
    }

    /// A 4-value chunk of a weight row, broadcast to every lane.
    #[inline(always)]
    unsafe fn bcast(p: *const u8) -> __m256i {
        _mm256_set1_epi32((p as *const i32).read_unaligned())
    }

    /// Chunk `i` (values `4i..4i+4`) of Q8_0 block `b` of tile row `c`.
    #[inline(always)]
    unsafe fn q8_chunk(t: &Tile<'_>, c: usize, b: usize, i: usize) -> __m256i {
        bcast(t.w.add(c * t.rb + b * 34 + 2 + i * 4))
    }

    /// Chunk `i` of the unpacked block `b` of tile row `c` (an unsigned
    /// format's values, or Q8_0's plus 128).
    #[inline(always)]
    unsafe fn unpacked_chunk(t: &Tile<'_>, c: usize, b: usize, i: usize) -> __m256i {
        bcast(t.s.vals.as_ptr().add((c * t.nb + b) * QK + i * 4))
    }

    struct Avx2;

    impl IDot for Avx2 {
        /// `|w|` as unsigned times `x` with the sign of `w` (`|w|` may be 128;
        /// pair sums stay within i16), then pairs of i16 summed to i32.
        #[inline(always)]
        unsafe fn q8<const C: usize>(
            xb: *const i8,
            _sumx: *const i32,
            t: &Tile<'_>,
            b: usize,
        ) -> [__m256i; C] {
            let ones = _mm256_set1_epi16(1);
            let mut isum = [_mm256_setzero_si256(); C];
            for i in 0..QK / 4 {
                let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                for (c, acc) in isum.iter_mut().enumerate() {
                    let wv = q8_chunk(t, c, b, i);
                    let p = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
                    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(p, ones));
                }
            }
            isum
        }

        /// Unsigned values (at most 31) times `x`; 4 chunks of i16 pair sums
        /// stay below 4 * 2 * 31 * 127 = 31496, so each half block adds up
        /// in i16 before it is widened.
        #[inline(always)]
        unsafe fn qu<const C: usize>(xb: *const i8, t: &Tile<'_>, b: usize) -> [__m256i; C] {
            let ones = _mm256_set1_epi16(1);
            let mut isum = [_mm256_setzero_si256(); C];
            for half in [0, QK / 8] {
                let mut s16 = [_mm256_setzero_si256(); C];
                for i in half..half + QK / 8 {
                    let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                    for (c, acc) in s16.iter_mut().enumerate() {
                        *acc = _mm256_add_epi16(
                            *acc,
                            _mm256_maddubs_epi16(unpacked_chunk(t, c, b, i), xv),
                        );
                    }
                }
                for (acc, v) in isum.iter_mut().zip(s16) {
                    *acc = _mm256_add_epi32(*acc, _mm256_madd_epi16(v, ones));
                }
            }
            isum
        }

        const R8_OFFSET: bool = false;

        #[inline(always)]
        unsafe fn w8(w: __m256i) -> __m256i {
            w
        }

        #[inline(always)]
        unsafe fn r8(x: __m256i, w: __m256i) -> __m256i {
            let p = _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(x, w));
            _mm256_madd_epi16(p, _mm256_set1_epi16(1))
        }

        #[inline(always)]
        unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i {
            _mm256_madd_epi16(_mm256_maddubs_epi16(nib, x), _mm256_set1_epi16(1))
        }
    }

    struct Vnni;

    impl IDot for Vnni {
        /// `(w + 128)` as unsigned times `x`, minus `128 * Σx`.
        #[inline(always)]
        unsafe fn q8<const C: usize>(
            xb: *const i8,
            sumx: *const i32,
            t: &Tile<'_>,
            b: usize,
        ) -> [__m256i; C] {
            // `prep` left `w + 128` in the scratch, where Q4_1 keeps its nibbles.
            let mut isum = [_mm256_setzero_si256(); C];
            for i in 0..QK / 4 {
                let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                for (c, acc) in isum.iter_mut().enumerate() {
                    *acc = _mm256_dpbusd_epi32(*acc, unpacked_chunk(t, c, b, i), xv);
                }
            }
            let corr = _mm256_slli_epi32::<7>(_mm256_loadu_si256(sumx as *const __m256i));
            isum.map(|v| _mm256_sub_epi32(v, corr))
        }

        #[inline(always)]
        unsafe fn qu<const C: usize>(xb: *const i8, t: &Tile<'_>, b: usize) -> [__m256i; C] {
            let mut isum = [_mm256_setzero_si256(); C];
            for i in 0..QK / 4 {
                let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                for (c, acc) in isum.iter_mut().enumerate() {
                    *acc = _mm256_dpbusd_epi32(*acc, unpacked_chunk(t, c, b, i), xv);
                }
            }
            isum
        }

        const R8_OFFSET: bool = true;

        /// `w + 128` as unsigned bytes.
        #[inline(always)]
        unsafe fn w8(w: __m256i) -> __m256i {
            _mm256_xor_si256(w, _mm256_set1_epi8(-128))
        }

        #[inline(always)]
        unsafe fn r8(x: __m256i, w: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x)
        }

        #[inline(always)]
        unsafe fn r4(x: __m256i, nib: __m256i) -> __m256i {
            _mm256_dpbusd_epi32(_mm256_setzero_si256(), nib, x)
        }
    }

    /// Unpacks the scales, values (and unsigned formats' minimums) of `rows` rows.
    #[inline(always)]
    unsafe fn prep(s: &mut Scratch, ty: QType, w: *const u8, rb: usize, rows: usize, nb: usize) {
        s.reserve(rows, nb);
        let bb = ty.block_bytes();
        if ty.is_super() {
            for c in 0..rows {
                for b in 0..nb {
                    let i = c * nb + b;
                    let v = s.vals.as_mut_ptr().add(i * QK) as *mut __m256i;
                    if ty == QType::Q6_K {
                        let (d, sc, blk) = q6_params(w.add(c * rb), b);
                        (s.dw[i], s.sc6[i]) = (d, sc);
                        _mm256_storeu_si256(v, unpack_q6(blk, b % 8));
                    } else {
                        let (dw, mw, blk) = super_params(ty, w.add(c * rb), b);
                        (s.dw[i], s.mw[i]) = (dw, mw);
                        _mm256_storeu_si256(v, unpack_super(ty, blk, b % 8));
                    }
                }
            }
            return;
        }
        for c in 0..rows {
            for b in 0..nb {
                let blk = w.add(c * rb + b * bb);
                let i = c * nb + b;
                s.dw[i] = f16_at(blk);
                let v = s.vals.as_mut_ptr().add(i * QK);
                if ty.unsigned() {
                    s.mw[i] = min_of(ty, std::slice::from_raw_parts(blk, bb));
                    _mm256_storeu_si256(v as *mut __m256i, unpack_unsigned(ty, blk));
                } else {
                    // Q8_0's values as `w + 128`, the unsigned operand VNNI takes.
                    let flip = _mm_set1_epi8(-128);
                    for h in [0, 16] {
                        let q = _mm_loadu_si128(blk.add(2 + h) as *const __m128i);
                        _mm_storeu_si128(v.add(h) as *mut __m128i, _mm_xor_si128(q, flip));
                    }
                }
            }
        }
    }

    /// The 32 values of an unsigned-format block as bytes, in order (the
    /// low 128 bits hold values 0..16).
    #[inline(always)]
    unsafe fn unpack_unsigned(ty: QType, blk: *const u8) -> __m256i {
        let low = _mm_set1_epi8(0x0f);
        let q = _mm_loadu_si128(blk.add(ty.nibbles_at()) as *const __m128i);
        let mut v = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(q), low),
            _mm_and_si128(q, low),
        );
        if let Some(h) = ty.high_bits_at() {
            // Byte i takes byte i/8 of the 32 bits, then keeps its bit i%8.
            let bits = _mm256_set1_epi32((blk.add(h) as *const i32).read_unaligned());
            let spread = _mm256_shuffle_epi8(
                bits,
                _mm256_setr_epi8(
                    0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3,
                    3, 3, 3, 3, 3, 3,
                ),
            );
            let mask = _mm256_set1_epi64x(0x8040_2010_0804_0201_u64 as i64);
            let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, mask), mask);
            v = _mm256_or_si256(v, _mm256_and_si256(set, _mm256_set1_epi8(0x10)));
        }
        v
    }

    /// The 32 values of block `j` of a Q4_K/Q5_K super-block as bytes, in
    /// order (see [`super::super_value`]).
    #[inline(always)]
    unsafe fn unpack_super(ty: QType, blk: *const u8, j: usize) -> __m256i {
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

    /// The 32 unsigned values (`q`, the weight being `q - 32`) of block `j`
    /// of a Q6_K super-block as bytes, in order (see [`super::q6_value`]).
    #[inline(always)]
    unsafe fn unpack_q6(blk: *const u8, j: usize) -> __m256i {
        let (h, g) = (j / 4, j % 4);
        let low = _mm256_set1_epi8(0x0f);
        let ql = _mm256_loadu_si256(blk.add(h * 64 + (g % 2) * 32) as *const __m256i);
        let lo = if g < 2 {
            _mm256_and_si256(ql, low)
        } else {
            _mm256_and_si256(_mm256_srli_epi16::<4>(ql), low)
        };
        // Bits 2g..2g+2 of each high-bit byte (16-bit shifts keep every
        // byte's own bits: 2g < 8), moved to bits 4..6.
        let qh = _mm256_loadu_si256(blk.add(128 + h * 32) as *const __m256i);
        let hi = _mm256_and_si256(
            _mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * g as i32)),
            _mm256_set1_epi8(3),
        );
        _mm256_or_si256(lo, _mm256_slli_epi16::<4>(hi))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn run_job_avx2(x: &QActs, job: &Job, s: &mut Scratch) {
        run_job::<Avx2>(x, job, s)
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    pub(super) unsafe fn run_job_vnni(x: &QActs, job: &Job, s: &mut Scratch) {
        run_job::<Vnni>(x, job, s)
    }

    /// Tiles of `NR` weight rows; each tile is unpacked once, then every
    /// activation group sweeps it. A step of at most [`DIRECT_MAX`] rows
    /// (decode at small batch) reads the blocks in place instead.
    #[inline(always)]
    unsafe fn run_job<D: IDot>(x: &QActs, job: &Job, s: &mut Scratch) {
        if x.m <= DIRECT_MAX {
            return match job.ty {
                QType::Q8_0 => direct::<D, 0>(x, job),
                QType::Q4_0 => direct::<D, 1>(x, job),
                QType::Q4_1 => direct::<D, 2>(x, job),
                QType::Q5_0 => direct::<D, 3>(x, job),
                QType::Q5_1 => direct::<D, 4>(x, job),
                QType::Q4_K => direct_super::<D, false>(x, job),
                QType::Q5_K => direct_super::<D, true>(x, job),
                QType::Q6_K => direct_q6::<D>(x, job),
                QType::F16 | QType::BF16 => unreachable!("run_many refuses them"),
            };
        }
        let (nb, rb) = (x.blocks(), job.ty.row_bytes(x.k));
        let mut j = job.j0;
        while j < job.j1 {
            let nr = NR.min(job.j1 - j);
            prep(s, job.ty, job.w.add(j * rb), rb, nr, nb);
            let t = Tile {
                w: job.w.add(j * rb),
                rb,
                nb,
                s,
            };
            for g in 0..x.groups() {
                let rows = GROUP.min(x.m - g * GROUP);
                let out = &mut [[0f32; GROUP]; NR];
                match (job.ty.unsigned(), nr) {
                    _ if job.ty == QType::Q6_K => match nr {
                        4 => tile_q6::<D, 4>(x, &t, g, out),
                        3 => tile_q6::<D, 3>(x, &t, g, out),
                        2 => tile_q6::<D, 2>(x, &t, g, out),
                        _ => tile_q6::<D, 1>(x, &t, g, out),
                    },
                    (false, 4) => tile::<D, 4, false>(x, &t, g, out),
                    (false, 3) => tile::<D, 3, false>(x, &t, g, out),
                    (false, 2) => tile::<D, 2, false>(x, &t, g, out),
                    (false, _) => tile::<D, 1, false>(x, &t, g, out),
                    (true, 4) => tile::<D, 4, true>(x, &t, g, out),
                    (true, 3) => tile::<D, 3, true>(x, &t, g, out),
                    (true, 2) => tile::<D, 2, true>(x, &t, g, out),
                    (true, _) => tile::<D, 1, true>(x, &t, g, out),
                }
                for (c, col) in out[..nr].iter().enumerate() {
                    for (l, &v) in col[..rows].iter().enumerate() {
                        *job.y.add((g * GROUP + l) * job.n + j + c) = v;
                    }
                }
            }
            j += nr;
        }
    }

    /// Steps with at most this many activation rows take [`direct`].
    const DIRECT_MAX: usize = 4;
    /// Weight rows per [`direct`] tile: one per lane.
    const DR: usize = 8;

    /// Activation rows (at most [`DIRECT_MAX`], all in group 0) against 8
    /// weight rows at a time, a lane per weight row, reading each block in
    /// place: the values are unpacked in registers, the 8 scales (and
    /// minimums) gathered and widened from f16 in one go, and the exact
    /// block dots brought into lanes with integer horizontal adds. The float
    /// sequence per element is the tile path's, so the results are its bits.
    #[inline(always)]
    unsafe fn direct<D: IDot, const T: usize>(x: &QActs, job: &Job) {
        // The format is a constant of each instance: its branches fold away.
        let ty = QType::ALL[T];
        let u = ty.unsigned();
        let (nb, k, m) = (x.blocks(), x.k, x.m);
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        // The job's first tile is fetched up front (its later tiles are
        // fetched ahead, one by one, while the tile before is computed).
        prefetch(
            job.w.wrapping_add(job.j0 * rb),
            DR.min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            // A short tile repeats its last row; the extra lanes are dropped.
            let row = |c: usize| c.min(nr - 1) * rb;
            let base = job.w.add(j * rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            // The tile's 8 rows are 8 streams too short for the hardware
            // prefetcher to pick up, so the next tile (contiguous) is fetched
            // ahead, a block column's worth of its bytes per block.
            let next = base.wrapping_add(DR * rb);
            for b in 0..nb {
                prefetch(next.wrapping_add(b * DR * bb), DR * bb);
                let blk = base.add(b * bb);
                let mut wv = [_mm256_setzero_si256(); DR];
                for (c, w) in wv.iter_mut().enumerate() {
                    let p = blk.add(row(c));
                    *w = if u {
                        unpack_unsigned(ty, p)
                    } else {
                        D::w8(_mm256_loadu_si256(p.add(2) as *const __m256i))
                    };
                }
                // Each row's f16 scale (and Q4_1's and Q5_1's f16 minimum after it).
                let h16 = |o: usize| (blk.add(o) as *const i16).read_unaligned();
                let dw = _mm256_cvtph_ps(_mm_setr_epi16(
                    h16(row(0)),
                    h16(row(1)),
                    h16(row(2)),
                    h16(row(3)),
                    h16(row(4)),
                    h16(row(5)),
                    h16(row(6)),
                    h16(row(7)),
                ));
                let mw = if !u {
                    _mm256_setzero_ps()
                } else if !ty.stored_min() {
                    // Exact: a power of two times the scale, as `min_of` computes it.
                    _mm256_mul_ps(_mm256_set1_ps(ty.min_factor()), dw)
                } else {
                    _mm256_cvtph_ps(_mm_setr_epi16(
                        h16(row(0) + 2),
                        h16(row(1) + 2),
                        h16(row(2) + 2),
                        h16(row(3) + 2),
                        h16(row(4) + 2),
                        h16(row(5) + 2),
                        h16(row(6) + 2),
                        h16(row(7) + 2),
                    ))
                };
                for (r, a) in acc[..m].iter_mut().enumerate() {
                    let xv =
                        _mm256_loadu_si256(x.rowq.as_ptr().add(r * k + b * QK) as *const __m256i);
                    let v: [__m256i; DR] = std::array::from_fn(|c| {
                        if u {
                            D::r4(xv, wv[c])
                        } else {
                            D::r8(xv, wv[c])
                        }
                    });
                    let mut isum = lanes8(&v);
                    let si = b * GROUP + r;
                    if !u && D::R8_OFFSET {
                        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(x.sum[si] << 7));
                    }
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, *a);
                    if u {
                        *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                    }
                }
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }

    /// [`direct`] for the super-block formats (`FIVE`: Q5_K, else Q4_K):
    /// each super-block's 8 scales and minimums are decoded once per row,
    /// then its 8 blocks go as [`direct`]'s unsigned ones do, with the
    /// float sequence of the tiles.
    #[inline(always)]
    unsafe fn direct_super<D: IDot, const FIVE: bool>(x: &QActs, job: &Job) {
        let ty = if FIVE { QType::Q5_K } else { QType::Q4_K };
        let (nb, k, m) = (x.blocks(), x.k, x.m);
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        prefetch(
            job.w.wrapping_add(job.j0 * rb),
            DR.min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            let row = |c: usize| c.min(nr - 1) * rb;
            let base = job.w.add(j * rb);
            let next = base.wrapping_add(DR * rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for sb in 0..nb / 8 {
                prefetch(next.wrapping_add(sb * DR * bb), DR * bb);
                let blk = |c: usize| base.add(row(c) + sb * bb);
                // Scales and minimums of the 8 rows' super-blocks: lane c is row c.
                let h16 = |c: usize, o: usize| (blk(c).add(o) as *const i16).read_unaligned();
                let d = _mm256_cvtph_ps(_mm_setr_epi16(
                    h16(0, 0),
                    h16(1, 0),
                    h16(2, 0),
                    h16(3, 0),
                    h16(4, 0),
                    h16(5, 0),
                    h16(6, 0),
                    h16(7, 0),
                ));
                let dmin = _mm256_cvtph_ps(_mm_setr_epi16(
                    h16(0, 2),
                    h16(1, 2),
                    h16(2, 2),
                    h16(3, 2),
                    h16(4, 2),
                    h16(5, 2),
                    h16(6, 2),
                    h16(7, 2),
                ));
                let mut sc = [[0i32; DR]; 8];
                let mut mn = [[0i32; DR]; 8];
                for c in 0..DR {
                    let scales = &*(blk(c).add(4) as *const [u8; 12]);
                    for jb in 0..8 {
                        let (s6, m6) = crate::gguf::k_scale_min(scales, jb);
                        sc[jb][c] = s6 as i32;
                        mn[jb][c] = m6 as i32;
                    }
                }
                for jb in 0..8 {
                    let b = sb * 8 + jb;
                    // Plain loops, not closures: a closure body is compiled
                    // without this function's target features, and every
                    // intrinsic in it becomes a call.
                    let mut wv = [_mm256_setzero_si256(); DR];
                    for (c, w) in wv.iter_mut().enumerate() {
                        *w = unpack_super(ty, blk(c), jb);
                    }
                    // Exact products, as `super_params` forms them: d*sc, -(dmin*m).
                    let dw = _mm256_mul_ps(
                        d,
                        _mm256_cvtepi32_ps(_mm256_loadu_si256(sc[jb].as_ptr() as *const __m256i)),
                    );
                    // A sign flip, as `-(dmin*m)` is (a zero product too).
                    let mw = _mm256_xor_ps(
                        _mm256_mul_ps(
                            dmin,
                            _mm256_cvtepi32_ps(_mm256_loadu_si256(
                                mn[jb].as_ptr() as *const __m256i
                            )),
                        ),
                        _mm256_set1_ps(-0.0),
                    );
                    for (r, a) in acc[..m].iter_mut().enumerate() {
                        let xv = _mm256_loadu_si256(
                            x.rowq.as_ptr().add(r * k + b * QK) as *const __m256i
                        );
                        let mut v = [_mm256_setzero_si256(); DR];
                        for (vc, &w) in v.iter_mut().zip(&wv) {
                            *vc = D::r4(xv, w);
                        }
                        let isum = lanes8(&v);
                        let si = b * GROUP + r;
                        let scl = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scl, *a);
                        *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                    }
                }
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }

    /// [`direct`] for Q6_K: per block and weight row, the 8 i32 lanes of
    /// `Σ q·x` over 4 values each, less `32 Σ x` over the same 4, times the
    /// scale of the half (lanes 0..4: values 0..16) they fall in, then summed
    /// across lanes: `Σ sc·(q - 32)·x` exactly, whatever the order. The
    /// float sequence is the tiles'.
    #[inline(always)]
    unsafe fn direct_q6<D: IDot>(x: &QActs, job: &Job) {
        let ty = QType::Q6_K;
        let (nb, k, m) = (x.blocks(), x.k, x.m);
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        let ones = _mm256_set1_epi8(1);
        prefetch(
            job.w.wrapping_add(job.j0 * rb),
            DR.min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            let row = |c: usize| c.min(nr - 1) * rb;
            let base = job.w.add(j * rb);
            let next = base.wrapping_add(DR * rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for sb in 0..nb / 8 {
                prefetch(next.wrapping_add(sb * DR * bb), DR * bb);
                let blk = |c: usize| base.add(row(c) + sb * bb);
                let h16 = |c: usize| (blk(c).add(208) as *const i16).read_unaligned();
                let d = _mm256_cvtph_ps(_mm_setr_epi16(
                    h16(0),
                    h16(1),
                    h16(2),
                    h16(3),
                    h16(4),
                    h16(5),
                    h16(6),
                    h16(7),
                ));
                for jb in 0..8 {
                    let b = sb * 8 + jb;
                    let (h, g) = (jb / 4, jb % 4);
                    let mut wv = [_mm256_setzero_si256(); DR];
                    let mut scv = [_mm256_setzero_si256(); DR];
                    for c in 0..DR {
                        wv[c] = unpack_q6(blk(c), jb);
                        let sc = blk(c).add(192 + h * 8 + 2 * g) as *const i8;
                        let (sa, sb2) = (*sc as i32, *sc.add(1) as i32);
                        scv[c] = _mm256_setr_epi32(sa, sa, sa, sa, sb2, sb2, sb2, sb2);
                    }
                    for (r, a) in acc[..m].iter_mut().enumerate() {
                        let xv = _mm256_loadu_si256(
                            x.rowq.as_ptr().add(r * k + b * QK) as *const __m256i
                        );
                        let xs32 = _mm256_slli_epi32::<5>(D::r4(xv, ones));
                        let mut v = [_mm256_setzero_si256(); DR];
                        for c in 0..DR {
                            v[c] = _mm256_mullo_epi32(
                                _mm256_sub_epi32(D::r4(xv, wv[c]), xs32),
                                scv[c],
                            );
                        }
                        let isum = lanes8(&v);
                        let si = b * GROUP + r;
                        let scl = _mm256_mul_ps(d, _mm256_set1_ps(x.d[si]));
                        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scl, *a);
                    }
                }
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }

    /// [`tile`] for Q6_K: per block, the halves' integer dots and the
    /// activations' half sums, combined as `sa·(A - 32 XA) + sb·(B - 32 XB)`
    /// per weight row (the integer [`direct_q6`] forms), then one `fma`.
    #[inline(always)]
    unsafe fn tile_q6<D: IDot, const C: usize>(
        x: &QActs,
        t: &Tile<'_>,
        g: usize,
        out: &mut [[f32; GROUP]; NR],
    ) {
        let (nb, s) = (x.blocks(), t.s);
        let ones = _mm256_set1_epi8(1);
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let xb = x.qs.as_ptr().add((g * nb + b) * GROUP_BLOCK);
            let si = (g * nb + b) * GROUP;
            let mut half = [[_mm256_setzero_si256(); C]; 2];
            let mut xsum = [_mm256_setzero_si256(); 2];
            for i in 0..QK / 4 {
                let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                let hh = i / 4;
                xsum[hh] = _mm256_add_epi32(xsum[hh], D::r4(xv, ones));
                for (c, h) in half[hh].iter_mut().enumerate() {
                    *h = _mm256_add_epi32(*h, D::r4(xv, unpacked_chunk(t, c, b, i)));
                }
            }
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(si));
            for c in 0..C {
                let [sa, sb] = s.sc6[c * nb + b];
                let lo = _mm256_sub_epi32(half[0][c], _mm256_slli_epi32::<5>(xsum[0]));
                let hi = _mm256_sub_epi32(half[1][c], _mm256_slli_epi32::<5>(xsum[1]));
                let isum = _mm256_add_epi32(
                    _mm256_mullo_epi32(lo, _mm256_set1_epi32(sa)),
                    _mm256_mullo_epi32(hi, _mm256_set1_epi32(sb)),
                );
                let sc = _mm256_mul_ps(_mm256_set1_ps(s.dw[c * nb + b]), dx);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[c]);
            }
        }
        for c in 0..C {
            _mm256_storeu_ps(out[c].as_mut_ptr(), acc[c]);
        }
    }

    /// Asks for the cache lines of `bytes` bytes from `p` (a hint: `p` need
    /// not be readable).
    #[inline(always)]
    unsafe fn prefetch(p: *const u8, bytes: usize) {
        let mut o = 0;
        while o < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(o) as *const i8);
            o += 64;
        }
    }

    /// Writes a [`direct`] tile's results: lane `c` of `acc[r]` is output
    /// `j + c` of activation row `r`, for the tile's `nr` real rows.
    #[inline(always)]
    unsafe fn store_tile(acc: &[__m256], nr: usize, job: &Job, j: usize) {
        for (r, a) in acc.iter().enumerate() {
            let mut out = [0f32; DR];
            _mm256_storeu_ps(out.as_mut_ptr(), *a);
            for (c, &v) in out[..nr].iter().enumerate() {
                *job.y.add(r * job.n + j + c) = v;
            }
        }
    }

    /// Lane `c` of the result is the sum of the 8 lanes of `v[c]`.
    #[inline(always)]
    unsafe fn lanes8(v: &[__m256i; DR]) -> __m256i {
        let a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
        let b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
        // a = [v0..v3 low-half sums | v0..v3 high-half sums], b likewise for v4..v7.
        _mm256_add_epi32(
            _mm256_permute2x128_si256::<0x20>(a, b),
            _mm256_permute2x128_si256::<0x31>(a, b),
        )
    }

    /// One activation group (8 rows, one per lane) against the `C` weight
    /// rows in `s`: the float sequence of the module invariant, per lane.
    #[inline(always)]
    unsafe fn tile<D: IDot, const C: usize, const U: bool>(
        x: &QActs,
        t: &Tile<'_>,
        g: usize,
        out: &mut [[f32; GROUP]; NR],
    ) {
        let (nb, s) = (x.blocks(), t.s);
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let xb = x.qs.as_ptr().add((g * nb + b) * GROUP_BLOCK);
            let si = (g * nb + b) * GROUP;
            let isum = if U {
                D::qu::<C>(xb, t, b)
            } else {
                D::q8::<C>(xb, x.sum.as_ptr().add(si), t, b)
            };
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(si));
            for c in 0..C {
                let sc = _mm256_mul_ps(_mm256_set1_ps(s.dw[c * nb + b]), dx);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[c]), sc, acc[c]);
                if U {
                    let dsum = _mm256_loadu_ps(x.dsum.as_ptr().add(si));
                    acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(s.mw[c * nb + b]), dsum, acc[c]);
                }
            }
        }
        for c in 0..C {
            _mm256_storeu_ps(out[c].as_mut_ptr(), acc[c]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::dequantize;
    use crate::kernels;

    /// Deterministic xorshift stream.
    struct Rng(u64);

    impl Rng {
        fn new(seed: u64) -> Rng {
            Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
        }

        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }

        /// In [-1, 1).
        fn f32(&mut self) -> f32 {
            ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        }
    }

    /// Activations with some all-zero blocks and a few large outliers.
    fn rand_acts(seed: u64, m: usize, k: usize) -> Vec<f32> {
        let mut rng = Rng::new(seed);
        let mut x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
        for (i, blk) in x.chunks_mut(QK).enumerate() {
            match rng.next() % 11 {
                0 => blk.fill(0.0),
                1 => blk[i % QK] *= 40.0,
                _ => {}
            }
        }
        x
    }

    /// A random weight matrix in GGUF layout; Q8_0 includes -128 values and
    /// negative scales, Q4_1 negative minimums.
    fn rand_weights(seed: u64, ty: QType, n: usize, k: usize) -> Vec<u8> {
        let mut rng = Rng::new(seed);
        let mut w = Vec::with_capacity(n * ty.row_bytes(k));
        for _ in 0..n * k / ty.block_values() {
            let d = half::f16::from_f32(0.001 + 0.02 * rng.f32().abs())
                * if rng.next().is_multiple_of(5) {
                    -half::f16::ONE
                } else {
                    half::f16::ONE
                };
            if ty == QType::Q6_K {
                // Values, high bits and i8 scales are any bytes; d comes last.
                w.extend((0..208).map(|_| rng.next() as u8));
                w.extend_from_slice(&(d * half::f16::from_f32(0.05)).to_le_bytes());
                continue;
            }
            w.extend_from_slice(&d.to_le_bytes());
            if ty.stored_min() {
                w.extend_from_slice(&half::f16::from_f32(0.1 * rng.f32()).to_le_bytes());
            }
            if ty.is_super() {
                // dmin; the 6-bit scales and minimums and the values are any bytes.
                w.extend_from_slice(&half::f16::from_f32(0.002 * rng.f32()).to_le_bytes());
            }
            for _ in 0..ty.block_bytes() - w.len() % ty.block_bytes() {
                w.push(rng.next() as u8);
            }
        }
        w
    }

    fn dequant(ty: QType, w: &[u8], n: usize, k: usize) -> Vec<f32> {
        let gt = crate::weights::ggml_type(ty);
        let mut out = vec![0f32; n * k];
        dequantize(gt, w, &mut out).expect("dequantising test weights");
        out
    }

    /// The activations as the kernels see them: `d * q` per value.
    fn dequant_acts(x: &QActs) -> Vec<f64> {
        let (m, k, nb) = (x.m, x.k, x.blocks());
        let mut out = vec![0f64; m * k];
        for r in 0..m {
            let (g, l) = (r / GROUP, r % GROUP);
            for b in 0..nb {
                let d = x.d[(g * nb + b) * GROUP + l] as f64;
                for i in 0..QK {
                    let q = x.qs[(g * nb + b) * GROUP_BLOCK + (i / 4) * 32 + l * 4 + i % 4];
                    out[r * k + b * QK + i] = d * q as f64;
                }
            }
        }
        out
    }

    fn flavours() -> Vec<Flavour> {
        [Flavour::Portable, Flavour::Avx2, Flavour::Vnni]
            .into_iter()
            .filter(|&f| has(f))
            .collect()
    }

    fn run(fl: Flavour, x: &QActs, ty: QType, w: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; x.rows() * n];
        run_many(
            fl,
            x,
            &mut [QLinear {
                ty,
                w,
                n,
                y: &mut y,
            }],
        );
        y
    }

    /// Every format the kernels read: the 32-value ones and the super-block
    /// ones (which need `k` a multiple of 256: tests skip them elsewhere).
    const TYPES: [QType; 8] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
    ];

    /// Whether rows of `k` values are whole blocks of `ty`.
    fn fits(ty: QType, k: usize) -> bool {
        k.is_multiple_of(ty.block_values())
    }

    /// The super-block writer the benches use encodes what the GGUF
    /// reader decodes: values come back within about half a step of their
    /// sub-block (the bounds leave room for the 6- or 8-bit scales).
    #[test]
    fn super_block_writer_round_trips_through_the_gguf_reader() {
        let k = 1024;
        let mut rng = Rng::new(17);
        let x: Vec<f32> = (0..k)
            .map(|i| rng.f32() * (1.0 + (i / 256) as f32))
            .collect();
        for (ty, bound) in [
            (QType::Q4_K, 0.6 / 15.0),
            (QType::Q5_K, 0.6 / 31.0),
            (QType::Q6_K, 0.6 / 31.0),
        ] {
            let mut blocks = vec![0u8; ty.row_bytes(k)];
            crate::bench::quantize_row(ty, &x, &mut blocks);
            let back = dequant(ty, &blocks, 1, k);
            for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
                // Relative to the span of the super-block's values.
                let span = 2.0 * (1.0 + (i / 256) as f32);
                assert!(
                    (a - b).abs() <= bound * span,
                    "{ty:?} value {i}: {a} came back as {b}"
                );
            }
        }
    }

    #[test]
    fn f16_conversion_is_exact() {
        for h in 0..=u16::MAX {
            let want = half::f16::from_bits(h).to_f32();
            let got = f16_to_f32(h);
            if want.is_nan() {
                assert!(got.is_nan(), "{h:#06x}");
            } else {
                assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn matches_f64_reference_on_dequantised_values() {
        for fl in flavours() {
            for ty in TYPES {
                for &(m, k, n) in &[
                    (1, 32, 1),
                    (5, 96, 7),
                    (13, 256, 10),
                    (40, 576, 33),
                    (3, 768, 9),
                    (9, 0, 3),
                ] {
                    if !fits(ty, k) {
                        continue;
                    }
                    let xf = rand_acts(1, m, k);
                    let mut x = QActs::new();
                    x.quantize(&xf, m, k);
                    let wq = rand_weights(2, ty, n, k);
                    let w = dequant(ty, &wq, n, k);
                    let xd = dequant_acts(&x);
                    let y = run(fl, &x, ty, &wq, n);
                    for r in 0..m {
                        for j in 0..n {
                            let (mut want, mut mag) = (0f64, 0f64);
                            for t in 0..k {
                                want += w[j * k + t] as f64 * xd[r * k + t];
                                mag += (w[j * k + t] as f64 * xd[r * k + t]).abs();
                            }
                            let got = y[r * n + j] as f64;
                            assert!(
                                (got - want).abs() <= 1e-5 * mag + 1e-30,
                                "{fl:?} {ty:?} m={m} k={k} n={n} ({r},{j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// Against the original f32 activations the error is the activation
    /// rounding: `|x - d*q| <= d/2` per value (plus float rounding, here a
    /// 1e-3 slack on it and 1e-5 of Σ|w||x|), so
    /// `|y - Σ w·x| <= Σ_b d_b/2 · Σ_{i in b} |w_i| · (1 + 1e-3) + 1e-5 · Σ|w·x|`.
    #[test]
    fn error_against_f32_activations_is_within_the_quantisation_bound() {
        let (m, k, n) = (11, 512, 9);
        let xf = rand_acts(3, m, k);
        let mut x = QActs::new();
        x.quantize(&xf, m, k);
        for fl in flavours() {
            for ty in TYPES {
                let wq = rand_weights(4, ty, n, k);
                let w = dequant(ty, &wq, n, k);
                let y = run(fl, &x, ty, &wq, n);
                for r in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag, mut bound) = (0f64, 0f64, 0f64);
                        for b in 0..k / QK {
                            let d = x.d[((r / GROUP) * (k / QK) + b) * GROUP + r % GROUP] as f64;
                            for t in b * QK..(b + 1) * QK {
                                let p = w[j * k + t] as f64 * xf[r * k + t] as f64;
                                want += p;
                                mag += p.abs();
                                bound += (w[j * k + t] as f64).abs() * d / 2.0 * (1.0 + 1e-3);
                            }
                        }
                        let err = (y[r * n + j] as f64 - want).abs();
                        assert!(
                            err <= bound + 1e-5 * mag,
                            "{fl:?} {ty:?} ({r},{j}): error {err} over bound {bound}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rows_are_bit_identical_for_every_m_position_and_thread_count() {
        let (k, n) = (256, 13);
        let pool_rows = rand_acts(5, 50, k);
        let row = |r: usize| &pool_rows[r * k..(r + 1) * k];
        let pools: Vec<rayon::ThreadPool> = [1, 3]
            .iter()
            .map(|&t| {
                rayon::ThreadPoolBuilder::new()
                    .num_threads(t)
                    .build()
                    .unwrap()
            })
            .collect();
        let mut x = QActs::new();
        for ty in TYPES {
            let w = rand_weights(6, ty, n, k);
            for fl in flavours() {
                let alone: Vec<Vec<u32>> = (0..50)
                    .map(|r| {
                        x.quantize(row(r), 1, k);
                        run(fl, &x, ty, &w, n).iter().map(|v| v.to_bits()).collect()
                    })
                    .collect();
                for m in 1..=70 {
                    for shift in [0, 3] {
                        let idx: Vec<usize> = (0..m).map(|i| (i + shift * m) % 50).collect();
                        let xf: Vec<f32> = idx.iter().flat_map(|&r| row(r).to_vec()).collect();
                        x.quantize(&xf, m, k);
                        for pool in &pools {
                            let y = pool.install(|| run(fl, &x, ty, &w, n));
                            for (i, &r) in idx.iter().enumerate() {
                                let got: Vec<u32> =
                                    y[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                                assert_eq!(
                                    got,
                                    alone[r],
                                    "{fl:?} {ty:?}: row {r} at position {i} of m={m}, {} threads",
                                    pool.current_num_threads()
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn avx2_and_vnni_agree_bit_for_bit() {
        if !has(Flavour::Vnni) {
            return;
        }
        let (m, k, n) = (21, 1024, 19);
        let mut x = QActs::new();
        x.quantize(&rand_acts(7, m, k), m, k);
        for ty in TYPES {
            let w = rand_weights(8, ty, n, k);
            let a: Vec<u32> = run(Flavour::Avx2, &x, ty, &w, n)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            let b: Vec<u32> = run(Flavour::Vnni, &x, ty, &w, n)
                .iter()
                .map(|v| v.to_bits())
                .collect();
            assert_eq!(a, b, "{ty:?}");
        }
    }

    #[test]
    fn qmatmul_many_equals_separate_calls() {
        let (m, k) = (10, 128);
        let mut x = QActs::new();
        x.quantize(&rand_acts(9, m, k), m, k);
        let shapes = [
            (QType::Q8_0, 17),
            (QType::Q4_1, 5),
            (QType::Q4_1, 32),
            (QType::Q8_0, 3),
            (QType::Q4_1, 9),
        ];
        let ws: Vec<Vec<u8>> = shapes
            .iter()
            .enumerate()
            .map(|(i, &(ty, n))| rand_weights(10 + i as u64, ty, n, k))
            .collect();
        for be in [Backend::Portable, kernels::backend()] {
            for count in 1..=shapes.len() {
                let mut ys: Vec<Vec<f32>> = shapes[..count]
                    .iter()
                    .map(|&(_, n)| vec![f32::NAN; m * n])
                    .collect();
                let mut outs: Vec<QLinear<'_>> = shapes
                    .iter()
                    .zip(&ws)
                    .zip(ys.iter_mut())
                    .map(|((&(ty, n), w), y)| QLinear { ty, w, n, y })
                    .collect();
                qmatmul_many_with(be, &x, &mut outs);
                drop(outs);
                for (i, &(ty, n)) in shapes[..count].iter().enumerate() {
                    let mut z = vec![f32::NAN; m * n];
                    qmatmul_many_with(
                        be,
                        &x,
                        &mut [QLinear {
                            ty,
                            w: &ws[i],
                            n,
                            y: &mut z,
                        }],
                    );
                    let a: Vec<u32> = ys[i].iter().map(|v| v.to_bits()).collect();
                    let b: Vec<u32> = z.iter().map(|v| v.to_bits()).collect();
                    assert_eq!(a, b, "{be:?}: matrix {i} of {count}");
                }
            }
        }
    }

    #[test]
    fn quantize_round_trips_maxima_and_zero_blocks() {
        let k = 64;
        let mut xf = vec![0f32; 2 * k];
        // Row 0, block 0: maxima ±127 give d = 1 and exact values.
        for (i, v) in xf[..32].iter_mut().enumerate() {
            *v = (i as f32 - 15.0) * 4.0;
        }
        xf[3] = 127.0;
        xf[7] = -127.0;
        // Row 0, block 1: a ±max of 0.37 goes to ±127 and back within rounding of d.
        xf[32 + 5] = 0.37;
        xf[32 + 9] = -0.37;
        xf[32 + 10] = 0.1;
        // Row 1: block 0 all zero, block 1 one value.
        xf[k + 40] = -2.5;
        let mut x = QActs::new();
        x.quantize(&xf, 2, k);
        let (nb, q) = (2, |x: &QActs, r: usize, b: usize, i: usize| {
            x.qs[((r / GROUP) * 2 + b) * GROUP_BLOCK + (i / 4) * 32 + (r % GROUP) * 4 + i % 4]
        });
        let s = |r: usize, b: usize| ((r / GROUP) * nb + b) * GROUP + r % GROUP;
        assert_eq!(x.d[s(0, 0)], 1.0);
        for (i, want) in xf.iter().enumerate().take(32) {
            assert_eq!(x.d[s(0, 0)] * q(&x, 0, 0, i) as f32, *want, "value {i}");
        }
        assert_eq!(
            x.sum[s(0, 0)],
            (0..32).map(|i| q(&x, 0, 0, i) as i32).sum::<i32>()
        );
        assert_eq!(
            (q(&x, 0, 1, 5), q(&x, 0, 1, 9), q(&x, 0, 1, 10)),
            (127, -127, 34)
        );
        assert_eq!(x.d[s(0, 1)], 0.37 / 127.0);
        assert!((x.d[s(0, 1)] * 127.0 - 0.37).abs() <= f32::EPSILON * 0.37);
        assert_eq!(x.sum[s(0, 1)], 34);
        assert_eq!(
            (x.d[s(1, 0)], x.sum[s(1, 0)], x.dsum[s(1, 0)]),
            (0.0, 0, 0.0)
        );
        assert!((0..32).all(|i| q(&x, 1, 0, i) == 0));
        assert_eq!((q(&x, 1, 1, 8), x.sum[s(1, 1)]), (-127, -127));
        // Half away from zero: 0.5 -> 1, -0.5 -> -1, 1.5 -> 2.
        let mut h = [0f32; 32];
        h[0] = 127.0;
        h[1] = 0.5;
        h[2] = -0.5;
        h[3] = 1.5;
        h[4] = -2.5;
        let (d, qb, _) = quantize_block(&h);
        assert_eq!((d, qb[1], qb[2], qb[3], qb[4]), (1.0, 1, -1, 2, -3));
        assert_eq!((x.rows(), x.cols()), (2, 64));
    }

    #[test]
    #[should_panic(expected = "is not a multiple of the block size 32")]
    fn quantize_rejects_k_not_a_multiple_of_32() {
        QActs::new().quantize(&[0.0; 40], 1, 40);
    }

    /// `cargo test --release -p pdkv-model --lib qkernels -- --ignored --nocapture`
    #[test]
    #[ignore]
    fn bench_against_f32_matmul() {
        let (k, n) = (576, 1536);
        let threads = std::env::var("PDKV_THREADS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(2);
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        let time = |f: &mut dyn FnMut()| {
            f();
            let mut best = f64::INFINITY;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                let mut reps = 0;
                while t.elapsed().as_secs_f64() < 0.05 || reps == 0 {
                    f();
                    reps += 1;
                }
                best = best.min(t.elapsed().as_secs_f64() / reps as f64);
            }
            best
        };
        println!(
            "threads {threads}, k {k}, n {n}, flavour {:?}",
            Flavour::of(kernels::backend())
        );
        for m in [1, 32, 512] {
            let xf = rand_acts(20, m, k);
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            for ty in TYPES.into_iter().filter(|&ty| fits(ty, k)) {
                let wq = rand_weights(21, ty, n, k);
                let w = dequant(ty, &wq, n, k);
                let mut y = vec![0f32; m * n];
                let tf = pool.install(|| time(&mut || kernels::matmul(&xf, m, k, &w, n, &mut y)));
                let mut x = QActs::new();
                let tqz = pool.install(|| time(&mut || x.quantize(&xf, m, k)));
                let tq = pool.install(|| {
                    time(&mut || {
                        qmatmul_many(
                            &x,
                            &mut [QLinear {
                                ty,
                                w: &wq,
                                n,
                                y: &mut y,
                            }],
                        )
                    })
                });
                println!(
                    "m={m:3} {ty:?}: f32 {:8.1} us {:6.1} GFLOP/s | q {:8.1} us {:6.1} GFLOP/s (+quantize {:6.1} us) | speedup {:.2}x",
                    tf * 1e6,
                    gflop / tf,
                    tq * 1e6,
                    gflop / tq,
                    tqz * 1e6,
                    tf / (tq + tqz)
                );
            }
        }
    }
}
