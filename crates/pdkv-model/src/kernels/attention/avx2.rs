//! The AVX2 flavour of the attention tiles and its sweeps.

use std::arch::x86_64::*;

use super::{AttnQuery, KvElem, PagedRows, Sweep, KEY_TILE};
use crate::kernels::expf::{exp1, exp8};
use crate::kernels::matmul::avx2::hsum;
use crate::kernels::tile512;

/// Lane `i` of the result is `hsum(v[i])`, with the very same additions:
/// `((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7))`.
///
/// # Safety
/// The CPU has AVX (AVX2 here).
#[inline(always)]
pub(in crate::kernels) unsafe fn hsum8(v: &[__m256; 8]) -> __m256 {
    // SAFETY: the caller guarantees AVX; registers only.
    unsafe {
        // The last step leaves lanes in the order (0, 2, 1, 3) per half, so
        // the inputs go in as 0, 2, 1, 3, 4, 6, 5, 7.
        let (w0, w1) = (halves(v[0], v[4]), halves(v[2], v[6]));
        let (w2, w3) = (halves(v[1], v[5]), halves(v[3], v[7]));
        hsum8_last(w0, w1, w2, w3)
    }
}

/// `[x.lo + x.hi | y.lo + y.hi]`: [`hsum8`]'s first step for two vectors.
///
/// # Safety
/// The CPU has AVX.
#[inline(always)]
unsafe fn halves(x: __m256, y: __m256) -> __m256 {
    // SAFETY: the caller guarantees AVX; registers only.
    unsafe {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(x, y),
            _mm256_permute2f128_ps::<0x31>(x, y),
        )
    }
}

/// [`hsum8`] after its first step: `w0..w3` are [`halves`] of the inputs
/// (0, 4), (2, 6), (1, 5) and (3, 7).
///
/// # Safety
/// The CPU has AVX.
#[inline(always)]
unsafe fn hsum8_last(w0: __m256, w1: __m256, w2: __m256, w3: __m256) -> __m256 {
    // SAFETY: the caller guarantees AVX; registers only.
    unsafe {
        // Per 128-bit lane [b0+b2, b1+b3] of x, then of y: the second step.
        let pairs = |x: __m256, y: __m256| {
            _mm256_add_ps(
                _mm256_shuffle_ps::<0b01_00_01_00>(x, y),
                _mm256_shuffle_ps::<0b11_10_11_10>(x, y),
            )
        };
        let (u, z) = (pairs(w0, w2), pairs(w1, w3));
        _mm256_add_ps(
            _mm256_shuffle_ps::<0b10_00_10_00>(u, z),
            _mm256_shuffle_ps::<0b11_01_11_01>(u, z),
        )
    }
}

/// [`super::sweep_with`] with AVX2 tiles.
///
/// # Safety
/// As [`super::attend_many`]'s; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn sweep<E: KvElem>(
    rows: &PagedRows<'_, E>,
    hd: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    sweep: Sweep,
) {
    // SAFETY: as `attend_many`'s contract, with AVX2 and FMA enabled;
    // each tile gets the rows and the queries the sweep was given, a
    // widened one the rows `fill_rows` copied.
    unsafe {
        super::sweep_generic(
            rows,
            hd,
            scale,
            qs,
            sweep,
            |qs: &mut [AttnQuery], kp, v_offset, hd, scale, t0| {
                // Pairs over a cache of floats only (an f32 cache's prefill
                // reads its rows in place). Over f16 rows, widened once for
                // both, pairs were faster with the rows in cache (3 queries
                // 28-29 -> 30-32 GFLOP/s) but not in batch-1 decode at a
                // depth of 4,096, whose 3-query tasks read rows from memory
                // (71-79 against 79-84 tok/s).
                let floats = std::mem::size_of::<E>() == 4 && hd.is_multiple_of(32);
                let pairs = floats.then_some(Cached { kp, v_offset });
                pipelined(qs, kp, v_offset, hd, scale, t0, pairs)
            },
            super::Wide {
                on: qs.len() > E::WIDEN_PAST,
                len: 2 * KEY_TILE * hd,
                fill: |kp: &[*const E; KEY_TILE], v_offset, buf| {
                    super::fill_rows(kp, v_offset, hd, buf, |src, dst, n| {
                        let n8 = n & !7;
                        for i in (0..n8).step_by(8) {
                            _mm256_storeu_ps(dst.add(i), E::get8(src, i));
                        }
                        for i in n8..n {
                            *dst.add(i) = E::get(src, i);
                        }
                    })
                },
                tile: |qs: &mut [AttnQuery], buf, scale, t0| match hd {
                    // The common heads' sizes as constants: loops of known
                    // length, rows at known offsets.
                    64 => tile_of::<64>(qs, buf, scale, t0),
                    128 => tile_of::<128>(qs, buf, scale, t0),
                    _ => {
                        let rows = super::rows_of(buf, hd);
                        pipelined(qs, &rows, KEY_TILE * hd, hd, scale, t0, None::<Widened<0>>)
                    }
                },
            },
        )
    }
}

