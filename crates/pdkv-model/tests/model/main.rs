//! The integration tests of this crate, one binary: each module is one
//! area (they share the helpers at the end of this file and pdkv-testkit).

mod formats;
mod hf_weights;
mod loading;
mod math;
mod numerics;
mod tp;

/// The largest magnitude in `v`.
fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0f32, |m, x| m.max(x.abs()))
}

/// The largest `|a[i] - b[i]|`.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs()))
}
