//! Matrix multiply on weights kept in GGUF block formats (placeholder:
//! scalar reference, replaced by the kernels of the `qk` branch).

use half::f16;
use rayon::prelude::*;

pub const QK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QType {
    Q8_0,
    Q4_1,
}

impl QType {
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q4_1 => 20,
        }
    }

    pub fn row_bytes(self, k: usize) -> usize {
        k / QK * self.block_bytes()
    }
}

#[derive(Default)]
pub struct QActs {
    m: usize,
    k: usize,
    d: Vec<f32>,
    s: Vec<i32>,
    q: Vec<i8>,
}

impl QActs {
    pub fn new() -> QActs {
        QActs::default()
    }

    pub fn quantize(&mut self, x: &[f32], m: usize, k: usize) {
        assert!(k % QK == 0, "activations of {k} columns are not whole 32-value blocks");
        let nb = m * k / QK;
        self.m = m;
        self.k = k;
        self.d.clear();
        self.s.clear();
        self.q.clear();
        for b in 0..nb {
            let xs = &x[b * QK..(b + 1) * QK];
            let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
            let d = amax / 127.0;
            let id = if d == 0.0 { 0.0 } else { 1.0 / d };
            let mut sum = 0i32;
            for &v in xs {
                let q = (v * id).round() as i8;
                sum += q as i32;
                self.q.push(q);
            }
            self.d.push(d);
            self.s.push(sum);
        }
    }

    pub fn rows(&self) -> usize {
        self.m
    }

    pub fn cols(&self) -> usize {
        self.k
    }
}

pub struct QLinear<'a> {
    pub ty: QType,
    pub w: &'a [u8],
    pub n: usize,
    pub y: &'a mut [f32],
}

fn dot(ty: QType, x: &QActs, r: usize, w: &[u8]) -> f32 {
    let nb = x.k / QK;
    let mut acc = 0f32;
    for b in 0..nb {
        let xi = r * nb + b;
        let (dx, sx, qx) = (x.d[xi], x.s[xi], &x.q[xi * QK..(xi + 1) * QK]);
        let blk = &w[b * ty.block_bytes()..(b + 1) * ty.block_bytes()];
        let dw = f16::from_le_bytes([blk[0], blk[1]]).to_f32();
        match ty {
            QType::Q8_0 => {
                let isum: i32 = (0..QK).map(|i| blk[2 + i] as i8 as i32 * qx[i] as i32).sum();
                acc += dw * dx * isum as f32;
            }
            QType::Q4_1 => {
                let mw = f16::from_le_bytes([blk[2], blk[3]]).to_f32();
                let isum: i32 = (0..16)
                    .map(|i| (blk[4 + i] & 0xF) as i32 * qx[i] as i32 + (blk[4 + i] >> 4) as i32 * qx[i + 16] as i32)
                    .sum();
                acc += dw * dx * isum as f32 + mw * dx * sx as f32;
            }
        }
    }
    acc
}

pub fn qmatmul_many(x: &QActs, outs: &mut [QLinear<'_>]) {
    qmatmul_many_with(crate::kernels::backend(), x, outs)
}

pub fn qmatmul_many_with(_be: crate::kernels::Backend, x: &QActs, outs: &mut [QLinear<'_>]) {
    let (m, k) = (x.m, x.k);
    for o in outs.iter_mut() {
        let rb = o.ty.row_bytes(k);
        let n = o.n;
        let cols: Vec<Vec<f32>> = (0..n)
            .into_par_iter()
            .map(|j| (0..m).map(|r| dot(o.ty, x, r, &o.w[j * rb..(j + 1) * rb])).collect())
            .collect();
        for (j, c) in cols.iter().enumerate() {
            for r in 0..m {
                o.y[r * n + j] = c[r];
            }
        }
    }
}
