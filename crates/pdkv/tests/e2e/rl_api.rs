//! What RL rollout clients (verl, OpenRLHF) send to vLLM, against a real
//! `pdkv serve` on loopback with SmolLM2: log-probabilities that agree with
//! the prompt log-probabilities of the same text, seeded groups of `n`
//! choices, logit_bias, min_tokens and stop token ids, and the fields that
//! must be refused.

use std::collections::BTreeSet;

use pdkv_deploy::EngineRole;
use pdkv_testkit::{
    deploy::Spec,
    http::{self, post_json, token_ids, wait_healthy},
    models::smollm2,
    proc::Proc,
    prom::metric,
    sse,
};
use serde_json::{json, Value};

const PROMPT: &str = "The three most useful things to pack for a long hike in the mountains are";

fn serve(path: &std::path::Path) -> Proc {
    Spec::new(path, 128).start_colocated()
}

/// A healthy server of the SmolLM2 GGUF and a client, or `None` (with a
/// note) when this machine has no model outside CI.
async fn started(test: &str) -> Option<(Proc, reqwest::Client)> {
    let path = smollm2(test)?;
    let s = serve(&path);
    let client = reqwest::Client::new();
    wait_healthy(&client, &s.url("/health")).await;
    Some((s, client))
}

async fn post(client: &reqwest::Client, url: String, body: &Value) -> (u16, Value) {
    let (status, v) = post_json(client, &url, body).await;
    (status.as_u16(), v)
}

