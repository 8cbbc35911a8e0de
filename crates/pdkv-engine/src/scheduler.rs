//! The sans-IO scheduler: continuous batching with chunked prefill, prefix
//! caching and preemption by recompute.
//!
//! The scheduler knows nothing of threads, clocks, channels or the model. A
//! driver calls [`Scheduler::schedule`], runs the model on the returned
//! [`SchedulerOutput`], samples, and feeds the sampled tokens back with
//! [`Scheduler::update_from_output`].
//!
//! Policy, per step:
//! 1. Running requests first, in admission order: a decoding request computes
//!    its one new token, an unfinished prefill continues with the next chunk
//!    that fits in the step's token budget. If blocks run out, the most
//!    recently admitted running request is preempted (its blocks are freed, it
//!    goes to the *front* of the waiting queue and will recompute prompt plus
//!    the output generated so far — the sequence continues exactly as if never
//!    preempted).
//! 2. Then waiting requests, first come first served, while the token budget,
//!    `max_num_seqs` and free blocks allow. The prefix cache serves the longest
//!    run of already computed full blocks. A prompt larger than the remaining
//!    budget is admitted with a first chunk. No waiting request is admitted in
//!    a step that preempted.
//!
//! Only the chunk that reaches the end of a request's known tokens samples.
//!
//! With a KV connector ([`crate::connector`]): at admission the connector may
//! offer external KV for tokens beyond the local prefix hit. An asynchronous
//! load parks the request in *waiting for remote KV* holding its blocks (it
//! is neither waiting nor running, takes no step budget and is never
//! preempted); when the connector reports the load finished, the request
//! goes back to the front of the waiting queue holding its blocks, with the
//! loaded tokens counted as computed — or, when the load failed, fails or
//! recomputes them by the connector's policy. A finished request whose KV
//! the connector still reads (a prefill engine's blocks waiting for the
//! decode engine) or writes (an aborted load) keeps its blocks *held* until
//! the connector names it in `get_finished`.
//!
//! Invariants (checked by [`Scheduler::check_invariants`]):
//! - every block reference is held by exactly one request's block table
//!   (sum of table lengths over live requests == sum of reference counts);
//! - a waiting request holds no blocks and has computed nothing, except one
//!   whose external KV finished loading (it holds blocks covering its
//!   computed tokens);
//! - blocks held for transfers belong to no live request's table and are
//!   counted in the reference counts;
//! - a running request's table covers its computed tokens;
//! - when no request is live and no transfer holds blocks, every block is free.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use crate::block_pool::{blocks_for, BlockHash, BlockPool};
use crate::connector::{
    ConnectorRequest, KvConnector, KvTransferParams, LoadError, LoadFailurePolicy,
};
use crate::FinishReason;

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub num_blocks: usize,
    pub enable_prefix_caching: bool,
}

/// A request as the scheduler sees it.
#[derive(Clone, Debug)]
pub struct NewRequest {
    pub id: Arc<str>,
    pub prompt_tokens: Vec<u32>,
    pub max_tokens: usize,
    /// Sampling one of these ends the request with [`FinishReason::Stop`]
    /// (EOS ids unless ignored, plus the request's stop token ids).
    pub stop_token_ids: Vec<u32>,
    /// For the KV connector (opaque here).
    pub kv_transfer_params: Option<KvTransferParams>,
    /// The caller needs the logits of every prompt position (prompt
    /// log-probabilities): until the first output token, the request takes
    /// no prefix-cache hit and its seqs ask for every position's row
    /// ([`ScheduledSeq::all_logits`]).
    pub prompt_logits: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Waiting,
    Running,
    /// Admitted with blocks, external KV loading into them.
    WaitingForRemoteKv,
}

#[derive(Debug)]
struct Request {
    id: Arc<str>,
    /// Prompt followed by the output so far.
    tokens: Vec<u32>,
    num_prompt_tokens: usize,
    max_tokens: usize,
    stop_token_ids: Vec<u32>,
    /// Tokens whose KV is written (or served from the prefix cache).
    num_computed_tokens: usize,
    blocks: Vec<u32>,
    /// Hash chain of the full blocks of `tokens`.
    block_hashes: Vec<BlockHash>,
    /// Leading blocks already offered to the prefix cache.
    num_cached_blocks: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    num_cached_tokens: Option<usize>,
    status: Status,
    num_preemptions: u32,
    kv_transfer_params: Option<KvTransferParams>,
    /// The connector was consulted at admission (only the first time: a
    /// preempted request recomputes locally).
    connector_consulted: bool,
    /// External tokens being loaded (status `WaitingForRemoteKv`).
    num_loading_tokens: usize,
    prompt_logits: bool,
}

