//! Packed matrices ([`QType::Q4_0R8`], `Q4_1R8`, `Q5_0R8`, `Q5_1R8`,
//! `Q4_KR8`: tiles of 8 rows laid out by block, [`crate::packed`]) at batch
//! 1 and small batches: with AVX-512 VNNI a tile block's 8 rows' nibbles are two
//! 512-bit loads and each fifth-bit mask one mask-register load; with AVX2
//! two rows share a 256-bit vector. Either way the tile is one stream and
//! its 8 scales (and stored minimums) one load; Q4_K's 6-bit scales and
//! minimums are decoded once per super-block, its blocks' nibbles read as
//! Q4_1's. The larger batches' tiles read
//! packed rows as they unpack them (`simd::prep_packed`), the portable
//! kernels unpacked (`matmul::run_unpacked`).
//!
//! The float sequence per output is [`super::simd`]'s direct kernel's
//! (see [`super`]): `acc = fma(I_b, dw_b * dx_b, acc)`, then
//! `acc = fma(mw_b, dx_b * Σqx_b, acc)` (`mw_b` Q4_0's `-8 dw_b`, Q5_0's
//! `-16 dw_b`, the stored minimum, or Q4_K's `-(dmin m_b)`), block by
//! block, so a packed matrix's outputs have its GGUF rows' bits.

use std::arch::x86_64::*;

use super::acts::{QActs, DIRECT_MAX};
use super::idot::{Avx2, IDot, PAIRS};
use super::job::Job;
use super::regs::{k_block_scales, k_scales, store_tile, x_halves};
use crate::packed::{nibbles_at, tile_block, Q4K_BLOCK, Q4K_DMIN, Q4K_NIBBLES, Q4K_SCALES, TILE};
use crate::prefetch::{tiles_ahead, to_l2, AHEAD};
use crate::qtype::{QType, QK};

/// # Safety
/// As [`super::simd::run_job_vnni`]'s, for a job of a packed matrix whose
/// columns start at a tile (`job.j0` a multiple of [`TILE`]), with `x.m`
/// at most [`DIRECT_MAX`] rows; the CPU has AVX-512 F, BW and VNNI (and
/// AVX2, FMA, F16C).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) unsafe fn run_job_vnni(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract.
    unsafe { run::<Wide>(x, job) }
}

/// # Safety
/// As [`run_job_vnni`]'s, with AVX2, FMA and F16C for the instructions.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_job_avx2(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract.
    unsafe { run::<Pairs>(x, job) }
}

/// The kernels of one instruction set: the whole tiles of a packed format
/// ([`tiles`]' `FIVE`, `MIN`, `K4`) for `M` activation rows (`M = 0`:
/// `x.m`), and the direct kernel for the GGUF rows past them.
trait Kernels {
    /// # Safety
    /// As [`tiles`]'.
    unsafe fn tiles<const FIVE: bool, const MIN: bool, const K4: bool, const M: usize>(
        x: &QActs,
        job: &Job,
        end: usize,
    );
    /// # Safety
    /// As `simd::run_job_vnni_direct`'s.
    unsafe fn direct(x: &QActs, job: &Job);
}

/// AVX-512 VNNI: [`tiles`].
struct Wide;
/// AVX2: [`tiles_pairs`].
struct Pairs;

impl Kernels for Wide {
    #[inline(always)]
    unsafe fn tiles<const FIVE: bool, const MIN: bool, const K4: bool, const M: usize>(
        x: &QActs,
        job: &Job,
        end: usize,
    ) {
        // SAFETY: as this function's contract.
        unsafe { tiles::<FIVE, MIN, K4, M>(x, job, end) }
    }
    #[inline(always)]
    unsafe fn direct(x: &QActs, job: &Job) {
        // SAFETY: as this function's contract.
        unsafe { super::simd::run_job_vnni_direct(x, job) }
    }
}

impl Kernels for Pairs {
    #[inline(always)]
    unsafe fn tiles<const FIVE: bool, const MIN: bool, const K4: bool, const M: usize>(
        x: &QActs,
        job: &Job,
        end: usize,
    ) {
        // SAFETY: as this function's contract.
        unsafe { tiles_pairs::<Avx2, FIVE, MIN, K4, M>(x, job, end) }
    }
    #[inline(always)]
    unsafe fn direct(x: &QActs, job: &Job) {
        // SAFETY: as this function's contract.
        unsafe { super::simd::run_job_avx2_direct(x, job) }
    }
}