/// [`super::sweep_with`] with every tile copied once and computed on
/// AVX-512 registers ([`tile512`]), the bits of [`sweep`]'s.
///
/// # Safety
/// As [`super::attend_many`]'s; the CPU has AVX-512F and DQ, AVX2, FMA
/// and F16C; `hd` is a multiple of 16.
#[target_feature(enable = "avx512f,avx512dq,avx2,fma,f16c")]
pub(super) unsafe fn sweep512<E: KvElem>(
    rows: &PagedRows<'_, E>,
    hd: usize,
    scale: f32,
    qs: &mut [AttnQuery],
    sweep: Sweep,
) {
    // SAFETY: as `attend_many`'s contract, with the instructions
    // enabled and `hd` a multiple of 16; every tile is filled for
    // `tile512::tile` to read, so the narrow kernel is never called.
    unsafe {
        super::sweep_generic(
            rows,
            hd,
            scale,
            qs,
            sweep,
            |qs: &mut [AttnQuery], kp, v_offset, hd, scale, t0| {
                pipelined(qs, kp, v_offset, hd, scale, t0, None::<Widened<0>>)
            },
            super::Wide {
                on: true,
                len: tile512::buffer_len(hd),
                fill: |kp: &[*const E; KEY_TILE], v_offset, buf| {
                    tile512::fill(kp, v_offset, hd, buf)
                },
                tile: |qs: &mut [AttnQuery], buf, scale, t0| {
                    fn part(q: &mut AttnQuery, t0: usize) -> tile512::Query<'_> {
                        tile512::Query {
                            q: q.q,
                            out: q.out,
                            seen: super::seen(q, t0),
                            m: &mut q.m,
                            l: &mut q.l,
                        }
                    }
                    // Queries two at a time, for a kernel that interleaves them.
                    let mut reach = qs.iter_mut().filter(|q| q.pos >= t0);
                    while let Some(a) = reach.next() {
                        match reach.next() {
                            Some(b) => tile512::tile([part(a, t0), part(b, t0)], buf, hd, scale),
                            None => tile512::tile([part(a, t0)], buf, hd, scale),
                        }
                    }
                },
            },
        )
    }
}

