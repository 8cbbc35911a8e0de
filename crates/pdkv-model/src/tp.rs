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

use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context};
use pdkv_vmem::{Pool, Tag};

use crate::forward::{Model, SeqInput, Workspace};
use crate::kv::KvCache;
use crate::weights::{DType, LayerWeights, TensorRef, Weights, WeightsLayout};
use crate::ModelConfig;

/// Longest a rank waits for the others at one meeting point.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

/// What one rank holds of the model.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
    /// Query heads (those of the KV heads below).
    pub heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Rows of `o_proj` and `down_proj`: columns of the residual update.
    pub hidden: Range<usize>,
    /// Rows of `gate/up_proj`: columns of the MLP's intermediate activation.
    pub inter: Range<usize>,
    /// Rows of the embedding table and the LM head.
    pub vocab: Range<usize>,
}

impl Shard {
    /// The rank's model shape: its heads and MLP columns. `vocab_size`
    /// stays the whole vocabulary (token ids and logits rows are global).
    pub fn config(&self, full: &ModelConfig) -> ModelConfig {
        ModelConfig {
            num_heads: self.heads.len(),
            num_kv_heads: self.kv_heads.len(),
            intermediate_size: self.inter.len(),
            ..full.clone()
        }
    }
}

/// Part `rank` of `n` units split into `size` contiguous ranges, the first
/// `n % size` ranges one unit longer.
fn split(n: usize, size: usize, rank: usize) -> Range<usize> {
    let (base, extra) = (n / size, n % size);
    let start = rank * base + rank.min(extra);
    start..start + base + usize::from(rank < extra)
}

/// How `full` splits over `size` ranks; an error says what does not divide.
pub fn plan(cfg: &ModelConfig, size: usize) -> anyhow::Result<Vec<Shard>> {
    ensure!(size >= 1, "the tensor-parallel size must be at least 1");
    ensure!(
        cfg.num_kv_heads >= size,
        "tensor-parallel size {size} exceeds the model's {} KV heads (each rank needs one of its own)",
        cfg.num_kv_heads
    );
    ensure!(
        cfg.hidden_size >= size && cfg.intermediate_size >= size && cfg.vocab_size >= size,
        "tensor-parallel size {size} exceeds the model's dimensions"
    );
    let group = cfg.num_heads / cfg.num_kv_heads;
    Ok((0..size)
        .map(|rank| {
            let kv_heads = split(cfg.num_kv_heads, size, rank);
            Shard {
                rank,
                size,
                heads: kv_heads.start * group..kv_heads.end * group,
                kv_heads,
                hidden: split(cfg.hidden_size, size, rank),
                inter: split(cfg.intermediate_size, size, rank),
                vocab: split(cfg.vocab_size, size, rank),
            }
        })
        .collect())
}

fn row_bytes(t: &TensorRef) -> usize {
    let cols = t.shape.last().copied().unwrap_or(1);
    match t.dtype {
        DType::F32 => cols * 4,
        DType::Quant(q) => q.row_bytes(cols),
    }
}

/// How a rank's tensor is cut from the whole one.
#[derive(Clone, Debug)]
enum Cut {
    Whole,
    Rows(Range<usize>),
}

impl Cut {
    fn shape(&self, t: &TensorRef) -> Vec<usize> {
        match self {
            Cut::Whole => t.shape.clone(),
            Cut::Rows(r) => vec![r.len(), t.shape[1]],
        }
    }

    /// Copies the cut of `src` (in `from`) to `dst` (in `to`).
    fn copy(
        &self,
        from: &Weights,
        src: &TensorRef,
        to: &Weights,
        dst: &TensorRef,
    ) -> anyhow::Result<()> {
        // SAFETY: the source weights are not written while they are read
        // (a load or reload writes only regions no step reads yet).
        let bytes = |off: usize, len: usize| unsafe { from.region.slice::<u8>(off, len) };
        match self {
            Cut::Whole => to
                .region
                .write_bytes(dst.offset, bytes(src.offset, src.bytes()))?,
            Cut::Rows(r) => {
                let rb = row_bytes(src);
                let s = bytes(src.offset + r.start * rb, r.len() * rb);
                to.region.write_bytes(dst.offset, s)?;
            }
        }
        Ok(())
    }
}

