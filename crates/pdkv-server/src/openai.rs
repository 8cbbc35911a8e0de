//! OpenAI request bodies and their validation into engine terms.
//!
//! Fields the server does not implement but that change what a client gets
//! back (`n`, `best_of`, `echo`, `logprobs`, `suffix`) are refused with a 400
//! rather than silently ignored; fields that only tune behaviour the server
//! lacks (`user`, `presence_penalty` at 0, ...) are ignored.

use pdkv_engine::SamplingParams;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// Default `max_tokens` of `/v1/completions`, as in the OpenAI API.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// Declares a request body with the sampling fields both endpoints share,
/// inline (not `#[serde(flatten)]`, which would hide the field name from
/// type errors), plus a `sampling()` accessor that gathers them.
macro_rules! request_with_sampling {
    ($(#[$meta:meta])* pub struct $name:ident { $($(#[$fmeta:meta])* pub $field:ident: $ty:ty,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Deserialize)]
        pub struct $name {
            $($(#[$fmeta])* pub $field: $ty,)*
            pub temperature: Option<f64>,
            pub top_p: Option<f64>,
            pub top_k: Option<i64>,
            pub seed: Option<u64>,
            pub stop: Option<Value>,
            pub stop_token_ids: Option<Vec<u32>>,
            pub ignore_eos: Option<bool>,
            pub n: Option<i64>,
            pub best_of: Option<i64>,
            pub logprobs: Option<Value>,
            pub top_logprobs: Option<Value>,
            pub presence_penalty: Option<f64>,
            pub frequency_penalty: Option<f64>,
        }

        impl $name {
            /// The sampling fields, for validation.
            pub fn sampling(&self) -> SamplingFields {
                SamplingFields {
                    temperature: self.temperature,
                    top_p: self.top_p,
                    top_k: self.top_k,
                    seed: self.seed,
                    stop: self.stop.clone(),
                    stop_token_ids: self.stop_token_ids.clone(),
                    ignore_eos: self.ignore_eos,
                    n: self.n,
                    best_of: self.best_of,
                    logprobs: self.logprobs.clone(),
                    top_logprobs: self.top_logprobs.clone(),
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                }
            }
        }
    };
}

/// The sampling fields shared by both endpoints.
#[derive(Debug, Default)]
pub struct SamplingFields {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<i64>,
    pub seed: Option<u64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
}

request_with_sampling! {
    /// The body of `POST /v1/completions`.
    pub struct CompletionRequest {
        pub model: Option<String>,
        pub prompt: Value,
        pub max_tokens: Option<i64>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        pub echo: Option<bool>,
        pub suffix: Option<String>,
        /// The engine request id to use (an `X-Request-Id` header wins).
        pub request_id: Option<String>,
        /// Handed to the engine's KV connector (P/D disaggregation).
        pub kv_transfer_params: Option<Value>,
    }
}

request_with_sampling! {
    /// The body of `POST /v1/chat/completions`.
    pub struct ChatRequest {
        pub model: Option<String>,
        pub messages: Vec<ChatMessageIn>,
        pub max_tokens: Option<i64>,
        pub max_completion_tokens: Option<i64>,
        pub stream: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        /// The engine request id to use (an `X-Request-Id` header wins).
        pub request_id: Option<String>,
        /// Handed to the engine's KV connector (P/D disaggregation).
        pub kv_transfer_params: Option<Value>,
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of `{"type":"text","text":..}` parts, or null.
    #[serde(default)]
    pub content: Value,
}

/// A prompt as the client gave it.
#[derive(Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// Reads `prompt`: a string, a list of one string, a list of token ids, or a
/// list of one list of token ids. Batches of several prompts are refused.
pub fn parse_prompt(v: &Value) -> Result<Prompt, ApiError> {
    let bad = |m: &str| ApiError::invalid_param("prompt", m);
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(items) => {
            if items.is_empty() {
                return Err(bad("prompt must not be empty"));
            }
            if items.iter().all(Value::is_string) {
                if items.len() != 1 {
                    return Err(bad("only one prompt per request is supported"));
                }
                return Ok(Prompt::Text(items[0].as_str().unwrap_or_default().to_string()));
            }
            if items.iter().all(Value::is_array) {
                if items.len() != 1 {
                    return Err(bad("only one prompt per request is supported"));
                }
                return parse_prompt(&items[0]).and_then(|p| match p {
                    Prompt::Tokens(t) => Ok(Prompt::Tokens(t)),
                    Prompt::Text(_) => {
                        Err(bad("prompt must be a string, a list of token ids, or a list of one of those"))
                    }
                });
            }
            let ids = items
                .iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| bad("prompt must be a string, a list of token ids, or a list of one of those"))?;
            Ok(Prompt::Tokens(ids))
        }
        Value::Null => Err(bad("prompt is required")),
        _ => Err(bad("prompt must be a string, a list of token ids, or a list of one of those")),
    }
}

/// Reads `stop`: null, a string, or a list of strings; none may be empty.
pub fn parse_stop(v: Option<&Value>) -> Result<Vec<String>, ApiError> {
    let bad = |m: &str| ApiError::invalid_param("stop", m);
    let list = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(items)) => items
            .iter()
            .map(|x| x.as_str().map(str::to_string))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| bad("stop must be a string or a list of strings"))?,
        Some(_) => return Err(bad("stop must be a string or a list of strings")),
    };
    if list.iter().any(String::is_empty) {
        return Err(bad("stop strings must not be empty"));
    }
    Ok(list)
}

