//! The P/D proxy in front of real pdkv servers (tiny random models, no KV
//! connector). A server without a connector ignores `kv_transfer_params`, so
//! whatever the proxy returns must equal the decode server's own answer;
//! prefill failures, dead backends and client disconnects are produced with
//! real servers (admin pause/abort, a shut-down server, a short context).

use std::time::Duration;

use crate::common::{Listening, Server, DEADLINE};
use pdkv_engine::{EngineConfig, PauseMode, SleepLevel};
use pdkv_server::proxy::{Proxy, ProxyConfig, Role};
use pdkv_testkit::{http, sse};
use pdkv_testkit::{http::assert_openai_error, prom::must};
use reqwest::StatusCode;
use serde_json::{json, Value};

const TOKEN: &str = "proxy-test-token";

/// A proxy served in-process on an ephemeral port. Its periodic health check
/// is effectively off (one hour): tests run rounds with `check()` so the
/// proxy's view of the backends changes only when a test says so.
struct ProxyServer {
    proxy: Proxy,
    base: String,
    client: reqwest::Client,
    listening: Listening,
}

impl ProxyServer {
    async fn start(prefill: &[&Server], decode: &[&Server]) -> ProxyServer {
        let urls = |servers: &[&Server]| servers.iter().map(|s| s.base.clone()).collect();
        ProxyServer::start_urls(urls(prefill), urls(decode), DEADLINE).await
    }

