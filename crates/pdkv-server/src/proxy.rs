//! The P/D proxy: one OpenAI endpoint in front of prefill (P) and decode (D)
//! engine servers.
//!
//! Each generation request goes to one healthy P and one healthy D at the
//! same time (round robin over the healthy ones of each role). P gets the
//! client's body with `max_tokens: 1`, `stream: false` and
//! `kv_transfer_params: {"do_remote_decode": true, "transfer_id": T}`; its
//! answer text is ignored. D gets the client's body with
//! `kv_transfer_params: {"do_remote_prefill": true, "remote_engine_id": ..,
//! "remote_bootstrap_addr": .., "transfer_id": T}` (P's engine id and
//! bootstrap address as its `GET /kv_transfer/info` last said), and D's
//! answer is what the client receives: JSON as D sent it, or D's server-sent
//! events forwarded unchanged.
//!
//! Read mode (P's `/kv_transfer/info` says `"transfer_mode":"read"`): D reads
//! the blocks P leases, which P names only in its answer, so P goes first
//! (same body as above); D then gets the client's body with exactly the
//! `kv_transfer_params` of P's JSON answer (none when P returned none, so D
//! computes the prompt itself). A P failure is the client's answer and D is
//! never asked.
//!
//! Failure rules:
//! - P fails (an error status, a transport error, or a request that P
//!   aborted, after which D would wait for KV that never comes): D's request
//!   is dropped, and the client gets P's error (an error status passed
//!   through with its body) or, when D's events were already being
//!   forwarded, an SSE error event and `data: [DONE]`.
//! - D answers an error status: passed through; P's request is dropped.
//! - D finishes first: its answer stands and P's request is dropped.
//! - The client disconnects: both upstream requests are dropped with the
//!   handler or the response body, which closes their connections, and a
//!   pdkv server aborts a request whose connection closes.
//!
//! Invariants:
//! - Both upstream requests of a client request are owned by its handler
//!   future or its response body and by nothing else (no spawned task), so
//!   nothing outlives the client's request.
//! - Forwarded event streams are cut only at event boundaries (`\n\n`), so
//!   an error event appended after a failure is never glued to half an event.
//! - Every upstream call is bounded: a connect timeout and an overall
//!   request timeout; health checks have their own short timeout.
//! - Each client request is counted in `pdkv_proxy_requests_total` exactly
//!   once (as `cancelled` when it is dropped before an outcome).

use std::collections::hash_map::RandomState;
use std::convert::Infallible;
use std::future::Future;
use std::hash::{BuildHasher, Hasher};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use futures::stream::BoxStream;
use futures::StreamExt;
use serde::Deserialize;
use serde_json::{json, Map, Value};

use crate::error::{parse_json, ApiError};
use crate::metrics::Exposition;
use crate::MAX_BODY_BYTES;

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
    /// Bound on a whole upstream generation request, streamed body included.
    pub request_timeout: Duration,
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
        }
    }
}

/// A configuration the proxy cannot start with.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("no {0} server given")]
    NoBackend(Role),
    #[error("invalid {role} server URL `{url}`: {reason}")]
    BadUrl { role: Role, url: String, reason: String },
    #[error("{role} server `{url}` is listed twice")]
    Duplicate { role: Role, url: String },
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// The part a backend plays.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    Prefill,
    Decode,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Prefill => "prefill",
            Role::Decode => "decode",
        }
    }
}

impl std::fmt::Display for Role {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
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
    /// The connector info of a prefill server (`None` for a server without a
    /// KV connector, and for decode servers, which are not asked).
    pub kv_info: Option<KvTransferInfo>,
    /// Why the last check failed, while unhealthy.
    pub last_error: Option<String>,
}

#[derive(Clone, Debug, Default)]
struct BackendStatus {
    healthy: bool,
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
        self.status.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Records a check's result, logging changes of health.
    fn set_status(&self, new: BackendStatus) {
        let mut st = self.status.lock().unwrap_or_else(|e| e.into_inner());
        match (st.healthy, new.healthy) {
            (false, true) => tracing::info!(role = %self.role, url = %self.url, "backend is healthy"),
            (true, false) => tracing::warn!(
                role = %self.role,
                url = %self.url,
                reason = new.last_error.as_deref().unwrap_or("unknown"),
                "backend is unhealthy; skipping it"
            ),
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
            kv_info: st.kv_info,
            last_error: st.last_error,
        }
    }
}

/// The backends of one role with the round-robin cursor.
struct Pool {
    backends: Vec<Arc<Backend>>,
    next: AtomicUsize,
}

