//! The SIMD kernels: 8 output rows (or, at decode, 8 weight rows) per
//! vector, one per lane, the exact integer block dots reached by a flavour
//! of [`super::idot`] (`maddubs`/`madd` or `vpdpbusd`).

use std::arch::x86_64::*;

use super::acts::{QActs, DIRECT_MAX, GROUP, GROUP_BLOCK};
use super::blocks::{f16_at, k_params, min_of, q6_params, super_params};
use super::idot::{unpacked_chunk, Avx2, IDot, Tile, Vnni, PAIRS};
use super::job::{Job, Scratch, NR};
use super::regs::{
    f16_high, f16_low, halves, k_block_scales, k_scales, lanes8, lanes8_halves, row_offsets,
    rows_word, store_tile, unpack_q6, unpack_super, unpack_super_pair, x_halves, DR,
};
use crate::packed::{self, TILE};
use crate::prefetch::{tiles_ahead, to_l2, AHEAD};
use crate::qtype::{QType, QK};

/// Rows `p` and `p + 4` of a [`direct`] tile's Q4_0/Q4_1 block as
/// [`IDot::dots_pairs`] takes them: `(lo, hi)`, values 0..16 (then 16..32)
/// of row `p` in the low half and of row `p + 4` in the high half. The
/// nibble bytes hold value `i` low and `i + 16` high, so one load per row
/// and two masks give both: no byte moves across the halves. (Q5's fifth
/// bits would need each mask spliced from two rows' words, which costs
/// more than the pairing saves: they keep a row a vector.)
///
/// # Safety
/// The CPU has AVX2; `a` and `b` point at whole blocks of `ty`, a format
/// of nibbles alone.
#[inline(always)]
unsafe fn unpack_pair(ty: QType, a: *const u8, b: *const u8) -> (__m256i, __m256i) {
    // SAFETY: the caller guarantees AVX2 and that `a` and `b` are whole
    // blocks of `ty`: their 16 nibble bytes are inside them.
    unsafe {
        let q = halves(a, b, ty.nibbles_at());
        let low = _mm256_set1_epi8(0x0f);
        (
            _mm256_and_si256(q, low),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), low),
        )
    }
}

/// Unpacks the scales, values (and unsigned formats' minimums) of `rows` rows.
///
/// # Safety
/// The CPU has AVX2, F16C and `D`'s instructions; `w` holds `rows` rows
/// of `rb` bytes, each `nb` blocks of `ty`.
#[inline(always)]
unsafe fn prep<D: IDot>(
    s: &mut Scratch,
    ty: QType,
    w: *const u8,
    rb: usize,
    rows: usize,
    nb: usize,
) {
    // SAFETY: the caller guarantees AVX2, F16C and `D`'s instructions and
    // that `w` holds `rows` rows of `rb` bytes (`nb` blocks each);
    // `s.reserve` made room in the scratch for all of them.
    unsafe {
        s.reserve(rows, nb);
        let bb = ty.block_bytes();
        if ty.is_super() {
            for c in 0..rows {
                for b in 0..nb {
                    let i = c * nb + b;
                    let v = s.vals.as_mut_ptr().add(i * QK) as *mut __m256i;
                    if ty == QType::Q6_K {
                        // Row `c` is `nb` blocks of whole super-blocks, so it
                        // holds block `b`'s (`q6_params`' contract).
                        let (d, sc, blk) = q6_params(w.add(c * rb), b);
                        (s.dw[i], s.sc6[i]) = (d, sc);
                        _mm256_storeu_si256(v, unpack_q6(blk, b % 8));
                    } else {
                        // As above (`super_params`' contract).
                        let (dw, mw, blk) = super_params(ty, w.add(c * rb), b);
                        (s.dw[i], s.mw[i]) = (dw, mw);
                        _mm256_storeu_si256(v, unpack_super(ty, blk, b % 8));
                    }
                }
            }
            return;
        }
        for c in 0..rows {
            for b in 0..nb {
                let blk = w.add(c * rb + b * bb);
                let i = c * nb + b;
                // Every format's block starts with its f16 scale
                // (`f16_at`'s contract: 2 readable bytes).
                s.dw[i] = f16_at(blk);
                let v = s.vals.as_mut_ptr().add(i * QK);
                if ty.unsigned() {
                    s.mw[i] = min_of(ty, std::slice::from_raw_parts(blk, bb));
                    _mm256_storeu_si256(v as *mut __m256i, unpack_unsigned::<D>(ty, blk));
                } else {
                    // Q8_0's values as the flavour's `q8` reads them.
                    for h in [0, 16] {
                        let q = _mm_loadu_si128(blk.add(2 + h) as *const __m128i);
                        _mm_storeu_si128(v.add(h) as *mut __m128i, D::scratch8(q));
                    }
                }
            }
        }
    }
}

