//! The lifecycle admin API over real sockets, with a real (tiny,
//! random-weight) model and a running engine: authentication, parameter
//! validation, pause/resume in every mode, sleep and (selective) wake,
//! KV-cache release, prefix-cache reset, aborts by request id, in-place
//! weight reloads, and the lifecycle metrics.

use std::path::Path;

use pdkv_engine::EngineConfig;
use pdkv_testkit::{http, sse};
use reqwest::{Method, StatusCode};
use serde_json::{json, Value};

use crate::common::{checkpoint, Server, DEADLINE};
use pdkv_testkit::{http::assert_openai_error, prom::must};

const TOKEN: &str = "test-admin-token";

impl Server {
    /// The tiny preset, seed 7, admin API on.
    async fn start_admin() -> Server {
        Server::start_admin_with("tiny", 7, Some(TOKEN), EngineConfig::default()).await
    }

    /// [`Server::start_admin`] and what it answers before the test
    /// changes anything ([`Server::probe`]).
    async fn start_probed() -> (Server, Vec<String>) {
        let s = Server::start_admin().await;
        let before = s.probe().await;
        (s, before)
    }

    async fn start_admin_with(
        preset: &str,
        seed: u64,
        token: Option<&str>,
        config: EngineConfig,
    ) -> Server {
        Server::spawn(preset, seed, token, config).await
    }

    fn checkpoint_path(&self) -> &Path {
        self.dir.path()
    }

    /// Sends a request with the given `Authorization` header (if any) and
    /// returns the status and the JSON body.
    async fn send(
        &self,
        method: Method,
        path: &str,
        auth: Option<&str>,
        body: Option<&Value>,
    ) -> (StatusCode, Value) {
        let mut req = self.client.request(method, self.url(path));
        if let Some(a) = auth {
            req = req.header("authorization", a);
        }
        if let Some(b) = body {
            req = req.json(b);
        }
        pdkv_testkit::http::answer(req).await
    }

    /// An authorized admin call.
    async fn admin(&self, method: Method, path: &str, body: Option<&Value>) -> (StatusCode, Value) {
        self.send(method, path, Some(&format!("Bearer {TOKEN}")), body)
            .await
    }

    /// An authorized admin call that must succeed.
    async fn admin_ok(&self, method: Method, path: &str, body: Option<&Value>) -> Value {
        let (status, v) = self.admin(method, path, body).await;
        assert_eq!(status, StatusCode::OK, "{path}: {v}");
        v
    }

    async fn is_sleeping(&self) -> bool {
        self.admin_ok(Method::GET, "/is_sleeping", None).await["is_sleeping"]
            .as_bool()
            .expect("is_sleeping bool")
    }

    async fn is_paused(&self) -> bool {
        self.admin_ok(Method::GET, "/is_paused", None).await["is_paused"]
            .as_bool()
            .expect("is_paused bool")
    }

    /// Resumes the engine, which then serves again.
    async fn resume_serving(&self) {
        self.admin_ok(Method::POST, "/resume", None).await;
        self.greedy("after resume").await;
    }

    /// The greedy completion of `prompt` (must succeed).
    async fn greedy(&self, prompt: &str) -> String {
        let (status, body) = self.post("/v1/completions", &greedy_body(prompt)).await;
        assert_eq!(status, StatusCode::OK, "{body}");
        body["choices"][0]["text"]
            .as_str()
            .expect("text")
            .to_string()
    }

    /// Completions of [`PROMPTS`], greedy and seeded-sampled. Greedy text of
    /// a random tiny model tends to repeat one token whatever the weights,
    /// so the sampled ones (temperature 20, fixed seed: deterministic) are
    /// what tells two sets of weights apart.
    async fn probe(&self) -> Vec<String> {
        let mut out = Vec::new();
        for p in PROMPTS {
            out.push(self.greedy(p).await);
            let body = json!({"prompt": p, "temperature": 20.0, "seed": 1234, "max_tokens": 8, "ignore_eos": true});
            let (status, v) = self.post("/v1/completions", &body).await;
            assert_eq!(status, StatusCode::OK, "{v}");
            out.push(v["choices"][0]["text"].as_str().expect("text").to_string());
        }
        out
    }

    /// Opens a streaming completion that runs for a long time.
    async fn open_stream(&self, extra: Value, id_header: Option<&str>) -> SseReader {
        let headers: Vec<(&str, &str)> = id_header
            .map(|id| ("x-request-id", id))
            .into_iter()
            .collect();
        self.open_stream_with(extra, &headers).await
    }

    /// [`Self::open_stream`] with the request headers `headers`.
    async fn open_stream_with(&self, extra: Value, headers: &[(&str, &str)]) -> SseReader {
        let mut body = json!({
            "prompt": "a b c", "max_tokens": self.engine.max_model_len() - 16,
            "ignore_eos": true, "stream": true, "temperature": 0,
        });
        for (k, v) in extra.as_object().expect("object") {
            body[k] = v.clone();
        }
        let mut req = self.client.post(self.url("/v1/completions")).json(&body);
        for (k, v) in headers {
            req = req.header(*k, *v);
        }
        let resp = req.send().await.expect("send");
        assert_eq!(resp.status(), StatusCode::OK);
        let header_id = resp
            .headers()
            .get("x-request-id")
            .map(|v| v.to_str().expect("ascii").to_string());
        SseReader {
            body: sse::Reader::new(resp),
            header_id,
        }
    }
}

const PROMPTS: [&str; 3] = [
    "The quick brown fox",
    "def main():",
    "In the evening the lights",
];

fn greedy_body(prompt: &str) -> Value {
    json!({"prompt": prompt, "temperature": 0, "max_tokens": 8, "ignore_eos": true})
}

/// Reads a server-sent-event body one `data:` payload at a time.
struct SseReader {
    body: sse::Reader,
    header_id: Option<String>,
}

impl SseReader {
    /// The next payload (`[DONE]` included), or `None` at the end of the body.
    async fn next(&mut self) -> Option<String> {
        self.body.next().await
    }

    /// The next payload as JSON (not `[DONE]`).
    async fn next_json(&mut self) -> Value {
        self.body.next_json().await
    }

    /// Reads to the end; returns the last finish reason and whether `[DONE]` came.
    async fn finish(&mut self) -> (Option<String>, bool) {
        let mut finish = None;
        let mut done = false;
        while let Some(p) = self.next().await {
            if p == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(&p).expect("chunk json");
            if let Some(r) = v["choices"][0]["finish_reason"].as_str() {
                finish = Some(r.to_string());
            }
        }
        (finish, done)
    }
}

fn device_bytes(m: &str) -> f64 {
    ["weights", "kv_cache", "runtime"]
        .iter()
        .map(|t| must(m, &format!("pdkv_device_memory_bytes{{tag=\"{t}\"}}")))
        .sum()
}