impl Pool {
    /// The next healthy backend in round-robin order, with its status.
    fn pick(&self) -> Option<(Arc<Backend>, BackendStatus)> {
        let healthy: Vec<(&Arc<Backend>, BackendStatus)> =
            self.backends.iter().map(|b| (b, b.status())).filter(|(_, st)| st.healthy).collect();
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

/// How a client request ended, as counted in `pdkv_proxy_requests_total`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Ok,
    BadRequest,
    NoBackend,
    PrefillError,
    DecodeError,
    Cancelled,
}

const OUTCOMES: [Outcome; 6] =
    [Outcome::Ok, Outcome::BadRequest, Outcome::NoBackend, Outcome::PrefillError, Outcome::DecodeError, Outcome::Cancelled];

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::BadRequest => "bad_request",
            Outcome::NoBackend => "no_backend",
            Outcome::PrefillError => "prefill_error",
            Outcome::DecodeError => "decode_error",
            Outcome::Cancelled => "cancelled",
        }
    }

    fn index(self) -> usize {
        OUTCOMES.iter().position(|&o| o == self).unwrap_or(0)
    }
}

#[derive(Default)]
struct ProxyMetrics {
    outcomes: [AtomicU64; OUTCOMES.len()],
    /// Failed upstream generation calls, by role (prefill, decode).
    upstream_errors: [AtomicU64; 2],
}

impl ProxyMetrics {
    fn upstream_error(&self, role: Role) {
        self.upstream_errors[role as usize].fetch_add(1, Ordering::Relaxed);
    }
}

/// Counts a request's outcome exactly once: the one set, or `cancelled` if
/// it is dropped before one was set.
struct OutcomeGuard {
    metrics: Arc<ProxyMetrics>,
    outcome: Option<Outcome>,
}

impl OutcomeGuard {
    fn set(&mut self, o: Outcome) {
        self.outcome.get_or_insert(o);
    }
}

impl Drop for OutcomeGuard {
    fn drop(&mut self) {
        let o = self.outcome.unwrap_or(Outcome::Cancelled);
        if o == Outcome::Cancelled {
            tracing::debug!("client went away; upstream requests dropped");
        }
        self.metrics.outcomes[o.index()].fetch_add(1, Ordering::Relaxed);
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
}

/// `http://host:port` from what a user typed (`host:port` gets `http://`).
fn normalize_url(role: Role, raw: &str) -> Result<String, ProxyError> {
    let raw = raw.trim();
    let with_scheme = if raw.contains("://") { raw.to_string() } else { format!("http://{raw}") };
    let bad = |reason: String| ProxyError::BadUrl { role, url: raw.to_string(), reason };
    let url = reqwest::Url::parse(&with_scheme).map_err(|e| bad(e.to_string()))?;
    if url.scheme() != "http" {
        return Err(bad(format!("scheme `{}` is not supported (only http)", url.scheme())));
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
        backends.push(Arc::new(Backend { role, url, status: Mutex::new(BackendStatus::default()) }));
    }
    Ok(Pool { backends, next: AtomicUsize::new(0) })
}

impl Proxy {
    /// A proxy over the configured backends. Every backend counts as
    /// unhealthy until [`Proxy::check_backends`] has seen it answer
    /// ([`Proxy::serve`] runs one round before it accepts connections).
    pub fn new(config: ProxyConfig) -> Result<Proxy, ProxyError> {
        let prefill = pool(Role::Prefill, &config.prefill)?;
        let decode = pool(Role::Decode, &config.decode)?;
        let client = reqwest::Client::builder().connect_timeout(config.connect_timeout).build()?;
        let mut h = RandomState::new().build_hasher();
        h.write_u32(std::process::id());
        h.write_u128(SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or_default().as_nanos());
        Ok(Proxy {
            inner: Arc::new(Inner {
                config,
                client,
                prefill,
                decode,
                metrics: Arc::new(ProxyMetrics::default()),
                id_seed: h.finish(),
                next_id: AtomicU64::new(0),
            }),
        })
    }

    /// Every backend, prefill servers first, as last checked.
    pub fn backends(&self) -> Vec<BackendSnapshot> {
        self.all_backends().map(|b| b.snapshot()).collect()
    }

