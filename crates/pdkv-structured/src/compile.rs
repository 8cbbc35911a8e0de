//! Compiling a [`Spec`] into a grammar the engine runs: llguidance's
//! parser for the served tokenizer, built once (lazily: a server that
//! never sees a constrained request never pays for it), with compiled
//! grammars cached by their text (a bounded cache, oldest out first) and
//! counters for `/metrics`.
//!
//! Bounds: a schema or grammar's text is at most [`MAX_SPEC_BYTES`];
//! llguidance's own limits bound the work compiling and each mask may do
//! (its lexer fuel and grammar size), so a hostile schema fails with an
//! error instead of running long. The server bounds the wait on top.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use llguidance::api::{GrammarWithLexer, TopLevelGrammar};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory, TokenParser};
use pdkv_engine::{Grammar, GrammarRef, TokenConstraint};
use pdkv_model::Tokenizer;
use serde_json::Value;

use crate::gbnf;
use crate::matcher::Guided;
use crate::request::{JsonOptions, Spec};

/// The longest schema or grammar accepted, in bytes of its text.
pub const MAX_SPEC_BYTES: usize = 256 * 1024;

/// Whitespace allowed between JSON tokens unless the request says
/// otherwise: any JSON whitespace, at most 32 characters a gap. Unbounded
/// whitespace lets a model fill its whole budget with blank lines (a
/// small model at temperature 1 does, now and then); a bounded gap still
/// takes any indentation a pretty-printer would write.
pub const JSON_WHITESPACE: &str = r"[\x20\x0A\x0D\x09]{1,32}";

/// Compiled grammars kept for reuse.
const CACHE_ENTRIES: usize = 256;

/// Why a constraint cannot be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompileError {
    /// The schema, regex or grammar does not compile; the message names
    /// the part that failed.
    #[error("the {kind} constraint does not compile: {message}")]
    Invalid { kind: &'static str, message: String },
    #[error("the {kind} constraint is {bytes} bytes long; at most {max} are accepted")]
    TooLarge {
        kind: &'static str,
        bytes: usize,
        max: usize,
    },
    /// The served tokenizer could not be prepared for constraints.
    #[error("structured outputs are unavailable with this tokenizer: {0}")]
    Tokenizer(String),
}

/// Counters, cumulative.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CompilerStats {
    /// Grammars compiled (cache misses), failed ones included.
    pub compiles: u64,
    pub compile_seconds: f64,
    pub cache_hits: u64,
    /// Constraints refused: too large or not compiling.
    pub errors: u64,
}

/// A compiled grammar: every request asking for it starts a matcher from a
/// copy of its parser.
struct Compiled {
    kind: &'static str,
    parser: TokenParser,
    eos: u32,
    stops: Arc<[u32]>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} constraint", self.kind)
    }
}

impl Grammar for Compiled {
    fn start(&self) -> Box<dyn TokenConstraint> {
        let matcher = Matcher::new(Ok(self.parser.deep_clone()));
        Box::new(Guided::new(matcher, self.eos, self.stops.clone()))
    }
}

struct Cache {
    entries: HashMap<String, GrammarRef>,
    order: VecDeque<String>,
}

/// Compiles constraints for one served model.
pub struct Compiler {
    tokenizer: Arc<Tokenizer>,
    vocab_size: usize,
    stops: Arc<[u32]>,
    factory: OnceLock<Result<ParserFactory, String>>,
    cache: Mutex<Cache>,
    stats: Mutex<CompilerStats>,
}

