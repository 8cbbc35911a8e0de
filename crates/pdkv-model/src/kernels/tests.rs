#[cfg(target_arch = "x86_64")]
use super::attention::avx2;
use super::attention::{attend_many_with, sweep_with, Sweep};
use super::blocks::dequantize_row;
use super::*;

/// Deterministic pseudo-random floats in [-1, 1).
pub(crate) fn rand_vec(seed: u64, n: usize) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// A rayon pool of `threads` threads, for tests that run a kernel under
/// several.
pub(crate) fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("a rayon pool")
}

/// For the benches: the best of 5 timings of `f` (after one untimed
/// call), each the mean of as many calls as fill `min_secs`, in seconds.
pub(crate) fn best_seconds(f: &mut dyn FnMut(), min_secs: f64) -> f64 {
    f();
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = std::time::Instant::now();
        let mut reps = 0;
        while t.elapsed().as_secs_f64() < min_secs || reps == 0 {
            f();
            reps += 1;
        }
        best = best.min(t.elapsed().as_secs_f64() / reps as f64);
    }
    best
}

fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
    let mut y = vec![0f64; m * n];
    for r in 0..m {
        for j in 0..n {
            y[r * n + j] = (0..k)
                .map(|t| x[r * k + t] as f64 * w[j * k + t] as f64)
                .sum();
        }
    }
    y
}

fn run(be: Backend, x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; m * n];
    matmul_many_with(be, x, m, k, &mut [Linear { w, n, y: &mut y }]);
    y
}

fn backends() -> Vec<Backend> {
    let mut v = vec![Backend::Portable];
    if backend() == Backend::Avx2Fma {
        v.push(Backend::Avx2Fma);
    }
    v
}

#[test]
fn block_matmul_equals_f32_matmul_on_the_dequantised_weights_bit_for_bit() {
    use crate::qtype::QType;
    let (k, n) = (96, 29);
    for ty in QType::ALL.into_iter().chain([QType::F16, QType::BF16]) {
        // Random blocks: f16 scales (and minima) from random values, random
        // codes; 16-bit floats from random values.
        let vals = rand_vec(11, n * k);
        let mut blocks = vec![0u8; n * ty.row_bytes(k)];
        for (row, out) in vals.chunks(k).zip(blocks.chunks_mut(ty.row_bytes(k))) {
            crate::quantize::quantize_row(ty, row, out);
        }
        let mut deq = vec![0f32; n * k];
        crate::gguf::dequantize(crate::qtype::ggml_type(ty), &blocks, &mut deq).unwrap();
        for be in backends() {
            for m in [1usize, 2, 3, 4, 5, 8, 33, 70] {
                let x = rand_vec(m as u64, m * k);
                let want = run(be, &x, m, k, &deq, n);
                let mut got = vec![0f32; m * n];
                matmul_blocks_many_with(
                    be,
                    &x,
                    m,
                    k,
                    &mut [BlockLinear {
                        ty,
                        w: &blocks,
                        n,
                        y: &mut got,
                    }],
                );
                assert_eq!(
                    got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                    "{ty:?} {be:?} m={m}"
                );
            }
            // The dequantiser of the backend equals the scalar one.
            let mut row = vec![0f32; k];
            dequantize_row(be, ty, &blocks[..ty.row_bytes(k)], &mut row);
            assert_eq!(row, deq[..k], "{ty:?} {be:?}");
        }
    }
}

#[test]
fn matmul_matches_f64_reference() {
    for be in backends() {
        for &(m, k, n) in &[
            (1, 8, 1),
            (5, 37, 7),
            (13, 64, 10),
            (40, 200, 33),
            (3, 1, 4),
        ] {
            let x = rand_vec(1, m * k);
            let w = rand_vec(2, n * k);
            let y = run(be, &x, m, k, &w, n);
            let r = reference(&x, m, k, &w, n);
            for (a, b) in y.iter().zip(&r) {
                assert!(
                    (*a as f64 - b).abs() <= 1e-5 * (1.0 + b.abs()),
                    "{be:?} m={m} k={k} n={n}: {a} vs {b}"
                );
            }
        }
    }
}