/// One tile for the queries of `qs` that reach it (position `t0` on), two
/// at a time when the caller gives the rows as `pairs` (each K and V row
/// loaded once for both: [`scores2`], [`accumulate2`]), software-pipelined:
/// the previous pair's outputs take the tile's V rows between this pair's
/// scores and its probabilities, so the latency of the one (score sums,
/// maximum, exponentials: a long chain of dependent operations) overlaps
/// the multiply-adds of the other. Each query's operations are those it
/// would have alone, in the same order: [`scores`], then [`probs`], then
/// [`accumulate`].
///
/// # Safety
/// The CPU has AVX2 and FMA; `kp`'s rows and their V rows (`v_offset`
/// elements further) hold `hd` readable elements; the `q` of each query
/// reaching the tile points at `hd` readable floats and its `out` at `hd`
/// writable ones, which nothing else touches; `pairs`, if given, reads the
/// same rows' values as floats, and `hd` is a multiple of 32.
#[inline(always)]
unsafe fn pipelined<E: KvElem>(
    qs: &mut [AttnQuery],
    kp: &[*const E; KEY_TILE],
    v_offset: usize,
    hd: usize,
    scale: f32,
    t0: usize,
    pairs: Option<impl TileRows>,
) {
    // SAFETY: as this function's contract.
    unsafe {
        let mut reach = qs.iter_mut().filter(|q| q.pos >= t0);
        let mut last: [Option<(*mut f32, Probs)>; 2] = [None, None];
        while let Some(a) = reach.next() {
            match pairs.and_then(|r| Some((r, reach.next()?))) {
                Some((r, b)) => {
                    let [sa, sb] = scores2([a.q, b.q], r, hd);
                    flush(&mut last, kp, v_offset, hd, pairs);
                    let pa = probs(a, &sa, scale, super::seen(a, t0));
                    let pb = probs(b, &sb, scale, super::seen(b, t0));
                    last = [Some((a.out, pa)), Some((b.out, pb))];
                }
                None => {
                    let s = scores(a.q, kp, hd);
                    flush(&mut last, kp, v_offset, hd, pairs);
                    last = [Some((a.out, probs(a, &s, scale, super::seen(a, t0)))), None];
                }
            }
        }
        flush(&mut last, kp, v_offset, hd, pairs);
    }
}

/// [`pipelined`] over a widened tile (`buf`, [`super::fill_rows`]'s
/// layout) for a head of `HD` floats, a function of its own: loops of
/// known length, rows at known offsets.
///
/// # Safety
/// As [`pipelined`]'s; the CPU has AVX2, FMA and F16C.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline(never)]
unsafe fn tile_of<const HD: usize>(qs: &mut [AttnQuery], buf: *const f32, scale: f32, t0: usize) {
    // SAFETY: as this function's contract.
    unsafe {
        let rows = super::rows_of(buf, HD);
        pipelined(
            qs,
            &rows,
            KEY_TILE * HD,
            HD,
            scale,
            t0,
            Some(Widened::<HD>(buf)),
        )
    }
}

/// The outputs of [`pipelined`]'s previous pair (or single query) take
/// the tile's V rows: both at once where they see the same keys.
///
/// # Safety
/// As [`accumulate`]'s for each; a pair only where `hd` is a multiple of 32.
#[inline(always)]
unsafe fn flush<E: KvElem>(
    last: &mut [Option<(*mut f32, Probs)>; 2],
    kp: &[*const E; KEY_TILE],
    v_offset: usize,
    hd: usize,
    pairs: Option<impl TileRows>,
) {
    // SAFETY: as this function's contract.
    unsafe {
        match (last, pairs) {
            ([Some((oa, pa)), Some((ob, pb))], Some(r)) if pa.seen == pb.seen => {
                accumulate2([*oa, *ob], [pa, pb], r, hd)
            }
            (last, _) => {
                for (out, pr) in last.iter().flatten() {
                    accumulate(*out, pr, kp, v_offset, hd);
                }
            }
        }
    }
}

/// Where [`scores2`] and [`accumulate2`] find a tile's rows of floats:
/// a widened buffer ([`Widened`]) or the cache's rows ([`Cached`]).
trait TileRows: Copy {
    /// Columns `p..p + 8` of key `key`'s K row.
    ///
    /// # Safety
    /// The CPU has AVX; the row holds them.
    unsafe fn k8(self, key: usize, p: usize) -> __m256;
    /// Columns `c..c + 8` of key `key`'s V row.
    ///
    /// # Safety
    /// As for [`Self::k8`].
    unsafe fn v8(self, key: usize, c: usize) -> __m256;
}

/// A widened tile ([`super::fill_rows`]'s layout) of `HD`-float rows:
/// rows at offsets known as the code is compiled.
#[derive(Clone, Copy)]
struct Widened<const HD: usize>(*const f32);

impl<const HD: usize> TileRows for Widened<HD> {
    #[inline(always)]
    unsafe fn k8(self, key: usize, p: usize) -> __m256 {
        // SAFETY: as the trait's contract.
        unsafe { _mm256_loadu_ps(self.0.add(key * HD + p)) }
    }

    #[inline(always)]
    unsafe fn v8(self, key: usize, c: usize) -> __m256 {
        // SAFETY: as the trait's contract.
        unsafe { _mm256_loadu_ps(self.0.add((KEY_TILE + key) * HD + c)) }
    }
}