async fn ok(client: &reqwest::Client, url: String, body: &Value) -> Value {
    let (status, v) = post(client, url, body).await;
    assert_eq!(status, 200, "{body} -> {v}");
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sampled_logprobs_equal_the_prompt_logprobs_of_the_completed_text() {
    let Some((s, client)) =
        started("sampled_logprobs_equal_the_prompt_logprobs_of_the_completed_text").await
    else {
        return;
    };
    let url = s.url("/v1/completions");

    // A hot temperature: the reported values must still be the raw model's.
    let body = json!({"prompt": PROMPT, "max_tokens": 12, "temperature": 1.5, "seed": 11, "logprobs": 3,
        "return_token_ids": true, "ignore_eos": true});
    let v = ok(&client, url.clone(), &body).await;
    let choice = &v["choices"][0];
    let prompt_ids = token_ids(&choice["prompt_token_ids"]);
    let out_ids = token_ids(&choice["token_ids"]);
    assert_eq!(out_ids.len(), 12);
    let lp = &choice["logprobs"];
    let sampled: Vec<f64> = lp["token_logprobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    assert_eq!(sampled.len(), 12);
    let tokens = lp["tokens"].as_array().unwrap();
    let offsets = token_ids(&lp["text_offset"]);
    for (j, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        let token = tokens[j].as_str().unwrap();
        // k tokens plus the sampled one, keyed by text (tokens that decode
        // alone to the same text, such as partial characters, share a key).
        assert!((1..=4).contains(&top.len()), "{top:?}");
        assert_eq!(
            top[token].as_f64().unwrap(),
            sampled[j],
            "the sampled token is listed with its logprob"
        );
        assert!(sampled[j] <= 0.0);
        if j > 0 {
            assert_eq!(
                offsets[j],
                offsets[j - 1] + tokens[j - 1].as_str().unwrap().chars().count() as u64
            );
        }
    }

    // The same text as a prompt: its prompt logprobs at the sampled positions.
    let full: Vec<u64> = prompt_ids.iter().chain(&out_ids).copied().collect();
    let again = ok(
        &client,
        url.clone(),
        &json!({"prompt": full, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 0}),
    )
    .await;
    let plp = again["choices"][0]["prompt_logprobs"].as_array().unwrap();
    assert_eq!(plp.len(), full.len());
    assert!(plp[0].is_null(), "the first prompt token has no logprob");
    let mut max_diff = 0.0f64;
    for (j, &t) in out_ids.iter().enumerate() {
        let entry = &plp[prompt_ids.len() + j][t.to_string()];
        let diff = (entry["logprob"].as_f64().unwrap() - sampled[j]).abs();
        max_diff = max_diff.max(diff);
        assert!(entry["rank"].as_u64().unwrap() >= 1);
    }
    println!(
        "largest |sampled logprob - prompt logprob| over {} tokens: {max_diff:e}",
        out_ids.len()
    );
    assert!(max_diff < 1e-4, "largest difference {max_diff}");

    // Echo with logprobs: the prompt's tokens first, the first one null.
    let echoed = ok(
        &client,
        url.clone(),
        &json!({"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "echo": true, "logprobs": 1}),
    )
    .await;
    let c = &echoed["choices"][0];
    assert!(c["text"].as_str().unwrap().starts_with(PROMPT), "{c}");
    let echo_lp = c["logprobs"]["token_logprobs"].as_array().unwrap();
    assert_eq!(echo_lp.len(), prompt_ids.len() + 2);
    assert!(echo_lp[0].is_null());
    for p in 1..prompt_ids.len() {
        let want = plp[p][prompt_ids[p].to_string()]["logprob"]
            .as_f64()
            .unwrap();
        assert!(
            (echo_lp[p].as_f64().unwrap() - want).abs() < 1e-9,
            "prompt position {p}"
        );
    }

    // Chat: greedy, so the chosen token leads its top list; streamed the same.
    let chat_url = s.url("/v1/chat/completions");
    let messages = json!([{"role": "user", "content": "Name a colour."}]);
    let chat = json!({"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let v = ok(&client, chat_url.clone(), &chat).await;
    let content = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .clone();
    assert!(!content.is_empty());
    for e in &content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 2);
        assert_eq!(
            (&top[0]["token"], &top[0]["logprob"]),
            (&e["token"], &e["logprob"]),
            "{e}"
        );
        assert_eq!(e["bytes"], json!(e["token"].as_str().unwrap().as_bytes()));
    }
    let mut streamed_body = chat.clone();
    streamed_body["stream"] = json!(true);
    let text = http::send(client.post(chat_url).json(&streamed_body))
        .await
        .text()
        .await
        .unwrap();
    let streamed: Vec<Value> = sse::values(&text)
        .iter()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(streamed, content, "streamed chunks carry the same logprobs");
    assert!(s.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn n8_seeded_choices_reproduce_and_differ() {
    let Some((s, client)) = started("n8_seeded_choices_reproduce_and_differ").await else {
        return;
    };
    let url = s.url("/v1/completions");
    // Over one 16-token block, so the choices have a full block to share.
    let prompt = format!("{PROMPT} water, a map and");
    let body = json!({"prompt": prompt, "n": 8, "seed": 42, "temperature": 1.0, "max_tokens": 8,
        "ignore_eos": true, "return_token_ids": true});
    let before = pdkv_testkit::http::get_text(&client, &s.url("/metrics")).await;
    let a = ok(&client, url.clone(), &body).await;
    let after = pdkv_testkit::http::get_text(&client, &s.url("/metrics")).await;
    let b = ok(&client, url.clone(), &body).await;
    let choices = |v: &Value| -> Vec<(u64, Vec<u64>, String)> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                (
                    c["index"].as_u64().unwrap(),
                    token_ids(&c["token_ids"]),
                    c["text"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let (ca, cb) = (choices(&a), choices(&b));
    assert_eq!(
        ca.iter().map(|c| c.0).collect::<Vec<_>>(),
        (0..8).collect::<Vec<_>>()
    );
    assert_eq!(ca, cb, "the same seed gives the same 8 choices");
    let distinct: BTreeSet<&Vec<u64>> = ca.iter().map(|c| &c.1).collect();
    assert_eq!(distinct.len(), 8, "the 8 choices differ: {ca:?}");
    let prompt_tokens = token_ids(&a["choices"][0]["prompt_token_ids"]).len() as u64;
    assert!(
        prompt_tokens > 16,
        "the prompt fills a block ({prompt_tokens} tokens)"
    );
    assert_eq!(
        a["usage"]["prompt_tokens"],
        json!(prompt_tokens),
        "the prompt counts once"
    );
    assert_eq!(
        a["usage"]["completion_tokens"],
        json!(64),
        "completion tokens over all choices"
    );
    // Choices 1..8 took the prompt's full blocks from choice 0's prefill.
    let hits = |t: &str| metric(t, "pdkv_prefix_cache_hits_total").unwrap_or(0.0);
    let full_blocks = (prompt_tokens as usize - 1) / 16 * 16;
    assert!(
        hits(&after) - hits(&before) >= (7 * full_blocks) as f64,
        "prefix hits {} -> {}",
        hits(&before),
        hits(&after)
    );

    // Choice 0 is the n=1 request with the same seed.
    let mut one = body.clone();
    one["n"] = json!(1);
    let single = ok(&client, url.clone(), &one).await;
    assert_eq!(token_ids(&single["choices"][0]["token_ids"]), ca[0].1);

    // Streamed, each chunk names its choice; the texts are the same.
    let mut streamed = body.clone();
    streamed["stream"] = json!(true);
    let text = http::send(client.post(url).json(&streamed))
        .await
        .text()
        .await
        .unwrap();
    let mut texts = vec![String::new(); 8];
    let mut finished = vec![0; 8];
    for e in sse::values(&text) {
        let c = &e["choices"][0];
        let i = c["index"].as_u64().unwrap() as usize;
        texts[i].push_str(c["text"].as_str().unwrap());
        if !c["finish_reason"].is_null() {
            finished[i] += 1;
        }
    }
    assert_eq!(finished, vec![1; 8], "one final chunk per choice");
    assert_eq!(texts, ca.iter().map(|c| c.2.clone()).collect::<Vec<_>>());
    assert!(s.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logit_bias_min_tokens_and_stop_token_ids_take_effect() {
    let Some((s, client)) = started("logit_bias_min_tokens_and_stop_token_ids_take_effect").await
    else {
        return;
    };
    let url = s.url("/v1/completions");

    // A +100 bias makes one token certain, even when sampling.
    let forced = 1010u64;
    let v = ok(
        &client,
        url.clone(),
        &json!({"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "seed": 3,
        "logit_bias": {forced.to_string(): 100}, "return_token_ids": true}),
    )
    .await;
    assert_eq!(
        token_ids(&v["choices"][0]["token_ids"]),
        vec![forced; 4],
        "{v}"
    );

    // A greedy chat answer ends early on EOS; min_tokens keeps it going.
    let chat_url = s.url("/v1/chat/completions");
    let messages = json!([{"role": "user", "content": "Name the capital city of France."}]);
    let plain = ok(&client, chat_url.clone(), &json!({"messages": messages, "max_tokens": 40, "temperature": 0, "return_token_ids": true})).await;
    let plain_ids = token_ids(&plain["choices"][0]["token_ids"]);
    assert_eq!(plain["choices"][0]["finish_reason"], "stop", "{plain}");
    assert!(plain_ids.len() < 40);
    let long = ok(
        &client,
        chat_url.clone(),
        &json!({"messages": messages, "max_tokens": 40, "min_tokens": 40, "temperature": 0}),
    )
    .await;
    assert_eq!(long["usage"]["completion_tokens"], json!(40), "{long}");
    assert_eq!(long["choices"][0]["finish_reason"], "length");

    // A stop token id ends the answer at its first occurrence, on either
    // endpoint; ignore_eos runs to max_tokens.
    let stop = plain_ids[1];
    let first = plain_ids.iter().position(|&t| t == stop).unwrap();
    let stopped = ok(
        &client,
        chat_url,
        &json!({"messages": messages, "max_tokens": 40, "temperature": 0,
        "stop_token_ids": [stop], "return_token_ids": true}),
    )
    .await;
    assert_eq!(stopped["choices"][0]["finish_reason"], "stop");
    assert_eq!(
        token_ids(&stopped["choices"][0]["token_ids"]),
        plain_ids[..=first].to_vec()
    );
    let v = ok(&client, url, &json!({"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": true, "stop_token_ids": [2]})).await;
    assert_eq!(v["usage"]["completion_tokens"], json!(6), "{v}");
    assert!(s.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_fields_answer_400_naming_them() {
    let Some((s, client)) = started("refused_fields_answer_400_naming_them").await else {
        return;
    };
    let messages = json!([{"role": "user", "content": "hi"}]);
    let cases = [
        (
            "/v1/completions",
            json!({"prompt": "a", "suffix": "b"}),
            "suffix",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "n": 2, "best_of": 3}),
            "best_of",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logit_bias": {"99999999": 5}}),
            "logit_bias",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "logprobs": 21}),
            "logprobs",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "repetition_penalty": 0}),
            "repetition_penalty",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "presence_penalty": 3}),
            "presence_penalty",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "response_format": {"type": "yaml"}}),
            "response_format.type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "tools": [{"type": "code"}]}),
            "tools[0].type",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "tool_choice": "required"}),
            "tool_choice",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}}}),
            "guided_json",
        ),
        (
            "/v1/completions",
            json!({"prompt": "a", "use_beam_search": true}),
            "use_beam_search",
        ),
        (
            "/v1/chat/completions",
            json!({"messages": messages, "top_logprobs": 2}),
            "top_logprobs",
        ),
    ];
    for (path, body, param) in cases {
        let (status, v) = post(&client, s.url(path), &body).await;
        assert_eq!(status, 400, "{path} {body} -> {v}");
        assert_eq!(v["error"]["param"], param, "{path} {body} -> {v}");
        assert_eq!(v["error"]["type"], "invalid_request_error");
    }
    // What vllm-router adds to every request is accepted.
    let router = json!({"messages": messages, "max_tokens": 2, "no_stop_trim": false, "skip_special_tokens": true,
        "return_hidden_states": false, "continue_final_message": false, "separate_reasoning": true,
        "stream_reasoning": false, "include_reasoning": true, "min_tokens": 0, "echo": false, "logprobs": false});
    ok(&client, s.url("/v1/chat/completions"), &router).await;
    assert!(s.terminate().success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokenize_detokenize_version_and_the_api_key() {
    let Some(path) = smollm2("tokenize_detokenize_version_and_the_api_key") else {
        return;
    };
    let s = Spec::new(&path, 64)
        .env("PDKV_API_KEY", "k3y")
        .start_colocated();
    let client = reqwest::Client::new();
    // Probes and scrapers need no key.
    wait_healthy(&client, &s.url("/health")).await;
    assert_eq!(
        client.get(s.url("/metrics")).send().await.unwrap().status(),
        200
    );
    let version: Value = pdkv_testkit::http::get_json(&client, &s.url("/version"))
        .await
        .1;
    assert_eq!(version["version"], env!("CARGO_PKG_VERSION"));

    let body = json!({"prompt": PROMPT, "add_special_tokens": false});
    for (path, key) in [
        ("/tokenize", None),
        ("/tokenize", Some("wrong")),
        ("/v1/completions", None),
        ("/v1/models", None),
    ] {
        let mut req = if path == "/v1/models" {
            client.get(s.url(path))
        } else {
            client.post(s.url(path)).json(&body)
        };
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.unwrap();
        assert_eq!(resp.status(), 401, "{path} with key {key:?}");
        let v: Value = resp.json().await.unwrap();
        assert_eq!(v["error"]["type"], "authentication_error", "{v}");
    }

    // Every call below carries the key.
    let keyed = |path: &str, body: Value| {
        let req = client.post(s.url(path)).bearer_auth("k3y").json(&body);
        async move {
            let (status, v) = http::answer(req).await;
            (status.as_u16(), v)
        }
    };
    let (_, tokenized) = keyed("/tokenize", body.clone()).await;
    let tokens = token_ids(&tokenized["tokens"]);
    assert_eq!(tokenized["count"], json!(tokens.len()));
    assert!(
        tokenized["max_model_len"].as_u64().unwrap() >= 2048,
        "{tokenized}"
    );
    // The vocabulary's strings on request (byte-level BPE: `Ġ` a space).
    let mut with_strs = body.clone();
    with_strs["return_token_strs"] = json!(true);
    let (_, strs) = keyed("/tokenize", with_strs).await;
    let strs: Vec<&str> = strs["token_strs"]
        .as_array()
        .unwrap_or_else(|| panic!("token_strs: {strs}"))
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(strs.len(), tokens.len());
    assert_eq!(strs.concat().replace('Ġ', " "), PROMPT);
    let (_, detok) = keyed("/detokenize", json!({"tokens": tokens})).await;
    assert_eq!(detok["prompt"], PROMPT);
    let (status, bad) = keyed("/detokenize", json!({"tokens": [99999999]})).await;
    assert_eq!(
        (status, &bad["error"]["param"]),
        (400, &json!("tokens")),
        "{bad}"
    );

    // A conversation tokenizes to the prompt the chat endpoint generates from.
    let messages = json!([{"role": "user", "content": "Hello there"}]);
    let (_, conv) = keyed("/tokenize", json!({"messages": messages})).await;
    let (_, chat) = keyed(
        "/v1/chat/completions",
        json!({"messages": messages, "max_tokens": 1, "return_token_ids": true}),
    )
    .await;
    assert_eq!(conv["tokens"], chat["prompt_token_ids"], "{conv} vs {chat}");
    // A conversation's tools are read (and refused by name when malformed).
    let (status, bad) = keyed(
        "/tokenize",
        json!({"messages": messages, "tools": [{"type": "retrieval"}]}),
    )
    .await;
    assert_eq!(
        (status, &bad["error"]["param"]),
        (400, &json!("tools[0].type")),
        "{bad}"
    );
    assert!(s.terminate().success());
}

/// A GRPO-style group through P/D (P, D and `pdkv proxy`): the same 8
/// seeded choices and logprobs as a colocated engine, for one KV transfer
/// (P computes the prompt once, D loads it once and its other choices take
/// the loaded blocks from its prefix cache). P and D check an API key,
/// which the proxy passes on from the client.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_n8_group_through_the_pd_proxy_is_one_transfer_and_equals_colocated() {
    let Some(path) =
        smollm2("an_n8_group_through_the_pd_proxy_is_one_transfer_and_equals_colocated")
    else {
        return;
    };
    let client = reqwest::Client::new();
    let colo = serve(&path);
    // The engines take the rollout key; the proxy passes the client's on.
    let spec = Spec::new(&path, 128).env("PDKV_API_KEY", "rollout-key");
    let p = spec.start_engine(EngineRole::Prefill, "p0");
    let d = spec.start_engine(EngineRole::Decode, "d0");
    let proxy = Spec::new(&path, 128).start_proxy(&[&p], &[&d]);
    for s in [&colo, &p, &d, &proxy] {
        wait_healthy(&client, &s.url("/health")).await;
    }
    let prompt = format!("{PROMPT} water, a map and");
    let body = json!({"prompt": prompt, "n": 8, "seed": 7, "temperature": 1.0, "max_tokens": 6,
        "ignore_eos": true, "logprobs": 1, "return_token_ids": true});
    let want = ok(&client, colo.url("/v1/completions"), &body).await;
    let loads = |t: &str| metric(t, "pdkv_kv_loads_ok_total").unwrap_or(0.0);
    let before = pdkv_testkit::http::get_text(&client, &d.url("/metrics")).await;
    let resp = http::send(client.post(proxy.url("/v1/completions")).json(&body)).await;
    assert_eq!(
        resp.status().as_u16(),
        401,
        "without the key: {}",
        resp.text().await.unwrap()
    );
    let resp = http::send(
        client
            .post(proxy.url("/v1/completions"))
            .bearer_auth("rollout-key")
            .json(&body),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    let got: Value = resp.json().await.unwrap();
    let after = pdkv_testkit::http::get_text(&client, &d.url("/metrics")).await;
    assert_eq!(
        loads(&after) - loads(&before),
        1.0,
        "one KV load for the group"
    );
    let (w, g) = (
        want["choices"].as_array().unwrap(),
        got["choices"].as_array().unwrap(),
    );
    assert_eq!(g.len(), 8, "{got}");
    let mut largest: f64 = 0.0;
    for (a, b) in w.iter().zip(g) {
        assert_eq!(a["index"], b["index"]);
        assert_eq!(
            token_ids(&a["token_ids"]),
            token_ids(&b["token_ids"]),
            "choice {}: the same tokens",
            a["index"]
        );
        let lp = |c: &Value| -> Vec<f64> {
            c["logprobs"]["token_logprobs"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect()
        };
        for (x, y) in lp(a).iter().zip(lp(b)) {
            largest = largest.max((x - y).abs());
        }
    }
    println!("largest logprob difference, P/D against colocated: {largest:e}");
    assert!(largest <= 1e-4, "logprobs through P/D differ by {largest}");
    assert_eq!(got["usage"], want["usage"]);
    // Prompt logprobs need the prompt's logits where the answer is made:
    // the proxy sends such a request to D alone, which computes the prompt.
    let pl = json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1});
    let want = ok(&client, colo.url("/v1/completions"), &pl).await;
    let resp = http::send(
        client
            .post(proxy.url("/v1/completions"))
            .bearer_auth("rollout-key")
            .json(&pl),
    )
    .await;
    assert_eq!(resp.status().as_u16(), 200);
    let got: Value = resp.json().await.unwrap();
    assert!(
        want["choices"][0]["prompt_logprobs"]
            .as_array()
            .is_some_and(|a| a.len() > 1),
        "{want}"
    );
    assert_eq!(
        got["choices"][0]["prompt_logprobs"],
        want["choices"][0]["prompt_logprobs"]
    );
    let last = pdkv_testkit::http::get_text(&client, &d.url("/metrics")).await;
    assert_eq!(
        loads(&last),
        loads(&after),
        "no KV load for a request D computed alone"
    );
    for s in [proxy, d, p, colo] {
        assert!(s.terminate().success());
    }
}

