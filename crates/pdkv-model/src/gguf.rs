//! A reader for GGUF files (versions 2 and 3) and dequantisation to f32.
//!
//! Layout of a GGUF file, all little-endian:
//! `magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count |
//!  kv_count × (string key, u32 type, value) |
//!  tensor_count × (string name, u32 n_dims, n_dims × u64 dim, u32 ggml_type, u64 offset) |
//!  padding to `general.alignment` | data section`.
//! Strings are `u64 length + UTF-8 bytes`. Tensor offsets are relative to the
//! start of the data section.
//!
//! Invariants: parsing never panics on malformed input (every read is
//! bounds-checked and every count is checked against the bytes left before
//! anything is allocated); a parsed [`GgufFile`] only holds tensors whose
//! data lies entirely inside the file.
//!
//! GGUF lists dimensions innermost first: a tensor with dims `[in, out]` is a
//! row-major `[out, in]` matrix. [`GgufTensorInfo::shape`] gives the row-major
//! (outermost-first) shape.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use half::f16;

use crate::safetensors::Dtype;

/// Why a GGUF file could not be read or a tensor not be dequantised.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("not a GGUF file (bad magic)")]
    BadMagic,
    #[error("unsupported GGUF version {0} (2 and 3 are supported)")]
    UnsupportedVersion(u32),
    #[error("GGUF file is truncated or malformed: {0}")]
    Malformed(String),
    #[error("tensor `{tensor}` has ggml type {ty}, which this reader cannot dequantise")]
    UnsupportedType { tensor: String, ty: GgmlType },
    #[error("i/o error reading {path}: {source}")]
    Io {
        path: String,
        #[source]
        source: std::io::Error,
    },
}

type Result<T> = std::result::Result<T, GgufError>;

fn malformed(msg: impl Into<String>) -> GgufError {
    GgufError::Malformed(msg.into())
}

/// A ggml tensor element type, as stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GgmlType(pub u32);

impl GgmlType {
    pub const F32: GgmlType = GgmlType(0);
    pub const F16: GgmlType = GgmlType(1);
    pub const Q4_0: GgmlType = GgmlType(2);
    pub const Q4_1: GgmlType = GgmlType(3);
    pub const Q5_0: GgmlType = GgmlType(6);
    pub const Q5_1: GgmlType = GgmlType(7);
    pub const Q8_0: GgmlType = GgmlType(8);
    pub const Q4_K: GgmlType = GgmlType(12);
    pub const Q5_K: GgmlType = GgmlType(13);
    pub const Q6_K: GgmlType = GgmlType(14);
    pub const BF16: GgmlType = GgmlType(30);

    /// The name ggml uses for this type, when known.
    pub fn name(self) -> Option<&'static str> {
        Some(match self.0 {
            0 => "F32",
            1 => "F16",
            2 => "Q4_0",
            3 => "Q4_1",
            6 => "Q5_0",
            7 => "Q5_1",
            8 => "Q8_0",
            9 => "Q8_1",
            10 => "Q2_K",
            11 => "Q3_K",
            12 => "Q4_K",
            13 => "Q5_K",
            14 => "Q6_K",
            15 => "Q8_K",
            24 => "I8",
            25 => "I16",
            26 => "I32",
            27 => "I64",
            28 => "F64",
            30 => "BF16",
            _ => return None,
        })
    }

    /// `(elements per block, bytes per block)` of every type whose storage
    /// size this reader knows, so that any tensor's extent can be checked.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        Some(match self.0 {
            0 => (1, 4),
            1 | 30 => (1, 2),
            2 => (32, 18),
            3 => (32, 20),
            6 => (32, 22),
            7 => (32, 24),
            8 => (32, 34),
            9 => (32, 36),
            10 => (256, 84),
            11 => (256, 110),
            12 => (256, 144),
            13 => (256, 176),
            14 => (256, 210),
            15 => (256, 292),
            24 => (1, 1),
            25 => (1, 2),
            26 => (1, 4),
            27 | 28 => (1, 8),
            _ => return None,
        })
    }

    /// Whether [`dequantize`] handles this type.
    pub fn can_dequantize(self) -> bool {
        matches!(
            self,
            GgmlType::F32
                | GgmlType::F16
                | GgmlType::BF16
                | GgmlType::Q4_0
                | GgmlType::Q4_1
                | GgmlType::Q5_0
                | GgmlType::Q5_1
                | GgmlType::Q8_0
                | GgmlType::Q4_K
                | GgmlType::Q5_K
                | GgmlType::Q6_K
        )
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => write!(f, "{n}"),
            None => write!(f, "#{}", self.0),
        }
    }
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum GgufValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<GgufValue>),
}

