//! The engine: requests, a sans-IO scheduler (continuous batching, block
//! pool, prefix cache, preemption), sampling, stops, and the engine core: a
//! stepper ([`EngineCore`]) with the model behind [`ModelRunner`] and time
//! from [`Clock`], which a thread drives in production and a simulator can
//! drive itself.
//!
//! Public API contract (used by `pdkv-server` and the `pdkv` binary):
//! - [`Engine::start`] takes a loaded model and an [`EngineConfig`], allocates
//!   the KV cache and the runtime workspace in the given pool, and starts the
//!   engine core thread.
//! - [`EngineHandle::add_request`] validates and enqueues a request and
//!   returns a [`RequestStream`] of [`RequestOutput`]s. Dropping the stream
//!   before it finished aborts the request (a client that disconnects).
//! - [`EngineHandle::abort`] aborts by id; [`EngineHandle::stats`] snapshots
//!   counters for metrics (lifecycle flags and sleep/wake durations included).
//! - Lifecycle ([`lifecycle`]): `pause`/`resume`, `sleep`/`wake_up`,
//!   `release_kv_cache_memory`, `reset_prefix_cache_with`, `abort_requests`,
//!   `update_weights` (in place), `weight_info`, `lifecycle_status`. Each one
//!   runs on the core thread between steps and blocks the caller (bounded)
//!   until the core applied it; requests refused meanwhile get
//!   [`AddRequestError::Unavailable`].
//! - [`EngineCore::new`] builds the stepper from any [`ModelRunner`],
//!   [`Clock`] and [`Publisher`]; a driver applies [`Command`]s to it and
//!   ticks it, single-threaded (see [`EngineCore`] for the contract).

pub mod block_pool;
pub mod clock;
pub mod connector;
pub mod constraint;
mod core;
pub mod detok;
pub mod lifecycle;
pub mod model;
pub mod sampling;
pub mod scheduler;

pub use crate::core::{
    AddRequest, Command, CoreParts, Engine, EngineCore, EngineHandle, LifecycleReply,
    LifecycleUpdate, NoPublisher, OutputSink, Publisher, Reply, RequestStream,
};
pub use block_pool::{BlockHash, BlockPool};
pub use clock::{Clock, SystemClock};
pub use connector::{KvConnector, KvTransferParams, LoadError, LoadFailurePolicy};
pub use constraint::{ConstraintError, Grammar, GrammarRef, StructuredStats, TokenConstraint};
pub use lifecycle::{LifecycleError, LifecycleStatus, PauseMode, SleepLevel, WeightInfo};
pub use model::{CpuModelRunner, ModelRunner, WeightSource};
pub use scheduler::{ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput, SpeculativeConfig};

/// Engine limits.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Most sequences scheduled in one step.
    pub max_num_seqs: usize,
    /// Most tokens computed in one step (chunked prefill splits longer prompts).
    pub max_num_batched_tokens: usize,
    /// KV blocks of `pdkv_model::BLOCK_SIZE` tokens.
    pub num_kv_blocks: usize,
    /// The KV cache's element type (`f16`: half the bytes a token).
    pub kv_cache_dtype: pdkv_model::KvDtype,
    pub enable_prefix_caching: bool,
    /// Longest prompt + output, in tokens (defaults to the model's context).
    pub max_model_len: Option<usize>,
    /// Allows sleep and KV release with a KV connector (the connector must
    /// support it; checked at start). Engines without a connector always
    /// allow them.
    pub enable_sleep_mode: bool,
    /// Bound on releasing KV held by transfers before a cache reset, and on
    /// the connector's release of its registrations.
    pub kv_release_timeout: std::time::Duration,
    /// Ranks the model is split over (`pdkv_model::tp`), each with its own
    /// pool; 1 runs it whole.
    pub tensor_parallel_size: usize,
    /// Speculative decoding by n-gram lookup (`None`: off).
    pub speculative: Option<SpeculativeConfig>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            max_num_seqs: 32,
            max_num_batched_tokens: 512,
            num_kv_blocks: 512,
            kv_cache_dtype: pdkv_model::KvDtype::F32,
            enable_prefix_caching: true,
            max_model_len: None,
            enable_sleep_mode: false,
            kv_release_timeout: std::time::Duration::from_secs(5),
            tensor_parallel_size: 1,
            speculative: None,
        }
    }
}

