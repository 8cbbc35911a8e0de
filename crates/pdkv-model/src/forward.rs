//! The transformer forward pass over a batch of sequences with paged KV.

use pdkv_vmem::Pool;

use crate::kv::KvCache;
use crate::weights::Weights;
use crate::ModelConfig;

/// One sequence's part of a step.
#[derive(Clone, Debug)]
pub struct SeqInput<'a> {
    /// Tokens to compute now (a prefill chunk, or the one decode token).
    pub tokens: &'a [u32],
    /// Number of tokens of this sequence already in the KV cache; `tokens[0]`
    /// sits at position `start_pos`.
    pub start_pos: usize,
    /// Block ids covering positions `0 .. start_pos + tokens.len()`.
    pub block_table: &'a [u32],
    /// Produce logits for the last token of `tokens`.
    pub want_logits: bool,
}

/// A loaded model: config plus weights in a `weights` region.
pub struct Model {
    config: ModelConfig,
    weights: Weights,
}

/// Scratch memory for a step, in a `runtime` region.
pub struct Workspace {
    _private: (),
}

impl Workspace {
    /// Scratch for steps of up to `max_tokens` tokens.
    pub fn new(_pool: &Pool, _cfg: &ModelConfig, _max_tokens: usize) -> anyhow::Result<Workspace> {
        todo!()
    }
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights) -> Model {
        Model { config, weights }
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn weights(&self) -> &Weights {
        &self.weights
    }

    /// Runs one step. Writes K/V of every token in `seqs` into its blocks and
    /// appends to `logits` one `vocab_size` row per sequence with
    /// `want_logits`, in order. `logits` is cleared first.
    pub fn forward(
        &self,
        _kv: &KvCache,
        _ws: &mut Workspace,
        _seqs: &[SeqInput<'_>],
        _logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        todo!()
    }
}
