//! The routes third-party P/D routers call on every worker besides the
//! OpenAI ones: `POST /flush_cache` (a router forwards it to every prefill
//! and decode engine), `GET /get_model_info` and `GET /get_server_info`
//! (proxied to the first prefill engine). None changes what a request
//! answers, so none needs the admin token.

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::error::ApiError;
use crate::AppState;

fn json_response(v: serde_json::Value) -> Response {
    (
        [(axum::http::header::CONTENT_TYPE, "application/json")],
        v.to_string(),
    )
        .into_response()
}

/// `POST /flush_cache`: drops every prefix-cache entry. A 409 while KV
/// blocks are in use (running requests or KV held for a transfer): the
/// cache cannot be emptied under them, and retrying once the engine is
/// idle succeeds.
pub async fn flush_cache(State(state): State<AppState>) -> Result<Response, ApiError> {
    let engine = state.engine().clone();
    let flushed = tokio::task::spawn_blocking(move || engine.reset_prefix_cache())
        .await
        .map_err(|e| ApiError::internal(format!("flushing the cache failed: {e}")))?;
    if flushed {
        Ok(json_response(
            json!({"success": true, "message": "the prefix cache is empty"}),
        ))
    } else {
        Err(ApiError::conflict("the prefix cache cannot be flushed while KV blocks are in use (requests running or KV held for a transfer); retry when idle")
            .with_code("cache_in_use"))
    }
}

/// `GET /get_model_info`: the model this engine serves.
pub async fn get_model_info(State(state): State<AppState>) -> Response {
    let engine = state.engine();
    let weights = engine.weight_info();
    json_response(json!({
        "model_path": weights.path.display().to_string(),
        "tokenizer_path": weights.path.display().to_string(),
        "served_model_name": state.served_model_name(),
        "model_name": engine.model_name(),
        "is_generation": true,
        "max_model_len": engine.max_model_len(),
        "weights_version": weights.version,
    }))
}

/// `GET /get_server_info`: the model, the KV connector, the lifecycle and
/// the cache, as this engine sees them now.
pub async fn get_server_info(State(state): State<AppState>) -> Response {
    let engine = state.engine();
    let st = crate::admin::lifecycle_status(&state);
    let stats = engine.stats();
    json_response(json!({
        "version": env!("CARGO_PKG_VERSION"),
        "served_model_name": state.served_model_name(),
        "model_path": engine.weight_info().path.display().to_string(),
        "max_model_len": engine.max_model_len(),
        "kv_transfer": engine.kv_connector_info(),
        "admin_api": state.admin_enabled(),
        "is_sleeping": st.sleeping.is_some(),
        "is_paused": st.paused.is_some(),
        "accepting_requests": engine.refusal().is_none(),
        "num_kv_blocks": stats.kv_blocks_total,
        "num_running": stats.num_running,
        "num_waiting": stats.num_waiting,
    }))
}
