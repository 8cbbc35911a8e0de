//! The lifecycle on a real engine: pause modes under load, sleep levels 1
//! and 2 with exact outputs after every wake, selective wake, in-place weight
//! reload, KV-cache release, and the prefix-cache invalidation that makes
//! sleeping safe. Real tiny checkpoints, real loader, real forward pass.
//!
//! The tests in this file run one at a time (a file-wide lock): one of them
//! measures the process's resident memory over 50 sleep cycles.

// Its own binary (it measures its process); the helpers of the engine tests.
#[path = "engine/common/mod.rs"]
mod common;

use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use common::*;
use pdkv_engine::lifecycle::{RELEASE_NEEDS_PAUSE, WEIGHTS_DISCARDED};
use pdkv_engine::{
    AddRequestError, Engine, EngineConfig, EngineHandle, FinishReason, LifecycleError, PauseMode,
    RequestStream, SleepLevel,
};
use pdkv_model::Arch;
use pdkv_vmem::{Pool, Tag};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

/// An engine on a checkpoint directory; shut down on drop.
struct Eng(EngineHandle);

impl std::ops::Deref for Eng {
    type Target = EngineHandle;
    fn deref(&self) -> &EngineHandle {
        &self.0
    }
}

impl Drop for Eng {
    fn drop(&mut self) {
        self.0.shutdown();
    }
}

fn checkpoint(arch: Arch, preset: &str, seed: u64) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("temp dir");
    pdkv_model::init::write_random_checkpoint(arch, preset, seed, dir.path())
        .expect("write checkpoint");
    dir
}

fn start_at(path: &Path, config: EngineConfig) -> Eng {
    let pool = Pool::default();
    let model = pdkv_model::load_model(path, &pool, &mut |_| {}).expect("load checkpoint");
    Eng(Engine::start(model, pool, config).expect("start engine"))
}

/// An engine on a fresh tiny checkpoint of `arch` made with `seed`; the
/// directory must outlive the engine.
fn start_tiny(arch: Arch, seed: u64, config: EngineConfig) -> (tempfile::TempDir, Eng) {
    let dir = checkpoint(arch, "tiny", seed);
    let e = start_at(dir.path(), config);
    (dir, e)
}

const T: Duration = Duration::from_secs(60);

/// Tokens and logit bits of one greedy run.
type Probe = (Vec<u32>, Vec<Vec<u32>>);

/// 30 greedy probes with different prompts, run concurrently.
fn probes(e: &EngineHandle, tag: &str) -> Vec<Probe> {
    let streams: Vec<RequestStream> = (0..30u64)
        .map(|i| {
            let len = 5 + (i as usize * 7) % 41;
            e.add_request(request(
                &format!("{tag}-probe-{i}"),
                prompt(900 + i, len),
                greedy(8),
            ))
            .unwrap_or_else(|err| panic!("probe {i} refused: {err}"))
        })
        .collect();
    streams
        .into_iter()
        .map(|s| {
            let c = collect(s);
            assert_eq!(c.finish, Some(FinishReason::Length));
            let bits = c.logit_bits();
            (c.tokens, bits)
        })
        .collect()
}

fn device_total(e: &EngineHandle) -> u64 {
    e.pool().device_bytes().total()
}

fn weights_base(e: &EngineHandle) -> usize {
    let r = e
        .pool()
        .regions()
        .into_iter()
        .find(|r| r.tag() == Tag::Weights)
        .expect("a weights region");
    r.base() as usize
}

fn refused(e: &EngineHandle, id: &str) -> String {
    match e.add_request(request(id, prompt(5, 10), greedy(4))) {
        Err(AddRequestError::Unavailable(msg)) => msg,
        Err(other) => panic!("expected Unavailable, got {other}"),
        Ok(_) => panic!("request {id} was accepted"),
    }
}

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("read /proc/self/statm");
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .expect("resident field")
        .parse()
        .expect("a number");
    pages * pdkv_vmem::page_size() as u64
}

