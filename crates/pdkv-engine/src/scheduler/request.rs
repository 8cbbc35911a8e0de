//! A request as the scheduler keeps it (its tokens, blocks and status),
//! and as a caller hands it in ([`NewRequest`]). A leaf.

use std::sync::Arc;

use crate::block_pool::BlockHash;
use crate::connector::{ConnectorRequest, KvTransferParams};

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
    /// The request's cache salt ([`BlockHash::salt`]): its blocks' hashes
    /// are its own, shared only with requests of the same salt.
    pub cache_salt: Option<BlockHash>,
    /// Outputs the request already has (a request resumed after another
    /// engine died): they follow the prompt in its tokens, count against
    /// `max_tokens` and are computed with the prompt.
    pub output_tokens: Vec<u32>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Status {
    Waiting,
    Running,
    /// Admitted with blocks, external KV loading into them.
    WaitingForRemoteKv,
}

#[derive(Debug)]
pub(super) struct Request {
    pub(super) id: Arc<str>,
    /// Prompt followed by the output so far.
    pub(super) tokens: Vec<u32>,
    pub(super) num_prompt_tokens: usize,
    pub(super) max_tokens: usize,
    pub(super) stop_token_ids: Vec<u32>,
    /// Tokens whose KV is written (or served from the prefix cache).
    pub(super) num_computed_tokens: usize,
    pub(super) blocks: Vec<u32>,
    /// Hash chain of the full blocks of `tokens`.
    pub(super) block_hashes: Vec<BlockHash>,
    /// Leading blocks already offered to the prefix cache.
    pub(super) num_cached_blocks: usize,
    /// Prompt tokens served from the prefix cache at first admission.
    pub(super) num_cached_tokens: Option<usize>,
    pub(super) status: Status,
    pub(super) num_preemptions: u32,
    pub(super) kv_transfer_params: Option<KvTransferParams>,
    /// The connector was consulted at admission (only the first time: a
    /// preempted request recomputes locally).
    pub(super) connector_consulted: bool,
    /// External tokens being loaded (status `WaitingForRemoteKv`).
    pub(super) num_loading_tokens: usize,
    pub(super) prompt_logits: bool,
    pub(super) cache_salt: Option<BlockHash>,
}

impl Request {
    pub(super) fn conn(&self) -> ConnectorRequest<'_> {
        ConnectorRequest {
            id: &self.id,
            prompt_tokens: &self.tokens[..self.num_prompt_tokens],
            kv_transfer_params: self.kv_transfer_params.as_ref(),
            cache_salt: self.cache_salt,
        }
    }

    pub(super) fn num_output_tokens(&self) -> usize {
        self.tokens.len() - self.num_prompt_tokens
    }

    /// Every position's logits are still needed (see
    /// [`NewRequest::prompt_logits`]); the first output ends that.
    pub(super) fn wants_all_logits(&self) -> bool {
        self.prompt_logits && self.num_output_tokens() == 0
    }
}
