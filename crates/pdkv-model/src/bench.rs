//! Throughput measurements: host memory bandwidth (the decode roofline) and
//! decode tokens per second of a model at a given batch size.

use std::time::Instant;

use pdkv_vmem::{Backing, Pool};
use rayon::prelude::*;

use crate::kernels;
use crate::{KvCache, KvDtype, Model, SeqInput, Workspace, BLOCK_SIZE};

/// Copy bandwidth in bytes per second (bytes read plus bytes written), best
/// of several passes copying a 256 MiB array with all math threads, in
/// memory held as a model's weights are ([`pdkv_vmem::Backing::Private`]:
/// huge pages where the kernel has them), so that a roofline fraction
/// compares like with like.
pub fn measure_copy_bandwidth() -> anyhow::Result<f64> {
    Ok(CopyBench::new()?.measure())
}

/// The two arrays [`measure_copy_bandwidth`] copies between, allocated (and
/// touched) once, so that a benchmark can measure the copy bandwidth again
/// beside each of its timed rounds ([`Rounds`]).
pub struct CopyBench {
    src: std::sync::Arc<pdkv_vmem::Region>,
    dst: std::sync::Arc<pdkv_vmem::Region>,
}

impl CopyBench {
    const BYTES: usize = 256 << 20;
    const PASSES: usize = 5;

    pub fn new() -> anyhow::Result<CopyBench> {
        let pool = Pool::default();
        let private =
            || pool.allocate_backed(pdkv_vmem::Tag::Runtime, Self::BYTES, Backing::Private);
        let mut bench = CopyBench {
            src: private()?,
            dst: private()?,
        };
        let (src, _) = bench.arrays();
        for (i, v) in src.iter_mut().enumerate() {
            *v = i as f32;
        }
        // The first pass touches the destination's pages.
        bench.measure();
        Ok(bench)
    }

    /// The two arrays, borrowed for as long as `self` is.
    fn arrays(&mut self) -> (&mut [f32], &mut [f32]) {
        let n = Self::BYTES / 4;
        // SAFETY: two distinct regions of `BYTES` each, page-aligned, only
        // ever viewed through this function, whose `&mut self` makes these
        // the only views while they live.
        unsafe {
            (
                self.src.slice_mut::<f32>(0, n),
                self.dst.slice_mut::<f32>(0, n),
            )
        }
    }

    /// Bytes per second, best of [`Self::PASSES`] copies.
    pub fn measure(&mut self) -> f64 {
        let chunk = 1 << 18;
        let mut best = 0f64;
        let (src, dst) = self.arrays();
        kernels::thread_pool().install(|| {
            for _ in 0..Self::PASSES {
                let t = Instant::now();
                dst.par_chunks_mut(chunk)
                    .zip(src.par_chunks(chunk))
                    .for_each(|(d, s)| d.copy_from_slice(s));
                let secs = t.elapsed().as_secs_f64();
                best = best.max((2 * Self::BYTES) as f64 / secs);
            }
        });
        std::hint::black_box(dst);
        best
    }

    /// Read bandwidth in bytes per second: best of [`Self::PASSES`] reads
    /// of the source array with all math threads, every word folded into a
    /// checksum (the stream a batch-1 step's weights are, without the
    /// copy's writes).
    pub fn measure_read(&mut self) -> f64 {
        let chunk = 1 << 18;
        let mut best = 0f64;
        let (src, _) = self.arrays();
        let src: &[f32] = src;
        kernels::thread_pool().install(|| {
            for _ in 0..Self::PASSES {
                let t = Instant::now();
                let sum = src
                    .par_chunks(chunk)
                    .map(|c| c.iter().fold(0u32, |a, v| a ^ v.to_bits()))
                    .reduce(|| 0, |a, b| a ^ b);
                std::hint::black_box(sum);
                best = best.max(Self::BYTES as f64 / t.elapsed().as_secs_f64());
            }
        });
        best
    }
}

