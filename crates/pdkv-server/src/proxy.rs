//! The P/D proxy: one OpenAI endpoint in front of prefill (P) and decode (D)
//! engine servers.
//!
//! Each generation request goes to one healthy P and one healthy D (round
//! robin over the healthy ones of each role). P gets the client's body with
//! `max_tokens: 1`, `stream: false` and `kv_transfer_params:
//! {"do_remote_decode": true, "transfer_id": T}`; its answer text is
//! ignored. D's answer is what the client receives: JSON as D sent it, or
//! D's server-sent events forwarded unchanged.
//!
//! Write mode: P and D are asked at once; D gets `kv_transfer_params:
//! {"do_remote_prefill": true, "remote_engine_id": .., "remote_bootstrap_addr":
//! .., "transfer_id": T}` (P's engine id and bootstrap address as its `GET
//! /kv_transfer/info` last said) and pulls the KV from P. Read mode (P's
//! info says `"transfer_mode":"read"`): D reads the blocks P leases, which
//! P names only in its answer, so P goes first and D gets exactly the
//! `kv_transfer_params` of P's answer.
//!
//! Plan and driver: what to do for one request is decided by a sans-IO
//! state machine, [`plan::RelayPlan`] (events in: P's answer, D's head,
//! body and end, failed calls, the client leaving; actions out: send,
//! cancel, drop the transfer at P, answer or stream to the client, count).
//! It has no HTTP types, clock or threads, so a simulator can drive it with
//! simulated time and network. This module (backends, health checks,
//! routes, metrics) and `relay.rs` (one request's calls) are its driver:
//! they move bytes, and decide nothing about a request.
//!
//! Failure rules (see [`plan`] for the exact actions):
//! - P stopping on purpose is not the client's failure, because a P
//!   lifecycle operation (pause, sleep, weight reload, abort) must never
//!   lose a request: P answered 503 `engine_not_serving` (paused, asleep) or
//!   its answer's `finish_reason` is `abort`. Write mode: D keeps running
//!   and P is told to drop the transfer with `prefill_refused` /
//!   `prefill_aborted`, so that a pull D parked at P is answered at once
//!   and D computes the prompt itself. Read mode: D gets the client's body
//!   without `kv_transfer_params`. The client gets D's answer; the request
//!   is counted in `pdkv_proxy_prefill_skipped_total{reason}`.
//! - Any other P failure (another error status, a transport error or
//!   timeout, an answer that is not a completion): D's request is dropped,
//!   and the client gets P's error (an error status passed through with its
//!   body, or the proxy's own error). It is always a status, since no
//!   stream is committed while P runs.
//! - D answers an error status: passed through. A failing D (error status,
//!   transport error, broken stream) drops a P request still running and
//!   tells P to drop the transfer, so P frees its blocks now.
//! - D finishes first: its answer stands and P's request is dropped.
//! - The client's own bad request (400, 404, 409, 413 or 422 from P or D,
//!   or a body the proxy cannot parse) is counted as `bad_request` and
//!   logged at debug, not as a backend's error.
//! - An upstream call past `request_timeout` is a 504 whose OpenAI error
//!   (`upstream_timeout`) names that setting; any other failed call a 502.
//! - The client disconnects: both upstream requests are dropped with the
//!   handler or the response body, which closes their connections, and a
//!   pdkv server aborts a request whose connection closes.
//!
//! Invariants:
//! - Both upstream requests of a client request are owned by its handler
//!   future or its response body and by nothing else (no spawned task), so
//!   nothing outlives the client's request.
//! - Streaming: D's status is committed only after P answered (or D's whole
//!   answer is in), so a P failure reaches the client as a status; D's
//!   events are cut only at event boundaries (`\n\n`), so an error event
//!   appended after a failure is never glued to half an event.
//! - Every upstream call is bounded: a connect timeout and an overall
//!   request timeout; health checks have their own short timeout; the plan
//!   buffers at most [`plan::MAX_BUFFERED`] bytes of an answer.
//! - Each client request is counted in `pdkv_proxy_requests_total` exactly
//!   once (as `cancelled` when it is dropped before an outcome).

use std::collections::hash_map::RandomState;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{parse_json, ApiError};
use crate::metrics::Exposition;
use crate::MAX_BODY_BYTES;

mod fanout;
pub use pdkv_relay::plan;
mod relay;
mod weight_fanout;

use pdkv_connector::wire::FailCode;
pub use plan::Role;
use plan::{Mode, OnPurpose, Outcome, RelayPlan};

