//! Prefill/decode disaggregation end to end with real processes: a prefill
//! server (P), a decode server (D) and `pdkv proxy`, against one colocated
//! server, on SmolLM2.
//!
//! - 40 prompts sharing prefixes (so D also serves parts of prompts from
//!   its own prefix cache and loads only the rest), half streamed, half
//!   not, over TCP and over shared memory: every greedy output through the
//!   proxy equals the colocated one, every request loaded its KV from P, and
//!   afterwards P and D are idle with every block free.
//! - A client that disconnects from the proxy mid-stream: P and D free
//!   every block.
//! - P killed while D waits for its KV: D's request fails with a clear
//!   error by its deadline (policy `fail`), and D is idle afterwards.
//! - One of two decode servers killed while it computes non-streamed
//!   requests: the proxy sends them again, whole, to the other one.

use std::time::{Duration, Instant};

use futures::StreamExt;
use pdkv_deploy::{EngineRole, Transport};
use pdkv_testkit::{
    deploy::{Pd, Spec},
    http::{self, complete, wait_healthy, wait_metrics},
    models::smollm2,
    prom::{self, metric, quiescent},
    DEADLINE,
};
use serde_json::{json, Value};

const PREFIXES: [&str; 10] = [
    "You are a careful assistant who answers in one short sentence. The library opens at nine and closes at five on weekdays.",
    "Background: the river Thames flows through London and reaches the North Sea after passing many bridges and docks.",
    "Recipe notes: to bake bread you need flour, water, salt and yeast, then patience while the dough rises twice.",
    "System report: the server rack in room four has twelve machines, two switches and a backup battery unit.",
    "Story so far: a young fox lived at the edge of a forest and every morning watched the farmer feed his hens.",
    "Physics primer: light travels at about three hundred thousand kilometres per second in a vacuum, slower in glass.",
    "Travel guide: the old town has narrow streets, a cathedral with a green roof and a market every Saturday.",
    "Meeting minutes: the team agreed to ship the release on Friday after fixing the login bug and updating docs.",
    "Garden diary: tomatoes need sun and regular water, while mint spreads quickly and is best kept in a pot.",
    "History lesson: the printing press made books cheaper and helped spread reading across Europe within decades.",
];

const QUESTIONS: [&str; 4] = [
    " Question: what is this about? Answer:",
    " Summarise it in five words:",
    " The most important detail is",
    " Give it a title:",
];

/// A prompt long enough to keep P busy prefilling for a while.
fn long_prompt() -> String {
    PREFIXES
        .iter()
        .cycle()
        .take(30)
        .cloned()
        .collect::<Vec<_>>()
        .join(" ")
}

/// What `p`'s `/kv_transfer/info` answers.
async fn kv_info(client: &reqwest::Client, p: &pdkv_testkit::proc::Proc) -> Value {
    http::get_json(client, &p.url("/kv_transfer/info")).await.1
}

/// Each prefix with each question: 40 prompts, each prefix shared by 4.
fn prompts() -> Vec<String> {
    PREFIXES
        .iter()
        .flat_map(|p| QUESTIONS.iter().map(move |q| format!("{p}{q}")))
        .collect()
}

