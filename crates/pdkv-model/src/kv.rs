//! The paged KV cache: one `kv_cache` region of fixed-size blocks.
//!
//! Layout is block-major so that one block is one contiguous byte range
//! (what a transfer moves), and head-major inside a block: block `b` holds,
//! for each KV head `h`, for each layer `l`, K then V, each
//! `BLOCK_SIZE` rows of `head_dim` elements of the cache's [`KvDtype`]
//! (`f32`; `f16` / `bf16`: half the bytes per token, for memory and for
//! every transfer; `q8_0`: blocks of 32 int8 values and their f16 scale,
//! 34 bytes per 32 elements):
//! offset(b, h, l, kv) = (((b * num_kv_heads + h) * num_layers + l) * 2 + kv)
//! * BLOCK_SIZE * row bytes.
//!
//! So the KV heads `h0..h1` of a block are one contiguous byte range of it,
//! `[h0 * head_bytes, h1 * head_bytes)` (`head_bytes`: one head's part), and
//! the block of a tensor-parallel rank holding those heads ([`crate::tp`])
//! has exactly those bytes: a rank's block is a slice of the whole model's
//! block, and the whole block the ranks' blocks one after the other.

use std::sync::Arc;

use pdkv_vmem::{Backing, Pool, Region, Tag};

use crate::kernels::{KvElem, PagedRows, Q8Byte, Q8_BLOCK, Q8_BLOCK_BYTES};
use crate::{ModelConfig, BLOCK_SIZE};

/// The element type of the KV cache.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 4 bytes an element: the activations' own precision.
    #[default]
    F32,
    /// IEEE half precision, 2 bytes an element: K and V are rounded to it
    /// as they are written and widened back as attention reads them.
    F16,
    /// bfloat16, 2 bytes an element: f32's range with 8 bits of mantissa
    /// (f16 has 11), rounded to nearest even as written, widened by a shift
    /// as attention reads it.
    BF16,
    /// llama.cpp's q8_0, 34 bytes per 32 elements: per block of 32 columns
    /// of a row an f16 scale (`max |x| / 127`) and 32 int8 values; a row
    /// reads back as scale times value. Needs a head size that is a
    /// multiple of 32.
    Q8_0,
}

impl KvDtype {
    /// What `auto` means (a server's default; [`KvDtype::default`], the
    /// library's, is f32): f16, as llama.cpp keeps K and V. Measured on
    /// SmolLM2 (README.md, "KV cache dtype"): perplexity within 0.3 % of
    /// f32 KV, batch-1 decode at 2,048 tokens of context 1.3x faster,
    /// prefill as fast, half the memory and transfer bytes.
    pub const AUTO: KvDtype = KvDtype::F16;

