//! Where the ranks meet ([`Comm`]): a barrier with a deadline that a
//! failing rank breaks for everyone, and whole activations exchanged
//! through buffers used by turns.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, RwLock};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};

/// Longest a rank waits for the others at one meeting point.
pub const COLLECTIVE_TIMEOUT: Duration = Duration::from_secs(120);

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
    pub(super) fn reset(&self) {
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
pub(super) fn place_cols(
    parts: &[&[f32]],
    widths: &[usize],
    out: &mut [f32],
) -> anyhow::Result<()> {
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

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
