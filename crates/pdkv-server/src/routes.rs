//! Request handlers: the OpenAI endpoints, health, models and metrics.

use std::convert::Infallible;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::Stream;
use pdkv_engine::{EngineRequest, FinishReason, SamplingParams};
use pdkv_model::ChatMessage;
use serde_json::{json, Value};

use crate::error::{ApiError, ApiJson};
use crate::metrics::LifecycleGauges;
use crate::openai::{
    message_text, parse_max_tokens, parse_prompt, ChatRequest, CompletionRequest, Endpoint, Prompt,
    DEFAULT_COMPLETION_MAX_TOKENS,
};
use crate::tracker::TrackedStream;
use crate::AppState;

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn check_model(state: &AppState, model: Option<&str>) -> Result<(), ApiError> {
    match model {
        Some(m) if m != state.served_model_name() => Err(ApiError::model_not_found(m)),
        _ => Ok(()),
    }
}

/// Runs CPU-heavy prompt preparation (tokenization, templates) off the
/// async workers.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T, ApiError> + Send + 'static) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .unwrap_or_else(|e| Err(ApiError::internal(format!("prompt preparation failed: {e}"))))
}

/// Validates token ids against the vocabulary.
fn check_token_ids(state: &AppState, ids: &[u32]) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::invalid_param("prompt", "prompt must not be empty"));
    }
    let vocab = state.engine().model_config().vocab_size;
    if let Some(bad) = ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "prompt",
            format!("token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

/// Validates the token ids of `logit_bias` and `stop_token_ids` against the
/// vocabulary, naming the field (the engine checks them too, without one).
fn check_sampling_ids(state: &AppState, params: &SamplingParams) -> Result<(), ApiError> {
    let vocab = state.engine().model_config().vocab_size;
    if let Some((bad, _)) = params.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "logit_bias",
            format!("logit_bias token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    if let Some(bad) = params.stop_token_ids.iter().find(|&&t| t as usize >= vocab) {
        return Err(ApiError::invalid_param(
            "stop_token_ids",
            format!("stop token id {bad} is out of range for a vocabulary of {vocab}"),
        ));
    }
    Ok(())
}

/// Longest client-chosen request id, in bytes.
const MAX_REQUEST_ID_LEN: usize = 256;

/// The engine id of a new request: the client's `X-Request-Id` header, else
/// its `request_id` body field, else a fresh `{prefix}<hex>` id. The same id
/// is the response's `id`, so `/abort_requests` can name the request.
fn choose_request_id(
    state: &AppState,
    headers: &HeaderMap,
    body_id: Option<&str>,
    prefix: &str,
) -> Result<String, ApiError> {
    let (param, given) = match headers.get("x-request-id") {
        Some(v) => {
            let v = v
                .to_str()
                .map_err(|_| ApiError::invalid_param("X-Request-Id", "X-Request-Id must be visible ASCII"))?;
            ("X-Request-Id", Some(v))
        }
        None => ("request_id", body_id),
    };
    let Some(id) = given else { return Ok(state.next_request_id(prefix)) };
    if id.is_empty() || id.len() > MAX_REQUEST_ID_LEN {
        return Err(ApiError::invalid_param(
            param,
            format!("{param} must be 1 to {MAX_REQUEST_ID_LEN} bytes long, got {}", id.len()),
        ));
    }
    if id.chars().any(char::is_control) {
        return Err(ApiError::invalid_param(param, format!("{param} must not contain control characters")));
    }
    Ok(id.to_string())
}

/// Echoes the request id in an `X-Request-Id` response header (when it is a
/// valid header value).
fn with_request_id(mut resp: Response, id: &str) -> Response {
    if let Ok(v) = HeaderValue::from_str(id) {
        resp.headers_mut().insert("x-request-id", v);
    }
    resp
}

/// What a generation endpoint needs to answer, in either shape.
struct Admitted {
    stream: TrackedStream,
    num_prompt_tokens: usize,
    id: String,
    created: u64,
}

/// Checks the shape of `kv_transfer_params` (the connector checks its
/// contents when the request is added).
fn kv_params(v: Option<Value>) -> Result<Option<Value>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v @ Value::Object(_)) => Ok(Some(v)),
        Some(_) => Err(ApiError::invalid_param("kv_transfer_params", "kv_transfer_params must be an object")),
    }
}