/// [`prep`] for rows `j..j + rows` of a packed matrix of `ty`, inside one
/// of its tiles, read in place: the same scales, minimums and values.
///
/// # Safety
/// The CPU has AVX2, F16C and `D`'s instructions; `w` holds the packed
/// matrix's tiles through rows `j..j + rows` (rows of `rb` bytes, `nb`
/// blocks each), which lie in one tile.
#[inline(always)]
unsafe fn prep_packed<D: IDot>(
    s: &mut Scratch,
    ty: QType,
    w: *const u8,
    (j, rows): (usize, usize),
    rb: usize,
    nb: usize,
) {
    // SAFETY: the caller guarantees the instructions and that the tile of
    // rows `j..j + rows` is inside `w`; `s.reserve` made room for them.
    unsafe {
        s.reserve(rows, nb);
        let tile = w.add(j / TILE * TILE * rb);
        if ty == QType::Q4_KR8 {
            return prep_packed_k4::<D>(s, tile, (j % TILE, rows), nb);
        }
        let (tb, nib, gguf) = (packed::tile_block(ty), packed::nibbles_at(ty), ty.gguf());
        let (mins, masks) = (packed::mins_at(ty), packed::masks_at(ty));
        for c in 0..rows {
            let row = j % TILE + c;
            for b in 0..nb {
                let p = tile.add(b * tb);
                let i = c * nb + b;
                s.dw[i] = f16_at(p.add(2 * row));
                s.mw[i] = match mins {
                    Some(at) => f16_at(p.add(at + 2 * row)),
                    None => gguf.min_factor() * s.dw[i],
                };
                let bits =
                    masks.map(|at| packed::fifth_bits(std::slice::from_raw_parts(p, tb), at, row));
                let v = s.vals.as_mut_ptr().add(i * QK) as *mut __m256i;
                _mm256_storeu_si256(v, nibble_values::<D>(p.add(nib + 16 * row), bits));
            }
        }
    }
}

/// [`prep_packed`] for Q4_K: rows `r0..r0 + rows` of the tile at `tile`
/// (`nb` blocks of 32 values a row), each block's `(dw, mw)` as
/// `super_params` forms them ([`k_params`] of the row's header).
///
/// # Safety
/// As [`prep_packed`]'s; `s.reserve` made room for the rows.
#[inline(always)]
unsafe fn prep_packed_k4<D: IDot>(
    s: &mut Scratch,
    tile: *const u8,
    (r0, rows): (usize, usize),
    nb: usize,
) {
    // SAFETY: the caller guarantees the instructions and that the tile's
    // `nb / 8` super-blocks are inside the matrix.
    unsafe {
        let tb = packed::tile_block(QType::Q4_KR8);
        for c in 0..rows {
            let row = r0 + c;
            for sbi in 0..nb / 8 {
                let p = std::slice::from_raw_parts(tile.add(sbi * tb), tb);
                // The row's GGUF super-block header: d, dmin, the scales.
                let mut head = [0u8; 16];
                packed::q4k_header_into(p, row, &mut head);
                for jb in 0..8 {
                    let b = sbi * 8 + jb;
                    let i = c * nb + b;
                    (s.dw[i], s.mw[i]) = k_params(&head, jb);
                    let nib = p.as_ptr().add(packed::Q4K_NIBBLES + packed::Q4K_BLOCK * jb);
                    let v = s.vals.as_mut_ptr().add(i * QK) as *mut __m256i;
                    _mm256_storeu_si256(v, nibble_values::<D>(nib.add(16 * row), None));
                }
            }
        }
    }
}

/// The 32 values of an unsigned-format block as bytes, in order (the
/// low 128 bits hold values 0..16).
///
/// # Safety
/// The CPU has AVX2 and `D`'s instructions; `blk` points at a whole block
/// of the unsigned format `ty`.
#[inline(always)]
unsafe fn unpack_unsigned<D: IDot>(ty: QType, blk: *const u8) -> __m256i {
    // SAFETY: the caller guarantees AVX2 (and `D`'s instructions) and that
    // `blk` is a whole block of `ty`: the nibbles (16 bytes) and fifth bits
    // (4) are inside it.
    unsafe {
        let bits = ty
            .high_bits_at()
            .map(|h| (blk.add(h) as *const u32).read_unaligned());
        nibble_values::<D>(blk.add(ty.nibbles_at()), bits)
    }
}

