//! Weight tensors laid out in one `weights` region of `pdkv-vmem`.
//!
//! Weights are stored row-major, in Hugging Face orientation: a linear layer
//! is `[out_features, in_features]` and computes `y = x W^T`. Norms,
//! embeddings and checkpoints of float types are f32; the linear layers of
//! a GGUF file in a block format the kernels compute on
//! ([`crate::qtype::QType`]) keep the file's blocks, row by row.
//! Q and K projections are in Hugging Face order (rotate-half RoPE); loaders
//! of GGUF files un-permute them on load.

use std::sync::Arc;

use pdkv_vmem::Region;

use crate::qtype::QType;
pub use crate::qtype::{ggml_type, quant_of};
use crate::{Arch, ModelConfig};

/// How a tensor's values are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DType {
    F32,
    /// A matrix in a GGUF block format, each row `QType::row_bytes(cols)` bytes.
    Quant(QType),
}

impl DType {
    /// The name a weight sync's manifest gives the type: `f32`, or the
    /// block format in lower case (`q4_1`, `q8_0`, `q6_k`, `f16`, `bf16`).
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::Quant(q) => match q {
                QType::Q8_0 => "q8_0",
                QType::Q4_0 => "q4_0",
                QType::Q4_1 => "q4_1",
                QType::Q5_0 => "q5_0",
                QType::Q5_0R8 => "q5_0r8",
                QType::Q4_1R8 => "q4_1r8",
                QType::Q4_0R8 => "q4_0r8",
                QType::Q5_1R8 => "q5_1r8",
                QType::Q4_KR8 => "q4_kr8",
                QType::Q5_1 => "q5_1",
                QType::Q4_K => "q4_k",
                QType::Q5_K => "q5_k",
                QType::Q6_K => "q6_k",
                QType::F16 => "f16",
                QType::BF16 => "bf16",
            },
        }
    }
}

/// A tensor inside the weights region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    /// Byte offset in the region (64-byte aligned).
    pub offset: usize,
    /// Row-major shape; `[out, in]` for linear layers, `[n]` for norms.
    pub shape: Vec<usize>,
    pub dtype: DType,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Bytes the tensor takes in the region.
    pub fn bytes(&self) -> usize {
        match self.dtype {
            DType::F32 => self.numel() * 4,
            DType::Quant(q) => {
                let cols = self.shape.last().copied().unwrap_or(1);
                (self.numel() / cols.max(1)) * q.row_bytes(cols)
            }
        }
    }
}

/// A weight matrix as the kernels take it.
#[derive(Clone, Copy)]
pub enum Mat<'a> {
    F32(&'a [f32]),
    Quant(QType, &'a [u8]),
}

#[derive(Clone, Debug)]
pub struct LayerWeights {
    pub attn_norm: TensorRef,
    pub wq: TensorRef,
    pub wk: TensorRef,
    pub wv: TensorRef,
    pub wo: TensorRef,
    /// Qwen3 only: RMSNorm weight over head_dim applied to each q head.
    pub q_norm: Option<TensorRef>,
    /// Qwen3 only: RMSNorm weight over head_dim applied to each k head.
    pub k_norm: Option<TensorRef>,
    pub ffn_norm: TensorRef,
    pub w_gate: TensorRef,
    pub w_up: TensorRef,
    pub w_down: TensorRef,
}

/// One of a layer's tensors: what every list of a layer's tensors (a
/// checkpoint's, a load plan's, a synthetic model's) goes through, in
/// [`LayerTensor::ALL`]'s order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerTensor {
    AttnNorm,
    Q,
    K,
    V,
    O,
    /// Qwen3 only.
    QNorm,
    /// Qwen3 only.
    KNorm,
    FfnNorm,
    Gate,
    Up,
    Down,
}

impl LayerTensor {
    /// Checkpoint order.
    pub const ALL: [LayerTensor; 11] = [
        LayerTensor::AttnNorm,
        LayerTensor::Q,
        LayerTensor::K,
        LayerTensor::V,
        LayerTensor::O,
        LayerTensor::QNorm,
        LayerTensor::KNorm,
        LayerTensor::FfnNorm,
        LayerTensor::Gate,
        LayerTensor::Up,
        LayerTensor::Down,
    ];

