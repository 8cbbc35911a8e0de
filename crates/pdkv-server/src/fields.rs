//! Which request fields a body may carry, screened before it is read: a
//! field vLLM honours is honoured here (a typed field of the request
//! structs in [`crate::openai`] and [`crate::generate`]) or, where its
//! effect is not implemented, refused with a 400 naming it unless it holds
//! its no-op value; a field vLLM does not know either is ignored, as vLLM
//! ignores it, with a WARN naming it and a count in `/metrics`
//! (`pdkv_ignored_request_fields_total{field}`).

use serde_json::{Map, Value};

use crate::error::ApiError;
use crate::Metrics;

/// The generation endpoints, as far as their fields go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Body {
    Completions,
    Chat,
    /// `/inference/v1/generate`'s top level.
    Generate,
    /// `/inference/v1/generate`'s `sampling_params`.
    GenerateSampling,
    /// `/tokenize` (a prompt or a conversation).
    Tokenize,
    /// `/detokenize`.
    Detokenize,
}

/// The sampling fields every generation endpoint reads (the OpenAI
/// endpoints at the top level, `/inference/v1/generate` in
/// `sampling_params`).
const BASIC_SAMPLING: &[&str] = &[
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "include_stop_str_in_output",
    "allowed_token_ids",
    "ignore_eos",
];

/// The other sampling fields both OpenAI endpoints' structs read.
const SAMPLING: &[&str] = &[
    "truncate_prompt_tokens",
    "cache_salt",
    "add_special_tokens",
    "spaces_between_special_tokens",
    "n",
    "best_of",
    "logprobs",
    "top_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "min_tokens",
    "logit_bias",
    "prompt_logprobs",
    "return_token_ids",
    "return_tokens_as_token_ids",
    "response_format",
    "structured_outputs",
    "guided_json",
    "guided_regex",
    "guided_choice",
    "guided_grammar",
    "guided_whitespace_pattern",
    "guided_decoding_backend",
    "tools",
    "tool_choice",
    "skip_special_tokens",
    "no_stop_trim",
    "return_hidden_states",
    "continue_final_message",
    "separate_reasoning",
    "stream_reasoning",
    "include_reasoning",
];

const COMPLETIONS: &[&str] = &[
    "model",
    "prompt",
    "max_tokens",
    "stream",
    "stream_options",
    "echo",
    "suffix",
    "request_id",
    "kv_transfer_params",
    "user",
];

const CHAT: &[&str] = &[
    "model",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "stream",
    "echo",
    "stream_options",
    "request_id",
    "kv_transfer_params",
    "chat_template_kwargs",
    "add_generation_prompt",
    "parallel_tool_calls",
    "structural_tag",
    "user",
];

const GENERATE: &[&str] = &[
    "request_id",
    "token_ids",
    "sampling_params",
    "model",
    "stream",
    "stream_options",
    "cache_salt",
    "priority",
    "kv_transfer_params",
    "features",
];

const TOKENIZE: &[&str] = &[
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "continue_final_message",
    "return_token_strs",
    "chat_template_kwargs",
    "tools",
];

const DETOKENIZE: &[&str] = &["model", "tokens"];

/// `sampling_params`' fields beyond [`BASIC_SAMPLING`].
const GENERATE_SAMPLING: &[&str] = &[
    "n",
    "max_tokens",
    "min_tokens",
    "logprobs",
    "prompt_logprobs",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logit_bias",
    "skip_special_tokens",
    "detokenize",
    "spaces_between_special_tokens",
    "truncate_prompt_tokens",
    "structured_outputs",
];

/// Fields vLLM honours whose effect pdkv does not implement: accepted only
/// with the value that changes nothing (absent and null always are), else a
/// 400 naming the field and saying why.
/// Whether a value of a refused field is its no-op one.
type IsNoOp = fn(&Value) -> bool;