fn body(prompt: &str, stream: bool) -> Value {
    json!({"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream})
}

/// Runs every prompt against `base`, 8 at a time; request `i` streams when
/// `i` is odd. Returns the texts in prompt order.
async fn run_all(client: &reqwest::Client, base: &str, prompts: &[String]) -> Vec<String> {
    let results = futures::stream::iter(prompts.iter().enumerate().map(|(i, p)| {
        let (client, base, body) = (client.clone(), base.to_string(), body(p, i % 2 == 1));
        async move { (i, complete(&client, &base, &body).await) }
    }))
    .buffer_unordered(8)
    .collect::<Vec<_>>()
    .await;
    let mut out = vec![String::new(); prompts.len()];
    for (i, r) in results {
        out[i] = r.unwrap_or_else(|e| panic!("prompt {i} failed: {e:?}"));
    }
    out
}

/// P, D and the proxy on `model` (256 KV blocks each) over `transport`.
fn deploy(model: &std::path::Path, transport: Transport) -> Pd {
    Spec::new(model, 256).transport(transport).start_pd()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn pd_through_the_proxy_equals_colocated_over_tcp_and_shm() {
    let Some(model) = smollm2("pd_through_the_proxy_equals_colocated_over_tcp_and_shm") else {
        return;
    };
    let client = reqwest::Client::new();
    let prompts = prompts();

    let colo = Spec::new(&model, 256).start_engine(EngineRole::Colocated, "c0");
    wait_healthy(&client, &colo.url("/health")).await;
    let expected = run_all(&client, &colo.base, &prompts).await;
    assert!(
        expected.iter().any(|t| !t.trim().is_empty()),
        "the reference produced no text"
    );
    drop(colo);

    for transport in [Transport::Tcp, Transport::Shm] {
        let dep = deploy(&model, transport);
        wait_healthy(&client, &dep.proxy.url("/health")).await;
        let t0 = Instant::now();
        let got = run_all(&client, &dep.proxy.base, &prompts).await;
        let secs = t0.elapsed().as_secs_f64();
        for (i, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_eq!(
                g, e,
                "{transport:?}: prompt {i} differs from the colocated output"
            );
        }
        let p_text = wait_metrics(&client, &dep.p.base, "P quiescent", quiescent).await;
        let d_text = wait_metrics(&client, &dep.d.base, "D quiescent", quiescent).await;
        // Every request's KV came from P (D computed only the rest).
        let loads =
            metric(&d_text, "pdkv_kv_loads_ok_total").expect("D exports pdkv_kv_loads_ok_total");
        let sends =
            metric(&p_text, "pdkv_kv_pulls_ok_total").expect("P exports pdkv_kv_pulls_ok_total");
        assert_eq!(loads, prompts.len() as f64, "{transport:?}: loads on D");
        assert_eq!(sends, prompts.len() as f64, "{transport:?}: sends on P");
        assert_eq!(metric(&d_text, "pdkv_kv_loads_failed_total"), Some(0.0));
        println!(
            "{transport:?}: {} prompts through the proxy in {secs:.1} s, all equal to colocated",
            prompts.len()
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_client_leaving_mid_stream_frees_blocks_on_p_and_d() {
    let Some(model) = smollm2("a_client_leaving_mid_stream_frees_blocks_on_p_and_d") else {
        return;
    };
    let dep = deploy(&model, Transport::Tcp);
    let client = reqwest::Client::new();
    wait_healthy(&client, &dep.proxy.url("/health")).await;
    for (i, prefix) in PREFIXES.iter().enumerate().take(4) {
        let prompt = format!("{prefix} Request {i}: tell a long story about it.");
        let body = json!({"prompt": prompt, "max_tokens": 200, "temperature": 0, "stream": true, "ignore_eos": true});
        let resp = http::send(client.post(dep.proxy.url("/v1/completions")).json(&body)).await;
        assert_eq!(resp.status(), 200);
        let mut stream = resp.bytes_stream();
        // Wait for two events (the first text), then leave.
        let mut seen = String::new();
        while seen.matches("data: ").count() < 2 {
            let chunk = tokio::time::timeout(DEADLINE, stream.next())
                .await
                .expect("a chunk in time");
            seen.push_str(&String::from_utf8_lossy(
                &chunk.expect("stream open").unwrap(),
            ));
        }
        drop(stream);
    }
    wait_metrics(&client, &dep.p.base, "P quiescent", quiescent).await;
    let d = wait_metrics(&client, &dep.d.base, "D quiescent", quiescent).await;
    // D's requests ended by the disconnects, not by running to their end.
    assert_eq!(
        metric(&d, "pdkv_requests_total{finish_reason=\"length\"}"),
        Some(0.0),
        "{d}"
    );
}

/// Sends one request to P and D directly (as the proxy would) and kills P
/// once D waits for the KV. Returns D's status, body and how long it took.
/// P's pull deadline 2 s, D's own wait 4 s, and D's failure `policy`.
fn short_deadlines(model: &std::path::Path, policy: &str) -> Spec {
    Spec::new(model, 256)
        .kv("abort_timeout_s", 2)
        .kv("load_timeout_s", 4)
        .kv("kv_load_failure_policy", policy)
}

async fn kill_p_while_d_waits(model: &std::path::Path, policy: &str) -> (u16, String, Duration) {
    let spec = short_deadlines(model, policy);
    let mut p = spec.start_engine(EngineRole::Prefill, "p0");
    let d = spec.start_engine(EngineRole::Decode, "d0");
    let client = reqwest::Client::new();
    let info = kv_info(&client, &p).await;
    // A long prompt keeps P busy prefilling for a while.
    let prompt = long_prompt();
    let p_req = client.post(p.url("/v1/completions")).json(&json!({
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "t-kill"},
    }));
    let d_body = json!({
        "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": info["engine_id"],
                               "remote_bootstrap_addr": info["bootstrap_addr"], "transfer_id": "t-kill"},
    });
    let p_task = tokio::spawn(async move { p_req.send().await.map(|r| r.status().as_u16()) });
    let d_task = tokio::spawn({
        let (client, url) = (client.clone(), d.url("/v1/completions"));
        async move {
            let r = client.post(url).json(&d_body).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap(), Instant::now())
        }
    });
    wait_metrics(&client, &d.base, "D waiting for remote KV", |t| {
        metric(t, "pdkv_num_requests_waiting_for_remote_kv") == Some(1.0)
    })
    .await;
    let killed = Instant::now();
    p.kill();
    assert!(
        p_task.await.unwrap().is_err(),
        "P's request cannot succeed: P was killed"
    );
    let (status, text, at) = tokio::time::timeout(DEADLINE, d_task)
        .await
        .expect("D answers in time")
        .unwrap();
    wait_metrics(&client, &d.base, "D quiescent", quiescent).await;
    (status, text, at - killed)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn p_killed_while_d_waits_fails_or_recomputes_by_policy() {
    let Some(model) = smollm2("p_killed_while_d_waits_fails_or_recomputes_by_policy") else {
        return;
    };
    let (status, text, took) = kill_p_while_d_waits(&model, "fail").await;
    assert_eq!(status, 500, "{text}");
    assert!(text.contains("kv_transfer_failed"), "{text}");
    // D's own wait is 4 s; a dead P is noticed sooner (its socket closes).
    assert!(took < Duration::from_secs(5), "took {took:?}");
    println!("policy fail: D answered {took:?} after P was killed: {text}");

    let (status, text, took) = kill_p_while_d_waits(&model, "recompute").await;
    assert_eq!(status, 200, "{text}");
    assert!(took < Duration::from_secs(60), "took {took:?}");
    println!("policy recompute: D answered {took:?} after P was killed");
}

/// P hangs (SIGSTOP) while D waits for its KV: D gives up `load_timeout_s`
/// after it last heard from P and answers 504 `kv_transfer_timeout`, whose
/// message names the setting to raise; P, resumed, finishes and both
/// engines end quiescent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hung_p_is_a_504_naming_the_setting_to_raise() {
    let Some(model) = smollm2("a_hung_p_is_a_504_naming_the_setting_to_raise") else {
        return;
    };
    let spec = short_deadlines(&model, "fail");
    let p = spec.start_engine(EngineRole::Prefill, "p0");
    let d = spec.start_engine(EngineRole::Decode, "d0");
    let client = reqwest::Client::builder()
        .timeout(DEADLINE)
        .build()
        .unwrap();
    let info = kv_info(&client, &p).await;
    let prompt = long_prompt();
    let p_req = client.post(p.url("/v1/completions")).json(&json!({
        "prompt": prompt, "max_tokens": 1, "temperature": 0,
        "kv_transfer_params": {"do_remote_decode": true, "transfer_id": "t-hung"},
    }));
    let d_req = client.post(d.url("/v1/completions")).json(&json!({
        "prompt": prompt, "max_tokens": 4, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": true, "remote_engine_id": info["engine_id"],
                               "remote_bootstrap_addr": info["bootstrap_addr"], "transfer_id": "t-hung"},
    }));
    let p_task = tokio::spawn(async move { p_req.send().await.map(|r| r.status().as_u16()) });
    let d_task = tokio::spawn(async move {
        let r = d_req.send().await.unwrap();
        (r.status().as_u16(), r.text().await.unwrap())
    });
    wait_metrics(&client, &d.base, "D waiting for remote KV", |t| {
        metric(t, "pdkv_num_requests_waiting_for_remote_kv") == Some(1.0)
    })
    .await;
    let pid = p.pid() as libc::pid_t;
    // SAFETY: plain syscalls on our own child, not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let stopped = Instant::now();
    let answered = tokio::time::timeout(DEADLINE, d_task)
        .await
        .expect("D answers in time")
        .unwrap();
    let took = stopped.elapsed();
    // SAFETY: the same child, still not reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let (status, text) = answered;
    assert_eq!(status, 504, "{text}");
    let body: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(body["error"]["code"], "kv_transfer_timeout", "{text}");
    assert_eq!(body["error"]["type"], "timeout_error", "{text}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("load_timeout_s"),
        "{text}"
    );
    assert!(
        took >= Duration::from_secs(2) && took < Duration::from_secs(30),
        "D gave up after {took:?}"
    );
    println!("hung P: D answered 504 {took:?} after P stopped: {text}");
    assert_eq!(
        p_task.await.unwrap().ok(),
        Some(200),
        "P, resumed, finishes its request"
    );
    wait_metrics(&client, &d.base, "D quiescent", quiescent).await;
    wait_metrics(&client, &p.base, "P quiescent", quiescent).await;
}

/// D refuses a request (it is paused) after P already computed the KV: the
/// proxy tells P to drop the transfer, so P frees the blocks at once instead
/// of holding them for the whole lease (30 s by default).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transfer_whose_decode_request_failed_is_dropped_at_p() {
    let Some(model) = smollm2("a_transfer_whose_decode_request_failed_is_dropped_at_p") else {
        return;
    };
    // The proxy passes D's refusal on at once instead of holding the
    // request until D serves again.
    let Pd { p, d, proxy } = Spec::new(&model, 256)
        .serve_args(&["--admin-token", "t0k"])
        .http_args(&["--pause-wait-timeout-s", "0"])
        .start_pd();
    let client = reqwest::Client::new();
    wait_healthy(&client, &proxy.url("/health")).await;
    let paused = http::send(client.post(d.url("/pause?mode=abort")).bearer_auth("t0k")).await;
    assert!(paused.status().is_success(), "{:?}", paused.text().await);
    for (i, prefix) in PREFIXES.iter().enumerate().take(3) {
        let r = client
            .post(proxy.url("/v1/completions"))
            .json(&body(&format!("{prefix} {i}"), false))
            .send()
            .await;
        let r = r.unwrap();
        assert_eq!(r.status(), 503, "D is paused: {:?}", r.text().await);
    }
    let t0 = Instant::now();
    wait_metrics(&client, &p.base, "P holds nothing", quiescent).await;
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "P held the KV for {:?}",
        t0.elapsed()
    );
}