#[test]
fn matmul_rows_are_bit_identical_for_every_m_and_position() {
    let (k, n) = (75, 23);
    let w = rand_vec(3, n * k);
    let pool_rows = rand_vec(4, 40 * k);
    for be in backends() {
        // Each row computed alone is the reference.
        let alone: Vec<Vec<f32>> = (0..40)
            .map(|r| run(be, &pool_rows[r * k..(r + 1) * k], 1, k, &w, n))
            .collect();
        for m in 1..=40 {
            // Rows taken from a rotating window so every row lands at many offsets.
            for shift in [0, 1, 3, 7] {
                let idx: Vec<usize> = (0..m).map(|i| (i + shift * m) % 40).collect();
                let x: Vec<f32> = idx
                    .iter()
                    .flat_map(|&r| pool_rows[r * k..(r + 1) * k].to_vec())
                    .collect();
                let y = run(be, &x, m, k, &w, n);
                for (i, &r) in idx.iter().enumerate() {
                    let got: Vec<u32> = y[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                    let want: Vec<u32> = alone[r].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(got, want, "{be:?}: row {r} at position {i} of m={m}");
                }
            }
        }
    }
}

#[test]
fn matmul_is_independent_of_thread_count() {
    let (m, k, n) = (37, 130, 301);
    let x = rand_vec(5, m * k);
    let w = rand_vec(6, n * k);
    for be in backends() {
        let mut results = Vec::new();
        for threads in [1, 2, 3, 5, 8] {
            let pool = pool(threads);
            let y = pool.install(|| run(be, &x, m, k, &w, n));
            results.push(y.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
        }
        assert!(
            results.windows(2).all(|p| p[0] == p[1]),
            "{be:?}: results differ across thread counts"
        );
    }
}

#[test]
fn matmul_many_equals_separate_products() {
    let (m, k) = (9, 48);
    let x = rand_vec(7, m * k);
    let w1 = rand_vec(8, 17 * k);
    let w2 = rand_vec(9, 5 * k);
    let (mut y1, mut y2) = (vec![0f32; m * 17], vec![0f32; m * 5]);
    matmul_many(
        &x,
        m,
        k,
        &mut [
            Linear {
                w: &w1,
                n: 17,
                y: &mut y1,
            },
            Linear {
                w: &w2,
                n: 5,
                y: &mut y2,
            },
        ],
    );
    let (mut z1, mut z2) = (vec![0f32; m * 17], vec![0f32; m * 5]);
    matmul(&x, m, k, &w1, 17, &mut z1);
    matmul(&x, m, k, &w2, 5, &mut z2);
    assert_eq!(y1, z1);
    assert_eq!(y2, z2);
}

#[test]
fn dot_matches_single_row_matmul() {
    let k = 67;
    let a = rand_vec(10, k);
    let b = rand_vec(11, k);
    let mut y = [0f32];
    matmul(&a, 1, k, &b, 1, &mut y);
    assert_eq!(dot(&a, &b).to_bits(), y[0].to_bits());
}

#[cfg(target_arch = "x86_64")]
#[test]
fn hsum8_lanes_are_hsum_bit_for_bit() {
    if backend() != Backend::Avx2Fma {
        return;
    }
    for seed in 0..200 {
        let vals = rand_vec(100 + seed, 64);
        // Wide exponent spread, so any change in the order of additions shows.
        let vals: Vec<f32> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| v * 2f32.powi((i % 13) as i32 * 3 - 18))
            .collect();
        // SAFETY: AVX2 is present (the backend); 64 floats are read.
        unsafe {
            use std::arch::x86_64::*;
            let v: [__m256; 8] = std::array::from_fn(|i| _mm256_loadu_ps(vals.as_ptr().add(8 * i)));
            let mut got = [0f32; 8];
            _mm256_storeu_ps(got.as_mut_ptr(), avx2::hsum8(&v));
            for i in 0..8 {
                assert_eq!(
                    got[i].to_bits(),
                    crate::kernels::matmul::avx2::hsum(v[i]).to_bits(),
                    "seed {seed} lane {i}"
                );
            }
        }
    }
}

#[test]
fn attend_matches_an_f64_softmax_over_paged_rows() {
    // Two heads of `hd` in rows of `2*hd + 8` floats (V a slab of K rows
    // further), in blocks of 8 positions laid out out of order; head
    // sizes that take every path of the kernels (64-, 32-, 8-wide, single).
    for hd in [16, 20, 64, 72, 100] {
        let (row_stride, block_size) = (2 * hd + 8, 8);
        let table = [3u32, 0, 2, 1, 4];
        let slab = block_size * row_stride;
        let kv = rand_vec(21, table.len() * 2 * slab);
        let q = rand_vec(22, hd);
        for head in 0..2 {
            let rows = PagedRows {
                base: kv.as_ptr(),
                block_table: &table,
                block_size,
                block_stride: 2 * slab,
                row_stride,
                head_offset: head * hd,
                v_offset: slab,
            };
            for pos in [0, 6, 7, 8, 15, 16, 30, 39] {
                let mut out = vec![0f32; hd];
                // SAFETY: every position up to 39 has K and V rows in `kv`.
                unsafe {
                    attend(
                        &AttendArgs {
                            q: &q,
                            pos,
                            rows,
                            scale: 0.25,
                        },
                        &mut out,
                    )
                };
                let k_off = |t: usize| {
                    table[t / block_size] as usize * 2 * slab
                        + (t % block_size) * row_stride
                        + head * hd
                };
                let (want, _) = f64_attention(&kv, &q, pos, 0.25, k_off, slab);
                for c in 0..hd {
                    let want = want[c];
                    assert!(
                        (out[c] as f64 - want).abs() < 1e-5,
                        "hd {hd} head {head} pos {pos} dim {c}: {} vs {want}",
                        out[c]
                    );
                }
            }
        }
    }
}

/// A paged cache of `blocks` blocks of `block_size` positions for one
/// head (K rows then V rows per block), in a scrambled block order, with
/// keys whose scale grows along the positions so the running maximum of
/// the online softmax moves on many tiles; and the f64 answer.
struct Cache {
    kv: Vec<f32>,
    table: Vec<u32>,
    block_size: usize,
    hd: usize,
    /// Times the running maximum grew on a later tile, over `reference` calls.
    grows: std::cell::Cell<usize>,
}

impl Cache {
    fn new(seed: u64, blocks: usize, block_size: usize, hd: usize) -> Cache {
        let mut kv = rand_vec(seed, blocks * 2 * block_size * hd);
        for (b, blk) in kv.chunks_mut(2 * block_size * hd).enumerate() {
            // Block slot b holds positions of table index (b * 7) % blocks.
            let first = ((b * 7) % blocks) * block_size;
            for (t, row) in blk[..block_size * hd].chunks_mut(hd).enumerate() {
                let g = 1.0 + (first + t) as f32 / 8.0;
                row.iter_mut().for_each(|x| *x *= g);
            }
        }
        let mut table = vec![0u32; blocks];
        for b in 0..blocks {
            table[(b * 7) % blocks] = b as u32;
        }
        Cache {
            kv,
            table,
            block_size,
            hd,
            grows: Default::default(),
        }
    }

    fn rows(&self) -> PagedRows<'_> {
        PagedRows {
            base: self.kv.as_ptr(),
            block_table: &self.table,
            block_size: self.block_size,
            block_stride: 2 * self.block_size * self.hd,
            row_stride: self.hd,
            head_offset: 0,
            v_offset: self.block_size * self.hd,
        }
    }

    fn reference(&self, q: &[f32], pos: usize, scale: f64) -> Vec<f64> {
        let off = |t: usize| {
            self.table[t / self.block_size] as usize * 2 * self.block_size * self.hd
                + (t % self.block_size) * self.hd
        };
        let (out, s) = f64_attention(&self.kv, q, pos, scale, off, self.block_size * self.hd);
        // Tiles after the first whose maximum beats every earlier score.
        let grows = s
            .chunks(KEY_TILE)
            .scan(f64::NEG_INFINITY, |m, tile| {
                let t = tile.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let up = t > *m && *m > f64::NEG_INFINITY;
                *m = m.max(t);
                Some(up)
            })
            .filter(|&up| up)
            .count();
        self.grows.set(self.grows.get() + grows);
        out
    }
}

