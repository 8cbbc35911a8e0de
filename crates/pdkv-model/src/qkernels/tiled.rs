//! Packed matrices ([`QType::Q5_0R8`], tiles of 8 rows laid out by block:
//! [`crate::packed`]) at batch 1 and small batches, with AVX-512 VNNI:
//! a tile block's 8 rows' nibbles are two 512-bit loads, each fifth-bit
//! mask one mask-register load, and the tile one stream. Every other path
//! reads a packed matrix's rows unpacked ([`run_unpacked`]).
//!
//! The float sequence per output is [`super::simd`]'s direct kernel's
//! (see [`super`]): `acc = fma(I_b, dw_b * dx_b, acc)`, then
//! `acc = fma(-16 dw_b, dx_b * Σqx_b, acc)`, block by block, so a packed
//! matrix's outputs have its GGUF rows' bits.

use std::arch::x86_64::*;

use super::acts::{QActs, DIRECT_MAX, GROUP};
use super::idot::{Avx2, IDot, PAIRS};
use super::job::Job;
use super::regs::x_halves;
use crate::packed::{MASKS_AT, NIBBLES_AT, TILE, TILE_BLOCK};
use crate::prefetch::{tiles_ahead, to_l2, AHEAD};
use crate::qtype::{QType, QK};

/// # Safety
/// As [`super::simd::run_job_vnni`]'s, for a `Q5_0R8` job whose columns
/// start at a tile (`job.j0` a multiple of [`TILE`]), with `x.m` at most
/// [`DIRECT_MAX`] rows; the CPU has AVX-512 F, BW and VNNI (and AVX2, FMA,
/// F16C).
#[target_feature(enable = "avx2,fma,f16c,avx512f,avx512bw,avx512vnni,avx512vl")]
pub(super) unsafe fn run_job_vnni(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract; the tail rows (GGUF rows) go
    // to the direct kernel of Q5_0, whose contract this one includes.
    unsafe {
        debug_assert!(job.ty == QType::Q5_0R8 && job.j0.is_multiple_of(TILE) && x.m <= DIRECT_MAX);
        let tiled = job.n / TILE * TILE;
        let end = job.j1.min(tiled);
        if job.j0 < end {
            match x.m {
                1 => tiles::<1>(x, job, end),
                _ => tiles::<0>(x, job, end),
            }
        }
        if job.j1 > tiled {
            let tail = Job {
                ty: QType::Q5_0,
                j0: tiled.max(job.j0),
                ..*job
            };
            super::simd::run_job_vnni_direct(x, &tail);
        }
    }
}

/// The whole tiles of columns `job.j0..end` for `M` activation rows (`M
/// = 0`: `x.m`).
///
/// # Safety
/// As [`run_job_vnni`]'s, `end` a multiple of [`TILE`] at most `job.n`.
#[inline(always)]
unsafe fn tiles<const M: usize>(x: &QActs, job: &Job, end: usize) {
    // SAFETY: the caller guarantees the CPU's instructions and that the
    // job's tiles, activations (`x.rowq`, `m <= DIRECT_MAX` rows) and
    // output columns are inside `job.w`, `x` and `job.y`.
    unsafe {
        let (nb, k, m) = (x.blocks(), x.k, if M == 0 { x.m } else { M });
        let tb = TILE * QType::Q5_0R8.row_bytes(k);
        to_l2(
            job.w.wrapping_add(job.j0 / TILE * tb),
            AHEAD.min((end - job.j0) / TILE) * tb,
        );
        // After the two folds below, dword 0 of 128-bit lane `l` holds row
        // `l`'s sum and dword 1 row `l + 4`'s.
        let order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 0, 0, 0, 0, 0, 0, 0);
        let min_factor = _mm256_set1_ps(QType::Q5_0R8.min_factor());
        let mut j = job.j0;
        while j < end {
            let base = job.w.add(j / TILE * tb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for b in 0..nb {
                tiles_ahead(base, tb, b * TILE_BLOCK, TILE_BLOCK);
                let p = base.add(b * TILE_BLOCK);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                let masks = p.add(MASKS_AT) as *const u64;
                let (qa, qb) = (
                    _mm512_loadu_si512(p.add(NIBBLES_AT) as *const _),
                    _mm512_loadu_si512(p.add(NIBBLES_AT + 64) as *const _),
                );
                let la = values::<false>(qa, masks.read_unaligned());
                let ha = values::<true>(qa, masks.add(1).read_unaligned());
                let lb = values::<false>(qb, masks.add(2).read_unaligned());
                let hb = values::<true>(qb, masks.add(3).read_unaligned());
                let mw = _mm256_mul_ps(min_factor, dw);
                for (r, a) in acc[..m].iter_mut().enumerate() {
                    let xp = x.rowq.as_ptr().add(r * k + b * QK);
                    let xl = _mm512_broadcast_i32x4(_mm_loadu_si128(xp as *const __m128i));
                    let xh = _mm512_broadcast_i32x4(_mm_loadu_si128(xp.add(16) as *const __m128i));
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
                    let si = b * GROUP + r;
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, *a);
                    *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                }
            }
            super::regs::store_tile(&acc[..m], TILE.min(job.j1 - j), job, j);
            j += TILE;
        }
    }
}