/// The cache's rows of a tile: K row pointers, V rows `v_offset` further.
#[derive(Clone, Copy)]
struct Cached<'a, E> {
    kp: &'a [*const E; KEY_TILE],
    v_offset: usize,
}

impl<E: KvElem> TileRows for Cached<'_, E> {
    #[inline(always)]
    unsafe fn k8(self, key: usize, p: usize) -> __m256 {
        // SAFETY: as the trait's contract.
        unsafe { E::get8(self.kp[key], p) }
    }

    #[inline(always)]
    unsafe fn v8(self, key: usize, c: usize) -> __m256 {
        // SAFETY: as the trait's contract.
        unsafe { E::get8(self.kp[key].add(self.v_offset), c) }
    }
}

/// [`scores`] for two queries (`hd` a multiple of 8): each K row loaded
/// once for both. Each (query, key) pair's accumulator takes the columns
/// in the order `scores` gives it and goes through [`hsum8`]'s additions
/// (split in its two steps so a half's keys 0, 4, 2, 6 are reduced before
/// 1, 5, 3, 7 are computed): the same bits.
///
/// # Safety
/// The CPU has AVX2 and FMA; `q` are `hd` readable floats each, and `r`'s
/// 16 K rows hold `hd` columns.
#[inline(always)]
unsafe fn scores2(q: [*const f32; 2], r: impl TileRows, hd: usize) -> [[f32; KEY_TILE]; 2] {
    // SAFETY: as this function's contract.
    unsafe {
        let mut s = [[0f32; KEY_TILE]; 2];
        for h in 0..KEY_TILE / 8 {
            let k0 = 8 * h;
            // Keys 0, 4, 2, 6 of the half, then 1, 5, 3, 7: `hsum8`'s
            // first step pairs (0, 4), (2, 6), (1, 5), (3, 7).
            let e = four(q, r, hd, [k0, k0 + 4, k0 + 2, k0 + 6]);
            let (wa0, wa1) = (halves(e[0][0], e[0][1]), halves(e[0][2], e[0][3]));
            let (wb0, wb1) = (halves(e[1][0], e[1][1]), halves(e[1][2], e[1][3]));
            let o = four(q, r, hd, [k0 + 1, k0 + 5, k0 + 3, k0 + 7]);
            let (wa2, wa3) = (halves(o[0][0], o[0][1]), halves(o[0][2], o[0][3]));
            let (wb2, wb3) = (halves(o[1][0], o[1][1]), halves(o[1][2], o[1][3]));
            _mm256_storeu_ps(s[0].as_mut_ptr().add(k0), hsum8_last(wa0, wa1, wa2, wa3));
            _mm256_storeu_ps(s[1].as_mut_ptr().add(k0), hsum8_last(wb0, wb1, wb2, wb3));
        }
        s
    }
}

/// [`scores2`]'s accumulators for four keys of the tile and both queries.
///
/// # Safety
/// As [`scores2`]'s; `keys` are below `KEY_TILE`.
#[inline(always)]
unsafe fn four(
    q: [*const f32; 2],
    r: impl TileRows,
    hd: usize,
    keys: [usize; 4],
) -> [[__m256; 4]; 2] {
    // SAFETY: as this function's contract.
    unsafe {
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut p = 0;
        while p < hd {
            let (qa, qb) = (_mm256_loadu_ps(q[0].add(p)), _mm256_loadu_ps(q[1].add(p)));
            for (i, &key) in keys.iter().enumerate() {
                let k = r.k8(key, p);
                acc[0][i] = _mm256_fmadd_ps(qa, k, acc[0][i]);
                acc[1][i] = _mm256_fmadd_ps(qb, k, acc[1][i]);
            }
            p += 8;
        }
        acc
    }
}

