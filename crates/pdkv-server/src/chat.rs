//! How a chat completion's choices are shown, streamed (server-sent
//! events) or whole: log-probabilities, token ids and, when the request
//! has tools, its answers read for calls ([`crate::tools`]).

use std::sync::Arc;

use axum::response::Response;
use pdkv_engine::sampling::TokenLogprobs;
use pdkv_engine::{FinishReason, RequestOutput};
use pdkv_model::Tokenizer;
use serde_json::{json, Value};

use crate::admit::{json_response, usage_json, with_request_id};
use crate::choices::Group;
use crate::error::ApiError;
use crate::logprobs;
use crate::sse::{sse_response, ChunkHead, StreamUsage};

/// How a chat completion's choices are shown: the options that shape them.
pub(crate) struct ChatView {
    pub(crate) tok: Arc<Tokenizer>,
    /// How log-probabilities name tokens (`return_tokens_as_token_ids`).
    pub(crate) names: logprobs::Names,
    /// `top_logprobs` when log-probabilities are asked for.
    pub(crate) top: Option<usize>,
    pub(crate) want_prompt_logprobs: bool,
    pub(crate) return_token_ids: bool,
    /// The prompt's token ids, when `return_token_ids` is set.
    pub(crate) prompt_ids: Option<Vec<u32>>,
    /// Answers are read for tool calls.
    pub(crate) tools: Option<crate::tools::Tools>,
    /// `echo`: the text every answer starts with (the last message's, an
    /// assistant's).
    pub(crate) echo: Option<String>,
}

impl ChatView {
    /// A choice's `logprobs` field.
    fn content_logprobs(&self, lps: &[TokenLogprobs]) -> Value {
        match self.top {
            Some(k) => json!({"content": logprobs::chat_content(&self.tok, self.names, lps, k)}),
            None => Value::Null,
        }
    }
}

/// A chat completion's choices as server-sent events: each choice's role
/// first, then its deltas.
pub(crate) fn stream_chat(
    group: Group,
    view: ChatView,
    model: String,
    usage: StreamUsage,
) -> Response {
    let (id, created) = (group.id.clone(), group.created);
    let head = ChunkHead::of(&group, "chat.completion.chunk", &model);
    let base =
        json!({"id": id, "object": "chat.completion.chunk", "created": created, "model": model});
    let opening = |i: usize, delta: Value| {
        let mut v = base.clone();
        v["choices"] =
            json!([{"index": i, "delta": delta, "logprobs": null, "finish_reason": null}]);
        if usage.include {
            v["usage"] = Value::Null;
        }
        v
    };
    let mut first: Vec<Value> = (0..group.n())
        .map(|i| {
            let mut v = opening(i, json!({"role": "assistant", "content": ""}));
            if i == 0 {
                if let Some(ids) = &view.prompt_ids {
                    v["prompt_token_ids"] = json!(ids);
                }
            }
            v
        })
        .collect();
    // The echoed text, a chunk per choice after the roles (as vLLM sends it).
    if let Some(e) = &view.echo {
        first.extend((0..group.n()).map(|i| opening(i, json!({"content": e}))));
    }
    let mut calls: Vec<crate::tools::Streamed> = (0..group.n())
        .map(|_| crate::tools::Streamed::default())
        .collect();
    let chunk = move |i: usize, out: &RequestOutput, usage: bool| {
        let (delta, finish) = match &view.tools {
            Some(t) => calls[i].push(t, &out.text, out.finish_reason),
            None => (
                if out.text.is_empty() {
                    json!({})
                } else {
                    json!({"content": out.text})
                },
                out.finish_reason.map(FinishReason::as_str),
            ),
        };
        let shows_tokens = view.top.is_some() || view.return_token_ids;
        let sends_prompt_lp = view.want_prompt_logprobs && out.prompt_logprobs.is_some();
        let empty = delta.as_object().is_some_and(|d| d.is_empty());
        if empty && finish.is_none() && !shows_tokens && !sends_prompt_lp {
            return None;
        }
        let mut v = base.clone();
        let mut choice = json!({"index": i, "delta": delta, "logprobs": view.content_logprobs(&out.logprobs), "finish_reason": finish});
        if view.return_token_ids {
            choice["token_ids"] = json!(out.token_ids);
        }
        v["choices"] = json!([choice]);
        if sends_prompt_lp {
            v["prompt_logprobs"] =
                logprobs::prompt_logprobs(&view.tok, out.prompt_logprobs.as_deref().unwrap_or(&[]));
        }
        if usage {
            v["usage"] = Value::Null;
        }
        Some(v)
    };
    let id = group.id.clone();
    with_request_id(sse_response(group, head, usage, first, chunk), &id)
}

/// A chat completion's choices, whole, in one JSON answer.
pub(crate) async fn whole_chat(
    mut group: Group,
    view: ChatView,
    model: String,
) -> Result<Response, ApiError> {
    let (done, choices) = group
        .collect_answers(|i, c| {
            let finish = c.finish_reason.unwrap_or(FinishReason::Abort);
            let (mut message, finish) = match &view.tools {
                Some(t) => crate::tools::message(t, &c.text, finish),
                None => (
                    json!({"role": "assistant", "content": c.text}),
                    finish.as_str(),
                ),
            };
            if let (Some(e), Some(text)) = (&view.echo, message["content"].as_str()) {
                message["content"] = json!(format!("{e}{text}"));
            }
            let mut v = json!({
                "index": i,
                "message": message,
                "logprobs": view.content_logprobs(&c.logprobs),
                "finish_reason": finish,
            });
            if view.return_token_ids {
                v["token_ids"] = json!(c.token_ids);
            }
            v
        })
        .await?;
    let mut body = json!({
        "id": group.id,
        "object": "chat.completion",
        "created": group.created,
        "model": model,
        "choices": choices,
        "usage": usage_json(group.num_prompt_tokens, group.generated()),
        "kv_transfer_params": done[0].kv_transfer_params,
    });
    if view.want_prompt_logprobs {
        body["prompt_logprobs"] = done[0]
            .prompt_logprobs
            .as_deref()
            .map_or(Value::Null, |p| logprobs::prompt_logprobs(&view.tok, p));
    }
    if let Some(ids) = view.prompt_ids {
        body["prompt_token_ids"] = json!(ids);
    }
    let resp = json_response(&body);
    Ok(with_request_id(resp, &group.id))
}
