//! The host-memory offload connector and the multi-connector on real
//! engines (a tiny random model): KV loaded from host memory gives the same
//! greedy tokens and logits bits as a colocated engine computing it, the
//! store survives a KV sleep, eviction keeps it within its budget, and a
//! multi-connector of P/D transfer plus offload does both jobs.

use crate::common::{
    assert_finished, colocated, config, engine, fingerprint, idle_and_free, metric, prompt,
    remote_prefill, WAIT,
};
use pdkv_engine::{EngineConfig, EngineHandle, FinishReason, PauseMode, RequestOutput, SleepLevel};
use serde_json::json;

/// [`config`] with prefix caching and sleep mode as given.
fn opts(prefix_caching: bool, sleep_mode: bool) -> EngineConfig {
    EngineConfig {
        enable_prefix_caching: prefix_caching,
        enable_sleep_mode: sleep_mode,
        ..config()
    }
}

/// Runs a request that must finish by length (every request here does).
fn run(
    e: &EngineHandle,
    id: &str,
    tokens: Vec<u32>,
    max_tokens: u32,
    params: Option<serde_json::Value>,
) -> Vec<RequestOutput> {
    let out = crate::common::run(e, id, tokens, max_tokens, params);
    assert_finished(&out, FinishReason::Length, &format!("request {id}"));
    out
}

const OFFLOAD: &str = r#"{"kv_connector":"offload"}"#;

/// Checks `e`'s output for `tokens` against a colocated engine's.
fn check_equal(e: &EngineHandle, colo: &EngineHandle, id: &str, tokens: &[u32], max_tokens: u32) {
    let out = run(e, id, tokens.to_vec(), max_tokens, None);
    let want = run(
        colo,
        &format!("colo-{id}"),
        tokens.to_vec(),
        max_tokens,
        None,
    );
    assert_eq!(fingerprint(&out), fingerprint(&want), "request {id}");
}

#[test]
fn blocks_loaded_from_host_memory_give_the_colocated_output() {
    // No local prefix cache: only the offload store can serve a prefix.
    let e = engine(Some((OFFLOAD, "o1")), opts(false, false));
    let colo = colocated();
    let h = &e.handle;
    let bb = metric(h, "offload_block_bytes");
    assert!(bb > 0.0);

    // A: 70 tokens, 4 full blocks saved when it ends.
    let a = prompt(1, 70);
    check_equal(h, &colo.handle, "a", &a, 4);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 0.0);
    assert_eq!(metric(h, "offload_saved_blocks_total"), 4.0);
    assert_eq!(metric(h, "offload_blocks_held"), 4.0);
    assert_eq!(metric(h, "offload_bytes_held"), 4.0 * bb);

    // B: A plus a suffix: its 4 first blocks come from host memory.
    let b = [&a[..], &prompt(2, 10)[..]].concat();
    check_equal(h, &colo.handle, "b", &b, 6);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 4.0);
    assert_eq!(metric(h, "offload_loaded_bytes_total"), 4.0 * bb);
    // B's fifth block is new.
    assert_eq!(metric(h, "offload_saved_blocks_total"), 5.0);

    // A again: 69 tokens may be loaded, so 4 whole blocks.
    check_equal(h, &colo.handle, "a2", &a, 4);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 8.0);

    // A prompt sharing only A's first block loads only that one.
    let c = [&a[..16], &prompt(3, 40)[..]].concat();
    check_equal(h, &colo.handle, "c", &c, 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 9.0);

    // A prompt sharing A's second block but not its first loads nothing:
    // the key covers the whole prefix.
    let d = [&prompt(4, 16)[..], &a[16..64]].concat();
    let misses = metric(h, "offload_lookup_misses_total");
    check_equal(h, &colo.handle, "d", &d, 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 9.0);
    assert_eq!(metric(h, "offload_lookup_misses_total"), misses + 1.0);

    // A different prompt never hits.
    check_equal(h, &colo.handle, "other", &prompt(5, 70), 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 9.0);
    assert_eq!(metric(h, "offload_lookup_misses_total"), misses + 2.0);
    assert_eq!(metric(h, "offload_evicted_blocks_total"), 0.0);
    idle_and_free(h);

    // A prefix-cache reset leaves the store, as vLLM's does without
    // `reset_external`: A's blocks come back from host memory.
    assert!(h.reset_prefix_cache_with(false, false));
    let held = metric(h, "offload_blocks_held");
    assert_eq!(
        held,
        metric(h, "offload_saved_blocks_total"),
        "nothing dropped"
    );
    assert!(held >= 4.0);
    check_equal(h, &colo.handle, "a-kept", &a, 4);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 13.0);
    idle_and_free(h);

    // With `reset_external` it empties the store too.
    assert!(h.reset_prefix_cache_with(false, true));
    assert_eq!(metric(h, "offload_bytes_held"), 0.0);
    assert_eq!(metric(h, "offload_blocks_held"), 0.0);
    check_equal(h, &colo.handle, "a3", &a, 4);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 13.0);
    assert_eq!(metric(h, "offload_lookup_misses_total"), misses + 3.0);
    idle_and_free(h);
}