/// Softmax attention in f64 of `q` over positions `0..=pos` whose K row
/// starts at `kv[k_off(t)]` and V row `v_delta` floats further: the
/// output row and the scaled scores.
fn f64_attention(
    kv: &[f32],
    q: &[f32],
    pos: usize,
    scale: f64,
    k_off: impl Fn(usize) -> usize,
    v_delta: usize,
) -> (Vec<f64>, Vec<f64>) {
    let s: Vec<f64> = (0..=pos)
        .map(|t| {
            scale
                * q.iter()
                    .zip(&kv[k_off(t)..])
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
        })
        .collect();
    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
    let z: f64 = e.iter().sum();
    let out = (0..q.len())
        .map(|c| {
            (0..=pos)
                .map(|t| e[t] / z * kv[k_off(t) + v_delta + c] as f64)
                .sum()
        })
        .collect();
    (out, s)
}

#[test]
fn online_softmax_matches_f64_over_long_contexts_with_a_growing_maximum() {
    for be in backends() {
        for (hd, block_size) in [(64, 16), (128, 16), (64, 8), (20, 32)] {
            let cache = Cache::new(31, 20, block_size, hd);
            let n = 20 * block_size;
            let q: Vec<f32> = rand_vec(32, hd).iter().map(|x| x * 3.0).collect();
            for pos in [0, 15, 16, 17, 100, n / 2, n - 1] {
                let mut out = vec![f32::NAN; hd];
                let mut qs = [AttnQuery::new(q.as_ptr(), pos, out.as_mut_ptr())];
                // SAFETY: the cache holds K and V for every position < n.
                unsafe { attend_many_with(be, &cache.rows(), hd, 0.3, &mut qs) };
                let want = cache.reference(&q, pos, 0.3);
                for c in 0..hd {
                    let tol = 2e-5 * (1.0 + want[c].abs());
                    assert!(
                        (out[c] as f64 - want[c]).abs() < tol,
                        "{be:?} hd {hd} bs {block_size} pos {pos} dim {c}: {} vs {}",
                        out[c],
                        want[c]
                    );
                }
            }
            assert!(
                cache.grows.get() >= 10,
                "hd {hd}: the maximum grew on {} later tiles only",
                cache.grows.get()
            );
        }
    }
}