    /// A proxy over backends by URL, bounding each upstream call by
    /// `request_timeout`.
    async fn start_urls(
        prefill: Vec<String>,
        decode: Vec<String>,
        request_timeout: Duration,
    ) -> ProxyServer {
        let mut config = ProxyConfig::new(prefill, decode);
        config.health_interval = Duration::from_secs(3600);
        config.request_timeout = request_timeout;
        // Refusals pass on at once (these tests check them; holding a
        // request until D serves again is the e2e frameworks tests' part).
        config.pause_wait = Duration::ZERO;
        let proxy = Proxy::new(config).expect("proxy config");
        // Healthy before the first request, as `serve` also checks first.
        proxy.check_backends().await;
        let serving = proxy.clone();
        let listening =
            Listening::start(|listener, shutdown| serving.serve(listener, shutdown)).await;
        ProxyServer {
            proxy,
            base: listening.base.clone(),
            client: reqwest::Client::new(),
            listening,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    async fn check(&self) {
        self.proxy.check_backends().await;
    }

    async fn metrics(&self) -> String {
        http::metrics(&self.client, &self.base).await
    }

    /// Polls the proxy's metrics until sample `name` is `value`.
    async fn wait_metric(&self, name: &str, value: f64) -> String {
        let deadline = std::time::Instant::now() + DEADLINE;
        loop {
            let m = self.metrics().await;
            if must(&m, name) == value {
                return m;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "timed out waiting for {name} = {value}:\n{m}"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    async fn stop(self) {
        self.listening.stop().await;
    }

    /// The prefill server's KV transfer info, as the proxy's health check
    /// read it.
    fn prefill_kv_info(&self) -> Option<pdkv_server::proxy::KvTransferInfo> {
        self.proxy
            .backends()
            .into_iter()
            .find(|b| b.role == Role::Prefill)
            .and_then(|b| b.kv_info)
    }
}

/// Stops the proxy, the connector servers behind it, then the colocated
/// server their answers were compared with.
async fn stop_with_colo(proxy: ProxyServer, servers: [ConnServer; 2], colo: Server) {
    proxy.stop().await;
    for s in servers {
        s.stop().await;
    }
    colo.stop().await;
}

/// Runs `call` on a clone of `engine` off the runtime (engine calls that
/// wait block); its result.
async fn on_engine<T: Send + 'static>(
    engine: &pdkv_engine::EngineHandle,
    call: impl FnOnce(pdkv_engine::EngineHandle) -> T + Send + 'static,
) -> T {
    let engine = engine.clone();
    tokio::task::spawn_blocking(move || call(engine))
        .await
        .expect("join")
}

/// Stops the proxy, then every server behind it.
async fn stop_all<const N: usize>(proxy: ProxyServer, servers: [Server; N]) {
    proxy.stop().await;
    for s in servers {
        s.stop().await;
    }
}

/// Posts `body` to `base + path` and returns the status and JSON body.
async fn post_json(client: &reqwest::Client, url: String, body: &Value) -> (StatusCode, Value) {
    http::post_json(client, &url, body).await
}

/// A streaming request's events, with the per-request `id` and `created`
/// fields removed so two servers' answers can be compared.
async fn stream_events(client: &reqwest::Client, url: String, body: &Value) -> Vec<Value> {
    let resp = client.post(url).json(body).send().await.expect("send");
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()["content-type"], "text/event-stream");
    let events = sse::Reader::new(resp).rest().await;
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "{events:?}"
    );
    events
        .iter()
        .map(|e| {
            if e == "[DONE]" {
                return json!("[DONE]");
            }
            let mut v: Value = serde_json::from_str(e).expect("JSON event");
            let o = v.as_object_mut().expect("event object");
            o.remove("id");
            o.remove("created");
            v
        })
        .collect()
}

fn strip_ids(mut v: Value) -> Value {
    let o = v.as_object_mut().expect("object");
    o.remove("id");
    o.remove("created");
    v
}

async fn admin(s: &Server, path: &str, body: Option<Value>) -> Value {
    let (status, v) = http::admin(&s.client, &s.base, path, TOKEN, body.as_ref()).await;
    assert_eq!(status, StatusCode::OK, "{path}: {v}");
    v
}

/// The sample of the metric `family` whose one label `key` is `value`.
fn labelled(m: &str, family: &str, key: &str, value: &str) -> f64 {
    must(m, &format!("{family}{{{key}=\"{value}\"}}"))
}

fn finished(m: &str, reason: &str) -> f64 {
    labelled(m, "pdkv_requests_total", "finish_reason", reason)
}

fn proxy_outcome(m: &str, outcome: &str) -> f64 {
    labelled(m, "pdkv_proxy_requests_total", "outcome", outcome)
}

fn skipped(m: &str, reason: &str) -> f64 {
    labelled(m, "pdkv_proxy_prefill_skipped_total", "reason", reason)
}

fn upstream_errors(m: &str, role: &str) -> f64 {
    labelled(m, "pdkv_proxy_upstream_errors_total", "role", role)
}

/// A server for the tiny preset, seed 7, with the admin API on when `token`
/// is given.
async fn tiny(token: Option<&str>) -> Server {
    Server::spawn("tiny", 7, token, EngineConfig::default()).await
}

fn greedy(prompt: &str, max_tokens: u32) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn chat(content: &str, max_tokens: u32) -> Value {
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_equal_the_decode_servers_own() {
    let p = tiny(None).await;
    let d = tiny(Some(TOKEN)).await;
    let proxy = ProxyServer::start(&[&p], &[&d]).await;
    let c = &proxy.client;

    // These servers have no KV connector: D computes every prompt itself
    // and could answer before P ran its one-token request, which the proxy
    // would then cancel (P counts it as aborted, or never sees it). So D is
    // held, keep-paused, until P answered: then P runs every request.
    admin(&d, "/pause?mode=keep", None).await;
    let cases = [
        ("/v1/completions", greedy("The river bends", 12)),
        ("/v1/chat/completions", chat("Say hello", 10)),
    ];
    let mut sent = 0.0;
    for (path, body) in &cases {
        let mut stream_body = body.clone();
        stream_body["stream"] = json!(true);
        stream_body["stream_options"] = json!({"include_usage": true});
        for body in [body, &stream_body] {
            let via = tokio::spawn(answer(c.clone(), proxy.url(path), body.clone()));
            sent += 1.0;
            p.wait_metrics("P answered the proxied request", |m| {
                finished(m, "length") == sent
            })
            .await;
            wait_waiting(&d, 1.0).await;
            admin(&d, "/resume", None).await;
            let via = tokio::time::timeout(DEADLINE, via)
                .await
                .expect("answer in time")
                .unwrap();
            if let Value::Array(events) = &via {
                assert!(events.len() > 3, "{via}");
            }
            assert_eq!(via, direct(&d, path, body).await, "{path} {body}");
            admin(&d, "/pause?mode=keep", None).await;
        }
    }
    admin(&d, "/resume", None).await;

    let pm = p.wait_all_blocks_free().await;
    assert_eq!(finished(&pm, "length"), 4.0, "{pm}");
    assert_eq!(finished(&pm, "abort"), 0.0, "{pm}");
    assert_eq!(
        must(&pm, "pdkv_generation_tokens_total"),
        4.0,
        "one token each: {pm}"
    );
    let dm = d.wait_all_blocks_free().await;
    assert_eq!(finished(&dm, "length"), 8.0, "{dm}");
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "ok"), 4.0, "{m}");
    assert_eq!(upstream_errors(&m, "prefill"), 0.0);

    // Other routes.
    let models: Value = pdkv_testkit::http::get_json(c, &proxy.url("/v1/models"))
        .await
        .1;
    let direct: Value = pdkv_testkit::http::get_json(c, &d.url("/v1/models"))
        .await
        .1;
    assert_eq!(models, direct);
    let resp = c.get(proxy.url("/v2/nothing")).send().await.unwrap();
    let status = resp.status();
    assert_openai_error(
        status,
        &resp.json().await.unwrap(),
        StatusCode::NOT_FOUND,
        "unknown route",
    );
    let (status, body) = {
        let r = http::send(c.post(proxy.url("/v1/completions")).body("{not json")).await;
        (r.status(), r.json::<Value>().await.unwrap())
    };
    assert_openai_error(status, &body, StatusCode::BAD_REQUEST, "malformed body");

    stop_all(proxy, [p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_skips_dead_backends_and_refuses_when_none_is_healthy() {
    let p = tiny(None).await;
    let d1 = tiny(None).await;
    let d2 = tiny(None).await;
    let proxy = ProxyServer::start(&[&p], &[&d1, &d2]).await;
    let c = &proxy.client;
    assert!(
        proxy.proxy.backends().iter().all(|b| b.healthy),
        "{:?}",
        proxy.proxy.backends()
    );
    assert_eq!(
        c.get(proxy.url("/health")).send().await.unwrap().status(),
        StatusCode::OK
    );

    let body = greedy("round robin", 3);
    for _ in 0..4 {
        let (status, v) = post_json(c, proxy.url("/v1/completions"), &body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    assert_eq!(finished(&d1.metrics().await, "length"), 2.0);
    assert_eq!(finished(&d2.metrics().await, "length"), 2.0);

    // A decode server that went away is skipped after the next check.
    let d2_url = d2.base.clone();
    d2.stop().await;
    proxy.check().await;
    let snap = proxy.proxy.backends();
    let dead = snap.iter().find(|b| b.url == d2_url).expect("d2 listed");
    assert!(
        !dead.healthy && dead.role == Role::Decode && dead.last_error.is_some(),
        "{dead:?}"
    );
    assert_eq!(
        c.get(proxy.url("/health")).send().await.unwrap().status(),
        StatusCode::OK
    );
    for _ in 0..3 {
        let (status, v) = post_json(c, proxy.url("/v1/completions"), &body).await;
        assert_eq!(status, StatusCode::OK, "{v}");
    }
    assert_eq!(finished(&d1.metrics().await, "length"), 5.0);
    let m = proxy.metrics().await;
    assert!(
        m.contains(&format!(
            "pdkv_proxy_backend_healthy{{role=\"decode\",url=\"{d2_url}\"}} 0\n"
        )),
        "{m}"
    );

    // Without a prefill server up, D computes the prompt itself: the same
    // tokens as a P/D run, counted; /health says so.
    let (_, want) = post_json(c, proxy.url("/v1/completions"), &body).await;
    p.stop().await;
    proxy.check().await;
    let resp = c.get(proxy.url("/health")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["status"], "degraded", "{v}");
    assert!(
        v["detail"].as_str().unwrap().contains("no prefill server"),
        "{v}"
    );
    let (status, v) = post_json(c, proxy.url("/v1/completions"), &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["text"], want["choices"][0]["text"]);
    let m = proxy.metrics().await;
    assert!(m.contains("pdkv_proxy_prefill_down_total 1\n"), "{m}");
    assert_eq!(proxy_outcome(&m, "ok"), 9.0, "{m}");

    // Without a decode server either: a retryable 503 naming the decode
    // servers' states.
    d1.stop().await;
    proxy.check().await;
    let resp = c.get(proxy.url("/health")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(http::retry_after(&resp), Some("1"));
    let v: Value = resp.json().await.unwrap();
    let why = v["error"]["message"].as_str().unwrap();
    assert!(
        why.contains("no decode server serves") && why.contains("down"),
        "{why}"
    );
    let resp = http::send(c.post(proxy.url("/v1/completions")).json(&body)).await;
    let status = resp.status();
    assert_eq!(http::retry_after(&resp), Some("1"));
    let v: Value = resp.json().await.unwrap();
    assert_openai_error(status, &v, StatusCode::SERVICE_UNAVAILABLE, "no server");
    assert_eq!(v["error"]["code"], "no_healthy_backend");
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "no_backend"), 1.0, "{m}");

    stop_all(proxy, []).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefill_client_error_passes_through_drops_d_and_counts_as_bad_request() {
    // P has a short context, so a long prompt is a 400 from P alone.
    let p = Server::spawn(
        "tiny",
        7,
        None,
        EngineConfig {
            max_model_len: Some(24),
            ..EngineConfig::default()
        },
    )
    .await;
    let d = tiny(Some(TOKEN)).await;
    let proxy = ProxyServer::start(&[&p], &[&d]).await;
    let c = &proxy.client;
    // Paused D holds requests; it can finish none of them.
    admin(&d, "/pause?mode=keep", None).await;

    let long = greedy(&"many words in a long prompt ".repeat(8), 4);
    // What P answers to the body the proxy sends it (one token, no stream).
    let mut as_p = long.clone();
    as_p["max_tokens"] = json!(1);
    let (want_status, want) = post_json(c, p.url("/v1/completions"), &as_p).await;
    assert_openai_error(want_status, &want, StatusCode::BAD_REQUEST, "P alone");
    let (status, got) = post_json(c, proxy.url("/v1/completions"), &long).await;
    assert_eq!((status, &got), (want_status, &want));
    let mut streaming = long.clone();
    streaming["stream"] = json!(true);
    let (status, got) = post_json(c, proxy.url("/v1/completions"), &streaming).await;
    assert_eq!((status, &got), (want_status, &want));

    // D's copies were dropped while D was paused.
    let dm = d
        .wait_metrics("D's requests dropped", |m| {
            must(m, "pdkv_num_requests_waiting") == 0.0
                && must(m, "pdkv_num_requests_running") == 0.0
        })
        .await;
    assert_eq!(must(&dm, "pdkv_paused"), 1.0);
    let dm = resume_until_idle(&d).await;
    assert_eq!(finished(&dm, "length") + finished(&dm, "stop"), 0.0, "{dm}");
    // The client's own bad request, not a prefill server's failure.
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "bad_request"), 2.0, "{m}");
    assert_eq!(proxy_outcome(&m, "prefill_error"), 0.0, "{m}");
    assert_eq!(upstream_errors(&m, "prefill"), 0.0, "{m}");

    stop_all(proxy, [p, d]).await;
}

/// A body over the limit is a 413 in OpenAI's shape from the proxy, as
/// from an engine, and counts as the client's bad request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_oversize_body_is_the_same_413_from_the_proxy_and_an_engine() {
    let (p, d, proxy) = plain_pd().await;
    let huge = json!({"prompt": "x".repeat(pdkv_server::MAX_BODY_BYTES + 1), "max_tokens": 1});
    let (engine_status, engine) = post_json(&proxy.client, d.url("/v1/completions"), &huge).await;
    assert_openai_error(
        engine_status,
        &engine,
        StatusCode::PAYLOAD_TOO_LARGE,
        "engine",
    );
    for path in ["/v1/completions", "/v1/chat/completions", "/tokenize"] {
        let (status, v) = post_json(&proxy.client, proxy.url(path), &huge).await;
        assert_openai_error(status, &v, StatusCode::PAYLOAD_TOO_LARGE, path);
        assert_eq!(v, engine, "{path}: the proxy's 413 is the engine's");
    }
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "bad_request"), 2.0, "{m}");
    stop_all(proxy, [p, d]).await;
}

/// JSON nested past the parser's depth limit is the same 400 from the proxy
/// as from an engine (the client's bad request), and one nested within it
/// gets the engine's own answer through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_nesting_is_judged_the_same_by_the_proxy_and_an_engine() {
    let (p, d, proxy) = plain_pd().await;
    let nested = |depth: usize| {
        let mut v = json!(1);
        for _ in 0..depth {
            v = json!([v]);
        }
        json!({"prompt": "hello", "max_tokens": 1, "temperature": 0, "user": v})
    };
    let (engine_status, engine) =
        post_json(&proxy.client, d.url("/v1/completions"), &nested(200)).await;
    assert_openai_error(
        engine_status,
        &engine,
        StatusCode::BAD_REQUEST,
        "engine, 200 deep",
    );
    let (status, via) = post_json(&proxy.client, proxy.url("/v1/completions"), &nested(200)).await;
    assert_eq!(
        (status, &via),
        (engine_status, &engine),
        "the proxy's answer to 200 levels is the engine's"
    );
    let (engine_status, engine) =
        post_json(&proxy.client, d.url("/v1/completions"), &nested(100)).await;
    let (status, via) = post_json(&proxy.client, proxy.url("/v1/completions"), &nested(100)).await;
    assert_eq!(status, engine_status, "100 levels: {via} vs {engine}");
    let m = proxy.metrics().await;
    assert_eq!(
        proxy_outcome(&m, "prefill_error") + proxy_outcome(&m, "decode_error"),
        0.0,
        "{m}"
    );
    assert_eq!(
        proxy_outcome(&m, "bad_request"),
        if status.is_success() { 1.0 } else { 2.0 },
        "{m}"
    );
    stop_all(proxy, [p, d]).await;
}

