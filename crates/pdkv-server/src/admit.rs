//! One engine request: admitting it, and the OpenAI shapes of its end (the
//! error a failed one answers with, the usage it reports). Below the
//! handlers ([`crate::routes`]), the `n` choices ([`crate::choices`]) and
//! the event streams ([`crate::sse`]), which all need them.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use pdkv_engine::{AddRequestError, EngineRequest, SamplingParams};
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::tracker::TrackedStream;
use crate::AppState;

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A request's prompt: its tokens and the cache salt they are hashed
/// under (vLLM's `cache_salt`: requests of different salts share no
/// prefix-cache entry).
#[derive(Clone, Debug)]
pub(crate) struct PromptIn {
    pub tokens: Vec<u32>,
    pub cache_salt: Option<String>,
}

/// Longest `cache_salt`, in bytes.
const MAX_CACHE_SALT_LEN: usize = 1024;

impl PromptIn {
    /// Checks the salt: a non-empty string of at most
    /// [`MAX_CACHE_SALT_LEN`] bytes.
    pub fn new(tokens: Vec<u32>, cache_salt: Option<String>) -> Result<PromptIn, ApiError> {
        if let Some(s) = &cache_salt {
            if s.is_empty() || s.len() > MAX_CACHE_SALT_LEN {
                return Err(ApiError::invalid_param(
                    "cache_salt",
                    format!(
                        "cache_salt must be 1 to {MAX_CACHE_SALT_LEN} bytes long, got {}",
                        s.len()
                    ),
                ));
            }
        }
        Ok(PromptIn { tokens, cache_salt })
    }
}

/// One admitted engine request.
pub(crate) struct Admitted {
    pub stream: TrackedStream,
    pub created: u64,
}

/// Admits one engine request. While the engine is paused (in any mode,
/// asleep included) the request waits for the pause to end, as vLLM holds
/// requests until `/resume`, bounded by the state's pause wait
/// ([`AppState::with_pause_wait`]): past it, a retryable 503 naming the
/// setting. A client that goes away meanwhile drops this future and with
/// it the wait.
///
/// A request with `kv_transfer_params` is refused at once instead (the
/// retryable 503): it comes from a P/D proxy or router, whose plan has an
/// answer to a paused engine (a paused P: D computes the prompt; the
/// request D then gets without KV waits here).
pub(crate) async fn admit(
    state: &AppState,
    id: String,
    prompt: PromptIn,
    params: SamplingParams,
    kv_transfer_params: Option<Value>,
    resume_token_ids: Vec<u32>,
    arrived: Instant,
) -> Result<Admitted, ApiError> {
    let num_prompt_tokens = prompt.tokens.len();
    let req = EngineRequest {
        cache_salt: prompt.cache_salt,
        id,
        prompt_tokens: prompt.tokens,
        params,
        kv_transfer_params,
        resume_token_ids,
    };
    let engine = state.engine();
    let deadline = tokio::time::Instant::now() + state.pause_wait();
    let mut waited = false;
    let stream = loop {
        // Armed before the attempt, so a resume in between is not missed.
        let changed = engine.lifecycle_changed();
        match engine.add_request(req.clone()) {
            Ok(stream) => break stream,
            Err(AddRequestError::Unavailable(reason))
                if !state.pause_wait().is_zero()
                    && req.kv_transfer_params.is_none()
                    && (engine.admission_closing()
                        || engine.lifecycle_status().paused.is_some()) =>
            {
                if !waited {
                    tracing::debug!(request_id = %req.id, %reason, "the engine is paused: the request waits for /resume");
                    waited = true;
                }
                let _waiting = WaitingForResume::new(state.metrics());
                if tokio::time::timeout_at(deadline, changed).await.is_err() {
                    return Err(ApiError::unavailable(format!(
                        "the engine stayed paused for {:.0} s (--pause-wait-timeout-s) while this request waited for /resume: {reason}",
                        state.pause_wait().as_secs_f64()
                    ))
                    .with_code(pdkv_relay::RETRYABLE_CODE));
                }
            }
            Err(e) => return Err(ApiError::from(e)),
        }
    };
    let stream = TrackedStream::new(stream, state.metrics().clone(), arrived, num_prompt_tokens);
    Ok(Admitted {
        stream,
        created: unix_now(),
    })
}

/// Counts a request in `pdkv_requests_waiting_for_resume` while alive.
struct WaitingForResume<'a>(&'a crate::Metrics);

impl<'a> WaitingForResume<'a> {
    fn new(m: &'a crate::Metrics) -> Self {
        m.waiting_for_resume(true);
        WaitingForResume(m)
    }
}

impl Drop for WaitingForResume<'_> {
    fn drop(&mut self) {
        self.0.waiting_for_resume(false);
    }
}

/// The error a request that ended with [`pdkv_engine::FinishReason::Error`] answers
/// with: a 504 `kv_transfer_timeout` when a deadline passed (the message
/// names the setting to raise), a 500 `structured_output_failed` when the
/// request's constraint failed, a 500 `kv_transfer_failed` otherwise.
pub(crate) fn failed_request(out: &pdkv_engine::RequestOutput) -> ApiError {
    let message = out
        .error
        .clone()
        .unwrap_or_else(|| "the request failed".into());
    if out.timed_out {
        return ApiError::timeout(message).with_code("kv_transfer_timeout");
    }
    if message.starts_with(pdkv_engine::constraint::FAILED) {
        return ApiError::internal(message).with_code("structured_output_failed");
    }
    ApiError::internal(message).with_code("kv_transfer_failed")
}

/// Echoes the request id in an `X-Request-Id` response header (when it is a
/// valid header value).
pub(crate) fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// A JSON body with its content type.
pub(crate) fn json_response(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

pub(crate) fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

/// Checks the shape of `kv_transfer_params` and maps a router's dialect
/// onto pdkv's keys for request `id` (the connector checks the contents
/// when the request is added).
pub(crate) fn kv_params(v: Option<Value>, id: &str) -> Result<KvIn, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(KvIn::default()),
        Some(Value::Object(mut obj)) => {
            let resume = match obj.remove(pdkv_connector::params::RESUME_TOKEN_IDS) {
                None | Some(Value::Null) => None,
                Some(v) => Some(resume_ids(&v)?),
            };
            // Only the resumed outputs: the engine computes the prompt. Any
            // other object (`{}` too) goes to the connector as before.
            let only_resume = resume.is_some() && obj.is_empty();
            let params =
                (!only_resume).then(|| pdkv_connector::params::canonical(Value::Object(obj), id));
            Ok(KvIn { params, resume })
        }
        Some(_) => Err(ApiError::invalid_param(
            "kv_transfer_params",
            "kv_transfer_params must be an object",
        )),
    }
}

/// A request's `kv_transfer_params`: those for the KV connector, and the
/// outputs to resume after (`resume_token_ids`, taken out of them).
#[derive(Default)]
pub(crate) struct KvIn {
    pub params: Option<Value>,
    /// `Some`: the request continues a stream another engine began (its
    /// opening chunks were sent), after these tokens (perhaps none).
    pub resume: Option<Vec<u32>>,
}

fn resume_ids(v: &Value) -> Result<Vec<u32>, ApiError> {
    let bad = || {
        ApiError::invalid_param(
            "kv_transfer_params.resume_token_ids",
            "kv_transfer_params.resume_token_ids must be a list of token ids",
        )
    };
    v.as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|t| {
            t.as_u64()
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(bad)
        })
        .collect()
}
