//! A model split over ranks ([`TpModel`]): each rank's shard, KV cache,
//! workspace and math threads, and a step run on every rank at once.

use std::sync::Arc;

use anyhow::Context;
use pdkv_vmem::{Backing, Pool};

use super::comm::{Comm, COLLECTIVE_TIMEOUT};
use super::rank::RankTp;
use super::shard::{plan, shard_weights};
use crate::forward::{Model, SeqInput, Workspace};
use crate::kv::{KvCache, KvDtype};
use crate::ModelConfig;

/// One rank: its shard of the model, its KV cache and workspace, and the
/// pool they live in.
pub struct Rank {
    pub model: Model,
    pub kv: KvCache,
    pub ws: Workspace,
    pub pool: Pool,
}

/// A model split over ranks (see the module docs).
pub struct TpModel {
    config: ModelConfig,
    ranks: Vec<Rank>,
    comm: Arc<Comm>,
}

impl TpModel {
    /// Splits `full` over `pools.len()` ranks: each gets its weights, a KV
    /// cache of `num_blocks` blocks of `kv_dtype` (its KV heads) held as
    /// `backing` says ([`KvCache::new_backed`]) and a
    /// workspace for steps of `max_tokens` tokens in its pool. `full` may
    /// be dropped after.
    pub fn new(
        full: &Model,
        pools: Vec<Pool>,
        (num_blocks, kv_dtype, backing): (usize, KvDtype, Backing),
        max_tokens: usize,
    ) -> anyhow::Result<TpModel> {
        let size = pools.len();
        let cfg = full.config().clone();
        let shards = plan(&cfg, size)?;
        let comm = Arc::new(Comm::new(size, COLLECTIVE_TIMEOUT));
        let threads = (crate::kernels::thread_pool().current_num_threads() / size).max(1);
        let mut ranks = Vec::with_capacity(size);
        for (s, pool) in shards.clone().into_iter().zip(pools) {
            let rank = s.rank;
            let rcfg = s.config(&cfg);
            let weights = shard_weights(full.weights(), &cfg, &s, &pool)?;
            let pool_threads = rayon::ThreadPoolBuilder::new()
                .num_threads(threads)
                .thread_name(move |i| format!("pdkv-tp{rank}-math-{i}"))
                .build()
                .context("building a rank's math thread pool")?;
            let tp = RankTp::new(
                s,
                shards.clone(),
                cfg.head_dim,
                comm.clone(),
                Arc::new(pool_threads),
            );
            let model = Model::new(rcfg.clone(), weights)
                .with_int8_activations(full.int8_activations())
                .with_tp(tp);
            let kv = KvCache::new_backed(&pool, &rcfg, num_blocks, kv_dtype, backing)
                .with_context(|| format!("allocating rank {rank}'s KV cache"))?;
            let ws = Workspace::new(&pool, &rcfg, max_tokens)
                .with_context(|| format!("allocating rank {rank}'s workspace"))?;
            ranks.push(Rank {
                model,
                kv,
                ws,
                pool,
            });
        }
        Ok(TpModel {
            config: cfg,
            ranks,
            comm,
        })
    }

    /// The whole model's shape.
    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    pub fn ranks(&self) -> &[Rank] {
        &self.ranks
    }

    /// [`Model::forward_with_rows`] over every rank at once; `logits` gets
    /// rank 0's gathered rows. Fails as a whole when any rank fails.
    pub fn forward_with_rows(
        &mut self,
        seqs: &[SeqInput<'_>],
        every_row: &[bool],
        logits: &mut Vec<f32>,
    ) -> anyhow::Result<()> {
        self.comm.reset();
        let comm = &self.comm;
        let run = |r: &mut Rank, out: &mut Vec<f32>| -> anyhow::Result<()> {
            let rank = r.model.tp().map_or(0, |t| t.shard.rank);
            let res = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                r.model
                    .forward_with_rows(&r.kv, &mut r.ws, seqs, every_row, out)
            }));
            let res = match res {
                Ok(r) => r,
                Err(p) => Err(anyhow::anyhow!(
                    "rank {rank} panicked: {}",
                    crate::team::panic_message(&*p)
                )),
            };
            if let Err(e) = &res {
                comm.break_with(format!("rank {rank} failed: {e:#}"));
            }
            res
        };
        let (first, rest) = self.ranks.split_first_mut().expect("at least one rank");
        let mut results: Vec<anyhow::Result<()>> = Vec::with_capacity(rest.len() + 1);
        std::thread::scope(|sc| {
            let handles: Vec<_> = rest
                .iter_mut()
                .map(|r| {
                    sc.spawn(move || {
                        let mut scratch = Vec::new();
                        run(r, &mut scratch)
                    })
                })
                .collect();
            results.push(run(first, logits));
            for h in handles {
                results.push(
                    h.join()
                        .unwrap_or_else(|_| Err(anyhow::anyhow!("a rank's thread panicked"))),
                );
            }
        });
        // The first rank's own error explains best; the others mostly say
        // that a rank stopped.
        let mut errors = results.into_iter().filter_map(Result::err);
        match errors.next() {
            None => Ok(()),
            Some(e) => {
                logits.clear();
                Err(e)
            }
        }
    }
}
