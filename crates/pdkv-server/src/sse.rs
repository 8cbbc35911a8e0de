//! Server-sent events for streamed generations: the chunks of every choice
//! of a [`Group`] as they come, then the optional usage chunk and `[DONE]`.

use std::collections::VecDeque;
use std::convert::Infallible;

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt};
use pdkv_engine::{FinishReason, RequestOutput};
use pdkv_relay::TOKEN_IDS_COMMENT;
use serde_json::{json, Value};

use crate::admit::{failed_request, usage_json};
use crate::choices::Group;
use crate::error::ApiError;

/// Builds the chunk for one output of choice `index`, or `None` when the
/// output shows nothing (no text, no tokens the client asked to see, not
/// the end). `usage_null`: add `"usage": null` (`include_usage` is set).
pub trait ChunkFn: FnMut(usize, &RequestOutput, bool) -> Option<Value> + Send + 'static {}
impl<F: FnMut(usize, &RequestOutput, bool) -> Option<Value> + Send + 'static> ChunkFn for F {}

/// What a stream says of its usage (`stream_options`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StreamUsage {
    /// A last chunk with the whole request's usage; every other chunk with
    /// a `usage` slot (null).
    pub include: bool,
    /// Each chunk's slot filled with its choice's usage so far
    /// (`continuous_usage_stats`).
    pub continuous: bool,
}

/// Where a stream is.
enum Phase {
    /// The opening chunks are still to be sent.
    Start,
    Generating,
    /// Every choice's final chunk went out; usage and `[DONE]` remain.
    Tail,
    Done,
}

struct SseState<F> {
    outputs: BoxStream<'static, (usize, Option<RequestOutput>)>,
    num_prompt_tokens: usize,
    /// Choices not finished yet.
    open: usize,
    usage: StreamUsage,
    /// Per choice: its prompt's tokens and the tokens it generated so far
    /// (the request's usage sums them).
    choice_usage: Vec<(usize, usize)>,
    /// Lead each event with its output token ids ([`TOKEN_IDS_COMMENT`]).
    report_token_ids: bool,
    first: VecDeque<Value>,
    chunk: F,
    phase: Phase,
    head: ChunkHead,
}

/// The fields every chunk of a stream shares.
pub struct ChunkHead {
    pub id: String,
    pub created: u64,
    pub object: &'static str,
    pub model: String,
}

impl ChunkHead {
    /// The head of `group`'s chunks, of type `object`.
    pub fn of(group: &Group, object: &'static str, model: &str) -> ChunkHead {
        ChunkHead {
            id: group.id.clone(),
            created: group.created,
            object,
            model: model.to_string(),
        }
    }
}

fn sse_event(v: &Value) -> String {
    format!("data: {v}\n\n")
}

/// The final output of a choice whose stream ended without one.
fn ended(index: usize) -> RequestOutput {
    RequestOutput {
        finish_reason: Some(FinishReason::Abort),
        ..RequestOutput::empty(index.to_string(), 0)
    }
}

impl<F: ChunkFn> SseState<F> {
    /// With continuous usage, fills the `usage` slot of choice `index`'s
    /// chunk `v` (a chunk without one, as the generate API's, keeps none).
    fn fill_usage(&self, v: &mut Value, index: usize) {
        if !self.usage.continuous {
            return;
        }
        if let (Some(slot), Some(&(prompt, generated))) =
            (v.get_mut("usage"), self.choice_usage.get(index))
        {
            *slot = usage_json(prompt, generated);
        }
    }

    /// The next piece of the body, or `None` at the end.
    async fn step(&mut self) -> Option<String> {
        loop {
            match self.phase {
                Phase::Start => match self.first.pop_front() {
                    Some(mut v) => {
                        let index = v["choices"][0]["index"].as_u64().unwrap_or(0) as usize;
                        self.fill_usage(&mut v, index);
                        return Some(sse_event(&v));
                    }
                    None => self.phase = Phase::Generating,
                },
                Phase::Generating => {
                    let (index, out) = match self.outputs.next().await {
                        Some((i, Some(out))) => (i, out),
                        Some((i, None)) => (i, ended(i)),
                        // Every choice's stream ended.
                        None => {
                            self.phase = Phase::Tail;
                            continue;
                        }
                    };
                    if out.finish_reason == Some(FinishReason::Error) {
                        // A failed request: an error event, then `[DONE]`.
                        self.phase = Phase::Done;
                        let err = failed_request(&out);
                        return Some(format!("data: {}\n\ndata: [DONE]\n\n", err.body_json()));
                    }
                    if let Some(u) = self.choice_usage.get_mut(index) {
                        u.1 += out.token_ids.len();
                    }
                    if out.finish_reason.is_some() {
                        self.open -= 1;
                        if self.open == 0 {
                            self.phase = Phase::Tail;
                        }
                    }
                    let mut event = (self.chunk)(index, &out, self.usage.include);
                    if let Some(v) = &mut event {
                        self.fill_usage(v, index);
                    }
                    if self.report_token_ids && !out.token_ids.is_empty() {
                        // One event, so the ids and their text arrive together.
                        let ids = json!(out.token_ids);
                        let data = event.as_ref().map_or(String::new(), sse_event);
                        let tail = if data.is_empty() { "\n" } else { "" };
                        return Some(format!("{TOKEN_IDS_COMMENT}{ids}\n{data}{tail}"));
                    }
                    if let Some(v) = event {
                        return Some(sse_event(&v));
                    }
                }
                Phase::Tail => {
                    self.phase = Phase::Done;
                    let mut out = String::new();
                    if self.usage.include {
                        let h = &self.head;
                        out.push_str(&sse_event(&json!({
                            "id": h.id, "object": h.object, "created": h.created, "model": h.model,
                            "choices": [],
                            "usage": usage_json(self.num_prompt_tokens, self.choice_usage.iter().map(|u| u.1).sum()),
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

/// A `text/event-stream` response that owns the group's streams: when the
/// client disconnects, hyper drops the body and with it every choice.
/// `first` are opening chunks sent before any output.
pub fn sse_response<F: ChunkFn>(
    group: Group,
    head: ChunkHead,
    usage: StreamUsage,
    first: Vec<Value>,
    chunk: F,
) -> Response {
    // A resumed request's opening chunks (the chat role) were sent by the
    // engine that began it.
    let first = if group.continues { Vec::new() } else { first };
    let state = SseState {
        num_prompt_tokens: group.num_prompt_tokens,
        open: group.n(),
        report_token_ids: group.report_token_ids,
        choice_usage: group.choice_usage(),
        outputs: group.into_stream().boxed(),
        usage,
        first: first.into(),
        chunk,
        phase: Phase::Start,
        head,
    };
    let body = futures::stream::unfold(state, |mut st| async move {
        let piece = st.step().await?;
        Some((Ok::<_, Infallible>(Bytes::from(piece)), st))
    });
    sse_body(body)
}

fn sse_body<S>(body: S) -> Response
where
    S: Stream<Item = Result<Bytes, Infallible>> + Send + 'static,
{
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(body))
        .unwrap_or_else(|e| {
            ApiError::internal(format!("could not build the response: {e}")).into_response()
        })
}