/// A job: its whole tiles with `K`'s kernel of its format and batch, then
/// its rows past the matrix's tiles (GGUF rows) with `K`'s direct kernel.
///
/// # Safety
/// As [`run_job_vnni`]'s, with `K`'s instructions.
#[inline(always)]
unsafe fn run<K: Kernels>(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract; the tail's contract is the
    // direct kernel's, which this one includes.
    unsafe {
        let end = tiles_end(x, job);
        if job.j0 < end {
            // The format's fifth bits and stored minimums, the batch of 1.
            match (job.ty, x.m == 1) {
                (QType::Q4_0R8, true) => K::tiles::<false, false, false, 1>(x, job, end),
                (QType::Q4_0R8, false) => K::tiles::<false, false, false, 0>(x, job, end),
                (QType::Q4_1R8, true) => K::tiles::<false, true, false, 1>(x, job, end),
                (QType::Q4_1R8, false) => K::tiles::<false, true, false, 0>(x, job, end),
                (QType::Q5_0R8, true) => K::tiles::<true, false, false, 1>(x, job, end),
                (QType::Q5_0R8, false) => K::tiles::<true, false, false, 0>(x, job, end),
                (QType::Q5_1R8, true) => K::tiles::<true, true, false, 1>(x, job, end),
                (QType::Q5_1R8, false) => K::tiles::<true, true, false, 0>(x, job, end),
                (QType::Q4_KR8, true) => K::tiles::<false, false, true, 1>(x, job, end),
                (QType::Q4_KR8, false) => K::tiles::<false, false, true, 0>(x, job, end),
                (ty, _) => unreachable!("{ty:?} is not a packed format"),
            }
        }
        if let Some(tail) = tail(job) {
            K::direct(x, &tail);
        }
    }
}

/// Where the job's whole tiles end (the matrix's last `n % 8` rows are
/// GGUF rows).
fn tiles_end(x: &QActs, job: &Job) -> usize {
    debug_assert!(job.ty.packed() && job.j0.is_multiple_of(TILE) && x.m <= DIRECT_MAX);
    job.j1.min(job.n / TILE * TILE)
}

/// The job's GGUF rows past the matrix's tiles, as a job of their format.
fn tail(job: &Job) -> Option<Job> {
    let tiled = job.n / TILE * TILE;
    (job.j1 > tiled).then(|| Job {
        ty: job.ty.gguf(),
        j0: tiled.max(job.j0),
        ..*job
    })
}

/// What the tile kernels sweep: blocks of 32 values a row (`nb`), values
/// a row (`k`), activation rows (`m`), bytes of a tile block (`tb`: of a
/// super-block for Q4_K) and where in it the nibbles start (`nib`), bytes
/// of a tile.
struct Shape {
    nb: usize,
    k: usize,
    m: usize,
    tb: usize,
    nib: usize,
    tile: usize,
}

impl Shape {
    /// Where block `b`'s nibbles start in a tile at `base` (`K4`: of
    /// Q4_K), and the part of the tile asked for ahead while it is read
    /// (block `b`'s share of the tile's bytes, of every tile `tile`
    /// apart): one tile block, or an eighth of a super-block.
    #[inline(always)]
    fn block<const K4: bool>(&self, base: *const u8, b: usize) -> *const u8 {
        if K4 {
            let q = self.tile / self.nb;
            tiles_ahead(base, self.tile, b * q, q);
            base.wrapping_add(b / 8 * self.tb + Q4K_NIBBLES + Q4K_BLOCK * (b % 8))
        } else {
            tiles_ahead(base, self.tile, b * self.tb, self.tb);
            base.wrapping_add(b * self.tb + self.nib)
        }
    }
}