/// The 32 values of the 16 nibble bytes at `nib` (value `i < 16` the low
/// nibble of byte `i`, `i + 16` its high one), with a Q5 block's fifth
/// `bits`, as bytes in order.
///
/// # Safety
/// The CPU has AVX2 and `D`'s instructions; 16 bytes at `nib` are readable.
#[inline(always)]
unsafe fn nibble_values<D: IDot>(nib: *const u8, bits: Option<u32>) -> __m256i {
    // SAFETY: the caller guarantees the instructions and the 16 bytes.
    unsafe {
        // The 16 nibble bytes in both halves, the high half shifted by 4
        // (a per-lane shift: no cross-lane shuffle), then the low nibbles.
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(nib as *const __m128i));
        let v = _mm256_and_si256(
            _mm256_srlv_epi32(q, _mm256_setr_epi32(0, 0, 0, 0, 4, 4, 4, 4)),
            _mm256_set1_epi8(0x0f),
        );
        match bits {
            Some(b) => D::fifth(v, b),
            None => v,
        }
    }
}

/// # Safety
/// As [`run_job`]'s, with `D` the AVX2 flavour.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_job_avx2(x: &QActs, job: &Job, s: &mut Scratch) {
    // SAFETY: the caller guarantees the job's contract; the features this
    // function enables are the ones the CPU has.
    unsafe { run_job::<Avx2>(x, job, s) }
}

/// # Safety
/// As [`run_job`]'s, with `D` the VNNI flavour (AVX-512 VNNI, VL and BW).
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
pub(super) unsafe fn run_job_vnni(x: &QActs, job: &Job, s: &mut Scratch) {
    // SAFETY: the caller guarantees the job's contract; the features this
    // function enables are the ones the CPU has.
    unsafe { run_job::<Vnni>(x, job, s) }
}

/// The [`direct`] kernel of a job of GGUF rows with VNNI (for a packed
/// matrix's last rows, which stay GGUF rows).
///
/// # Safety
/// As [`run_job_vnni`]'s, with `x.m` at most [`DIRECT_MAX`].
#[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw")]
pub(super) unsafe fn run_job_vnni_direct(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract.
    unsafe { direct_of::<Vnni, 0>(x, job) }
}

/// [`run_job_vnni_direct`] with the AVX2 flavour.
///
/// # Safety
/// As [`run_job_avx2`]'s, with `x.m` at most [`DIRECT_MAX`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn run_job_avx2_direct(x: &QActs, job: &Job) {
    // SAFETY: as this function's contract.
    unsafe { direct_of::<Avx2, 0>(x, job) }
}

/// Tiles of `NR` weight rows; each tile is unpacked once, then the
/// activation groups sweep it, as many at a time as the flavour takes
/// ([`IDot::GROUPS`]). A step of at most [`DIRECT_MAX`] rows (decode at
/// small batch) reads the blocks in place instead.
///
/// # Safety
/// `job.w` holds `job.n` rows of `x.k` values of `job.ty`, `job.y` `x.m * job.n`
/// floats of which no one else writes columns `job.j0..job.j1`; the CPU has
/// AVX2, FMA and F16C, and `D`'s instructions.
#[inline(always)]
unsafe fn run_job<D: IDot>(x: &QActs, job: &Job, s: &mut Scratch) {
    // SAFETY: the caller guarantees this function's contract: the CPU has the
    // instructions, and every weight row, activation and output this job
    // touches lies inside `job.w`, `x` and `job.y` (columns `j0..j1`).
    unsafe {
        if x.m == 1 {
            // One row (batch 1, the common decode step) is its own instance:
            // its accumulator stays in a register.
            return direct_of::<D, 1>(x, job);
        }
        if x.m <= DIRECT_MAX {
            return direct_of::<D, 0>(x, job);
        }
        let (nb, rb) = (x.blocks(), job.ty.row_bytes(x.k));
        let mut j = job.j0;
        // A packed matrix's tiles (its last `n % 8` rows are GGUF rows).
        let tiled = if job.ty.packed() {
            job.n / TILE * TILE
        } else {
            0
        };
        while j < job.j1 {
            let nr = NR.min(job.j1 - j);
            // The rows two tiles on (their bytes' place in the matrix,
            // a packed tile's half), asked for into L2 while this one is
            // computed: `perf` put a batch-32 step's hottest instructions in
            // `prep`'s first reads of each tile's rows. Steps alternating
            // in one process (AMD EPYC, 2 threads, context 128): batch 32
            // 1.09x (Q8_0) and 1.06x (Q4_K_M), batch 16 1.19x / 1.03x;
            // prefill of 512 and 2,048 tokens within noise (0.95-1.06).
            let ahead = (j + 2 * NR).min(job.j1);
            to_l2(
                job.w.wrapping_add(ahead * rb),
                (job.j1 - ahead).min(NR) * rb,
            );
            if j < tiled {
                prep_packed::<D>(s, job.ty, job.w, (j, nr), rb, nb);
            } else {
                prep::<D>(s, job.ty.gguf(), job.w.add(j * rb), rb, nr, nb);
            }
            let t = Tile {
                w: job.w.add(j * rb),
                rb,
                nb,
                s,
            };
            // The flavour's number of groups a pass (`IDot::GROUPS`),
            // one at a time for the last where they do not divide.
            let mut g = 0;
            while g < x.groups() {
                if D::GROUPS >= 2 && g + 2 <= x.groups() {
                    groups_pass::<D, 2>(x, &t, job, (j, nr), g);
                    g += 2;
                } else {
                    groups_pass::<D, 1>(x, &t, job, (j, nr), g);
                    g += 1;
                }
            }
            j += nr;
        }
    }
}

