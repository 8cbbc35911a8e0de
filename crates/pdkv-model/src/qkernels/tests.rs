use super::acts::{quantize_block, GROUP, GROUP_BLOCK};
use super::blocks::f16_to_f32;
use super::flavour::{has, Flavour};
use super::matmul::run_many;
use super::*;
use crate::dispatch::Backend;
use crate::gguf::dequantize;
use crate::kernels;

/// Deterministic xorshift stream.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// In [-1, 1).
    fn f32(&mut self) -> f32 {
        ((self.next() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// Activations with some all-zero blocks and a few large outliers.
fn rand_acts(seed: u64, m: usize, k: usize) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let mut x: Vec<f32> = (0..m * k).map(|_| rng.f32()).collect();
    for (i, blk) in x.chunks_mut(QK).enumerate() {
        match rng.next() % 11 {
            0 => blk.fill(0.0),
            1 => blk[i % QK] *= 40.0,
            _ => {}
        }
    }
    x
}

/// A random weight matrix in GGUF layout; Q8_0 includes -128 values and
/// negative scales, Q4_1 negative minimums.
fn rand_weights(seed: u64, ty: QType, n: usize, k: usize) -> Vec<u8> {
    if ty.packed() {
        let rows = rand_weights(seed, ty.gguf(), n, k);
        let mut w = vec![0u8; rows.len()];
        crate::packed::pack(ty, &rows, k, &mut w);
        return w;
    }
    let mut rng = Rng::new(seed);
    let mut w = Vec::with_capacity(n * ty.row_bytes(k));
    for _ in 0..n * k / ty.block_values() {
        let d = half::f16::from_f32(0.001 + 0.02 * rng.f32().abs())
            * if rng.next().is_multiple_of(5) {
                -half::f16::ONE
            } else {
                half::f16::ONE
            };
        if ty == QType::Q6_K {
            // Values, high bits and i8 scales are any bytes; d comes last.
            w.extend((0..208).map(|_| rng.next() as u8));
            w.extend_from_slice(&(d * half::f16::from_f32(0.05)).to_le_bytes());
            continue;
        }
        w.extend_from_slice(&d.to_le_bytes());
        if ty.stored_min() {
            w.extend_from_slice(&half::f16::from_f32(0.1 * rng.f32()).to_le_bytes());
        }
        if ty.is_super() {
            // dmin; the 6-bit scales and minimums and the values are any bytes.
            w.extend_from_slice(&half::f16::from_f32(0.002 * rng.f32()).to_le_bytes());
        }
        for _ in 0..ty.block_bytes() - w.len() % ty.block_bytes() {
            w.push(rng.next() as u8);
        }
    }
    w
}

fn dequant(ty: QType, w: &[u8], n: usize, k: usize) -> Vec<f32> {
    let gt = crate::weights::ggml_type(ty);
    let mut out = vec![0f32; n * k];
    let rows = crate::packed::gguf_rows(ty, w, k);
    dequantize(gt, &rows, &mut out).expect("dequantising test weights");
    out
}

/// The activations as the kernels see them: `d * q` per value.
fn dequant_acts(x: &QActs) -> Vec<f64> {
    let (m, k, nb) = (x.m, x.k, x.blocks());
    let mut out = vec![0f64; m * k];
    for r in 0..m {
        let (g, l) = (r / GROUP, r % GROUP);
        for b in 0..nb {
            let d = x.d[(g * nb + b) * GROUP + l] as f64;
            for i in 0..QK {
                let q = x.qs[(g * nb + b) * GROUP_BLOCK + (i / 4) * 32 + l * 4 + i % 4];
                out[r * k + b * QK + i] = d * q as f64;
            }
        }
    }
    out
}

fn flavours() -> Vec<Flavour> {
    [Flavour::Portable, Flavour::Avx2, Flavour::Vnni]
        .into_iter()
        .filter(|&f| has(f))
        .collect()
}

fn run(fl: Flavour, x: &QActs, ty: QType, w: &[u8], n: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; x.rows() * n];
    run_many(
        fl,
        x,
        &mut [QLinear {
            ty,
            w,
            n,
            y: &mut y,
        }],
    );
    y
}

/// Every format the kernels read: the 32-value ones, the super-block
/// ones (which need `k` a multiple of 256: tests skip them elsewhere), then
/// the packed formats.
const TYPES: [QType; 13] = {
    let mut t = [QType::Q4_1R8; 13];
    let mut i = 0;
    while i < QType::INT.len() {
        t[i] = QType::INT[i];
        i += 1;
    }
    t[8] = QType::Q5_0R8;
    t[10] = QType::Q4_0R8;
    t[11] = QType::Q5_1R8;
    t[12] = QType::Q4_KR8;
    t
};

/// Whether rows of `k` values are whole blocks of `ty`.
fn fits(ty: QType, k: usize) -> bool {
    k.is_multiple_of(ty.block_values())
}

/// The super-block writer the benches use encodes what the GGUF
/// reader decodes: values come back within about half a step of their
/// sub-block (the bounds leave room for the 6- or 8-bit scales).
#[test]
fn super_block_writer_round_trips_through_the_gguf_reader() {
    let k = 1024;
    let mut rng = Rng::new(17);
    let x: Vec<f32> = (0..k)
        .map(|i| rng.f32() * (1.0 + (i / 256) as f32))
        .collect();
    for (ty, bound) in [
        (QType::Q4_K, 0.6 / 15.0),
        (QType::Q5_K, 0.6 / 31.0),
        (QType::Q6_K, 0.6 / 31.0),
    ] {
        let mut blocks = vec![0u8; ty.row_bytes(k)];
        crate::quantize::quantize_row(ty, &x, &mut blocks);
        let back = dequant(ty, &blocks, 1, k);
        for (i, (&a, &b)) in x.iter().zip(&back).enumerate() {
            // Relative to the span of the super-block's values.
            let span = 2.0 * (1.0 + (i / 256) as f32);
            assert!(
                (a - b).abs() <= bound * span,
                "{ty:?} value {i}: {a} came back as {b}"
            );
        }
    }
}

#[test]
fn f16_conversion_is_exact() {
    for h in 0..=u16::MAX {
        let want = half::f16::from_bits(h).to_f32();
        let got = f16_to_f32(h);
        if want.is_nan() {
            assert!(got.is_nan(), "{h:#06x}");
        } else {
            assert_eq!(got.to_bits(), want.to_bits(), "{h:#06x}");
        }
    }
}

#[test]
fn matches_f64_reference_on_dequantised_values() {
    for fl in flavours() {
        for ty in TYPES {
            for &(m, k, n) in &[
                (1, 32, 1),
                (5, 96, 7),
                (13, 256, 10),
                (40, 576, 33),
                (3, 768, 9),
                (9, 0, 3),
            ] {
                if !fits(ty, k) {
                    continue;
                }
                let xf = rand_acts(1, m, k);
                let mut x = QActs::new();
                x.quantize(&xf, m, k);
                let wq = rand_weights(2, ty, n, k);
                let w = dequant(ty, &wq, n, k);
                let xd = dequant_acts(&x);
                let y = run(fl, &x, ty, &wq, n);
                for r in 0..m {
                    for j in 0..n {
                        let (mut want, mut mag) = (0f64, 0f64);
                        for t in 0..k {
                            want += w[j * k + t] as f64 * xd[r * k + t];
                            mag += (w[j * k + t] as f64 * xd[r * k + t]).abs();
                        }
                        let got = y[r * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * mag + 1e-30,
                            "{fl:?} {ty:?} m={m} k={k} n={n} ({r},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// The bytes of a block of `ty` that hold its values (the rest are
/// scales and minimums).
fn value_bytes(ty: QType) -> std::ops::Range<usize> {
    match ty {
        QType::Q8_0 => 2..34,
        QType::Q4_0 => 2..18,
        QType::Q4_1 => 4..20,
        QType::Q5_0 => 2..22,
        QType::Q5_1 => 4..24,
        QType::Q4_K => 16..144,
        QType::Q5_K => 16..176,
        QType::Q6_K => 0..192,
        QType::F16 | QType::BF16 => unreachable!("not a block format"),
        QType::Q5_0R8 | QType::Q4_1R8 | QType::Q4_0R8 | QType::Q5_1R8 | QType::Q4_KR8 => {
            unreachable!("packed: its GGUF rows are filled")
        }
    }
}

/// Every weight value at its format's extreme (Q8_0's -128, the others'
/// largest unsigned value) against activations all +127 or all -127:
/// the largest partial sums any kernel forms (the AVX2 flavour adds pair
/// sums of 4 rows in i16) stay exact.
#[test]
fn the_largest_block_dots_are_exact() {
    let (k, n) = (256, 11);
    for fl in flavours() {
        for ty in TYPES {
            // A packed format's GGUF rows filled, then packed.
            let rows_ty = ty.gguf();
            let mut wq = rand_weights(3, rows_ty, n, k);
            let fill = if ty == QType::Q8_0 { 0x80 } else { 0xff };
            for blk in wq.chunks_mut(rows_ty.block_bytes()) {
                blk[value_bytes(rows_ty)].fill(fill);
            }
            if ty.packed() {
                let rows = wq.clone();
                crate::packed::pack(ty, &rows, k, &mut wq);
            }
            let w = dequant(ty, &wq, n, k);
            for (sign, m) in [(1.0f32, 1), (-1.0, 1), (1.0, 3), (-1.0, 12)] {
                let mut x = QActs::new();
                x.quantize(&vec![sign; m * k], m, k);
                let xd = dequant_acts(&x);
                let y = run(fl, &x, ty, &wq, n);
                for r in 0..m {
                    for j in 0..n {
                        let terms = (0..k).map(|t| w[j * k + t] as f64 * xd[r * k + t]);
                        let want: f64 = terms.clone().sum();
                        let mag: f64 = terms.map(f64::abs).sum();
                        let got = y[r * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-5 * mag,
                            "{fl:?} {ty:?} m={m} x={sign} ({r},{j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }
}

/// Against the original f32 activations the error is the activation
/// rounding: `|x - d*q| <= d/2` per value (plus float rounding, here a
/// 1e-3 slack on it and 1e-5 of Σ|w||x|), so
/// `|y - Σ w·x| <= Σ_b d_b/2 · Σ_{i in b} |w_i| · (1 + 1e-3) + 1e-5 · Σ|w·x|`.
#[test]
fn error_against_f32_activations_is_within_the_quantisation_bound() {
    let (m, k, n) = (11, 512, 9);
    let xf = rand_acts(3, m, k);
    let mut x = QActs::new();
    x.quantize(&xf, m, k);
    for fl in flavours() {
        for ty in TYPES {
            let wq = rand_weights(4, ty, n, k);
            let w = dequant(ty, &wq, n, k);
            let y = run(fl, &x, ty, &wq, n);
            for r in 0..m {
                for j in 0..n {
                    let (mut want, mut mag, mut bound) = (0f64, 0f64, 0f64);
                    for b in 0..k / QK {
                        let d = x.d[((r / GROUP) * (k / QK) + b) * GROUP + r % GROUP] as f64;
                        for t in b * QK..(b + 1) * QK {
                            let p = w[j * k + t] as f64 * xf[r * k + t] as f64;
                            want += p;
                            mag += p.abs();
                            bound += (w[j * k + t] as f64).abs() * d / 2.0 * (1.0 + 1e-3);
                        }
                    }
                    let err = (y[r * n + j] as f64 - want).abs();
                    assert!(
                        err <= bound + 1e-5 * mag,
                        "{fl:?} {ty:?} ({r},{j}): error {err} over bound {bound}"
                    );
                }
            }
        }
    }
}

/// A matrix large enough at batch 1 to be split into jobs
/// (`dispatch::MIN_JOB_WORK`) gives each output the bits of that row
/// computed alone, whatever the threads and wherever the jobs end (1,001
/// rows: the last tile partial).
#[test]
fn a_batch_one_matrix_split_into_jobs_gives_each_row_its_own_bits() {
    let (k, n) = (256, 1001);
    let mut x = QActs::new();
    for m in [1, 2] {
        x.quantize(&rand_acts(30, m, k), m, k);
        for ty in TYPES {
            let w = rand_weights(31, ty, n, k);
            let rb = ty.row_bytes(k);
            // A packed matrix's row alone is its GGUF row.
            let rows = crate::packed::gguf_rows(ty, &w, k);
            for fl in flavours() {
                let alone: Vec<Vec<f32>> = (0..n)
                    .map(|j| run(fl, &x, ty.gguf(), &rows[j * rb..(j + 1) * rb], 1))
                    .collect();
                for t in [1, 3] {
                    let pool = crate::kernels::tests::pool(t);
                    let y = pool.install(|| run(fl, &x, ty, &w, n));
                    for r in 0..m {
                        for (j, a) in alone.iter().enumerate() {
                            assert_eq!(
                                y[r * n + j].to_bits(),
                                a[r].to_bits(),
                                "{fl:?} {ty:?}: row {r}, feature {j}, {t} threads"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn rows_are_bit_identical_for_every_m_position_and_thread_count() {
    let (k, n) = (256, 13);
    let pool_rows = rand_acts(5, 50, k);
    let row = |r: usize| &pool_rows[r * k..(r + 1) * k];
    let pools: Vec<rayon::ThreadPool> = [1, 3]
        .iter()
        .map(|&t| crate::kernels::tests::pool(t))
        .collect();
    let mut x = QActs::new();
    for ty in TYPES {
        let w = rand_weights(6, ty, n, k);
        for fl in flavours() {
            let alone: Vec<Vec<u32>> = (0..50)
                .map(|r| {
                    x.quantize(row(r), 1, k);
                    run(fl, &x, ty, &w, n).iter().map(|v| v.to_bits()).collect()
                })
                .collect();
            for m in 1..=70 {
                for shift in [0, 3] {
                    let idx: Vec<usize> = (0..m).map(|i| (i + shift * m) % 50).collect();
                    let xf: Vec<f32> = idx.iter().flat_map(|&r| row(r).to_vec()).collect();
                    x.quantize(&xf, m, k);
                    for pool in &pools {
                        let y = pool.install(|| run(fl, &x, ty, &w, n));
                        for (i, &r) in idx.iter().enumerate() {
                            let got: Vec<u32> =
                                y[i * n..(i + 1) * n].iter().map(|v| v.to_bits()).collect();
                            assert_eq!(
                                got,
                                alone[r],
                                "{fl:?} {ty:?}: row {r} at position {i} of m={m}, {} threads",
                                pool.current_num_threads()
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn avx2_and_vnni_agree_bit_for_bit() {
    if !has(Flavour::Vnni) {
        return;
    }
    let (m, k, n) = (21, 1024, 19);
    let mut x = QActs::new();
    x.quantize(&rand_acts(7, m, k), m, k);
    for ty in TYPES {
        let w = rand_weights(8, ty, n, k);
        let a: Vec<u32> = run(Flavour::Avx2, &x, ty, &w, n)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        let b: Vec<u32> = run(Flavour::Vnni, &x, ty, &w, n)
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert_eq!(a, b, "{ty:?}");
    }
}

#[test]
fn qmatmul_many_equals_separate_calls() {
    let (m, k) = (10, 128);
    let mut x = QActs::new();
    x.quantize(&rand_acts(9, m, k), m, k);
    let shapes = [
        (QType::Q8_0, 17),
        (QType::Q4_1, 5),
        (QType::Q4_1, 32),
        (QType::Q8_0, 3),
        (QType::Q4_1, 9),
    ];
    let ws: Vec<Vec<u8>> = shapes
        .iter()
        .enumerate()
        .map(|(i, &(ty, n))| rand_weights(10 + i as u64, ty, n, k))
        .collect();
    for be in [Backend::Portable, kernels::backend()] {
        for count in 1..=shapes.len() {
            let mut ys: Vec<Vec<f32>> = shapes[..count]
                .iter()
                .map(|&(_, n)| vec![f32::NAN; m * n])
                .collect();
            let mut outs: Vec<QLinear<'_>> = shapes
                .iter()
                .zip(&ws)
                .zip(ys.iter_mut())
                .map(|((&(ty, n), w), y)| QLinear { ty, w, n, y })
                .collect();
            qmatmul_many_with(be, &x, &mut outs);
            drop(outs);
            for (i, &(ty, n)) in shapes[..count].iter().enumerate() {
                let mut z = vec![f32::NAN; m * n];
                qmatmul_many_with(
                    be,
                    &x,
                    &mut [QLinear {
                        ty,
                        w: &ws[i],
                        n,
                        y: &mut z,
                    }],
                );
                let a: Vec<u32> = ys[i].iter().map(|v| v.to_bits()).collect();
                let b: Vec<u32> = z.iter().map(|v| v.to_bits()).collect();
                assert_eq!(a, b, "{be:?}: matrix {i} of {count}");
            }
        }
    }
}

#[test]
fn quantize_round_trips_maxima_and_zero_blocks() {
    let k = 64;
    let mut xf = vec![0f32; 2 * k];
    // Row 0, block 0: maxima ±127 give d = 1 and exact values.
    for (i, v) in xf[..32].iter_mut().enumerate() {
        *v = (i as f32 - 15.0) * 4.0;
    }
    xf[3] = 127.0;
    xf[7] = -127.0;
    // Row 0, block 1: a ±max of 0.37 goes to ±127 and back within rounding of d.
    xf[32 + 5] = 0.37;
    xf[32 + 9] = -0.37;
    xf[32 + 10] = 0.1;
    // Row 1: block 0 all zero, block 1 one value.
    xf[k + 40] = -2.5;
    let mut x = QActs::new();
    x.quantize(&xf, 2, k);
    let (nb, q) = (2, |x: &QActs, r: usize, b: usize, i: usize| {
        x.qs[((r / GROUP) * 2 + b) * GROUP_BLOCK + (i / 4) * 32 + (r % GROUP) * 4 + i % 4]
    });
    let s = |r: usize, b: usize| ((r / GROUP) * nb + b) * GROUP + r % GROUP;
    assert_eq!(x.d[s(0, 0)], 1.0);
    for (i, want) in xf.iter().enumerate().take(32) {
        assert_eq!(x.d[s(0, 0)] * q(&x, 0, 0, i) as f32, *want, "value {i}");
    }
    assert_eq!(
        x.sum[s(0, 0)],
        (0..32).map(|i| q(&x, 0, 0, i) as i32).sum::<i32>()
    );
    assert_eq!(
        (q(&x, 0, 1, 5), q(&x, 0, 1, 9), q(&x, 0, 1, 10)),
        (127, -127, 34)
    );
    assert_eq!(x.d[s(0, 1)], 0.37 / 127.0);
    assert!((x.d[s(0, 1)] * 127.0 - 0.37).abs() <= f32::EPSILON * 0.37);
    assert_eq!(x.sum[s(0, 1)], 34);
    assert_eq!(
        (x.d[s(1, 0)], x.sum[s(1, 0)], x.dsum[s(1, 0)]),
        (0.0, 0, 0.0)
    );
    assert!((0..32).all(|i| q(&x, 1, 0, i) == 0));
    assert_eq!((q(&x, 1, 1, 8), x.sum[s(1, 1)]), (-127, -127));
    // Half away from zero: 0.5 -> 1, -0.5 -> -1, 1.5 -> 2.
    let mut h = [0f32; 32];
    h[0] = 127.0;
    h[1] = 0.5;
    h[2] = -0.5;
    h[3] = 1.5;
    h[4] = -2.5;
    let (d, qb, _) = quantize_block(&h);
    assert_eq!((d, qb[1], qb[2], qb[3], qb[4]), (1.0, 1, -1, 2, -3));
    assert_eq!((x.rows(), x.cols()), (2, 64));
}

#[test]
fn the_avx2_block_quantiser_gives_the_portable_ones_bits() {
    #[cfg(target_arch = "x86_64")]
    {
        if !has(Flavour::Avx2) {
            eprintln!("skipped: this CPU lacks AVX2");
            return;
        }
        let mut rng = Rng::new(11);
        let mut blocks: Vec<[f32; 32]> = Vec::new();
        // Random blocks at several magnitudes, with exact halves after the
        // division (amax 127: d = 1), zeros, and non-finite values.
        for scale in [1e-30f32, 1e-3, 1.0, 7.5, 1e6] {
            for _ in 0..400 {
                blocks.push(std::array::from_fn(|_| rng.f32() * scale));
            }
        }
        let mut h = [0f32; 32];
        h[0] = 127.0;
        for (i, v) in h.iter_mut().enumerate().skip(1) {
            *v = (i as f32 - 16.0) + 0.5;
        }
        blocks.push(h);
        h[0] = -127.0;
        h[5] = -0.0;
        blocks.push(h);
        blocks.push([0.0; 32]);
        // Quotients a float below a half past an integer (and a half past
        // it): where adding a half and truncating would round up wrongly.
        let mut below = [0f32; 32];
        below[0] = 127.0;
        let near = [0.5f32, 1.5, 2.5, 63.5, 64.5, 126.5];
        for (i, &x) in near.iter().enumerate() {
            let down = f32::from_bits(x.to_bits() - 1);
            below[1 + 4 * i] = down;
            below[2 + 4 * i] = -down;
            below[3 + 4 * i] = x;
            below[4 + 4 * i] = -x;
        }
        below[25] = f32::from_bits(1);
        below[26] = f32::MIN_POSITIVE;
        blocks.push(below);
        let mut odd = h;
        odd[3] = f32::NAN;
        blocks.push(odd);
        odd[7] = f32::INFINITY;
        blocks.push(odd);
        odd[9] = f32::NEG_INFINITY;
        blocks.push(odd);
        for (i, b) in blocks.iter().enumerate() {
            let (d0, q0, s0) = quantize_block(b);
            // SAFETY: the CPU has AVX2 (checked above).
            let (d1, q1, s1) = unsafe { super::acts::quantize_block_avx2(b) };
            assert_eq!(
                (d0.to_bits(), q0, s0),
                (d1.to_bits(), q1, s1),
                "block {i}: {b:?}"
            );
        }
    }
}

#[test]
#[should_panic(expected = "is not a multiple of the block size 32")]
fn quantize_rejects_k_not_a_multiple_of_32() {
    QActs::new().quantize(&[0.0; 40], 1, 40);
}

/// What the benches time, from the environment: `PDKV_THREADS` threads
/// (2), `PDKV_BENCH_FLAVOUR=avx2` the AVX2 flavour on a CPU with VNNI,
/// `PDKV_BENCH_TYPES=Q5_0,Q4_1` those formats only (their names).
struct BenchEnv {
    threads: usize,
    fl: Flavour,
    types: Vec<QType>,
}

/// The benches' threads: a team, as model steps run on (a rayon pool's
/// wake-ups took longer than a batch-1 matmul of these sizes).
fn bench_team(threads: usize) -> crate::team::Team {
    crate::team::Team::new(threads, "pdkv-bench").expect("starting the bench's team")
}

/// Runs `f` on `team`, which nothing else holds.
fn on<R>(team: &crate::team::Team, f: impl FnOnce() -> R) -> R {
    team.enter(f).expect("the bench's team is free")
}

fn bench_env() -> BenchEnv {
    let threads = std::env::var("PDKV_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let fl = match std::env::var("PDKV_BENCH_FLAVOUR").as_deref() {
        Ok("avx2") => Flavour::Avx2,
        _ => Flavour::of(kernels::backend()),
    };
    let types = match std::env::var("PDKV_BENCH_TYPES") {
        Ok(s) => TYPES
            .into_iter()
            .filter(|ty| s.split(',').any(|t| t.trim() == format!("{ty:?}")))
            .collect(),
        Err(_) => TYPES.to_vec(),
    };
    BenchEnv { threads, fl, types }
}

/// `cargo test --release -p pdkv-model --lib qkernels -- --ignored --nocapture`
#[test]
#[ignore]
fn bench_against_f32_matmul() {
    // SmolLM2's gate projection, and its down projection for the
    // super-block formats (whose rows are whole multiples of 256 values).
    let shape = |ty: QType| {
        if fits(ty, 576) {
            (576, 1536)
        } else {
            (1536, 576)
        }
    };
    let BenchEnv { threads, fl, types } = bench_env();
    let team = bench_team(threads);
    let time = |f: &mut dyn FnMut()| crate::kernels::tests::best_seconds(f, 0.05);
    println!("threads {threads}, flavour {fl:?}");
    // PDKV_BENCH_M=1 (a comma-separated list) times those batch sizes only.
    let ms: Vec<usize> = std::env::var("PDKV_BENCH_M")
        .map(|s| s.split(',').map(|m| m.trim().parse().unwrap()).collect())
        .unwrap_or_else(|_| vec![1, 32, 512]);
    for m in ms {
        for &ty in &types {
            let (k, n) = shape(ty);
            let xf = rand_acts(20, m, k);
            let gflop = 2.0 * (m * k * n) as f64 / 1e9;
            let wq = rand_weights(21, ty, n, k);
            let w = dequant(ty, &wq, n, k);
            let mut y = vec![0f32; m * n];
            let tf = on(&team, || {
                time(&mut || kernels::matmul(&xf, m, k, &w, n, &mut y))
            });
            let mut x = QActs::new();
            let tqz = on(&team, || time(&mut || x.quantize(&xf, m, k)));
            let tq = on(&team, || {
                time(&mut || {
                    run_many(
                        fl,
                        &x,
                        &mut [QLinear {
                            ty,
                            w: &wq,
                            n,
                            y: &mut y,
                        }],
                    )
                })
            });
            println!(
                "m={m:3} {ty:?} {k}x{n}: {:6.1} GB/s of weights | f32 {:8.1} us {:6.1} GFLOP/s | q {:8.1} us {:6.1} GFLOP/s (+quantize {:6.1} us) | speedup {:.2}x",
                wq.len() as f64 / tq / 1e9,
                tf * 1e6,
                gflop / tf,
                tq * 1e6,
                gflop / tq,
                tqz * 1e6,
                tf / (tq + tqz)
            );
        }
    }
}

/// The batch-1 kernels streaming weights from memory, as a decode step
/// does: copies of one matrix filling `PDKV_BENCH_MB` (default 128) MiB,
/// swept in turn, against a copy of as many bytes timed in the same run.
/// Same environment knobs as [`bench_against_f32_matmul`].
#[test]
#[ignore]
fn bench_from_memory() {
    let BenchEnv { threads, fl, types } = bench_env();
    let team = bench_team(threads);
    let mb: usize = std::env::var("PDKV_BENCH_MB")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(128);
    println!("threads {threads}, flavour {fl:?}, {mb} MiB of weights");
    let src = vec![1u8; mb << 20];
    let mut dst = vec![0u8; mb << 20];
    let copy = |dst: &mut Vec<u8>| {
        on(&team, || {
            crate::team::par_chunks_mut(dst, (mb << 20) / threads, |i, c| {
                let at = i * ((mb << 20) / threads);
                c.copy_from_slice(&src[at..at + c.len()])
            })
        })
    };
    for &ty in &types {
        let (k, n) = if fits(ty, 576) {
            (576, 1536)
        } else {
            (1536, 576)
        };
        let wq = rand_weights(21, ty, n, k);
        let copies = ((mb << 20) / wq.len()).max(1);
        let all: Vec<u8> = wq.iter().copied().cycle().take(copies * wq.len()).collect();
        let mut x = QActs::new();
        x.quantize(&rand_acts(20, 1, k), 1, k);
        let mut y = vec![0f32; n];
        let mut sweep = || {
            for c in 0..copies {
                run_many(
                    fl,
                    &x,
                    &mut [QLinear {
                        ty,
                        w: &all[c * wq.len()..(c + 1) * wq.len()],
                        n,
                        y: &mut y,
                    }],
                )
            }
        };
        // Alternating, best of 5 each.
        let (mut tq, mut tc) = (f64::INFINITY, f64::INFINITY);
        for _ in 0..5 {
            let t = std::time::Instant::now();
            on(&team, &mut sweep);
            tq = tq.min(t.elapsed().as_secs_f64());
            let t = std::time::Instant::now();
            copy(&mut dst);
            tc = tc.min(t.elapsed().as_secs_f64());
        }
        let gbs = all.len() as f64 / tq / 1e9;
        let copy_gbs = (mb << 20) as f64 / tc / 1e9;
        println!(
            "{ty:?} {k}x{n}: {gbs:6.1} GB/s of weights, copy {copy_gbs:6.1} GB/s: {:.3} of copy",
            gbs / copy_gbs
        );
    }
}

/// A step's activations without the interleaved copy (their scales `m`
/// apart, [`QActs::quantize_for_step`]) give every format's kernels the
/// bits of the interleaved ones, for each batch the direct kernels take;
/// one buffer reused across sizes and both layouts, as a model's is.
#[test]
fn a_steps_compact_activations_give_the_interleaved_ones_bits() {
    let (k, n) = (512, 19);
    let mut step = QActs::new();
    let mut full = QActs::new();
    // The portable kernels read the interleaved copy alone (a step on a
    // CPU without AVX2 is quantised with it).
    for fl in flavours().into_iter().filter(|&f| f != Flavour::Portable) {
        for ty in TYPES {
            let w = rand_weights(40, ty, n, k);
            let bits = |x: &QActs| -> Vec<u32> {
                run(fl, x, ty, &w, n).iter().map(|v| v.to_bits()).collect()
            };
            for m in [1, 3, 8, 2, 1, 5] {
                let xf = rand_acts(41 + m as u64, m, k);
                full.quantize(&xf, m, k);
                let want = bits(&full);
                step.quantize_for_step(&xf, m, k);
                assert_eq!(bits(&step), want, "{fl:?} {ty:?} m {m}");
                // Interleaved again in the same buffer, then a step again.
                step.quantize(&xf, m, k);
                let again = bits(&step);
                assert_eq!(again, want, "{fl:?} {ty:?} m {m}, interleaved after a step");
            }
        }
    }
}
