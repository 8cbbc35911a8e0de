//! The block-format matmul's entry points: shapes checked, output features
//! split into jobs on the math threads, each job run by its flavour.

use std::cell::RefCell;

use super::acts::{QActs, DIRECT_MAX};
use super::flavour::{has, Flavour};
use super::job::{Job, Scratch, NR};
use super::portable;
#[cfg(target_arch = "x86_64")]
use super::{simd, tiled};
use crate::dispatch::{check_outputs, for_each_job_of, Backend, Features, SendConstPtr, SendPtr};
use crate::packed;
use crate::qtype::QType;

/// One quantised weight matrix `[n, k]` (rows of `ty.row_bytes(k)` bytes, GGUF block layout or a packed format's tiles) and its output `[m, n]`.
pub struct QLinear<'a> {
    pub ty: QType,
    pub w: &'a [u8],
    pub n: usize,
    pub y: &'a mut [f32],
}

/// `y[r][j] = Σ_blocks dot(x_block, w_block)` for every matrix, on the
/// current rayon pool (like [`crate::kernels::matmul_many`]: output features
/// `j` are split into jobs, never `k`).
pub fn qmatmul_many(x: &QActs, outs: &mut [QLinear<'_>]) {
    qmatmul_many_with(crate::dispatch::backend(), x, outs)
}

/// [`qmatmul_many`] with an explicit backend (tests exercise every one available).
pub fn qmatmul_many_with(be: Backend, x: &QActs, outs: &mut [QLinear<'_>]) {
    run_many(Flavour::of(be), x, outs)
}

pub(super) fn run_many(fl: Flavour, x: &QActs, outs: &mut [QLinear<'_>]) {
    let (m, k) = (x.m, x.k);
    for o in outs.iter() {
        assert!(!o.ty.is_half(), "{:?} takes f32 activations", o.ty);
        assert!(
            k % o.ty.block_values() == 0,
            "{:?} rows are whole blocks of {} values, k = {k}",
            o.ty,
            o.ty.block_values()
        );
    }
    let shapes = outs
        .iter()
        .map(|o| (o.w.len(), o.n * o.ty.row_bytes(k), o.y.len(), o.n));
    // The activations are `x`'s own (`QActs` holds `m` rows of `k`).
    check_outputs(m, k, "bytes", shapes);
    assert!(has(fl), "{fl:?} is not available on this CPU");
    assert!(
        x.interleaved() || (fl != Flavour::Portable && m <= DIRECT_MAX),
        "activations of {m} rows quantised without the interleaved copy {fl:?} reads"
    );
    if m == 0 {
        return;
    }
    let view = |o: &mut QLinear<'_>| {
        let p = (
            o.ty,
            SendConstPtr(o.w.as_ptr()),
            SendPtr(o.y.as_mut_ptr()),
            o.n,
        );
        let work = m * o.ty.row_bytes(k);
        (p, Features { n: o.n, work })
    };
    // A packed matrix's jobs start at its tiles.
    let tile = if outs.iter().any(|o| o.ty.packed()) {
        packed::TILE
    } else {
        NR
    };
    for_each_job_of(outs, tile, view, |(ty, w, y, n), j0, j1| {
        let job = Job {
            ty,
            w: w.get(),
            y: y.0,
            n,
            j0,
            j1,
        };
        // SAFETY: shapes were checked above; jobs write disjoint column
        // ranges of their `y`, every `y` is a distinct &mut borrow, and the
        // flavour was checked against the CPU.
        unsafe { run_job(fl, x, &job) }
    });
}

/// # Safety
/// `job.w` holds `job.n` rows, `job.y` `m * job.n` floats of which no one
/// else writes columns `j0..j1`; the CPU supports `fl`.
unsafe fn run_job(fl: Flavour, x: &QActs, job: &Job) {
    // SAFETY: as this function's contract: the job's rows and columns are
    // inside its matrix and output, and the CPU supports `fl`.
    unsafe {
        let (packed, small) = (job.ty.packed(), x.m <= DIRECT_MAX);
        match fl {
            // Packed rows: at a small batch, the kernels of packed tiles;
            // at a larger one, the SIMD tiles, which rebuild a tile's rows
            // as they unpack them (`simd::prep_packed`); the portable
            // kernels take the job's rows unpacked first.
            #[cfg(target_arch = "x86_64")]
            Flavour::Vnni if packed && small => tiled::run_job_vnni(x, job),
            #[cfg(target_arch = "x86_64")]
            Flavour::Avx2 if packed && small => tiled::run_job_avx2(x, job),
            Flavour::Portable if packed => run_unpacked(fl, x, job),
            #[cfg(target_arch = "x86_64")]
            Flavour::Avx2 | Flavour::Vnni => SCRATCH.with(|s| {
                let s = &mut *s.borrow_mut();
                if fl == Flavour::Vnni {
                    simd::run_job_vnni(x, job, s)
                } else {
                    simd::run_job_avx2(x, job, s)
                }
            }),
            _ => portable::run_job(x, job),
        }
    }
}

/// A job on a packed matrix for a kernel of GGUF rows: the job's rows
/// unpacked into the thread's buffer, then computed as GGUF rows.
///
/// # Safety
/// As [`run_job`]'s, for a packed `job.ty` whose columns start at a tile.
unsafe fn run_unpacked(fl: Flavour, x: &QActs, job: &Job) {
    let (k, rows) = (x.k, job.j1 - job.j0);
    let rb = job.ty.row_bytes(k);
    UNPACKED.with(|buf| {
        let buf = &mut *buf.borrow_mut();
        buf.clear();
        buf.resize(rows * rb, 0);
        // SAFETY: the caller guarantees that `job.w` holds the matrix's
        // `job.n` rows.
        let w = unsafe { std::slice::from_raw_parts(job.w, job.n * rb) };
        packed::rows_into(job.ty, w, k, job.j0, buf);
        let rows_job = Job {
            ty: job.ty.gguf(),
            w: buf.as_ptr(),
            // Column `j0` of each output row is the unpacked rows' column 0.
            y: job.y.wrapping_add(job.j0),
            n: job.n,
            j0: 0,
            j1: rows,
        };
        // SAFETY: the unpacked job's rows are `buf`'s, its output columns
        // the caller's job's.
        unsafe { run_job(fl, x, &rows_job) }
    })
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
    /// The rows of the job [`run_unpacked`] runs.
    static UNPACKED: RefCell<Vec<u8>> = const { RefCell::new(Vec::new()) };
}
