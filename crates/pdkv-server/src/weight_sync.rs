//! Weight sync from a trainer, in vLLM's four phases (admin routes):
//!
//! - `POST /init_weight_transfer_engine {"init_info": {"backend": "pdkv",
//!   "url": "http://HOST:PORT", "transport": "auto"}}`: where the trainer
//!   publishes (once; again to change it), and how to reach it: `auto`
//!   (the default) copies from the publisher's shared memory when it offers
//!   it and is on this host, and reads over TCP otherwise; `tcp` and `shm`
//!   force one. Any other backend is refused, naming the one there is.
//! - `POST /start_weight_update`: fetches the publisher's manifest, checks
//!   every tensor's name, type, shape and size against the running model
//!   (a mismatch is a 400 naming the tensor, before a byte moves), and
//!   stages a region laid out as the running weights.
//! - `POST /update_weights {"update_info": {"names": [...]}}`: pulls those
//!   tensors (all not yet pulled when `names` is absent) one-sided into the
//!   staging, each checked against its CRC-32. Once or in chunks.
//! - `POST /finish_weight_update {"version": "..."}`: when every tensor is
//!   pulled, installs the staging in one switch through the lifecycle
//!   machine (the same switch as a reload from disk: transfers holding
//!   old-weight KV are released first, caches invalidated, a `keep`
//!   pause's requests recompute), and the version becomes live.
//!
//! Until the switch the old weights serve; a failed pull (a publisher
//! killed mid-way, a bad checksum) keeps the update open with the failed
//! tensors unpulled, so a later pull or a new `start_weight_update` can go
//! on. The staging region is kept for the next sync (fresh pages cost more
//! than the pull) and freed when the engine sleeps at level 1 or 2, with the
//! mapping of the publisher's shared memory. Metrics: bytes and seconds per
//! sync, the staging and the kept region's bytes.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use pdkv_sync::{Puller, Staging, SyncError, Transport};
use pdkv_transfer::auth::KvSecret;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::Mutex;

use crate::error::ApiError;

/// The backend name `init_info.backend` must give.
pub const BACKEND: &str = "pdkv";
/// Bound on one pull (all the tensors it names).
const PULL_TIMEOUT: Duration = Duration::from_secs(300);
/// Connections to a publisher (reads run in parallel over them).
const CONNS: usize = 4;

/// The sync state of one server.
pub struct WeightSync {
    secret: KvSecret,
    /// Where the puller's agent binds (serving this engine's staging to a
    /// relayed engine).
    bind_ip: String,
    phase: Mutex<Phase>,
    /// The puller of the last init (also in `phase`), reachable without
    /// waiting for a step in progress: for the metrics and a sleep.
    puller: std::sync::Mutex<Option<Arc<Puller>>>,
    stats: SyncStats,
}

#[derive(Default)]
struct Phase {
    /// The publisher's URL, once initialised.
    url: Option<String>,
    puller: Option<Arc<Puller>>,
    staging: Option<Staging>,
}

/// Counters for `/metrics`.
#[derive(Default)]
pub struct SyncStats {
    pub syncs: AtomicU64,
    pub failures: AtomicU64,
    pub bytes: AtomicU64,
    /// Microseconds spent pulling, over every sync.
    pub pull_micros: AtomicU64,
    /// The last completed sync: bytes, and seconds from start to switch.
    pub last_bytes: AtomicU64,
    pub last_micros: AtomicU64,
    /// Bytes of the staging region while an update is open.
    pub staged_bytes: AtomicU64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct InitBody {
    init_info: InitInfo,
}

#[derive(Debug, Deserialize)]
struct InitInfo {
    #[serde(default)]
    backend: Option<String>,
    url: Option<String>,
    #[serde(default)]
    transport: Option<String>,
}

impl WeightSync {
    pub fn new(secret: KvSecret) -> WeightSync {
        WeightSync {
            secret,
            bind_ip: "127.0.0.1".into(),
            phase: Mutex::new(Phase::default()),
            puller: std::sync::Mutex::new(None),
            stats: SyncStats::default(),
        }
    }