impl Compiler {
    /// A compiler for `tokenizer` on a model whose logits rows are
    /// `vocab_size` wide; an output may end with any of `stop_ids` once
    /// its grammar is complete (the first is the grammar's own end).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, stop_ids: &[u32]) -> Compiler {
        Compiler {
            tokenizer,
            vocab_size,
            stops: stop_ids.into(),
            factory: OnceLock::new(),
            cache: Mutex::new(Cache {
                entries: HashMap::new(),
                order: VecDeque::new(),
            }),
            stats: Mutex::new(CompilerStats::default()),
        }
    }

    /// A compiler for what `engine` serves: its tokenizer, its logits
    /// width, and the end tokens of its tokenizer and model config.
    pub fn for_engine(engine: &pdkv_engine::EngineHandle) -> Compiler {
        let mut stops = engine.tokenizer().eos_token_ids().to_vec();
        for &e in &engine.model_config().eos_token_ids {
            if !stops.contains(&e) {
                stops.push(e);
            }
        }
        Compiler::new(
            engine.tokenizer().clone(),
            engine.model_config().vocab_size,
            &stops,
        )
    }

    pub fn stats(&self) -> CompilerStats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn factory(&self) -> Result<&ParserFactory, CompileError> {
        let built = self.factory.get_or_init(|| {
            let started = Instant::now();
            let eos = *self
                .stops
                .first()
                .ok_or("the model has no end-of-sequence token")?;
            let env = crate::vocab::tok_env(self.tokenizer.clone(), self.vocab_size, eos)
                .map_err(|e| format!("{e:#}"))?;
            let mut f = ParserFactory::new_simple(&env).map_err(|e| format!("{e:#}"))?;
            f.quiet();
            // Errors name the failing part without dumping parser state.
            f.limits_mut().verbose_errors = false;
            tracing::info!(
                seconds = started.elapsed().as_secs_f64(),
                vocab = self.vocab_size,
                "structured outputs ready (llguidance)"
            );
            Ok(f)
        });
        built
            .as_ref()
            .map_err(|e| CompileError::Tokenizer(e.clone()))
    }

    /// The grammar for `spec`, from the cache or compiled now (this may
    /// take milliseconds to seconds for a large schema: call it off async
    /// threads).
    pub fn compile(&self, spec: &Spec) -> Result<GrammarRef, CompileError> {
        let r = self.compile_or_reuse(spec);
        if r.is_err() {
            self.bump(|s| s.errors += 1);
        }
        r
    }

    fn compile_or_reuse(&self, spec: &Spec) -> Result<GrammarRef, CompileError> {
        let kind = spec.kind();
        let grammar = top_level(spec)?;
        let key = serde_json::to_string(&grammar).expect("a grammar serialises");
        if key.len() > MAX_SPEC_BYTES {
            return Err(CompileError::TooLarge {
                kind,
                bytes: key.len(),
                max: MAX_SPEC_BYTES,
            });
        }
        if let Some(g) = self.lock_cache().entries.get(&key).cloned() {
            self.bump(|s| s.cache_hits += 1);
            return Ok(g);
        }
        let factory = self.factory()?;
        let started = Instant::now();
        let compiled = factory
            .create_parser(grammar)
            .map_err(|e| format!("{e:#}"))
            .and_then(|parser| {
                // A grammar that admits no output at all fails its first
                // mask: refuse it here rather than at the request's first
                // token.
                let mut probe = Matcher::new(Ok(parser.deep_clone()));
                match probe.compute_mask() {
                    Ok(m) if !m.is_zero() => Ok(parser),
                    Ok(_) => Err("it admits no output".to_string()),
                    Err(e) => Err(format!("it admits no output ({e})")),
                }
            })
            .map_err(|message| CompileError::Invalid { kind, message });
        let took = started.elapsed();
        self.bump(|s| {
            s.compiles += 1;
            s.compile_seconds += took.as_secs_f64();
        });
        slow_compile(kind, took);
        let g = GrammarRef::new(Arc::new(Compiled {
            kind,
            parser: compiled?,
            eos: self.stops[0],
            stops: self.stops.clone(),
        }));
        let mut cache = self.lock_cache();
        if cache.entries.insert(key.clone(), g.clone()).is_none() {
            cache.order.push_back(key);
            while cache.order.len() > CACHE_ENTRIES {
                let old = cache.order.pop_front().expect("non-empty");
                cache.entries.remove(&old);
            }
        }
        Ok(g)
    }

    fn lock_cache(&self) -> std::sync::MutexGuard<'_, Cache> {
        self.cache.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self, f: impl FnOnce(&mut CompilerStats)) {
        f(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }
}

