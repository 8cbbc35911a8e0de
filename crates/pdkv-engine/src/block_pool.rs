//! The KV block pool: reference-counted block ids, an LRU free list and the
//! prefix cache.
//!
//! Pure bookkeeping: this module never touches KV memory, threads or clocks.
//!
//! Invariants (checked by [`BlockPool::check_invariants`]):
//! - a block is in the free list exactly when its reference count is 0;
//! - the free list is ordered by release time: allocation takes the block
//!   released longest ago (least recently used) first;
//! - every entry `hash -> id` of the cache map names a block whose own hash
//!   is `hash`, and every block that carries a hash is in the map;
//! - a block carries a hash only once all of its [`BLOCK_SIZE`] tokens have
//!   been written, so a cache hit always reads complete KV;
//! - a freed block keeps its hash (its KV stays valid) until it is handed out
//!   again by [`BlockPool::allocate`] or [`BlockPool::reset_prefix_cache`]
//!   drops every hash.
//!
//! Releasing a block that is already free is a bug in the caller and panics:
//! a reference count never saturates.

use std::collections::{BTreeMap, HashMap};

use pdkv_model::BLOCK_SIZE;

/// A 128-bit hash identifying a full block *and everything before it*: the
/// hash of block `i` covers the parent hash (block `i - 1`) and the block's
/// own [`BLOCK_SIZE`] token ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BlockHash(pub u128);

const FNV128_OFFSET: u128 = 0x6c62272e07bb014262b821756295c58d;
const FNV128_PRIME: u128 = 0x0000000001000000000000000000013B;

impl BlockHash {
    /// The hash of a full block of `tokens` following the block hashed as
    /// `parent` (`None` for the first block of a sequence).
    ///
    /// FNV-1a over 128 bits with a final avalanche step; deterministic across
    /// runs and processes (nothing random is mixed in).
    pub fn of_block(parent: Option<BlockHash>, tokens: &[u32]) -> BlockHash {
        assert_eq!(tokens.len(), BLOCK_SIZE, "only full blocks are hashed");
        let head = match parent {
            Some(p) => [&[1u8][..], &p.0.to_le_bytes()].concat(),
            None => vec![0],
        };
        BlockHash::fnv(
            head.into_iter()
                .chain(tokens.iter().flat_map(|t| t.to_le_bytes())),
        )
    }

    /// FNV-1a over 128 bits of `bytes`, then an avalanche step so that every
    /// input bit reaches every output bit.
    fn fnv(bytes: impl Iterator<Item = u8>) -> BlockHash {
        let mut h = FNV128_OFFSET;
        for b in bytes {
            h ^= b as u128;
            h = h.wrapping_mul(FNV128_PRIME);
        }
        h ^= h >> 67;
        h = h.wrapping_mul(0x9E3779B97F4A7C15F39CC0605CEDC835);
        h ^= h >> 61;
        BlockHash(h)
    }

    /// Hashes of the full blocks of `tokens` from block `hashes.len()` on,
    /// appended to `hashes` (the chain continues from the last one there).
    pub fn extend_chain(hashes: &mut Vec<BlockHash>, tokens: &[u32]) {
        BlockHash::extend_salted_chain(hashes, tokens, None);
    }

    /// A request's cache salt as the parent of its first block: the chains
    /// of different salts (and of no salt) share no hash, so their
    /// requests share no prefix-cache entry.
    pub fn salt(salt: &str) -> BlockHash {
        // Tag 2: no block's input starts with it (theirs start with 0 or 1).
        BlockHash::fnv(std::iter::once(2).chain(salt.bytes()))
    }

    /// [`BlockHash::extend_chain`] for a request salted with `salt` (see
    /// [`BlockHash::salt`]): the first block's parent is the salt.
    pub fn extend_salted_chain(
        hashes: &mut Vec<BlockHash>,
        tokens: &[u32],
        salt: Option<BlockHash>,
    ) {
        let full = tokens.len() / BLOCK_SIZE;
        for i in hashes.len()..full {
            let parent = hashes.last().copied().or(salt);
            hashes.push(BlockHash::of_block(
                parent,
                &tokens[i * BLOCK_SIZE..(i + 1) * BLOCK_SIZE],
            ));
        }
    }
}

