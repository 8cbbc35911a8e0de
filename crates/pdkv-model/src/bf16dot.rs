//! BF16 weights times bf16-rounded activations with AVX512_BF16's
//! `vdpbf16ps`, on CPUs that have it.
//!
//! Invariant (the one of [`crate::kernels`]): `y[r][j]` comes from one fixed
//! sequence of operations whatever the batch, the register tile or the
//! thread split. There are 16 f32 lanes; lane `l` takes the products of
//! values `32s + 2l` and `32s + 2l + 1` for `s = 0, 1, ...` in order (one
//! `vdpbf16ps` per step), and the 16 lanes are then summed in a fixed tree.
//! The activations are rounded to bf16 (nearest even) once per row, by the
//! caller (see [`round_rows`]). A product of two bf16 values is exact in
//! f32, so only the accumulation rounds.
//!
//! The model takes this path for BF16 matrices when activations are reduced
//! (the default; `PDKV_INT8_ACTIVATIONS=0` keeps them f32) and [`available`]
//! says the CPU can. Otherwise BF16 matrices go through the f32 path of
//! [`crate::kernels::matmul_blocks_many`], widened in registers.

use std::sync::OnceLock;

use crate::dispatch::{check_shapes, for_each_job_of, Features, SendConstPtr, SendPtr};
use crate::kernels::BlockLinear;
use crate::qtype::QType;

/// Values per `vdpbf16ps` step (one 512-bit register of bf16).
pub const STEP: usize = 32;
/// Activation rows per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
const NR: usize = 4;
/// Activation rows per cache block: a block of `x` is reused from L2 for
/// every weight tile of a job.
const MB: usize = 64;

/// Whether this CPU has AVX512_BF16 (with AVX-512F, AVX2 and FMA), detected once.
pub fn available() -> bool {
    static HAS: OnceLock<bool> = OnceLock::new();
    *HAS.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bf16")
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// `x` (whole [`STEP`]-value steps) rounded to bf16 bit patterns, nearest
/// even, into `out` (resized), by the conversion instruction (which treats
/// denormals as zero). Panics unless [`available`].
pub fn round_rows(x: &[f32], out: &mut Vec<u16>) {
    assert!(available(), "bf16 rounding needs a CPU with AVX512_BF16");
    assert!(
        x.len().is_multiple_of(STEP),
        "{} values are not whole {STEP}-value steps",
        x.len()
    );
    out.resize(x.len(), 0);
    // SAFETY: the CPU has AVX512_BF16; both slices hold whole steps.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        avx512::round(x, out)
    };
}