impl GgufValue {
    /// The value as an unsigned integer, if it is a non-negative integer.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            GgufValue::U8(v) => Some(v.into()),
            GgufValue::U16(v) => Some(v.into()),
            GgufValue::U32(v) => Some(v.into()),
            GgufValue::U64(v) => Some(v),
            GgufValue::I8(v) => u64::try_from(v).ok(),
            GgufValue::I16(v) => u64::try_from(v).ok(),
            GgufValue::I32(v) => u64::try_from(v).ok(),
            GgufValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as a signed integer.
    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            GgufValue::I8(v) => Some(v.into()),
            GgufValue::I16(v) => Some(v.into()),
            GgufValue::I32(v) => Some(v.into()),
            GgufValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    /// The value as a float (integers convert too).
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            GgufValue::F32(v) => Some(v.into()),
            GgufValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            GgufValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            GgufValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[GgufValue]> {
        match self {
            GgufValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// Where a tensor lives and what it holds.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// Dimensions as stored: innermost first.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Byte offset from the start of the data section.
    pub offset: u64,
}

impl GgufTensorInfo {
    /// Row-major shape, outermost first (`[out, in]` for a linear layer).
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }

    pub fn numel(&self) -> u64 {
        self.dims.iter().product()
    }

    /// Bytes of the tensor's data, or `None` if its type is unknown or its
    /// row length is not a whole number of blocks.
    pub fn byte_len(&self) -> Option<u64> {
        let (block, bytes) = self.ty.block_layout()?;
        let row = *self.dims.first().unwrap_or(&1);
        if !row.is_multiple_of(block as u64) {
            return None;
        }
        (self.numel() / block as u64).checked_mul(bytes as u64)
    }
}

enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// A parsed GGUF file: metadata, tensor directory, and the bytes behind it.
pub struct GgufFile {
    pub version: u32,
    pub metadata: BTreeMap<String, GgufValue>,
    pub tensors: Vec<GgufTensorInfo>,
    /// Absolute offset of the data section.
    pub data_offset: usize,
    pub alignment: usize,
    backing: Backing,
}

impl fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GgufFile")
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .field("data_offset", &self.data_offset)
            .finish()
    }
}

