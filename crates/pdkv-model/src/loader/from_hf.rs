//! Hugging Face checkpoint directories: `config.json`, the safetensors
//! shards, `tokenizer.json` and the chat template.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use pdkv_vmem::Pool;
use serde_json::Value;

use super::format::{converted, WeightFormat};
use super::plan::{check_shape, parse_arch, LoadProgress, Slot, SlotDst, WeightsPlan};
use crate::qtype::QType;
use crate::safetensors::SafetensorsFile;
use crate::weights::{DType, TensorRef, Weights};
use crate::{ChatTemplate, ModelConfig, Tokenizer};

/// The 16-bit format a safetensors tensor keeps in the weights region, by
/// its Hugging Face name (F32 ones, and any not found, become f32).
pub(super) fn hf_quant(sh: &HfShards) -> impl Fn(&str, &str, usize) -> Option<QType> + '_ {
    move |_, name, _| {
        let &i = sh.index.get(name)?;
        half_of(sh.shards[i].tensors.get(name)?.dtype)
    }
}

/// The 16-bit format a safetensors dtype is kept in (`None`: f32).
fn half_of(d: crate::safetensors::Dtype) -> Option<QType> {
    match d {
        crate::safetensors::Dtype::F16 => Some(QType::F16),
        crate::safetensors::Dtype::BF16 => Some(QType::BF16),
        crate::safetensors::Dtype::F32 => None,
    }
}

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text = crate::checkpoint_file::read_to_string(path)
        .with_context(|| format!("cannot read {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not valid JSON", path.display()))
}

fn read_json_opt(path: &Path) -> anyhow::Result<Option<Value>> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

/// Token ids from a JSON int, list of ints, or null.
fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(Value::as_u64)
            .map(|x| x as u32)
            .collect(),
        _ => Vec::new(),
    }
}

/// The model config of a Hugging Face checkpoint directory (`config.json`,
/// plus `generation_config.json` for extra stop ids).
pub fn hf_config(dir: &Path) -> anyhow::Result<ModelConfig> {
    let path = dir.join("config.json");
    let c = read_json(&path)?;
    let ctx = |k: &str| format!("{} lacks `{k}`", path.display());
    let uint = |k: &str| -> anyhow::Result<usize> {
        c[k].as_u64().map(|v| v as usize).with_context(|| ctx(k))
    };
    let model_type = c["model_type"]
        .as_str()
        .with_context(|| ctx("model_type"))?;
    let arch = parse_arch(model_type)?;
    let num_heads = uint("num_attention_heads")?;
    let hidden_size = uint("hidden_size")?;
    anyhow::ensure!(num_heads > 0, "num_attention_heads is 0");
    // Newer configs keep RoPE settings under `rope_parameters`, older ones
    // use `rope_theta` and `rope_scaling`.
    let rope = ["rope_parameters", "rope_scaling"]
        .iter()
        .map(|k| &c[*k])
        .find(|v| v.is_object());
    if let Some(r) = rope {
        let ty = r["rope_type"]
            .as_str()
            .or(r["type"].as_str())
            .unwrap_or("default");
        if ty != "default" {
            bail!("RoPE scaling `{ty}` is not supported");
        }
    }
    let rope_theta = c["rope_theta"]
        .as_f64()
        .or_else(|| rope.and_then(|r| r["rope_theta"].as_f64()))
        .unwrap_or(10_000.0);
    let mut eos_token_ids = ids(c.get("eos_token_id"));
    let mut bos_token_id = ids(c.get("bos_token_id")).first().copied();
    if let Some(gc) = read_json_opt(&dir.join("generation_config.json"))? {
        for id in ids(gc.get("eos_token_id")) {
            if !eos_token_ids.contains(&id) {
                eos_token_ids.push(id);
            }
        }
        bos_token_id = bos_token_id.or(ids(gc.get("bos_token_id")).first().copied());
    }
    let cfg = ModelConfig {
        arch,
        vocab_size: uint("vocab_size")?,
        hidden_size,
        intermediate_size: uint("intermediate_size")?,
        num_layers: uint("num_hidden_layers")?,
        num_heads,
        num_kv_heads: c["num_key_value_heads"]
            .as_u64()
            .map_or(num_heads, |v| v as usize),
        head_dim: c["head_dim"]
            .as_u64()
            .map_or(hidden_size / num_heads, |v| v as usize),
        rope_theta: rope_theta as f32,
        rms_norm_eps: c["rms_norm_eps"]
            .as_f64()
            .with_context(|| ctx("rms_norm_eps"))? as f32,
        max_position_embeddings: uint("max_position_embeddings")?,
        tie_word_embeddings: c["tie_word_embeddings"].as_bool().unwrap_or(false),
        bos_token_id,
        eos_token_ids,
    };
    cfg.validate()?;
    Ok(cfg)
}

/// The safetensors shards of a checkpoint directory and, per tensor name,
/// the index of the shard that holds it.
pub(super) struct HfShards {
    dir: PathBuf,
    shards: Vec<SafetensorsFile>,
    index: std::collections::HashMap<String, usize>,
}

