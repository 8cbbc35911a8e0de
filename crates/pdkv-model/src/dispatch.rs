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

/// Splits the output features of up to [`MAX_MANY`] matrices (of `ns`:
/// features, and [`Features::work`] each) into jobs of whole `tile`-row
/// register tiles, and runs `run(matrix, j0, j1)` for each
/// ([`crate::team::par_for`]). A job owns a column range of its matrix's
/// `y` and the matching rows of its `w`. Job descriptors live on the
/// stack: a step allocates nothing here.
pub(crate) fn for_each_job(
    ns: impl Iterator<Item = Features>,
    tile: usize,
    run: impl Fn(usize, usize, usize) + Sync,
) {
    let threads = crate::team::threads().max(1);
    // Per matrix: features, features per job, index of its first job.
    let mut mats = [(0usize, 0usize, 0usize); MAX_MANY];
    let (mut count, mut total) = (0, 0);
    for (slot, f) in mats.iter_mut().zip(ns) {
        let (n, per) = (f.n, per_job(f, tile, threads));
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

/// Features per job of a matrix: [`JOBS_PER_THREAD`] jobs a thread, or
/// as many as [`MIN_JOB_WORK`] goes into the matrix's work, rounded up,
/// where that is fewer, but one a thread at the least, and a whole number
/// a thread (three jobs on two threads leave one thread two thirds of the
/// matrix: `bench_from_memory`'s Q4_K matrix of 498 KB, 2 threads, 24.3 ->
/// 28.6-29.1 GB/s with four); whole `tile`s each (so a matrix of few tiles
/// has fewer), the last taking what is left.
fn per_job(f: Features, tile: usize, threads: usize) -> usize {
    let jobs = (f.n * f.work)
        .div_ceil(MIN_JOB_WORK)
        .clamp(threads, threads * JOBS_PER_THREAD)
        .next_multiple_of(threads);
    f.n.div_ceil(jobs).div_ceil(tile).max(1) * tile
}

/// A matrix's output features as [`for_each_job`] splits them: how many
/// (`n`), and the work each one is (`work`: its weight row's bytes times
/// the activation rows, which a job reads or multiplies by).
#[derive(Clone, Copy)]
pub(crate) struct Features {
    pub(crate) n: usize,
    pub(crate) work: usize,
}

/// [`for_each_job`] over any number of matrices, [`MAX_MANY`] to a
/// dispatch: `view` gives each output what its jobs need (`P`: pointers, a
/// format, ...) and its [`Features`]; `run(p, j0, j1)` runs one job.
pub(crate) fn for_each_job_of<T, P: Copy + Sync>(
    outs: &mut [T],
    tile: usize,
    view: impl Fn(&mut T) -> (P, Features),
    run: impl Fn(P, usize, usize) + Sync,
) {
    for group in outs.chunks_mut(MAX_MANY) {
        let mut mats: [Option<(P, Features)>; MAX_MANY] = [None; MAX_MANY];
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

/// The work of a job of [`for_each_job`] below which a matrix is split
/// into fewer jobs (down to one a thread), in weight bytes times activation rows
/// ([`Features::work`]): a matrix gets as many jobs as this goes into its
/// work, rounded up. At batch 1 a job streams its weight rows once, and
/// each job starts a stream of its own (its first loads wait on memory)
/// and claims its place in the team: SmolLM2's K and V projections made
/// jobs of 15 KB. Batch-1 decode steps with 0 (four jobs a thread, as
/// before), 128, 192 and 256 KiB, rounded down, interleaved step by step
/// in one process (1,000 steps, medians, two processes each, an AMD Zen 3
/// with 2 threads): Q8_0 8.29-8.41 / 8.01-8.02 / 8.03-8.12 / 8.16-8.17
/// ms, Q4_1 6.62-6.89 / 6.16-6.30 / 5.87-6.15 / 5.93-6.18 ms, Q4_K_M
/// 7.04-7.85 / 6.80-7.43 / 6.69-7.30 / 6.78-7.40 ms; 192 KiB rounded up
/// against rounded down: Q8_0 7.99-8.35 / 8.08-8.47, Q4_1 5.67-6.29 /
/// 5.72-6.28, Q4_K_M 5.97-7.13 / 6.32-7.14 ms (no rounding: 8.39-8.81,
/// 6.00-6.90, 6.43-7.83 ms). One job a thread at the least (so that on
/// a machine of many cores every thread streams weights; here a K or V
/// projection then takes two jobs instead of one): Q8_0 6.53-7.64 against
/// 6.51-7.58 ms, Q4_1 5.99-6.04 against 5.92-5.97, Q4_K_M 5.97-7.14
/// against 5.92-7.18. Batches of many rows, and prefill, keep
/// [`JOBS_PER_THREAD`] jobs a thread.
const MIN_JOB_WORK: usize = 192 << 10;

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_matrix_is_split_into_fewer_jobs_only_when_they_would_be_small() {
        let jobs = |n: usize, work: usize, threads: usize| {
            n.div_ceil(per_job(Features { n, work }, 4, threads))
        };
        // Batch 1, SmolLM2's shapes in Q8_0 (612-byte rows), 2 threads:
        // the K and V projections (118 KB) and the query projection (353
        // KB) one job a thread, the gate projection (940 KB: five of 192
        // KiB) six, a whole number a thread; with 16 threads, one a thread.
        assert_eq!(jobs(192, 612, 2), 2);
        assert_eq!(jobs(576, 612, 2), 2);
        assert_eq!(jobs(1536, 612, 2), 6);
        // Q4_K_M's down projection (576 rows of 864 bytes, 498 KB: three
        // of 192 KiB) four, not three (one thread would stream two thirds).
        assert_eq!(jobs(576, 864, 2), 4);
        assert_eq!(jobs(576, 864, 3), 3);
        assert_eq!(jobs(192, 612, 16), 16);
        assert_eq!(jobs(1536, 612, 16), 16);
        // Two activation rows: twice the work.
        assert_eq!(jobs(576, 612 * 2, 2), 4);
        assert_eq!(jobs(1536, 612 * 2, 2), 8);
        // Many activation rows: work enough for every job (whole tiles:
        // 20 jobs a 192 features would be 9.6 each, 12 make 16 jobs).
        assert_eq!(jobs(192, 612 * 512, 2), 8);
        assert_eq!(jobs(192, 612 * 512, 5), 16);
        // Never more jobs than register tiles; at least one, but none for
        // an empty matrix.
        assert_eq!(jobs(6, 1 << 30, 8), 2);
        assert_eq!(jobs(1, 1, 1), 1);
        assert_eq!(jobs(0, 1, 2), 0);
    }

    #[test]
    fn jobs_cover_each_matrix_once_in_whole_tiles() {
        let ns = [(1usize, 1usize), (13, 1 << 20), (301, 300), (2000, 4000)];
        for threads in [1, 2, 3, 8] {
            let pool = crate::kernels::tests::pool(threads);
            let seen = std::sync::Mutex::new(Vec::new());
            pool.install(|| {
                for_each_job(
                    ns.iter().map(|&(n, work)| Features { n, work }),
                    4,
                    |i, j0, j1| seen.lock().unwrap().push((i, j0, j1)),
                )
            });
            let mut seen = seen.into_inner().unwrap();
            seen.sort();
            for (i, &(n, _)) in ns.iter().enumerate() {
                let mine: Vec<_> = seen.iter().filter(|s| s.0 == i).collect();
                let mut at = 0;
                for &&(_, j0, j1) in &mine {
                    assert_eq!(j0, at, "matrix {i}, {threads} threads: {mine:?}");
                    assert!(j1 > j0 && (j1 == n || (j1 - j0) % 4 == 0), "{mine:?}");
                    at = j1;
                }
                assert_eq!(at, n, "matrix {i}, {threads} threads: {mine:?}");
            }
        }
    }
}
