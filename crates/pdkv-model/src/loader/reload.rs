//! Reloading a checkpoint into a running model's weights region, at the
//! same addresses, after checking everything before the first write.

use std::path::Path;

use anyhow::Context;

use super::from_gguf::{fill_gguf_slot, gguf_config, gguf_quant, precheck_gguf_slot};
use super::from_hf::{hf_config, open_hf_shards, HfShards};
use super::plan::{slot_dst, LoadProgress, WeightsPlan};
use crate::gguf::GgufFile;
use crate::qtype::QType;
use crate::weights::{DType, Weights};
use crate::ModelConfig;

/// Why [`reload_weights_into`] failed.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The checkpoint could not be read (missing path, unparsable config).
    /// Nothing was written.
    #[error("{0:#}")]
    Unreadable(anyhow::Error),
    /// The checkpoint does not fit the running model (architecture, a
    /// hyper-parameter, or a tensor's presence, shape or type). Nothing was
    /// written.
    #[error("{0:#}")]
    Incompatible(anyhow::Error),
    /// The weights region is released (asleep); nothing was written.
    #[error("the weights region is released; wake it before reloading")]
    RegionReleased,
    /// Converting a tensor failed after writing had begun: the region now
    /// holds a mix of old and new tensors and must be reloaded.
    #[error("{0:#}")]
    Partial(anyhow::Error),
}

