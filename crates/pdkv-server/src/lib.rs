//! The OpenAI-compatible HTTP front end of a pdkv engine (axum).
//!
//! Endpoints: `POST /v1/completions`, `POST /v1/chat/completions` (both with
//! `"stream": true` as server-sent events), `POST /inference/v1/generate`
//! (vLLM's token-in/token-out API, [`generate`]), `GET /v1/models`, `POST
//! /tokenize`, `POST /detokenize`, `GET /version`, `GET /health`, `GET
//! /metrics` (Prometheus text), and what P/D routers call on every worker
//! ([`compat`]: `/flush_cache`, `/get_model_info`, `/get_server_info`). With
//! an API key ([`AppState::with_api_key`]) the OpenAI routes and the
//! tokenizer routes need `Authorization: Bearer <key>`. With an admin token
//! ([`AppState::with_admin_token`]) also the lifecycle API of [`admin`]
//! (`/pause`, `/sleep`, `/wake_up`, `/update_weights`, ...), each route
//! behind `Authorization: Bearer <token>`; without one those routes do not
//! exist (404), unless the server runs in dev mode
//! ([`AppState::with_dev_mode`]), which mounts them open, as vLLM does under
//! `VLLM_SERVER_DEV_MODE=1`.
//!
//! A generation request's `id` (and its `X-Request-Id` response header)
//! names it for `/abort_requests`; a client may choose it with an
//! `X-Request-Id` header or a `request_id` body field, and the engine then
//! runs it scoped to that client ([`ids`]), so no one else can claim it.
//!
//! Invariants:
//! - Only this crate knows HTTP and the OpenAI JSON shapes; the engine sees
//!   token ids and [`pdkv_engine::SamplingParams`].
//! - A request's [`pdkv_engine::RequestStream`] is owned by its handler
//!   future or its response body and by nothing else (no spawned task), so
//!   a client that disconnects aborts its request and frees its KV blocks.
//! - Every error a client can cause is an OpenAI-shaped JSON body with a 4xx
//!   status; handlers never panic on input.

pub mod admin;
mod admit;
mod api_key;
mod chat;
mod choices;
mod compat;
mod dialects;
pub mod error;
pub mod fields;
mod generate;
mod ids;
pub mod listen;
mod logprobs;
pub mod metrics;
pub mod openai;
pub mod proxy;
mod routes;
mod sse;
mod structured;
mod tokenize;
pub mod tools;
pub mod tracker;
pub mod weight_sync;

use std::future::Future;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use pdkv_engine::EngineHandle;

pub use error::{ApiError, ApiJson};
pub use metrics::Metrics;

/// Largest request body accepted, in bytes.
pub const MAX_BODY_BYTES: usize = 4 * 1024 * 1024;

