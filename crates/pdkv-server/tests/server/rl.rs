//! What RL frameworks send besides plain completions: vLLM's token-in /
//! token-out `/inference/v1/generate`, the sampling fields they set, dev
//! mode, the pause semantics they rely on (new requests wait for
//! `/resume`; an `abort` pause ends requests with the tokens so far, which
//! a framework continues) and their own route dialects. Each effect is
//! checked against a reference computed another way (the same request
//! through `/v1/completions`, a greedy answer, the tokenizer).

use std::time::Duration;

use pdkv_engine::EngineConfig;
use pdkv_testkit::http::{self, assert_openai_error};
use pdkv_testkit::prom::must;
use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::common::{Server, Serving};

async fn dev_server(pause_wait: Duration) -> Server {
    let serving = Serving {
        pause_wait,
        dev_mode: true,
        ..Serving::default()
    };
    Server::spawn_serving("tiny", 7, None, EngineConfig::default(), serving).await
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("ids")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

const PROMPT: [u32; 12] = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100, 33];

async fn generate(s: &Server, body: Value) -> Value {
    let (status, v) = s.post("/inference/v1/generate", &body).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    v
}

/// `body` to `/inference/v1/generate` is refused with `want`, an error in
/// OpenAI's shape; the answer.
async fn generate_refused(s: &Server, body: &Value, want: StatusCode, ctx: &str) -> Value {
    let (status, v) = s.post("/inference/v1/generate", body).await;
    assert_openai_error(status, &v, want, ctx);
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generate_matches_completions_and_names_tokens_by_id() {
    let s = dev_server(Duration::ZERO).await;
    let g = generate(
        &s,
        json!({"token_ids": PROMPT, "model": crate::common::SERVED,
               "sampling_params": {"max_tokens": 8, "temperature": 0, "logprobs": 2, "ignore_eos": true}}),
    )
    .await;
    let (status, c) = s
        .post(
            "/v1/completions",
            &json!({"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 2,
                    "ignore_eos": true, "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{c}");
    let choice = &g["choices"][0];
    let tokens = ids(&choice["token_ids"]);
    assert_eq!(tokens, ids(&c["choices"][0]["token_ids"]));
    assert_eq!(tokens.len(), 8);
    assert_eq!(choice["finish_reason"], "length");
    assert_eq!(g["usage"]["prompt_tokens"], PROMPT.len());
    let content = choice["logprobs"]["content"].as_array().expect("content");
    let reference = c["choices"][0]["logprobs"]["token_logprobs"]
        .as_array()
        .unwrap();
    for (i, e) in content.iter().enumerate() {
        assert_eq!(e["token"], format!("token_id:{}", tokens[i]));
        assert_eq!(e["logprob"], reference[i], "position {i}");
        assert!(e["top_logprobs"].as_array().unwrap().len() <= 2);
        assert_eq!(e["top_logprobs"][0]["token"], e["token"]);
    }

    // Seeded groups reproduce choice by choice; a stream carries the same
    // tokens as the whole answer.
    let body = json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 1.5,
                      "seed": 11, "n": 3, "ignore_eos": true}});
    let a = generate(&s, body.clone()).await;
    let b = generate(&s, body.clone()).await;
    assert_eq!(a["choices"].as_array().unwrap().len(), 3);
    for i in 0..3 {
        assert_eq!(a["choices"][i]["token_ids"], b["choices"][i]["token_ids"]);
    }
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let resp = http::send(
        s.client
            .post(s.url("/inference/v1/generate"))
            .json(&streamed),
    )
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.unwrap();
    let mut per_choice = vec![Vec::new(); 3];
    for v in pdkv_testkit::sse::values(&text) {
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            per_choice[i].extend(ids(&c["token_ids"]));
        }
    }
    for i in 0..3 {
        assert_eq!(
            per_choice[i],
            ids(&a["choices"][i]["token_ids"]),
            "choice {i}"
        );
    }

    // prompt_logprobs: one entry per prompt token, the first null, each
    // holding the prompt token itself.
    let p = generate(
        &s,
        json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}),
    )
    .await;
    let plp = p["prompt_logprobs"].as_array().expect("prompt_logprobs");
    assert_eq!(plp.len(), PROMPT.len());
    assert!(plp[0].is_null());
    for (i, e) in plp.iter().enumerate().skip(1) {
        assert!(e.get(PROMPT[i].to_string()).is_some(), "position {i}: {e}");
    }
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn what_generate_cannot_do_is_a_400_naming_it() {
    let s = dev_server(Duration::ZERO).await;
    for (body, param) in [
        (json!({"token_ids": PROMPT, "cache_salt": ""}), "cache_salt"),
        (json!({"token_ids": PROMPT, "priority": 2}), "priority"),
        (
            json!({"token_ids": PROMPT, "features": {"mm_hashes": {}}}),
            "features",
        ),
        (
            json!({"token_ids": PROMPT, "sampling_params": {"use_beam_search": true}}),
            "sampling_params.use_beam_search",
        ),
        (json!({"token_ids": [1_000_000]}), "prompt"),
        (
            json!({"token_ids": PROMPT, "sampling_params": {"min_p": 2}}),
            "min_p",
        ),
    ] {
        let v = generate_refused(&s, &body, StatusCode::BAD_REQUEST, param).await;
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let other = json!({"token_ids": PROMPT, "model": "other"});
    generate_refused(&s, &other, StatusCode::NOT_FOUND, "unknown model").await;
    // Priority 0 and beam search off are what vLLM does by default.
    generate(
        &s,
        json!({"token_ids": PROMPT, "priority": 0,
               "sampling_params": {"max_tokens": 1, "use_beam_search": false}}),
    )
    .await;
    s.stop().await;
}

/// The text of a completion of `body`.
async fn text_of(s: &Server, body: Value) -> Value {
    let (status, v) = s.post("/v1/completions", &body).await;
    assert_eq!(status, StatusCode::OK, "{body}: {v}");
    v["choices"][0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_sampling_field_takes_effect() {
    let s = dev_server(Duration::ZERO).await;
    let base = json!({"prompt": "The river ran low", "max_tokens": 12, "ignore_eos": true,
                      "return_token_ids": true});
    let with = |extra: Value| {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    let greedy = text_of(&s, with(json!({"temperature": 0}))).await;

    // min_p = 1 keeps only the most likely token: sampling turns greedy.
    for seed in [1, 2, 3] {
        let c = text_of(
            &s,
            with(json!({"temperature": 1.0, "seed": seed, "min_p": 1.0})),
        )
        .await;
        assert_eq!(c["token_ids"], greedy["token_ids"], "seed {seed}");
    }

    // allowed_token_ids: nothing else is sampled, hot or greedy.
    let allowed = [101u32, 108, 111];
    for t in [0.0, 2.0] {
        let c = text_of(
            &s,
            with(json!({"temperature": t, "seed": 5, "allowed_token_ids": allowed})),
        )
        .await;
        assert!(
            ids(&c["token_ids"]).iter().all(|t| allowed.contains(t)),
            "{c}"
        );
    }

    // Stop strings: cut before the match, or after it with
    // include_stop_str_in_output; the reference is the greedy text.
    let full = greedy["text"].as_str().unwrap().to_string();
    let chars: Vec<char> = full.chars().collect();
    assert!(chars.len() >= 8, "greedy text too short to cut: {full:?}");
    let stop: String = chars[4..6].iter().collect();
    let at = full.find(&stop).unwrap();
    let cut = text_of(&s, with(json!({"temperature": 0, "stop": [stop.clone()]}))).await;
    assert_eq!(cut["text"], full[..at], "stop {stop:?}");
    assert_eq!(cut["finish_reason"], "stop");
    let kept = text_of(
        &s,
        with(json!({"temperature": 0, "stop": [stop.clone()], "include_stop_str_in_output": true})),
    )
    .await;
    assert_eq!(kept["text"], full[..at + stop.len()], "stop {stop:?}");

    // skip_special_tokens: a generation of special tokens only shows them
    // when asked; the reference is the tokenizer's own decoding.
    let tok = s.engine.tokenizer().clone();
    let vocab = s.engine.model_config().vocab_size as u32;
    let special = vocab - 1;
    let shown = tok.decode(&[special], false);
    assert!(!shown.is_empty() && tok.decode(&[special], true).is_empty());
    let only_special = json!({"temperature": 0, "allowed_token_ids": [special], "max_tokens": 3});
    let hidden = text_of(&s, with(only_special.clone())).await;
    assert_eq!(hidden["text"], "");
    let mut keep = only_special;
    keep["skip_special_tokens"] = json!(false);
    let visible = text_of(&s, with(keep)).await;
    assert_eq!(visible["text"], shown.repeat(3));

    // truncate_prompt_tokens keeps the prompt's last k tokens: the same
    // answer as those k tokens sent as the prompt.
    let all = greedy["prompt_token_ids"].clone();
    let k = 3;
    let tail: Vec<u32> = ids(&all)[ids(&all).len() - k..].to_vec();
    let truncated = text_of(
        &s,
        with(json!({"temperature": 0, "truncate_prompt_tokens": k})),
    )
    .await;
    assert_eq!(truncated["prompt_token_ids"], json!(tail));
    let direct = text_of(
        &s,
        json!({"prompt": tail, "max_tokens": 12, "ignore_eos": true, "temperature": 0,
               "return_token_ids": true}),
    )
    .await;
    assert_eq!(truncated["token_ids"], direct["token_ids"]);

    // add_special_tokens: the prompt's ids are the tokenizer's with or
    // without its special tokens.
    for add in [true, false] {
        let c = text_of(
            &s,
            with(json!({"temperature": 0, "add_special_tokens": add, "max_tokens": 1})),
        )
        .await;
        let want = tok.encode("The river ran low", add).unwrap();
        assert_eq!(
            ids(&c["prompt_token_ids"]),
            want,
            "add_special_tokens {add}"
        );
    }

    // return_tokens_as_token_ids in both shapes (AReaL parses `token_id:N`).
    let c = text_of(
        &s,
        with(json!({"temperature": 0, "logprobs": 0, "return_tokens_as_token_ids": true})),
    )
    .await;
    let named: Vec<String> = c["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = ids(&c["token_ids"])
        .iter()
        .map(|t| format!("token_id:{t}"))
        .collect();
    assert_eq!(named, want);
    let (status, chat) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "temperature": 0, "logprobs": true, "return_tokens_as_token_ids": true,
                    "return_token_ids": true}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{chat}");
    let tokens: Vec<String> = chat["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    let want: Vec<String> = ids(&chat["choices"][0]["token_ids"])
        .iter()
        .map(|t| format!("token_id:{t}"))
        .collect();
    assert_eq!(tokens, want);

    // max_tokens 0 with echo scores the prompt: its log-probabilities, as
    // generate's prompt_logprobs gives them, and nothing generated.
    let scored = text_of(
        &s,
        json!({"prompt": PROMPT, "max_tokens": 0, "echo": true, "logprobs": 0}),
    )
    .await;
    let plp = generate(
        &s,
        json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": 1, "prompt_logprobs": 0}}),
    )
    .await["prompt_logprobs"]
        .clone();
    let lps = scored["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(lps.len(), PROMPT.len(), "{scored}");
    assert!(lps[0].is_null());
    for i in 1..PROMPT.len() {
        assert_eq!(
            lps[i],
            plp[i][PROMPT[i].to_string()]["logprob"],
            "position {i}"
        );
    }
    assert_eq!(scored["text"], tok.decode(&PROMPT, false));
    let (status, v) = s
        .post("/v1/completions", &json!({"prompt": "x", "max_tokens": 0}))
        .await;
    assert_openai_error(
        status,
        &v,
        StatusCode::BAD_REQUEST,
        "max_tokens 0 without echo",
    );

    // A field vLLM does not know is ignored and counted; one it knows but
    // pdkv does not implement is refused when it would change the answer.
    let c = text_of(&s, with(json!({"temperature": 0, "my_own_field": 1}))).await;
    assert_eq!(c["token_ids"], greedy["token_ids"]);
    let m = s.metrics().await;
    assert_eq!(
        must(
            &m,
            "pdkv_ignored_request_fields_total{field=\"my_own_field\"}"
        ),
        1.0
    );
    let (status, v) = s
        .post("/v1/completions", &with(json!({"bad_words": ["x"]})))
        .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "bad_words");
    assert_eq!(v["error"]["param"], "bad_words");
    s.stop().await;
}

/// Polls until `n` requests wait for `/resume`: before admission, or
/// (a `keep` pause admits them) in the engine's frozen queue.
async fn wait_waiting(s: &Server, n: f64) {
    s.wait_metrics(&format!("{n} requests waiting for /resume"), |m| {
        must(m, "pdkv_requests_waiting_for_resume") + must(m, "pdkv_num_requests_waiting") == n
    })
    .await;
}

async fn post_dev(s: &Server, path: &str, body: Option<Value>) -> Value {
    let mut req = s.client.post(s.url(path));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let (status, v) = pdkv_testkit::http::answer(req).await;
    assert_eq!(status, StatusCode::OK, "{path}: {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_requests_wait_for_resume_in_every_pause_mode() {
    let s = dev_server(Duration::from_secs(120)).await;
    let body = json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": 6, "temperature": 0}});
    let reference = generate(&s, body.clone()).await["choices"][0]["token_ids"].clone();
    for (pause, resume) in [
        ("/pause?mode=abort", vec!["/resume"]),
        ("/pause?mode=wait", vec!["/resume"]),
        ("/pause?mode=keep", vec!["/resume"]),
        (
            "/areal_pause_generation",
            vec!["/areal_continue_generation"],
        ),
        ("/sleep?level=1", vec!["/wake_up", "/resume"]),
    ] {
        post_dev(&s, pause, None).await;
        let client = s.client.clone();
        let url = s.url("/inference/v1/generate");
        let b = body.clone();
        let waiting =
            tokio::spawn(
                async move { pdkv_testkit::http::answer(client.post(url).json(&b)).await },
            );
        wait_waiting(&s, 1.0).await;
        assert!(!waiting.is_finished(), "{pause}: answered while paused");
        for r in resume {
            post_dev(&s, r, None).await;
        }
        let (status, v) = tokio::time::timeout(crate::common::DEADLINE, waiting)
            .await
            .expect("answered after resume")
            .unwrap();
        assert_eq!(status, StatusCode::OK, "{pause}: {v}");
        assert_eq!(v["choices"][0]["token_ids"], reference, "{pause}");
        wait_waiting(&s, 0.0).await;
    }
    s.stop().await;

    // Past the wait, a retryable 503 naming the setting.
    let s = dev_server(Duration::from_millis(200)).await;
    post_dev(&s, "/pause?mode=abort", None).await;
    let resp = http::send(s.client.post(s.url("/inference/v1/generate")).json(&body)).await;
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert!(resp.headers().get("retry-after").is_some());
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["error"]["code"], "engine_not_serving", "{v}");
    assert!(
        http::error_message(&v).contains("--pause-wait-timeout-s"),
        "{v}"
    );
    wait_waiting(&s, 0.0).await;
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_abort_pause_returns_the_tokens_so_far_and_they_continue() {
    let s = dev_server(Duration::from_secs(120)).await;
    // Long enough that the pause lands mid-rollout.
    let len = (s.engine.max_model_len() - PROMPT.len() - 1) as u64;
    let full = generate(
        &s,
        json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": len, "temperature": 0, "ignore_eos": true}}),
    )
    .await["choices"][0]["token_ids"]
        .clone();
    let full = ids(&full);
    let before = must(&s.metrics().await, "pdkv_generation_tokens_total");
    let client = s.client.clone();
    let url = s.url("/inference/v1/generate");
    let rollout = tokio::spawn(async move {
        let body = json!({"token_ids": PROMPT, "stream": false,
                          "sampling_params": {"max_tokens": len, "temperature": 0, "ignore_eos": true}});
        pdkv_testkit::http::answer(client.post(url).json(&body)).await
    });
    s.wait_metrics("the rollout generated 3 tokens", |m| {
        must(m, "pdkv_generation_tokens_total") >= before + 3.0
    })
    .await;
    post_dev(&s, "/areal_pause_generation", None).await;
    let (status, v) = rollout.await.unwrap();
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "abort");
    let partial = ids(&v["choices"][0]["token_ids"]);
    assert!(
        !partial.is_empty() && partial.len() < len as usize,
        "{partial:?}"
    );
    assert_eq!(partial[..], full[..partial.len()]);
    post_dev(&s, "/areal_continue_generation", None).await;
    // The framework re-sends the prompt with the tokens so far appended.
    let mut prompt = PROMPT.to_vec();
    prompt.extend(&partial);
    let rest = generate(
        &s,
        json!({"token_ids": prompt, "sampling_params": {
            "max_tokens": len as usize - partial.len(), "temperature": 0, "ignore_eos": true}}),
    )
    .await;
    let mut joined = partial.clone();
    joined.extend(ids(&rest["choices"][0]["token_ids"]));
    assert_eq!(joined, full);
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dev_mode_opens_the_lifecycle_routes_and_their_dialects() {
    let s = dev_server(Duration::from_secs(120)).await;
    // No token, no Authorization header: the routes answer.
    assert_eq!(
        pdkv_testkit::http::get_json(&s.client, &s.url("/get_world_size")).await,
        (StatusCode::OK, json!({"world_size": 1}))
    );
    // Parameters in a JSON body, as SkyRL sends them; an unknown query
    // parameter is ignored.
    let v = post_dev(
        &s,
        "/sleep?odd=1",
        Some(json!({"level": 1, "tags": ["weights", "kv_cache"]})),
    )
    .await;
    assert_eq!(v["level"], 1);
    let v = post_dev(&s, "/wake_up", Some(json!({"tags": ["weights"]}))).await;
    assert_eq!(v["asleep_tags"], json!(["kv_cache"]));
    post_dev(&s, "/wake_up", Some(json!({}))).await;
    post_dev(&s, "/resume", None).await;
    post_dev(
        &s,
        "/reset_prefix_cache",
        Some(json!({"reset_running_requests": false})),
    )
    .await;
    let (status, v) = pdkv_testkit::http::answer(s.client.get(s.url("/flush_cache"))).await;
    assert_eq!(status, StatusCode::OK, "{v}");

    // prime-rl's and AReaL's reload bodies; the version as vLLM's RLHF
    // router reads it.
    let dir = s.dir.path().display().to_string();
    post_dev(
        &s,
        "/update_weights",
        Some(json!({"weight_dir": dir, "version": "step-1"})),
    )
    .await;
    let (_, info) = pdkv_testkit::http::get_json(&s.client, &s.url("/weight_info")).await;
    assert_eq!(info["weight_version"], "step-1");
    let v = post_dev(
        &s,
        "/areal_update_weights",
        Some(json!({"model_path": dir})),
    )
    .await;
    assert_eq!(v["success"], true);

    // An empty abort list ends every request in flight (two as long as the
    // context allows: 500 tokens each could end between two polls).
    let client = s.client.clone();
    let url = s.url("/inference/v1/generate");
    let max_tokens = s.engine.max_model_len() - 16;
    let long = tokio::spawn(async move {
        let body = json!({"token_ids": PROMPT, "sampling_params": {"max_tokens": max_tokens, "ignore_eos": true, "n": 2}});
        pdkv_testkit::http::answer(client.post(url).json(&body)).await
    });
    s.wait_metrics("two requests running", |m| {
        must(m, "pdkv_num_requests_running") == 2.0
    })
    .await;
    let v = post_dev(&s, "/abort_requests", Some(json!({}))).await;
    assert_eq!(v["num_aborted"], 2, "{v}");
    let (status, v) = long.await.unwrap();
    assert_eq!(status, StatusCode::OK);
    assert_eq!(v["choices"][0]["finish_reason"], "abort");
    assert_eq!(v["choices"][1]["finish_reason"], "abort");

    let (status, v) = pdkv_testkit::http::answer(
        s.client
            .post(s.url("/collective_rpc"))
            .json(&json!({"method": "reload_weights"})),
    )
    .await;
    assert_openai_error(status, &v, StatusCode::BAD_REQUEST, "collective_rpc");
    assert!(v["error"]["message"]
        .as_str()
        .unwrap()
        .contains("reload_weights"));
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cache_salt_separates_prefix_cache_entries() {
    let s = dev_server(Duration::ZERO).await;
    // Three full blocks of 16 tokens, then one more.
    let prompt: Vec<u32> = (0..49).map(|i| 40 + (i * 7) % 300).collect();
    let hits = |m: &str| must(m, "pdkv_prefix_cache_hits_total");
    let send = |salt: Option<&str>| {
        let mut body =
            json!({"token_ids": prompt, "sampling_params": {"max_tokens": 2, "temperature": 0}});
        if let Some(salt) = salt {
            body["cache_salt"] = json!(salt);
        }
        body
    };
    let first = generate(&s, send(Some("tenant-a"))).await;
    let h0 = hits(&s.metrics().await);
    // Another salt, and no salt: no hit on tenant a's blocks.
    generate(&s, send(Some("tenant-b"))).await;
    generate(&s, send(None)).await;
    let h1 = hits(&s.metrics().await);
    assert_eq!(h1, h0, "a different salt hit the cache");
    // The same salt hits, with the same answer.
    // The core publishes its counters after the answer goes out: wait for
    // them (bounded) rather than read them once.
    let again = generate(&s, send(Some("tenant-a"))).await;
    let h2 = hits(&s.wait_metrics("the same salt hits", |m| hits(m) > h1).await);
    assert_eq!(
        again["choices"][0]["token_ids"],
        first["choices"][0]["token_ids"]
    );
    // Completions take it too; an empty salt is refused.
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    s.wait_metrics("completions with the salt hit", |m| hits(m) > h2)
        .await;
    let empty_salt = json!({"token_ids": prompt, "cache_salt": ""});
    let v = generate_refused(&s, &empty_salt, StatusCode::BAD_REQUEST, "empty cache_salt").await;
    assert_eq!(v["error"]["param"], "cache_salt");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn values_the_engine_cannot_hold_and_unknown_roles_are_400s() {
    let s = dev_server(Duration::ZERO).await;
    let user = |content: Value| json!([{"role": "user", "content": content}]);
    for (body, param, shown) in [
        (json!({"prompt": "x", "top_p": 1e-300}), "top_p", "1e-300"),
        (
            json!({"prompt": "x", "repetition_penalty": 1e308}),
            "repetition_penalty",
            "1e308",
        ),
    ] {
        let (status, v) = s.post("/v1/completions", &body).await;
        assert_openai_error(status, &v, StatusCode::BAD_REQUEST, param);
        assert_eq!(v["error"]["param"], param, "{v}");
        assert!(
            v["error"]["message"].as_str().unwrap().contains(shown),
            "{v}"
        );
    }
    for (messages, param) in [
        (
            json!([{"role": "narrator", "content": "hi"}]),
            "messages[0].role",
        ),
        (user(Value::Null), "messages[0].content"),
    ] {
        let (status, v) = s
            .post(
                "/v1/chat/completions",
                &json!({"messages": messages, "max_tokens": 1}),
            )
            .await;
        assert_openai_error(status, &v, StatusCode::BAD_REQUEST, param);
        assert_eq!(v["error"]["param"], param, "{v}");
    }
    // An assistant turn without content is allowed, as OpenAI allows it.
    let (status, v) = s
        .post(
            "/v1/chat/completions",
            &json!({"messages": [{"role": "user", "content": "hi"},
                                 {"role": "assistant", "content": null},
                                 {"role": "user", "content": "again"}], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    s.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_list_of_prompts_answers_each_as_its_own_request_would() {
    let s = dev_server(Duration::ZERO).await;
    let prompts = ["The river ran low", "A small server", "Each request waited"];
    let mut want = Vec::new();
    for p in prompts {
        let c = text_of(
            &s,
            json!({"prompt": p, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "n": 2}),
        )
        .await;
        want.push(c["text"].clone());
    }
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "n": 2}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 6);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i, "{v}");
        assert_eq!(c["text"], want[i / 2], "choice {i}: {v}");
    }
    assert_eq!(v["usage"]["completion_tokens"], 30, "{v}");
    // Streamed, each choice's pieces carry its index; put together they
    // are the same texts, and the usage adds up every prompt's.
    let resp = http::send(s.client.post(s.url("/v1/completions")).json(&json!({
        "prompt": prompts, "max_tokens": 5, "temperature": 0, "ignore_eos": true, "n": 2,
        "stream": true, "stream_options": {"include_usage": true}
    })))
    .await;
    assert_eq!(resp.status(), StatusCode::OK);
    let text = resp.text().await.unwrap();
    let mut streamed = vec![String::new(); 6];
    let mut finished = 0;
    let mut usage = Value::Null;
    for v in pdkv_testkit::sse::values(&text) {
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
        for c in v["choices"].as_array().unwrap() {
            let i = c["index"].as_u64().unwrap() as usize;
            streamed[i].push_str(c["text"].as_str().unwrap());
            finished += usize::from(!c["finish_reason"].is_null());
        }
    }
    for (i, t) in streamed.iter().enumerate() {
        assert_eq!(
            t,
            want[i / 2].as_str().unwrap(),
            "streamed choice {i}: {text}"
        );
    }
    assert_eq!(finished, 6, "{text}");
    assert_eq!(usage["completion_tokens"], 30, "{text}");
    assert_eq!(
        usage["prompt_tokens"], v["usage"]["prompt_tokens"],
        "{text}"
    );
    // Token-id prompts too.
    let (status, v) = s
        .post(
            "/v1/completions",
            &json!({"prompt": [[72, 101], [108, 108, 111]], "max_tokens": 1}),
        )
        .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["usage"]["prompt_tokens"], 5, "{v}");
    s.stop().await;
}
