//! Server-side metrics and the Prometheus text exposition format.
//!
//! Counters and histograms measured here are per request, as the HTTP layer
//! sees them (time to first token counts from the request's arrival, so it
//! includes tokenization and queueing). Gauges come from a snapshot of the
//! engine's counters and the pool's live physical bytes at scrape time.
//!
//! Lifecycle metrics: the durations of `/sleep` and `/wake_up` are measured
//! by their handlers (the whole engine operation, as a client waits for it);
//! the sleep, pause and host-backup gauges are read from the engine and the
//! pool at scrape time, so they never disagree with `/is_sleeping`.
//!
//! Invariant: a request is counted in `pdkv_requests_total` exactly once,
//! when its [`crate::tracker::TrackedStream`] sees the final output or is
//! dropped before it (then as `abort`).

use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use pdkv_engine::{EngineStats, FinishReason};
use pdkv_vmem::{Tag, TagBytes};

/// Upper bounds (seconds) of the time-to-first-token buckets.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
];

/// Upper bounds (seconds) of the inter-token-latency buckets.
pub const ITL_BUCKETS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3,
    0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
];

/// Upper bounds (seconds) of the sleep and wake duration buckets.
pub const LIFECYCLE_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// The engine's lifecycle state as the metrics report it, read at scrape time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LifecycleGauges {
    /// The sleep level while asleep, `None` while awake.
    pub sleep_level: Option<u32>,
    pub paused: bool,
    /// True after a level-2 wake until weights are reloaded.
    pub weights_discarded: bool,
    /// Host memory holding backups of released regions (level-1 weights).
    pub host_backup_bytes: u64,
}

/// A histogram with fixed, increasing bucket bounds and an implicit `+Inf`.
#[derive(Clone, Debug, PartialEq)]
pub struct Histogram {
    bounds: &'static [f64],
    /// `counts[i]` observations fell in `(bounds[i-1], bounds[i]]`; the last
    /// entry counts those above every bound. Not cumulative.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    /// `bounds` must be strictly increasing and finite.
    pub fn new(bounds: &'static [f64]) -> Histogram {
        debug_assert!(bounds.windows(2).all(|w| w[0] < w[1]));
        Histogram {
            bounds,
            counts: vec![0; bounds.len() + 1],
            sum: 0.0,
            count: 0,
        }
    }

    /// Records one value. NaN is ignored (it belongs to no bucket).
    pub fn observe(&mut self, v: f64) {
        if v.is_nan() {
            return;
        }
        let i = self.bounds.partition_point(|&b| b < v);
        self.counts[i] += 1;
        self.sum += v;
        self.count += 1;
    }

    pub fn count(&self) -> u64 {
        self.count
    }

    pub fn sum(&self) -> f64 {
        self.sum
    }

    /// `(upper bound, cumulative count)` pairs ending with `(+inf, count)`.
    pub fn cumulative(&self) -> Vec<(f64, u64)> {
        let mut acc = 0;
        let mut out = Vec::with_capacity(self.counts.len());
        for (i, c) in self.counts.iter().enumerate() {
            acc += c;
            out.push((self.bounds.get(i).copied().unwrap_or(f64::INFINITY), acc));
        }
        out
    }
}

/// Writes the Prometheus text format (version 0.0.4).
#[derive(Default)]
pub struct Exposition {
    out: String,
}

impl Exposition {
    pub fn new() -> Exposition {
        Exposition::default()
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {}", escape_help(help));
        let _ = writeln!(self.out, "# TYPE {name} {kind}");
    }

    fn sample(&mut self, name: &str, labels: &[(&str, &str)], value: f64) {
        self.out.push_str(name);
        if !labels.is_empty() {
            self.out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                if i > 0 {
                    self.out.push(',');
                }
                let _ = write!(self.out, "{k}=\"{}\"", escape_label(v));
            }
            self.out.push('}');
        }
        let _ = writeln!(self.out, " {}", format_value(value));
    }

    /// One metric family with one sample per label set.
    pub fn family(
        &mut self,
        name: &str,
        help: &str,
        kind: &str,
        samples: &[(&[(&str, &str)], f64)],
    ) {
        self.header(name, help, kind);
        for (labels, v) in samples {
            self.sample(name, labels, *v);
        }
    }

    pub fn counter(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, help, "counter", &[(&[], value)]);
    }

    pub fn gauge(&mut self, name: &str, help: &str, value: f64) {
        self.family(name, help, "gauge", &[(&[], value)]);
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let bucket = format!("{name}_bucket");
        for (le, c) in h.cumulative() {
            let le = format_value(le);
            self.sample(&bucket, &[("le", &le)], c as f64);
        }
        self.sample(&format!("{name}_sum"), &[], h.sum());
        self.sample(&format!("{name}_count"), &[], h.count() as f64);
    }

    pub fn finish(self) -> String {
        self.out
    }
}