fn admit(
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
        .add_request(EngineRequest { id: id.clone(), prompt_tokens, params, kv_transfer_params })
        .map_err(ApiError::from)?;
    let stream = TrackedStream::new(stream, state.metrics().clone(), arrived, num_prompt_tokens);
    Ok(Admitted { stream, num_prompt_tokens, id, created: unix_now() })
}

/// The whole generation of a non-streaming request.
struct Collected {
    text: String,
    finish_reason: FinishReason,
    completion_tokens: usize,
    kv_transfer_params: Option<Value>,
}

/// The error a request that ended with [`FinishReason::Error`] answers with.
fn failed_request(message: Option<String>) -> ApiError {
    let message = message.unwrap_or_else(|| "the request failed".into());
    ApiError::internal(message).with_code("kv_transfer_failed")
}

/// Collects a whole generation; a request that failed becomes its error.
async fn collect(stream: &mut TrackedStream) -> Result<Collected, ApiError> {
    let mut text = String::new();
    let mut finish_reason = FinishReason::Abort;
    let mut kv_transfer_params = None;
    while let Some(out) = stream.next().await {
        text.push_str(&out.text);
        if let Some(r) = out.finish_reason {
            finish_reason = r;
            kv_transfer_params = out.kv_transfer_params;
            if r == FinishReason::Error {
                return Err(failed_request(out.error));
            }
        }
    }
    Ok(Collected { text, finish_reason, completion_tokens: stream.generated(), kv_transfer_params })
}

fn usage_json(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion})
}

fn json_response(v: &Value) -> Response {
    ([(header::CONTENT_TYPE, "application/json")], v.to_string()).into_response()
}