/// One of two decode servers killed (SIGKILL) while it computes
/// non-streamed requests: the proxy has sent nothing of them to their
/// clients yet, so it sends them again, whole, to the decode server left,
/// and every client gets the whole answer, equal to the one before the
/// kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_survive_their_decode_server_killed_before_it_answered() {
    let dir = pdkv_testkit::models::checkpoint(pdkv_model::Arch::Llama, "small", 11);
    let spec = Spec::new(dir.path(), 512);
    let p = spec.start_engine(EngineRole::Prefill, "p0");
    let mut d0 = spec.start_engine(EngineRole::Decode, "d0");
    let d1 = spec.start_engine(EngineRole::Decode, "d1");
    let proxy = spec.start_proxy(&[&p], &[&d0, &d1]);
    let client = reqwest::Client::new();
    let body = json!({"prompt": "The river ran on and on", "max_tokens": 600,
                      "temperature": 0, "ignore_eos": true});
    let send = |body: Value| {
        let (client, url) = (client.clone(), proxy.url("/v1/completions"));
        async move {
            let resp = http::send(client.post(url).json(&body)).await;
            let status = resp.status().as_u16();
            let v: Value = resp.json().await.unwrap();
            (status, v)
        }
    };
    let (status, first) = send(body.clone()).await;
    assert_eq!(status, 200, "{first}");
    let want = first["choices"][0]["text"].clone();

    let requests: Vec<_> = (0..8).map(|_| tokio::spawn(send(body.clone()))).collect();
    // Kill d0 once it runs one of them (a bounded wait on its gauge).
    http::wait_metrics(&client, &d0.base, "d0 runs a request", |m| {
        prom::metric(m, "pdkv_num_requests_running").is_some_and(|v| v >= 1.0)
    })
    .await;
    d0.kill();
    for r in requests {
        let (status, v) = tokio::time::timeout(DEADLINE, r)
            .await
            .expect("answered in time")
            .expect("the request task");
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            v["choices"][0]["text"], want,
            "the whole answer, as before the kill: {}",
            v["choices"][0]["finish_reason"]
        );
    }
    let m = http::metrics(&client, &proxy.base).await;
    let lost = prom::sums_by_label(&m, "pdkv_proxy_upstream_errors_total", "role");
    assert!(
        lost.get("decode").is_some_and(|&v| v >= 1.0),
        "the proxy saw d0 go:\n{m}"
    );
}

