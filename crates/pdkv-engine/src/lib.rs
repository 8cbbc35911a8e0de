//! The engine: requests, a sans-IO scheduler (continuous batching, block
//! pool, prefix cache, preemption), sampling, stops, and the engine core loop
//! that runs on its own thread.
//!
//! Public API contract (used by `pdkv-server` and the `pdkv` binary):
//! - [`Engine::start`] takes a loaded model and an [`EngineConfig`], allocates
//!   the KV cache and the runtime workspace in the given pool, and starts the
//!   engine core thread.
//! - [`EngineHandle::add_request`] validates and enqueues a request and
//!   returns a [`RequestStream`] of [`RequestOutput`]s. Dropping the stream
//!   before it finished aborts the request (a client that disconnects).
//! - [`EngineHandle::abort`] aborts by id; [`EngineHandle::stats`] snapshots
//!   counters for metrics.

use std::sync::Arc;

use pdkv_model::{LoadedModel, Tokenizer};

use pdkv_vmem::Pool;

/// Engine limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most sequences scheduled in one step.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (chunked prefill splits longer prompts).
    pub max_num_batched_tokens: usize,
    /// KV blocks of `pdkv_model::BLOCK_SIZE` tokens.
    pub num_kv_blocks: usize,
    pub enable_prefix_caching: bool,
    /// Longest prompt + output, in tokens (defaults to the model's context).
    pub max_model_len: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            num_kv_blocks: 512,
            enable_prefix_caching: true,
            max_model_len: None,
        }
    }
}

/// How to pick tokens and when to stop.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 means greedy.
    pub temperature: f32,
    /// 1.0 means off.
    pub top_p: f32,
    /// 0 means off.
    pub top_k: u32,
    /// Per-request seed: the same seed gives the same tokens.
    pub seed: Option<u64>,
    pub max_tokens: u32,
    /// Stop strings; the output is cut before the matched string.
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Return the logits row each token was sampled from (tests, tools).
    pub return_logits: bool,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            return_logits: false,
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub id: String,
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
    /// Aborted (by id, by a client disconnect, or at shutdown).
    Abort,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
        }
    }
}

/// What one engine step produced for one request.
#[derive(Clone, Debug)]
pub struct RequestOutput {
    pub request_id: String,
    /// Tokens generated in this step (usually one; empty on abort).
    pub token_ids: Vec<u32>,
    /// Text newly decoded since the previous output (stop strings cut out).
    pub text: String,
    /// Set on the last output of the request.
    pub finish_reason: Option<FinishReason>,
    pub num_prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub num_cached_tokens: usize,
    /// One logits row per token in `token_ids` when `return_logits` was set.
    pub logits: Vec<Vec<f32>>,
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddRequestError {
    #[error("prompt has {prompt} tokens plus max_tokens {max_tokens}, over the model's context of {max_model_len} tokens")]
    TooLong { prompt: usize, max_tokens: usize, max_model_len: usize },
    #[error("prompt needs {needed} KV blocks, more than the {total} the cache holds")]
    ExceedsKvCapacity { needed: usize, total: usize },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("request id {0} is already in use")]
    DuplicateId(String),
    #[error("the engine has stopped")]
    Stopped,
}

/// Counters for metrics, a snapshot.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Prompt tokens looked up in the prefix cache / found there, cumulative.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub steps: u64,
}

/// Starts engines.
pub struct Engine;

impl Engine {
    /// Allocates the KV cache (`num_kv_blocks` blocks) and workspace in `pool`
    /// and starts the engine core thread.
    pub fn start(_model: LoadedModel, _pool: Pool, _config: EngineConfig) -> anyhow::Result<EngineHandle> {
        todo!()
    }
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    _private: Arc<()>,
}

impl EngineHandle {
    /// Validates and enqueues a request.
    pub fn add_request(&self, _req: EngineRequest) -> Result<RequestStream, AddRequestError> {
        todo!()
    }

    /// Aborts a request by id; unknown or finished ids are ignored (returns false).
    pub fn abort(&self, _request_id: &str) -> bool {
        todo!()
    }

    pub fn stats(&self) -> EngineStats {
        todo!()
    }

    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        todo!()
    }

    pub fn config(&self) -> &EngineConfig {
        todo!()
    }

    /// The model's short name (for `/v1/models`).
    pub fn model_name(&self) -> &str {
        todo!()
    }

    pub fn chat_template(&self) -> Option<&pdkv_model::ChatTemplate> {
        todo!()
    }

    pub fn model_config(&self) -> &pdkv_model::ModelConfig {
        todo!()
    }

    /// The memory pool holding weights, KV cache and runtime scratch.
    pub fn pool(&self) -> &Pool {
        todo!()
    }

    /// The model's context length as the engine enforces it.
    pub fn max_model_len(&self) -> usize {
        todo!()
    }

    /// Stops the engine thread: running requests end with `Abort`. Waits for
    /// the thread to exit.
    pub fn shutdown(&self) {
        todo!()
    }
}

/// The outputs of one request. Dropping it before the final output aborts
/// the request.
pub struct RequestStream {
    _private: (),
}

impl RequestStream {
    pub fn request_id(&self) -> &str {
        todo!()
    }

    /// The next output; `None` after the final one.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        todo!()
    }

    /// Blocking variant for threads outside an async runtime.
    pub fn blocking_next(&mut self) -> Option<RequestOutput> {
        todo!()
    }
}
