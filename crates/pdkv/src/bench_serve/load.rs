//! The client side of `pdkv bench serve`: workers that each send one
//! streamed `/v1/completions` request after another, and what one request
//! ended as.
//!
//! Split as the rest of pdkv is: [`SseParser`] and [`Exchange`] are pure
//! (bytes and instants in, events and verdicts out), so every way a stream
//! can end is decided in one place; [`send`] is the thin driver that moves
//! bytes and owns the deadline.
//!
//! Every request is planned from the seed and its index alone
//! ([`plan`]): its prompt (distinct text, so no prefix-cache hits) and
//! whether, and after how many tokens, the client drops the connection on
//! purpose.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub use pdkv_server::error::error_chain;

/// The knobs of the load.
pub struct LoadConfig {
    /// The proxy's base URL.
    pub url: String,
    pub concurrency: usize,
    pub max_tokens: u32,
    pub prompt_words: usize,
    pub disconnect_share: f64,
    pub seed: u64,
    pub request_timeout: Duration,
    /// Total requests (`--requests`); `None`: until [`Counters::stop`].
    pub requests: Option<u64>,
    /// No connection is kept for a later request.
    pub fresh_connections: bool,
    /// Requests carry a JSON schema (`response_format`).
    pub structured: bool,
}

/// Live counts, read by the sampler while the workers run.
#[derive(Default)]
pub struct Counters {
    pub ok: AtomicU64,
    pub failed: AtomicU64,
    pub disconnected: AtomicU64,
    /// Output tokens received, by every request.
    pub tokens: AtomicU64,
    /// Set to stop starting requests (the ones in flight finish).
    pub stop: AtomicBool,
}

/// One request, decided before it is sent.
pub struct Plan {
    pub index: u64,
    pub prompt: String,
    /// Drop the connection once this many tokens arrived.
    pub cut_after: Option<u32>,
}

/// splitmix64: the request's deterministic randomness.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

const WORDS: [&str; 64] = [
    "amber", "river", "quiet", "market", "stone", "window", "baker", "lantern", "harbor", "copper",
    "meadow", "signal", "winter", "garden", "thunder", "pencil", "orbit", "valley", "candle",
    "mirror", "forest", "engine", "velvet", "island", "ladder", "silver", "canyon", "feather",
    "bridge", "planet", "marble", "rocket", "saddle", "tunnel", "violet", "anchor", "basket",
    "castle", "desert", "falcon", "glacier", "hammer", "jungle", "kettle", "lemon", "magnet",
    "needle", "oyster", "pepper", "quartz", "ribbon", "shadow", "timber", "umbrella", "walnut",
    "yellow", "zephyr", "button", "cotton", "dragon", "ember", "fabric", "goblet", "horizon",
];

/// Request `index`'s prompt and disconnect decision, from `seed` alone.
/// Every word is drawn at random, so two prompts share no 16-token block.
pub fn plan(cfg: &LoadConfig, index: u64) -> Plan {
    let mut x = mix(cfg.seed ^ mix(index));
    let mut next = move || {
        x = mix(x);
        x
    };
    let mut prompt = String::new();
    for i in 0..cfg.prompt_words.max(1) {
        if i > 0 {
            prompt.push(if i % 12 == 0 { '\n' } else { ' ' });
        }
        prompt.push_str(WORDS[(next() % WORDS.len() as u64) as usize]);
    }
    let draw = (next() >> 11) as f64 / (1u64 << 53) as f64;
    // After 1..=max_tokens-1 tokens, so the cut comes before the end.
    let span = u64::from(cfg.max_tokens.saturating_sub(1).max(1));
    let cut_after = (draw < cfg.disconnect_share).then(|| 1 + (next() % span) as u32);
    Plan {
        index,
        prompt,
        cut_after,
    }
}

