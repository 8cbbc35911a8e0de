//! Structured outputs in the engine: a constrained request's every output
//! follows its grammar (regex, choice, JSON schema, GBNF), greedy or
//! seeded; the rows it is sampled from are its logits with exactly the
//! forbidden tokens at `-inf` (log-probabilities read them); and batching
//! with other requests, n-gram drafts and preemption change none of its
//! tokens. Real tiny checkpoint, real llguidance grammars.

use crate::common::*;
use pdkv_engine::{EngineConfig, EngineHandle, FinishReason, SamplingParams, SpeculativeConfig};
use pdkv_model::Arch;
use pdkv_structured::{Compiler, JsonOptions, Spec};
use serde_json::{json, Value};

fn compiler(e: &EngineHandle) -> Compiler {
    Compiler::for_engine(e)
}

/// Whether a complete output follows its constraint.
type Check = fn(&str) -> bool;

/// The constraints under test, with a check of a complete output.
fn specs() -> Vec<(&'static str, Spec, Check)> {
    let schema = json!({
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 99},
            "tag": {"enum": ["a", "bb"]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "tag", "ok"],
        "additionalProperties": false,
    });
    vec![
        (
            "regex",
            Spec::Regex("[a-z]{2,5}( [a-z]{2,5}){1,2}\\.".into()),
            |t| {
                let Some(body) = t.strip_suffix('.') else {
                    return false;
                };
                let words: Vec<&str> = body.split(' ').collect();
                (2..=3).contains(&words.len())
                    && words.iter().all(|w| {
                        (2..=5).contains(&w.len()) && w.bytes().all(|b| b.is_ascii_lowercase())
                    })
            },
        ),
        (
            "choice",
            Spec::Choice(vec!["red".into(), "green".into(), "deep blue".into()]),
            |t| ["red", "green", "deep blue"].contains(&t),
        ),
        (
            "json",
            Spec::Json {
                schema,
                options: JsonOptions {
                    compact: true,
                    ..JsonOptions::default()
                },
            },
            |t| {
                let Ok(Value::Object(o)) = serde_json::from_str::<Value>(t) else {
                    return false;
                };
                o.len() == 3
                    && o["id"].as_u64().is_some_and(|i| i <= 99)
                    && ["a", "bb"].contains(&o["tag"].as_str().unwrap_or(""))
                    && o["ok"].is_boolean()
            },
        ),
        (
            "gbnf",
            Spec::Grammar("root ::= (\"ab\" | \"c\"){1,4} \"!\"".into()),
            |t| {
                t.strip_suffix('!').is_some_and(|b| {
                    !b.is_empty() && b.replace("ab", "").replace('c', "").is_empty()
                })
            },
        ),
    ]
}

/// (id, prompt, params, check) for every spec, greedy and seeded, plus
/// unconstrained requests in between.
#[allow(clippy::type_complexity)]
fn cases(c: &Compiler) -> Vec<(String, Vec<u32>, SamplingParams, Option<Check>)> {
    let mut v = Vec::new();
    for (i, (name, spec, check)) in specs().into_iter().enumerate() {
        let g = c.compile(&spec).unwrap_or_else(|e| panic!("{name}: {e}"));
        for (j, seed) in [None, Some(11u64), Some(12)].into_iter().enumerate() {
            let params = SamplingParams {
                temperature: if seed.is_some() { 1.5 } else { 0.0 },
                seed,
                max_tokens: 80,
                return_logits: true,
                constraint: Some(g.clone()),
                ..SamplingParams::default()
            };
            v.push((
                format!("{name}-{j}"),
                prompt(100 + i as u64 * 7 + j as u64, 12),
                params,
                Some(check),
            ));
        }
        v.push((
            format!("free-{i}"),
            prompt(200 + i as u64, 12),
            greedy(20),
            None,
        ));
    }
    v
}

fn run_all(e: &EngineHandle, c: &Compiler, batched: bool) -> Vec<Collected> {
    let cases = cases(c);
    if batched {
        let streams: Vec<_> = cases
            .into_iter()
            .map(|(id, p, s, _)| e.add_request(request(&id, p, s)).expect("accepted"))
            .collect();
        streams.into_iter().map(collect).collect()
    } else {
        cases
            .into_iter()
            .map(|(id, p, s, _)| run_one(e, request(&id, p, s)))
            .collect()
    }
}

/// Each row a constrained token was sampled from is the model's row with
/// exactly the tokens the grammar forbade there at `-inf`.
fn check_rows(id: &str, params: &SamplingParams, out: &Collected) {
    let mut m = params.constraint.as_ref().expect("constrained").start();
    for (k, (row, &tok)) in out.logits.iter().zip(&out.tokens).enumerate() {
        let mut probe = vec![0.0f32; row.len()];
        m.apply(&mut probe).expect("mask");
        for (t, (&p, &l)) in probe.iter().zip(row).enumerate() {
            assert_eq!(
                p == f32::NEG_INFINITY,
                l == f32::NEG_INFINITY,
                "{id}: token {t} at output {k}: the row is masked exactly as the grammar says"
            );
        }
        assert!(
            row[tok as usize].is_finite(),
            "{id}: sampled an allowed token"
        );
        m.commit(tok).expect("commit");
    }
}

