//! Planning a step ([`Scheduler::schedule`]) and applying its results
//! ([`Scheduler::update_from_output`]).

use std::sync::Arc;

use super::plan::{ScheduledSeq, SchedulerOutput, SeqUpdate};
use super::request::{Request, Status};
use super::state::Scheduler;
use crate::block_pool::{blocks_for, BlockHash, BlockPool};
use crate::connector::{Allocated, ExternalMatch};
use crate::FinishReason;

/// What an attempt to admit the head of the waiting queue came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Admit {
    /// It was admitted (running, or parked for its load), or blocks were
    /// freed for another try: admission goes on.
    Next,
    /// It cannot get its blocks: the step admits nothing more.
    Stop,
}

impl Scheduler {
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

    pub(super) fn preempt(&mut self, id: Arc<str>) {
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
        Self::seq_with_draft(req, num_new, Vec::new())
    }

    /// [`Self::seq_for`] with `draft` tokens after the request's known ones
    /// (`num_new` reaches its last token).
    fn seq_with_draft(req: &Request, num_new: usize, draft: Vec<u32>) -> ScheduledSeq {
        let start = req.num_computed_tokens;
        let end = start + num_new;
        let mut tokens = req.tokens[start..end].to_vec();
        let num_draft = draft.len();
        tokens.extend(draft);
        ScheduledSeq {
            request_id: req.id.clone(),
            tokens,
            start_pos: start,
            block_table: req.blocks[..blocks_for(end + num_draft)].to_vec(),
            sample: end == req.tokens.len(),
            output_index: req.num_output_tokens(),
            all_logits: req.wants_all_logits(),
            num_draft,
        }
    }

    /// The draft a running request proposes this step: only when it
    /// decodes (its one uncomputed token is its latest output), within the
    /// step's `budget` (its own token included) and its `max_tokens`.
    fn draft_for(&self, req: &Request, budget: usize) -> Vec<u32> {
        let Some(spec) = self.config.speculative else {
            return Vec::new();
        };
        if req.tokens.len() - req.num_computed_tokens != 1 || req.num_output_tokens() == 0 {
            return Vec::new();
        }
        let room = req
            .max_tokens
            .saturating_sub(req.num_output_tokens() + 1)
            .min(budget.saturating_sub(1));
        spec.propose(&req.tokens, room)
    }

    /// Plans one step. Blocks for the planned tokens are allocated here; the
    /// step's results must be reported with [`Scheduler::update_from_output`]
    /// before the next call.
    pub fn schedule(&mut self) -> SchedulerOutput {
        let mut out = SchedulerOutput::default();
        let mut budget = self.config.max_num_batched_tokens;

        // 1. Running requests, oldest first.
        self.schedule_running(&mut out, &mut budget);

        // 2. Waiting requests, FCFS; none in a step that preempted.
        if out.preempted.is_empty() {
            self.admit_waiting(&mut out, &mut budget);
        }
        out
    }

    /// Step 1: each running request, oldest first, computes its next token
    /// or the next chunk that fits the budget. When blocks run out the most
    /// recently admitted running request is preempted; when that is the
    /// request at hand, the pass ends.
    fn schedule_running(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 && out.seqs.len() < self.config.max_num_seqs {
            let id = self.running[i].clone();
            let req = self.requests.get(&id).expect("running request exists");
            let num_new = (req.tokens.len() - req.num_computed_tokens).min(*budget);
            debug_assert!(
                num_new > 0,
                "a running request always has a token to compute"
            );
            let draft = self.draft_for(req, *budget);
            let target = req.num_computed_tokens + num_new + draft.len();
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
            *budget -= num_new + draft.len();
            out.seqs.push(Self::seq_with_draft(req, num_new, draft));
            i += 1;
        }
    }

    /// Step 2: the waiting queue's head is admitted, again and again, while
    /// the budget, `max_num_seqs` and the free blocks allow.
    fn admit_waiting(&mut self, out: &mut SchedulerOutput, budget: &mut usize) {
        while *budget > 0
            && self.running.len() < self.config.max_num_seqs
            && out.seqs.len() < self.config.max_num_seqs
        {
            let Some(id) = self.waiting.front().cloned() else {
                break;
            };
            let req = self.requests.get(&id).expect("waiting request exists");
            let next = if !req.blocks.is_empty() {
                // Its external KV landed (or failed and is recomputed):
                // it holds blocks for its computed tokens already.
                self.admit_loaded(&id, out, budget)
            } else {
                self.admit_new(&id, out, budget)
            };
            if next == Admit::Stop {
                break;
            }
        }
    }