/// A query's output has the same bits alone and in a sweep with others
/// (at scattered positions, so the queries paired on a
/// tile see different numbers of its keys), over an f32 cache (read in
/// place) and an f16 one (many queries: each tile widened once and taken
/// two queries at a time).
#[test]
fn a_query_gets_the_same_bits_whatever_queries_share_its_sweep() {
    for be in backends() {
        for hd in [64, 128, 24, 20, 72, 96] {
            let cache = Cache::new(41, 12, 16, hd);
            let halves: Vec<half::f16> = cache.kv.iter().map(|&x| half::f16::from_f32(x)).collect();
            let f32_rows = cache.rows();
            let f16_rows = retyped(&f32_rows, halves.as_ptr());
            // SAFETY: both caches hold K and V for 12 blocks of 16 positions.
            unsafe {
                same_bits_whatever_shares_the_sweep(be, &f32_rows, hd, 12 * 16, "f32");
                same_bits_whatever_shares_the_sweep(be, &f16_rows, hd, 12 * 16, "f16");
            }
        }
    }
}

/// 40 query heads at scattered positions below `n`, as a prefill chunk or
/// a decode batch would bring them: each alone, then all in sweeps of 40,
/// 7, 3 (rows read in place, not widened: on an f32 cache a pair and one)
/// and 1, with the same bits.
///
/// # Safety
/// `rows` holds `hd` readable elements of K and of V for positions `0..n`.
unsafe fn same_bits_whatever_shares_the_sweep<E: KvElem>(
    be: Backend,
    rows: &PagedRows<'_, E>,
    hd: usize,
    n: usize,
    what: &str,
) {
    let qv: Vec<Vec<f32>> = (0..40).map(|i| rand_vec(500 + i, hd)).collect();
    let pos: Vec<usize> = (0..40).map(|i| (i * 37 + 5) % n).collect();
    let alone: Vec<Vec<f32>> = (0..40)
        .map(|i| {
            let mut out = vec![0f32; hd];
            let mut qs = [AttnQuery::new(qv[i].as_ptr(), pos[i], out.as_mut_ptr())];
            // SAFETY: positions are below n.
            unsafe { attend_many_with(be, rows, hd, 0.125, &mut qs) };
            out
        })
        .collect();
    for split in [40, 7, 3, 1] {
        let mut outs = vec![vec![f32::NAN; hd]; 40];
        let mut qs: Vec<AttnQuery> = outs
            .iter_mut()
            .enumerate()
            .map(|(i, o)| AttnQuery::new(qv[i].as_ptr(), pos[i], o.as_mut_ptr()))
            .collect();
        for part in qs.chunks_mut(split) {
            // SAFETY: as above; outputs are distinct.
            unsafe { attend_many_with(be, rows, hd, 0.125, part) };
        }
        for i in 0..40 {
            assert_eq!(
                bits(&outs[i]),
                bits(&alone[i]),
                "{be:?} {what} hd {hd} split {split}: query {i} at {} differs",
                pos[i]
            );
        }
    }
}

/// An f16 cache is read as the f32 cache of its values: attention over it
/// gives the very bits attention over the f32 copy gives, on each backend
/// and for head sizes with and without a tail past 8 columns.
#[test]
fn attention_over_f16_rows_equals_attention_over_their_f32_values() {
    attention_over_narrow_rows_equals_attention_over_their_f32_values(half::f16::from_f32);
}

/// The same for a bf16 cache.
#[test]
fn attention_over_bf16_rows_equals_attention_over_their_f32_values() {
    attention_over_narrow_rows_equals_attention_over_their_f32_values(half::bf16::from_f32);
}

fn attention_over_narrow_rows_equals_attention_over_their_f32_values<E: KvElem>(
    narrow: fn(f32) -> E,
) {
    for be in backends() {
        for hd in [64, 128, 20, 72] {
            let mut cache = Cache::new(51, 10, 16, hd);
            // The values the narrow cache can hold, in the f32 cache too.
            for x in &mut cache.kv {
                // SAFETY: one element, read at column 0.
                *x = unsafe { E::get(&narrow(*x), 0) };
            }
            let narrowed: Vec<E> = cache.kv.iter().map(|&x| narrow(x)).collect();
            let f32_rows = cache.rows();
            let narrow_rows = retyped(&f32_rows, narrowed.as_ptr());
            // SAFETY: both caches hold K and V for every position < 160.
            unsafe {
                assert_same_attention(
                    be,
                    &f32_rows,
                    &narrow_rows,
                    hd,
                    &[0, 9, 16, 31, 100, 159],
                    600,
                )
            };
        }
    }
}

