//! The host-memory offload connector (`"kv_connector": "offload"`): a second
//! tier of prefix cache in ordinary host memory.
//!
//! When a request ends normally (stop or length) its full *prompt* blocks are
//! copied out of the KV cache into a store on the heap; when a later request
//! is admitted, the longest run of stored blocks that follows its local
//! prefix-cache hit is offered to the scheduler as a synchronous match and
//! copied back into the request's freshly allocated blocks by
//! [`start_load_kv`](KvConnector::start_load_kv), before the forward pass
//! that needs them.
//!
//! Invariants:
//! - A stored block is keyed by the [`BlockHash`] chain of the prompt up to
//!   the end of that block, and also keeps its parent key and its own tokens;
//!   a lookup serves it only when all three agree, so a hash collision can
//!   never load KV computed for different tokens.
//! - The store never holds more than `max_bytes` of block data: inserting
//!   evicts least recently used blocks first. A chain is touched from its
//!   last block to its first, so eviction trims chains from the tail and a
//!   stored prefix stays usable as long as possible.
//! - Data promised by a match is pinned (reference counted) from the match
//!   until it is copied, so an eviction in between cannot take it away: a
//!   synchronous match has no failure path.
//! - The store lives outside the engine's memory pool, so it survives a KV
//!   sleep (the connector holds no registration: release and restore are
//!   no-ops); the KV region is only read while it is mapped. The store is
//!   dropped by [`reset_cache`](KvConnector::reset_cache), which the engine
//!   calls when weights change or the prefix cache is reset with
//!   `reset_external` (vLLM's name; a reset without it leaves the store).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use pdkv_engine::connector::{
    Allocated, ConnectorMeta, ConnectorRequest, Ended, ExternalMatch, FinishedTransfers,
    KvCacheSpec, KvTransferParams, MetricsReader, Waker,
};
use pdkv_engine::{BlockHash, FinishReason, KvConnector};
use serde::Deserialize;
use serde_json::json;

use crate::config::{parse_fields, ConfigError, KvRole};

/// The connector name that selects this connector.
pub const CONNECTOR_NAME: &str = "offload";

/// Default store size: 1 GiB.
pub const DEFAULT_MAX_BYTES: u64 = 1 << 30;

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Raw {
    kv_connector: String,
    max_bytes: Option<u64>,
    /// Accepted for symmetry with the P/D connector; the offload connector
    /// both saves and loads whatever the role.
    #[allow(dead_code)]
    kv_role: Option<KvRole>,
}

/// A checked offload configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffloadConfig {
    /// Most bytes of block data the store holds.
    pub max_bytes: u64,
}

impl OffloadConfig {
    /// Parses and checks a configuration; the error names the bad field.
    pub fn parse(json: &str) -> Result<OffloadConfig, ConfigError> {
        let raw: Raw = parse_fields(json)?;
        if raw.kv_connector != CONNECTOR_NAME {
            return Err(ConfigError {
                field: "kv_connector".into(),
                message: format!("expected {CONNECTOR_NAME:?}, got {:?}", raw.kv_connector),
            });
        }
        let max_bytes = raw.max_bytes.unwrap_or(DEFAULT_MAX_BYTES);
        if max_bytes == 0 {
            return Err(ConfigError {
                field: "max_bytes".into(),
                message: "must be at least 1".into(),
            });
        }
        Ok(OffloadConfig { max_bytes })
    }
}

/// One stored block.
struct Entry {
    /// The key of the block before it (`None` for a prompt's first block).
    parent: Option<BlockHash>,
    tokens: Box<[u32]>,
    data: Arc<[u8]>,
    /// Position in the LRU order (larger: more recently used).
    tick: u64,
}

/// The block store: a map from chain key to block, plus an LRU order.
/// Pure data structure; the connector does the copying and the counting.
struct Store {
    entries: HashMap<BlockHash, Entry>,
    lru: BTreeMap<u64, BlockHash>,
    next_tick: u64,
    bytes: u64,
    max_bytes: u64,
}

