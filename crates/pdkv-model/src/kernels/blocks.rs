//! Block-format matrices (GGUF blocks, F16, BF16) times f32 activations,
//! bit-identical to [`crate::kernels::matmul_many`] on the dequantised
//! weights: the f32 tiles run over rows dequantised a panel at a time, or,
//! for a few rows (decode), each block is dequantised in registers and
//! multiplied at once.

use super::matmul::{run_job, Job, NR, W_L1_BYTES};
use crate::dispatch::{
    backend, check_shapes, for_each_job_of, Backend, Features, SendConstPtr, SendPtr,
};
use crate::qtype::{QType, QK};

/// One weight matrix in a GGUF block format applied to f32 activations.
pub struct BlockLinear<'a> {
    pub ty: QType,
    /// `n` rows of `ty.row_bytes(k)` bytes.
    pub w: &'a [u8],
    pub n: usize,
    pub y: &'a mut [f32],
}

/// `y = x · wᵀ` for block-format matrices, bit-identical to [`matmul_many`]
/// on the dequantised weights: each job dequantises its weight rows a panel
/// at a time (one that fits in L1) into a per-thread scratch and runs the
/// same tiles over it. The weights are read in their blocks (a fraction of
/// the f32 bytes); the activations and the arithmetic are the f32 path's.
pub fn matmul_blocks_many(x: &[f32], m: usize, k: usize, outs: &mut [BlockLinear<'_>]) {
    matmul_blocks_many_with(backend(), x, m, k, outs)
}

/// [`matmul_blocks_many`] with an explicit backend.
pub fn matmul_blocks_many_with(
    be: Backend,
    x: &[f32],
    m: usize,
    k: usize,
    outs: &mut [BlockLinear<'_>],
) {
    assert!(
        k.is_multiple_of(QK),
        "rows of {k} values are not whole 32-value blocks"
    );
    let shapes = outs
        .iter()
        .map(|o| (o.w.len(), o.n * o.ty.row_bytes(k), o.y.len(), o.n));
    check_shapes((x.len(), m, k), "bytes", shapes);
    if m == 0 {
        return;
    }
    let xp = SendConstPtr(x.as_ptr());
    let view = |o: &mut BlockLinear<'_>| {
        let p = (
            o.ty,
            SendConstPtr(o.w.as_ptr()),
            o.w.len(),
            SendPtr(o.y.as_mut_ptr()),
            o.n,
        );
        let work = m * o.ty.row_bytes(k);
        (p, Features { n: o.n, work })
    };
    for_each_job_of(outs, NR, view, |(ty, w, wlen, y, n), j0, j1| {
        let rb = ty.row_bytes(k);
        // SAFETY: `w` points at the matrix's `wlen` bytes (checked above).
        let wb = unsafe { std::slice::from_raw_parts(w.get(), wlen) };
        // A few rows (decode): each weight block is dequantised in
        // registers and multiplied at once, the tiles' very arithmetic.
        #[cfg(target_arch = "x86_64")]
        if be == Backend::Avx2Fma && m <= FUSED_ROWS && avx2::has_block_kernels(ty) {
            // SAFETY: AVX2 is present (the backend); rows `j0..j1` of `w`,
            // `m` rows of `x` and columns `j0..j1` of `y` are in bounds.
            unsafe { avx2::block_rows(ty, &wb[j0 * rb..j1 * rb], xp.get(), m, k, y.0.add(j0), n) };
            return;
        }
        let panel = (W_L1_BYTES / (4 * k) / NR * NR).max(NR);
        BLOCK_SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            if scratch.len() < panel * k {
                scratch.resize(panel * k, 0.0);
            }
            // A packed matrix's rows are unpacked one at a time first.
            let mut unpacked = vec![0u8; if ty.packed() { rb } else { 0 }];
            let mut p0 = j0;
            while p0 < j1 {
                let p1 = (p0 + panel).min(j1);
                for r in p0..p1 {
                    let dst = &mut scratch[(r - p0) * k..(r - p0 + 1) * k];
                    if ty.packed() {
                        crate::packed::row_into(ty, wb, k, r, &mut unpacked);
                        dequantize_row(be, ty.gguf(), &unpacked, dst);
                    } else {
                        dequantize_row(be, ty, &wb[r * rb..(r + 1) * rb], dst);
                    }
                }
                // The scratch holds rows p0..p1 as f32; the job owns columns
                // p0..p1 of `y`, which start `p0` floats in.
                let job = Job {
                    w: scratch.as_ptr(),
                    // SAFETY: column `p0 < n` of `y`'s first row is inside `y`.
                    y: SendPtr(unsafe { y.0.add(p0) }),
                    n,
                    j0: 0,
                    j1: p1 - p0,
                };
                // SAFETY: shapes were checked above (`x` is `m*k` floats, the
                // scratch `p1 - p0` rows of `k`, `y` `m*n` from column `p0`),
                // the job writes only its own columns, and `be` is one the
                // CPU has.
                unsafe { run_job(be, xp.get(), m, k, &job) };
                p0 = p1;
            }
        });
    });
}

