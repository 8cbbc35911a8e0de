//! The proxy's calls to the engines: a generation request's post, the
//! drop of a transfer at P, and the routes forwarded to a decode server;
//! with the helpers that shape what they give back.

use std::sync::Arc;
use std::time::Duration;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use pdkv_connector::wire::FailCode;

use super::backends::Backend;
use super::body::Endpoint;
use super::shared::Shared;
use crate::error::ApiError;

/// The client's headers a generation request carries on to P and D: its
/// request id, and its `Authorization` (engines started with `--api-key`
/// check it themselves).
#[derive(Clone, Debug, Default)]
pub(super) struct Forwarded {
    pub(super) request_id: Option<HeaderValue>,
    pub(super) authorization: Option<HeaderValue>,
}

impl Shared {
    /// Posts `body` to a backend, bounded by `request_timeout`. A connection
    /// failure marks the backend unhealthy at once (the next health check
    /// may restore it).
    pub(super) async fn post(
        &self,
        b: &Arc<Backend>,
        endpoint: Endpoint,
        body: Vec<u8>,
        forwarded: &Forwarded,
    ) -> Result<reqwest::Response, reqwest::Error> {
        let mut req = self
            .client
            .post(format!("{}{}", b.url, endpoint.path()))
            .timeout(self.config.request_timeout)
            .header(header::CONTENT_TYPE, "application/json")
            .body(body);
        if let Some(a) = &forwarded.authorization {
            req = req.header(header::AUTHORIZATION, a.clone());
        }
        if let Some(id) = forwarded.request_id.clone() {
            req = req.header("x-request-id", id);
        }
        let r = req.send().await;
        if let Err(e) = &r {
            if e.is_connect() {
                b.mark_unhealthy(format!("connecting failed: {}", error_chain(e)));
            }
        }
        r
    }

    /// Tells P (in the background, bounded) to drop a transfer for `code`:
    /// no decode request will take it (P frees the blocks now rather than
    /// when the lease expires), or P refused or aborted it (a pull D parked
    /// at P is answered at once).
    pub(super) fn drop_at_prefill(
        &self,
        bootstrap: Option<String>,
        transfer_id: &str,
        code: FailCode,
    ) {
        let Some(addr) = bootstrap else { return };
        // A relay dropped while the runtime shuts down has no one to tell.
        let Ok(rt) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let transfer_id = transfer_id.to_string();
        let limit = self.config.health_timeout.max(Duration::from_secs(2));
        let secret = self.config.kv_secret.clone();
        rt.spawn(async move {
            match pdkv_connector::wire::drop_transfer(&addr, &secret, &transfer_id, code, limit).await {
                Ok(known) => tracing::debug!(%transfer_id, %code, known, "dropped the transfer at the prefill server"),
                Err(e) => tracing::warn!(%transfer_id, %code, "could not drop the transfer at {addr}: {e}"),
            }
        });
    }

    /// Any healthy decode server's answer to `GET path`.
    pub(super) async fn forward_get(&self, path: &str) -> Response {
        self.forward(reqwest::Method::GET, path, None, None).await
    }

    /// Any healthy decode server's answer to `method path` with `body` (the
    /// client's `Authorization` passed on): the routes that ask about the
    /// model, which every engine answers alike.
    pub(super) async fn forward(
        &self,
        method: reqwest::Method,
        path: &str,
        auth: Option<HeaderValue>,
        body: Option<Bytes>,
    ) -> Response {
        let Some((d, _)) = self.decode.pick() else {
            return retryable(
                ApiError::unavailable("no decode server is healthy")
                    .with_code("no_healthy_backend"),
            );
        };
        let mut req = self
            .client
            .request(method, format!("{}{path}", d.url))
            .timeout(self.config.health_timeout.max(Duration::from_secs(10)));
        if let Some(a) = auth {
            req = req.header(header::AUTHORIZATION, a);
        }
        if let Some(b) = body {
            req = req.header(header::CONTENT_TYPE, "application/json").body(b);
        }
        let resp = req.send().await;
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return forward_failed(&d, &e),
        };
        let status = resp.status();
        let head = passthrough_headers(resp.headers());
        match resp.bytes().await {
            Ok(b) => build_response(status, head, Body::from(b)),
            Err(e) => forward_failed(&d, &e),
        }
    }
}

/// A 502 for a `GET` forwarded to D that got no answer.
pub(super) fn forward_failed(d: &Backend, e: &reqwest::Error) -> Response {
    let message = format!("decode server {} failed: {}", d.url, error_chain(e));
    ApiError {
        status: StatusCode::BAD_GATEWAY,
        message,
        kind: "server_error",
        param: None,
        code: Some("upstream_error"),
    }
    .into_response()
}

/// A 503 with `Retry-After`.
pub(super) fn retryable(err: ApiError) -> Response {
    let mut resp = err.into_response();
    resp.headers_mut()
        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    resp
}

/// The response headers worth passing through from an upstream answer.
pub(super) fn passthrough_headers(h: &HeaderMap) -> Vec<(HeaderName, HeaderValue)> {
    [
        header::CONTENT_TYPE,
        header::CACHE_CONTROL,
        header::RETRY_AFTER,
        HeaderName::from_static("x-request-id"),
    ]
    .into_iter()
    .filter_map(|name| h.get(&name).cloned().map(|v| (name, v)))
    .collect()
}

pub(super) fn build_response(
    status: StatusCode,
    head: Vec<(HeaderName, HeaderValue)>,
    body: Body,
) -> Response {
    let mut resp = Response::new(body);
    *resp.status_mut() = status;
    resp.headers_mut().extend(head);
    resp
}

/// An error with its sources, on one line.
pub(super) fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut src = e.source();
    while let Some(cause) = src {
        let c = cause.to_string();
        if !s.contains(&c) {
            s.push_str(": ");
            s.push_str(&c);
        }
        src = cause.source();
    }
    s
}
