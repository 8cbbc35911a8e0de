//! OpenAI request bodies and their validation into engine terms.
//!
//! Every field the server accepts takes effect. Fields it does not implement
//! but that change what a client gets back (`best_of` above `n`, `suffix`,
//! `tools`, ...) are refused with a
//! 400 naming the field rather than silently ignored ([`crate::fields`]
//! screens the vLLM fields no struct here has). Ignored are only fields
//! that change nothing here: `user`, `spaces_between_special_tokens` (it
//! affects slow tokenizers only), and the reasoning-parser switches
//! vllm-router adds to every request (`separate_reasoning`,
//! `stream_reasoning`, `include_reasoning`); and, with a WARN and a count
//! in `/metrics`, fields vLLM does not know either.

use pdkv_engine::{SamplingParams, MAX_LOGPROBS};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::sse::StreamUsage;

/// Default `max_tokens` of `/v1/completions`, as in the OpenAI API.
pub const DEFAULT_COMPLETION_MAX_TOKENS: u32 = 16;

/// A streamed request's `stream_options`, as vLLM reads them.
#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// End with a usage chunk. Absent, true where `stream_options` is
    /// given at all (vLLM's default); null, false.
    #[serde(default = "absent_is_true")]
    pub include_usage: Option<bool>,
    /// With `include_usage`: every chunk carries its choice's usage so far.
    #[serde(default)]
    pub continuous_usage_stats: Option<bool>,
}

fn absent_is_true() -> Option<bool> {
    Some(true)
}