    /// The head holds blocks for its computed tokens: it runs with blocks
    /// for its next chunk.
    fn admit_loaded(
        &mut self,
        id: &Arc<str>,
        out: &mut SchedulerOutput,
        budget: &mut usize,
    ) -> Admit {
        let req = self.requests.get(id).expect("waiting request exists");
        let num_new = (req.tokens.len() - req.num_computed_tokens).min(*budget);
        let target = req.num_computed_tokens + num_new;
        let need = blocks_for(target).saturating_sub(req.blocks.len());
        if need > self.pool.num_free() {
            return self.unjam_or_stop(id, need - self.pool.num_free());
        }
        let fresh = self.pool.allocate(need).expect("counted above");
        let req = self.requests.get_mut(id).expect("waiting request exists");
        req.blocks.extend(fresh);
        req.status = Status::Running;
        self.waiting.pop_front();
        self.running.push(id.clone());
        out.seqs.push(Self::seq_for(&self.requests[id], num_new));
        *budget -= num_new;
        Admit::Next
    }

    /// The head holds nothing: the prefix cache serves what it can, the
    /// connector (consulted once) offers external KV, and the request parks
    /// for an asynchronous load or runs.
    fn admit_new(&mut self, id: &Arc<str>, out: &mut SchedulerOutput, budget: &mut usize) -> Admit {
        let req = self.requests.get_mut(id).expect("waiting request exists");
        debug_assert!(req.num_computed_tokens == 0);
        if self.pool.caching_enabled() {
            BlockHash::extend_salted_chain(&mut req.block_hashes, &req.tokens, req.cache_salt);
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
            return self.park_for_load(id, hit, num_hit_tokens, ext);
        }
        self.start_running(id, hit, num_hit_tokens, ext, out, budget)
    }

