//! The lifecycle admin API an RL trainer drives between rollouts: pause,
//! resume, sleep, wake, KV-cache release, prefix-cache reset, request aborts
//! and in-place weight reloads. Paths, query parameters and bodies follow
//! vLLM's (`POST /pause?mode=keep`, `POST /wake_up?tags=weights`,
//! `GET /is_sleeping` → `{"is_sleeping":true}`, ...), so frameworks written
//! against vLLM drive pdkv unchanged.
//!
//! The RL frameworks' own dialects of the same operations (`dialects.rs`,
//! which builds on this file's helpers; the router hands its routes to
//! [`routes`] to mount behind the same token): `GET /get_world_size`, AReaL's
//! `/areal_pause_generation`, `/areal_update_weights` and
//! `/areal_continue_generation`, prime-rl's `{"weight_dir"}` body.
//!
//! Invariants:
//! - The routes exist only when the server was given an admin token or
//!   runs in dev mode ([`crate::AppState::with_dev_mode`]). With a token,
//!   every one of them checks `Authorization: Bearer <token>` (compared in
//!   time independent of where the bytes differ) before doing anything.
//! - Engine lifecycle calls block until the engine core has applied them, so
//!   handlers run them on tokio's blocking pool, never on an async worker.
//! - Parameters are read from the query string and, as several frameworks
//!   send them, from a JSON object body under the same names; repeats are
//!   allowed only where a parameter is a list (`tags`). A repeated scalar
//!   or a malformed value is a 400 naming the parameter, before the engine
//!   is touched. A parameter the route does not know is ignored with a WARN
//!   (as vLLM ignores it).

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{RawQuery, Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use pdkv_engine::{EngineHandle, LifecycleError, LifecycleStatus, PauseMode, SleepLevel};
use pdkv_model::loader::ReloadError;
use pdkv_vmem::Tag;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiJson};
use crate::AppState;

/// Default deadline of `/pause` and `/sleep` (`timeout` overrides it).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// Longest `timeout` a client may ask for.
pub const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// The admin API's shared secret.
pub struct AdminToken(Vec<u8>);

/// An admin token must not be empty (it would let anyone in).
#[derive(Debug, thiserror::Error)]
#[error("the admin token must not be empty")]
pub struct EmptyTokenError;

impl AdminToken {
    pub fn new(token: String) -> Result<AdminToken, EmptyTokenError> {
        if token.is_empty() {
            return Err(EmptyTokenError);
        }
        Ok(AdminToken(token.into_bytes()))
    }

    /// Compares `presented` with the token. The time taken depends only on
    /// the lengths, not on where the bytes first differ.
    pub fn matches(&self, presented: &[u8]) -> bool {
        let expected = &self.0;
        let mut diff = (expected.len() ^ presented.len()) as u64;
        for (i, &b) in presented.iter().enumerate() {
            // Against a byte of the token (cycled) so every byte costs the same.
            let e = expected[i % expected.len()];
            diff |= u64::from(std::hint::black_box(b ^ e));
        }
        diff == 0
    }
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AdminToken(..)")
    }
}

/// The admin routes and `beside` (the frameworks' dialects of them), each
/// behind the token check when there is a token (dev mode: open).
pub(crate) fn routes(token: Option<Arc<AdminToken>>, beside: Router<AppState>) -> Router<AppState> {
    let routes = Router::new()
        .route("/pause", post(pause))
        .route("/resume", post(resume))
        .route("/is_paused", get(is_paused))
        .route("/sleep", post(sleep))
        .route("/wake_up", post(wake_up))
        .route("/is_sleeping", get(is_sleeping))
        .route("/release_kv_cache_memory", post(release_kv_cache_memory))
        .route("/reset_prefix_cache", post(reset_prefix_cache))
        .route("/abort_requests", post(abort_requests))
        .route("/update_weights", post(update_weights))
        .route("/weight_info", get(weight_info))
        .route(
            "/init_weight_transfer_engine",
            post(init_weight_transfer_engine),
        )
        .route("/start_weight_update", post(start_weight_update))
        .route("/finish_weight_update", post(finish_weight_update))
        .merge(beside);
    match token {
        Some(token) => routes.route_layer(middleware::from_fn_with_state(token, require_token)),
        None => routes,
    }
}

/// Lets a request through only with `Authorization: Bearer <token>`.
pub(crate) async fn require_token(
    State(token): State<Arc<AdminToken>>,
    req: Request,
    next: Next,
) -> Response {
    match check_bearer(
        &token,
        &req,
        "invalid admin token",
        "the admin API needs an `Authorization: Bearer <token>` header",
    ) {
        Ok(()) => next.run(req).await,
        Err(e) => unauthorized(e),
    }
}