    fn all_backends(&self) -> impl Iterator<Item = &Arc<Backend>> {
        self.inner.prefill.backends.iter().chain(&self.inner.decode.backends)
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
        let health = self.inner.client.get(format!("{}/health", b.url)).timeout(timeout).send().await;
        let problem = match health {
            Ok(r) if r.status().is_success() => None,
            Ok(r) => Some(format!("/health answered {}", r.status())),
            Err(e) => Some(format!("/health failed: {}", error_chain(&e))),
        };
        if let Some(reason) = problem {
            tracing::debug!(role = %b.role, url = %b.url, %reason, "health check failed");
            b.set_status(BackendStatus { healthy: false, kv_info: b.status().kv_info, last_error: Some(reason) });
            return;
        }
        let kv_info = match b.role {
            Role::Decode => None,
            Role::Prefill => match self.fetch_info(&b).await {
                Ok(info) => info,
                Err(reason) => {
                    // A server that is up but cannot describe its connector is
                    // not usable as P: D would get no bootstrap address.
                    b.set_status(BackendStatus { healthy: false, kv_info: None, last_error: Some(reason) });
                    return;
                }
            },
        };
        b.set_status(BackendStatus { healthy: true, kv_info, last_error: None });
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
                let bytes = resp.bytes().await.map_err(|e| format!("/kv_transfer/info body: {}", error_chain(&e)))?;
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
        Router::new()
            .route("/v1/completions", post(completions))
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
        let result = axum::serve(listener, self.router()).with_graceful_shutdown(shutdown).await;
        health.abort();
        result
    }

    /// The Prometheus text of the proxy's counters and backend health.
    pub fn render_metrics(&self) -> String {
        let m = &self.inner.metrics;
        let mut e = Exposition::new();
        let outcomes: Vec<[(&str, &str); 1]> = OUTCOMES.iter().map(|o| [("outcome", o.as_str())]).collect();
        let samples: Vec<(&[(&str, &str)], f64)> = outcomes
            .iter()
            .zip(OUTCOMES)
            .map(|(l, o)| (&l[..], m.outcomes[o.index()].load(Ordering::Relaxed) as f64))
            .collect();
        e.family("pdkv_proxy_requests_total", "Client generation requests by outcome.", "counter", &samples);
        let roles = [[("role", "prefill")], [("role", "decode")]];
        let samples: Vec<(&[(&str, &str)], f64)> =
            roles.iter().enumerate().map(|(i, l)| (&l[..], m.upstream_errors[i].load(Ordering::Relaxed) as f64)).collect();
        e.family(
            "pdkv_proxy_upstream_errors_total",
            "Failed upstream generation calls (error status, transport error or aborted prefill), by role.",
            "counter",
            &samples,
        );
        let snaps = self.backends();
        let labels: Vec<[(&str, &str); 2]> =
            snaps.iter().map(|b| [("role", b.role.as_str()), ("url", b.url.as_str())]).collect();
        let samples: Vec<(&[(&str, &str)], f64)> =
            labels.iter().zip(&snaps).map(|(l, b)| (&l[..], if b.healthy { 1.0 } else { 0.0 })).collect();
        e.family("pdkv_proxy_backend_healthy", "1 if the backend passed its last health check.", "gauge", &samples);
        e.finish()
    }

    fn guard(&self) -> OutcomeGuard {
        OutcomeGuard { metrics: self.inner.metrics.clone(), outcome: None }
    }