impl Store {
    fn new(max_bytes: u64) -> Store {
        Store {
            entries: HashMap::new(),
            lru: BTreeMap::new(),
            next_tick: 0,
            bytes: 0,
            max_bytes,
        }
    }

    /// The block stored for `key`, if it really is the block of `tokens`
    /// following `parent`.
    fn get(&self, key: BlockHash, parent: Option<BlockHash>, tokens: &[u32]) -> Option<&Arc<[u8]>> {
        self.entries
            .get(&key)
            .filter(|e| e.parent == parent && *e.tokens == *tokens)
            .map(|e| &e.data)
    }

    /// Marks `key` most recently used.
    fn touch(&mut self, key: BlockHash) {
        if let Some(e) = self.entries.get_mut(&key) {
            self.lru.remove(&e.tick);
            e.tick = self.next_tick;
            self.next_tick += 1;
            self.lru.insert(e.tick, key);
        }
    }

    fn remove(&mut self, key: BlockHash) -> Option<Entry> {
        let e = self.entries.remove(&key)?;
        self.lru.remove(&e.tick);
        self.bytes -= e.data.len() as u64;
        Some(e)
    }

    /// Stores a block as the most recently used one, evicting the least
    /// recently used ones to stay within `max_bytes`. Returns whether it was
    /// stored (a block larger than the whole store is not) and how many
    /// blocks were evicted. An entry already under `key` is replaced.
    fn insert(
        &mut self,
        key: BlockHash,
        parent: Option<BlockHash>,
        tokens: &[u32],
        data: Arc<[u8]>,
    ) -> (bool, usize) {
        let len = data.len() as u64;
        if len > self.max_bytes {
            return (false, 0);
        }
        self.remove(key);
        let mut evicted = 0;
        while self.bytes + len > self.max_bytes {
            let (_, victim) = self
                .lru
                .pop_first()
                .expect("bytes held imply a stored block");
            let e = self
                .entries
                .remove(&victim)
                .expect("the LRU order lists stored blocks");
            self.bytes -= e.data.len() as u64;
            evicted += 1;
        }
        let tick = self.next_tick;
        self.next_tick += 1;
        self.lru.insert(tick, key);
        self.entries.insert(
            key,
            Entry {
                parent,
                tokens: tokens.into(),
                data,
                tick,
            },
        );
        self.bytes += len;
        (true, evicted)
    }

    fn clear(&mut self) {
        self.entries.clear();
        self.lru.clear();
        self.bytes = 0;
    }

    fn len(&self) -> usize {
        self.entries.len()
    }
}

/// Counters, readable from any thread.
#[derive(Default)]
struct Counters {
    block_bytes: AtomicU64,
    bytes_held: AtomicU64,
    blocks_held: AtomicU64,
    lookups: AtomicU64,
    lookup_misses: AtomicU64,
    hit_blocks: AtomicU64,
    bytes_loaded: AtomicU64,
    saved_blocks: AtomicU64,
    bytes_saved: AtomicU64,
    evicted_blocks: AtomicU64,
    resets: AtomicU64,
}

/// The copies decided in one step: destination block ← stored data.
struct OffloadMeta {
    loads: Vec<(u32, Arc<[u8]>)>,
}

/// See the module docs.
pub struct OffloadConnector {
    engine_id: String,
    config: OffloadConfig,
    store: Store,
    counters: Arc<Counters>,
    kv: Option<KvCacheSpec>,
    /// Data offered to a request by `get_num_new_matched_tokens`, in block
    /// order, until its blocks are allocated (or it ends).
    matched: HashMap<Arc<str>, Vec<Arc<[u8]>>>,
    /// Copies decided since the last `build_connector_meta`.
    pending: Vec<(u32, Arc<[u8]>)>,
}

