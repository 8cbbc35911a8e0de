//! The transformer forward pass over a batch of sequences with paged KV.
//!
//! One step takes any mix of prefill chunks and decode tokens. All tokens of
//! the step are stacked into one activation matrix, so every weight matrix is
//! streamed once per step whatever the batch size. Attention is per sequence:
//! the K/V of every token of the step are written into the sequence's blocks
//! first, then each query reads positions `0..=pos` of its own sequence from
//! the blocks, so chunk boundaries and block placement never show in results
//! (see the invariant in [`crate::kernels`]).

use anyhow::{bail, ensure};

use crate::bf16dot;
use crate::kernels::{self, AttnQuery, KvElem, Linear};
use crate::kv::{KvCache, KvDtype};
use crate::profile::{self, mark, Op};
use crate::qkernels::{self, QActs, QLinear, QType};
use crate::team;
use crate::tp::rank::RankTp;
use crate::weights::{LayerWeights, Mat, TensorRef, Weights};
pub use crate::workspace::Workspace;
use crate::workspace::{AttnMerge, AttnTask, Bufs, Dims, TokenMeta, TpBufs};
use crate::{Arch, ModelConfig, BLOCK_SIZE};

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
    /// RoPE inverse frequencies, `head_dim / 2`.
    inv_freq: Vec<f32>,
    /// Block-format matrices multiply activations quantised to 8 bits per
    /// 32-value block ([`qkernels`], llama.cpp's numerics and speed: the
    /// default) instead of the f32 activations (the f32 path's results bit
    /// for bit, with the weights read in their blocks). With it, BF16
    /// matrices multiply activations rounded to bf16 where the CPU has bf16
    /// dot products ([`bf16dot`]).
    int8_activations: bool,
    /// Set on one rank of a tensor-parallel model ([`crate::tp`]).
    tp: Option<RankTp>,
}

/// Queries per attention task.
const ATTN_ROWS: usize = 32;

/// Query heads that sweep the key tiles together (a task's rows times its
/// heads, in slices of this many).
const ATTN_QUERIES: usize = 96;

/// A raw pointer that may cross threads; users guarantee disjoint access.
#[derive(Clone, Copy)]
struct RawPtr(*mut f32);
// SAFETY: see the type's doc: its users write disjoint ranges only.
unsafe impl Send for RawPtr {}
// SAFETY: as for `Send`; sharing the pointer gives no access of its own.
unsafe impl Sync for RawPtr {}

impl RawPtr {
    /// A method (not a field access) so closures capture the whole wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// Whether steps may run on the thread team: unless the process says
/// `PDKV_TEAM=0` (the rayon pool alone, for comparison).
fn use_team() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("PDKV_TEAM").map_or(true, |v| v.trim() != "0"))
}

/// Fewest gate values per SwiGLU job: a job must outweigh a region's cost.
const SILU_CHUNK: usize = 512;

/// Rows per parallel job in per-row kernels.
const ROWS_PER_JOB: usize = 8;

/// Applies `f(row_index, row)` to every `len`-float row of `buf`, in parallel
/// when there are enough rows. Each row is processed independently.
fn for_rows(buf: &mut [f32], len: usize, f: impl Fn(usize, &mut [f32]) + Sync) {
    if buf.len() <= len * ROWS_PER_JOB {
        buf.chunks_exact_mut(len)
            .enumerate()
            .for_each(|(i, r)| f(i, r));
    } else {
        team::par_chunks_mut(buf, len * ROWS_PER_JOB, |c, rows| {
            for (i, r) in rows.chunks_exact_mut(len).enumerate() {
                f(c * ROWS_PER_JOB + i, r)
            }
        });
    }
}

impl Model {
    pub fn new(config: ModelConfig, weights: Weights) -> Model {
        let inv_freq = kernels::rope_inv_freq(config.rope_theta, config.head_dim);
        // Block-format matrices take int8 activations unless the process
        // says PDKV_INT8_ACTIVATIONS=0 (f32 activations, the f32 path's bits).
        let int8_activations =
            std::env::var("PDKV_INT8_ACTIVATIONS").map_or(true, |v| v.trim() != "0");
        Model {
            config,
            weights,
            inv_freq,
            int8_activations,
            tp: None,
        }
    }

    /// Makes this model one rank of a tensor-parallel model: its weights
    /// are the rank's shard, and it meets the other ranks in every step.
    pub fn with_tp(mut self, tp: RankTp) -> Model {
        self.tp = Some(tp);
        self
    }

    /// The rank's part, when this is one rank of a tensor-parallel model.
    pub fn tp(&self) -> Option<&RankTp> {
        self.tp.as_ref()
    }

    /// Chooses how block-format matrices are multiplied (see the field).
    pub fn with_int8_activations(mut self, on: bool) -> Model {
        self.int8_activations = on;
        self
    }