/// The hyper-parameters that decide the weights' shapes and the math, as
/// `(name, checkpoint value, running value)` for each one that differs.
/// Context length and special token ids are not compared: the running
/// engine keeps its own.
pub(super) fn config_mismatches(
    found: &ModelConfig,
    expected: &ModelConfig,
) -> Vec<(&'static str, String, String)> {
    // Bit patterns for the floats: a reload must not change the math, not
    // even slightly.
    type Show = fn(&ModelConfig) -> String;
    let fields: [(&'static str, Show); 11] = [
        ("arch", |c| c.arch.as_str().into()),
        ("vocab_size", |c| c.vocab_size.to_string()),
        ("hidden_size", |c| c.hidden_size.to_string()),
        ("intermediate_size", |c| c.intermediate_size.to_string()),
        ("num_layers", |c| c.num_layers.to_string()),
        ("num_heads", |c| c.num_heads.to_string()),
        ("num_kv_heads", |c| c.num_kv_heads.to_string()),
        ("head_dim", |c| c.head_dim.to_string()),
        ("tie_word_embeddings", |c| c.tie_word_embeddings.to_string()),
        ("rope_theta", |c| c.rope_theta.to_bits().to_string()),
        ("rms_norm_eps", |c| c.rms_norm_eps.to_bits().to_string()),
    ];
    fields
        .into_iter()
        .map(|(name, show)| (name, show(found), show(expected)))
        .filter(|(_, a, b)| a != b)
        .collect()
}

/// The running model's block format of each matrix, by Hugging Face name:
/// the plan a Hugging Face checkpoint is converted by on a reload.
pub(super) fn running_quant(weights: &Weights) -> impl Fn(&str, &str, usize) -> Option<QType> {
    let formats: std::collections::HashMap<String, QType> = weights
        .named()
        .into_iter()
        .filter_map(|(name, t)| match t.dtype {
            DType::Quant(q) => Some((name, q)),
            DType::F32 => None,
        })
        .collect();
    move |_, hf, _| formats.get(hf).copied()
}

/// Reloads a checkpoint (GGUF file or Hugging Face directory) *into* the
/// weights region of a running model, at the same addresses.
///
/// Everything is validated before the first byte is written: the checkpoint's
/// architecture and hyper-parameters must equal `expected` (the running
/// model's config), and every planned tensor must exist with the running
/// model's shape and a convertible type. On any mismatch the error names the
/// field or tensor and the old weights are untouched. Only then are the
/// tensors converted in place, in the order of the plan.
///
/// A Hugging Face checkpoint (F32, F16 or BF16 tensors) is converted to the
/// running model's format tensor by tensor, whatever that is (f32, F16,
/// BF16, or a block format through [`crate::quantize::quantize_rows`]):
/// the same bytes a fresh load of it in that format
/// ([`super::load_model_as`]) holds. A GGUF file keeps its own formats,
/// which must be the running model's.
///
/// The caller guarantees that nothing reads the weights while this runs (the
/// engine calls it between steps, on the thread that runs the model).
pub fn reload_weights_into(
    weights: &Weights,
    expected: &ModelConfig,
    path: &Path,
    progress: &mut dyn FnMut(&LoadProgress),
) -> Result<(), ReloadError> {
    let source = open_matching(path, expected)?;
    let plan = match &source {
        Source::Hf(_) => WeightsPlan::new(expected, &running_quant(weights)),
        Source::Gguf(g) => WeightsPlan::new(expected, &gguf_quant(g)),
    };
    if !same_layout(&plan, weights) {
        return Err(ReloadError::Incompatible(anyhow::anyhow!(
            "{}",
            format_difference(&plan, weights).unwrap_or_else(|| {
                "the running model's weights are not laid out as its config plans them".into()
            })
        )));
    }
    for slot in &plan.slots {
        let checked = match &source {
            Source::Hf(h) => h.precheck(slot),
            Source::Gguf(g) => precheck_gguf_slot(g, slot),
        };
        checked.map_err(ReloadError::Incompatible)?;
    }
    if !weights.region.is_mapped() {
        return Err(ReloadError::RegionReleased);
    }
    write_slots(weights, expected, &source, &plan, progress)
}

/// Reads the whole checkpoint at `path` (GGUF file or Hugging Face
/// directory, checked against `expected`) into fresh memory laid out as
/// `running` (the running model's weights, or a split model's whole
/// layout), a Hugging Face one converted to the running formats: the
/// weights a reload then copies in after checking their layout, so a read
/// that fails or stalls never touches the running ones. Every file is a
/// regular one ([`crate::checkpoint_file`]). Blocking: call it off any
/// thread that must keep serving.
pub fn stage_checkpoint(
    path: &Path,
    running: &Weights,
    expected: &ModelConfig,
) -> Result<Weights, ReloadError> {
    let meta = std::fs::metadata(path).map_err(|e| {
        ReloadError::Unreadable(anyhow::anyhow!(
            "checkpoint path {} cannot be read: {e}",
            path.display()
        ))
    })?;
    if !meta.is_dir() {
        // Named at once; the load checks the descriptor it opens again.
        crate::checkpoint_file::open(path)
            .map_err(|e| ReloadError::Unreadable(anyhow::anyhow!("checkpoint {e}")))?;
    }
    let scratch = pdkv_vmem::Pool::default();
    super::load_weights_like(path, running, expected, &scratch, &mut |_| {})
        .map_err(ReloadError::Incompatible)
}

/// A checkpoint being reloaded, opened.
enum Source {
    Hf(HfShards),
    Gguf(GgufFile),
}

/// Opens the checkpoint at `path` after checking that its config matches
/// the running model's (`expected`): its architecture and every
/// hyper-parameter that shapes the weights or the math.
fn open_matching(path: &Path, expected: &ModelConfig) -> Result<Source, ReloadError> {
    if !path.exists() {
        return Err(ReloadError::Unreadable(anyhow::anyhow!(
            "checkpoint path {} does not exist",
            path.display()
        )));
    }
    let (cfg, source) = if path.is_dir() {
        let cfg = hf_config(path).map_err(ReloadError::Unreadable)?;
        (cfg, None)
    } else {
        let gguf = GgufFile::open(path)
            .with_context(|| format!("cannot read GGUF {}", path.display()))
            .map_err(ReloadError::Unreadable)?;
        let cfg = gguf_config(&gguf).map_err(ReloadError::Unreadable)?;
        (cfg, Some(Source::Gguf(gguf)))
    };
    let diffs = config_mismatches(&cfg, expected);
    if !diffs.is_empty() {
        let list: Vec<String> = diffs
            .iter()
            .map(|(n, a, b)| format!("{n}: checkpoint has {a}, the running model {b}"))
            .collect();
        return Err(ReloadError::Incompatible(anyhow::anyhow!(
            "checkpoint {} does not match the running model ({})",
            path.display(),
            list.join("; ")
        )));
    }
    Ok(match source {
        Some(s) => s,
        None => Source::Hf(open_hf_shards(path).map_err(ReloadError::Unreadable)?),
    })
}

/// Whether the checkpoint's plan puts every tensor where the running
/// model's weights have it, with the same shape and format, inside the
/// region.
fn same_layout(plan: &WeightsPlan, weights: &Weights) -> bool {
    plan.embed == weights.embed
        && plan.final_norm == weights.final_norm
        && plan.lm_head == weights.lm_head
        && plan.layers.len() == weights.layers.len()
        && plan.layers.iter().zip(&weights.layers).all(|(a, b)| {
            [
                &a.attn_norm,
                &a.wq,
                &a.wk,
                &a.wv,
                &a.wo,
                &a.ffn_norm,
                &a.w_gate,
                &a.w_up,
                &a.w_down,
            ] == [
                &b.attn_norm,
                &b.wq,
                &b.wk,
                &b.wv,
                &b.wo,
                &b.ffn_norm,
                &b.w_gate,
                &b.w_up,
                &b.w_down,
            ] && a.q_norm == b.q_norm
                && a.k_norm == b.k_norm
        })
        && plan.total_bytes <= weights.region.len()
}

/// Names a tensor the checkpoint stores in another format than the running
/// model, if any.
fn format_difference(plan: &WeightsPlan, weights: &Weights) -> Option<String> {
    let running = weights.tensors_by_offset();
    plan.slots.iter().find_map(|s| {
        running
            .iter()
            .find(|t| {
                t.offset == s.dest.offset && t.shape == s.dest.shape && t.dtype != s.dest.dtype
            })
            .map(|t| {
                format!(
                    "the checkpoint stores `{}` as {:?}, the running model as {:?}",
                    s.gguf_name, s.dest.dtype, t.dtype
                )
            })
    })
}

/// Converts every slot of the (checked) plan into the region, in the order
/// of the plan.
fn write_slots(
    weights: &Weights,
    expected: &ModelConfig,
    source: &Source,
    plan: &WeightsPlan,
    progress: &mut dyn FnMut(&LoadProgress),
) -> Result<(), ReloadError> {
    let mut p = plan.progress();
    for slot in &plan.slots {
        // SAFETY: each slot is its own 64-byte-aligned range inside the
        // region (the layout was checked by the caller), and the caller of
        // `reload_weights_into` guarantees that no view of the weights is
        // alive while this runs.
        let dst = unsafe { slot_dst(&weights.region, &slot.dest) };
        let filled = match source {
            Source::Hf(h) => h.fill(slot, dst),
            Source::Gguf(g) => fill_gguf_slot(g, expected, slot, dst),
        };
        filled.map_err(ReloadError::Partial)?;
        p.tensors_done += 1;
        p.bytes_done += slot.dest.bytes() as u64;
        progress(&p);
    }
    Ok(())
}