    /// The puller's agent binds on `ip` (default loopback).
    pub fn bind_on(mut self, ip: &str) -> WeightSync {
        self.bind_ip = ip.into();
        self
    }

    pub fn stats(&self) -> &SyncStats {
        &self.stats
    }

    /// `init_weight_transfer_engine`.
    pub async fn init(&self, body: Value) -> Result<Value, ApiError> {
        let body: InitBody = serde_json::from_value(body)
            .map_err(|e| ApiError::invalid(format!("init_weight_transfer_engine: {e}")))?;
        let backend = body.init_info.backend.as_deref().unwrap_or(BACKEND);
        if backend != BACKEND {
            return Err(ApiError::invalid_param(
                "init_info.backend",
                format!("weight transfer backend `{backend}` is not available; this server's backend is `{BACKEND}` (a publisher's registered memory read over the transfer engine)"),
            ));
        }
        let Some(url) = body.init_info.url.filter(|u| !u.is_empty()) else {
            return Err(ApiError::invalid_param(
                "init_info.url",
                "init_info.url must name the publisher (http://HOST:PORT)",
            ));
        };
        let transport = match body.init_info.transport.as_deref() {
            None => Transport::Auto,
            Some(t) => Transport::parse(t).ok_or_else(|| {
                ApiError::invalid_param(
                    "init_info.transport",
                    format!("init_info.transport must be auto, tcp or shm, got {t:?}"),
                )
            })?,
        };
        let mut p = self.phase.lock().await;
        if p.puller.as_ref().map(|p| p.transport()) != Some(transport) {
            let puller = Puller::bind(&self.bind_ip, self.secret.clone(), CONNS)
                .await
                .map_err(|e| ApiError::internal(format!("starting the weight puller: {e:#}")))?
                .with_transport(transport);
            let puller = Arc::new(puller);
            p.puller = Some(puller.clone());
            *self.puller.lock().unwrap() = Some(puller);
        }
        if p.staging.take().is_some() {
            self.stats.staged_bytes.store(0, Ordering::Relaxed);
            tracing::info!(
                "an open weight update was dropped by a new init_weight_transfer_engine"
            );
        }
        tracing::info!(
            url,
            transport = transport.name(),
            "weight transfer initialised"
        );
        p.url = Some(url.clone());
        Ok(json!({"status": "ok", "backend": BACKEND, "url": url, "transport": transport.name()}))
    }

    /// `GET /weight_sync/manifest`: this engine's complete staging as a
    /// publisher's manifest, for another engine of the deployment to pull
    /// from instead of the trainer (the proxy's `relay` fan-out). The reads
    /// go to this engine's puller agent at `host` (the host the caller
    /// reached this server by) and need the deployment's KV secret. A 409
    /// until every tensor is pulled.
    pub async fn relay_manifest(&self, host: &str) -> Result<Value, ApiError> {
        let p = self.phase.lock().await;
        let (Some(puller), Some(staging)) = (p.puller.as_ref(), p.staging.as_ref()) else {
            return Err(ApiError::conflict(
                "no weight update is open here: nothing to relay",
            ));
        };
        let port = puller
            .agent_addr()
            .rsplit_once(':')
            .map(|(_, port)| port.to_string())
            .unwrap_or_default();
        let m = staging
            .relay_manifest(format!("{host}:{port}"))
            .map_err(|e| {
                ApiError::conflict(format!("this engine's staging cannot be relayed yet: {e}"))
            })?;
        serde_json::to_value(m).map_err(|e| ApiError::internal(e.to_string()))
    }

