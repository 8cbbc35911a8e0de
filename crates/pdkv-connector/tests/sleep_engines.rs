//! The seeds' bug cannot come back: P/D engines that sleep (level 1) and
//! wake keep serving exactly the KV their engines compute — never KV from
//! the pages the KV cache had before the sleep — and a sleeping engine holds
//! (almost) no device memory, also while a shared-memory peer had its KV
//! segment mapped. (The start-up gate for connectors that cannot release is
//! tested in pdkv-engine's `tests/connector.rs`.)
//!
//! Sleep swaps the physical pages under the KV cache's fixed addresses. A
//! transfer registration holds its own reference to the pages it covers (as
//! an RDMA memory region does), so without the connector's release before
//! the unmap and restore after the map, P would send D the stale pre-sleep
//! KV (and D would receive into pages its engine no longer reads), while the
//! old pages stayed allocated. Every round here uses fresh prompts and
//! compares D's greedy tokens and logits bits with a colocated engine's.

use std::time::Duration;

use pdkv_engine::{
    Engine, EngineConfig, EngineHandle, EngineRequest, FinishReason, PauseMode, RequestOutput, SamplingParams,
    SleepLevel,
};
use pdkv_model::Arch;
use pdkv_vmem::{Pool, Tag};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

struct Started {
    handle: EngineHandle,
    _dir: tempfile::TempDir,
}

impl Drop for Started {
    fn drop(&mut self) {
        self.handle.shutdown();
    }
}

fn engine(connector: Option<(&str, &str)>) -> Started {
    let dir = tempfile::tempdir().unwrap();
    pdkv_model::init::write_random_checkpoint(Arch::Llama, "tiny", 7, dir.path()).unwrap();
    let pool = Pool::default();
    let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).unwrap();
    let config = EngineConfig {
        max_num_seqs: 8,
        max_num_batched_tokens: 256,
        num_kv_blocks: 64,
        enable_sleep_mode: connector.is_some(),
        ..EngineConfig::default()
    };
    let c = connector.map(|(cfg, id)| pdkv_connector::build(cfg, id).unwrap());
    let handle = Engine::start_with_connector(model, pool, config, c).unwrap();
    Started { handle, _dir: dir }
}

fn prompt(seed: u64, len: usize) -> Vec<u32> {
    (0..len as u64).map(|i| (pdkv_engine::sampling::splitmix64(seed.wrapping_mul(1_000_003) ^ i) % 500) as u32).collect()
}

fn run(e: &EngineHandle, id: &str, tokens: Vec<u32>, max_tokens: u32, params: Option<serde_json::Value>) -> Vec<RequestOutput> {
    let sp = SamplingParams { temperature: 0.0, max_tokens, ignore_eos: true, return_logits: true, ..SamplingParams::default() };
    let mut s = e
        .add_request(EngineRequest { id: id.into(), prompt_tokens: tokens, params: sp, kv_transfer_params: params })
        .unwrap();
    let mut out = Vec::new();
    while let Some(o) = s.blocking_next() {
        let last = o.finish_reason.is_some();
        out.push(o);
        if last {
            break;
        }
    }
    out
}

type Fingerprint = (Vec<u32>, Vec<Vec<u32>>);

fn fingerprint(outs: &[RequestOutput]) -> Fingerprint {
    let toks = outs.iter().flat_map(|o| o.token_ids.clone()).collect();
    let bits = outs.iter().flat_map(|o| o.logits.iter().map(|r| r.iter().map(|x| x.to_bits()).collect())).collect();
    (toks, bits)
}

/// One P/D request; D's output, or why it failed.
fn pd(p: &EngineHandle, d: &EngineHandle, id: &str, pr: &[u32]) -> Result<Fingerprint, String> {
    let pout = run(p, &format!("{id}-p"), pr.to_vec(), 1, Some(json!({"do_remote_decode": true, "transfer_id": id})));
    let last = pout.last().unwrap();
    if last.finish_reason != Some(FinishReason::Length) {
        return Err(format!("P: {:?} {:?}", last.finish_reason, last.error));
    }
    let params = last.kv_transfer_params.clone().ok_or("P returned no transfer params")?;
    let dout = run(d, &format!("{id}-d"), pr.to_vec(), 5, Some(params));
    let last = dout.last().unwrap();
    if last.finish_reason != Some(FinishReason::Length) {
        return Err(format!("D: {:?} {:?}", last.finish_reason, last.error));
    }
    Ok(fingerprint(&dout))
}

fn idle_and_free(e: &EngineHandle) {
    let ok = e.wait_stats(WAIT, |s| {
        s.num_running == 0 && s.num_waiting == 0 && s.kv_blocks_held == 0 && s.kv_blocks_free == s.kv_blocks_total
    });
    assert!(ok.is_some(), "not idle with all blocks free: {:?}", e.stats());
}

fn sleep_and_wake(engines: &[&EngineHandle]) -> Vec<(u64, u64)> {
    let awake: Vec<u64> = engines.iter().map(|e| e.pool().device_bytes().total()).collect();
    for e in engines {
        e.sleep(SleepLevel::L1, PauseMode::Abort, WAIT).expect("sleep");
    }
    let asleep: Vec<u64> = engines.iter().map(|e| e.pool().device_bytes().total()).collect();
    for e in engines {
        assert_eq!(e.pool().device_bytes().get(Tag::KvCache), 0, "the KV cache's pages must be free while asleep");
        e.wake_up(None).expect("wake");
    }
    awake.into_iter().zip(asleep).collect()
}

fn survives_sleep(transport: &str) {
    let pc = format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_producer","transport":"{transport}"}}"#);
    let dc = format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_consumer","transport":"{transport}"}}"#);
    let p = engine(Some((&pc, "p-sleep")));
    let d = engine(Some((&dc, "d-sleep")));
    let colo = engine(None);
    let rounds: [(&str, Vec<&EngineHandle>); 4] =
        [("awake", vec![]), ("P", vec![&p.handle]), ("D", vec![&d.handle]), ("both", vec![&p.handle, &d.handle])];
    for (r, (name, sleepers)) in rounds.iter().enumerate() {
        for (awake, asleep) in sleep_and_wake(sleepers) {
            assert!(asleep * 50 <= awake, "{transport}/{name}: {asleep} bytes asleep of {awake} awake (over 2%)");
        }
        for i in 0..4u64 {
            let pr = prompt(100 * r as u64 + i, 20 + 9 * i as usize);
            let want = fingerprint(&run(&colo.handle, &format!("c{r}-{i}"), pr.clone(), 5, None));
            let got = pd(&p.handle, &d.handle, &format!("t{r}-{i}"), &pr);
            assert_eq!(got.as_ref(), Ok(&want), "{transport}: after {name} slept and woke, prompt {i}");
        }
        idle_and_free(&p.handle);
        idle_and_free(&d.handle);
    }
    let metric = |e: &EngineHandle, name: &str| e.kv_connector_metrics().into_iter().find(|m| m.0 == name).map(|m| m.2);
    assert_eq!(metric(&d.handle, "loads_ok_total"), Some(16.0));
    assert_eq!(metric(&d.handle, "loads_failed_total"), Some(0.0));
    // Nothing stays pinned: every live chunk belongs to a mapped region.
    assert_eq!(p.handle.pool().pinned_bytes(), 0);
    assert_eq!(d.handle.pool().pinned_bytes(), 0);
}

#[test]
fn pd_outputs_after_sleep_and_wake_equal_colocated_over_tcp() {
    survives_sleep("tcp");
}

#[test]
fn pd_outputs_after_sleep_and_wake_equal_colocated_over_shm() {
    survives_sleep("shm");
}