impl Request {
    fn conn(&self) -> ConnectorRequest<'_> {
        ConnectorRequest {
            id: &self.id,
            prompt_tokens: &self.tokens[..self.num_prompt_tokens],
            kv_transfer_params: self.kv_transfer_params.as_ref(),
        }
    }

    fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// Every position's logits are still needed (see
    /// [`NewRequest::prompt_logits`]); the first output ends that.
    fn wants_all_logits(&self) -> bool {
        self.prompt_logits && self.num_output_tokens() == 0
    }
}

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub request_id: Arc<str>,
    /// Tokens to compute now.
    pub tokens: Vec<u32>,
    /// Tokens already in the KV cache; `tokens[0]` sits at this position.
    pub start_pos: usize,
    /// Blocks covering `0 .. start_pos + tokens.len()`.
    pub block_table: Vec<u32>,
    /// This chunk ends the known tokens: sample the next one from its logits.
    pub sample: bool,
    /// Index of the output token that sampling produces (0 for the first).
    pub output_index: usize,
    /// The model returns a logits row for every token of `tokens`, not only
    /// for the last one when sampling (prompt log-probabilities).
    pub all_logits: bool,
}

impl ScheduledSeq {
    /// Logits rows the model returns for this seq: one per token with
    /// `all_logits`, else one when it samples.
    pub fn num_logit_rows(&self) -> usize {
        if self.all_logits {
            self.tokens.len()
        } else {
            usize::from(self.sample)
        }
    }
}

/// The plan of one step.
#[derive(Clone, Debug, Default)]
pub struct SchedulerOutput {
    pub seqs: Vec<ScheduledSeq>,
    /// Requests preempted while planning this step.
    pub preempted: Vec<Arc<str>>,
}

impl SchedulerOutput {
    pub fn is_empty(&self) -> bool {
        self.seqs.is_empty()
    }

    pub fn num_tokens(&self) -> usize {
        self.seqs.iter().map(|s| s.tokens.len()).sum()
    }

    pub fn num_sampled(&self) -> usize {
        self.seqs.iter().filter(|s| s.sample).count()
    }

    /// Logits rows the model returns for the whole step.
    pub fn num_logit_rows(&self) -> usize {
        self.seqs.iter().map(ScheduledSeq::num_logit_rows).sum()
    }
}

/// What a step did to one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqUpdate {
    pub request_id: Arc<str>,
    /// The token sampled this step, if the step sampled for this request.
    pub new_token: Option<u32>,
    /// Set when the request ended in this step (its blocks are freed, or
    /// held for the connector).
    pub finished: Option<FinishReason>,
    /// The connector's parameters for the request's last output.
    pub kv_transfer_params: Option<KvTransferParams>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
}

/// Live request counts and block usage.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SchedulerCounts {
    pub num_running: usize,
    pub num_waiting: usize,
    pub num_blocks: usize,
    pub num_free_blocks: usize,
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    pub num_preemptions: u64,
    /// Requests whose external KV is loading.
    pub num_waiting_for_remote_kv: usize,
    /// Blocks held by transfers of finished requests.
    pub num_held_blocks: usize,
}

/// A request the connector's load failed for, ended by the `fail` policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FailedLoad {
    pub request_id: Arc<str>,
    pub error: String,
    /// The load ended because a deadline passed ([`LoadError::timed_out`]).
    pub timed_out: bool,
}

