//! Tool calls over HTTP with SmolLM2, as an agent loop sends them: a call
//! forced with `required`, a named function, the tools' answers sent back
//! as `role: "tool"` messages, then `auto` (the server reads calls with the
//! hermes parser); calls in OpenAI's shape with arguments that parse and
//! follow their schemas, streamed as deltas too.

use pdkv_testkit::{
    deploy::Spec,
    http::{post_json, wait_healthy},
    models::smollm2,
    sse,
};
use serde_json::{json, Value};

fn tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "get_time", "description": "The local time in a timezone",
            "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 40}},
                "required": ["timezone"], "additionalProperties": false}}},
    ])
}

/// A call's arguments parse and hold the keys its schema requires.
fn check_call(call: &Value) {
    assert_eq!(call["type"], "function", "{call}");
    assert!(call["id"].as_str().is_some_and(|i| !i.is_empty()), "{call}");
    let args: Value = serde_json::from_str(
        call["function"]["arguments"]
            .as_str()
            .expect("arguments text"),
    )
    .unwrap_or_else(|e| panic!("arguments do not parse: {e}: {call}"));
    match call["function"]["name"].as_str() {
        Some("get_weather") => {
            assert!(args["city"].is_string(), "{call}");
            assert!(
                ["celsius", "fahrenheit"].contains(&args["unit"].as_str().unwrap_or("")),
                "{call}"
            );
        }
        Some("get_time") => assert!(args["timezone"].is_string(), "{call}"),
        other => panic!("unknown tool {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_loop_calls_tools_and_reads_their_answers() {
    let Some(path) = smollm2("an_agent_loop_calls_tools_and_reads_their_answers") else {
        return;
    };
    let s = Spec::new(&path, 128)
        .serve_args(&["--enable-auto-tool-choice", "--tool-call-parser", "hermes"])
        .start_colocated();
    let client = reqwest::Client::new();
    wait_healthy(&client, &s.url("/health")).await;
    let url = s.url("/v1/chat/completions");
    let mut messages = vec![
        json!({"role": "user", "content": "What is the weather in Paris, and what time is it there?"}),
    ];

    // Turn 1: a call is required.
    let body = json!({"messages": messages, "tools": tools(), "tool_choice": "required",
        "temperature": 1.0, "seed": 5, "max_tokens": 200});
    let (status, v) = post_json(&client, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    assert_eq!(c["finish_reason"], "tool_calls", "{v}");
    assert!(c["message"]["content"].is_null(), "{v}");
    let calls = c["message"]["tool_calls"].as_array().expect("tool_calls");
    assert!(!calls.is_empty());
    calls.iter().for_each(check_call);
    messages.push(c["message"].clone());
    for call in calls {
        messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "18 degrees, sunny; 14:05"}));
    }

    // Turn 2: a named function, streamed.
    let body = json!({"messages": messages, "tools": tools(), "stream": true, "temperature": 1.0, "seed": 6,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 200});
    let text = client
        .post(&url)
        .json(&body)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let chunks = sse::values(&text);
    let deltas: Vec<&Value> = chunks.iter().filter_map(|c| c["choices"].get(0)).collect();
    let with_calls: Vec<&&Value> = deltas
        .iter()
        .filter(|d| d["delta"].get("tool_calls").is_some())
        .collect();
    assert_eq!(with_calls.len(), 1, "the call comes as one delta: {text}");
    let call = &with_calls[0]["delta"]["tool_calls"][0];
    assert_eq!(
        (call["index"].as_u64(), call["function"]["name"].as_str()),
        (Some(0), Some("get_time"))
    );
    check_call(call);
    assert_eq!(deltas.last().unwrap()["finish_reason"], "tool_calls");
    messages.push(json!({"role": "assistant", "content": null, "tool_calls": [call]}));
    messages.push(json!({"role": "tool", "tool_call_id": call["id"], "content": "14:05"}));

    // Turn 3: auto; SmolLM2 answers in words (its template has no tools),
    // which come back as content.
    let body = json!({"messages": messages, "tools": tools(), "tool_choice": "auto", "temperature": 0, "max_tokens": 60});
    let (status, v) = post_json(&client, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    match c["finish_reason"].as_str() {
        Some("tool_calls") => c["message"]["tool_calls"]
            .as_array()
            .unwrap()
            .iter()
            .for_each(check_call),
        Some("stop" | "length") => assert!(
            c["message"]["content"]
                .as_str()
                .is_some_and(|t| !t.is_empty()),
            "{v}"
        ),
        other => panic!("finish {other:?}: {v}"),
    }
    // `none` answers in words whatever the tools.
    let body =
        json!({"messages": messages, "tools": tools(), "tool_choice": "none", "max_tokens": 20});
    let (status, v) = post_json(&client, &url, &body).await;
    assert_eq!(status, 200, "{v}");
    assert!(
        v["choices"][0]["message"]["tool_calls"].is_null()
            && v["choices"][0]["message"]["content"].is_string()
    );
    // A tool message without its call, and tools on /v1/completions, are refused by name.
    let bad = json!({"messages": [{"role": "tool", "content": "x"}], "max_tokens": 5});
    let (status, v) = post_json(&client, &url, &bad).await;
    assert_eq!(
        (status.as_u16(), v["error"]["param"].as_str()),
        (400, Some("messages[0].tool_call_id"))
    );
    let bad = json!({"prompt": "x", "tools": tools()});
    let (status, v) = post_json(&client, &s.url("/v1/completions"), &bad).await;
    assert_eq!(
        (status.as_u16(), v["error"]["param"].as_str()),
        (400, Some("tools"))
    );
}
