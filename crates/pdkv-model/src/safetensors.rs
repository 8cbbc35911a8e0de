//! Reading and writing the safetensors format.
//!
//! A file is `u64 LE header length | JSON header | data`. The header maps
//! tensor names to `{"dtype", "shape", "data_offsets": [begin, end]}`, with
//! offsets relative to the start of the data; an optional `__metadata__`
//! entry holds string pairs.
//!
//! Invariant: a parsed [`SafetensorsFile`] only lists tensors whose byte
//! range lies inside the file and matches their dtype and shape.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context};
use half::{bf16, f16};
use serde_json::Value;

/// Element types this reader converts to f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    F32,
    F16,
    BF16,
}

impl Dtype {
    /// A weight sync's name for the type (`f32`, `f16`, `bf16`).
    pub fn from_sync_name(s: &str) -> Option<Dtype> {
        Some(match s {
            "f32" => Dtype::F32,
            "f16" => Dtype::F16,
            "bf16" => Dtype::BF16,
            _ => return None,
        })
    }

    fn parse(s: &str) -> Option<Dtype> {
        Some(match s {
            "F32" => Dtype::F32,
            "F16" => Dtype::F16,
            "BF16" => Dtype::BF16,
            _ => return None,
        })
    }

    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
        }
    }

    /// The name the header gives the dtype.
    pub fn name(self) -> &'static str {
        match self {
            Dtype::F32 => "F32",
            Dtype::F16 => "F16",
            Dtype::BF16 => "BF16",
        }
    }

    /// Widens little-endian values of this dtype into `out` (exact: every
    /// F16 and BF16 value is an f32). `bytes` holds `out.len()` values.
    pub fn decode(self, bytes: &[u8], out: &mut [f32]) {
        assert_eq!(
            bytes.len(),
            out.len() * self.size(),
            "bytes for {} values",
            out.len()
        );
        match self {
            Dtype::F32 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
                }
            }
            Dtype::F16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
            Dtype::BF16 => {
                for (o, b) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = bf16::from_le_bytes([b[0], b[1]]).to_f32();
                }
            }
        }
    }

    /// Narrows `values` to this dtype (rounded to nearest, as `half`
    /// rounds), appending their little-endian bytes to `out`.
    pub fn encode(self, values: &[f32], out: &mut Vec<u8>) {
        out.reserve(values.len() * self.size());
        for &v in values {
            match self {
                Dtype::F32 => out.extend_from_slice(&v.to_le_bytes()),
                Dtype::F16 => out.extend_from_slice(&f16::from_f32(v).to_le_bytes()),
                Dtype::BF16 => out.extend_from_slice(&bf16::from_f32(v).to_le_bytes()),
            }
        }
    }
}

#[derive(Clone, Debug)]
pub struct TensorEntry {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub end: usize,
}

/// A memory-mapped safetensors file.
pub struct SafetensorsFile {
    map: memmap2::Mmap,
    pub tensors: BTreeMap<String, TensorEntry>,
}

/// Header size limit; real headers are well under a few MB.
const MAX_HEADER: u64 = 100 << 20;

impl SafetensorsFile {
    pub fn open(path: &Path) -> anyhow::Result<SafetensorsFile> {
        let file = crate::checkpoint_file::open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: read-only mapping of a checkpoint file.
        let map = unsafe { memmap2::Mmap::map(&file) }
            .with_context(|| format!("cannot map {}", path.display()))?;
        let tensors = parse_header(&map)
            .with_context(|| format!("{} is not a valid safetensors file", path.display()))?;
        Ok(SafetensorsFile { map, tensors })
    }

    /// A tensor's bytes as stored, with their dtype.
    pub fn raw(&self, name: &str) -> Option<(&[u8], Dtype)> {
        let e = self.tensors.get(name)?;
        Some((&self.map[e.start..e.end], e.dtype))
    }

    /// Converts a tensor to f32 into `out` (which must hold exactly its
    /// elements).
    pub fn read_f32(&self, name: &str, out: &mut [f32]) -> anyhow::Result<()> {
        let e = self
            .tensors
            .get(name)
            .with_context(|| format!("no tensor `{name}`"))?;
        let bytes = &self.map[e.start..e.end];
        if bytes.len() != out.len() * e.dtype.size() {
            bail!(
                "tensor `{name}` has {} bytes, expected {}",
                bytes.len(),
                out.len() * e.dtype.size()
            );
        }
        e.dtype.decode(bytes, out);
        Ok(())
    }
}