/// Every admin route, with a body where it needs one.
fn admin_routes(ckpt: &Path) -> Vec<(Method, &'static str, Option<Value>)> {
    vec![
        (Method::POST, "/pause", None),
        (Method::POST, "/resume", None),
        (Method::GET, "/is_paused", None),
        (Method::POST, "/sleep?level=1", None),
        (Method::POST, "/wake_up", None),
        (Method::GET, "/is_sleeping", None),
        (Method::POST, "/release_kv_cache_memory", None),
        (Method::POST, "/reset_prefix_cache", None),
        (
            Method::POST,
            "/abort_requests",
            Some(json!({"request_ids": []})),
        ),
        (
            Method::POST,
            "/update_weights",
            Some(json!({"path": ckpt.to_str().unwrap()})),
        ),
        (Method::GET, "/weight_info", None),
    ]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_do_not_exist_without_a_token() {
    let s = Server::start_admin_with("tiny", 7, None, EngineConfig::default()).await;
    for (method, path, body) in admin_routes(s.checkpoint_path()) {
        // Even with a token, the routes are absent.
        let (status, v) = s
            .send(
                method.clone(),
                path,
                Some(&format!("Bearer {TOKEN}")),
                body.as_ref(),
            )
            .await;
        assert_openai_error(
            status,
            &v,
            StatusCode::NOT_FOUND,
            &format!("{method} {path}"),
        );
    }
    // The OpenAI API is unaffected.
    s.greedy("hello").await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_routes_need_the_token() {
    let (s, before) = Server::start_probed().await;
    let wrong = [
        None,
        Some("Bearer wrong-token".to_string()),
        Some(format!("Basic {TOKEN}")),
        Some(format!("Bearer {TOKEN}x")),
        Some("Bearer".to_string()),
    ];
    for (method, path, body) in admin_routes(s.checkpoint_path()) {
        for auth in &wrong {
            let (status, v) = s
                .send(method.clone(), path, auth.as_deref(), body.as_ref())
                .await;
            assert_openai_error(
                status,
                &v,
                StatusCode::UNAUTHORIZED,
                &format!("{method} {path} with {auth:?}"),
            );
        }
    }
    // Nothing was done: not paused, not asleep, same weights and outputs.
    assert!(!s.is_paused().await);
    assert!(!s.is_sleeping().await);
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert!(info["version"].is_null(), "{info}");
    assert_eq!(s.probe().await, before);
    // The token is case-sensitive but the scheme is not.
    let (status, _) = s
        .send(
            Method::GET,
            "/is_paused",
            Some(&format!("bearer {TOKEN}")),
            None,
        )
        .await;
    assert_eq!(status, StatusCode::OK);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_parameters_are_400_naming_the_parameter() {
    let s = Server::start_admin().await;
    let cases: Vec<(Method, &str, Option<Value>, Option<&str>)> = vec![
        (Method::POST, "/sleep?level=3", None, Some("level")),
        (Method::POST, "/sleep?level=one", None, Some("level")),
        (Method::POST, "/sleep?level=-1", None, Some("level")),
        (Method::POST, "/sleep?level=1&level=2", None, Some("level")),
        (Method::POST, "/sleep?mode=pause", None, Some("mode")),
        (Method::POST, "/sleep?level=3&levle=1", None, Some("level")),
        (
            Method::POST,
            "/sleep",
            Some(json!({"level": 5})),
            Some("level"),
        ),
        (
            Method::POST,
            "/wake_up",
            Some(json!({"tags": ["brain"]})),
            Some("tags"),
        ),
        (Method::POST, "/sleep?timeout=0", None, Some("timeout")),
        (Method::POST, "/pause?mode=nope", None, Some("mode")),
        (Method::POST, "/pause?mode=", None, Some("mode")),
        (
            Method::POST,
            "/pause?clear_cache=maybe",
            None,
            Some("clear_cache"),
        ),
        (Method::POST, "/pause?timeout=soon", None, Some("timeout")),
        (
            Method::POST,
            "/pause?mode=wait&wait_for_inflight_requests=true",
            None,
            Some("mode"),
        ),
        (Method::POST, "/wake_up?tags=gpu", None, Some("tags")),
        (
            Method::POST,
            "/wake_up?tags=weights&tags=",
            None,
            Some("tags"),
        ),
        (
            Method::POST,
            "/reset_prefix_cache?reset_running_requests=2",
            None,
            Some("reset_running_requests"),
        ),
        (
            Method::POST,
            "/reset_prefix_cache?reset_external=maybe",
            None,
            Some("reset_external"),
        ),
        (
            Method::POST,
            "/abort_requests",
            Some(json!({"ids": ["x"]})),
            None,
        ),
        (
            Method::POST,
            "/abort_requests",
            Some(json!({"request_ids": "x"})),
            Some("request_ids"),
        ),
        (
            Method::POST,
            "/abort_requests",
            Some(json!({"request_ids": [1]})),
            Some("request_ids[0]"),
        ),
        (Method::POST, "/update_weights", Some(json!({})), None),
        (
            Method::POST,
            "/update_weights",
            Some(json!({"path": ""})),
            Some("path"),
        ),
        (
            Method::POST,
            "/update_weights",
            Some(json!({"path": 3})),
            Some("path"),
        ),
    ];
    for (method, path, body, param) in &cases {
        let (status, v) = s.admin(method.clone(), path, body.as_ref()).await;
        let ctx = format!("{method} {path} {body:?}");
        assert_openai_error(status, &v, StatusCode::BAD_REQUEST, &ctx);
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], *p, "{ctx}: {v}");
        }
    }
    // A body that is not JSON at all.
    let resp = http::send(
        s.client
            .post(s.url("/abort_requests"))
            .header("authorization", format!("Bearer {TOKEN}"))
            .body("not json"),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    // None of them touched the engine.
    assert!(!s.is_paused().await);
    assert!(!s.is_sleeping().await);
    s.greedy("still serving").await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_level_1_then_wake_restores_outputs_and_frees_memory() {
    let (s, before) = Server::start_probed().await;
    let awake = s.wait_all_blocks_free().await;
    let awake_bytes = device_bytes(&awake);
    assert_eq!(must(&awake, "pdkv_sleeping"), 0.0);
    assert_eq!(must(&awake, "pdkv_sleep_level"), -1.0);

    // Waking what is awake is a no-op.
    s.admin_ok(Method::POST, "/wake_up", None).await;
    assert!(!s.is_sleeping().await);
    assert_eq!(s.probe().await, before);

    assert_eq!(s.health().await, StatusCode::OK);
    let v = s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    assert_eq!(v["status"], "sleeping");
    assert!(s.is_sleeping().await);
    // Asleep, /health is a retryable 503 naming the state, so a router's
    // health check steers traffic away.
    let resp = s.client.get(s.url("/health")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(http::retry_after(&resp), Some("1"));
    let body: Value = resp.json().await.unwrap();
    assert_eq!(body["error"]["code"], "sleeping", "{body}");
    let (status, body) = s.post("/v1/completions", &greedy_body("asleep")).await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "completion while asleep",
    );
    assert_eq!(
        body["error"]["code"], "engine_not_serving",
        "a retryable 503: {body}"
    );
    let resp = http::send(
        s.client
            .post(s.url("/v1/completions"))
            .json(&greedy_body("asleep")),
    )
    .await;
    assert_eq!(http::retry_after(&resp), Some("1"));
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        )
        .await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "chat while asleep",
    );

    let asleep = s.metrics().await;
    assert_eq!(must(&asleep, "pdkv_sleeping"), 1.0);
    assert_eq!(must(&asleep, "pdkv_sleep_level"), 1.0);
    assert_eq!(must(&asleep, "pdkv_sleep_duration_seconds_count"), 1.0);
    let asleep_bytes = device_bytes(&asleep);
    assert!(
        asleep_bytes <= 0.02 * awake_bytes,
        "asleep {asleep_bytes} bytes is more than 2% of awake {awake_bytes}"
    );
    // Level 1 keeps the weights in host memory.
    let weights = must(&awake, "pdkv_device_memory_bytes{tag=\"weights\"}");
    assert!(
        must(&asleep, "pdkv_host_backup_bytes") >= weights,
        "{asleep}"
    );

    let v = s.admin_ok(Method::POST, "/wake_up", None).await;
    assert_eq!(v["is_sleeping"], false, "{v}");
    assert!(!s.is_sleeping().await);
    assert!(!s.is_paused().await);
    assert_eq!(s.health().await, StatusCode::OK);
    assert_eq!(s.probe().await, before);
    let m = s.wait_all_blocks_free().await;
    assert_eq!(must(&m, "pdkv_sleeping"), 0.0);
    assert_eq!(device_bytes(&m), awake_bytes);
    // Two wakes were measured: the no-op one and the real one.
    assert_eq!(must(&m, "pdkv_wake_duration_seconds_count"), 2.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selective_wake_in_both_orders() {
    let (s, before) = Server::start_probed().await;
    for order in [["weights", "kv_cache"], ["kv_cache", "weights"]] {
        s.admin_ok(Method::POST, "/sleep?level=1", None).await;
        let v = s
            .admin_ok(Method::POST, &format!("/wake_up?tags={}", order[0]), None)
            .await;
        assert_eq!(v["is_sleeping"], true, "{order:?}: {v}");
        assert_eq!(v["asleep_tags"], json!([order[1]]), "{order:?}: {v}");
        assert!(s.is_sleeping().await);
        let (status, body) = s.post("/v1/completions", &greedy_body("half awake")).await;
        assert_openai_error(
            status,
            &body,
            StatusCode::SERVICE_UNAVAILABLE,
            "completion while half awake",
        );
        let v = s
            .admin_ok(Method::POST, &format!("/wake_up?tags={}", order[1]), None)
            .await;
        assert_eq!(v["is_sleeping"], false, "{order:?}: {v}");
        assert!(!s.is_sleeping().await);
        assert_eq!(s.probe().await, before, "after waking {order:?}");
    }
    // Both tags in one call, repeated query parameters.
    s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    s.admin_ok(Method::POST, "/wake_up?tags=weights&tags=kv_cache", None)
        .await;
    assert!(!s.is_sleeping().await);
    assert_eq!(s.probe().await, before);
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_kv_cache_memory_needs_a_pause() {
    let (s, before) = Server::start_probed().await;
    let (status, v) = s
        .admin(Method::POST, "/release_kv_cache_memory", None)
        .await;
    assert_openai_error(status, &v, StatusCode::CONFLICT, "release while not paused");
    assert!(
        v["error"]["message"].as_str().unwrap().contains("pause"),
        "{v}"
    );

    s.admin_ok(Method::POST, "/pause", None).await;
    assert!(s.is_paused().await);
    s.admin_ok(Method::POST, "/release_kv_cache_memory", None)
        .await;
    let m = s.metrics().await;
    assert_eq!(
        must(&m, "pdkv_device_memory_bytes{tag=\"kv_cache\"}"),
        0.0,
        "{m}"
    );
    assert_eq!(must(&m, "pdkv_paused"), 1.0);
    let v = s.admin_ok(Method::POST, "/resume", None).await;
    assert_eq!(v["status"], "resumed");
    assert!(!s.is_paused().await);
    assert_eq!(s.probe().await, before);
    let m = s.wait_all_blocks_free().await;
    assert!(must(&m, "pdkv_device_memory_bytes{tag=\"kv_cache\"}") > 0.0);
    assert_eq!(must(&m, "pdkv_paused"), 0.0);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_keep_holds_requests_until_resume() {
    let s = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    let before = s.greedy("held back").await;
    // A request running when the pause starts is frozen, not aborted.
    let mut running = s.open_stream(json!({"max_tokens": 64}), None).await;
    running.next_json().await;
    let v = s.admin_ok(Method::POST, "/pause?mode=keep", None).await;
    assert_eq!(v["status"], "paused");
    assert!(s.is_paused().await);

    // A request sent during a keep-pause queues.
    let client = s.client.clone();
    let url = s.url("/v1/completions");
    let queued = tokio::spawn(async move {
        let resp = http::send(client.post(url).json(&greedy_body("held back"))).await;
        (resp.status(), resp.json::<Value>().await.expect("json"))
    });
    let m = s
        .wait_metrics("the request to queue", |m| {
            must(m, "pdkv_num_requests_waiting") >= 1.0
        })
        .await;
    assert_eq!(must(&m, "pdkv_paused"), 1.0);
    assert!(!queued.is_finished());
    // Paused, /health steers routers away (requests sent anyway are held).
    let (status, v) = s.send(Method::GET, "/health", None, None).await;
    http::assert_error_code(status, &v, StatusCode::SERVICE_UNAVAILABLE, "paused");

    s.admin_ok(Method::POST, "/resume", None).await;
    assert_eq!(s.health().await, StatusCode::OK);
    let (status, body) = tokio::time::timeout(DEADLINE, queued)
        .await
        .expect("queued request ends")
        .unwrap();
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["choices"][0]["text"], before.as_str());
    let (finish, done) = running.finish().await;
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(done);
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_abort_ends_concurrent_streams_and_frees_blocks() {
    let s = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    let mut streams = Vec::new();
    for i in 0..8 {
        streams.push(
            s.open_stream(json!({"prompt": format!("stream number {i}")}), None)
                .await,
        );
    }
    for st in &mut streams {
        st.next_json().await;
    }
    s.admin_ok(Method::POST, "/pause?mode=abort", None).await;
    for (i, st) in streams.iter_mut().enumerate() {
        let (finish, done) = st.finish().await;
        assert_eq!(finish.as_deref(), Some("abort"), "stream {i}");
        assert!(done, "stream {i} ends with [DONE]");
    }
    let m = s.wait_all_blocks_free().await;
    assert_eq!(
        must(&m, "pdkv_requests_total{finish_reason=\"abort\"}"),
        8.0
    );
    // New requests during an abort pause are refused with a retryable 503.
    let (status, body) = s.post("/v1/completions", &greedy_body("paused")).await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "completion while paused",
    );
    s.resume_serving().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pause_wait_lets_running_requests_finish() {
    let s = Server::start_admin().await;
    let mut running = s.open_stream(json!({"max_tokens": 32}), None).await;
    running.next_json().await;
    s.admin_ok(Method::POST, "/pause?mode=wait&timeout=30", None)
        .await;
    let (finish, _) = running.finish().await;
    assert_eq!(finish.as_deref(), Some("length"));
    assert!(s.is_paused().await);
    s.wait_all_blocks_free().await;
    s.resume_serving().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_weights_matches_a_fresh_server_and_refuses_incompatible_ones() {
    let s = Server::start_admin().await;
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert!(info["version"].is_null(), "{info}");
    assert_eq!(info["path"], s.checkpoint_path().to_str().unwrap());
    let seed7 = s.probe().await;

    // A checkpoint of another shape is refused and the old weights keep serving.
    let small = checkpoint("small", 2);
    s.admin_ok(Method::POST, "/pause", None).await;
    let (status, v) = s
        .admin(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": small.path().to_str().unwrap(), "version": "bad"})),
        )
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "incompatible weights");
    s.admin_ok(Method::POST, "/resume", None).await;
    assert_eq!(s.probe().await, seed7);
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert!(info["version"].is_null(), "{info}");

    // A compatible checkpoint (same shape, seed 2) replaces the weights.
    let seed2_dir = checkpoint("tiny", 2);
    let seed2_path = seed2_dir.path().to_str().unwrap().to_string();
    s.admin_ok(Method::POST, "/pause", None).await;
    let v = s
        .admin_ok(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": seed2_path, "version": "v2"})),
        )
        .await;
    assert_eq!(v, json!({"status": "ok", "version": "v2"}));
    s.admin_ok(Method::POST, "/resume", None).await;
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert_eq!(
        info,
        json!({"version": "v2", "weight_version": "v2", "path": seed2_path})
    );
    let reloaded = s.probe().await;
    assert_ne!(
        reloaded, seed7,
        "seed 2 weights should change the sampled outputs"
    );

    let fresh = Server::start_admin_with("tiny", 2, Some(TOKEN), EngineConfig::default()).await;
    assert_eq!(reloaded, fresh.probe().await);
    fresh.stop().await;
    s.wait_all_blocks_free().await;
    s.stop().await;
}

/// Makes a FIFO at `path`.
fn mkfifo(path: &Path) {
    let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    let made = unsafe { libc::mkfifo(c.as_ptr(), 0o600) };
    assert_eq!(made, 0, "mkfifo {path:?}");
}

/// A checkpoint path that would block a reader for ever — a FIFO nobody
/// writes, a device that never ends, a checkpoint directory whose weights
/// file is a FIFO whose writer wrote a little and stopped (a hung
/// filesystem's shape) — is refused with a 400 naming what it is, at once;
/// the engine serves its old weights throughout, and a good reload after
/// them works.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn update_weights_from_a_fifo_a_device_or_a_stalled_pipe_is_refused_while_serving() {
    let s = Server::start_admin().await;
    let before = s.probe().await;
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("w.gguf");
    mkfifo(&fifo);
    // A copy of a good checkpoint whose weights file is a FIFO, held open
    // by a writer that wrote a few bytes and stopped.
    let good = checkpoint("tiny", 2);
    let stalled = dir.path().join("stalled");
    std::fs::create_dir(&stalled).unwrap();
    for e in std::fs::read_dir(good.path()).unwrap() {
        let e = e.unwrap();
        let name = e.file_name();
        if name.to_str().unwrap().ends_with(".safetensors") {
            mkfifo(&stalled.join(&name));
        } else {
            std::fs::copy(e.path(), stalled.join(&name)).unwrap();
        }
    }
    let shard = std::fs::read_dir(&stalled)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .expect("the checkpoint has a safetensors file");
    // Opening a FIFO read-write does not wait for a reader (Linux).
    let mut writer = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&shard)
        .unwrap();
    std::io::Write::write_all(&mut writer, &[0u8; 16]).unwrap();

    for (path, what) in [
        (fifo.as_path(), "a FIFO"),
        (Path::new("/dev/zero"), "a device"),
        (stalled.as_path(), "a FIFO"),
    ] {
        let (status, v) = tokio::time::timeout(
            DEADLINE,
            s.admin(
                Method::POST,
                "/update_weights",
                Some(&json!({"path": path.to_str().unwrap(), "version": "never"})),
            ),
        )
        .await
        .unwrap_or_else(|_| panic!("update_weights from {path:?} did not answer"));
        assert_openai_error(status, &v, StatusCode::BAD_REQUEST, &format!("{path:?}"));
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(what), "{path:?}: {msg}");
        assert_eq!(s.probe().await, before, "old weights serve after {path:?}");
    }
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert!(info["version"].is_null(), "{info}");
    drop(writer);

    // A good checkpoint still loads, and serves what a fresh server does.
    s.admin_ok(
        Method::POST,
        "/update_weights",
        Some(&json!({"path": good.path().to_str().unwrap(), "version": "v2"})),
    )
    .await;
    let fresh = Server::start_admin_with("tiny", 2, Some(TOKEN), EngineConfig::default()).await;
    assert_eq!(s.probe().await, fresh.probe().await);
    fresh.stop().await;
    s.stop().await;
}

/// Level 2 over level 1 drops the weights' host backup: the answer and
/// `/is_sleeping` say so, a wake brings back an engine that needs its
/// weights loaded (every request a 503 until then), and a load serves.
/// Level 1 over level 2 keeps level 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_level_2_over_level_1_discards_the_backup_and_says_so() {
    let (s, before) = Server::start_probed().await;
    let v = s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    assert_eq!(
        v,
        json!({"status": "sleeping", "level": 1, "weights_discarded": false})
    );
    assert!(must(&s.metrics().await, "pdkv_host_backup_bytes") > 0.0);
    let v = s.admin_ok(Method::POST, "/sleep?level=2", None).await;
    assert_eq!(
        (&v["level"], &v["weights_discarded"]),
        (&json!(2), &json!(true)),
        "{v}"
    );
    assert!(
        v["detail"]
            .as_str()
            .unwrap()
            .contains("host backup was discarded"),
        "{v}"
    );
    assert_eq!(must(&s.metrics().await, "pdkv_host_backup_bytes"), 0.0);
    let v = s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    assert_eq!((&v["level"], v.get("detail")), (&json!(2), None), "{v}");
    let v = s.admin_ok(Method::GET, "/is_sleeping", None).await;
    assert_eq!(
        v,
        json!({"is_sleeping": true, "level": 2, "weights_discarded": true})
    );
    let v = s.admin_ok(Method::POST, "/wake_up", None).await;
    assert_eq!(
        (&v["status"], &v["weights_discarded"]),
        (&json!("awake"), &json!(true)),
        "{v}"
    );
    let (status, body) = s.post("/v1/completions", &greedy_body("no weights")).await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "before the load",
    );
    let path = s.checkpoint_path().to_str().unwrap().to_string();
    s.admin_ok(
        Method::POST,
        "/update_weights",
        Some(&json!({"path": path})),
    )
    .await;
    assert_eq!(s.probe().await, before);
    let v = s.admin_ok(Method::GET, "/is_sleeping", None).await;
    assert_eq!(
        v,
        json!({"is_sleeping": false, "level": null, "weights_discarded": false})
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_level_2_then_reload_serves_the_new_weights() {
    let (s, before) = Server::start_probed().await;
    s.admin_ok(Method::POST, "/sleep?level=2", None).await;
    let asleep = s.metrics().await;
    assert_eq!(must(&asleep, "pdkv_sleep_level"), 2.0);
    assert_eq!(
        must(&asleep, "pdkv_host_backup_bytes"),
        0.0,
        "level 2 keeps no backup"
    );
    // Weights cannot be written while their memory is released.
    let path = s.checkpoint_path().to_str().unwrap().to_string();
    let (status, v) = s
        .admin(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": path})),
        )
        .await;
    assert_openai_error(
        status,
        &v,
        StatusCode::CONFLICT,
        "update_weights while the weights sleep",
    );
    s.admin_ok(Method::POST, "/wake_up", None).await;
    // Weights were discarded: nothing is served until they are reloaded.
    let (status, body) = s.post("/v1/completions", &greedy_body("no weights")).await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "completion before reload",
    );
    assert_eq!(must(&s.metrics().await, "pdkv_weights_discarded"), 1.0);
    let path = s.checkpoint_path().to_str().unwrap().to_string();
    // A checkpoint that does not exist is the client's mistake.
    let (status, v) = s
        .admin(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": "/nonexistent/checkpoint"})),
        )
        .await;
    assert_openai_error(
        status,
        &v,
        StatusCode::BAD_REQUEST,
        "update_weights from a missing path",
    );
    s.admin_ok(
        Method::POST,
        "/update_weights",
        Some(&json!({"path": path, "version": "again"})),
    )
    .await;
    assert_eq!(s.probe().await, before);
    assert_eq!(must(&s.metrics().await, "pdkv_weights_discarded"), 0.0);
    s.stop().await;
}

