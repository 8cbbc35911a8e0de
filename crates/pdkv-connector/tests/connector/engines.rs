//! End to end on real engines: a prefill engine with a producer connector
//! and a decode engine with a consumer connector, on a tiny random model;
//! the decode engine's greedy tokens and logits equal a colocated engine's.

use crate::common::{
    assert_finished, colocated, d_engine, error_of, fingerprint, idle_and_free, metric, p_engine,
    pd, prefix_prompts, prompt, pull_params, run,
};
use pdkv_engine::FinishReason;

/// Each prompt through P then D (6 tokens) and through the colocated
/// engine: D's greedy tokens and logits equal the colocated engine's.
fn pd_as_colocated(
    p: &crate::common::Started,
    d: &crate::common::Started,
    colo: &crate::common::Started,
    prompts: &[Vec<u32>],
    what: &str,
) {
    for (i, pr) in prompts.iter().enumerate() {
        let dout = pd(&p.handle, &d.handle, &format!("x{i}"), pr, 6)
            .unwrap_or_else(|e| panic!("prompt {i} {what}: {e}"));
        let cout = run(&colo.handle, &format!("c{i}"), pr.clone(), 6, None);
        assert_eq!(fingerprint(&dout), fingerprint(&cout), "prompt {i} {what}");
    }
}

