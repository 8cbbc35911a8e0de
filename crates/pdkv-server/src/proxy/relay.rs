//! The driver of one client request's [`RelayPlan`]: it makes the HTTP
//! calls the plan asks for, turns what they give into plan events, and
//! turns the plan's answer into the client's response. Every decision is
//! the plan's; this module only moves bytes.
//!
//! A [`Relay`] is owned by the handler future until the client's answer is
//! decided, then (when streaming) by the response body, and by nothing else:
//! dropping it drops both calls (closing their connections, which aborts a
//! pdkv server's request) and tells the plan the client went away.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderName, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use futures::stream::BoxStream;
use futures::StreamExt;
use serde_json::{Map, Value};

use pdkv_relay::plan::{
    Action, CallError, Cause, Event, Head, Outcome, PrefillAnswer, RelayPlan, Reply, Role,
};

use super::backends::Backend;
use super::body::{decode_body, prefill_body, Endpoint};
use super::shared::Shared;
use super::upstream::{build_response, passthrough_headers, Forwarded};
use crate::error::error_chain;
use crate::error::ApiError;

/// The client's request as the calls need it.
pub(super) struct Call {
    pub endpoint: Endpoint,
    pub req: Map<String, Value>,
    pub headers: Forwarded,
}

type PrefillCall = Pin<Box<dyn Future<Output = (Event, Option<HeaderValue>)> + Send>>;
type DecodeSend = Pin<Box<dyn Future<Output = reqwest::Result<reqwest::Response>> + Send>>;
type DecodeResume =
    Pin<Box<dyn Future<Output = Result<(Arc<Backend>, reqwest::Response), CallError>> + Send>>;

/// D's call: not made, waiting for its head (of the first D, or of the one
/// a lost stream resumes on, once one serves), or reading its body.
enum DecodeCall {
    Idle,
    Sending(DecodeSend),
    Resuming(DecodeResume),
    Body(BoxStream<'static, reqwest::Result<Bytes>>),
}

/// What an action gives the client.
enum Output {
    Reply(Response),
    StreamHead(u16),
    Piece(Bytes),
    /// The stream ends broken (after the pieces before it).
    Broken,
}

/// The error that ends a client's stream broken.
fn broken_stream() -> std::io::Error {
    std::io::Error::other("the decode server's answer broke off")
}

/// One client request in flight: its plan and the calls the plan made.
pub(super) struct Relay {
    proxy: Arc<Shared>,
    plan: RelayPlan,
    call: Call,
    p: Arc<Backend>,
    /// P's control listener, where drops go.
    p_bootstrap: Option<String>,
    d: Arc<Backend>,
    prefill: Option<PrefillCall>,
    /// The content type of P's answer.
    prefill_type: Option<HeaderValue>,
    decode: DecodeCall,
    /// D's headers worth passing on.
    decode_head: Vec<(HeaderName, HeaderValue)>,
}

/// A decode server that serves (a lost one is marked down until a health
/// check finds it back): picked at once, else after fresh health checks,
/// until `wait` passes.
async fn serving_decode(
    proxy: &Shared,
    wait: std::time::Duration,
) -> Result<Arc<Backend>, CallError> {
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Some((d, _)) = proxy.decode.pick() {
            return Ok(d);
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(CallError {
                timed_out: false,
                detail: format!(
                    "no decode server served within {:.0} s of losing the stream's (--resume-wait-s)",
                    wait.as_secs_f64()
                ),
            });
        }
        let pause = proxy
            .config
            .health_interval
            .min(std::time::Duration::from_millis(250));
        tokio::time::sleep_until(deadline.min(tokio::time::Instant::now() + pause)).await;
        proxy.check_backends().await;
    }
}

/// P's call: its answer read whole and classified, with its content type.
async fn prefill_call(
    proxy: Arc<Shared>,
    p: Arc<Backend>,
    endpoint: Endpoint,
    body: Vec<u8>,
    headers: Forwarded,
) -> (Event, Option<HeaderValue>) {
    let resp = match proxy.post(&p, endpoint, body, &headers).await {
        Ok(r) => r,
        Err(e) => return (Event::PrefillFailed(call_error(&e)), None),
    };
    let status = resp.status().as_u16();
    let content_type = resp.headers().get(header::CONTENT_TYPE).cloned();
    match resp.bytes().await {
        Ok(b) => (
            Event::Prefill(PrefillAnswer::parse(status, &b)),
            content_type,
        ),
        Err(e) => (Event::PrefillFailed(call_error(&e)), None),
    }
}

fn call_error(e: &reqwest::Error) -> CallError {
    CallError {
        timed_out: e.is_timeout(),
        detail: error_chain(e),
    }
}

/// P's next event; pends forever when P's call is not running.
async fn next_prefill(slot: &mut Option<PrefillCall>) -> (Event, Option<HeaderValue>) {
    let Some(fut) = slot.as_mut() else {
        return std::future::pending().await;
    };
    let out = fut.await;
    *slot = None;
    out
}