/// `y = x · wᵀ` for BF16 matrices: `x` is `m` rows of `k` bf16 values (from
/// [`round_rows`]), every `outs[i].ty` is [`QType::BF16`]. Panics unless
/// [`available`].
pub fn matmul_many(x: &[u16], m: usize, k: usize, outs: &mut [BlockLinear<'_>]) {
    assert!(available(), "bf16 dot products need a CPU with AVX512_BF16");
    assert!(
        k.is_multiple_of(STEP),
        "rows of {k} values are not whole {STEP}-value steps"
    );
    for o in outs.iter() {
        assert_eq!(
            o.ty,
            QType::BF16,
            "only BF16 matrices take bf16 dot products"
        );
    }
    let shapes = outs
        .iter()
        .map(|o| (o.w.len(), o.n * k * 2, o.y.len(), o.n));
    check_shapes((x.len(), m, k), "bytes", shapes);
    if m == 0 {
        return;
    }
    let xp = SendConstPtr(x.as_ptr());
    let view = |o: &mut BlockLinear<'_>| {
        let p = (SendConstPtr(o.w.as_ptr()), SendPtr(o.y.as_mut_ptr()), o.n);
        let work = m * k * std::mem::size_of::<u16>();
        (p, Features { n: o.n, work })
    };
    for_each_job_of(outs, NR, view, |(w, y, n), j0, j1| {
        // SAFETY: shapes were checked above and the CPU has the instructions;
        // jobs write disjoint column ranges of their `y`, and every `y` is a
        // distinct &mut borrow.
        #[cfg(target_arch = "x86_64")]
        unsafe {
            avx512::run_job(xp.get(), m, k, w.get(), y.0, n, j0, j1)
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (xp, w, y, n, j0, j1);
    });
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::*;
    use std::mem::transmute;

    use super::{MB, MR, NR, STEP};

    /// `x` (whole steps) rounded to bf16 by `vcvtne2ps2bf16`.
    ///
    /// # Safety
    /// The CPU has AVX512F and AVX512_BF16; `out` holds at least `x.len()`
    /// values, a whole number of [`STEP`]s.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub(super) unsafe fn round(x: &[f32], out: &mut [u16]) {
        // SAFETY: the caller guarantees AVX512F and AVX512_BF16, and `x` and
        // `out` hold the same whole number of steps: every load and store is
        // inside them.
        unsafe {
            for (src, dst) in x.chunks_exact(STEP).zip(out.chunks_exact_mut(STEP)) {
                let lo = _mm512_loadu_ps(src.as_ptr());
                let hi = _mm512_loadu_ps(src.as_ptr().add(16));
                // The second operand fills the low half.
                let v: __m512i = transmute(_mm512_cvtne2ps_pbh(hi, lo));
                _mm512_storeu_si512(dst.as_mut_ptr().cast(), v);
            }
        }
    }

    /// Columns `j0..j1` of `y[m, n] = x[m, k] · w[n, k]ᵀ`, `w` rows of `2k`
    /// bytes of bf16.
    ///
    /// # Safety
    /// The CPU has AVX512_BF16, AVX-512F, AVX2 and FMA; `x` holds `m * k`
    /// values, `w` `n` rows of `2k` bytes and `y` `m * n` floats, of which no
    /// one else writes columns `j0..j1`; `k` is a whole number of steps.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx512f,avx512bf16,avx2,fma")]
    pub(super) unsafe fn run_job(
        x: *const u16,
        m: usize,
        k: usize,
        w: *const u8,
        y: *mut f32,
        n: usize,
        j0: usize,
        j1: usize,
    ) {
        // SAFETY: the caller guarantees the instructions and the shapes; each
        // tile below lies inside the job's rows of `x`, rows `j0..j1` of `w` and
        // the matching columns of `y`.
        unsafe {
            let mut r0 = 0;
            while r0 < m {
                let r1 = (r0 + MB).min(m);
                let mut j = j0;
                while j < j1 {
                    let nc = (j1 - j).min(NR);
                    let mut r = r0;
                    while r < r1 {
                        let nr = (r1 - r).min(MR);
                        let (xt, wt, yt) = (x.add(r * k), w.add(j * 2 * k), y.add(r * n + j));
                        match (nr, nc) {
                            (4, 4) => tile::<4, 4>(xt, wt, k, yt, n),
                            (4, 3) => tile::<4, 3>(xt, wt, k, yt, n),
                            (4, 2) => tile::<4, 2>(xt, wt, k, yt, n),
                            (4, 1) => tile::<4, 1>(xt, wt, k, yt, n),
                            (3, 4) => tile::<3, 4>(xt, wt, k, yt, n),
                            (3, 3) => tile::<3, 3>(xt, wt, k, yt, n),
                            (3, 2) => tile::<3, 2>(xt, wt, k, yt, n),
                            (3, 1) => tile::<3, 1>(xt, wt, k, yt, n),
                            (2, 4) => tile::<2, 4>(xt, wt, k, yt, n),
                            (2, 3) => tile::<2, 3>(xt, wt, k, yt, n),
                            (2, 2) => tile::<2, 2>(xt, wt, k, yt, n),
                            (2, 1) => tile::<2, 1>(xt, wt, k, yt, n),
                            (1, 4) => tile::<1, 4>(xt, wt, k, yt, n),
                            (1, 3) => tile::<1, 3>(xt, wt, k, yt, n),
                            (1, 2) => tile::<1, 2>(xt, wt, k, yt, n),
                            (1, 1) => tile::<1, 1>(xt, wt, k, yt, n),
                            _ => unreachable!("tile shape out of range"),
                        }
                        r += nr;
                    }
                    j += nc;
                }
                r0 = r1;
            }
        }
    }

    /// `R x C` register tile: `R` rows of `x` (stride `k` values) against
    /// `C` rows of `w` (stride `2k` bytes), into `y` (row stride `ldy`).
    ///
    /// # Safety
    /// The CPU has AVX512_BF16 and AVX-512F; `x` holds `R` rows of `k` values,
    /// `w` `C` rows of `2k` bytes, and `y` `R` rows of stride `ldy` with `C`
    /// writable columns; `k` is a whole number of steps.
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const u16,
        w: *const u8,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees the instructions and that the tile's
        // `R` rows of `x`, `C` rows of `w` and `R x C` outputs are inside them.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); C]; R];
            let mut p = 0;
            while p < k {
                let mut xv = [_mm512_setzero_si512(); R];
                for (r, v) in xv.iter_mut().enumerate() {
                    *v = _mm512_loadu_si512(x.add(r * k + p).cast());
                }
                for c in 0..C {
                    let wv: __m512bh = transmute(_mm512_loadu_si512(w.add(2 * (c * k + p)).cast()));
                    for (row, x) in acc.iter_mut().zip(&xv) {
                        row[c] = _mm512_dpbf16_ps(row[c], transmute::<__m512i, __m512bh>(*x), wv);
                    }
                }
                p += STEP;
            }
            for (r, row) in acc.iter().enumerate() {
                for (c, a) in row.iter().enumerate() {
                    *y.add(r * ldy + c) = reduce(*a);
                }
            }
        }
    }

    /// Fixed-order sum of 16 lanes: lane `i` plus lane `i + 8`, then the
    /// 8-lane sum of the f32 kernels.
    ///
    /// # Safety
    /// The CPU has AVX-512F and AVX2.
    #[inline(always)]
    unsafe fn reduce(v: __m512) -> f32 {
        // SAFETY: the caller guarantees AVX-512F and AVX2; registers only.
        unsafe {
            let lo = _mm512_castps512_ps256(v);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            crate::kernels::matmul::avx2::hsum(_mm256_add_ps(lo, hi))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::rand_vec;

    /// What the kernel reports against what the operating system says of
    /// the CPU (Linux's flag names).
    fn cpu_flags_say_bf16() -> bool {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("reading /proc/cpuinfo");
        let flags = info
            .lines()
            .find(|l| l.starts_with("flags"))
            .expect("a flags line in /proc/cpuinfo");
        let has = |f: &str| flags.split_whitespace().any(|w| w == f);
        has("avx512f") && has("avx512_bf16") && has("avx2") && has("fma")
    }

    #[test]
    fn detection_agrees_with_the_cpu_flags() {
        assert_eq!(available(), cpu_flags_say_bf16());
    }

    /// `n` rows of `k` random values as BF16 bytes.
    fn bf16_matrix(seed: u64, n: usize, k: usize) -> Vec<u8> {
        rand_vec(seed, n * k)
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect()
    }

    fn run(x: &[u16], m: usize, k: usize, w: &[u8], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        matmul_many(
            x,
            m,
            k,
            &mut [BlockLinear {
                ty: QType::BF16,
                w,
                n,
                y: &mut y,
            }],
        );
        y
    }

    /// Where the CPU lacks the instructions the kernel tests have nothing to
    /// run; they then check that the CPU really lacks them.
    fn runnable() -> bool {
        if !available() {
            assert!(
                !cpu_flags_say_bf16(),
                "the CPU has AVX512_BF16 but it was not detected"
            );
            eprintln!("this CPU has no AVX512_BF16: the bf16 dot-product kernel is not run");
        }
        available()
    }

    #[test]
    fn rounding_is_nearest_even_as_half_rounds() {
        if !runnable() {
            return;
        }
        // Ties both ways, values that carry into the exponent, signs, huge
        // and tiny normals, plus random values.
        let mut x: Vec<f32> = [
            1.0f32,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0x3f81_8000),
            f32::from_bits(0x3f80_8001),
            f32::from_bits(0x3fff_ffff),
            -2.5,
            f32::MAX,
            -f32::MIN_POSITIVE,
            0.0,
            -0.0,
        ]
        .to_vec();
        x.extend(rand_vec(3, 64 - x.len()).iter().map(|v| v * 1e3));
        let mut got = Vec::new();
        round_rows(&x, &mut got);
        for (g, v) in got.iter().zip(&x) {
            assert_eq!(*g, half::bf16::from_f32(*v).to_bits(), "{v:e}");
        }
    }

    #[test]
    fn dot_products_match_f64_over_the_rounded_values() {
        if !runnable() {
            return;
        }
        for &(m, k, n) in &[
            (1, 32, 1),
            (1, 576, 9),
            (3, 64, 5),
            (6, 1536, 7),
            (9, 96, 13),
        ] {
            let xf = rand_vec(m as u64 + 100, m * k);
            let mut x = Vec::new();
            round_rows(&xf, &mut x);
            let w = bf16_matrix(k as u64, n, k);
            let y = run(&x, m, k, &w, n);
            let wv = |j: usize, i: usize| {
                half::bf16::from_le_bytes([w[2 * (j * k + i)], w[2 * (j * k + i) + 1]]).to_f64()
            };
            for r in 0..m {
                for j in 0..n {
                    let terms =
                        (0..k).map(|i| half::bf16::from_bits(x[r * k + i]).to_f64() * wv(j, i));
                    let (want, size) = terms.fold((0f64, 0f64), |(s, a), t| (s + t, a + t.abs()));
                    // Two roundings per lane and step, then four in the sum.
                    let tol = (2 * k / 16 + 4) as f64 * f32::EPSILON as f64 * size;
                    let got = y[r * n + j] as f64;
                    assert!(
                        (got - want).abs() <= tol,
                        "m={m} k={k} n={n} ({r},{j}): {got} vs {want} (tolerance {tol:e})"
                    );
                }
            }
        }
    }

    #[test]
    fn a_row_gets_the_same_bits_in_any_batch_tile_or_thread_split() {
        if !runnable() {
            return;
        }
        let (k, n) = (128, 23);
        let w = bf16_matrix(7, n, k);
        let m = 70;
        let mut x = Vec::new();
        round_rows(&rand_vec(8, m * k), &mut x);
        let alone: Vec<Vec<f32>> = (0..m)
            .map(|r| run(&x[r * k..(r + 1) * k], 1, k, &w, n))
            .collect();
        for threads in [1, 3] {
            let pool = crate::kernels::tests::pool(threads);
            for rows in [70, 5, 2] {
                let mut got = Vec::new();
                for (c, chunk) in x.chunks(rows * k).enumerate() {
                    let mc = chunk.len() / k;
                    let y = pool.install(|| run(chunk, mc, k, &w, n));
                    for r in 0..mc {
                        got.push((c * rows + r, y[r * n..(r + 1) * n].to_vec()));
                    }
                }
                for (r, y) in got {
                    let same = y
                        .iter()
                        .zip(&alone[r])
                        .all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "threads {threads} batches of {rows}: row {r} differs");
                }
            }
        }
    }
}
