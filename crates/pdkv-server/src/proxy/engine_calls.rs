//! Calls to every engine behind the proxy with its admin token, in the
//! order a lifecycle call needs, and the one answer their results make.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::{header, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use pdkv_relay::plan::Role;
use serde_json::{json, Value};

use super::backends::Backend;
use super::shared::Shared;
use crate::error::error_chain;

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

    pub(super) fn json(&self) -> Value {
        json!({"role": self.role.to_string(), "url": self.url, "status": self.status, "body": self.body})
    }
}

/// Calls `path` on one engine with the proxy's admin token.
pub(super) async fn call_one(
    proxy: &Shared,
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
    let mut req = proxy
        .client
        .request(method, url)
        .timeout(proxy.config.request_timeout);
    if let Some(t) = &proxy.config.admin_token {
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
            json!({"error": {"message": format!("calling {}{path} failed: {}", b.url, error_chain(&e))}}),
        ),
    };
    EngineResult {
        role: b.role,
        url: b.url.clone(),
        status,
        body,
    }
}

/// Calls `path` on every backend of `role` at once.
pub(super) async fn call_role(
    proxy: &Shared,
    role: Role,
    method: &Method,
    path: &str,
    query: Option<&str>,
    body: &Bytes,
) -> Vec<EngineResult> {
    let calls = proxy
        .backends(role)
        .iter()
        .map(|b| call_one(proxy, b, method.clone(), path, query, body));
    futures::future::join_all(calls).await
}

pub(super) fn not_called(proxy: &Shared, role: Role) -> Vec<EngineResult> {
    proxy
        .backends(role)
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
    State(proxy): State<Arc<Shared>>,
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

/// 200 with every engine's result when all succeeded; else the first
/// failure's status (502 when an engine gave none) naming each engine that
/// failed.
pub(super) fn answer(path: &str, results: &[EngineResult]) -> Response {
    let (status, body) = answer_json(path, results);
    json_response(status, &body)
}

/// The answer when every engine succeeded: the first engine's body (its
/// fields are what a client of one engine reads), `status` set (`"ok"`
/// when the engine gave none), `/abort_requests`' ids and counts summed
/// over the engines, and every engine's own answer under `engines`.
fn merged_success(path: &str, results: &[EngineResult], engines: Vec<Value>) -> Value {
    let mut body = match results.first().map(|r| &r.body) {
        Some(Value::Object(o)) => o.clone(),
        _ => serde_json::Map::new(),
    };
    body.entry("status").or_insert_with(|| json!("ok"));
    if path == "/abort_requests" {
        let ids: Vec<Value> = results
            .iter()
            .filter_map(|r| r.body["aborted"].as_array())
            .flatten()
            .cloned()
            .collect();
        body.insert("num_aborted".into(), json!(ids.len()));
        body.insert("aborted".into(), Value::Array(ids));
    }
    body.insert("engines".into(), Value::Array(engines));
    Value::Object(body)
}

fn answer_json(path: &str, results: &[EngineResult]) -> (StatusCode, Value) {
    let engines: Vec<Value> = results.iter().map(EngineResult::json).collect();
    let failed: Vec<&EngineResult> = results
        .iter()
        .filter(|r| !r.ok() && r.body != json!("not called"))
        .collect();
    if failed.is_empty() {
        return (StatusCode::OK, merged_success(path, results, engines));
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

pub(super) fn json_response(status: StatusCode, v: &Value) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
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
