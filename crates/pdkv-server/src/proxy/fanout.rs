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
use axum::http::{header, Method, StatusCode};
use axum::middleware;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use super::{Backend, Proxy, Role};
use crate::admin::{require_token, AdminToken};

/// In which order a call reaches the roles.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Order {
    /// Prefill engines, then decode engines.
    PrefillFirst,
    /// Decode engines, then prefill engines.
    DecodeFirst,
    /// Every engine at once.
    Together,
}

/// One engine's answer to a fanned-out call.
#[derive(Debug)]
pub(super) struct EngineResult {
    pub(super) role: Role,
    pub(super) url: String,
    /// `None`: not called (an earlier phase failed) or no answer.
    pub(super) status: Option<u16>,
    pub(super) body: Value,
}

impl EngineResult {
    pub(super) fn ok(&self) -> bool {
        self.status.is_some_and(|s| (200..300).contains(&s))
    }

    fn json(&self) -> Value {
        json!({"role": self.role.to_string(), "url": self.url, "status": self.status, "body": self.body})
    }
}

/// The admin routes of the proxy, behind `token`.
pub(super) fn routes(token: Arc<AdminToken>) -> Router<Proxy> {
    Router::new()
        .route(
            "/pause",
            post(|s, q, b| call(s, Method::POST, "/pause", Order::PrefillFirst, q, b)),
        )
        .route(
            "/sleep",
            post(|s, q, b| call(s, Method::POST, "/sleep", Order::PrefillFirst, q, b)),
        )
        .route(
            "/release_kv_cache_memory",
            post(|s, q, b| {
                call(
                    s,
                    Method::POST,
                    "/release_kv_cache_memory",
                    Order::PrefillFirst,
                    q,
                    b,
                )
            }),
        )
        .route(
            "/wake_up",
            post(|s, q, b| call(s, Method::POST, "/wake_up", Order::DecodeFirst, q, b)),
        )
        .route(
            "/resume",
            post(|s, q, b| call(s, Method::POST, "/resume", Order::DecodeFirst, q, b)),
        )
        .route("/update_weights", post(super::weight_fanout::update))
        .route(
            "/init_weight_transfer_engine",
            post(super::weight_fanout::init),
        )
        .route("/start_weight_update", post(super::weight_fanout::start))
        .route(
            "/finish_weight_update",
            post(|s, q, b| {
                call(
                    s,
                    Method::POST,
                    "/finish_weight_update",
                    Order::Together,
                    q,
                    b,
                )
            }),
        )
        .route(
            "/reset_prefix_cache",
            post(|s, q, b| {
                call(
                    s,
                    Method::POST,
                    "/reset_prefix_cache",
                    Order::Together,
                    q,
                    b,
                )
            }),
        )
        .route(
            "/abort_requests",
            post(|s, q, b| call(s, Method::POST, "/abort_requests", Order::Together, q, b)),
        )
        .route(
            "/is_sleeping",
            get(|s, q| read_flag(s, "/is_sleeping", "is_sleeping", q)),
        )
        .route(
            "/is_paused",
            get(|s, q| read_flag(s, "/is_paused", "is_paused", q)),
        )
        .route("/weight_info", get(weight_info))
        .route_layer(middleware::from_fn_with_state(token, require_token))
}

/// Calls `path` on one engine with the proxy's admin token.
pub(super) async fn call_one(
    proxy: &Proxy,
    b: &Backend,
    method: Method,
    path: &str,
    query: Option<&str>,
    body: &Bytes,
) -> EngineResult {
    let url = match query {
        Some(q) if !q.is_empty() => format!("{}{path}?{q}", b.url),
        _ => format!("{}{path}", b.url),
    };
    let inner = &proxy.inner;
    let mut req = inner
        .client
        .request(method, url)
        .timeout(inner.config.request_timeout);
    if let Some(t) = &inner.config.admin_token {
        req = req.bearer_auth(t);
    }
    if !body.is_empty() {
        req = req
            .header(header::CONTENT_TYPE, "application/json")
            .body(body.clone());
    }
    let (status, body) = match req.send().await {
        Ok(resp) => {
            let status = resp.status().as_u16();
            let bytes = resp.bytes().await.unwrap_or_default();
            let body = serde_json::from_slice(&bytes)
                .unwrap_or_else(|_| json!({"text": String::from_utf8_lossy(&bytes).into_owned()}));
            (Some(status), body)
        }
        Err(e) => (
            None,
            json!({"error": {"message": format!("calling {}{path} failed: {}", b.url, super::error_chain(&e))}}),
        ),
    };
    EngineResult {
        role: b.role,
        url: b.url.clone(),
        status,
        body,
    }
}

