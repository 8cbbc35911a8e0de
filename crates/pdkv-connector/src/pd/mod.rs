//! The P/D connector. Write mode: the prefill engine (P) writes a finished
//! prompt's KV blocks into the decode engine's (D) blocks when D pulls them.
//! Read mode (`"transfer_mode":"read"`): P *leases* the blocks and D reads
//! them one-sided.
//!
//! Three layers, one job each:
//! - the machines decide: P's [`crate::send::SendMachine`] (per transfer
//!   WAITING / READY / DONE, pulls, leases) and D's
//!   [`crate::recv::RecvMachine`] (per load: bootstrap or handshake, pull
//!   or read, fence);
//! - [`core::PdCore`] glues them to the engine's connector calls, the KV
//!   cache registration and the wire messages, and queues [`core::Io`] —
//!   still without I/O, so a simulator runs it as it is;
//! - a [`Driver`] carries the I/O out and feeds the results back through
//!   [`Shared::event`]: `net.rs` over TCP and shared memory on the
//!   connector's own tokio runtime (two threads, `pdkv-kv`), or a
//!   simulator's network.
//!
//! [`PdConnector`] is the engine's [`KvConnector`]: every call locks the core
//! (never across an await or an I/O), applies the call with the driver's
//! time, hands the queued I/O to the driver after unlocking, and wakes the
//! engine when a transfer ended.
//!
//! Deadlines count from when P's KV is ready: a pull waits while P computes
//! a long prompt (P reports progress every `heartbeat_s`; D gives up
//! `load_timeout_s` after it last heard from P; `prefill_timeout_s` bounds
//! the whole wait), so P/D serves every prompt a single engine serves.
//!
//! Fencing: a load D gives up (its deadline, a lost connection, its request
//! ended, a cache reset) keeps its blocks until nothing can land in them:
//! P's answer to the pull or to a drop (P answers both only once no write
//! is in flight), or the revoke of the pull's *grant* — a key that opens
//! exactly the load's blocks of D's registration and that D revokes itself
//! (over shared memory: every peer unmaps the segment). The engine learns a
//! given-up load at once (`abandoned`: the request recomputes or fails on
//! fresh blocks), so no client waits for the fence.
//!
//! Sleep mode. A registration pins the pages it covers (see
//! `pdkv_transfer::registry`), so before the KV cache is unmapped the
//! engine calls `release_kv_caches` — once no transfer holds blocks; with
//! transfers still in flight the release refuses and changes nothing. It
//! deregisters (over shared memory only after every peer that mapped the
//! segment acknowledged the unmap; if one does not, the registration is
//! restored under a new epoch and the release fails, naming the peers).
//! Until `restore_kv_caches` the connector is *asleep*: P answers every
//! pull at once ([`FailCode::Asleep`]) and D fails every load at once, so
//! nothing reaches the region while it has no pages. Restore registers the
//! same range again: same segment, next epoch, new key; an access naming an
//! older epoch is refused, so stale pages are never served.
//!
//! A transfer that a lifecycle operation or a refusal ended on purpose
//! (`FailCode::on_purpose`: P's cache reset or sleep, an aborted or
//! refused prefill, other weights) is not a failure: D recomputes the
//! prompt whatever `kv_load_failure_policy` says.

mod bootstrap;
pub mod core;
mod net;

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use anyhow::Context;
use pdkv_engine::connector::{
    Allocated, ConnectorMeta, ConnectorRequest, Ended, ExternalMatch, FinishedTransfers,
    KvCacheSpec, KvTransferParams, LoadError, MetricsReader, ParamsValidator, Waker,
};
use pdkv_engine::{KvConnector, LoadFailurePolicy};
use serde_json::json;

use self::core::{Io, PdCore};
use crate::config::KvTransferConfig;
pub use crate::recv::CUT_SHORT;

/// The least time a release gives shared-memory peers to acknowledge an
/// unmap (never more than the caller's timeout).
const MIN_UNMAP_WAIT: Duration = Duration::from_secs(1);

