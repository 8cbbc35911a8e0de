//! Paged causal attention: tiles of [`KEY_TILE`] keys with an online
//! softmax, swept by all the query heads of a task together (see
//! [`attend_many`]).

use super::elem::KvElem;
#[cfg(target_arch = "x86_64")]
use super::tile512;
use crate::dispatch::{backend, Backend};
use crate::prefetch::to_l2;

#[cfg(target_arch = "x86_64")]
const _: () = assert!(tile512::KEYS == KEY_TILE);

/// Where a KV head's rows live in a paged cache, in elements from `base`:
/// the K row of position `t` is at
/// `block_table[t / block_size] * block_stride + (t % block_size) * row_stride + head_offset`,
/// and the V row `v_offset` elements further.
#[derive(Clone, Copy)]
pub struct PagedRows<'a, E: KvElem = f32> {
    pub base: *const E,
    pub block_table: &'a [u32],
    pub block_size: usize,
    pub block_stride: usize,
    pub row_stride: usize,
    pub head_offset: usize,
    pub v_offset: usize,
}

impl<E: KvElem> PagedRows<'_, E> {
    #[inline(always)]
    pub(crate) fn k_row(&self, t: usize) -> *const E {
        let b = self.block_table[t / self.block_size] as usize;
        let off =
            b * self.block_stride + (t % self.block_size) * self.row_stride + self.head_offset;
        self.base.wrapping_add(off)
    }

    /// The K rows of the tile from position `t0`, those past `last` standing
    /// in for the tile's first: where a tile lies in one block (the block
    /// size a multiple of the tile's), one block lookup for the tile.
    #[inline(always)]
    fn tile_rows(&self, t0: usize, last: usize) -> [*const E; KEY_TILE] {
        if self.block_size.is_multiple_of(KEY_TILE) {
            let first = self.k_row(t0);
            std::array::from_fn(|i| {
                if t0 + i <= last {
                    first.wrapping_add(i * self.row_stride)
                } else {
                    first
                }
            })
        } else {
            std::array::from_fn(|i| self.k_row(if t0 + i <= last { t0 + i } else { t0 }))
        }
    }
}

/// Keys per tile of the online softmax: tiles start at multiples of
/// `KEY_TILE` positions, whatever the queries around them, so a query's
/// arithmetic depends on its position and the cache alone.
pub const KEY_TILE: usize = 16;

/// Keys per segment: a query's keys are taken in segments of this many
/// positions (starting at multiples of it), each with its own online
/// softmax, folded into the query's total in position order ([`fold`]).
/// So a long context's segments can be computed by different threads
/// ([`attend_segment`]) and folded afterwards, with the bits one thread
/// sweeping them all gets ([`attend_many`]).
pub const SEGMENT: usize = 256;

/// A query's running total over the segments folded so far: the maximum
/// score and the sum of `exp(score - m)`; the accumulator is its output row.
#[derive(Clone, Copy, Debug)]
pub struct Total {
    pub m: f32,
    pub l: f32,
}

/// Folds a segment's result (its maximum `m`, sum `l` and accumulator
/// `part`) into a query's total (`total` and its accumulator `acc`); the
/// first segment is copied. One sequence of operations, used by every path
/// that folds segments, so the bits do not depend on which thread computed
/// a segment.
#[inline]
pub fn fold(total: &mut Total, acc: &mut [f32], m: f32, l: f32, part: &[f32], first: bool) {
    if first {
        *total = Total { m, l };
        acc.copy_from_slice(part);
        return;
    }
    let mn = total.m.max(m);
    let (a, b) = ((total.m - mn).exp(), (m - mn).exp());
    total.l = total.l * a + l * b;
    total.m = mn;
    for (x, &p) in acc.iter_mut().zip(part) {
        *x = *x * a + p * b;
    }
}

/// Divides a query's folded accumulator by its sum: its attention output.
#[inline]
pub fn finish(total: &Total, acc: &mut [f32]) {
    let inv = 1.0 / total.l;
    for x in acc {
        *x *= inv;
    }
}