/// Both servers keep-paused: each holds the proxied request without running it.
async fn paused_pair() -> (Server, Server) {
    let p = tiny(Some(TOKEN)).await;
    let d = tiny(Some(TOKEN)).await;
    admin(&p, "/pause?mode=keep", None).await;
    admin(&d, "/pause?mode=keep", None).await;
    (p, d)
}

/// [`paused_pair`] and the proxy in front of it.
async fn paused_pd() -> (Server, Server, ProxyServer) {
    let (p, d) = paused_pair().await;
    let proxy = ProxyServer::start(&[&p], &[&d]).await;
    (p, d, proxy)
}

/// A prefill and a decode server (admin API off) and the proxy in front.
async fn plain_pd() -> (Server, Server, ProxyServer) {
    let p = tiny(None).await;
    let d = tiny(None).await;
    let proxy = ProxyServer::start(&[&p], &[&d]).await;
    (p, d, proxy)
}

async fn wait_waiting(s: &Server, n: f64) -> String {
    s.wait_metrics(&format!("{n} waiting request(s)"), |m| {
        must(m, "pdkv_num_requests_waiting") == n
    })
    .await
}

/// Sends `body` to the proxy in the background; the status and the text.
fn spawn_request(
    proxy: &ProxyServer,
    path: &str,
    body: &Value,
    id: &str,
) -> tokio::task::JoinHandle<(StatusCode, String)> {
    let req = proxy
        .client
        .post(proxy.url(path))
        .header("x-request-id", id)
        .json(body);
    tokio::spawn(async move {
        let resp = req.send().await.expect("send");
        (resp.status(), resp.text().await.expect("body"))
    })
}