    /// Frees what syncs keep between them (the staging region, the mapping
    /// of the publisher's shared memory); an update in progress keeps its
    /// staging. Returns the bytes of the region freed.
    pub fn release_memory(&self) -> u64 {
        let Some(puller) = self.puller.lock().unwrap().clone() else {
            return 0;
        };
        let bytes = puller.spare_bytes();
        puller.drop_spare();
        if bytes > 0 {
            tracing::info!(bytes, "the weight sync's staging region was freed");
        }
        bytes
    }

    /// `start_weight_update`: the manifest, checked, and a staging for it.
    pub async fn start(
        &self,
        layout: Option<&pdkv_model::weights::Weights>,
    ) -> Result<Value, ApiError> {
        let mut p = self.phase.lock().await;
        let (Some(url), Some(puller)) = (p.url.clone(), p.puller.clone()) else {
            return Err(ApiError::conflict(
                "start_weight_update needs init_weight_transfer_engine first",
            ));
        };
        let Some(layout) = layout else {
            return Err(ApiError::invalid(
                "this engine's model cannot take synced weights",
            ));
        };
        p.staging = None;
        self.stats.staged_bytes.store(0, Ordering::Relaxed);
        let manifest = puller.manifest(&url).await.map_err(|e| self.failed(e))?;
        let staging = puller
            .stage(manifest, layout)
            .await
            .map_err(|e| self.failed(e))?;
        let m = staging.manifest();
        let out = json!({
            "status": "ok",
            "tensors": m.tensors.len(),
            "bytes": m.bytes(),
            "version": m.version,
            "transport": staging.transport(),
        });
        tracing::info!(url, tensors = m.tensors.len(), bytes = m.bytes(), version = ?m.version, transport = staging.transport(), "weight update started");
        self.stats
            .staged_bytes
            .store(staging.staged_bytes(), Ordering::Relaxed);
        p.staging = Some(staging);
        Ok(out)
    }

    /// `update_weights` with `update_info`: pulls the named tensors (all
    /// not pulled yet when none are named).
    pub async fn update(&self, update_info: &Value) -> Result<Value, ApiError> {
        let names: Option<Vec<String>> = match update_info.get("names") {
            None | Some(Value::Null) => None,
            Some(v) => Some(serde_json::from_value(v.clone()).map_err(|_| {
                ApiError::invalid_param(
                    "update_info.names",
                    "update_info.names must be a list of tensor names",
                )
            })?),
        };
        let mut p = self.phase.lock().await;
        let puller = p.puller.clone();
        let (Some(puller), Some(staging)) = (puller, p.staging.as_mut()) else {
            return Err(ApiError::conflict(
                "update_weights with update_info needs start_weight_update first",
            ));
        };
        let r = puller
            .pull(staging, names.as_deref(), PULL_TIMEOUT)
            .await
            .map_err(|e| self.failed(e))?;
        let (done, total) = staging.progress();
        tracing::info!(
            tensors = r.tensors,
            bytes = r.bytes,
            secs = r.seconds,
            convert_secs = r.convert_seconds,
            gb_per_s = r.bytes as f64 / r.seconds.max(1e-9) / 1e9,
            transport = r.transport,
            done,
            total,
            "weights pulled"
        );
        Ok(json!({
            "status": "ok",
            "tensors": r.tensors,
            "bytes": r.bytes,
            "seconds": r.seconds,
            "read_seconds": r.read_seconds,
            "convert_seconds": r.convert_seconds,
            "transport": r.transport,
            "pulled": done,
            "total": total,
        }))
    }

    /// `finish_weight_update`: the staged weights, complete, for the
    /// engine to install; the caller reports the outcome with
    /// [`WeightSync::finished`].
    pub async fn finish(&self) -> Result<Finishing, ApiError> {
        let mut p = self.phase.lock().await;
        let Some(staging) = p.staging.as_ref() else {
            return Err(ApiError::conflict(
                "finish_weight_update needs start_weight_update first",
            ));
        };
        let weights = staging.complete().map_err(|e| self.failed(e))?;
        let (bytes, pull_secs) = staging.totals();
        let origin = p.url.clone().unwrap_or_default();
        let version = staging.manifest().version.clone();
        let staging = p.staging.take().expect("checked above");
        Ok(Finishing {
            weights,
            origin,
            version,
            bytes,
            pull_secs,
            _staging: staging,
            started: Instant::now(),
        })
    }