/// A 401 response asking for a bearer token.
pub(crate) fn unauthorized(e: ApiError) -> Response {
    let mut resp = e.into_response();
    resp.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}

/// Checks `Authorization: Bearer <secret>` against `secret`; the 401 to
/// answer otherwise, with `invalid` (a wrong secret) or `missing` (none).
pub(crate) fn check_bearer(
    secret: &AdminToken,
    req: &Request,
    invalid: &str,
    missing: &str,
) -> Result<(), ApiError> {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    match presented {
        Some(t) if secret.matches(t.as_bytes()) => Ok(()),
        Some(_) => Err(ApiError::unauthorized(invalid)),
        None => Err(ApiError::unauthorized(missing)),
    }
}

/// A parsed query string: name/value pairs in order, repeats kept.
#[derive(Debug, Default)]
pub struct QueryParams {
    pairs: Vec<(String, String)>,
}

impl QueryParams {
    /// Parses `raw` (percent-decoding, `+` as space). A parameter not in
    /// `allowed` is dropped with a WARN naming it (vLLM ignores them too).
    pub fn parse(raw: Option<&str>, allowed: &[&str]) -> Result<QueryParams, ApiError> {
        let pairs: Vec<(String, String)> = raw
            .map(|q| {
                form_urlencoded::parse(q.as_bytes())
                    .map(|(k, v)| (k.into_owned(), v.into_owned()))
                    .collect()
            })
            .unwrap_or_default();
        let mut q = QueryParams::default();
        q.extend(pairs, allowed, "query parameter");
        Ok(q)
    }

    /// [`QueryParams::parse`], then the fields of a JSON object `body` (an
    /// empty body adds none) under the same names: strings, numbers and
    /// booleans as their text, lists as repeats, nulls dropped. A body that
    /// is not a JSON object is a 400.
    pub fn parse_with_body(
        raw: Option<&str>,
        body: &[u8],
        allowed: &[&str],
    ) -> Result<QueryParams, ApiError> {
        let mut q = QueryParams::parse(raw, allowed)?;
        if body.iter().all(u8::is_ascii_whitespace) {
            return Ok(q);
        }
        let v: Value = crate::error::parse_json(body)?;
        let Value::Object(map) = v else {
            return Err(ApiError::invalid(
                "the body must be a JSON object of the route's parameters",
            ));
        };
        let mut pairs = Vec::new();
        for (k, v) in map {
            let items = match v {
                Value::Array(items) => items,
                other => vec![other],
            };
            for item in items {
                let text = match item {
                    Value::Null => continue,
                    Value::String(s) => s,
                    Value::Bool(b) => b.to_string(),
                    Value::Number(n) => n.to_string(),
                    other => {
                        return Err(ApiError::invalid_param(
                            &k,
                            format!(
                            "`{k}` must be a string, number, boolean or list of them, got {other}"
                        ),
                        ))
                    }
                };
                pairs.push((k.clone(), text));
            }
        }
        q.extend(pairs, allowed, "body field");
        Ok(q)
    }

    fn extend(&mut self, pairs: Vec<(String, String)>, allowed: &[&str], what: &str) {
        for (k, v) in pairs {
            if allowed.contains(&k.as_str()) {
                self.pairs.push((k, v));
            } else {
                tracing::warn!(
                    parameter = %k,
                    known = %allowed.join(", "),
                    "ignoring an unknown admin {what}"
                );
            }
        }
    }

    /// Every value of `name`, in order.
    pub fn all(&self, name: &str) -> Vec<&str> {
        self.pairs
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
            .collect()
    }

    /// The value of a scalar parameter; given twice is an error.
    pub fn single(&self, name: &str) -> Result<Option<&str>, ApiError> {
        match self.all(name)[..] {
            [] => Ok(None),
            [v] => Ok(Some(v)),
            _ => Err(ApiError::invalid_param(
                name,
                format!("query parameter `{name}` is given more than once"),
            )),
        }
    }

    pub fn bool(&self, name: &str, default: bool) -> Result<bool, ApiError> {
        let Some(v) = self.single(name)? else {
            return Ok(default);
        };
        match v.to_ascii_lowercase().as_str() {
            "true" | "1" => Ok(true),
            "false" | "0" => Ok(false),
            _ => Err(ApiError::invalid_param(
                name,
                format!("`{name}` must be true or false, got {v:?}"),
            )),
        }
    }