impl HfShards {
    fn entry(&self, slot: &Slot) -> anyhow::Result<(usize, &crate::safetensors::TensorEntry)> {
        let name = slot.hf_name.as_str();
        let &i = self
            .index
            .get(name)
            .with_context(|| format!("checkpoint {} lacks tensor `{name}`", self.dir.display()))?;
        let entry = &self.shards[i].tensors[name];
        check_shape(name, &entry.shape, &slot.dest.shape)?;
        Ok((i, entry))
    }

    /// Checks, without converting anything, that the tensor of `slot` exists
    /// with the planned shape and exactly the bytes its dtype needs, and
    /// that a block-format destination takes its rows whole.
    pub(super) fn precheck(&self, slot: &Slot) -> anyhow::Result<()> {
        let (_, entry) = self.entry(slot)?;
        let want = slot.dest.numel() * entry.dtype.size();
        if entry.end - entry.start != want {
            bail!(
                "tensor `{}` has {} bytes, expected {want}",
                slot.hf_name,
                entry.end - entry.start
            );
        }
        if let DType::Quant(q) = slot.dest.dtype {
            let cols = slot.dest.shape.last().copied().unwrap_or(1);
            if slot.dest.shape.len() != 2 || cols % q.block_values() != 0 {
                bail!(
                    "tensor `{}` has rows of {cols} values, not whole {q:?} blocks of {}",
                    slot.hf_name,
                    q.block_values()
                );
            }
        }
        Ok(())
    }

    /// Converts the tensor of `slot` into `dst`: widened to f32, its 16-bit
    /// values copied when the destination keeps that format, or each row
    /// widened and quantised into the destination's block format
    /// ([`crate::quantize::quantize_rows`]).
    pub(super) fn fill(&self, slot: &Slot, dst: SlotDst<'_>) -> anyhow::Result<()> {
        let (i, _) = self.entry(slot)?;
        let dst = match dst {
            SlotDst::F32(dst) => return self.shards[i].read_f32(&slot.hf_name, dst),
            SlotDst::Raw(dst) => dst,
        };
        let name = &slot.hf_name;
        let (bytes, dtype) = self.shards[i]
            .raw(name)
            .with_context(|| format!("no tensor `{name}`"))?;
        let DType::Quant(q) = slot.dest.dtype else {
            bail!("tensor `{name}` is planned as f32")
        };
        quantize_tensor(name, bytes, dtype, q, &slot.dest, dst)
    }
}

/// `bytes` (values of `dtype`, `dest`'s shape) into `dst` in the block
/// format `q`: copied when `q` is that 16-bit format, else each row widened
/// and quantised ([`crate::quantize::quantize_rows`]).
fn quantize_tensor(
    name: &str,
    bytes: &[u8],
    dtype: crate::safetensors::Dtype,
    q: QType,
    dest: &TensorRef,
    dst: &mut [u8],
) -> anyhow::Result<()> {
    if half_of(dtype) == Some(q) && bytes.len() == dst.len() {
        dst.copy_from_slice(bytes);
        return Ok(());
    }
    let cols = dest.shape.last().copied().unwrap_or(1);
    let rows = dest.numel() / cols.max(1);
    if dest.shape.len() != 2
        || cols % q.block_values() != 0
        || bytes.len() != rows * cols * dtype.size()
        || dst.len() != rows * q.row_bytes(cols)
    {
        bail!(
            "tensor `{name}` ({dtype:?}, {} bytes) does not convert to {q:?} of {} bytes",
            bytes.len(),
            dst.len()
        );
    }
    let rb = cols * dtype.size();
    crate::quantize::quantize_rows(q, cols, dst, &|r, out| {
        dtype.decode(&bytes[r * rb..(r + 1) * rb], out)
    });
    Ok(())
}

/// Converts one tensor as a trainer holds it — `src`, row-major values of
/// `src_dtype` (`f32`, `f16` or `bf16`) in `dest`'s shape, Hugging Face
/// order — into `dest`'s storage (`dst`, `dest.bytes()` long): what the
/// same tensor of a Hugging Face checkpoint becomes at load (widened to
/// f32, kept 16-bit, or each row quantised to the block format).
pub fn convert_tensor(
    name: &str,
    src: &[u8],
    src_dtype: &str,
    dest: &TensorRef,
    dst: &mut [u8],
) -> anyhow::Result<()> {
    let Some(dtype) = crate::safetensors::Dtype::from_sync_name(src_dtype) else {
        bail!("tensor `{name}`: {src_dtype} does not convert (f32, f16 or bf16 do)");
    };
    if src.len() != dest.numel() * dtype.size() || dst.len() != dest.bytes() {
        bail!(
            "tensor `{name}`: {} bytes of {src_dtype} into {} bytes, for {:?} values",
            src.len(),
            dst.len(),
            dest.shape
        );
    }
    match dest.dtype {
        DType::F32 => {
            let mut out = vec![0f32; dest.numel()];
            dtype.decode(src, &mut out);
            for (d, v) in dst.chunks_exact_mut(4).zip(&out) {
                d.copy_from_slice(&v.to_le_bytes());
            }
            Ok(())
        }
        DType::Quant(q) => quantize_tensor(name, src, dtype, q, dest, dst),
    }
}

