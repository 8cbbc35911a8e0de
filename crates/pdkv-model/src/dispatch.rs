//! Where and how the model's math runs: the instruction set ([`Backend`],
//! chosen once per process), the math thread pool and thread team, and the
//! dispatcher that splits a matmul's output features into jobs
//! ([`for_each_job_of`], run by [`crate::team::par_for`]), with the pointer
//! wrappers those jobs carry across threads.
//!
//! Next to a leaf: it imports only [`crate::team`]; the kernels
//! ([`crate::kernels`], [`crate::qkernels`], [`crate::bf16dot`]) build on it
//! and it imports none of them.

use std::sync::OnceLock;

use crate::team::Team;

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

/// The process's thread team for model steps ([`crate::team`]): as many
/// threads as [`thread_pool`], `None` if its threads could not be started
/// (steps then run on the pool).
pub fn team() -> Option<&'static Team> {
    static TEAM: OnceLock<Option<Team>> = OnceLock::new();
    TEAM.get_or_init(|| {
        let threads = thread_pool().current_num_threads();
        match Team::new(threads, "pdkv-team") {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!("math thread team not started ({e}); steps run on the pool");
                None
            }
        }
    })
    .as_ref()
}

/// Splits the output features of up to [`MAX_MANY`] matrices (of `ns`
/// features each) into jobs of whole `tile`-row register tiles, and runs
/// `run(matrix, j0, j1)` for each ([`crate::team::par_for`]). A job owns a
/// column range of its matrix's `y` and the matching rows of its `w`. Job
/// descriptors live on the stack: a step allocates nothing here.
pub(crate) fn for_each_job(
    ns: impl Iterator<Item = usize>,
    tile: usize,
    run: impl Fn(usize, usize, usize) + Sync,
) {
    let threads = crate::team::threads().max(1);
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
    if threads == 1 {
        (0..total).for_each(job);
    } else {
        crate::team::par_for(total, job);
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

/// The shapes every batched matmul checks before it splits the work:
/// `x` (`x_len` values) holds `m` rows of `k`, and [`check_outputs`].
pub(crate) fn check_shapes(
    (x_len, m, k): (usize, usize, usize),
    unit: &str,
    outs: impl Iterator<Item = (usize, usize, usize, usize)>,
) {
    assert!(x_len >= m * k, "x has {x_len} values, need {m}x{k}");
    check_outputs(m, k, unit, outs);
}

/// Each output's matrix holds its `n` rows (`w_len` of the `w_need` bytes
/// or values, counted in `unit`) and its `y` (`y_len` floats) `m` rows of
/// `n`, for activations of `m` rows of `k` values. Panics otherwise.
pub(crate) fn check_outputs(
    m: usize,
    k: usize,
    unit: &str,
    outs: impl Iterator<Item = (usize, usize, usize, usize)>,
) {
    for (w_len, w_need, y_len, n) in outs {
        assert!(
            w_len >= w_need,
            "w has {w_len} {unit}, need {w_need} ({n} rows of {k} values)"
        );
        assert!(y_len >= m * n, "y has {y_len} floats, need {m}x{n}");
    }
}

/// Jobs per thread and matrix of [`for_each_job`]: a few, so that a thread
/// slowed down is made up for (measured at decode batch 1: 4 and 2 alike,
/// 1 slower).
const JOBS_PER_THREAD: usize = 4;

/// Matrices per [`crate::kernels::matmul_many_with`] dispatch (and per
/// [`for_each_job`]).
pub(crate) const MAX_MANY: usize = 4;

/// A pointer for disjoint writes from several threads, coordinated by the
/// matmul dispatchers ([`crate::kernels`], [`crate::qkernels`],
/// [`crate::bf16dot`]).
pub(crate) struct SendPtr<T>(pub(crate) *mut T);
impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendPtr<T> {}
// SAFETY: used only for disjoint writes coordinated by a dispatcher: no two
// threads write the same element, and no one reads it meanwhile.
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as for `Send`; sharing the pointer gives no access of its own.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// A method (not a field access) so closures capture the whole wrapper.
    pub(crate) fn get(self) -> *mut T {
        self.0
    }
}

/// A pointer to data that several threads only read.
pub(crate) struct SendConstPtr<T>(pub(crate) *const T);
impl<T> Clone for SendConstPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for SendConstPtr<T> {}
// SAFETY: it points at data that no one writes while the threads read it.
unsafe impl<T> Send for SendConstPtr<T> {}
// SAFETY: as for `Send`: shared reads of data nobody writes.
unsafe impl<T> Sync for SendConstPtr<T> {}

impl<T> SendConstPtr<T> {
    /// A method (not a field access) so closures capture the whole wrapper.
    pub(crate) fn get(self) -> *const T {
        self.0
    }
}
