//! The RL frameworks' own names for the lifecycle operations, as routes
//! beside vLLM's (mounted with the admin API, behind its token or open in
//! dev mode):
//!
//! - `GET /get_world_size` → `{"world_size": N}` (SkyRL reads it before a
//!   weight sync): the engine's tensor-parallel ranks.
//! - AReaL: `POST /areal_pause_generation` ends every request in flight
//!   (200 with `finish_reason: "abort"` and the tokens so far, which AReaL
//!   re-sends with those tokens appended) and empties the prefix cache;
//!   new requests wait until `POST /areal_continue_generation`.
//!   `POST /areal_update_weights {"model_path": DIR}` reloads a checkpoint.
//!   Each answers `{"success": bool, "message": ...}` as AReaL's server does.
//! - `POST /collective_rpc`: a 400 naming the method and what pdkv offers
//!   instead (there are no worker processes to call into).

use axum::body::Bytes;
use axum::extract::{RawQuery, State};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use pdkv_engine::PauseMode;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::admin::{on_engine, reload_from_disk, QueryParams, DEFAULT_TIMEOUT};
use crate::admit::json_response;
use crate::error::ApiError;
use crate::AppState;

pub(crate) fn routes() -> Router<AppState> {
    Router::new()
        .route("/get_world_size", get(get_world_size))
        .route("/areal_pause_generation", post(areal_pause))
        .route("/areal_continue_generation", post(areal_continue))
        .route("/areal_update_weights", post(areal_update_weights))
        .route("/collective_rpc", post(collective_rpc))
}

/// `GET /get_world_size` (a body, as SkyRL sends `{}`, is ignored).
async fn get_world_size(State(state): State<AppState>, RawQuery(raw): RawQuery) -> Response {
    let _ = QueryParams::parse(raw.as_deref(), &[]);
    json_response(&json!({"world_size": state.engine().config().tensor_parallel_size}))
}

fn success(message: &str) -> Response {
    json_response(&json!({"success": true, "message": message}))
}

/// `POST /areal_pause_generation`: a pause in `abort` mode that empties the
/// prefix cache.
async fn areal_pause(State(state): State<AppState>) -> Result<Response, ApiError> {
    on_engine(&state, |e| e.pause(PauseMode::Abort, true, DEFAULT_TIMEOUT)).await??;
    Ok(success(
        "generation paused and every request in flight aborted",
    ))
}

/// `POST /areal_continue_generation`: ends the pause.
async fn areal_continue(State(state): State<AppState>) -> Result<Response, ApiError> {
    on_engine(&state, |e| e.resume()).await??;
    Ok(success("generation continues"))
}

#[derive(Deserialize)]
struct ArealUpdate {
    model_path: String,
    #[serde(default, alias = "weight_version")]
    version: Option<Value>,
}

/// `POST /areal_update_weights {"model_path": DIR}`.
async fn areal_update_weights(
    State(state): State<AppState>,
    body: Bytes,
) -> Result<Response, ApiError> {
    let body: ArealUpdate = crate::error::parse_json(&body)?;
    let version = match body.version {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(v @ Value::Number(_)) => Some(v.to_string()),
        Some(_) => {
            return Err(ApiError::invalid_param(
                "version",
                "version must be a string or a number",
            ))
        }
    };
    reload_from_disk(&state, body.model_path, version).await?;
    Ok(success("weights updated"))
}

/// `POST /collective_rpc`: refused, naming the method.
async fn collective_rpc(body: Bytes) -> ApiError {
    let method = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|v| v.get("method").and_then(Value::as_str).map(str::to_string))
        .unwrap_or_else(|| "(none given)".into());
    ApiError::invalid_param(
        "method",
        format!(
            "collective_rpc `{method}`: pdkv has no worker processes to call into; \
             reload weights with POST /update_weights {{\"path\"|\"weight_dir\"|\"model_path\": DIR}} \
             (a Hugging Face checkpoint directory or a GGUF file), or sync them from a trainer's \
             publisher with /init_weight_transfer_engine, /start_weight_update, /update_weights \
             {{\"update_info\"}} and /finish_weight_update"
        ),
    )
}
