//! Batch-invariant CPU kernels: matrix multiply, RMSNorm, RoPE, SwiGLU and
//! paged causal attention.
//!
//! Invariant: every output element is produced by one fixed sequence of
//! floating-point operations that depends only on that element's own inputs.
//! It does not depend on how many rows are in the batch, where a row sits in
//! it, which register tile computed it, how work was split across threads, or
//! how a sequence's prefill was chunked. Concretely:
//!
//! - [`matmul`]: `y[r][j] = dot(x[r], w[j])` with one 8-lane accumulator per
//!   output element, stepping over `k` in strides of 8 from 0, then a fixed
//!   horizontal sum (`lane i + lane i+4`, then `+2`, then `+1`), then the
//!   scalar tail in index order. Every tile shape runs exactly this sequence
//!   for each of its elements; threads split the output features `j`, never `k`.
//! - [`attend`]: per (query, head) one pass over positions `0..=p` in order:
//!   scores, their maximum, the exponentials and their sum, then the
//!   probability-weighted sum of V rows in position order.
//! - norms, RoPE and SiLU act on one row at a time with sequential sums.
//!
//! The SIMD flavour ([`Backend`]) is chosen once per process, so all rows of
//! all steps go through the same code.

use std::sync::OnceLock;

use rayon::prelude::*;

/// Which instruction set the kernels use. Fixed for the life of the process.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// x86-64 AVX2 with fused multiply-add (and F16C, which every such CPU
    /// has, for half-float weights).
    Avx2Fma,
    /// Plain Rust (separate multiply and add), for any CPU.
    Portable,
}

/// The backend all model math uses: AVX2+FMA when the CPU has it.
pub fn backend() -> Backend {
    static BACKEND: OnceLock<Backend> = OnceLock::new();
    *BACKEND.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
            {
                return Backend::Avx2Fma;
            }
        }
        Backend::Portable
    })
}

/// The thread pool the forward pass runs on. Its size never changes results
/// (see the module invariant); `PDKV_THREADS` overrides the default of one
/// thread per available core.
pub fn thread_pool() -> &'static rayon::ThreadPool {
    static POOL: OnceLock<rayon::ThreadPool> = OnceLock::new();
    POOL.get_or_init(|| {
        let n = std::env::var("PDKV_THREADS")
            .ok()
            .and_then(|s| s.parse::<usize>().ok())
            .filter(|&n| n > 0)
            .unwrap_or_else(|| {
                std::thread::available_parallelism()
                    .map(|n| n.get())
                    .unwrap_or(2)
            });
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .thread_name(|i| format!("pdkv-math-{i}"))
            .build()
            .expect("building the math thread pool")
    })
}

// ---------------------------------------------------------------------------
// Matrix multiply
// ---------------------------------------------------------------------------

/// Activation rows per register tile.
const MR: usize = 4;
/// Weight rows per register tile.
const NR: usize = 3;
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
    assert!(
        x.len() >= m * k,
        "x has {} floats, need {}x{}",
        x.len(),
        m,
        k
    );
    for o in outs.iter() {
        assert!(
            o.w.len() >= o.n * k,
            "w has {} floats, need {}x{}",
            o.w.len(),
            o.n,
            k
        );
        assert!(
            o.y.len() >= m * o.n,
            "y has {} floats, need {}x{}",
            o.y.len(),
            m,
            o.n
        );
    }
    if m == 0 || k == 0 {
        for o in outs.iter_mut() {
            o.y[..m * o.n].fill(0.0);
        }
        return;
    }
    let x = SendConstPtr(x.as_ptr());
    let view = |o: &mut Linear<'_>| {
        let p = (SendConstPtr(o.w.as_ptr()), SendPtr(o.y.as_mut_ptr()), o.n);
        (p, o.n)
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

/// Splits the output features of up to [`MAX_MANY`] matrices (of `ns`
/// features each) into jobs of whole `tile`-row register tiles, and runs
/// `run(matrix, j0, j1)` for each on the current rayon pool. A job owns a
/// column range of its matrix's `y` and the matching rows of its `w`. Job
/// descriptors live on the stack: a step allocates nothing here.
pub(crate) fn for_each_job(
    ns: impl Iterator<Item = usize>,
    tile: usize,
    run: impl Fn(usize, usize, usize) + Sync,
) {
    let threads = rayon::current_num_threads().max(1);
    // Per matrix: features, features per job, index of its first job.
    let mut mats = [(0usize, 0usize, 0usize); MAX_MANY];
    let (mut count, mut total) = (0, 0);
    for (slot, n) in mats.iter_mut().zip(ns) {
        let per = n.div_ceil(threads * JOBS_PER_THREAD).div_ceil(tile).max(1) * tile;
        *slot = (n, per, total);
        total += n.div_ceil(per);
        count += 1;
    }
    let mats = &mats[..count];
    let job = |i: usize| {
        let (mi, &(n, per, first)) = mats
            .iter()
            .enumerate()
            .rev()
            .find(|(_, mat)| mat.2 <= i)
            .expect("job index in range");
        let j0 = (i - first) * per;
        run(mi, j0, (j0 + per).min(n));
    };
    if total == 1 || threads == 1 {
        (0..total).for_each(job);
    } else {
        (0..total).into_par_iter().for_each(job);
    }
}

/// [`for_each_job`] over any number of matrices, [`MAX_MANY`] to a
/// dispatch: `view` gives each output what its jobs need (`P`: pointers, a
/// format, ...) and its feature count; `run(p, j0, j1)` runs one job.
pub(crate) fn for_each_job_of<T, P: Copy + Sync>(
    outs: &mut [T],
    tile: usize,
    view: impl Fn(&mut T) -> (P, usize),
    run: impl Fn(P, usize, usize) + Sync,
) {
    for group in outs.chunks_mut(MAX_MANY) {
        let mut mats: [Option<(P, usize)>; MAX_MANY] = [None; MAX_MANY];
        for (slot, o) in mats.iter_mut().zip(group.iter_mut()) {
            *slot = Some(view(o));
        }
        let mats = &mats[..group.len()];
        let mat = |i: usize| mats[i].expect("a slot per output");
        for_each_job((0..mats.len()).map(|i| mat(i).1), tile, |i, j0, j1| {
            run(mat(i).0, j0, j1)
        });
    }
}