/// For a query at each of `positions` (vectors seeded from `seed`):
/// attention over `rows` has the bits of attention over `f32_rows` (which
/// hold the values `rows` read back as), the query alone and eight copies
/// of it in one sweep (narrow tiles then widened once for all of them).
///
/// # Safety
/// Both describe `hd` readable elements of K and of V for every position
/// up to the largest of `positions`.
unsafe fn assert_same_attention<E: KvElem>(
    be: Backend,
    f32_rows: &PagedRows<'_>,
    rows: &PagedRows<'_, E>,
    hd: usize,
    positions: &[usize],
    seed: u64,
) {
    for (i, &pos) in positions.iter().enumerate() {
        let q = rand_vec(seed + i as u64, hd);
        let (mut a, mut b) = (vec![f32::NAN; hd], vec![f32::NAN; hd]);
        let mut qa = [AttnQuery::new(q.as_ptr(), pos, a.as_mut_ptr())];
        let mut qb = [AttnQuery::new(q.as_ptr(), pos, b.as_mut_ptr())];
        // SAFETY: as this function's contract; the outputs are distinct.
        unsafe {
            attend_many_with(be, f32_rows, hd, 0.2, &mut qa);
            attend_many_with(be, rows, hd, 0.2, &mut qb);
        }
        assert_eq!(bits(&a), bits(&b), "{be:?} hd {hd} pos {pos}");
        assert!(a.iter().all(|x| x.is_finite()), "{be:?} hd {hd} pos {pos}");
        let mut outs = vec![vec![f32::NAN; hd]; 8];
        let mut many: Vec<AttnQuery> = outs
            .iter_mut()
            .map(|o| AttnQuery::new(q.as_ptr(), pos, o.as_mut_ptr()))
            .collect();
        // SAFETY: as above.
        unsafe { attend_many_with(be, rows, hd, 0.2, &mut many) };
        for o in &outs {
            assert_eq!(bits(o), bits(&a), "{be:?} hd {hd} pos {pos}, widened");
        }
    }
}

/// A query's segments computed one by one (as threads computing them
/// apart would), then folded in order and finished: the bits of the
/// sweep that computes them all, one query alone or many together, for
/// each backend, head size and an f16 cache.
#[test]
fn segments_computed_apart_and_folded_equal_the_whole_sweep() {
    for be in backends() {
        for hd in [64, 20, 72] {
            let cache = Cache::new(61, 50, 16, hd);
            let rows = cache.rows();
            let narrowed: Vec<half::f16> =
                cache.kv.iter().map(|&x| half::f16::from_f32(x)).collect();
            let f16_rows = retyped(&rows, narrowed.as_ptr());
            let pos: Vec<usize> = vec![0, 255, 256, 300, 511, 512, 640, 799, 799];
            let qv: Vec<Vec<f32>> = (0..pos.len())
                .map(|i| rand_vec(700 + i as u64, hd))
                .collect();
            let check = |sweep_whole: &dyn Fn(&mut [AttnQuery]),
                         sweep_seg: &dyn Fn(usize, &mut [AttnQuery])| {
                let mut whole = vec![vec![f32::NAN; hd]; pos.len()];
                let mut qs: Vec<AttnQuery> = whole
                    .iter_mut()
                    .enumerate()
                    .map(|(i, o)| AttnQuery::new(qv[i].as_ptr(), pos[i], o.as_mut_ptr()))
                    .collect();
                sweep_whole(&mut qs);
                for (i, want) in whole.iter().enumerate() {
                    let mut out = vec![f32::NAN; hd];
                    let mut total = AttnQuery::EMPTY.partial();
                    for seg in 0..=pos[i] / SEGMENT {
                        let mut part = vec![f32::NAN; hd];
                        let mut q = [AttnQuery::new(qv[i].as_ptr(), pos[i], part.as_mut_ptr())];
                        sweep_seg(seg, &mut q);
                        let p = q[0].partial();
                        fold(&mut total, &mut out, p.m, p.l, &part, seg == 0);
                    }
                    finish(&total, &mut out);
                    assert_eq!(
                        bits(&out),
                        bits(want),
                        "{be:?} hd {hd}: query at {} folded apart differs",
                        pos[i]
                    );
                }
                // The whole sweep of one query alone: the same bits again.
                for (i, want) in whole.iter().enumerate() {
                    let mut out = vec![f32::NAN; hd];
                    let mut q = [AttnQuery::new(qv[i].as_ptr(), pos[i], out.as_mut_ptr())];
                    sweep_whole(&mut q);
                    assert_eq!(
                        bits(&out),
                        bits(want),
                        "{be:?} hd {hd}: alone at {}",
                        pos[i]
                    );
                }
            };
            // SAFETY: both caches hold K and V for every position < 800;
            // every query's output is its own.
            unsafe {
                check(
                    &|qs| sweep_with(be, &rows, hd, 0.15, qs, Sweep::Whole),
                    &|seg, qs| sweep_with(be, &rows, hd, 0.15, qs, Sweep::Segment(seg)),
                );
                check(
                    &|qs| sweep_with(be, &f16_rows, hd, 0.15, qs, Sweep::Whole),
                    &|seg, qs| sweep_with(be, &f16_rows, hd, 0.15, qs, Sweep::Segment(seg)),
                );
            }
        }
    }
}

