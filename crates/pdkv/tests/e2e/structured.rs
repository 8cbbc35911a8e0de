//! Structured outputs over HTTP with SmolLM2, through a prefill/decode
//! pair behind the proxy (D constrains; P computes the prompt): JSON
//! schemas at temperature 1 with `n` and streaming, regexes and choices,
//! the greedy answer unchanged by a constraint that admits it, and bad
//! constraints refused naming their field.

use pdkv_structured::compile::rx_escape;
use pdkv_testkit::{
    deploy::Spec,
    http::{self, post_json, wait_healthy},
    models::smollm2,
    prom::metric,
};
use serde_json::{json, Value};

fn schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "hobbies": {"type": "array", "items": {"enum": ["chess", "hiking", "baking", "music"]}, "minItems": 1, "maxItems": 3},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 24}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": false,
            },
        },
        "required": ["name", "age", "hobbies", "address"],
        "additionalProperties": false,
    })
}

/// `text` is a JSON document valid against [`schema`] (checked by hand:
/// every keyword the schema uses).
fn valid(text: &str) -> Result<(), String> {
    let v: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let o = v.as_object().ok_or("not an object")?;
    let keys: Vec<&str> = o.keys().map(String::as_str).collect();
    let mut sorted = keys.clone();
    sorted.sort();
    if sorted != ["address", "age", "hobbies", "name"] {
        return Err(format!("keys {keys:?}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    if name.chars().count() > 24 {
        return Err("name too long".into());
    }
    if o["age"].as_u64().is_none_or(|a| a > 120) {
        return Err("age".into());
    }
    let hobbies = o["hobbies"].as_array().ok_or("hobbies")?;
    let known = ["chess", "hiking", "baking", "music"];
    if hobbies.is_empty()
        || hobbies.len() > 3
        || !hobbies
            .iter()
            .all(|h| known.contains(&h.as_str().unwrap_or("")))
    {
        return Err("hobbies".into());
    }
    let a = o["address"].as_object().ok_or("address")?;
    let zip = a.get("zip").and_then(Value::as_str).unwrap_or("");
    if a.len() != 2
        || !a["city"].is_string()
        || zip.len() != 5
        || !zip.bytes().all(|b| b.is_ascii_digit())
    {
        return Err("address".into());
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn constrained_outputs_through_prefill_and_decode() {
    let Some(path) = smollm2("constrained_outputs_through_prefill_and_decode") else {
        return;
    };
    let pd = Spec::new(&path, 256).start_pd();
    let client = reqwest::Client::new();
    wait_healthy(&client, &pd.proxy.url("/health")).await;
    let chat = pd.proxy.url("/v1/chat/completions");
    let cmpl = pd.proxy.url("/v1/completions");
    let ask = json!([{"role": "user", "content": "Describe a person as JSON: name, age, hobbies and address."}]);
    let format = json!({"type": "json_schema", "json_schema": {"name": "person", "strict": true, "schema": schema()}});

    // Temperature 1 (seeded, so the run replays), four choices a request.
    for seed in 0..4 {
        let body = json!({"messages": ask, "response_format": format, "temperature": 1.0,
            "seed": seed, "n": 4, "max_tokens": 400});
        let (status, v) = post_json(&client, &chat, &body).await;
        assert_eq!(status, 200, "{v}");
        for c in v["choices"].as_array().expect("choices") {
            let text = c["message"]["content"].as_str().expect("content");
            assert_eq!(c["finish_reason"], "stop", "{text}");
            valid(text).unwrap_or_else(|e| panic!("seed {seed}: {e}: {text}"));
        }
    }
    // Streamed, and as vLLM's own fields.
    let body = json!({"messages": ask, "structured_outputs": {"json": schema()}, "temperature": 1.0,
        "seed": 9, "max_tokens": 400, "stream": true});
    let text = http::generate(&client, &pd.proxy.base, "/v1/chat/completions", &body)
        .await
        .expect("stream");
    valid(&text).unwrap_or_else(|e| panic!("streamed: {e}: {text}"));

    // Regexes and choices on completions.
    let body = json!({"prompt": "Call me at", "guided_regex": "[0-9]{3}-[0-9]{4}", "temperature": 1.0,
        "seed": 3, "n": 3, "max_tokens": 20});
    let (status, v) = post_json(&client, &cmpl, &body).await;
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        let b = t.as_bytes();
        assert!(
            b.len() == 8 && b[3] == b'-' && t.replace('-', "").bytes().all(|x| x.is_ascii_digit()),
            "{t:?}"
        );
    }
    let body = json!({"prompt": "Is the sky green? Answer:", "structured_outputs": {"choice": ["yes", "no"]},
        "max_tokens": 5, "temperature": 0});
    let (_, v) = post_json(&client, &cmpl, &body).await;
    assert!(
        ["yes", "no"].contains(&v["choices"][0]["text"].as_str().unwrap()),
        "{v}"
    );

    // Token ids in, token ids out (`/inference/v1/generate`).
    let yes_no: Vec<String> = ["yes", "no"].iter().map(|w| w.to_string()).collect();
    let body = json!({"token_ids": [504, 3458, 314, 260, 5048, 30], "sampling_params": {"max_tokens": 5,
        "temperature": 0, "structured_outputs": {"choice": yes_no}}});
    let (status, v) = post_json(&client, &pd.proxy.url("/inference/v1/generate"), &body).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let ids = v["choices"][0]["token_ids"]
        .as_array()
        .expect("token ids")
        .len();
    assert!((1..=2).contains(&ids), "\"yes\" or \"no\" and the end: {v}");

    // A structural tag: free text, and any call it opens is whole.
    let tag = json!({"type": "structural_tag", "triggers": ["<call="],
        "structures": [{"begin": "<call=weather>", "schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, "end": "</call>"}]});
    let body = json!({"prompt": "The weather in Rome: <call=", "response_format": tag, "max_tokens": 40, "temperature": 0});
    let (status, v) = post_json(&client, &cmpl, &body).await;
    assert_eq!(status, 200, "{v}");
    let text = v["choices"][0]["text"].as_str().unwrap();
    if let Some(at) = text.find("<call=") {
        let call = &text[at..];
        assert!(call.starts_with("<call=weather>{"), "{text:?}");
    }

    // A constraint that admits the greedy answer changes nothing.
    let free = json!({"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 40, "temperature": 0,
        "logprobs": true, "top_logprobs": 1});
    let (_, want) = post_json(&client, &chat, &free).await;
    let answer = want["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(answer.len() > 10, "{want}");
    let mut same = free.clone();
    same["structured_outputs"] = json!({"regex": format!("{}(.|\n)*", rx_escape(&answer))});
    let (status, got) = post_json(&client, &chat, &same).await;
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    assert_eq!(
        got["usage"]["completion_tokens"],
        want["usage"]["completion_tokens"]
    );

    // vLLM's older top-level chat `structural_tag` (a JSON string) is the
    // response_format's constraint: a structure the free answer's opening
    // triggers turns that answer away, and both spellings give the same.
    let trigger: String = answer.chars().take(4).collect();
    assert!(!answer[trigger.len()..].trim_start().starts_with('{'));
    let tag = json!({"type": "structural_tag", "triggers": [trigger],
        "structures": [{"begin": trigger, "schema": {"type": "object"}, "end": "</s>"}]});
    let mut top = free.clone();
    top["structural_tag"] = json!(tag.to_string());
    let (status, got) = post_json(&client, &chat, &top).await;
    assert_eq!(status, 200, "{got}");
    let text = got["choices"][0]["message"]["content"].as_str().unwrap();
    assert_ne!(text, answer, "the structural tag was not applied");
    if let Some(at) = text.find(trigger.as_str()) {
        let after = &text[at + trigger.len()..];
        assert!(after.trim_start().starts_with('{'), "{text:?}");
    }
    let mut typed = free.clone();
    typed["response_format"] = tag;
    let (_, other) = post_json(&client, &chat, &typed).await;
    assert_eq!(other["choices"][0]["message"], got["choices"][0]["message"]);

    // Refusals name the field that asked.
    for (body, param) in [
        (
            json!({"prompt": "x", "structured_outputs": {"regex": "[0-9"}}),
            "structured_outputs",
        ),
        (
            json!({"prompt": "x", "guided_grammar": "start: start\n"}),
            "guided_grammar",
        ),
        (
            json!({"prompt": "x", "guided_json": {"type": "object", "properties": {"a": {"$ref": "#/$defs/none"}}}}),
            "guided_json",
        ),
        (
            json!({"prompt": "x", "guided_choice": ["a"], "response_format": {"type": "json_object"}}),
            "response_format",
        ),
        (
            json!({"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "outlines"}),
            "guided_decoding_backend",
        ),
        (
            json!({"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": 5}}}),
            "response_format.json_schema.schema",
        ),
    ] {
        let (status, v) = post_json(&client, &pd.d.url("/v1/completions"), &body).await;
        assert_eq!(status.as_u16(), 400, "{body}: {v}");
        assert_eq!(v["error"]["param"], param, "{body}: {v}");
    }
    let m = http::metrics(&client, &pd.d.base).await;
    assert!(
        metric(&m, "pdkv_structured_masks_total").unwrap() > 100.0,
        "D constrained"
    );
    assert!(
        metric(&m, "pdkv_structured_compile_cache_hits_total").unwrap() > 0.0,
        "schemas reused"
    );
    assert_eq!(metric(&m, "pdkv_structured_requests_running"), Some(0.0));
}