pub struct Scheduler {
    config: SchedulerConfig,
    pool: BlockPool,
    requests: HashMap<Arc<str>, Request>,
    /// FCFS; preempted requests go back to the front.
    waiting: VecDeque<Arc<str>>,
    /// In admission order (the last one is preempted first).
    running: Vec<Arc<str>>,
    /// Requests whose external KV is loading, in admission order.
    loading: Vec<Arc<str>>,
    /// Blocks of finished requests that a transfer still reads or writes.
    held: HashMap<Arc<str>, Vec<u32>>,
    connector: Option<Box<dyn KvConnector>>,
    num_preemptions: u64,
}

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Scheduler {
        assert!(
            config.max_num_seqs > 0 && config.max_num_batched_tokens > 0 && config.num_blocks > 0
        );
        Scheduler {
            pool: BlockPool::new(config.num_blocks, config.enable_prefix_caching),
            config,
            requests: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            loading: Vec::new(),
            held: HashMap::new(),
            connector: None,
            num_preemptions: 0,
        }
    }

    /// A scheduler that consults `connector` (see the module docs).
    pub fn with_connector(config: SchedulerConfig, connector: Box<dyn KvConnector>) -> Scheduler {
        let mut s = Scheduler::new(config);
        s.connector = Some(connector);
        s
    }

    /// The connector, for the worker-side calls.
    pub fn connector_mut(&mut self) -> Option<&mut (dyn KvConnector + 'static)> {
        self.connector.as_deref_mut()
    }

    /// Whether a step could do anything (a request waiting or running;
    /// loading requests wait for the connector instead).
    pub fn has_runnable(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Blocks held for transfers of finished requests.
    pub fn num_held_blocks(&self) -> usize {
        self.held.values().map(Vec::len).sum()
    }

    /// Transfers hold blocks now: finished requests' blocks kept for remote
    /// readers, or loads in flight.
    pub fn has_transfers(&self) -> bool {
        !self.held.is_empty() || !self.loading.is_empty()
    }

    /// Releases the KV that transfers hold, ahead of a cache reset: every
    /// load in flight is cut short (the request goes back to the waiting
    /// queue with nothing computed and recomputes its prompt; its blocks stay
    /// held until the transfer stops writing them), waiting requests that
    /// hold loaded blocks give them up (they recompute too), and the
    /// connector is asked to end its transfers ([`KvConnector::abort_transfers`]).
    /// Returns how many loads were cut short.
    pub fn release_transfer_kv(&mut self) -> usize {
        let cut = std::mem::take(&mut self.loading);
        for id in cut.iter().rev() {
            self.requeue_from_scratch(id);
        }
        self.drop_waiting_blocks();
        if let Some(c) = self.connector.as_deref_mut() {
            c.abort_transfers();
        }
        if !cut.is_empty() {
            tracing::info!(
                loads = cut.len(),
                "KV loads cut short by a cache reset; their requests recompute"
            );
        }
        cut.len()
    }

    /// Whether `id` names a finished request whose blocks a transfer holds.
    pub fn is_held(&self, id: &str) -> bool {
        self.held.contains_key(id)
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    pub fn block_pool(&self) -> &BlockPool {
        &self.pool
    }

    /// Blocks a request needs at its longest: the last sampled token is
    /// never written to the cache.
    pub fn max_blocks_needed(num_prompt_tokens: usize, max_tokens: usize) -> usize {
        blocks_for(num_prompt_tokens + max_tokens.max(1) - 1)
    }

    pub fn has_work(&self) -> bool {
        !self.requests.is_empty()
    }

    pub fn contains(&self, id: &str) -> bool {
        self.requests.contains_key(id)
    }

    pub fn counts(&self) -> SchedulerCounts {
        SchedulerCounts {
            num_running: self.running.len(),
            num_waiting: self.waiting.len(),
            num_blocks: self.pool.num_blocks(),
            num_free_blocks: self.pool.num_free(),
            prefix_cache_queries: self.pool.num_queries(),
            prefix_cache_hits: self.pool.num_hits(),
            num_preemptions: self.num_preemptions,
            num_waiting_for_remote_kv: self.loading.len(),
            num_held_blocks: self.num_held_blocks(),
        }
    }

    /// Ids of the live requests (waiting, running, loading), for shutdown.
    pub fn request_ids(&self) -> Vec<Arc<str>> {
        self.waiting
            .iter()
            .chain(self.running.iter())
            .chain(self.loading.iter())
            .cloned()
            .collect()
    }

    /// Queues a request. The caller has validated it: non-empty prompt,
    /// `max_tokens >= 1`, unique id, and prompt plus output fits the cache
    /// alone (see [`Scheduler::max_blocks_needed`]) — which is what guarantees
    /// that preemption always makes progress.
    ///
    /// # Panics
    /// When one of those preconditions does not hold.
    pub fn add_request(&mut self, req: NewRequest) {
        assert!(!req.prompt_tokens.is_empty(), "empty prompt");
        assert!(
            !self.requests.contains_key(&req.id),
            "duplicate request id {}",
            req.id
        );
        assert!(req.max_tokens > 0, "max_tokens must be at least 1");
        let max_blocks = Self::max_blocks_needed(req.prompt_tokens.len(), req.max_tokens);
        assert!(
            max_blocks <= self.pool.num_blocks(),
            "request {} can never fit the KV cache",
            req.id
        );
        let mut block_hashes = Vec::new();
        if self.pool.caching_enabled() {
            BlockHash::extend_chain(&mut block_hashes, &req.prompt_tokens);
        }
        let r = Request {
            id: req.id.clone(),
            num_prompt_tokens: req.prompt_tokens.len(),
            tokens: req.prompt_tokens,
            max_tokens: req.max_tokens,
            stop_token_ids: req.stop_token_ids,
            num_computed_tokens: 0,
            blocks: Vec::new(),
            block_hashes,
            num_cached_blocks: 0,
            num_cached_tokens: None,
            status: Status::Waiting,
            num_preemptions: 0,
            kv_transfer_params: req.kv_transfer_params,
            connector_consulted: false,
            num_loading_tokens: 0,
            prompt_logits: req.prompt_logits,
        };
        if let Some(c) = self.connector.as_deref_mut() {
            c.request_added(r.conn());
        }
        self.requests.insert(req.id.clone(), r);
        self.waiting.push_back(req.id);
    }

    /// Ends a live request with `reason` and frees its blocks (or holds
    /// them, when the connector still transfers them). Returns false for an
    /// unknown id.
    pub fn finish_request(&mut self, id: &str, reason: FinishReason) -> bool {
        self.finish_request_with(id, reason).is_some()
    }

    /// [`Scheduler::finish_request`], returning the connector's parameters
    /// for the request's last output (`None`: unknown id).
    pub fn finish_request_with(
        &mut self,
        id: &str,
        reason: FinishReason,
    ) -> Option<Option<KvTransferParams>> {
        let req = self.requests.remove(id)?;
        let list = match req.status {
            Status::Waiting => {
                let pos = self
                    .waiting
                    .iter()
                    .position(|w| **w == *id)
                    .expect("waiting request is queued");
                self.waiting.remove(pos);
                None
            }
            Status::Running => Some(&mut self.running),
            Status::WaitingForRemoteKv => Some(&mut self.loading),
        };
        if let Some(list) = list {
            let pos = list
                .iter()
                .position(|w| **w == *id)
                .expect("request is listed");
            list.remove(pos);
        }
        let (delay, params) = match self.connector.as_deref_mut() {
            Some(c) => c.request_finished(req.conn(), &req.blocks, reason),
            None => (false, None),
        };
        if delay && !req.blocks.is_empty() {
            self.held
                .entry(req.id.clone())
                .or_default()
                .extend(req.blocks);
        } else {
            self.pool.free(&req.blocks);
        }
        Some(params)
    }

    /// Takes what the connector finished since the last call: frees the
    /// blocks of finished transfers, moves loaded requests back to the
    /// waiting queue (loaded tokens computed), and applies the failure
    /// policy to failed loads (a load ended on purpose always recomputes).
    /// An abandoned load's request gives its blocks to the transfer (held
    /// until the load is reported in `recving`) and fails or recomputes
    /// from scratch now. Returns the requests the `fail` policy ended
    /// (already removed; the caller reports them).
    pub fn update_from_connector(&mut self) -> Vec<FailedLoad> {
        let Some(c) = self.connector.as_deref_mut() else {
            return Vec::new();
        };
        let finished = c.get_finished();
        let errors: HashMap<u32, LoadError> =
            c.get_block_ids_with_load_errors().into_iter().collect();
        let policy = c.load_failure_policy();
        if finished.is_empty() && errors.is_empty() {
            return Vec::new();
        }
        let mut failed = Vec::new();
        for id in &finished.sending {
            if let Some(blocks) = self.held.remove(id) {
                self.pool.free(&blocks);
            }
        }
        for id in &finished.abandoned {
            if let Some(f) = self.abandon_load(id, &errors, policy) {
                failed.push(f);
            }
        }
        for id in &finished.recving {
            if let Some(blocks) = self.held.remove(id) {
                // A load whose request ended (or gave it up) while it ran.
                self.pool.free(&blocks);
                continue;
            }
            if let Some(f) = self.end_load(id, &errors, policy) {
                failed.push(f);
            }
        }
        if let Some(c) = self.connector.as_deref_mut() {
            c.update_connector_output(&finished);
        }
        failed
    }

    /// The first load error among a loading request's external blocks.
    fn load_error(req: &Request, errors: &HashMap<u32, LoadError>) -> Option<LoadError> {
        let first = req.num_computed_tokens / pdkv_model::BLOCK_SIZE;
        req.blocks[first..]
            .iter()
            .find_map(|b| errors.get(b).cloned())
    }

    /// A loaded (or failed) request goes back to the front of the waiting
    /// queue, holding its blocks; the `fail` policy ends a failed one.
    fn end_load(
        &mut self,
        id: &Arc<str>,
        errors: &HashMap<u32, LoadError>,
        policy: LoadFailurePolicy,
    ) -> Option<FailedLoad> {
        let req = self.requests.get_mut(id)?;
        if req.status != Status::WaitingForRemoteKv {
            return None;
        }
        let error = Self::load_error(req, errors);
        let pos = self
            .loading
            .iter()
            .position(|w| w == id)
            .expect("loading request is listed");
        self.loading.remove(pos);
        let loaded = std::mem::take(&mut req.num_loading_tokens);
        req.status = Status::Waiting;
        self.waiting.push_front(id.clone());
        match error {
            None => {
                req.num_computed_tokens += loaded;
                None
            }
            Some(e) if e.recompute || policy == LoadFailurePolicy::Recompute => {
                tracing::warn!(id = %id, error = %e.message, "external KV failed to load; recomputing it");
                None
            }
            Some(e) => {
                tracing::warn!(id = %id, error = %e.message, "external KV failed to load; failing the request");
                self.finish_request(id, FinishReason::Error);
                Some(FailedLoad {
                    request_id: id.clone(),
                    error: e.message,
                    timed_out: e.timed_out,
                })
            }
        }
    }

    /// A loading request goes back to the front of the queue to start from
    /// scratch; the blocks its load may still write stay the transfer's
    /// (held until the connector names the request finished).
    fn requeue_from_scratch(&mut self, id: &Arc<str>) {
        let req = self.requests.get_mut(id).expect("loading request exists");
        let blocks = std::mem::take(&mut req.blocks);
        req.num_computed_tokens = 0;
        req.num_cached_blocks = 0;
        req.num_loading_tokens = 0;
        req.status = Status::Waiting;
        self.held.entry(id.clone()).or_default().extend(blocks);
        self.waiting.push_front(id.clone());
    }

    /// The connector gave up a load that may still write its blocks: the
    /// blocks become the transfer's (held until `recving` names the
    /// request), and the request recomputes from scratch or fails now.
    fn abandon_load(
        &mut self,
        id: &Arc<str>,
        errors: &HashMap<u32, LoadError>,
        policy: LoadFailurePolicy,
    ) -> Option<FailedLoad> {
        let req = self.requests.get_mut(id)?;
        if req.status != Status::WaitingForRemoteKv {
            return None;
        }
        let error = Self::load_error(req, errors)
            .unwrap_or_else(|| LoadError::failed("the KV load was given up"));
        let pos = self
            .loading
            .iter()
            .position(|w| w == id)
            .expect("loading request is listed");
        self.loading.remove(pos);
        self.requeue_from_scratch(id);
        if error.recompute || policy == LoadFailurePolicy::Recompute {
            tracing::warn!(id = %id, error = %error.message, "external KV load given up; recomputing the prompt");
            return None;
        }
        tracing::warn!(id = %id, error = %error.message, "external KV load given up; failing the request");
        self.finish_request(id, FinishReason::Error);
        Some(FailedLoad {
            request_id: id.clone(),
            error: error.message,
            timed_out: error.timed_out,
        })
    }

    /// Aborts a request in any state. Returns false for an unknown id.
    pub fn abort_request(&mut self, id: &str) -> bool {
        self.finish_request(id, FinishReason::Abort)
    }

    /// Drops every prefix-cache entry; false while any block is in use.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.pool.reset_prefix_cache()
    }

    /// Preempts every running request for recompute (newest first, so the
    /// waiting queue starts with them in admission order). Afterwards no
    /// request holds a block. Returns how many were preempted.
    pub fn preempt_all_running(&mut self) -> usize {
        let n = self.running.len();
        while let Some(id) = self.running.pop() {
            self.preempt(id);
        }
        self.drop_waiting_blocks();
        n
    }

    /// Waiting requests whose external KV landed (and were not scheduled
    /// yet) give their blocks up and will recompute from scratch.
    fn drop_waiting_blocks(&mut self) {
        for id in &self.waiting {
            let req = self.requests.get_mut(id).expect("waiting request exists");
            if !req.blocks.is_empty() {
                self.pool.free(&req.blocks);
                req.blocks.clear();
                req.num_computed_tokens = 0;
                req.num_cached_blocks = 0;
            }
        }
    }

    /// The head of the waiting queue cannot get its blocks. When nothing
    /// runs (no step will free any) and waiting requests behind it hold
    /// blocks (KV that loaded, or a failed load they recompute into), those
    /// give the blocks back and will recompute: otherwise waiting requests
    /// could hold the cache forever while the head waits for it. Returns
    /// whether blocks were freed (the head is tried again).
    fn unjam(&mut self, head: &Arc<str>) -> bool {
        if !self.running.is_empty() {
            return false;
        }
        let holders: Vec<Arc<str>> = self
            .waiting
            .iter()
            .filter(|id| **id != *head && !self.requests[*id].blocks.is_empty())
            .cloned()
            .collect();
        for id in &holders {
            let req = self.requests.get_mut(id).expect("waiting request exists");
            self.pool.free(&req.blocks);
            req.blocks.clear();
            req.num_computed_tokens = 0;
            req.num_cached_blocks = 0;
        }
        if !holders.is_empty() {
            tracing::info!(
                requests = holders.len(),
                "waiting requests gave their blocks back so the first in line can run"
            );
        }
        !holders.is_empty()
    }

    /// Drops the prefix-cache hashes of free blocks only (see
    /// [`BlockPool::forget_free_cached_blocks`]).
    pub fn forget_free_cached_blocks(&mut self) -> usize {
        self.pool.forget_free_cached_blocks()
    }

    /// Makes `req`'s table cover `num_tokens` tokens; false if blocks ran out.
    fn grow_blocks(pool: &mut BlockPool, req: &mut Request, num_tokens: usize) -> bool {
        let need = blocks_for(num_tokens).saturating_sub(req.blocks.len());
        if need == 0 {
            return true;
        }
        match pool.allocate(need) {
            Some(ids) => {
                req.blocks.extend(ids);
                true
            }
            None => false,
        }
    }

    fn preempt(&mut self, id: Arc<str>) {
        let req = self.requests.get_mut(&id).expect("running request exists");
        debug_assert_eq!(req.status, Status::Running);
        self.pool.free(&req.blocks);
        req.blocks.clear();
        req.num_computed_tokens = 0;
        req.num_cached_blocks = 0;
        req.status = Status::Waiting;
        req.num_preemptions += 1;
        self.num_preemptions += 1;
        self.waiting.push_front(id);
    }

    fn seq_for(req: &Request, num_new: usize) -> ScheduledSeq {
        let start = req.num_computed_tokens;
        let end = start + num_new;
        ScheduledSeq {
            request_id: req.id.clone(),
            tokens: req.tokens[start..end].to_vec(),
            start_pos: start,
            block_table: req.blocks[..blocks_for(end)].to_vec(),
            sample: end == req.tokens.len(),
            output_index: req.num_output_tokens(),
            all_logits: req.wants_all_logits(),
        }
    }

    /// Plans one step. Blocks for the planned tokens are allocated here; the
    /// step's results must be reported with [`Scheduler::update_from_output`]
    /// before the next call.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;

        // 1. Running requests, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 && out.seqs.len() < self.config.max_num_seqs {
            let id = self.running[i].clone();
            let req = self.requests.get(&id).expect("running request exists");
            let num_new = (req.tokens.len() - req.num_computed_tokens).min(budget);
            debug_assert!(
                num_new > 0,
                "a running request always has a token to compute"
            );
            let target = req.num_computed_tokens + num_new;
            let mut scheduled = true;
            loop {
                let req = self.requests.get_mut(&id).expect("running request exists");
                if Self::grow_blocks(&mut self.pool, req, target) {
                    break;
                }
                // Out of blocks: preempt the most recently admitted request.
                let victim = self.running.pop().expect("running is not empty here");
                let is_self = victim == id;
                self.preempt(victim.clone());
                out.preempted.push(victim);
                if is_self {
                    scheduled = false;
                    break;
                }
            }
            if !scheduled {
                break;
            }
            let req = &self.requests[&id];
            out.seqs.push(Self::seq_for(req, num_new));
            budget -= num_new;
            i += 1;
        }

        // 2. Waiting requests, FCFS; none in a step that preempted.
        if out.preempted.is_empty() {
            while budget > 0
                && self.running.len() < self.config.max_num_seqs
                && out.seqs.len() < self.config.max_num_seqs
            {
                let Some(id) = self.waiting.front().cloned() else {
                    break;
                };
                let req = self.requests.get_mut(&id).expect("waiting request exists");
                if !req.blocks.is_empty() {
                    // Its external KV landed (or failed and is recomputed):
                    // it holds blocks for its computed tokens already.
                    let num_new = (req.tokens.len() - req.num_computed_tokens).min(budget);
                    let target = req.num_computed_tokens + num_new;
                    let need = blocks_for(target).saturating_sub(req.blocks.len());
                    if need > self.pool.num_free() {
                        if self.unjam(&id) {
                            continue;
                        }
                        break;
                    }
                    let fresh = self.pool.allocate(need).expect("counted above");
                    let req = self.requests.get_mut(&id).expect("waiting request exists");
                    req.blocks.extend(fresh);
                    req.status = Status::Running;
                    self.waiting.pop_front();
                    self.running.push(id.clone());
                    out.seqs.push(Self::seq_for(&self.requests[&id], num_new));
                    budget -= num_new;
                    continue;
                }
                debug_assert!(req.num_computed_tokens == 0);
                if self.pool.caching_enabled() {
                    BlockHash::extend_chain(&mut req.block_hashes, &req.tokens);
                }
                // Cached blocks would skip positions whose logits are wanted.
                let hit = if req.wants_all_logits() {
                    Vec::new()
                } else {
                    self.pool
                        .get_computed_blocks(&req.tokens, &req.block_hashes)
                };
                let num_hit_tokens = hit.len() * pdkv_model::BLOCK_SIZE;
                let ext = match self.connector.as_deref_mut() {
                    Some(c) if !req.connector_consulted => {
                        req.connector_consulted = true;
                        let mut m = c.get_num_new_matched_tokens(req.conn(), num_hit_tokens);
                        // The last prompt token is always computed here.
                        let room = req.num_prompt_tokens.saturating_sub(1 + num_hit_tokens);
                        if m.num_tokens > room {
                            tracing::warn!(id = %req.id, offered = m.num_tokens, room, "connector offered more tokens than a request can take");
                            m.num_tokens = room;
                        }
                        m
                    }
                    _ => Default::default(),
                };
                if ext.load_async && ext.num_tokens > 0 {
                    // Park it with blocks for the hit and the external tokens.
                    let need = blocks_for(num_hit_tokens + ext.num_tokens) - hit.len();
                    let available = self.pool.num_free() - self.pool.count_free(&hit);
                    if need > available {
                        // Ask again once blocks are free.
                        req.connector_consulted = false;
                        if self.unjam(&id) {
                            continue;
                        }
                        break;
                    }
                    self.pool.touch(&hit);
                    self.pool.record_lookup(req.tokens.len(), num_hit_tokens);
                    let fresh = self.pool.allocate(need).expect("counted above");
                    let req = self.requests.get_mut(&id).expect("waiting request exists");
                    req.blocks = hit;
                    req.blocks.extend(fresh);
                    req.num_computed_tokens = num_hit_tokens;
                    req.num_cached_blocks = num_hit_tokens / pdkv_model::BLOCK_SIZE;
                    req.num_cached_tokens = Some(num_hit_tokens);
                    req.num_loading_tokens = ext.num_tokens;
                    req.status = Status::WaitingForRemoteKv;
                    self.waiting.pop_front();
                    self.loading.push(id.clone());
                    let c = self.connector.as_deref_mut().expect("consulted above");
                    c.update_state_after_alloc(
                        req.conn(),
                        &req.blocks,
                        num_hit_tokens,
                        ext.num_tokens,
                    );
                    continue;
                }
                // KV the connector provides synchronously counts as computed
                // (it is in place before this step's forward pass).
                let num_hit_tokens = num_hit_tokens + ext.num_tokens;
                let num_new = (req.tokens.len() - num_hit_tokens).min(budget);
                let need = blocks_for(num_hit_tokens + num_new) - hit.len();
                let available = self.pool.num_free() - self.pool.count_free(&hit);
                if need > available {
                    if self.unjam(&id) {
                        continue;
                    }
                    break;
                }
                self.pool.touch(&hit);
                self.pool
                    .record_lookup(req.tokens.len(), num_hit_tokens - ext.num_tokens);
                let fresh = self.pool.allocate(need).expect("counted above");
                let req = self.requests.get_mut(&id).expect("waiting request exists");
                req.blocks = hit;
                req.blocks.extend(fresh);
                req.num_computed_tokens = num_hit_tokens;
                req.num_cached_blocks = (num_hit_tokens - ext.num_tokens) / pdkv_model::BLOCK_SIZE;
                if req.num_cached_tokens.is_none() {
                    req.num_cached_tokens = Some(num_hit_tokens);
                }
                req.status = Status::Running;
                self.waiting.pop_front();
                self.running.push(id.clone());
                if ext.num_tokens > 0 {
                    let c = self.connector.as_deref_mut().expect("consulted above");
                    c.update_state_after_alloc(
                        req.conn(),
                        &req.blocks,
                        num_hit_tokens - ext.num_tokens,
                        ext.num_tokens,
                    );
                }
                out.seqs.push(Self::seq_for(&self.requests[&id], num_new));
                budget -= num_new;
            }
        }
        out
    }

    /// Applies a step's results: `sampled[i]` is the token sampled for
    /// `output.seqs[i]` (`Some` exactly when that seq had `sample`). Requests
    /// that ended (stop token, `max_tokens`) are removed and their blocks
    /// freed. Seqs of requests that ended since `schedule` are skipped.
    pub fn update_from_output(
        &mut self,
        output: &SchedulerOutput,
        sampled: &[Option<u32>],
    ) -> Vec<SeqUpdate> {
        assert_eq!(
            output.seqs.len(),
            sampled.len(),
            "one sample slot per scheduled seq"
        );
        let mut updates = Vec::new();
        for (seq, tok) in output.seqs.iter().zip(sampled) {
            let Some(req) = self.requests.get_mut(&seq.request_id) else {
                continue;
            };
            debug_assert_eq!(
                req.num_computed_tokens, seq.start_pos,
                "step results applied out of order"
            );
            req.num_computed_tokens = seq.start_pos + seq.tokens.len();
            // Offer newly completed blocks to the prefix cache.
            if self.pool.caching_enabled() {
                let full = req.num_computed_tokens / pdkv_model::BLOCK_SIZE;
                BlockHash::extend_chain(
                    &mut req.block_hashes,
                    &req.tokens[..full * pdkv_model::BLOCK_SIZE],
                );
                for b in req.num_cached_blocks..full {
                    self.pool.cache_block(req.blocks[b], req.block_hashes[b]);
                }
                req.num_cached_blocks = req.num_cached_blocks.max(full);
            }
            let new_token = if seq.sample {
                let t = tok.expect("a sampling seq has a sampled token");
                req.tokens.push(t);
                Some(t)
            } else {
                debug_assert!(tok.is_none());
                None
            };
            let finished = new_token.and_then(|t| {
                if req.stop_token_ids.contains(&t) {
                    Some(FinishReason::Stop)
                } else if req.num_output_tokens() >= req.max_tokens {
                    Some(FinishReason::Length)
                } else {
                    None
                }
            });
            let mut update = SeqUpdate {
                request_id: seq.request_id.clone(),
                new_token,
                finished,
                num_prompt_tokens: req.num_prompt_tokens,
                num_cached_tokens: req.num_cached_tokens.unwrap_or(0),
                kv_transfer_params: None,
            };
            if let Some(reason) = finished {
                update.kv_transfer_params =
                    self.finish_request_with(&seq.request_id, reason).flatten();
            }
            updates.push(update);
        }
        updates
    }

    /// Checks the module's invariants and the block pool's; panics on a
    /// violation.
    pub fn check_invariants(&self) {
        self.pool.check_invariants();
        let mut refs = vec![0u32; self.pool.num_blocks()];
        for blocks in self.held.values() {
            for &b in blocks {
                refs[b as usize] += 1;
            }
        }
        for req in self.requests.values() {
            for &b in &req.blocks {
                refs[b as usize] += 1;
            }
            match req.status {
                Status::Waiting if !req.blocks.is_empty() => {
                    assert!(blocks_for(req.num_computed_tokens) <= req.blocks.len());
                    assert!(self.waiting.contains(&req.id));
                }
                Status::Waiting => {
                    assert_eq!(
                        req.num_computed_tokens, 0,
                        "waiting request {} without blocks computed tokens",
                        req.id
                    );
                    assert!(self.waiting.contains(&req.id));
                }
                Status::WaitingForRemoteKv => {
                    assert!(
                        blocks_for(req.num_computed_tokens + req.num_loading_tokens)
                            <= req.blocks.len()
                    );
                    assert!(req.num_loading_tokens > 0);
                    assert!(self.loading.contains(&req.id));
                }
                Status::Running => {
                    assert!(blocks_for(req.num_computed_tokens) <= req.blocks.len());
                    assert!(
                        req.num_computed_tokens < req.tokens.len(),
                        "running request with nothing to compute"
                    );
                    assert!(self.running.contains(&req.id));
                }
            }
            assert!(req.num_output_tokens() < req.max_tokens);
        }
        for (b, &n) in refs.iter().enumerate() {
            assert_eq!(
                n,
                self.pool.ref_count(b as u32),
                "block {b}: table references != ref count"
            );
        }
        assert_eq!(
            self.waiting.len() + self.running.len() + self.loading.len(),
            self.requests.len()
        );
        assert!(self.running.len() <= self.config.max_num_seqs);
        if self.requests.is_empty() && self.held.is_empty() {
            assert_eq!(
                self.pool.num_free(),
                self.pool.num_blocks(),
                "blocks leaked at quiescence"
            );
        }
    }

    /// The waiting queue as text (front first), for diagnostics.
    pub fn describe_waiting(&self, n: usize) -> Vec<String> {
        self.waiting
            .iter()
            .take(n)
            .map(|id| {
                let r = &self.requests[id];
                format!(
                    "{id}: tokens {} computed {} blocks {} loading {} consulted {}",
                    r.tokens.len(),
                    r.num_computed_tokens,
                    r.blocks.len(),
                    r.num_loading_tokens,
                    r.connector_consulted
                )
            })
            .collect()
    }

    /// Output tokens generated so far by a live request.
    pub fn output_tokens(&self, id: &str) -> Option<&[u32]> {
        self.requests
            .get(id)
            .map(|r| &r.tokens[r.num_prompt_tokens..])
    }

    /// Times a live request was preempted.
    pub fn request_preemptions(&self, id: &str) -> Option<u32> {
        self.requests.get(id).map(|r| r.num_preemptions)
    }
}