/// Where the proxy sends requests and how long it waits.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    /// Base URLs of the prefill servers (`http://host:port`).
    pub prefill: Vec<String>,
    /// Base URLs of the decode servers.
    pub decode: Vec<String>,
    /// Time between two rounds of health checks.
    pub health_interval: Duration,
    /// Bound on one health or info request.
    pub health_timeout: Duration,
    /// Bound on opening a connection to a backend.
    pub connect_timeout: Duration,
    /// Bound on a whole upstream generation request, streamed body included
    /// (and on each engine's answer to a fanned-out admin call).
    pub request_timeout: Duration,
    /// Enables the deployment's lifecycle admin API ([`fanout`]), behind
    /// `Authorization: Bearer <token>`; the proxy calls the engines with the
    /// same token.
    pub admin_token: Option<String>,
    /// The deployment's KV secret, proven to a prefill engine's control
    /// port when the proxy asks it to drop a transfer.
    pub kv_secret: pdkv_connector::KvSecret,
    /// The bounds on client connections.
    pub http: crate::listen::HttpLimits,
}

impl ProxyConfig {
    /// The given backends with the default timings (health every 2 s,
    /// 1 s health timeout, 5 s connect timeout, 600 s request timeout).
    pub fn new(prefill: Vec<String>, decode: Vec<String>) -> ProxyConfig {
        ProxyConfig {
            prefill,
            decode,
            health_interval: Duration::from_secs(2),
            health_timeout: Duration::from_secs(1),
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(600),
            admin_token: None,
            kv_secret: pdkv_connector::KvSecret::open(),
            http: crate::listen::HttpLimits::default(),
        }
    }
}

/// How long a pooled connection to an engine may sit idle before the proxy
/// drops it; engines' `--header-timeout-s` must be longer (default 10 s).
pub const UPSTREAM_IDLE: Duration = Duration::from_secs(2);

/// A configuration the proxy cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no {0} server given")]
    NoBackend(Role),
    #[error("invalid {role} server URL `{url}`: {reason}")]
    BadUrl {
        role: Role,
        url: String,
        reason: String,
    },
    #[error("{role} server `{url}` is listed twice")]
    Duplicate { role: Role, url: String },
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
    #[error("the admin token must not be empty")]
    EmptyAdminToken,
}

/// What a server's `GET /kv_transfer/info` reports about its KV connector.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
pub struct KvTransferInfo {
    pub engine_id: String,
    #[serde(default)]
    pub kv_role: Option<String>,
    #[serde(default)]
    pub transport: Option<String>,
    #[serde(default)]
    pub transfer_mode: Option<String>,
    #[serde(default)]
    pub bootstrap_addr: Option<String>,
    #[serde(default)]
    pub transfer_addr: Option<String>,
}

/// A backend as the last health check saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BackendSnapshot {
    pub role: Role,
    pub url: String,
    pub healthy: bool,
    /// Why a healthy backend refuses new requests for now (paused, asleep).
    pub refusing: Option<String>,
    /// The connector info of a prefill server (`None` for a server without a
    /// KV connector, and for decode servers, which are not asked).
    pub kv_info: Option<KvTransferInfo>,
    /// Why the last check failed, while unhealthy.
    pub last_error: Option<String>,
}

#[derive(Clone, Debug, Default)]
struct BackendStatus {
    healthy: bool,
    /// Up, but refusing new requests for now (its `/health` answered a 503
    /// with `Retry-After`: paused, asleep): picked only when no backend of
    /// its role serves. A refusing P then answers its 503 and D computes
    /// the prompt itself; a refusing D passes its retryable 503 on.
    refusing: Option<String>,
    kv_info: Option<KvTransferInfo>,
    last_error: Option<String>,
}

struct Backend {
    role: Role,
    /// Base URL without a trailing slash.
    url: String,
    status: Mutex<BackendStatus>,
}