/// Timed steps in rounds, the copy bandwidth measured just before each
/// ([`DecodeResult::rounds`]): on a machine whose other tenants come and
/// go, a step's weight streaming rate is compared with the bandwidth of
/// the same moment, not of the start of the run.
pub struct Rounds<'a> {
    pub copy: &'a mut CopyBench,
    pub count: usize,
}

/// One round of [`Rounds`].
#[derive(Clone, Copy, Debug)]
pub struct Round {
    pub steps: usize,
    pub seconds: f64,
    /// Bytes per second, measured just before the round.
    pub copy_bandwidth: f64,
    /// Bytes per second of a plain read ([`CopyBench::measure_read`]),
    /// measured just before the round too.
    pub read_bandwidth: f64,
}

/// Result of [`decode_throughput`].
#[derive(Clone, Debug)]
pub struct DecodeResult {
    pub batch: usize,
    pub context: usize,
    pub steps: usize,
    /// Generated tokens per second over all sequences.
    pub tokens_per_s: f64,
    /// Mean wall time of one decode step.
    pub step_ms: f64,
    /// Weight bytes one step reads (`Weights::bytes_read_per_token`).
    pub weight_bytes_per_token: usize,
    /// Weight bytes streamed per second: `steps/s * weight_bytes_per_token`.
    pub weight_bandwidth: f64,
    /// Seconds per timed step in each operation, when the per-operation
    /// clock was on ([`crate::profile::enable`]; zeros otherwise).
    pub profile: Vec<(crate::profile::Op, f64)>,
    /// The timed steps in rounds, when [`Rounds`] were asked for.
    pub rounds: Vec<Round>,
}

impl DecodeResult {
    /// Each round's weight streaming rate over the copy bandwidth measured
    /// just before it, sorted (empty without rounds).
    pub fn paired_fractions(&self) -> Vec<f64> {
        self.fractions_of(|r| r.copy_bandwidth)
    }

    /// The same against the plain read measured beside the copy.
    pub fn paired_read_fractions(&self) -> Vec<f64> {
        self.fractions_of(|r| r.read_bandwidth)
    }

    fn fractions_of(&self, bandwidth: impl Fn(&Round) -> f64) -> Vec<f64> {
        let mut f: Vec<f64> = self
            .rounds
            .iter()
            .map(|r| r.steps as f64 * self.weight_bytes_per_token as f64 / r.seconds / bandwidth(r))
            .collect();
        f.sort_by(f64::total_cmp);
        f
    }
}

/// Prefills `batch` sequences of `context` tokens, then times `steps`
/// decode steps of all of them together (greedy next tokens).
pub fn decode_throughput(
    model: &Model,
    pool: &Pool,
    (batch, context, steps): (usize, usize, usize),
    kv_dtype: KvDtype,
    rounds: Option<Rounds<'_>>,
) -> anyhow::Result<DecodeResult> {
    let blocks_per_seq = blocks_per_seq(batch, context, steps)?;
    let cfg = model.config();
    let kv = KvCache::new(pool, cfg, batch * blocks_per_seq, kv_dtype)?;
    let mut ws = Workspace::new(pool, cfg, context.min(PREFILL_CHUNK).max(batch))?;
    let bytes = model.weights().bytes_read_per_token();
    decode_steps(
        cfg,
        bytes,
        (batch, context, steps),
        rounds,
        &mut |seqs, out| model.forward(&kv, &mut ws, seqs, out),
    )
}

/// Tokens per prefill step in the decode benchmark.
const PREFILL_CHUNK: usize = 512;

/// KV blocks each sequence of the decode benchmark needs (its arguments
/// checked).
fn blocks_per_seq(batch: usize, context: usize, steps: usize) -> anyhow::Result<usize> {
    anyhow::ensure!(
        batch > 0 && context > 0 && steps > 0,
        "batch, context and steps must be positive"
    );
    Ok((context + steps).div_ceil(BLOCK_SIZE))
}