/// Number of blocks that hold `num_tokens` tokens.
pub fn blocks_for(num_tokens: usize) -> usize {
    num_tokens.div_ceil(BLOCK_SIZE)
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    ref_cnt: u32,
    hash: Option<BlockHash>,
    /// Position in the free list while free.
    free_stamp: Option<u64>,
}

/// Block ids `0..num_blocks` with reference counts, an LRU free list and a
/// prefix cache over full blocks.
#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<BlockMeta>,
    /// Free blocks by release stamp; the smallest stamp is reused first.
    free: BTreeMap<u64, u32>,
    next_stamp: u64,
    cached: HashMap<BlockHash, u32>,
    enable_caching: bool,
    /// Prompt tokens looked up in the cache / found there.
    queries: u64,
    hits: u64,
}

impl BlockPool {
    pub fn new(num_blocks: usize, enable_caching: bool) -> BlockPool {
        assert!(num_blocks <= u32::MAX as usize, "block ids are u32");
        let mut pool = BlockPool {
            blocks: vec![BlockMeta::default(); num_blocks],
            free: BTreeMap::new(),
            next_stamp: 0,
            cached: HashMap::new(),
            enable_caching,
            queries: 0,
            hits: 0,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free(id);
        }
        pool
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn caching_enabled(&self) -> bool {
        self.enable_caching
    }

    /// Tokens looked up in the prefix cache, cumulative.
    pub fn num_queries(&self) -> u64 {
        self.queries
    }

    /// Tokens found in the prefix cache, cumulative.
    pub fn num_hits(&self) -> u64 {
        self.hits
    }

    /// Number of blocks that currently carry a hash.
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    pub fn ref_count(&self, id: u32) -> u32 {
        self.blocks[id as usize].ref_cnt
    }

    fn push_free(&mut self, id: u32) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        let meta = &mut self.blocks[id as usize];
        debug_assert!(meta.free_stamp.is_none());
        meta.free_stamp = Some(stamp);
        self.free.insert(stamp, id);
    }

    fn remove_free(&mut self, id: u32) {
        let stamp = self.blocks[id as usize]
            .free_stamp
            .take()
            .unwrap_or_else(|| panic!("block {id} is not in the free list"));
        let removed = self.free.remove(&stamp);
        assert_eq!(removed, Some(id), "free list out of sync for block {id}");
    }

    /// The longest run of cached full blocks that starts `tokens`, for
    /// `block_hashes` = the hash chain of `tokens`. At least the last token is
    /// left out so that it is computed and yields logits. Counts a query of
    /// Neither counts nor takes references: an admitted request passes the
    /// result to [`BlockPool::touch`] and [`BlockPool::record_lookup`].
    pub fn get_computed_blocks(&self, tokens: &[u32], block_hashes: &[BlockHash]) -> Vec<u32> {
        if !self.enable_caching || tokens.is_empty() {
            return Vec::new();
        }
        let max_blocks = (tokens.len() - 1) / BLOCK_SIZE;
        let mut out = Vec::new();
        for h in block_hashes.iter().take(max_blocks) {
            match self.cached.get(h) {
                Some(&id) => out.push(id),
                None => break,
            }
        }
        out
    }

    /// Counts a lookup of `num_tokens` tokens of which `num_hit_tokens` were
    /// served from the cache.
    pub fn record_lookup(&mut self, num_tokens: usize, num_hit_tokens: usize) {
        if self.enable_caching {
            self.queries += num_tokens as u64;
            self.hits += num_hit_tokens as u64;
        }
    }

