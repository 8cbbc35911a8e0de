//! Tool calls on chat completions, as OpenAI and vLLM shape them.
//!
//! A request's `tools` (functions with JSON-schema parameters) go to the
//! chat template as its `tools` variable, and its `tool_choice` decides
//! how calls come back:
//! - `none`: the answer is text;
//! - `auto`: the model writes calls in its own format when it wants to, and
//!   the server's parser (`--enable-auto-tool-choice --tool-call-parser
//!   NAME`: `hermes`, `<tool_call>{"name":..,"arguments":..}</tool_call>`,
//!   or `llama3_json`, a bare `{"name":..,"parameters":..}`) reads them;
//!   text outside the calls is the content;
//! - `required`: constrained decoding makes the answer a JSON list of one
//!   or more `{"name", "parameters"}` (one when `parallel_tool_calls` is
//!   false), each naming a tool with arguments valid for it;
//! - a named function: constrained decoding makes the answer that
//!   function's arguments.
//!
//! A message with calls has `tool_calls` in OpenAI's shape (`id`, `type:
//! function`, `function: {name, arguments}` with the arguments as a JSON
//! string) and finishes with `tool_calls`; streamed, the calls come as one
//! delta each once read, and text that may open a call is held back until
//! it is known not to.

use std::str::FromStr;

use pdkv_structured::{JsonOptions, Spec};
use serde_json::{json, Value};

use crate::error::ApiError;

/// How the server reads calls a model writes on its own (`auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Parser {
    /// `<tool_call>{"name": .., "arguments": {..}}</tool_call>` (Qwen2.5,
    /// Qwen3, Hermes and others).
    Hermes,
    /// A JSON object `{"name": .., "parameters": {..}}` as the whole
    /// answer, optionally after `<|python_tag|>`; several separated by `;`
    /// (Llama 3.1 and later).
    Llama3Json,
}

impl std::fmt::Display for Parser {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Parser::Hermes => "hermes",
            Parser::Llama3Json => "llama3_json",
        })
    }
}

impl FromStr for Parser {
    type Err = String;
    fn from_str(s: &str) -> Result<Parser, String> {
        match s {
            "hermes" => Ok(Parser::Hermes),
            "llama3_json" => Ok(Parser::Llama3Json),
            other => Err(format!(
                "unknown tool call parser {other:?}: hermes or llama3_json"
            )),
        }
    }
}

/// A request's `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// One function a request offers.
#[derive(Clone, Debug, PartialEq)]
pub struct Tool {
    pub name: String,
    /// Its arguments' JSON schema (any object when absent).
    pub parameters: Value,
}

/// A request's tools and how it wants them called.
#[derive(Clone, Debug, PartialEq)]
pub struct Tools {
    pub tools: Vec<Tool>,
    /// `tools` as sent, for the template.
    pub listed: Value,
    pub choice: Choice,
    pub parallel: bool,
    /// The server's parser (for `auto`).
    pub parser: Option<Parser>,
}

/// A call read from an answer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Call {
    pub name: String,
    /// JSON text.
    pub arguments: String,
}

