//! Matrix multiply of f32 activations against weights kept in GGUF block
//! formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, the K formats; the four 32-value
//! unsigned ones packed in tiles of 8 rows), computing on the blocks directly.
//!
//! Activations are quantised once per step ([`QActs`]): every 32-value block
//! of a row gets an f32 scale `d = max|x| / 127` and 32 `i8` values
//! `q = round(x / d)`. They are stored interleaved in groups of 8 rows, so
//! that one 256-bit vector holds the same 4 values of a block for 8 rows and
//! the SIMD kernels compute 8 output rows at once, one per lane.
//!
//! Invariant (as in [`crate::kernels`]): every output element is produced by
//! one fixed sequence of floating-point operations on its own inputs. Per
//! block `b` the integer dot `I_b = Σ qw·qx` is exact in i32 (however it is
//! computed: its magnitude stays below 2^20), and then, from `acc = 0` and
//! for `b = 0, 1, ...` in order,
//!
//! - Q8_0 (signed values): `acc = fma(I_b, dw_b * dx_b, acc)`,
//! - the unsigned formats (Q4_0, Q4_1, Q5_0, Q5_1; `x = dw*q + mw` with
//!   `mw` Q4_0's `-8 dw`, Q5_0's `-16 dw`, or the stored minimum): the same,
//!   then `acc = fma(mw_b, dx_b * Σqx_b, acc)`,
//!
//! and `y = acc` (the portable backend rounds the multiply and the add
//! separately instead of fusing them). A vector lane is one output element,
//! never part of one, so the batch size, a row's position in it, the tiling
//! and the thread split change nothing. The AVX2 and AVX-512 VNNI flavours
//! differ only in how they reach the exact `I_b`, so they agree bit for bit
//! and the choice between them cannot show in results.
//!
//! One file per job: [`acts`] quantises the activations, [`matmul`]
//! dispatches the products, [`portable`] and [`simd`] compute them (the
//! latter with [`idot`]'s integer dots and [`regs`]' register pieces), and
//! [`tiled`] the small batches of packed matrices ([`crate::packed`]), on the
//! weight blocks as [`blocks`] reads them (with [`job`]'s per-job
//! descriptors and scratch, and [`flavour`]'s choice of instructions); this
//! file only hands their names on.

mod acts;
mod blocks;
mod flavour;
#[cfg(target_arch = "x86_64")]
mod idot;
mod job;
mod matmul;
mod portable;
#[cfg(target_arch = "x86_64")]
mod regs;
#[cfg(target_arch = "x86_64")]
mod simd;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tiled;

pub use crate::qtype::{QType, QK, QK_K};
pub use acts::QActs;
pub use matmul::{qmatmul_many, qmatmul_many_with, QLinear};