/// Every tensor of a rank with its cut, in one fixed order.
fn cuts<'w>(w: &'w Weights, s: &Shard, hd: usize) -> Vec<(&'w TensorRef, Cut)> {
    let (q, kv) = (
        s.heads.start * hd..s.heads.end * hd,
        s.kv_heads.start * hd..s.kv_heads.end * hd,
    );
    let mut v = vec![(&w.embed, Cut::Rows(s.vocab.clone()))];
    for l in &w.layers {
        v.extend([
            (&l.attn_norm, Cut::Whole),
            (&l.wq, Cut::Rows(q.clone())),
            (&l.wk, Cut::Rows(kv.clone())),
            (&l.wv, Cut::Rows(kv.clone())),
            (&l.wo, Cut::Rows(s.hidden.clone())),
            (&l.ffn_norm, Cut::Whole),
            (&l.w_gate, Cut::Rows(s.inter.clone())),
            (&l.w_up, Cut::Rows(s.inter.clone())),
            (&l.w_down, Cut::Rows(s.hidden.clone())),
        ]);
        v.extend(
            [&l.q_norm, &l.k_norm]
                .into_iter()
                .flatten()
                .map(|t| (t, Cut::Whole)),
        );
    }
    v.push((&w.final_norm, Cut::Whole));
    if w.lm_head != w.embed {
        v.push((&w.lm_head, Cut::Rows(s.vocab.clone())));
    }
    v
}

/// Rank `s`'s weights, cut from `full` into a new `weights` region of `pool`.
pub fn shard_weights(
    full: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
    pool: &Pool,
) -> anyhow::Result<Weights> {
    let mut lay = WeightsLayout::new();
    let refs: Vec<TensorRef> = cuts(full, s, cfg.head_dim)
        .iter()
        .map(|(t, c)| lay.push_typed(&c.shape(t), t.dtype))
        .collect();
    // The same tensors in the order `cuts` lists them.
    let mut refs = refs.into_iter();
    let mut next = || refs.next().expect("one cut per tensor");
    let embed = next();
    let layers = full
        .layers
        .iter()
        .map(|l| LayerWeights {
            attn_norm: next(),
            wq: next(),
            wk: next(),
            wv: next(),
            wo: next(),
            ffn_norm: next(),
            w_gate: next(),
            w_up: next(),
            w_down: next(),
            q_norm: l.q_norm.as_ref().map(|_| next()),
            k_norm: l.k_norm.as_ref().map(|_| next()),
        })
        .collect();
    let final_norm = next();
    let lm_head = if full.lm_head == full.embed {
        embed.clone()
    } else {
        next()
    };
    let region = pool
        .allocate(Tag::Weights, lay.total_bytes())
        .with_context(|| format!("allocating rank {}'s weights", s.rank))?;
    let out = Weights {
        region,
        embed,
        layers,
        final_norm,
        lm_head,
    };
    copy_shard(full, &out, cfg, s)?;
    Ok(out)
}

/// Checks that rank `s`'s cut of `full` fits `dst`, a shard laid out as
/// [`shard_weights`] lays it out: the same tensors, shapes and formats.
pub fn check_shard(
    full: &Weights,
    dst: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
) -> anyhow::Result<()> {
    let (src, dst_cuts) = (cuts(full, s, cfg.head_dim), cuts(dst, s, cfg.head_dim));
    ensure!(
        src.len() == dst_cuts.len(),
        "the checkpoint has other tensors than rank {}'s weights",
        s.rank
    );
    for ((t, cut), (d, _)) in src.iter().zip(&dst_cuts) {
        ensure!(
            cut.shape(t) == d.shape && t.dtype == d.dtype,
            "rank {}: a {:?} {:?} tensor does not fit the running {:?} {:?} one",
            s.rank,
            cut.shape(t),
            t.dtype,
            d.shape,
            d.dtype
        );
    }
    Ok(())
}