#[test]
fn the_offload_store_survives_a_kv_sleep() {
    let e = engine(Some((OFFLOAD, "o2")), opts(true, true));
    let colo = colocated();
    let h = &e.handle;
    let a = prompt(11, 70);
    check_equal(h, &colo.handle, "a", &a, 4);
    assert_eq!(metric(h, "offload_saved_blocks_total"), 4.0);

    h.sleep(SleepLevel::L1, PauseMode::Abort, WAIT).unwrap();
    assert!(
        !h.pool().is_awake(pdkv_vmem::Tag::KvCache),
        "level 1 releases the KV cache"
    );
    assert_eq!(
        metric(h, "offload_blocks_held"),
        4.0,
        "a sleep leaves the host store alone"
    );
    h.wake_up(None).unwrap();

    // The sleep invalidated the local prefix cache: the whole prefix comes
    // from host memory (had the local cache served any block, the connector
    // would have been asked only for the blocks after it), and the output
    // is the colocated one.
    let b = [&a[..], &prompt(12, 10)[..]].concat();
    check_equal(h, &colo.handle, "b", &b, 6);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 4.0);
    idle_and_free(h);
}

#[test]
fn eviction_keeps_the_store_within_max_bytes() {
    // Learn the block size from a first engine's connector.
    let probe = engine(Some((OFFLOAD, "probe")), opts(false, false));
    let bb = metric(&probe.handle, "offload_block_bytes") as u64;
    drop(probe);
    let max = 3 * bb + bb / 2;
    let cfg = json!({"kv_connector": "offload", "max_bytes": max}).to_string();
    let e = engine(Some((&cfg, "o3")), opts(false, false));
    let colo = colocated();
    let h = &e.handle;
    // Four prompts of two full blocks each, into room for three blocks.
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(20 + i, 40)).collect();
    for (i, p) in prompts.iter().enumerate() {
        run(h, &format!("p{i}"), p.clone(), 2, None);
        assert!(
            metric(h, "offload_bytes_held") <= max as f64,
            "over budget after prompt {i}"
        );
    }
    assert_eq!(metric(h, "offload_saved_blocks_total"), 8.0);
    assert_eq!(metric(h, "offload_blocks_held"), 3.0);
    assert_eq!(metric(h, "offload_bytes_held"), 3.0 * bb as f64);
    assert_eq!(metric(h, "offload_evicted_blocks_total"), 5.0);
    // Chains are evicted from the tail: the last prompt keeps both blocks,
    // the third its first block; the first prompt is gone.
    let fourth = [&prompts[3][..32], &prompt(31, 10)[..]].concat();
    check_equal(h, &colo.handle, "fourth", &fourth, 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 2.0);
    let third = [&prompts[2][..32], &prompt(30, 10)[..]].concat();
    check_equal(h, &colo.handle, "third", &third, 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 3.0);
    let first = [&prompts[0][..32], &prompt(32, 10)[..]].concat();
    check_equal(h, &colo.handle, "first", &first, 3);
    assert_eq!(metric(h, "offload_hit_blocks_total"), 3.0);
    assert!(metric(h, "offload_bytes_held") <= max as f64);
    idle_and_free(h);
}