fn parse_header(buf: &[u8]) -> anyhow::Result<BTreeMap<String, TensorEntry>> {
    let len_bytes: [u8; 8] = buf
        .get(..8)
        .context("file shorter than 8 bytes")?
        .try_into()?;
    let hlen = u64::from_le_bytes(len_bytes);
    if hlen > MAX_HEADER || 8 + hlen > buf.len() as u64 {
        bail!(
            "header length {hlen} does not fit the file of {} bytes",
            buf.len()
        );
    }
    let data_start = 8 + hlen as usize;
    let header: BTreeMap<String, Value> =
        serde_json::from_slice(&buf[8..data_start]).context("header is not a JSON object")?;
    let data_len = buf.len() - data_start;
    let mut out = BTreeMap::new();
    for (name, v) in header {
        if name == "__metadata__" {
            continue;
        }
        let dtype_s = v["dtype"]
            .as_str()
            .with_context(|| format!("tensor `{name}` has no dtype"))?;
        let dtype = Dtype::parse(dtype_s).with_context(|| {
            format!("tensor `{name}` has dtype {dtype_s}; only F32, F16 and BF16 are supported")
        })?;
        let shape: Vec<usize> = v["shape"]
            .as_array()
            .and_then(|a| a.iter().map(|d| d.as_u64().map(|d| d as usize)).collect())
            .with_context(|| format!("tensor `{name}` has no valid shape"))?;
        let offs: Vec<u64> = v["data_offsets"]
            .as_array()
            .and_then(|a| a.iter().map(Value::as_u64).collect())
            .with_context(|| format!("tensor `{name}` has no valid data_offsets"))?;
        let [b, e] = offs[..] else {
            bail!("tensor `{name}` data_offsets must have two entries");
        };
        let numel = shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .with_context(|| format!("tensor `{name}` has an impossible shape {shape:?}"))?;
        if b > e || e > data_len as u64 || (e - b) != (numel * dtype.size()) as u64 {
            bail!("tensor `{name}` byte range {b}..{e} does not match shape {shape:?} {dtype_s} within {data_len} data bytes");
        }
        out.insert(
            name,
            TensorEntry {
                dtype,
                shape,
                start: data_start + b as usize,
                end: data_start + e as usize,
            },
        );
    }
    Ok(out)
}

/// Writes f32 tensors as a safetensors file, in the given order. The header
/// is padded with spaces to a multiple of 8 bytes so the data is aligned.
pub fn write_f32(path: &Path, tensors: &[(String, Vec<usize>, Vec<f32>)]) -> anyhow::Result<()> {
    write_as(path, tensors, Dtype::F32)
}

/// Writes tensors as a safetensors file of `dtype` (values rounded to
/// nearest, as `half` rounds), in the given order; see [`write_f32`].
pub fn write_as(
    path: &Path,
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    dtype: Dtype,
) -> anyhow::Result<()> {
    let shapes: Vec<(String, Vec<usize>)> = tensors
        .iter()
        .map(|(name, shape, _)| (name.clone(), shape.clone()))
        .collect();
    write_with(path, dtype, &shapes, &mut |i, buf| {
        buf.clear();
        buf.extend_from_slice(&tensors[i].2);
        Ok(())
    })?;
    Ok(())
}

/// Writes a safetensors file of `dtype` one tensor at a time, so that no
/// more than one tensor's values are held: `tensors` names each tensor
/// and its shape, in file order, and `values(i, buf)` puts tensor `i`'s
/// values (as many as its shape holds) into `buf`. Returns the bytes
/// written. The header is padded with spaces to a multiple of 8 bytes so
/// the data is aligned.
pub fn write_with(
    path: &Path,
    dtype: Dtype,
    tensors: &[(String, Vec<usize>)],
    values: &mut dyn FnMut(usize, &mut Vec<f32>) -> anyhow::Result<()>,
) -> anyhow::Result<u64> {
    let mut header = serde_json::Map::new();
    let mut offset = 0usize;
    for (name, shape) in tensors {
        let end = offset + shape.iter().product::<usize>() * dtype.size();
        let entry = serde_json::json!({"dtype": dtype.name(), "shape": shape, "data_offsets": [offset, end]});
        if header.insert(name.clone(), entry).is_some() {
            bail!("tensor `{name}` is listed twice");
        }
        offset = end;
    }
    header.insert("__metadata__".into(), serde_json::json!({"format": "pt"}));
    let mut hbytes = serde_json::to_vec(&Value::Object(header))?;
    while hbytes.len() % 8 != 0 {
        hbytes.push(b' ');
    }
    let file =
        std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    w.write_all(&(hbytes.len() as u64).to_le_bytes())?;
    w.write_all(&hbytes)?;
    let (mut buf, mut bytes) = (Vec::new(), Vec::new());
    for (i, (name, shape)) in tensors.iter().enumerate() {
        values(i, &mut buf)?;
        let n: usize = shape.iter().product();
        if buf.len() != n {
            bail!(
                "tensor `{name}` has {} values for shape {shape:?}",
                buf.len()
            );
        }
        bytes.clear();
        dtype.encode(&buf, &mut bytes);
        w.write_all(&bytes)
            .with_context(|| format!("cannot write {}", path.display()))?;
    }
    w.flush()
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(8 + hbytes.len() as u64 + offset as u64)
}
