//! The KV connector API: how an engine exchanges KV blocks with the world
//! outside its own cache (a prefill engine's KV read by a decode engine, a
//! host-memory offload tier).
//!
//! One object implements both sides and both run on the engine core thread,
//! so the methods must not block (a connector does its I/O on its own
//! threads and reports back through [`KvConnector::get_finished`], calling the
//! [`Waker`] it was given whenever it has news for the core).
//!
//! **Scheduler side** (called by [`crate::Scheduler`]):
//! [`get_num_new_matched_tokens`](KvConnector::get_num_new_matched_tokens)
//! when a request is admitted, [`update_state_after_alloc`](KvConnector::update_state_after_alloc)
//! once its blocks exist, [`build_connector_meta`](KvConnector::build_connector_meta)
//! once per step, [`request_finished`](KvConnector::request_finished) when a
//! request ends (the connector may keep its blocks: *delayed free*),
//! [`update_connector_output`](KvConnector::update_connector_output),
//! [`reset_cache`](KvConnector::reset_cache) and
//! [`abort_transfers`](KvConnector::abort_transfers).
//!
//! **Worker side** (called by the engine core around the forward pass):
//! [`register_kv_caches`](KvConnector::register_kv_caches) once at start,
//! [`start_load_kv`](KvConnector::start_load_kv) before a step,
//! [`wait_for_save`](KvConnector::wait_for_save) after it,
//! [`get_finished`](KvConnector::get_finished) and
//! [`get_block_ids_with_load_errors`](KvConnector::get_block_ids_with_load_errors)
//! every loop turn, [`release_kv_caches`](KvConnector::release_kv_caches)
//! before the KV cache is unmapped and
//! [`restore_kv_caches`](KvConnector::restore_kv_caches) after it is mapped again.
//!
//! Contract on blocks: a block id handed to the connector (by
//! `update_state_after_alloc` or `request_finished` with delayed free) stays
//! allocated to that request until the connector names the request in
//! `get_finished` (sending side: nothing reads the blocks any more; receiving
//! side: nothing writes them any more). The engine never frees such a block
//! earlier, and never hands it to another request while it is held.
//!
//! `kv_transfer_params` are opaque JSON to the engine: it carries them from
//! the request to the connector and from the connector to the request's last
//! output, and never interprets them.

use std::sync::Arc;
use std::time::Duration;

use crate::FinishReason;

/// Opaque per-request parameters a connector reads and returns.
pub type KvTransferParams = serde_json::Value;

/// Called by a connector (from any thread) when it has something for the
/// core: a finished send or load, a load error. Cheap and non-blocking.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

/// Checks a request's `kv_transfer_params` on the caller's thread when it
/// is added (an `Err` names the problem; the request is refused).
pub type ParamsValidator =
    Arc<dyn Fn(Option<&KvTransferParams>) -> Result<(), String> + Send + Sync>;

/// Reads a connector's counters from any thread: `(name, help, value)`
/// triples, exported as Prometheus metrics `pdkv_kv_<name>`. Names ending
/// in `_total` are counters, others gauges.
pub type MetricsReader = Arc<dyn Fn() -> Vec<(&'static str, &'static str, f64)> + Send + Sync>;

/// What to do with a request whose external KV failed to load.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LoadFailurePolicy {
    /// End the request with an error naming the failure.
    #[default]
    Fail,
    /// Drop the external tokens and compute them locally.
    Recompute,
}

/// A request as a connector sees it.
#[derive(Clone, Copy, Debug)]
pub struct ConnectorRequest<'a> {
    pub id: &'a Arc<str>,
    pub prompt_tokens: &'a [u32],
    pub kv_transfer_params: Option<&'a KvTransferParams>,
    /// The request's cache salt: a connector that keys KV by the prompt's
    /// hash chain salts the chain with it ([`crate::block_pool::BlockHash::extend_salted_chain`]).
    pub cache_salt: Option<crate::block_pool::BlockHash>,
}

/// What [`KvConnector::update_state_after_alloc`] learns of a request's
/// blocks: `block_ids` is its whole table, whose blocks
/// `num_computed_tokens / block_size ..` receive the `num_external_tokens`
/// external tokens (none when 0).
#[derive(Clone, Copy, Debug)]
pub struct Allocated<'a> {
    pub block_ids: &'a [u32],
    pub num_computed_tokens: usize,
    pub num_external_tokens: usize,
}