fn slow_compile(kind: &str, took: Duration) {
    if took > Duration::from_millis(500) {
        tracing::info!(
            kind,
            seconds = took.as_secs_f64(),
            "slow constraint compile"
        );
    }
}

/// llguidance's grammar for a spec.
fn top_level(spec: &Spec) -> Result<TopLevelGrammar, CompileError> {
    let kind = spec.kind();
    let invalid = |message: String| CompileError::Invalid { kind, message };
    Ok(match spec {
        Spec::Json { schema, options } => {
            TopLevelGrammar::from_json_schema(with_options(schema.clone(), options))
        }
        Spec::JsonObject { options } => TopLevelGrammar::from_json_schema(with_options(
            serde_json::json!({"type": "object"}),
            options,
        )),
        Spec::Regex(rx) => {
            // Refuse what the regex parser refuses, with its message, before
            // llguidance wraps it in a grammar.
            regex_syntax_check(rx).map_err(invalid)?;
            TopLevelGrammar::from_regex(rx)
        }
        Spec::Choice(choices) => {
            let alts: Vec<String> = choices
                .iter()
                .map(|c| serde_json::to_string(c).expect("a string serialises"))
                .collect();
            TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
        }
        Spec::Grammar(g) if gbnf::is_gbnf(g) => {
            let lark = gbnf::to_lark(g).map_err(|e| invalid(e.to_string()))?;
            TopLevelGrammar::from_grammar(GrammarWithLexer::from_lark(lark))
        }
        Spec::Grammar(g) => TopLevelGrammar::from_lark(g.clone()),
        Spec::StructuralTag {
            structures,
            triggers,
        } => TopLevelGrammar::from_lark(structural_lark(structures, triggers)),
    })
}

/// A structural tag as Lark: chunks of free text each ending at a
/// trigger's first occurrence (`PRE_t`, which holds no other trigger),
/// each followed by one of the structures that begin with that trigger,
/// then free text holding no trigger. A structure belongs to the longest
/// trigger its `begin` starts with.
fn structural_lark(structures: &[crate::request::Structure], triggers: &[String]) -> String {
    let any_trigger = triggers
        .iter()
        .map(|t| rx_escape(t))
        .collect::<Vec<_>>()
        .join("|");
    let quote = |s: &str| serde_json::to_string(s).expect("a string serialises");
    let mut lark = String::new();
    let mut chunks = Vec::new();
    for (t, trig) in triggers.iter().enumerate() {
        let mine: Vec<(usize, &crate::request::Structure)> = structures
            .iter()
            .enumerate()
            .filter(|(_, s)| {
                let longest = triggers
                    .iter()
                    .filter(|x| s.begin.starts_with(x.as_str()))
                    .max_by_key(|x| x.len());
                longest == Some(trig)
            })
            .collect();
        if mine.is_empty() {
            continue;
        }
        chunks.push(format!("pre_{t} after_{t}"));
        lark.push_str(&format!(
            "pre_{t}[lazy]: PRE_{t}\nPRE_{t}: /(?s:.*){}/ & ~/(?s:.*)({any_trigger})(?s:.+)/\n",
            rx_escape(trig)
        ));
        let alts: Vec<String> = mine.iter().map(|(k, _)| format!("s_{k}")).collect();
        lark.push_str(&format!("after_{t}: {}\n", alts.join(" | ")));
        for (k, s) in mine {
            let rest = &s.begin[trig.len()..];
            let schema = match &s.schema {
                Value::Object(_) => s.schema.to_string(),
                _ => "{}".to_string(),
            };
            let head = if rest.is_empty() {
                String::new()
            } else {
                quote(rest) + " "
            };
            let tail = if s.end.is_empty() {
                String::new()
            } else {
                " ".to_string() + &quote(&s.end)
            };
            lark.push_str(&format!("s_{k}: {head}%json {schema}{tail}\n"));
        }
    }
    let mut top = format!(
        "start: chunk* rest?\nrest: REST\nREST: /(?s:.+)/ & ~/(?s:.*)({any_trigger})(?s:.*)/\n"
    );
    top.push_str(&format!("chunk: {}\n", chunks.join(" | ")));
    top + &lark
}

