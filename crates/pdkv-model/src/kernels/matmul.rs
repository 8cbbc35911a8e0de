//! The f32 matrix multiply: `y = x · wᵀ` in register tiles of `MR`
//! activation rows by `NR` weight rows, one 8-lane accumulator per output
//! element (see the invariant in [`crate::kernels`]). Its tiles, horizontal
//! sum and dot product are the arithmetic the other kernels reproduce.

use crate::dispatch::{
    backend, check_shapes, for_each_job_of, Backend, Features, SendConstPtr, SendPtr,
};

/// Activation rows per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
pub(super) const NR: usize = 3;
/// Activation rows per cache block: a block of `x` is reused from L2 for
/// every weight tile of a job.
const MB: usize = 64;

/// One weight matrix applied to shared activations: `y = x · wᵀ`, where `w`
/// is `[n, k]` row-major and `y` is `[m, n]` row-major.
pub struct Linear<'a> {
    pub w: &'a [f32],
    pub n: usize,
    pub y: &'a mut [f32],
}

/// `y[m, n] = x[m, k] · w[n, k]ᵀ` on the current rayon pool.
pub fn matmul(x: &[f32], m: usize, k: usize, w: &[f32], n: usize, y: &mut [f32]) {
    matmul_many(x, m, k, &mut [Linear { w, n, y }]);
}