    pub fn pause_mode(&self, name: &str) -> Result<Option<PauseMode>, ApiError> {
        self.single(name)?
            .map(|v| {
                PauseMode::parse(v).ok_or_else(|| {
                    ApiError::invalid_param(
                        name,
                        format!("`{name}` must be abort, wait or keep, got {v:?}"),
                    )
                })
            })
            .transpose()
    }

    /// `timeout` in seconds (fractions allowed), within (0, [`MAX_TIMEOUT`]].
    pub fn timeout(&self) -> Result<Duration, ApiError> {
        let Some(v) = self.single("timeout")? else {
            return Ok(DEFAULT_TIMEOUT);
        };
        let bad = || {
            ApiError::invalid_param(
                "timeout",
                format!(
                    "`timeout` must be a number of seconds in (0, {}], got {v:?}",
                    MAX_TIMEOUT.as_secs()
                ),
            )
        };
        let secs: f64 = v.parse().map_err(|_| bad())?;
        if !(secs > 0.0 && secs <= MAX_TIMEOUT.as_secs_f64()) {
            return Err(bad());
        }
        Ok(Duration::from_secs_f64(secs))
    }
}

/// Runs a blocking engine call on the blocking pool.
pub(crate) async fn on_engine<T: Send + 'static>(
    state: &AppState,
    f: impl FnOnce(&EngineHandle) -> T + Send + 'static,
) -> Result<T, ApiError> {
    let engine = state.engine().clone();
    tokio::task::spawn_blocking(move || f(&engine))
        .await
        .map_err(|e| ApiError::internal(format!("the engine operation failed: {e}")))
}

/// The engine's lifecycle snapshot (published by the core; reading it does
/// not wait for the core).
pub(crate) fn lifecycle_status(state: &AppState) -> LifecycleStatus {
    state.engine().lifecycle_status()
}