/// Reads `tools`, `tool_choice` and `parallel_tool_calls` (`None`: the
/// request has no tools, or says `none` with none).
pub fn parse(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
    parallel: Option<&Value>,
    parser: Option<Parser>,
) -> Result<Option<Tools>, ApiError> {
    let bad = |p: &str, m: String| ApiError::invalid_param(p, m);
    let listed = tools.filter(|v| !v.is_null()).cloned().unwrap_or(json!([]));
    let items = listed
        .as_array()
        .ok_or_else(|| bad("tools", format!("must be a list, got {listed}")))?;
    let mut parsed = Vec::with_capacity(items.len());
    for (i, t) in items.iter().enumerate() {
        let p = format!("tools[{i}]");
        if t.get("type").and_then(Value::as_str) != Some("function") {
            return Err(bad(
                &format!("{p}.type"),
                "only function tools exist: \"function\"".into(),
            ));
        }
        let f = t
            .get("function")
            .and_then(Value::as_object)
            .ok_or_else(|| {
                bad(
                    &format!("{p}.function"),
                    "is required: {\"name\": .., \"parameters\": {..}}".into(),
                )
            })?;
        let name = f
            .get("name")
            .and_then(Value::as_str)
            .filter(|n| !n.is_empty())
            .ok_or_else(|| {
                bad(
                    &format!("{p}.function.name"),
                    "must be a non-empty string".into(),
                )
            })?;
        if parsed.iter().any(|x: &Tool| x.name == name) {
            return Err(bad(
                &format!("{p}.function.name"),
                format!("two tools are named {name:?}"),
            ));
        }
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object"}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => {
                return Err(bad(
                    &format!("{p}.function.parameters"),
                    format!("must be a JSON schema object, got {v}"),
                ))
            }
        };
        parsed.push(Tool {
            name: name.to_string(),
            parameters,
        });
    }
    let choice = match tool_choice.filter(|v| !v.is_null()) {
        // OpenAI's default: auto with tools, none without.
        None if parsed.is_empty() => Choice::None,
        None => Choice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "none" => Choice::None,
            "auto" => Choice::Auto,
            "required" => Choice::Required,
            other => return Err(bad("tool_choice", format!("unknown choice {other:?}: none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}"))),
        },
        Some(v) => {
            let name = v
                .get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                .ok_or_else(|| bad("tool_choice", format!("must be none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ..}}}}, got {v}")))?;
            Choice::Named(name.to_string())
        }
    };
    let parallel = match parallel.filter(|v| !v.is_null()) {
        None => true,
        Some(Value::Bool(b)) => *b,
        Some(v) => {
            return Err(bad(
                "parallel_tool_calls",
                format!("must be a boolean, got {v}"),
            ))
        }
    };
    match &choice {
        Choice::None if parsed.is_empty() => return Ok(None),
        Choice::Required | Choice::Named(_) if parsed.is_empty() => {
            return Err(bad("tool_choice", "needs tools to choose from".into()))
        }
        Choice::Named(n) if !parsed.iter().any(|t| &t.name == n) => {
            return Err(bad("tool_choice", format!("names {n:?}, which is not among the tools")))
        }
        Choice::Auto if parser.is_none() => {
            return Err(bad(
                "tool_choice",
                "\"auto\" tool choice needs the server started with --enable-auto-tool-choice and --tool-call-parser NAME".into(),
            ))
        }
        _ => {}
    }
    Ok(Some(Tools {
        tools: parsed,
        listed,
        choice,
        parallel,
        parser,
    }))
}

impl Tools {
    /// The constraint the choice needs: the arguments of the named
    /// function, or a list of calls for `required`.
    pub fn spec(&self) -> Option<Spec> {
        let options = JsonOptions::default();
        match &self.choice {
            Choice::Named(n) => {
                let t = self.tools.iter().find(|t| &t.name == n).expect("checked");
                Some(Spec::Json {
                    schema: t.parameters.clone(),
                    options,
                })
            }
            Choice::Required => {
                let calls: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|t| {
                        json!({"type": "object",
                            "properties": {"name": {"const": t.name}, "parameters": t.parameters},
                            "required": ["name", "parameters"], "additionalProperties": false})
                    })
                    .collect();
                let mut schema = json!({"type": "array", "minItems": 1, "items": {"anyOf": calls}});
                if !self.parallel {
                    schema["maxItems"] = json!(1);
                }
                Some(Spec::Json { schema, options })
            }
            Choice::None | Choice::Auto => None,
        }
    }

    /// Whether answers are read for calls at all.
    pub fn reads_calls(&self) -> bool {
        self.choice != Choice::None
    }

    /// An answer's content (`None` when it is only calls) and calls.
    pub fn read(&self, text: &str) -> (Option<String>, Vec<Call>) {
        let calls = match &self.choice {
            Choice::None => None,
            Choice::Named(n) => Some(vec![Call {
                name: n.clone(),
                arguments: text.trim().to_string(),
            }]),
            Choice::Required => read_required(text),
            Choice::Auto => match self.parser {
                Some(Parser::Hermes) => return read_hermes(text, self.parallel),
                Some(Parser::Llama3Json) => read_llama3(text),
                None => None,
            },
        };
        match calls {
            Some(mut c) if !c.is_empty() => {
                if !self.parallel {
                    c.truncate(1);
                }
                (None, c)
            }
            _ => (Some(text.to_string()), Vec::new()),
        }
    }

    /// How much of `text` (an answer so far) may be streamed as content
    /// now: everything before what may open a call.
    pub fn streamable(&self, text: &str) -> usize {
        match (&self.choice, self.parser) {
            (Choice::None, _) => text.len(),
            (Choice::Auto, Some(Parser::Hermes)) => match text.find(HERMES_OPEN) {
                Some(at) => at,
                // Hold back a tail that may be the tag's beginning.
                None => (1..HERMES_OPEN.len())
                    .rev()
                    .find(|&k| text.ends_with(&HERMES_OPEN[..k]))
                    .map_or(text.len(), |k| text.len() - k),
            },
            (Choice::Auto, Some(Parser::Llama3Json)) => {
                let t = text.trim_start();
                if t.is_empty()
                    || t.starts_with('{')
                    || PYTHON_TAG.starts_with(t)
                    || t.starts_with(PYTHON_TAG)
                {
                    0
                } else {
                    text.len()
                }
            }
            _ => 0,
        }
    }
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

