//! What a publisher announces: every tensor's name, type, shape, place in
//! its registration and checksum, and how to reach the registration.

use std::collections::{HashMap, HashSet};

use pdkv_model::weights::{TensorRef, Weights};
use serde::{Deserialize, Serialize};

/// The manifest's format; a puller refuses another.
pub const PROTOCOL: u32 = 1;

/// A publisher's set of tensors, as `GET /manifest` answers it (JSON).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub protocol: u32,
    /// The version the trainer gives these weights (`/weight_info` reports
    /// it after the switch unless `finish_weight_update` names another).
    pub version: Option<String>,
    /// Where the publisher's transfer agent serves one-sided reads (TCP,
    /// `host:port`).
    pub transfer_addr: String,
    /// The registration that holds every tensor.
    pub segment: u64,
    pub key: u64,
    pub epoch: u64,
    /// The same registration over shared memory, for engines on the
    /// publisher's host (absent: TCP only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shm: Option<ShmEndpoint>,
    pub tensors: Vec<TensorEntry>,
}

/// Where a publisher shares its registration's memfds (a Unix socket
/// speaking the transfer engine's shared-memory protocol), and the
/// registration's whole length (what a map request names).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShmEndpoint {
    pub path: String,
    pub len: u64,
}

/// One tensor of a [`Manifest`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorEntry {
    /// The Hugging Face name (`model.layers.0.self_attn.q_proj.weight`).
    pub name: String,
    /// `f32`, or a GGUF block format in lower case (`q4_1`, `q8_0`, ...):
    /// the bytes are the rows as the engine stores them; or `f32`, `f16`,
    /// `bf16` values as a trainer holds them (Hugging Face order), which the
    /// engine converts to its own type while it pulls.
    pub dtype: String,
    /// Row-major, `[out, in]` for linear layers.
    pub shape: Vec<usize>,
    /// Where the bytes lie in the registration.
    pub offset: u64,
    pub len: u64,
    /// CRC-32 (IEEE, as zlib's `crc32`) of the bytes.
    pub crc32: u32,
}

impl Manifest {
    /// Total bytes of every tensor.
    pub fn bytes(&self) -> u64 {
        self.tensors.iter().map(|t| t.len).sum()
    }
}

/// The checksum of a tensor's bytes.
pub fn checksum(bytes: &[u8]) -> u32 {
    crc32fast::hash(bytes)
}

/// Why a manifest does not fit the running model. Every message names the
/// tensor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MismatchError {
    #[error("the publisher speaks manifest protocol {0}, this engine {PROTOCOL}")]
    Protocol(u32),
    #[error("tensor `{0}` is published twice")]
    Duplicate(String),
    #[error("the publisher has no tensor `{0}`, which the model needs")]
    Missing(String),
    #[error("the publisher's tensor `{0}` is not one of the model's")]
    Unknown(String),
    #[error("tensor `{name}`: the publisher's type is {published}, the model stores {expected} (a tensor comes as the model stores it, or as f32, f16 or bf16 to convert)")]
    DType {
        name: String,
        published: String,
        expected: String,
    },
    #[error("tensor `{name}`: the publisher's shape is {published:?}, the model's {expected:?}")]
    Shape {
        name: String,
        published: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("tensor `{name}`: the publisher announces {published} bytes, its type and shape take {expected}")]
    Len {
        name: String,
        published: u64,
        expected: u64,
    },
}

/// Whether the tensor published as `e` is converted into `dest`'s type
/// (published as a trainer holds it: `f32`, `f16` or `bf16` where the model
/// stores another type) rather than copied as it is.
pub fn converts(e: &TensorEntry, dest: &TensorRef) -> bool {
    e.dtype != dest.dtype.name()
}

/// Matches every tensor of `manifest` to the tensor of `layout` it
/// replaces, checking names, types, shapes and sizes: all of the model's
/// tensors must be published, and nothing else. A tensor comes either as
/// the model stores it, or as a trainer holds it (`f32`, `f16`, `bf16`,
/// Hugging Face order) for the puller to convert ([`converts`]). The pairs
/// come in the layout's order.
pub fn plan<'a>(
    manifest: &'a Manifest,
    layout: &'a Weights,
) -> Result<Vec<(&'a TensorEntry, TensorRef)>, MismatchError> {
    if manifest.protocol != PROTOCOL {
        return Err(MismatchError::Protocol(manifest.protocol));
    }
    let mut by_name: HashMap<&str, &TensorEntry> = HashMap::new();
    for t in &manifest.tensors {
        if by_name.insert(t.name.as_str(), t).is_some() {
            return Err(MismatchError::Duplicate(t.name.clone()));
        }
    }
    let named = layout.named();
    let known: HashSet<&str> = named.iter().map(|(n, _)| n.as_str()).collect();
    if let Some(t) = manifest
        .tensors
        .iter()
        .find(|t| !known.contains(t.name.as_str()))
    {
        return Err(MismatchError::Unknown(t.name.clone()));
    }
    let mut out = Vec::with_capacity(named.len());
    for (name, dest) in named {
        let Some(&e) = by_name.get(name.as_str()) else {
            return Err(MismatchError::Missing(name));
        };
        let source = pdkv_model::safetensors::Dtype::from_sync_name(&e.dtype);
        let converted = converts(e, dest);
        if converted && source.is_none() {
            return Err(MismatchError::DType {
                name,
                published: e.dtype.clone(),
                expected: dest.dtype.name().into(),
            });
        }
        if e.shape != dest.shape {
            return Err(MismatchError::Shape {
                name,
                published: e.shape.clone(),
                expected: dest.shape.clone(),
            });
        }
        let expected = match source {
            Some(d) if converted => (dest.numel() * d.size()) as u64,
            _ => dest.bytes() as u64,
        };
        if e.len != expected {
            return Err(MismatchError::Len {
                name,
                published: e.len,
                expected,
            });
        }
        out.push((e, dest.clone()));
    }
    Ok(out)
}
