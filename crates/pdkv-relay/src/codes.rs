//! The OpenAI error codes the relay plan decides on.

/// The code of a 503 that clears by itself (paused, asleep, weights being
/// reloaded): such responses carry `Retry-After`. A prefill engine's 503
/// with this code is a refusal on purpose, after which D computes the
/// prompt itself.
pub const RETRYABLE_CODE: &str = "engine_not_serving";
