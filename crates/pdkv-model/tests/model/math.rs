//! The forward pass: batch invariance (bit-exact), chunking and block
//! placement invariance, and agreement with a plain f64 reference.

use pdkv_model::bench::synthetic_model_with;
use pdkv_model::qkernels::QType;
use pdkv_model::weights::DType;
use pdkv_model::{Arch, KvCache, KvDtype, Model, ModelConfig, SeqInput, Workspace, BLOCK_SIZE};
use pdkv_vmem::Pool;

fn llama_cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 101,
        hidden_size: 48,
        intermediate_size: 84,
        num_layers: 2,
        num_heads: 6,
        num_kv_heads: 2,
        head_dim: 8,
        rope_theta: 10000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 512,
        tie_word_embeddings: true,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

/// Qwen3 with `head_dim` (14) different from `hidden / heads` (10).
fn qwen3_cfg() -> ModelConfig {
    ModelConfig {
        arch: Arch::Qwen3,
        vocab_size: 89,
        hidden_size: 40,
        intermediate_size: 72,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 14,
        rope_theta: 1_000_000.0,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 512,
        tie_word_embeddings: false,
        bos_token_id: None,
        eos_token_ids: vec![3],
    }
}

fn configs() -> Vec<ModelConfig> {
    vec![llama_cfg(), qwen3_cfg()]
}

/// Shapes whose linear layers have rows of whole 32-value blocks.
fn block_cfgs() -> Vec<ModelConfig> {
    let llama = ModelConfig {
        hidden_size: 64,
        intermediate_size: 96,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        ..llama_cfg()
    };
    let qwen3 = ModelConfig {
        hidden_size: 64,
        intermediate_size: 96,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 24,
        ..qwen3_cfg()
    };
    vec![llama, qwen3]
}

/// The invariance cases: f32 weights, and weights in each block format the
/// kernels compute on (16-bit floats included), with f32 and with int8
/// activations.
fn cases() -> Vec<(ModelConfig, Option<QType>, bool)> {
    let mut v: Vec<_> = configs().into_iter().map(|c| (c, None, false)).collect();
    for q in QType::ALL.into_iter().chain([QType::F16, QType::BF16]) {
        for int8 in [false, true] {
            v.extend(block_cfgs().into_iter().map(|c| (c, Some(q), int8)));
        }
    }
    v
}

fn tokens(seed: u32, n: usize, vocab: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(seed.wrapping_mul(97))
                >> 7)
                % vocab as u32
        })
        .collect()
}

struct Harness {
    model: Model,
    kv: KvCache,
    ws: Workspace,
}

impl Harness {
    fn new(cfg: &ModelConfig, blocks: usize, ws_tokens: usize) -> Harness {
        Harness::with(cfg, None, false, blocks, ws_tokens)
    }

    fn with(
        cfg: &ModelConfig,
        quant: Option<QType>,
        int8: bool,
        blocks: usize,
        ws_tokens: usize,
    ) -> Harness {
        let pool = Pool::default();
        let model = synthetic_model_with(&pool, cfg, 42, quant)
            .unwrap()
            .with_int8_activations(int8);
        if quant.is_some() {
            assert!(
                matches!(model.weights().layers[0].wq.dtype, DType::Quant(_)),
                "{:?} keeps its blocks",
                cfg.arch
            );
        }
        let kv = KvCache::new(&pool, cfg, blocks, KvDtype::F32).unwrap();
        let ws = Workspace::new(&pool, cfg, ws_tokens).unwrap();
        Harness { model, kv, ws }
    }