impl StreamOptions {
    /// What a stream with these options (if any) says of its usage.
    pub fn usage(options: Option<&StreamOptions>) -> StreamUsage {
        let include = options.is_some_and(|o| o.include_usage == Some(true));
        StreamUsage {
            include,
            continuous: include && options.is_some_and(|o| o.continuous_usage_stats == Some(true)),
        }
    }
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
            pub min_p: Option<f64>,
            /// vLLM's range, a 64-bit signed integer (see [`seed_bits`]).
            pub seed: Option<i64>,
            pub stop: Option<Value>,
            pub stop_token_ids: Option<Vec<u32>>,
            pub include_stop_str_in_output: Option<bool>,
            pub allowed_token_ids: Option<Vec<u32>>,
            pub ignore_eos: Option<bool>,
            /// Keep only the last k prompt tokens (`-1`: the model's limit).
            pub truncate_prompt_tokens: Option<i64>,
            /// Whether tokenizing a text prompt adds BOS and the like
            /// (completions: yes; chat: no, the template places them).
            pub add_special_tokens: Option<bool>,
            /// Affects only slow (Python) tokenizers; this tokenizer decodes
            /// the same either way (typed, so a wrong type is still a 400).
            pub spaces_between_special_tokens: Option<bool>,
            pub n: Option<i64>,
            /// Requests of different salts share no prefix-cache entry.
            pub cache_salt: Option<String>,
            pub best_of: Option<i64>,
            pub logprobs: Option<Value>,
            pub top_logprobs: Option<Value>,
            pub presence_penalty: Option<f64>,
            pub frequency_penalty: Option<f64>,
            pub repetition_penalty: Option<f64>,
            pub min_tokens: Option<i64>,
            pub logit_bias: Option<Value>,
            pub prompt_logprobs: Option<Value>,
            pub return_token_ids: Option<bool>,
            /// Log-probabilities name tokens `token_id:N` instead of text.
            pub return_tokens_as_token_ids: Option<bool>,
            pub response_format: Option<Value>,
            pub structured_outputs: Option<Value>,
            pub guided_json: Option<Value>,
            pub guided_regex: Option<Value>,
            pub guided_choice: Option<Value>,
            pub guided_grammar: Option<Value>,
            pub guided_whitespace_pattern: Option<Value>,
            pub guided_decoding_backend: Option<Value>,
            pub tools: Option<Value>,
            pub tool_choice: Option<Value>,
            pub skip_special_tokens: Option<bool>,
            pub no_stop_trim: Option<bool>,
            pub return_hidden_states: Option<bool>,
            pub continue_final_message: Option<bool>,
            // Reasoning-parser switches: there is no reasoning parser here,
            // so they change nothing (typed, so a wrong type is still a 400).
            pub separate_reasoning: Option<bool>,
            pub stream_reasoning: Option<bool>,
            pub include_reasoning: Option<bool>,
        }

        impl $name {
            /// The sampling fields, for validation.
            pub fn sampling(&self) -> SamplingFields {
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
                    n: self.n,
                    best_of: self.best_of,
                    logprobs: self.logprobs.clone(),
                    top_logprobs: self.top_logprobs.clone(),
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    min_tokens: self.min_tokens,
                    logit_bias: self.logit_bias.clone(),
                    prompt_logprobs: self.prompt_logprobs.clone(),
                    response_format: self.response_format.clone(),
                    structured_outputs: self.structured_outputs.clone(),
                    guided_json: self.guided_json.clone(),
                    guided_regex: self.guided_regex.clone(),
                    guided_choice: self.guided_choice.clone(),
                    guided_grammar: self.guided_grammar.clone(),
                    guided_whitespace_pattern: self.guided_whitespace_pattern.clone(),
                    guided_decoding_backend: self.guided_decoding_backend.clone(),
                    tools: self.tools.clone(),
                    tool_choice: self.tool_choice.clone(),
                    skip_special_tokens: self.skip_special_tokens,
                    no_stop_trim: self.no_stop_trim,
                    return_hidden_states: self.return_hidden_states,
                    continue_final_message: self.continue_final_message,
                    // A chat completion's own field (set by its handler).
                    structural_tag: None,
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
    pub min_p: Option<f64>,
    pub seed: Option<i64>,
    pub stop: Option<Value>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub include_stop_str_in_output: Option<bool>,
    pub allowed_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<Value>,
    pub presence_penalty: Option<f64>,
    pub frequency_penalty: Option<f64>,
    pub repetition_penalty: Option<f64>,
    pub min_tokens: Option<i64>,
    pub logit_bias: Option<Value>,
    pub prompt_logprobs: Option<Value>,
    /// Structured outputs, in OpenAI's and vLLM's spellings (see
    /// [`SamplingFields::structured`]).
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<Value>,
    pub guided_choice: Option<Value>,
    pub guided_grammar: Option<Value>,
    pub guided_whitespace_pattern: Option<Value>,
    pub guided_decoding_backend: Option<Value>,
    pub tools: Option<Value>,
    pub tool_choice: Option<Value>,
    pub skip_special_tokens: Option<bool>,
    pub no_stop_trim: Option<bool>,
    pub return_hidden_states: Option<bool>,
    pub continue_final_message: Option<bool>,
    /// Chat completions only: vLLM's top-level `structural_tag`.
    pub structural_tag: Option<Value>,
}

/// A request's seed as the sampler takes it: vLLM takes any 64-bit signed
/// integer (a client may send `-1`); a negative one is its two's-complement
/// bits, so distinct seeds stay distinct.
pub fn seed_bits(seed: i64) -> u64 {
    seed as u64
}

/// Which endpoint a body came to: they spell `logprobs` differently.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `logprobs: k`, an integer in `0..=20`.
    Completions,
    /// `logprobs: true` plus `top_logprobs: k`.
    Chat,
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
        /// vLLM's chat `echo` (the last message prepended): only false.
        pub echo: Option<bool>,
        pub stream_options: Option<StreamOptions>,
        /// The engine request id to use (an `X-Request-Id` header wins).
        pub request_id: Option<String>,
        /// Handed to the engine's KV connector (P/D disaggregation).
        pub kv_transfer_params: Option<Value>,
        /// Extra variables for the chat template (e.g. `enable_thinking`).
        pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
        /// Whether to end the prompt with the assistant's turn opening.
        pub add_generation_prompt: Option<bool>,
        /// Several calls in one answer (default true).
        pub parallel_tool_calls: Option<Value>,
        /// vLLM's older spelling of a structural tag: its JSON as a string.
        pub structural_tag: Option<Value>,
    }
}