/// A client that learns one server-made id and claims the ids that would
/// follow it (as `X-Request-Id`s of requests it keeps open) refuses nobody:
/// server-made ids are random, not a counter.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_made_request_ids_cannot_be_squatted() {
    let s = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    let mut seen = s.open_stream(json!({}), None).await;
    let id = seen.next_json().await["id"].as_str().unwrap().to_string();
    let hex = id.strip_prefix("cmpl-").expect("a completion id");
    assert_eq!(hex.len(), 32, "{id}: 128 bits");
    assert!(hex.chars().all(|c| c.is_ascii_hexdigit()), "{id}");
    // The squatter's guesses: the next values of the id's last 8 digits.
    let (head, tail) = id.split_at(id.len() - 8);
    let tail = u32::from_str_radix(tail, 16).unwrap();
    let mut squatted = Vec::new();
    let mut held = Vec::new();
    for k in 1..=8u32 {
        let guess = format!("{head}{:08x}", tail.wrapping_add(k));
        held.push(s.open_stream(json!({}), Some(&guess)).await);
        squatted.push(guess);
    }
    // Six honest requests without ids: none refused, none given a squatted id.
    for _ in 0..6 {
        let (status, v) = s.post("/v1/completions", &greedy_body("honest")).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        let got = v["id"].as_str().unwrap();
        assert!(!squatted.iter().any(|q| q == got), "{got}");
    }
    let v = s
        .admin_ok(Method::POST, "/abort_requests", Some(&json!({})))
        .await;
    assert_eq!(v["num_aborted"], json!(9));
    assert_eq!(seen.finish().await, (Some("abort".to_string()), true));
    for mut h in held {
        assert_eq!(h.finish().await, (Some("abort".to_string()), true));
    }
    s.wait_all_blocks_free().await;
    s.stop().await;
}

