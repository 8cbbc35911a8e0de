//! The request fields that ask for structured outputs, in vLLM's and
//! OpenAI's spellings, read into one [`Spec`]:
//!
//! - OpenAI's `response_format`: `{"type": "text"}` (none),
//!   `{"type": "json_object"}`, `{"type": "json_schema", "json_schema":
//!   {"name", "schema", "strict", "description"}}`;
//! - vLLM's `structured_outputs` object: exactly one of `json` (a schema,
//!   as an object or a string), `regex`, `choice`, `grammar`,
//!   `json_object`, plus the JSON options `disable_any_whitespace`,
//!   `disable_additional_properties`, `whitespace_pattern` and
//!   `disable_fallback` (there is one backend: nothing to fall back from);
//! - vLLM's older top-level fields `guided_json`, `guided_regex`,
//!   `guided_choice`, `guided_grammar`, `guided_whitespace_pattern`,
//!   `guided_decoding_backend` and (chat completions) `structural_tag`.
//!
//! Two ways of asking in one request, a field of the wrong type or an
//! unknown key are refused naming the field ([`FieldError`]).

use serde_json::{Map, Value};

/// What an output must follow.
#[derive(Clone, Debug, PartialEq)]
pub enum Spec {
    /// JSON valid against a schema.
    Json { schema: Value, options: JsonOptions },
    /// Any JSON object.
    JsonObject { options: JsonOptions },
    /// A regular expression (Rust `regex` syntax), matched whole.
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar (llguidance's dialect), or a GBNF one (rules written
    /// `name ::= ...`, converted to Lark; see [`crate::gbnf`]).
    Grammar(String),
    /// Free text in which each occurrence of a trigger opens one of the
    /// structures that begin with it: its `begin`, JSON valid against its
    /// schema, its `end` (vLLM's `structural_tag`).
    StructuralTag {
        structures: Vec<Structure>,
        triggers: Vec<String>,
    },
}

/// One structure of a [`Spec::StructuralTag`].
#[derive(Clone, Debug, PartialEq)]
pub struct Structure {
    pub begin: String,
    pub schema: Value,
    pub end: String,
}

/// How JSON may be laid out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JsonOptions {
    /// No whitespace between tokens (`disable_any_whitespace`): the
    /// output is compact JSON.
    pub compact: bool,
    /// Objects whose schema says nothing of `additionalProperties` get
    /// none (`disable_additional_properties`).
    pub no_additional_properties: bool,
    /// The whitespace allowed between tokens, as a regular expression
    /// (`whitespace_pattern`, `guided_whitespace_pattern`).
    pub whitespace_pattern: Option<String>,
}

impl Spec {
    /// What kind of constraint this is, for logs and metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            Spec::Json { .. } => "json",
            Spec::JsonObject { .. } => "json_object",
            Spec::Regex(_) => "regex",
            Spec::Choice(_) => "choice",
            Spec::Grammar(_) => "grammar",
            Spec::StructuralTag { .. } => "structural_tag",
        }
    }
}

/// A request field that cannot be read as a constraint: a 400 naming it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{param}: {message}")]
pub struct FieldError {
    /// The field, dotted into objects (`structured_outputs.json`).
    pub param: String,
    pub message: String,
}

fn err(param: impl Into<String>, message: impl Into<String>) -> FieldError {
    FieldError {
        param: param.into(),
        message: message.into(),
    }
}

/// The fields of one request that may ask for a constraint (absent and
/// null mean the same).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fields<'a> {
    pub response_format: Option<&'a Value>,
    pub structured_outputs: Option<&'a Value>,
    pub guided_json: Option<&'a Value>,
    pub guided_regex: Option<&'a Value>,
    pub guided_choice: Option<&'a Value>,
    pub guided_grammar: Option<&'a Value>,
    pub guided_whitespace_pattern: Option<&'a Value>,
    pub guided_decoding_backend: Option<&'a Value>,
    /// vLLM's top-level chat field: a structural tag as a JSON string
    /// (`{"type": "structural_tag", "structures", "triggers"}`).
    pub structural_tag: Option<&'a Value>,
}