#[derive(Debug, Deserialize)]
pub struct ChatMessageIn {
    pub role: String,
    /// A string, a list of `{"type":"text","text":..}` parts, or null.
    #[serde(default)]
    pub content: Value,
    /// An assistant's calls (OpenAI's shape), passed to the template.
    pub tool_calls: Option<Value>,
    /// A tool message's call.
    pub tool_call_id: Option<String>,
    /// A tool message's tool.
    pub name: Option<String>,
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
                return Ok(Prompt::Text(
                    items[0].as_str().unwrap_or_default().to_string(),
                ));
            }
            if items.iter().all(Value::is_array) {
                if items.len() != 1 {
                    return Err(bad("only one prompt per request is supported"));
                }
                return parse_prompt(&items[0]).and_then(|p| match p {
                    Prompt::Tokens(t) => Ok(Prompt::Tokens(t)),
                    Prompt::Text(_) => Err(bad(
                        "prompt must be a string, a list of token ids, or a list of one of those",
                    )),
                });
            }
            let ids = items
                .iter()
                .map(|x| x.as_u64().and_then(|i| u32::try_from(i).ok()))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| {
                    bad("prompt must be a string, a list of token ids, or a list of one of those")
                })?;
            Ok(Prompt::Tokens(ids))
        }
        Value::Null => Err(bad("prompt is required")),
        _ => Err(bad(
            "prompt must be a string, a list of token ids, or a list of one of those",
        )),
    }
}

/// Most prompts one `/v1/completions` request may carry.
pub const MAX_PROMPTS: usize = 64;

/// Reads `prompt` as a batch: a list of several strings or of several lists
/// of token ids is one prompt each (their choices are numbered prompt by
/// prompt, as vLLM numbers them); anything else is one prompt
/// ([`parse_prompt`]).
pub fn parse_prompts(v: &Value) -> Result<Vec<Prompt>, ApiError> {
    let several = match v {
        Value::Array(items) if items.len() > 1 => {
            items.iter().all(Value::is_string) || items.iter().all(Value::is_array)
        }
        _ => false,
    };
    if !several {
        return parse_prompt(v).map(|p| vec![p]);
    }
    let items = v.as_array().expect("checked above");
    if items.len() > MAX_PROMPTS {
        return Err(ApiError::invalid_param(
            "prompt",
            format!(
                "at most {MAX_PROMPTS} prompts per request, got {}",
                items.len()
            ),
        ));
    }
    items
        .iter()
        .map(|item| match item {
            Value::String(s) => Ok(Prompt::Text(s.clone())),
            other => parse_prompt(other),
        })
        .collect()
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
                match (
                    part.get("type").and_then(Value::as_str),
                    part.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => texts.push(t),
                    (Some("text"), None) => {
                        return Err(ApiError::invalid_param(
                            &param,
                            "a text content part needs a string `text`",
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::invalid_param(
                            &param,
                            format!(
                                "content parts of type `{other}` are not supported; only `text`"
                            ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::invalid_param(
                            &param,
                            "each content part needs a `type`",
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(ApiError::invalid_param(
            &param,
            "content must be a string or a list of content parts",
        )),
    }
}

/// The messages of a conversation with their text contents.
/// The roles a message may have (OpenAI's; `developer` is its newer name
/// for `system`).
pub const CHAT_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

pub fn chat_messages(messages: &[ChatMessageIn]) -> Result<Vec<pdkv_model::ChatMessage>, ApiError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            if !CHAT_ROLES.contains(&m.role.as_str()) {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].role"),
                    format!(
                        "unknown role {:?} (one of: {})",
                        m.role,
                        CHAT_ROLES.join(", ")
                    ),
                ));
            }
            // OpenAI allows no content only on an assistant's turn.
            if m.content.is_null() && m.role != "assistant" {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].content"),
                    format!("a {} message needs content", m.role),
                ));
            }
            if m.role == "tool" && m.tool_call_id.is_none() {
                return Err(ApiError::invalid_param(
                    &format!("messages[{i}].tool_call_id"),
                    "a tool message needs the tool_call_id of the call it answers",
                ));
            }
            match &m.tool_calls {
                None | Some(Value::Null) => {}
                Some(Value::Array(_)) if m.role == "assistant" => {}
                Some(_) => {
                    return Err(ApiError::invalid_param(
                        &format!("messages[{i}].tool_calls"),
                        "tool_calls is a list, on an assistant's message",
                    ))
                }
            }
            Ok(pdkv_model::ChatMessage {
                role: m.role.clone(),
                content: message_text(i, &m.content)?,
                tool_calls: m.tool_calls.clone().filter(|v| !v.is_null()),
                tool_call_id: m.tool_call_id.clone(),
                name: m.name.clone(),
            })
        })
        .collect()
}

