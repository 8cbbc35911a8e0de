//! `pdkv bench structured`: decode throughput of concurrent requests
//! constrained by a JSON schema against the same requests unconstrained,
//! in one run on one engine, and what the masks cost: their compute time
//! per step (mostly overlapped with the forward pass) and the time steps
//! waited for them. Both sides generate exactly `--max-tokens` tokens a
//! request (the schema asks for a long array, the free side ignores EOS),
//! so the token counts match and the ratio compares like with like. The
//! last line of stdout is a JSON summary.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use pdkv_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, GrammarRef, SamplingParams, StructuredStats,
};
use pdkv_structured::{Compiler, JsonOptions, Spec};
use pdkv_vmem::Pool;
use serde_json::json;

use crate::progress;

#[derive(Args, Debug)]
pub struct StructuredArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Tokens each request generates.
    #[arg(long, default_value_t = 128)]
    pub max_tokens: u32,
    /// Times each side runs (the best run counts).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
}

/// Records of people: a schema with nested objects, arrays, enums, bounds
/// and required fields, long enough that no answer completes it.
pub(crate) fn schema() -> serde_json::Value {
    json!({
        "type": "object",
        "properties": {"people": {"type": "array", "minItems": 200, "items": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 20},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "role": {"enum": ["admin", "editor", "viewer"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
                "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
            },
            "required": ["name", "age", "role", "tags", "address"],
        }}},
        "required": ["people"],
    })
}

/// One side's run: its tokens and wall time, and the mask counters it added.
struct Side {
    run: progress::Throughput,
    masks: StructuredStats,
}

impl Side {
    fn tok_s(&self) -> f64 {
        self.run.tok_s()
    }
}

pub fn run_structured(args: StructuredArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(args.concurrency > 0, "--concurrency must be at least 1");
    let pool = Pool::default();
    let (path, model) = progress::load_model(args.model.clone(), &pool)?;
    let prompts: Vec<Vec<u32>> = (0..args.concurrency)
        .map(|i| {
            let ask = format!(
                "List the staff of office {i} as JSON: name, age, role, tags and address of each person."
            );
            progress::user_prompt(&model, &ask)
        })
        .collect::<anyhow::Result<_>>()?;
    let name = model.name.clone();
    let engine = Engine::start(
        model,
        pool,
        EngineConfig {
            max_num_seqs: args.concurrency.max(1),
            ..EngineConfig::default()
        },
    )
    .context("starting the engine")?;
    let result = (|| -> anyhow::Result<()> {
        let compiler = Compiler::for_engine(&engine);
        let t0 = Instant::now();
        let grammar = compiler
            .compile(&Spec::Json {
                schema: schema(),
                options: JsonOptions::default(),
            })
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        let compile_ms = t0.elapsed().as_secs_f64() * 1e3;
        println!("model: {name} ({})", path.display());
        println!(
            "{} concurrent requests, {} tokens each, temperature 1 (seeded), best of {}; schema compiled in {compile_ms:.1} ms (the first compile, preparing the tokenizer too)",
            args.concurrency, args.max_tokens, args.repeats
        );
        let (mut free, mut guided): (Option<Side>, Option<Side>) = (None, None);
        for rep in 0..args.repeats {
            let f = run_side(&engine, &prompts, &args, None, rep)?;
            let g = run_side(&engine, &prompts, &args, Some(&grammar), rep)?;
            if free.as_ref().is_none_or(|b| f.tok_s() > b.tok_s()) {
                free = Some(f);
            }
            if guided.as_ref().is_none_or(|b| g.tok_s() > b.tok_s()) {
                guided = Some(g);
            }
        }
        let (free, guided) = (free.expect("a run"), guided.expect("a run"));
        let m = &guided.masks;
        let steps = m.num_steps.max(1) as f64;
        let ratio = guided.tok_s() / free.tok_s();
        println!("{:<14} {:>9} {:>9}", "side", "tokens", "tok/s");
        println!(
            "{:<14} {:>9} {:>9.1}",
            "unconstrained",
            free.run.tokens,
            free.tok_s()
        );
        println!(
            "{:<14} {:>9} {:>9.1}",
            "json schema",
            guided.run.tokens,
            guided.tok_s()
        );
        println!("ratio (json schema / unconstrained): {ratio:.3}x");
        println!(
            "masks: {} in {} steps; compute {:.2} ms a step ({:.0} us a mask, beside the forward pass), steps waited {:.3} ms a step",
            m.num_masks,
            m.num_steps,
            1e3 * m.mask_seconds / steps,
            1e6 * m.mask_seconds / (m.num_masks.max(1) as f64),
            1e3 * m.mask_wait_seconds / steps
        );
        println!(
            "{}",
            json!({"concurrency": args.concurrency, "max_tokens": args.max_tokens,
                "unconstrained_tok_s": free.tok_s(), "structured_tok_s": guided.tok_s(), "ratio": ratio,
                "compile_ms": compile_ms, "masks": m.num_masks, "mask_steps": m.num_steps,
                "mask_ms_per_step": 1e3 * m.mask_seconds / steps,
                "mask_wait_ms_per_step": 1e3 * m.mask_wait_seconds / steps})
        );
        Ok(())
    })();
    engine.shutdown();
    result
}

/// Runs every prompt at once (constrained by `grammar` when given) and
/// waits for all: the tokens, the wall time and the mask counters added.
fn run_side(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    args: &StructuredArgs,
    grammar: Option<&GrammarRef>,
    rep: usize,
) -> anyhow::Result<Side> {
    let before = engine.stats().structured;
    let tag = if grammar.is_some() { "json" } else { "free" };
    let t0 = Instant::now();
    let mut readers = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let req = EngineRequest::new(
            format!("{tag}-{rep}-{i}"),
            p.clone(),
            SamplingParams {
                temperature: 1.0,
                seed: Some(i as u64),
                max_tokens: args.max_tokens,
                ignore_eos: grammar.is_none(),
                constraint: grammar.cloned(),
                ..SamplingParams::default()
            },
        );
        let mut stream = engine.add_request(req)?;
        readers.push(std::thread::spawn(move || {
            crate::bench_pd::collect(&mut stream, t0).map(|(_, toks)| toks.len())
        }));
    }
    let mut tokens = 0;
    for r in readers {
        tokens += r
            .join()
            .map_err(|_| anyhow::anyhow!("a reader panicked"))??;
    }
    let seconds = t0.elapsed().as_secs_f64();
    // The stats of the last step are published after its outputs.
    let after = engine
        .wait_stats(std::time::Duration::from_secs(10), |s| {
            s.num_running == 0 && s.num_waiting == 0
        })
        .context("the engine did not go idle after the run")?
        .structured;
    if tokens != prompts.len() * args.max_tokens as usize {
        bail!(
            "{tag}: {tokens} tokens, expected {} (a request ended early)",
            prompts.len() * args.max_tokens as usize
        );
    }
    Ok(Side {
        run: progress::Throughput { tokens, seconds },
        masks: StructuredStats {
            num_masks: after.num_masks - before.num_masks,
            mask_seconds: after.mask_seconds - before.mask_seconds,
            mask_wait_seconds: after.mask_wait_seconds - before.mask_wait_seconds,
            num_steps: after.num_steps - before.num_steps,
            num_running: 0,
        },
    })
}
