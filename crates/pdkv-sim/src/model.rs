//! The simulated model: a [`ModelRunner`] whose "math" makes stale or
//! foreign KV detectable exactly.
//!
//! Every token position's KV slot holds a tag: the hash of the request's
//! tokens up to that position and the id of the weights that computed it.
//! The slots live in a real `kv_cache` region of the engine's pool (so
//! sleep, wake, registrations and transfers move them as they move real
//! KV), and the weights id in a real `weights` region (offloaded, discarded
//! and woken with it). At every step the model checks, for every sequence,
//! that each earlier position's slot holds exactly the tag of *this*
//! request's tokens under *these* weights — the tokens come from the
//! [`Oracle`], which the simulator keeps from what it sent and what the
//! engine returned, independently of the engine — then writes the new
//! positions' tags and predicts the next token from the last tag. A
//! mismatch is a violation, recorded with what was found.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use pdkv_engine::connector::KvCacheSpec;
use pdkv_engine::detok::Decode;
use pdkv_engine::scheduler::ScheduledSeq;
use pdkv_engine::ModelRunner;
use pdkv_model::loader::ReloadError;
use pdkv_model::BLOCK_SIZE;
use pdkv_vmem::{Pool, Region, Tag};

/// Token ids are below this.
pub const VOCAB: usize = 512;
/// Bytes of one token position's KV: the prefix hash and the weights id.
pub const SLOT: usize = 16;
/// Bytes of one KV block.
pub const BLOCK_BYTES: usize = BLOCK_SIZE * SLOT;

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
    kv: Arc<Region>,
    weights: Arc<Region>,
    num_blocks: usize,
    oracle: SharedOracle,
}

impl SimModel {
    /// Allocates the KV region (`num_blocks` blocks) and the weights region
    /// (holding `weights_id`) in `pool`.
    pub fn new(
        pool: &Pool,
        num_blocks: usize,
        name: &str,
        oracle: SharedOracle,
        weights_id: u64,
    ) -> anyhow::Result<SimModel> {
        let kv = pool.allocate(Tag::KvCache, num_blocks * BLOCK_BYTES)?;
        let weights = pool.allocate(Tag::Weights, 4096)?;
        weights.write_bytes(0, &weights_id.to_le_bytes())?;
        Ok(SimModel {
            name: name.to_string(),
            kv,
            weights,
            num_blocks,
            oracle,
        })
    }

    fn weights_id(&self) -> anyhow::Result<u64> {
        let mut b = [0u8; 8];
        self.weights.read_bytes(0, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    fn slot_offset(&self, table: &[u32], pos: usize) -> anyhow::Result<usize> {
        let block = *table
            .get(pos / BLOCK_SIZE)
            .ok_or_else(|| anyhow::anyhow!("block table too short for position {pos}"))?;
        anyhow::ensure!(
            (block as usize) < self.num_blocks,
            "block {block} outside the cache"
        );
        Ok(block as usize * BLOCK_BYTES + (pos % BLOCK_SIZE) * SLOT)
    }

    fn read_slot(&self, table: &[u32], pos: usize) -> anyhow::Result<(u64, u64)> {
        let mut b = [0u8; SLOT];
        self.kv.read_bytes(self.slot_offset(table, pos)?, &mut b)?;
        let h = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let w = u64::from_le_bytes(b[8..].try_into().expect("8 bytes"));
        Ok((h, w))
    }

    fn write_slot(&self, table: &[u32], pos: usize, h: u64, w: u64) -> anyhow::Result<()> {
        let mut b = [0u8; SLOT];
        b[..8].copy_from_slice(&h.to_le_bytes());
        b[8..].copy_from_slice(&w.to_le_bytes());
        self.kv.write_bytes(self.slot_offset(table, pos)?, &b)?;
        Ok(())
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
        for (p, &want) in hashes.iter().enumerate().take(s.start_pos) {
            let (h, kw) = self.read_slot(&s.block_table, p)?;
            if (h, kw) != (want, w) {
                self.violation(format!(
                    "request {}: stale or foreign KV at position {p} of {}: found (hash {h:#x}, weights {kw}), expected (hash {want:#x}, weights {w}); block {}",
                    s.request_id,
                    s.start_pos,
                    s.block_table[p / BLOCK_SIZE]
                ));
                anyhow::bail!("stale KV");
            }
        }
        for (p, &h) in hashes.iter().enumerate().skip(s.start_pos) {
            self.write_slot(&s.block_table, p, h, w)?;
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
        KvCacheSpec {
            region: self.kv.clone(),
            num_blocks: self.num_blocks,
            block_bytes: BLOCK_BYTES,
            block_size: BLOCK_SIZE,
            layout: "sim:slots=16x16".into(),
        }
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
        self.weights
            .write_bytes(0, &id.to_le_bytes())
            .map_err(|_| ReloadError::RegionReleased)
    }
}

/// Token ids as text, for the engine's detokenizer.
pub struct Ids;

impl Decode for Ids {
    fn decode(&self, ids: &[u32]) -> String {
        ids.iter().map(|i| format!("<{i}>")).collect()
    }
}
