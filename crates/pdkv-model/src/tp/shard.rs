//! How a model splits over ranks ([`plan`]) and each rank's cut of the
//! weights ([`shard_weights`], [`check_shard`], [`copy_shard`]).

use std::ops::Range;

use anyhow::{ensure, Context};
use pdkv_vmem::{Backing, Pool, Tag};

use crate::weights::{DType, LayerWeights, TensorRef, Weights, WeightsLayout};
use crate::ModelConfig;

/// What one rank holds of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    /// Query heads (those of the KV heads below).
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Rows of `o_proj` and `down_proj`: columns of the residual update.
    pub hidden: Range<usize>,
    /// Rows of `gate/up_proj`: columns of the MLP's intermediate activation.
    pub inter: Range<usize>,
    /// Rows of the embedding table and the LM head.
    pub vocab: Range<usize>,
}

impl Shard {
    /// The rank's model shape: its heads and MLP columns. `vocab_size`
    /// stays the whole vocabulary (token ids and logits rows are global).
    pub fn config(&self, full: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.inter.len(),
            ..full.clone()
        }
    }
}

/// Part `rank` of `n` units split into `size` contiguous ranges, the first
/// `n % size` ranges one unit longer.
fn split(n: usize, size: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// How `full` splits over `size` ranks; an error says what does not divide.
pub fn plan(cfg: &ModelConfig, size: usize) -> anyhow::Result<Vec<Shard>> {
    ensure!(size >= 1, "the tensor-parallel size must be at least 1");
    ensure!(
        cfg.num_kv_heads >= size,
        "tensor-parallel size {size} exceeds the model's {} KV heads (each rank needs one of its own)",
        cfg.num_kv_heads
    );
    ensure!(
        cfg.hidden_size >= size && cfg.intermediate_size >= size && cfg.vocab_size >= size,
        "tensor-parallel size {size} exceeds the model's dimensions"
    );
    let group = cfg.num_heads / cfg.num_kv_heads;
    Ok((0..size)
        .map(|rank| {
            let kv_heads = split(cfg.num_kv_heads, size, rank);
            Shard {
                rank,
                size,
                heads: kv_heads.start * group..kv_heads.end * group,
                kv_heads,
                hidden: split(cfg.hidden_size, size, rank),
                inter: split(cfg.intermediate_size, size, rank),
                vocab: split(cfg.vocab_size, size, rank),
            }
        })
        .collect())
}

fn row_bytes(t: &TensorRef) -> usize {
    let cols = t.shape.last().copied().unwrap_or(1);
    match t.dtype {
        DType::F32 => cols * 4,
        DType::Quant(q) => q.row_bytes(cols),
    }
}

/// How a rank's tensor is cut from the whole one.
#[derive(Clone, Debug)]
enum Cut {
    Whole,
    Rows(Range<usize>),
}

impl Cut {
    fn shape(&self, t: &TensorRef) -> Vec<usize> {
        match self {
            Cut::Whole => t.shape.clone(),
            Cut::Rows(r) => vec![r.len(), t.shape[1]],
        }
    }

    /// Copies the cut of `src` (in `from`) to `dst` (in `to`).
    fn copy(
        &self,
        from: &Weights,
        src: &TensorRef,
        to: &Weights,
        dst: &TensorRef,
    ) -> anyhow::Result<()> {
        // SAFETY: the source weights are not written while they are read
        // (a load or reload writes only regions no step reads yet).
        let bytes = |off: usize, len: usize| unsafe { from.region.slice::<u8>(off, len) };
        match self {
            Cut::Whole => to
                .region
                .write_bytes(dst.offset, bytes(src.offset, src.bytes()))?,
            Cut::Rows(r) => {
                let rb = row_bytes(src);
                match src.dtype {
                    // A packed matrix's rows as GGUF rows, packed again in
                    // the cut's own tiles.
                    DType::Quant(q) if q.packed() => {
                        let cols = src.shape[1];
                        let mut rows = vec![0u8; r.len() * rb];
                        let whole = bytes(src.offset, src.bytes());
                        crate::packed::rows_into(q, whole, cols, r.start, &mut rows);
                        crate::packed::pack_in_place(q, &mut rows, cols);
                        to.region.write_bytes(dst.offset, &rows)?;
                    }
                    _ => {
                        let s = bytes(src.offset + r.start * rb, r.len() * rb);
                        to.region.write_bytes(dst.offset, s)?;
                    }
                }
            }
        }
        Ok(())
    }
}

/// Every tensor of a rank with its cut, in one fixed order.
fn cuts<'w>(w: &'w Weights, s: &Shard, hd: usize) -> Vec<(&'w TensorRef, Cut)> {
    let (q, kv) = (
        s.heads.start * hd..s.heads.end * hd,
        s.kv_heads.start * hd..s.kv_heads.end * hd,
    );
    let mut v = vec![(&w.embed, Cut::Rows(s.vocab.clone()))];
    for l in &w.layers {
        v.extend([
            (&l.attn_norm, Cut::Whole),
            (&l.wq, Cut::Rows(q.clone())),
            (&l.wk, Cut::Rows(kv.clone())),
            (&l.wv, Cut::Rows(kv.clone())),
            (&l.wo, Cut::Rows(s.hidden.clone())),
            (&l.ffn_norm, Cut::Whole),
            (&l.w_gate, Cut::Rows(s.inter.clone())),
            (&l.w_up, Cut::Rows(s.inter.clone())),
            (&l.w_down, Cut::Rows(s.hidden.clone())),
        ]);
        v.extend(
            [&l.q_norm, &l.k_norm]
                .into_iter()
                .flatten()
                .map(|t| (t, Cut::Whole)),
        );
    }
    v.push((&w.final_norm, Cut::Whole));
    if w.lm_head != w.embed {
        v.push((&w.lm_head, Cut::Rows(s.vocab.clone())));
    }
    v
}