/// Bounds-checked little-endian cursor.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| {
                malformed(format!(
                    "unexpected end of file reading {what} at byte {}",
                    self.pos
                ))
            })?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let s = self.take(N, what)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// A count that must fit in what is left of the file, given that each
    /// counted item takes at least `min_item_bytes`.
    fn count(&mut self, what: &str, min_item_bytes: usize) -> Result<usize> {
        let n = self.u64(what)?;
        let max = (self.remaining() / min_item_bytes.max(1)) as u64;
        if n > max {
            return Err(malformed(format!(
                "{what} {n} exceeds what the file can hold"
            )));
        }
        Ok(n as usize)
    }

    fn string(&mut self, what: &str) -> Result<String> {
        let len = self.count(what, 1)?;
        let bytes = self.take(len, what)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| malformed(format!("{what} is not valid UTF-8")))
    }

    fn value(&mut self, ty: u32, depth: usize) -> Result<GgufValue> {
        Ok(match ty {
            0 => GgufValue::U8(self.array::<1>("u8")?[0]),
            1 => GgufValue::I8(self.array::<1>("i8")?[0] as i8),
            2 => GgufValue::U16(u16::from_le_bytes(self.array("u16")?)),
            3 => GgufValue::I16(i16::from_le_bytes(self.array("i16")?)),
            4 => GgufValue::U32(self.u32("u32")?),
            5 => GgufValue::I32(i32::from_le_bytes(self.array("i32")?)),
            6 => GgufValue::F32(f32::from_le_bytes(self.array("f32")?)),
            7 => match self.array::<1>("bool")?[0] {
                0 => GgufValue::Bool(false),
                1 => GgufValue::Bool(true),
                b => return Err(malformed(format!("bool value {b}"))),
            },
            8 => GgufValue::String(self.string("string")?),
            9 => {
                if depth > 8 {
                    return Err(malformed("arrays nested too deeply"));
                }
                let elem_ty = self.u32("array type")?;
                let min = match elem_ty {
                    0 | 1 | 7 => 1,
                    2 | 3 => 2,
                    4..=6 => 4,
                    8 | 10 | 11 | 12 => 8,
                    9 => 12,
                    t => return Err(malformed(format!("unknown metadata value type {t}"))),
                };
                let n = self.count("array length", min)?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem_ty, depth + 1)?);
                }
                GgufValue::Array(items)
            }
            10 => GgufValue::U64(self.u64("u64")?),
            11 => GgufValue::I64(i64::from_le_bytes(self.array("i64")?)),
            12 => GgufValue::F64(f64::from_le_bytes(self.array("f64")?)),
            t => return Err(malformed(format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file, mapping it read-only.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let io = |source| GgufError::Io {
            path: path.display().to_string(),
            source,
        };
        let file = crate::checkpoint_file::open(path).map_err(io)?;
        // SAFETY: the mapping is read-only; a checkpoint file being rewritten
        // while loaded is outside what a loader can defend against.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        Self::parse(Backing::Mapped(map))
    }

    /// Parses a GGUF image held in memory.
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile> {
        Self::parse(Backing::Owned(bytes))
    }

    fn parse(backing: Backing) -> Result<GgufFile> {
        let buf = backing.bytes();
        let mut c = Cursor { buf, pos: 0 };
        if c.take(4, "magic").map_err(|_| GgufError::BadMagic)? != b"GGUF" {
            return Err(GgufError::BadMagic);
        }
        let version = c.u32("version")?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::UnsupportedVersion(version));
        }
        // A tensor info is at least 8 (name len) + 4 + 4 + 8 bytes; a kv at
        // least 8 (key len) + 4 (type) + 1.
        let tensor_count = c.u64("tensor count")?;
        let kv_count = c.count("metadata count", 13)?;
        let mut metadata = BTreeMap::new();
        for _ in 0..kv_count {
            let key = c.string("metadata key")?;
            let ty = c.u32("metadata type")?;
            let value = c.value(ty, 0)?;
            metadata.insert(key, value);
        }
        if tensor_count > (c.remaining() / 24) as u64 {
            return Err(malformed(format!(
                "tensor count {tensor_count} exceeds what the file can hold"
            )));
        }
        let mut tensors = Vec::with_capacity(tensor_count as usize);
        for _ in 0..tensor_count {
            let name = c.string("tensor name")?;
            let n_dims = c.u32("tensor rank")?;
            if n_dims > 8 {
                return Err(malformed(format!("tensor `{name}` has rank {n_dims}")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64("tensor dim")?);
            }
            if dims
                .iter()
                .try_fold(1u64, |acc, &d| acc.checked_mul(d))
                .is_none()
            {
                return Err(malformed(format!(
                    "tensor `{name}` has an impossible shape {dims:?}"
                )));
            }
            let ty = GgmlType(c.u32("tensor type")?);
            let offset = c.u64("tensor offset")?;
            tensors.push(GgufTensorInfo {
                name,
                dims,
                ty,
                offset,
            });
        }
        let alignment = match metadata.get("general.alignment") {
            None => 32,
            Some(v) => match v.as_u64() {
                Some(a) if a > 0 && a.is_power_of_two() && a <= 1 << 20 => a as usize,
                _ => {
                    return Err(malformed(format!(
                        "general.alignment {v:?} is not a power of two"
                    )))
                }
            },
        };
        let data_offset = c.pos.div_ceil(alignment) * alignment;
        let data_len = buf.len().saturating_sub(data_offset) as u64;
        for t in &tensors {
            if t.offset % alignment as u64 != 0 {
                return Err(malformed(format!(
                    "tensor `{}` offset {} is not aligned",
                    t.name, t.offset
                )));
            }
            let len = match t.byte_len() {
                Some(len) => len,
                // A tensor of a type newer than this reader: its extent is
                // unknown, so it is kept and refused only if its data is asked for.
                None if t.ty.block_layout().is_none() => continue,
                None => {
                    return Err(malformed(format!(
                        "tensor `{}` of type {} has rows of {} values, not whole blocks",
                        t.name,
                        t.ty,
                        t.dims.first().copied().unwrap_or(1)
                    )))
                }
            };
            if t.offset.checked_add(len).is_none_or(|end| end > data_len) {
                return Err(malformed(format!(
                    "tensor `{}` ({} bytes at {}) runs past the end of the file",
                    t.name, len, t.offset
                )));
            }
        }
        Ok(GgufFile {
            version,
            metadata,
            tensors,
            data_offset,
            alignment,
            backing,
        })
    }

    pub fn get(&self, key: &str) -> Option<&GgufValue> {
        self.metadata.get(key)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(GgufValue::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(GgufValue::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(GgufValue::as_f64)
    }

    /// An array of strings (such as `tokenizer.ggml.tokens`).
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(GgufValue::as_str)
            .collect()
    }

    pub fn tensor(&self, name: &str) -> Option<&GgufTensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw bytes of a tensor.
    pub fn tensor_data(&self, t: &GgufTensorInfo) -> Result<&[u8]> {
        let len = t.byte_len().ok_or_else(|| GgufError::UnsupportedType {
            tensor: t.name.clone(),
            ty: t.ty,
        })?;
        let start = self.data_offset as u64 + t.offset;
        let bytes = self.backing.bytes();
        // Bounds were checked at parse time; check again rather than trust.
        let end = start
            .checked_add(len)
            .filter(|&e| e <= bytes.len() as u64)
            .ok_or_else(|| {
                malformed(format!("tensor `{}` runs past the end of the file", t.name))
            })?;
        Ok(&bytes[start as usize..end as usize])
    }

    /// Dequantises a whole tensor into `out` (row-major, `numel` values).
    pub fn dequantize_into(&self, t: &GgufTensorInfo, out: &mut [f32]) -> Result<()> {
        let data = self.tensor_data(t)?;
        if out.len() as u64 != t.numel() {
            return Err(malformed(format!(
                "tensor `{}` has {} values, destination holds {}",
                t.name,
                t.numel(),
                out.len()
            )));
        }
        dequantize(t.ty, data, out).map_err(|e| match e {
            GgufError::UnsupportedType { ty, .. } => GgufError::UnsupportedType {
                tensor: t.name.clone(),
                ty,
            },
            e => e,
        })
    }

    /// Dequantises a 2-D tensor row by row, writing stored row `r` to
    /// destination row `row_map(r)`. `row_map` must be a permutation of
    /// `0..rows`.
    pub fn dequantize_rows_into(
        &self,
        t: &GgufTensorInfo,
        out: &mut [f32],
        row_map: &(dyn Fn(usize) -> usize + Sync),
    ) -> Result<()> {
        use rayon::prelude::*;
        let data = self.tensor_data(t)?;
        let shape = t.shape();
        let [rows, cols] = shape[..] else {
            return Err(malformed(format!(
                "tensor `{}` is not 2-D: {:?}",
                t.name, shape
            )));
        };
        if out.len() != rows * cols {
            return Err(malformed(format!(
                "tensor `{}` does not fit its destination",
                t.name
            )));
        }
        let (block, block_bytes) =
            t.ty.block_layout()
                .filter(|_| t.ty.can_dequantize())
                .ok_or_else(|| GgufError::UnsupportedType {
                    tensor: t.name.clone(),
                    ty: t.ty,
                })?;
        let row_bytes = cols / block * block_bytes;
        if cols == 0 || rows == 0 {
            return Ok(());
        }
        // Pair each stored row with its destination slice, then dequantise
        // the rows in parallel.
        let mut slots: Vec<Option<&mut [f32]>> = out.chunks_mut(cols).map(Some).collect();
        let mut ordered: Vec<&mut [f32]> = Vec::with_capacity(rows);
        for r in 0..rows {
            let slot = slots
                .get_mut(row_map(r))
                .and_then(Option::take)
                .ok_or_else(|| {
                    malformed(format!("row map for `{}` is not a permutation", t.name))
                })?;
            ordered.push(slot);
        }
        ordered
            .into_par_iter()
            .enumerate()
            .try_for_each(|(r, slot)| {
                dequantize(t.ty, &data[r * row_bytes..(r + 1) * row_bytes], slot)
            })
    }
}