fn json_ok(v: Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// `POST /pause?mode=abort|wait|keep&clear_cache=false&timeout=60`. vLLM's
/// older `wait_for_inflight_requests=true|false` is accepted in place of
/// `mode` (true = wait, false = abort).
async fn pause(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let q = QueryParams::parse_with_body(
        raw.as_deref(),
        &body,
        &[
            "mode",
            "clear_cache",
            "timeout",
            "wait_for_inflight_requests",
        ],
    )?;
    let legacy = q.single("wait_for_inflight_requests")?.is_some();
    let mode = match (q.pause_mode("mode")?, legacy) {
        (Some(_), true) => {
            return Err(ApiError::invalid_param(
                "mode",
                "give either `mode` or `wait_for_inflight_requests`, not both",
            ))
        }
        (Some(m), false) => m,
        (None, true) => {
            if q.bool("wait_for_inflight_requests", false)? {
                PauseMode::Wait
            } else {
                PauseMode::Abort
            }
        }
        (None, false) => PauseMode::Abort,
    };
    let clear_cache = q.bool("clear_cache", false)?;
    let timeout = q.timeout()?;
    on_engine(&state, move |e| e.pause(mode, clear_cache, timeout)).await??;
    Ok(json_ok(json!({"status": "paused", "mode": mode.as_str()})))
}

/// `POST /resume`.
async fn resume(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    QueryParams::parse_with_body(raw.as_deref(), &body, &[])?;
    state.cancel_checkpoint_reads("/resume");
    on_engine(&state, |e| e.resume()).await??;
    Ok(json_ok(json!({"status": "resumed"})))
}

/// `GET /is_paused`.
async fn is_paused(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    let st = lifecycle_status(&state);
    Ok(json_ok(json!({"is_paused": st.paused.is_some()})))
}

/// `POST /sleep?level=0|1|2&mode=abort|wait|keep&timeout=60` (level 1 by
/// default). Without `mode`, a sleep over a pause keeps that pause's mode
/// (an RL trainer's `pause?mode=keep` then `sleep`: frozen requests are
/// preempted and recompute after the wake, none is aborted); an engine not
/// paused is paused with `abort`.
async fn sleep(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let q =
        QueryParams::parse_with_body(raw.as_deref(), &body, &["level", "mode", "timeout", "tags"])?;
    // A sleep releases every tag whatever `tags` says (vLLM's `/sleep`
    // takes none); the names are still checked.
    parse_tags(&q)?;
    let level = match q.single("level")? {
        None => SleepLevel::L1,
        Some(v) => v
            .parse::<u32>()
            .ok()
            .and_then(SleepLevel::parse)
            .ok_or_else(|| {
                ApiError::invalid_param("level", format!("`level` must be 0, 1 or 2, got {v:?}"))
            })?,
    };
    let mode = match q.pause_mode("mode")? {
        Some(m) => m,
        None => lifecycle_status(&state).paused.unwrap_or(PauseMode::Abort),
    };
    let timeout = q.timeout()?;
    let started = Instant::now();
    let before = lifecycle_status(&state);
    on_engine(&state, move |e| e.sleep(level, mode, timeout)).await??;
    if level != SleepLevel::L0 {
        // What weight syncs keep between them goes with the rest.
        state.weight_sync().release_memory();
    }
    state
        .metrics()
        .observe_sleep(started.elapsed().as_secs_f64());
    let after = lifecycle_status(&state);
    Ok(json_ok(sleep_answer(&before, &after)))
}

/// The answer to a sleep: the level the engine sleeps at now (a sleep
/// never gets lighter: level 1 over level 2 stays level 2), whether its
/// weights are discarded, and, when level 2 came over level 1, that the
/// weights' host backup was dropped with them.
fn sleep_answer(before: &LifecycleStatus, after: &LifecycleStatus) -> Value {
    let level = after.sleeping.map(|l| l.as_u32());
    let mut v = json!({
        "status": "sleeping",
        "level": level,
        "weights_discarded": after.weights_discarded,
    });
    if before.sleeping == Some(SleepLevel::L1) && after.sleeping == Some(SleepLevel::L2) {
        v["detail"] = json!(
            "level 2 over level 1: the weights' host backup was discarded; after /wake_up, load weights (/update_weights) before serving"
        );
    }
    v
}

/// `POST /wake_up[?tags=weights&tags=kv_cache]`: wakes the given tags, or
/// everything without `tags`. Waking what is awake changes nothing.
async fn wake_up(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let q = QueryParams::parse_with_body(raw.as_deref(), &body, &["tags"])?;
    let tags = parse_tags(&q)?;
    let started = Instant::now();
    let status = on_engine(&state, move |e| {
        e.wake_up(tags.as_deref()).map(|()| e.lifecycle_status())
    })
    .await??;
    state
        .metrics()
        .observe_wake(started.elapsed().as_secs_f64());
    let asleep: Vec<&str> = status.asleep_tags.iter().map(|t| t.as_str()).collect();
    Ok(json_ok(json!({
        "status": if status.sleeping.is_some() { "sleeping" } else { "awake" },
        "is_sleeping": status.sleeping.is_some(),
        "asleep_tags": asleep,
        "weights_discarded": status.weights_discarded,
    })))
}

/// The `tags` parameter: `None` when absent (everything).
fn parse_tags(q: &QueryParams) -> Result<Option<Vec<Tag>>, ApiError> {
    let names = q.all("tags");
    if names.is_empty() {
        return Ok(None);
    }
    let mut tags = Vec::with_capacity(names.len());
    for name in names {
        let tag = Tag::parse(name).ok_or_else(|| {
            let known: Vec<&str> = Tag::ALL.iter().map(|t| t.as_str()).collect();
            ApiError::invalid_param(
                "tags",
                format!("unknown tag {name:?} (known: {})", known.join(", ")),
            )
        })?;
        if !tags.contains(&tag) {
            tags.push(tag);
        }
    }
    Ok(Some(tags))
}

/// `GET /is_sleeping`.
async fn is_sleeping(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    let st = lifecycle_status(&state);
    // vLLM's field, then what a client needs to know what a wake brings
    // back: the level, and whether the weights must be loaded again.
    Ok(json_ok(json!({
        "is_sleeping": st.sleeping.is_some(),
        "level": st.sleeping.map(|l| l.as_u32()),
        "weights_discarded": st.weights_discarded,
    })))
}

/// `POST /release_kv_cache_memory`: needs a completed pause (409 otherwise).
async fn release_kv_cache_memory(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    QueryParams::parse_with_body(raw.as_deref(), &body, &[])?;
    on_engine(&state, |e| e.release_kv_cache_memory()).await??;
    Ok(json_ok(json!({"status": "released"})))
}

/// `POST /reset_prefix_cache?reset_running_requests=false&reset_external=false`
/// → `{"success":bool}` (false when the cache cannot be reset now);
/// `reset_external` empties the KV connector's cache too (a host offload
/// store), as in vLLM.
async fn reset_prefix_cache(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    let q = QueryParams::parse_with_body(
        raw.as_deref(),
        &body,
        &["reset_running_requests", "reset_external"],
    )?;
    let reset_running = q.bool("reset_running_requests", false)?;
    let reset_external = q.bool("reset_external", false)?;
    let success = on_engine(&state, move |e| {
        e.reset_prefix_cache_with(reset_running, reset_external)
    })
    .await?;
    Ok(json_ok(json!({"success": success})))
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct AbortRequestsBody {
    #[serde(default)]
    request_ids: Option<Vec<String>>,
}

/// `POST /abort_requests {"request_ids":[...]}` → `{"aborted":[...],
/// "num_aborted": N}`, the ids that named a live request (an id as its
/// client sees it ends every engine request that runs it: see
/// [`crate::ids::runs`]). No body, `{}`, or an empty
/// list aborts every live request; any other field is a 400 (a misspelt
/// list must not abort everything).
async fn abort_requests(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: Bytes,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    let body: AbortRequestsBody = if body.iter().all(u8::is_ascii_whitespace) {
        AbortRequestsBody::default()
    } else {
        crate::error::parse_json(&body)?
    };
    state.cancel_checkpoint_reads("/abort_requests");
    let live = state.engine().live_request_ids();
    let ids = match body.request_ids {
        Some(ids) if !ids.is_empty() => ids,
        _ => live.clone(),
    };
    // An id a client sees names every engine request that runs it: its
    // choices, its prompts, and a client-chosen id in every client's scope.
    let engine_ids: Vec<String> = live
        .into_iter()
        .filter(|e| ids.iter().any(|shown| crate::ids::runs(e, shown)))
        .collect();
    let ended = on_engine(&state, move |e| e.abort_requests(&engine_ids)).await?;
    let aborted: Vec<String> = ids
        .into_iter()
        .filter(|shown| ended.iter().any(|e| crate::ids::runs(e, shown)))
        .collect();
    Ok(json_ok(
        json!({"num_aborted": aborted.len(), "aborted": aborted}),
    ))
}

#[derive(Debug, Deserialize)]
struct UpdateWeightsBody {
    /// A `.gguf` file or a Hugging Face checkpoint directory (SGLang and
    /// AReaL call it `model_path`, prime-rl `weight_dir`).
    #[serde(alias = "model_path", alias = "weight_dir")]
    path: String,
    #[serde(alias = "weight_version")]
    version: Option<String>,
}

/// `POST /update_weights {"path":"...","version":"..."}` (or `model_path`,
/// `weight_dir`): reloads weights in place. A checkpoint that does not fit
/// the model is a 400 and the old weights keep serving.
///
/// With `{"update_info": {...}}` instead, one chunk of a weight sync (see
/// [`crate::weight_sync`]).
async fn update_weights(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    if let Some(info) = body.get("update_info") {
        return Ok(json_ok(state.weight_sync().update(info).await?));
    }
    // A reload from disk; parsed again so a bad field is named in `param`.
    let bytes = serde_json::to_vec(&body).map_err(|e| ApiError::internal(e.to_string()))?;
    let body: UpdateWeightsBody = crate::error::parse_json(&bytes)?;
    let version = body.version.clone();
    reload_from_disk(&state, body.path, body.version).await?;
    Ok(json_ok(json!({"status": "ok", "version": version})))
}

/// Reloads the checkpoint at `path` in place, as `version`. On an engine
/// that is not paused, requests in flight are frozen for the reload (a
/// `keep` pause) and continue with the new weights afterwards, as a
/// trainer that updates between two steps of its rollouts expects; an
/// engine already paused stays as its pause left it.
pub(crate) async fn reload_from_disk(
    state: &AppState,
    path: String,
    version: Option<String>,
) -> Result<(), ApiError> {
    if path.is_empty() {
        return Err(ApiError::invalid_param("path", "`path` must not be empty"));
    }
    let path = std::path::PathBuf::from(path);
    let started = Instant::now();
    // The newest update wins: one still reading is cancelled.
    state.cancel_checkpoint_reads("another /update_weights");
    let staged = stage_checkpoint(state, &path).await?;
    let v = version.clone();
    on_engine(state, move |e| {
        let load = move || match staged {
            Some(weights) => e.install_weights(weights, path.display().to_string(), v),
            None => e.update_weights(&path, v),
        };
        if e.lifecycle_status().paused.is_some() {
            return load();
        }
        e.pause(PauseMode::Keep, false, DEFAULT_TIMEOUT)?;
        let updated = load();
        let resumed = e.resume();
        updated.and(resumed)
    })
    .await??;
    tracing::info!(version = ?version, secs = started.elapsed().as_secs_f64(), "weights updated");
    Ok(())
}

/// Reads the checkpoint at `path` into memory laid out as the running
/// weights ([`pdkv_model::loader::stage_checkpoint`]) off the engine's
/// thread and bounded by the state's checkpoint read timeout
/// ([`bounded_read`]): the engine keeps serving its current weights while
/// the files are read, and a read that stalls (a hung network filesystem)
/// is a 504. `None`: the model takes no staged weights, and its core reads
/// the checkpoint.
async fn stage_checkpoint(
    state: &AppState,
    path: &std::path::Path,
) -> Result<Option<Arc<pdkv_model::weights::Weights>>, ApiError> {
    let Some(layout) = state.engine().weights_layout().cloned() else {
        return Ok(None);
    };
    let expected = state.engine().model_config().clone();
    let p = path.to_path_buf();
    let limit = state.checkpoint_read_timeout;
    let read = move || pdkv_model::loader::stage_checkpoint(&p, &layout, &expected);
    let cancel = state.checkpoint_cancel.subscribe();
    let staged = match bounded_read(&state.checkpoint_reads, limit, cancel, read).await {
        Ok(staged) => staged,
        Err(ReadRefused::Busy) => {
            return Err(ApiError::conflict(
                "another checkpoint read is still running (one that stalled past its deadline counts until it ends); the engine keeps serving its current weights",
            ))
        }
        Err(ReadRefused::TimedOut) => {
            tracing::warn!(path = %path.display(), ?limit, "reading a checkpoint stalled past its deadline; the engine keeps its current weights");
            return Err(ApiError::timeout(format!(
                "reading checkpoint {} did not finish within {} s; the engine keeps serving its current weights",
                path.display(),
                limit.as_secs_f64()
            )));
        }
        Err(ReadRefused::Cancelled(by)) => {
            tracing::info!(path = %path.display(), by, "a checkpoint read was cancelled; the engine keeps its current weights");
            return Err(ApiError::conflict(format!(
                "reading checkpoint {} was cancelled by {by}; the engine keeps serving its current weights",
                path.display()
            ))
            .with_code("checkpoint_read_cancelled"));
        }
        Err(ReadRefused::Panicked(e)) => {
            return Err(ApiError::internal(format!(
                "reading the checkpoint failed: {e}"
            )))
        }
    };
    let staged = staged.map_err(|e| {
        ApiError::from(match e {
            ReloadError::Incompatible(e) => LifecycleError::IncompatibleWeights(format!("{e:#}")),
            ReloadError::Unreadable(e) => LifecycleError::Invalid(format!("{e:#}")),
            e => LifecycleError::Internal(format!("{e:#}")),
        })
    })?;
    Ok(Some(Arc::new(staged)))
}

/// Why [`bounded_read`] gave no result.
#[derive(Debug)]
enum ReadRefused {
    /// Another read holds the one permit (it may have stalled).
    Busy,
    /// The read did not end by its deadline; its thread goes on alone.
    TimedOut,
    /// Cancelled by what is named (its thread goes on alone).
    Cancelled(&'static str),
    Panicked(String),
}

/// Runs the blocking `read` on its own thread, one at a time (`reads` has
/// one permit), waiting at most `limit` for it and until `cancel` changes.
/// A read past its deadline or cancelled is left to end on its own and
/// keeps the permit until it does: a stalled filesystem costs one thread,
/// not one per retry.
async fn bounded_read<T: Send + 'static>(
    reads: &Arc<tokio::sync::Semaphore>,
    limit: Duration,
    mut cancel: tokio::sync::watch::Receiver<(u64, &'static str)>,
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ReadRefused> {
    let Ok(permit) = reads.clone().try_acquire_owned() else {
        return Err(ReadRefused::Busy);
    };
    let task = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        read()
    });
    tokio::select! {
        joined = tokio::time::timeout(limit, task) => match joined {
            Err(_) => Err(ReadRefused::TimedOut),
            Ok(joined) => joined.map_err(|e| ReadRefused::Panicked(e.to_string())),
        },
        // A sender dropped (the server is gone) cancels too.
        _ = cancel.changed() => Err(ReadRefused::Cancelled(cancel.borrow().1)),
    }
}

/// `POST /init_weight_transfer_engine {"init_info": {"backend": "pdkv",
/// "url": ...}}`.
async fn init_weight_transfer_engine(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    ApiJson(body): ApiJson<Value>,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    Ok(json_ok(state.weight_sync().init(body).await?))
}

/// `POST /start_weight_update` (vLLM's `is_checkpoint_format` is accepted:
/// the tensors are always in the engine's own storage format).
async fn start_weight_update(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    if !body.is_empty() {
        let v: Value = crate::error::parse_json(&body)?;
        if let Some(k) = v
            .as_object()
            .and_then(|o| o.keys().find(|k| *k != "is_checkpoint_format"))
        {
            return Err(ApiError::invalid_param(
                k,
                format!("start_weight_update takes no `{k}`"),
            ));
        }
    }
    let layout = state.engine().weights_layout().cloned();
    Ok(json_ok(state.weight_sync().start(layout.as_ref()).await?))
}

/// `POST /finish_weight_update {"version": "..."}`: installs the synced
/// weights in one switch; the version (the body's, else the manifest's)
/// becomes live.
async fn finish_weight_update(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
    body: axum::body::Bytes,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    let version = if body.is_empty() {
        None
    } else {
        let v: Value = crate::error::parse_json(&body)?;
        match v.get("version").or_else(|| v.get("weight_version")) {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.clone()),
            Some(_) => {
                return Err(ApiError::invalid_param(
                    "version",
                    "version must be a string",
                ))
            }
        }
    };
    let sync = state.weight_sync().clone();
    let f = sync.finish().await?;
    let version = version.or_else(|| f.version.clone());
    let (weights, origin, v2) = (f.weights.clone(), f.origin.clone(), version.clone());
    let t0 = std::time::Instant::now();
    let r = on_engine(&state, move |e| e.install_weights(weights, origin, v2)).await?;
    let secs = t0.elapsed().as_secs_f64();
    let bytes = f.bytes;
    let pull_secs = f.pull_secs;
    sync.finished(f, r.is_ok(), secs);
    r?;
    tracing::info!(version = ?version, bytes, pull_secs, switch_secs = secs, "synced weights are live");
    Ok(json_ok(
        json!({"status": "ok", "version": version, "bytes": bytes, "pull_seconds": pull_secs, "switch_seconds": secs}),
    ))
}

/// `GET /weight_info` → `{"version":..,"weight_version":..,"path":..}`
/// (`weight_version` as vLLM's RLHF router reads it).
async fn weight_info(
    State(state): State<AppState>,
    RawQuery(raw): RawQuery,
) -> Result<Response, ApiError> {
    QueryParams::parse(raw.as_deref(), &[])?;
    let info = on_engine(&state, |e| e.weight_info()).await?;
    Ok(json_ok(json!({
        "version": info.version,
        "weight_version": info.version,
        "path": info.path.display().to_string(),
    })))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::StatusCode;

    /// A read that stalls ends in `TimedOut` by its deadline; while it
    /// stalls, another read is refused (one thread per stalled filesystem,
    /// not one per retry); once it ends, reads run again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_read_times_out_and_holds_the_one_permit_until_it_ends() {
        let reads = Arc::new(tokio::sync::Semaphore::new(1));
        let (_cancel, rx) = tokio::sync::watch::channel((0u64, ""));
        let (release, stalled) = std::sync::mpsc::channel::<()>();
        let (ended_tx, ended) = tokio::sync::oneshot::channel();
        let limit = Duration::from_millis(50);
        let r = bounded_read(&reads, limit, rx.clone(), move || {
            // Stands for a read() that does not return until released.
            stalled.recv().unwrap();
            ended_tx.send(()).unwrap();
        })
        .await;
        assert!(matches!(r, Err(ReadRefused::TimedOut)), "{r:?}");
        let r = bounded_read(&reads, limit, rx.clone(), || 1).await;
        assert!(matches!(r, Err(ReadRefused::Busy)), "{r:?}");
        release.send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), ended)
            .await
            .expect("the released read ends")
            .unwrap();
        // The permit goes back when the thread's closure returns; wait for it.
        let permit = tokio::time::timeout(Duration::from_secs(10), reads.acquire())
            .await
            .expect("the permit comes back");
        drop(permit);
        assert_eq!(bounded_read(&reads, limit, rx, || 7).await.unwrap(), 7);
    }

    /// A read that stalls is cancelled at once by what is named (its
    /// thread goes on and keeps the permit until it ends).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stalled_read_is_cancelled_by_name() {
        let reads = Arc::new(tokio::sync::Semaphore::new(1));
        let (cancel, rx) = tokio::sync::watch::channel((0u64, ""));
        let (release, stalled) = std::sync::mpsc::channel::<()>();
        let read = bounded_read(&reads, Duration::from_secs(3600), rx, move || {
            stalled.recv().unwrap();
        });
        let canceller = async {
            // Once the read holds the permit, cancel it.
            while reads.available_permits() > 0 {
                tokio::task::yield_now().await;
            }
            cancel.send_modify(|(n, why)| {
                *n += 1;
                *why = "/resume";
            });
        };
        let (r, ()) = tokio::time::timeout(Duration::from_secs(10), async {
            tokio::join!(read, canceller)
        })
        .await
        .expect("the cancelled read answers at once");
        assert!(matches!(r, Err(ReadRefused::Cancelled("/resume"))), "{r:?}");
        assert_eq!(reads.available_permits(), 0, "the thread still reads");
        release.send(()).unwrap();
    }

    #[test]
    fn token_compare() {
        let t = AdminToken::new("s3cret".into()).unwrap();
        assert!(t.matches(b"s3cret"));
        for bad in [
            &b""[..],
            b"s3cre",
            b"s3cret!",
            b"S3cret",
            b"s3cres",
            b"xxxxxx",
        ] {
            assert!(!t.matches(bad), "{:?}", String::from_utf8_lossy(bad));
        }
        assert!(AdminToken::new(String::new()).is_err());
    }

    #[test]
    fn query_repeats_and_decoding() {
        let q = QueryParams::parse(
            Some("tags=weights&tags=kv%5Fcache&mode=a+b"),
            &["tags", "mode"],
        )
        .unwrap();
        assert_eq!(q.all("tags"), vec!["weights", "kv_cache"]);
        assert_eq!(q.single("mode").unwrap(), Some("a b"));
        assert_eq!(q.single("tags").unwrap_err().param.as_deref(), Some("tags"));
        assert_eq!(q.single("absent").unwrap(), None);
        // An unknown parameter is dropped (with a WARN), as vLLM ignores it.
        let unknown = QueryParams::parse(Some("levle=2&level=1"), &["level"]).unwrap();
        assert_eq!(unknown.all("levle"), Vec::<&str>::new());
        assert_eq!(unknown.single("level").unwrap(), Some("1"));
        // Body fields join the query's under the same names.
        let q = QueryParams::parse_with_body(
            Some("mode=keep"),
            br#"{"tags": ["weights", "kv_cache"], "level": 2, "odd": {"x": 1}}"#,
            &["mode", "tags", "level"],
        );
        assert_eq!(q.unwrap_err().param.as_deref(), Some("odd"));
        let q = QueryParams::parse_with_body(
            Some("mode=keep"),
            br#"{"tags": ["weights", "kv_cache"], "level": 2, "clear": null}"#,
            &["mode", "tags", "level"],
        )
        .unwrap();
        assert_eq!(q.all("tags"), vec!["weights", "kv_cache"]);
        assert_eq!(q.single("level").unwrap(), Some("2"));
        assert_eq!(q.single("mode").unwrap(), Some("keep"));
        let both = QueryParams::parse_with_body(Some("level=1"), br#"{"level": 2}"#, &["level"]);
        assert!(
            both.unwrap().single("level").is_err(),
            "a scalar given twice"
        );
        let not_object = QueryParams::parse_with_body(None, b"[1]", &["level"]).unwrap_err();
        assert_eq!(not_object.status, StatusCode::BAD_REQUEST);
        assert!(QueryParams::parse_with_body(None, b"  ", &[]).is_ok());
        assert!(QueryParams::parse(None, &[]).unwrap().all("x").is_empty());
    }

    #[test]
    fn query_values() {
        let q = QueryParams::parse(
            Some("a=TRUE&b=0&c=maybe&timeout=2.5"),
            &["a", "b", "c", "timeout"],
        )
        .unwrap();
        assert!(q.bool("a", false).unwrap());
        assert!(!q.bool("b", true).unwrap());
        assert!(q.bool("d", true).unwrap());
        assert_eq!(q.bool("c", false).unwrap_err().param.as_deref(), Some("c"));
        assert_eq!(q.timeout().unwrap(), Duration::from_millis(2500));
        for bad in ["0", "-1", "nan", "inf", "x", "7200"] {
            let q = QueryParams::parse(Some(&format!("timeout={bad}")), &["timeout"]).unwrap();
            assert_eq!(
                q.timeout().unwrap_err().param.as_deref(),
                Some("timeout"),
                "{bad}"
            );
        }
        assert_eq!(QueryParams::default().timeout().unwrap(), DEFAULT_TIMEOUT);
        let q = QueryParams::parse(Some("mode=keep&m2=pause"), &["mode", "m2"]).unwrap();
        assert_eq!(q.pause_mode("mode").unwrap(), Some(PauseMode::Keep));
        assert_eq!(q.pause_mode("m2").unwrap_err().param.as_deref(), Some("m2"));
    }
}