impl OffloadConnector {
    pub fn new(config: OffloadConfig, engine_id: &str) -> OffloadConnector {
        OffloadConnector {
            engine_id: engine_id.to_string(),
            store: Store::new(config.max_bytes),
            config,
            counters: Arc::default(),
            kv: None,
            matched: HashMap::new(),
            pending: Vec::new(),
        }
    }

    fn publish_size(&self) {
        self.counters
            .bytes_held
            .store(self.store.bytes, Ordering::Relaxed);
        self.counters
            .blocks_held
            .store(self.store.len() as u64, Ordering::Relaxed);
    }

    /// Copies `req`'s full prompt blocks that are not stored yet out of the
    /// KV cache, last block first (see the module docs on LRU order).
    fn save(&mut self, req: ConnectorRequest<'_>, block_ids: &[u32]) {
        let Some(kv) = &self.kv else { return };
        if !kv.is_mapped() {
            tracing::warn!(id = %req.id, "KV cache released; request's blocks not offloaded");
            return;
        }
        let bs = kv.block_size;
        let full = (req.prompt_tokens.len() / bs).min(block_ids.len());
        let mut keys = Vec::with_capacity(full);
        BlockHash::extend_salted_chain(&mut keys, &req.prompt_tokens[..full * bs], req.cache_salt);
        let (mut saved, mut evicted) = (0u64, 0u64);
        for i in (0..full).rev() {
            let parent = i.checked_sub(1).map(|p| keys[p]);
            let tokens = &req.prompt_tokens[i * bs..(i + 1) * bs];
            if self.store.get(keys[i], parent, tokens).is_some() {
                self.store.touch(keys[i]);
                continue;
            }
            let mut data = vec![0u8; kv.block_bytes];
            if let Err(e) = kv.read_block(block_ids[i], &mut data) {
                tracing::error!(id = %req.id, block = block_ids[i], error = %e, "reading a KV block to offload failed");
                continue;
            }
            let (stored, ev) = self.store.insert(keys[i], parent, tokens, data.into());
            saved += stored as u64;
            evicted += ev as u64;
        }
        let c = &self.counters;
        c.saved_blocks.fetch_add(saved, Ordering::Relaxed);
        c.bytes_saved
            .fetch_add(saved * kv.block_bytes as u64, Ordering::Relaxed);
        c.evicted_blocks.fetch_add(evicted, Ordering::Relaxed);
        self.publish_size();
    }
}

impl KvConnector for OffloadConnector {
    fn name(&self) -> &str {
        CONNECTOR_NAME
    }

    /// Holds no registration of the KV cache, and its store is host memory
    /// that a sleep leaves alone.
    fn supports_sleep_mode(&self) -> bool {
        true
    }

    fn info(&self) -> serde_json::Value {
        json!({
            "kv_connector": CONNECTOR_NAME,
            "engine_id": self.engine_id,
            "max_bytes": self.config.max_bytes,
            "supports_sleep_mode": true,
        })
    }

    fn metrics_reader(&self) -> Option<MetricsReader> {
        let c = self.counters.clone();
        let max = self.config.max_bytes as f64;
        Some(Arc::new(move || {
            let get = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
            vec![
                (
                    "offload_bytes_held",
                    "KV bytes held in the host offload store",
                    get(&c.bytes_held),
                ),
                (
                    "offload_blocks_held",
                    "KV blocks held in the host offload store",
                    get(&c.blocks_held),
                ),
                (
                    "offload_max_bytes",
                    "Capacity of the host offload store in bytes",
                    max,
                ),
                (
                    "offload_block_bytes",
                    "Bytes of one KV block in the host offload store",
                    get(&c.block_bytes),
                ),
                (
                    "offload_lookups_total",
                    "Requests looked up in the host offload store",
                    get(&c.lookups),
                ),
                (
                    "offload_lookup_misses_total",
                    "Lookups that found no block to load",
                    get(&c.lookup_misses),
                ),
                (
                    "offload_hit_blocks_total",
                    "KV blocks loaded from the host offload store",
                    get(&c.hit_blocks),
                ),
                (
                    "offload_loaded_bytes_total",
                    "KV bytes loaded from the host offload store",
                    get(&c.bytes_loaded),
                ),
                (
                    "offload_saved_blocks_total",
                    "KV blocks saved to the host offload store",
                    get(&c.saved_blocks),
                ),
                (
                    "offload_saved_bytes_total",
                    "KV bytes saved to the host offload store",
                    get(&c.bytes_saved),
                ),
                (
                    "offload_evicted_blocks_total",
                    "KV blocks evicted from the host offload store",
                    get(&c.evicted_blocks),
                ),
                (
                    "offload_resets_total",
                    "Times the host offload store was emptied by a cache reset",
                    get(&c.resets),
                ),
            ]
        }))
    }

