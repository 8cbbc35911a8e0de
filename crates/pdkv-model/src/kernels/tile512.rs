//! The attention tile on AVX-512 registers, with the AVX2 tile's bits.
//!
//! A tile's rows are first copied ([`fill`]) into a buffer laid out for
//! 16-float registers: K rows in pairs `(i, i + 8)`, each 8 columns of row
//! `i` beside the same 8 of row `i + 8`, then the V rows as they are. One
//! register so carries two keys' 8-lane accumulators, each lane taking the
//! columns `c ≡ lane (mod 8)` in order as the AVX2 tile's does, and the
//! horizontal sums add in `hsum`'s tree; the exponentials are [`exp16`]'s,
//! the output columns are 16-lane registers taking the positions in order.
//! So every element goes through the AVX2 tile's operations, half as many
//! instructions. Used where many queries share a tile (the copy is made
//! once for all of them) and the head is a multiple of 16 floats.

use std::arch::x86_64::*;
use std::sync::OnceLock;

use super::elem::KvElem;
use super::expf::{exp1, exp16};
use crate::kernels::matmul::avx2::hsum;

/// Keys per tile: eight registers of two keys.
pub(super) const KEYS: usize = 16;

/// Queries in one sweep past which its tiles are copied for this tile
/// (fewer read the rows in place with the AVX2 tile). Two: a batch-1
/// decode step's three query heads per KV head (SmolLM2) share one copy;
/// medians of 3-4 alternating runs (Q8_0, f16 KV, 2 threads) at depths
/// 2,048, 4,096 and 8,128: 72.2 -> 74.5, 51.2 -> 52.7 and 31.2 -> 33.0
/// tok/s (past 4: the AVX2 tile widening each row for each query),
/// unchanged at 1,024 and with f32 KV.
pub(super) const WIDEN_PAST: usize = 2;

/// Floats in a tile's buffer for a head of `hd` floats.
pub(super) fn buffer_len(hd: usize) -> usize {
    2 * KEYS * hd
}

/// Whether this CPU has what the tile needs (AVX-512F and DQ beside AVX2, FMA and
/// F16C), detected once.
pub(super) fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
    })
}

/// Copies a tile's 16 K rows (`kp`) and their V rows (`v_offset` elements
/// further) into `buf` as floats, in the layout the tile reads.
///
/// # Safety
/// The CPU has AVX-512F and DQ, AVX2, FMA and F16C; `hd` is a multiple of 16;
/// `kp`'s rows and their V rows hold `hd` readable columns; `buf` is
/// [`buffer_len`]`(hd)` writable floats.
#[inline(always)]
pub(super) unsafe fn fill<E: KvElem>(
    kp: &[*const E; KEYS],
    v_offset: usize,
    hd: usize,
    buf: *mut f32,
) {
    // SAFETY: as this function's contract.
    unsafe {
        for i in 0..KEYS / 2 {
            let pair = buf.add(i * 2 * hd);
            for c in (0..hd).step_by(8) {
                let two = _mm512_insertf32x8::<1>(
                    _mm512_castps256_ps512(E::get8(kp[i], c)),
                    E::get8(kp[i + KEYS / 2], c),
                );
                _mm512_storeu_ps(pair.add(2 * c), two);
            }
        }
        let v = buf.add(KEYS * hd);
        for (t, &k) in kp.iter().enumerate() {
            for c in (0..hd).step_by(8) {
                _mm256_storeu_ps(v.add(t * hd + c), E::get8(k.add(v_offset), c));
            }
        }
    }
}