/// D's next event; pends forever when D's call is not running. A resumed
/// call's D becomes `d`.
async fn next_decode(
    call: &mut DecodeCall,
    head: &mut Vec<(HeaderName, HeaderValue)>,
    d: &mut Arc<Backend>,
) -> Event {
    let event = match call {
        DecodeCall::Idle => return std::future::pending().await,
        DecodeCall::Sending(fut) => match fut.await {
            Ok(resp) => {
                *head = passthrough_headers(resp.headers());
                let status = resp.status().as_u16();
                *call = DecodeCall::Body(resp.bytes_stream().boxed());
                return Event::DecodeHead { status };
            }
            Err(e) => Event::DecodeFailed(call_error(&e)),
        },
        DecodeCall::Resuming(fut) => match fut.await {
            Ok((backend, resp)) => {
                // The client has its head already; only the body follows.
                *d = backend;
                let status = resp.status().as_u16();
                *call = DecodeCall::Body(resp.bytes_stream().boxed());
                return Event::DecodeHead { status };
            }
            Err(e) => Event::DecodeFailed(e),
        },
        DecodeCall::Body(body) => match body.next().await {
            Some(Ok(chunk)) => return Event::DecodeBody(Vec::from(chunk)),
            Some(Err(e)) => Event::DecodeFailed(call_error(&e)),
            None => Event::DecodeEnd,
        },
    };
    *call = DecodeCall::Idle;
    event
}

impl Relay {
    pub(super) fn new(
        proxy: Arc<Shared>,
        plan: RelayPlan,
        call: Call,
        (p, p_bootstrap): (Arc<Backend>, Option<String>),
        d: Arc<Backend>,
    ) -> Relay {
        Relay {
            proxy,
            plan,
            call,
            p,
            p_bootstrap,
            d,
            prefill: None,
            prefill_type: None,
            decode: DecodeCall::Idle,
            decode_head: Vec::new(),
        }
    }

    /// Drives the plan until the client's answer is decided: a whole reply,
    /// or the head of a stream whose body then drives the rest.
    pub(super) async fn respond(mut self) -> Response {
        let mut reply = None;
        loop {
            while let Some(a) = self.plan.poll_action() {
                match self.apply(a) {
                    None => {}
                    Some(Output::Reply(r)) => reply = Some(r),
                    Some(Output::StreamHead(status)) => return self.into_stream(status),
                    Some(Output::Piece(_) | Output::Broken) => {
                        tracing::error!("the relay plan streamed before it started a stream")
                    }
                }
            }
            if let Some(r) = reply {
                return r;
            }
            if self.plan.is_finished() {
                return ApiError::internal("the relay plan ended without an answer")
                    .into_response();
            }
            let event = self.next_event().await;
            self.plan.handle(event);
        }
    }

    fn into_stream(self, status: u16) -> Response {
        let head = self.decode_head.clone();
        tracing::debug!(decode = %self.d.url, "streaming the decode server's events");
        let body = futures::stream::unfold(self, |mut relay| async move {
            let piece = relay.next_piece().await?;
            Some((piece, relay))
        });
        build_response(
            StatusCode::from_u16(status).unwrap_or(StatusCode::OK),
            head,
            Body::from_stream(body),
        )
    }

    /// The next piece of the client's stream; `None` at its end, an error
    /// when it ends broken.
    async fn next_piece(&mut self) -> Option<Result<Bytes, std::io::Error>> {
        loop {
            while let Some(a) = self.plan.poll_action() {
                match self.apply(a) {
                    None => {}
                    Some(Output::Piece(b)) => return Some(Ok(b)),
                    Some(Output::Broken) => return Some(Err(broken_stream())),
                    Some(Output::Reply(_) | Output::StreamHead(_)) => {
                        tracing::error!("the relay plan answered again inside a stream")
                    }
                }
            }
            if self.plan.is_finished() {
                return None;
            }
            let event = self.next_event().await;
            self.plan.handle(event);
        }
    }

    /// What the calls the plan made give next.
    async fn next_event(&mut self) -> Event {
        if self.prefill.is_none() && matches!(self.decode, DecodeCall::Idle) {
            // The plan waits for nothing that can come: end it rather than hang.
            let detail = "the relay waits for no call (a bug)".to_string();
            return Event::DecodeFailed(CallError {
                timed_out: false,
                detail,
            });
        }
        tokio::select! {
            (event, content_type) = next_prefill(&mut self.prefill) => {
                self.prefill_type = content_type;
                event
            }
            event = next_decode(&mut self.decode, &mut self.decode_head, &mut self.d) => event,
        }
    }