/// One weight matrix in a GGUF block format applied to f32 activations.
pub struct BlockLinear<'a> {
    pub ty: crate::qkernels::QType,
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
        x.len() >= m * k,
        "x has {} floats, need {}x{}",
        x.len(),
        m,
        k
    );
    assert!(
        k.is_multiple_of(crate::qkernels::QK),
        "rows of {k} values are not whole 32-value blocks"
    );
    for o in outs.iter() {
        assert!(
            o.w.len() >= o.n * o.ty.row_bytes(k),
            "w has {} bytes, need {} rows",
            o.w.len(),
            o.n
        );
        assert!(
            o.y.len() >= m * o.n,
            "y has {} floats, need {}x{}",
            o.y.len(),
            m,
            o.n
        );
    }
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
        (p, o.n)
    };
    for_each_job_of(outs, NR, view, |(ty, w, wlen, y, n), j0, j1| {
        let rb = ty.row_bytes(k);
        // SAFETY: `w` points at the matrix's `wlen` bytes (checked above).
        let wb = unsafe { std::slice::from_raw_parts(w.get(), wlen) };
        // A few rows (decode): each weight block is dequantised in
        // registers and multiplied at once, the tiles' very arithmetic.
        #[cfg(target_arch = "x86_64")]
        if be == Backend::Avx2Fma && m <= FUSED_ROWS && avx2::has_block_kernels(ty) {
            for j in j0..j1 {
                // SAFETY: AVX2 is present (the backend); row `j` of `w`,
                // `m` rows of `x` and column `j` of `y` are in bounds.
                unsafe {
                    avx2::block_rows(ty, &wb[j * rb..(j + 1) * rb], xp.get(), m, k, y.0.add(j), n)
                };
            }
            return;
        }
        let panel = (W_L1_BYTES / (4 * k) / NR * NR).max(NR);
        BLOCK_SCRATCH.with(|cell| {
            let mut scratch = cell.borrow_mut();
            if scratch.len() < panel * k {
                scratch.resize(panel * k, 0.0);
            }
            let mut p0 = j0;
            while p0 < j1 {
                let p1 = (p0 + panel).min(j1);
                for r in p0..p1 {
                    dequantize_row(
                        be,
                        ty,
                        &wb[r * rb..(r + 1) * rb],
                        &mut scratch[(r - p0) * k..(r - p0 + 1) * k],
                    );
                }
                // SAFETY: the scratch holds rows p0..p1 as f32; the job owns
                // columns p0..p1 of `y`, which start `p0` floats in.
                let job = Job {
                    w: scratch.as_ptr(),
                    y: SendPtr(unsafe { y.0.add(p0) }),
                    n,
                    j0: 0,
                    j1: p1 - p0,
                };
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
fn dequantize_row(be: Backend, ty: crate::qkernels::QType, src: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if be == Backend::Avx2Fma && avx2::has_block_kernels(ty) {
        // SAFETY: the backend is AVX2 only where the CPU has it; lengths are
        // whole blocks (checked by the caller).
        return unsafe { avx2::dequantize_row(ty, src, out) };
    }
    let _ = be;
    crate::gguf::dequantize(crate::weights::ggml_type(ty), src, out).expect("whole blocks");
}

/// Jobs per thread and matrix of [`for_each_job`]: a few, so that a thread
/// slowed down is made up for (measured at decode batch 1: 4 and 2 alike,
/// 1 slower).
const JOBS_PER_THREAD: usize = 4;

/// Matrices per [`matmul_many_with`] dispatch (and per [`for_each_job`]).
pub(crate) const MAX_MANY: usize = 4;

/// A pointer for disjoint writes from several threads, coordinated by the
/// matmul dispatchers (here and in [`crate::qkernels`]).
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: used only for disjoint writes coordinated by a dispatcher.
unsafe impl<T> Send for SendPtr<T> {}
unsafe impl<T> Sync for SendPtr<T> {}

/// A pointer to data that several threads only read.
pub(crate) struct SendConstPtr<T>(pub(crate) *const T);
impl<T> Clone for SendConstPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendConstPtr<T> {}
// SAFETY: read-only shared data.
unsafe impl<T> Send for SendConstPtr<T> {}
unsafe impl<T> Sync for SendConstPtr<T> {}

impl<T> SendConstPtr<T> {
    /// A method (not a field access) so closures capture the whole wrapper.
    pub(crate) fn get(self) -> *const T {
        self.0
    }
}

struct Job {
    w: *const f32,
    y: SendPtr<f32>,
    n: usize,
    j0: usize,
    j1: usize,
}
// SAFETY: see `SendPtr`; `w` is only read.
unsafe impl Send for Job {}
unsafe impl Sync for Job {}

/// Computes columns `j0..j1` of `y` for all `m` rows.
///
/// # Safety
/// `x` holds `m*k` floats, `job.w` `n*k`, `job.y` `m*n`; no one else writes
/// columns `j0..j1` of `y`.
unsafe fn run_job(be: Backend, x: *const f32, m: usize, k: usize, job: &Job) {
    match be {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2Fma => avx2::run_job(x, m, k, job),
        _ => portable::run_job(x, m, k, job),
    }
}

/// Bytes of weight rows kept in L1 while a tile of activation rows sweeps them.
const W_L1_BYTES: usize = 24 << 10;

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
        let (w, y, n) = (job.w, job.y.0, job.n);
        for_each_tile(m, k, job, |mr, nr, r, j| {
            // SAFETY: the tile lies inside the job's rows and columns.
            unsafe {
                let xt = x.add(r * k);
                let wt = w.add(j * k);
                let yt = y.add(r * n + j);
                dispatch_tile!(tile, mr, nr, xt, wt, k, yt, n)
            }
        });
    }

    /// The formats [`dequantize_row`] and [`block_rows`] handle (the others
    /// go through [`crate::gguf::dequantize`] and the f32 tiles).
    pub(super) fn has_block_kernels(ty: crate::qkernels::QType) -> bool {
        use crate::qkernels::QType;
        matches!(ty, QType::Q8_0 | QType::Q4_1 | QType::F16 | QType::BF16)
    }

    /// The 8 values at `p` of a 16-bit float format, widened exactly.
    #[inline(always)]
    unsafe fn half8(ty: crate::qkernels::QType, p: *const u8) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        if ty == crate::qkernels::QType::F16 {
            _mm256_cvtph_ps(h)
        } else {
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
        }
    }

    /// A block-format row as f32: `d*q` (Q8_0), `d*q + m` (Q4_1), with a
    /// separate multiply and add, as the scalar dequantiser rounds; 16-bit
    /// floats widened exactly.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dequantize_row(ty: crate::qkernels::QType, src: &[u8], out: &mut [f32]) {
        use crate::qkernels::QType;
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let bb = ty.block_bytes();
        for (b, o) in src.chunks_exact(bb).zip(out.chunks_exact_mut(32)) {
            let d = _mm256_set1_ps(f16(&b[0..2]));
            let o = o.as_mut_ptr();
            match ty {
                QType::Q8_0 => {
                    for g in 0..4 {
                        let q8 = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * g) as *const __m128i);
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8));
                        _mm256_storeu_ps(o.add(8 * g), _mm256_mul_ps(d, q));
                    }
                }
                QType::Q4_1 => {
                    let m = _mm256_set1_ps(f16(&b[2..4]));
                    let bytes = _mm_loadu_si128(b.as_ptr().add(4) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(bytes, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask);
                    for (g, v) in [lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)]
                        .into_iter()
                        .enumerate()
                    {
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                        _mm256_storeu_ps(o.add(8 * g), _mm256_add_ps(_mm256_mul_ps(d, q), m));
                    }
                }
                QType::F16 | QType::BF16 => {
                    for g in 0..4 {
                        _mm256_storeu_ps(o.add(8 * g), half8(ty, b.as_ptr().add(16 * g)));
                    }
                }
                other => unreachable!("{other:?} has no AVX2 dequantiser (has_block_kernels)"),
            }
        }
    }

    /// `y[r*ldy] = dot(x[r], w)` for the `m` (at most 4) rows of `x`, with
    /// `w` one block-format row of `k` values: each 8-value group is
    /// dequantised in registers exactly as `dequantize_row` does and enters
    /// the same 8-lane accumulation as the f32 tiles, then the same
    /// horizontal sum (`k` is whole blocks, so there is no tail).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn block_rows(
        ty: crate::qkernels::QType,
        w: &[u8],
        x: *const f32,
        m: usize,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        match m {
            1 => block_rows_n::<1>(ty, w, x, k, y, ldy),
            2 => block_rows_n::<2>(ty, w, x, k, y, ldy),
            3 => block_rows_n::<3>(ty, w, x, k, y, ldy),
            4 => block_rows_n::<4>(ty, w, x, k, y, ldy),
            _ => unreachable!("at most 4 rows"),
        }
    }

    #[inline(always)]
    unsafe fn block_rows_n<const R: usize>(
        ty: crate::qkernels::QType,
        w: &[u8],
        x: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
        use crate::qkernels::QType;
        let f16 = |b: &[u8]| half::f16::from_le_bytes([b[0], b[1]]).to_f32();
        let mut acc = [_mm256_setzero_ps(); R];
        for (bi, b) in w.chunks_exact(ty.block_bytes()).enumerate() {
            let d = _mm256_set1_ps(f16(&b[0..2]));
            let mut g = [_mm256_setzero_ps(); 4];
            match ty {
                QType::Q8_0 => {
                    for (i, gv) in g.iter_mut().enumerate() {
                        let q8 = _mm_loadl_epi64(b.as_ptr().add(2 + 8 * i) as *const __m128i);
                        *gv = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
                    }
                }
                QType::Q4_1 => {
                    let mn = _mm256_set1_ps(f16(&b[2..4]));
                    let bytes = _mm_loadu_si128(b.as_ptr().add(4) as *const __m128i);
                    let mask = _mm_set1_epi8(0x0f);
                    let lo = _mm_and_si128(bytes, mask);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(bytes), mask);
                    for (gv, v) in
                        g.iter_mut()
                            .zip([lo, _mm_srli_si128::<8>(lo), hi, _mm_srli_si128::<8>(hi)])
                    {
                        let q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v));
                        *gv = _mm256_add_ps(_mm256_mul_ps(d, q), mn);
                    }
                }
                QType::F16 | QType::BF16 => {
                    for (i, gv) in g.iter_mut().enumerate() {
                        *gv = half8(ty, b.as_ptr().add(16 * i));
                    }
                }
                other => unreachable!("{other:?} has no fused kernel (has_block_kernels)"),
            }
            for (i, gv) in g.iter().enumerate() {
                let p = bi * 32 + 8 * i;
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.add(r * k + p)), *gv, *a);
                }
            }
        }
        debug_assert_eq!(k % 8, 0);
        for (r, a) in acc.iter().enumerate() {
            *y.add(r * ldy) = hsum(*a);
        }
    }

    /// Fixed-order horizontal sum of 8 lanes: (i + i+4), then (+2), then (+1).
    #[inline(always)]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps::<1>(v);
        let s4 = _mm_add_ps(lo, hi);
        let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
        let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
        _mm_cvtss_f32(s1)
    }

    /// Lane `i` of the result is `hsum(v[i])`, with the very same additions:
    /// `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
    #[inline(always)]
    pub(super) unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
        // [x.lo + x.hi | y.lo + y.hi]: hsum's first step for two vectors.
        let halves = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_permute2f128_ps::<0x20>(x, y),
                _mm256_permute2f128_ps::<0x31>(x, y),
            )
        };
        // Per 128-bit lane [b0+b2, b1+b3] of x, then of y: the second step.
        let pairs = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        // The last step leaves lanes in the order (0, 2, 1, 3) per half, so
        // the inputs go in as 0, 2, 1, 3, 4, 6, 5, 7.
        let (w0, w1) = (halves(v[0], v[4]), halves(v[2], v[6]));
        let (w2, w3) = (halves(v[1], v[5]), halves(v[3], v[7]));
        let (u, z) = (pairs(w0, w2), pairs(w1, w3));
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(u, z),
            _mm256_shuffle_ps::<0b11_01_11_01>(u, z),
        )
    }

    /// `MR x NR` register tile: `MR` rows of `x` (stride `k`) against `NR`
    /// rows of `w` (stride `k`), into `y` (row stride `ldy`).
    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
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

    /// `dot(a, b)` with the same scheme as a matmul element.
    #[inline(always)]
    pub(super) unsafe fn dot(a: *const f32, b: *const f32, k: usize) -> f32 {
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

    // Cephes-style expf: exp(x) = 2^n * p(r), r = x - n ln 2, |r| <= ln2/2.
    const EXP_LO: f32 = -87.336_55;
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

    /// `exp(x)` for 8 lanes with `x <= 0`; inputs below `EXP_LO` give 0.
    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
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

    /// The same operations as one lane of [`exp8`], for the tail.
    #[inline(always)]
    fn exp1(x: f32) -> f32 {
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

    /// [`super::attend_many`] with AVX2 tiles.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn attend_many(
        rows: &super::PagedRows<'_>,
        hd: usize,
        scale: f32,
        qs: &mut [super::AttnQuery],
    ) {
        super::attend_many_generic(rows, hd, scale, qs, |q, kp, v_offset, hd, scale, seen| {
            // SAFETY: as `attend_many`'s contract; AVX2 and FMA are enabled here.
            unsafe { attend_tile(q, kp, v_offset, hd, scale, seen) }
        })
    }

    /// One tile for one query. Scores: 8 keys side by side over the head's
    /// columns, reduced in `hsum`'s order (then the columns past a multiple
    /// of 8 one by one), times the scale; keys the query does not see become
    /// `-inf`. `p = exp(s - m)` 8 at a time, the tile's sum in `hsum`'s
    /// order. The output keeps 64 columns in registers while it takes the
    /// tile's positions in order: each element is `fma(p_t, v_t, acc)`.
    #[inline(always)]
    unsafe fn attend_tile(
        q: &mut super::AttnQuery,
        kp: &[*const f32; super::KEY_TILE],
        v_offset: usize,
        hd: usize,
        scale: f32,
        seen: usize,
    ) {
        let hd8 = hd & !7;
        let qp = q.q;
        let mut s = [0f32; super::KEY_TILE];
        for h in 0..super::KEY_TILE / 8 {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut p = 0;
            while p < hd8 {
                let qv = _mm256_loadu_ps(qp.add(p));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kp[8 * h + i].add(p)), *a);
                }
                p += 8;
            }
            _mm256_storeu_ps(s.as_mut_ptr().add(8 * h), hsum8(&acc));
        }
        if hd8 < hd {
            for (j, sj) in s.iter_mut().enumerate() {
                for c in hd8..hd {
                    *sj += *qp.add(c) * *kp[j].add(c);
                }
            }
        }
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let sv = _mm256_set1_ps(scale);
        let masked = |h: usize| {
            let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(seen as i32 - 8 * h as i32), lane);
            let x = _mm256_mul_ps(_mm256_loadu_ps(s.as_ptr().add(8 * h)), sv);
            _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep))
        };
        let (s0, s1) = (masked(0), masked(1));
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_max_ps(s0, s1));
        let m = lanes.iter().fold(q.m, |m, &v| m.max(v));
        let mv = _mm256_set1_ps(m);
        let (p0, p1) = (exp8(_mm256_sub_ps(s0, mv)), exp8(_mm256_sub_ps(s1, mv)));
        let sum = hsum(_mm256_add_ps(p0, p1));
        let mut ps = [0f32; super::KEY_TILE];
        _mm256_storeu_ps(ps.as_mut_ptr(), p0);
        _mm256_storeu_ps(ps.as_mut_ptr().add(8), p1);
        // How the accumulator starts: zero on the first tile, rescaled when
        // the maximum grew, as it is otherwise (`x * 1` would change nothing).
        let first = q.m == f32::NEG_INFINITY;
        let alpha = if !first && m > q.m {
            exp1(q.m - m)
        } else {
            1.0
        };
        q.l = if first { sum } else { q.l * alpha + sum };
        q.m = m;
        let rescale = !first && alpha != 1.0;
        let av = _mm256_set1_ps(alpha);
        let out = q.out;
        let start = |at: *const f32| {
            if first {
                _mm256_setzero_ps()
            } else if rescale {
                _mm256_mul_ps(_mm256_loadu_ps(at), av)
            } else {
                _mm256_loadu_ps(at)
            }
        };
        let ps = &ps[..seen];
        let mut c = 0;
        while c + 64 <= hd {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, a) in acc.iter_mut().enumerate() {
                *a = start(out.add(c + 8 * j));
            }
            for (t, &p) in ps.iter().enumerate() {
                let v = kp[t].add(v_offset + c);
                let pv = _mm256_set1_ps(p);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, _mm256_loadu_ps(v.add(8 * j)), *a);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(c + 8 * j), *a);
            }
            c += 64;
        }
        while c + 8 <= hd {
            let mut acc = start(out.add(c));
            for (t, &p) in ps.iter().enumerate() {
                acc = _mm256_fmadd_ps(
                    _mm256_set1_ps(p),
                    _mm256_loadu_ps(kp[t].add(v_offset + c)),
                    acc,
                );
            }
            _mm256_storeu_ps(out.add(c), acc);
            c += 8;
        }
        while c < hd {
            let mut acc = if first {
                0.0
            } else if rescale {
                *out.add(c) * alpha
            } else {
                *out.add(c)
            };
            for (t, &p) in ps.iter().enumerate() {
                acc = p.mul_add(*kp[t].add(v_offset + c), acc);
            }
            *out.add(c) = acc;
            c += 1;
        }
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn vector_exp_is_accurate_and_lane_consistent() {
            if super::super::backend() != super::super::Backend::Avx2Fma {
                return;
            }
            let xs: Vec<f32> = (0..4000)
                .map(|i| -(i as f32) * 0.0231)
                .chain([0.0, -1e-30, -87.0, -88.0, -1000.0])
                .collect();
            for x in xs {
                // SAFETY: the CPU has AVX2 and FMA (checked above).
                let v = unsafe {
                    let r = super::exp8(std::arch::x86_64::_mm256_set1_ps(x));
                    let mut o = [0f32; 8];
                    std::arch::x86_64::_mm256_storeu_ps(o.as_mut_ptr(), r);
                    o[3]
                };
                let s = unsafe { exp1_fma(x) };
                assert_eq!(v.to_bits(), s.to_bits(), "lane and tail differ at {x}");
                let want = (x as f64).exp();
                if x >= super::EXP_LO {
                    assert!(
                        ((v as f64) - want).abs() <= 4.0 * f32::EPSILON as f64 * want,
                        "exp({x}) = {v}, want {want}"
                    );
                } else {
                    assert_eq!(v, 0.0);
                }
            }
        }

        #[target_feature(enable = "avx2,fma")]
        unsafe fn exp1_fma(x: f32) -> f32 {
            super::exp1(x)
        }
    }
}