const REFUSED: &[(&str, IsNoOp, &str)] = &[
    ("use_beam_search", is_false, "beam search is not supported"),
    (
        "length_penalty",
        is_one,
        "length_penalty applies to beam search, which is not supported",
    ),
    (
        "priority",
        is_zero,
        "this server does not use priority scheduling (only priority 0)",
    ),
    ("bad_words", is_empty, "bad_words is not supported"),
    (
        "logits_processors",
        is_empty,
        "custom logits processors are not supported",
    ),
    ("vllm_xargs", is_empty, "vllm_xargs is not supported"),
    ("extra_args", is_empty, "extra_args is not supported"),
    (
        "guided_decoding",
        is_null,
        "guided_decoding is not read: use structured_outputs, response_format or guided_json/regex/choice/grammar",
    ),
    (
        "prompt_embeds",
        is_null,
        "prompt embeddings are not supported",
    ),
    (
        "mm_processor_kwargs",
        is_empty,
        "this server serves text models only",
    ),
    (
        "media_io_kwargs",
        is_empty,
        "this server serves text models only",
    ),
    (
        "multi_modal_data",
        is_null,
        "this server serves text models only",
    ),
    ("documents", is_null, "documents are not supported"),
    (
        "chat_template",
        is_null,
        "a request's own chat_template is not supported; the model's is used",
    ),
    (
        "reasoning_effort",
        is_null,
        "reasoning_effort is not supported (no reasoning parser)",
    ),
    ("output_kind", is_anything, ""),
    (
        "thinking_token_budget",
        is_null,
        "thinking_token_budget is not supported",
    ),
    (
        "repetition_detection",
        is_null,
        "repetition_detection is not supported",
    ),
];

fn is_null(v: &Value) -> bool {
    v.is_null()
}
fn is_false(v: &Value) -> bool {
    matches!(v, Value::Null | Value::Bool(false))
}
fn is_zero(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(0.0)
}
fn is_one(v: &Value) -> bool {
    v.is_null() || v.as_f64() == Some(1.0)
}
fn is_empty(v: &Value) -> bool {
    match v {
        Value::Null => true,
        Value::Array(a) => a.is_empty(),
        Value::Object(o) => o.is_empty(),
        _ => false,
    }
}
/// A value that a Python `if` takes as true (vLLM's validators test fields
/// this way): not null, false, zero or empty.
fn truthy(v: &Value) -> bool {
    match v {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(a) => !a.is_empty(),
        Value::Object(o) => !o.is_empty(),
    }
}
/// Fields that change nothing here whatever their value (`parallel_tool_calls`
/// without tools; `output_kind`, which the API sets itself).
fn is_anything(_: &Value) -> bool {
    true
}

/// The lists of the fields `body` reads.
fn accepted(body: Body) -> [&'static [&'static str]; 3] {
    match body {
        Body::Completions => [COMPLETIONS, BASIC_SAMPLING, SAMPLING],
        Body::Chat => [CHAT, BASIC_SAMPLING, SAMPLING],
        Body::Generate => [GENERATE, &[], &[]],
        Body::GenerateSampling => [GENERATE_SAMPLING, BASIC_SAMPLING, &[]],
        Body::Tokenize => [TOKENIZE, &[], &[]],
        Body::Detokenize => [DETOKENIZE, &[], &[]],
    }
}

/// Screens the fields of `obj` (a request body, or `sampling_params`) for
/// `body`: refuses a field vLLM honours that pdkv does not, unless it
/// holds its no-op value, and counts and logs each field vLLM does not
/// know either. `prefix` names where `obj` sits (`"sampling_params."`).
pub fn screen(
    obj: &Map<String, Value>,
    body: Body,
    prefix: &str,
    metrics: &Metrics,
) -> Result<(), ApiError> {
    let lists = accepted(body);
    for (k, v) in obj {
        if lists.iter().any(|l| l.contains(&k.as_str())) {
            continue;
        }
        if let Some((_, ok, why)) = REFUSED.iter().find(|(name, _, _)| name == k) {
            if ok(v) {
                continue;
            }
            let name = format!("{prefix}{k}");
            return Err(ApiError::invalid_param(&name, format!("{name}: {why}")));
        }
        let name = format!("{prefix}{k}");
        tracing::warn!(field = %name, "ignoring a request field that vLLM does not know either");
        metrics.ignored_field(&name);
    }
    Ok(())
}

/// A request body of `T`, screened ([`screen_bytes`]) and then parsed.
pub struct Screened<T>(pub T);

/// The body kind of a request struct.
pub trait Screen {
    const BODY: Body;
}

impl<T: serde::de::DeserializeOwned + Screen> axum::extract::FromRequest<crate::AppState>
    for Screened<T>
{
    type Rejection = ApiError;

    async fn from_request(
        req: axum::extract::Request,
        state: &crate::AppState,
    ) -> Result<Self, Self::Rejection> {
        let bytes = axum::body::Bytes::from_request(req, state)
            .await
            .map_err(crate::error::body_rejection)?;
        screen_bytes(&bytes, T::BODY, state.metrics())?;
        crate::error::parse_json(&bytes).map(Screened)
    }
}