/// One query head of an [`attend_many`] call: its vector (`head_dim`
/// floats, after norm and RoPE), its position (keys `0..=pos` are read) and
/// its output row (`head_dim` floats, also the running accumulator).
#[derive(Clone, Copy)]
pub struct AttnQuery {
    q: *const f32,
    pos: usize,
    out: *mut f32,
    /// Running maximum of the scores seen so far (`-inf` before the first tile).
    m: f32,
    /// Running sum of `exp(score - m)`.
    l: f32,
}

impl AttnQuery {
    pub const EMPTY: AttnQuery = AttnQuery {
        q: std::ptr::null(),
        pos: 0,
        out: std::ptr::null_mut(),
        m: f32::NEG_INFINITY,
        l: 0.0,
    };

    pub fn new(q: *const f32, pos: usize, out: *mut f32) -> Self {
        AttnQuery {
            q,
            pos,
            out,
            ..Self::EMPTY
        }
    }

    /// The maximum and sum of the keys swept so far: after an
    /// [`attend_segment`], that segment's, to [`fold`].
    pub fn partial(&self) -> Total {
        Total {
            m: self.m,
            l: self.l,
        }
    }
}

/// One query head attending over a sequence's cached positions `0..=pos`.
pub struct AttendArgs<'a> {
    /// The query head vector (`head_dim`, after norm and RoPE).
    pub q: &'a [f32],
    /// Position of the query; keys `0..=pos` are read.
    pub pos: usize,
    pub rows: PagedRows<'a>,
    pub scale: f32,
}

/// Causal attention for one (query, head): `out = softmax(q·Kᵀ·scale) · V`,
/// [`attend_many`] with one query.
///
/// # Safety
/// As [`attend_many`]; `out` is `head_dim` floats.
pub unsafe fn attend(args: &AttendArgs<'_>, out: &mut [f32]) {
    // SAFETY: as this function's contract (that of `attend_many`); the
    // query and output rows are `head_dim` floats each (asserted).
    unsafe {
        assert_eq!(args.q.len(), out.len());
        let mut q = [AttnQuery::new(args.q.as_ptr(), args.pos, out.as_mut_ptr())];
        attend_many(&args.rows, args.q.len(), args.scale, &mut q);
    }
}

/// Causal attention for query heads that share one KV head:
/// `out = softmax(q·Kᵀ·scale) · V` for each, by tiles of [`KEY_TILE`] keys
/// with an online softmax (a running maximum and sum; the accumulator is
/// rescaled when the maximum grows), segment by segment ([`SEGMENT`]), each
/// segment [`fold`]ed into the query's total in position order. The tiles
/// sweep every query's keys once: a tile's K and V rows are read from
/// memory once for all the queries, and stay in cache while each of them
/// uses it.
///
/// Each query's operations depend only on its position and the cache (the
/// tiles, the segments, the order of additions in each, where the rescaling
/// happens), not on which other queries share the call nor on whether its
/// segments were computed here or by [`attend_segment`] elsewhere: the bits
/// are the same however a sequence is batched, chunked, preempted or split
/// over threads.
///
/// # Safety
/// `rows` must describe `head_dim` readable floats of K and of V for every
/// position up to the largest `pos`, not written while this runs; each
/// query's `q` must point at `head_dim` readable floats and its `out` at
/// `head_dim` writable floats that nothing else touches meanwhile.
pub unsafe fn attend_many<E: KvElem>(
    rows: &PagedRows<'_, E>,
    head_dim: usize,
    scale: f32,
    qs: &mut [AttnQuery],
) {
    // SAFETY: as this function's contract; `backend()` is one the CPU has.
    unsafe { sweep_with(backend(), rows, head_dim, scale, qs, Sweep::Whole) }
}