    /// The switch of `f` ended: counted, and the staging freed.
    pub fn finished(&self, f: Finishing, ok: bool, total_secs: f64) {
        let s = &self.stats;
        s.staged_bytes.store(0, Ordering::Relaxed);
        if ok {
            s.syncs.fetch_add(1, Ordering::Relaxed);
            s.bytes.fetch_add(f.bytes, Ordering::Relaxed);
            s.pull_micros
                .fetch_add((f.pull_secs * 1e6) as u64, Ordering::Relaxed);
            s.last_bytes.store(f.bytes, Ordering::Relaxed);
            s.last_micros
                .store((total_secs * 1e6) as u64, Ordering::Relaxed);
        } else {
            s.failures.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A failed step: counted, and answered with its message.
    fn failed(&self, e: SyncError) -> ApiError {
        self.stats.failures.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %e, "weight sync step refused");
        match e {
            SyncError::Manifest { .. } | SyncError::Transfer { .. } => {
                ApiError::unavailable(e.to_string()).with_code("weight_transfer_failed")
            }
            SyncError::Staging(_) => ApiError::internal(e.to_string()),
            SyncError::Incomplete { .. } => ApiError::conflict(e.to_string()),
            SyncError::Mismatch(_) | SyncError::NotPublished(_) | SyncError::Checksum { .. } => {
                ApiError::invalid(e.to_string())
            }
        }
    }

    /// The Prometheus lines.
    pub fn render(&self, out: &mut String) {
        let s = &self.stats;
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut line = |name: &str, kind: &str, help: &str, v: f64| {
            out.push_str(&format!(
                "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
            ));
        };
        line(
            "pdkv_weight_syncs_total",
            "counter",
            "Weight syncs from a trainer that switched the weights",
            g(&s.syncs) as f64,
        );
        line("pdkv_weight_sync_failures_total", "counter", "Weight sync steps refused (manifest, mismatch, transfer, checksum, incomplete) or switches that failed", g(&s.failures) as f64);
        line(
            "pdkv_weight_sync_bytes_total",
            "counter",
            "Weight bytes pulled by syncs that switched",
            g(&s.bytes) as f64,
        );
        line(
            "pdkv_weight_sync_pull_seconds_total",
            "counter",
            "Seconds spent pulling weights, over the syncs that switched",
            g(&s.pull_micros) as f64 / 1e6,
        );
        line(
            "pdkv_weight_sync_last_bytes",
            "gauge",
            "Bytes the last sync pulled",
            g(&s.last_bytes) as f64,
        );
        line(
            "pdkv_weight_sync_last_switch_seconds",
            "gauge",
            "Seconds the last sync's switch took (installing the staged weights)",
            g(&s.last_micros) as f64 / 1e6,
        );
        line(
            "pdkv_weight_sync_staged_bytes",
            "gauge",
            "Bytes of the staging region of an open weight update",
            g(&s.staged_bytes) as f64,
        );
        let spare = self
            .puller
            .lock()
            .unwrap()
            .as_ref()
            .map_or(0, |p| p.spare_bytes());
        line(
            "pdkv_weight_sync_spare_bytes",
            "gauge",
            "Bytes of the staging region kept for the next sync (freed when the engine sleeps)",
            spare as f64,
        );
    }
}

/// A complete staging on its way into the engine.
pub struct Finishing {
    pub weights: Arc<pdkv_model::weights::Weights>,
    pub origin: String,
    /// The manifest's version (the finish body may name another).
    pub version: Option<String>,
    pub bytes: u64,
    pub pull_secs: f64,
    _staging: Staging,
    pub started: Instant,
}