/// [`accumulate`] for two queries that see the same keys (`hd` a
/// multiple of 32): 32 columns of both in registers while they take the
/// positions in order, each V row loaded once for both; each element
/// `fma(p_t, v_t, acc)` in the order `accumulate` gives it.
///
/// # Safety
/// The CPU has AVX2 and FMA; `pr[0].seen == pr[1].seen`; `r`'s first
/// `seen` V rows hold `hd` columns; each `out` is `hd` writable floats
/// nothing else touches.
#[inline(always)]
unsafe fn accumulate2(out: [*mut f32; 2], pr: [&Probs; 2], r: impl TileRows, hd: usize) {
    // SAFETY: as this function's contract.
    unsafe {
        let seen = pr[0].seen;
        let mut c = 0;
        while c < hd {
            let mut acc = [[_mm256_setzero_ps(); 4]; 2];
            for (q, a) in acc.iter_mut().enumerate() {
                for (j, x) in a.iter_mut().enumerate() {
                    *x = pr[q].start(out[q].add(c + 8 * j));
                }
            }
            for t in 0..seen {
                let (pa, pb) = (_mm256_set1_ps(pr[0].ps[t]), _mm256_set1_ps(pr[1].ps[t]));
                let [ya, yb] = &mut acc;
                for (j, (ya, yb)) in ya.iter_mut().zip(yb.iter_mut()).enumerate() {
                    let x = r.v8(t, c + 8 * j);
                    *ya = _mm256_fmadd_ps(pa, x, *ya);
                    *yb = _mm256_fmadd_ps(pb, x, *yb);
                }
            }
            for (q, a) in acc.iter().enumerate() {
                for (j, x) in a.iter().enumerate() {
                    _mm256_storeu_ps(out[q].add(c + 8 * j), *x);
                }
            }
            c += 32;
        }
    }
}

/// A query's raw scores (`q·k`, before the scale) for the tile's 16 keys:
/// 8 keys side by side over the head's columns, reduced in `hsum`'s order
/// (then the columns past a multiple of 8 one by one).
///
/// # Safety
/// The CPU has AVX2 and FMA; `q` and `kp`'s rows hold `hd` readable
/// elements.
#[inline(always)]
unsafe fn scores<E: KvElem>(
    q: *const f32,
    kp: &[*const E; KEY_TILE],
    hd: usize,
) -> [f32; KEY_TILE] {
    // SAFETY: as this function's contract.
    unsafe {
        let hd8 = hd & !7;
        let mut s = [0f32; KEY_TILE];
        for h in 0..KEY_TILE / 8 {
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut p = 0;
            while p < hd8 {
                let qv = _mm256_loadu_ps(q.add(p));
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(qv, E::get8(kp[8 * h + i], p), *a);
                }
                p += 8;
            }
            _mm256_storeu_ps(s.as_mut_ptr().add(8 * h), hsum8(&acc));
        }
        if hd8 < hd {
            for (j, sj) in s.iter_mut().enumerate() {
                for c in hd8..hd {
                    *sj += *q.add(c) * E::get(kp[j], c);
                }
            }
        }
        s
    }
}

/// The tile's V rows into a query's output `out` (its running
/// accumulator) by the probabilities `pr` of the keys it sees: 64
/// columns in registers while they take the positions in order, each
/// element `fma(p_t, v_t, acc)`.
///
/// # Safety
/// The CPU has AVX2 and FMA; the first `pr.seen` rows of `kp` have V rows
/// (`v_offset` elements further) of `hd` readable elements; `out` is `hd`
/// writable floats nothing else touches.
#[inline(always)]
unsafe fn accumulate<E: KvElem>(
    out: *mut f32,
    pr: &Probs,
    kp: &[*const E; KEY_TILE],
    v_offset: usize,
    hd: usize,
) {
    // SAFETY: as this function's contract.
    unsafe {
        let ps = &pr.ps[..pr.seen];
        let mut c = 0;
        while c + 64 <= hd {
            let mut acc = [_mm256_setzero_ps(); 8];
            for (j, a) in acc.iter_mut().enumerate() {
                *a = pr.start(out.add(c + 8 * j));
            }
            for (t, &p) in ps.iter().enumerate() {
                let v = kp[t].add(v_offset);
                let pv = _mm256_set1_ps(p);
                for (j, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(pv, E::get8(v, c + 8 * j), *a);
                }
            }
            for (j, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(out.add(c + 8 * j), *a);
            }
            c += 64;
        }
        while c + 8 <= hd {
            let mut acc = pr.start(out.add(c));
            for (t, &p) in ps.iter().enumerate() {
                acc = _mm256_fmadd_ps(_mm256_set1_ps(p), E::get8(kp[t].add(v_offset), c), acc);
            }
            _mm256_storeu_ps(out.add(c), acc);
            c += 8;
        }
        while c < hd {
            let mut acc = if pr.first {
                0.0
            } else if pr.rescale {
                *out.add(c) * pr.alpha
            } else {
                *out.add(c)
            };
            for (t, &p) in ps.iter().enumerate() {
                acc = p.mul_add(E::get(kp[t].add(v_offset), c), acc);
            }
            *out.add(c) = acc;
            c += 1;
        }
    }
}