/// Segment `seg` of [`attend_many`] alone: keys
/// `seg * SEGMENT ..= min(seg * SEGMENT + SEGMENT - 1, pos)` of each query,
/// which leaves in each query's `out` the segment's accumulator (not yet
/// divided) and in [`AttnQuery::partial`] its maximum and sum, for
/// [`fold`]ing in segment order and [`finish`]ing.
///
/// # Safety
/// As [`attend_many`]'s; every query's `pos` is at least `seg * SEGMENT`.
pub unsafe fn attend_segment<E: KvElem>(
    rows: &PagedRows<'_, E>,
    head_dim: usize,
    scale: f32,
    seg: usize,
    qs: &mut [AttnQuery],
) {
    debug_assert!(qs.iter().all(|q| q.pos >= seg * SEGMENT));
    // SAFETY: as this function's contract; `backend()` is one the CPU has.
    unsafe { sweep_with(backend(), rows, head_dim, scale, qs, Sweep::Segment(seg)) }
}

/// What a sweep computes: every segment of each query, folded and divided,
/// or one segment's partial result.
#[derive(Clone, Copy, Debug)]
pub(super) enum Sweep {
    Whole,
    Segment(usize),
}

/// [`attend_many`] on a given backend (one the CPU has).
///
/// # Safety
/// As [`attend_many`]'s; the CPU has `be`'s instructions.
#[cfg(test)]
pub(super) unsafe fn attend_many_with<E: KvElem>(
    be: Backend,
    rows: &PagedRows<'_, E>,
    head_dim: usize,
    scale: f32,
    qs: &mut [AttnQuery],
) {
    // SAFETY: as this function's contract.
    unsafe { sweep_with(be, rows, head_dim, scale, qs, Sweep::Whole) }
}

/// A [`Sweep`] on a given backend (one the CPU has).
///
/// # Safety
/// As [`attend_many`]'s (and [`attend_segment`]'s for a segment); the CPU
/// has `be`'s instructions.
pub(super) unsafe fn sweep_with<E: KvElem>(
    be: Backend,
    rows: &PagedRows<'_, E>,
    head_dim: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    sweep: Sweep,
) {
    let widened = qs.len() > E::WIDEN_PAST;
    #[cfg(target_arch = "x86_64")]
    let wide512 =
        qs.len() > tile512::WIDEN_PAST && head_dim.is_multiple_of(16) && tile512::available();
    match be {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2Fma if wide512 => {
            // SAFETY: as this function's contract, with AVX-512F and DQ,
            // AVX2, FMA and F16C present and a head of whole 16-float
            // registers.
            unsafe { avx2::sweep512(rows, head_dim, scale, qs, sweep) }
        }
        // SAFETY: as this function's contract, with AVX2 and FMA present.
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2Fma => unsafe { avx2::sweep(rows, head_dim, scale, qs, sweep) },
        // SAFETY: as this function's contract; each tile gets the rows and
        // the query the sweep was given, a widened one the rows `fill_rows`
        // copied.
        _ => unsafe {
            sweep_generic(
                rows,
                head_dim,
                scale,
                qs,
                sweep,
                |qs: &mut [AttnQuery], kp, v_offset, hd, scale, t0| {
                    for q in qs.iter_mut().filter(|q| q.pos >= t0) {
                        let seen = seen(q, t0);
                        portable::attend_tile(q, kp, v_offset, hd, scale, seen)
                    }
                },
                Wide {
                    on: widened,
                    len: 2 * KEY_TILE * head_dim,
                    fill: |kp: &[*const E; KEY_TILE], v_offset, buf| {
                        fill_rows(kp, v_offset, head_dim, buf, |src, dst, n| {
                            for i in 0..n {
                                *dst.add(i) = E::get(src, i);
                            }
                        })
                    },
                    tile: |qs: &mut [AttnQuery], buf, scale, t0| {
                        let kp = rows_of(buf, head_dim);
                        for q in qs.iter_mut().filter(|q| q.pos >= t0) {
                            let seen = seen(q, t0);
                            portable::attend_tile(
                                q,
                                &kp,
                                KEY_TILE * head_dim,
                                head_dim,
                                scale,
                                seen,
                            )
                        }
                    },
                },
            )
        },
    }
}

/// [`sweep_with`] on the AVX2 tiles alone, for tests that compare them with
/// the AVX-512 tile.
///
/// # Safety
/// As [`sweep_with`]'s, with AVX2, FMA and F16C.
#[cfg(all(test, target_arch = "x86_64"))]
pub(super) unsafe fn sweep_avx2<E: KvElem>(
    rows: &PagedRows<'_, E>,
    head_dim: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    sweep: Sweep,
) {
    // SAFETY: as this function's contract.
    unsafe { avx2::sweep(rows, head_dim, scale, qs, sweep) }
}

