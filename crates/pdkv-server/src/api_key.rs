//! `--api-key`: the OpenAI routes (`/v1/*`, `/tokenize`, `/detokenize`)
//! answer only requests with `Authorization: Bearer <key>`, as vLLM's
//! `--api-key` does; `/health`, `/metrics` and `/version` stay open for
//! probes and scrapers. A missing or wrong key is a 401 with an OpenAI
//! error body. The comparison is the admin token's (time independent of
//! where the bytes differ).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;

use crate::admin::{check_bearer, unauthorized, AdminToken};

/// The key clients must present.
pub type ApiKey = AdminToken;

/// Lets a request through only with `Authorization: Bearer <key>`.
pub(crate) async fn require_key(
    State(key): State<Arc<ApiKey>>,
    req: Request,
    next: Next,
) -> Response {
    let missing = "this server needs an API key: send `Authorization: Bearer <key>`";
    match check_bearer(&key, &req, "invalid API key", missing) {
        Ok(()) => next.run(req).await,
        Err(e) => unauthorized(e),
    }
}