#[test]
fn rope_rotates_pairs_and_keeps_norm() {
    let d = 8;
    let inv = rope_inv_freq(10000.0, d);
    assert_eq!(inv[0], 1.0);
    let (mut c, mut s) = (vec![0f32; d / 2], vec![0f32; d / 2]);
    rope_cos_sin(0, &inv, &mut c, &mut s);
    let mut v = rand_vec(12, d);
    let orig = v.clone();
    rope_apply(&mut v, &c, &s);
    assert_eq!(v, orig, "position 0 is the identity");
    rope_cos_sin(5, &inv, &mut c, &mut s);
    rope_apply(&mut v, &c, &s);
    let n0: f32 = orig.iter().map(|x| x * x).sum();
    let n1: f32 = v.iter().map(|x| x * x).sum();
    assert!((n0 - n1).abs() < 1e-5);
    // Pair (0, d/2) rotates by angle 5 * inv[0] = 5.
    let (x1, x2) = (orig[0], orig[d / 2]);
    assert!((v[0] - (x1 * 5f32.cos() - x2 * 5f32.sin())).abs() < 1e-6);
}

#[test]
fn rmsnorm_and_silu_match_definitions() {
    let x = rand_vec(13, 10);
    let w = rand_vec(14, 10);
    let mut out = vec![0f32; 10];
    rmsnorm(&x, &w, 1e-5, &mut out);
    let ms: f64 = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / 10.0;
    for i in 0..10 {
        let want = w[i] as f64 * x[i] as f64 / (ms + 1e-5).sqrt();
        assert!((out[i] as f64 - want).abs() < 1e-6);
    }
    let mut g = vec![-2.0f32, 0.0, 3.0];
    silu_mul(&mut g, &[1.0, 5.0, 2.0]);
    assert!((g[0] - (-2.0 / (1.0 + 2f32.exp()))).abs() < 1e-6);
    assert_eq!(g[1], 0.0);
    assert!((g[2] - 2.0 * 3.0 / (1.0 + (-3f32).exp())).abs() < 1e-6);
}