/// Whether a positive `v` stays positive and finite as an f32.
fn fits_f32(v: f64) -> bool {
    let f = v as f32;
    f.is_finite() && f > 0.0
}

/// Checks `max_tokens`-like fields: at least 1 and fits a u32.
pub fn parse_max_tokens(param: &str, v: Option<i64>) -> Result<Option<u32>, ApiError> {
    match v {
        None => Ok(None),
        Some(n) if n < 1 => Err(ApiError::invalid_param(
            param,
            format!("{param} must be at least 1, got {n}"),
        )),
        Some(n) => u32::try_from(n)
            .map(Some)
            .map_err(|_| ApiError::invalid_param(param, format!("{param} is too large: {n}"))),
    }
}

/// Reads an optional count field that must be an integer in `0..=max`
/// (null means absent).
fn count_field(param: &str, v: Option<&Value>, max: u32) -> Result<Option<u32>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match n.as_u64() {
            Some(k) if k <= max as u64 => Ok(Some(k as u32)),
            _ => Err(ApiError::invalid_param(
                param,
                format!("{param} must be an integer from 0 to {max}, got {n}"),
            )),
        },
        Some(other) => Err(ApiError::invalid_param(
            param,
            format!("{param} must be an integer from 0 to {max}, got {other}"),
        )),
    }
}

/// Reads `logit_bias`: an object from token id (a decimal string) to a
/// number. As vLLM does, a bias outside [-100, 100] is clamped into it; an id
/// outside the vocabulary is refused when the request is checked.
pub fn parse_logit_bias(v: Option<&Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("logit_bias", m);
    let map = match v {
        None | Some(Value::Null) => return Ok(Vec::new()),
        Some(Value::Object(map)) => map,
        Some(_) => {
            return Err(bad(
                "logit_bias must be an object from token id to bias".into()
            ))
        }
    };
    let mut out = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let id: u32 = key
            .parse()
            .map_err(|_| bad(format!("logit_bias keys must be token ids, got {key:?}")))?;
        let b = bias
            .as_f64()
            .filter(|b| b.is_finite())
            .ok_or_else(|| bad(format!("logit_bias[{key:?}] must be a number, got {bias}")))?;
        out.push((id, b.clamp(-100.0, 100.0) as f32));
    }
    out.sort_unstable_by_key(|&(id, _)| id);
    out.dedup_by_key(|&mut (id, _)| id);
    Ok(out)
}

