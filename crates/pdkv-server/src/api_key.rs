//! `--api-key`: the OpenAI routes (`/v1/*`, `/tokenize`, `/detokenize`)
//! answer only requests with `Authorization: Bearer <key>`, as vLLM's
//! `--api-key` does; `/health`, `/metrics` and `/version` stay open for
//! probes and scrapers. A missing or wrong key is a 401 with an OpenAI
//! error body. The comparison is the admin token's (time independent of
//! where the bytes differ).

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

use crate::admin::AdminToken;
use crate::error::ApiError;

/// The key clients must present.
pub type ApiKey = AdminToken;

/// Lets a request through only with `Authorization: Bearer <key>`.
pub(crate) async fn require_key(State(key): State<Arc<ApiKey>>, req: Request, next: Next) -> Response {
    let presented = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim());
    let err = match presented {
        Some(t) if key.matches(t.as_bytes()) => return next.run(req).await,
        Some(_) => ApiError::unauthorized("invalid API key"),
        None => ApiError::unauthorized("this server needs an API key: send `Authorization: Bearer <key>`"),
    };
    let mut resp = err.into_response();
    resp.headers_mut().insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    resp
}