/// [`decode_throughput`] of `model` split over `size` tensor-parallel
/// ranks ([`crate::tp`]), each in a pool of its own.
pub fn decode_throughput_tp(
    model: &Model,
    size: usize,
    (batch, context, steps): (usize, usize, usize),
    kv_dtype: KvDtype,
    rounds: Option<Rounds<'_>>,
) -> anyhow::Result<DecodeResult> {
    let blocks_per_seq = blocks_per_seq(batch, context, steps)?;
    let pools = (0..size).map(|_| Pool::default()).collect();
    let max_tokens = context.min(PREFILL_CHUNK).max(batch);
    let mut tpm = crate::tp::TpModel::new(
        model,
        pools,
        (batch * blocks_per_seq, kv_dtype, Backing::Private),
        max_tokens,
    )?;
    let bytes = model.weights().bytes_read_per_token();
    decode_steps(
        model.config(),
        bytes,
        (batch, context, steps),
        rounds,
        &mut |seqs, out| tpm.forward_with_rows(seqs, &[], out),
    )
}

/// A forward pass over a batch, writing the logits rows.
type StepFn<'a> = dyn FnMut(&[SeqInput<'_>], &mut Vec<f32>) -> anyhow::Result<()> + 'a;

/// The decode benchmark over `step`: prefills `batch` sequences of
/// `context` tokens, then times `steps` decode steps of all of them (in
/// `rounds`, where given, the copy bandwidth measured before each: the
/// copy flushes no cache a step reuses, as a step streams more weights
/// than the last-level cache holds).
fn decode_steps(
    cfg: &crate::ModelConfig,
    bytes: usize,
    (batch, context, steps): (usize, usize, usize),
    mut rounds: Option<Rounds<'_>>,
    step_fn: &mut StepFn<'_>,
) -> anyhow::Result<DecodeResult> {
    let count = rounds
        .as_ref()
        .map_or(1, |r| r.count.clamp(1, steps.max(1)));
    let blocks_per_seq = blocks_per_seq(batch, context, steps)?;
    let chunk = context.min(PREFILL_CHUNK);
    let tables: Vec<Vec<u32>> = (0..batch)
        .map(|s| {
            (0..blocks_per_seq)
                .map(|b| (s * blocks_per_seq + b) as u32)
                .collect()
        })
        .collect();
    let vocab = cfg.vocab_size as u32;
    let prompt = |s: usize| -> Vec<u32> {
        (0..context)
            .map(|i| ((i * 7919 + s * 104_729 + 1) as u32) % vocab)
            .collect()
    };

    let mut logits = Vec::new();
    let mut next = vec![0u32; batch];
    for s in 0..batch {
        let toks = prompt(s);
        let mut start = 0;
        while start < context {
            let end = (start + chunk).min(context);
            let input = SeqInput {
                tokens: &toks[start..end],
                start_pos: start,
                block_table: &tables[s],
                want_logits: end == context,
            };
            step_fn(std::slice::from_ref(&input), &mut logits)?;
            start = end;
        }
        next[s] = argmax(&logits);
    }

    let mut elapsed = 0f64;
    let mut done = Vec::with_capacity(count);
    let mut pos = context;
    let mut step = |logits: &mut Vec<f32>, next: &mut Vec<u32>| {
        let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
        let inputs: Vec<SeqInput<'_>> = (0..batch)
            .map(|s| SeqInput {
                tokens: &toks[s],
                start_pos: pos,
                block_table: &tables[s],
                want_logits: true,
            })
            .collect();
        let t = Instant::now();
        step_fn(&inputs, logits)?;
        let secs = t.elapsed().as_secs_f64();
        for (s, row) in logits.chunks_exact(cfg.vocab_size).enumerate() {
            next[s] = argmax(row);
        }
        pos += 1;
        anyhow::Ok(secs)
    };
    // The timed steps' operations (not the prefill's).
    let mut profile: Vec<(crate::profile::Op, f64)> = Vec::new();
    for r in 0..count {
        let in_round = steps / count + usize::from(r < steps % count);
        let (copy_bandwidth, read_bandwidth) = match rounds.as_mut() {
            Some(rs) => (rs.copy.measure(), rs.copy.measure_read()),
            None => (0.0, 0.0),
        };
        crate::profile::take();
        let mut seconds = 0.0;
        for _ in 0..in_round {
            seconds += step(&mut logits, &mut next)?;
        }
        for (i, (op, secs)) in crate::profile::take().into_iter().enumerate() {
            match profile.get_mut(i) {
                Some(p) => p.1 += secs,
                None => profile.push((op, secs)),
            }
        }
        elapsed += seconds;
        done.push(Round {
            steps: in_round,
            seconds,
            copy_bandwidth,
            read_bandwidth,
        });
    }
    let steps_per_s = steps as f64 / elapsed;
    let profile = profile
        .into_iter()
        .map(|(op, secs)| (op, secs / steps as f64))
        .collect();
    Ok(DecodeResult {
        batch,
        context,
        steps,
        tokens_per_s: steps_per_s * batch as f64,
        step_ms: 1e3 * elapsed / steps as f64,
        weight_bytes_per_token: bytes,
        weight_bandwidth: steps_per_s * bytes as f64,
        profile,
        rounds: if rounds.is_some() { done } else { Vec::new() },
    })
}

