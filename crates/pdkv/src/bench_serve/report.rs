//! What `pdkv bench serve` reports: requests by outcome and failures by
//! cause, throughput and latency percentiles over the measured window,
//! memory drift, and the KV blocks at the end. Pure: computed from the
//! records and samples, printed as a table and one JSON object.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::load::{Outcome, Record};
use super::memory::{EngineSample, Sample};

const MIB: f64 = 1024.0 * 1024.0;

/// Failures of one cause.
pub struct Cause {
    pub count: u64,
    pub example: String,
}

pub struct Requests {
    pub ok: u64,
    pub disconnected: u64,
    pub failed: u64,
    /// By cause, in a fixed (sorted) order.
    pub causes: BTreeMap<String, Cause>,
}

pub fn requests(records: &[Record]) -> Requests {
    let mut r = Requests {
        ok: 0,
        disconnected: 0,
        failed: 0,
        causes: BTreeMap::new(),
    };
    for rec in records {
        match &rec.outcome {
            Outcome::Ok => r.ok += 1,
            Outcome::Disconnected => r.disconnected += 1,
            Outcome::Failed(f) => {
                r.failed += 1;
                let c = r.causes.entry(f.cause.clone()).or_insert_with(|| Cause {
                    count: 0,
                    example: f.message.clone(),
                });
                c.count += 1;
            }
        }
    }
    r
}

/// p50, p90, p99 and max of a set of milliseconds (nearest rank).
#[derive(Clone, Copy, Debug)]
pub struct Percentiles {
    pub n: usize,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
}

pub fn percentiles(mut v: Vec<f64>) -> Option<Percentiles> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let at = |p: f64| v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Some(Percentiles {
        n: v.len(),
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: v[v.len() - 1],
    })
}

impl Percentiles {
    fn json(p: Option<Percentiles>) -> Value {
        p.map_or(
            Value::Null,
            |p| json!({"n": p.n, "p50": p.p50, "p90": p.p90, "p99": p.p99, "max": p.max}),
        )
    }

    fn cells(p: Option<Percentiles>) -> String {
        p.map_or_else(
            || "no samples".to_string(),
            |p| {
                format!(
                    "p50 {:.1}  p90 {:.1}  p99 {:.1}  max {:.1}  (n {})",
                    p.p50, p.p90, p.p99, p.max, p.n
                )
            },
        )
    }
}

/// The measured window: requests started in it count for latency, tokens
/// that arrived in it for throughput.
pub struct Window {
    pub from: Instant,
    pub to: Instant,
}

pub struct Throughput {
    pub seconds: f64,
    pub output_tok_per_s: f64,
    pub req_per_s: f64,
    pub ttft_ms: Option<Percentiles>,
    pub itl_ms: Option<Percentiles>,
}

