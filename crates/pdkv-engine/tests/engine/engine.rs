//! Engine behaviour on a real tiny checkpoint: stops (token ids, strings,
//! EOS, max_tokens), streaming text, aborts, disconnects, bad requests and
//! shutdown.

use std::time::Duration;

use crate::common::*;
use pdkv_engine::{AddRequestError, EngineConfig, FinishReason, SamplingParams};
use pdkv_model::Arch;

fn engine() -> TestEngine {
    start(Arch::Qwen3, config(64, 128))
}

/// Sampled text that is varied enough to contain ASCII stop candidates.
fn varied(max_tokens: u32, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: 4.0,
        top_k: 100,
        seed: Some(seed),
        max_tokens,
        ignore_eos: true,
        ..Default::default()
    }
}

#[test]
fn max_tokens_ends_with_length_and_deltas_make_the_text() {
    let e = engine();
    let c = run_one(&e, request("a", prompt(1, 20), varied(30, 1)));
    assert_eq!(c.finish, Some(FinishReason::Length));
    assert_eq!(c.tokens.len(), 30);
    assert_eq!(c.num_prompt_tokens, 20);
    assert_eq!(
        c.text,
        e.tokenizer().decode(&c.tokens, true),
        "streamed deltas add up to the full decode"
    );
    assert!(c.logits.is_empty(), "no logits unless asked");
    assert!(c.deltas.iter().all(|d| !d.contains('\u{FFFD}')) || c.text.contains('\u{FFFD}'));
    wait_idle(&e);
}

#[test]
fn stop_token_id_ends_the_request_and_is_not_in_the_text() {
    let e = engine();
    let full = run_one(&e, request("ref", prompt(2, 12), varied(40, 2)));
    // Stop on the token at index 10 (its first occurrence).
    let stop = full.tokens[10];
    let k = full.tokens.iter().position(|&t| t == stop).unwrap();
    let params = SamplingParams {
        stop_token_ids: vec![stop],
        ..varied(40, 2)
    };
    let c = run_one(&e, request("stop", prompt(2, 12), params));
    assert_eq!(c.finish, Some(FinishReason::Stop));
    assert_eq!(
        c.tokens,
        full.tokens[..=k].to_vec(),
        "the stop token is the last token"
    );
    assert_eq!(
        c.text,
        e.tokenizer().decode(&full.tokens[..k], true),
        "the stop token's text is left out"
    );
    wait_idle(&e);
}

#[test]
fn stop_string_cuts_the_text_and_never_streams_it() {
    let e = engine();
    let full = run_one(&e, request("ref", prompt(3, 12), varied(60, 3)));
    let text = full.text.clone();
    // A two-character ASCII stop string that first occurs after a few characters.
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    let (pos, stop) = chars
        .windows(2)
        .filter(|w| w[0].0 >= 4 && w.iter().all(|(_, c)| c.is_ascii_alphanumeric()))
        .map(|w| (w[0].0, format!("{}{}", w[0].1, w[1].1)))
        .find(|(p, s)| text.find(s.as_str()) == Some(*p))
        .unwrap_or_else(|| panic!("no ASCII stop candidate in {text:?}"));
    let params = SamplingParams {
        stop: vec![stop.clone()],
        ..varied(60, 3)
    };
    let c = run_one(&e, request("stop", prompt(3, 12), params));
    assert_eq!(c.finish, Some(FinishReason::Stop));
    assert_eq!(
        c.text,
        text[..pos],
        "text is cut before the stop string {stop:?}"
    );
    assert!(c.tokens.len() < full.tokens.len());
    assert_eq!(c.tokens, full.tokens[..c.tokens.len()].to_vec());
    for d in &c.deltas {
        assert!(!d.contains(stop.as_str()));
    }
    wait_idle(&e);
}

#[test]
fn eos_stops_unless_ignored() {
    let e = engine();
    let mut eos: Vec<u32> = e.tokenizer().eos_token_ids().to_vec();
    eos.extend(&e.model_config().eos_token_ids);
    assert!(!eos.is_empty());
    // Find a seed whose (near-uniform, very hot) sampling produces an EOS.
    let hot = |seed| SamplingParams {
        temperature: 50.0,
        seed: Some(seed),
        max_tokens: 200,
        ignore_eos: true,
        ..Default::default()
    };
    let streams: Vec<_> = (0..16)
        .map(|s| {
            e.add_request(request(&format!("probe{s}"), prompt(4, 8), hot(s)))
                .unwrap()
        })
        .collect();
    let probes: Vec<_> = streams.into_iter().map(collect).collect();
    let (seed, k) = probes
        .iter()
        .enumerate()
        .find_map(|(s, c)| {
            c.tokens
                .iter()
                .position(|t| eos.contains(t))
                .map(|k| (s as u64, k))
        })
        .expect("some probe sampled an EOS token");
    assert_eq!(
        probes[seed as usize].tokens.len(),
        200,
        "ignore_eos runs to max_tokens"
    );
    let c = run_one(
        &e,
        request(
            "eos",
            prompt(4, 8),
            SamplingParams {
                ignore_eos: false,
                ..hot(seed)
            },
        ),
    );
    assert_eq!(c.finish, Some(FinishReason::Stop));
    assert_eq!(c.tokens, probes[seed as usize].tokens[..=k].to_vec());
    wait_idle(&e);
}

