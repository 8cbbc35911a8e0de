//! GGUF files: the config from the metadata, the tensors (dequantised, or
//! their blocks kept, Q/K rows un-permuted) and the chat template.

use anyhow::{bail, Context};
use pdkv_vmem::Pool;

use super::format::{converted, WeightFormat};
use super::plan::{check_shape, parse_arch, LoadProgress, Slot, SlotDst, WeightsPlan};
use crate::gguf::GgufFile;
use crate::qtype::QType;
use crate::weights::{quant_of, DType, Weights};
use crate::{ChatTemplate, ModelConfig, Tokenizer};

/// The model config a GGUF file's metadata describes.
pub fn gguf_config(g: &GgufFile) -> anyhow::Result<ModelConfig> {
    let arch_s = g
        .get_str("general.architecture")
        .context("GGUF lacks general.architecture")?;
    let arch = parse_arch(arch_s)?;
    let key = |k: &str| format!("{arch_s}.{k}");
    let req = |k: &str| -> anyhow::Result<usize> {
        g.get_u64(&key(k))
            .map(|v| v as usize)
            .with_context(|| format!("GGUF metadata lacks integer {}", key(k)))
    };
    if let Some(t) = g.get_str(&key("rope.scaling.type")) {
        let factor = g.get_f64(&key("rope.scaling.factor")).unwrap_or(1.0);
        if t != "none" && factor != 1.0 {
            bail!("RoPE scaling `{t}` is not supported");
        }
    }
    let hidden_size = req("embedding_length")?;
    let num_heads = req("attention.head_count")?;
    anyhow::ensure!(num_heads > 0, "attention.head_count is 0");
    let head_dim = match g.get_u64(&key("attention.key_length")) {
        Some(d) => d as usize,
        None => hidden_size / num_heads,
    };
    let embd = g
        .tensor("token_embd.weight")
        .context("GGUF lacks tensor `token_embd.weight`")?;
    let vocab_size = match embd.shape()[..] {
        [v, h] if h == hidden_size => v,
        ref s => {
            bail!("tensor `token_embd.weight` has shape {s:?}, expected [vocab, {hidden_size}]")
        }
    };
    let mut eos_token_ids = Vec::new();
    for k in ["tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"] {
        if let Some(id) = g.get_u64(k) {
            if !eos_token_ids.contains(&(id as u32)) {
                eos_token_ids.push(id as u32);
            }
        }
    }
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_layers: req("block_count")?,
        num_heads,
        num_kv_heads: g
            .get_u64(&key("attention.head_count_kv"))
            .map_or(num_heads, |v| v as usize),
        head_dim,
        rope_theta: g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0) as f32,
        rms_norm_eps: g
            .get_f64(&key("attention.layer_norm_rms_epsilon"))
            .with_context(|| {
                format!(
                    "GGUF metadata lacks {}",
                    key("attention.layer_norm_rms_epsilon")
                )
            })? as f32,
        max_position_embeddings: req("context_length")?,
        tie_word_embeddings: g.tensor("output.weight").is_none(),
        bos_token_id: g.get_u64("tokenizer.ggml.bos_token_id").map(|v| v as u32),
        eos_token_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Loads the weights of `g` (config `cfg`), stored as `format` says.
pub(super) fn load_gguf_weights(
    g: &GgufFile,
    cfg: &ModelConfig,
    format: WeightFormat,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    let plan = match format {
        WeightFormat::AsStored => WeightsPlan::new(cfg, &gguf_quant(g)),
        WeightFormat::Convert(_) => WeightsPlan::new(cfg, &converted(format, cfg)),
    };
    plan.load(pool, progress, |slot, dst| {
        fill_gguf_slot(g, cfg, slot, dst)
    })
}

/// The block format a GGUF tensor keeps in the weights region, by name.
pub(super) fn gguf_quant(g: &GgufFile) -> impl Fn(&str, &str, usize) -> Option<QType> + '_ {
    move |name, _, _| g.tensor(name).and_then(|i| quant_of(i.ty))
}