    /// How many of `ids` are free now (they leave the free list when touched).
    pub fn count_free(&self, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|&&id| self.blocks[id as usize].ref_cnt == 0)
            .count()
    }

    /// Takes one more reference on each of `ids` (prefix-cache hits).
    pub fn touch(&mut self, ids: &[u32]) {
        for &id in ids {
            if self.blocks[id as usize].ref_cnt == 0 {
                self.remove_free(id);
            }
            self.blocks[id as usize].ref_cnt += 1;
        }
    }

    /// Allocates `n` fresh blocks (reference count 1), least recently freed
    /// first; a reused block loses its hash. `None` (and nothing allocated)
    /// when fewer than `n` are free.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.free.len() {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let (_, id) = self.free.pop_first().expect("counted above");
            let meta = &mut self.blocks[id as usize];
            meta.free_stamp = None;
            debug_assert_eq!(meta.ref_cnt, 0);
            meta.ref_cnt = 1;
            if let Some(h) = meta.hash.take() {
                let removed = self.cached.remove(&h);
                debug_assert_eq!(removed, Some(id));
            }
            out.push(id);
        }
        Some(out)
    }

    /// Drops one reference on each of `ids`. Blocks are released in reverse
    /// order so that the tail of a sequence is evicted before its prefix.
    ///
    /// # Panics
    /// If a block is already free (a double free).
    pub fn free(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            let meta = &mut self.blocks[id as usize];
            assert!(meta.ref_cnt > 0, "double free of KV block {id}");
            meta.ref_cnt -= 1;
            if meta.ref_cnt == 0 {
                self.push_free(id);
            }
        }
    }

    /// Records that block `id`, now full and written, holds the tokens hashed
    /// as `hash`. If another block already holds the same content, `id` stays
    /// an ordinary block.
    pub fn cache_block(&mut self, id: u32, hash: BlockHash) {
        if !self.enable_caching {
            return;
        }
        let meta = &self.blocks[id as usize];
        assert!(meta.ref_cnt > 0, "caching block {id} that nobody holds");
        if meta.hash.is_some() {
            debug_assert_eq!(
                meta.hash,
                Some(hash),
                "block {id} re-cached with another hash"
            );
            return;
        }
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(hash) {
            e.insert(id);
            self.blocks[id as usize].hash = Some(hash);
        }
    }

    /// Forgets every cached hash. Refused (returns false) while any block is
    /// in use, since a running sequence's blocks would lose their entries.
    pub fn reset_prefix_cache(&mut self) -> bool {
        if self.free.len() != self.blocks.len() {
            return false;
        }
        for meta in &mut self.blocks {
            meta.hash = None;
        }
        self.cached.clear();
        true
    }

    /// Forgets the hashes of the free blocks only; blocks in use keep theirs
    /// (a frozen request's KV stays valid). With every block free this is
    /// [`BlockPool::reset_prefix_cache`]. Returns how many hashes were dropped.
    pub fn forget_free_cached_blocks(&mut self) -> usize {
        let mut dropped = 0;
        for meta in &mut self.blocks {
            if meta.ref_cnt == 0 {
                if let Some(h) = meta.hash.take() {
                    self.cached.remove(&h);
                    dropped += 1;
                }
            }
        }
        dropped
    }

    /// Forgets every cached hash, of blocks in use too: a block held by a
    /// transfer or a load keeps its contents for its holder but is never
    /// matched again, and goes back to the free list uncached. Returns how
    /// many hashes were dropped.
    pub fn forget_all_cached_blocks(&mut self) -> usize {
        let dropped = self.cached.len();
        for meta in &mut self.blocks {
            meta.hash = None;
        }
        self.cached.clear();
        dropped
    }

    /// Checks every invariant of the module docs; panics on a violation.
    pub fn check_invariants(&self) {
        let mut free_count = 0;
        for (id, meta) in self.blocks.iter().enumerate() {
            match meta.free_stamp {
                Some(s) => {
                    assert_eq!(meta.ref_cnt, 0, "block {id} is listed free but referenced");
                    assert_eq!(
                        self.free.get(&s),
                        Some(&(id as u32)),
                        "block {id} stamp not in free list"
                    );
                    free_count += 1;
                }
                None => assert!(meta.ref_cnt > 0, "block {id} is unreferenced but not free"),
            }
            if let Some(h) = meta.hash {
                assert_eq!(
                    self.cached.get(&h),
                    Some(&(id as u32)),
                    "block {id} hash missing from map"
                );
            }
        }
        assert_eq!(
            free_count,
            self.free.len(),
            "free list holds unknown entries"
        );
        for (h, &id) in &self.cached {
            assert_eq!(
                self.blocks[id as usize].hash,
                Some(*h),
                "map entry for block {id} is stale"
            );
        }
        if !self.enable_caching {
            assert!(self.cached.is_empty());
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn salted_chains_share_no_hash_with_other_salts() {
        let tokens: Vec<u32> = (0..(3 * BLOCK_SIZE as u32)).collect();
        let chain = |salt: Option<&str>| {
            let mut h = Vec::new();
            BlockHash::extend_salted_chain(&mut h, &tokens, salt.map(BlockHash::salt));
            h
        };
        let (a, a2, b, none) = (
            chain(Some("a")),
            chain(Some("a")),
            chain(Some("b")),
            chain(None),
        );
        assert_eq!(a, a2);
        let mut plain = Vec::new();
        BlockHash::extend_chain(&mut plain, &tokens);
        assert_eq!(none, plain);
        for (x, y) in [(&a, &b), (&a, &none), (&b, &none)] {
            assert!(x.iter().all(|h| !y.contains(h)), "{x:?} / {y:?}");
        }
    }

    use super::*;

    fn toks(start: u32, n: usize) -> Vec<u32> {
        (start..start + n as u32).collect()
    }

    fn chain(tokens: &[u32]) -> Vec<BlockHash> {
        let mut h = Vec::new();
        BlockHash::extend_chain(&mut h, tokens);
        h
    }

    #[test]
    fn hash_depends_on_parent_and_tokens() {
        let a = BlockHash::of_block(None, &toks(0, 16));
        assert_eq!(a, BlockHash::of_block(None, &toks(0, 16)), "deterministic");
        assert_ne!(a, BlockHash::of_block(None, &toks(1, 16)));
        assert_ne!(a, BlockHash::of_block(Some(a), &toks(0, 16)));
        let c = chain(&toks(0, 40));
        assert_eq!(c.len(), 2, "only full blocks are hashed");
        assert_eq!(c[1], BlockHash::of_block(Some(c[0]), &toks(16, 16)));
    }

    #[test]
    fn allocate_free_counts_and_double_free_panics() {
        let mut p = BlockPool::new(4, true);
        let a = p.allocate(3).unwrap();
        assert_eq!(p.num_free(), 1);
        assert!(p.allocate(2).is_none(), "all or nothing");
        assert_eq!(p.num_free(), 1);
        p.free(&a);
        assert_eq!(p.num_free(), 4);
        p.check_invariants();
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.free(&a[..1])));
        assert!(r.is_err(), "a double free must panic");
    }

    #[test]
    fn prefix_hit_and_never_the_whole_prompt() {
        let mut p = BlockPool::new(8, true);
        let prompt = toks(100, 32);
        let hashes = chain(&prompt);
        let ids = p.allocate(2).unwrap();
        p.cache_block(ids[0], hashes[0]);
        p.cache_block(ids[1], hashes[1]);
        p.free(&ids);
        p.check_invariants();
        // Same 32 tokens: the last block holds the last token, so only one hits.
        let hit = p.get_computed_blocks(&prompt, &hashes);
        assert_eq!(hit, vec![ids[0]]);
        // 33 tokens: both full blocks hit.
        let mut longer = prompt.clone();
        longer.push(7);
        let hit = p.get_computed_blocks(&longer, &chain(&longer));
        assert_eq!(hit, ids);
        p.record_lookup(longer.len(), hit.len() * BLOCK_SIZE);
        assert_eq!(p.num_queries(), 33);
        assert_eq!(p.num_hits(), 32);
        assert_eq!(p.count_free(&hit), 2);
        p.touch(&hit);
        assert_eq!(p.num_free(), 6);
        p.check_invariants();
        // A different first block breaks the chain even if block 2 matches.
        let mut other = longer.clone();
        other[0] = 99;
        assert!(p.get_computed_blocks(&other, &chain(&other)).is_empty());
        p.free(&hit);
        assert_eq!(p.num_free(), 8);
    }

    #[test]
    fn freed_cached_blocks_are_reused_lru_and_lose_their_hash() {
        let mut p = BlockPool::new(3, true);
        let seq = toks(0, 48);
        let hashes = chain(&seq);
        let ids = p.allocate(3).unwrap();
        for i in 0..3 {
            p.cache_block(ids[i], hashes[i]);
        }
        p.free(&ids);
        // Freed in reverse: the tail block is the least recently used.
        let got = p.allocate(1).unwrap();
        assert_eq!(got, vec![ids[2]]);
        assert_eq!(p.num_cached_blocks(), 2);
        p.check_invariants();
        let mut q = seq.clone();
        q.push(1);
        let hit = p.get_computed_blocks(&q, &chain(&q));
        assert_eq!(
            hit,
            vec![ids[0], ids[1]],
            "prefix survives, evicted tail misses"
        );
        p.free(&got);
        p.check_invariants();
    }

    #[test]
    fn duplicate_content_keeps_first_block() {
        let mut p = BlockPool::new(2, true);
        let h = chain(&toks(0, 16))[0];
        let ids = p.allocate(2).unwrap();
        p.cache_block(ids[0], h);
        p.cache_block(ids[1], h);
        assert_eq!(p.num_cached_blocks(), 1);
        p.check_invariants();
        p.free(&ids);
        p.check_invariants();
    }

    #[test]
    fn reset_prefix_cache_only_when_idle() {
        let mut p = BlockPool::new(2, true);
        let h = chain(&toks(0, 16))[0];
        let ids = p.allocate(1).unwrap();
        p.cache_block(ids[0], h);
        assert!(!p.reset_prefix_cache());
        p.free(&ids);
        assert!(p.reset_prefix_cache());
        assert_eq!(p.num_cached_blocks(), 0);
        assert!(p
            .get_computed_blocks(&toks(0, 17), &chain(&toks(0, 17)))
            .is_empty());
        p.check_invariants();
    }

    #[test]
    fn forgetting_free_cached_blocks_keeps_those_in_use() {
        let mut p = BlockPool::new(3, true);
        let c = chain(&toks(0, 32));
        let ids = p.allocate(2).unwrap();
        p.cache_block(ids[0], c[0]);
        p.cache_block(ids[1], c[1]);
        p.free(&ids[1..]);
        assert_eq!(p.forget_free_cached_blocks(), 1);
        assert_eq!(p.num_cached_blocks(), 1, "the held block keeps its hash");
        p.check_invariants();
        p.free(&ids[..1]);
        assert_eq!(p.forget_free_cached_blocks(), 1);
        assert_eq!(p.num_cached_blocks(), 0);
        p.check_invariants();
    }

    #[test]
    fn forgetting_all_cached_blocks_keeps_blocks_in_use_but_unmatched() {
        let mut pool = BlockPool::new(8, true);
        let tokens = toks(0, 2 * BLOCK_SIZE + 1);
        let hashes = chain(&tokens);
        let held = pool.allocate(2).unwrap();
        pool.cache_block(held[0], hashes[0]);
        pool.cache_block(held[1], hashes[1]);
        assert_eq!(pool.forget_all_cached_blocks(), 2);
        pool.check_invariants();
        assert!(pool.get_computed_blocks(&tokens, &hashes).is_empty());
        // The holder keeps its blocks; they come back uncached.
        assert_eq!(pool.ref_count(held[0]), 1);
        pool.free(&held);
        assert_eq!(pool.num_free(), 8);
        assert_eq!(pool.num_cached_blocks(), 0);
        pool.check_invariants();
        // Caching works again afterwards.
        let again = pool.allocate(1).unwrap();
        pool.cache_block(again[0], hashes[0]);
        assert_eq!(pool.num_cached_blocks(), 1);
    }

    #[test]
    fn caching_disabled_never_hits() {
        let mut p = BlockPool::new(2, false);
        let t = toks(0, 17);
        let ids = p.allocate(1).unwrap();
        p.cache_block(ids[0], chain(&t)[0]);
        p.free(&ids);
        assert!(p.get_computed_blocks(&t, &chain(&t)).is_empty());
        p.record_lookup(17, 0);
        assert_eq!(p.num_queries(), 0);
        p.check_invariants();
    }
}
