//! The GGUF block formats the kernels compute on ([`QType`]): their block
//! sizes and byte layouts, and how they map to and from GGUF's types.
//!
//! A leaf below the kernels and the weights: it imports only the GGUF
//! reader's type names.

/// Values per quantisation block.
pub const QK: usize = 32;
/// Values per super-block of the K formats.
pub const QK_K: usize = 256;

/// A GGUF block format the kernels read directly.
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    /// 256-value super-blocks of 8 sub-blocks of 32, each with a 6-bit scale
    /// and minimum under the super-block's f16 `d` and `dmin`.
    Q4_K,
    /// Q4_K with a fifth bit per value.
    Q5_K,
    /// 256-value super-blocks of signed 6-bit values (`q - 32`) with an i8
    /// scale per 16 values under one f16 `d`.
    Q6_K,
    /// IEEE half floats, no scales (seen as blocks of 32 values). The int8
    /// kernels do not take them: they multiply f32 activations, converted
    /// in registers (`kernels::matmul_blocks_many`), with the f32 path's bits.
    F16,
    /// bfloat16, as [`QType::F16`].
    BF16,
    /// Q5_0 with each tile of 8 rows packed by block ([`crate::packed`]):
    /// the same bytes in another order, as the loader keeps Q5_0 matrices.
    /// Not a GGUF type: [`QType::gguf`] names the rows it unpacks to.
    Q5_0R8,
    /// Q4_1 packed as [`QType::Q5_0R8`] packs Q5_0.
    Q4_1R8,
    /// Q4_0 packed likewise.
    Q4_0R8,
    /// Q5_1 packed likewise.
    Q5_1R8,
    /// Q4_K with each tile of 8 rows packed by super-block
    /// ([`crate::packed`]): the same values, scales and minimums.
    Q4_KR8,
}

impl QType {
    /// Every integer block format (what the int8 kernels read).
    pub const INT: [QType; 8] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
        QType::Q4_K,
        QType::Q5_K,
        QType::Q6_K,
    ];

    /// The 32-value block formats, in the order of [`QType::INT`] (for
    /// tests and dispatch tables).
    pub const ALL: [QType; 5] = [
        QType::Q8_0,
        QType::Q4_0,
        QType::Q4_1,
        QType::Q5_0,
        QType::Q5_1,
    ];

    /// Bytes of one block as stored: Q8_0 34 (f16 d, 32 x i8); Q4_0 18 (f16
    /// d, 16 bytes of nibbles); Q4_1 20 (f16 d, f16 m, nibbles); Q5_0 22 (f16
    /// d, 32 fifth bits, nibbles); Q5_1 24 (f16 d, f16 m, fifth bits,
    /// nibbles); Q4_K 144 per 256 values (f16 d, f16 dmin, 12 bytes of
    /// scales and minimums, 128 bytes of nibbles); Q5_K 176 (the same with
    /// 32 bytes of fifth bits before the nibbles); Q6_K 210 (128 bytes of
    /// low nibbles, 64 of high bit pairs, 16 i8 scales, f16 d last).
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q4_0 | QType::Q4_0R8 => 18,
            QType::Q4_1 | QType::Q4_1R8 => 20,
            QType::Q5_0 | QType::Q5_0R8 => 22,
            QType::Q5_1 | QType::Q5_1R8 => 24,
            QType::Q4_K | QType::Q4_KR8 => 144,
            QType::Q5_K => 176,
            QType::Q6_K => 210,
            QType::F16 | QType::BF16 => 64,
        }
    }

    /// Values per stored block: 32, or 256 for a super-block format.
    pub fn block_values(self) -> usize {
        if self.is_super() {
            QK_K
        } else {
            QK
        }
    }

    /// Whether the values are 16-bit floats (F16, BF16): no int8 kernels.
    pub fn is_half(self) -> bool {
        matches!(self, QType::F16 | QType::BF16)
    }

    /// Whether the rows are packed in tiles ([`QType::Q5_0R8`] and the
    /// other `R8`s): readers other than the kernels made for them take
    /// [`QType::gguf`] rows ([`crate::packed::gguf_rows`]).
    pub fn packed(self) -> bool {
        matches!(
            self,
            QType::Q5_0R8 | QType::Q4_1R8 | QType::Q4_0R8 | QType::Q5_1R8 | QType::Q4_KR8
        )
    }

    /// The GGUF format of the rows: the packed format's unpacked rows'.
    pub fn gguf(self) -> QType {
        match self {
            QType::Q5_0R8 => QType::Q5_0,
            QType::Q4_1R8 => QType::Q4_1,
            QType::Q4_0R8 => QType::Q4_0,
            QType::Q5_1R8 => QType::Q5_1,
            QType::Q4_KR8 => QType::Q4_K,
            q => q,
        }
    }

    /// The format a loaded matrix of this format keeps: the 32-value
    /// unsigned formats and Q4_K packed, every other as it is.
    pub fn loaded(self) -> QType {
        match self {
            QType::Q5_0 => QType::Q5_0R8,
            QType::Q4_1 => QType::Q4_1R8,
            QType::Q4_0 => QType::Q4_0R8,
            QType::Q5_1 => QType::Q5_1R8,
            QType::Q4_K => QType::Q4_KR8,
            q => q,
        }
    }

    /// Whether rows are 256-value super-blocks (Q4_K, Q5_K, Q6_K, and
    /// packed Q4_K).
    pub fn is_super(self) -> bool {
        matches!(
            self,
            QType::Q4_K | QType::Q5_K | QType::Q6_K | QType::Q4_KR8
        )
    }

    /// Offset in a block of the 16 bytes of low nibbles (all but Q8_0):
    /// value `i < 16` is the low nibble of byte `i`, value `i + 16` its high one.
    pub(crate) fn nibbles_at(self) -> usize {
        match self {
            QType::Q8_0 => unreachable!("Q8_0 has whole bytes"),
            QType::Q4_0 => 2,
            QType::Q4_1 => 4,
            QType::Q5_0 => 6,
            QType::Q5_1 => 8,
            QType::Q4_K | QType::Q5_K | QType::Q6_K => {
                unreachable!("{self:?} keeps its nibbles per super-block")
            }
            QType::F16 | QType::BF16 => unreachable!("{self:?} has no nibbles"),
            QType::Q5_0R8 | QType::Q4_1R8 | QType::Q4_0R8 | QType::Q5_1R8 | QType::Q4_KR8 => {
                unreachable!("packed rows are read unpacked")
            }
        }
    }

    /// Offset of the 32 fifth bits (bit `i` of the little-endian u32 is
    /// value `i`'s bit 4), for Q5_0 and Q5_1.
    pub(crate) fn high_bits_at(self) -> Option<usize> {
        match self {
            QType::Q5_0 => Some(2),
            QType::Q5_1 => Some(4),
            q if q.packed() => unreachable!("packed rows are read unpacked"),
            _ => None,
        }
    }

    /// Whether the block stores its minimum as an f16 after the scale
    /// (Q4_1, Q5_1); Q4_0's and Q5_0's minimums are `-8d` and `-16d`.
    pub(crate) fn stored_min(self) -> bool {
        matches!(
            self,
            QType::Q4_1 | QType::Q5_1 | QType::Q4_1R8 | QType::Q5_1R8
        )
    }

    /// The factor `f` of `mw = f * d` for Q4_0 (-8) and Q5_0 (-16).
    pub(crate) fn min_factor(self) -> f32 {
        match self {
            QType::Q4_0 | QType::Q4_0R8 => -8.0,
            QType::Q5_0 | QType::Q5_0R8 => -16.0,
            _ => unreachable!("{self:?} stores its minimum"),
        }
    }

    /// Unsigned values `q` with `x = d*q + mw`: every format but Q8_0
    /// (signed, `x = d*q`) and Q6_K (its own kernels: two scales a block).
    pub(crate) fn unsigned(self) -> bool {
        !matches!(self, QType::Q8_0 | QType::Q6_K)
    }

    /// Bytes of one row of `k` values (k a multiple of
    /// [`QType::block_values`]).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }
}