/// One of two decode servers killed (SIGKILL) in the middle of the streams
/// it serves: the proxy resumes each on the decode server left with the
/// tokens its client already has, and every client reads one unbroken
/// stream (one id, no comment or error events) whose text equals the
/// uninterrupted answer, with usage counting every token once. d0 is
/// paused (its requests kept) before the kill, so its streams are
/// mid-way when it dies whatever the machine's speed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn streams_survive_their_decode_server_killed_mid_stream() {
    let dir = pdkv_testkit::models::checkpoint(pdkv_model::Arch::Llama, "small", 11);
    let body = json!({"prompt": "The river ran on and on", "max_tokens": 700,
                      "temperature": 0, "ignore_eos": true});
    kill_d0_mid_stream(dir.path(), "/v1/completions", body).await;
}

/// The same for chat streams on SmolLM2: the resumed server sends no
/// second role chunk, and the content is the uninterrupted answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_streams_survive_their_decode_server_killed_mid_stream() {
    let Some(model) = smollm2("chat_streams_survive_their_decode_server_killed_mid_stream") else {
        return;
    };
    let body = json!({"messages": [{"role": "user", "content": "Tell me about rivers."}],
                      "max_tokens": 96, "temperature": 0, "ignore_eos": true});
    kill_d0_mid_stream(&model, "/v1/chat/completions", body).await;
}

