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
//! - [`attend`]: per (query, head) one pass over positions `0..=p` in order,
//!   by segments of [`SEGMENT`] positions and tiles of [`KEY_TILE`] in each:
//!   scores, their maximum, the exponentials and their sum, then the
//!   probability-weighted sum of V rows in position order; each segment
//!   folded into the total in position order, whichever thread computed it.
//! - norms act on one row at a time, its squares summed in one fixed order
//!   on every CPU (eight f64 accumulators, then a fixed fold and the tail);
//!   RoPE and SiLU act element by element, SiLU's exponential the
//!   softmax's polynomial in every lane and the tail.
//!
//! The SIMD flavour ([`Backend`]) is chosen once per process, so all rows of
//! all steps go through the same code.
//!
//! The kernels live in one file per job: [`matmul`] (f32 weights: the
//! register tiles every other path reproduces), [`blocks`] (block-format
//! weights times f32 activations), [`attention`] (paged causal attention)
//! and [`rows`] (per-row kernels); this file only hands their names on.

pub(crate) mod attention;
pub(crate) mod blocks;
pub(crate) mod elem;
mod expf;
pub(crate) mod matmul;
mod rows;
#[cfg(test)]
pub(crate) mod tests;
#[cfg(target_arch = "x86_64")]
mod tile512;

pub use crate::dispatch::{backend, thread_pool, Backend};
pub use attention::{
    attend, attend_many, attend_segment, finish, fold, AttendArgs, AttnQuery, PagedRows, Total,
    KEY_TILE, SEGMENT,
};
pub use blocks::{matmul_blocks_many, matmul_blocks_many_with, BlockLinear};
pub use elem::{KvElem, Q8Byte, Q8_BLOCK, Q8_BLOCK_BYTES};
pub use matmul::{dot, matmul, matmul_many, matmul_many_with, Linear};
pub use rows::{rmsnorm, rmsnorm_inplace, rope_apply, rope_cos_sin, rope_inv_freq, silu_mul};