    /// The tensors a layer of `arch` has, in checkpoint order.
    pub fn of(arch: Arch) -> impl Iterator<Item = LayerTensor> {
        Self::ALL
            .into_iter()
            .filter(move |t| arch == Arch::Qwen3 || !t.is_head_norm())
    }

    fn is_head_norm(self) -> bool {
        matches!(self, LayerTensor::QNorm | LayerTensor::KNorm)
    }

    /// `(Hugging Face name, GGUF name)` within the layer, without the
    /// `.weight` suffix.
    pub fn names(self) -> (&'static str, &'static str) {
        match self {
            LayerTensor::AttnNorm => ("input_layernorm", "attn_norm"),
            LayerTensor::Q => ("self_attn.q_proj", "attn_q"),
            LayerTensor::K => ("self_attn.k_proj", "attn_k"),
            LayerTensor::V => ("self_attn.v_proj", "attn_v"),
            LayerTensor::O => ("self_attn.o_proj", "attn_output"),
            LayerTensor::QNorm => ("self_attn.q_norm", "attn_q_norm"),
            LayerTensor::KNorm => ("self_attn.k_norm", "attn_k_norm"),
            LayerTensor::FfnNorm => ("post_attention_layernorm", "ffn_norm"),
            LayerTensor::Gate => ("mlp.gate_proj", "ffn_gate"),
            LayerTensor::Up => ("mlp.up_proj", "ffn_up"),
            LayerTensor::Down => ("mlp.down_proj", "ffn_down"),
        }
    }

    /// Its shape: a norm's `[n]`, a linear layer's `[out, in]`.
    pub fn shape(self, cfg: &ModelConfig) -> Vec<usize> {
        let (h, q, kv, ff) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        match self {
            LayerTensor::AttnNorm | LayerTensor::FfnNorm => vec![h],
            LayerTensor::QNorm | LayerTensor::KNorm => vec![cfg.head_dim],
            LayerTensor::Q => vec![q, h],
            LayerTensor::K | LayerTensor::V => vec![kv, h],
            LayerTensor::O => vec![h, q],
            LayerTensor::Gate | LayerTensor::Up => vec![ff, h],
            LayerTensor::Down => vec![h, ff],
        }
    }

    /// A linear layer (a matrix), not a norm.
    pub fn is_linear(self) -> bool {
        !matches!(
            self,
            LayerTensor::AttnNorm | LayerTensor::FfnNorm | LayerTensor::QNorm | LayerTensor::KNorm
        )
    }

    /// Llama's q and k projections: the heads GGUF files interleave for
    /// RoPE (loaders un-permute them); `None` for every other tensor.
    pub fn rope_heads(self, cfg: &ModelConfig) -> Option<usize> {
        match (cfg.arch, self) {
            (Arch::Llama, LayerTensor::Q) => Some(cfg.num_heads),
            (Arch::Llama, LayerTensor::K) => Some(cfg.num_kv_heads),
            _ => None,
        }
    }
}

impl LayerWeights {
    /// A layer of `cfg`'s shape, each tensor made by `make` in checkpoint
    /// order.
    pub fn build(
        cfg: &ModelConfig,
        mut make: impl FnMut(LayerTensor) -> TensorRef,
    ) -> LayerWeights {
        let qwen = cfg.arch == Arch::Qwen3;
        let attn_norm = make(LayerTensor::AttnNorm);
        let wq = make(LayerTensor::Q);
        let wk = make(LayerTensor::K);
        let wv = make(LayerTensor::V);
        let wo = make(LayerTensor::O);
        let q_norm = qwen.then(|| make(LayerTensor::QNorm));
        let k_norm = qwen.then(|| make(LayerTensor::KNorm));
        LayerWeights {
            attn_norm,
            wq,
            wk,
            wv,
            wo,
            q_norm,
            k_norm,
            ffn_norm: make(LayerTensor::FfnNorm),
            w_gate: make(LayerTensor::Gate),
            w_up: make(LayerTensor::Up),
            w_down: make(LayerTensor::Down),
        }
    }

    /// The layer's tensors (Qwen3's head norms when it has them).
    pub fn tensors(&self) -> impl Iterator<Item = &TensorRef> {
        [
            &self.attn_norm,
            &self.wq,
            &self.wk,
            &self.wv,
            &self.wo,
            &self.ffn_norm,
            &self.w_gate,
            &self.w_up,
            &self.w_down,
        ]
        .into_iter()
        .chain([&self.q_norm, &self.k_norm].into_iter().flatten())
    }
}