/// Where the CPU has AVX-512, a sweep of many queries runs the AVX-512
/// tile (rows copied once, queries two at a time); it gives the AVX2
/// tiles' bits for f32, f16 and q8_0 rows, heads of 16 to 128 floats,
/// queries side by side in one tile (each seeing a different number of its
/// keys), across segments, whole or a segment at a time.
#[cfg(target_arch = "x86_64")]
#[test]
fn the_avx512_tile_gives_the_avx2_tiles_bits() {
    use super::attention::sweep_avx2;
    if !super::tile512::available() {
        eprintln!("no AVX-512 here: its tile is checked on CPUs that have it");
        return;
    }
    for hd in [16, 48, 64, 128] {
        let cache = Cache::new(81, 40, 16, hd);
        let rows = cache.rows();
        let f16s: Vec<half::f16> = cache.kv.iter().map(|&x| half::f16::from_f32(x)).collect();
        let f16_rows = retyped(&rows, f16s.as_ptr());
        // Heads of 16 and 48 floats are not whole q8_0 blocks.
        let q8 = hd % Q8_BLOCK == 0;
        let q8s = if q8 {
            q8_rows(&cache.kv, hd)
        } else {
            Vec::new()
        };
        let q8_rows = q8_paged(&q8s, &rows, hd);
        // Every position up to 40 (a tile's queries see 1 to 16 of its
        // keys), then scattered ones past the first segments; an odd count
        // of queries, so one is left alone at each tile.
        let pos: Vec<usize> = (0..41).chain((0..20).map(|i| 250 + i * 19)).collect();
        let qv: Vec<Vec<f32>> = (0..pos.len())
            .map(|i| rand_vec(900 + i as u64, hd))
            .collect();
        for sweep in [Sweep::Whole, Sweep::Segment(0), Sweep::Segment(2)] {
            let from = match sweep {
                Sweep::Whole => 0,
                Sweep::Segment(seg) => seg * SEGMENT,
            };
            // Each query's output and running maximum and sum, as bits.
            let run = |f: &dyn Fn(&mut [AttnQuery])| {
                let mut outs = vec![vec![f32::NAN; hd]; pos.len()];
                let mut qs: Vec<AttnQuery> = (outs.iter_mut().enumerate())
                    .filter(|&(i, _)| pos[i] >= from)
                    .map(|(i, o)| AttnQuery::new(qv[i].as_ptr(), pos[i], o.as_mut_ptr()))
                    .collect();
                f(&mut qs);
                let totals: Vec<_> = qs.iter().map(|q| q.partial()).collect();
                let totals: Vec<_> = totals
                    .iter()
                    .map(|t| (t.m.to_bits(), t.l.to_bits()))
                    .collect();
                (outs.iter().map(|o| bits(o)).collect::<Vec<_>>(), totals)
            };
            // SAFETY: every cache holds K and V for every position < 640;
            // each query's output is its own; the CPU has AVX-512 and AVX2.
            unsafe {
                let both = |name: &str,
                            a: &dyn Fn(&mut [AttnQuery]),
                            b: &dyn Fn(&mut [AttnQuery])| {
                    let ((oa, ta), (ob, tb)) = (run(a), run(b));
                    let first = (0..oa.len()).find(|&i| oa[i] != ob[i] || ta.get(i) != tb.get(i));
                    assert!(
                        first.is_none(),
                        "{name} hd {hd} {sweep:?}: query {first:?} differs"
                    );
                };
                both(
                    "f32",
                    &|qs| sweep_with(Backend::Avx2Fma, &rows, hd, 0.3, qs, sweep),
                    &|qs| sweep_avx2(&rows, hd, 0.3, qs, sweep),
                );
                both(
                    "f16",
                    &|qs| sweep_with(Backend::Avx2Fma, &f16_rows, hd, 0.3, qs, sweep),
                    &|qs| sweep_avx2(&f16_rows, hd, 0.3, qs, sweep),
                );
                if q8 {
                    both(
                        "q8_0",
                        &|qs| sweep_with(Backend::Avx2Fma, &q8_rows, hd, 0.3, qs, sweep),
                        &|qs| sweep_avx2(&q8_rows, hd, 0.3, qs, sweep),
                    );
                }
            }
        }
    }
}

/// Every row (K and V) of an f32 cache of `hd`-float rows quantised into
/// a q8_0 row.
fn q8_rows(kv: &[f32], hd: usize) -> Vec<u8> {
    let rb = hd / Q8_BLOCK * Q8_BLOCK_BYTES;
    let mut bytes = vec![0u8; kv.len() / hd * rb];
    for (row, dst) in kv.chunks(hd).zip(bytes.chunks_mut(rb)) {
        // SAFETY: `dst` is one q8_0 row of `hd` values.
        unsafe { Q8Byte::quantize_row(row, dst.as_mut_ptr()) };
    }
    bytes
}

/// [`q8_rows`]'s rows where `rows` has the f32 ones (one KV head).
fn q8_paged<'a>(bytes: &'a [u8], rows: &PagedRows<'a>, hd: usize) -> PagedRows<'a, Q8Byte> {
    let rb = hd / Q8_BLOCK * Q8_BLOCK_BYTES;
    PagedRows {
        base: bytes.as_ptr().cast::<Q8Byte>(),
        block_table: rows.block_table,
        block_size: rows.block_size,
        block_stride: 2 * rows.block_size * rb,
        row_stride: rb,
        head_offset: 0,
        v_offset: rows.block_size * rb,
    }
}

