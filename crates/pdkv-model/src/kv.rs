//! The paged KV cache: one `kv_cache` region of fixed-size blocks.
//!
//! Layout is block-major so that one block is one contiguous byte range
//! (what a transfer moves): block `b` holds, for each layer `l`, K then V,
//! each `[BLOCK_SIZE, num_kv_heads, head_dim]` f32.
//! offset(b, l, kv) = ((b * num_layers + l) * 2 + kv) * BLOCK_SIZE * kv_dim * 4.

use std::sync::Arc;

use pdkv_vmem::{Pool, Region, Tag};

use crate::kernels::PagedRows;
use crate::{ModelConfig, BLOCK_SIZE};

pub struct KvCache {
    region: Arc<Region>,
    num_blocks: usize,
    num_layers: usize,
    kv_dim: usize,
}

impl KvCache {
    /// Allocates `num_blocks` blocks for `cfg` in a `kv_cache` region of `pool`.
    pub fn new(pool: &Pool, cfg: &ModelConfig, num_blocks: usize) -> anyhow::Result<KvCache> {
        anyhow::ensure!(num_blocks > 0, "the KV cache needs at least one block");
        let block_bytes = Self::block_bytes_for(cfg);
        let region = pool.allocate(Tag::KvCache, block_bytes * num_blocks)?;
        Ok(KvCache {
            region,
            num_blocks,
            num_layers: cfg.num_layers,
            kv_dim: cfg.kv_dim(),
        })
    }

    pub fn block_bytes_for(cfg: &ModelConfig) -> usize {
        cfg.num_layers * 2 * BLOCK_SIZE * cfg.kv_dim() * 4
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Floats per token per layer in each of K and V: `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.kv_dim
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        BLOCK_SIZE
    }

    pub fn block_bytes(&self) -> usize {
        self.num_layers * 2 * BLOCK_SIZE * self.kv_dim * 4
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Byte offset of the K (`kv == 0`) or V (`kv == 1`) slab of `layer` in `block`.
    pub fn slab_offset(&self, block: usize, layer: usize, kv: usize) -> usize {
        debug_assert!(block < self.num_blocks && layer < self.num_layers && kv < 2);
        ((block * self.num_layers + layer) * 2 + kv) * BLOCK_SIZE * self.kv_dim * 4
    }

    /// Floats per slab: `BLOCK_SIZE * kv_dim`.
    pub fn slab_len(&self) -> usize {
        BLOCK_SIZE * self.kv_dim
    }

    /// Reads one slab.
    ///
    /// # Safety
    /// No one may write this slab while the slice lives.
    pub unsafe fn slab(&self, block: usize, layer: usize, kv: usize) -> &[f32] {
        self.region
            .slice::<f32>(self.slab_offset(block, layer, kv), self.slab_len())
    }

    /// Writes into one slab.
    ///
    /// # Safety
    /// The caller must be the only one accessing this slab while the slice lives
    /// (the scheduler gives each block to one sequence at a time).
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slab_mut(&self, block: usize, layer: usize, kv: usize) -> &mut [f32] {
        self.region
            .slice_mut::<f32>(self.slab_offset(block, layer, kv), self.slab_len())
    }

    /// Writes the K and V rows of the token in `slot` of `block` for `layer`.
    ///
    /// # Safety
    /// No one else may access that token's rows while this runs.
    pub(crate) unsafe fn write_token(
        &self,
        block: usize,
        layer: usize,
        slot: usize,
        k: &[f32],
        v: &[f32],
    ) {
        assert!(block < self.num_blocks && layer < self.num_layers && slot < BLOCK_SIZE);
        assert!(k.len() == self.kv_dim && v.len() == self.kv_dim);
        let base = self.region.base() as *mut f32;
        let row = slot * self.kv_dim;
        let k_at = base.add(self.slab_offset(block, layer, 0) / 4 + row);
        let v_at = base.add(self.slab_offset(block, layer, 1) / 4 + row);
        std::ptr::copy_nonoverlapping(k.as_ptr(), k_at, self.kv_dim);
        std::ptr::copy_nonoverlapping(v.as_ptr(), v_at, self.kv_dim);
    }

    /// Where KV head `kv_head` of `layer` lives for a sequence with `block_table`.
    /// Every id in `block_table` must be `< num_blocks` (checked by the caller).
    pub(crate) fn paged_rows<'a>(
        &self,
        layer: usize,
        kv_head: usize,
        head_dim: usize,
        block_table: &'a [u32],
    ) -> PagedRows<'a> {
        let slab = BLOCK_SIZE * self.kv_dim;
        PagedRows {
            base: (self.region.base() as *const f32).wrapping_add(layer * 2 * slab),
            block_table,
            block_size: BLOCK_SIZE,
            block_stride: self.num_layers * 2 * slab,
            row_stride: self.kv_dim,
            head_offset: kv_head * head_dim,
            v_offset: slab,
        }
    }
}