/// A client-chosen id collides only with its own client's requests: a
/// squatter that claims an id first (from another address, as the
/// `X-Forwarded-For` a proxy sets tells, or with other credentials) refuses
/// nobody; the same client choosing a live id again is a 409; each sees the
/// id it chose, and an abort by that id ends every request running it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_chosen_ids_collide_only_with_the_same_clients_requests() {
    let s = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    let id = ("x-request-id", "job-1");
    let squatters = [
        [id, ("x-forwarded-for", "192.0.2.66")],
        [id, ("authorization", "Bearer someone-else")],
    ];
    let mut held = Vec::new();
    for h in &squatters {
        held.push(s.open_stream_with(json!({}), h).await);
    }
    let honest = [id, ("x-forwarded-for", "192.0.2.1")];
    let mut mine = s.open_stream_with(json!({}), &honest).await;
    assert_eq!(mine.header_id.as_deref(), Some("job-1"));
    assert_eq!(mine.next_json().await["id"], "job-1");
    for h in &mut held {
        assert_eq!(h.next_json().await["id"], "job-1");
    }
    // The same client again, while its job-1 runs.
    let mut again = s
        .client
        .post(s.url("/v1/completions"))
        .json(&greedy_body("x"));
    for (k, v) in honest {
        again = again.header(k, v);
    }
    let (status, v) = http::answer(again).await;
    http::assert_error_code(status, &v, StatusCode::CONFLICT, "duplicate_request_id");

    let v = s
        .admin_ok(
            Method::POST,
            "/abort_requests",
            Some(&json!({"request_ids": ["job-1"]})),
        )
        .await;
    assert_eq!(v["aborted"], json!(["job-1"]), "{v}");
    assert_eq!(mine.finish().await, (Some("abort".to_string()), true));
    for mut h in held {
        assert_eq!(h.finish().await, (Some("abort".to_string()), true));
    }
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abort_requests_by_id_and_request_ids() {
    let s = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    // The id chosen with X-Request-Id is the response's id and header.
    let mut a = s.open_stream(json!({}), Some("client-chosen-1")).await;
    assert_eq!(a.header_id.as_deref(), Some("client-chosen-1"));
    assert_eq!(a.next_json().await["id"], "client-chosen-1");
    // One chosen with the body field, and a server-made one.
    let mut b = s
        .open_stream(json!({"request_id": "body-chosen-2"}), None)
        .await;
    assert_eq!(b.next_json().await["id"], "body-chosen-2");
    let mut c = s.open_stream(json!({}), None).await;
    let c_id = c.next_json().await["id"].as_str().unwrap().to_string();
    assert!(c_id.starts_with("cmpl-"), "{c_id}");
    assert_eq!(c.header_id.as_deref(), Some(c_id.as_str()));

    // A live id cannot be reused.
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "x", "request_id": "body-chosen-2"}),
        )
        .await;
    assert_openai_error(status, &v, StatusCode::CONFLICT, "duplicate id");

    let v = s
        .admin_ok(
            Method::POST,
            "/abort_requests",
            Some(&json!({"request_ids": ["client-chosen-1", "no-such-request", c_id]})),
        )
        .await;
    let mut aborted: Vec<String> = v["aborted"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap().to_string())
        .collect();
    aborted.sort();
    let mut want = vec!["client-chosen-1".to_string(), c_id.clone()];
    want.sort();
    assert_eq!(aborted, want);
    assert_eq!(a.finish().await, (Some("abort".to_string()), true));
    assert_eq!(c.finish().await, (Some("abort".to_string()), true));
    // The other request is still running; abort it too.
    let v = s
        .admin_ok(
            Method::POST,
            "/abort_requests",
            Some(&json!({"request_ids": ["body-chosen-2"]})),
        )
        .await;
    assert_eq!(v["aborted"], json!(["body-chosen-2"]));
    assert_eq!(b.finish().await, (Some("abort".to_string()), true));
    let v = s
        .admin_ok(
            Method::POST,
            "/abort_requests",
            Some(&json!({"request_ids": []})),
        )
        .await;
    assert_eq!(v["aborted"], json!([]));
    s.wait_all_blocks_free().await;

    // Ids are checked.
    let resp = http::send(
        s.client
            .post(s.url("/v1/completions"))
            .header("x-request-id", "x".repeat(300))
            .json(&greedy_body("a")),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::BAD_REQUEST);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["param"], "X-Request-Id");
    let (status, v) = s
        .post("/v1/completions", &json!({"prompt": "a", "request_id": ""}))
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "empty request_id");
    // A finished id is free again.
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": "a", "max_tokens": 2, "request_id": "body-chosen-2"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["id"], "body-chosen-2");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_prefix_cache_reports_success() {
    let s = Server::start_admin().await;
    let prompt =
        "a prompt long enough to fill more than one block of sixteen tokens, twice over for sure";
    s.greedy(prompt).await;
    s.greedy(prompt).await;
    let m = s.wait_all_blocks_free().await;
    let hits = must(&m, "pdkv_prefix_cache_hits_total");
    assert!(hits > 0.0, "the second run should hit the prefix cache");
    let v = s.admin_ok(Method::POST, "/reset_prefix_cache", None).await;
    assert_eq!(v, json!({"success": true}));
    // After the reset the same prompt finds nothing cached.
    s.greedy(prompt).await;
    let m = s.wait_all_blocks_free().await;
    assert_eq!(must(&m, "pdkv_prefix_cache_hits_total"), hits);
    let v = s
        .admin_ok(
            Method::POST,
            "/reset_prefix_cache?reset_running_requests=true&reset_external=true",
            None,
        )
        .await;
    assert_eq!(v, json!({"success": true}));
    // A router's `/flush_cache` (no token needed) empties the cache too.
    s.greedy(prompt).await;
    let m = s.wait_all_blocks_free().await;
    let hits = must(&m, "pdkv_prefix_cache_hits_total");
    let (status, v) = s.send(Method::POST, "/flush_cache", None, None).await;
    assert_eq!(
        (status, &v["success"]),
        (StatusCode::OK, &json!(true)),
        "{v}"
    );
    s.greedy(prompt).await;
    let m = s.wait_all_blocks_free().await;
    assert_eq!(
        must(&m, "pdkv_prefix_cache_hits_total"),
        hits,
        "nothing was cached after the flush"
    );
    // While blocks are in use the flush is refused, not half done. The
    // request is frozen by a keep-pause so it holds its blocks whatever the
    // machine's speed (a running one could end between two polls).
    let mut running = s.open_stream(json!({}), None).await;
    running.next_json().await;
    s.admin_ok(Method::POST, "/pause?mode=keep", None).await;
    let (status, v) = s.send(Method::POST, "/flush_cache", None, None).await;
    http::assert_error_code(status, &v, StatusCode::CONFLICT, "cache_in_use");
    s.admin_ok(Method::POST, "/resume", None).await;
    drop(running);
    let (status, v) = s.send(Method::GET, "/get_model_info", None, None).await;
    assert_eq!(
        (status, &v["is_generation"]),
        (StatusCode::OK, &json!(true)),
        "{v}"
    );
    let (status, v) = s.send(Method::GET, "/get_server_info", None, None).await;
    assert_eq!(
        (status, &v["accepting_requests"]),
        (StatusCode::OK, &json!(true)),
        "{v}"
    );
    s.stop().await;
}