/// `rows`' layout over other elements at `base` (a cache of the same
/// shape in another dtype of the same size).
fn retyped<'a, E: KvElem>(rows: &PagedRows<'a>, base: *const E) -> PagedRows<'a, E> {
    PagedRows {
        base,
        block_table: rows.block_table,
        block_size: rows.block_size,
        block_stride: rows.block_stride,
        row_stride: rows.row_stride,
        head_offset: rows.head_offset,
        v_offset: rows.v_offset,
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// Attention over a q8_0 cache equals attention over an f32 cache holding
/// the values its rows read back as, bit for bit: one query or many in a
/// sweep (the many widen each tile once), whole or segment by segment.
#[test]
fn attention_over_q8_0_rows_equals_attention_over_their_values() {
    for be in backends() {
        for hd in [64, 128, 96] {
            let cache = Cache::new(71, 40, 16, hd);
            let rb = hd / Q8_BLOCK * Q8_BLOCK_BYTES;
            let bytes = q8_rows(&cache.kv, hd);
            let q8 = bytes.as_ptr().cast::<Q8Byte>();
            let values: Vec<f32> = (0..cache.kv.len())
                // SAFETY: row `i / hd` holds column `i % hd`.
                .map(|i| unsafe { Q8Byte::get(q8.add(i / hd * rb), i % hd) })
                .collect();
            let f32_rows = PagedRows {
                base: values.as_ptr(),
                ..cache.rows()
            };
            let q8_rows = q8_paged(&bytes, &cache.rows(), hd);
            // SAFETY: both caches hold K and V for every position < 640.
            unsafe {
                assert_same_attention(
                    be,
                    &f32_rows,
                    &q8_rows,
                    hd,
                    &[0, 17, 255, 256, 400, 639],
                    800,
                )
            };
        }
    }
}

/// q8_0 rows read back within half a step of their block's scale, zeros
/// as zeros, and each block's largest magnitude exactly (up to the scale's
/// f16 rounding).
#[test]
fn q8_0_rows_read_back_within_half_a_step() {
    let mut row = rand_vec(90, 96);
    row[40..72].fill(0.0);
    row[5] = -3.5;
    let mut bytes = vec![0u8; 3 * Q8_BLOCK_BYTES];
    // SAFETY: three blocks of 34 bytes for 96 values.
    unsafe { Q8Byte::quantize_row(&row, bytes.as_mut_ptr()) };
    let q8 = bytes.as_ptr().cast::<Q8Byte>();
    for (b, block) in row.chunks(Q8_BLOCK).enumerate() {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let step = amax / 127.0;
        for (j, &x) in block.iter().enumerate() {
            // SAFETY: column `b * 32 + j` of the 96-column row.
            let got = unsafe { Q8Byte::get(q8, b * Q8_BLOCK + j) };
            assert!(
                (got - x).abs() <= step * 0.5 + amax * 1e-3,
                "column {}: {got} for {x} (step {step})",
                b * Q8_BLOCK + j
            );
            if x == 0.0 {
                assert_eq!(got, 0.0);
            }
        }
    }
    // SAFETY: column 5 of the row.
    let at5 = unsafe { Q8Byte::get(q8, 5) };
    assert!((at5 + 3.5).abs() < 3.5 * 1e-3, "{at5}");
}

/// Not a test: the attention sweep's speed on one thread, as a prefill
/// chunk's task brings it: 32 rows of 3 query heads sharing a KV head (or
/// `PDKV_BENCH_QUERIES` heads), head size 64 (or `PDKV_BENCH_HD`), an f16
/// cache (f32 with `PDKV_BENCH_KV=f32`), the rows at the end of a context
/// of 4,096 positions (or `PDKV_BENCH_CTX`); on each backend, GFLOP/s of
/// the two products (4 per key, column and query).
/// `cargo test -p pdkv-model --release --lib -- --ignored --nocapture bench_attention_sweep`
#[test]
#[ignore]
fn bench_attention_sweep() {
    let env = |k: &str, d: usize| {
        std::env::var(k)
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(d)
    };
    let (hd, ctx) = (env("PDKV_BENCH_HD", 64), env("PDKV_BENCH_CTX", 4096));
    let nq = env("PDKV_BENCH_QUERIES", 96);
    let mut cache = Cache::new(7, ctx.div_ceil(16), 16, hd);
    // Keys of one scale, as a model's are: the running maximum grows on
    // a few tiles only.
    cache.kv = rand_vec(8, cache.kv.len());
    let halves: Vec<half::f16> = cache.kv.iter().map(|&x| half::f16::from_f32(x)).collect();
    let f16_rows = retyped(&cache.rows(), halves.as_ptr());
    let f32_rows = cache.rows();
    let f32_kv = std::env::var("PDKV_BENCH_KV").is_ok_and(|v| v == "f32");
    let qv: Vec<Vec<f32>> = (0..nq).map(|i| rand_vec(900 + i as u64, hd)).collect();
    let pos: Vec<usize> = (0..nq).map(|i| ctx - nq.div_ceil(3) + i / 3).collect();
    let mut outs = vec![vec![0f32; hd]; nq];
    let keys: usize = pos.iter().map(|p| p + 1).sum();
    for be in backends() {
        let mut run = || {
            let mut qs: Vec<AttnQuery> = outs
                .iter_mut()
                .enumerate()
                .map(|(i, o)| AttnQuery::new(qv[i].as_ptr(), pos[i], o.as_mut_ptr()))
                .collect();
            // SAFETY: every position is below the cache's length.
            unsafe {
                match f32_kv {
                    true => attend_many_with(be, &f32_rows, hd, 0.125, &mut qs),
                    false => attend_many_with(be, &f16_rows, hd, 0.125, &mut qs),
                }
            };
        };
        let best = best_seconds(&mut run, 0.2);
        let gflops = (4 * keys * hd) as f64 / best / 1e9;
        let kv = if f32_kv { "f32" } else { "f16" };
        println!(
            "{be:?} {kv} hd {hd} ctx {ctx} queries {nq}: {:.2} ms a sweep, {gflops:.1} GFLOP/s",
            best * 1e3
        );
    }
}
