//! A request's tokens and logits do not depend on what else is batched with
//! it, on how its prompt is chunked, on prefix-cache hits or on preemption.
//! Real tiny Llama and Qwen3 checkpoints, real loader, real forward pass.

use crate::common::*;
use pdkv_engine::{EngineHandle, FinishReason, SamplingParams};
use pdkv_model::Arch;

const PREFIX: u64 = 4242;

/// The request under test: a 48-token shared prefix plus its own tail.
fn target_prompt() -> Vec<u32> {
    let mut p = prompt(PREFIX, 48);
    p.extend(prompt(17, 13));
    p
}

fn seeded(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        // Random tied embeddings make the tiny models very confident: a high
        // temperature keeps the seeded run well away from greedy.
        temperature: 4.0,
        top_p: 0.95,
        top_k: 100,
        seed: Some(1234),
        max_tokens,
        ignore_eos: true,
        return_logits: true,
        ..SamplingParams::default()
    }
}

/// Runs the target (greedy and seeded variants) while 31 other requests of
/// various lengths and sampling settings run concurrently.
fn run_batched(e: &EngineHandle, tag: &str) -> (Collected, Collected) {
    let mut others = Vec::new();
    for i in 0..31u64 {
        let len = 3 + (i as usize * 11) % 90;
        let params = if i % 3 == 0 {
            SamplingParams {
                temperature: 1.0,
                seed: Some(i),
                max_tokens: 5 + (i as u32 % 20),
                ignore_eos: true,
                ..Default::default()
            }
        } else {
            greedy(5 + (i as u32 * 7) % 30)
        };
        others.push(
            e.add_request(request(
                &format!("{tag}-other-{i}"),
                prompt(100 + i, len),
                params,
            ))
            .unwrap(),
        );
        if i == 15 {
            // The targets join in the middle of the crowd.
            others.push(
                e.add_request(request(&format!("{tag}-g"), target_prompt(), greedy(24)))
                    .unwrap(),
            );
            others.push(
                e.add_request(request(&format!("{tag}-s"), target_prompt(), seeded(24)))
                    .unwrap(),
            );
        }
    }
    let mut results: Vec<(String, Collected)> = others
        .into_iter()
        .map(|s| (s.request_id().to_string(), collect(s)))
        .collect();
    for (id, c) in &results {
        assert_ne!(c.finish, Some(FinishReason::Abort), "{id} was aborted");
    }
    let take = |results: &mut Vec<(String, Collected)>, id: String| {
        let i = results.iter().position(|(r, _)| *r == id).unwrap();
        results.remove(i).1
    };
    let g = take(&mut results, format!("{tag}-g"));
    let s = take(&mut results, format!("{tag}-s"));
    (g, s)
}

fn check_arch(arch: Arch) {
    // Reference: each target alone on a fresh engine, no cache hit.
    let e = start(arch, config(512, 256));
    let ref_g = run_one(&e, request("g", target_prompt(), greedy(24)));
    assert_eq!(ref_g.num_cached_tokens, 0);
    assert_eq!(ref_g.tokens.len(), 24);
    assert_eq!(ref_g.finish, Some(FinishReason::Length));
    let ref_s = run_one(&e, request("s", target_prompt(), seeded(24)));
    assert_ne!(ref_s.tokens, ref_g.tokens, "seeded sampling is not greedy");
    // The same seed alone again, now with a prefix-cache hit on 48 + 0 tokens.
    let again = run_one(&e, request("s2", target_prompt(), seeded(24)));
    assert!(
        again.num_cached_tokens >= 48,
        "a repeated prompt hits the cache"
    );
    assert_same(&format!("{arch:?} seeded, cache hit"), &again, &ref_s);
    let other_seed = run_one(
        &e,
        request(
            "s3",
            target_prompt(),
            SamplingParams {
                seed: Some(99),
                ..seeded(24)
            },
        ),
    );
    assert_ne!(
        other_seed.tokens, ref_s.tokens,
        "another seed gives other tokens"
    );
    drop(e);

    // Batched with 31 others, for several chunk sizes.
    for budget in [7, 16, 64, 512] {
        let e = start(arch, config(budget, 256));
        let (g, s) = run_batched(&e, "b");
        assert_same(
            &format!("{arch:?} greedy, batched, budget {budget}"),
            &g,
            &ref_g,
        );
        assert_same(
            &format!("{arch:?} seeded, batched, budget {budget}"),
            &s,
            &ref_s,
        );
        wait_idle(&e);
    }

    // A prefix-cache hit: a request sharing the 48-token prefix runs first.
    let e = start(arch, config(64, 256));
    let mut sharer = prompt(PREFIX, 48);
    sharer.extend(prompt(5, 7));
    run_one(&e, request("sharer", sharer, greedy(3)));
    let hit = run_one(&e, request("g", target_prompt(), greedy(24)));
    assert_eq!(hit.num_cached_tokens, 48);
    assert!(e.stats().prefix_cache_hits >= 48);
    assert_same(&format!("{arch:?} greedy, prefix hit"), &hit, &ref_g);
    drop(e);

    // Preemption: a KV cache far too small for the crowd.
    let e = start(arch, config(64, 12));
    let (g, s) = run_batched(&e, "p");
    let stats = wait_idle(&e);
    assert!(
        stats.num_preemptions > 0,
        "no preemption happened: {stats:?}"
    );
    assert_same(&format!("{arch:?} greedy, preempted"), &g, &ref_g);
    assert_same(&format!("{arch:?} seeded, preempted"), &s, &ref_s);
}

#[test]
fn batch_invariance_llama() {
    check_arch(Arch::Llama);
}

#[test]
fn batch_invariance_qwen3() {
    check_arch(Arch::Qwen3);
}
