//! What the engine core needs of a model, as a trait ([`ModelRunner`]), and
//! the real implementation ([`CpuModelRunner`]) over `pdkv_model`'s
//! transformer, KV cache and workspace.
//!
//! The core hands the runner a batch of sequences (their tokens, positions
//! and block tables, as the scheduler planned them) and reads back one logits
//! row per sequence that samples. A simulator implements the trait with a
//! model of its own (deterministic logits, no memory) and drives the real
//! scheduler, lifecycle machine and core logic with it.

use std::path::Path;

use anyhow::Context;
use pdkv_model::loader::{load_weights_like, reload_weights_into, ReloadError};
use pdkv_model::tp::{self, TpModel};
use pdkv_model::{KvCache, KvDtype, Model, SeqInput, Workspace};
use pdkv_vmem::{Backing, Pool, Tag};

use crate::connector::{KvCacheSpec, KvRank};
use crate::scheduler::ScheduledSeq;

/// A model the engine core runs. Called on the core's thread only.
pub trait ModelRunner: Send {
    /// Runs one step: computes (and caches the K/V of) every token in `seqs`
    /// (the scheduler's plan: each sequence's request, new tokens, position
    /// and block table) and writes into `logits`, cleared first,
    /// [`ScheduledSeq::num_logit_rows`] rows of [`ModelRunner::vocab_size`]
    /// per sequence, in order: one for a sequence that samples, one per
    /// token for one with `all_logits`.
    /// An `Err` (or a panic) ends the step's requests with `Abort`; the core
    /// keeps serving.
    fn forward(&mut self, seqs: &[ScheduledSeq], logits: &mut Vec<f32>) -> anyhow::Result<()>;

    /// Entries per logits row; token ids are below it.
    fn vocab_size(&self) -> usize;

    /// Positions the model can encode; the engine's `max_model_len`
    /// defaults to it.
    fn max_context_len(&self) -> usize;

    /// What a KV connector learns of the KV cache (asked once, at start, and
    /// only when the engine has a connector).
    fn kv_cache_spec(&self) -> KvCacheSpec;

    /// Writes the weights of the checkpoint at `path` over the running ones,
    /// in place. The error tells whether anything was written
    /// ([`ReloadError::Partial`]: the weights are unusable until a reload
    /// succeeds) or not (the old weights keep serving).
    fn reload_weights(&mut self, path: &Path) -> Result<(), ReloadError>;

    /// The layout of the whole model's weights, which a weight sync stages
    /// a copy of ([`pdkv_model::weights::Weights::with_region`]): a model
    /// that is not split gives its running weights, a split one the whole
    /// model's layout (over a region that holds none of it); `None` where a
    /// sync cannot be staged.
    fn weights(&self) -> Option<&pdkv_model::weights::Weights> {
        None
    }

    /// Writes `staged` (laid out as [`ModelRunner::weights`], every tensor
    /// already checked) over the running weights, in place; errors as for
    /// [`ModelRunner::reload_weights`].
    fn install_weights(
        &mut self,
        _staged: &pdkv_model::weights::Weights,
    ) -> Result<(), ReloadError> {
        Err(ReloadError::Incompatible(anyhow::anyhow!(
            "this model cannot take staged weights"
        )))
    }
}

/// Where an in-place weight update comes from.
#[derive(Clone, Debug)]
pub enum WeightSource {
    /// A checkpoint on disk (GGUF file or Hugging Face directory).
    Checkpoint(std::path::PathBuf),
    /// Weights a sync staged in memory, laid out as the running ones and
    /// checked tensor by tensor; `origin` names where they came from (what
    /// `/weight_info` reports as the path).
    Staged {
        weights: std::sync::Arc<pdkv_model::weights::Weights>,
        origin: String,
    },
}

impl WeightSource {
    /// What `/weight_info` reports as the weights' path.
    pub fn path(&self) -> std::path::PathBuf {
        match self {
            WeightSource::Checkpoint(p) => p.clone(),
            WeightSource::Staged { origin, .. } => origin.into(),
        }
    }
}

/// The real model: `pdkv_model`'s forward pass over a KV cache and a runtime
/// workspace allocated in the engine's pool.
pub struct CpuModelRunner {
    model: Model,
    kv: KvCache,
    ws: Workspace,
}

