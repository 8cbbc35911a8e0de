//! Speculative decoding (n-gram drafts) changes nothing a request gets: the
//! same tokens, bit-identical logits and the same text as an engine without
//! it, greedy or seeded, with penalties, stop tokens and `max_tokens`
//! inside a draft, alone or batched. Real tiny checkpoints, real forward.

use crate::common::*;
use pdkv_engine::{EngineConfig, EngineHandle, FinishReason, SamplingParams, SpeculativeConfig};
use pdkv_model::Arch;

/// A prompt that repeats itself, so that drafts are proposed at once.
fn repetitive(seed: u64) -> Vec<u32> {
    let unit = prompt(seed, 9);
    unit.iter().cycle().take(9 * 5).copied().collect()
}

fn seeded(seed: u64, max_tokens: u32) -> SamplingParams {
    SamplingParams {
        // The tiny models are very confident: a high temperature keeps the
        // seeded run away from greedy.
        temperature: 4.0,
        top_p: 0.95,
        top_k: 100,
        seed: Some(seed),
        max_tokens,
        ignore_eos: true,
        return_logits: true,
        ..SamplingParams::default()
    }
}

/// The requests under test: (id, prompt, sampling).
fn cases() -> Vec<(String, Vec<u32>, SamplingParams)> {
    let mut v = Vec::new();
    for i in 0..4u64 {
        v.push((format!("g{i}"), repetitive(i), greedy(48)));
        v.push((format!("s{i}"), repetitive(10 + i), seeded(i, 48)));
        v.push((format!("r{i}"), prompt(20 + i, 30), greedy(40)));
    }
    // Penalties read the history the drafts extend.
    v.push((
        "pen".into(),
        repetitive(7),
        SamplingParams {
            repetition_penalty: 1.3,
            presence_penalty: 0.5,
            ..greedy(40)
        },
    ));
    // A short max_tokens ends inside a draft.
    v.push(("len".into(), repetitive(8), greedy(5)));
    v
}

fn engine(arch: Arch, spec: Option<SpeculativeConfig>) -> TestEngine {
    start(
        arch,
        EngineConfig {
            speculative: spec,
            ..config(256, 256)
        },
    )
}

fn run_all(e: &EngineHandle, batched: bool) -> Vec<Collected> {
    let cases = cases();
    if batched {
        let streams: Vec<_> = cases
            .into_iter()
            .map(|(id, p, s)| e.add_request(request(&id, p, s)).expect("accepted"))
            .collect();
        streams.into_iter().map(collect).collect()
    } else {
        cases
            .into_iter()
            .map(|(id, p, s)| run_one(e, request(&id, p, s)))
            .collect()
    }
}

fn check_arch(arch: Arch) {
    let plain = engine(arch, None);
    let spec: SpeculativeConfig =
        r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1,"prompt_lookup_max":3}"#
            .parse()
            .unwrap();
    let fast = engine(arch, Some(spec));
    let want = run_all(&plain, false);
    for batched in [false, true] {
        let got = run_all(&fast, batched);
        for (((id, _, _), g), w) in cases().iter().zip(&got).zip(&want) {
            assert_same(&format!("{arch:?} {id} batched {batched}"), g, w);
        }
    }
    let len = want
        .iter()
        .zip(cases())
        .find(|(_, c)| c.0 == "len")
        .unwrap()
        .0;
    assert_eq!(
        (len.tokens.len(), len.finish),
        (5, Some(FinishReason::Length))
    );
    let st = wait_idle(&fast).spec;
    assert!(
        st.num_drafts > 0 && st.num_accepted_tokens > 0,
        "{arch:?}: drafts were proposed and some kept: {st:?}"
    );
    assert!(
        st.num_accepted_tokens < st.num_draft_tokens,
        "{arch:?}: some drafts were rejected (the correction path ran): {st:?}"
    );
    assert_eq!(wait_idle(&plain).spec.num_drafts, 0);
}

#[test]
fn speculative_decoding_gives_what_decoding_without_it_gives_llama() {
    check_arch(Arch::Llama);
}

#[test]
fn speculative_decoding_gives_what_decoding_without_it_gives_qwen3() {
    check_arch(Arch::Qwen3);
}

/// A stop string that completes inside a run of confirmed drafts ends
/// the request at that token, with the text cut as without drafts (the
/// engine without them says where).
#[test]
fn a_stop_string_completed_inside_a_draft_ends_the_request_there() {
    let spec: SpeculativeConfig =
        r#"{"method":"ngram","num_speculative_tokens":4,"prompt_lookup_min":1}"#
            .parse()
            .unwrap();
    let plain = engine(Arch::Llama, None);
    let fast = engine(Arch::Llama, Some(spec));
    let p = repetitive(3);
    let free = run_one(&plain, request("free", p.clone(), greedy(48)));
    // One token a step without drafts: each delta is one token's text
    // (held-back text aside, none here: no stop strings).
    let stop: String = free.deltas[..6].concat();
    assert!(!stop.is_empty(), "the tiny model's tokens have text");
    let params = SamplingParams {
        stop: vec![stop],
        ..greedy(48)
    };
    let want = run_one(&plain, request("w", p.clone(), params.clone()));
    let got = run_one(&fast, request("g", p, params));
    assert_eq!(want.finish, Some(FinishReason::Stop));
    assert!(want.tokens.len() < 48, "{:?}", want.tokens);
    assert_same("stop string", &got, &want);
    let st = wait_idle(&fast).spec;
    assert!(st.num_accepted_tokens > 0, "{st:?} {:?}", want.tokens);
}