#[test]
fn sleep_levels_1_and_2_restore_exact_outputs() {
    let _g = serial();
    let (dir, e) = start_tiny(Arch::Llama, 7, config(256, 512));
    let baseline = probes(&e, "base");
    wait_idle(&e);
    let awake = device_total(&e);
    let base_addr = weights_base(&e);
    assert!(awake > 0);

    // Level 1: weights to host, KV discarded.
    e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
    let st = e.lifecycle_status();
    assert_eq!(st.sleeping, Some(SleepLevel::L1));
    assert_eq!(st.asleep_tags, vec![Tag::Weights, Tag::KvCache]);
    let asleep = device_total(&e);
    assert!(
        asleep * 50 <= awake,
        "asleep {asleep} B is over 2% of awake {awake} B"
    );
    assert!(
        e.pool().host_backup_bytes() > 0,
        "level 1 keeps a host copy of the weights"
    );
    assert!(refused(&e, "during-l1").contains("asleep"));
    assert_eq!(e.stats().sleep_level, Some(1));
    e.wake_up(None).unwrap();
    assert_eq!(e.lifecycle_status().sleeping, None);
    assert_eq!(
        e.lifecycle_status().paused,
        None,
        "the sleep's own pause ends with the wake"
    );
    assert_eq!(device_total(&e), awake);
    assert_eq!(
        weights_base(&e),
        base_addr,
        "weights wake at the same address"
    );
    assert_eq!(probes(&e, "l1"), baseline, "outputs after a level-1 wake");

    // Level 2: everything discarded; weights must be reloaded.
    e.sleep(SleepLevel::L2, PauseMode::Abort, T).unwrap();
    let asleep = device_total(&e);
    assert!(
        asleep * 50 <= awake,
        "asleep {asleep} B is over 2% of awake {awake} B"
    );
    assert_eq!(
        e.pool().host_backup_bytes(),
        0,
        "level 2 keeps no host copy"
    );
    e.wake_up(None).unwrap();
    let st = e.lifecycle_status();
    assert!(st.weights_discarded && st.sleeping.is_none());
    assert_eq!(refused(&e, "after-l2-wake"), WEIGHTS_DISCARDED);
    e.update_weights(dir.path(), Some("reloaded".into()))
        .unwrap();
    assert!(!e.lifecycle_status().weights_discarded);
    assert_eq!(e.weight_info().version.as_deref(), Some("reloaded"));
    assert_eq!(weights_base(&e), base_addr, "the reload writes in place");
    assert_eq!(
        probes(&e, "l2"),
        baseline,
        "outputs after a level-2 wake and reload"
    );
    let s = wait_idle(&e);
    assert!(
        s.lifecycle.num_sleeps >= 2
            && s.lifecycle.num_wakes >= 2
            && s.lifecycle.last_sleep_seconds > 0.0
            && s.lifecycle.last_wake_seconds > 0.0
    );
    println!(
        "device bytes awake {awake}, asleep {asleep}; last sleep {:.6} s, last wake {:.6} s, reload {:.6} s",
        s.lifecycle.last_sleep_seconds, s.lifecycle.last_wake_seconds, s.lifecycle.last_weight_update_seconds
    );
}

#[test]
fn fifty_level_1_cycles_keep_memory_flat() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, config(256, 512));
    let reference = run_one(&e, request("ref", prompt(31, 40), greedy(8)));
    wait_idle(&e);
    let awake = device_total(&e);
    let mut rss_first = None;
    for cycle in 0..50 {
        e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
        assert!(
            device_total(&e) * 50 <= awake,
            "cycle {cycle}: memory not released"
        );
        e.wake_up(None).unwrap();
        let c = run_one(&e, request(&format!("c{cycle}"), prompt(31, 40), greedy(8)));
        assert_eq!(c.tokens, reference.tokens, "cycle {cycle}");
        assert_eq!(c.logit_bits(), reference.logit_bits(), "cycle {cycle}");
        wait_idle(&e);
        assert_eq!(
            device_total(&e),
            awake,
            "cycle {cycle}: device bytes awake changed"
        );
        let rss = rss_bytes();
        let first = *rss_first.get_or_insert(rss);
        assert!(
            rss.abs_diff(first) * 20 <= first,
            "cycle {cycle}: RSS {rss} B drifted more than 5% from cycle 1 ({first} B)"
        );
        if cycle == 49 {
            println!("RSS cycle 1 {first} B, cycle 50 {rss} B; device bytes awake {awake} B");
        }
    }
}