impl<'a> Allocated<'a> {
    pub fn new(
        block_ids: &'a [u32],
        num_computed_tokens: usize,
        num_external_tokens: usize,
    ) -> Self {
        Allocated {
            block_ids,
            num_computed_tokens,
            num_external_tokens,
        }
    }
}

/// How a request ended, for [`KvConnector::request_finished`]: the blocks
/// it holds and why it ended.
#[derive(Clone, Copy, Debug)]
pub struct Ended<'a> {
    pub block_ids: &'a [u32],
    pub reason: FinishReason,
}

impl<'a> Ended<'a> {
    pub fn new(block_ids: &'a [u32], reason: FinishReason) -> Self {
        Ended { block_ids, reason }
    }
}

/// The answer of [`KvConnector::get_num_new_matched_tokens`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExternalMatch {
    /// Tokens beyond the locally computed ones whose KV the connector can
    /// provide (0: none).
    pub num_tokens: usize,
    /// The KV arrives asynchronously: the request waits (holding its blocks)
    /// until the connector reports the load in `get_finished`.
    pub load_async: bool,
}

/// What the scheduler decided this step, for the worker side. Opaque to the
/// engine; each connector puts its own type in it.
pub struct ConnectorMeta(pub Box<dyn std::any::Any + Send>);

impl ConnectorMeta {
    pub fn empty() -> ConnectorMeta {
        ConnectorMeta(Box::new(()))
    }
}

/// Requests whose transfers ended since the last call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FinishedTransfers {
    /// Requests (finished, blocks held) whose KV no one reads any more: their
    /// blocks may be freed.
    pub sending: Vec<Arc<str>>,
    /// Requests whose load ended (successfully or not: see
    /// [`KvConnector::get_block_ids_with_load_errors`]); nothing writes their
    /// blocks any more.
    pub recving: Vec<Arc<str>>,
    /// Requests whose load the connector gave up (its errors come with it)
    /// while the transfer may still write into its blocks: the request
    /// fails or recomputes *now*, on fresh blocks, and the load's blocks
    /// stay held until the request is named in `recving`.
    pub abandoned: Vec<Arc<str>>,
}

impl FinishedTransfers {
    pub fn is_empty(&self) -> bool {
        self.sending.is_empty() && self.recving.is_empty() && self.abandoned.is_empty()
    }
}

/// Why a block's load failed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadError {
    pub message: String,
    /// The load was ended on purpose (the producer's lifecycle released the
    /// KV, a cache reset cut it short): the request recomputes whatever the
    /// `kv_load_failure_policy`.
    pub recompute: bool,
    /// A deadline passed (the message names the setting to raise).
    pub timed_out: bool,
}

impl LoadError {
    /// A failure the policy decides about.
    pub fn failed(message: impl Into<String>) -> LoadError {
        LoadError {
            message: message.into(),
            recompute: false,
            timed_out: false,
        }
    }

    /// A deadline passed: a failure the policy decides about, which HTTP
    /// answers with 504.
    pub fn timed_out(message: impl Into<String>) -> LoadError {
        LoadError {
            message: message.into(),
            recompute: false,
            timed_out: true,
        }
    }

    /// An end on purpose: the request recomputes.
    pub fn recompute(message: impl Into<String>) -> LoadError {
        LoadError {
            message: message.into(),
            recompute: true,
            timed_out: false,
        }
    }
}

/// What the engine tells a connector about its KV cache.
///
/// The cache is one region per tensor-parallel rank. Every rank has the same
/// block ids; block `b` of rank `r` is the range `b * r.block_bytes(..)` of
/// its region and holds that rank's KV heads, head-major, so the whole
/// model's block is the ranks' blocks one after the other.
#[derive(Clone)]
pub struct KvCacheSpec {
    /// The ranks in head order: their `heads` ranges cover
    /// `0..num_kv_heads` without gap or overlap.
    pub ranks: Vec<KvRank>,
    pub num_blocks: usize,
    /// Bytes of the whole model's block (every rank's part of it).
    pub block_bytes: usize,
    /// The KV heads of the whole model; one head's part of a block is
    /// `block_bytes / num_kv_heads` bytes.
    pub num_kv_heads: usize,
    /// Tokens per block.
    pub block_size: usize,
    /// Identifies the whole model's KV layout; peers must agree on it.
    pub layout: String,
}

