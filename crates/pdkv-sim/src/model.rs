//! The simulated model: a [`ModelRunner`] whose "math" makes stale or
//! foreign KV detectable exactly.
//!
//! Every token position's KV slot holds a tag: the hash of the request's
//! tokens up to that position and the id of the weights that computed it.
//! The slots live in real `kv_cache` regions of the engine's pools (so
//! sleep, wake, registrations and transfers move them as they move real
//! KV), and the weights id in a real `weights` region on every rank
//! (offloaded, discarded and woken with it). At every step the model
//! checks, for every sequence, that each earlier position's slot holds
//! exactly the tag of *this* request's tokens under *these* weights — the
//! tokens come from the [`Oracle`], which the simulator keeps from what it
//! sent and what the engine returned, independently of the engine — then
//! writes the new positions' tags and predicts the next token from the last
//! tag. A mismatch is a violation, recorded with what was found.
//!
//! The model is split over tensor-parallel ranks as a real one is: its
//! block has [`NUM_KV_HEADS`] heads, head-major, and each head holds a
//! quarter of every position's slot, so a slot's bytes lie on every rank.
//! A transfer that misplaces, drops or mixes one head's share of a block
//! (between engines split differently, say) leaves a tag no request
//! wrote, and the next step that attends to it fails.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::Path;
use std::sync::{Arc, Mutex};

use pdkv_engine::connector::{KvCacheSpec, KvRank};
use pdkv_engine::detok::Decode;
use pdkv_engine::scheduler::ScheduledSeq;
use pdkv_engine::ModelRunner;
use pdkv_model::loader::ReloadError;
use pdkv_model::BLOCK_SIZE;
use pdkv_vmem::{Pool, Region, Tag};

/// Token ids are below this.
pub const VOCAB: usize = 512;
/// Bytes of one token position's KV: the prefix hash and the weights id
/// (stored mixed with the hash).
pub const SLOT: usize = 16;
/// KV heads of the model: what tensor parallelism splits.
pub const NUM_KV_HEADS: usize = 4;
/// Bytes of one position's slot that one head holds.
pub const HEAD_SLOT: usize = SLOT / NUM_KV_HEADS;
/// Bytes of one head's part of a block.
pub const HEAD_BYTES: usize = BLOCK_SIZE * HEAD_SLOT;
/// Bytes of one KV block (every head's part).
pub const BLOCK_BYTES: usize = BLOCK_SIZE * SLOT;

/// The KV heads each of `tp` ranks holds, in rank order: an even split
/// where `tp` divides the heads, else the first rank takes the remainder
/// (three ranks hold 2, 1 and 1 heads).
pub fn split_heads(tp: usize) -> Vec<Range<usize>> {
    let tp = tp.clamp(1, NUM_KV_HEADS);
    let small = NUM_KV_HEADS / tp;
    let first = NUM_KV_HEADS - small * (tp - 1);
    (0..tp)
        .map(|r| match r {
            0 => 0..first,
            _ => {
                let h0 = first + (r - 1) * small;
                h0..h0 + small
            }
        })
        .collect()
}

/// The simulator's own record of every request's tokens on one engine.
#[derive(Default)]
pub struct Oracle {
    tokens: BTreeMap<String, Vec<u32>>,
    /// What the model found wrong, in order.
    pub violations: Vec<String>,
    /// Tokens the model computed in its last step (how long it took).
    pub last_step_tokens: usize,
}

pub type SharedOracle = Arc<Mutex<Oracle>>;

impl Oracle {
    /// A request was sent to the engine with this prompt.
    pub fn start(&mut self, id: &str, prompt: &[u32]) {
        self.tokens.insert(id.to_string(), prompt.to_vec());
    }

    /// The engine returned these tokens for the request.
    pub fn extend(&mut self, id: &str, tokens: &[u32]) {
        if let Some(t) = self.tokens.get_mut(id) {
            t.extend_from_slice(tokens);
        }
    }