impl SamplingFields {
    /// Validates the fields into engine sampling parameters (with
    /// `max_tokens` left at the given value), for a body sent to `endpoint`.
    pub fn to_params(
        &self,
        max_tokens: u32,
        endpoint: Endpoint,
    ) -> Result<SamplingParams, ApiError> {
        // `n` and `best_of` shape the group of choices (`choices::parse_n`).
        self.refuse_unsupported(endpoint)?;
        let logprobs = self.logprobs(endpoint)?;
        let prompt_logprobs = count_field(
            "prompt_logprobs",
            self.prompt_logprobs.as_ref(),
            MAX_LOGPROBS,
        )?;
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if let Some(p) = v.filter(|p| !(-2.0..=2.0).contains(p)) {
                return Err(ApiError::invalid_param(
                    name,
                    format!("{name} must be in [-2, 2], got {p}"),
                ));
            }
        }
        let repetition_penalty = self.repetition_penalty.unwrap_or(1.0);
        // The engine computes in f32: a value f32 cannot hold (0 or inf
        // once cast) is refused here, naming the value as given.
        if !(repetition_penalty > 0.0 && fits_f32(repetition_penalty)) {
            return Err(ApiError::invalid_param(
                "repetition_penalty",
                format!("repetition_penalty must be greater than 0 and hold in a 32-bit float ({:e} to {:e}), got {repetition_penalty:e}", f32::from_bits(1), f32::MAX),
            ));
        }
        let min_tokens = match self.min_tokens.unwrap_or(0) {
            m if m < 0 => {
                return Err(ApiError::invalid_param(
                    "min_tokens",
                    format!("min_tokens must be at least 0, got {m}"),
                ))
            }
            m if m > max_tokens as i64 => {
                return Err(ApiError::invalid_param(
                    "min_tokens",
                    format!("min_tokens ({m}) must not exceed max_tokens ({max_tokens})"),
                ))
            }
            m => m as u32,
        };
        let temperature = self.temperature.unwrap_or(1.0);
        if !temperature.is_finite() || !(0.0..=100.0).contains(&temperature) {
            return Err(ApiError::invalid_param(
                "temperature",
                format!("temperature must be in [0, 100], got {temperature}"),
            ));
        }
        let top_p = self.top_p.unwrap_or(1.0);
        if !(top_p > 0.0 && top_p <= 1.0 && fits_f32(top_p)) {
            return Err(ApiError::invalid_param(
                "top_p",
                format!("top_p must be in (0, 1] and hold in a 32-bit float (at least {:e}), got {top_p:e}", f32::from_bits(1)),
            ));
        }
        let min_p = self.min_p.unwrap_or(0.0);
        if !(0.0..=1.0).contains(&min_p) {
            return Err(ApiError::invalid_param(
                "min_p",
                format!("min_p must be in [0, 1], got {min_p}"),
            ));
        }
        if self.allowed_token_ids.as_ref().is_some_and(Vec::is_empty) {
            return Err(ApiError::invalid_param(
                "allowed_token_ids",
                "allowed_token_ids must not be empty",
            ));
        }
        let top_k = match self.top_k.unwrap_or(0) {
            -1 | 0 => 0,
            k if k > 0 => u32::try_from(k).unwrap_or(u32::MAX),
            k => {
                return Err(ApiError::invalid_param(
                    "top_k",
                    format!("top_k must be -1, 0 (off) or positive, got {k}"),
                ))
            }
        };
        Ok(SamplingParams {
            temperature: temperature as f32,
            top_p: top_p as f32,
            top_k,
            min_p: min_p as f32,
            allowed_token_ids: self.allowed_token_ids.clone(),
            include_stop_str_in_output: self.include_stop_str_in_output.unwrap_or(false),
            skip_special_tokens: self.skip_special_tokens.unwrap_or(true),
            seed: self.seed.map(seed_bits),
            max_tokens,
            stop: parse_stop(self.stop.as_ref())?,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            ignore_eos: self.ignore_eos.unwrap_or(false),
            min_tokens,
            repetition_penalty: repetition_penalty as f32,
            presence_penalty: self.presence_penalty.unwrap_or(0.0) as f32,
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0) as f32,
            logit_bias: parse_logit_bias(self.logit_bias.as_ref())?,
            return_logits: false,
            logprobs,
            prompt_logprobs,
            // Compiled apart (it may take a while): `crate::structured`.
            constraint: None,
        })
    }

    /// The fields that may ask for a structured output.
    pub fn structured(&self) -> pdkv_structured::Fields<'_> {
        pdkv_structured::Fields {
            response_format: self.response_format.as_ref(),
            structured_outputs: self.structured_outputs.as_ref(),
            guided_json: self.guided_json.as_ref(),
            guided_regex: self.guided_regex.as_ref(),
            guided_choice: self.guided_choice.as_ref(),
            guided_grammar: self.guided_grammar.as_ref(),
            guided_whitespace_pattern: self.guided_whitespace_pattern.as_ref(),
            guided_decoding_backend: self.guided_decoding_backend.as_ref(),
            structural_tag: self.structural_tag.as_ref(),
        }
    }

    /// The number of top log-probabilities per output token, as each
    /// endpoint spells it (`None`: no log-probabilities).
    fn logprobs(&self, endpoint: Endpoint) -> Result<Option<u32>, ApiError> {
        match endpoint {
            Endpoint::Completions => {
                if !matches!(self.top_logprobs, None | Some(Value::Null)) {
                    return Err(ApiError::invalid_param(
                        "top_logprobs",
                        "top_logprobs is a chat completions field; /v1/completions takes logprobs: k",
                    ));
                }
                match &self.logprobs {
                    // vllm-router sends `logprobs: false` with every request.
                    Some(Value::Bool(false)) => Ok(None),
                    v => count_field("logprobs", v.as_ref(), MAX_LOGPROBS),
                }
            }
            Endpoint::Chat => {
                let on = match &self.logprobs {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(other) => {
                        return Err(ApiError::invalid_param(
                            "logprobs",
                            format!("logprobs must be a boolean, got {other}"),
                        ))
                    }
                };
                let top = count_field("top_logprobs", self.top_logprobs.as_ref(), MAX_LOGPROBS)?;
                match (on, top) {
                    (true, top) => Ok(Some(top.unwrap_or(0))),
                    (false, Some(k)) if k > 0 => Err(ApiError::invalid_param(
                        "top_logprobs",
                        "top_logprobs needs logprobs: true",
                    )),
                    (false, _) => Ok(None),
                }
            }
        }
    }

    /// Refuses fields whose effect the server does not implement (see the
    /// module docs); their defaults are accepted.
    fn refuse_unsupported(&self, endpoint: Endpoint) -> Result<(), ApiError> {
        let refuse = |param: &str, m: &str| Err(ApiError::invalid_param(param, m.to_string()));
        // Tools are a chat completions matter (`crate::tools`).
        if endpoint == Endpoint::Completions {
            match &self.tools {
                None | Some(Value::Null) => {}
                Some(Value::Array(t)) if t.is_empty() => {}
                Some(_) => return refuse("tools", "tools go to /v1/chat/completions"),
            }
            match &self.tool_choice {
                None | Some(Value::Null) => {}
                Some(Value::String(c)) if c == "none" => {}
                Some(_) => return refuse("tool_choice", "tools go to /v1/chat/completions"),
            }
        }
        if self.no_stop_trim == Some(true) {
            return refuse(
                "no_stop_trim",
                "only no_stop_trim=false is supported (a matched stop string is cut from the text)",
            );
        }
        if self.return_hidden_states == Some(true) {
            return refuse(
                "return_hidden_states",
                "return_hidden_states is not supported",
            );
        }
        if endpoint == Endpoint::Completions && self.continue_final_message == Some(true) {
            return refuse(
                "continue_final_message",
                "continue_final_message continues a conversation's last message: it goes to /v1/chat/completions",
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn prompt_shapes() {
        assert_eq!(
            parse_prompt(&json!("hi")).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse_prompt(&json!(["hi"])).unwrap(),
            Prompt::Text("hi".into())
        );
        assert_eq!(
            parse_prompt(&json!([1, 2, 3])).unwrap(),
            Prompt::Tokens(vec![1, 2, 3])
        );
        assert_eq!(
            parse_prompt(&json!([[4, 5]])).unwrap(),
            Prompt::Tokens(vec![4, 5])
        );
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
        assert_eq!(
            parse_stop(Some(&json!(["x", "y"]))).unwrap(),
            vec!["x", "y"]
        );
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
        assert_eq!(
            message_text(2, &img).unwrap_err().param.as_deref(),
            Some("messages[2].content")
        );
    }

    #[test]
    fn sampling_validation() {
        let ok = SamplingFields {
            temperature: Some(0.0),
            top_k: Some(-1),
            ..Default::default()
        };
        let p = ok.to_params(5, Endpoint::Completions).unwrap();
        assert_eq!((p.temperature, p.top_k, p.max_tokens), (0.0, 0, 5));
        // Each body's one field is out of range or unsupported.
        let cases = [
            json!({"temperature": -0.5}),
            json!({"top_p": 0.0}),
            json!({"top_k": -2}),
            json!({"logprobs": 21}),
            json!({"logprobs": -1}),
            json!({"top_logprobs": 2}),
            json!({"prompt_logprobs": 25}),
            json!({"presence_penalty": 2.5}),
            json!({"frequency_penalty": -2.1}),
            json!({"repetition_penalty": 0.0}),
            json!({"min_tokens": 6}),
            json!({"min_tokens": -1}),
            json!({"logit_bias": {"x": 1}}),
            json!({"logit_bias": {"3": "high"}}),
            json!({"logit_bias": [1]}),
            json!({"tools": [{"type": "function"}]}),
            json!({"tool_choice": "auto"}),
            json!({"min_p": 1.5}),
            json!({"allowed_token_ids": []}),
            json!({"no_stop_trim": true}),
            json!({"return_hidden_states": true}),
            json!({"continue_final_message": true}),
        ];
        for mut body in cases {
            let param = body.as_object().unwrap().keys().next().unwrap().clone();
            body["prompt"] = json!("x");
            let req: CompletionRequest = serde_json::from_value(body.clone()).unwrap();
            let err = req
                .sampling()
                .to_params(5, Endpoint::Completions)
                .unwrap_err();
            assert_eq!(
                err.param.as_deref(),
                Some(param.as_str()),
                "{body}: {err:?}"
            );
        }
        assert!(parse_max_tokens("max_tokens", Some(0)).is_err());
        assert_eq!(parse_max_tokens("max_tokens", Some(3)).unwrap(), Some(3));
    }

    #[test]
    fn extras_reach_the_engine_params() {
        let fields = SamplingFields {
            min_tokens: Some(3),
            repetition_penalty: Some(1.3),
            presence_penalty: Some(-0.5),
            frequency_penalty: Some(0.25),
            logit_bias: Some(json!({"7": 150, "2": -3.5})),
            stop_token_ids: Some(vec![9]),
            ignore_eos: Some(true),
            prompt_logprobs: Some(json!(2)),
            // The defaults vllm-router sends are accepted.
            response_format: Some(json!({"type": "text"})),
            tools: Some(json!([])),
            tool_choice: Some(json!("none")),
            skip_special_tokens: Some(true),
            no_stop_trim: Some(false),
            return_hidden_states: Some(false),
            continue_final_message: Some(false),
            ..Default::default()
        };
        let p = fields.to_params(8, Endpoint::Completions).unwrap();
        assert_eq!(p.min_tokens, 3);
        assert!((p.repetition_penalty - 1.3).abs() < 1e-6);
        assert_eq!((p.presence_penalty, p.frequency_penalty), (-0.5, 0.25));
        assert_eq!(
            p.logit_bias,
            vec![(2, -3.5), (7, 100.0)],
            "sorted by id, clamped as vLLM does"
        );
        assert_eq!(
            (p.stop_token_ids.as_slice(), p.ignore_eos),
            (&[9u32][..], true)
        );
        assert_eq!((p.logprobs, p.prompt_logprobs), (None, Some(2)));
    }

    #[test]
    fn logprobs_as_each_endpoint_spells_them() {
        let with = |logprobs: Value, top: Option<Value>| SamplingFields {
            logprobs: Some(logprobs),
            top_logprobs: top,
            ..Default::default()
        };
        let cmpl = |f: SamplingFields| f.to_params(4, Endpoint::Completions).map(|p| p.logprobs);
        let chat = |f: SamplingFields| f.to_params(4, Endpoint::Chat).map(|p| p.logprobs);
        assert_eq!(cmpl(with(json!(3), None)).unwrap(), Some(3));
        assert_eq!(cmpl(with(json!(0), None)).unwrap(), Some(0));
        assert_eq!(cmpl(with(json!(false), None)).unwrap(), None);
        assert_eq!(
            cmpl(with(json!(true), None)).unwrap_err().param.as_deref(),
            Some("logprobs")
        );
        assert_eq!(chat(with(json!(true), Some(json!(5)))).unwrap(), Some(5));
        assert_eq!(chat(with(json!(true), None)).unwrap(), Some(0));
        assert_eq!(chat(with(json!(false), None)).unwrap(), None);
        assert_eq!(
            chat(with(json!(false), Some(json!(2))))
                .unwrap_err()
                .param
                .as_deref(),
            Some("top_logprobs")
        );
        assert_eq!(
            chat(with(json!(3), None)).unwrap_err().param.as_deref(),
            Some("logprobs")
        );
    }
}

#[cfg(test)]
mod body_tests {
    use super::*;
    use crate::error::parse_json;

    #[test]
    fn sampling_fields_parse_and_type_errors_name_them() {
        let req: CompletionRequest = parse_json(
            br#"{"prompt":"a","temperature":1,"top_k":5,"seed":9,"stop":["x"],"user":"u","separate_reasoning":true,"stream_reasoning":false,"include_reasoning":true,"echo":false,"logprobs":false,"min_tokens":0}"#,
        )
        .unwrap();
        let sampling = req.sampling();
        assert_eq!(sampling.temperature, Some(1.0));
        assert_eq!(sampling.top_k, Some(5));
        assert_eq!(sampling.seed, Some(9));
        // vLLM's seeds are signed 64-bit integers: -1 is one, 2^63 is not.
        let req: CompletionRequest = parse_json(br#"{"prompt":"a","seed":-1}"#).unwrap();
        let params = req.sampling().to_params(5, Endpoint::Completions).unwrap();
        assert_eq!(params.seed, Some(u64::MAX));
        let err = parse_json::<CompletionRequest>(br#"{"prompt":"a","seed":9223372036854775808}"#)
            .unwrap_err();
        assert_eq!(err.param.as_deref(), Some("seed"), "{err:?}");
        let err =
            parse_json::<CompletionRequest>(br#"{"prompt":"a","temperature":"hot"}"#).unwrap_err();
        assert_eq!(err.status, axum::http::StatusCode::BAD_REQUEST);
        assert_eq!(err.param.as_deref(), Some("temperature"), "{err:?}");
    }
}

impl crate::fields::Screen for CompletionRequest {
    const BODY: crate::fields::Body = crate::fields::Body::Completions;
}

impl crate::fields::Screen for ChatRequest {
    const BODY: crate::fields::Body = crate::fields::Body::Chat;
}
