//! Kernels that act on one row at a time: RMSNorm (its squares summed in
//! one fixed order), RoPE and SwiGLU's SiLU.

use super::expf::exp_any1;
#[cfg(target_arch = "x86_64")]
use super::expf::exp_any8;

/// RMSNorm of one row as Hugging Face computes it in f32:
/// `w * (x * 1/sqrt(mean(x²) + eps))`. The squares are summed in f64
/// ([`sum_squares`]), the mean rounded to f32.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    debug_assert!(x.len() == w.len() && out.len() == x.len());
    let inv = rms_inv(x, eps);
    for ((o, &xi), &wi) in out.iter_mut().zip(x).zip(w) {
        *o = wi * (xi * inv);
    }
}

/// RMSNorm in place.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    debug_assert!(x.len() == w.len());
    let inv = rms_inv(x, eps);
    for (xi, &wi) in x.iter_mut().zip(w) {
        *xi = wi * (*xi * inv);
    }
}

fn rms_inv(x: &[f32], eps: f32) -> f32 {
    let var = (sum_squares(x) / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
}

/// `Σ x²` in f64, in one fixed order whatever the CPU: element `i` of
/// each whole run of 8 into accumulator `i % 8` (each square is exact in
/// f64, so a fused multiply-add rounds as the addition alone), the eight
/// added as `((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7))`, then the
/// tail in index order. Eight chains instead of one: a row of 576 was a
/// chain of 576 dependent additions.
fn sum_squares(x: &[f32]) -> f64 {
    let n8 = x.len() & !7;
    #[cfg(target_arch = "x86_64")]
    let acc = if crate::dispatch::backend() == crate::dispatch::Backend::Avx2Fma {
        // SAFETY: the backend is chosen only where the CPU has AVX2 and FMA.
        unsafe { squares8_avx2(&x[..n8]) }
    } else {
        squares8(&x[..n8])
    };
    #[cfg(not(target_arch = "x86_64"))]
    let acc = squares8(&x[..n8]);
    let mut ss = ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
    for &v in &x[n8..] {
        ss += (v as f64) * (v as f64);
    }
    ss
}

/// [`sum_squares`]' eight accumulators over `x` (a multiple of 8 long).
fn squares8(x: &[f32]) -> [f64; 8] {
    let mut acc = [0f64; 8];
    for run in x.chunks_exact(8) {
        for (a, &v) in acc.iter_mut().zip(run) {
            *a += (v as f64) * (v as f64);
        }
    }
    acc
}

/// [`squares8`] in two registers of four f64 lanes.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn squares8_avx2(x: &[f32]) -> [f64; 8] {
    use std::arch::x86_64::*;
    let mut acc = [0f64; 8];
    // SAFETY: the CPU has AVX2 and FMA (this function's contract); each
    // load reads elements `i..i + 8` of `x`, whose length is a multiple of
    // 8, and the stores write the 8 f64 of `acc`.
    unsafe {
        let (mut lo, mut hi) = (_mm256_setzero_pd(), _mm256_setzero_pd());
        for i in (0..x.len()).step_by(8) {
            let v = _mm256_loadu_ps(x.as_ptr().add(i));
            let a = _mm256_cvtps_pd(_mm256_castps256_ps128(v));
            let b = _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v));
            lo = _mm256_fmadd_pd(a, a, lo);
            hi = _mm256_fmadd_pd(b, b, hi);
        }
        _mm256_storeu_pd(acc.as_mut_ptr(), lo);
        _mm256_storeu_pd(acc.as_mut_ptr().add(4), hi);
    }
    acc
}

/// Rotary frequencies as Hugging Face computes them in f32:
/// `inv_freq[i] = 1 / theta^((2i) / head_dim)`.
pub fn rope_inv_freq(theta: f32, head_dim: usize) -> Vec<f32> {
    (0..head_dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / head_dim as f32;
            1.0f32 / theta.powf(e)
        })
        .collect()
}

/// Fills `cos`/`sin` (`head_dim / 2` each) for position `pos`; the angle is
/// `pos * inv_freq` rounded to f32 as in Hugging Face.
pub fn rope_cos_sin(pos: usize, inv_freq: &[f32], cos: &mut [f32], sin: &mut [f32]) {
    for ((f, c), s) in inv_freq.iter().zip(cos.iter_mut()).zip(sin.iter_mut()) {
        let a = (pos as f32) * f;
        let a64 = a as f64;
        *c = a64.cos() as f32;
        *s = a64.sin() as f32;
    }
}

/// Rotate-half RoPE on one head vector: pairs `(i, i + d/2)`.
pub fn rope_apply(v: &mut [f32], cos: &[f32], sin: &[f32]) {
    let half = v.len() / 2;
    let (a, b) = v.split_at_mut(half);
    for i in 0..half {
        let (x1, x2) = (a[i], b[i]);
        a[i] = x1 * cos[i] - x2 * sin[i];
        b[i] = x2 * cos[i] + x1 * sin[i];
    }
}