mod portable {
    use super::{for_each_tile, Job};

    pub(super) unsafe fn run_job(x: *const f32, m: usize, k: usize, job: &Job) {
        let (w, y, n) = (job.w, job.y.0, job.n);
        for_each_tile(m, k, job, |mr, nr, r, j| {
            // SAFETY: the tile lies inside the job's rows and columns.
            unsafe {
                let xt = x.add(r * k);
                let wt = w.add(j * k);
                let yt = y.add(r * n + j);
                dispatch_tile!(tile, mr, nr, xt, wt, k, yt, n)
            }
        });
    }

    /// The same fixed horizontal order as the AVX2 flavour.
    #[inline(always)]
    pub(super) fn hsum(a: &[f32; 8]) -> f32 {
        let s4 = [a[0] + a[4], a[1] + a[5], a[2] + a[6], a[3] + a[7]];
        let s2 = [s4[0] + s4[2], s4[1] + s4[3]];
        s2[0] + s2[1]
    }

    #[inline(always)]
    unsafe fn tile<const R: usize, const C: usize>(
        x: *const f32,
        w: *const f32,
        k: usize,
        y: *mut f32,
        ldy: usize,
    ) {
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

    pub(super) unsafe fn dot(a: *const f32, b: *const f32, k: usize) -> f32 {
        let mut acc = [0f32; 8];
        let k8 = k & !7;
        let mut p = 0;
        while p < k8 {
            for (l, al) in acc.iter_mut().enumerate() {
                *al += *a.add(p + l) * *b.add(p + l);
            }
            p += 8;
        }
        let mut s = hsum(&acc);
        for t in k8..k {
            s += *a.add(t) * *b.add(t);
        }
        s
    }

    pub(super) unsafe fn axpy(acc: *mut f32, p: f32, v: *const f32, k: usize) {
        for t in 0..k {
            *acc.add(t) += p * *v.add(t);
        }
    }

    /// One tile of [`super::attend_many`] for one query: `seen` of the
    /// tile's keys, scalar operations in a fixed order.
    pub(super) unsafe fn attend_tile(
        q: &mut super::AttnQuery,
        kp: &[*const f32; super::KEY_TILE],
        v_offset: usize,
        hd: usize,
        scale: f32,
        seen: usize,
    ) {
        let mut s = [0f32; super::KEY_TILE];
        for (j, sj) in s.iter_mut().enumerate().take(seen) {
            *sj = dot(q.q, kp[j], hd) * scale;
        }
        let m = s[..seen].iter().fold(q.m, |m, &v| m.max(v));
        let mut sum = 0f32;
        for sj in &mut s[..seen] {
            *sj = (*sj - m).exp();
            sum += *sj;
        }
        let first = q.m == f32::NEG_INFINITY;
        if first {
            std::slice::from_raw_parts_mut(q.out, hd).fill(0.0);
            q.l = sum;
        } else if m > q.m {
            let alpha = (q.m - m).exp();
            for c in 0..hd {
                *q.out.add(c) *= alpha;
            }
            q.l = q.l * alpha + sum;
        } else {
            q.l += sum;
        }
        q.m = m;
        for (j, &p) in s.iter().enumerate().take(seen) {
            axpy(q.out, p, kp[j].add(v_offset), hd);
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
    avx2::dot(a.as_ptr(), b.as_ptr(), a.len())
}

// ---------------------------------------------------------------------------
// Per-row kernels
// ---------------------------------------------------------------------------

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

/// `gate[i] = silu(gate[i]) * up[i]` with `silu(x) = x / (1 + e^-x)`.
pub fn silu_mul(gate: &mut [f32], up: &[f32]) {
    for (g, &u) in gate.iter_mut().zip(up) {
        let x = *g;
        *g = x / (1.0 + (-x).exp()) * u;
    }
}

// ---------------------------------------------------------------------------
// Paged attention
// ---------------------------------------------------------------------------

/// Where a KV head's rows live in a paged cache, in floats from `base`:
/// the K row of position `t` is at
/// `block_table[t / block_size] * block_stride + (t % block_size) * row_stride + head_offset`,
/// and the V row `v_offset` floats further.
#[derive(Clone, Copy)]
pub struct PagedRows<'a> {
    pub base: *const f32,
    pub block_table: &'a [u32],
    pub block_size: usize,
    pub block_stride: usize,
    pub row_stride: usize,
    pub head_offset: usize,
    pub v_offset: usize,
}

impl PagedRows<'_> {
    #[inline(always)]
    pub(crate) fn k_row(&self, t: usize) -> *const f32 {
        let b = self.block_table[t / self.block_size] as usize;
        let off =
            b * self.block_stride + (t % self.block_size) * self.row_stride + self.head_offset;
        self.base.wrapping_add(off)
    }
}

/// Keys per tile of the online softmax: tiles start at multiples of
/// `KEY_TILE` positions, whatever the queries around them, so a query's
/// arithmetic depends on its position and the cache alone.
pub const KEY_TILE: usize = 16;

/// One query head of an [`attend_many`] call: its vector (`head_dim`
/// floats, after norm and RoPE), its position (keys `0..=pos` are read) and
/// its output row (`head_dim` floats, also the running accumulator).
#[derive(Clone, Copy)]
pub struct AttnQuery {
    q: *const f32,
    pos: usize,
    out: *mut f32,
    /// Running maximum of the scores seen so far (`-inf` before the first tile).
    m: f32,
    /// Running sum of `exp(score - m)`.
    l: f32,
}

impl AttnQuery {
    pub const EMPTY: AttnQuery = AttnQuery {
        q: std::ptr::null(),
        pos: 0,
        out: std::ptr::null_mut(),
        m: f32::NEG_INFINITY,
        l: 0.0,
    };