/// Groups `g..g + G` against the tile of weight rows `j..j + nr` of
/// [`run_job`] (unpacked in `t`), into their rows of `job.y`.
///
/// # Safety
/// As [`run_job`]'s; `t` holds the tile's `nr` rows (at most [`NR`]),
/// `g + G <= x.groups()`, `G` at most `D::GROUPS`.
#[inline(always)]
unsafe fn groups_pass<D: IDot, const G: usize>(
    x: &QActs,
    t: &Tile<'_>,
    job: &Job,
    (j, nr): (usize, usize),
    g: usize,
) {
    // SAFETY: as this function's contract.
    unsafe {
        let out = &mut [[[0f32; GROUP]; NR]; G];
        match (job.ty.unsigned(), nr) {
            // Q6_K's groups one by one: its half sums for two groups do
            // not fit in the registers (two in one pass: its matmul at
            // batch 32 and 512 took 11-69 % longer, in cache).
            _ if job.ty == QType::Q6_K => {
                for (h, out) in out.iter_mut().enumerate() {
                    match nr {
                        4 => tile_q6::<D, 4>(x, t, g + h, out),
                        3 => tile_q6::<D, 3>(x, t, g + h, out),
                        2 => tile_q6::<D, 2>(x, t, g + h, out),
                        _ => tile_q6::<D, 1>(x, t, g + h, out),
                    }
                }
            }
            (false, 4) => tile::<D, 4, false, G>(x, t, g, out),
            (false, 3) => tile::<D, 3, false, G>(x, t, g, out),
            (false, 2) => tile::<D, 2, false, G>(x, t, g, out),
            (false, _) => tile::<D, 1, false, G>(x, t, g, out),
            (true, 4) => tile::<D, 4, true, G>(x, t, g, out),
            (true, 3) => tile::<D, 3, true, G>(x, t, g, out),
            (true, 2) => tile::<D, 2, true, G>(x, t, g, out),
            (true, _) => tile::<D, 1, true, G>(x, t, g, out),
        }
        for (h, out) in out.iter().enumerate() {
            let rows = GROUP.min(x.m - (g + h) * GROUP);
            for (c, col) in out[..nr].iter().enumerate() {
                for (l, &v) in col[..rows].iter().enumerate() {
                    *job.y.add(((g + h) * GROUP + l) * job.n + j + c) = v;
                }
            }
        }
    }
}

/// The [`direct`] kernel of `job.ty` for `M` activation rows (`M = 0`:
/// as many as `x.m`).
///
/// # Safety
/// As [`direct`]'s.
#[inline(always)]
unsafe fn direct_of<D: IDot, const M: usize>(x: &QActs, job: &Job) {
    // SAFETY: the caller guarantees [`direct`]'s contract, which every
    // kernel here shares.
    unsafe {
        match job.ty {
            QType::Q8_0 => direct::<D, 0, M>(x, job),
            QType::Q4_0 => direct::<D, 1, M>(x, job),
            QType::Q4_1 => direct::<D, 2, M>(x, job),
            QType::Q5_0 => direct::<D, 3, M>(x, job),
            QType::Q5_1 => direct::<D, 4, M>(x, job),
            QType::Q4_K => direct_super::<D, false, M>(x, job),
            QType::Q5_K => direct_super::<D, true, M>(x, job),
            QType::Q6_K => direct_q6::<D, M>(x, job),
            QType::F16 | QType::BF16 => unreachable!("run_many refuses them"),
            QType::Q5_0R8 | QType::Q4_1R8 | QType::Q4_0R8 | QType::Q5_1R8 | QType::Q4_KR8 => {
                unreachable!("packed rows go to `tiled` or are unpacked")
            }
        }
    }
}