fn format_value(v: f64) -> String {
    if v.is_nan() {
        "NaN".to_string()
    } else if v == f64::INFINITY {
        "+Inf".to_string()
    } else if v == f64::NEG_INFINITY {
        "-Inf".to_string()
    } else {
        // Rust's shortest round-trip form, never in exponent notation.
        format!("{v}")
    }
}

fn escape_label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn escape_help(v: &str) -> String {
    v.replace('\\', "\\\\").replace('\n', "\\n")
}

const FINISH_REASONS: [FinishReason; 4] = [
    FinishReason::Stop,
    FinishReason::Length,
    FinishReason::Abort,
    FinishReason::Error,
];

fn reason_index(r: FinishReason) -> usize {
    match r {
        FinishReason::Stop => 0,
        FinishReason::Length => 1,
        FinishReason::Abort => 2,
        FinishReason::Error => 3,
    }
}

/// Request-level metrics collected by the HTTP layer.
pub struct Metrics {
    requests: [AtomicU64; 4],
    prompt_tokens: AtomicU64,
    generation_tokens: AtomicU64,
    ttft: Mutex<Histogram>,
    itl: Mutex<Histogram>,
    sleep_duration: Mutex<Histogram>,
    wake_duration: Mutex<Histogram>,
    /// Requests waiting for `/resume` before admission (a gauge).
    waiting_for_resume: AtomicU64,
    /// Request fields ignored because vLLM does not know them either, by
    /// name (names are bounded: see [`Metrics::ignored_field`]).
    ignored_fields: Mutex<std::collections::BTreeMap<String, u64>>,
}

