//! The softmax's `exp`: one sequence of operations (Cephes-style,
//! `exp(x) = 2^n * p(r)` with `r = x - n ln 2`, `|r| <= ln2/2`) computed
//! for 8 lanes ([`exp8`], AVX2), 16 lanes ([`exp16`], AVX-512) or one
//! ([`exp1`], the tail), each lane's bits the same whichever computes it.
//! A leaf: the attention tiles build on it.

/// Below this `exp` is taken as 0.
pub(super) const EXP_LO: f32 = -87.336_55;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
const EXP_C: [f32; 6] = [
    1.987_569_1e-4,
    1.398_199_9e-3,
    8.333_452e-3,
    4.166_579_6e-2,
    1.666_666_5e-1,
    0.5,
];

/// The same operations as one lane of [`exp8`], for the tail (with FMA
/// where the caller's target has it, as `mul_add` is one rounding either way).
#[inline(always)]
pub(super) fn exp1(x: f32) -> f32 {
    if x < EXP_LO {
        return 0.0;
    }
    let n = (x * LOG2E).round_ties_even();
    let r = (-n).mul_add(LN2_HI, x);
    let r = (-n).mul_add(LN2_LO, r);
    let mut p = EXP_C[0];
    for &c in &EXP_C[1..] {
        p = p.mul_add(r, c);
    }
    let p = p.mul_add(r * r, r) + 1.0;
    p * f32::from_bits(((n as i32 + 127) as u32) << 23)
}

/// Above this [`exp_any1`] and [`exp_any8`] are infinite.
pub(super) const EXP_HI: f32 = 88.0;

