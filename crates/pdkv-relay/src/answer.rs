//! P's answer to the proxy's one-token prefill, classified.

use serde_json::Value;

/// P's answer, read by [`PrefillAnswer::parse`].
#[derive(Clone, Debug, PartialEq)]
pub enum PrefillAnswer {
    /// A completion that was not aborted, with the `kv_transfer_params` it
    /// returned (`None` when it returned none).
    Done { params: Option<Value> },
    /// A completion whose `finish_reason` is `abort`.
    Aborted,
    /// An error status, with the OpenAI error `code` of its body if any.
    Error {
        status: u16,
        code: Option<String>,
        body: Vec<u8>,
    },
    /// A success status whose body is not a completion.
    Malformed { reason: String },
}

impl PrefillAnswer {
    /// Reads P's status and whole body.
    pub fn parse(status: u16, body: &[u8]) -> PrefillAnswer {
        if !(200..300).contains(&status) {
            let code = serde_json::from_slice::<Value>(body)
                .ok()
                .and_then(|v| v.get("error")?.get("code")?.as_str().map(str::to_string));
            return PrefillAnswer::Error {
                status,
                code,
                body: body.to_vec(),
            };
        }
        let malformed = |reason: String| PrefillAnswer::Malformed { reason };
        let mut v = match serde_json::from_slice::<Value>(body) {
            Ok(v) => v,
            Err(e) => return malformed(format!("not JSON: {e}")),
        };
        let Some(choice) = v
            .get("choices")
            .and_then(Value::as_array)
            .and_then(|c| c.first())
        else {
            return malformed("no choices".to_string());
        };
        if choice.get("finish_reason").and_then(Value::as_str) == Some("abort") {
            return PrefillAnswer::Aborted;
        }
        match v.get_mut("kv_transfer_params").map(Value::take) {
            None | Some(Value::Null) => PrefillAnswer::Done { params: None },
            Some(p @ Value::Object(_)) => PrefillAnswer::Done { params: Some(p) },
            Some(other) => malformed(format!("kv_transfer_params is not an object: {other}")),
        }
    }
}