/// What the connector needs from the world: the time, and I/O.
pub trait Driver: Send + Sync + 'static {
    fn now(&self) -> Instant;
    /// Starts `io`; its result comes back through [`Shared::event`].
    fn execute(&self, shared: &Arc<Shared>, io: Io);
    /// Deregisters the KV cache's `segment`: over shared memory after every
    /// peer that mapped it acknowledged the unmap (waiting at most
    /// `timeout`), otherwise at once.
    fn deregister(&self, segment: u64, timeout: Duration) -> anyhow::Result<()>;
    /// The core's next timeout may have changed.
    fn timer_changed(&self, shared: &Arc<Shared>);

    /// Whether the KV cache registration `reg` can be served over this
    /// driver's transport, checked once at start-up (after the core
    /// registered it) so that a registration a peer could never map is
    /// refused there, with its reason, rather than on the first transfer.
    fn check_registration(&self, _reg: &pdkv_transfer::Registration) -> anyhow::Result<()> {
        Ok(())
    }

    /// The connector is being dropped: deliver what is on its way (bounded).
    fn flush(&self, _timeout: Duration) {}

    /// The driver's own counters for `/metrics` (what its listeners refused).
    fn counters(&self) -> Vec<(&'static str, &'static str, f64)> {
        Vec::new()
    }
}

/// The core, its driver and the engine's waker.
pub struct Shared {
    core: Mutex<PdCore>,
    driver: Box<dyn Driver>,
    waker: Mutex<Option<Waker>>,
}

impl Shared {
    pub fn new(core: PdCore, driver: Box<dyn Driver>) -> Arc<Shared> {
        Arc::new(Shared {
            core: Mutex::new(core),
            driver,
            waker: Mutex::new(None),
        })
    }

    pub fn now(&self) -> Instant {
        self.driver.now()
    }

    /// Applies an event to the core (an I/O result, a message, a timer)
    /// with the driver's time, then carries out what it queued.
    pub fn event<T>(self: &Arc<Self>, f: impl FnOnce(&mut PdCore, Instant) -> T) -> T {
        let now = self.driver.now();
        let mut core = self.core.lock().unwrap();
        let out = f(&mut core, now);
        self.pump(core);
        out
    }

    /// Reads the core (metrics, tests) without changing it.
    pub fn inspect<T>(&self, f: impl FnOnce(&PdCore) -> T) -> T {
        f(&self.core.lock().unwrap())
    }

    /// Takes the core's queued I/O and news, unlocks, then executes the I/O
    /// and wakes the engine.
    fn pump(self: &Arc<Self>, mut core: MutexGuard<'_, PdCore>) {
        let ios: Vec<Io> = std::iter::from_fn(|| core.poll_io()).collect();
        let news = core.take_news();
        drop(core);
        for io in ios {
            self.driver.execute(self, io);
        }
        self.driver.timer_changed(self);
        if news {
            let w = self.waker.lock().unwrap().clone();
            if let Some(w) = w {
                w();
            }
        }
    }
}

/// The P/D connector; see the module docs.
pub struct PdConnector {
    shared: Arc<Shared>,
    runtime: Option<tokio::runtime::Runtime>,
}

/// How long a dropped connector gives its final answers to reach the peers.
const FLUSH_WAIT: Duration = Duration::from_millis(500);

impl Drop for PdConnector {
    fn drop(&mut self) {
        self.shared.driver.flush(FLUSH_WAIT);
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

impl PdConnector {
    /// The production connector: its runtime, control listener, transfer
    /// agent and (for the side whose memory a peer maps) the shared-memory
    /// exporter.
    pub fn new(cfg: KvTransferConfig, engine_id: &str) -> anyhow::Result<PdConnector> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("pdkv-kv")
            .enable_all()
            .build()
            .context("starting the KV connector's runtime")?;
        let shared = net::start(&runtime, cfg, engine_id)?;
        Ok(PdConnector {
            shared,
            runtime: Some(runtime),
        })
    }

    /// A connector over any driver (a simulator's).
    pub fn with_driver(core: PdCore, driver: Box<dyn Driver>) -> PdConnector {
        PdConnector {
            shared: Shared::new(core, driver),
            runtime: None,
        }
    }

    pub fn shared(&self) -> &Arc<Shared> {
        &self.shared
    }

    /// Where P's control listener is (the `remote_bootstrap_addr` D uses).
    pub fn bootstrap_addr(&self) -> String {
        self.shared.inspect(|c| c.bootstrap_addr().to_string())
    }

    fn call<T>(&self, f: impl FnOnce(&mut PdCore, Instant) -> T) -> T {
        self.shared.event(f)
    }
}

impl KvConnector for PdConnector {
    fn name(&self) -> &str {
        "pdkv"
    }