/// Several products of the same activations in one parallel dispatch (for
/// example the q, k and v projections).
pub fn matmul_many(x: &[f32], m: usize, k: usize, outs: &mut [Linear<'_>]) {
    matmul_many_with(backend(), x, m, k, outs)
}

/// [`matmul_many`] with an explicit backend (tests exercise both).
pub fn matmul_many_with(be: Backend, x: &[f32], m: usize, k: usize, outs: &mut [Linear<'_>]) {
    let shapes = outs.iter().map(|o| (o.w.len(), o.n * k, o.y.len(), o.n));
    check_shapes((x.len(), m, k), "floats", shapes);
    if m == 0 || k == 0 {
        for o in outs.iter_mut() {
            o.y[..m * o.n].fill(0.0);
        }
        return;
    }
    let x = SendConstPtr(x.as_ptr());
    let view = |o: &mut Linear<'_>| {
        let p = (SendConstPtr(o.w.as_ptr()), SendPtr(o.y.as_mut_ptr()), o.n);
        let work = m * k * std::mem::size_of::<f32>();
        (p, Features { n: o.n, work })
    };
    for_each_job_of(outs, NR, view, |(w, y, n), j0, j1| {
        // SAFETY: shapes were checked above; jobs write disjoint column
        // ranges of their `y`, and every `y` is a distinct &mut borrow.
        unsafe {
            run_job(
                be,
                x.get(),
                m,
                k,
                &Job {
                    w: w.get(),
                    y,
                    n,
                    j0,
                    j1,
                },
            )
        }
    });
}

pub(super) struct Job {
    pub(super) w: *const f32,
    pub(super) y: SendPtr<f32>,
    pub(super) n: usize,
    pub(super) j0: usize,
    pub(super) j1: usize,
}
// SAFETY: see `SendPtr`; `w` is only read.
unsafe impl Send for Job {}
// SAFETY: as for `Send`: `y` is written only in the job's own columns.
unsafe impl Sync for Job {}

/// Computes columns `j0..j1` of `y` for all `m` rows.
///
/// # Safety
/// `x` holds `m*k` floats, `job.w` `n*k`, `job.y` `m*n`; no one else writes
/// columns `j0..j1` of `y`.
pub(super) unsafe fn run_job(be: Backend, x: *const f32, m: usize, k: usize, job: &Job) {
    // SAFETY: as this function's contract, plus a backend the CPU has.
    unsafe {
        match be {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2Fma => avx2::run_job(x, m, k, job),
            _ => portable::run_job(x, m, k, job),
        }
    }
}

/// Bytes of weight rows kept in L1 while a tile of activation rows sweeps them.
pub(super) const W_L1_BYTES: usize = 24 << 10;

/// Walks a job in cache blocks and register tiles, calling `tile(mr, nr, r, j)`.
/// The order is: blocks of `MB` activation rows (kept in L2), then panels of
/// weight rows that fit in L1, then `MR`-row activation tiles (each loaded
/// into L1 once per panel), then `NR`-row weight tiles. The order changes
/// only which data is cached, never the arithmetic of an element.
#[inline(always)]
fn for_each_tile(m: usize, k: usize, job: &Job, mut tile: impl FnMut(usize, usize, usize, usize)) {
    let panel = (W_L1_BYTES / (4 * k.max(1)) / NR * NR).max(NR);
    let mut r0 = 0;
    while r0 < m {
        let r_end = (r0 + MB).min(m);
        let mut p0 = job.j0;
        while p0 < job.j1 {
            let p_end = (p0 + panel).min(job.j1);
            let mut r = r0;
            while r < r_end {
                let mr = MR.min(r_end - r);
                let mut j = p0;
                while j < p_end {
                    let nr = NR.min(p_end - j);
                    tile(mr, nr, r, j);
                    j += nr;
                }
                r += mr;
            }
            p0 = p_end;
        }
        r0 = r_end;
    }
}

/// A job's body in a flavour module: every tile of the job (in
/// [`for_each_tile`]'s order) through the module's micro-kernel `$kernel`,
/// `$x` being `$m` activation rows of `$k` floats.
macro_rules! run_tiles {
    ($kernel:ident, $x:ident, $m:ident, $k:ident, $job:ident) => {
        let (w, y, n) = ($job.w, $job.y.0, $job.n);
        for_each_tile($m, $k, $job, |mr, nr, r, j| {
            // SAFETY: the tile lies inside the job's rows and columns.
            unsafe {
                let xt = $x.add(r * $k);
                let wt = w.add(j * $k);
                let yt = y.add(r * n + j);
                dispatch_tile!($kernel, mr, nr, xt, wt, $k, yt, n)
            }
        })
    };
}

/// Dispatches a runtime tile shape to a monomorphised micro-kernel.
macro_rules! dispatch_tile {
    ($kernel:ident, $mr:expr, $nr:expr, $($arg:expr),*) => {
        match ($mr, $nr) {
            (4, 3) => $kernel::<4, 3>($($arg),*),
            (4, 2) => $kernel::<4, 2>($($arg),*),
            (4, 1) => $kernel::<4, 1>($($arg),*),
            (3, 3) => $kernel::<3, 3>($($arg),*),
            (3, 2) => $kernel::<3, 2>($($arg),*),
            (3, 1) => $kernel::<3, 1>($($arg),*),
            (2, 3) => $kernel::<2, 3>($($arg),*),
            (2, 2) => $kernel::<2, 2>($($arg),*),
            (2, 1) => $kernel::<2, 1>($($arg),*),
            (1, 3) => $kernel::<1, 3>($($arg),*),
            (1, 2) => $kernel::<1, 2>($($arg),*),
            (1, 1) => $kernel::<1, 1>($($arg),*),
            _ => unreachable!("tile shape out of range"),
        }
    };
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    use super::{for_each_tile, Job};

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn run_job(x: *const f32, m: usize, k: usize, job: &Job) {
        run_tiles!(tile, x, m, k, job);
    }

    /// Fixed-order horizontal sum of 8 lanes: (i + i+4), then (+2), then (+1).
    ///
    /// # Safety
    /// The CPU has AVX (AVX2 here).
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        // SAFETY: the caller guarantees AVX; registers only.
        unsafe {
            let lo = _mm256_castps256_ps128(v);
            let hi = _mm256_extractf128_ps::<1>(v);
            let s4 = _mm_add_ps(lo, hi);
            let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
            _mm_cvtss_f32(s1)
        }
    }

    /// `MR x NR` register tile: `MR` rows of `x` (stride `k`) against `NR`
    /// rows of `w` (stride `k`), into `y` (row stride `ldy`).
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `x` holds `R` rows of `k` floats, `w` `C`
    /// rows of `k` floats, and `y` `R` rows of stride `ldy` with `C` writable
    /// columns.
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees AVX2 and FMA and that the tile's `R`
        // rows of `x`, `C` rows of `w` (`k` floats each) and `R x C` outputs are
        // inside them.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); C]; R];
            let k8 = k & !7;
            let mut p = 0;
            while p < k8 {
                let mut wv = [_mm256_setzero_ps(); C];
                for (c, wc) in wv.iter_mut().enumerate() {
                    *wc = _mm256_loadu_ps(w.add(c * k + p));
                }
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let xv = _mm256_loadu_ps(x.add(r * k + p));
                    for c in 0..C {
                        acc_r[c] = _mm256_fmadd_ps(xv, wv[c], acc_r[c]);
                    }
                }
                p += 8;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (c, a) in acc_r.iter().enumerate() {
                    let mut s = hsum(*a);
                    for t in k8..k {
                        s = (*x.add(r * k + t)).mul_add(*w.add(c * k + t), s);
                    }
                    *y.add(r * ldy + c) = s;
                }
            }
        }
    }

    /// `dot(a, b)` with the same scheme as a matmul element.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `a` and `b` point at `k` readable floats.
    #[inline(always)]
    pub(super) unsafe fn dot(a: *const f32, b: *const f32, k: usize) -> f32 {
        // SAFETY: the caller guarantees AVX2 and FMA and `k` readable floats at
        // `a` and at `b`.
        unsafe {
            let mut acc = _mm256_setzero_ps();
            let k8 = k & !7;
            let mut p = 0;
            while p < k8 {
                acc = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(p)), _mm256_loadu_ps(b.add(p)), acc);
                p += 8;
            }
            let mut s = hsum(acc);
            for t in k8..k {
                s = (*a.add(t)).mul_add(*b.add(t), s);
            }
            s
        }
    }
}