    /// Bytes of the unit rows are addressed in: an element, or for q8_0
    /// a byte of its blocks.
    pub fn unit_bytes(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::BF16 => 2,
            KvDtype::Q8_0 => 1,
        }
    }

    /// Bytes of one row of `head_dim` elements (one token's K, or V, of
    /// one head and layer).
    pub fn row_bytes(self, head_dim: usize) -> usize {
        match self {
            KvDtype::Q8_0 => head_dim.div_ceil(Q8_BLOCK) * Q8_BLOCK_BYTES,
            other => head_dim * other.unit_bytes(),
        }
    }

    /// The name `--kv-cache-dtype` and the KV layout use.
    pub fn as_str(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::BF16 => "bf16",
            KvDtype::Q8_0 => "q8_0",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    /// `auto` ([`KvDtype::AUTO`]), `f32` (also `float32`), `f16` (also
    /// `float16`, `half`), `bf16` (also `bfloat16`) or `q8_0`.
    fn from_str(s: &str) -> Result<KvDtype, String> {
        match s {
            "auto" => Ok(KvDtype::AUTO),
            "f32" | "float32" | "float" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::BF16),
            "q8_0" => Ok(KvDtype::Q8_0),
            other => Err(format!(
                "KV cache dtype {other:?} is not supported here (supported: auto, f32, f16, bf16, q8_0)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

pub struct KvCache {
    region: Arc<Region>,
    num_blocks: usize,
    num_layers: usize,
    num_kv_heads: usize,
    head_dim: usize,
    dtype: KvDtype,
}

impl KvCache {
    /// Allocates `num_blocks` blocks of `dtype` for `cfg` in a private
    /// `kv_cache` region of `pool` ([`KvCache::new_backed`]).
    pub fn new(
        pool: &Pool,
        cfg: &ModelConfig,
        num_blocks: usize,
        dtype: KvDtype,
    ) -> anyhow::Result<KvCache> {
        Self::new_backed(pool, cfg, num_blocks, dtype, Backing::Private)
    }

    /// Allocates `num_blocks` blocks of `dtype` for `cfg` in a `kv_cache`
    /// region of `pool` held as `backing` says: [`Backing::Shared`] where a
    /// KV connector may hand the blocks to a transfer (registrations pin
    /// and export its memfd chunks), else [`Backing::Private`], whose huge
    /// pages spare attention a page walk for every few rows it reads (the
    /// cache's blocks lie anywhere in a region of gigabytes; under
    /// virtualisation each walk is two-level). In one process, settings
    /// alternating every round (`pdkv bench decode`'s workload, f16 KV):
    /// attention 11 % shorter and decode 9 % faster at a depth of 4,096
    /// (batch 1, Q4_K_M) and of 2,048 (batch 8, Q8_0); the same at 128.
    pub fn new_backed(
        pool: &Pool,
        cfg: &ModelConfig,
        num_blocks: usize,
        dtype: KvDtype,
        backing: Backing,
    ) -> anyhow::Result<KvCache> {
        anyhow::ensure!(num_blocks > 0, "the KV cache needs at least one block");
        anyhow::ensure!(
            dtype != KvDtype::Q8_0 || cfg.head_dim.is_multiple_of(Q8_BLOCK),
            "a q8_0 KV cache needs a head size that is a multiple of {Q8_BLOCK} (this model's is {})",
            cfg.head_dim
        );
        let block_bytes = Self::block_bytes_for(cfg, dtype);
        let region = pool.allocate_backed(Tag::KvCache, block_bytes * num_blocks, backing)?;
        Ok(KvCache {
            region,
            num_blocks,
            num_layers: cfg.num_layers,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            dtype,
        })
    }

    pub fn block_bytes_for(cfg: &ModelConfig, dtype: KvDtype) -> usize {
        cfg.num_layers * 2 * BLOCK_SIZE * cfg.num_kv_heads * dtype.row_bytes(cfg.head_dim)
    }

    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Elements per token per layer in each of K and V: `num_kv_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    pub fn num_kv_heads(&self) -> usize {
        self.num_kv_heads
    }

    /// Bytes of one KV head's part of a block (all layers, K and V).
    pub fn head_bytes(&self) -> usize {
        self.num_layers * 2 * BLOCK_SIZE * self.dtype.row_bytes(self.head_dim)
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
    /// `layer` in `block`: `BLOCK_SIZE` rows of `head_dim` elements.
    pub fn rows_offset(&self, block: usize, head: usize, layer: usize, kv: usize) -> usize {
        debug_assert!(
            block < self.num_blocks
                && head < self.num_kv_heads
                && layer < self.num_layers
                && kv < 2
        );
        (((block * self.num_kv_heads + head) * self.num_layers + layer) * 2 + kv)
            * BLOCK_SIZE
            * self.dtype.row_bytes(self.head_dim)
    }

    /// Reads head `head`'s K or V rows of `layer` in `block`, widened to
    /// `f32`.
    ///
    /// # Safety
    /// No one may write these rows while this runs.
    pub unsafe fn rows(&self, block: usize, head: usize, layer: usize, kv: usize) -> Vec<f32> {
        let at = self.rows_offset(block, head, layer, kv);
        let (hd, rb) = (self.head_dim, self.dtype.row_bytes(self.head_dim));
        // SAFETY: `rows_offset` places the rows inside the region (it checks
        // the indices); the caller guarantees no one writes them meanwhile.
        unsafe {
            let base = self.region.base().add(at);
            let mut out = Vec::with_capacity(BLOCK_SIZE * hd);
            for t in 0..BLOCK_SIZE {
                let row = base.add(t * rb);
                match self.dtype {
                    KvDtype::F32 => out.extend((0..hd).map(|c| f32::get(row.cast(), c))),
                    KvDtype::F16 => out.extend((0..hd).map(|c| half::f16::get(row.cast(), c))),
                    KvDtype::BF16 => out.extend((0..hd).map(|c| half::bf16::get(row.cast(), c))),
                    KvDtype::Q8_0 => out.extend((0..hd).map(|c| Q8Byte::get(row.cast(), c))),
                }
            }
            out
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
        let base = self.region.base();
        let rb = self.dtype.row_bytes(hd);
        for h in 0..self.num_kv_heads {
            for (kv, src) in [(0, &k[h * hd..(h + 1) * hd]), (1, &v[h * hd..(h + 1) * hd])] {
                let at = self.rows_offset(block, h, layer, kv) + slot * rb;
                // SAFETY: the indices were checked above, so the row of `hd`
                // elements at `at` lies inside the region (aligned to its
                // element: every offset is a multiple of it); `src` is not in
                // the region's token rows; the caller guarantees no one else
                // touches these rows.
                unsafe {
                    let dst = base.add(at);
                    match self.dtype {
                        KvDtype::F32 => {
                            std::ptr::copy_nonoverlapping(src.as_ptr(), dst.cast::<f32>(), hd)
                        }
                        KvDtype::F16 => {
                            use half::slice::HalfFloatSliceExt;
                            std::slice::from_raw_parts_mut(dst.cast::<half::f16>(), hd)
                                .convert_from_f32_slice(src)
                        }
                        KvDtype::BF16 => {
                            use half::slice::HalfFloatSliceExt;
                            std::slice::from_raw_parts_mut(dst.cast::<half::bf16>(), hd)
                                .convert_from_f32_slice(src)
                        }
                        KvDtype::Q8_0 => Q8Byte::quantize_row(src, dst),
                    }
                }
            }
        }
    }

    /// Where KV head `kv_head` of `layer` lives for a sequence with
    /// `block_table`, as elements of type `E` (the cache's dtype: checked).
    /// Every id in `block_table` must be `< num_blocks` (checked by the caller).
    pub(crate) fn paged_rows<'a, E: KvElem>(
        &self,
        layer: usize,
        kv_head: usize,
        head_dim: usize,
        block_table: &'a [u32],
    ) -> PagedRows<'a, E> {
        debug_assert_eq!(head_dim, self.head_dim);
        assert_eq!(
            std::mem::size_of::<E>(),
            self.dtype.unit_bytes(),
            "rows of another dtype"
        );
        let eb = self.dtype.unit_bytes();
        let row = self.dtype.row_bytes(self.head_dim) / eb;
        PagedRows {
            base: self
                .region
                .base()
                .wrapping_add(self.rows_offset(0, kv_head, layer, 0))
                .cast::<E>()
                .cast_const(),
            block_table,
            block_size: BLOCK_SIZE,
            block_stride: self.block_bytes() / eb,
            row_stride: row,
            head_offset: 0,
            v_offset: BLOCK_SIZE * row,
        }
    }
}