/// The request body: greedy, EOS ignored (so every request generates
/// `max_tokens` tokens), streamed with token ids and usage.
/// With `structured`, a JSON schema constrains the output (long enough
/// that no answer completes it before `max_tokens`).
pub fn body(cfg: &LoadConfig, plan: &Plan) -> Value {
    let mut b = json!({
        "prompt": plan.prompt,
        "max_tokens": cfg.max_tokens,
        "temperature": 0,
        "ignore_eos": true,
        "stream": true,
        "stream_options": {"include_usage": true},
        "return_token_ids": true,
    });
    if cfg.structured {
        b["response_format"] = json!({"type": "json_schema", "json_schema": {
            "name": "records", "schema": crate::bench_structured::schema()}});
    }
    b
}

/// A failure that was not intended: its cause (the key failures are
/// counted by) and one message.
#[derive(Clone, Debug, PartialEq)]
pub struct Failure {
    pub cause: String,
    pub message: String,
}

fn failure(cause: impl Into<String>, message: impl Into<String>) -> Failure {
    Failure {
        cause: cause.into(),
        message: message.into(),
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    Ok,
    /// Dropped by the client on purpose.
    Disconnected,
    Failed(Failure),
}

/// One request as the client saw it.
pub struct Record {
    /// The request's index ([`plan`]).
    pub index: u64,
    /// The tokens it got (all of them when it ended well).
    pub token_ids: Vec<u32>,
    pub started: Instant,
    pub ttft: Option<Duration>,
    /// Between successive token chunks.
    pub itl: Vec<Duration>,
    /// When each token chunk arrived and how many tokens it carried.
    pub arrivals: Vec<(Instant, u32)>,
    pub outcome: Outcome,
}

/// Splits a server-sent event stream into the data of its events, fed with
/// bytes as they arrive.
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn feed(&mut self, bytes: &[u8]) {
        self.buf.extend_from_slice(bytes);
    }

    /// The next whole event's data (its `data:` lines joined by `\n`);
    /// events without data (comments) are skipped.
    pub fn next_event(&mut self) -> Option<String> {
        loop {
            let end = self.buf.windows(2).position(|w| w == b"\n\n")?;
            let raw: Vec<u8> = self.buf.drain(..end + 2).collect();
            let text = String::from_utf8_lossy(&raw[..end]);
            let data: Vec<&str> = text
                .split('\n')
                .map(|l| l.strip_suffix('\r').unwrap_or(l))
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                return Some(data.join("\n"));
            }
        }
    }

    /// Bytes of an unfinished event.
    pub fn pending(&self) -> usize {
        self.buf.len()
    }
}

/// What one event of a completion stream says.
#[derive(Debug, PartialEq)]
pub enum Event {
    /// A choice's chunk: tokens (0 for a chunk that only finishes) and the
    /// finish reason, if it is the last.
    Tokens {
        n: u32,
        /// The chunk's token ids, when the server returned them.
        ids: Vec<u32>,
        finish: Option<String>,
    },
    Usage {
        completion_tokens: u64,
    },
    Done,
    /// `{"error": {...}}` inside the stream.
    Error {
        cause: String,
        message: String,
    },
    Bad(String),
}

/// `type/code` of an OpenAI error object, the parts that are present.
fn error_kind(err: &Value) -> String {
    let parts: Vec<&str> = [&err["type"], &err["code"]]
        .into_iter()
        .filter_map(Value::as_str)
        .collect();
    parts.join("/")
}