    fn supports_sleep_mode(&self) -> bool {
        true
    }

    fn info(&self) -> serde_json::Value {
        self.shared.inspect(|core| {
            let c = core.config();
            json!({
                "engine_id": core.engine_id(),
                "kv_role": c.kv_role.as_str(),
                "transport": c.transport.as_str(),
                "transfer_mode": c.transfer_mode.as_str(),
                "bootstrap_addr": core.bootstrap_addr(),
                "transfer_addr": match core.transfer_dest() {
                    crate::wire::Destination::Tcp { addr } => addr.clone(),
                    crate::wire::Destination::Shm { path } => path.clone(),
                },
                "supports_sleep_mode": true,
                "registration_epoch": core.kv().map(|k| k.generation()),
                "kv_released": core.is_asleep(),
            })
        })
    }

    fn validate_params(&self, params: Option<&KvTransferParams>) -> Result<(), String> {
        self.shared.inspect(|c| {
            let cfg = c.config();
            core::validate(cfg.kv_role, cfg.kv_peers.as_ref(), params).map_err(|e| e.to_string())
        })
    }

    fn params_validator(&self) -> ParamsValidator {
        let (role, peers) = self
            .shared
            .inspect(|c| (c.config().kv_role, c.config().kv_peers.clone()));
        Arc::new(move |p| core::validate(role, peers.as_ref(), p).map_err(|e| e.to_string()))
    }

    fn metrics_reader(&self) -> Option<MetricsReader> {
        let shared = self.shared.clone();
        Some(Arc::new(move || {
            let mut m = shared.inspect(metrics);
            m.extend(shared.driver.counters());
            m
        }))
    }

    fn set_waker(&mut self, waker: Waker) {
        *self.shared.waker.lock().unwrap() = Some(waker);
    }

    fn load_failure_policy(&self) -> LoadFailurePolicy {
        self.shared.inspect(|c| c.config().kv_load_failure_policy)
    }

    fn set_weights_version(&mut self, version: Option<&str>) {
        self.call(|c, _| c.set_weights_version(version));
    }

    fn request_added(&mut self, req: ConnectorRequest<'_>) {
        self.call(|c, now| c.request_added(now, req));
    }

    fn get_num_new_matched_tokens(
        &mut self,
        req: ConnectorRequest<'_>,
        num_computed_tokens: usize,
    ) -> ExternalMatch {
        self.call(|c, now| c.get_num_new_matched_tokens(now, req, num_computed_tokens))
    }

    fn update_state_after_alloc(&mut self, req: ConnectorRequest<'_>, alloc: Allocated<'_>) {
        self.call(|c, _| c.update_state_after_alloc(req, alloc));
    }

    fn build_connector_meta(&mut self) -> ConnectorMeta {
        ConnectorMeta(Box::new(self.call(|c, _| c.take_new_loads())))
    }

    fn request_finished(
        &mut self,
        req: ConnectorRequest<'_>,
        end: Ended<'_>,
    ) -> (bool, Option<KvTransferParams>) {
        self.call(|c, now| c.request_finished(now, req, end))
    }

    /// P: stops holding KV for D (see [`crate::send::SendMachine::abort_all`]).
    /// D: cuts every load short: one not started ends now, one in flight
    /// once fenced; all are reported with [`CUT_SHORT`] (the engine holds
    /// their blocks and recomputes the requests).
    fn abort_transfers(&mut self) {
        self.call(|c, now| c.abort_transfers(now));
    }

    fn num_held_blocks(&self) -> usize {
        self.shared.inspect(|c| c.num_held_blocks())
    }

    fn reclaim_held_blocks(&mut self, blocks: usize) -> usize {
        self.call(|c, now| c.reclaim(now, blocks))
    }