/// `POST /v1/completions`.
pub async fn completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<CompletionRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    check_model(&state, req.model.as_deref())?;
    let id = choose_request_id(&state, &headers, req.request_id.as_deref(), "cmpl-")?;
    if req.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "echo is not supported"));
    }
    if req.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "suffix is not supported"));
    }
    let max_tokens = parse_max_tokens("max_tokens", req.max_tokens)?.unwrap_or(DEFAULT_COMPLETION_MAX_TOKENS);
    let params = req.sampling().to_params(max_tokens, Endpoint::Completions)?;
    check_sampling_ids(&state, &params)?;
    let prompt_tokens = match parse_prompt(&req.prompt)? {
        Prompt::Tokens(ids) => ids,
        Prompt::Text(text) => {
            let tok = state.engine().tokenizer().clone();
            blocking(move || {
                tok.encode(&text, true)
                    .map_err(|e| ApiError::invalid_param("prompt", format!("could not tokenize the prompt: {e:#}")))
            })
            .await?
        }
    };
    check_token_ids(&state, &prompt_tokens)?;
    let kv = kv_params(req.kv_transfer_params)?;
    let mut admitted = admit(&state, id, prompt_tokens, params, kv, arrived)?;
    let model = state.served_model_name().to_string();

    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let (id, created) = (admitted.id.clone(), admitted.created);
        let head = ChunkHead { object: "text_completion", model: model.clone() };
        let chunk = move |text: &str, finish: Option<FinishReason>, usage: bool| {
            let mut v = json!({
                "id": id, "object": "text_completion", "created": created, "model": model,
                "choices": [{"index": 0, "text": text, "logprobs": null, "finish_reason": finish.map(FinishReason::as_str)}],
            });
            if usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let id = admitted.id.clone();
        return Ok(with_request_id(sse_response(admitted, head, include_usage, None, chunk), &id));
    }

    let done = collect(&mut admitted.stream).await?;
    let resp = json_response(&json!({
        "id": admitted.id,
        "object": "text_completion",
        "created": admitted.created,
        "model": model,
        "choices": [{"index": 0, "text": done.text, "logprobs": null, "finish_reason": done.finish_reason.as_str()}],
        "usage": usage_json(admitted.num_prompt_tokens, done.completion_tokens),
        "kv_transfer_params": done.kv_transfer_params,
    }));
    Ok(with_request_id(resp, &admitted.id))
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(state): State<AppState>,
    headers: HeaderMap,
    ApiJson(req): ApiJson<ChatRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    check_model(&state, req.model.as_deref())?;
    let id = choose_request_id(&state, &headers, req.request_id.as_deref(), "chatcmpl-")?;
    if req.messages.is_empty() {
        return Err(ApiError::invalid_param("messages", "messages must not be empty"));
    }
    if state.engine().chat_template().is_none() {
        return Err(ApiError::invalid_param(
            "messages",
            "this model has no chat template; use /v1/completions with a plain prompt",
        )
        .with_code("no_chat_template"));
    }
    let messages = req
        .messages
        .iter()
        .enumerate()
        .map(|(i, m)| Ok(ChatMessage { role: m.role.clone(), content: message_text(i, &m.content)? }))
        .collect::<Result<Vec<_>, ApiError>>()?;
    let max_tokens = match parse_max_tokens("max_completion_tokens", req.max_completion_tokens)? {
        Some(n) => Some(n),
        None => parse_max_tokens("max_tokens", req.max_tokens)?,
    };
    if req.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "echo is not supported on chat completions"));
    }
    // Validate sampling fields before the (costly) template and tokenizer
    // (`max_tokens` is settled below once the prompt's length is known).
    let mut params = req.sampling().to_params(max_tokens.unwrap_or(u32::MAX), Endpoint::Chat)?;
    check_sampling_ids(&state, &params)?;

    let engine = state.engine().clone();
    let prompt_tokens = blocking(move || {
        let template = engine
            .chat_template()
            .ok_or_else(|| ApiError::invalid_param("messages", "this model has no chat template"))?;
        let text = template
            .render(&messages, true)
            .map_err(|e| ApiError::invalid_param("messages", format!("could not apply the chat template: {e:#}")))?;
        // The template already placed BOS and other special tokens.
        engine
            .tokenizer()
            .encode(&text, false)
            .map_err(|e| ApiError::invalid_param("messages", format!("could not tokenize the conversation: {e:#}")))
    })
    .await?;
    check_token_ids(&state, &prompt_tokens)?;
    // Without a limit a chat reply may use the rest of the context.
    params.max_tokens = match max_tokens {
        Some(n) => n,
        None => {
            let room = state.engine().max_model_len().saturating_sub(prompt_tokens.len());
            u32::try_from(room.max(1)).unwrap_or(u32::MAX)
        }
    };
    let kv = kv_params(req.kv_transfer_params)?;
    let mut admitted = admit(&state, id, prompt_tokens, params, kv, arrived)?;
    let model = state.served_model_name().to_string();

    if req.stream.unwrap_or(false) {
        let include_usage = req.stream_options.is_some_and(|o| o.include_usage);
        let (id, created) = (admitted.id.clone(), admitted.created);
        let head = ChunkHead { object: "chat.completion.chunk", model: model.clone() };
        let base = json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
        let first = {
            let mut v = base.clone();
            v["choices"] = json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}]);
            if include_usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let chunk = move |text: &str, finish: Option<FinishReason>, usage: bool| {
            let mut v = base.clone();
            let delta = if text.is_empty() { json!({}) } else { json!({"content": text}) };
            v["choices"] = json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish.map(FinishReason::as_str)}]);
            if usage {
                v["usage"] = Value::Null;
            }
            v
        };
        let id = admitted.id.clone();
        return Ok(with_request_id(sse_response(admitted, head, include_usage, Some(first), chunk), &id));
    }

    let done = collect(&mut admitted.stream).await?;
    let resp = json_response(&json!({
        "id": admitted.id,
        "object": "chat.completion",
        "created": admitted.created,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": done.text},
            "logprobs": null,
            "finish_reason": done.finish_reason.as_str(),
        }],
        "usage": usage_json(admitted.num_prompt_tokens, done.completion_tokens),
        "kv_transfer_params": done.kv_transfer_params,
    }));
    Ok(with_request_id(resp, &admitted.id))
}

/// Where a server-sent-event stream is.
enum Phase {
    /// The optional opening chunk is still to be sent.
    Start,
    Generating,
    /// The final chunk went out; usage and `[DONE]` remain.
    Tail,
    Done,
}

struct SseState<F> {
    stream: TrackedStream,
    num_prompt_tokens: usize,
    include_usage: bool,
    first: Option<Value>,
    chunk: F,
    phase: Phase,
    id: String,
    created: u64,
    object: &'static str,
    model: String,
}

fn sse_event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