/// The backends of `role`.
pub(super) fn backends(proxy: &Proxy, role: Role) -> &[Arc<Backend>] {
    match role {
        Role::Prefill => &proxy.inner.prefill.backends,
        Role::Decode => &proxy.inner.decode.backends,
    }
}

/// Calls `path` on every backend of `role` at once.
pub(super) async fn call_role(
    proxy: &Proxy,
    role: Role,
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Vec<EngineResult> {
    let calls = backends(proxy, role)
        .iter()
        .map(|b| call_one(proxy, b, method.clone(), path, query, body));
    futures::future::join_all(calls).await
}

pub(super) fn not_called(proxy: &Proxy, role: Role) -> Vec<EngineResult> {
    backends(proxy, role)
        .iter()
        .map(|b| EngineResult {
            role,
            url: b.url.clone(),
            status: None,
            body: json!("not called"),
        })
        .collect()
}

/// Fans `path` out in `order`; answers once every called engine has.
pub(super) async fn call(
    State(proxy): State<Proxy>,
    method: Method,
    path: &'static str,
    order: Order,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let q = query.as_deref();
    let results = match order {
        Order::Together => {
            let (mut p, d) = futures::join!(
                call_role(&proxy, Role::Prefill, &method, path, q, &body),
                call_role(&proxy, Role::Decode, &method, path, q, &body)
            );
            p.extend(d);
            p
        }
        Order::PrefillFirst | Order::DecodeFirst => {
            let (first, second) = match order {
                Order::PrefillFirst => (Role::Prefill, Role::Decode),
                _ => (Role::Decode, Role::Prefill),
            };
            let mut results = call_role(&proxy, first, &method, path, q, &body).await;
            if results.iter().all(EngineResult::ok) {
                results.extend(call_role(&proxy, second, &method, path, q, &body).await);
            } else {
                results.extend(not_called(&proxy, second));
            }
            results
        }
    };
    if matches!(path, "/wake_up" | "/resume") {
        // Serving again: route to these engines from the next request on.
        proxy.check_backends().await;
    }
    answer(path, &results)
}

/// `POST /flush_cache` (no token, as on an engine): every engine's prefix
/// cache at once.
pub(super) async fn flush_cache(proxy: State<Proxy>, query: RawQuery) -> Response {
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

/// 200 with every engine's result when all succeeded; else the first
/// failure's status (502 when an engine gave none) naming each engine that
/// failed.
pub(super) fn answer(path: &str, results: &[EngineResult]) -> Response {
    let (status, body) = answer_json(path, results);
    json_response(status, &body)
}

fn answer_json(path: &str, results: &[EngineResult]) -> (StatusCode, Value) {
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    let failed: Vec<&EngineResult> = results
        .iter()
        .filter(|r| !r.ok() && r.body != json!("not called"))
        .collect();
    if failed.is_empty() {
        let status = results
            .first()
            .map(|r| r.body["status"].clone())
            .unwrap_or(Value::Null);
        return (
            StatusCode::OK,
            json!({"status": status, "engines": engines}),
        );
    }
    let status = failed[0]
        .status
        .and_then(|s| StatusCode::from_u16(s).ok())
        .unwrap_or(StatusCode::BAD_GATEWAY);
    let names: Vec<String> = failed
        .iter()
        .map(|r| {
            let msg = r.body["error"]["message"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| r.body.to_string());
            match r.status {
                Some(s) => format!("{} {} answered {s}: {msg}", r.role, r.url),
                None => format!("{} {}: {msg}", r.role, r.url),
            }
        })
        .collect();
    let code = failed[0].body["error"]["code"].clone();
    let body = json!({
        "error": {
            "message": format!("{path} failed on {} of {} engines: {}", failed.len(), results.len(), names.join("; ")),
            "type": "engine_error",
            "param": null,
            "code": if code.is_null() { json!("engine_failed") } else { code },
        },
        "engines": engines,
    });
    (status, body)
}

fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// Every engine's answer to a read, at once.
async fn read_all(proxy: &Proxy, path: &str, query: Option<&str>) -> Vec<EngineResult> {
    let empty = Bytes::new();
    let (mut p, d) = futures::join!(
        call_role(proxy, Role::Prefill, &Method::GET, path, query, &empty),
        call_role(proxy, Role::Decode, &Method::GET, path, query, &empty)
    );
    p.extend(d);
    p
}

/// `GET /is_sleeping` / `GET /is_paused`: true only when every engine says
/// so; `agree` tells whether they all answered the same.
async fn read_flag(
    State(proxy): State<Proxy>,
    path: &'static str,
    key: &'static str,
    RawQuery(query): RawQuery,
) -> Response {
    let results = read_all(&proxy, path, query.as_deref()).await;
    if results.iter().any(|r| !r.ok()) {
        return answer(path, &results);
    }
    let flags: Vec<bool> = results
        .iter()
        .map(|r| r.body[key].as_bool().unwrap_or(false))
        .collect();
    let all = flags.iter().all(|&f| f);
    let agree = flags.iter().all(|&f| f == flags[0]);
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    json_response(
        StatusCode::OK,
        &json!({key: all, "agree": agree, "engines": engines}),
    )
}

/// `GET /weight_info`: the version every engine serves (`null` and
/// `"agree": false` when they differ).
async fn weight_info(State(proxy): State<Proxy>, RawQuery(query): RawQuery) -> Response {
    let results = read_all(&proxy, "/weight_info", query.as_deref()).await;
    if results.iter().any(|r| !r.ok()) {
        return answer("/weight_info", &results);
    }
    let versions: Vec<&Value> = results.iter().map(|r| &r.body["version"]).collect();
    let agree = versions.iter().all(|v| *v == versions[0]);
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    let version = if agree {
        versions[0].clone()
    } else {
        Value::Null
    };
    json_response(
        StatusCode::OK,
        &json!({"version": version, "agree": agree, "engines": engines}),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(role: Role, status: Option<u16>, body: Value) -> EngineResult {
        EngineResult {
            role,
            url: format!("http://{role}"),
            status,
            body,
        }
    }

    #[test]
    fn the_answer_names_each_engine_that_failed() {
        let ok = [
            r(Role::Prefill, Some(200), json!({"status": "paused"})),
            r(Role::Decode, Some(200), json!({})),
        ];
        let (status, v) = answer_json("/pause", &ok);
        assert_eq!(
            (status, &v["status"]),
            (StatusCode::OK, &json!("paused")),
            "{v}"
        );
        assert_eq!(v["engines"].as_array().unwrap().len(), 2);
        let failed = [
            r(
                Role::Prefill,
                Some(504),
                json!({"error": {"message": "timed out: drain", "code": null}}),
            ),
            r(
                Role::Prefill,
                None,
                json!({"error": {"message": "connection refused"}}),
            ),
            r(Role::Decode, None, json!("not called")),
        ];
        let (status, v) = answer_json("/sleep", &failed);
        assert_eq!(status, StatusCode::GATEWAY_TIMEOUT);
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.starts_with("/sleep failed on 2 of 3 engines"), "{msg}");
        assert!(
            msg.contains("prefill http://prefill answered 504: timed out: drain"),
            "{msg}"
        );
        assert!(msg.contains("connection refused"), "{msg}");
        assert_eq!(v["error"]["code"], "engine_failed");
        assert_eq!(v["engines"][2]["body"], "not called");
    }
}