impl CpuModelRunner {
    /// Allocates a KV cache of `num_kv_blocks` blocks of `kv_dtype` held
    /// as `backing` says ([`KvCache::new_backed`]) and a workspace for
    /// steps of `max_num_batched_tokens` tokens in `pool`.
    pub fn new(
        model: Model,
        pool: &Pool,
        (num_kv_blocks, kv_dtype, backing): (usize, KvDtype, Backing),
        max_num_batched_tokens: usize,
    ) -> anyhow::Result<CpuModelRunner> {
        let config = model.config();
        let kv = KvCache::new_backed(pool, config, num_kv_blocks, kv_dtype, backing)
            .context("allocating the KV cache")?;
        let ws = Workspace::new(pool, config, max_num_batched_tokens)
            .context("allocating the runtime workspace")?;
        Ok(CpuModelRunner { model, kv, ws })
    }
}

/// The model's inputs for the scheduler's plan, and which sequences want
/// every row's logits.
fn inputs(seqs: &[ScheduledSeq]) -> (Vec<SeqInput<'_>>, Vec<bool>) {
    let inputs = seqs
        .iter()
        .map(|s| SeqInput {
            tokens: &s.tokens,
            start_pos: s.start_pos,
            block_table: &s.block_table,
            want_logits: s.sample,
        })
        .collect();
    (inputs, seqs.iter().map(ScheduledSeq::every_row).collect())
}

/// The KV cache spec of `ranks` (each rank's cache and its first KV head):
/// the layout names the whole model, so engines of any split agree on it.
fn kv_spec(arch: &str, ranks: &[(&KvCache, usize)]) -> KvCacheSpec {
    let kv = ranks[0].0;
    let head_bytes = kv.head_bytes();
    let num_kv_heads: usize = ranks.iter().map(|(k, _)| k.num_kv_heads()).sum();
    KvCacheSpec {
        ranks: ranks
            .iter()
            .map(|&(k, h0)| KvRank {
                region: k.region().clone(),
                heads: h0..h0 + k.num_kv_heads(),
            })
            .collect(),
        num_blocks: kv.num_blocks(),
        block_bytes: head_bytes * num_kv_heads,
        num_kv_heads,
        block_size: kv.block_size(),
        layout: format!(
            "{arch}:layers={}:kv_heads={num_kv_heads}:head_dim={}:block={}:head_major:{}",
            kv.num_layers(),
            kv.kv_dim() / kv.num_kv_heads(),
            kv.block_size(),
            kv.dtype().as_str()
        ),
    }
}

impl ModelRunner for CpuModelRunner {
    fn forward(&mut self, seqs: &[ScheduledSeq], logits: &mut Vec<f32>) -> anyhow::Result<()> {
        let (inputs, every_row) = inputs(seqs);
        self.model
            .forward_with_rows(&self.kv, &mut self.ws, &inputs, &every_row, logits)
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn max_context_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    fn kv_cache_spec(&self) -> KvCacheSpec {
        kv_spec(self.model.config().arch.as_str(), &[(&self.kv, 0)])
    }

    fn reload_weights(&mut self, path: &Path) -> Result<(), ReloadError> {
        let expected = self.model.config().clone();
        reload_weights_into(self.model.weights(), &expected, path, &mut |_| {})
    }

    fn weights(&self) -> Option<&pdkv_model::weights::Weights> {
        Some(self.model.weights())
    }

    fn install_weights(
        &mut self,
        staged: &pdkv_model::weights::Weights,
    ) -> Result<(), ReloadError> {
        let running = self.model.weights();
        if !running.region.is_mapped() {
            return Err(ReloadError::RegionReleased);
        }
        if let Some(d) = running.layout_difference(staged) {
            return Err(ReloadError::Incompatible(anyhow::anyhow!(
                "the new weights are not laid out as the running ones: {d}"
            )));
        }
        // SAFETY: the core calls this between steps, on its own thread:
        // nothing reads the weights meanwhile.
        unsafe { running.copy_from(staged) }.map_err(ReloadError::Partial)
    }
}

/// The model split over tensor-parallel ranks ([`pdkv_model::tp`]), each
/// rank with its KV cache and workspace in its own pool.
pub struct TpModelRunner {
    model: TpModel,
    /// The whole model's layout, for staging a sync (its region is a
    /// placeholder: the whole model is freed once split).
    full_layout: pdkv_model::weights::Weights,
}

impl TpModelRunner {
    /// Splits `model` over `pools.len()` ranks (each gets `num_kv_blocks`
    /// blocks of its KV heads, held as `backing` says, and a workspace for
    /// `max_num_batched_tokens`);
    /// the whole model is dropped after.
    pub fn new(
        model: Model,
        pools: Vec<Pool>,
        num_kv_blocks: (usize, KvDtype, Backing),
        max_num_batched_tokens: usize,
    ) -> anyhow::Result<TpModelRunner> {
        let size = pools.len();
        let placeholder = Pool::default()
            .allocate(Tag::Weights, pdkv_vmem::page_size())
            .context("allocating the layout's placeholder")?;
        let full_layout = pdkv_model::weights::Weights {
            region: placeholder,
            ..model.weights().clone()
        };
        let model = TpModel::new(&model, pools, num_kv_blocks, max_num_batched_tokens)
            .with_context(|| format!("splitting the model over {size} tensor-parallel ranks"))?;
        Ok(TpModelRunner { model, full_layout })
    }
}

impl ModelRunner for TpModelRunner {
    fn forward(&mut self, seqs: &[ScheduledSeq], logits: &mut Vec<f32>) -> anyhow::Result<()> {
        let (inputs, every_row) = inputs(seqs);
        self.model.forward_with_rows(&inputs, &every_row, logits)
    }