#[test]
fn multi_of_pd_and_offload_transfers_and_saves_on_both_sides() {
    let pc = r#"{"kv_connector":"multi","connectors":[{"kv_connector":"pdkv","kv_role":"kv_producer"},{"kv_connector":"offload"}]}"#;
    let dc = r#"{"kv_connector":"multi","connectors":[{"kv_connector":"pdkv","kv_role":"kv_consumer"},{"kv_connector":"offload"}]}"#;
    // No local prefix cache, so that repeats are served by the offload tier.
    let p = engine(Some((pc, "mp")), opts(false, true));
    let d = engine(Some((dc, "md")), opts(false, true));
    let colo = colocated();
    let info = d.handle.kv_connector_info().unwrap();
    assert_eq!(info["kv_connector"], "multi");
    assert_eq!(info["connectors"][1]["kv_connector"], "offload");

    let prompts = [prompt(40, 70), prompt(41, 33)];
    let pd_round = |round: usize| {
        for (i, pr) in prompts.iter().enumerate() {
            let kp = remote_prefill(
                &p.handle,
                &format!("p{round}-{i}"),
                pr,
                &format!("t{round}-{i}"),
            );
            // The P/D child keeps P's blocks for D, so the multi does too.
            let held = p.handle.wait_stats(WAIT, |s| s.kv_blocks_held > 0);
            assert!(
                held.is_some(),
                "P freed the blocks before D pulled: {:?}",
                p.handle.stats()
            );
            let dout = run(&d.handle, &format!("d{round}-{i}"), pr.clone(), 6, Some(kp));
            let cout = run(&colo.handle, &format!("c{round}-{i}"), pr.clone(), 6, None);
            assert_eq!(
                fingerprint(&dout),
                fingerprint(&cout),
                "round {round}, prompt {i}"
            );
        }
    };
    pd_round(0);
    // Both sides saved the prompts' full blocks (4 + 2); nothing was
    // served from host memory yet.
    for e in [&p.handle, &d.handle] {
        assert_eq!(metric(e, "offload_saved_blocks_total"), 6.0);
        assert_eq!(metric(e, "offload_hit_blocks_total"), 0.0);
    }
    assert_eq!(metric(&d.handle, "loads_ok_total"), 2.0);
    assert_eq!(metric(&p.handle, "pulls_ok_total"), 2.0);

    // A KV sleep on both: P/D re-registers, the offload stores stay.
    for e in [&p.handle, &d.handle] {
        e.sleep(SleepLevel::L1, PauseMode::Abort, WAIT).unwrap();
        e.wake_up(None).unwrap();
        assert_eq!(metric(e, "offload_blocks_held"), 6.0);
    }

    // The same prompts again: P's prefix comes from its offload store (4 +
    // 2 blocks), D's from P (the P/D child is asked first and wins).
    pd_round(1);
    assert_eq!(metric(&p.handle, "offload_hit_blocks_total"), 6.0);
    assert_eq!(metric(&d.handle, "offload_hit_blocks_total"), 0.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 4.0);
    assert_eq!(metric(&p.handle, "pulls_ok_total"), 4.0);

    // A plain request on D falls through to the offload child.
    check_equal(&d.handle, &colo.handle, "plain", &prompts[0], 5);
    assert_eq!(metric(&d.handle, "offload_hit_blocks_total"), 4.0);
    assert_eq!(metric(&d.handle, "loads_ok_total"), 4.0);
    for e in [&p.handle, &d.handle] {
        idle_and_free(e);
    }
}

#[test]
fn multi_configuration_is_checked_and_sleep_support_is_the_and_of_children() {
    let ok = pdkv_connector::build(
        r#"{"kv_connector":"multi","connectors":[{"kv_connector":"offload","max_bytes":4096},{"kv_connector":"offload"}]}"#,
        "m1",
    )
    .unwrap();
    assert!(ok.supports_sleep_mode());
    assert_eq!(ok.name(), "multi");
    // Two children of one kind: their metrics are told apart by index.
    let names: Vec<&str> = ok.metrics_reader().unwrap()()
        .into_iter()
        .map(|m| m.0)
        .collect();
    assert!(
        names.contains(&"offload0_offload_max_bytes")
            && names.contains(&"offload1_offload_max_bytes"),
        "{names:?}"
    );
    let unique: std::collections::HashSet<_> = names.iter().collect();
    assert_eq!(unique.len(), names.len(), "metric names are unique");

    let err = |cfg: &str| {
        pdkv_connector::build(cfg, "m1")
            .err()
            .map(|e| format!("{e:#}"))
            .expect("refused")
    };
    let e = err(r#"{"kv_connector":"multi","connectors":[]}"#);
    assert!(e.contains("connectors") && e.contains("1 to 4"), "{e}");
    let five = vec![json!({"kv_connector": "offload"}); 5];
    let e = err(&json!({"kv_connector": "multi", "connectors": five}).to_string());
    assert!(e.contains("1 to 4"), "{e}");
    let e = err(r#"{"kv_connector":"multi","connectors":[{"kv_connector":"offload"}],"extra":1}"#);
    assert!(e.contains("kv_transfer_config: extra:"), "{e}");
    let e = err(
        r#"{"kv_connector":"multi","connectors":[{"kv_connector":"offload"},{"kv_connector":"offload","max_bytes":0}]}"#,
    );
    assert!(
        e.starts_with("kv_transfer_config: connectors[1].max_bytes:"),
        "{e}"
    );
    let e = err(
        r#"{"kv_connector":"multi","connectors":[{"kv_connector":"pdkv","kv_role":"nobody"}]}"#,
    );
    assert!(
        e.starts_with("kv_transfer_config: connectors[0].kv_role:"),
        "{e}"
    );
    let e = err(r#"{"kv_connector":"offload","max_bytes":"lots"}"#);
    assert!(e.starts_with("kv_transfer_config: max_bytes:"), "{e}");
}