#[test]
fn selective_wake_in_both_orders() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Qwen3, 3, config(256, 512));
    let baseline = probes(&e, "base");
    for (n, order) in [[Tag::Weights, Tag::KvCache], [Tag::KvCache, Tag::Weights]]
        .iter()
        .enumerate()
    {
        e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
        e.wake_up(Some(&order[..1])).unwrap();
        let st = e.lifecycle_status();
        assert_eq!(st.asleep_tags, vec![order[1]], "order {n}");
        assert!(e.pool().is_awake(order[0]) && !e.pool().is_awake(order[1]));
        refused(&e, &format!("half-awake-{n}"));
        e.wake_up(Some(&order[1..])).unwrap();
        assert_eq!(e.lifecycle_status().sleeping, None);
        assert_eq!(probes(&e, &format!("woke-{n}")), baseline, "order {n}");
    }
}

/// 32 concurrent long requests; returns once each has produced a token.
fn load(e: &EngineHandle, tag: &str, max_tokens: u32) -> Vec<(RequestStream, Collected)> {
    let mut out: Vec<(RequestStream, Collected)> = (0..32u64)
        .map(|i| {
            let s = e.add_request(request(
                &format!("{tag}-{i}"),
                prompt(300 + i, 8 + i as usize % 9),
                greedy(max_tokens),
            ));
            (s.expect("accepted"), Collected::default())
        })
        .collect();
    for (s, c) in &mut out {
        let o = s.blocking_next().expect("a first output");
        assert!(
            o.finish_reason.is_none(),
            "request ended before the test could pause it"
        );
        c.tokens.extend(o.token_ids);
        c.logits.extend(o.logits);
    }
    out
}

fn finish(mut s: RequestStream, mut c: Collected) -> Collected {
    while let Some(o) = s.blocking_next() {
        c.tokens.extend(&o.token_ids);
        c.logits.extend(o.logits);
        c.finish = o.finish_reason;
    }
    c
}

/// [`load`], each request then run to its end.
fn load_to_end(e: &EngineHandle, tag: &str, max_tokens: u32) -> Vec<Collected> {
    load(e, tag, max_tokens)
        .into_iter()
        .map(|(s, c)| finish(s, c))
        .collect()
}

/// Each of `running` ends by its length exactly as its `reference` did:
/// the same tokens and the same logits.
fn assert_finish_as(running: Vec<(RequestStream, Collected)>, reference: &[Collected]) {
    for (i, ((s, c), want)) in running.into_iter().zip(reference).enumerate() {
        let c = finish(s, c);
        assert_eq!(c.finish, Some(FinishReason::Length), "request {i}");
        assert_eq!(c.tokens, want.tokens, "request {i}");
        assert_eq!(c.logit_bits(), want.logit_bits(), "request {i}");
    }
}

fn load_config() -> EngineConfig {
    config(256, 2100)
}

#[test]
fn pause_abort_under_load_aborts_everything() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, load_config());
    let running = load(&e, "a", 1000);
    e.pause(PauseMode::Abort, true, T).unwrap();
    assert_eq!(e.lifecycle_status().paused, Some(PauseMode::Abort));
    for (s, c) in running {
        let c = finish(s, c);
        assert_eq!(c.finish, Some(FinishReason::Abort));
        assert!(c.tokens.len() < 1000);
    }
    let s = wait_idle(&e);
    assert_eq!(s.kv_blocks_free, s.kv_blocks_total);
    assert!(refused(&e, "during-abort-pause").contains("paused"));
    e.resume().unwrap();
    assert_eq!(e.lifecycle_status().paused, None);
    assert_eq!(
        run_one(&e, request("after", prompt(1, 10), greedy(4))).finish,
        Some(FinishReason::Length)
    );
}

