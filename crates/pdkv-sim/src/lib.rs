//! A deterministic simulator of a P/D deployment (see [`world`]).
//!
//! [`run`] plays one seed: a safety phase (clients under load, operators
//! driving lifecycle operations on P and D at random, faults when asked),
//! then a liveness phase (faults healed, every engine brought back to
//! serving, no new work) that must end with every client request ended and
//! every engine idle with every block free. Checked at every event:
//! - no token is computed from stale or foreign KV (the simulated model
//!   checks every attended position's tag: this request's tokens, these
//!   weights) and D's answers equal a colocated engine's when its weights
//!   did not change meanwhile;
//! - no KV frame lands in blocks D has given back;
//! - a KV cache split over tensor-parallel ranks is registered on every
//!   rank (at the epochs the connector names) or on none, never on some,
//!   and its ranks sleep and wake together;
//! - the scheduler's invariants (block references, queues) hold;
//! - every engine request ends exactly once, every client request is
//!   counted exactly once, every pull is answered at most once (and, at the
//!   end, at least once by a live prefill engine);
//! - no connector deadline stays pending past its time;
//! - a KV cache that is asleep holds no memory;
//! - every lifecycle call is answered within 60 simulated seconds;
//! - without network faults, no client request is lost (a 5xx other than a
//!   retryable 503) to lifecycle operations.
//!
//! The same seed gives the same run: every table is ordered, the one
//! random source is the seed's, and time is the simulator's.

mod checker;
mod cluster;
mod ctx;
mod kv;
pub mod model;
mod net;
pub mod node;
mod operator;
mod proxy;
mod rng;
mod workload;
pub mod world;

/// The proxy's relay plan, which the simulator drives, and the code of a
/// retryable refusal.
use pdkv_relay::{plan, RETRYABLE_CODE};

use std::collections::BTreeMap;
use std::time::Duration;

/// What one run does.
#[derive(Clone, Debug)]
pub struct Options {
    pub seed: u64,
    /// D reads P's leased blocks (else P writes into D's).
    pub read_mode: bool,
    /// `kv_load_failure_policy` of the decode engine: `fail` or `recompute`.
    pub policy: &'static str,
    /// Lifecycle operations on the engines during the safety phase.
    pub lifecycle: bool,
    /// Network faults (delays with long spikes, lost and duplicated frames,
    /// broken connections, partitions).
    pub faults: bool,
    /// Engines that crash and restart (with `faults`).
    pub crashes: bool,
    /// The prefill engine computes slowly: long prompts outlast every
    /// transfer timeout.
    pub slow_prefill: bool,
    /// How long (ms, uniform) an engine serves between two lifecycle
    /// sequences.
    pub op_idle_ms: (u64, u64),
    /// Client requests in the safety phase, at most.
    pub clients: u64,
    /// Simulated length of the safety phase.
    pub safety: Duration,
    /// Bound on the liveness phase.
    pub liveness: Duration,
    /// Tensor-parallel ranks of the prefill engine and of the decode
    /// engine (each 1 to [`model::NUM_KV_HEADS`]).
    pub p_tp: usize,
    pub d_tp: usize,
}

impl Options {
    /// A run of `seed` with its variant drawn from the seed: mode, policy,
    /// whether network faults are on, and how each engine is split over
    /// tensor-parallel ranks.
    pub fn for_seed(seed: u64) -> Options {
        let slow_prefill = (seed / 8) % 4 == 1;
        let (p_tp, d_tp) = tp_for_seed(seed);
        Options {
            seed,
            read_mode: seed % 2 == 1,
            policy: if (seed / 2).is_multiple_of(2) {
                "fail"
            } else {
                "recompute"
            },
            lifecycle: true,
            faults: (seed / 4) % 2 == 1,
            crashes: (seed / 4) % 4 == 3,
            slow_prefill,
            // A slow prefill engine gets fewer requests, so its backlog
            // drains within the liveness bound.
            clients: if slow_prefill { 60 } else { 400 },
            // Rarer lifecycle operations when prefills are slow, so that
            // some long ones run undisturbed.
            op_idle_ms: if slow_prefill {
                (5_000, 40_000)
            } else {
                (200, 8_000)
            },
            safety: Duration::from_secs(60),
            liveness: Duration::from_secs(if slow_prefill { 1800 } else { 600 }),
            p_tp,
            d_tp,
        }
    }
}

/// The tensor-parallel sizes of a seed's prefill and decode engines. Drawn
/// from a stream of the seed's own, so that the rest of a run (which draws
/// from the run's stream) does not shift with it: a quarter of the seeds
/// run both engines on one rank, the others every pair of 1, 2, 3 (an
/// uneven split of the heads) and 4 ranks, heterogeneous pairs most often.
fn tp_for_seed(seed: u64) -> (usize, usize) {
    let mut r = rng::Rng::new(seed ^ 0x7470_7470_7470_7470);
    if r.below(4) == 0 {
        return (1, 1);
    }
    const SIZES: [usize; 6] = [1, 2, 2, 4, 1, 3];
    (*r.pick(&SIZES), *r.pick(&SIZES))
}