/// Prefill throughput in tokens per second: one sequence of `tokens` tokens
/// computed in steps of `chunk` tokens (logits only at the end).
pub fn prefill_throughput(
    model: &Model,
    pool: &Pool,
    tokens: usize,
    chunk: usize,
    kv_dtype: KvDtype,
) -> anyhow::Result<f64> {
    anyhow::ensure!(tokens > 0 && chunk > 0, "tokens and chunk must be positive");
    let cfg = model.config();
    let blocks = tokens.div_ceil(BLOCK_SIZE);
    let kv = KvCache::new(pool, cfg, blocks, kv_dtype)?;
    let mut ws = Workspace::new(pool, cfg, chunk.min(tokens))?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let toks: Vec<u32> = (0..tokens)
        .map(|i| ((i * 7919 + 1) % cfg.vocab_size) as u32)
        .collect();
    let mut logits = Vec::new();
    let t = Instant::now();
    let mut start = 0;
    while start < tokens {
        let end = (start + chunk).min(tokens);
        let input = SeqInput {
            tokens: &toks[start..end],
            start_pos: start,
            block_table: &table,
            want_logits: end == tokens,
        };
        model.forward(&kv, &mut ws, std::slice::from_ref(&input), &mut logits)?;
        start = end;
    }
    Ok(tokens as f64 / t.elapsed().as_secs_f64())
}

/// Perplexity of `tokens` as llama.cpp's `llama-perplexity` measures it:
/// the text cut into windows of `ctx` tokens, each computed from scratch
/// (one prefill, every row's logits) and scored on its second half (the
/// tokens with at least `ctx / 2` of context); `exp` of the mean negative
/// log-likelihood over all scored tokens. Returns it with the number of
/// tokens scored.
pub fn perplexity(
    model: &Model,
    pool: &Pool,
    tokens: &[u32],
    ctx: usize,
    kv_dtype: KvDtype,
) -> anyhow::Result<Perplexity> {
    anyhow::ensure!(ctx >= 2, "the context must hold at least 2 tokens");
    anyhow::ensure!(
        tokens.len() >= ctx,
        "the text has {} tokens, fewer than one window of {ctx}",
        tokens.len()
    );
    let cfg = model.config();
    let blocks = ctx.div_ceil(BLOCK_SIZE);
    let kv = KvCache::new(pool, cfg, blocks, kv_dtype)?;
    let mut ws = Workspace::new(pool, cfg, ctx)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let (mut nll, mut scored) = (0f64, 0usize);
    let mut greedy = Vec::new();
    let mut logits = Vec::new();
    for window in tokens.chunks_exact(ctx) {
        let input = SeqInput {
            tokens: window,
            start_pos: 0,
            block_table: &table,
            want_logits: true,
        };
        model.forward_with_rows(
            &kv,
            &mut ws,
            std::slice::from_ref(&input),
            &[true],
            &mut logits,
        )?;
        let v = cfg.vocab_size;
        for i in ctx / 2..ctx - 1 {
            let row = &logits[i * v..(i + 1) * v];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x)) as f64;
            let z: f64 = row.iter().map(|&x| (x as f64 - max).exp()).sum();
            let target = row[window[i + 1] as usize] as f64;
            nll += z.ln() + max - target;
            scored += 1;
            greedy.push(argmax(row));
        }
    }
    Ok(Perplexity {
        perplexity: (nll / scored as f64).exp(),
        scored,
        greedy,
    })
}