/// 1P2D behind the proxy; `body` once whole, then four times streamed while
/// d0 is paused and killed: each stream must equal the whole answer.
async fn kill_d0_mid_stream(model: &std::path::Path, path: &str, body: Value) {
    let spec = Spec::new(model, 512).serve_args(&["--admin-token", "t0k"]);
    let p = spec.start_engine(EngineRole::Prefill, "p0");
    let mut d0 = spec.start_engine(EngineRole::Decode, "d0");
    let d1 = spec.start_engine(EngineRole::Decode, "d1");
    let proxy = spec.start_proxy(&[&p], &[&d0, &d1]);
    let client = reqwest::Client::new();
    let max_tokens = body["max_tokens"].as_u64().unwrap();
    let resp = http::send(client.post(proxy.url(path)).json(&body)).await;
    assert_eq!(resp.status(), 200);
    let whole: Value = resp.json().await.unwrap();
    let want = pdkv_testkit::sse::choice_text(&whole);
    assert_eq!(whole["usage"]["completion_tokens"], max_tokens, "{whole}");

    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    streamed["stream_options"] = json!({"include_usage": true});
    let mut readers = Vec::new();
    for _ in 0..4 {
        let resp = http::send(client.post(proxy.url(path)).json(&streamed)).await;
        assert_eq!(resp.status(), 200);
        let mut r = pdkv_testkit::sse::Reader::new(resp);
        let first = r.next_json().await;
        readers.push((r, first));
    }
    http::wait_metrics(&client, &d0.base, "d0 runs a stream", |m| {
        prom::metric(m, "pdkv_num_requests_running").is_some_and(|v| v >= 1.0)
    })
    .await;
    let paused = http::send(client.post(d0.url("/pause?mode=keep")).bearer_auth("t0k")).await;
    assert!(paused.status().is_success(), "{:?}", paused.text().await);
    d0.kill();
    for (mut r, first) in readers {
        let id = first["id"].clone();
        let mut text = pdkv_testkit::sse::choice_text(&first);
        let (mut usage, mut roles) = (None, 0);
        roles += usize::from(first["choices"][0]["delta"]["role"].is_string());
        let mut rest = r.rest().await;
        assert_eq!(rest.pop().as_deref(), Some("[DONE]"));
        for p in rest {
            let v: Value = serde_json::from_str(&p).unwrap_or_else(|e| panic!("{e}: {p}"));
            assert!(v.get("error").is_none(), "the stream failed: {v}");
            assert_eq!(v["id"], id, "one stream, one id");
            text.push_str(&pdkv_testkit::sse::choice_text(&v));
            roles += usize::from(v["choices"][0]["delta"]["role"].is_string());
            if !v["usage"].is_null() {
                usage = Some(v["usage"].clone());
            }
        }
        assert_eq!(text, want, "the stream's text is the uninterrupted answer");
        assert!(roles <= 1, "{roles} role chunks in one stream");
        let usage = usage.expect("a usage chunk");
        assert_eq!(usage["completion_tokens"], max_tokens, "{usage}");
    }
    let m = http::metrics(&client, &proxy.base).await;
    assert!(
        prom::metric(&m, "pdkv_proxy_requests_resumed_total").is_some_and(|v| v >= 1.0),
        "the proxy resumed d0's streams:\n{m}"
    );
    let outcomes = prom::sums_by_label(&m, "pdkv_proxy_requests_total", "outcome");
    assert_eq!(outcomes.get("ok").copied(), Some(5.0), "{m}");
}