/// What every handler shares: the engine, the metrics, the served name and
/// the admin token (when the lifecycle API is enabled).
#[derive(Clone)]
pub struct AppState {
    inner: Arc<StateInner>,
    sync: Arc<weight_sync::WeightSync>,
    admin_token: Option<Arc<admin::AdminToken>>,
    dev_mode: bool,
    pause_wait: std::time::Duration,
    api_key: Option<Arc<api_key::ApiKey>>,
    checkpoint_read_timeout: std::time::Duration,
    /// Reads calls a model writes on its own (`tool_choice: auto`);
    /// `None`: auto is refused.
    tool_parser: Option<tools::Parser>,
    /// One checkpoint read at a time; its permit goes with the reading
    /// thread, so a read that stalls past its deadline still holds it.
    checkpoint_reads: Arc<tokio::sync::Semaphore>,
    /// Bumped (with what did it) to cancel the checkpoint read an
    /// `/update_weights` waits on: `/resume`, `/abort_requests`, another
    /// update, shutdown.
    checkpoint_cancel: Arc<tokio::sync::watch::Sender<(u64, &'static str)>>,
}

/// How long a new request waits for `/resume` while the engine is paused
/// ([`AppState::with_pause_wait`]) by default.
pub const DEFAULT_PAUSE_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

/// Bound on reading a checkpoint for `/update_weights` by default
/// ([`AppState::with_checkpoint_read_timeout`]).
pub const DEFAULT_CHECKPOINT_READ_TIMEOUT: std::time::Duration =
    std::time::Duration::from_secs(300);

struct StateInner {
    engine: EngineHandle,
    metrics: Arc<Metrics>,
    served_model_name: String,
    started_at: u64,
    ids: ids::IdSource,
    /// Compiles structured output constraints (built on first use).
    structured: Arc<pdkv_structured::Compiler>,
}

impl AppState {
    /// `served_model_name` is the name clients use in `model` and see in
    /// `/v1/models`.
    pub fn new(engine: EngineHandle, served_model_name: impl Into<String>) -> AppState {
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        AppState {
            inner: Arc::new(StateInner {
                structured: Arc::new(pdkv_structured::Compiler::for_engine(&engine)),
                engine,
                metrics: Arc::new(Metrics::new()),
                served_model_name: served_model_name.into(),
                started_at: now.as_secs(),
                ids: ids::IdSource::default(),
            }),
            sync: Arc::new(weight_sync::WeightSync::new(
                pdkv_transfer::auth::KvSecret::open(),
            )),
            admin_token: None,
            dev_mode: false,
            pause_wait: DEFAULT_PAUSE_WAIT,
            api_key: None,
            checkpoint_read_timeout: DEFAULT_CHECKPOINT_READ_TIMEOUT,
            tool_parser: None,
            checkpoint_reads: Arc::new(tokio::sync::Semaphore::new(1)),
            checkpoint_cancel: Arc::new(tokio::sync::watch::channel((0, "")).0),
        }
    }

    /// Cancels the wait of an `/update_weights` that reads a checkpoint:
    /// it answers at once that `by` cancelled it, and the engine keeps its
    /// weights (the reading thread, which cannot be interrupted, ends on
    /// its own and its result is dropped).
    pub fn cancel_checkpoint_reads(&self, by: &'static str) {
        self.checkpoint_cancel.send_modify(|(n, why)| {
            *n += 1;
            *why = by;
        });
    }

    /// The deployment's KV secret, which weight syncs prove to the
    /// trainer's publisher (open by default), and the address their puller
    /// binds on (`ip`, port chosen by the system): where another engine
    /// reads this one's staging in a relayed sync.
    pub fn with_kv_secret(mut self, secret: pdkv_transfer::auth::KvSecret, ip: &str) -> AppState {
        self.sync = Arc::new(weight_sync::WeightSync::new(secret).bind_on(ip));
        self
    }

    /// Compiles structured output constraints for the served model.
    pub(crate) fn structured(&self) -> &Arc<pdkv_structured::Compiler> {
        &self.inner.structured
    }

    /// Lets requests use `tool_choice: auto`, their answers read by
    /// `parser` (`--enable-auto-tool-choice --tool-call-parser NAME`).
    pub fn with_tool_parser(mut self, parser: Option<tools::Parser>) -> AppState {
        self.tool_parser = parser;
        self
    }

    pub(crate) fn tool_parser(&self) -> Option<tools::Parser> {
        self.tool_parser
    }

    /// The weight sync state (see [`weight_sync`]).
    pub fn weight_sync(&self) -> &Arc<weight_sync::WeightSync> {
        &self.sync
    }

    /// Requires `Authorization: Bearer <key>` on the OpenAI routes (`/v1/*`,
    /// `/tokenize`, `/detokenize`; see [`api_key`]). An empty key is refused.
    pub fn with_api_key(
        mut self,
        key: impl Into<String>,
    ) -> Result<AppState, admin::EmptyTokenError> {
        self.api_key = Some(Arc::new(api_key::ApiKey::new(key.into())?));
        Ok(self)
    }

    /// Enables the lifecycle admin API, guarded by `token` (sent by clients
    /// as `Authorization: Bearer <token>`). An empty token is refused.
    pub fn with_admin_token(
        mut self,
        token: impl Into<String>,
    ) -> Result<AppState, admin::EmptyTokenError> {
        self.admin_token = Some(Arc::new(admin::AdminToken::new(token.into())?));
        Ok(self)
    }

    /// Dev mode: the lifecycle admin API is mounted even without an admin
    /// token, open to anyone who reaches the port (with a token, the token
    /// is still required). For RL frameworks that call those routes without
    /// credentials on a trusted network.
    pub fn with_dev_mode(mut self, on: bool) -> AppState {
        self.dev_mode = on;
        self
    }

