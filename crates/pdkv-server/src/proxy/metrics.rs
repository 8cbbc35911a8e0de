//! The proxy's counters and their Prometheus text.

use std::sync::atomic::{AtomicU64, Ordering};

use pdkv_relay::plan::{OnPurpose, Outcome, Role};

use super::backends::BackendSnapshot;
use crate::metrics::Exposition;

/// The proxy's counters.
#[derive(Default)]
pub(super) struct ProxyMetrics {
    outcomes: [AtomicU64; Outcome::ALL.len()],
    /// Failed upstream generation calls, by role (prefill, decode).
    upstream_errors: [AtomicU64; 2],
    /// Prefills that stopped on purpose, by [`OnPurpose`].
    prefill_skipped: [AtomicU64; OnPurpose::ALL.len()],
    /// Requests D computed alone because no prefill server was up.
    prefill_down: AtomicU64,
    resumed: AtomicU64,
}

impl ProxyMetrics {
    pub(super) fn count(&self, outcome: Outcome) {
        self.outcomes[outcome.index()].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn upstream_error(&self, role: Role) {
        self.upstream_errors[role as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn prefill_skipped(&self, why: OnPurpose) {
        self.prefill_skipped[why as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn resumed(&self) {
        self.resumed.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn prefill_down(&self) {
        self.prefill_down.fetch_add(1, Ordering::Relaxed);
    }
}

/// The Prometheus text of the proxy's counters `m` and the backends' health
/// (`snaps`).
pub(super) fn render(m: &ProxyMetrics, snaps: &[BackendSnapshot]) -> String {
    let mut e = Exposition::new();
    let outcomes: Vec<[(&str, &str); 1]> = Outcome::ALL
        .iter()
        .map(|o| [("outcome", o.as_str())])
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = outcomes
        .iter()
        .zip(Outcome::ALL)
        .map(|(l, o)| (&l[..], m.outcomes[o.index()].load(Ordering::Relaxed) as f64))
        .collect();
    e.family(
        "pdkv_proxy_requests_total",
        "Client generation requests by outcome.",
        "counter",
        &samples,
    );
    let roles = [[("role", "prefill")], [("role", "decode")]];
    let samples: Vec<(&[(&str, &str)], f64)> = roles
        .iter()
        .enumerate()
        .map(|(i, l)| (&l[..], m.upstream_errors[i].load(Ordering::Relaxed) as f64))
        .collect();
    e.family(
            "pdkv_proxy_upstream_errors_total",
            "Failed upstream generation calls (an error status other than the client's own bad request, a transport \
             error, a timeout or an unusable answer), by role.",
            "counter",
            &samples,
        );
    let reasons: Vec<[(&str, &str); 1]> = OnPurpose::ALL
        .iter()
        .map(|w| [("reason", w.as_str())])
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = reasons
        .iter()
        .zip(OnPurpose::ALL)
        .map(|(l, w)| {
            (
                &l[..],
                m.prefill_skipped[w as usize].load(Ordering::Relaxed) as f64,
            )
        })
        .collect();
    e.family(
            "pdkv_proxy_prefill_skipped_total",
            "Requests whose prefill server refused (paused, asleep) or aborted them on purpose; the decode server \
             computed the prompt itself.",
            "counter",
            &samples,
        );
    e.family(
        "pdkv_proxy_prefill_down_total",
        "Requests the decode server computed alone because no prefill server was up.",
        "counter",
        &[(&[][..], m.prefill_down.load(Ordering::Relaxed) as f64)],
    );
    e.family(
        "pdkv_proxy_requests_resumed_total",
        "Streams moved to another decode server (or the same, restarted) after theirs was lost mid-stream.",
        "counter",
        &[(&[][..], m.resumed.load(Ordering::Relaxed) as f64)],
    );
    let labels: Vec<[(&str, &str); 2]> = snaps
        .iter()
        .map(|b| [("role", b.role.as_str()), ("url", b.url.as_str())])
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = labels
        .iter()
        .zip(snaps)
        .map(|(l, b)| (&l[..], if b.healthy { 1.0 } else { 0.0 }))
        .collect();
    e.family(
        "pdkv_proxy_backend_healthy",
        "1 if the backend passed its last health check.",
        "gauge",
        &samples,
    );
    e.finish()
}
