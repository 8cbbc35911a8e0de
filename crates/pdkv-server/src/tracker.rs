//! A request's output stream with per-request timing for metrics.
//!
//! [`TrackedStream`] owns the engine's [`RequestStream`]; the HTTP response
//! (or the handler future, for non-streaming requests) owns the
//! `TrackedStream` and nothing else does. So when a client goes away and
//! hyper drops the response body or the handler, the `RequestStream` is
//! dropped with it and the engine aborts the request and frees its blocks.

use std::sync::Arc;
use std::time::Instant;

use pdkv_engine::{FinishReason, RequestOutput, RequestStream};

use crate::metrics::Metrics;

pub struct TrackedStream {
    stream: RequestStream,
    metrics: Arc<Metrics>,
    arrived: Instant,
    last_token_at: Option<Instant>,
    generated: usize,
    /// Set once the request's end was counted in the metrics.
    finished: bool,
}

impl TrackedStream {
    /// `arrived` is when the HTTP request came in; the prompt tokens are
    /// counted now, as the request was admitted.
    pub fn new(
        stream: RequestStream,
        metrics: Arc<Metrics>,
        arrived: Instant,
        num_prompt_tokens: usize,
    ) -> TrackedStream {
        metrics.add_prompt_tokens(num_prompt_tokens as u64);
        TrackedStream {
            stream,
            metrics,
            arrived,
            last_token_at: None,
            generated: 0,
            finished: false,
        }
    }

    pub fn request_id(&self) -> &str {
        self.stream.request_id()
    }

    /// Tokens generated so far.
    pub fn generated(&self) -> usize {
        self.generated
    }

    /// The next output, or `None` after the last one. A stream that ends
    /// without a final output (the engine went away) counts as aborted.
    pub async fn next(&mut self) -> Option<RequestOutput> {
        if self.finished {
            return None;
        }
        let Some(out) = self.stream.next().await else {
            self.finish(FinishReason::Abort);
            return None;
        };
        self.observe_tokens(out.token_ids.len(), Instant::now());
        if let Some(reason) = out.finish_reason {
            self.finish(reason);
        }
        Some(out)
    }

    fn observe_tokens(&mut self, n: usize, now: Instant) {
        if n == 0 {
            return;
        }
        self.generated += n;
        self.metrics.add_generation_tokens(n as u64);
        match self.last_token_at {
            None => {
                self.metrics
                    .observe_ttft(now.duration_since(self.arrived).as_secs_f64());
                // Tokens that arrived together with the first one share its
                // step, so they add no inter-token latency of their own.
            }
            Some(prev) => {
                let each = now.duration_since(prev).as_secs_f64() / n as f64;
                for _ in 0..n {
                    self.metrics.observe_itl(each);
                }
            }
        }
        self.last_token_at = Some(now);
    }

    fn finish(&mut self, reason: FinishReason) {
        if !self.finished {
            self.finished = true;
            self.metrics.record_finished(reason);
        }
    }
}

impl Drop for TrackedStream {
    fn drop(&mut self) {
        // Dropping `self.stream` right after this aborts the request in the
        // engine; count it here so every admitted request is counted once.
        self.finish(FinishReason::Abort);
    }
}
