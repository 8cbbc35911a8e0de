//! The scratch a step runs in ([`Workspace`]): one `runtime` region of
//! activations split into the step's buffers, and the step's bookkeeping
//! (its tokens, attention work units, logits rows, quantised activations and
//! a tensor-parallel rank's exchange buffers), kept between steps so that a
//! steady-state step allocates nothing.

use std::sync::Arc;

use anyhow::Context;
use pdkv_vmem::{Pool, Region, Tag};

use crate::qkernels::QActs;
use crate::ModelConfig;

/// Per-token activation buffers, in floats per token.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Dims {
    pub(crate) hidden: usize,
    pub(crate) q: usize,
    pub(crate) kv: usize,
    pub(crate) inter: usize,
    pub(crate) half_head: usize,
}

impl Dims {
    pub(crate) fn of(cfg: &ModelConfig) -> Dims {
        Dims {
            hidden: cfg.hidden_size,
            q: cfg.q_dim(),
            kv: cfg.kv_dim(),
            inter: cfg.intermediate_size,
            half_head: cfg.head_dim / 2,
        }
    }

    /// Floats per token over all buffers of [`Bufs`].
    fn per_token(&self) -> usize {
        2 * self.hidden + 2 * self.q + 2 * self.kv + 2 * self.inter + 2 * self.half_head
    }
}

/// Disjoint views of the activation region for one step.
pub(crate) struct Bufs<'a> {
    /// Residual stream `[T, hidden]`.
    pub(crate) x: &'a mut [f32],
    /// Normed input / projection output `[T, hidden]`.
    pub(crate) h: &'a mut [f32],
    pub(crate) q: &'a mut [f32],
    pub(crate) k: &'a mut [f32],
    pub(crate) v: &'a mut [f32],
    /// Attention output `[T, q_dim]`.
    pub(crate) att: &'a mut [f32],
    pub(crate) gate: &'a mut [f32],
    pub(crate) up: &'a mut [f32],
    pub(crate) cos: &'a mut [f32],
    pub(crate) sin: &'a mut [f32],
}

/// Where a token of the step comes from.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TokenMeta {
    pub(crate) seq: usize,
    pub(crate) pos: usize,
}

/// One unit of attention work: query rows `row0..row1` of sequence `seq`
/// (rows of the step's activation matrix), the query heads `h0..h1` that
/// share KV head `kv_head` (all of them, so its K/V rows are read from
/// cache while warm, unless the step is too small to keep threads busy).
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnTask {
    pub(crate) seq: usize,
    pub(crate) kv_head: usize,
    pub(crate) row0: usize,
    pub(crate) row1: usize,
    /// Query heads `h0..h1` of the KV head's group.
    pub(crate) h0: usize,
    pub(crate) h1: usize,
    /// Set when the task computes one segment of its queries' keys
    /// ([`crate::kernels::SEGMENT`]) into partial slots, folded afterwards
    /// by its [`AttnMerge`]; unset, the task computes its queries whole.
    pub(crate) seg: Option<usize>,
    /// The first partial slot of the task's merge (segment `s`, query `i`
    /// of the task's `(row, head)` pairs in order: slot
    /// `slot + s * queries + i`).
    pub(crate) slot: usize,
}

/// The fold of a split task's segments: its queries' partial slots, in
/// segment order, into their attention outputs.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AttnMerge {
    /// The task as a whole (`seg` unset).
    pub(crate) task: AttnTask,
}

/// Scratch memory for a step, in `runtime` regions. Grows when a step needs
/// more than it holds, never shrinks; steady-state steps allocate nothing.
pub struct Workspace {
    pool: Pool,
    pub(crate) dims: Dims,
    /// Tokens the activation region holds.
    cap_tokens: usize,
    act: Arc<Region>,
    pub(crate) tokens: Vec<TokenMeta>,
    pub(crate) tasks: Vec<AttnTask>,
    pub(crate) merges: Vec<AttnMerge>,
    /// Partial slots of split attention tasks: `head_dim + 2` floats each
    /// (the accumulator, the maximum, the sum).
    pub(crate) parts: Vec<f32>,
    pub(crate) logit_rows: Vec<usize>,
    pub(crate) written: Vec<(u32, usize)>,
    /// The step's activations quantised for block-format weights.
    pub(crate) qacts: QActs,
    /// A tensor-parallel rank's exchange buffers (empty on a single rank).
    pub(crate) tp: TpBufs,
}

impl Workspace {
    /// Scratch for steps of up to `max_tokens` tokens.
    pub fn new(pool: &Pool, cfg: &ModelConfig, max_tokens: usize) -> anyhow::Result<Workspace> {
        let dims = Dims::of(cfg);
        let cap_tokens = max_tokens.max(1);
        let act = Self::alloc_act(pool, &dims, cap_tokens)?;
        Ok(Workspace {
            pool: pool.clone(),
            dims,
            cap_tokens,
            act,
            tokens: Vec::with_capacity(cap_tokens),
            tasks: Vec::new(),
            merges: Vec::new(),
            parts: Vec::new(),
            logit_rows: Vec::new(),
            written: Vec::new(),
            qacts: QActs::new(),
            tp: TpBufs::default(),
        })
    }

    /// Tokens a step can hold without growing.
    pub fn capacity_tokens(&self) -> usize {
        self.cap_tokens
    }

    fn alloc_act(pool: &Pool, dims: &Dims, tokens: usize) -> anyhow::Result<Arc<Region>> {
        let bytes = dims.per_token() * tokens * 4;
        pool.allocate(Tag::Runtime, bytes)
            .with_context(|| format!("allocating {bytes} bytes of activations for {tokens} tokens"))
    }

    /// Makes room for `tokens` tokens.
    pub(crate) fn reserve(&mut self, tokens: usize) -> anyhow::Result<()> {
        if tokens > self.cap_tokens {
            let cap = tokens.max(self.cap_tokens * 2);
            self.act = Self::alloc_act(&self.pool, &self.dims, cap)?;
            self.cap_tokens = cap;
        }
        Ok(())
    }

    /// Splits the activation region into the step's buffers.
    pub(crate) fn bufs(&mut self, t: usize) -> Bufs<'_> {
        let d = self.dims;
        let cap = self.cap_tokens;
        assert!(t <= cap);
        let sizes = [
            d.hidden,
            d.hidden,
            d.q,
            d.kv,
            d.kv,
            d.q,
            d.inter,
            d.inter,
            d.half_head,
            d.half_head,
        ];
        let base = self.act.base() as *mut f32;
        let mut off = 0;
        let mut take = |per: usize| {
            // SAFETY: the ranges `[off, off + per*cap)` are disjoint and lie in
            // the region (sized `per_token * cap` floats); `&mut self` makes
            // these views the only ones.
            let s = unsafe { std::slice::from_raw_parts_mut(base.add(off), per * t) };
            off += per * cap;
            s
        };
        Bufs {
            x: take(sizes[0]),
            h: take(sizes[1]),
            q: take(sizes[2]),
            k: take(sizes[3]),
            v: take(sizes[4]),
            att: take(sizes[5]),
            gate: take(sizes[6]),
            up: take(sizes[7]),
            cos: take(sizes[8]),
            sin: take(sizes[9]),
        }
    }
}

/// A tensor-parallel rank's buffers for what the ranks exchange.
#[derive(Default)]
pub(crate) struct TpBufs {
    /// A projection's whole input (every rank's columns).
    pub(crate) input: Vec<f32>,
    /// The rank's part of a projection's output.
    pub(crate) part: Vec<f32>,
}