fn given(v: Option<&Value>) -> Option<&Value> {
    v.filter(|v| !v.is_null())
}

/// The backends a request may name: they all mean this one.
const BACKENDS: &[&str] = &["auto", "guidance", "llguidance"];

/// A constraint and the field that asked for it.
#[derive(Clone, Debug, PartialEq)]
pub struct Asked {
    /// `response_format`, `structured_outputs` or the `guided_*` field.
    pub param: &'static str,
    pub spec: Spec,
}

impl Fields<'_> {
    /// The constraint these fields ask for (`None`: none).
    pub fn spec(&self) -> Result<Option<Spec>, FieldError> {
        Ok(self.asked()?.map(|a| a.spec))
    }

    /// The constraint these fields ask for and which field asked.
    pub fn asked(&self) -> Result<Option<Asked>, FieldError> {
        if let Some(b) = given(self.guided_decoding_backend) {
            let name = b.as_str().ok_or_else(|| {
                err(
                    "guided_decoding_backend",
                    format!("must be a string, got {b}"),
                )
            })?;
            // vLLM appends options after a colon ("guidance:no-fallback").
            let base = name.split(':').next().unwrap_or(name);
            if !BACKENDS.contains(&base) {
                return Err(err(
                    "guided_decoding_backend",
                    format!(
                        "backend {name:?} is not available: structured outputs run on llguidance (\"guidance\" or \"auto\")"
                    ),
                ));
            }
        }
        let (legacy_param, legacy) = match self.legacy()? {
            Some((p, s)) => (p, Some(s)),
            None => ("guided_json", None),
        };
        let structured = match given(self.structured_outputs) {
            Some(v) => Some(structured_outputs(v)?),
            None => None,
        };
        let format = match given(self.response_format) {
            Some(v) => response_format(v)?,
            None => None,
        };
        let mut asked: Vec<(&str, Spec)> = Vec::new();
        if let Some(s) = legacy {
            asked.push((legacy_param, s));
        }
        if let Some(s) = structured {
            asked.push(("structured_outputs", s));
        }
        if let Some(s) = format {
            asked.push(("response_format", s));
        }
        if asked.len() > 1 {
            let names: Vec<&str> = asked.iter().map(|(n, _)| *n).collect();
            return Err(err(
                asked[1].0,
                format!(
                    "a request asks for one constraint; this one names {}",
                    names.join(" and ")
                ),
            ));
        }
        let Some((param, mut spec)) = asked.pop() else {
            return match given(self.guided_whitespace_pattern) {
                Some(_) => Err(err(
                    "guided_whitespace_pattern",
                    "applies to JSON constraints only (guided_json, a json_schema response_format)",
                )),
                None => Ok(None),
            };
        };
        if let Some(w) = given(self.guided_whitespace_pattern) {
            let pattern = w.as_str().ok_or_else(|| {
                err(
                    "guided_whitespace_pattern",
                    format!("must be a string, got {w}"),
                )
            })?;
            match &mut spec {
                Spec::Json { options, .. } | Spec::JsonObject { options } => {
                    options.whitespace_pattern = Some(pattern.to_string());
                }
                _ => return Err(err(
                    "guided_whitespace_pattern",
                    "applies to JSON constraints only (guided_json, a json_schema response_format)",
                )),
            }
        }
        Ok(Some(Asked { param, spec }))
    }

    /// `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`,
    /// `structural_tag`.
    fn legacy(&self) -> Result<Option<(&'static str, Spec)>, FieldError> {
        let mut found = Vec::new();
        if let Some(v) = given(self.structural_tag) {
            found.push(("structural_tag", structural_tag_text("structural_tag", v)?));
        }
        if let Some(v) = given(self.guided_json) {
            found.push((
                "guided_json",
                json_spec("guided_json", v, JsonOptions::default())?,
            ));
        }
        if let Some(v) = given(self.guided_regex) {
            found.push(("guided_regex", Spec::Regex(string("guided_regex", v)?)));
        }
        if let Some(v) = given(self.guided_choice) {
            found.push(("guided_choice", Spec::Choice(choices("guided_choice", v)?)));
        }
        if let Some(v) = given(self.guided_grammar) {
            found.push((
                "guided_grammar",
                Spec::Grammar(string("guided_grammar", v)?),
            ));
        }
        if found.len() > 1 {
            let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
            return Err(err(
                found[1].0,
                format!("only one of {} may be given", names.join(", ")),
            ));
        }
        Ok(found.pop())
    }
}