#[test]
fn pause_wait_under_load_finishes_everything_and_refuses_new_requests() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, load_config());
    let reference = load_to_end(&e, "ref", 60);
    wait_idle(&e);

    let running = load(&e, "w", 60);
    let pauser = {
        let h = e.0.clone();
        std::thread::spawn(move || h.pause(PauseMode::Wait, false, T))
    };
    // While the pause waits, new requests are refused.
    e.wait_stats(T, |s| s.paused)
        .expect("the pause is published");
    assert!(refused(&e, "while-waiting").contains("paused (mode wait)"));
    let results: Vec<Collected> = running.into_iter().map(|(s, c)| finish(s, c)).collect();
    pauser.join().unwrap().expect("the wait pause completes");
    for (i, (r, want)) in results.iter().zip(&reference).enumerate() {
        assert_eq!(r.finish, Some(FinishReason::Length), "request {i}");
        assert_eq!(
            r.tokens, want.tokens,
            "request {i} runs to its end unchanged"
        );
    }
    assert!(refused(&e, "after-wait").contains("paused"));
    e.resume().unwrap();

    // A wait that cannot finish in time reports it; the pause stays.
    let running = load(&e, "slow", 1000);
    let err = e
        .pause(PauseMode::Wait, false, Duration::from_millis(50))
        .unwrap_err();
    assert!(matches!(err, LifecycleError::Timeout(_)), "{err}");
    assert_eq!(e.lifecycle_status().paused, Some(PauseMode::Wait));
    e.pause(PauseMode::Abort, false, T).unwrap();
    for (s, c) in running {
        assert_eq!(finish(s, c).finish, Some(FinishReason::Abort));
    }
    e.resume().unwrap();
    wait_idle(&e);
}

#[test]
fn pause_keep_freezes_requests_which_continue_exactly_after_resume() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Qwen3, 5, load_config());
    let reference = load_to_end(&e, "ref", 80);
    let late_ref = run_one(&e, request("late-ref", prompt(77, 20), greedy(10)));
    wait_idle(&e);

    let running = load(&e, "k", 80);
    e.pause(PauseMode::Keep, true, T).unwrap();
    let frozen = e.stats();
    assert!(
        frozen.num_running > 0 && frozen.kv_blocks_free < frozen.kv_blocks_total,
        "frozen requests keep their KV"
    );
    // Added during keep: accepted and queued.
    let late = e
        .add_request(request("late", prompt(77, 20), greedy(10)))
        .expect("keep queues new requests");
    assert!(
        e.wait_stats(Duration::from_millis(300), |s| s.steps > frozen.steps)
            .is_none(),
        "a step ran during a keep pause"
    );
    e.resume().unwrap();
    assert_finish_as(running, &reference);
    let late = collect(late);
    assert_eq!(late.tokens, late_ref.tokens);
    wait_idle(&e);
}

#[test]
fn sleep_with_keep_recomputes_frozen_requests_after_wake() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, load_config());
    let reference = load_to_end(&e, "ref", 60);
    wait_idle(&e);

    let running = load(&e, "k", 60);
    e.sleep(SleepLevel::L1, PauseMode::Keep, T).unwrap();
    let s = e.stats();
    assert_eq!(
        s.kv_blocks_free, s.kv_blocks_total,
        "sleep frees every block, frozen requests included"
    );
    assert_eq!(s.num_running, 0);
    assert!(s.num_waiting > 0, "frozen requests wait to recompute");
    e.wake_up(None).unwrap();
    assert_finish_as(running, &reference);
    wait_idle(&e);
}