impl<F: FnMut(&str, Option<FinishReason>, bool) -> Value> SseState<F> {
    /// The next piece of the body, or `None` at the end.
    async fn step(&mut self) -> Option<String> {
        loop {
            match self.phase {
                Phase::Start => {
                    self.phase = Phase::Generating;
                    if let Some(first) = self.first.take() {
                        return Some(sse_event(&first));
                    }
                }
                Phase::Generating => {
                    let (text, finish) = match self.stream.next().await {
                        Some(out) if out.finish_reason == Some(FinishReason::Error) => {
                            // A failed request: an error event, then `[DONE]`.
                            self.phase = Phase::Done;
                            let err = failed_request(out.error);
                            return Some(format!("data: {}\n\ndata: [DONE]\n\n", err.body_json()));
                        }
                        Some(out) => (out.text, out.finish_reason),
                        // The engine ended the stream without a final output.
                        None => (String::new(), Some(FinishReason::Abort)),
                    };
                    if finish.is_none() && text.is_empty() {
                        continue;
                    }
                    if finish.is_some() {
                        self.phase = Phase::Tail;
                    }
                    return Some(sse_event(&(self.chunk)(&text, finish, self.include_usage)));
                }
                Phase::Tail => {
                    self.phase = Phase::Done;
                    let mut out = String::new();
                    if self.include_usage {
                        out.push_str(&sse_event(&json!({
                            "id": self.id, "object": self.object, "created": self.created, "model": self.model,
                            "choices": [],
                            "usage": usage_json(self.num_prompt_tokens, self.stream.generated()),
                        })));
                    }
                    out.push_str("data: [DONE]\n\n");
                    return Some(out);
                }
                Phase::Done => return None,
            }
        }
    }
}

/// A `text/event-stream` response that owns the request's stream: when the
/// client disconnects, hyper drops the body and with it the request.
fn sse_response<F>(admitted: Admitted, head: ChunkHead, include_usage: bool, first: Option<Value>, chunk: F) -> Response
where
    F: FnMut(&str, Option<FinishReason>, bool) -> Value + Send + 'static,
{
    let ChunkHead { object, model } = head;
    let state = SseState {
        stream: admitted.stream,
        num_prompt_tokens: admitted.num_prompt_tokens,
        include_usage,
        first,
        chunk,
        phase: Phase::Start,
        id: admitted.id,
        created: admitted.created,
        object,
        model,
    };
    let body = futures::stream::unfold(state, |mut st| async move {
        let piece = st.step().await?;
        Some((Ok::<_, Infallible>(Bytes::from(piece)), st))
    });
    sse_body(body)
}

/// The fields of a stream's final usage chunk besides id and time.
struct ChunkHead {
    object: &'static str,
    model: String,
}

fn sse_body<S>(body: S) -> Response
where
    S: Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| ApiError::internal(format!("could not build the response: {e}")).into_response())
}

/// `GET /kv_transfer/info`: what the KV connector says about itself
/// (engine id, role, bootstrap address), for P/D proxies; 404 without one.
pub async fn kv_transfer_info(State(state): State<AppState>) -> Response {
    match state.engine().kv_connector_info() {
        Some(info) => json_response(info),
        None => ApiError::not_found("this server has no KV connector").into_response(),
    }
}

/// `GET /v1/models`.
pub async fn models(State(state): State<AppState>) -> Response {
    json_response(&json!({
        "object": "list",
        "data": [{
            "id": state.served_model_name(),
            "object": "model",
            "created": state.started_at(),
            "owned_by": "pdkv",
            "root": state.engine().model_name(),
            "parent": null,
            "max_model_len": state.engine().max_model_len(),
        }],
    }))
}

/// `GET /health`: 200 while the engine accepts requests.
pub async fn health(State(state): State<AppState>) -> Response {
    if !state.engine().is_stopped() {
        StatusCode::OK.into_response()
    } else {
        ApiError::unavailable("the engine has stopped").into_response()
    }
}

/// `GET /metrics` in the Prometheus text format.
pub async fn metrics(State(state): State<AppState>) -> Response {
    let st = crate::admin::lifecycle_status(&state);
    let lifecycle = LifecycleGauges {
        sleep_level: st.sleeping.map(|l| l.as_u32()),
        paused: st.paused.is_some(),
        weights_discarded: st.weights_discarded,
        host_backup_bytes: state.engine().pool().host_backup_bytes(),
    };
    let stats = state.engine().stats();
    let device = state.engine().pool().device_bytes();
    let connector = state.engine().kv_connector_metrics();
    let text = state.metrics().render_with(&stats, &device, &lifecycle, &connector);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

pub async fn not_found() -> ApiError {
    ApiError::not_found("no such route")
}

pub async fn method_not_allowed() -> ApiError {
    ApiError { status: StatusCode::METHOD_NOT_ALLOWED, ..ApiError::invalid("method not allowed on this route") }
}