/// `s` with the regular-expression metacharacters (and Lark's `/`)
/// escaped: a regex (or a Lark `/…/` terminal) that matches `s` alone.
pub fn rx_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "\\.+*?()|[]{}^$#&-~/".contains(c) {
            out.push('\\');
        }
        out.push(c);
    }
    out
}

fn regex_syntax_check(rx: &str) -> Result<(), String> {
    llguidance::derivre::RegexBuilder::new()
        .mk_regex(rx)
        .map(|_| ())
        .map_err(|e| format!("regex {rx:?}: {e}"))
}

/// The schema with the layout options llguidance reads from it.
fn with_options(mut schema: Value, options: &JsonOptions) -> Value {
    if options.no_additional_properties {
        close_objects(&mut schema);
    }
    let mut o = JsonCompileOptions::default();
    if options.compact {
        o.whitespace_flexible = false;
    } else {
        let w = options
            .whitespace_pattern
            .as_deref()
            .unwrap_or(JSON_WHITESPACE);
        o.whitespace_pattern = Some(w.to_string());
    }
    if let Value::Object(_) = schema {
        o.apply_to(&mut schema);
    }
    schema
}

/// Objects whose schema does not say otherwise get no properties beyond
/// the listed ones.
fn close_objects(v: &mut Value) {
    match v {
        Value::Object(m) => {
            let is_object = m.get("type").and_then(Value::as_str) == Some("object")
                || m.contains_key("properties");
            if is_object && !m.contains_key("additionalProperties") {
                m.insert("additionalProperties".into(), Value::Bool(false));
            }
            for child in m.values_mut() {
                close_objects(child);
            }
        }
        Value::Array(a) => a.iter_mut().for_each(close_objects),
        _ => {}
    }
}

#[cfg(test)]
mod tests_support {
    use super::*;

    /// Bytes-and-merges tokenizer of the tiny test models, with a few
    /// padding ids past it in the logits (as models pad their vocabulary).
    pub(super) const TOKENS: usize = 512;
    pub(super) const PADDED: usize = TOKENS + 5;

    fn tokenizer() -> (Arc<Tokenizer>, Vec<u32>) {
        let json = pdkv_model::init::tokenizer_json(TOKENS).expect("tokenizer json");
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("tokenizer.json");
        std::fs::write(&path, json.to_string()).expect("write");
        let tok = Tokenizer::from_file(&path).expect("tokenizer");
        let stops: Vec<u32> = ["<|endoftext|>", "<|im_end|>"]
            .iter()
            .map(|t| tok.token_to_id(t).expect("special token"))
            .collect();
        (Arc::new(tok.with_special_ids(None, stops.clone())), stops)
    }

    pub(super) fn compiler() -> (Compiler, Arc<Tokenizer>, Vec<u32>) {
        let (tok, stops) = tokenizer();
        (Compiler::new(tok.clone(), PADDED, &stops), tok, stops)
    }
}

#[cfg(test)]
mod tests {
    use super::tests_support::*;
    use super::*;
    use crate::request::JsonOptions;
    use serde_json::json;

    /// A splitmix64 stream of logits in [0, 1).
    fn logits(seed: u64, step: u64) -> Vec<f32> {
        (0..PADDED as u64)
            .map(|i| {
                let x = pdkv_engine::sampling::splitmix64(seed ^ (step << 20) ^ i);
                (x >> 40) as f32 / (1u64 << 24) as f32
            })
            .collect()
    }

