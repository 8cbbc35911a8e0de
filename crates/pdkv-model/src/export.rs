//! Writing a loaded model as a Hugging Face checkpoint directory, the
//! format RL trainers hold: `config.json`, `generation_config.json`,
//! `tokenizer.json`, `tokenizer_config.json` (with the chat template) and
//! `model.safetensors` in BF16 under Hugging Face tensor names.
//!
//! Every tensor is read from the weights region as the model serves it
//! (block formats dequantised, as [`Weights::row_into`] does) and rounded
//! to bf16; Q/K rows are already in Hugging Face order in memory. The
//! directory loads back through [`crate::loader`] with the same config and
//! tokenizer.

use std::path::{Path, PathBuf};

use anyhow::Context;
use rayon::prelude::*;
use serde_json::{json, Value};

use crate::init::{hf_config_json, write_json};
use crate::safetensors::{write_with, Dtype};
use crate::weights::{DType, TensorRef, Weights};
use crate::{LoadProgress, LoadedModel};

/// What [`export_hf`] wrote.
#[derive(Clone, Debug)]
pub struct ExportSummary {
    pub dir: PathBuf,
    /// Tensors in `model.safetensors`.
    pub tensors: usize,
    /// Bytes of `model.safetensors`.
    pub weights_bytes: u64,
    /// Bytes of every file written.
    pub total_bytes: u64,
}

/// Writes `loaded` as a Hugging Face checkpoint directory `out` (created
/// if needed; files of the same names are replaced), reporting each
/// tensor written to `progress`.
pub fn export_hf(
    loaded: &LoadedModel,
    out: &Path,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<ExportSummary> {
    std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
    let cfg = loaded.model.config();
    let tok = &loaded.tokenizer;
    let mut config = hf_config_json(cfg);
    config["torch_dtype"] = json!("bfloat16");
    config["eos_token_id"] = match cfg.eos_token_ids[..] {
        [one] => json!(one),
        ref ids => json!(ids),
    };
    write_json(&out.join("config.json"), &config)?;
    write_json(
        &out.join("generation_config.json"),
        &json!({"bos_token_id": cfg.bos_token_id, "eos_token_id": cfg.eos_token_ids}),
    )?;
    let text = |id: Option<u32>| id.and_then(|id| tok.id_to_token(id));
    let mut tc = json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": text(tok.bos_token_id()),
        "eos_token": text(tok.eos_token_ids().first().copied()),
        "clean_up_tokenization_spaces": false,
        "model_max_length": cfg.max_position_embeddings,
    });
    if let Some(t) = &loaded.chat_template {
        tc["chat_template"] = Value::String(t.source().to_string());
    }
    write_json(&out.join("tokenizer_config.json"), &tc)?;
    let tok_json = tok
        .inner()
        .to_string(false)
        .map_err(|e| anyhow::anyhow!("cannot serialise the tokenizer: {e}"))?;
    let tok_path = out.join("tokenizer.json");
    std::fs::write(&tok_path, tok_json)
        .with_context(|| format!("cannot write {}", tok_path.display()))?;

    let (tensors, weights_bytes) = write_bf16_weights(
        loaded.model.weights(),
        &out.join("model.safetensors"),
        progress,
    )?;
    let mut total_bytes = weights_bytes;
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "tokenizer.json",
    ] {
        total_bytes += std::fs::metadata(out.join(f))?.len();
    }
    Ok(ExportSummary {
        dir: out.to_path_buf(),
        tensors,
        weights_bytes,
        total_bytes,
    })
}

/// Writes every tensor of `w` under its Hugging Face name (the LM head only
/// when it is not the embedding table) to the safetensors file `path` in
/// BF16. Returns the tensors and bytes written.
pub fn write_bf16_weights(
    w: &Weights,
    path: &Path,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<(usize, u64)> {
    let named = w.named();
    let shapes: Vec<(String, Vec<usize>)> = named
        .iter()
        .map(|(name, t)| (name.clone(), t.shape.clone()))
        .collect();
    let mut p = LoadProgress {
        tensors_done: 0,
        tensors_total: named.len(),
        bytes_done: 0,
        bytes_total: named.iter().map(|(_, t)| (t.numel() * 2) as u64).sum(),
    };
    let bytes = write_with(path, Dtype::BF16, &shapes, &mut |i, buf| {
        let t = named[i].1;
        dequantize_tensor(w, t, buf);
        p.tensors_done += 1;
        p.bytes_done += (t.numel() * 2) as u64;
        progress(&p);
        Ok(())
    })?;
    Ok((named.len(), bytes))
}

/// A tensor's values as f32 into `out` (resized): block formats
/// dequantised row by row on the math threads.
pub fn dequantize_tensor(w: &Weights, t: &TensorRef, out: &mut Vec<f32>) {
    out.clear();
    out.resize(t.numel(), 0.0);
    match t.dtype {
        DType::F32 => out.copy_from_slice(w.get(t)),
        DType::Quant(_) => {
            let cols = t.shape.last().copied().unwrap_or(1);
            crate::dispatch::thread_pool().install(|| {
                out.par_chunks_mut(cols)
                    .enumerate()
                    .for_each(|(r, row)| w.row_into(t, r, row));
            });
        }
    }
}