/// How a sweep reads a tile that many queries share: whether it copies the
/// tile's rows as floats (`on`) into a buffer of `len` floats (`fill`: the
/// tile's K row pointers, the V rows' offset, the buffer), and the tile
/// kernel that reads that buffer (`tile`: the sweep's queries, of which
/// those whose position reaches the tile take it, in order; the buffer,
/// the scale, the tile's first position).
struct Wide<F, T> {
    on: bool,
    len: usize,
    fill: F,
    tile: T,
}

/// The widened layout of the AVX2 and portable tiles: the 16 K rows, then
/// their 16 V rows, `hd` floats each, each row copied by `widen`.
///
/// # Safety
/// `kp`'s rows and their V rows (`v_offset` elements further) hold `hd`
/// readable elements; `buf` is `2 * KEY_TILE * hd` writable floats;
/// `widen` writes `n` floats for `n` readable elements.
#[inline(always)]
unsafe fn fill_rows<E: KvElem>(
    kp: &[*const E; KEY_TILE],
    v_offset: usize,
    hd: usize,
    buf: *mut f32,
    widen: impl Fn(*const E, *mut f32, usize),
) {
    // SAFETY: as this function's contract.
    unsafe {
        for (i, &k) in kp.iter().enumerate() {
            widen(k, buf.add(i * hd), hd);
            widen(k.add(v_offset), buf.add((KEY_TILE + i) * hd), hd);
        }
    }
}

/// Asks for the K rows `kp` of a coming tile (and their V rows, `v_offset`
/// elements further; `row_bytes` each) to be brought into L2
/// while the queries work on this tile: the next tile's rows sit in a
/// block of their own, which the hardware's prefetching does not foresee
/// (batch-1 decode at a depth of 4,096 waited on those loads; 4 of 4
/// paired runs 3-11 % faster with the hint). Into L2, not L1: an L1
/// prefetch holds one of the core's few line-fill buffers until its line
/// arrives, and `perf` put most of the sweep's samples on those
/// prefetches; attention's time per batch-1 step (Q8_0, alternating, 2
/// threads) went 2.45-2.63 -> 2.34-2.39 ms at a depth of 1,024 (3 runs
/// each), 10.8-11.1 -> 10.4-10.6 ms at 4,096 (2 each), unchanged at 128.
///
/// The sweep asks for each tile twice: two tiles ahead, then again one
/// ahead. On an AMD Zen 3 (2 threads, f16 KV, steps alternating in one
/// process, medians) that made decode steps at a depth of 8,128 tokens
/// 10-12 % shorter (Q8_0 22.5-23.4 against 25.4-26.3 ms, Q4_K_M
/// 18.0-22.4 against 20.4-25.2), at 4,096 8-12 % (batch 8: 87-88 against
/// 100-101 ms), batch 32 at 2,048 12 % (226 against 256 ms), batch 1 at
/// 1,024 5 % and at 128 about 1 %; prefill of 8,192 tokens unchanged.
/// Asking once, two, three or four tiles ahead (the first tiles asked for
/// as a segment starts), or twice one tile ahead, was no faster than once
/// one ahead; one, two and three ahead was slower than one and two. A
/// likely reading: a hint that finds the core's queue of misses full is
/// dropped, and the second request, a tile later, finds room. A hint:
/// nothing is read.
#[inline(always)]
fn prefetch_rows<E: KvElem>(kp: &[*const E], v_offset: usize, row_bytes: usize) {
    for &k in kp {
        to_l2(k.cast(), row_bytes);
        to_l2(k.wrapping_add(v_offset).cast(), row_bytes);
    }
}

/// How many of the tile from position `t0` a query sees.
#[inline(always)]
fn seen(q: &AttnQuery, t0: usize) -> usize {
    (q.pos + 1 - t0).min(KEY_TILE)
}

