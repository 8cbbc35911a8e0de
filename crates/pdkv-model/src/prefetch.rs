//! Cache hints for the streams the hardware's prefetching does not foresee:
//! a tile's weight rows (streams too short for it to pick up) and the KV
//! rows of the coming blocks. A leaf: the kernels import it, it imports
//! nothing of theirs.

/// Tiles ahead that the batch-1 kernels first ask for the weight rows
/// (`qkernels::simd::direct` and the super-block variants,
/// `kernels::blocks`' fused rows). With [`to_l2`], two tiles ahead measured
/// best at batch 1 (against one tile into L1, alternating, medians of 5:
/// Q8_0 +10 %, Q4_1 +6 %, Q4_K_M +4 %): an L1 prefetch holds one of the
/// core's few line-fill buffers until its line arrives, and the weights
/// stream from memory, so those buffers were the limit.
pub(crate) const AHEAD: usize = 2;

/// Asks for bytes `at..at + bytes` of the tile [`AHEAD`] tiles on from
/// the one at `base` (tiles of `tile` bytes), then for the same bytes of
/// the next tile once more: each tile is asked for twice, two tiles ahead
/// and again one ahead, as the attention sweep asks for its KV rows.
/// Batch-1 decode on an AMD Zen 3 (2 threads, steps alternating in one
/// process, medians of 300-450 steps) was 0.5-4 % faster than with the one
/// request in 44 of 44 pairs (Q8_0 5.47-6.99 against 5.59-7.16 ms a step,
/// Q4_1 4.10-5.23 against 4.17-5.44, Q4_K_M 4.88-5.61 against 4.95-5.68),
/// batch 4 about 1 %; a third request, three tiles ahead, made it slower
/// than one, and the second request into L1 instead of L2 changed
/// nothing. A hint: `base` and what follows need not be readable.
#[inline(always)]
pub(crate) fn tiles_ahead(base: *const u8, tile: usize, at: usize, bytes: usize) {
    for ahead in [AHEAD, 1] {
        to_l2(base.wrapping_add(ahead * tile + at), bytes);
    }
}

/// Asks for the cache lines of `bytes` bytes from `p` into L2 (a hint:
/// `p` need not be readable).
#[inline(always)]
pub(crate) fn to_l2(p: *const u8, bytes: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T1};
        let mut o = 0;
        while o < bytes {
            // SAFETY: a prefetch is a hint that never faults, whatever the
            // address; SSE is part of every x86-64 CPU.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(o) as *const i8) };
            o += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, bytes);
}
