//! Loading a checkpoint (GGUF file or Hugging Face directory) into a pool.
//!
//! Both formats go through one plan: from the config, [`WeightsPlan`] lists
//! every tensor the model needs with its row-major shape, its name in each
//! format, and its place in a single `weights` region. Each source tensor is
//! then checked against the planned shape and converted to f32 straight into
//! its place in the region (no intermediate copy of the model).
//!
//! Invariants:
//! - every tensor of the plan is written exactly once, or the load fails
//!   with an error naming the tensor (missing, wrong shape, unsupported type);
//! - weights end up in Hugging Face order: GGUF files of the `llama`
//!   architecture store Q and K rows interleaved per head for llama.cpp's
//!   RoPE, and are un-permuted here.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use pdkv_vmem::{Pool, Tag};
use serde_json::Value;

use crate::gguf::GgufFile;
use crate::qkernels::QType;
use crate::safetensors::SafetensorsFile;
use crate::weights::{quant_of, DType, LayerWeights, TensorRef, Weights, WeightsLayout};
use crate::{Arch, ChatTemplate, Model, ModelConfig, Tokenizer};

/// Progress of a load, for a progress display.
#[derive(Clone, Debug)]
pub struct LoadProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    /// f32 bytes written into the weights region so far.
    pub bytes_done: u64,
    pub bytes_total: u64,
}

pub struct LoadedModel {
    pub model: Model,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// A short name for `/v1/models` (file stem or directory name).
    pub name: String,
    pub source: PathBuf,
}

/// Loads `path`: a `.gguf` file, or a directory with `config.json`,
/// `*.safetensors` and `tokenizer.json` (and optionally `tokenizer_config.json`).
pub fn load_model(
    path: &Path,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<LoadedModel> {
    let name = if path.is_dir() {
        path.file_name()
    } else {
        path.file_stem()
    }
    .map(|s| s.to_string_lossy().into_owned())
    .unwrap_or_else(|| "model".to_string());
    let (config, weights, tokenizer, chat_template) = if path.is_dir() {
        let cfg = hf_config(path)?;
        let weights = load_hf_weights(path, &cfg, pool, progress)?;
        let (tok, tmpl) = hf_tokenizer(path, &cfg)?;
        (cfg, weights, tok, tmpl)
    } else {
        let gguf =
            GgufFile::open(path).with_context(|| format!("cannot read GGUF {}", path.display()))?;
        let cfg = gguf_config(&gguf)?;
        let weights = load_gguf_weights(&gguf, &cfg, pool, progress)?;
        let tok = Tokenizer::from_gguf(&gguf)?;
        let tmpl = gguf_chat_template(&gguf, &tok);
        (cfg, weights, tok, tmpl)
    };
    if tokenizer.vocab_size() > config.vocab_size {
        bail!(
            "tokenizer has {} tokens but the model's vocabulary is {}",
            tokenizer.vocab_size(),
            config.vocab_size
        );
    }
    Ok(LoadedModel {
        model: Model::new(config, weights),
        tokenizer,
        chat_template,
        name,
        source: path.to_path_buf(),
    })
}

/// Reads only the config and weights of a checkpoint (for reloading weights
/// in place of a running model's): the result must match `expected` exactly.
pub fn load_weights_matching(
    path: &Path,
    expected: &ModelConfig,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    let check = |cfg: &ModelConfig| -> anyhow::Result<()> {
        if cfg != expected {
            bail!(
                "checkpoint {} has config {cfg:?}, expected {expected:?}",
                path.display()
            );
        }
        Ok(())
    };
    if path.is_dir() {
        let cfg = hf_config(path)?;
        check(&cfg)?;
        load_hf_weights(path, &cfg, pool, progress)
    } else {
        let gguf =
            GgufFile::open(path).with_context(|| format!("cannot read GGUF {}", path.display()))?;
        let cfg = gguf_config(&gguf)?;
        check(&cfg)?;
        load_gguf_weights(&gguf, &cfg, pool, progress)
    }
}

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
fn config_mismatches(
    found: &ModelConfig,
    expected: &ModelConfig,
) -> Vec<(&'static str, String, String)> {
    let mut out = Vec::new();
    let mut cmp = |name: &'static str, a: String, b: String| {
        if a != b {
            out.push((name, a, b));
        }
    };
    cmp(
        "arch",
        found.arch.as_str().into(),
        expected.arch.as_str().into(),
    );
    cmp(
        "vocab_size",
        found.vocab_size.to_string(),
        expected.vocab_size.to_string(),
    );
    cmp(
        "hidden_size",
        found.hidden_size.to_string(),
        expected.hidden_size.to_string(),
    );
    cmp(
        "intermediate_size",
        found.intermediate_size.to_string(),
        expected.intermediate_size.to_string(),
    );
    cmp(
        "num_layers",
        found.num_layers.to_string(),
        expected.num_layers.to_string(),
    );
    cmp(
        "num_heads",
        found.num_heads.to_string(),
        expected.num_heads.to_string(),
    );
    cmp(
        "num_kv_heads",
        found.num_kv_heads.to_string(),
        expected.num_kv_heads.to_string(),
    );
    cmp(
        "head_dim",
        found.head_dim.to_string(),
        expected.head_dim.to_string(),
    );
    cmp(
        "tie_word_embeddings",
        found.tie_word_embeddings.to_string(),
        expected.tie_word_embeddings.to_string(),
    );
    // Bit patterns: a reload must not change the math, not even slightly.
    cmp(
        "rope_theta",
        found.rope_theta.to_bits().to_string(),
        expected.rope_theta.to_bits().to_string(),
    );
    cmp(
        "rms_norm_eps",
        found.rms_norm_eps.to_bits().to_string(),
        expected.rms_norm_eps.to_bits().to_string(),
    );
    out
}

