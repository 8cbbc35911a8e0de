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
        let parser = factory.create_parser(grammar);
        let took = started.elapsed();
        let compiled = parser.map_err(|e| CompileError::Invalid {
            kind,
            message: format!("{e:#}"),
        });
        self.bump(|s| {
            s.compiles += 1;
            s.compile_seconds += took.as_secs_f64();
            s.errors += u64::from(compiled.is_err());
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
    })
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
    }
    if let Some(w) = &options.whitespace_pattern {
        o.whitespace_pattern = Some(w.clone());
        o.whitespace_flexible = false;
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