    /// Decodes under the grammar with random logits (greedy on them): the
    /// text and whether it ended with a stop token within `max` tokens.
    fn walk(
        g: &GrammarRef,
        tok: &Tokenizer,
        stops: &[u32],
        seed: u64,
        max: usize,
    ) -> (String, bool) {
        let mut m = g.start();
        let mut ids = Vec::new();
        for step in 0..max as u64 {
            let mut row = logits(seed, step);
            m.apply(&mut row).expect("mask");
            assert!(
                row[TOKENS..].iter().all(|l| *l == f32::NEG_INFINITY),
                "padding ids are never allowed"
            );
            let t = pdkv_engine::sampling::argmax(&row);
            m.commit(t).expect("commit an allowed token");
            if stops.contains(&t) {
                return (tok.decode(&ids, true), true);
            }
            ids.push(t);
        }
        (tok.decode(&ids, true), false)
    }

    #[test]
    fn choices_regexes_and_grammars_bound_every_output() {
        let (c, tok, stops) = compiler();
        let choice = c
            .compile(&Spec::Choice(vec!["alpha".into(), "beta gamma".into()]))
            .unwrap();
        let regex = c
            .compile(&Spec::Regex("[0-9]{3}-[a-z]{2,4}".into()))
            .unwrap();
        let gbnf = c
            .compile(&Spec::Grammar(
                "root ::= item (\", \" item)* \"!\"\nitem ::= \"ab\" | \"cd\"".into(),
            ))
            .unwrap();
        let lark = c
            .compile(&Spec::Grammar("start: (\"x\" | \"yz\"){2,3}\n".into()))
            .unwrap();
        for seed in 0..20 {
            let (text, ended) = walk(&choice, &tok, &stops, seed, 50);
            assert!(
                ended && ["alpha", "beta gamma"].contains(&text.as_str()),
                "{text:?}"
            );
            let (text, ended) = walk(&regex, &tok, &stops, seed, 50);
            let b = text.as_bytes();
            assert!(ended && b.len() >= 6 && b.len() <= 8, "{text:?}");
            assert!(
                b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-',
                "{text:?}"
            );
            assert!(b[4..].iter().all(u8::is_ascii_lowercase), "{text:?}");
            let (text, ended) = walk(&gbnf, &tok, &stops, seed, 200);
            if ended {
                let body = text.strip_suffix('!').expect("ends with !");
                assert!(body.split(", ").all(|i| i == "ab" || i == "cd"), "{text:?}");
            }
            let (text, ended) = walk(&lark, &tok, &stops, seed, 50);
            let rest = text.replace("yz", "").replace('x', "");
            assert!(ended && rest.is_empty(), "{text:?}");
        }
    }

