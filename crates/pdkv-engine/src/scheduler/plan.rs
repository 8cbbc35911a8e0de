//! A step's plan ([`SchedulerOutput`], one [`ScheduledSeq`] per request)
//! and what the step did to each request ([`SeqUpdate`]). A leaf.

use std::sync::Arc;

use crate::connector::KvTransferParams;
use crate::FinishReason;

/// One sequence's work in a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub request_id: Arc<str>,
    /// Tokens to compute now (the last `num_draft` of them are drafts).
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
    /// Draft tokens at the end of `tokens` (speculative decoding; then
    /// `tokens` is the one uncomputed token followed by the drafts): the
    /// model returns a row for every token, and sampling goes through the
    /// rows while it confirms the drafts.
    pub num_draft: usize,
}

impl ScheduledSeq {
    /// Logits rows the model returns for this seq: one per token with
    /// `all_logits` or drafts, else one when it samples.
    pub fn num_logit_rows(&self) -> usize {
        if self.every_row() {
            self.tokens.len()
        } else {
            usize::from(self.sample)
        }
    }

    /// The model returns a row for every token of the seq.
    pub fn every_row(&self) -> bool {
        self.all_logits || self.num_draft > 0
    }

    /// The draft tokens.
    pub fn draft(&self) -> &[u32] {
        &self.tokens[self.tokens.len() - self.num_draft..]
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

    /// Draft tokens of the step.
    pub fn num_draft(&self) -> usize {
        self.seqs.iter().map(|s| s.num_draft).sum()
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
    /// The tokens this step added (confirmed drafts, then the sampled
    /// one); empty when the step did not sample for this request.
    pub new_tokens: Vec<u32>,
    /// Set when the request ended in this step (its blocks are freed, or
    /// held for the connector).
    pub finished: Option<FinishReason>,
    /// The connector's parameters for the request's last output.
    pub kv_transfer_params: Option<KvTransferParams>,
    pub num_prompt_tokens: usize,
    pub num_cached_tokens: usize,
}
