//! Log-probabilities from the engine: prompt log-probabilities cover every
//! prompt position however the prompt is chunked and even when the prefix
//! cache holds it, and they agree exactly with the log-probabilities the
//! same tokens got when they were sampled. Real tiny Llama checkpoint.

use crate::common::*;
use pdkv_engine::sampling::TokenLogprobs;
use pdkv_engine::{EngineHandle, SamplingParams};
use pdkv_model::Arch;

struct Run {
    tokens: Vec<u32>,
    logprobs: Vec<TokenLogprobs>,
    prompt_logprobs: Vec<Option<TokenLogprobs>>,
    num_cached_tokens: usize,
}

fn run(e: &EngineHandle, id: &str, prompt: Vec<u32>, params: SamplingParams) -> Run {
    let mut s = e
        .add_request(request(id, prompt, params))
        .expect("request accepted");
    let mut r = Run {
        tokens: Vec::new(),
        logprobs: Vec::new(),
        prompt_logprobs: Vec::new(),
        num_cached_tokens: 0,
    };
    while let Some(o) = s.blocking_next() {
        r.tokens.extend(&o.token_ids);
        r.logprobs.extend(o.logprobs);
        if let Some(p) = o.prompt_logprobs {
            assert!(r.prompt_logprobs.is_empty(), "prompt logprobs come once");
            r.prompt_logprobs = p;
        }
        r.num_cached_tokens = o.num_cached_tokens;
    }
    r
}

fn sampled(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 2.0,
        seed: Some(5),
        max_tokens,
        ignore_eos: true,
        logprobs: Some(3),
        prompt_logprobs: Some(2),
        ..SamplingParams::default()
    }
}

#[test]
fn prompt_logprobs_cover_every_position_however_chunked_and_match_sampled_logprobs() {
    let whole = start(Arch::Llama, config(512, 64));
    let chunked = start(Arch::Llama, config(8, 64));
    let prompt = prompt(31, 40);
    // The prefix cache holds the prompt; a prompt-logprobs request does not use it.
    run(
        &chunked,
        "warm",
        prompt.clone(),
        SamplingParams {
            prompt_logprobs: None,
            ..sampled(2)
        },
    );
    let a = run(&whole, "a", prompt.clone(), sampled(6));
    let b = run(&chunked, "b", prompt.clone(), sampled(6));
    assert_eq!(b.num_cached_tokens, 0, "no prefix-cache hit");
    assert_eq!(a.prompt_logprobs.len(), prompt.len());
    assert!(a.prompt_logprobs[0].is_none());
    for (p, e) in a.prompt_logprobs.iter().enumerate().skip(1) {
        let e = e
            .as_ref()
            .unwrap_or_else(|| panic!("position {p} has no logprob"));
        assert_eq!(e.token, prompt[p]);
        assert_eq!(e.top.len(), 2);
        assert!(e.top[0].1 >= e.top[1].1 && e.logprob <= e.top[0].1);
    }
    assert_eq!(
        a.prompt_logprobs, b.prompt_logprobs,
        "chunking changes nothing"
    );
    assert_eq!((&a.tokens, &a.logprobs), (&b.tokens, &b.logprobs));
    assert_eq!(a.logprobs.len(), 6);

    // The completed text as a prompt: its last positions are the sampled tokens.
    let full: Vec<u32> = prompt.iter().chain(&a.tokens).copied().collect();
    let again = run(
        &chunked,
        "again",
        full,
        SamplingParams {
            logprobs: None,
            ..sampled(1)
        },
    );
    for (j, lp) in a.logprobs.iter().enumerate() {
        let e = again.prompt_logprobs[prompt.len() + j].as_ref().unwrap();
        assert_eq!(
            (e.token, e.logprob, e.rank),
            (lp.token, lp.logprob, lp.rank),
            "output token {j}"
        );
        assert_eq!(e.top, lp.top[..2].to_vec());
    }
    wait_idle(&whole);
    wait_idle(&chunked);
}

#[test]
fn penalties_and_bias_change_the_tokens_not_the_reported_logprobs() {
    let e = start(Arch::Llama, config(512, 64));
    let prompt = prompt(8, 12);
    let greedy = SamplingParams {
        temperature: 0.0,
        max_tokens: 8,
        ignore_eos: true,
        logprobs: Some(0),
        ..SamplingParams::default()
    };
    let plain = run(&e, "plain", prompt.clone(), greedy.clone());
    let forced = 3u32;
    let biased = run(
        &e,
        "biased",
        prompt.clone(),
        SamplingParams {
            logit_bias: vec![(forced, 100.0)],
            ..greedy.clone()
        },
    );
    assert_eq!(biased.tokens, vec![forced; 8]);
    assert_ne!(plain.tokens[0], forced, "the bias is what picks the token");
    // Reported from the raw row: the forced token's logprob is the one the
    // unbiased model gives it (read back as a prompt logprob).
    let mut with_forced = prompt.clone();
    with_forced.push(forced);
    let check = SamplingParams {
        prompt_logprobs: Some(0),
        logprobs: None,
        max_tokens: 1,
        ..greedy.clone()
    };
    let raw = run(&e, "raw", with_forced, check);
    let want = raw.prompt_logprobs[prompt.len()].as_ref().unwrap();
    assert_eq!(
        (biased.logprobs[0].token, biased.logprobs[0].logprob),
        (forced, want.logprob)
    );
    assert!(biased.logprobs[0].rank > 1, "not the raw argmax");
    // A strong repetition penalty never repeats a token greedily here.
    let penalised = run(
        &e,
        "rep",
        prompt,
        SamplingParams {
            repetition_penalty: 1e6,
            ..greedy
        },
    );
    let mut seen = std::collections::BTreeSet::new();
    assert!(
        penalised.tokens.iter().all(|t| seen.insert(*t)),
        "{:?}",
        penalised.tokens
    );
    wait_idle(&e);
}