/// Scale and minimum (6 bits each) of sub-block `j` (0..8) of a Q4_K/Q5_K
/// super-block: sub-blocks 0..4 in the low 6 bits of bytes `j` and `j+4`,
/// 4..8 in the nibbles of bytes `j+4` with their top 2 bits in the top
/// bits of bytes `j-4` and `j`.
pub(crate) fn k_scale_min(s: &[u8; 12], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 63, s[j + 4] & 63)
    } else {
        (
            (s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4,
            (s[j + 4] >> 4) | (s[j] >> 6) << 4,
        )
    }
}

/// Value `l` (0..32, unsigned) of sub-block `sub` (0..8) of a Q4_K (or,
/// `five`, Q5_K) super-block `b`: the low (`sub` even) or high nibble of
/// byte `32*(sub/2) + l` of the nibbles, plus 16 where bit `sub` of
/// fifth-bit byte `l` is set.
pub(crate) fn k45_value(b: &[u8], five: bool, sub: usize, l: usize) -> u8 {
    let q = b[if five { 48 } else { 16 } + sub / 2 * 32 + l];
    let v = if sub.is_multiple_of(2) {
        q & 0x0f
    } else {
        q >> 4
    };
    if five {
        v | (b[16 + l] >> sub & 1) << 4
    } else {
        v
    }
}

