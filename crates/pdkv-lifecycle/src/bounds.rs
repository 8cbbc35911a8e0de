//! Every bound of the matrix, each with its reason.

use std::time::Duration;

/// Bound on one load or probe request (connection to the end of its body).
pub(crate) const REQUEST_DEADLINE: Duration = Duration::from_secs(120);
/// A load worker's bound on stopping: its request's bound, and slack.
pub(crate) const WORKER_STOP_DEADLINE: Duration =
    Duration::from_secs(REQUEST_DEADLINE.as_secs() + 10);
/// Bound on waiting for P and D to become quiescent after the load stopped.
pub(crate) const QUIESCE_DEADLINE: Duration = Duration::from_secs(90);
/// Bound on waiting for the load to make progress (warm-up, after restore).
pub(crate) const PROGRESS_DEADLINE: Duration = Duration::from_secs(90);
/// How long a worker waits after a 503 before its next request.
pub(crate) const RETRY_BACKOFF: Duration = Duration::from_millis(100);
/// Interval of metric and health polls.
pub(crate) const POLL: Duration = Duration::from_millis(20);
/// Interval of the polls for a transfer held at P (a moment that passes
/// quickly).
pub(crate) const GAUGE_POLL: Duration = Duration::from_millis(5);
/// Bound on one `/metrics` scrape.
pub(crate) const METRICS_TIMEOUT: Duration = Duration::from_secs(10);
/// Bound on connecting to an engine or the proxy.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// The proxy's health checks' interval, in milliseconds: short, so that it
/// sees an engine serving again soon after a restore.
pub(crate) const PROXY_HEALTH_INTERVAL_MS: u64 = 200;
/// Most device bytes a sleeping engine may keep, as a fraction of awake.
pub(crate) const ASLEEP_MAX_FRACTION: f64 = 0.02;
/// A phase slower than this (seconds) is named in the case's notes.
pub(crate) const SLOW_PHASE_S: f64 = 5.0;
/// Probes sent at once.
pub(crate) const PROBE_BATCH: usize = 8;
pub(crate) const MIB: f64 = 1024.0 * 1024.0;