pub(super) mod portable {
    use super::{for_each_tile, Job};
    use crate::kernels::elem::KvElem;

    pub(super) unsafe fn run_job(x: *const f32, m: usize, k: usize, job: &Job) {
        run_tiles!(tile, x, m, k, job);
    }

    /// The same fixed horizontal order as the AVX2 flavour.
    #[inline(always)]
    pub(super) fn hsum(a: &[f32; 8]) -> f32 {
        let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
        let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
        s2[0] + s2[1]
    }

    /// # Safety
    /// `x` holds `R` rows of `k` floats, `w` `C` rows of `k` floats, and `y`
    /// `R` rows of stride `ldy` with `C` writable columns.
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees that the tile's `R` rows of `x`, `C`
        // rows of `w` (`k` floats each) and `R x C` outputs are inside them.
        unsafe {
            let mut acc = [[[0f32; 8]; C]; R];
            let k8 = k & !7;
            let mut p = 0;
            while p < k8 {
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    for (c, a) in acc_r.iter_mut().enumerate() {
                        for (l, al) in a.iter_mut().enumerate() {
                            *al += *x.add(r * k + p + l) * *w.add(c * k + p + l);
                        }
                    }
                }
                p += 8;
            }
            for (r, acc_r) in acc.iter().enumerate() {
                for (c, a) in acc_r.iter().enumerate() {
                    let mut s = hsum(a);
                    for t in k8..k {
                        s += *x.add(r * k + t) * *w.add(c * k + t);
                    }
                    *y.add(r * ldy + c) = s;
                }
            }
        }
    }

    /// # Safety
    /// `a` and `b` point at `k` readable floats.
    pub(in crate::kernels) unsafe fn dot<E: KvElem>(a: *const f32, b: *const E, k: usize) -> f32 {
        // SAFETY: the caller guarantees `k` readable elements at `a` and at `b`.
        unsafe {
            let mut acc = [0f32; 8];
            let k8 = k & !7;
            let mut p = 0;
            while p < k8 {
                for (l, al) in acc.iter_mut().enumerate() {
                    *al += *a.add(p + l) * E::get(b, p + l);
                }
                p += 8;
            }
            let mut s = hsum(&acc);
            for t in k8..k {
                s += *a.add(t) * E::get(b, t);
            }
            s
        }
    }
}

/// `dot(a, b)` with the matmul element scheme.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    // SAFETY: both slices hold `a.len()` floats; the backend matches the CPU.
    unsafe {
        match backend() {
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2Fma => dot_avx2(a, b),
            _ => portable::dot(a.as_ptr(), b.as_ptr(), a.len()),
        }
    }
}

/// # Safety
/// The CPU has AVX2 and FMA; `b` is at least as long as `a`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2 and FMA; both slices hold `a.len()`
    // floats (the caller asserted equal lengths).
    unsafe { avx2::dot(a.as_ptr(), b.as_ptr(), a.len()) }
}
