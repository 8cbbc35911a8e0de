//! The P/D proxy: one OpenAI endpoint in front of prefill (P) and decode (D)
//! engine servers.
//!
//! Each generation request goes to one healthy P and one healthy D (round
//! robin over the healthy ones of each role). P gets the client's body with
//! `max_tokens: 1`, `stream: false` and `kv_transfer_params:
//! {"do_remote_decode": true, "transfer_id": T}`; its answer text is
//! ignored. D's answer is what the client receives: JSON as D sent it, or
//! D's server-sent events forwarded unchanged.
//!
//! Write mode: P and D are asked at once; D gets `kv_transfer_params:
//! {"do_remote_prefill": true, "remote_engine_id": .., "remote_bootstrap_addr":
//! .., "transfer_id": T}` (P's engine id and bootstrap address as its `GET
//! /kv_transfer/info` last said) and pulls the KV from P. Read mode (P's
//! info says `"transfer_mode":"read"`): D reads the blocks P leases, which
//! P names only in its answer, so P goes first and D gets exactly the
//! `kv_transfer_params` of P's answer.
//!
//! Plan and driver: what to do for one request is decided by a sans-IO
//! state machine, [`plan::RelayPlan`] (events in: P's answer, D's head,
//! body and end, failed calls, the client leaving; actions out: send,
//! cancel, drop the transfer at P, answer or stream to the client, count).
//! It has no HTTP types, clock or threads, so a simulator can drive it with
//! simulated time and network; it lives in the crate `pdkv-relay`. This
//! module and its rooms are its driver: they move bytes, and decide nothing
//! about a request.
//!
//! Rooms, each with one job: `config.rs` (the configuration and the ones
//! refused), `backends.rs` (the backends as last checked, the round-robin
//! pick), `health.rs` (the checks), `shared.rs` (the state every room
//! shares: no room reaches back into this file), `upstream.rs` (the calls to
//! the engines), `body.rs` (P's and D's bodies), `handlers.rs` (the routes),
//! `relay.rs` (one request's calls), `metrics.rs` (the counters),
//! `fanout.rs`, `engine_calls.rs` and `weight_fanout.rs` (the admin API).
//!
//! A request that wants its prompt's logits (`prompt_logprobs`, or `echo`
//! with `logprobs`) goes to D alone, which computes the prompt; its answer
//! passes through as it comes.
//!
//! Failure rules (see [`plan`] for the exact actions):
//! - P stopping on purpose is not the client's failure, because a P
//!   lifecycle operation (pause, sleep, weight reload, abort) must never
//!   lose a request: P answered 503 `engine_not_serving` (paused, asleep) or
//!   its answer's `finish_reason` is `abort`. Write mode: D keeps running
//!   and P is told to drop the transfer with `prefill_refused` /
//!   `prefill_aborted`, so that a pull D parked at P is answered at once
//!   and D computes the prompt itself. Read mode: D gets the client's body
//!   without `kv_transfer_params`. The client gets D's answer; the request
//!   is counted in `pdkv_proxy_prefill_skipped_total{reason}`.
//! - Any other P failure (another error status, a transport error or
//!   timeout, an answer that is not a completion): D's request is dropped,
//!   and the client gets P's error (an error status passed through with its
//!   body, or the proxy's own error). It is always a status, since no
//!   stream is committed while P runs.
//! - D answers an error status: passed through. A failing D (error status,
//!   transport error, broken stream) drops a P request still running and
//!   tells P to drop the transfer, so P frees its blocks now.
//! - D finishes first: its answer stands and P's request is dropped.
//! - The client's own bad request (400, 404, 409, 413 or 422 from P or D,
//!   or a body the proxy cannot parse) is counted as `bad_request` and
//!   logged at debug, not as a backend's error.
//! - An upstream call past `request_timeout` is a 504 whose OpenAI error
//!   (`upstream_timeout`) names that setting; any other failed call a 502.
//! - The client disconnects: both upstream requests are dropped with the
//!   handler or the response body, which closes their connections, and a
//!   pdkv server aborts a request whose connection closes.
//!
//! Invariants:
//! - Both upstream requests of a client request are owned by its handler
//!   future or its response body and by nothing else (no spawned task), so
//!   nothing outlives the client's request.
//! - Streaming: D's status is committed only after P answered (or D's whole
//!   answer is in), so a P failure reaches the client as a status; D's
//!   events are cut only at event boundaries (`\n\n`), so an error event
//!   appended after a failure is never glued to half an event.
//! - Every upstream call is bounded: a connect timeout and an overall
//!   request timeout; health checks have their own short timeout; the plan
//!   buffers at most [`plan::MAX_BUFFERED`] bytes of an answer.
//! - Each client request is counted in `pdkv_proxy_requests_total` exactly
//!   once (as `cancelled` when it is dropped before an outcome).

