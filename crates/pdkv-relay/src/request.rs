//! What the relay plan reads of a client's request body: whether it needs
//! its prompt's logits, carries several prompts, or can be resumed.

use serde_json::{Map, Value};

/// Whether a request (its JSON body) wants logits of its prompt's positions
/// (`prompt_logprobs` — at the top or, in the token-in/token-out API, in
/// `sampling_params` — or `echo` with `logprobs`): only the engine that
/// computes the prompt has them, so P cannot help and D computes it.
pub fn needs_prompt_logits(req: &Map<String, Value>) -> bool {
    let set = |m: &Map<String, Value>, k: &str| {
        m.get(k)
            .is_some_and(|v| !v.is_null() && *v != Value::Bool(false))
    };
    let nested = req
        .get("sampling_params")
        .and_then(Value::as_object)
        .is_some_and(|sp| set(sp, "prompt_logprobs"));
    set(req, "prompt_logprobs")
        || nested
        || (req.get("echo") == Some(&Value::Bool(true)) && set(req, "logprobs"))
}

/// Whether a completions body carries several prompts (a list of strings
/// or of token-id lists): one transfer carries one prompt's KV, so D
/// answers such a batch alone.
pub fn is_prompt_batch(req: &Map<String, Value>) -> bool {
    match req.get("prompt") {
        Some(Value::Array(items)) if items.len() > 1 => {
            items.iter().all(Value::is_string) || items.iter().all(Value::is_array)
        }
        _ => false,
    }
}

/// Whether a request whose body is `req` can be resumed on another D with
/// the tokens it produced: one sequence (`n` and `best_of` at most 1), no
/// echoed prompt and no prompt log-probabilities (those went out with the
/// first event, and a resumed D would send them again).
pub fn can_resume(req: &Map<String, Value>) -> bool {
    let at_most_one = |k: &str| req.get(k).and_then(Value::as_u64).is_none_or(|n| n <= 1);
    at_most_one("n")
        && at_most_one("best_of")
        && req.get("echo").and_then(Value::as_bool) != Some(true)
        && !needs_prompt_logits(req)
        && !is_prompt_batch(req)
}
