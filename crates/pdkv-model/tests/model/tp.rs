//! Tensor parallelism: a model split over ranks gives the whole model's
//! logits bit for bit, its weights are split (not copied) over the ranks'
//! own pools, and each rank's KV blocks are slices of the whole model's.

use pdkv_model::tp::{self, TpModel};
use pdkv_model::{
    init, load_model, Arch, KvCache, KvDtype, Model, SeqInput, Workspace, BLOCK_SIZE,
};
use pdkv_testkit::models::smollm2;
use pdkv_vmem::{Pool, Tag};

/// Greedy decoding of every probe at once (one batch per step): the tokens
/// and every step's logits rows.
struct Run {
    tokens: Vec<Vec<u32>>,
    logits: Vec<Vec<f32>>,
}

const GEN: usize = 12;

fn blocks_per_probe(probes: &[Vec<u32>]) -> usize {
    (probes.iter().map(Vec::len).max().unwrap() + GEN).div_ceil(BLOCK_SIZE)
}

/// One forward step of a model under test: sequences in, logits out.
type Step<'a> = dyn FnMut(&[SeqInput<'_>], &mut Vec<f32>) -> anyhow::Result<()> + 'a;

fn greedy(probes: &[Vec<u32>], vocab: usize, step: &mut Step<'_>) -> Run {
    let per = blocks_per_probe(probes);
    let tables: Vec<Vec<u32>> = (0..probes.len())
        .map(|i| ((i * per) as u32..((i + 1) * per) as u32).collect())
        .collect();
    let mut seqs: Vec<Vec<u32>> = probes.to_vec();
    let mut done = vec![0usize; probes.len()];
    let mut all_logits = Vec::new();
    let mut out = Vec::new();
    for g in 0..GEN {
        let inputs: Vec<SeqInput<'_>> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| SeqInput {
                tokens: &s[done[i]..],
                start_pos: done[i],
                block_table: &tables[i],
                want_logits: true,
            })
            .collect();
        step(&inputs, &mut out).unwrap_or_else(|e| panic!("step {g}: {e:#}"));
        assert_eq!(out.len(), probes.len() * vocab);
        for (i, row) in out.chunks(vocab).enumerate() {
            done[i] = seqs[i].len();
            let best = row
                .iter()
                .enumerate()
                .fold(
                    (0, f32::NEG_INFINITY),
                    |b, (j, &v)| if v > b.1 { (j, v) } else { b },
                );
            seqs[i].push(best.0 as u32);
        }
        all_logits.push(out.clone());
    }
    Run {
        tokens: seqs
            .iter()
            .zip(probes)
            .map(|(s, p)| s[p.len()..].to_vec())
            .collect(),
        logits: all_logits,
    }
}

fn whole(model: &Model, pool: &Pool, probes: &[Vec<u32>]) -> (Run, KvCache) {
    let cfg = model.config();
    let kv = KvCache::new(
        pool,
        cfg,
        blocks_per_probe(probes) * probes.len(),
        KvDtype::F32,
    )
    .unwrap();
    let tokens: usize = probes.iter().map(Vec::len).sum();
    let mut ws = Workspace::new(pool, cfg, tokens).unwrap();
    let run = greedy(probes, cfg.vocab_size, &mut |s, out| {
        model.forward(&kv, &mut ws, s, out)
    });
    (run, kv)
}

/// Block `b`'s bytes.
fn block(kv: &KvCache, b: usize) -> Vec<u8> {
    let mut out = vec![0u8; kv.block_bytes()];
    kv.region()
        .read_bytes(b * kv.block_bytes(), &mut out)
        .unwrap();
    out
}

fn split(model: &Model, size: usize, probes: &[Vec<u32>]) -> (Run, TpModel) {
    let pools: Vec<Pool> = (0..size).map(|_| Pool::default()).collect();
    let tokens: usize = probes.iter().map(Vec::len).sum();
    let mut tpm = TpModel::new(
        model,
        pools,
        (
            blocks_per_probe(probes) * probes.len(),
            KvDtype::F32,
            pdkv_vmem::Backing::Private,
        ),
        tokens,
    )
    .unwrap();
    let vocab = tpm.config().vocab_size;
    let run = greedy(probes, vocab, &mut |s, out| {
        tpm.forward_with_rows(s, &[], out)
    });
    (run, tpm)
}

/// Prompts of 1 to 40 tokens drawn from a fixed generator.
fn probes(n: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..n)
        .map(|_| {
            let len = 1 + (next() % 40) as usize;
            (0..len).map(|_| (next() % vocab as u64) as u32).collect()
        })
        .collect()
}

/// Logits whose bits differ between two runs.
fn bits_differing(a: &Run, b: &Run) -> usize {
    assert_eq!(a.logits.len(), b.logits.len());
    a.logits
        .iter()
        .zip(&b.logits)
        .flat_map(|(x, y)| x.iter().zip(y).filter(|(p, q)| p.to_bits() != q.to_bits()))
        .count()
}

