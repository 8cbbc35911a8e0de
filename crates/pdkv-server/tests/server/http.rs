//! The HTTP server over real sockets, with a real (tiny, random-weight) model
//! and a running engine: request and response shapes, streaming, errors,
//! client disconnects and metrics.

use crate::common::{Listening, Server, DEADLINE, SERVED};
use futures::StreamExt;
use pdkv_engine::{Engine, EngineConfig};
use pdkv_model::Arch;
use pdkv_server::AppState;
use pdkv_testkit::{http, sse};
use pdkv_testkit::{http::assert_openai_error, prom::must};
use pdkv_vmem::Pool;
use reqwest::StatusCode;
use serde_json::{json, Value};

impl Server {
    async fn start() -> Server {
        Server::start_with(EngineConfig::default()).await
    }

    async fn start_with(config: EngineConfig) -> Server {
        Server::start_model("tiny", config).await
    }

    /// A server for a random checkpoint of `preset` (seed 7), admin API off.
    async fn start_model(preset: &str, config: EngineConfig) -> Server {
        Server::spawn(preset, 7, None, config).await
    }

    async fn post_raw(&self, path: &str, body: Vec<u8>) -> (StatusCode, Value) {
        http::post_raw(&self.client, &self.url(path), body).await
    }

    /// Posts a streaming request and returns the `data:` payloads, `[DONE]` included.
    async fn post_stream(&self, path: &str, body: &Value) -> Vec<String> {
        let resp = http::send(self.client.post(self.url(path)).json(body)).await;
        assert_eq!(resp.status(), StatusCode::OK);
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        let text = resp.text().await.expect("body");
        sse::payloads(&text)
    }

    /// Posts a streaming request and returns its JSON events, checking it
    /// ends with `[DONE]` (left out).
    async fn post_events(&self, path: &str, body: &Value) -> Vec<Value> {
        let events = self.post_stream(path, body).await;
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        events[..events.len() - 1]
            .iter()
            .map(|e| serde_json::from_str(e).expect("a JSON event"))
            .collect()
    }
}