#[derive(Clone, Debug)]
pub struct Weights {
    pub region: Arc<Region>,
    /// `[vocab, hidden]`
    pub embed: TensorRef,
    pub layers: Vec<LayerWeights>,
    pub final_norm: TensorRef,
    /// `[vocab, hidden]`; the same tensor as `embed` when embeddings are tied.
    pub lm_head: TensorRef,
}

impl Weights {
    /// The f32 contents of a tensor stored as f32.
    pub fn get(&self, t: &TensorRef) -> &[f32] {
        assert_eq!(
            t.dtype,
            DType::F32,
            "tensor at {} of shape {:?} is not stored as f32",
            t.offset,
            t.shape
        );
        // SAFETY: tensors are written once at load time, before any reader
        // exists, and never overlap; offsets are 64-byte aligned.
        unsafe { self.region.slice::<f32>(t.offset, t.numel()) }
    }

    /// A matrix as stored, for the kernels.
    pub fn mat(&self, t: &TensorRef) -> Mat<'_> {
        match t.dtype {
            DType::F32 => Mat::F32(self.get(t)),
            DType::Quant(q) => {
                // SAFETY: as in `get`; the bytes of a block-format tensor.
                Mat::Quant(q, unsafe { self.region.slice::<u8>(t.offset, t.bytes()) })
            }
        }
    }

    /// Row `r` of a matrix as f32 values (block formats dequantised).
    pub fn row_f32(&self, t: &TensorRef, r: usize) -> Vec<f32> {
        let mut out = vec![0f32; t.shape.last().copied().unwrap_or(1)];
        self.row_into(t, r, &mut out);
        out
    }

    /// Writes row `r` of a matrix into `out` (its width) as f32 values.
    pub fn row_into(&self, t: &TensorRef, r: usize, out: &mut [f32]) {
        let cols = t.shape.last().copied().unwrap_or(1);
        match self.mat(t) {
            Mat::F32(v) => out.copy_from_slice(&v[r * cols..(r + 1) * cols]),
            Mat::Quant(q, b) => {
                let rb = q.row_bytes(cols);
                let mut unpacked = Vec::new();
                let row = if q.packed() {
                    unpacked.resize(rb, 0);
                    crate::packed::row_into(q, b, cols, r, &mut unpacked);
                    &unpacked[..]
                } else {
                    &b[r * rb..(r + 1) * rb]
                };
                crate::gguf::dequantize(ggml_type(q), row, out).expect("a stored row dequantises");
            }
        }
    }

    /// Every tensor with its Hugging Face name, in the region's order (the
    /// LM head only when it is not the embedding table itself): what a
    /// weight sync publishes and pulls.
    pub fn named(&self) -> Vec<(String, &TensorRef)> {
        let mut v = vec![("model.embed_tokens.weight".to_string(), &self.embed)];
        for (i, l) in self.layers.iter().enumerate() {
            let f = |n: &str| format!("model.layers.{i}.{n}.weight");
            v.push((f("input_layernorm"), &l.attn_norm));
            v.push((f("self_attn.q_proj"), &l.wq));
            v.push((f("self_attn.k_proj"), &l.wk));
            v.push((f("self_attn.v_proj"), &l.wv));
            v.push((f("self_attn.o_proj"), &l.wo));
            if let Some(t) = &l.q_norm {
                v.push((f("self_attn.q_norm"), t));
            }
            if let Some(t) = &l.k_norm {
                v.push((f("self_attn.k_norm"), t));
            }
            v.push((f("post_attention_layernorm"), &l.ffn_norm));
            v.push((f("mlp.gate_proj"), &l.w_gate));
            v.push((f("mlp.up_proj"), &l.w_up));
            v.push((f("mlp.down_proj"), &l.w_down));
        }
        v.push(("model.norm.weight".to_string(), &self.final_norm));
        if self.lm_head != self.embed {
            v.push(("lm_head.weight".to_string(), &self.lm_head));
        }
        v.sort_by_key(|(_, t)| t.offset);
        v
    }

    /// Bytes the layout spans: the end of its last tensor, 64-aligned.
    pub fn layout_bytes(&self) -> usize {
        self.named()
            .iter()
            .map(|(_, t)| t.offset + t.bytes())
            .max()
            .unwrap_or(0)
            .div_ceil(64)
            * 64
    }

    /// The same layout over another region (of at least
    /// [`Weights::layout_bytes`]), for staging a whole set of weights beside
    /// the running ones.
    pub fn with_region(&self, region: Arc<Region>) -> Weights {
        assert!(
            region.len() >= self.layout_bytes(),
            "a staging region of {} bytes for weights of {}",
            region.len(),
            self.layout_bytes()
        );
        Weights {
            region,
            ..self.clone()
        }
    }

    /// How `other` is laid out differently from these weights: the first
    /// tensor whose name, dtype, shape or offset differs (`None`: the same
    /// layout).
    pub fn layout_difference(&self, other: &Weights) -> Option<String> {
        let (mine, theirs) = (self.named(), other.named());
        if mine.len() != theirs.len() {
            return Some(format!("{} tensors against {}", theirs.len(), mine.len()));
        }
        let (a, b) = mine.iter().zip(&theirs).find(|(a, b)| a != b)?;
        Some(if a.0 != b.0 {
            format!("`{}` where `{}` is expected", b.0, a.0)
        } else {
            format!(
                "`{}` is {:?} {:?} at {}, the running model's {:?} {:?} at {}",
                b.0, b.1.dtype, b.1.shape, b.1.offset, a.1.dtype, a.1.shape, a.1.offset
            )
        })
    }

    /// Copies every tensor's bytes from `src`, a set of weights of the
    /// same layout (see [`Weights::with_region`]), into this region.
    ///
    /// # Safety
    /// Nothing may read these weights meanwhile (the engine calls it
    /// between steps, on the thread that runs the model).
    pub unsafe fn copy_from(&self, src: &Weights) -> anyhow::Result<()> {
        if let Some(d) = self.layout_difference(src) {
            anyhow::bail!("the staged weights are not laid out as the running ones: {d}");
        }
        let mine = self.named();
        for (_, t) in &mine {
            let n = t.bytes();
            // SAFETY: both tensors lie inside their regions (the layouts are
            // equal and each region holds its layout); the regions differ.
            let from = unsafe { std::slice::from_raw_parts(src.region.base().add(t.offset), n) };
            self.region.write_bytes(t.offset, from)?;
        }
        Ok(())
    }

    /// Every tensor, for comparisons of layouts.
    pub fn tensors_by_offset(&self) -> Vec<&TensorRef> {
        let mut v = vec![&self.embed, &self.final_norm, &self.lm_head];
        v.extend(self.layers.iter().flat_map(LayerWeights::tensors));
        v.sort_by_key(|t| t.offset);
        v
    }

    /// Bytes of all weights in the region (what a level-1 sleep backs up).
    pub fn bytes_total(&self) -> usize {
        let head = if self.lm_head != self.embed {
            self.lm_head.bytes()
        } else {
            0
        };
        self.embed.bytes() + head + self.final_norm.bytes() + self.layer_bytes()
    }

    /// Bytes of weights that one decode step reads (each tensor once; the
    /// embedding table is read only as the LM head).
    pub fn bytes_read_per_token(&self) -> usize {
        self.lm_head.bytes() + self.final_norm.bytes() + self.layer_bytes()
    }

    /// Bytes of every layer's tensors.
    fn layer_bytes(&self) -> usize {
        let tensors = self.layers.iter().flat_map(LayerWeights::tensors);
        tensors.map(TensorRef::bytes).sum()
    }
}

/// Builds a weights region: tensors are appended with 64-byte alignment.
pub struct WeightsLayout {
    next: usize,
}

impl Default for WeightsLayout {
    fn default() -> Self {
        Self::new()
    }
}

impl WeightsLayout {
    pub fn new() -> Self {
        WeightsLayout { next: 0 }
    }

    /// Reserves space for a tensor of `shape` and returns where it goes.
    pub fn push(&mut self, shape: &[usize]) -> TensorRef {
        self.push_typed(shape, DType::F32)
    }

    /// Reserves space for a tensor of `shape` stored as `dtype`.
    pub fn push_typed(&mut self, shape: &[usize], dtype: DType) -> TensorRef {
        let offset = self.next;
        let t = TensorRef {
            offset,
            shape: shape.to_vec(),
            dtype,
        };
        self.next = (offset + t.bytes()).div_ceil(64) * 64;
        t
    }

    /// Total bytes needed so far.
    pub fn total_bytes(&self) -> usize {
        self.next.max(64)
    }
}
