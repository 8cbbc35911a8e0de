//! `pdkv bench spec`: batch-1 decode with speculative decoding (n-gram
//! drafts) against the same engine without it, in one run, on two
//! workloads: one whose answers repeat their prompts (editing and copying
//! lists) and one whose answers do not (free writing). Every
//! request runs greedy, one at a time; the outputs of the two engines must
//! be the same tokens, and the ratio of their decode speeds is the figure.
//! The last line of stdout is a JSON summary.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use pdkv_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, SamplingParams, SpeculativeConfig,
};
use pdkv_vmem::Pool;
use serde_json::json;

use crate::progress;

#[derive(Args, Debug)]
pub struct SpecArgs {
    /// A `.gguf` file or Hugging Face directory (default: the cached SmolLM2).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// The speculative engine's configuration (see `pdkv serve --speculative-config`).
    #[arg(
        long,
        default_value = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_max":5,"prompt_lookup_min":3}"#
    )]
    pub speculative_config: SpeculativeConfig,
    /// Tokens each answer may run to (it ends earlier at EOS).
    #[arg(long, default_value_t = 160)]
    pub max_tokens: u32,
    /// Times each workload runs on each engine (the best run counts).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
}

/// Edits and copies of the prompt's own text: answers that repeat it
/// (SmolLM2-135M copies these faithfully; asked to rewrite code it
/// rewrites it freely instead, so code is left out).
const REPETITIVE: [&str; 3] = [
    "Fix the spelling mistakes in this list and copy the rest as it is:\n\
- Turn off the lights in the kitchen.\n- Close the windows in the bedrom.\n\
- Water the plants on the balcony.\n- Feed the cat and refill its water bowl.\n\
- Lock the front door and the garage.\n- Take the rubbish out before nine.\n\
- Set the alarm for seven in the morning.\n",
    "Copy the following list exactly, one item per line:\n\
- Preheat the oven to 180 degrees.\n- Mix the flour, the sugar and the butter in a large bowl.\n\
- Add two eggs and a cup of milk, then stir until smooth.\n- Pour the batter into a greased tin.\n\
- Bake for forty minutes, then let it cool before serving.\n",
    "Here is a shopping list:\n1. Two loaves of bread\n2. A dozen eggs\n3. One litre of milk\n\
4. A bag of apples\n5. Three tins of tomatoes\n6. A packet of rice\n7. Olive oil\n8. Fresh basil\n\
Write the list again with the items in the same order, each on its own line.",
];

/// Requests for new text: answers that repeat little of their prompts.
const FRESH: [&str; 3] = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain why the sky is blue to a ten year old child.",
    "Give three tips for learning to play the guitar, with a reason for each.",
];

/// One workload on one engine: tokens after the first, and the time they took.
type Decode = progress::Throughput;

pub fn run_spec(args: SpecArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repeats > 0, "--repeats must be at least 1");
    anyhow::ensure!(args.max_tokens > 1, "--max-tokens must be at least 2");
    let pool_off = Pool::default();
    let (path, off_model) = progress::load_model(args.model.clone(), &pool_off)?;
    let render = |text: &str| progress::user_prompt(&off_model, text);
    let workloads: Vec<(&str, Vec<Vec<u32>>)> = vec![
        (
            "repetitive (edit a list, copy a list, rewrite a list)",
            REPETITIVE
                .iter()
                .map(|t| render(t))
                .collect::<anyhow::Result<_>>()?,
        ),
        (
            "fresh (a story, an explanation, tips)",
            FRESH
                .iter()
                .map(|t| render(t))
                .collect::<anyhow::Result<_>>()?,
        ),
    ];
    let name = off_model.name.clone();
    let off = Engine::start(off_model, pool_off, EngineConfig::default())
        .context("starting the engine without drafts")?;
    let pool_on = Pool::default();
    let (_, on_model) = progress::load_model(args.model.clone(), &pool_on)?;
    let on = Engine::start(
        on_model,
        pool_on,
        EngineConfig {
            speculative: Some(args.speculative_config),
            ..EngineConfig::default()
        },
    )
    .context("starting the engine with drafts")?;

    println!("model: {name} ({})", path.display());
    println!(
        "speculative: n-gram, {} tokens, lookup {}..={}; greedy, batch 1, up to {} tokens, best of {}",
        args.speculative_config.num_speculative_tokens,
        args.speculative_config.prompt_lookup_min,
        args.speculative_config.prompt_lookup_max,
        args.max_tokens,
        args.repeats
    );
    println!(
        "{:<58} {:>9} {:>9} {:>7} {:>9}",
        "workload", "off tok/s", "on tok/s", "ratio", "accepted"
    );
    let mut rows = Vec::new();
    let result = (|| -> anyhow::Result<()> {
        for (label, prompts) in &workloads {
            let (mut best_off, mut best_on) = (Decode::default(), Decode::default());
            let before = on.stats().spec;
            for rep in 0..args.repeats {
                let (d_off, out_off) = run_workload(&off, prompts, args.max_tokens, rep, "off")?;
                let (d_on, out_on) = run_workload(&on, prompts, args.max_tokens, rep, "on")?;
                if out_off != out_on {
                    bail!("{label}: the outputs with drafts differ from those without");
                }
                if d_off.tok_s() > best_off.tok_s() {
                    best_off = d_off;
                }
                if d_on.tok_s() > best_on.tok_s() {
                    best_on = d_on;
                }
            }
            let after = on.stats().spec;
            let drafted = after.num_draft_tokens - before.num_draft_tokens;
            let kept = after.num_accepted_tokens - before.num_accepted_tokens;
            let share = kept as f64 / (drafted as f64).max(1.0);
            let ratio = best_on.tok_s() / best_off.tok_s();
            println!(
                "{label:<58} {:>9.1} {:>9.1} {:>6.2}x {:>8.1}%",
                best_off.tok_s(),
                best_on.tok_s(),
                ratio,
                100.0 * share
            );
            rows.push(json!({"workload": label, "off_tok_s": best_off.tok_s(),
                "on_tok_s": best_on.tok_s(), "ratio": ratio,
                "draft_tokens": drafted, "accepted_tokens": kept}));
        }
        Ok(())
    })();
    off.shutdown();
    on.shutdown();
    result?;
    println!("outputs with and without drafts: identical");
    println!("{}", json!({ "workloads": rows }));
    Ok(())
}

/// Runs `prompts` one at a time: the decode time and tokens (after each
/// answer's first token) and every answer's tokens.
fn run_workload(
    engine: &EngineHandle,
    prompts: &[Vec<u32>],
    max_tokens: u32,
    rep: usize,
    tag: &str,
) -> anyhow::Result<(Decode, Vec<Vec<u32>>)> {
    let mut total = Decode::default();
    let mut outputs = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let req = EngineRequest::new(
            format!("{tag}-{rep}-{i}"),
            p.clone(),
            SamplingParams {
                temperature: 0.0,
                max_tokens,
                ..SamplingParams::default()
            },
        );
        let t0 = Instant::now();
        let mut stream = engine.add_request(req)?;
        let (ttft, toks) = crate::bench_pd::collect(&mut stream, t0)?;
        // The first output is the prompt's one token; the rest is decode.
        total.tokens += toks.len() - 1;
        total.seconds += (t0.elapsed() - ttft).as_secs_f64();
        outputs.push(toks);
    }
    Ok((total, outputs))
}