fn call_from(v: &Value, args_key: &[&str]) -> Option<Call> {
    let name = v.get("name")?.as_str()?.to_string();
    let args = args_key
        .iter()
        .find_map(|k| v.get(*k))
        .cloned()
        .unwrap_or(json!({}));
    let arguments = match args {
        Value::String(s) => s,
        other => other.to_string(),
    };
    Some(Call { name, arguments })
}

fn read_required(text: &str) -> Option<Vec<Call>> {
    let v: Value = serde_json::from_str(text.trim()).ok()?;
    v.as_array()?
        .iter()
        .map(|c| call_from(c, &["parameters", "arguments"]))
        .collect()
}

/// Hermes: content before the first tag; each tag's JSON a call. A tag
/// whose JSON does not parse leaves the whole answer as content.
fn read_hermes(text: &str, parallel: bool) -> (Option<String>, Vec<Call>) {
    let Some(first) = text.find(HERMES_OPEN) else {
        return (Some(text.to_string()), Vec::new());
    };
    let mut calls = Vec::new();
    let mut rest = &text[first..];
    while let Some(at) = rest.find(HERMES_OPEN) {
        let body = &rest[at + HERMES_OPEN.len()..];
        let (inner, after) = match body.find(HERMES_CLOSE) {
            Some(end) => (&body[..end], &body[end + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        let call = serde_json::from_str::<Value>(inner.trim())
            .ok()
            .and_then(|v| call_from(&v, &["arguments", "parameters"]));
        match call {
            Some(c) => calls.push(c),
            None => return (Some(text.to_string()), Vec::new()),
        }
        rest = after;
    }
    if !parallel {
        calls.truncate(1);
    }
    let content = text[..first].trim();
    ((!content.is_empty()).then(|| content.to_string()), calls)
}

fn read_llama3(text: &str) -> Option<Vec<Call>> {
    let t = text.trim();
    let t = t.strip_prefix(PYTHON_TAG).unwrap_or(t).trim();
    if !t.starts_with('{') {
        return None;
    }
    // One object, or several separated by `;`.
    let mut calls = Vec::new();
    let mut rest = t;
    loop {
        let mut objects = serde_json::Deserializer::from_str(rest).into_iter::<Value>();
        let v = objects.next()?.ok()?;
        calls.push(call_from(&v, &["parameters", "arguments"])?);
        rest = rest[objects.byte_offset()..].trim_start();
        if rest.is_empty() {
            return Some(calls);
        }
        rest = rest.strip_prefix(';')?.trim_start();
    }
}

/// OpenAI's `tool_calls` of a message: ids from `ids`.
pub fn calls_json(calls: &[Call], mut ids: impl FnMut() -> String) -> Value {
    Value::Array(
        calls
            .iter()
            .map(|c| json!({"id": ids(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect(),
    )
}

/// A fresh id for a call.
pub fn call_id() -> String {
    let mut b = [0u8; 12];
    // The system's entropy; a counter-free id is all a call needs.
    if getrandom::fill(&mut b).is_err() {
        b = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| {
                d.as_nanos().to_le_bytes()[..12]
                    .try_into()
                    .expect("12 bytes")
            })
            .unwrap_or_default();
    }
    let hex: String = b.iter().map(|x| format!("{x:02x}")).collect();
    format!("chatcmpl-tool-{hex}")
}

/// A whole answer's message and finish reason: its calls read out (the
/// finish reason `tool_calls` when there are some and the answer ended by
/// itself).
pub fn message(
    tools: &Tools,
    text: &str,
    finish: pdkv_engine::FinishReason,
) -> (Value, &'static str) {
    let (content, calls) = tools.read(text);
    let mut m = json!({"role": "assistant", "content": content});
    if calls.is_empty() {
        return (m, finish.as_str());
    }
    m["tool_calls"] = calls_json(&calls, call_id);
    (m, with_calls(finish))
}

/// The finish reason of an answer with calls: `tool_calls` when it ended by
/// itself, else its own (a cut answer keeps `length`).
fn with_calls(finish: pdkv_engine::FinishReason) -> &'static str {
    match finish {
        pdkv_engine::FinishReason::Stop => "tool_calls",
        other => other.as_str(),
    }
}

/// One streamed choice's reading: the text so far and how much of it went
/// out as content.
#[derive(Debug, Default)]
pub struct Streamed {
    text: String,
    sent: usize,
}

impl Streamed {
    /// The delta for an output adding `text` (and ending with `finish`),
    /// and the finish reason to show.
    pub fn push(
        &mut self,
        tools: &Tools,
        text: &str,
        finish: Option<pdkv_engine::FinishReason>,
    ) -> (Value, Option<&'static str>) {
        self.text.push_str(text);
        let Some(finish) = finish else {
            let upto = tools.streamable(&self.text).max(self.sent);
            let piece = &self.text[self.sent..upto];
            self.sent = upto;
            return (content_delta(piece), None);
        };
        let (content, calls) = tools.read(&self.text);
        if calls.is_empty() {
            // No calls: the rest is content.
            let piece = &self.text[self.sent..];
            self.sent = self.text.len();
            return (content_delta(piece), Some(finish.as_str()));
        }
        // Content before the calls went out already (as held back, the
        // calls' text never did); what remains of the content goes now.
        let mut delta = json!({});
        let said = content.unwrap_or_default();
        let already = self.text[..self.sent].trim();
        if let Some(rest) = said.strip_prefix(already).filter(|r| !r.is_empty()) {
            delta["content"] = json!(rest);
        }
        let list: Vec<Value> = calls_json(&calls, call_id)
            .as_array()
            .expect("a list")
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut c = c.clone();
                c["index"] = json!(k);
                c
            })
            .collect();
        delta["tool_calls"] = Value::Array(list);
        self.sent = self.text.len();
        (delta, Some(with_calls(finish)))
    }
}

fn content_delta(piece: &str) -> Value {
    if piece.is_empty() {
        json!({})
    } else {
        json!({"content": piece})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pdkv_engine::FinishReason;

    fn weather() -> Value {
        json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}])
    }

    fn tools(choice: Value, parser: Option<Parser>) -> Tools {
        parse(Some(&weather()), Some(&choice), None, parser)
            .unwrap()
            .expect("tools")
    }

    #[test]
    fn choices_read_and_refused_by_field() {
        assert_eq!(tools(json!("required"), None).choice, Choice::Required);
        let named = json!({"type": "function", "function": {"name": "get_time"}});
        assert_eq!(tools(named, None).choice, Choice::Named("get_time".into()));
        assert_eq!(parse(None, None, None, None).unwrap(), None);
        assert_eq!(
            parse(Some(&json!([])), Some(&json!("none")), None, None).unwrap(),
            None
        );
        let t = weather();
        let refused = [
            (parse(Some(&t), None, None, None), "tool_choice"),
            (
                parse(Some(&t), Some(&json!("auto")), None, None),
                "tool_choice",
            ),
            (
                parse(Some(&t), Some(&json!("sometimes")), None, None),
                "tool_choice",
            ),
            (
                parse(
                    Some(&t),
                    Some(&json!({"type": "function", "function": {"name": "nope"}})),
                    None,
                    None,
                ),
                "tool_choice",
            ),
            (
                parse(None, Some(&json!("required")), None, None),
                "tool_choice",
            ),
            (
                parse(Some(&json!([{"type": "code"}])), None, None, None),
                "tools[0].type",
            ),
            (
                parse(
                    Some(&json!([{"type": "function", "function": {}}])),
                    None,
                    None,
                    None,
                ),
                "tools[0].function.name",
            ),
            (
                parse(
                    Some(&t),
                    Some(&json!("required")),
                    Some(&json!("yes")),
                    None,
                ),
                "parallel_tool_calls",
            ),
        ];
        for (r, param) in refused {
            assert_eq!(r.unwrap_err().param.as_deref(), Some(param));
        }
        assert!("hermes".parse::<Parser>().is_ok() && "pythonic".parse::<Parser>().is_err());
    }

    #[test]
    fn required_and_named_answers_become_calls() {
        let t = tools(json!("required"), None);
        let Some(Spec::Json { schema, .. }) = t.spec() else {
            panic!("a JSON spec")
        };
        assert_eq!(schema["items"]["anyOf"].as_array().unwrap().len(), 2);
        assert!(schema.get("maxItems").is_none(), "parallel by default");
        let (content, calls) = t.read(r#"[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]"#);
        assert_eq!(content, None);
        assert_eq!(
            calls,
            vec![
                Call {
                    name: "get_weather".into(),
                    arguments: r#"{"city":"Oslo"}"#.into()
                },
                Call {
                    name: "get_time".into(),
                    arguments: "{}".into()
                },
            ]
        );
        let one = parse(
            Some(&weather()),
            Some(&json!("required")),
            Some(&json!(false)),
            None,
        )
        .unwrap()
        .unwrap();
        let Some(Spec::Json { schema, .. }) = one.spec() else {
            panic!()
        };
        assert_eq!(schema["maxItems"], 1);
        let named = tools(
            json!({"type": "function", "function": {"name": "get_weather"}}),
            None,
        );
        let Some(Spec::Json { schema, .. }) = named.spec() else {
            panic!()
        };
        assert_eq!(schema["required"], json!(["city"]));
        let (m, finish) = message(&named, " {\"city\": \"Rome\"}", FinishReason::Stop);
        assert_eq!(finish, "tool_calls");
        assert_eq!(m["content"], Value::Null);
        assert_eq!(
            m["tool_calls"][0]["function"],
            json!({"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"})
        );
        assert!(m["tool_calls"][0]["id"]
            .as_str()
            .unwrap()
            .starts_with("chatcmpl-tool-"));
        let (m, finish) = message(&named, "{\"city\": \"Ro", FinishReason::Length);
        assert_eq!(finish, "length", "a truncated call says so");
        assert!(m["tool_calls"].is_array());
    }

    #[test]
    fn auto_answers_are_parsed_by_the_servers_parser() {
        let h = tools(json!("auto"), Some(Parser::Hermes));
        let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
        let (content, calls) = h.read(text);
        assert_eq!(content.as_deref(), Some("Let me check."));
        assert_eq!(
            calls,
            vec![Call {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            }]
        );
        assert_eq!(h.read("Just text."), (Some("Just text.".into()), vec![]));
        assert_eq!(
            h.read("<tool_call>{broken</tool_call>").1,
            vec![],
            "unparsable calls stay text"
        );
        let l = tools(json!("auto"), Some(Parser::Llama3Json));
        let (content, calls) = l.read("<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}; {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b\"}}");
        assert_eq!(content, None);
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments, r#"{"city":"a;b"}"#);
        assert_eq!(l.read("Hello {there}").1, vec![]);
    }

    #[test]
    fn streams_hold_back_what_may_open_a_call() {
        let h = tools(json!("auto"), Some(Parser::Hermes));
        let mut s = Streamed::default();
        let mut content = String::new();
        let mut last = None;
        for piece in [
            "Let me ",
            "check.<tool",
            "_call>{\"name\": \"get_time\", ",
            "\"arguments\": {}}</tool_call>",
        ] {
            let (d, f) = s.push(&h, piece, None);
            assert!(d.get("tool_calls").is_none());
            content.push_str(d["content"].as_str().unwrap_or(""));
            last = f;
        }
        assert_eq!(last, None);
        assert_eq!(content, "Let me check.");
        let (d, f) = s.push(&h, "", Some(FinishReason::Stop));
        assert_eq!(f, Some("tool_calls"));
        assert_eq!(d["tool_calls"][0]["function"]["name"], "get_time");
        assert_eq!(d["tool_calls"][0]["index"], 0);
        assert!(d.get("content").is_none(), "the content went out already");
        // A held-back "<tool" that turns out to be text is sent in the end.
        let mut s = Streamed::default();
        let (d, _) = s.push(&h, "a <tool", None);
        assert_eq!(d["content"], "a ");
        let (d, f) = s.push(&h, "box", Some(FinishReason::Stop));
        assert_eq!((d["content"].as_str(), f), (Some("<toolbox"), Some("stop")));
        // A named call cut by max_tokens comes as a call, finishing `length`.
        let named = tools(
            json!({"type": "function", "function": {"name": "get_time"}}),
            None,
        );
        let mut s = Streamed::default();
        let (d, _) = s.push(&named, "{\"timezone\": \"U", None);
        assert_eq!(d, json!({}), "held back");
        let (d, f) = s.push(&named, "TC", Some(FinishReason::Length));
        assert_eq!(f, Some("length"));
        assert_eq!(
            d["tool_calls"][0]["function"]["arguments"],
            "{\"timezone\": \"UTC"
        );
    }
}
