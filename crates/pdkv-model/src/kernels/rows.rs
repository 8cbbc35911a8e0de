//! Kernels that act on one row at a time, with sequential sums: RMSNorm,
//! RoPE and SwiGLU's SiLU.

use super::expf::exp_any1;
#[cfg(target_arch = "x86_64")]
use super::expf::exp_any8;

/// RMSNorm of one row as Hugging Face computes it in f32:
/// `w * (x * 1/sqrt(mean(x²) + eps))`. The mean is accumulated in f64 in
/// index order, then rounded to f32.
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
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let var = (ss / x.len() as f64) as f32;
    1.0 / (var + eps).sqrt()
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