impl Backend {
    fn status(&self) -> BackendStatus {
        self.status
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Records a check's result, logging changes of health.
    fn set_status(&self, new: BackendStatus) {
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        match (st.healthy, new.healthy) {
            (false, true) => {
                tracing::info!(role = %self.role, url = %self.url, "backend is healthy")
            }
            (true, false) => tracing::warn!(
                role = %self.role,
                url = %self.url,
                reason = new.last_error.as_deref().unwrap_or("unknown"),
                "backend is unhealthy; skipping it"
            ),
            _ => {}
        }
        match (&st.refusing, &new.refusing) {
            (None, Some(why)) if new.healthy => tracing::info!(
                role = %self.role,
                url = %self.url,
                reason = %why,
                "backend is up but not serving; preferring others"
            ),
            (Some(_), None) if new.healthy => {
                tracing::info!(role = %self.role, url = %self.url, "backend serves again")
            }
            _ => {}
        }
        if st.kv_info != new.kv_info {
            match &new.kv_info {
                Some(i) => tracing::info!(
                    url = %self.url,
                    engine_id = %i.engine_id,
                    bootstrap_addr = i.bootstrap_addr.as_deref().unwrap_or("-"),
                    "prefill server's KV connector"
                ),
                None if new.healthy => tracing::warn!(
                    url = %self.url,
                    "prefill server reports no KV connector; decode servers will get no bootstrap address"
                ),
                None => {}
            }
        }
        *st = new;
    }

    /// Marks the backend unhealthy after a failed call, until the next check.
    fn mark_unhealthy(&self, reason: String) {
        let mut new = self.status();
        new.healthy = false;
        new.last_error = Some(reason);
        self.set_status(new);
    }

    fn snapshot(&self) -> BackendSnapshot {
        let st = self.status();
        BackendSnapshot {
            role: self.role,
            url: self.url.clone(),
            healthy: st.healthy,
            refusing: st.refusing,
            kv_info: st.kv_info,
            last_error: st.last_error,
        }
    }
}

/// The client's headers a generation request carries on to P and D: its
/// request id, and its `Authorization` (engines started with `--api-key`
/// check it themselves).
#[derive(Clone, Debug, Default)]
struct Forwarded {
    request_id: Option<HeaderValue>,
    authorization: Option<HeaderValue>,
}

/// The backends of one role with the round-robin cursor.
struct Pool {
    backends: Vec<Arc<Backend>>,
    next: AtomicUsize,
}

impl Pool {
    /// The next healthy backend in round-robin order, with its status: one
    /// that serves, else one that is up but refusing for now.
    fn pick(&self) -> Option<(Arc<Backend>, BackendStatus)> {
        let up: Vec<(&Arc<Backend>, BackendStatus)> = self
            .backends
            .iter()
            .map(|b| (b, b.status()))
            .filter(|(_, st)| st.healthy)
            .collect();
        let serving: Vec<_> = up
            .iter()
            .filter(|(_, st)| st.refusing.is_none())
            .cloned()
            .collect();
        let healthy = if serving.is_empty() { up } else { serving };
        if healthy.is_empty() {
            return None;
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % healthy.len();
        let (b, st) = &healthy[i];
        Some(((*b).clone(), st.clone()))
    }

    fn any_healthy(&self) -> bool {
        self.backends.iter().any(|b| b.status().healthy)
    }
}

#[derive(Default)]
struct ProxyMetrics {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Failed upstream generation calls, by role (prefill, decode).
    upstream_errors: [AtomicU64; 2],
    /// Prefills that stopped on purpose, by [`OnPurpose`].
    prefill_skipped: [AtomicU64; OnPurpose::ALL.len()],
}

impl ProxyMetrics {
    fn count(&self, outcome: Outcome) {
        self.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    fn upstream_error(&self, role: Role) {
        self.upstream_errors[role as usize].fetch_add(1, Ordering::Relaxed);
    }

    fn prefill_skipped(&self, why: OnPurpose) {
        self.prefill_skipped[why as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// The P/D proxy. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

struct Inner {
    config: ProxyConfig,
    client: reqwest::Client,
    prefill: Pool,
    decode: Pool,
    metrics: Arc<ProxyMetrics>,
    /// Random per process: the high half of every transfer id.
    id_seed: u64,
    next_id: AtomicU64,
    /// How the last `init_weight_transfer_engine` fans weight syncs out.
    weight_fanout: std::sync::Mutex<weight_fanout::Fanout>,
}

/// `http://host:port` from what a user typed (`host:port` gets `http://`).
fn normalize_url(role: Role, raw: &str) -> Result<String, ProxyError> {
    let raw = raw.trim();
    let with_scheme = if raw.contains("://") {
        raw.to_string()
    } else {
        format!("http://{raw}")
    };
    let bad = |reason: String| ProxyError::BadUrl {
        role,
        url: raw.to_string(),
        reason,
    };
    let url = reqwest::Url::parse(&with_scheme).map_err(|e| bad(e.to_string()))?;
    if url.scheme() != "http" {
        return Err(bad(format!(
            "scheme `{}` is not supported (only http)",
            url.scheme()
        )));
    }
    if url.host_str().is_none() {
        return Err(bad("no host".to_string()));
    }
    if url.query().is_some() || url.fragment().is_some() {
        return Err(bad("a base URL takes no query or fragment".to_string()));
    }
    Ok(with_scheme.trim_end_matches('/').to_string())
}

fn pool(role: Role, urls: &[String]) -> Result<Pool, ProxyError> {
    if urls.is_empty() {
        return Err(ProxyError::NoBackend(role));
    }
    let mut backends: Vec<Arc<Backend>> = Vec::new();
    for raw in urls {
        let url = normalize_url(role, raw)?;
        if backends.iter().any(|b| b.url == url) {
            return Err(ProxyError::Duplicate { role, url });
        }
        backends.push(Arc::new(Backend {
            role,
            url,
            status: Mutex::new(BackendStatus::default()),
        }));
    }
    Ok(Pool {
        backends,
        next: AtomicUsize::new(0),
    })
}

impl Proxy {
    /// A proxy over the configured backends. Every backend counts as
    /// unhealthy until [`Proxy::check_backends`] has seen it answer
    /// ([`Proxy::serve`] runs one round before it accepts connections).
    pub fn new(config: ProxyConfig) -> Result<Proxy, ProxyError> {
        if config.admin_token.as_deref() == Some("") {
            return Err(ProxyError::EmptyAdminToken);
        }
        let prefill = pool(Role::Prefill, &config.prefill)?;
        let decode = pool(Role::Decode, &config.decode)?;
        // Pooled connections to the engines are given up after a short idle
        // time, below any engine's header timeout (which closes idle
        // keep-alive connections): otherwise a request sent on one just as
        // the engine closes it fails as "connection closed before message
        // completed".
        let client = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .pool_idle_timeout(UPSTREAM_IDLE)
            .build()?;
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_nanos(),
        );
        Ok(Proxy {
            inner: Arc::new(Inner {
                config,
                client,
                prefill,
                decode,
                metrics: Arc::new(ProxyMetrics::default()),
                id_seed: h.finish(),
                next_id: AtomicU64::new(0),
                weight_fanout: std::sync::Mutex::new(weight_fanout::Fanout::Direct),
            }),
        })
    }

    /// Every backend, prefill servers first, as last checked.
    pub fn backends(&self) -> Vec<BackendSnapshot> {
        self.all_backends().map(|b| b.snapshot()).collect()
    }

    fn all_backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.inner
            .prefill
            .backends
            .iter()
            .chain(&self.inner.decode.backends)
    }

    /// Whether at least one prefill and one decode server are healthy.
    pub fn is_ready(&self) -> bool {
        self.inner.prefill.any_healthy() && self.inner.decode.any_healthy()
    }

    /// A fresh transfer id: 128 bits as 32 hex digits, unique within this
    /// process (a counter) and across processes (a random half).
    fn new_transfer_id(&self) -> String {
        let n = self.inner.next_id.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:016x}", self.inner.id_seed)
    }

    /// One round of health checks, all backends at once: `GET /health`, and
    /// for prefill servers `GET /kv_transfer/info`. Returns when every
    /// check has answered or timed out.
    pub async fn check_backends(&self) {
        let checks = self.all_backends().map(|b| self.check_one(b.clone()));
        futures::future::join_all(checks).await;
    }

    async fn check_one(&self, b: Arc<Backend>) {
        let timeout = self.inner.config.health_timeout;
        let health = self
            .inner
            .client
            .get(format!("{}/health", b.url))
            .timeout(timeout)
            .send()
            .await;
        let (problem, refusing) = match health {
            Ok(r) if r.status().is_success() => (None, None),
            Ok(r)
                if r.status() == StatusCode::SERVICE_UNAVAILABLE
                    && r.headers().contains_key(reqwest::header::RETRY_AFTER) =>
            {
                let body = r.bytes().await.unwrap_or_default();
                let why = serde_json::from_slice::<Value>(&body)
                    .ok()
                    .and_then(|v| v["error"]["message"].as_str().map(str::to_string))
                    .unwrap_or_else(|| "not serving for now".into());
                (None, Some(why))
            }
            Ok(r) => (Some(format!("/health answered {}", r.status())), None),
            Err(e) => (Some(format!("/health failed: {}", error_chain(&e))), None),
        };
        if let Some(reason) = problem {
            tracing::debug!(role = %b.role, url = %b.url, %reason, "health check failed");
            b.set_status(BackendStatus {
                healthy: false,
                refusing: None,
                kv_info: b.status().kv_info,
                last_error: Some(reason),
            });
            return;
        }
        let kv_info = match b.role {
            Role::Decode => None,
            Role::Prefill => match self.fetch_info(&b).await {
                Ok(info) => info,
                Err(reason) => {
                    // A server that is up but cannot describe its connector is
                    // not usable as P: D would get no bootstrap address.
                    b.set_status(BackendStatus {
                        healthy: false,
                        refusing: None,
                        kv_info: None,
                        last_error: Some(reason),
                    });
                    return;
                }
            },
        };
        b.set_status(BackendStatus {
            healthy: true,
            refusing,
            kv_info,
            last_error: None,
        });
    }

    /// A prefill server's connector info; `Ok(None)` when it has none (404).
    async fn fetch_info(&self, b: &Backend) -> Result<Option<KvTransferInfo>, String> {
        let timeout = self.inner.config.health_timeout;
        let resp = self
            .inner
            .client
            .get(format!("{}/kv_transfer/info", b.url))
            .timeout(timeout)
            .send()
            .await
            .map_err(|e| format!("/kv_transfer/info failed: {}", error_chain(&e)))?;
        match resp.status() {
            StatusCode::NOT_FOUND => Ok(None),
            s if s.is_success() => {
                let bytes = resp
                    .bytes()
                    .await
                    .map_err(|e| format!("/kv_transfer/info body: {}", error_chain(&e)))?;
                serde_json::from_slice::<KvTransferInfo>(&bytes)
                    .map(Some)
                    .map_err(|e| format!("/kv_transfer/info is not the expected JSON: {e}"))
            }
            s => Err(format!("/kv_transfer/info answered {s}")),
        }
    }

    /// Checks every `health_interval` until the returned task is aborted.
    fn spawn_health_loop(&self) -> tokio::task::JoinHandle<()> {
        let proxy = self.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(proxy.inner.config.health_interval);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                proxy.check_backends().await;
            }
        })
    }