    pub fn int8_activations(&self) -> bool {
        self.int8_activations
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
        kv: &KvCache,
        ws: &mut Workspace,
        seqs: &[SeqInput<'_>],
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        self.forward_with_rows(kv, ws, seqs, &[], logits)
    }

    /// [`Model::forward`], where sequence `i` with `every_row[i]` set gets a
    /// logits row for each of its tokens (in order, instead of the one
    /// `want_logits` asks for): prompt log-probabilities need them. Missing
    /// entries of `every_row` count as unset. Each row is the same as the one
    /// `want_logits` would give at that position.
    pub fn forward_with_rows(
        &self,
        kv: &KvCache,
        ws: &mut Workspace,
        seqs: &[SeqInput<'_>],
        every_row: &[bool],
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        logits.clear();
        let cfg = &self.config;
        ensure!(
            ws.dims == Dims::of(cfg),
            "the workspace was made for a different model shape"
        );
        ensure!(
            kv.num_layers() == cfg.num_layers && kv.kv_dim() == cfg.kv_dim(),
            "the KV cache was made for a different model shape ({} layers x {} floats, model has {} x {})",
            kv.num_layers(),
            kv.kv_dim(),
            cfg.num_layers,
            cfg.kv_dim()
        );
        self.validate(kv, ws, seqs)?;
        if seqs.is_empty() {
            return Ok(());
        }

        ws.tokens.clear();
        ws.logit_rows.clear();
        let mut max_ctx = 0;
        for (si, s) in seqs.iter().enumerate() {
            let every = every_row.get(si).copied().unwrap_or(false);
            for i in 0..s.tokens.len() {
                ws.tokens.push(TokenMeta {
                    seq: si,
                    pos: s.start_pos + i,
                });
                if every {
                    ws.logit_rows.push(ws.tokens.len() - 1);
                }
            }
            if s.want_logits && !every {
                ws.logit_rows.push(ws.tokens.len() - 1);
            }
            max_ctx = max_ctx.max(s.start_pos + s.tokens.len());
        }
        let pool = match &self.tp {
            Some(tp) => &*tp.threads,
            None => kernels::thread_pool(),
        };
        ws.reserve(ws.tokens.len())?;
        // A whole model's step runs on the process's thread team when it is
        // free (see `crate::team`); a tensor-parallel rank, or a second
        // model stepping at the same time, runs on its rayon pool.
        if self.tp.is_none() && use_team() {
            if let Some(team) = crate::dispatch::team() {
                if let Some(r) = team.enter(|| self.run_step(kv, ws, seqs, logits)) {
                    return r;
                }
            }
        }
        pool.install(|| self.run_step(kv, ws, seqs, logits))
    }

    /// Checks a step's inputs so that the math below cannot index out of
    /// bounds or race: tokens in vocabulary, block tables long enough with
    /// ids in range, and no block written by one sequence while another
    /// sequence of the step uses it.
    fn validate(
        &self,
        kv: &KvCache,
        ws: &mut Workspace,
        seqs: &[SeqInput<'_>],
    ) -> anyhow::Result<()> {
        let vocab = self.config.vocab_size;
        ws.written.clear();
        for (si, s) in seqs.iter().enumerate() {
            ensure!(
                !s.tokens.is_empty(),
                "sequence {si} of the step has no tokens"
            );
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= vocab) {
                bail!("sequence {si}: token id {t} is outside the vocabulary of {vocab}");
            }
            let end = s.start_pos + s.tokens.len();
            let need = end.div_ceil(BLOCK_SIZE);
            ensure!(
                s.block_table.len() >= need,
                "sequence {si}: {} blocks cover {} positions, need {end}",
                s.block_table.len(),
                s.block_table.len() * BLOCK_SIZE
            );
            if let Some(&b) = s.block_table[..need]
                .iter()
                .find(|&&b| b as usize >= kv.num_blocks())
            {
                bail!(
                    "sequence {si}: block id {b} is outside the cache of {} blocks",
                    kv.num_blocks()
                );
            }
            for &b in &s.block_table[s.start_pos / BLOCK_SIZE..need] {
                ws.written.push((b, si));
            }
        }
        ws.written.sort_unstable();
        ws.written.dedup();
        for pair in ws.written.windows(2) {
            ensure!(
                pair[0].0 != pair[1].0,
                "block {} is written by sequences {} and {} in the same step",
                pair[0].0,
                pair[0].1,
                pair[1].1
            );
        }
        for (si, s) in seqs.iter().enumerate() {
            let need = (s.start_pos + s.tokens.len()).div_ceil(BLOCK_SIZE);
            for &b in &s.block_table[..need] {
                if let Ok(i) = ws.written.binary_search_by_key(&b, |&(wb, _)| wb) {
                    let writer = ws.written[i].1;
                    ensure!(
                        writer == si,
                        "block {b} is written by sequence {writer} while sequence {si} reads it"
                    );
                }
            }
        }
        Ok(())
    }

    /// One step, its inputs checked and its token list built: embeddings,
    /// the layers, then the logits of the rows that want them.
    fn run_step(
        &self,
        kv: &KvCache,
        ws: &mut Workspace,
        seqs: &[SeqInput<'_>],
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        let t_all = ws.tokens.len();

        let tokens = std::mem::take(&mut ws.tokens);
        let mut tasks = std::mem::take(&mut ws.tasks);
        let mut merges = std::mem::take(&mut ws.merges);
        let mut parts = std::mem::take(&mut ws.parts);
        let logit_rows = std::mem::take(&mut ws.logit_rows);
        let mut qa = std::mem::take(&mut ws.qacts);
        let mut tpb = std::mem::take(&mut ws.tp);
        let mut b = ws.bufs(t_all);

        profile::start();
        self.embed(seqs, &tokens, &mut b)?;
        let slots = plan_attention(&self.config, seqs, &mut tasks, &mut merges);
        parts.resize(slots * (self.config.head_dim + 2), 0.0);
        mark(Op::Embed);
        let step = Step {
            kv,
            seqs,
            tokens: &tokens,
            tasks: &tasks,
            merges: &merges,
            parts: RawPtr(parts.as_mut_ptr()),
        };
        for (li, lw) in self.weights.layers.iter().enumerate() {
            self.attention_block(&step, li, lw, &mut b, &mut qa, &mut tpb)?;
            self.mlp_block(&step, li, lw, &mut b, &mut qa, &mut tpb)?;
        }
        self.lm_head(&logit_rows, &mut b, &mut qa, &mut tpb, logits)?;
        mark(Op::LmHead);

        ws.tokens = tokens;
        ws.tasks = tasks;
        ws.merges = merges;
        ws.parts = parts;
        ws.logit_rows = logit_rows;
        ws.qacts = qa;
        ws.tp = tpb;
        Ok(())
    }

    /// The embedding row and the rotary table of every token of the step.
    /// A rank of a tensor-parallel model holds some rows of each matrix
    /// and exchanges what it computed with the other ranks ([`crate::tp`]):
    /// it looks up the tokens of its vocabulary rows and gets the others'
    /// from their ranks.
    fn embed(
        &self,
        seqs: &[SeqInput<'_>],
        tokens: &[TokenMeta],
        b: &mut Bufs<'_>,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let w = &self.weights;
        let hidden = cfg.hidden_size;
        let half = cfg.head_dim / 2;
        let t_all = tokens.len();
        let tp = self.tp.as_ref();
        let vocab0 = tp.map_or(0, |t| t.shard.vocab.start);
        let vocab_here = tp.map_or(cfg.vocab_size, |t| t.shard.vocab.len());

        let mut row = 0;
        for s in seqs {
            for &tok in s.tokens {
                let out = &mut b.x[row * hidden..(row + 1) * hidden];
                match (tok as usize)
                    .checked_sub(vocab0)
                    .filter(|&t| t < vocab_here)
                {
                    Some(t) => w.row_into(&w.embed, t, out),
                    None => out.fill(0.0),
                }
                row += 1;
            }
        }
        if let Some(tp) = tp {
            let toks = seqs.iter().flat_map(|s| s.tokens.iter().copied());
            tp.share_embedding(toks, &mut b.x[..t_all * hidden])?;
        }
        for (i, tm) in tokens.iter().enumerate() {
            let (c, s) = (
                &mut b.cos[i * half..(i + 1) * half],
                &mut b.sin[i * half..(i + 1) * half],
            );
            kernels::rope_cos_sin(tm.pos, &self.inv_freq, c, s);
        }
        Ok(())
    }

    /// Layer `li`'s attention block: norm, q/k/v, the step's K/V into the
    /// cache, attention, `o_proj`, and the residual update.
    fn attention_block(
        &self,
        step: &Step<'_, '_>,
        li: usize,
        lw: &LayerWeights,
        b: &mut Bufs<'_>,
        qa: &mut QActs,
        tpb: &mut TpBufs,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let w = &self.weights;
        let (hd, eps) = (cfg.head_dim, cfg.rms_norm_eps);
        let (q_dim, kv_dim) = (cfg.q_dim(), cfg.kv_dim());
        let t_all = step.tokens.len();

        self.block_in(
            (b.x, b.h, t_all),
            qa,
            &lw.attn_norm,
            [
                (w.mat(&lw.wq), q_dim, &mut *b.q),
                (w.mat(&lw.wk), kv_dim, &mut *b.k),
                (w.mat(&lw.wv), kv_dim, &mut *b.v),
            ],
        );
        mark(Op::Qkv);
        let qn = lw
            .q_norm
            .as_ref()
            .filter(|_| cfg.arch == Arch::Qwen3)
            .map(|t| w.get(t));
        let kn = lw
            .k_norm
            .as_ref()
            .filter(|_| cfg.arch == Arch::Qwen3)
            .map(|t| w.get(t));
        norm_rope(b.q, hd, qn, eps, b.cos, b.sin);
        norm_rope(b.k, hd, kn, eps, b.cos, b.sin);
        mark(Op::Rope);
        step.write_kv(li, kv_dim, b.k, b.v);
        mark(Op::WriteKv);
        step.attend(li, hd, q_dim, b.q, b.att);
        mark(Op::Attention);
        self.block_out(
            (b.att, t_all, q_dim),
            |t| &t.q_widths,
            (w.mat(&lw.wo), Op::OProj),
            (&mut *b.x, &mut *b.h),
            (qa, tpb),
            (li, "the attention output", "o_proj"),
        )
    }

    /// A block's start: each of the `t` rows of the residual stream `x`
    /// under RMSNorm with the weight `norm` (into `h`), projected by every
    /// matrix of `outs` (`n` features each).
    fn block_in<const N: usize>(
        &self,
        (x, h, t): (&[f32], &mut [f32], usize),
        qa: &mut QActs,
        norm: &TensorRef,
        outs: [(Mat<'_>, usize, &mut [f32]); N],
    ) {
        let (hidden, eps) = (self.config.hidden_size, self.config.rms_norm_eps);
        let norm = self.weights.get(norm);
        for_rows(h, hidden, |i, h| {
            kernels::rmsnorm(&x[i * hidden..(i + 1) * hidden], norm, eps, h)
        });
        mark(Op::Norm);
        project(self.int8_activations, qa, h, t, hidden, outs);
    }

    /// A block's end: its output (`[t, k]` as this rank computed it)
    /// gathered from every rank (`widths`), projected by `wm` into the
    /// residual update `h` (timed as `op`), and added into the residual
    /// stream `x`; `names` (the output's, the projection's) for errors.
    fn block_out(
        &self,
        (out, t_all, k): (&[f32], usize, usize),
        widths: impl Fn(&RankTp) -> &Vec<usize>,
        (wm, op): (Mat<'_>, Op),
        (x, h): (&mut [f32], &mut [f32]),
        (qa, tpb): (&mut QActs, &mut TpBufs),
        (li, out_name, proj_name): (usize, &str, &str),
    ) -> anyhow::Result<()> {
        let tp = self.tp.as_ref();
        let hidden_here = tp.map_or(self.config.hidden_size, |t| t.shard.hidden.len());
        let (input, input_k) = gather_input(tp, (out, t_all, k), widths, &mut tpb.input, &|| {
            format!("{out_name} of layer {li}")
        })?;
        project_residual(
            self.int8_activations,
            qa,
            (input, t_all, input_k),
            (wm, hidden_here),
            tp,
            &mut tpb.part,
            h,
            &|| format!("{proj_name} of layer {li}"),
        )?;
        mark(op);
        add_into(x, h);
        mark(Op::Residual);
        Ok(())
    }

    /// Layer `li`'s MLP block: norm, gate and up, SwiGLU, `down_proj`, and
    /// the residual update.
    fn mlp_block(
        &self,
        step: &Step<'_, '_>,
        li: usize,
        lw: &LayerWeights,
        b: &mut Bufs<'_>,
        qa: &mut QActs,
        tpb: &mut TpBufs,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let w = &self.weights;
        let inter = cfg.intermediate_size;
        let t_all = step.tokens.len();

        self.block_in(
            (b.x, b.h, t_all),
            qa,
            &lw.ffn_norm,
            [
                (w.mat(&lw.w_gate), inter, &mut *b.gate),
                (w.mat(&lw.w_up), inter, &mut *b.up),
            ],
        );
        mark(Op::GateUp);
        {
            // Element by element, so the buffer splits anywhere: a single
            // decode row's 1,536 exponentials go on every thread too.
            let up = &*b.up;
            let chunk = SILU_CHUNK.max(b.gate.len().div_ceil(team::threads()));
            team::par_chunks_mut(b.gate, chunk, |c, g| {
                kernels::silu_mul(g, &up[c * chunk..][..g.len()])
            });
        }
        mark(Op::Silu);
        self.block_out(
            (b.gate, t_all, inter),
            |t| &t.inter_widths,
            (w.mat(&lw.w_down), Op::Down),
            (&mut *b.x, &mut *b.h),
            (qa, tpb),
            (li, "the MLP activation", "down_proj"),
        )
    }

    /// Final norm and LM head, only for the rows that want logits (a
    /// tensor-parallel rank's columns gathered to rank 0).
    fn lm_head(
        &self,
        logit_rows: &[usize],
        b: &mut Bufs<'_>,
        qa: &mut QActs,
        tpb: &mut TpBufs,
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        let cfg = &self.config;
        let w = &self.weights;
        let (hidden, eps) = (cfg.hidden_size, cfg.rms_norm_eps);
        let int8 = self.int8_activations;
        let tp = self.tp.as_ref();
        let vocab_here = tp.map_or(cfg.vocab_size, |t| t.shard.vocab.len());

        let final_norm = w.get(&w.final_norm);
        let n_out = logit_rows.len();
        for (i, &r) in logit_rows.iter().enumerate() {
            kernels::rmsnorm(
                &b.x[r * hidden..(r + 1) * hidden],
                final_norm,
                eps,
                &mut b.h[i * hidden..(i + 1) * hidden],
            );
        }
        mark(Op::Norm);
        if n_out > 0 {
            let mut local = match tp {
                Some(_) => std::mem::take(&mut tpb.part),
                None => std::mem::take(logits),
            };
            local.resize(n_out * vocab_here, 0.0);
            project(
                int8,
                qa,
                &b.h[..n_out * hidden],
                n_out,
                hidden,
                [(w.mat(&w.lm_head), vocab_here, &mut local[..])],
            );
            match tp {
                Some(tp) => {
                    tp.gather_logits(&local, n_out, logits)?;
                    tpb.part = local;
                }
                None => *logits = local,
            }
        }
        Ok(())
    }
}

/// What every layer of a step reads: the cache, the sequences, where each
/// token of the step comes from and the attention work units.
struct Step<'a, 's> {
    kv: &'a KvCache,
    seqs: &'a [SeqInput<'s>],
    tokens: &'a [TokenMeta],
    tasks: &'a [AttnTask],
    merges: &'a [AttnMerge],
    /// The split tasks' partial slots (`head_dim + 2` floats each).
    parts: RawPtr,
}

impl Step<'_, '_> {
    /// Writes the K/V rows (`k`, `v`: `[T, kv_dim]`) of the step's tokens
    /// into layer `li` of the cache, before any query reads them.
    fn write_kv(&self, li: usize, kv_dim: usize, k: &[f32], v: &[f32]) {
        for (i, tm) in self.tokens.iter().enumerate() {
            let s = &self.seqs[tm.seq];
            let block = s.block_table[tm.pos / BLOCK_SIZE] as usize;
            // SAFETY: `validate` checked the block id and that no other
            // sequence of the step uses this block; no reader runs yet.
            unsafe {
                self.kv.write_token(
                    block,
                    li,
                    tm.pos % BLOCK_SIZE,
                    &k[i * kv_dim..(i + 1) * kv_dim],
                    &v[i * kv_dim..(i + 1) * kv_dim],
                )
            };
        }
    }

    /// Attention of every query row of the step (`q`: `[T, q_dim]`) over
    /// layer `li`'s cache, into `att` (`[T, q_dim]`), a task per thread job.
    fn attend(&self, li: usize, hd: usize, q_dim: usize, q: &[f32], att: &mut [f32]) {
        match self.kv.dtype() {
            KvDtype::F32 => self.attend_as::<f32>(li, hd, q_dim, q, att),
            KvDtype::F16 => self.attend_as::<half::f16>(li, hd, q_dim, q, att),
            KvDtype::BF16 => self.attend_as::<half::bf16>(li, hd, q_dim, q, att),
            KvDtype::Q8_0 => self.attend_as::<kernels::Q8Byte>(li, hd, q_dim, q, att),
        }
    }

    /// [`Self::attend`] over a cache of `E` elements: the tasks in
    /// parallel, then the folds of the split ones.
    fn attend_as<E: KvElem>(&self, li: usize, hd: usize, q_dim: usize, q: &[f32], att: &mut [f32]) {
        let scale = (1.0 / (hd as f64).sqrt()) as f32;
        let (kv, seqs) = (self.kv, self.seqs);
        let att = RawPtr(att.as_mut_ptr());
        let parts = self.parts;
        let tokens = &self.tokens;
        let slot_len = hd + 2;
        team::par_for(self.tasks.len(), |ti| {
            let task = &self.tasks[ti];
            let s = &seqs[task.seq];
            let need = (s.start_pos + s.tokens.len()).div_ceil(BLOCK_SIZE);
            let rows = kv.paged_rows::<E>(li, task.kv_head, hd, &s.block_table[..need]);
            // The task's queries go through the tiles together, up
            // to `ATTN_QUERIES` at a time.
            let mut qs = [AttnQuery::EMPTY; ATTN_QUERIES];
            let mut slots = [0usize; ATTN_QUERIES];
            let mut n = 0;
            // Tasks cover disjoint (row, head) slices of `att` and disjoint
            // slots of `parts` (sized for the plan); the blocks hold every
            // position up to each query's, written before attention or by
            // earlier steps; a segment task's queries reach its segment.
            let run = |qs: &mut [AttnQuery], slots: &[usize]| match task.seg {
                // SAFETY: as above.
                None => unsafe { kernels::attend_many(&rows, hd, scale, qs) },
                // SAFETY: as above.
                Some(seg) => unsafe {
                    kernels::attend_segment(&rows, hd, scale, seg, qs);
                    for (q, &slot) in qs.iter().zip(slots) {
                        let p = q.partial();
                        let at = parts.get().add(slot * slot_len + hd);
                        *at = p.m;
                        *at.add(1) = p.l;
                    }
                },
            };
            let heads = task.h1 - task.h0;
            let queries = (task.row1 - task.row0) * heads;
            let from = task.seg.map_or(0, |seg| seg * kernels::SEGMENT);
            for (r, tm) in tokens.iter().enumerate().take(task.row1).skip(task.row0) {
                if tm.pos < from {
                    continue;
                }
                for head in task.h0..task.h1 {
                    let off = r * q_dim + head * hd;
                    let i = (r - task.row0) * heads + head - task.h0;
                    slots[n] = task.slot + task.seg.unwrap_or(0) * queries + i;
                    let out = match task.seg {
                        None => att.get().wrapping_add(off),
                        Some(_) => parts.get().wrapping_add(slots[n] * slot_len),
                    };
                    qs[n] = AttnQuery::new(q[off..off + hd].as_ptr(), tm.pos, out);
                    n += 1;
                    if n == ATTN_QUERIES {
                        run(&mut qs, &slots);
                        n = 0;
                    }
                }
            }
            run(&mut qs[..n], &slots[..n]);
        });
        team::par_for(self.merges.len(), |mi| {
            let m = &self.merges[mi];
            let t = &m.task;
            let heads = t.h1 - t.h0;
            let queries = (t.row1 - t.row0) * heads;
            for (r, tm) in tokens.iter().enumerate().take(t.row1).skip(t.row0) {
                for head in t.h0..t.h1 {
                    let i = (r - t.row0) * heads + head - t.h0;
                    // SAFETY: the merge's (row, head) slices of `att` are its
                    // own; its slots were written by its segment tasks, done.
                    let out = unsafe {
                        std::slice::from_raw_parts_mut(att.get().add(r * q_dim + head * hd), hd)
                    };
                    let mut total = AttnQuery::EMPTY.partial();
                    for seg in 0..=tm.pos / kernels::SEGMENT {
                        let slot = t.slot + seg * queries + i;
                        // SAFETY: as above.
                        let p = unsafe {
                            std::slice::from_raw_parts(parts.get().add(slot * slot_len), slot_len)
                        };
                        kernels::fold(&mut total, out, p[hd], p[hd + 1], &p[..hd], seg == 0);
                    }
                    kernels::finish(&total, out);
                }
            }
        });
    }
}

#[cfg(test)]
thread_local! {
    /// A test's thread count for [`plan_attention`] (steps of this thread).
    static PLAN_THREADS: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// The threads [`plan_attention`] makes units for: the team's (a test may
/// say another number, to reach every shape of plan on any machine).
fn plan_threads() -> usize {
    #[cfg(test)]
    if let Some(n) = PLAN_THREADS.with(|c| c.get()) {
        return n;
    }
    team::threads()
}

/// Attention work units: (sequence, KV head, up to ATTN_ROWS queries),
/// every query head of the group, and the folds of split units; returns the
/// partial slots the split units use. Too few units to keep the math
/// threads busy (decode at small batch), a unit whose queries reach past
/// the first segment is split into one unit per segment (its K/V rows still
/// read once, by one thread each); fewer units than threads, each query
/// head is its own unit. The kernels give the same bits either way.
fn plan_attention(
    cfg: &ModelConfig,
    seqs: &[SeqInput<'_>],
    tasks: &mut Vec<AttnTask>,
    merges: &mut Vec<AttnMerge>,
) -> usize {
    let group = cfg.num_heads / cfg.num_kv_heads;
    let threads = plan_threads();
    let units = cfg.num_kv_heads
        * seqs
            .iter()
            .map(|s| s.tokens.len().div_ceil(ATTN_ROWS))
            .sum::<usize>();
    let few = units < 2 * threads;
    tasks.clear();
    merges.clear();
    let mut row0 = 0;
    let mut slots = 0;
    for (si, s) in seqs.iter().enumerate() {
        let n = s.tokens.len();
        for kv_head in 0..cfg.num_kv_heads {
            let mut r = 0;
            while r < n {
                let r1 = (r + ATTN_ROWS).min(n);
                let (h0, h1) = (kv_head * group, (kv_head + 1) * group);
                let t = AttnTask {
                    seq: si,
                    kv_head,
                    row0: row0 + r,
                    row1: row0 + r1,
                    h0,
                    h1,
                    seg: None,
                    slot: slots,
                };
                let segs = (s.start_pos + r1 - 1) / kernels::SEGMENT + 1;
                if few && segs > 1 {
                    merges.push(AttnMerge { task: t });
                    tasks.extend((0..segs).map(|seg| AttnTask {
                        seg: Some(seg),
                        ..t
                    }));
                    slots += segs * (r1 - r) * group;
                } else {
                    tasks.push(t);
                }
                r = r1;
            }
        }
        row0 += n;
    }
    // Fewer units than threads: each query head its own unit. (With as
    // many units as threads or more, a KV head's query heads stay
    // together, each K/V row read once for all of them: on an AMD Zen 3
    // with 2 threads, batch-1 decode at context 128 spent 0.46-0.65 ms a
    // step in attention with its 3 KV heads as 3 units, 0.53-0.80 with 9.)
    if merges.is_empty() && group > 1 && tasks.len() < threads {
        for i in 0..tasks.len() {
            let t = tasks[i];
            tasks[i].h1 = t.h0 + 1;
            tasks.extend((t.h0 + 1..t.h1).map(|h| AttnTask {
                h0: h,
                h1: h + 1,
                ..t
            }));
        }
    } else if merges.is_empty() && few && group > 1 && !tasks.len().is_multiple_of(threads) {
        // Units that do not divide among the threads (3 KV heads on 2):
        // the last ones' query heads in two parts, claimed after the whole
        // ones (batch-1 decode on 2 threads, alternating in one process:
        // attention 8-12 % shorter, Q4_1 1.015-1.025, Q4_K_M 1.017).
        let left = tasks.len() % threads;
        let at = tasks.len() - left;
        for i in at..at + left {
            let t = tasks[i];
            let mid = t.h0 + (t.h1 - t.h0).div_ceil(2);
            tasks[i].h1 = mid;
            tasks.push(AttnTask { h0: mid, ..t });
        }
    }
    slots
}

/// `y = x · wᵀ` for each `(w, n, y)` of a group sharing the activations
/// `x` (`[m, k]`): f32 matrices through [`kernels::matmul_many`], block-format
/// ones through [`qkernels::qmatmul_many`] (`x` quantised once, into `qa`).
fn project<const N: usize>(
    int8: bool,
    qa: &mut QActs,
    x: &[f32],
    m: usize,
    k: usize,
    outs: [(Mat<'_>, usize, &mut [f32]); N],
) {
    // Reduced activations (`int8`): integer block formats take int8 ones,
    // BF16 matrices bf16 ones where the CPU has bf16 dot products; F16 (and
    // BF16 elsewhere) multiply f32 activations, widened in registers.
    let blocks = outs
        .iter()
        .filter(|o| matches!(o.0, Mat::Quant(..)))
        .count();
    let int8_of = |w: &Mat<'_>| matches!(w, Mat::Quant(ty, _) if int8 && !ty.is_half());
    let bf16_of = |w: &Mat<'_>| {
        int8 && matches!(w, Mat::Quant(QType::BF16, _))
            && k.is_multiple_of(bf16dot::STEP)
            && bf16dot::available()
    };
    let int8s = outs.iter().filter(|o| int8_of(&o.0)).count();
    let bf16s = outs.iter().filter(|o| bf16_of(&o.0)).count();
    if int8s > 0 {
        qa.quantize_for_step(&x[..m * k], m, k);
    }
    if bf16s > 0 {
        qa.round_bf16(&x[..m * k]);
    }
    mark(Op::Quantize);
    if blocks == 0 {
        let mut ls = outs.map(|(w, n, y)| match w {
            Mat::F32(w) => Linear { w, n, y },
            Mat::Quant(..) => unreachable!("counted none"),
        });
        kernels::matmul_many(x, m, k, &mut ls);
    } else if int8s == N {
        let mut ls = outs.map(|(w, n, y)| match w {
            Mat::Quant(ty, w) => QLinear { ty, w, n, y },
            Mat::F32(_) => unreachable!("counted all"),
        });
        qkernels::qmatmul_many(qa, &mut ls);
    } else if bf16s == N {
        let mut ls = outs.map(|(w, n, y)| match w {
            Mat::Quant(ty, w) => kernels::BlockLinear { ty, w, n, y },
            Mat::F32(_) => unreachable!("counted all"),
        });
        bf16dot::matmul_many(qa.bf16(), m, k, &mut ls);
    } else if blocks == N && int8s == 0 && bf16s == 0 {
        // f32 activations: block-format rows dequantised into the f32 tiles.
        let mut ls = outs.map(|(w, n, y)| match w {
            Mat::Quant(ty, w) => kernels::BlockLinear { ty, w, n, y },
            Mat::F32(_) => unreachable!("counted all"),
        });
        kernels::matmul_blocks_many(x, m, k, &mut ls);
    } else {
        for (w, n, y) in outs {
            let (int8, bf16) = (int8_of(&w), bf16_of(&w));
            match w {
                Mat::F32(w) => kernels::matmul(x, m, k, w, n, y),
                Mat::Quant(ty, w) if int8 => {
                    qkernels::qmatmul_many(qa, &mut [QLinear { ty, w, n, y }])
                }
                Mat::Quant(ty, w) => {
                    let l = &mut [kernels::BlockLinear { ty, w, n, y }];
                    if bf16 {
                        bf16dot::matmul_many(qa.bf16(), m, k, l)
                    } else {
                        kernels::matmul_blocks_many(x, m, k, l)
                    }
                }
            }
        }
    }
}

/// A projection's input as a rank computed it (`local`, `[t, k]`: its
/// columns) and as the whole model has it: `local` itself on a single rank,
/// else every rank's columns gathered into `buf`. Gives the input and its
/// width.
fn gather_input<'a>(
    tp: Option<&RankTp>,
    (local, t, k): (&'a [f32], usize, usize),
    widths: impl Fn(&RankTp) -> &Vec<usize>,
    buf: &'a mut Vec<f32>,
    what: &dyn Fn() -> String,
) -> anyhow::Result<(&'a [f32], usize)> {
    let Some(tp) = tp else {
        return Ok((local, k));
    };
    let widths = widths(tp);
    let total = widths.iter().sum::<usize>();
    buf.resize(t * total, 0.0);
    tp.comm
        .all_gather_cols(tp.shard.rank, local, widths, buf, &what())?;
    Ok((&buf[..], total))
}

/// `h = x · wᵀ` (`x` is `[m, k]`, `h` the residual update `[m, hidden]`).
/// A rank of a tensor-parallel model computes its `n` rows of `w` into
/// `part` and gets the other ranks' columns of `h` from them.
#[allow(clippy::too_many_arguments)]
fn project_residual(
    int8: bool,
    qa: &mut QActs,
    (x, m, k): (&[f32], usize, usize),
    (w, n): (Mat<'_>, usize),
    tp: Option<&RankTp>,
    part: &mut Vec<f32>,
    h: &mut [f32],
    what: &dyn Fn() -> String,
) -> anyhow::Result<()> {
    let Some(tp) = tp else {
        project(int8, qa, x, m, k, [(w, n, h)]);
        return Ok(());
    };
    part.resize(m * n, 0.0);
    project(int8, qa, x, m, k, [(w, n, &mut part[..])]);
    tp.comm
        .all_gather_cols(tp.shard.rank, part, &tp.hidden_widths, h, &what())
}

/// Per-head RMSNorm (Qwen3's q/k norm, when `norm` is given) then RoPE on
/// every head of every row of `buf`; row `i` uses `cos`/`sin` row `i`.
fn norm_rope(buf: &mut [f32], hd: usize, norm: Option<&[f32]>, eps: f32, cos: &[f32], sin: &[f32]) {
    let half = hd / 2;
    let tokens = cos.len() / half;
    let row_len = buf.len() / tokens.max(1);
    for_rows(buf, row_len, |i, r| {
        let (c, s) = (
            &cos[i * half..(i + 1) * half],
            &sin[i * half..(i + 1) * half],
        );
        for head in r.chunks_exact_mut(hd) {
            if let Some(nw) = norm {
                kernels::rmsnorm_inplace(head, nw, eps);
            }
            kernels::rope_apply(head, c, s);
        }
    });
}

/// `x += d`, element-wise.
fn add_into(x: &mut [f32], d: &[f32]) {
    for (a, b) in x.iter_mut().zip(d) {
        *a += *b;
    }
}

#[cfg(test)]
mod tests {
    use super::PLAN_THREADS;
    use crate::{init, load_model, Arch, KvCache, KvDtype, SeqInput, Workspace, BLOCK_SIZE};
    use pdkv_vmem::Pool;

    /// A batch-1 decode step's logits are the same bits whether each query
    /// head is a unit of its own (fewer KV heads than threads), a KV head's
    /// query heads share one, or the keys are split into segments (the
    /// tiny model: 2 KV heads of 2 query heads each; the positions the
    /// step rewrites get the K and V the prefill wrote, from the same
    /// tokens).
    #[test]
    fn attention_units_give_the_same_logits_whatever_the_threads() {
        let dir = tempfile::tempdir().unwrap();
        init::write_random_checkpoint(Arch::Llama, "tiny", 11, dir.path()).unwrap();
        let pool = Pool::default();
        let m = load_model(dir.path(), &pool, &mut |_| {}).unwrap();
        let cfg = m.model.config();
        assert!(cfg.num_heads > cfg.num_kv_heads && cfg.num_kv_heads == 2);
        // Past the first segment, so the split into segments is reached too.
        let prompt: Vec<u32> = (0..300).map(|i| (i * 7 + 3) % 250).collect();
        let blocks = (prompt.len() + 1).div_ceil(BLOCK_SIZE);
        let table: Vec<u32> = (0..blocks as u32).collect();
        let mut per_plan = Vec::new();
        // A step at position 40 (one segment): 1 thread, the KV heads whole;
        // 3 or 8, one unit per query head. At the last position (two
        // segments): 1 thread, whole; 3 or 8, a unit per segment.
        for threads in [1, 3, 8] {
            let kv = KvCache::new(&pool, cfg, blocks, KvDtype::F16).unwrap();
            let mut ws = Workspace::new(&pool, cfg, prompt.len()).unwrap();
            let mut logits = Vec::new();
            let mut step = |tokens: &[u32], start_pos: usize, logits: &mut Vec<f32>| {
                let seq = SeqInput {
                    tokens,
                    start_pos,
                    block_table: &table,
                    want_logits: true,
                };
                m.model.forward(&kv, &mut ws, &[seq], logits).unwrap();
            };
            step(&prompt[..prompt.len() - 1], 0, &mut logits);
            PLAN_THREADS.with(|c| c.set(Some(threads)));
            let mut got = Vec::new();
            for pos in [40, prompt.len() - 1] {
                step(&prompt[pos..pos + 1], pos, &mut logits);
                got.push(logits.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            }
            PLAN_THREADS.with(|c| c.set(None));
            per_plan.push(got);
        }
        assert_eq!(
            per_plan[0], per_plan[1],
            "query heads as units of their own"
        );
        assert_eq!(per_plan[0], per_plan[2], "segments as units");
    }

    /// Every plan covers each (token, query head) of a step exactly once,
    /// split into units or not: SmolLM2's 3 KV heads of 3 query heads on
    /// 1 to 8 threads (2 threads: two whole KV heads and the third in two
    /// parts), and the tiny model's shape, at batch 1, a few sequences and
    /// a prefill chunk, in one segment and past it.
    #[test]
    fn attention_plans_cover_each_query_head_of_a_step_once() {
        let mut cfg = crate::init::preset_config(Arch::Llama, "tiny").unwrap();
        let tokens = [0u32; 40];
        let table = [0u32; 64];
        for (heads, kv_heads) in [(9, 3), (4, 2), (15, 5)] {
            (cfg.num_heads, cfg.num_kv_heads) = (heads, kv_heads);
            for threads in 1..=8 {
                for shape in [
                    &[(1, 127)][..],
                    &[(1, 300)],
                    &[(1, 10), (1, 50)],
                    &[(40, 0)],
                ] {
                    let seqs: Vec<SeqInput<'_>> = shape
                        .iter()
                        .map(|&(n, start_pos)| SeqInput {
                            tokens: &tokens[..n],
                            start_pos,
                            block_table: &table,
                            want_logits: true,
                        })
                        .collect();
                    let (mut tasks, mut merges) = (Vec::new(), Vec::new());
                    PLAN_THREADS.with(|c| c.set(Some(threads)));
                    super::plan_attention(&cfg, &seqs, &mut tasks, &mut merges);
                    PLAN_THREADS.with(|c| c.set(None));
                    // (row, head) -> how many units compute it (a split
                    // one's segments count once: its merge).
                    let rows: usize = shape.iter().map(|s| s.0).sum();
                    let mut seen = vec![0usize; rows * heads];
                    let whole = tasks.iter().filter(|t| t.seg.is_none());
                    for t in whole.chain(merges.iter().map(|m| &m.task)) {
                        for r in t.row0..t.row1 {
                            for h in t.h0..t.h1 {
                                assert_eq!(h / (heads / kv_heads), t.kv_head, "head {h}");
                                seen[r * heads + h] += 1;
                            }
                        }
                    }
                    assert!(
                        seen.iter().all(|&n| n == 1),
                        "{heads} heads, {kv_heads} KV heads, {threads} threads, {shape:?}: {seen:?}"
                    );
                    if (heads, threads, shape) == (9, 2, &[(1, 127)][..]) {
                        let parts: Vec<usize> = tasks.iter().map(|t| t.h1 - t.h0).collect();
                        assert_eq!(parts, [3, 3, 2, 1], "whole KV heads first, then the parts");
                    }
                }
            }
        }
    }
}