/// What a run saw.
#[derive(Clone, Debug, Default)]
pub struct Report {
    pub seed: u64,
    /// The prefill and decode engines' tensor-parallel ranks.
    pub p_tp: usize,
    pub d_tp: usize,
    pub events: u64,
    pub simulated: Duration,
    pub clients: u64,
    pub outcomes: BTreeMap<&'static str, u64>,
    /// Client requests that failed on the server side (a 5xx but a
    /// retryable 503).
    pub lost: u64,
    /// The first few lost requests' answers.
    pub losses: Vec<String>,
    pub prefill_skipped: u64,
    /// Streams the proxy moved to a decode engine after losing theirs.
    pub resumed: u64,
    /// Of the streams that ended whole, those that were resumed and whose
    /// tokens, as the client got them, were checked against a colocated
    /// engine's.
    pub checked_resumed: u64,
    pub checked_outputs: u64,
    pub frames: u64,
    /// KV frames that arrived after their write had ended (refused by D's
    /// registry, or a violation).
    pub late_frames: u64,
    /// The engines' connector counters at the end (a restarted engine's
    /// count from its restart).
    pub loads_ok: u64,
    pub loads_released: u64,
    pub loads_failed: u64,
    pub loads_abandoned: u64,
    pub pulls_ok: u64,
    /// Transfers D claimed for queued requests (renewals included).
    pub claims_sent: u64,
    /// Leases P let expire: on transfers no D claimed, and on claimed ones
    /// (a D whose claims stopped: crashed or cut off; never without faults).
    pub leases_expired: u64,
    pub claimed_leases_expired: u64,
    /// D loads that found the lease expired (recomputed).
    pub loads_lease_expired: u64,
    /// Held transfers P gave back because new prompts needed the blocks.
    pub leases_reclaimed: u64,
    pub operations: u64,
    pub operations_ok: u64,
    pub operations_failed: u64,
    pub operation_errors: BTreeMap<String, u64>,
    pub crashes: u64,
    /// Per-rank KV copies that landed in D's memory (a write's frame or a
    /// read's answer).
    pub rank_copies: u64,
    /// Transfers (writes and reads) between engines split over different
    /// numbers of ranks.
    pub hetero_transfers: u64,
    /// Lifecycle calls failed by an injected fault on one rank while
    /// releasing the KV cache registrations (a deregistration a peer did
    /// not acknowledge) or restoring them (a registration that failed).
    pub rank_release_faults: u64,
    pub rank_restore_faults: u64,
    /// Of the release faults, those whose rollback (registering every rank
    /// again) failed too, on an injected registration fault.
    pub rank_rollback_faults: u64,
    /// Of those, the calls that then succeeded when retried.
    pub rank_faults_retried: u64,
    /// A hash of every event's time, schedule place and kind: a replay
    /// must reproduce it exactly.
    pub trace: u64,
    pub violations: Vec<String>,
}

impl Report {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }

    /// One line for a log.
    pub fn line(&self) -> String {
        format!(
            "seed {} {}: TP {}->{}, {} events, {:.1} s simulated, {} clients {:?}, lost {}, {} outputs checked, {} KV frames ({} late), {} rank copies, {} heterogeneous transfers, loads ok/released/failed/abandoned {}/{}/{}/{}, {} claims, leases expired unclaimed/claimed {}/{} ({} loads found one expired), {} reclaimed, {} lifecycle calls ({} failed), rank faults release/restore/rollback {}/{}/{} ({} retried), {} crashes, {} streams resumed ({} checked whole){}",
            self.seed,
            if self.ok() { "ok" } else { "VIOLATION" },
            self.p_tp,
            self.d_tp,
            self.events,
            self.simulated.as_secs_f64(),
            self.clients,
            self.outcomes,
            self.lost,
            self.checked_outputs,
            self.frames,
            self.late_frames,
            self.rank_copies,
            self.hetero_transfers,
            self.loads_ok,
            self.loads_released,
            self.loads_failed,
            self.loads_abandoned,
            self.claims_sent,
            self.leases_expired,
            self.claimed_leases_expired,
            self.loads_lease_expired,
            self.leases_reclaimed,
            self.operations,
            self.operations_failed,
            self.rank_release_faults,
            self.rank_restore_faults,
            self.rank_rollback_faults,
            self.rank_faults_retried,
            self.crashes,
            self.resumed,
            self.checked_resumed,
            self.violations.first().map(|v| format!(": {v}")).unwrap_or_default()
        )
    }
}

/// Plays every run of `opts` on up to `threads` threads and returns their
/// reports in `opts`' order. Each run is a world of its own (its clock,
/// its random numbers, its network), so a report is the one [`run`] gives
/// for the same options, whichever thread played it.
pub fn run_each(opts: Vec<Options>, threads: usize) -> Vec<Report> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<Report>>> = opts.iter().map(|_| Mutex::new(None)).collect();
    std::thread::scope(|s| {
        for _ in 0..threads.clamp(1, opts.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(o) = opts.get(i) else { break };
                let r = run(o.clone());
                *slots[i].lock().unwrap() = Some(r);
            });
        }
    });
    slots
        .into_iter()
        .map(|m| m.into_inner().unwrap().expect("every run was played"))
        .collect()
}

/// Plays one run. A panic inside the real code (an invariant check) is a
/// violation too.
pub fn run(opts: Options) -> Report {
    let (seed, p_tp, d_tp) = (opts.seed, opts.p_tp, opts.d_tp);
    let played = std::panic::catch_unwind(std::panic::AssertUnwindSafe(
        || -> anyhow::Result<Report> {
            let mut w = world::World::new(opts)?;
            w.run()?;
            Ok(w.into_report())
        },
    ));
    match played {
        Ok(Ok(r)) => r,
        Ok(Err(e)) => Report {
            seed,
            p_tp,
            d_tp,
            violations: vec![format!("the run could not be set up: {e:#}")],
            ..Report::default()
        },
        Err(p) => {
            let msg = pdkv_model::team::panic_message(&*p);
            Report {
                seed,
                p_tp,
                d_tp,
                violations: vec![format!("panic: {msg}")],
                ..Report::default()
            }
        }
    }
}