/// What speculative decoding proposed and kept, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecStats {
    /// Seqs that carried drafts.
    pub num_drafts: u64,
    pub num_draft_tokens: u64,
    /// Draft tokens the sampler confirmed.
    pub num_accepted_tokens: u64,
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
    /// In [0, 1]; 0 is off. A token less likely than `min_p` times the most
    /// likely token (after temperature) is never sampled.
    pub min_p: f32,
    /// Only these tokens may be sampled (`None`: any).
    pub allowed_token_ids: Option<Vec<u32>>,
    /// A matched stop string stays in the text (it is cut after it).
    pub include_stop_str_in_output: bool,
    /// Special tokens are left out of the text (the default).
    pub skip_special_tokens: bool,
    /// Per-request seed: the same seed gives the same tokens.
    pub seed: Option<u64>,
    pub max_tokens: u32,
    /// Stop strings; the output is cut before the matched string.
    pub stop: Vec<String>,
    pub stop_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// EOS and `stop_token_ids` cannot be sampled before this many output
    /// tokens exist, and stop strings do not match before then.
    pub min_tokens: u32,
    /// 1.0 is off; must be > 0 (see [`sampling::LogitsAdjust`]).
    pub repetition_penalty: f32,
    /// In [-2, 2]; 0 is off.
    pub presence_penalty: f32,
    /// In [-2, 2]; 0 is off.
    pub frequency_penalty: f32,
    /// `(token id, bias in [-100, 100])`, added to the logit before sampling.
    pub logit_bias: Vec<(u32, f32)>,
    /// Return the raw logits row each token was sampled from (tests, tools).
    pub return_logits: bool,
    /// Report each output token's log-probability plus this many most likely
    /// tokens' ([`RequestOutput::logprobs`]); at most [`MAX_LOGPROBS`].
    pub logprobs: Option<u32>,
    /// Report each prompt token's log-probability given the tokens before it
    /// plus this many most likely tokens' ([`RequestOutput::prompt_logprobs`]).
    /// Such a request computes its whole prompt (no prefix-cache hit) and
    /// cannot take external KV.
    pub prompt_logprobs: Option<u32>,
    /// Only outputs this grammar allows (structured outputs); the
    /// log-probabilities reported are of the constrained distribution.
    pub constraint: Option<GrammarRef>,
}

/// The most top log-probabilities a request may ask for per position.
pub const MAX_LOGPROBS: u32 = 20;

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            allowed_token_ids: None,
            include_stop_str_in_output: false,
            skip_special_tokens: true,
            seed: None,
            max_tokens: 16,
            stop: Vec::new(),
            stop_token_ids: Vec::new(),
            ignore_eos: false,
            min_tokens: 0,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            return_logits: false,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }
}

#[derive(Clone, Debug)]
pub struct EngineRequest {
    pub id: String,
    pub prompt_tokens: Vec<u32>,
    pub params: SamplingParams,
    /// Handed to the KV connector as is (P/D: `do_remote_decode`,
    /// `do_remote_prefill`, the remote engine and transfer id).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// Requests of different salts share no prefix-cache entry (vLLM's
    /// `cache_salt`); `None` shares with every unsalted request.
    pub cache_salt: Option<String>,
    /// Output tokens the request already produced elsewhere (an engine that
    /// died mid-stream): they count as its first outputs (`max_tokens`,
    /// `min_tokens`, penalties, the seeded sampler's step), their KV is
    /// computed with the prompt's, their text is not sent again (a stop
    /// string's held-back prefix is held again), and sampling continues
    /// after them. Empty for a new request.
    pub resume_token_ids: Vec<u32>,
}

impl EngineRequest {
    /// A new request (unsalted, for no KV connector, nothing produced yet).
    pub fn new(id: impl Into<String>, prompt_tokens: Vec<u32>, params: SamplingParams) -> Self {
        EngineRequest {
            id: id.into(),
            prompt_tokens,
            params,
            kv_transfer_params: None,
            cache_salt: None,
            resume_token_ids: Vec::new(),
        }
    }

