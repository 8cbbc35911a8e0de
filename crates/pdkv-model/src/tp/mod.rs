//! Tensor parallelism: one model split over `size` ranks that compute each
//! step together.
//!
//! Every matrix is split by its output rows, so each output element of every
//! projection is computed whole by one rank, by the same kernel call as on
//! a single rank:
//! - **KV heads** are divided into contiguous ranges (as evenly as they go:
//!   SmolLM2-135M's 3 KV heads over 2 ranks are 2 + 1), and every query head
//!   goes with its KV head's group, so a rank's attention needs only its own
//!   K/V. `q/k/v_proj` keep the rows of the rank's heads.
//! - `o_proj` and `down_proj` keep a range of the hidden rows,
//!   `gate/up_proj` a range of the MLP's intermediate rows.
//! - **Vocabulary**: the embedding table and the LM head keep a contiguous
//!   range of rows.
//! - Norms (and Qwen3's per-head q/k norms) are copied to every rank.
//!
//! Each rank owns its weights (a `weights` region of its own pool), its KV
//! cache (its KV heads only) and its workspace, and runs on its own math
//! thread pool. Where a rank needs values other ranks computed, they are
//! exchanged whole, never added:
//! - the embedding rows, each from the rank that holds its token;
//! - the attention output, before `o_proj`;
//! - the MLP's intermediate activation, before `down_proj`;
//! - `o_proj`'s and `down_proj`'s outputs (the residual update);
//! - the logits columns, to rank 0.
//!
//! So the split model computes the same floating-point operations on the
//! same values as the whole one, and its logits are **bit-identical** to a
//! single rank's for every tensor-parallel size (the tests hold it to
//! that). The price is communication: an exchange moves a whole activation
//! where a sum of partial products would move only the hidden size, which
//! in one process is a copy.
//!
//! Invariants:
//! - Every wait at an exchange has a deadline ([`COLLECTIVE_TIMEOUT`]).
//!   A rank that fails or panics breaks the exchange for the others, so
//!   they stop at once. The step then fails as a whole: a step never ends
//!   with some ranks done and others not.
//! - Every rank makes the same exchanges in the same order in a step; each
//!   takes one meeting of all ranks (two sets of buffers alternate, so a
//!   rank writing the next exchange never overwrites one still being read).
//!
//! One file per job: [`shard`] plans the split and cuts the weights,
//! [`comm`] is where the ranks meet, [`rank`] is a rank's part in a step
//! (what [`crate::forward`] calls), and [`model`] runs the ranks together
//! over [`crate::forward::Model`]; this file only hands their names on.

pub(crate) mod comm;
mod model;
pub(crate) mod rank;
mod shard;

pub use comm::{Comm, COLLECTIVE_TIMEOUT};
pub use model::{Rank, TpModel};
pub use rank::RankTp;
pub use shard::{check_shard, copy_shard, plan, shard_weights, Shard};
