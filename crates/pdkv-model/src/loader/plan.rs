//! The one plan both formats load through ([`WeightsPlan`]): every tensor
//! the model needs, its name in each format, its shape and its place in
//! the `weights` region; and the region filled slot by slot.

use anyhow::{bail, Context};
use pdkv_vmem::{Backing, Pool, Tag};

use crate::qtype::QType;
use crate::weights::{DType, LayerWeights, TensorRef, Weights, WeightsLayout};
use crate::{Arch, ModelConfig};

/// Progress of a load, for a progress display.
#[derive(Clone, Debug)]
pub struct LoadProgress {
    pub tensors_done: usize,
    pub tensors_total: usize,
    /// f32 bytes written into the weights region so far.
    pub bytes_done: u64,
    pub bytes_total: u64,
}

/// Where a slot's values go: f32 values, or a block-format tensor's bytes.
pub(super) enum SlotDst<'a> {
    F32(&'a mut [f32]),
    Raw(&'a mut [u8]),
}

/// The destination of `t` in `region`.
///
/// # Safety
/// `t` lies inside `region` and no other view of its range exists while the
/// destination lives.
pub(super) unsafe fn slot_dst<'a>(region: &'a pdkv_vmem::Region, t: &TensorRef) -> SlotDst<'a> {
    // SAFETY: the caller guarantees that `t` lies inside `region` and that
    // no other view of its range exists while the destination lives.
    unsafe {
        match t.dtype {
            DType::F32 => SlotDst::F32(region.slice_mut::<f32>(t.offset, t.numel())),
            DType::Quant(_) => SlotDst::Raw(region.slice_mut::<u8>(t.offset, t.bytes())),
        }
    }
}

/// The block format a plan keeps a matrix in, by `(gguf_name, hf_name,
/// cols)`; `None`: f32.
pub(super) type Quant<'a> = dyn Fn(&str, &str, usize) -> Option<QType> + 'a;

/// One tensor of the plan.
pub(super) struct Slot {
    pub(super) gguf_name: String,
    pub(super) hf_name: String,
    pub(super) dest: TensorRef,
    /// For Q/K projections: the number of heads whose rows a llama GGUF
    /// stores permuted.
    pub(super) rope_heads: Option<usize>,
}

/// Where every tensor goes in the weights region.
pub(super) struct WeightsPlan {
    pub(super) embed: TensorRef,
    pub(super) layers: Vec<LayerWeights>,
    pub(super) final_norm: TensorRef,
    pub(super) lm_head: TensorRef,
    pub(super) slots: Vec<Slot>,
    pub(super) total_bytes: usize,
}

impl WeightsPlan {
    /// The plan for `cfg`; `quant(gguf_name, hf_name, cols)` names the
    /// block format a matrix with rows of `cols` values keeps (a GGUF
    /// tensor in a format the kernels read, a 16-bit safetensors tensor,
    /// the running model's format on a reload, a chosen format), `None`
    /// for f32.
    pub(super) fn new(cfg: &ModelConfig, quant: &Quant<'_>) -> WeightsPlan {
        let mut layout = WeightsLayout::new();
        let mut slots = Vec::new();
        let mut push =
            |gguf: String, hf: String, shape: &[usize], rope_heads: Option<usize>, linear: bool| {
                let cols = shape.last().copied().unwrap_or(1);
                // A block format as the kernels keep it loaded (`QType::loaded`).
                let dtype = match quant(&gguf, &hf, cols) {
                    Some(q) if linear && shape.len() == 2 && cols % q.block_values() == 0 => {
                        DType::Quant(q.loaded())
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
        let (h, v) = (cfg.hidden_size, cfg.vocab_size);
        let embed = push(
            "token_embd.weight".into(),
            "model.embed_tokens.weight".into(),
            &[v, h],
            None,
            true,
        );
        let layers = (0..cfg.num_layers)
            .map(|i| plan_layer(cfg, i, &mut push))
            .collect();
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

    pub(super) fn bytes_total(&self) -> u64 {
        self.slots.iter().map(|s| s.dest.bytes() as u64).sum()
    }

    /// A load of this plan's tensors, none done yet.
    pub(super) fn progress(&self) -> LoadProgress {
        LoadProgress {
            tensors_done: 0,
            tensors_total: self.slots.len(),
            bytes_done: 0,
            bytes_total: self.bytes_total(),
        }
    }

    /// Allocates the region, fills every slot with `fill(slot, dest)`, and
    /// assembles the weights.
    pub(super) fn load(
        self,
        pool: &Pool,
        progress: &mut dyn FnMut(&LoadProgress),
        mut fill: impl FnMut(&Slot, SlotDst<'_>) -> anyhow::Result<()>,
    ) -> anyhow::Result<Weights> {
        // Only this process reads the running weights: private memory, in
        // huge pages where the kernel has them (see `pdkv_vmem::Backing`).
        let region = pool
            .allocate_backed(Tag::Weights, self.total_bytes, Backing::Private)
            .context("cannot allocate the weights region")?;
        let mut p = self.progress();
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

/// Plans layer `i`'s tensors through `push(gguf_name, hf_name, shape,
/// rope_heads, linear)`, in the plan's order.
fn plan_layer(
    cfg: &ModelConfig,
    i: usize,
    push: &mut impl FnMut(String, String, &[usize], Option<usize>, bool) -> TensorRef,
) -> LayerWeights {
    LayerWeights::build(cfg, |t| {
        let (hf, gguf) = t.names();
        push(
            format!("blk.{i}.{gguf}.weight"),
            format!("model.layers.{i}.{hf}.weight"),
            &t.shape(cfg),
            t.rope_heads(cfg),
            t.is_linear(),
        )
    })
}

pub(super) fn check_shape(name: &str, found: &[usize], expected: &[usize]) -> anyhow::Result<()> {
    if found != expected {
        bail!("tensor `{name}` has shape {found:?}, expected {expected:?}");
    }
    Ok(())
}

pub(super) fn parse_arch(s: &str) -> anyhow::Result<Arch> {
    match s {
        "llama" => Ok(Arch::Llama),
        "qwen3" => Ok(Arch::Qwen3),
        other => bail!("unsupported architecture `{other}` (supported: llama, qwen3)"),
    }
}