pub fn parse_event(data: &str) -> Event {
    if data == "[DONE]" {
        return Event::Done;
    }
    let v: Value = match serde_json::from_str(data) {
        Ok(v) => v,
        Err(e) => return Event::Bad(format!("not JSON ({e}): {}", clip(data))),
    };
    if let Some(err) = v.get("error") {
        let message = err["message"]
            .as_str()
            .map_or_else(|| clip(data), str::to_string);
        return Event::Error {
            cause: format!("stream error event {}", error_kind(err)),
            message,
        };
    }
    match v["choices"].as_array() {
        Some(c) if !c.is_empty() => {
            let choice = &c[0];
            // Token ids when the server returns them, else one per chunk with text.
            let ids: Vec<u32> = choice["token_ids"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| t.as_u64().and_then(|t| u32::try_from(t).ok()))
                .collect();
            let n = match choice["token_ids"].as_array() {
                Some(all) => all.len() as u32,
                None => u32::from(choice["text"].as_str().is_some_and(|t| !t.is_empty())),
            };
            Event::Tokens {
                n,
                ids,
                finish: choice["finish_reason"].as_str().map(str::to_string),
            }
        }
        _ => match v["usage"]["completion_tokens"].as_u64() {
            Some(t) => Event::Usage {
                completion_tokens: t,
            },
            None => Event::Bad(format!("neither a choice nor usage: {}", clip(data))),
        },
    }
}

/// At most 200 characters of `s`, on one line.
pub fn clip(s: &str) -> String {
    let one_line = s.replace('\n', " ");
    match one_line.char_indices().nth(200) {
        Some((i, _)) => format!("{}...", &one_line[..i]),
        None => one_line,
    }
}

/// What the driver does after an event.
#[derive(Debug, PartialEq)]
pub enum Step {
    Continue,
    /// Drop the connection now (the planned disconnect).
    Cut,
    /// `[DONE]` arrived: judge with [`Exchange::judge`].
    Finished,
    Fail(Failure),
}

/// One streamed request's progress: fed its events with their arrival
/// times, it records latencies and says when the stream is over.
pub struct Exchange {
    sent: Instant,
    cut_after: Option<u32>,
    max_tokens: u32,
    pub tokens: u32,
    finish: Option<String>,
    usage: Option<u64>,
    last: Option<Instant>,
    pub ttft: Option<Duration>,
    pub itl: Vec<Duration>,
    pub arrivals: Vec<(Instant, u32)>,
    /// Every token id the stream carried, in order.
    pub token_ids: Vec<u32>,
}

impl Exchange {
    pub fn new(sent: Instant, cut_after: Option<u32>, max_tokens: u32) -> Exchange {
        Exchange {
            sent,
            cut_after,
            max_tokens,
            tokens: 0,
            finish: None,
            usage: None,
            last: None,
            ttft: None,
            itl: Vec::new(),
            arrivals: Vec::new(),
            token_ids: Vec::new(),
        }
    }

    pub fn on_event(&mut self, ev: Event, now: Instant) -> Step {
        match ev {
            Event::Tokens { n, ids, finish } => {
                self.token_ids.extend(ids);
                if n > 0 {
                    match self.last {
                        None => self.ttft = Some(now - self.sent),
                        Some(last) => self.itl.push(now - last),
                    }
                    self.last = Some(now);
                    self.tokens += n;
                    self.arrivals.push((now, n));
                }
                if finish.is_some() {
                    self.finish = finish;
                }
                if self.cut_after.is_some_and(|k| self.tokens >= k) && self.finish.is_none() {
                    return Step::Cut;
                }
                Step::Continue
            }
            Event::Usage { completion_tokens } => {
                self.usage = Some(completion_tokens);
                Step::Continue
            }
            Event::Done => Step::Finished,
            Event::Error { cause, message } => Step::Fail(failure(
                cause,
                format!("after {} tokens: {message}", self.tokens),
            )),
            Event::Bad(m) => Step::Fail(failure("bad event", m)),
        }
    }

    /// The verdict on a stream that ended with `[DONE]`.
    pub fn judge(&self) -> Outcome {
        let expected = self.max_tokens;
        let usage_ok = self.usage.is_none_or(|u| u == u64::from(self.tokens));
        if self.finish.as_deref() == Some("length") && self.tokens == expected && usage_ok {
            return Outcome::Ok;
        }
        let finish = self.finish.as_deref().unwrap_or("none");
        Outcome::Failed(failure(
            format!("wrong token count (finish_reason {finish})"),
            format!(
                "got {} tokens (usage says {}), finish_reason {finish}; expected {expected} (max_tokens, ignore_eos)",
                self.tokens,
                self.usage.map_or("nothing".to_string(), |u| u.to_string())
            ),
        ))
    }