/// `exp(x)` for any `x`: [`exp1`]'s operations up to [`EXP_HI`] (whose
/// `2^n` stays finite there), infinity above it.
#[inline(always)]
pub(super) fn exp_any1(x: f32) -> f32 {
    if x > EXP_HI {
        f32::INFINITY
    } else {
        exp1(x)
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{exp16, exp8, exp_any8};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{EXP_C, EXP_HI, EXP_LO, LN2_HI, LN2_LO, LOG2E};

    /// `exp(x)` for 8 lanes with `x <= 0`; inputs below `EXP_LO` give 0.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn exp8(x: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX2 and FMA; registers only.
        unsafe {
            let tiny = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_LO));
            let x = _mm256_max_ps(x, _mm256_set1_ps(EXP_LO));
            let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
            );
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
            let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
            let mut p = _mm256_set1_ps(EXP_C[0]);
            for &c in &EXP_C[1..] {
                p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
            }
            let p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
            let p = _mm256_add_ps(p, _mm256_set1_ps(1.0));
            let pow2 = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(
                _mm256_cvtps_epi32(n),
                _mm256_set1_epi32(127),
            )));
            _mm256_andnot_ps(tiny, _mm256_mul_ps(p, pow2))
        }
    }

    /// [`super::exp_any1`] for 8 lanes: [`exp8`] (whose operations hold
    /// for any `x` up to [`EXP_HI`]), infinity above it.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn exp_any8(x: __m256) -> __m256 {
        // SAFETY: the caller guarantees AVX2 and FMA; registers only.
        unsafe {
            let hi = _mm256_set1_ps(EXP_HI);
            let big = _mm256_cmp_ps::<_CMP_GT_OQ>(x, hi);
            let e = exp8(_mm256_min_ps(x, hi));
            _mm256_blendv_ps(e, _mm256_set1_ps(f32::INFINITY), big)
        }
    }

    /// [`exp8`]'s operations on 16 lanes.
    ///
    /// # Safety
    /// The CPU has AVX-512F.
    #[inline(always)]
    pub(in crate::kernels) unsafe fn exp16(x: __m512) -> __m512 {
        // SAFETY: the caller guarantees AVX-512F; registers only.
        unsafe {
            let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, _mm512_set1_ps(EXP_LO));
            let x = _mm512_max_ps(x, _mm512_set1_ps(EXP_LO));
            let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
                _mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
            );
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
            let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
            let mut p = _mm512_set1_ps(EXP_C[0]);
            for &c in &EXP_C[1..] {
                p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
            }
            let p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
            let p = _mm512_add_ps(p, _mm512_set1_ps(1.0));
            let pow2 = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(_mm512_add_epi32(
                _mm512_cvtps_epi32(n),
                _mm512_set1_epi32(127),
            )));
            _mm512_maskz_mul_ps(kept, p, pow2)
        }
    }

    #[cfg(test)]
    mod tests {
        use std::arch::x86_64::*;

        use crate::kernels::expf::{exp1, exp_any1, EXP_HI, EXP_LO};

        fn inputs() -> Vec<f32> {
            (0..4000)
                .map(|i| -(i as f32) * 0.0231)
                .chain([0.0, -0.0, -1e-30, -87.0, -87.336_55, -88.0, -1000.0])
                .chain([f32::NEG_INFINITY])
                .collect()
        }

        #[test]
        fn vector_exp_is_accurate_and_lane_consistent() {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            for x in inputs() {
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                let v = unsafe { lane8(x) };
                // SAFETY: as above.
                let s = unsafe { exp1_fma(x) };
                assert_eq!(v.to_bits(), s.to_bits(), "lane and tail differ at {x}");
                let want = (x as f64).exp();
                if x >= EXP_LO {
                    assert!(
                        ((v as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                        "exp({x}) = {v}, want {want}"
                    );
                } else {
                    assert_eq!(v, 0.0);
                }
            }
        }

        #[test]
        fn sixteen_lanes_have_eight_lanes_bits() {
            if !is_x86_feature_detected!("avx512f") {
                eprintln!("no AVX-512F here: exp16 is checked on CPUs that have it");
                return;
            }
            let xs = inputs();
            for chunk in xs.chunks(16) {
                let mut x = [0f32; 16];
                x[..chunk.len()].copy_from_slice(chunk);
                // SAFETY: the CPU has AVX-512F (checked above), so AVX2 and FMA.
                let got = unsafe { lanes16(&x) };
                for (i, (&xi, g)) in x.iter().zip(got).enumerate() {
                    // SAFETY: as above.
                    let want = unsafe { lane8(xi) };
                    assert_eq!(g.to_bits(), want.to_bits(), "lane {i} at {xi}");
                }
            }
        }

        #[target_feature(enable = "avx2,fma")]
        unsafe fn lane8(x: f32) -> f32 {
            let mut o = [0f32; 8];
            // SAFETY: AVX2 and FMA are enabled; `o` holds 8 floats.
            unsafe { _mm256_storeu_ps(o.as_mut_ptr(), super::exp8(_mm256_set1_ps(x))) };
            o[3]
        }

        #[target_feature(enable = "avx512f")]
        unsafe fn lanes16(x: &[f32; 16]) -> [f32; 16] {
            let mut o = [0f32; 16];
            // SAFETY: AVX-512F is enabled; both arrays hold 16 floats.
            unsafe { _mm512_storeu_ps(o.as_mut_ptr(), super::exp16(_mm512_loadu_ps(x.as_ptr()))) };
            o
        }

        #[target_feature(enable = "avx2,fma")]
        unsafe fn exp1_fma(x: f32) -> f32 {
            exp1(x)
        }

        #[test]
        fn the_any_sign_exp_is_accurate_lane_consistent_and_infinite_past_its_bound() {
            if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
                return;
            }
            let xs = (0..8000)
                .map(|i| (i as f32 - 4000.0) * 0.0229)
                .chain([87.9, EXP_HI, 88.000_01, 88.8, 1e6, f32::INFINITY])
                .chain(inputs());
            for x in xs {
                let mut o = [0f32; 8];
                // SAFETY: the CPU has AVX2 and FMA (checked above); `o`
                // holds 8 floats.
                unsafe { _mm256_storeu_ps(o.as_mut_ptr(), super::exp_any8(_mm256_set1_ps(x))) };
                let s = exp_any1(x);
                assert_eq!(o[5].to_bits(), s.to_bits(), "lane and tail differ at {x}");
                if x > EXP_HI {
                    assert_eq!(s, f32::INFINITY, "{x}");
                } else if x >= EXP_LO {
                    let want = (x as f64).exp();
                    assert!(
                        ((s as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                        "exp({x}) = {s}, want {want}"
                    );
                } else {
                    assert_eq!(s, 0.0, "{x}");
                }
            }
        }
    }
}
