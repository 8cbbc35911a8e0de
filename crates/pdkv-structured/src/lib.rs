//! Structured outputs: what a request's output must follow (a JSON schema,
//! any JSON object, a regular expression, one of a few strings, a Lark or
//! GBNF grammar), read from the request fields vLLM and OpenAI define
//! ([`request`]), compiled with llguidance against the served tokenizer
//! ([`compile`]) and run per output token as the engine's
//! [`pdkv_engine::TokenConstraint`] ([`matcher`]).
//!
//! Boundaries: no HTTP here (the server maps [`request::FieldError`] to a
//! 400 and runs [`Compiler::compile`] off its async threads); no engine
//! state either (the core holds each request's matcher and masks logits
//! with it).

pub mod compile;
pub mod gbnf;
pub mod matcher;
pub mod request;
mod vocab;

pub use compile::{CompileError, Compiler, CompilerStats, JSON_WHITESPACE};
pub use request::{Asked, FieldError, Fields, JsonOptions, Spec, Structure};