    /// The proxy's routes.
    pub fn router(&self) -> Router {
        let mut app = Router::new();
        if let Some(t) = &self.inner.config.admin_token {
            match crate::admin::AdminToken::new(t.clone()) {
                Ok(token) => app = app.merge(fanout::routes(Arc::new(token))),
                Err(e) => tracing::error!("the admin API is off: {e}"),
            }
        }
        app.merge(forwarded_routes())
            .route("/v1/completions", post(completions))
            .route("/flush_cache", post(fanout::flush_cache))
            .route("/v1/chat/completions", post(chat_completions))
            .route("/v1/models", get(models))
            .route("/health", get(health))
            .route("/metrics", get(metrics))
            .fallback(not_found)
            .method_not_allowed_fallback(method_not_allowed)
            .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
            .with_state(self.clone())
    }

    /// Checks the backends once, then serves on `listener` (with health
    /// checks every `health_interval`) until `shutdown` resolves; then stops
    /// accepting and waits for open connections.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        self.check_backends().await;
        for b in self.backends() {
            if !b.healthy {
                tracing::warn!(
                    role = %b.role,
                    url = %b.url,
                    reason = b.last_error.as_deref().unwrap_or("unknown"),
                    "backend not healthy at start"
                );
            }
        }
        let health = self.spawn_health_loop();
        let result =
            crate::listen::serve(listener, self.router(), self.inner.config.http, shutdown).await;
        health.abort();
        result
    }

    /// The Prometheus text of the proxy's counters and backend health.
    pub fn render_metrics(&self) -> String {
        let m = &self.inner.metrics;
        let mut e = Exposition::new();
        let outcomes: Vec<[(&str, &str); 1]> = Outcome::ALL
            .iter()
            .map(|o| [("outcome", o.as_str())])
            .collect();
        let samples: Vec<(&[(&str, &str)], f64)> = outcomes
            .iter()
            .zip(Outcome::ALL)
            .map(|(l, o)| (&l[..], m.outcomes[o.index()].load(Ordering::Relaxed) as f64))
            .collect();
        e.family(
            "pdkv_proxy_requests_total",
            "Client generation requests by outcome.",
            "counter",
            &samples,
        );
        let roles = [[("role", "prefill")], [("role", "decode")]];
        let samples: Vec<(&[(&str, &str)], f64)> = roles
            .iter()
            .enumerate()
            .map(|(i, l)| (&l[..], m.upstream_errors[i].load(Ordering::Relaxed) as f64))
            .collect();
        e.family(
            "pdkv_proxy_upstream_errors_total",
            "Failed upstream generation calls (an error status other than the client's own bad request, a transport \
             error, a timeout or an unusable answer), by role.",
            "counter",
            &samples,
        );
        let reasons: Vec<[(&str, &str); 1]> = OnPurpose::ALL
            .iter()
            .map(|w| [("reason", w.as_str())])
            .collect();
        let samples: Vec<(&[(&str, &str)], f64)> = reasons
            .iter()
            .zip(OnPurpose::ALL)
            .map(|(l, w)| {
                (
                    &l[..],
                    m.prefill_skipped[w as usize].load(Ordering::Relaxed) as f64,
                )
            })
            .collect();
        e.family(
            "pdkv_proxy_prefill_skipped_total",
            "Requests whose prefill server refused (paused, asleep) or aborted them on purpose; the decode server \
             computed the prompt itself.",
            "counter",
            &samples,
        );
        let snaps = self.backends();
        let labels: Vec<[(&str, &str); 2]> = snaps
            .iter()
            .map(|b| [("role", b.role.as_str()), ("url", b.url.as_str())])
            .collect();
        let samples: Vec<(&[(&str, &str)], f64)> = labels
            .iter()
            .zip(&snaps)
            .map(|(l, b)| (&l[..], if b.healthy { 1.0 } else { 0.0 }))
            .collect();
        e.family(
            "pdkv_proxy_backend_healthy",
            "1 if the backend passed its last health check.",
            "gauge",
            &samples,
        );
        e.finish()
    }

    /// Routes one generation request through a P and a D: picks them, then
    /// hands the request to its [`relay::Relay`], which drives its plan.
    async fn relay(&self, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        let req: Map<String, Value> = match parse_json(&body) {
            Ok(m) => m,
            Err(e) => {
                self.inner.metrics.count(Outcome::BadRequest);
                tracing::debug!("refusing a request: {}", e.message);
                return e.into_response();
            }
        };
        let mut picked = (self.inner.prefill.pick(), self.inner.decode.pick());
        if picked.0.is_none() || picked.1.is_none() {
            // The last check may be stale (an engine woke since, say): look
            // again now, bounded by the health timeout, before refusing.
            self.check_backends().await;
            picked = (self.inner.prefill.pick(), self.inner.decode.pick());
        }
        let (Some((p, p_status)), Some((d, _))) = picked else {
            self.inner.metrics.count(Outcome::NoBackend);
            let missing = match (
                self.inner.prefill.any_healthy(),
                self.inner.decode.any_healthy(),
            ) {
                (false, false) => "no prefill and no decode server is healthy",
                (false, true) => "no prefill server is healthy",
                _ => "no decode server is healthy",
            };
            tracing::warn!("refusing a request: {missing}");
            return retryable(ApiError::unavailable(missing).with_code("no_healthy_backend"));
        };
        let forwarded = Forwarded {
            request_id: headers.get("x-request-id").cloned(),
            authorization: headers.get(header::AUTHORIZATION).cloned(),
        };
        let transfer_id = self.new_transfer_id();
        let mode = plan_mode(p_status.kv_info.as_ref());
        let read_mode = mode == Mode::Read;
        let plan = RelayPlan::for_request(&req, mode, &transfer_id);
        if plan.is_decode_alone() {
            tracing::debug!(endpoint = endpoint.path(), decode = %d.url, "prompt logits wanted: D computes the prompt");
        } else {
            tracing::debug!(
                endpoint = endpoint.path(),
                prefill = %p.url,
                decode = %d.url,
                %transfer_id,
                streaming = plan.streaming(),
                read_mode,
                "routing request"
            );
        }
        let call = relay::Call {
            endpoint,
            req,
            headers: forwarded,
        };
        let p_bootstrap = p_status.kv_info.and_then(|i| i.bootstrap_addr);
        relay::Relay::new(self.clone(), plan, call, (p, p_bootstrap), d)
            .respond()
            .await
    }

    /// A generation request whose body could not be read: the client's own
    /// error, counted once as such.
    fn refuse_body(&self, r: axum::extract::rejection::BytesRejection) -> Response {
        self.inner.metrics.count(Outcome::BadRequest);
        crate::error::body_rejection(r).into_response()
    }

    /// Posts `body` to a backend, bounded by `request_timeout`. A connection
    /// failure marks the backend unhealthy at once (the next health check
    /// may restore it).
    async fn post(
        &self,
        b: &Arc<Backend>,
        endpoint: Endpoint,
        body: Vec<u8>,
        forwarded: &Forwarded,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut req = self
            .inner
            .client
            .post(format!("{}{}", b.url, endpoint.path()))
            .timeout(self.inner.config.request_timeout)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(a) = &forwarded.authorization {
            req = req.header(header::AUTHORIZATION, a.clone());
        }
        if let Some(id) = forwarded.request_id.clone() {
            req = req.header("x-request-id", id);
        }
        let r = req.send().await;
        if let Err(e) = &r {
            if e.is_connect() {
                b.mark_unhealthy(format!("connecting failed: {}", error_chain(e)));
            }
        }
        r
    }

    /// Tells P (in the background, bounded) to drop a transfer for `code`:
    /// no decode request will take it (P frees the blocks now rather than
    /// when the lease expires), or P refused or aborted it (a pull D parked
    /// at P is answered at once).
    fn drop_at_prefill(&self, bootstrap: Option<String>, transfer_id: &str, code: FailCode) {
        let Some(addr) = bootstrap else { return };
        // A relay dropped while the runtime shuts down has no one to tell.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let transfer_id = transfer_id.to_string();
        let limit = self.inner.config.health_timeout.max(Duration::from_secs(2));
        let secret = self.inner.config.kv_secret.clone();
        rt.spawn(async move {
            match pdkv_connector::wire::drop_transfer(&addr, &secret, &transfer_id, code, limit).await {
                Ok(known) => tracing::debug!(%transfer_id, %code, known, "dropped the transfer at the prefill server"),
                Err(e) => tracing::warn!(%transfer_id, %code, "could not drop the transfer at {addr}: {e}"),
            }
        });
    }

    /// Any healthy decode server's answer to `GET path`.
    async fn forward_get(&self, path: &str) -> Response {
        self.forward(reqwest::Method::GET, path, None, None).await
    }

    /// Any healthy decode server's answer to `method path` with `body` (the
    /// client's `Authorization` passed on): the routes that ask about the
    /// model, which every engine answers alike.
    async fn forward(
        &self,
        method: reqwest::Method,
        path: &str,
        auth: Option<HeaderValue>,
        body: Option<Bytes>,
    ) -> Response {
        let Some((d, _)) = self.inner.decode.pick() else {
            return retryable(
                ApiError::unavailable("no decode server is healthy")
                    .with_code("no_healthy_backend"),
            );
        };
        let mut req = self
            .inner
            .client
            .request(method, format!("{}{path}", d.url))
            .timeout(
                self.inner
                    .config
                    .health_timeout
                    .max(Duration::from_secs(10)),
            );
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a);
        }
        if let Some(b) = body {
            req = req.header(header::CONTENT_TYPE, "application/json").body(b);
        }
        let resp = req.send().await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return forward_failed(&d, &e),
        };
        let status = resp.status();
        let head = passthrough_headers(resp.headers());
        match resp.bytes().await {
            Ok(b) => build_response(status, head, Body::from(b)),
            Err(e) => forward_failed(&d, &e),
        }
    }
}

