//! End to end on real engines: a prefill engine with a producer connector
//! and a decode engine with a consumer connector, on a tiny random model;
//! the decode engine's greedy tokens and logits equal a colocated engine's.

use std::time::Duration;

use pdkv_engine::{Engine, EngineConfig, EngineHandle, EngineRequest, FinishReason, RequestOutput, SamplingParams};
use pdkv_model::Arch;
use pdkv_vmem::Pool;
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
    let config = EngineConfig { max_num_seqs: 8, max_num_batched_tokens: 256, num_kv_blocks: 64, enable_prefix_caching: true, max_model_len: None, ..EngineConfig::default() };
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

fn tokens_and_bits(outs: &[RequestOutput]) -> (Vec<u32>, Vec<Vec<u32>>) {
    let toks = outs.iter().flat_map(|o| o.token_ids.clone()).collect();
    let bits = outs.iter().flat_map(|o| o.logits.iter().map(|r| r.iter().map(|x| x.to_bits()).collect())).collect();
    (toks, bits)
}

fn all_free(e: &EngineHandle) {
    assert!(e.wait_stats(WAIT, |s| s.kv_blocks_free == s.kv_blocks_total).is_some(), "blocks leaked: {:?}", e.stats());
}

fn pd_matches_colocated(transport: &str) {
    let pc = format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_producer","transport":"{transport}"}}"#);
    let dc = format!(r#"{{"kv_connector":"pdkv","kv_role":"kv_consumer","transport":"{transport}"}}"#);
    let p = engine(Some((&pc, "p1")));
    let d = engine(Some((&dc, "d1")));
    let colo = engine(None);
    // Shared prefixes: the second and third prompts start like the first,
    // so D has local prefix hits for them.
    let base = prompt(1, 40);
    let prompts = [base.clone(), [&base[..32], &prompt(2, 9)[..]].concat(), [&base[..16], &prompt(3, 30)[..]].concat(), prompt(4, 5)];
    for (i, pr) in prompts.iter().enumerate() {
        let tid = format!("x{i}");
        let pout = run(&p.handle, &format!("p{i}"), pr.clone(), 1, Some(json!({"do_remote_decode": true, "transfer_id": tid})));
        let last = pout.last().unwrap();
        assert_eq!(last.finish_reason, Some(FinishReason::Length), "{:?}", last.error);
        let kp = last.kv_transfer_params.clone().expect("P returns transfer params");
        let dout = run(&d.handle, &format!("d{i}"), pr.clone(), 6, Some(kp));
        assert_eq!(dout.last().unwrap().finish_reason, Some(FinishReason::Length), "{:?}", dout.last().unwrap().error);
        let cout = run(&colo.handle, &format!("c{i}"), pr.clone(), 6, None);
        assert_eq!(tokens_and_bits(&dout), tokens_and_bits(&cout), "prompt {i} over {transport}");
    }
    all_free(&p.handle);
    all_free(&d.handle);
    // Every prompt longer than its local prefix hit was really loaded: 3
    // loads (the 5-token prompt moves 1 block too), none failed.
    let metric = |e: &EngineHandle, name: &str| e.kv_connector_metrics().into_iter().find(|m| m.0 == name).unwrap().2;
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
    let p = engine(Some((r#"{"kv_connector":"pdkv","kv_role":"kv_producer","arrival_timeout_s":0.2}"#, "p1")));
    let d = engine(Some((r#"{"kv_connector":"pdkv","kv_role":"kv_consumer"}"#, "d1")));
    let dr = engine(Some((r#"{"kv_connector":"pdkv","kv_role":"kv_consumer","kv_load_failure_policy":"recompute"}"#, "d2")));
    let colo = engine(None);
    let boot = p.handle.kv_connector_info().unwrap()["bootstrap_addr"].clone();
    let bogus = json!({"do_remote_prefill": true, "remote_engine_id": "p1", "remote_bootstrap_addr": boot, "transfer_id": "nope"});
    let pr = prompt(9, 33);
    let out = run(&d.handle, "bad", pr.clone(), 3, Some(bogus.clone()));
    let last = out.last().unwrap();
    assert_eq!(last.finish_reason, Some(FinishReason::Error));
    let why = last.error.clone().unwrap_or_default();
    assert!(why.contains("nope") && why.contains("unknown to the prefill engine"), "{why}");
    // Recompute: the same failure, then the tokens equal a colocated run.
    let out = run(&dr.handle, "bad", pr.clone(), 3, Some(bogus));
    assert_eq!(out.last().unwrap().finish_reason, Some(FinishReason::Length), "{:?}", out.last().unwrap().error);
    assert_eq!(tokens_and_bits(&out), tokens_and_bits(&run(&colo.handle, "c", pr.clone(), 3, None)));
    // A good request on D afterwards.
    let pout = run(&p.handle, "p", pr.clone(), 1, Some(json!({"do_remote_decode": true, "transfer_id": "good"})));
    let kp = pout.last().unwrap().kv_transfer_params.clone().unwrap();
    let out = run(&d.handle, "good", pr.clone(), 3, Some(kp));
    assert_eq!(out.last().unwrap().finish_reason, Some(FinishReason::Length));
    for e in [&p.handle, &d.handle, &dr.handle] {
        all_free(e);
    }
}
