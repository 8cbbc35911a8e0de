//! One engine request: admitting it, and the OpenAI shapes of its end (the
//! error a failed one answers with, the usage it reports). Below the
//! handlers ([`crate::routes`]), the `n` choices ([`crate::choices`]) and
//! the event streams ([`crate::sse`]), which all need them.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use pdkv_engine::{EngineRequest, SamplingParams};
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

/// One admitted engine request.
pub(crate) struct Admitted {
    pub stream: TrackedStream,
    pub created: u64,
}

pub(crate) fn admit(
    state: &AppState,
    id: String,
    prompt_tokens: Vec<u32>,
    params: SamplingParams,
    kv_transfer_params: Option<Value>,
    arrived: Instant,
) -> Result<Admitted, ApiError> {
    let num_prompt_tokens = prompt_tokens.len();
    let stream = state
        .engine()
        .add_request(EngineRequest {
            id: id.clone(),
            prompt_tokens,
            params,
            kv_transfer_params,
        })
        .map_err(ApiError::from)?;
    let stream = TrackedStream::new(stream, state.metrics().clone(), arrived, num_prompt_tokens);
    Ok(Admitted {
        stream,
        created: unix_now(),
    })
}

/// The error a request that ended with [`pdkv_engine::FinishReason::Error`] answers
/// with: a 504 `kv_transfer_timeout` when a deadline passed (the message
/// names the setting to raise), a 500 `kv_transfer_failed` otherwise.
pub(crate) fn failed_request(out: &pdkv_engine::RequestOutput) -> ApiError {
    let message = out
        .error
        .clone()
        .unwrap_or_else(|| "the request failed".into());
    if out.timed_out {
        return ApiError::timeout(message).with_code("kv_transfer_timeout");
    }
    ApiError::internal(message).with_code("kv_transfer_failed")
}

pub(crate) fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}