    /// Registers the KV cache, then asks the driver whether its transport
    /// can serve the registration (over shared memory: whether a peer may
    /// map that many memfds); a refusal fails the engine's start, naming
    /// why.
    fn register_kv_caches(&mut self, spec: &KvCacheSpec) -> anyhow::Result<()> {
        self.call(|c, _| c.register_kv_caches(spec))?;
        let regs = self.shared.inspect(|c| c.kv().map(|k| k.regs()));
        for (i, reg) in regs.unwrap_or_default().iter().enumerate() {
            self.shared
                .driver
                .check_registration(reg)
                .with_context(|| {
                    format!("connector pdkv: rank {i}'s KV cache cannot be transferred")
                })?;
        }
        Ok(())
    }

    fn start_load_kv(&mut self, meta: ConnectorMeta) {
        let Ok(reqs) = meta.0.downcast::<Vec<Arc<str>>>() else {
            return;
        };
        self.call(|c, now| c.start_load_kv(now, *reqs));
    }

    fn get_finished(&mut self) -> FinishedTransfers {
        self.call(|c, _| c.get_finished())
    }

    fn get_block_ids_with_load_errors(&mut self) -> Vec<(u32, LoadError)> {
        self.call(|c, _| c.get_block_ids_with_load_errors())
    }

    /// Releases every rank's KV cache registration when nothing is in
    /// flight (else refuses, changing nothing, and names what was in
    /// flight); over shared memory each deregistration waits for every
    /// peer's unmap: each rank the time left of `timeout`, but at least
    /// [`MIN_UNMAP_WAIT`] (capped by `timeout`), so a slow first rank does
    /// not leave the later ones no time at all (the whole release waits at
    /// most `timeout` plus that minimum per further rank). All ranks or
    /// none: when one rank's peer does not acknowledge in time, the release
    /// fails naming that rank, and every rank — those released before it
    /// too — is registered again under a new epoch, so a retry starts from
    /// one state. Should that registration fail as well, the ranks not yet
    /// released are deregistered at once (without waiting for their
    /// peers), so that no rank stays registered under the old epoch: the
    /// connector is then released on every rank, as after a release, and
    /// the next restore registers every rank. Idempotent.
    fn release_kv_caches(&mut self, timeout: Duration) -> anyhow::Result<()> {
        let t0 = self.shared.now();
        let began = self.call(|c, now| c.begin_release(now));
        let regs = match began {
            Ok(None) => return Ok(()),
            Ok(Some(regs)) => regs,
            Err(busy) => anyhow::bail!("connector pdkv: the KV cache registration is still in use: {busy}; nothing was released"),
        };
        let least = MIN_UNMAP_WAIT.min(timeout);
        for (i, reg) in regs.iter().enumerate() {
            let left = timeout.saturating_sub(self.shared.now() - t0).max(least);
            let Err(e) = self.shared.driver.deregister(reg.segment, left) else {
                tracing::info!(rank = i, segment = reg.segment, epoch = reg.epoch, waited = ?self.shared.now() - t0, "KV cache registration released");
                continue;
            };
            // Serve again under a new epoch on every rank: the old ones are
            // refused, and the pages a late peer still maps are freed when
            // it unmaps.
            let restored = self.call(|c, _| c.restore());
            let done = match i {
                0 => String::new(),
                1 => "rank 0 had been released; ".to_string(),
                _ => format!("ranks 0..{i} had been released; "),
            };
            let what = format!(
                "rank {i}: releasing the KV cache registration (segment {}): {e:#}; {done}",
                reg.segment
            );
            return match restored {
                Ok(()) => Err(anyhow::anyhow!("{what}every rank's registration was restored under a new epoch; the release can be retried")),
                Err(r) => {
                    // Ranks i+1.. still hold the old epoch: give them up
                    // too, so every rank is released and none is half so.
                    // (Rank i's own deregistration refused its old epoch
                    // before it waited for the peers.)
                    let rest = &regs[i + 1..];
                    for reg in rest {
                        if let Err(e) = self.shared.driver.deregister(reg.segment, Duration::ZERO) {
                            tracing::warn!(segment = reg.segment, error = %format!("{e:#}"), "deregistered without waiting for the peers' unmap");
                        }
                    }
                    let gave_up = match (i + 1, regs.len()) {
                        (a, n) if a >= n => String::new(),
                        (a, n) if a + 1 == n => format!("rank {a} was deregistered without waiting for its peers; "),
                        (a, n) => format!("ranks {a}..{n} were deregistered without waiting for their peers; "),
                    };
                    Err(anyhow::anyhow!("{what}registering every rank again failed too: {r:#}; {gave_up}no rank is registered, and the KV cache registration stays released until it is restored"))
                }
            };
        }
        Ok(())
    }