/// Converts the GGUF tensor of `slot` into `dst` (Q/K rows un-permuted):
/// dequantised to f32, its blocks copied row by row when the destination
/// keeps the file's format, or dequantised and quantised into the
/// destination's block format.
pub(super) fn fill_gguf_slot(
    g: &GgufFile,
    cfg: &ModelConfig,
    slot: &Slot,
    dst: SlotDst<'_>,
) -> anyhow::Result<()> {
    let head_dim = cfg.head_dim;
    let name = &slot.gguf_name;
    let info = g
        .tensor(name)
        .with_context(|| format!("GGUF lacks tensor `{name}`"))?;
    check_shape(name, &info.shape(), &slot.dest.shape)?;
    // Stored row h*hd + 2i + j holds Hugging Face row h*hd + j*hd/2 + i.
    let half = head_dim / 2;
    let unpermute = move |r: usize| {
        let (h, within) = (r / head_dim, r % head_dim);
        h * head_dim + (within % 2) * half + within / 2
    };
    match (dst, slot.rope_heads) {
        (SlotDst::F32(dst), Some(_)) => g.dequantize_rows_into(info, dst, &unpermute)?,
        (SlotDst::F32(dst), None) => g.dequantize_into(info, dst)?,
        (SlotDst::Raw(dst), rope) => {
            let DType::Quant(q) = slot.dest.dtype else {
                bail!("tensor `{name}` is planned as f32")
            };
            let cols = slot.dest.shape[1];
            if quant_of(info.ty) != Some(q.gguf()) {
                let mut values = vec![0f32; slot.dest.numel()];
                match rope {
                    Some(_) => g.dequantize_rows_into(info, &mut values, &unpermute)?,
                    None => g.dequantize_into(info, &mut values)?,
                }
                if dst.len() != q.row_bytes(cols) * (values.len() / cols) {
                    bail!("tensor `{name}` does not fit {} bytes of {q:?}", dst.len());
                }
                crate::quantize::quantize_rows(q, cols, dst, &|r, out| {
                    out.copy_from_slice(&values[r * cols..(r + 1) * cols])
                });
                return Ok(());
            }
            let data = g.tensor_data(info)?;
            let rb = q.row_bytes(cols);
            if data.len() != dst.len() || data.len() % rb != 0 {
                bail!(
                    "tensor `{name}` has {} bytes, expected {}",
                    data.len(),
                    dst.len()
                );
            }
            for r in 0..data.len() / rb {
                let to = if rope.is_some() { unpermute(r) } else { r };
                dst[to * rb..(to + 1) * rb].copy_from_slice(&data[r * rb..(r + 1) * rb]);
            }
            if q.packed() {
                crate::packed::pack_in_place(q, dst, cols);
            }
        }
    }
    Ok(())
}

/// Checks, without converting anything, that the GGUF tensor of `slot`
/// exists, has the planned shape, a type this crate dequantises, and data
/// inside the file.
pub(super) fn precheck_gguf_slot(g: &GgufFile, slot: &Slot) -> anyhow::Result<()> {
    let name = &slot.gguf_name;
    let info = g
        .tensor(name)
        .with_context(|| format!("GGUF lacks tensor `{name}`"))?;
    check_shape(name, &info.shape(), &slot.dest.shape)?;
    let (block, _) = info
        .ty
        .block_layout()
        .filter(|_| info.ty.can_dequantize())
        .with_context(|| format!("tensor `{name}` has a type this loader cannot convert"))?;
    let cols = slot.dest.shape.last().copied().unwrap_or(1);
    if cols % block != 0 {
        bail!(
            "tensor `{name}` has rows of {cols} values, not a whole number of {block}-value blocks"
        );
    }
    g.tensor_data(info)?;
    Ok(())
}

pub(super) fn gguf_chat_template(g: &GgufFile, tok: &Tokenizer) -> Option<ChatTemplate> {
    let src = g.get_str("tokenizer.chat_template")?;
    let token = |key: &str| {
        g.get_u64(key)
            .and_then(|id| tok.id_to_token(id as u32))
            .unwrap_or_default()
    };
    let t = ChatTemplate::new(
        src.to_string(),
        token("tokenizer.ggml.bos_token_id"),
        token("tokenizer.ggml.eos_token_id"),
    );
    match t.validate() {
        Ok(()) => Some(t),
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "ignoring the GGUF chat template");
            None
        }
    }
}