    /// Loads are synchronous: nothing to wake the core for.
    fn set_waker(&mut self, _waker: Waker) {}

    fn get_num_new_matched_tokens(
        &mut self,
        req: ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> ExternalMatch {
        let Some(kv) = &self.kv else {
            return ExternalMatch::default();
        };
        let bs = kv.block_size;
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        self.matched.remove(req.id);
        let first = num_computed_tokens / bs;
        // Whole blocks, and the last prompt token always left to compute.
        let room = req
            .prompt_tokens
            .len()
            .saturating_sub(1 + num_computed_tokens)
            / bs;
        let end = if num_computed_tokens.is_multiple_of(bs) {
            first + room
        } else {
            first
        };
        let mut keys = Vec::with_capacity(end);
        BlockHash::extend_salted_chain(&mut keys, &req.prompt_tokens[..end * bs], req.cache_salt);
        let mut found = Vec::new();
        for i in first..end {
            let parent = i.checked_sub(1).map(|p| keys[p]);
            match self
                .store
                .get(keys[i], parent, &req.prompt_tokens[i * bs..(i + 1) * bs])
            {
                Some(data) => found.push(data.clone()),
                None => break,
            }
        }
        if found.is_empty() {
            self.counters.lookup_misses.fetch_add(1, Ordering::Relaxed);
            return ExternalMatch::default();
        }
        for i in (first..first + found.len()).rev() {
            self.store.touch(keys[i]);
        }
        let num_tokens = found.len() * bs;
        self.matched.insert(req.id.clone(), found);
        ExternalMatch {
            num_tokens,
            load_async: false,
        }
    }

    fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, alloc: Allocated<'_>) {
        let Allocated {
            block_ids,
            num_computed_tokens,
            num_external_tokens,
        } = alloc;
        let Some(found) = self.matched.remove(req.id) else {
            return;
        };
        if num_external_tokens == 0 {
            return;
        }
        let Some(kv) = &self.kv else { return };
        let bs = kv.block_size;
        let first = num_computed_tokens / bs;
        let n = num_external_tokens / bs;
        if !num_external_tokens.is_multiple_of(bs) || n > found.len() || first + n > block_ids.len()
        {
            // The scheduler only trims a match to whole blocks it has room for.
            tracing::error!(id = %req.id, num_external_tokens, offered = found.len() * bs, blocks = block_ids.len(),
                "offload match does not fit the allocated blocks");
        }
        let n = n
            .min(found.len())
            .min(block_ids.len().saturating_sub(first));
        self.pending
            .extend(block_ids[first..first + n].iter().copied().zip(found));
    }