    pub fn new(q: *const f32, pos: usize, out: *mut f32) -> Self {
        AttnQuery {
            q,
            pos,
            out,
            ..Self::EMPTY
        }
    }
}

/// One query head attending over a sequence's cached positions `0..=pos`.
pub struct AttendArgs<'a> {
    /// The query head vector (`head_dim`, after norm and RoPE).
    pub q: &'a [f32],
    /// Position of the query; keys `0..=pos` are read.
    pub pos: usize,
    pub rows: PagedRows<'a>,
    pub scale: f32,
}

/// Causal attention for one (query, head): `out = softmax(q·Kᵀ·scale) · V`,
/// [`attend_many`] with one query.
///
/// # Safety
/// As [`attend_many`]; `out` is `head_dim` floats.
pub unsafe fn attend(args: &AttendArgs<'_>, out: &mut [f32]) {
    assert_eq!(args.q.len(), out.len());
    let mut q = [AttnQuery::new(args.q.as_ptr(), args.pos, out.as_mut_ptr())];
    attend_many(&args.rows, args.q.len(), args.scale, &mut q);
}

/// Causal attention for query heads that share one KV head:
/// `out = softmax(q·Kᵀ·scale) · V` for each, by tiles of [`KEY_TILE`] keys
/// with an online softmax (a running maximum and sum; the accumulator is
/// rescaled when the maximum grows). The tiles sweep every query's keys once:
/// a tile's K and V rows are read from memory once for all the queries, and
/// stay in cache while each of them uses it.
///
/// Each query's operations depend only on its position and the cache (the
/// tiles, the order of additions in each, where the rescaling happens), not
/// on which other queries share the call: the bits are the same however a
/// sequence is batched, chunked or preempted.
///
/// # Safety
/// `rows` must describe `head_dim` readable floats of K and of V for every
/// position up to the largest `pos`, not written while this runs; each
/// query's `q` must point at `head_dim` readable floats and its `out` at
/// `head_dim` writable floats that nothing else touches meanwhile.
pub unsafe fn attend_many(rows: &PagedRows<'_>, head_dim: usize, scale: f32, qs: &mut [AttnQuery]) {
    attend_many_with(backend(), rows, head_dim, scale, qs)
}