    /// The request with `params` for the KV connector.
    pub fn with_kv_transfer_params(mut self, params: Option<KvTransferParams>) -> Self {
        self.kv_transfer_params = params;
        self
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS, a stop token id or a stop string.
    Stop,
    /// max_tokens reached.
    Length,
    /// Aborted (by id, by a client disconnect, or at shutdown).
    Abort,
    /// Failed: the request's external KV could not be loaded (the
    /// output's `error` says why).
    Error,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
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
    /// One entry per token in `token_ids` when `logprobs` was set (from the
    /// raw logits, before temperature, penalties and bias).
    pub logprobs: Vec<sampling::TokenLogprobs>,
    /// With `prompt_logprobs`, on the output carrying the first token: one
    /// entry per prompt token, `None` for the first (nothing precedes it).
    pub prompt_logprobs: Option<Vec<Option<sampling::TokenLogprobs>>>,
    /// On the last output: what the KV connector returns for the request
    /// (a prefill engine's transfer handle for the decode engine).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// On a last output with [`FinishReason::Error`]: why.
    pub error: Option<String>,
    /// With `error`: the failure was a deadline passing (the message names
    /// the setting), which HTTP answers with 504 rather than 500.
    pub timed_out: bool,
}

impl RequestOutput {
    /// An output of request `request_id` (of `num_prompt_tokens` prompt
    /// tokens) carrying nothing yet: no tokens, text, finish or extras.
    pub fn empty(request_id: String, num_prompt_tokens: usize) -> RequestOutput {
        RequestOutput {
            request_id,
            token_ids: Vec::new(),
            text: String::new(),
            finish_reason: None,
            num_prompt_tokens,
            num_cached_tokens: 0,
            logits: Vec::new(),
            logprobs: Vec::new(),
            prompt_logprobs: None,
            kv_transfer_params: None,
            error: None,
            timed_out: false,
        }
    }
}

/// Why a request was refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum AddRequestError {
    #[error(
        "prompt has {prompt} tokens plus max_tokens {max_tokens}, over the model's context of {max_model_len} tokens"
    )]
    TooLong {
        prompt: usize,
        max_tokens: usize,
        max_model_len: usize,
    },
    /// `needed` counts the blocks of the prompt plus `max_tokens - 1` outputs
    /// (the request at its longest must fit the cache alone).
    #[error("the request needs {needed} KV blocks at its longest (prompt plus max_tokens), more than the {total} the cache holds")]
    ExceedsKvCapacity { needed: usize, total: usize },
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("request id {0} is already in use")]
    DuplicateId(String),
    #[error("the engine has stopped")]
    Stopped,
    /// Paused (abort/wait) or asleep, or weights were discarded and not
    /// reloaded yet: retry later (HTTP 503).
    #[error("the engine is not serving now: {0}")]
    Unavailable(String),
}

/// Counters for metrics, a snapshot.
#[derive(Clone, Debug, Default)]
pub struct EngineStats {
    pub num_running: usize,
    pub num_waiting: usize,
    pub kv_blocks_total: usize,
    pub kv_blocks_free: usize,
    /// Blocks of finished requests held for KV transfers.
    pub kv_blocks_held: usize,
    /// Requests whose external KV is loading (counted in `num_waiting`).
    pub num_waiting_for_remote_kv: usize,
    /// Prompt tokens looked up in the prefix cache / found there, cumulative.
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    pub steps: u64,
    /// Speculative decoding's drafts and the tokens of them kept.
    pub spec: SpecStats,
    /// Constrained decoding: masks, their time, requests.
    pub structured: StructuredStats,
    /// Scheduling is paused (by a pause or a sleep).
    pub paused: bool,
    /// The sleep level while asleep.
    pub sleep_level: Option<u32>,
    /// After a level-2 sleep until weights are reloaded (requests refused).
    pub weights_discarded: bool,
    /// Sleeps, wakes and weight updates: how many, and the last ones' time.
    pub lifecycle: LifecycleStats,
}

/// The lifecycle's counters in [`EngineStats`].
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LifecycleStats {
    /// Seconds the memory side of the last sleep (offload/discard) took.
    pub last_sleep_seconds: f64,
    /// Seconds the last wake (mapping and restoring memory) took.
    pub last_wake_seconds: f64,
    /// Seconds the last in-place weight reload took.
    pub last_weight_update_seconds: f64,
    pub num_sleeps: u64,
    pub num_wakes: u64,
    pub num_weight_updates: u64,
}