/// The GGUF type of a block format (of its [`QType::gguf`] rows).
pub fn ggml_type(q: QType) -> crate::gguf::GgmlType {
    match q {
        QType::Q8_0 => crate::gguf::GgmlType::Q8_0,
        QType::Q4_0 | QType::Q4_0R8 => crate::gguf::GgmlType::Q4_0,
        QType::Q4_1 | QType::Q4_1R8 => crate::gguf::GgmlType::Q4_1,
        // Of the rows unpacked (`crate::packed::gguf_rows`).
        QType::Q5_0 | QType::Q5_0R8 => crate::gguf::GgmlType::Q5_0,
        QType::Q5_1 | QType::Q5_1R8 => crate::gguf::GgmlType::Q5_1,
        QType::Q4_K | QType::Q4_KR8 => crate::gguf::GgmlType::Q4_K,
        QType::Q5_K => crate::gguf::GgmlType::Q5_K,
        QType::Q6_K => crate::gguf::GgmlType::Q6_K,
        QType::F16 => crate::gguf::GgmlType::F16,
        QType::BF16 => crate::gguf::GgmlType::BF16,
    }
}

/// The block format of a GGUF type the kernels compute on, if any.
pub fn quant_of(t: crate::gguf::GgmlType) -> Option<QType> {
    match t {
        crate::gguf::GgmlType::Q8_0 => Some(QType::Q8_0),
        crate::gguf::GgmlType::Q4_0 => Some(QType::Q4_0),
        crate::gguf::GgmlType::Q4_1 => Some(QType::Q4_1),
        crate::gguf::GgmlType::Q5_0 => Some(QType::Q5_0),
        crate::gguf::GgmlType::Q5_1 => Some(QType::Q5_1),
        crate::gguf::GgmlType::Q4_K => Some(QType::Q4_K),
        crate::gguf::GgmlType::Q5_K => Some(QType::Q5_K),
        crate::gguf::GgmlType::Q6_K => Some(QType::Q6_K),
        crate::gguf::GgmlType::F16 => Some(QType::F16),
        crate::gguf::GgmlType::BF16 => Some(QType::BF16),
        _ => None,
    }
}