fn pd_matches_colocated(transport: &str) {
    let t = format!(r#","transport":"{transport}""#);
    let p = p_engine(&t, "p1");
    let d = d_engine(&t, "d1");
    let colo = colocated();
    // Shared prefixes: D has local prefix hits for some.
    let what = format!("over {transport}");
    pd_as_colocated(&p, &d, &colo, &prefix_prompts(), &what);
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
    // Every prompt longer than its local prefix hit was really loaded: 3
    // loads (the 5-token prompt moves 1 block too), none failed.
    assert_eq!(metric(&d.handle, "loads_ok_total"), 4.0);
    assert_eq!(metric(&d.handle, "loads_failed_total"), 0.0);
    assert_eq!(metric(&p.handle, "pulls_ok_total"), 4.0);
    assert!(metric(&p.handle, "bytes_sent_total") > 0.0);
}

#[test]
fn decode_after_remote_prefill_equals_colocated_over_tcp() {
    pd_matches_colocated("tcp");
}

#[test]
fn decode_after_remote_prefill_equals_colocated_over_shm() {
    pd_matches_colocated("shm");
}

#[test]
fn a_bogus_transfer_fails_only_its_request_and_recompute_recovers() {
    let p = p_engine(r#","arrival_timeout_s":0.2"#, "p1");
    let d = d_engine("", "d1");
    let dr = d_engine(r#","kv_load_failure_policy":"recompute""#, "d2");
    let colo = colocated();
    let bogus = pull_params(&p.handle, "nope");
    let pr = prompt(9, 33);
    let why = error_of(
        &run(&d.handle, "bad", pr.clone(), 3, Some(bogus.clone())),
        "D under fail",
    );
    assert!(
        why.contains("nope") && why.contains("unknown to the prefill engine"),
        "{why}"
    );
    // Recompute: the same failure, then the tokens equal a colocated run.
    let out = run(&dr.handle, "bad", pr.clone(), 3, Some(bogus));
    assert_finished(&out, FinishReason::Length, "D under recompute");
    assert_eq!(
        fingerprint(&out),
        fingerprint(&run(&colo.handle, "c", pr.clone(), 3, None))
    );
    // A good request on D afterwards.
    pd(&p.handle, &d.handle, "good", &pr, 3).expect("a good transfer after the bogus one");
    for e in [&p.handle, &d.handle, &dr.handle] {
        idle_and_free(e);
    }
}

/// Requests at once on a fresh pair over shared memory: the first
/// transfers all find D's KV cache not yet mapped at P, and every one must
/// succeed. Catches the race in which two of them both mapped the segment
/// and the second map retired the first mapping under the first write
/// (which then failed with "segment 1 is not registered now"). Several
/// fresh pairs, since the race needs two maps to overlap.
#[test]
fn the_first_transfers_at_once_over_shm_all_succeed() {
    const PAIRS: usize = 8;
    const AT_ONCE: usize = 8;
    let t = r#","transport":"shm""#;
    let colo = colocated();
    let prompts: Vec<Vec<u32>> = (0..AT_ONCE)
        .map(|i| prompt(70 + i as u64, 20 + 3 * i))
        .collect();
    let want: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, pr)| fingerprint(&run(&colo.handle, &format!("c{i}"), pr.clone(), 3, None)))
        .collect();
    for pair in 0..PAIRS {
        let p = p_engine(t, &format!("p-cold{pair}"));
        let d = d_engine(t, &format!("d-cold{pair}"));
        let (ph, dh) = (&p.handle, &d.handle);
        let outs: Vec<_> = std::thread::scope(|s| {
            let runs: Vec<_> = prompts
                .iter()
                .enumerate()
                .map(|(i, pr)| s.spawn(move || pd(ph, dh, &format!("x{i}"), pr, 3)))
                .collect();
            runs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for (i, out) in outs.iter().enumerate() {
            let out = out
                .as_ref()
                .unwrap_or_else(|e| panic!("pair {pair}, request {i}: {e}"));
            assert_eq!(fingerprint(out), want[i], "pair {pair}, request {i}");
        }
        assert_eq!(metric(dh, "loads_failed_total"), 0.0, "pair {pair}");
        idle_and_free(ph);
        idle_and_free(dh);
    }
}

/// A P, a D and a colocated engine of KV dtype `dtype` on the tiny model
/// of `arch`: D's tokens and logits for two prompts equal the colocated
/// engine's, every load succeeds and every block is freed; returns the
/// bytes P sent.
fn pd_equals_colocated(arch: pdkv_model::Arch, dtype: pdkv_model::KvDtype) -> f64 {
    use crate::common::{config, consumer, producer, start_on};
    use pdkv_engine::EngineConfig;
    let with = || EngineConfig {
        kv_cache_dtype: dtype,
        ..config()
    };
    let built = |json: &str, id: &str| Some(pdkv_connector::build(json, id).unwrap());
    let p = start_on(arch, built(&producer(""), "p1"), with()).unwrap();
    let d = start_on(arch, built(&consumer(""), "d1"), with()).unwrap();
    let colo = start_on(arch, None, with()).unwrap();
    let what = format!("with {dtype} KV");
    pd_as_colocated(&p, &d, &colo, &[prompt(5, 40), prompt(6, 70)], &what);
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 2.0, "{dtype:?}");
    metric(&p.handle, "bytes_sent_total")
}

/// An f16 (or bf16) KV cache on both sides: D's tokens and logits equal a
/// colocated engine's of that dtype, for half the bytes an f32 pair moves
/// for the same prompts.
#[test]
fn pd_with_16_bit_kv_equals_colocated_for_half_the_bytes() {
    use pdkv_model::{Arch, KvDtype};
    let sent: Vec<f64> = [KvDtype::F32, KvDtype::F16, KvDtype::BF16]
        .into_iter()
        .map(|dtype| pd_equals_colocated(Arch::Llama, dtype))
        .collect();
    assert!(
        sent[0] > 0.0 && sent[1] * 2.0 == sent[0] && sent[2] == sent[1],
        "bytes sent f32, f16, bf16: {sent:?}"
    );
}

/// A q8_0 KV cache on both sides (the tiny Qwen3: heads of 32 values, one
/// q8_0 block a row): D's tokens and logits equal a colocated q8_0
/// engine's, for 34 bytes a row where f16 moves 64; a model whose heads are
/// not a multiple of 32 values is refused at start, naming q8_0.
#[test]
fn pd_with_q8_0_kv_equals_colocated_for_34_bytes_a_row() {
    use crate::common::{config, start_on};
    use pdkv_engine::EngineConfig;
    use pdkv_model::{Arch, KvDtype};
    let sent: Vec<f64> = [KvDtype::F16, KvDtype::Q8_0]
        .into_iter()
        .map(|dtype| pd_equals_colocated(Arch::Qwen3, dtype))
        .collect();
    assert!(
        sent[1] > 0.0 && sent[1] * 64.0 == sent[0] * 34.0,
        "bytes sent f16, q8_0: {sent:?}"
    );
    let q8 = EngineConfig {
        kv_cache_dtype: KvDtype::Q8_0,
        ..config()
    };
    let err = start_on(Arch::Llama, None, q8)
        .err()
        .map(|e| format!("{e:#}"))
        .expect("heads of 16 values refused");
    assert!(err.contains("q8_0") && err.contains("32"), "{err}");
}

/// P and D with KV caches of different dtypes cannot share blocks, even
/// of the same size (bf16 and f16): D's load fails naming both layouts
/// (each with its dtype).
#[test]
fn prefill_and_decode_of_different_kv_dtypes_refuse_each_others_blocks() {
    use crate::common::{config, consumer, engine, producer};
    use pdkv_engine::EngineConfig;
    use pdkv_model::KvDtype;
    let with = |dtype| EngineConfig {
        kv_cache_dtype: dtype,
        ..config()
    };
    for (pt, dt) in [(KvDtype::F16, KvDtype::F32), (KvDtype::BF16, KvDtype::F16)] {
        let p = engine(Some((&producer(""), "p1")), with(pt));
        let d = engine(Some((&consumer(""), "d1")), with(dt));
        let err = pd(&p.handle, &d.handle, "x", &prompt(7, 40), 3).expect_err("a dtype mismatch");
        assert!(
            err.contains("layout mismatch")
                && err.contains(&format!(":{pt}"))
                && err.contains(&format!(":{dt}")),
            "{pt} P, {dt} D: {err}"
        );
        idle_and_free(&p.handle);
        idle_and_free(&d.handle);
    }
}

/// D decodes with n-gram drafts after loading P's KV: its tokens and
/// logits are a colocated engine's without drafts, and drafts were kept.
#[test]
fn a_speculating_decode_engine_equals_colocated_without_drafts() {
    use crate::common::{config, consumer, engine, producer};
    use pdkv_engine::EngineConfig;
    let spec = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":1}"#
        .parse()
        .unwrap();
    let p = engine(Some((&producer(""), "p1")), config());
    let d = engine(
        Some((&consumer(""), "d1")),
        EngineConfig {
            speculative: Some(spec),
            ..config()
        },
    );
    let colo = colocated();
    for (i, pr) in [prompt(5, 40), prompt(6, 70)].iter().enumerate() {
        let dout = pd(&p.handle, &d.handle, &format!("x{i}"), pr, 24)
            .unwrap_or_else(|e| panic!("prompt {i}: {e}"));
        let cout = run(&colo.handle, &format!("c{i}"), pr.clone(), 24, None);
        assert_eq!(fingerprint(&dout), fingerprint(&cout), "prompt {i}");
    }
    idle_and_free(&p.handle);
    idle_and_free(&d.handle);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 2.0);
    let st = d.handle.stats().spec;
    assert!(st.num_accepted_tokens > 0, "D kept drafts: {st:?}");
}
