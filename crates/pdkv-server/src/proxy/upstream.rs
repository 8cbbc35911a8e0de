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
use crate::error::{error_chain, ApiError};

/// The client's headers a generation request carries on to P and D: its
/// request id, and its `Authorization` (engines started with `--api-key`
/// check it themselves).
#[derive(Clone, Debug, Default)]
pub(super) struct Forwarded {
    pub(super) request_id: Option<HeaderValue>,
    pub(super) authorization: Option<HeaderValue>,
    /// The client's address, which engines scope its request id by.
    pub(super) forwarded_for: Option<HeaderValue>,
    /// The id P is asked under where it is not D's: a request sent again
    /// after a retryable refusal asks P under a fresh id, since P may still
    /// hold the first attempt's (that call was dropped, and P lets its id
    /// go only once it sees the connection close). The client sees D's id.
    pub(super) prefill_request_id: Option<HeaderValue>,
    /// Ask D to name each streamed event's token ids
    /// ([`pdkv_relay::TOKEN_IDS_HEADER`]): the plan resumes lost streams.
    pub(super) token_ids: bool,
}

impl Forwarded {
    /// The headers P's call carries.
    pub(super) fn for_prefill(&self) -> Forwarded {
        Forwarded {
            request_id: self
                .prefill_request_id
                .clone()
                .or_else(|| self.request_id.clone()),
            authorization: self.authorization.clone(),
            forwarded_for: self.forwarded_for.clone(),
            prefill_request_id: None,
            token_ids: false,
        }
    }
}

/// The id P is asked under in attempt `attempt` (from 0) of a request the
/// client named `id` (`None`: P makes its own): the client's id at first,
/// then the id with `-retry<attempt>` (cut to stay within an engine's
/// 256-byte bound).
pub(super) fn prefill_request_id(id: Option<&str>, attempt: u32) -> Option<HeaderValue> {
    let id = id?;
    if attempt == 0 {
        return HeaderValue::from_str(id).ok();
    }
    let suffix = format!("-retry{attempt}");
    let keep = id.len().min(256 - suffix.len());
    // Header values and validated ids are ASCII: any cut is a boundary.
    let cut = id.get(..keep).unwrap_or(id);
    HeaderValue::from_str(&format!("{cut}{suffix}")).ok()
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
        if let Some(ip) = forwarded.forwarded_for.clone() {
            req = req.header("x-forwarded-for", ip);
        }
        if forwarded.token_ids {
            req = req.header(pdkv_relay::TOKEN_IDS_HEADER, "1");
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retry_asks_prefill_under_a_fresh_id_within_the_bound() {
        let id =
            |s: Option<&str>, n| prefill_request_id(s, n).map(|v| v.to_str().unwrap().to_string());
        assert_eq!(id(None, 0), None);
        assert_eq!(id(None, 3), None);
        assert_eq!(id(Some("req-1"), 0).as_deref(), Some("req-1"));
        assert_eq!(id(Some("req-1"), 1).as_deref(), Some("req-1-retry1"));
        assert_eq!(id(Some("req-1"), 12).as_deref(), Some("req-1-retry12"));
        let long = "x".repeat(256);
        let cut = id(Some(&long), 2).unwrap();
        assert_eq!(cut.len(), 256);
        assert!(cut.ends_with("x-retry2"), "{cut}");

        // P's call carries the fresh id; D's keeps the client's.
        let f = Forwarded {
            request_id: Some(HeaderValue::from_static("req-1")),
            authorization: Some(HeaderValue::from_static("Bearer k")),
            forwarded_for: Some(HeaderValue::from_static("192.0.2.7")),
            prefill_request_id: prefill_request_id(Some("req-1"), 1),
            token_ids: false,
        };
        let p = f.for_prefill();
        assert_eq!(p.request_id.unwrap(), "req-1-retry1");
        assert_eq!(p.authorization.unwrap(), "Bearer k");
        assert_eq!(p.forwarded_for.unwrap(), "192.0.2.7");
        assert_eq!(f.request_id.unwrap(), "req-1");
    }
}