#[test]
fn update_weights_in_place_and_refuse_incompatible_checkpoints() {
    let _g = serial();
    let seed1 = checkpoint(Arch::Llama, "tiny", 1);
    let seed2 = checkpoint(Arch::Llama, "tiny", 2);
    let want2 = {
        let fresh = start_at(seed2.path(), config(256, 512));
        probes(&fresh, "fresh2")
    };
    let e = start_at(seed1.path(), config(256, 512));
    let before = probes(&e, "s1");
    assert_ne!(before, want2, "the two checkpoints differ");
    assert_eq!(e.weight_info().version, None);
    assert_eq!(e.weight_info().path, seed1.path());
    let addr = weights_base(&e);
    let bytes = e.pool().device_bytes().get(Tag::Weights);

    // Not while requests run.
    let busy = e
        .add_request(request("busy", prompt(2, 10), greedy(1000)))
        .unwrap();
    let err = e
        .update_weights(seed2.path(), Some("v2".into()))
        .unwrap_err();
    assert!(matches!(err, LifecycleError::Conflict(_)), "{err}");
    drop(busy);
    wait_idle(&e);

    e.update_weights(seed2.path(), Some("v2".into())).unwrap();
    let info = e.weight_info();
    assert_eq!(info.version.as_deref(), Some("v2"));
    assert_eq!(info.path, seed2.path());
    assert_eq!(weights_base(&e), addr, "same addresses");
    assert_eq!(
        e.pool().device_bytes().get(Tag::Weights),
        bytes,
        "no second copy"
    );
    assert_eq!(
        probes(&e, "s2"),
        want2,
        "serves exactly what a fresh engine on seed 2 serves"
    );

    // Another architecture, another size, a tensor of the wrong shape, a
    // missing path: refused, and the weights keep serving unchanged.
    let qwen = checkpoint(Arch::Qwen3, "tiny", 2);
    let small = checkpoint(Arch::Llama, "small", 2);
    let bad_tensor = tempfile::tempdir().unwrap();
    write_with_bad_tensor(
        seed1.path(),
        bad_tensor.path(),
        "model.layers.1.mlp.up_proj.weight",
    );
    for (path, needle) in [
        (qwen.path(), "arch"),
        (small.path(), "hidden_size"),
        (bad_tensor.path(), "model.layers.1.mlp.up_proj.weight"),
    ] {
        match e.update_weights(path, Some("bad".into())) {
            Err(LifecycleError::IncompatibleWeights(msg)) => assert!(msg.contains(needle), "{msg}"),
            other => panic!("expected IncompatibleWeights for {needle}, got {other:?}"),
        }
        assert_eq!(e.weight_info(), info);
        assert_eq!(
            probes(&e, &format!("after-{needle}")),
            want2,
            "old weights untouched after {needle}"
        );
    }
    let err = e
        .update_weights(&seed1.path().join("missing"), None)
        .unwrap_err();
    assert!(matches!(err, LifecycleError::Invalid(_)), "{err}");

    // Asleep weights cannot be written.
    e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
    let err = e.update_weights(seed1.path(), None).unwrap_err();
    assert!(
        matches!(&err, LifecycleError::Conflict(m) if m.contains("wake weights first")),
        "{err}"
    );
    e.wake_up(None).unwrap();
    assert_eq!(probes(&e, "woke"), want2);
}

/// Copies the checkpoint at `from` to `to` with the tensor `name` one row
/// short (every earlier tensor intact).
fn write_with_bad_tensor(from: &Path, to: &Path, name: &str) {
    pdkv_testkit::models::copy_side_files(from, to);
    let st =
        pdkv_model::safetensors::SafetensorsFile::open(&from.join("model.safetensors")).unwrap();
    let mut tensors = Vec::new();
    for (n, entry) in &st.tensors {
        let mut data = vec![0f32; entry.shape.iter().product()];
        st.read_f32(n, &mut data).unwrap();
        let mut shape = entry.shape.clone();
        if n == name {
            shape[0] -= 1;
            data.truncate(shape.iter().product());
        }
        tensors.push((n.clone(), shape, data));
    }
    pdkv_model::safetensors::write_f32(&to.join("model.safetensors"), &tensors).unwrap();
}

#[test]
fn release_kv_needs_a_pause_and_wake_when_awake_changes_nothing() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, config(256, 512));
    let baseline = probes(&e, "base");
    wait_idle(&e);
    let awake = e.pool().device_bytes();

    // Waking an awake engine is fine and changes nothing.
    let status = e.lifecycle_status();
    e.wake_up(None).unwrap();
    e.wake_up(Some(&[Tag::KvCache])).unwrap();
    assert_eq!(e.lifecycle_status(), status);
    assert_eq!(e.pool().device_bytes(), awake);
    assert_eq!(e.stats().lifecycle.num_wakes, 0);

    match e.release_kv_cache_memory() {
        Err(LifecycleError::Conflict(m)) => assert_eq!(m, RELEASE_NEEDS_PAUSE),
        other => panic!("expected Conflict, got {other:?}"),
    }
    // Resume without a pause is a no-op.
    e.resume().unwrap();

    // Released under a keep pause: requests queue; resume maps the KV again.
    e.pause(PauseMode::Keep, false, T).unwrap();
    e.release_kv_cache_memory().unwrap();
    assert_eq!(e.pool().device_bytes().get(Tag::KvCache), 0);
    assert_eq!(e.lifecycle_status().asleep_tags, vec![Tag::KvCache]);
    let queued = e
        .add_request(request("queued", prompt(903, 26), greedy(8)))
        .expect("keep queues");
    e.resume().unwrap();
    assert_eq!(e.pool().device_bytes(), awake);
    let c = collect(queued);
    assert_eq!((c.tokens.clone(), c.logit_bits()), baseline[3]);

    // Sleeping twice is fine.
    e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
    e.sleep(SleepLevel::L1, PauseMode::Abort, T).unwrap();
    e.wake_up(None).unwrap();
    assert_eq!(probes(&e, "after"), baseline);
}