    pub fn forget(&mut self, id: &str) {
        self.tokens.remove(id);
    }
}

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The hash of `tokens[..=p]` for every position `p`.
pub fn prefix_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut h = 0x7064_6b76u64;
    tokens
        .iter()
        .map(|&t| {
            h = mix(h ^ (t as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            h
        })
        .collect()
}

/// The token the model predicts after a prefix with hash `h` under weights `w`.
pub fn next_token(h: u64, w: u64) -> u32 {
    (mix(h ^ w.rotate_left(17)) % VOCAB as u64) as u32
}

/// The output tokens a request gets when every token is computed with
/// weights `w` (what a colocated engine answers).
pub fn reference(prompt: &[u32], max_tokens: usize, w: u64) -> Vec<u32> {
    let mut toks = prompt.to_vec();
    let mut out = Vec::with_capacity(max_tokens);
    for _ in 0..max_tokens {
        let h = *prefix_hashes(&toks)
            .last()
            .expect("a prompt is never empty");
        let t = next_token(h, w);
        out.push(t);
        toks.push(t);
    }
    out
}

/// The weights id a checkpoint path names (`sim/weights/<id>`).
pub fn weights_path(id: u64) -> String {
    format!("sim/weights/{id}")
}

/// See the module docs.
pub struct SimModel {
    name: String,
    /// Every rank's KV region and heads: what the engine's connector
    /// registers, and what the model reads and writes blocks through.
    spec: KvCacheSpec,
    /// Every rank's copy of the weights id.
    weights: Vec<Arc<Region>>,
    num_blocks: usize,
    oracle: SharedOracle,
}

impl SimModel {
    /// Allocates, in each rank's pool, its share of the KV cache
    /// (`num_blocks` blocks of its heads, [`split_heads`]) and a weights
    /// region holding `weights_id`.
    pub fn new(
        pools: &[Pool],
        num_blocks: usize,
        name: &str,
        oracle: SharedOracle,
        weights_id: u64,
    ) -> anyhow::Result<SimModel> {
        anyhow::ensure!(
            (1..=NUM_KV_HEADS).contains(&pools.len()),
            "{} ranks, the model has {NUM_KV_HEADS} KV heads",
            pools.len()
        );
        let mut ranks = Vec::with_capacity(pools.len());
        let mut weights = Vec::with_capacity(pools.len());
        for (pool, heads) in pools.iter().zip(split_heads(pools.len())) {
            let region = pool.allocate(Tag::KvCache, num_blocks * heads.len() * HEAD_BYTES)?;
            ranks.push(KvRank { region, heads });
            let w = pool.allocate(Tag::Weights, 4096)?;
            w.write_bytes(0, &weights_id.to_le_bytes())?;
            weights.push(w);
        }
        let spec = KvCacheSpec {
            ranks,
            num_blocks,
            block_bytes: BLOCK_BYTES,
            num_kv_heads: NUM_KV_HEADS,
            block_size: BLOCK_SIZE,
            layout: "sim:slots=16x16".into(),
        };
        Ok(SimModel {
            name: name.to_string(),
            spec,
            weights,
            num_blocks,
            oracle,
        })
    }

    /// The weights id every rank holds; ranks that disagree are a violation
    /// (a reload or wake reached some ranks only).
    fn weights_id(&self) -> anyhow::Result<u64> {
        let mut ids = Vec::with_capacity(self.weights.len());
        for w in &self.weights {
            let mut b = [0u8; 8];
            w.read_bytes(0, &mut b)?;
            ids.push(u64::from_le_bytes(b));
        }
        if ids.iter().any(|&i| i != ids[0]) {
            self.violation(format!("the ranks hold different weights: {ids:?}"));
            anyhow::bail!("ranks on different weights");
        }
        Ok(ids[0])
    }

    fn block_of(&self, table: &[u32], pos: usize) -> anyhow::Result<u32> {
        let block = *table
            .get(pos / BLOCK_SIZE)
            .ok_or_else(|| anyhow::anyhow!("block table too short for position {pos}"))?;
        anyhow::ensure!(
            (block as usize) < self.num_blocks,
            "block {block} outside the cache"
        );
        Ok(block)
    }

    /// The whole model's block `b`, gathered from every rank.
    fn read_block(&self, b: u32) -> anyhow::Result<[u8; BLOCK_BYTES]> {
        let mut buf = [0u8; BLOCK_BYTES];
        self.spec.read_block(b, &mut buf)?;
        Ok(buf)
    }

    /// The tag at position `i` of a block: each head's share of the slot
    /// from its place in the head-major block.
    fn slot_in(block: &[u8; BLOCK_BYTES], i: usize) -> (u64, u64) {
        let mut b = [0u8; SLOT];
        for (k, part) in b.chunks_exact_mut(HEAD_SLOT).enumerate() {
            let at = k * HEAD_BYTES + i * HEAD_SLOT;
            part.copy_from_slice(&block[at..at + HEAD_SLOT]);
        }
        let h = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let w = u64::from_le_bytes(b[8..].try_into().expect("8 bytes")) ^ h;
        (h, w)
    }

    /// Writes a tag. The weights id is stored mixed with the hash, so
    /// that every head's share depends on the request: a share left from
    /// another request under the same weights does not pass for this one's.
    fn set_slot(block: &mut [u8; BLOCK_BYTES], i: usize, h: u64, w: u64) {
        let mut b = [0u8; SLOT];
        b[..8].copy_from_slice(&h.to_le_bytes());
        b[8..].copy_from_slice(&(w ^ h).to_le_bytes());
        for (k, part) in b.chunks_exact(HEAD_SLOT).enumerate() {
            let at = k * HEAD_BYTES + i * HEAD_SLOT;
            block[at..at + HEAD_SLOT].copy_from_slice(part);
        }
    }

    /// Checks one sequence's earlier KV and writes its new positions;
    /// returns the last position's hash.
    fn run_seq(&self, s: &ScheduledSeq, w: u64) -> anyhow::Result<u64> {
        let oracle = self.oracle.lock().unwrap();
        let Some(all) = oracle.tokens.get(&*s.request_id).cloned() else {
            drop(oracle);
            self.violation(format!(
                "the engine computes request {} that was never sent to it",
                s.request_id
            ));
            anyhow::bail!("unknown request");
        };
        drop(oracle);
        let end = s.start_pos + s.tokens.len();
        if all.get(s.start_pos..end) != Some(&s.tokens[..]) {
            self.violation(format!(
                "request {}: the step computes tokens {:?} at {}, the request's tokens there are {:?}",
                s.request_id,
                s.tokens,
                s.start_pos,
                all.get(s.start_pos..end.min(all.len()))
            ));
            anyhow::bail!("wrong tokens");
        }
        let hashes = prefix_hashes(&all[..end]);
        // One gather per block rather than per position: a block's slots
        // are spread over every rank.
        let mut cached: Option<(u32, [u8; BLOCK_BYTES])> = None;
        for (p, &want) in hashes.iter().enumerate().take(s.start_pos) {
            let b = self.block_of(&s.block_table, p)?;
            if cached.as_ref().is_none_or(|c| c.0 != b) {
                cached = Some((b, self.read_block(b)?));
            }
            let block = &cached.as_ref().expect("read above").1;
            let (h, kw) = Self::slot_in(block, p % BLOCK_SIZE);
            if (h, kw) != (want, w) {
                self.violation(format!(
                    "request {}: stale or foreign KV at position {p} of {}: found (hash {h:#x}, weights {kw}), expected (hash {want:#x}, weights {w}); block {b}",
                    s.request_id,
                    s.start_pos,
                ));
                anyhow::bail!("stale KV");
            }
        }
        let mut p = s.start_pos;
        while p < end {
            let b = self.block_of(&s.block_table, p)?;
            let mut block = self.read_block(b)?;
            let stop = end.min((p / BLOCK_SIZE + 1) * BLOCK_SIZE);
            for (q, &h) in hashes.iter().enumerate().take(stop).skip(p) {
                Self::set_slot(&mut block, q % BLOCK_SIZE, h, w);
            }
            self.spec.write_block(b, &block)?;
            p = stop;
        }
        Ok(hashes[end - 1])
    }

    fn violation(&self, what: String) {
        self.oracle
            .lock()
            .unwrap()
            .violations
            .push(format!("{}: {what}", self.name));
    }
}

impl ModelRunner for SimModel {
    fn forward(&mut self, seqs: &[ScheduledSeq], logits: &mut Vec<f32>) -> anyhow::Result<()> {
        logits.clear();
        let w = self.weights_id()?;
        if w == 0 {
            self.violation("a step ran on discarded weights".into());
            anyhow::bail!("discarded weights");
        }
        self.oracle.lock().unwrap().last_step_tokens = seqs.iter().map(|s| s.tokens.len()).sum();
        for s in seqs {
            let h = self.run_seq(s, w)?;
            if s.sample {
                let mut row = vec![0.0f32; VOCAB];
                row[next_token(h, w) as usize] = 1.0;
                logits.extend_from_slice(&row);
            }
        }
        Ok(())
    }

    fn vocab_size(&self) -> usize {
        VOCAB
    }

    fn max_context_len(&self) -> usize {
        4096
    }

    fn kv_cache_spec(&self) -> KvCacheSpec {
        self.spec.clone()
    }

    fn reload_weights(&mut self, path: &Path) -> Result<(), ReloadError> {
        let id = path
            .to_str()
            .and_then(|p| p.strip_prefix("sim/weights/"))
            .and_then(|id| id.parse::<u64>().ok())
            .filter(|&id| id != 0)
            .ok_or_else(|| {
                ReloadError::Unreadable(anyhow::anyhow!(
                    "not a simulated checkpoint: {}",
                    path.display()
                ))
            })?;
        // Every rank's weights are asleep or awake together (the pools
        // sleep and wake all ranks or none), so a refusal comes from the
        // first rank, before any is written.
        for w in &self.weights {
            w.write_bytes(0, &id.to_le_bytes())
                .map_err(|_| ReloadError::RegionReleased)?;
        }
        Ok(())
    }
}

/// Token ids as text, for the engine's detokenizer.
pub struct Ids;

impl Decode for Ids {
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|i| format!("<{i}>")).collect()
    }
}