/// Most distinct ignored field names counted; later ones share `"other"`.
const MAX_IGNORED_FIELD_NAMES: usize = 64;

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        Metrics {
            requests: Default::default(),
            prompt_tokens: AtomicU64::new(0),
            generation_tokens: AtomicU64::new(0),
            ttft: Mutex::new(Histogram::new(TTFT_BUCKETS)),
            itl: Mutex::new(Histogram::new(ITL_BUCKETS)),
            sleep_duration: Mutex::new(Histogram::new(LIFECYCLE_BUCKETS)),
            wake_duration: Mutex::new(Histogram::new(LIFECYCLE_BUCKETS)),
            waiting_for_resume: AtomicU64::new(0),
            ignored_fields: Mutex::new(std::collections::BTreeMap::new()),
        }
    }

    /// A request starts (`true`) or stops waiting for `/resume`.
    pub fn waiting_for_resume(&self, start: bool) {
        if start {
            self.waiting_for_resume.fetch_add(1, Ordering::Relaxed);
        } else {
            self.waiting_for_resume.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// How often the field `name` was ignored.
    pub fn ignored_field_count(&self, name: &str) -> u64 {
        let m = self
            .ignored_fields
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.get(name).copied().unwrap_or(0)
    }

    /// How often any field was ignored.
    pub fn ignored_fields_total(&self) -> u64 {
        let m = self
            .ignored_fields
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        m.values().sum()
    }

    /// A request field was ignored. Names are chosen by clients, so only
    /// the first [`MAX_IGNORED_FIELD_NAMES`] get their own series.
    pub fn ignored_field(&self, name: &str) {
        let mut m = self
            .ignored_fields
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let key = if m.contains_key(name) || m.len() < MAX_IGNORED_FIELD_NAMES {
            name
        } else {
            "other"
        };
        *m.entry(key.to_string()).or_insert(0) += 1;
    }

    pub fn record_finished(&self, reason: FinishReason) {
        self.requests[reason_index(reason)].fetch_add(1, Ordering::Relaxed);
    }

    pub fn requests_finished(&self, reason: FinishReason) -> u64 {
        self.requests[reason_index(reason)].load(Ordering::Relaxed)
    }

    pub fn add_prompt_tokens(&self, n: u64) {
        self.prompt_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub fn add_generation_tokens(&self, n: u64) {
        self.generation_tokens.fetch_add(n, Ordering::Relaxed);
    }

    pub fn observe_ttft(&self, seconds: f64) {
        self.ttft
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(seconds);
    }

    pub fn observe_itl(&self, seconds: f64) {
        self.itl
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(seconds);
    }

    /// A successful sleep took `seconds` (pause plus memory release).
    pub fn observe_sleep(&self, seconds: f64) {
        self.sleep_duration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(seconds);
    }

    /// A successful wake took `seconds` (mapping plus backup restore).
    pub fn observe_wake(&self, seconds: f64) {
        self.wake_duration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .observe(seconds);
    }

    /// The full exposition: these metrics plus engine, lifecycle and memory
    /// gauges.
    pub fn render(
        &self,
        stats: &EngineStats,
        device: &[TagBytes],
        lifecycle: &LifecycleGauges,
    ) -> String {
        self.render_with(stats, device, lifecycle, &[])
    }

    /// [`Metrics::render`] plus the KV connector's counters (`pdkv_kv_<name>`).
    pub fn render_with(
        &self,
        stats: &EngineStats,
        device: &[TagBytes],
        lifecycle: &LifecycleGauges,
        connector: &[(&str, &str, f64)],
    ) -> String {
        let mut e = Exposition::new();
        for &(name, help, value) in connector {
            let full = format!("pdkv_kv_{name}");
            if name.ends_with("_total") {
                e.counter(&full, help, value);
            } else {
                e.gauge(&full, help, value);
            }
        }
        self.render_requests(&mut e);
        render_engine(&mut e, stats);
        self.render_lifecycle(&mut e, stats, lifecycle);
        render_memory(&mut e, device);
        e.finish()
    }

    /// Requests and tokens: counts, TTFT and inter-token latency.
    fn render_requests(&self, e: &mut Exposition) {
        e.gauge(
            "pdkv_requests_waiting_for_resume",
            "Requests waiting for /resume before admission (the engine is paused).",
            self.waiting_for_resume.load(Ordering::Relaxed) as f64,
        );
        {
            let m = self
                .ignored_fields
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            let labels: Vec<[(&str, &str); 1]> =
                m.keys().map(|k| [("field", k.as_str())]).collect();
            let samples: Vec<(&[(&str, &str)], f64)> = labels
                .iter()
                .zip(m.values())
                .map(|(l, &v)| (&l[..], v as f64))
                .collect();
            e.family(
                "pdkv_ignored_request_fields_total",
                "Request fields ignored because vLLM does not know them either, by name.",
                "counter",
                &samples,
            );
        }
        let reasons: Vec<(&str, f64)> = FINISH_REASONS
            .iter()
            .map(|&r| (r.as_str(), self.requests_finished(r) as f64))
            .collect();
        let label_sets: Vec<[(&str, &str); 1]> = reasons
            .iter()
            .map(|(r, _)| [("finish_reason", *r)])
            .collect();
        let samples: Vec<(&[(&str, &str)], f64)> = label_sets
            .iter()
            .zip(&reasons)
            .map(|(l, (_, v))| (&l[..], *v))
            .collect();
        e.family(
            "pdkv_requests_total",
            "Finished requests by finish reason.",
            "counter",
            &samples,
        );
        e.counter(
            "pdkv_prompt_tokens_total",
            "Prompt tokens of admitted requests.",
            self.prompt_tokens.load(Ordering::Relaxed) as f64,
        );
        e.counter(
            "pdkv_generation_tokens_total",
            "Generated tokens.",
            self.generation_tokens.load(Ordering::Relaxed) as f64,
        );
        let ttft = self.ttft.lock().unwrap_or_else(|p| p.into_inner()).clone();
        e.histogram(
            "pdkv_time_to_first_token_seconds",
            "Time from a request's arrival to its first generated token.",
            &ttft,
        );
        let itl = self.itl.lock().unwrap_or_else(|p| p.into_inner()).clone();
        e.histogram(
            "pdkv_inter_token_latency_seconds",
            "Time between consecutive generated tokens.",
            &itl,
        );
    }

    /// The lifecycle's gauges and histograms, and the weight updates.
    fn render_lifecycle(
        &self,
        e: &mut Exposition,
        stats: &EngineStats,
        lifecycle: &LifecycleGauges,
    ) {
        let flag = |b: bool| if b { 1.0 } else { 0.0 };
        e.gauge(
            "pdkv_sleeping",
            "1 while the engine is asleep (any level), else 0.",
            flag(lifecycle.sleep_level.is_some()),
        );
        e.gauge(
            "pdkv_sleep_level",
            "The level of the current sleep (0, 1 or 2); -1 while awake.",
            lifecycle.sleep_level.map_or(-1.0, f64::from),
        );
        e.gauge(
            "pdkv_paused",
            "1 while scheduling is paused (by /pause or a sleep), else 0.",
            flag(lifecycle.paused),
        );
        e.gauge(
            "pdkv_weights_discarded",
            "1 after a level-2 wake until weights are reloaded (requests are refused), else 0.",
            flag(lifecycle.weights_discarded),
        );
        e.gauge(
            "pdkv_host_backup_bytes",
            "Host memory holding backups of released device memory.",
            lifecycle.host_backup_bytes as f64,
        );
        let sleep = self
            .sleep_duration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        e.histogram(
            "pdkv_sleep_duration_seconds",
            "Duration of successful /sleep calls.",
            &sleep,
        );
        let wake = self
            .wake_duration
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        e.histogram(
            "pdkv_wake_duration_seconds",
            "Duration of successful /wake_up calls.",
            &wake,
        );
        e.counter(
            "pdkv_weight_updates_total",
            "In-place weight reloads.",
            stats.lifecycle.num_weight_updates as f64,
        );
    }
}

/// The engine's scheduler, KV cache and prefix cache.
fn render_engine(e: &mut Exposition, stats: &EngineStats) {
    e.gauge(
        "pdkv_num_requests_running",
        "Requests scheduled in the engine.",
        stats.num_running as f64,
    );
    e.gauge(
        "pdkv_num_requests_waiting",
        "Requests queued in the engine.",
        stats.num_waiting as f64,
    );
    e.gauge(
        "pdkv_kv_blocks_total",
        "KV cache blocks.",
        stats.kv_blocks_total as f64,
    );
    e.gauge(
        "pdkv_kv_blocks_free",
        "Free KV cache blocks.",
        stats.kv_blocks_free as f64,
    );
    e.gauge(
        "pdkv_kv_blocks_used",
        "KV cache blocks in use.",
        stats.kv_blocks_total.saturating_sub(stats.kv_blocks_free) as f64,
    );
    e.counter(
        "pdkv_prefix_cache_queries_total",
        "Prompt tokens looked up in the prefix cache.",
        stats.prefix_cache_queries as f64,
    );
    e.counter(
        "pdkv_prefix_cache_hits_total",
        "Prompt tokens found in the prefix cache.",
        stats.prefix_cache_hits as f64,
    );
    let hit_rate = if stats.prefix_cache_queries == 0 {
        0.0
    } else {
        stats.prefix_cache_hits as f64 / stats.prefix_cache_queries as f64
    };
    e.gauge(
        "pdkv_prefix_cache_hit_rate",
        "Prefix cache hits / queries, cumulative.",
        hit_rate,
    );
    e.counter(
        "pdkv_num_preemptions_total",
        "Requests preempted by the scheduler.",
        stats.num_preemptions as f64,
    );
    e.gauge(
        "pdkv_kv_blocks_held",
        "KV blocks of finished requests held for transfers.",
        stats.kv_blocks_held as f64,
    );
    e.gauge(
        "pdkv_num_requests_waiting_for_remote_kv",
        "Requests whose KV is being loaded from another engine.",
        stats.num_waiting_for_remote_kv as f64,
    );
    e.counter(
        "pdkv_spec_decode_num_drafts_total",
        "Decode steps of a sequence that carried speculative draft tokens.",
        stats.spec.num_drafts as f64,
    );
    e.counter(
        "pdkv_spec_decode_num_draft_tokens_total",
        "Speculative draft tokens proposed.",
        stats.spec.num_draft_tokens as f64,
    );
    e.counter(
        "pdkv_spec_decode_num_accepted_tokens_total",
        "Speculative draft tokens the sampler confirmed.",
        stats.spec.num_accepted_tokens as f64,
    );
    let st = &stats.structured;
    e.gauge(
        "pdkv_structured_requests_running",
        "Requests with a structured output constraint in the engine.",
        st.num_running as f64,
    );
    e.counter(
        "pdkv_structured_masks_total",
        "Allowed-token masks computed for constrained requests.",
        st.num_masks as f64,
    );
    e.counter(
        "pdkv_structured_mask_seconds_total",
        "Seconds spent computing allowed-token masks (mostly while the forward pass runs).",
        st.mask_seconds,
    );
    e.counter(
        "pdkv_structured_mask_wait_seconds_total",
        "Seconds steps waited for masks after their forward pass.",
        st.mask_wait_seconds,
    );
    e.counter(
        "pdkv_structured_steps_total",
        "Steps that computed at least one mask.",
        st.num_steps as f64,
    );
}

/// Device memory by tag, in all and for each rank.
fn render_memory(e: &mut Exposition, device: &[TagBytes]) {
    let tags: Vec<[(&str, &str); 1]> = Tag::ALL.iter().map(|t| [("tag", t.as_str())]).collect();
    let mem: Vec<(&[(&str, &str)], f64)> = tags
        .iter()
        .zip(Tag::ALL)
        .map(|(l, t)| (&l[..], device.iter().map(|d| d.get(t)).sum::<u64>() as f64))
        .collect();
    e.family(
        "pdkv_device_memory_bytes",
        "Live physical bytes of the engine's memory (every rank's), by tag.",
        "gauge",
        &mem,
    );
    let ranks: Vec<String> = (0..device.len()).map(|r| r.to_string()).collect();
    let labels: Vec<[(&str, &str); 2]> = ranks
        .iter()
        .flat_map(|r| {
            Tag::ALL
                .iter()
                .map(move |t| [("rank", r.as_str()), ("tag", t.as_str())])
        })
        .collect();
    let by_rank: Vec<(&[(&str, &str)], f64)> = labels
        .iter()
        .zip(device.iter().flat_map(|d| Tag::ALL.map(|t| d.get(t))))
        .map(|(l, v)| (&l[..], v as f64))
        .collect();
    e.family(
            "pdkv_rank_device_memory_bytes",
            "Live physical bytes of each tensor-parallel rank's memory pool, by tag (rank 0 only for a whole model).",
            "gauge",
            &by_rank,
        );
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: &[f64] = &[0.1, 0.5, 1.0];

    #[test]
    fn histogram_buckets_are_upper_inclusive_and_cumulative() {
        let mut h = Histogram::new(B);
        for v in [0.05, 0.1, 0.3, 1.0, 7.0, f64::NAN] {
            h.observe(v);
        }
        assert_eq!(h.count(), 5);
        assert!((h.sum() - 8.45).abs() < 1e-12);
        assert_eq!(
            h.cumulative(),
            vec![(0.1, 2), (0.5, 3), (1.0, 4), (f64::INFINITY, 5)]
        );
    }

    #[test]
    fn histogram_exposition() {
        let mut h = Histogram::new(B);
        h.observe(0.2);
        h.observe(2.0);
        let mut e = Exposition::new();
        e.histogram("lat_seconds", "Latency.", &h);
        let expected = "# HELP lat_seconds Latency.\n\
                        # TYPE lat_seconds histogram\n\
                        lat_seconds_bucket{le=\"0.1\"} 0\n\
                        lat_seconds_bucket{le=\"0.5\"} 1\n\
                        lat_seconds_bucket{le=\"1\"} 1\n\
                        lat_seconds_bucket{le=\"+Inf\"} 2\n\
                        lat_seconds_sum 2.2\n\
                        lat_seconds_count 2\n";
        assert_eq!(e.finish(), expected);
    }

    #[test]
    fn labels_are_escaped_and_values_formatted() {
        let mut e = Exposition::new();
        e.family(
            "x_total",
            "Line1\nline2.",
            "counter",
            &[(&[("a", "q\"b\\c\nd")], 3.0)],
        );
        e.gauge("g", "G.", 0.25);
        e.gauge("nan", "N.", f64::NAN);
        let text = e.finish();
        assert!(text.contains("# HELP x_total Line1\\nline2.\n"), "{text}");
        assert!(
            text.contains("x_total{a=\"q\\\"b\\\\c\\nd\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("\ng 0.25\n"), "{text}");
        assert!(text.contains("\nnan NaN\n"), "{text}");
    }

    #[test]
    fn render_reports_every_family() {
        let m = Metrics::new();
        m.record_finished(FinishReason::Length);
        m.record_finished(FinishReason::Abort);
        m.record_finished(FinishReason::Abort);
        m.add_prompt_tokens(7);
        m.add_generation_tokens(5);
        m.observe_ttft(0.03);
        m.observe_itl(0.004);
        let stats = EngineStats {
            num_running: 1,
            num_waiting: 2,
            kv_blocks_total: 10,
            kv_blocks_free: 4,
            prefix_cache_queries: 8,
            prefix_cache_hits: 2,
            num_preemptions: 3,
            lifecycle: pdkv_engine::LifecycleStats {
                num_weight_updates: 2,
                ..Default::default()
            },
            spec: pdkv_engine::SpecStats {
                num_drafts: 4,
                num_draft_tokens: 12,
                num_accepted_tokens: 7,
            },
            ..EngineStats::default()
        };
        m.observe_sleep(0.3);
        m.observe_wake(0.02);
        m.observe_wake(0.04);
        let lifecycle = LifecycleGauges {
            sleep_level: Some(1),
            paused: true,
            weights_discarded: false,
            host_backup_bytes: 4096,
        };
        let text = m.render(
            &stats,
            &[TagBytes([100, 200, 300]), TagBytes([1, 2, 3])],
            &lifecycle,
        );
        for line in [
            "pdkv_requests_total{finish_reason=\"stop\"} 0",
            "pdkv_requests_total{finish_reason=\"length\"} 1",
            "pdkv_requests_total{finish_reason=\"abort\"} 2",
            "pdkv_prompt_tokens_total 7",
            "pdkv_generation_tokens_total 5",
            "pdkv_time_to_first_token_seconds_count 1",
            "pdkv_time_to_first_token_seconds_bucket{le=\"0.04\"} 1",
            "pdkv_time_to_first_token_seconds_bucket{le=\"0.02\"} 0",
            "pdkv_inter_token_latency_seconds_bucket{le=\"0.005\"} 1",
            "pdkv_num_requests_running 1",
            "pdkv_num_requests_waiting 2",
            "pdkv_kv_blocks_total 10",
            "pdkv_kv_blocks_free 4",
            "pdkv_kv_blocks_used 6",
            "pdkv_prefix_cache_queries_total 8",
            "pdkv_prefix_cache_hits_total 2",
            "pdkv_prefix_cache_hit_rate 0.25",
            "pdkv_num_preemptions_total 3",
            "pdkv_spec_decode_num_drafts_total 4",
            "pdkv_spec_decode_num_draft_tokens_total 12",
            "pdkv_spec_decode_num_accepted_tokens_total 7",
            "pdkv_device_memory_bytes{tag=\"weights\"} 101",
            "pdkv_device_memory_bytes{tag=\"kv_cache\"} 202",
            "pdkv_device_memory_bytes{tag=\"runtime\"} 303",
            "pdkv_rank_device_memory_bytes{rank=\"0\",tag=\"kv_cache\"} 200",
            "pdkv_rank_device_memory_bytes{rank=\"1\",tag=\"runtime\"} 3",
            "pdkv_sleeping 1",
            "pdkv_sleep_level 1",
            "pdkv_paused 1",
            "pdkv_weights_discarded 0",
            "pdkv_host_backup_bytes 4096",
            "pdkv_sleep_duration_seconds_count 1",
            "pdkv_sleep_duration_seconds_bucket{le=\"0.25\"} 0",
            "pdkv_sleep_duration_seconds_bucket{le=\"0.5\"} 1",
            "pdkv_wake_duration_seconds_count 2",
            "pdkv_weight_updates_total 2",
            "pdkv_wake_duration_seconds_bucket{le=\"0.025\"} 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "missing {line:?} in\n{text}"
            );
        }
        // Every sample line belongs to a family declared with # TYPE.
        for l in text.lines().filter(|l| !l.starts_with('#')) {
            let name = l.split(['{', ' ']).next().unwrap();
            let family = name
                .trim_end_matches("_bucket")
                .trim_end_matches("_sum")
                .trim_end_matches("_count");
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "{name} has no TYPE line"
            );
        }
        // Awake: not sleeping, level -1.
        let awake = m.render(&stats, &[TagBytes([1, 2, 3])], &LifecycleGauges::default());
        assert!(awake.lines().any(|l| l == "pdkv_sleeping 0"), "{awake}");
        assert!(awake.lines().any(|l| l == "pdkv_sleep_level -1"), "{awake}");
    }
}