#[test]
fn constrained_outputs_follow_their_grammar_batched_preempted_and_with_drafts() {
    let plain = start(Arch::Llama, config(256, 256));
    let c = compiler(&plain);
    let want = run_all(&plain, &c, false);
    for ((id, _, params, check), out) in cases(&c).iter().zip(&want) {
        let Some(check) = check else { continue };
        assert_eq!(
            out.finish,
            Some(FinishReason::Stop),
            "{id}: ends at the grammar's end: {:?}",
            out.text
        );
        assert!(
            check(&out.text),
            "{id}: {:?} breaks its constraint",
            out.text
        );
        check_rows(id, params, out);
    }
    let st = wait_idle(&plain).structured;
    assert!(st.num_masks > 0 && st.num_steps > 0, "{st:?}");
    assert_eq!(st.num_running, 0, "constrained requests all ended");

    // Batched together with unconstrained requests: the same tokens.
    let got = run_all(&plain, &c, true);
    for ((id, ..), (g, w)) in cases(&c).iter().zip(got.iter().zip(&want)) {
        assert_same(&format!("{id} batched"), g, w);
    }

    // Drafts (their rows masked in turn) and preemption (the matcher stays
    // with the request) change nothing.
    let spec: SpeculativeConfig =
        r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1,"prompt_lookup_max":2}"#
            .parse()
            .unwrap();
    let drafting = start(
        Arch::Llama,
        EngineConfig {
            speculative: Some(spec),
            ..config(256, 256)
        },
    );
    let tight = start(Arch::Llama, config(64, 14));
    for (name, e) in [("drafts", &drafting), ("preempted", &tight)] {
        let c = compiler(e);
        let got = run_all(e, &c, true);
        for ((id, ..), (g, w)) in cases(&c).iter().zip(got.iter().zip(&want)) {
            assert_same(&format!("{id} {name}"), g, w);
        }
    }
    assert!(
        wait_idle(&drafting).spec.num_drafts > 0,
        "drafts were proposed"
    );
    assert!(
        wait_idle(&tight).num_preemptions > 0,
        "requests were preempted"
    );
}

/// Outputs produced elsewhere (`resume_token_ids`) advance the grammar as
/// if sampled here; ones that break it end the request with an error.
#[test]
fn resumed_outputs_advance_the_grammar() {
    let e = start(Arch::Llama, config(256, 256));
    let c = compiler(&e);
    let g = c
        .compile(&Spec::Choice(vec!["abcabc".into(), "xyz".into()]))
        .unwrap();
    let params = SamplingParams {
        temperature: 0.0,
        max_tokens: 40,
        constraint: Some(g),
        ..SamplingParams::default()
    };
    let tok = e.tokenizer().clone();
    let head = tok.encode("abc", false).unwrap();
    let mut req = request("resumed", prompt(5, 10), params.clone());
    req.resume_token_ids = head.clone();
    let out = run_one(&e, req);
    assert_eq!(out.finish, Some(FinishReason::Stop));
    assert_eq!(
        out.text, "abc",
        "the rest of \"abcabc\" after the resumed \"abc\""
    );

    let mut req = request("broken", prompt(5, 10), params);
    req.resume_token_ids = tok.encode("q", false).unwrap();
    let mut s = e.add_request(req).expect("accepted");
    let last = std::iter::from_fn(|| s.blocking_next())
        .last()
        .expect("an output");
    assert_eq!(last.finish_reason, Some(FinishReason::Error));
    assert!(last.error.unwrap_or_default().contains("structured output"));
    assert_eq!(wait_idle(&e).structured.num_running, 0);
}

/// A `keep` pause in the middle of a constrained request freezes it with
/// its grammar; after the resume it ends as it would have. A stop string
/// cuts a constrained output as any other.
#[test]
fn a_keep_pause_and_a_stop_string_leave_the_grammar_in_place() {
    let e = start(Arch::Llama, config(256, 256));
    let c = compiler(&e);
    // Long enough (300 letters) to be running when the pause comes.
    let letters = c.compile(&Spec::Regex("[a-z]{300}".into())).unwrap();
    let params = SamplingParams {
        temperature: 1.5,
        seed: Some(3),
        max_tokens: 400,
        constraint: Some(letters),
        ..SamplingParams::default()
    };
    let want = run_one(&e, request("whole", prompt(31, 12), params.clone()));
    assert_eq!(want.finish, Some(FinishReason::Stop));
    assert!(want.text.len() == 300 && want.text.bytes().all(|b| b.is_ascii_lowercase()));

    let mut s = e
        .add_request(request("paused", prompt(31, 12), params))
        .expect("accepted");
    let mut got = Collected::default();
    let first = s.blocking_next().expect("a first output");
    got.tokens.extend(&first.token_ids);
    got.text.push_str(&first.text);
    e.pause(pdkv_engine::PauseMode::Keep, true, WAIT)
        .expect("pause");
    e.resume().expect("resume");
    while let Some(o) = s.blocking_next() {
        got.tokens.extend(&o.token_ids);
        got.text.push_str(&o.text);
        got.finish = o.finish_reason;
    }
    assert_eq!(
        (&got.tokens, &got.text, got.finish),
        (&want.tokens, &want.text, want.finish)
    );

    let words = c
        .compile(&Spec::Regex("[a-z]{2,5}( [a-z]{2,5}){1,2}\\.".into()))
        .unwrap();
    let cut = SamplingParams {
        temperature: 0.0,
        max_tokens: 40,
        stop: vec![" ".into()],
        constraint: Some(words),
        ..SamplingParams::default()
    };
    let out = run_one(&e, request("cut", prompt(32, 12), cut));
    assert_eq!(out.finish, Some(FinishReason::Stop));
    assert!(
        (2..=5).contains(&out.text.len()) && out.text.bytes().all(|b| b.is_ascii_lowercase()),
        "the first word only: {:?}",
        out.text
    );
}
