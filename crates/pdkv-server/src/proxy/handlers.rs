//! The proxy's HTTP routes: the generation endpoints (each request routed
//! through a P and a D by its relay plan), the routes a decode server
//! answers, health, metrics and the admin fan-out.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Router};
use pdkv_relay::plan::{Mode, Outcome, RelayPlan};
use serde_json::{Map, Value};

use super::backends::{plan_mode, BackendStatus};
use super::body::Endpoint;
use super::shared::Shared;
use super::upstream::{retryable, Forwarded};
use super::{fanout, metrics as proxy_metrics, relay};
use crate::error::{parse_json, ApiError};
use crate::listen::PeerAddr;
use crate::MAX_BODY_BYTES;

/// The proxy's routes.
pub(super) fn router(proxy: Arc<Shared>) -> Router {
    let mut app = Router::new();
    if let Some(t) = &proxy.config.admin_token {
        match crate::admin::AdminToken::new(t.clone()) {
            Ok(token) => app = app.merge(fanout::routes(Some(Arc::new(token)))),
            Err(e) => tracing::error!("the admin API is off: {e}"),
        }
    } else if proxy.config.dev_mode {
        tracing::warn!(
            "dev mode: the deployment's lifecycle and weight routes (/pause, /sleep, /update_weights, ...) are open to anyone who reaches this port"
        );
        app = app.merge(fanout::routes(None));
    }
    app.merge(forwarded_routes())
        .route("/v1/completions", post(relay(Endpoint::Completions)))
        .route(
            "/flush_cache",
            post(fanout::flush_cache).get(fanout::flush_cache),
        )
        .route(
            "/v1/chat/completions",
            post(relay(Endpoint::ChatCompletions)),
        )
        .route("/inference/v1/generate", post(relay(Endpoint::Generate)))
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
        .with_state(proxy)
}

/// Routes one generation request through a P and a D ([`generate_once`]).
/// An answer that is a retryable 503 (the decode engine paused or asleep, or
/// none healthy) waits, within the configured pause wait, for a decode
/// engine that serves and is sent again: through the proxy a paused
/// deployment holds new requests until `/resume`, as one engine does.
async fn generate(
    proxy: Arc<Shared>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let deadline = tokio::time::Instant::now() + proxy.config.pause_wait;
    let mut attempt = 0;
    loop {
        let resp = generate_once(
            proxy.clone(),
            endpoint,
            headers.clone(),
            body.clone(),
            attempt,
        )
        .await;
        let refused_on_purpose = resp.status() == StatusCode::SERVICE_UNAVAILABLE
            && resp.headers().contains_key(header::RETRY_AFTER);
        if !refused_on_purpose || !wait_for_decode(&proxy, deadline).await {
            return resp;
        }
        tracing::debug!("a decode engine serves again: sending the held request");
        attempt += 1;
    }
}

/// Waits until a decode engine's `/health` says it serves (checking at the
/// health interval); false at `deadline`.
async fn wait_for_decode(proxy: &Shared, deadline: tokio::time::Instant) -> bool {
    loop {
        if tokio::time::Instant::now() >= deadline {
            return false;
        }
        let next = (tokio::time::Instant::now() + proxy.config.health_interval).min(deadline);
        tokio::time::sleep_until(next).await;
        proxy.check_backends().await;
        if proxy.decode.any_healthy() {
            return true;
        }
    }
}

