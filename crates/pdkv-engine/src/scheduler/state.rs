//! The [`Scheduler`]'s state and limits, the requests' lifetimes (added,
//! finished, aborted, preempted for a lifecycle operation), the counts and
//! the invariants. Planning a step is `step.rs`; what transfers hold and
//! report, `transfers.rs`.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use super::request::{NewRequest, Request, Status};
use crate::block_pool::{blocks_for, BlockHash, BlockPool};
use crate::connector::{Ended, KvConnector, KvTransferParams};
use crate::FinishReason;

/// Scheduler limits.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub num_blocks: usize,
    pub enable_prefix_caching: bool,
    /// Decoding requests propose draft tokens (`None`: one token a step).
    pub speculative: Option<super::SpeculativeConfig>,
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
    pub(super) config: SchedulerConfig,
    pub(super) pool: BlockPool,
    pub(super) requests: HashMap<Arc<str>, Request>,
    /// FCFS; preempted requests go back to the front.
    pub(super) waiting: VecDeque<Arc<str>>,
    /// In admission order (the last one is preempted first).
    pub(super) running: Vec<Arc<str>>,
    /// Requests whose external KV is loading, in admission order.
    pub(super) loading: Vec<Arc<str>>,
    /// Blocks of finished requests that a transfer still reads or writes.
    pub(super) held: HashMap<Arc<str>, Vec<u32>>,
    pub(super) connector: Option<Box<dyn KvConnector>>,
    pub(super) num_preemptions: u64,
    /// The connector was asked to give held blocks back and none came back
    /// since.
    pub(super) reclaim_asked: bool,
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
            reclaim_asked: false,
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
        assert!(
            req.output_tokens.len() < req.max_tokens,
            "max_tokens must exceed the outputs a request already has"
        );
        let max_blocks = Self::max_blocks_needed(req.prompt_tokens.len(), req.max_tokens);
        assert!(
            max_blocks <= self.pool.num_blocks(),
            "request {} can never fit the KV cache",
            req.id
        );
        let num_prompt_tokens = req.prompt_tokens.len();
        let mut tokens = req.prompt_tokens;
        tokens.extend_from_slice(&req.output_tokens);
        let mut block_hashes = Vec::new();
        if self.pool.caching_enabled() {
            BlockHash::extend_salted_chain(&mut block_hashes, &tokens, req.cache_salt);
        }
        let r = Request {
            id: req.id.clone(),
            num_prompt_tokens,
            tokens,
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
            cache_salt: req.cache_salt,
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
            Some(c) => c.request_finished(req.conn(), Ended::new(&req.blocks, reason)),
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
        let n = self.preempt_running();
        self.drop_waiting_blocks();
        n
    }

    /// Preempts the running requests, newest first.
    fn preempt_running(&mut self) -> usize {
        let n = self.running.len();
        while let Some(id) = self.running.pop() {
            self.preempt(id);
        }
        n
    }

    /// Resets the prefix cache while requests run (`reset_running_requests`):
    /// running requests are preempted and recompute (their outputs go on
    /// exactly), then every cached hash is forgotten, those of blocks still
    /// held by transfers and loads included, which finish with their blocks
    /// and hand them back uncached. Nothing a transfer moved is thrown away.
    /// Returns how many requests were preempted.
    pub fn reset_prefix_cache_preempting(&mut self) -> usize {
        let n = self.preempt_running();
        self.pool.forget_all_cached_blocks();
        n
    }

    /// Waiting requests whose external KV landed (and were not scheduled
    /// yet) give their blocks up and will recompute from scratch.
    pub(super) fn drop_waiting_blocks(&mut self) {
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

    /// Drops the prefix-cache hashes of free blocks only (see
    /// [`BlockPool::forget_free_cached_blocks`]).
    pub fn forget_free_cached_blocks(&mut self) -> usize {
        self.pool.forget_free_cached_blocks()
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