    /// Parks the head, waiting for remote KV, with blocks for the hit and
    /// the external tokens.
    fn park_for_load(
        &mut self,
        id: &Arc<str>,
        hit: Vec<u32>,
        num_hit_tokens: usize,
        ext: ExternalMatch,
    ) -> Admit {
        let req = self.requests.get_mut(id).expect("waiting request exists");
        let need = blocks_for(num_hit_tokens + ext.num_tokens) - hit.len();
        let available = self.pool.num_free() - self.pool.count_free(&hit);
        if need > available {
            // Ask again once blocks are free.
            req.connector_consulted = false;
            return self.unjam_or_stop(id, need - available);
        }
        self.pool.touch(&hit);
        self.pool.record_lookup(req.tokens.len(), num_hit_tokens);
        let fresh = self.pool.allocate(need).expect("counted above");
        let req = self.requests.get_mut(id).expect("waiting request exists");
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
            Allocated {
                block_ids: &req.blocks,
                num_computed_tokens: num_hit_tokens,
                num_external_tokens: ext.num_tokens,
            },
        );
        Admit::Next
    }

    /// The head runs: KV the connector provides synchronously counts as
    /// computed (it is in place before this step's forward pass).
    fn start_running(
        &mut self,
        id: &Arc<str>,
        hit: Vec<u32>,
        num_hit_tokens: usize,
        ext: ExternalMatch,
        out: &mut SchedulerOutput,
        budget: &mut usize,
    ) -> Admit {
        let req = self.requests.get(id).expect("waiting request exists");
        let num_hit_tokens = num_hit_tokens + ext.num_tokens;
        let num_new = (req.tokens.len() - num_hit_tokens).min(*budget);
        let need = blocks_for(num_hit_tokens + num_new) - hit.len();
        let available = self.pool.num_free() - self.pool.count_free(&hit);
        if need > available {
            return self.unjam_or_stop(id, need - available);
        }
        self.pool.touch(&hit);
        self.pool
            .record_lookup(req.tokens.len(), num_hit_tokens - ext.num_tokens);
        let fresh = self.pool.allocate(need).expect("counted above");
        let req = self.requests.get_mut(id).expect("waiting request exists");
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
                Allocated {
                    block_ids: &req.blocks,
                    num_computed_tokens: num_hit_tokens - ext.num_tokens,
                    num_external_tokens: ext.num_tokens,
                },
            );
        }
        out.seqs.push(Self::seq_for(&self.requests[id], num_new));
        *budget -= num_new;
        Admit::Next
    }

    /// The head is `short` blocks short: it is tried again when
    /// [`Self::unjam`] freed some; otherwise the step admits nothing more,
    /// and transfers that hold finished requests' blocks give some back
    /// ([`Self::reclaim_held`]).
    fn unjam_or_stop(&mut self, head: &Arc<str>, short: usize) -> Admit {
        if self.unjam(head) {
            Admit::Next
        } else {
            self.reclaim_held(short);
            Admit::Stop
        }
    }

    /// Nothing runs, and blocks held for transfers (a prefill engine's
    /// finished prompts no decode engine took yet) are what keeps the head
    /// out: the connector gives back at least `short` of them if it can
    /// (they come back through [`Self::update_from_connector`]). Asked once
    /// until some came back. While something runs the engine makes
    /// progress, and the decode engines may take their KV meanwhile.
    fn reclaim_held(&mut self, short: usize) {
        if self.reclaim_asked || self.held.is_empty() || !self.running.is_empty() {
            return;
        }
        let Some(c) = self.connector.as_deref_mut() else {
            return;
        };
        let n = c.reclaim_held_blocks(short);
        if n > 0 {
            self.reclaim_asked = true;
            tracing::info!(
                short,
                reclaimed = n,
                "blocks held for decode engines given back: new prompts needed them"
            );
        }
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
        let kept: Vec<&[u32]> = sampled.iter().map(|t| t.as_slice()).collect();
        self.update_from_tokens(output, &kept)
    }

    /// [`Self::update_from_output`] for steps with drafts: `kept[i]` is what
    /// the step added to `output.seqs[i]`'s request, the drafts the sampler
    /// confirmed (a prefix of the seq's draft) then the token it sampled
    /// (empty exactly when the seq did not sample). The positions of the
    /// drafts it did not confirm do not count as computed. A stop token or
    /// `max_tokens` ends the request at that token; what follows is dropped.
    pub fn update_from_tokens(
        &mut self,
        output: &SchedulerOutput,
        kept: &[&[u32]],
    ) -> Vec<SeqUpdate> {
        assert_eq!(
            output.seqs.len(),
            kept.len(),
            "one sample slot per scheduled seq"
        );
        let mut updates = Vec::new();
        for (seq, &toks) in output.seqs.iter().zip(kept) {
            let Some(req) = self.requests.get_mut(&seq.request_id) else {
                continue;
            };
            debug_assert_eq!(
                req.num_computed_tokens, seq.start_pos,
                "step results applied out of order"
            );
            assert_eq!(
                seq.sample,
                !toks.is_empty(),
                "a sampling seq has sampled tokens, another none"
            );
            assert!(
                toks.len() <= seq.num_draft + 1
                    && seq
                        .draft()
                        .starts_with(&toks[..toks.len().saturating_sub(1)]),
                "kept tokens are confirmed drafts and one sampled token"
            );
            let mut new_tokens = Vec::with_capacity(toks.len());
            let mut finished = None;
            for &t in toks {
                req.tokens.push(t);
                new_tokens.push(t);
                if req.stop_token_ids.contains(&t) {
                    finished = Some(FinishReason::Stop);
                } else if req.num_output_tokens() >= req.max_tokens {
                    finished = Some(FinishReason::Length);
                }
                if finished.is_some() {
                    break;
                }
            }
            // The seq's own tokens and the drafts it kept (each the input
            // of a position computed now) have their KV written.
            let confirmed = new_tokens.len().saturating_sub(1).min(seq.num_draft);
            req.num_computed_tokens = seq.start_pos + seq.tokens.len() - seq.num_draft + confirmed;
            // Offer newly completed blocks to the prefix cache.
            if self.pool.caching_enabled() {
                let full = req.num_computed_tokens / pdkv_model::BLOCK_SIZE;
                BlockHash::extend_salted_chain(
                    &mut req.block_hashes,
                    &req.tokens[..full * pdkv_model::BLOCK_SIZE],
                    req.cache_salt,
                );
                for b in req.num_cached_blocks..full {
                    self.pool.cache_block(req.blocks[b], req.block_hashes[b]);
                }
                req.num_cached_blocks = req.num_cached_blocks.max(full);
            }
            let mut update = SeqUpdate {
                request_id: seq.request_id.clone(),
                new_tokens,
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
}