/// The two generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// The plan's mode for a P as its `/kv_transfer/info` described it: read
/// mode when it says so, else write mode naming P (as far as it is known).
fn plan_mode(info: Option<&KvTransferInfo>) -> Mode {
    Mode::for_prefill(
        info.and_then(|i| i.transfer_mode.as_deref()),
        info.map(|i| i.engine_id.as_str()),
        info.and_then(|i| i.bootstrap_addr.as_deref()),
    )
}

/// P's body: the client's, generating one token without streaming, with
/// the plan's `kv_transfer_params`.
fn prefill_body(req: &Map<String, Value>, endpoint: Endpoint, params: Value) -> Vec<u8> {
    let mut body = req.clone();
    body.insert("max_tokens".into(), json!(1));
    if endpoint == Endpoint::ChatCompletions && body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    body.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&body).unwrap_or_default()
}

/// D's body: the client's, with exactly the plan's `kv_transfer_params`
/// (none at all for `None`, whatever the client sent).
fn decode_body(req: &Map<String, Value>, params: Option<Value>) -> Vec<u8> {
    let mut body = req.clone();
    match params {
        Some(p) => body.insert("kv_transfer_params".into(), p),
        None => body.remove("kv_transfer_params"),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// A 502 for a `GET` forwarded to D that got no answer.
fn forward_failed(d: &Backend, e: &reqwest::Error) -> Response {
    let message = format!("decode server {} failed: {}", d.url, error_chain(e));
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message,
        kind: "server_error",
        param: None,
        code: Some("upstream_error"),
    }
    .into_response()
}

/// A 503 with `Retry-After`.
fn retryable(err: ApiError) -> Response {
    let mut resp = err.into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// The response headers worth passing through from an upstream answer.
fn passthrough_headers(h: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::RETRY_AFTER,
        HeaderName::from_static("x-request-id"),
    ]
    .into_iter()
    .filter_map(|name| h.get(&name).cloned().map(|v| (name, v)))
    .collect()
}

fn build_response(
    status: StatusCode,
    head: Vec<(HeaderName, HeaderValue)>,
    body: Body,
) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().extend(head);
    resp
}