    fn step(&mut self, seqs: &[SeqInput<'_>]) -> Vec<f32> {
        let mut logits = vec![1.0; 3];
        self.model
            .forward(&self.kv, &mut self.ws, seqs, &mut logits)
            .unwrap();
        logits
    }

    /// Prefills `toks` in chunks of the given sizes (cycled); returns the
    /// logits of the last token.
    fn prefill(&mut self, toks: &[u32], table: &[u32], chunks: &[usize]) -> Vec<f32> {
        let mut start = 0;
        let mut last = Vec::new();
        let mut i = 0;
        while start < toks.len() {
            let end = (start + chunks[i % chunks.len()]).min(toks.len());
            let input = SeqInput {
                tokens: &toks[start..end],
                start_pos: start,
                block_table: table,
                want_logits: end == toks.len(),
            };
            last = self.step(&[input]);
            start = end;
            i += 1;
        }
        last
    }

    /// Bits of the K and V rows of positions `0..len` of every layer.
    fn kv_bits(&self, table: &[u32], len: usize) -> Vec<u32> {
        let hd = self.kv.kv_dim() / self.kv.num_kv_heads();
        let mut out = Vec::new();
        for layer in 0..self.kv.num_layers() {
            for which in 0..2 {
                for pos in 0..len {
                    let block = table[pos / BLOCK_SIZE] as usize;
                    for head in 0..self.kv.num_kv_heads() {
                        // SAFETY: no step runs while the test reads.
                        let rows = unsafe { self.kv.rows(block, head, layer, which) };
                        let row = &rows[(pos % BLOCK_SIZE) * hd..(pos % BLOCK_SIZE + 1) * hd];
                        out.extend(row.iter().map(|v| v.to_bits()));
                    }
                }
            }
        }
        out
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn contiguous(first: u32, n: usize) -> Vec<u32> {
    (first..first + n as u32).collect()
}

#[test]
fn prefill_chunking_and_block_placement_do_not_change_results() {
    for (cfg, quant, int8) in cases() {
        let toks = tokens(1, 70, cfg.vocab_size);
        let nb = toks.len().div_ceil(BLOCK_SIZE) + 2;
        let mut h = Harness::with(&cfg, quant, int8, 64, 128);
        let base_table = contiguous(0, nb);
        let want = h.prefill(&toks, &base_table, &[toks.len()]);
        let want_kv = h.kv_bits(&base_table, toks.len());
        assert!(want.iter().all(|v| v.is_finite()));

        let scattered: Vec<u32> = vec![41, 7, 30, 12, 55, 3, 19];
        for (chunks, table) in [
            (vec![1], contiguous(8, nb)),
            (vec![5], contiguous(16, nb)),
            (vec![16], scattered.clone()),
            (vec![33], contiguous(24, nb)),
            (vec![7, 1, 16, 3], scattered.clone()),
            (vec![toks.len()], scattered.clone()),
        ] {
            let got = h.prefill(&toks, &table, &chunks);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{:?}: chunks {chunks:?} table {table:?}",
                cfg.arch
            );
            assert_eq!(
                h.kv_bits(&table, toks.len()),
                want_kv,
                "{:?}: KV of chunks {chunks:?}",
                cfg.arch
            );
        }
    }
}

#[test]
fn decode_after_chunked_prefill_equals_unchunked() {
    for (cfg, quant, int8) in cases() {
        let toks = tokens(2, 37, cfg.vocab_size);
        let gen = tokens(3, 6, cfg.vocab_size);
        let len = toks.len() + gen.len();
        let nb = len.div_ceil(BLOCK_SIZE);
        let mut h = Harness::with(&cfg, quant, int8, 32, 64);
        let mut run = |chunks: &[usize], table: &[u32]| {
            let mut all = vec![bits(&h.prefill(&toks, table, chunks))];
            for (i, t) in gen.iter().enumerate() {
                let input = with_logits(std::slice::from_ref(t), toks.len() + i, table);
                all.push(bits(&h.step(&[input])));
            }
            (all, h.kv_bits(table, len))
        };
        let want = run(&[toks.len()], &contiguous(0, nb));
        let got = run(&[7], &[20, 2, 29][..nb]);
        assert_eq!(got, want, "{:?}", cfg.arch);
    }
}

/// A target sequence computed alone, then inside busy batches of 31 other
/// sequences with mixed prefill chunks and decode tokens, at varying
/// positions in the batch: its logits and KV are bit-identical.
#[test]
fn logits_do_not_depend_on_the_rest_of_the_batch() {
    for (cfg, quant, int8) in cases() {
        let vocab = cfg.vocab_size;
        let prompt = tokens(4, 45, vocab);
        let gen = tokens(5, 4, vocab);
        let target_len = prompt.len() + gen.len();
        let per_seq = 6; // blocks per sequence: up to 96 positions
        let mut h = Harness::with(&cfg, quant, int8, 32 * per_seq, 64);

        // Alone: one prefill step, then one decode step per generated token.
        let table_alone = contiguous(0, per_seq);
        let mut alone = vec![bits(&h.prefill(&prompt, &table_alone, &[prompt.len()]))];
        for (i, t) in gen.iter().enumerate() {
            let input = with_logits(std::slice::from_ref(t), prompt.len() + i, &table_alone);
            alone.push(bits(&h.step(&[input])));
        }
        let alone_kv = h.kv_bits(&table_alone, target_len);

        // Batched: 31 others with their own prompts, progressing by chunks of
        // differing sizes; the target is at a different index every step.
        // Each other sequence has a prompt of `plen[i]` tokens followed by 8
        // tokens it consumes one decode step at a time.
        let plen: Vec<usize> = (0..31).map(|i| 3 + (i * 13) % 80).collect();
        let others: Vec<Vec<u32>> = (0..31)
            .map(|i| tokens(100 + i as u32, plen[i] + 8, vocab))
            .collect();
        let tables: Vec<Vec<u32>> = (0..32)
            .map(|s| contiguous((s * per_seq) as u32, per_seq))
            .collect();
        // Sequence 31 of `tables` is the target's, in the last blocks.
        let target_table = &tables[31];
        let mut done = vec![0usize; 31];
        let mut batched = Vec::new();
        for step in 0..=gen.len() {
            let mut inputs: Vec<SeqInput<'_>> = Vec::new();
            for (i, o) in others.iter().enumerate() {
                let start = done[i];
                if start < o.len() {
                    // A prefill chunk of 1..=23 tokens, or one decode token.
                    let n = if start < plen[i] {
                        (1 + (i * 5 + step * 3) % 23).min(plen[i] - start)
                    } else {
                        1
                    };
                    inputs.push(SeqInput {
                        tokens: &o[start..start + n],
                        start_pos: start,
                        block_table: &tables[i],
                        want_logits: (i + step) % 3 != 0,
                    });
                    done[i] += n;
                }
            }
            let target = if step == 0 {
                with_logits(&prompt, 0, target_table)
            } else {
                with_logits(
                    std::slice::from_ref(&gen[step - 1]),
                    prompt.len() + step - 1,
                    target_table,
                )
            };
            let at = (step * 11) % (inputs.len() + 1);
            inputs.insert(at, target);
            let logits = h.step(&inputs);
            // Rows come out in input order for inputs that want logits.
            let row = inputs[..at].iter().filter(|s| s.want_logits).count();
            batched.push(bits(&logits[row * vocab..(row + 1) * vocab]));
        }
        assert_eq!(
            batched, alone,
            "{:?} {quant:?} int8 {int8}: target logits differ in a batch",
            cfg.arch
        );
        assert_eq!(
            h.kv_bits(target_table, target_len),
            alone_kv,
            "{:?} {quant:?}: target KV differs",
            cfg.arch
        );
    }
}

/// Prefix caching: a sequence that reuses another's full blocks and
/// computes only its suffix gets the logits of a full recompute.
#[test]
fn shared_prefix_blocks_give_the_same_logits_as_recompute() {
    for (cfg, quant, int8) in cases() {
        let mut h = Harness::with(&cfg, quant, int8, 16, 64);
        let a = tokens(6, 40, cfg.vocab_size);
        let mut b = a[..32].to_vec();
        b.extend(tokens(7, 9, cfg.vocab_size));
        h.prefill(&a, &[0, 1, 2], &[40]);
        let full = h.prefill(&b, &[5, 6, 7], &[41]);
        // Blocks 0 and 1 hold positions 0..32 of `a`, identical to `b`'s.
        let input = with_logits(&b[32..], 32, &[0, 1, 9]);
        let reused = h.step(&[input]);
        assert_eq!(bits(&reused), bits(&full), "{:?}", cfg.arch);
    }
}

/// `tokens` from position `start_pos` over `block_table`, wanting logits.
fn with_logits<'a>(tokens: &'a [u32], start_pos: usize, block_table: &'a [u32]) -> SeqInput<'a> {
    SeqInput {
        tokens,
        start_pos,
        block_table,
        want_logits: true,
    }
}

#[test]
fn bad_steps_are_refused() {
    let cfg = llama_cfg();
    let mut h = Harness::new(&cfg, 4, 16);
    let mut logits = Vec::new();
    let toks = [1u32; 20];
    let mut try_step = |seqs: &[SeqInput<'_>]| h.model.forward(&h.kv, &mut h.ws, seqs, &mut logits);
    let bad_tok = [cfg.vocab_size as u32];
    let refused: [(&str, Vec<SeqInput>); 6] = [
        (
            "too few blocks for 20 positions",
            vec![with_logits(&toks, 0, &[0])],
        ),
        (
            "a block id outside the cache",
            vec![with_logits(&toks, 0, &[0, 4])],
        ),
        (
            "a token outside the vocabulary",
            vec![with_logits(&bad_tok, 0, &[0])],
        ),
        (
            "two sequences writing the same block",
            vec![
                with_logits(&toks[..3], 0, &[2]),
                with_logits(&toks[..3], 0, &[2]),
            ],
        ),
        (
            "a block written by one sequence while another reads it",
            vec![
                with_logits(&toks[..3], 16, &[0, 1]),
                with_logits(&toks[..3], 16, &[1, 3]),
            ],
        ),
        ("an empty sequence", vec![with_logits(&[], 0, &[0])]),
    ];
    for (what, seqs) in refused {
        assert!(try_step(&seqs).is_err(), "{what}");
    }
    // A valid step still works afterwards and a workspace grows on demand.
    assert!(try_step(&[with_logits(&toks, 0, &[0, 1])]).is_ok());
    assert_eq!(logits.len(), cfg.vocab_size);
}

// ---------------------------------------------------------------------------
// Plain f64 reference forward (contiguous KV, textbook formulas)
// ---------------------------------------------------------------------------

fn ref_linear(w: &[f32], out: usize, x: &[f64]) -> Vec<f64> {
    let k = x.len();
    (0..out)
        .map(|j| (0..k).map(|t| w[j * k + t] as f64 * x[t]).sum())
        .collect()
}

fn ref_rmsnorm(x: &[f64], w: &[f32], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, &g)| v * inv * g as f64).collect()
}

fn ref_rope(v: &mut [f64], pos: usize, theta: f64) {
    let d = v.len();
    let half = d / 2;
    for i in 0..half {
        let freq = 1.0 / theta.powf((2 * i) as f64 / d as f64);
        let (c, s) = ((pos as f64 * freq).cos(), (pos as f64 * freq).sin());
        let (a, b) = (v[i], v[i + half]);
        v[i] = a * c - b * s;
        v[i + half] = b * c + a * s;
    }
}

/// A matrix's values as f32 (block formats dequantised).
fn mat_f32(w: &pdkv_model::weights::Weights, t: &pdkv_model::weights::TensorRef) -> Vec<f32> {
    (0..t.shape[0]).flat_map(|r| w.row_f32(t, r)).collect()
}

/// Logits of the last token of `toks`, computed from scratch.
fn reference_logits(model: &Model, toks: &[u32]) -> Vec<f64> {
    let cfg = model.config();
    let w = model.weights();
    let (hd, nh, nkv) = (cfg.head_dim, cfg.num_heads, cfg.num_kv_heads);
    let eps = cfg.rms_norm_eps as f64;
    let embed = w.get(&w.embed);
    let h = cfg.hidden_size;
    let mut xs: Vec<Vec<f64>> = toks
        .iter()
        .map(|&t| {
            embed[t as usize * h..(t as usize + 1) * h]
                .iter()
                .map(|&v| v as f64)
                .collect()
        })
        .collect();
    for lw in &w.layers {
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let hn = ref_rmsnorm(x, w.get(&lw.attn_norm), eps);
            let mut q = ref_linear(&mat_f32(w, &lw.wq), nh * hd, &hn);
            let mut k = ref_linear(&mat_f32(w, &lw.wk), nkv * hd, &hn);
            let v = ref_linear(&mat_f32(w, &lw.wv), nkv * hd, &hn);
            for (buf, norm) in [(&mut q, &lw.q_norm), (&mut k, &lw.k_norm)] {
                for head in buf.chunks_mut(hd) {
                    if let (Arch::Qwen3, Some(n)) = (cfg.arch, norm) {
                        let normed = ref_rmsnorm(head, w.get(n), eps);
                        head.copy_from_slice(&normed);
                    }
                    ref_rope(head, pos, cfg.rope_theta as f64);
                }
            }
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0f64; nh * hd];
            for head in 0..nh {
                let g = head / (nh / nkv);
                let q = &qs[p][head * hd..(head + 1) * hd];
                let scores: Vec<f64> = (0..=p)
                    .map(|t| {
                        q.iter()
                            .zip(&ks[t][g * hd..(g + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for t in 0..=p {
                    for d in 0..hd {
                        att[head * hd + d] += e[t] / z * vs[t][g * hd + d];
                    }
                }
            }
            let o = ref_linear(&mat_f32(w, &lw.wo), h, &att);
            for (a, b) in x.iter_mut().zip(&o) {
                *a += b;
            }
            let hn = ref_rmsnorm(x, w.get(&lw.ffn_norm), eps);
            let gate = ref_linear(&mat_f32(w, &lw.w_gate), cfg.intermediate_size, &hn);
            let up = ref_linear(&mat_f32(w, &lw.w_up), cfg.intermediate_size, &hn);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let d = ref_linear(&mat_f32(w, &lw.w_down), h, &act);
            for (a, b) in x.iter_mut().zip(&d) {
                *a += b;
            }
        }
    }
    let last = ref_rmsnorm(xs.last().unwrap(), w.get(&w.final_norm), eps);
    ref_linear(w.get(&w.lm_head), cfg.vocab_size, &last)
}

/// Weights in a block format: the f64 reference on the dequantised weights,
/// as closely as the f32 path with f32 activations, and within what
/// quantising the activations to 8 bits per 32-value block costs with int8
/// activations (llama.cpp's trade).
#[test]
fn block_format_forward_agrees_with_f64_reference_on_dequantised_weights() {
    let formats = QType::ALL.into_iter().chain([QType::F16, QType::BF16]);
    for (q, int8) in formats.flat_map(|q| [(q, false), (q, true)]) {
        for cfg in block_cfgs() {
            let mut h = Harness::with(&cfg, Some(q), int8, 16, 64);
            let toks = tokens(8, 50, cfg.vocab_size);
            let got = h.prefill(&toks, &contiguous(3, 4), &[17]);
            let want = reference_logits(&h.model, &toks);
            let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
            assert!(scale > 0.1, "logits are not degenerate");
            let worst = got
                .iter()
                .zip(&want)
                .map(|(g, w)| (*g as f64 - w).abs() / scale)
                .fold(0f64, f64::max);
            println!(
                "{:?} {q:?} int8 {int8}: worst relative logit error {worst:.2e}",
                cfg.arch
            );
            // f32 activations: the f32 path's accuracy; int8: what quantising
            // the activations to 8 bits per 32-value block costs.
            let bound = if int8 { 1e-2 } else { 1e-4 };
            assert!(
                worst < bound,
                "{:?} {q:?} int8 {int8}: relative logit error {worst:e}",
                cfg.arch
            );
        }
    }
}

#[test]
fn forward_agrees_with_f64_reference() {
    for cfg in configs() {
        let mut h = Harness::new(&cfg, 16, 64);
        let toks = tokens(8, 50, cfg.vocab_size);
        let got = h.prefill(&toks, &contiguous(3, 4), &[17]);
        let want = reference_logits(&h.model, &toks);
        let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
        assert!(scale > 0.1, "logits are not degenerate");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let err = (*g as f64 - w).abs() / scale;
            assert!(
                err < 1e-4,
                "{:?}: logit {i}: {g} vs {w} (rel err {err:e})",
                cfg.arch
            );
        }
    }
}

/// A decode step at a context of several attention segments computed
/// alone (few attention units: each query's segments go to different
/// threads and are folded afterwards) and inside a batch busy enough that
/// each query is computed by one thread: the same bits.
#[test]
fn long_context_decode_alone_equals_decode_in_a_busy_batch() {
    for (cfg, quant, int8) in [
        (llama_cfg(), None, false),
        (block_cfgs()[1].clone(), Some(QType::Q8_0), true),
    ] {
        let cfg = ModelConfig {
            max_position_embeddings: 2048,
            ..cfg
        };
        let vocab = cfg.vocab_size;
        let prompt = tokens(7, 700, vocab);
        let gen = tokens(8, 3, vocab);
        let per_seq = (prompt.len() + gen.len()).div_ceil(BLOCK_SIZE);
        let mut h = Harness::with(&cfg, quant, int8, 3 * per_seq, 256);
        let decode = |h: &mut Harness, table: &[u32], busy: Option<&[u32]>| {
            let mut out = vec![bits(&h.prefill(&prompt, table, &[256]))];
            let filler = tokens(9, 64, vocab);
            for (i, t) in gen.iter().enumerate() {
                let mut inputs = vec![with_logits(
                    std::slice::from_ref(t),
                    prompt.len() + i,
                    table,
                )];
                // Another sequence recomputing 64 tokens: eight units of
                // attention work per KV head beside the target's one.
                if let Some(other) = busy {
                    inputs.push(SeqInput {
                        tokens: &filler,
                        start_pos: 0,
                        block_table: other,
                        want_logits: false,
                    });
                }
                out.push(bits(&h.step(&inputs)[..vocab]));
            }
            out
        };
        let alone = decode(&mut h, &contiguous(0, per_seq), None);
        let other = contiguous(2 * per_seq as u32, per_seq);
        let batched = decode(&mut h, &contiguous(per_seq as u32, per_seq), Some(&other));
        assert_eq!(
            alone, batched,
            "{:?} {quant:?}: a long context's decode differs in a batch",
            cfg.arch
        );
        assert!(alone
            .iter()
            .flatten()
            .all(|b| f32::from_bits(*b).is_finite()));
    }
}

/// A q8_0 KV cache: chunking and block placement still change no bit, the
/// logits stay close to an f32 cache's, and a head size that is not a
/// multiple of 32 is refused by name.
#[test]
fn a_q8_0_cache_keeps_the_invariances_and_follows_the_f32_cache() {
    let cfg = ModelConfig {
        hidden_size: 64,
        num_heads: 2,
        num_kv_heads: 1,
        head_dim: 32,
        ..llama_cfg()
    };
    let toks = tokens(11, 70, cfg.vocab_size);
    let nb = toks.len().div_ceil(BLOCK_SIZE);
    let mut h = Harness::new(&cfg, 16, 128);
    let f32_logits = h.prefill(&toks, &contiguous(0, nb), &[toks.len()]);
    h.kv = KvCache::new(&Pool::default(), &cfg, 16, KvDtype::Q8_0).unwrap();
    assert_eq!(
        h.kv.block_bytes(),
        2 * 2 * BLOCK_SIZE * 34,
        "two layers of K and V, 16 rows of one 34-byte block"
    );
    let want = h.prefill(&toks, &contiguous(0, nb), &[toks.len()]);
    let got = h.prefill(&toks, &[9, 3, 12, 1, 7], &[7, 16, 1]);
    assert_eq!(
        bits(&got),
        bits(&want),
        "q8_0: chunks and blocks changed bits"
    );
    let scale = crate::max_abs(&f32_logits);
    let worst = crate::max_abs_diff(&want, &f32_logits);
    assert!(
        worst > 0.0 && worst < 0.05 * scale,
        "q8_0 logits {worst} from f32's (largest {scale})"
    );
    let err = KvCache::new(&Pool::default(), &llama_cfg(), 4, KvDtype::Q8_0)
        .err()
        .expect("head size 8 refused")
        .to_string();
    assert!(err.contains("q8_0") && err.contains("32"), "{err}");
}

/// `bench::greedy_continuations` (the KV dtypes' greedy agreement in `pdkv
/// bench perplexity`) against each sequence recomputed whole, from a fresh
/// cache, for every token: the same tokens, whatever the batch.
#[test]
fn greedy_continuations_equal_recomputing_each_sequence_whole() {
    let mut runs: Vec<_> = configs().into_iter().map(|c| (c, None, false)).collect();
    runs.extend(
        block_cfgs()
            .into_iter()
            .map(|c| (c, Some(QType::Q4_1), true)),
    );
    for (cfg, quant, int8) in runs {
        let pool = Pool::default();
        let model = synthetic_model_with(&pool, &cfg, 7, quant)
            .unwrap()
            .with_int8_activations(int8);
        let prompts: Vec<Vec<u32>> = [5, 17, 33, 1, 40]
            .iter()
            .enumerate()
            .map(|(i, &n)| tokens(i as u32 + 3, n, cfg.vocab_size))
            .collect();
        let n = 6;
        let whole: Vec<Vec<u32>> = prompts
            .iter()
            .map(|p| {
                let mut seq = p.clone();
                for _ in 0..n {
                    let blocks = seq.len().div_ceil(BLOCK_SIZE);
                    let kv = KvCache::new(&pool, &cfg, blocks, KvDtype::F32).unwrap();
                    let mut ws = Workspace::new(&pool, &cfg, seq.len()).unwrap();
                    let table = contiguous(0, blocks);
                    let input = SeqInput {
                        tokens: &seq,
                        start_pos: 0,
                        block_table: &table,
                        want_logits: true,
                    };
                    let mut logits = Vec::new();
                    model.forward(&kv, &mut ws, &[input], &mut logits).unwrap();
                    seq.push(pdkv_model::bench::argmax(&logits));
                }
                seq[p.len()..].to_vec()
            })
            .collect();
        for batch in [1, 2, 5] {
            let got = pdkv_model::bench::greedy_continuations(
                &model,
                &pool,
                &prompts,
                n,
                batch,
                KvDtype::F32,
            )
            .unwrap();
            assert_eq!(
                got, whole,
                "{:?} {quant:?} int8 {int8}, batch {batch}",
                cfg.arch
            );
        }
        let distinct: std::collections::HashSet<_> = whole.iter().collect();
        assert!(
            distinct.len() > 1,
            "{:?}: every prompt got the same continuation, a weak check: {whole:?}",
            cfg.arch
        );
    }
}