fn string(param: &str, v: &Value) -> Result<String, FieldError> {
    match v.as_str() {
        Some(s) if !s.is_empty() => Ok(s.to_string()),
        Some(_) => Err(err(param, "must not be empty")),
        None => Err(err(param, format!("must be a string, got {v}"))),
    }
}

/// Most strings in a choice constraint.
const MAX_CHOICES: usize = 4096;

fn choices(param: &str, v: &Value) -> Result<Vec<String>, FieldError> {
    let list = v
        .as_array()
        .ok_or_else(|| err(param, format!("must be a list of strings, got {v}")))?;
    if list.is_empty() || list.len() > MAX_CHOICES {
        return Err(err(
            param,
            format!("must hold 1 to {MAX_CHOICES} strings, got {}", list.len()),
        ));
    }
    list.iter()
        .enumerate()
        .map(|(i, c)| match c {
            // vLLM turns each choice into a string.
            Value::String(s) => Ok(s.clone()),
            Value::Number(_) | Value::Bool(_) => Ok(c.to_string()),
            other => Err(err(
                format!("{param}[{i}]"),
                format!("must be a string, got {other}"),
            )),
        })
        .collect()
}

/// A schema given as an object or as a string holding one.
fn json_spec(param: &str, v: &Value, options: JsonOptions) -> Result<Spec, FieldError> {
    let schema = match v {
        Value::String(s) => serde_json::from_str::<Value>(s)
            .map_err(|e| err(param, format!("is not a JSON schema: {e}")))?,
        other => other.clone(),
    };
    match &schema {
        Value::Object(_) => Ok(Spec::Json { schema, options }),
        // `true` is the schema every value satisfies.
        Value::Bool(true) => Ok(Spec::Json { schema, options }),
        other => Err(err(
            param,
            format!("must be a JSON schema (an object), got {other}"),
        )),
    }
}

const STRUCTURED_KEYS: &[&str] = &[
    "json",
    "regex",
    "choice",
    "grammar",
    "json_object",
    "structural_tag",
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
];

/// vLLM's `structured_outputs` object.
fn structured_outputs(v: &Value) -> Result<Spec, FieldError> {
    let obj = v
        .as_object()
        .ok_or_else(|| err("structured_outputs", format!("must be an object, got {v}")))?;
    for key in obj.keys() {
        if !STRUCTURED_KEYS.contains(&key.as_str()) {
            return Err(err(
                format!("structured_outputs.{key}"),
                format!("unknown key; known: {}", STRUCTURED_KEYS.join(", ")),
            ));
        }
    }
    let field = |k: &str| given(obj.get(k));
    let flag = |k: &str| -> Result<bool, FieldError> {
        match field(k) {
            None => Ok(false),
            Some(Value::Bool(b)) => Ok(*b),
            Some(other) => Err(err(
                format!("structured_outputs.{k}"),
                format!("must be a boolean, got {other}"),
            )),
        }
    };
    let options = JsonOptions {
        compact: flag("disable_any_whitespace")?,
        no_additional_properties: flag("disable_additional_properties")?,
        whitespace_pattern: match field("whitespace_pattern") {
            None => None,
            Some(w) => Some(string("structured_outputs.whitespace_pattern", w)?),
        },
    };
    flag("disable_fallback")?;
    let mut found: Vec<(&str, Spec)> = Vec::new();
    if let Some(t) = field("structural_tag") {
        found.push((
            "structural_tag",
            structural_tag_text("structured_outputs.structural_tag", t)?,
        ));
    }
    if let Some(j) = field("json") {
        found.push((
            "json",
            json_spec("structured_outputs.json", j, options.clone())?,
        ));
    }
    if let Some(r) = field("regex") {
        found.push(("regex", Spec::Regex(string("structured_outputs.regex", r)?)));
    }
    if let Some(c) = field("choice") {
        found.push((
            "choice",
            Spec::Choice(choices("structured_outputs.choice", c)?),
        ));
    }
    if let Some(g) = field("grammar") {
        found.push((
            "grammar",
            Spec::Grammar(string("structured_outputs.grammar", g)?),
        ));
    }
    if flag("json_object")? {
        found.push((
            "json_object",
            Spec::JsonObject {
                options: options.clone(),
            },
        ));
    }
    match found.len() {
        0 => Err(err(
            "structured_outputs",
            "names no constraint: give one of json, regex, choice, grammar, json_object",
        )),
        1 => Ok(found.pop().expect("one").1),
        _ => {
            let names: Vec<&str> = found.iter().map(|(n, _)| *n).collect();
            Err(err(
                format!("structured_outputs.{}", names[1]),
                format!("only one constraint may be given, got {}", names.join(", ")),
            ))
        }
    }
}

