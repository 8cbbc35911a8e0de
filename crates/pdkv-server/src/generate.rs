//! `POST /inference/v1/generate`: vLLM's token-in/token-out API, which RL
//! frameworks (SkyRL, prime-rl) send every rollout to. Token ids in, token
//! ids and log-probabilities out; no text either way.
//!
//! Request: `token_ids`, `sampling_params` (vLLM's `SamplingParams` field
//! names: `max_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `n`,
//! `stop`, `stop_token_ids`, `logprobs` (k), `prompt_logprobs` (k), ...),
//! `model`, `request_id`, `stream`, `stream_options`, `cache_salt`,
//! `priority`, `kv_transfer_params`. Response: `request_id`, `choices[]`
//! (`index`, `token_ids`, `finish_reason`, `logprobs.content[]` with tokens
//! named `token_id:N`), `prompt_logprobs` when asked, `usage`,
//! `kv_transfer_params`. Streamed: one event per new tokens with the same
//! choice fields, then `[DONE]`.
//!
//! Without `max_tokens`, a request may use the rest of the context (as
//! vLLM's generate does, unlike `/v1/completions`' 16).

use std::time::Instant;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::Extension;
use pdkv_engine::{FinishReason, RequestOutput};
use serde::Deserialize;
use serde_json::{json, Value};

use crate::admit::{json_response, with_request_id};
use crate::admit::{kv_params, usage_json, PromptIn};
use crate::choices::{admit_group, parse_n, Group};
use crate::error::ApiError;
use crate::fields::{Body, Screen, Screened};
use crate::listen::PeerAddr;
use crate::logprobs::{self, Names};
use crate::openai::{parse_max_tokens, Endpoint, SamplingFields, StreamOptions};
use crate::routes::{
    check_model, check_sampling_ids, check_token_ids, choose_request_id, reports_token_ids,
    truncate_prompt,
};
use crate::sse::{sse_response, ChunkHead, StreamUsage};
use crate::AppState;

/// The body of `POST /inference/v1/generate`.
#[derive(Debug, Deserialize)]
pub struct GenerateRequest {
    pub request_id: Option<String>,
    pub token_ids: Vec<u32>,
    #[serde(default)]
    pub sampling_params: GenerateSampling,
    pub model: Option<String>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub cache_salt: Option<String>,
    pub priority: Option<i64>,
    pub kv_transfer_params: Option<Value>,
    /// Multimodal features: only null (this server takes text models).
    pub features: Option<Value>,
}

impl Screen for GenerateRequest {
    const BODY: Body = Body::Generate;
}

/// vLLM's `SamplingParams`, as the generate API spells them.
#[derive(Debug, Default, Deserialize)]
pub struct GenerateSampling {
    pub n: Option<i64>,
    pub max_tokens: Option<i64>,
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub min_p: Option<f64>,
    /// vLLM's range, a 64-bit signed integer.
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub include_stop_str_in_output: Option<bool>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub min_tokens: Option<i64>,
    /// Keep only the last k prompt tokens (`-1`: the model's limit).
    pub truncate_prompt_tokens: Option<i64>,
    #[allow(dead_code)]
    pub spaces_between_special_tokens: Option<bool>,
    pub logprobs: Option<Value>,
    pub prompt_logprobs: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub logit_bias: Option<Value>,
    /// vLLM's structured outputs object (json, regex, choice, grammar).
    pub structured_outputs: Option<Value>,
    /// Text is never returned here: which tokens a text would show, and
    /// whether one is made, change nothing (typed, so a wrong type is
    /// still a 400).
    #[allow(dead_code)]
    pub skip_special_tokens: Option<bool>,
    #[allow(dead_code)]
    pub detokenize: Option<bool>,
}

impl GenerateSampling {
    fn fields(&self) -> SamplingFields {
        SamplingFields {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            min_p: self.min_p,
            seed: self.seed,
            stop: self.stop.clone(),
            stop_token_ids: self.stop_token_ids.clone(),
            include_stop_str_in_output: self.include_stop_str_in_output,
            allowed_token_ids: self.allowed_token_ids.clone(),
            ignore_eos: self.ignore_eos,
            logprobs: self.logprobs.clone(),
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            repetition_penalty: self.repetition_penalty,
            min_tokens: self.min_tokens,
            logit_bias: self.logit_bias.clone(),
            prompt_logprobs: self.prompt_logprobs.clone(),
            // No text is returned, so which tokens the text would show
            // changes nothing.
            skip_special_tokens: None,
            structured_outputs: self.structured_outputs.clone(),
            ..SamplingFields::default()
        }
    }
}

