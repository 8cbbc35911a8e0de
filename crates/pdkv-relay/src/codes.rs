//! The OpenAI error codes the relay plan decides on.

/// The code of a 503 that clears by itself (paused, asleep, weights being
/// reloaded): such responses carry `Retry-After`. A prefill engine's 503
/// with this code is a refusal on purpose, after which D computes the
/// prompt itself.
pub const RETRYABLE_CODE: &str = "engine_not_serving";

/// The code of the proxy's 503 for a decode engine lost (its connection
/// refused or broken, not timed out) before anything of its answer reached
/// the client: the request can be sent again whole, and the proxy does so
/// once a decode engine serves (it carries `Retry-After`).
pub const DECODE_LOST_CODE: &str = "decode_server_lost";
