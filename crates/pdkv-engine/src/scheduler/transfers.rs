//! What transfers hold and report: blocks held for finished requests, loads
//! that finished, failed or were given up, and the KV released ahead of a
//! cache reset.

use std::collections::HashMap;
use std::sync::Arc;

use super::request::{Request, Status};
use super::state::{FailedLoad, Scheduler};
use crate::connector::{LoadError, LoadFailurePolicy};
use crate::FinishReason;

impl Scheduler {
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
        if !finished.sending.is_empty() {
            self.reclaim_asked = false;
        }
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

    /// Takes a loading request off the loading list: `None` when it is not
    /// loading, else its load's error (if any).
    fn stop_loading(
        &mut self,
        id: &Arc<str>,
        errors: &HashMap<u32, LoadError>,
    ) -> Option<Option<LoadError>> {
        let req = self.requests.get(id)?;
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
        Some(error)
    }

    /// Ends a request whose load failed, under the `fail` policy.
    fn fail_load(&mut self, id: &Arc<str>, e: LoadError) -> Option<FailedLoad> {
        self.finish_request(id, FinishReason::Error);
        Some(FailedLoad {
            request_id: id.clone(),
            error: e.message,
            timed_out: e.timed_out,
        })
    }

    /// A loaded (or failed) request goes back to the front of the waiting
    /// queue, holding its blocks; the `fail` policy ends a failed one.
    fn end_load(
        &mut self,
        id: &Arc<str>,
        errors: &HashMap<u32, LoadError>,
        policy: LoadFailurePolicy,
    ) -> Option<FailedLoad> {
        let error = self.stop_loading(id, errors)?;
        let req = self.requests.get_mut(id).expect("a loading request exists");
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
                self.fail_load(id, e)
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
        let error = self
            .stop_loading(id, errors)?
            .unwrap_or_else(|| LoadError::failed("the KV load was given up"));
        self.requeue_from_scratch(id);
        if error.recompute || policy == LoadFailurePolicy::Recompute {
            tracing::warn!(id = %id, error = %error.message, "external KV load given up; recomputing the prompt");
            return None;
        }
        tracing::warn!(id = %id, error = %error.message, "external KV load given up; failing the request");
        self.fail_load(id, error)
    }
}