    /// The verdict on a stream whose body ended (EOF) without `[DONE]`.
    pub fn ended_early(&self, pending: usize) -> Outcome {
        Outcome::Failed(failure(
            "stream ended without [DONE]",
            format!(
                "after {} tokens (finish_reason {}), {pending} bytes of an unfinished event",
                self.tokens,
                self.finish.as_deref().unwrap_or("none")
            ),
        ))
    }
}

fn transport_failure(e: &reqwest::Error, during: &str) -> Failure {
    let cause = if e.is_connect() {
        "connect error"
    } else if e.is_timeout() {
        "timeout"
    } else if during == "body" {
        "stream broken"
    } else {
        "request error"
    };
    failure(cause, format!("{during}: {}", error_chain(e)))
}

/// The cause of an error status: `http STATUS type/code` from the OpenAI
/// error body, when it has one.
fn status_failure(status: u16, body: &str) -> Failure {
    let v: Option<Value> = serde_json::from_str(body).ok();
    let err = v.as_ref().map(|v| &v["error"]).filter(|e| e.is_object());
    match err {
        Some(e) => {
            let kind = error_kind(e);
            let cause = if kind.is_empty() {
                format!("http {status}")
            } else {
                format!("http {status} {kind}")
            };
            failure(
                cause,
                e["message"].as_str().map_or_else(|| clip(body), clip),
            )
        }
        None => failure(format!("http {status}"), clip(body)),
    }
}

/// Sends one request and reads its stream to the end, the planned cut or
/// the first failure, all within `cfg.request_timeout`.
pub async fn send(
    client: &reqwest::Client,
    cfg: &LoadConfig,
    plan: &Plan,
    counters: &Counters,
) -> Record {
    let started = Instant::now();
    let mut ex = Exchange::new(started, plan.cut_after, cfg.max_tokens);
    let deadline = started + cfg.request_timeout;
    let mut outcome =
        match tokio::time::timeout_at(deadline.into(), drive(client, cfg, plan, &mut ex, counters))
            .await
        {
            Ok(o) => o,
            Err(_) => Outcome::Failed(failure(
                "timeout",
                format!(
                    "no end within {}s ({} tokens so far)",
                    cfg.request_timeout.as_secs_f64(),
                    ex.tokens
                ),
            )),
        };
    if let Outcome::Failed(f) = &mut outcome {
        // The index reproduces the request (with the seed).
        f.message = format!("request {}: {}", plan.index, f.message);
    }
    Record {
        index: plan.index,
        token_ids: ex.token_ids,
        started,
        ttft: ex.ttft,
        itl: ex.itl,
        arrivals: ex.arrivals,
        outcome,
    }
}

async fn drive(
    client: &reqwest::Client,
    cfg: &LoadConfig,
    plan: &Plan,
    ex: &mut Exchange,
    counters: &Counters,
) -> Outcome {
    let url = format!("{}/v1/completions", cfg.url);
    let mut resp = match client.post(url).json(&body(cfg, plan)).send().await {
        Ok(r) => r,
        Err(e) => return Outcome::Failed(transport_failure(&e, "send")),
    };
    let status = resp.status().as_u16();
    if status != 200 {
        let text = resp
            .text()
            .await
            .unwrap_or_else(|e| format!("(body unreadable: {})", error_chain(&e)));
        return Outcome::Failed(status_failure(status, &text));
    }
    let mut sse = SseParser::default();
    loop {
        let chunk = match resp.chunk().await {
            Ok(Some(c)) => c,
            Ok(None) => return ex.ended_early(sse.pending()),
            Err(e) => return Outcome::Failed(transport_failure(&e, "body")),
        };
        sse.feed(&chunk);
        while let Some(data) = sse.next_event() {
            let before = ex.tokens;
            let step = ex.on_event(parse_event(&data), Instant::now());
            counters
                .tokens
                .fetch_add(u64::from(ex.tokens - before), Ordering::Relaxed);
            match step {
                Step::Continue => {}
                // Dropping the response closes the connection.
                Step::Cut => return Outcome::Disconnected,
                Step::Finished => return ex.judge(),
                Step::Fail(f) => return Outcome::Failed(f),
            }
        }
    }
}

