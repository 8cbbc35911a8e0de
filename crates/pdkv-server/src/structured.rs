//! Structured outputs on the server: a request's `response_format`,
//! `structured_outputs` or `guided_*` fields read into a constraint
//! ([`pdkv_structured::Fields`]), compiled on a blocking thread within
//! [`COMPILE_WAIT`] (compiled grammars are cached by their text), and
//! handed to the engine with the sampling parameters. Every refusal is a
//! 400 naming the field that asked.

use std::time::Duration;

use pdkv_engine::SamplingParams;
use pdkv_structured::Compiler;

use crate::error::ApiError;
use crate::openai::SamplingFields;
use crate::AppState;

/// Longest a request waits for its constraint to compile. A compile that
/// takes longer goes on (and is cached when it ends); the request is
/// refused.
pub const COMPILE_WAIT: Duration = Duration::from_secs(10);

/// Sets `params.constraint` from the request's fields (nothing when none
/// asks for one).
pub(crate) async fn constrain(
    state: &AppState,
    fields: &SamplingFields,
    params: &mut SamplingParams,
) -> Result<(), ApiError> {
    let asked = fields
        .structured()
        .asked()
        .map_err(|e| ApiError::invalid_param(&e.param, e.to_string()))?;
    let Some(asked) = asked else {
        return Ok(());
    };
    constrain_with(state, asked.param, asked.spec, params).await
}

/// Sets `params.constraint` to `spec` compiled; a refusal names `param`.
pub(crate) async fn constrain_with(
    state: &AppState,
    param: &'static str,
    spec: pdkv_structured::Spec,
    params: &mut SamplingParams,
) -> Result<(), ApiError> {
    if params.constraint.is_some() {
        return Err(ApiError::invalid_param(
            param,
            "a request asks for one constraint (structured output fields, or tool_choice required or named)",
        ));
    }
    let compiler = state.structured().clone();
    let kind = spec.kind();
    let compiling = tokio::task::spawn_blocking(move || compiler.compile(&spec));
    let grammar = match tokio::time::timeout(COMPILE_WAIT, compiling).await {
        Ok(Ok(Ok(g))) => g,
        // Too large, not compiling, or a tokenizer llguidance cannot read:
        // this request cannot be served as asked.
        Ok(Ok(Err(e))) => return Err(ApiError::invalid_param(param, e.to_string())),
        Ok(Err(join)) => {
            return Err(ApiError::internal(format!(
                "compiling the {kind} constraint failed: {join}"
            )))
        }
        Err(_) => {
            return Err(ApiError::invalid_param(
                param,
                format!(
                    "the {kind} constraint took more than {}s to compile",
                    COMPILE_WAIT.as_secs()
                ),
            ))
        }
    };
    params.constraint = Some(grammar);
    Ok(())
}

/// The compiler's counters in the Prometheus text format.
pub(crate) fn render(compiler: &Compiler, text: &mut String) {
    use std::fmt::Write;
    let s = compiler.stats();
    for (name, help, v) in [
        (
            "pdkv_structured_compiles_total",
            "Structured output constraints compiled (cache misses, failures included).",
            s.compiles as f64,
        ),
        (
            "pdkv_structured_compile_seconds_total",
            "Seconds spent compiling structured output constraints.",
            s.compile_seconds,
        ),
        (
            "pdkv_structured_compile_cache_hits_total",
            "Structured output constraints found compiled in the cache.",
            s.cache_hits as f64,
        ),
        (
            "pdkv_structured_compile_errors_total",
            "Structured output constraints that did not compile.",
            s.errors as f64,
        ),
    ] {
        let _ = writeln!(
            text,
            "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
        );
    }
}