/// `gate[i] = silu(gate[i]) * up[i]` with `silu(x) = x / (1 + e^-x)`,
/// `e^-x` the attention softmax's polynomial ([`exp_any1`]: within 4 ulp,
/// infinite for `x < -88`, where SiLU is -0): eight lanes at a time where
/// the CPU has AVX2, the same operations, so the same bits, on any machine.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    let n = gate.len().min(up.len());
    let (gate, up) = (&mut gate[..n], &up[..n]);
    #[allow(unused_mut)]
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::dispatch::backend() == crate::dispatch::Backend::Avx2Fma {
        // SAFETY: the backend is chosen only where the CPU has AVX2 and FMA.
        done = unsafe { silu_mul_avx2(gate, up) };
    }
    for (g, &u) in gate[done..].iter_mut().zip(&up[done..]) {
        *g = silu1(*g) * u;
    }
}

/// One element's `silu(x)`.
#[inline(always)]
fn silu1(x: f32) -> f32 {
    x / (1.0 + exp_any1(-x))
}

/// [`silu_mul`] on the first multiple of 8 elements; returns how many.
///
/// # Safety
/// The CPU has AVX2 and FMA; `up` is at least as long as `gate`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn silu_mul_avx2(gate: &mut [f32], up: &[f32]) -> usize {
    use std::arch::x86_64::*;
    let n8 = gate.len() & !7;
    // SAFETY: the CPU has AVX2 and FMA (this function's contract); each
    // load and store covers elements `i..i + 8` of `gate` and `up`, below
    // `n8 <= gate.len() <= up.len()`.
    unsafe {
        let (one, sign) = (_mm256_set1_ps(1.0), _mm256_set1_ps(-0.0));
        for i in (0..n8).step_by(8) {
            let x = _mm256_loadu_ps(gate.as_ptr().add(i));
            let e = exp_any8(_mm256_xor_ps(x, sign));
            let s = _mm256_div_ps(x, _mm256_add_ps(one, e));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            _mm256_storeu_ps(gate.as_mut_ptr().add(i), _mm256_mul_ps(s, u));
        }
    }
    n8
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::tests::rand_vec;

    /// RMSNorm's sum of squares takes one order on every CPU: the AVX2 lanes
    /// give the portable accumulators' bits, rows of any length (runs of 8
    /// and a tail), values of any scale; the result is within f32 rounding of
    /// the f64 definition.
    #[test]
    fn rmsnorm_takes_one_order_on_every_cpu() {
        for n in [1, 7, 8, 9, 64, 576, 1003] {
            let x: Vec<f32> = rand_vec(40 + n as u64, n)
                .iter()
                .enumerate()
                .map(|(i, v)| v * (1.0 + (i % 5) as f32 * 300.0))
                .collect();
            let w = rand_vec(41, n);
            let mut got = vec![0f32; n];
            rmsnorm(&x, &w, 1e-6, &mut got);
            // The order spelled out: accumulators by index mod 8, fixed pairs, tail.
            let n8 = n & !7;
            let mut acc = [0f64; 8];
            for (i, &v) in x[..n8].iter().enumerate() {
                acc[i % 8] += v as f64 * v as f64;
            }
            let mut ss =
                ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
            for &v in &x[n8..] {
                ss += v as f64 * v as f64;
            }
            let inv = 1.0 / (((ss / n as f64) as f32) + 1e-6).sqrt();
            let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64;
            for i in 0..n {
                assert_eq!(
                    got[i].to_bits(),
                    (w[i] * (x[i] * inv)).to_bits(),
                    "n {n} element {i}"
                );
                let want = w[i] as f64 * x[i] as f64 / (ms + 1e-6).sqrt();
                assert!(
                    (got[i] as f64 - want).abs() <= 1e-6 * (1.0 + want.abs()),
                    "n {n} element {i}"
                );
            }
            let mut inplace = x.clone();
            rmsnorm_inplace(&mut inplace, &w, 1e-6);
            assert_eq!(inplace, got, "n {n}: in place");
        }
    }

    /// SiLU's lanes (eight at a time on AVX2) and its tail give each element
    /// the bits it gets alone, within a few ulp of the f64 definition, over
    /// the whole range (`e^-x` infinite past -88: SiLU -0 there).
    #[test]
    fn silu_gives_each_element_its_own_bits_near_the_definition() {
        let x: Vec<f32> = (0..2003)
            .map(|i| (i as f32 - 1001.0) * 0.097)
            .chain([-88.5, -1e4, 1e4, 0.0, -0.0, 1e-30])
            .collect();
        let up: Vec<f32> = (0..x.len()).map(|i| 0.5 + (i % 7) as f32 * 0.25).collect();
        let mut all = x.clone();
        silu_mul(&mut all, &up);
        for (i, (&xi, &ui)) in x.iter().zip(&up).enumerate() {
            let mut one = [xi];
            silu_mul(&mut one, &[ui]);
            assert_eq!(all[i].to_bits(), one[0].to_bits(), "element {i} ({xi})");
            let want = xi as f64 / (1.0 + (-xi as f64).exp()) * ui as f64;
            assert!(
                (all[i] as f64 - want).abs() <= 8.0 * f32::EPSILON as f64 * want.abs() + 1e-30,
                "silu({xi}) * {ui} = {}, want {want}",
                all[i]
            );
        }
    }
}