use std::future::Future;
use std::sync::Arc;

use axum::Router;

mod backends;
mod body;
mod config;
mod engine_calls;
mod fanout;
mod handlers;
mod health;
mod metrics;
mod relay;
mod shared;
mod upstream;
mod weight_fanout;

pub use backends::{BackendSnapshot, KvTransferInfo};
pub use config::{ProxyConfig, ProxyError, UPSTREAM_IDLE};
pub use pdkv_relay::plan;
pub use plan::Role;

use shared::Shared;

/// The P/D proxy. Cheap to clone (shared state).
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Shared>,
}

impl Proxy {
    /// A proxy over the configured backends. Every backend counts as
    /// unhealthy until [`Proxy::check_backends`] has seen it answer
    /// ([`Proxy::serve`] runs one round before it accepts connections).
    pub fn new(config: ProxyConfig) -> Result<Proxy, ProxyError> {
        Ok(Proxy {
            inner: Arc::new(Shared::new(config)?),
        })
    }

    /// Every backend, prefill servers first, as last checked.
    pub fn backends(&self) -> Vec<BackendSnapshot> {
        self.inner.snapshots()
    }

    /// Whether at least one prefill and one decode server are healthy.
    pub fn is_ready(&self) -> bool {
        self.inner.is_ready()
    }

    /// One round of health checks, all backends at once: `GET /health`, and
    /// for prefill servers `GET /kv_transfer/info`. Returns when every
    /// check has answered or timed out.
    pub async fn check_backends(&self) {
        self.inner.check_backends().await
    }

    /// The proxy's routes.
    pub fn router(&self) -> Router {
        handlers::router(self.inner.clone())
    }

    /// Checks the backends once, then serves on `listener` (with health
    /// checks every `health_interval`) until `shutdown` resolves; then stops
    /// accepting and waits for open connections.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        self.check_backends().await;
        for b in self.backends() {
            if !b.healthy {
                tracing::warn!(
                    role = %b.role,
                    url = %b.url,
                    reason = b.last_error.as_deref().unwrap_or("unknown"),
                    "backend not healthy at start"
                );
            }
        }
        let health = health::spawn_loop(self.inner.clone());
        let result =
            crate::listen::serve(listener, self.router(), self.inner.config.http, shutdown).await;
        health.abort();
        result
    }

    /// The Prometheus text of the proxy's counters and backend health.
    pub fn render_metrics(&self) -> String {
        metrics::render(&self.inner.metrics, &self.backends())
    }
}

#[cfg(test)]
mod tests {
    use super::config::normalize_url;
    use super::*;

    #[test]
    fn urls_are_normalized_and_checked() {
        assert_eq!(
            normalize_url(Role::Prefill, "127.0.0.1:8100").unwrap(),
            "http://127.0.0.1:8100"
        );
        assert_eq!(
            normalize_url(Role::Decode, "http://localhost:9/").unwrap(),
            "http://localhost:9"
        );
        assert!(matches!(
            normalize_url(Role::Decode, "https://x:1"),
            Err(ProxyError::BadUrl { .. })
        ));
        assert!(matches!(
            normalize_url(Role::Decode, "http://x:1/?a=b"),
            Err(ProxyError::BadUrl { .. })
        ));
        let dup = ProxyConfig::new(vec!["a:1".into(), "http://a:1".into()], vec!["b:2".into()]);
        assert!(matches!(Proxy::new(dup), Err(ProxyError::Duplicate { .. })));
        assert!(matches!(
            Proxy::new(ProxyConfig::new(vec![], vec!["b:2".into()])),
            Err(ProxyError::NoBackend(_))
        ));
    }
}