/// Lanes `0..16` are `hsum` of keys `0..16`'s accumulators, where register
/// `i` holds key `i` in its lower half and key `i + 8` in its upper: the
/// AVX2 `hsum8`'s additions on each half, its 128-bit quarters moved so the
/// halves stay apart.
///
/// # Safety
/// The CPU has AVX-512F.
#[inline(always)]
unsafe fn hsum16(v: &[__m512; 8]) -> __m512 {
    // SAFETY: the caller guarantees AVX-512F; registers only.
    unsafe {
        // Quarters [x0 + x1, x2 + x3, y0 + y1, y2 + y3]: each key's halves
        // added, as `hsum8`'s first step.
        let halves = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
            )
        };
        let pairs = |x: __m512, y: __m512| {
            _mm512_add_ps(
                _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        let (w0, w1) = (halves(v[0], v[4]), halves(v[2], v[6]));
        let (w2, w3) = (halves(v[1], v[5]), halves(v[3], v[7]));
        let (u, z) = (pairs(w0, w2), pairs(w1, w3));
        // Quarters now hold keys 0-3, 8-11, 4-7, 12-15.
        let s = _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(u, z),
            _mm512_shuffle_ps::<0b11_01_11_01>(u, z),
        );
        _mm512_shuffle_f32x4::<0b11_01_10_00>(s, s)
    }
}

/// A query as [`tile`] takes it: its vector, its output row (also the
/// running accumulator), its running maximum and sum, and how many of the
/// tile's keys it sees.
pub(super) struct Query<'a> {
    pub q: *const f32,
    pub out: *mut f32,
    pub m: &'a mut f32,
    pub l: &'a mut f32,
    pub seen: usize,
}

/// One tile for `N` queries over a [`fill`]ed buffer, each with the
/// operations it would have alone: the queries share the loads of K and V
/// and interleave their chains of multiply-adds, which one query's output
/// columns are too few to keep the multiply-add units busy.
///
/// # Safety
/// The CPU has AVX-512F and DQ, AVX2 and FMA; `hd` is a multiple of 16;
/// `buf` is a filled buffer for `hd`; each query's `q` points at `hd`
/// readable floats and its `out` at `hd` writable ones nothing else
/// touches; `1 <= seen <= 16`.
#[inline(always)]
pub(super) unsafe fn tile<const N: usize>(
    mut qs: [Query<'_>; N],
    buf: *const f32,
    hd: usize,
    scale: f32,
) {
    // SAFETY: as this function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); KEYS / 2]; N];
        for c in (0..hd).step_by(8) {
            let qv: [__m512; N] =
                std::array::from_fn(|n| _mm512_broadcast_f32x8(_mm256_loadu_ps(qs[n].q.add(c))));
            for i in 0..KEYS / 2 {
                let k = _mm512_loadu_ps(buf.add(i * 2 * hd + 2 * c));
                for (a, &qn) in acc.iter_mut().zip(&qv) {
                    a[i] = _mm512_fmadd_ps(qn, k, a[i]);
                }
            }
        }
        let mut ps = [[0f32; KEYS]; N];
        let mut starts = [Start::Zero; N];
        for (((q, acc), ps), start) in qs.iter_mut().zip(&acc).zip(&mut ps).zip(&mut starts) {
            *start = softmax(hsum16(acc), scale, q.seen, q.m, q.l, ps);
        }
        let outs: [*mut f32; N] = std::array::from_fn(|n| qs[n].out);
        let ps: [&[f32]; N] = std::array::from_fn(|n| &ps[n][..qs[n].seen]);
        let v = buf.add(KEYS * hd);
        let mut c = 0;
        while c + 128 <= hd {
            columns::<8, N>(outs.map(|o| o.add(c)), v.add(c), hd, ps, starts);
            c += 128;
        }
        while c + 64 <= hd {
            columns::<4, N>(outs.map(|o| o.add(c)), v.add(c), hd, ps, starts);
            c += 64;
        }
        while c < hd {
            columns::<1, N>(outs.map(|o| o.add(c)), v.add(c), hd, ps, starts);
            c += 16;
        }
    }
}