/// Rank `s`'s weights, cut from `full` into a new `weights` region of `pool`.
pub fn shard_weights(
    full: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
    pool: &Pool,
) -> anyhow::Result<Weights> {
    let mut lay = WeightsLayout::new();
    let refs: Vec<TensorRef> = cuts(full, s, cfg.head_dim)
        .iter()
        .map(|(t, c)| lay.push_typed(&c.shape(t), t.dtype))
        .collect();
    // The same tensors in the order `cuts` lists them.
    let mut refs = refs.into_iter();
    let mut next = || refs.next().expect("one cut per tensor");
    let embed = next();
    let layers = full
        .layers
        .iter()
        .map(|l| LayerWeights {
            attn_norm: next(),
            wq: next(),
            wk: next(),
            wv: next(),
            wo: next(),
            ffn_norm: next(),
            w_gate: next(),
            w_up: next(),
            w_down: next(),
            q_norm: l.q_norm.as_ref().map(|_| next()),
            k_norm: l.k_norm.as_ref().map(|_| next()),
        })
        .collect();
    let final_norm = next();
    let lm_head = if full.lm_head == full.embed {
        embed.clone()
    } else {
        next()
    };
    // Private memory, as a loaded model's weights (see `loader`).
    let region = pool
        .allocate_backed(Tag::Weights, lay.total_bytes(), Backing::Private)
        .with_context(|| format!("allocating rank {}'s weights", s.rank))?;
    let out = Weights {
        region,
        embed,
        layers,
        final_norm,
        lm_head,
    };
    copy_shard(full, &out, cfg, s)?;
    Ok(out)
}

/// Checks that rank `s`'s cut of `full` fits `dst`, a shard laid out as
/// [`shard_weights`] lays it out: the same tensors, shapes and formats.
pub fn check_shard(
    full: &Weights,
    dst: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
) -> anyhow::Result<()> {
    let (src, dst_cuts) = (cuts(full, s, cfg.head_dim), cuts(dst, s, cfg.head_dim));
    ensure!(
        src.len() == dst_cuts.len(),
        "the checkpoint has other tensors than rank {}'s weights",
        s.rank
    );
    for ((t, cut), (d, _)) in src.iter().zip(&dst_cuts) {
        ensure!(
            cut.shape(t) == d.shape && t.dtype == d.dtype,
            "rank {}: a {:?} {:?} tensor does not fit the running {:?} {:?} one",
            s.rank,
            cut.shape(t),
            t.dtype,
            d.shape,
            d.dtype
        );
    }
    Ok(())
}

/// Writes rank `s`'s cut of `full` over `dst` (after [`check_shard`]).
pub fn copy_shard(
    full: &Weights,
    dst: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
) -> anyhow::Result<()> {
    check_shard(full, dst, cfg, s)?;
    let (src, dst_cuts) = (cuts(full, s, cfg.head_dim), cuts(dst, s, cfg.head_dim));
    for ((t, cut), (d, _)) in src.iter().zip(&dst_cuts) {
        cut.copy(full, t, dst, d)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_contiguous_and_cover_everything() {
        for n in 1..20 {
            for size in 1..=n {
                let mut next = 0;
                for r in 0..size {
                    let s = split(n, size, r);
                    assert_eq!(s.start, next);
                    assert!(s.len() == n / size || s.len() == n / size + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
