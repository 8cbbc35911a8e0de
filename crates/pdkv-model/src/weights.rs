//! Weight tensors laid out in one `weights` region of `pdkv-vmem`.
//!
//! All weights are stored as f32, row-major, in Hugging Face orientation:
//! a linear layer is `[out_features, in_features]` and computes `y = x W^T`.
//! Q and K projections are in Hugging Face order (rotate-half RoPE); loaders
//! of GGUF files un-permute them on load.

use std::sync::Arc;

use pdkv_vmem::Region;

/// A tensor inside the weights region.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorRef {
    /// Byte offset in the region (64-byte aligned).
    pub offset: usize,
    /// Row-major shape; `[out, in]` for linear layers, `[n]` for norms.
    pub shape: Vec<usize>,
}

impl TensorRef {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
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
    /// The f32 contents of a tensor.
    pub fn get(&self, t: &TensorRef) -> &[f32] {
        // SAFETY: tensors are written once at load time, before any reader
        // exists, and never overlap; offsets are 64-byte aligned.
        unsafe { self.region.slice::<f32>(t.offset, t.numel()) }
    }

    /// Bytes of weights that one decode step reads (each tensor once; the
    /// embedding table is read only as the LM head).
    pub fn bytes_read_per_token(&self) -> usize {
        let mut n = self.lm_head.numel() + self.final_norm.numel();
        for l in &self.layers {
            for t in [&l.attn_norm, &l.wq, &l.wk, &l.wv, &l.wo, &l.ffn_norm, &l.w_gate, &l.w_up, &l.w_down] {
                n += t.numel();
            }
            for t in [&l.q_norm, &l.k_norm].into_iter().flatten() {
                n += t.numel();
            }
        }
        n * 4
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
        let offset = self.next;
        let bytes = shape.iter().product::<usize>() * 4;
        self.next = (offset + bytes).div_ceil(64) * 64;
        TensorRef { offset, shape: shape.to_vec() }
    }

    /// Total bytes needed so far.
    pub fn total_bytes(&self) -> usize {
        self.next.max(64)
    }
}