/// The 8 rows' `(dw, mw)` of each block of the Q4_K tile super-block at
/// `p` ([`k_block_scales`] of each).
///
/// # Safety
/// The CPU has AVX2 and F16C; `p` is a whole tile super-block.
#[inline(always)]
unsafe fn k4_scales(p: *const u8) -> ([__m256; 8], [__m256; 8]) {
    // SAFETY: the caller guarantees the instructions and the super-block.
    unsafe {
        // Plain loops, not closures: a closure body is compiled without
        // the caller's target features, and every intrinsic in it becomes
        // a call.
        let d = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(p.add(Q4K_DMIN) as *const __m128i));
        let w = p.add(Q4K_SCALES) as *const __m256i;
        let (sc, mn) = k_scales(
            _mm256_loadu_si256(w),
            _mm256_loadu_si256(w.add(1)),
            _mm256_loadu_si256(w.add(2)),
        );
        let (mut dw, mut mw) = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
        for i in 0..8 {
            (dw[i], mw[i]) = k_block_scales(d, dmin, sc[i], mn[i]);
        }
        (dw, mw)
    }
}

/// Blocks the tile kernels take in one group: a Q4_K super-block's 8,
/// else 1.
const fn group<const K4: bool>() -> usize {
    if K4 {
        8
    } else {
        1
    }
}

/// The 8 rows' `(dw, mw)` of block `b` of a tile at `base`: decoded
/// from Q4_K's super-block as `b` enters it (`K4`, into `k4`), or the
/// tile block's ([`scales`]).
///
/// # Safety
/// As [`k4_scales`]' and [`scales`]'.
#[inline(always)]
unsafe fn block_scales<const FIVE: bool, const MIN: bool, const K4: bool>(
    sh: &Shape,
    base: *const u8,
    b: usize,
    k4: &mut ([__m256; 8], [__m256; 8]),
) -> (__m256, __m256) {
    // SAFETY: as this function's contract.
    unsafe {
        if K4 {
            if b.is_multiple_of(8) {
                *k4 = k4_scales(base.add(b / 8 * sh.tb));
            }
            (k4.0[b % 8], k4.1[b % 8])
        } else {
            scales::<FIVE, MIN>(base.add(b * sh.tb))
        }
    }
}

/// The [`Shape`] of a job whose tiles end at `end` for `M` activation rows
/// (`M = 0`: `x.m`); its first tiles are asked for into L2 (a hint).
#[inline(always)]
fn shape<const M: usize>(x: &QActs, job: &Job, end: usize) -> Shape {
    let k = x.k;
    let tile = TILE * job.ty.row_bytes(k);
    to_l2(
        job.w.wrapping_add(job.j0 / TILE * tile),
        AHEAD.min((end - job.j0) / TILE) * tile,
    );
    Shape {
        nb: x.blocks(),
        k,
        m: if M == 0 { x.m } else { M },
        tb: tile_block(job.ty),
        nib: nibbles_at(job.ty),
        tile,
    }
}

