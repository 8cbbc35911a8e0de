//! `pdkv bench decode`: decode throughput per batch size, against the
//! memory-bandwidth roofline.
//!
//! Decoding one token of a batch-1 sequence reads every weight once, so its
//! speed is bounded by memory bandwidth: `tok/s × weight bytes per token ≤
//! bandwidth`. The roofline fraction at batch 1 says how close the math
//! kernels come to that bound. The last line of stdout is a JSON summary.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;
use pdkv_vmem::Pool;
use serde_json::{json, Value};

use crate::progress;

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Comma-separated batch sizes.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32")]
    pub batch_sizes: Vec<usize>,
    /// Tokens of context each sequence has before the timed steps.
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Timed decode steps per batch size.
    #[arg(long, default_value_t = 32)]
    pub steps: usize,
    /// Splits the model over this many tensor-parallel ranks (as `serve
    /// --tensor-parallel-size`).
    #[arg(long, short = 't', default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// The KV cache's element type (see `pdkv serve --kv-cache-dtype`).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: pdkv_model::KvDtype,
    /// Also prints where a timed step's wall time goes, operation by
    /// operation (the clock read at each boundary: a few percent slower)
    #[arg(long)]
    pub profile: bool,
}

#[derive(Args, Debug)]
pub struct PrefillArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Comma-separated prompt lengths in tokens.
    #[arg(long, value_delimiter = ',', default_value = "512,2048")]
    pub tokens: Vec<usize>,
    /// Tokens per forward step (the server's `--max-num-batched-tokens`).
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Timed prompts per length (the best is reported; one untimed prompt warms up first).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
    /// The KV cache's element type (see `pdkv serve --kv-cache-dtype`).
    #[arg(long, default_value = "auto")]
    pub kv_cache_dtype: pdkv_model::KvDtype,
}

#[derive(Args, Debug)]
pub struct PerplexityArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The text to score (UTF-8).
    #[arg(long)]
    pub file: PathBuf,
    /// Tokens per window (each window scored on its second half).
    #[arg(long, default_value_t = 512)]
    pub ctx: usize,
    /// KV cache element types to compare, the first the baseline.
    #[arg(long, value_delimiter = ',', default_value = "f32,f16")]
    pub kv_cache_dtype: Vec<pdkv_model::KvDtype>,
    /// Prompts cut from the text (spread over it) whose greedy
    /// continuations each type's are compared with the first type's; 0:
    /// none.
    #[arg(long, default_value_t = 200)]
    pub greedy_prompts: usize,
    /// Tokens of each such prompt.
    #[arg(long, default_value_t = 64)]
    pub greedy_prompt_len: usize,
    /// New tokens of each greedy continuation.
    #[arg(long, default_value_t = 32)]
    pub greedy_tokens: usize,
}

/// Sequences a step of the greedy continuations.
const GREEDY_BATCH: usize = 16;