/// OpenAI's `response_format` (`None` for `text`).
fn response_format(v: &Value) -> Result<Option<Spec>, FieldError> {
    let obj = v
        .as_object()
        .ok_or_else(|| err("response_format", format!("must be an object, got {v}")))?;
    let kind = obj.get("type").and_then(Value::as_str).ok_or_else(|| {
        err(
            "response_format.type",
            "is required: text, json_object or json_schema",
        )
    })?;
    match kind {
        "text" => Ok(None),
        "json_object" => Ok(Some(Spec::JsonObject {
            options: JsonOptions::default(),
        })),
        "json_schema" => {
            let js = obj
                .get("json_schema")
                .and_then(Value::as_object)
                .ok_or_else(|| {
                    err(
                        "response_format.json_schema",
                        "is required with type json_schema: {\"name\": ..., \"schema\": {...}}",
                    )
                })?;
            json_schema_object(js).map(Some)
        }
        "structural_tag" => structural_tag("response_format", v).map(Some),
        other => Err(err(
            "response_format.type",
            format!("unknown type {other:?}: text, json_object, json_schema or structural_tag"),
        )),
    }
}

/// A structural tag as vLLM takes it, a JSON string ([`structural_tag`]'s
/// object in it); an object is read the same.
fn structural_tag_text(param: &str, v: &Value) -> Result<Spec, FieldError> {
    match v {
        Value::String(s) => {
            let v = serde_json::from_str::<Value>(s)
                .map_err(|e| err(param, format!("is not JSON: {e}")))?;
            structural_tag(param, &v)
        }
        other => structural_tag(param, other),
    }
}

/// `{"structures": [{"begin", "schema", "end"}, ..], "triggers": [..]}`
/// (a `type` key aside): every structure begins with one of the triggers.
fn structural_tag(param: &str, v: &Value) -> Result<Spec, FieldError> {
    let obj = v
        .as_object()
        .ok_or_else(|| err(param, format!("must be an object, got {v}")))?;
    for key in obj.keys() {
        if !["type", "structures", "triggers"].contains(&key.as_str()) {
            return Err(err(
                format!("{param}.{key}"),
                "unknown key; known: structures, triggers",
            ));
        }
    }
    let list = |k: &str| -> Result<&Vec<Value>, FieldError> {
        obj.get(k)
            .and_then(Value::as_array)
            .filter(|a| !a.is_empty())
            .ok_or_else(|| err(format!("{param}.{k}"), "is required: a non-empty list"))
    };
    let triggers = list("triggers")?
        .iter()
        .enumerate()
        .map(|(i, t)| string(&format!("{param}.triggers[{i}]"), t))
        .collect::<Result<Vec<String>, FieldError>>()?;
    let mut structures = Vec::new();
    for (i, s) in list("structures")?.iter().enumerate() {
        let p = format!("{param}.structures[{i}]");
        let text = |k: &str| -> Result<String, FieldError> {
            match s.get(k) {
                Some(Value::String(t)) => Ok(t.clone()),
                _ => Err(err(format!("{p}.{k}"), "is required: a string")),
            }
        };
        let begin = text("begin")?;
        let end = text("end")?;
        if !triggers.iter().any(|t| begin.starts_with(t.as_str())) {
            return Err(err(
                format!("{p}.begin"),
                format!("{begin:?} starts with none of the triggers"),
            ));
        }
        let schema = match s.get("schema") {
            Some(sc @ (Value::Object(_) | Value::Bool(true))) => sc.clone(),
            None => Value::Bool(true),
            Some(other) => {
                return Err(err(
                    format!("{p}.schema"),
                    format!("must be a JSON schema (an object), got {other}"),
                ))
            }
        };
        structures.push(Structure { begin, schema, end });
    }
    Ok(Spec::StructuralTag {
        structures,
        triggers,
    })
}