/// Activation rows (at most [`DIRECT_MAX`], all in group 0) against 8
/// weight rows at a time, a lane per weight row, reading each block in
/// place: the values are unpacked in registers, the 8 scales (and
/// minimums) loaded into one vector and widened from f16 in one go, and
/// the exact block dots brought into lanes with integer horizontal adds.
/// The float
/// sequence per element is the tile path's, so the results are its bits.
///
/// # Safety
/// `job.w` holds `job.n` rows of `x.k` values of `job.ty`, `job.y` `x.m * job.n`
/// floats of which no one else writes columns `job.j0..job.j1`; the CPU has
/// AVX2, FMA and F16C, and `D`'s instructions.
/// `x.m <= DIRECT_MAX`, and `M` is 0 (as many rows as `x.m`) or `x.m`.
#[inline(always)]
unsafe fn direct<D: IDot, const T: usize, const M: usize>(x: &QActs, job: &Job) {
    // SAFETY: the caller guarantees this function's contract: the CPU has the
    // instructions, and every weight row, activation and output this job
    // touches lies inside `job.w`, `x` and `job.y` (columns `j0..j1`).
    // The step has at most `DIRECT_MAX` rows, all in `x.rowq`.
    unsafe {
        // The format is a constant of each instance: its branches fold away.
        let ty = QType::ALL[T];
        let u = ty.unsigned();
        // Q4_0 and Q4_1 go in row pairs (`unpack_pair`), the Q5 formats a
        // row a vector (`unpack_unsigned`). On an AMD EPYC with AVX-512
        // VNNI, one thread, weights in cache (`bench_against_f32_matmul`,
        // best of 6 alternations): Q4_1 22.4 -> 26.8 GB/s; Q5_0 pairs
        // 19.9 -> 19.7, so they stay as they were.
        let paired = u && ty.high_bits_at().is_none();
        let (nb, k, m) = (x.blocks(), x.k, if M == 0 { x.m } else { M });
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        // The job's first `AHEAD` tiles are fetched up front (its later
        // tiles ahead, bit by bit, while a tile is computed).
        to_l2(
            job.w.wrapping_add(job.j0 * rb),
            (AHEAD * DR).min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            // A short tile repeats its last row; the extra lanes are dropped.
            let base = job.w.add(j * rb);
            let offs = &row_offsets(nr, rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            // The tile's 8 rows are 8 streams too short for the hardware
            // prefetcher to pick up, so the tiles ahead (contiguous) are
            // fetched, a block column's worth of their bytes per block.
            for b in 0..nb {
                tiles_ahead(base, DR * rb, b * DR * bb, DR * bb);
                let blk = base.add(b * bb);
                let mut wv = [_mm256_setzero_si256(); DR];
                let (mut lo, mut hi) = (
                    [_mm256_setzero_si256(); PAIRS],
                    [_mm256_setzero_si256(); PAIRS],
                );
                if paired {
                    for p in 0..PAIRS {
                        (lo[p], hi[p]) =
                            unpack_pair(ty, blk.add(offs[p]), blk.add(offs[p + PAIRS]));
                    }
                } else if u {
                    for (c, w) in wv.iter_mut().enumerate() {
                        *w = unpack_unsigned::<D>(ty, blk.add(offs[c]));
                    }
                } else {
                    for (c, w) in wv.iter_mut().enumerate() {
                        *w = D::w8(_mm256_loadu_si256(blk.add(offs[c] + 2) as *const __m256i));
                    }
                }
                // Each row's f16 scale and the two bytes after it (Q4_1's
                // and Q5_1's f16 minimum) in one vector: lane c is row c.
                let g = rows_word(blk, offs);
                let dw = f16_low(g);
                let mw = if !u {
                    _mm256_setzero_ps()
                } else if !ty.stored_min() {
                    // Exact: a power of two times the scale, as `min_of` computes it.
                    _mm256_mul_ps(_mm256_set1_ps(ty.min_factor()), dw)
                } else {
                    f16_high(g)
                };
                for (r, a) in acc[..m].iter_mut().enumerate() {
                    let xp = x.rowq.as_ptr().add(r * k + b * QK);
                    let mut isum = if paired {
                        let (xl, xh) = x_halves(xp);
                        D::dots_pairs(xl, xh, &lo, &hi)
                    } else if u {
                        D::dots_u(_mm256_loadu_si256(xp as *const __m256i), &wv)
                    } else {
                        let xv = _mm256_loadu_si256(xp as *const __m256i);
                        // A plain loop, not `array::from_fn`: a closure body is
                        // compiled without this function's target features.
                        let mut v = [_mm256_setzero_si256(); DR];
                        for (vc, &w) in v.iter_mut().zip(&wv) {
                            *vc = D::r8(xv, w);
                        }
                        lanes8(&v)
                    };
                    let si = x.at(b, r);
                    if !u && D::R8_OFFSET {
                        isum = _mm256_sub_epi32(isum, _mm256_set1_epi32(x.sum[si] << 7));
                    }
                    let sc = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                    *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, *a);
                    if u {
                        *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                    }
                }
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }
}

/// `$block!(0)` to `$block!(7)`: a super-block's 8 blocks, each copy with
/// its block index a constant (the batch-1 super-block kernels).
macro_rules! each_block {
    ($block:ident) => {
        $block!(0);
        $block!(1);
        $block!(2);
        $block!(3);
        $block!(4);
        $block!(5);
        $block!(6);
        $block!(7);
    };
}

/// [`direct`] for the super-block formats (`FIVE`: Q5_K, else Q4_K):
/// each super-block's 8 scales and minimums are decoded once per row,
/// then its 8 blocks go as [`direct`]'s unsigned ones do, with the
/// float sequence of the tiles.
///
/// # Safety
/// `job.w` holds `job.n` rows of `x.k` values of `job.ty`, `job.y` `x.m * job.n`
/// floats of which no one else writes columns `job.j0..job.j1`; the CPU has
/// AVX2, FMA and F16C, and `D`'s instructions.
/// `x.m <= DIRECT_MAX`, and `M` is 0 (as many rows as `x.m`) or `x.m`.
#[inline(always)]
unsafe fn direct_super<D: IDot, const FIVE: bool, const M: usize>(x: &QActs, job: &Job) {
    // SAFETY: the caller guarantees this function's contract: the CPU has the
    // instructions, and every weight row, activation and output this job
    // touches lies inside `job.w`, `x` and `job.y` (columns `j0..j1`).
    // The step has at most `DIRECT_MAX` rows, all in `x.rowq`.
    unsafe {
        let ty = if FIVE { QType::Q5_K } else { QType::Q4_K };
        let (nb, k, m) = (x.blocks(), x.k, if M == 0 { x.m } else { M });
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        to_l2(
            job.w.wrapping_add(job.j0 * rb),
            (AHEAD * DR).min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            let base = job.w.add(j * rb);
            let offs = &row_offsets(nr, rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for sb in 0..nb / 8 {
                tiles_ahead(base, DR * rb, sb * DR * bb, DR * bb);
                let blk = |c: usize| base.add(offs[c] + sb * bb);
                let sbp = base.add(sb * bb);
                // Of the 8 rows' super-blocks (lane c is row c): the f16
                // scale and minimum (one word), and the 12 bytes of 6-bit
                // scales and minimums as three words.
                let dm = rows_word(sbp, offs);
                let d = f16_low(dm);
                let dmin = f16_high(dm);
                let (sc, mn) = k_scales(
                    rows_word(sbp.add(4), offs),
                    rows_word(sbp.add(8), offs),
                    rows_word(sbp.add(12), offs),
                );
                // The block index a constant in each copy (`block!`), as in
                // `direct_q6`: the nibble half and the fifth bit's shift
                // are immediates, the scales' registers named. The batch-1
                // Q5_K kernel went 11.9-12.2 -> 14.2-14.9 GB/s on one
                // thread, Q4_K 14.6-15.5 -> 15.2-15.8 (AMD Zen 3, weights
                // in cache, `bench_against_f32_matmul`, binaries
                // alternating 6 times).
                macro_rules! block {
                    ($jb:literal) => {{
                        let jb: usize = $jb;
                        let b = sb * 8 + jb;
                        // Plain loops, not closures: a closure body is compiled
                        // without this function's target features, and every
                        // intrinsic in it becomes a call.
                        // Rows in pairs, as `direct` takes Q4_1's.
                        let mut lo = [_mm256_setzero_si256(); PAIRS];
                        let mut hi = [_mm256_setzero_si256(); PAIRS];
                        for p in 0..PAIRS {
                            (lo[p], hi[p]) = unpack_super_pair(ty, blk(p), blk(p + PAIRS), jb);
                        }
                        let (dw, mw) = k_block_scales(d, dmin, sc[jb], mn[jb]);
                        for (r, a) in acc[..m].iter_mut().enumerate() {
                            let xp = x.rowq.as_ptr().add(r * k + b * QK);
                            let (xl, xh) = x_halves(xp);
                            let isum = D::dots_pairs(xl, xh, &lo, &hi);
                            let si = x.at(b, r);
                            let scl = _mm256_mul_ps(dw, _mm256_set1_ps(x.d[si]));
                            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scl, *a);
                            *a = _mm256_fmadd_ps(mw, _mm256_set1_ps(x.dsum[si]), *a);
                        }
                    }};
                }
                each_block!(block);
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }
}

/// [`direct`] for Q6_K: per block and weight row, the 8 i32 lanes of
/// `Σ q·x` over 4 values each, less `32 Σ x` over the same 4, times the
/// scale of the half (lanes 0..4: values 0..16) they fall in, then summed
/// across lanes: `Σ sc·(q - 32)·x` exactly, whatever the order. The
/// float sequence is the tiles'.
///
/// # Safety
/// `job.w` holds `job.n` rows of `x.k` values of `job.ty`, `job.y` `x.m * job.n`
/// floats of which no one else writes columns `job.j0..job.j1`; the CPU has
/// AVX2, FMA and F16C, and `D`'s instructions.
/// `x.m <= DIRECT_MAX`, and `M` is 0 (as many rows as `x.m`) or `x.m`.
#[inline(always)]
unsafe fn direct_q6<D: IDot, const M: usize>(x: &QActs, job: &Job) {
    // SAFETY: the caller guarantees this function's contract: the CPU has the
    // instructions, and every weight row, activation and output this job
    // touches lies inside `job.w`, `x` and `job.y` (columns `j0..j1`).
    // The step has at most `DIRECT_MAX` rows, all in `x.rowq`.
    unsafe {
        let ty = QType::Q6_K;
        let (nb, k, m) = (x.blocks(), x.k, if M == 0 { x.m } else { M });
        let (rb, bb) = (ty.row_bytes(k), ty.block_bytes());
        let ones = _mm256_set1_epi8(1);
        to_l2(
            job.w.wrapping_add(job.j0 * rb),
            (AHEAD * DR).min(job.j1 - job.j0) * rb,
        );
        let mut j = job.j0;
        while j < job.j1 {
            let nr = DR.min(job.j1 - j);
            let base = job.w.add(j * rb);
            let offs = &row_offsets(nr, rb);
            let mut acc = [_mm256_setzero_ps(); DIRECT_MAX];
            for sb in 0..nb / 8 {
                tiles_ahead(base, DR * rb, sb * DR * bb, DR * bb);
                let blk = |c: usize| base.add(offs[c] + sb * bb);
                let sbp = base.add(sb * bb);
                // The f16 scale is the block's last two bytes: the high half
                // of the word before (a word at 208 would read past the block).
                let d = f16_high(rows_word(sbp.add(206), offs));
                // The block index a constant in each copy (`block!`): the
                // high bits' shifts are immediates, their branches fold.
                // With `unpack_q6`'s one shift a row, the batch-1 Q6_K
                // kernel went 10.7-11.6 -> 12.6-13.9 GB/s on one thread,
                // 20.9-21.8 -> 22.4-26.6 on two (AMD Zen 3, weights in
                // cache, `bench_against_f32_matmul`, binaries alternating).
                macro_rules! block {
                    ($jb:literal) => {{
                        let jb: usize = $jb;
                        let b = sb * 8 + jb;
                        let (h, g) = (jb / 4, jb % 4);
                        let mut wv = [_mm256_setzero_si256(); DR];
                        for (c, w) in wv.iter_mut().enumerate() {
                            *w = unpack_q6(blk(c), jb);
                        }
                        // The rows' i8 scales of the block's halves (values 0..16, 16..32).
                        let sw = rows_word(sbp.add(192 + h * 8 + 2 * g), offs);
                        let sa = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<24>(sw));
                        let sb2 = _mm256_srai_epi32::<24>(_mm256_slli_epi32::<16>(sw));
                        for (r, a) in acc[..m].iter_mut().enumerate() {
                            let xv = _mm256_loadu_si256(
                                x.rowq.as_ptr().add(r * k + b * QK) as *const __m256i
                            );
                            let xs32 = _mm256_slli_epi32::<5>(D::r4(xv, ones));
                            let mut v = [_mm256_setzero_si256(); DR];
                            for c in 0..DR {
                                v[c] = _mm256_sub_epi32(D::r4(xv, wv[c]), xs32);
                            }
                            // Lanes 0..4 of a row's dot are its first half's values.
                            let (lo, hi) = lanes8_halves(&v);
                            let isum = _mm256_add_epi32(
                                _mm256_mullo_epi32(lo, sa),
                                _mm256_mullo_epi32(hi, sb2),
                            );
                            let si = x.at(b, r);
                            let scl = _mm256_mul_ps(d, _mm256_set1_ps(x.d[si]));
                            *a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), scl, *a);
                        }
                    }};
                }
                each_block!(block);
            }
            store_tile(&acc[..m], nr, job, j);
            j += nr;
        }
    }
}

/// [`tile`] for Q6_K: per block, the halves' integer dots and the
/// activations' half sums, combined as `sa·(A - 32 XA) + sb·(B - 32 XB)`
/// per weight row (the integer [`direct_q6`] forms), then one `fma`.
///
/// # Safety
/// The CPU has AVX2 and `D`'s instructions; `g < x.groups()`; `t.s` holds
/// `C` unpacked Q6_K rows of `x.k` values.
#[inline(always)]
unsafe fn tile_q6<D: IDot, const C: usize>(
    x: &QActs,
    t: &Tile<'_>,
    g: usize,
    out: &mut [[f32; GROUP]; NR],
) {
    // SAFETY: the caller guarantees AVX2 (and `D`'s instructions), that `g`
    // is a group of `x` and that `t.s` holds `C` unpacked Q6_K rows of `x.k`
    // values with their scales.
    unsafe {
        let (nb, s) = (x.blocks(), t.s);
        let ones = _mm256_set1_epi8(1);
        let mut acc = [_mm256_setzero_ps(); C];
        for b in 0..nb {
            let xb = x.qs.as_ptr().add((g * nb + b) * GROUP_BLOCK);
            let si = (g * nb + b) * GROUP;
            let mut half = [[_mm256_setzero_si256(); C]; 2];
            let mut xsum = [_mm256_setzero_si256(); 2];
            for i in 0..QK / 4 {
                let xv = _mm256_loadu_si256(xb.add(i * 32) as *const __m256i);
                let hh = i / 4;
                xsum[hh] = _mm256_add_epi32(xsum[hh], D::r4(xv, ones));
                for (c, h) in half[hh].iter_mut().enumerate() {
                    *h = _mm256_add_epi32(*h, D::r4(xv, unpacked_chunk(t, c, b, i)));
                }
            }
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(si));
            for c in 0..C {
                let [sa, sb] = s.sc6[c * nb + b];
                let lo = _mm256_sub_epi32(half[0][c], _mm256_slli_epi32::<5>(xsum[0]));
                let hi = _mm256_sub_epi32(half[1][c], _mm256_slli_epi32::<5>(xsum[1]));
                let isum = _mm256_add_epi32(
                    _mm256_mullo_epi32(lo, _mm256_set1_epi32(sa)),
                    _mm256_mullo_epi32(hi, _mm256_set1_epi32(sb)),
                );
                let sc = _mm256_mul_ps(_mm256_set1_ps(s.dw[c * nb + b]), dx);
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), sc, acc[c]);
            }
        }
        for c in 0..C {
            _mm256_storeu_ps(out[c].as_mut_ptr(), acc[c]);
        }
    }
}