/// `POST /inference/v1/generate`.
pub async fn generate(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<Extension<PeerAddr>>,
    Screened(req): Screened<GenerateRequest>,
) -> Result<Response, ApiError> {
    let arrived = Instant::now();
    check_model(&state, req.model.as_deref())?;
    if !matches!(req.features, None | Some(Value::Null)) {
        return Err(ApiError::invalid_param(
            "features",
            "multimodal features are not supported (text models only)",
        ));
    }
    if let Some(p) = req.priority.filter(|&p| p != 0) {
        return Err(ApiError::invalid_param(
            "priority",
            format!("priority {p}: this server does not use priority scheduling (only 0)"),
        ));
    }
    let ids = choose_request_id(&state, &headers, peer, req.request_id.as_deref(), "gen-")?;
    let sp = &req.sampling_params;
    let token_ids = truncate_prompt(&state, req.token_ids, sp.truncate_prompt_tokens)?;
    check_token_ids(&state, &token_ids)?;
    let n = parse_n(sp.n, None)?;
    let max_tokens = match parse_max_tokens("max_tokens", sp.max_tokens)? {
        Some(m) => m,
        None => {
            let room = state
                .engine()
                .max_model_len()
                .saturating_sub(token_ids.len());
            u32::try_from(room.max(1)).unwrap_or(u32::MAX)
        }
    };
    let fields = sp.fields();
    let mut params = fields.to_params(max_tokens, Endpoint::Completions)?;
    check_sampling_ids(&state, &params)?;
    crate::structured::constrain(&state, &fields, &mut params).await?;
    let top = params.logprobs;
    let want_prompt_lp = params.prompt_logprobs.is_some();
    let kv = kv_params(req.kv_transfer_params, &ids.engine)?;
    let prompt = PromptIn::new(token_ids, req.cache_salt)?;
    let mut group = admit_group(&state, ids, prompt, params, kv, arrived, n).await?;
    group.report_token_ids = reports_token_ids(&headers);
    let view = GenerateView {
        tok: state.engine().tokenizer().clone(),
        top: top.map(|k| k as usize),
    };
    if req.stream.unwrap_or(false) {
        let usage = StreamOptions::usage(req.stream_options.as_ref());
        let model = state.served_model_name().to_string();
        return Ok(stream(group, view, model, usage));
    }
    whole(group, view, want_prompt_lp).await
}

/// How a generate answer's choices are shown.
struct GenerateView {
    tok: std::sync::Arc<pdkv_model::Tokenizer>,
    /// `logprobs` (k) when asked for.
    top: Option<usize>,
}

impl GenerateView {
    fn logprobs(&self, lps: &[pdkv_engine::sampling::TokenLogprobs]) -> Value {
        match self.top {
            // vLLM lists at least one top entry per position.
            Some(k) => {
                json!({"content": logprobs::chat_content(&self.tok, Names::TokenIds, lps, k.max(1))})
            }
            None => Value::Null,
        }
    }
}

async fn whole(
    mut group: Group,
    view: GenerateView,
    want_prompt_lp: bool,
) -> Result<Response, ApiError> {
    let (done, choices) = group
        .collect_answers(|i, c| {
            json!({
                "index": i,
                "token_ids": c.token_ids,
                "logprobs": view.logprobs(&c.logprobs),
                "finish_reason": c.finish_reason.unwrap_or(FinishReason::Abort).as_str(),
            })
        })
        .await?;
    let prompt_lp = if want_prompt_lp {
        done[0]
            .prompt_logprobs
            .as_deref()
            .map_or(Value::Null, |p| logprobs::prompt_logprobs(&view.tok, p))
    } else {
        Value::Null
    };
    let resp = json_response(&json!({
        "request_id": group.id,
        "choices": choices,
        "prompt_logprobs": prompt_lp,
        "usage": usage_json(group.num_prompt_tokens, group.generated()),
        "kv_transfer_params": done[0].kv_transfer_params,
    }));
    Ok(with_request_id(resp, &group.id))
}

fn stream(group: Group, view: GenerateView, model: String, usage: StreamUsage) -> Response {
    let id = group.id.clone();
    let head = ChunkHead::of(&group, "generate.chunk", &model);
    let rid = id.clone();
    let chunk = move |i: usize, out: &RequestOutput, _usage: bool| {
        if out.token_ids.is_empty() && out.finish_reason.is_none() {
            return None;
        }
        let mut v = json!({
            "request_id": rid,
            "choices": [{
                "index": i,
                "token_ids": out.token_ids,
                "logprobs": view.logprobs(&out.logprobs),
                "finish_reason": out.finish_reason.map(FinishReason::as_str),
            }],
        });
        if let Some(p) = out.prompt_logprobs.as_deref() {
            v["prompt_logprobs"] = logprobs::prompt_logprobs(&view.tok, p);
        }
        Some(v)
    };
    with_request_id(sse_response(group, head, usage, Vec::new(), chunk), &id)
}
