//! The bodies the proxy sends P and D, made from the client's.

use serde_json::{json, Map, Value};

/// The generation endpoints.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Endpoint {
    Completions,
    ChatCompletions,
    /// vLLM's token-in/token-out API: the sampling fields sit in
    /// `sampling_params`.
    Generate,
}

impl Endpoint {
    pub(super) fn path(self) -> &'static str {
        match self {
            Endpoint::Completions => "/v1/completions",
            Endpoint::ChatCompletions => "/v1/chat/completions",
            Endpoint::Generate => "/inference/v1/generate",
        }
    }
}

/// P's body: the client's, generating one token without streaming, with
/// the plan's `kv_transfer_params`.
pub(super) fn prefill_body(req: &Map<String, Value>, endpoint: Endpoint, params: Value) -> Vec<u8> {
    let mut body = req.clone();
    if endpoint == Endpoint::Generate {
        let sp = body.entry("sampling_params").or_insert_with(|| json!({}));
        if let Some(sp) = sp.as_object_mut() {
            sp.insert("max_tokens".into(), json!(1));
        }
    } else {
        body.insert("max_tokens".into(), json!(1));
    }
    if endpoint == Endpoint::ChatCompletions && body.contains_key("max_completion_tokens") {
        body.insert("max_completion_tokens".into(), json!(1));
    }
    // Options of a stream the client asked for go; options without one
    // stay, so that P refuses them (a 400 naming them, as D would) before
    // any KV is computed for a request D would refuse.
    if body.get("stream") == Some(&Value::Bool(true)) {
        body.remove("stream_options");
    }
    body.insert("stream".into(), json!(false));
    body.insert("kv_transfer_params".into(), params);
    serde_json::to_vec(&body).unwrap_or_default()
}

/// D's body: the client's, with exactly the plan's `kv_transfer_params`
/// (none at all for `None`, whatever the client sent).
pub(super) fn decode_body(req: &Map<String, Value>, params: Option<Value>) -> Vec<u8> {
    let mut body = req.clone();
    match params {
        Some(p) => body.insert("kv_transfer_params".into(), p),
        None => body.remove("kv_transfer_params"),
    };
    serde_json::to_vec(&body).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn obj(v: Value) -> Map<String, Value> {
        v.as_object().cloned().unwrap()
    }

    #[test]
    fn prefill_body_generates_one_token_without_streaming() {
        let req = obj(json!({
            "prompt": "hi", "max_tokens": 50, "stream": true, "stream_options": {"include_usage": true},
            "kv_transfer_params": {"client": 1}, "temperature": 0,
        }));
        let params = pdkv_connector::params::for_prefill("t1");
        let p: Value =
            serde_json::from_slice(&prefill_body(&req, Endpoint::Completions, params.clone()))
                .unwrap();
        assert_eq!(p["max_tokens"], 1);
        assert_eq!(p["stream"], false);
        assert!(p.get("stream_options").is_none());
        assert_eq!(p["kv_transfer_params"], params);
        assert_eq!(p["prompt"], "hi");
        assert_eq!(p["temperature"], 0);

        let chat = obj(json!({"messages": [], "max_completion_tokens": 9}));
        let p: Value = serde_json::from_slice(&prefill_body(
            &chat,
            Endpoint::ChatCompletions,
            params.clone(),
        ))
        .unwrap();
        assert_eq!(p["max_completion_tokens"], 1);
        assert_eq!(p["max_tokens"], 1);

        // Without a stream, the options stay for P to refuse.
        let unstreamed = obj(json!({"prompt": "hi", "stream_options": {"include_usage": true}}));
        let p: Value =
            serde_json::from_slice(&prefill_body(&unstreamed, Endpoint::Completions, params))
                .unwrap();
        assert_eq!(p["stream_options"], json!({"include_usage": true}));
    }

    #[test]
    fn prefill_body_of_generate_limits_its_sampling_params() {
        let req = obj(json!({
            "token_ids": [1, 2, 3], "stream": true,
            "sampling_params": {"max_tokens": 50, "temperature": 0.7, "n": 4},
        }));
        let params = pdkv_connector::params::for_prefill("t1");
        let p: Value =
            serde_json::from_slice(&prefill_body(&req, Endpoint::Generate, params.clone()))
                .unwrap();
        assert_eq!(p["sampling_params"]["max_tokens"], 1);
        assert_eq!(p["sampling_params"]["temperature"], 0.7);
        assert!(p.get("max_tokens").is_none(), "{p}");
        assert_eq!(
            (p["stream"].as_bool(), &p["kv_transfer_params"]),
            (Some(false), &params)
        );
        assert_eq!(p["token_ids"], json!([1, 2, 3]));
    }

    #[test]
    fn decode_body_carries_exactly_the_plans_params() {
        let req = obj(
            json!({"prompt": "hi", "max_tokens": 50, "stream": true, "kv_transfer_params": {"client": 1}}),
        );
        let params = json!({"do_remote_prefill": true, "transfer_id": "t", "remote_block_ids": [4, 5],
                            "remote_registration_generation": 2});
        let d: Value = serde_json::from_slice(&decode_body(&req, Some(params.clone()))).unwrap();
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!(
            (
                d["prompt"].as_str(),
                d["max_tokens"].as_u64(),
                d["stream"].as_bool()
            ),
            (Some("hi"), Some(50), Some(true))
        );
        // D computes the prompt itself: the client's own params go too.
        let d: Value = serde_json::from_slice(&decode_body(&req, None)).unwrap();
        assert!(d.get("kv_transfer_params").is_none(), "{d}");
    }
}