    /// Routes one generation request through a P and a D.
    async fn relay(&self, endpoint: Endpoint, headers: HeaderMap, body: Bytes) -> Response {
        let mut guard = self.guard();
        let req: Map<String, Value> = match parse_json(&body) {
            Ok(m) => m,
            Err(e) => {
                guard.set(Outcome::BadRequest);
                return e.into_response();
            }
        };
        let streaming = req.get("stream").and_then(Value::as_bool).unwrap_or(false);
        let (Some((p, p_status)), Some((d, _))) = (self.inner.prefill.pick(), self.inner.decode.pick()) else {
            guard.set(Outcome::NoBackend);
            let missing = match (self.inner.prefill.any_healthy(), self.inner.decode.any_healthy()) {
                (false, false) => "no prefill and no decode server is healthy",
                (false, true) => "no prefill server is healthy",
                _ => "no decode server is healthy",
            };
            tracing::warn!("refusing a request: {missing}");
            return retryable(ApiError::unavailable(missing).with_code("no_healthy_backend"));
        };
        let transfer_id = self.new_transfer_id();
        tracing::debug!(
            endpoint = endpoint.path(),
            prefill = %p.url,
            decode = %d.url,
            %transfer_id,
            streaming,
            "routing request"
        );
        let p_body = prefill_body(&req, endpoint, &transfer_id);
        let request_id = headers.get("x-request-id").cloned();
        let read_mode = p_status.kv_info.as_ref().and_then(|i| i.transfer_mode.as_deref()) == Some("read");

        let (mut watch, d_body) = if read_mode {
            match self.clone().prefill_answer(p, endpoint, p_body, request_id.clone()).await {
                // P is done: nothing more to watch.
                Ok(params) => (PrefillWatch { fut: None }, decode_body_with(&req, params)),
                Err(f) => return self.prefill_failed(&mut guard, f),
            }
        } else {
            let d_body = decode_body(&req, &transfer_id, p_status.kv_info.as_ref());
            (PrefillWatch { fut: Some(Box::pin(self.clone().prefill(p, endpoint, p_body, request_id.clone()))) }, d_body)
        };
        let d_send = self.post(&d, endpoint, d_body, request_id);
        tokio::pin!(d_send);

        // Until D has answered, a P failure is reported with P's status.
        let d_resp = tokio::select! {
            f = watch.failed() => return self.prefill_failed(&mut guard, f),
            r = &mut d_send => r,
        };
        // D failed: nobody will take P's KV, so P is told to drop it now.
        let p_bootstrap = p_status.kv_info.as_ref().and_then(|i| i.bootstrap_addr.clone());
        let d_resp = match d_resp {
            Ok(r) => r,
            Err(e) => {
                self.drop_at_prefill(p_bootstrap, &transfer_id);
                return self.decode_failed(&mut guard, &d, e);
            }
        };
        if !d_resp.status().is_success() {
            self.drop_at_prefill(p_bootstrap, &transfer_id);
            let status = d_resp.status();
            let head = passthrough_headers(d_resp.headers());
            let body = d_resp.bytes().await.unwrap_or_default();
            tracing::warn!(decode = %d.url, %status, "decode server answered an error; passing it through");
            self.inner.metrics.upstream_error(Role::Decode);
            guard.set(Outcome::DecodeError);
            return build_response(status, head, Body::from(body));
        }
        let status = d_resp.status();
        let head = passthrough_headers(d_resp.headers());
        if !streaming {
            let body = tokio::select! {
                f = watch.failed() => return self.prefill_failed(&mut guard, f),
                b = d_resp.bytes() => b,
            };
            return match body {
                Ok(b) => {
                    guard.set(Outcome::Ok);
                    build_response(status, head, Body::from(b))
                }
                Err(e) => self.decode_failed(&mut guard, &d, e),
            };
        }

        // Streaming: D produces no token before P's KV arrived, so waiting
        // for P's answer costs nothing and lets a P failure (a P that is
        // paused or asleep answers 503) reach the client as a status rather
        // than as an error event inside a 200 stream.
        if let Some(fut) = watch.fut.take() {
            if let Err(f) = fut.await {
                return self.prefill_failed(&mut guard, f);
            }
        }
        // Then D's first complete event before committing to D's status.
        let mut relay = Relay {
            proxy: self.clone(),
            watch,
            events: Events { d: Some(d_resp.bytes_stream().boxed()), d_url: d.url.clone(), buf: Vec::new() },
            guard,
            done: false,
        };
        let first = tokio::select! {
            f = relay.watch.failed() => return self.prefill_failed(&mut relay.guard, f),
            item = relay.events.next() => relay.on_events(item),
        };
        tracing::debug!(decode = %d.url, "streaming the decode server's events");
        let body = futures::stream::unfold((relay, first), |(mut relay, first)| async move {
            let piece = match first {
                Some(p) => p,
                None => relay.next_piece().await?,
            };
            Some((Ok::<_, Infallible>(piece), (relay, None)))
        });
        build_response(status, head, Body::from_stream(body))
    }

    /// The prefill call: `Ok` once P answered 2xx with a request that was
    /// not aborted.
    async fn prefill(
        self,
        p: Arc<Backend>,
        endpoint: Endpoint,
        body: Vec<u8>,
        request_id: Option<HeaderValue>,
    ) -> Result<(), Failure> {
        self.prefill_answer(p, endpoint, body, request_id).await.map(|_| ())
    }

    /// The prefill call, giving the `kv_transfer_params` of P's answer
    /// (`None` when it has none).
    async fn prefill_answer(
        self,
        p: Arc<Backend>,
        endpoint: Endpoint,
        body: Vec<u8>,
        request_id: Option<HeaderValue>,
    ) -> Result<Option<Value>, Failure> {
        let failure = |f: Failure| Err(f.at(Role::Prefill, &p.url));
        let resp = match self.post(&p, endpoint, body, request_id).await {
            Ok(r) => r,
            Err(e) => return failure(Failure::Transport(error_chain(&e))),
        };
        let status = resp.status();
        let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
        let bytes = match resp.bytes().await {
            Ok(b) => b,
            Err(e) => return failure(Failure::Transport(error_chain(&e))),
        };
        if !status.is_success() {
            return failure(Failure::Status { status, content_type, body: bytes });
        }
        let answer = serde_json::from_slice::<Value>(&bytes).ok();
        let finish = answer.as_ref().and_then(|v| v["choices"][0]["finish_reason"].as_str().map(str::to_string));
        if finish.as_deref() == Some("abort") {
            return failure(Failure::Aborted);
        }
        tracing::debug!(prefill = %p.url, "prefill done");
        Ok(answer.and_then(|mut v| v.get_mut("kv_transfer_params").map(Value::take)).filter(|v| !v.is_null()))
    }