/// An error with its sources, on one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
        src = cause.source();
    }
    s
}

/// A request body, or the OpenAI-shaped error for one the proxy will not
/// read (over [`MAX_BODY_BYTES`]: a 413, as the engines answer).
type BodyOrRefusal = Result<Bytes, axum::extract::rejection::BytesRejection>;

async fn completions(
    State(proxy): State<Proxy>,
    headers: HeaderMap,
    body: BodyOrRefusal,
) -> Response {
    match body {
        Ok(body) => proxy.relay(Endpoint::Completions, headers, body).await,
        Err(r) => proxy.refuse_body(r),
    }
}

async fn chat_completions(
    State(proxy): State<Proxy>,
    headers: HeaderMap,
    body: BodyOrRefusal,
) -> Response {
    match body {
        Ok(body) => proxy.relay(Endpoint::ChatCompletions, headers, body).await,
        Err(r) => proxy.refuse_body(r),
    }
}

async fn models(State(proxy): State<Proxy>, headers: HeaderMap) -> Response {
    let auth = headers.get(header::AUTHORIZATION).cloned();
    proxy
        .forward(reqwest::Method::GET, "/v1/models", auth, None)
        .await
}

/// `POST /tokenize` and `/detokenize`, `GET /version`, `/get_model_info`
/// and `/get_server_info`: a decode server's answer.
fn forwarded_routes() -> Router<Proxy> {
    let post_to = |path: &'static str| {
        post(
            move |State(proxy): State<Proxy>, headers: HeaderMap, body: BodyOrRefusal| async move {
                let body = match body {
                    Ok(b) => b,
                    Err(r) => return crate::error::body_rejection(r).into_response(),
                };
                let auth = headers.get(header::AUTHORIZATION).cloned();
                proxy
                    .forward(reqwest::Method::POST, path, auth, Some(body))
                    .await
            },
        )
    };
    let get_from = |path: &'static str| {
        get(move |State(proxy): State<Proxy>| async move { proxy.forward_get(path).await })
    };
    Router::new()
        .route("/tokenize", post_to("/tokenize"))
        .route("/detokenize", post_to("/detokenize"))
        .route("/version", get_from("/version"))
        .route("/get_model_info", get_from("/get_model_info"))
        .route("/get_server_info", get_from("/get_server_info"))
}

