//! Decode throughput against the memory-bandwidth roofline.
//!
//! `decode_bench [MODEL_PATH] [--context N] [--steps N] [--batch B]...`
//! Without a model path, uses random weights in the SmolLM2-135M shape.

use std::path::PathBuf;

use pdkv_model::bench::{
    decode_throughput, measure_copy_bandwidth, prefill_throughput, synthetic_model,
};
use pdkv_model::{Arch, KvDtype, Model, ModelConfig};
use pdkv_vmem::Pool;

fn smollm2_shape() -> ModelConfig {
    ModelConfig {
        arch: Arch::Llama,
        vocab_size: 49152,
        hidden_size: 576,
        intermediate_size: 1536,
        num_layers: 30,
        num_heads: 9,
        num_kv_heads: 3,
        head_dim: 64,
        rope_theta: 100000.0,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 8192,
        tie_word_embeddings: true,
        bos_token_id: Some(1),
        eos_token_ids: vec![2],
    }
}

fn main() -> anyhow::Result<()> {
    let mut path: Option<PathBuf> = None;
    let (mut context, mut steps, mut batches) = (64usize, 16usize, Vec::new());
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut num = |name: &str| -> anyhow::Result<usize> {
            args.next()
                .ok_or_else(|| anyhow::anyhow!("{name} needs a value"))?
                .parse()
                .map_err(Into::into)
        };
        match a.as_str() {
            "--context" => context = num("--context")?,
            "--steps" => steps = num("--steps")?,
            "--batch" => batches.push(num("--batch")?),
            _ => path = Some(PathBuf::from(a)),
        }
    }
    if batches.is_empty() {
        batches = vec![1, 8, 32];
    }
    let pool = Pool::default();
    let model: Model = match &path {
        Some(p) => pdkv_model::load_model(p, &pool, &mut |_| {})?.model,
        None => synthetic_model(&pool, &smollm2_shape(), 1)?,
    };
    let pf = prefill_throughput(&model, &pool, 512, 256, KvDtype::F32)?;
    println!("prefill 512 tokens in chunks of 256: {pf:.1} tok/s");
    let bw = measure_copy_bandwidth()?;
    println!("copy bandwidth: {:.2} GB/s", bw / 1e9);
    for b in batches {
        let r = decode_throughput(&model, &pool, (b, context, steps), KvDtype::F32, None)?;
        let roof = bw / r.weight_bytes_per_token as f64;
        println!(
            "batch {:>3} context {:>4}: {:>8.1} tok/s  step {:>7.2} ms  weights {:.0} MB/step  {:.2} GB/s  roofline(batch 1) {:.1} steps/s  fraction {:.2}",
            b,
            context,
            r.tokens_per_s,
            r.step_ms,
            r.weight_bytes_per_token as f64 / 1e6,
            r.weight_bandwidth / 1e9,
            roof,
            (r.tokens_per_s / b as f64) / roof
        );
    }
    Ok(())
}
