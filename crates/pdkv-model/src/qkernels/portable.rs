//! The portable flavour: one element at a time, straight from the GGUF
//! blocks, scalar operations in the invariant's order.

use super::acts::{QActs, GROUP, GROUP_BLOCK};
use super::blocks::{
    f16_in, min_of, q6_params, q6_value, super_params, super_value, unsigned_value,
};
use super::job::Job;
use crate::qtype::{QType, QK};

/// One element at a time, straight from the GGUF blocks.
///
/// # Safety
/// `job.w` holds `job.n` rows of `x.k` values of `job.ty`; `job.y` holds
/// `x.m * job.n` floats, of which no one else writes columns
/// `job.j0..job.j1`.
pub(super) unsafe fn run_job(x: &QActs, job: &Job) {
    let nb = x.blocks();
    let (bb, rb) = (job.ty.block_bytes(), job.ty.row_bytes(x.k));
    for j in job.j0..job.j1 {
        // SAFETY: row `j < job.n` starts inside `job.w` (the caller's
        // contract: `job.n` rows of `rb` bytes).
        let wr = unsafe { job.w.add(j * rb) };
        for r in 0..x.m {
            let (g, lane) = (r / GROUP, r % GROUP);
            let mut acc = 0f32;
            for b in 0..nb {
                let s = (g * nb + b) * GROUP + lane;
                let xq = &x.qs[(g * nb + b) * GROUP_BLOCK + lane * 4..];
                let qx = |i: usize| xq[(i / 4) * 32 + i % 4] as i32;
                if job.ty == QType::Q6_K {
                    // SAFETY: `wr` is a whole Q6_K row of `x.k` values, so it
                    // holds the super-block of block `b < nb`.
                    let (d, sc, blk) = unsafe { q6_params(wr, b) };
                    // SAFETY: `blk` is that super-block, `bb` bytes in the row.
                    let blk = unsafe { std::slice::from_raw_parts(blk, bb) };
                    let isum: i32 = (0..QK)
                        .map(|i| sc[i / 16] * (q6_value(blk, b % 8, i) as i32 - 32) * qx(i))
                        .sum();
                    acc += isum as f32 * (d * x.d[s]);
                    continue;
                }
                if job.ty.is_super() {
                    // SAFETY: `wr` is a whole row of `x.k` values of `job.ty`,
                    // so it holds the super-block of block `b < nb`.
                    let (dw, mw, blk) = unsafe { super_params(job.ty, wr, b) };
                    // SAFETY: `blk` is that super-block, `bb` bytes in the row.
                    let blk = unsafe { std::slice::from_raw_parts(blk, bb) };
                    let isum: i32 = (0..QK)
                        .map(|i| super_value(job.ty, blk, b % 8, i) as i32 * qx(i))
                        .sum();
                    acc += isum as f32 * (dw * x.d[s]);
                    acc += mw * x.dsum[s];
                    continue;
                }
                // SAFETY: block `b < nb` of the row is `bb` bytes inside it.
                let blk = unsafe { std::slice::from_raw_parts(wr.add(b * bb), bb) };
                let dw = f16_in(blk, 0);
                if job.ty.unsigned() {
                    let isum: i32 = (0..QK)
                        .map(|i| unsigned_value(job.ty, blk, i) as i32 * qx(i))
                        .sum();
                    acc += isum as f32 * (dw * x.d[s]);
                    acc += min_of(job.ty, blk) * x.dsum[s];
                } else {
                    let isum: i32 = (0..QK).map(|i| blk[2 + i] as i8 as i32 * qx(i)).sum();
                    acc += isum as f32 * (dw * x.d[s]);
                }
            }
            // SAFETY: row `r < x.m`, column `j` of the job's own columns:
            // inside `job.y`, and no one else writes it (the caller's contract).
            unsafe { *job.y.add(r * job.n + j) = acc };
        }
    }
}