/// `pdkv bench perplexity`: the text's perplexity over each KV cache type,
/// with its ratio to the first and the share of scored positions whose
/// greedy next token is the first type's; then, over `--greedy-prompts`
/// prompts cut from the text, how many greedy continuations are the first
/// type's token for token, and the share of tokens before the first
/// difference. The last line of stdout is a JSON summary.
pub fn run_perplexity(args: PerplexityArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.kv_cache_dtype.is_empty(),
        "--kv-cache-dtype names no type"
    );
    let text = std::fs::read_to_string(&args.file)
        .with_context(|| format!("reading {}", args.file.display()))?;
    let pool = Pool::default();
    let (path, loaded) = progress::load_model(args.model, &pool)?;
    let tokens = loaded.tokenizer.encode(&text, true)?;
    let prompts = greedy_prompts(&tokens, args.greedy_prompts, args.greedy_prompt_len)?;
    println!("model: {} ({})", loaded.name, path.display());
    println!(
        "text: {} ({} tokens), windows of {} tokens; greedy: {} prompts of {} tokens, {} new tokens each",
        args.file.display(),
        tokens.len(),
        args.ctx,
        prompts.len(),
        args.greedy_prompt_len,
        args.greedy_tokens
    );
    println!(
        "{:>6} {:>12} {:>10} {:>8} {:>14} {:>12} {:>12}",
        "kv", "perplexity", "vs first", "scored", "greedy agrees", "same answers", "same tokens"
    );
    let mut first: Option<(pdkv_model::bench::Perplexity, Vec<Vec<u32>>)> = None;
    let mut rows = Vec::new();
    for dtype in args.kv_cache_dtype {
        let p = pdkv_model::bench::perplexity(&loaded.model, &pool, &tokens, args.ctx, dtype)?;
        let answers = pdkv_model::bench::greedy_continuations(
            &loaded.model,
            &pool,
            &prompts,
            args.greedy_tokens,
            GREEDY_BATCH,
            dtype,
        )?;
        let (base, base_answers) = first.get_or_insert_with(|| {
            let p = pdkv_model::bench::Perplexity {
                greedy: p.greedy.clone(),
                ..p
            };
            (p, answers.clone())
        });
        // Positions whose greedy next token is the first type's.
        let same = p
            .greedy
            .iter()
            .zip(&base.greedy)
            .filter(|(a, b)| a == b)
            .count();
        let next_agrees = same as f64 / p.scored as f64;
        let (same_answers, prefix) = agreement(&answers, base_answers);
        let (answers_col, tokens_col) = match answers.len() {
            0 => ("-".to_string(), "-".to_string()),
            n => (
                format!("{same_answers}/{n}"),
                format!("{:.2}%", 100.0 * prefix),
            ),
        };
        println!(
            "{:>6} {:>12.4} {:>10.5} {:>8} {:>13.2}% {:>12} {:>12}",
            dtype.as_str(),
            p.perplexity,
            p.perplexity / base.perplexity,
            p.scored,
            100.0 * next_agrees,
            answers_col,
            tokens_col
        );
        rows.push(json!({
            "kv_cache_dtype": dtype.as_str(),
            "perplexity": p.perplexity,
            "vs_first": p.perplexity / base.perplexity,
            "scored": p.scored,
            "greedy_next_agrees": next_agrees,
            "same_answers": same_answers,
            "same_token_share": prefix,
        }));
    }
    println!(
        "{}",
        json!({
            "model": loaded.name,
            "ctx": args.ctx,
            "greedy_prompts": prompts.len(),
            "greedy_prompt_len": args.greedy_prompt_len,
            "greedy_tokens": args.greedy_tokens,
            "rows": rows,
        })
    );
    Ok(())
}

/// `n` prompts of `len` tokens cut from `tokens`, their starts spread
/// evenly from its first token to its last window.
fn greedy_prompts(tokens: &[u32], n: usize, len: usize) -> anyhow::Result<Vec<Vec<u32>>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    anyhow::ensure!(len >= 1, "--greedy-prompt-len 0");
    anyhow::ensure!(
        tokens.len() >= len,
        "the text has {} tokens, fewer than one greedy prompt of {len}",
        tokens.len()
    );
    let span = tokens.len() - len;
    Ok((0..n)
        .map(|i| {
            let start = span * i / (n - 1).max(1);
            tokens[start..start + len].to_vec()
        })
        .collect())
}

/// How many of `answers` equal `base`'s, and the share of all their tokens
/// that come before each answer's first difference from `base`'s.
fn agreement(answers: &[Vec<u32>], base: &[Vec<u32>]) -> (usize, f64) {
    let same = answers.iter().zip(base).filter(|(a, b)| a == b).count();
    let total: usize = base.iter().map(Vec::len).sum();
    let prefix: usize = answers
        .iter()
        .zip(base)
        .map(|(a, b)| a.iter().zip(b).take_while(|(x, y)| x == y).count())
        .sum();
    (same, prefix as f64 / total.max(1) as f64)
}