/// What [`perplexity`] measured.
pub struct Perplexity {
    pub perplexity: f64,
    /// Positions scored.
    pub scored: usize,
    /// The greedy (top-1) next token at each scored position, in order.
    pub greedy: Vec<u32>,
}

/// Greedy continuations of `prompts`, `new_tokens` each, with the KV cache
/// in `kv_dtype`: `batch` prompts at a time, each prefilled whole in one
/// step, then decoded together a token a step (argmax, first on ties) —
/// the tokens a server's greedy requests get from the same model, since
/// the forward pass gives the same bits whatever the batch.
pub fn greedy_continuations(
    model: &Model,
    pool: &Pool,
    prompts: &[Vec<u32>],
    new_tokens: usize,
    batch: usize,
    kv_dtype: KvDtype,
) -> anyhow::Result<Vec<Vec<u32>>> {
    anyhow::ensure!(batch >= 1, "a batch of 0 sequences");
    anyhow::ensure!(prompts.iter().all(|p| !p.is_empty()), "an empty prompt");
    let cfg = model.config();
    let longest_prompt = prompts.iter().map(Vec::len).max().unwrap_or(1);
    let longest = longest_prompt + new_tokens;
    anyhow::ensure!(
        longest <= cfg.max_position_embeddings,
        "a prompt of {longest_prompt} tokens and {new_tokens} new ones pass the model's {} positions",
        cfg.max_position_embeddings
    );
    let seqs = batch.min(prompts.len()).max(1);
    let per_seq = longest.div_ceil(BLOCK_SIZE);
    let kv = KvCache::new(pool, cfg, per_seq * seqs, kv_dtype)?;
    let mut ws = Workspace::new(pool, cfg, longest_prompt * seqs)?;
    let tables: Vec<Vec<u32>> = (0..seqs)
        .map(|s| (s * per_seq..(s + 1) * per_seq).map(|b| b as u32).collect())
        .collect();
    let v = cfg.vocab_size;
    let mut logits = Vec::new();
    let mut out = Vec::with_capacity(prompts.len());
    for group in prompts.chunks(seqs) {
        let mut gen: Vec<Vec<u32>> = vec![Vec::with_capacity(new_tokens); group.len()];
        for step in 0..new_tokens {
            // Step 0 prefills the prompts; each later step feeds every
            // sequence its last token.
            let last: Vec<[u32; 1]> = gen
                .iter()
                .map(|g| [g.last().copied().unwrap_or(0)])
                .collect();
            let inputs: Vec<SeqInput<'_>> = group
                .iter()
                .zip(&tables)
                .zip(&last)
                .map(|((p, t), l)| match step {
                    0 => SeqInput {
                        tokens: p,
                        start_pos: 0,
                        block_table: t,
                        want_logits: true,
                    },
                    _ => SeqInput {
                        tokens: l,
                        start_pos: p.len() + step - 1,
                        block_table: t,
                        want_logits: true,
                    },
                })
                .collect();
            model.forward(&kv, &mut ws, &inputs, &mut logits)?;
            for (i, g) in gen.iter_mut().enumerate() {
                g.push(argmax(&logits[i * v..(i + 1) * v]));
            }
        }
        out.extend(gen);
    }
    Ok(out)
}

/// Index of the largest logit (first on ties).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in row.iter().enumerate() {
        if v > row[best] {
            best = i;
        }
    }
    best as u32
}

/// A model of shape `cfg` with seeded pseudo-random weights (linear layers
/// uniform in `±1/sqrt(in_features)`, norm weights near 1), for benchmarks
/// and tests that need no checkpoint.
pub fn synthetic_model(pool: &Pool, cfg: &crate::ModelConfig, seed: u64) -> anyhow::Result<Model> {
    synthetic_model_with(pool, cfg, seed, None)
}