/// A query's step of the online softmax over one tile.
struct Probs {
    /// `exp(s - m)` of the keys the query sees (0 past them).
    ps: [f32; KEY_TILE],
    /// How many of the tile's keys the query sees.
    seen: usize,
    /// The tile is the query's first: its accumulator starts at zero.
    first: bool,
    /// The maximum grew: the accumulator is multiplied by `alpha` first.
    rescale: bool,
    alpha: f32,
}

impl Probs {
    /// 8 columns of the accumulator at `at` as the tile starts them: zero
    /// on the first tile, rescaled when the maximum grew, as they are
    /// otherwise (`x * 1` would change nothing).
    ///
    /// # Safety
    /// The CPU has AVX; `at` is 8 readable floats unless `first`.
    #[inline(always)]
    unsafe fn start(&self, at: *const f32) -> __m256 {
        // SAFETY: as this function's contract.
        unsafe {
            if self.first {
                _mm256_setzero_ps()
            } else if self.rescale {
                _mm256_mul_ps(_mm256_loadu_ps(at), _mm256_set1_ps(self.alpha))
            } else {
                _mm256_loadu_ps(at)
            }
        }
    }
}

/// The tile's probabilities for a query from its raw scores `s` (before
/// the scale), of which it sees the first `seen`: the scaled scores, the
/// unseen `-inf`; the new maximum; `p = exp(s - m)` 8 at a time, their
/// sum in `hsum`'s order; the query's maximum and sum updated.
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[inline(always)]
unsafe fn probs(q: &mut AttnQuery, s: &[f32; KEY_TILE], scale: f32, seen: usize) -> Probs {
    // SAFETY: the caller guarantees AVX2 and FMA; `s` is 16 floats.
    unsafe {
        let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        let ninf = _mm256_set1_ps(f32::NEG_INFINITY);
        let sv = _mm256_set1_ps(scale);
        let masked = |h: usize| {
            let keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(seen as i32 - 8 * h as i32), lane);
            let x = _mm256_mul_ps(_mm256_loadu_ps(s.as_ptr().add(8 * h)), sv);
            _mm256_blendv_ps(ninf, x, _mm256_castsi256_ps(keep))
        };
        let (s0, s1) = (masked(0), masked(1));
        // The tile's maximum by a tree (any order gives the same maximum).
        let x = _mm256_max_ps(s0, s1);
        let x = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps::<1>(x));
        let x = _mm_max_ps(x, _mm_movehl_ps(x, x));
        let x = _mm_max_ss(x, _mm_movehdup_ps(x));
        let m = q.m.max(_mm_cvtss_f32(x));
        let mv = _mm256_set1_ps(m);
        let (p0, p1) = (exp8(_mm256_sub_ps(s0, mv)), exp8(_mm256_sub_ps(s1, mv)));
        let sum = hsum(_mm256_add_ps(p0, p1));
        let mut ps = [0f32; KEY_TILE];
        _mm256_storeu_ps(ps.as_mut_ptr(), p0);
        _mm256_storeu_ps(ps.as_mut_ptr().add(8), p1);
        let first = q.m == f32::NEG_INFINITY;
        let alpha = if !first && m > q.m {
            exp1(q.m - m)
        } else {
            1.0
        };
        q.l = if first { sum } else { q.l * alpha + sum };
        q.m = m;
        Probs {
            ps,
            seen,
            first,
            rescale: !first && alpha != 1.0,
            alpha,
        }
    }
}