    /// Registers the KV cache again: the same segment with a new epoch and
    /// key. D's next pulls carry them; an access naming the old epoch is
    /// refused. Idempotent.
    fn restore_kv_caches(&mut self) -> anyhow::Result<()> {
        self.call(|c, _| c.restore())
    }
}

/// The connector's counters and gauges, for `/metrics`.
fn metrics(core: &PdCore) -> Vec<(&'static str, &'static str, f64)> {
    let c = core.counters();
    let f = |v: u64| v as f64;
    vec![
        ("pulls_ok_total", "Pulls this prefill engine served successfully", f(c.pulls_ok)),
        ("pulls_failed_total", "Pulls this prefill engine answered with an error", f(c.pulls_failed)),
        ("loads_ok_total", "KV loads this decode engine completed", f(c.loads_ok)),
        ("loads_failed_total", "KV loads this decode engine failed", f(c.loads_failed)),
        ("loads_cut_short_total", "KV loads this decode engine ended early for a cache reset", f(c.loads_cut_short)),
        ("pulls_cancelled_total", "Pulls ended because the decode engine dropped the transfer", f(c.pulls_cancelled)),
        ("loads_cancelled_total", "KV loads ended because their request ended first", f(c.loads_cancelled)),
        (
            "pulls_released_total",
            "Pulls refused because the transfer was ended on purpose (cache reset, sleep, refused or aborted prefill)",
            f(c.pulls_released),
        ),
        (
            "loads_released_total",
            "KV loads the prefill side ended on purpose (cache reset, sleep, refused or aborted prefill); recomputed",
            f(c.loads_released),
        ),
        (
            "loads_lease_expired_total",
            "KV loads that found the prefill engine's lease expired (recomputed: P's work was lost)",
            f(c.loads_lease_expired),
        ),
        ("claims_sent_total", "Transfers this decode engine claimed for its queued requests (each renewal counts)", f(c.claims_sent)),
        ("claims_received_total", "Transfers decode engines claimed from this prefill engine (each renewal counts)", f(c.claims_received)),
        ("leases_expired_total", "Leases that expired on transfers no decode engine claimed or pulled", f(c.leases_expired)),
        (
            "claimed_leases_expired_total",
            "Leases that expired although a decode engine had claimed the transfer (its claims stopped)",
            f(c.claimed_leases_expired),
        ),
        (
            "leases_reclaimed_total",
            "Held transfers this prefill engine gave back early because new prompts needed the blocks (D recomputes them)",
            f(c.leases_reclaimed),
        ),
        ("claimed_transfers", "Queued requests whose transfers this decode engine claims now", core.num_claimed() as f64),
        ("loads_abandoned_total", "KV loads given up (deadline, lost peer) before their transfer was fenced", f(c.loads_abandoned)),
        ("fences_total", "Fences of loads a prefill engine might still have been writing", f(c.fences)),
        ("drops_unpulled_total", "Transfers this decode engine dropped without pulling", f(c.drops_unpulled)),
        ("drops_received_total", "Drops of transfers this prefill engine received", f(c.drops_received)),
        ("bytes_sent_total", "KV bytes this prefill engine wrote to decode engines", f(c.bytes_sent)),
        ("handshakes_total", "Read-mode handshakes this decode engine made with prefill engines", f(c.handshakes)),
        ("bytes_read_total", "KV bytes this decode engine read from prefill engines", f(c.bytes_read)),
        ("reads_done_total", "Leases ended by a decode engine's read_done while they held", f(c.reads_done)),
        ("reads_late_total", "read_done reports that came after the lease had ended", f(c.reads_late)),
        ("send_held_blocks", "KV blocks held for decode engines now", core.send_machine().held_blocks() as f64),
        ("pulls_pending", "Pulls received and not yet answered (or still writing)", core.send_machine().live_pulls() as f64),
        ("loads_in_flight", "KV loads started and not yet ended (fencing included)", core.recv_machine().num_active() as f64),
        ("kv_released", "1 while the KV cache registration is released (asleep)", if core.is_asleep() { 1.0 } else { 0.0 }),
    ]
}