/// [`attend_many`] on a given backend (one the CPU has).
unsafe fn attend_many_with(
    be: Backend,
    rows: &PagedRows<'_>,
    head_dim: usize,
    scale: f32,
    qs: &mut [AttnQuery],
) {
    match be {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2Fma => avx2::attend_many(rows, head_dim, scale, qs),
        _ => attend_many_generic(
            rows,
            head_dim,
            scale,
            qs,
            |q, kp, v_offset, hd, scale, seen| {
                // SAFETY: as this function's contract.
                unsafe { portable::attend_tile(q, kp, v_offset, hd, scale, seen) }
            },
        ),
    }
}

/// The sweep of [`attend_many`]: tiles in position order, every query that
/// reaches a tile taking it in turn, then the division by the sum. `tile`
/// takes a query, the tile's 16 K row pointers (the V row is `v_offset`
/// floats further), and how many of them the query sees.
#[inline(always)]
unsafe fn attend_many_generic(
    rows: &PagedRows<'_>,
    hd: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    tile: impl Fn(&mut AttnQuery, &[*const f32; KEY_TILE], usize, usize, f32, usize),
) {
    let Some(max_pos) = qs.iter().map(|q| q.pos).max() else {
        return;
    };
    for q in qs.iter_mut() {
        q.m = f32::NEG_INFINITY;
        q.l = 0.0;
    }
    let mut kp = [std::ptr::null(); KEY_TILE];
    for t0 in (0..=max_pos).step_by(KEY_TILE) {
        // Rows past the last query's position are not read: their slots
        // point at the tile's first row, and every query masks them.
        for (i, p) in kp.iter_mut().enumerate() {
            let t = t0 + i;
            *p = rows.k_row(if t <= max_pos { t } else { t0 });
        }
        for q in qs.iter_mut().filter(|q| q.pos >= t0) {
            let seen = (q.pos + 1 - t0).min(KEY_TILE);
            tile(q, &kp, rows.v_offset, hd, scale, seen);
        }
    }
    for q in qs.iter() {
        let inv = 1.0 / q.l;
        for c in 0..hd {
            *q.out.add(c) *= inv;
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Deterministic pseudo-random floats in [-1, 1).
    pub(crate) fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for j in 0..n {
                y[r * n + j] = (0..k)
                    .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                    .sum();
            }
        }
        y
    }

    fn run(be: Backend, x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
        let mut y = vec![f32::NAN; m * n];
        matmul_many_with(be, x, m, k, &mut [Linear { w, n, y: &mut y }]);
        y
    }

    fn backends() -> Vec<Backend> {
        let mut v = vec![Backend::Portable];
        if backend() == Backend::Avx2Fma {
            v.push(Backend::Avx2Fma);
        }
        v
    }

    #[test]
    fn block_matmul_equals_f32_matmul_on_the_dequantised_weights_bit_for_bit() {
        use crate::qkernels::QType;
        let (k, n) = (96, 29);
        for ty in QType::ALL.into_iter().chain([QType::F16, QType::BF16]) {
            // Random blocks: f16 scales (and minima) from random values, random
            // codes; 16-bit floats from random values.
            let vals = rand_vec(11, n * k);
            let mut blocks = vec![0u8; n * ty.row_bytes(k)];
            for (row, out) in vals.chunks(k).zip(blocks.chunks_mut(ty.row_bytes(k))) {
                crate::bench::quantize_row(ty, row, out);
            }
            let mut deq = vec![0f32; n * k];
            crate::gguf::dequantize(crate::weights::ggml_type(ty), &blocks, &mut deq).unwrap();
            for be in backends() {
                for m in [1usize, 2, 3, 4, 5, 8, 33, 70] {
                    let x = rand_vec(m as u64, m * k);
                    let want = run(be, &x, m, k, &deq, n);
                    let mut got = vec![0f32; m * n];
                    matmul_blocks_many_with(
                        be,
                        &x,
                        m,
                        k,
                        &mut [BlockLinear {
                            ty,
                            w: &blocks,
                            n,
                            y: &mut got,
                        }],
                    );
                    assert_eq!(
                        got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "{ty:?} {be:?} m={m}"
                    );
                }
                // The dequantiser of the backend equals the scalar one.
                let mut row = vec![0f32; k];
                dequantize_row(be, ty, &blocks[..ty.row_bytes(k)], &mut row);
                assert_eq!(row, deq[..k], "{ty:?} {be:?}");
            }
        }
    }

    #[test]
    fn matmul_matches_f64_reference() {
        for be in backends() {
            for &(m, k, n) in &[
                (1, 8, 1),
                (5, 37, 7),
                (13, 64, 10),
                (40, 200, 33),
                (3, 1, 4),
            ] {
                let x = rand_vec(1, m * k);
                let w = rand_vec(2, n * k);
                let y = run(be, &x, m, k, &w, n);
                let r = reference(&x, m, k, &w, n);
                for (a, b) in y.iter().zip(&r) {
                    assert!(
                        (*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{be:?} m={m} k={k} n={n}: {a} vs {b}"
                    );
                }
            }
        }
    }

    #[test]
    fn matmul_rows_are_bit_identical_for_every_m_and_position() {
        let (k, n) = (75, 23);
        let w = rand_vec(3, n * k);
        let pool_rows = rand_vec(4, 40 * k);
        for be in backends() {
            // Each row computed alone is the reference.
            let alone: Vec<Vec<f32>> = (0..40)
                .map(|r| run(be, &pool_rows[r * k..(r + 1) * k], 1, k, &w, n))
                .collect();
            for m in 1..=40 {
                // Rows taken from a rotating window so every row lands at many offsets.
                for shift in [0, 1, 3, 7] {
                    let idx: Vec<usize> = (0..m).map(|i| (i + shift * m) % 40).collect();
                    let x: Vec<f32> = idx
                        .iter()
                        .flat_map(|&r| pool_rows[r * k..(r + 1) * k].to_vec())
                        .collect();
                    let y = run(be, &x, m, k, &w, n);
                    for (i, &r) in idx.iter().enumerate() {
                        let got: Vec<u32> =
                            y[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                        let want: Vec<u32> = alone[r].iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "{be:?}: row {r} at position {i} of m={m}");
                    }
                }
            }
        }
    }

    #[test]
    fn matmul_is_independent_of_thread_count() {
        let (m, k, n) = (37, 130, 301);
        let x = rand_vec(5, m * k);
        let w = rand_vec(6, n * k);
        for be in backends() {
            let mut results = Vec::new();
            for threads in [1, 2, 3, 5, 8] {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                let y = pool.install(|| run(be, &x, m, k, &w, n));
                results.push(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
            }
            assert!(
                results.windows(2).all(|p| p[0] == p[1]),
                "{be:?}: results differ across thread counts"
            );
        }
    }

    #[test]
    fn matmul_many_equals_separate_products() {
        let (m, k) = (9, 48);
        let x = rand_vec(7, m * k);
        let w1 = rand_vec(8, 17 * k);
        let w2 = rand_vec(9, 5 * k);
        let (mut y1, mut y2) = (vec![0f32; m * 17], vec![0f32; m * 5]);
        matmul_many(
            &x,
            m,
            k,
            &mut [
                Linear {
                    w: &w1,
                    n: 17,
                    y: &mut y1,
                },
                Linear {
                    w: &w2,
                    n: 5,
                    y: &mut y2,
                },
            ],
        );
        let (mut z1, mut z2) = (vec![0f32; m * 17], vec![0f32; m * 5]);
        matmul(&x, m, k, &w1, 17, &mut z1);
        matmul(&x, m, k, &w2, 5, &mut z2);
        assert_eq!(y1, z1);
        assert_eq!(y2, z2);
    }

    #[test]
    fn dot_matches_single_row_matmul() {
        let k = 67;
        let a = rand_vec(10, k);
        let b = rand_vec(11, k);
        let mut y = [0f32];
        matmul(&a, 1, k, &b, 1, &mut y);
        assert_eq!(dot(&a, &b).to_bits(), y[0].to_bits());
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn hsum8_lanes_are_hsum_bit_for_bit() {
        if backend() != Backend::Avx2Fma {
            return;
        }
        for seed in 0..200 {
            let vals = rand_vec(100 + seed, 64);
            // Wide exponent spread, so any change in the order of additions shows.
            let vals: Vec<f32> = vals
                .iter()
                .enumerate()
                .map(|(i, v)| v * 2f32.powi((i % 13) as i32 * 3 - 18))
                .collect();
            // SAFETY: AVX2 is present (the backend); 64 floats are read.
            unsafe {
                use std::arch::x86_64::*;
                let v: [__m256; 8] =
                    std::array::from_fn(|i| _mm256_loadu_ps(vals.as_ptr().add(8 * i)));
                let mut got = [0f32; 8];
                _mm256_storeu_ps(got.as_mut_ptr(), avx2::hsum8(&v));
                for i in 0..8 {
                    assert_eq!(
                        got[i].to_bits(),
                        avx2::hsum(v[i]).to_bits(),
                        "seed {seed} lane {i}"
                    );
                }
            }
        }
    }

    #[test]
    fn attend_matches_an_f64_softmax_over_paged_rows() {
        // Two heads of `hd` in rows of `2*hd + 8` floats (V a slab of K rows
        // further), in blocks of 8 positions laid out out of order; head
        // sizes that take every path of the kernels (64-, 32-, 8-wide, single).
        for hd in [16, 20, 64, 72, 100] {
            let (row_stride, block_size) = (2 * hd + 8, 8);
            let table = [3u32, 0, 2, 1, 4];
            let slab = block_size * row_stride;
            let kv = rand_vec(21, table.len() * 2 * slab);
            let q = rand_vec(22, hd);
            for head in 0..2 {
                let rows = PagedRows {
                    base: kv.as_ptr(),
                    block_table: &table,
                    block_size,
                    block_stride: 2 * slab,
                    row_stride,
                    head_offset: head * hd,
                    v_offset: slab,
                };
                for pos in [0, 6, 7, 8, 15, 16, 30, 39] {
                    let mut out = vec![0f32; hd];
                    // SAFETY: every position up to 39 has K and V rows in `kv`.
                    unsafe {
                        attend(
                            &AttendArgs {
                                q: &q,
                                pos,
                                rows,
                                scale: 0.25,
                            },
                            &mut out,
                        )
                    };
                    let k_off = |t: usize| {
                        table[t / block_size] as usize * 2 * slab
                            + (t % block_size) * row_stride
                            + head * hd
                    };
                    let (want, _) = f64_attention(&kv, &q, pos, 0.25, k_off, slab);
                    for c in 0..hd {
                        let want = want[c];
                        assert!(
                            (out[c] as f64 - want).abs() < 1e-5,
                            "hd {hd} head {head} pos {pos} dim {c}: {} vs {want}",
                            out[c]
                        );
                    }
                }
            }
        }
    }

    /// A paged cache of `blocks` blocks of `block_size` positions for one
    /// head (K rows then V rows per block), in a scrambled block order, with
    /// keys whose scale grows along the positions so the running maximum of
    /// the online softmax moves on many tiles; and the f64 answer.
    struct Cache {
        kv: Vec<f32>,
        table: Vec<u32>,
        block_size: usize,
        hd: usize,
        /// Times the running maximum grew on a later tile, over `reference` calls.
        grows: std::cell::Cell<usize>,
    }

    impl Cache {
        fn new(seed: u64, blocks: usize, block_size: usize, hd: usize) -> Cache {
            let mut kv = rand_vec(seed, blocks * 2 * block_size * hd);
            for (b, blk) in kv.chunks_mut(2 * block_size * hd).enumerate() {
                // Block slot b holds positions of table index (b * 7) % blocks.
                let first = ((b * 7) % blocks) * block_size;
                for (t, row) in blk[..block_size * hd].chunks_mut(hd).enumerate() {
                    let g = 1.0 + (first + t) as f32 / 8.0;
                    row.iter_mut().for_each(|x| *x *= g);
                }
            }
            let mut table = vec![0u32; blocks];
            for b in 0..blocks {
                table[(b * 7) % blocks] = b as u32;
            }
            Cache {
                kv,
                table,
                block_size,
                hd,
                grows: Default::default(),
            }
        }

        fn rows(&self) -> PagedRows<'_> {
            PagedRows {
                base: self.kv.as_ptr(),
                block_table: &self.table,
                block_size: self.block_size,
                block_stride: 2 * self.block_size * self.hd,
                row_stride: self.hd,
                head_offset: 0,
                v_offset: self.block_size * self.hd,
            }
        }

        fn reference(&self, q: &[f32], pos: usize, scale: f64) -> Vec<f64> {
            let off = |t: usize| {
                self.table[t / self.block_size] as usize * 2 * self.block_size * self.hd
                    + (t % self.block_size) * self.hd
            };
            let (out, s) = f64_attention(&self.kv, q, pos, scale, off, self.block_size * self.hd);
            // Tiles after the first whose maximum beats every earlier score.
            let grows = s
                .chunks(KEY_TILE)
                .scan(f64::NEG_INFINITY, |m, tile| {
                    let t = tile.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let up = t > *m && *m > f64::NEG_INFINITY;
                    *m = m.max(t);
                    Some(up)
                })
                .filter(|&up| up)
                .count();
            self.grows.set(self.grows.get() + grows);
            out
        }
    }

    /// Softmax attention in f64 of `q` over positions `0..=pos` whose K row
    /// starts at `kv[k_off(t)]` and V row `v_delta` floats further: the
    /// output row and the scaled scores.
    fn f64_attention(
        kv: &[f32],
        q: &[f32],
        pos: usize,
        scale: f64,
        k_off: impl Fn(usize) -> usize,
        v_delta: usize,
    ) -> (Vec<f64>, Vec<f64>) {
        let s: Vec<f64> = (0..=pos)
            .map(|t| {
                scale
                    * q.iter()
                        .zip(&kv[k_off(t)..])
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
            })
            .collect();
        let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
        let z: f64 = e.iter().sum();
        let out = (0..q.len())
            .map(|c| {
                (0..=pos)
                    .map(|t| e[t] / z * kv[k_off(t) + v_delta + c] as f64)
                    .sum()
            })
            .collect();
        (out, s)
    }

    #[test]
    fn online_softmax_matches_f64_over_long_contexts_with_a_growing_maximum() {
        for be in backends() {
            for (hd, block_size) in [(64, 16), (128, 16), (64, 8), (20, 32)] {
                let cache = Cache::new(31, 20, block_size, hd);
                let n = 20 * block_size;
                let q: Vec<f32> = rand_vec(32, hd).iter().map(|x| x * 3.0).collect();
                for pos in [0, 15, 16, 17, 100, n / 2, n - 1] {
                    let mut out = vec![f32::NAN; hd];
                    let mut qs = [AttnQuery::new(q.as_ptr(), pos, out.as_mut_ptr())];
                    // SAFETY: the cache holds K and V for every position < n.
                    unsafe { attend_many_with(be, &cache.rows(), hd, 0.3, &mut qs) };
                    let want = cache.reference(&q, pos, 0.3);
                    for c in 0..hd {
                        let tol = 2e-5 * (1.0 + want[c].abs());
                        assert!(
                            (out[c] as f64 - want[c]).abs() < tol,
                            "{be:?} hd {hd} bs {block_size} pos {pos} dim {c}: {} vs {}",
                            out[c],
                            want[c]
                        );
                    }
                }
                assert!(
                    cache.grows.get() >= 10,
                    "hd {hd}: the maximum grew on {} later tiles only",
                    cache.grows.get()
                );
            }
        }
    }

    #[test]
    fn a_query_gets_the_same_bits_whatever_queries_share_its_sweep() {
        for be in backends() {
            for hd in [64, 128, 24, 20, 72] {
                let cache = Cache::new(41, 12, 16, hd);
                let n = 12 * 16;
                // 40 query heads at scattered positions (some repeated), as a
                // prefill chunk or a decode batch would bring them.
                let qv: Vec<Vec<f32>> = (0..40).map(|i| rand_vec(500 + i, hd)).collect();
                let pos: Vec<usize> = (0..40).map(|i| (i * 37 + 5) % n).collect();
                let alone: Vec<Vec<f32>> = (0..40)
                    .map(|i| {
                        let mut out = vec![0f32; hd];
                        let mut qs = [AttnQuery::new(qv[i].as_ptr(), pos[i], out.as_mut_ptr())];
                        // SAFETY: positions are below n.
                        unsafe { attend_many_with(be, &cache.rows(), hd, 0.125, &mut qs) };
                        out
                    })
                    .collect();
                for split in [40, 7, 1] {
                    let mut outs = vec![vec![f32::NAN; hd]; 40];
                    let mut qs: Vec<AttnQuery> = outs
                        .iter_mut()
                        .enumerate()
                        .map(|(i, o)| AttnQuery::new(qv[i].as_ptr(), pos[i], o.as_mut_ptr()))
                        .collect();
                    for part in qs.chunks_mut(split) {
                        // SAFETY: as above; outputs are distinct.
                        unsafe { attend_many_with(be, &cache.rows(), hd, 0.125, part) };
                    }
                    for i in 0..40 {
                        let same = outs[i]
                            .iter()
                            .zip(&alone[i])
                            .all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(
                            same,
                            "{be:?} hd {hd} split {split}: query {i} at {} differs",
                            pos[i]
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn rope_rotates_pairs_and_keeps_norm() {
        let d = 8;
        let inv = rope_inv_freq(10000.0, d);
        assert_eq!(inv[0], 1.0);
        let (mut c, mut s) = (vec![0f32; d / 2], vec![0f32; d / 2]);
        rope_cos_sin(0, &inv, &mut c, &mut s);
        let mut v = rand_vec(12, d);
        let orig = v.clone();
        rope_apply(&mut v, &c, &s);
        assert_eq!(v, orig, "position 0 is the identity");
        rope_cos_sin(5, &inv, &mut c, &mut s);
        rope_apply(&mut v, &c, &s);
        let n0: f32 = orig.iter().map(|x| x * x).sum();
        let n1: f32 = v.iter().map(|x| x * x).sum();
        assert!((n0 - n1).abs() < 1e-5);
        // Pair (0, d/2) rotates by angle 5 * inv[0] = 5.
        let (x1, x2) = (orig[0], orig[d / 2]);
        assert!((v[0] - (x1 * 5f32.cos() - x2 * 5f32.sin())).abs() < 1e-6);
    }

    #[test]
    fn rmsnorm_and_silu_match_definitions() {
        let x = rand_vec(13, 10);
        let w = rand_vec(14, 10);
        let mut out = vec![0f32; 10];
        rmsnorm(&x, &w, 1e-5, &mut out);
        let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 10.0;
        for i in 0..10 {
            let want = w[i] as f64 * x[i] as f64 / (ms + 1e-5).sqrt();
            assert!((out[i] as f64 - want).abs() < 1e-6);
        }
        let mut g = vec![-2.0f32, 0.0, 3.0];
        silu_mul(&mut g, &[1.0, 5.0, 2.0]);
        assert!((g[0] - (-2.0 / (1.0 + 2f32.exp()))).abs() < 1e-6);
        assert_eq!(g[1], 0.0);
        assert!((g[2] - 2.0 * 3.0 / (1.0 + (-3f32).exp())).abs() < 1e-6);
    }
}