/// One tensor-parallel rank's KV cache.
#[derive(Clone)]
pub struct KvRank {
    /// The rank's `kv_cache` region.
    pub region: Arc<pdkv_vmem::Region>,
    /// The KV heads its blocks hold.
    pub heads: std::ops::Range<usize>,
}

impl KvCacheSpec {
    /// A KV cache of one rank holding every head (in one region).
    pub fn single(
        region: Arc<pdkv_vmem::Region>,
        num_blocks: usize,
        block_bytes: usize,
        block_size: usize,
        layout: impl Into<String>,
    ) -> KvCacheSpec {
        KvCacheSpec {
            ranks: vec![KvRank {
                region,
                heads: 0..1,
            }],
            num_blocks,
            block_bytes,
            num_kv_heads: 1,
            block_size,
            layout: layout.into(),
        }
    }

    /// Bytes of one head's part of a block.
    pub fn head_bytes(&self) -> usize {
        self.block_bytes / self.num_kv_heads
    }

    /// Bytes of rank `r`'s block.
    pub fn rank_block_bytes(&self, r: usize) -> usize {
        self.ranks[r].heads.len() * self.head_bytes()
    }

    fn check_block_len(&self, len: usize) -> pdkv_vmem::Result<()> {
        if len == self.block_bytes {
            return Ok(());
        }
        Err(pdkv_vmem::VmemError::OutOfBounds {
            offset: 0,
            len,
            region_len: self.block_bytes,
        })
    }

    /// Whether every rank's region is mapped (none is asleep).
    pub fn is_mapped(&self) -> bool {
        self.ranks.iter().all(|r| r.region.is_mapped())
    }

    /// Copies the whole model's block `b` into `dst` (`block_bytes` long):
    /// every rank's part at its heads' place.
    pub fn read_block(&self, b: u32, dst: &mut [u8]) -> pdkv_vmem::Result<()> {
        self.check_block_len(dst.len())?;
        let hb = self.head_bytes();
        for (i, r) in self.ranks.iter().enumerate() {
            let len = self.rank_block_bytes(i);
            let at = r.heads.start * hb;
            r.region
                .read_bytes(b as usize * len, &mut dst[at..at + len])?;
        }
        Ok(())
    }

    /// Writes the whole model's block `b` from `src`, each rank its part.
    pub fn write_block(&self, b: u32, src: &[u8]) -> pdkv_vmem::Result<()> {
        self.check_block_len(src.len())?;
        let hb = self.head_bytes();
        for (i, r) in self.ranks.iter().enumerate() {
            let len = self.rank_block_bytes(i);
            let at = r.heads.start * hb;
            r.region.write_bytes(b as usize * len, &src[at..at + len])?;
        }
        Ok(())
    }
}

/// A KV connector; see the module docs for the calling protocol.
pub trait KvConnector: Send {
    /// The connector's name, for logs and errors.
    fn name(&self) -> &str;

    /// Whether this connector can give up its registrations before the KV
    /// cache is unmapped and register it again after (sleep mode needs it).
    fn supports_sleep_mode(&self) -> bool;

    /// Static facts for operators and proxies (engine id, role, addresses).
    fn info(&self) -> serde_json::Value;

    /// Checks a request's `kv_transfer_params` when it is added, so a
    /// malformed one is refused at once (an `Err` names the problem).
    fn validate_params(&self, _params: Option<&KvTransferParams>) -> Result<(), String> {
        Ok(())
    }

    /// The check of [`KvConnector::validate_params`] as a function the
    /// engine calls on the caller's thread, before the request reaches the
    /// core (the default accepts everything).
    fn params_validator(&self) -> ParamsValidator {
        Arc::new(|_| Ok(()))
    }

    /// The connector's counters (transfers by outcome, bytes, time spent
    /// loading and sending), readable from any thread.
    fn metrics_reader(&self) -> Option<MetricsReader> {
        None
    }

    /// Called once, before any other call, with the engine's waker.
    fn set_waker(&mut self, waker: Waker);