/// A rank's live device bytes over every tag, from `/metrics`.
fn rank_bytes(m: &str, rank: usize) -> f64 {
    ["weights", "kv_cache", "runtime"]
        .iter()
        .map(|t| {
            must(
                m,
                &format!("pdkv_rank_device_memory_bytes{{rank=\"{rank}\",tag=\"{t}\"}}"),
            )
        })
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_model_split_over_ranks_serves_sleeps_wakes_and_reloads_as_one() {
    const RANKS: usize = 3;
    let whole = Server::start_admin_with("small", 7, Some(TOKEN), EngineConfig::default()).await;
    let tp = EngineConfig {
        tensor_parallel_size: RANKS,
        ..EngineConfig::default()
    };
    // 4 KV heads over 3 ranks: 2 + 1 + 1.
    let s = Server::start_admin_with("small", 7, Some(TOKEN), tp.clone()).await;
    let before = s.probe().await;
    assert_eq!(
        before,
        whole.probe().await,
        "the split model answers as the whole one"
    );

    // Every rank holds memory of its own, and together no more than the
    // whole model's weights (plus the norms each rank copies).
    let awake = s.wait_all_blocks_free().await;
    let whole_m = whole.wait_all_blocks_free().await;
    let w = |m: &str| must(m, "pdkv_device_memory_bytes{tag=\"weights\"}");
    assert!(w(&awake) <= w(&whole_m) * 1.05, "{awake}");
    let per_rank: Vec<f64> = (0..RANKS).map(|r| rank_bytes(&awake, r)).collect();
    for (r, b) in per_rank.iter().enumerate() {
        let weights = must(
            &awake,
            &format!("pdkv_rank_device_memory_bytes{{rank=\"{r}\",tag=\"weights\"}}"),
        );
        assert!(weights > 0.0 && weights < w(&whole_m), "rank {r}: {awake}");
        assert!(*b > weights, "rank {r} has a KV cache and scratch: {awake}");
    }

    // Asleep, every rank is down to 2% of its memory.
    s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    let asleep = s.metrics().await;
    for (r, awake_b) in per_rank.iter().enumerate() {
        let b = rank_bytes(&asleep, r);
        assert!(
            b <= 0.02 * awake_b,
            "rank {r}: {b} of {awake_b} bytes asleep"
        );
    }

    // A wake that fails on rank 1 leaves every rank asleep, names the rank,
    // and a retry wakes them all.
    s.engine.pool().ranks()[1].faults().fail_wakes(1);
    let (status, v) = s.admin(Method::POST, "/wake_up", None).await;
    assert!(status.is_server_error(), "{status} {v}");
    let msg = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        msg.contains("rank 1: wake failed") && msg.contains("ranks 0..1 were put back to sleep"),
        "{v}"
    );
    assert!(s.is_sleeping().await);
    let still = s.metrics().await;
    for (r, awake_b) in per_rank.iter().enumerate() {
        let b = rank_bytes(&still, r);
        assert!(b <= 0.02 * awake_b, "rank {r} woke alone: {b} bytes");
    }
    s.admin_ok(Method::POST, "/wake_up", None).await;
    assert!(!s.is_sleeping().await);
    assert_eq!(s.probe().await, before);
    let m = s.wait_all_blocks_free().await;
    for (r, awake_b) in per_rank.iter().enumerate() {
        assert_eq!(rank_bytes(&m, r), *awake_b, "rank {r} after the wake");
    }

    // A weight update reaches every rank: the answers are those of a whole
    // model on the new checkpoint.
    let seed2 = checkpoint("small", 2);
    s.admin_ok(Method::POST, "/pause", None).await;
    s.admin_ok(
        Method::POST,
        "/update_weights",
        Some(&json!({"path": seed2.path().to_str().unwrap(), "version": "v2"})),
    )
    .await;
    s.admin_ok(Method::POST, "/resume", None).await;
    let fresh = Server::start_admin_with("small", 2, Some(TOKEN), EngineConfig::default()).await;
    let reloaded = s.probe().await;
    assert_ne!(reloaded, before);
    assert_eq!(reloaded, fresh.probe().await);
    // A checkpoint of another shape is refused before any rank is written.
    s.admin_ok(Method::POST, "/pause", None).await;
    let tiny = checkpoint("tiny", 2);
    let (status, v) = s
        .admin(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": tiny.path().to_str().unwrap()})),
        )
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "incompatible weights");
    s.admin_ok(Method::POST, "/resume", None).await;
    assert_eq!(s.probe().await, reloaded);
    for srv in [fresh, whole, s] {
        srv.wait_all_blocks_free().await;
        srv.stop().await;
    }
}

