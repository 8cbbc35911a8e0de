//! This engine's KV cache as the core registered it: one registration per
//! rank. A leaf.

use std::ops::Range;
use std::sync::Arc;

use pdkv_transfer::Registration;

use crate::ranks::RankReg;

/// This engine's KV cache, once registered: one registration per rank.
#[derive(Clone)]
pub struct KvInfo {
    pub ranks: Vec<RankKv>,
    /// Bytes of the whole model's block (every rank's part).
    pub block_bytes: u64,
    /// Bytes of one KV head's part of a block.
    pub head_bytes: u64,
    pub num_kv_heads: usize,
    pub block_size: usize,
    pub layout: String,
}

/// One rank's KV cache and its registration.
#[derive(Clone)]
pub struct RankKv {
    /// The current registration (gone while asleep; restore makes the next
    /// epoch).
    pub reg: Registration,
    pub region: Arc<pdkv_vmem::Region>,
    pub heads: Range<usize>,
    /// Bytes registered: every block of the rank.
    pub len: usize,
    /// Bytes of the rank's block.
    pub block_bytes: u64,
}

impl KvInfo {
    /// The generation peers read at: the first rank's epoch (every rank is
    /// registered again together).
    pub fn generation(&self) -> u64 {
        self.ranks[0].reg.epoch
    }

    pub fn regs(&self) -> Vec<Registration> {
        self.ranks.iter().map(|r| r.reg).collect()
    }

    pub fn heads(&self) -> Vec<Range<usize>> {
        self.ranks.iter().map(|r| r.heads.clone()).collect()
    }

    pub(super) fn rank_regs(&self) -> Vec<RankReg> {
        self.ranks
            .iter()
            .map(|r| RankReg {
                heads: (r.heads.start, r.heads.end),
                reg: r.reg,
            })
            .collect()
    }
}