    /// What to do when a load fails.
    fn load_failure_policy(&self) -> LoadFailurePolicy {
        LoadFailurePolicy::Fail
    }

    /// The weights the engine serves from now on (its `update_weights`
    /// version; `None` for the weights it started with). A connector that
    /// moves KV between engines refuses KV computed with other weights.
    fn set_weights_version(&mut self, _version: Option<&str>) {}

    // ---- scheduler side ----

    /// A request was queued (before any admission): a connector that
    /// serves other engines' pulls learns of it now, so a pull that arrives
    /// while the request waits its turn is not mistaken for an unknown one.
    fn request_added(&mut self, _req: ConnectorRequest<'_>) {}

    /// How many tokens beyond `num_computed_tokens` (already in the local
    /// cache) the connector can provide for `req`, and whether they arrive
    /// asynchronously. Never more than `prompt_tokens.len() - 1 -
    /// num_computed_tokens`: the last prompt token is always computed locally
    /// (its logits are needed).
    fn get_num_new_matched_tokens(
        &mut self,
        req: ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> ExternalMatch;

    /// The request's blocks exist now ([`Allocated`] says which receive
    /// external KV).
    fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, alloc: Allocated<'_>);

    /// Collects this step's decisions for the worker side.
    fn build_connector_meta(&mut self) -> ConnectorMeta;

    /// `req` ended with `reason` holding `block_ids`. Returns whether the
    /// connector keeps the blocks (freed once `get_finished` names the
    /// request) and the `kv_transfer_params` for the request's last output.
    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<KvTransferParams>);

    /// The scheduler applied these finished transfers.
    fn update_connector_output(&mut self, _finished: &FinishedTransfers) {}

    /// The prefix cache is being reset: drop whatever the connector caches
    /// about block contents. Returns false if it cannot now.
    fn reset_cache(&mut self) -> bool {
        true
    }

    /// Stop holding finished requests' KV for remote readers and end remote
    /// loads in flight; the requests concerned are reported by
    /// `get_finished` as the transfers give their blocks back.
    fn abort_transfers(&mut self) {}

    /// Blocks held for transfers right now (sending and receiving).
    fn num_held_blocks(&self) -> usize {
        0
    }

    /// The engine cannot admit a new request: it is `blocks` short, and
    /// transfers hold finished requests' blocks. A connector that can end
    /// some of its sends early does (they come back through `get_finished`);
    /// returns how many blocks will come back.
    fn reclaim_held_blocks(&mut self, _blocks: usize) -> usize {
        0
    }

    // ---- worker side ----

    /// The engine's KV cache, once, at start.
    fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()>;

    /// Starts the loads decided in `meta`.
    fn start_load_kv(&mut self, meta: ConnectorMeta);

    /// Called after a forward pass (a connector that saves KV as it is
    /// computed finishes that here).
    fn wait_for_save(&mut self) {}

    /// Transfers that ended since the last call.
    fn get_finished(&mut self) -> FinishedTransfers;

    /// Blocks whose load failed since the last call (each belongs to a
    /// request reported in `get_finished().recving` or `.abandoned` in the
    /// same or an earlier call), with the reason.
    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, LoadError)>;

    /// Gives up the registrations of the KV cache before it is unmapped.
    /// The engine calls it only once no transfer holds blocks; a connector
    /// that still has transfers in flight refuses (`Err`, naming them) and
    /// changes nothing. `timeout` bounds waiting for peers to acknowledge.
    /// On `Err` the registrations are in place as before (a retry may
    /// succeed) — or, when a connector of several ranks could not put them
    /// back either, given up on every rank (never some ranks registered
    /// and others not); the engine, which stays awake, then calls
    /// [`restore_kv_caches`](KvConnector::restore_kv_caches) once more.
    /// Idempotent.
    fn release_kv_caches(&mut self, _timeout: Duration) -> anyhow::Result<()> {
        anyhow::bail!(
            "connector {} cannot release its KV cache registrations",
            self.name()
        )
    }

    /// Registers the KV cache again (a new epoch) after it was mapped again.
    /// Idempotent.
    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        anyhow::bail!(
            "connector {} cannot restore its KV cache registrations",
            self.name()
        )
    }
}
