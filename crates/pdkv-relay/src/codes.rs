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

/// The request header that asks an engine to name, in each streamed event,
/// the output token ids the event's text comes from: an SSE comment line
/// ([`TOKEN_IDS_COMMENT`]) leads the event, and an output that shows
/// nothing still gets an event of that line alone. Clients' SSE parsers
/// skip comments; the proxy strips them. It is what lets the proxy resume
/// a stream elsewhere with exactly the tokens whose text the client has.
pub const TOKEN_IDS_HEADER: &str = "x-pdkv-token-ids";

/// How that comment line starts; the ids follow as a JSON array.
pub const TOKEN_IDS_COMMENT: &str = ": token_ids ";