    /// How long a new request waits for `/resume` while the engine is
    /// paused (in any mode, asleep included) before a 503; zero refuses at
    /// once.
    pub fn with_pause_wait(mut self, wait: std::time::Duration) -> AppState {
        self.pause_wait = wait;
        self
    }

    pub fn pause_wait(&self) -> std::time::Duration {
        self.pause_wait
    }

    /// How long `/update_weights` may take to read a checkpoint from disk
    /// (the engine serves its current weights meanwhile) before a 504.
    pub fn with_checkpoint_read_timeout(mut self, limit: std::time::Duration) -> AppState {
        self.checkpoint_read_timeout = limit;
        self
    }

    /// Whether the admin API is enabled.
    pub fn admin_enabled(&self) -> bool {
        self.admin_token.is_some() || self.dev_mode
    }

    pub fn engine(&self) -> &EngineHandle {
        &self.inner.engine
    }

    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.inner.metrics
    }

    pub fn served_model_name(&self) -> &str {
        &self.inner.served_model_name
    }

    /// Unix time the state was created (the model's `created` field).
    pub fn started_at(&self) -> u64 {
        self.inner.started_at
    }

    /// A fresh request id no client can guess (and claim first with
    /// `X-Request-Id`): `prefix` and 128 random bits.
    fn next_request_id(&self, prefix: &str) -> String {
        format!("{prefix}{}", self.inner.ids.next_hex())
    }

    /// The ids of a request whose client chose `id` (see [`ids`]).
    fn scoped_request_id(&self, id: &str, sender: &ids::Sender<'_>) -> ids::RequestIds {
        self.inner.ids.scoped(id, sender)
    }
}

/// All routes, with the body-size limit and JSON fallbacks. The admin routes
/// are mounted only when the state carries an admin token.
pub fn router(state: AppState) -> Router {
    let mut app = Router::new();
    if let Some(token) = &state.admin_token {
        app = app.merge(admin::routes(Some(token.clone()), dialects::routes()));
    } else if state.dev_mode {
        tracing::warn!(
            "dev mode: the lifecycle and weight routes (/pause, /sleep, /update_weights, ...) are open to anyone who reaches this port"
        );
        app = app.merge(admin::routes(None, dialects::routes()));
    }
    let mut openai = Router::new()
        .route("/v1/completions", post(routes::completions))
        .route("/v1/chat/completions", post(routes::chat_completions))
        .route("/v1/models", get(routes::models))
        .route("/inference/v1/generate", post(generate::generate))
        .route("/tokenize", post(tokenize::tokenize))
        .route("/detokenize", post(tokenize::detokenize));
    if let Some(key) = &state.api_key {
        openai = openai.route_layer(axum::middleware::from_fn_with_state(
            key.clone(),
            api_key::require_key,
        ));
    }
    app.merge(openai)
        .route("/version", get(tokenize::version))
        .route("/health", get(routes::health))
        // vLLM's alias of /health (for SageMaker), by GET or POST.
        .route("/ping", get(routes::health).post(routes::health))
        .route("/kv_transfer/info", get(routes::kv_transfer_info))
        .route("/weight_sync/manifest", get(routes::weight_sync_manifest))
        .route("/metrics", get(routes::metrics))
        .route(
            "/flush_cache",
            post(compat::flush_cache).get(compat::flush_cache),
        )
        .route("/get_model_info", get(compat::get_model_info))
        .route("/get_server_info", get(compat::get_server_info))
        .fallback(routes::not_found)
        .method_not_allowed_fallback(routes::method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(state)
}

/// Serves `state` on `listener` with the default [`listen::HttpLimits`]
/// until `shutdown` resolves, then stops accepting connections and waits
/// for the open ones to finish.
pub async fn serve(
    listener: tokio::net::TcpListener,
    state: AppState,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_with(listener, state, listen::HttpLimits::default(), shutdown).await
}

/// [`serve`] within `limits`.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    state: AppState,
    limits: listen::HttpLimits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    listen::serve(listener, router(state), limits, shutdown).await
}