/// Activation rows up to which block rows are multiplied straight from
/// their blocks rather than through a dequantised panel.
const FUSED_ROWS: usize = 4;

thread_local! {
    /// Dequantised weight rows of the panel a thread is working on.
    static BLOCK_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// One row of a block-format matrix as f32, exactly as
/// [`crate::gguf::dequantize`] computes it (`d*q`, `d*q + m`).
pub(super) fn dequantize_row(be: Backend, ty: QType, src: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if be == Backend::Avx2Fma && avx2::has_block_kernels(ty) {
        // SAFETY: the backend is AVX2 only where the CPU has it; lengths are
        // whole blocks (checked by the caller).
        return unsafe { avx2::dequantize_row(ty, src, out) };
    }
    let _ = be;
    crate::gguf::dequantize(crate::qtype::ggml_type(ty), src, out).expect("whole blocks");
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    use crate::kernels::matmul::avx2::hsum;
    use crate::qtype::QType;

    /// The formats [`dequantize_row`] and [`block_rows`] handle (the others
    /// go through [`crate::gguf::dequantize`] and the f32 tiles).
    pub(super) fn has_block_kernels(ty: QType) -> bool {
        matches!(ty, QType::Q8_0 | QType::Q4_1 | QType::F16 | QType::BF16)
    }

    /// The 8 values at `p` of a 16-bit float format, widened exactly.
    ///
    /// # Safety
    /// The CPU has AVX2 and F16C; `p` points at 16 readable bytes.
    #[inline(always)]
    unsafe fn half8(ty: QType, p: *const u8) -> __m256 {
        // SAFETY: the caller guarantees AVX2 and F16C and 16 readable bytes at `p`.
        unsafe {
            let h = _mm_loadu_si128(p as *const __m128i);
            if ty == QType::F16 {
                _mm256_cvtph_ps(h)
            } else {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
            }
        }
    }

    /// A block-format row as f32: `d*q` (Q8_0), `d*q + m` (Q4_1), with a
    /// separate multiply and add, as the scalar dequantiser rounds; 16-bit
    /// floats widened exactly.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `ty` has block kernels; `out` holds 32
    /// floats for each whole block of `src`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_row(ty: QType, src: &[u8], out: &mut [f32]) {
        // SAFETY: the caller guarantees the instructions; `src` is whole
        // blocks of `ty` and `out` 32 floats per block.
        unsafe {
            match ty {
                QType::Q8_0 => dequantize_row_of::<0>(src, out),
                QType::Q4_1 => dequantize_row_of::<1>(src, out),
                QType::F16 => dequantize_row_of::<2>(src, out),
                QType::BF16 => dequantize_row_of::<3>(src, out),
                other => unreachable!("{other:?} has no AVX2 dequantiser (has_block_kernels)"),
            }
        }
    }

    /// [`dequantize_row`] for the format `T` ([`format`]): each block's
    /// values as [`block_values`] forms them, stored.
    ///
    /// # Safety
    /// As [`dequantize_row`]'s.
    #[inline(always)]
    unsafe fn dequantize_row_of<const T: u8>(src: &[u8], out: &mut [f32]) {
        // SAFETY: the caller guarantees the instructions; each block `b` of
        // `src` is whole, and its 32 floats of `out` are writable.
        unsafe {
            let bb = format(T).block_bytes();
            for (b, o) in src.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
                for (i, g) in block_values::<T>(b.as_ptr()).into_iter().enumerate() {
                    _mm256_storeu_ps(o.as_mut_ptr().add(8 * i), g);
                }
            }
        }
    }

    /// `y[r*ldy + c] = dot(x[r], w[c])` for the `m` (at most 4) rows of
    /// `x` and the block-format rows `w[c]` of `k` values in `w`: each
    /// 8-value group is dequantised in registers exactly as
    /// `dequantize_row` does and enters the same 8-lane accumulation as the
    /// f32 tiles, then the same horizontal sum (`k` is whole blocks, so
    /// there is no tail). A single activation row takes four weight rows
    /// at a time, two rows two: each (weight row, activation row) is its
    /// own chain of dependent multiply-adds, and a lone chain waits on the
    /// latency of each. Each chain's operations are the same however many
    /// run side by side, so the bits are too. The rows a few tiles on are
    /// asked for while a tile is computed, as the integer kernels do
    /// ([`crate::prefetch::tiles_ahead`]): a tile's rows are streams too
    /// short for the hardware to foresee. On an AMD Zen 3 (2 threads, a
    /// BF16 export of SmolLM2, processes alternating, 3 runs each) batch-1
    /// decode went 64.8-76.1 -> 75.5-88.9 tok/s (0.70-0.79 -> 0.80-0.89 of
    /// copy bandwidth) and batch 2 126-133 -> 157-187 against one weight
    /// row at a time without the requests. A first four-row version, its
    /// accumulators spilled to the stack and no rows asked for ahead, was
    /// slower than one row at a time (52 against 77 tok/s): `perf` put
    /// half its samples on the first load of each block.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `ty` has block kernels; `w` is whole
    /// rows of `k` values (whole blocks); `x` holds `m <= 4` rows of `k`
    /// floats, and `y` has `m` rows of stride `ldy` whose first
    /// `w.len() / ty.row_bytes(k)` floats are writable.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block_rows(
        ty: QType,
        w: &[u8],
        x: *const f32,
        m: usize,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees the instructions and the shapes,
        // which `rows_of` takes as they are.
        unsafe {
            match ty {
                QType::Q8_0 => rows_of::<0>(w, x, m, k, y, ldy),
                QType::Q4_1 => rows_of::<1>(w, x, m, k, y, ldy),
                QType::F16 => rows_of::<2>(w, x, m, k, y, ldy),
                QType::BF16 => rows_of::<3>(w, x, m, k, y, ldy),
                other => unreachable!("{other:?} has no fused kernel (has_block_kernels)"),
            }
        }
    }

    /// The format of [`rows_of`]'s and [`block_rows_n`]'s `T`.
    const fn format(t: u8) -> QType {
        match t {
            0 => QType::Q8_0,
            1 => QType::Q4_1,
            2 => QType::F16,
            _ => QType::BF16,
        }
    }

    /// [`block_rows`] for the format `T` ([`format`]).
    ///
    /// # Safety
    /// As [`block_rows`]'s.
    #[inline(always)]
    unsafe fn rows_of<const T: u8>(
        w: &[u8],
        x: *const f32,
        m: usize,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees the instructions and the shapes;
        // each call below gets `C` whole rows of `w` from row `j` and the
        // columns of `y` they fill.
        unsafe {
            let rb = format(T).row_bytes(k);
            let rows = w.len() / rb;
            let mut j = 0;
            macro_rules! by {
                ($r:literal, $c:literal) => {
                    while rows - j >= $c {
                        block_rows_n::<T, $r, $c>(w.as_ptr().add(j * rb), x, k, y.add(j), ldy);
                        j += $c;
                    }
                };
            }
            match m {
                1 => {
                    by!(1, 4);
                    by!(1, 1);
                }
                2 => {
                    by!(2, 2);
                    by!(2, 1);
                }
                3 => by!(3, 1),
                4 => by!(4, 1),
                _ => unreachable!("at most 4 rows"),
            }
        }
    }

    /// The 32 values of the block at `b` of the format `T`, as
    /// `dequantize_row` computes them, in four registers.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `b` points at a whole block.
    #[inline(always)]
    unsafe fn block_values<const T: u8>(b: *const u8) -> [__m256; 4] {
        // SAFETY: the caller guarantees the instructions and a whole block
        // at `b`: every load below is inside it.
        unsafe {
            let ty = format(T);
            // The f16 at `p`, widened (exactly).
            let f16 = |p: *const u8| {
                let h = _mm_cvtsi32_si128(i32::from((p as *const u16).read_unaligned()));
                _mm256_broadcastss_ps(_mm_cvtph_ps(h))
            };
            let mut g = [_mm256_setzero_ps(); 4];
            match ty {
                QType::Q8_0 => {
                    let d = f16(b);
                    for (i, gv) in g.iter_mut().enumerate() {
                        let q8 = _mm_loadl_epi64(b.add(2 + 8 * i) as *const __m128i);
                        *gv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
                    }
                }
                QType::Q4_1 => {
                    let (d, mn) = (f16(b), f16(b.add(2)));
                    let bytes = _mm_loadu_si128(b.add(4) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(bytes, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask);
                    let parts = [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)];
                    for (gv, v) in g.iter_mut().zip(parts) {
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                        *gv = _mm256_add_ps(_mm256_mul_ps(d, q), mn);
                    }
                }
                _ => {
                    for (i, gv) in g.iter_mut().enumerate() {
                        *gv = half8(ty, b.add(16 * i));
                    }
                }
            }
            g
        }
    }

    /// # Safety
    /// As [`block_rows`]'s, with `m = R`, for the `C` rows of `k` values
    /// of the format `T` at `w`.
    #[inline(always)]
    unsafe fn block_rows_n<const T: u8, const R: usize, const C: usize>(
        w: *const u8,
        x: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        // SAFETY: the caller guarantees the instructions and the shapes: the
        // loads of `x` are inside its `R` rows of `k` floats, those of `w`
        // inside its `C` rows, and each output is column `c` of row `r` of
        // `y`.
        unsafe {
            let ty = format(T);
            let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
            let mut acc = [[_mm256_setzero_ps(); R]; C];
            for bi in 0..k / 32 {
                crate::prefetch::tiles_ahead(w, C * rb, bi * C * bb, C * bb);
                for (c, acc) in acc.iter_mut().enumerate() {
                    let g = block_values::<T>(w.add(c * rb + bi * bb));
                    for (i, gv) in g.iter().enumerate() {
                        let p = bi * 32 + 8 * i;
                        for (r, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(r * k + p)), *gv, *a);
                        }
                    }
                }
            }
            debug_assert_eq!(k % 8, 0);
            for (c, acc) in acc.iter().enumerate() {
                for (r, a) in acc.iter().enumerate() {
                    *y.add(r * ldy + c) = hsum(*a);
                }
            }
        }
    }
}