/// `response_format.json_schema`: `schema` (any schema when absent, as
/// vLLM reads it), `name`, `description`, `strict`.
fn json_schema_object(js: &Map<String, Value>) -> Result<Spec, FieldError> {
    for key in js.keys() {
        if !["name", "schema", "strict", "description"].contains(&key.as_str()) {
            return Err(err(
                format!("response_format.json_schema.{key}"),
                "unknown key; known: name, schema, strict, description",
            ));
        }
    }
    match given(js.get("strict")) {
        None | Some(Value::Bool(_)) => {}
        Some(other) => {
            return Err(err(
                "response_format.json_schema.strict",
                format!("must be a boolean, got {other}"),
            ))
        }
    }
    match given(js.get("schema")) {
        Some(s) => json_spec(
            "response_format.json_schema.schema",
            s,
            JsonOptions::default(),
        ),
        None => Ok(Spec::JsonObject {
            options: JsonOptions::default(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The spec of a request whose one structured field `name` holds `v`.
    fn spec(name: &str, v: Value) -> Result<Option<Spec>, FieldError> {
        let mut f = Fields::default();
        let slot = match name {
            "response_format" => &mut f.response_format,
            "structured_outputs" => &mut f.structured_outputs,
            "guided_json" => &mut f.guided_json,
            "guided_regex" => &mut f.guided_regex,
            "guided_choice" => &mut f.guided_choice,
            "guided_grammar" => &mut f.guided_grammar,
            "guided_decoding_backend" => &mut f.guided_decoding_backend,
            "structural_tag" => &mut f.structural_tag,
            other => panic!("no field {other}"),
        };
        *slot = Some(&v);
        f.spec()
    }

    #[test]
    fn every_spelling_reads_into_one_spec() {
        let schema = json!({"type": "object", "properties": {"a": {"type": "integer"}}});
        let want = Some(Spec::Json {
            schema: schema.clone(),
            options: JsonOptions::default(),
        });
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": true}});
        assert_eq!(spec("response_format", rf).unwrap(), want);
        let so = json!({"json": schema});
        assert_eq!(spec("structured_outputs", so).unwrap(), want);
        let as_text = json!({"json": schema.to_string()});
        assert_eq!(spec("structured_outputs", as_text).unwrap(), want);
        assert_eq!(spec("guided_json", schema.clone()).unwrap(), want);
        assert_eq!(
            spec("guided_choice", json!(["yes", "no", 3])).unwrap(),
            Some(Spec::Choice(vec!["yes".into(), "no".into(), "3".into()]))
        );
        assert_eq!(
            spec("structured_outputs", json!({"regex": "[0-9]+"})).unwrap(),
            Some(Spec::Regex("[0-9]+".into()))
        );
        assert_eq!(
            spec("response_format", json!({"type": "text"})).unwrap(),
            None
        );
        assert_eq!(
            spec(
                "structured_outputs",
                json!({"json_object": true, "disable_any_whitespace": true})
            )
            .unwrap(),
            Some(Spec::JsonObject {
                options: JsonOptions {
                    compact: true,
                    ..JsonOptions::default()
                }
            })
        );
        assert_eq!(Fields::default().spec().unwrap(), None);
        let tag = json!({"structures": [{"begin": "<f=a>", "schema": {"type": "object"}, "end": "</f>"}], "triggers": ["<f="]});
        let want = Some(Spec::StructuralTag {
            structures: vec![Structure {
                begin: "<f=a>".into(),
                schema: json!({"type": "object"}),
                end: "</f>".into(),
            }],
            triggers: vec!["<f=".into()],
        });
        let mut typed = tag.clone();
        typed["type"] = json!("structural_tag");
        assert_eq!(spec("response_format", typed.clone()).unwrap(), want);
        let as_text = json!({"structural_tag": tag.to_string()});
        assert_eq!(spec("structured_outputs", as_text).unwrap(), want);
        // vLLM's top-level chat field: the typed object as a JSON string.
        let top = json!(typed.to_string());
        assert_eq!(spec("structural_tag", top).unwrap(), want);
    }

    #[test]
    fn a_whitespace_pattern_goes_with_a_json_constraint_only() {
        let ws = json!("[ ]?");
        let schema = json!({"type": "object"});
        let fields = Fields {
            guided_json: Some(&schema),
            guided_whitespace_pattern: Some(&ws),
            ..Fields::default()
        };
        let Some(Spec::Json { options, .. }) = fields.spec().unwrap() else {
            panic!("a JSON spec");
        };
        assert_eq!(options.whitespace_pattern.as_deref(), Some("[ ]?"));
        let rx = json!("a+");
        let fields = Fields {
            guided_regex: Some(&rx),
            guided_whitespace_pattern: Some(&ws),
            ..Fields::default()
        };
        assert_eq!(
            fields.spec().unwrap_err().param,
            "guided_whitespace_pattern"
        );
    }

    #[test]
    fn bad_fields_are_refused_by_name() {
        let cases = [
            (
                "structured_outputs",
                json!({"regex": "a", "choice": ["b"]}),
                "structured_outputs.choice",
            ),
            (
                "structured_outputs",
                json!({"jsn": {}}),
                "structured_outputs.jsn",
            ),
            ("structured_outputs", json!({}), "structured_outputs"),
            (
                "structured_outputs",
                json!({"regex": 3}),
                "structured_outputs.regex",
            ),
            (
                "structured_outputs",
                json!({"json": "{not json"}),
                "structured_outputs.json",
            ),
            (
                "structured_outputs",
                json!({"structural_tag": "{}"}),
                "structured_outputs.structural_tag.triggers",
            ),
            ("structural_tag", json!("x"), "structural_tag"),
            (
                "structural_tag",
                json!(r#"{"type": "structural_tag", "triggers": ["<f="]}"#),
                "structural_tag.structures",
            ),
            (
                "response_format",
                json!({"type": "structural_tag", "triggers": ["<f="], "structures": [{"begin": "<g>", "end": "</g>"}]}),
                "response_format.structures[0].begin",
            ),
            (
                "response_format",
                json!({"type": "yaml"}),
                "response_format.type",
            ),
            (
                "response_format",
                json!({"type": "json_schema"}),
                "response_format.json_schema",
            ),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"schema": 3}}),
                "response_format.json_schema.schema",
            ),
            (
                "response_format",
                json!({"type": "json_schema", "json_schema": {"shema": {}}}),
                "response_format.json_schema.shema",
            ),
            ("guided_choice", json!([]), "guided_choice"),
            ("guided_choice", json!(["a", {"b": 1}]), "guided_choice[1]"),
            ("guided_regex", json!(""), "guided_regex"),
            (
                "guided_decoding_backend",
                json!("xgrammar"),
                "guided_decoding_backend",
            ),
        ];
        for (name, v, param) in cases {
            let got = spec(name, v.clone()).unwrap_err();
            assert_eq!(got.param, param, "{v}: {got}");
        }
        let (a, b) = (json!({"type": "json_object"}), json!({"regex": "x"}));
        let both = Fields {
            response_format: Some(&a),
            structured_outputs: Some(&b),
            ..Fields::default()
        };
        assert_eq!(both.spec().unwrap_err().param, "response_format");
        let (r, c) = (json!("x"), json!(["y"]));
        let two = Fields {
            guided_regex: Some(&r),
            guided_choice: Some(&c),
            ..Fields::default()
        };
        assert_eq!(two.spec().unwrap_err().param, "guided_choice");
        let auto = json!("guidance:no-fallback");
        let fine = Fields {
            guided_decoding_backend: Some(&auto),
            guided_regex: Some(&r),
            ..Fields::default()
        };
        assert_eq!(fine.spec().unwrap(), Some(Spec::Regex("x".into())));
    }
}
