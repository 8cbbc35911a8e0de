//! Shared set-up for the engine tests: a real tiny random checkpoint, loaded
//! by the real loader, served by a real engine.

#![allow(dead_code)]

use std::time::Duration;

use pdkv_engine::{
    EngineConfig, EngineHandle, EngineRequest, EngineStats, FinishReason, KvConnector,
    RequestStream, SamplingParams,
};
use pdkv_model::Arch;

/// Longest any test waits for the engine.
pub const WAIT: Duration = Duration::from_secs(60);

pub use pdkv_testkit::engine::{prompt, Started as TestEngine};

/// Starts an engine on the tiny random checkpoint of `arch` (seed 7).
pub fn start(arch: Arch, config: EngineConfig) -> TestEngine {
    start_with_connector(arch, config, None)
}

/// [`start`] with a KV connector.
pub fn start_with_connector(
    arch: Arch,
    config: EngineConfig,
    connector: Option<Box<dyn KvConnector>>,
) -> TestEngine {
    pdkv_testkit::engine::start(arch, connector, config).expect("start engine")
}

pub fn config(max_num_batched_tokens: usize, num_kv_blocks: usize) -> EngineConfig {
    EngineConfig {
        max_num_seqs: 32,
        max_num_batched_tokens,
        num_kv_blocks,
        enable_prefix_caching: true,
        max_model_len: None,
        ..EngineConfig::default()
    }
}

pub fn greedy(max_tokens: u32) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ignore_eos: true,
        return_logits: true,
        ..SamplingParams::default()
    }
}

pub fn request(id: &str, prompt_tokens: Vec<u32>, params: SamplingParams) -> EngineRequest {
    EngineRequest::new(id, prompt_tokens, params)
}

/// A [`greedy`] request for `max_tokens` on `prompt(seed, len)`.
pub fn greedy_request(id: &str, seed: u64, len: usize, max_tokens: u32) -> EngineRequest {
    request(id, prompt(seed, len), greedy(max_tokens))
}

/// Runs a [`greedy_request`] alone; it must end by its length.
pub fn run_to_length(
    e: &EngineHandle,
    id: &str,
    seed: u64,
    len: usize,
    max_tokens: u32,
) -> Collected {
    let out = run_one(e, greedy_request(id, seed, len, max_tokens));
    assert_eq!(out.finish, Some(FinishReason::Length), "{id}");
    out
}

/// A request as the scheduler takes it (no model behind it).
pub fn new_request(
    id: &str,
    prompt: Vec<u32>,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
) -> pdkv_engine::scheduler::NewRequest {
    pdkv_engine::scheduler::NewRequest {
        cache_salt: None,
        output_tokens: Vec::new(),
        id: id.into(),
        prompt_tokens: prompt,
        max_tokens,
        stop_token_ids,
        kv_transfer_params: None,
        prompt_logits: false,
    }
}

/// Spins (yielding) until `done` holds; panics naming `what` after 30 s.
pub fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let t0 = std::time::Instant::now();
    while !done() {
        assert!(t0.elapsed() < Duration::from_secs(30), "{what}");
        std::thread::yield_now();
    }
}

/// Everything a request produced.
#[derive(Clone, Debug, Default)]
pub struct Collected {
    pub tokens: Vec<u32>,
    pub text: String,
    pub deltas: Vec<String>,
    pub logits: Vec<Vec<f32>>,
    pub finish: Option<FinishReason>,
    pub num_cached_tokens: usize,
    pub num_prompt_tokens: usize,
}

impl Collected {
    /// Logits as bits, for exact comparison.
    pub fn logit_bits(&self) -> Vec<Vec<u32>> {
        self.logits
            .iter()
            .map(|r| r.iter().map(|x| x.to_bits()).collect())
            .collect()
    }
}

/// Two runs of a request gave the same: tokens, finish reason, text and
/// bit-identical logits (one row per token).
pub fn assert_same(what: &str, got: &Collected, want: &Collected) {
    assert_eq!(got.tokens, want.tokens, "{what}: tokens differ");
    assert_eq!(got.finish, want.finish, "{what}: finish differs");
    assert_eq!(
        got.logits.len(),
        got.tokens.len(),
        "{what}: one logits row per token"
    );
    assert!(
        got.logit_bits() == want.logit_bits(),
        "{what}: logits are not bit-identical"
    );
    assert_eq!(got.text, want.text, "{what}: text differs");
}

/// Reads a stream to its end.
pub fn collect(mut s: RequestStream) -> Collected {
    let mut c = Collected::default();
    while let Some(o) = s.blocking_next() {
        assert!(c.finish.is_none(), "output after the final one");
        c.tokens.extend(&o.token_ids);
        c.text.push_str(&o.text);
        c.deltas.push(o.text);
        c.logits.extend(o.logits);
        c.finish = o.finish_reason;
        c.num_cached_tokens = o.num_cached_tokens;
        c.num_prompt_tokens = o.num_prompt_tokens;
    }
    assert!(c.finish.is_some(), "stream ended without a final output");
    c
}

/// Runs one request alone to completion.
pub fn run_one(e: &EngineHandle, req: EngineRequest) -> Collected {
    collect(e.add_request(req).expect("request accepted"))
}

/// Waits until no request is live and every block is free again.
pub fn wait_idle(e: &EngineHandle) -> EngineStats {
    e.wait_stats(WAIT, |s| {
        s.num_running == 0 && s.num_waiting == 0 && s.kv_blocks_free == s.kv_blocks_total
    })
    .unwrap_or_else(|| {
        panic!(
            "engine did not go idle with all blocks free: {:?}",
            e.stats()
        )
    })
}