/// Reloads a checkpoint (GGUF file or Hugging Face directory) *into* the
/// weights region of a running model, at the same addresses.
///
/// Everything is validated before the first byte is written: the checkpoint's
/// architecture and hyper-parameters must equal `expected` (the running
/// model's config), and every planned tensor must exist with the running
/// model's shape and a convertible type. On any mismatch the error names the
/// field or tensor and the old weights are untouched. Only then are the
/// tensors converted to f32 in place, in the order of the plan.
///
/// The caller guarantees that nothing reads the weights while this runs (the
/// engine calls it between steps, on the thread that runs the model).
pub fn reload_weights_into(
    weights: &Weights,
    expected: &ModelConfig,
    path: &Path,
    progress: &mut dyn FnMut(&LoadProgress),
) -> Result<(), ReloadError> {
    if !path.exists() {
        return Err(ReloadError::Unreadable(anyhow::anyhow!(
            "checkpoint path {} does not exist",
            path.display()
        )));
    }
    enum Source {
        Hf(HfShards),
        Gguf(GgufFile),
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
    let source = match source {
        Some(s) => s,
        None => Source::Hf(open_hf_shards(path).map_err(ReloadError::Unreadable)?),
    };
    let plan = match &source {
        Source::Hf(sh) => WeightsPlan::new(expected, &hf_quant(sh)),
        Source::Gguf(g) => WeightsPlan::new(expected, &gguf_quant(g)),
    };
    let layout_matches = plan.embed == weights.embed
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
        && plan.total_bytes <= weights.region.len();
    if !layout_matches {
        // Name a tensor the checkpoint stores in another format, if any.
        let running = weights.tensors_by_offset();
        let differs = plan.slots.iter().find_map(|s| {
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
        });
        return Err(ReloadError::Incompatible(anyhow::anyhow!(
            "{}",
            differs.unwrap_or_else(|| {
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
    let mut p = LoadProgress {
        tensors_done: 0,
        tensors_total: plan.slots.len(),
        bytes_done: 0,
        bytes_total: plan.bytes_total(),
    };
    for slot in &plan.slots {
        // SAFETY: each slot is its own 64-byte-aligned range inside the
        // region (the layout was checked above), and the caller guarantees
        // that no view of the weights is alive while this runs.
        let dst = unsafe { slot_dst(&weights.region, &slot.dest) };
        let filled = match &source {
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

/// Where a slot's values go: f32 values, or a block-format tensor's bytes.
enum SlotDst<'a> {
    F32(&'a mut [f32]),
    Raw(&'a mut [u8]),
}

/// The destination of `t` in `region`.
///
/// # Safety
/// `t` lies inside `region` and no other view of its range exists while the
/// destination lives.
unsafe fn slot_dst<'a>(region: &'a pdkv_vmem::Region, t: &TensorRef) -> SlotDst<'a> {
    match t.dtype {
        DType::F32 => SlotDst::F32(region.slice_mut::<f32>(t.offset, t.numel())),
        DType::Quant(_) => SlotDst::Raw(region.slice_mut::<u8>(t.offset, t.bytes())),
    }
}

/// One tensor of the plan.
struct Slot {
    gguf_name: String,
    hf_name: String,
    dest: TensorRef,
    /// For Q/K projections: the number of heads whose rows a llama GGUF
    /// stores permuted.
    rope_heads: Option<usize>,
}

/// Where every tensor goes in the weights region.
struct WeightsPlan {
    embed: TensorRef,
    layers: Vec<LayerWeights>,
    final_norm: TensorRef,
    lm_head: TensorRef,
    slots: Vec<Slot>,
    total_bytes: usize,
}

impl WeightsPlan {
    /// The plan for `cfg`; `quant(gguf_name, hf_name)` names the block
    /// format a linear layer keeps (a GGUF tensor in a format the kernels
    /// read, a 16-bit safetensors tensor), `None` for f32.
    fn new(cfg: &ModelConfig, quant: &dyn Fn(&str, &str) -> Option<QType>) -> WeightsPlan {
        let mut layout = WeightsLayout::new();
        let mut slots = Vec::new();
        let mut push =
            |gguf: String, hf: String, shape: &[usize], rope_heads: Option<usize>, linear: bool| {
                let cols = shape.last().copied().unwrap_or(1);
                let dtype = match quant(&gguf, &hf) {
                    Some(q) if linear && shape.len() == 2 && cols % q.block_values() == 0 => {
                        DType::Quant(q)
                    }
                    _ => DType::F32,
                };
                let dest = layout.push_typed(shape, dtype);
                slots.push(Slot {
                    gguf_name: gguf,
                    hf_name: hf,
                    dest: dest.clone(),
                    rope_heads,
                });
                dest
            };
        let (h, q, kv, ff, v) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
            cfg.vocab_size,
        );
        let embed = push(
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            &[v, h],
            None,
            true,
        );
        let llama = cfg.arch == Arch::Llama;
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let g = |n: &str| format!("blk.{i}.{n}.weight");
            let f = |n: &str| format!("model.layers.{i}.{n}.weight");
            let attn_norm = push(g("attn_norm"), f("input_layernorm"), &[h], None, false);
            let wq = push(
                g("attn_q"),
                f("self_attn.q_proj"),
                &[q, h],
                llama.then_some(cfg.num_heads),
                true,
            );
            let wk = push(
                g("attn_k"),
                f("self_attn.k_proj"),
                &[kv, h],
                llama.then_some(cfg.num_kv_heads),
                true,
            );
            let wv = push(g("attn_v"), f("self_attn.v_proj"), &[kv, h], None, true);
            let wo = push(g("attn_output"), f("self_attn.o_proj"), &[h, q], None, true);
            let (q_norm, k_norm) = if cfg.arch == Arch::Qwen3 {
                (
                    Some(push(
                        g("attn_q_norm"),
                        f("self_attn.q_norm"),
                        &[cfg.head_dim],
                        None,
                        false,
                    )),
                    Some(push(
                        g("attn_k_norm"),
                        f("self_attn.k_norm"),
                        &[cfg.head_dim],
                        None,
                        false,
                    )),
                )
            } else {
                (None, None)
            };
            let ffn_norm = push(
                g("ffn_norm"),
                f("post_attention_layernorm"),
                &[h],
                None,
                false,
            );
            let w_gate = push(g("ffn_gate"), f("mlp.gate_proj"), &[ff, h], None, true);
            let w_up = push(g("ffn_up"), f("mlp.up_proj"), &[ff, h], None, true);
            let w_down = push(g("ffn_down"), f("mlp.down_proj"), &[h, ff], None, true);
            layers.push(LayerWeights {
                attn_norm,
                wq,
                wk,
                wv,
                wo,
                q_norm,
                k_norm,
                ffn_norm,
                w_gate,
                w_up,
                w_down,
            });
        }
        let final_norm = push(
            "output_norm.weight".into(),
            "model.norm.weight".into(),
            &[h],
            None,
            false,
        );
        let lm_head = if cfg.tie_word_embeddings {
            embed.clone()
        } else {
            push(
                "output.weight".into(),
                "lm_head.weight".into(),
                &[v, h],
                None,
                true,
            )
        };
        WeightsPlan {
            embed,
            layers,
            final_norm,
            lm_head,
            slots,
            total_bytes: layout.total_bytes(),
        }
    }

    fn bytes_total(&self) -> u64 {
        self.slots.iter().map(|s| s.dest.bytes() as u64).sum()
    }

    /// Allocates the region, fills every slot with `fill(slot, dest)`, and
    /// assembles the weights.
    fn load(
        self,
        pool: &Pool,
        progress: &mut dyn FnMut(&LoadProgress),
        mut fill: impl FnMut(&Slot, SlotDst<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<Weights> {
        let region = pool
            .allocate(Tag::Weights, self.total_bytes)
            .context("cannot allocate the weights region")?;
        let mut p = LoadProgress {
            tensors_done: 0,
            tensors_total: self.slots.len(),
            bytes_done: 0,
            bytes_total: self.bytes_total(),
        };
        for slot in &self.slots {
            // SAFETY: the layout gives every slot its own 64-byte-aligned
            // range inside the region, and no other view of the region exists
            // until the weights are returned.
            let dst = unsafe { slot_dst(&region, &slot.dest) };
            fill(slot, dst)?;
            p.tensors_done += 1;
            p.bytes_done += slot.dest.bytes() as u64;
            progress(&p);
        }
        Ok(Weights {
            region,
            embed: self.embed,
            layers: self.layers,
            final_norm: self.final_norm,
            lm_head: self.lm_head,
        })
    }
}

fn check_shape(name: &str, found: &[usize], expected: &[usize]) -> anyhow::Result<()> {
    if found != expected {
        bail!("tensor `{name}` has shape {found:?}, expected {expected:?}");
    }
    Ok(())
}

// ---------------------------------------------------------------- GGUF ----

fn parse_arch(s: &str) -> anyhow::Result<Arch> {
    match s {
        "llama" => Ok(Arch::Llama),
        "qwen3" => Ok(Arch::Qwen3),
        other => bail!("unsupported architecture `{other}` (supported: llama, qwen3)"),
    }
}

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

fn load_gguf_weights(
    g: &GgufFile,
    cfg: &ModelConfig,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    WeightsPlan::new(cfg, &gguf_quant(g)).load(pool, progress, |slot, dst| {
        fill_gguf_slot(g, cfg, slot, dst)
    })
}

/// The block format a GGUF tensor keeps in the weights region, by name.
fn gguf_quant(g: &GgufFile) -> impl Fn(&str, &str) -> Option<QType> + '_ {
    move |name, _| g.tensor(name).and_then(|i| quant_of(i.ty))
}

/// The 16-bit format a safetensors tensor keeps in the weights region, by
/// its Hugging Face name (F32 ones, and any not found, become f32).
fn hf_quant(sh: &HfShards) -> impl Fn(&str, &str) -> Option<QType> + '_ {
    move |_, name| {
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

/// Converts the GGUF tensor of `slot` into `dst` (Q/K rows un-permuted):
/// dequantised to f32, or its blocks copied row by row.
fn fill_gguf_slot(
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
            if quant_of(info.ty) != Some(q) {
                bail!(
                    "tensor `{name}` has ggml type {}, the running model keeps {q:?}",
                    info.ty
                );
            }
            let data = g.tensor_data(info)?;
            let cols = slot.dest.shape[1];
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
        }
    }
    Ok(())
}

/// Checks, without converting anything, that the GGUF tensor of `slot`
/// exists, has the planned shape, a type this crate dequantises, and data
/// inside the file.
fn precheck_gguf_slot(g: &GgufFile, slot: &Slot) -> anyhow::Result<()> {
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

fn gguf_chat_template(g: &GgufFile, tok: &Tokenizer) -> Option<ChatTemplate> {
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

// --------------------------------------------------- Hugging Face dir ----

fn read_json(path: &Path) -> anyhow::Result<Value> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
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
struct HfShards {
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
    /// with the planned shape and exactly the bytes its dtype needs.
    fn precheck(&self, slot: &Slot) -> anyhow::Result<()> {
        let (_, entry) = self.entry(slot)?;
        let want = slot.dest.numel() * entry.dtype.size();
        if entry.end - entry.start != want {
            bail!(
                "tensor `{}` has {} bytes, expected {want}",
                slot.hf_name,
                entry.end - entry.start
            );
        }
        Ok(())
    }

    fn fill(&self, slot: &Slot, dst: SlotDst<'_>) -> anyhow::Result<()> {
        let (i, _) = self.entry(slot)?;
        match dst {
            SlotDst::F32(dst) => self.shards[i].read_f32(&slot.hf_name, dst),
            SlotDst::Raw(dst) => {
                let name = &slot.hf_name;
                let (bytes, dtype) = self.shards[i]
                    .raw(name)
                    .with_context(|| format!("no tensor `{name}`"))?;
                let planned = slot.dest.dtype;
                if half_of(dtype).map(DType::Quant) != Some(planned) || bytes.len() != dst.len() {
                    bail!(
                        "tensor `{name}` is {dtype:?} of {} bytes, the running model keeps {planned:?} of {}",
                        bytes.len(),
                        dst.len()
                    );
                }
                dst.copy_from_slice(bytes);
                Ok(())
            }
        }
    }
}

fn load_hf_weights(
    dir: &Path,
    cfg: &ModelConfig,
    pool: &Pool,
    progress: &mut dyn FnMut(&LoadProgress),
) -> anyhow::Result<Weights> {
    let shards = open_hf_shards(dir)?;
    let plan = WeightsPlan::new(cfg, &hf_quant(&shards));
    plan.load(pool, progress, |slot, dst| shards.fill(slot, dst))
}

fn open_hf_shards(dir: &Path) -> anyhow::Result<HfShards> {
    let mut shard_paths: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    shard_paths.sort();
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

fn hf_tokenizer(
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
            std::fs::read_to_string(&jinja)
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