/// A whole SSE body as JSON events, without the per-request fields.
fn sse_values(text: &str) -> Vec<Value> {
    sse::payloads(text)
        .into_iter()
        .map(|data| {
            if data == "[DONE]" {
                json!("[DONE]")
            } else {
                strip_ids(serde_json::from_str(&data).expect("JSON event"))
            }
        })
        .collect()
}

/// What D itself answers to `body` (JSON, or events when streaming).
async fn direct(s: &Server, path: &str, body: &Value) -> Value {
    answer(s.client.clone(), s.url(path), body.clone()).await
}

/// A successful answer to `body` at `url`, without the per-request fields:
/// JSON, or the events when streaming.
async fn answer(client: reqwest::Client, url: String, body: Value) -> Value {
    if body["stream"] == json!(true) {
        return Value::Array(stream_events(&client, url, &body).await);
    }
    let (status, v) = post_json(&client, url, &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    strip_ids(v)
}

/// A proxied answer as [`direct`] gives it.
fn proxied(status: StatusCode, text: &str, streaming: bool) -> Value {
    assert_eq!(status, StatusCode::OK, "{text}");
    if streaming {
        Value::Array(sse_values(text))
    } else {
        strip_ids(serde_json::from_str(text).expect("JSON answer"))
    }
}

/// Resumes keep-paused D so it serves the proxied request `pending` (`body`
/// sent to `path`), whose answer must equal D's own; D is keep-paused again
/// after.
async fn release_d_and_compare(
    d: &Server,
    pending: tokio::task::JoinHandle<(StatusCode, String)>,
    path: &str,
    body: &Value,
) {
    admin(d, "/resume", None).await;
    let (status, text) = tokio::time::timeout(DEADLINE, pending)
        .await
        .expect("answer in time")
        .unwrap();
    let got = proxied(status, &text, body["stream"] == json!(true));
    assert_eq!(got, direct(d, path, body).await, "{path}");
    admin(d, "/pause?mode=keep", None).await;
}

/// Resumes `s` and waits until it is idle with every KV block free; its
/// metrics then.
async fn resume_until_idle(s: &Server) -> String {
    admin(s, "/resume", None).await;
    s.wait_all_blocks_free().await
}

fn generation_cases() -> [(&'static str, Value); 2] {
    let mut streaming = chat("keep talking", 12);
    streaming["stream"] = json!(true);
    [
        ("/v1/completions", greedy("abort me", 8)),
        ("/v1/chat/completions", streaming),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_aborted_prefill_leaves_d_to_compute_the_prompt() {
    let (p, d, proxy) = paused_pd().await;

    // P's abort (an admin's or its lifecycle's) does not lose the request:
    // D, which holds it, computes the prompt itself once it runs again.
    for (n, (path, body)) in generation_cases().into_iter().enumerate() {
        let id = format!("req-{n}");
        let pending = spawn_request(&proxy, path, &body, &id);
        wait_waiting(&p, 1.0).await;
        wait_waiting(&d, 1.0).await;
        let v = admin(&p, "/abort_requests", Some(json!({"request_ids": [id]}))).await;
        assert_eq!(v["aborted"], json!([id]));
        proxy
            .wait_metric(
                "pdkv_proxy_prefill_skipped_total{reason=\"aborted\"}",
                (n + 1) as f64,
            )
            .await;
        // The proxy kept D's request: D still holds it, the client waits.
        assert!(
            !pending.is_finished(),
            "the client was answered before D ran"
        );
        assert_eq!(must(&d.metrics().await, "pdkv_num_requests_waiting"), 1.0);
        release_d_and_compare(&d, pending, path, &body).await;
    }

    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "ok"), 2.0, "{m}");
    assert_eq!(proxy_outcome(&m, "prefill_error"), 0.0, "{m}");
    assert_eq!(skipped(&m, "aborted"), 2.0, "{m}");
    for s in [&p, &d] {
        resume_until_idle(s).await;
    }
    stop_all(proxy, [p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_prefill_server_refuses_and_d_computes_the_prompt() {
    let (p, d, proxy) = paused_pd().await;
    // Paused in abort mode, P refuses new requests: a retryable 503.
    admin(&p, "/pause?mode=abort", None).await;
    let (status, v) = post_json(&proxy.client, p.url("/v1/completions"), &greedy("x", 1)).await;
    http::assert_error_code(
        status,
        &v,
        StatusCode::SERVICE_UNAVAILABLE,
        "engine_not_serving",
    );

    // D (with no KV connector here) is held until the proxy took P's
    // refusal; running, it could answer first, and the proxy would then
    // cancel P's call instead.
    for (n, (path, body)) in generation_cases().into_iter().enumerate() {
        let pending = spawn_request(&proxy, path, &body, &format!("req-{n}"));
        proxy
            .wait_metric(
                "pdkv_proxy_prefill_skipped_total{reason=\"refused\"}",
                (n + 1) as f64,
            )
            .await;
        wait_waiting(&d, 1.0).await;
        release_d_and_compare(&d, pending, path, &body).await;
    }
    admin(&d, "/resume", None).await;
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "ok"), 2.0, "{m}");
    assert_eq!(skipped(&m, "refused"), 2.0, "{m}");
    assert_eq!(upstream_errors(&m, "prefill"), 0.0, "{m}");
    let pm = p.metrics().await;
    assert_eq!(
        finished(&pm, "length") + finished(&pm, "abort"),
        0.0,
        "P ran nothing: {pm}"
    );

    stop_all(proxy, [p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn upstream_timeouts_are_504_naming_request_timeout() {
    let (p, d) = paused_pair().await;
    let proxy = ProxyServer::start_urls(
        vec![p.base.clone()],
        vec![d.base.clone()],
        Duration::from_millis(300),
    )
    .await;
    let (status, v) = post_json(
        &proxy.client,
        proxy.url("/v1/completions"),
        &greedy("never answered", 4),
    )
    .await;
    assert_openai_error(status, &v, StatusCode::GATEWAY_TIMEOUT, "timed out");
    assert_eq!(v["error"]["code"], "upstream_timeout");
    assert_eq!(v["error"]["type"], "timeout_error");
    assert!(http::error_message(&v).contains("request_timeout"), "{v}");
    let m = proxy.metrics().await;
    assert_eq!(
        proxy_outcome(&m, "prefill_error") + proxy_outcome(&m, "decode_error"),
        1.0,
        "{m}"
    );
    // Both calls were dropped: neither server keeps the request.
    for s in [&p, &d] {
        wait_waiting(s, 0.0).await;
        resume_until_idle(s).await;
    }
    stop_all(proxy, [p, d]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_disconnect_aborts_both_upstream_requests() {
    let (p, d, proxy) = paused_pd().await;

    // The client leaves while both servers hold its request.
    let mut body = chat("a long answer please", 64);
    body["stream"] = json!(true);
    let client = proxy.client.clone();
    let url = proxy.url("/v1/chat/completions");
    let pending = tokio::spawn(async move { client.post(url).json(&body).send().await });
    wait_waiting(&p, 1.0).await;
    wait_waiting(&d, 1.0).await;
    pending.abort();
    assert!(pending.await.unwrap_err().is_cancelled());

    for s in [&p, &d] {
        let m = wait_waiting(s, 0.0).await;
        assert_eq!(finished(&m, "abort"), 1.0, "{m}");
        let m = resume_until_idle(s).await;
        assert_eq!(finished(&m, "length") + finished(&m, "stop"), 0.0, "{m}");
    }
    let m = proxy.metrics().await;
    assert_eq!(proxy_outcome(&m, "cancelled"), 1.0, "{m}");
    stop_all(proxy, [p, d]).await;
}

/// A server whose engine runs a real P/D connector (read mode here).
struct ConnServer {
    base: String,
    engine: pdkv_engine::EngineHandle,
    listening: Listening,
    _dir: tempfile::TempDir,
}

impl ConnServer {
    async fn spawn(connector_json: &str, engine_id: &str, config: EngineConfig) -> ConnServer {
        let dir = crate::common::checkpoint("tiny", 7);
        let pool = pdkv_vmem::Pool::default();
        let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).expect("load model");
        // The connector starts its own runtime: build it off this one.
        let (json, id) = (connector_json.to_string(), engine_id.to_string());
        let connector = tokio::task::spawn_blocking(move || pdkv_connector::build(&json, &id))
            .await
            .expect("join")
            .expect("connector");
        let engine =
            pdkv_engine::Engine::start_with_connector(model, pool, config, Some(connector))
                .expect("engine");
        let state = pdkv_server::AppState::new(engine.clone(), crate::common::SERVED);
        let listening =
            Listening::start(|listener, shutdown| pdkv_server::serve(listener, state, shutdown))
                .await;
        ConnServer {
            base: listening.base.clone(),
            engine,
            listening,
            _dir: dir,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{}", self.base, path)
    }

    fn connector_metric(&self, name: &str) -> f64 {
        self.engine
            .kv_connector_metrics()
            .into_iter()
            .find(|m| m.0 == name)
            .map_or(f64::NAN, |m| m.2)
    }

    async fn stop(self) {
        self.listening.stop().await;
        self.engine.shutdown();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn read_mode_sends_p_first_and_d_reads_with_p_params() {
    let read = |role: &str| {
        format!(
            r#"{{"kv_connector":"pdkv","kv_role":"{role}","transfer_mode":"read","abort_timeout_s":120}}"#
        )
    };
    // P's short context makes a long prompt a 400 from P alone.
    let p_config = EngineConfig {
        max_model_len: Some(48),
        enable_sleep_mode: true,
        ..EngineConfig::default()
    };
    let p = ConnServer::spawn(&read("kv_producer"), "p-proxy-read", p_config).await;
    let d = ConnServer::spawn(
        &read("kv_consumer"),
        "d-proxy-read",
        EngineConfig::default(),
    )
    .await;
    let colo = tiny(None).await;
    let proxy = ProxyServer::start_urls(vec![p.base.clone()], vec![d.base.clone()], DEADLINE).await;
    let info = proxy.prefill_kv_info().expect("P's info");
    assert_eq!(info.transfer_mode.as_deref(), Some("read"));
    let (base, c) = (proxy.base.clone(), proxy.client.clone());

    // D's answers equal a colocated server's: D read P's KV (a D that got
    // no params would compute the prompt itself, so the loads are counted).
    let cases = [
        (
            "/v1/completions",
            greedy("The river bends and the valley opens", 8),
        ),
        ("/v1/chat/completions", chat("Say hello", 6)),
    ];
    for (path, body) in &cases {
        let (s1, via) = post_json(&c, format!("{base}{path}"), body).await;
        let (s2, direct) = post_json(&c, colo.url(path), body).await;
        assert_eq!(
            (s1, s2),
            (StatusCode::OK, StatusCode::OK),
            "{via} / {direct}"
        );
        assert_eq!(
            strip_ids(via)["choices"],
            strip_ids(direct)["choices"],
            "{path}"
        );
        let mut stream_body = body.clone();
        stream_body["stream"] = json!(true);
        let via = stream_events(&c, format!("{base}{path}"), &stream_body).await;
        let direct = stream_events(&c, colo.url(path), &stream_body).await;
        assert_eq!(via, direct, "{path} stream");
    }
    assert_eq!(d.connector_metric("loads_ok_total"), 4.0);
    assert_eq!(d.connector_metric("loads_failed_total"), 0.0);
    assert_eq!(
        p.connector_metric("reads_done_total"),
        4.0,
        "every lease ended by D's read_done"
    );

    // P fails: its error is the answer and D is never asked.
    let idle = d.engine.wait_stats(DEADLINE, |s| {
        s.num_running == 0 && s.num_waiting == 0 && s.kv_blocks_free == s.kv_blocks_total
    });
    let steps_before = idle.expect("D idle").steps;
    let long = greedy(&"many words in a long prompt ".repeat(8), 4);
    let mut as_p = long.clone();
    as_p["max_tokens"] = json!(1);
    let (want_status, want) = post_json(&c, p.url("/v1/completions"), &as_p).await;
    assert_openai_error(want_status, &want, StatusCode::BAD_REQUEST, "P alone");
    let (status, got) = post_json(&c, format!("{base}/v1/completions"), &long).await;
    assert_eq!((status, &got), (want_status, &want));
    assert_eq!(
        d.engine.stats().steps,
        steps_before,
        "D ran no step for the failed request"
    );
    assert_eq!(
        d.connector_metric("loads_ok_total") + d.connector_metric("loads_failed_total"),
        4.0
    );

    // P asleep refuses (503 engine_not_serving): D gets the client's body
    // without params, computes the prompt itself, and no request is lost.
    on_engine(&p.engine, |e| {
        e.sleep(SleepLevel::L1, PauseMode::Abort, DEADLINE)
    })
    .await
    .expect("P sleeps");
    for (path, body) in &cases {
        let (s1, via) = post_json(&c, format!("{base}{path}"), body).await;
        let (_, direct) = post_json(&c, colo.url(path), body).await;
        assert_eq!(s1, StatusCode::OK, "{via}");
        assert_eq!(
            strip_ids(via)["choices"],
            strip_ids(direct)["choices"],
            "{path} while P sleeps"
        );
    }
    assert_eq!(
        d.connector_metric("loads_ok_total") + d.connector_metric("loads_failed_total"),
        4.0,
        "no load tried"
    );
    let m = pdkv_testkit::http::get_text(&c, &format!("{base}/metrics")).await;
    assert_eq!(skipped(&m, "refused"), 2.0, "{m}");
    on_engine(&p.engine, |e| e.wake_up(None))
        .await
        .expect("P wakes");

    stop_with_colo(proxy, [p, d], colo).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_mode_refused_prefill_answers_ds_parked_pull_at_once() {
    // Without the proxy's drop, D's pull would wait at P for P's arrival
    // timeout (120 s) for a request P never admitted. D recomputes after
    // the failed pull by its policy here; a connector that acts on the
    // drop's code (`prefill_refused` is on purpose) recomputes whatever the
    // policy.
    let p_json = r#"{"kv_connector":"pdkv","kv_role":"kv_producer","abort_timeout_s":120,"arrival_timeout_s":120}"#;
    let d_json = r#"{"kv_connector":"pdkv","kv_role":"kv_consumer","abort_timeout_s":120,"kv_load_failure_policy":"recompute"}"#;
    let p = ConnServer::spawn(p_json, "p-proxy-write", EngineConfig::default()).await;
    let d = ConnServer::spawn(d_json, "d-proxy-write", EngineConfig::default()).await;
    let colo = tiny(None).await;
    let proxy = ProxyServer::start_urls(vec![p.base.clone()], vec![d.base.clone()], DEADLINE).await;
    let info = proxy.prefill_kv_info();
    assert!(
        info.is_some_and(|i| i.bootstrap_addr.is_some()),
        "P's bootstrap address is known"
    );
    let c = &proxy.client;
    let body = greedy("The river bends and the valley opens", 8);
    let (_, want) = post_json(c, colo.url("/v1/completions"), &body).await;

    // Served: D pulled P's KV.
    let (status, via) = post_json(c, proxy.url("/v1/completions"), &body).await;
    assert_eq!(status, StatusCode::OK, "{via}");
    assert_eq!(
        strip_ids(via)["choices"],
        strip_ids(want.clone())["choices"]
    );
    assert_eq!(d.connector_metric("loads_ok_total"), 1.0);

    // P paused (abort mode) refuses: D's answer still comes, at once.
    on_engine(&p.engine, |e| e.pause(PauseMode::Abort, false, DEADLINE))
        .await
        .expect("P pauses");
    let mut stream_body = body.clone();
    stream_body["stream"] = json!(true);
    let want_events = stream_events(&colo.client, colo.url("/v1/completions"), &stream_body).await;
    let started = std::time::Instant::now();
    let (status, via) = post_json(c, proxy.url("/v1/completions"), &body).await;
    assert_eq!(status, StatusCode::OK, "{via}");
    assert_eq!(strip_ids(via)["choices"], strip_ids(want)["choices"]);
    let via_events = stream_events(c, proxy.url("/v1/completions"), &stream_body).await;
    assert_eq!(via_events, want_events);
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "D waited for P: {:?}",
        started.elapsed()
    );
    assert_eq!(
        d.connector_metric("loads_ok_total"),
        1.0,
        "D computed the prompts itself"
    );
    assert_eq!(p.connector_metric("pulls_ok_total"), 1.0);
    let m = proxy.metrics().await;
    assert_eq!(skipped(&m, "refused"), 2.0, "{m}");
    assert_eq!(proxy_outcome(&m, "ok"), 3.0, "{m}");

    on_engine(&p.engine, |e| e.resume())
        .await
        .expect("P resumes");
    stop_with_colo(proxy, [p, d], colo).await;
}

/// Clients behind the proxy are told apart by their address: the proxy
/// sets `X-Forwarded-For` to it (dropping whatever the client sent), so one
/// client's request id cannot refuse another's, while a client's own
/// duplicate is still a 409. (Loopback has a whole /8 to send from.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn clients_behind_the_proxy_choose_request_ids_apart() {
    let (p, d, proxy) = paused_pd().await;
    let body = greedy("The river", 4);
    let send = |from: &str, forwarded_for: Option<&str>| {
        let client = reqwest::Client::builder()
            .local_address(from.parse::<std::net::IpAddr>().unwrap())
            .build()
            .unwrap();
        let mut req = client
            .post(proxy.url("/v1/completions"))
            .header("x-request-id", "job-1")
            .json(&body);
        if let Some(f) = forwarded_for {
            req = req.header("x-forwarded-for", f);
        }
        tokio::spawn(async move {
            let resp = req.send().await.expect("send");
            (resp.status(), resp.text().await.expect("body"))
        })
    };
    let squatter = send("127.0.0.2", None);
    wait_waiting(&p, 1.0).await;
    let honest = send("127.0.0.3", None);
    wait_waiting(&p, 2.0).await;
    // The same client again, and the squatter naming another address: both
    // duplicates of their own held request.
    for (from, claimed) in [("127.0.0.3", None), ("127.0.0.2", Some("192.0.2.9"))] {
        let (status, text) = send(from, claimed).await.unwrap();
        assert_eq!(status, StatusCode::CONFLICT, "from {from}: {text}");
    }
    admin(&p, "/resume", None).await;
    admin(&d, "/resume", None).await;
    for held in [squatter, honest] {
        let (status, text) = held.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{text}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(v["id"], "job-1", "{v}");
    }
    stop_all(proxy, [p, d]).await;
}