/// Value `i` (0..256, unsigned 6 bits) of a Q6_K super-block `b`. In each
/// 128-value half, value `32*g + l` (g = 0..4) takes its low nibble from
/// byte `l` (g even) or `l + 32` (g odd) of the half's 64 bytes of `ql`,
/// the low nibble for g < 2 and the high one after; its top 2 bits are bits
/// `2g..2g+2` of byte `l` of the half's 32 bytes of `qh`.
pub(crate) fn k6_value(b: &[u8], i: usize) -> u8 {
    let (half, r) = (i / 128, i % 128);
    let (g, l) = (r / 32, r % 32);
    let ql = b[half * 64 + l + (g % 2) * 32];
    let lo = if g < 2 { ql & 0x0f } else { ql >> 4 };
    let hi = (b[128 + half * 32 + l] >> (2 * g)) & 3;
    lo | hi << 4
}

/// Dequantises `data` of type `ty` into `out`; `out.len()` values must be a
/// whole number of blocks and `data` exactly their size.
pub fn dequantize(ty: GgmlType, data: &[u8], out: &mut [f32]) -> Result<()> {
    let unsupported = GgufError::UnsupportedType {
        tensor: String::new(),
        ty,
    };
    let (block, block_bytes) = ty
        .block_layout()
        .filter(|_| ty.can_dequantize())
        .ok_or(unsupported)?;
    if !out.len().is_multiple_of(block) || data.len() != out.len() / block * block_bytes {
        return Err(malformed(format!(
            "{} bytes of {ty} cannot hold exactly {} values",
            data.len(),
            out.len()
        )));
    }
    match ty {
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 => dequantize_floats(ty, data, out),
        GgmlType::Q8_0 => dequantize_q8_0(data, out),
        GgmlType::Q4_0 => dequantize_q4_0(data, out),
        GgmlType::Q4_1 => dequantize_q4_1(data, out),
        GgmlType::Q5_0 | GgmlType::Q5_1 => dequantize_q5(ty == GgmlType::Q5_1, data, out),
        GgmlType::Q4_K | GgmlType::Q5_K => dequantize_k45(ty == GgmlType::Q5_K, data, out),
        GgmlType::Q6_K => dequantize_q6_k(data, out),
        _ => unreachable!("can_dequantize admits exactly the types above"),
    }
    Ok(())
}

/// The f16 at byte `i` of `b`, exactly.
fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

/// F32, F16 and BF16 values, widened exactly (as a safetensors file's
/// values of the same type are).
fn dequantize_floats(ty: GgmlType, data: &[u8], out: &mut [f32]) {
    let dtype = match ty {
        GgmlType::F32 => Dtype::F32,
        GgmlType::F16 => Dtype::F16,
        GgmlType::BF16 => Dtype::BF16,
        _ => unreachable!("{ty} is not a float type"),
    };
    dtype.decode(data, out)
}

