//! The paged KV cache: one `kv_cache` region of fixed-size blocks.
//!
//! Layout is block-major so that one block is one contiguous byte range
//! (what a transfer moves), and head-major inside a block: block `b` holds,
//! for each KV head `h`, for each layer `l`, K then V, each
//! `[BLOCK_SIZE, head_dim]` f32:
//! offset(b, h, l, kv) = (((b * num_kv_heads + h) * num_layers + l) * 2 + kv)
//! * BLOCK_SIZE * head_dim * 4.
//!
//! So the KV heads `h0..h1` of a block are one contiguous byte range of it,
//! `[h0 * head_bytes, h1 * head_bytes)` (`head_bytes`: one head's part), and
//! the block of a tensor-parallel rank holding those heads ([`crate::tp`])
//! has exactly those bytes: a rank's block is a slice of the whole model's
//! block, and the whole block the ranks' blocks one after the other.

use std::sync::Arc;

use pdkv_vmem::{Pool, Region, Tag};

use crate::kernels::PagedRows;
use crate::{ModelConfig, BLOCK_SIZE};

pub struct KvCache {
    region: Arc<Region>,
    num_blocks: usize,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
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
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
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
        self.num_kv_heads * self.head_dim
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Bytes of one KV head's part of a block (all layers, K and V).
    pub fn head_bytes(&self) -> usize {
        self.num_layers * 2 * BLOCK_SIZE * self.head_dim * 4
    }

    pub fn num_blocks(&self) -> usize {
        self.num_blocks
    }

    pub fn block_size(&self) -> usize {
        BLOCK_SIZE
    }

    pub fn block_bytes(&self) -> usize {
        self.num_kv_heads * self.head_bytes()
    }

    pub fn region(&self) -> &Arc<Region> {
        &self.region
    }

    /// Byte offset of head `head`'s K (`kv == 0`) or V (`kv == 1`) rows of
    /// `layer` in `block`: `BLOCK_SIZE` rows of `head_dim` floats.
    pub fn rows_offset(&self, block: usize, head: usize, layer: usize, kv: usize) -> usize {
        debug_assert!(
            block < self.num_blocks
                && head < self.num_kv_heads
                && layer < self.num_layers
                && kv < 2
        );
        (((block * self.num_kv_heads + head) * self.num_layers + layer) * 2 + kv)
            * BLOCK_SIZE
            * self.head_dim
            * 4
    }

    /// Reads head `head`'s K or V rows of `layer` in `block`.
    ///
    /// # Safety
    /// No one may write these rows while the slice lives.
    pub unsafe fn rows(&self, block: usize, head: usize, layer: usize, kv: usize) -> &[f32] {
        // SAFETY: `rows_offset` places the rows inside the region (it checks
        // the indices); the caller guarantees no one writes them meanwhile.
        unsafe {
            self.region.slice::<f32>(
                self.rows_offset(block, head, layer, kv),
                BLOCK_SIZE * self.head_dim,
            )
        }
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
        let hd = self.head_dim;
        assert!(k.len() == self.kv_dim() && v.len() == self.kv_dim());
        let base = self.region.base() as *mut f32;
        for h in 0..self.num_kv_heads {
            // SAFETY: the indices were checked above, so each row of `hd`
            // floats lies inside the region; `k` and `v` hold every head's
            // row (checked above) and are not in the region's token rows;
            // the caller guarantees no one else touches these rows.
            unsafe {
                let k_at = base.add(self.rows_offset(block, h, layer, 0) / 4 + slot * hd);
                let v_at = base.add(self.rows_offset(block, h, layer, 1) / 4 + slot * hd);
                std::ptr::copy_nonoverlapping(k[h * hd..].as_ptr(), k_at, hd);
                std::ptr::copy_nonoverlapping(v[h * hd..].as_ptr(), v_at, hd);
            }
        }
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
        debug_assert_eq!(head_dim, self.head_dim);
        let rows = BLOCK_SIZE * self.head_dim;
        PagedRows {
            base: (self.region.base() as *const f32)
                .wrapping_add(self.rows_offset(0, kv_head, layer, 0) / 4),
            block_table,
            block_size: BLOCK_SIZE,
            block_stride: self.block_bytes() / 4,
            row_stride: self.head_dim,
            head_offset: 0,
            v_offset: rows,
        }
    }
}