/// Runs `cfg.concurrency` workers until `--requests` are sent or
/// `counters.stop` is set; every record, in no particular order.
pub async fn run(cfg: Arc<LoadConfig>, counters: Arc<Counters>) -> anyhow::Result<Vec<Record>> {
    let client = reqwest::Client::builder()
        .connect_timeout(Duration::from_secs(10))
        .pool_max_idle_per_host(if cfg.fresh_connections {
            0
        } else {
            cfg.concurrency
        })
        .pool_idle_timeout(pdkv_server::proxy::UPSTREAM_IDLE)
        .build()?;
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..cfg.concurrency {
        let (client, cfg, counters, next) =
            (client.clone(), cfg.clone(), counters.clone(), next.clone());
        workers.spawn(async move {
            let mut records = Vec::new();
            loop {
                if counters.stop.load(Ordering::Relaxed) {
                    break;
                }
                let index = next.fetch_add(1, Ordering::Relaxed);
                if cfg.requests.is_some_and(|n| index >= n) {
                    break;
                }
                let r = send(&client, &cfg, &plan(&cfg, index), &counters).await;
                let count = match r.outcome {
                    Outcome::Ok => &counters.ok,
                    Outcome::Disconnected => &counters.disconnected,
                    Outcome::Failed(_) => &counters.failed,
                };
                count.fetch_add(1, Ordering::Relaxed);
                records.push(r);
            }
            records
        });
    }
    let mut all = Vec::new();
    while let Some(r) = workers.join_next().await {
        all.extend(r?);
    }
    Ok(all)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> LoadConfig {
        LoadConfig {
            url: String::new(),
            concurrency: 1,
            max_tokens: 4,
            prompt_words: 100,
            disconnect_share: 0.2,
            seed: 7,
            request_timeout: Duration::from_secs(1),
            requests: None,
            fresh_connections: false,
            structured: false,
        }
    }

    /// `--structured` requests carry a schema no answer completes within
    /// `max_tokens` (so every request still makes `max_tokens` tokens).
    #[test]
    fn structured_requests_carry_a_long_schema() {
        let mut c = cfg();
        assert!(body(&c, &plan(&c, 0)).get("response_format").is_none());
        c.structured = true;
        let b = body(&c, &plan(&c, 0));
        let schema = &b["response_format"]["json_schema"]["schema"];
        assert_eq!(b["response_format"]["type"], "json_schema");
        assert!(
            schema["properties"]["people"]["minItems"].as_u64() >= Some(200),
            "{b}"
        );
        assert_eq!(b["ignore_eos"], true);
    }

    #[test]
    fn plans_are_deterministic_distinct_and_cut_at_the_share() {
        let c = cfg();
        let (a, b) = (plan(&c, 3), plan(&c, 3));
        assert_eq!(
            (a.prompt.as_str(), a.cut_after),
            (b.prompt.as_str(), b.cut_after)
        );
        assert_eq!(a.prompt.split_whitespace().count(), 100);
        let plans: Vec<Plan> = (0..2000).map(|i| plan(&c, i)).collect();
        let firsts: std::collections::HashSet<String> = plans
            .iter()
            .map(|p| {
                p.prompt
                    .split_whitespace()
                    .take(6)
                    .collect::<Vec<_>>()
                    .join(" ")
            })
            .collect();
        assert_eq!(
            firsts.len(),
            plans.len(),
            "the first six words already differ"
        );
        let cuts: Vec<u32> = plans.iter().filter_map(|p| p.cut_after).collect();
        assert!(
            (300..500).contains(&cuts.len()),
            "{} of 2000 cut",
            cuts.len()
        );
        assert!(cuts.iter().all(|&k| (1..=3).contains(&k)));
    }

    #[test]
    fn sse_events_split_across_feeds() {
        let mut p = SseParser::default();
        p.feed(b"data: {\"a\":1}\n\nda");
        assert_eq!(p.next_event().as_deref(), Some("{\"a\":1}"));
        assert_eq!(p.next_event(), None);
        p.feed(b"ta: [DONE]\n\n: comment\n\n");
        assert_eq!(p.next_event().as_deref(), Some("[DONE]"));
        assert_eq!(p.next_event(), None);
        assert_eq!(p.pending(), 0);
    }

    fn chunk(ids: &[u32], finish: Option<&str>) -> Event {
        parse_event(&json!({"choices": [{"index": 0, "text": "x", "token_ids": ids, "finish_reason": finish}]}).to_string())
    }

    #[test]
    fn a_whole_stream_is_ok_and_records_latencies() {
        let t0 = Instant::now();
        let mut ex = Exchange::new(t0, None, 4);
        let at = |ms| t0 + Duration::from_millis(ms);
        assert_eq!(ex.on_event(chunk(&[1], None), at(50)), Step::Continue);
        assert_eq!(ex.on_event(chunk(&[2, 3], None), at(60)), Step::Continue);
        assert_eq!(
            ex.on_event(chunk(&[4], Some("length")), at(75)),
            Step::Continue
        );
        let usage =
            parse_event(r#"{"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}"#);
        assert_eq!(ex.on_event(usage, at(76)), Step::Continue);
        assert_eq!(ex.on_event(parse_event("[DONE]"), at(76)), Step::Finished);
        assert_eq!(ex.judge(), Outcome::Ok);
        assert_eq!(ex.ttft, Some(Duration::from_millis(50)));
        assert_eq!(
            ex.itl,
            vec![Duration::from_millis(10), Duration::from_millis(15)]
        );
    }

    #[test]
    fn short_streams_errors_and_cuts_are_told_apart() {
        let t0 = Instant::now();
        let mut ex = Exchange::new(t0, None, 4);
        ex.on_event(chunk(&[1], Some("abort")), t0);
        ex.on_event(Event::Done, t0);
        let Outcome::Failed(f) = ex.judge() else {
            panic!()
        };
        assert_eq!(f.cause, "wrong token count (finish_reason abort)");

        let mut ex = Exchange::new(t0, Some(2), 4);
        assert_eq!(ex.on_event(chunk(&[1], None), t0), Step::Continue);
        assert_eq!(ex.on_event(chunk(&[2], None), t0), Step::Cut);

        let mut ex = Exchange::new(t0, None, 4);
        let err = parse_event(
            r#"{"error":{"message":"boom","type":"server_error","code":"kv_load_failed"}}"#,
        );
        let Step::Fail(f) = ex.on_event(err, t0) else {
            panic!()
        };
        assert_eq!(f.cause, "stream error event server_error/kv_load_failed");
        let Outcome::Failed(f) = ex.ended_early(3) else {
            panic!()
        };
        assert_eq!(f.cause, "stream ended without [DONE]");

        let f = status_failure(
            503,
            r#"{"error":{"message":"asleep","type":"service_unavailable_error","code":"engine_not_serving"}}"#,
        );
        assert_eq!(
            f.cause,
            "http 503 service_unavailable_error/engine_not_serving"
        );
        assert_eq!(status_failure(502, "bad gateway").cause, "http 502");
    }
}