impl Server {
    /// `init_weight_transfer_engine` with the publisher at `url`, then
    /// `start_weight_update` (both must succeed); start's answer.
    async fn begin_sync(&self, url: &str) -> Value {
        let init = json!({"init_info": {"backend": "pdkv", "url": url}});
        self.admin_ok(Method::POST, "/init_weight_transfer_engine", Some(&init))
            .await;
        let start = json!({"is_checkpoint_format": true});
        self.admin_ok(Method::POST, "/start_weight_update", Some(&start))
            .await
    }

    /// `update_weights` pulling every tensor left of the sync begun.
    async fn pull_weights(&self) -> (StatusCode, Value) {
        let pull = json!({"update_info": {}});
        self.admin(Method::POST, "/update_weights", Some(&pull))
            .await
    }

    /// [`Server::pull_weights`], which must succeed; its answer.
    async fn pull_weights_ok(&self) -> Value {
        let (status, v) = self.pull_weights().await;
        assert_eq!(status, StatusCode::OK, "/update_weights: {v}");
        v
    }

    /// The switch as a trainer makes it: a `keep` pause,
    /// `finish_weight_update` with `body`, resume; finish's answer.
    async fn switch_synced(&self, body: Option<&Value>) -> Value {
        self.admin_ok(Method::POST, "/pause?mode=keep", None).await;
        let v = self
            .admin_ok(Method::POST, "/finish_weight_update", body)
            .await;
        self.admin_ok(Method::POST, "/resume", None).await;
        v
    }
}