#[test]
fn abort_mid_generation_frees_all_blocks() {
    let e = engine();
    let mut s = e
        .add_request(request("long", prompt(5, 40), varied(800, 5)))
        .unwrap();
    for _ in 0..3 {
        let o = s.blocking_next().unwrap();
        assert!(o.finish_reason.is_none());
    }
    let st = e.stats();
    assert!(
        st.kv_blocks_free < st.kv_blocks_total,
        "the request holds blocks while running"
    );
    assert!(e.abort("long"));
    let mut last = None;
    while let Some(o) = s.blocking_next() {
        last = o.finish_reason;
    }
    assert_eq!(last, Some(FinishReason::Abort));
    assert!(!e.abort("long"), "a finished id is unknown");
    assert!(!e.abort("never-added"));
    wait_idle(&e);
}

#[test]
fn dropping_the_stream_aborts_and_frees_all_blocks() {
    let e = engine();
    // One stream is dropped after an output, another before reading any.
    let mut s = e
        .add_request(request("gone", prompt(6, 40), varied(800, 6)))
        .unwrap();
    let unread = e
        .add_request(request("gone-unread", prompt(7, 30), varied(800, 7)))
        .unwrap();
    s.blocking_next().unwrap();
    drop(s);
    drop(unread);
    wait_idle(&e);
    // The ids are free again.
    let c = run_one(&e, request("gone", prompt(6, 5), varied(2, 6)));
    assert_eq!(c.finish, Some(FinishReason::Length));
}

#[test]
fn bad_requests_are_refused() {
    let e = start(
        Arch::Llama,
        EngineConfig {
            num_kv_blocks: 8,
            ..config(64, 8)
        },
    );
    let ok = || varied(4, 1);
    let invalid = |r: Result<_, AddRequestError>| matches!(r, Err(AddRequestError::Invalid(_)));
    assert!(invalid(e.add_request(request("x", vec![], ok()))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams {
            max_tokens: 0,
            ..ok()
        }
    ))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams {
            temperature: -0.5,
            ..ok()
        }
    ))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams {
            temperature: f32::NAN,
            ..ok()
        }
    ))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams { top_p: 0.0, ..ok() }
    ))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams { top_p: 1.5, ..ok() }
    ))));
    assert!(invalid(e.add_request(request(
        "x",
        prompt(1, 4),
        SamplingParams {
            stop: vec![String::new()],
            ..ok()
        }
    ))));
    let vocab = e.model_config().vocab_size as u32;
    assert!(invalid(e.add_request(request("x", vec![1, vocab], ok()))));
    let max_len = e.max_model_len();
    assert_eq!(max_len, e.model_config().max_position_embeddings);
    match e.add_request(request(
        "x",
        prompt(1, max_len - 2),
        SamplingParams {
            max_tokens: 3,
            ..ok()
        },
    )) {
        Err(AddRequestError::TooLong {
            prompt,
            max_tokens: 3,
            max_model_len,
        }) => {
            assert_eq!((prompt, max_model_len), (max_len - 2, max_len));
        }
        other => panic!(
            "expected TooLong, got {:?}",
            other.map(|s| s.request_id().to_string())
        ),
    }
    // 8 blocks hold 128 tokens: 120 + 9 - 1 = 128 fits, 120 + 10 - 1 does not.
    assert!(e
        .add_request(request(
            "fits",
            prompt(1, 120),
            SamplingParams {
                max_tokens: 9,
                ..ok()
            }
        ))
        .is_ok());
    assert_eq!(
        e.add_request(request(
            "x",
            prompt(1, 120),
            SamplingParams {
                max_tokens: 10,
                ..ok()
            }
        ))
        .err(),
        Some(AddRequestError::ExceedsKvCapacity {
            needed: 9,
            total: 8
        })
    );
    // Duplicate while live.
    let live = e
        .add_request(request("dup", prompt(2, 10), varied(100, 2)))
        .unwrap();
    assert_eq!(
        e.add_request(request("dup", prompt(2, 10), ok())).err(),
        Some(AddRequestError::DuplicateId("dup".into()))
    );
    drop(live);
    wait_idle(&e);
    // Nothing was refused into a leak, and the engine still serves.
    let c = run_one(&e, request("after", prompt(3, 10), ok()));
    assert_eq!(c.tokens.len(), 4);
    e.shutdown();
    assert_eq!(
        e.add_request(request("late", prompt(3, 10), ok())).err(),
        Some(AddRequestError::Stopped)
    );
}

#[test]
fn shutdown_aborts_running_requests() {
    let e = engine();
    let mut s = e
        .add_request(request("long", prompt(8, 30), varied(900, 8)))
        .unwrap();
    s.blocking_next().unwrap();
    e.shutdown();
    let mut last = None;
    while let Some(o) = s.blocking_next() {
        last = o.finish_reason;
    }
    assert_eq!(last, Some(FinishReason::Abort));
    assert!(e.is_stopped());
    let st = e.wait_stats(Duration::from_secs(1), |s| {
        s.kv_blocks_free == s.kv_blocks_total
    });
    assert!(st.is_some(), "blocks freed at shutdown: {:?}", e.stats());
}

#[test]
fn reset_prefix_cache_drops_hits_and_is_refused_while_running() {
    let e = engine();
    let p = prompt(9, 40);
    run_one(&e, request("a", p.clone(), varied(3, 9)));
    assert_eq!(
        run_one(&e, request("b", p.clone(), varied(3, 9))).num_cached_tokens,
        32
    );
    let mut long = e
        .add_request(request("long", prompt(10, 20), varied(500, 10)))
        .unwrap();
    long.blocking_next().unwrap();
    assert!(
        !e.reset_prefix_cache(),
        "refused while a request holds blocks"
    );
    drop(long);
    wait_idle(&e);
    assert!(e.reset_prefix_cache());
    assert_eq!(
        run_one(&e, request("c", p, varied(3, 9))).num_cached_tokens,
        0,
        "no hit after a reset"
    );
}