/// The text of a message's `content`: a string, null (empty), or text parts
/// joined by newlines.
pub fn message_text(index: usize, content: &Value) -> Result<String, ApiError> {
    let param = format!("messages[{index}].content");
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for part in parts {
                match (part.get("type").and_then(Value::as_str), part.get("text").and_then(Value::as_str)) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid_param(&param, "a text content part needs a string `text`"))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!("content parts of type `{other}` are not supported; only `text`"),
                        ))
                    }
                    (None, _) => return Err(ApiError::invalid_param(&param, "each content part needs a `type`")),
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::invalid_param(&param, "content must be a string or a list of content parts")),
    }
}

/// Checks `max_tokens`-like fields: at least 1 and fits a u32.
pub fn parse_max_tokens(param: &str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(param, format!("{param} must be at least 1, got {n}"))),
        Some(n) => {
            u32::try_from(n).map(Some).map_err(|_| ApiError::invalid_param(param, format!("{param} is too large: {n}")))
        }
    }
}

impl SamplingFields {
    /// Validates the fields into engine sampling parameters (with
    /// `max_tokens` left at the given value).
    pub fn to_params(&self, max_tokens: u32) -> Result<SamplingParams, ApiError> {
        if let Some(n) = self.n {
            if n != 1 {
                return Err(ApiError::invalid_param("n", format!("only n=1 is supported, got {n}")));
            }
        }
        if let Some(b) = self.best_of {
            if b != 1 {
                return Err(ApiError::invalid_param("best_of", format!("only best_of=1 is supported, got {b}")));
            }
        }
        match &self.logprobs {
            None | Some(Value::Null) | Some(Value::Bool(false)) => {}
            Some(_) => return Err(ApiError::invalid_param("logprobs", "logprobs are not supported")),
        }
        if !matches!(self.top_logprobs, None | Some(Value::Null)) {
            return Err(ApiError::invalid_param("top_logprobs", "logprobs are not supported"));
        }
        for (name, v) in [("presence_penalty", self.presence_penalty), ("frequency_penalty", self.frequency_penalty)] {
            if matches!(v, Some(p) if p != 0.0) {
                return Err(ApiError::invalid_param(name, format!("{name} is not supported (only 0)")));
            }
        }
        let temperature = self.temperature.unwrap_or(1.0);
        if !temperature.is_finite() || !(0.0..=100.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("temperature must be in [0, 100], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0) {
            return Err(ApiError::invalid_param("top_p", format!("top_p must be in (0, 1], got {top_p}")));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            k => {
                return Err(ApiError::invalid_param("top_k", format!("top_k must be -1, 0 (off) or positive, got {k}")))
            }
        };
        Ok(SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            seed: self.seed,
            max_tokens,
            stop: parse_stop(self.stop.as_ref())?,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            return_logits: false,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        assert_eq!(parse_prompt(&json!("hi")).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(parse_prompt(&json!(["hi"])).unwrap(), Prompt::Text("hi".into()));
        assert_eq!(parse_prompt(&json!([1, 2, 3])).unwrap(), Prompt::Tokens(vec![1, 2, 3]));
        assert_eq!(parse_prompt(&json!([[4, 5]])).unwrap(), Prompt::Tokens(vec![4, 5]));
        for bad in [
            json!([]),
            json!(["a", "b"]),
            json!([[1], [2]]),
            json!([1, "a"]),
            json!([-1]),
            json!(3),
            json!(null),
            json!([[["x"]]]),
        ] {
            let e = parse_prompt(&bad).unwrap_err();
            assert_eq!(e.param.as_deref(), Some("prompt"), "{bad}");
        }
    }

    #[test]
    fn stop_shapes() {
        assert_eq!(parse_stop(None).unwrap(), Vec::<String>::new());
        assert_eq!(parse_stop(Some(&json!("x"))).unwrap(), vec!["x"]);
        assert_eq!(parse_stop(Some(&json!(["x", "y"]))).unwrap(), vec!["x", "y"]);
        assert!(parse_stop(Some(&json!([1]))).is_err());
        assert!(parse_stop(Some(&json!(""))).is_err());
    }

    #[test]
    fn content_parts() {
        assert_eq!(message_text(0, &json!("a")).unwrap(), "a");
        assert_eq!(message_text(0, &json!(null)).unwrap(), "");
        let parts = json!([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]);
        assert_eq!(message_text(0, &parts).unwrap(), "a\nb");
        let img = json!([{"type": "image_url", "image_url": {"url": "x"}}]);
        assert_eq!(message_text(2, &img).unwrap_err().param.as_deref(), Some("messages[2].content"));
    }

    #[test]
    fn sampling_validation() {
        let ok = SamplingFields { temperature: Some(0.0), top_k: Some(-1), ..Default::default() };
        let p = ok.to_params(5).unwrap();
        assert_eq!((p.temperature, p.top_k, p.max_tokens), (0.0, 0, 5));
        let cases: Vec<(SamplingFields, &str)> = vec![
            (SamplingFields { n: Some(2), ..Default::default() }, "n"),
            (SamplingFields { temperature: Some(-0.5), ..Default::default() }, "temperature"),
            (SamplingFields { top_p: Some(0.0), ..Default::default() }, "top_p"),
            (SamplingFields { top_k: Some(-2), ..Default::default() }, "top_k"),
            (SamplingFields { logprobs: Some(json!(3)), ..Default::default() }, "logprobs"),
        ];
        for (fields, param) in cases {
            assert_eq!(fields.to_params(1).unwrap_err().param.as_deref(), Some(param));
        }
        assert!(parse_max_tokens("max_tokens", Some(0)).is_err());
        assert_eq!(parse_max_tokens("max_tokens", Some(3)).unwrap(), Some(3));
    }
}

#[cfg(test)]
mod body_tests {
    use super::*;
    use crate::error::parse_json;

    #[test]
    fn sampling_fields_parse_and_type_errors_name_them() {
        let req: CompletionRequest =
            parse_json(br#"{"prompt":"a","temperature":1,"top_k":5,"seed":9,"stop":["x"],"user":"u"}"#).unwrap();
        let sampling = req.sampling();
        assert_eq!(sampling.temperature, Some(1.0));
        assert_eq!(sampling.top_k, Some(5));
        assert_eq!(sampling.seed, Some(9));
        let err = parse_json::<CompletionRequest>(br#"{"prompt":"a","temperature":"hot"}"#).unwrap_err();
        assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(err.param.as_deref(), Some("temperature"), "{err:?}");
    }
}
