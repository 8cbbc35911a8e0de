//! The deployment's lifecycle admin API: the same paths, query strings and
//! bodies as an engine's ([`crate::admin`]), each fanned out to every
//! prefill and decode engine behind the proxy, so an RL trainer drives the
//! whole P/D deployment with one call per step (`/pause`, `/sleep`,
//! `/update_weights`, `/wake_up`, `/resume`).
//!
//! Order: calls that stop work (`/pause`, `/sleep`,
//! `/release_kv_cache_memory`) reach the prefill engines first and the
//! decode engines after them (no new KV is produced for a D that is being
//! stopped); calls that start work (`/wake_up`, `/resume`) reach the decode
//! engines first (every D can receive before a P produces again). Engines
//! of one role are called at once. A role's phase that fails stops the
//! fan-out there: the answer names each engine that failed with its status
//! and message, and lists every engine's result (`"not called"` for those
//! after the failure), so the caller sees the deployment's state and can
//! retry the same call. The other calls (`/update_weights`, the weight
//! sync's `/init_weight_transfer_engine`, `/start_weight_update` and
//! `/finish_weight_update`, `/reset_prefix_cache`, `/abort_requests`, the
//! reads) go to every engine at once: in a sync each engine pulls the
//! tensors from the trainer's publisher itself, unless the sync was set up
//! to relay (decode engines pulling from prefill engines; see
//! [`super::weight_fanout`]).
//!
//! Reads (`/is_sleeping`, `/is_paused`, `/weight_info`) report the
//! deployment: a flag is true only when every engine says so, and
//! `"agree": false` with the per-engine answers shows engines that differ.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{Method, StatusCode};
use axum::middleware;
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use pdkv_relay::plan::Role;

use super::engine_calls::{answer, call, call_role, json_response, EngineResult, Order};
use super::shared::Shared;
use super::weight_fanout;
use crate::admin::{require_token, AdminToken};

/// The admin routes of the proxy, behind `token` (dev mode: open).
pub(super) fn routes(token: Option<Arc<AdminToken>>) -> Router<Arc<Shared>> {
    // The calls passed on to every engine as they are, in the order each needs.
    let passed_on = [
        ("/pause", Order::PrefillFirst),
        ("/sleep", Order::PrefillFirst),
        ("/release_kv_cache_memory", Order::PrefillFirst),
        ("/wake_up", Order::DecodeFirst),
        ("/resume", Order::DecodeFirst),
        ("/finish_weight_update", Order::Together),
        ("/reset_prefix_cache", Order::Together),
        ("/abort_requests", Order::Together),
        ("/areal_pause_generation", Order::PrefillFirst),
        ("/areal_continue_generation", Order::DecodeFirst),
        ("/areal_update_weights", Order::Together),
    ];
    let mut routes = Router::new();
    for (path, order) in passed_on {
        routes = routes.route(
            path,
            post(move |s, q, b| call(s, Method::POST, path, order, q, b)),
        );
    }
    let routes = routes
        .route("/update_weights", post(weight_fanout::update))
        .route("/init_weight_transfer_engine", post(weight_fanout::init))
        .route("/start_weight_update", post(weight_fanout::start))
        .route(
            "/is_sleeping",
            get(|s, q| read_flag(s, "/is_sleeping", "is_sleeping", q)),
        )
        .route(
            "/is_paused",
            get(|s, q| read_flag(s, "/is_paused", "is_paused", q)),
        )
        .route("/weight_info", get(weight_info))
        .route("/get_world_size", get(world_size))
        .route("/collective_rpc", post(collective_rpc));
    match token {
        Some(token) => routes.route_layer(middleware::from_fn_with_state(token, require_token)),
        None => routes,
    }
}

/// `GET /get_world_size`: the ranks of one engine (every engine must have
/// the same; `"agree": false` when they do not).
async fn world_size(
    State(proxy): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
) -> Result<Response, Response> {
    let results = read_all(&proxy, "/get_world_size", query.as_deref()).await?;
    let (sizes, agree) = values_of(&results, "world_size");
    Ok(json_response(
        StatusCode::OK,
        &json!({"world_size": sizes[0], "agree": agree}),
    ))
}

/// `POST /collective_rpc`: the first prefill engine's refusal, as is.
async fn collective_rpc(State(proxy): State<Arc<Shared>>, body: Bytes) -> Response {
    let Some(b) = proxy.backends(Role::Prefill).first() else {
        return json_response(
            StatusCode::SERVICE_UNAVAILABLE,
            &json!({"error": {"message": "no prefill engine"}}),
        );
    };
    let r = super::engine_calls::call_one(&proxy, b, Method::POST, "/collective_rpc", None, &body)
        .await;
    let status = r
        .status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    json_response(status, &r.body)
}

/// `POST /flush_cache` (no token, as on an engine): every engine's prefix
/// cache at once.
pub(super) async fn flush_cache(proxy: State<Arc<Shared>>, query: RawQuery) -> Response {
    call(
        proxy,
        Method::POST,
        "/flush_cache",
        Order::Together,
        query,
        Bytes::new(),
    )
    .await
}

/// Every engine's answer to a read, at once; the answer naming the
/// engines that failed when one did.
async fn read_all(
    proxy: &Shared,
    path: &str,
    query: Option<&str>,
) -> Result<Vec<EngineResult>, Response> {
    let empty = Bytes::new();
    let (mut p, d) = futures::join!(
        call_role(proxy, Role::Prefill, &Method::GET, path, query, &empty),
        call_role(proxy, Role::Decode, &Method::GET, path, query, &empty)
    );
    p.extend(d);
    if p.iter().any(|r| !r.ok()) {
        return Err(answer(path, &p));
    }
    Ok(p)
}

/// Every engine's `key`, and whether they all agree.
fn values_of<'a>(results: &'a [EngineResult], key: &str) -> (Vec<&'a Value>, bool) {
    let values: Vec<&Value> = results.iter().map(|r| &r.body[key]).collect();
    let agree = values.iter().all(|v| *v == values[0]);
    (values, agree)
}

/// `GET /is_sleeping` / `GET /is_paused`: true only when every engine says
/// so; `agree` tells whether they all answered the same.
async fn read_flag(
    State(proxy): State<Arc<Shared>>,
    path: &'static str,
    key: &'static str,
    RawQuery(query): RawQuery,
) -> Result<Response, Response> {
    let results = read_all(&proxy, path, query.as_deref()).await?;
    let flags: Vec<bool> = results
        .iter()
        .map(|r| r.body[key].as_bool().unwrap_or(false))
        .collect();
    let all = flags.iter().all(|&f| f);
    let agree = flags.iter().all(|&f| f == flags[0]);
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    Ok(json_response(
        StatusCode::OK,
        &json!({key: all, "agree": agree, "engines": engines}),
    ))
}

/// `GET /weight_info`: the version every engine serves (`null` and
/// `"agree": false` when they differ).
async fn weight_info(
    State(proxy): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
) -> Result<Response, Response> {
    let results = read_all(&proxy, "/weight_info", query.as_deref()).await?;
    let (versions, agree) = values_of(&results, "version");
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    let version = if agree {
        versions[0].clone()
    } else {
        Value::Null
    };
    Ok(json_response(
        StatusCode::OK,
        &json!({"version": version, "agree": agree, "engines": engines}),
    ))
}