pub fn run_prefill(args: PrefillArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.tokens.is_empty(), "--tokens is empty");
    anyhow::ensure!(
        args.tokens.iter().all(|&t| t > 0),
        "prompt lengths must be positive"
    );
    anyhow::ensure!(
        args.chunk > 0 && args.repeats > 0,
        "--chunk and --repeats must be positive"
    );
    let pool = Pool::default();
    let (path, loaded) = progress::load_model(args.model, &pool)?;
    let model = &loaded.model;
    let max_len = model.config().max_position_embeddings;
    if let Some(&t) = args.tokens.iter().find(|&&t| t > max_len) {
        anyhow::bail!("--tokens {t} exceeds the model's context of {max_len}");
    }
    println!("model: {} ({})", loaded.name, path.display());
    println!(
        "chunks of {} tokens, best of {} prompts",
        args.chunk, args.repeats
    );
    println!("{:>7} {:>12}", "tokens", "tok/s");
    pdkv_model::bench::prefill_throughput(
        model,
        &pool,
        args.tokens[0].min(args.chunk),
        args.chunk,
        args.kv_cache_dtype,
    )?;
    let mut per_len: Vec<(usize, f64)> = Vec::new();
    for &tokens in &args.tokens {
        let mut best = 0f64;
        for _ in 0..args.repeats {
            let t = pdkv_model::bench::prefill_throughput(
                model,
                &pool,
                tokens,
                args.chunk,
                args.kv_cache_dtype,
            )
            .with_context(|| format!("a prompt of {tokens} tokens"))?;
            best = best.max(t);
        }
        println!("{tokens:>7} {best:>12.1}");
        per_len.push((tokens, best));
    }
    let fields: Vec<String> = per_len
        .iter()
        .map(|(n, t)| format!("\"{n}\":{}", json!(t)))
        .collect();
    println!(
        "{{\"chunk\":{},\"prefill_tok_s\":{{{}}}}}",
        args.chunk,
        fields.join(",")
    );
    Ok(())
}

/// A timed step's operations: milliseconds per step and share of the step.
fn print_profile(r: &pdkv_model::bench::DecodeResult) {
    let step = r.step_ms * 1e-3;
    for (op, secs) in &r.profile {
        println!(
            "       {:<10} {:>8.3} ms {:>5.1}%",
            op.name(),
            secs * 1e3,
            100.0 * secs / step
        );
    }
    let timed: f64 = r.profile.iter().map(|(_, s)| s).sum();
    println!(
        "       {:<10} {:>8.3} ms {:>5.1}%",
        "(other)",
        (step - timed) * 1e3,
        100.0 * (step - timed) / step
    );
}

/// Rounds batch 1's timed steps are taken in, each after a measurement of
/// the copy bandwidth: the share is their median, so that the bandwidth a
/// step is compared with is that of the same moment on a shared machine.
const B1_ROUNDS: usize = 8;

/// The smallest and largest of `v` (NaN for none).
fn extremes(v: impl IntoIterator<Item = f64>) -> (f64, f64) {
    v.into_iter()
        .fold((f64::NAN, f64::NAN), |(lo, hi), x| (lo.min(x), hi.max(x)))
}

