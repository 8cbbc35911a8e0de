//! How the proxy fans a weight sync out to its engines.
//!
//! `init_info.fanout` in `init_weight_transfer_engine` chooses:
//!
//! - `direct` (the default): every engine pulls the full set from the
//!   trainer's publisher, all at once. On the publisher's host the engines
//!   copy from its shared memory and the trainer does no work; across hosts
//!   the trainer's link carries one copy per engine.
//! - `relay`: the prefill engines pull from the trainer; each decode engine
//!   pulls from a prefill engine's complete staging
//!   (`GET /weight_sync/manifest` on it) once that prefill engine has every
//!   tensor. The trainer's link carries one copy per prefill engine.
//!   `start_weight_update` then reaches the prefill engines only;
//!   `update_weights` pulls on them, and once each has every tensor starts
//!   and pulls the decode engines. `finish_weight_update` switches all.
//!
//! Answers list every engine as the other fanned-out calls do; a decode
//! engine not reached yet is `"not called"`.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::http::Method;
use axum::response::{IntoResponse, Response};
use pdkv_relay::plan::Role;
use serde_json::{json, Value};

use super::engine_calls::{answer, call, call_one, call_role, not_called, Order};
use super::shared::{Fanout, Shared};
use crate::error::ApiError;

/// `path` to every engine at once, as the other fanned-out calls.
async fn together(
    proxy: Arc<Shared>,
    path: &'static str,
    query: Option<String>,
    body: Bytes,
) -> Response {
    call(
        State(proxy),
        Method::POST,
        path,
        Order::Together,
        RawQuery(query),
        body,
    )
    .await
}

fn mode(proxy: &Shared) -> Fanout {
    *proxy.weight_fanout.lock().unwrap()
}

/// `POST /init_weight_transfer_engine`: the fan-out read (and taken out of
/// the engines' body); under `relay` each decode engine is pointed at a
/// prefill engine's staging instead of the trainer.
pub(super) async fn init(
    State(proxy): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let mut v: Value = match serde_json::from_slice(&body) {
        Ok(v) => v,
        Err(e) => {
            return ApiError::invalid(format!("init_weight_transfer_engine: {e}")).into_response()
        }
    };
    let fanout = match v
        .get_mut("init_info")
        .and_then(Value::as_object_mut)
        .and_then(|i| i.remove("fanout"))
    {
        None => Fanout::Direct,
        Some(f) if f == "direct" => Fanout::Direct,
        Some(f) if f == "relay" => Fanout::Relay,
        Some(f) => {
            return ApiError::invalid_param(
                "init_info.fanout",
                format!("init_info.fanout must be direct or relay, got {f}"),
            )
            .into_response()
        }
    };
    let q = query.as_deref();
    let path = "/init_weight_transfer_engine";
    let to_p = Bytes::from(v.to_string());
    let prefill = proxy.backends(Role::Prefill);
    if fanout == Fanout::Direct || prefill.is_empty() {
        *proxy.weight_fanout.lock().unwrap() = Fanout::Direct;
        return together(proxy, path, query, to_p).await;
    }
    // Decode engine i pulls from prefill engine i mod P.
    let to_d: Vec<Bytes> = (0..proxy.backends(Role::Decode).len())
        .map(|i| {
            let mut d = v.clone();
            d["init_info"]["url"] =
                json!(format!("{}/weight_sync", prefill[i % prefill.len()].url));
            Bytes::from(d.to_string())
        })
        .collect();
    let d_calls = proxy
        .backends(Role::Decode)
        .iter()
        .zip(&to_d)
        .map(|(b, body)| call_one(&proxy, b, Method::POST, path, q, body));
    let (mut results, d) = futures::join!(
        call_role(&proxy, Role::Prefill, &Method::POST, path, q, &to_p),
        futures::future::join_all(d_calls)
    );
    results.extend(d);
    if results.iter().all(|r| r.ok()) {
        *proxy.weight_fanout.lock().unwrap() = Fanout::Relay;
        tracing::info!("weight syncs relay: decode engines pull from prefill engines");
    }
    answer(path, &results)
}

/// `POST /start_weight_update`: every engine, or under `relay` the prefill
/// engines only (a decode engine starts once its prefill engine's staging
/// is complete, in `update_weights`).
pub(super) async fn start(
    State(proxy): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let path = "/start_weight_update";
    if mode(&proxy) == Fanout::Direct {
        return together(proxy, path, query, body).await;
    }
    let mut results = call_role(
        &proxy,
        Role::Prefill,
        &Method::POST,
        path,
        query.as_deref(),
        &body,
    )
    .await;
    results.extend(not_called(&proxy, Role::Decode));
    answer(path, &results)
}

/// `POST /update_weights`: every engine, or under `relay` (for a sync's
/// `update_info`) the prefill engines, then, once each has every tensor,
/// the decode engines' start and pull. A reload from disk (`path`) goes
/// to every engine either way.
pub(super) async fn update(
    State(proxy): State<Arc<Shared>>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Response {
    let path = "/update_weights";
    let is_sync = serde_json::from_slice::<Value>(&body)
        .ok()
        .is_some_and(|v| v.get("update_info").is_some());
    if mode(&proxy) == Fanout::Direct || !is_sync {
        return together(proxy, path, query, body).await;
    }
    let q = query.as_deref();
    let mut results = call_role(&proxy, Role::Prefill, &Method::POST, path, q, &body).await;
    let complete = results
        .iter()
        .all(|r| r.ok() && r.body["pulled"] == r.body["total"] && !r.body["total"].is_null());
    if !complete {
        results.extend(not_called(&proxy, Role::Decode));
        return answer(path, &results);
    }
    let started = call_role(
        &proxy,
        Role::Decode,
        &Method::POST,
        "/start_weight_update",
        q,
        &Bytes::new(),
    )
    .await;
    if !started.iter().all(|r| r.ok()) {
        results.extend(started);
        return answer("/start_weight_update", &results);
    }
    let all = Bytes::from(json!({"update_info": {}}).to_string());
    results.extend(call_role(&proxy, Role::Decode, &Method::POST, path, q, &all).await);
    answer(path, &results)
}