/// A server with n-gram speculative decoding answers what one without it
/// answers, over HTTP with SmolLM2: the same tokens and log-probabilities,
/// greedy and seeded, streamed or not; its metrics show drafts kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_speculating_server_answers_as_one_without_drafts() {
    let Some(path) = smollm2("a_speculating_server_answers_as_one_without_drafts") else {
        return;
    };
    let spec = r#"{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2}"#;
    let plain = serve(&path);
    let fast = Spec::new(&path, 128)
        .serve_args(&["--speculative-config", spec])
        .start_colocated();
    let client = reqwest::Client::new();
    wait_healthy(&client, &plain.url("/health")).await;
    wait_healthy(&client, &fast.url("/health")).await;
    // A prompt whose answer repeats it, so that drafts are kept.
    let list = "Copy the following list exactly, one item per line:\n- Preheat the oven to 180 degrees.\n- Mix the flour, the sugar and the butter in a large bowl.\n- Pour the batter into a greased tin.\n";
    for body in [
        json!({"messages": [{"role": "user", "content": list}], "max_tokens": 48,
            "temperature": 0, "logprobs": true, "top_logprobs": 2}),
        json!({"messages": [{"role": "user", "content": list}], "max_tokens": 48,
            "temperature": 0.8, "seed": 7, "logprobs": true, "top_logprobs": 2}),
    ] {
        let url = |s: &Proc| s.url("/v1/chat/completions");
        let want = ok(&client, url(&plain), &body).await;
        let got = ok(&client, url(&fast), &body).await;
        let entries = want["choices"][0]["logprobs"]["content"].as_array();
        assert!(entries.is_some_and(|a| a.len() > 8), "{want}");
        assert_eq!(
            got["choices"][0]["message"], want["choices"][0]["message"],
            "{body}"
        );
        assert_eq!(
            got["choices"][0]["logprobs"], want["choices"][0]["logprobs"],
            "{body}"
        );
        assert_eq!(got["usage"], want["usage"], "{body}");
        let mut streamed = body.clone();
        streamed["stream"] = json!(true);
        let text = |v: &Value| {
            v["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .to_string()
        };
        let got_stream = http::generate(&client, &fast.base, "/v1/chat/completions", &streamed)
            .await
            .unwrap();
        assert_eq!(got_stream, text(&want), "streamed {body}");
    }
    let m = http::metrics(&client, &fast.base).await;
    let kept = metric(&m, "pdkv_spec_decode_num_accepted_tokens_total").unwrap();
    assert!(kept > 0.0, "drafts kept: {kept}");
    let m = http::metrics(&client, &plain.base).await;
    assert_eq!(metric(&m, "pdkv_spec_decode_num_drafts_total"), Some(0.0));
}