/// A query's softmax step over a tile's raw scores `dots`: the scores
/// scaled (keys past `seen` at `-inf`), the new maximum and sum (`m`,
/// `l`), the tile's probabilities in `ps`; returns how its output starts.
///
/// # Safety
/// The CPU has AVX-512F and DQ, AVX2 and FMA; `1 <= seen <= 16`.
#[inline(always)]
unsafe fn softmax(
    dots: __m512,
    scale: f32,
    seen: usize,
    m: &mut f32,
    l: &mut f32,
    ps: &mut [f32; KEYS],
) -> Start {
    // SAFETY: as this function's contract; `ps` holds 16 floats.
    unsafe {
        let keep: __mmask16 = ((1u32 << seen) - 1) as u16;
        let s = _mm512_mask_mul_ps(
            _mm512_set1_ps(f32::NEG_INFINITY),
            keep,
            dots,
            _mm512_set1_ps(scale),
        );
        let mt = _mm512_reduce_max_ps(s);
        let mx = if mt > *m { mt } else { *m };
        let p = exp16(_mm512_sub_ps(s, _mm512_set1_ps(mx)));
        let sum = hsum(_mm256_add_ps(
            _mm512_castps512_ps256(p),
            _mm512_extractf32x8_ps::<1>(p),
        ));
        _mm512_storeu_ps(ps.as_mut_ptr(), p);
        let first = *m == f32::NEG_INFINITY;
        let alpha = if !first && mx > *m {
            exp1(*m - mx)
        } else {
            1.0
        };
        *l = if first { sum } else { *l * alpha + sum };
        *m = mx;
        if first {
            Start::Zero
        } else if alpha != 1.0 {
            Start::Scaled(_mm512_set1_ps(alpha))
        } else {
            Start::Kept
        }
    }
}

/// How an output register starts a tile: zero on a query's first tile,
/// rescaled when the maximum grew, as it is otherwise.
#[derive(Clone, Copy)]
enum Start {
    Zero,
    Scaled(__m512),
    Kept,
}

/// `16 * C` output columns of `N` queries at `outs`: each element
/// `fma(p_t, v_t, acc)` over the positions its query sees, in order; `v`
/// is the first V row's matching column (rows `hd` floats apart). The
/// queries share the V loads of the positions all of them see.
///
/// # Safety
/// The CPU has AVX-512F; each of `outs` is `16 * C` writable floats, and
/// each V row from `v` that a query sees has `16 * C` readable floats.
#[inline(always)]
unsafe fn columns<const C: usize, const N: usize>(
    outs: [*mut f32; N],
    v: *const f32,
    hd: usize,
    ps: [&[f32]; N],
    starts: [Start; N],
) {
    // SAFETY: as this function's contract.
    unsafe {
        let mut acc = [[_mm512_setzero_ps(); C]; N];
        for ((a, &out), &start) in acc.iter_mut().zip(&outs).zip(&starts) {
            for (j, x) in a.iter_mut().enumerate() {
                let at = out.add(16 * j);
                *x = match start {
                    Start::Zero => _mm512_setzero_ps(),
                    Start::Scaled(alpha) => _mm512_mul_ps(_mm512_loadu_ps(at), alpha),
                    Start::Kept => _mm512_loadu_ps(at),
                };
            }
        }
        let common = ps.iter().map(|p| p.len()).min().unwrap_or(0);
        for t in 0..common {
            let vt = v.add(t * hd);
            let pv: [__m512; N] = ps.map(|p| _mm512_set1_ps(p[t]));
            for j in 0..C {
                let x = _mm512_loadu_ps(vt.add(16 * j));
                for (a, &p) in acc.iter_mut().zip(&pv) {
                    a[j] = _mm512_fmadd_ps(p, x, a[j]);
                }
            }
        }
        for (a, p) in acc.iter_mut().zip(&ps) {
            for (t, &pt) in p.iter().enumerate().skip(common) {
                let (vt, pv) = (v.add(t * hd), _mm512_set1_ps(pt));
                for (j, x) in a.iter_mut().enumerate() {
                    *x = _mm512_fmadd_ps(pv, _mm512_loadu_ps(vt.add(16 * j)), *x);
                }
            }
        }
        for (a, &out) in acc.iter().zip(&outs) {
            for (j, x) in a.iter().enumerate() {
                _mm512_storeu_ps(out.add(16 * j), *x);
            }
        }
    }
}