/// Values 0..16 (`HIGH`: 16..32) of 4 rows whose 16 nibble bytes each are
/// `q`'s 128-bit lanes, with 16 added where the row's fifth bit in `mask`
/// (16 bits a lane, lane 0 lowest) is set: unsigned 5-bit values as bytes.
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[inline(always)]
unsafe fn values<const HIGH: bool>(q: __m512i, mask: u64) -> __m512i {
    // SAFETY: the caller guarantees the instructions; registers only.
    unsafe {
        let q = if HIGH { _mm512_srli_epi16::<4>(q) } else { q };
        let v = _mm512_and_si512(q, _mm512_set1_epi8(0x0f));
        _mm512_mask_add_epi8(v, mask, v, _mm512_set1_epi8(16))
    }
}

/// # Safety
/// As [`run_job_vnni`]'s, with AVX2, FMA and F16C for the instructions.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_job_avx2(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract; the tail rows (GGUF rows) go
    // to the direct kernel of Q5_0, whose contract this one includes.
    unsafe {
        debug_assert!(job.ty == QType::Q5_0R8 && job.j0.is_multiple_of(TILE));
        let tiled = job.n / TILE * TILE;
        let end = job.j1.min(tiled);
        if job.j0 < end {
            match x.m {
                1 => tiles_pairs::<Avx2, 1>(x, job, end),
                _ => tiles_pairs::<Avx2, 0>(x, job, end),
            }
        }
        if job.j1 > tiled {
            let tail = Job {
                ty: QType::Q5_0,
                j0: tiled.max(job.j0),
                ..*job
            };
            super::simd::run_job_avx2_direct(x, &tail);
        }
    }
}

/// [`tiles`] in 256-bit vectors, with `D`'s integer dots: rows `2p` and
/// `2p + 1` of a tile block share a vector (their nibble bytes are 32
/// adjacent bytes), each half's 16 fifth bits 32 adjacent bits of a mask.
///
/// # Safety
/// As [`tiles`]', with AVX2, FMA, F16C and `D`'s instructions.
#[inline(always)]
unsafe fn tiles_pairs<D: IDot, const M: usize>(x: &QActs, job: &Job, end: usize) {
    // SAFETY: the caller guarantees the CPU's instructions and that the
    // job's tiles, activations (`x.rowq`, `m <= DIRECT_MAX` rows) and
    // output columns are inside `job.w`, `x` and `job.y`.
    unsafe {
        let (nb, k, m) = (x.blocks(), x.k, if M == 0 { x.m } else { M });
        let tb = TILE * QType::Q5_0R8.row_bytes(k);
        to_l2(
            job.w.wrapping_add(job.j0 / TILE * tb),
            AHEAD.min((end - job.j0) / TILE) * tb,
        );
        // `D::dots_pairs` puts row `2p` in lane `p` and row `2p + 1` in
        // lane `p + 4`; this takes lane `c` to row `c`.
        let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        let (low, min_factor) = (
            _mm256_set1_epi8(0x0f),
            _mm256_set1_ps(QType::Q5_0R8.min_factor()),
        );
        let mut j = job.j0;
        while j < end {
            let base = job.w.add(j / TILE * tb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for b in 0..nb {
                tiles_ahead(base, tb, b * TILE_BLOCK, TILE_BLOCK);
                let p = base.add(b * TILE_BLOCK);
                let dw = _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i));
                // Mask `2 * (p / 2) + half`'s 32-bit word `p % 2`: rows 2p, 2p + 1.
                let bits = p.add(MASKS_AT) as *const u32;
                let (mut lo, mut hi) = (
                    [_mm256_setzero_si256(); PAIRS],
                    [_mm256_setzero_si256(); PAIRS],
                );
                for q in 0..PAIRS {
                    let v = _mm256_loadu_si256(p.add(NIBBLES_AT + 32 * q) as *const __m256i);
                    let word = 4 * (q / 2) + q % 2;
                    lo[q] = D::fifth(_mm256_and_si256(v, low), bits.add(word).read_unaligned());
                    hi[q] = D::fifth(
                        _mm256_and_si256(_mm256_srli_epi16::<4>(v), low),
                        bits.add(word + 2).read_unaligned(),
                    );
                }
                let mw = _mm256_mul_ps(min_factor, dw);
                for (r, a) in acc[..m].iter_mut().enumerate() {
                    let (xl, xh) = x_halves(x.rowq.as_ptr().add(r * k + b * QK));
                    let isum = _mm256_permutevar8x32_epi32(D::dots_pairs(xl, xh, &lo, &hi), order);
                    let si = b * GROUP + r;
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, *a);
                    *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                }
            }
            super::regs::store_tile(&acc[..m], TILE.min(job.j1 - j), job, j);
            j += TILE;
        }
    }
}