/// Checks a split of `model` over `size` ranks against the whole model on
/// `n` probes: the same tokens and the same logits, bit for bit, the same
/// KV blocks, each rank's weights in its own pool.
fn check(name: &str, model: &Model, size: usize, n: usize) {
    let cfg = model.config().clone();
    let probes = probes(n, cfg.vocab_size, 7);
    let pool = Pool::default();
    let (want, whole_kv) = whole(model, &pool, &probes);
    let (got, tpm) = split(model, size, &probes);
    for (i, (w, g)) in want.tokens.iter().zip(&got.tokens).enumerate() {
        assert_eq!(w, g, "{name} TP{size}: probe {i} decodes differently");
    }
    let n: usize = want.logits.iter().map(Vec::len).sum();
    assert_eq!(
        bits_differing(&want, &got),
        0,
        "{name} TP{size}: logits differ from the whole model's"
    );
    println!(
        "{name} TP{size}: {} probes x {GEN} tokens equal, {n} logits bit-identical",
        probes.len()
    );

    // Each rank holds its part, in its own pool: together about the whole,
    // no rank the whole (the norms are copied, nothing else).
    let whole_bytes = model.weights().bytes_total();
    let parts: Vec<usize> = tpm
        .ranks()
        .iter()
        .map(|r| r.model.weights().bytes_total())
        .collect();
    let norms = cfg.num_layers * 2 * cfg.hidden_size * 4 + cfg.hidden_size * 4;
    let sum: usize = parts.iter().sum();
    assert!(
        sum <= whole_bytes + (size - 1) * (norms + 4096),
        "{name} TP{size}: ranks hold {parts:?} bytes of weights, the whole model {whole_bytes}"
    );
    for (r, rank) in tpm.ranks().iter().enumerate() {
        assert!(
            parts[r] < whole_bytes,
            "{name}: rank {r} holds all the weights"
        );
        let live = rank.pool.device_bytes();
        assert!(
            live.get(Tag::Weights) >= parts[r] as u64,
            "{name}: rank {r}'s weights are not in its own pool"
        );
        assert!(
            live.get(Tag::KvCache) > 0,
            "{name}: rank {r} has no KV cache of its own"
        );
    }

    // A rank's KV block is the slice of the whole model's block that holds
    // its KV heads, bit for bit: the ranks' blocks one after the other are
    // the whole block (what a transfer between different splits relies on).
    for b in 0..whole_kv.num_blocks() {
        let parts: Vec<u8> = tpm.ranks().iter().flat_map(|r| block(&r.kv, b)).collect();
        assert!(
            parts == block(&whole_kv, b),
            "{name} TP{size}: block {b} differs from its ranks' blocks"
        );
    }

    // The same split, run again, gives the same bits.
    let (again, _) = split(model, size, &probes);
    assert_eq!(
        bits_differing(&got, &again),
        0,
        "{name} TP{size} is not deterministic"
    );
}

fn random_model(arch: Arch, preset: &str) -> Model {
    let dir = tempfile::tempdir().unwrap();
    init::write_random_checkpoint(arch, preset, 11, dir.path()).unwrap();
    load_model(dir.path(), &Pool::default(), &mut |_| {})
        .unwrap()
        .model
}

#[test]
fn split_models_decode_as_the_whole_one() {
    for arch in [Arch::Llama, Arch::Qwen3] {
        let tiny = random_model(arch, "tiny");
        check(&format!("{arch:?} tiny"), &tiny, 2, 30);
        // 4 KV heads over 3 ranks (2 + 1 + 1), uneven MLP columns too.
        let small = random_model(arch, "small");
        for size in [2, 3, 4] {
            check(&format!("{arch:?} small"), &small, size, 30);
        }
    }
}

#[test]
fn smollm2_over_two_ranks_decodes_as_the_whole_model() {
    let Some(path) = smollm2("smollm2_over_two_ranks_decodes_as_the_whole_model") else {
        return;
    };
    let m = load_model(&path, &Pool::default(), &mut |_| {}).unwrap();
    // 3 KV heads: rank 0 gets 2 (6 query heads), rank 1 gets 1 (3).
    let shards = tp::plan(m.model.config(), 2).unwrap();
    let err = tp::plan(m.model.config(), 4).unwrap_err();
    assert!(
        format!("{err}").contains("exceeds the model's 3 KV heads"),
        "{err}"
    );
    assert_eq!(
        (shards[0].kv_heads.clone(), shards[1].kv_heads.clone()),
        (0..2, 2..3)
    );
    // 12 probes: a batch past the batch-1..8 kernels, on the tile path.
    check("SmolLM2 Q4_1", &m.model, 2, 12);
    let f32_acts = m.model.with_int8_activations(false);
    check("SmolLM2 Q4_1, f32 activations", &f32_acts, 2, 12);
}