/// A publisher of the `tiny` checkpoint of `seed` (its weights loaded in a
/// pool of their own, as a trainer's would be).
async fn publisher(seed: u64, version: &str) -> (tempfile::TempDir, pdkv_sync::Publisher) {
    let dir = checkpoint("tiny", seed);
    let pool = pdkv_vmem::Pool::default();
    let m = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).expect("load");
    let p = pdkv_sync::Publisher::start(
        m.model.weights().clone(),
        Some(version.into()),
        pdkv_sync::PublishOptions::default(),
    )
    .await
    .expect("publish");
    (dir, p)
}

/// A trainer publishes its tensors as it holds them — Hugging Face names,
/// bf16 — to an engine serving Q8_0: the engine converts while it pulls,
/// and then answers as an engine that reloaded the same checkpoint from
/// disk (the loader's conversion) does. The manifest keeps the trainer's
/// types; the report names the conversion's cost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sync_of_a_trainers_bf16_tensors_into_a_q8_0_engine_equals_a_reload() {
    let q8 = || crate::common::Serving {
        weight_format: pdkv_model::loader::WeightFormat::Convert(
            pdkv_model::weights::DType::Quant(pdkv_model::qtype::QType::Q8_0),
        ),
        ..crate::common::Serving::default()
    };
    let s = Server::spawn_serving("tiny", 7, Some(TOKEN), EngineConfig::default(), q8()).await;
    let before = s.probe().await;
    // The trainer's checkpoint: seed 2, written as bf16 safetensors.
    let seed2 = checkpoint("tiny", 2);
    let exported = tempfile::tempdir().unwrap();
    {
        let pool = pdkv_vmem::Pool::default();
        let m = pdkv_model::load_model(seed2.path(), &pool, &mut |_| {}).expect("load");
        pdkv_model::export::export_hf(&m, exported.path(), &mut |_| {}).expect("export");
    }
    let reference =
        Server::spawn_serving("tiny", 7, Some(TOKEN), EngineConfig::default(), q8()).await;
    let path = exported.path().to_str().unwrap();
    reference
        .admin_ok(
            Method::POST,
            "/update_weights",
            Some(&json!({"path": path})),
        )
        .await;
    let want = reference.probe().await;
    assert_ne!(want, before, "seed 2 answers otherwise");

    let tensors = pdkv_sync::TrainerTensor::read_hf_dir(exported.path()).unwrap();
    assert!(tensors.iter().all(|t| t.dtype == "bf16"));
    let p = pdkv_sync::Publisher::start_tensors(
        tensors,
        Some("hf".into()),
        pdkv_sync::PublishOptions::default(),
    )
    .await
    .expect("publish");
    s.begin_sync(&p.url()).await;
    let v = s.pull_weights_ok().await;
    assert!(
        v["convert_seconds"].as_f64().is_some_and(|x| x > 0.0),
        "{v}"
    );
    s.switch_synced(None).await;
    assert_eq!(s.probe().await, want, "as the reload from disk answers");
    reference.stop().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_sync_matches_a_fresh_server_and_a_bad_one_changes_nothing() {
    let (s, seed7) = Server::start_probed().await;

    // Another backend is refused, naming ours; a phase out of order is a 409.
    let (status, v) = s
        .admin(
            Method::POST,
            "/init_weight_transfer_engine",
            Some(&json!({"init_info": {"backend": "nccl", "master_address": "x"}})),
        )
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "nccl backend");
    assert!(v.to_string().contains("`pdkv`"), "{v}");
    let (status, v) = s.admin(Method::POST, "/start_weight_update", None).await;
    assert_openai_error(status, &v, StatusCode::CONFLICT, "start before init");

    // A bad checksum: one tensor's bytes change under the manifest. The
    // pull is refused naming it, finish is refused (incomplete), and the
    // old weights keep serving.
    let (_d3, bad) = publisher(3, "bad").await;
    let (name, offset) = {
        let t = &bad.manifest().tensors[5];
        (t.name.clone(), t.offset as usize)
    };
    let mut b = [0u8; 1];
    bad.region().read_bytes(offset + 3, &mut b).unwrap();
    b[0] ^= 1;
    bad.region().write_bytes(offset + 3, &b).unwrap();
    let v = s.begin_sync(&bad.url()).await;
    assert_eq!(v["bytes"].as_u64(), Some(bad.manifest().bytes()), "{v}");
    let (status, v) = s.pull_weights().await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "bad checksum");
    assert!(v.to_string().contains(&name), "names the tensor: {v}");
    let (status, v) = s.admin(Method::POST, "/finish_weight_update", None).await;
    assert_openai_error(
        status,
        &v,
        StatusCode::CONFLICT,
        "finish an incomplete sync",
    );
    assert_eq!(s.probe().await, seed7, "the old weights serve");

    // A publisher killed before the pull: 503, naming it; old weights serve.
    let (_d4, gone) = publisher(4, "gone").await;
    s.begin_sync(&gone.url()).await;
    // The server pulls over shared memory when the publisher offers it.
    let addr = match &gone.manifest().shm {
        Some(shm) => shm.path.clone(),
        None => gone.manifest().transfer_addr.clone(),
    };
    drop(gone);
    let (status, v) = s.pull_weights().await;
    assert_openai_error(
        status,
        &v,
        StatusCode::SERVICE_UNAVAILABLE,
        "publisher gone",
    );
    assert!(v.to_string().contains(&addr), "names the publisher: {v}");
    assert_eq!(s.probe().await, seed7, "the old weights serve");

    // A good sync of seed 2, in two chunks, paused around the switch as a
    // trainer does: outputs equal a fresh server's on the seed-2 checkpoint.
    let (_d2, good) = publisher(2, "v2").await;
    s.begin_sync(&good.url()).await;
    let names: Vec<String> = good
        .manifest()
        .tensors
        .iter()
        .map(|t| t.name.clone())
        .collect();
    let v = s
        .admin_ok(
            Method::POST,
            "/update_weights",
            Some(&json!({"update_info": {"names": names[..4]}})),
        )
        .await;
    assert_eq!(
        (v["pulled"].as_u64(), v["total"].as_u64()),
        (Some(4), Some(names.len() as u64)),
        "{v}"
    );
    assert_eq!(
        s.probe().await,
        seed7,
        "still the old weights before the switch"
    );
    s.pull_weights_ok().await;
    let v = s.switch_synced(None).await;
    assert_eq!(v["version"], "v2", "the manifest's version: {v}");
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert_eq!(info["version"], "v2", "{info}");
    let synced = s.probe().await;
    assert_ne!(synced, seed7);
    let fresh = Server::start_admin_with("tiny", 2, Some(TOKEN), EngineConfig::default()).await;
    assert_eq!(
        synced,
        fresh.probe().await,
        "equal to a fresh server on the new checkpoint"
    );
    let m = s.metrics().await;
    assert_eq!(must(&m, "pdkv_weight_syncs_total"), 1.0);
    assert_eq!(
        must(&m, "pdkv_weight_sync_bytes_total"),
        good.manifest().bytes() as f64
    );
    assert_eq!(
        must(&m, "pdkv_weight_sync_failures_total"),
        3.0,
        "checksum, incomplete, transfer"
    );
    assert_eq!(
        must(&m, "pdkv_weight_sync_staged_bytes"),
        0.0,
        "the staging is freed"
    );
    // Over shared memory the server copied every byte itself: the
    // publisher's TCP agent served none.
    assert_eq!(good.bytes_served(), 0, "pulled over shared memory");
    fresh.stop().await;

    // The staging region is kept for the next sync, and freed by a sleep.
    let spare = must(&m, "pdkv_weight_sync_spare_bytes");
    assert!(spare >= good.manifest().bytes() as f64, "kept: {spare}");
    s.admin_ok(Method::POST, "/sleep?level=1", None).await;
    let m = s.metrics().await;
    assert_eq!(
        must(&m, "pdkv_weight_sync_spare_bytes"),
        0.0,
        "freed asleep"
    );
    s.admin_ok(Method::POST, "/wake_up", None).await;

    // A transport that does not exist is refused, naming the field; `tcp`
    // reads every byte from the publisher's agent once.
    let (status, v) = s
        .admin(
            Method::POST,
            "/init_weight_transfer_engine",
            Some(&json!({"init_info": {"url": good.url(), "transport": "rdma"}})),
        )
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "unknown transport");
    assert_eq!(v["error"]["param"], "init_info.transport", "{v}");
    let (_d3, third) = publisher(3, "v3").await;
    let init = json!({"init_info": {"url": third.url(), "transport": "tcp"}});
    let v = s
        .admin_ok(Method::POST, "/init_weight_transfer_engine", Some(&init))
        .await;
    assert_eq!(v["transport"], "tcp", "{v}");
    let v = s.admin_ok(Method::POST, "/start_weight_update", None).await;
    assert_eq!(v["transport"], "tcp", "{v}");
    let v = s.pull_weights_ok().await;
    assert_eq!(v["transport"], "tcp", "{v}");
    s.switch_synced(None).await;
    assert_eq!(
        third
            .bytes_served_reaching(third.manifest().bytes(), DEADLINE)
            .await,
        third.manifest().bytes(),
        "each byte read once"
    );
    let fresh = Server::start_admin_with("tiny", 3, Some(TOKEN), EngineConfig::default()).await;
    assert_eq!(
        s.probe().await,
        fresh.probe().await,
        "equal to a fresh server on seed 3"
    );
    fresh.stop().await;
    s.wait_all_blocks_free().await;
    s.stop().await;
}

/// A sync into a model split over 2 ranks: each rank takes its cut of the
/// staged whole weights, and the answers equal a whole fresh server's on
/// the new checkpoint.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_weight_sync_into_a_split_model_matches_a_fresh_whole_server() {
    let tp2 = EngineConfig {
        tensor_parallel_size: 2,
        ..EngineConfig::default()
    };
    let s = Server::start_admin_with("tiny", 7, Some(TOKEN), tp2).await;
    let seed7 = s.probe().await;
    let (_d2, good) = publisher(2, "v2").await;
    s.begin_sync(&good.url()).await;
    s.pull_weights_ok().await;
    s.switch_synced(Some(&json!({"version": "tp-v2"}))).await;
    let info = s.admin_ok(Method::GET, "/weight_info", None).await;
    assert_eq!(
        info["version"], "tp-v2",
        "the finish body's version: {info}"
    );
    let synced = s.probe().await;
    assert_ne!(synced, seed7);
    let fresh = Server::start_admin_with("tiny", 2, Some(TOKEN), EngineConfig::default()).await;
    assert_eq!(synced, fresh.probe().await);
    fresh.stop().await;
    s.wait_all_blocks_free().await;
    s.stop().await;
}