/// [`synthetic_model`] whose linear layers (those with rows of whole
/// 32-value blocks) are stored in the block format `quant`: the same
/// pseudo-random values, quantised as a GGUF writer would.
pub fn synthetic_model_with(
    pool: &Pool,
    cfg: &crate::ModelConfig,
    seed: u64,
    quant: Option<crate::qkernels::QType>,
) -> anyhow::Result<Model> {
    use crate::weights::{DType, LayerWeights, TensorRef, Weights, WeightsLayout};
    cfg.validate()?;
    let (h, q, inter) = (cfg.hidden_size, cfg.q_dim(), cfg.intermediate_size);
    let mut lay = WeightsLayout::new();
    let embed = lay.push(&[cfg.vocab_size, h]);
    let linear = |lay: &mut WeightsLayout, shape: &[usize]| match quant {
        Some(qt) if shape[1].is_multiple_of(qt.block_values()) => {
            lay.push_typed(shape, DType::Quant(qt.loaded()))
        }
        _ => lay.push(shape),
    };
    let layers = (0..cfg.num_layers)
        .map(|_| {
            LayerWeights::build(cfg, |t| match t.is_linear() {
                true => linear(&mut lay, &t.shape(cfg)),
                false => lay.push(&t.shape(cfg)),
            })
        })
        .collect::<Vec<_>>();
    let final_norm = lay.push(&[h]);
    let lm_head = if cfg.tie_word_embeddings {
        embed.clone()
    } else {
        lay.push(&[cfg.vocab_size, h])
    };
    // As a loaded model's weights are held (`loader`): private memory.
    let region =
        pool.allocate_backed(pdkv_vmem::Tag::Weights, lay.total_bytes(), Backing::Private)?;

    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0xD1B5_4A32_D192_ED03;
    let mut fill = |t: &TensorRef, center: f32, spread: f32| {
        let mut values = vec![0f32; t.numel()];
        for v in values.iter_mut() {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            let u = (state >> 40) as f32 / (1u64 << 24) as f32;
            *v = center + spread * (2.0 * u - 1.0);
        }
        // The region was just allocated and has no other views; tensors from
        // the layout never overlap.
        match t.dtype {
            DType::F32 => {
                // SAFETY: as above: the tensor's own range, no other view.
                unsafe { region.slice_mut::<f32>(t.offset, t.numel()) }.copy_from_slice(&values)
            }
            DType::Quant(qt) => {
                // SAFETY: as above: the tensor's own range, no other view.
                let dst = unsafe { region.slice_mut::<u8>(t.offset, t.bytes()) };
                let cols = t.shape[1];
                crate::quantize::quantize_rows(qt, cols, dst, &|r, out| {
                    out.copy_from_slice(&values[r * cols..(r + 1) * cols])
                });
            }
        }
    };
    fill(&embed, 0.0, 1.0);
    for l in &layers {
        for t in [&l.attn_norm, &l.ffn_norm] {
            fill(t, 1.0, 0.2);
        }
        for t in [&l.q_norm, &l.k_norm].into_iter().flatten() {
            fill(t, 1.0, 0.2);
        }
        fill(&l.wq, 0.0, 1.0 / (h as f32).sqrt());
        fill(&l.wk, 0.0, 1.0 / (h as f32).sqrt());
        fill(&l.wv, 0.0, 1.0 / (h as f32).sqrt());
        fill(&l.wo, 0.0, 1.0 / (q as f32).sqrt());
        fill(&l.w_gate, 0.0, 1.0 / (h as f32).sqrt());
        fill(&l.w_up, 0.0, 1.0 / (h as f32).sqrt());
        fill(&l.w_down, 0.0, 1.0 / (inter as f32).sqrt());
    }
    fill(&final_norm, 1.0, 0.2);
    if !cfg.tie_word_embeddings {
        fill(&lm_head, 0.0, 1.0 / (h as f32).sqrt());
    }
    let weights = Weights {
        region,
        embed,
        layers,
        final_norm,
        lm_head,
    };
    Ok(Model::new(cfg.clone(), weights))
}
