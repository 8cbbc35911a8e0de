//! A rank's part in a step ([`RankTp`]): its shard, every rank's widths,
//! and the exchanges the forward pass makes through [`Comm`].

use std::sync::Arc;

use super::comm::{place_cols, Comm};
use super::shard::Shard;

/// A rank's part in the model: its shard and where it meets the others.
#[derive(Clone)]
pub struct RankTp {
    pub shard: Shard,
    pub comm: Arc<Comm>,
    /// Every rank's shard, in rank order.
    pub shards: Vec<Shard>,
    /// Every rank's columns of the attention output, the residual update,
    /// the MLP activation and the logits, in rank order.
    pub q_widths: Vec<usize>,
    pub hidden_widths: Vec<usize>,
    pub inter_widths: Vec<usize>,
    pub vocab_widths: Vec<usize>,
    /// The rank's own math threads.
    pub threads: Arc<rayon::ThreadPool>,
}

impl RankTp {
    pub(super) fn new(
        shard: Shard,
        shards: Vec<Shard>,
        head_dim: usize,
        comm: Arc<Comm>,
        threads: Arc<rayon::ThreadPool>,
    ) -> RankTp {
        let widths = |f: &dyn Fn(&Shard) -> usize| shards.iter().map(f).collect::<Vec<_>>();
        RankTp {
            q_widths: widths(&|s| s.heads.len() * head_dim),
            hidden_widths: widths(&|s| s.hidden.len()),
            inter_widths: widths(&|s| s.inter.len()),
            vocab_widths: widths(&|s| s.vocab.len()),
            shard,
            shards,
            comm,
            threads,
        }
    }

    /// `x` (`[t, hidden]`) holds this rank's embedding rows of the tokens
    /// in its vocabulary; afterwards every row, each from its token's rank.
    pub fn share_embedding(
        &self,
        tokens: impl Iterator<Item = u32>,
        x: &mut [f32],
    ) -> anyhow::Result<()> {
        let owners: Vec<usize> = tokens
            .map(|t| {
                self.shards
                    .iter()
                    .position(|s| s.vocab.contains(&(t as usize)))
                    .expect("validated token ids are in the vocabulary")
            })
            .collect();
        let hidden = x.len() / owners.len().max(1);
        let mine = x.to_vec();
        self.comm
            .exchange(self.shard.rank, &mine, "the embedding", |parts| {
                for (i, &o) in owners.iter().enumerate() {
                    let src = &parts[o][i * hidden..(i + 1) * hidden];
                    x[i * hidden..(i + 1) * hidden].copy_from_slice(src);
                }
                Ok(())
            })
    }

    /// Rank 0 gets in `out` the `rows` whole logits rows from every rank's
    /// `local` columns; the other ranks' `out` is left empty.
    pub fn gather_logits(
        &self,
        local: &[f32],
        rows: usize,
        out: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        out.clear();
        let rank = self.shard.rank;
        self.comm.exchange(rank, local, "the logits", |parts| {
            if rank == 0 {
                out.resize(rows * self.vocab_widths.iter().sum::<usize>(), 0.0);
                place_cols(parts, &self.vocab_widths, out)?;
            }
            Ok(())
        })
    }
}
