//! Where a step's wall time goes, operation by operation, for
//! `pdkv bench decode --profile`.
//!
//! Off unless [`enable`]d: then the stepping thread reads the clock at each
//! boundary between operations of a step ([`mark`]) and adds the time since
//! the previous boundary to that operation's total. A parallel region is
//! timed whole (its slowest thread, as a step waits for it), and serial
//! work between regions is timed where it runs, so the shares add up to
//! the step. Only steps run by one thread at a time are meaningful (the
//! benchmark's); the totals are process-wide.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// The operations a step is split into, in the order a layer runs them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// The embedding rows, the rotary tables and the attention plan.
    Embed,
    /// The RMS norms (before attention, before the MLP, and the final one).
    Norm,
    /// Activations quantised (or rounded) for the block-format matmuls.
    Quantize,
    /// The q, k and v projections.
    Qkv,
    /// The q/k norms (Qwen3) and the rotary embedding.
    Rope,
    /// The step's K/V rows written into the cache.
    WriteKv,
    /// Attention over the cache (and the folds of split tasks).
    Attention,
    /// `o_proj`.
    OProj,
    /// The gate and up projections.
    GateUp,
    /// SwiGLU.
    Silu,
    /// `down_proj`.
    Down,
    /// The residual additions (and tensor-parallel exchanges).
    Residual,
    /// The LM head (and the tensor-parallel gather of the logits).
    LmHead,
}

impl Op {
    pub const ALL: [Op; 13] = [
        Op::Embed,
        Op::Norm,
        Op::Quantize,
        Op::Qkv,
        Op::Rope,
        Op::WriteKv,
        Op::Attention,
        Op::OProj,
        Op::GateUp,
        Op::Silu,
        Op::Down,
        Op::Residual,
        Op::LmHead,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Op::Embed => "embed",
            Op::Norm => "rmsnorm",
            Op::Quantize => "quantize",
            Op::Qkv => "qkv_proj",
            Op::Rope => "rope",
            Op::WriteKv => "write_kv",
            Op::Attention => "attention",
            Op::OProj => "o_proj",
            Op::GateUp => "gate_up",
            Op::Silu => "silu",
            Op::Down => "down_proj",
            Op::Residual => "residual",
            Op::LmHead => "lm_head",
        }
    }
}

static ON: AtomicBool = AtomicBool::new(false);
static NANOS: [AtomicU64; Op::ALL.len()] = [const { AtomicU64::new(0) }; Op::ALL.len()];

thread_local! {
    /// The previous boundary on this thread.
    static LAST: Cell<Option<Instant>> = const { Cell::new(None) };
}

/// Turns the per-operation clock on or off (and clears the totals).
pub fn enable(on: bool) {
    for n in &NANOS {
        n.store(0, Ordering::Relaxed);
    }
    ON.store(on, Ordering::Relaxed);
}

/// The totals since [`enable`] (or the last `take`), in seconds, cleared.
pub fn take() -> Vec<(Op, f64)> {
    Op::ALL
        .iter()
        .map(|&op| {
            let ns = NANOS[op as usize].swap(0, Ordering::Relaxed);
            (op, ns as f64 * 1e-9)
        })
        .collect()
}

/// A step starts: the first boundary.
#[inline]
pub(crate) fn start() {
    if ON.load(Ordering::Relaxed) {
        LAST.with(|l| l.set(Some(Instant::now())));
    }
}

/// The work since the previous boundary was `op`.
#[inline]
pub(crate) fn mark(op: Op) {
    if !ON.load(Ordering::Relaxed) {
        return;
    }
    let now = Instant::now();
    if let Some(last) = LAST.with(|l| l.replace(Some(now))) {
        let ns = now.saturating_duration_since(last).as_nanos() as u64;
        NANOS[op as usize].fetch_add(ns, Ordering::Relaxed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn marks_add_the_time_between_boundaries_to_their_operation() {
        enable(true);
        start();
        // Work that takes measurable time on any machine: a busy loop
        // until the clock has moved.
        let t = Instant::now();
        while t.elapsed().as_micros() < 200 {
            std::hint::spin_loop();
        }
        mark(Op::Attention);
        let got = take();
        enable(false);
        // (Other tests' steps may add to the totals while this one has the
        // clock on; they only add.)
        let of = |op: Op| got.iter().find(|(o, _)| *o == op).unwrap().1;
        assert!(of(Op::Attention) >= 200e-6, "{got:?}");
        // Off: marks add nothing, and `take` cleared the totals.
        start();
        mark(Op::Qkv);
        assert!(take().iter().all(|(_, s)| *s == 0.0));
    }
}