/// [`screen`] over a whole body's bytes, when they are a JSON object (a body
/// that is not is left to the typed parse, which names the problem).
pub fn screen_bytes(bytes: &[u8], body: Body, metrics: &Metrics) -> Result<(), ApiError> {
    let Ok(Value::Object(obj)) = serde_json::from_slice::<Value>(bytes) else {
        return Ok(());
    };
    screen(&obj, body, "", metrics)?;
    if matches!(body, Body::Completions | Body::Chat)
        && obj.get("stream_options").is_some_and(truthy)
        && obj.get("stream") != Some(&Value::Bool(true))
    {
        // vLLM's rule: options of a stream that is not asked for are a
        // mistake to name, not a no-op (an empty object passes, as there).
        return Err(ApiError::invalid_param(
            "stream_options",
            "stream_options can only be given with stream: true",
        ));
    }
    if body == Body::Generate {
        if let Some(Value::Object(sp)) = obj.get("sampling_params") {
            screen(sp, Body::GenerateSampling, "sampling_params.", metrics)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn run(v: Value, body: Body) -> (Result<(), ApiError>, Metrics) {
        let m = Metrics::new();
        let r = screen_bytes(v.to_string().as_bytes(), body, &m);
        (r, m)
    }

    #[test]
    fn known_fields_pass_and_no_op_values_of_refused_ones_too() {
        let (r, m) = run(
            json!({"prompt": "x", "min_p": 0.1, "use_beam_search": false, "priority": 0,
                   "length_penalty": 1.0, "bad_words": [], "cache_salt": null}),
            Body::Completions,
        );
        assert!(r.is_ok());
        assert_eq!(m.ignored_fields_total(), 0);
    }

    #[test]
    fn a_refused_field_with_an_effect_is_a_400_naming_it() {
        for (v, field) in [
            (
                json!({"prompt": "x", "use_beam_search": true}),
                "use_beam_search",
            ),
            (json!({"prompt": "x", "priority": 3}), "priority"),
            (
                json!({"messages": [], "media_io_kwargs": {"video": {"num_frames": 8}}}),
                "media_io_kwargs",
            ),
            (
                json!({"messages": [], "guided_decoding": {"json": {}}}),
                "guided_decoding",
            ),
        ] {
            let body = if v.get("messages").is_some() {
                Body::Chat
            } else {
                Body::Completions
            };
            let e = run(v, body).0.unwrap_err();
            assert_eq!(e.param.as_deref(), Some(field));
        }
        let e = run(
            json!({"token_ids": [1], "sampling_params": {"bad_words": ["x"]}}),
            Body::Generate,
        )
        .0
        .unwrap_err();
        assert_eq!(e.param.as_deref(), Some("sampling_params.bad_words"));
    }

    #[test]
    fn stream_options_without_a_stream_are_a_400_naming_them() {
        let opts = json!({"include_usage": true});
        for (stream, body) in [(json!(false), Body::Completions), (Value::Null, Body::Chat)] {
            let mut v = json!({"prompt": "x", "stream_options": opts});
            if !stream.is_null() {
                v["stream"] = stream;
            }
            let e = run(v, body).0.unwrap_err();
            assert_eq!(e.param.as_deref(), Some("stream_options"));
        }
        // With a stream, or empty or null (as vLLM's check lets them by).
        for v in [
            json!({"prompt": "x", "stream": true, "stream_options": opts}),
            json!({"prompt": "x", "stream_options": {}}),
            json!({"prompt": "x", "stream": false, "stream_options": null}),
        ] {
            assert!(run(v, Body::Completions).0.is_ok());
        }
    }

    #[test]
    fn unknown_fields_are_counted_by_name() {
        let (r, m) = run(
            json!({"prompt": "x", "my_extension": 1, "another": true}),
            Body::Completions,
        );
        assert!(r.is_ok());
        assert_eq!(m.ignored_field_count("my_extension"), 1);
        assert_eq!(m.ignored_field_count("another"), 1);
        assert_eq!(m.ignored_fields_total(), 2);
        let (_, m) = run(
            json!({"token_ids": [1], "sampling_params": {"odd": 1}}),
            Body::Generate,
        );
        assert_eq!(m.ignored_field_count("sampling_params.odd"), 1);
    }
}