    #[test]
    fn json_outputs_follow_their_schema() {
        let (c, tok, stops) = compiler();
        let schema = json!({
            "type": "object",
            "properties": {
                "n": {"type": "integer", "minimum": 0, "maximum": 999},
                "kind": {"enum": ["cat", "dog"]},
                "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 3},
                "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false},
            },
            "required": ["n", "kind", "tags", "inner"],
            "additionalProperties": false,
        });
        let compact = JsonOptions {
            compact: true,
            ..JsonOptions::default()
        };
        let g = c
            .compile(&Spec::Json {
                schema,
                options: compact,
            })
            .unwrap();
        for seed in 0..20 {
            let (text, ended) = walk(&g, &tok, &stops, seed, 400);
            assert!(ended, "{text:?}");
            let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
            assert!(!text.contains(' '), "compact: {text:?}");
            let o = v.as_object().expect("an object");
            assert_eq!(o.len(), 4, "{text}");
            assert!(o["n"].as_u64().is_some_and(|n| n <= 999), "{text}");
            assert!(
                ["cat", "dog"].contains(&o["kind"].as_str().unwrap()),
                "{text}"
            );
            let tags = o["tags"].as_array().expect("tags");
            assert!(tags.len() <= 3, "{text}");
            for t in tags {
                let t = t.as_str().expect("a string tag");
                assert!((1..=5).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_lowercase()));
            }
            assert!(o["inner"]["ok"].is_boolean(), "{text}");
        }
        let any = c
            .compile(&Spec::JsonObject {
                options: JsonOptions::default(),
            })
            .unwrap();
        let mut m = any.start();
        let mut row = logits(1, 0);
        m.apply(&mut row).unwrap();
        let allowed: Vec<String> = (0..TOKENS as u32)
            .filter(|&t| row[t as usize] > f32::NEG_INFINITY)
            .map(|t| tok.decode(&[t], false))
            .collect();
        assert!(!allowed.is_empty());
        assert!(
            allowed
                .iter()
                .all(|s| s.trim_start().starts_with('{') || s.trim().is_empty()),
            "an object opens first: {allowed:?}"
        );
    }

    #[test]
    fn the_models_every_end_token_ends_a_complete_output() {
        let (c, tok, stops) = compiler();
        let g = c.compile(&Spec::Choice(vec!["ok".into()])).unwrap();
        let mut m = g.start();
        for t in tok.encode("ok", false).unwrap() {
            let mut row = vec![0.0; PADDED];
            m.apply(&mut row).unwrap();
            assert_eq!(row[t as usize], 0.0);
            for s in &stops {
                assert_eq!(row[*s as usize], f32::NEG_INFINITY, "not before the end");
            }
            m.commit(t).unwrap();
        }
        let mut row: Vec<f32> = (0..PADDED).map(|i| i as f32).collect();
        m.apply(&mut row).unwrap();
        let open: Vec<u32> = (0..PADDED as u32)
            .filter(|&t| row[t as usize].is_finite())
            .collect();
        assert_eq!(open, stops, "only the end tokens, each with its own logit");
        for &s in &stops {
            assert_eq!(row[s as usize], s as f32);
        }
        // A token the mask forbade is refused.
        let mut m = g.start();
        let x = tok.encode("x", false).unwrap()[0];
        assert!(m.commit(x).is_err());
    }

    #[test]
    fn compiled_grammars_are_shared_and_failures_name_the_part() {
        let (c, _, _) = compiler();
        let spec = Spec::Regex("a+b".into());
        let a = c.compile(&spec).unwrap();
        let b = c.compile(&spec).unwrap();
        assert_eq!(a, b, "the cache hands out the same grammar");
        let s = c.stats();
        assert_eq!((s.compiles, s.cache_hits, s.errors), (1, 1, 0));
        let e = c.compile(&Spec::Regex("(a".into())).unwrap_err();
        assert!(
            matches!(&e, CompileError::Invalid { kind: "regex", message } if message.contains("(a")),
            "{e}"
        );
        let e = c
            .compile(&Spec::Grammar("start: nope\n".into()))
            .unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
        let e = c
            .compile(&Spec::Grammar("start: start\n".into()))
            .unwrap_err();
        assert!(e.to_string().contains("admits no output"), "{e}");
        let e = c
            .compile(&Spec::Grammar("root ::= \"a".into()))
            .unwrap_err();
        assert!(e.to_string().contains("unterminated string"), "{e}");
        let e = c
            .compile(&Spec::Json {
                schema: json!({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}),
                options: JsonOptions::default(),
            })
            .unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
        let huge = Spec::Choice(vec!["x".repeat(1024); 300]);
        assert!(matches!(
            c.compile(&huge),
            Err(CompileError::TooLarge { .. })
        ));
        assert_eq!(c.stats().errors, 6, "every refusal counts");
    }
}

#[cfg(test)]
mod whitespace_tests {
    use super::*;