#[test]
fn abort_requests_and_reset_prefix_cache_with_running_requests() {
    let _g = serial();
    let (_dir, e) = start_tiny(Arch::Llama, 7, config(256, 512));
    let reference = run_one(&e, request("ref", prompt(8, 40), greedy(200)));
    wait_idle(&e);
    let a = e
        .add_request(request("a", prompt(1, 10), greedy(1000)))
        .unwrap();
    let b = e
        .add_request(request("b", prompt(8, 40), greedy(200)))
        .unwrap();
    e.wait_stats(T, |s| s.num_running == 2).expect("both run");
    assert!(!e.reset_prefix_cache_with(false, false), "blocks in use");
    let preempting = e.reset_prefix_cache_with(true, false);
    assert!(preempting, "running requests are preempted first");
    let found = e.abort_requests(&["a".to_string(), "nope".to_string()]);
    assert_eq!(found, vec!["a".to_string()]);
    assert_eq!(collect(a).finish, Some(FinishReason::Abort));
    let b = collect(b);
    assert_eq!(
        b.tokens, reference.tokens,
        "a preempted request continues exactly"
    );
    wait_idle(&e);
}

/// Sleep must invalidate the prefix cache: KV discarded by a sleep comes
/// back zeroed, and a request that reused it would compute garbage.
#[test]
fn sleep_invalidates_the_prefix_cache() {
    let _g = serial();
    let (dir, e) = start_tiny(Arch::Llama, 7, config(256, 512));
    let shared = prompt(4242, 48);
    let mut second = shared.clone();
    second.extend(prompt(17, 9));
    // The reference: `second` computed from scratch.
    let want = run_one(&e, request("want", second.clone(), greedy(8)));
    assert_eq!(want.num_cached_tokens, 0);
    assert!(e.reset_prefix_cache());

    // Cache the shared prefix, check that it is reused while awake.
    run_one(&e, request("first", shared.clone(), greedy(4)));
    let hit = run_one(&e, request("hit", second.clone(), greedy(8)));
    assert_eq!(
        hit.num_cached_tokens, 48,
        "the prefix cache serves the shared blocks"
    );
    assert_eq!(hit.tokens, want.tokens);

    for (level, name) in [(SleepLevel::L1, "l1"), (SleepLevel::L2, "l2")] {
        run_one(
            &e,
            request(&format!("warm-{name}"), shared.clone(), greedy(4)),
        );
        e.sleep(level, PauseMode::Abort, T).unwrap();
        e.wake_up(None).unwrap();
        if level == SleepLevel::L2 {
            e.update_weights(dir.path(), None).unwrap();
        }
        let after = run_one(
            &e,
            request(&format!("after-{name}"), second.clone(), greedy(8)),
        );
        assert_eq!(
            after.num_cached_tokens, 0,
            "{name}: no prefix-cache hit on zeroed KV"
        );
        assert_eq!(after.tokens, want.tokens, "{name}");
        assert_eq!(after.logit_bits(), want.logit_bits(), "{name}");
    }

    // The same for release_kv_cache_memory.
    run_one(&e, request("warm-release", shared.clone(), greedy(4)));
    e.pause(PauseMode::Abort, false, T).unwrap();
    e.release_kv_cache_memory().unwrap();
    e.resume().unwrap();
    let after = run_one(&e, request("after-release", second, greedy(8)));
    assert_eq!(after.num_cached_tokens, 0);
    assert_eq!(after.logit_bits(), want.logit_bits());
}