/// The whole tiles of columns `job.j0..end` of a packed format (`FIVE`:
/// fifth bits, `MIN`: stored minimums, `K4`: Q4_K) for `M` activation rows
/// (`M = 0`: `x.m`).
///
/// # Safety
/// As [`run_job_vnni`]'s, `end` a multiple of [`TILE`] at most `job.n`.
#[inline(always)]
unsafe fn tiles<const FIVE: bool, const MIN: bool, const K4: bool, const M: usize>(
    x: &QActs,
    job: &Job,
    end: usize,
) {
    // SAFETY: the caller guarantees the CPU's instructions and that the
    // job's tiles, activations (`x.rowq`, `m <= DIRECT_MAX` rows) and
    // output columns are inside `job.w`, `x` and `job.y`.
    unsafe {
        let sh = shape::<M>(x, job, end);
        let (nb, k, m, tile) = (sh.nb, sh.k, sh.m, sh.tile);
        // After the two folds below, dword 0 of 128-bit lane `l` holds row
        // `l`'s sum and dword 1 row `l + 4`'s.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut k4 = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
        let mut j = job.j0;
        while j < end {
            let base = job.w.add(j / TILE * tile);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            // Q4_K's blocks a super-block at a time (the inner loop's
            // count a constant: VNNI Q4_K 26.5-26.7 -> 27.0-27.1 GB/s, one
            // thread, in cache, binaries alternating), the others one by one.
            for b0 in (0..nb).step_by(group::<K4>()) {
                for b in b0..b0 + group::<K4>() {
                    let nibs = sh.block::<K4>(base, b);
                    let (dw, mw) = block_scales::<FIVE, MIN, K4>(&sh, base, b, &mut k4);
                    // Rows 0..4 (then 4..8), 16 nibble bytes each: values
                    // 0..16 in the low nibbles, 16..32 in the high ones, Q5_0's
                    // fifth bits added from its masks.
                    let masks = base.wrapping_add(b * sh.tb + masks_at(MIN)) as *const u64;
                    let mask = |i: usize| {
                        if FIVE {
                            masks.add(i).read_unaligned()
                        } else {
                            0
                        }
                    };
                    let (qa, qb) = (
                        _mm512_loadu_si512(nibs as *const _),
                        _mm512_loadu_si512(nibs.add(64) as *const _),
                    );
                    let la = values::<false, FIVE>(qa, mask(0));
                    let ha = values::<true, FIVE>(qa, mask(1));
                    let lb = values::<false, FIVE>(qb, mask(2));
                    let hb = values::<true, FIVE>(qb, mask(3));
                    for (r, a) in acc[..m].iter_mut().enumerate() {
                        let xp = x.rowq.as_ptr().add(r * k + b * QK);
                        let xl = _mm512_broadcast_i32x4(_mm_loadu_si128(xp as *const __m128i));
                        let xh =
                            _mm512_broadcast_i32x4(_mm_loadu_si128(xp.add(16) as *const __m128i));
                        let z = _mm512_setzero_si512();
                        // 128-bit lane `l`: 4 partial dots of row `l` (of `l + 4`).
                        let sa = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, la, xl), ha, xh);
                        let sb = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(z, lb, xl), hb, xh);
                        let t = _mm512_add_epi32(
                            _mm512_unpacklo_epi32(sa, sb),
                            _mm512_unpackhi_epi32(sa, sb),
                        );
                        let u = _mm512_add_epi32(t, _mm512_shuffle_epi32::<0b0100_1110>(t));
                        let isum = _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, u));
                        accumulate(a, isum, (dw, mw), x, x.at(b, r));
                    }
                }
            }
            store_tile(&acc[..m], TILE.min(job.j1 - j), job, j);
            j += TILE;
        }
    }
}

/// Values 0..16 (`HIGH`: 16..32) of 4 rows whose 16 nibble bytes each are
/// `q`'s 128-bit lanes, with 16 added where the row's fifth bit in `mask`
/// (16 bits a lane, lane 0 lowest; `FIVE` only) is set: unsigned values
/// as bytes. The fifth bits go in as 16 where set (one zero-masked move)
/// and the nibbles are kept and merged with them in one `vpternlogd`:
/// written as a masked add, the compiler made an AND, an OR and a masked
/// move of it (AVX-512 VNNI on an AMD EPYC, 2 threads, weights in cache,
/// alternating in one process, medians of 40: Q5_0R8 1.03-1.07x, Q5_1R8 1.10-1.12x).
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[inline(always)]
unsafe fn values<const HIGH: bool, const FIVE: bool>(q: __m512i, mask: u64) -> __m512i {
    // SAFETY: the caller guarantees the instructions; registers only.
    unsafe {
        let q = if HIGH { _mm512_srli_epi16::<4>(q) } else { q };
        let low = _mm512_set1_epi8(0x0f);
        if !FIVE {
            return _mm512_and_si512(q, low);
        }
        let sixteen = _mm512_maskz_mov_epi8(mask, _mm512_set1_epi8(16));
        // (q & low) | sixteen: the nibble below bit 4, the fifth bit at it.
        _mm512_ternarylogic_epi32::<0xEA>(q, low, sixteen)
    }
}

/// The 8 rows' scales `dw` and minimums `mw` of the tile block at `p`:
/// stored (`MIN`: Q4_1, Q5_1) or `-16 dw` (`FIVE`: Q5_0) or `-8 dw` (Q4_0),
/// exact.
///
/// # Safety
/// The CPU has AVX2 and F16C; `p` is a whole tile block.
#[inline(always)]
unsafe fn scales<const FIVE: bool, const MIN: bool>(p: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees the instructions and the tile block.
    unsafe {
        let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
        let mw = if MIN {
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(2 * TILE) as *const __m128i))
        } else {
            let ty = if FIVE { QType::Q5_0 } else { QType::Q4_0 };
            _mm256_mul_ps(_mm256_set1_ps(ty.min_factor()), dw)
        };
        (dw, mw)
    }
}