/// `kv_transfer_params.resume_token_ids` continues a sequence after the
/// tokens another engine produced: with a seed at temperature 1 the
/// continuation equals the rest of the uninterrupted run (the sampler's
/// step carries over), its text is the rest of that run's text, usage
/// counts every token; the shapes it cannot continue are refused naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resume_token_ids_continue_a_seeded_sequence_exactly() {
    let dir = pdkv_testkit::models::checkpoint(pdkv_model::Arch::Llama, "small", 11);
    let s = Spec::new(dir.path(), 256).start_colocated();
    let client = reqwest::Client::new();
    let base = json!({"prompt": "The river ran on and on", "max_tokens": 40,
                      "temperature": 1.0, "seed": 5, "return_token_ids": true});
    let post = |body: Value| {
        let (client, url) = (client.clone(), s.url("/v1/completions"));
        async move {
            let resp = http::send(client.post(url).json(&body)).await;
            let status = resp.status().as_u16();
            (status, resp.json::<Value>().await.unwrap())
        }
    };
    let (status, whole) = post(base.clone()).await;
    assert_eq!(status, 200, "{whole}");
    let tokens = http::token_ids(&whole["choices"][0]["token_ids"]);
    let text = whole["choices"][0]["text"].as_str().unwrap().to_string();
    assert_eq!(tokens.len(), 40);
    for k in [1, 17, 39] {
        let mut body = base.clone();
        body["kv_transfer_params"] = json!({"resume_token_ids": tokens[..k]});
        let (status, v) = post(body).await;
        assert_eq!(status, 200, "{v}");
        assert_eq!(
            http::token_ids(&v["choices"][0]["token_ids"]),
            tokens[k..],
            "after {k} tokens"
        );
        let rest = v["choices"][0]["text"].as_str().unwrap();
        assert!(text.ends_with(rest), "after {k}: {rest:?} ends {text:?}");
        assert_eq!(v["usage"]["completion_tokens"], 40, "{v}");
    }
    for (extra, field) in [
        (json!({"n": 2}), "kv_transfer_params.resume_token_ids"),
        (json!({"echo": true}), "echo"),
        (
            json!({"kv_transfer_params": {"resume_token_ids": "5"}}),
            "kv_transfer_params.resume_token_ids",
        ),
    ] {
        let mut body = base.clone();
        body["kv_transfer_params"] = json!({"resume_token_ids": tokens[..3]});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, v) = post(body).await;
        assert_eq!(status, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], field, "{v}");
    }
    let mut body = base.clone();
    body["kv_transfer_params"] = json!({"resume_token_ids": tokens});
    let (status, v) = post(body).await;
    assert_eq!(status, 400, "nothing left to generate: {v}");
    assert!(http::error_message(&v).contains("max_tokens"), "{v}");
}