/// Activation groups `g..g + G` (8 rows each, one per lane) against the
/// `C` weight rows in `s`: the float sequence of the module invariant,
/// per lane, whichever groups share the pass.
///
/// # Safety
/// The CPU has AVX2 and `D`'s instructions; `g + G <= x.groups()`, `G`
/// at most `D::GROUPS`; `t` holds `C` weight rows of `x.k` values,
/// unpacked in `t.s`.
#[inline(always)]
unsafe fn tile<D: IDot, const C: usize, const U: bool, const G: usize>(
    x: &QActs,
    t: &Tile<'_>,
    g: usize,
    out: &mut [[[f32; GROUP]; NR]; G],
) {
    // SAFETY: the caller guarantees AVX2 (and `D`'s instructions), that
    // the `G` groups from `g` are `x`'s and that `t` holds `C` rows
    // (unpacked in `t.s`) of `x.k` values.
    unsafe {
        let (nb, s) = (x.blocks(), t.s);
        let mut acc = [[_mm256_setzero_ps(); C]; G];
        for b in 0..nb {
            let (mut xb, mut si) = ([std::ptr::null(); G], [0; G]);
            for h in 0..G {
                xb[h] = x.qs.as_ptr().add(((g + h) * nb + b) * GROUP_BLOCK);
                si[h] = ((g + h) * nb + b) * GROUP;
            }
            let isum = if U {
                D::qu::<C, G>(xb, t, b)
            } else {
                let mut sums = [std::ptr::null(); G];
                for h in 0..G {
                    sums[h] = x.sum.as_ptr().add(si[h]);
                }
                D::q8::<C, G>(xb, sums, t, b)
            };
            for h in 0..G {
                let dx = _mm256_loadu_ps(x.d.as_ptr().add(si[h]));
                for c in 0..C {
                    let sc = _mm256_mul_ps(_mm256_set1_ps(s.dw[c * nb + b]), dx);
                    acc[h][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h][c]), sc, acc[h][c]);
                    if U {
                        let dsum = _mm256_loadu_ps(x.dsum.as_ptr().add(si[h]));
                        let mw = _mm256_set1_ps(s.mw[c * nb + b]);
                        acc[h][c] = _mm256_fmadd_ps(mw, dsum, acc[h][c]);
                    }
                }
            }
        }
        for h in 0..G {
            for c in 0..C {
                _mm256_storeu_ps(out[h][c].as_mut_ptr(), acc[h][c]);
            }
        }
    }
}