    fn vocab_size(&self) -> usize {
        self.model.config().vocab_size
    }

    fn max_context_len(&self) -> usize {
        self.model.config().max_position_embeddings
    }

    /// Every rank's KV cache, with the KV heads it holds.
    fn kv_cache_spec(&self) -> KvCacheSpec {
        let ranks: Vec<(&KvCache, usize)> = self
            .model
            .ranks()
            .iter()
            .map(|r| (&r.kv, r.model.tp().map_or(0, |t| t.shard.kv_heads.start)))
            .collect();
        kv_spec(self.model.config().arch.as_str(), &ranks)
    }

    fn weights(&self) -> Option<&pdkv_model::weights::Weights> {
        Some(&self.full_layout)
    }

    /// Checks every rank's cut of the staged whole weights against its
    /// running weights, and only then writes the ranks.
    fn install_weights(
        &mut self,
        staged: &pdkv_model::weights::Weights,
    ) -> Result<(), ReloadError> {
        let ranks = self.model.ranks();
        if ranks.iter().any(|r| !r.pool.is_awake(Tag::Weights)) {
            return Err(ReloadError::RegionReleased);
        }
        let cfg = self.model.config();
        for r in ranks {
            let shard = &r.model.tp().expect("a rank of the split model").shard;
            tp::check_shard(staged, r.model.weights(), cfg, shard)
                .map_err(ReloadError::Incompatible)?;
        }
        for r in ranks {
            let shard = &r.model.tp().expect("a rank of the split model").shard;
            tp::copy_shard(staged, r.model.weights(), cfg, shard).map_err(ReloadError::Partial)?;
        }
        Ok(())
    }

    /// Reads the whole checkpoint into scratch memory (a Hugging Face one
    /// converted to the running formats), checks every rank's
    /// cut against its running weights, and only then writes the ranks.
    fn reload_weights(&mut self, path: &Path) -> Result<(), ReloadError> {
        let ranks = self.model.ranks();
        if ranks.iter().any(|r| !r.pool.is_awake(Tag::Weights)) {
            return Err(ReloadError::RegionReleased);
        }
        if !path.exists() {
            return Err(ReloadError::Unreadable(anyhow::anyhow!(
                "checkpoint path {} does not exist",
                path.display()
            )));
        }
        let cfg = self.model.config();
        let scratch = Pool::default();
        let full = load_weights_like(path, &self.full_layout, cfg, &scratch, &mut |_| {})
            .map_err(ReloadError::Incompatible)?;
        for r in ranks {
            let shard = &r.model.tp().expect("a rank of the split model").shard;
            tp::check_shard(&full, r.model.weights(), cfg, shard)
                .map_err(ReloadError::Incompatible)?;
        }
        for r in ranks {
            let shard = &r.model.tp().expect("a rank of the split model").shard;
            tp::copy_shard(&full, r.model.weights(), cfg, shard).map_err(ReloadError::Partial)?;
        }
        Ok(())
    }
}