/// Loads the weights of the checkpoint directory `dir` (config `cfg`),
/// stored as `format` says.
pub(super) fn load_hf_weights(
    dir: &Path,
    cfg: &ModelConfig,
    format: WeightFormat,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    let shards = open_hf_shards(dir)?;
    let plan = match format {
        WeightFormat::AsStored => WeightsPlan::new(cfg, &hf_quant(&shards)),
        WeightFormat::Convert(_) => WeightsPlan::new(cfg, &converted(format, cfg)),
    };
    load_planned(&shards, plan, pool, progress)
}

/// Checks every tensor of `plan` in `shards`, then allocates the region and
/// converts them into it.
pub(super) fn load_planned(
    shards: &HfShards,
    plan: WeightsPlan,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    for slot in &plan.slots {
        shards.precheck(slot)?;
    }
    plan.load(pool, progress, |slot, dst| shards.fill(slot, dst))
}

/// The index of a sharded checkpoint, naming each tensor's shard.
const SHARD_INDEX: &str = "model.safetensors.index.json";

/// Opens the safetensors shards of `dir`: those its
/// `model.safetensors.index.json` names (each tensor the index lists must
/// be in the shard it names), or without an index every `*.safetensors`
/// file in it.
pub(super) fn open_hf_shards(dir: &Path) -> anyhow::Result<HfShards> {
    let weight_map = read_json_opt(&dir.join(SHARD_INDEX))?
        .map(|v| -> anyhow::Result<Vec<(String, String)>> {
            let map = v["weight_map"]
                .as_object()
                .with_context(|| format!("{SHARD_INDEX} lacks `weight_map`"))?;
            map.iter()
                .map(|(name, file)| {
                    let file = file.as_str().with_context(|| {
                        format!("{SHARD_INDEX} names no file for tensor `{name}`")
                    })?;
                    Ok((name.clone(), file.to_string()))
                })
                .collect()
        })
        .transpose()?;
    let mut shard_paths: Vec<PathBuf> = match &weight_map {
        Some(map) => map.iter().map(|(_, f)| dir.join(f)).collect(),
        None => std::fs::read_dir(dir)
            .with_context(|| format!("cannot list {}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
            .collect(),
    };
    shard_paths.sort();
    shard_paths.dedup();
    if shard_paths.is_empty() {
        bail!("{} holds no *.safetensors files", dir.display());
    }
    let shards: Vec<SafetensorsFile> = shard_paths
        .iter()
        .map(|p| SafetensorsFile::open(p))
        .collect::<anyhow::Result<_>>()?;
    // Which shard holds each tensor; a name in two shards is ambiguous.
    let mut index = std::collections::HashMap::new();
    for (i, s) in shards.iter().enumerate() {
        for name in s.tensors.keys() {
            if let Some(j) = index.insert(name.clone(), i) {
                bail!(
                    "tensor `{name}` appears in both {} and {}",
                    shard_paths[j].display(),
                    shard_paths[i].display()
                );
            }
        }
    }
    for (name, file) in weight_map.iter().flatten() {
        if index.get(name).map(|&i| &shard_paths[i]) != Some(&dir.join(file)) {
            bail!("{SHARD_INDEX} puts tensor `{name}` in {file}, which does not hold it");
        }
    }
    Ok(HfShards {
        dir: dir.to_path_buf(),
        shards,
        index,
    })
}

/// A special token in tokenizer_config.json: a string or `{"content": ..}`.
fn token_text(v: &Value) -> Option<String> {
    match v {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

pub(super) fn hf_tokenizer(
    dir: &Path,
    cfg: &ModelConfig,
) -> anyhow::Result<(Tokenizer, Option<ChatTemplate>)> {
    let tok = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
    let tc = read_json_opt(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let bos_text = token_text(&tc["bos_token"]);
    let eos_text = token_text(&tc["eos_token"]);
    let mut eos = cfg.eos_token_ids.clone();
    if let Some(id) = eos_text.as_deref().and_then(|t| tok.token_to_id(t)) {
        if !eos.contains(&id) {
            eos.push(id);
        }
    }
    let bos = cfg
        .bos_token_id
        .or(bos_text.as_deref().and_then(|t| tok.token_to_id(t)));
    let tok = tok.with_special_ids(bos, eos);

    // The template lives in chat_template.jinja (newer) or in
    // tokenizer_config.json, as a string or a list of named templates.
    let jinja = dir.join("chat_template.jinja");
    let source = if jinja.exists() {
        Some(
            crate::checkpoint_file::read_to_string(&jinja)
                .with_context(|| format!("cannot read {}", jinja.display()))?,
        )
    } else {
        match &tc["chat_template"] {
            Value::String(s) => Some(s.clone()),
            Value::Array(list) => list
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string),
            _ => None,
        }
    };
    let template = match source {
        Some(src) => {
            let t = ChatTemplate::new(
                src,
                bos_text.unwrap_or_default(),
                eos_text.unwrap_or_default(),
            );
            t.validate()?;
            Some(t)
        }
        None => None,
    };
    Ok((tok, template))
}