/// The K rows of a buffer [`fill_rows`] wrote (their V rows are
/// `KEY_TILE * hd` floats further).
#[inline(always)]
fn rows_of(buf: *const f32, hd: usize) -> [*const f32; KEY_TILE] {
    std::array::from_fn(|i| buf.wrapping_add(i * hd))
}

/// The sweep of [`attend_many`] and [`attend_segment`]: per segment, tiles
/// in position order, every query that reaches a tile taking it in turn;
/// for a whole sweep, each segment folded into the query's total, then the
/// division by the sum. `tile` takes the sweep's queries (those whose
/// position reaches the tile take it, in order), the tile's 16 K row
/// pointers (the V row is `v_offset` elements further), the head size, the
/// scale and the tile's first position; when `wide.on`, each tile is
/// copied once for all the queries by `wide.fill` and read by `wide.tile`
/// instead.
///
/// # Safety
/// As [`attend_many`]'s (and [`attend_segment`]'s for a segment), for `hd`
/// elements per row; `tile` computes one tile for the queries that reach
/// it within that contract, `wide.tile` the same over a buffer of
/// `wide.len` floats that `wide.fill` wrote from the tile's rows.
#[inline(always)]
unsafe fn sweep_generic<E: KvElem>(
    rows: &PagedRows<'_, E>,
    hd: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    sweep: Sweep,
    tile: impl Fn(&mut [AttnQuery], &[*const E; KEY_TILE], usize, usize, f32, usize),
    wide: Wide<
        impl Fn(&[*const E; KEY_TILE], usize, *mut f32),
        impl Fn(&mut [AttnQuery], *const f32, f32, usize),
    >,
) {
    // SAFETY: the caller guarantees `attend_many`'s contract: the rows
    // of every position up to the largest `pos` are readable, and each
    // query's `out` is `hd` writable floats no one else touches.
    unsafe {
        let Some(max_pos) = qs.iter().map(|q| q.pos).max() else {
            return;
        };
        // A tile read by many queries may be copied as floats once for all
        // of them; read by a few, each query reads (and widens) the rows as
        // it loads them. The arithmetic, so the bits, are the same either way.
        let mut buf = vec![0f32; if wide.on { wide.len } else { 0 }];
        let mut kp = [std::ptr::null(); KEY_TILE];
        // One segment for the queries that reach it, each starting afresh.
        let mut segment = |qs: &mut [AttnQuery], seg: usize| {
            let t_lo = seg * SEGMENT;
            let t_hi = (t_lo + SEGMENT - 1).min(max_pos);
            for q in qs.iter_mut().filter(|q| q.pos >= t_lo) {
                q.m = f32::NEG_INFINITY;
                q.l = 0.0;
            }
            // Each tile's row pointers are worked out once, two tiles
            // ahead, where they are first asked for; rows past the last
            // query's position are not read: their slots point at the
            // tile's first row, and every query masks them. (Working them
            // out for every request took a lone query's sweep over rows in
            // cache from 21-22 down to 18 GFLOP/s on an AMD Zen 3; over
            // rows from memory, that sweep measured 12.8 against 10-11
            // GFLOP/s the other way round, but a batch-1 step's lone
            // queries sweep short contexts its first query head brought
            // into cache.)
            let ahead = |t: usize| (t <= t_hi).then(|| rows.tile_rows(t, max_pos));
            let mut next = [ahead(t_lo + KEY_TILE), None];
            kp = rows.tile_rows(t_lo, max_pos);
            for t0 in (t_lo..=t_hi).step_by(KEY_TILE) {
                next[1] = ahead(t0 + 2 * KEY_TILE);
                // The next two tiles' rows (up to the segment's last): each
                // tile is asked for twice, two tiles ahead and again one
                // ahead (see `prefetch_rows`).
                for (a, p) in next.iter().enumerate() {
                    if let Some(p) = p {
                        let t = t0 + (a + 1) * KEY_TILE;
                        let n = (t_hi + 1 - t).min(KEY_TILE);
                        prefetch_rows(&p[..n], rows.v_offset, E::row_bytes(hd));
                    }
                }
                if wide.on {
                    (wide.fill)(&kp, rows.v_offset, buf.as_mut_ptr());
                }
                if wide.on {
                    (wide.tile)(qs, buf.as_ptr(), scale, t0);
                } else {
                    tile(qs, &kp, rows.v_offset, hd, scale, t0);
                }
                if let Some(p) = next[0] {
                    kp = p;
                }
                next = [next[1], None];
            }
        };
        let out = |q: &AttnQuery| std::slice::from_raw_parts_mut(q.out, hd);
        match sweep {
            Sweep::Segment(seg) => segment(qs, seg),
            // One segment: accumulated in place, as folding its copy would.
            Sweep::Whole if max_pos < SEGMENT => {
                segment(qs, 0);
                for q in qs.iter() {
                    finish(&q.partial(), out(q));
                }
            }
            Sweep::Whole => {
                let mut part = vec![0f32; qs.len() * hd];
                let mut work: Vec<AttnQuery> = qs
                    .iter()
                    .enumerate()
                    .map(|(i, q)| AttnQuery {
                        out: part.as_mut_ptr().add(i * hd),
                        ..*q
                    })
                    .collect();
                let mut totals = vec![AttnQuery::EMPTY.partial(); qs.len()];
                for seg in 0..=max_pos / SEGMENT {
                    segment(&mut work, seg);
                    for ((q, w), total) in qs.iter().zip(&work).zip(&mut totals) {
                        if q.pos >= seg * SEGMENT {
                            let p = std::slice::from_raw_parts(w.out, hd);
                            fold(total, out(q), w.m, w.l, p, seg == 0);
                        }
                    }
                }
                for (q, total) in qs.iter().zip(&totals) {
                    finish(total, out(q));
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;

mod portable {
    use super::KvElem;
    use crate::kernels::matmul::portable::dot;

    /// # Safety
    /// `acc` points at `k` writable floats and `v` at `k` readable
    /// elements, not overlapping.
    pub(super) unsafe fn axpy<E: KvElem>(acc: *mut f32, p: f32, v: *const E, k: usize) {
        // SAFETY: the caller guarantees that `acc` and `v` hold `k` floats and
        // do not overlap.
        unsafe {
            for t in 0..k {
                *acc.add(t) += p * E::get(v, t);
            }
        }
    }

    /// One tile of [`super::attend_many`] for one query: `seen` of the
    /// tile's keys, scalar operations in a fixed order.
    ///
    /// # Safety
    /// The first `seen` rows of `kp` and their V rows (`v_offset` floats
    /// further) hold `hd` readable floats; `q.q` points at `hd` readable floats
    /// and `q.out` at `hd` writable ones nothing else touches.
    pub(super) unsafe fn attend_tile<E: KvElem>(
        q: &mut super::AttnQuery,
        kp: &[*const E; super::KEY_TILE],
        v_offset: usize,
        hd: usize,
        scale: f32,
        seen: usize,
    ) {
        // SAFETY: the caller guarantees `attend_many`'s contract: the first
        // `seen` rows of `kp` and their V rows hold `hd` readable floats; `q.q`
        // is `hd` readable floats and `q.out` `hd` writable ones.
        unsafe {
            let mut s = [0f32; super::KEY_TILE];
            for (j, sj) in s.iter_mut().enumerate().take(seen) {
                *sj = dot(q.q, kp[j], hd) * scale;
            }
            let m = s[..seen].iter().fold(q.m, |m, &v| m.max(v));
            let mut sum = 0f32;
            for sj in &mut s[..seen] {
                *sj = (*sj - m).exp();
                sum += *sj;
            }
            let first = q.m == f32::NEG_INFINITY;
            if first {
                std::slice::from_raw_parts_mut(q.out, hd).fill(0.0);
                q.l = sum;
            } else if m > q.m {
                let alpha = (q.m - m).exp();
                for c in 0..hd {
                    *q.out.add(c) *= alpha;
                }
                q.l = q.l * alpha + sum;
            } else {
                q.l += sum;
            }
            q.m = m;
            for (j, &p) in s.iter().enumerate().take(seen) {
                axpy(q.out, p, kp[j].add(v_offset), hd);
            }
        }
    }
}