/// Writes rank `s`'s cut of `full` over `dst` (after [`check_shard`]).
pub fn copy_shard(
    full: &Weights,
    dst: &Weights,
    cfg: &ModelConfig,
    s: &Shard,
) -> anyhow::Result<()> {
    check_shard(full, dst, cfg, s)?;
    let (src, dst_cuts) = (cuts(full, s, cfg.head_dim), cuts(dst, s, cfg.head_dim));
    for ((t, cut), (d, _)) in src.iter().zip(&dst_cuts) {
        cut.copy(full, t, dst, d)?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Meeting points
// ---------------------------------------------------------------------------

#[derive(Debug, Default)]
struct BarrierState {
    arrived: usize,
    generation: u64,
    broken: Option<String>,
}

/// Where the ranks exchange values: a barrier with a deadline that a
/// failing rank breaks for everyone, and two buffers per rank, used by
/// turns.
pub struct Comm {
    size: usize,
    timeout: Duration,
    state: Mutex<BarrierState>,
    cv: Condvar,
    slots: [Vec<RwLock<Vec<f32>>>; 2],
    /// Exchanges each rank made in this step (which buffers are its turn).
    made: Vec<AtomicUsize>,
    /// The barrier's generation and whether it broke, readable without the
    /// lock (for the spin before a wait).
    passed: AtomicU64,
    stop: AtomicBool,
}

/// How long a rank spins at a meeting before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

impl Comm {
    pub fn new(size: usize, timeout: Duration) -> Comm {
        let slots = || (0..size).map(|_| RwLock::new(Vec::new())).collect();
        Comm {
            size,
            timeout,
            state: Mutex::new(BarrierState::default()),
            cv: Condvar::new(),
            slots: [slots(), slots()],
            made: (0..size).map(|_| AtomicUsize::new(0)).collect(),
            passed: AtomicU64::new(0),
            stop: AtomicBool::new(false),
        }
    }

    /// Readies the exchanges for a step (no rank is running now).
    fn reset(&self) {
        *self.state.lock().unwrap() = BarrierState::default();
        self.passed.store(0, Ordering::Release);
        self.stop.store(false, Ordering::Release);
        for m in &self.made {
            m.store(0, Ordering::Relaxed);
        }
    }

    /// Makes every waiting and later exchange fail with `why` until the
    /// next step.
    pub fn break_with(&self, why: String) {
        let mut s = self.state.lock().unwrap();
        if s.broken.is_none() {
            s.broken = Some(why);
        }
        self.stop.store(true, Ordering::Release);
        self.cv.notify_all();
    }

    /// Waits until every rank arrived at the same meeting.
    fn meet(&self, rank: usize, what: &str) -> anyhow::Result<()> {
        let mut s = self.state.lock().unwrap();
        if let Some(b) = &s.broken {
            bail!("rank {rank} stopped at {what}: {b}");
        }
        let generation = s.generation;
        s.arrived += 1;
        if s.arrived == self.size {
            s.arrived = 0;
            s.generation += 1;
            self.passed.store(s.generation, Ordering::Release);
            self.cv.notify_all();
            return Ok(());
        }
        // The others are usually a few microseconds away (a meeting comes
        // every half layer): spin a while before sleeping on the condvar,
        // whose wake-up costs more than that.
        drop(s);
        let spin_until = Instant::now() + SPIN;
        while self.passed.load(Ordering::Acquire) == generation
            && !self.stop.load(Ordering::Acquire)
            && Instant::now() < spin_until
        {
            std::hint::spin_loop();
        }
        let mut s = self.state.lock().unwrap();
        let deadline = Instant::now() + self.timeout;
        loop {
            if s.generation != generation {
                return Ok(());
            }
            if let Some(b) = &s.broken {
                bail!("rank {rank} stopped at {what}: {b}");
            }
            let now = Instant::now();
            if now >= deadline {
                let why = format!(
                    "rank {rank} waited {:?} at {what} for the other ranks",
                    self.timeout
                );
                s.broken = Some(why.clone());
                self.stop.store(true, Ordering::Release);
                self.cv.notify_all();
                bail!(why);
            }
            s = self.cv.wait_timeout(s, deadline - now).unwrap().0;
        }
    }

    /// Every rank gives `local` and, once all have, `read` sees all of
    /// them in rank order.
    pub fn exchange<R>(
        &self,
        rank: usize,
        local: &[f32],
        what: &str,
        read: impl FnOnce(&[&[f32]]) -> anyhow::Result<R>,
    ) -> anyhow::Result<R> {
        let turn = self.made[rank].fetch_add(1, Ordering::Relaxed) % 2;
        let slots = &self.slots[turn];
        {
            let mut slot = slots[rank].write().unwrap();
            slot.clear();
            slot.extend_from_slice(local);
        }
        // After this meeting nobody writes these buffers again before
        // every rank passed the next one, so after everyone read them.
        self.meet(rank, what)?;
        let guards: Vec<_> = slots.iter().map(|s| s.read().unwrap()).collect();
        let parts: Vec<&[f32]> = guards.iter().map(|g| g.as_slice()).collect();
        read(&parts)
    }

    /// `out` (`rows x sum(widths)`) gets rank `r`'s `local` (`rows x
    /// widths[r]`) as its columns `widths[..r].sum()..`, on every rank.
    pub fn all_gather_cols(
        &self,
        rank: usize,
        local: &[f32],
        widths: &[usize],
        out: &mut [f32],
        what: &str,
    ) -> anyhow::Result<()> {
        if self.size == 1 {
            out.copy_from_slice(local);
            return Ok(());
        }
        self.exchange(rank, local, what, |parts| place_cols(parts, widths, out))
    }
}

/// Writes each part (`rows x widths[r]`) into its columns of `out`.
fn place_cols(parts: &[&[f32]], widths: &[usize], out: &mut [f32]) -> anyhow::Result<()> {
    let total: usize = widths.iter().sum();
    let rows = out.len() / total.max(1);
    let mut col = 0;
    for (r, (&p, &w)) in parts.iter().zip(widths).enumerate() {
        ensure!(
            p.len() == rows * w,
            "rank {r} sent {} values, not {rows} x {w}",
            p.len()
        );
        for i in 0..rows {
            out[i * total + col..i * total + col + w].copy_from_slice(&p[i * w..(i + 1) * w]);
        }
        col += w;
    }
    Ok(())
}

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
    fn new(
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
    /// cache of `num_blocks` blocks (its KV heads) and a workspace for steps
    /// of `max_tokens` tokens in its pool. `full` may be dropped after.
    pub fn new(
        full: &Model,
        pools: Vec<Pool>,
        num_blocks: usize,
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
            let kv = KvCache::new(&pool, &rcfg, num_blocks)
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
                    p.downcast_ref::<String>()
                        .map(String::as_str)
                        .or_else(|| p.downcast_ref::<&str>().copied())
                        .unwrap_or("(no message)")
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_are_contiguous_and_cover_everything() {
        for n in 1..20 {
            for size in 1..=n {
                let mut next = 0;
                for r in 0..size {
                    let s = split(n, size, r);
                    assert_eq!(s.start, next);
                    assert!(s.len() == n / size || s.len() == n / size + 1);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn a_waiting_rank_stops_at_its_deadline_and_the_late_one_learns_why() {
        let comm = Comm::new(2, Duration::from_millis(50));
        let (local, mut out) = ([1.0f32; 2], [0.0f32; 4]);
        let what = "the attention output of layer 3";
        let err = comm
            .all_gather_cols(0, &local, &[2, 2], &mut out, what)
            .unwrap_err();
        let msg = format!("{err:#}");
        assert!(msg.contains("rank 0 waited") && msg.contains(what), "{msg}");
        let err = comm
            .all_gather_cols(1, &local, &[2, 2], &mut out, what)
            .unwrap_err();
        assert!(format!("{err:#}").contains("rank 0 waited"), "{err:#}");
        comm.reset();
        assert!(comm.state.lock().unwrap().broken.is_none());
    }

    #[test]
    fn every_rank_gathers_every_ranks_columns_exchange_after_exchange() {
        let comm = Arc::new(Comm::new(3, Duration::from_secs(10)));
        let widths = [1, 2, 3];
        // Many exchanges in a row: the buffers taken by turns never mix.
        let got: Vec<Vec<Vec<f32>>> = std::thread::scope(|sc| {
            let hs: Vec<_> = (0..3)
                .map(|r| {
                    let comm = comm.clone();
                    sc.spawn(move || {
                        (0..50)
                            .map(|n| {
                                let local: Vec<f32> = (0..2 * widths[r])
                                    .map(|i| (n * 100 + r * 10 + i) as f32)
                                    .collect();
                                let mut out = vec![0.0; 12];
                                comm.all_gather_cols(r, &local, &widths, &mut out, "test")
                                    .unwrap();
                                out
                            })
                            .collect()
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        for n in 0..50 {
            let v = |r: usize, i: usize| (n * 100 + r * 10 + i) as f32;
            // Row 0: rank 0's first value, rank 1's first two, rank 2's first three.
            let want = vec![
                v(0, 0),
                v(1, 0),
                v(1, 1),
                v(2, 0),
                v(2, 1),
                v(2, 2),
                v(0, 1),
                v(1, 2),
                v(1, 3),
                v(2, 3),
                v(2, 4),
                v(2, 5),
            ];
            for g in &got {
                assert_eq!(g[n], want, "exchange {n}");
            }
        }
    }

    #[test]
    fn a_failing_rank_stops_the_others_at_once() {
        let comm = Arc::new(Comm::new(2, Duration::from_secs(600)));
        let c = comm.clone();
        let waiting = std::thread::spawn(move || {
            let mut out = [0.0f32; 2];
            c.all_gather_cols(0, &[1.0], &[1, 1], &mut out, "the logits")
        });
        comm.break_with("rank 1 failed: its KV cache is gone".into());
        let err = waiting.join().unwrap().unwrap_err();
        assert!(
            format!("{err:#}").contains("rank 1 failed: its KV cache is gone"),
            "{err:#}"
        );
    }
}