/// Q8_0: f16 scale d, then 32 signed bytes: x = d * q.
fn dequantize_q8_0(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(34)) {
        let d = f16_at(b, 0);
        for (x, &q) in o.iter_mut().zip(&b[2..34]) {
            *x = d * f32::from(q as i8);
        }
    }
}

/// Q4_0: f16 scale d, then 16 bytes of nibbles: value j < 16 is the low
/// nibble of byte j, value j >= 16 the high nibble of byte j-16;
/// x = d * (q - 8).
fn dequantize_q4_0(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(18)) {
        let d = f16_at(b, 0);
        for (j, &q) in b[2..18].iter().enumerate() {
            o[j] = d * (f32::from(q & 0x0f) - 8.0);
            o[j + 16] = d * (f32::from(q >> 4) - 8.0);
        }
    }
}

/// Q4_1: f16 scale d, f16 minimum m, then nibbles as in Q4_0; x = d*q + m.
fn dequantize_q4_1(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(20)) {
        let d = f16_at(b, 0);
        let m = f16_at(b, 2);
        for (j, &q) in b[4..20].iter().enumerate() {
            o[j] = d * f32::from(q & 0x0f) + m;
            o[j + 16] = d * f32::from(q >> 4) + m;
        }
    }
}

/// Q5_0 and (`one`) Q5_1: f16 d, (Q5_1) f16 m, 32 fifth bits, 16 bytes of
/// low nibbles laid out as in Q4_0; Q5_0 x = d*(q - 16), Q5_1 x = d*q + m.
fn dequantize_q5(one: bool, data: &[u8], out: &mut [f32]) {
    let bb = if one { 24 } else { 22 };
    for (o, b) in out.chunks_exact_mut(32).zip(data.chunks_exact(bb)) {
        let d = f16_at(b, 0);
        let m = if one { f16_at(b, 2) } else { 0.0 };
        let h = if one { 4 } else { 2 };
        let qh = u32::from_le_bytes([b[h], b[h + 1], b[h + 2], b[h + 3]]);
        for (j, &q) in b[h + 4..h + 20].iter().enumerate() {
            let lo = (q & 0x0f) as u32 | ((qh >> j) & 1) << 4;
            let hi = (q >> 4) as u32 | ((qh >> (j + 16)) & 1) << 4;
            if one {
                o[j] = d * lo as f32 + m;
                o[j + 16] = d * hi as f32 + m;
            } else {
                o[j] = d * (lo as f32 - 16.0);
                o[j + 16] = d * (hi as f32 - 16.0);
            }
        }
    }
}

/// Q4_K and (`five`) Q5_K: super-blocks of 256: f16 d, f16 dmin, 12 bytes
/// of 6-bit scales and minimums for 8 sub-blocks of 32, (Q5_K) 32 bytes of
/// fifth bits, 128 bytes of nibbles (a 64-value chunk's 32 bytes hold
/// sub-block 2i in the low nibbles, 2i+1 in the high ones);
/// x = d*sc*q - dmin*m.
fn dequantize_k45(five: bool, data: &[u8], out: &mut [f32]) {
    let bb = if five { 176 } else { 144 };
    for (o, b) in out.chunks_exact_mut(256).zip(data.chunks_exact(bb)) {
        let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
        let scales: &[u8; 12] = b[4..16].try_into().expect("12 bytes");
        for sub in 0..8 {
            let (sc, mn) = k_scale_min(scales, sub);
            let (dl, ml) = (d * sc as f32, dmin * mn as f32);
            for l in 0..32 {
                o[sub * 32 + l] = dl * k45_value(b, five, sub, l) as f32 - ml;
            }
        }
    }
}

/// Q6_K: super-blocks of 256: 128 bytes of low nibbles, 64 bytes of high
/// 2-bit pairs, 16 i8 scales (one per 16 values), f16 d;
/// x = d*sc*(q - 32).
fn dequantize_q6_k(data: &[u8], out: &mut [f32]) {
    for (o, b) in out.chunks_exact_mut(256).zip(data.chunks_exact(210)) {
        let d = f16_at(b, 208);
        for i in 0..256 {
            let q = k6_value(b, i);
            let sc = b[192 + i / 16] as i8;
            o[i] = d * sc as f32 * (q as f32 - 32.0);
        }
    }
}
