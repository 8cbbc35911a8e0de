//! What one job of a block-format matmul works on: its columns of one
//! matrix ([`Job`]) and its thread's scratch for unpacked weight rows
//! ([`Scratch`]).

use crate::qtype::{QType, QK};

/// Weight rows per register tile of the SIMD flavours.
pub(super) const NR: usize = 4;

/// Columns `j0..j1` of one matrix's output.
pub(super) struct Job {
    pub(super) ty: QType,
    pub(super) w: *const u8,
    pub(super) y: *mut f32,
    pub(super) n: usize,
    pub(super) j0: usize,
    pub(super) j1: usize,
}

/// Weight rows of one register tile, unpacked once and reused by every
/// activation group: per row `c`, block `b`, the scale `dw[c*nb + b]`, and
/// the 32 values as bytes at `vals[(c*nb + b)*32..]` (an unsigned format's
/// values; Q8_0's plus 128 for VNNI's unsigned operand, or their magnitudes
/// for AVX2's), and an unsigned format's minimum `mw[c*nb + b]`.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) vals: Vec<u8>,
    pub(super) dw: Vec<f32>,
    pub(super) mw: Vec<f32>,
    /// Q6_K's two i8 scales per block.
    pub(super) sc6: Vec<[i32; 2]>,
}

impl Scratch {
    /// Makes room for `rows` weight rows of `nb` blocks (growing only).
    pub(super) fn reserve(&mut self, rows: usize, nb: usize) {
        let grow = |len: usize, want: usize| want.saturating_sub(len);
        self.vals.extend(std::iter::repeat_n(
            0,
            grow(self.vals.len(), rows * nb * QK),
        ));
        self.dw
            .extend(std::iter::repeat_n(0.0, grow(self.dw.len(), rows * nb)));
        self.mw
            .extend(std::iter::repeat_n(0.0, grow(self.mw.len(), rows * nb)));
        self.sc6
            .extend(std::iter::repeat_n([0; 2], grow(self.sc6.len(), rows * nb)));
    }
}
