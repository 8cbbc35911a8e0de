//! The element types of the KV cache as the kernels read them. A leaf:
//! the attention and matmul kernels build on it.

/// An element of the KV cache as the kernels read it: `f32`, `f16` or
/// `bf16` (half the bytes; widened to `f32` as it is loaded, so the
/// arithmetic is the same), or a byte of a q8_0 row ([`Q8Byte`]). The
/// kernels read a row through its first element and a column, so a row
/// may hold more than its elements (q8_0's scales).
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Queries in one attention sweep past which the rows are widened to
    /// f32 a tile at a time, once for all of them, rather than as each
    /// query loads them (`usize::MAX`: never, f32 rows are read in place).
    const WIDEN_PAST: usize;
    /// Bytes of a row of `hd` columns.
    fn row_bytes(hd: usize) -> usize {
        hd * std::mem::size_of::<Self>()
    }
    /// Column `c` of the row at `row`, as an `f32`.
    ///
    /// # Safety
    /// `row` starts a row of more than `c` columns.
    unsafe fn get(row: *const Self, c: usize) -> f32;
    /// Columns `c..c + 8` of the row at `row` as `f32` lanes, each lane
    /// [`KvElem::get`]'s value; `c` is a multiple of 8.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `row` starts a row of at least
    /// `c + 8` columns.
    #[cfg(target_arch = "x86_64")]
    unsafe fn get8(row: *const Self, c: usize) -> std::arch::x86_64::__m256;
}

impl KvElem for f32 {
    const WIDEN_PAST: usize = usize::MAX;

    #[inline(always)]
    unsafe fn get(row: *const f32, c: usize) -> f32 {
        // SAFETY: as this function's contract.
        unsafe { *row.add(c) }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(row: *const f32, c: usize) -> std::arch::x86_64::__m256 {
        // SAFETY: as this function's contract.
        unsafe { std::arch::x86_64::_mm256_loadu_ps(row.add(c)) }
    }
}

impl KvElem for half::f16 {
    const WIDEN_PAST: usize = 4;

    #[inline(always)]
    unsafe fn get(row: *const half::f16, c: usize) -> f32 {
        // SAFETY: as this function's contract.
        unsafe { (*row.add(c)).to_f32() }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(row: *const half::f16, c: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as this function's contract: 16 readable bytes, F16C.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(row.add(c).cast())) }
    }
}

impl KvElem for half::bf16 {
    const WIDEN_PAST: usize = 4;

    #[inline(always)]
    unsafe fn get(row: *const half::bf16, c: usize) -> f32 {
        // SAFETY: as this function's contract.
        unsafe { (*row.add(c)).to_f32() }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(row: *const half::bf16, c: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as this function's contract: 16 readable bytes, AVX2.
        // A bf16 is the upper half of the f32 it stands for.
        unsafe {
            let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(row.add(c).cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
        }
    }
}

/// Columns per q8_0 block.
pub const Q8_BLOCK: usize = 32;

/// Bytes of a q8_0 block: its scale (f16) then its 32 values (int8).
pub const Q8_BLOCK_BYTES: usize = 2 + Q8_BLOCK;

/// A byte of a q8_0 row: `head_dim / 32` blocks of [`Q8_BLOCK_BYTES`],
/// column `c` worth `scale(c / 32) * value(c)`, the scale widened from
/// f16 and the product rounded to f32 (a quarter of f32's bytes and a bit
/// over half of f16's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[repr(transparent)]
pub struct Q8Byte(pub u8);

impl Q8Byte {
    /// The block holding column `c` of the row at `row`: its scale, and a
    /// pointer at column `c`'s value.
    ///
    /// # Safety
    /// `row` starts a q8_0 row of more than `c` columns.
    #[inline(always)]
    unsafe fn block(row: *const Q8Byte, c: usize) -> (f32, *const i8) {
        // SAFETY: as this function's contract: the block lies in the row.
        unsafe {
            let b = row.cast::<u8>().add(c / Q8_BLOCK * Q8_BLOCK_BYTES);
            let d = half::f16::from_bits(b.cast::<u16>().read_unaligned().to_le()).to_f32();
            (d, b.add(2 + c % Q8_BLOCK).cast::<i8>())
        }
    }

    /// Writes `src` (a multiple of 32 values) as q8_0 blocks at `dst`: per
    /// block, the scale `max |x| / 127` (as f16) and each value
    /// `round(x / scale)`.
    ///
    /// # Safety
    /// `dst` holds `src.len() / 32 * 34` writable bytes.
    pub(crate) unsafe fn quantize_row(src: &[f32], dst: *mut u8) {
        debug_assert!(src.len().is_multiple_of(Q8_BLOCK));
        for (i, block) in src.chunks_exact(Q8_BLOCK).enumerate() {
            let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
            let d = amax / 127.0;
            let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
            // SAFETY: as this function's contract: block `i` lies in `dst`.
            unsafe {
                let b = dst.add(i * Q8_BLOCK_BYTES);
                b.cast::<u16>()
                    .write_unaligned(half::f16::from_f32(d).to_bits().to_le());
                for (j, x) in block.iter().enumerate() {
                    *b.add(2 + j) = ((x * inv).round().clamp(-127.0, 127.0) as i8) as u8;
                }
            }
        }
    }
}

impl KvElem for Q8Byte {
    const WIDEN_PAST: usize = 4;

    fn row_bytes(hd: usize) -> usize {
        hd / Q8_BLOCK * Q8_BLOCK_BYTES
    }

    #[inline(always)]
    unsafe fn get(row: *const Q8Byte, c: usize) -> f32 {
        // SAFETY: as this function's contract.
        unsafe {
            let (d, q) = Q8Byte::block(row, c);
            d * *q as f32
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn get8(row: *const Q8Byte, c: usize) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        // SAFETY: as this function's contract: `c` is a multiple of 8, so
        // the 8 values lie in one block; AVX2.
        unsafe {
            let b = row.cast::<u8>().add(c / Q8_BLOCK * Q8_BLOCK_BYTES);
            let bits = b.cast::<u16>().read_unaligned().to_le();
            // The scale widened by F16C: exact, as `get`'s widening is.
            let d = _mm256_cvtph_ps(_mm_set1_epi16(bits as i16));
            let q = b.add(2 + c % Q8_BLOCK);
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(q.cast())));
            _mm256_mul_ps(d, v)
        }
    }
}