fn greedy(extra: Value) -> Value {
    let mut v = json!({"temperature": 0, "max_tokens": 6, "ignore_eos": true});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_text_tokens_and_stream_agree() {
    let s = Server::start().await;
    let prompt = "The quick brown fox";
    let (status, body) = s
        .post(
            "/v1/completions",
            &greedy(json!({"prompt": prompt, "model": SERVED})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "text_completion");
    assert_eq!(body["model"], SERVED);
    assert!(body["id"].as_str().unwrap().starts_with("cmpl-"));
    assert!(body["created"].as_u64().unwrap() > 0);
    let choice = &body["choices"][0];
    assert_eq!(choice["index"], 0);
    assert_eq!(choice["finish_reason"], "length");
    assert!(choice["logprobs"].is_null());
    let text = choice["text"].as_str().unwrap().to_string();
    let ids = s.engine.tokenizer().encode(prompt, true).unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    assert_eq!(body["usage"]["completion_tokens"], 6);
    assert_eq!(body["usage"]["total_tokens"], ids.len() + 6);

    // The same prompt as token ids (and as a list of one string) gives the same greedy text.
    for prompt in [json!(ids), json!([ids]), json!([prompt])] {
        let (status, again) = s
            .post("/v1/completions", &greedy(json!({"prompt": prompt})))
            .await;
        assert_eq!(status, StatusCode::OK, "{again}");
        assert_eq!(
            again["choices"][0]["text"],
            text.as_str(),
            "prompt {prompt}"
        );
    }

    // Streaming: the chunks add up to the same text, then usage, then [DONE].
    let chunks = s.post_events("/v1/completions", &greedy(json!({"prompt": prompt, "stream": true, "stream_options": {"include_usage": true}}))).await;
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 6);
    let mut streamed = String::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "text_completion");
        assert!(c["usage"].is_null());
        streamed.push_str(c["choices"][0]["text"].as_str().unwrap());
    }
    assert_eq!(streamed, text);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert!(chunks[..chunks.len() - 2]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));

    // `stream_options` given: a usage chunk unless it says otherwise
    // (vLLM's default); with continuous_usage_stats every chunk carries its
    // choice's usage so far.
    let chunks = s
        .post_events(
            "/v1/completions",
            &greedy(json!({"prompt": prompt, "stream": true, "n": 2,
        "return_token_ids": true, "stream_options": {"continuous_usage_stats": true}})),
        )
        .await;
    let (last, body) = chunks.split_last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 12);
    let mut so_far = [0usize; 2];
    for c in body {
        let i = c["choices"][0]["index"].as_u64().unwrap() as usize;
        so_far[i] += c["choices"][0]["token_ids"].as_array().unwrap().len();
        assert_eq!(c["usage"]["completion_tokens"], so_far[i], "{c}");
        assert_eq!(c["usage"]["prompt_tokens"], last["usage"]["prompt_tokens"]);
    }
    assert_eq!(so_far, [6, 6]);

    // Without include_usage there is no usage chunk.
    let events = s
        .post_stream(
            "/v1/completions",
            &greedy(json!({"prompt": prompt, "stream": true})),
        )
        .await;
    let last: Value = serde_json::from_str(&events[events.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last.get("usage").is_none());
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_completions_stream_and_not() {
    let s = Server::start().await;
    let messages = json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Say hi"}]},
    ]);
    let (status, body) = s
        .post(
            "/v1/chat/completions",
            &greedy(json!({"messages": messages})),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{body}");
    assert_eq!(body["object"], "chat.completion");
    assert!(body["id"].as_str().unwrap().starts_with("chatcmpl-"));
    let choice = &body["choices"][0];
    assert_eq!(choice["message"]["role"], "assistant");
    assert_eq!(choice["finish_reason"], "length");
    let content = choice["message"]["content"].as_str().unwrap().to_string();

    // The prompt is the rendered template tokenized without extra special tokens.
    let rendered = s
        .engine
        .chat_template()
        .unwrap()
        .render(
            &[
                pdkv_model::ChatMessage {
                    role: "system".into(),
                    content: "You are terse.".into(),
                    ..Default::default()
                },
                pdkv_model::ChatMessage {
                    role: "user".into(),
                    content: "Say hi".into(),
                    ..Default::default()
                },
            ],
            true,
        )
        .unwrap();
    let ids = s.engine.tokenizer().encode(&rendered, false).unwrap();
    assert_eq!(body["usage"]["prompt_tokens"], ids.len());
    let (_, raw) = s
        .post("/v1/completions", &greedy(json!({"prompt": ids})))
        .await;
    assert_eq!(raw["choices"][0]["text"], content.as_str());

    // max_completion_tokens takes precedence over max_tokens.
    let (_, short) = s
        .post(
            "/v1/chat/completions",
            &greedy(json!({"messages": messages, "max_completion_tokens": 2, "max_tokens": 5})),
        )
        .await;
    assert_eq!(short["usage"]["completion_tokens"], 2);

    // continue_final_message: the prompt ends right after the last message's
    // text (before the template closes its turn) and the answer goes on
    // from there, as a completion of that prompt does.
    let mut cont = messages.as_array().unwrap().clone();
    cont.push(json!({"role": "assistant", "content": "Hi, I am"}));
    let ask = greedy(
        json!({"messages": cont, "continue_final_message": true, "add_generation_prompt": false}),
    );
    let (status, v) = s.post("/v1/chat/completions", &ask).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let closed = s
        .engine
        .chat_template()
        .unwrap()
        .render(
            &[
                pdkv_model::ChatMessage::new("system", "You are terse."),
                pdkv_model::ChatMessage::new("user", "Say hi"),
                pdkv_model::ChatMessage::new("assistant", "Hi, I am"),
            ],
            false,
        )
        .unwrap();
    let end = closed.rfind("Hi, I am").unwrap() + "Hi, I am".len();
    assert!(
        end < closed.len(),
        "the template closes the turn: {closed:?}"
    );
    let ids = s.engine.tokenizer().encode(&closed[..end], false).unwrap();
    assert_eq!(v["usage"]["prompt_tokens"], ids.len(), "{v}");
    let (_, raw) = s
        .post("/v1/completions", &greedy(json!({"prompt": ids})))
        .await;
    assert_eq!(
        raw["choices"][0]["text"],
        v["choices"][0]["message"]["content"]
    );
    // `echo`: the answer starts with the continued message's text, whole
    // and streamed (a chunk after the role); a last message of another
    // role is not echoed.
    let mut echoed = ask.clone();
    echoed["echo"] = json!(true);
    let (_, e) = s.post("/v1/chat/completions", &echoed).await;
    let answer = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(
        e["choices"][0]["message"]["content"],
        format!("Hi, I am{answer}")
    );
    echoed["stream"] = json!(true);
    let chunks = s.post_events("/v1/chat/completions", &echoed).await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[1]["choices"][0]["delta"]["content"], "Hi, I am");
    let streamed: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, format!("Hi, I am{answer}"));
    let (_, plain) = s
        .post(
            "/v1/chat/completions",
            &greedy(json!({"messages": messages, "echo": true})),
        )
        .await;
    assert_eq!(plain["choices"][0]["message"]["content"], content.as_str());

    // /tokenize gives that prompt too; both endings at once are refused.
    let (_, t) = s
        .post(
            "/tokenize",
            &json!({"messages": cont, "continue_final_message": true, "add_generation_prompt": false}),
        )
        .await;
    assert_eq!(t["tokens"], json!(ids));
    let both = greedy(json!({"messages": cont, "continue_final_message": true}));
    let (status, v) = s.post("/v1/chat/completions", &both).await;
    assert_eq!(
        (status, &v["error"]["param"]),
        (StatusCode::BAD_REQUEST, &json!("add_generation_prompt")),
        "{v}"
    );

    let chunks = s.post_events("/v1/chat/completions", &greedy(json!({"messages": messages, "stream": true, "stream_options": {"include_usage": true}}))).await;
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut streamed = String::new();
    for c in &chunks[..chunks.len() - 1] {
        assert_eq!(c["object"], "chat.completion.chunk");
        if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
            streamed.push_str(t);
        }
    }
    assert_eq!(streamed, content);
    assert_eq!(
        chunks[chunks.len() - 2]["choices"][0]["finish_reason"],
        "length"
    );
    assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 6);
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_get_openai_errors() {
    // 8 blocks of 16 tokens: 128 tokens of KV, less than the model's context.
    let s = Server::start_with(EngineConfig {
        num_kv_blocks: 8,
        ..EngineConfig::default()
    })
    .await;
    let max_len = s.engine.max_model_len();
    assert!(
        max_len > 8 * 16 + 8,
        "the tiny model's context ({max_len}) must exceed the KV cache for this test"
    );
    let vocab = s.engine.model_config().vocab_size;
    let bad = StatusCode::BAD_REQUEST;
    let completions: Vec<(Value, StatusCode, Option<&str>)> = vec![
        (json!({"prompt": 5}), bad, Some("prompt")),
        (json!({"max_tokens": 3}), bad, None),
        (
            json!({"prompt": "a", "max_tokens": "x"}),
            bad,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": "a", "max_tokens": 0}),
            bad,
            Some("max_tokens"),
        ),
        (
            json!({"prompt": "a", "max_tokens": -3}),
            bad,
            Some("max_tokens"),
        ),
        (json!({"prompt": "a", "n": 0}), bad, Some("n")),
        (
            json!({"prompt": "a", "n": 2, "best_of": 4}),
            bad,
            Some("best_of"),
        ),
        (
            json!({"prompt": "a", "logprobs": 21}),
            bad,
            Some("logprobs"),
        ),
        (
            json!({"prompt": "a", "logit_bias": {vocab.to_string(): 1}}),
            bad,
            Some("logit_bias"),
        ),
        (
            json!({"prompt": "a", "stop_token_ids": [vocab]}),
            bad,
            Some("stop_token_ids"),
        ),
        (
            json!({"prompt": "a", "temperature": -1}),
            bad,
            Some("temperature"),
        ),
        (
            json!({"prompt": "a", "temperature": "hot"}),
            bad,
            Some("temperature"),
        ),
        (json!({"prompt": "a", "top_p": 1.5}), bad, Some("top_p")),
        (json!({"prompt": "a", "stop": 3}), bad, Some("stop")),
        (json!({"prompt": "a", "stream": "yes"}), bad, Some("stream")),
        (json!({"prompt": []}), bad, Some("prompt")),
        (json!({"prompt": ["a", 5]}), bad, Some("prompt")),
        (json!({"prompt": [1, vocab]}), bad, Some("prompt")),
        // Over the model's context.
        (
            json!({"prompt": "a", "max_tokens": max_len + 1}),
            bad,
            Some("prompt"),
        ),
        // Within the context, over the KV cache.
        (
            json!({"prompt": "a", "max_tokens": 8 * 16 + 1}),
            bad,
            Some("prompt"),
        ),
        (
            json!({"prompt": "a", "model": "nope"}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
    ];
    let chats: Vec<(Value, StatusCode, Option<&str>)> = vec![
        (json!({"messages": "hi"}), bad, Some("messages")),
        (json!({"messages": []}), bad, Some("messages")),
        (json!({"model": SERVED}), bad, None),
        (json!({"messages": [{"content": "x"}]}), bad, None),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
            bad,
            Some("messages[0].content"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "n": 200}),
            bad,
            Some("n"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
            bad,
            Some("max_completion_tokens"),
        ),
        (
            json!({"messages": [{"role": "user", "content": "x"}], "model": "nope"}),
            StatusCode::NOT_FOUND,
            Some("model"),
        ),
    ];
    let cases = (completions.into_iter().map(|c| ("/v1/completions", c)))
        .chain(chats.into_iter().map(|c| ("/v1/chat/completions", c)))
        .map(|(path, (body, want, param))| (path, body, want, param));
    for (path, body, want, param) in cases {
        let (status, resp) = s.post(path, &body).await;
        let ctx = format!("{path} {body}");
        assert_openai_error(status, &resp, want, &ctx);
        if let Some(p) = param {
            assert_eq!(resp["error"]["param"], p, "{ctx}: {resp}");
        }
    }
    let (status, resp) = s
        .post("/v1/completions", &json!({"prompt": "a", "model": "nope"}))
        .await;
    http::assert_error_code(status, &resp, StatusCode::NOT_FOUND, "model_not_found");

    for raw in [&b"{\"prompt\": "[..], b"not json", b"", b"[1,2]"] {
        let (status, resp) = s.post_raw("/v1/completions", raw.to_vec()).await;
        assert_openai_error(
            status,
            &resp,
            bad,
            &format!("raw {:?}", String::from_utf8_lossy(raw)),
        );
    }
    // Twice the 4 MiB body limit. The server reads the rest of a refused
    // body (within bounds) before it answers and closes the connection, so
    // the client writes all of it and then reads the 413, not a broken
    // pipe. The closed connection is also why this request gets a
    // connection of its own: the shared client's pool must not hand it to
    // the next request.
    let filler = serde_json::to_vec(&json!({"prompt": ""})).unwrap().len();
    let over = 2 * pdkv_server::MAX_BODY_BYTES - filler;
    let big = serde_json::to_vec(&json!({"prompt": "a".repeat(over)})).unwrap();
    assert_eq!(big.len(), 2 * pdkv_server::MAX_BODY_BYTES);
    let once = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let req = once
        .post(s.url("/v1/completions"))
        .header("content-type", "application/json")
        .body(big);
    let (status, resp) = http::answer(req).await;
    assert_openai_error(
        status,
        &resp,
        StatusCode::PAYLOAD_TOO_LARGE,
        "oversize body",
    );

    let resp = s.client.get(s.url("/v1/nothing")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::NOT_FOUND);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].is_string());
    let resp = s.client.get(s.url("/v1/completions")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::METHOD_NOT_ALLOWED);
    let v: Value = resp.json().await.unwrap();
    assert!(v["error"]["message"].is_string());

    // Nothing was admitted, and the server still works.
    let (status, ok) = s
        .post("/v1/completions", &greedy(json!({"prompt": "a"})))
        .await;
    assert_eq!(status, StatusCode::OK, "{ok}");
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_engine_is_503_and_unhealthy() {
    let s = Server::start().await;
    assert_eq!(s.health().await, StatusCode::OK);
    let ping = s.client.get(s.url("/ping")).send().await.unwrap();
    assert_eq!(ping.status(), StatusCode::OK);
    s.engine.shutdown();
    let (status, body) = s.post("/v1/completions", &json!({"prompt": "a"})).await;
    assert_openai_error(
        status,
        &body,
        StatusCode::SERVICE_UNAVAILABLE,
        "after shutdown",
    );
    assert_eq!(s.health().await, StatusCode::SERVICE_UNAVAILABLE);
    // `/ping`, vLLM's alias, answers as `/health` does, by GET or POST.
    let get = s.client.get(s.url("/ping")).send().await.unwrap();
    let post = s.client.post(s.url("/ping")).send().await.unwrap();
    assert_eq!(
        (get.status(), post.status()),
        (
            StatusCode::SERVICE_UNAVAILABLE,
            StatusCode::SERVICE_UNAVAILABLE
        )
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn models_health_and_memory_metrics() {
    let s = Server::start().await;
    let resp = s.client.get(s.url("/v1/models")).send().await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["object"], "list");
    assert_eq!(v["data"][0]["id"], SERVED);
    assert_eq!(v["data"][0]["object"], "model");
    assert_eq!(v["data"][0]["owned_by"], "pdkv");

    let (status, _) = s
        .post("/v1/completions", &greedy(json!({"prompt": "hello"})))
        .await;
    assert_eq!(status, StatusCode::OK);
    let m = s.wait_all_blocks_free().await;
    assert!(must(&m, "pdkv_device_memory_bytes{tag=\"weights\"}") > 0.0);
    assert!(must(&m, "pdkv_device_memory_bytes{tag=\"kv_cache\"}") > 0.0);
    must(&m, "pdkv_device_memory_bytes{tag=\"runtime\"}");
    assert_eq!(
        must(&m, "pdkv_requests_total{finish_reason=\"length\"}"),
        1.0
    );
    assert_eq!(must(&m, "pdkv_generation_tokens_total"), 6.0);
    assert_eq!(must(&m, "pdkv_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(must(&m, "pdkv_inter_token_latency_seconds_count"), 5.0);
    assert_eq!(
        must(&m, "pdkv_kv_blocks_total"),
        EngineConfig::default().num_kv_blocks as f64
    );
    for name in [
        "pdkv_prefix_cache_queries_total",
        "pdkv_prefix_cache_hits_total",
        "pdkv_prefix_cache_hit_rate",
        "pdkv_num_preemptions_total",
        "pdkv_kv_blocks_used",
    ] {
        must(&m, name);
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streaming_client_disconnect_aborts_and_frees_blocks() {
    let s = Server::start().await;
    let max_tokens = s.engine.max_model_len() - 16;
    let body = json!({"prompt": "a b c", "max_tokens": max_tokens, "ignore_eos": true, "stream": true, "temperature": 0});
    let resp = http::send(s.client.post(s.url("/v1/completions")).json(&body)).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let mut chunks = resp.bytes_stream();
    let first = tokio::time::timeout(DEADLINE, chunks.next())
        .await
        .expect("first chunk")
        .expect("a chunk")
        .unwrap();
    assert!(first.starts_with(b"data: "));
    drop(chunks);
    let m = s
        .wait_metrics("the disconnected request to be aborted", |m| {
            must(m, "pdkv_requests_total{finish_reason=\"abort\"}") == 1.0
        })
        .await;
    assert_eq!(
        must(&m, "pdkv_requests_total{finish_reason=\"length\"}"),
        0.0
    );
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_streaming_client_disconnect_aborts_and_frees_blocks() {
    use tokio::io::AsyncWriteExt;
    // The larger preset decodes slowly enough that the request is still
    // running long after the client left.
    let s = Server::start_model("small", EngineConfig::default()).await;
    let max_tokens = s.engine.max_model_len() - 16;
    let body = json!({"prompt": "a b c", "max_tokens": max_tokens, "ignore_eos": true}).to_string();
    let addr = s.base.strip_prefix("http://").unwrap();
    let mut sock = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = format!(
        "POST /v1/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
        body.len()
    );
    sock.write_all(head.as_bytes()).await.unwrap();
    sock.write_all(body.as_bytes()).await.unwrap();
    s.wait_metrics("the request to generate", |m| {
        must(m, "pdkv_generation_tokens_total") > 0.0
    })
    .await;
    drop(sock);
    let m = s
        .wait_metrics("the disconnected request to be aborted", |m| {
            must(m, "pdkv_requests_total{finish_reason=\"abort\"}") == 1.0
        })
        .await;
    assert!(must(&m, "pdkv_generation_tokens_total") < max_tokens as f64);
    s.wait_all_blocks_free().await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_32_concurrent_requests_frees_every_block() {
    let s = Server::start().await;
    let mut tasks = Vec::new();
    for i in 0..32u32 {
        let client = s.client.clone();
        let base = s.base.clone();
        tasks.push(tokio::spawn(async move {
            let stream = i % 2 == 0;
            let (path, mut body) = if i % 3 == 0 {
                (
                    "/v1/chat/completions",
                    json!({"messages": [{"role": "user", "content": format!("question {i}")}]}),
                )
            } else {
                (
                    "/v1/completions",
                    json!({"prompt": format!("prompt number {i} and")}),
                )
            };
            body["max_tokens"] = json!(4 + i % 7);
            body["ignore_eos"] = json!(true);
            body["seed"] = json!(i);
            body["stream"] = json!(stream);
            let resp = http::send(client.post(format!("{base}{path}")).json(&body)).await;
            assert_eq!(resp.status(), StatusCode::OK);
            let text = resp.text().await.unwrap();
            if stream {
                assert!(text.ends_with("data: [DONE]\n\n"), "{text}");
            } else {
                let v: Value = serde_json::from_str(&text).unwrap();
                assert_eq!(v["usage"]["completion_tokens"], 4 + i % 7);
            }
        }));
    }
    for t in tasks {
        tokio::time::timeout(DEADLINE, t)
            .await
            .expect("request finishes")
            .expect("request task");
    }
    let m = s.wait_all_blocks_free().await;
    let finished: f64 = ["stop", "length", "abort"]
        .iter()
        .map(|r| must(&m, &format!("pdkv_requests_total{{finish_reason=\"{r}\"}}")))
        .sum();
    assert_eq!(finished, 32.0);
    assert_eq!(
        must(&m, "pdkv_requests_total{finish_reason=\"length\"}"),
        32.0
    );
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_without_template_is_a_clear_400() {
    let dir = tempfile::tempdir().expect("tempdir");
    pdkv_model::init::write_random_checkpoint(Arch::Llama, "tiny", 3, dir.path())
        .expect("write checkpoint");
    let cfg_path = dir.path().join("tokenizer_config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg.as_object_mut()
        .unwrap()
        .remove("chat_template")
        .expect("the checkpoint has a template to remove");
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let pool = Pool::default();
    let model = pdkv_model::load_model(dir.path(), &pool, &mut |_| {}).expect("load model");
    assert!(model.chat_template.is_none());
    let engine = Engine::start(model, pool, EngineConfig::default()).expect("start engine");

    let state = AppState::new(engine.clone(), SERVED);
    let server =
        Listening::start(|listener, shutdown| pdkv_server::serve(listener, state, shutdown)).await;
    let base = server.base.clone();
    let client = reqwest::Client::new();
    let resp = http::send(
        client
            .post(format!("{base}/v1/chat/completions"))
            .json(&json!({"messages": [{"role": "user", "content": "hi"}]})),
    )
    .await;
    let status = resp.status();
    let body: Value = resp.json().await.unwrap();
    assert_openai_error(status, &body, StatusCode::BAD_REQUEST, "no chat template");
    assert!(
        http::error_message(&body).contains("chat template"),
        "{body}"
    );
    // Plain completions still work.
    let resp = http::send(
        client
            .post(format!("{base}/v1/completions"))
            .json(&greedy(json!({"prompt": "hi"}))),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    server.stop().await;
    engine.shutdown();
}