/// Where a tile block's fifth-bit masks start ([`crate::packed::masks_at`]).
const fn masks_at(min: bool) -> usize {
    if min {
        4 * TILE
    } else {
        2 * TILE
    }
}

/// One block's step of every lane's sum, as `simd::direct` takes it:
/// `acc = fma(isum, dw * dx, acc)`, then `acc = fma(mw, dx * Σqx, acc)`,
/// with the activation block's scale and sum at `x.d[si]`, `x.dsum[si]`.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[inline(always)]
unsafe fn accumulate(
    a: &mut __m256,
    isum: __m256i,
    (dw, mw): (__m256, __m256),
    x: &QActs,
    si: usize,
) {
    // SAFETY: the caller guarantees the instructions; `x.d` and `x.dsum`
    // are indexed with bounds checks.
    unsafe {
        let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
        *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, *a);
        *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
    }
}

/// [`tiles`] in 256-bit vectors, with `D`'s integer dots: rows `2p` and
/// `2p + 1` of a tile block share a vector (their nibble bytes are 32
/// adjacent bytes), and a Q5_0 half's 16 fifth bits a row are 32 adjacent
/// bits of a mask.
///
/// # Safety
/// As [`tiles`]', with AVX2, FMA, F16C and `D`'s instructions.
#[inline(always)]
unsafe fn tiles_pairs<
    D: IDot,
    const FIVE: bool,
    const MIN: bool,
    const K4: bool,
    const M: usize,
>(
    x: &QActs,
    job: &Job,
    end: usize,
) {
    // SAFETY: as [`tiles`]'.
    unsafe {
        let sh = shape::<M>(x, job, end);
        let (nb, k, m, tile) = (sh.nb, sh.k, sh.m, sh.tile);
        // `D::dots_pairs` puts row `2p` in lane `p` and row `2p + 1` in
        // lane `p + 4`; this takes lane `c` to row `c`.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let low = _mm256_set1_epi8(0x0f);
        let mut k4 = ([_mm256_setzero_ps(); 8], [_mm256_setzero_ps(); 8]);
        let mut j = job.j0;
        while j < end {
            let base = job.w.add(j / TILE * tile);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            // Q4_K's blocks a super-block at a time, as in `tiles`.
            for b0 in (0..nb).step_by(group::<K4>()) {
                for b in b0..b0 + group::<K4>() {
                    let nibs = sh.block::<K4>(base, b);
                    let scales = block_scales::<FIVE, MIN, K4>(&sh, base, b, &mut k4);
                    // Rows 2q, 2q + 1: mask `2 * (q / 2) + half`'s word `q % 2`.
                    let bits = base.wrapping_add(b * sh.tb + masks_at(MIN)) as *const u32;
                    let (mut lo, mut hi) = (
                        [_mm256_setzero_si256(); PAIRS],
                        [_mm256_setzero_si256(); PAIRS],
                    );
                    for q in 0..PAIRS {
                        let v = _mm256_loadu_si256(nibs.add(32 * q) as *const __m256i);
                        lo[q] = _mm256_and_si256(v, low);
                        hi[q] = _mm256_and_si256(_mm256_srli_epi16::<4>(v), low);
                        if FIVE {
                            let word = 4 * (q / 2) + q % 2;
                            lo[q] = D::fifth(lo[q], bits.add(word).read_unaligned());
                            hi[q] = D::fifth(hi[q], bits.add(word + 2).read_unaligned());
                        }
                    }
                    for (r, a) in acc[..m].iter_mut().enumerate() {
                        let (xl, xh) = x_halves(x.rowq.as_ptr().add(r * k + b * QK));
                        let isum =
                            _mm256_permutevar8x32_epi32(D::dots_pairs(xl, xh, &lo, &hi), order);
                        accumulate(a, isum, scales, x, x.at(b, r));
                    }
                }
            }
            store_tile(&acc[..m], TILE.min(job.j1 - j), job, j);
            j += TILE;
        }
    }
}