    /// Posts `body` to a backend. A connection failure marks the backend
    /// unhealthy at once (the next health check may restore it).
    async fn post(
        &self,
        b: &Arc<Backend>,
        endpoint: Endpoint,
        body: Vec<u8>,
        request_id: Option<HeaderValue>,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut req = self
            .inner
            .client
            .post(format!("{}{}", b.url, endpoint.path()))
            .timeout(self.inner.config.request_timeout)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(id) = request_id {
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

    fn prefill_failed(&self, guard: &mut OutcomeGuard, f: Failure) -> Response {
        tracing::warn!("{}; dropping the decode request", f.describe());
        self.inner.metrics.upstream_error(Role::Prefill);
        guard.set(Outcome::PrefillError);
        f.into_response()
    }

    /// Tells P (in the background, bounded) to drop a transfer no decode
    /// request will take, so its blocks are freed now rather than when the
    /// lease expires.
    fn drop_at_prefill(&self, bootstrap: Option<String>, transfer_id: &str) {
        let Some(addr) = bootstrap else { return };
        let transfer_id = transfer_id.to_string();
        let limit = self.inner.config.health_timeout.max(Duration::from_secs(2));
        tokio::spawn(async move {
            match pdkv_connector::wire::drop_transfer(&addr, &transfer_id, pdkv_connector::wire::FailCode::Dropped, limit).await {
                Ok(known) => tracing::debug!(%transfer_id, known, "dropped the transfer at the prefill server"),
                Err(e) => tracing::warn!(%transfer_id, "could not drop the transfer at {addr}: {e}"),
            }
        });
    }

    fn decode_failed(&self, guard: &mut OutcomeGuard, d: &Backend, e: reqwest::Error) -> Response {
        let f = Failure::Transport(error_chain(&e)).at(Role::Decode, &d.url);
        tracing::warn!("{}; dropping the prefill request", f.describe());
        self.inner.metrics.upstream_error(Role::Decode);
        guard.set(Outcome::DecodeError);
        f.into_response()
    }

    /// Any healthy decode server's answer to `GET path`.
    async fn forward_get(&self, path: &str) -> Response {
        let Some((d, _)) = self.inner.decode.pick() else {
            return retryable(ApiError::unavailable("no decode server is healthy").with_code("no_healthy_backend"));
        };
        let resp = self
            .inner
            .client
            .get(format!("{}{path}", d.url))
            .timeout(self.inner.config.health_timeout.max(Duration::from_secs(10)))
            .send()
            .await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => {
                return Failure::Transport(error_chain(&e)).at(Role::Decode, &d.url).into_response();
            }
        };
        let status = resp.status();
        let head = passthrough_headers(resp.headers());
        match resp.bytes().await {
            Ok(b) => build_response(status, head, Body::from(b)),
            Err(e) => Failure::Transport(error_chain(&e)).at(Role::Decode, &d.url).into_response(),
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

/// P's body: the client's, generating one token without streaming, with
/// `do_remote_decode`.
fn prefill_body(req: &Map<String, Value>, endpoint: Endpoint, transfer_id: &str) -> Vec<u8> {
    let mut body = req.clone();
    body.insert("max_tokens".into(), json!(1));
    if endpoint == Endpoint::ChatCompletions && body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    body.insert("stream".into(), json!(false));
    body.remove("stream_options");
    body.insert("kv_transfer_params".into(), pdkv_connector::params::for_prefill(transfer_id));
    serde_json::to_vec(&body).unwrap_or_default()
}

/// D's body: the client's, with `do_remote_prefill` naming P.
fn decode_body(req: &Map<String, Value>, transfer_id: &str, p_info: Option<&KvTransferInfo>) -> Vec<u8> {
    let mut body = req.clone();
    let params = pdkv_connector::params::for_decode(
        transfer_id,
        p_info.map(|i| i.engine_id.as_str()),
        p_info.and_then(|i| i.bootstrap_addr.as_deref()),
    );
    body.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&body).unwrap_or_default()
}

/// D's body in read mode: the client's, with exactly P's params (none when
/// P returned none).
fn decode_body_with(req: &Map<String, Value>, params: Option<Value>) -> Vec<u8> {
    let mut body = req.clone();
    match params {
        Some(p) => body.insert("kv_transfer_params".into(), p),
        None => body.remove("kv_transfer_params"),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

/// Why an upstream call produced no usable answer.
#[derive(Debug)]
enum Failure {
    /// An error status; its body is passed to the client unchanged.
    Status { status: StatusCode, content_type: Option<HeaderValue>, body: Bytes },
    /// No answer: connection refused or reset, timeout, broken body.
    Transport(String),
    /// P answered, but its request was aborted (paused, shut down or aborted
    /// by an admin), so its KV will never reach D.
    Aborted,
    /// Any of the above, naming the backend.
    At { role: Role, url: String, inner: Box<Failure> },
}

impl Failure {
    fn at(self, role: Role, url: &str) -> Failure {
        Failure::At { role, url: url.to_string(), inner: Box::new(self) }
    }

    fn describe(&self) -> String {
        match self {
            Failure::Status { status, .. } => format!("answered {status}"),
            Failure::Transport(e) => format!("failed: {e}"),
            Failure::Aborted => "aborted the request".to_string(),
            Failure::At { role, url, inner } => format!("{role} server {url} {}", inner.describe()),
        }
    }

    /// The error as an OpenAI error (for errors that carry no body of their own).
    fn api_error(&self) -> ApiError {
        match self {
            Failure::At { inner, .. } if matches!(**inner, Failure::Aborted) => {
                ApiError::unavailable(self.describe()).with_code("prefill_aborted")
            }
            _ => ApiError {
                status: StatusCode::BAD_GATEWAY,
                message: self.describe(),
                kind: "server_error",
                param: None,
                code: Some("upstream_error"),
            },
        }
    }

    fn root(&self) -> &Failure {
        match self {
            Failure::At { inner, .. } => inner.root(),
            f => f,
        }
    }

    fn into_response(self) -> Response {
        if let Failure::Status { status, content_type, body } = self.root() {
            let mut head = Vec::new();
            if let Some(ct) = content_type {
                head.push((header::CONTENT_TYPE, ct.clone()));
            }
            // A P that is not serving now (paused, asleep) clears by itself:
            // the client may retry, as it would with the engine itself.
            if *status == StatusCode::SERVICE_UNAVAILABLE {
                head.push((header::RETRY_AFTER, HeaderValue::from_static("1")));
            }
            return build_response(*status, head, Body::from(body.clone()));
        }
        let aborted = matches!(self.root(), Failure::Aborted);
        let err = self.api_error();
        if aborted {
            retryable(err)
        } else {
            err.into_response()
        }
    }

    /// The SSE events ending a stream that this failure cut short: the
    /// error (the upstream JSON error body when there is one) and `[DONE]`.
    fn sse_tail(&self) -> Bytes {
        let payload = match self.root() {
            Failure::Status { body, .. } => serde_json::from_slice::<Value>(body)
                .ok()
                .filter(|v| v.get("error").is_some())
                .map(|v| v.to_string()),
            _ => None,
        }
        .unwrap_or_else(|| self.api_error().body_json());
        Bytes::from(format!("data: {payload}\n\ndata: [DONE]\n\n"))
    }
}

/// A 503 with `Retry-After`.
fn retryable(err: ApiError) -> Response {
    let mut resp = err.into_response();
    resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// The response headers worth passing through from an upstream answer.
fn passthrough_headers(h: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    [header::CONTENT_TYPE, header::CACHE_CONTROL, header::RETRY_AFTER, HeaderName::from_static("x-request-id")]
        .into_iter()
        .filter_map(|name| h.get(&name).cloned().map(|v| (name, v)))
        .collect()
}

fn build_response(status: StatusCode, head: Vec<(HeaderName, HeaderValue)>, body: Body) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().extend(head);
    resp
}

type PrefillFuture = Pin<Box<dyn Future<Output = Result<(), Failure>> + Send>>;

/// P's request, polled alongside D's. Dropping it drops P's request.
struct PrefillWatch {
    fut: Option<PrefillFuture>,
}

impl PrefillWatch {
    /// Resolves when P's request fails; pends forever once it succeeded.
    /// Cancel-safe: the request lives in `self`, not in this future.
    async fn failed(&mut self) -> Failure {
        if let Some(fut) = self.fut.as_mut() {
            let result = fut.await;
            self.fut = None;
            if let Err(f) = result {
                return f;
            }
        }
        std::future::pending().await
    }
}

/// D's event stream on its way to the client, with P still watched.
struct Relay {
    proxy: Proxy,
    watch: PrefillWatch,
    events: Events,
    guard: OutcomeGuard,
    done: bool,
}

/// D's response body, cut at event boundaries.
struct Events {
    d: Option<BoxStream<'static, reqwest::Result<Bytes>>>,
    d_url: String,
    /// Received bytes after the last complete event.
    buf: Vec<u8>,
}

/// What D's stream produced next.
enum EventsItem {
    /// Complete events, unchanged.
    Events(Bytes),
    /// D's stream ended; whatever trailed the last complete event.
    End(Option<Bytes>),
    Failed(Failure),
}

/// The length of the longest prefix of `buf` made of complete events.
fn complete_events_len(buf: &[u8]) -> usize {
    buf.windows(2).rposition(|w| w == b"\n\n").map_or(0, |i| i + 2)
}

impl Events {
    async fn next(&mut self) -> EventsItem {
        loop {
            let Some(d) = self.d.as_mut() else { return EventsItem::End(None) };
            match d.next().await {
                Some(Ok(chunk)) => {
                    self.buf.extend_from_slice(&chunk);
                    let n = complete_events_len(&self.buf);
                    if n > 0 {
                        let rest = self.buf.split_off(n);
                        return EventsItem::Events(Bytes::from(std::mem::replace(&mut self.buf, rest)));
                    }
                }
                Some(Err(e)) => {
                    self.d = None;
                    self.buf.clear();
                    return EventsItem::Failed(Failure::Transport(error_chain(&e)).at(Role::Decode, &self.d_url));
                }
                None => {
                    self.d = None;
                    let rest = std::mem::take(&mut self.buf);
                    return EventsItem::End((!rest.is_empty()).then(|| Bytes::from(rest)));
                }
            }
        }
    }
}

impl Relay {
    /// Turns D's next item into the client's next piece of body.
    fn on_events(&mut self, item: EventsItem) -> Option<Bytes> {
        match item {
            EventsItem::Events(b) => Some(b),
            EventsItem::End(rest) => {
                self.guard.set(Outcome::Ok);
                self.finish();
                rest
            }
            EventsItem::Failed(f) => {
                tracing::warn!("{}; ending the stream", f.describe());
                self.proxy.inner.metrics.upstream_error(Role::Decode);
                self.guard.set(Outcome::DecodeError);
                self.finish();
                Some(f.sse_tail())
            }
        }
    }

    fn on_prefill_failed(&mut self, f: Failure) -> Option<Bytes> {
        tracing::warn!("{}; ending the decode stream", f.describe());
        self.proxy.inner.metrics.upstream_error(Role::Prefill);
        self.guard.set(Outcome::PrefillError);
        self.finish();
        Some(f.sse_tail())
    }

    /// The next piece of the client's body, or `None` at the end.
    async fn next_piece(&mut self) -> Option<Bytes> {
        if self.done {
            return None;
        }
        tokio::select! {
            f = self.watch.failed() => self.on_prefill_failed(f),
            item = self.events.next() => self.on_events(item),
        }
    }

    /// Drops both upstream requests (P's, if still running, is aborted).
    fn finish(&mut self) {
        self.done = true;
        self.events.d = None;
        self.events.buf.clear();
        self.watch.fut = None;
    }
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

async fn completions(State(proxy): State<Proxy>, headers: HeaderMap, body: Bytes) -> Response {
    proxy.relay(Endpoint::Completions, headers, body).await
}

async fn chat_completions(State(proxy): State<Proxy>, headers: HeaderMap, body: Bytes) -> Response {
    proxy.relay(Endpoint::ChatCompletions, headers, body).await
}

async fn models(State(proxy): State<Proxy>) -> Response {
    proxy.forward_get("/v1/models").await
}

async fn health(State(proxy): State<Proxy>) -> Response {
    if proxy.is_ready() {
        StatusCode::OK.into_response()
    } else {
        retryable(ApiError::unavailable("no healthy prefill or decode server").with_code("no_healthy_backend"))
    }
}

async fn metrics(State(proxy): State<Proxy>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], proxy.render_metrics()).into_response()
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

async fn method_not_allowed() -> ApiError {
    ApiError { status: StatusCode::METHOD_NOT_ALLOWED, ..ApiError::invalid("method not allowed on this route") }
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
        let p: Value = serde_json::from_slice(&prefill_body(&req, Endpoint::Completions, "t1")).unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"], json!({"do_remote_decode": true, "transfer_id": "t1"}));
        assert_eq!(p["prompt"], "hi");
        assert_eq!(p["temperature"], 0);

        let chat = obj(json!({"messages": [], "max_completion_tokens": 9}));
        let p: Value = serde_json::from_slice(&prefill_body(&chat, Endpoint::ChatCompletions, "t")).unwrap();
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["max_tokens"], 1);
    }

    #[test]
    fn decode_body_names_the_prefill_server() {
        let req = obj(json!({"prompt": "hi", "max_tokens": 50, "stream": true}));
        let info = KvTransferInfo {
            engine_id: "p0".into(),
            kv_role: Some("kv_producer".into()),
            transport: Some("tcp".into()),
            transfer_mode: Some("write".into()),
            bootstrap_addr: Some("127.0.0.1:7000".into()),
            transfer_addr: Some("127.0.0.1:7001".into()),
        };
        let d: Value = serde_json::from_slice(&decode_body(&req, "t2", Some(&info))).unwrap();
        assert_eq!(
            d["kv_transfer_params"],
            json!({"do_remote_prefill": true, "transfer_id": "t2", "remote_engine_id": "p0",
                   "remote_bootstrap_addr": "127.0.0.1:7000"})
        );
        assert_eq!(d["max_tokens"], 50);
        assert_eq!(d["stream"], true);
        let d: Value = serde_json::from_slice(&decode_body(&req, "t3", None)).unwrap();
        assert_eq!(d["kv_transfer_params"], json!({"do_remote_prefill": true, "transfer_id": "t3"}));
    }

    #[test]
    fn read_mode_decode_body_carries_exactly_p_params() {
        let req = obj(json!({"prompt": "hi", "max_tokens": 50, "kv_transfer_params": {"client": 1}}));
        let params = json!({"do_remote_prefill": true, "transfer_id": "t", "remote_block_ids": [4, 5],
                            "remote_registration_generation": 2});
        let d: Value = serde_json::from_slice(&decode_body_with(&req, Some(params.clone()))).unwrap();
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!((d["prompt"].as_str(), d["max_tokens"].as_u64()), (Some("hi"), Some(50)));
        let d: Value = serde_json::from_slice(&decode_body_with(&req, None)).unwrap();
        assert!(d.get("kv_transfer_params").is_none(), "{d}");
    }

    #[test]
    fn events_are_cut_at_boundaries() {
        assert_eq!(complete_events_len(b"data: {\"a\""), 0);
        assert_eq!(complete_events_len(b"data: 1\n\ndata: 2"), 9);
        assert_eq!(complete_events_len(b"data: 1\n\ndata: 2\n\n"), 18);
        assert_eq!(complete_events_len(b""), 0);
    }

    #[test]
    fn urls_are_normalized_and_checked() {
        assert_eq!(normalize_url(Role::Prefill, "127.0.0.1:8100").unwrap(), "http://127.0.0.1:8100");
        assert_eq!(normalize_url(Role::Decode, "http://localhost:9/").unwrap(), "http://localhost:9");
        assert!(matches!(normalize_url(Role::Decode, "https://x:1"), Err(ProxyError::BadUrl { .. })));
        assert!(matches!(normalize_url(Role::Decode, "http://x:1/?a=b"), Err(ProxyError::BadUrl { .. })));
        let dup = ProxyConfig::new(vec!["a:1".into(), "http://a:1".into()], vec!["b:2".into()]);
        assert!(matches!(Proxy::new(dup), Err(ProxyError::Duplicate { .. })));
        assert!(matches!(Proxy::new(ProxyConfig::new(vec![], vec!["b:2".into()])), Err(ProxyError::NoBackend(_))));
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

    #[test]
    fn sse_tail_carries_the_upstream_error_body() {
        let body = Bytes::from_static(br#"{"error":{"message":"too long","type":"invalid_request_error","param":null,"code":null}}"#);
        let f = Failure::Status { status: StatusCode::BAD_REQUEST, content_type: None, body }.at(Role::Prefill, "http://p");
        let tail = String::from_utf8(f.sse_tail().to_vec()).unwrap();
        assert!(tail.starts_with("data: {\"error\":"), "{tail}");
        assert!(tail.contains("too long"));
        assert!(tail.ends_with("\n\ndata: [DONE]\n\n"));
        let aborted = String::from_utf8(Failure::Aborted.at(Role::Prefill, "http://p").sse_tail().to_vec()).unwrap();
        assert!(aborted.contains("prefill_aborted"), "{aborted}");
    }
}