/// Routes one generation request through a P and a D: picks them, then
/// hands the request to its [`relay::Relay`], which drives its plan.
async fn generate_once(
    proxy: Arc<Shared>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Bytes,
    attempt: u32,
) -> Response {
    let req: Map<String, Value> = match parse_json(&body) {
        Ok(m) => m,
        Err(e) => {
            proxy.metrics.count(Outcome::BadRequest);
            tracing::debug!("refusing a request: {}", e.message);
            return e.into_response();
        }
    };
    let mut picked = (proxy.prefill.pick(), proxy.decode.pick());
    if picked.0.is_none() || picked.1.is_none() {
        // The last check may be stale (an engine woke since, say): look
        // again now, bounded by the health timeout, before refusing.
        proxy.check_backends().await;
        picked = (proxy.prefill.pick(), proxy.decode.pick());
    }
    let Some((d, _)) = picked.1 else {
        proxy.metrics.count(Outcome::NoBackend);
        let missing = if proxy.prefill.any_healthy() {
            "no decode server is healthy"
        } else {
            "no prefill and no decode server is healthy"
        };
        tracing::warn!("refusing a request: {missing}");
        return retryable(ApiError::unavailable(missing).with_code("no_healthy_backend"));
    };
    // The client's id: its X-Request-Id, else the body's `request_id`.
    let client_id = match headers.get("x-request-id") {
        Some(v) => v.to_str().ok(),
        None => req.get("request_id").and_then(Value::as_str),
    };
    let forwarded = Forwarded {
        request_id: headers.get("x-request-id").cloned(),
        authorization: headers.get(header::AUTHORIZATION).cloned(),
        forwarded_for: headers.get(X_FORWARDED_FOR).cloned(),
        prefill_request_id: super::upstream::prefill_request_id(client_id, attempt),
        token_ids: false,
    };
    let transfer_id = proxy.new_transfer_id();
    let (p, p_status, plan) = match picked.0 {
        Some((p, st)) => {
            let plan = RelayPlan::for_request(&req, plan_mode(st.kv_info.as_ref()), &transfer_id)
                .with_resumes(&req, proxy.config.max_resumes);
            (p, st, plan)
        }
        None => {
            // Every prefill server is down: D computes the prompt, as when
            // P is paused. (The plan never asks P; the relay still names one.)
            proxy.metrics.prefill_down();
            tracing::warn!(decode = %d.url, "no prefill server is up: the decode server computes the prompt itself");
            let plan = RelayPlan::without_prefill(&req, &transfer_id)
                .with_resumes(&req, proxy.config.max_resumes);
            (
                proxy.prefill.backends[0].clone(),
                BackendStatus::default(),
                plan,
            )
        }
    };
    let read_mode = plan_mode(p_status.kv_info.as_ref()) == Mode::Read;
    if plan.is_decode_alone() {
        tracing::debug!(endpoint = endpoint.path(), decode = %d.url, "D computes the prompt");
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
    relay::Relay::new(proxy, plan, call, (p, p_bootstrap), d)
        .respond()
        .await
}

/// A generation request whose body could not be read: the client's own
/// error, counted once as such.
fn refuse_body(proxy: &Shared, r: axum::extract::rejection::BytesRejection) -> Response {
    proxy.metrics.count(Outcome::BadRequest);
    crate::error::body_rejection(r).into_response()
}

/// `headers` with `X-Forwarded-For` set to the client's address (whatever
/// the client sent in it dropped): engines scope a client-chosen request id
/// by it, so clients behind this proxy cannot claim each other's ids.
fn forwarded_for(mut headers: HeaderMap, peer: Option<Extension<PeerAddr>>) -> HeaderMap {
    headers.remove(X_FORWARDED_FOR);
    if let Some(Extension(PeerAddr(addr))) = peer {
        let ip = HeaderValue::from_str(&addr.ip().to_string()).expect("an IP address is ASCII");
        headers.insert(X_FORWARDED_FOR, ip);
    }
    headers
}

/// The header a proxy names its client's address in.
const X_FORWARDED_FOR: &str = "x-forwarded-for";

/// A request body, or the OpenAI-shaped error for one the proxy will not
/// read (over [`MAX_BODY_BYTES`]: a 413, as the engines answer).
type BodyOrRefusal = Result<Bytes, axum::extract::rejection::BytesRejection>;

/// The handler of a generating endpoint: the body relayed by [`generate`].
fn relay(
    endpoint: Endpoint,
) -> impl Fn(State<Arc<Shared>>, HeaderMap, Option<Extension<PeerAddr>>, BodyOrRefusal) -> BoxFuture
       + Clone
       + Send
       + Sync
       + 'static {
    move |State(proxy), headers, peer, body| {
        Box::pin(async move {
            match body {
                Ok(body) => generate(proxy, endpoint, forwarded_for(headers, peer), body).await,
                Err(r) => refuse_body(&proxy, r),
            }
        })
    }
}

/// A handler's future.
type BoxFuture = std::pin::Pin<Box<dyn std::future::Future<Output = Response> + Send>>;

async fn models(State(proxy): State<Arc<Shared>>, headers: HeaderMap) -> Response {
    let auth = headers.get(header::AUTHORIZATION).cloned();
    proxy
        .forward(reqwest::Method::GET, "/v1/models", auth, None)
        .await
}

/// `POST /tokenize` and `/detokenize`, `GET /version`, `/get_model_info`
/// and `/get_server_info`: a decode server's answer.
fn forwarded_routes() -> Router<Arc<Shared>> {
    let post_to = |path: &'static str| {
        post(
            move |State(proxy): State<Arc<Shared>>, headers: HeaderMap, body: BodyOrRefusal| async move {
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
        get(move |State(proxy): State<Arc<Shared>>| async move { proxy.forward_get(path).await })
    };
    Router::new()
        .route("/tokenize", post_to("/tokenize"))
        .route("/detokenize", post_to("/detokenize"))
        .route("/version", get_from("/version"))
        .route("/get_model_info", get_from("/get_model_info"))
        .route("/get_server_info", get_from("/get_server_info"))
}

/// 200 while a decode server serves (with every prefill server down, D
/// computes prompts itself, which the body notes); otherwise a retryable
/// 503 saying why no decode server serves.
async fn health(State(proxy): State<Arc<Shared>>) -> Response {
    let decode: Vec<_> = proxy.decode.backends.iter().map(|b| b.status()).collect();
    if decode.iter().any(|s| s.healthy && s.refusing.is_none()) {
        if proxy.prefill.any_healthy() {
            return StatusCode::OK.into_response();
        }
        return (
            StatusCode::OK,
            axum::Json(serde_json::json!({
                "status": "degraded",
                "detail": "no prefill server is up: the decode servers compute prompts themselves",
            })),
        )
            .into_response();
    }
    let why: Vec<String> = proxy
        .decode
        .backends
        .iter()
        .zip(&decode)
        .map(|(b, s)| {
            let state = match (&s.refusing, &s.last_error) {
                (Some(r), _) if s.healthy => format!("refusing: {r}"),
                (_, Some(e)) => format!("down: {e}"),
                _ => "down".to_string(),
            };
            format!("{} {state}", b.url)
        })
        .collect();
    retryable(
        ApiError::unavailable(format!("no decode server serves ({})", why.join("; ")))
            .with_code("no_healthy_backend"),
    )
}

async fn metrics(State(proxy): State<Arc<Shared>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        proxy_metrics::render(&proxy.metrics, &proxy.snapshots()),
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