/// Throughput and latencies over `w`. Latencies are those of every request
/// that got tokens (ok and intentionally disconnected) and started in the
/// window; requests per second count the ok ones that ended in it.
pub fn throughput(records: &[Record], w: &Window) -> Throughput {
    let seconds = w.to.saturating_duration_since(w.from).as_secs_f64();
    let in_window = |t: Instant| t >= w.from && t <= w.to;
    let mut tokens = 0u64;
    let mut ok_ended = 0u64;
    let (mut ttft, mut itl) = (Vec::new(), Vec::new());
    for r in records {
        tokens += r
            .arrivals
            .iter()
            .filter(|(t, _)| in_window(*t))
            .map(|&(_, n)| u64::from(n))
            .sum::<u64>();
        let ended = r.arrivals.last().map(|&(t, _)| t);
        if r.outcome == Outcome::Ok && ended.is_some_and(in_window) {
            ok_ended += 1;
        }
        if r.started >= w.from && !matches!(r.outcome, Outcome::Failed(_)) {
            ttft.extend(r.ttft.map(ms));
            itl.extend(r.itl.iter().copied().map(ms));
        }
    }
    let rate = |n: u64| {
        if seconds > 0.0 {
            n as f64 / seconds
        } else {
            f64::NAN
        }
    };
    Throughput {
        seconds,
        output_tok_per_s: rate(tokens),
        req_per_s: rate(ok_ended),
        ttft_ms: percentiles(ttft),
        itl_ms: percentiles(itl),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// A quantity at the first sample after the warm-up and at the end.
pub struct Drift {
    pub what: String,
    pub start: f64,
    pub end: f64,
}

impl Drift {
    fn mib(&self) -> f64 {
        (self.end - self.start) / MIB
    }
    fn pct(&self) -> f64 {
        if self.start > 0.0 {
            100.0 * (self.end - self.start) / self.start
        } else {
            f64::NAN
        }
    }
    fn json(&self) -> Value {
        json!({"what": self.what, "start_mib": self.start / MIB, "end_mib": self.end / MIB,
               "drift_mib": self.mib(), "drift_pct": self.pct()})
    }
}

/// RSS per process and device bytes per engine: `end` against the first
/// sample at or after the warm-up (`None` when no sample was that late).
pub fn drift(
    samples: &[Sample],
    warmup: Duration,
    end: &Sample,
    procs: &[String],
    engines: &[String],
) -> Vec<Drift> {
    let Some(base) = samples.iter().find(|s| s.elapsed >= warmup) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, name) in procs.iter().enumerate() {
        if let (Some(Some(a)), Some(Some(b))) = (base.rss.get(i), end.rss.get(i)) {
            out.push(Drift {
                what: format!("{name} rss"),
                start: *a as f64,
                end: *b as f64,
            });
        }
    }
    for (i, name) in engines.iter().enumerate() {
        let dev = |s: &Sample| {
            s.engines
                .get(i)
                .copied()
                .flatten()
                .and_then(|e| e.device_bytes)
        };
        if let (Some(a), Some(b)) = (dev(base), dev(end)) {
            out.push(Drift {
                what: format!("{name} device memory"),
                start: a,
                end: b,
            });
        }
    }
    out
}

/// How one engine's `/metrics` answered over the run.
pub struct Scrapes {
    pub engine: String,
    pub total: usize,
    pub failed: usize,
    pub example_error: Option<String>,
    pub slowest_ms: Option<f64>,
}

pub fn scrapes(samples: &[Sample], engines: &[String]) -> Vec<Scrapes> {
    let mut out: Vec<Scrapes> = engines
        .iter()
        .map(|e| Scrapes {
            engine: e.clone(),
            total: 0,
            failed: 0,
            example_error: None,
            slowest_ms: None,
        })
        .collect();
    for s in samples {
        for (o, r) in out.iter_mut().zip(&s.scrapes) {
            o.total += 1;
            match r {
                Ok(d) => o.slowest_ms = Some(o.slowest_ms.unwrap_or(0.0).max(ms(*d))),
                Err(why) => {
                    o.failed += 1;
                    o.example_error.get_or_insert_with(|| why.clone());
                }
            }
        }
    }
    out
}

impl Scrapes {
    fn json(&self) -> Value {
        json!({"engine": self.engine, "total": self.total, "failed": self.failed,
               "example_error": self.example_error, "slowest_ms": self.slowest_ms})
    }
}

/// One engine's KV blocks once the load stopped.
pub struct Blocks {
    pub engine: String,
    pub at_end: Option<EngineSample>,
}

impl Blocks {
    pub fn all_free(&self) -> bool {
        self.at_end.is_some_and(|s| s.quiet())
    }

    fn describe(&self) -> String {
        match self.at_end {
            None => "unreadable (/metrics failed)".to_string(),
            Some(s) => {
                let f = |v: Option<f64>| v.map_or("?".to_string(), |v| format!("{v}"));
                format!(
                    "free {} / total {}, held {}, running {}, waiting {}",
                    f(s.blocks_free),
                    f(s.blocks_total),
                    f(s.blocks_held),
                    f(s.running),
                    f(s.waiting)
                )
            }
        }
    }

    fn json(&self) -> Value {
        let s = self.at_end.unwrap_or_default();
        json!({"engine": self.engine, "all_free": self.all_free(), "free": s.blocks_free, "total": s.blocks_total,
               "held": s.blocks_held, "running": s.running, "waiting": s.waiting})
    }
}

/// Everything the summary shows.
pub struct Summary {
    pub requests: Requests,
    pub throughput: Throughput,
    pub drift: Vec<Drift>,
    pub blocks: Vec<Blocks>,
    pub quiet_wait: Duration,
    pub flood: Vec<Value>,
    pub scrapes: Vec<Scrapes>,
}

impl Summary {
    /// Why the run counts as failed (empty: it passed).
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        if self.requests.failed > 0 {
            let causes: Vec<String> = self
                .requests
                .causes
                .iter()
                .map(|(k, c)| format!("{k}: {}", c.count))
                .collect();
            p.push(format!(
                "{} requests failed ({})",
                self.requests.failed,
                causes.join(", ")
            ));
        }
        for b in self.blocks.iter().filter(|b| !b.all_free()) {
            p.push(format!(
                "{}: KV blocks not all free {:.0}s after the load stopped: {}",
                b.engine,
                self.quiet_wait.as_secs_f64(),
                b.describe()
            ));
        }
        p
    }

    pub fn table(&self) -> String {
        let mut s = String::new();
        let r = &self.requests;
        let t = &self.throughput;
        let _ = writeln!(
            s,
            "requests: {} ok, {} failed, {} disconnected (intended)",
            r.ok, r.failed, r.disconnected
        );
        if !r.causes.is_empty() {
            let _ = writeln!(s, "  {:<48} {:>7}  example", "failure cause", "count");
            for (cause, c) in &r.causes {
                let _ = writeln!(s, "  {cause:<48} {:>7}  {}", c.count, c.example);
            }
        }
        let _ = writeln!(
            s,
            "measured window {:.1}s: {:.1} output tok/s, {:.2} req/s",
            t.seconds, t.output_tok_per_s, t.req_per_s
        );
        let _ = writeln!(s, "TTFT ms: {}", Percentiles::cells(t.ttft_ms));
        let _ = writeln!(s, "ITL ms:  {}", Percentiles::cells(t.itl_ms));
        if self.drift.is_empty() {
            let _ = writeln!(s, "memory drift: no sample after the warm-up");
        }
        for d in &self.drift {
            let _ = writeln!(
                s,
                "memory drift {:<26} {:>9.1} -> {:>9.1} MiB  {:>+8.1} MiB ({:+.1}%)",
                d.what,
                d.start / MIB,
                d.end / MIB,
                d.mib(),
                d.pct()
            );
        }
        if self.blocks.is_empty() {
            let _ = writeln!(
                s,
                "KV blocks: not checked (no engine to read; --engine URL with --url)"
            );
        }
        for b in &self.blocks {
            let verdict = if b.all_free() { "yes" } else { "NO" };
            let _ = writeln!(
                s,
                "KV blocks free == total on {}: {verdict} ({})",
                b.engine,
                b.describe()
            );
        }
        for m in &self.scrapes {
            let slowest = m
                .slowest_ms
                .map_or("-".to_string(), |v| format!("{v:.0} ms"));
            let _ = write!(
                s,
                "/metrics of {}: {} of {} scrapes failed, slowest answer {slowest}",
                m.engine, m.failed, m.total
            );
            let _ = writeln!(
                s,
                "{}",
                m.example_error
                    .as_ref()
                    .map_or(String::new(), |e| format!(" (e.g. {e})"))
            );
        }
        for f in &self.flood {
            let _ = writeln!(
                s,
                "idle flood {} ({}): {} held, {} opened, {} closed by the server, {} connect errors",
                f["label"].as_str().unwrap_or_default(),
                f["addr"].as_str().unwrap_or_default(),
                f["size"],
                f["opened"],
                f["closed_by_server"],
                f["connect_errors"]
            );
        }
        s
    }

    pub fn json(&self) -> Value {
        let r = &self.requests;
        let t = &self.throughput;
        let causes: serde_json::Map<String, Value> = r
            .causes
            .iter()
            .map(|(k, c)| (k.clone(), json!({"count": c.count, "example": c.example})))
            .collect();
        json!({
            "requests": {"ok": r.ok, "failed": r.failed, "disconnected": r.disconnected, "failed_by_cause": causes},
            "window_s": t.seconds,
            "output_tok_per_s": t.output_tok_per_s,
            "req_per_s": t.req_per_s,
            "ttft_ms": Percentiles::json(t.ttft_ms),
            "itl_ms": Percentiles::json(t.itl_ms),
            "memory_drift": self.drift.iter().map(Drift::json).collect::<Vec<_>>(),
            "blocks": self.blocks.iter().map(Blocks::json).collect::<Vec<_>>(),
            "idle_flood": self.flood,
            "metrics_scrapes": self.scrapes.iter().map(Scrapes::json).collect::<Vec<_>>(),
            "problems": self.problems(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank_and_ordered() {
        let p = percentiles((1..=100).map(f64::from).collect()).unwrap();
        assert_eq!((p.p50, p.p90, p.p99, p.max), (50.0, 90.0, 99.0, 100.0));
        let one = percentiles(vec![7.0]).unwrap();
        assert_eq!((one.p50, one.p99), (7.0, 7.0));
        assert!(percentiles(Vec::new()).is_none());
    }
}