    #[test]
    fn json_whitespace_is_bounded_unless_compact_or_given() {
        let opts = |v: &Value| v["x-guidance"].clone();
        let schema = serde_json::json!({"type": "object"});
        let d = opts(&with_options(schema.clone(), &JsonOptions::default()));
        assert_eq!(d["whitespace_pattern"], JSON_WHITESPACE);
        let c = opts(&with_options(
            schema.clone(),
            &JsonOptions {
                compact: true,
                ..JsonOptions::default()
            },
        ));
        assert_eq!(
            (
                c["whitespace_flexible"].as_bool(),
                c["whitespace_pattern"].is_null()
            ),
            (Some(false), true)
        );
        let g = opts(&with_options(
            schema,
            &JsonOptions {
                whitespace_pattern: Some(" ?".into()),
                ..JsonOptions::default()
            },
        ));
        assert_eq!(g["whitespace_pattern"], " ?");
        let closed = with_options(
            serde_json::json!({"type": "object", "properties": {"a": {"type": "object", "properties": {}}}}),
            &JsonOptions {
                no_additional_properties: true,
                ..JsonOptions::default()
            },
        );
        assert_eq!(closed["additionalProperties"], false);
        assert_eq!(closed["properties"]["a"]["additionalProperties"], false);
    }
}

#[cfg(test)]
mod structural_tests {
    use super::tests_support::*;
    use super::*;
    use crate::request::Structure;
    use serde_json::json;

    /// Feeds `text`'s tokens: whether each is allowed, and whether the
    /// output may end after them.
    fn feed(g: &GrammarRef, tok: &Tokenizer, stops: &[u32], text: &str) -> Result<bool, String> {
        let mut m = g.start();
        for t in tok.encode(text, false).unwrap() {
            let mut row = vec![0.0; PADDED];
            m.apply(&mut row).map_err(|e| e.to_string())?;
            if row[t as usize] == f32::NEG_INFINITY {
                return Err(format!("{:?} refused in {text:?}", tok.decode(&[t], false)));
            }
            m.commit(t).map_err(|e| e.to_string())?;
        }
        let mut row = vec![0.0; PADDED];
        m.apply(&mut row).map_err(|e| e.to_string())?;
        Ok(row[stops[0] as usize].is_finite())
    }

    #[test]
    fn structural_tags_hold_free_text_and_each_triggered_structure() {
        let (c, tok, stops) = compiler();
        let spec = Spec::StructuralTag {
            structures: vec![
                Structure {
                    begin: "<f=weather>".into(),
                    schema: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"], "additionalProperties": false}),
                    end: "</f>".into(),
                },
                Structure {
                    begin: "<f=time>".into(),
                    schema: json!({"type": "object", "properties": {"tz": {"enum": ["utc", "cet"]}}, "required": ["tz"], "additionalProperties": false}),
                    end: "</f>".into(),
                },
            ],
            triggers: vec!["<f=".into()],
        };
        let g = c.compile(&spec).unwrap_or_else(|e| panic!("{e}"));
        let ok = [
            "just some text, no call at all",
            "Let me look. <f=weather>{\"city\": \"Oslo\"}</f> and then <f=time>{\"tz\": \"cet\"}</f> done",
            "<f=time>{\"tz\":\"utc\"}</f>",
        ];
        for text in ok {
            assert_eq!(feed(&g, &tok, &stops, text), Ok(true), "{text:?}");
        }
        // Open structures cannot end; broken ones are refused.
        assert_eq!(
            feed(&g, &tok, &stops, "x <f=weather>{\"city\": \"Oslo\"}"),
            Ok(false)
        );
        for bad in [
            "x <f=rain>{}</f>",
            "x <f=time>{\"tz\": \"pst\"}</f>",
            "x <f=weather>{\"town\": \"Oslo\"}</f>",
        ] {
            assert!(feed(&g, &tok, &stops, bad).is_err(), "{bad:?} is refused");
        }
    }
}
