//! The element types of the KV cache as the kernels read them. A leaf:
//! the attention and matmul kernels build on it.

/// An element of the KV cache as the kernels read it: `f32`, or `f16` or
/// `bf16` (half the bytes; widened to `f32` as it is loaded, so the
/// arithmetic is the same).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Whether the element is `f32` itself (read in place, not widened).
    const IS_F32: bool;
    /// The cache's element as an `f32`.
    fn widen(self) -> f32;
    /// 8 elements at `p` as `f32` lanes.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `p` holds 8 readable elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    const IS_F32: bool = true;

    #[inline(always)]
    fn widen(self) -> f32 {
        self
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        // SAFETY: as this function's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(p) }
    }
}

impl KvElem for half::f16 {
    const IS_F32: bool = false;

    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as this function's contract: 16 readable bytes, F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p.cast())) }
    }
}

impl KvElem for half::bf16 {
    const IS_F32: bool = false;

    #[inline(always)]
    fn widen(self) -> f32 {
        self.to_f32()
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const half::bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as this function's contract: 16 readable bytes, AVX2.
        // A bf16 is the upper half of the f32 it stands for.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}