async fn health(State(proxy): State<Proxy>) -> Response {
    if proxy.is_ready() {
        StatusCode::OK.into_response()
    } else {
        retryable(
            ApiError::unavailable("no healthy prefill or decode server")
                .with_code("no_healthy_backend"),
        )
    }
}

async fn metrics(State(proxy): State<Proxy>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        proxy.render_metrics(),
    )
        .into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        ..ApiError::invalid("method not allowed on this route")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn prefill_body_generates_one_token_without_streaming() {
        let req = obj(json!({
            "prompt": "hi", "max_tokens": 50, "stream": true, "stream_options": {"include_usage": true},
            "kv_transfer_params": {"client": 1}, "temperature": 0,
        }));
        let params = pdkv_connector::params::for_prefill("t1");
        let p: Value =
            serde_json::from_slice(&prefill_body(&req, Endpoint::Completions, params.clone()))
                .unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"], params);
        assert_eq!(p["prompt"], "hi");
        assert_eq!(p["temperature"], 0);

        let chat = obj(json!({"messages": [], "max_completion_tokens": 9}));
        let p: Value =
            serde_json::from_slice(&prefill_body(&chat, Endpoint::ChatCompletions, params))
                .unwrap();
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["max_tokens"], 1);
    }

    #[test]
    fn write_mode_names_the_prefill_server_and_read_mode_follows_its_info() {
        let mut info = KvTransferInfo {
            engine_id: "p0".into(),
            kv_role: Some("kv_producer".into()),
            transport: Some("tcp".into()),
            transfer_mode: Some("write".into()),
            bootstrap_addr: Some("127.0.0.1:7000".into()),
            transfer_addr: Some("127.0.0.1:7001".into()),
        };
        let write = Mode::Write {
            remote_engine_id: Some("p0".into()),
            remote_bootstrap_addr: Some("127.0.0.1:7000".into()),
        };
        assert_eq!(plan_mode(Some(&info)), write);
        assert_eq!(
            plan_mode(None),
            Mode::Write {
                remote_engine_id: None,
                remote_bootstrap_addr: None
            }
        );
        info.transfer_mode = Some("read".into());
        assert_eq!(plan_mode(Some(&info)), Mode::Read);
    }

    #[test]
    fn decode_body_carries_exactly_the_plans_params() {
        let req = obj(
            json!({"prompt": "hi", "max_tokens": 50, "stream": true, "kv_transfer_params": {"client": 1}}),
        );
        let params = json!({"do_remote_prefill": true, "transfer_id": "t", "remote_block_ids": [4, 5],
                            "remote_registration_generation": 2});
        let d: Value = serde_json::from_slice(&decode_body(&req, Some(params.clone()))).unwrap();
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!(
            (
                d["prompt"].as_str(),
                d["max_tokens"].as_u64(),
                d["stream"].as_bool()
            ),
            (Some("hi"), Some(50), Some(true))
        );
        // D computes the prompt itself: the client's own params go too.
        let d: Value = serde_json::from_slice(&decode_body(&req, None)).unwrap();
        assert!(d.get("kv_transfer_params").is_none(), "{d}");
    }

    #[test]
    fn urls_are_normalized_and_checked() {
        assert_eq!(
            normalize_url(Role::Prefill, "127.0.0.1:8100").unwrap(),
            "http://127.0.0.1:8100"
        );
        assert_eq!(
            normalize_url(Role::Decode, "http://localhost:9/").unwrap(),
            "http://localhost:9"
        );
        assert!(matches!(
            normalize_url(Role::Decode, "https://x:1"),
            Err(ProxyError::BadUrl { .. })
        ));
        assert!(matches!(
            normalize_url(Role::Decode, "http://x:1/?a=b"),
            Err(ProxyError::BadUrl { .. })
        ));
        let dup = ProxyConfig::new(vec!["a:1".into(), "http://a:1".into()], vec!["b:2".into()]);
        assert!(matches!(Proxy::new(dup), Err(ProxyError::Duplicate { .. })));
        assert!(matches!(
            Proxy::new(ProxyConfig::new(vec![], vec!["b:2".into()])),
            Err(ProxyError::NoBackend(_))
        ));
    }

    #[test]
    fn transfer_ids_are_unique_128_bit_hex() {
        let proxy = Proxy::new(ProxyConfig::new(vec!["a:1".into()], vec!["b:2".into()])).unwrap();
        let a = proxy.new_transfer_id();
        let b = proxy.new_transfer_id();
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
        assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