pub fn run_decode(args: DecodeArgs) -> anyhow::Result<()> {
    anyhow::ensure!(!args.batch_sizes.is_empty(), "--batch-sizes is empty");
    anyhow::ensure!(
        args.batch_sizes.iter().all(|&b| b > 0),
        "batch sizes must be positive"
    );
    anyhow::ensure!(
        args.context > 0 && args.steps > 0,
        "--context and --steps must be positive"
    );
    let pool = Pool::default();
    let (path, loaded) = progress::load_model(args.model, &pool)?;
    let model = &loaded.model;
    let max_len = model.config().max_position_embeddings;
    anyhow::ensure!(
        args.context + args.steps <= max_len,
        "--context {} plus --steps {} exceeds the model's context of {max_len}",
        args.context,
        args.steps
    );

    eprintln!("measuring copy bandwidth");
    let mut copy = pdkv_model::bench::CopyBench::new()?;
    let bandwidth = copy.measure();
    println!("model: {} ({})", loaded.name, path.display());
    println!("copy bandwidth: {:.2} GB/s", bandwidth / 1e9);
    let region = &model.weights().region;
    println!(
        "weights: {:.1} MiB, {:.1} MiB of it in huge pages",
        region.len() as f64 / (1 << 20) as f64,
        region.huge_page_bytes() as f64 / (1 << 20) as f64
    );
    println!(
        "context {} tokens, {} timed steps",
        args.context, args.steps
    );
    println!("{:>6} {:>12} {:>10}", "batch", "tok/s", "ms/step");
    pdkv_model::profile::enable(args.profile);

    // In the order given (a JSON object from serde_json would sort the keys).
    let mut per_batch: Vec<(usize, f64)> = Vec::new();
    let mut roofline_b1 = Value::Null;
    let mut read_b1 = Value::Null;
    for &batch in &args.batch_sizes {
        // Batch 1's share of the copy bandwidth is taken round by round.
        let rounds = (batch == 1).then_some(pdkv_model::bench::Rounds {
            copy: &mut copy,
            count: B1_ROUNDS,
        });
        let r = match args.tensor_parallel_size {
            1 => pdkv_model::bench::decode_throughput(
                model,
                &pool,
                (batch, args.context, args.steps),
                args.kv_cache_dtype,
                rounds,
            ),
            n => pdkv_model::bench::decode_throughput_tp(
                model,
                n,
                (batch, args.context, args.steps),
                args.kv_cache_dtype,
                rounds,
            ),
        }
        .with_context(|| format!("decoding at batch {batch}"))?;
        println!("{:>6} {:>12.1} {:>10.2}", batch, r.tokens_per_s, r.step_ms);
        if args.profile {
            print_profile(&r);
        }
        if batch == 1 {
            let fractions = r.paired_fractions();
            let fraction = crate::bench_sleep::median(&fractions);
            let (f_lo, f_hi) = extremes(fractions.iter().copied());
            let (c_lo, c_hi) = extremes(r.rounds.iter().map(|x| x.copy_bandwidth / 1e9));
            println!(
                "       batch 1 streams {:.2} GB/s of weights ({:.1} MiB per token): {:.1}% of copy bandwidth",
                r.weight_bandwidth / 1e9,
                r.weight_bytes_per_token as f64 / (1024.0 * 1024.0),
                100.0 * fraction
            );
            println!(
                "       (the median of {} rounds, each against the copy bandwidth measured just before it: {:.1}-{:.1}%, copy {c_lo:.1}-{c_hi:.1} GB/s)",
                fractions.len(),
                100.0 * f_lo,
                100.0 * f_hi,
            );
            let reads = r.paired_read_fractions();
            let read_fraction = crate::bench_sleep::median(&reads);
            let (r_lo, r_hi) = extremes(reads.iter().copied());
            let (b_lo, b_hi) = extremes(r.rounds.iter().map(|x| x.read_bandwidth / 1e9));
            println!(
                "       against a plain read measured beside each copy: {:.1}% ({:.1}-{:.1}%, reads {b_lo:.1}-{b_hi:.1} GB/s)",
                100.0 * read_fraction,
                100.0 * r_lo,
                100.0 * r_hi,
            );
            roofline_b1 = json!(fraction);
            read_b1 = json!(read_fraction);
        }
        per_batch.push((batch, r.tokens_per_s));
    }
    let decode: Vec<String> = per_batch
        .iter()
        .map(|(b, t)| format!("\"{b}\":{}", json!(t)))
        .collect();
    println!(
        "{{\"bandwidth_gbs\":{},\"decode_tok_s\":{{{}}},\"roofline_fraction_b1\":{},\"read_fraction_b1\":{}}}",
        json!(bandwidth / 1e9),
        decode.join(","),
        roofline_b1,
        read_b1
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_prompts_spread_from_the_first_token_to_the_last_window() {
        let tokens: Vec<u32> = (0..100).collect();
        let p = greedy_prompts(&tokens, 3, 10).unwrap();
        let starts: Vec<u32> = p.iter().map(|w| w[0]).collect();
        assert_eq!(starts, [0, 45, 90]);
        assert!(p.iter().all(|w| w.len() == 10));
        assert_eq!(
            greedy_prompts(&tokens, 1, 100).unwrap(),
            vec![tokens.clone()]
        );
        assert!(greedy_prompts(&tokens, 0, 500).unwrap().is_empty());
        let e = greedy_prompts(&tokens, 2, 101).unwrap_err().to_string();
        assert!(e.contains("fewer than one greedy prompt"), "{e}");
    }

    #[test]
    fn agreement_counts_whole_answers_and_tokens_before_the_first_difference() {
        let base = vec![vec![1, 2, 3], vec![1, 5, 4], vec![7, 7, 7]];
        let answers = vec![vec![1, 2, 3], vec![1, 2, 4], vec![8, 7, 7]];
        // 3 + 1 + 0 of 9 tokens before a difference; one answer equal.
        assert_eq!(agreement(&answers, &base), (1, 4.0 / 9.0));
        assert_eq!(agreement(&base, &base), (3, 1.0));
    }
}