    /// Carries out one action; what it gives the client, if anything.
    fn apply(&mut self, a: Action) -> Option<Output> {
        match a {
            Action::SendPrefill { params } => {
                let body = prefill_body(&self.call.req, self.call.endpoint, params);
                let (proxy, p, endpoint, id) = (
                    self.proxy.clone(),
                    self.p.clone(),
                    self.call.endpoint,
                    self.call.headers.for_prefill(),
                );
                self.prefill = Some(Box::pin(prefill_call(proxy, p, endpoint, body, id)));
            }
            Action::SendDecode { params } => {
                let body = decode_body(&self.call.req, params);
                let mut id = self.call.headers.clone();
                id.token_ids = self.plan.tracks_token_ids();
                let (proxy, d, endpoint) = (self.proxy.clone(), self.d.clone(), self.call.endpoint);
                self.decode = DecodeCall::Sending(Box::pin(async move {
                    proxy.post(&d, endpoint, body, &id).await
                }));
            }
            Action::ResumeDecode { token_ids } => self.resume(token_ids),
            Action::CancelPrefill => self.prefill = None,
            Action::CancelDecode => self.decode = DecodeCall::Idle,
            Action::DropAtPrefill { code } => {
                self.proxy
                    .drop_at_prefill(self.p_bootstrap.clone(), self.plan.transfer_id(), code)
            }
            Action::PrefillSkipped(why) => {
                self.proxy.metrics.prefill_skipped(why);
                tracing::info!(
                    prefill = %self.p.url,
                    transfer_id = self.plan.transfer_id(),
                    reason = why.as_str(),
                    "the prefill server stopped on purpose; the decode server computes the prompt itself"
                );
            }
            Action::Reply(r) => return Some(Output::Reply(self.reply(r))),
            Action::StartStream { status } => return Some(Output::StreamHead(status)),
            Action::Stream(b) => return Some(Output::Piece(Bytes::from(b))),
            Action::FailStream {
                event,
                broken: false,
            } => return Some(Output::Piece(Bytes::from(event))),
            Action::FailStream {
                event,
                broken: true,
            } => {
                if !event.is_empty() {
                    tracing::error!("the relay plan sent an event with a broken end");
                }
                return Some(Output::Broken);
            }
            Action::EndStream => {}
            Action::Count { outcome, cause } => self.count(outcome, cause),
        }
        None
    }

    /// Sends the request to a decode server that serves, to continue
    /// after `token_ids`, under the id the client sees.
    fn resume(&mut self, token_ids: Vec<u32>) {
        let lost = self.d.clone();
        lost.mark_unhealthy("a stream it served broke off".into());
        self.proxy.metrics.resumed();
        tracing::warn!(
            decode = %lost.url,
            tokens = token_ids.len(),
            "decode server lost mid-stream; resuming the request on a decode server that serves"
        );
        // Even with no token yet: the new D must not open the stream again.
        let params = serde_json::json!({ pdkv_connector::params::RESUME_TOKEN_IDS: token_ids });
        let body = decode_body(&self.call.req, Some(params));
        let mut headers = self.call.headers.clone();
        headers.token_ids = true;
        if headers.request_id.is_none() {
            // The id the lost D gave, so the client's chunks keep it.
            headers.request_id = self
                .decode_head
                .iter()
                .find(|(name, _)| name.as_str() == "x-request-id")
                .map(|(_, v)| v.clone());
        }
        let (proxy, endpoint) = (self.proxy.clone(), self.call.endpoint);
        self.decode = DecodeCall::Resuming(Box::pin(async move {
            let d = serving_decode(&proxy, proxy.config.resume_wait).await?;
            let resp = proxy
                .post(&d, endpoint, body, &headers)
                .await
                .map_err(|e| call_error(&e))?;
            Ok((d, resp))
        }));
    }

    fn reply(&self, r: Reply) -> Response {
        let mut head = match r.head {
            Head::Decode => self.decode_head.clone(),
            Head::Prefill => self
                .prefill_type
                .iter()
                .map(|v| (header::CONTENT_TYPE, v.clone()))
                .collect(),
            Head::Json => vec![(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
        };
        if r.retry_after {
            head.retain(|(name, _)| name != header::RETRY_AFTER);
            head.push((header::RETRY_AFTER, HeaderValue::from_static("1")));
        }
        let status = StatusCode::from_u16(r.status).unwrap_or(StatusCode::BAD_GATEWAY);
        build_response(status, head, Body::from(r.body))
    }

    fn count(&self, outcome: Outcome, cause: Option<Cause>) {
        let metrics = &self.proxy.metrics;
        metrics.count(outcome);
        let Some(Cause { role, what }) = cause else {
            if outcome == Outcome::Cancelled {
                tracing::debug!("client went away; upstream requests dropped");
            }
            return;
        };
        let url = match role {
            Role::Prefill => &self.p.url,
            Role::Decode => &self.d.url,
        };
        if outcome == Outcome::BadRequest {
            tracing::debug!("{role} server {url} {what}: the client's request is refused");
        } else {
            metrics.upstream_error(role);
            tracing::warn!("{role} server {url} {what}; the request failed");
        }
    }
}

impl Drop for Relay {
    /// The client went away (or the answer is complete): the plan is told,
    /// so the request is counted once, and the calls drop with `self`.
    fn drop(&mut self) {
        self.plan.handle(Event::ClientGone);
        while let Some(a) = self.plan.poll_action() {
            let _ = self.apply(a);
        }
    }
}