    fn build_connector_meta(&mut self) -> ConnectorMeta {
        ConnectorMeta(Box::new(OffloadMeta {
            loads: std::mem::take(&mut self.pending),
        }))
    }

    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<KvTransferParams>) {
        self.matched.remove(req.id);
        if matches!(end.reason, FinishReason::Stop | FinishReason::Length) {
            self.save(req, end.block_ids);
        }
        (false, None)
    }

    fn update_connector_output(&mut self, _finished: &FinishedTransfers) {}

    fn reset_cache(&mut self) -> bool {
        self.store.clear();
        self.matched.clear();
        self.counters.resets.fetch_add(1, Ordering::Relaxed);
        self.publish_size();
        true
    }

    fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()> {
        anyhow::ensure!(
            spec.block_size == pdkv_model::BLOCK_SIZE,
            "the offload connector keys blocks of {} tokens; the KV cache has blocks of {}",
            pdkv_model::BLOCK_SIZE,
            spec.block_size
        );
        for (i, r) in spec.ranks.iter().enumerate() {
            let bb = spec.rank_block_bytes(i);
            anyhow::ensure!(
                spec.num_blocks
                    .checked_mul(bb)
                    .is_some_and(|n| n <= r.region.len()),
                "rank {i}'s KV cache region ({} bytes) is smaller than {} blocks of {bb} bytes",
                r.region.len(),
                spec.num_blocks,
            );
        }
        self.counters
            .block_bytes
            .store(spec.block_bytes as u64, Ordering::Relaxed);
        self.kv = Some(spec.clone());
        Ok(())
    }

    fn start_load_kv(&mut self, meta: ConnectorMeta) {
        let Ok(meta) = meta.0.downcast::<OffloadMeta>() else {
            tracing::error!("the offload connector was handed another connector's metadata");
            return;
        };
        if meta.loads.is_empty() {
            return;
        }
        let Some(kv) = &self.kv else { return };
        if !kv.is_mapped() {
            // The core never steps while the KV cache is released.
            tracing::error!(
                blocks = meta.loads.len(),
                "KV cache released; offloaded blocks not loaded"
            );
            return;
        }
        let mut bytes = 0u64;
        for (block, data) in &meta.loads {
            match kv.write_block(*block, data) {
                Ok(()) => bytes += data.len() as u64,
                Err(e) => {
                    tracing::error!(block, error = %e, "loading an offloaded KV block failed")
                }
            }
        }
        self.counters
            .hit_blocks
            .fetch_add(meta.loads.len() as u64, Ordering::Relaxed);
        self.counters
            .bytes_loaded
            .fetch_add(bytes, Ordering::Relaxed);
    }

    fn get_finished(&mut self) -> FinishedTransfers {
        FinishedTransfers::default()
    }

    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, pdkv_engine::LoadError)> {
        Vec::new()
    }

    /// No registration to give up; the store stays.
    fn release_kv_caches(&mut self, _timeout: Duration) -> anyhow::Result<()> {
        Ok(())
    }

    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: u128) -> BlockHash {
        BlockHash(n)
    }

    fn data(len: usize, fill: u8) -> Arc<[u8]> {
        vec![fill; len].into()
    }

    /// An offload connector over a real 16-block KV region of `BB`-byte
    /// blocks, storing at most `max_blocks` blocks; block `b` holds bytes `b`.
    fn connector(max_blocks: u64) -> (OffloadConnector, Arc<pdkv_vmem::Region>) {
        const BB: usize = 256;
        let pool = pdkv_vmem::Pool::default();
        let region = pool.allocate(pdkv_vmem::Tag::KvCache, 16 * BB).unwrap();
        for b in 0..16u8 {
            region.write_bytes(b as usize * BB, &[b; BB]).unwrap();
        }
        let mut c = OffloadConnector::new(
            OffloadConfig {
                max_bytes: max_blocks * BB as u64,
            },
            "o1",
        );
        let spec = KvCacheSpec::single(region.clone(), 16, BB, pdkv_model::BLOCK_SIZE, "test");
        c.register_kv_caches(&spec).unwrap();
        (c, region)
    }

    fn counter(c: &OffloadConnector, name: &str) -> f64 {
        c.metrics_reader().unwrap()()
            .into_iter()
            .find(|m| m.0 == name)
            .unwrap()
            .2
    }

    /// `id` asks with `computed` tokens already local; returns the tokens
    /// offered and, once loaded into `blocks`, the first byte of each.
    fn lookup_and_load(
        c: &mut OffloadConnector,
        region: &pdkv_vmem::Region,
        id: &str,
        prompt: &[u32],
        computed: usize,
        blocks: &[u32],
    ) -> (usize, Vec<u8>) {
        let id: Arc<str> = id.into();
        let req = ConnectorRequest {
            cache_salt: None,
            id: &id,
            prompt_tokens: prompt,
            kv_transfer_params: None,
        };
        let m = c.get_num_new_matched_tokens(req, computed);
        c.update_state_after_alloc(req, Allocated::new(blocks, computed, m.num_tokens));
        let meta = c.build_connector_meta();
        c.start_load_kv(meta);
        let first = computed / pdkv_model::BLOCK_SIZE;
        let n = m.num_tokens / pdkv_model::BLOCK_SIZE;
        let bytes = blocks[first..first + n]
            .iter()
            .map(|&b| {
                let mut x = [0u8; 1];
                region.read_bytes(b as usize * 256, &mut x).unwrap();
                x[0]
            })
            .collect();
        (m.num_tokens, bytes)
    }

    #[test]
    fn saves_full_prompt_blocks_and_loads_the_ones_past_the_local_prefix() {
        let (mut c, region) = connector(4);
        assert_eq!(c.name(), "offload");
        // A 64-token prompt (4 full blocks) ends in blocks 0..4: all saved.
        let a: Vec<u32> = (100..164).collect();
        let id: Arc<str> = "a".into();
        c.request_finished(
            ConnectorRequest {
                cache_salt: None,
                id: &id,
                prompt_tokens: &a,
                kv_transfer_params: None,
            },
            Ended::new(&[0, 1, 2, 3], FinishReason::Length),
        );
        assert_eq!(counter(&c, "offload_saved_blocks_total"), 4.0);
        assert_eq!(counter(&c, "offload_saved_bytes_total"), 4.0 * 256.0);
        // The same prompt with its first block local: blocks 1 and 2 load
        // (block 3 holds the last token, which is always computed).
        let (tokens, got) = lookup_and_load(&mut c, &region, "b", &a, 16, &[8, 9, 10, 11]);
        assert_eq!((tokens, got), (32, vec![1, 2]));
        // Another prompt's two blocks evict the two least recently used:
        // blocks 3 and 0 (the lookup just used 1 and 2).
        let other: Vec<u32> = (300..332).collect();
        let id: Arc<str> = "c".into();
        c.request_finished(
            ConnectorRequest {
                cache_salt: None,
                id: &id,
                prompt_tokens: &other,
                kv_transfer_params: None,
            },
            Ended::new(&[4, 5], FinishReason::Stop),
        );
        assert_eq!(counter(&c, "offload_evicted_blocks_total"), 2.0);
        let (tokens, got) = lookup_and_load(&mut c, &region, "d", &a, 32, &[12, 13, 14, 15]);
        assert_eq!(
            (tokens, got),
            (16, vec![2]),
            "block 2 was used recently and stayed"
        );
        let (tokens, _) = lookup_and_load(&mut c, &region, "e", &a, 0, &[12, 13, 14, 15]);
        assert_eq!(tokens, 0, "block 0 was evicted");
    }

    #[test]
    fn field_errors_name_the_field_without_a_position() {
        let err = |json: &str| parse_fields::<Raw>(json).err().expect("refused");
        let missing = err(r#"{"max_bytes":1}"#);
        assert_eq!(missing.field, "kv_connector");
        assert_eq!(missing.message, "missing field `kv_connector`");
        let unknown = err(r#"{"kv_connector":"offload","extra":1}"#);
        assert_eq!(unknown.field, "extra");
        assert!(
            unknown.message.starts_with("unknown field `extra`"),
            "{}",
            unknown.message
        );
        let typed = err(r#"{"kv_connector":5}"#);
        assert_eq!(typed.field, "kv_connector");
        assert_eq!(
            typed.message,
            "invalid type: integer `5`, expected a string"
        );
    }

    #[test]
    fn config_defaults_and_errors_name_the_field() {
        let c = OffloadConfig::parse(r#"{"kv_connector":"offload"}"#).unwrap();
        assert_eq!(c.max_bytes, DEFAULT_MAX_BYTES);
        let c = OffloadConfig::parse(
            r#"{"kv_connector":"offload","max_bytes":4096,"kv_role":"kv_both"}"#,
        )
        .unwrap();
        assert_eq!(c.max_bytes, 4096);
        let e = OffloadConfig::parse(r#"{"kv_connector":"offload","max_byte":1}"#).unwrap_err();
        assert_eq!(e.field, "max_byte");
        let e = OffloadConfig::parse(r#"{"kv_connector":"offload","max_bytes":-1}"#).unwrap_err();
        assert_eq!(e.field, "max_bytes");
        let e = OffloadConfig::parse(r#"{"kv_connector":"offload","max_bytes":0}"#).unwrap_err();
        assert_eq!(e.field, "max_bytes");
        let e =
            OffloadConfig::parse(r#"{"kv_connector":"offload","kv_role":"sideways"}"#).unwrap_err();
        assert_eq!(e.field, "kv_role");
        assert!(
            e.to_string().starts_with("kv_transfer_config: kv_role: "),
            "{e}"
        );
    }

    #[test]
    fn a_block_is_served_only_for_its_parent_and_tokens() {
        let mut s = Store::new(1000);
        s.insert(key(1), None, &[1, 2], data(10, 7));
        s.insert(key(2), Some(key(1)), &[3, 4], data(10, 8));
        assert_eq!(s.get(key(1), None, &[1, 2]).unwrap()[0], 7);
        assert!(
            s.get(key(1), None, &[1, 3]).is_none(),
            "other tokens under a colliding key"
        );
        assert!(
            s.get(key(2), Some(key(9)), &[3, 4]).is_none(),
            "another parent under a colliding key"
        );
        assert!(s.get(key(2), None, &[3, 4]).is_none());
        assert_eq!(s.get(key(2), Some(key(1)), &[3, 4]).unwrap()[0], 8);
    }

    #[test]
    fn eviction_is_lru_and_keeps_bytes_under_the_limit() {
        let mut s = Store::new(30);
        for k in 1..=3 {
            assert_eq!(
                s.insert(key(k), None, &[k as u32], data(10, k as u8)),
                (true, 0)
            );
        }
        s.touch(key(1));
        // Key 2 is now the least recently used.
        assert_eq!(s.insert(key(4), None, &[4], data(10, 4)), (true, 1));
        assert!(s.get(key(2), None, &[2]).is_none());
        assert!(s.get(key(1), None, &[1]).is_some() && s.get(key(3), None, &[3]).is_some());
        assert_eq!(s.bytes, 30);
        // A bigger block evicts as many as needed; one over the limit is refused.
        assert_eq!(s.insert(key(5), None, &[5], data(25, 5)), (true, 3));
        assert_eq!((s.bytes, s.len()), (25, 1));
        assert_eq!(s.insert(key(6), None, &[6], data(31, 6)), (false, 0));
        assert_eq!((s.bytes, s.len()), (25, 1));
        // Replacing a key does not count it twice.
        assert_eq!(s.insert(key(5), None, &[5], data(20, 9)), (true, 0));
        assert_eq!((s.bytes, s.len()), (20, 1));
        s.clear();
        assert_eq!((s.bytes, s.len(), s.lru.len()), (0, 0, 0));
    }

    #[test]
    fn pinned_data_outlives_eviction() {
        let mut s = Store::new(10);
        s.insert(key(1), None, &[1], data(10, 1));
        let pinned = s.get(key(1), None, &[1]).unwrap().clone();
        s.insert(key(2), None, &[2], data(10, 2));
        assert!(s.get(key(1), None, &[1]).is_none());
        assert_eq!(&pinned[..], &[1u8; 10][..]);
    }
}
